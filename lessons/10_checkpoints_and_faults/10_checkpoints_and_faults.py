"""Lesson 10's notebook, 10_checkpoints_and_faults.ipynb, as plain Python in the percent format (see
lessons/_notebook.py): edit this file, never the notebook.

    python lessons/_notebook.py 10_checkpoints_and_faults --run fast    # rebuild, execute in FAST mode
"""

# %% [markdown]
# # Lesson 10 — Checkpoints that survive anything, and training that survives a lost rank
#
# A large run fails, routinely. Llama 3 405B's pre-training on up to 16,384 H100 GPUs saw 466 interruptions in a
# 54-day window, 419 unexpected (one every 3 hours), about 78% hardware: GPUs, their HBM3, network links (Dubey et
# al. 2024, "The Llama 3 Herd of Models", section 3.3.4). Training is synchronous: one lost GPU stops all 16,384. What
# keeps it going is a checkpoint it resumes from exactly, written often and cheaply, and a launcher that restarts the
# job by itself.
#
# Built and measured here on real processes: what an exact resume needs; sharded checkpoints with an index, loadable
# into any layout; atomic and asynchronous writes; ranks killed with SIGKILL mid-step and mid-write, the job still
# finishing with the never-failed run's loss; the cost of saving, against `torch.distributed.checkpoint`; how often
# to save (Young and Daly) at Llama 3's failure rate; and a faster second level on the nodes' own disks, with nodes
# lost for real. Code: `picotron/checkpoint.py` (saving), `picotron/reshard.py` (loading into any layout),
# `picotron/faults.py`; experiments: `experiment.py` here. `PICOTRON_FAST=1` gives a short run.

# %%
import json
import os
import sys
import matplotlib.pyplot as plt
sys.path.insert(0, "..")   # lessons/: the helpers every lesson shares
import _common
from picotron import checkpoint, reshard

FAST, OUT = _common.FAST, _common.run_dir("10_checkpoints_and_faults")
import experiment as lesson   # this folder's experiment.py: its measurements, formulas and plots
MiB = 2**20

def check(name, ok, detail):
    print(f"{'✓' if ok else '✗'} {name}: {detail}")

st = lesson.settings(FAST)
N = _common.nproc("10_checkpoints_and_faults", 2)   # section 5's processes: 2, or 8 with PICOTRON_NPROC=8
print(f"FAST={FAST}, results in {OUT.relative_to(_common.ROOT)}")

# %% [markdown]
# ## 1. What an exact resume needs
#
# After step $j$ the run's state is the parameters, the optimizer's state (AdamW: two moments and a step count), the
# learning rate (a function of the step here), the data position, and any random generator the step draws from. In
# picotron batches are a pure function of (seed, step, rank) and there is no dropout, so the data position is the
# step; each rank's RNG state is saved anyway. In fp32 that is $4 + 4 + 4 = 12$ bytes per parameter (mixed precision
# holds 16 in memory, but the bf16 copy and gradients follow from the fp32 masters and moments: again 12; formulas
# and sources: [the reference](../../docs/reference.md#checkpoints-and-failures); symbols: the
# [notation](../../docs/reference.md#notation)).
#
# The experiment: one `picotron.train` run (one process, 2 micro-batches per step), a checkpoint in the middle, and
# four runs resumed from it: same layout; resharded to dp2 + ZeRO-1 (same global batch); another data seed; and
# Adam's moments and step count stripped out.

# %%
resume = lesson.resume_demo(OUT / "resume", FAST)
lesson.plot_resume(resume); plt.show()
mid, ref = resume["mid"], resume["reference"]
after = ref[mid:]
rel = {k: max(abs(a - b) / abs(b) for a, b in zip(v, after)) for k, v in resume["curves"].items()}
for k, v in rel.items():
    print(f"  {k:<28} worst relative difference to the uninterrupted run over steps {mid + 1}-{resume['steps']}: {v:.1e}")

# %%
check("same layout: bit for bit", resume["curves"]["same layout"] == after,
      f"every loss after the resume equals the uninterrupted run's, as floats ({len(after)} steps)")
for name, ok, detail in _common.parity_checks("resharded to dp2 + ZeRO-1", resume["curves"]["resharded to dp2 + ZeRO-1"],
                                              after, where="lesson 03, section 5"):
    check(name, ok, detail)
check("what breaks it shows", rel["another data seed"] > 1e-3 and rel["no optimizer state"] > 1e-3,
      f"another data seed {rel['another data seed']:.1e}, no optimizer state {rel['no optimizer state']:.1e}")

# %% [markdown]
# The same layout resumes bit for bit. Resharded, the loaded values are identical (section 3 compares them), but the
# next steps sum in another order (a reduce-scatter over two ranks), so the losses agree to the parity tolerance, as
# any two layouts do (lesson 09). Another seed is a plausible curve of another run. Without Adam's state the first
# update is a fresh Adam's (moments at zero, bias correction at step 1), so the step size jumps; the loss at the
# resume step itself, computed before the update, still agrees.
#
# **Takeaway:** parameters alone are not a checkpoint: exactness needs the optimizer state, the step and the
# generators; a new layout changes only the reduction order.
#
# ## 2. One file per rank, and an index
#
# A rank writes only what it alone holds (the tensors its optimizer updates, ZeRO: its pieces; the moments), in
# parallel, nothing twice, with an index of where each sits in the full model. Names are the same in every layout
# (layers and experts keep their global numbers), so a name plus a box is an address:

# %%
folder = checkpoint.latest(str(OUT / "resume" / "resharded_to_dp2_+_ZeRO-1"))
for rank in (0, 1):
    lines = open(f"{folder}/rank_{rank:05d}.json").read().splitlines()
    print(f"rank {rank}: {lines[0][:120]}...")
    for line in lines[1:4]:
        print("   ", line[:150])
    print(f"    ... {len(lines) - 2} entries in all")

# %% [markdown]
# Here is how `picotron.checkpoint` reads every entry off the tensors' placements (`picotron.marks`: lesson 04's
# pieces carry `flat`, lesson 05's slices `shape` and `offsets`, lesson 07's tied copy `copy_of`, lesson 11's fp32
# masters `master_for`) and how a slice is cut out of a full tensor:

# %%
_common.show_source(checkpoint.placements)
_common.show_source(checkpoint.Slice.cut)

# %% [markdown]
# "Who writes" is the rule that counts each gradient element once in global-norm clipping (`marks.counted_here`):
# the rank at coordinate 0 along every dimension the tensor is replicated over. Plain data parallelism: rank 0 writes
# everything; ZeRO: each its $1/n$; tp: each its slice, rank 0 the replicated norms too.
#
# **Takeaway:** each rank writes only what it alone holds, addressed by a global name and a box: in parallel, nothing
# twice, files independent of the layout that wrote them.
#
# ## 3. Resharding: a checkpoint of one layout loads into any other
#
# Loading (`picotron.reshard`) does not care who wrote what. Each rank of the new layout computes the (name, offsets,
# box, flat) of every tensor *it* holds; then, one parameter at a time, assembles the full tensor from the pieces of
# that name (memory-mapped) and cuts its slice out. Extra memory: one full parameter and its moments.

# %%
_common.show_source(reshard.load, "reader = Reader", "after()")

# %% [markdown]
# The round trip: train 2 steps at one layout and save; load at another and save again; consolidate both and compare
# every parameter, moment and Adam's step, element by element. (FAST: one pair; full: six, from 8 processes to 4,
# ZeRO-3 to one process, cp·pp to dp, tp + sp + ZeRO-2 to an interleaved pipeline, an MoE from ep to tp;
# tests/test_checkpoint.py runs seven.)

# %%
trips = lesson.round_trips(OUT / "trips", FAST)
for r in trips:
    print(f"  {r['src']:<24} ({r['ranks'][0]} ranks) -> {r['dst']:<18} ({r['ranks'][1]}): {r['elements']:,} values "
          f"compared, {r['differ']} differ ({r['seconds']:.0f} s)")
check("reshard round trips", all(r["differ"] == 0 for r in trips) and trips,
      f"{len(trips)} pair(s): parameters, Adam's moments and step identical after loading into another layout")

# %% [markdown]
# **Takeaway:** an index of (name, full shape, offsets, box, flat range) is all resharding needs; the new layout
# computes its own index and reads what overlaps it.
#
# ## 4. Atomic writes, and ranks that die
#
# A rank killed half way through its file must not leave a checkpoint that looks complete. The protocol: every rank
# writes into `step_000120.tmp/`, each file as `.part`, flushed, `fsync`ed, renamed; after a barrier, rank 0 renames
# the folder to `step_000120/`, then replaces the pointer `latest` (temporary file, `fsync`, rename). A rename within
# one file system is atomic (POSIX), so whenever the crash comes, `latest` names a complete checkpoint, old or new.
#
# And the job must end when a rank dies, not hang in a collective that never completes. torchrun stops the other
# workers when one exits; with `--max-restarts N` it starts every rank again, and ranks that see
# `TORCHELASTIC_RESTART_COUNT` > 0 act as `--resume`, loading the newest complete checkpoint. `--faults` injects real
# deaths (SIGKILL): rank 1 mid-step, then rank 0 mid-write, then rank 1 again, in three successive attempts.

# %%
demo = lesson.fault_demo(OUT / "faults", FAST)
for line in demo["lines"]:
    print(" ", line.replace(str(OUT), "OUT"))
lesson.plot_faults(demo); plt.show()

# %%
check("the faulty run finishes", demo["code"] == (0, 0), f"exit codes (clean, faulty) = {demo['code']}")
check("the final loss equals the run without faults, bit for bit", demo["final"][0] == demo["final"][1],
      f"{demo['final'][1]!r} vs {demo['final'][0]!r}; every step's loss equal: {demo['losses'][0] == demo['losses'][1]}")
resumed = [a[0][0] for a in demo["attempts"][1:] if a and isinstance(a[0][0], int)]
killed_in_write = next(int(w.rsplit(" ", 1)[1]) for a in demo["attempts"] for s, w in a if s == "fault" and "checkpoint" in w)
check("a kill during a write leaves the previous checkpoint", resumed[1] == resumed[0],
      f"the attempt after the kill in step {killed_in_write}'s write resumed at step {resumed[1]}, from the checkpoint "
      f"before it (the half-written step_{killed_in_write:06d}.tmp was never named by `latest`)")
check("no hang", demo["seconds"][1] < 600, f"{demo['seconds'][1]:.0f} s for three deaths and three restarts "
      f"(the run without faults: {demo['seconds'][0]:.0f} s)")

# %% [markdown]
# Each restart repeats the steps since the newest complete checkpoint: the work lost is that time plus the restart
# (here: starting processes, measuring the matmul peak; on a cluster: scheduling, loading, warming up). A kill
# *during* a write loses more: that checkpoint never counts.
#
# **Takeaway:** atomic renames make "the newest complete checkpoint" well defined; a launcher that restarts, and a
# trainer that resumes by itself, turn a dead rank into lost minutes instead of a lost run.
#
# ## 5. What saving costs: bytes per rank, time, and asynchronous writes
#
# On two processes, per layout and model size: one step, a synchronous save and a load (the slowest rank's time),
# every rank's bytes. Then steps with no checkpoint, a synchronous and an asynchronous one every few steps. Then our
# save and load against `torch.distributed.checkpoint` (DCP) on the same tensors, in turn.

# %%
out = _common.launch("10_checkpoints_and_faults/experiment.py", ["--out", OUT], nproc=N, quiet=True)
print("\n".join(line for line in out.splitlines() if not line.startswith(("step ", "picotron |", "done: "))))
cost = _common.load_json(OUT / "cost.json")["results"]
lesson.plot_cost(cost); plt.show()

# %%
for r in cost:
    total = sum(b["bytes"] for b in r["per_rank"])
    check(f"{r['size']} {r['layout']}: every element written once", total == 12 * r["params"],
          f"{total:,} bytes over the ranks = 12 × {r['params']:,} parameters (on disk {r['on_disk']:,}, the index "
          f"and pickling add {100 * (r['on_disk'] / total - 1):.1f}%)")
dp = [r for r in cost if r["layout"] == f"dp{N}"]
check("plain data parallelism: rank 0 writes it all", all(r["per_rank"][0]["bytes"] == 12 * r["params"]
                                                          and not any(b["bytes"] for b in r["per_rank"][1:]) for r in dp),
      "the other ranks write nothing")
zero = [r for r in cost if "zero" in r["layout"]]
check(f"ZeRO: each rank writes 1/{N}", all(abs(b["bytes"] - 12 * r["params"] / N) <= 12 * 32 * N for r in zero
                                          for b in r["per_rank"]),
      "within the padding of the flat units (a few elements per unit)")

# %% [markdown]
# Saving and loading cost about the same in every layout and grow with the model: the same bytes, different
# writers. Plain data parallelism is the one layout where one rank writes everything; a real cluster would split
# that over the replicas.

# %%
asy = _common.load_json(OUT / "async.json")["results"]
lesson.plot_async(asy); plt.show()
ends, stopped, moved = {}, {}, {}
for mode in ("none", "sync", "async"):
    r = asy["runs"][mode][0]
    spans = [b - a for _, a, b in r["steps"]]
    copy = [s["snapshot_s"] for s in r["saves"]]
    write = [s["write_s"] for s in r["saves"]]
    ends[mode] = r["end"]
    stopped[mode] = sum(copy) + (sum(write) if mode == "sync" else 0.0)
    moved[mode] = sum(write) if mode == "async" else 0.0
    extra = ""
    if copy:
        c_ms, w_ms = 1e3 * sum(copy) / len(copy), 1e3 * sum(write) / len(write)
        extra = (f", {len(copy)} saves: each stops training {c_ms + w_ms:.0f} ms (copy {c_ms:.0f} + write {w_ms:.0f})"
                 if mode == "sync" else f", {len(copy)} saves: each stops training {c_ms:.0f} ms (the copy); its "
                 f"write, {w_ms:.0f} ms, runs in a thread beside the training")
    print(f"  {mode:<5}: {len(spans)} steps in {r['end']:.2f} s, mean step {1e3 * sum(spans) / len(spans):.0f} ms{extra}")
cost_sync, cost_async = ends["sync"] - ends["none"], ends["async"] - ends["none"]
hid = max(0.0, min(1.0, 1 - cost_async / cost_sync)) if cost_sync > 0 else 0.0
cores = len(os.sched_getaffinity(0))
verdict = ("the thread hid none of the synchronous cost, it added more" if cost_async >= cost_sync
           else f"the thread hid {hid:.0%} of the synchronous cost")
print(f"saving added {cost_sync:.2f} s to the run synchronously (its pauses: {stopped['sync']:.2f} s) and "
      f"{cost_async:.2f} s asynchronously (its pauses: {stopped['async']:.2f} s; its writes, {moved['async']:.2f} s, "
      f"beside the training): {verdict}"
      + (f"; the writer thread and the two trainers share {cores} cores" if hid < 0.5 else
         f", on {cores} cores shared by the writer thread and the two trainers"))

# %% [markdown]
# A synchronous save stops training for the copy *and* the write; an asynchronous one only for the copy to host
# memory, while a thread writes; the next save (and the end of training) waits for it first, never two writes at
# once. The writer has its own process group (gloo), so its barriers never interleave with the training's
# collectives. On a GPU the copy is a device-to-host transfer and the write costs the GPUs nothing.
#
# Here it is not free (the last line above says how much of the synchronous cost it hid): the two trainers keep both
# cores busy, so the writer takes a core from one; the write takes longer beside training than alone (the two
# printed write times), and the steps it overlaps stretch, in the full run eating most of what it hides. Timeline:
# the thin orange bar under the asynchronous row is the write, the green steps above run beside it.

# %%
dcp = _common.load_json(OUT / "dcp.json")["results"]
for r in dcp:
    print(f"  {r['size']:<6} {r['layout']}: save ours {1e3 * r['ours_save']:.0f} ms, DCP {1e3 * r['dcp_save']:.0f} ms "
          f"(ours / DCP throughput {r['dcp_save'] / r['ours_save']:.2f}); load ours {1e3 * r['ours_load']:.0f} ms, DCP "
          f"{1e3 * r['dcp_load']:.0f} ms ({r['dcp_load'] / r['ours_load']:.2f}); bytes on disk ours {r['bytes']['ours']:,}, "
          f"DCP {r['bytes']['dcp']:,}")

# %% [markdown]
# DCP writes the same tensors (a replicated tensor once, as we do; tp's split tensors one key per rank, as DCP
# needs without DTensors). The ratios are medians of rounds alternating the order; on a cluster file system the
# write bandwidth dominates, not the library.
#
# **Takeaway:** a checkpoint's bytes are 12 per parameter (weights or master weights, two moments), shared over
# the ranks that hold distinct values; asynchronous saving hides the write, not the copy.
#
# ## 6. How often to checkpoint: Young and Daly
#
# A checkpoint every $T$ seconds of work costs $C$ seconds; failures arrive at random every $\theta$ seconds on
# average (the MTBF); a restart costs $R$. We lose $C/T$ to saving, and per failure half an interval of redone work
# plus the restart: to first order the share of time lost is
#
# $$\text{waste}(T) \approx \frac{C}{T} + \frac{T/2 + R}{\theta}, \qquad \text{minimised at } T^* = \sqrt{2C\theta}
# \quad \text{(Young 1974)}.$$
#
# Daly (2006) refines it for saves that are not small against $\theta$: $T^* = \sqrt{2C\theta}\,[1 + \tfrac13\sqrt{C/2\theta} +
# \tfrac19 (C/2\theta)] - C$ for $C < 2\theta$. The failure rate grows with the number of GPUs $G$: from the Llama 3 run, one
# unexpected interruption per $54 \times 24 \times 16384 / 419 \approx 50{,}700$ GPU-hours, so $\theta = 50{,}700\,\text{h} / G$.
# A simulation checks the formula: failures drawn at random over months of work, the lost time counted (the
# derivation and the sources: [reference](../../docs/reference.md#checkpoints-and-failures)).

# %%
C, R = 60.0, 300.0   # a one-minute save, a five-minute restart (both assumptions; measure yours)
print(f"{'GPUs':>6} {'M (h)':>8} {'Young (min)':>12} {'Daly (min)':>11} {'waste at T*':>12}")
for n in (8, 512, 2048, 16384, 100000):
    m = lesson.mtbf_hours(n) * 3600
    t = lesson.young(C, m)
    print(f"{n:>6} {m / 3600:>8.1f} {t / 60:>12.1f} {lesson.daly(C, m) / 60:>11.1f} {100 * lesson.waste_model(t, C, m, R):>11.1f}%")

M = lesson.mtbf_hours(16384) * 3600
grid = [lesson.young(C, M) * f for f in (0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8, 4.0)]
work = 3600 * 24 * (10 if FAST else 60)
sim = [sum(lesson.simulate_waste(t, C, M, R, work, seed=s) for s in range(4)) / 4 for t in grid]
model = [lesson.waste_model(t, C, M, R) for t in grid]
fig, ax = plt.subplots(figsize=(6.5, 3))
ax.plot([t / 60 for t in grid], [100 * x for x in model], "k-", label="first-order model C/T + (T/2 + R)/M")
ax.plot([t / 60 for t in grid], [100 * x for x in sim], "o", label=f"simulated ({work / 86400:.0f} days of work, 4 seeds)")
ax.axvline(lesson.young(C, M) / 60, color="gray", ls=":", label="Young: sqrt(2Cθ)")
ax.set_xscale("log"); ax.set_xlabel("minutes of work between checkpoints", fontsize=8)
ax.set_ylabel("% of the time lost", fontsize=8); ax.legend(fontsize=7); ax.tick_params(labelsize=8)
ax.set_title(f"16,384 GPUs (θ = {M / 3600:.1f} h), C = {C:.0f} s, R = {R:.0f} s", fontsize=9)
fig.tight_layout(); plt.show()

# %%
at_young = sim[grid.index(lesson.young(C, M))]
check("Young's interval is (near) the simulated optimum", at_young <= 1.03 * min(sim),
      f"{100 * at_young:.2f}% lost at sqrt(2Cθ) = {lesson.young(C, M) / 60:.0f} min, the best of the grid "
      f"{100 * min(sim):.2f}% at {grid[sim.index(min(sim))] / 60:.0f} min")
check("the first-order model against the simulation", abs(model[4] - at_young) <= 0.2 * at_young,
      f"{100 * model[4]:.2f}% predicted, {100 * at_young:.2f}% simulated at T* (the model ignores failures during "
      f"saves and restarts, and counts lost work as if failures never cluster)")

# %% [markdown]
# **From what we measured.** Section 5's write bandwidth is the largest model's bytes over its synchronous save time.
# Llama 3's checkpoints held 1 MB to 4 GB per GPU (Dubey et al. 2024, section 3.3.1): a 4 GB shard at that bandwidth,
# and at the copy to host memory alone (an asynchronous save's pause), gives a 16,384-GPU job's interval:

# %%
big = max(cost, key=lambda r: r["params"])
per_rank = max(b["bytes"] for b in big["per_rank"])
bandwidth = per_rank / big["save_s"]
pause = [s["snapshot_s"] for s in asy["runs"]["async"][0]["saves"]]
copy_bw = max(s["bytes"] for s in asy["runs"]["async"][0]["saves"]) / (sum(pause) / len(pause))
M = lesson.mtbf_hours(16384) * 3600
for label, bw in (("synchronous save", bandwidth), ("asynchronous: the copy", copy_bw)):
    c = 4e9 / bw
    print(f"  {label:<24} {bw / 1e6:8.0f} MB/s here -> C = {c:6.1f} s for 4 GB: Young {lesson.young(c, M) / 60:5.1f} min, "
          f"Daly {lesson.daly(c, M) / 60:5.1f} min, {100 * lesson.waste_model(lesson.young(c, M), c, M, R):.1f}% lost "
          f"(R = {R:.0f} s)")
check("measured cost -> interval", 0 < lesson.daly(4e9 / bandwidth, M) < lesson.young(4e9 / bandwidth, M) < M,
      "Daly's interval is a little shorter than Young's, both far shorter than M")

# %% [markdown]
# **Two levels.** Most failures take out one node while its neighbours live. A copy of each rank's shard in a peer
# node's memory is cheap to write (a network transfer) and survives those; disk is needed only when the pair (or the
# job) is lost. With a share $\rho$ of failures recoverable from the peer's copy, each level gets its own Young
# interval: $T_1 = \sqrt{2C_1M/\rho}$, $T_2 = \sqrt{2C_2M/(1-\rho)}$ (multi-level checkpointing, Moody et al. 2010,
# "SCR"; Gemini, Wang et al. 2023, keeps checkpoints in other machines' CPU memory). Sliders: GPUs, the two costs,
# $\rho$. (picotron's trainer keeps the peer's copy on the next node's local disk: section 7.)

# %%
def draw(gpus=16384, c_disk=60.0, c_memory=2.0, restart=300.0, p=0.9):
    m = lesson.mtbf_hours(gpus) * 3600
    one = lesson.waste_model(lesson.young(c_disk, m), c_disk, m, restart)
    ps = [i / 20 for i in range(0, 20)]
    two = [lesson.two_level(c_memory, c_disk, m, restart, max(q, 1e-3))[2] for q in ps]
    t1, t2, w = lesson.two_level(c_memory, c_disk, m, restart, p)
    fig, ax = plt.subplots(figsize=(6.5, 2.8))
    ax.plot(ps, [100 * x for x in two], "-", label="two levels (peer memory, then disk)")
    ax.axhline(100 * one, color="k", ls="--", label="disk only, at Young's interval")
    ax.plot([p], [100 * w], "o", color="C3")
    ax.set_xlabel("share ρ of failures a peer's copy recovers", fontsize=8); ax.set_ylabel("% of time lost", fontsize=8)
    ax.legend(fontsize=7); ax.tick_params(labelsize=8); fig.tight_layout(); plt.show()
    print(f"{gpus} GPUs: θ = {m / 3600:.2f} h; disk only every {lesson.young(c_disk, m) / 60:.0f} min loses "
          f"{100 * one:.1f}%; two levels: memory every {t1 / 60:.1f} min, disk every {t2 / 60:.0f} min, lose {100 * w:.1f}%")

_common.interactive(draw, lambda w: dict(
    gpus=w.IntSlider(value=16384, min=8, max=131072, step=8, description="GPUs"),
    c_disk=w.FloatSlider(value=60, min=1, max=900, description="C disk (s)"),
    c_memory=w.FloatSlider(value=2, min=0.1, max=60, description="C memory (s)"),
    restart=w.FloatSlider(value=300, min=10, max=1800, description="restart (s)"),
    p=w.FloatSlider(value=0.9, min=0.0, max=0.99, step=0.01, description="ρ")))

# %% [markdown]
# **Takeaway:** checkpoint every $\sqrt{2C\theta}$; $\theta$ shrinks as $1/G$, so a bigger cluster must save more often or
# more cheaply — asynchronous writes shrink $C$ to the copy, and a peer's memory shrinks it further for most failures.
#
# ## 7. Two levels, built: a lost node, and what it costs
#
# `--local-save-every K1` in front of `--save-every K2` (`picotron/checkpoint.py`). **Level 1**, every $K_1$ steps:
# each rank writes its *whole* state (replicas included, to restore itself alone) to its node's local folder, and
# sends the same bytes to the rank in its place on the next node, which writes them locally: a ring of nodes, one
# batch of messages each way. **Level 2**, every $K_2$ steps: the shared folder of sections 2–5 (a multiple of $K_2$
# writes level 2 only). Here a "node" is one process (`--ranks-per-node 1`), its local disk `OUT/local/node_N`;
# `--faults lose-node@STEP:rN` deletes that folder, then kills the rank: a machine lost with its disk.
#
# On restart every rank reports the level-1 steps it holds, its own shard and the copy it keeps for the previous
# node (one all-gather); the newest step newer than level 2's at which every rank's shard survives, on its node or the
# next, wins; a lost shard comes back from the next node, a lost copy is sent again. Else level 2.
#
# **The model.** A failure during step $j$ redoes the $j - j_0$ steps since the newest surviving checkpoint $j_0$,
# the killed one included: $(K+1)/2$ on average over an interval of $K$ steps (section 6's $T/2$ plus the killed
# step), $K = K_1$ when the lost node's peer survives, $K_2$ otherwise; in seconds, that many steps plus the restart
# $R$ (as Moody et al. 2010 model each level). The experiment: dp2 + ZeRO-1 as two nodes, level 2 every $K_2$ steps, a
# node lost at every step of one level-2 interval (FAST: its last), with and without level 1 every $K_1$; each
# restart timed from the kill to the killed step done again.

# %%
lv = lesson.levels_demo(OUT / "levels", FAST)
k1, k2 = lv["k1"], lv["k2"]
for label, r in lv["runs"].items():
    for x in r["restarts"]:
        print(f"  {label:<12} node lost in step {x['killed']:>2}: resumed from level {x['level']}'s step {x['resumed']}, "
              f"{x['redone']} step(s) redone, {x['seconds']:5.1f} s from the kill to step {x['killed']} done again")
    print(f"  {label:<12} exit {r['code']}, median step {1e3 * (r['step_s'] or 0):.0f} ms" + "".join(r["tail"]))
lesson.plot_levels(lv); plt.show()

# %%
def newest_before(k, every):
    return every * ((k - 1) // every)

for label, every in (("level 1", k1), ("level 2 only", k2)):
    r = lv["runs"][label]
    got, want = [x["resumed"] for x in r["restarts"]], [newest_before(k, every) for k in r["kills"]]
    check(f"{label}: each restart resumed from the newest checkpoint that survived", r["code"] == 0 and got == want,
          f"resumed from steps {got}; the newest multiples of {every} before the killed steps {r['kills']}: {want}")
    redone = [x["redone"] for x in r["restarts"]]
    if len(redone) % every == 0 and len(redone) > 1:  # kills at each step of whole intervals (full mode)
        check(f"{label}: steps redone per lost node", sum(redone) / len(redone) == (every + 1) / 2,
              f"mean {sum(redone) / len(redone):.2f} over kills at each step of an interval; model (K+1)/2 = "
              f"{(every + 1) / 2:.2f}")
    else:
        print(f"  {label}: {redone} step(s) redone at the end of an interval (K = {every}); the model's mean over an "
              f"interval (K+1)/2 = {(every + 1) / 2:.1f} (the full run kills at each step)")
peer = [x for x in lv["runs"]["level 1"]["restarts"] if x["resumed"] % k2]
check("a lost node's state came back from its peer", bool(peer) and all(x["level"] == 1 for x in peer),
      f"{len(peer)} restart(s) from level 1 with the killed node's folder deleted")
ref = lv["runs"]["clean"]["losses"] if "clean" in lv["runs"] else lv["runs"]["level 2 only"]["losses"]
check("both faulty runs end on the same losses, bit for bit",
      all(lv["runs"][k]["losses"] == ref for k in ("level 1", "level 2 only")) and len(ref) == lv["steps"],
      f"every step's loss equal to the {'run without faults' if 'clean' in lv['runs'] else 'run without level 1'} "
      f"({len(ref)} steps)")

# %% [markdown]
# The steps redone follow the surviving level: with the peer's copy never more than $K_1$, without it up to $K_2$.
# The seconds hardly follow them here (compare the printed median step with the seconds from kill to redone step): a
# restart (processes, model, matmul peak, on a busy machine) lasts many small steps, so $R$ dominates; the hatched
# share is the work redone. On a cluster a step takes seconds and an interval minutes, and level 1 turns $(K_2+1)/2$
# steps lost per lost node into $(K_1+1)/2$.
#
# What each level costs to write (the trainer's `summary` line in `metrics.jsonl` keeps, per level, the mean seconds
# to copy the state to host memory and to write it):

# %%
saves = lv["runs"]["level 1"]["saves"] or {}
for level in ("level_1", "level_2"):
    if level in saves:
        x = saves[level]
        print(f"  {level.replace('_', ' ')}: {x['count']} save(s) by rank 0, {x['bytes'] / MiB:.1f} MiB of its state each, "
              f"copy {1e3 * x['snapshot_s']:.0f} ms, write {1e3 * x['write_s']:.0f} ms")
if not FAST:  # larger models: a level-1 save (own folder + the peer's copy) against a level-2 save, in turn
    _common.launch("10_checkpoints_and_faults/experiment.py", ["--out", OUT, "--only", "levels"], nproc=2, quiet=True)
    for r in _common.load_json(OUT / "levels.json")["results"]:
        print(f"  {r['size']:<6} ({r['params'] / 1e6:.1f} M parameters): level 1 {1e3 * r['level1_s']:.0f} ms (each node "
              f"then holds {r['held']['1'][0] / MiB:.0f} MiB: its rank's state and the other's copy), level 2 "
              f"{1e3 * r['level2_s']:.0f} ms ({r['held']['2'] / MiB:.0f} MiB in the shared folder)")

# %% [markdown]
# Here level 1 is the *slower*: both levels write to the same disk, and level 1 writes twice the bytes (its state and
# its peer's copy) and sends half through gloo's sockets on the same two cores. On a cluster it writes to each node's
# own NVMe drive, all nodes in parallel, plus one transfer to a neighbour, instead of every rank through the shared
# file system: hence $C_1 \ll C_2$ in section 6's model, and level 1 far more often.
#
# **Takeaway:** a copy on the next node turns a lost node into $(K_1+1)/2$ steps redone instead of $(K_2+1)/2$;
# the shared folder stays the last resort, for a node lost together with its peer.
#
# ## 8. On an 8-GPU node you should see
#
# On a node a save first copies each GPU's state to host memory (over PCIe), then writes it to a disk that the 8
# ranks share. `PICOTRON_NPROC=8` runs section 5 at 8 ranks: dp8, ZeRO over 8, tp2·dp4, pp2·dp4. Bytes are counts;
# the save time needs a disk bandwidth, which no datasheet of ours gives, so the row below assumes one and says so.

# %%
import _node   # lessons/_node.py: the planner's predictions for one 8×H100 node, and the command that measures them
_node.show("10_checkpoints_and_faults")

# %% [markdown]
# **Takeaway:** ZeRO spreads the writing over all 8 ranks; plain dp leaves it to rank 0. At 8 GPUs failures are
# rare, so Young's interval is tens of minutes.
#
# ## 9. Exercises
# Open `lessons/10_checkpoints_and_faults/exercise.py`:
#
# 1. `cut(full, offsets, box, flat)`: a rank's values from a full tensor and its index entry, on real layouts'
#    entries (tp boxes along either dimension, ZeRO ranges inside them); the checker names the entry and element, and
#    recognises a flat range taken from the whole tensor instead of the box.
#
# 2. `assemble(shape, pieces)`: the full tensor from the pieces, in any order; a missing piece must raise ValueError
#    naming an element, not load as zeros; the checker recognises a box written through a strided view that never
#    reached the tensor.
#
# 3. `interval(cost, mtbf)` — Young's and Daly's intervals; the checker recognises $\sqrt{CM}$ (no factor 2) and
#    Daly without its $-C$.
#
# 4. `resume_point(held, world_size, per_node, level2_step)` — given which level-1 shards survive on which node,
#    the level and step a restart resumes from (section 7's rule). The checker recognises a level-1 step taken with
#    a missing shard, a complete one passed over because a shard survives only on the next node, and a level-1
#    step taken that is not newer than level 2's.
#
# Until you write them, the checker reports `NotImplementedError: not written yet`:

# %%
import check as checker   # this folder's check.py
all_passed = checker.check()

# %% [markdown]
# ## 10. What it costs, when to use it, what comes next
#
# | | bytes written | pause per save | survives |
# |---|---|---|---|
# | synchronous, sharded (ours) | 12 per parameter (fp32 weights or master weights, two moments), split over the distinct holders | the whole write | everything but the storage |
# | asynchronous | the same | the copy to host memory | the same, one interval later |
# | level 1: the node's disk and a peer's (`--local-save-every`) | each rank's whole state, twice (its node, the next) | the whole write (or the copy, `--async-save`) | a lost node whose neighbour lives |
# | consolidated (one file, e.g. for export) | the same, through one rank | gather + write | — a format for others, not for resuming |
#
# **What ours lacks** (torch.distributed.checkpoint, Megatron's distributed checkpointing, the large labs' systems):
# several threads and files per rank, storage backends (S3, GCS), DTensor placements (the same idea as our index),
# deduplication across replicas chosen by bandwidth, checkpoints in peers' *memory* (ours: their local disks),
# detecting hangs and slow ranks (NCCL's flight recorder, heartbeats), swapping out bad nodes before a restart, and
# elastic restarts at another world size (our checkpoints reshard, but torchrun restarts the same layout).
#
# **Sources.** Young 1974, "A first order approximation to the optimum checkpoint interval" (CACM 17(9));
# Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps" (FGCS 22(3));
# Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4 (466 interruptions in 54 days, 419 unexpected,
# over 90% effective training time); Moody et al. 2010, "Design, Modeling, and Evaluation of a Scalable
# Multi-level Checkpointing System" (SCR); Wang et al. 2023, "Gemini: Fast Failure Recovery in Distributed
# Training with In-Memory Checkpoints"; PyTorch's torchrun (elastic launch, `--max-restarts`) and
# `torch.distributed.checkpoint` documentation.
#
# **Next:** lesson 11 — precision and kernels: bf16 and fp16 with loss scaling, FP8, flash attention written by
# hand.
#
# **Takeaway:** a checkpoint is an index plus each rank's distinct values; written atomically, often enough
# ($\sqrt{2C\theta}$) and cheaply enough (asynchronously), it turns routine failures into minutes lost.
