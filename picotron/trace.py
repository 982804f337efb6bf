"""Traces a learner opens in Perfetto: `--profile A:B` records optimizer steps A to B (both included) with
torch.profiler, picotron's own phases as named ranges, every rank's trace merged into one view.

    python -m picotron.train --dp 2 --pp 2 --grad-acc 4 --steps 4 --profile 2:3
    -> OUT/traces/rank0.json ... rank3.json     one Chrome trace per rank (torch.profiler's export_chrome_trace)
       OUT/traces/merged.json                   every rank in one file, one process row per rank, on one clock
       OUT/traces/memory_rank{R}.pickle         on CUDA: the allocator's history, for pytorch.org/memory_viz

Open a .json in https://ui.perfetto.dev (or chrome://tracing): drag the file in. What a rank's trace holds:
- torch's own rows: every operator the CPU ran (aten::mm, ...), and on CUDA the kernels on their streams;
- picotron's phases as `torch.profiler.record_function` ranges on the thread that ran them, around the operators they
  contain: "step N", each micro-batch's "forward" / "backward" / "weight" (a pipeline's F, B and W, with mb= the
  micro-batch, chunk= and stage=), ZeRO-3's per-layer phases, context parallelism's ring steps and waits,
  "clip grad norm" and "optimizer step" (the trainer's), "wait p2p" where a pipeline stage waits for its neighbour;
- picotron's collectives on rows of their own ("picotron collectives"): each one from its launch to its completion,
  with its axis (dp, tp, pp_link, ...), kind and bytes in its arguments.

Why collectives are not record_function ranges: ranges on one thread must nest, and an asynchronous collective
(a gradient bucket's all-reduce launched during backward, waited for at its end) starts inside one phase and ends
inside another. So the axes' Recorder (picotron.metrics) times each one, as the lessons' timelines do, and after the
range this module writes them into the trace as complete events, packed greedily onto as many rows ("lanes") as
overlap. Their times are the host's perf_counter (on a GPU: the CUDA events' times mapped onto it,
metrics.Timeline); the trace's are the profiler's clock (microseconds of the Unix epoch, counted from the file's
baseTimeNanoseconds). The start marker below is in both: its perf_counter time is taken as it is opened, so
    trace time = marker's trace time + (perf_counter time - marker's perf_counter time) x 1e6.

Merging (rank 0, after every rank has written its file; a world barrier says they have). The ranks of one machine
share its clock, and their traces line up as they are. Machines' clocks disagree by NTP's error (milliseconds, more
than a pipeline step's phases), so at the start of the range every rank meets at a world barrier (a one-element
all-reduce, as `Mesh.agree`) and opens the marker "picotron: profile start" right after it: the barrier releases
every rank at one instant of the job, and the first rank of a machine to leave it is the closest to that instant
(the others were late to get a core back, or to see the release). So each machine's events are shifted together:
    merged time = trace time - (earliest marker among the machine's ranks, on the machine's clock)
which puts one machine's ranks on their common clock, exactly, and the machines on one another within the barrier's
release skew (microseconds on NVLink and InfiniBand). The merged file's "picotron" entry keeps what was removed
(`clock_offsets_us`: each machine's instant against the first's, on their clocks) and each rank's own lag in leaving
the barrier (`barrier_skew_us`: milliseconds on an oversubscribed CPU, where a rank waits for a core). Each rank's
events go under pid r, named "rank r (dp d, pp p, cp c, tp t)"; event ids (flows from an operator to its kernel)
are prefixed with the rank, thread ids renumbered per rank, so nothing of two ranks collides.

Cost: off by default, and then nothing here runs (the trainer holds `Off`: no recorder on the axes, no listener on
the phases). With --profile the axes count every collective (a dict update each, as the lessons' runs do) and
time them only inside the range, where the profiler itself costs far more (measured in lesson 01).

CUDA memory snapshot. On CUDA each rank also records the caching allocator's history over the range
(torch.cuda.memory._record_memory_history, the last MAX_ENTRIES allocations and frees with their stacks) and dumps
it to memory_rank{R}.pickle, which pytorch.org/memory_viz draws as every allocation alive over time (the "Active
Memory Timeline"), as CS336's systems assignment asks students to read. It is never touched on a CPU run, and it
is unmeasured here: no GPU was lent when this was written.
"""
import json
import os
import socket
import time
from contextlib import contextmanager, nullcontext

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from picotron import hooks, metrics
from picotron.rules import profile_steps

START = "picotron: profile start"  # the marker every rank opens right after the barrier at the range's start
COMM_TID = 1_000_000_000  # the collectives' rows, above any thread id (Linux's pid_max is at most 2**22)
MAX_ENTRIES = 100_000  # allocations and frees the CUDA memory history keeps (torch's tutorial uses 100000)
SHORT = {"micro": "mb"}


class Off:
    """What the trainer holds without --profile: no recorder, no listener, no range; nothing runs."""
    recorder = None

    def watch(self, run):
        pass

    def step(self, step):
        return nullcontext()

    def range(self, name):
        return nullcontext()


def for_run(cfg, mesh):
    """The trainer's tracer: `Off` unless --profile is given."""
    if cfg.profile is None:
        return Off()
    first, last = profile_steps(cfg.profile)
    return Tracer(mesh, first, last, os.path.join(cfg.out, "traces"))


def label(name, info):
    """A phase's range name: its name and what identifies it, e.g. "forward mb=3 chunk=0 stage=1"."""
    parts = [name] + [f"{SHORT.get(k, k)}={v}" for k, v in info.items() if not isinstance(v, bool)]
    return " ".join(parts) + "".join(f" +{k}" for k, v in info.items() if v is True)


class TraceRecorder(metrics.Recorder):
    """The axes' recorder while profiling: a metrics.Recorder (collectives timed on a timeline, with their axis and
    bytes) whose point-to-point batches are timed too (from posting to the end of the wait, with the bytes they send;
    0 for a batch of receives), their waits named as ranges ("wait p2p")."""
    time_messages = True

    def collective(self, kind, nbytes, work, label, start, axis=None, **info):
        return super().collective(kind, nbytes, work, label, start, axis=axis, axis_name=axis, bytes=nbytes,
                                  collective=kind, **info)

    def message(self, nbytes, label, axis=None):
        super().message(nbytes, label, axis)
        self._last_message = nbytes

    def _count(self, kind, nbytes, axis):  # outside the profiled steps nothing is kept (a long run's log would grow)
        if self.timeline.enabled:
            super()._count(kind, nbytes, axis)

    def _wait_handle(self, work, on_done):
        return _NamedWait(work, on_done)

    def _message_event(self, label, axis):  # a batch of receives sends 0 bytes
        nbytes = getattr(self, "_last_message", 0)
        return (f"p2p {label}" if nbytes else "p2p receive",
                dict(axis_name=axis, bytes_sent=nbytes, collective="p2p"))


class _NamedWait(metrics._TimedAtWait):
    """A message's handle whose wait is a named range: where a stage waits for its neighbour."""

    def wait(self, timeout=None):
        with record_function("wait p2p"):
            return super().wait(timeout)


class Tracer:
    """--profile on one rank: the profiler over steps `first` to `last`, the phases' ranges, the files, the merge."""

    def __init__(self, mesh, first, last, folder):
        self.mesh, self.first, self.last, self.folder = mesh, first, last, folder
        self.cuda = torch.device(mesh.device).type == "cuda"
        self.recorder = TraceRecorder(metrics.Timeline(mesh.device, mesh.rank, enabled=False))
        self.profiler, self.mark = None, None

    @property
    def active(self):
        return self.profiler is not None

    def watch(self, run):
        """Every phase of the model, its wrappers and the step engine becomes a range while the profiler runs."""
        hooks.watch(run.model, run.raw, run.schedule, listener=self.phase)

    def phase(self, name, **info):
        """A listener (picotron.hooks): the phase as a record_function range, inside the profiled steps."""
        return record_function(label(name, info)) if self.active else nullcontext()

    def range(self, name):
        """One of the trainer's own parts of a step ("clip grad norm", "optimizer step") as a range."""
        return record_function(name) if self.active else nullcontext()

    @contextmanager
    def step(self, step):
        """Around optimizer step `step`: the profiler starts before the first profiled one and stops after the last."""
        if step == self.first:
            self._start()
        if not self.active:
            yield
            return
        with record_function(f"step {step}"):
            yield
        if step == self.last:
            self._stop()

    def _start(self):
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.profiler = profile(activities=activities)
        self.profiler.start()
        if self.cuda:  # unmeasured: no GPU was lent when this was written
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)
        self.mesh.agree(False)  # the barrier: every rank leaves it at (nearly) the same instant
        tl = self.recorder.timeline
        tl.enabled = True
        self.mark = time.perf_counter() - tl.t0
        with record_function(START):
            pass

    def _stop(self):
        metrics.sync(self.mesh.device)
        tl, rank = self.recorder.timeline, self.mesh.rank
        tl.enabled = False
        self.profiler.stop()
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"rank{rank}.json")
        self.profiler.export_chrome_trace(path)
        self.profiler = None
        if self.cuda:
            torch.cuda.memory._dump_snapshot(os.path.join(self.folder, f"memory_rank{rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        add_collectives(path, [e for e in tl.events if e.get("kind") == "comm"], self.mark, about(self.mesh))
        self.mesh.agree(False)  # every rank's file is written
        if rank == 0:
            missing = merge(self.folder, self.mesh.world_size)
            note = f"; no file from rank(s) {', '.join(map(str, missing))}, left out" if missing else ""
            print(f"picotron: trace of steps {self.first}-{self.last}: {self.folder}/rank*.json and merged.json "
                  f"(open in ui.perfetto.dev){note}", flush=True)


def about(mesh):
    """This rank's place in the grid, for the file and the merged view's row name."""
    return {"rank": mesh.rank, "dp": mesh.dp.rank, "pp": mesh.pp.rank, "cp": mesh.cp.rank, "tp": mesh.tp.rank,
            "device": str(mesh.device), "host": socket.gethostname()}


def add_collectives(path, events, mark, where):
    """Write picotron's timed collectives (Timeline events, seconds on the host's clock) into the trace at `path`,
    on rows of their own, converted to the trace's clock by the start marker; and this rank's place."""
    with open(path) as f:
        trace = json.load(f)
    marker = start_marker(trace)
    pid = marker["pid"]
    lanes, out = [], []  # each lane's end; an event goes on the first lane free at its start
    for e in sorted(events, key=lambda e: e["start"]):
        ts, end = (marker["ts"] + (e[k] - mark) * 1e6 for k in ("start", "end"))
        lane = next((i for i, free in enumerate(lanes) if free <= ts), len(lanes))
        lanes[lane:lane + 1] = [end]
        args = {k: v for k, v in e.items() if k not in ("rank", "name", "start", "end", "kind")}
        out.append({"ph": "X", "cat": "picotron collective", "name": e["name"], "pid": pid, "tid": COMM_TID + lane,
                    "ts": ts, "dur": max(end - ts, 0.0), "args": args})
    out += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": COMM_TID + i,
             "args": {"name": f"picotron collectives ({i})"}} for i in range(len(lanes))]
    trace["traceEvents"] += out
    trace["picotron"] = dict(where, marker=START)
    with open(path, "w") as f:
        json.dump(trace, f)


def start_marker(trace):
    """The trace's "picotron: profile start" event."""
    found = [e for e in trace["traceEvents"] if e.get("name") == START and e.get("ph") == "X"]
    if not found:
        raise ValueError(f"the trace has no {START!r} event: it was not written by picotron.trace.")
    return found[0]


def row_name(where):
    return f"rank {where['rank']} (dp {where['dp']}, pp {where['pp']}, cp {where['cp']}, tp {where['tp']})"


def merge(folder, world_size, name="merged.json"):
    """Every rank's trace in `folder` (rank{R}.json) in one file, one process row per rank, on one clock (the module
    docstring: each machine's ranks keep their common clock, the machines are aligned on their first rank to leave
    the start barrier); returns the ranks whose file is missing (left out)."""
    traces, missing = {}, []
    for r in range(world_size):
        try:
            with open(os.path.join(folder, f"rank{r}.json")) as f:
                traces[r] = json.load(f)
        except (OSError, ValueError):
            missing.append(r)
    marks = {r: start_marker(t)["ts"] + t.get("baseTimeNanoseconds", 0) / 1e3 for r, t in traces.items()}  # µs
    hosts = {r: t.get("picotron", {}).get("host", t.get("host_name", f"rank {r}")) for r, t in traces.items()}
    zero = {h: min(marks[r] for r in marks if hosts[r] == h) for h in set(hosts.values())}  # each machine's instant
    events, places = [], {}
    for r, t in traces.items():
        places[r] = t.get("picotron", {"rank": r, "dp": "?", "pp": "?", "cp": "?", "tp": "?"})
        t0 = zero[hosts[r]] - t.get("baseTimeNanoseconds", 0) / 1e3  # the machine's instant on this file's clock
        events += rank_events(t, r, t0, row_name(places[r]))
    first = min(marks) if marks else None
    merged = {"traceEvents": events, "displayTimeUnit": "ms",
              "picotron": {"ranks": places, "missing": missing, "aligned_on": START,
                           "barrier_skew_us": {r: marks[r] - zero[hosts[r]] for r in marks},
                           "clock_offsets_us": {r: zero[hosts[r]] - zero[hosts[first]] for r in marks}}}
    with open(os.path.join(folder, name), "w") as f:
        json.dump(merged, f)
    return missing


def rank_events(trace, rank, t0, name):
    """One rank's events for the merged file: pid = rank, times from its marker (t0), thread ids renumbered, event
    ids prefixed with the rank, its own process names replaced by one row name."""
    threads, names, out = {}, {}, []
    procs = {e["pid"]: e["args"].get("name", "") for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name", "").startswith(("process_", "thread_sort")):
            continue
        key = (e.get("pid"), e.get("tid"))
        tid = threads.setdefault(key, len(threads) + 1)
        e = dict(e, pid=rank, tid=tid)
        if "ts" in e:
            e["ts"] = e["ts"] - t0
        if "id" in e:
            e["id"] = f"{rank}:{e['id']}"
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[tid] = e["args"].get("name", "")
            continue
        out.append(e)
    for (pid, tid_was), tid in threads.items():
        where = procs.get(pid, "")
        thread = names.get(tid, f"thread {tid_was}")
        shown = thread if where in ("", "python") or where in thread else f"{where} {thread}"
        out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": shown}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
    out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": name}})
    out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    return out


# ------------------------------------------------------------------------------------------- reading
def phases(trace, pid=None):
    """The named ranges and collectives of a trace (a rank's or the merged one), as (pid, name, start µs, end µs,
    args), in time order: picotron's phases, steps, waits, the trainer's ranges and the collectives."""
    ours = ("forward", "backward", "weight", "step ", "wait", "attention", "clip grad norm", "optimizer step", START)
    rows = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or (pid is not None and e.get("pid") != pid):
            continue
        if e.get("cat") == "picotron collective" or (e.get("cat") == "user_annotation" and
                                                     e.get("name", "").startswith(ours)):
            rows.append((e["pid"], e["name"], e["ts"], e["ts"] + e.get("dur", 0.0), e.get("args", {})))
    return sorted(rows, key=lambda r: r[2])
