"""Lesson 00's notebook, 00_gpu_primer.ipynb, as plain Python in the percent format (see lessons/_notebook.py):
edit this file, never the notebook.

    python lessons/_notebook.py 00_gpu_primer --run fast    # rebuild the notebook, execute it in FAST mode
"""

# %% [markdown]
# # Lesson 00 — A GPU primer: rooflines, memory, streams and overlap
#
# The lessons that follow say that a collective "hides under compute", that an operation is "memory-bound", that
# DualPipe's pairs "run back to back". This lesson gives those words their meaning, measured on the device you run it
# on (this CPU, or the GPU where there is one):
#
# 1. **the roofline**: how many FLOPs a device can do per byte it moves, and why a matmul reaches the peak while a
#    norm cannot;
# 2. **HBM against on-chip memory**: bandwidth falls as the working set grows, and a fused kernel stays on chip;
# 3. **streams and asynchronous launches**: the CPU queues work and runs ahead; `.item()` waits;
# 4. **communication under compute**: an all-reduce started with `async_op=True` runs while the matmuls do;
# 5. an exercise with a checker, and what an H100 should show.
#
# Symbols follow the course's [notation](../../docs/reference.md#notation); the GPU figures and their sources are in
# [the reference](../../docs/reference.md#gpu-primer). `PICOTRON_FAST=1` runs short settings.

# %%
import contextlib, io, os, sys
import matplotlib.pyplot as plt
import torch
sys.path.insert(0, "..")   # lessons/: the helpers every lesson shares
import _common
from _common import check
from picotron import metrics
from picotron.plan import hardware

FAST, OUT = _common.FAST, _common.run_dir("00_gpu_primer")
import experiment as lesson   # this folder's experiment.py: the measurements and the plots
import check as checker       # this folder's check.py: the exercises' checker
DEVICE = torch.device(_common.device())   # cuda where torch sees a GPU (PICOTRON_DEVICE), else cpu
st = _common.sized("00_gpu_primer", lesson.settings(FAST), FAST)
GB, H100 = 1e9, hardware.GPUS["h100-80gb"]
print(f"FAST={FAST}, measuring {DEVICE} ({st['dtype']}), {torch.get_num_threads()} threads, "
      f"results in {OUT.relative_to(_common.ROOT)}")

# %% [markdown]
# ## 1. The roofline, measured here
#
# An operation does $F$ floating-point operations and moves $Q$ bytes between main memory and the chip. A device
# computes at most $P$ FLOP/s and moves at most $B$ bytes/s, so the operation takes at least
# $\max(F/P,\ Q/B)$. Divide $F$ by that time: the rate it can attain is
#
# $$\text{attainable} = \min(P,\ B \cdot I), \qquad I = F/Q \text{ (arithmetic intensity, FLOP per byte)}.$$
#
# This is the **roofline** (Williams, Waterman & Patterson 2009, §2). Its **ridge** $I^* = P/B$ splits operations
# in two. Below it an operation is **memory-bound**: the bytes decide, and a faster chip does not help. Above it,
# it can be **compute-bound**.
#
# A matmul $C_{m\times n} = A_{m\times k} B_{k\times n}$ does $2mnk$ FLOPs (a multiply and an add per term) and
# moves $q(mk + kn + mn)$ bytes, $q$ bytes an element. A square one has $I = 2n/(3q)$: it grows with $n$. An RMSNorm
# does about 4 FLOPs per element and reads and writes each element once: $I \approx 4/(2q)$, whatever its size. An
# add has $I = 1/(3q)$. `picotron.plan.hardware.op_cost` counts them; below, each is timed on this device.

# %%
window = _common.LoadWindow()
roof = lesson.measure_roofline(st, DEVICE)
busy = _common.busy_reason(_common.others_share([window.stop()]))
peak, bw, ridge_here = roof["peak"], roof["bandwidth"], roof["ridge"]
print(f"measured peak P = {peak / 1e9:,.0f} GFLOP/s (the best matmul), main-memory bandwidth B = {bw / GB:,.1f} GB/s "
      f"(the faster of a {roof['big_mib']} MiB copy and an add, bytes read + written): ridge P/B = {ridge_here:.1f} "
      f"FLOP/byte")
print(f"{'operation':<34}{'I, FLOP/byte':>13}{'GFLOP/s':>10}{'roof':>10}{'of roof':>9}")
points = [(f"matmul {p['n']}³", p) for p in roof["matmuls"]] + [
    ("add, x + y", roof["add"]), ("RMSNorm, whole tensor", roof["norm"]),
    (f"RMSNorm, {roof['tiled']['how']}", roof["tiled"])]
for name, p in points:
    top = hardware.roofline(peak, bw, p["intensity"])
    print(f"{name:<34}{p['intensity']:>13.3g}{p['rate'] / 1e9:>10.2f}{top / 1e9:>10.2f}{p['rate'] / top:>9.0%}")
lesson.plot_roofline(roof, ("H100 SXM bf16", H100.peak, hardware.HBM_BANDWIDTH["h100-80gb"])); plt.show()

# %%
under = [(name, p["rate"] / hardware.roofline(peak, bw, p["intensity"])) for name, p in points]
check("every operation lies under the measured roof", all(x <= 1.25 for _, x in under),
      "highest " + ", ".join(f"{n} {x:.0%}" for n, x in sorted(under, key=lambda t: -t[1])[:2])
      + " of min(P, B·I) (25% allowed for timing noise)", busy)
low = [roof["add"], roof["norm"], roof["tiled"]]
check("the add and the norm are memory-bound: below the ridge, under a quarter of the peak",
      all(p["intensity"] < ridge_here and p["rate"] < 0.25 * peak for p in low),
      ", ".join(f"I = {p['intensity']:.3g} at {p['rate'] / peak:.1%} of P" for p in low) + f"; ridge {ridge_here:.1f}", busy)
streams = roof["add"]["bandwidth"] / roof["copy"]["bandwidth"]
check("the copy and the add both stream at the memory's speed: within x1.5 of each other", 1 / 1.5 <= streams <= 1.5,
      f"copy {roof['copy']['bandwidth'] / GB:.1f} GB/s, add {roof['add']['bandwidth'] / GB:.1f} GB/s (bytes read + "
      f"written)", busy)

# %% [markdown]
# Read the plot from left to right. The add sits on the sloped part of the roof: it moves 12 bytes (fp32) for one
# FLOP and runs at memory speed. The norm's intensity is a little higher. Yet the whole-tensor norm falls far below
# its roof: it is six kernels (`kernels.rms_norm_plain`), four of which read the whole tensor from main memory
# and three write one as large, so it moves several times the bytes counted here. Section 2 keeps those passes on chip.
# The matmuls sit right of the ridge and near the peak.
#
# A GPU's ridge is far to the right. For an H100 SXM in bf16, `hardware.ridge` of the datasheet figures gives:

# %%
for key in ("a100-80gb", "h100-80gb", "h200"):
    hw = hardware.GPUS[key]
    print(f"{hw.name:<16} {hw.peak / 1e12:6.1f} TFLOP/s bf16 / {hardware.HBM_BANDWIDTH[key] / 1e12:5.2f} TB/s HBM = "
          f"ridge {hardware.ridge(hw.peak, hardware.HBM_BANDWIDTH[key]):5.0f} FLOP/byte")
print(f"this {DEVICE.type}: {peak / 1e9:,.0f} GFLOP/s / {bw / GB:.1f} GB/s = ridge {ridge_here:.1f} FLOP/byte (measured)")

# %% [markdown]
# Near 300 FLOPs per byte: a bf16 matmul needs $n/3 > 295$, so $n$ above about 900, to be compute-bound on an H100.
# Every norm, activation, residual add and softmax there is memory-bound by a factor of a hundred or more.
#
# **Takeaway:** intensity (FLOPs per byte) against the ridge (peak over bandwidth) says which limit an operation
# meets. Large matmuls reach the peak; everything elementwise runs at memory speed, on a GPU even more than here.

# %% [markdown]
# ## 2. HBM against on-chip memory
#
# "Main memory" is the slowest level of a hierarchy. Copy buffers of growing size and the bandwidth falls in steps:
# each step is a cache the working set has outgrown.

# %%
sweep = lesson.sweep(st["sweep_bytes"], DEVICE, st["repeats"], st["dtype"])
lesson.plot_sweep(sweep, bw); plt.show()
if DEVICE.type == "cpu" and lesson.cpu_caches():
    print("this CPU's caches (L1 and L2 per core, L3 shared): " + ", ".join(lesson.cpu_caches()))
fastest = max(sweep, key=lambda r: r["bandwidth"])
check("a working set that fits a cache copies faster than main memory", fastest["bandwidth"] >= 1.3 * sweep[-1]["bandwidth"],
      f"{metrics.human_bytes(fastest['nbytes'])}: {fastest['bandwidth'] / GB:.0f} GB/s against "
      f"{metrics.human_bytes(sweep[-1]['nbytes'])}: {sweep[-1]['bandwidth'] / GB:.0f} GB/s", busy)

# %% [markdown]
# A GPU has the same shape, with more of everything. An H100 SXM (NVIDIA's datasheet and its *H100 Tensor Core GPU
# Architecture* whitepaper, 2022):
#
# | level | size | where |
# |---|---|---|
# | registers | 256 KB per SM (64K × 32 bit), 132 SMs | on chip, per thread |
# | L1 / shared memory | 256 KB per SM, up to 228 KB of it shared | on chip, per SM |
# | L2 cache | 50 MB | on chip, shared by all SMs |
# | HBM3 | 80 GB at 3.35 TB/s | off chip, beside it |
#
# The on-chip levels are many times faster than HBM (NVIDIA publishes no single figure for them; unmeasured here).
# A kernel that keeps its data on chip between steps moves only its inputs and outputs through HBM. That is a
# **fused** kernel. The whole-tensor norm above makes four trips through main memory. The same
# arithmetic a tile at a time (this CPU: tiles that fit its cache; a GPU: picotron's Triton kernel, one row per
# program) makes one trip. On the CPU the tiles run on one core, their temporaries in buffers allocated once: a
# fresh tensor per tile may be handed new pages by the OS each time, and a tile split over two threads waits for
# the second to wake; either costs more than the trips saved.

# %%
speedup = roof["norm"]["seconds"] / roof["tiled"]["seconds"]
print(f"RMSNorm over {roof['norm']['shape'][0]:,} × {roof['norm']['shape'][1]} ({st['dtype']}): whole tensor "
      f"{roof['norm']['seconds'] * 1e3:.1f} ms, {roof['tiled']['how']} {roof['tiled']['seconds'] * 1e3:.1f} ms "
      f"(x{speedup:.1f}); its roof, one read and one write, allows {roof['norm']['bytes'] / bw * 1e3:.1f} ms")
check("keeping the norm's passes on chip makes it faster", speedup >= 1.5,
      f"{roof['tiled']['how']}: x{speedup:.1f} against the whole-tensor norm (1.5 asked)", busy)

# %% [markdown]
# FlashAttention (lesson 11) is this idea applied to attention: the $s \times s$ scores never leave the chip.
#
# **Takeaway:** bandwidth depends on where the data lives. Fusing operations keeps intermediate results on chip, so
# a memory-bound chain pays for main memory once instead of once per operation.

# %% [markdown]
# ## 3. Streams and asynchronous launches
#
# On a GPU the CPU does not run the kernels: it **launches** them. Each launch appends the kernel to a **stream**, a
# queue the GPU runs in order, and returns in microseconds. So the Python loop runs ahead of the GPU. Anything
# that needs a *value* on the CPU must wait for the queue to drain: `.item()`, `.cpu()`, `print(tensor)`, `if
# loss > x`. That wait is a **synchronisation**. This is why the course's rules forbid `.item()` in hot loops, and
# why timing a GPU needs `torch.cuda.synchronize()` or CUDA events.
#
# On a CPU every operator runs on the thread that called it: the loop *is* the work. Queue some matmuls, then ask
# for one number:

# %%
lw = lesson.launch_and_wait(st["launch_n"], st["launch_count"], st["dtype"], DEVICE)
print(f"{lw['count']} matmuls of {lw['n']}²: the loop returned after {lw['launch_s'] * 1e3:.1f} ms, .item() then waited "
      f"{lw['item_s'] * 1e3:.1f} ms; the matmuls themselves take {lw['work_s'] * 1e3:.1f} ms")
if DEVICE.type == "cuda":
    check("on a GPU the launches return before the work is done, and .item() waits for it",
          lw["launch_s"] < 0.5 * lw["total_s"] and lw["item_s"] > 0.3 * lw["total_s"],
          f"loop {lw['launch_s'] / lw['total_s']:.0%} of the time, .item() {lw['item_s'] / lw['total_s']:.0%}")
else:
    check("on a CPU each operator runs as it is called: the loop takes the time, .item() waits for nothing",
          lw["launch_s"] >= 0.9 * lw["total_s"],
          f"loop {lw['launch_s'] / lw['total_s']:.0%} of the time, .item() {lw['item_s'] * 1e3:.2f} ms", busy)

# %% [markdown]
# A profiler trace shows the same thing for a whole training step. `picotron.train --profile 2:2` (lesson 01,
# section 4h, reads such a trace) records step 2 of the small model. The drawing puts picotron's phases, the CPU
# thread's operators and, on a GPU, each stream's kernels on one time axis:

# %%
_common.launch("00_gpu_primer/experiment.py", ["--out", OUT, "--only", "trace"], nproc=1, quiet=True)
tr = _common.load_json(OUT / "trace.json")["results"]
print(f"trace: {tr['trace']} — open it at https://ui.perfetto.dev")
print(f"step 2: {tr['step_ms']:.0f} ms; the CPU thread ran operators {tr['ops_ms']:.0f} ms of it ({tr['n_ops']} "
      f"operators); GPU kernels {tr['kernels_ms']:.0f} ms on {tr['n_streams']} stream(s); waits {tr['waits_ms']:.1f} ms")
lesson.plot_timeline(tr); plt.show()
if tr["device"] == "cuda":
    lead = None if tr["last_launch_ms"] is None else tr["last_kernel_ms"] - tr["last_launch_ms"]
    check("on a GPU the kernels run on streams of their own, after the CPU launched them",
          tr["n_kernels"] > 0 and lead is not None and lead >= 0, f"{tr['n_kernels']} kernels on {tr['n_streams']} "
          f"stream(s); the last kernel ended {lead if lead is not None else float('nan'):.1f} ms after the last launch")
else:
    check("on a CPU the operators run on the thread that launched them and fill the step", tr["n_kernels"] == 0
          and tr["ops_ms"] >= 0.8 * tr["step_ms"], f"no device rows; operators {tr['ops_ms'] / tr['step_ms']:.0%} of "
          f"the step", busy)

# %% [markdown]
# On this CPU the operator row is nearly solid: the thread is the device. On a GPU the kernels form rows of their
# own, shifted right of their launches. A wait (red) is the CPU stopped at a sync, for example where the trainer
# reads the loss. With a model this small a GPU often idles between kernels: the CPU cannot launch them fast enough
# (*launch-bound*), which is what CUDA graphs and `--compile` address (lesson 11).
#
# **Takeaway:** the CPU queues, the GPU runs the queue in order. Each sync makes the CPU wait for the queue to
# drain, so keep syncs out of the loop.

# %% [markdown]
# ## 4. Why communication can hide under compute
#
# torch runs NCCL's collectives on **a stream of its own**. While the compute stream runs the backward's matmuls,
# the NCCL stream can all-reduce the gradients computed earlier. `dist.all_reduce(x, async_op=True)` returns a
# handle at once; `handle.wait()` makes the *current stream* wait for it (not the CPU). gloo, on CPUs, does the same
# with a thread of its own. Below, each of 2 processes runs matmuls alone, an all-reduce alone, then both: the
# all-reduce is started first, the matmuls run, then `wait()`.

# %%
saved = os.environ.get("PICOTRON_DEVICE")
if _common.on_gpu() and _common.gpu_count() < 2:  # one GPU cannot hold 2 ranks: this section runs on the CPU
    print("one GPU: the two processes run on the CPU with gloo")
    os.environ["PICOTRON_DEVICE"] = "cpu"
try:
    _common.launch("00_gpu_primer/experiment.py", ["--out", OUT, "--only", "overlap"], nproc=2)
finally:
    os.environ.pop("PICOTRON_DEVICE", None) if saved is None else os.environ.update(PICOTRON_DEVICE=saved)
ov = _common.load_json(OUT / "overlap.json")["results"]
lesson.plot_overlap(ov); plt.show()
serial, both = ov["compute_s"] + ov["comm_s"], ov["both_s"]
hidden = (serial - both) / ov["comm_s"]
ov_busy = _common.busy_reason(ov["others_share"])
print(f"{ov['backend']}: matmuls {ov['compute_s'] * 1e3:.1f} ms + all-reduce of {ov['mib']} MiB {ov['comm_s'] * 1e3:.1f} ms "
      f"= {serial * 1e3:.1f} ms one after the other; together {both * 1e3:.1f} ms: {min(hidden, 1):.0%} of the all-reduce "
      f"hidden (medians of {len(ov['times']['both'])} trials" + ("; together ran faster than the matmuls alone: the "
      "machine's load changed between runs)" if hidden > 1 else ")"))
check("all_reduce(async_op=True) returns at once and the all-reduce runs beside the caller",
      ov["call_s"] <= 0.1 * ov["comm_s"], f"the call returned after {ov['call_s'] * 1e3:.2f} ms, the all-reduce alone "
      f"takes {ov['comm_s'] * 1e3:.1f} ms (a tenth asked)", ov_busy)
check("overlapping never costs more than running one after the other", both <= 1.1 * serial,
      f"{both * 1e3:.1f} ms against {serial * 1e3:.1f} ms (10% allowed)", ov_busy)
if ov["spare"]:  # a GPU's all-reduce runs on links and a few SMs; a CPU rank's, on a core its matmuls left free
    check("part of the all-reduce hides under the matmuls", hidden >= 0.2,
          f"{hidden:.0%} of its {ov['comm_s'] * 1e3:.1f} ms hidden (20% asked)", ov_busy)
else:
    print(f"how much hides is not judged here: {ov['cores']} cores for {ov['ranks']} ranks leave no core for gloo's "
          f"thread, which takes turns with its rank's matmuls (run on {2 * ov['ranks']} cores or more to judge it)")

# %% [markdown]
# Hiding needs hands to spare. With 2 cores for 2 ranks, gloo's thread copies and adds the bytes on the core its
# rank's matmuls use: they take turns, and only the time the all-reduce waits on its partner can hide (anything from
# none to half of it, run to run). With 4 cores or more, the matmuls leave each rank a core for gloo's thread and
# the all-reduce runs beside them. On GPUs the collective runs on NVLink and a few SMs while the matmuls run on the
# rest, and most of it can hide, as long as it is started early enough and enough compute is left to cover it.
# The course uses this five times:
#
# - lesson 03: gradient buckets all-reduced during the backward;
# - lesson 04: ZeRO-3 gathers the next layer's parameters while this one computes (prefetch);
# - lesson 05: async tensor parallelism splits a matmul so each chunk's transfer hides under the next chunk;
# - lesson 06: ring attention sends the next K/V block while this one is used;
# - lesson 07: DualPipe runs one micro-batch's forward beside another's backward, so that each one's
#   communication hides under the other's compute.
#
# **Takeaway:** a collective on its own stream (or thread) runs while compute runs; what is left exposed is the
# part that nothing was ready to cover.

# %% [markdown]
# ## 5. Exercises
# Open `lessons/00_gpu_primer/exercise.py` and write
#
# 1. `intensity(m, n, k, elem)`: FLOPs per byte of a matmul;
# 2. `attainable(peak, bandwidth, intensity)`: the roofline;
# 3. `min_seconds(flops, nbytes, peak, bandwidth)`: the least time an operation can take.
#
# The checker compares them with `picotron.plan.hardware` on many shapes and devices, and names the usual slips: a
# forgotten factor 2 of the multiply-add, $C$'s bytes counted twice or not at all, elements for bytes, a max for the
# min, times added that overlap. Run it here or as `./run.sh python lessons/00_gpu_primer/check.py [name]`.

# %%
all_passed = checker.check()

# %%
with contextlib.redirect_stdout(io.StringIO()) as log:
    solutions_pass = checker.check(module=checker.SOLUTIONS)
check("the exercise checker passes the reference solutions", solutions_pass,
      "intensity, attainable, min_seconds" if solutions_pass else log.getvalue())

# %% [markdown]
# **Takeaway:** three lines of arithmetic, `2mnk`, `min(P, B·I)` and `max(F/P, Q/B)`, predict which limit any
# operation meets.
#
# ## 6. On an H100 you should see
# Predictions from the datasheet figures (`hardware.GPUS`, `hardware.HBM_BANDWIDTH`), unmeasured. A measured peak
# is lower: a large bf16 matmul reaches about 0.8 of the datasheet's (`plan/hardware.py`).

# %%
P, B = H100.peak, hardware.HBM_BANDWIDTH["h100-80gb"]
print(f"H100 SXM, bf16: peak {P / 1e12:.0f} TFLOP/s, HBM {B / 1e12:.2f} TB/s, ridge {hardware.ridge(P, B):.0f} FLOP/byte")
for n in (512, 1024, 4096, 8192):
    i = hardware.intensity("matmul", (n, n, n), 2)
    print(f"  matmul {n}³: I = {i:6.0f} -> {hardware.roofline(P, B, i) / 1e12:5.0f} TFLOP/s at most "
          f"({'compute' if i > hardware.ridge(P, B) else 'memory'}-bound)")
for kind, shape, label in (("rmsnorm", (16384, 4096), "RMSNorm 16384 × 4096"), ("add", (2**28,), "add of 2^28")):
    flops, moved = hardware.op_cost(kind, shape, 2)
    print(f"  {label}: I = {flops / moved:.2f} -> {hardware.roofline(P, B, flops / moved) / 1e12:.2f} TFLOP/s at most "
          f"({hardware.roofline(P, B, flops / moved) / P:.2%} of the peak), {moved / B * 1e6:.0f} µs")
print("measure them on a pod: PICOTRON_DEVICE=cuda python lessons/_notebook.py 00_gpu_primer --run full")

# %% [markdown]
# Sections 3 and 4 change most on a GPU: the loop returns long before `.item()`, the trace gets a row per stream,
# and with 2 GPUs the all-reduce runs over NVLink beside the matmuls.
#
# **Takeaway:** on an H100 only matmuls of a few hundred rows or more are compute-bound. Everything else is paid in
# bytes of HBM.
#
# ## 7. What comes next
# Lesson 01 counts the memory and time of one training step on one device, in these terms: a step's FLOPs against
# the peak (MFU), its bytes against the memory. The parallel lessons then split that step across devices, and each
# asks the questions of this lesson: how many bytes, on which link, and can they hide under compute?
#
# **Takeaway:** FLOPs, bytes and overlap are the three numbers every later lesson measures.

# %%
_common.summary()
