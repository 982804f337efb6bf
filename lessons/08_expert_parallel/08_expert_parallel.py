"""Lesson 08's notebook, 08_expert_parallel.ipynb, as plain Python in the percent format (see lessons/_notebook.py):
edit this file, never the notebook.

    python lessons/_notebook.py 08_expert_parallel --run fast    # rebuild the notebook, execute it in FAST mode
"""

# %% [markdown]
# # Lesson 08 — Expert parallelism: many experts, few per token
#
# Every strategy so far cut the *same* computation into pieces. A **mixture of experts** (MoE) changes the model:
# each layer's MLP becomes $E$ expert MLPs and a **router** that sends every token to $k$ of them (Shazeer et al. 2017;
# GShard, Lepikhin et al. 2020; Switch Transformers, Fedus et al. 2022; Mixtral, Jiang et al. 2024: $E = 8$, $k = 2$).
# Parameters grow with $E$, work per token only with $k$. **Expert parallelism** places experts on different ranks
# and moves the *tokens*: one all-to-all to send each token to its experts, one to bring the results back.
#
# | piece | what it does | where |
# |---|---|---|
# | router | softmax, top-$k$, renormalise (Mixtral); or DeepSeek-V3's sigmoid + bias (§9) | `moe.route` |
# | dispatch permutation | a stable sort of the (token, choice) pairs by expert | `MoE.forward` |
# | load-balancing loss | $E \sum_e f_e P_e$: $k$ when balanced, larger when concentrated | `moe.aux_loss`, `AuxLoss` |
# | capacity | at most $\lceil \kappa\,s\,k/E \rceil$ tokens per expert and sequence; the rest dropped | `moe.capacity_keep` |
# | the exchange | counts, then rows, all-to-all over ep; back after the experts | `expert_parallel.Exchange` |
# | the overlap | two parts, each one's all-to-all under the other's experts (`--ep-overlap`, §10) | `expert_parallel.OverlappedExchange` |
# | gradients | dense: averaged over dp; experts: summed over edp, divided by dp | `marks.sync_axis` |
#
# We count what experts buy; route tokens by hand; train with and without the balancing loss; count the
# all-to-alls' bytes against the formula and put them on a timeline; measure memory and throughput against ep; check
# parity with one process, and the trap of the wrong gradient divisor; then DeepSeek-V3's bias router, and the
# all-to-alls hidden under compute. The experiments are `experiment.py` here, launched with `torchrun`;
# `PICOTRON_FAST=1` gives a short run.

# %%
import statistics
import sys
import matplotlib.pyplot as plt
import torch
sys.path.insert(0, "..")   # lessons/: the helpers every lesson shares
import _common
from picotron import expert_parallel, marks, moe, planner
from picotron.model import ModelConfig

FAST, OUT = _common.FAST, _common.run_dir("08_expert_parallel")
import experiment as lesson   # this folder's experiment.py: its measurements, formulas and plots
MiB, GB = 2**20, 1e9

def run(only, nproc=2):
    # torchrun --nproc_per_node nproc lessons/08_expert_parallel/experiment.py --out OUT --only <only>
    _common.run_experiment("08_expert_parallel", only, nproc)

def check(name, ok, detail):
    print(f"{'✓' if ok else '✗'} {name}: {detail}")

st = lesson.settings(FAST)
EP = _common.nproc("08_expert_parallel", 4)   # the main run's processes: 4, or 8 with PICOTRON_NPROC=8 (ep = 8)
mc = lesson.model_config(st)
print(f"FAST={FAST}, results in {OUT.relative_to(_common.ROOT)}; model: '{st['preset']}', {mc.num_hidden_layers} "
      f"layers, h={mc.hidden_size}, {mc.num_local_experts} experts of h_ff={mc.intermediate_size}, top-"
      f"{mc.num_experts_per_tok}: {mc.num_params() / 1e6:.2f} M parameters, {mc.num_params(active=True) / 1e6:.2f} M "
      f"active per token; {st['micro_batch_size']} sequences of {st['seq_len']} tokens per rank and step")

# %% [markdown]
# ## 1. Why experts: parameters grow, FLOPs per token do not
#
# A dense layer's MLP of width $h_\text{ff}$ holds $3\,h\,h_\text{ff}$ parameters and every token multiplies by all of
# them ([notation](../../docs/reference.md#notation)). With $E$ experts of the same shape and $k$ per token, the
# layer holds $3E\,h\,h_\text{ff}$ (plus the router, $E h$) but a token passes through $3k\,h\,h_\text{ff}$: the
# **active** parameters. Training FLOPs per token are $6 N_\text{active}$ plus attention, so with $E/k = 4$ an MoE
# holds four times the MLP parameters of a dense model of the same cost per token. Mixtral-8x7B: 46.7 B parameters,
# 12.9 B active.

# %%
dense_of = lambda m: ModelConfig.from_preset("tiny", **{f: getattr(m, f) for f in ("vocab_size", "hidden_size",
                                            "num_hidden_layers", "num_attention_heads", "num_key_value_heads")},
                                            intermediate_size=m.num_experts_per_tok * m.intermediate_size)
mix = ModelConfig.from_preset("mixtral-8x7b")
mix_dense = ModelConfig.from_preset("mixtral-8x7b", num_local_experts=0, intermediate_size=2 * mix.intermediate_size)
rows = [("tiny-moe (E=4, k=2)", mc, 64), ("dense, MLP h_ff = k·h_ff", dense_of(mc), 64),
        ("Mixtral-8x7B (E=8, k=2)", mix, 4096), ("dense, MLP h_ff = k·h_ff", mix_dense, 4096)]
print(f"{'model':<26} {'parameters':>14} {'active / token':>15} {'GFLOP / token (train)':>22}")
for name, m, s in rows:
    print(f"{name:<26} {m.num_params() / 1e6:>12.2f} M {m.num_params(active=True) / 1e6:>13.2f} M "
          f"{m.flops_per_token(s) / 1e9:>22.4f}   (s = {s})")
check("Mixtral-8x7B: 46.7 B parameters, 12.9 B active (the paper's numbers)",
      (round(mix.num_params() / 1e9, 1), round(mix.num_params(active=True) / 1e9, 1)) == (46.7, 12.9),
      f"{mix.num_params() / 1e9:.2f} B, {mix.num_params(active=True) / 1e9:.2f} B")
mlp_ratio = mc.ffn_params() / dense_of(mc).ffn_params()
check("tiny-moe: the MLP parameters are E/k times the dense model's, the FLOPs per token the same (+ the router)",
      abs(mlp_ratio - (mc.num_local_experts * 3 * mc.hidden_size * mc.intermediate_size + mc.num_local_experts
                       * mc.hidden_size) / dense_of(mc).ffn_params()) < 1e-12
      and mc.flops_per_token(64) - dense_of(mc).flops_per_token(64) == 6 * mc.num_hidden_layers * mc.num_local_experts * mc.hidden_size,
      f"MLP parameters x{mlp_ratio:.3f}; FLOPs per token {mc.flops_per_token(64):,} against {dense_of(mc).flops_per_token(64):,}: "
      f"the difference is the router, 6·L·E·h")

# %% [markdown]
# **Measured.** A forward and backward of 8 × 64 tokens on one process, the dense model against the MoE (median of
# a few steps):

# %%
t_dense, t_moe = lesson.time_step("tiny", intermediate_size=2 * mc.intermediate_size), lesson.time_step("tiny-moe")
print(f"dense (h_ff = {2 * mc.intermediate_size}): {1e3 * t_dense:.0f} ms; tiny-moe (4 experts of h_ff = "
      f"{mc.intermediate_size}, top-2): {1e3 * t_moe:.0f} ms -> the MoE takes {t_moe / t_dense:.2f}x the dense step "
      f"for {mc.num_params() / dense_of(mc).num_params():.2f}x the parameters")

# %% [markdown]
# Same FLOPs, not quite the same time: the MoE pays for bookkeeping (a sort, a gather, four small matmuls instead of
# one, an `index_add` back), visible at this size; at Mixtral's size it is a few percent. The price that remains is
# **memory**: every expert's states must live somewhere, though each token uses a quarter of them. Expert
# parallelism spreads that memory.
#
# **Takeaway:** parameters scale with $E$, FLOPs with $k$: a big model's memory at a small model's cost per token.
#
# ## 2. Routing, and the dispatch permutation
#
# The router is one linear layer, $h \to E$. Mixtral takes the softmax over the $E$ logits (fp32), keeps the $k$
# largest probabilities $\pi_e$ and renormalises them to sum to 1; the output for token $\tau$ is
# $y_\tau = \sum_{j=1}^{k} w_{\tau j}\,\text{Expert}_{e_{\tau j}}(x_\tau)$, $e_{\tau j}$ its $j$-th expert and
# $w_{\tau j}$ that expert's renormalised probability. (Switch uses $k = 1$ and no renormalisation; GShard $k = 2$.)
# Five tokens, four experts, by hand:

# %%
logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(3)) * 1.5
probs, top, chosen, weights = lesson.route_by_hand(logits, 2)
for t in range(5):
    print(f"token {t}: probabilities {[round(p, 3) for p in probs[t].tolist()]} -> experts {chosen[t].tolist()} "
          f"with {[round(p, 3) for p in top[t].tolist()]}, renormalised {[round(w, 3) for w in weights[t].tolist()]}")
w_lib, e_lib, _ = moe.route(logits, 2)
check("by hand = picotron's moe.route (weights and experts)", torch.equal(e_lib, chosen) and torch.allclose(w_lib, weights),
      "softmax -> top-2 -> renormalise")

# %% [markdown]
# The bookkeeping: the $n_\text{tok} \cdot k$ (token, choice) pairs, flattened token-major, are sorted by expert
# with a **stable** sort, so each expert's pairs are contiguous and in token order. `rows = x[order // k]` gathers the
# inputs; each expert runs on its slice (`counts[e]` rows); `index_add(order // k, out · w[order])` puts the weighted
# outputs back. Stable matters twice: capacity is first come, first served in token order, and the sum is
# reproducible. Each *rank's* rows are contiguous too (its experts are consecutive), so the exchange needs only the
# counts.

# %%
order = torch.argsort(chosen.flatten(), stable=True)
print("pairs (token, expert):", [(p // 2, int(e)) for p, e in enumerate(chosen.flatten())])
print("order:", order.tolist(), " -> tokens", (order // 2).tolist(), "experts", chosen.flatten()[order].tolist(),
      " counts", torch.bincount(chosen.flatten(), minlength=4).tolist())
lesson.plot_routing(logits, 2); plt.show()
_common.show_source(moe.MoE.forward, "flat = x.reshape", "y = torch.zeros_like")

# %% [markdown]
# **Takeaway:** routing is softmax, top-$k$, renormalise; dispatching is one stable sort, and combining is its
# inverse, weighted.
#
# ## 3. Load balance
#
# Nothing in the language-model loss keeps the router fair: an expert that gets more tokens early learns faster and
# attracts even more. Idle experts are wasted parameters, and the rank holding the popular ones sets everyone's pace
# (and, with a capacity, drops tokens). The **auxiliary loss** of Switch (eq. 4), in Hugging Face Mixtral's form,
# per layer:
#
# $$\text{aux} = E \sum_{e=0}^{E-1} f_e P_e,\qquad f_e = \frac{\#\{\text{choices of expert } e\}}{n_\text{tok}},\quad
# P_e = \frac{1}{n_\text{tok}}\sum_\tau \pi_{\tau,e},$$
#
# over the batch's $n_\text{tok}$ tokens $\tau$, $\pi_{\tau,e}$ token $\tau$'s router probability for expert $e$.
# $\sum_e f_e = k$ and $\sum_e P_e = 1$; uniform routing ($f_e = k/E$, $P_e = 1/E$) gives aux $= k$, and it grows as
# routing concentrates. $f$ is a count (no gradient); the gradient flows through $P$, away from the most chosen
# experts. picotron adds $\alpha \cdot \text{aux}$ (mean over layers) through `AuxLoss`, an identity in forward whose
# backward also feeds $\alpha$ to the aux, so `forward` still returns only logits.
#
# **Measured.** `picotron.train` on tiny-moe at dp = ep = 2 (two processes, two experts each), same seed and data,
# with $\alpha = 0$ and $\alpha = 0.01$ (tiny-moe's default). For comparison: the Mixtral paper (Jiang et al. 2024,
# §2.1) names no auxiliary loss and no $\alpha$; the released `config.json` (mistralai/Mixtral-8x7B-v0.1) sets
# `router_aux_loss_coef` to 0.02, `transformers`' `MixtralConfig` defaults to 0.001. Each step's record holds
# `record["moe"]["tokens_per_expert"]` (per layer, summed over dp). The same launch runs sections 4-6's measurements.

# %%
run("balance,bytes,scaling,parity", nproc=2)
bal = _common.load_json(OUT / "balance_ep2.json")["results"]
last = max(1, len(next(iter(bal["runs"].values()))["aux"]) // 10)
ratios = {}
for coef, r in bal["runs"].items():
    ratios[coef] = lesson.window_ratio([{"moe": {"tokens_per_expert": t}} for t in r["tokens_per_expert"]], last)
    print(f"aux coef {coef:>4}: loss {r['loss'][0]:.3f} -> {r['loss'][-1]:.3f}; aux {r['aux'][0]:.3f} -> "
          f"{r['aux'][-1]:.3f}; busiest expert / mean over the last {last} steps, per layer "
          f"{[round(x, 2) for x in ratios[coef]]}; last step's tokens per expert, layer 3: {r['tokens_per_expert'][-1][3]}")
lesson.plot_balance(bal); plt.show()
lesson.plot_balance_curves(bal, window=max(3, last)); plt.show()

# %%
free, aux_run = bal["runs"]["0"], bal["runs"]["0.01"]
E, k = mc.num_local_experts, mc.num_experts_per_tok
check("with the auxiliary loss the experts end better balanced (mean over layers of busiest / mean)",
      statistics.mean(ratios["0.01"]) < statistics.mean(ratios["0"]) - 0.15,
      f"{statistics.mean(ratios['0.01']):.2f} with aux against {statistics.mean(ratios['0']):.2f} without, over the "
      f"last {last} steps (1 = balanced, E/k = {E // k} = two experts take every choice)")
check("without it, a layer collapses onto a few experts", max(ratios["0"]) >= 1.5,
      f"busiest / mean up to {max(ratios['0']):.2f} (the most is E/k = {E // k}: each token's 2 choices on 2 experts)")
check("the aux loss: near k = 2 with it, higher without", abs(aux_run["aux"][-1] - k) < 0.15 and
      free["aux"][-1] > aux_run["aux"][-1] + 0.2, f"last step {aux_run['aux'][-1]:.3f} with, {free['aux'][-1]:.3f} without")
check("balance costs (almost) nothing in loss", abs(aux_run["loss"][-1] - free["loss"][-1]) < 0.1 * free["loss"][-1],
      f"final loss {aux_run['loss'][-1]:.3f} with, {free['loss'][-1]:.3f} without")

# %% [markdown]
# Without the auxiliary loss the deeper layers collapse within tens of steps: two of the four experts take nearly
# every choice (ratio 2, the most possible with $k = 2$ of $E = 4$), the others idle. With $\alpha = 0.01$ the maps
# stay even, the aux sits at $k$, and the loss is the same to a few percent: at this scale balance is free. (The first
# layer balances itself better: its input, the byte embeddings, varies more.)
#
# **Capacity.** GShard and Switch bound each expert's work, fixing a step's shapes so one hot expert cannot stall
# the rest: expert $e$ takes at most $\lceil \kappa\,s\,k/E \rceil$ of a sequence's choices, first come first served;
# the rest are **dropped** (the token keeps its residual). Both trained models, one batch, dropped fraction against
# $\kappa$; dashed: uniformly random routing (each load Binomial($s$, $k/E$), `lesson.expected_dropped`):

# %%
for coef, r in bal["runs"].items():
    print(f"aux coef {coef:>4}: dropped " + ", ".join(f"κ={c:g}: {d:.3f}" for c, d in zip(bal["capacities"], r["dropped"])))
print("uniform:        dropped " + ", ".join(f"κ={c:g}: {d:.3f}" for c, d in zip(bal["capacities"], bal["uniform"])))
lesson.plot_capacity(bal); plt.show()
check("a larger capacity drops fewer choices, both runs", all(all(a >= b for a, b in zip(r["dropped"], r["dropped"][1:]))
                                                        for r in bal["runs"].values()),
      f"κ = {bal['capacities'][0]:g} .. {bal['capacities'][-1]:g}")
i1 = bal["capacities"].index(1.0)
check("at κ = 1 the collapsed router drops far more than the balanced one", free["dropped"][i1] > 2 * aux_run["dropped"][i1],
      f"{free['dropped'][i1]:.3f} against {aux_run['dropped'][i1]:.3f} of the choices")

# %% [markdown]
# At $\kappa = 1$ the collapsed router loses much of its choices: balance makes a capacity affordable. Real routers
# drop more than the binomial line even when balanced on average (a sequence's tokens are alike); $\kappa = 1.25$
# (Switch's training default) to 2 keeps drops small. picotron's default is $\kappa = 0$, no limit (Mixtral's choice).
#
# **Takeaway:** without a balancing term the router collapses; $E\sum_e f_e P_e$ keeps it even at no visible cost;
# capacity trades dropped tokens for bounded work.
#
# ## 4. Read the code: the exchange
#
# `picotron/expert_parallel.py`. The ep ranks (carved out of dp: they see different data) each keep $E/ep$ experts.
# A rank's rows for rank $r$'s experts are one contiguous block, so the all-to-all's splits are sums of `counts`. The
# receiver does not know how many rows each sender has for it, so the counts go first (an all-to-all of $E$
# numbers), then the rows, which arrive grouped by *source* and are regrouped by *expert*:

# %%
_common.show_source(expert_parallel.Exchange.dispatch)
_common.show_source(expert_parallel.Exchange.combine)

# %% [markdown]
# `AllToAll` is an autograd function: backward sends gradients back the way the rows came (splits swapped). So per
# layer and micro-batch there are four all-to-alls of rows (dispatch, combine, their backwards); `Exchange.rows`
# counts those sent to *other* ranks. Balanced, a rank's $n_\text{tok} k$ rows leave in proportion $(ep-1)/ep$:

# %%
_common.show_source(expert_parallel.bytes_per_step_formula, "return")
_common.show_source(marks.sync_axis)

# %% [markdown]
# The second function is the gradient rule. Dense parameters are averaged over dp as always. An expert lives on one
# rank of each ep group, replicated only over `edp` (dp / ep ranks); its gradient already holds its whole ep group's
# tokens (the all-to-all brought them), so it is **summed over edp and divided by dp** (not edp): the gradient of the
# global batch's mean loss, like every other parameter's.
#
# **Takeaway:** two all-to-alls per layer and their backwards; counts first, rows second; expert gradients
# summed over their replicas and divided by the whole dp.
#
# ## 5. The all-to-all, counted and timed
#
# Training steps at ep = 2 (two processes) and ep = 4 (four), every collective counted by a `metrics.Recorder`
# (`parallelize(cfg, mesh, recorder=...)`), each layer's `Exchange.rows` and every rank's tokens per expert read after
# each step. The routing predicts the rows *exactly*: rank $r$ sends rank $r'$ its counts for $r'$'s experts
# (`lesson.send_matrix`, `lesson.predicted_rows`). The Recorder counts each call's whole buffer, a rank's own block
# included, plus the counts ($8E$ bytes): `lesson.predicted_a2a_bytes`. The balanced formula is the expectation.

# %%
run("bytes,scaling,parity", nproc=EP)
byt = {W: _common.load_json(OUT / f"bytes_ep{W}.json")["results"] for W in (2, EP)}
for W, res in byt.items():
    for s in res["steps"]:
        sent = [sum(m.values()) * res["hidden"] * 4 for m in s["measured"]]
        print(f"ep={W} step {s['step']}: sent to other ranks per rank {[round(b / MiB, 3) for b in sent]} MiB; "
              f"balanced formula {res['formula'] / MiB:.3f} MiB; Recorder's all-to-all bytes "
              f"{[round(b / MiB, 3) for b in s['a2a']]} MiB")
lesson.plot_bytes([byt[2], byt[EP]]); plt.show()

# %%
for W, res in byt.items():
    n = sum(len(s["measured"]) for s in res["steps"])
    check(f"ep={W}: rows each Exchange sent = the routing's prediction, every kind, rank and step",
          all(s["measured"] == s["predicted"] for s in res["steps"]), f"{n} (rank, step) cases x 4 kinds")
    check(f"ep={W}: the Recorder's all-to-all bytes = the prediction (own block and counts included)",
          all(s["a2a"] == s["a2a_predicted"] for s in res["steps"]), f"{n} (rank, step) cases")
    sent = [sum(m.values()) * res["hidden"] * 4 for s in res["steps"] for m in s["measured"]]
    worst = max(abs(b / res["formula"] - 1) for b in sent)
    bound = 0.35 if W <= 4 else 0.5  # ep = 8 (PICOTRON_NPROC=8): 8 experts, fewer rows each, a wider spread (40% seen)
    check(f"ep={W}: bytes sent within {bound:.0%} of the balanced formula", worst < bound,
          f"formula {res['formula'] / MiB:.3f} MiB per rank and step; measured off by up to {100 * worst:.0f}% "
          f"(the routing is not perfectly balanced)")

# %% [markdown]
# The all-to-all sends what the routing says, no more. The formula's $4\,n_\text{tok}\,k\,h\,(ep-1)/ep$ elements per
# layer is a balanced router's cost; each rank sends more or less as its tokens prefer remote or local experts (in a
# pair, what one sends in dispatch the other sends in combine). From ep = 2 to 4 the remote share goes from 1/2 to 3/4.
#
# **The timeline.** The last step at ep = 2 and 4: collectives from the Recorder, attention and each expert from
# module hooks:

# %%
for W, res in byt.items():
    lesson.plot_timeline(res); plt.show()
    sh = lesson.timeline_shares(res)
    print(f"ep={W}: per rank, all-to-alls {[s['n_a2a'] for s in sh]} calls, "
          f"{[round(1e3 * s['a2a']) for s in sh]} ms of a {[round(1e3 * s['step']) for s in sh]} ms step "
          f"({[round(100 * s['a2a'] / s['step']) for s in sh]} %); attention {[round(1e3 * s['attention']) for s in sh]} ms, "
          f"experts {[round(1e3 * s['experts']) for s in sh]} ms")
    layers, micro = res["layers"], 1
    check(f"ep={W}: 5 all-to-alls per layer and micro-batch on every rank (counts, dispatch, combine, 2 backwards)",
          all(s["n_a2a"] == 5 * layers * micro for s in sh), f"{sh[0]['n_a2a']} = 5 x {layers} layers")

# %% [markdown]
# Each all-to-all is a synchronisation point: no rank runs its experts before every rank has sent its rows, so the
# red bars also hold the ranks' differences in speed. Here they block (experts wait for the dispatch, attention for
# the combine). Production systems overlap them: DeepSeek-V3's DualPipe runs one micro-batch's all-to-all under
# another's compute; Megatron-LM and DeepEP pipeline the exchange with the experts; section 10 does it with
# `--ep-overlap`.
#
# **Takeaway:** the bytes are the routing's, to the byte; the all-to-alls sit on the critical path unless the
# schedule hides them.
#
# ## 6. Memory and throughput per rank against ep
#
# The same global batch (8 sequences of 64 tokens per rank), dp = 2 (then 4) with ep = 1 (plain data parallelism),
# 2 and 4, one step of each in turn. fp32 AdamW states: 16 bytes per parameter held plus a 4-byte step counter per
# tensor; a rank holds the dense part and $E/ep$ of every layer's experts (`lesson.model_state_parts`).

# %%
sca = {W: _common.load_json(OUT / f"scaling_ep{W}.json")["results"] for W in (2, EP)}
for W, res in sca.items():
    for ep, r in res["rows"].items():
        m = r["mem"][0]
        print(f"{W} processes, ep={ep}: model states per rank {sum(m.values()) / MiB:6.2f} MiB measured (params "
              f"{m['params'] / MiB:.2f} + grads {m['grads'] / MiB:.2f} + AdamW {m['optimizer'] / MiB:.2f}), formula "
              f"{r['formula'] / MiB:6.2f}; {r['tokens_per_s']:6.0f} tokens/s (median step {1e3 * r['step_s']:.0f} ms, "
              f"range {1e3 * min(r['times']):.0f}-{1e3 * max(r['times']):.0f})")
lesson.plot_scaling([sca[2], sca[EP]]); plt.show()

# %%
for W, res in sca.items():
    rows = res["rows"]
    check(f"{W} processes: model states per rank = the formula, to the byte, every ep and rank",
          all(sum(m.values()) == r["formula"] for r in rows.values() for m in r["mem"]),
          ", ".join(f"ep={ep}: {r['formula'] / MiB:.2f} MiB" for ep, r in rows.items()))
    mems = [rows[ep]["formula"] for ep in sorted(rows, key=int)]
    check(f"{W} processes: each doubling of ep halves the experts held (memory falls toward the dense part)",
          all(a > b for a, b in zip(mems, mems[1:])),
          f"dense part {rows['1']['parts']['dense'] * 16 / MiB:.2f} MiB, experts {rows['1']['parts']['experts'] * 16 / MiB:.2f} MiB at ep = 1")

# %% [markdown]
# Memory is exactly the formula: at ep = $E$ a rank holds one expert per layer, and tiny-moe's states shrink from
# 22 to about 8 MiB, what makes Mixtral-sized models fit (section 8's widget). Throughput: here ep is **not** faster
# (the same FLOPs on two cores, plus the all-to-alls and regrouping). On GPUs, ep gives each expert's matmul the whole
# group's rows (better utilisation for small batches) and the model fits; its all-to-all crosses nodes once ep
# exceeds a node's GPUs, hence DeepSeek-V3's node-limited routing (each token's experts on at most 4 nodes).
#
# **Takeaway:** ep divides the experts' memory by ep exactly; its price is two all-to-alls per layer.
#
# ## 7. Check it: expert parallelism trains like one process
#
# `picotron.train` at ep = 2 (dp = 2) on two processes; ep = 4 (dp = 4), dp = 4 × ep = 2 (each expert on two ranks)
# and ep = 2 × tp = 2 (each expert cut like an MLP) on four; against one process with the same global batch, fp32,
# same seed: per-step loss within $10^{-5}$ relative over 10
# steps, the [parity standard](../../docs/reference.md#parity-standard). Both modes train exactly 10 steps, with no
# drift bound after them: the router is **discrete**.
#
# A last-digit rounding difference in a router logit can flip one token's second choice between two nearly equal
# experts, changing its output by a finite amount. In a 20-step run (longer cosine schedule, larger early learning
# rates) ep2 × tp2 left the standard at step 9 ($2.9 \times 10^{-5}$, then $4 \times 10^{-4}$ at step 10, up to
# $3 \times 10^{-3}$ by step 17), and dp4 × ep2's gradient norm jumped by $7 \times 10^{-2}$ at step 20, while the
# dense layers' rounding stays near $10^{-7}$: routing flips, not a wrong gradient (the first steps, and every
# gradient in `tests/test_expert_parallel.py`, agree to $10^{-5}$).
#
# The gradient norm is global (every gradient counted once), so it checks the gradients too; tensor parallelism
# changes its order of summation, and after a few AdamW steps it differs more than the loss (ep2 × tp2 reached
# $1.6 \times 10^{-5}$ in one run), so we hold it to $10^{-4}$, a hundred times below what the trap gives at step 1.
#
# **The trap.** It is tempting to average an expert's gradient over its own replicas (edp), as data parallelism
# does over its group. But it already sums the whole ep group's tokens: divided by edp (here 1) instead of dp (here
# 2), it is twice too large. `lesson.experts_divided_by_edp` does exactly that.

# %%
GRAD_TOL = 1e-4   # the gradient norm: a sum of squares over 1.4 M gradients, in another order under tp
if EP > 4:  # ep = 8, 8 experts: more router near-ties, a flip by step 10 moved the norm 9e-4 (CPU); the trap: 1e-2 at step 1
    GRAD_TOL = 1e-3
par_ = {W: _common.load_json(OUT / f"parity_ep{W}.json")["results"] for W in (2, EP)}
pairs, norms = {}, {}
for W, res in par_.items():
    for label, losses in res["losses"].items():
        ref = res["reference"][res["ref_of"][label]]
        pairs[label] = (losses, ref["losses"])
        norms[label] = (res["grad_norms"][label], ref["grad_norms"])
for label, (got, want) in pairs.items():
    p_ = _common.parity(got, want)
    g_ = _common.parity(*norms[label])
    print(f"{label:<14} vs 1 process: loss max relative difference over steps 1-{p_['window']} {p_['worst']:.1e}, "
          f"gradient norm {g_['worst']:.1e}" + (f"; steps {p_['window'] + 1}-{p_['n_steps']}: loss {p_['beyond']:.1e}"
                                              if p_["n_beyond"] else ""))
lesson.plot_parity(pairs); plt.show()

# %%
for label, (got, want) in pairs.items():
    if label == "experts / edp":
        continue
    for line in _common.parity_checks(label, got, want):
        check(*line)
    g_ = _common.parity(*norms[label], tol=GRAD_TOL)
    check(f"gradient norm {label}", g_["ok"], f"within {GRAD_TOL:.0e} relative over steps 1-10: max {g_['worst']:.1e}")
bad, badg = _common.parity(*pairs["experts / edp"]), _common.parity(*norms["experts / edp"])
check("expert gradients divided by edp: the gradient norm differs from step 1", badg["first_over"] == 1,
      f"step 1: {_common.rel_diffs(*norms['experts / edp'])[0]:.1e} relative (the loss of step 1 agrees: same weights)")
check("expert gradients divided by edp: the loss leaves the reference", not bad["ok"],
      f"first over 1e-5 at step {bad['first_over']}, worst of steps 1-10 {bad['worst']:.1e}")

# %% [markdown]
# Every layout trains like one process to rounding. The wrong divisor shows at once in the gradient norm; in the loss
# it is damped, since AdamW divides each update by the gradient's running scale: only clipping (which sees the global
# norm) and Adam's early steps let it through, at the $10^{-4}$ level. A check of losses to $10^{-2}$ would miss it;
# the suite compares every gradient
# (`tests/test_expert_parallel.py::test_the_parity_check_catches_expert_gradients_divided_by_their_own_group`).
#
# **Takeaway:** expert parallelism is the same training; expert gradients are summed over edp and divided by dp.
#
# ## 8. Explore: experts, ep and capacity against memory and bytes per GPU
#
# Pick a model, $E$, $k$, ep and the capacity factor. Left: model states per GPU (bf16 weights and gradients, fp32
# master weights and moments: 16 bytes per parameter) for every ep dividing $E$; middle: all-to-all bytes each GPU
# sends per step for 4096 tokens (balanced, bf16); right: choices dropped at $\kappa$ under uniform routing. How many
# GPUs does Mixtral-8x7B's model state need at ep = 1, and at ep = 8? Why does the traffic hardly grow from ep = 4 to
# 8? What $\kappa$ keeps drops under 1%? (Widgets need a live kernel.)

# %%
def draw(preset="mixtral-8x7b", E=8, k=2, ep=8, c=1.25):
    E = max(E, 1)
    ep = max(d for d in range(1, E + 1) if E % d == 0 and d <= ep)
    n = lesson.widget_numbers(preset, E, k, ep, c)
    lesson.plot_widget(preset, E, k, ep, c); plt.show()
    print(f"{preset}, E={E}, k={min(k, E)}, ep={ep}: {n['total'] / 1e9:.2f} B parameters ({n['active'] / 1e9:.2f} B "
          f"active); per GPU {n['dense'] / 1e9:.2f} B dense + {n['experts'] / 1e9:.2f} B of experts -> model states "
          f"{n['state_bytes'] / GB:.0f} GB; all-to-all {n['a2a_bytes'] / GB:.2f} GB per step (4096 tokens per GPU); "
          f"dropped at κ={c:g}: {100 * n['dropped']:.3f}% (uniform routing)")

_common.interactive(draw, lambda w: dict(
    preset=w.Dropdown(options=["mixtral-8x7b", "tiny-moe", "llama3-8b"], value="mixtral-8x7b"),
    E=w.IntSlider(value=8, min=1, max=64, description="experts E"), k=w.IntSlider(value=2, min=1, max=8, description="top-k"),
    ep=w.IntSlider(value=8, min=1, max=64, description="ep"), c=w.FloatSlider(value=1.25, min=0.5, max=3, step=0.05,
                                                                              description="capacity κ")))

# %%
n1, n8 = lesson.widget_numbers(ep=1), lesson.widget_numbers(ep=8)
check("the widget's numbers: Mixtral-8x7B's states, ep = 1 against ep = 8",
      n1["state_bytes"] == 16 * n1["total"] and n8["state_bytes"] == 16 * (n8["dense"] + n8["experts"])
      and n8["experts"] * 8 == n1["experts"], f"{n1['state_bytes'] / GB:.0f} GB -> {n8['state_bytes'] / GB:.0f} GB per GPU")

# %% [markdown]
# **Takeaway:** ep divides the experts' share of memory; the all-to-all's bytes grow with $k$ and $h$, barely
# with ep; capacity drops fall fast once $\kappa$ exceeds 1 — for a balanced router.
#
# ## 9. DeepSeek-V3's router: balance without an auxiliary loss
#
# The auxiliary loss's gradient pulls the router away from what the language-model loss wants: a large $\alpha$
# balances well and costs quality, a small one balances poorly (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing
# Strategy for Mixture-of-Experts", arXiv:2408.15664). DeepSeek-V3 (arXiv:2412.19437, §2.1.2) routes differently:
#
# * **sigmoid affinities** $\pi_e = \sigma(x \cdot w_e)$, each expert scored on its own (no softmax); the gates are
#   the chosen affinities normalised, $g_e = \pi_e / \sum_{e' \in \text{top-}k} \pi_{e'}$ (times
#   `routed_scaling_factor`, 2.5 in the released config; 1 here);
#
# * **a bias for the choice only**: top-$k$ over $\pi_e + \mathrm{bias}_e$, but the bias never enters the gates, so
#   no gradient sees it;
#
# * **the bias update** after each optimizer step: $\mathrm{bias}_e \mathrel{+}= \gamma \cdot
#   \mathrm{sign}(\overline{\mathrm{load}} - \mathrm{load}_e)$, $\mathrm{load}_e$ the step's tokens choosing $e$,
#   $\overline{\mathrm{load}}$ their mean over experts. Loads are counted over the **global** batch (summed over
#   every dp, cp and ep rank by `moe.step_stats`), so every replica's bias stays the same;
#
# * **shared and fine-grained experts** (DeepSeekMoE, arXiv:2401.06066): $N_s$ shared experts every token passes
#   through, and more, smaller routed ones. `tiny-deepseek-moe`: 8 routed experts of $h_\text{ff} = 96$, top-3,
#   $N_s = 1$: the same active width ($4 \times 96$) as `tiny-moe`'s $2 \times 192$;
#
# * **a small sequence-wise balance loss**: the report still adds the aux loss's form over each sequence's tokens,
#   with an "extremely small" $\alpha$ (0.0001 in pre-training, §4.2), against extreme imbalance inside a sequence.
#   picotron does not build it: its bias run has no balance term in the loss.
#
# | piece | where |
# |---|---|
# | sigmoid scores, top-$k$ of $\pi + \mathrm{bias}$, gates without the bias | `moe.route(logits, k, "sigmoid", bias)` |
# | the bias: a buffer (no gradient, no optimizer state), saved in checkpoints | `MoE.e_score_correction_bias` |
# | $\mathrm{bias}_e \mathrel{+}= \gamma\,\mathrm{sign}(\overline{\mathrm{load}} - \mathrm{load}_e)$ on the step's global loads | `moe.update_bias`, called by `moe.step_stats` |
# | options | `--router sigmoid --shared-experts 1 --expert-size 96 --bias-update-speed 0.001`, or `--preset tiny-deepseek-moe` |
#
# We train `tiny-deepseek-moe` at dp = ep = 2 three times on the same batches: unbalanced, with the auxiliary loss
# ($\alpha = 0.01$) and with the bias update. The report's $\gamma = 0.001$ suits hundreds of thousands of steps; for
# our 200, $\gamma = 0.01$. Expected: the bias run's busiest expert (last 10 steps) below the unbalanced run's, and
# the final bias exactly the sum of the $\pm\gamma$ steps the recorded loads prescribe.

# %%
run("router")
rt = _common.load_json(OUT / "router_ep2.json")["results"]
imbalance = {name: [statistics.mean(lesson.load_ratio(x)) for x in r["tokens_per_expert"]] for name, r in rt["runs"].items()}
last = {name: statistics.mean(v[-10:]) for name, v in imbalance.items()}
for name, r in rt["runs"].items():
    print(f"{name:>5}: busiest/mean expert load {imbalance[name][0]:.2f} at step 1 -> {last[name]:.2f} over the last 10 "
          f"steps; loss {r['loss'][0]:.3f} -> {statistics.mean(r['loss'][-10:]):.3f} (last 10 steps' mean)")
lesson.plot_router(rt); plt.show()

# %%
check("the bias update balances the experts", last["bias"] < last["none"],
      f"busiest/mean over the last 10 steps {last['bias']:.2f} with the bias update, {last['none']:.2f} without "
      f"balancing ({last['aux']:.2f} with the aux loss)")
replay = lesson.bias_replay(rt["runs"]["bias"]["tokens_per_expert"], rt["gamma"])
final = torch.tensor(rt["runs"]["bias"]["bias"])
check("each bias moved by ±γ by the sign of its load error, every step", torch.equal(final, replay),
      f"{final.shape[0]} layers x {final.shape[1]} experts equal to γ·Σ sign(mean − load) over "
      f"{len(rt['runs']['bias']['loss'])} steps, max |difference| {(final - replay).abs().max():.1e}; biases from "
      f"{final.min():+.2f} to {final.max():+.2f}")

# %% [markdown]
# Without balancing, the busiest expert settles at about 2.25 times the mean load; the auxiliary loss brings it to
# 1.13, the bias update to 1.09 with no term in the loss. Each bias walks by $\pm\gamma$ and hovers where its expert's
# load crosses the mean (within $\pm 0.34$ after 200 steps). The three losses stay within about 1% (2.21, 2.20, 2.23
# over the last 10 steps): the quality gain Wang et al. and DeepSeek-V3 claim for the bias was measured at billions of parameters. Here it buys
# the balance itself with no hyper-parameter traded against the loss.
#
# **Exercise 5.** `deepseek_router_step(logits, k, bias, gamma)` in `exercise.py`: the choice with the bias, the
# gates without it, then the bias update from the batch's loads. The checker says when the bias leaked into the
# gates, the choice ignored it, or the update's sign is reversed or its step is not $\pm\gamma$:

# %%
import check as checker   # this folder's check.py
checker.check(["deepseek_router_step"])

# %% [markdown]
# **Takeaway:** DeepSeek-V3 balances its experts with a per-expert bias that only chooses, moved by $\pm\gamma$
# against the global load each step; its loss adds only a tiny sequence-wise balance term (our bias run adds none).
#
# ## 10. The all-to-alls under compute (`--ep-overlap`)
#
# In section 5's timeline nothing runs while the rows travel. The fix: give the link and the cores different work at
# once. DeepSeek-V3 (arXiv:2412.19437, §3.2.2) runs one micro-batch's all-to-alls under another's compute (DualPipe
# pairs a forward chunk with a backward chunk); Megatron-LM has `--overlap-moe-expert-parallel-comm`. Ours works
# inside one micro-batch, with **two parts**:
#
# 1. route, apply the capacity and compute the aux loss on the *whole* micro-batch;
# 2. cut the sorted rows in two: part 1 the first half (rounded up) of each expert's rows, part 2 the rest, each a
#    dispatch of its own (one all-to-all of $2E$ counts for both);
# 3. launch both dispatches; the shared expert runs while they travel; part 1's experts run once dispatch 1 is in;
#    combine 1 is launched and part 2's experts run under it; combine 2.
#
# An expert's output for a row depends on that row alone, so the result is the unsplit layer's to rounding
# (`tests/test_ep_overlap.py` checks the layer, the model, and every rank's order of launches and waits). Backward has
# the same shape, mirrored. One subtlety: data parallelism counts gradient
# *hooks* to know when a bucket is full, so the two parts' weight gradients are summed and handed to autograd once
# (`_accumulate_once`); per part, the hook would fire twice and a bucket be all-reduced half-summed (the parity test
# caught exactly that).
#
# **The formula.** With one part's all-to-all taking $a$ on the link (one message at a time), one part's experts $c$
# and the shared expert $s$, the pass ends with combine 2; what it adds to the compute $s + 2c$ is exposed
# (`planner.ep_overlap_exposed_seconds`):
#
# $$T_\text{exposed} = 2a - \min(s, a) \quad (c \ge a), \qquad 4a - 2c - s \quad (a \ge c \ge s), \qquad 4a \ \text{blocking}$$
#
# — the first dispatch (less the shared expert under it) and the last combine stay exposed; each middle all-to-all
# hides under the other part's experts. The planner charges this per MoE layer and micro-batch for `ep-overlap`
# layouts (backward: the same with $2c$ and $2s$).

# %%
_common.show_source(expert_parallel._TwoParts.forward)
_common.show_source(planner.ep_overlap_exposed_seconds, "a, c, s, t = a2a_s")

# %% [markdown]
# **Measured.** Blocking and overlapped, one step of each in turn: `tiny-deepseek-moe` at dp = ep = 2, each exchange
# on its **own emulated link** (`picotron.link.EmulatedLink`: every all-to-all runs for real, then completes no
# earlier than latency + the bytes this rank sends / bandwidth; the wait is a sleep, costing no core, as a NIC's
# would). The link is sized so one part's all-to-all takes about as long as one part's experts in the forward. Every
# wait for a row all-to-all is timed: the exposed communication.
#
# Part of a wait can be for the *peer* (imbalance), so each wait is also cut where the link had carried its
# message: the time waited *for the link*, which the formula models. It is fed the measured $a$ and the rank's work
# per slot, read off its launches and waits: $s$ (dispatch 1's launch to its wait), $c$ (a part's arrival to the next
# wait) and $t$, part 2's work after launching its combine (the launch itself; in backward, the gradients'
# accumulation, placed there on purpose), which hides part of the last combine (`tail_s`; 0 in the GPU model).

# %%
run("overlap")
ov = _common.load_json(OUT / "overlap_ep2.json")["results"]
print(f"link: {ov['link']['label']}; {ov['layers']} MoE layers; per step (median of the timed steps):")
for r, row in enumerate(ov["ranks"]):
    print(f"  rank {r}: step {1e3 * row['blocking']['step']:.1f} ms blocking, {1e3 * row['overlapped']['step']:.1f} ms "
          f"overlapped; waited for the rows {1e3 * row['blocking']['exposed']:.1f} -> {1e3 * row['overlapped']['exposed']:.1f}"
          f" ms, of which for the link {1e3 * row['blocking']['link_exposed']:.1f} -> "
          f"{1e3 * row['overlapped']['link_exposed']:.1f} ms (planner {1e3 * row['blocking']['predicted']:.1f} -> "
          f"{1e3 * row['overlapped']['predicted']:.1f} ms)")
a, c, s, t = ov["ranks"][0]["terms"][0]
print(f"  rank 0, layer 0, forward: a = {1e3 * a:.2f} ms per part on the link, c = {1e3 * c:.2f} ms per part of work, "
      f"s = {1e3 * s:.2f} ms before the first wait (the shared expert), t = {1e3 * t:.2f} ms after the last launch -> "
      f"exposed {1e3 * planner.ep_overlap_exposed_seconds(a, c, s, t):.2f} ms against {4e3 * a:.2f} ms blocking")
lesson.plot_overlap(ov); plt.show()
for name, ok, detail, busy in lesson.overlap_checks(ov):
    _common.check(name, ok, detail, busy)

# %% [markdown]
# The red bars shrink to where the formula puts them: in each forward the first dispatch (partly under the shared
# expert) and the last combine, in backward the last dispatch-backward; the time waited for the link follows the
# formula. The *step* is not faster by the hidden time here, and can be slower: on 2 cores the compute, gloo's
# transfer threads and the split's bookkeeping (twice the expert calls and launches) share the cores, so each rank
# computes more slowly and waits longer for its peer (the pale bars).
#
# The emulated link shows the schedule; a step's gain needs hardware that moves bytes without the cores.
# `benchmarks/ep_overlap_bench.py` measures step time side by side, with and without an emulated link. On a GPU the
# all-to-all has its own engine (NVLink, RDMA) and the formula's hidden time is what the step saves; the planner's
# time model, for Mixtral-8x7B on one and on two H100 nodes:

# %%
from picotron.plan.hardware import GPUS
from picotron.plan.time_model import step_time
mixtral = ModelConfig.from_preset("mixtral-8x7b")
for text in ("dp8,ep8,zero1,mbs1,ga16", "dp16,ep8,tp2,sp,zero1,mbs1,ga16"):
    t = [step_time(mixtral, planner.Layout.parse(text, ep_overlap=o), 4096, GPUS["h100-80gb"]) for o in (False, True)]
    print(f"{text} (s = 4,096, bf16, H100): all-to-alls exposed {t[0]['ep']:.3f} s -> {t[1]['ep']:.3f} s per step, "
          f"step {t[0]['total']:.2f} s -> {t[1]['total']:.2f} s, MFU {100 * t[0]['mfu']:.1f}% -> {100 * t[1]['mfu']:.1f}%")

# %% [markdown]
#
# **NCCL.** Every rank issues each layer's all-to-alls in the same order (counts, dispatch 1, 2, combine 1, 2;
# backward: combine-backward 1, 2, dispatch-backward 1, 2); only *when* a rank waits moves. Collectives on one
# communicator run in issue order, so two in flight are legal, and nothing on another group (dp, cp, tp) is issued
# between a launch and its wait in a rank-dependent order, so the run fits one order across communicators.
# `tests/test_ep_overlap.py` replays every rank's recorded communication under both of `picotron.nccl_rules`'
# models, with cp, tp, pp, ZeRO-1 and full recomputation.
#
# **Exercise 6.** `two_part_exposed(a, c, s)` in `exercise.py`: the schedule above, event by event, and what it
# leaves exposed. The checker compares with the planner in both regimes and names the usual slips (the blocking
# $4a$, a link carrying two messages at once, combine 2 forgotten, the closed form outside its regime):

# %%
import check as checker   # this folder's check.py
checker.check(["two_part_exposed"])

# %% [markdown]
# **Takeaway:** split the routed rows in two after routing, and each part's all-to-all hides under the other's
# experts; only the first dispatch and the last combine stay on the critical path.
#
# ## 11. On an 8-GPU node you should see
#
# On a node the all-to-alls run over NVLink, every GPU reaching every other directly, and each rank computes on a GPU
# of its own. `PICOTRON_NPROC=8` runs sections 5-7 at ep = 8, tiny-moe given 8 experts (ep must divide them). The
# planner predicts the GPU-size run (8 sequences of 256 tokens per rank): the bytes, their time, the memory.

# %%
import _node   # lessons/_node.py: the planner's predictions for one 8×H100 node, and the command that measures them
_node.show("08_expert_parallel")

# %% [markdown]
# **Takeaway:** at ep = 8 a rank sends 7/8 of its rows away, yet on NVLink their time is mostly the 7 steps' latency
# per all-to-all; the experts' memory falls by 8.
#
# ## 12. Exercises
# Open `lessons/08_expert_parallel/exercise.py`:
#
# 1. `top_k_route(logits, k)`: Mixtral's router (softmax in fp32, top-$k$, renormalise), against `moe.route` for
#    several $(n_\text{tok}, E, k)$; the checker names the token and expert, and recognises weights not
#    renormalised, raw logits as weights, the least probable experts, and a softmax over the wrong dimension.
#
# 2. `dispatch_permutation(experts, E)`: the (token, choice) pairs' order sorted by expert, stable, and the counts;
#    the checker names an unstable sort, token indices for pair indices, a descending sort, an expert missing.
#
# 3. `aux_loss(probs, experts, E)`: $E \sum_e f_e P_e$, value and gradient; the checker recognises $f$ normalised
#    by $k$ (balance would give 1), the missing factor $E$, $P$ averaged over the chosen experts only, and a loss no
#    gradient crosses.
#
# 4. `exchange_splits(counts, group)`: on every ep rank, the rows it sends to and receives from each rank, after
#    exchanging the counts (one collective); run on 2 and 4 processes, the checker names the rank and peer.
#
# 5. `deepseek_router_step(logits, k, bias, gamma)` — DeepSeek-V3's router and bias update (section 9).
#
# 6. `two_part_exposed(a, c, s)` — the exposed seconds of `--ep-overlap`'s two-part schedule (section 10).
#
# Until you write them, the checker reports `NotImplementedError: not written yet`:

# %%
import check as checker   # this folder's check.py
all_passed = checker.check()

# %% [markdown]
# **Takeaway:** the router is three lines; the dispatch is a stable sort; the balance loss is a dot product of a
# count and a mean; the exchange needs the counts before the rows.
#
# ## 13. What it costs, when to use it, what comes next
#
# | | per rank | communication | use it when |
# |---|---|---|---|
# | MoE, experts replicated (ep = 1) | every expert: $3E\,h\,h_\text{ff}$ per layer, states ×16 bytes | gradients all-reduced over dp | the experts fit |
# | expert parallel, ep ranks | $E/ep$ experts per layer + the dense part | per layer and micro-batch: counts, then $4\,n_\text{tok}kh\,(ep-1)/ep$ elements in four all-to-alls (hidden in part with `--ep-overlap`) | the experts do not fit; ep within a node, or routing limited to few nodes |
# | + capacity factor $\kappa$ | bounded expert work | the same, bounded | static shapes (TPUs, CUDA graphs), some tokens dropped |
#
# **Its costs.** The all-to-alls are on the critical path and change size every step (the counts travel first);
# the busiest rank sets everyone's pace, so balancing (loss or bias, section 9) is not optional. Expert gradients
# have their own group (edp) and divisor; ZeRO shards them over edp. Finer experts (DeepSeekMoE) give small matmuls
# that need grouped GEMM kernels.
#
# **What ours lacks** (what Megatron-LM, DeepSpeed-MoE, torchtitan and DeepEP add): grouped GEMM, DualPipe's
# overlap across micro-batches (ours splits one micro-batch, section 10), fp8 dispatch, token dropping with padding
# to static shapes, DeepSeek-V3's group-limited routing and multi-token prediction, expert-choice routing (Zhou et
# al. 2022, each expert picks its tokens), and hierarchical (node-aware) all-to-alls. With context parallelism the
# aux loss's statistics are summed over cp (one all-reduce of $2E$ numbers per layer); a finite capacity is refused
# there (its first-come order runs along the whole sequence).
#
# **Sources.** Shazeer et al. 2017, "Outrageously Large Neural Networks: The Sparsely-Gated Mixture-of-Experts
# Layer" (noisy top-$k$ gating, a balancing loss); Lepikhin et al. 2020, "GShard" (top-2, expert capacity, experts
# sharded across devices with all-to-all); Fedus et al. 2022, "Switch Transformers" (top-1, the $E\sum_e f_e P_e$
# loss, capacity factors); Jiang et al. 2024, "Mixtral of Experts" (softmax then top-2, renormalised; 46.7 B / 12.9 B).
# Dai et al. 2024, "DeepSeekMoE" (arXiv:2401.06066: fine-grained and shared experts); Wang et al. 2024,
# "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts" (arXiv:2408.15664); DeepSeek-AI 2024,
# "DeepSeek-V3 Technical Report" (arXiv:2412.19437, §2.1.2: sigmoid affinities, the bias update, γ = 0.001).
#
# **Next:** lesson 09 puts the strategies together — a 4-D (and with ep, 5-D) layout planned for a real cluster.
#
# **Takeaway:** data parallelism cuts the batch, tensor parallelism the matrices, pipeline parallelism the depth,
# context parallelism the sequence, and expert parallelism the experts — moving tokens instead of weights.
