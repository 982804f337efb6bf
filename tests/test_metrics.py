"""Timing in picotron/metrics.py: the Recorder never waits for a collective (the caller computes while it is in
flight, on real gloo ranks too); on the CPU a time is the host's clock, as before; on a GPU (exercised here with
fake CUDA events) every time is an event on a stream, nothing synchronises per event, one synchronisation
resolves them when the timeline is read, and a collective ends when its stream says so, not at its launch.
Who measures: no strategy counts or times anything; a recorder listens to the algorithms' phases, an axis
reports its point-to-point messages to its recorder as it does its collectives, and ActivationPeak counts a
step's activations from the phases a step engine names (picotron.hooks)."""
import pickle
import time

import pytest
import torch
import torch.distributed as dist

from picotron import metrics
from picotron.launch import run_on_ranks
from picotron.mesh import Mesh


# ------------------------------------------------------------------------------ no barrier from the recorder
class CountingWork:
    """A collective's handle that counts who waits for it; its future completes when the test says so."""

    def __init__(self, future=True):
        self.waits = 0
        self.future = torch.futures.Future() if future else None

    def get_future(self):
        if self.future is None:
            raise RuntimeError("this backend gives no future")
        return self.future

    def wait(self, timeout=None):
        self.waits += 1
        return True

    def is_completed(self):
        return self.future is not None and self.future.done()


def test_recorder_never_waits_for_a_collective():
    tl = metrics.Timeline("cpu")
    rec = metrics.Recorder(tl)
    work = CountingWork()
    handle = rec.collective("all_reduce", 64, work, "all-reduce", rec.now())
    assert handle is work and work.waits == 0 and tl.events == []  # in flight: nothing waited, nothing ended
    with tl.record("compute"):  # the caller computes meanwhile
        torch.ones(64, 64) @ torch.ones(64, 64)
    work.future.set_result(None)  # the backend completes it: its callback ends the event
    assert work.waits == 0
    assert [e["name"] for e in tl.events] == ["compute", "all-reduce"]
    comm = tl.events[1]
    assert comm["kind"] == "comm" and comm["start"] <= tl.events[0]["start"] <= tl.events[0]["end"] <= comm["end"]
    assert rec.bytes == {"all_reduce": 64} and rec.calls == {"all_reduce": 1}

    nofuture = CountingWork(future=False)  # no future: ended when the caller waits, and only then
    handle = rec.collective("reduce_scatter", 32, nofuture, "reduce-scatter", rec.now())
    assert nofuture.waits == 0 and len(tl.events) == 2
    handle.wait()
    assert nofuture.waits == 1 and tl.events[-1]["end_observed_at_wait"] is True


def _overlap_on_gloo(delay_s):
    mesh = Mesh.init(dp=2)
    tl = metrics.Timeline(mesh.device, mesh.rank)
    axis = mesh.recorded(metrics.Recorder(tl)).world
    x = torch.full((1000,), float(mesh.rank + 1))
    dist.barrier()
    if mesh.rank == 1:
        time.sleep(delay_s)  # rank 1 joins late: rank 0's all-reduce is in flight all that time
    work = axis.all_reduce(x, async_op=True)
    in_flight = []
    with tl.record("compute"):
        y = torch.randn(128, 128)
        for _ in range(5):
            y = torch.tanh(y @ y)
        in_flight.append(not work.is_completed())  # the recorder returned without waiting
    work.wait()
    deadline = time.perf_counter() + 5
    while len(tl.events) < 2 and time.perf_counter() < deadline:  # gloo runs the future's callback on its thread
        time.sleep(0.01)
    return dict(sum=x[0].item(), in_flight=in_flight[0], events=tl.events)


def test_caller_computes_while_a_recorded_all_reduce_is_in_flight():
    delay_s = 1.0
    r0, r1 = run_on_ranks(_overlap_on_gloo, 2, delay_s)
    assert r0["sum"] == r1["sum"] == 3.0
    assert r0["in_flight"]  # rank 0 computed while its all-reduce waited for rank 1
    comm = next(e for e in r0["events"] if e.get("kind") == "comm")
    compute = next(e for e in r0["events"] if e["name"] == "compute")
    assert comm["start"] <= compute["start"] <= compute["end"] <= comm["end"]  # the overlap is on the timeline
    assert comm["end"] - comm["start"] >= delay_s / 2  # it ended when rank 1 joined, not at launch


# ------------------------------------------------------------------ measurement is installed from outside
# the strategies and the step engines (pipeline_schedules is left out: its simulator computes timelines, on paper)
STRATEGIES = ("context_parallel", "zero3", "zero", "data_parallel", "tensor_parallel", "expert_parallel", "moe",
              "pipeline_parallel", "zero_bubble", "schedule", "fp8", "precision")


def test_no_strategy_counts_or_times_anything():
    """The strategies import neither picotron.metrics nor anything that times, and touch no recorder or timeline:
    they name their phases (picotron.hooks) and communicate through the axes, which report to a recorder."""
    import ast
    from pathlib import Path

    for name in STRATEGIES:
        tree = ast.parse((Path(metrics.__file__).parent / f"{name}.py").read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names} | \
                   {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not imported & {"metrics", "picotron.metrics", "time"}, (name, imported)
        used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
               {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert not used & {"metrics", "recorder", "timeline", "perf_counter"}, (name, used)


def test_a_recorder_listens_to_phases():
    """Recorder.phase: each phase of an algorithm (picotron.hooks) becomes a compute event on its timeline; without
    a timeline, or with nobody listening, a phase is a no-op."""
    from picotron import hooks

    tl = metrics.Timeline("cpu")
    rec, phases = metrics.Recorder(tl), hooks.Phases()
    with phases("nobody listens"):
        pass
    phases.listen(rec.phase)
    with phases("forward layer 0", micro=1):
        pass
    assert [(e["name"], e["kind"], e["micro"]) for e in tl.events] == [("forward layer 0", "compute", 1)]
    phases.forget()
    phases.listen(metrics.Recorder().phase)  # no timeline: nothing to record on
    with phases("forward layer 1"):
        pass
    assert len(tl.events) == 1


def _ring_messages():
    class ByLabel(metrics.Recorder):
        def message(self, nbytes, label, axis=None):
            self.labels = getattr(self, "labels", []) + [label]
            super().message(nbytes, label, axis=axis)

    with Mesh.init(cp=2) as mesh:
        rec = ByLabel()
        axis = mesh.cp.recorded(rec)
        nxt = axis.ranks[(axis.rank + 1) % 2]
        got = torch.empty(3, 4)
        for w in axis.exchange([("send", torch.full((3, 4), float(mesh.rank)), nxt), ("recv", got, nxt)], label="kv"):
            w.wait()
        for w in mesh.cp.exchange([("send", torch.ones(5), nxt), ("recv", torch.empty(5), nxt)]):  # unrecorded
            w.wait()
    return dict(got=got[0, 0].item(), bytes=rec.bytes, calls=rec.calls, log=rec.log, labels=rec.labels)


def test_an_axis_counts_its_point_to_point_messages():
    """Axis.exchange posts a batch of messages and reports the bytes of its sends to the axis's recorder (kind
    "send", with what they carry as the label); an axis without a recorder just sends."""
    for rank, r in enumerate(run_on_ranks(_ring_messages, 2)):
        assert r["got"] == 1 - rank
        assert r["bytes"] == {"send": 48} and r["calls"] == {"send": 1} and r["log"] == [("send", 48, "cp")]
        assert r["labels"] == ["kv"]


# ----------------------------------------------------------------------------------------- the CPU path
def test_cpu_times_are_the_host_clock_and_touch_no_cuda(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a torch.cuda function was called on the CPU path")

    for name in ("Event", "synchronize", "current_stream"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    tl = metrics.Timeline(torch.device("cpu"), rank=3)
    t = tl.now()
    assert type(t) is float
    before = time.perf_counter() - tl.t0
    with tl.record("optimizer", kind="compute") as event:
        time.sleep(0.01)
        event["cpu"] = 0.5  # what a subclass adds to the event it is given
    after = time.perf_counter() - tl.t0
    tl.add("wait", t, tl.now(), micro=1)
    e0, e1 = tl.events
    assert list(e0) == ["rank", "name", "start", "end", "kind", "cpu"] and e0["rank"] == 3
    assert before <= e0["start"] < e0["end"] <= after and e0["end"] - e0["start"] >= 0.01
    assert type(e0["start"]) is type(e0["end"]) is float and e1["start"] == t
    tl.enabled = False
    with tl.record("skipped") as event:
        event["cpu"] = 1.0
    assert len(tl.events) == 2 and tl.seconds(t) == t


# ----------------------------------------------------------------------------- the CUDA path, with fakes
class FakeGPU:
    """A GPU's clock as the fakes see it: `at[stream]` is when that stream will reach the next event recorded on
    it (the host sets it as if kernels ran), `stream` is the current stream; `syncs` counts synchronisations."""

    def __init__(self):
        self.at = {"main": 0.0, "pool": 0.0}
        self.stream = "main"
        self.syncs = self.records = 0
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.t = self.n = None

            def record(self, stream=None):
                gpu.records += 1
                self.t, self.n = gpu.at[gpu.stream], gpu.records

            def elapsed_time(self, end):
                assert self.n is not None and end.n is not None, "an event that was never recorded"
                assert max(self.n, end.n) <= gpu.done, "elapsed_time on an event the host has not waited for"
                return (end.t - self.t) * 1e3

        self.Event = Event
        self.done = 0  # events recorded before the last synchronisation: those that have run

    def synchronize(self, device=None):
        self.syncs += 1
        self.done = self.records


class NcclLikeWork:
    """NCCL's handle: the future is complete at launch, so `then` runs the callback at once, on the host; torch
    runs it with a pool stream current that waits for the collective (here: done on the GPU at `done_at`)."""

    def __init__(self, gpu, done_at):
        self.gpu, self.done_at, self.waits = gpu, done_at, 0

    def get_future(self):
        work = self

        class Future:
            def then(self, callback):
                gpu, saved = work.gpu, work.gpu.stream
                gpu.stream, gpu.at["pool"] = "pool", work.done_at
                try:
                    callback(self)
                finally:
                    gpu.stream = saved
                return self
        return Future()

    def wait(self, timeout=None):
        self.waits += 1
        return True


@pytest.fixture
def gpu(monkeypatch):
    fake = FakeGPU()
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return fake


def test_cuda_timeline_records_events_and_synchronises_only_when_read(gpu):
    tl = metrics.Timeline(torch.device("cuda", 0), rank=0)
    assert gpu.syncs == 1  # the anchor, on an idle device: the one synchronisation before the events are read
    gpu.syncs = 0
    rec = metrics.Recorder(tl)
    gpu.at["main"] = 1.0
    with tl.record("forward", kind="compute"):
        gpu.at["main"] = 3.0  # the host launched 2 s of kernels and went on at once
    start = rec.now()  # what the axis takes just before launching (main stream at 3.0)
    work = NcclLikeWork(gpu, done_at=7.0)
    assert rec.collective("all_reduce", 1024, work, "all-reduce", start) is work
    with tl.record("backward", kind="compute"):  # overlaps the all-reduce on the GPU
        gpu.at["main"] = 5.0
    for i in range(100):  # many more events: still no synchronisation
        s = tl.now()
        gpu.at["main"] += 0.01
        tl.add("step", s, tl.now(), i=i)
    assert gpu.syncs == 0 and work.waits == 0

    events = tl.events  # read: one synchronisation resolves every pending event
    assert gpu.syncs == 1
    shift = tl._anchor_host - tl.t0  # the anchor (GPU time 0) in seconds since t0: about zero
    assert abs(shift) < 0.1
    times = {e["name"]: (e["start"] - shift, e["end"] - shift) for e in events[:3]}
    assert times["forward"] == pytest.approx((1.0, 3.0))
    assert times["all-reduce"] == pytest.approx((3.0, 7.0))  # when the collective finished, not its launch
    assert times["backward"] == pytest.approx((3.0, 5.0))
    assert events[3]["i"] == 0 and events[3]["end"] - events[3]["start"] == pytest.approx(0.01)
    assert all(type(e["start"]) is float and type(e["end"]) is float for e in events)
    assert tl.events is events and gpu.syncs == 1  # nothing pending: reading again costs nothing
    assert rec.bytes == {"all_reduce": 1024}

    t = tl.now()
    assert isinstance(t, metrics.Stamp) and type(pickle.loads(pickle.dumps(t))) is float
    assert tl.seconds(t) - shift == pytest.approx(gpu.at["main"]) and gpu.syncs == 2
    assert tl.seconds(0.5) == 0.5 and gpu.syncs == 2


def test_cuda_collective_without_future_ends_on_the_callers_stream_after_wait(gpu):
    tl = metrics.Timeline(torch.device("cuda", 0))
    rec = metrics.Recorder(tl)
    gpu.syncs = 0
    work = CountingWork(future=False)
    handle = rec.collective("all_gather", 8, work, "all-gather", rec.now())
    gpu.at["main"] = 2.0
    assert work.waits == 0 and gpu.syncs == 0
    handle.wait()  # the caller's stream waits for the collective; the end is recorded there
    assert work.waits == 1 and gpu.syncs == 0
    (e,) = tl.events
    shift = tl._anchor_host - tl.t0
    assert (e["start"] - shift, e["end"] - shift) == pytest.approx((0.0, 2.0)) and e["end_observed_at_wait"]
    rec.collective("all_reduce", 8, None, "all-reduce", rec.now())  # synchronous: over when it returns
    assert gpu.syncs == 1
    assert len(tl.events) == 2 and gpu.syncs == 2


def test_cuda_timeline_disabled_records_nothing(gpu):
    tl = metrics.Timeline(torch.device("cuda", 0), enabled=False)
    records = gpu.records
    with tl.record("forward"):
        pass
    assert type(tl.now()) is float and gpu.records == records and tl.events == []


def test_cuda_times_count_from_the_t0_they_were_taken_with(gpu):
    tl = metrics.Timeline(torch.device("cuda", 0))
    old = tl.t0
    gpu.at["main"] = 1.0
    tl.add("before", tl.now(), tl.now())
    tl.t0 = old - 10.0  # a lesson moves the origin (a common one for every rank) before its timed steps
    tl.add("after", tl.now(), tl.now())
    before, after = tl.events
    assert after["start"] - before["start"] == pytest.approx(10.0)  # as the host clock would have it on the CPU


# ------------------------------------------------------------------------------ activations, from phases
def test_activation_peak_keeps_each_micro_batch_alive_until_its_last_phase():
    """ActivationPeak on a Phases: the first forward of a chunk is counted, every micro-batch of it holds as much,
    from its forward until its backward (or its weight phase, when the backward leaves the weights to it); a step
    starts again at micro-batch 0's forward."""
    from picotron import hooks

    layer = torch.nn.Linear(8, 8)
    phases, peak = hooks.Phases(), metrics.ActivationPeak(layer)
    phases.listen(peak)
    x = torch.randn(4, 8)

    def forward(mb):
        with phases("forward", micro=mb, chunk=0):
            return layer(x).tanh().sum()

    with metrics.ActivationCounter(layer) as one:
        layer(x).tanh().sum()
    assert one.bytes > 0
    outs = [forward(0), forward(1)]  # AFAB, m = 2: both alive
    for mb, out in enumerate(outs):
        with phases("backward", micro=mb, chunk=0):
            out.backward()
    assert peak.per_chunk == {0: one.bytes} and peak.bytes == 2 * one.bytes and not peak.alive
    for mb in range(2):  # 1F1B's last stage: one at a time, the count of the new step only
        out = forward(mb)
        with phases("backward", micro=mb, chunk=0):
            out.backward()
    assert peak.bytes == one.bytes
    for mb in range(2):  # a split backward: alive until the weight phase
        out = forward(mb)
        with phases("backward", micro=mb, chunk=0, weights=False):
            out.backward()
    assert peak.bytes == 2 * one.bytes and len(peak.alive) == 2
