"""Lesson 07's experiments: pipeline parallelism measured through picotron's own seam (`parallelize`, as
picotron.train runs it), and the notebook's simulator helpers and plots.

    torchrun --nproc_per_node 2 lessons/07_pipeline_parallel/experiment.py [--only bubble,memory,parity,dualpipe]
        [--schedules afab,1f1b,...]   # bubble: only these schedules (default: all)
    torchrun --nproc_per_node 8 lessons/07_pipeline_parallel/experiment.py   # pp = 8, 16 layers (at_world)
    PICOTRON_FAST=1 ...    # short settings (the notebook's FAST mode)

Rank 0 writes OUT/<name>_pp<p>.json. dualpipe: ZB-V and DualPipe timed as in bubble at one m, and the parameter
bytes each rank holds under DualPipe against 1F1B's.
bubble: every schedule (AFAB, 1F1B, interleaved v=2, ZB-H1, ZB-V) for several
micro-batch counts m, each step's actions timed on every rank (a Timeline listening to the executor's phases), the
wait for a message cut out of the action it happened in; from that the measured bubble, each kind of action's mean
time, the point-to-point bytes per step and the Gantt chart of the last step. memory: one step per schedule with every tensor
autograd saves tracked while it is alive (saved-tensor hooks whose packed objects say when autograd lets them go),
the weight-gradient store's stash added: the peak per stage against the schedule's prediction. parity:
picotron.train at pp = world size for each schedule (and tied embeddings) against one process, trained in rank 0.
"""
import os
import statistics
import sys
import time
import weakref
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/
import _common  # noqa: E402  (puts the repository root on sys.path)
from _common import gather, make_cfg, say  # noqa: E402
from _plots import FONT, legend_below, plot_parity_below  # noqa: E402  (figure helpers several lessons share)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from picotron import marks, metrics, pipeline_schedules as ps  # noqa: E402
from picotron.mesh import Mesh  # noqa: E402
from picotron.parallelize import parallelize  # noqa: E402
from picotron.train import load_data, train  # noqa: E402

MiB = 2**20
SCHEDULES = ("afab", "1f1b", "interleaved", "zb-h1", "zb-v")
FORMULA = ("afab", "1f1b", "interleaved", "zb-h1")  # the ones with a closed-form bubble
LABELS = {"afab": "AFAB (GPipe)", "1f1b": "1F1B", "interleaved": "interleaved, v=2", "zb-h1": "ZB-H1", "zb-v": "ZB-V",
          "dualpipe": "DualPipe"}
KIND_COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}


def settings(fast, device_type=None):
    """The experiments' model (the lessons' 'small' one with 8 layers: 4 per stage at pp=2, 2 per chunk interleaved;
    its LM head over 256 byte tokens costs 8% of a layer, so the stages cost nearly the same) and batches; on GPUs
    _common.GPU_SETTINGS["07_pipeline_parallel"] on top (device_type: the mesh's, else _common.device())."""
    st = dict(size="small", layers=8, seq_len=128, micro_batch_size=2, ms=(2, 4, 8) if fast else (2, 4, 8, 16),
              steps=3 if fast else 6, max_steps=10 if fast else 20, quiet=0.15, warmup=1, parity_steps=10 if fast else 20, parity_seq_len=32, parity_layers=4,
              parity_grad_acc=4, dual_m=8 if fast else 16)
    return _common.sized("07_pipeline_parallel", st, fast, device_type)


def at_world(st, p):
    """The settings on p stages: every schedule needs a layer per chunk (interleaved v = 2, ZB-V and DualPipe: 2p
    chunks), interleaved a multiple of p micro-batches and DualPipe at least 2p; at p = 2 (the lesson's) they change
    nothing, at p = 8 (PICOTRON_NPROC=8) the model has 16 layers."""
    ga = -(-st["parity_grad_acc"] // p) * p  # the next multiple of p
    return dict(st, layers=max(st["layers"], 2 * p), parity_layers=max(st["parity_layers"], 2 * p), parity_grad_acc=ga,
                dual_m=max(st["dual_m"], 2 * p))


def cfg_for(st, name, m, p, **kw):
    """The experiments' Config for schedule `name` over m micro-batches on p stages."""
    return make_cfg(st["size"], num_hidden_layers=st["layers"], seq_len=st["seq_len"],
                    micro_batch_size=st["micro_batch_size"], pp=p, pp_schedule=name, grad_acc=m,
                    pp_chunks=2 if name == "interleaved" else 1, **kw)


def chunks(name):
    return ps.chunks_of(name, 2)


# ------------------------------------------------------------------------------- the schedule's side
def simulated(name, p, m, v=None, cost=None, latency=0.0):
    """pipeline_schedules.simulate of schedule `name` (v: chunks per rank, default its own)."""
    return ps.simulate(ps.build(name, p, m, chunks(name) if v is None else v), cost=cost, latency=latency)


def formula(name, p, m, v=2):
    """The closed-form bubble (fraction of the step), or None (ZB-V has none)."""
    return ps.bubble_formula(name, p, m, v) if name in FORMULA else None


def zb_h1_formula(p, m, t_f, t_b, t_w):
    """ZB-H1's closed form for any t_F, t_B, t_W (docs/reference.md): step m(t_F + t_B + t_W) + (p-1)(t_F + t_B - t_W),
    work m(t_F + t_B + t_W) per rank; with t_F = t_B = t_W it is (p-1)/(3m+p-1)."""
    idle = (p - 1) * (t_f + t_b - t_w)
    return idle / (m * (t_f + t_b + t_w) + idle)


def dualpipe_formula(p, m, t_f, t_b, t_w):
    """DualPipe's Table-2 idle (p/2 - 1)(F&B + B - 3W), B the whole backward t_B + t_W, F&B = t_F + t_B + t_W (nothing
    overlaps here), as a fraction of the step m(t_F + t_B + t_W) + idle (pipeline_schedules.dualpipe_idle)."""
    idle = ps.dualpipe_idle(p, t_f, t_b, t_w)
    return idle / (m * (t_f + t_b + t_w) + idle)


def predicted_peak(schedule, rank, per_chunk, stash=None):
    """The most activation bytes `rank` holds at once if it keeps each chunk's `per_chunk[c]` bytes from a
    micro-batch's F until its B (split schedules: until its W): the schedule's own prediction. With `stash`
    (split schedules: {chunk: bytes the weight-gradient store keeps from a B until its W}), B frees the forward's
    bytes and keeps the stash instead."""
    alive, peak = 0, 0
    release = "W" if schedule.split and stash is None else "B"
    for a in schedule.ranks[rank]:
        c = a.chunk
        if a.kind == "F":
            alive += per_chunk[c]
        elif a.kind == release:
            alive -= per_chunk[c]
        if stash is not None:
            alive += stash[c] if a.kind == "B" else -stash[c] if a.kind == "W" else 0
        peak = max(peak, alive)
    return peak


def p2p_formula(name, p, m, b, s, h, elem=4):
    """Bytes sent per step, all ranks together: every stage boundary carries each micro-batch's activation forward
    and its gradient back, b·s·h numbers each, fp32: 2(S-1)·m·b·s·h·4 for S = p·v stages; with the V shape the
    boundary in the V's turn (stage p-1 -> p) stays on one rank: 2(S-2)·m·b·s·h·4."""
    v = chunks(name)
    boundaries = p * v - 1 - (1 if name == "zb-v" else 0) if name != "dualpipe" else p - 1  # DualPipe: p stages
    return 2 * boundaries * m * b * s * h * elem


def messages_of(schedule, rank):
    """(sends, receives) that `rank`'s action list implies, derived here from the list alone (not by the executor):
    an F sends its output on unless its stage is the last, a B sends its input's gradient back unless its stage is
    the first, each receiving what its neighbour stage sends it; a neighbour stage on the same rank (the V's turn)
    is handed over in memory, no message. W's carry nothing."""
    sends = recvs = 0
    last = schedule.stages - 1
    for a in schedule.ranks[rank]:
        s = schedule.stage(rank, a.chunk)
        if a.kind == "F":
            sends += s < last and schedule.where(s + 1, a.mb)[0] != rank
            recvs += s > 0 and schedule.where(s - 1, a.mb)[0] != rank
        elif a.kind == "B":
            sends += s > 0 and schedule.where(s - 1, a.mb)[0] != rank
            recvs += s < last and schedule.where(s + 1, a.mb)[0] != rank
    return sends, recvs


def message_problems(schedule, counted):
    """Where the messages the executor posted (`counted[r]` = (sends, receives) of rank r in one step, from the
    recorder) differ from those its list implies (messages_of): one line per rank that differs, [] when all agree."""
    out = []
    for r, got in enumerate(counted):
        want = messages_of(schedule, r)
        if tuple(got) != want:
            out.append(f"rank {r}: posted {got[0]} sends, {got[1]} receives; its list implies {want[0]}, {want[1]}")
    return out


# ------------------------------------------------------------------------------------------- measuring
class CpuTimeline(metrics.Timeline):
    """A Timeline whose events also carry the CPU time this thread spent inside them (`cpu`): an action's wall time
    minus its CPU time minus its wait for a message is time the process was runnable but had no core."""

    @contextmanager
    def record(self, name, **info):
        c0 = time.thread_time()
        with super().record(name, **info) as event:
            yield event
        event["cpu"] = time.thread_time() - c0


class Stepper:
    """One schedule built as picotron.train builds it (`parallelize`), stepped as it steps (schedule.run, clipping,
    optimizer step, zero_grad), with a Timeline listening to the executor's phases: each action becomes one event;
    a receive waited on inside an action is recorded too (the executor's `_receive`, wrapped on this instance
    only), so that `busy` can leave the wait out."""

    def __init__(self, cfg, mesh):
        self.cfg, self.mesh = cfg, mesh
        self.sent = metrics.Recorder()  # counts the executor's messages (Axis.exchange on the pipeline links)
        self.run = parallelize(cfg, mesh, recorder=self.sent)
        self.pipe = self.run.schedule
        self.listen(CpuTimeline(mesh.device, mesh.rank))
        receive = self.pipe._receive

        def timed(a):
            t0 = self.tl.now()
            x = receive(a)
            self.tl.add("wait", t0, self.tl.now(), micro=a.mb, chunk=a.chunk, of=a.kind)
            return x
        self.pipe._receive = timed
        self.loader = load_data(cfg, mesh)[1]
        self.losses = []

    def listen(self, timeline):
        """The executor's phases recorded on `timeline` (outermost), and counted as picotron.train counts them
        (`activations`, a metrics.ActivationPeak: the executor's count of its activations)."""
        self.tl = timeline
        self.pipe.phases.forget()
        self.pipe.phases.listen(timeline.record)
        self.activations = self.pipe.phases.listen(metrics.ActivationPeak(self.run.raw))

    def step(self, step):
        """One step; returns this rank's events (absolute seconds: comparable across processes on one machine,
        perf_counter being the system's monotonic clock), the bytes it sent and its _common.LoadWindow reading (what
        tells, with the other ranks', how much of the machine other programs used during the step)."""
        run = self.run
        dist.barrier(self.mesh.pp.group)
        self.tl.events.clear()
        self.sent.reset()
        window = _common.LoadWindow()
        loss = self.pipe.run(run.model, self.loader.micro_batches(step), run.loss_fn)
        marks.clip_grad_norm(run.params, self.cfg.grad_clip, self.mesh)
        run.optimizer.step()
        run.model.zero_grad(set_to_none=True)
        load = window.stop()
        self.losses.append(loss.item())
        # what the executor posted, as the recorder saw it: a send's batch carries bytes, a receive's none
        self.messages = (sum(1 for kind, nbytes, _ in self.sent.log if kind == "send" and nbytes > 0),
                         sum(1 for kind, nbytes, _ in self.sent.log if kind == "send" and nbytes == 0))
        events = [dict(e, start=e["start"] + self.tl.t0, end=e["end"] + self.tl.t0) for e in self.tl.events]
        return events, self.sent.bytes.get("send", 0), load


KIND = {"forward": "F", "backward": "B", "weight": "W"}


def actions(events):
    """[(rank, kind, mb, chunk, start, compute_start, end, cpu)] from every rank's events: an action's compute starts
    when the wait for its message (if any) inside it ended; cpu: the CPU seconds the action used."""
    waits = {(e["rank"], e["of"], e["micro"], e["chunk"]): e for e in events if e["name"] == "wait"}
    out = []
    for e in events:
        if e["name"] in KIND:
            k = KIND[e["name"]]
            w = waits.get((e["rank"], k, e["micro"], e["chunk"]))
            out.append((e["rank"], k, e["micro"], e["chunk"], e["start"], w["end"] if w else e["start"], e["end"],
                        e.get("cpu", 0.0)))
    return sorted(out, key=lambda x: (x[0], x[4]))


def disturbance(acts, p):
    """The share of the step's rank-time in which a rank had work but no core (another program ran): inside each
    action, its compute time minus the CPU time it got; between two actions of a rank, the gap (the executor needs
    well under a millisecond there). 0 on a quiet machine."""
    t0, t1 = min(a[4] for a in acts), max(a[6] for a in acts)
    lost = sum(max(0.0, (a[6] - a[5]) - a[7]) for a in acts)
    for r in range(p):
        mine = [a for a in acts if a[0] == r]
        lost += sum(max(0.0, b[4] - a[6] - 1e-3) for a, b in zip(mine, mine[1:]))
    return lost / (p * (t1 - t0))


def spread(acts):
    """The largest, over the kinds of action, relative standard deviation of that kind's compute times in one step,
    all ranks and micro-batches together: a few percent when every stage computes at the same speed all step long
    (ours cost the same); more when another program slowed one rank for a while, without taking its core."""
    out = 0.0
    for k in "FBW":
        d = [a[6] - a[5] for a in acts if a[1] == k]
        if len(d) > 1:
            out = max(out, statistics.pstdev(d) / statistics.mean(d))
    return out


def quality(acts, p, share=0.0):
    """How far a step is from a quiet machine's: its disturbance (rank-time without a core) plus its spread plus
    `share`, the share of the machine's cores other programs used during it (_common.others_share): a program that
    keeps a core busy also delays the messages (gloo moves them with threads that need a core), which the actions'
    own times do not show."""
    return disturbance(acts, p) + spread(acts) + share


def measured_bubble(acts, p):
    """1 - (busy time summed over ranks) / (ranks x step time); the step: first action's start to last one's end."""
    t0, t1 = min(a[4] for a in acts), max(a[6] for a in acts)
    busy = sum(a[6] - a[5] for a in acts)
    return 1 - busy / (p * (t1 - t0)), t1 - t0


def mean_costs(acts_by_step, p, v):
    """{rank: {chunk: {kind: mean compute seconds}}} over the measured steps."""
    bins = {}
    for acts in acts_by_step:
        for r, k, _, c, _, c0, e, _ in acts:
            bins.setdefault((r, c, k), []).append(e - c0)
    return {r: {c: {k: statistics.mean(bins[(r, c, k)]) for k in "FBW" if (r, c, k) in bins} for c in range(v)}
            for r in range(p)}


def balance(acts):
    """The largest ratio, over the kinds of action, of the slowest to the fastest (rank, chunk)'s mean time in one
    step: 1.0 when every stage costs the same; a step in which another program took a core looks unbalanced."""
    times = {}
    for r, k, _, c, _, c0, e, _ in acts:
        times.setdefault(k, {}).setdefault((r, c), []).append(e - c0)
    return max(max(means) / min(means) for means in
               ([statistics.mean(x) for x in by.values()] for by in times.values()))


def latency_of(acts, schedule):
    """The median delay from a message's producer finishing to its consumer starting to compute, over the messages
    the consumer waited for (a wait longer than 1 µs): what the simulator's `latency` stands for."""
    ends = {(r, k, mb, c): e for r, k, mb, c, _, _, e, _ in acts}
    delays = []
    for r, k, mb, c, s, c0, e, _ in acts:
        if c0 - s < 1e-6 or k == "W":
            continue
        stage = schedule.stage(r, c)
        src = stage - 1 if k == "F" else stage + 1
        sr, sc = schedule.where(src, mb)
        if sr != r and (sr, k, mb, sc) in ends:
            delays.append(c0 - ends[(sr, k, mb, sc)])
    return statistics.median(delays) if delays else 0.0


def exp_bubble(mesh, st, out):
    """Every schedule at every m of the settings (ZB-V: the largest m only): measured steps with their timelines."""
    p, rows = mesh.pp.size, []
    b, s, h = st["micro_batch_size"], st["seq_len"], _common.SIZES[st["size"]]["hidden_size"]
    for name in st.get("schedules", SCHEDULES):
        for m in (st["ms"] if name != "zb-v" else st["ms"][-1:]):
            if name == "interleaved" and m % p:
                continue
            stepper, steps, p2p, shares, messages = Stepper(cfg_for(st, name, m, p), mesh), [], [], [], []
            for k in range(st["warmup"] + st["max_steps"]):
                events, sent, load = stepper.step(k + 1)
                every = sum(gather(events, mesh), [])  # the same lists on every rank: they decide alike below
                total = sum(gather(sent, mesh))
                posted = gather(stepper.messages, mesh)  # (sends, receives) per rank
                share = _common.others_share(gather(load, mesh)) or 0.0
                if k >= st["warmup"]:
                    steps.append(actions(every))
                    p2p.append(total)
                    messages.append(posted)
                    shares.append(share)
                if len(steps) >= st["steps"] and min(map(quality, steps, [p] * len(steps), shares)) <= st["quiet"]:
                    break
            sch, v = stepper.pipe.schedule, chunks(name)
            bubbles = [measured_bubble(a, p) for a in steps]
            qualities = [quality(a, p, x) for a, x in zip(steps, shares)]
            quiet = [k for k in range(len(steps)) if qualities[k] <= st["quiet"]]
            # the shortest quiet step (a message delivered late lengthens a step without showing in its actions), or
            # the least disturbed one
            best = (min(quiet, key=lambda k: bubbles[k][1]) if quiet else
                    min(range(len(steps)), key=lambda k: qualities[k]))
            acts = steps[best]
            costs = mean_costs([acts], p, v)
            lat = latency_of(acts, sch)
            sim = ps.simulate(sch, cost=lambda a, r: costs[r][a.chunk][a.kind])  # messages instant
            sim_lat = ps.simulate(sch, cost=lambda a, r: costs[r][a.chunk][a.kind], latency=lat)
            per_kind = {k: statistics.mean(costs[r][c][k] for r in range(p) for c in range(v) if k in costs[r][c])
                        for k in "FBW" if any(k in costs[r][c] for r in range(p) for c in range(v))}
            row = dict(name=name, m=m, p=p, v=v, bubble=bubbles[best][0], step_s=bubbles[best][1],
                       bubbles=[x[0] for x in bubbles], step_times=[x[1] for x in bubbles], balance=balance(acts),
                       disturbance=disturbance(acts, p), spread=spread(acts), qualities=qualities,
                       busy=shares[best], shares=shares,
                       formula=formula(name, p, m), sim_unit=simulated(name, p, m).bubble,
                       formula_costs=(zb_h1_formula(p, m, per_kind["F"], per_kind["B"], per_kind["W"])
                                      if name == "zb-h1" else
                                      dualpipe_formula(p, m, per_kind["F"], per_kind["B"], per_kind["W"])
                                      if name == "dualpipe" else formula(name, p, m)),
                       sim_measured=sim.bubble, sim_measured_latency=sim_lat.bubble, sim_makespan=sim.makespan,
                       sim_pairs=(ps.simulate(sch, cost=lambda a, r: costs[r][a.chunk][a.kind], pairs=True).bubble
                                  if sch.shape == "dual" else None),
                       latency=lat, costs={str(r): {str(c): x for c, x in cs.items()} for r, cs in costs.items()},
                       per_kind=per_kind, p2p=p2p, p2p_formula=p2p_formula(name, p, m, b, s, h), messages=messages,
                       messages_of_list=[messages_of(sch, r) for r in range(p)],
                       gantt=acts, losses=stepper.losses)
            rows.append(row)
            say(mesh, f"{LABELS[name]:<17} m={m:<3} bubble measured {row['bubble']:6.1%} | formula "
                       + (f"{row['formula']:6.1%}" if row["formula"] is not None else "  --  ")
                       + f" | simulated with measured costs {row['sim_measured']:6.1%} | step {1e3 * row['step_s']:6.0f} ms"
                       f" | t_F {1e3 * per_kind['F']:.1f} t_B {1e3 * per_kind['B']:.1f}"
                       + (f" t_W {1e3 * per_kind['W']:.1f}" if "W" in per_kind else "") + " ms"
                       f" | p2p {row['p2p'][-1] / MiB:.2f} MiB/step (formula {row['p2p_formula'] / MiB:.2f})"
                       f" | other programs {row['busy']:.0%} of the cores")
            del stepper
    return dict(rows=rows, b=b, s=s, h=h)


# --------------------------------------------------------------------------------------- live activations
class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


class LiveActivations:
    """The bytes of every tensor autograd keeps for backward, while it keeps it: a saved-tensor pack hook hands
    autograd a small holder instead of the tensor, and the holder's finalizer runs when autograd lets it go (after
    the node's backward ran). Storages are counted once however many holders share them; parameters are not
    activations. `bytes` now, `peak` since `reset_peak()`."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live = {}  # storage pointer -> [bytes, holders]
        self.bytes = self.peak = 0

    def pack(self, t):
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in self.params or nbytes == 0 or t.device.type == "meta":
            return t
        entry = self.live.setdefault(ptr, [nbytes, 0])
        if entry[1] == 0:
            self.bytes += nbytes
            self.peak = max(self.peak, self.bytes)
        entry[1] += 1
        held = _Held(t)
        weakref.finalize(held, self._drop, ptr)
        return held

    def _drop(self, ptr):
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= entry[0]
            del self.live[ptr]

    @staticmethod
    def unpack(x):
        return x.t if isinstance(x, _Held) else x

    def reset_peak(self):
        self.peak = self.bytes


@contextmanager
def tracking(tracker):
    """While inside: every saved tensor goes through `tracker`, also inside the ActivationCounter of the executor's
    count (metrics.ActivationPeak: the first micro-batch of each chunk; hooks nest, the innermost wins), whose count
    still runs."""
    original = metrics.ActivationCounter

    class Both(original):
        def __enter__(self):
            def pack(t):
                self._pack(t)
                return tracker.pack(t)
            self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, tracker.unpack)
            self._hooks.__enter__()
            return self

    metrics.ActivationCounter = Both
    hooks = torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack)
    try:
        with hooks:
            yield tracker
    finally:
        metrics.ActivationCounter = original


def stash_bytes(store, tracker):
    """Bytes the weight-gradient store keeps for the W's still to come (inputs and output gradients of the linear
    layers), counting only storages autograd no longer holds."""
    if store is None:
        return 0
    seen, total = set(), 0
    for items in store.queues.values():
        for _, x, g in items:
            for t in (x, g):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in seen and ptr not in tracker.live:
                    seen.add(ptr)
                    total += t.untyped_storage().nbytes()
    return total


class MemoryTimeline(metrics.Timeline):
    """A Timeline whose events also carry the live activation bytes: at the action's start, its peak inside and
    at its end (autograd's saved tensors plus the weight-gradient store's stash)."""

    def __init__(self, device, rank, tracker, store):
        super().__init__(device, rank)
        self.tracker, self.store = tracker, store

    @contextmanager
    def record(self, name, **info):
        tr = self.tracker
        stash0 = stash_bytes(self.store, tr)
        before = tr.bytes + stash0
        tr.reset_peak()
        with super().record(name, **info) as event:
            yield event
        stash = stash_bytes(self.store, tr)
        event.update(before=before, after=tr.bytes + stash, peak=max(before, tr.bytes + stash, tr.peak + min(stash0, stash)),
                     stash=stash - stash0, saved=tr.bytes - (before - stash0))


def exp_memory(mesh, st, out):
    """One step of each schedule (m = the largest of the settings) with live activations tracked: the peak per stage,
    each chunk's bytes per micro-batch (the growth over its first forward), the schedule's prediction from them and
    the executor's count (`metrics.ActivationPeak` on its phases, as picotron.train counts)."""
    p, rows = mesh.pp.size, []
    m = st["ms"][-1]
    for name in SCHEDULES:
        stepper = Stepper(cfg_for(st, name, m, p), mesh)
        stepper.step(1)  # warm-up
        tracker = LiveActivations(stepper.run.raw)
        stepper.listen(MemoryTimeline(mesh.device, mesh.rank, tracker, stepper.pipe.store))
        with tracking(tracker):
            events, _, _ = stepper.step(2)
        sch = stepper.pipe.schedule
        per_chunk, stash = {}, {}
        for e in events:
            if e["name"] == "forward" and e["chunk"] not in per_chunk:
                per_chunk[e["chunk"]] = e["after"] - e["before"]
            if e["name"] == "backward" and e["chunk"] not in stash:
                stash[e["chunk"]] = e["stash"]
        me = dict(rank=mesh.rank, peak=max(e["peak"] for e in events if e["name"] in KIND), per_chunk=per_chunk,
                  stash=stash if sch.split else None, predicted=predicted_peak(sch, mesh.pp.rank, per_chunk),
                  predicted_stash=predicted_peak(sch, mesh.pp.rank, per_chunk, stash) if sch.split else None,
                  executor=stepper.activations.bytes, left=tracker.bytes + stash_bytes(stepper.pipe.store, tracker),
                  curve=[(e["name"], e["micro"], e["chunk"], e["after"]) for e in events if e["name"] in KIND],
                  alive_units=simulated(name, p, m).peak_alive[mesh.pp.rank])
        ranks = gather(me, mesh)
        rows.append(dict(name=name, m=m, p=p, ranks=ranks))
        say(mesh, f"{LABELS[name]:<17} m={m}: peak activations per stage " + ", ".join(
            f"stage {r['rank']} {r['peak'] / MiB:.2f} MiB (predicted {r['predicted'] / MiB:.2f}"
            + (f", with the stash {r['predicted_stash'] / MiB:.2f}" if r["predicted_stash"] else "") + f", executor's count "
            f"{r['executor'] / MiB:.2f}; {r['alive_units']} micro-batches)" for r in ranks))
        del stepper
    return dict(rows=rows)


# --------------------------------------------------------------------------------------------- parity
def _trained(mesh, st, out, name, **kw):
    """picotron.train on `mesh` with the parity settings: (per-step losses on rank 0, what parallelize built)."""
    cfg = make_cfg(st["size"], num_hidden_layers=st["parity_layers"], steps=st["parity_steps"],
                   seq_len=st["parity_seq_len"], micro_batch_size=2, grad_acc=st["parity_grad_acc"], warmup_steps=2,
                   lr=3e-3, log_every=st["parity_steps"], out=str(Path(out) / name), **kw)
    _, run = train(cfg, mesh, return_model=True)
    losses = [r["loss"] for r in metrics.read_metrics(cfg.out)[0]] if mesh.rank == 0 else None
    return losses, run


def tied_copies(run, mesh):
    """(rank, name, weight) of the tied matrix on this rank: the first stage's embedding, the last stage's head."""
    out = []
    for chunk, s in zip(run.raw.chunks, run.raw.stage_ids):
        if chunk.embed_tokens is not None:
            out.append((s, "embed_tokens.weight", chunk.embed_tokens.weight.detach().clone()))
        if chunk.lm_head is not None:
            out.append((s, "lm_head.weight", chunk.lm_head.weight.detach().clone()))
    return out


def exp_parity(mesh, st, out):
    """picotron.train at pp = world size for every schedule, and 1F1B with tied embeddings; the references (pp=1, the
    same global batch) trained by rank 0 alone, in its own process."""
    p, result = mesh.pp.size, dict(losses={}, reference={})
    for name in SCHEDULES:
        kw = dict(pp=p, pp_schedule=name, pp_chunks=2 if name == "interleaved" else 1)
        result["losses"][name] = _trained(mesh, st, out, f"parity_{name}", **kw)[0]
    losses, run = _trained(mesh, st, out, "parity_tied", pp=p, pp_schedule="1f1b", tie_word_embeddings=True)
    result["losses"]["1f1b, tied"] = losses
    copies = sum(gather([(s, n, w.tolist()) for s, n, w in tied_copies(run, mesh)], mesh), [])
    if mesh.rank == 0:
        (_, n0, w0), (_, n1, w1) = sorted(copies)[0], sorted(copies)[-1]
        result["tied"] = dict(first=n0, last=n1, max_abs_diff=(torch.tensor(w0) - torch.tensor(w1)).abs().max().item())
        local = Mesh.local(mesh.device)
        result["reference"]["untied"] = _trained(local, st, out, "parity_reference")[0]
        result["reference"]["tied"] = _trained(local, st, out, "parity_reference_tied", tie_word_embeddings=True)[0]
    dist.barrier(mesh.pp.group)
    return result


def exp_dualpipe(mesh, st, out):
    """ZB-V and DualPipe at m = dual_m, timed as exp_bubble times them; and the parameter bytes on each rank under
    DualPipe (its stage and a copy of its mirror's) and under 1F1B (its stage), built as picotron.train builds them."""
    p, m = mesh.pp.size, st["dual_m"]
    rows = exp_bubble(mesh, dict(st, schedules=("zb-v", "dualpipe"), ms=(m,)), out)["rows"]
    held = {}
    for name in ("1f1b", "dualpipe"):
        run = parallelize(cfg_for(st, name, m, p), mesh)
        held[name] = gather(sum(q.numel() * q.element_size() for q in run.raw.parameters()), mesh)
        del run
    return dict(rows=rows, param_bytes=held)


EXPERIMENTS = ("bubble", "memory", "parity", "dualpipe")


def configs_at(nproc, fast=False):
    """The Configs the main run (bubble and memory: the notebook's `run("bubble,memory", nproc=...)`) and the parity
    run train on `nproc` processes (pp = nproc), at GPU size (GPU_SETTINGS on top: the 8-process mode is for a node of
    GPUs): every schedule at every m exp_bubble runs, then _trained's parity runs."""
    st = at_world(settings(fast, "cuda"), nproc)
    out = [cfg_for(st, name, m, nproc) for name in SCHEDULES
           for m in (st["ms"] if name != "zb-v" else st["ms"][-1:]) if not (name == "interleaved" and m % nproc)]
    for name in SCHEDULES:
        out.append(make_cfg(st["size"], num_hidden_layers=st["parity_layers"], steps=st["parity_steps"],
                            seq_len=st["parity_seq_len"], micro_batch_size=2, grad_acc=st["parity_grad_acc"],
                            pp=nproc, pp_schedule=name, pp_chunks=2 if name == "interleaved" else 1))
    return out


# ----------------------------------------------------------------------------- plots (for the notebook)
def draw_gantt(ax, bars, p, title="", span=None, labels=True):
    """bars: [(rank, kind, mb, chunk, start, end)]: one row per rank (rank 0 on top), F blue, B orange, W green;
    a second chunk drawn hatched; the micro-batch written in each bar wide enough for it."""
    from matplotlib.patches import Patch

    span = span or max(b[5] for b in bars)
    for r, k, mb, c, s, e in bars:
        ax.barh(r, e - s, left=s, height=0.8, color=KIND_COLORS[k], edgecolor="white", lw=0.4,
                hatch="///" if c else None)
        if labels and (e - s) > span / 60:
            ax.text((s + e) / 2, r, str(mb), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)], fontsize=FONT)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_title(title, fontsize=9, loc="left")
    ax.tick_params(axis="x", labelsize=FONT)
    return [Patch(color=KIND_COLORS[k], label=n) for k, n in (("F", "F forward"), ("B", "B backward (input grad "
            "when split)"), ("W", "W weight grad"))] + [Patch(facecolor="white", edgecolor="k", hatch="///",
                                                             label="second chunk")]


def sim_bars(sim):
    return [(r, a.kind, a.mb, a.chunk, s, e) for r, t in enumerate(sim.timeline) for a, s, e in t]


def measured_bars(acts):
    """Measured actions as bars (compute only: the wait inside an action is left blank), in ms from the step's start."""
    t0 = min(a[4] for a in acts)
    return [(r, k, mb, c, 1e3 * (c0 - t0), 1e3 * (e - t0)) for r, k, mb, c, _, c0, e, _ in acts]


def plot_gantt_pairs(rows, names=SCHEDULES, m=None):
    """One row per schedule: simulated with unit costs (t_F = 1, t_B = 2; split: 1, 1, 1) on the left, measured on
    the right (ms), at micro-batch count m where measured (else, and by default, the largest measured)."""
    import matplotlib.pyplot as plt

    def pick(n):
        mine = {r["m"]: r for r in rows if r["name"] == n}
        return mine.get(m, mine[max(mine)])
    picked = [pick(n) for n in names]
    fig, axes = plt.subplots(len(picked), 2, figsize=(13, 1.25 * sum(r["p"] for r in picked) / 2 + 0.9 * len(picked)),
                             squeeze=False)
    for (ax1, ax2), row in zip(axes, picked):
        sim = simulated(row["name"], row["p"], row["m"])
        handles = draw_gantt(ax1, sim_bars(sim), row["p"], f"{LABELS[row['name']]}, m={row['m']}: simulated, "
                             f"bubble {sim.bubble:.0%}")
        draw_gantt(ax2, measured_bars(row["gantt"]), row["p"], f"measured on {row['p']} processes (the kept one of "
                   f"{len(row['bubbles'])} steps): bubble {row['bubble']:.0%}, step {1e3 * row['step_s']:.0f} ms")
    axes[-1][0].set_xlabel("time (t_F = 1)", fontsize=FONT)
    axes[-1][1].set_xlabel("ms since the step's first action", fontsize=FONT)
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=FONT, frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def plot_bubbles(rows, p4=None):
    """Bubble against m per schedule: measured (markers; AFAB's filled, 1F1B's hollow and each schedule nudged
    sideways, so that equal values stay visible), the simulator with the measured costs (crosses), and the closed
    forms the checks use (lines): (p-1)/(m+p-1) for AFAB and 1F1B, (p-1)/(vm+p-1) interleaved, and for ZB-H1
    zb_h1_formula with each row's measured t_F, t_B, t_W (`formula_costs`, what its check compares); its equal-cost
    form (p-1)/(3m+p-1) dotted. Right: p = 4 from the simulator (unit costs) and the closed forms."""
    import matplotlib.pyplot as plt

    colors = {"afab": "#4c72b0", "1f1b": "#8172b2", "interleaved": "#c44e52", "zb-h1": "#55a868", "zb-v": "#dd8452"}
    marker = {"afab": ("o", 6, True), "1f1b": ("o", 11, False), "interleaved": ("s", 6, True),
              "zb-h1": ("D", 9, False), "zb-v": ("^", 7, True)}  # (marker, size, filled)
    nudge = {"afab": 0.96, "1f1b": 1.04, "interleaved": 0.96, "zb-h1": 1.04, "zb-v": 1.0}  # x factor (log axis)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    ax = axes[0]
    for name in SCHEDULES:
        rs = sorted((r for r in rows if r["name"] == name), key=lambda r: r["m"])
        if not rs:
            continue
        ms = [r["m"] for r in rs]
        xs = [m * nudge[name] for m in ms]
        mk, size, filled = marker[name]
        ax.plot(xs, [r["bubble"] for r in rs], mk, color=colors[name], ms=size, mew=1.5,
                mfc=colors[name] if filled else "none", label=f"{LABELS[name]} measured")
        ax.plot(xs, [r["sim_measured"] for r in rs], "x", color=colors[name], ms=7, mew=1.5)
        grid = range(min(ms), max(ms) + 1)
        if name in ("afab", "1f1b", "interleaved"):
            ax.plot(list(grid), [formula(name, rs[0]["p"], g) for g in grid], color=colors[name], lw=1, alpha=0.7,
                    ls="--" if name == "1f1b" else "-")
        elif name == "zb-h1":  # the check's formula: each row's measured t_F, t_B, t_W
            ax.plot(ms, [r["formula_costs"] for r in rs], "-", color=colors[name], lw=1.2, marker="_", ms=10,
                    label="ZB-H1, its check's form with the measured $t_F, t_B, t_W$:\n"
                          r"$(p-1)(t_F+t_B-t_W)\,/\,[m(t_F+t_B+t_W)+(p-1)(t_F+t_B-t_W)]$")
            ax.plot(list(grid), [formula(name, rs[0]["p"], g) for g in grid], ":", color=colors[name], lw=1,
                    label=r"ZB-H1 with $t_F=t_B=t_W$: $(p-1)/(3m+p-1)$")
    ax.plot([], [], "kx", label=r"simulated with the measured $t_F, t_B, t_W$")
    ax.plot([], [], "k-", lw=1, label=r"$(p-1)/(m+p-1)$: AFAB, 1F1B (dashed)")
    ax.plot([], [], "-", color=colors["interleaved"], lw=1, label=r"$(p-1)/(vm+p-1)$: interleaved, $v=2$")
    handles, labels = ax.get_legend_handles_labels()
    first = [k for k, x in enumerate(labels) if x.endswith(" measured")]  # column 1: the measurements
    order = first + [k for k in range(len(labels)) if k not in first]
    ax.set(xscale="log", xlabel="micro-batches m", ylabel="bubble (idle fraction of the step)", ylim=(0, None),
           title=f"p = {rows[0]['p']}: measured on this machine")
    ax.set_xticks(sorted({r["m"] for r in rows}), [str(m) for m in sorted({r["m"] for r in rows})])
    ax.minorticks_off()
    legend_below(ax, ncol=2, dy=-0.16, handles=[handles[k] for k in order], labels=[labels[k] for k in order])
    ax = axes[1]
    p = 4
    ms = [4, 8, 16, 32, 64]
    for name in SCHEDULES:
        mk, size, filled = marker[name]
        ax.plot(ms, [simulated(name, p, m).bubble for m in ms], "-", marker=mk, color=colors[name],
                label=LABELS[name], ms=size * 0.7, mew=1.2, mfc=colors[name] if filled else "none",
                lw=3 if name == "afab" else 1, alpha=0.6 if name == "afab" else 1)
    for name in FORMULA:
        ax.plot(ms, [formula(name, p, m) for m in ms], ":", color="k", lw=0.8)
    ax.set(xscale="log", xlabel="micro-batches m", ylim=(0, None),
           title="p = 4: the simulator (unit costs), closed forms dotted")
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.minorticks_off()
    legend_below(ax, ncol=3, dy=-0.16)
    fig.tight_layout()
    return fig


def plot_memory(res):
    """Peak activations per stage and schedule: measured (solid) beside the schedule's prediction (hatched), and the
    live bytes of the measured step action by action, per stage, for AFAB and 1F1B."""
    import matplotlib.pyplot as plt

    rows = res["rows"]
    p = rows[0]["p"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.8), gridspec_kw=dict(width_ratios=[1.3, 1]))
    width = 0.8 / (2 * p)
    stage_colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
    for x, row in enumerate(rows):
        for r in row["ranks"]:
            k = r["rank"]
            ax1.bar(x - 0.4 + width * (2 * k + 0.5), r["peak"] / MiB, width, color=stage_colors[k],
                    label=f"rank {k} measured" if x == 0 else None)
            ax1.bar(x - 0.4 + width * (2 * k + 1.5), r["predicted"] / MiB, width, color=stage_colors[k], alpha=0.45,
                    hatch="//", label=f"rank {k}: the schedule's prediction" if x == 0 else None)
    ax1.set_xticks(range(len(rows)), [LABELS[r["name"]] for r in rows], fontsize=FONT)
    ax1.set(ylabel="MiB (activations autograd keeps)", title=f"peak activations per rank, m={rows[0]['m']}")
    legend_below(ax1, ncol=2, dy=-0.12)
    for row, ls in zip([r for r in rows if r["name"] in ("afab", "1f1b")], ("-", "--")):
        for r in row["ranks"]:
            ax2.plot([a[3] / MiB for a in r["curve"]], ls, color=stage_colors[r["rank"]], lw=1.3,
                     label=f"{LABELS[row['name']]}, rank {r['rank']}")
    ax2.set(xlabel="the rank's actions, in order", ylabel="MiB alive after the action",
            title="alive activations through one step")
    legend_below(ax2, ncol=2, dy=-0.16)
    fig.tight_layout()
    return fig


def plot_widget(name, p, m, v):
    """The widget's picture: the simulated Gantt chart (unit costs) and the chunk-activations alive per rank."""
    import matplotlib.pyplot as plt

    sch = ps.build(name, p, m, v)
    sim = ps.simulate(sch)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.5 * p + 1.8), gridspec_kw=dict(width_ratios=[4, 1]))
    handles = draw_gantt(ax1, sim_bars(sim), p, f"{LABELS.get(name, name)}: p={p}, m={m}, v={sch.v}: bubble "
                         f"{sim.bubble:.1%} of the step (t_F = 1, t_B = 2; split: t_F = t_B = t_W = 1)", labels=m <= 16)
    ax1.set_xlabel("time", fontsize=FONT)
    units = [x * p / sch.stages for x in sim.peak_alive]  # a chunk is 1/v of a stage (DualPipe's: a whole one)
    ax2.barh(range(p), units, color="#c44e52")
    for r, u in enumerate(units):
        ax2.text(u, r, f" {u:g}", va="center", fontsize=FONT)
    ax2.set_yticks(range(p), [f"rank {r}" for r in range(p)], fontsize=FONT)
    ax2.set_ylim(p - 0.5, -0.5)
    ax2.set_xlim(0, max(units) * 1.3)
    ax2.set_title("peak activations\n(micro-batches of a whole stage)", fontsize=9)
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=FONT, frameon=False)
    fig.tight_layout(rect=(0, 0.1 if p < 4 else 0.06, 1, 1))
    return fig, sim


def plot_dualpipe(rows, p=4, m=8):
    """DualPipe beside ZB-V: the measured steps (ms, compute only; hatched: the second chunk, for DualPipe the
    micro-batches fed in at the last rank), then DualPipe at p ranks simulated with unit costs and its F&B pairs."""
    import matplotlib.pyplot as plt

    by = {r["name"]: r for r in rows}
    sim = ps.simulate(ps.build("dualpipe", p, m), pairs=True)
    fig, axes = plt.subplots(3, 1, figsize=(12, 6.6), gridspec_kw=dict(height_ratios=[2, 2, p]))
    for ax, name in zip(axes, ("zb-v", "dualpipe")):
        r = by[name]
        title = f"{LABELS[name]}, p={r['p']}, m={r['m']}, measured: bubble {r['bubble']:.1%}"
        handles = draw_gantt(ax, measured_bars(r["gantt"]), r["p"], title, labels=True)
        ax.set_xlabel("ms", fontsize=FONT)
    draw_gantt(axes[2], sim_bars(sim), p, f"DualPipe, p={p}, m={m}, simulated (t_F = t_B = t_W = 1, F&B pairs as one "
               f"unit): idle {ps.dualpipe_idle(p):g} per rank = (p/2 - 1)(F&B + B - 3W), bubble {sim.bubble:.1%}")
    axes[2].set_xlabel("time", fontsize=FONT)
    fig.legend(handles=handles[:3] + [handles[3].__class__(facecolor="white", edgecolor="k", hatch="///",
                                                             label="second chunk (DualPipe: fed in at the last rank)")],
               loc="lower center", ncol=4, fontsize=FONT, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def plot_parity(pairs):
    return plot_parity_below(pairs, "each schedule at pp=2")


# ------------------------------------------------------------------------------------------------ main
def main(argv=None):
    args, names, out = _common.cli("07_pipeline_parallel", EXPERIMENTS, __doc__, argv=argv, extra=[
        (("--schedules",), dict(default=",".join(SCHEDULES), help=f"bubble: a comma-separated subset of {SCHEDULES}"))])
    schedules = tuple(args.schedules.split(","))
    if any(name not in SCHEDULES for name in schedules):
        sys.exit(f"--schedules {args.schedules!r}: pick a comma-separated subset of {', '.join(SCHEDULES)}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        sys.exit("run it on 2 or more processes: torchrun --nproc_per_node 2 lessons/07_pipeline_parallel/experiment.py")
    mesh = Mesh.init(pp=world, device=_common.experiment_device("07_pipeline_parallel"))
    with mesh:  # on success every rank meets at a barrier before the groups go (Mesh.destroy)
        st = dict(at_world(settings(args.fast, mesh.device.type), world), schedules=schedules)
        _common.run_experiments(names, lambda name: globals()[f"exp_{name}"](mesh, st, out),
                                lambda name: out / f"{name}_pp{world}.json", _common.environment(mesh, pp=world, settings=st),
                                mesh.rank)


if __name__ == "__main__":
    main()
