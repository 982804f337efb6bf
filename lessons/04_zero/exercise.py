"""Lesson 04 exercises: ZeRO's three moves by hand. Write the pieces marked EXERCISE, then run
    python lessons/04_zero/check.py                              # all exercises
    python lessons/04_zero/check.py reduce_scatter_gradients     # just one (or shard_range, sharded_adamw)
The checker runs shard_range on many sizes, and the other two on 2 and then 3 real processes (gloo), every
rank with its own gradients, with sizes that n does not divide (so padding matters). It compares what each
rank returns or holds with the answer computed in one process (the mean gradient; torch.optim.AdamW on the
whole vector) and says which rank, which chunk and which element is wrong and what that usually means
(forgot to divide by n, wrong padding, wrong chunk offset, missing all-gather, ...), and which ranks hang and
on which line of this file they wait. The lesson notebook (lessons/04_zero/04_zero.ipynb) reads picotron/zero.py,
which does the same at scale; the solutions are in solution.py
(look after trying).

The flat view (picotron/zero.py's FlatUnit): a unit's tensors, concatenated in order into one vector, padded
with zeros to n·chunk elements and cut into n equal chunks; rank r owns chunk r, elements [r·chunk, (r+1)·chunk).

What you may use (torch.distributed, `group` may be None = every rank):
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    dist.reduce_scatter_single(output, input, group=group)  input: n·chunk elements on every rank; output
                                                            (chunk elements) on rank r: the SUM over ranks of
                                                            input[r·chunk:(r+1)·chunk]
    dist.all_gather_single(output, input, group=group)      input: chunk elements; output (n·chunk) on every
                                                            rank: rank 0's input, then rank 1's, ...
(older torch calls them reduce_scatter_tensor and all_gather_into_tensor, same arguments), or, if you did
lesson 02, the same built from dist.send / dist.recv. Every rank must make the same calls in the same order.
"""
import math  # noqa: F401  (math.ceil)

import torch
import torch.distributed as dist


def shard_range(numel, n, rank):
    """EXERCISE 1. A unit of `numel` elements, seen as one flat vector padded with zeros to a multiple of n and
    cut into n EQUAL chunks. Return (lo, hi): the slice [lo, hi) of the padded flat vector that is rank `rank`'s
    chunk. Every chunk has at least one element (also when numel < n), and the n chunks together cover all
    numel elements, so the padded length is n·(hi - lo) >= numel.
    Examples: shard_range(10, 4, 0) == (0, 3); shard_range(10, 4, 3) == (9, 12): elements 10 and 11 are padding."""
    raise NotImplementedError("not written yet")


def reduce_scatter_gradients(grads, group=None):
    """EXERCISE 2 (ZeRO-2's gradient step). `grads`: this rank's gradient tensors of one unit, in order (same
    shapes on every rank, different values). Return this rank's chunk of the MEAN over the ranks of the unit's
    flat gradient, as a new 1-D tensor of `chunk` elements: concatenate the tensors in order into one flat
    vector, pad it with zeros to n·chunk elements (shard_range tells you chunk), and reduce-scatter it, so that
    rank r receives the sum of everybody's chunk r; make that sum a mean. (While checking this exercise the
    checker gives you the reference shard_range, so exercise 1 need not be done first.)"""
    raise NotImplementedError("not written yet")


class ShardedAdamW:
    """ZeRO-1's optimizer on one unit: every rank holds the whole flat parameter vector `flat` (padded, n·chunk
    elements; the model's parameters are views of it), but AdamW's two moments only for its own chunk."""

    def __init__(self, flat, group=None, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
        self.flat, self.group = flat, group
        self.lr, (self.beta1, self.beta2), self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.lo, self.hi = shard_range(flat.numel(), self.n, self.rank)
        self.exp_avg = torch.zeros(self.hi - self.lo, dtype=flat.dtype)     # 1/n of Adam's state: the saving
        self.exp_avg_sq = torch.zeros(self.hi - self.lo, dtype=flat.dtype)
        self.t = 0  # steps taken

    def step(self, grad_chunk):
        """EXERCISE 3. `grad_chunk`: this rank's chunk of the mean gradient (what exercise 2 returns). Take one
        AdamW step (torch.optim.AdamW's maths) on this rank's chunk of self.flat, elements [self.lo, self.hi),
        in place:
            t += 1
            p  = p · (1 - lr·weight_decay)                          decoupled weight decay, on the parameter
            m  = β1·m + (1 - β1)·g            v = β2·v + (1 - β2)·g²
            p  = p - lr · (m / (1 - β1^t)) / (sqrt(v / (1 - β2^t)) + eps)
        then make every rank's self.flat whole again: all-gather the updated chunks INTO self.flat (the same
        tensor: the model's parameters are views of it). The checker gives you the reference shard_range."""
        raise NotImplementedError("not written yet")
