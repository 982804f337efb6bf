"""Data parallelism: every rank holds the whole model and trains on its own part of the global batch.

After backward each rank has the gradient of ITS micro-batches. Averaging the gradients over the ranks gives
the gradient of the whole global batch, so every replica takes the same optimizer step and the replicas stay
identical, bit for bit. Nothing else is shared: no activations, no parameters. (ZeRO, next lesson, shards the
optimizer state, gradients and parameters that data parallelism keeps n copies of.)

    rank 0: forward/backward on rows 0..B/n-1   -> grads g0 \\
    rank 1: forward/backward on rows B/n..2B/n-1 -> grads g1  }-- all-reduce(mean) --> (g0+g1+...)/n everywhere
    ...                                                      /

Communication per step: one all-reduce of every gradient, Ψ elements; a ring all-reduce sends
2(n-1)/n·Ψ·bytes per rank, whatever n is. The art is to hide that time behind the backward pass:

1. `NaiveDataParallel`: a hook on each parameter all-reduces its gradient as soon as autograd has
   accumulated it, synchronously. Simple and correct, but backward stops for every message, and one message
   per parameter tensor pays the latency α hundreds of times.
2. `DataParallel(bucket_mb=0)`: the same per-parameter hooks, but the all-reduce is asynchronous: the
   communication of layer L's gradients overlaps the backward of layer L-1. Still one message per tensor.
3. `DataParallel(bucket_mb=25)`: gradients live in a few contiguous buffers ("buckets"), filled in the order
   backward produces them (the reverse of the forward order). When every gradient of a bucket is ready, ONE
   asynchronous all-reduce sends the whole bucket. Each `p.grad` is a view into its bucket, so autograd
   accumulates straight into the buffer we send: no copy on the hot path (DDP's gradient_as_bucket_view).

Gradient accumulation: with k micro-batches per step, synchronising after each one would send k times the
data for the same result. `with model.no_sync():` skips it for all but the last micro-batch; the gradients
keep adding up locally, and the last backward sends the sum once.

Before the optimizer step, `finish_gradient_sync()` waits for the outstanding all-reduces. Gradients are
averaged over the dp x cp group: context-parallel ranks hold the same parameters but see different tokens,
so their gradients must be summed too (a peer project forgot this when dp = 1).

Caveat, as in DDP: every parameter must receive a gradient in every backward pass, or its bucket never
fills and the step waits forever (here: until the process-group timeout ends it with an error).
"""
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn


class _Replicated(nn.Module):
    """What both wrappers share: the wrapped module, the group, no_sync, and a pass-through forward."""

    def __init__(self, module, mesh):
        super().__init__()
        self.module = module
        self.group = mesh.dp_cp_group
        self.size = mesh.dp_cp_size
        self.sync = True
        _broadcast_parameters(module, self.group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Backward passes inside this block accumulate gradients locally and send nothing."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous


def _broadcast_parameters(module, group):
    """Start every replica from rank 0's weights (our init is already identical: this is a safety net)."""
    src = dist.get_global_rank(group, 0)
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src=src, group=group)


class NaiveDataParallel(_Replicated):
    """All-reduce each gradient, synchronously, the moment autograd has accumulated it."""

    def __init__(self, module, mesh):
        super().__init__(module, mesh)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):
        if self.sync:
            p.grad.div_(self.size)
            dist.all_reduce(p.grad, group=self.group)  # blocks backward until this tensor is averaged

    def finish_gradient_sync(self):
        pass  # every all-reduce has already completed inside backward


class _Bucket:
    """A contiguous gradient buffer for a few parameters; each p.grad is a view into it."""

    def __init__(self, params):
        self.params = params
        p0 = params[0]
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=p0.dtype, device=p0.device)
        self.ready = 0
        self.work = None
        self.attach_views()

    def attach_views(self):
        offset = 0
        for p in self.params:
            p.grad = self.buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()


class DataParallel(_Replicated):
    """Bucketed, overlapped gradient all-reduce (bucket_mb=0: one bucket per parameter)."""

    def __init__(self, module, mesh, bucket_mb=25.0, timeline=None):
        super().__init__(module, mesh)
        self.timeline = timeline  # a metrics.Timeline: records when each bucket's all-reduce starts and ends
        self.buckets, self.bucket_of = [], {}
        params = [p for p in module.parameters() if p.requires_grad]
        current, size = [], 0
        # Backward produces gradients roughly in the reverse order of the forward pass: fill buckets that way.
        for p in reversed(params):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_mb * 2**20:
                self._add_bucket(current)
                current, size = [], 0
        if current:
            self._add_bucket(current)
        for p in params:
            p.register_post_accumulate_grad_hook(self._hook)

    def _add_bucket(self, params):
        bucket = _Bucket(params)
        self.buckets.append(bucket)
        for p in params:
            self.bucket_of[p] = bucket

    def _hook(self, p):
        bucket = self.bucket_of[p]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):  # the last gradient of this bucket just arrived
            bucket.ready = 0
            if self.sync:
                bucket.buffer.div_(self.size)
                bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
                if self.timeline is not None:
                    self._record(bucket)

    def _record(self, bucket):
        start, index = self.timeline.now(), self.buckets.index(bucket)
        mib = bucket.buffer.numel() * bucket.buffer.element_size() / 2**20
        bucket.work.get_future().then(  # runs when the all-reduce completes
            lambda _: self.timeline.add(f"all-reduce bucket {index}", start, self.timeline.now(), bucket=index, mib=mib))

    def forward(self, *args, **kwargs):
        # A new forward while buckets are still being sent would let the next backward add into buffers in
        # flight (wrong gradients, silently): finish the previous synchronisation first.
        if any(b.work is not None for b in self.buckets):
            self.finish_gradient_sync()
        return self.module(*args, **kwargs)

    def finish_gradient_sync(self):
        """Wait for every bucket's all-reduce: call after the last backward, before the optimizer step."""
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None

    def zero_grad(self, set_to_none=True):
        """Zero the buckets in place: the gradients must stay views of them (set_to_none is ignored)."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.attach_views()  # in case someone replaced a p.grad


def wrap(model, mesh, impl="bucket", bucket_mb=25.0, timeline=None):
    """The trainer's entry point: wrap `model` for data parallelism over mesh.dp_cp_group.

    impl: "naive" (synchronous per-parameter), "overlap" (asynchronous per-parameter), "bucket" (asynchronous
    buckets of bucket_mb MiB) or "ddp" (torch's DistributedDataParallel, to compare against)."""
    if impl == "naive":
        return NaiveDataParallel(model, mesh)
    if impl in ("overlap", "bucket"):
        return DataParallel(model, mesh, bucket_mb=0 if impl == "overlap" else bucket_mb, timeline=timeline)
    if impl == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model, process_group=mesh.dp_cp_group, bucket_cap_mb=bucket_mb,
                                                  gradient_as_bucket_view=True,
                                                  device_ids=[mesh.device] if mesh.device.type == "cuda" else None)
        ddp.finish_gradient_sync = lambda: None  # DDP waits for its all-reduces at the end of backward
        return ddp
    raise ValueError(f"dp impl {impl!r}; use 'naive', 'overlap', 'bucket' or 'ddp'.")
