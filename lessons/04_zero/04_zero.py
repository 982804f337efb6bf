"""Lesson 04's notebook, 04_zero.ipynb, as plain Python in the percent format (see lessons/_notebook.py):
edit this file, never the notebook.

    python lessons/_notebook.py 04_zero --run fast    # rebuild the notebook, execute it in FAST mode
"""

# %% [markdown]
# # Lesson 04 — ZeRO: stop keeping n copies
#
# With data parallelism every rank keeps **all** the parameters, gradients and AdamW state: $n$ identical copies of
# $16\Psi$ bytes (lesson 03's last chart). ZeRO (Rajbhandari et al., 2020) shards one more of the three over the $n$
# ranks at each stage ([notation](../../docs/reference.md#notation)):
#
# | stage | each rank keeps | bytes per rank (our fp32 recipe) | traffic per step |
# |---|---|---|---|
# | DP | everything | $4\Psi + 4\Psi + 8\Psi$ | all-reduce ≈ $2\Psi$ |
# | ZeRO-1 | $\frac1n$ of the optimizer state | $4\Psi + 4\Psi + 8\Psi/n$ | reduce-scatter + all-gather ≈ $2\Psi$ |
# | ZeRO-2 | also $\frac1n$ of the gradients | $4\Psi + (4\Psi + 8\Psi)/n$ | the same ≈ $2\Psi$ |
# | ZeRO-3 | also $\frac1n$ of the parameters | $(4\Psi + 4\Psi + 8\Psi)/n$ | two all-gathers + a reduce-scatter ≈ $3\Psi$ |
#
# We build all three (`picotron/zero.py`, `picotron/zero3.py`), measure memory and bytes against these formulas, watch
# ZeRO-3's all-gathers hide behind compute, race it against torch's FSDP2 and check that every stage trains like one
# process; then ZeRO with a pipeline, HSDP and Muon.
#
# The experiments, `lessons/04_zero/experiment.py`, run under `torchrun` on 1, 2 and 4 processes (`PICOTRON_FAST=1`: a
# short run).

# %%
import sys
import matplotlib.pyplot as plt
sys.path.insert(0, "..")   # lessons/: the helpers every lesson shares
import _common
from picotron import marks, metrics, zero, zero3
from picotron.mesh import Axis
from picotron.model import ModelConfig

FAST, OUT = _common.FAST, _common.run_dir("04_zero")
import experiment as lesson   # this folder's experiment.py: its widget model and its plots
MiB = 2**20

def run(only, nproc=2):
    # torchrun --nproc_per_node nproc lessons/04_zero/experiment.py --out OUT --only <only>; show what it printed
    _common.run_experiment("04_zero", only, nproc)

mc = ModelConfig.from_preset("tiny", **_common.SIZES["small"])
psi = mc.num_params()
print(f"FAST={FAST}, results in {OUT.relative_to(_common.ROOT)}; model 'small': Ψ = {psi / 1e6:.2f} M parameters, "
      f"{16 * psi / MiB:.1f} MiB of fp32 model states (16 bytes per parameter)")

# %% [markdown]
# ## 1. The problem: model states do not fit
#
# Model states per GPU of real models (lesson 01) under each stage, with the
# [mixed-precision recipe](../../docs/reference.md#model-states) ($2\Psi + 2\Psi + 12\Psi$), on 8 and 64 GPUs:

# %%
# Llama-3-70B is not a preset of ours (it would never be trained here); its shape, for the arithmetic:
llama70 = ModelConfig.from_preset("llama3-8b", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                                  num_key_value_heads=8, intermediate_size=28672)
SIZES = {"smollm-1.7b": ModelConfig.from_preset("smollm-1.7b").num_params(),
         "llama3-8b": ModelConfig.from_preset("llama3-8b").num_params(), "llama3-70b": llama70.num_params()}
for name, p in SIZES.items():
    for n in (8, 64):
        per = lesson.memory_per_gpu(p, n, recipe="mixed")
        print(f"{name:<12} Ψ = {p / 1e9:5.2f} B, n = {n:>2}: " +
              "  ".join(f"{lesson.STAGE_NAMES[s]} {per[s]['total'] / 1e9:7.1f} GB" for s in range(4)))

# %% [markdown]
# **Takeaway:** data parallelism's memory per GPU does not fall as GPUs are added (Llama-3-8B: 128 GB of model states
# on every GPU); ZeRO's does (ZeRO-3 over 8 GPUs: 16 GB each), at a price in communication that this lesson shows is
# small.
#
# ## 2. The idea
#
# **ZeRO-1.** After the all-reduce, $n$ ranks take the same AdamW step on identical state. Instead, cut every
# parameter vector into $n$ chunks: rank $r$ keeps Adam's moments for chunk $r$ only and updates that chunk, then the
# ranks exchange the updated chunks. AdamW is **elementwise**, so the result is exactly data parallelism's.
#
# The all-reduce is a **reduce-scatter followed by an all-gather** (lesson 02); ZeRO-1 puts the optimizer step
# *between* the two halves:
#
# ```
# DP:      grads ──reduce-scatter──> chunk r summed ──all-gather──> full grads ──AdamW on all Ψ──> params
# ZeRO-1:  grads ──reduce-scatter──> chunk r summed ──AdamW on chunk r (Ψ/n)──> new chunk r ──all-gather──> params
# ```
#
# Same bytes ($\approx 2\Psi$ per rank), $\frac1n$ of the optimizer state and of the optimizer's arithmetic.
#
# **ZeRO-2.** A rank reads only its own chunk of the gradient: reduce-scatter each bucket as soon as backward
# fills it, keep the chunk, drop the bucket.
#
# **ZeRO-3.** Keep $\frac1n$ of the parameters too; **all-gather** a layer's parameters just before it computes,
# then free them. Backward gathers them again: $\approx 3\Psi$ (two all-gathers, one reduce-scatter). To hide
# them, gather the **next** layer while the current one computes (prefetch).
#
# **The flat view** (`FlatUnit`). Each unit (a bucket in stages 1–2, a layer in stage 3) is one flat vector: its
# tensors concatenated, zero-padded to a multiple of $n$, cut into $n$ equal chunks. Chunks cut across tensors:
# AdamW does not care, and weight decay is decided per tensor piece.

# %%
_common.show_source(zero.FlatUnit)

# %% [markdown]
# Our small model's ZeRO-3 units at dp = 3 (cutting runs no collective). Three does not divide a layer's size, so each
# layer gets one element of padding (zoomed in on a layer's end):

# %%
layout = lesson.flat_layout(3)
lesson.plot_flat_units(layout, 3); plt.show()
for u in layout:
    print(f"{u['name']:<8} {u['numel']:>9,} elements = 3 × {u['chunk']:,} − {u['padded'] - u['numel']} padding")

# %% [markdown]
# **Takeaway:** ZeRO is one idea applied three times: keep $\frac1n$ of a flat, padded vector; fetch or scatter the
# rest with one collective when needed.
#
# ## 3. Read the code
#
# **Stages 1 and 2** (`ZeroDataParallel`): lesson 03's buckets, but a complete bucket launches a **reduce-scatter**
# instead of an all-reduce. Stage 1 keeps the full gradient buffer (gradient accumulation adds into it under
# `no_sync`); stage 2 keeps only the chunk, reduce-scattering into it every micro-batch:

# %%
_common.show_source(zero.ZeroDataParallel._grad_ready)
print()
_common.show_source(zero.ShardedGradSync._send_gradients)

# %% [markdown]
# The optimizer never sees a full tensor: `optimizer_groups()` hands AdamW 1-D views of this rank's chunk (one piece
# per tensor it touches). `ShardedOptimizer.step()` runs AdamW on those pieces, then all-gathers the updated chunks in
# place into the buffers the parameters are views of:

# %%
_common.show_source(zero.ShardedGradSync.optimizer_groups)
print()
_common.show_source(zero.ShardedOptimizer.step)
print()
_common.show_source(zero.ZeroDataParallel.gather_updated_params)

# %% [markdown]
# **Gradient clipping** needs the *whole* gradient's norm: all-reduce the chunks' squared norms (one number), then
# scale every chunk; forgetting it trains silently wrong
# ([reference](../../docs/reference.md#gradient-clipping-when-gradients-are-sharded)). ZeRO **marks** its pieces as
# sharded over dp × cp; `marks.clip_grad_norm` sums a marked gradient over the ranks, an unmarked one on one rank
# only:

# %%
_common.show_source(zero.ShardedGradSync._make_pieces)
print()
_common.show_source(marks.clip_grad_norm)

# %% [markdown]
# **Stage 3** (`zero3.Zero3`): one unit per layer plus a *root* unit (embedding, final norm, LM head). A unit's flat
# buffer is freed by resizing its storage to 0 bytes and refilled by an all-gather; the parameters stay views of it,
# so what autograd saved stays valid. Four hooks: before a layer's forward (gather, prefetch the next), after it
# (free; hook its output's gradient), when backward reaches it (gather again, prefetch the previous), after its last
# parameter gradient (reduce-scatter, free):

# %%
_common.show_source(zero3.Zero3._use)
print()
for hook in (zero3.Zero3._post_forward, zero3.Zero3._pre_backward, zero3.Zero3._grad_ready):
    _common.show_source(hook)
    print()

# %% [markdown]
# The root stays gathered from the forward's start to the backward's end (the LM head is used last in forward and
# first in backward; FSDP2 does the same), so stage 3 all-gathers $2\Psi - \Psi_\text{root}$ and reduce-scatters
# $\Psi$. The last *layer* is freed by `_post_forward` and gathered again at once (exercise 4 fixes that). Under
# ZeRO-3 **every forward is collective**: evaluation and generation must run on every rank, or the others hang.
#
# **Who counts the bytes.** A `metrics.Recorder`, passed as `mesh.dp_cp.recorded(recorder)`, sums each collective's
# whole buffer by kind and records when it ran; the hooks name each layer's forward and backward (`self.phases`) for
# it (`hooks.watch(model, listener=recorder.phase)`):

# %%
_common.show_source(Axis.reduce_scatter_into)
print()
_common.show_source(metrics.Recorder.collective, "def collective", "self.log.append")

# %% [markdown]
# Each variant is built and stepped as `picotron.train` does (`parallelize(cfg, mesh, recorder=...)`): forward,
# backward, gradient sync, clipping, optimizer step (ZeRO-1/2: with its all-gather), `zero_grad`:

# %%
_common.show_source(lesson.Variant.step, "batches =", "self.model.zero_grad")

# %% [markdown]
# **Takeaway:** the training loop does not change; each stage is a gradient-sync wrapper plus, for ZeRO-1/2, an
# optimizer that all-gathers after its step.
#
# ## 4. Run it
#
# ### (a) What every rank keeps, at dp = 2 and 4
# Every stage (stage 0: lesson 03's `DataParallel`) on its own copy of the model, one step each in turn. Each rank
# reports the parameter, gradient and optimizer bytes it holds after the gradient sync, beside
# `planner.zero_model_state_bytes`; the same run counts the bytes on the wire for (b):

# %%
for n in lesson.counts():   # 2, 4; and 8 with PICOTRON_NPROC=8 (section 10)
    run("stages", nproc=n)
stages = {n: _common.load_json(OUT / f"stages_dp{n}.json")["results"] for n in lesson.counts()}
lesson.plot_memory(stages); plt.show()
print(f"{'':<12}" + "".join(f"{k + ' MiB':>24}" for k in lesson.PARTS))
for n, res in stages.items():
    for row in res["rows"]:
        cells = []
        for k in lesson.PARTS:
            worst = max(abs(m[k] / row["formula"][k] - 1) for m in row["mem_by_rank"])
            cells.append(f"{row['mem_by_rank'][0][k] / MiB:8.2f} ({row['formula'][k] / MiB:6.2f}, {worst:5.1%})")
        print(f"{row['name']:<8}n={n:<2}" + "".join(f"{c:>24}" for c in cells))
print("each cell: rank 0 measured (formula, worst relative difference over all ranks)")

# %% [markdown]
# Every bar matches its formula, up to Adam's 4-byte step counters and padding (the worst difference printed).
#
# The formula leaves out two things. First, the **buffers in flight**, which do not shrink with $n$: up to two flat
# gradient buckets for ZeRO-2; whole gathered layers and the root for ZeRO-3:

# %%
for n, res in stages.items():
    z2, z3 = res["rows"][2], res["rows"][3]
    buckets = [4 * u["padded"] for u in z2["units"]]
    root, layer = 4 * z3["units"][0]["padded"], 4 * max(u["padded"] for u in z3["units"][1:])
    p2, p3 = (r["mem_by_rank"][0]["zero_transient_peak"] for r in (z2, z3))
    print(f"dp={n}: ZeRO-2 {p2 / MiB:5.2f} MiB in flight at the peak = {p2 / max(buckets):.2f} of its largest "
          f"bucket ({max(buckets) / MiB:.2f} MiB); ZeRO-3 {p3 / MiB:5.2f} MiB = {(p3 - 2 * root) / layer:.2f} layers "
          f"({layer / MiB:.2f} MiB each) + 2 × the root ({root / MiB:.2f} MiB), against "
          f"{z3['mem_by_rank'][0]['params'] / MiB:.2f} MiB of parameter shards")

# %% [markdown]
# ZeRO-3's peak is three layers and twice the root: in backward, the layer computing, the one prefetched and a
# gradient buffer, plus the root and its gradient; with our 4 layers that is most of the model, with 32 or 80 a small
# fraction. Second, **activations**: ZeRO does not touch them (recomputation, lesson 01, and tensor, sequence and
# context parallelism, lessons 05–06, do).
#
# **Takeaway:** the model states fall exactly as the formula says; ZeRO adds a few whole units in flight, which matter
# only in a model with few units.
#
# ### (b) The bytes on the wire
# The bytes each variant's collectives cover per step (DP's all-reduce counted as a ring's reduce-scatter plus
# all-gather), against `planner.zero_comm_elements` (black lines):

# %%
lesson.plot_comm(stages); plt.show()
for n, res in stages.items():
    for row in res["rows"]:
        total = sum(b * (2 if k == "all_reduce" else 1) for k, b in row["bytes_per_step"].items())
        pred = 4 * sum(row["predicted_elements"].values())
        print(f"dp={n} {row['name']:<7} {total / (4 * row['psi']):.3f} x 4Ψ bytes per step (predicted {pred / (4 * row['psi']):.3f}), "
              f"step {1e3 * row['median']:6.1f} ms (median)")

# %% [markdown]
# Stages 1 and 2 move exactly what data parallelism moves; stage 3 one more all-gather of every layer. A ring sends
# $\frac{n-1}{n}$ of each buffer per rank, so the bytes per rank hardly depend on $n$.
#
# **Takeaway:** ZeRO-1 and ZeRO-2 are free in bytes; ZeRO-3 costs about 1.5× data parallelism's traffic, cheap in
# time only if hidden behind compute.
#
# ### (c) ZeRO-3's timeline: prefetch on and off
# For ZeRO-3 with and without prefetch (steps alternating), every rank records each layer's forward and backward and
# each collective from launch to completion. Each rank computes more tokens than in (a) (first line printed), so that
# a layer computes longer than its parameters take to arrive. First on gloo alone:

# %%
run("timeline")
tl_run = _common.load_json(OUT / "timeline.json")
tl, st = tl_run["results"], tl_run["settings"]
print(f"ZeRO-3, {st['tl_micro_batch_size']} × {st['tl_seq_len']} tokens per rank per step, {st['tl_steps']} timed "
      f"steps of each variant")

def show_prefetch(rows, where):
    for row in rows:
        o = row["overlap"]
        print(f"{where}, {row['name']:<11}: step {1e3 * row['median']:6.1f} ms (median, quartiles "
              f"{1e3 * row['q1']:.0f}-{1e3 * row['q3']:.0f}) | {o['n_gathers']:.0f} layer all-gathers per step, "
              f"{o['hidden_fraction']:.0%} of their time under layer compute, {1e3 * o['exposed_gather_s']:.1f} ms outside")
    g = lesson.prefetch_gain(rows)
    print(f"{where}: prefetch took {1e3 * g['moved']:.1f} ms of all-gathering per step off the critical path; the fastest "
          f"step {'gained' if g['gain'] >= 0 else 'LOST'} {1e3 * abs(g['gain']):.1f} ms (the median of {g['n']} paired "
          f"rounds: {1e3 * g['paired']:+.1f} ms)" + ("  [FAST: few steps]" if FAST else ""))
    return g

gloo_gain = show_prefetch(tl["rows"], "gloo")
lesson.plot_timeline(tl["rows"], title="ZeRO-3 on gloo, 2 processes on this CPU: one step of rank 0 (the last timed)"); plt.show()

# %% [markdown]
# With prefetch the all-gather of layer $j+1$ (orange) sits under the forward of layer $j$ (blue), in backward the
# gather of layer $j-1$ under the backward of layer $j$ (green), and a layer's reduce-scatter (red) under the next
# layer's backward. Without prefetch the orange bars sit *between* the compute bars: each layer waits for its gather.
# (gloo's reduce-scatter has no completion callback: its end is seen only when we wait, so those bars are paler and
# too long.)
#
# The last line compares the gathering prefetch hid with what it gained between each variant's fastest step (the least
# disturbed); the quartiles show the noise, the paired median is a second opinion. On this CPU expect a gain much
# smaller than what was hidden, often none (a chance gain shows as two disagreeing estimates): gloo moves the bytes
# with the same two cores that compute, so a hidden all-gather still slows the layer beside it. On a GPU the transfer
# has its own engine and links, and the hidden time is saved.
#
# **Takeaway:** prefetch hides the all-gathers on this CPU, but hiding is not saving when the transfer competes with
# compute for the same cores.
#
# ### (c′) The same timeline over an emulated link
# The same run over an **emulated link** (`picotron/link.py`): each collective still runs on gloo (exact results) but
# completes no earlier than a ring would on a link of the given bandwidth and latency, sleeping meanwhile so the cores
# can compute. The bandwidth makes a layer's all-gather take four fifths of its measured forward (first line below):
# short enough to hide, long enough that the real local transfer is a small part:

# %%
link = tl["link"]
print(f"{link['label']}: one layer's all-gather = {link['layer_bytes'] / 1e6:.2f} MB, {1e3 * link['t_gather']:.1f} ms on "
      f"the link, against a layer's forward of {1e3 * link['t_forward']:.1f} ms (median, gloo run)")
link_gain = show_prefetch(tl["link_rows"], "emulated")
lesson.plot_timeline(tl["link_rows"], title=f"ZeRO-3 over an {link['label']} (collectives run on gloo, held to the "
                                           f"link's time): one step of rank 0"); plt.show()

# %% [markdown]
# Now the picture is the textbook one: prefetch puts the gathers under the previous layer's compute, and the fastest
# step gains a large part of what was hidden (last line; on a busy machine even more). Two gathers stay exposed: the
# first layer's at the forward's start, and the last layer's re-gather at the backward's start (section 3).
#
# **Takeaway:** prefetch turns ZeRO-3's extra all-gathers into hidden work when the transfer does not compete with
# compute: true on GPUs, emulated here.
#
# ### (d) Against torch's FSDP2
# `torch.distributed.fsdp.fully_shard` is torch's ZeRO-3, with our units (one call per layer, one on the model).
# Same model and batches, one step of each alternately (`benchmarks/zero_vs_fsdp.py`), keeping each round's ratio;
# then each alone on two fresh ranks, for the peak memory above the baseline:

# %%
run("fsdp")
run("fsdp_memory", nproc=1)
fsdp = _common.load_json(OUT / "fsdp.json")["results"]
fmem = _common.load_json(OUT / "fsdp_memory.json")["results"]["memory"]
r = fsdp["ratio"]
print(f"ours/FSDP2 throughput: {r['median']:.3f} (median of {r['n']} paired rounds, quartiles {r['q1']:.3f}-{r['q3']:.3f}):"
      f" in this run ours is {'faster' if r['median'] > 1 else 'slower'}" + ("  [FAST mode: few rounds]" if FAST else ""))
for name in ("ours", "fsdp2"):
    states = sum(fmem[name]["states"].values())
    print(f"{name:<6} peak {fmem[name]['peak'] / MiB:7.2f} MiB above the baseline, {fmem[name]['peak'] / states:.1f} x its "
          f"model states (" + ", ".join(f"{k} {v / MiB:.2f}" for k, v in fmem[name]["states"].items()) + " MiB)")
lesson.plot_fsdp(fsdp, fmem); plt.show()

# %% [markdown]
# The model states are identical, byte for byte. The peaks are a few times the model states (ratios printed):
# activations, the logits and their gradient, autograd's temporaries, the allocator's slack.
#
# The throughput ratio varies with this machine's load: run `python benchmarks/repeat.py --runs 5 zero_vs_fsdp.py` on
# a quiet one before quoting it. Both run the same collectives; where ours is faster, the gap is overhead. FSDP2,
# built for GPUs, copies every chunk into and out of a separate all-gather buffer and runs more Python and autograd
# machinery around the backward, on the two cores that also compute; ours gathers straight into the parameters' buffer
# and lets autograd accumulate into the buffer the reduce-scatter sends.
#
# **Takeaway:** the same algorithm, the same memory; on a CPU the bookkeeping around the collectives decides the
# speed.
#
# ## 5. Check it: the same training as one process
#
# `picotron.train --zero 0|1|2|3` at dp = 2 and 4, 2 micro-batches per step, against one process with the same
# global batch (`grad_acc` = 2·dp), fp32, same seed: losses within $10^{-5}$ relative over the first 10 steps, the
# [parity standard](../../docs/reference.md#parity-standard). The full settings train 20 steps; later steps are
# drift, bounded by $10^{-3}$ (lesson 03 §5). `tests/test_zero.py` also checks gradients and parameters at dp = 2, 3, 4.

# %%
for n in (1,) + lesson.counts():   # and dp = 8 with PICOTRON_NPROC=8
    run("parity", nproc=n)
refs = _common.load_json(OUT / "parity_dp1.json")["results"]["losses"]
pairs = {}
for n in lesson.counts():
    for stage, losses in _common.load_json(OUT / f"parity_dp{n}.json")["results"]["losses"].items():
        pairs[f"dp={n} {lesson.STAGE_NAMES[int(stage)]}"] = (losses, refs[f"reference_acc{2 * n}"])
for label, (got, ref) in pairs.items():
    p = _common.parity(got, ref)
    print(f"{label:<12} vs 1 process: max relative loss difference over steps 1-{p['window']} {p['worst']:.1e}"
          + (f", over steps {p['window'] + 1}-{p['n_steps']} {p['beyond']:.1e}" if p["n_beyond"] else ""))
lesson.plot_parity(pairs); plt.show()

# %% [markdown]
# Every claim of this lesson that is not a timing is checked as a number; the timing claims, with wide margins:
# prefetch must put at least 30 points more of the layer all-gathers' time under compute, and over the emulated link
# the fastest step must gain at least a quarter of the gathering prefetch hid (gloo's real transfer under the sleep
# still takes some core time; a quarter leaves room for that and a busy machine). A timing check that misses while
# other programs held over 10% of the cores (`_common.LoadWindow`) prints **?** (inconclusive: rerun), not ✗.

# %%
check = _common.check   # prints ✓ or ✗ (or ?, only for a timing check on a machine measured busy) and counts it

for label, (got, ref) in pairs.items():
    for line in _common.parity_checks(label, got, ref):
        check(*line)
for n, res in stages.items():
    worst = max(abs(m[k] / row["formula"][k] - 1) for row in res["rows"] for m in row["mem_by_rank"] for k in lesson.PARTS)
    check(f"memory within 1% of the formula, every stage and rank, dp={n}", worst <= 0.01, f"worst difference {worst:.2%}")
    for row in res["rows"]:
        got = sum(b * (2 if k == "all_reduce" else 1) for k, b in row["bytes_per_step"].items()) / 4
        pred = sum(row["predicted_elements"].values())
        check(f"dp={n} {row['name']}: bytes per step as predicted", abs(got / pred - 1) <= 0.01,
              f"{got / row['psi']:.3f} Ψ elements (predicted {pred / row['psi']:.3f} Ψ)")
for where, rows in (("gloo", tl["rows"]), ("emulated link", tl["link_rows"])):
    pre, nopre = (row["overlap"] for row in rows)
    check(f"{where}: prefetch hides ZeRO-3's layer all-gathers under compute",
          pre["hidden_fraction"] > nopre["hidden_fraction"] + 0.3,
          f"{pre['hidden_fraction']:.0%} with prefetch, {nopre['hidden_fraction']:.0%} without",
          _common.busy_reason(rows[0].get("busy"), what="during the timed steps"))
check("emulated link: what prefetch hides comes back as a faster step", link_gain["gain"] >= 0.25 * link_gain["moved"],
      f"the fastest step {1e3 * link_gain['gain']:.1f} ms faster for {1e3 * link_gain['moved']:.1f} ms of gathering hidden "
      f"({link_gain['gain'] / link_gain['moved']:.0%}; gloo alone: {1e3 * gloo_gain['gain']:.1f} ms for "
      f"{1e3 * gloo_gain['moved']:.1f} ms)",
      _common.busy_reason(tl["link_rows"][0].get("busy"), what="during the timed steps"))
same = all(abs(fmem["ours"]["states"][k] - fmem["fsdp2"]["states"][k]) <= 0.01 * fmem["fsdp2"]["states"][k] for k in lesson.PARTS)
check("ours and FSDP2 keep the same model states", same,
      ", ".join(f"{k} {fmem['ours']['states'][k] / MiB:.2f} vs {fmem['fsdp2']['states'][k] / MiB:.2f} MiB" for k in lesson.PARTS))

# %% [markdown]
# **Takeaway:** sharding changes where the numbers live, not the numbers: every stage trains like one process.
#
# ## 6. Explore: how many GPUs for a model?
#
# `lesson.memory_per_gpu` is the introduction's table as code (`planner.zero_model_state_bytes`). Pick a model,
# $n$, a stage and a recipe ("ours": fp32; "mixed": bf16 params and grads, fp32 master and moments). At which $n$
# does ZeRO-1 stop helping? Why does ZeRO-3's curve keep falling while the others flatten? How many 80 GB GPUs does
# Llama-3-70B need for its model states with each stage? (Widgets need a live kernel.)

# %%
PRESETS = {"small (this lesson)": psi, "smollm-135m": ModelConfig.from_preset("smollm-135m").num_params(), **SIZES}

def draw(model="llama3-8b", n=8, stage=3, recipe="mixed", capacity_gb=80.0):
    p = PRESETS[model]
    lesson.plot_memory_model(p, n, stage, recipe, capacity_gb, title=f"({model})"); plt.show()
    fits = {s: lesson.smallest_dp_that_fits(p, s, capacity_gb * 1e9, recipe) for s in range(4)}
    print("smallest power-of-two n whose model states fit: " +
          ", ".join(f"{lesson.STAGE_NAMES[s]} {fits[s] if fits[s] else 'never'}" for s in range(4)))

# drawn once with the defaults (what a static viewer shows); in a live kernel, controls that redraw it
_common.interactive(draw, lambda w: dict(model=w.Dropdown(options=list(PRESETS), value="llama3-8b"),
                                         n=w.SelectionSlider(options=[2**k for k in range(11)], value=8, description="ranks n"),
                                         stage=w.ToggleButtons(options=[("DP", 0), ("ZeRO-1", 1), ("ZeRO-2", 2), ("ZeRO-3", 3)], value=3),
                                         recipe=w.ToggleButtons(options=["mixed", "ours"]),
                                         capacity_gb=w.FloatSlider(value=80, min=8, max=192, step=8, description="GB per GPU")))

# %% [markdown]
# **Takeaway:** only ZeRO-3 keeps falling with $n$; stages 1 and 2 level off at the parameters (and gradients)
# every rank still keeps whole.
#
# ## 7. ZeRO with a pipeline
#
# Pipeline parallelism (lesson 07) cuts the model by depth, data parallelism copies each stage, ZeRO shards the
# copies, as in Llama 3 405B's training: FSDP (ZeRO-3) as the dp dimension of a tp · cp · pp · dp layout, weights kept
# gathered after the forward so the backward needs no second all-gather (Dubey et al. 2024, *The Llama 3 Herd of
# Models*, arXiv:2407.21783, §3.3.2). The pipeline changes *when*: a step runs $m \ge p$ micro-batches through each
# chunk, interleaved with other chunks'.
#
# The executor (`Pipeline.run`) runs every backward but a chunk's last (`Pipeline.final`: its last $B$, or $W$ in a
# split schedule) under `no_sync()`, as data parallelism expects. ZeRO follows ($\Psi_s$: one pipeline rank's
# parameters):
#
# * **ZeRO-1** as before: one reduce-scatter at the chunk's last backward, one all-gather after the optimizer step:
#   $\Psi_s + \Psi_s$ per step.
#
# * **ZeRO-2** holds the chunk's whole gradients through the step ($4\Psi_s$ bytes here) and reduce-scatters them
#   once: $\Psi_s + \Psi_s$. Reduce-scattering every micro-batch, as without a pipeline, would send $m\Psi_s$, and
#   $m$ is 4–8 $p$ in practice. torch's pipeline stages do the same with FSDP (`torch.distributed.pipelining`,
#   `set_requires_gradient_sync(False)` on all but the last backward).
#
# * **ZeRO-3** gathers a unit for each $F$ and $B$ that uses it (a split schedule's $W$ reads no weight: $g^T x$).
#   Either it **keeps** each unit gathered from its first use to the chunk's last backward (all-gather $\Psi_s$ per
#   step, holding the stage's whole parameters *and* gradients), or it **reshards** after every use (all-gather
#   $\Psi_{root} + 2m\Psi_{layers}$, holding a few layers' parameters beside the whole gradients).
#
# picotron keeps them, as torchtitan does with pp (`reshard_after_forward=False`, "to avoid per-microbatch
# all-gathers"): $2m$ times the traffic to save at most half of the step's peak is a bad trade.
#
# The experiment: the small model with 8 layers on 2 × 2 ranks (dp 2, pp 2, 1F1B) under each variant (ZeRO-3
# resharded via `reshard_after_forward`), every collective counted by a Recorder, against the formula from each
# rank's padded units, `lesson.pp_zero_elements`.

# %%
run("pipeline", nproc=4)
pipe = _common.load_json(OUT / "pipeline.json")["results"]
print(f"dp={pipe['dp']} x pp={pipe['pp']}, 1F1B, m={pipe['m']} micro-batches per step; per step, per rank "
      f"(elements / Ψ_stage), and the whole buffers ZeRO held at the peak of the step on top of what it keeps "
      f"between steps (/ 4Ψ_stage bytes; ZeRO-1 keeps its whole gradients all the time)")
for row in pipe["rows"]:
    for i in range(pipe["pp"]):
        r = next(x for x in row["by_rank"] if x["pp_rank"] == i)
        sent = {k: b / 4 / r["psi"] for k, b in r["bytes"].items()}
        print(f"{row['name']:<17} stage {i}: all-gather {sent['all_gather']:5.2f}, reduce-scatter "
              f"{sent['reduce_scatter']:4.2f} (formula {r['predicted']['all_gather'] / r['psi']:5.2f}, "
              f"{r['predicted']['reduce_scatter'] / r['psi']:4.2f}); held whole at the peak "
              f"{r['mem']['zero_transient_peak'] / (4 * r['psi']):.2f}")
lesson.plot_pipeline(pipe); plt.show()
for row in pipe["rows"]:
    exact = all(x["bytes"][k] == 4 * x["predicted"][k] for x in row["by_rank"] for k in x["predicted"])
    _common.check(f"pp=2: {row['name']} sends what the formula says, every rank", exact,
                  "; ".join(f"rank {j}: {x['bytes']['all_gather'] // 4} + {x['bytes']['reduce_scatter'] // 4} elements"
                            f" (formula {x['predicted']['all_gather']} + {x['predicted']['reduce_scatter']})"
                            for j, x in enumerate(row["by_rank"])))
kept, resharded = ({x["pp_rank"]: x for x in row["by_rank"]} for row in pipe["rows"][2:4])
_common.check("ZeRO-3 kept holds the stage's whole parameters and gradients at its peak; resharded, much less",
              all(kept[i]["mem"]["zero_transient_peak"] >= 8 * kept[i]["psi"] > resharded[i]["mem"]["zero_transient_peak"]
                  for i in kept),
              ", ".join(f"stage {i}: {kept[i]['mem']['zero_transient_peak'] / MiB:.1f} vs "
                        f"{resharded[i]['mem']['zero_transient_peak'] / MiB:.1f} MiB" for i in kept))

# %% [markdown]
# The reduce-scatters are exactly $\Psi_s$ for every variant, whatever $m$. ZeRO-3 kept moves what ZeRO-1/2 move;
# resharded, its all-gathers grow with $m$ while it saves only parameters (the gradients stay whole until the last
# backward; ZeRO-1's always). Exercise 7 asks for these formulas; its checker:

# %%
import check as checker   # this folder's check.py
checker.check(["pp_traffic"])

# %% [markdown]
# **Takeaway:** under a pipeline the sharded stages follow the schedule's last backward: one reduce-scatter per chunk
# per step; ZeRO-3 keeps a chunk's layers gathered through the step (resharding costs $2m$ times the traffic).
#
# ## 8. HSDP: shard within a node, replicate across nodes
#
# ZeRO over all $n$ dp ranks runs at the speed of the group's slowest link: on a pod, the network between nodes (about
# 50 GB/s per H100 against NVLink's 450), over which ZeRO-3 all-gathers **every layer, forward and backward, every
# micro-batch**. **HSDP** (hybrid sharded data parallelism) shards over a smaller group and replicates that sharded
# model:
#
# * the dp ranks are cut into blocks of $n_s$ = `dp_shard` consecutive ranks (with their cp ranks): a **shard group**,
#   typically one node. ZeRO (any stage) runs within it, on NVLink;
# * the $n_r = n / n_s$ blocks are **replicas**: rank $j$ of every block holds the same shard, and after the
#   reduce-scatter the replicas **all-reduce that shard**, $\Psi/n_s$ of the gradient, over the network;
# * memory is divided by $n_s$ instead of $n$: the price of the cheaper network.
#
# PyTorch FSDP calls it hybrid sharding (Zhao et al. 2023, *PyTorch FSDP*, arXiv:2304.11277, section 3.2; its other
# names, in torchtitan, Megatron-LM and ZeRO++, Wang et al. 2023, arXiv:2306.10209, in the
# [reference](../../docs/reference.md#zero-memory-and-communication-per-rank)). Here: `--dp-shard N` with `--zero 1|2|3`; the mesh gets
# axes `dp_shard` and `dp_replicate` (`picotron.mesh.shard_groups`), each its own process group, so a Recorder
# counts each link's bytes apart. dp = 8 on two nodes of four GPUs, `--dp-shard 4`:

# %%
from picotron.mesh import shard_groups
for dp, ds, cp in ((8, 4, 1), (4, 2, 1), (4, 2, 2)):
    shard, replicate = shard_groups(dict(dp=dp, cp=cp), ds)
    print(f"dp={dp} cp={cp} --dp-shard {ds}: shard groups {shard}   replicate groups {replicate}")

# %% [markdown]
# With cp, replicas share the cp coordinate. The bytes each rank **sends** per step (one micro-batch, ring
# collectives, $\Psi$ fp32 parameters):
#
# $$\text{shard link: } \frac{n_s-1}{n_s}\,(\underbrace{\Psi}_{\text{RS}} + \underbrace{\Psi \text{ or } 2\Psi-\Psi_{root}}_{\text{AG: ZeRO-1/2 or 3}})\cdot 4
# \qquad \text{replicate link: } \frac{2(n_r-1)}{n_r}\,\frac{\Psi}{n_s}\cdot 4$$
#
# (`planner.hsdp_bytes_per_step`). At $n_s = n$ it is plain ZeRO; at $n_s = 1$, data parallelism's all-reduce, all on
# the replicate link. The code is four lines in `ShardedGradSync`: after the last reduce-scatter, each unit's gradient
# shard is all-reduced over the replicas and divided by all $n$ batch shards (not $n_s$). Every rank starts them in
# the units' order after the shard group's collectives, so the two communicators see one order, as NCCL asks
# (tests/test_hsdp.py replays it):

# %%
_common.show_source(zero.ShardedGradSync._all_reduce_replicas)

# %% [markdown]
# Clipping and checkpoints read each optimizer piece's placement: under HSDP, sharded over `("dp_shard", "cp")`
# (different within a block, the same on its replicas), so `marks.counted_here` counts it on the first block only,
# and a checkpoint written at `--dp-shard 2` loads into plain ZeRO and back (tests/test_hsdp.py).
#
# **Run it.** dp = 4 on 4 processes, ZeRO-1 and ZeRO-3, at `dp_shard` = 1, 2 and 4 (1: data parallelism; 4: plain
# ZeRO): the last step's bytes on each link, every rank, against the formula from its padded units; the losses;
# what a rank keeps.

# %%
run("hsdp", nproc=4)
hs = _common.load_json(OUT / "hsdp.json")["results"]
print(f"dp={hs['dp']}: bytes sent per rank per step / 4Ψ (measured | formula), optimizer state per rank, losses")
for row in hs["rows"]:
    r = row["by_rank"][0]
    norm = 4 * r["psi"]
    print(f"ZeRO-{row['stage']} dp_shard={row['dp_shard']} (n_s={row['n_shard']}, n_r={row['n_replicate']}): "
          f"shard link {r['sent']['shard'] / norm:.3f} | {r['formula']['dp_shard'] / norm:.3f}, "
          f"replicate link {r['sent']['replicate'] / norm:.3f} | {r['formula']['dp_replicate'] / norm:.3f}; "
          f"optimizer {r['mem']['optimizer'] / MiB:5.2f} MiB; losses {', '.join(f'{x:.5f}' for x in row['losses'])}")
lesson.plot_hsdp(hs); plt.show()
for row in hs["rows"]:
    exact = all(x["buffers"]["shard"] == x["formula"]["buffers"]["dp_shard"]
                and x["buffers"]["replicate"] == x["formula"]["buffers"]["dp_replicate"] for x in row["by_rank"])
    _common.check(f"ZeRO-{row['stage']} dp_shard={row['dp_shard']}: each link carries the formula's buffers, every rank",
                  exact, "; ".join(f"rank {j}: {x['buffers']}" for j, x in enumerate(row["by_rank"])))
for stage in sorted({row["stage"] for row in hs["rows"]}):
    rows = [row for row in hs["rows"] if row["stage"] == stage]
    plain = next(row for row in rows if row["n_replicate"] == 1)
    worst = max(abs(a - b) / abs(b) for row in rows for a, b in zip(row["losses"], plain["losses"]))
    _common.check(f"ZeRO-{stage}: every dp_shard trains as plain ZeRO (losses within 1e-5)", worst <= 1e-5,
                  f"worst relative difference {worst:.1e} over {len(plain['losses'])} steps")
_common.check("the two communicators replay clean under NCCL's rules (ZeRO-3, dp_shard=2)", hs["replay"]["ok"],
              f"per communicator: {hs['replay']['per_communicator']}; one order: {hs['replay']['one_order']}")

# %% [markdown]
# The shard link carries ZeRO's usual $\frac{n_s-1}{n_s}$ share, the replicate link $\frac{1}{n_s}$ of data
# parallelism's all-reduce: at dp = 4 = 2 × 2, half a model's bytes cross the "network" per step instead of 1.5 (ZeRO)
# or 2.2 (ZeRO-3); on a pod $n_s = 8$ makes it an eighth. The price: the optimizer state per rank doubles from
# `dp_shard` 4 to 2.
#
# **Is it worth it on a pod?** The planner (`python -m picotron.plan`) tries every `dp_shard` whose group lies in one
# node (NVLink within, the network across, ZeRO's states divided by the group). For Llama 3 70B (seq 8192, 16M tokens
# per step) on H100s, a node's dp ranks cannot hold the model ($16\Psi$ = 1.1 TB), but a node's **cp ranks** can
# (`dp_shard` = 1 with cp 8), and its ZeRO then reduce-scatters on NVLink. Under a pipeline ZeRO-2 and 3 save nothing
# over ZeRO-1 at the step's peak (section 7), so the best layouts use ZeRO-1 (ZeRO-2 ties):

# %%
from picotron import plan
from picotron.planner import Layout
mc70 = ModelConfig.from_preset("llama3-70b")
h100 = plan.usable(plan.GPUS["h100-80gb"])
for gpus, plain, hybrid in ((256, "dp8,tp2,pp4,cp4,sp,zero1,1f1b,mbs1,ga256",
                             "dp4,pp8,cp8,zero1,shard1,1f1b,mbs1,ga512"),
                            (1024, "dp32,tp4,pp2,cp4,sp,zero1,interleaved-v2,mbs2,ga32",
                             "dp16,pp8,cp8,zero1,shard1,1f1b,mbs1,ga128")):
    rows = {name: plan.step_time(mc70, Layout.parse(name), 8192, h100) for name in (plain, hybrid)}
    print(f"{gpus} GPUs: best plain {plain}: {rows[plain]['tokens_per_s']:,.0f} tokens/s (dp {rows[plain]['dp']:.2f} s); "
          f"HSDP {hybrid}: {rows[hybrid]['tokens_per_s']:,.0f} tokens/s (dp {rows[hybrid]['dp']:.2f} s), "
          f"{rows[hybrid]['tokens_per_s'] / rows[plain]['tokens_per_s'] - 1:+.1%}")

# %% [markdown]
# The best plain layouts leave about half a second of gradient traffic exposed per step (0.54 s on 256 GPUs, 0.42 s
# on 1,024: reduce-scatter and all-gather across nodes, behind one backward); HSDP cuts that below 0.1 s but needs
# eight pipeline stages, a larger bubble. On 256 GPUs (58 s steps) HSDP loses by 1.1%; on 1,024 (15 s steps) it
# wins by 0.4%: the planner's answer there, a small one.
#
# **Takeaway:** HSDP keeps ZeRO's heavy traffic inside a node and sends $1/n_s$ of the gradient across nodes, for
# $n_s$-way instead of $n$-way memory savings. It matters when that traffic is exposed: ZeRO-3 across many nodes,
# few tokens per GPU, a slow network.
#
# ## 9. Muon: an optimizer that needs the whole matrix
#
# ZeRO rests on AdamW being **elementwise**, so a flat chunk may cut a matrix anywhere. **Muon** (Jordan et al. 2024,
# *Muon: An optimizer for hidden layers in neural networks*, kellerjordan.github.io/posts/muon) breaks that on
# purpose. For each hidden matrix $W$ ($A \times B$) it keeps SGD momentum with Nesterov, $M_t = \mu M_{t-1} + G_t$, $U_t = G_t + \mu M_t$
# ($\mu = 0.95$), and steps along the orthogonal matrix nearest to $U_t$, $O_t = UV^\top$ for $U_t = U\Sigma V^\top$,
# computed by five Newton–Schulz iterations of a quintic from $X_0 = U_t/\lVert U_t\rVert_F$:
#
# $$X_{k+1} = aX_k + (bA_k + cA_k^2)X_k,\quad A_k = X_kX_k^\top,\quad (a, b, c) = (3.4445, -4.7750, 2.0315)$$
#
# then scales it so that its RMS matches AdamW's and the same learning rate works (Liu et al. 2025, *Muon is Scalable
# for LLM Training*, arXiv:2502.16982, §2.2): $W \leftarrow W - \eta\,(0.2\sqrt{\max(A,B)}\,O_t + \lambda W)$.
# Embedding, LM head and norms stay with AdamW. (The blog iterates in bf16 on a GPU; ours in fp32, so a sharded run
# can be checked against one process.) `picotron/muon.py`, `--optimizer muon`.
#
# $X_kX_k^\top$ mixes every element with every other: **Newton–Schulz needs the whole matrix**. The momentum stays
# in ZeRO's pieces, but before the iteration the pieces must meet. Two designs:
#
# * **gather** (Liu et al.'s *Distributed Muon*, §2.3): every rank all-gathers the update of each unit holding a Muon
#   matrix, runs Newton–Schulz on every matrix, redundantly, and keeps its piece. Bytes per rank: one more
#   all-gather, $\approx\frac{n-1}{n}\Psi$; compute: all of it, on every rank.
# * **owner**: each matrix gets one owner, largest first to the least-loaded rank (`planner.owner_of`). One
#   all-to-all sends every piece to its owner, the owner orthogonalises, a second sends the pieces back: about
#   $2\Psi_{muon}/n$ per rank, $\approx 1/n$ of the compute. Jordan's modded-nanogpt shares matrices out likewise
#   (each rank orthogonalises every $n$-th one, then the results are all-gathered).
#
# Under tensor parallelism the same holds for tp's slices. Newton–Schulz costs $5\,(4m^2k + 2m^3)$ FLOPs for an
# $m \times k$ matrix, $m \le k$ (`planner.muon_ns_flops`); both designs' bytes, exact for our units, are
# `planner.muon_bytes_per_step`. The owner's exchange:

# %%
from picotron import muon
_common.show_source(muon.Exchange._owner)

# %% [markdown]
# **Run it.** dp = 4, ZeRO-1 (4 MiB buckets): AdamW, Muon-gather and Muon-owner on the same batches and learning
# rate. Each optimizer step is timed apart from ZeRO's all-gather, Newton–Schulz's time summed; a Recorder counts
# the exchange's collectives.

# %%
import statistics
run("muon", nproc=4)
mu = _common.load_json(OUT / "muon.json")["results"]
print(f"dp={mu['dp']}, ZeRO-1: Muon's exchange per rank per step, buffers in MiB (measured | formula), "
      f"Newton–Schulz GFLOP per rank, the optimizer step's time (rank 0, median)")
for row in mu["rows"]:
    steps0 = row["by_rank"][0]["steps"]
    opt_ms = statistics.median(s["optimizer_s"] for s in steps0) * 1e3
    ns_ms = statistics.median(s["ns_s"] for s in steps0) * 1e3
    name = row["optimizer"] + (f" ({row['impl']})" if row["optimizer"] == "muon" else "")
    if row["optimizer"] == "muon":
        per = "; ".join(f"rank {k}: {sum(r['steps'][-1]['bytes'].values()) / MiB:.2f} | "
                        f"{sum(r['formula']['buffers'].values()) / MiB:.2f}, {r['steps'][-1]['ns_flops'] / 1e9:.2f}"
                        for k, r in enumerate(row["by_rank"]))
        print(f"{name:15s} {per}")
    print(f"{'' if row['optimizer'] == 'muon' else name:15s} step {opt_ms:6.1f} ms, of which Newton–Schulz "
          f"{ns_ms:6.1f} ms; losses "
          f"{', '.join(f'{x:.4f}' for x in row['losses'])}")
lesson.plot_muon(mu); plt.show()
gathered, owned = (next(r for r in mu["rows"] if r["impl"] == i and r["optimizer"] == "muon") for i in ("gather", "owner"))
for row in (gathered, owned):
    _common.check(f"Muon ({row['impl']}): every rank's exchange is the formula's buffers, every step",
                  all(s["bytes"] == r["formula"]["buffers"] for r in row["by_rank"] for s in r["steps"]),
                  "; ".join(f"rank {k}: {r['steps'][-1]['bytes']} vs {r['formula']['buffers']}"
                            for k, r in enumerate(row["by_rank"])))
    _common.check(f"Muon ({row['impl']}): the Newton–Schulz FLOPs each rank ran are the formula's",
                  all(s["ns_flops"] == r["ns_flops_formula"] for r in row["by_rank"] for s in r["steps"]),
                  "; ".join(f"rank {k}: {r['steps'][-1]['ns_flops']} vs {r['ns_flops_formula']}"
                            for k, r in enumerate(row["by_rank"])))
_common.check("owner sends fewer bytes than gather on every rank, and runs ~1/n of the Newton–Schulz work",
              all(sum(o["formula"]["buffers"].values()) < sum(g["formula"]["buffers"].values())
                  and o["ns_flops_formula"] < g["ns_flops_formula"] for o, g in zip(owned["by_rank"], gathered["by_rank"])),
              f"owner {[sum(r['formula']['buffers'].values()) for r in owned['by_rank']]} vs gather "
              f"{[sum(r['formula']['buffers'].values()) for r in gathered['by_rank']]}")
worst = max(abs(a - b) / abs(b) for a, b in zip(owned["losses"], gathered["losses"]))
_common.check("gather and owner train alike (the same update, computed elsewhere): losses within 1e-5", worst <= 1e-5,
              f"worst relative difference {worst:.1e}")

# %% [markdown]
# Gather all-gathers every bucket holding a hidden matrix (here nearly the whole model: the embedding shares buckets
# with the layers), and every rank runs all the Newton–Schulz FLOPs; at n = 4 owner sends about half of the hidden
# matrices' bytes, and each rank runs about a quarter of the FLOPs. On this CPU Newton–Schulz is most of Muon's step,
# so dividing it is what owner buys; on a GPU in bf16 the bytes matter more (unmeasured here). The losses match one
# process's (tests/test_muon.py: dp, ZeRO-1/2/3, tp, pp, both designs, 1e-5), and the tests replay both exchanges
# under NCCL's rules (same collectives, order and sizes on every rank).
#
# **Takeaway:** a matrix optimizer undoes ZeRO's "cut anywhere": each matrix must meet once per step, on every rank
# (gather) or on one owner (about $2\Psi_{muon}/n$ bytes, $1/n$ of the compute); exercise 9 assigns the owners.
#
# ## 10. On an 8-GPU node you should see
# Over 8 GPUs the model states per GPU shrink towards $16\Psi/8$ as the stages rise, while the activations stay: for
# the medium model at 8 × 512 tokens they are most of each GPU's memory, so ZeRO saves little there. ZeRO-3 sends 1.5×
# ZeRO-0's bytes, all hidden under compute on NVLink in the time model. `PICOTRON_NPROC=8` adds dp = 8 to the stage
# comparison of 4(a) and the parity runs of section 5.

# %%
import _node   # lessons/_node.py: the planner's predictions for one 8×H100 node
_node.show("04_zero")

# %% [markdown]
# **Takeaway:** ZeRO pays where model states dominate; on one node its extra traffic is cheap, and for a small model
# the activations set the memory.
#
# ## 11. Exercises
# Open `lessons/04_zero/exercise.py`. First ZeRO's three moves by hand:
#
# 1. `shard_range(numel, n, rank)` — the chunk rank `rank` owns in a unit padded to a multiple of $n$;
# 2. `reduce_scatter_gradients(grads)` — ZeRO-2's step: flatten, pad, reduce-scatter, average: this rank's chunk of
#    the mean gradient;
# 3. `ShardedAdamW.step(grad_chunk)` — ZeRO-1's optimizer: AdamW on this rank's chunk only, then all-gather the
#    updated chunks into the flat parameter vector, in place.
#
# Then two things section 4 found, made into code (each a small subclass of `zero3.Zero3`):
#
# 4. `KeepLastLayer._post_forward` — keep the last layer gathered from its forward to its backward (the timelines show
#    it freed and re-gathered at once): one all-gather of a layer less per micro-batch;
# 5. `Bf16Gather._gather` / `_wait` — all-gather a bf16 copy of each shard and widen it into the fp32 buffer: half
#    the all-gather bytes, the fp32 shards still the master copy.
#
# And a puzzle:
#
# 6. `plan(budget_mib)` — the small model on 2 ranks, 16 sequences of 128 tokens per step: choose the ZeRO stage and
#    the micro-batch that fit the budget per rank and move the fewest bytes. The formulas of sections 1 and 4 (and
#    the buffers in flight printed in 4a) are all you need; try 64 MiB by hand first.
# 7. `pp_zero_traffic(stage, root, layers, m, reshard)` — section 7's formulas: what one pipeline rank's ZeRO
#    collectives cover per step.
# 8. `hsdp_groups(dp, dp_shard, cp)` — section 8's groups: the shard groups and the replicate groups of a dp × cp
#    grid, as lists of ranks.
# 9. `owner_of(sizes, n)` — section 9's owners: give each matrix (its size in elements) to one of $n$ ranks so that
#    the largest load, the Newton–Schulz work of the slowest rank, is as small as the largest-first rule makes it.
#
# The checker runs exercise 1 on many sizes, 2 to 5 on 2 and then 3 real processes (3 brings padding), comparing every
# rank with an answer computed another way: in one process (1–3), or by the plain `Zero3` with all-gathers counted by
# a `metrics.Recorder` (4–5: the same losses exactly; bf16 within the bound it prints).
#
# It checks 6's plans against the formulas, then trains each for one step on 2 ranks and compares the measured memory
# with your budget; 7, 8 and 9 run on many cases in one process (8 against `picotron.mesh.shard_groups`, 9 against
# `planner.owner_of`'s largest load). Each failure names the mistake (a sum instead of a mean, a chunk at the wrong
# offset, the last layer gathered twice, an fp32 all-gather, a plan over budget or moving bytes it need not, ...).
# Until you write them it reports `NotImplementedError: not written yet`.
#
# **Takeaway:** what FSDP2 adds over plain ZeRO-3 is a few lines each; checking bytes and numbers on real ranks is
# what makes them right.

# %%
import check as checker   # this folder's check.py
all_passed = checker.check()

# %% [markdown]
# ## 12. What it costs, when to use it, what comes next
#
# | | per rank | cost |
# |---|---|---|
# | ZeRO-1 | optimizer state $/n$ | nothing: the same $2\Psi$ as DP, the optimizer's work $/n$ |
# | ZeRO-2 | + gradients $/n$ (plus two buckets in flight) | nothing more in bytes, but with gradient accumulation a reduce-scatter per micro-batch, not once per step like DP and ZeRO-1 (under a pipeline ZeRO-2 too, section 7) |
# | ZeRO-3 | + parameters $/n$ (plus a few whole units in flight) | $\approx 3\Psi$ per micro-batch: 1.5× DP's traffic, in latency-bound per-layer collectives that must be prefetched to hide |
# | HSDP | any stage's states $/n_s$ instead of $/n$ | the stage's traffic within the shard group (a node), plus $\frac{2(n_r-1)}{n_r}\Psi/n_s$ across the replicas |
# | Muon on ZeRO | less (one momentum instead of two moments) | gather: $\approx\frac{n-1}{n}\Psi$ more per step, all of Newton–Schulz everywhere; owner: $\approx 2\Psi_{muon}/n$, $1/n$ of it |
#
# **Use it** when data parallelism runs out of memory for model states: ZeRO-1 is free and almost always on; ZeRO-2
# is free without gradient accumulation; ZeRO-3 (FSDP) trains a model larger than one GPU with data parallelism
# alone, if each layer's all-gather hides behind a layer's compute (enough tokens per GPU, fast links).
#
# **Its limits:** activations are untouched; every forward becomes collective; across slow links the $3\Psi$ per
# step can dominate.
#
# **What ours lacks** (FSDP2 and DeepSpeed have it): bf16 all-gathers and a last layer kept gathered (exercises 5
# and 4), re-sharding a checkpoint to another number of ranks, offloading to CPU memory, units other than `layers`.
#
# **Takeaway:** shard the optimizer state always, the gradients when it is free, the parameters when the model
# must fit — then make sure the extra all-gathers hide.
#
# **Next — lesson 05, tensor parallelism:** ZeRO-3 still computes every layer whole on every rank. Tensor
# parallelism cuts the layers' matrices across ranks and computes with the shards instead of gathering them.
