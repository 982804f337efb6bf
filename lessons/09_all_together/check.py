"""Checker for lesson 09's exercises.

    python lessons/09_all_together/check.py [name ...]          # your lessons/09_all_together/exercise.py
    python lessons/09_all_together/check.py --solutions         # the reference solutions (must pass)
    python lessons/09_all_together/check.py --module my.py      # any file defining the same functions
From the lesson's notebook: `import check as checker; checker.check()` (returns True when everything passes).
Exit status 0 when every check passes, 1 otherwise. Everything runs in this process (no process group: the
exercises are arithmetic on layouts).

place: every rank of several 4-D grids against picotron.mesh (`grid_coords`, `group_ranks`); names the rank, the
axis and the group, and recognises dp numbered fastest (tp slowest), a group along the wrong axis, and a group
missing this rank.
step_batch: the global-batch arithmetic of several layouts; names the field, and recognises the sequences divided
over dp x cp or over every rank (cp cuts sequences, tp and pp cut the model: neither reads more of them), the
micro-batch size forgotten, the tokens per micro-batch not divided by cp, the bubble of the wrong formula, and an
impossible batch accepted.
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository root, for `import picotron`

from picotron.mesh import ORDER, grid_coords, group_ranks  # noqa: E402

sys.path.insert(0, str(HERE.parent))  # lessons/: the shared checker pieces
from _checker import entry_points, load, where  # noqa: E402

LEARNER = HERE / "exercise.py"
SOLUTIONS = HERE / "solution.py"
TIMEOUT_S = 30.0
EXERCISES = {"place": "place", "step_batch": "step_batch"}

GRIDS = (dict(dp=2, pp=2, cp=2, tp=2), dict(dp=2, pp=1, cp=1, tp=4), dict(dp=3, pp=2, cp=2, tp=4),
         dict(dp=1, pp=4, cp=1, tp=2), dict(dp=4, pp=1, cp=2, tp=1))


def _name(sizes):
    return "·".join(f"{d}{sizes[d]}" for d in ORDER)


def _reversed_coords(rank, sizes):
    """The coordinates if dp varied fastest (tp slowest)."""
    c = {}
    for d in ORDER:
        rank, c[d] = divmod(rank, sizes[d])
    return c


# ------------------------------------------------------------------------------------------ exercise 1
def _place_problem(fn, path):
    for sizes in GRIDS:
        n = sizes["dp"] * sizes["pp"] * sizes["cp"] * sizes["tp"]
        head = _name(sizes)
        groups_of = {a: group_ranks(sizes, a) for a in ORDER}
        for rank in range(n):
            got = fn(rank, dict(sizes))
            if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(x, dict) for x in got)):
                return f"{head}, rank {rank}: returned {str(got)[:60]!r}; return the pair (coords, groups), two dicts"
            coords, groups = got
            want = grid_coords(rank, sizes)
            if {d: coords.get(d) for d in ORDER} != want:
                if {d: coords.get(d) for d in ORDER} == _reversed_coords(rank, sizes):
                    return (f"{head}, rank {rank}: coordinates {coords}, expected {want}: you numbered dp fastest; in "
                            f"picotron tp varies fastest (rank = ((dp·pp_size + pp)·cp_size + cp)·tp_size + tp), so a "
                            f"tp group is consecutive ranks, on one node")
                return f"{head}, rank {rank}: coordinates {coords}, expected {want}"
            for axis in ORDER:
                mine = groups.get(axis)
                right = next(g for g in groups_of[axis] if rank in g)
                if mine is None:
                    return f"{head}, rank {rank}: no group for axis {axis!r}; return one list of ranks per axis"
                mine = list(mine)
                if sorted(mine) == right:
                    if mine != right:
                        return (f"{head}, rank {rank}: {axis} group {mine}, expected {right}: the right ranks, but in "
                                f"the order of their {axis} coordinate (index i of the list holds {axis} = i)")
                    continue
                if rank not in mine:
                    return f"{head}, rank {rank}: its {axis} group {mine} does not contain rank {rank}; expected {right}"
                other = [a for a in ORDER if a != axis and sorted(mine) == next(g for g in groups_of[a] if rank in g)]
                if other:
                    return (f"{head}, rank {rank}: {axis} group {mine}, expected {right}: that is its {other[0]} group "
                            f"(the ranks that differ only in {other[0]})")
                return (f"{head}, rank {rank}: {axis} group {mine}, expected {right} (the ranks that agree with it on "
                        f"every coordinate but {axis})")
    return None


# ------------------------------------------------------------------------------------------ exercise 4
# (global batch in tokens, seq_len, micro-batch, layout); the first is Llama 3 405B's 16,384 GPUs (tp8, pp16, dp128)
BATCHES = ((4 * 2**20, 4096, 1, dict(dp=128, pp=16, cp=1, tp=8)),
           (2**20, 2048, 4, dict(dp=8, pp=1, cp=1, tp=1)),
           (2**21, 8192, 2, dict(dp=4, pp=2, cp=2, tp=4)),
           (2**19, 1024, 2, dict(dp=16, pp=4, cp=1, tp=2)),
           (2**22, 32768, 1, dict(dp=2, pp=4, cp=8, tp=8)))
IMPOSSIBLE = ((2**20, 4096, 4, dict(dp=48, pp=1, cp=1, tp=8)), (1000, 128, 1, dict(dp=1, pp=1, cp=1, tp=1)))


def _world(case):
    sizes = case[-1]
    return sizes["dp"] * sizes["pp"] * sizes["cp"] * sizes["tp"]


def _want_batch(tokens, s, b, sizes):
    seqs = tokens // s
    m = seqs // (sizes["dp"] * b)
    return dict(sequences=seqs, grad_acc=m, tokens_per_micro_batch=b * s // sizes["cp"],
                bubble=(sizes["pp"] - 1) / (m + sizes["pp"] - 1))


def _batch_problem(fn, path):
    for tokens, s, b, sizes in BATCHES:
        head = f"{tokens:,} tokens per step, sequences of {s}, micro-batch {b}, {_name(sizes)}"
        want = _want_batch(tokens, s, b, sizes)
        try:
            got = fn(tokens, s, b, dict(sizes))
        except ValueError as e:
            return (f"{head}: raised ValueError({str(e)[:80]!r}), but this batch is reachable: {want['sequences']} "
                    f"sequences = dp {sizes['dp']} x micro-batch {b} x {want['grad_acc']} micro-steps (only the dp "
                    f"replicas read different sequences)")
        if not isinstance(got, dict):
            return f"{head}: returned {str(got)[:60]!r}; return a dict with {', '.join(want)}"
        for key in want:
            if key not in got:
                return f"{head}: no {key!r} in your dict; return {', '.join(want)}"
        if got["sequences"] != want["sequences"]:
            return f"{head}: sequences = {got['sequences']}, expected {want['sequences']} (tokens / seq_len)"
        m, world = got["grad_acc"], sizes["dp"] * sizes["pp"] * sizes["cp"] * sizes["tp"]
        if m != want["grad_acc"]:
            seqs = want["sequences"]
            hints = {seqs // (sizes["dp"] * sizes["cp"] * b): "you divided by dp x cp: cp ranks share each sequence "
                                                             "(each holds seq_len / cp of its tokens), they do not "
                                                             "read more sequences",
                     seqs // (world * b): "you divided by every rank: only the dp replicas read different sequences; "
                                          "tp and pp ranks of one replica work on the same micro-batch",
                     seqs // sizes["dp"]: "you forgot the micro-batch size: each replica's micro-step reads "
                                          f"{b} sequences"}
            hint = hints.get(m, "grad_acc = sequences / (dp x micro_batch_size)")
            return f"{head}: grad_acc = {m}, expected {want['grad_acc']}: {hint}"
        if got["tokens_per_micro_batch"] != want["tokens_per_micro_batch"]:
            hint = (": cp cuts every sequence, so each rank holds seq_len / cp tokens of each"
                    if got["tokens_per_micro_batch"] == b * s else "")
            return (f"{head}: tokens_per_micro_batch = {got['tokens_per_micro_batch']}, expected "
                    f"{want['tokens_per_micro_batch']} (what one rank's activations are made of){hint}")
        if abs(got["bubble"] - want["bubble"]) > 1e-9:
            p = sizes["pp"]
            hint = ""
            if abs(got["bubble"] - (p - 1) / m) < 1e-9:
                hint = (": (pp-1)/m is the bubble relative to the useful time; the fraction of the step is "
                        "(pp-1)/(m+pp-1)")
            return f"{head}: bubble = {got['bubble']:.4f}, expected {want['bubble']:.4f} (1F1B, m = grad_acc){hint}"
    for tokens, s, b, sizes in IMPOSSIBLE:
        head = f"{tokens:,} tokens per step, sequences of {s}, micro-batch {b}, {_name(sizes)}"
        try:
            got = fn(tokens, s, b, dict(sizes))
        except ValueError:
            continue
        return (f"{head}: returned {got}; no whole number of micro-steps gives this batch "
                f"({tokens / s:g} sequences over dp x micro-batch = {sizes['dp'] * b}): raise ValueError")
    return None


def _in_process(name, path, report, problem_of, success):
    try:
        fn = getattr(load(path, "ex09"), name)
        problem = problem_of(fn, path)
    except Exception as e:  # noqa: BLE001 - any bug in the learner's code is a failed check
        report.fail(name, f"{type(e).__name__}: {e}{where(e, path)}")
        return False
    if problem:
        report.fail(name, problem)
        return False
    report.ok(name, success)
    return True


SUCCESS = {
    "place": f": coordinates and the four groups of every rank of {', '.join(_name(g) for g in GRIDS)}",
    "step_batch": f": {len(BATCHES)} layouts from {min(map(_world, BATCHES)):,} to {max(map(_world, BATCHES)):,} GPUs, "
                  f"and {len(IMPOSSIBLE)} impossible batches refused",
}
PROBLEMS = {"place": _place_problem, "step_batch": _batch_problem}


def check_one(name, path, report, timeout_s):
    return _in_process(name, path, report, PROBLEMS[name], SUCCESS[name])


check, main = entry_points("Check lesson 09's exercises (in this process).", EXERCISES, check_one, LEARNER,
                           SOLUTIONS, TIMEOUT_S, "ex09")


if __name__ == "__main__":
    sys.exit(main())
