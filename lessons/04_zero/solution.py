"""Lesson 04 exercises — reference solutions. (The exercise file, lessons/04_zero/exercise.py, is the same file
with the three marked pieces left to write.)"""
import math

import torch
import torch.distributed as dist


def shard_range(numel, n, rank):
    """EXERCISE 1."""
    chunk = max(1, math.ceil(numel / n))  # round UP: n equal chunks cover every element; the rest is padding
    return rank * chunk, (rank + 1) * chunk


def reduce_scatter_gradients(grads, group=None):
    """EXERCISE 2."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    numel = sum(g.numel() for g in grads)
    lo, hi = shard_range(numel, n, rank)
    flat = torch.zeros(n * (hi - lo), dtype=grads[0].dtype, device=grads[0].device)  # zeros: the padding adds 0
    offset = 0
    for g in grads:  # in order: the flat layout every rank agrees on
        flat[offset:offset + g.numel()].copy_(g.reshape(-1))
        offset += g.numel()
    flat.div_(n)  # the sum over ranks becomes the mean (divide once, before or after)
    out = torch.empty(hi - lo, dtype=flat.dtype, device=flat.device)
    dist.reduce_scatter_single(out, flat, group=group)  # rank r receives the sum of everybody's chunk r
    return out


class ShardedAdamW:
    """ZeRO-1's optimizer on one unit: every rank holds the whole flat parameter vector, but Adam's moments
    only for its own chunk; it updates that chunk, then all ranks exchange their updated chunks."""

    def __init__(self, flat, group=None, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
        self.flat, self.group = flat, group
        self.lr, (self.beta1, self.beta2), self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.lo, self.hi = shard_range(flat.numel(), self.n, self.rank)
        self.exp_avg = torch.zeros(self.hi - self.lo, dtype=flat.dtype)     # 1/n of Adam's state: the saving
        self.exp_avg_sq = torch.zeros(self.hi - self.lo, dtype=flat.dtype)
        self.t = 0

    def step(self, grad_chunk):
        """EXERCISE 3."""
        self.t += 1
        p = self.flat[self.lo:self.hi]  # a view: updating it in place updates self.flat
        p.mul_(1 - self.lr * self.weight_decay)  # decoupled weight decay (AdamW), on the parameter itself
        self.exp_avg.mul_(self.beta1).add_(grad_chunk, alpha=1 - self.beta1)
        self.exp_avg_sq.mul_(self.beta2).addcmul_(grad_chunk, grad_chunk, value=1 - self.beta2)
        bias1, bias2 = 1 - self.beta1 ** self.t, 1 - self.beta2 ** self.t
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(self.eps)
        p.addcdiv_(self.exp_avg, denom, value=-self.lr / bias1)
        # every rank's updated chunk to every rank, into the flat vector itself (the input is a copy: it must
        # not be overwritten while it is being sent)
        dist.all_gather_single(self.flat, p.clone(), group=self.group)
