"""Lesson 05 exercises — reference solutions. (The exercise file, lessons/05_tensor_parallel/exercise.py, is the
same file with the marked pieces left to write.)"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/
import _common  # noqa: E402


class CopyToTP(torch.autograd.Function):
    """EXERCISE 1a: f, identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x  # already the same on every rank

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()  # autograd may still use `grad` elsewhere: sum a copy
        dist.all_reduce(grad, group=ctx.group)  # each rank's part came through its own slice: add them up
        return grad, None  # one gradient per forward input; none for the group


class ReduceFromTP(torch.autograd.Function):
    """EXERCISE 1b: g, all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()  # all_reduce works in place: never change the caller's tensor
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None  # every rank already holds the whole gradient of the (replicated) output


def parallel_mlp(x, gate_w, up_w, down_w, group=None):
    """EXERCISE 2."""
    x = CopyToTP.apply(x, group)  # once, for both column-parallel layers: ONE all-reduce of x's gradient
    h = F.silu(F.linear(x, gate_w)) * F.linear(x, up_w)  # this rank's i/n intermediate features, no exchange
    return ReduceFromTP.apply(F.linear(h, down_w), group)  # partial sums of the output, summed once


def vocab_parallel_cross_entropy(logits, targets, group=None):
    """EXERCISE 3."""
    v_local = logits.shape[-1]
    lo = dist.get_rank(group) * v_local
    m = logits.max(dim=-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)  # the max over the whole vocabulary
    exp = (logits - m[:, None]).exp()
    sum_exp = exp.sum(dim=-1)
    dist.all_reduce(sum_exp, group=group)  # the denominator covers every rank's columns
    inside = (targets >= lo) & (targets < lo + v_local)  # the rows whose target is one of my columns
    local = (targets - lo).masked_fill(~inside, 0)  # global id -> my column (0 where not mine: masked below)
    target_logit = (logits.gather(1, local[:, None]).squeeze(1) - m).masked_fill(~inside, 0.0)
    dist.all_reduce(target_logit, group=group)  # exactly one rank contributes each row's target logit
    return sum_exp.log() - target_logit, exp / sum_exp[:, None]


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Given (not an exercise): the loss as an autograd Function around exercise 3. d loss / d z_v =
    softmax_v - [v == target]; each rank has its own columns of the softmax, so backward needs no
    communication."""

    @staticmethod
    def forward(ctx, logits, targets, group):
        losses, softmax = vocab_parallel_cross_entropy(logits, targets, group)
        lo = dist.get_rank(group) * logits.shape[-1]
        inside = (targets >= lo) & (targets < lo + logits.shape[-1])
        ctx.save_for_backward(softmax, (targets - lo).masked_fill(~inside, 0), inside)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        softmax, local, inside = ctx.saved_tensors
        grad = softmax.clone()
        grad[torch.arange(len(local)), local] -= inside.to(grad.dtype)
        return grad * grad_losses[:, None], None, None


def plan(budget_mib):
    """EXERCISE 4: every layout the job allows, kept if it fits; the fastest of those by the puzzle's ranking."""
    lesson = _common.load_lesson("05_tensor_parallel")
    mc, batch, seq = lesson.puzzle_model(), lesson.PUZZLE["global_batch"], lesson.PUZZLE["seq_len"]
    fits = []
    for tp in lesson.valid_tps(mc):
        states = sum(lesson.rank_state_bytes(mc, tp).values())
        for sp in (False, True) if tp > 1 else (False,):
            for b in [b for b in range(1, batch + 1) if batch % b == 0]:
                # one micro-batch's activations: accumulation frees each one's in its backward
                if states + lesson.activation_bytes(mc, seq, b, tp, sp) <= budget_mib * 2**20:
                    fits.append((tp, -b, sp))  # sorts as: fewest tp ranks, largest micro-batch, sp off
    if not fits:
        return None
    tp, minus_b, sp = min(fits)
    return tp, sp, -minus_b


# ------------------------------------------------------------------------ exercise 5: partitioned checkpoints
def keep_my_piece(x, group=None):
    """EXERCISE 5a: this rank's hidden columns of the layer input, a copy (a view would keep all of x alive)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(n, dim=-1)[r].clone()


def rebuild_input(piece, group=None):
    """EXERCISE 5b: all-gather every rank's columns and put them side by side, rank 0's first."""
    parts = [torch.empty_like(piece) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, piece.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def ring_steps(rank, n):
    """EXERCISE 6: the all-gather-matmul's ring order."""
    right, left = (rank + 1) % n, (rank - 1) % n
    steps = []
    for i in range(n):
        chunk = (rank - i) % n  # what arrived from the left i steps ago: my own chunk at step 0
        last = i == n - 1  # everything has arrived: nothing left to pass on
        steps.append((chunk, None if last else right, None if last else left))
    return steps
