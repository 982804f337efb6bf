"""Lesson 05's notebook, 05_tensor_parallel.ipynb, as plain Python in the percent format (see lessons/_notebook.py):
edit this file, never the notebook.

    python lessons/_notebook.py 05_tensor_parallel --run fast    # rebuild the notebook, execute it in FAST mode
"""

# %% [markdown]
# # Lesson 05 — Tensor parallelism: cut the matrices, not the batch
#
# Data parallelism and ZeRO (lessons 03 and 04) give every rank different *samples* and the whole model's
# arithmetic for them: however many ranks, each one still runs every layer whole, holds the activations of its
# micro-batch whole and, under ZeRO-3, gathers every layer's weights whole before using them. **Tensor
# parallelism** (Megatron-LM, Shoeybi et al. 2019) cuts the layers themselves: each of the $t$ ranks of a
# tensor-parallel group keeps $\frac1t$ of every weight matrix, computes with it on the **same** tokens, and the
# ranks exchange partial results twice per layer forward and twice backward. **Sequence parallelism** (Korthikanti
# et al. 2022) then cuts what tensor parallelism leaves whole — the norms and the residual stream — along the
# sequence.
#
# | | each rank keeps | each rank computes | communication per layer |
# |---|---|---|---|
# | data parallel (lesson 03) | the whole model | the whole model, on its own samples | none in the layer; one all-reduce of the gradients per step |
# | tensor parallel | $\frac1t$ of every matrix | $\frac1t$ of every matmul, on all the samples | 2 all-reduces of the $b\cdot s\cdot h$ activations forward, 2 backward |
# | + sequence parallel | the same, and $\frac1t$ of the tokens between the blocks | the same, and $\frac1t$ of the norms | 2 all-gathers + 2 reduce-scatters forward and backward: the same bytes |
#
# We build it (`picotron/tensor_parallel.py`), count every collective of a layer against Megatron's pattern,
# measure what each rank keeps against the formulas with and without sp, measure throughput at tp = 1, 2 and 4,
# race our tensor parallelism against torch's DTensor one, and check that tp = 2 and 4 train exactly like one process.
#
# The experiments are `lessons/05_tensor_parallel/experiment.py`, launched with `torchrun` on 1, 2 and 4 processes.
# `PICOTRON_FAST=1` gives a short run; the default settings are the real lesson.

# %%
import sys
import matplotlib.pyplot as plt
sys.path.insert(0, "..")   # lessons/: the helpers every lesson shares
import _common
from picotron import planner, tensor_parallel
from picotron.model import ModelConfig

FAST, OUT = _common.FAST, _common.run_dir("05_tensor_parallel")
import experiment as lesson   # this folder's experiment.py: its formulas, shard shapes and plots
MiB, GB = 2**20, 1e9

def run(only, nproc=2):
    # torchrun --nproc_per_node nproc lessons/05_tensor_parallel/experiment.py --out OUT --only <only>; show what it printed
    out = _common.launch("05_tensor_parallel/experiment.py", ["--out", OUT, "--only", only], nproc=nproc, quiet=True)
    print("\n".join(line for line in out.splitlines() if not line.startswith(("step ", "picotron |", "done: "))))

mc = ModelConfig.from_preset("tiny", **lesson.SIZES["small"])
st = lesson.settings(FAST)  # this machine's settings (the experiments pick the GPU ones on a GPU)
print(f"FAST={FAST}, results in {OUT.relative_to(_common.ROOT)}; model 'small': {mc.num_params() / 1e6:.2f} M parameters, "
      f"h={mc.hidden_size}, {mc.num_attention_heads} heads, {mc.num_key_value_heads} KV heads, {mc.num_hidden_layers} layers; "
      f"batch {st['micro_batch_size']} x {st['seq_len']} tokens, the same on every tp rank")

# %% [markdown]
# ## 1. The problem: what ZeRO does not cut
#
# Model states are not the only memory. The activations autograd keeps for backward grow with the tokens of a
# micro-batch, and neither data parallelism nor ZeRO touches them: each rank keeps all of its own. Llama-3-8B with
# one sequence of 8,192 tokens per GPU, per GPU, with the textbook formulas ([mixed-precision model
# states](../../docs/reference.md#model-states), 16 bytes per parameter; [Korthikanti's bf16
# activations](../../docs/reference.md#activation-memory), $34\,sbh$ bytes per layer with flash attention, which never
# stores the $s\times s$ scores):

# %%
llama = ModelConfig.from_preset("llama3-8b")
for t in (1, 2, 4, 8):
    for sp in (False, True):
        if t == 1 and sp:
            continue
        m = lesson.memory_per_rank(llama, t, sp, seq_len=8192, micro_batch_size=1)
        states = m["params"] + m["grads"] + m["optimizer"]
        print(f"tp={t}{' + sp' if sp else '     '}: model states {states / GB:6.1f} GB + activations {m['activations'] / GB:5.1f} GB "
              f"= {m['total'] / GB:6.1f} GB per GPU")
zero3 = 16 * llama.num_params() / 8
print(f"(ZeRO-3 over 8 GPUs instead: model states {zero3 / GB:.1f} GB, activations still "
      f"{lesson.memory_per_rank(llama, 1, seq_len=8192)['activations'] / GB:.1f} GB per GPU, and every layer gathered whole)")

# %% [markdown]
# 36.5 GB of activations for one sequence is almost half an 80 GB GPU before a single weight is stored; ZeRO-3 cannot
# shrink it. Tensor parallelism divides most of it by $t$ (everything inside the attention and MLP blocks), and
# sequence parallelism, as Megatron implements it, the rest (section 4 measures what ours does).
#
# ## 2. The idea
#
# **Column, then row.** A linear layer computes $Y = XA$ (in PyTorch's layout `F.linear(x, W)`, $A = W^\top$). Cut
# $A$ by **columns**, $A = [A_1 \mid A_2]$: rank $r$ computes $Y_r = X A_r$, its own slice of the output features,
# from the whole $X$ — no communication, no approximation. An elementwise function (GeLU, or SwiGLU's
# $\mathrm{silu}(\text{gate}) \cdot \text{up}$) of a slice is the slice of the function, so each rank continues on its own.
# The next layer $Z = YB$ then has its $B$ cut by **rows**, $B = \begin{bmatrix}B_1\\B_2\end{bmatrix}$, the rows that read
# each rank's slice: $Z = Y_1B_1 + Y_2B_2$. Each rank computes one term, and **one all-reduce** sums them.
#
# ```
#           x (whole, on every rank)
#           │
#           f        forward: identity                backward: all-reduce (sum the ranks' parts of dL/dx)
#    ┌──────┴──────┐
#  gate_r, up_r       column-parallel: rank r's i/t rows of W_gate, W_up  → its i/t intermediate features
#  silu(gate_r)·up_r  elementwise: stays on rank r
#  down_r             row-parallel: the i/t columns of W_down that read them → a PARTIAL sum of the output
#    └──────┬──────┘
#           g        forward: all-reduce (sum the partial outputs)    backward: identity
#           │
#           y (whole, on every rank)
# ```
#
# Had we cut the first matrix by rows, its output would be a partial sum, and silu of a partial sum is not a partial
# sum of anything: a second all-reduce would be needed before the nonlinearity. Column-then-row needs exactly one.
#
# **Attention** is the same with heads: heads are independent, so rank $r$ takes whole heads — its rows of $W_q$,
# $W_k$, $W_v$ (column-parallel) — computes attention for them alone, and $W_o$ is row-parallel. Grouped-query
# attention shares each KV head among several query heads, so a rank needs whole KV heads too: $t$ must divide the
# KV heads (8 for Llama-3-8B, 32 for SmolLM-1.7B, 3 for SmolLM-135M; replicating KV heads would allow more).
#
# **f and g** are the two autograd functions that make this work (Megatron's conjugate pair; see the
# [reference](../../docs/reference.md#tensor-parallelism)): $f$ where the
# tensor-parallel region begins, $g$ where it ends. Per layer: one $g$ after attention and one after the MLP
# (2 all-reduces forward), one $f$ before each in backward (2 all-reduces backward), each of the $b\cdot s\cdot h$
# activation. That is traffic proportional to the **tokens**, not to the parameters, and it sits on the critical
# path: the next layer cannot start before the all-reduce ends. That is why tensor parallelism lives inside a node
# (NVLink, $t \le 8$).
#
# **The vocabulary** is cut too: rank $r$ keeps rows $[r\frac vt, (r+1)\frac vt)$ of the embedding (tokens outside them
# look up zeros; the all-reduce adds the one rank that has each row) and of the LM head, whose logits then stay cut
# over the vocabulary, $[b, s, \frac vt]$. The cross-entropy needs only three all-reduces of one number per token (the
# row maximum, the sum of exponentials, the target's logit), never the $b\cdot s\cdot v$ logits (4.2 GB in fp32 for one
# 8,192-token sequence of Llama-3's 128,256-token vocabulary).
#
# **Sequence parallelism.** Between the blocks the RMSNorms and the residual stream are still whole on every rank:
# $t$ copies of the same $b\cdot s\cdot h$ numbers, the same work $t$ times. An all-reduce is a reduce-scatter followed by an
# all-gather (lesson 02). So: leave a block with a **reduce-scatter** along the sequence (each rank keeps the sum for
# its $s/t$ tokens), run the norm and the residual add on those tokens only, and enter the next block with an
# **all-gather** (attention and the matmuls need every token). Same bytes, and everything outside the blocks divided
# by $t$. Each rank of tp = 2 holds, for our model:

# %%
print(lesson.shard_table(mc, 2))
lesson.plot_shards(mc, 2, title="tp=2, the 'small' model: one colour per rank"); plt.show()

# %% [markdown]
# ## 3. Read the code
#
# **f and g** (`picotron/tensor_parallel.py`), and sequence parallelism's pair — all-gather forward with a
# reduce-scatter backward, and the reverse:

# %%
for fn in (tensor_parallel.CopyToTP, tensor_parallel.ReduceFromTP, tensor_parallel.GatherSequence,
           tensor_parallel.ReduceScatterSequence):
    _common.show_source(fn)
    print()
_common.show_source(tensor_parallel.enter_tp)
_common.show_source(tensor_parallel.leave_tp)

# %% [markdown]
# **The layers.** A column-parallel linear keeps rows of $W$ (its slice of the output features); a row-parallel one
# keeps columns (the input features that read its slice) and leaves the region with $g$. The input enters once per
# block, not once per layer: q, k and v read the same input, and three $f$'s would all-reduce its gradient three
# times (a forward pre-hook on the attention and MLP blocks does it):

# %%
_common.show_source(tensor_parallel.ColumnParallelLinear.forward)
_common.show_source(tensor_parallel.RowParallelLinear.forward)
print()
_common.show_source(tensor_parallel.apply, "for layer in model.layers:", "model.tie_weights()")

# %% [markdown]
# `apply` swaps the modules of a model built on the meta device, so the names stay those of the unsharded model and
# `init_weights` draws each full tensor from (seed, name) and keeps this rank's slice: every layout starts from the
# same weights, which is what makes the parity check of section 5 exact.
#
# **The vocabulary-parallel embedding and loss:**

# %%
_common.show_source(tensor_parallel.VocabParallelEmbedding.forward)
print()
_common.show_source(tensor_parallel.VocabParallelCrossEntropy)

# %% [markdown]
# With sp, the norm weights are whole on every rank but each rank only sees its own tokens, so their gradients are
# partial sums: the weight goes through $f$, whose backward all-reduces that gradient ($h$ numbers per norm):

# %%
_common.show_source(tensor_parallel.SequenceParallelRMSNorm.forward)

# %% [markdown]
# ## 4. Run it
#
# Every experiment runs at tp = the number of processes (dp = 1): every rank sees the same batch. `_common.launch`
# gives each rank `OMP_NUM_THREADS = cores // nproc` threads: on this 2-core machine tp=1 runs 2 threads, tp=2 one
# thread per rank, and **tp=4 puts 4 single-threaded ranks on 2 cores: oversubscribed**, each rank gets half a core.
# So the ideal here is *flat* throughput (the same two cores, however the matmuls are split); on a GPU node, where
# every rank brings its own GPU and NVLink, the ideal is $t\times$ a single GPU's speed for the same batch.
#
# Each variant is built and stepped by picotron's own seam, as `picotron.train` does it: `parallelize(cfg, mesh)`
# gives this rank's shards, the optimizer, the step schedule and the loss (vocabulary-parallel under tp), and a step
# is the schedule's forward and backward, the clipping, the optimizer step. While a variant steps, a
# `metrics.Recorder` counts and times every collective of the mesh's axes (`parallelize(cfg, mesh, recorder=...)`
# builds the run on `mesh.recorded(recorder)`: the same groups, each collective reported), on a timeline it shares
# with the schedule's forward and backward events:

# %%
_common.show_source(lesson.Variant.__init__, "self.recorder =", "self.run.schedule.timeline")
_common.show_source(lesson.Variant.step, "recorder.reset()", "elapsed =")

# %%
run("memory,scaling", nproc=1)
run("comm,memory,scaling", nproc=2)
run("comm,memory,scaling", nproc=4)
comm = {t: _common.load_json(OUT / f"comm_tp{t}.json")["results"] for t in (2, 4)}
st = _common.load_json(OUT / "memory_tp1.json")["results"]["settings"]  # what the experiments ran with
memory = {t: _common.load_json(OUT / f"memory_tp{t}.json")["results"] for t in (1, 2, 4)}
scaling = {t: _common.load_json(OUT / f"scaling_tp{t}.json")["results"] for t in (1, 2, 4)}

# %% [markdown]
# ### (a) The collectives of a layer, counted
# One training step of the model with 2 and with 4 layers; every all-reduce, all-gather and reduce-scatter is counted
# with its buffer size, in the phase it started in (`lesson.by_phase`: forward with the loss, backward, or the step
# after them). Per layer is the difference divided by 2, against Megatron's pattern (`lesson.megatron_pattern`): bars
# are what was counted, black outlines what the pattern predicts, in units of one $b\cdot s\cdot h$ activation (here
# $4 \times 128 \times 256$ fp32 numbers = 512 KiB):

# %%
def size(nb):
    return f"{nb / 1024:,.0f} KiB" if nb >= 1024 else f"{nb} B"

def fmt(counts):
    return ", ".join(f"{c:g} x {lesson.OPS[op]} of {size(nb)}" for (op, nb), c in sorted(counts.items())) or "nothing"

for t, res in comm.items():
    for row in res["rows"]:
        got, exp, out = (lesson.parse_counts(row[k]) for k in ("per_layer", "expected", "outside"))
        print(f"{row['name']:<9} per layer  forward: {fmt(got['forward'])}\n{'':<20}backward: {fmt(got['backward'])}"
              f"\n{'':<10}Megatron's pattern: {'matched exactly' if row['matches'] else 'NOT matched'}")
        print(f"{'':<10}outside the layers, forward: {fmt(out['forward'])}; backward: {fmt(out['backward'])}; "
              f"optimizer step: {fmt(out['step'])}")
lesson.plot_comm(comm); plt.show()

# %% [markdown]
# Every layer makes exactly Megatron's collectives: without sp 2 all-reduces of the 512 KiB activation forward and 2
# backward; with sp each becomes an all-gather entering a block and a reduce-scatter leaving it, forward and
# backward — four times as many calls, the same bytes (a ring all-reduce *is* a reduce-scatter plus an all-gather).
# Ours adds two small all-reduces per layer with sp, of the two norm weights' gradients ($h$ = 256 numbers each:
# 1 KiB); Megatron collects those once per step instead. Outside the layers: the embedding's all-reduce (sp: a
# reduce-scatter), the LM head's $f$ (sp: an all-gather), and the loss's **three all-reduces of $b\cdot s$ numbers**
# (2 KiB each) — never the logits; the optimizer step adds one all-reduce of one number: the squared gradient norm
# of the sharded parameters, for clipping (the norm weights, whole on every rank, are counted once).
#
# Per rank a ring sends $2\frac{t-1}{t}$ of each all-reduced buffer: per layer and step
# $4 \cdot 2\frac{t-1}{t} \cdot b s h \cdot 4$ bytes here. Data parallelism sends the *gradients*, once per step, and
# overlaps them with backward; tensor parallelism sends *activations*, 4 times per layer, each blocking the next
# layer. How much of a step that is on this machine, next.
#
# ### (b) What each rank keeps
# One step of every variant; the bytes autograd keeps for backward — the step schedule counts them for the step's
# first micro-batch (`schedule.activation_bytes`) — attributed to the part of the model that saved them by one more
# forward of the same batch under `PartCounter` (`metrics.ActivationCounter` with a forward hook per module; the two
# totals must agree), next to `lesson.activation_parts` (exact for our code: every term is listed in its docstring):

# %%
for t, res in memory.items():
    for row in res["rows"]:
        worst = max(abs(p["total"] / row["formula_total"] - 1) for p in row["parts_by_rank"])
        got = row["parts_by_rank"][0]
        print(f"{row['name']:<9} activations per rank {got['total'] / MiB:6.2f} MiB (formula {row['formula_total'] / MiB:6.2f}, "
              f"worst rank {worst:.2%}); per layer " + ", ".join(f"{p} {got['per layer'][p] / MiB:.2f}" for p in lesson.LAYER_PARTS) + " MiB")
lesson.plot_activations(memory, mc, st["seq_len"], st["micro_batch_size"]); plt.show()
R, S = lesson.replicated_and_sharded(mc, st["seq_len"], st["micro_batch_size"])
Rsp, Ssp = lesson.replicated_and_sharded(mc, st["seq_len"], st["micro_batch_size"], sp=True)
sbh = st["seq_len"] * st["micro_batch_size"] * mc.hidden_size
print(f"our formula per layer: {R / sbh:.1f}·sbh + {S / sbh:.1f}·sbh/t bytes; with sp {Rsp / sbh:.1f}·sbh + {Ssp / sbh:.1f}·sbh/t "
      f"(Korthikanti, bf16: 10·sbh + 24·sbh/t, with sp 34·sbh/t, flash attention)")

# %% [markdown]
# Our formula has Korthikanti's shape in fp32 bytes (twice his bf16 ones; a SwiGLU MLP of width $i = 3h$ instead of a
# $4h$ GeLU one; no dropout): a part kept whole on every rank — the two norms ($x$ and $x\cdot$rsqrt: 16 bytes per
# element of $b\cdot s\cdot h$) and each block's input (4 + 4) — plus the part inside the blocks, divided by $t$: q, k,
# v, the attention output, the four MLP intermediates. Measured per layer and rank: 10.52 MiB at tp=1, 6.76 at tp=2,
# 4.88 at tp=4, equal to the formula part by part on every rank. The $24\,sbh$ bytes kept whole are 3.0 MiB here: with
# tensor parallelism alone a layer's activations never drop below that, whatever $t$ (Korthikanti's $10\,sbh$).
#
# **What sequence parallelism did here, measured.** It divides the norms by $t$, as promised. But it does not divide
# each block's input: the all-gathered $[b, s, h]$ tensor that q, k, v (and gate, up) multiply must be kept for their
# weight gradients — and our all-gather hands it over as a *transposed view* (`_all_gather_sequence` gathers along
# dim 0 and transposes back), so each of the five projections keeps its own contiguous copy (`SP_INPUT_COPIES`:
# 3 in attention, 2 in the MLP, against 1 and 1 without sp, where the three projections share the norm's output).
# Measured: at tp=2 a layer with sp keeps 7.26 MiB against 6.76 MiB without — *more*; at tp=4 both keep 4.88 MiB.
# The norms shrank by 0.5 MiB each at tp=2 (0.75 at tp=4), and the three extra copies (2 in attention, 1 in the MLP,
# 0.5 MiB each) ate it: sp only starts saving beyond tp=4 here. The fix is to make the gathered input contiguous once (or to keep activations as $[s, b, h]$
# throughout, as Megatron does, so the gather needs no transpose). Megatron goes further: it keeps only the rank's
# own $s/t$ tokens of each block's input and all-gathers them **again in backward** (one more all-gather per block,
# overlapped with the input-gradient matmul) — that is what takes Korthikanti's sequence-parallel formula to
# $34\,sbh/t$, everything divided. This is what measuring memory per part is for: the parity test passes either way.
#
# And the model states, per rank:

# %%
for t, res in memory.items():
    for row in res["rows"]:
        m, f = row["states_by_rank"][0], row["formula_states"]
        print(f"{row['name']:<9} rank 0: " + ", ".join(f"{k} {m[k] / MiB:5.2f} MiB (formula {f[k] / MiB:5.2f})" for k in lesson.PARTS)
              + f" | {row['params_per_rank']:,} parameters (shard_shapes says {lesson.params_per_rank(mc, t):,})")
lesson.plot_memory(memory); plt.show()

# %% [markdown]
# Every matrix is divided by $t$ — the embedding and LM head included — and only the norm weights ($(2L+1)h$
# numbers) stay whole, so parameters, gradients and AdamW's moments all shrink by $t$: unlike ZeRO, tensor
# parallelism needs no gathering to use them. Unlike data parallelism it does not multiply the batch either: every
# tp rank works on the same tokens.
#
# ### (c) Throughput against tp
# A few steps of sp off and sp on, alternating, at each tp: the step time (the slowest rank's), tokens per second
# (the batch is the same on every rank, so it is not multiplied by $t$) and the time spent inside collectives:

# %%
for t, res in scaling.items():
    for r in res["rows"]:
        print(f"{r['name']:<9} ({res['threads']} thread(s) per rank): {r['tokens_per_s']:7,.0f} tokens/s, step {1e3 * r['median']:6.1f} ms "
              f"(quartiles {1e3 * r['q1']:.0f}-{1e3 * r['q3']:.0f}), inside collectives {1e3 * r['comm_median']:5.1f} ms "
              f"({r['comm_median'] / r['median']:.0%})" + ("  [FAST: few steps]" if FAST else ""))
lesson.plot_scaling(scaling); plt.show()

# %% [markdown]
# What to expect (the numbers above are this run's; the same 4 × 128 tokens per step on every rank): on this 2-core
# machine tensor parallelism only costs. One process with two threads is fastest; tp=2 runs at roughly 0.6× of it,
# sequence parallelism is slower again, and tp=4 (four processes on two cores) slowest. Runs differ by 10% or more
# with the machine's load, FAST ones (few steps) more; the order stays. The right-hand plot says where the time goes.
# At tp=2 the part of the step outside collectives is about what one process with two threads needs: the same
# arithmetic, split over two processes instead of two threads. On top come 18 all-reduces of $b\cdot s\cdot h$
# (512 KiB) per step — 4 per layer, the embedding's, the LM head's — at about 2 ms each (the lines printed by the
# experiment above give this run's figure): a quarter to a third of the step.
# Unlike data parallelism's gradient all-reduce (lesson 03) none of them can hide behind computation: each one's
# result is what the next layer reads. With sp the same bytes take two calls, an all-gather and a reduce-scatter
# against one all-reduce (their times per call are printed above), with a transpose on each side: slower again. At tp=4 four
# processes share two cores, and a rank "inside a collective" is mostly waiting for peers that have no core to run
# on: there the orange bar measures the oversubscription more than the transfer.
#
# What a CPU cannot show is the setting tensor parallelism is made for: each rank with its own GPU, the all-reduces
# over NVLink. An estimate (not a measurement) of the counted pattern next to the compute of one layer, on H100s:

# %%
# An estimate, not a measurement: what the counted pattern costs next to the compute, per layer and token, on
# H100s (bf16, 50% MFU of the 989.5 TFLOP/s datasheet peak; links at their datasheet bandwidth per direction).
llama70 = ModelConfig.from_preset("llama3-8b", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                                  num_key_value_heads=8, intermediate_size=28672)   # Llama-3-70B's shape
seq, flops_per_s = 8192, 0.5 * 989.5e12
links = {"NVLink (one node), 450 GB/s": 450e9, "InfiniBand NDR (across nodes), 50 GB/s": 50e9}
for name, m in (("llama3-8b", llama), ("llama3-70b", llama70)):
    for t in (2, 4, 8):
        compute = (6 * planner.matmul_params_per_layer(m) + 12 * seq * m.hidden_size) / t / flops_per_s
        sent = 4 * 2 * (t - 1) / t * m.hidden_size * 2   # 4 all-reduces of h bf16 numbers per token, ring
        print(f"{name:<11} tp={t}: communication / compute per layer = " +
              ", ".join(f"{sent / bw / compute:4.2f} over {link}" for link, bw in links.items()))

# %% [markdown]
# Inside a node, tp=8's all-reduces cost about 30% of a layer's compute for Llama-3-8B and 17% for Llama-3-70B:
# the compute per token grows as $h^2$, the traffic as $h$, so the larger the model, the better tensor parallelism
# pays. Across nodes the same all-reduces would take longer than the compute itself. Hence the rule everybody follows:
# tensor parallelism inside a node, $t \le 8$, the other dimensions (data, pipeline) across nodes. For scale: Megatron-LM
# measured 77% of linear weak scaling at 8-way tensor parallelism within one DGX-2H node (Shoeybi et al. 2019), and
# overlapping these collectives with the matmuls ("async TP") is how newer systems win back much of the rest.

# %% [markdown]
# ### (d) Against torch's DTensor tensor parallelism
# `torch.distributed.tensor.parallel.parallelize_module` with `ColwiseParallel` / `RowwiseParallel` plans (and
# `SequenceParallel` on the norms, `loss_parallel` for the loss) is torch's own tensor parallelism: the same Megatron
# layout, the same weights and batches, one step of ours and one of DTensor's in turn, with and without sp
# (`benchmarks/tp_vs_dtensor.py`); the ratio of each round's step times is kept:

# %%
run("dtensor")
dt = _common.load_json(OUT / "dtensor_tp2.json")["results"]
dt_ref = dt["reference_losses"]   # the unsharded model on the same batches (each process, no communication)
first = min(10, len(dt_ref))      # the parity standard: at least 10 steps within 1e-5

def drift(losses, upto=None):
    return max(abs(a - b) / abs(b) for a, b in list(zip(losses, dt_ref))[:upto])

for name, res in dt["runs"].items():
    r, (ours, theirs) = res["ratio"], res["rows"]
    print(f"{name:<9} ours/DTensor throughput {r['median']:.3f} (median of {r['n']} paired rounds, quartiles {r['q1']:.3f}-{r['q3']:.3f})"
          + ("  [FAST mode: few rounds, noisy]" if FAST else ""))
    print(f"{'':<10}losses against one process, max relative difference over the first {first} steps: ours {drift(ours['losses'], first):.1e}, "
          f"DTensor {drift(theirs['losses'], first):.1e}; over all {len(dt_ref)}: ours {drift(ours['losses']):.1e}, DTensor {drift(theirs['losses']):.1e}")
    print(f"{'':<10}model states per rank, ours: " + ", ".join(f"{k} {ours['states'][k] / MiB:.2f}" for k in lesson.PARTS)
          + " MiB; DTensor: " + ", ".join(f"{k} {theirs['states'][k] / MiB:.2f}" for k in lesson.PARTS) + " MiB")
lesson.plot_dtensor(dt); plt.show()

# %% [markdown]
# This run's ratios are printed above. For scale, 5 separate runs of `benchmarks/tp_vs_dtensor.py` on this 2-core
# machine (60 paired rounds each, nothing else running) gave medians of 1.51 (runs 1.45–1.52) without sp and 1.64
# (1.58–1.74) with sp at these 4 × 128 tokens, and 1.79 and 2.00 at 2 × 64 tokens, where DTensor's cost per
# operation weighs more. Both run the same layout, the same collectives and — the losses agree to about $10^{-7}$
# (printed above) — the same arithmetic. The likely difference
# (not profiled) is overhead per operation: DTensor converts the input and output of every parallel layer to and from
# DTensors in module hooks and sends each operation on a DTensor through its sharding propagation, in Python; with
# layers this small on a CPU that is a large part of a step. We have not measured the comparison on GPUs, where
# kernels are larger and run asynchronously to Python. Both keep the same parameters and optimizer state per rank
# (DTensor's gradients take 128 KiB more per rank).
#
# The right-hand panel compares both with the unsharded model on the same batches: equal to a few $10^{-7}$ at first.
# The full settings run long enough (about 60 steps) to see what comes next: after a dozen or more steps all four
# curves rise together, to $10^{-5}$ and then $10^{-2}$. Ours and DTensor's drift away from the single process alike:
# the rounding of different summation orders, amplified by training at a constant learning rate of $3\cdot10^{-3}$
# without warm-up. (FAST mode stops after a few steps, before the drift starts.) The trainer's runs in the next section, with
# warm-up and decay, stay within $10^{-6}$.
#
# ## 5. Check it: the same training as one process
#
# `picotron.train --tp 2` and `--tp 4`, with and without `--sp`, against one process with the same batch (tp does
# not change the batch: every rank reads the same rows), fp32, same seed: per-step losses within $10^{-5}$ relative
# over the first 10 steps, the [parity standard](../../docs/reference.md#parity-standard). The full settings train 20
# steps; the steps after the window are reported as drift against a looser bound of $10^{-3}$ (lesson 03, section 5
# explains why the curves part). (The test suite, `tests/test_tensor_parallel.py`, also checks every gradient slice against the single process, and
# tp combined with data parallelism and ZeRO.)

# %%
run("parity", nproc=1)
run("parity", nproc=2)
run("parity", nproc=4)
ref = _common.load_json(OUT / "parity_tp1.json")["results"]["losses"]["reference"]
pairs = {}
for t in (2, 4):
    for name, losses in _common.load_json(OUT / f"parity_tp{t}.json")["results"]["losses"].items():
        pairs[name] = (losses, ref)
for label, (got, want) in pairs.items():
    p = _common.parity(got, want)
    print(f"{label:<10} vs 1 process: max relative loss difference over steps 1-{p['window']} {p['worst']:.1e}"
          + (f", over steps {p['window'] + 1}-{p['n_steps']} {p['beyond']:.1e}" if p["n_beyond"] else ""))
lesson.plot_parity(pairs); plt.show()

# %% [markdown]
# Every claim of this lesson that is not a timing, as a number:

# %%
def check(name, ok, detail):
    print(f"{'✓' if ok else '✗'} {name}: {detail}")

for label, (got, want) in pairs.items():
    for line in _common.parity_checks(label, got, want):
        check(*line)
for t, res in comm.items():
    for row in res["rows"]:
        got = lesson.parse_counts(row["per_layer"])
        check(f"{row['name']}: collectives per layer are Megatron's", row["matches"],
              f"forward {sum(got['forward'].values()):g} calls, backward {sum(got['backward'].values()):g} calls, as predicted")
    act = 4 * res["rows"][0]["b"] * res["rows"][0]["s"] * res["rows"][0]["h"]
    vol = [sum(nb * c * (2 if op == "all_reduce" else 1) for p in ("forward", "backward")
               for (op, nb), c in lesson.parse_counts(row["per_layer"])[p].items() if nb == act) for row in res["rows"]]
    check(f"tp={t}: sp moves the same activation bytes per layer (all-reduce = reduce-scatter + all-gather)", vol[0] == vol[1],
          f"{vol[0] / act:g} vs {vol[1] / act:g} activations' worth")
    for row in res["rows"]:
        forward = [(op, nb) for phase, op, nb, _ in row["calls"] if phase == "forward"]
        bs = 4 * row["b"] * row["s"]
        check(f"{row['name']}: the loss's collectives are 3 all-reduces of b·s numbers, after the last activation-sized one",
              forward[-3:] == [("all_reduce", bs)] * 3 and forward[-4][1] == act,
              f"the last four forward calls: {', '.join(f'{lesson.OPS[op]} of {nb:,} B' for op, nb in forward[-4:])} "
              f"(this rank's logits: {bs * mc.vocab_size // t:,} B, never communicated)")
        step = lesson.parse_counts(row["outside"])["step"]
        check(f"{row['name']}: clipping adds one all-reduce of one number", step == {("all_reduce", 4): 1}, fmt(step))
for t, res in memory.items():
    for row in res["rows"]:
        worst = max(abs(p["total"] / row["formula_total"] - 1) for p in row["parts_by_rank"])
        check(f"{row['name']}: activations per rank = lesson.activation_parts", worst <= 0.01, f"worst rank {worst:.2%} off")
        check(f"{row['name']}: the step schedule's count = the sum of PartCounter's parts, every rank",
              row["schedule_by_rank"] == [p["total"] for p in row["parts_by_rank"]],
              f"rank 0: {row['schedule_by_rank'][0]:,} B")
        worst = max(abs(m[k] / row["formula_states"][k] - 1) for m in row["states_by_rank"] for k in lesson.PARTS)
        check(f"{row['name']}: model states per rank = formula", worst <= 0.01, f"worst {worst:.2%} off")
        check(f"{row['name']}: parameters per rank = shard_shapes' count", row["params_per_rank"] == lesson.params_per_rank(mc, t),
              f"{row['params_per_rank']:,}")
for name, res in dt["runs"].items():
    ours, theirs = res["rows"]
    worst = max(drift(ours["losses"], first), drift(theirs["losses"], first))
    check(f"{name}: ours and DTensor's train like one process", worst <= 1e-5,
          f"max relative loss difference {worst:.1e} over the first {first} steps"
          + (" (FAST mode: fewer than the parity standard's 10; section 5 checks the standard)" if first < 10 else ""))
    check(f"{name}: ours and DTensor's keep the same parameters and optimizer state per rank",
          all(ours["states"][k] == theirs["states"][k] for k in ("params", "optimizer")),
          ", ".join(f"{k} {ours['states'][k]:,} vs {theirs['states'][k]:,} B" for k in ("params", "optimizer")))
per_layer = {r["name"]: sum(r["parts_by_rank"][0]["per layer"].values()) for res in memory.values() for r in res["rows"]}
check("tp=2: with sp a layer keeps MORE activations than without (the extra copies of the gathered input)",
      per_layer["tp=2 + sp"] > per_layer["tp=2"], f"{per_layer['tp=2 + sp'] / MiB:.2f} vs {per_layer['tp=2'] / MiB:.2f} MiB")
check("tp=4: with sp a layer keeps as much as without", abs(per_layer["tp=4 + sp"] / per_layer["tp=4"] - 1) < 0.005,
      f"{per_layer['tp=4 + sp'] / MiB:.2f} vs {per_layer['tp=4'] / MiB:.2f} MiB")
check("a layer's activations per rank: tp=1 > tp=2 > tp=4", per_layer["tp=1"] > per_layer["tp=2"] > per_layer["tp=4"],
      " > ".join(f"{per_layer[k] / MiB:.2f}" for k in ("tp=1", "tp=2", "tp=4")) + " MiB")
for t in (2, 4):
    one = memory[1]["rows"][0]["states_by_rank"][0]["params"]
    got = memory[t]["rows"][0]["states_by_rank"][0]["params"]
    check(f"tp={t}: parameters per rank shrink by about t", abs(one / got / t - 1) < 0.02, f"x{one / got:.2f}")

# %% [markdown]
# ## 6. Explore: who holds what, for a real model
#
# `lesson.shard_shapes` computes every rank's shard without starting a process: it builds a one-layer copy of the
# model on the **meta** device (shapes, no memory) and runs `tensor_parallel.apply` over `Axis.alone("tp", t, r)`, a tp
# axis with no process group, for each rank r.
# Pick a model and a degree: the figure cuts layer 0's matrices, the embedding and the LM head into one colour per
# rank, the table gives each rank's shape and slice, and the bars show the memory per GPU (textbook mixed precision,
# Korthikanti's activations) for every degree the model allows. A degree the model does not allow gives the error
# message `apply` gives (try tp=8 on SmolLM-135M: 3 KV heads). Questions: why is SmolLM-135M limited to tp=3? At which
# tp does Llama-3-8B's training fit 80 GB with one 8,192-token sequence, with and without sp? (Widgets need a live
# kernel; a static viewer shows the default only.)

# %%
PRESETS = {"small (this lesson)": mc, **{p: ModelConfig.from_preset(p) for p in
                                         ("tiny", "smollm-135m", "smollm-360m", "smollm-1.7b", "llama3-8b")}}

def draw(model="llama3-8b", tp=4, sp=True, seq_len=8192, micro_batch_size=1, capacity_gb=80.0):
    m = PRESETS[model]
    problem = lesson.tp_problem(m, tp)  # tensor_parallel.check's sentence, or None
    if problem:
        print(f"{model}, tp={tp}: {problem}\nallowed: tp in {lesson.valid_tps(m)}")
        return
    lesson.plot_shards(m, tp, sp, title=f"{model}, tp={tp}{' + sp' if sp else ''}"); plt.show()
    print(lesson.shard_table(m, tp, sp))
    lesson.plot_memory_model(m, tp, sp, seq_len, micro_batch_size, capacity_gb=capacity_gb, title=f"({model})"); plt.show()

# drawn once with the defaults (what a static viewer shows); in a live kernel, controls that redraw it
_common.interactive(draw, lambda w: dict(model=w.Dropdown(options=list(PRESETS), value="llama3-8b"),
                                         tp=w.SelectionSlider(options=[1, 2, 3, 4, 8, 16, 32], value=4, description="tp"),
                                         sp=w.Checkbox(value=True, description="sequence parallel"),
                                         seq_len=w.SelectionSlider(options=[512, 1024, 2048, 4096, 8192, 16384], value=8192, description="seq len"),
                                         micro_batch_size=w.IntSlider(value=1, min=1, max=16, description="micro-batch"),
                                         capacity_gb=w.FloatSlider(value=80, min=8, max=192, step=8, description="GB per GPU")))

# %% [markdown]
# ## 7. Exercises
# Open `lessons/05_tensor_parallel/exercise.py` and write Megatron's pieces by hand:
#
# 1. `CopyToTP` and `ReduceFromTP` — $f$ and $g$ as autograd Functions, forward and backward;
# 2. `parallel_mlp(x, gate_w, up_w, down_w)` — the column-then-row MLP with one $f$ and one $g$;
# 3. `vocab_parallel_cross_entropy(logits, targets)` — the loss from this rank's vocabulary columns, with three
#    all-reduces of one number per token (the backward is given).
#
# The checker runs each on 2 and then 4 real processes, every rank with its slice of the same full weights or
# logits, compares outputs **and gradients** with the unsharded computation in one process, counts your all-reduces
# against Megatron's pattern, and says which rank and tensor are wrong and what that usually means ("missing
# all-reduce in backward of f: x's gradient is rank 0's partial sum", "summed twice", "each rank's own maximum", ...),
# or which ranks hang and on which line. Until you write them it reports `NotImplementedError: not written yet`.

# %%
import check as checker   # this folder's check.py
all_passed = checker.check()

# %% [markdown]
# ## 8. What it costs, when to use it, what comes next
#
# | | per rank | communication | use it when |
# |---|---|---|---|
# | tensor parallel, degree $t$ | $\frac1t$ of every matrix and of its gradient and optimizer state; activations inside the blocks $/t$ | 4 all-reduces of $b\cdot s\cdot h$ per layer per step, blocking | the model (or one layer's activations) does not fit, **within a node** (NVLink), $t \le 8$ |
# | + sequence parallel | also the norms and residual stream $/t$ (Megatron: everything) | the same bytes as all-gathers and reduce-scatters (twice the calls) | with tp, when activations limit the micro-batch or sequence: Megatron's version saves memory at any $t$ for no extra bytes moved; ours keeps extra copies of the gathered input and saves only beyond tp=4 (section 4), and on this CPU each step is slower (section 4) |
#
# **Its costs.** The collectives carry activations, so their size grows with the tokens per micro-batch, not with the
# model; they cannot overlap the layer that needs their result; and each rank's matmuls get $t$ times thinner, which
# makes GPUs less efficient. Across nodes (InfiniBand, ~10x slower than NVLink) it stops paying: the usual recipe is
# tensor parallelism inside each node of 8 GPUs and data parallelism / ZeRO (and pipeline parallelism) across nodes.
# The degree is also bounded by the model: $t$ must divide the heads, the KV heads (unless they are replicated), the
# MLP width and the vocabulary.
#
# **What ours lacks** (what Megatron-LM and torchtitan add): overlapping the all-gather and reduce-scatter with the
# matmuls they feed ("async TP", collective matmul); with sp, a contiguous gathered input shared by the projections
# (ours keeps one copy per projection, section 4b) and, better, only the local tokens of each block's input,
# re-gathered in backward; replicating KV heads to go beyond their number; fused kernels.
#
# **Next — lesson 06, context parallelism:** sequence parallelism cut the tokens only between the blocks; attention
# still needs every token on every rank. With sequences of 100k tokens even one block's activations do not fit.
# Context parallelism cuts the sequence *through* attention: each rank keeps its chunk of queries and passes the keys
# and values around a ring (ring attention).
