"""Lesson 06's notebook, 06_context_parallel.ipynb, as plain Python in the percent format (see lessons/_notebook.py):
edit this file, never the notebook.

    python lessons/_notebook.py 06_context_parallel --run fast    # rebuild the notebook, execute it in FAST mode
"""

# %% [markdown]
# # Lesson 06 — Context parallelism: cut the sequence
#
# Data, tensor and pipeline parallelism (lessons 03-05, 07) leave the **sequence** whole on every rank. Activations
# grow with it, and at 32k or 128k tokens one sequence's activations no longer fit a GPU, however the model is cut.
# **Context parallelism** cuts the sequence: each of $c$ ranks holds $s/c$ of every sequence's tokens. All of a layer
# but attention works token by token; attention needs every earlier token's key and value, so the ranks pass their
# K/V blocks around a **ring** while they compute, and merge the partial results exactly.
#
# | piece | what it does | where |
# |---|---|---|
# | the log-sum-exp merge | two partial softmax attentions over disjoint key sets → the attention over both, exactly, without overflow | `merge` |
# | ring attention | K/V blocks travel rank → rank + 1, one per step, the next one in flight while the current is computed; backward walks the ring again, dK/dV travelling home | `RingAttention` |
# | zig-zag layout | $2c$ chunks, rank $r$ holds chunks $r$ and $2c-1-r$: under the causal mask every rank does the same work | `chunks_of`, `positions` |
# | all-gather (the baseline, Llama 3's choice) | gather the whole K/V once, attend locally | `allgather_attention` |
# | Ulysses (DeepSpeed's) | all-to-all: $s/c$ tokens of every head → every token of $a/c$ heads; attend locally; back | `ulysses_attention` |
#
# We measure how cp divides the memory; derive the merge and watch the naive one overflow; run the ring by hand;
# measure the causal imbalance and zig-zag's cure; time the ring's transfers under the compute and count its bytes;
# check parity with one process, and the trap of cp without dp; and measure Ulysses, all-to-alls over heads. The
# experiments are `experiment.py` here, launched with `torchrun`; `PICOTRON_FAST=1` gives a short run.

# %%
import sys
import matplotlib.pyplot as plt
import torch
sys.path.insert(0, "..")   # lessons/: the helpers every lesson shares
import _common
from picotron import context_parallel as cpm, planner
from picotron.model import ModelConfig

FAST, OUT = _common.FAST, _common.run_dir("06_context_parallel")
import experiment as lesson   # this folder's experiment.py: its measurements, formulas and plots
MiB, GB = 2**20, 1e9

def run(only, nproc=2, hide=()):
    # torchrun --nproc_per_node nproc lessons/06_context_parallel/experiment.py --out OUT --only <only>
    # prints what it printed, less the training chatter and the lines that start with one of `hide` (rows that the
    # notebook prints itself, with the formula beside them, from the JSON)
    _common.run_experiment("06_context_parallel", only, nproc, hide=_common.TRAINING_CHATTER + hide)

check = _common.check   # prints ✓ or ✗ (or ?, only for a timing check on a machine measured busy) and counts it

st = lesson.settings(FAST)
C = _common.nproc("06_context_parallel", 4)   # the main runs' processes: 4, or 8 with PICOTRON_NPROC=8 (cp = 8)
mc = lesson.model_config(st)
print(f"FAST={FAST}, results in {OUT.relative_to(_common.ROOT)}; model: the lessons' '{st['size']}' one, "
      f"{mc.num_hidden_layers} layers, {mc.num_params() / 1e6:.2f} M parameters, h={mc.hidden_size}, "
      f"{mc.num_attention_heads} query heads over {mc.num_key_value_heads} KV heads of d={mc.head_dim}")

# %% [markdown]
# ## 1. The problem: one sequence that no GPU holds
#
# Per layer, our Llama keeps for backward (fp32, flash-style attention; lesson 01 lists every tensor,
# [reference](../../docs/reference.md#activation-memory); symbols: [notation](../../docs/reference.md#notation))
# $A_\text{layer} = sbh\,(32 + 8a_\text{kv}/a) + 16\,sbh_\text{ff} + sb\,(8 + 4a)$ bytes: **linear in the sequence
# length $s$** and in the micro-batch $b$, already 1 for long sequences. Tensor parallelism divides part of it, ZeRO
# the model states, pipeline parallelism the layers; none divides $s$.
#
# For a real model, the textbook count (Korthikanti et al. 2022, arXiv:2205.05198, §4.1): a GPT layer in 16-bit
# precision keeps $sbh\,(34 + 5as/h)$ bytes; flash attention never stores the $5as^2b$ of scores, leaving $34\,sbh$
# (`planner.korthikanti_bytes_per_layer`). Llama-3-8B by that count (an estimate, not our trainer's bytes), the $L$
# layers' activations alone, per GPU:

# %%
llama8 = ModelConfig.from_preset("llama3-8b")
L8, h8, a8 = llama8.num_hidden_layers, llama8.hidden_size, llama8.num_attention_heads
textbook = lambda s, recompute="selective": L8 * planner.korthikanti_bytes_per_layer(s, 1, h8, a8, recompute)
print(f"Llama-3-8B ({llama8.num_params() / 1e9:.1f} B parameters, L={L8}, h={h8}), 16-bit, flash attention "
      f"(Korthikanti et al.'s 34·sbh per layer), one sequence:")
print(f"{'s':>8} " + " ".join(f"{f'cp={c}':>9}" for c in (1, 2, 4, 8, 16)) + "   (GB of activations per GPU)")
for s in (8192, 32768, 131072):
    print(f"{s:>8} " + " ".join(f"{textbook(s // c) / GB:>9.1f}" for c in (1, 2, 4, 8, 16)))
print(f"per layer at s = 8192: {textbook(8192) / L8 / GB:.2f} GB; with the scores kept (5as²b, no flash attention): "
      f"{textbook(8192, 'none') / L8 / GB:.2f} GB; at s = 131072 full recomputation (each layer's input, 2sbh) "
      f"still keeps {textbook(131072, 'full') / GB:.1f} GB")

# %% [markdown]
# At 128k tokens one sequence needs several 80 GB GPUs' worth of activations; even full recomputation leaves tens of
# GB. Every term grows with $s$, so $c$ ranks holding $s/c$ tokens each keep exactly $1/c$ of it; what does not
# depend on $s$ (in our trainer, autocast's bf16 weight copies) stays whole. Llama 3 405B's 128k-token stage ran with
# $c = 16$, beside tp 8 and pp 16 on 16,384 GPUs (Llama Team 2024, Table 4).
#
# **Measured.** One forward of the small model through `parallelize` and the loader, every tensor autograd saves
# counted (`metrics.ActivationCounter`), at $c = 1, 2, 4$ on 4 processes (the rest: data parallel). The formula
# (`lesson.activation_parts`) is the project's count with $s \to s/c$, plus what cp changes: each rank's ids and
# targets picked out of every row (new tensors); the ring's $[b, a, s/c, d]$ output copied for `o_proj`'s
# $[b, s/c, h]$ ($4bh\,s/c$ per layer); the all-gather's **whole** K and V, and `sdpa`'s fp32 $[s/c, s]$ mask,
# quadratic in $s$. Then the longest sequence that fits a budget, by the formula, checked by measuring it and the
# next length up.

# %%
run("memory", nproc=4)
mem = _common.load_json(OUT / "memory_cp4.json")["results"]
single = {r["s"]: r["measured"] for r in mem["rows"] if r["cp"] == 1}
for r in mem["rows"]:
    print(f"cp={r['cp']} {r['impl']:<9} s={r['s']:<5} {r['measured'] / MiB:8.3f} MiB per rank measured, formula "
          f"{r['formula'] / MiB:8.3f}  ({r['measured'] / single[r['s']]:.3f} of cp=1's)")
lesson.plot_memory(mem); plt.show()

# %%
check("activations per rank = the formula, to the byte", all(r["measured"] == r["formula"] for r in mem["rows"]),
      f"{len(mem['rows'])} (cp, impl, s) cases, ring and all-gather")
check("every rank keeps the same bytes", all(len(set(r["every_rank"])) == 1 for r in mem["rows"]),
      "4 ranks each (their tokens differ, their sizes do not)")
ag = [(r, next(x for x in mem["rows"] if (x["cp"], x["impl"], x["s"]) == (r["cp"], "ring", r["s"])))
      for r in mem["rows"] if r["impl"] == "allgather"]
check("the all-gather keeps more than the ring, and the gap grows faster than s",
      all(a["measured"] > b["measured"] for a, b in ag)
      and all((a2["measured"] - b2["measured"]) / (a1["measured"] - b1["measured"]) > a2["s"] / a1["s"]
              for (a1, b1), (a2, b2) in zip(ag, ag[1:]) if a1["cp"] == a2["cp"]),
      "; ".join(f"cp={a['cp']} s={a['s']}: +{(a['measured'] - b['measured']) / MiB:.2f} MiB" for a, b in ag))
one = next(f for f in mem["fits"] if f["cp"] == 1)
for f in mem["fits"]:
    check(f"budget {f['budget'] / MiB:g} MiB, cp={f['cp']}: the longest s by the formula fits, the next one does not",
          f["at"] <= f["budget"] < f["above"],
          f"s={f['s_max']}: {f['at'] / MiB:.2f} MiB measured; s={f['s_max'] + 2 * f['cp']}: {f['above'] / MiB:.2f} MiB")
    if f["cp"] > 1:
        check(f"cp={f['cp']} holds about cp times cp=1's longest sequence",
              abs(f["s_max"] / one["s_max"] / f["cp"] - 1) < 0.1, f"{f['s_max']} / {one['s_max']} = {f['s_max'] / one['s_max']:.2f}")

# %% [markdown]
# The measurement is the formula to the byte, on every rank: $1/c$ of one process's activations plus the ring's copy
# for `o_proj` (a few percent), so the longest sequence within a budget grows almost $c$-fold. The all-gather's extra
# grows faster than $s$: the whole K/V, and with our `sdpa` call an fp32 $s/c \times s$ mask.
#
# **Takeaway:** activations grow with $s$, and context parallelism is the one cut that divides $s$: per rank
# they fall to about $1/c$.
#
# ## 2. The idea
#
# ### (a) Attention in blocks: the log-sum-exp merge
# A rank holds its queries and, at any moment, one block of keys and values. For one query $\mathbf q$ with scores
# $z_i = \mathbf q \cdot \mathbf k_i / \sqrt d$ against the keys $\mathbf k_i$ (values $\mathbf v_i$), block $j$ gives
# its normalised output and the log-sum-exp of its scores:
#
# $$o_j = \sum_{i \in j} e^{z_i - \ell_j}\, \mathbf v_i, \qquad \ell_j = \log \sum_{i\in j} e^{z_i}.$$
#
# Over all blocks the softmax denominator is $\sum_j e^{\ell_j} = e^{\ell}$, so
#
# $$o = \sum_i e^{z_i - \ell}\, \mathbf v_i = \sum_j e^{\ell_j - \ell} \sum_{i\in j} e^{z_i - \ell_j} \mathbf v_i
# = \sum_j e^{\ell_j - \ell}\, o_j, \qquad \ell = \log \sum_j e^{\ell_j}.$$
#
# Merging two at a time: $\ell = \operatorname{logaddexp}(\ell_1, \ell_2)$ and $o = e^{\ell_1 - \ell}\, o_1 +
# e^{\ell_2 - \ell}\, o_2$: weights at most 1 that sum to 1; $e^{\ell}$ is never formed (FlashAttention's online
# softmax, [reference](../../docs/reference.md#context-parallelism)). The library's `merge`:

# %%
_common.show_source(cpm.merge)
g = torch.Generator().manual_seed(0)
randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
q, k, v = randn(1, 2, 4, 8), randn(1, 2, 12, 8), randn(1, 2, 12, 8)   # 4 queries, 12 keys, 2 heads
whole, lse_whole = cpm.block_forward(q, k, v, causal=False, scale=1.0)
blocks = [cpm.block_forward(q, k[:, :, i:j], v[:, :, i:j], causal=False, scale=1.0)
          for i, j in ((0, 5), (5, 9), (9, 12))]   # the keys in three blocks
o, lse = None, None
for ob, lb in blocks:
    o, lse = cpm.merge(o, lse, ob, lb)
err = max((o - whole).abs().max().item(), (lse - lse_whole).abs().max().item())
check("three key blocks merged = softmax attention over all 12 keys (float64)", err < 1e-12, f"max |difference| {err:.1e}")

# %% [markdown]
# **Why not merge with $e^{\ell_j}$ directly?** $o = (e^{\ell_1} o_1 + e^{\ell_2} o_2)/(e^{\ell_1} + e^{\ell_2})$ is the
# same in exact arithmetic, but fp32 overflows past $e^{88.7}$. Scores that large happen (a query aligned with a key
# of norm 30 in 64 dimensions is enough); here they are near 1000:

# %%
qb = torch.ones(1, 1, 2, 8)
kb, vb = torch.full((1, 1, 6, 8), 125.0) + torch.randn(1, 1, 6, 8, generator=g), torch.randn(1, 1, 6, 8, generator=g)
ref, ref_lse = cpm.block_forward(qb.double(), kb.double(), vb.double(), causal=False, scale=1.0)
a_, b_ = (cpm.block_forward(qb, kb[:, :, i:j], vb[:, :, i:j], causal=False, scale=1.0) for i, j in ((0, 3), (3, 6)))
naive, naive_lse = lesson.naive_merge(*a_, *b_)
good, good_lse = cpm.merge(*a_, *b_)
print(f"scores {(qb @ kb.transpose(-2, -1)).min():.0f}..{(qb @ kb.transpose(-2, -1)).max():.0f}; fp32's largest "
      f"finite e^x: x = {torch.log(torch.tensor(torch.finfo(torch.float32).max)):.1f}")
print(f"naive merge: out {naive[0, 0, 0, :3].tolist()}, lse {naive_lse[0, 0].tolist()}")
print(f"logaddexp merge: out {[round(x, 4) for x in good[0, 0, 0, :3].tolist()]}, lse "
      f"{[round(x, 3) for x in good_lse[0, 0].tolist()]}")
check("the naive merge overflows (inf / inf = nan)", not torch.isfinite(naive).any(), "every output element nan")
rel = ((good.double() - ref).abs().max() / ref.abs().max()).item()
check("the log-sum-exp merge stays finite and right in fp32", bool(torch.isfinite(good).all()) and rel < 1e-4,
      f"max |difference| to float64 {rel:.1e} of the largest output (fp32 rounds lse ~ 1000 to 6e-5, the weights "
      f"e^(lse_i - L) inherit it)")

# %% [markdown]
# ### (b) The ring, step by step
# Cut the sequence into $2c$ chunks; each rank holds two (which two: part (c)) and keeps its queries. At each step
# it computes with the K/V block it holds while sending it to rank $r+1$ and receiving the next from rank $r-1$;
# after step $j$ it has seen the K/V of ranks $r, r-1, \dots, r-j$, after $c$ steps all of them. Each (query chunk, key chunk) pair is one block: a key chunk *before* the
# query chunk is seen whole (`all`), the chunk itself under the causal mask (`causal`, step 0 only), a chunk *after*
# it not at all (`none`: skipped). `lesson.ring_by_hand` runs this in one process with the library's `block_forward`
# and `merge` (the ring without its messages), $c = 4$, zig-zag:

# %%
cp = 4
q, k, v = randn(1, 4, 32, 8), randn(1, 2, 32, 8), randn(1, 2, 32, 8)   # 32 tokens, 4 query heads over 2 KV heads
full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
for layout in cpm.LAYOUTS:
    out, log = lesson.ring_by_hand(q, k, v, cp, layout)
    if layout == "zigzag":
        for step in range(cp):
            print(f"step {step}: " + " | ".join(
                f"r{r} has K/V of r{(r - step) % cp}: " + " ".join(f"({qc},{kc}){seen[0]}" for qc, kc, seen in log[(r, step)])
                for r in range(cp)))
        print("(q chunk, k chunk) a = all, c = causal, n = none (skipped)")
    check(f"the ring by hand, cp={cp}, {layout}: every rank's output = its piece of full causal attention (float64)",
          (out - full).abs().max() < 1e-12, f"max |difference| {(out - full).abs().max():.1e}")
seen = [(qc, kc) for (r, step), blocks in log.items() for qc, kc, s in blocks if s != "none"]
check("over the ring, every (query chunk, key chunk) pair with key <= query is computed once, and nothing else",
      sorted(seen) == sorted((qc, kc) for qc in range(2 * cp) for kc in range(qc + 1)),
      f"{len(seen)} blocks = {2 * cp} x {2 * cp + 1} / 2")

# %% [markdown]
# Backward walks the ring again ([reference](../../docs/reference.md#context-parallelism)): with the *final*
# log-sum-exp $\ell$ and $\delta = \operatorname{rowsum}(dO \circ O)$ each block's share of the gradient is known alone
# ($P = e^{S - \ell}$, $dS = P \circ (dO\,V^\top - \delta)$), so $dQ$ accumulates at home while each block's $dK, dV$ travel
# with it, every rank adding its part, and arrive at their owner after a full turn.
#
# ### (c) Causal imbalance, and the zig-zag layout
# Under the causal mask the last tokens attend to everything, the first to almost nothing. Cut in order (rank $r$
# holds chunks $2r$ and $2r+1$, the **contiguous** layout) and rank 0 only ever sees its own block, rank $c-1$
# everything. The **zig-zag** layout gives rank $r$ chunks $r$ and $2c-1-r$, one early and one late: equal work.
# Blocks over a whole ring (a causal block costs about half a whole one in a kernel that skips the masked half, the
# reference's count; ours masks a whole block, so it counts one):

# %%
print(f"{'cp':>3} {'layout':<11} {'blocks per rank (causal = 1)':<34} {'max/min':>8}   "
      f"{'work per rank (causal = 1/2)':<30} {'max/min':>8}")
for c in (2, 4, 8):
    for layout in cpm.LAYOUTS:
        w1 = [lesson.pairs(r, c, layout) for r in range(c)]
        w2 = [lesson.pairs(r, c, layout, 0.5) for r in range(c)]
        print(f"{c:>3} {layout:<11} {str([int(x) for x in w1]):<34} {max(w1) / min(w1):>8.2f}   {str(w2):<30} "
              f"{max(w2) / min(w2):>8.2f}")
check("zig-zag: every rank computes the same blocks' worth, any cp", all(
    len({lesson.pairs(r, c, "zigzag", w) for r in range(c)}) == 1 for c in range(1, 9) for w in (0.5, 1.0)), "cp = 1..8")
check("contiguous: rank r computes 4r + 3 blocks (4r + 2 with causal = 1/2): the slowest / fastest is 2cp - 1 at best",
      all(lesson.pairs(r, c, "contiguous") == 4 * r + 3 and lesson.pairs(r, c, "contiguous", 0.5) == 4 * r + 2
          for c in range(1, 9) for r in range(c)), "cp = 1..8")

# %% [markdown]
# The ranks exchange blocks at every step, so contiguous runs at its last rank's pace. Zig-zag costs nothing: the
# loader hands each rank its tokens with their true positions (`positions`) for RoPE, and the ring never knows.
#
# **Takeaway:** partial attentions merge exactly through their log-sum-exps; a ring of $c$ steps brings every
# block to every rank; zig-zag makes the causal work equal.
#
# ## 3. Read the code
#
# `picotron/context_parallel.py`. Which tokens a rank holds (the loader picks `positions` out of every row, in
# `picotron/train.py`'s `load_data`):

# %%
_common.show_source(cpm.chunks_of)
_common.show_source(cpm.positions)
_common.show_source(cpm.visibility)

# %% [markdown]
# One block (scores in fp32, query heads grouped over their KV head so K/V are never repeated), and the ring's
# forward: the next K/V block is started before this step's blocks are computed, and waited for after. `phases`
# names each step's compute and each wait; section 4 listens with a timeline (`core.phases.listen(timeline.record)`).

# %%
_common.show_source(cpm.block_forward, "b, a, cq, d", "return out.reshape")
_common.show_source(cpm.RingAttention._forward, "ring, mine", "ctx.save_for_backward")

# %% [markdown]
# The exchange: a send to the next rank and a receive from the previous, posted as one batch
# (`picotron.p2p.exchange`, a `batch_isend_irecv`): on NCCL two single messages could each wait for the other's
# partner (lesson 02 replays that under NCCL's rules). It goes through the cp axis (`Axis.exchange`), which reports
# every byte sent to a recorder when one is attached:

# %%
_common.show_source(cpm._Ring.start)

# %% [markdown]
# The backward: the K/V blocks turn again; each step adds this rank's share to the held block's gradient (`dkv`),
# which travels with it home:

# %%
_common.show_source(cpm.RingAttention._backward, "for step in range(n):", "dkv = ring.finish(dkv_pending, n")

# %% [markdown]
# Wiring it in: `apply` swaps every layer's attention core (RoPE at the true positions, then ring or all-gather);
# `parallelize` averages gradients over **dp × cp** (`mesh.dp_cp`): cp ranks hold the same weights but see different
# tokens (section 5: what happens otherwise).

# %%
_common.show_source(cpm.ContextParallelAttention.forward)
_common.show_source(cpm.bytes_per_step_formula, "block = ")

# %% [markdown]
# **Takeaway:** a block is a few matmuls and a log-sum-exp; the ring is a loop that starts the next exchange
# before computing; the backward is the same loop with gradients riding along.
#
# ## 4. Run it
#
# ### (a) Causal balance, measured on 2 and 4 processes
# The attention core alone (8 query heads over 4 KV heads, $d = 32$), forward and backward, 2048 tokens, each layout
# in turn, several repeats, each ring step's compute an event on a timeline. At $c = 4$ four processes share two
# cores, so the events also carry the **CPU time** the rank used (which waiting does not inflate), and each rank's
# time is the least over the repeats. Prediction: section 2(c)'s block counts weighted by what a whole and a causal
# block cost, read off zig-zag's own steps (after the first, two whole blocks; step 0, two causal and one whole).

# %%
run("balance,train,parity", nproc=2)   # this section's runs and the next one's (section 5: parity)
run("balance,train,parity", nproc=C)
bal = {c: _common.load_json(OUT / f"balance_cp{c}.json")["results"] for c in (2, C)}
for c, res in bal.items():
    print(f"cp={c}: a whole block {1e3 * res['t_all']:.1f} ms, a causal one {1e3 * res['t_causal']:.1f} ms (CPU, "
          f"forward + backward)")
    for layout, r in res["layouts"].items():
        print(f"  {layout:<11} per rank {[round(1e3 * x) for x in r['per_rank']['cpu']]} ms: max/min {r['ratio']:.2f}; "
              f"predicted {r['predicted_costs']:.2f} (blocks {r['predicted']:.2f}, with causal = 1/2 "
              f"{r['predicted_ideal']:.2f}); a call takes {1e3 * max(r['per_rank']['call']):.0f} ms (median)")
lesson.plot_balance([bal[2], bal[C]]); plt.show()

# %%
for c, res in bal.items():
    zz, co = res["layouts"]["zigzag"], res["layouts"]["contiguous"]
    others = f"; other programs used {res['busy']:.0%} of the cores"
    busy = _common.busy_reason(res["busy"], what="during the calls (median)")
    near = 1.35 if c == 2 else 1.5  # four processes on two cores: more noise
    check(f"cp={c}: zig-zag balances the ranks (attention max/min near 1)", zz["ratio"] <= near,
          f"max/min {zz['ratio']:.2f} (the blocks predict 1; this shared machine's noise: up to {near}){others}", busy)
    far = 1.5 if c == 2 else 2.2
    check(f"cp={c}: contiguous does not (max/min far from 1)", co["ratio"] >= far,
          f"max/min {co['ratio']:.2f} (>= {far}; predicted {co['predicted_costs']:.2f}, blocks {co['predicted']:.2f})"
          f"{others}", busy)
    t = co["per_rank"]["cpu"]
    check(f"cp={c}, contiguous: the attention time grows with the rank (rank r: 4r + 3 blocks)",
          all(a < b for a, b in zip(t, t[1:])), " < ".join(f"{1e3 * x:.0f}" for x in t) + f" ms{others}", busy)

# %% [markdown]
# Zig-zag's ranks do the same work; contiguous's grows with the rank, and its slowest sets the pace. Here a causal
# block is *dearer* than a whole one (the same matmuls plus the mask), so the ratio sits below the textbook's
# $2c - 1$, which assumes a kernel that skips the masked half. On 2 shared cores even CPU time is not immune (a
# neighbour in a core's caches slows a rank): the contiguous ratio moves by a few tenths around the prediction, and
# more at $c = 4$ (zig-zag's equal ranks can differ by a third there); the ranks' order and the imbalance's size do
# not. The experiment reads other programs' share of the cores (`_common.LoadWindow`, from `/proc/stat`), and a
# timing check that misses while they held over 10% prints **?** (inconclusive, rerun) instead of ✗. Counts of
# blocks and bytes are ✓ or ✗, busy or not.
#
# ### (b) The timeline: K/V transfers under the compute
# The quietest repeat at $c = 2$: each ring step's compute (forward, then backward), the waits, and in grey each K/V
# block from the start of its send (before the step's compute) to its wait (after).

# %%
lesson.plot_ring_timeline(bal[2]); plt.show()
r2 = bal[2]
for layout, r in r2["layouts"].items():
    w = r["per_rank"]
    print(f"{layout:<11} waits per rank (median): for K/V {[round(1e3 * x, 1) for x in w['wait_kv']]} ms, for dK/dV "
          f"{[round(1e3 * x, 1) for x in w['wait_dkv']]} ms; compute {[round(1e3 * x) for x in w['wall']]} ms")
flops = 2 * mc.num_attention_heads * (r2["s"] // 2) / (mc.num_key_value_heads * 4)
print(f"one K/V block ({r2['block_bytes'] / 1024:.0f} KiB) exchanged alone takes {1e3 * r2['exchange_alone_s']:.2f} ms; "
      f"one whole block's compute {1e3 * r2['t_all']:.0f} ms (forward + backward); FLOPs per byte sent "
      f"2a(s/c)/(a_kv·4) = {flops:.0f}")

# %%
zz = r2["layouts"]["zigzag"]["per_rank"]
hidden = max(zz["wait_kv"])
check("cp=2, zig-zag: the K/V transfers hide under the compute", hidden <= 0.25 * 2 * (r2["cp"] - 1) * r2["exchange_alone_s"]
      or hidden <= 0.01 * max(zz["wall"]),
      f"the ranks waited at most {1e3 * hidden:.2f} ms for K/V in a forward + backward, against "
      f"{2 * (r2['cp'] - 1)} exchanges x {1e3 * r2['exchange_alone_s']:.2f} ms alone; other programs used "
      f"{r2['layouts']['zigzag']['busy']:.0%} of the cores", _common.busy_reason(r2["layouts"]["zigzag"]["busy"]))

# %% [markdown]
# The K/V arrive long before they are needed (a block moves in about a millisecond; computing with it takes tens).
# A block carries $2a(s/c)/(a_\text{kv} \cdot 4)$ FLOPs of attention per byte sent, growing with the tokens per rank:
# long sequences, where cp is needed, are where the ring hides its traffic. The waits that remain are ranks waiting
# for *each other*: small in zig-zag; in contiguous, rank 0 finishes its forward early and waits in backward for the
# dK/dV of the block rank 1 is still working on.
#
# ### (c) Bytes per step: counted against the formula
# Training steps at $c = 2$ and $c = 4$ (section (d)), a recorder counting what the attention cores sent along cp
# (`lesson.SentBytes`). A block is one rank's K and V: $2\,b\,a_\text{kv}\,(s/c)\,d$ numbers (only the KV heads
# travel: grouped-query attention pays $a/a_\text{kv}$ times less). Per layer and step each rank sends, ring: $c-1$
# blocks forward, $c-1$ again in backward, and $c$ dK/dV blocks (fp32); all-gather: $c-1$ in the gather, $c-1$ in
# its backward's reduce-scatter.

# %%
trn = {c: _common.load_json(OUT / f"train_cp{c}.json")["results"] for c in (2, C)}
for c, res in trn.items():
    block = res["rows"]["ring, zigzag"]["formula_parts"]["block"]
    print(f"cp={c}, s={res['s']}, b={res['b']}, a_kv={res['kv_heads']}, d={res['head_dim']}, {res['layers']} layers: one "
          f"block {block / 1024:.0f} KiB")
    for name, r in res["rows"].items():
        per = r["sent"][0][-1]
        print(f"  {name:<17} rank 0 sent {per['kv'] / MiB:.3f} MiB of K/V blocks + {per['dkv'] / MiB:.3f} MiB of "
              f"their gradients = {(per['kv'] + per['dkv']) / MiB:.3f} MiB; formula {r['formula'] / MiB:.3f} MiB = "
              f"{r['formula'] // block // res['layers']} blocks per layer")
for c, res in trn.items():
    rows = res["rows"].values()
    check(f"cp={c}: bytes sent per step = bytes_per_step_formula, every variant, rank and step",
          all(x["kv"] + x["dkv"] == r["formula"] for r in rows for rank in r["sent"] for x in rank),
          f"{len(res['rows'])} variants x {c} ranks x {len(next(iter(rows))['sent'][0])} steps")
for c, res in bal.items():
    want = cpm.bytes_per_step_formula(c, res["b"], res["s"], mc.num_key_value_heads, mc.head_dim, layers=1)
    got = res["layouts"]["zigzag"]["bytes"]
    check(f"cp={c}: the balance run's core (one layer, the last call) sent the formula's bytes", got["kv"] + got["dkv"] == want,
          f"{(got['kv'] + got['dkv']) / MiB:.2f} MiB")

# %% [markdown]
# The ring sends $3c - 2$ blocks per layer where the all-gather sends $2(c - 1)$: its backward walks the ring again
# rather than keeping every block, and returns fp32 gradients. The all-gather pays in memory: all $c$ blocks at once.
#
# ### (d) Throughput: ring against all-gather
# The same training step (the small model, the train settings' $s$, $b = 2$), the three variants in turn, the median
# step.

# %%
for c, res in trn.items():
    print(f"cp={c} ({c} processes), s={res['s']}: " + "; ".join(
        f"{name} {r['tokens_per_s']:.0f} tokens/s (median {1e3 * r['step_s']:.0f} ms, steps {1e3 * min(r['times']):.0f}-"
        f"{1e3 * max(r['times']):.0f} ms)" for name, r in res["rows"].items()))
lesson.plot_throughput([trn[2], trn[C]]); plt.show()

# %% [markdown]
# Step times here vary by tens of percent (the range is printed; FAST runs two steps of each): only large differences
# mean something. The all-gather tends to win: after one collective it calls PyTorch's fused attention, while our ring
# computes each block with plain matmuls in Python, a handicap of this implementation, not of the ring. The ring's
# advantage is memory: two K/V blocks at most, where the all-gather holds all $c$ (and here an $s/c \times s$ mask).
#
# Zig-zag against contiguous: a step also runs everything else, which cp divides evenly, so (a)'s balance shows less
# than the noise here; (a)'s per-rank time is the clean measure. $c = 4$ times are not a scaling result (four
# processes, two cores). On GPUs, with a flash kernel per block and NVLink, the ring's transfers hide once the tokens
# per rank are enough; Llama 3 chose the all-gather because it handles any attention mask (packed documents) simply,
# and with grouped-query attention K and V are small next to Q (Llama Team 2024, §3.3).
#
# **Takeaway:** zig-zag balances the ranks; the transfers hide under the compute; the bytes are exactly the
# formula's; the ring buys memory with a few more bytes than the all-gather.
#
# ## 5. Check it: context parallelism trains like one process
#
# `picotron.train` with `--cp 2` (zig-zag, contiguous, all-gather) on 2 processes, and `--cp 4` and `--cp 2 --dp 2`
# on 4, against one process with the same global batch, fp32, same seed: per-step losses within $10^{-5}$
# relative over the first 10 steps, the [parity standard](../../docs/reference.md#parity-standard) (full settings
# train 20 steps; after step 10, drift against $10^{-3}$, lesson 03 section 5). Rank 0 trains the references alone;
# the runs were launched in section 4.
#
# **The trap.** With dp = 1 it is tempting to skip the gradient all-reduce. But each cp rank's gradient is that of
# *its tokens'* loss only; picotron averages over dp × cp (`mesh.dp_cp`), also at dp = 1. The last run does what a
# trainer averaging over dp only would do at dp = 1 (`lesson.not_averaged_over_cp`: no sync at all).

# %%
par = {c: _common.load_json(OUT / f"parity_cp{c}.json")["results"] for c in (2, C)}
pairs, spread = {}, {}
for c, res in par.items():
    for label, losses in res["losses"].items():
        pairs[label] = (losses, res["reference"]["dp=2" if "dp=2" in label else "dp=1"])
        spread[label] = res["spread"][label]
for label, (got, want) in pairs.items():
    p_ = _common.parity(got, want)
    print(f"{label:<17} vs 1 process: max relative loss difference over steps 1-{p_['window']} {p_['worst']:.1e}"
          + (f", over steps {p_['window'] + 1}-{p_['n_steps']} {p_['beyond']:.1e}" if p_["n_beyond"] else "")
          + f"; replicas differ by up to {spread[label]:.1e}")
lesson.plot_parity(pairs); plt.show()

# %%
for label, (got, want) in pairs.items():
    if label == "not averaged":
        continue
    for line in _common.parity_checks(label, got, want):
        check(*line)
    check(f"{label}: every rank holds the same weights after training", spread[label] == 0.0,
          f"max |difference| {spread[label]}")
bad = _common.parity(*pairs["not averaged"])
check("not averaged over cp (dp = 1): the parity check catches it", not bad["ok"] and bad["first_over"] is not None,
      f"step 1 agrees (the log averages the loss), then step {bad['first_over']} differs by "
      f"{_common.rel_diffs(*pairs['not averaged'])[bad['first_over'] - 1]:.1e}, the worst of steps 1-10 "
      f"{bad['worst']:.1e}")
check("not averaged over cp: the two ranks' weights drift apart", spread["not averaged"] > 1e-3,
      f"max |difference| {spread['not averaged']:.1e} after {len(pairs['not averaged'][0])} steps")

# %% [markdown]
# Every layout and both implementations agree with one process to rounding (blocks merge in a different order than
# one softmax, hence the last digits). Without the average over cp, step 1's *logged* loss still agrees (the mean of
# the ranks' losses), but each rank steps with half the picture: the ranks' weights part, and the loss leaves the
# reference at step 2. The suite keeps this trap closed
# (`tests/test_context_parallel.py::test_the_parity_check_catches_gradients_not_averaged_over_cp`).
#
# **Takeaway:** context parallelism is the same training; its gradients are averaged over dp × cp, always.
#
# ## 6. Explore: the ring, step by step, for any cp and layout
#
# The query chunk × key chunk grid of causal attention: at the chosen ring step each block is coloured by the rank
# computing it (hatched: the causal diagonal), pale if computed at another step, white if skipped. Right: each rank's
# blocks over the ring. At $c = 8$, contiguous, how many steps does rank 0 idle? In zig-zag, why does each rank
# compute exactly two whole blocks at every step after the first? Which step computes the diagonal? (Widgets need a
# live kernel.)

# %%
def draw(cp=4, layout="zigzag", step=1):
    step = min(step, cp - 1)
    lesson.plot_widget(cp, layout, step); plt.show()
    for r in range(cp):
        blocks = lesson.step_blocks(r, step, cp, layout)
        print(f"rank {r}: holds queries of chunks {cpm.chunks_of(r, cp, layout)} and the K/V of rank {(r - step) % cp} "
              f"(chunks {cpm.chunks_of((r - step) % cp, cp, layout)}): computes "
              + (", ".join(f"({qc},{kc}) {seen}" for qc, kc, seen in blocks) if blocks else "nothing (waits)"))

_common.interactive(draw, lambda w: dict(cp=w.IntSlider(value=4, min=1, max=8, description="cp"),
                                         layout=w.Dropdown(options=list(cpm.LAYOUTS), value="zigzag"),
                                         step=w.IntSlider(value=1, min=0, max=7, description="ring step")))

# %% [markdown]
# **Takeaway:** the ring visits every block of the causal triangle exactly once; zig-zag spreads them evenly.
#
# ## 7. Another way: Ulysses, an all-to-all from tokens to heads
#
# The ring moves K/V. **Ulysses** (DeepSpeed-Ulysses, Jacobs et al. 2023,
# [arXiv:2309.14509](https://arxiv.org/abs/2309.14509) §3) changes *what is split* during attention: heads are as
# independent as tokens are in the MLP. Each rank computes q, k, v for its $s/c$ tokens and all heads; an
# **all-to-all** sends head group $j$ to rank $j$, which then holds the *whole sequence* of $a/c$ heads and runs
# ordinary causal attention (any kernel); a fourth all-to-all turns the output back into $s/c$ tokens of all heads for
# o_proj. Four all-to-alls forward (q, k, v, out), four backward (an all-to-all's gradient is the inverse
# all-to-all). `picotron --cp-impl ulysses`, `ulysses_attention` in `picotron/context_parallel.py`.
#
# In an all-to-all a rank keeps $1/c$ of its buffer and sends the rest. Per layer and step each rank sends
#
# $$B_{\text{Ulysses}} = 2 \cdot (2a + 2a_\text{kv}')\, b\, \tfrac{s}{c}\, d \cdot \tfrac{c-1}{c} \cdot 4 \text{ bytes}
# \qquad\text{against}\qquad B_{\text{ring}} = (3c - 2) \cdot 2\, b\, a_\text{kv}\, \tfrac{s}{c}\, d \cdot 4,$$
#
# ($a_\text{kv}'$: the KV heads sent, below). At fixed tokens per rank (twice the sequence, twice the ranks), Ulysses'
# bytes per rank approach a constant, $2(2a + 2a_\text{kv}') b (s/c) d$, while the ring's grow with $c$. (The paper
# counts the same: a message of $M$ over $c$ ranks costs each link $M/c$.) Ulysses also sends q and the output, so
# with few KV heads and small $c$ the ring can send less; and Ulysses cannot hide its traffic: attention waits for
# the all-to-all.
#
# **The limit.** Each rank attends with $a/c$ whole heads, so $c$ must divide the query heads (per tp rank, with tp);
# `picotron` refuses any other $c$ in one sentence. With fewer KV heads, picotron *replicates* each to
# $a_\text{kv}' = \mathrm{lcm}(a_\text{kv}, c)$ heads so every rank receives those its query heads read (DeepSpeed's
# uneven-head variant is another answer). No more ranks than heads; the ring has no such limit. With zig-zag the
# gathered sequence arrives in layout order; picotron puts it in position order for the causal attention and back.
#
# The measurement: training steps on 4 processes, $c = 2$ (× dp 2) and $c = 4$, the same $s/c$ tokens per rank, ring
# and Ulysses (zig-zag) in turn; the recorder counts every all-to-all's buffer on the cp axis (`lesson.SentBytes`),
# `metrics.ActivationCounter` the bytes one forward keeps.

# %%
run("ulysses", nproc=C, hide=("cp=",))   # cp = 2 (x dp = 2) and cp = 4 on the same 4 processes (and 8 on 8); rows below
uly = _common.load_json(OUT / f"ulysses_cp{C}.json")["results"]["runs"]
for res in uly:
    print(f"cp={res['cp']} x dp={res['dp']}, s={res['s']} ({res['s'] // res['cp']} tokens per rank), b={res['b']}, "
          f"a={res['heads']}, "
          f"a_kv={res['kv_heads']}, d={res['head_dim']}, {res['layers']} layers; other programs used {res['busy']:.0%} "
          f"of the cores")
    for impl, r in res["rows"].items():
        sent = r["sent"][0][-1]
        print(f"  {impl:<8} rank 0 sent {sum(sent.values()) / MiB:.3f} MiB per step (formula {r['formula'] / MiB:.3f});"
              f" one forward keeps {r['activations'][0] / MiB:.2f} MiB; median step {1e3 * r['step_s']:.0f} ms "
              f"(steps {1e3 * min(r['times']):.0f}-{1e3 * max(r['times']):.0f} ms)")
    fwd = res["rows"]["ulysses"]["buffers"][0][-1]["a2a forward"] // res["layers"]
    print(f"  ulysses: the four forward all-to-alls of a layer carry {fwd / 1024:.0f} KiB of buffers (formula "
          f"(2a + 2a_kv')·b·(s/c)·d·4 = {res['forward_formula'] / 1024:.0f} KiB), of which (c-1)/c leave the rank")
lesson.plot_ulysses(uly); plt.show()

# %%
for res in uly:
    c, L, u, r = res["cp"], res["layers"], res["rows"]["ulysses"], res["rows"]["ring"]
    check(f"cp={c}: Ulysses' forward all-to-alls per layer = (2a + 2a_kv')·b·(s/c)·d·4 bytes, every rank and step",
          all(step["a2a forward"] == L * res["forward_formula"] for rank in u["buffers"] for step in rank),
          f"{u['buffers'][0][-1]['a2a forward'] // L} bytes per layer, formula {res['forward_formula']}")
    check(f"cp={c}: bytes sent per step = bytes_per_step_formula, Ulysses and the ring, every rank and step",
          all(sum(step.values()) == x["formula"] for x in (u, r) for rank in x["sent"] for step in rank),
          f"Ulysses {u['formula'] / MiB:.3f} MiB, ring {r['formula'] / MiB:.3f} MiB")
    mem = u["activations"][0] / r["activations"][0]
    if res["kv_heads"] % c:  # cp = 8 (PICOTRON_NPROC=8): more ranks than KV heads
        print(f"cp={c}: Ulysses keeps {mem - 1:+.1%} more than the ring: it repeats the {res['kv_heads']} KV heads to "
              f"{planner.ulysses_kv_heads(res['kv_heads'], c)}, kept for backward; the 2% check is for a cp that "
              f"divides them: skipped")
        continue
    check(f"cp={c}: Ulysses keeps the ring's activation memory (within 2%)", abs(mem - 1) <= 0.02,
          f"{u['activations'][0] / MiB:.2f} MiB against {r['activations'][0] / MiB:.2f} MiB ({mem - 1:+.2%})")
grow = [sum(res["rows"][i]["sent"][0][-1].values()) for res in uly for i in ("ring", "ulysses")]  # measured, rank 0
check("same tokens per rank, cp 2 -> 4: the ring's bytes per rank grow by (3·4-2)/(3·2-2) = 2.5x, Ulysses' by "
      "(3/4)/(1/2) = 1.5x", grow[2] / grow[0] == 2.5 and grow[3] / grow[1] == 1.5,
      f"measured: ring {grow[2] / grow[0]:.2f}x, Ulysses {grow[3] / grow[1]:.2f}x")

# %% [markdown]
# The all-to-alls carry exactly the formula's bytes; with the same tokens per rank the ring's traffic grows with $c$
# while Ulysses' levels off at $(2a + 2a_\text{kv}') b (s/c) d$ per direction: at $c = 4$ it already sends less than
# half the ring's. Activation memory is the same: the ring's $s/c$ tokens of $a$ heads are as many numbers as
# Ulysses' $s$ tokens of $a/c$ heads (Ulysses' whole-sequence K/V, like the ring's two blocks, is transient).
#
# Step times here (four processes on two cores) say little: Ulysses calls PyTorch's fused attention once where our
# ring works block by block in Python. On GPUs the choice is bandwidth and heads: Ulysses over a fast, fully
# connected link (NVLink in a node) with $c \le$ the heads; the ring across nodes, for more ranks than heads, where
# its transfers hide under long blocks. The two compose (USP, Fang & Zhao 2024,
# [arXiv:2405.07719](https://arxiv.org/abs/2405.07719)): Ulysses inside the node, the ring across.
#
# **Takeaway:** Ulysses swaps "every head, some tokens" for "some heads, every token" with an all-to-all; its bytes
# per rank stay flat as $c$ grows with the sequence, and $c$ can be no larger than the heads.
#
# ## 8. On an 8-GPU node you should see
#
# On a node each rank has a GPU of its own, and K/V blocks travel over NVLink (about 450 GB/s a direction) instead of
# through shared memory. `PICOTRON_NPROC=8` runs sections 4, 5 and 7 at $c = 8$. The planner predicts, for the train run
# at GPU size ($s$ = 4,096): the ring hidden under the attention, Ulysses' all-to-alls exposed, zig-zag exactly balanced.

# %%
import _node   # lessons/_node.py: the planner's predictions for one 8×H100 node, and the command that measures them
_node.show("06_context_parallel")

# %% [markdown]
# **Takeaway:** over NVLink at $s$ = 4,096 the ring costs bytes, not time; Ulysses pays its all-to-alls in full. A
# model this small spends much of a GPU step launching kernels, which the planner does not count: its times are floors.
#
# ## 9. Exercises
# Open `lessons/06_context_parallel/exercise.py`:
#
# 1. `merge(out, lse, out_b, lse_b)`: the log-sum-exp merge, against softmax attention over all keys (two and three
#    blocks, float64); the checker names the usual mistakes (the plain sum or mean, the max of the lse's, the weights
#    swapped) and the first wrong value, feeds scores near 1000 in fp32 (where $e^{\ell}$ overflows), then runs
#    picotron's ring on 2 and 3 processes with your merge and names the rank whose output differs.
#
# 2. `zigzag_positions(seq_len, cp, rank)`: the positions a rank holds (RoPE's input); the checker names the rank
#    and position, and recognises the contiguous layout and chunks in the wrong order.
#
# 3. `step_blocks(rank, step, cp)`: which (query chunk, key chunk) blocks a rank computes at a ring step, whole or
#    causal; the checker names the rank, step and block, a ring turning the wrong way, a diagonal block computed
#    whole, a block from the future.
#
# 4. `heads_send_buffer(x, cp)`: Ulysses' send side (section 7), this rank's tokens of all heads cut into one head
#    group per destination; the checker plays the all-to-all between simulated ranks and names the rank axis not
#    first, a reshape with no transpose (it cuts the batch), heads taken every $c$-th.
#
# Until you write them, the checker reports `NotImplementedError: not written yet`:

# %%
import check as checker   # this folder's check.py
all_passed = checker.check()
_common.summary()   # this notebook's own checks, counted: ✓, ? and ✗

# %% [markdown]
# **Takeaway:** the merge is two weights that sum to 1; the layout is an index map; a ring step is "whose K/V do I
# hold, and which of its chunks can my queries see".
#
# ## 10. What it costs, when to use it, what comes next
#
# | | per rank | communication | use it when |
# |---|---|---|---|
# | context parallel, ring, $c$ ranks | $1/c$ of every sequence's activations (plus a block in flight); the whole model | per layer $3c - 2$ K/V blocks of $2ba_\text{kv}(s/c)d$, point to point, overlapped with attention | sequences too long for one GPU's activations even with recomputation; transfers hide when $s/c$ is a few thousand tokens |
# | context parallel, all-gather | $1/c$, but the whole K/V (and a mask) for a moment | $2(c-1)$ blocks in collectives, not overlapped | K/V are small (grouped-query attention, few KV heads) and the link is fast |
# | + zig-zag | the same | the same | always with causal attention: it costs nothing |
# | context parallel, Ulysses | $1/c$; the whole sequence of $a/c$ heads inside attention | per layer 8 all-to-alls, $2(2a + 2a_\text{kv}')b(s/c)d \cdot \frac{c-1}{c}$ numbers sent, not overlapped | a fast all-to-all (inside a node), $c \le$ the (per-tp-rank) query heads |
#
# **Its costs.** Gradients are averaged over dp × cp. The ring's transfers hide only while a block's attention
# outlasts its transfer, so $s/c$ must stay large. Every rank holds the whole model: cp combines with tp, pp and
# ZeRO, not instead of them. Document masking (several documents in one sequence) breaks zig-zag's balance.
#
# **What ours lacks** (Megatron-LM, torchtitan, ring-flash-attention, Llama 3's training): a fused flash kernel per
# block, CUDA streams so the exchange really runs beside the compute, causal blocks that skip their masked half,
# hierarchical rings, striped and document-aware layouts, Ulysses with uneven heads or with its all-to-alls
# overlapped with the projections, and the two combined (Ulysses inside a node, the ring across).
#
# **Next — lesson 07, pipeline parallelism:** the layers cut into stages on different ranks, and the micro-batches
# that flow through them; lesson 08 then moves tokens to experts on other ranks.
#
# **Takeaway:** data parallelism cuts the batch, tensor parallelism the layers' matrices, and context parallelism
# the sequence; pipeline parallelism, next, cuts the depth.
