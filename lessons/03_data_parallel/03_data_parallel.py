"""Lesson 03's notebook, 03_data_parallel.ipynb, as plain Python in the percent format (see lessons/_notebook.py):
edit this file, never the notebook.

    python lessons/_notebook.py 03_data_parallel --run fast    # rebuild the notebook, execute it in FAST mode
"""

# %% [markdown]
# # Lesson 03 — Data parallelism: many replicas, one gradient
#
# Lesson 01 trained on one device; lesson 02 built the collectives. Now we use the most important one, the
# **all-reduce**, for the oldest and still most used way to train on many devices: every rank holds the whole
# model, trains on its own slice of the batch, and the ranks **average their gradients** before each optimizer step.
#
# The maths is one line; the engineering is all about **time**: the all-reduce must hide behind the backward pass.
# We build it in three steps and measure each one — a naive hook per parameter, the same hook made asynchronous,
# and gradient **buckets** — then add gradient accumulation without needless traffic (`no_sync`), race torch's own
# `DistributedDataParallel`, scale from 1 to 4 ranks, and look at what data parallelism does *not* do: save memory.
#
# The code is `picotron/data_parallel.py`; the experiments are `lessons/03_data_parallel/experiment.py`, launched with
# `torchrun` on 2 (and 4) processes. `PICOTRON_FAST=1` gives a two-minute run; the default settings are the real lesson.

# %%
import sys
import matplotlib.pyplot as plt
sys.path.insert(0, "..")   # lessons/: the helpers every lesson shares
import _common
from picotron import data_parallel, schedule
from picotron.model import ModelConfig

FAST, OUT = _common.FAST, _common.run_dir("03_data_parallel")
import experiment as lesson   # this folder's experiment.py: its model of the timeline and its plots
MiB = 2**20

def run(only, nproc=2):
    # torchrun --nproc_per_node nproc lessons/03_data_parallel/experiment.py --out OUT --only <only>; show what it printed
    out = _common.launch("03_data_parallel/experiment.py", ["--out", OUT, "--only", only], nproc=nproc, quiet=True)
    print("\n".join(line for line in out.splitlines() if not line.startswith(("step ", "picotron |"))))

mc = ModelConfig.from_preset("tiny", **lesson.SIZES["small"])
print(f"FAST={FAST}, results in {OUT.relative_to(_common.ROOT)}; model 'small': {mc.num_params() / 1e6:.2f} M parameters, "
      f"{4 * mc.num_params() / MiB:.1f} MiB of fp32 gradients")

# %% [markdown]
# ## 1. The problem: one device is too slow
#
# First the number. One process trains our `small` model (the tiny preset widened to h=256, 4 layers: 3.3 M
# parameters) with `picotron.train` on all of this machine's cores. (This launch also runs the single-process
# references we compare the data-parallel runs with in section 5.)

# %%
run("scaling", nproc=1)
one = _common.load_json(OUT / "scaling_dp1.json")["results"]
tps1 = one["tokens_per_s"]   # from the median step time
tokens = 20 * mc.num_params()   # Chinchilla: ~20 tokens per parameter
print(f"\none process ({one['threads']} threads on {one['cores']} cores): {tps1:,.0f} tokens/s")
print(f"  our 3.3 M model, 20 tokens per parameter ({tokens / 1e6:.0f} M tokens): {tokens / tps1 / 3600:,.1f} hours")
big = ModelConfig.from_preset("llama3-8b")
flops = big.flops_per_token(8192) * 15e12   # Llama-3-8B was trained on ~15 T tokens
h100 = 0.40 * 989.5e12                       # one H100 at a good 40% MFU of its bf16 datasheet peak
print(f"  Llama-3-8B, 15 T tokens: {flops:.1e} FLOPs; one H100 at 40% MFU: {flops / h100 / 3600 / 24 / 365:,.0f} years")

# %% [markdown]
# Even with perfect use of one GPU, a modern pre-training run would take decades. (It also would not *fit*: lesson 01
# showed that Llama-3-8B's model states alone are 128 GB.) The way out is more devices working on the same step.
#
# ## 2. The idea and the formulas
#
# Split the global batch of $B$ sequences into $n$ slices. Rank $r$ holds a full copy of the model, runs forward
# and backward on its $B/n$ sequences and gets $g_r$, the gradient of the mean loss over its slice. The gradient of
# the mean loss over the whole batch is the mean of the slices' gradients:
#
# $$\nabla L_{\text{batch}} = \frac1n\sum_{r=0}^{n-1} g_r .$$
#
# So after backward each rank calls **all-reduce** (sum, then divide by $n$), every rank holds the same gradient,
# takes the same AdamW step, and the replicas stay identical, bit for bit. Nothing else is ever exchanged.
#
# ```
# rank 0:  forward/backward on rows 0 .. B/n-1      -> g0 ─┐
# rank 1:  forward/backward on rows B/n .. 2B/n-1   -> g1 ─┼─ all-reduce, ÷n ─> (g0+g1+…)/n on every rank -> AdamW step
#   …                                                     …─┘
# ```
#
# **Communication per step.** A ring all-reduce is a reduce-scatter followed by an all-gather (lesson 02); each rank
# sends and receives $2\frac{n-1}{n}\,\Psi\cdot\text{bytes}$ for $\Psi$ gradient elements — almost independent of $n$.
# For our model in fp32 and for two real ones in bf16:

# %%
for name, psi, nbytes in [("small (this lesson)", mc.num_params(), 4),
                          ("smollm-1.7b", ModelConfig.from_preset("smollm-1.7b").num_params(), 2),
                          ("llama3-8b", big.num_params(), 2)]:
    per_rank = {n: 2 * (n - 1) / n * psi * nbytes for n in (2, 8, 64)}
    print(f"{name:<20} Ψ = {psi / 1e6:8.1f} M, {nbytes} bytes/grad: sent per rank per step " +
          "  ".join(f"n={n}: {v / 2**30:7.3f} GiB" for n, v in per_rank.items()))

# %% [markdown]
# What does one all-reduce cost *here*? The experiment times `dist.all_reduce` from 1 KiB to 16 MiB on 2 processes
# (gloo over the loopback interface) and fits the latency–bandwidth model $T = \alpha + \beta\cdot\text{bytes}$:

# %%
run("allreduce")
allreduce_json = _common.load_json(OUT / "allreduce.json")
allreduce = allreduce_json["results"]
N = 2
lesson.plot_allreduce(allreduce, N); plt.show()
grad_bytes, tensors = 4 * mc.num_params(), allreduce_json["grad_tensor_bytes"]
t_all = allreduce["latency_s"] + allreduce["s_per_byte"] * grad_bytes
print(f"latency α ≈ {1e6 * allreduce['latency_s']:.0f} µs, bus bandwidth ≈ {allreduce['busbw'] / 1e9:.2f} GB/s → all-reduce of "
      f"all {grad_bytes / MiB:.1f} MiB of gradients ≈ {1e3 * t_all:.1f} ms; of each of the {len(tensors)} tensors "
      f"one by one ≈ {1e3 * (len(tensors) * allreduce['latency_s'] + allreduce['s_per_byte'] * grad_bytes):.1f} ms")

# %% [markdown]
# Two regimes: small messages cost the latency $\alpha$ whatever their size, large ones cost bytes/bandwidth.
# That already tells us not to send 39 tensors one by one.
#
# **Hiding it behind backward.** Backward produces gradients from the last layer to the first. The gradients of
# the last layers are final long before backward ends, so their all-reduce can run *while* backward computes the
# earlier layers. Group the gradients, in that order, into **buckets**; when a bucket is complete, start its
# all-reduce asynchronously. With buckets $1..K$, bucket $k$ ready at time $t_k$ and taking $c_k$ to all-reduce on
# one communication channel,
#
# $$\text{start}_k = \max(t_k,\ \text{end}_{k-1}),\qquad \text{end}_k = \text{start}_k + \alpha + 2\tfrac{n-1}{n}\,\frac{\text{bytes}_k}{\text{bandwidth}},
# \qquad \text{exposed} = \max(0,\ \text{end}_K - t_{\text{backward end}}).$$
#
# Everything is hidden when each bucket's communication is shorter than the backward time until the next bucket is
# ready ($c_k \le t_{k+1} - t_k$) — except the **last** bucket, which is ready only when backward ends: its
# all-reduce is always exposed. Tiny buckets pay $\alpha$ many times; one huge bucket cannot start before backward
# ends. The best size is in between, and section 6 lets you move it.
#
# **The rule of thumb.** Backward costs about $4N$ FLOPs per token (of the $6N$ per training token), the all-reduce
# moves $\approx 2\Psi$ gradient values per rank whatever the batch. With $T$ tokens per rank, achieved FLOP/s $F$,
# link bandwidth $W$ bytes/s and bf16 gradients (2 bytes), backward hides the all-reduce when
#
# $$T\cdot\frac{4N}{F} \ \ge\ \frac{2\cdot 2N}{W} \iff T \ \ge\ \frac{F}{W}.$$
#
# For an H100, $F \approx 989.5$ TFLOP/s (bf16 datasheet) over NVLink's $W \approx 450$ GB/s per direction gives
# $T \gtrsim 2{,}200$ tokens per GPU; the scaling-book estimate is about 2,200–2,500 tokens per H100
# ([reference](../../docs/reference.md#data-parallelism-hiding-the-all-reduce)). Treat it as a
# rule of thumb, not a law: at a realistic 40–50% MFU the threshold halves, across nodes (≈50 GB/s of InfiniBand per
# GPU) it grows ~10×, and it assumes the communication runs on hardware of its own. We check it on this machine in
# section 4 — where that last assumption fails.

# %%
for where, F, W in [("H100, NVLink, datasheet peak", 989.5e12, 450e9), ("H100, NVLink, 40% MFU", 0.4 * 989.5e12, 450e9),
                    ("H100, across nodes (400 Gb/s IB per GPU), 40% MFU", 0.4 * 989.5e12, 50e9)]:
    print(f"{where:<52} tokens per GPU to hide the all-reduce: T ≥ F/W = {F / W:8,.0f}")

# %% [markdown]
# ## 3. Read the code
#
# `picotron/data_parallel.py`. Both wrappers share a base that holds the axis they average over (`mesh.dp_cp`, dp × cp:
# context-parallel ranks see other tokens of the same sequences, so their gradients are averaged too; the axis runs
# the collectives), broadcasts rank 0's weights once, and owns `no_sync`. The naive wrapper is one hook:

# %%
_common.show_source(data_parallel.NaiveDataParallel)

# %% [markdown]
# `register_post_accumulate_grad_hook` fires once autograd has *added* this backward's contribution into `p.grad`
# (after all uses of a shared weight, e.g. tied embeddings). The all-reduce sums, so we divide first. It is
# **blocking**: backward stops at each of the 39 tensors until the message is through.
#
# The bucketed version keeps the gradients in contiguous buffers. `p.grad` *is* a slice of its bucket's buffer, so
# autograd accumulates straight into the memory we send — no copy (DDP calls this `gradient_as_bucket_view`):

# %%
_common.show_source(data_parallel._Bucket)
print("\n    # DataParallel.__init__:")
_common.show_source(data_parallel.DataParallel.__init__, "self.buckets, self.bucket_of", "register_post_accumulate_grad_hook")

# %% [markdown]
# The hook counts the gradients of each bucket; the last one to arrive launches **one asynchronous** all-reduce of
# the whole buffer (`async_op=True` returns at once with a handle) and backward goes on. With `bucket_mb=0` every
# tensor is its own bucket: the "overlap" variant. Before the optimizer step we wait for the handles:

# %%
_common.show_source(data_parallel.DataParallel._hook)
print()
_common.show_source(data_parallel.DataParallel.finish_sync)

# %% [markdown]
# **Gradient accumulation** (lesson 01) runs $k$ micro-batches before one optimizer step. All-reducing after each
# would send $k$ times the bytes for the same result, since the sum of averages is the average of sums. `no_sync`
# switches the hook's sending off. The step engine (`schedule.OneStage.run`, what `picotron/train.py` calls for each
# optimizer step) wraps all micro-batches but the last in it, and waits for the gradient sync with `finish_sync()`
# at the end. It asks nothing else of the model: every wrapper here, ZeRO's, and `Local` (one replica, nothing to
# send) speak that protocol, `GradSync`.

# %%
_common.show_source(data_parallel._Replicated.no_sync)
print("\n    # picotron/schedule.py, the micro-batches of one optimizer step:")
_common.show_source(schedule.OneStage.run)

# %% [markdown]
# ## 4. Run it
#
# Every timed comparison below runs all its variants **in one launch**, each on its own copy of the model
# (identical weights), one step of each in turn with a barrier before every step and the order rotating. So slow
# drift of this shared machine hits every variant alike. A step's time is the slowest rank's; we report medians and
# quartiles. Two ranks on two cores, one thread each.
#
# ### (a) Naive → overlap → buckets: where does the time go?
# Seven variants: **compute only** (each rank trains alone, nothing is sent — the floor), **naive**, and the
# bucketed `DataParallel` with buckets of 0 (one per tensor, "overlap"), 0.25, 1, 4 and 25 MiB. Each rank records a
# timeline: forward, backward and the wait after backward (`finish_sync`) from the step engine, each all-reduce from
# launch to completion from a `metrics.Recorder` on the wrapper's axis (a callback on the all-reduce's future), and
# the optimizer. Each variant is the trainer's own pieces, built the way `parallelize` builds them, and one step is
# the step engine, then AdamW:

# %%
_common.show_source(lesson.Variant.__init__, "self.raw =", "self.schedule =")
_common.show_source(lesson.Variant.step, "self.forward_backward", "self.model.zero_grad")

# %%
run("timeline")
tl = _common.load_json(OUT / "timeline.json")
rows, st = tl["results"]["rows"], tl["results"]["settings"]
by = {r["name"]: r for r in rows}
base = by["compute only"]
tokens_per_rank = st["micro_batch_size"] * st["seq_len"]
print(f"\n{tokens_per_rank} tokens per rank per step, {st['steps']} timed steps per variant\n")
print(f"{'variant':<15}{'step ms':>9}{'tokens/s':>10}{'backward':>10}{'wait after':>12}{'exposed':>10}{'all-reduces':>13}{'comm busy':>11}")
print(f"{'':<15}{'':>9}{'':>10}{'ms':>10}{'backward ms':>12}{'ms':>10}{'per step':>13}{'ms':>11}")
for r in rows:
    p = r["phases"]
    print(f"{r['name']:<15}{1e3 * r['median']:9.1f}{r['tokens_per_s']:10,.0f}{1e3 * p['backward']:10.1f}{1e3 * p['wait']:12.1f}"
          f"{1e3 * (r['median'] - base['median']):10.1f}{p['n_allreduce']:13.0f}{1e3 * p['comm']:11.1f}")

# %% [markdown]
# What to expect (the table is this run's; the full settings time 40 steps per variant, FAST mode only a few on a
# machine that may be busy, so read its numbers as rough): the naive variant exposes the most, and none of it as a
# wait after backward, because each blocking all-reduce stalls backward itself; the per-tensor overlap exposes less
# but pays one latency per tensor; buckets expose less the larger they are, down to the single 25 MiB bucket, which
# cannot start before backward ends, so all of its transfer is a wait after backward. Even the best variant's exposed
# time stays a sizeable part of the compute-only step on this machine (a fifth to a quarter in our runs), never zero
# (why: below).
#
# Two measures of what the communication costs: **wait after backward** is the time from the end of backward to
# the end of `finish_sync` (the communication that was not hidden at all); **exposed** is the step time
# minus the compute-only step (everything communication costs, including a slower backward). The Gantt chart shows
# one step of four variants on both ranks (compute row: forward, backward, wait, optimizer; communication row: each
# all-reduce from launch to completion, one colour per bucket):

# %%
lesson.plot_timelines([by[k] for k in ("naive", "overlap", "bucket 1 MiB", "bucket 25 MiB")], step=-1,
                      title=f"one step (the last timed one), {N} ranks"); plt.show()
lesson.plot_phases(rows, base["median"]); plt.show()

# %% [markdown]
# How to read it:
#
# * **naive**: the all-reduces sit *inside* backward (the communication row is busy while the compute row is stalled
#   in backward); nothing is waited for afterwards, but backward is stretched by the sum of 39 blocking messages.
# * **overlap** (a bucket per tensor): backward no longer stops, but 39 messages queue on one channel, each paying the
#   latency; the queue is still draining when backward ends, so a long wait remains.
# * **bucket 1 MiB**: a handful of messages; most of the traffic happens during backward.
# * **bucket 25 MiB**: all 12.5 MiB in one bucket: it can only start when backward is over, so its whole all-reduce is
#   exposed — one latency and no interference with backward (which suits this CPU, see below), but on a large model
#   it would add the full all-reduce time to every step.
#
# One thing the GPU picture does not have: **on a CPU the communication is not free for the computation.** gloo adds
# and copies the buffers with the same cores that run backward (and the loopback "network" is the kernel copying
# memory), so an overlapped all-reduce slows backward down — compare each variant's backward column with the
# compute-only one. On GPUs the all-reduce runs on NVLink/InfiniBand with a few SMs to spare, and overlap is much
# closer to free. This is why our "exposed" column never reaches zero, whatever the bucket size.
#
# **The rule of thumb, checked here.** The measured backward time per token and the all-reduce fit give this
# machine's threshold, the same way $F/W$ did for the H100:

# %%
bwd_per_token = base["phases"]["backward"] / tokens_per_rank
threshold = t_all / bwd_per_token
print(f"backward: {1e6 * bwd_per_token:.1f} µs per token per rank; all-reduce of all gradients: {1e3 * t_all:.1f} ms")
print(f"→ backward covers the all-reduce from T ≈ {threshold:,.0f} tokens per rank (we run {tokens_per_rank}) — "
      f"if communication cost no compute; the wait and exposed columns above show how far that 'if' is from a CPU")

# %% [markdown]
# ### (b) Throughput against bucket size
# The same run, as tokens/s against the bucket size, with the overlap model of section 2 (the measured all-reduce fit
# and the measured compute-only backward) drawn over it:

# %%
lesson.plot_buckets(rows, tl["grad_tensor_bytes"], allreduce, N, N * tokens_per_rank); plt.show()
for r in rows[2:]:
    pred = lesson.predicted_step(base, tl["grad_tensor_bytes"], allreduce, r["bucket_mb"], N)
    print(f"{r['name']:<15} {r['n_buckets']:>2} buckets: measured {1e3 * r['median']:6.1f} ms/step, overlap model {1e3 * pred:6.1f} ms")

# %% [markdown]
# The model and the measurement agree on the left: one message per tensor pays the latency 39 times. They part on
# the right. The model assumes communication runs *beside* the computation for free, so it prefers a few buckets that
# overlap backward. On this CPU every overlapped byte is added and copied by the cores that run backward, so
# overlapping slows backward down, and one big bucket that overlaps nothing ties with or beats the middle sizes. On
# GPUs, where the all-reduce has its own links and engines, the middle sizes win; DDP's default is 25 MiB, for models
# of billions of parameters (hundreds of buckets).
#
# ### (c) Against torch's DistributedDataParallel
# Same model, same bucket size, same batches, DDP with `gradient_as_bucket_view=True` like ours; one step of ours,
# one of DDP, alternately. The ratio of each round (DDP's step time ÷ ours, i.e. ours' throughput ÷ DDP's) is kept,
# so the spread shows how much to trust the median. Timelines are off for both (DDP records none).

# %%
run("ddp")
ddp = _common.load_json(OUT / "ddp.json")
for mb, r in ddp["results"]["ratios"].items():
    print(f"bucket {mb:>2} MiB: ours/DDP throughput = {r['median']:.3f} (median of {r['n']} paired rounds, quartiles "
          f"{r['q1']:.3f}–{r['q3']:.3f}; ratio of the medians {r['of_medians']:.3f})"
          + ("  [FAST mode: few rounds, noisy; the full run uses 100]" if FAST else ""))
lesson.plot_ddp(ddp["results"]); plt.show()

# %% [markdown]
# DDP is the same design — buckets in reverse order, one asynchronous all-reduce per full bucket, gradients as
# bucket views — written in C++ (its "Reducer"). Measured with enough rounds on a quiet machine
# (`benchmarks/dp_vs_ddp.py`, 300 alternating rounds per bucket size, 2 ranks, this model and batch): **ours/DDP =
# 0.968 at 1 MiB** (quartiles of the per-round ratio 0.92–1.03) **and 0.979 at 25 MiB** (0.92–1.03); the lesson
# script's own 100-round run gave 0.966 and 0.974. The remaining 2–3% (about 1.5 ms of a 78 ms step) is the price of
# Python and of simplicity: our hook is a Python call per tensor, autograd adds each gradient into a bucket we zeroed
# (DDP lets autograd write a fresh gradient and copies it in, divided, in one pass), and we zero the buckets every
# step. Dividing after the all-reduce instead of before made no measurable difference (0.966 and 0.974).
#
# ### (d) Gradient accumulation: `no_sync`
# Four micro-batches per step (1 MiB buckets): all-reduce only after the last one, or after every one. Syncing every
# micro-batch has a trap: the next micro-batch's backward adds its gradients into the very buffers that are still
# being all-reduced, so it must **wait** for them first (here the step engine runs once per micro-batch, each loss
# divided by $k$, and each run ends in `finish_sync`; DDP always waits at the end of backward). The first version of this experiment forgot, and its gradients were off by 10%.
# Before timing, one step of each from the same weights on the same batches: the gradients must agree.

# %%
run("accumulate")
acc = _common.load_json(OUT / "accumulate.json")["results"]
for r in acc["rows"]:
    print(f"{r['name']:<24} {r['bytes_sent_per_rank'] / MiB:6.1f} MiB sent per rank per step, {r['phases']['n_allreduce']:3.0f} all-reduces, "
          f"{1e3 * r['median']:6.1f} ms/step")
print(f"max |grad(no_sync) − grad(sync every micro-batch)| = {acc['max_grad_diff']:.1e} (largest gradient {acc['max_grad']:.1e})")
lesson.plot_accumulate(acc, N); plt.show()

# %% [markdown]
# Same gradients (up to the order of float additions), a quarter of the bytes. In the time panel `no_sync` sits
# above compute alone by about what one step's gradient sync exposes (lines above), syncing every micro-batch by about
# four times that. On a busy machine the step-to-step noise can be as large as `no_sync`'s cost, and its bar can even
# come out *below* compute alone: that is noise, not a gain; rerun on a quiet machine. With $k$ micro-batches, `no_sync`
# makes the communication per *optimizer step* independent of $k$, so gradient accumulation also raises the
# tokens per rank per all-reduce — the $T$ of the rule of thumb.
#
# ### (e) Scaling from 1 to 2 to 4 ranks
# `picotron.train` with `--dp 1, 2, 4`, the same micro-batch per rank (so the global batch grows with dp: weak
# scaling). `_common.launch` gives each rank `OMP_NUM_THREADS = cores // nproc` threads: on this 2-core machine
# dp=1 runs 2 threads, dp=2 one thread per rank, and **dp=4 puts 4 single-threaded ranks on 2 cores: oversubscribed**,
# each rank gets half a core. So here the ideal is *flat* (the same two cores, however split); on a GPU node, where
# every rank brings its own device, the ideal is dp × the single-device throughput.

# %%
for n in (2, 4):
    run("scaling", nproc=n)
runs = {n: _common.load_json(OUT / f"scaling_dp{n}.json") for n in (1, 2, 4)}
for n, r in runs.items():
    s = r["results"]
    print(f"dp={n}: {s['tokens_per_s']:8,.0f} tokens/s (median step), {s['threads']} thread(s) per rank | vs dp=1: ×{s['tokens_per_s'] / tps1:.2f} "
          f"(same cores: ideal ×1) | per-device efficiency if each rank had its own device: {s['tokens_per_s'] / (n * tps1):.0%}")
lesson.plot_scaling(runs); plt.show()

# %% [markdown]
# On two cores dp=2 does about what dp=1 does: the same arithmetic, split between two processes instead of two
# threads, plus the all-reduce. dp=4 oversubscribes the cores (four processes time-sharing two cores, and gloo's
# threads on top) and pays for it. What this measures is the *overhead* of data parallelism on fixed hardware; the
# speed-up comes when every rank has its own GPU (run the same command on a pod: `torchrun --nproc_per_node 8 -m
# picotron.train --dp 8`).
#
# ### (f) Memory per rank: unchanged
# Each rank's parameters, gradients, AdamW state and activations, as the trainer measured them (the wrapper's `memory()`,
# `metrics.optimizer_bytes`, the step engine's `ActivationCounter`) — every rank of every run — and, hatched, what ZeRO would keep per rank at dp=4
# ([the formulas](../../docs/reference.md#zero-memory-and-communication-per-rank): ZeRO-1 shards the optimizer state,
# ZeRO-2 also the gradients, ZeRO-3 also the parameters):

# %%
for n, r in runs.items():
    for rank, m in enumerate(r["results"]["mem_by_rank"]):
        print(f"dp={n} rank {rank}: " + "  ".join(f"{k} {m[k] / MiB:6.2f} MiB" for k in lesson.PARTS))
lesson.plot_memory(runs); plt.show()

# %% [markdown]
# Data parallelism buys speed, not memory: every rank keeps all $16\Psi$ bytes of model states (fp32 params 4 +
# grads 4 + Adam 8), and the activations of its own micro-batch. With $n$ ranks, $n$ identical copies of the
# optimizer state exist — pure redundancy. **ZeRO (lesson 04) removes it**: each rank keeps $1/n$ of the optimizer
# state (and of the gradients, and of the parameters), for about the same communication.
#
# ## 5. Check it: the same training as one process
#
# The [parity standard](../../docs/reference.md#parity-standard) of the course: dp ranks with micro-batch $b$ see exactly
# the rows one process sees with micro-batch $b$ and `grad_acc` = dp (the loader lays a step's rows out rank-major),
# so with fp32 and the same seed the per-step losses must agree within $10^{-5}$ relative **for the first 10 steps**
# — only the order of the float additions differs. (The test suite, `tests/test_data_parallel.py`, also checks the
# gradients of a step within $10^{-5}$.)
#
# Why only the first 10? The full settings train for 30 steps, and there the curves slowly part: the relative
# difference starts at $10^{-7}$ (or exactly 0) and grows step after step, in some runs past $10^{-5}$ around step 20
# and to $10^{-4}$ by step 30. Nothing is wrong. With four ranks the all-reduce adds the four partial gradients in a
# different order than one process accumulating four micro-batches, so the gradients differ in their last bits; AdamW
# divides each element's update by $\sqrt{\hat v}$, its own running gradient scale, so on elements whose gradient is
# near zero a last-bit difference becomes a visible difference of the step; and every step's weights feed the next
# step's forward pass, so the gap compounds. (dp=2 stays equal bit for bit here: each element's average is one
# addition of two halves, and $a + b = b + a$ exactly.) How far it gets varies from run to run: on this machine one full
# run stayed below $4\cdot10^{-6}$ for all 30 steps, another crossed $10^{-5}$ at step 19 and reached $10^{-4}$ by step 30.
#
# So the check compares the window of the standard, and the steps after it are reported as **drift** against a bound
# of $10^{-3}$, stated in the check line: a hundred times the standard, ten times the worst drift seen in 30 steps, and
# below what a real bug does. With these settings, dropping the gradient of one of the four micro-batches (a rank whose
# contribution never arrives) or counting one twice moves the loss by up to $4\cdot10^{-3}$ within the first 10 steps,
# by $3\cdot10^{-3}$ or more on every step from 11 on and by $1$–$3\cdot10^{-2}$ from step 15: the window catches it at
# step 2, the drift bound on every later step.

# %%
pairs = {f"dp={n} vs 1 process, grad_acc={n}": (runs[n]["results"]["loss"], one["references"][str(n)]) for n in (2, 4)}
for label, (dp, ref) in pairs.items():
    p = _common.parity(dp, ref)
    print(f"{label}: max relative loss difference over steps 1-{p['window']} {p['worst']:.1e}"
          + (f", over steps {p['window'] + 1}-{p['n_steps']} {p['beyond']:.1e}" if p["n_beyond"] else "")
          + (f"; first above 1e-5 at step {p['first_over']}" if p["first_over"] else "; never above 1e-5"))
lesson.plot_parity(pairs); plt.show()

# %% [markdown]
# Every claim of this lesson that is not a timing, as a number (timings on a shared CPU are measurements, not
# pass/fail criteria; they are above):

# %%
def check(name, ok, detail):
    print(f"{'✓' if ok else '✗'} {name}: {detail}")

for label, (dp, ref) in pairs.items():
    for line in _common.parity_checks(label, dp, ref, where="section 5"):
        check(*line)
n_tensors = len(tl["grad_tensor_bytes"])
check("naive and overlap: one all-reduce per tensor", by["naive"]["phases"]["n_allreduce"] == by["overlap"]["phases"]["n_allreduce"] == n_tensors,
      f"{by['naive']['phases']['n_allreduce']:.0f} and {by['overlap']['phases']['n_allreduce']:.0f} for {n_tensors} tensors")
check("25 MiB: one bucket holds every gradient", by["bucket 25 MiB"]["n_buckets"] == 1 and abs(by["bucket 25 MiB"]["phases"]["mib_sent"] - grad_bytes / MiB) < 1e-6,
      f"{by['bucket 25 MiB']['n_buckets']} bucket, {by['bucket 25 MiB']['phases']['mib_sent']:.2f} MiB per step")
check("the same bytes whatever the bucket size", len({round(r['phases']['mib_sent'], 6) for r in rows[1:]}) == 1,
      f"{rows[1]['phases']['mib_sent']:.2f} MiB of gradients per rank per step in every variant")
ns, se = acc["rows"][1], acc["rows"][2]
check(f"no_sync sends 1/{acc['k']} of the bytes", abs(se["bytes_sent_per_rank"] / ns["bytes_sent_per_rank"] - acc["k"]) < 1e-9,
      f"{ns['bytes_sent_per_rank'] / MiB:.1f} vs {se['bytes_sent_per_rank'] / MiB:.1f} MiB per rank per step")
check("no_sync gives the same gradients", acc["max_grad_diff"] <= 1e-6 * max(1.0, acc["max_grad"]), f"max |Δgrad| {acc['max_grad_diff']:.1e}")
mems = [(n, m) for n, r in runs.items() for m in r["results"]["mem_by_rank"]]
same = all(m[k] == mems[0][1][k] for _, m in mems for k in lesson.PARTS)
check("memory per rank does not depend on dp", same, f"params+grads+optimizer {sum(mems[0][1][k] for k in lesson.PARTS[:3]) / MiB:.1f} MiB on each of "
      f"{len(mems)} ranks in dp=1,2,4; activations {mems[0][1]['activations'] / MiB:.1f} MiB")

# %% [markdown]
# ## 6. Explore: a model of the timeline
#
# `lesson.model_timeline` is the formula of section 2 as code: backward spread over the gradient tensors in proportion
# to their size, buckets closing at the chosen size, one all-reduce at a time of $\alpha + 2\frac{n-1}{n}\frac{\text{bytes}}{\text{bandwidth}}$.
# It starts from this machine's measurements (our model, the measured backward, α and bandwidth). Questions to try:
# why does the exposed time never drop below the last bucket's all-reduce? At which bucket size does latency stop
# mattering? Switch to SmolLM-1.7B with bf16 gradients, an H100's backward (~6,000 tokens per GPU at 40% MFU: about
# 0.2 s) and NVLink (450 GB/s, ~20 µs): how small a bucket is still fine? Then divide the bandwidth by 10 (crossing
# nodes). (Widgets need a live kernel; a static viewer shows the default only.)

# %%
from picotron.model import Llama
import torch

def tensor_bytes(preset, nbytes):
    c = mc if preset == "small (this lesson)" else ModelConfig.from_preset(preset)
    with torch.device("meta"):
        return [nbytes * p.numel() for p in reversed(list(Llama(c).parameters()))]

def draw(model="small (this lesson)", grad_dtype="fp32", bucket_mb=1.0, backward_ms=1e3 * base["phases"]["backward"],
         bandwidth_gbs=allreduce["busbw"] / 1e9, latency_us=1e6 * allreduce["latency_s"], n=2):
    sizes = tensor_bytes(model, 4 if grad_dtype == "fp32" else 2)
    lesson.plot_model_timeline(sizes, backward_ms / 1e3, bucket_mb, latency_us / 1e6, bandwidth_gbs * 1e9, n,
                               title=f"\n{model}, {sum(sizes) / MiB:,.1f} MiB of {grad_dtype} gradients, n={n}"); plt.show()

# drawn once with the defaults (what a static viewer shows); in a live kernel, controls that redraw it
_common.interactive(draw, lambda w: dict(model=w.Dropdown(options=["small (this lesson)", "smollm-135m", "smollm-1.7b", "llama3-8b"]),
                                         grad_dtype=w.ToggleButtons(options=["fp32", "bf16"]),
                                         bucket_mb=w.SelectionSlider(options=[0, 0.0625, 0.25, 1, 4, 16, 25, 64, 256], value=1, description="bucket MiB"),
                                         backward_ms=w.FloatLogSlider(value=1e3 * base["phases"]["backward"], base=10, min=-1, max=4, description="backward ms"),
                                         bandwidth_gbs=w.FloatLogSlider(value=allreduce["busbw"] / 1e9, base=10, min=-1, max=3, description="GB/s"),
                                         latency_us=w.FloatLogSlider(value=1e6 * allreduce["latency_s"], base=10, min=0, max=4, description="latency µs"),
                                         n=w.IntSlider(value=2, min=2, max=64, description="ranks")))

# %% [markdown]
# ## 7. Exercises
# Open `lessons/03_data_parallel/exercise.py` and write:
#
# 1. `NaiveDP.average_gradient(p)` — the hook of the naive wrapper: average `p.grad` over the ranks, in place;
# 2. `BucketedDP.on_gradient_ready(p)` and `finish_sync()` — count a bucket's gradients, launch one
#    asynchronous all-reduce when it is complete, wait for all of them before the optimizer step;
# 3. `BucketedDP.no_sync()` — the context manager that switches sending off, restoring the previous state even when
#    the block raises or blocks nest.
#
# The checker runs your classes on 2 and 3 real processes with a different batch on each rank and compares every
# rank's gradients with the mean computed in one process. It names the rank and the parameter that are wrong and what
# the error looks like ("off by a factor 2 = the world size", "still rank 1's own gradient"), the ranks that hang and
# the line where they wait, and whether your all-reduces overlap backward. Until you write them it reports
# `NotImplementedError: not written yet`.

# %%
import check as checker   # this folder's check.py
all_passed = checker.check()

# %% [markdown]
# ## 8. What it costs, when to use it, what comes next
#
# | | per rank | cost |
# |---|---|---|
# | memory | all model states ($16\Psi$ bytes in fp32 + Adam) + activations of its micro-batch | nothing saved: $n$ copies |
# | communication | one all-reduce of the gradients per optimizer step: $2\frac{n-1}{n}\Psi$·bytes sent, independent of the batch | hidden behind backward when tokens per rank ≳ $F/W$ (~2,200–2,500 per H100 over NVLink); `no_sync` makes it independent of gradient accumulation |
# | compute | none extra (the division by $n$; on CPUs the reduction itself) | — |
#
# **Use it** always, as the outermost dimension: it is the simplest parallelism, it needs no change to the model,
# and its traffic (once per step, overlapped) tolerates the slowest links, so it is what crosses nodes.
# **Its limits:** the model states and one micro-batch's activations must fit on each device; and the global batch
# grows with $n$ — beyond the critical batch size more data parallelism stops helping the optimisation, whatever
# the throughput. **Practical points:** buckets of a few to 25 MiB; keep every parameter used in every step (or a
# bucket never fills — DDP's `find_unused_parameters`); average over dp × cp, also when dp = 1.
#
# **Next — lesson 04, ZeRO:** the memory bars of section 4(f) are $n$ identical copies. ZeRO-1 gives each rank $1/n$
# of the optimizer state (replace the all-reduce by a reduce-scatter of the gradients, update your shard, all-gather
# the parameters — the same $2\Psi$ of traffic), ZeRO-2 also shards the gradients, ZeRO-3 the parameters too, for
# ≈ $3\Psi$.
