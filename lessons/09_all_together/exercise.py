"""Lesson 09 exercises: the arithmetic of a 4-D layout. Write the pieces marked EXERCISE, then
    ./run.sh python lessons/09_all_together/check.py                # all exercises
    ./run.sh python lessons/09_all_together/check.py place          # just one (or step_batch)
Everything is checked in this process, on grids and clusters too big to launch: the checker compares with
picotron.mesh and names the rank, the axis, the group or the number that is wrong, and recognises the usual
mistakes (dp numbered fastest, a group along the wrong axis, sequences divided over cp...). The lesson notebook
(lessons/09_all_together/09_all_together.ipynb) draws the grid and runs the layouts; the solutions are in
solution.py (look after trying).

A layout is a dict of sizes {"dp": .., "pp": .., "cp": .., "tp": ..}; ranks are numbered with tp fastest:
    rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank
"""
ORDER = ("dp", "pp", "cp", "tp")  # slowest- to fastest-varying


def place(rank, sizes):
    """EXERCISE 1: where `rank` sits on the grid `sizes` and whom it talks to. Return (coords, groups):
    coords {"dp": .., "pp": .., "cp": .., "tp": ..}, and groups {axis: [ranks]} for each of the four axes: the ranks
    that agree with `rank` on the three other coordinates, listed by their coordinate along the axis (index i holds
    the rank whose `axis` coordinate is i; the rank itself is one of them)."""
    raise NotImplementedError("not written yet")


def step_batch(global_batch_tokens, seq_len, micro_batch_size, sizes):
    """EXERCISE 4: the global-batch arithmetic of a layout. Return a dict:
    sequences               sequences per optimizer step (global_batch_tokens / seq_len)
    grad_acc                micro-batches each dp replica runs per step (the pipeline's m)
    tokens_per_micro_batch  the tokens of one micro-batch that ONE rank holds (its activations are made of these)
    bubble                  the share of the step a 1F1B pipeline of `sizes["pp"]` stages idles, with m = grad_acc
    Raise ValueError when no whole number of micro-batches gives the batch (the tokens are not whole sequences, or
    the sequences do not split evenly over the replicas' micro-batches)."""
    raise NotImplementedError("not written yet")


def memory_by_part(params, layout, activations, stage):
    """EXERCISE 3: the memory of one GPU of a layout, by part, in bytes, in bf16 mixed precision (bf16 parameters
    and gradients, an fp32 master copy and AdamW's two fp32 moments). `params`: the parameters this GPU's stage
    holds on it (its slice under tp); `layout`: a picotron.planner.Layout (.dp .tp .pp .cp .zero .grad_acc; the
    1F1B schedule); `activations`: the bytes one micro-batch's forward leaves on this GPU; `stage`: its pipeline
    stage (0 = first). Return {"params", "grads", "optimizer", "activations"}: ZeRO-1 shards the optimizer state,
    ZeRO-2 also the gradients, ZeRO-3 also the parameters, over the ranks that hold the same parameters; the
    activations are those of the micro-batches alive at the schedule's peak on this stage."""
    raise NotImplementedError("not written yet")


def choose(candidates, memory_gib, step_seconds, budget_gib, global_seqs):
    """EXERCISE 4: the decision procedure. `candidates`: Layouts (.dp .micro_batch_size .grad_acc ...), in the order
    to try them; memory_gib(layout) and step_seconds(layout): the planner's predictions; budget_gib: the GiB per
    GPU a layout may use (the checker gives 71.7, an H100's 79.6 less 10% headroom, then 35.6, an A100 40GB's
    39.6 less 10%); global_seqs: sequences per optimizer step. Step 1: reject what does not fit ("memory"); step 2: reject
    what does not run exactly global_seqs sequences per step ("batch"); a layout failing both is rejected at the
    first step that fails. Step 3: of the rest, the one with the most tokens per second. Return (best or None,
    [(layout, "memory" | "batch"), ...] in the candidates' order)."""
    raise NotImplementedError("not written yet")


def clock_shifts(markers, hosts):
    """EXERCISE 5: one clock for every rank of a merged trace (section 2b). `markers`: {rank: the time, in µs on its
    machine's clock, at which the rank left the barrier at the start of the profiled range}; `hosts`: {rank: its
    machine's name}. Ranks of one machine share that machine's clock; machines' clocks disagree. Return {rank: shift}
    (µs) such that merged time = a rank's own time - its shift puts every machine's earliest barrier leaver at 0
    and keeps the ranks of one machine on their common clock (picotron.trace.merge's rule)."""
    raise NotImplementedError("not written yet")
