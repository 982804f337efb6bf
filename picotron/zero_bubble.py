"""Zero-bubble autograd (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): a backward cut in two.

A linear layer's backward computes two things: the gradient of its input, gW (which the previous pipeline
stage waits for), and the gradient of its weight, gᵀx (which nobody waits for). The split schedules (ZB-H1,
ZB-V, DualPipe in picotron.pipeline_schedules) run B, the input gradients only, as soon as they can, and W, the
weight gradients, later, where a stage would otherwise sit idle. `defer_weight_grads` routes every linear layer of a
module through a `WeightGradStore`; the executor (picotron.pipeline_parallel.Pipeline) sets `store.deferring`
around a B, `collect`s what it stashed under the micro-batch's key, and `flush`es that key at its W. Outside
a B (any other backward) a weight gradient is computed at once, as usual.
"""
from collections import defaultdict
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from picotron.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class WeightGradStore:
    """Split schedules (ZB-H1, ZB-V, DualPipe): during B, every linear layer computes only the gradient of its input
    and stashes (input, output gradient); W later turns them into weight gradients, dW = gᵀx, accumulated by
    autograd (so the gradient-sync hooks fire as for any gradient). Norm and embedding weights, cheap, get
    theirs in B. The weight enters the B graph detached: autograd must not even visit its accumulator there
    (its post-accumulate hooks, which data parallelism counts, fire even for a None gradient)."""

    def __init__(self):
        self.deferring = False
        self.stash = []  # (weight, x, grad_out) of the current B
        self.queues = defaultdict(list)  # (mb, chunk) -> stashed items, waiting for their W

    def linear(self, x, weight):
        return _DeferredLinear.apply(x, weight.detach(), (weight,), self)

    def take(self, items):
        """Weight gradients [(weight, x, grad_out), ...] computed elsewhere (async TP's collective matmuls, which
        compute their input gradients in their own rings): stashed during a B, accumulated now otherwise."""
        if self.deferring:
            self.stash.extend(items)
        else:
            _accumulate(items)

    def collect(self, key):
        self.queues[key], self.stash = self.stash, []

    def flush(self, key):
        """Compute and accumulate the weight gradients of (mb, chunk)'s B."""
        _accumulate(self.queues.pop(key, []))


def _accumulate(items):
    """Weight gradients gᵀx of stashed (weight, x, g), accumulated into .grad by autograd (hooks fire)."""
    if items:
        with torch.enable_grad():
            dummies = [_WeightGrad.apply(w, x, g) for w, x, g in items]
        torch.autograd.backward(dummies, [torch.ones((), device=d.device) for d in dummies])


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, detached, boxed, store):
        ctx.save_for_backward(x)
        # the Parameter itself, inside a tuple so that autograd draws no edge to it (a saved copy of it would
        # also accumulate elsewhere)
        (ctx.weight,), ctx.store = boxed, store
        return F.linear(x, detached)

    @staticmethod
    def backward(ctx, grad_out):
        (x,), weight = ctx.saved_tensors, ctx.weight
        grad_x = grad_out @ weight.to(grad_out.dtype)
        item = (weight, x.detach(), grad_out.detach())
        if ctx.store.deferring:
            ctx.store.stash.append(item)
        else:  # a backward outside a split schedule: the weight gradient now
            _accumulate([item])
        return grad_x, None, None, None


def _weight_grad(x, grad_out, weight):
    g = grad_out.reshape(-1, grad_out.shape[-1])
    return (g.t() @ x.reshape(-1, x.shape[-1]).to(g.dtype)).to(weight.dtype)


class _WeightGrad(torch.autograd.Function):
    """A zero-size output whose backward hands `weight` its gradient gᵀx: lets autograd accumulate it."""

    @staticmethod
    def forward(ctx, weight, x, grad_out):
        ctx.x, ctx.grad_out, ctx.weight = x, grad_out, weight  # plain references: used once, then dropped
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return _weight_grad(ctx.x, ctx.grad_out, ctx.weight), None, None


def defer_weight_grads(module, store):
    """Route every linear layer of `module` through `store` (plain nn.Linear, and tensor parallelism's
    layers, which call their `matmul`)."""
    for m in module.modules():
        if type(m) is nn.Linear:
            m.forward = partial(lambda mod, x: store.linear(x, mod.weight), m)
        elif isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            m.matmul = store.linear
            m.weight_grads = store  # async TP's collective matmuls hand their weight gradients to it (`take`)
