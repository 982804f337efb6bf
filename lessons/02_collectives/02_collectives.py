"""Lesson 02's notebook, 02_collectives.ipynb, as plain Python in the percent format (see lessons/_notebook.py):
edit this file, never the notebook.

    python lessons/_notebook.py 02_collectives --run fast    # rebuild the notebook, execute it in FAST mode
"""

# %% [markdown]
# # Lesson 02 — Collectives: all-reduce and friends, built from send and receive
#
# Every parallel strategy in this course is a pattern of a few **collective** operations: data parallelism
# all-reduces gradients, ZeRO reduce-scatters gradients and all-gathers parameters, tensor parallelism all-reduces
# activations, expert parallelism all-to-alls tokens. `picotron/collectives.py` writes all of them with nothing but
# point-to-point `send`/`recv`, with `torch.distributed`'s arguments. This lesson
#
# * draws what each collective does, from what our code produced on 4 processes;
# * takes the **ring all-reduce** apart: step by step, in a dozen lines, then picotron's pipelined version;
# * measures every collective against the built-in (`gloo` here, `nccl` on GPUs), fits the **α–β model**
#   $T = \alpha + \beta M$, and asks when a **tree** beats the ring (a puzzle for you);
# * says what NCCL does on a real GPU node.
#
# The measurements live in `experiment.py` (launched with `torchrun`); `PICOTRON_FAST=1` runs short settings.

# %%
import contextlib, io, math, sys
import matplotlib.pyplot as plt
sys.path.insert(0, "..")   # lessons/: the helpers every lesson shares
import _common
from picotron import collectives as C
from picotron.model import ModelConfig

FAST, OUT = _common.FAST, _common.run_dir("02_collectives")
NPROC = _common.nproc("02_collectives", 4)   # PICOTRON_NPROC=8: sections 2, 4 and 5 on 8 ranks (section 10)
import experiment as lesson   # this folder's experiment.py: the measurements and the plots
import check as checker       # this folder's check.py: the exercises' checker
MiB, GB = 2**20, 1e9
print(f"FAST={FAST}, {NPROC} processes, results in {OUT.relative_to(_common.ROOT)}")

# %% [markdown]
# ## 1. The problem: n copies of a gradient must become one sum, everywhere
#
# Data parallelism runs the same model on $n$ devices ([notation](../../docs/reference.md#notation)); after
# backward each holds its own gradient and each needs their **sum** (the all-reduce). With one link of bandwidth
# $B$ each way per device, how long does it take, counting only bytes, in units of $M/B$ (the whole gradient
# through one link once)?
#
# * **star**: everybody sends to one rank, which adds and sends the sum back: $2(n-1)$ units at that rank.
# * **binomial tree**: reduce up a tree in $\lceil\log_2 n\rceil$ rounds, broadcast down in as many, each round
#   moving the whole $M$: $2\lceil\log_2 n\rceil$ units.
# * **ring**: $2(n-1)$ steps of $M/n$, every rank sending and receiving at once: $2(n-1)/n$ units — less than 2.

# %%
N = 2 * ModelConfig.from_preset("llama3-8b").num_params()      # bf16 gradients: 2 bytes each
ns = [2, 4, 8, 64, 512, 4096]
units = {"star: 2(n−1)": [2 * (n - 1) for n in ns], "tree: 2⌈log₂n⌉": [2 * math.ceil(math.log2(n)) for n in ns],
         "ring: 2(n−1)/n": [2 * (n - 1) / n for n in ns]}
print(f"Llama-3-8B gradients in bf16: M = {N / GB:.1f} GB. All-reduce time in units of M/B:")
print(f"{'n':>6}" + "".join(f"{k.split(':')[0]:>8}" for k in units))
for i, n in enumerate(ns):
    print(f"{n:>6}" + "".join(f"{v[i]:>8.4g}" for v in units.values()))
lesson.plot_panels([dict(title="all-reduce: the bandwidth term", ylabel="time in units of M/B", yscale="log",
                         lines=[(k, ns, v, dict(marker="o")) for k, v in units.items()])], "devices n", size=(6, 3.2))
plt.show()

# %% [markdown]
# The star's root grows linearly in $n$, the tree with $\log n$; the ring stays flat: each link carries a little
# under $2M$ each way, on 8 or 4096 devices. Latency is the other half (section 6): the ring needs $2(n-1)$
# sequential steps, the tree only $2\lceil\log_2 n\rceil$.
#
# **Takeaway:** only the ring's bandwidth term does not grow with $n$: about $2M/B$ on any number of devices.
#
# ## 2. Eight collectives, drawn from a real run
# 4 processes under `torchrun`; each rank's tensor holds **encoded chunks** (rank $r$'s chunk $j$ stores
# $2^r + 256j$, so any sum decodes to *which ranks' which chunk* it contains). Each picture is what **our** code
# produced, checked in the same run against the built-in. Colours are ranks (a = rank 0, …), the subscript the
# chunk, stripes sums. The first four only **move** data, from one rank to all or all to one:

# %%
_common.launch("02_collectives/experiment.py", ["--out", OUT, "--only", "correctness,trace"], nproc=NPROC)
correctness = _common.load_json(OUT / "correctness.json")["results"]
trace = _common.load_json(OUT / "trace.json")["results"]
pics = correctness["pictures"]
lesson.plot_collectives(pics, ["broadcast", "scatter", "gather", "all_gather"]); plt.show()

# %% [markdown]
# all-to-all moves every piece somewhere else; the other three **reduce** (here: sum; also max, min, product,
# average):

# %%
lesson.plot_collectives(pics, ["all_to_all", "reduce", "all_reduce", "reduce_scatter"]); plt.show()
print("ours == built-in on these pictures:", {name: p["equal_builtin"] for name, p in pics.items()})

# %% [markdown]
# Two identities for the rest of the course:
#
# * **all-reduce = reduce-scatter + all-gather.** After a reduce-scatter rank $r$ holds the finished chunk $r$; an
#   all-gather hands every chunk to everybody. ZeRO (lesson 04) stops half-way and all-gathers only when needed.
# * **all-to-all is a transpose** of the (rank × chunk) grid: expert parallelism's pattern.
#
# Costs with $n$ ranks, $M$ bytes in the nccl-tests convention (all-reduce and broadcast: the buffer; all-gather
# and gather: the **output**; reduce-scatter, scatter, all-to-all: the **input**), $\alpha$ one message's latency,
# $\beta$ one link's time per byte ([reference](../../docs/reference.md#collectives-and-their-cost)):
#
# | collective | our algorithm | steps | bytes sent by each rank (busiest) | α–β time |
# |---|---|---|---|---|
# | broadcast | binomial tree | $\lceil\log_2 n\rceil$ | $\lceil\log_2 n\rceil M$ (the root) | $\lceil\log_2 n\rceil(\alpha + M\beta)$ |
# | reduce | binomial tree, backwards | $\lceil\log_2 n\rceil$ | $M$ (the root receives $\lceil\log_2 n\rceil M$) | $\lceil\log_2 n\rceil(\alpha + M\beta)$ |
# | all-reduce | ring: reduce-scatter + all-gather | $2(n-1)$ | $2\frac{n-1}{n}M$ | $2(n-1)\alpha + 2\frac{n-1}{n}M\beta$ |
# | reduce-scatter, all-gather | ring | $n-1$ | $\frac{n-1}{n}M$ | $(n-1)\alpha + \frac{n-1}{n}M\beta$ |
# | all-to-all | pairwise exchange | $n-1$ | $\frac{n-1}{n}M$ | $(n-1)\alpha + \frac{n-1}{n}M\beta$ |
# | gather, scatter | straight to/from the root | $n-1$ at the root | $\frac{n-1}{n}M$ (the root) | $(n-1)\alpha + \frac{n-1}{n}M\beta$ |
# | naive all-reduce | tree reduce + tree broadcast | $2\lceil\log_2 n\rceil$ | $\lceil\log_2 n\rceil M$ (the root; it receives as much) | $2\lceil\log_2 n\rceil(\alpha + M\beta)$ |
# | barrier | dissemination | $\lceil\log_2 n\rceil$ | 1 byte per step | $\lceil\log_2 n\rceil\alpha$ |
#
# **Takeaway:** eight operations, two families (movers and reducers), and every one of ours equals the built-in
# (section 8 checks far more inputs).
#
# ## 3. The ring all-reduce, step by step
# Cut the tensor into $n$ chunks; every rank sends only to its right neighbour and receives from its left.
# **Reduce-scatter** ($n-1$ steps): in step $j$ rank $r$ sends its running sum of chunk $(r-j-1) \bmod n$ and
# *adds* the chunk $(r-j-2) \bmod n$ it receives; at the end rank $r$ owns the finished chunk $r$. The trace below
# was **recorded** from `picotron.collectives.all_reduce` on 4 processes (every message intercepted); a black
# border marks the chunk received in that step.

# %%
ring = trace["ring"]
n = ring["n"]
lesson.plot_ring_steps(ring, 0, n - 1); plt.show()

# %% [markdown]
# **All-gather** ($n-1$ more steps): each rank passes the finished chunks ($\Sigma$) on and *copies* what it
# receives.

# %%
lesson.plot_ring_steps(ring, n - 1, 2 * (n - 1)); plt.show()
print(f"recorded: {len(ring['frames']) - 1} steps = 2(n-1) for n = {n}; replaying the messages gives "
      f"all_reduce's own result: {ring['consistent']}")

# %% [markdown]
# One step at a time, with numbers: rank $r$'s chunk $j$ is $10(r+1)+j$ (rank 0: 10 11 12 13, rank 1: 20 21 22 23,
# …); the full sum of chunk $j$ is $100 + 4j$. Move the slider in a live kernel; a static viewer shows step 3, the
# last reduce-scatter step, where every rank completes its own chunk.

# %%
def show_step(step=3):
    lesson.plot_ring_step(ring, step); plt.show()

# drawn once with the defaults (what a static viewer shows); in a live kernel, controls that redraw it
_common.interactive(show_step, lambda w: dict(step=w.IntSlider(value=3, min=0, max=len(ring["frames"]) - 1, description="step", continuous_update=False)))

# %% [markdown]
# ### Why the ring is bandwidth-optimal
# Follow one element: each rank must end with a value depending on all $n$ inputs, and a message carries what its
# sender knows so far. Gathering all contributions somewhere takes $n-1$ messages, spreading the result $n-1$
# more: $2(n-1)$ (the *one-way gossip problem*; no schedule does fewer). So the ranks send at least $2(n-1)M$ bytes
# together, the busiest at least $2\frac{n-1}{n}M$, and the ring hits that bound **on every rank at once**
# (Patarasuk & Yuan 2009 prove it for all-reduce on a cluster). The bytes each rank sent in each of our collectives:

# %%
vol = trace["volume"]
print(f"{'collective':<24}{'M (bytes)':>10}  {'sent by each rank (measured)':<40}{'formula':<40}")
for name, v in vol.items():
    print(f"{name:<24}{v['bytes']:>10,}  {str(v['sent']):<40}{str(v['expected_sent']):<40}")
n, N = trace["world_size"], vol["all_reduce"]["bytes"]
print(f"\nring all-reduce: every rank sent {vol['all_reduce']['sent'][0]:,} B = 2(n-1)/n·M = {2 * (n - 1) * N // n:,} B;"
      f" the tree (naive) all-reduce's root sent {max(vol['naive_all_reduce']['sent']):,} B")

# %% [markdown]
# **Takeaway:** $2(n-1)$ steps of one chunk each; every rank sends exactly the lower bound, $2\frac{n-1}{n}M$.
#
# ## 4. The ring in a dozen lines, then picotron's
# The whole algorithm, from this lesson's `experiment.py`. Reduce-scatter and all-gather use the same indices; *add*
# becomes *copy*. Each step posts its send and receive **before** waiting for either: with a blocking `send` first
# on every rank, all could sit in their sends, nobody receiving (depending on message size and backend: a bug that
# shows only sometimes).

# %%
_common.show_source(lesson.simple_ring_all_reduce)

# %% [markdown]
# On 2, 3 and 4 processes, on integers (lengths $n$ divides and does not) against the built-in `all_reduce`, bytes
# counted; the 4-process run also times it (figure below).

# %%
runs = {}
for k in (2, 3):
    _common.launch("02_collectives/experiment.py", ["--out", OUT / f"n{k}", "--only", "ring", "--no-timing"], nproc=k, quiet=True)
    runs[k] = _common.load_json(OUT / f"n{k}" / "ring.json")["results"]
_common.launch("02_collectives/experiment.py", ["--out", OUT, "--only", "ring"], nproc=NPROC, quiet=True)
runs[NPROC] = rv = _common.load_json(OUT / "ring.json")["results"]
for k, r in runs.items():
    print(f"n = {k}: equal to the built-in, bit for bit, for lengths {r['lengths']}: {r['equal']}; bytes sent per rank "
          f"for M = {r['volume_bytes']:,} B: simple {r['sent']['simple']}, picotron's {r['sent']['picotron']}")

# %% [markdown]
# Same result, same bytes. picotron's `all_reduce` runs the same two lists of steps (`_rs_steps`, `_ag_steps`)
# through `_ring`, which adds three things:
#
# 1. **pipelining**: chunks are cut into pieces of `PIECE_BYTES` that travel on their own; a piece of step $j+1$
#    leaves once the same piece of step $j$ has arrived and been added, so adding one piece overlaps receiving the
#    next (NCCL's slices);
# 2. **one batch per exchange**: the send and receive of (step, piece) are posted as one `batch_isend_irecv`
#    (`picotron/p2p.py`), in the same order on every rank, as NCCL needs (section 7);
# 3. scratch buffers kept between calls (fresh memory costs a page fault per 4 KiB on the CPU).

# %%
_common.show_source(C._rs_steps)
_common.show_source(C._ag_steps)
_common.show_source(C.all_reduce)
_common.show_source(C._ring)

# %% [markdown]
# Pipelining can hide at best the reduce-scatter's $n-1$ chunk additions behind the transfers (the dashed line,
# from one addition's measured time), and only where something sits idle. On this CPU the cores that add also move
# the bytes, an addition is cheap next to a transfer, and chunks below `PIECE_BYTES` are not cut: at $n = 4$ nothing
# changes up to $4\times$`PIECE_BYTES`. At small sizes `_ring`'s longer Python per step can cost more than
# pipelining saves. The simple ring keeps its receive buffer between calls too, so only the schedule is compared.

# %%
lesson.plot_ring_variants(rv); plt.show()
T, sizes, n = rv["time"], rv["sizes"], rv["world_size"]
print(f"{'bytes':>12}" + "".join(f"{k:>11}" for k in T) + f"{'(n-1) adds':>11}{'1 piece/simple':>16}{'pieces/1 piece':>16}")
for j, size in enumerate(sizes):
    print(f"{size:>12,}" + "".join(f"{1e3 * T[k][j]:>11.2f}" for k in T) + f"{1e3 * (n - 1) * rv['add'][j]:>11.2f}"
          f"{T['one piece'][j] / T['simple'][j]:>16.2f}{T['pieces'][j] / T['one piece'][j]:>16.2f}")
piped = [j for j, size in enumerate(sizes) if size > n * rv["piece_bytes"]]
same = sorted(T["pieces"][j] / T["one piece"][j] for j in range(len(sizes)) if j not in piped)
print(f"(times in ms) pipelining cuts chunks only above n × PIECE_BYTES = {n * rv['piece_bytes'] // MiB} MiB; below, "
      f"'pieces' and 'one piece' run the same code, so their ratio there ({same[0]:.2f} to {same[-1]:.2f}) is this "
      f"machine's noise. " + (" ".join(f"At {sizes[j] // MiB} MiB, pieces / one piece = "
                                         f"{T['pieces'][j] / T['one piece'][j]:.2f}, and the additions it could hide are "
                                         f"{100 * (n - 1) * rv['add'][j] / T['one piece'][j]:.0f}% of the time."
                                         for j in piped) or "No size measured here is that large."))

# %% [markdown]
# **Takeaway:** the ring itself is a dozen lines; the rest of `_ring` is scheduling, which pays where a step is long
# and the hardware overlaps (a GPU's links move bytes while its SMs add); the last two columns say what each bought.
#
# ### The binomial tree
# Broadcast (and reduce, run backwards): relative to the root, a rank's parent is itself minus its lowest set bit,
# its children are itself plus each smaller power of two. Round $j$ doubles the number of ranks that hold the data.
# Pieces flow here too: a rank forwards each piece to its children as soon as that piece has arrived.

# %%
_common.show_source(C._tree)
_common.show_source(C.broadcast)

# %% [markdown]
# **Takeaway:** the tree needs only $\lceil\log_2 n\rceil$ rounds each way, but its root sends the whole message
# once per round.
#
# ## 5. Bandwidth against the built-in
# Every collective, ours and `torch.distributed`'s, on the same buffers over message sizes, alternating inside every
# repeat so a disturbance hits both; a repeat's time is the slowest rank's (after a barrier), and we keep the median.
# As nccl-tests reports it:
#
# $$\text{algbw} = \frac{M}{T}, \qquad \text{busbw} = \text{algbw}\cdot f(n),\quad f = \tfrac{2(n-1)}{n}\ \text{(all-reduce)},\ \tfrac{n-1}{n}\ \text{(all-gather, reduce-scatter, all-to-all, gather, scatter)},\ 1\ \text{(broadcast, reduce)}.$$
#
# busbw is the busiest link's speed under the ring's traffic, comparable across collectives, $n$ and the hardware's
# link speed.

# %%
_common.launch("02_collectives/experiment.py", ["--out", OUT, "--only", "bandwidth"], nproc=NPROC, quiet=True)
env = _common.load_json(OUT / "bandwidth.json")
bw = env["results"]
print(f"{env['device']} / {env['backend']}, {bw['world_size']} ranks, {env['cpus']} CPU cores, torch {env['torch']}, "
      f"{env['seconds']:.0f} s; sizes {bw['sizes'][0] // 1024} KiB .. {bw['sizes'][-1] // MiB} MiB")
at = bw["ratio_at"]
print(f"{'collective':<24}{'ours ms':>9}{'built-in ms':>12}{'busbw ours':>12}{'built-in':>10}{'ours/built-in':>15}"
      f"   α–β fit ours: α µs, 1/β GB/s | built-in")
for name, r in bw["results"].items():
    j = r["bytes"].index(at)
    fo, fb = r["ours"]["fit"], r["builtin"]["fit"]
    print(f"{name:<24}{1e3 * r['ours']['time'][j]:>9.2f}{1e3 * r['builtin']['time'][j]:>12.2f}{r['ours']['busbw'][j]:>12.2f}"
          f"{r['builtin']['busbw'][j]:>10.2f}{bw['ratio'][name]:>15.2f}   {fo['alpha_us']:8.0f} {fo['inv_beta_GBps']:6.2f} | "
          f"{fb['alpha_us']:8.0f} {fb['inv_beta_GBps']:6.2f}")
b = bw["barrier"]
print(f"{'barrier':<24}{1e3 * b['ours']:>9.2f}{1e3 * b['builtin']:>12.2f}")
print(f"\nmeasured: ring all-reduce busbw at {at // MiB} MiB on {bw['world_size']} ranks = {bw['ratio']['all_reduce']:.2f}× "
      f"the built-in's (1 = as fast; a timing on a shared machine: shown, never asserted)")
lesson.plot_ratio(bw); plt.show()

# %% [markdown]
# Points are measurements, dashed lines the fitted α–β model (least squares on the relative error; α and 1/β in
# the table above) as the bus bandwidth it predicts, $f(n)\,M/(\alpha+\beta M)$: flat near zero while $\alpha$
# dominates, rising through $M \approx \alpha/\beta$, levelling at $f(n)/\beta$ (perhaps beyond the largest sizes
# here). The tensor forms (`all_gather_into_tensor`, `reduce_scatter_tensor`) run the same rings as the list forms:
# in the table and the bar chart.

# %%
lesson.plot_bandwidth(bw, ["all_reduce", "reduce_scatter", "all_gather", "all_to_all"]); plt.show()

# %%
lesson.plot_bandwidth(bw, ["broadcast", "reduce", "gather", "scatter"]); plt.show()

# %% [markdown]
# On this CPU the "links" are loopback TCP sockets, and the two cores run all four processes, the socket copies and
# gloo's threads. So $\alpha$ is large (each step needs the peer process *scheduled*) and $1/\beta$ is a memory-copy
# rate. Ours against the built-in is fair (same processes, buffers, moment), but the absolute numbers say nothing
# about a GPU node, where the same code measures NCCL.
#
# **Takeaway:** every collective follows $T = \alpha + \beta M$ roughly; on a CPU, α is scheduling and 1/β a
# memory-copy rate, so compare ours with the built-in, not with a GPU.
#
# ## 6. When a tree wins: latency
# The ring's bandwidth term is optimal, but its latency term $2(n-1)\alpha$ grows with $n$; the tree's is
# $2\lceil\log_2 n\rceil\alpha$. Our `naive_all_reduce` (binomial-tree reduce, then broadcast) against the ring:

# %%
lesson.plot_naive_vs_ring(bw); plt.show()
ring_r, naive_r = bw["results"]["all_reduce"], bw["results"]["naive_all_reduce"]
ring_wins = [b for b, tr, tn in zip(ring_r["bytes"], ring_r["ours"]["time"], naive_r["ours"]["time"]) if tr <= tn]
print(f"measured: the tree is faster than our ring at {len(ring_r['bytes']) - len(ring_wins)} of {len(ring_r['bytes'])} "
      f"sizes; the ring is faster at: " + (", ".join(f"{b / 1024:,.0f} KiB" for b in ring_wins) or "none"))

# %% [markdown]
# Now the model. Reading the ring fit as $T = 2(n-1)\,\alpha_\text{step} + 2\frac{n-1}{n}M\,\beta_\text{link}$
# gives one message's latency and one link's time per byte; with them the tree costs
# $2\lceil\log_2 n\rceil(\alpha_\text{step} + M\beta_\text{link})$, and the two cross at
#
# $$M^* = \frac{2\alpha\,(n-1-\lceil\log_2 n\rceil)}{\beta\,\bigl(2\lceil\log_2 n\rceil - 2\frac{n-1}{n}\bigr)}.$$
#
# Below $M^*$ the tree wins. With 4 ranks the latency gap is small (6 steps against 4); with 512 it is 1022 against
# 18, and the tree wins up to much larger messages.
#
# On this CPU $M^*$ for 4 ranks need not match where the ring won above. The model gives every rank its own link;
# here four processes share two cores and one memory bus, so what costs is the total of bytes copied, the same
# $2(n-1)M$ for both (the ring spreads it evenly, the tree does not). And a tree hop needs two processes scheduled,
# a ring step all of them (the last line compares the fits' α). So expect the tree to keep up to larger sizes than
# the model says. (Our tree cuts messages above `PIECE_BYTES` into pieces, the model's does not.)

# %%
n = bw["world_size"]
link = lesson.per_link(ring_r["ours"]["fit"], n)
a, b = link["alpha_step"], link["beta_link"]
print(f"from the ring fit on {n} ranks: α = {a * 1e6:.0f} µs per message, 1/β = {1e-9 / b:.2f} GB/s per link")
for m in (4, 8, 64, 512):
    x = lesson.crossover_bytes(m, a, b)
    print(f"  n = {m:>3}: the tree wins below M* = {x / 1024:,.0f} KiB" if x else f"  n = {m:>3}: the tree never wins")
tree_hop = naive_r["ours"]["fit"]["alpha"] / (2 * math.ceil(math.log2(n)))
print(f"the tree's own fit: α = {tree_hop * 1e6:.0f} µs per hop, against {a * 1e6:.0f} µs per ring step"
      + (" — on an oversubscribed CPU a ring step needs all ranks to be scheduled, a tree hop only two: one likely reason"
         " why the ring pays more per step here than the model's single α assumes" if tree_hop < 0.8 * a else ""))
lesson.plot_model((4, 8, 64, 512), a, b); plt.show()

# %% [markdown]
# A real library picks per call, by size and topology. A binomial tree's root sends the whole message once per
# round, so its bandwidth term stays $\lceil\log_2 n\rceil M\beta$ however pipelined; NCCL's *double binary tree*
# uses two binary trees each carrying half the data, every rank an inner node in at most one, so no link carries
# much more than $M$: a bandwidth term near the ring's with a logarithmic latency.
#
# ### Puzzle (exercise 4)
# With this machine's α and β, before computing anything: (a) 4 ranks all-reduce 64 KiB: ring or tree, and by how
# much? (b) 64 ranks and 16 MiB? (c) 1024 ranks and 1 MiB? Then write `allreduce_time` and `ring_or_tree` in
# `exercise.py`; this cell prints your answers (rerun it after editing), and the checker (section 11) tests them
# against the model and a real run of both algorithms.

# %%
mine = checker.load(checker.LEARNER, "ex02")   # exercise.py, freshly imported
try:
    for m, size in ((4, 64 * 1024), (64, 16 * MiB), (1024, MiB)):
        winner, factor = mine.ring_or_tree(m, size, a, b)
        print(f"n = {m:>4}, {size / 1024:>7,.0f} KiB: your model says the {winner} is {factor:.2f}× faster")
except NotImplementedError:
    print("exercise.py's ring_or_tree is not written yet: write it, then rerun this cell")

# %% [markdown]
# **Takeaway:** in the model, below $M^*$ latency rules and the tree wins, above it the ring, and $M^*$ grows with
# $n$. The model assumes a link per rank, which this CPU lacks; the puzzle's checker tests it over an emulated link.
#
# ## 7. What NCCL does on a real node
# NCCL automates all of the above on GPUs (details depend on versions):
#
# * **Topology.** It detects NVLink, NVSwitch, PCIe switches and NICs (`NCCL_TOPO_DUMP_FILE` writes what it found)
#   and searches for **rings and trees** over them. On an 8-GPU NVSwitch node (DGX/HGX H100) every GPU reaches every
#   other at full NVLink speed, so any ring order works; across nodes they run over the NICs.
#
# * **Channels.** Several rings/trees run in parallel, each a *channel* driven by its own CUDA thread block (its own
#   SM) on a slice of the buffer, to use all links and enough memory bandwidth; more channels take more SMs from
#   compute.
#
# * **Algorithms.** Ring and Tree (a pipelined *double binary tree* since NCCL 2.4, mostly across nodes), CollNet
#   (reductions inside InfiniBand switches, SHARP), and with third-generation NVSwitch **NVLS** (NVLink SHARP, NCCL ≥
#   2.17): the switch adds all GPUs' data and multicasts the result, freeing SMs for all-reduce; for all-gather and
#   reduce-scatter it moves fewer bytes but promises no speed-up (NVIDIA/nccl issues #807, #1506). NVLSTree adds
#   trees across nodes.
#
# * **Protocols.** *Simple*: large chunks, memory fences to signal completion; full bandwidth, highest latency. *LL*
#   (low latency): 8-byte words of 4 bytes data + 4 bytes flag, polled by the receiver; lowest latency, at most half
#   the bandwidth. *LL128*: 128-byte lines of 120 bytes data + 8 bytes flag (about 94% of the bandwidth), safe only
#   where 128-byte stores arrive in order, so enabled only on verified platforms, e.g. NVLink (NVIDIA/nccl #281, #786).
#
# * **Tuning.** Per call, NCCL's cost model (per algorithm and protocol, latency plus bandwidth, like our α–β) picks
#   from the message size, ranks per node, nodes and measured link speeds: typically LL for small messages, Simple
#   for large, LL128 between where enabled, tree or ring by size and topology; no fixed rule (NVIDIA/nccl #754).
#   `NCCL_ALGO` and `NCCL_PROTO` force a choice (for debugging); `NCCL_DEBUG=INFO` prints what it built.
#
# * **Measuring.** `nccl-tests` (`all_reduce_perf -b 1K -e 1G -f 2 -g 8`) reports `algbw` and `busbw` as this lesson
#   does; compare busbw with the NVLink or NIC speed. On 2 nodes Tree can show a busbw above the network's speed (the
#   formula assumes ring traffic); force `NCCL_ALGO=Ring` to benchmark the network itself.
#
# **Takeaway:** NCCL is this lesson's ring and tree, pipelined in slices over many channels, with an α–β-style cost
# model choosing per call.
#
# ### The order of messages: why the dozen-line ring would hang on NCCL
# gloo matches each message by sender and tag and buffers it; NCCL does neither. The single `isend`/`irecv` between
# two ranks share one communicator and one CUDA stream, both directions mixed, run in the order posted; a receive
# holds the stream until its send arrives, and a send its receive (NCCL may buffer a small one; the replay below
# never counts on it). And the first message between two ranks *creates* their communicator, blocking the host
# until the peer posts its own first message to us.
#
# Section 4's ring posts "send right, receive left" as two single messages: at $n = 2$ both ranks' streams start
# with a send to the other; at $n = 3$ every rank's first message waits for its right neighbour, which waits for its
# own: a circle.
#
# `picotron.collectives` posts each step's send and receive as **one batch** (`batch_isend_irecv`,
# `picotron/p2p.py`), in the same order on every rank: a batch runs on the group's own communicator and meets the
# neighbours' batches whole.
#
# `picotron.nccl_rules` records every rank's messages on gloo and replays them under those rules, naming each
# rank's first stuck operation (`nccl_order.py` in this folder runs both rings):

# %%
from picotron import nccl_rules
from picotron.launch import run_on_ranks
import nccl_order   # this folder: section 4's ring, and picotron.collectives.all_reduce

verdicts = {}
for n in (2, 3):
    dozen = run_on_ranks(nccl_rules.run_recorded, n, nccl_order.dozen_line_ring)
    verdicts[n] = nccl_rules.replay([trace for _, trace in dozen])
    print(f"dozen-line ring, n = {n}: gloo's sum {dozen[0][0][:3]}...; {verdicts[n]}")
ours = run_on_ranks(nccl_rules.run_recorded, 3, nccl_order.picotron_ring)
verdicts["ours"] = nccl_rules.replay([trace for _, trace in ours])
print(f"picotron.collectives.all_reduce, n = 3: {verdicts['ours']}")
ok = not verdicts[2].ok and not verdicts[3].ok and verdicts["ours"].ok
print(f"{'✓' if ok else '✗'} NCCL's rules: the dozen-line ring hangs at n = 2 and 3, picotron's batched ring completes: "
      f"replayed from gloo recordings ({verdicts['ours'].ops} operations matched)")

# %% [markdown]
# **Takeaway:** on NCCL the order in which ranks post their messages is part of correctness: post each step's send
# and receive as one batch, in the same order on every rank. `nccl_rules` replays a gloo recording to show it.
#
# ## 8. Check it
# Every claim, as a measured fact (timings are shown above, never asserted):

# %%
def check(name, ok, detail):
    print(f"{'✓' if ok else '✗'} {name}: {detail}")

rows = correctness["rows"]
ints = [r for r in rows if r["dtype"] == "int64"]
floats = [r for r in rows if r["dtype"] == "float32"]
check("ours == built-in, int64, bit for bit", all(r["bitwise_equal"] for r in ints),
      f"{sum(r['bitwise_equal'] for r in ints)}/{len(ints)} cases: {len({r['collective'] for r in ints})} collectives, "
      f"SUM/MAX/MIN, on the world and on the sub-group of ranks {correctness['sub_group']}, uneven lengths")
worst = max(r["max_abs_diff"] for r in floats)
check("ours ≈ built-in, float32", worst < 1e-4, f"max |diff| {worst:.1e}; bit for bit in {sum(r['bitwise_equal'] for r in floats)}/"
      f"{len(floats)} cases (the rest add in another order: float addition is not associative)")
check("the pictures: ours == built-in", all(p["equal_builtin"] for p in pics.values()), f"{len(pics)} collectives on encoded chunks")
msgs = [m for f in ring["frames"] for m in f["messages"]]
check("ring all-reduce: 2(n-1) steps, one message per rank per step, always to the right",
      len(ring["frames"]) - 1 == 2 * (ring["n"] - 1) and all(m["dst"] == (m["src"] + 1) % ring["n"] for m in msgs)
      and len(msgs) == 2 * (ring["n"] - 1) * ring["n"], f"{len(ring['frames']) - 1} steps, {len(msgs)} messages")
check("replaying the recorded messages gives all_reduce's result", ring["consistent"], "sources, every rank and chunk")
n, v = trace["world_size"], vol["all_reduce"]
check("ring all-reduce sends 2(n-1)/n·N per rank (the lower bound)", v["sent"] == [2 * (n - 1) * v["bytes"] // n] * n,
      f"{v['sent'][0]:,} B of N = {v['bytes']:,} B on each of {n} ranks")
check("bytes sent == formula, every collective", all(x["sent"] == x["expected_sent"] for x in vol.values()), f"{len(vol)} collectives")
check("simple_ring_all_reduce == built-in, int64, bit for bit", all(all(r["equal"]) for r in runs.values()),
      f"on {', '.join(map(str, runs))} processes, lengths {runs[NPROC]['lengths']}")
check("simple ring and picotron's send the same bytes: 2(n-1)/n·N per rank",
      all(r["sent"]["simple"] == r["sent"]["picotron"] == [2 * (k - 1) * r["volume_bytes"] // k] * k for k, r in runs.items()),
      f"N = {runs[NPROC]['volume_bytes']:,} B on {', '.join(map(str, runs))} processes")
with contextlib.redirect_stdout(io.StringIO()) as log:
    solutions_pass = checker.check(module=checker.SOLUTIONS)
check("the exercise checker passes the reference solutions", solutions_pass,
      "on 2, 3 and 4 processes; the puzzle against the model and a real run" if solutions_pass else log.getvalue())

# %% [markdown]
# **Takeaway:** our collectives equal the built-in bit for bit on integers (on floats they differ only by the order
# of the additions), and each sends exactly the bytes its formula says: for the ring, the lower bound.
#
# ## 9. Explore: ring or tree?
# Choose the devices, one message's latency and one link's bandwidth; the α–β model redraws both all-reduces' time
# against message size. Try GPU-like values (a few µs, tens to hundreds of GB/s per link) against this CPU's: where
# the tree stops paying is a question of $\alpha/\beta$, the size at which the bytes cost as much as the start.

# %%
def draw_model(n=64, alpha_us=10.0, link_GBps=50.0):
    lesson.plot_model((n,), alpha_us * 1e-6, 1e-9 / link_GBps, ratio=False); plt.show()

# drawn once with the defaults (what a static viewer shows); in a live kernel, controls that redraw it
_common.interactive(draw_model, lambda w: dict(n=w.SelectionSlider(options=[2, 4, 8, 16, 64, 256, 1024, 4096], value=64),
                                               alpha_us=w.FloatLogSlider(value=10, base=10, min=0, max=4, description="α µs"),
                                               link_GBps=w.FloatLogSlider(value=50, base=10, min=-1, max=3, description="1/β GB/s")))

# %% [markdown]
# **Takeaway:** where the tree stops paying depends on $n$ and $\alpha/\beta$ alone: a larger latency or a faster
# link moves it to larger messages.

# %% [markdown]
# ## 10. On an 8-GPU node you should see
# On eight H100s the same code measures NCCL over NVLink (450 GB/s each way per GPU) instead of gloo over loopback
# sockets, and `PICOTRON_NPROC=8` runs the collectives of sections 2, 4 and 5 on all 8 ranks. The α–β model
# predicts a 256 MiB all-reduce near the link's bus bandwidth, and a 1 KiB one that is all latency: $2(n-1)$ steps
# of α. NCCL also switches to trees for small messages, which the planner's rings do not model.

# %%
import _node   # lessons/_node.py: the planner's predictions for one 8×H100 node
_node.show("02_collectives")

# %% [markdown]
# **Takeaway:** on NVLink, large messages reach the link's bandwidth and small ones pay α per step; the command
# above measures both.
#
# ## 11. Exercises
# Open `lessons/02_collectives/exercise.py` and write, with only `send`/`recv`/`isend`/`irecv`:
#
# 1. `ring_all_gather(tensor)` — every rank's tensor, concatenated in rank order, on every rank;
# 2. `ring_reduce_scatter(tensor)` — chunk $r$ of the sum on rank $r$ (chunks as `torch.tensor_split`: uneven lengths!);
# 3. `tree_broadcast(tensor, src)` — in place, along a binomial tree, at most $\lceil\log_2 n\rceil$ messages per rank;
#
# and, for the puzzle of section 6,
#
# 4. `allreduce_time(algorithm, n, nbytes, alpha, beta)` and `ring_or_tree(n, nbytes, alpha, beta)`.
#
# The checker runs 1–3 on 2, 3 and 4 real processes and names exactly what is wrong: *"rank 2: element 0 is 618,
# expected 1024 — rank 3's contribution is missing"*, *"rank 0 sent a message to rank 2: in a ring every rank sends
# only to its right neighbour"*, or, when ranks wait for each other forever, *"hang: ranks 0, 1 are still waiting
# after 10 s"* with the line each one waits on.
#
# For 4 it compares your formulas with the model on many cases, naming the usual slips (*"that is one tree (a
# reduce or a broadcast); the naive all-reduce runs two"*), then runs picotron's ring and tree on 4 processes over
# an emulated link (20 ms per message, 20 MB/s: this CPU's own costs are small next to it) and checks your predicted
# times against the measured ones (within ×0.9 to ×1.5: a busy machine only adds time) and your winner. Run it here
# or as `./run.sh python lessons/02_collectives/check.py [name]`; until you write them it reports
# `NotImplementedError: not written yet`.

# %%
all_passed = checker.check()

# %% [markdown]
# **Takeaway:** a collective is a schedule of sends and receives; writing one, the usual mistakes are a missing
# contribution, a message to the wrong neighbour and two ranks waiting for each other — the checker names each.
#
# ## 12. What it costs, when to use it, what comes next
# | collective | bytes per rank (busiest) | used by |
# |---|---|---|
# | all-reduce | $2\frac{n-1}{n}M$ (ring) | data parallelism: gradients (lesson 03); tensor parallelism: activations |
# | reduce-scatter | $\frac{n-1}{n}M$ | ZeRO: gradient shards (lesson 04); sequence parallelism |
# | all-gather | $\frac{n-1}{n}M$ | ZeRO-3: parameters before use; sequence parallelism |
# | all-to-all | $\frac{n-1}{n}M$ | expert parallelism: tokens to their experts and back |
# | broadcast | $\lceil\log_2 n\rceil M$ (tree root) | initial weights; the loss from the last pipeline stage |
# | send / recv | $M$ | pipeline parallelism (activations between stages), context parallelism (K/V around a ring) |
#
# * **Bandwidth**: the ring is built for large messages, $2M$ per rank whatever $n$; bucket small tensors into large
#   messages (lesson 03 does, with gradients).
# * **Latency**: $2(n-1)$ sequential steps; at small sizes or large $n$ trees win, and a good library picks per call.
# * **Overlap**: a GPU can hide a collective behind computation; the next lessons overlap the gradient all-reduce
#   with backward.
#
# Next, **lesson 03** uses `all_reduce` for data parallelism: $n$ replicas, one gradient sum per step, bucketed and
# overlapped with backward, training like one big batch.
#
# **Takeaway:** every later parallelism is one of these collectives on some group of ranks, costing about $\alpha$ per
# step plus its bytes per rank times $\beta$: large messages, few steps and overlap are what the next lessons work for.
