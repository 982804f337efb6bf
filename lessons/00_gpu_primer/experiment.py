"""Lesson 00, the measurements: a roofline of this device (matmul FLOP/s, copy bandwidth, a norm and an add placed on
it), bandwidth against working-set size, asynchronous launches, a profiler trace of one training step, and an
all-reduce hidden under matmuls on two processes.

The notebook runs sections 1-3a in its own kernel (measure_* below, on `_common.device()`: the GPU where there is
one) and launches the two multi-step experiments with torchrun:

    torchrun --nproc_per_node 1 lessons/00_gpu_primer/experiment.py --only trace     # --profile of one step
    torchrun --nproc_per_node 2 lessons/00_gpu_primer/experiment.py --only overlap   # all-reduce under matmuls
    PICOTRON_FAST=1 torchrun ...   (or --fast)    short settings

Each writes OUT/<name>.json (OUT: runs/lessons/00_gpu_primer/), which the notebook plots with the plot_* functions.
Every formula (FLOPs and bytes of an operation, the ridge, the roof) is picotron.plan.hardware's; this file measures.
Timings are the best of a few repeats, each bracketed by a device synchronisation (metrics.sync) on a GPU.
"""
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/
import _common  # noqa: E402  (puts the repository root on sys.path; sets the OpenMP wait policy before torch)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from picotron import kernels, metrics  # noqa: E402
from picotron.plan import hardware  # noqa: E402

KiB, MiB = 2**10, 2**20
EXPERIMENTS = ("trace", "overlap")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SETTINGS = {
    "fast": dict(dtype="fp32", mm_sizes=(64, 128, 256, 512), big_mib=64, norm_h=2048, tile_rows=32,
                 sweep_bytes=[16 * KiB * 4**k for k in range(8)], repeats=3, launch_n=256, launch_count=40,
                 trace_seq_len=64, trace_micro_batch_size=4, overlap_n=256, overlap_reps=40, overlap_mib=16, overlap_dtype="fp32",
                 overlap_trials=9),
    "full": dict(dtype="fp32", mm_sizes=(64, 128, 256, 512, 1024), big_mib=128, norm_h=2048, tile_rows=32,
                 sweep_bytes=[16 * KiB * 2**k for k in range(15)], repeats=5, launch_n=256, launch_count=80,
                 trace_seq_len=128, trace_micro_batch_size=4, overlap_n=256, overlap_reps=80, overlap_mib=32, overlap_dtype="fp32",
                 overlap_trials=9),
}


def settings(fast):
    """The lesson's CPU settings (FAST or full); the notebook puts _common.GPU_SETTINGS' row on top on a GPU."""
    return dict(SETTINGS["fast" if fast else "full"])


# ------------------------------------------------------------------------------------------- timing
def best_seconds(fn, device, repeats=5, inner=1, warm=True):
    """The fastest of `repeats` timings of `inner` calls of fn() (after one call to warm up, if `warm`), per call,
    each timing bracketed by a device synchronisation: on a GPU, the time the kernels took, not the time to queue
    them."""
    if warm:
        fn()
    best = float("inf")
    for _ in range(repeats):
        metrics.sync(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        metrics.sync(device)
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def _point(kind, shape, elem, seconds, **extra):
    """One measured operation as the roofline sees it: its FLOPs and bytes (hardware.op_cost), time and rates."""
    flops, moved = hardware.op_cost(kind, shape, elem)
    return dict(kind=kind, shape=list(shape), flops=flops, bytes=moved, seconds=seconds, rate=flops / seconds,
                bandwidth=moved / seconds, intensity=flops / moved if moved else None, **extra)


# ------------------------------------------------------------------------------- section 1: the roofline
def measure_matmuls(sizes, dtype, device, repeats):
    """torch.mm of n×n by n×n for each n: FLOP/s attained and FLOPs per byte (each matrix read or written once)."""
    dt, out = DTYPES[dtype], []
    for n in sizes:
        a, b = (torch.randn(n, n, device=device, dtype=dt) for _ in range(2))
        c = torch.empty(n, n, device=device, dtype=dt)
        inner = max(1, 2**27 // n**3) if device.type == "cpu" else max(1, 2**33 // n**3)  # ~0.1 GFLOP (CPU) a timing
        seconds = best_seconds(lambda: torch.mm(a, b, out=c), device, repeats, inner)
        out.append(_point("matmul", (n, n, n), a.element_size(), seconds, n=n))
    return out


def copy_job(nbytes, device, dtype="fp32"):
    """A copy of `nbytes` into a buffer allocated beforehand (bytes read + written): (fn, kind, shape, elem, extra)."""
    dt = DTYPES[dtype]
    n = max(1, nbytes // torch.tensor([], dtype=dt).element_size())
    src = torch.ones(n, device=device, dtype=dt)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), "copy", (n,), src.element_size(), {}


def add_job(n, dtype, device):
    """z = x + y into a buffer allocated beforehand: 1 FLOP for 3 elements moved."""
    dt = DTYPES[dtype]
    x, y = (torch.randn(n, device=device, dtype=dt) for _ in range(2))
    z = torch.empty_like(x)
    return (lambda: torch.add(x, y, out=z)), "add", (n,), x.element_size(), {}


@contextlib.contextmanager
def num_threads(n):
    """torch's intra-op threads set to `n` inside the block, given back after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def rms_norm_tiled(x, w, out, tile_rows, eps=1e-5):
    """kernels.rms_norm_plain's arithmetic (in fp32) over x (rows × h) `tile_rows` rows at a time into `out`, on one
    thread, each tile's temporaries in two buffers allocated once, so that they stay in the core's cache.

    Why so: a fresh tensor per tile goes through malloc, which may hand each one new pages from the OS (a page fault
    per 4 KiB, zeroed): that ran slower than the whole-tensor norm on CI (x0.7). And a tile is too little work to
    split: with OMP_WAIT_POLICY=PASSIVE (lessons/_common.py) each small operator on 2 threads waits for the second to
    wake, x0.7 again. The whole-tensor norm it is compared with runs on every thread."""
    rows, h = x.shape
    sq = torch.empty(tile_rows, h, device=x.device, dtype=torch.float32)
    ms = torch.empty(tile_rows, 1, device=x.device, dtype=torch.float32)
    with num_threads(1), torch.no_grad():
        for i in range(0, rows, tile_rows):
            n = min(tile_rows, rows - i)
            xt, s, m = x[i:i + n], sq[:n], ms[:n]
            torch.mul(xt, xt, out=s)
            torch.mean(s, -1, keepdim=True, out=m)
            m.add_(eps).rsqrt_()
            torch.mul(xt, m, out=s)
            out[i:i + n].copy_(s.mul_(w))  # cast back to x's dtype on the way out
    return out


def norm_job(rows, h, dtype, device, tile_rows=None):
    """picotron's RMSNorm arithmetic (kernels.rms_norm_plain, the model's: square, mean, add, rsqrt, scale, weight,
    each a kernel of its own; four of them stream the whole tensor) over rows × h, on the whole tensor at once
    (`tile_rows` None); or kept on chip: on a CPU a tile of `tile_rows` rows at a time into an output allocated
    beforehand (each tile's temporaries stay in the cache), on a GPU picotron's fused Triton kernel (kernels.rms_norm,
    one row per program, held in registers: x read once, y written once)."""
    dt = DTYPES[dtype]
    x = torch.randn(rows, h, device=device, dtype=dt)
    w = torch.ones(h, device=device, dtype=dt)
    y = torch.empty_like(x)

    def whole():
        with torch.no_grad():
            return kernels.rms_norm_plain(x, w, 1e-5)

    def tiled():
        rms_norm_tiled(x, w, y, tile_rows)

    def fused():
        with torch.no_grad():
            return kernels.rms_norm(x, w, 1e-5, impl="auto")

    how = "whole" if not tile_rows else "fused" if device.type == "cuda" else "tiled"
    return dict(whole=whole, tiled=tiled, fused=fused)[how], "rmsnorm", (rows, h), x.element_size(), \
        dict(how=how, tile_rows=tile_rows)


def measure_interleaved(jobs, device, repeats):
    """Time each job (name -> job) `repeats` times, the jobs taking turns (a shared machine's changing load hits
    them alike), each timing synchronised; {name: _point of its fastest}."""
    for fn, *_ in jobs.values():
        fn()
    best = {name: float("inf") for name in jobs}
    for _ in range(repeats):
        for name, (fn, *_) in jobs.items():
            best[name] = min(best[name], best_seconds(fn, device, repeats=1, warm=False))
    return {name: _point(kind, shape, elem, best[name], **extra) for name, (_, kind, shape, elem, extra) in jobs.items()}


def measure_copy(nbytes, device, repeats, dtype="fp32"):
    """The copy of `copy_job` timed alone, with enough copies a timing to be measurable (small buffers)."""
    fn, kind, shape, elem, _ = copy_job(nbytes, device, dtype)
    moved = 2 * shape[0] * elem
    inner = max(1, (256 * MiB if device.type == "cuda" else 64 * MiB) // moved)
    return _point(kind, shape, elem, best_seconds(fn, device, repeats, inner))


def measure_roofline(st, device):
    """Section 1: the matmuls, then the main-memory copy, the add and the norm (whole and on chip) taking turns."""
    elem = torch.tensor([], dtype=DTYPES[st["dtype"]]).element_size()
    big = st["big_mib"] * MiB
    rows = big // (st["norm_h"] * elem)
    mm = measure_matmuls(st["mm_sizes"], st["dtype"], device, st["repeats"])
    r = measure_interleaved(dict(copy=copy_job(big, device, st["dtype"]), add=add_job(big // elem, st["dtype"], device),
                                 norm=norm_job(rows, st["norm_h"], st["dtype"], device),
                                 tiled=norm_job(rows, st["norm_h"], st["dtype"], device, st["tile_rows"])),
                            device, st["repeats"])
    # the roof: the best matmul, and the faster of two streaming kernels (a CPU's copy often trails the add: each
    # store to a line not in the cache reads it first, which the copy pays on 1 byte of 2 counted, the add on 1 of 3)
    peak, bandwidth = max(p["rate"] for p in mm), max(r["copy"]["bandwidth"], r["add"]["bandwidth"])
    return dict(matmuls=mm, **r, peak=peak, bandwidth=bandwidth, ridge=hardware.ridge(peak, bandwidth),
                device=str(device), dtype=st["dtype"], big_mib=st["big_mib"])


# ------------------------------------------------------------------------- section 2: the memory hierarchy
def sweep(sizes, device, repeats, dtype="fp32"):
    """Copy bandwidth against the size of the copied buffer (the working set is twice that: source and target)."""
    return [dict(nbytes=n, bandwidth=measure_copy(n, device, repeats, dtype)["bandwidth"]) for n in sizes]


def cpu_caches(cpu="/sys/devices/system/cpu/cpu0/cache"):
    """This CPU's caches as Linux lists them ("L1 Data 32K", ...); [] where it does not (macOS, Windows)."""
    out = []
    for index in sorted(Path(cpu).glob("index*")):
        try:
            level, kind, size = ((index / f).read_text().strip() for f in ("level", "type", "size"))
        except OSError:
            continue
        if kind != "Instruction":
            out.append(f"L{level}{' data' if kind == 'Data' else ''} {size}")
    return out


# --------------------------------------------------------------------- section 3: asynchronous launches
def launch_and_wait(n, count, dtype, device):
    """Queue `count` matmuls of n×n, then read one number of the result (.item()). Returns the seconds the loop took
    to return (the launches), the seconds .item() took (the wait for the queue), and the matmuls' own time
    (best_seconds, synchronised): on a CPU each op runs as it is called; on a GPU the loop returns at once."""
    dt = DTYPES[dtype]
    a = torch.randn(n, n, device=device, dtype=dt)
    c = torch.empty_like(a)
    torch.mm(a, a, out=c)
    metrics.sync(device)
    t0 = time.perf_counter()
    for _ in range(count):
        torch.mm(a, a, out=c)
    t1 = time.perf_counter()
    c[0, 0].item()  # a device-to-host copy: it waits for every kernel queued before it
    t2 = time.perf_counter()
    one = best_seconds(lambda: torch.mm(a, a, out=c), device, repeats=3)
    return dict(n=n, count=count, launch_s=t1 - t0, item_s=t2 - t1, total_s=t2 - t0, work_s=count * one)


# --------------------------------------------------------------------- section 3b: a step's trace
def exp_trace(mesh, fast, out):
    """picotron.train --profile 2:2 of 2 steps of the small model (what lesson 01, section 4h, reads), then the
    trace's rows as the timeline draws them: phases, the CPU's operators, the GPU's kernels by stream, syncs."""
    from picotron import train as trainer
    from picotron import trace as tracing

    st = _common.sized("00_gpu_primer", settings(fast), fast, mesh.device.type)
    folder = Path(out) / "trace_run"
    cfg = _common.make_cfg("small", steps=2, seq_len=st["trace_seq_len"], micro_batch_size=st["trace_micro_batch_size"],
                           eval_every=0, log_every=2, warmup_steps=1, profile="2:2", out=str(folder))
    trainer.train(cfg, mesh)
    path = folder / "traces" / "rank0.json"
    events = _common.load_json(path)["traceEvents"]
    step = next((s, e) for _, name, s, e, _ in tracing.phases({"traceEvents": events}) if name == "step 2")
    return dict(trace=os.path.relpath(path), device=mesh.device.type, seq_len=cfg.seq_len,
                micro_batch_size=cfg.micro_batch_size, **timeline(events, *step))


PHASES = ("forward", "backward", "wait", "clip grad norm", "optimizer step")  # picotron's ranges in a one-process step


def timeline(events, start, end):
    """The rows of one step of a Chrome trace, times in ms from the step's start: picotron's phases, the CPU
    thread's top-level operators, the GPU's kernels (one row per stream) and the CUDA runtime's waits (a
    synchronize, or a device-to-host copy, longer than 50 µs). Also each row's busy time (overlaps counted once)."""
    def ms(e):
        return (e["ts"] - start) / 1e3, (e["ts"] + e.get("dur", 0.0) - start) / 1e3

    inside = [e for e in events if e.get("ph") == "X" and start <= e.get("ts", -1) <= end]
    phases = [(e["name"], *ms(e)) for e in inside if e.get("cat") == "user_annotation" and
              e["name"].startswith(PHASES)]
    ops = top_level([e for e in inside if e.get("cat") == "cpu_op"])
    # the GPU runs behind the CPU: a kernel the step launched may start after the step's CPU range has closed (the
    # trace holds this one step: every kernel from its start on is the step's)
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel" and e.get("ts", -1) >= start]
    streams = sorted({e.get("args", {}).get("stream", e.get("tid")) for e in kernels}, key=str)
    waits = [e for e in inside if e.get("cat") == "cuda_runtime" and e.get("dur", 0) > 50 and
             ("Synchronize" in e["name"] or "Memcpy" in e["name"])]
    launches = [e for e in inside if e.get("cat") == "cuda_runtime" and "Launch" in e["name"]]
    rows = dict(phases=phases, ops=[ms(e) for e in ops],
                kernels={str(s): [ms(e) for e in kernels if e.get("args", {}).get("stream", e.get("tid")) == s]
                         for s in streams},
                waits=[(e["name"], *ms(e)) for e in waits])
    busy_ops = _common.union_length([ms(e) for e in ops])
    busy_kernels = _common.union_length([ms(e) for e in kernels])
    last_launch = max((ms(e)[1] for e in launches), default=None)
    last_kernel = max((ms(e)[1] for e in kernels), default=None)
    return dict(rows=rows, step_ms=(end - start) / 1e3, ops_ms=busy_ops, kernels_ms=busy_kernels,
                n_ops=len(ops), n_kernels=len(kernels), n_streams=len(streams),
                waits_ms=sum(b - a for _, a, b in rows["waits"]), last_launch_ms=last_launch,
                last_kernel_ms=last_kernel)


def top_level(ops):
    """The operators not inside another operator of the same thread (aten::linear, not its aten::addmm)."""
    out, ends = [], {}
    for e in sorted(ops, key=lambda e: (e["ts"], -e.get("dur", 0))):
        tid = e.get("tid")
        if e["ts"] >= ends.get(tid, float("-inf")):
            out.append(e)
            ends[tid] = e["ts"] + e.get("dur", 0)
    return out


# --------------------------------------------------------------------- section 4: communication under compute
def exp_overlap(mesh, fast, out):
    """On every rank: `reps` matmuls of n×n alone, an all-reduce of `mib` MiB alone, and both at once (the
    all-reduce started with async_op=True, the matmuls run, then wait()), interleaved trial by trial; the slowest
    rank's time of each, the median over trials, and the machine's load from other programs while it ran."""
    st = _common.sized("00_gpu_primer", settings(fast), fast, mesh.device.type)
    dev, dt = mesh.device, DTYPES[st["overlap_dtype"]]
    # on a CPU the all-reduce needs a core of its own to hide: gloo's thread copies and adds the bytes. launch()
    # gives each rank cores // ranks threads; where that is 2 or more, the matmuls leave one of them to gloo
    cores, mm_threads = os.cpu_count() or 1, torch.get_num_threads()
    if dev.type == "cpu":
        mm_threads = max(1, mm_threads - 1)
    spare = dev.type != "cpu" or cores >= mesh.world_size * (mm_threads + 1)
    a = torch.randn(st["overlap_n"], st["overlap_n"], device=dev, dtype=dt)
    c = torch.empty_like(a)
    buf = torch.ones(st["overlap_mib"] * MiB // a.element_size(), device=dev, dtype=dt)

    def compute():
        with num_threads(mm_threads):
            for _ in range(st["overlap_reps"]):
                torch.mm(a, a, out=c)

    def comm():
        dist.all_reduce(buf)

    def both():
        t = time.perf_counter()
        work = dist.all_reduce(buf, async_op=True)  # gloo: its own thread; NCCL: its own stream
        call = time.perf_counter() - t
        compute()
        t = time.perf_counter()
        work.wait()
        return call, time.perf_counter() - t

    def timed(fn):
        dist.barrier()
        metrics.sync(dev)
        t0 = time.perf_counter()
        extra = fn()
        metrics.sync(dev)
        return time.perf_counter() - t0, extra

    for fn in (compute, comm, both):  # warm up: thread pools, the communicator's buffers
        timed(fn)
    window, times = _common.LoadWindow(), {"compute": [], "comm": [], "both": [], "call": [], "wait": []}
    for _ in range(st["overlap_trials"]):  # the three in turn, trial after trial: a machine's drift hits all alike
        for name, fn in (("compute", compute), ("comm", comm), ("both", both)):
            seconds, parts = timed(fn)
            times[name].append(max(_common.gather(seconds, mesh)))  # the slowest rank's
            if parts is not None:
                for part, value in zip(("call", "wait"), parts):
                    times[part].append(max(_common.gather(value, mesh)))
    share = _common.others_share(_common.gather(window.stop(), mesh))
    med = {name: statistics.median(values) for name, values in times.items()}
    _common.say(mesh, f"overlap: compute {med['compute'] * 1e3:.1f} ms, all-reduce {med['comm'] * 1e3:.1f} ms, "
                      f"both {med['both'] * 1e3:.1f} ms (wait() {med['wait'] * 1e3:.1f} ms); medians of "
                      f"{st['overlap_trials']} trials")
    return dict(compute_s=med["compute"], comm_s=med["comm"], both_s=med["both"], call_s=med["call"],
                wait_s=med["wait"], times=times, others_share=share, n=st["overlap_n"], reps=st["overlap_reps"],
                mib=st["overlap_mib"], backend=mesh.backend, device=dev.type, threads=mm_threads,
                cores=cores, ranks=mesh.world_size, spare=spare)


# ------------------------------------------------------------------------------------ plots (for the notebook)
COLORS = dict(matmul="#4c72b0", copy="#8c8c8c", add="#dd8452", rmsnorm="#c44e52", tiled="#55a868")
NORM_LABEL = dict(tiled="RMSNorm, {tile_rows} rows a tile", fused="RMSNorm, fused (Triton)")


def plot_roofline(r, gpu=None):
    """Attained FLOP/s against FLOPs per byte, on log axes, under the measured roofline min(peak, bw × I); the ridge
    marked. `gpu`: (label, peak, bandwidth) of a datasheet roofline drawn beside it (dashed)."""
    import matplotlib.pyplot as plt
    from _plots import FONT, legend_below

    fig, ax = plt.subplots(figsize=(8, 4.6))
    points = [p["intensity"] for p in r["matmuls"] + [r["add"], r["norm"], r["tiled"]]]
    lo, hi = min(points) / 3, max(points + [r["ridge"]]) * 3
    if gpu:
        hi = max(hi, hardware.ridge(gpu[1], gpu[2]) * 3)
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.loglog(xs, [hardware.roofline(r["peak"], r["bandwidth"], x) for x in xs], "k-", lw=1.5,
              label=f"measured roof: min({r['peak'] / 1e9:.0f} GFLOP/s, {r['bandwidth'] / 1e9:.0f} GB/s × I)")
    ax.axvline(r["ridge"], color="k", ls=":", lw=1)
    ax.text(r["ridge"], r["peak"] * 1.15, f" ridge {r['ridge']:.1f}", fontsize=FONT)
    if gpu:
        label, peak, bw = gpu
        ax.loglog(xs, [hardware.roofline(peak, bw, x) for x in xs], "k--", lw=1, alpha=0.5,
                  label=f"{label} datasheet: ridge {hardware.ridge(peak, bw):.0f} FLOP/byte")
    mm = r["matmuls"]
    ax.loglog([p["intensity"] for p in mm], [p["rate"] for p in mm], "o", color=COLORS["matmul"],
              label="matmul n×n×n (n = " + ", ".join(str(p["n"]) for p in mm) + ")")
    for key, color, label in (("add", COLORS["add"], "add x + y"), ("norm", COLORS["rmsnorm"], "RMSNorm, whole"),
                              ("tiled", COLORS["tiled"], NORM_LABEL[r["tiled"]["how"]].format(**r["tiled"]))):
        p = r[key]
        ax.loglog([p["intensity"]], [p["rate"]], "s" if key != "add" else "^", color=color, ms=8, label=label)
    ax.set(xlabel="arithmetic intensity I, FLOPs per byte moved (log)", ylabel="attained FLOP/s (log)",
           title=f"The roofline of this device ({r['device']}, {r['dtype']})")
    ax.tick_params(labelsize=FONT)
    legend_below(ax, ncol=2, dy=-0.15)
    fig.tight_layout()
    return fig


def plot_sweep(rows, big):
    """Copy bandwidth against the copied buffer's size (log x): the steps are the caches."""
    import matplotlib.pyplot as plt
    from _plots import FONT

    fig, ax = plt.subplots(figsize=(8, 3.4))
    ax.semilogx([r["nbytes"] for r in rows], [r["bandwidth"] / 1e9 for r in rows], "o-", color=COLORS["copy"])
    ax.axhline(big / 1e9, color="k", ls=":", lw=1, label=f"main memory (section 1): {big / 1e9:.0f} GB/s")
    ticks = [r["nbytes"] for r in rows][::2]
    ax.set_xticks(ticks, [metrics.human_bytes(t) for t in ticks], fontsize=FONT)
    ax.set(xlabel="bytes copied (the working set is twice that)", ylabel="GB/s (read + written)",
           title="Bandwidth against working-set size: small buffers stay in the caches")
    ax.legend(fontsize=FONT)
    fig.tight_layout()
    return fig


def plot_timeline(t):
    """One training step from its trace: picotron's phases, the CPU thread's operators, the GPU's kernels by stream
    (on a GPU) and the waits, on one time axis."""
    import matplotlib.pyplot as plt
    from _plots import FONT

    rows = t["rows"]
    lanes = [("phases", rows["phases"]), ("CPU thread: operators", [("", a, b) for a, b in rows["ops"]])]
    lanes += [(f"GPU stream {s}: kernels", [("", a, b) for a, b in ks]) for s, ks in rows["kernels"].items()]
    if rows["waits"]:
        lanes.append(("CPU waits (sync)", rows["waits"]))
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(lanes) + 1.4))
    palette = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer step": "#55a868", "clip grad norm": "#8172b2"}
    for y, (label, spans) in enumerate(lanes):
        for name, a, b in spans:
            color = palette.get(name.split(" mb=")[0], "#c44e52" if "waits" in label else "#777777")
            ax.barh(y, b - a, left=a, height=0.6, color=color, edgecolor="none")
            if label == "phases" and b - a > 0.06 * t["step_ms"]:
                ax.text((a + b) / 2, y, name.split(" mb=")[0], ha="center", va="center", fontsize=FONT, color="w")
    ax.set_yticks(range(len(lanes)), [label for label, _ in lanes], fontsize=FONT)
    ax.invert_yaxis()
    ax.set_xlabel(f"ms from the start of step 2 ({t['device']})", fontsize=FONT)
    ax.set_title(f"One training step, small model, s = {t['seq_len']}, micro-batch {t['micro_batch_size']}: "
                 f"{t['n_ops']} operators" + (f", {t['n_kernels']} kernels" if t["n_kernels"] else ""), fontsize=9)
    fig.tight_layout()
    return fig


def plot_overlap(o):
    """Three bars: compute alone, the all-reduce alone, both at once; the sum of the first two dashed."""
    import matplotlib.pyplot as plt
    from _plots import FONT

    fig, ax = plt.subplots(figsize=(7, 2.6))
    names = ["matmuls alone", "all-reduce alone", "both (async_op=True)"]
    values = [o["compute_s"] * 1e3, o["comm_s"] * 1e3, o["both_s"] * 1e3]
    ax.barh(names, values, color=[COLORS["matmul"], COLORS["add"], COLORS["tiled"]])
    ax.axvline(values[0] + values[1], color="k", ls="--", lw=1, label="one after the other")
    ax.axvline(max(values[:2]), color="k", ls=":", lw=1, label="perfect overlap")
    ax.invert_yaxis()
    ax.set_xlabel(f"ms, slowest of 2 ranks ({o['backend']})", fontsize=FONT)
    ax.tick_params(labelsize=FONT)
    ax.legend(fontsize=FONT, loc="lower right")
    fig.tight_layout()
    return fig


def main(argv=None):
    from picotron.mesh import Mesh

    args, names, out = _common.cli("00_gpu_primer", EXPERIMENTS, __doc__, argv=argv)
    mesh = Mesh.init(dp=int(os.environ.get("WORLD_SIZE", "1")), device=_common.experiment_device("00_gpu_primer"))
    with mesh:
        _common.run_experiments(names, lambda name: globals()[f"exp_{name}"](mesh, args.fast, out),
                                lambda name: out / f"{name}.json", _common.environment(mesh, fast=args.fast),
                                mesh.rank, after=lambda name: dist.barrier() if mesh.world_size > 1 else None)


if __name__ == "__main__":
    main()
