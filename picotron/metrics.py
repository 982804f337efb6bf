"""Measuring a training run: FLOPs and MFU, memory by category, timers and per-rank timelines.

Everything a lesson plots comes from here, so each number says exactly what it counts.

How measurement is installed. The algorithms (picotron's strategies) never count or time anything and never
import this module: whoever measures installs it from outside, in two places.
- Communication: every collective and point-to-point message goes through an axis of the mesh (`mesh.Axis`), and
  an axis given a `Recorder` (`mesh.recorded(recorder)`, `axis.recorded(recorder)`, `parallelize(cfg, mesh,
  recorder=...)`) reports each one to it: the bytes by kind, and with a timeline when each collective ran.
- Computation: an algorithm names its phases (`picotron.hooks.Phases`: a ring step's attention, ZeRO-3's forward of
  a layer, a wait for a message) and a listener turns them into measurements: `hooks.watch(model,
  listener=timeline.record)` makes each phase an event of a `Timeline`, `recorder.phase` an event on the recorder's
  timeline beside its collectives.
The lessons, the benchmarks and the trainer install what they need; nothing is measured where nobody listens.

FLOPs. A matmul of an (m x k) by a (k x n) matrix costs 2·m·k·n FLOPs. Per token, the forward pass through
the weight matrices costs 2·N and the backward 4·N (gradients for inputs and for weights), so 6·N in all,
where N counts the parameters that take part in matmuls: every weight except the input embedding (a
table lookup, no FLOPs); the LM head counts even when it shares its weight with the embedding. Attention
adds, per layer and per token, QK^T and scores·V: 2·2·s·h forward, ×3 with backward = 12·s·h. So

    FLOPs per token = 6·N + 12·L·h·s          (PaLM appendix B; we count the full s×s, not the causal half)

MFU (model FLOPs utilisation) = tokens/s × FLOPs per token ÷ peak FLOP/s. Recomputation makes the machine
do more work but does not change the model's FLOPs, so it lowers MFU: that is the point of the metric.
The peak is the datasheet number where we know the device (H100/H200 bf16 dense: 989.5 TFLOP/s) and, on
every device, the speed of one large matmul measured here (`measured_matmul_peak`): the honest ceiling.

Memory. Each gradient-sync wrapper says what it keeps (`model.memory()`: the bytes of its parameters and gradients,
or ZeRO's shards), `optimizer_bytes` counts the optimizer's state by walking its tensors;
`ActivationCounter` counts the bytes autograd saves for the backward pass with saved-tensor hooks (each
storage once; parameters excluded), and `ActivationPeak`, listening to a step engine's phases (picotron.hooks),
the most of them alive at once in a step; the device's own peak (CUDA allocator) is added where there is one,
and on the CPU the process's peak resident set size, which includes Python and torch themselves.

Time. On the CPU a time is the host's clock: the work runs while the host waits for it. On a GPU the host only
queues kernels, so its clock tells when work was launched, and synchronising the device around every event
would serialise the very overlap of computation and communication the lessons measure. So on a GPU
`Timeline.now()` records a CUDA event on the current stream (no wait), and the events are converted to seconds
only when the timeline is read, with one `torch.cuda.synchronize()` (`Timeline.events`, `dump`, `seconds`).
A collective's end cannot come from the host either: on NCCL `work.get_future()` is complete at launch, so its
`then` callback runs at once (1 ms after launch for 643 ms of GPU work, measured on an H200). But torch runs the
callback of a CUDA-aware future "with some dedicated streams set as current (fetched from a global pool) which
will be synchronized with those kernels" (torch.futures.Future.then, so in every torch >= 2.4; ProcessGroupNCCL
makes the work's future on its NCCL stream, so "those kernels" are the collective). The Recorder's callback records
its end event there: it fires when the collective has finished, whatever the caller's stream is doing, and
nobody waits. torch's own per-collective timer (TORCH_NCCL_ENABLE_TIMING) measures from an event on the NCCL
stream, but its duration (WorkNCCL::getDuration) has no Python binding (torch 2.13's Work has none), so the
start here is an event on the caller's stream just before the launch, where the NCCL stream joins it: a
collective queued behind another one on the same communicator counts that wait too.
"""
import json
import os
import resource
import sys
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F

# bf16 dense datasheet peaks, FLOP/s. H200 uses the same compute die as H100 SXM.
DATASHEET_PEAK_BF16 = {"H100": 989.5e12, "H200": 989.5e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


# ----------------------------------------------------------------------------------------------- FLOPs
def flops_per_token(model_config, seq_len):
    """Training FLOPs (forward + backward) per token: 6·N + 12·L·h·s (see ModelConfig.flops_per_token)."""
    return model_config.flops_per_token(seq_len)


def datasheet_peak(device):
    """Datasheet bf16 dense peak of a known GPU, else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in DATASHEET_PEAK_BF16.items() if key in name), None)


_PEAK_CACHE = {}


def measured_matmul_peak(device, dtype=torch.float32, n=None, trials=5, again=False):
    """FLOP/s of one large square matmul on this device (best of a few trials): the practical MFU ceiling.

    Measured once per process and kept; `again=True` measures anew and keeps the larger of the two (a peak
    measured while other work shared the device is too low: the busy machine's MFU would read above 100%)."""
    key = (str(device), dtype)
    if key not in _PEAK_CACHE or again:
        n = n or (8192 if device.type == "cuda" else 1024 if dtype == torch.float32 else 512)
        repeats = 10 if device.type == "cuda" else 3
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        # F.linear (a @ b.T) is the op every nn.Linear runs; on CPUs it takes the fast oneDNN path for bf16,
        # where a plain bf16 `a @ b` can be 10x slower.
        F.linear(a, b)  # warm up (thread pool, kernel selection)
        best = float("inf")
        for _ in range(trials):
            sync(device)
            t0 = time.perf_counter()
            for _ in range(repeats):
                F.linear(a, b)
            sync(device)
            best = min(best, (time.perf_counter() - t0) / repeats)
        _PEAK_CACHE[key] = max(_PEAK_CACHE.get(key, 0.0), 2 * n**3 / best)
    return _PEAK_CACHE[key]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------- memory
def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_bytes(optimizer):
    """The optimizer's state (Adam's moments and step counters) and, under bf16-params or fp16, its fp32 master
    copy of the parameters (precision.MasterWeights)."""
    masters = tensor_bytes(getattr(optimizer, "masters", ()))
    return masters + sum(tensor_bytes(v for v in s.values() if torch.is_tensor(v)) for s in optimizer.state.values())


class ActivationCounter:
    """Counts the bytes autograd saves for backward inside a `with` block.

    A saved-tensor hook sees every tensor an autograd node keeps (inputs of a matmul, the mask of a
    ReLU, ...). We count each underlying storage once and skip parameters, which are not activations.
    With activation checkpointing only the checkpointed region's inputs are saved: the count drops.
    `by_dtype`: the same bytes by the saved tensor's dtype ({torch.bfloat16: ..., torch.float32: ...}).
    """

    def __init__(self, model=None):
        # A storage's identity (_cdata) survives ZeRO-3 freeing and re-gathering it; its data_ptr does not.
        self._params = {p.untyped_storage()._cdata for p in model.parameters()} if model is not None else set()
        self.bytes, self.by_dtype = 0, {}
        self._seen = set()

    def _pack(self, t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if storage._cdata not in self._params and ptr not in self._seen and t.device.type != "meta":
            self._seen.add(ptr)
            self.bytes += storage.nbytes()
            self.by_dtype[t.dtype] = self.by_dtype.get(t.dtype, 0) + storage.nbytes()
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._seen.clear()  # drop pointers; the storages may be freed and reused after backward


class ActivationPeak:
    """A listener (picotron.hooks) on a step engine's phases: `bytes`, the most activation bytes alive at once in
    the last step, and `per_chunk`, what one micro-batch's forward saves on each chunk (`by_dtype`: the same
    bytes summed over the chunks, by dtype).

    Every micro-batch's forward of a chunk saves the same bytes, and the hooks cost time, so only the step's first
    "forward" of each chunk is counted (`ActivationCounter`). A micro-batch's bytes are alive from its "forward"
    until its "weight" phase or, when its "backward" also computes the weight gradients (`weights`, default True),
    until its "backward". Each (micro-batch, chunk) has one forward a step, so a forward seen before begins a new
    step (DualPipe's second rank starts with the other direction's micro-batch, not micro-batch 0 on chunk 0).

        pipe.phases.listen(metrics.ActivationPeak(stage))   # then, after a step: .bytes"""

    def __init__(self, model):
        self.model = model  # its parameters are not activations
        self.bytes, self.per_chunk, self.by_dtype, self.alive, self.seen = 0, {}, {}, {}, set()

    @contextmanager
    def __call__(self, name, micro=0, chunk=0, weights=True, **info):
        key = (micro, chunk)
        if name != "forward":
            yield
            if name == "weight" or (name == "backward" and weights):
                self.alive.pop(key, None)
            return
        if key in self.seen:  # a new step
            self.bytes, self.per_chunk, self.by_dtype, self.alive, self.seen = 0, {}, {}, {}, set()
        self.seen.add(key)
        counter = ActivationCounter(self.model) if chunk not in self.per_chunk else None
        with counter if counter is not None else nullcontext():
            yield
        if counter is not None:
            self.per_chunk[chunk] = counter.bytes
            for dtype, n in counter.by_dtype.items():
                self.by_dtype[dtype] = self.by_dtype.get(dtype, 0) + n
        self.alive[key] = self.per_chunk[chunk]
        self.bytes = max(self.bytes, sum(self.alive.values()))


def device_peak_bytes(device):
    """Peak bytes allocated by torch on a CUDA device since the last reset, else None."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def reset_device_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def process_peak_rss_bytes():
    """Peak resident set size of this process: Python + torch + tensors.

    On Linux, /proc/self/status's VmHWM (the high-water mark of this program's own memory). Not getrusage's
    ru_maxrss: it survives fork and exec, so a run started by a large process (a notebook's kernel, pytest) would
    report that parent's size as its own peak. Elsewhere ru_maxrss (bytes on macOS, KiB on other systems)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def malloc_returns_freed_memory(threshold=64 * 1024):
    """CPU only (glibc): serve allocations above `threshold` bytes with mmap and give them back on free.

    By default glibc raises that threshold each time a large block is freed, after which big tensors come
    from a heap that never shrinks: resident memory then shows the high-water mark of the allocator, not the
    tensors alive (ZeRO-3, which frees and re-gathers every layer, looks like it leaks). Call this before
    measuring memory on a CPU. Returns False where it does not apply (not Linux/glibc)."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, threshold)) and bool(libc.mallopt(-1, threshold))  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        return False


def process_anon_rss_bytes():
    """Resident anonymous memory of this process now (the heap: tensors, Python objects; not the code of
    shared libraries, which counts in the RSS as soon as it is touched). Linux; None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
    except (OSError, StopIteration):
        return None


# ------------------------------------------------------------------------------------ time and events
class Stamp(float):
    """A time from `Timeline.now()` on a GPU. As a number it is the host's clock (seconds since t0: when the work
    was *launched*); it also carries a CUDA event recorded on the current stream at that point, which tells when
    the GPU *reached* it (and the t0 it counts from). The timeline turns it into seconds when its events are read."""

    __slots__ = ("event", "t0")

    def __new__(cls, seconds, event, t0):
        stamp = super().__new__(cls, seconds)
        stamp.event, stamp.t0 = event, t0
        return stamp

    def __reduce__(self):  # pickled (gathered to another rank) as the plain host time, without its event
        return float, (float(self),)


class Timeline:
    """Per-rank events (name, start, end in seconds since `t0`) for timeline / bubble plots.

    On a GPU every time from `now()` is a `Stamp` holding a CUDA event; they stay pending until the events are
    read, which synchronises once: an anchor event recorded when the timeline was made, on an idle device, ties
    the GPU's clock to perf_counter, and an event's time is `anchor's host time - t0 + anchor.elapsed_time(it)`.
    Read the events at the end of a step or run, never inside what you measure."""

    def __init__(self, device, rank=0, enabled=True):
        self.device, self.rank, self.enabled = device, rank, enabled
        self._cuda = torch.device(device).type == "cuda"
        self._events, self._pending = [], []  # every event; those still holding CUDA events
        if self._cuda:  # the one synchronisation until the events are read: the anchor runs at once
            torch.cuda.synchronize(device)
            self._anchor = torch.cuda.Event(enable_timing=True)
            self._anchor.record()
            self._anchor_host = time.perf_counter()
        self.t0 = time.perf_counter()

    @property
    def events(self):
        """The events, every time in seconds since t0 (on a GPU, one synchronisation resolves the pending ones)."""
        if self._pending:
            self._resolve()
        return self._events

    @events.setter
    def events(self, events):
        self._events = events
        self._pending = [e for e in events if isinstance(e["start"], Stamp) or isinstance(e["end"], Stamp)]

    @contextmanager
    def record(self, name, **info):
        """The block as one event; yields it (a dict: add to it, e.g. what else you measured inside)."""
        if not self.enabled:
            yield {}
            return
        event = {"rank": self.rank, "name": name, "start": self.now(), "end": None, **info}
        yield event
        event["end"] = self.now()
        self._append(event)

    def now(self):
        """Seconds since t0; on a GPU, a Stamp: also this point of the current stream (resolved when read)."""
        t = time.perf_counter() - self.t0
        if not (self._cuda and self.enabled):
            return t
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return Stamp(t, event, self.t0)

    def add(self, name, start, end, **info):
        """An event timed elsewhere (start and end from `now()`; e.g. an asynchronous collective's, see Recorder)."""
        if self.enabled:
            self._append({"rank": self.rank, "name": name, "start": start, "end": end, **info})

    def seconds(self, t):
        """A time from `now()` as the events give it: a Stamp's GPU time (this synchronises), a float as it is."""
        if not isinstance(t, Stamp):
            return t
        torch.cuda.synchronize(self.device)
        return self._gpu_seconds(t)

    def _append(self, event):
        self._events.append(event)
        if isinstance(event["start"], Stamp) or isinstance(event["end"], Stamp):
            self._pending.append(event)

    def _resolve(self):
        torch.cuda.synchronize(self.device)  # every event recorded so far, on every stream, has run
        pending, self._pending = self._pending, []
        for e in pending:
            for key in ("start", "end"):
                if isinstance(e[key], Stamp):
                    e[key] = self._gpu_seconds(e[key])

    def _gpu_seconds(self, stamp):
        """When the GPU reached `stamp`'s event (it has run), in seconds since the t0 of its time, as on the CPU."""
        return self._anchor_host - stamp.t0 + self._anchor.elapsed_time(stamp.event) / 1e3

    def dump(self, path):
        with open(path, "w") as f:
            json.dump(self.events, f)


class Recorder:
    """What every lesson measures about communication, in one place: the bytes each kind of collective
    covered (`bytes["all_gather"]`, ...; the whole buffer, nccl-tests' N), the bytes of point-to-point messages
    sent (`bytes["send"]`) and, with a `timeline`, when each collective ran. Attach it to an axis
    (`mesh.dp_cp.recorded(recorder)`) and hand that axis to a strategy: the axis reports every collective and
    message to it, and the algorithms never count or time anything themselves.

    The recorder never waits for a collective: the caller computes while it is in flight, as it would unrecorded.
    A collective runs from `start` (the axis takes `now()` just before launching it) to its completion, which the
    work's future reports: on gloo its callback runs when the collective has finished; on NCCL it runs at launch
    but on a stream that waits for the collective, where the end's CUDA event is recorded (module docstring).
    Where the backend gives no future (gloo's reduce-scatter, the send/recv collectives), the end is taken when
    the caller waits for it (on a GPU: on the caller's stream after `wait()`, so also after what that stream
    computed first), and the event says `end_observed_at_wait`.

    `phase` is a listener for the algorithms' phases (picotron.hooks): installed with `hooks.watch(model,
    listener=recorder.phase)`, each phase (ZeRO-3's forward of a layer, ...) becomes a compute event on the same
    timeline as the collectives."""

    def __init__(self, timeline=None):
        self.timeline = timeline
        self.bytes = {}  # kind -> bytes
        self.calls = {}  # kind -> number of calls
        self.log = []  # (kind, bytes, axis name) of every call, in order

    def collective(self, kind, nbytes, work, label, start, axis=None, **info):
        """Count one collective (started at `start`, self.now()); return its handle, timed if there is a timeline."""
        self._count(kind, nbytes, axis)
        tl = self.timeline
        if tl is None or not tl.enabled:
            return work
        if work is None:  # it ran synchronously (on a GPU: the caller's stream waits for it): it is over
            tl.add(label, start, tl.now(), kind="comm", **info)
            return work
        try:
            work.get_future().then(lambda _: tl.add(label, start, tl.now(), kind="comm", **info))
            return work
        except (RuntimeError, AttributeError):
            return _TimedAtWait(work, lambda: tl.add(label, start, tl.now(), kind="comm", end_observed_at_wait=True,
                                                     **info))

    def message(self, nbytes, label, axis=None):
        """Count one batch of point-to-point messages (`Axis.exchange`): the `nbytes` its sends carry, as kind
        "send". `label` says what they carry (a subclass may sort by it); they are not timed (see Axis.exchange)."""
        self._count("send", nbytes, axis)

    # --- async TP's lesson: point-to-point batches timed (Axis.exchange asks when `time_messages` is set)
    time_messages = False

    def timed_messages(self, works, label, start, axis=None):
        """With a timeline: one batch of messages as a comm event from `start` until the caller has waited for all its
        handles (a message is over when its receiver has it); returns the handles to wait on instead."""
        tl = self.timeline
        if tl is None or not tl.enabled or not works:
            return works
        name, info, left = *self._message_event(label, axis), [len(works)]

        def one_done():
            left[0] -= 1
            if not left[0]:
                tl.add(name, start, tl.now(), kind="comm", end_observed_at_wait=True, **info)
        return [self._wait_handle(w, one_done) for w in works]

    def _message_event(self, label, axis):
        """(name, fields) of a timed batch's event (a subclass adds what its reader wants: picotron.trace)."""
        return label, dict(axis=axis)

    def _wait_handle(self, work, on_done):
        """The handle a caller waits on instead of `work` (a subclass may name the wait: picotron.trace)."""
        return _TimedAtWait(work, on_done)
    # --- end async TP

    def _count(self, kind, nbytes, axis):
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.log.append((kind, nbytes, axis))

    def phase(self, name, **info):
        """A listener (picotron.hooks): the phase as a compute event on the timeline, if there is one."""
        if self.timeline is None:
            return nullcontext()
        return self.timeline.record(name, kind="compute", **info)

    def now(self):
        return self.timeline.now() if self.timeline is not None else 0.0

    def reset(self):
        self.bytes.clear()
        self.calls.clear()
        self.log.clear()


class _TimedAtWait:
    """A collective's handle whose end is recorded when someone waits for it."""

    def __init__(self, work, on_done):
        self.work, self.on_done = work, on_done

    def wait(self, timeout=None):
        self.work.wait()
        if self.on_done is not None:
            self.on_done()
            self.on_done = None
        return True

    def is_completed(self):
        return self.work.is_completed()


class MetricsLog:
    """`metrics.jsonl`: one JSON object per optimizer step, written by one rank, flushed each line.

    `resume_step=k` keeps the lines of steps before k (a resumed run continues the same file; steps logged
    after the checkpoint by the interrupted run are dropped, they are about to be redone)."""

    def __init__(self, out_dir, enabled=True, resume_step=None):
        self.enabled = enabled
        self.path = os.path.join(out_dir, "metrics.jsonl")
        if enabled:
            os.makedirs(out_dir, exist_ok=True)
            kept = []
            if resume_step is not None and os.path.exists(self.path):
                with open(self.path) as f:  # (a line a killed run left half written is dropped too)
                    kept = [line for line in f if _step_of(line, resume_step) < resume_step]
            self._f = open(self.path, "w")
            self._f.writelines(kept)

    def write(self, record):
        if self.enabled:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()

    def close(self):
        if self.enabled:
            self._f.close()


def read_metrics(out_dir):
    """The per-step records and the summary of a run directory: (steps, summary)."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if "summary" not in r], next((r for r in reversed(rows) if "summary" in r), None)


def human_bytes(n):
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _step_of(line, default):
    try:
        return json.loads(line).get("step", default)
    except ValueError:
        return default
