"""Lesson 11's notebook, 11_precision_and_kernels.ipynb, as plain Python in the percent format (see
lessons/_notebook.py): edit this file, never the notebook.

    python lessons/_notebook.py 11_precision_and_kernels --run fast    # rebuild, execute in FAST mode
"""

# %% [markdown]
# # Lesson 11 — Precision and kernels: fewer bits per number, fewer trips to memory
#
# An H100 multiplies bf16 matrices at about 989 TFLOP/s, FP8 at about 1,979 (dense), fp32 at about 67, and moves 3.35
# TB/s to and from memory: ~300 bf16 FLOPs per byte that arrives (NVIDIA H100 SXM datasheet). Hence two habits of
# every large run. Numbers are stored and multiplied in 16 or 8 bits, with fp32 master weights, loss scaling and
# per-tensor scales so that training does not notice. And since an operation with few FLOPs per byte runs at memory
# speed, attention and the small layers between matmuls are tiled and fused to keep their intermediates on chip.
#
# Measured here, in order: the formats' range and rounding; fp16 and loss scaling; each `--dtype` recipe's memory and
# traffic; FP8 scaled per tensor and per tile; attention's bytes and the tiled online softmax; fused kernels; a
# profile of one step.
#
# Code: `picotron/precision.py`, `fp8.py`, `fp8_blockwise.py`, `kernels.py`; measurements: `experiment.py` here;
# formulas and sources: [the reference](../../docs/reference.md#precision-and-kernels); symbols: the
# [notation](../../docs/reference.md#notation). `PICOTRON_FAST=1` gives a short run. Everything runs on this CPU; the
# text says where a GPU differs.

# %%
import math
import sys
import matplotlib.pyplot as plt
import torch
sys.path.insert(0, "..")   # lessons/: the helpers every lesson shares
import _common
from picotron import fp8, fp8_blockwise, kernels, metrics, planner, precision

FAST, OUT = _common.FAST, _common.run_dir("11_precision_and_kernels")
import experiment as lesson   # this folder's experiment.py: its measurements, formulas and plots
MiB = 2**20

def check(name, ok, detail):
    print(f"{'✓' if ok else '✗'} {name}: {detail}")

st = lesson.settings(FAST)
print(f"FAST={FAST}, results in {OUT.relative_to(_common.ROOT)}; torch {torch.__version__}, "
      f"{torch.get_num_threads()} thread(s)")

# %% [markdown]
# ## 1. Five number formats, measured by casting
#
# A binary float with $w_e$ exponent bits and $w_m$ mantissa bits stores $\pm 1.f \times 2^{z - \text{bias}}$ ($z$ the
# stored exponent), bias $= 2^{w_e-1} - 1$. Its **range** runs from the smallest normal number $2^{1 - \text{bias}}$
# to the largest, $(2 - 2^{-w_m})\,2^{2^{w_e} - 2 - \text{bias}}$ (the top exponent is kept for inf and NaN); below
# the smallest normal the *subnormals* $0.f \times 2^{1-\text{bias}}$ reach down to $2^{1-\text{bias}-w_m}$ with ever
# fewer significant bits. Its **precision**: rounding to nearest moves any number in the normal range by at most
# $u = 2^{-(w_m+1)}$ of itself (the unit roundoff). FP8's E4M3 (torch's `float8_e4m3fn`, "finite") has no infinities
# and one NaN pattern, so its top exponent holds numbers too, up to $1.75 \cdot 2^8 = 448$ (IEEE 754-2019; Goldberg
# 1991; Micikevicius et al. 2022 for FP8).
#
# The experiment: these formulas against `torch.finfo`; then values spread evenly in $\log_2$ over the range and
# beyond, cast to the format and back.

# %%
print(f"{'format':<6} {'e':>2} {'m':>3} {'largest':>11} {'smallest normal':>16} {'smallest subnormal':>19} "
      f"{'u = 2^-(m+1)':>13} {'binades':>8}")
for name in lesson.FORMATS:
    f = lesson.format_formulas(name)
    print(f"{name:<6} {f['e']:>2} {f['m']:>3} {f['max']:>11.4g} {f['normal']:>16.4g} {f['subnormal']:>19.4g} "
          f"{f['u']:>13.3g} {f['binades']:>8.1f}")
lesson.plot_formats(); plt.show()

# %%
for name, (dtype, e, m, _) in lesson.FORMATS.items():
    f, fi, got = lesson.format_formulas(name), torch.finfo(dtype), lesson.measure_format(name)
    check(f"{name}: the formulas are torch.finfo's", (f["max"], f["normal"], f["eps"]) == (fi.max, fi.tiny, fi.eps),
          f"largest {f['max']:.6g}, smallest normal 2^{math.log2(f['normal']):.0f}, eps 2^-{m} (bias {f['bias']})")
    check(f"{name}: measured by casting {got['samples']:,} values", got["smallest_positive"] == f["subnormal"]
          and 0.95 * f["u"] / (1 + f["u"]) <= got["max_rel_normal"] <= f["u"] and got["below_half_subnormal_zero"],
          f"smallest positive result {got['smallest_positive']:.4g} = 2^{math.log2(got['smallest_positive']):.0f} "
          f"(the smallest subnormal); worst relative error in the normal range {got['max_rel_normal']:.3g} "
          f"(u = {f['u']:.3g}; the worst case, just above a power of 2, is u/(1 + u) = {f['u'] / (1 + f['u']):.3g}); "
          f"below half the smallest subnormal: 0; above the largest: {got['above_max']}")

# %% [markdown]
# Right panel: inside the normal range the *relative* error is the same at every magnitude — $2^{-24}$ for fp32,
# $2^{-8}$ for bf16 (0.4%), $2^{-11}$ for fp16, 6% and 12% for the FP8 formats — and outside it climbs to 100%
# (flushed to 0) or infinity. bf16 is fp32 with 16 mantissa bits cut off: the same range ($10^{\pm 38}$), about 2.4
# significant decimal digits instead of 7.2. fp16 spans only 40 binades, $6 \cdot 10^{-8}$ to 65,504; E4M3 18,
# E5M2 32. (On this build torch's cast to `float8_e4m3fn` saturates at 448; fp16 and E5M2 overflow to inf.)
#
# **Takeaway:** a format is a window of binades with a fixed relative precision inside. Low precision fails on a
# value outside the window (flushed to zero, or inf), or an update smaller than half a step of its number.
#
# ## 2. fp16: gradients below the window, and loss scaling
#
# A mean loss over $n_\text{tok}$ tokens gives each token a $1/n_\text{tok}$ share of every gradient. A real LLM step
# holds $10^5$ to $10^7$ tokens (Llama 3 405B started at 4 M), so below fp16's smallest normal ($2^{-14} \approx 6
# \cdot 10^{-5}$) a contribution loses bits, below half its smallest subnormal ($2^{-25}$) it becomes zero, and zeros
# propagate backwards. The fix (Micikevicius et al. 2017, section 3.2): multiply the loss by $S$ before backward,
# moving every gradient up $\log_2 S$ binades, and divide by $S$ in fp32 before the update.
#
# We train MINI (the tiny preset cut to 2 layers of width 64, 0.13 M parameters) on 256-token micro-batches, dividing
# each mean loss by $V = 4096$: the gradient is exactly that of **one micro-batch of a step of $V$ times more tokens**
# (~$10^6$). First, every decoder submodule's output gradient (captured by hooks) in fp32, the true values, then in
# fp16 unscaled and with $S = 2^{16}$.

# %%
g32 = lesson.activation_grads("fp32")
g16 = lesson.activation_grads("fp16", scale=1.0)
g16s = lesson.activation_grads("fp16", scale=2.0**16)
lesson.plot_grad_histogram(g32, 2.0**16); plt.show()
bands, bands_s = lesson.fp16_bands(g32), lesson.fp16_bands(g32 * 2.0**16)
for label, b in (("as computed", bands), ("times S = 2^16", bands_s)):
    print(f"  fp32 gradients {label:<15}: fp16 would flush {100 * b['zero']:5.1f}% to 0, keep {100 * b['subnormal']:5.1f}% "
          f"as subnormals, {100 * b['normal']:5.1f}% as normal numbers, overflow {100 * b['overflow']:.1f}%")
zero16, zero16s, zero32 = (float((g == 0).float().mean()) for g in (g16, g16s, g32))
print(f"  measured in real fp16 backward passes: {100 * zero16:.1f}% of {len(g16):,} activation-gradient elements are "
      f"exactly 0 without scaling, {100 * zero16s:.2f}% with S = 2^16 (fp32: {100 * zero32:.2f}%)")

# %%
check("most activation gradients lie below fp16's normal range", bands["normal"] < 0.01 and bands["zero"] > 0.5,
      f"{100 * (1 - bands['normal']):.1f}% below 2^-14, {100 * bands['zero']:.1f}% below 2^-25 (flushed to 0)")
check("a real fp16 backward loses them", zero16 >= 0.9 * bands["zero"] and zero16 > 0.5,
      f"{100 * zero16:.1f}% exactly zero (the formula's {100 * bands['zero']:.1f}%, plus zeros propagated backwards)")
check("S = 2^16 moves them into the window", bands_s["zero"] < 0.01 and bands_s["overflow"] == 0 and zero16s < 0.01,
      f"{100 * bands_s['zero']:.2f}% below 2^-25 after scaling, none overflows; {100 * zero16s:.2f}% zero in the "
      f"scaled fp16 backward")

# %% [markdown]
# Now training with `picotron.train`'s steps (lr schedule, global gradient norm, loss-scale update, no
# `optimizer.step()` on overflow), loss divided by $V$: fp32, then fp16 (fp16 parameters and gradients, fp32 master
# weights and moments: section 3) with `--loss-scale none` and with dynamic loss scaling (the default).

# %%
runs = {"fp32": lesson.train_curve(st["fp16_steps"], v=lesson.V),
        "fp16, no loss scaling": lesson.train_curve(st["fp16_steps"], v=lesson.V, dtype="fp16", loss_scale="none"),
        "fp16, dynamic loss scaling": lesson.train_curve(st["fp16_steps"], v=lesson.V, dtype="fp16")}
lesson.plot_fp16_runs(runs, lesson.V); plt.show()
for label, r in runs.items():
    print(f"  {label:<27} final loss {r['loss'][-1]:.3f}, gradient elements exactly 0 at the last step "
          f"{100 * r['zero_share'][-1]:.1f}%, loss scale {r['final_scale']:g}, {r['seconds']:.1f} s")

# %%
ref, none, dyn = runs.values()
worst = max(abs(a - b) / b for a, b in zip(dyn["loss"], ref["loss"]))
extra = sum(n - r for n, r in zip(none["zero_share"], ref["zero_share"])) / len(ref["zero_share"])
check("fp16 without loss scaling fails", none["loss"][-1] > ref["loss"][-1] + 0.2 and extra > 0.4,
      f"final loss {none['loss'][-1]:.3f} against fp32's {ref['loss'][-1]:.3f}; on average {100 * extra:.0f}% more "
      f"gradient elements exactly zero than fp32's {100 * sum(ref['zero_share']) / len(ref['zero_share']):.1f}% "
      f"(fp32's zeros: embedding rows of bytes the batches never hold)")
check("fp16 with dynamic loss scaling trains like fp32", worst < 5e-3 and not any(dyn["skipped"]),
      f"per-step loss within {worst:.1e} relative of fp32's over {len(ref['loss'])} steps (fp16 rounds each operation "
      f"to 2^-11), final {dyn['loss'][-1]:.3f} vs {ref['loss'][-1]:.3f}; no overflow at S = {dyn['final_scale']:g}")

# %% [markdown]
# Without scaling the run does not diverge: it learns from the gradients that survive and lags fp32 throughout. With
# $S = 2^{16}$ it matches fp32 to within fp16's rounding: the division by $S$ happens *in fp32*, on the master
# weights' side, where it cannot underflow.
#
# **Dynamic loss scaling.** Too small an $S$ loses gradients, too large overflows (past 65,504), and the right one
# drifts, so $S$ is found by trial: a step whose gradients hold an inf or NaN is skipped and halves $S$;
# `growth_interval` clean steps in a row double it (torch's `GradScaler`, picotron's `LossScaler`: start $2^{16}$,
# growth after 2,000). Here from an absurd $S = 2^{30}$, on MINI's plain loss, growth interval 10:

# %%
_common.show_source(precision.LossScaler.update)
scale_run = lesson.train_curve(st["scale_steps"], dtype="fp16", start_scale=2.0**30, growth_interval=10)
lesson.plot_scale(scale_run, 2.0**30, 10); plt.show()

# %%
sk, bad, S = scale_run["skipped"], scale_run["nonfinite"], scale_run["scale"]
check("exactly the steps with non-finite gradients were skipped", sk == bad and any(sk),
      f"{sum(sk)} of {len(sk)} steps skipped: {[i + 1 for i, x in enumerate(sk) if x]} — the steps whose fp16 "
      f"gradients held an inf or NaN (read off the tensors); the weights moved on every other step and on none of "
      f"these: {scale_run['moved'] == [not x for x in sk]}")
rule, clean = [2.0**30], 0   # the rule replayed from the skipped steps alone
for skipped in sk[:-1]:
    clean = 0 if skipped else clean + 1
    rule.append(rule[-1] / 2 if skipped else 2 * rule[-1] if clean == 10 else rule[-1])
    clean = 0 if clean == 10 else clean
grew = [i + 2 for i in range(len(S) - 1) if S[i + 1] == 2 * S[i]]
check("S halves on every skipped step and doubles after 10 clean ones", S == rule,
      f"S step by step is the rule's, replayed from the skipped steps: from 2^30 to 2^{math.log2(S[-1]):.0f}, halved "
      f"after each of the {sum(sk)} skipped steps, doubled before step{'s' if len(grew) != 1 else ''} {grew}")

# %% [markdown]
# The first steps overflow, each halving $S$, until the gradients fit; then $S$ hovers below the largest value that
# fits, probing upwards every `growth_interval` steps at the cost of one skipped step (one in 2,000 by default).
#
# **Takeaway:** a large-batch mean loss's gradients live below fp16's window: multiply the loss by $S$, divide in
# fp32, skip and halve on overflow. bf16, with fp32's exponent range, needs none, which is why it replaced fp16.
#
# ## 3. What each recipe keeps in memory, and sends
#
# `--dtype` picks a recipe (`picotron/precision.py`). Bytes per parameter $\Psi$ of its model states (no sharding), in
# the ZeRO paper's accounting (Rajbhandari et al. 2019, section 3.1):
#
# | recipe | parameters | gradients | optimizer | total |
# |---|---:|---:|---:|---:|
# | fp32, bf16 (autocast), fp8 | 4 | 4 | 8 (two moments) | 16 |
# | bf16-params, fp16 | 2 | 2 | 4 (fp32 master) + 8 | 16 |
#
# Low-precision parameters do not shrink the model states: the optimizer needs an fp32 copy to add small updates to.
# bf16's neighbours of 1.0 are $1 - 2^{-8}$ and $1 + 2^{-7}$, so an update of $3 \cdot 10^{-4}$ (a learning rate times
# Adam's ~unit step) to a bf16 weight of 1.0 changes nothing:

# %%
w = torch.tensor(1.0, dtype=torch.bfloat16)
print(f"bf16: 1.0 + 3e-4 = {float(w + 3e-4)};  fp32: 1.0 + 3e-4 = {float(torch.tensor(1.0) + 3e-4):.7f}")
check("an update below half a bf16 step is rounded away", float(w + 3e-4) == 1.0 and float(w + 4e-3) != 1.0,
      "3e-4 added to 1.0 in bf16 leaves 1.0; 4e-3 (above half the gap 2^-7 up to the next number) does not")
_common.show_source(precision.MasterWeights.step)

# %% [markdown]
# `MasterWeights` casts every gradient to fp32, steps the fp32 masters and rounds them into the bf16 (or fp16)
# parameters, each a single `torch._foreach_*` call over all tensors (a few GPU kernels, not hundreds). The
# experiment: one step of each recipe on the tiny preset (0.85 M parameters, 8 × 128 tokens), all its bytes measured;
# then one step at dp = 2 (2 processes), with bucketed all-reduce and with ZeRO-3, each collective's bytes counted by
# a `metrics.Recorder`.

# %%
mem = lesson.recipe_memory()
_common.launch("11_precision_and_kernels/experiment.py", ["--out", OUT, "--only", "comm"], nproc=2, quiet=True)
comm = _common.load_json(OUT / "comm.json")["results"]
lesson.plot_recipe_memory(mem, comm); plt.show()
print(f"{'recipe':<12} {'params':>7} {'grads':>7} {'masters':>8} {'moments':>8} {'= states':>9} {'activations':>12}  "
      f"(bytes per parameter)")
for r in mem:
    n = r["num_params"]
    print(f"{r['recipe']:<12} {r['params'] / n:>7.2f} {r['grads'] / n:>7.2f} {r['masters'] / n:>8.2f} "
          f"{r['moments'] / n:>8.2f} {(r['params'] + r['grads'] + r['masters'] + r['moments']) / n:>9.3f} "
          f"{r['activations'] / n:>12.1f}   {r['about']}")
print("saved for backward, by dtype (bytes per parameter): " + "; ".join(
    f"{r['recipe']} " + ", ".join(f"{k} {v / r['num_params']:.1f}" for k, v in sorted(r["saved_by_dtype"].items(),
                                                                              key=lambda kv: -kv[1]) if v / r['num_params'] >= 0.05)
    for r in mem))
for label, r in comm.items():
    print(f"  {label:<22} " + ", ".join(f"{k.replace('_', '-')} {v / r['num_params']:.2f} B/param ({r['calls'][k]} calls)"
                                         for k, v in sorted(r["bytes"].items())))

# %%
for r in mem:
    f, n, t = r["formula"], r["num_params"], r["tensors"]
    check(f"{r['recipe']}: the model states are the formula's", r["params"] == f["params"] and r["grads"] == f["grads"]
          and r["masters"] + r["moments"] == f["optimizer"] + 4 * t,
          f"{r['params'] // n} + {r['grads'] // n} + {(r['masters'] + r['moments'] - 4 * t) // n} bytes per parameter = "
          f"{(r['params'] + r['grads'] + r['masters'] + r['moments'] - 4 * t) // n} (+ AdamW's 4-byte step counter per "
          f"tensor, {t} tensors)")
act = {r["recipe"]: r["activations"] for r in mem}
dt = {r["recipe"]: {k: v / r["num_params"] for k, v in r["saved_by_dtype"].items()} for r in mem}
check("fp8 saves fewer activation bytes than bf16 autocast: its matmul inputs in one byte, the rest as bf16 does",
      act["fp8"] < act["bf16"] and dt["fp8"].get("float8_e4m3fn", 0) > 0
      and dt["fp8"]["bfloat16"] < dt["bf16"]["bfloat16"] and dt["fp8"]["float32"] < 1.001 * dt["bf16"]["float32"],
      f"fp8 {act['fp8'] / mem[0]['num_params']:.1f} B/param vs bf16 autocast {act['bf16'] / mem[0]['num_params']:.1f}: "
      f"e4m3 {dt['fp8'].get('float8_e4m3fn', 0):.1f}, bf16 {dt['fp8']['bfloat16']:.1f} (bf16 autocast "
      f"{dt['bf16']['bfloat16']:.1f}), fp32 {dt['fp8']['float32']:.1f} (bf16 autocast {dt['bf16']['float32']:.1f})")
check("low precision shrinks the activations, not the model states", act["bf16-params"] < act["bf16"] < act["fp32"]
      and act["fp8"] < act["fp32"], ", ".join(f"{k} {v / act['fp32']:.2f}" for k, v in act.items()) + " of fp32's")
half = {layout: comm[f"bf16-params {layout}"]["bytes"] for layout in ("dp2", "dp2 ZeRO-3")}
full = {layout: comm[f"fp32 {layout}"]["bytes"] for layout in ("dp2", "dp2 ZeRO-3")}
check("ZeRO-3 gathers bf16 parameters in half the bytes of fp32",
      2 * half["dp2 ZeRO-3"]["all_gather"] == full["dp2 ZeRO-3"]["all_gather"]
      and 2 * half["dp2 ZeRO-3"]["reduce_scatter"] == full["dp2 ZeRO-3"]["reduce_scatter"],
      f"all-gather {half['dp2 ZeRO-3']['all_gather']:,} vs {full['dp2 ZeRO-3']['all_gather']:,} bytes, reduce-scatter "
      f"{half['dp2 ZeRO-3']['reduce_scatter']:,} vs {full['dp2 ZeRO-3']['reduce_scatter']:,}")
check("and data parallelism all-reduces bf16 gradients in half, bf16 autocast's fp32 ones in full",
      2 * half["dp2"]["all_reduce"] == full["dp2"]["all_reduce"] == comm["bf16 dp2"]["bytes"]["all_reduce"],
      f"{half['dp2']['all_reduce']:,} bytes (bf16-params) vs {full['dp2']['all_reduce']:,} (fp32 and bf16 autocast)")

# %% [markdown]
# What differs between recipes is the activations (bf16 autocast keeps its matmuls' inputs in bf16, plus a bf16 copy
# of each weight, lesson 01; bf16 parameters need no copies) and the traffic: bf16 autocast moves fp32 through every
# collective, bf16-params half the bytes.
#
# FP8 saves fewer activation bytes than bf16 autocast: its linears save the E4M3 input and weight copy
# (`ctx.save_for_backward` in `picotron/fp8.py`), one byte where autocast saves two (plus a 4-byte scale each), and
# return bf16 as autocast does, so the rest is saved as under autocast. Had `fp8_linear` returned its *input's* dtype
# (fp32 here), every tensor after a linear would be saved in fp32, and FP8 would save more than autocast.
#
# **Takeaway:** mixed precision is about speed, activations and bandwidth; the model states stay at 16 bytes per
# parameter, and only sharding (ZeRO) divides them.
#
# ## 4. FP8: per-tensor scales, E4M3 forward, E5M2 backward
#
# FP8's windows are narrow (section 1), so each operand of an FP8 matmul is multiplied by its own scale before the
# cast and the product divided by both scales afterwards (`picotron/fp8.py`, current scaling):
#
# $$\sigma = \frac{f_{\max}}{\max|t|}, \qquad t_q = \text{fp8}\big(\text{clamp}(t \cdot \sigma, \pm f_{\max})\big), \qquad
# x\,w^\top \approx \frac{x_q\, w_q^\top}{\sigma_x\, \sigma_w}$$
#
# so the largest element lands on the format's largest number (448 or 57,344). Three tensors of MINI after 10 steps
# (layer 1's `down_proj` input, the SwiGLU product; its weight; the gradient at its output), quantized in each format
# with and without the scale:

# %%
_common.show_source(fp8.quantize)
tensors = lesson.capture(steps=10)
print(f"{'tensor':<11} {'amax':>8} {'binades':>8}  " + "  ".join(f"{fmt + (' scaled' if sc else ' no scale'):>24}"
                                                     for fmt in ("E4M3", "E5M2") for sc in (False, True)))
stats = {}
for name, t in tensors.items():
    stats[name] = {(fmt, sc): lesson.fp8_stats(t, getattr(fp8, fmt), sc) for fmt in ("E4M3", "E5M2")
                   for sc in (False, True)}
    print(f"{name:<11} {float(t.abs().max()):>8.2g} {lesson.binades_below_max(t):>8.1f}  " + "  ".join(
        f"err {s['rel']:6.4f} zero {100 * s['zero']:5.1f}%" for s in stats[name].values()))
print("(binades: from the 1% smallest nonzero |t| to max |t|; err = ‖t̂ − t‖/‖t‖; zero = nonzero elements flushed to 0)")
hist, fp32_run = lesson.amax_history(st["fp8_steps"])
lesson.plot_fp8_tensors(tensors, hist); plt.show()
spread = {k: lesson.spread_binades(v) for k, v in hist.items()}
moves = {k: max(math.log2(max(x) / min(x)) for x in v.values()) for k, v in hist.items()}
print(f"over {st['fp8_steps']} steps and the 14 decoder linears: activation amaxes span {spread['activation']:.1f} "
      f"binades (one tensor moves up to {moves['activation']:.1f}), gradient amaxes {spread['gradient']:.1f} "
      f"({moves['gradient']:.1f})")

# %%
E4, E5 = lesson.format_formulas("E4M3"), lesson.format_formulas("E5M2")
check("the per-tensor scale puts every tensor in E4M3's window", all(
    s[("E4M3", True)]["zero"] < 1e-3 and s[("E4M3", True)]["rel"] < 1.2 * E4["u"] for s in stats.values()),
      "; ".join(f"{k}: error {s[('E4M3', True)]['rel']:.4f} (u = {E4['u']}), {100 * s[('E4M3', True)]['zero']:.2f}% "
                f"flushed" for k, s in stats.items()))
check("without it the gradient underflows E4M3", stats["gradient"][("E4M3", False)]["zero"] > 0.5,
      f"{100 * stats['gradient'][('E4M3', False)]['zero']:.0f}% of the gradient flushed to 0 (E5M2, 7 binades lower: "
      f"{100 * stats['gradient'][('E5M2', False)]['zero']:.1f}%)")
check("scaled, E4M3 is about twice as accurate as E5M2", all(
    1.5 < s[("E5M2", True)]["rel"] / s[("E4M3", True)]["rel"] < 2.5 for s in stats.values()),
      "error ratios E5M2/E4M3 " + ", ".join(f"{s[('E5M2', True)]['rel'] / s[('E4M3', True)]['rel']:.2f}"
                                            for s in stats.values()) + " (one mantissa bit: u doubles)")
check("gradients spread over more binades than activations", spread["gradient"] > spread["activation"] + 5,
      f"{spread['gradient']:.1f} against {spread['activation']:.1f} binades across tensors and steps (E4M3's window: "
      f"{E4['binades']:.0f}, E5M2's: {E5['binades']:.0f})")

# %% [markdown]
# Scaled, E4M3 holds all three tensors at twice E5M2's precision; unscaled, the gradient (amax below $2^{-10}$, half
# E4M3's smallest subnormal) falls out. Why E5M2 for gradients, then? Right panel: over layers and steps the
# gradients' scale moves over many more binades than the activations'. The original FP8 recipes (Micikevicius et al.
# 2022; Transformer Engine's "HYBRID") used *delayed* scaling, from past steps' amaxes, and E5M2's 14 extra binades
# keep a tensor whose amax has since fallen from underflowing. With *current* scaling (ours: each tensor's own, each
# call) the margin matters less: DeepSeek-V3 (section 3.3) uses E4M3 everywhere (section 5).
#
# The FP8 linear layer: the three matmuls of $y = x W^\top$, E4M3 operands forward, an E5M2 gradient backward,
# simulated exactly on this CPU (FP8 operands cast back to fp32, where a product of two FP8 numbers is exact) and run
# by `torch._scaled_mm` on an H100's FP8 tensor cores.

# %%
x2, g2 = tensors["activation"].flatten(0, 1), tensors["gradient"].flatten(0, 1)
errs = lesson.fp8_linear_errors(x2, tensors["weight"], g2)
for label, e in (("fp8_linear", errs["fp8"]), ("bf16 F.linear", errs["bf16"])):
    print(f"  {label:<14} relative error against fp32: y {e[0]:.4f}, grad_x {e[1]:.4f}, grad_w {e[2]:.4f}")
check("fp8_linear is the dequantized product", errs["explicit"] < 1e-5,
      f"forward equals dequantize(x_q) @ dequantize(w_q)ᵀ to {errs['explicit']:.1e} (fp32 summation order)")
check("fp8_linear's error is FP8's", all(e < 0.15 for e in errs["fp8"]) and all(
    a > 3 * b for a, b in zip(errs["fp8"], errs["bf16"])),
      f"y {errs['fp8'][0]:.3f}, grad_x {errs['fp8'][1]:.3f}, grad_w {errs['fp8'][2]:.3f}: a few times u_E4M3 = "
      f"{E4['u']:.4f} / u_E5M2 = {E5['u']:.3f}, far above bf16's {max(errs['bf16']):.4f}")

# %% [markdown]
# A few percent per matmul is unbiased noise that training averages away. `--dtype fp8` on MINI (the decoder's seven
# linears in FP8; embedding, head, norms and attention in higher precision, as in DeepSeek-V3) against bf16 and fp32:

# %%
curves = {"fp32": fp32_run, "bf16": lesson.train_curve(st["fp8_steps"], dtype="bf16"),
          "fp8": lesson.train_curve(st["fp8_steps"], dtype="fp8")}
lesson.plot_fp8_curves(curves); plt.show()
dev = {k: max(abs(a - b) / b for a, b in zip(r["loss"], curves["fp32"]["loss"])) for k, r in curves.items()}
for k, r in curves.items():
    print(f"  {k:<5} final loss {r['loss'][-1]:.4f}, worst per-step relative difference to fp32 {dev[k]:.1e}, "
          f"{r['seconds']:.1f} s")
check("FP8 training follows fp32", dev["fp8"] < 3e-2 and curves["fp8"]["loss"][-1] < 0.75 * curves["fp8"]["loss"][0],
      f"every step within {dev['fp8']:.1e} relative of fp32 (bf16: {dev['bf16']:.1e}); it learns "
      f"({curves['fp8']['loss'][0]:.2f} → {curves['fp8']['loss'][-1]:.3f})")

# %% [markdown]
# Here FP8 is slower (the simulation works in fp32). On an H100 the decoder's matmuls would run at up to twice the
# bf16 rate (datasheet ratio, unmeasured); a step gains less (casts, amax reductions and the bf16 parts do not speed
# up), more as the model grows and its large matmuls dominate.
#
# **Takeaway:** FP8 works because each tensor gets its own scale; E4M3 where precision matters, E5M2 where the
# range must absorb a stale scale; the rest of the model stays in higher precision.

# %% [markdown]
# ## 5. Fine-grained FP8: a scale per 1 × 128 tile (DeepSeek-V3)
#
# One scale per tensor lets the largest element decide where all others land, and LLM activations have outliers: a
# few channels tens to hundreds of times larger than the rest (Dettmers et al. 2022, "LLM.int8()"; Xiao et al. 2023,
# "SmoothQuant"), single tokens, often the first, thousands of times larger (Sun et al. 2024). DeepSeek-V3 (section
# 3.3.2) gives each **1 × 128 tile** of an activation or gradient (one token, 128 channels) and each **128 × 128
# block** of a weight its own scale:
#
# $$d = \frac{\max_{\text{tile}} |t|}{448}, \qquad t_q = \text{E4M3}\big(t / d\big), \qquad
# x W^\top \approx \sum_{j=1}^{\lceil K/128 \rceil} \big(x_{q,j}\, W_{q,j}^\top\big) \cdot d_{x,j}\, d_{W,j}$$
#
# ($d$ is the *dequantizing* factor, $t \approx t_q\,d$, the reciprocal of section 4's $\sigma$.) The scales change
# every 128 elements of the contraction axis $K$, so the product is summed slice by slice, each partial sum times its
# two scales, into an fp32 accumulator. That also fixes a hardware limit ("Increasing Accumulation Precision"):
# Hopper's FP8 tensor cores keep about 14 bits of their running sum (measured on H800), so DeepSeek's kernel copies it
# to fp32 registers every $N_C = 128$ products, the **promotion interval**.
#
# With a window per tile, E4M3 serves every tensor, gradients included ("we adopt the E4M3 format on all tensors").
# Backward tiles along the axis it contracts: dgrad ($g\,W$) takes $g$ in 1 × 128 tiles; wgrad ($g^\top x$, over the
# tokens) takes $g$ and $x$ in **128 × 1** tiles, $x$'s made by dequantizing the saved 1 × 128 tiles, transposing and
# re-quantizing (section 3.5.2). `picotron/fp8_blockwise.py` implements this (`--dtype fp8 --fp8-recipe blockwise`).
# MINI's widths (64, 192) are not multiples of 128: a row's shorter last tile gets its own scale.
#
# First, section 4's tensors, and the activation with one outlier added (a token or a channel times 10 to 10⁶),
# quantized with one scale per tensor and per tile; the error is over the *other* elements:

# %%
_common.show_source(fp8_blockwise.quantize_tiles)
real = {name: lesson.quant_errors(t.reshape(-1, t.shape[-1])) for name, t in tensors.items()}
print(f"{'tensor':<11} " + " ".join(f"{k:>12}" for k in real["activation"]))
for name, e in real.items():
    print(f"{name:<11} " + " ".join(f"{v:12.4f}" for v in e.values()))
x_act, w_act = tensors["activation"].reshape(-1, tensors["activation"].shape[-1]), tensors["weight"]
gemms = {"per tensor": lesson.gemm_errors(x2, tensors["weight"], g2, fp8.fp8_linear),
         "blockwise": lesson.gemm_errors(x2, tensors["weight"], g2, fp8_blockwise.fp8_linear_blockwise)}
for k, e in gemms.items():
    print(f"  {k:<10} fp8 linear, relative error against fp32: y {e[0]:.4f}, grad_x {e[1]:.4f}, grad_w {e[2]:.4f}")
sweep = lesson.outlier_sweep(x_act, w_act)
acc = lesson.accumulation_sweep()
lesson.plot_blockwise(sweep, acc); plt.show()
print(f"{'outlier':<18} {'per tensor E4M3':>15} {'per tensor E5M2':>15} {'tiles E4M3':>11}   x·Wᵀ: {'per tensor':>10} "
      f"{'tiles':>7}")
for r in sweep:
    print(f"{r['kind']:<8} × {r['magnitude']:<7.0e} {r['tensor E4M3']:15.4f} {r['tensor E5M2']:15.4f} "
          f"{r['tiles E4M3']:11.4f}   {r['out_tensor']:17.4f} {r['out_tiles']:7.4f}")
print("K:" + "".join(f"{r['k']:>9}" for r in acc))
for key in ("never", "promoted", "fp32"):
    print(f"{key:<9}" + "".join(f"{r[key]:9.1e}" for r in acc))

# %%
tok = {r["magnitude"]: r for r in sweep if r["kind"] == "token"}
chan = {r["magnitude"]: r for r in sweep if r["kind"] == "channel"}
E4u = E4["u"]
check("tiles keep E4M3's error on the lesson's tensors", all(
    e["tiles E4M3"] <= 1.05 * e["tensor E4M3"] and e["blocks E4M3"] <= 1.05 * e["tensor E4M3"] and e["tiles E4M3"] < E4u
    for e in real.values()),
      "; ".join(f"{k}: tiles {e['tiles E4M3']:.4f}, blocks {e['blocks E4M3']:.4f}, per tensor {e['tensor E4M3']:.4f}"
                for k, e in real.items()) + " (no outliers here: little to win)")
check("blockwise's three GEMMs are more accurate than per-tensor's", gemms["blockwise"][0] <= 1.05 * gemms[
    "per tensor"][0] and all(b < 0.8 * t for b, t in zip(gemms["blockwise"][1:], gemms["per tensor"][1:])),
      f"grad_x {gemms['blockwise'][1]:.4f} against {gemms['per tensor'][1]:.4f}, grad_w {gemms['blockwise'][2]:.4f} "
      f"against {gemms['per tensor'][2]:.4f} (E4M3 gradients instead of E5M2, a scale per tile), y "
      f"{gemms['blockwise'][0]:.4f} against {gemms['per tensor'][0]:.4f}")
check("a 100× or 1000× outlier costs per-tensor E4M3 nothing measurable", all(
    r["tensor E4M3"] < 1.15 * r["tiles E4M3"] for m in (1e2, 1e3) for r in (tok[m], chan[m])),
      "other elements' error " + ", ".join(f"{r['kind']} ×{m:.0e}: {r['tensor E4M3']:.4f} (tiles {r['tiles E4M3']:.4f})"
                                           for m in (1e2, 1e3) for r in (tok[m], chan[m]))
      + ": a float format shifts them down a few binades, it does not round them to a coarse grid as INT8 would")
check("a massive token (× 1e5) flushes the others per tensor, not per tile", tok[1e5]["tensor E4M3"] > 10 * tok[1e5][
    "tiles E4M3"] and tok[1e5]["out_tensor"] > 5 * tok[1e5]["out_tiles"],
      f"other elements' error {tok[1e5]['tensor E4M3']:.3f} per tensor against {tok[1e5]['tiles E4M3']:.4f} per tile "
      f"({tok[1e5]['tensor E4M3'] / tok[1e5]['tiles E4M3']:.0f}×); the other tokens' x·Wᵀ {tok[1e5]['out_tensor']:.3f} "
      f"against {tok[1e5]['out_tiles']:.4f}; per-tensor E5M2 holds ({tok[1e5]['tensor E5M2']:.3f}) at twice E4M3's error")
check("an outlier channel shares its tiles: tiles help less", chan[1e6]["tiles E4M3"] > 1.5 * tok[1e6]["tiles E4M3"],
      f"channel × 1e6: tiles {chan[1e6]['tiles E4M3']:.3f} (per tensor {chan[1e6]['tensor E4M3']:.3f}); token × 1e6: "
      f"tiles {tok[1e6]['tiles E4M3']:.4f} (per tensor {tok[1e6]['tensor E4M3']:.2f})")
check("promotion every 128 products bounds the limited accumulator", acc[-1]["never"] > 10 * acc[-1]["promoted"] and
      max(r["promoted"] for r in acc) < 1.5 * min(r["promoted"] for r in acc),
      f"K = {acc[-1]['k']}: {acc[-1]['never']:.1e} never promoted, {acc[-1]['promoted']:.1e} promoted (flat in K: "
      f"{min(r['promoted'] for r in acc):.1e} to {max(r['promoted'] for r in acc):.1e}); fp32 {acc[-1]['fp32']:.1e}")

# %% [markdown]
# A float format is forgiving: up to about $10^3$–$10^4$ the outlier only pushes the others down the window, keeping
# their 3 mantissa bits (INT8's uniform grid would leave a bit or two). Past E4M3's span (448 down to $2^{-9}$: 17.8
# binades) one scale per tensor flushes the rest, and per-tensor E5M2 survives by trading precision for range; tiles
# keep E4M3's error for the other tokens, a token outlier being alone in its tiles. A channel outlier sits in one tile
# of *every* token, sparing only each row's other tiles (SmoothQuant moves such scales into the weight).
#
# Right panel: a 14-bit accumulator (modelled: it chops what it cannot hold; positive products, the worst case) drifts
# in proportion to $K$; restarted every 128 products and summed in fp32, its error stays at one slice's, whatever $K$.
# DeepSeek reports about 2% at $K = 4096$ on H800 without promotion; our model shows the mechanism, not their
# hardware.
#
# Tiles cost one fp32 scale per 128 one-byte elements, $4/128 = 3.1\%$ more activation bytes ($4\lceil K/128 \rceil
# / K$ with a ragged tail), $4/128^2$ for weights. The training curves, same seed, same batches:

# %%
curves["fp8-blockwise"] = lesson.train_curve(st["fp8_steps"], dtype="fp8", fp8_recipe="blockwise")
lesson.plot_fp8_curves(curves); plt.show()
rel = {k: [abs(a - b) / b for a, b in zip(r["loss"], curves["fp32"]["loss"])] for k, r in curves.items()}
dev, mean_dev = {k: max(v) for k, v in rel.items()}, {k: sum(v) / len(v) for k, v in rel.items()}
for k, r in curves.items():
    print(f"  {k:<13} final loss {r['loss'][-1]:.4f}, relative difference to fp32: mean {mean_dev[k]:.1e}, worst "
          f"{dev[k]:.1e} (step {1 + rel[k].index(dev[k])}), {r['seconds']:.1f} s")
xq, xd = fp8_blockwise.quantize_tiles(x_act)
wq, wd = fp8_blockwise.quantize_blocks(w_act)
k_in = x_act.shape[1]
measured = xd.numel() * xd.element_size() / (xq.numel() * xq.element_size())
planned = planner.fp8_scale_bytes(*x_act.shape) / x_act.numel()
fin = {k: abs(r["loss"][-1] - curves["fp32"]["loss"][-1]) / curves["fp32"]["loss"][-1] for k, r in curves.items()}
check("blockwise FP8 training follows fp32, drifting within 3× per-tensor FP8's",
      mean_dev["fp8-blockwise"] < 1.5e-2 and
      fin["fp8-blockwise"] < 3e-2 and mean_dev["fp8-blockwise"] < 3 * max(mean_dev["fp8"], 1e-4) and
      curves["fp8-blockwise"]["loss"][-1] < 0.75 * curves["fp8-blockwise"]["loss"][0],
      f"mean per-step difference {mean_dev['fp8-blockwise']:.1e} (per-tensor fp8 {mean_dev['fp8']:.1e}, bf16 "
      f"{mean_dev['bf16']:.1e}), final loss {fin['fp8-blockwise']:.1e} off (per-tensor {fin['fp8']:.1e}); worst "
      f"step {dev['fp8-blockwise']:.1e} (per-tensor {dev['fp8']:.1e}); it learns "
      f"({curves['fp8-blockwise']['loss'][0]:.2f} → {curves['fp8-blockwise']['loss'][-1]:.3f})")
check("the scales cost 4·⌈K/128⌉/K bytes per element (planner.fp8_scale_bytes)", measured == planned and
      wd.numel() * wd.element_size() == planner.fp8_scale_bytes(*w_act.shape, block=True),
      f"down_proj's input, K = {k_in}: {xd.numel()} fp32 scales for {xq.numel():,} E4M3 bytes = {100 * measured:.2f}% "
      f"(a multiple of 128: 3.12%); its weight {tuple(w_act.shape)}: {wd.numel()} block scales, "
      f"{wd.numel() * wd.element_size()} bytes")

# %% [markdown]
# In training both FP8 recipes drift from fp32 by a percent or so, most at a loss spike (the worst step printed): one
# small model on one seed cannot rank them, and without outliers one scale per tensor fits. Tiles pay where outliers
# live, in large models over long runs: DeepSeek validated the recipe against bf16 on two smaller MoE models over
# about 10¹² tokens (relative loss difference below 0.25%, section 3.3, appendix B.1), then trained DeepSeek-V3 (671 B
# parameters) with it.
#
# On Hopper, `torch.nn.functional.scaled_mm` computes blockwise products (`BlockWise1x128`, `BlockWise128x128`);
# picotron calls it for the three GEMMs when shapes are multiples of 128. No GPU has run that code yet: correctness
# and speed unmeasured (`./run.sh gpu-check` on a pod compares it with the simulation).
#
# **Takeaway:** a scale per 1 × 128 tile confines an outlier to its tile, so E4M3 serves every tensor; the product
# is summed slice by slice along $K$, and promoting each slice to fp32 also rescues the tensor cores' short accumulator.

# %% [markdown]
# ## 6. Why attention is memory-bound, and how tiling cuts its traffic
#
# Written as three kernels — $S = QK^\top/\sqrt d$, $P = \text{softmax}(S)$, $O = PV$ — attention writes the $s \times s$
# scores to memory, reads them, writes the probabilities, reads them again. Per forward, with $b$ sequences, $a$
# query heads, $a_\text{kv}$ KV heads, elem bytes per number (`kernels.attention_bytes`):
#
# $$\text{naive} = \text{elem}\,(2basd + 2ba_\text{kv}sd + 4bas^2), \qquad \text{FLOPs} = 4bas^2d
# \;\Rightarrow\; \text{intensity} \to \frac{d}{\text{elem}} \text{ FLOP/byte}.$$
#
# At $d = 128$ in bf16 that is 64 FLOPs per byte, against the ~295 an H100 needs (989 TFLOP/s / 3.35 TB/s):
# memory-bound, whatever $s$. FlashAttention (Dao et al. 2022; Dao 2023) never writes $S$: a tile of $B_q$ queries
# stays on chip while the key and value tiles stream past, merged by the **online softmax** (Milakov and Gimelshein
# 2018): keep a running max $\mu$, a running sum $l$ and an unnormalised output, and rescale both by $e^{\mu - \mu'}$
# whenever a new tile raises the max:

# %%
_common.show_source(kernels._flash_forward, "for q0 in range", "lse[..., q0:q1]")

# %% [markdown]
# This is FlashAttention-2's loop order (Dao 2023): each query tile reads its $Q$ once and the K/V tiles it sees, and
# writes $O$ and one log-sum-exp per row, so traffic grows as $s^2/B_q$, not $s^2$. (FlashAttention-1, Dao et al.
# 2022, Algorithm 1, puts the K/V loop outside, rewriting each $O$ tile once per K/V tile.) With grouped-query
# attention, who loads a K/V tile matters: `flash_attention` loads it once per KV head, for the group's
# $a/a_\text{kv}$ query heads together; the Triton kernel (`picotron/flash_triton.py`), like FlashAttention-2, runs
# one program per (query tile, query head), each loading its own copy.
#
# The experiment, for a Llama-3-8B-like layer (32 query heads, 8 KV heads, $d = 128$, bf16, tiles of 128):
# `attention_bytes` against $s$, checked on `kernels.flash_attention` by a dispatch mode that watches the tiles it
# loads and writes; the intensity (K/V loaded per KV head, or per query head) against the balance (matmul peak over
# copy bandwidth) of this CPU, measured, and of the H100; our three implementations' times and saved activations.

# %%
cfg = dict(b=1, a=32, kv=8, d=128, elem=2, block=128, label="32 heads, 8 KV heads, d = 128, bf16")
rows = []
for s in [2**i for i in range(8, 17)]:
    naive = kernels.attention_bytes(1, 32, 8, s, 128, 2, impl="naive")
    tiled = kernels.attention_bytes(1, 32, 8, s, 128, 2, 128, 128, impl="tiled")
    per_q_head = kernels.attention_bytes(1, 32, 32, s, 128, 2, 128, 128, impl="tiled")  # K/V loaded per query head
    rows.append(dict(s=s, naive=naive, tiled=tiled, io=2 * (2 * 32 * s * 128 + 2 * 8 * s * 128),
                     naive_intensity=lesson.attention_flops(1, 32, s, 128, "naive") / naive,
                     tiled_intensity=lesson.attention_flops(1, 32, s, 128, "tiled", 128, 128) / tiled,
                     per_q_head_intensity=lesson.attention_flops(1, 32, s, 128, "tiled", 128, 128) / per_q_head))
peak = metrics.measured_matmul_peak(torch.device("cpu"))
bandwidth = lesson.memory_bandwidth()
balance = {f"this CPU: {peak / 1e9:.0f} GFLOP/s / {bandwidth / 1e9:.0f} GB/s = {peak / bandwidth:.1f}": peak / bandwidth,
           f"H100 SXM datasheet: {lesson.H100['flops'] / 1e12:.0f} TFLOP/s / {lesson.H100['bandwidth'] / 1e12:.2f} TB/s "
           f"= {lesson.H100_RIDGE:.0f}": lesson.H100_RIDGE}
times, saved = lesson.time_attention(("sdpa", "eager", "flash"), st["attn_seqs"], repeats=st["repeats"])
lesson.plot_attention(rows, times, saved, balance, cfg); plt.show()
print(f"  this CPU: matmul peak {peak / 1e9:.0f} GFLOP/s (fp32, metrics.measured_matmul_peak), copy bandwidth "
      f"{bandwidth / 1e9:.0f} GB/s (a 256 MiB copy, read + write): balance {peak / bandwidth:.1f} FLOP/byte")
for r in rows[::2]:
    print(f"  s = {r['s']:>6}: naive {metrics.human_bytes(r['naive']):>10}, tiled {metrics.human_bytes(r['tiled']):>10} "
          f"({r['naive'] / r['tiled']:5.1f}x less); intensity naive {r['naive_intensity']:5.1f}, tiled "
          f"{r['tiled_intensity']:6.1f} (K/V per KV head) or {r['per_q_head_intensity']:6.1f} (per query head) FLOP/byte")
for s in st["attn_seqs"]:
    print(f"  s = {s:>5}: forward + backward " + ", ".join(f"{i} {1e3 * times[i][s]:6.1f} ms" for i in times)
          + " | saved for backward " + ", ".join(f"{i} {saved[i][s] / MiB:5.1f} MiB" for i in saved))

# %%
counted = [(shape, lesson.counted_flash_bytes(*shape), kernels.attention_bytes(*shape, 2, 64, 64, impl="tiled"))
           for shape in ((1, 8, 2, 512, 64), (2, 4, 4, 300, 32), (1, 8, 4, 1024, 64))]
check("attention_bytes counts what the tiled kernel moves", all(c == f for _, c, f in counted),
      "; ".join(f"(b, a, kv, s, d) = {shape}: {c:,} bytes loaded + written, counted on flash_attention" for shape, c, _
                in counted))
b_, a_, k_, s_, d_ = 1, 32, 8, 4096, 128
check("the naive count is the reference's formula", kernels.attention_bytes(b_, a_, k_, s_, d_, 2, impl="naive")
      == 2 * (2 * b_ * a_ * s_ * d_ + 2 * b_ * k_ * s_ * d_ + 4 * b_ * a_ * s_ * s_),
      "elem·(2basd + 2b·a_kv·sd + 4bas²) at s = 4096")
top = rows[-1]
limits = dict(naive_intensity=128 / 2, per_q_head_intensity=2 * 128 / 2, tiled_intensity=2 * 32 * 128 / (8 * 2))
check("intensities reach their limits: naive and per-query-head tiled below the H100's ~295, per-KV-head above",
      all(abs(top[k] - v) / v < 0.05 for k, v in limits.items())
      and top["naive_intensity"] < top["per_q_head_intensity"] < lesson.H100_RIDGE < top["tiled_intensity"],
      f"at s = {top['s']}: naive {top['naive_intensity']:.1f} FLOP/byte (→ d/elem = 64); tiled, K/V per query head "
      f"(Triton, FlashAttention-2) {top['per_q_head_intensity']:.1f} (→ 2B_q/elem = 128), K/V per KV head "
      f"(flash_attention) {top['tiled_intensity']:.0f} (→ 2aB_q/(a_kv·elem) = 512)")
errs = lesson.flash_against_sdpa()
check("tiled attention = SDPA (float64)", max(errs) < 1e-10,
      f"causal, GQA, s = 200 in tiles of 64: largest difference out {errs[0]:.1e}, dq {errs[1]:.1e}, dk {errs[2]:.1e}, "
      f"dv {errs[3]:.1e}")
S = list(st["attn_seqs"])
quad = [(saved["eager"][b] - saved["flash"][b]) / (saved["eager"][a] - saved["flash"][a]) for a, b in zip(S, S[1:])]
lin = [saved["flash"][b] / saved["flash"][a] for a, b in zip(S, S[1:])]
check("eager's saved activations grow as s², flash's as s", all(3.6 < r < 4.4 for r in quad)
      and all(1.9 < r < 2.1 for r in lin),
      f"doubling s: eager's s² part (eager − flash) grows {', '.join(f'{r:.2f}x' for r in quad)}; flash "
      f"{', '.join(f'{r:.2f}x' for r in lin)}")

# %% [markdown]
# At long $s$ both counts are dominated by their $s^2$ terms: naive $4bas^2$ elements against tiled $2ba_\text{kv}d
# \cdot s^2/(2B_q)$ (causal: each query tile reads half the keys on average), a ratio of $4aB_q/(a_\text{kv}d)$ = 16
# for this layer, where the printed ratios level off.
#
# The naive intensity tends to $d/\text{elem}$ = 64; the tiled one to $2aB_q/(a_\text{kv}\cdot\text{elem})$ = 512 if K
# and V are loaded once per KV head, but to $2B_q/\text{elem}$ = 128 if once per query head (the Triton kernel,
# FlashAttention-2): below the H100's ~295, so against main memory that kernel, with $B_q = 128$, is still
# memory-bound in bf16. Larger query tiles raise the bound (on-chip memory limits them); K/V tiles that the GPU's
# cache serves to several programs of a group move it towards the per-KV-head count (unmeasured).
#
# Times: a CPU core's balance is a few FLOPs per byte, so even the naive form is not starved here: `sdpa` (PyTorch's
# fused kernel) is fastest, `eager` falls behind as $s$ grows ($s^2$ fp32 scores), and our `flash`, a Python loop of
# small ops, pays per tile. On a GPU tiling in one kernel wins: FlashAttention-2 runs 3–10× faster than standard
# PyTorch attention, up to 73% of an A100's peak (Dao 2023, section 4.1). The memory saving holds everywhere: `eager`
# saves the $s\times s$ probabilities (×4 when $s$ doubles); `flash` and `sdpa` save $Q, K, V$, the output and one
# log-sum-exp per row, and recompute the probabilities.
#
# **Takeaway:** count bytes, not FLOPs: below the machine's balance an operation runs at memory speed. Tiling keeps
# the $s^2$ intermediates on chip, the online softmax makes tiles mergeable; whether the kernel then crosses the
# balance depends on its query tile and how often it loads each K/V tile.
#
# ## 7. Fused kernels: RMSNorm and SwiGLU
#
# RMSNorm ($y = x/\sqrt{\text{mean}(x^2) + \epsilon} \cdot w$) and SwiGLU ($\text{silu}(g) \cdot u$) do a few FLOPs
# per element; unfused, each op reads its inputs from memory and writes its output back. The op-by-op RMSNorm forward
# moves $7Rh + 6R + h$ elements ($R$ rows of $h$): $x^2$ (read $Rh$, write $Rh$), its mean ($Rh$ in, $R$ out),
# $+\epsilon$ and rsqrt ($2R$ each), $x \cdot \text{rstd}$ ($Rh + R$ in, $Rh$ out), $\cdot\, w$ ($Rh + h$ in, $Rh$
# out). A fused kernel reads $x$ and $w$ and writes $y$ (and one rstd per row): $2Rh + h$. The experiment counts the
# plain ops' bytes (dispatch mode, forward and backward) against `picotron/kernels.py`'s fused kernels, then checks
# and times `torch.compile`'s version against the plain one.

# %%
R = st["fused_rows"]
traffic, fused_times = {}, {}
for kind, h in (("rms_norm", 1024), ("swiglu", 2816)):
    fwd, bwd = lesson.count_plain(kind, R, h)
    traffic[f"{kind} forward"] = dict(plain=fwd.total, fused=lesson.fused_bytes(kind, R, h), ops=len(fwd.ops))
    traffic[f"{kind} backward"] = dict(plain=bwd.total, fused=lesson.fused_bytes(kind, R, h, backward=True),
                                       ops=len(bwd.ops))
    diff, best = lesson.compare_impls(kind, R, h, repeats=st["repeats"])
    fused_times[f"{kind} [{R}, {h}]"] = best
    check(f"{kind}: torch.compile = plain", diff["compile"] < 1e-5,
          f"y and every input gradient within {diff['compile']:.1e} relative of the plain ops' ([{R}, {h}], fp32)")
lesson.plot_fused(traffic, fused_times); plt.show()
for label, t in traffic.items():
    print(f"  {label:<18} plain {t['plain'] / MiB:7.1f} MiB in {t['ops']:>2} ops, fused {t['fused'] / MiB:6.1f} MiB: "
          f"{t['plain'] / t['fused']:.1f}x")
for label, t in fused_times.items():
    print(f"  {label:<22} forward + backward: plain {1e3 * t['plain']:.1f} ms, compile {1e3 * t['compile']:.1f} ms "
          f"({t['plain'] / t['compile']:.1f}x)")
print(f"  triton: {'installed' if kernels.triton is not None else 'not installed here'}; "
      "its kernels run compiled on a CUDA GPU or, with TRITON_INTERPRET=1 set before the import, under its interpreter "
      "(tests/test_kernels.py runs them that way where triton is installed)")

# %%
check("the plain RMSNorm's bytes are the formula's", traffic["rms_norm forward"]["plain"]
      == lesson.rms_norm_plain_bytes(R, 1024),
      f"{traffic['rms_norm forward']['plain']:,} bytes counted op by op = 4·(7Rh + 6R + h), R = {R} rows, h = 1024")

# %% [markdown]
# Fusing cuts the RMSNorm forward's traffic about 3.5× and its backward's more (autograd re-reads and re-writes
# every intermediate); SwiGLU, already two ops, gains less. On a GPU a memory-bound op's time follows its bytes, so
# a fused kernel gains about what it saves (Liger Kernel, Hsu et al. 2024, ships such kernels). `torch.compile`
# writes fused kernels itself: C++ loops here, Triton on a GPU (the untimed first call compiles).
#
# `--compile` compiles every decoder layer of a training run. MINI with and without it:

# %%
compiled = {False: [], True: []}
for flag in (False, True, True, False):   # two runs each, in turn: a busy machine slows both alike
    compiled[flag].append(lesson.compile_run(flag, st["compile_steps"]))
median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
steady = {flag: min(median(r["step_time"][1:]) for r in runs_) for flag, runs_ in compiled.items()}
for flag, runs_ in compiled.items():
    first = ", ".join(f"{1e3 * r['step_time'][0]:.0f}" for r in runs_)
    print(f"  --compile {'on ' if flag else 'off'}: first step {first} ms"
          f"{' (the first run compiles, the second reuses its code)' if flag else ''}, then {1e3 * steady[flag]:.1f} ms "
          f"per step (the better run's median); losses "
          f"{', '.join(f'{x:.5f}' for x in runs_[0]['loss'][:4])}, ...")
print(f"  compiled / not: {steady[True] / steady[False]:.2f} of the step time")
rel = max(abs(a - b) / b for a, b in zip(compiled[True][0]["loss"], compiled[False][0]["loss"]))
check("--compile trains the same model", rel < 1e-5 and len(compiled[True][0]["loss"]) == st["compile_steps"]
      and compiled[True][0]["loss"] == compiled[True][1]["loss"],
      f"{st['compile_steps']} steps, per-step losses within {rel:.1e} relative of the uncompiled run's (the fused code "
      f"rounds in another order); the two compiled runs equal to the bit")

# %% [markdown]
# On a model this small a compiled step is not much faster: its time is dispatch overhead, which compiling trims, and
# matmuls, which it does not change. On a GPU, where every small op costs a launch and a round trip to memory,
# compiling pays more, after a first step that pays for the compilation (seconds to minutes).
#
# **Takeaway:** fuse what is memory-bound; let the compiler do it where it can, write the kernel (Triton, CUDA)
# where it cannot — attention was the case that needed a new algorithm, not just fusion.
#
# ## 8. Where a step's time goes: a profile
#
# `torch.profiler` records every operator a step runs, with its time excluding its children ("self" time) and, for
# matmuls, its FLOPs. One training step of picotron's tiny preset (8 × 128 tokens), after one warm-up step:

# %%
prof = lesson.profile_step()
fig, groups = lesson.plot_profile(prof); plt.show()
total = sum(r["self_s"] for r in prof["ops"])
mm = sum(r["flops"] for r in prof["ops"] if r["op"] == "aten::mm")
for name in sorted(groups, key=groups.get, reverse=True):
    print(f"  {name:<22} {1e3 * groups[name]:7.1f} ms  {100 * groups[name] / total:5.1f}%")
print(f"  the step: {1e3 * prof['wall']:.0f} ms under the profiler, {1e3 * prof['plain']:.0f} ms without it; "
      f"self times sum to {1e3 * total:.0f} ms")

# %%
check("the profiler's matmul FLOPs are 6 × linear parameters × tokens", mm == 6 * prof["linear_params"] * prof["tokens"],
      f"aten::mm counted {mm:,} FLOPs = 6 × {prof['linear_params']:,} × {prof['tokens']:,} (forward 2, backward 4 per "
      f"weight per token); the model's 6N + 12Lhs per token adds attention's {prof['flops_per_token'] * prof['tokens'] - mm:,}, "
      f"inside SDPA, which the profiler does not count")
check("self times partition the step", total <= 1.05 * prof["wall"],
      f"{1e3 * total:.0f} ms of self time within the {1e3 * prof['wall']:.0f} ms the profiled step took")

# %% [markdown]
# The matmuls dominate, as they should on a CPU; attention (SDPA's fused kernels) and the elementwise ops and norms
# share most of the rest; the optimizer (its ops and the `mul_`, `lerp_`, `addcdiv_` it calls, grouped by name) is
# small at this size. On a GPU (`ProfilerActivity.CUDA`) tensor cores shrink the matmuls, so the memory-bound kernels
# (norms, activations, casts, the optimizer) take a larger share. `prof.export_chrome_trace(...)` opens in Perfetto as
# a timeline.
#
# **Takeaway:** a profile, not a guess, says where a step's time goes: here the matmuls; on a GPU more to the
# memory-bound kernels, the share that fusion and FP8's fewer bytes go after.
#
# ## 9. Explore: a format, a tensor, a scale
#
# Pick a format, one of the model's tensors, and a scale $2^j$ applied before the cast, and see the values' histogram
# over the format's window and what the cast does to them. What loss scale puts all section-2 gradients (loss / V)
# into fp16's normal range, and what scale makes them overflow? Which tensors fit E4M3 unscaled? For FP8, what is the
# error at the per-tensor scale $f_{\max}/\text{amax}$ (printed), and at half and twice it? (Widgets need a live
# kernel.)

# %%
VIEW = {"activation gradients (loss / V)": g32, "activation (down_proj input)": tensors["activation"],
        "weight (down_proj)": tensors["weight"], "gradient (down_proj output)": tensors["gradient"]}

def draw(tensor="activation gradients (loss / V)", fmt="fp16", log2_scale=0):
    t = VIEW[tensor]
    fig, s = lesson.draw_view(t, tensor, fmt, log2_scale); plt.show()
    per_tensor = math.log2(lesson.format_formulas(fmt)["max"] / float(t.abs().max()))
    print(f"{tensor} ({t.numel():,} elements) × 2^{log2_scale} in {fmt}: relative error {s['rel']:.3e}, flushed to 0 "
          f"{100 * s['zero']:.2f}%, subnormal {100 * s['subnormal']:.2f}%, overflow {100 * s['overflow']:.2f}%; "
          f"the per-tensor scale fmax/amax would be 2^{per_tensor:.1f}")
    return s

default_view = lesson.view_stats(g32, "fp16", 0)
_common.interactive(draw, lambda w: dict(
    tensor=w.Dropdown(options=list(VIEW), value="activation gradients (loss / V)", description="tensor"),
    fmt=w.Dropdown(options=list(lesson.FORMATS), value="fp16", description="format"),
    log2_scale=w.IntSlider(value=0, min=-20, max=40, description="log2 scale")))

# %%
check("the widget's default = section 2's measurement", abs(default_view["zero"] - bands["zero"]) < 1e-3
      and abs(default_view["subnormal"] - bands["subnormal"]) < 1e-3,
      f"casting the loss / V gradients to fp16 flushes {100 * default_view['zero']:.2f}% to 0 (section 2's thresholds: "
      f"{100 * bands['zero']:.2f}%), keeps {100 * default_view['subnormal']:.2f}% as subnormals "
      f"({100 * bands['subnormal']:.2f}%)")

# %% [markdown]
# **Takeaway:** what a cast does to a tensor depends on where its values sit in the format's window, and a scale
# $2^j$ moves them there: the loss scale for fp16's gradients, $f_{\max}/\text{amax}$ for FP8.
#
# ## 10. On an 8-GPU node you should see
#
# This lesson has no 8-rank mode: it measures in one process, and section 3's byte ratios do not depend on the number
# of ranks. What a GPU changes is the hardware (the H100 figures at the top: bf16 at 15× fp32's peak). The planner
# predicts one H100; FP8 is not in its time model.

# %%
import _node   # lessons/_node.py: the planner's predictions for one 8×H100 node, and the command that measures them
_node.show("11_precision_and_kernels")

# %% [markdown]
# **Takeaway:** on an H100 bf16 is an order of magnitude faster than fp32; tiled attention per query head sits below
# the ridge (memory-bound), per KV head above it.
#
# ## 11. Exercises
# Open `lessons/11_precision_and_kernels/exercise.py`:
#
# 1. `online_softmax_attention(q, k, v, block)`: attention over blocks of keys with a running max, a running sum
#    and a rescaled accumulator, returning the output and the log-sum-exp. Checked against the whole softmax for
#    blocks from 1 to more than the keys and scores around ±1000; the checker names the block size and row, and
#    recognises an unrescaled accumulator (or sum), a missing final division, lse without its max, and overflow.
#
# 2. `update(scale, clean_steps, overflow, ...)`: one step of dynamic loss scaling, run in sequences against
#    `precision.LossScaler`; the checker names the first wrong step and recognises a clean-step count an overflow
#    does not reset, growth one step late or early, and an overflowing step not skipped.
#
# 3. `quantize_e4m3(t)`: per-tensor current scaling into E4M3, bit for bit against `fp8.quantize`; the checker
#    recognises a scale upside down, E5M2's maximum, and an all-zero tensor with an infinite scale.
#
# 4. `quantize_tiles(x, tile=128)`: section 5's tiles, one dequantizing scale amax / 448 per tile, the last one
#    shorter, bit for bit against `fp8_blockwise.quantize_tiles`; the checker recognises scales of the wrong shape
#    (wrong axis, ragged tail dropped), upside down, from the row's amax, E5M2's maximum, and an all-zero tile.
#
# Until you write them, the checker reports `NotImplementedError: not written yet`:

# %%
import check as checker   # this folder's check.py
all_passed = checker.check()

# %% [markdown]
# ## 12. What it costs, when to use it, what comes next
#
# | | model states per parameter | what it buys | what it costs |
# |---|---|---|---|
# | fp32 | 4 + 4 + 8 | exactness, the reference | the slowest matmuls (H100: 67 TFLOP/s, not 989), twice the bytes on the wire |
# | bf16 autocast (`--dtype bf16`) | 4 + 4 + 8 | bf16 matmuls, smaller activations | a bf16 copy of each weight; fp32 traffic |
# | bf16 params (`bf16-params`) | 2 + 2 + 12 | half the bytes in every collective | a master copy |
# | fp16 (`fp16`) | 2 + 2 + 12 | the same without bf16 hardware | loss scaling, skipped steps |
# | FP8 (`fp8`) | 4 + 4 + 8 here | up to 2× matmul rate (Hopper, Ada, Blackwell); fewer activation bytes than bf16 (§3) | scales, casts; outliers |
# | FP8 blockwise (`fp8 --fp8-recipe blockwise`) | 4 + 4 + 8 here | E4M3 everywhere, an outlier confined to its tile (§5) | +3.1% activation bytes, a sum per 128-slice |
# | tiled attention | — | no $s^2$ memory or traffic | a hand-written kernel |
# | fused norms and activations | — | fewer round trips to memory | a compiler, or a kernel to write |
#
# **When.** bf16 with fp32 master weights is the default wherever the hardware has it; fp16 with dynamic loss
# scaling where it does not (V100 and older). FP8 pays on Hopper and later at scale, where the matmuls dominate and
# the casts hide behind them. Flash attention and fused kernels are always on in practice (SDPA picks a flash kernel
# on a GPU; `torch.compile` fuses the rest).
#
# **On a GPU: what each path cost, and why.** One H200 (torch 2.11, CUDA 13), SmolLM-360M at $s = 2048$, micro-batch
# 4, *before* this lesson's GPU paths were rewritten: `--dtype bf16` 69,800 tokens/s (25.9% of the measured matmul
# peak), level with transformers' Llama (70,100); `--compile` 98,100 (1.41×: the elementwise ops fused);
# `--kernels triton` 1.08× (two of those fusions by hand); `--dtype bf16-params` 0.89× (the fp32 master copy updated
# one tensor at a time: hundreds of small launches ate what half the bytes saved); `--dtype fp8` 0.44× (scales, casts
# and fp32 outputs as separate kernels, the fp32 outputs saved for backward); `--attn-impl flash` 0.011× (a handful of
# small kernels per tile).
#
# Each cause is now addressed (foreach kernels for the master copy; FP8 linears that return bf16 and use
# `torch._scaled_mm` on sm89+; a Triton kernel, `picotron/flash_triton.py`, for `--attn-impl flash`), but unmeasured
# on a GPU: `python benchmarks/mfu_table.py` re-measures every row at the SmolLM-360M and 1.7B shapes, beside
# transformers' Llama, with MFU against the measured and the datasheet peak.
#
# **What ours lacks.** FP8 is simulated on CPUs and uses `torch._scaled_mm` only on sm89+ (the blockwise sm90 path has
# never run on a GPU, section 5); no per-32-element scales (Blackwell's MXFP8), no amax history, none of DeepSeek's
# other FP8 savings (FP8 activations cached between layers, FP8 all-to-all dispatch). The Triton flash attention
# follows FlashAttention-2, without FlashAttention-3's Hopper features (warp specialisation, asynchronous copies,
# FP8). Production stacks also fuse the cross-entropy with the LM head (the logits never exist), RoPE, and the
# optimizer step.
#
# **Sources.** IEEE 754-2019; Goldberg 1991, "What Every Computer Scientist Should Know About Floating-Point
# Arithmetic"; Micikevicius et al. 2017, "Mixed Precision Training" (loss scaling, master weights); Micikevicius et
# al. 2022, "FP8 Formats for Deep Learning"; Rajbhandari et al. 2019, "ZeRO", section 3.1 (2 + 2 + 12 bytes);
# DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", sections 3.3 and 3.5.2 (FP8 training, fine-grained scaling,
# promotion, 128 × 1 tiles for wgrad); Dettmers et al. 2022, "LLM.int8()"; Xiao et al. 2023, "SmoothQuant"; Sun et al.
# 2024, "Massive Activations in Large Language Models"; Milakov and
# Gimelshein 2018, "Online normalizer calculation for softmax"; Dao et al. 2022, "FlashAttention"; Dao 2023,
# "FlashAttention-2", section 4.1; Hsu et al. 2024, "Liger Kernel" (fused RMSNorm, SwiGLU); NVIDIA's H100 datasheet
# and Transformer Engine FP8 primer; PyTorch's `torch.amp.GradScaler`; the Triton tutorials (fused softmax, layer
# norm). Formulas and links: [the reference](../../docs/reference.md#precision-and-kernels).
#
# **Next:** on a GPU, `python benchmarks/kernels_bench.py` times these kernels and recipes against the alternatives
# (paired rounds, ratios with quartiles; `--gpu-attention-only`: our Triton flash attention against SDPA's), and
# `--dtype`, `--attn-impl flash`, `--kernels` / `--compile` switch them on in any training run.
#
# **Takeaway:** spend bits where the numbers need them (fp32 for the optimizer, bf16 or FP8 for the matmuls, a scale
# per tensor) and trips to memory only where data must go: tile, fuse, and measure bytes as carefully as FLOPs.
