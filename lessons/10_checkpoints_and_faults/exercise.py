"""Lesson 10 exercises: the checkpoint's index, and how often to write one. Write the pieces marked EXERCISE, then
    ./run.sh python lessons/10_checkpoints_and_faults/check.py              # all exercises
    ./run.sh python lessons/10_checkpoints_and_faults/check.py cut          # just one (or assemble, interval, resume_point)
Everything is checked in this process against picotron.checkpoint and the lesson's formulas: the checker names
the slice, the element or the number that is wrong, and recognises the usual mistakes (the flat range taken from
the whole tensor instead of the rank's box, an element nobody wrote left as zero, Young's formula without its
factor 2...). The solutions are in solution.py (look after trying).

An index entry (picotron.checkpoint.Slice) says where a rank's tensor sits in the full one:
    offsets   the corner of the rank's box (its tensor-parallel or expert slice), one number per dimension
    box       the box's shape
    flat      None, or (a, b): the rank holds only elements a..b-1 of the box, flattened row by row (a ZeRO piece)
"""
import torch


def cut(full, offsets, box, flat):
    """EXERCISE 1: the values a rank holds: the box of `full` at `offsets` with shape `box`, and, when `flat` =
    (a, b), only elements a..b-1 of that box flattened (a 1-D tensor). Without `flat`, the box itself."""
    raise NotImplementedError("not written yet")


def assemble(shape, pieces):
    """EXERCISE 2: the full tensor of `shape` from the pieces ranks wrote: each piece is (offsets, box, flat,
    values), `values` being what `cut` returns for it. Raise ValueError naming an element (its index, a tuple) if
    no piece covers it: a missing rank file must never load as zeros."""
    raise NotImplementedError("not written yet")


def interval(cost_s, mtbf_s):
    """EXERCISE 3: how many seconds of training between two checkpoints, for a save that costs `cost_s` seconds
    and failures every `mtbf_s` seconds on average. Return (young, daly): Young's first-order interval
    sqrt(2 C θ) (θ = mtbf_s), and Daly's higher-order one sqrt(2Cθ)·[1 + (1/3)·sqrt(C/(2θ)) + (1/9)·(C/(2θ))] − C,
    which is θ when C >= 2θ."""
    raise NotImplementedError("not written yet")


def resume_point(held, world_size, per_node, level2_step):
    """EXERCISE 4: where a restart resumes with two levels of checkpoints. `held` says what survives on each node's
    local disk: {node: {step: set of ranks whose level-1 shard of that step the node's folder holds}} (a node
    lost with its disk is absent or empty). Rank r lives on node r // per_node, and its peer copy on the NEXT node,
    (r // per_node + 1) % nodes. `level2_step`: the newest level-2 checkpoint's step in the shared folder (0: none).
    Return (1, step) for the newest level-1 step NEWER than level2_step at which every rank's shard is on its own
    node or on the next one; else (2, level2_step)."""
    raise NotImplementedError("not written yet")
