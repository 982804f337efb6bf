"""Checker for lesson 04's exercises: runs your ZeRO pieces on real processes (gloo, through
picotron.launch.run_on_ranks) and compares them with the answer computed in one process. It names the rank,
the chunk and the element that are wrong and what the error usually means (forgot to divide by n, wrong
padding, wrong chunk offset, the chunks never all-gathered, no bias correction, ...), and the ranks that hang
with the line of your file where they wait.

    ./run.sh python lessons/04_zero/check.py [name ...] [--solutions | --module my.py] [--timeout S]
(what each option does, and the call from the notebook: lessons/_checker.py; here --timeout defaults to 10 s,
at least 120 for the exercises that train a model.)

The exercises: shard_range (pure arithmetic: checked on many sizes in one process), reduce_scatter_gradients
and sharded_adamw (ShardedAdamW.step), each on 2 and 3 ranks with unit sizes that n does not divide, so the
padding matters. While checking exercises 2 and 3 your file's shard_range is replaced by the reference one,
so they do not depend on exercise 1. keep_last_layer and bf16_gather (subclasses of zero3.Zero3) train a tiny
model on 2 and 3 ranks next to the plain Zero3, with a metrics.Recorder that keeps each all-gather's label and
bytes: the first must all-gather the last layer once per micro-batch and give exactly the plain losses and
parameters; the second must move half the bytes, gather exactly bf16(the fp32 weights), keep an fp32 master
and stay within BF16_LOSS_TOL of the fp32 losses. plan (the puzzle) is checked against the lesson's formulas
(`plan_problem`), then each chosen plan trains one step on 2 ranks, whose measured memory must fit. pp_traffic
(ZeRO with a pipeline: the elements each collective covers per step) is arithmetic, checked in one process
(`pp_traffic_problem`) against what tests/test_zero.py and the lesson measure. hsdp_groups (HSDP's shard and
replicate groups) is checked in one process against picotron.mesh.shard_groups, on grids with and without cp
(`hsdp_groups_problem`). owner_of (Muon's owners) is checked in one process on many lists of sizes: a rank for
every matrix, in range, and the largest load no more than picotron.planner.owner_of's (`owner_of_problem`).

How it works: run_on_ranks pickles the function it runs by reference, so the children run `_on_rank` (below,
at module level). It imports YOUR file by path, builds every rank's inputs deterministically (so each child
can also compute every other rank's, and the parent the expected answer), runs your code, and meets the other
ranks at a store-based rendezvous before returning, so a rank stuck in a collective shows up as a hang rather
than as a peer that left.
"""
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # lessons/: _checker, which puts the repository root on sys.path too
from _checker import _Failure, attempt, entry_points, in_process, load, on_ranks, rendezvous, where  # noqa: E402

import torch  # noqa: E402

from picotron import metrics  # noqa: E402
from picotron.launch import run_on_ranks  # noqa: E402


LEARNER = HERE / "exercise.py"
SOLUTIONS = HERE / "solution.py"
TIMEOUT_S = 10.0
EXERCISES = {"shard_range": "shard_range", "reduce_scatter_gradients": "reduce_scatter_gradients",
             "sharded_adamw": "ShardedAdamW.step", "keep_last_layer": "KeepLastLayer._post_forward",
             "bf16_gather": "Bf16Gather._gather/_wait", "plan": "plan (the puzzle)",
             "pp_traffic": "pp_zero_traffic", "hsdp_groups": "hsdp_groups", "owner_of": "owner_of"}
WORLD_SIZES = {"shard_range": (1,), "reduce_scatter_gradients": (2, 3), "sharded_adamw": (2, 3),
               "keep_last_layer": (2, 3), "bf16_gather": (2, 3), "plan": (2,)}
MIN_TIMEOUT_S = {"keep_last_layer": 120, "bf16_gather": 120, "plan": 300}  # they build and train models
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
             "sharded_adamw": _scenario_sharded_adamw}  # and, defined below, the three on real models


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


# ------------------------------------------------------------- exercises 4 and 5: ZeRO-3 on a real model
ZERO3_STEPS, ZERO3_ACC = 2, 2  # optimizer steps, micro-batches per step
BF16_LOSS_TOL = 5e-3  # bf16 keeps 8 significant bits: each gathered weight is off by at most 2^-9 relative


def _zero3_cfg(n):
    from picotron.config import Config
    return Config(preset="tiny", seq_len=32, micro_batch_size=2, dp=n, lr=1e-2)


class _LabelRecorder(metrics.Recorder):
    """A metrics.Recorder that also keeps each collective's label (which unit it moved)."""

    def __init__(self):
        super().__init__()
        self.labels = []

    def collective(self, kind, nbytes, work, label, start, axis=None, **info):
        self.labels.append((kind, label))
        return super().collective(kind, nbytes, work, label, start, axis=axis, **info)


def _zero3_run(cls, mesh):
    """Train `cls` (Zero3 or a subclass) for ZERO3_STEPS steps of ZERO3_ACC micro-batches, then one forward under
    no_grad; what happened: losses, all-gathers by unit, bytes, unit states, shards, the gathered weights."""
    import torch.distributed as dist
    from picotron import schedule
    from picotron.compat import collective
    from picotron.mesh import Mesh
    from picotron.model import loss_fn
    from picotron.parallelize import build_model, build_optimizer

    cfg, rec = _zero3_cfg(mesh.dp.size), _LabelRecorder()
    model = cls(build_model(cfg, Mesh.local()), mesh.dp_cp.recorded(rec))
    ptrs = [u.shard.data_ptr() for u in model.units]
    opt = build_optimizer(model.optimizer_groups(), cfg, mesh.device)
    engine = schedule.OneStage(mesh.dp_cp, mesh.device)
    g = torch.Generator().manual_seed(1 + mesh.rank)
    out = dict(losses=[], gathers=[], ag_bytes=[], kept=[], names=[u.name for u in model.units],
               padded=[u.padded for u in model.units])
    for _ in range(ZERO3_STEPS):
        rec.labels.clear()
        before = rec.bytes.get("all_gather", 0)
        batches = [tuple(torch.randint(0, 256, (2, 32), generator=g) for _ in range(2)) for _ in range(ZERO3_ACC)]
        out["losses"].append(engine.run(model, batches, loss_fn).item())
        opt.step()
        model.zero_grad(set_to_none=True)
        out["gathers"].append([label for kind, label in rec.labels if kind == "all_gather"])
        out["ag_bytes"].append(rec.bytes.get("all_gather", 0) - before)
        out["kept"].append([u.name for u in model.units if u.state != "free"])
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 32), generator=g))
    out["kept_after_eval"] = [u.name for u in model.units if u.state != "free"]
    out["shard_replaced"] = [u.name for u, p in zip(model.units, ptrs)
                             if u.shard.data_ptr() != p or u.shard.dtype != torch.float32]
    out["shards"] = [u.shard.detach().clone() for u in model.units]
    expected = []  # the fp32 weights, gathered here with a plain all-gather (not the code under test)
    for u in model.units:
        full = torch.empty(u.padded)
        collective(dist, "all_gather_into_tensor")(full, u.shard.detach().float().contiguous())
        expected.append(full)
    with model.gathered():
        out["full"] = [u.full.detach().clone() for u in model.units]
    out["expected_full"] = expected
    out["param_dtype"] = str(next(model.module.parameters()).dtype)
    return out


def _scenario_zero3(cls_name):
    def scenario(mod, ref, rank, n):
        from picotron import zero3
        from picotron.mesh import Mesh
        mesh = Mesh.init(dp=n)
        return dict(plain=_zero3_run(zero3.Zero3, mesh), got=_zero3_run(getattr(mod, cls_name), mesh))
    return scenario


def _counts(labels):
    out = {}
    for label in labels:
        name = label.removeprefix("all-gather ")
        out[name] = out.get(name, 0) + 1
    return out


def compare_keep_last_layer(n, results):
    for rank, res in enumerate(results):
        plain, got = res["plain"], res["got"]
        names, last = got["names"], got["names"][-1]
        for s, kept in enumerate(got["kept"], start=1):
            if kept:
                return (f"rank {rank}: after step {s}, {', '.join(kept)} still gathered: only the forward keeps the last "
                        f"layer; its backward must free it as before (keep _grad_ready as it is). A unit left gathered "
                        f"is not gathered again, so the next step would compute with the weights from before the "
                        f"optimizer step")
        if got["kept_after_eval"]:
            return (f"rank {rank}: after a forward under torch.no_grad() (evaluation) {', '.join(got['kept_after_eval'])} "
                    f"stayed gathered: no backward follows to use or free it. Keep the last layer only when a "
                    f"backward will come: torch.is_grad_enabled() and output.requires_grad")
        want = {u: c for u, c in _counts(plain["gathers"][0]).items()}
        want[last] -= ZERO3_ACC
        have = _counts(got["gathers"][0])
        if have != want:
            per = {u: have.get(u, 0) / ZERO3_ACC for u in names}
            extra = [u for u in names[1:-1] if have.get(u, 0) < want[u]]
            head = (f"rank {rank}: all-gathers per micro-batch: " + ", ".join(f"{u} {per[u]:g}" for u in names)
                    + " (plain ZeRO-3: root 1, every layer 2)")
            if have.get(last, 0) == 2 * ZERO3_ACC:
                return (f"{head} — {last} is still gathered twice: once for its forward, again right at the start "
                        f"of the backward. Do not free it after its forward (k == len(self.units) - 1)")
            if extra and len(extra) == len(names) - 2:
                return (f"{head} — every layer stays gathered from its forward to its backward: at the end of the "
                        f"forward the whole model is gathered, which is what ZeRO-3 exists to avoid. Keep only the "
                        f"last layer, the one the backward needs first")
            if extra:
                return (f"{head} — {', '.join(extra)} kept gathered too: only the last layer is needed again right "
                        f"away; an earlier layer kept gathered holds its weights through the rest of the forward")
            return f"{head}; expected {last} once and the other layers twice"
        if got["losses"] != plain["losses"] or any(not torch.equal(a, b) for a, b in zip(got["shards"], plain["shards"])):
            worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], plain["losses"]))
            return (f"rank {rank}: the losses or the parameters after {ZERO3_STEPS} steps differ from plain ZeRO-3's "
                    f"(max relative loss difference {worst:.1e}): keeping a layer gathered must not change any number")
        if got["ag_bytes"][0] != plain["ag_bytes"][0] - ZERO3_ACC * 4 * got["padded"][-1]:
            return (f"rank {rank}: {got['ag_bytes'][0]} bytes all-gathered per step, expected "
                    f"{plain['ag_bytes'][0] - ZERO3_ACC * 4 * got['padded'][-1]}")
    return None


def compare_bf16_gather(n, results):
    for rank, res in enumerate(results):
        plain, got = res["plain"], res["got"]
        if got["param_dtype"] != "torch.float32":
            return (f"rank {rank}: the model's parameters became {got['param_dtype']}: keep unit.full fp32 (the "
                    f"parameters are views of it) and copy the gathered bf16 values into it")
        if got["shard_replaced"]:
            return (f"rank {rank}: unit.shard of {', '.join(got['shard_replaced'])} was replaced (or changed dtype): the "
                    f"optimizer updates the original fp32 shard, its pieces are views of it. Send a bf16 COPY "
                    f"(unit.shard.to(torch.bfloat16)) and leave unit.shard alone")
        ratio = got["ag_bytes"][0] / plain["ag_bytes"][0]
        mib = got["ag_bytes"][0] / 2**20
        if abs(ratio - 1) < 1e-9:
            return (f"rank {rank}: {mib:.2f} MiB all-gathered per step, as many as plain ZeRO-3: the all-gathers still "
                    f"carry fp32. Cast the shard to bf16 BEFORE the all-gather, into a bf16 buffer (rounding "
                    f"unit.full afterwards saves nothing on the wire)")
        if abs(ratio - 0.5) > 1e-9:
            return (f"rank {rank}: {mib:.2f} MiB all-gathered per step, {ratio:.2f} x plain ZeRO-3's; expected exactly "
                    f"half (every unit's all-gather in bf16, once per use, as before)")
        for u, full, exp, padded in zip(got["names"], got["full"], got["expected_full"], got["padded"]):
            want = exp.to(torch.bfloat16).float()
            if torch.equal(full, want):
                continue
            chunk = padded // n
            bad = [k for k in range(n) if not torch.equal(full[k * chunk:(k + 1) * chunk], want[k * chunk:(k + 1) * chunk])]
            head = f"rank {rank}: after a gather, {u}'s weights are not the fp32 weights rounded to bf16"
            if len(bad) == n:
                return (f"{head}: unit.full does not hold the gathered values. In _wait, after unit.work.wait(), copy "
                        f"the received bf16 buffer into unit.full (in place: the parameters are views of it)")
            return (f"{head} in chunks {bad} of {n}: all-gather the bf16 copy of this rank's own shard into a buffer "
                    f"of n·chunk = {padded} elements, and copy that whole buffer after unit.work.wait()")
        rounded = [u for u, sh in zip(got["names"], got["shards"])
                   if sh.numel() > 100 and (sh.to(torch.bfloat16).float() == sh).float().mean() > 0.9]
        if rounded:
            return (f"rank {rank}: the fp32 master shards of {', '.join(rounded)} hold only bf16 values after "
                    f"{ZERO3_STEPS} steps: the shard itself was rounded. Round a copy; the master keeps fp32, else "
                    f"every update smaller than bf16's resolution (about 0.4% of a weight) is lost")
        worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], plain["losses"]))
        if worst > BF16_LOSS_TOL:
            return (f"rank {rank}: the losses differ from fp32 gathering by up to {worst:.1e} relative, more than "
                    f"{BF16_LOSS_TOL:.0e}: weights rounded to bf16 should change them far less")
    return None


def bf16_success(results):
    plain, got = results[0]["plain"], results[0]["got"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], plain["losses"]))
    return (f": {plain['ag_bytes'][0] / 2**20:.2f} -> {got['ag_bytes'][0] / 2**20:.2f} MiB all-gathered per step "
            f"(recorded); gathered weights = bf16(fp32 master) exactly; losses within {worst:.0e} of fp32 "
            f"gathering (bound {BF16_LOSS_TOL:.0e})")


def keep_last_success(results):
    plain, got = results[0]["plain"], results[0]["got"]
    return (f": {plain['ag_bytes'][0] / 2**20:.2f} -> {got['ag_bytes'][0] / 2**20:.2f} MiB all-gathered per step "
            f"(recorded; {got['names'][-1]} once per micro-batch); losses and parameters identical to plain ZeRO-3")


# ------------------------------------------------------------------------------------ exercise 6: the puzzle
PUZZLE_BUDGETS = (100, 64, 47)  # MiB per rank
PUZZLE_MBS = (1, 2, 4, 8)


def puzzle_facts():
    """The puzzle's model, as in exercise.py; the buffers in flight computed from the real units' sizes."""
    from picotron import zero
    from picotron.config import Config
    from picotron.mesh import Axis, Mesh
    from picotron.model import ModelConfig
    from picotron.parallelize import build_model

    mc = ModelConfig.from_preset("tiny", hidden_size=256, intermediate_size=768, num_hidden_layers=4)
    cfg = Config(preset="tiny", hidden_size=256, intermediate_size=768, num_hidden_layers=4)
    z2 = zero.ZeroDataParallel(build_model(cfg, Mesh.local()), Axis.alone("dp", 2, 0), 2, bucket_mb=4.0)
    buckets = [4 * u.padded for u in z2.units]
    psi = mc.num_params()
    root = psi - mc.num_hidden_layers * (sum(p.numel() for p in build_model(cfg, Mesh.local()).layers[0].parameters()))
    layer = (psi - root) // mc.num_hidden_layers
    in_flight = {0: 0, 1: 0, 2: max(a + b for a, b in zip(buckets, buckets[1:])), 3: 4 * (2 * root + 3 * layer)}
    return dict(mc=mc, psi=psi, root=root, in_flight=in_flight, dp=2, seq_len=128, seqs=8)


def puzzle_cost(f, zero, mbs):
    """(memory by part in bytes, elements through the collectives per step, micro-batches per step)."""
    from picotron import planner
    g = f["seqs"] // mbs
    mem = dict(planner.zero_model_state_bytes(f["psi"], zero, f["dp"]), in_flight=f["in_flight"][zero],
               activations=planner.activation_bytes(f["mc"], f["seq_len"], mbs))
    psi = f["psi"]
    wire = {0: 2 * psi, 1: 2 * psi, 2: (g + 1) * psi, 3: g * (3 * psi - f["root"])}[zero]
    return mem, wire, g


def _describe(f, zero, mbs):
    mem, wire, g = puzzle_cost(f, zero, mbs)
    parts = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in mem.items() if v)
    return (f"{sum(mem.values()) / 2**20:.1f} MiB ({parts}), {wire / f['psi']:.2f} Ψ through the collectives per step "
            f"in {g} micro-batch{'es' if g > 1 else ''}")


def plan_problem(f, budget, got):
    """What is wrong with the plan `got` for `budget` MiB, or None."""
    if not (isinstance(got, dict) and got.get("zero") in (0, 1, 2, 3) and got.get("micro_batch_size") in PUZZLE_MBS):
        return (f"plan({budget}) returned {got!r}: return dict(zero=0|1|2|3, micro_batch_size=b) with b dividing the "
                f"{f['seqs']} sequences per rank (1, 2, 4 or 8)")
    zero, mbs = got["zero"], got["micro_batch_size"]
    mem, wire, g = puzzle_cost(f, zero, mbs)
    name = f"{['DP', 'ZeRO-1', 'ZeRO-2', 'ZeRO-3'][zero]} with micro-batch {mbs}"
    if sum(mem.values()) > budget * 2**20:
        big = max(mem, key=mem.get)
        return (f"plan({budget}): {name} needs {_describe(f, zero, mbs)} > {budget} MiB: it does not fit (the "
                f"largest part: {big}). " + ("A smaller micro-batch keeps fewer activations; " if mbs > 1 else "")
                + ("a higher ZeRO stage shards more" if zero < 3 else "ZeRO-3 with one sequence is the least there is"))
    fits = [(puzzle_cost(f, z, b)[1:], z, b) for z in range(4) for b in PUZZLE_MBS
            if sum(puzzle_cost(f, z, b)[0].values()) <= budget * 2**20]
    (best_wire, best_g), _, _ = min(fits)
    if (wire, g) == (best_wire, best_g):
        return None
    if wire > best_wire:
        why = {2: "ZeRO-2 reduce-scatters after every micro-batch", 3: "ZeRO-3 all-gathers twice and reduce-scatters "
               "once per micro-batch"}.get(zero, "")
        return (f"plan({budget}): {name} fits ({_describe(f, zero, mbs)}) but is not the fastest: {why}; a plan that "
                f"fits moves {best_wire / f['psi']:.2f} Ψ per step")
    return (f"plan({budget}): {name} fits ({_describe(f, zero, mbs)}) and moves the fewest bytes, but in {g} "
            f"micro-batches; a plan that fits moves as few in {best_g}: bigger micro-batches, fewer launches")


def _scenario_plan(mod, ref, rank, n):
    """One training step of each distinct plan the learner chose, on these ranks: the memory they measure."""
    import importlib.util

    from picotron.mesh import Mesh
    spec = importlib.util.spec_from_file_location("lesson04_experiment", HERE / "experiment.py")
    lesson = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lesson)
    mesh = Mesh.init(dp=n)
    out = {}
    for budget in PUZZLE_BUDGETS:
        p = mod.plan(budget)
        key = (p["zero"], p["micro_batch_size"])
        if key not in out:
            cfg = lesson.make_cfg("small", seq_len=128, micro_batch_size=key[1], grad_acc=8 // key[1], dp=n)
            v = lesson.Variant(f"plan {key}", key[0], cfg, mesh)
            v.step(1)
            mem = {k: v.mem.get(k, 0) for k in ("params", "grads", "optimizer", "zero_transient_peak", "activations")}
            total = sum(b * (2 if k == "all_reduce" else 1) for k, b in v.recorder.bytes.items())
            out[key] = dict(mem=mem, wire_bytes=total)
            del v
    return out


def check_plan(path, report, timeout_s):
    what = EXERCISES["plan"]
    try:
        mod = load(path, "ex04plan")
        plans = {b: mod.plan(b) for b in PUZZLE_BUDGETS}
    except Exception as e:  # noqa: BLE001
        report.fail(what, f"{type(e).__name__}: {e}{where(e, path)}")
        return
    f = puzzle_facts()
    problems = [plan_problem(f, b, plans[b]) for b in PUZZLE_BUDGETS]
    if any(p and p.startswith(f"plan({b}) returned") for b, p in zip(PUZZLE_BUDGETS, problems)):
        report.fail(what, next(p for p in problems if p))
        return
    measured = attempt(lambda: run_on_ranks(_on_rank, f["dp"], str(path), "plan", str(SOLUTIONS),
                                            timeout_s=timeout_s), report, what, path, timeout_s)
    if measured is None:
        return
    lines, failures = [], []
    for b, problem in zip(PUZZLE_BUDGETS, problems):
        key = (plans[b]["zero"], plans[b]["micro_batch_size"])
        mem, wire, _ = puzzle_cost(f, *key)
        peak = max(sum(r[key]["mem"].values()) for r in measured)
        on_wire = measured[0][key]["wire_bytes"] / 4
        if problem is None and peak > b * 2**20:
            problem = f"plan({b}): the ranks measured {peak / 2**20:.1f} MiB per rank > {b} MiB"
        if problem is None and (abs(peak / sum(mem.values()) - 1) > 0.01 or on_wire != wire):
            problem = (f"plan({b}): the ranks measured {peak / 2**20:.1f} MiB and {on_wire / f['psi']:.2f} Ψ per step, "
                       f"the formulas say {sum(mem.values()) / 2**20:.1f} MiB and {wire / f['psi']:.2f} Ψ")
        if problem:
            failures.append(problem + ("" if "measured" in problem else f" (on 2 ranks it measured {peak / 2**20:.1f} MiB)"))
        lines.append(f"{b} MiB: {['DP', 'ZeRO-1', 'ZeRO-2', 'ZeRO-3'][key[0]]} micro-batch {key[1]}, "
                     f"{peak / 2**20:.1f} MiB measured, {on_wire / f['psi']:.2f} Ψ per step")
    if failures:
        report.fail(what, failures[0])
    else:
        report.ok(what, ": " + "; ".join(lines))


SCENARIOS.update(keep_last_layer=_scenario_zero3("KeepLastLayer"), bf16_gather=_scenario_zero3("Bf16Gather"),
                 plan=_scenario_plan)
COMPARE = {"shard_range": compare_shard_range, "reduce_scatter_gradients": compare_reduce_scatter_gradients,
           "sharded_adamw": compare_sharded_adamw, "keep_last_layer": compare_keep_last_layer,
           "bf16_gather": compare_bf16_gather}
SUCCESS = {"shard_range": f"{sum(k for _, k in SHARD_CASES)} (numel, n, rank) cases, padding and numel < n included",
           "reduce_scatter_gradients": f"{len(GRAD_UNITS)} units (uneven sizes: padding); every rank holds its chunk of "
                                       f"the mean gradient",
           "sharded_adamw": f"{ADAM_STEPS} steps on units of {' and '.join(map(str, ADAM_NUMELS))} elements equal "
                            f"torch.optim.AdamW on the whole vector, on every rank, in place",
           "keep_last_layer": keep_last_success, "bf16_gather": bf16_success}


# ------------------------------------------------------------------------- exercise 7: ZeRO with a pipeline
PP_CASES = [(stage, root, layers, m, reshard) for stage in (1, 2, 3) for root, layers in ((1000, 6000), (0, 4096))
            for m in (1, 4, 8) for reshard in ((False, True) if stage == 3 else (False,))]


def pp_traffic_problem(fn, path):
    """The first case where the learner's pp_zero_traffic differs from the answer, with what that usually means."""
    for stage, root, layers, m, reshard in PP_CASES:
        total = root + layers
        want = {"all_gather": root + 2 * m * layers if reshard else total, "reduce_scatter": total}
        got = fn(stage, root, layers, m, reshard)
        got = {k: got.get(k) for k in want} if isinstance(got, dict) else got
        if got == want:
            continue
        call = f"pp_zero_traffic({stage}, root={root}, layers={layers}, m={m}, reshard={reshard})"
        head = f"{call} returned {got}, expected {want}"
        if not isinstance(got, dict):
            return f"{head}: return a dict with the keys all_gather and reduce_scatter"
        rs, ag = got["reduce_scatter"], got["all_gather"]
        if m > 1 and rs == m * total:
            return (f"{head}: a reduce-scatter per micro-batch; under the pipeline's no_sync a chunk's gradients add "
                    f"up locally and are reduce-scattered ONCE, at its last backward")
        if rs != total:
            return f"{head}: every gradient element is reduce-scattered once per step: root + layers = {total}"
        if stage < 3 and ag == 0:
            return (f"{head}: ZeRO-{stage} all-gathers the updated parameters after the optimizer step (every rank "
                    f"updated only its chunk)")
        if reshard and ag == 2 * m * total:
            return (f"{head}: the roots are gathered once per step (kept from the first forward to the last "
                    f"backward); only the layers are freed and gathered again")
        if reshard and ag in (root + m * layers, m * total):
            return f"{head}: a resharded layer is gathered for its F and again for its B: 2m times per step"
        if reshard and ag == root + 3 * m * layers:
            return f"{head}: the W of a split schedule needs no gather (gᵀx reads no weights), and 1F1B has no W"
        if not reshard and stage == 3 and ag != total:
            return (f"{head}: kept, ZeRO-3 gathers each unit once, at its first use in the step, and keeps it to the "
                    f"chunk's last backward: root + layers = {total}")
        return head
    return None


# ------------------------------------------------------------------------------- exercise 8: HSDP's groups
HSDP_CASES = [(4, 2, 1), (8, 4, 1), (8, 2, 1), (6, 3, 1), (4, 2, 2), (4, 1, 2), (8, 4, 2), (4, 4, 1), (2, 2, 3)]


def _as_sets(groups):
    return sorted(sorted(int(r) for r in g) for g in groups)


def hsdp_groups_problem(fn, path):
    """The first grid on which the learner's hsdp_groups differs from picotron.mesh.shard_groups, with what the
    difference usually means."""
    from picotron.mesh import shard_groups
    for dp, ds, cp in HSDP_CASES:
        want = tuple(_as_sets(g) for g in shard_groups(dict(dp=dp, cp=cp), ds))
        got = fn(dp, ds, cp)
        call = f"hsdp_groups(dp={dp}, dp_shard={ds}, cp={cp})"
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            return f"{call} returned {got!r}: return a pair (shard groups, replicate groups)"
        got = tuple(_as_sets(g) for g in got)
        if got == want:
            continue
        head = f"{call} returned shard {got[0]}, replicate {got[1]}; expected shard {want[0]}, replicate {want[1]}"
        if got == want[::-1]:
            return f"{head}: the two are swapped (a shard group is a block of consecutive dp coordinates: a node)"
        if got[0] == _as_sets(shard_groups(dict(dp=dp, cp=cp), dp // ds)[1]):
            return (f"{head}: your shard groups are strided (every dp/dp_shard-th rank); HSDP's are blocks of "
                    f"dp_shard CONSECUTIVE dp coordinates, so that a group sits in one node")
        if cp > 1 and all(len(g) == ds for g in got[0]):
            return (f"{head}: a shard group holds every cp rank of its dp coordinates (ZeRO shards over dp x cp): "
                    f"dp_shard x cp = {ds * cp} ranks")
        if cp > 1 and any(len({r % cp for r in g}) > 1 for g in got[1]):
            return f"{head}: replicas share the cp coordinate (they hold the same shard only if they see the same units)"
        if sorted(r for g in got[0] for r in g) != list(range(dp * cp)):
            return f"{head}: the shard groups must cover every rank once"
        return head
    return None


# ------------------------------------------------------------------------------------ exercise 9: Muon's owners
OWNER_CASES = [([1, 5, 3, 3], 2), ([4, 4, 4, 4], 4), ([10], 3), ([7, 7, 6, 6, 5, 5, 4, 4, 1], 3),
               ([3, 3, 2, 2, 2], 2), ([1, 1, 1, 9], 2), ([2, 8, 2, 8, 2, 8, 1], 4), ([16384, 16384, 4096, 4096, 49152,
                                                                                   49152, 49152], 4)]


def owner_of_problem(fn, path):
    """The first list of sizes on which the learner's owner_of is wrong, with what that usually means."""
    from picotron.planner import owner_of
    for sizes, n in OWNER_CASES:
        call = f"owner_of({sizes}, {n})"
        got = fn(list(sizes), n)
        if not (isinstance(got, (list, tuple)) and len(got) == len(sizes)):
            return f"{call} returned {got!r}: return one rank per matrix ({len(sizes)} of them)"
        if any(not isinstance(r, int) or not 0 <= r < n for r in got):
            return f"{call} returned {list(got)}: every owner is a rank in 0..{n - 1}"
        loads = [sum(s for s, r in zip(sizes, got) if r == k) for k in range(n)]
        best = max(sum(s for s, r in zip(sizes, owner_of(sizes, n)) if r == k) for k in range(n))
        if max(loads) <= best:
            continue
        head = f"{call} returned {list(got)}: loads {loads}, the largest {max(loads)}; the largest-first rule gives {best}"
        if list(got) == [k % n for k in range(len(sizes))]:
            return f"{head}: you dealt the matrices out in turn (round-robin by position); take them by size, largest first"
        if len(set(got)) == 1:
            return f"{head}: every matrix went to rank {got[0]}; give each to the least-loaded rank so far"
        return (f"{head}: take the matrices largest first (a large one placed last unbalances the ranks), each to the "
                f"rank with the least load so far")
    return None


def check_one(name, path, report, timeout_s):
    timeout_s = max(timeout_s, MIN_TIMEOUT_S.get(name, 0))
    if name == "owner_of":
        return in_process("owner_of", path, report, owner_of_problem,
                          f": {len(OWNER_CASES)} lists of sizes (n = 2 to 4)", "ex04owner", EXERCISES[name])
    if name == "plan":
        return check_plan(path, report, timeout_s)
    if name == "hsdp_groups":
        return in_process("hsdp_groups", path, report, hsdp_groups_problem,
                          f": {len(HSDP_CASES)} grids (dp up to 8, with and without cp)", "ex04hsdp", EXERCISES[name])
    if name == "pp_traffic":
        return in_process("pp_zero_traffic", path, report, pp_traffic_problem,
                          f": {len(PP_CASES)} cases (ZeRO-1/2/3, kept and resharded, m = 1, 4, 8)", "ex04pp",
                          EXERCISES[name])
    success = SUCCESS[name]
    on_ranks(lambda n: EXERCISES[name] + (" on many sizes" if n == 1 else f" on {n} ranks"), WORLD_SIZES[name],
             lambda n: run_on_ranks(_on_rank, n, str(path), name, str(SOLUTIONS), timeout_s=timeout_s),
             lambda n, results: (COMPARE[name](n, results),
                                 success(results) if callable(success) else f": {success}"), report, path, timeout_s)


check, main = entry_points("Check lesson 04's exercises (on 1, 2 and 3 processes).", EXERCISES, check_one,
                           LEARNER, SOLUTIONS, TIMEOUT_S, "ex04")


if __name__ == "__main__":
    sys.exit(main())
