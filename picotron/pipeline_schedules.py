"""Pipeline schedules as data, and the arithmetic around them: pure Python (no torch), so the planner
(picotron.planner, picotron.plan) and the lessons use them without a process group.

With p stages, m micro-batches and t_F, t_B the time of one micro-batch's forward and backward on one stage
(a stage waiting for its neighbour is idle: the *bubble*):

    AFAB / 1F1B      time = (m + p - 1)(t_F + t_B)        bubble = (p-1)/(m+p-1) of the time
    interleaved (v)  the bubble shrinks v-fold: (p-1)/(v·m + p-1), for v× the point-to-point messages
    ZB-H1            B split into B (input gradient) and W (weight gradient); the W's fill the cool-down:
                     with t_F = t_B = t_W the bubble is (p-1)/(3m + p-1), at 1F1B's memory
    ZB-V             two chunks per rank in a V (rank r holds stages r and 2p-1-r), W's fill the rest
    DualPipe         p stages, each on two ranks: half the micro-batches enter at rank 0, half at rank p-1;
                     idle (p/2 - 1)(F&B + B - 3W) per rank (DeepSeek-V3 report, Table 2), 2x the parameters

(The Ultra-Scale Playbook writes the bubble relative to the ideal time, (p-1)/m for 1F1B: the same idle
time divided by m(t_F + t_B) instead of the total. Both are in the lesson.)

A schedule is data. For each rank, the ordered list of its `Action`s: F (forward), B (backward; with a
split schedule only the input gradient) and W (the weight gradient) of micro-batch `mb` on the rank's chunk
`chunk`. The sends and receives are implied: F on stage s > 0 receives the activation from stage s-1, F on a
stage before the last sends its output on; B receives the output gradient from stage s+1 and sends its input
gradient to stage s-1. The generators below are pure functions of (p, m, v); `simulate` runs any schedule on
an ideal machine (F, B, W taking given times, messages instant) and refuses a wrong one with the first
problem: an action missing or twice, a B before its F, a W before its B, or a deadlock (which ranks wait for
what). `bubble_formula` is the closed form; `split_layers` cuts the layers into stages of nearly equal cost.
Real processes run a schedule in picotron.pipeline_parallel (`Pipeline`).

Activations in flight: AFAB keeps all m micro-batches' activations until the backward starts; 1F1B starts
backward as soon as the first micro-batch has come back, so stage i keeps at most p - i
(`simulate(...).peak_alive`).
"""
import math
from collections import namedtuple
from dataclasses import dataclass, field

from picotron.config import PP_SCHEDULES as SCHEDULES  # --pp-schedule's values (config: a leaf, no torch)

# ============================================================================================ schedules
Action = namedtuple("Action", "kind mb chunk")  # kind "F" | "B" | "W"; micro-batch; chunk on this rank
Action.__repr__ = lambda a: f"{a.kind}{a.mb}" + (f".{a.chunk}" if a.chunk else "")

class ScheduleError(ValueError):
    """A schedule that cannot run: the message names the first wrong action or the deadlock."""


@dataclass
class Schedule:
    """Every rank's ordered actions. `v` chunks per rank; `shape` "loop" (chunk c of rank r is stage
    c·p + r, Megatron's interleaving), "v" (chunk 0 is stage r, chunk 1 stage 2p-1-r) or "dual" (DualPipe:
    p stages, chunk 0 is stage r, chunk 1 stage p-1-r, a copy of rank p-1-r's chunk 0); `split`: the
    backward is cut into B (input gradient) and W (weight gradient).

    Where a stage lives can depend on the micro-batch: in "dual" micro-batches 0..m/2-1 travel from rank 0
    to rank p-1 on the chunks 0 (direction 0), the others from rank p-1 to rank 0 on the chunks 1
    (`direction(mb)`). Every other shape has one direction and one place per stage."""
    name: str
    p: int
    m: int
    v: int
    ranks: list
    split: bool = False
    shape: str = "loop"

    @property
    def stages(self):
        return self.p if self.shape == "dual" else self.p * self.v

    @property
    def copies(self):
        """Every stage held twice (DualPipe): rank r's chunk 1 is a copy of rank p-1-r's chunk 0. What the executor
        and the placements read (copies placed as such, their gradients summed: pipeline_parallel.sum_copies; the
        loss on two last stages), so no code outside this file asks which shape a schedule has."""
        return self.shape == "dual"

    def stage(self, rank, chunk):
        if self.shape == "v":
            return rank if chunk == 0 else 2 * self.p - 1 - rank
        if self.shape == "dual":
            return rank if chunk == 0 else self.p - 1 - rank
        return chunk * self.p + rank

    def direction(self, mb):
        """0, or 1 for a DualPipe micro-batch that enters at the last rank."""
        return int(self.shape == "dual" and mb >= self.m // 2)

    def where(self, stage, mb=0):
        """(rank, chunk) holding `stage` for micro-batch `mb` (the canonical place, direction 0, by default)."""
        if self.shape == "v":
            return (stage, 0) if stage < self.p else (2 * self.p - 1 - stage, 1)
        if self.shape == "dual":
            return (stage, 0) if self.direction(mb) == 0 else (self.p - 1 - stage, 1)
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


def dualpipe(p, m):
    """DualPipe (DeepSeek-V3 technical report, section 3.2.1, Figure 5): p stages, rank r holding stage r
    (chunk 0) and a copy of stage p-1-r (chunk 1). Micro-batches 0..m/2-1 enter at rank 0 and travel on the
    chunks 0; m/2..m-1 enter at rank p-1 and travel back on the chunks 1 (`Schedule.direction`). Both ends of
    the pipeline start at once, and a forward of one direction is paired with a backward of the other (F&B:
    overlapped on a GPU, back to back here). Needs p even and m even with m >= 2p.

    Rank r's phases, h = min(r, p-1-r) its distance from the nearer end, "near" the direction that enters at
    that end (chunk 0 on the first half of the ranks, chunk 1 on the second), "far" the other, n = m/2:
      1  2(p/2-h-1) forwards of near                     (its micro-batches are the first to arrive)
      2  h+1 times F near, F far
      3  p/2-h-1 times B, W, F of far                    (W at once: nothing else to do yet)
      4  n-p+h+1 times F near, B far (+W), F far, B near (+W)   (the steady state: two F&B pairs)
      5  p/2-h-1 times B far (+W), F far, B near (+W)
      6  h+1 times B far, B near; from half-way on their W's wait for the next phases
      7  p/2-h-1 times a held W, B near (W held)
      8  the held W's
    Each B is B then W at once, except where held: the W's then fill the drain, as in zero bubble."""
    if p % 2 or m % 2 or m < 2 * p:
        raise ScheduleError(f"DualPipe needs an even pp and an even number of micro-batches m >= 2·pp (half enter at "
                            f"each end), got pp={p}, m={m}; pick an even pp and --grad-acc {max(2 * p, m + m % 2)}.")
    half, n = p // 2, m // 2
    ranks = []
    for r in range(p):
        h = min(r, p - 1 - r)
        flip = int(r >= half)  # phase 0 (near) is chunk 0 on the first half of the ranks, chunk 1 on the second
        acts, f, b, held = [], [0, 0], [0, 0], []

        def fwd(ph):
            c = ph ^ flip
            acts.append(Action("F", c * n + f[ph], c))
            f[ph] += 1

        def bwd(ph, hold=False):  # B, and its W now or later
            c = ph ^ flip
            acts.append(Action("B", c * n + b[ph], c))
            (held if hold else acts).append(Action("W", c * n + b[ph], c))
            b[ph] += 1

        for _ in range(2 * (half - h - 1)):
            fwd(0)
        for _ in range(h + 1):
            fwd(0), fwd(1)
        for _ in range(half - h - 1):
            bwd(1), fwd(1)
        for _ in range(n - p + h + 1):
            fwd(0), bwd(1), fwd(1), bwd(0)
        for _ in range(half - h - 1):
            bwd(1), fwd(1), bwd(0)
        hold = False
        for i in range(h + 1):
            hold = hold or (i == (h + 1) // 2 and h % 2 == 1)
            bwd(1, hold)
            hold = hold or (i == (h + 1) // 2 and h % 2 == 0)
            bwd(0, hold)
        for _ in range(half - h - 1):
            acts.append(held.pop(0))
            bwd(0, True)
        acts += held
        ranks.append(acts)
    return Schedule("dualpipe", p, m, 2, ranks, split=True, shape="dual")


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
    if name == "dualpipe":
        return dualpipe(p, m)
    raise ScheduleError(f"unknown pipeline schedule {name!r}; pick one of {', '.join(SCHEDULES)}.")


def chunks_of(name, v):
    """Chunks per rank a schedule uses: v for interleaved, 2 for the V shape and DualPipe, else 1."""
    return v if name == "interleaved" else 2 if name in ("zb-v", "dualpipe") else 1


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


def simulate(schedule, cost=None, latency=0.0, pairs=False):
    """Run `schedule` on an ideal machine: each rank executes its list in order, an action starting when the
    rank is free and its inputs have arrived (`latency` after they were produced on another rank). `cost`:
    {"F": t_F, "B": t_B, "W": t_W} (default F 1, B 2; split: 1, 1, 1), or a function (action, rank) -> time.
    `pairs`: DualPipe's F&B, a forward followed by the other chunk's B (and its W), runs as one unit, as when
    the two overlap on a GPU: it starts when both inputs are there and both outputs leave at its end (its
    length here is still the sum: nothing overlaps). Without it each action's output leaves at its own end.
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
            if sch.where(key[2], a.mb) != (r, a.chunk):  # DualPipe: each direction on its own chunks
                raise ScheduleError(f"rank {r}, action {k} ({a!r}): micro-batch {a.mb} goes through stage {key[2]} on "
                                    f"rank {sch.where(key[2], a.mb)[0]}, chunk {sch.where(key[2], a.mb)[1]}.")
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
                    r, c = sch.where(s, i)
                    raise ScheduleError(f"rank {r} never runs {kind} of micro-batch {i} on its chunk {c} (stage {s}).")

    def needs(a, r):
        s = sch.stage(r, a.chunk)
        if a.kind == "F":
            return [("F", a.mb, s - 1)] if s > 0 else []
        if a.kind == "B":
            return [("F", a.mb, s)] + ([("B", a.mb, s + 1)] if s < sch.stages - 1 else [])
        return [("B", a.mb, s)]

    def unit(r, k):
        """How many actions from rank r's k-th run as one: 1, or with `pairs` an F, the other chunk's B and its W."""
        acts = sch.ranks[r]
        if not pairs or acts[k].kind != "F" or k + 1 == len(acts) or acts[k + 1].kind != "B" \
                or acts[k + 1].chunk == acts[k].chunk:
            return 1
        b = acts[k + 1]
        return 3 if k + 2 < len(acts) and acts[k + 2] == Action("W", b.mb, b.chunk) else 2

    finish, pos, free = {}, [0] * p, [0.0] * p
    timeline = [[] for _ in range(p)]
    alive, peak = [0] * p, [0] * p
    remaining = sum(len(a) for a in sch.ranks)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(sch.ranks[r]):
                group = sch.ranks[r][pos[r]:pos[r] + unit(r, pos[r])]
                keys = [(a.kind, a.mb, sch.stage(r, a.chunk)) for a in group]
                deps = [d for a in group for d in needs(a, r) if d not in keys]
                if any(d not in finish for d in deps):
                    break
                arrive = [finish[d] + (latency if sch.where(d[2], d[1])[0] != r else 0.0) for d in deps]
                start = end = max([free[r]] + arrive)
                for a in group:  # one after the other; a pair's outputs all leave at its end
                    timeline[r].append((a, end, end + costs(a, r)))
                    end += costs(a, r)
                    alive[r] += 1 if a.kind == "F" else -1 if a.kind == ("W" if sch.split else "B") else 0
                    peak[r] = max(peak[r], alive[r])
                for key in keys:
                    finish[key] = end
                free[r] = end
                pos[r] += len(group)
                remaining -= len(group)
                progressed = True
        if not progressed:
            stuck = []
            for r in range(p):
                if pos[r] < len(sch.ranks[r]):
                    a = sch.ranks[r][pos[r]]
                    missing = [d for d in needs(a, r) if d not in finish][0]
                    src, c = sch.where(missing[2], missing[1])
                    stuck.append(f"rank {r} waits at {a!r} for {missing[0]}{missing[1]} of stage {missing[2]} "
                                 f"(rank {src}, chunk {c})")
            raise ScheduleError("deadlock: " + "; ".join(stuck) + ".")
    makespan = max(free)
    busy = [sum(e - s for _, s, e in t) for t in timeline]
    return Simulation(timeline, makespan, busy, peak)


def bubble_formula(name, p, m, v=1):
    """The idle fraction of a step's time when stages are equal, messages instant, and t_B = 2 t_F (split:
    t_F = t_B = t_W): (p-1)/(m+p-1) for AFAB and 1F1B, (p-1)/(v·m+p-1) interleaved, (p-1)/(3m+p-1) ZB-H1
    (m >= p), (p-2)/(3m+p-2) DualPipe (m >= 2p: `dualpipe_idle` with t = 1 over the step's 3m + idle; as the
    simulator finds it with `pairs`). ZB-V has no closed form here: its value is the simulator's."""
    if name == "dualpipe":
        return dualpipe_idle(p) / (3 * m + dualpipe_idle(p))
    if name in ("afab", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    raise ValueError(f"no closed-form bubble for {name!r}; use simulate(build(...)).bubble.")


def dualpipe_idle(p, t_f=1.0, t_b=1.0, t_w=1.0, t_fb=None):
    """DualPipe's idle time per rank in a step, (p/2 - 1)(F&B + B - 3W) (DeepSeek-V3 report, Table 2), where B
    there is the whole backward (t_b + t_w: input and weight gradients) and F&B a forward and a backward
    overlapped; `t_fb` None: nothing overlaps, F&B = t_f + t_b + t_w (the pair back to back)."""
    t_fb = t_f + t_b + t_w if t_fb is None else t_fb
    return (p / 2 - 1) * (t_fb + (t_b + t_w) - 3 * t_w)


# ============================================================================================= messages
Message = namedtuple("Message", "op kind mb chunk peer")  # op "send" | "recv"; kind "F" (an activation) or "B" (a
Message.__repr__ = lambda m: (f"{'S' if m.op == 'send' else 'R'}{m.kind}{m.mb}" + (f".{m.chunk}" if m.chunk else "")
                              + f"{'>' if m.op == 'send' else '<'}{m.peer}")  # gradient); this rank's chunk; peer rank


def with_messages(schedule):
    """Each rank's actions with its sends and receives placed between them, in ONE order that every rank follows:
    the order of the ideal timeline (`simulate`). Every message happens at one instant there, the moment its F
    or B ends, and both its ends see it at that instant: the sender right after that action, the receiver
    between the actions it runs before and after that moment. Sort every compute start and every message
    by time (a message before an action that starts at its instant: the action may need it) and deal them out
    to the ranks: each rank's list is then a piece of one global sequence, so when each rank posts its
    messages in its list's order, every message's two ends meet, whatever runs beside them. This is NCCL's rule
    for several communicators ("operations submitted in the same order across ranks"), and what
    torch.distributed.pipelining's runtime does when it inserts its SEND/RECV actions into a simulated order.

    Only the order of the messages matters to NCCL, not where the computing actions fall between them, so each
    receive then moves up to just after the rank's previous message: it is posted as early as the one order
    allows, and the tensor arrives while the rank computes what comes before its use.

    Returns [[Action | Message, ...] per rank]: `Message(op, kind, mb, chunk, peer)` with `chunk` this rank's
    chunk that produced (send) or will consume (recv) the tensor. Between chunks of one rank (the V's turn)
    nothing is sent: the tensor is handed over in memory."""
    sim = simulate(schedule)
    sch, last = schedule, schedule.stages - 1
    events = []  # (time, 0 message | 1 action, rank, position, what)
    for r, timeline in enumerate(sim.timeline):
        for k, (a, start, end) in enumerate(timeline):
            events.append((start, 1, r, k, a))
            s = sch.stage(r, a.chunk)
            to = s + 1 if a.kind == "F" and s < last else s - 1 if a.kind == "B" and s > 0 else None
            if to is not None:
                dst, c = sch.where(to, a.mb)
                if dst != r:
                    events.append((end, 0, r, k, (Message("send", a.kind, a.mb, a.chunk, dst),
                                                  dst, Message("recv", a.kind, a.mb, c, r))))
    out = [[] for _ in range(sch.p)]
    last = [0] * sch.p  # where each rank's list had its latest message: a receive moves up to just after it
    for _, is_action, r, _, what in sorted(events, key=lambda e: e[:4]):
        if is_action:
            out[r].append(what)
        else:
            send, dst, recv = what
            out[r].append(send)
            last[r] = len(out[r])
            out[dst].insert(last[dst], recv)
            last[dst] += 1
    return out


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
