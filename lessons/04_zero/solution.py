"""Lesson 04 exercises — reference solutions. (The exercise file, lessons/04_zero/exercise.py, is the same file
with the six marked pieces left to write.)"""
import math
from functools import partial

import torch
import torch.distributed as dist

from picotron import planner, zero3
from picotron.model import ModelConfig

# exercise 6's facts (the same lines as in exercise.py)
MODEL = ModelConfig.from_preset("tiny", hidden_size=256, intermediate_size=768, num_hidden_layers=4)
PSI, ROOT = MODEL.num_params(), 131_328
DP, SEQ_LEN, SEQS_PER_RANK = 2, 128, 8
IN_FLIGHT = {0: 0, 1: 0, 2: 8_919_040, 3: 10_493_952}


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
    dist.reduce_scatter_tensor(out, flat, group=group)  # rank r receives the sum of everybody's chunk r
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
        dist.all_gather_into_tensor(self.flat, p.clone(), group=self.group)


# ------------------------------------------------------------------------ exercises 4 and 5: ZeRO-3, cheaper
class KeepLastLayer(zero3.Zero3):
    """ZeRO-3 that does not free its last layer after the forward: the backward needs it first, right away."""

    def _post_forward(self, k, module, args, output):
        """EXERCISE 4."""
        if self.in_backward:
            return  # a recomputation inside backward
        self._close_phase(k)
        backward_follows = torch.is_grad_enabled() and output.requires_grad
        if backward_follows:
            output.register_hook(partial(self._pre_backward, k))
        if k < len(self.units) - 1 or not backward_follows:  # keep the last layer only if a backward comes
            self._free(self.units[k])


class Bf16Gather(zero3.Zero3):
    """ZeRO-3 whose all-gathers carry bf16: half the bytes; the fp32 shards stay the master copy."""

    def _gather(self, unit):
        """EXERCISE 5 (start)."""
        if unit.state == "free":
            unit.full.untyped_storage().resize_(unit.nbytes())
            unit.send = unit.shard.to(torch.bfloat16)  # a bf16 COPY: the fp32 shard stays as it is
            unit.received = torch.empty(unit.padded, dtype=torch.bfloat16, device=unit.shard.device)
            unit.work = self.axis.all_gather_into(unit.received, unit.send, async_op=True,
                                                  label=f"all-gather {unit.name}")
            unit.state = "gathering"
            self._track(unit.nbytes())

    def _wait(self, unit):
        """EXERCISE 5 (finish)."""
        if unit.state == "gathering":
            unit.work.wait()  # only now does unit.received hold every rank's chunk
            unit.full.copy_(unit.received)  # bf16 -> fp32, into the buffer the parameters are views of
            unit.work, unit.send, unit.received, unit.state = None, None, None, "gathered"


# ------------------------------------------------------------------------------------- exercise 6: a puzzle
def plan(budget_mib):
    """EXERCISE 6: every plan that fits, ranked by bytes on the wire per step, then by micro-batches."""
    best = None
    for zero in range(4):
        for mbs in (1, 2, 4, 8):
            g = SEQS_PER_RANK // mbs  # micro-batches per step
            states = sum(planner.zero_model_state_bytes(PSI, zero, DP).values())
            memory = states + IN_FLIGHT[zero] + planner.activation_bytes(MODEL, SEQ_LEN, mbs)
            if memory > budget_mib * 2**20:
                continue
            wire = {0: 2 * PSI, 1: 2 * PSI, 2: (g + 1) * PSI, 3: g * (3 * PSI - ROOT)}[zero]
            if best is None or (wire, g) <= best[0]:  # a tie: the higher stage (less optimizer work)
                best = (wire, g), dict(zero=zero, micro_batch_size=mbs)
    return best[1]



# ----------------------------------------------------------------------------- exercise 7: ZeRO with a pipeline
def pp_zero_traffic(stage, root, layers, m, reshard=False):
    """EXERCISE 7: one reduce-scatter of everything per step; the all-gathers once per step, or resharded 2m times
    per layer (F and B of each micro-batch) and once for the roots."""
    total = root + layers
    gathered = root + 2 * m * layers if stage == 3 and reshard else total
    return {"all_gather": gathered, "reduce_scatter": total}


# --------------------------------------------------------------------------------------- exercise 8: HSDP's groups
def hsdp_groups(dp, dp_shard, cp=1):
    """EXERCISE 8: blocks of dp_shard consecutive dp coordinates (with their cp ranks); the same place in each block."""
    def rank(d, c):
        return d * cp + c
    shard = [[rank(d, c) for d in range(b * dp_shard, (b + 1) * dp_shard) for c in range(cp)]
             for b in range(dp // dp_shard)]
    replicate = [[rank(d, c) for d in range(j, dp, dp_shard)] for j in range(dp_shard) for c in range(cp)]
    return shard, replicate


# ------------------------------------------------------------------------------------ exercise 9: Muon's owners
def owner_of(sizes, n):
    """EXERCISE 9: largest first, each to the least-loaded rank so far (ties: the lowest rank)."""
    load, owner = [0] * n, [0] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        r = min(range(n), key=lambda r: (load[r], r))
        owner[k], load[r] = r, load[r] + sizes[k]
    return owner
