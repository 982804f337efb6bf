"""Checker for lesson 10's exercises.

    ./run.sh python lessons/10_checkpoints_and_faults/check.py [name ...] [--solutions | --module my.py]
(what each option does, and the call from the notebook: lessons/_checker.py.) Everything runs in this process.

cut: every slice of real checkpoints' indexes (tensor-parallel boxes along either dimension, ZeRO's flat ranges
inside a box, pipeline stages) against picotron.checkpoint.Slice.cut; names the tensor, the rank's entry and the
first wrong element, and recognises the flat range taken from the whole tensor instead of the box, and the box
read with its offsets and shape swapped.
assemble: the pieces of those indexes back into whole tensors, in any order; names the element that is wrong and
recognises a box written through a strided view that never reached the tensor; a missing piece must raise
ValueError naming an uncovered element, not load as zeros.
interval: Young's and Daly's intervals for save costs from a second to an hour and failure rates from minutes
to months (and C >= 2θ); recognises Young without its factor 2, and Daly without its − C.
resume_point: which step, at which level, a restart resumes from, given which level-1 shards survive on which
node: a lost node whose shards live on the next node, a lost pair, a half-written newest step, level 2 newer than
level 1, one node without peers; names a level-1 step taken with a missing shard (which rank, which nodes), a
complete level-1 step passed over (whose shard only the peer holds: the peer is the NEXT node), and a level-1 step
taken that is not newer than level 2's.
"""
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # lessons/: _checker, which puts the repository root on sys.path too
from _checker import entry_points, in_process  # noqa: E402

import torch  # noqa: E402

from picotron.checkpoint import Slice  # noqa: E402


LEARNER = HERE / "exercise.py"
SOLUTIONS = HERE / "solution.py"
TIMEOUT_S = 30.0
EXERCISES = {"cut": "cut", "assemble": "assemble", "interval": "interval", "resume_point": "resume_point"}


def _entries():
    """Index entries as picotron writes them: (label, full shape, [Slice per rank]) for a row-parallel weight at
    tp 2 under ZeRO-1 over dp 2, a column-parallel one at tp 4, a norm cut by ZeRO over 3 ranks, a 3-D tensor."""
    def zero(shape, offsets, box, n):
        numel = math.prod(box)
        chunk = math.ceil(numel / n)
        return [(offsets, box, (r * chunk, min(numel, (r + 1) * chunk))) for r in range(n) if r * chunk < numel]

    cases = []
    shape = (12, 10)  # down_proj [h, i]: tp splits dim 1; ZeRO over 2 cuts each box's flat view
    pieces = zero(shape, (0, 0), (12, 5), 2) + zero(shape, (0, 5), (12, 5), 2)
    cases.append(("a row-parallel weight, tp 2 x ZeRO-1 over dp 2", shape, pieces))
    shape = (16, 6)
    cases.append(("a column-parallel weight at tp 4", shape, [((4 * r, 0), (4, 6), None) for r in range(4)]))
    cases.append(("a norm weight, ZeRO over 3 ranks", (10,), zero((10,), (0,), (10,), 3)))
    shape = (4, 6, 5)
    cases.append(("a 3-D tensor split on dim 1, ZeRO over 2", shape,
                  zero(shape, (0, 0, 0), (4, 3, 5), 2) + zero(shape, (0, 3, 0), (4, 3, 5), 2)))
    return [(label, shape, [Slice("w", shape, o, b, f) for o, b, f in pieces]) for label, shape, pieces in cases]


def _full(shape):
    return torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + 1  # no zeros: a gap shows


def _desc(s):
    return f"offsets {s.offsets}, box {s.box}" + (f", flat {s.flat}" if s.flat else "")


# ------------------------------------------------------------------------------------------ exercise 1
def _cut_problem(fn, path):
    for label, shape, slices in _entries():
        full = _full(shape)
        for r, s in enumerate(slices):
            want = s.cut(full)
            got = fn(full.clone(), s.offsets, s.box, s.flat)
            head = f"{label}, entry {r} ({_desc(s)})"
            if not torch.is_tensor(got):
                return f"{head}: returned {type(got).__name__}; return a tensor"
            if tuple(got.shape) != tuple(want.shape):
                if s.flat and got.numel() == want.numel():
                    return f"{head}: shape {tuple(got.shape)}, expected {tuple(want.shape)}: a flat range is 1-D"
                return f"{head}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
            if not torch.equal(got, want):
                if s.flat and torch.equal(got.reshape(-1), full.reshape(-1)[s.flat[0]:s.flat[1]]):
                    return (f"{head}: you took elements {s.flat[0]}..{s.flat[1] - 1} of the whole tensor flattened; "
                            f"the range counts inside the rank's box (cut the box first, then flatten it)")
                i = int((got.reshape(-1) != want.reshape(-1)).nonzero()[0])
                return (f"{head}: element {i} of the slice is {got.reshape(-1)[i].item():g}, expected "
                        f"{want.reshape(-1)[i].item():g} (the full tensor holds 1, 2, 3, ... row by row)")
    return None


# ------------------------------------------------------------------------------------------ exercise 2
STRIDED = ("a box cut along a later dimension is a strided view, .reshape(-1) of it is a copy, and writing into the "
           "copy changes nothing; fill a copy of the box, then write it back with full[box] = ...")


def _assemble_problem(fn, path):
    for label, shape, slices in _entries():
        full = _full(shape)
        pieces = [(s.offsets, s.box, s.flat, s.cut(full).clone()) for s in slices]
        for order, name in ((pieces, "in rank order"), (pieces[::-1], "in reverse rank order")):
            head = f"{label}, pieces {name}"
            try:
                got = fn(shape, list(order))
            except ValueError as e:
                return (f"{head}: raised ValueError({e}) but the pieces cover every element: {STRIDED}")
            if not torch.is_tensor(got) or tuple(got.shape) != tuple(shape):
                return f"{head}: returned {getattr(got, 'shape', type(got).__name__)}; expected a tensor of shape {shape}"
            if not torch.equal(got, full):
                bad = (got != full).nonzero()[0]
                idx = tuple(int(i) for i in bad)
                hint = ""
                if got[idx] == 0:
                    hint = f": it is still 0, so that piece's values never reached the tensor ({STRIDED})"
                return f"{head}: element {idx} is {got[idx].item():g}, expected {full[idx].item():g}{hint}"
        missing = pieces[:-1]
        try:
            got = fn(shape, missing)
        except ValueError as e:
            text = str(e)
            if not any(ch.isdigit() for ch in text):
                return f"{label}, the last piece missing: ValueError({text!r}) should name an uncovered element"
            continue
        return (f"{label}, the last piece missing: returned a tensor (elements nobody wrote read as "
                f"{'zeros' if torch.is_tensor(got) else got}); raise ValueError naming an uncovered element")
    return None


# ------------------------------------------------------------------------------------------ exercise 3
INTERVALS = ((60.0, 3 * 3600.0), (1.0, 3600.0), (600.0, 24 * 3600.0), (3600.0, 30 * 24 * 3600.0), (20.0, 600.0),
             (5.0, 180.0), (900.0, 300.0))


def _interval_problem(fn, path):
    sol = _solution()
    for c, m in INTERVALS:
        head = f"C = {c:g} s, θ = {m:g} s"
        got = fn(c, m)
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            return f"{head}: returned {got!r}; return (young, daly)"
        young, daly = sol.interval(c, m)
        g_young, g_daly = float(got[0]), float(got[1])
        if not math.isclose(g_young, young, rel_tol=1e-9):
            hint = ""
            if math.isclose(g_young, math.sqrt(c * m), rel_tol=1e-9):
                hint = ": sqrt(C·θ) lacks the factor 2 (half the lost work per failure is T/2: minimise C/T + T/(2θ))"
            return f"{head}: young = {g_young:.6g}, expected {young:.6g}{hint}"
        if not math.isclose(g_daly, daly, rel_tol=1e-9):
            hint = ""
            if c < 2 * m and math.isclose(g_daly, daly + c, rel_tol=1e-9):
                hint = ": Daly subtracts the save's cost C from the bracket"
            elif c >= 2 * m:
                hint = ": when the save costs at least 2M, Daly's interval is M"
            return f"{head}: daly = {g_daly:.6g}, expected {daly:.6g}{hint}"
    return None


# ------------------------------------------------------------------------------------------ exercise 4
def _node_of_step(world_size, per_node, ranks):
    """One node's folder after a level-1 save: its own ranks' shards and the previous node's (their peer copies)."""
    nodes = world_size // per_node
    return lambda node: {r for r in ranks if r // per_node == node or (r // per_node + 1) % nodes == node}


def _scenarios():
    """(label, held, world_size, per_node, level2_step): what survives on each node after a failure."""
    def run(world_size, per_node, steps, lost=(), partial=None):
        nodes = world_size // per_node
        folder = _node_of_step(world_size, per_node, range(world_size))
        held = {n: {s: folder(n) for s in steps} for n in range(nodes) if n not in lost}
        if partial:  # (step, ranks written): a save cut short by the crash
            step, ranks = partial
            for n in held:
                held[n][step] = _node_of_step(world_size, per_node, ranks)(n)
        return held

    return [
        ("2 nodes of 2 ranks, node 1 lost", run(4, 2, (5, 6), lost=(1,)), 4, 2, 4),
        ("3 nodes of 2 ranks, node 1 lost", run(6, 2, (7, 8), lost=(1,)), 6, 2, 6),
        ("3 nodes of 2 ranks, nodes 1 and 2 lost (a rank and its peer copy both gone)", run(6, 2, (7, 8), lost=(1, 2)),
         6, 2, 6),
        ("4 nodes of 1 rank, step 10 half written when node 3 was lost", run(4, 1, (8, 9), lost=(3,),
                                                                             partial=(10, (0, 1))), 4, 1, 6),
        ("2 nodes of 2 ranks, level 2 newer than every level-1 step", run(4, 2, (9, 11)), 4, 2, 12),
        ("one node of 2 ranks (no peer), nothing lost", run(2, 2, (3, 5)), 2, 2, 4),
        ("one node of 2 ranks (no peer), the node lost", run(2, 2, (3, 5), lost=(0,)), 2, 2, 4),
    ]


def _missing(held, world_size, per_node, step):
    """The first rank whose shard of `step` is on neither its own node nor the next one, or None."""
    nodes = world_size // per_node
    for r in range(world_size):
        own, peer = r // per_node, (r // per_node + 1) % nodes
        if not any(r in held.get(n, {}).get(step, ()) for n in (own, peer)):
            return r, own, peer
    return None


def _resume_point_problem(fn, path):
    sol = _solution()
    for label, held, world, per_node, level2 in _scenarios():
        want = sol.resume_point(held, world, per_node, level2)
        got = fn({n: {s: set(r) for s, r in steps.items()} for n, steps in held.items()}, world, per_node, level2)
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            return f"{label}: returned {got!r}; return (level, step)"
        got = (int(got[0]), int(got[1]))
        if got == want:
            continue
        head = f"{label} (level 2 at step {level2}): returned {got}, expected {want}"
        level, step = got
        if level == 1 and step <= level2:
            return f"{head}: level-1 step {step} is not newer than level 2's step {level2}, which survives anything"
        if level == 1:
            gap = _missing(held, world, per_node, step)
            if gap:
                r, own, peer = gap
                where = (f"neither on node {own} (its own) nor on node {peer} (the next node: its peer copy)"
                         if own != peer else f"not on node {own} (its only node: no peer)")
                return f"{head}: took a level-1 step with a missing shard: rank {r}'s shard of step {step} is {where}"
        if want[0] == 1 and (level == 2 or step < want[1]):
            nodes = world // per_node
            only_peer = [r for r in range(world) if r not in held.get(r // per_node, {}).get(want[1], ())]
            hint = ""
            if only_peer:
                r = only_peer[0]
                hint = (f"; rank {r}'s shard survives only as its peer copy on node {(r // per_node + 1) % nodes}, the "
                        f"next node")
                if nodes > 2:
                    hint += f" (not node {(r // per_node - 1) % nodes}, the previous one)"
            return f"{head}: passed over level-1 step {want[1]}, complete on the nodes' disks{hint}"
        return head
    return None


def _solution():
    from _checker import load

    return load(SOLUTIONS, "sol10")


SUCCESS = {
    "cut": f": every entry of {len(_entries())} indexes (tp boxes along dims 0, 1; ZeRO ranges inside them; 1-D, 2-D, 3-D)",
    "assemble": f": {len(_entries())} tensors from their pieces in two orders, and a missing piece refused",
    "interval": f": Young and Daly for {len(INTERVALS)} save costs and failure rates",
    "resume_point": f": {len(_scenarios())} failures (lost nodes, a lost pair, a half-written step, one node)",
}
PROBLEMS = {"cut": _cut_problem, "assemble": _assemble_problem, "interval": _interval_problem,
            "resume_point": _resume_point_problem}


def check_one(name, path, report, timeout_s):
    return in_process(name, path, report, PROBLEMS[name], SUCCESS[name], "ex10")


check, main = entry_points("Check lesson 10's exercises (in this process).", EXERCISES, check_one, LEARNER,
                           SOLUTIONS, TIMEOUT_S, "ex10")


if __name__ == "__main__":
    sys.exit(main())
