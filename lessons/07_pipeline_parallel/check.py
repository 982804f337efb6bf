"""Checker for lesson 07's exercises.

    ./run.sh python lessons/07_pipeline_parallel/check.py [name ...] [--solutions | --module my.py] [--timeout S]
(what each option does, and the call from the notebook: lessons/_checker.py; here --timeout defaults to 15 s.)

one_f_one_b_rank (in this process): for several (p, m), each stage's list of yours runs in picotron's simulator
(`pipeline_schedules.simulate`, t_F = 1, t_B = 2) together with the reference lists of the other stages; the
simulator's own sentence names the first problem (a micro-batch missing or twice, a B before its F, a deadlock
and which rank waits for what). A list that runs must keep 1F1B's memory (at most min(p - r, m) micro-batches
alive on stage r) and its step time.

forward_step and sync_tied_grads run on 2 and then 3 real processes (gloo, picotron.launch.run_on_ranks; the
tied sync also on 1, where one rank holds both copies). forward_step: rank r holds a small stage seeded by r;
the checker computes the whole chain in this process and names the rank whose input or output is wrong and what
it matches instead (the previous rank's input: it sent x instead of y; NaN, or zeros: a receive never waited for,
the checker filling torch.empty's buffers with NaN while rank 0 sends late; ...), an
input that does not require a gradient, or the ranks that hang and the line of your file where they wait.
sync_tied_grads: the first and last rank hold copies of one matrix with different gradients; both must end with
the sum, a middle rank with nothing touched.

dualpipe_place (in this process): for several (p, m), every (stage, micro-batch) against picotron's DualPipe
schedule (`Schedule.where(stage, mb)`); a wrong place is named with what it mixes up (the direction ignored, the
halves taken as even and odd micro-batches, the mirror rank off by one, the right rank with the other chunk).

How it works: as in every multi-rank checker (lessons/_checker.py), each child runs `_on_rank` (below).
"""
import sys
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # lessons/: _checker, which puts the repository root on sys.path too
from _checker import _Failure, entry_points, load, on_ranks, rendezvous, where  # noqa: E402

import torch  # noqa: E402

from picotron import pipeline_schedules as ps  # noqa: E402
from picotron.launch import run_on_ranks  # noqa: E402


LEARNER = HERE / "exercise.py"
SOLUTIONS = HERE / "solution.py"
TIMEOUT_S = 15.0
EXERCISES = {"one_f_one_b_rank": "one_f_one_b_rank", "forward_step": "forward_step",
             "sync_tied_grads": "sync_tied_grads", "dualpipe_place": "dualpipe_place"}
WORLD_SIZES = {"forward_step": (2, 3), "sync_tied_grads": (1, 2, 3)}
CASES = ((2, 4), (4, 8), (4, 2), (3, 5), (1, 3))  # (p, m) for exercise 1
B, S, H = 2, 3, 4  # forward_step's activation [b, s, h]
V = 6  # sync_tied_grads' matrix [V, H]


# ------------------------------------------------------------------------------------------ exercise 1
def _as_actions(got):
    """The learner's list as Actions, or a sentence saying why it is not one."""
    if not isinstance(got, (list, tuple)):
        return None, f"returned {type(got).__name__} {got!r:.80}; return a list of Action(kind, mb, chunk)"
    out = []
    for k, a in enumerate(got):
        try:
            kind, mb, chunk = a
        except (TypeError, ValueError):
            return None, f"item {k} is {a!r:.60}, not an Action(kind, mb, chunk)"
        out.append(ps.Action(kind, int(mb), int(chunk)))
    return out, None


def _problem_1f1b(fn, p, m):
    ref = ps.one_f_one_b(p, m)
    best = ps.simulate(ref)
    for i in range(p):
        got, problem = _as_actions(fn(i, p, m))
        if problem:
            return f"stage {i} of p={p}, m={m}: {problem}"
        ranks = [list(r) for r in ref.ranks]
        ranks[i] = got
        try:
            sim = ps.simulate(ps.Schedule("1f1b", p, m, 1, ranks))
        except ps.ScheduleError as e:
            return (f"stage {i} of p={p}, m={m} (the other stages: the reference lists): {e} Your list: "
                    f"{_show(got)}")
        lead = next((k for k, a in enumerate(got) if a.kind == "B"), len(got))  # forwards before the first B
        want = min(p - i, m)
        runs = (f"your list runs {lead} forwards before its first backward, 1F1B's stage {i} runs min(p - r, m) = "
                f"{want} (p - r - 1 warm-up forwards, then the first forward of the steady state)")
        if sim.peak_alive[i] > min(p - i, m):
            hint = (" — all forwards first is AFAB (GPipe): start each backward as soon as it can come back"
                    if lead == m and m > p - i else f" — {runs}")
            return (f"stage {i} of p={p}, m={m}: runs, but holds {sim.peak_alive[i]} micro-batches' activations at "
                    f"once; 1F1B holds at most min(p - r, m) = {min(p - i, m)}{hint}. Your list: {_show(got)}")
        if sim.makespan > best.makespan + 1e-9:
            hint = (f"{runs}, to be busy until micro-batch 0's backward comes back" if lead != want else
                    "after the warm-up alternate ONE forward and ONE backward (the oldest micro-batch in flight)")
            return (f"stage {i} of p={p}, m={m}: runs, but the step takes {sim.makespan:g} time units instead of "
                    f"1F1B's {best.makespan:g} (t_F = 1, t_B = 2) — {hint}. Your list: {_show(got)}")
    return None


def _show(acts, limit=14):
    text = " ".join(map(repr, acts[:limit]))
    return f"[{text}{' ...' if len(acts) > limit else ''}]"


def _check_cases(path, report, name, cases, problem_of, success):
    """Exercise `name` against each (p, m) of `cases`: the first problem `problem_of(fn, p, m)` names fails it;
    else `success` (with {cases} filled in) is its line."""
    what = EXERCISES[name]
    try:
        fn = getattr(load(path, "ex07"), name)
        for p, m in cases:
            problem = problem_of(fn, p, m)
            if problem:
                return report.fail(what, problem)
    except Exception as e:  # noqa: BLE001 - any bug in the learner's code is a failed check
        return report.fail(what, f"{type(e).__name__}: {e}{where(e, path)}")
    report.ok(what, success.format(cases=", ".join(f"({p}, {m})" for p, m in cases)))


def check_1f1b(path, report):
    _check_cases(path, report, "one_f_one_b_rank", CASES, _problem_1f1b,
                 ": every stage's list runs with the others' for (p, m) in {cases}; 1F1B's step time, at most p - r "
                 "micro-batches alive on stage r")


# ------------------------------------------------------------------------------------------ exercise 4
DUAL_CASES = ((2, 4), (4, 8), (4, 12), (6, 12))  # (p, m)


def _problem_dualpipe(fn, p, m):
    """The first (stage, mb) whose place is wrong, said with what it mixes up; or None."""
    sch = ps.build("dualpipe", p, m)
    for mb in range(m):
        for s in range(p):
            want, got = sch.where(s, mb), fn(s, mb, p, m)
            try:
                got = (int(got[0]), int(got[1]))
            except (TypeError, ValueError, IndexError):
                return f"dualpipe_place({s}, {mb}, p={p}, m={m}) returned {got!r:.60}; return the pair (rank, chunk)"
            if got == want:
                continue
            at = f"stage {s} of micro-batch {mb} (p={p}, m={m}) is on rank {want[0]}, chunk {want[1]}; yours says {got}"
            back = mb >= m // 2
            if back and got == (s, 0):
                why = (f"micro-batch {mb} >= m/2 = {m // 2} is fed in at rank p-1 and travels back up on the chunks 1: "
                       f"the direction is missing")
            elif got == ((s, 0) if mb % 2 == 0 else (p - 1 - s, 1)):
                why = f"the first m/2 = {m // 2} micro-batches go down, the others up (halves, not even and odd)"
            elif back and got[1] == 1 and got[0] == p - s:
                why = "the mirror of rank s is p-1-s (ranks count from 0): off by one"
            elif got[0] == want[0]:
                why = (f"the right rank, the other chunk: rank {want[0]}'s chunk 0 is stage {want[0]}, its chunk 1 "
                       f"stage {p - 1 - want[0]}")
            else:
                why = "stage s runs on rank s going down, on rank p-1-s going up"
            return f"{at} — {why}"
    return None


def check_dualpipe(path, report):
    _check_cases(path, report, "dualpipe_place", DUAL_CASES, _problem_dualpipe,
                 ": every stage of every micro-batch on DualPipe's rank and chunk for (p, m) in {cases}")


# ---------------------------------------------------------------------------------- exercises 2 and 3
def randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def make_stage(rank):
    """Rank r's stage: a linear layer seeded by r, then tanh."""
    torch.manual_seed(1000 + rank)
    return torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Tanh())


def first_input():
    return randn(7, B, S, H)


def _plain(value):
    return value.detach().clone() if torch.is_tensor(value) else None if value is None else repr(value)[:120]


SENDER_DELAY_S = 0.5  # rank 0 sends this late: a receive that is not waited for is read before anything arrives


@contextmanager
def _nan_filled_empty():
    """While inside: torch.empty's float tensors come filled with NaN (its contents are undefined anyway), so a
    receive buffer read before its message arrived shows as NaN, whatever the memory held."""
    empty = torch.empty

    def filled(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    torch.empty = filled
    try:
        yield
    finally:
        torch.empty = empty


def _scenario_forward_step(mod, rank, n):
    stage = make_stage(rank)
    prev, nxt = (rank - 1 if rank > 0 else None), (rank + 1 if rank < n - 1 else None)
    if rank == 0:
        time.sleep(SENDER_DELAY_S)
    with _nan_filled_empty():
        got = mod.forward_step(stage, first_input() if rank == 0 else None, prev, nxt, (B, S, H), None)
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return dict(returned=repr(got)[:120])
    x, y = got
    out = dict(x=_plain(x), y=_plain(y), x_requires_grad=bool(torch.is_tensor(x) and x.requires_grad),
               y_has_graph=bool(torch.is_tensor(y) and y.grad_fn is not None), x_grad=None)
    if out["y_has_graph"] and out["x_requires_grad"] and torch.is_tensor(x) and x.is_leaf:
        y.sum().backward()
        out["x_grad"] = _plain(x.grad)
    return out


def _scenario_sync_tied_grads(mod, rank, n):
    import torch.distributed as dist

    group = dist.new_group([0, n - 1]) if n > 1 else None  # every rank takes part in making a group
    first, last = rank == 0, rank == n - 1
    w = randn(20, V, H)
    emb = torch.nn.Parameter(w.clone()) if first else None
    head = torch.nn.Parameter(w.clone()) if last else None
    if emb is not None:
        emb.grad = randn(21, V, H)
    if head is not None:
        head.grad = randn(22, V, H)
    mod.sync_tied_grads(emb, head, group if (first or last) else None)
    return {k: (dict(weight=_plain(t), grad=_plain(t.grad)) if t is not None else None)
            for k, t in (("embedding", emb), ("head", head))}


SCENARIOS = {"forward_step": _scenario_forward_step, "sync_tied_grads": _scenario_sync_tied_grads}


def _on_rank(path, name):
    """Runs on every rank: the scenario of exercise `name` with the file at `path`; returns its results, or raises
    _Failure with one line."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    try:
        mod = load(path, "ex07")
    except Exception as e:  # noqa: BLE001
        raise _Failure(f"cannot import {Path(path).name}: {type(e).__name__}: {e}{where(e, path)}") from None
    try:
        results = SCENARIOS[name](mod, rank, n)
    except Exception as e:  # noqa: BLE001 - any bug in the learner's code is a failed check
        raise _Failure(f"{type(e).__name__}: {e}{where(e, path)}") from None
    rendezvous(n, "check07/done")
    return results


def _close(a, b):
    return torch.is_tensor(a) and a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def compare_forward_step(n, results):
    with torch.no_grad():
        chain = [first_input()]
        for r in range(n):
            chain.append(make_stage(r)(chain[-1]))
    for r, res in enumerate(results):
        if "returned" in res:
            return f"rank {r}: returned {res['returned']}; return the pair (x, y)"
        x, y, want_x, want_y = res["x"], res["y"], chain[r], chain[r + 1]
        if not torch.is_tensor(x) or x.shape != want_x.shape:
            return (f"rank {r}: x is {x if not torch.is_tensor(x) else list(x.shape)}, expected a tensor of shape "
                    f"{list(want_x.shape)} (" + ("the input you were given" if r == 0 else f"received from rank {r - 1}")
                    + ")")
        if not _close(x, want_x):
            if r > 0 and _close(x, chain[r - 1]):
                return (f"rank {r}: received rank {r - 1}'s INPUT, not its output: rank {r - 1} sent x instead of "
                        f"y = stage(x)")
            if r > 0 and torch.isnan(x).any():
                return (f"rank {r}: x still holds what its buffer held before the receive (the checker fills "
                        f"torch.empty's buffers with NaN and rank {r - 1} sends {SENDER_DELAY_S:g} s late): you used x "
                        f"before the activation from rank {r - 1} arrived — wait for the irecv's request "
                        f"(dist.irecv(...).wait()) before using the tensor")
            if r > 0 and not x.abs().sum():
                return (f"rank {r}: x is all zeros: the activation from rank {r - 1} never arrived in it (wait for the "
                        f"irecv's request before using the tensor)")
            return f"rank {r}: x differs from what rank {r - 1} computed: max |diff| {(x - want_x).abs().max():.2e}"
        if not torch.is_tensor(y) or y.shape != want_y.shape or not _close(y, want_y):
            if r > 0 and torch.is_tensor(y) and torch.isnan(y).any():
                return (f"rank {r}: y = stage(x) was computed before the activation from rank {r - 1} arrived in x "
                        f"(y is NaN: the checker fills torch.empty's buffers with NaN) — wait for the irecv's request "
                        f"(dist.irecv(...).wait()) before using the tensor")
            return f"rank {r}: y is not stage(x) on this rank's stage"
        if r > 0 and not res["x_requires_grad"]:
            return (f"rank {r}: the received x does not require a gradient, so the backward cannot compute x.grad, the "
                    f"message rank {r} owes rank {r - 1} in the backward: x.requires_grad_() after receiving it")
        if not res["y_has_graph"]:
            return f"rank {r}: y has no autograd graph (computed under no_grad, or detached?): the backward needs it"
        if r > 0 and res["x_grad"] is None:
            return f"rank {r}: y's backward does not reach x: compute y from the x you return"
    return None


def compare_sync_tied_grads(n, results):
    w, g0, g1 = randn(20, V, H), randn(21, V, H), randn(22, V, H)
    total = g0 + g1
    for r, res in enumerate(results):
        for key, own in (("embedding", g0), ("head", g1)):
            got = res[key]
            if got is None:
                continue
            if not _close(got["weight"], w):
                return (f"rank {r}: the {key}'s WEIGHT changed: make the gradients equal (.grad), the optimizer "
                        f"moves the weights")
            g = got["grad"]
            other = g1 if key == "embedding" else g0
            if _close(g, total):
                continue
            who = "the first stage's embedding" if key == "embedding" else "the last stage's head"
            if _close(g, own):
                fix = ("one rank holds both copies here: add them in memory (embedding.grad += head.grad, then copy "
                       "it back into head.grad)" if n == 1 else
                       "all-reduce it (a sum) over the group of the first and the last stage")
                return f"rank {r}: {who}'s gradient is still only its own stage's part: {fix}"
            if _close(g, total / 2):
                return (f"rank {r}: {who}'s gradient is the MEAN of the two parts: the matrix is used twice (embedding "
                        f"and head) and its gradient is the SUM of both uses; do not divide")
            if _close(g, other):
                return f"rank {r}: {who}'s gradient is the OTHER copy's part only: it needs the sum of both"
            if _close(g, 2 * total) or _close(g, total + own):
                return f"rank {r}: {who}'s gradient counts a part twice: summed twice?"
            return f"rank {r}: {who}'s gradient is wrong: max |got - sum| {(g - total).abs().max():.2e}"
    return None


COMPARE = {"forward_step": compare_forward_step, "sync_tied_grads": compare_sync_tied_grads}
SUCCESS = {"forward_step": f"every rank received its predecessor's output [{B}, {S}, {H}], requiring a gradient, and "
                           f"handed stage(x) on; the last rank's output is the whole chain's",
           "sync_tied_grads": "both copies' gradients are the sum of the two parts; weights and middle ranks untouched"}


def check_one(name, path, report, timeout_s):
    if name == "one_f_one_b_rank":
        return check_1f1b(path, report)
    if name == "dualpipe_place":
        return check_dualpipe(path, report)
    on_ranks(lambda n: f"{EXERCISES[name]} on {n} rank{'s' if n > 1 else ''}", WORLD_SIZES[name],
             lambda n: run_on_ranks(_on_rank, n, str(path), name, timeout_s=timeout_s),
             lambda n, results: (COMPARE[name](n, results), f": {SUCCESS[name]}"), report, path, timeout_s)


check, main = entry_points("Check lesson 07's exercises (1F1B by the simulator, DualPipe's placement against its "
                           "schedule; the others on 1-3 processes).",
                           EXERCISES, check_one, LEARNER, SOLUTIONS, TIMEOUT_S, "ex07")


if __name__ == "__main__":
    sys.exit(main())
