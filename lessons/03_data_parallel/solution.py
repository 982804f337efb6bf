"""Lesson 03 exercises — reference solutions. (The exercise file, lessons/03_data_parallel/exercise.py, is the
same file with the three marked methods left to write.)"""
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn


class NaiveDP(nn.Module):
    """Data parallelism in its simplest form: average every gradient over the ranks the moment it exists."""

    def __init__(self, module, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.world_size = dist.get_world_size(group)
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self.average_gradient)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def average_gradient(self, p):
        """EXERCISE 1."""
        p.grad.div_(self.world_size)  # all-reduce sums: divide first (or after), once
        dist.all_reduce(p.grad, group=self.group)  # in place, blocking: every rank leaves with the mean


class Bucket:
    """A contiguous gradient buffer for a few parameters; each p.grad is a view into it."""

    def __init__(self, params):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.ready = 0     # how many of self.params have their gradient for the current backward
        self.work = None   # the handle of this bucket's asynchronous all-reduce, while one is in flight
        offset = 0
        for p in params:
            p.grad = self.buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()


class BucketedDP(nn.Module):
    """Gradients in buckets filled in backward order; one asynchronous all-reduce per full bucket."""

    def __init__(self, module, bucket_numel=4096, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.world_size = dist.get_world_size(group)
        self.sync = True  # False inside no_sync(): gradients accumulate locally, nothing is sent
        self.buckets, self.bucket_of, current = [], {}, []
        params = [p for p in module.parameters() if p.requires_grad]
        for p in reversed(params):  # backward produces gradients roughly from the last layer to the first
            current.append(p)
            if sum(q.numel() for q in current) >= bucket_numel:
                self._add(current)
                current = []
        if current:
            self._add(current)
        for p in params:
            p.register_post_accumulate_grad_hook(self.on_gradient_ready)

    def _add(self, params):
        bucket = Bucket(params)
        self.buckets.append(bucket)
        for p in params:
            self.bucket_of[p] = bucket

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad(self, set_to_none=True):
        for bucket in self.buckets:
            bucket.buffer.zero_()

    def on_gradient_ready(self, p):
        """EXERCISE 2 (a)."""
        bucket = self.bucket_of[p]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):  # the last gradient of this bucket just arrived
            bucket.ready = 0  # ready for the next backward pass
            if self.sync:
                bucket.buffer.div_(self.world_size)
                bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)  # do not wait

    def finish_sync(self):
        """EXERCISE 2 (b)."""
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None

    @contextmanager
    def no_sync(self):
        """EXERCISE 3."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous  # the previous value, not True: no_sync blocks may nest


# ------------------------------------------------------------------------- EXERCISE 4: the bucket-size puzzle
CANDIDATES_MB = (0, 0.0625, 0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256)


def exposed_time(grad_bytes, backward_s, bucket_bytes, bandwidth, latency, n):
    """EXERCISE 4 (a)."""
    total, done, size, link_free = sum(grad_bytes), 0, 0, 0.0
    for i, nbytes in enumerate(grad_bytes):
        done, size = done + nbytes, size + nbytes
        if size >= bucket_bytes or i == len(grad_bytes) - 1:  # the bucket is full (or the last one): send it
            ready = backward_s * done / total
            link_free = max(ready, link_free) + latency + 2 * (n - 1) / n * size / bandwidth  # queued behind the last
            size = 0
    return max(0.0, link_free - backward_s)


def best_bucket_mb(grad_bytes, backward_s, bandwidth, latency, n, candidates=CANDIDATES_MB):
    """EXERCISE 4 (b)."""
    return min(candidates, key=lambda mb: exposed_time(grad_bytes, backward_s, mb * 2**20, bandwidth, latency, n))
