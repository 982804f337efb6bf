"""Lesson 05 exercises: Megatron's tensor parallelism by hand, a puzzle, ZeRO-R's partitioned checkpoint, and async
TP's ring order (exercise 6, checked in one process). Write
the pieces marked EXERCISE, then
    ./run.sh python lessons/05_tensor_parallel/check.py                          # all exercises
    ./run.sh python lessons/05_tensor_parallel/check.py parallel_mlp             # just one (or f_and_g, vocab_parallel_cross_entropy, plan, partition, ring)
The checker runs each exercise on 2 and then 4 real processes (gloo), gives every rank its slice of the same
full weights or logits, and compares what every rank computes, outputs AND gradients, with the unsharded
computation done in one process. It says which rank and which tensor is wrong and what that usually means (a
missing all-reduce in backward, a sum taken twice, a partial sum, each rank's own maximum, ...), counts your
all-reduces against Megatron's pattern, and names the ranks that hang and the line of this file where they
wait. The lesson notebook (lessons/05_tensor_parallel/05_tensor_parallel.ipynb) reads picotron/tensor_parallel.py, which does the
same for the whole model; the solutions are in solution.py
(look after trying).

What you may use (torch.distributed; `group` may be None = every rank):
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)   every rank's `t` becomes the sum over the ranks
                                                            (op=dist.ReduceOp.MAX: the maximum), IN PLACE
    F.linear(x, w) = x @ w.T                                 (w: [out_features, in_features])
A torch.autograd.Function has `forward(ctx, *inputs)`, computing the output, and `backward(ctx, grad_output)`,
returning one gradient per input of forward: the gradient of the loss with respect to that input, or None for
an input that is not a differentiable tensor (like `group`). Call it as CopyToTP.apply(x, group). Inside
forward autograd is off; `ctx.group = group` keeps what backward needs. Every rank must make the same
collective calls, in the same order.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: F401  (F.linear, F.silu)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/
import _common  # noqa: E402,F401  (exercise 4: _common.load_lesson("05_tensor_parallel"))


class CopyToTP(torch.autograd.Function):
    """EXERCISE 1a: Megatron's f, where a tensor-parallel region begins (before column-parallel layers).

    Forward: x is already the same on every rank; return it unchanged.
    Backward: each rank computed with its own slice of the weights, so its gradient of x holds only the part
    that flowed through that slice. The gradient of x is the SUM of these parts over the ranks: all-reduce it."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("not written yet")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("not written yet")


class ReduceFromTP(torch.autograd.Function):
    """EXERCISE 1b: Megatron's g, where a tensor-parallel region ends (after a row-parallel layer).

    Forward: x is this rank's partial sum of the output; return the sum over the ranks (every rank gets it).
    Do not change x itself: all-reduce a copy.
    Backward: the output is the same on every rank and so is its gradient; each rank's partial sum
    contributed to it with weight 1: return the gradient unchanged."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("not written yet")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("not written yet")


def parallel_mlp(x, gate_w, up_w, down_w, group=None):
    """EXERCISE 2: the Megatron MLP (SwiGLU, as in picotron/model.py: down(silu(gate(x)) * up(x))).

    x: [b, s, h], the same on every rank. gate_w, up_w: [i/n, h], this rank's rows of the gate and up
    projections (column-parallel: its slice of the i intermediate features); down_w: [h, i/n], this rank's
    columns of the down projection (row-parallel: the columns that read its slice). Return the full output
    [b, s, h], the same on every rank, such that backward gives x and every weight slice its right gradient.

    Column then row: silu and the product are elementwise, so each rank can apply them to its own slice of
    the intermediate features; nothing needs to be exchanged in between. Use f (CopyToTP.apply(x, group)) ONCE,
    before gate and up, and g (ReduceFromTP.apply(y, group)) ONCE, after down: one all-reduce forward and one
    backward. (While checking this exercise the checker gives you its own CopyToTP and ReduceFromTP, so
    exercise 1 need not be done first.)"""
    raise NotImplementedError("not written yet")


def vocab_parallel_cross_entropy(logits, targets, group=None):
    """EXERCISE 3: the cross-entropy of logits split over the vocabulary, without ever gathering them.

    logits: [T, n_vocab/n] (T tokens, n ranks in the group), this rank's columns: the logits of vocabulary ids
    [lo, lo + n_vocab/n), lo = rank·n_vocab/n.
    targets: [T], the target ids (global: 0 <= target < n_vocab).
    Return (losses, softmax): losses [T], the per-token cross-entropy over the WHOLE vocabulary,
    -log softmax(z)[target] = log Σ_u exp(z_u - row_max) - (z_target - row_max), the same on every rank;
    softmax [T, n_vocab/n], this rank's columns of softmax(z). Three all-reduces of T numbers each:
        row_max    the maximum of each row over the whole vocabulary (each rank's row max, all-reduced with MAX);
                   subtracting it keeps exp from overflowing
        sum_exp    Σ_u exp(z_u - row_max): each rank's partial sums, all-reduced
        z_target   only the rank whose columns hold a row's target has its logit; the others contribute 0
                   to an all-reduced sum
    The given VocabParallelCrossEntropy below calls this in its forward and does the backward
    (softmax - one_hot(target), on this rank's columns). Autograd is off in here: no need to be careful."""
    raise NotImplementedError("not written yet")


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Given (not an exercise): the loss as an autograd Function around exercise 3. d loss / d z_u =
    softmax_u - [u == target]; each rank has its own columns of the softmax, so backward needs no
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
    """EXERCISE 4, a puzzle: the fastest layout that fits a memory budget.

    The job: train the lesson's 'small' model (lesson.puzzle_model(): 8 heads, 4 KV heads, 3.3 M parameters) on
    global batches of lesson.PUZZLE["global_batch"] = 8 sequences of lesson.PUZZLE["seq_len"] = 128 tokens, fp32,
    AdamW, no data parallelism. You choose
        tp                 the tensor-parallel degree, one the model allows (lesson.valid_tps(mc))
        sp                 sequence parallelism, on top of tp > 1
        micro_batch_size   b, a divisor of 8: each step accumulates 8 / b micro-batches (the same training)
    No rank may hold more than budget_mib MiB (2**20 bytes): its model states (lesson.rank_state_bytes(mc, tp),
    params + grads + optimizer) plus the activations autograd keeps for backward (lesson.activation_bytes(mc,
    seq_len, micro_batch_size, tp, sp): the lesson measured both exactly). Think about how many micro-batches'
    activations are alive at once.

    Fastest, from what section 4 measured: (1) the fewest tp ranks: tp's collectives block every layer, and
    the ranks tp does not need can run data-parallel replicas; (2) then the largest micro-batch: fewer, larger
    matmuls; (3) then sp off: it moves the same bytes in twice the calls, so use it only when it is what makes
    a layout fit. Return (tp, sp, micro_batch_size), or None when nothing fits.
    The checker asks for six budgets, most hiding a trap, and runs the layouts that need tp > 1 for one real
    step on tp processes: their measured bytes per rank must fit."""
    lesson = _common.load_lesson("05_tensor_parallel")  # noqa: F841  (this folder's experiment.py: its formulas)
    raise NotImplementedError("not written yet")


# ------------------------------------------------------------------------ exercise 5: partitioned checkpoints
def keep_my_piece(x, group=None):
    """EXERCISE 5a: ZeRO-R's partitioned checkpoint, the forward half (section 10).

    x: [b, s, h], a layer's input, the same on every rank of the tp group. Return this rank's piece: the columns
    [r·h/n, (r+1)·h/n) of the LAST (hidden) dimension, r = dist.get_rank(group), n = dist.get_world_size(group).
    The piece must be a tensor of its own: a view of x (a slice, or .chunk) keeps x's whole storage alive, and
    then nothing is saved. No communication."""
    raise NotImplementedError("not written yet")


def rebuild_input(piece, group=None):
    """EXERCISE 5b: the backward half: every rank's piece [b, s, h/n] -> the whole [b, s, h], on every rank.

    One all-gather. dist.all_gather(parts, piece, group=group) fills the list `parts` (n tensors shaped like
    piece, e.g. [torch.empty_like(piece) for _ in range(n)]) with every rank's piece, in rank order; put them back
    where they came from. (dist.all_gather_into_tensor(out, t, group=group) concatenates along dim 0 instead.)"""
    raise NotImplementedError("not written yet")


# ------------------------------------------------------------------------ exercise 6: async TP's ring order
def ring_steps(rank, n):
    """EXERCISE 6: the order of an all-gather-matmul's ring (section 11, picotron/async_tp.py).

    n ranks each hold one chunk of the sequence: rank r holds chunk r. At every step a rank multiplies the chunk it
    holds while passing that chunk on to its RIGHT neighbour and receiving the next one from its LEFT neighbour
    (ranks r + 1 and r - 1, around the ring: mod n). After n steps every rank has multiplied every chunk once; the
    last step passes nothing on (every chunk has arrived: n - 1 messages).
    Return one tuple per step i = 0 .. n-1: (the chunk rank `rank` multiplies at step i, the rank it sends to, the
    rank it receives from), the last two None at the last step. E.g. ring_steps(0, 2) == [(0, 1, 1), (1, None, None)].
    No communication: the order alone."""
    raise NotImplementedError("not written yet")
