"""Lesson 03 exercises: data parallelism from autograd hooks. Write the methods marked EXERCISE, then run
    ./run.sh python lessons/03_data_parallel/check.py                          # all exercises
    ./run.sh python lessons/03_data_parallel/check.py average_gradient         # just one (on_gradient_ready, no_sync, bucket_size)
The checker starts 2 and then 3 real processes (gloo), gives every rank its own batch, runs your class and
compares each rank's gradients with the mean of all ranks' gradients computed in one process. It says which
rank and which parameter is wrong and by how much (and what that usually means), which ranks hang and on
which line of this file they wait, and whether your all-reduces overlap the backward pass. The lesson notebook
(lessons/03_data_parallel/03_data_parallel.ipynb, section 3) reads picotron's version of the same code; the solutions are in solution.py
(look after trying).

What you may use: torch.distributed's all_reduce (dist.all_reduce(tensor, group=self.group) sums `tensor` in
place over the group; with async_op=True it returns at once with a work handle whose .wait() blocks until the
result is there), and self.world_size.

Exercise 4 is a puzzle with no processes in it: on a given link, which bucket size leaves the least communication
after backward? Write the overlap model yourself (exposed_time), then use it (best_bucket_mb). The checker compares
your numbers with the lesson's model on a few links, then trains with your choice over an emulated link (notebook,
section 4(c)) and measures what it leaves to wait for.
"""
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
        """EXERCISE 1. Autograd calls this during backward, as soon as p.grad holds THIS rank's gradient of p.
        Replace p.grad, in place, by the mean of p.grad over the ranks of self.group. Synchronously: when this
        returns, every rank holds the same averaged p.grad."""
        raise NotImplementedError("not written yet")


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
        """EXERCISE 2 (a). Autograd calls this when p.grad (a view into the buffer of self.bucket_of[p]) has
        received this backward pass's gradient. Count it in its bucket. When it is the bucket's last one: reset
        the count (the next backward pass counts again) and, unless self.sync is False (inside no_sync), start
        ONE asynchronous all-reduce of the whole bucket buffer that leaves the MEAN on every rank; keep its
        handle in bucket.work. Do not wait for it: backward goes on computing while the bucket travels."""
        raise NotImplementedError("not written yet")

    def finish_sync(self):
        """EXERCISE 2 (b). Called after the last backward pass, before the optimizer step: wait until every
        bucket's all-reduce has completed, and forget the handles (bucket.work = None)."""
        raise NotImplementedError("not written yet")

    @contextmanager
    def no_sync(self):
        """EXERCISE 3. Inside `with model.no_sync():` backward passes send nothing (on_gradient_ready reads
        self.sync): the gradients keep adding up in the buckets, and the first backward after the block
        sends the accumulated sum once. On leaving the block, restore synchronisation as it was before it,
        also when the block raises an exception, and also when no_sync blocks are nested."""
        raise NotImplementedError("not written yet")
        yield


# ------------------------------------------------------------------------- EXERCISE 4: the bucket-size puzzle
CANDIDATES_MB = (0, 0.0625, 0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256)


def exposed_time(grad_bytes, backward_s, bucket_bytes, bandwidth, latency, n):
    """EXERCISE 4 (a). Seconds of gradient communication still running after backward ends, on one link:

    - grad_bytes lists the gradient tensors' sizes in bytes, in the order backward produces them; backward lasts
      backward_s seconds, spread over the tensors in proportion to their bytes (the tensor that brings the
      running total to D of all T bytes is ready at backward_s * D / T);
    - buckets fill in that order and close as soon as they hold at least bucket_bytes (0: one bucket per
      tensor); whatever is left at the end is the last bucket; a bucket is ready when its last tensor is;
    - a bucket's ring all-reduce over n ranks takes latency + 2(n-1)/n * bytes / bandwidth on the link;
    - the link carries one all-reduce at a time: a bucket's starts when it is ready AND the previous one is done.
    Return how long after backward_s the last all-reduce ends (0 if it ends before)."""
    raise NotImplementedError("not written yet")


def best_bucket_mb(grad_bytes, backward_s, bandwidth, latency, n, candidates=CANDIDATES_MB):
    """EXERCISE 4 (b). The bucket size in MiB, one of `candidates`, that gives the shortest step on this link.
    (The compute does not depend on the bucket size; only the exposed communication does. Ties: any of them.)"""
    raise NotImplementedError("not written yet")
