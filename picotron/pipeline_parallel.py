"""Pipeline parallelism: the layers cut into stages, one per rank, micro-batches flowing through them
(GPipe: Huang et al. 2019; 1F1B: Narayanan et al. 2019 "PipeDream", Megatron-LM 2021 for the interleaved
schedule; zero bubble: Qi et al. 2024, "Zero Bubble Pipeline Parallelism").

Stage s keeps layers [a_s, b_s); stage 0 also keeps the embedding, the last stage the final norm and the LM
head. A micro-batch's forward goes stage 0 -> 1 -> ... -> p-1 (each stage sends its output activation to the
next, [b, s, h]); its backward comes back (each stage sends the gradient of its input to the previous one).
A stage waiting for its neighbour is idle: the *bubble*. With p stages, m micro-batches and t_F, t_B the
time of one micro-batch's forward and backward on one stage:

    AFAB / 1F1B      time = (m + p - 1)(t_F + t_B)        bubble = (p-1)/(m+p-1) of the time
    interleaved (v)  the bubble shrinks v-fold: (p-1)/(v·m + p-1), for v× the point-to-point messages
    ZB-H1            B split into B (input gradient) and W (weight gradient); the W's fill the cool-down:
                     with t_F = t_B = t_W the bubble is (p-1)/(3m + p-1), at 1F1B's memory
    ZB-V             two chunks per rank in a V (rank r holds stages r and 2p-1-r), W's fill the rest

(The Ultra-Scale Playbook writes the bubble relative to the ideal time, (p-1)/m for 1F1B: the same idle
time divided by m(t_F + t_B) instead of the total. Both are in the lesson.)

A schedule is data. For each rank, the ordered list of its `Action`s: F (forward), B (backward; with a
split schedule only the input gradient) and W (the weight gradient) of micro-batch `mb` on the rank's chunk
`chunk`. The sends and receives are implied: F on stage s > 0 receives the activation from stage s-1, F on a
stage before the last sends its output on; B receives the output gradient from stage s+1 and sends its input
gradient to stage s-1. The generators below are pure functions of (p, m, v); `simulate` runs any schedule on
an ideal machine (F, B, W taking given times, messages instant) and refuses a wrong one with the first
problem: an action missing or twice, a B before its F, a W before its B, or a deadlock (which ranks wait for
what). `Pipeline`, the executor, runs any schedule on real processes (one message = one batched send or receive on
the group of its direction, NCCL-safe by construction: see `Pipeline`); with one stage it is
plain gradient accumulation.

Activations in flight: AFAB keeps all m micro-batches' activations until the backward starts; 1F1B starts
backward as soon as the first micro-batch has come back, so stage i keeps at most p - i.
"""
import math
from collections import defaultdict, namedtuple
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from picotron import marks, metrics, p2p

# ============================================================================================ schedules
Action = namedtuple("Action", "kind mb chunk")  # kind "F" | "B" | "W"; micro-batch; chunk on this rank
Action.__repr__ = lambda a: f"{a.kind}{a.mb}" + (f".{a.chunk}" if a.chunk else "")

SCHEDULES = ("afab", "1f1b", "interleaved", "zb-h1", "zb-v")


class ScheduleError(ValueError):
    """A schedule that cannot run: the message names the first wrong action or the deadlock."""


@dataclass
class Schedule:
    """Every rank's ordered actions. `v` chunks per rank; `shape` "loop" (chunk c of rank r is stage
    c·p + r, Megatron's interleaving) or "v" (chunk 0 is stage r, chunk 1 stage 2p-1-r); `split`: the
    backward is cut into B (input gradient) and W (weight gradient)."""
    name: str
    p: int
    m: int
    v: int
    ranks: list
    split: bool = False
    shape: str = "loop"

    @property
    def stages(self):
        return self.p * self.v

    def stage(self, rank, chunk):
        if self.shape == "v":
            return rank if chunk == 0 else 2 * self.p - 1 - rank
        return chunk * self.p + rank

    def where(self, stage):
        """(rank, chunk) holding `stage`."""
        if self.shape == "v":
            return (stage, 0) if stage < self.p else (2 * self.p - 1 - stage, 1)
        return stage % self.p, stage // self.p

    def __repr__(self):
        return f"Schedule({self.name}, p={self.p}, m={self.m}, v={self.v})"


def afab(p, m):
    """All forwards, then all backwards (GPipe)."""
    return Schedule("afab", p, m, 1, [[Action("F", i, 0) for i in range(m)] + [Action("B", i, 0) for i in range(m)]
                                      for _ in range(p)])


def one_f_one_b(p, m):
    """1F1B: rank r runs p-r-1 forwards (warm-up), then alternates one forward, one backward, then drains."""
    ranks = []
    for r in range(p):
        warm = min(p - r - 1, m)
        acts = [Action("F", i, 0) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action("F", warm + i, 0), Action("B", i, 0)]
        acts += [Action("B", i, 0) for i in range(m - warm, m)]
        ranks.append(acts)
    return Schedule("1f1b", p, m, 1, ranks)


def interleaved(p, m, v):
    """Megatron's interleaved 1F1B: v chunks per rank (stage c·p + r), micro-batches in groups of p; rank r
    warms up with 2(p-r-1) + (v-1)·p forwards. Needs m to be a multiple of p (when v > 1)."""
    if v == 1:
        return one_f_one_b(p, m)
    if m % p:
        raise ScheduleError(f"the interleaved schedule needs the micro-batches m={m} to be a multiple of pp={p} "
                            f"(they go through the chunks in groups of pp); pick --grad-acc {p * max(1, m // p)} "
                            f"or {p * (m // p + 1)}.")
    total = m * v

    def nth(k, backward):  # the k-th forward (or backward) of a rank: (micro-batch, chunk)
        group, within = divmod(k, p * v)
        chunk = within // p
        return Action("B" if backward else "F", group * p + within % p, v - 1 - chunk if backward else chunk)

    ranks = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        acts = [nth(k, False) for k in range(warm)]
        for k in range(total - warm):
            acts += [nth(warm + k, False), nth(k, True)]
        acts += [nth(k, True) for k in range(total - warm, total)]
        ranks.append(acts)
    return Schedule("interleaved", p, m, v, ranks)


def zb_h1(p, m):
    """ZB-H1: 1F1B's order with each backward split into B then W, and rank r holding back up to r of its
    W's to fill the cool-down, where later stages would otherwise wait; at most p micro-batches in flight."""
    ranks = []
    for r, acts in enumerate(one_f_one_b(p, m).ranks):
        out, pending = [], []
        for a in acts:
            out.append(a)
            if a.kind == "B":
                pending.append(Action("W", a.mb, 0))
                if len(pending) > r:
                    out.append(pending.pop(0))
        ranks.append(out + pending)
    return Schedule("zb-h1", p, m, 1, ranks, split=True)


def zb_v(p, m):
    """ZB-V (Qi et al. 2024, section 5): two chunks per rank in a V, rank r holding stages r and 2p-1-r, so the
    first and the last stage share rank 0 and every rank has work at both ends of the step; the backward split
    into B and W. Each phase's length follows from when a micro-batch can arrive, with t_F = t_B = t_W:
      warm-up    2(p-r)-1 forwards of chunk 0 (micro-batch 0 needs that long to come back down the V),
                 then r times (chunk 1's F, chunk 0's F), then p-r times chunk 1's F, B, W;
      steady     F, B, W of chunk 0 then of chunk 1, one micro-batch each;
      cool-down  B of chunk 0 and of chunk 1, the W's held back r rounds to fill the wait for the next B,
                 the rest of the W's at the end.
    Every call is guarded (a forward of chunk 1 only after the same micro-batch's chunk 0 on this rank, a B
    of chunk 0 only after chunk 1's), so any m works. At most 2p chunk-activations (p whole stages, 1F1B's
    worst stage) are alive."""
    ranks = []
    for r in range(p):
        acts, f, b, w = [], [0, 0], [0, 0], [0, 0]

        def fwd(c):
            if f[c] < m and (c == 0 or f[1] < f[0]):
                acts.append(Action("F", f[c], c))
                f[c] += 1

        def bwd(c):
            if b[c] < f[c] and (c == 1 or b[0] < b[1]):
                acts.append(Action("B", b[c], c))
                b[c] += 1

        def wgt(c):
            if w[c] < b[c]:
                acts.append(Action("W", w[c], c))
                w[c] += 1

        for _ in range(2 * (p - r) - 1):
            fwd(0)
        for _ in range(r):
            fwd(1), fwd(0)
        for _ in range(p - r):
            fwd(1), bwd(1), wgt(1)
        while f[0] < m or f[1] < m:
            fwd(0), bwd(0), wgt(0), fwd(1), bwd(1), wgt(1)
        rounds = 0
        while b[0] < m or b[1] < m:
            bwd(0), bwd(1)
            rounds += 1
            if rounds > r:
                wgt(0) if w[0] < w[1] else wgt(1)
        while w[0] < m or w[1] < m:
            wgt(0) if w[0] < m and (w[0] < w[1] or w[1] >= m) else wgt(1)
        ranks.append(acts)
    return Schedule("zb-v", p, m, 2, ranks, split=True, shape="v")


def build(name, p, m, v=1):
    """The schedule `name` (one of SCHEDULES) for p stages (ranks), m micro-batches, v chunks per rank."""
    if name == "afab":
        return afab(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved(p, m, v)
    if name == "zb-h1":
        return zb_h1(p, m)
    if name == "zb-v":
        return zb_v(p, m)
    raise ScheduleError(f"unknown pipeline schedule {name!r}; pick one of {', '.join(SCHEDULES)}.")


def chunks_of(name, v):
    """Chunks per rank a schedule uses: v for interleaved, 2 for the V shape, else 1."""
    return v if name == "interleaved" else 2 if name == "zb-v" else 1


# ============================================================================================ simulator
@dataclass
class Simulation:
    """What `simulate` found: per rank the (action, start, end) it ran, the step's length, busy time, the
    bubble (idle fraction of the total) and the most chunk-activations alive at once."""
    timeline: list
    makespan: float
    busy: list
    peak_alive: list
    bubble: float = field(init=False)

    def __post_init__(self):
        total = self.makespan * len(self.busy)
        self.bubble = 1 - sum(self.busy) / total if total else 0.0


def default_costs(split):
    return {"F": 1.0, "B": 1.0, "W": 1.0} if split else {"F": 1.0, "B": 2.0, "W": 0.0}


def simulate(schedule, cost=None, latency=0.0):
    """Run `schedule` on an ideal machine: each rank executes its list in order, an action starting when the
    rank is free and its inputs have arrived (`latency` after they were produced on another rank). `cost`:
    {"F": t_F, "B": t_B, "W": t_W} (default F 1, B 2; split: 1, 1, 1), or a function (action, rank) -> time.
    Raises ScheduleError naming the first problem; returns a Simulation."""
    sch, p, m = schedule, schedule.p, schedule.m
    costs = cost if callable(cost) else (lambda a, r, c=cost or default_costs(sch.split): c[a.kind])
    kinds = ("F", "B", "W") if sch.split else ("F", "B")
    if len(sch.ranks) != p:
        raise ScheduleError(f"the schedule has {len(sch.ranks)} action lists for pp={p} ranks.")
    seen = {}
    for r, acts in enumerate(sch.ranks):
        for k, a in enumerate(acts):
            if a.kind not in kinds:
                raise ScheduleError(f"rank {r}, action {k} ({a!r}): kind {a.kind!r} is not one of {kinds} for this "
                                    f"schedule.")
            if not (0 <= a.mb < m and 0 <= a.chunk < sch.v):
                raise ScheduleError(f"rank {r}, action {k} ({a!r}): micro-batch {a.mb} or chunk {a.chunk} out of range "
                                    f"(m={m}, v={sch.v}).")
            key = (a.kind, a.mb, sch.stage(r, a.chunk))
            if key in seen:
                raise ScheduleError(f"rank {r}, action {k} ({a!r}): {a.kind} of micro-batch {a.mb} on stage {key[2]} "
                                    f"appears twice.")
            seen[key] = (r, k)
            before = {"B": "F", "W": "B"}.get(a.kind)
            if before and (before, a.mb, key[2]) not in seen:
                raise ScheduleError(f"rank {r}, action {k} ({a!r}): {a.kind} of micro-batch {a.mb} comes before its "
                                    f"{before} on this rank.")
    for kind in kinds:
        for i in range(m):
            for s in range(sch.stages):
                if (kind, i, s) not in seen:
                    r, c = sch.where(s)
                    raise ScheduleError(f"rank {r} never runs {kind} of micro-batch {i} on its chunk {c} (stage {s}).")

    def needs(a, r):
        s = sch.stage(r, a.chunk)
        if a.kind == "F":
            return [("F", a.mb, s - 1)] if s > 0 else []
        if a.kind == "B":
            return [("F", a.mb, s)] + ([("B", a.mb, s + 1)] if s < sch.stages - 1 else [])
        return [("B", a.mb, s)]

    finish, pos, free = {}, [0] * p, [0.0] * p
    timeline = [[] for _ in range(p)]
    alive, peak = [0] * p, [0] * p
    remaining = sum(len(a) for a in sch.ranks)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(sch.ranks[r]):
                a = sch.ranks[r][pos[r]]
                deps = needs(a, r)
                if any(d not in finish for d in deps):
                    break
                arrive = [finish[d] + (latency if sch.where(d[2])[0] != r else 0.0) for d in deps]
                start = max([free[r]] + arrive)
                end = start + costs(a, r)
                finish[(a.kind, a.mb, sch.stage(r, a.chunk))] = end
                free[r] = end
                timeline[r].append((a, start, end))
                alive[r] += 1 if a.kind == "F" else -1 if a.kind == ("W" if sch.split else "B") else 0
                peak[r] = max(peak[r], alive[r])
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = []
            for r in range(p):
                if pos[r] < len(sch.ranks[r]):
                    a = sch.ranks[r][pos[r]]
                    missing = [d for d in needs(a, r) if d not in finish][0]
                    src, c = sch.where(missing[2])
                    stuck.append(f"rank {r} waits at {a!r} for {missing[0]}{missing[1]} of stage {missing[2]} "
                                 f"(rank {src}, chunk {c})")
            raise ScheduleError("deadlock: " + "; ".join(stuck) + ".")
    makespan = max(free)
    busy = [sum(e - s for _, s, e in t) for t in timeline]
    return Simulation(timeline, makespan, busy, peak)


def bubble_formula(name, p, m, v=1):
    """The idle fraction of a step's time when stages are equal, messages instant, and t_B = 2 t_F (split:
    t_F = t_B = t_W): (p-1)/(m+p-1) for AFAB and 1F1B, (p-1)/(v·m+p-1) interleaved, (p-1)/(3m+p-1) ZB-H1
    (m >= p). ZB-V has no closed form here: its value is the simulator's."""
    if name in ("afab", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    raise ValueError(f"no closed-form bubble for {name!r}; use simulate(build(...)).bubble.")


# ============================================================================ deferred weight gradients
class WeightGradStore:
    """Split schedules (ZB-H1, ZB-V): during B, every linear layer computes only the gradient of its input and
    stashes (input, output gradient); W later turns them into weight gradients, dW = gᵀx, accumulated by
    autograd (so the gradient-sync hooks fire as for any gradient). Norm and embedding weights, cheap, get
    theirs in B. The weight enters the B graph detached: autograd must not even visit its accumulator there
    (its post-accumulate hooks, which data parallelism counts, fire even for a None gradient)."""

    def __init__(self):
        self.deferring = False
        self.stash = []  # (weight, x, grad_out) of the current B
        self.queues = defaultdict(list)  # (mb, chunk) -> stashed items, waiting for their W

    def linear(self, x, weight):
        return _DeferredLinear.apply(x, weight.detach(), (weight,), self)

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
        elif hasattr(m, "matmul"):
            m.matmul = store.linear


# ========================================================================================== stage split
def layer_costs(model_config, seq_len):
    """Training FLOPs per token of each part, in layer order: [embedding, layer 0, ..., layer L-1, head].
    The embedding is a lookup (no FLOPs, counted as 0); the head is its matmul, 6·h·v."""
    mc, h = model_config, model_config.hidden_size
    kv = mc.num_key_value_heads * mc.head_dim
    layer = 6 * (2 * h * h + 2 * h * kv + 3 * h * mc.intermediate_size) + 12 * h * seq_len
    return [0] + [layer] * mc.num_hidden_layers + [6 * h * mc.vocab_size]


def split_layers(model_config, stages, seq_len):
    """Contiguous layer ranges [(lo, hi), ...], one per stage (each at least one layer), that minimise the
    most expensive stage, the first counting the embedding and the last the LM head."""
    costs = layer_costs(model_config, seq_len)
    L = model_config.num_hidden_layers
    if stages > L:
        raise ValueError(f"{stages} stages need at least {stages} layers, the model has {L}.")
    inner = costs[1:-1]
    prefix = [0]
    for c in inner:
        prefix.append(prefix[-1] + c)

    def cost(s, lo, hi):
        return prefix[hi] - prefix[lo] + (costs[0] if s == 0 else 0) + (costs[-1] if s == stages - 1 else 0)

    best = {}  # (s, lo) -> (max cost of stages s.., cuts)

    def solve(s, lo):
        if (s, lo) in best:
            return best[(s, lo)]
        if s == stages - 1:
            out = (cost(s, lo, L), [(lo, L)])
        else:
            out = (math.inf, None)
            for hi in range(lo + 1, L - (stages - s - 1) + 1):
                rest, cuts = solve(s + 1, hi)
                worst = max(cost(s, lo, hi), rest)
                if worst < out[0]:
                    out = (worst, [(lo, hi)] + cuts)
        best[(s, lo)] = out
        return out

    return solve(0, 0)[1]


# ========================================================================================= a rank's stage
class PipelineStage(nn.Module):
    """This rank's chunks of the model: `chunks[c]` is a Llama keeping only stage schedule.stage(rank, c)'s
    layers (with the embedding on stage 0, norm and head on the last). Parameter names inside a chunk are
    the full model's (layers.5.mlp..., lm_head.weight), so the layout-independent init holds."""

    def __init__(self, chunks, stages, tied):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.stage_ids = list(stages)
        self.tied = tied  # (embedding weight or None, head weight or None) when the embeddings are tied
        self.config = chunks[0].config

    def init_weights(self, seed):
        for chunk in self.chunks:
            chunk.init_weights(seed)
        embedding, head = self.tied
        if head is not None:  # the last stage's copy of the tied matrix starts as the embedding
            from picotron.model import init_tensor
            full = init_tensor("embed_tokens.weight", getattr(head, "full_shape", head.shape), seed,
                               self.config.initializer_range)
            take = getattr(head, "take_shard", None)
            with torch.no_grad():
                head.copy_(take(full) if take else full)
        return self

    @property
    def recompute(self):
        return self.chunks[0].recompute

    @recompute.setter
    def recompute(self, value):
        for chunk in self.chunks:
            chunk.recompute = value


def keep_stage(model_factory, schedule, rank, model_config, seq_len):
    """Build this rank's PipelineStage (on the meta device): for each chunk a fresh `model_factory()` with
    the layers of its stage kept and the rest dropped; embedding only on stage 0, norm + head on the last."""
    cuts = split_layers(model_config, schedule.stages, seq_len)
    last = schedule.stages - 1
    chunks, stages = [], []
    for c in range(schedule.v):
        s = schedule.stage(rank, c)
        model = model_factory()
        lo, hi = cuts[s]
        for i in list(model.layers.indices()):
            if not lo <= i < hi:
                del model.layers[str(i)]
        if s != 0:
            model.embed_tokens = None
        if s != last:
            model.norm = model.lm_head = None
        elif model_config.tie_word_embeddings and s != 0:  # its own copy of the matrix, kept equal by sync
            model.lm_head.weight = nn.Parameter(torch.empty_like(model.lm_head.weight))
        chunks.append(model)
        stages.append(s)
    return PipelineStage(chunks, stages, (None, None))


def mark_stage(stage, schedule, pp):
    """After materialising: mark every parameter as sharded over pp (each stage holds different ones), the
    last stage's copy of a tied embedding as a copy (clipping counts it once, on stage 0), and remember the
    tied pair for the gradient sync."""
    embedding = head = None
    for chunk, s in zip(stage.chunks, stage.stage_ids):
        for p in chunk.parameters():
            marks.mark(p, pp.dims)
        if s == 0 and chunk.embed_tokens is not None and chunk.lm_head is None:
            embedding = chunk.embed_tokens.weight
        if s == schedule.stages - 1 and chunk.embed_tokens is None and stage.config.tie_word_embeddings:
            head = chunk.lm_head.weight
            head.is_copy = True
    if stage.config.tie_word_embeddings and schedule.stages > 1:
        stage.tied = (embedding, head)
    return stage


def sync_tied(stage, ends):
    """Tied embeddings on two stages: add the gradients of the first stage's embedding and the last
    stage's head (one all-reduce between those two ranks; in memory when one rank holds both, as in the
    V shape), so both copies take the same step from the same values."""
    embedding, head = stage.tied
    if embedding is not None and head is not None:
        embedding.grad.add_(head.grad)
        head.grad.copy_(embedding.grad)
        return
    for w in (embedding, head):
        if w is not None:
            ends.all_reduce(w.grad, label="tied embedding")


# ============================================================================================= executor
class Pipeline:
    """Runs a `Schedule` for one optimizer step: the step engine of a pipeline stage (the same contract as
    `schedule.OneStage`: gradients left synchronised, the global-batch loss returned on every rank).

    Each rank walks its action list. F: the input is the batch's tokens on stage 0, else the activation
    received from the previous stage; the output goes to the next stage (or, on the last, into the loss,
    divided by m). B: the output gradient arrives from the next stage (the loss on the last); the input's
    gradient goes back. W: the stashed weight gradients. Between chunks of one rank (the V's turn) the tensor is
    handed over in memory.

    Messages, and why they cannot hang on NCCL. There, the messages of one communicator run in the order posted
    on one stream, both directions mixed, and a receive holds the stream until its send arrives. Posting "receive
    B0 from the next stage" while that stage posts "receive F1 from us" first would wait forever (it did: every
    schedule, replayed under NCCL's rules). So each direction between two neighbours has its own group
    (`mesh.pp_links`): a sender posts its sends in its own order, and the receiver posts its receives in that
    same order — it knows the neighbour's action list — one action ahead of their use, so the next input
    arrives while this action computes. Each message is one `batch_isend_irecv` (picotron.p2p), which runs on
    the group's communicator, made with the group, so no host waits at a first contact either.
    tests/test_nccl_rules.py replays every schedule at pp 2 and 4 under these rules."""

    def __init__(self, schedule, mesh, hidden, seq_div=1, ends=None, autocast=nullcontext, store=None,
                 timeline=None, dtype=torch.float32):
        self.schedule, self.mesh, self.pp = schedule, mesh, mesh.pp
        self.dtype = dtype  # of the residual stream that travels: the parameters' (fp32, or bf16/fp16 parameters)
        self.hidden, self.seq_div = hidden, seq_div  # an activation is [b, s / seq_div, hidden] (sp: seq_div = tp)
        self.ends, self.autocast, self.store, self.timeline = ends, autocast, store, timeline
        self.activation_bytes = 0
        self.p2p_bytes = 0
        self.rank = mesh.pp.rank
        sch = schedule
        self.last_stage = sch.stages - 1
        # messages each neighbour sends me, in its order: ("F"|"B", mb, my chunk)
        self.incoming = defaultdict(list)
        for r, acts in enumerate(sch.ranks):
            for a in acts:
                s = sch.stage(r, a.chunk)
                if a.kind == "F" and s < self.last_stage:
                    dst, c = sch.where(s + 1)
                    if dst == self.rank and r != self.rank:
                        self.incoming[r].append(("F", a.mb, c))
                if a.kind == "B" and s > 0:
                    dst, c = sch.where(s - 1)
                    if dst == self.rank and r != self.rank:
                        self.incoming[r].append(("B", a.mb, c))
        mine = sch.ranks[self.rank]
        self.final = set()  # the actions after which a chunk's parameters have their whole gradient
        for c in range(sch.v):
            for kind in ("B", "W"):
                same = [k for k, a in enumerate(mine) if a.kind == kind and a.chunk == c]
                if same:
                    self.final.add(same[-1])

    # ------------------------------------------------------------------------------- messages
    def _global(self, pp_rank):
        return self.pp.ranks[pp_rank]

    def _post(self, src, upto):
        """Post receives from `src` in its send order, up to and including message `upto`."""
        queue = self.incoming[src]
        while self.posted[src] < len(queue):
            key = queue[self.posted[src]]
            buf = torch.empty(self.act_shape, dtype=self.dtype, device=self.mesh.device)
            self.pending[key] = (buf, self._message("recv", buf, src))
            self.posted[src] += 1
            if key == upto:
                return

    def _source(self, a):
        """(rank, message key) this action receives from, or None."""
        sch = self.schedule
        s = sch.stage(self.rank, a.chunk)
        if a.kind == "F" and s > 0:
            r, _ = sch.where(s - 1)
            return (r, ("F", a.mb, a.chunk)) if r != self.rank else None
        if a.kind == "B" and s < self.last_stage:
            r, _ = sch.where(s + 1)
            return (r, ("B", a.mb, a.chunk)) if r != self.rank else None
        return None

    def _receive(self, a):
        src = self._source(a)
        if src is None:  # same rank: handed over in memory
            return self.local.pop((a.kind, a.mb, a.chunk))
        r, key = src
        self._post(r, key)
        buf, works = self.pending.pop(key)
        p2p.wait_all(works)
        return buf

    def _send(self, t, kind, mb, to_stage):
        r, c = self.schedule.where(to_stage)
        t = t.detach().to(self.dtype).contiguous()
        if r == self.rank:
            self.local[(kind, mb, c)] = t
            return
        self.sends += self._message("send", t, r)
        self.p2p_bytes += t.numel() * t.element_size()

    def _message(self, kind, t, peer):
        """Post one message to / from pipeline rank `peer` on the group of its direction (mesh.pp_links: on
        NCCL each direction is then its own ordered stream, see mesh.pipeline_links); the handles."""
        me, other = self._global(self.rank), self._global(peer)
        link = self.mesh.pp_links[(me, other) if kind == "send" else (other, me)]
        return p2p.exchange([(kind, t, other)], link)

    # -------------------------------------------------------------------------------- the step
    def _phase(self, a):
        if self.timeline is None:
            return nullcontext()
        return self.timeline.record({"F": "forward", "B": "backward", "W": "weight"}[a.kind], micro=a.mb,
                                    chunk=a.chunk, stage=self.schedule.stage(self.rank, a.chunk))

    def run(self, model, micro_batches, loss_fn):
        sch, stage = self.schedule, model.module
        m = len(micro_batches)
        if m != sch.m:
            raise ValueError(f"the schedule is for {sch.m} micro-batches, the step has {m}.")
        self.pending, self.posted, self.local, self.sends = {}, defaultdict(int), {}, []
        b, seq = micro_batches[0][0].shape
        self.act_shape = (b, seq // self.seq_div, self.hidden)
        saved, alive = {}, {}  # (mb, chunk) -> (input, output); -> activation bytes saved by its forward
        per_chunk = {}  # chunk -> activation bytes one micro-batch's forward saves
        self.peak_activation_bytes = 0
        total = torch.zeros((), device=self.mesh.device)
        acts = sch.ranks[self.rank]
        for k, a in enumerate(acts):
            if k + 1 < len(acts):  # post the next action's receive now: it arrives while this one computes
                nxt = self._source(acts[k + 1])
                if nxt is not None:
                    self._post(*nxt)
            s = sch.stage(self.rank, a.chunk)
            chunk = stage.chunks[a.chunk]
            x_ids, y, positions = self._on_device(micro_batches[a.mb])
            with self._phase(a):
                if a.kind == "F":
                    x = x_ids if s == 0 else self._receive(a).requires_grad_()
                    # every micro-batch of a chunk saves the same bytes: count the first one's (hooks cost time)
                    counter = metrics.ActivationCounter(chunk) if a.chunk not in per_chunk else nullcontext()
                    with self.autocast(), counter:
                        out = chunk(x, positions)
                        if s == self.last_stage:
                            out = loss_fn(out, y) / m
                    per_chunk.setdefault(a.chunk, getattr(counter, "bytes", 0))
                    alive[(a.mb, a.chunk)] = per_chunk[a.chunk]
                    self.peak_activation_bytes = max(self.peak_activation_bytes, sum(alive.values()))
                    if s == self.last_stage:
                        total += out.detach()
                    else:
                        self._send(out, "F", a.mb, s + 1)
                    saved[(a.mb, a.chunk)] = (x if s > 0 else None, out)
                else:
                    sync = nullcontext() if k in self.final else model.no_sync()
                    with sync:
                        if a.kind == "B":
                            x, out = saved.pop((a.mb, a.chunk))
                            grad = None if s == self.last_stage else self._receive(a)
                            if self.store is not None:
                                self.store.deferring = True
                            torch.autograd.backward(out, grad)
                            if self.store is not None:
                                self.store.deferring = False
                                self.store.collect((a.mb, a.chunk))
                            if s > 0:
                                self._send(x.grad, "B", a.mb, s - 1)
                            del x, out, grad
                        else:
                            self.store.flush((a.mb, a.chunk))
                    if a.kind == ("W" if sch.split else "B"):
                        alive.pop((a.mb, a.chunk))
        for w in self.sends:
            w.wait()
        self.sends = []
        self.activation_bytes = self.peak_activation_bytes  # what the log's "act" shows: the step's peak
        model.finish_sync()
        if self.ends is not None:
            sync_tied(stage, self.ends)
        # the loss lives on the last stage: hand it to every stage, then average over the replicas
        loss = total if self.pp.size == 1 else _from_last(total, self.pp, self.schedule)
        return self.mesh.dp_cp.mean(loss)

    def _on_device(self, batch):
        """(inputs, targets, positions) on the device; positions 0..s-1 when the batch has none (a stage
        after the first sees hidden states, whose length under sp is not the sequence's)."""
        x, y, positions = _triple(batch)
        if positions is None:
            positions = torch.arange(x.shape[1])
        dev = self.mesh.device
        return x.to(dev, non_blocking=True), y.to(dev, non_blocking=True), positions.to(dev, non_blocking=True)

    # ----------------------------------------------------------------------------- forward only
    @torch.no_grad()
    def forward_only(self, stage, batch, head=None):
        """One batch through every stage in order (no schedule: evaluation and text generation). Returns
        the last stage's output (or head(output)) on the last rank, None elsewhere."""
        x_ids, _, positions = self._on_device(batch)
        sch = self.schedule
        shape = (x_ids.shape[0], x_ids.shape[1] // self.seq_div, self.hidden)
        x, out = x_ids, None
        for s in range(sch.stages):
            r, c = sch.where(s)
            if r == self.rank:
                if s > 0:
                    prev, _ = sch.where(s - 1)
                    if prev != self.rank:
                        x = torch.empty(shape, dtype=self.dtype, device=self.mesh.device)
                        p2p.wait_all(self._message("recv", x, prev))
                with self.autocast():
                    x = stage.chunks[c](x, positions)
                if s == self.last_stage:
                    out = head(x) if head is not None else x
                else:
                    nxt, _ = sch.where(s + 1)
                    if nxt != self.rank:
                        p2p.wait_all(self._message("send", x.to(self.dtype).contiguous(), nxt))
        return out

    @torch.no_grad()
    def evaluate(self, model, batches, loss_fn):
        """The mean loss over `batches`, forward only through the pipeline; the same number on every rank."""
        stage = model.module if hasattr(model, "module") else model
        stage.eval()
        losses = []
        for batch in batches:
            _, y, _ = _triple(batch)
            out = self.forward_only(stage, batch, head=lambda z: loss_fn(z, y.to(z.device)))
            t = torch.zeros((), device=self.mesh.device) if out is None else out.float()
            losses.append(self.mesh.cp.mean(_from_last(t, self.pp, self.schedule)).item())  # cp: tokens split
        stage.train()
        return sum(losses) / len(losses)


def _triple(batch):
    x, y, *positions = batch
    return x, y, (positions[0] if positions else None)


def _from_last(t, pp, schedule):
    """`t` as the rank holding the last stage has it, on every rank of the pp axis."""
    t = t.detach().clone()
    if pp.size > 1:
        pp.broadcast(t, index=schedule.where(schedule.stages - 1)[0])
    return t


class PipelineSampler(nn.Module):
    """ids -> logits over the whole vocabulary on every rank, through the pipeline (text generation).
    `head(x)` turns the last stage's output into full-vocabulary logits (a tp gather, or nothing)."""

    def __init__(self, stage, pipeline, head=None):
        super().__init__()
        self.stage, self.pipeline, self.head = stage, pipeline, head
        self.config = stage.config

    def forward(self, ids):
        s, n = ids.shape[1], self.pipeline.seq_div
        if s % n:  # sequence parallel: pad on the right to a multiple of tp (causal: earlier logits unchanged)
            ids = F.pad(ids, (0, n - s % n))
        out = self.pipeline.forward_only(self.stage, (ids, ids), head=self.head)
        t = out.float() if out is not None else torch.zeros(ids.shape + (self.config.vocab_size,), device=ids.device)
        return _from_last(t, self.pipeline.pp, self.pipeline.schedule)[:, :s]


# ========================================================================================== the rules
def check(cfg, model_config):
    """Pipeline parallelism's own rules: the one-sentence problem with these settings, or None (which strategies
    combine with it: picotron.parallelize.combination_problem)."""
    if cfg.pp == 1:
        return None
    v = chunks_of(cfg.pp_schedule, cfg.pp_chunks)
    if cfg.pp_chunks > 1 and cfg.pp_schedule != "interleaved":
        return (f"pp_chunks={cfg.pp_chunks} applies to the interleaved schedule only (zb-v always uses 2, the others 1); "
                f"pass --pp-schedule interleaved or drop --pp-chunks.")
    if cfg.pp_schedule == "interleaved" and cfg.pp_chunks == 1:
        return ("pp_schedule='interleaved' with pp_chunks=1 is plain 1F1B; pass --pp-chunks 2 (or more) for "
                "interleaving, or --pp-schedule 1f1b.")
    L = model_config.num_hidden_layers
    if cfg.pp * v > L:
        return (f"pp={cfg.pp} with {v} chunk{'s' if v > 1 else ''} per rank needs {cfg.pp * v} stages of at least one "
                f"layer each but the model has num_hidden_layers={L}; pick pp <= {max(1, L // v)}"
                + (" or fewer --pp-chunks." if cfg.pp_schedule == "interleaved" else "."))
    if cfg.pp_schedule == "interleaved" and cfg.grad_acc % cfg.pp:
        return (f"the interleaved schedule needs grad_acc={cfg.grad_acc} (the micro-batches of a step) to be a "
                f"multiple of pp={cfg.pp}; pass --grad-acc {cfg.pp * max(1, cfg.grad_acc // cfg.pp)}.")
    return None
