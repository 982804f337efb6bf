"""Lesson 01's notebook, 01_single_device.ipynb, as plain Python in the percent format (see lessons/_notebook.py):
edit this file, never the notebook.

    python lessons/_notebook.py 01_single_device --run fast    # rebuild the notebook, execute it in FAST mode
"""

# %% [markdown]
# # Lesson 01 — A single device: where the memory of a training step goes
#
# Before splitting training across GPUs we need to know **what** has to be split. This lesson takes one training
# step of our Llama apart on one device and checks every formula against a measurement:
#
# * the **model states** (parameters, gradients, optimizer state) and the **activations** autograd keeps for backward,
#   first **counted** tensor by tensor, then seen by the **allocator** over a whole step,
# * three tools that need no second device: **activation recomputation**, **gradient accumulation**, **bf16 mixed
#   precision**,
# * **throughput**, **MFU** (model FLOPs utilisation, every later lesson's yardstick) and a **profiler trace**.
#
# The experiment is `lessons/01_single_device/experiment.py` (launched with `torchrun`), the memory model
# `picotron/planner.py`. `PICOTRON_FAST=1` gives a short run.

# %%
import dataclasses, sys
import matplotlib.pyplot as plt
sys.path.insert(0, "..")   # lessons/: the helpers every lesson shares
import _common
from picotron import planner, schedule, train as trainer
from picotron.model import ModelConfig, Llama, DecoderLayer, Attention, RMSNorm

FAST, OUT = _common.FAST, _common.run_dir("01_single_device")
import experiment as lesson   # this folder's experiment.py: its helpers and plots
GB, MiB = 1e9, 2**20
print(f"FAST={FAST}, results in {OUT.relative_to(_common.ROOT)}")

# %% [markdown]
# ## 1. The problem: a model, its optimizer and its activations do not fit
#
# The back-of-the-envelope numbers (sources in the course's [reference](../../docs/reference.md); checked below):
#
# * **model states** in bf16 mixed precision with Adam: bf16 params $2\Psi$ + bf16 grads $2\Psi$ + fp32 master
#   weights $4\Psi$ + two fp32 Adam moments $8\Psi$ = **16 bytes per parameter**
#   ([model states](../../docs/reference.md#model-states));
# * **activations** per layer (Korthikanti et al. 2022, GPT-3 in bf16): $sbh\,(34 + 5as/h)$ bytes, times $L$ layers
#   ([activation memory](../../docs/reference.md#activation-memory); the symbols are the course's
#   [notation](../../docs/reference.md#notation)).
#
# Here are SmolLM-1.7B and Llama-3-8B at sequence length $s=2048$ against one 80 GB GPU.

# %%
def textbook(name, s, b):
    c = ModelConfig.from_preset(name)
    est = planner.model_state_bytes(c.num_params(), "bf16", "adamw")
    est["activations"] = c.num_hidden_layers * planner.korthikanti_bytes_per_layer(s, b, c.hidden_size, c.num_attention_heads)
    return est

cases = {f"{name}  s=2048 b={b}": textbook(name, 2048, b) for name, b in
         [("smollm-1.7b", 1), ("smollm-1.7b", 4), ("llama3-8b", 1)]}
for label, est in cases.items():
    print(f"{label:<26}" + "  ".join(f"{k} {v / GB:6.1f}" for k, v in est.items()) + f"   total {sum(est.values()) / GB:6.1f} GB")
lesson.plot_estimate(cases, title="textbook estimate: bf16 mixed precision + Adam, no recomputation"); plt.show()

# %% [markdown]
# Llama-3-8B does not fit before the first activation: 16 bytes × 8.0 B parameters. SmolLM-1.7B fits one sequence
# per step, but a useful batch (pre-training uses ~1-4 M tokens per step, hundreds of sequences of 2048) is far out
# of reach: activations grow linearly with $b$ and, without flash attention, quadratically with $s$. The rest of the
# course (ZeRO, tensor, pipeline, context parallelism) cuts one of these bars into pieces.
#
# **Takeaway:** model states are 16 bytes per parameter whatever the batch; activations scale with the batch and
# the sequence.

# %% [markdown]
# ## 2. The idea and the formulas
#
# ### Model states
# | | params | grads | optimizer | total / param |
# |---|---|---|---|---|
# | fp32 + Adam | 4 | 4 | 8 (two moments) | **16** |
# | textbook bf16 mixed precision + Adam | 2 | 2 | 4 (fp32 master) + 8 | **16** (20 with fp32 grad accumulation) |
# | **our trainer**, `--dtype bf16` | 4 (fp32 master = the params) | 4 | 8 | **16**, + a 2-byte bf16 copy of each weight while it is in use |
#
# Our trainer (`picotron/train.py`) keeps parameters, gradients and Adam state in fp32 and runs the forward under
# `torch.autocast(dtype=bfloat16)`, each matmul casting its weight and input to bf16 on the fly. So **bf16 does not
# shrink the model states** (the optimizer needs fp32 weights); it shrinks part of the activations and speeds up the
# matmuls on hardware with bf16 units.
#
# ### Activations: ask autograd what it keeps
# Every op that needs its inputs (or outputs) for backward hands them to autograd, and a *saved-tensor hook* sees
# each one. `saved_tensors_table` runs ONE decoder layer of the `tiny` model (h=128, 8 heads, 4 KV heads,
# $h_\text{ff}=384$) on s=16, b=2 and lists the **counted saved tensors** (a storage saved twice counts once;
# parameters are not activations).

# %%
tiny = ModelConfig.from_preset("tiny")
rows = lesson.saved_tensors_table(tiny, seq_len=16, batch=2, dtype="fp32")
lesson.print_table(rows)

# %% [markdown]
# Reading the table, with $s$ sequence, $b$ micro-batch, $h$ hidden, $h_\text{ff}$ MLP width, $a$ heads,
# $a_\text{kv}$ KV heads, $d$ head dimension, fp32 (4 bytes):
#
# | part | what is saved | bytes |
# |---|---|---|
# | `input_layernorm` | its input $x$ (the residual stream), $1/\mathrm{rms}$, the normalised $x$ | $8sbh + 4sb$ |
# | `q/k/v_proj` | their common input, **once** (same storage) | $4sbh$ |
# | RoPE | the cos/sin tables: one pair for the whole model | $2\cdot4sd$ (once) |
# | `scaled_dot_product_attention` | $Q, K, V$ after RoPE ($K, V$ are $a_\text{kv}/a$ of $Q$: GQA), output, logsumexp | $4sbh(2 + 2a_\text{kv}/a) + 4asb$ |
# | `o_proj` | its input *is* the sdpa output: nothing new | 0 |
# | `post_attention_layernorm` | as above | $8sbh + 4sb$ |
# | `mlp` | shared input of gate/up, $\mathrm{gate}$, $\mathrm{silu(gate)}$, $\mathrm{up}$, their product (input of down) | $4sbh + 16sbh_\text{ff}$ |
#
# $$A_\text{layer}^\text{fp32} = sbh\,(32 + 8a_\text{kv}/a) + 16\,sbh_\text{ff} + sb\,(8 + 4a)\ \text{bytes.}$$
#
# No $s\times s$ matrix: the flash-style sdpa kernel keeps each row's logsumexp and recomputes the scores in
# backward. `planner.activation_terms_per_layer` encodes this; the ratios below compare it with the counts by part:

# %%
def compare_parts(rows, mc, s, b, dtype="fp32", recompute="none"):
    measured, formula = lesson.by_part(rows), planner.activation_terms_per_layer(mc, s, b, dtype, recompute)
    for part in formula:
        print(f"  {part:<26} counted {measured.get(part, 0):>9,}  formula {formula[part]:>9,}  ratio {measured.get(part, 0) / formula[part]:.4f}")
    print(f"  {'(RoPE tables, shared)':<26} counted {measured.get('RoPE tables (shared)', 0):>9,}")

compare_parts(rows, tiny, 16, 2)

# %% [markdown]
# **Eager attention stores the $s \times s$ scores.** With `attn_impl="eager"` (an explicit
# `softmax(q kᵀ/√d) v`, as in pre-flash code), the attention core instead keeps $Q$, $K$ and $V$ *repeated* to all
# $a$ heads, the causal mask ($s^2$ bytes), the fp32 softmax output ($4as^2b$) and a copy of the output:

# %%
eager = dataclasses.replace(tiny, attn_impl="eager")
rows_eager = lesson.saved_tensors_table(eager, seq_len=16, batch=2)
lesson.print_table([r for r in rows_eager if r["module"] == "self_attn" and r["bytes"]])
compare_parts(rows_eager, eager, 16, 2)

# %% [markdown]
# **Under bf16 autocast** three things change: matmul inputs and outputs are bf16, but the RMSNorms still save fp32
# (the residual stream stays fp32); q/k/v's shared input is cast **once per Linear**, so saved three times; and every
# Linear saves **the bf16 copy of its weight** until backward: the textbook's "bf16 params $2\Psi$", here as
# activations.

# %%
rows_bf16 = lesson.saved_tensors_table(tiny, seq_len=16, batch=2, dtype="bf16")
lesson.print_table([r for r in rows_bf16 if r["bytes"] and r["module"] in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj")])
compare_parts(rows_bf16, tiny, 16, 2, "bf16")

# %% [markdown]
# ### Against the textbook: Korthikanti et al.'s $34\,sbh + 5as^2b$
# Their count is for GPT-3 in pure bf16 *with dropout*. Term by term (bytes):
#
# | Korthikanti (GPT, bf16) | | ours (Llama, bf16 autocast) | |
# |---|---|---|---|
# | 2 LayerNorm inputs | $4sbh$ | 2 RMSNorms in fp32: input, normalised $x$, $1/\mathrm{rms}$ | $16sbh + 8sb$ |
# | QKV input | $2sbh$ | q/k/v input, one bf16 cast per Linear | $6sbh$ |
# | $Q, K$ | $4sbh$ | $Q, K$ after RoPE ($K$ is $a_\text{kv}/a$ of $Q$) | $2sbh(1 + a_\text{kv}/a)$ |
# | softmax output + dropout mask + dropout output | $5as^2b$ | sdpa: logsumexp only · eager: fp32 softmax + its bf16 copy | $4asb$ · $6as^2b$ |
# | $V$, output-projection input, dropout mask | $5sbh$ | $V$, sdpa output (shared with `o_proj`), no dropout | $2sbh(1 + a_\text{kv}/a)$ |
# | MLP: input, GeLU in ($4h$), GeLU out, dropout mask | $19sbh$ | SwiGLU: input ×2 casts, gate, silu, up, product ($h_\text{ff}$ wide) | $4sbh + 8sbh_\text{ff}$ |
# | — | | bf16 weight copies | $2$ bytes × layer params |
#
# (With eager attention our $K$ and $V$ are repeated to all $a$ heads, the output is copied for `o_proj`, and the
# $s^2$ terms are the causal mask $s^2$ plus the fp32 softmax $4as^2b$ and its bf16 copy $2as^2b$.)
#
# Below, both formulas for a GPT-3-like layer ($h_\text{ff}=4h$, $a_\text{kv}=a$) and for SmolLM-1.7B ($h_\text{ff}=4h$, $a_\text{kv}=a$
# too), eager and sdpa:

# %%
for name, mc in [("GPT-like h=2048 a=16", ModelConfig(vocab_size=50257, hidden_size=2048, intermediate_size=8192, num_hidden_layers=1,
                                                       num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048)),
                 ("smollm-1.7b", ModelConfig.from_preset("smollm-1.7b"))]:
    s, b, h, a = 2048, 1, mc.hidden_size, mc.num_attention_heads
    k = planner.korthikanti_bytes_per_layer(s, b, h, a)
    for impl in ("eager", "sdpa"):
        ours = planner.activation_terms_per_layer(dataclasses.replace(mc, attn_impl=impl), s, b, "bf16")
        acts = sum(v for p, v in ours.items() if p != "bf16 weight copies")
        print(f"{name:<22} {impl:<6} Korthikanti {k / 2**20:7.0f} MiB | ours {acts / 2**20:7.0f} MiB + weight copies "
              f"{ours['bf16 weight copies'] / 2**20:4.0f} MiB | ours/Korthikanti {acts / k:.2f}")

# %% [markdown]
# With eager attention we keep *more* than the textbook (fp32 norms and softmax, triple casts, wider SwiGLU); with
# sdpa the $s^2$ term disappears and we keep far less at long sequences.
#
# **Takeaway:** a textbook formula is only as good as its assumptions: count what *your* code saves.
#
# ## 3. Read the code
# The decoder layer: two pre-norm residual branches. `selective` wraps only `Attention.core` (where tokens see each
# other, the $s^2$ work) in `torch.utils.checkpoint`.

# %%
_common.show_source(DecoderLayer.forward)
_common.show_source(Attention.forward)
_common.show_source(RMSNorm.forward)

# %% [markdown]
# `RMSNorm.forward` explains three rows of the table: `pow` saves the input, `rsqrt` saves $1/\mathrm{rms}$, the
# final `*` saves the normalised $x$ (the weight is a parameter). `Llama.forward` holds the other recomputation
# mode, `full`: checkpoint each whole layer, keep only its input, redo its forward during backward.

# %%
_common.show_source(Llama.forward, "x = self.embed_tokens", "return self.lm_head")

# %% [markdown]
# And one optimizer step. The step engine, `schedule.OneStage.run` (`picotron/schedule.py`), runs $m$ = `grad_acc`
# micro-batches, each loss divided by $m$ so the summed gradients are the mean loss's. It measures nothing:
# `self.phases` names each micro-batch's forward and backward, and listeners (`picotron/hooks.py`) measure: the
# trainer counts saved activations, section 4 feeds the profiler. (`no_sync` and `finish_sync` are for lesson 03;
# on one device `Local` has nothing to synchronise.) `picotron/train.py` calls it, clips the gradient norm and steps
# AdamW:

# %%
_common.show_source(schedule.OneStage.run)
print("\n    # picotron/train.py, one optimizer step:")
_common.show_source(trainer.one_step, "loss = run.schedule.run", "model.zero_grad")

# %% [markdown]
# **Takeaway:** one step is forward and backward of each micro-batch (gradients adding up), then one optimizer step;
# every memory term of section 2 lives somewhere in this loop.
#
# ## 4. Run it
# Each part launches `experiment.py` under `torchrun --nproc_per_node 1` (later lessons: N processes) and plots the
# JSON it writes.
#
# ### (a) Memory: counted vs planned
# One real training step (AdamW included) per model size and sequence length. Parameters, gradients and optimizer
# state are **counted** by walking the tensors (`model.memory()`, `metrics.optimizer_bytes`), activations by the
# saved-tensor hook (`metrics.ActivationCounter`). The planner predicts all four from the config alone.

# %%
_common.launch("01_single_device/experiment.py", ["--out", OUT, "--only", "memory"])
memory = _common.load_json(OUT / "memory.json")["results"]
for r in memory:
    ratios = "  ".join(f"{p} {r['counted'][p] / r['estimate'][p]:.6f}" for p in lesson.PARTS)
    print(f"{r['size']:<7}{r['dtype']:<5} s={r['seq_len']:<4} counted/planned: {ratios}")
lesson.plot_memory(memory); plt.show()

# %% [markdown]
# The ratios: planner against counts (optimizer state: 8 bytes per parameter plus a 4-byte `step` counter per
# tensor). The saved tensors grow linearly with $s$ (and $b$), the model states stay put; bf16 shrinks them by much
# less than 2× (fp32 norms, the fp32 log-softmax over the vocabulary, the bf16 weight copies).
#
# **Takeaway:** the planner knows every tensor our step keeps. But a count is not what the device holds: (b) asks
# the allocator.
#
# ### (b) The allocator's view of one step
# The allocator also sees every temporary, gradients appearing one by one in backward, and AdamW's state created at
# the first `optimizer.step()`. `lesson.step_memory` builds the `small` model and runs two steps under
# `torch.profiler` with `profile_memory=True`, which records every allocation and free; their running sum is the
# memory in use (data loaded before, so only the model's allocations count). Three variants: no recomputation, full
# recomputation, and the same global batch as two micro-batches.

# %%
_common.launch("01_single_device/experiment.py", ["--out", OUT, "--only", "allocator"])
allocator = _common.load_json(OUT / "allocator.json")["results"]
main = allocator[0]
c, (s1, s2) = main["counted"], main["steps"]
def mib(x): return f"{x / MiB:7.2f} MiB"
print(f"{'the allocator (MiB in use)':<52}{'':>11}   counted")
for label, got, part in [("after building the model", main["after_build"], "params"),
                         ("step 1: the forward adds", s1["after_forward"] - s1["start"], "activations"),
                         ("step 1: after backward, above the step's start", s1["before_optimizer"] - s1["start"], "grads"),
                         ("step 1: after AdamW's first step, above the start", s1["end"] - s1["start"], "optimizer")]:
    print(f"{label:<52}{mib(got)}   {mib(c[part])} {lesson.LABELS[part]}")
print(f"peak of step 1 {mib(s1['peak'])} ({s1['peak_phase']}); of step 2 {mib(s2['peak'])} ({s2['peak_phase']}, in {s2['peak_op']})")
print(f"\n{'variant':<38}{'P+O+saved':>10}{'estimate':>10}{'peak':>9}{'bound':>9}  (MiB; step 2)  peak - (P+O+saved), where")
for r in allocator:
    c2, last = r["counted"], r["steps"][-1]
    base = c2["params"] + c2["optimizer"] + c2["activations"]
    print(f"recompute {r['recompute']:<5} micro-batch {r['micro_batch_size']} x {r['grad_acc']:<10}{base / MiB:10.2f}"
          f"{r['estimate']['total'] / MiB:10.2f}{last['peak'] / MiB:9.2f}{r['bound'] / MiB:9.2f}  {(last['peak'] - base) / MiB:6.2f} MiB in {last['peak_op']}")
for r in (r for r in allocator if r["cuda"]):  # on a GPU: the caching allocator's own numbers
    print(f"CUDA, recompute {r['recompute']}, x {r['grad_acc']}: max_memory_allocated {mib(r['cuda'][-1]['allocated'])}, "
          f"max_memory_reserved {mib(r['cuda'][-1]['reserved'])}" + (f"; snapshot {r['snapshot']} (open it at https://pytorch.org/memory_viz)" if r["snapshot"] else ""))
lesson.plot_allocator_timeline(main); plt.show()

# %% [markdown]
# Left to right: building the model leaves exactly the counted parameters. Each forward climbs by the counted saved
# tensors: what the hook counts *is* what the allocator holds. The backward walks down as saved tensors are freed
# and gradients appear, ending at its start plus the gradients. In step 1 the optimizer jumps up by AdamW's two
# moments; `zero_grad` then leaves parameters + optimizer state, so step 2 starts higher by that state.
#
# Why the peak is not the counted estimate (params + grads + optimizer + saved tensors):
# * **gradients arrive during backward** while saved tensors leave, so the peak can stay below the estimate;
# * **temporaries**: at the peak a backward operator (named in the table) holds its inputs' gradients: MLP-wide in a
#   layer, logits-sized ($4sb\,n_\text{vocab}$ bytes) at the loss;
# * **full recomputation** brings each layer's saved tensors back, one layer at a time, during the backward;
# * **gradient accumulation**: the first micro-batch's gradients stay through the second one's forward;
# * **AdamW's state is created at the first optimizer step**: step 1's peak lacks it.
#
# `lesson.peak_bound` is the rule of thumb: the estimate plus the backward's working set (one layer's saved
# tensors, another layer's worth under full recomputation or the attention block's under selective, two
# logits-sized fp32 gradients). The figure puts each peak between the tensors that must exist at the forward's end
# and that bound; section 5 checks this bracket, and each boundary above against its count within 1%.

# %%
lesson.plot_allocator_peaks(allocator); plt.show()

# %% [markdown]
# On a GPU, PyTorch's caching allocator rounds blocks up (to multiples of 512 bytes) and keeps freed ones, so
# `torch.cuda.max_memory_reserved` exceeds `max_memory_allocated`; there (b)'s first cell prints both and saves a
# `torch.cuda.memory._record_memory_history` snapshot. On a CPU the process holds more still (Python, libraries,
# dataset, malloc's free lists): compare the `peak` column of (e)'s trainer lines with the MiB its model needs.
#
# **Takeaway:** the counts predict the allocator phase by phase; the peak is the count plus the backward's working
# set. Plan with headroom, and measure with the allocator.
#
# ### (c) Activation recomputation: memory for compute
# `none`, `selective` and `full` on the `small` model, with sdpa and with eager attention. Same seed, same batch:
# the loss and the gradients must not change at all.

# %%
_common.launch("01_single_device/experiment.py", ["--out", OUT, "--only", "recompute"])
recompute = _common.load_json(OUT / "recompute.json")["results"]
for impl in ("sdpa", "eager"):
    base = next(r for r in recompute if r["attn_impl"] == impl and r["recompute"] == "none")
    for r in (r for r in recompute if r["attn_impl"] == impl):
        print(f"{impl:<6}{r['recompute']:<10} counted saved tensors {r['counted']['activations'] / MiB:7.2f} MiB "
              f"({r['counted']['activations'] / base['counted']['activations']:5.1%}) | step time x{r['time'] / base['time']:.2f} | "
              f"counted/planned {r['counted']['activations'] / r['estimate']['activations']:.4f} | max|Δgrad| {r['max_grad_diff']:.1e}")
lesson.plot_recompute(recompute); plt.show()

# %% [markdown]
# **Full** recomputation keeps one tensor per layer and runs each forward twice: $6N$ to $8N$ FLOPs per token, so a
# step up to about a third longer (diluted by the optimizer and work outside the layers; a busy machine can stretch
# any one step far more).
#
# **Selective** drops and re-runs only the attention core. With eager attention that is the $s^2$ part, a memory win
# growing with $s$; its time cost is the core's share of the layer, growing with $s/h$ (at long sequences in a small
# model, nearly full's). With sdpa it saves almost nothing: flash attention *is* selective recomputation. Timings on
# a shared CPU are noisy; the memory numbers are exact.
#
# (A fourth mode, `--recompute partitioned`, splits the kept inputs over the tp ranks: lesson 05, section 10.)
#
# **Takeaway:** recomputation trades memory for FLOPs without changing a single gradient; recompute the part whose
# memory is largest per FLOP (the $s^2$ scores), or everything when nothing else fits.
#
# ### (d) Gradient accumulation: a big batch in small pieces
# One batch of $B$ sequences at once, or $m$ micro-batches of $b = B/m$, each loss divided by $m$, gradients summed in
# `p.grad`: the same maths, another order of float additions.

# %%
_common.launch("01_single_device/experiment.py", ["--out", OUT, "--only", "accumulate"])
accumulate = _common.load_json(OUT / "accumulate.json")["results"]
a1 = accumulate[0]["counted"]["activations"]
for r in accumulate:
    print(f"m={r['grad_acc']:<3} micro-batch {r['micro_batch_size']:<3} counted saved tensors {r['counted']['activations'] / MiB:7.2f} MiB "
          f"(m=1 / {a1 / r['counted']['activations']:.2f}) | max|grad - grad(m=1)| {r['max_grad_diff']:.1e} "
          f"(largest gradient {r['max_grad']:.1e}) | loss {r['loss']:.7f} | step {1e3 * r['time']:6.1f} ms")
lesson.plot_accumulate(accumulate); plt.show()

# %% [markdown]
# The saved tensors drop by almost exactly $m$ (only the RoPE tables do not scale with $b$). The gradients agree to
# about $10^{-7}$ of the largest. The cost is time: $m$ passes of smaller matmuls. On a GPU small micro-batches idle
# the tensor cores and pay $m$ times for every kernel launch; on this CPU the step times may differ by little more
# than the noise.
#
# **Takeaway:** gradient accumulation divides the activations by $m$ at the same global batch, exactly; it is the
# first tool to reach for.
#
# ### (e) bf16 autocast vs fp32
# Two short runs of the real trainer (`picotron.train.train`), same seed and batches.

# %%
_common.launch("01_single_device/experiment.py", ["--out", OUT, "--only", "precision"])
precision = _common.load_json(OUT / "precision.json")
runs = precision["results"]
for d, r in runs.items():
    s = r["summary"]
    print(f"{d}: final loss {s['final_loss']:.4f}, val {s['val_loss']:.4f}, {s['tokens_per_s']:,.0f} tokens/s, "
          f"activations {s['mem']['activations'] / 2**20:.2f} MiB (planned {r['estimate']['activations'] / 2**20:.2f})")
step_gaps = [abs(a - b) for a, b in zip(runs["bf16"]["loss"], runs["fp32"]["loss"])]
val_gaps = {s: abs(a - b) for (s, a), (_, b) in zip(runs["bf16"]["val"], runs["fp32"]["val"])}
print("validation loss, |bf16 - fp32| at steps " + ", ".join(f"{s}: {g:.4f}" for s, g in val_gaps.items()))
worst_step = max(range(len(step_gaps)), key=step_gaps.__getitem__)
print(f"training loss of single batches: max |bf16 - fp32| {step_gaps[worst_step]:.4f} at step {runs['fp32']['steps'][worst_step]} "
      f"(gradient norms there: fp32 {runs['fp32']['grad_norm'][worst_step]:.2f}, bf16 {runs['bf16']['grad_norm'][worst_step]:.2f}), "
      f"median over the {len(step_gaps)} steps {sorted(step_gaps)[len(step_gaps) // 2]:.4f}")
lesson.plot_precision(runs); plt.show()

# %% [markdown]
# The loss curves lie on top of each other: bf16 keeps fp32's exponent range (no loss scaling) and the master
# weights stay fp32. Single steps can differ more: the runs round differently, and a small model at its peak
# learning rate has loss spikes that can hit one run and not the other (a gradient norm far above its neighbours',
# pulled back by clipping).
#
# The line above gives the largest single-batch gap, where, and the two gradient norms there: typically a few
# hundredths, occasionally a few tenths, more often in short runs at a high learning rate. So section 5 compares the
# **validation loss** (the mean over held-out batches, every quarter of the run).
#
# Speed depends on the hardware: tensor cores run bf16 matmuls several times faster than fp32; a CPU without bf16
# units (most laptops) emulates it, many times *slower*: see the tokens/s bars.
#
# **Reading the MFU of the two runs.** Each run's MFU is against the matmul peak *of its own dtype* measured here
# (its start-up line says which). Where bf16 is emulated its peak is many times lower, so a much slower bf16 run can
# show fp32's MFU. MFU says how close a run comes to its own ceiling; to compare precisions, compare tokens/s.
#
# **Takeaway:** bf16 autocast trains like fp32 and keeps fewer activation bytes; whether it is faster depends on the
# hardware's bf16 units.
#
# ### (f) Throughput and MFU
# MFU = achieved model FLOP/s ÷ peak FLOP/s, the model's FLOPs $6N + 12Lhs$ per token (PaLM, appendix B; which
# parameters $N$ counts: [FLOPs per token](../../docs/reference.md#flops-per-token)). The peak is one large matmul's
# speed measured here (`metrics.measured_matmul_peak`); on a GPU the datasheet peak is shown too.

# %%
_common.launch("01_single_device/experiment.py", ["--out", OUT, "--only", "throughput"])
throughput = _common.load_json(OUT / "throughput.json")
for r in throughput["results"]:
    print(f"{r['size']:<12}{r['num_params'] / 1e6:7.2f} M params | {r['flops_per_token'] / 1e6:7.1f} MFLOP/token | "
          f"{r['tokens_per_s']:>9,.0f} tokens/s | MFU {100 * r['mfu']:5.1f}% of {r['peak_flops_measured'] / 1e9:,.0f} GFLOP/s ({throughput['device']})")
lesson.plot_throughput(throughput["results"]); plt.show()

# %% [markdown]
# Bigger matrices use the hardware better: small models spend more of their time in element-wise ops, Python and
# kernel launches, which do no model FLOPs ((g) shows where). Well-tuned LLM training reaches 35–55% MFU on H100
# clusters ([published figures](../../docs/reference.md#reference-points)).
#
# **Takeaway:** MFU is the share of the device's own matmul speed that goes into the model's FLOPs.
#
# ### (g) Where the time of a step goes: a profiler trace
# `torch.profiler` also records when each operator ran. The experiment profiles one steady step of the `small` model
# (after the step that created AdamW's state) into `trace_step.json` (path printed below). Drag it into
# https://ui.perfetto.dev (or chrome://tracing → Load): the `forward`, `backward` and `optimizer` ranges come from the
# phase hooks, each operator nested under them with its shapes and duration. Below, each operator's **self time**
# (without the operators it calls; on a GPU its kernels' time) summed by phase.

# %%
_common.launch("01_single_device/experiment.py", ["--out", OUT, "--only", "trace"])
trace = _common.load_json(OUT / "trace.json")["results"]
print(f"trace: {trace['trace']} ({trace['trace_mb']:.1f} MB) — open it at https://ui.perfetto.dev or chrome://tracing")
phases = trace["phases"]
for name, p in phases.items():
    print(f"{name:<10} {p['self_ms']:8.1f} ms of {trace['time']} self time: " + ", ".join(f"{n} {ms:.1f}" for n, ms in p["top"])
          + f", other {p['other_ms']:.1f}")
print(f"backward / forward: {phases['backward']['self_ms'] / phases['forward']['self_ms']:.2f}")
lesson.plot_trace(trace); plt.show()

# %% [markdown]
# Expect the backward to take about twice the forward: gradients of both inputs and weights of every matmul ($4N$
# FLOPs per token against $2N$); one step on a shared CPU is a noisy sample. The matmuls (`mm`) should lead both
# phases; then the attention kernel, element-wise work (norms, SwiGLU, RoPE), the autograd engine and Python between
# operators: time without model FLOPs, which MFU counts against us. The optimizer is a thin slice: a few
# element-wise operations per parameter, independent of the batch. (The profiler adds a little to every operator.)
#
# **Takeaway:** a trace says which operators to make faster; on one device, for these models, that is mostly the
# matmuls of forward and backward.
#
# ### (h) The trainer's own trace: `--profile`, opened in Perfetto
# Any `picotron.train` run can write such a trace: `--profile 2:3` profiles optimizer steps 2 and 3 (step 1 pays for
# warm-up) into `OUT/traces/rank0.json`, with picotron's phases as named ranges around torch's operators: `step N`,
# `forward mb=i`, `backward mb=i`, the gradient sync's `wait`, `clip grad norm`, `optimizer step` (and, in a parallel
# run, every collective with its axis and bytes on rows of its own: lesson 09):
#
#     python -m picotron.train --preset tiny --steps 3 --grad-acc 2 --profile 2:3 --out runs/profiled
#
# The experiment runs it on the `small` model and reads the file back: each phase's time over the two steps, next to
# the step time `metrics.jsonl` measured on its own.

# %%
_common.launch("01_single_device/experiment.py", ["--out", OUT, "--only", "profile"], quiet=True)
prof = _common.load_json(OUT / "profile.json")["results"]
print(f"trace: {prof['trace']} ({prof['trace_mb']:.1f} MB); open it at https://ui.perfetto.dev (drag the file in)")
print(f"{'phase':<16}{'ms (2 steps)':>14}{'share of the steps':>20}")
steps_ms = sum(prof["step_ms"].values())
for name, ms in sorted(prof["phases"].items(), key=lambda kv: -kv[1]):
    print(f"{name:<16}{ms:14.1f}{ms / steps_ms:19.1%}")
for step in prof["steps"]:
    print(f"step {step}: its phases {prof['phases_by_step'][str(step)]:.1f} ms, its step_time in metrics.jsonl "
          f"{prof['metrics_step_ms'][str(step)]:.1f} ms, its range in the trace {prof['step_ms'][str(step)]:.1f} ms")
print(f"CUDA memory snapshot: {prof['snapshot'] or 'not written (a CPU run: it records the CUDA allocator)'}")
lesson.plot_profile(prof); plt.show()

# %% [markdown]
# Two clocks, one story: the profiled phases make up nearly all of `metrics.jsonl`'s `perf_counter` `step_time` (the
# rest: fetching the batch, the loss's `.item()`, zeroing gradients). A step's range can be longer than its
# `step_time`: it covers bookkeeping after the clock stops (memory counts, the matmul peak re-measured when a step
# beat it, section 4f). In Perfetto, W/S zoom, A/D pan; click a range for its duration and operators; select a
# stretch for a table of what ran, by name. Forward and backward dominate as in (g); `optimizer step` and `clip
# grad norm` are thin, and `wait` is nothing on one device.
#
# **On a GPU** the run also writes `OUT/traces/memory_rank0.pickle`, the CUDA caching allocator's history
# (`torch.cuda.memory._record_memory_history`: every allocation and free with its Python stack). In
# https://pytorch.org/memory_viz the *Active Memory Timeline* shows (b)'s saw-tooth with names: activations piling
# up in forward, released in backward, the gradients, AdamW's moments. Not written on a CPU; on a GPU unmeasured (no
# GPU was lent when this was written).
#
# **Takeaway:** `--profile A:B` gives any training run a trace whose phases add up to the measured `step_time`; read
# it in Perfetto to see which phase, and which operator inside it, to make faster.
#
# ## 5. Check it
# The lesson's claims about memory and gradients, as numbers:

# %%
def check(name, ok, detail):
    print(f"{'✓' if ok else '✗'} {name}: {detail}")

worst = {p: max(abs(r["counted"][p] / r["estimate"][p] - 1) for r in memory) for p in lesson.PARTS}
check("planner == counted (params, grads, optimizer)", max(worst[p] for p in lesson.PARTS[:3]) == 0, f"max relative error {max(worst[p] for p in lesson.PARTS[:3]):.1e}")
check("planner == counted saved tensors (activations)", worst["activations"] < 1e-3, f"max relative error {worst['activations']:.1e} over {len(memory)} configs")
steps = [(r, s) for r in allocator for s in r["steps"]]
def rel(got, want): return abs(got / want - 1)
err = max(rel(r["after_build"], r["counted"]["params"]) for r in allocator)
check("allocator: building the model leaves the counted parameters", err < 0.01, f"max relative difference {err:.1e} over {len(allocator)} runs (tolerance 1%)")
err = max(rel(s["after_forward"] - s["start"], r["counted"]["activations"]) for r, s in steps)
check("allocator: a forward adds the counted saved tensors", err < 0.01, f"max relative difference {err:.1e} over {len(steps)} steps (tolerance 1%)")
err = max(rel(s["before_optimizer"] - s["start"], r["counted"]["grads"]) for r, s in steps)
check("allocator: after backward a step holds its start + the counted gradients", err < 0.01, f"max relative difference {err:.1e} over {len(steps)} steps (tolerance 1%)")
err = max(rel(r["steps"][0]["end"] - r["steps"][0]["start"], r["counted"]["optimizer"]) for r in allocator)
check("allocator: AdamW's first step leaves the counted optimizer state", err < 0.01, f"max relative difference {err:.1e} over {len(allocator)} runs (tolerance 1%)")
brackets = [(r["counted"]["params"] + r["counted"]["optimizer"] + r["counted"]["activations"], r["steps"][-1]["peak"], r["bound"]) for r in allocator]
check("allocator: P + O + saved <= peak <= peak_bound", all(lo <= pk <= hi for lo, pk, hi in brackets),
      "; ".join(f"{r['recompute']} x{r['grad_acc']}: {lo / MiB:.1f} <= {pk / MiB:.1f} <= {hi / MiB:.1f} MiB" for r, (lo, pk, hi) in zip(allocator, brackets)))
check("recomputation leaves gradients unchanged", max(r["max_grad_diff"] for r in recompute) <= 1e-6, f"max |Δgrad| {max(r['max_grad_diff'] for r in recompute):.1e}")
full = [r for r in recompute if r["recompute"] == "full"]
check("full recomputation keeps 4sbh per layer (+ the rest)", all(abs(r["counted"]["activations"] / r["estimate"]["activations"] - 1) < 1e-3 for r in full),
      f"counted {[r['counted']['activations'] for r in full]} planned {[r['estimate']['activations'] for r in full]}")
acc_ok = max(r["max_grad_diff"] / r["max_grad"] for r in accumulate)
check("grad accumulation == big batch", acc_ok < 1e-5, f"max |Δgrad| / max|grad| = {acc_ok:.1e}")
drop = a1 / accumulate[-1]["counted"]["activations"]
check(f"counted saved tensors drop by m={accumulate[-1]['grad_acc']}", drop > 0.9 * accumulate[-1]["grad_acc"], f"counted drop ×{drop:.2f}")
check("bf16 loss follows fp32", max(val_gaps.values()) < 0.1,
      f"validation loss within 0.1 of fp32's at all {len(val_gaps)} evaluations: max |Δ| {max(val_gaps.values()):.4f} "
      f"(single training batches: max |Δ| {max(step_gaps):.4f}, median {sorted(step_gaps)[len(step_gaps) // 2]:.4f}; section 4e)")
inside = sum(prof["phases"].values())
check("--profile: the phases' ranges fit inside their steps'", inside <= steps_ms,
      f"{inside:.0f} ms of phases in {steps_ms:.0f} ms of steps {prof['steps'][0]}-{prof['steps'][-1]} (section 4h)")
cover = {s: prof["phases_by_step"][str(s)] / prof["metrics_step_ms"][str(s)] for s in prof["steps"]}
check("--profile: the trace's phases are most of metrics.jsonl's step_time, never more", all(0.8 <= c <= 1.01 for c in cover.values()),
      "; ".join(f"step {s}: {prof['phases_by_step'][str(s)]:.1f} of {prof['metrics_step_ms'][str(s)]:.1f} ms ({c:.0%})"
                for s, c in cover.items()) + " (two clocks: the profiler's and perf_counter; tolerance 80% to 101%)")

# %% [markdown]
# **Takeaway:** every memory and gradient claim of the lesson holds as a number, against a formula or another
# measurement; timings on a shared machine are shown, not asserted.
#
# ## 6. Explore
# Pick a model, sequence length, micro-batch, precision, recomputation and attention kernel; the planner redraws one
# device's memory (its count of tensors; section 4b's working set comes on top; widgets need a live kernel). At what
# sequence length does eager attention's $s^2$ term overtake the MLP for SmolLM-1.7B? How large a micro-batch fits
# in 80 GB with full recomputation? Why does nothing help Llama-3-8B?
#
# The widget draws the planner's model of *our* code, not section 1's textbook formula, so its default (SmolLM-1.7B,
# $s$ = 2048, $b$ = 4) differs from the top figure. Model states agree (16 bytes per parameter); activations do not:
# Korthikanti keeps the $s\times s$ scores (his $5as/h$ term), our `sdpa` none, our eager attention more copies, in
# fp32. The line below the cell compares all three.
#
# **Takeaway:** the planner answers "does it fit?" for any model in milliseconds, as long as it models your code.

# %%
def draw(preset="smollm-1.7b", seq_len=2048, micro_batch=4, dtype="bf16", recompute="none", attn="sdpa"):
    mc = dataclasses.replace(ModelConfig.from_preset(preset), attn_impl=attn)
    est = planner.memory_estimate(mc, seq_len, micro_batch, dtype, recompute)
    lesson.plot_estimate({f"{preset} s={seq_len} b={micro_batch}\n{dtype} {recompute} {attn}": est},
                         title=f"planner.memory_estimate: {est['total'] / GB:.1f} GB"); plt.show()

default = dict(preset="smollm-1.7b", s=2048, b=4)
ours = {attn: planner.memory_estimate(dataclasses.replace(ModelConfig.from_preset(default["preset"]), attn_impl=attn),
                                      default["s"], default["b"], "bf16", "none")["total"] for attn in ("sdpa", "eager")}
print(f"SmolLM-1.7B, s=2048, b=4, bf16: section 1's textbook estimate {sum(textbook('smollm-1.7b', 2048, 4).values()) / GB:.1f} GB; "
      f"our code with sdpa {ours['sdpa'] / GB:.1f} GB, with eager attention {ours['eager'] / GB:.1f} GB")
# drawn once with the defaults (what a static viewer shows); in a live kernel, controls that redraw it
_common.interactive(draw, lambda w: dict(
    preset=w.Dropdown(options=["tiny", "smollm-135m", "smollm-360m", "smollm-1.7b", "llama3-8b"], value="smollm-1.7b",
                      description="model"),
    seq_len=w.SelectionSlider(options=[2**k for k in range(7, 15)], value=2048, description="sequence s"),
    micro_batch=w.IntSlider(value=4, min=1, max=64, description="micro-batch b"),
    dtype=w.ToggleButtons(options=["fp32", "bf16"], value="bf16", description="precision"),
    recompute=w.ToggleButtons(options=["none", "selective", "full"], description="recompute"),
    attn=w.ToggleButtons(options=["sdpa", "eager"], description="attention")))

# %% [markdown]
# ## 7. On an 8-GPU node you should see
# This lesson needs one GPU of the node. There the throughput run of 4(f) trains in bf16 at $s$ = 1,024, with the
# SmolLM models added, and the tensor cores set the pace. The planner's time model predicts tokens/s at one kernel
# efficiency (0.6 of the datasheet peak; its MFU is against that peak, not 4(f)'s measured one). The tiny and small
# models it does not predict: their step is kernel launches, which it does not count.

# %%
import _node   # lessons/_node.py: the planner's predictions for one 8×H100 node
_node.show("01_single_device")

# %% [markdown]
# **Takeaway:** the memory model of this lesson holds on a GPU unchanged; speed is the FLOPs over 0.6 of the peak,
# once the model is big enough to keep the GPU busy.
#
# ## 8. Exercises
# Open `lessons/01_single_device/exercise.py` and write:
#
# 1. `count_parameters(cfg)` — the exact parameter count from the shapes (GQA, SwiGLU, tied or untied `lm_head`);
# 2. `model_state_bytes(n_params, dtype, optimizer)` — the textbook bytes of params, grads and optimizer state;
# 3. `activation_bytes_per_layer(cfg, seq_len, micro_batch_size)` — fp32, sdpa or eager; the checker compares it
#    with the saved-tensor count of a real layer;
# 4. `accumulate_gradients(model, input_ids, targets, k)` — gradients equal to the big batch's;
#
# 5. the puzzle, `plan_step(model_config, seq_len, global_batch, budget_bytes)`: one step must fit a memory budget
#    at the highest throughput. Choose the micro-batch size, the gradient accumulation and the recomputation
#    (the docstring gives the rules: the global batch stays, `peak_bound` ≤ budget, the least repeated work wins).
#    The checker tries it on the puzzles below, then runs your choice for real on the CPU: the allocator's peak
#    must fit too, and it measures tokens/s beside the reference choice.
# 6. `phase_ms(trace)` — read a trace that `--profile` wrote (section 4h): each phase's milliseconds, summed over
#    the micro-batches and the profiled steps. The checker gives it a trace with torch's operators inside the phases,
#    metadata and the step ranges, and names the usual slips (microseconds, operators counted, steps counted).
#
# Then run the checker (here, or `./run.sh python lessons/01_single_device/check.py [name]`). Until you write them it
# reports `NotImplementedError: not written yet`; a wrong answer comes with the expected value and the likely mistake.

# %%
import check as checker   # this folder's check.py
for name, settings, s, gb, budget in checker.PUZZLES:
    print(f"puzzle {name + ':':<15} the {checker.model_name(settings)} model, s={s}, global batch {gb} sequences, budget {budget} MiB")

# %%
all_passed = checker.check()

# %% [markdown]
# **Takeaway:** "does it fit, and at what speed?" is a search over micro-batch, accumulation and recomputation that
# the planner answers in milliseconds and one real step confirms.
#
# ## 9. What it costs, when to use it, what comes next
# | tool | saves | costs | use when |
# |---|---|---|---|
# | gradient accumulation ($m$) | activations ÷ $m$ (same global batch) | $m$ smaller, less efficient matmuls; one fp32 gradient buffer | the batch you want does not fit: always the first tool |
# | selective recomputation | the attention core's saves ($s^2$ terms with eager attention) | recomputing the attention core (a few % of a large model's FLOPs; more when $s$ is large against $h$) | no flash kernel, long sequences; with flash/sdpa it is already built in |
# | full recomputation | all but one tensor per layer | one extra forward: $6N \to 8N$ FLOPs | activations dominate even at micro-batch 1 |
# | bf16 autocast | activations (less than 2× here), matmul time on GPUs | nothing on model states; slower on CPUs without bf16 units | always on modern GPUs |
#
# Whatever the tool, plan with the count and leave room for the backward's working set (section 4b).
#
# **Takeaway:** none of these touches the **model states**: 16 bytes per parameter, 128 GB for Llama-3-8B, more than
# one 80 GB GPU. The rest of the course splits the work over devices that must talk: **lesson 02 builds the
# collectives** from point-to-point messages, lesson 03 uses them for data parallelism, and lesson 04 (ZeRO) shards
# the three model-state bars measured here.
