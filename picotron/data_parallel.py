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

Before the optimizer step, `finish_sync()` waits for the outstanding all-reduces. Gradients are
averaged over the dp x cp group: context-parallel ranks hold the same parameters but see different tokens,
so their gradients must be summed too (a peer project forgot this when dp = 1).

Every wrapper here (and ZeRO's) speaks one small protocol, `GradSync`: the sync starts by itself during the
last backward, `finish_sync()` waits for it, `no_sync()` accumulates without syncing, `memory()` says what it
keeps. At dp = 1 the trainer still wraps the model, in `Local`, which does nothing: the step loop never asks
which strategy is on. The collectives go through the dp x cp `Axis` the wrapper receives.

Experts (expert parallelism) are the exception: each rank holds only some experts, and the copies of one expert
sit on the mesh's `edp` axis. `axis_of(p)` (from the parameter placements, `marks.sync_axis`) says which axis a
gradient is summed over; buckets never mix axes. Whatever the axis, the sum is divided by the dp x cp size: an
expert's gradient already holds the tokens of every rank of its ep group (the all-to-all brought them), so
summed over edp it covers the whole global batch, which dp x cp ranks shared.

Caveat, as in DDP: every parameter must receive a gradient in every backward pass, or its bucket never
fills and the step waits forever (here: until the process-group timeout ends it with an error).
"""
from contextlib import contextmanager

import torch
from torch import nn

from picotron import marks


class GradSync(nn.Module):
    """The protocol every gradient-sync wrapper follows (the step engine uses nothing else).

    forward(...)        the wrapped module's forward
    no_sync()           backward passes inside accumulate locally and send nothing
    finish_sync()       after the last backward: wait until every gradient is synchronised
    zero_grad()         drop (or zero) the gradients for the next step
    memory()            bytes of parameters and gradients this rank keeps: {"params": .., "grads": .., ...}
    optimizer_groups()  (parameters with weight decay, without): what the optimizer updates on this rank
    tied_grads()        the gradients of this rank's ends of an embedding tied across pipeline stages, as this
                        wrapper holds them (whole here; ZeRO: this rank's shards), for pipeline_parallel.sync_tied

    `self.stages` is what the wrapped model holds (model.Stages: its chunks, their pipeline stages, the tied
    pair), read once from `module.stages()`: the one thing wrappers and the pipeline executor read of a model
    (a whole Llama and a pipeline stage both answer it). `self.sync` is False inside no_sync(): a wrapper's
    gradient hooks read it (ZeRO-2/3 reduce-scatter anyway). Wrapping gives every parameter its placement
    again (picotron.marks.attach: the records kept on the modules), since the wrappers read them.
    """

    def __init__(self, module):
        super().__init__()
        self.module = marks.attach(module)
        self.stages = module.stages()
        self.sync = True

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

    def finish_sync(self):
        pass

    def memory(self):
        params = list(self.module.parameters())
        return {"params": sum(p.nbytes for p in params),
                "grads": sum(p.grad.nbytes for p in params if p.grad is not None), "optimizer": 0}

    def optimizer_groups(self):
        params = [p for p in self.module.parameters() if p.requires_grad]
        return [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]

    def tied_grads(self):
        return [p.grad for p in self.stages.tied_params(self.module)]


class Local(GradSync):
    """Nothing to synchronise: one replica (dp x cp = 1)."""


class _Replicated(GradSync):
    """What the data-parallel wrappers share: the axis (dp x cp), start from rank 0's weights."""

    def __init__(self, module, axis, axis_of=None):
        super().__init__(module)
        self.axis = axis  # dp x cp: the gradients are divided by its size
        self.axis_of = axis_of or (lambda p: axis)  # where each gradient is summed (experts: edp)
        for p in module.parameters():  # a safety net: our init is identical
            self.axis_of(p).broadcast(p.data)
        for t in module.buffers():
            axis.broadcast(t.data)


def buckets(params, bucket_mb):
    """Group `params` into lists of about bucket_mb MiB, in the order backward produces their gradients
    (roughly the reverse of the forward); bucket_mb=0: one parameter per bucket. Shared with ZeRO-1/2."""
    out, current, size = [], [], 0
    for p in reversed(list(params)):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_mb * 2**20:
            out.append(current)
            current, size = [], 0
    if current:
        out.append(current)
    return out


class NaiveDataParallel(_Replicated):
    """All-reduce each gradient, synchronously, the moment autograd has accumulated it."""

    def __init__(self, module, axis, axis_of=None):
        super().__init__(module, axis, axis_of)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):
        if self.sync:
            p.grad.div_(self.axis.size)
            self.axis_of(p).all_reduce(p.grad)  # blocks backward until this tensor is averaged


class _Bucket:
    """A contiguous gradient buffer for a few parameters; each p.grad is a view into it."""

    def __init__(self, params, index, axis):
        self.params, self.index, self.axis = params, index, axis
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

    def __init__(self, module, axis, bucket_mb=25.0, axis_of=None):
        super().__init__(module, axis, axis_of)
        params = [p for p in module.parameters() if p.requires_grad]
        by_axis = {}  # buckets never mix axes
        for p in params:
            by_axis.setdefault(self.axis_of(p), []).append(p)
        groups = [(a, ps) for a, group in by_axis.items() for ps in buckets(group, bucket_mb)]
        self.buckets = [_Bucket(ps, i, a) for i, (a, ps) in enumerate(groups)]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        for p in params:
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):
        if not self.sync:  # under no_sync the gradients only add up; only a synced backward counts arrivals
            return
        bucket = self.bucket_of[p]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):  # the last gradient of this bucket just arrived
            bucket.ready = 0
            bucket.buffer.div_(self.axis.size)
            mib = bucket.buffer.numel() * bucket.buffer.element_size() / 2**20
            bucket.work = bucket.axis.all_reduce(bucket.buffer, async_op=True, label=f"all-reduce bucket {bucket.index}",
                                               bucket=bucket.index, mib=mib)

    def forward(self, *args, **kwargs):
        # A new forward while buckets are still being sent would let the next backward add into buffers in
        # flight (wrong gradients, silently): finish the previous synchronisation first.
        if any(b.work is not None for b in self.buckets):
            self.finish_sync()
        return self.module(*args, **kwargs)

    def finish_sync(self):
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


class TorchDDP(GradSync):
    """torch's DistributedDataParallel behind the same protocol, to compare against (--dp-impl ddp)."""

    def __init__(self, module, axis, bucket_mb=25.0):
        super().__init__(module)
        device = next(module.parameters()).device
        self.ddp = nn.parallel.DistributedDataParallel(module, process_group=axis.group, bucket_cap_mb=bucket_mb,
                                                       gradient_as_bucket_view=True,
                                                       device_ids=[device] if device.type == "cuda" else None)

    def forward(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)

    def no_sync(self):
        return self.ddp.no_sync()  # (DDP waits for its all-reduces at the end of backward: finish_sync has nothing to do)


def wrap(model, axis, impl="bucket", bucket_mb=25.0, axis_of=None):
    """Wrap `model` for data parallelism over `axis` (the mesh's dp_cp axis); one replica: `Local`.
    `axis_of(p)`: the axis to sum p's gradient over when it is not `axis` (experts: the mesh's edp).

    impl: "naive" (synchronous per-parameter), "overlap" (asynchronous per-parameter), "bucket" (asynchronous
    buckets of bucket_mb MiB) or "ddp" (torch's DistributedDataParallel, to compare against)."""
    if axis.size == 1:
        return Local(model)
    if impl == "naive":
        return NaiveDataParallel(model, axis, axis_of)
    if impl in ("overlap", "bucket"):
        return DataParallel(model, axis, bucket_mb=0 if impl == "overlap" else bucket_mb, axis_of=axis_of)
    if impl == "ddp":
        return TorchDDP(model, axis, bucket_mb=bucket_mb)
    raise ValueError(f"dp impl {impl!r}; use 'naive', 'overlap', 'bucket' or 'ddp'.")
