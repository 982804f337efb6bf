"""Lesson 04 exercises: ZeRO's three moves by hand, two improvements to ZeRO-3, and a puzzle. Write the pieces
marked EXERCISE, then run
    ./run.sh python lessons/04_zero/check.py                      # all exercises
    ./run.sh python lessons/04_zero/check.py keep_last_layer      # just one: shard_range, reduce_scatter_gradients,
                                                                  # sharded_adamw, keep_last_layer, bf16_gather, plan,
                                                                  # pp_traffic, hsdp_groups, owner_of
The checker runs shard_range on many sizes, and exercises 2 to 5 on 2 and then 3 real processes (gloo), with
sizes that n does not divide (so padding matters). It compares what each rank returns or holds with the answer
computed another way — in one process (the mean gradient; torch.optim.AdamW on the whole vector), or with the
plain picotron.zero3.Zero3 beside yours, every all-gather counted by a metrics.Recorder — and says which rank,
chunk, element or unit is wrong and what that usually means (forgot to divide by n, wrong chunk offset, chunks
never all-gathered, the last layer still gathered twice, an fp32 all-gather, ...), and which ranks hang on which
line of this file. Exercise 6 is checked against the lesson's formulas and by one training step of your plan on 2
ranks; exercise 7 (ZeRO with a pipeline) and exercise 8 (HSDP's groups) on many sizes in one process. The notebook (lessons/04_zero/04_zero.ipynb) reads picotron/zero.py and zero3.py, which do the same at
scale; the solutions are in solution.py (look after trying).

The flat view (picotron/zero.py's FlatUnit): a unit's tensors, concatenated in order into one vector, padded
with zeros to n·chunk elements and cut into n equal chunks; rank r owns chunk r, elements [r·chunk, (r+1)·chunk).

What you may use (torch.distributed, `group` may be None = every rank):
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    dist.reduce_scatter_tensor(output, input, group=group)  input: n·chunk elements on every rank; output
                                                            (chunk elements) on rank r: the SUM over ranks of
                                                            input[r·chunk:(r+1)·chunk]
    dist.all_gather_into_tensor(output, input, group=group) input: chunk elements; output (n·chunk) on every
                                                            rank: rank 0's input, then rank 1's, ...
(torch 2.13 renamed them reduce_scatter_single and all_gather_single, same arguments; the names above still work
there, with a deprecation warning), or, if you did lesson 02, the same built from dist.send / dist.recv. Every
rank must make the same calls in the same order.
"""
import math
from functools import partial

import torch
import torch.distributed as dist

from picotron import planner, zero3
from picotron.model import ModelConfig

_ = math.ceil, partial, planner  # what your answers may need (exercises 1, 4 and 6)


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


# ------------------------------------------------------------------------ exercises 4 and 5: ZeRO-3, cheaper
# Both are subclasses of picotron.zero3.Zero3 (read it first: the notebook's section 3 shows its hooks). A unit
# (the root, or one layer) is in one of three states: "free" (its flat buffer unit.full has 0 bytes),
# "gathering" (an all-gather into unit.full is in flight: unit.work) or "gathered". self._gather(unit) starts
# the all-gather of a free unit, self._wait(unit) waits for it, self._free(unit) gives the memory back.
# self.units[0] is the root, self.units[k] for k >= 1 is layer k - 1. The checker runs each on 2 and 3 ranks
# next to the plain Zero3, counts every all-gather with a metrics.Recorder, and compares the results.

class KeepLastLayer(zero3.Zero3):
    """ZeRO-3 that keeps its LAST layer gathered from the end of the forward to its backward. The plain Zero3
    frees every layer after its forward, and the backward's first act is to all-gather the last layer again:
    the same bytes twice in a row (section 4c's timeline shows the two all-gathers side by side)."""

    def _post_forward(self, k, module, args, output):
        """EXERCISE 4. Called after unit k's forward (see zero3.Zero3._post_forward, which you may copy): do
        what it does, except that the last layer (k == len(self.units) - 1) is not freed when a backward will
        follow (torch.is_grad_enabled() and output.requires_grad). Under torch.no_grad() (evaluation) no
        backward comes to use or free it: free it as usual. The rest of Zero3 already copes: _gather of a
        gathered unit does nothing, and the last layer is freed after its backward like every other layer."""
        raise NotImplementedError("not written yet")


class Bf16Gather(zero3.Zero3):
    """ZeRO-3 whose all-gathers carry bf16: half the bytes. Each rank's shard (unit.shard) stays fp32 — it is
    the master copy the optimizer updates; only the copy that travels is bf16. unit.full stays fp32 too (the
    parameters are views of it), filled with the gathered values, so the model computes with weights rounded
    to bf16 (under bf16 autocast every matmul rounds them so anyway)."""

    def _gather(self, unit):
        """EXERCISE 5, start (see zero3.Zero3._gather). If unit.state == "free": give unit.full its memory back
        (unit.full.untyped_storage().resize_(unit.nbytes())), make a bf16 copy of the shard and an empty bf16
        buffer of unit.padded elements, start the all-gather of the copy into that buffer with
        self.axis.all_gather_into(buffer, copy, async_op=True, label=f"all-gather {unit.name}") and keep its
        handle in unit.work; keep the buffer (and the copy) on the unit until _wait; unit.state = "gathering";
        self._track(unit.nbytes())."""
        raise NotImplementedError("not written yet")

    def _wait(self, unit):
        """EXERCISE 5, finish (see zero3.Zero3._wait). If unit.state == "gathering": wait for unit.work, copy
        the bf16 buffer into unit.full (in place: the parameters are views of it), drop the buffers,
        unit.work = None, unit.state = "gathered"."""
        raise NotImplementedError("not written yet")


# ------------------------------------------------------------------------------------- exercise 6: a puzzle
# Train the lesson's small model on dp = 2 ranks, 16 sequences of 128 tokens per step (8 per rank), fp32.
MODEL = ModelConfig.from_preset("tiny", hidden_size=256, intermediate_size=768, num_hidden_layers=4)
PSI, ROOT = MODEL.num_params(), 131_328  # parameters in all; in the root unit (embedding, final norm, LM head)
DP, SEQ_LEN, SEQS_PER_RANK = 2, 128, 8
# Buffers the sharded stages hold during the backward, whatever the micro-batch (section 4a prints them): ZeRO-2
# two gradient buckets in flight; ZeRO-3 the root and its gradient buffer, plus three layers (the one in backward,
# the one prefetched, the gradient buffer).
IN_FLIGHT = {0: 0, 1: 0, 2: 8_919_040, 3: 10_493_952}


def plan(budget_mib):
    """EXERCISE 6, a puzzle. Return the plan dict(zero=stage, micro_batch_size=b) with the highest throughput
    whose memory per rank fits in `budget_mib` MiB. Each rank takes 8 // b micro-batches per step.

    Memory per rank = model states (the introduction's table: planner.zero_model_state_bytes(PSI, zero, DP))
                    + IN_FLIGHT[zero]
                    + activations of one micro-batch (planner.activation_bytes(MODEL, SEQ_LEN, b): autograd
                      keeps one micro-batch's at a time; about 11 MiB per sequence here).
    Throughput: the compute is the same 16 x 128 tokens for every plan; what differs is communication. So:
    fewer bytes through the collectives per step first (section 4b: DP and ZeRO-1 2Ψ, whatever b; ZeRO-2
    reduce-scatters after EVERY micro-batch; ZeRO-3 all-gathers twice and reduce-scatters once per micro-batch,
    3Ψ - ROOT), then, for equal bytes, fewer micro-batches (bigger matmuls, fewer launches).

    Try 64 MiB by hand first. The checker asks for 100, 64 and 47 MiB, checks each plan with these formulas
    (does it fit? does a plan that fits move fewer bytes?), and trains each plan for one step on 2 real ranks:
    the memory the ranks measure (the wrappers' accounting, activations counted by autograd hooks) must fit."""
    raise NotImplementedError("not written yet")



# ----------------------------------------------------------------------------- exercise 7: ZeRO with a pipeline
def pp_zero_traffic(stage, root, layers, m, reshard=False):
    """EXERCISE 7 (section 7). One pipeline rank under ZeRO `stage` (1, 2 or 3) with m micro-batches per step: return
    {"all_gather": elements, "reduce_scatter": elements} its ZeRO collectives cover per step (whole buffers, as
    the Recorder counts them). `root`: the elements of its root units (embedding, final norm, head: whichever this
    stage holds), `layers`: those of its decoder layers, both already padded.

    What the pipeline does: every backward of a chunk but its last runs under no_sync, so the gradients add up
    locally and are reduce-scattered once, at the chunk's last backward. ZeRO-1/2 all-gather the updated
    parameters after the optimizer step. ZeRO-3 kept (reshard=False): each unit is gathered at its first use in the
    step and kept to its last backward. ZeRO-3 resharded: the roots as kept; each layer is freed after every use,
    so it is gathered again for each F and each B (a split schedule's W reads no weights: gᵀx)."""
    raise NotImplementedError("not written yet")


# --------------------------------------------------------------------------------------- exercise 8: HSDP's groups
def hsdp_groups(dp, dp_shard, cp=1):
    """EXERCISE 8 (section 8). A grid of dp x cp ranks (pp = tp = 1), rank = dp_rank * cp + cp_rank (picotron.mesh's
    order, cp faster). Return (shard groups, replicate groups), each a list of lists of global ranks:

    - a SHARD group: a block of dp_shard CONSECUTIVE dp coordinates (0..dp_shard-1, then dp_shard..2·dp_shard-1, ...),
      with every cp rank of those coordinates: the ranks ZeRO cuts its units over (a node);
    - a REPLICATE group: the ranks at the same place in every block (same dp_rank % dp_shard) and the same cp rank:
      the ranks that hold the same shard and all-reduce its gradient (across nodes).

    dp_shard divides dp. E.g. hsdp_groups(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]]). Any order of the groups
    and of the ranks inside a group is accepted."""
    raise NotImplementedError("not written yet")


# ------------------------------------------------------------------------------------ exercise 9: Muon's owners
def owner_of(sizes, n):
    """EXERCISE 9 (section 9). Muon's owner design gives each whole matrix to one rank, which runs its Newton–Schulz.
    `sizes`: each matrix's number of elements, in the model's order; `n`: the ranks. Return a list with one rank
    (0..n-1) per matrix, so that the largest load (the sum of the sizes a rank owns: the slowest rank's work) is as
    small as the LARGEST-FIRST rule makes it: take the matrices from the largest to the smallest and give each to the
    rank with the least load so far. E.g. owner_of([1, 5, 3, 3], 2) gives the 5 to one rank and 3 + 3 to the other,
    with the 1 on the lighter: largest load 6. (Every rank must compute the same answer from the same sizes: no
    message is sent; any answer with the same largest load is accepted.)"""
    raise NotImplementedError("not written yet")
