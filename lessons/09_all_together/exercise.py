"""Lesson 09 exercises: the arithmetic of a 4-D layout. Write the pieces marked EXERCISE, then
    python lessons/09_all_together/check.py                # all exercises
    python lessons/09_all_together/check.py place          # just one (or step_batch)
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
