"""Lesson 02's notebook, 02_collectives.ipynb, as plain Python in the percent format (see lessons/_notebook.py):
edit this file, never the notebook.

    python lessons/_notebook.py 02_collectives --run fast    # rebuild the notebook, execute it in FAST mode
"""

# %% [markdown]
# # Lesson 02 — Collectives: all-reduce and friends, built from send and receive
#
# Every parallel strategy in this course is, underneath, a pattern of a handful of **collective** operations:
# data parallelism all-reduces gradients, ZeRO reduce-scatters gradients and all-gathers parameters, tensor
# parallelism all-reduces activations (or all-gathers and reduce-scatters them with sequence parallelism),
# expert parallelism all-to-alls tokens. Before using them we build them: `picotron/collectives.py` writes
# broadcast, reduce, all-reduce, gather, all-gather, scatter, reduce-scatter, all-to-all and barrier with
# nothing but point-to-point `send`/`recv`, with exactly `torch.distributed`'s arguments, and this lesson
#
# * draws what each collective does, from what our code actually produced on 4 processes;
# * takes the **ring all-reduce** apart step by step, and shows why it is bandwidth-optimal;
# * measures every collective against the built-in (`gloo` here, `nccl` on GPUs) and fits the
#   **α–β model** $T = \alpha + \beta\,N$ to the curves; shows when a **tree** beats the ring;
# * says what NCCL does on a real GPU node;
# * checks that ours equals the built-in, bit for bit on integers.
#
# The experiment lives in `lessons/02_collectives/experiment.py` (launched with `torchrun` on 4 processes);
# `PICOTRON_FAST=1` runs short settings (about a minute on 2 CPU cores), the default is the real lesson.

# %%
import contextlib, io, math, sys
import matplotlib.pyplot as plt
sys.path.insert(0, "..")   # lessons/: the helpers every lesson shares
import _common
from picotron import collectives as C
from picotron.model import ModelConfig

FAST, OUT, NPROC = _common.FAST, _common.run_dir("02_collectives"), 4
import experiment as lesson   # this folder's experiment.py: its model, trace and plots
MiB, GB = 2**20, 1e9
print(f"FAST={FAST}, {NPROC} processes, results in {OUT.relative_to(_common.ROOT)}")

# %% [markdown]
# ## 1. The problem: n copies of a gradient must become one sum, everywhere
#
# Data parallelism runs the same model on $n$ devices, each on its own data; after the backward pass every device
# holds its own gradient and every device needs their **sum** (the all-reduce). For Llama-3-8B in bf16 that is
# 16 GB per step. If every device has one link of bandwidth $B$ each way, how long does the all-reduce take —
# counting only the bytes, in units of $N/B$, the time to push the whole gradient through one link once?
#
# * **star**: everybody sends to one rank, which adds and sends the sum back. That rank receives $(n-1)N$, then
#   sends $(n-1)N$: $2(n-1)$ units.
# * **binomial tree**: reduce up a tree in $\lceil\log_2 n\rceil$ rounds, broadcast down in as many, each round
#   moving the whole $N$: $2\lceil\log_2 n\rceil$ units.
# * **ring**: $2(n-1)$ steps of $N/n$, every rank sending and receiving at once: $2(n-1)/n$ units — less than 2.

# %%
N = 2 * ModelConfig.from_preset("llama3-8b").num_params()      # bf16 gradients: 2 bytes each
print(f"Llama-3-8B gradients in bf16: N = {N / GB:.1f} GB. All-reduce time in units of N/B (one link, bytes only):")
ns = [2, 4, 8, 64, 512, 4096]
star, tree, ring_ = [2 * (n - 1) for n in ns], [2 * math.ceil(math.log2(n)) for n in ns], [2 * (n - 1) / n for n in ns]
print(f"{'n':>6} {'star':>8} {'tree':>8} {'ring':>8}")
for row in zip(ns, star, tree, ring_):
    print(f"{row[0]:>6} {row[1]:>8} {row[2]:>8} {row[3]:>8.3f}")
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(ns, star, "o-", label="star: 2(n−1)")
ax.plot(ns, tree, "o-", label="tree: 2⌈log₂n⌉")
ax.plot(ns, ring_, "o-", label="ring: 2(n−1)/n")
ax.set(xscale="log", yscale="log", xlabel="devices n", ylabel="time in units of N/B", title="all-reduce: the bandwidth term")
ax.legend(fontsize=8); plt.show()

# %% [markdown]
# The star's root drowns linearly in $n$; the tree grows with $\log n$; the ring stays flat: at 8 devices or at
# 4096, each link carries a little under $2N$ each way, and the all-reduce takes about $2N/B$ no matter how many
# devices share the work. That is why every data-parallel framework uses it — and
# what this lesson builds. Latency is the other half of the story (section 4): the ring needs $2(n-1)$ steps
# one after the other, the tree only $2\lceil\log_2 n\rceil$.
#
# ## 2. The idea: eight collectives, drawn from a real run
# The run below starts 4 processes with `torchrun`; each rank's tensor holds **encoded chunks** (rank $r$'s chunk
# $c$ stores $2^r + 256c$, so any sum decodes back to *which ranks' which chunk* it contains). Each picture is
# what **our** implementation produced — and, checked in the same run, exactly what the built-in produced.
# Colours are ranks (a = rank 0, b = rank 1, …), the subscript is the chunk, stripes are sums.

# %%
_common.launch("02_collectives/experiment.py", ["--out", OUT, "--only", "correctness,trace"], nproc=NPROC)
correctness = _common.load_json(OUT / "correctness.json")["results"]
trace = _common.load_json(OUT / "trace.json")["results"]
pics = correctness["pictures"]
lesson.plot_collectives(pics, ["broadcast", "scatter", "gather", "all_gather", "all_to_all"]); plt.show()

# %% [markdown]
# Those five only **move** data. The next three **reduce** it (here: sum; also max, min, product, average):

# %%
lesson.plot_collectives(pics, ["reduce", "all_reduce", "reduce_scatter"]); plt.show()
print("ours == built-in on these pictures:", {name: p["equal_builtin"] for name, p in pics.items()})

# %% [markdown]
# Two identities to keep in mind for the rest of the course:
#
# * **all-reduce = reduce-scatter + all-gather.** After a reduce-scatter rank $i$ holds the finished chunk $i$;
#   an all-gather then hands every finished chunk to everybody. ZeRO (lesson 04) stops half-way: it keeps the
#   reduce-scatter's shard and all-gathers only when the full tensor is needed.
# * **all-to-all is a transpose** of the (rank × chunk) grid: the pattern of expert parallelism.
#
# What each one costs, with $n$ ranks, $N$ bytes in the nccl-tests convention (the whole buffer of all-reduce and
# broadcast, the whole **output** of all-gather and gather, the whole **input** of reduce-scatter, scatter and
# all-to-all), $\alpha$ the latency of one message and $\beta$ the time per byte of one link (sources in the
# [reference](../../docs/reference.md#collectives-and-their-cost)):
#
# | collective | our algorithm | steps | bytes sent by each rank (busiest) | α–β time |
# |---|---|---|---|---|
# | broadcast | binomial tree | $\lceil\log_2 n\rceil$ | $\lceil\log_2 n\rceil N$ (the root) | $\lceil\log_2 n\rceil(\alpha + N\beta)$ |
# | reduce | binomial tree, backwards | $\lceil\log_2 n\rceil$ | $N$ (the root receives $\lceil\log_2 n\rceil N$) | $\lceil\log_2 n\rceil(\alpha + N\beta)$ |
# | all-reduce | ring: reduce-scatter + all-gather | $2(n-1)$ | $2\frac{n-1}{n}N$ | $2(n-1)\alpha + 2\frac{n-1}{n}N\beta$ |
# | reduce-scatter, all-gather | ring | $n-1$ | $\frac{n-1}{n}N$ | $(n-1)\alpha + \frac{n-1}{n}N\beta$ |
# | all-to-all | pairwise exchange | $n-1$ | $\frac{n-1}{n}N$ | $(n-1)\alpha + \frac{n-1}{n}N\beta$ |
# | gather, scatter | straight to/from the root | $n-1$ at the root | $\frac{n-1}{n}N$ (the root) | $(n-1)\alpha + \frac{n-1}{n}N\beta$ |
# | naive all-reduce | tree reduce + tree broadcast | $2\lceil\log_2 n\rceil$ | $\lceil\log_2 n\rceil N$ (the root; it receives as much) | $2\lceil\log_2 n\rceil(\alpha + N\beta)$ |
# | barrier | dissemination | $\lceil\log_2 n\rceil$ | 1 byte per step | $\lceil\log_2 n\rceil\alpha$ |
#
# ### The ring all-reduce, step by step
# Cut the tensor into $n$ chunks. Every rank sends only to its right neighbour and receives only from its left one.
# **Reduce-scatter** ($n-1$ steps): in step $t$ rank $r$ sends its running sum of chunk $(r-t-1) \bmod n$ and
# *adds* the chunk $(r-t-2) \bmod n$ it receives; after $n-1$ steps rank $r$ owns the finished chunk $r$.
# **All-gather** ($n-1$ more steps): each rank passes the finished chunks around and *copies* what it receives.
# The trace below was **recorded** from `picotron.collectives.all_reduce` on 4 processes (every message
# intercepted, with its data), not drawn by hand: a black border marks the chunk a rank received in that step.

# %%
ring = trace["ring"]
lesson.plot_ring_all_steps(ring); plt.show()
print(f"recorded: {len(ring['frames']) - 1} steps = 2(n-1) for n = {ring['n']}; replaying the messages gives "
      f"all_reduce's own result: {ring['consistent']}")

# %% [markdown]
# One step at a time, with the values (rank 0 starts with 10 11 12 13, rank 1 with 20 21 22 23, …; the sum of
# chunk $c$ is $100 + 4c$). Move the slider in a live kernel; a static viewer shows step 3, the last
# reduce-scatter step, where every rank completes its own chunk.

# %%
def show_step(step=3):
    lesson.plot_ring_step(ring, step); plt.show()

# drawn once with the defaults (what a static viewer shows); in a live kernel, controls that redraw it
_common.interactive(show_step, lambda w: dict(step=w.IntSlider(value=3, min=0, max=len(ring["frames"]) - 1, description="step", continuous_update=False)))

# %% [markdown]
# ### Why the ring is bandwidth-optimal
# Follow one element. In the end each of the $n$ ranks must hold a value that depends on all $n$ inputs. Every
# message carries what its sender knows so far (a partial sum), one way. How many one-way messages does it take
# until everybody has heard from everybody? This is the *one-way gossip problem*, and the answer is
# $2(n-1)$: $n-1$ messages to bring all contributions together somewhere, $n-1$ more to spread the result (no
# cleverer schedule does it with fewer). So for $N$ bytes, the ranks together must send at least $2(n-1)\,N$ bytes,
# and the busiest rank at least the average, $2\frac{n-1}{n}N$.
#
# The ring hits that bound **on every rank at once**: $2(n-1)$ steps of $N/n$ bytes each. The bound does not grow
# with $n$ — the bandwidth term of the ring is independent of the number of devices (Patarasuk & Yuan 2009 prove
# the same bound for all-reduce algorithms on a cluster). The recording also counted the bytes each rank sent
# in every one of our collectives; they match the table exactly:

# %%
vol = trace["volume"]
print(f"{'collective':<24}{'N (bytes)':>10}  {'sent by each rank (measured)':<40}{'formula':<40}")
for name, v in vol.items():
    print(f"{name:<24}{v['bytes']:>10,}  {str(v['sent']):<40}{str(v['expected_sent']):<40}")
n, N = trace["world_size"], vol["all_reduce"]["bytes"]
print(f"\nring all-reduce: every rank sent {vol['all_reduce']['sent'][0]:,} B = 2(n-1)/n·N = {2 * (n - 1) * N // n:,} B;"
      f" the tree (naive) all-reduce's root sent {max(vol['naive_all_reduce']['sent']):,} B")

# %% [markdown]
# ## 3. Read the code
# The heart of `picotron/collectives.py` is one function, `_ring`, that runs a list of ring steps — each step
# *(chunk to send, chunk to receive, reduce it?)* — and the two lists that make reduce-scatter and all-gather.
# All-reduce is just both lists, one after the other:

# %%
_common.show_source(C._rs_steps)
_common.show_source(C._ag_steps)
_common.show_source(C.all_reduce)

# %% [markdown]
# `_ring` cuts every chunk into pieces (`PIECE_BYTES`) that travel independently: piece $j$ of step $t+1$ leaves
# as soon as piece $j$ of step $t$ arrived and was reduced, so adding one piece overlaps receiving the next — the
# same **pipelining** NCCL does with its chunks. It also posts the receive of step $t+1$ (into the second of two
# scratch buffers) *before* waiting for step $t$, and always posts a step's receive before its send, so a
# neighbour's data never waits for us to ask for it and no two ranks can sit in a send waiting for each other.
# With $n = 2$ both neighbours are the same rank, and the lower rank sends first.

# %%
_common.show_source(C._ring)

# %% [markdown]
# The binomial tree (broadcast; reduce runs it backwards): relative to the root, a rank's parent is itself minus
# its lowest set bit, its children are itself plus each smaller power of two. Round $k$ doubles the number of
# ranks that hold the data. The broadcast is pipelined too: a rank forwards piece $j$ to its children as soon
# as piece $j$ has arrived.

# %%
_common.show_source(C._tree)
_common.show_source(C.broadcast)

# %% [markdown]
# ## 4. Run it: bandwidth against the built-in
# The benchmark runs every collective, ours and `torch.distributed`'s, on the same buffers from 1 KiB to 64 MiB
# (FAST: up to 16 MiB), alternating the two inside every repeat so that a disturbance hits both. A repeat's time
# is the slowest rank's (after a barrier); we keep the median. Then, as nccl-tests reports it:
#
# $$\text{algbw} = \frac{N}{T}, \qquad \text{busbw} = \text{algbw}\cdot f(n),\quad f = \tfrac{2(n-1)}{n}\ \text{(all-reduce)},\ \tfrac{n-1}{n}\ \text{(all-gather, reduce-scatter, all-to-all, gather, scatter)},\ 1\ \text{(broadcast, reduce)}.$$
#
# busbw is the speed of the busiest link under the ring's traffic pattern, which is what makes numbers of
# different collectives (and different $n$) comparable with each other and with the hardware's link speed.

# %%
_common.launch("02_collectives/experiment.py", ["--out", OUT, "--only", "bandwidth"], nproc=NPROC)
bw = _common.load_json(OUT / "bandwidth.json")
env, bw = bw, bw["results"]
print(f"\n{env['device']} / {env['backend']}, {bw['world_size']} ranks, {env['cpus']} CPU cores, torch {env['torch']}, "
      f"{env['seconds']:.0f} s")

# %%
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
# The curves: points are measurements, dashed lines the α–β model $T = \alpha + \beta N$ fitted to them (least
# squares on the relative error, so small and large messages count alike), drawn as the bus bandwidth it predicts,
# $f(n)\,N/(\alpha+\beta N)$. Every curve has the same shape: flat near zero while the fixed cost $\alpha$
# dominates, rising through $N \approx \alpha/\beta$, levelling off at $f(n)/\beta$.

# %%
lesson.plot_bandwidth(bw); plt.show()

# %% [markdown]
# Reading the CPU numbers: the "links" here are loopback TCP sockets, and the "reduction engine" is the same two
# CPU cores that run all four processes, the kernel's socket copies and gloo's threads. So $\alpha$ is large
# (each step needs the peer process to be *scheduled*, not just a wire to carry a packet) and $1/\beta$ is a
# memory-copy rate, not a network's. The comparison between ours and the built-in is fair — same processes,
# same buffers, same moment — but the absolute numbers say nothing about a GPU node: run this notebook on one
# and the same code measures NCCL.
#
# ### When a tree wins: latency
# The ring's bandwidth term is optimal, but its latency term $2(n-1)\alpha$ grows with $n$; the tree's is
# $2\lceil\log_2 n\rceil\alpha$. Our `naive_all_reduce` (binomial-tree reduce, then broadcast) against the ring:

# %%
lesson.plot_naive_vs_ring(bw); plt.show()
ring_r, naive_r = bw["results"]["all_reduce"], bw["results"]["naive_all_reduce"]
faster = [b for b, tr, tn in zip(ring_r["bytes"], ring_r["ours"]["time"], naive_r["ours"]["time"]) if tn < tr]
print(f"measured: the tree is faster than our ring for {len(faster)} of {len(ring_r['bytes'])} sizes"
      + (f", up to {max(faster) / 1024:,.0f} KiB" if faster else ""))

# %% [markdown]
# Now the model. Reading the ring fit as $T = 2(n-1)\,\alpha_\text{step} + 2\frac{n-1}{n}N\,\beta_\text{link}$ gives
# one message's latency and one link's time per byte; with them, the tree costs
# $2\lceil\log_2 n\rceil(\alpha_\text{step} + N\beta_\text{link})$ and the two cross at
#
# $$N^* = \frac{2\alpha\,(n-1-\lceil\log_2 n\rceil)}{\beta\,\bigl(2\lceil\log_2 n\rceil - 2\frac{n-1}{n}\bigr)}.$$
#
# Below $N^*$ the tree wins. With 4 ranks the latency gap is small (6 steps against 4), with 512 it is 1022
# against 18: then the tree wins up to much larger messages. (The model's tree sends the whole message at every hop; ours
# is pipelined in pieces of `PIECE_BYTES`, so above that size its measured bandwidth term is smaller than the model's.)

# %%
n = bw["world_size"]
link = lesson.per_link(ring_r["ours"]["fit"], n)
a, b = link["alpha_step"], link["beta_link"]
print(f"from the ring fit on {n} ranks: α = {a * 1e6:.0f} µs per message, 1/β = {1e-9 / b:.2f} GB/s per link")
for m in (4, 8, 64, 512):
    x = lesson.crossover_bytes(m, a, b)
    print(f"  n = {m:>3}: the tree wins below N* = {x / 1024:,.0f} KiB" if x else f"  n = {m:>3}: the tree never wins")
tree_hop = naive_r["ours"]["fit"]["alpha"] / (2 * math.ceil(math.log2(n)))
print(f"the tree's own fit: α = {tree_hop * 1e6:.0f} µs per hop, against {a * 1e6:.0f} µs per ring step"
      + (" — on an oversubscribed CPU a ring step needs all ranks to be scheduled, a tree hop only two: one likely reason"
         " why the ring pays more per step here than the model's single α assumes" if tree_hop < 0.8 * a else ""))
lesson.plot_tree_vs_ring(a, b); plt.show()

# %% [markdown]
# A real library does not choose between the two once and for all: it picks per call, by size and topology.
# Pipelining a tree (cutting the message into pieces that flow down the tree one after another) brings its
# bandwidth term close to the ring's while keeping the logarithmic latency; a *double binary tree* (two trees
# in which every rank is an inner node in one and a leaf in the other) also keeps every rank's links busy.
#
# ### What NCCL does on a real node
# Everything above is what NCCL automates on GPUs. Facts worth knowing, hedged where they depend on versions:
#
# * **It detects the topology** (NVLink, NVSwitch, PCIe switches, NICs; `NCCL_TOPO_DUMP_FILE` writes what it
#   found) and searches for **rings and trees** over it. On an 8-GPU NVSwitch node (DGX/HGX H100) every GPU reaches
#   every other at full NVLink speed, so any ring order works; across nodes the rings and trees run over the NICs.
# * **Channels.** NCCL runs several rings/trees in parallel, each a *channel* driven by its own CUDA thread
#   block (on its own SM), each taking a slice of the buffer, so that all links and enough memory bandwidth are
#   used. More channels cost more SMs taken from compute.
# * **Algorithms.** Ring and Tree (a pipelined *double binary tree* since NCCL 2.4, used mostly across nodes),
#   CollNet (reductions inside InfiniBand switches, SHARP), and on H100-class systems with third-generation
#   NVSwitch, **NVLS** (NVLink SHARP, NCCL ≥ 2.17): the switch itself adds the data of all GPUs and multicasts the
#   result, which takes arithmetic off the GPUs and frees SMs for all-reduce; for all-gather and reduce-scatter
#   it moves fewer bytes in total but promises no speed-up (NVIDIA/nccl issues #807, #1506). NVLSTree
#   combines it with trees across nodes.
# * **Protocols.** *Simple* moves large chunks and uses memory fences to signal completion: full bandwidth,
#   highest latency. *LL* (low latency) writes 8-byte words of 4 bytes data + 4 bytes flag, so the receiver polls
#   the flag instead of waiting for a fence: lowest latency, at most half the bandwidth. *LL128* uses 128-byte
#   lines of 120 bytes data + 8 bytes flag (≈95% of the bandwidth), which is only safe where 128-byte stores arrive
#   in order, so NCCL enables it only on platforms it has verified, e.g. NVLink (NVIDIA/nccl #281, #786).
# * **Tuning.** For every call NCCL's internal cost model — per algorithm and protocol, a latency plus a bandwidth
#   term, like our α–β — picks the combination from the message size, the number of ranks per node and of nodes,
#   and the measured link speeds: typically LL for small messages, Simple for large ones, LL128 in between where
#   it is enabled, and tree or ring depending on size and topology — there is no fixed rule (NVIDIA/nccl #754). `NCCL_ALGO` and `NCCL_PROTO` force a choice (for debugging);
#   `NCCL_DEBUG=INFO` prints the rings, trees and channels it built.
# * **Measuring.** `nccl-tests` (`all_reduce_perf -b 1K -e 1G -f 2 -g 8`) reports `algbw` and `busbw` exactly as
#   this lesson does; compare busbw with the NVLink or NIC speed. On 2 nodes Tree can show a busbw above the
#   network's speed (the formula assumes ring traffic); force `NCCL_ALGO=Ring` to benchmark the network itself.
#
# ## 5. Check it
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
check("replaying the recorded messages gives all_reduce's result", ring["consistent"], "sources and values, every rank and chunk")
v = vol["all_reduce"]
check("ring all-reduce sends 2(n-1)/n·N per rank (the lower bound)", v["sent"] == [2 * (n - 1) * v["bytes"] // n] * n,
      f"{v['sent'][0]:,} B of N = {v['bytes']:,} B on each of {n} ranks")
check("bytes sent == formula, every collective", all(x["sent"] == x["expected_sent"] for x in vol.values()), f"{len(vol)} collectives")
import check as checker   # this folder's check.py
with contextlib.redirect_stdout(io.StringIO()) as log:
    solutions_pass = checker.check(module=checker.SOLUTIONS)
check("the exercise checker passes the reference solutions", solutions_pass, "on 2, 3 and 4 processes" if solutions_pass else log.getvalue())

# %% [markdown]
# ## 6. Explore: ring or tree?
# Choose the number of devices, the latency of one message and the bandwidth of one link; the α–β model redraws
# both all-reduces' time against message size. Try GPU-like values (a few µs of latency, tens to hundreds of GB/s
# per link) against this CPU's, and find where the tree stops paying: it is always a question of $\alpha/\beta$,
# the size at which sending the bytes costs as much as starting the message.

# %%
import numpy as np

def draw_model(n=64, alpha_us=10.0, link_GBps=50.0):
    a, b = alpha_us * 1e-6, 1e-9 / link_GBps
    sizes = np.geomspace(1024, 2**30, 200)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(sizes, lesson.ring_allreduce_time(n, sizes, a, b) * 1e3, label="ring: 2(n−1)α + 2(n−1)/n·Nβ")
    ax.plot(sizes, lesson.tree_allreduce_time(n, sizes, a, b) * 1e3, label="tree: 2⌈log₂n⌉(α + Nβ)")
    x = lesson.crossover_bytes(n, a, b)
    title = f"n={n}: the tree wins below {x / 2**20:.2f} MiB" if x else f"n={n}: the tree never wins"
    ax.set(xscale="log", yscale="log", xlabel="message bytes N", ylabel="ms", title=title)
    ax.legend(fontsize=8); plt.show()

# drawn once with the defaults (what a static viewer shows); in a live kernel, controls that redraw it
_common.interactive(draw_model, lambda w: dict(n=w.SelectionSlider(options=[2, 4, 8, 16, 64, 256, 1024, 4096], value=64),
                                               alpha_us=w.FloatLogSlider(value=10, base=10, min=0, max=4, description="α µs"),
                                               link_GBps=w.FloatLogSlider(value=50, base=10, min=-1, max=3, description="1/β GB/s")))

# %% [markdown]
# ## 7. Exercises
# Open `lessons/02_collectives/exercise.py` and write, with only `send`/`recv`/`isend`/`irecv`:
#
# 1. `ring_all_gather(tensor)` — every rank's tensor, concatenated in rank order, on every rank;
# 2. `ring_reduce_scatter(tensor)` — chunk $r$ of the sum on rank $r$ (chunks as `torch.tensor_split`: uneven lengths!);
# 3. `tree_broadcast(tensor, src)` — in place, along a binomial tree, at most $\lceil\log_2 n\rceil$ messages per rank.
#
# The checker runs your function on 2, 3 and 4 real processes and names exactly what is wrong: *"rank 2: element 0
# is 618, expected 1024 — rank 3's contribution is missing"*, *"rank 1 output has shape [2], expected [3]"*,
# *"rank 0 sent a message to rank 2: in a ring every rank sends only to its right neighbour"*, or, when ranks wait
# for each other forever, *"hang: ranks 0, 1 are still waiting after 10 s"* with the line of your file each one
# waits on. Run it here or as `python lessons/02_collectives/check.py [name]`; until you write them it reports
# `NotImplementedError: not written yet`.

# %%
all_passed = checker.check()

# %% [markdown]
# ## 8. What it costs, when to use it, what comes next
# | collective | bytes per rank (busiest) | used by |
# |---|---|---|
# | all-reduce | $2\frac{n-1}{n}N$ (ring) | data parallelism: gradients (lesson 03); tensor parallelism: activations |
# | reduce-scatter | $\frac{n-1}{n}N$ | ZeRO: gradient shards (lesson 04); sequence parallelism |
# | all-gather | $\frac{n-1}{n}N$ | ZeRO-3: parameters before use; sequence parallelism |
# | all-to-all | $\frac{n-1}{n}N$ | expert parallelism: tokens to their experts and back |
# | broadcast | $\lceil\log_2 n\rceil N$ (tree root) | initial weights; the loss from the last pipeline stage |
# | send / recv | $N$ | pipeline parallelism (activations between stages), context parallelism (K/V around a ring) |
#
# * **Bandwidth**: large messages are what the ring is built for: $2N$ per rank whatever $n$. Bucket small
#   tensors into large messages (lesson 03 does exactly this with gradients).
# * **Latency**: $2(n-1)$ sequential steps. At small sizes or large $n$ trees win; a good library picks per call.
# * **Overlap**: a collective is communication the GPU could hide behind computation; the next lessons overlap
#   the gradient all-reduce with the backward pass.
#
# Next, **lesson 03** uses `all_reduce` for data parallelism: $n$ replicas, one gradient sum per step, bucketed
# and overlapped with backward — and checks that $n$ replicas train like one big batch.
