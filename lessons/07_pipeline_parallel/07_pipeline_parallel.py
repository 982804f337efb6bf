"""Lesson 07's notebook, 07_pipeline_parallel.ipynb, as plain Python in the percent format (see lessons/_notebook.py):
edit this file, never the notebook.

    python lessons/_notebook.py 07_pipeline_parallel --run fast    # rebuild the notebook, execute it in FAST mode
"""

# %% [markdown]
# # Lesson 07 — Pipeline parallelism: cut the model by depth
#
# Tensor parallelism (lesson 05) pays four blocking all-reduces per layer: it lives inside a node. **Pipeline
# parallelism** cuts the model by depth: the $L$ layers into $p$ consecutive **stages**, one per rank, and a step's
# batch into $m$ **micro-batches** that flow through them. Between two stages travel one activation per micro-batch
# forward and its gradient backward: few, small point-to-point messages, so pipelines cross nodes. The price is
# time: a stage waiting for its neighbour idles, the **bubble**.
#
# | schedule | idea | bubble (fraction of the step) | activations alive on stage $r$ (micro-batches) |
# |---|---|---|---|
# | AFAB / GPipe (Huang et al. 2019) | all forwards, then all backwards | $\frac{p-1}{m+p-1}$ | $m$ |
# | 1F1B with a flush (PipeDream-Flush, Narayanan et al. 2021b) | $p-r-1$ forwards, then one forward one backward | $\frac{p-1}{m+p-1}$ | $p-r$ |
# | interleaved 1F1B (Megatron-LM, Narayanan et al. 2021a) | $v$ smaller chunks per rank | $\frac{p-1}{v\,m+p-1}$ | $p\left(1+\frac{p-1}{pv}\right)$ on stage 0, fewer after |
# | ZB-H1 (Zero Bubble, Qi et al. 2024) | backward split into $B$ (input gradient) and $W$ (weight gradient); $W$'s fill the idle slots | $\frac{p-1}{3m+p-1}$ when $t_F=t_B=t_W$ | $\le p$ |
# | ZB-V (Qi et al. 2024) | two chunks per rank in a V, $W$'s fill the rest | no closed form: the simulator's | $\le p$ stages' worth |
# | DualPipe (DeepSeek-V3, 2024) | every stage on two ranks, micro-batches fed in at both ends, F&B pairs | idle $(\frac p2-1)(F\&B+B-3W)$ per rank; $\frac{p-2}{3m+p-2}$ with unit costs | $p+1$, at $2\times$ the parameters |
#
# Symbols as in the course's [notation](../../docs/reference.md#notation): $r$ is a stage's index on its rank, $v$
# the chunks per rank. Sources: Narayanan et al. 2021a, "Efficient Large-Scale Language Model Training on GPU Clusters
# Using Megatron-LM" (arXiv:2104.04473), §2.2.1 (1F1B with a flush, their default schedule) and §2.2.2 (interleaving:
# its bubble, messages and memory); Narayanan et al. 2021b, "Memory-Efficient Pipeline-Parallel DNN Training" (ICML
# 2021, arXiv:2006.09503), §3.2 (PipeDream-Flush); Korthikanti et al. 2022, "Reducing Activation Recomputation in
# Large Transformer Models" (arXiv:2205.05198), §4.2.3 (the first stage's activations under interleaving). The first
# PipeDream (Narayanan et al. 2019, SOSP) ran 1F1B without a flush, with stashed weight versions: a different
# training. The 1F1B taught here flushes every step and trains exactly as one process does.
#
# Schedules are **data**: one list of actions per rank (`picotron/pipeline_schedules.py`). A simulator runs any list
# on an ideal machine and says why a wrong one cannot run; one executor runs any list on real processes. We derive
# the bubble, draw every schedule simulated **and** measured, measure activations and bytes against the formulas,
# keep tied embeddings equal, and check parity with one process. The experiments are `experiment.py` here, launched
# with `torchrun`; `PICOTRON_FAST=1` gives a short run.

# %%
import sys
import matplotlib.pyplot as plt
sys.path.insert(0, "..")   # lessons/: the helpers every lesson shares
import _common
from picotron import pipeline_parallel as pp, pipeline_schedules as ps
from picotron.model import ModelConfig

FAST, OUT = _common.FAST, _common.run_dir("07_pipeline_parallel")
import experiment as lesson   # this folder's experiment.py: its measurements, simulator helpers and plots
MiB, GB = 2**20, 1e9

def run(only, nproc=2, hide=()):
    # torchrun --nproc_per_node nproc lessons/07_pipeline_parallel/experiment.py --out OUT --only <only>
    # prints what it printed, less the training chatter and the lines that start with one of `hide` (rows that the
    # notebook prints itself from the JSON)
    _common.run_experiment("07_pipeline_parallel", only, nproc, hide=_common.TRAINING_CHATTER + hide)

check = _common.check   # prints ✓ or ✗ (or ?, only for a timing check on a machine measured busy) and counts it

P = _common.nproc("07_pipeline_parallel", 2)   # the runs' stages: 2, or 8 with PICOTRON_NPROC=8 (16 layers)
st = lesson.at_world(lesson.settings(FAST), P)
mc = ModelConfig.from_preset("tiny", **dict(_common.SIZES[st["size"]], num_hidden_layers=st["layers"]))
print(f"FAST={FAST}, results in {OUT.relative_to(_common.ROOT)}; model: the lessons' '{st['size']}' one with "
      f"{mc.num_hidden_layers} layers, {mc.num_params() / 1e6:.2f} M parameters, h={mc.hidden_size}, vocabulary "
      f"{mc.vocab_size}; micro-batches of {st['micro_batch_size']} x {st['seq_len']} tokens")

# %% [markdown]
# ## 1. The problem: a model that no node holds
#
# Llama-3-70B in mixed precision with Adam needs 16 bytes per parameter for its model states
# ([reference](../../docs/reference.md#model-states)). Tensor parallelism stops at the node (8 GPUs, lesson 05), and
# ZeRO-3 gathers every layer whole from across the network at every step (lesson 04). Cut by depth instead:

# %%
llama70 = ModelConfig.from_preset("llama3-8b", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                                  num_key_value_heads=8, intermediate_size=28672)   # Llama-3-70B's shape
n, h, seq = llama70.num_params(), llama70.hidden_size, 8192
print(f"Llama-3-70B: {n / 1e9:.1f} B parameters, model states {16 * n / GB:,.0f} GB")
for tp, p in ((8, 1), (8, 2), (8, 4), (8, 8)):
    print(f"  tp={tp} x pp={p} ({tp * p:>2} GPUs): {16 * n / (tp * p) / GB:6.1f} GB of model states per GPU"
          + ("  <- fits an 80 GB GPU with room for activations" if 16 * n / (tp * p) / GB < 50 else ""))
print(f"what crosses a stage boundary per micro-batch of one {seq}-token sequence: its activation, {seq * h * 2 / 2**20:.0f} MiB "
      f"in bf16, forward, and its gradient backward; tensor parallelism all-reduces that much 4 times per LAYER")

# %% [markdown]
# Eight GPUs of a node with tensor parallelism still hold 140 GB each; two to four nodes in a pipeline bring it under
# 80 GB, and the traffic between nodes is one activation per micro-batch and stage boundary — not per layer.
#
# **Takeaway:** pipeline parallelism divides the model states by $p$ for little communication; what it costs is
# idle time, which the rest of the lesson measures.
#
# ## 2. The idea: where the bubble comes from
#
# A micro-batch's forward goes stage $0 \to 1 \to \dots \to p-1$; its backward comes back. Stage $r$ waits for the
# $r$ stages before it, and stage 0's last backward waits for the last micro-batch to go down and come back. Every
# stage does $m(t_F + t_B)$ of work, but the step lasts $(m + p - 1)(t_F + t_B)$: the first stage idles $(p-1)$
# forward-and-backward times at the end, the last at the start, the others some of each. The idle fraction is
#
# $$\text{bubble} = \frac{(p-1)(t_F+t_B)}{(m+p-1)(t_F+t_B)} = \frac{p-1}{m+p-1}.$$
#
# (GPipe §2.3; the Ultra-Scale Playbook and Megatron-LM divide the idle time by the ideal $m(t_F+t_B)$ instead:
# $\frac{p-1}{m}$. More micro-batches shrink it either way.) The simulator: each rank runs its list in order, an
# action starts when the rank is free and its input has arrived, $t_F = 1$, $t_B = 2$; here AFAB and 1F1B, $p = 4$,
# $m = 8$:

# %%
for name in ("afab", "1f1b"):
    fig, sim = lesson.plot_widget(name, 4, 8, 1)
    plt.show()
    print(f"{lesson.LABELS[name]}: step {sim.makespan:g} time units, every rank busy {sim.busy[0]:g}; bubble "
          f"{sim.bubble:.4f} = (p-1)/(m+p-1) = {ps.bubble_formula(name, 4, 8):.4f}; peak micro-batches alive per rank "
          f"{sim.peak_alive}")

# %% [markdown]
# Same step, same bubble, but AFAB keeps all $m$ micro-batches' activations until its first backward, while 1F1B
# starts each backward as soon as it can: stage $r$ runs $p-r-1$ warm-up forwards, then alternates, and never holds
# more than $p - r$ micro-batches. AFAB's bubble at a fraction of its memory, so $m$ can grow to shrink the bubble.
#
# **Two ways to shrink the bubble further.** *Interleaving* (Megatron-LM): each rank holds $v$ smaller chunks
# (stages $r, r+p, \dots$), the pipeline fills $v$ times faster, and the bubble is $\frac{p-1}{v\,m+p-1}$, for more
# messages: Narayanan et al. 2021a §2.2.2 say communication "increases by $v$"; counting boundaries, $pv-1$ instead
# of $p-1$, gives this lesson's exact factor $\frac{pv-1}{p-1}$, close to $v$ only for large $p$. *Splitting the
# backward* (Zero Bubble): a linear layer's backward is two matmuls, the input's gradient ($B$, which the previous
# stage waits for) and the weight's ($W$, which nobody waits for). Run $B$ at once and hold $W$ back to fill idle
# slots: with $t_F = t_B = t_W$ ZB-H1's bubble is $\frac{p-1}{3m+p-1}$ at 1F1B's memory. Every schedule against the
# closed forms, $p = 4$, unit costs:

# %%
print(f"{'m':>4} " + " ".join(f"{lesson.LABELS[n]:>18}" for n in lesson.SCHEDULES))
for m in (4, 8, 16, 32):
    print(f"{m:>4} " + " ".join(f"{lesson.simulated(n, 4, m).bubble:>9.1%} ({lesson.formula(n, 4, m):.1%})"
                                 if n in lesson.FORMULA else f"{lesson.simulated(n, 4, m).bubble:>18.1%}"
                                 for n in lesson.SCHEDULES))
print("simulated (closed form); interleaved with v=2; ZB-V has no closed form")

# %%
for p in (2, 4):
    worst = max(abs(lesson.simulated(n, p, m).bubble - lesson.formula(n, p, m))
                for n in lesson.FORMULA for m in (p, 2 * p, 4 * p, 8 * p))
    check(f"p={p}: the simulator (unit costs) gives every closed form", worst < 1e-12,
          f"AFAB, 1F1B, interleaved v=2, ZB-H1 at m = p..8p: max difference {worst:.1e}")

# %% [markdown]
# **Takeaway:** the bubble is $(p-1)$ stage-times of filling and draining out of $m + p - 1$; more micro-batches,
# smaller chunks ($v$) or backward halves that wait ($W$) shrink it.
#
# ## 3. Read the code
#
# A schedule is a list of `Action(kind, mb, chunk)` per rank; the generators are pure functions of $(p, m, v)$.
# 1F1B and ZB-H1 (1F1B's order with each backward split, rank $r$ holding back up to $r$ of its $W$'s):

# %%
_common.show_source(ps.one_f_one_b)
_common.show_source(ps.zb_h1)
print(ps.build("zb-h1", 3, 4).ranks[2])

# %% [markdown]
# The simulator checks a list before running it and names the first problem — what exercise 1's checker prints.
# Swap rank 1's first two actions of 1F1B at $p = 2$ and the two ranks wait for each other:

# %%
bad = ps.one_f_one_b(2, 4)
bad.ranks[1][:2] = bad.ranks[1][1::-1]
try:
    ps.simulate(bad)
except ps.ScheduleError as e:
    print("ScheduleError:", e)
bad.ranks[0] = bad.ranks[0][1:]
try:
    ps.simulate(bad)
except ps.ScheduleError as e:
    print("ScheduleError:", e)

# %% [markdown]
# **The executor** (`Pipeline.run`, `picotron/pipeline_parallel.py`) walks this rank's list. A forward receives its
# input (stage 0: the tokens), runs the chunk, sends the output on (last stage: the loss divided by $m$); a backward
# receives the output's gradient, runs autograd from the stashed output, and sends the input's gradient back. The
# messages are data too: `ps.with_messages` places each rank's sends and receives between its actions ("On a GPU
# pod" below says why). Each action is a named phase (`self.phases`, `picotron.hooks`) that the experiments listen
# to with a timeline and an activation count:

# %%
print("1F1B, p = 2, m = 2, with its messages:", ps.with_messages(ps.build("1f1b", 2, 2)))
_common.show_source(pp.Pipeline.run, "for a in self.steps:")
_common.show_source(pp.Pipeline._forward)
_common.show_source(pp.Pipeline._backward)

# %% [markdown]
# **On a GPU pod: NCCL's rules** ([reference](../../docs/reference.md#nccls-ordering-rules-what-gloo-forgives)).
# gloo matches each message by sender and tag and buffers it; NCCL does neither: a send or receive blocks its stream
# until the partner's call runs, and single `isend`/`irecv` between two ranks share one stream, both directions, in
# the order posted. The first version of this executor posted each action's *next* receive before this action's
# send. At $p = 2$, 1F1B, $m = 2$ (rank 0 runs F0 F1 B0 B1, rank 1 F0 B0 F1 B1), rank 0's stream held [send F0,
# receive B0 (early), send F1] and rank 1's [receive F0, receive F1 (early), send B0]: after F0 each waits for a
# message the other can only send from behind its own head. gloo ran it; a pod hangs until the watchdog kills it.
#
# The second version gave each *direction* its own group. But NCCL promises nothing about two communicators running
# side by side; its user guide asks that "operations are submitted in the same order across ranks". Seen as ONE
# queue per GPU, the toy order is the same deadlock: rank 0 waits in its receive of B0 for rank 1, which waits in its
# receive of F1 for rank 0.
#
# `picotron.nccl_rules` shows both without a GPU: it records every rank's messages and collectives on gloo and
# replays them as NCCL would (each communicator on its own stream, then all of a rank's groups as one queue), naming
# each rank's first stuck operation. Below: the two versions on a toy model (`nccl_order.py` here), then picotron's
# executor.
#
# Its fix: `ps.with_messages` (printed above) runs the schedule on the ideal machine, where each message
# happens at the end of the action that makes it, and gives every rank its messages in the order of those instants:
# pieces of one global order. Each receive then moves up to just after the rank's previous message (rank 1 above
# posts R F0 and R F1 before computing), so activations arrive while the rank computes. `torch.distributed.pipelining`
# derives its SEND/RECV the same way; Megatron-LM posts each step's send-forward/receive-backward pair as one batch.
# `tests/test_nccl_rules.py` replays every schedule at $p = 2$ and $4$, with ZeRO, tp and dp, and every layout of the
# parity matrix, under both rules.

# %%
from picotron import nccl_rules
from picotron.launch import run_on_ranks
import nccl_order   # this folder: the first two versions' order on a toy model, and one step of picotron's executor

naive = run_on_ranks(nccl_rules.run_recorded, 2, nccl_order.naive_1f1b, 2)
print("gloo ran the first version's order to the end; each rank's output sum:", [round(out, 3) for out, _ in naive])
naive_verdict = nccl_rules.replay([trace for _, trace in naive], order="per-communicator")
print("first version (single messages), each communicator on its own stream:", naive_verdict)
directed = run_on_ranks(nccl_rules.run_recorded, 2, nccl_order.direction_groups_1f1b, 2)
directed_per_comm = nccl_rules.replay([trace for _, trace in directed], order="per-communicator")
directed_one = nccl_rules.replay([trace for _, trace in directed])
print("second version (a group per direction), each communicator on its own stream:", directed_per_comm)
print("second version, one order across communicators:", directed_one)
ours = run_on_ranks(nccl_rules.run_recorded, 2, nccl_order.picotron_1f1b, 2)
ours_verdict = nccl_rules.replay([trace for _, trace in ours])
print(f"picotron's executor, the same schedule on the tiny model (loss {ours[0][0]:.4f}), one order:", ours_verdict)
check("NCCL's rules: the first version deadlocks on one communicator, the second passes per communicator "
      "but deadlocks in one order, picotron's executor completes",
      not naive_verdict.ok and directed_per_comm.ok and not directed_one.ok and ours_verdict.ok,
      f"{len(naive_verdict.problems) - 1} and {len(directed_one.problems) - 1} ranks stuck vs "
      f"{ours_verdict.ops} operations matched")

# %% [markdown]
# **Tied embeddings.** Small models share one matrix between the embedding (first stage) and the LM head (last).
# The last stage keeps its own copy, initialised equal; after the backward the two gradients are summed, one
# all-reduce between exactly those two ranks (Megatron's "embedding group"; in memory when one rank holds both, as in
# the V shape), so both copies take the same step and stay equal:

# %%
_common.show_source(pp.sync_tied)

# %% [markdown]
# **Takeaway:** schedules are lists, the simulator is their referee, and one executor runs them all; tied weights
# cost one all-reduce between the two ends.
#
# ## 4. Run it
#
# The experiments run $p = 2$ processes, one per core of this machine (the simulator shows $p = 4$). The model has 8
# layers, 4 per stage (2 per chunk interleaved); the LM head over 256 byte tokens costs 8% of a layer, so the stages
# cost nearly the same, as the closed forms assume. Each schedule is built as `picotron.train` builds it
# (`parallelize` with `pp_schedule=...`) and its executor gets a `Timeline`: every action is an event on its rank.
#
# A forward waiting for its message waits *inside* its event, so each wait is timed and left out of the busy time:
# **measured bubble = 1 − (sum over ranks of the compute time) / (ranks × the step's length)**. On a shared machine
# another program may take a core (read from each action's CPU time) or slow one (the same action suddenly takes
# longer): a step's *disturbance* (rank-time without a core) plus its *spread* (the relative standard deviation of
# each kind of action's times) says how far it is from quiet.
#
# A message late because gloo's threads waited for a core shows in neither, so the experiment also reads the cores' share used by *other programs* (`_common.LoadWindow`,
# from `/proc/stat`). It steps on, up to a limit, until a step scores under 0.15 (the three summed), keeps the
# shortest such step (or the quietest), and prints **?** (inconclusive, rerun) instead of ✗ for a bubble check that
# misses while other programs held over 10% of the cores, or while one kind of action's times spread over 5%. The
# bytes, memory and parity checks are ✓ or ✗ regardless.

# %%
run("bubble,memory", nproc=P)
bub = _common.load_json(OUT / f"bubble_pp{P}.json")["results"]
mem = _common.load_json(OUT / f"memory_pp{P}.json")["results"]
rows = bub["rows"]

# %% [markdown]
# ### (a) Every schedule, simulated and measured
# $m = 8$ (ZB-V: the largest $m$ measured). Left: the simulator, unit costs ($t_F = 1$, $t_B = 2$; split: $1, 1, 1$).
# Right: the kept measured step on two processes, in milliseconds, compute only (white gaps: the bubble). A bar's
# number is its micro-batch; hatched bars are a rank's second chunk.

# %%
lesson.plot_gantt_pairs(rows, m=8); plt.show()

# %% [markdown]
# The measured charts have the simulated shapes (AFAB's blocks, 1F1B's alternation, interleaving's narrower bars,
# ZB-H1's W's filling rank 0's end, ZB-V's V); the real costs differ: here a backward costs less than twice a forward,
# and $B$, $W$ are not equal to $F$.
#
# ### (b) The bubble against $m$: measured, formula, and simulated with the measured costs
# The simulator is also run with the kept step's mean compute time per kind of action, rank and chunk, messages
# instant: the schedule on an ideal machine with *these* costs.

# %%
print(f"{'schedule':<17}{'m':>3} {'measured':>9} {'formula':>8} {'sim, measured costs':>20} {'sim, unit':>10}   "
      f"t_F / t_B / t_W (ms)   disturbance + spread   others   steps (bubble range)")
for r in rows:
    k = r["per_kind"]
    print(f"{lesson.LABELS[r['name']]:<17}{r['m']:>3} {r['bubble']:>9.1%} "
          + (f"{r['formula']:>8.1%}" if r["formula"] is not None else f"{'--':>8}")
          + f" {r['sim_measured']:>20.1%} {r['sim_unit']:>10.1%}   "
          + f"{' / '.join(f'{1e3 * k[x]:.1f}' for x in 'FBW' if x in k):<22} {r['disturbance']:>5.1%} + {r['spread']:>5.1%}"
          + f"   {r['busy']:>6.0%}   {len(r['bubbles'])} ({min(r['bubbles']):.0%}-{max(r['bubbles']):.0%})")
lesson.plot_bubbles(rows); plt.show()

# %% [markdown]
# How to read it. The closed forms assume equal stages, instant messages and, for ZB-H1, $t_F = t_B = t_W$. For
# AFAB, 1F1B and interleaving $t_B/t_F$ does not matter (idle time and work both scale with $t_F + t_B$), so on equal
# stages the measurement should land on the formula. The simulator with measured costs explains part of the rest: a
# last stage a few percent slower (LM head, loss); for ZB-H1 a $W$ cheaper than $F$ (only the linear layers' weight
# gradients are in $W$), leaving less to fill the bubble with; a rank slowed by another program for a whole run.
#
# What it does not know is the messages' delivery: gloo's threads need a core while both ranks compute on our two,
# so a message sometimes arrives milliseconds late. That costs most where actions are short and messages many:
# interleaving's and ZB-V's measured bubbles sit a point or two above the simulated ones. (`experiment.latency_of`
# measures the median delay of the messages a rank waited for; the row keeps that simulation as
# `sim_measured_latency`, which overshoots, since most messages arrive before they are needed.) The printed
# step-to-step range is the machine's noise. Right plot, $p = 4$ simulated: the bubble grows with $p$ for a given $m$,
# so deeper pipelines need more micro-batches.
#
# For ZB-H1, $W$ takes about three quarters of $F$'s time here. The same derivation with any costs (step $=
# m(t_F+t_B+t_W) + (p-1)(t_F+t_B-t_W)$: the cool-down's $W$'s fill all but $t_F + t_B - t_W$ of each idle slot,
# [reference](../../docs/reference.md#pipeline-parallelism)) gives `lesson.zb_h1_formula`; the checks hold ZB-H1's
# measurement to it with the measured $t_F$, $t_B$, $t_W$, and print the equal-cost value beside it.

# %%
def uneven(r):
    """Why a bubble check on a step of spread > 5% cannot decide: the closed forms assume each action costs the same."""
    return (f"one kind of action took {r['spread']:.0%} more or less time from one to the next (spread), more than "
            "the 5 points allowed: the formula assumes each costs the same") if r["spread"] > 0.05 else None


for r in rows:
    if r["formula"] is not None:
        zb = r["name"] == "zb-h1"
        check(f"{lesson.LABELS[r['name']]}, m={r['m']}: measured bubble within 5 points of the formula"
              + (" with the measured t_F, t_B, t_W" if zb else ""), abs(r["bubble"] - r["formula_costs"]) <= 0.05,
              f"measured {r['bubble']:.1%}, formula {r['formula_costs']:.1%}"
              + (f" (with t_F = t_B = t_W: {r['formula']:.1%})" if zb else "") + ", simulated with the measured costs "
              f"{r['sim_measured']:.1%} (disturbance {r['disturbance']:.1%}, spread {r['spread']:.1%}, other programs "
              f"{r['busy']:.0%} of the cores)", busy=_common.busy_reason(r["busy"], what="during the kept step") or uneven(r))
for name in (n for n in lesson.FORMULA if any(r["name"] == n for r in rows)):
    rs = sorted((r for r in rows if r["name"] == name), key=lambda r: r["m"])
    if len(rs) < 2:  # interleaved at p = 8 in FAST mode: m = 8 only (m must be a multiple of p)
        print(f"{lesson.LABELS[name]}: one m measured at p={P}, nothing to compare: skipped")
        continue
    check(f"{lesson.LABELS[name]}: the bubble shrinks as m grows (measured)", rs[-1]["bubble"] < rs[0]["bubble"],
          " -> ".join(f"m={r['m']}: {r['bubble']:.1%}" for r in rs),
          busy=_common.busy_reason(max(rs[0]["busy"], rs[-1]["busy"]),
                                   what=f"during m={rs[0]['m']}'s or m={rs[-1]['m']}'s kept step"))

# %% [markdown]
# **What interleaving and splitting bought here.** At the largest $m$ measured, against 1F1B:

# %%
top = max(r["m"] for r in rows if r["name"] == "1f1b")
at = {r["name"]: r for r in rows if r["m"] == top}
for name in ("interleaved", "zb-h1", "zb-v"):
    r, one = at[name], at["1f1b"]
    print(f"{lesson.LABELS[name]:<17} m={top}: bubble {r['bubble']:.1%} vs 1F1B's {one['bubble']:.1%} (formula "
          f"{one['formula']:.1%} -> " + (f"{r['formula']:.1%})" if r["formula"] is not None else
                                         f"simulated {r['sim_unit']:.1%})")
          + f"; bytes sent per step {r['p2p'][-1] / MiB:.1f} MiB vs {one['p2p'][-1] / MiB:.1f}")
inter = [(r, next(o for o in rows if o["name"] == "1f1b" and o["m"] == r["m"])) for r in rows if r["name"] == "interleaved"]
p_, v_ = inter[0][0]["p"], inter[0][0]["v"]
ratios = [r["p2p"][-1] / one["p2p"][-1] for r, one in inter]
check(f"interleaved, v={v_}: bytes sent per step = (pv-1)/(p-1) times 1F1B's (stage boundaries counted), every m",
      all(abs(x - (p_ * v_ - 1) / (p_ - 1)) < 1e-9 for x in ratios),
      f"measured {', '.join(f'{x:.3f}' for x in ratios)} vs ({p_}*{v_} - 1)/({p_} - 1) = {(p_ * v_ - 1) / (p_ - 1):.3f}, "
      f"not v = {v_}")

# %% [markdown]
# Interleaving halves the filling and draining ($v = 2$) and pays with messages: each micro-batch crosses $pv - 1 = 3$
# boundaries instead of $p - 1 = 1$, so $\frac{pv-1}{p-1}$ times 1F1B's bytes, 3 here, not $v = 2$ (section (d)); this
# exact count is the lesson's refinement of Narayanan et al. 2021a's (§2.2.2) "increases by $v$".
#
# Splitting the backward costs no extra bytes or FLOPs (each of the two matmuls runs once, at different times) but
# keeps each layer's input and output gradient alive from $B$ until $W$ (section (c)). ZB-V combines both: two chunks
# per rank in a V, so rank 0 has work at both ends, and the $W$'s fill the rest; the V's turn stays on one rank, in
# memory. Per-action fixed costs (Python, a message, the timeline) weigh more here than on a GPU in the smaller
# actions of interleaving and ZB-V.
#
# ### (c) Memory per stage
# One more step per schedule ($m$ = the largest above) follows every tensor autograd saves while it is alive (a
# saved-tensor hook hands autograd a small holder whose finalizer runs when it is released), plus the split schedules'
# weight-gradient stash. A chunk's bytes per micro-batch are what its first forward added; the prediction walks the
# rank's list, adding them at F and removing them at B (split schedules: at W).

# %%
for row in mem["rows"]:
    for r in row["ranks"]:
        per = sum(r["per_chunk"].values()) / len(r["per_chunk"])
        print(f"{lesson.LABELS[row['name']]:<17} rank {r['rank']}: peak {r['peak'] / MiB:6.2f} MiB measured, "
              f"{r['predicted'] / MiB:6.2f} predicted ({r['peak'] / per:.2f} x one micro-batch's {per / MiB:.2f} MiB)"
              + (f", {r['predicted_stash'] / MiB:.2f} with B keeping only the stash ({sum(r['stash'].values()) / len(r['stash']) / MiB:.2f} MiB per micro-batch)"
                 if r["predicted_stash"] else "") + f"; the executor's count {r['executor'] / MiB:.2f}")
lesson.plot_memory(mem); plt.show()

# %% [markdown]
# AFAB holds all $m$ micro-batches on both stages; 1F1B holds $p - r$: 2 on rank 0, 1 on rank 1 — $2/m$ and $1/m$
# of AFAB's, for the same bubble. Interleaving holds more than 1F1B on rank 0: its warm-up is $2(p-r-1) + (v-1)p$
# chunk-forwards, and the first stage holds $p\left(1+\frac{p-1}{pv}\right)$ whole-stage micro-batches
# (Korthikanti et al. 2022 §4.2.3, who write $m$ for our $v$), $2.5$ at $p = v = 2$.
#
# The executor's own count (`metrics.ActivationPeak` on its phases, what `picotron.train` logs) is a third reading:
# a micro-batch counted whole from its F to its B (split: its W). On split schedules it is an upper bound: from $B$
# to $W$ a micro-batch keeps its linear layers' inputs and output gradients, not what the forward saved, and the
# prediction counting those is the one the measurement follows.

# %%
m_mem = mem["rows"][0]["m"]
for row in mem["rows"]:
    for r in row["ranks"]:
        want = r["predicted_stash"] or r["predicted"]
        check(f"{lesson.LABELS[row['name']]}, rank {r['rank']}: peak activations = the schedule's prediction",
              abs(r["peak"] / want - 1) <= 0.02,
              f"{r['peak'] / MiB:.2f} vs {want / MiB:.2f} MiB" + (" (B keeps the stash)" if r["predicted_stash"] else ""))
        split = r["predicted_stash"] is not None
        check(f"{lesson.LABELS[row['name']]}, rank {r['rank']}: the executor's own count "
              + ("bounds the measured peak (it keeps a micro-batch whole until W)" if split else "= the measured peak"),
              r["executor"] >= 0.98 * r["peak"] if split else abs(r["executor"] / r["peak"] - 1) <= 0.02,
              f"{r['executor'] / MiB:.2f} vs {r['peak'] / MiB:.2f} MiB measured")
for row in mem["rows"]:
    if row["name"] in ("afab", "1f1b"):
        for r in row["ranks"]:
            held = r["peak"] / r["per_chunk"]["0"]
            want = m_mem if row["name"] == "afab" else min(row["p"] - r["rank"], m_mem)
            check(f"{lesson.LABELS[row['name']]}, rank {r['rank']}: holds {'m' if row['name'] == 'afab' else 'p - r'} = "
                  f"{want} micro-batches", abs(held - want) < 0.01, f"peak / one micro-batch = {held:.3f}")
    if row["name"] == "interleaved":  # stage 0, in micro-batches of a whole stage (all v chunks)
        r, p_, v_ = row["ranks"][0], row["p"], lesson.chunks("interleaved")
        # at most all m: at p = 8 (PICOTRON_NPROC=8) FAST's m = 8 ends the warm-up before it is whole
        held, want = r["peak"] / sum(r["per_chunk"].values()), min(p_ * (1 + (p_ - 1) / (p_ * v_)), row["m"])
        check(f"interleaved, v={v_}, rank 0: holds p(1 + (p-1)/(pv)) = {want:g} whole-stage micro-batches (at most m) "
              f"(Korthikanti et al. 2022, 4.2.3)", abs(held / want - 1) <= 0.02, f"peak / one micro-batch = {held:.3f}")

# %% [markdown]
# ### (d) Point-to-point bytes per step
# A `metrics.Recorder` on the mesh counts the bytes the executor sends (each message goes through its link's
# `Axis.exchange`, which reports as every collective does). The second check holds each rank's sends and receives of
# every measured step against a count from its action list alone (`experiment.messages_of`): a message dropped,
# doubled or kept in memory shows there. Every boundary carries each micro-batch's activation, $b \cdot s \cdot h$
# fp32 numbers, forward, and its gradient backward:
# $2(S-1)\,m\,b\,s\,h \cdot 4$ bytes per step over all ranks with $S = p\,v$ stages ($2(S-2)$ for ZB-V, whose turn
# stays on one rank):

# %%
act = 4 * bub["b"] * bub["s"] * bub["h"]
print(f"one activation: {bub['b']} x {bub['s']} x {bub['h']} fp32 = {act / 1024:.0f} KiB")
for r in rows:
    print(f"{lesson.LABELS[r['name']]:<17} m={r['m']:<3} counted {r['p2p'][-1] / MiB:6.2f} MiB per step, formula "
          f"{r['p2p_formula'] / MiB:6.2f} MiB = {r['p2p_formula'] // act} activations")
check("every schedule and m: bytes sent per step = the formula, every measured step",
      all(x == r["p2p_formula"] for r in rows for x in r["p2p"]), f"{len(rows)} (schedule, m) pairs")
for name in lesson.SCHEDULES:  # per rank: the messages the executor posted against those its list implies
    rs = [r for r in rows if r["name"] == name]
    wrong = [f"m={r['m']}: {line}" for r in rs for step in r["messages"]
             for line in lesson.message_problems(ps.build(name, r["p"], r["m"], r["v"]), step)]
    check(f"{lesson.LABELS[name]}: each rank's messages per step (the recorder's count of what the executor posted) "
          f"= those its action list implies", not wrong and all(r["messages"] for r in rs),
          wrong[0] if wrong else f"{sum(map(len, (r['messages'] for r in rs)))} steps; at m={rs[-1]['m']} (sent, "
          f"received) per rank {[tuple(x) for x in rs[-1]['messages'][-1]]}")

# %% [markdown]
# A few MiB per step, against tensor parallelism's four all-reduces per layer: why pipelines go between nodes.
# Interleaving multiplies it by $\frac{pv-1}{p-1}$: 3 here, $15/7 \approx 2.1$ at $p = 8$, $v = 2$, towards $v$ as $p$
# grows.
#
# **Takeaway:** on equal stages the measured bubble follows $\frac{p-1}{m+p-1}$ and its refinements; memory follows
# the schedule's list; the traffic is exactly one activation per boundary and micro-batch each way.
#
# ## 5. Check it: every schedule trains like one process
#
# `picotron.train` with `--pp 2` and each `--pp-schedule`, and 1F1B with tied embeddings, against one process with
# the same global batch (the same rows, accumulated), fp32, same seed: per-step losses within $10^{-5}$ relative over
# the first 10 steps, the [parity standard](../../docs/reference.md#parity-standard) (full settings train 20 steps;
# after step 10, drift against $10^{-3}$, lesson 03 section 5). Rank 0 trains the references alone.

# %%
run("parity", nproc=P)
par = _common.load_json(OUT / f"parity_pp{P}.json")["results"]
pairs = {name: (losses, par["reference"]["tied" if "tied" in name else "untied"]) for name, losses in par["losses"].items()}
for label, (got, want) in pairs.items():
    p_ = _common.parity(got, want)
    print(f"{label:<12} vs 1 process: max relative loss difference over steps 1-{p_['window']} {p_['worst']:.1e}"
          + (f", over steps {p_['window'] + 1}-{p_['n_steps']} {p_['beyond']:.1e}" if p_["n_beyond"] else ""))
lesson.plot_parity(pairs); plt.show()

# %%
for label, (got, want) in pairs.items():
    for line in _common.parity_checks(f"pp={P} {label}", got, want):
        check(*line)
t = par["tied"]
check("tied embeddings: the first stage's and the last stage's copies are still equal after training",
      t["max_abs_diff"] == 0.0, f"{t['first']} (rank 0) vs {t['last']} (rank 1): max |difference| {t['max_abs_diff']}")

# %% [markdown]
# The losses differ only in the last digits: a pipeline changes where layers run, not the arithmetic (each
# micro-batch's loss is divided by $m$, as in gradient accumulation). The tied matrix's two copies are bit-for-bit
# equal after every step.
#
# **Takeaway:** every schedule is the same training; they differ only in time and memory.
#
# ## 6. Explore: any schedule, any $p$, $m$, $v$
#
# The simulator with unit costs ($t_F = 1$, $t_B = 2$; split: all 1): the Gantt chart, the bubble, and peak
# activations per rank in whole-stage micro-batches. At $p = 8$, how many micro-batches does 1F1B need for a bubble
# under 10%, and interleaving with $v = 4$? Why does AFAB's memory grow with $m$ and 1F1B's not? What does ZB-V give
# at $m = p$? (Widgets need a live kernel; settings a schedule does not allow print the rule.)

# %%
def draw(schedule="1f1b", p=4, m=8, v=2):
    v = ps.chunks_of(schedule, v)
    try:
        fig, sim = lesson.plot_widget(schedule, p, m, v)
    except ps.ScheduleError as e:
        print(e)
        return
    plt.show()
    closed = f"; closed form {lesson.formula(schedule, p, m, v):.1%}" if schedule in lesson.FORMULA else ""
    print(f"{schedule}, p={p}, m={m}, v={v}: bubble {sim.bubble:.1%} of the step{closed}; the Playbook's "
          f"(idle / ideal time) {sim.bubble / (1 - sim.bubble):.1%}; peak activations per rank (whole-stage micro-"
          f"batches): {[x / v for x in sim.peak_alive]}")

_common.interactive(draw, lambda w: dict(schedule=w.Dropdown(options=list(ps.SCHEDULES), value="1f1b"),
                                         p=w.IntSlider(value=4, min=1, max=8, description="p (stages)"),
                                         m=w.IntSlider(value=8, min=1, max=32, description="m (micro-batches)"),
                                         v=w.IntSlider(value=2, min=1, max=4, description="v (interleaved)")))

# %% [markdown]
# **Takeaway:** the bubble is a property of the list; the simulator answers "how many micro-batches?" before any
# GPU is rented.

# %% [markdown]
# ## 7. DualPipe: feed the pipeline from both ends
#
# DeepSeek-V3 trains with **DualPipe** (DeepSeek-V3 technical report, §3.2.1, Figure 5 and Table 2; the Ultra-Scale
# Playbook, "Zero Bubble and DualPipe"). Every rank holds **two** of the $p$ stages: rank $r$ runs stage $r$ (chunk
# 0) and a copy of stage $p-1-r$ (chunk 1). Half the micro-batches enter at rank 0 and go down through the chunks 0;
# the other half enter at rank $p-1$ and go back up through the copies. Both ends start at once, so one direction's
# warm-up is the other's cool-down. The backward is split into $B$ and $W$, and a forward of one direction is paired
# with a backward of the other, **F&B**, overlapped on a GPU (one's all-to-all behind the other's compute), back to
# back here. Table 2 of the report gives, per rank:
#
# $$\text{idle} = \left(\tfrac{p}{2}-1\right)\left(F\&B + B - 3W\right),\qquad \text{parameters } 2\times,\qquad
# \text{activations of } p+1 \text{ micro-batches,}$$
#
# with $B$ the whole backward ($t_B + t_W$ here) and $F\&B$ the pair's time. The price is the copies: twice the
# parameters, gradients and optimizer state, and after the backward mirror ranks ($r$ and $p-1-r$ hold the same two
# stages) exchange both stages' gradients so both copies take the same step. `ps.dualpipe(p, m)` builds the lists
# ($p$ even, $m$ even, $m \ge 2p$); `Schedule.where(stage, mb)` depends on the micro-batch's direction. The simulator
# reproduces Table 2 when each F&B pair runs as one unit whose outputs leave at its end (`pairs=True`), with
# $t_F = t_B = t_W = 1$ and $F\&B = 3$:

# %%
for p_ in (4, 8):
    sch = ps.build("dualpipe", p_, 2 * p_)
    paired, alone = ps.simulate(sch, pairs=True), ps.simulate(sch)
    print(f"p={p_}, m={2 * p_}: rank 0 runs {' '.join(map(repr, sch.ranks[0][:12]))} ... (.1: the copy, fed from rank "
          f"{p_ - 1}); idle per rank: pairs {paired.makespan - 6 * p_:g}, action by action {alone.makespan - 6 * p_:g}, "
          f"Table 2 {ps.dualpipe_idle(p_):g}; activations alive {max(paired.peak_alive)} micro-batches")
    check(f"DualPipe, p={p_}: the simulated idle with F&B pairs = (p/2 - 1)(F&B + B - 3W), and p + 1 activations",
          paired.makespan - 6 * p_ == ps.dualpipe_idle(p_) and max(paired.peak_alive) == p_ + 1,
          f"{paired.makespan - 6 * p_:g} = {ps.dualpipe_idle(p_):g} time units, {max(paired.peak_alive)} micro-batches")

# %% [markdown]
# Run action by action, as on a CPU where nothing overlaps, each output leaves when its own action ends, and the idle
# time is half the formula's. At $p = 2$ the formula is 0 whatever the costs: each rank holds the whole model, and the
# two directions fill each other's gaps.
#
# The experiment times ZB-V and DualPipe on two processes at $m = 16$ (FAST: 8), as section 4 did, and counts the
# parameter bytes per rank under DualPipe and 1F1B:

# %%
run("dualpipe", nproc=P, hide=tuple(lesson.LABELS[n] + " " for n in ("zb-v", "dualpipe")))  # its rows: printed below
dual = _common.load_json(OUT / f"dualpipe_pp{P}.json")["results"]
zbv, dp = (next(r for r in dual["rows"] if r["name"] == n) for n in ("zb-v", "dualpipe"))
for r in (zbv, dp):
    k = r["per_kind"]
    print(f"{lesson.LABELS[r['name']]:<9} p={r['p']} m={r['m']}: bubble measured {r['bubble']:.1%}, simulated with "
          f"the measured costs {r['sim_measured']:.1%}; t_F / t_B / t_W {1e3 * k['F']:.1f} / {1e3 * k['B']:.1f} / "
          f"{1e3 * k['W']:.1f} ms; sent {r['p2p'][-1] / MiB:.2f} MiB per step; other programs {r['busy']:.0%} of the cores")
k, m_ = dp["per_kind"], dp["m"]
check(f"DualPipe, p={dp['p']}, m={m_}: measured bubble within 5 points of Table 2's (p/2 - 1)(F&B + B - 3W) with the "
      f"measured t_F, t_B, t_W", abs(dp["bubble"] - dp["formula_costs"]) <= 0.05,
      f"measured {dp['bubble']:.1%}, formula {dp['formula_costs']:.1%}, simulated with the measured costs "
      f"{dp['sim_measured']:.1%} (disturbance {dp['disturbance']:.1%}, spread {dp['spread']:.1%})",
      busy=_common.busy_reason(dp["busy"], what="during the kept step") or uneven(dp))
one, two = dual["param_bytes"]["1f1b"], dual["param_bytes"]["dualpipe"]
print(f"parameter bytes per rank: 1F1B {[f'{x / MiB:.2f} MiB' for x in one]}, DualPipe {[f'{x / MiB:.2f} MiB' for x in two]}")
check("DualPipe: each rank holds its stage and its mirror's: bytes = 1F1B's rank r + rank p-1-r, 2x in all",
      all(two[r] == one[r] + one[len(one) - 1 - r] for r in range(len(one))) and sum(two) == 2 * sum(one),
      f"{sum(two) / MiB:.2f} MiB vs 1F1B's {sum(one) / MiB:.2f} MiB over the ranks")
check("DualPipe: bytes sent per step = the activations' formula + each rank's gradients once to its mirror",
      all(x == dp["p2p_formula"] + sum(two) for x in dp["p2p"]),
      f"{dp['p2p'][-1] / MiB:.2f} MiB = {dp['p2p_formula'] / MiB:.2f} + {sum(two) / MiB:.2f}")
for p_ in (4, 8):  # deeper pipelines, from the simulator with this machine's costs
    m4 = 2 * p_
    sim4 = [ps.simulate(ps.build("dualpipe", p_, m4), cost=k, pairs=pr).bubble for pr in (True, False)]
    print(f"p={p_}, m={m4}, with these t_F, t_B, t_W: Table 2 {lesson.dualpipe_formula(p_, m4, k['F'], k['B'], k['W']):.1%}, "
          f"simulated with F&B pairs {sim4[0]:.1%}, action by action {sim4[1]:.1%}; ZB-V simulated "
          f"{ps.simulate(ps.build('zb-v', p_, m4), cost=k).bubble:.1%}")

# %%
lesson.plot_dualpipe(dual["rows"], p=4, m=8); plt.show()

# %% [markdown]
# At $p = 2$ Table 2 and the simulator with equal costs say 0. The measurement adds this machine: message delivery,
# and ranks slowed unequally by other programs (then the simulator with *measured* costs is not 0 either). A quiet
# step measured about 1%; a busy one far more, and the check prints ? rather than ✗.
#
# DualPipe's stages are twice ZB-V's chunks, so its actions are longer and fewer. It pays in the other two checks:
# twice the parameter bytes, and each step the copies' gradients cross between mirror ranks, here many times the
# activations' traffic since our micro-batches are small (DeepSeek-V3 spreads it over its expert parallelism, whose
# 2× parameters are a small share of each rank). The deeper pipelines (printed, simulated with this machine's costs) show Table 2 is
# derived for pairs: when $t_F$, $t_B$, $t_W$ differ, its value moves with how F&B overlaps.
#
# **Takeaway:** DualPipe halves the warm-up by feeding the pipeline from both ends, and pays with a second copy of
# every stage and its gradient exchange.
#
# ## 8. On an 8-GPU node you should see
#
# On a node each stage has a GPU of its own and activations cross NVLink: a message takes microseconds, and no
# stage waits for a core. `PICOTRON_NPROC=8` runs sections 4, 5 and 7 at $p = 8$, with 16 layers (ZB-V and DualPipe
# need $2p$ chunks). The planner predicts each schedule at $p = 8$, $m = 16$, the medium model's micro-batches of 4 × 512:

# %%
import _node   # lessons/_node.py: the planner's predictions for one 8×H100 node, and the command that measures them
_node.show("07_pipeline_parallel")

# %% [markdown]
# **Takeaway:** at $p = 8$ the bubble is the schedule's formula: 1F1B's $(p-1)/(m+p-1)$ costs 30% at $m = 16$, ZB-V
# about 7%; AFAB costs 1F1B's time and over twice its activations.
#
# ## 9. Exercises
# Open `lessons/07_pipeline_parallel/exercise.py`:
#
# 1. `one_f_one_b_rank(i, p, m)`: the 1F1B action list of stage $r$ (the argument `i`), simulated with the other
#    stages' reference lists for several $(p, m)$; the checker prints the simulator's sentence for the first problem
#    (a deadlock naming who waits for what, a B before its F, a micro-batch missing or twice), then checks memory
#    ($\le p - r$ micro-batches) and step time.
#
# 2. `forward_step(stage, x, prev, next, shape)`: one forward with its messages (receive, compute, send on), on 2 and
#    3 processes; the checker names the rank that received the wrong tensor (or used its buffer before the message
#    arrived) and the rank that hangs, with its line.
#
# 3. `sync_tied_grads(embedding, head, group)` — make the gradients of the first and last stage's copies of a tied
#    matrix equal to their sum. Checked on 1, 2 and 3 processes.
#
# 4. `dualpipe_place(stage, mb, p, m)` — DualPipe's (rank, chunk) for a stage of a micro-batch. Checked against the
#    schedule for several $(p, m)$; the checker says what a wrong place mixes up (the direction, the halves, the mirror).
#
# Until you write them, the checker reports `NotImplementedError: not written yet`:

# %%
import check as checker   # this folder's check.py
all_passed = checker.check()
_common.summary()   # this notebook's own checks, counted: ✓, ? and ✗

# %% [markdown]
# **Takeaway:** a schedule is right when its lists can run together; a stage is its receive, its compute and its
# send; tied weights are one sum.
#
# ## 10. What it costs, when to use it, what comes next
#
# | | per rank | communication | use it when |
# |---|---|---|---|
# | pipeline parallel, $p$ stages | $\frac1p$ of the layers and their model states; activations of up to $p$ micro-batches (1F1B) on the first stage | one activation per micro-batch and stage boundary each way, point to point, overlappable | the model does not fit a node: pipelines go **across nodes** (tensor parallelism inside), with $m \gg p$ micro-batches per step |
# | + interleaving ($v$ chunks) | the same layers, in $v$ pieces; activations of $p(1+\frac{p-1}{pv})$ micro-batches on the first stage | $\frac{pv-1}{p-1}\times$ the messages ($\to v$ for large $p$) | the bubble matters and the link is fast; $m$ a multiple of $p$ |
# | + split backward (ZB-H1, ZB-V) | also each layer's input and output gradient from $B$ to $W$ | the same | the bubble matters and memory allows |
# | DualPipe | $2\times$ the parameters (a copy of the mirror rank's stage), activations of $p+1$ micro-batches | the same activations, plus each stage's gradients between mirror ranks every step | $p$ even, $m \ge 2p$, and the F&B pairs can overlap communication (DeepSeek-V3's expert all-to-all) |
#
# **Its costs.** The bubble, $\frac{p-1}{m+p-1}$, unless $m$ is several times $p$, and a larger $m$ means a larger
# global batch (or smaller micro-batches, which use a GPU less well). Stages must cost the same (`split_layers`
# balances FLOPs; the embedding and LM head make the ends uneven). The first stage holds the most activations. The
# loss exists on the last stage only (picotron broadcasts it for the log); evaluation and sampling cross every stage.
#
# **What ours lacks** (Megatron-LM, torchtitan, DualPipe): messages overlapped with compute on GPUs (CUDA streams),
# ZB-H2 and automatic zero-bubble schedules (memory for an empty bubble), F&B pairs really overlapped, recomputation
# on the first stages only, and unequal stages planned from measured costs rather than FLOPs.
#
# **Next — lesson 08, expert parallelism:** the mixture-of-experts layer, whose experts live on different ranks and
# whose tokens travel to them with an all-to-all.
#
# **Takeaway:** tensor parallelism inside a node, pipeline parallelism across nodes, data parallelism around both.
