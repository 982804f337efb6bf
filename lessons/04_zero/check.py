"""Checker for lesson 04's exercises: runs your ZeRO pieces on real processes (gloo, through
picotron.launch.run_on_ranks) and compares them with the answer computed in one process. It names the rank,
the chunk and the element that are wrong and what the error usually means (forgot to divide by n, wrong
padding, wrong chunk offset, the chunks never all-gathered, no bias correction, ...), and the ranks that hang
with the line of your file where they wait.

    python lessons/04_zero/check.py [name ...]          # your lessons/04_zero/exercise.py
    python lessons/04_zero/check.py --solutions         # the reference solutions (must pass)
    python lessons/04_zero/check.py --module my.py      # any file defining the same functions
    python lessons/04_zero/check.py --timeout 5         # seconds before a launch counts as a hang (10)
From the lesson's notebook: `import check as checker; checker.check()` (returns True when everything passes).
Exit status 0 when every check passes, 1 otherwise.

The exercises: shard_range (pure arithmetic: checked on many sizes in one process), reduce_scatter_gradients
and sharded_adamw (ShardedAdamW.step), each on 2 and 3 ranks with unit sizes that n does not divide, so the
padding matters. While checking exercises 2 and 3 your file's shard_range is replaced by the reference one,
so they do not depend on exercise 1.

How it works: run_on_ranks pickles the function it runs by reference, so the children run `_on_rank` (below,
at module level). It imports YOUR file by path, builds every rank's inputs deterministically (so each child
can also compute every other rank's, and the parent the expected answer), runs your code, and meets the other
ranks at a store-based rendezvous before returning, so a rank stuck in a collective shows up as a hang rather
than as a peer that left.
"""
import math
import sys
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository root, for `import picotron`

import torch  # noqa: E402

from picotron.launch import RankError, RankTimeout, run_on_ranks  # noqa: E402

sys.path.insert(0, str(HERE.parent))  # lessons/: the shared checker pieces
from _checker import (_Failure, check_all, cli, failure_message, hang_message, load,  # noqa: E402,F401
                      rendezvous, where)

LEARNER = HERE / "exercise.py"
SOLUTIONS = HERE / "solution.py"
TIMEOUT_S = 10.0
EXERCISES = {"shard_range": "shard_range", "reduce_scatter_gradients": "reduce_scatter_gradients",
             "sharded_adamw": "ShardedAdamW.step"}
WORLD_SIZES = {"shard_range": (1,), "reduce_scatter_gradients": (2, 3), "sharded_adamw": (2, 3)}
# (numel, n): sizes n divides and sizes it does not, numel < n, one element, a large prime
SHARD_CASES = [(12, 4), (10, 4), (3, 4), (1, 1), (5, 1), (29, 2), (29, 3), (7, 7), (1, 3), (1_000_003, 8)]
# the units of exercise 2: 29 elements (padding 1 with n = 2 and 3), 2 (n = 3: rank 2 owns only padding), 19
GRAD_UNITS = [[(4, 5), (6,), (3,)], [(2,)], [(3, 3), (2, 5)]]
ADAM_NUMELS = (29, 2)
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
ADAM_STEPS = 2


def chunk_of(numel, n):
    return max(1, math.ceil(numel / n))


# ------------------------------------------------------------------------------- inputs (child and parent)
def rank_grads(shapes, rank, case):
    """Rank `rank`'s gradient tensors for unit `case`: different on every rank."""
    g = torch.Generator().manual_seed(1000 * case + rank)
    return [torch.randn(s, generator=g) for s in shapes]


def padded_flat(tensors, n):
    numel = sum(t.numel() for t in tensors)
    flat = torch.zeros(n * chunk_of(numel, n))
    flat[:numel] = torch.cat([t.reshape(-1) for t in tensors])
    return flat


def mean_flat(shapes, n, case):
    return sum(padded_flat(rank_grads(shapes, r, case), n) for r in range(n)) / n


def adam_init(numel, n):
    g = torch.Generator().manual_seed(7 + numel)
    flat = torch.zeros(n * chunk_of(numel, n))
    flat[:numel] = torch.randn(numel, generator=g)
    return flat


def adam_grad(numel, n, step):
    """The mean over the ranks of step `step`'s gradient of the whole padded vector (the padding's is 0)."""
    total = torch.zeros(n * chunk_of(numel, n))
    for r in range(n):
        g = torch.Generator().manual_seed(100 * step + r)
        total[:numel] += torch.randn(numel, generator=g)
    return total / n


# --------------------------------------------------------------------------------------- in each child
def _on_rank(path, name, ref_path):
    """Runs on every rank: the scenario of exercise `name` with the file at `path`; returns its results, or
    raises _Failure with one line."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    try:
        mod = load(path, "ex04")
    except Exception as e:  # noqa: BLE001
        raise _Failure(f"cannot import {Path(path).name}: {type(e).__name__}: {e}{where(e, path)}") from None
    ref = load(ref_path, "ex04ref")
    if name != "shard_range":
        mod.shard_range = ref.shard_range  # exercises 2 and 3 do not depend on exercise 1
    try:
        results = SCENARIOS[name](mod, ref, rank, n)
    except _Failure:
        raise
    except Exception as e:  # noqa: BLE001 - any bug in the learner's code is a failed check
        raise _Failure(f"{type(e).__name__}: {e}{where(e, path)}") from None
    rendezvous(n, "check04/done")
    return results


def _plain(value):
    """What came back, as something picklable and printable (tensors as CPU copies)."""
    if torch.is_tensor(value):
        return value.detach().cpu().clone()
    return value if isinstance(value, (int, float, type(None))) else repr(value)


def _pair(value):
    """shard_range's answer as a tuple of two ints where it is one (a list, a tuple, numpy or 0-d tensor
    ints), else its repr."""
    try:
        items = list(value)
        if len(items) == 2 and all(float(v) == int(v) for v in items):
            return tuple(int(v) for v in items)
    except (TypeError, ValueError, RuntimeError):
        pass
    return repr(value)


def _scenario_shard_range(mod, ref, rank, n):
    return [(numel, k, r, _pair(mod.shard_range(numel, k, r))) for numel, k in SHARD_CASES for r in range(k)]


def _scenario_reduce_scatter_gradients(mod, ref, rank, n):
    out = []
    for case, shapes in enumerate(GRAD_UNITS):
        grads = rank_grads(shapes, rank, case)
        out.append(_plain(mod.reduce_scatter_gradients([g.clone() for g in grads])))
    return out


def _scenario_sharded_adamw(mod, ref, rank, n):
    out = []
    for numel in ADAM_NUMELS:
        flat = adam_init(numel, n)
        ptr = flat.data_ptr()
        opt = mod.ShardedAdamW(flat, **HYPER)
        lo, hi = ref.shard_range(flat.numel(), n, rank)
        states, same = [], []
        for t in range(1, ADAM_STEPS + 1):
            opt.step(adam_grad(numel, n, t)[lo:hi].clone())
            states.append(flat.clone())  # the tensor the model's parameters would be views of
            same.append(opt.flat is flat and flat.data_ptr() == ptr)
        out.append(dict(numel=numel, states=states, same=same))
    return out


SCENARIOS = {"shard_range": _scenario_shard_range, "reduce_scatter_gradients": _scenario_reduce_scatter_gradients,
             "sharded_adamw": _scenario_sharded_adamw}


# ------------------------------------------------------------------------------------------ the parent
def _close(a, b):
    return torch.is_tensor(a) and a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def compare_shard_range(n, results):
    got_all = {(numel, k, r): got for numel, k, r, got in results[0]}
    for numel, k in SHARD_CASES:
        chunk = chunk_of(numel, k)
        for r in range(k):
            got, expected = got_all[(numel, k, r)], (r * chunk, (r + 1) * chunk)
            if got == expected:
                continue
            head = f"shard_range({numel}, {k}, {r}) returned {got}, expected {expected}"
            if not (isinstance(got, tuple) and len(got) == 2):
                return f"{head}: return a pair (lo, hi) of ints"
            sizes = [got_all[(numel, k, q)][1] - got_all[(numel, k, q)][0] for q in range(k)
                     if isinstance(got_all[(numel, k, q)], tuple) and len(got_all[(numel, k, q)]) == 2]
            lo, hi = got
            if hi - lo == 0 and numel < k:
                why = "an empty chunk (numel < n): every rank owns at least one element, chunk = max(1, ceil(numel / n))"
            elif hi == numel and hi - lo < chunk and r == k - 1:
                why = (f"the last chunk stops at numel: all chunks are chunk = {chunk} long; the padding "
                       f"({k * chunk - numel} element(s)) fills the end of the last one")
            elif len(set(sizes)) > 1:
                why = (f"the chunks differ in size between ranks ({', '.join(map(str, sizes))} elements, like "
                       f"tensor_split): ZeRO cuts the PADDED vector into n EQUAL chunks, so one reduce-scatter / "
                       f"all-gather of n·chunk elements fits. chunk = ceil(numel / n) = {chunk}")
            elif hi - lo == numel // k and numel // k != chunk:
                why = (f"a chunk of {numel} // {k} = {numel // k} elements (rounded down): {k} such chunks miss the last "
                       f"{numel - k * (numel // k)} element(s). Round UP, chunk = ceil(numel / n) = {chunk}, and pad the "
                       f"flat vector to n·chunk = {k * chunk}")
            elif hi - lo == chunk and lo != r * chunk:
                why = f"the right size ({chunk}) but the wrong offset: rank r's chunk starts at r·chunk = {r * chunk}"
            else:
                why = f"chunk = max(1, ceil({numel} / {k})) = {chunk}; rank r owns [r·chunk, (r+1)·chunk)"
            return f"{head}: {why}"
    return None


def _locate(shapes, index):
    """'element 3 of tensor 1 (shape [6])' for a position in the flat vector, or 'padding'."""
    offset = 0
    for i, s in enumerate(shapes):
        numel = math.prod(s)
        if index < offset + numel:
            return f"element {index - offset} of tensor {i} (shape {list(s)})"
        offset += numel
    return "padding"


def compare_reduce_scatter_gradients(n, results):
    for case, shapes in enumerate(GRAD_UNITS):
        numel = sum(math.prod(s) for s in shapes)
        chunk = chunk_of(numel, n)
        mean = mean_flat(shapes, n, case)
        chunks = [mean[k * chunk:(k + 1) * chunk] for k in range(n)]
        where_ = f"unit {case} ({len(shapes)} tensors, {numel} elements, n={n}: chunk {chunk}, padded {n * chunk})"
        for rank, res in enumerate(results):
            problem = _rs_problem(res[case], rank, n, shapes, numel, chunk, mean, chunks)
            if problem:
                return f"{where_}, rank {rank}: {problem}"
    return None


def _rs_problem(got, rank, n, shapes, numel, chunk, mean, chunks):
    expected = chunks[rank]
    if not torch.is_tensor(got):
        return f"returned {got}, expected a 1-D tensor of {chunk} elements"
    if got.numel() != chunk:
        k = got.numel()
        if k == n * chunk:
            why = "the whole padded vector: return only this rank's chunk (what the reduce-scatter's output holds)"
        elif k == numel:
            why = "the whole flat gradient: pad it to n·chunk and reduce-SCATTER it; return this rank's chunk"
        elif k == numel // n:
            why = f"numel // n elements (rounded down): chunk = ceil(numel / n) = {chunk}, padding the flat vector"
        else:
            why = f"expected chunk = ceil({numel} / {n}) = {chunk}"
        return f"returned {k} elements — {why}"
    got = got.reshape(-1).to(expected.dtype)
    if _close(got, expected):
        return None
    own = padded_flat(rank_grads(shapes, rank, GRAD_UNITS.index(shapes)), n)[rank * chunk:(rank + 1) * chunk]
    head = f"max |got - expected| = {(got - expected).abs().max().item():.2e}"
    if _close(got, n * expected):
        return f"{head} — the SUM over the {n} ranks, not the mean: divide by n = {n} (once)"
    if _close(got, expected / n):
        return f"{head} — 1/{n} of the mean: divided by n twice?"
    for k in range(n):
        if k != rank and (_close(got, chunks[k]) or _close(got, n * chunks[k])):
            return (f"{head} — these are chunk {k}'s values, not chunk {rank}'s: wrong chunk offset (rank r owns "
                    f"elements [r·chunk, (r+1)·chunk) of the padded vector, and the reduce-scatter hands rank r "
                    f"exactly that chunk: do not slice or shift it yourself)")
    if _close(got, own) or _close(got, own / n):
        return (f"{head} — still this rank's own gradient{' divided by n' if _close(got, own / n) else ''}: it was "
                f"never summed over the ranks (reduce-scatter the flat vector, and return its OUTPUT)")
    pad = torch.arange(rank * chunk, (rank + 1) * chunk) >= numel
    if pad.any() and _close(got[~pad], expected[~pad]):
        return (f"{head} — right except the padding (flat positions {numel} to {n * chunk - 1}), which holds "
                f"{got[pad].tolist()} instead of zeros: pad with torch.zeros (torch.empty leaves garbage, and the "
                f"reduce-scatter adds everybody's garbage)")
    reordered = [padded_flat(list(reversed(rank_grads(shapes, r, GRAD_UNITS.index(shapes)))), n) for r in range(n)]
    if len(shapes) > 1 and _close(got, (sum(reordered) / n)[rank * chunk:(rank + 1) * chunk]):
        return f"{head} — the tensors are concatenated in reverse order: flatten them in the order given"
    i = int((got - expected).abs().argmax())
    return (f"{head} — first at chunk element {i} = flat position {rank * chunk + i} "
            f"({_locate(shapes, rank * chunk + i)}): got {got[i].item():.6g}, expected {expected[i].item():.6g}")


def adam_step(p, m, v, g, t, lr, betas, eps, weight_decay, variant=None):
    """One AdamW step on tensors (returns new p, m, v); `variant` names a common mistake to imitate."""
    b1, b2 = betas
    p, m, v = p.clone(), m.clone(), v.clone()
    if variant == "sgd":
        return p - lr * g, m, v
    if variant in ("fresh moments", "a first step again"):
        m, v = torch.zeros_like(m), torch.zeros_like(v)
        t = 1 if variant == "a first step again" else t
    if variant == "t stuck at 1":
        t = 1
    if variant == "L2":
        g = g + weight_decay * p
    elif variant == "decay without lr":
        p = p * (1 - weight_decay)
    elif variant != "no weight decay":
        p = p * (1 - lr * weight_decay)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    if variant == "no bias correction":
        return p - lr * m / (v.sqrt() + eps), m, v
    return p - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps), m, v


VARIANTS = {
    "no bias correction": "matches Adam WITHOUT bias correction: divide m by (1 - β1^t) and v by (1 - β2^t)",
    "L2": "matches Adam with the weight decay added to the gradient (Adam + L2); AdamW decays the parameter "
          "itself: p = p·(1 - lr·weight_decay), then the Adam update",
    "no weight decay": "matches AdamW without the weight decay: p = p·(1 - lr·weight_decay) first",
    "decay without lr": "matches p·(1 - weight_decay): the decoupled decay is scaled by the learning rate, "
                        "p·(1 - lr·weight_decay)",
    "sgd": "matches a plain SGD step p - lr·g: this is AdamW, keep the moments m and v",
    "fresh moments": "matches a step from m = v = 0: the moments must persist from one step to the next "
                     "(keep them in self.exp_avg / self.exp_avg_sq and update those in place)",
    "a first step again": "matches a FIRST step (m = v = 0, t = 1): the moments and the step count must persist "
                          "from one step to the next (self.exp_avg, self.exp_avg_sq, self.t)",
    "t stuck at 1": "matches bias correction with t = 1: count the steps (self.t += 1) before using t",
}


def torch_adamw(flat0, grads):
    """torch.optim.AdamW on the whole vector: the flat vector after each step."""
    p = torch.nn.Parameter(flat0.clone())
    opt = torch.optim.AdamW([p], **HYPER)
    out = []
    for g in grads:
        p.grad = g.clone()
        opt.step()
        out.append(p.detach().clone())
    return out


def compare_sharded_adamw(n, results):
    for case, numel in enumerate(ADAM_NUMELS):
        chunk = chunk_of(numel, n)
        flat0 = adam_init(numel, n)
        grads = [adam_grad(numel, n, t) for t in range(1, ADAM_STEPS + 1)]
        expected = torch_adamw(flat0, grads)
        states = [(flat0, torch.zeros_like(flat0), torch.zeros_like(flat0))]  # (p, m, v) before each step
        for t, g in enumerate(grads, start=1):
            states.append(adam_step(*states[-1], g, t, **HYPER))
        where_ = f"a unit of {numel} elements (n={n}: chunk {chunk}, padded {n * chunk})"
        for rank, res in enumerate(results):
            res = res[case]
            for t in range(1, ADAM_STEPS + 1):
                problem = _adam_problem(res, rank, n, t, chunk, expected, states, grads)
                if problem:
                    return f"{where_}, rank {rank}, after step {t}: {problem}"
    return None


def _adam_problem(res, rank, n, t, chunk, expected, states, grads):
    if not res["same"][t - 1]:
        return ("self.flat is no longer the tensor it was given: the model's parameters are views of that tensor and "
                "would never see the update. Update it in place (self.flat[lo:hi] is a view; use in-place ops such "
                "as mul_, addcdiv_, copy_) and all-gather INTO self.flat")
    got, exp, before = res["states"][t - 1], expected[t - 1], states[t - 1][0]
    for k in range(n):
        s = slice(k * chunk, (k + 1) * chunk)
        if _close(got[s], exp[s]):
            continue
        err = (got[s] - exp[s]).abs().max().item()
        head = f"chunk {k} (elements {k * chunk}..{(k + 1) * chunk - 1}) is wrong, max |got - expected| = {err:.2e}"
        if k != rank:
            if _close(got[s], before[s]):
                return (f"{head}: it still holds its values from before this step. Chunk {k} is rank {k}'s to update; "
                        f"all-gather every rank's updated chunk into self.flat after the update")
            if _close(got[rank * chunk:(rank + 1) * chunk], exp[rank * chunk:(rank + 1) * chunk]):
                return (f"{head}, although this rank's own chunk {rank} is right: the all-gather put the chunks in the "
                        f"wrong places? (rank k's chunk goes to [k·chunk, (k+1)·chunk))")
            continue  # the problem is on rank k itself: reported when rank k's own chunk is checked
        if _close(got[s], before[s]):
            return (f"{head}: this rank's own chunk did not change in self.flat. Update self.flat[lo:hi] in place "
                    f"(p = p - ... makes a new tensor and leaves self.flat alone)")
        p, m, v = states[t - 1]
        for variant, why in VARIANTS.items():
            if variant in ("fresh moments", "a first step again", "t stuck at 1") and t == 1:
                continue
            wrong = adam_step(p[s], m[s], v[s], grads[t - 1][s], t, **HYPER, variant=variant)[0]
            if _close(got[s], wrong):
                right_before = t > 1 and _close(res["states"][t - 2][s], expected[t - 2][s])
                return f"{head}: {why}" + (" (step 1 was right)" if right_before else "")
        i = int((got[s] - exp[s]).abs().argmax())
        return (f"{head}; first at element {k * chunk + i}: got {got[s][i].item():.7g}, expected "
                f"{exp[s][i].item():.7g} (before the step {before[s][i].item():.7g})")
    return None


COMPARE = {"shard_range": compare_shard_range, "reduce_scatter_gradients": compare_reduce_scatter_gradients,
           "sharded_adamw": compare_sharded_adamw}
SUCCESS = {"shard_range": f"{sum(k for _, k in SHARD_CASES)} (numel, n, rank) cases, padding and numel < n included",
           "reduce_scatter_gradients": f"{len(GRAD_UNITS)} units (uneven sizes: padding); every rank holds its chunk of "
                                       f"the mean gradient",
           "sharded_adamw": f"{ADAM_STEPS} steps on units of {' and '.join(map(str, ADAM_NUMELS))} elements equal "
                            f"torch.optim.AdamW on the whole vector, on every rank, in place"}


def check_one(name, path, report, timeout_s):
    for n in WORLD_SIZES[name]:
        what = f"{EXERCISES[name]}" + (" on many sizes" if n == 1 else f" on {n} ranks")
        try:
            results = run_on_ranks(_on_rank, n, str(path), name, str(SOLUTIONS), timeout_s=timeout_s)
        except RankTimeout as e:
            report.fail(what, hang_message(e, path, timeout_s))
            return  # it would hang again on the next world size
        except RankError as e:
            message = failure_message(e)
            report.fail(what, message)
            if "NotImplementedError" in message or "cannot import" in message:
                return
            continue
        problem = COMPARE[name](n, results)
        if problem:
            report.fail(what, problem)
        else:
            report.ok(what, f": {SUCCESS[name]}")


def check(names=None, module=None, timeout_s=TIMEOUT_S):
    """Check the named exercises (default: all) of `module` (a path; default: your exercise file)."""
    path = Path(module).resolve() if module else LEARNER
    return check_all(names, path, EXERCISES, partial(check_one, timeout_s=timeout_s), "ex04")


def main(argv=None):
    return cli(argv, "Check lesson 04's exercises (on 1, 2 and 3 processes).", check, EXERCISES,
               LEARNER, SOLUTIONS, TIMEOUT_S)


if __name__ == "__main__":
    sys.exit(main())
