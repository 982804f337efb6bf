"""Lesson 09's notebook, 09_all_together.ipynb, as plain Python in the percent format (see lessons/_notebook.py):
edit this file, never the notebook.

    python lessons/_notebook.py 09_all_together --run fast    # rebuild the notebook, execute it in FAST mode
"""

# %% [markdown]
# # Lesson 09 — All together: one grid, every strategy, and a plan for a real cluster
#
# Each lesson so far cut one thing. Real runs cut all of them at once: Llama 3 405B trained on 16,384 H100s as
# tp 8 × pp 16 × dp 128 (Dubey et al. 2024, table 4), and its long-context phase added cp 16. Every GPU is one cell
# of a 4-D grid and talks along its four axes, each axis with its own traffic and its own need for bandwidth:
#
# | axis | cuts | what travels, how often | needs |
# |---|---|---|---|
# | tp (lesson 05) | every weight matrix | activations: 2 all-reduces per layer forward, 2 backward, blocking | the fastest links: inside a node |
# | cp (lesson 06) | every sequence | K/V blocks around a ring each layer, under the attention compute | fast links |
# | pp (lesson 07) | the layers | one activation per micro-batch and stage boundary; the bubble | crosses nodes well |
# | dp, ZeRO (lessons 03, 04) | the batch (and the model states) | gradients once per step, under the backward | crosses nodes |
# | ep (lesson 08) | the experts, carved out of dp | two all-to-alls of tokens per MoE layer | inside a node, or few nodes |
#
# We draw the grid from `picotron.mesh` — which rank talks to which, over which link; run one 4-D training on
# real processes and draw every rank's step on one timeline, its bytes by axis against the formulas; check it
# against one process, and read the whole parity matrix; check the memory and time model of `picotron.planner`
# against measurements; and then use that model the way a training team does: for a model, a number of GPUs and a
# sequence length, find the layouts that fit, reach the global batch, and are fastest. The experiments are
# `experiment.py` in this folder, launched with `torchrun`; `PICOTRON_FAST=1` gives a short run.

# %%
import sys
import matplotlib.pyplot as plt
sys.path.insert(0, "..")   # lessons/: the helpers every lesson shares
import _common
from picotron import mesh as grid
from picotron.model import ModelConfig

FAST, OUT = _common.FAST, _common.run_dir("09_all_together")
import experiment as lesson   # this folder's experiment.py: its measurements, formulas and plots
MiB, GB = 2**20, 1e9

def run(only, nproc):
    # torchrun --nproc_per_node nproc lessons/09_all_together/experiment.py --out OUT --only <only>
    out = _common.launch("09_all_together/experiment.py", ["--out", OUT, "--only", only], nproc=nproc, quiet=True)
    print("\n".join(line for line in out.splitlines() if not line.startswith(("step ", "picotron |", "done: "))))

def check(name, ok, detail):
    print(f"{'✓' if ok else '✗'} {name}: {detail}")

def at(coords):
    return " ".join(f"{d}{coords[d]}" for d in grid.ORDER)

st = lesson.settings(FAST)
LAYOUT = st["layout"]
W = LAYOUT["dp"] * LAYOUT["pp"] * LAYOUT["cp"] * LAYOUT["tp"]
mc = ModelConfig.from_preset(st["preset"])
print(f"FAST={FAST}, results in {OUT.relative_to(_common.ROOT)}; the run: {lesson.layout_name(LAYOUT)} = {W} processes "
      f"of the '{st['preset']}' model ({mc.num_params() / 1e6:.2f} M parameters, {mc.num_hidden_layers} layers, "
      f"h={mc.hidden_size}), {st['grad_acc']} micro-batches of {st['micro_batch_size']} x {st['seq_len']} tokens per "
      f"replica and step")

# %% [markdown]
# ## 1. The grid: who talks to whom, over which link
#
# `picotron.mesh` numbers the ranks row-major over (dp, pp, cp, tp), **tp fastest**:
#
# $$\text{rank} = ((d \cdot P + p) \cdot C + c) \cdot T + t$$
#
# for coordinates $(d, p, c, t)$ on a grid of sizes $(D, P, C, T)$. A **group** along an axis is every rank that
# agrees with you on the three other coordinates (`mesh.group_ranks`); each strategy only talks inside its group.
# Launchers (torchrun, Slurm) give consecutive ranks to the GPUs of one node, so the order decides which groups
# stay inside a node: tp's groups are consecutive ranks, cp's are $T$ apart, pp's $CT$ apart, dp's $PCT$ apart.
# One rank of the 16-rank grid dp2 × pp2 × cp2 × tp2:

# %%
SIZES16 = dict(dp=2, pp=2, cp=2, tp=2)
r = 11
coords = grid.grid_coords(r, SIZES16)
print(f"rank {r}: coordinates {coords}; rank back from them: {grid.grid_rank(coords, SIZES16)}")
for axis in lesson.AXES:
    g = next(g for g in grid.group_ranks(SIZES16, axis) if r in g)
    print(f"  its {axis} group: {g}   ({lesson.WHAT_TRAVELS[axis]})")

# %% [markdown]
# Put those 16 ranks on nodes of 4 GPUs: a node is one row of the drawing. Each panel joins the groups of one axis,
# green where a group stays inside a node (NVLink: H100 nodes give each GPU ~450 GB/s each way), orange where it
# crosses nodes (InfiniBand: ~50 GB/s per GPU with one 400 Gb/s NIC per GPU), the link ratio that decides where
# each strategy may go.

# %%
lesson.plot_grid4d(SIZES16, gpus_per_node=4); plt.show()
for per_node in (4, 8):
    info = lesson.groups_and_links(SIZES16, per_node)
    print(f"{per_node} GPUs per node: " + "; ".join(
        f"{a} {sum(x == 'inter' for x in info[a]['links'])}/{len(info[a]['groups'])} groups cross nodes"
        for a in lesson.AXES))

# %%
info4, info8 = lesson.groups_and_links(SIZES16, 4), lesson.groups_and_links(SIZES16, 8)
check("4 GPUs per node: every tp and cp group inside a node, every pp and dp group across nodes",
      all(x == "intra" for a in ("tp", "cp") for x in info4[a]["links"])
      and all(x == "inter" for a in ("pp", "dp") for x in info4[a]["links"]),
      "tp fastest, then cp: the chatty axes get the consecutive ranks")
check("8 GPUs per node: only dp crosses nodes", [a for a in lesson.AXES if "inter" in info8[a]["links"]] == ["dp"],
      "tp, cp and pp inside a node; the gradients' all-reduce, once per step, crosses")
flipped = lesson.groups_with_order(SIZES16, ("tp", "cp", "pp", "dp"))  # dp fastest, tp slowest
check("numbered the other way round (dp fastest), every tp group would cross nodes",
      all(lesson.link_of(g, 4) == "inter" for g in flipped["tp"]) and all(lesson.link_of(g, 4) == "intra"
                                                                         for g in flipped["dp"]),
      f"tp groups {flipped['tp'][:2]}...: 8 ranks apart, on two nodes, each all-reduce on InfiniBand")

# %% [markdown]
# At scale the same rule holds. Llama 3 405B's grid on 16,384 GPUs (8 per node): how many nodes each axis's group
# spans, and what share of its groups leave a node:

# %%
for name, sizes in (("Llama 3 405B, 8k context", dict(dp=128, pp=16, cp=1, tp=8)),
                    ("Llama 3 405B, 128k context", dict(dp=8, pp=16, cp=16, tp=8))):
    info = lesson.groups_and_links(sizes, 8)
    print(f"{name}: {lesson.layout_name(sizes)} = {16384:,} GPUs; " + "; ".join(
        f"{a}{sizes[a]}: groups span {info[a]['nodes']} node{'s' if info[a]['nodes'] > 1 else ''}"
        for a in lesson.AXES if sizes[a] > 1))

# %% [markdown]
# tp 8 fills a node exactly; everything else crosses the network. In the 128k-context phase cp's ring spans 16
# nodes: each K/V block travels over InfiniBand, hidden under attention whose cost grows with $s^2$ while the
# block grows with $s$ — long sequences are what make cp affordable across nodes.
#
# **Takeaway:** the rank order is a placement decision: tp fastest keeps the blocking all-reduces on NVLink, and
# what crosses nodes is what overlaps (dp's gradients) or is small (pp's activations).
#
# ## 2. One 4-D run: every rank's step on one timeline
#
# The tiny model on real processes (gloo on this CPU): `picotron.train` for a few steps, then more steps built
# the same way (`parallelize`) with a recorder on every axis and a timeline on the pipeline executor and on every
# ring-attention core, then the same global batch on one process. In full mode that is dp2 × pp2 × cp2 × tp2,
# 16 processes on 2 cores; FAST drops dp (pp2 × cp2 × tp2, 8 processes), the gradients then averaged over the cp
# pair (dp × cp = 2).

# %%
run("run4d", nproc=W)
env = _common.load_json(OUT / f"run4d_{lesson.layout_name(LAYOUT)}.json")
res = env["results"]
steps = res["timed_steps"][-1]
print(f"{res['name']}: {W} processes, the timed step took {1e3 * min(steps):.0f}-{1e3 * max(steps):.0f} ms on the "
      f"ranks; picotron.train's {st['steps']} steps took {res['train_s']:.1f} s, one process with the same batch "
      f"{res['reference']['seconds']:.1f} s")
lesson.plot_timeline4d(res); plt.show()

# %% [markdown]
# Read it by blocks of ranks. The first pipeline stage (pp0) runs 1F1B's warm-up forward, then alternates; the last
# stage starts by waiting (green) for the first activation, and its forwards and backwards alternate from the
# start. Inside every F and B the red bars are tensor parallelism's all-reduces — the densest traffic, a few per
# layer and micro-batch — and the purple ones the ring-attention waits for the next K/V block. The gradients'
# all-reduce over dp × cp (blue) comes once, after the last backward, then the gradient norm's all-reduce over
# every rank (brown) and the optimizer step. Where each rank's time went:

# %%
lesson.plot_shares(res); plt.show()
sh = [lesson.shares(x) for x in res["timed"]]
comm = sum(s[c] for s in sh for c in lesson.COMM_CLASSES) / sum(s["step"] for s in sh)
print(f"over all ranks: compute {sum(s['compute'] for s in sh) / sum(s['step'] for s in sh):.0%} of the rank-time, "
      f"communication {comm:.0%}, idle {sum(s['idle'] for s in sh) / sum(s['step'] for s in sh):.0%}; "
      f"{W} processes share {env['cores']} cores")

# %% [markdown]
# On this machine the communication share is mostly not the network: every process needs a core and $W$
# processes share two, so a rank in an all-reduce is usually waiting for a partner that has no core. The bytes are
# the part that carries over to GPUs. Each rank's bytes per step, by axis, against what the layout and the model's
# shapes say (`lesson.bytes_formula`: tp's four all-reduces per layer and micro-batch plus the embedding's and the
# loss's; cp's ring blocks; pp's one activation per micro-batch; dp × cp's every gradient once):

# %%
print(f"{'rank':>4} {'coords':<14} " + " ".join(f"{a:>14}" for a in ("tp", "cp", "pp", "dp_cp", "world")))
for x in res["timed"][:4] + res["timed"][-2:]:
    got = lesson.measured_bytes(x)
    print(f"{x['rank']:>4} {at(x['coords']):<14} " + " ".join(f"{got.get(a, 0) / MiB:>12.3f} M" for a in ("tp", "cp", "pp", "dp_cp", "world")))

# %%
mismatch = [(x["rank"], a) for x in res["timed"] for a, v in lesson.bytes_formula(res, x["coords"]).items()
            if lesson.measured_bytes(x).get(a) != v]
check(f"every rank's bytes per step, on every axis, are the formula's, to the byte ({W} ranks)", not mismatch,
      f"mismatches {mismatch[:3]}" if mismatch else
      f"tp {lesson.bytes_formula(res, res['timed'][0]['coords'])['tp'] / MiB:.2f} MiB on the first stage; "
      f"cp {lesson.bytes_formula(res, res['timed'][0]['coords'])['cp'] / MiB:.2f} MiB; "
      f"pp {lesson.bytes_formula(res, res['timed'][0]['coords'])['pp'] / MiB:.2f} MiB; "
      f"dp x cp {lesson.bytes_formula(res, res['timed'][0]['coords'])['dp_cp'] / MiB:.3f} MiB")

# %% [markdown]
# The formula and the run agree on every rank and axis. With the tiny model the tp all-reduces dominate the bytes
# (activations of $b \cdot s/cp \cdot h$ numbers, many times per layer) while the gradients cross once; at scale
# the gradients are much larger ($4\Psi/(tp \cdot pp)$ bytes per GPU) but overlap the backward.
#
# **Takeaway:** every strategy keeps its own traffic on its own axis; one timeline shows them nested — tp and cp
# inside every pipeline action, pp between them, dp at the end.
#
# ## 3. Check it: the 4-D run trains like one process
#
# The same seed, the same global batch (the one process accumulates dp × grad_acc micro-batches), fp32: the
# per-step loss within $10^{-5}$ relative over the first 10 steps (the [parity standard](../../docs/reference.md#parity-standard)),
# and after them within the drift bound $10^{-3}$. The gradient norm is a sum of squares over every gradient,
# taken here in another order (slices over tp, stages over pp, each counted once from its marks): we hold it to
# $10^{-4}$, as in lesson 08.

# %%
GRAD_TOL = 1e-4
got, ref = res["run"], res["reference"]
p_, g_ = _common.parity(got["losses"], ref["losses"]), _common.parity(got["grad_norms"], ref["grad_norms"], tol=GRAD_TOL)
print(f"loss: {got['losses'][0]:.4f} -> {got['losses'][-1]:.4f} on {W} processes, {ref['losses'][0]:.4f} -> "
      f"{ref['losses'][-1]:.4f} on one; max relative difference {p_['worst']:.1e} over steps 1-{p_['window']}"
      + (f", {p_['beyond']:.1e} after" if p_["n_beyond"] else "") + f"; gradient norm {g_['worst']:.1e}")
lesson.plot_parity({f"{res['name']} ({W} processes)": (got["losses"], ref["losses"])}); plt.show()
for line in _common.parity_checks(res["name"], got["losses"], ref["losses"], where="lesson 03, section 5"):
    check(*line)
check(f"gradient norm {res['name']}", g_["ok"], f"within {GRAD_TOL:.0e} relative over steps 1-10: max {g_['worst']:.1e}")

# %% [markdown]
# What each rank holds, against the one process (bytes of the last step; activations: the peak of the pipeline's
# stash). Model states divide by tp × pp (the norms' weights are copies on every tp rank); activations divide by
# tp for the sharded parts, by cp for every token-wise tensor, and the 1F1B stash holds up to $pp - i$ micro-batches
# on stage $i$:

# %%
one = ref["mem"]
for x in res["ranks"][:1] + res["ranks"][-1:]:
    m = x["mem"]
    print(f"rank {res['ranks'].index(x):>2} ({at(x['coords'])}): "
          f"params {m['params'] / MiB:.2f} MiB, grads {m['grads'] / MiB:.2f}, AdamW {m['optimizer'] / MiB:.2f}, "
          f"activations {m['activations'] / MiB:.2f} MiB")
print(f"one process:         params {one['params'] / MiB:.2f} MiB, AdamW {one['optimizer'] / MiB:.2f}, activations "
      f"{one['activations'] / MiB:.2f} MiB")
held = sum(x["params"] for x in res["ranks"] if x["coords"]["dp"] == 0 and x["coords"]["cp"] == 0)
check("the parameters of one replica's tp x pp ranks add up to the model (+ the norms copied on each tp rank)",
      held - mc.num_params() == (LAYOUT["tp"] - 1) * mc.hidden_size * (2 * mc.num_hidden_layers + 1),
      f"{held:,} held against {mc.num_params():,}: {(LAYOUT['tp'] - 1)} extra copy of the {2 * mc.num_hidden_layers + 1} "
      f"norm vectors of {mc.hidden_size}")

# %% [markdown]
# **The whole matrix.** One 4-D run proves one layout. `tests/test_parity_matrix.py --parity-matrix` runs every
# layout with dp, pp, cp, tp in {1, 2}, each with and without sequence parallelism (where tp = 2) and ZeRO-1 (where
# dp·cp > 1), and ep = 2 on the MoE model: each against one process, every gradient of a step compared (ZeRO
# shards, tp slices and experts gathered first), and the loss, gradient norm and validation loss of 3 steps. Its
# last result, committed as `figures/09_parity_matrix.json`:

# %%
matrix = _common.load_json(_common.ROOT / "figures" / "09_parity_matrix.json")
meta, rows = matrix["meta"], matrix["rows"]
ran = [x for x in rows if not x.get("refused")]
print(f"{meta['command']}\n{meta['variants']} variants: {meta['ran']} ran ({meta['passed']} passed), {meta['refused']} "
      f"refused; {meta['wall_s_sum']:.0f} s of parallel runs on {meta['cpu_cores']} cores (torch {meta['torch']})")
worst = {k: max(ran, key=lambda x: x[k]) for k in ("grad_rel", "loss_rel", "grad_norm_rel")}
for k, x in worst.items():
    print(f"  worst {k:<13} {x[k]:.1e}  ({x['variant']}, {x['processes']} processes)")
lesson.plot_matrix(matrix); plt.show()

# %%
check("every variant of the matrix that ran passed", all(x["passed"] for x in ran) and len(ran) == meta["ran"],
      f"{len(ran)} of {len(ran)}: gradients within 1e-5 of their tensor's largest, worst {worst['grad_rel']['grad_rel']:.1e}")
check("the refused ones are exactly experts with cp = 2 (one sentence from the configuration)",
      all(x["layout"]["ep"] > 1 and x["layout"]["cp"] > 1 for x in rows if x.get("refused")),
      f"{meta['refused']} refused: {next(x['refused'] for x in rows if x.get('refused'))[:70]}...")

# %% [markdown]
# ## 7. Exercises
# Open `lessons/09_all_together/exercise.py`:
#
# 1. `place(rank, sizes)` — a rank's coordinates on a 4-D grid and its four groups. The checker compares every rank
#    of five grids (up to 48 ranks) with `picotron.mesh`, names the rank, the axis and the group, and recognises dp
#    numbered fastest and a group along the wrong axis.
# 4. `step_batch(global_batch_tokens, seq_len, micro_batch_size, sizes)` — sequences per step, micro-batches per
#    replica, the tokens one rank holds of a micro-batch, and the 1F1B bubble; an impossible batch refused. The
#    checker recognises the sequences divided over dp × cp or over every rank, and the bubble relative to the
#    useful time.
#
# Until you write them, the checker reports `NotImplementedError: not written yet`:

# %%
import check as checker   # this folder's check.py
all_passed = checker.check()
