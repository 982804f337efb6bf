"""Lesson 05's notebook, 05_tensor_parallel.ipynb, as plain Python in the percent format (see lessons/_notebook.py):
edit this file, never the notebook.

    python lessons/_notebook.py 05_tensor_parallel --run fast    # rebuild the notebook, execute it in FAST mode
"""

# %% [markdown]
# # Lesson 05 — Tensor parallelism: cut the matrices, not the batch
#
# Data parallelism and ZeRO (lessons 03–04) give each rank different *samples*, each running every layer whole.
# **Tensor parallelism** (Megatron-LM, Shoeybi et al. 2019) cuts the layers: each of $t$ ranks keeps $\frac1t$ of
# every weight matrix and uses it on the **same** tokens, exchanging partial results twice per layer each way.
# **Sequence parallelism** (Korthikanti et al. 2022) cuts the rest, the norms and the residual stream, along the
# sequence.
#
# | | each rank keeps | each rank computes | communication per layer |
# |---|---|---|---|
# | data parallel (lesson 03) | the whole model | the whole model, on its own samples | none in the layer; one all-reduce of the gradients per step |
# | tensor parallel | $\frac1t$ of every matrix | $\frac1t$ of every matmul, on all the samples | 2 all-reduces of the $b\cdot s\cdot h$ activations forward, 2 backward |
# | + sequence parallel | the same, and $\frac1t$ of the tokens between the blocks | the same, and $\frac1t$ of the norms | 2 all-gathers + 2 reduce-scatters forward and backward: the same bytes |
#
# We build it (`picotron/tensor_parallel.py`), count its collectives, measure its memory, time it at tp = 1, 2, 4 and
# against torch's DTensor, check parity with one process, and run a 2 × 2 grid with data parallelism and ZeRO-1 (this
# folder's `experiment.py` under `torchrun`; `PICOTRON_FAST=1`: a short run).

# %%
import sys
import matplotlib.pyplot as plt
sys.path.insert(0, "..")   # lessons/: the helpers every lesson shares
import _common
from picotron import mesh as grid, planner, tensor_parallel
from picotron.model import ModelConfig

FAST, OUT = _common.FAST, _common.run_dir("05_tensor_parallel")
import experiment as lesson   # this folder's experiment.py: its formulas, shard shapes and plots
MiB, GB = 2**20, 1e9

def run(only, nproc=2, dp=1, hide=()):
    # torchrun --nproc_per_node nproc lessons/05_tensor_parallel/experiment.py --out OUT --only <only> --dp dp
    # prints what it printed, less the training chatter and the lines that start with one of `hide` (rows that the
    # notebook prints itself, with the formula beside them, from the JSON)
    _common.run_experiment("05_tensor_parallel", only, nproc, "--dp", dp, hide=_common.TRAINING_CHATTER + hide)

def check(name, ok, detail):
    print(f"{'✓' if ok else '✗'} {name}: {detail}")

st = lesson.settings(FAST)  # this machine's settings (the experiments pick the GPU ones on a GPU)
# the model of the main runs (PICOTRON_NPROC=8: 8 KV heads, section 8)
mc = ModelConfig.from_preset("tiny", **_common.SIZES[st["size"]], **lesson.model_overrides())
print(f"FAST={FAST}, results in {OUT.relative_to(_common.ROOT)}; model '{st['size']}': {mc.num_params() / 1e6:.2f} M parameters, "
      f"h={mc.hidden_size}, {mc.num_attention_heads} heads, {mc.num_key_value_heads} KV heads, {mc.num_hidden_layers} layers; "
      f"batch {st['micro_batch_size']} x {st['seq_len']} tokens, the same on every tp rank")

# %% [markdown]
# ## 1. The problem: what ZeRO does not cut
#
# The activations kept for backward grow with a micro-batch's tokens, and ZeRO does not cut them. Llama-3-8B with one
# 8,192-token sequence per GPU, by the textbook formulas ([mixed-precision model
# states](../../docs/reference.md#model-states), 16 bytes per parameter; [Korthikanti's bf16
# activations](../../docs/reference.md#activation-memory), $34\,sbh$ bytes per layer with flash attention; symbols as
# in the course's [notation](../../docs/reference.md#notation)):

# %%
llama = ModelConfig.from_preset("llama3-8b")
for t in (1, 2, 4, 8):
    for sp in ((False, True) if t > 1 else (False,)):
        m = lesson.memory_per_rank(llama, t, sp, seq_len=8192, micro_batch_size=1)
        states = m["params"] + m["grads"] + m["optimizer"]
        print(f"tp={t}{' + sp' if sp else '     '}: model states {states / GB:6.1f} GB + activations {m['activations'] / GB:5.1f} GB "
              f"= {m['total'] / GB:6.1f} GB per GPU")
print(f"(ZeRO-3 over 8 GPUs instead: model states {16 * llama.num_params() / 8 / GB:.1f} GB, activations still "
      f"{lesson.memory_per_rank(llama, 1, seq_len=8192)['activations'] / GB:.1f} GB per GPU, and every layer gathered whole)")

# %% [markdown]
# At tp = 1 one sequence's activations fill almost half an 80 GB GPU. Tensor parallelism divides most of them by $t$
# (everything inside the attention and MLP blocks); Megatron's sequence parallelism, the rest.
#
# **Takeaway:** ZeRO shards the model states; to shrink the activations, cut the layers.
#
# ## 2. The idea
#
# **Column, then row.** A linear layer computes $Y = XA$ (`F.linear(x, W)`, $A = W^\top$). Cut $A$ by **columns**,
# $A = [A_1 \mid A_2]$: rank $r$ computes its output features $Y_r = X A_r$ from the whole $X$, without
# communication, and an elementwise function of them (SwiGLU's $\mathrm{silu}(\text{gate}) \cdot \text{up}$) stays on
# the rank. Cut the next layer's $B$ (Megatron's letters: weights, not the course's batch) by **rows**,
# $Z = YB = Y_1B_1 + Y_2B_2$: each rank computes one term; **one all-reduce** sums them.
#
# ```
#           x (whole, on every rank)
#           │
#           f        forward: identity                backward: all-reduce (sum the ranks' parts of d loss/dx)
#    ┌──────┴──────┐
#  gate_r, up_r       column-parallel: rank r's h_ff/t rows of W_gate, W_up  → its h_ff/t intermediate features
#  silu(gate_r)·up_r  elementwise: stays on rank r
#  down_r             row-parallel: the h_ff/t columns of W_down that read them → a PARTIAL sum of the output
#    └──────┬──────┘
#           g        forward: all-reduce (sum the partial outputs)    backward: identity
#           │
#           y (whole, on every rank)
# ```
#
# By rows instead, the first matrix would give a partial sum, and silu of a partial sum is not one, so a second
# all-reduce would be needed.

# %% [markdown]
# **Attention** is the same with heads: rank $r$ takes whole heads (its rows of $W_q$, $W_k$, $W_v$,
# column-parallel); $W_o$ is row-parallel. Grouped-query attention shares each KV head among several query heads, so
# $t$ must also divide the KV heads $a_\text{kv}$ (8 for Llama-3-8B, 3 for SmolLM-135M).
#
# **f and g** are Megatron's conjugate pair of autograd functions
# ([reference](../../docs/reference.md#tensor-parallelism)): $f$ opens a tensor-parallel region, $g$ closes it. Each
# layer has a $g$ after attention and after the MLP (2 all-reduces forward) and an $f$ before each (2 backward), each
# of a $b\cdot s\cdot h$ activation: traffic that grows with the **tokens**, on the critical path, hence inside a
# node (NVLink, $t \le 8$).
#
# **The vocabulary** is cut too: rank $r$ keeps rows $[r\frac{n_\text{vocab}}{t}, (r+1)\frac{n_\text{vocab}}{t})$ of
# the embedding and LM head, whose logits stay cut, $[b, s, \frac{n_\text{vocab}}{t}]$. The cross-entropy needs
# three all-reduces of one number per token (row maximum, sum of exponentials, target's logit), never the logits.
#
# **Sequence parallelism.** Between the blocks every rank computes the same norms and residual stream. An all-reduce
# is a reduce-scatter then an all-gather (lesson 02), so leave a block with a **reduce-scatter** along the sequence
# (each rank keeps $s/t$ tokens), run the norm and residual add on those, and enter the next block with an
# **all-gather**: same bytes, the outside of the blocks divided by $t$. Each rank's share of our model at tp = 2:

# %%
lesson.plot_shards(mc, 2, title="tp=2, the 'small' model: one colour per rank"); plt.show()

# %% [markdown]
# **Takeaway:** column-parallel then row-parallel costs one all-reduce per block each way; every matrix is cut, the
# embedding and LM head included; only the norm weights stay whole.
#
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
# **The layers.** A column-parallel linear keeps rows of $W$; a row-parallel one keeps columns and ends with $g$. The
# input enters through $f$ once per block (a forward pre-hook), not per layer, or q, k and v would all-reduce its
# gradient three times:

# %%
_common.show_source(tensor_parallel.ColumnParallelLinear.forward)
_common.show_source(tensor_parallel.RowParallelLinear.forward)
print()
_common.show_source(tensor_parallel.apply, "for layer in model.layers:", "model.tie_weights()")

# %% [markdown]
# `apply` swaps the modules of a meta-device model, keeping the unsharded names; `init_weights` draws each full
# tensor from (seed, name) and keeps this rank's slice, so every layout starts from the same weights (hence sections
# 5 and 6's exact parity). The vocabulary-parallel embedding and loss:

# %%
_common.show_source(tensor_parallel.VocabParallelEmbedding.forward)
print()
_common.show_source(tensor_parallel.VocabParallelCrossEntropy)

# %% [markdown]
# With sp each rank sees only its own tokens, so the whole norm weights get partial gradients: the weight passes
# through $f$, whose backward all-reduces them ($h$ numbers per norm):

# %%
_common.show_source(tensor_parallel.SequenceParallelRMSNorm.forward)

# %% [markdown]
# **Takeaway:** four autograd functions carry all of tensor and sequence parallelism; the layers only decide where
# to call them.
#
# ## 4. Run it
#
# Every experiment here runs at tp = the number of processes (dp = 1), all ranks on the same batch. With threads
# shared as in lesson 03 §4(f), **tp=4 puts 4 ranks on 2 cores: oversubscribed**. The ideal here is *flat*
# throughput; on a GPU node, a GPU per rank, $t\times$ one GPU's.
#
# Each variant is built and stepped once as `picotron.train` does (`parallelize(cfg, mesh)`: shards, optimizer, step
# schedule, loss) on `mesh.recorded(recorder)`: the same process groups, with one `metrics.Recorder` counting and
# timing every collective on the schedule's timeline:

# %%
_common.show_source(lesson.Variant.__init__, "self.recorder =", "self.recorder.timeline.record")
_common.show_source(lesson.Variant.step, "self.recorder.reset()", "elapsed, calls =")

# %%
run("memory,scaling", nproc=1)
for t in lesson.tp_counts()[1:]:   # 2, 4; and 8 with PICOTRON_NPROC=8 (section 8)
    run("comm,memory,scaling", nproc=t)
comm = {t: _common.load_json(OUT / f"comm_tp{t}.json")["results"] for t in lesson.tp_counts()[1:]}
memory = {t: _common.load_json(OUT / f"memory_tp{t}.json")["results"] for t in lesson.tp_counts()}
scaling = {t: _common.load_json(OUT / f"scaling_tp{t}.json")["results"] for t in lesson.tp_counts()}
st = _common.load_json(OUT / "memory_tp1.json")["settings"]  # what the experiments ran with

# %% [markdown]
# ### (a) The collectives of a layer, counted
# One step with 2 and with 4 layers, each collective counted with its buffer size in the phase it started in
# (`lesson.by_phase`); per layer is the difference over 2. Bars: counted; black outlines: Megatron's pattern
# (`lesson.megatron_pattern`), in $b\cdot s\cdot h$ activations:

# %%
def size(nb):
    return f"{nb / 1024:,.0f} KiB" if nb >= 1024 else f"{nb} B"

def fmt(counts):
    return ", ".join(f"{c:g} x {lesson.OPS[op]} of {size(nb)}" for (op, nb), c in sorted(counts.items())) or "nothing"

row0 = comm[2]["rows"][0]
act = 4 * row0["b"] * row0["s"] * row0["h"]
print(f"one b·s·h activation: {row0['b']} x {row0['s']} x {row0['h']} fp32 numbers = {size(act)}; "
      f"one b·s vector (the loss's): {size(4 * row0['b'] * row0['s'])}; one norm weight's gradient: {size(4 * row0['h'])}")
for t, res in comm.items():
    for row in res["rows"]:
        got, out = (lesson.parse_counts(row[k]) for k in ("per_layer", "outside"))
        print(f"{row['name']:<9} per layer  forward: {fmt(got['forward'])}\n{'':<20}backward: {fmt(got['backward'])}"
              f"\n{'':<10}Megatron's pattern: {'matched exactly' if row['matches'] else 'NOT matched'}")
        print(f"{'':<10}outside the layers, forward: {fmt(out['forward'])}; backward: {fmt(out['backward'])}; "
              f"optimizer step: {fmt(out['step'])}")
lesson.plot_comm(comm); plt.show()

# %% [markdown]
# Each layer makes exactly Megatron's collectives (with sp twice the calls, the same bytes), plus, with sp, two small
# all-reduces per layer of the norm weights' gradients (Megatron: once per step). Outside the layers: the embedding's
# all-reduce, the LM head's $f$, the loss's **three all-reduces of $b\cdot s$ numbers** and, for clipping, one
# all-reduce of one number.
#
# **Takeaway:** tensor parallelism sends *activations*, 4 times per layer, each one blocking the next layer; data
# parallelism sends *gradients*, once per step, behind backward.
#
# ### (b) What each rank keeps
# One step of every variant: the bytes autograd keeps (`metrics.ActivationPeak`), credited to the part that saved
# them by one more forward under `PartCounter` (the totals must agree), against `lesson.activation_parts` (exact for
# our code, term by term):

# %%
for t, res in memory.items():
    for row in res["rows"]:
        worst = max(abs(p["total"] / row["formula_total"] - 1) for p in row["parts_by_rank"])
        got = row["parts_by_rank"][0]
        print(f"{row['name']:<9} activations per rank {got['total'] / MiB:6.2f} MiB (formula {row['formula_total'] / MiB:6.2f}, "
              f"worst rank {worst:.2%}); per layer " + ", ".join(f"{p} {got['per layer'][p] / MiB:.2f}" for p in lesson.LAYER_PARTS) + " MiB")
lesson.plot_activations(memory, mc, st["seq_len"], st["micro_batch_size"]); plt.show()
per_layer = {r["name"]: sum(r["parts_by_rank"][0]["per layer"].values()) for res in memory.values() for r in res["rows"]}
sbh = st["seq_len"] * st["micro_batch_size"] * mc.hidden_size
R, S = lesson.replicated_and_sharded(mc, st["seq_len"], st["micro_batch_size"])
Rsp, Ssp = lesson.replicated_and_sharded(mc, st["seq_len"], st["micro_batch_size"], sp=True)
print(f"our formula per layer: {R / sbh:.1f}·sbh + {S / sbh:.1f}·sbh/t bytes; with sp {Rsp / sbh:.1f}·sbh + {Ssp / sbh:.1f}·sbh/t "
      f"(Korthikanti, bf16: 10·sbh + 24·sbh/t, with sp 34·sbh/t, flash attention)")
print(f"kept whole on every rank without sp: {R / MiB:.2f} MiB per layer, the floor tp alone never goes below; "
      f"a layer measured: " + ", ".join(f"{k} {v / MiB:.2f} MiB" for k, v in per_layer.items()))

# %% [markdown]
# Our formula has Korthikanti's shape in fp32 bytes (twice his bf16; SwiGLU of width $h_\text{ff} = 3h$; no dropout):
# a part whole on every rank (the two norms, each block's input) plus the blocks' inside over $t$ (q, k, v, attention
# output, MLP intermediates), and it matches the measurement part by part, on every rank.
#
# **What sequence parallelism did here.** It divides the norms by $t$, but our all-gather leaves each block's
# gathered $[b, s, h]$ input (kept for the projections' weight gradients) as a *transposed view*, so each of the five
# projections keeps its own contiguous copy (`SP_INPUT_COPIES`: 3 in attention, 2 in the MLP, against 1 and 1 without
# sp). Per layer, sp therefore keeps *more* at tp=2, the same at tp=4 (the whole model a little less: the final norm
# is cut too; section 5 checks it), and would save only beyond tp=4.
#
# A contiguous gathered input (or Megatron's $[s, b, h]$ layout) would fix it. Megatron also keeps only each rank's
# $s/t$ tokens of a block's input and gathers them **again in backward**: Korthikanti's $34\,sbh/t$. The parity test
# passes either way; only measuring memory by part shows it.
#
# The model states per rank:

# %%
for t, res in memory.items():
    for row in res["rows"]:
        m, f = row["states_by_rank"][0], row["formula_states"]
        print(f"{row['name']:<9} rank 0: " + ", ".join(f"{k} {m[k] / MiB:5.2f} MiB (formula {f[k] / MiB:5.2f})" for k in lesson.PARTS)
              + f" | {row['params_per_rank']:,} parameters (shard_shapes says {lesson.params_per_rank(mc, t):,})")
lesson.plot_memory(memory); plt.show()

# %% [markdown]
# Only the norm weights ($(2L+1)h$ numbers) stay whole, so parameters, gradients and AdamW's moments shrink by about
# $t$, with no gathering before use (unlike ZeRO-3).
#
# **Takeaway:** tp divides the model states and the activations inside the blocks by $t$; the part between the blocks
# stays whole unless sp cuts it, which ours only pays for at tp=4.
#
# ### (c) Throughput against tp
# Steps with sp off and on, alternating, at each tp: the slowest rank's step time, tokens per second (every rank has
# the same batch: not multiplied by $t$) and time inside collectives:

# %%
for t, res in scaling.items():
    for r in res["rows"]:
        print(f"{r['name']:<9} ({res['threads']} thread(s) per rank): {r['tokens_per_s']:7,.0f} tokens/s, step {1e3 * r['median']:6.1f} ms "
              f"(quartiles {1e3 * r['q1']:.0f}-{1e3 * r['q3']:.0f}), inside collectives {1e3 * r['comm_median']:5.1f} ms "
              f"({r['comm_median'] / r['median']:.0%})" + ("  [FAST: few steps]" if FAST else ""))
one = scaling[1]["rows"][0]["tokens_per_s"]
print("relative to one process: " + ", ".join(f"{r['name']} {r['tokens_per_s'] / one:.2f}x" for t in list(scaling)[1:] for r in scaling[t]["rows"]))
lesson.plot_scaling(scaling); plt.show()

# %% [markdown]
# On 2 cores tensor parallelism only costs: on an idle machine one process with two threads is fastest, tp=2 reaches
# a fraction of it, sp less, the oversubscribed tp=4 least. Runs differ by 10% or more with the load (FAST more);
# busy cores hurt the single process's two threads most and can change the order.
#
# Right-hand plot: at tp=2 the time outside collectives is about one process's, with the activation-sized all-reduces
# on top, none hidden (the next layer reads each result). With sp the same bytes take two calls and two transposes.
# At tp=4 a rank "inside a collective" mostly waits for peers that have no core: the orange bar measures
# oversubscription.
#
# A CPU cannot show tp's real setting, a GPU per rank linked by NVLink. An estimate of the counted pattern against
# one layer's compute on H100s:

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
# Inside a node tp=8's all-reduces cost a fraction of a layer's compute, less for the larger model (compute per token
# grows as $h^2$, traffic as $h$); across nodes, about as much as the compute or more. Hence tp inside a node,
# $t \le 8$, data and pipeline across. (Megatron-LM measured 77% of linear weak scaling at 8-way tp in one DGX-2H
# node, Shoeybi et al. 2019; "async TP", section 11, wins back more.)
#
# **Takeaway:** tp's collectives sit on the critical path: it pays only where the link is fast next to the compute.
#
# ### (d) Against torch's DTensor tensor parallelism
# torch's own tensor parallelism, `parallelize_module` with `ColwiseParallel` / `RowwiseParallel` (`SequenceParallel`
# on the norms, `loss_parallel`): the same layout, weights and batches, one step of each in turn, with and without
# sp (`benchmarks/tp_vs_dtensor.py`), keeping each round's ratio:

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
# The ratios vary from run to run (FAST's few rounds most). Both run the same collectives and arithmetic (the losses
# agree closely). The likely difference (not profiled) is DTensor's per-operation overhead in Python (module hooks
# converting each parallel layer's input and output, sharding propagation for every operation), a large part of a
# step for layers this small on a CPU; unmeasured on GPUs, where kernels are larger and run asynchronously to Python.
#
# Right-hand panel: over many steps (full settings) both part from the unsharded model together, by rounding from
# different summation orders amplified by a constant learning rate without warm-up. Section 5's trainer runs, with
# warm-up and decay, are held to the parity standard.
#
# **Takeaway:** the same Megatron layout, the same numbers; ours is a few hundred lines of autograd functions and
# module swaps.
#
# ## 5. Check it: the same training as one process
#
# `picotron.train --tp 2` and `--tp 4`, with and without `--sp`, against one process with the same batch, fp32, same
# seed: losses within $10^{-5}$ relative over the first 10 steps, the [parity
# standard](../../docs/reference.md#parity-standard); the full settings' later steps are drift, bounded by $10^{-3}$
# (lesson 03 §5). `tests/test_tensor_parallel.py` also checks every gradient slice.

# %%
run("parity", nproc=1)
run("parity", nproc=2)
run("parity", nproc=4)
ref = _common.load_json(OUT / "parity_tp1.json")["results"]["losses"]["reference"]
pairs = {name: (losses, ref) for t in (2, 4)
         for name, losses in _common.load_json(OUT / f"parity_tp{t}.json")["results"]["losses"].items()}
for label, (got, want) in pairs.items():
    p = _common.parity(got, want)
    print(f"{label:<10} vs 1 process: max relative loss difference over steps 1-{p['window']} {p['worst']:.1e}"
          + (f", over steps {p['window'] + 1}-{p['n_steps']} {p['beyond']:.1e}" if p["n_beyond"] else ""))
lesson.plot_parity(pairs); plt.show()

# %% [markdown]
# Every claim of sections 4 and 5 that is not a timing, as a number:

# %%
for label, (got, want) in pairs.items():
    for line in _common.parity_checks(label, got, want):
        check(*line)
for t, res in comm.items():
    for row in res["rows"]:
        got = lesson.parse_counts(row["per_layer"])
        check(f"{row['name']}: collectives per layer are Megatron's", row["matches"],
              f"forward {sum(got['forward'].values()):g} calls, backward {sum(got['backward'].values()):g} calls, as predicted")
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
          + (" (FAST mode: fewer than the parity standard's 10; this section's parity checks hold the standard)" if first < 10 else ""))
    check(f"{name}: ours and DTensor's keep the same parameters and optimizer state per rank",
          all(ours["states"][k] == theirs["states"][k] for k in ("params", "optimizer")),
          ", ".join(f"{k} {ours['states'][k]:,} vs {theirs['states'][k]:,} B" for k in ("params", "optimizer")))
check("tp=2: with sp a layer keeps MORE activations than without (the extra copies of the gathered input)",
      per_layer["tp=2 + sp"] > per_layer["tp=2"], f"{per_layer['tp=2 + sp'] / MiB:.2f} vs {per_layer['tp=2'] / MiB:.2f} MiB")
check("tp=4: with sp a layer keeps as much as without", abs(per_layer["tp=4 + sp"] / per_layer["tp=4"] - 1) < 0.005,
      f"{per_layer['tp=4 + sp'] / MiB:.2f} vs {per_layer['tp=4'] / MiB:.2f} MiB")
total = {r["name"]: r["parts_by_rank"][0]["total"] for res in memory.values() for r in res["rows"]}
check("tp=4: with sp the whole model keeps less (the final norm is cut too)", total["tp=4 + sp"] < total["tp=4"],
      f"{total['tp=4 + sp'] / MiB:.2f} vs {total['tp=4'] / MiB:.2f} MiB per rank")
check("a layer's activations per rank: tp=1 > tp=2 > tp=4", per_layer["tp=1"] > per_layer["tp=2"] > per_layer["tp=4"],
      " > ".join(f"{per_layer[k] / MiB:.2f}" for k in ("tp=1", "tp=2", "tp=4")) + " MiB")
for t in list(memory)[1:]:
    one_p, got = (memory[k]["rows"][0]["states_by_rank"][0]["params"] for k in (1, t))
    check(f"tp={t}: parameters per rank shrink by about t", abs(one_p / got / t - 1) < 0.02, f"x{one_p / got:.2f}")

# %% [markdown]
# **Takeaway:** tp = 2 and 4, with and without sp, train like one process; collectives, bytes and parameters match
# their formulas exactly.
#
# ## 6. Process groups and a 2D run
#
# Real jobs put tensor parallelism inside a node and data parallelism (or ZeRO) across. `picotron.mesh` lays the
# ranks on a grid, tp fastest ($\text{rank} = \text{dp\_rank}\cdot t + \text{tp\_rank}$), so a tp group is
# consecutive ranks, one node's GPUs; `group_ranks(sizes, "tp")` are the ranks agreeing on every other axis. For dp =
# 2 × tp = 2, without any process:

# %%
sizes = dict(dp=2, tp=2)
for r in range(4):
    print(f"rank {r}: coordinates {dict((k, v) for k, v in grid.grid_coords(r, sizes).items() if k in sizes)}")
print(f"tp groups {grid.group_ranks(sizes, 'tp')}: the same rows of the batch, 1/tp of every matrix each")
print(f"dp groups {grid.group_ranks(sizes, 'dp')}: the same shard of the model, different rows")
lesson.plot_grid(sizes, micro_batch_size=2, grad_acc=2); plt.show()

# %% [markdown]
# `picotron.train` with dp = 2, tp = 2 and ZeRO-1 over dp on 4 processes, against one process with the same global
# batch (`picotron.data` numbers rows by (dp rank, micro-step)). Each rank reports its groups, its rows (numbered as
# the single process reads them) and its model states:

# %%
run("grid", nproc=1)
run("grid", nproc=4, dp=2)
solo = _common.load_json(OUT / "grid_tp1.json")["results"]
g2 = _common.load_json(OUT / "grid_dp2_tp2.json")["results"]
c, c1 = g2["config"], solo["config"]
print(f"global batch = micro_batch_size x grad_acc x dp = {c['micro_batch_size']} x {c['grad_acc']} x {c['dp']} = "
      f"{c['micro_batch_size'] * c['grad_acc'] * c['dp']} sequences of {c['seq_len']} tokens (the loader says {c['global_batch']}); "
      f"the tp={c['tp']} ranks of a replica share theirs. One process: {c1['micro_batch_size']} x {c1['grad_acc']} x {c1['dp']} = {c1['global_batch']}")
for r in g2["ranks"]:
    print(f"rank {r['rank']} (dp={r['coords']['dp']}, tp={r['coords']['tp']}): tp group {r['tp_ranks']}, dp group {r['dp_ranks']}, "
          f"rows {r['rows']}, model states " + ", ".join(f"{k} {r['states'][k] / MiB:.2f}" for k in lesson.PARTS) + " MiB")
lesson.plot_parity({"dp=2 x tp=2, ZeRO-1": (g2["losses"], solo["losses"])}, what="the 2D run"); plt.show()

# %%
for line in _common.parity_checks("dp=2 x tp=2, ZeRO-1 vs one process", g2["losses"], solo["losses"]):
    check(*line)
ranks = g2["ranks"]
check("every rank's tp and dp groups are picotron.mesh.group_ranks'",
      all(r["tp_ranks"] in g2["groups"]["tp"] and r["dp_ranks"] in g2["groups"]["dp"] and r["rank"] in r["tp_ranks"]
          and r["rank"] in r["dp_ranks"] for r in ranks), f"tp {g2['groups']['tp']}, dp {g2['groups']['dp']}")
check("the tp ranks of a replica read the same rows", all(len({tuple(ranks[k]["rows"]) for k in g}) == 1 for g in g2["groups"]["tp"]),
      "; ".join(f"ranks {g}: rows {ranks[g[0]]['rows']}" for g in g2["groups"]["tp"]))
rows = [ranks[g[0]]["rows"] for g in g2["groups"]["tp"]]
check("the replicas' rows are disjoint and together the whole global batch", sorted(sum(rows, [])) == list(range(c1["global_batch"])),
      f"{' + '.join(str(len(x)) for x in rows)} = {c1['global_batch']} rows")
check("global batch = micro-batch x accumulation x dp, the same as the single process's",
      c["micro_batch_size"] * c["grad_acc"] * c["dp"] == c["global_batch"] == c1["global_batch"],
      f"{c['micro_batch_size']} x {c['grad_acc']} x {c['dp']} = {c['global_batch']}")
zero_opt, alone = max(r["states"]["optimizer"] for r in ranks), g2["tp_alone_states"]["optimizer"]
check("ZeRO-1 over dp=2 halves each rank's optimizer state of its tp shard", abs(zero_opt / alone - 0.5) < 0.01,
      f"{zero_opt / MiB:.2f} MiB per rank vs {alone / MiB:.2f} MiB for tp=2 alone (x{zero_opt / alone:.3f})")

# %% [markdown]
# A replica's tp ranks share rows, the replicas do not, so the global batch is micro-batch × accumulation × dp only:
# more tp ranks make a step cheaper in memory, never bigger.
#
# **Takeaway:** a 2D layout is two sets of process groups from one grid; tp groups share rows, dp groups share a
# shard, and only dp multiplies the batch.
#
# ## 7. Explore: who holds what, for a real model
#
# `lesson.shard_shapes` computes every rank's shard without a process: `tensor_parallel.apply` on a one-layer
# **meta**-device copy of the model, over `Axis.alone("tp", t, r)` (a tp axis with no process group). Pick a model
# and a degree: layer 0's matrices, the embedding and the LM head coloured by rank, each rank's shapes and slices,
# and the memory per GPU (textbook mixed precision, Korthikanti's activations) at every allowed degree; a forbidden
# one gives `apply`'s error (try tp=8 on SmolLM-135M). Why is SmolLM-135M limited to tp=3? At which tp does
# Llama-3-8B's training fit 80 GB with one 8,192-token sequence, with and without sp? (Widgets need a live kernel.)

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
    lesson.plot_memory_model(m, tp, sp, seq_len, micro_batch_size, capacity_gb=capacity_gb, title=f"{model}:"); plt.show()

# drawn once with the defaults (what a static viewer shows); in a live kernel, controls that redraw it
_common.interactive(draw, lambda w: dict(model=w.Dropdown(options=list(PRESETS), value="llama3-8b"),
                                         tp=w.SelectionSlider(options=[1, 2, 3, 4, 8, 16, 32], value=4, description="tp"),
                                         sp=w.Checkbox(value=True, description="sequence parallel"),
                                         seq_len=w.SelectionSlider(options=[512, 1024, 2048, 4096, 8192, 16384], value=8192, description="seq len"),
                                         micro_batch_size=w.IntSlider(value=1, min=1, max=16, description="micro-batch"),
                                         capacity_gb=w.FloatSlider(value=80, min=8, max=192, step=8, description="GB per GPU")))

# %% [markdown]
# **Takeaway:** the model bounds the degree (heads, KV heads, vocabulary), and the memory it buys is a formula you
# can evaluate before renting a GPU.
#
# ## 8. On an 8-GPU node you should see
# For the medium model at 8 × 1,024 tokens the time model predicts a step falling with tp but the all-reduces' share
# rising towards half at tp = 8. tp = 8 needs a whole KV head per rank, so `PICOTRON_NPROC=8` gives the medium model
# 8 KV heads and trains it at tp = 1, 2, 4 and 8 in 4(a)'s runs.

# %%
import _node   # lessons/_node.py: the planner's predictions for one 8×H100 node
_node.show("05_tensor_parallel")

# %% [markdown]
# **Takeaway:** tensor parallelism cuts memory and compute per GPU, but its communication's share grows with $t$:
# keep it inside a node, and at 8 expect a large part of the step in all-reduces.
#
# ## 9. Exercises
# Open `lessons/05_tensor_parallel/exercise.py`. Megatron's pieces by hand:
#
# 1. `CopyToTP` and `ReduceFromTP` — $f$ and $g$ as autograd Functions, forward and backward;
# 2. `parallel_mlp(x, gate_w, up_w, down_w)` — the column-then-row MLP with one $f$ and one $g$;
# 3. `vocab_parallel_cross_entropy(logits, targets)` — the loss from this rank's vocabulary columns, with three
#    all-reduces of one number per token (the backward is given).
#
# The checker runs each on 2, then 4 real processes, compares outputs **and gradients** with the unsharded
# computation, counts your all-reduces against Megatron's pattern, and names the wrong rank, tensor and usual cause
# ("missing all-reduce in backward of f", "summed twice", ...) or which ranks hang on which line.
#
# 4. **A puzzle**, `plan(budget_mib)`: train this lesson's model on global batches of 8 sequences of 128 tokens, no
#    data parallelism, within `budget_mib` MiB per rank (model states + activations, this lesson's formulas).
#    Choose tp, sp and the micro-batch (the rest accumulated) for the highest throughput: the fewest tp ranks, then
#    the largest micro-batch, then sp off unless it makes a layout fit. Six budgets, most with a trap; the checker
#    names the mistake ("you counted the activations of all 8 sequences ...", "at tp=2 ours keeps MORE with sp ...")
#    and runs the right answers with tp > 1 for one real step, whose measured bytes must fit. Every layout, with the
#    budgets:

# %%
lesson.plot_puzzle(); plt.show()

# %% [markdown]
# Until you write them, the checker reports `NotImplementedError: not written yet`:

# %%
import check as checker   # this folder's check.py
all_passed = checker.check(["f_and_g", "parallel_mlp", "vocab_parallel_cross_entropy", "plan"])  # exercise 5: section 10

# %% [markdown]
# **Takeaway:** memory decides which layouts are possible; throughput decides among them, and the cheapest lever
# (a smaller micro-batch) comes before the expensive ones (more tp ranks).
#
# ## 10. Partitioned checkpoints: ZeRO-R inside the tp group
#
# Full recomputation (lesson 01, section 4c) keeps only each layer's input, $b\cdot s\cdot h$ numbers, the same on
# every rank under tp without sp: $t$ copies of every checkpoint. **Partitioned activation checkpointing** ($P_a$,
# ZeRO-R, Rajbhandari et al. 2020, §6.1) keeps $\frac1t$ of it per rank and all-gathers the rest just before the
# recomputation (docs/reference.md, "Activation memory"):
#
# $$\text{checkpoints per rank} = \frac{L\,s\,b\,h\,q}{t}\ \text{bytes instead of}\ L\,s\,b\,h\,q,
# \qquad\text{plus } L \text{ all-gathers of } s\,b\,h\,q \text{ bytes per micro-batch, in backward}$$
#
# ($q$ = 4 bytes in fp32; each rank receives $\frac{t-1}{t}$ of each all-gather.) Small next to the layer's own
# traffic: with full recomputation a Megatron layer makes 6 all-reduces of $sbh$ ($12\,sbh$ sent per rank), and the
# all-gather adds under 10% (ZeRO, §8), on the backward's critical path like every tp collective.
#
# **With sequence parallelism it comes for free:** sp keeps the layer inputs cut along the sequence, so full
# recomputation already keeps $\frac1t$ of each checkpoint, and the block's own all-gather rebuilds the tokens.
# Korthikanti et al. 2022 discuss the two side by side; Megatron-LM offers $P_a$ (`--distribute-saved-activations`)
# but ignores it with sp. Here `--recompute partitioned` refuses `--sp` (use `full`) and tp = 1, and combines with
# dp, ZeRO, cp and pp (tests/test_tensor_parallel.py).
#
# **The code.** `tensor_parallel.apply` gives the model a `HiddenSlices`: rank $r$ keeps hidden columns
# $[rh/t, (r+1)h/t)$ ($t$ divides the heads, so $h$; Megatron cuts the flattened tensor). torch's checkpoint saves
# the *piece*; only the first forward gets the whole input, which the recomputation rebuilds. The autograd graph is
# the forward's own, so every gradient is full recomputation's, bit for bit:

# %%
from picotron import model as llama
_common.show_source(llama.checkpoint_partitioned, "    if not torch.is_grad_enabled()")
print()
_common.show_source(tensor_parallel.HiddenSlices, "    def keep")

# %% [markdown]
# **Measured.** `experiment.py --only partitioned` builds the model with no, full and partitioned recomputation, at 2
# and 4 layers. One step of each measures what autograd keeps (`ActivationPeak`; per layer: the depths' difference
# over 2) and the recorder counts the last step's all-gathers; the 4-layer variants take turns for step times:

# %%
TPS = (2,) if FAST else (1, 2, 4)  # FAST: one tp degree for the checks
for t in TPS:
    run("partitioned", nproc=t, hide=(f"tp={t} ",))  # the experiment's rows: printed below, with the formula
part = {t: _common.load_json(OUT / f"partitioned_tp{t}.json")["results"] for t in TPS}
for t, res in part.items():
    full_ms = next(r["median"] for r in res["rows"] if r["mode"] == "full")
    for r in res["rows"]:
        print(f"tp={t} {r['mode']:<12} a layer keeps {max(r['per_layer_by_rank']) / MiB:6.3f} MiB per rank (formula "
              f"{res['formula_per_layer'][r['mode']] / MiB:6.3f}); all-gathers per step: {r['all_gather_calls']} of "
              f"{r['all_gather_bytes'] / MiB:.2f} MiB in all; {1e3 * r['median']:6.1f} ms/step (x{r['median'] / full_ms:.2f} full's)")
lesson.plot_partitioned(part); plt.show()

# %%
for t, res in part.items():
    if t == 1:
        continue
    rows, f, L = {r["mode"]: r for r in res["rows"]}, res["formula_per_layer"], res["layers"]
    act = 4 * res["b"] * res["s"] * res["h"]  # one layer input, fp32
    for mode, what in (("full", "4sbh"), ("partitioned", "4sbh/t")):
        worst = max(abs(m / f[mode] - 1) for m in rows[mode]["per_layer_by_rank"])
        check(f"tp={t}: {mode} recomputation keeps {what} per layer on every rank", worst < 1e-3,
              f"{f[mode] / MiB:.3f} MiB, worst rank {worst:.2%} off")
    got = rows["partitioned"]["all_gather_bytes"] - rows["full"]["all_gather_bytes"]
    check(f"tp={t}: partitioned adds one all-gather of 4sbh per layer per step", got == L * act and
          rows["partitioned"]["all_gather_calls"] - rows["full"]["all_gather_calls"] == L,
          f"{rows['partitioned']['all_gather_calls']} all-gathers, {got / MiB:.2f} MiB counted, formula L·4sbh = "
          f"{L * act / MiB:.2f} MiB (each rank receives {(t - 1) / t:.0%} of it)")
    check(f"tp={t}: partitioned trains exactly like full recomputation", rows["partitioned"]["losses"] == rows["full"]["losses"],
          f"{len(rows['full']['losses'])} steps, losses equal bit for bit")

# %% [markdown]
# Full recomputation is already far below none (log scale), so $P_a$ matters when the checkpoints themselves do not
# fit: long sequences, many layers, few tp ranks without sp. Its cost, one all-gather and concatenation per layer, is
# lost in this shared CPU's noise: shown, not judged.
#
# **Exercise 5** (`exercise.py`): `keep_my_piece(x, group)`, this rank's copy of its hidden columns, and
# `rebuild_input(piece, group)`, the whole input back on every rank with one all-gather. The checker runs them on 2
# and 4 processes and names the mistake: the sequence cut instead of the hidden dimension, another rank's columns, a
# view instead of a copy (keeping the whole input alive), pieces stacked along the batch as `all_gather_into_tensor`
# leaves them, or put back in the wrong order.

# %%
import check as checker   # this folder's check.py
partition_passed = checker.check(["partition"])

# %% [markdown]
# **Takeaway:** where tp leaves copies, ZeRO-R removes them for one all-gather each; sequence parallelism removes
# them with no extra collective, which is why Megatron uses it instead whenever it can.
#
# ## 11. Async TP: the collective matmul
#
# Every tp collective so far blocks: with sp the matmuls wait for the block's all-gather and make its reduce-scatter
# wait. But a matmul is row-wise in the tokens: the rows of $y = xW^\top$ from rank $r$'s chunk need only that chunk.
# **The collective matmul** (Wang et al. 2023, "Overlap Communication with Dependent Computation via Decomposition",
# ASPLOS'23, §3; the JAX scaling book's collective-matmul example; torchtitan's async TP) cuts the all-gather into
# $t-1$ ring steps, multiplying each arrived chunk while the next travels:
#
# | step $i$ | rank 0 | rank 1 | rank 2 | rank 3 | in flight meanwhile |
# |---|---|---|---|---|---|
# | 0 | $x_0W^\top$ | $x_1W^\top$ | $x_2W^\top$ | $x_3W^\top$ | every rank sends the chunk it holds to its right neighbour |
# | 1 | $x_3W^\top$ | $x_0W^\top$ | $x_1W^\top$ | $x_2W^\top$ | the same again |
# | 2 | $x_2W^\top$ | $x_3W^\top$ | $x_0W^\top$ | $x_1W^\top$ | the same again |
# | 3 | $x_1W^\top$ | $x_2W^\top$ | $x_3W^\top$ | $x_0W^\top$ | nothing: every chunk has arrived |
#
# (rank $r$ multiplies chunk $(r-i) \bmod t$ at step $i$). The row-parallel mirror, **matmul-reduce-scatter**: at
# step $i$ rank $r$ computes its partial sum of chunk $(r-i-1) \bmod t$, adds the running sum from its left neighbour
# and passes it on; the last step completes its own chunk. Backward swaps the pair: an all-gather-matmul's input
# gradient is a matmul-reduce-scatter of $dy\,W$ (its weight gradient $dy^\top x$ uses the gathered $x$ kept from
# forward); a matmul-reduce-scatter's is an all-gather-matmul of $dy$ (each arriving chunk gives its rows of $dx$ and
# its share of $dW$). Same bytes as the replaced collectives, $\frac{t-1}{t}$ of the buffer per rank, in $t-1$
# messages. What stays exposed ([docs/reference.md](../../docs/reference.md#sequence-parallelism),
# `planner.async_tp_exposed_seconds`):
#
# $$T_\text{exposed} = (t-1)\cdot\max\Big(0,\ \alpha + \beta M - t_\text{chunk matmul}\Big)
# \qquad\text{against}\qquad T_\text{blocking} = (t-1)\big(\alpha + \beta M\big),
# \qquad M = \frac{b\,s}{t}\,h\,q\ \text{bytes}$$
#
# per collective: a ring step costs only what its message takes beyond one chunk's matmul. A layer has 8 (forward:
# q/k/v and gate/up all-gather-matmuls, o and down matmul-reduce-scatters; backward: the same four swapped),
# `planner.async_tp_layer_seconds`. One ring multiplies each chunk by q, k and v's weights together (gate and up
# alike), as torch's fused all-gather-matmul does.
#
# **The code** (`picotron/async_tp.py`; `--async-tp`, with `--sp`): the ring, and the all-gather-matmul built on it.

# %%
from picotron import async_tp
_common.show_source(async_tp.ring_all_gather, "    n, chunk = axis.size, local")
print()
_common.show_source(async_tp.AllGatherMatmul.forward, "        def use(j, chunk, step):", "        ring_all_gather(")

# %% [markdown]
# **NCCL.** Each ring step is one batch (`Axis.exchange`: send right and receive left, posted together on the tp
# communicator). Every rank posts the same steps in the same order and waits for each before posting on another
# group, so they never cross data parallelism's or the pipeline's traffic.
#
# `tests/test_async_tp.py` replays every layout's communication (tp; dp × tp with ZeRO-1/3; pp × tp with 1F1B,
# interleaved, ZB-H1, ZB-V and DualPipe; cp × tp; dp × pp × tp) under both of NCCL's models (one stream per
# communicator; one order across communicators) and trains each against one process. Under a split (zero-bubble)
# schedule the rings hand the weight gradients to the schedule's store for its W. FP8 is refused: it replaces the
# linears' matmul, which the collective matmul does itself.
#
# **Measured.** `experiment.py --only asynctp` builds the layers twice on 2 ranks, blocking sp and async TP, with the
# same weights and batch, and times one forward + backward of each in turn. A CPU's local transfer is nearly free and
# runs on the cores that multiply, leaving nothing to hide, so every collective and ring step is held to an
# **emulated link** (`picotron.link`, as in lessons 03 and 04) on which a ring step's message takes twice one chunk's
# q/k/v matmul at the measured rate: a model of a link.
#
# The recorder times the blocking collectives, the ring steps and the `wait` phases (a rank blocked on a ring step:
# its exposed communication); the link logs when it carried each message, splitting each blocked interval into
# waiting for the link (what the formula models) and the rest (the other rank, the transfer's own work):

# %%
run("asynctp", nproc=2)
atp = _common.load_json(OUT / "asynctp_tp2.json")["results"]
emulated = atp["link"] is not None  # on GPUs: the real interconnect, no model of it here
for name, row in atp["runs"].items():
    print(f"{name:<11} {1e3 * row['median_s']:7.1f} ms per forward + backward; exposed tp communication "
          f"{1e3 * row['exposed_per_layer_s']:6.2f} ms per layer" +
          (f", of which waiting for the link {1e3 * row['link_bound_per_layer_s']:.2f} ms (model: "
           f"{1e3 * atp['model'][name]:.2f} ms)" if emulated else ""))
print(f"{atp['link']['label'] if emulated else 'the real interconnect'}; matmul rate {atp['rate'] / 1e9:.1f} GFLOP/s; "
      f"overlapped throughput / blocking's: median {atp['ratio']['median']:.2f} (quartiles {atp['ratio']['q1']:.2f}-"
      f"{atp['ratio']['q3']:.2f})")
lesson.plot_async_timelines(atp); plt.show()
lesson.plot_async_exposed(atp); plt.show()

# %%
blk, ovl = atp["runs"]["blocking"], atp["runs"]["overlapped"]
check("async TP computes what blocking sp computes", atp["parity"]["worst_relative"] < 1e-5,
      f"layers' output, input gradient and {atp['parity']['tensors'] - 2} weight gradients: worst difference "
      f"{atp['parity']['worst_relative']:.1e} of the tensor's largest value")
sent_blocking = (blk["bytes"].get("all_gather", 0) + blk["bytes"].get("reduce_scatter", 0)) * (atp["tp"] - 1) / atp["tp"]
check("the ring sends exactly the blocking collectives' bytes, (t-1)/t of each buffer", ovl["bytes"].get("send") == sent_blocking,
      f"{ovl['bytes'].get('send', 0) / MiB:.3f} MiB in {ovl['calls'].get('send', 0)} ring steps against "
      f"{sent_blocking / MiB:.3f} MiB in {blk['calls'].get('all_gather', 0) + blk['calls'].get('reduce_scatter', 0)} "
      f"all-gathers and reduce-scatters (one step)")
if emulated:
    model_b, model_o = atp["model"]["blocking"], atp["model"]["overlapped"]
    got_b, got_o = blk["link_bound_per_layer_s"], ovl["link_bound_per_layer_s"]
    check("blocking: the wait for the link is the formula's (t-1)(α + c/β) per collective, 8 per layer",
          abs(got_b / model_b - 1) < 0.05, f"{1e3 * got_b:.2f} ms measured per layer, model {1e3 * model_b:.2f} ms")
    check("overlapped: the chunks' matmuls hide at least what the formula says (it assumes the peak matmul rate)",
          got_o <= 1.25 * model_o + 1e-4, f"{1e3 * got_o:.2f} ms waited for the link per layer, model at most "
          f"{1e3 * model_o:.2f} ms; blocking waited {1e3 * got_b:.2f} ms")
check("overlapped: less of the communication is exposed than blocking",
      ovl["link_bound_per_layer_s" if emulated else "exposed_per_layer_s"] <
      blk["link_bound_per_layer_s" if emulated else "exposed_per_layer_s"],
      f"{1e3 * ovl['exposed_per_layer_s']:.2f} ms blocked per layer against {1e3 * blk['exposed_per_layer_s']:.2f} ms" +
      (f"; on the link {1e3 * ovl['link_bound_per_layer_s']:.2f} against {1e3 * blk['link_bound_per_layer_s']:.2f} ms"
       if emulated else ""))

# %% [markdown]
# **What was measured, and what not.** The blocking run waits for the link exactly as long as the formula says, the
# overlapped run far less, even less than the formula predicts (the chunk matmuls run below the measured peak here,
# and a longer matmul hides more). Both are blocked much longer in total (on 2 shared cores the ranks do not compute
# in step, and gloo's transfer runs on them). Step times move much less: the chunk matmuls are $t$ times smaller
# (less efficient), the ring's bookkeeping shares the cores, the emulated link only sleeps. The throughput ratio
# ranged from about 0.9 to 1.3 across runs while we wrote this: **the CPU shows the mechanism, not a speed-up you
# could quote.**
#
# On a GPU, NVLink's copy engines move the bytes while the tensor cores multiply, as the model assumes. The planner's
# prediction for an 8-GPU H100 node (NVLink 450 GB/s per direction, 60% of the bf16 peak; one micro-batch of 4,096
# tokens, bf16):

# %%
import dataclasses
from picotron.plan.hardware import GPUS
from picotron.plan.time_model import step_time
h100 = GPUS["h100-80gb"]
for preset in ("llama3-8b", "llama3-70b"):
    m = ModelConfig.from_preset(preset)
    for t in (2, 4, 8):
        lay = planner.Layout(tp=t, dp=8 // t, sp=True, micro_batch_size=1, grad_acc=8)
        args = (m, 4096, t, 2, h100.peak * h100.efficiency, h100.intra_alpha, h100.intra_bw)
        b_, a_ = step_time(m, lay, 4096, h100), step_time(m, dataclasses.replace(lay, async_tp=True), 4096, h100)
        print(f"{preset:<11} tp={t}: tp communication per layer {1e3 * planner.async_tp_layer_seconds(*args, overlap=False):.3f} ms "
              f"blocking, {1e3 * planner.async_tp_layer_seconds(*args):.3f} ms exposed with async TP; step "
              f"{b_['total']:.2f} s -> {a_['total']:.2f} s (x{b_['total'] / a_['total']:.2f})")

# %% [markdown]
# At tp = 2 and 4 a chunk's matmul outlasts its message on NVLink and the model hides it all; at tp = 8 chunks are
# $t^2$ times smaller than the block's matmul and part of each message shows. The model's 1.1–1.3× is an upper bound:
# on a GPU the matmuls and NCCL share the SMs and memory bandwidth, and small chunk matmuls are less efficient.
# torchtitan measures 1.04–1.16× on H100s, fusing the rings with symmetric memory and copy engines.
#
# **Exercise 6** (`exercise.py`): `ring_steps(rank, n)`, the all-gather-matmul's order: at each step, which chunk
# rank `rank` multiplies and whom it sends to and receives from. The checker tries 2, 3, 4 and 8 ranks and names the
# mistake (chunks passed the wrong way, a message too many, another rank's chunk first, the wrong neighbour).

# %%
ring_passed = checker.check(["ring"])

# %% [markdown]
# **Takeaway:** the collective matmul sends no fewer bytes; it hides each message under a matmul, and pays where a
# chunk's matmul lasts at least as long as its message: large hidden sizes, long sequences, few tp ranks, a fast
# link.
#
# ## 12. What it costs, when to use it, what comes next
#
# | | per rank | communication | use it when |
# |---|---|---|---|
# | tensor parallel, degree $t$ | $\frac1t$ of every matrix, its gradient and optimizer state; activations inside the blocks $/t$ | 4 blocking all-reduces of $b\cdot s\cdot h$ per layer per step | the model (or a layer's activations) does not fit; **within a node**, $t \le 8$ |
# | + sequence parallel | also the norms and residual stream $/t$ (Megatron: everything) | the same bytes, twice the calls | with tp, when activations limit the micro-batch or sequence (ours: below) |
# | + partitioned checkpoints (ZeRO-R $P_a$) | each layer's checkpointed input $/t$ | + 1 all-gather of $b\cdot s\cdot h$ per layer in backward | full recomputation without sp (section 10) |
# | + async TP (with sp) | the same | the same bytes in $t-1$ ring steps per collective, each under a chunk's matmul | when tp's collectives show (tp = 8, short sequences; section 11) |
#
# Megatron's sequence parallelism saves memory at any $t$ for no extra bytes. Ours, with its extra copies of the
# gathered input, kept *more* at tp=2 and ran slower (sections 4b, 4c); at tp=4 it saved a little, enough for the
# puzzle's 23 MiB budget.
#
# **Its costs.** The collectives carry activations: they grow with the tokens per micro-batch, cannot overlap the
# layer that needs them, and leave each rank $t$ times thinner matmuls (less efficient on GPUs). Across nodes tp
# stops paying (section 4c). $t$ must divide the heads, the KV heads (unless replicated), the MLP width and the
# vocabulary.
#
# **What ours lacks** (Megatron-LM and torchtitan have it): async TP with FP8 matmuls; fused rings on symmetric
# memory (ours posts one point-to-point batch per step); with sp but no async TP, a contiguous gathered input shared
# by the projections or, better, only the local tokens kept and re-gathered in backward; replicated KV heads; fused
# kernels.
#
# **Next — lesson 06, context parallelism:** attention still needs every token on every rank. Context parallelism
# cuts the sequence *through* attention: each rank keeps its chunk of queries and passes the keys and values around
# a ring (ring attention).
#
# **Takeaway:** tensor parallelism buys memory with blocking communication; use it inside a node, only as far as the
# model must be cut, and let data parallelism do the rest.
