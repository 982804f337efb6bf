"""Checker for lesson 05's exercises: runs your tensor-parallel pieces on real processes (gloo, through
picotron.launch.run_on_ranks), every rank with its slice of the same full weights or logits, and compares
outputs AND gradients with the unsharded computation done in one process. It names the rank and the tensor
that are wrong and what the error usually means (a missing all-reduce in backward of f, a partial sum left
unsummed, a sum taken twice, an all-reduce done in place on the caller's tensor, each rank's own maximum, the
wrong columns, ...), counts your all-reduces against Megatron's pattern, and names the ranks that hang with the
line of your file where they wait.

    ./run.sh python lessons/05_tensor_parallel/check.py [name ...] [--solutions | --module my.py] [--timeout S]
(what each option does, and the call from the notebook: lessons/_checker.py; here --timeout defaults to 15 s.)

The puzzle, plan(budget_mib), is graded in this process against the lesson's formulas for six budgets (most
with a trap: counting every accumulated micro-batch's activations, sp where it costs memory, no sp where it saves
it, tp where accumulation would do); the right answers that need tp > 1 then run one real step on tp processes,
whose measured bytes per rank must fit the budget. The other exercises, each on 2 and then 4 ranks: f_and_g
(CopyToTP and ReduceFromTP, forward and backward), parallel_mlp (the column-then-row MLP; while it is checked,
your file's CopyToTP and ReduceFromTP are replaced by the reference ones, so it does not depend on exercise 1),
vocab_parallel_cross_entropy (the loss from vocabulary-sharded logits; its backward is the checker's own, from
the softmax columns you return), partition (keep_my_piece and rebuild_input, ZeRO-R's partitioned checkpoint: the
piece's dimension, rank, and that it is a copy; rebuild_input is given the right piece, and its output's layout and
collectives are checked). ring (ring_steps, async TP's all-gather-matmul order: which chunk each rank multiplies at
each step, whom it sends to and receives from) is checked in this process for 2, 3, 4 and 8 ranks, naming the
mistake (chunks passed the wrong way, a message too many, another rank's chunk first, the wrong neighbour).

How it works: run_on_ranks pickles the function it runs by reference, so the children run `_on_rank` (below,
at module level). It imports YOUR file by path, builds the full tensors from fixed seeds (so the parent can
compute the unsharded answer), gives each rank its slice, runs your code forward and backward while counting
the collectives it calls, and meets the other ranks at a store-based rendezvous before returning, so a rank
stuck in a collective shows up as a hang rather than as a peer that left.
"""
import sys
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # lessons/: _checker, which puts the repository root on sys.path too
from _checker import _Failure, entry_points, load, on_ranks, rendezvous, where  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from picotron.launch import RankError, RankTimeout, run_on_ranks  # noqa: E402


LEARNER = HERE / "exercise.py"
SOLUTIONS = HERE / "solution.py"
TIMEOUT_S = 15.0
EXERCISES = {"f_and_g": "CopyToTP and ReduceFromTP", "parallel_mlp": "parallel_mlp",
             "vocab_parallel_cross_entropy": "vocab_parallel_cross_entropy", "plan": "plan (the puzzle)",
             "partition": "keep_my_piece and rebuild_input", "ring": "ring_steps (async TP's ring order)"}
WORLD_SIZES = {"f_and_g": (2, 4), "parallel_mlp": (2, 4), "vocab_parallel_cross_entropy": (2, 4), "partition": (2, 4)}
# the tensor forms under both names: torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (whichever
# this torch has are counted; on 2.13 the old name calls the new one, which _Counter counts once, as the outer call)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
               "reduce_scatter_single", "broadcast", "reduce")
B, S, H, I = 2, 3, 8, 16  # the MLP: b sequences of s tokens, hidden h, intermediate i (4 divides it)
N_TOK, VOCAB, BIG_ROW, BIG_COL = 12, 24, 5, 17  # the loss: T tokens, vocabulary n_vocab; one logit of 120 (overflow)
PB, PS, PH = 2, 4, 8  # the partitioned layer input [b, s, h]: 4 divides s too, so a cut of the wrong dim fits


# ------------------------------------------------------------------------------- inputs (child and parent)
def randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def f_inputs(rank):
    """f: x (the same on every rank) and this rank's gradient of f's output (different on every rank)."""
    return randn(1, 3, 8), randn(100 + rank, 3, 8)


def g_inputs(rank):
    """g: this rank's partial sum (different on every rank) and the gradient of g's output (the same)."""
    return randn(200 + rank, 3, 8), randn(300, 3, 8)


def mlp_inputs():
    """x, the full gate, up and down weights, the gradient of the output."""
    return randn(400, B, S, H), randn(401, I, H) * 0.5, randn(402, I, H) * 0.5, randn(403, H, I) * 0.5, randn(404, B, S, H)


def ce_inputs():
    """Full logits (one of them 120: exp overflows without the max), targets covering every rank's columns,
    and the gradient of the per-token losses."""
    logits = randn(500, N_TOK, VOCAB) * 3
    logits[BIG_ROW, BIG_COL] = 120.0
    targets = torch.randint(0, VOCAB, (N_TOK,), generator=torch.Generator().manual_seed(501))
    targets[:4] = torch.tensor([0, VOCAB - 1, VOCAB // 2, VOCAB // 4 + 1])
    return logits, targets, randn(502, N_TOK)


def partition_input():
    """A layer's input [b, s, h], the same on every rank."""
    return randn(600, PB, PS, PH)


def mlp(x, gate_w, up_w, down_w):
    return F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)


# --------------------------------------------------------------------------------------- in each child
class _Counter:
    """Counts the collectives called through torch.distributed while active, by phase."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.phase, self.counts, self._orig, self._inside = dist, "forward", {}, {}, False

    def _count(self, name, fn, /, *args, **kwargs):
        if self._inside:  # a collective called by a counted one (torch 2.13's deprecated names): not another call
            return fn(*args, **kwargs)
        key = f"{self.phase} {name}"
        self.counts[key] = self.counts.get(key, 0) + 1
        self._inside = True
        try:
            return fn(*args, **kwargs)
        finally:
            self._inside = False

    def __enter__(self):
        for name in COLLECTIVES:
            if hasattr(self.dist, name):
                self._orig[name] = getattr(self.dist, name)
                setattr(self.dist, name, partial(self._count, name, self._orig[name]))
        return self

    def __exit__(self, *exc):
        for name, fn in self._orig.items():
            setattr(self.dist, name, fn)


class _CrossEntropy(torch.autograd.Function):
    """The loss as an autograd Function around the learner's (losses, softmax): the exercise file's
    VocabParallelCrossEntropy, kept here so that a change to that given code cannot hide or cause a failure."""

    @staticmethod
    def forward(ctx, logits, targets, losses, softmax):
        import torch.distributed as dist

        lo = dist.get_rank() * logits.shape[-1]
        inside = (targets >= lo) & (targets < lo + logits.shape[-1])
        ctx.save_for_backward(softmax, (targets - lo).masked_fill(~inside, 0), inside)
        return losses.clone()

    @staticmethod
    def backward(ctx, grad_losses):
        softmax, local, inside = ctx.saved_tensors
        grad = softmax.clone()
        grad[torch.arange(len(local)), local] -= inside.to(grad.dtype)
        return grad * grad_losses[:, None], None, None, None


def _on_rank(path, name, ref_path):
    """Runs on every rank: the scenario of exercise `name` with the file at `path`; returns its results, or
    raises _Failure with one line."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    try:
        mod = load(path, "ex05")
    except Exception as e:  # noqa: BLE001
        raise _Failure(f"cannot import {Path(path).name}: {type(e).__name__}: {e}{where(e, path)}") from None
    ref = load(ref_path, "ex05ref")
    if name == "parallel_mlp":  # exercise 2 does not depend on exercise 1
        mod.CopyToTP, mod.ReduceFromTP = ref.CopyToTP, ref.ReduceFromTP
    try:
        results = SCENARIOS[name](mod, rank, n)
    except _Failure:
        raise
    except Exception as e:  # noqa: BLE001 - any bug in the learner's code is a failed check
        raise _Failure(f"{type(e).__name__}: {e}{where(e, path)}{_hint(e)}") from None
    rendezvous(n, "check05/done")
    return results


def _hint(e):
    text = str(e)
    if "incorrect number of gradients" in text:
        return " — backward returns one gradient per input of forward: (grad_x, None), None for the group"
    if isinstance(e, IndexError) or "out of bounds" in text or "out of range" in text:
        return (" — targets are global vocabulary ids; this rank's columns hold ids [lo, lo + n_vocab/n), lo = rank·n_vocab/n: "
                "subtract lo, and take no logit for rows whose target is not in your columns")
    return ""


def _plain(value):
    if torch.is_tensor(value):
        return value.detach().cpu().clone()
    return value if isinstance(value, (int, float, type(None))) else repr(value)


def _scenario_f_and_g(mod, rank, n):
    out = {}
    x0, gy = f_inputs(rank)
    x = x0.clone().requires_grad_()
    with _Counter() as c:
        y = mod.CopyToTP.apply(x, None)
        out["f_out"] = _plain(y)
        out["f_input_after"] = _plain(x)
        c.phase = "backward"
        if torch.is_tensor(y) and y.shape == gy.shape and y.requires_grad:
            (y * gy).sum().backward()
    out["f_grad"], out["f_counts"] = _plain(x.grad), c.counts

    p0, gz = g_inputs(rank)
    p = p0.clone().requires_grad_()
    with _Counter() as c:
        z = mod.ReduceFromTP.apply(p, None)
        out["g_out"] = _plain(z)
        out["g_input_after"] = _plain(p)
        c.phase = "backward"
        if torch.is_tensor(z) and z.shape == gz.shape and z.requires_grad:
            (z * gz).sum().backward()
    out["g_grad"], out["g_counts"] = _plain(p.grad), c.counts
    return out


def _scenario_parallel_mlp(mod, rank, n):
    x0, wg, wu, wd, gy = mlp_inputs()
    x = x0.clone().requires_grad_()
    gate = wg.chunk(n, 0)[rank].clone().requires_grad_()
    up = wu.chunk(n, 0)[rank].clone().requires_grad_()
    down = wd.chunk(n, 1)[rank].clone().requires_grad_()
    with _Counter() as c:
        y = mod.parallel_mlp(x, gate, up, down, None)
        c.phase = "backward"
        if torch.is_tensor(y) and y.shape == gy.shape and y.requires_grad:
            (y * gy).sum().backward()
    return dict(out=_plain(y), x_grad=_plain(x.grad), gate_grad=_plain(gate.grad), up_grad=_plain(up.grad),
                down_grad=_plain(down.grad), counts=c.counts)


def _scenario_vocab_parallel_cross_entropy(mod, rank, n):
    full, targets, w = ce_inputs()
    logits = full.chunk(n, -1)[rank].clone().requires_grad_()
    with _Counter() as c:
        got = mod.vocab_parallel_cross_entropy(logits.detach().clone(), targets.clone(), None)
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(torch.is_tensor(t) for t in got)):
            return dict(returned=repr(got)[:200], counts=c.counts)
        losses, softmax = got
        grad = None
        if losses.shape == (N_TOK,) and softmax.shape == logits.shape:
            c.phase = "backward"
            (_CrossEntropy.apply(logits, targets, losses.detach(), softmax.detach()) * w).sum().backward()
            grad = logits.grad
    return dict(losses=_plain(losses), softmax=_plain(softmax), grad=_plain(grad), counts=c.counts)


def _scenario_partition(mod, rank, n):
    """keep_my_piece on the input, then rebuild_input from the RIGHT piece (5b does not depend on 5a)."""
    x = partition_input()
    with _Counter() as c:  # phase "forward": keeping; "backward": rebuilding
        piece = mod.keep_my_piece(x, None)
        shares = torch.is_tensor(piece) and piece.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        out = dict(piece=_plain(piece), shares=shares, x_after=_plain(x))
        c.phase = "backward"
        out["rebuilt"] = _plain(mod.rebuild_input(x.chunk(n, -1)[rank].clone(), None))
    return out | dict(counts=c.counts)


SCENARIOS = {"f_and_g": _scenario_f_and_g, "parallel_mlp": _scenario_parallel_mlp,
             "vocab_parallel_cross_entropy": _scenario_vocab_parallel_cross_entropy, "partition": _scenario_partition}


# ------------------------------------------------------------------------------------------ the parent
def _close(a, b):
    """Same shape and values (infinities and nans where the other has the same: a mistake imitated in the parent
    may overflow just like the learner's)."""
    return torch.is_tensor(a) and a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)


def _diff(got, expected):
    """'max |got - expected| = 1.2e-01, first at [0, 2]: got 0.5, expected 0.62'."""
    bad = ~torch.isclose(got, expected, rtol=1e-5, atol=1e-6, equal_nan=True)
    idx = tuple(int(i) for i in bad.nonzero()[0])
    d = (got - expected).abs().nan_to_num(nan=float("inf"))
    return (f"max |got - expected| = {d.max().item():.2e}, first at {list(idx)}: got {got[idx].item():.6g}, "
            f"expected {expected[idx].item():.6g}")


def _shape_problem(got, expected, what):
    if got is None:
        return f"{what} is None: no gradient reached it (backward must return a gradient for it)"
    if not torch.is_tensor(got):
        return f"{what}: got {got}, expected a tensor of shape {list(expected.shape)}"
    if got.shape != expected.shape:
        return f"{what} has shape {list(got.shape)}, expected {list(expected.shape)}"
    return None


def _counts_text(counts, phase):
    items = [(k.split()[1], c) for k, c in counts.items() if k.startswith(phase)]
    return ", ".join(f"{c} {name.replace('_', '-')}" for name, c in items) or "no collective"


def compare_f_and_g(n, results):
    x0, _ = f_inputs(0)
    gys = [f_inputs(r)[1] for r in range(n)]
    ps = [g_inputs(r)[0] for r in range(n)]
    _, gz = g_inputs(0)
    total_gy, total_p = sum(gys), sum(ps)
    for r, res in enumerate(results):
        problem = _f_problem(res, r, n, x0, gys[r], total_gy) or _g_problem(res, r, n, ps[r], total_p, gz)
        if problem:
            return f"rank {r}: {problem}"
    return None


def _f_problem(res, r, n, x0, own, total):
    y, after, gx = res["f_out"], res["f_input_after"], res["f_grad"]
    problem = _shape_problem(y, x0, "CopyToTP.forward's output")
    if problem:
        return problem
    if not _close(after, x0):
        return ("CopyToTP.forward changed its input x in place (dist.all_reduce works in place): f's forward is the "
                "identity; return x untouched")
    if not _close(y, x0):
        if _close(y, n * x0):
            return (f"CopyToTP.forward returned {n}·x: it all-reduced in forward. f is the identity forward (x is "
                    f"already the same on every rank); its all-reduce belongs in backward")
        return f"CopyToTP.forward should return x unchanged; {_diff(y, x0)}"
    problem = _shape_problem(gx, x0, "x's gradient through CopyToTP")
    if problem:
        return problem
    if not _close(gx, total):
        if _close(gx, own):
            return (f"missing all-reduce in backward of f: x's gradient on rank {r} is only rank {r}'s partial sum "
                    f"(the part that flowed through its own slice of the weights). The gradient of x is the SUM of "
                    f"the ranks' parts: all-reduce it in CopyToTP.backward")
        if _close(gx, n * total):
            return f"x's gradient is {n} times the right one: summed twice (two all-reduces, or an all-reduce of a sum)"
        if _close(gx, total / n):
            return ("x's gradient is the MEAN of the ranks' parts, not their sum: each part is the contribution of a "
                    "different slice of the weights, not a copy of the same gradient. Do not divide by n")
        return f"x's gradient through CopyToTP is wrong; {_diff(gx, total)}"
    counts = res["f_counts"]
    if counts.get("forward all_reduce", 0) or counts.get("backward all_reduce", 0) != 1:
        return (f"right values, but CopyToTP made {_counts_text(counts, 'forward')} in forward and "
                f"{_counts_text(counts, 'backward')} in backward: f is no communication forward, ONE all-reduce "
                f"backward")
    return None


def _g_problem(res, r, n, own, total, gz):
    z, after, gp = res["g_out"], res["g_input_after"], res["g_grad"]
    problem = _shape_problem(z, total, "ReduceFromTP.forward's output")
    if problem:
        return problem
    if not _close(after, own):
        if _close(after, total):
            return ("ReduceFromTP.forward all-reduced its input IN PLACE: the caller's tensor changed (dist.all_reduce "
                    "works in place, and the caller, e.g. the row-parallel layer's autograd, may still need it); "
                    "all-reduce a copy, x.clone()")
        return "ReduceFromTP.forward changed its input x: leave it alone, all-reduce a copy (x.clone())"
    if not _close(z, total):
        if _close(z, own):
            return (f"missing all-reduce in forward of g: the output on rank {r} is only its own partial sum. Every "
                    f"rank holds a partial sum of the output (a row-parallel layer's slice of the product); g "
                    f"returns their SUM (all-reduce a copy)")
        if _close(z, total / n):
            return ("ReduceFromTP's output is the MEAN of the partial sums: g SUMS them (each is the contribution of "
                    "a different slice, not a copy); do not divide by n")
        return f"ReduceFromTP.forward should return the sum of the ranks' inputs; {_diff(z, total)}"
    problem = _shape_problem(gp, gz, "x's gradient through ReduceFromTP")
    if problem:
        return problem
    if not _close(gp, gz):
        if _close(gp, n * gz):
            return (f"x's gradient through g is {n} times too large: g's backward all-reduced the gradient too (summed "
                    f"twice). The output of g is the same on every rank and so is its gradient; g's backward is the "
                    f"identity")
        if _close(gp, gz / n):
            return f"x's gradient through g is divided by {n}: g's backward is the identity, return the gradient as it is"
        return f"x's gradient through ReduceFromTP should be the output's gradient unchanged; {_diff(gp, gz)}"
    counts = res["g_counts"]
    if counts.get("forward all_reduce", 0) != 1 or counts.get("backward all_reduce", 0):
        return (f"right values, but ReduceFromTP made {_counts_text(counts, 'forward')} in forward and "
                f"{_counts_text(counts, 'backward')} in backward: g is ONE all-reduce forward and no communication "
                f"backward (an extra all-reduce of b·s·h numbers per layer is what tensor parallelism cannot afford)")
    return None


def _mlp_reference(n):
    """The full computation with its gradients, and each rank's partial output and partial x-gradient."""
    x0, wg, wu, wd, gy = mlp_inputs()
    x, g, u, d = (t.clone().requires_grad_() for t in (x0, wg, wu, wd))
    y = mlp(x, g, u, d)
    (y * gy).sum().backward()
    partial_out, partial_gx = [], []
    for r in range(n):
        xr = x0.clone().requires_grad_()
        yr = mlp(xr, wg.chunk(n, 0)[r], wu.chunk(n, 0)[r], wd.chunk(n, 1)[r])
        (yr * gy).sum().backward()
        partial_out.append(yr.detach())
        partial_gx.append(xr.grad)
    return dict(out=y.detach(), x_grad=x.grad, gate=g.grad, up=u.grad, down=d.grad, partial_out=partial_out,
                partial_gx=partial_gx)


def compare_parallel_mlp(n, results):
    ref = _mlp_reference(n)
    for r, res in enumerate(results):
        problem = _mlp_problem(res, r, n, ref)
        if problem:
            return f"rank {r}: {problem}"
    return None


def _mlp_problem(res, r, n, ref):
    y, full = res["out"], ref["out"]
    problem = _shape_problem(y, full, "parallel_mlp's output")
    if problem:
        return problem
    if not _close(y, full):
        if _close(y, ref["partial_out"][r]):
            return (f"the output is rank {r}'s partial sum: the row-parallel down projection gives each rank the "
                    f"contribution of its i/n features only. Sum them over the ranks: g (ReduceFromTP) after the "
                    f"down projection")
        if _close(y, n * full):
            return f"the output is {n} times the right one: summed twice (g applied twice?)"
        return (f"the output is wrong; {_diff(y, full)}. Between the column-parallel gate/up and the row-parallel "
                f"down nothing is exchanged: silu and the product are elementwise, each rank applies them to its own "
                f"slice of the intermediate features")
    problem = _shape_problem(res["x_grad"], ref["x_grad"], "x's gradient")
    if problem:
        return problem + " — x must reach gate and up through f (CopyToTP), whose backward returns its gradient"
    gx = res["x_grad"]
    if not _close(gx, ref["x_grad"]):
        if _close(gx, ref["partial_gx"][r]):
            return (f"x's gradient on rank {r} is its own partial sum (the part through its slices of gate and up): "
                    f"x must enter through f (CopyToTP) before the column-parallel layers; f's backward all-reduces "
                    f"x's gradient")
        if _close(gx, n * ref["x_grad"]):
            return f"x's gradient is {n} times the right one: summed twice (f applied twice in a row?)"
        return f"x's gradient is wrong; {_diff(gx, ref['x_grad'])}"
    for key, what, full_grad, dim in (("gate_grad", "gate_w", ref["gate"], 0), ("up_grad", "up_w", ref["up"], 0),
                                      ("down_grad", "down_w", ref["down"], 1)):
        want = full_grad.chunk(n, dim)[r]
        got = res[key]
        problem = _shape_problem(got, want, f"{what}'s gradient")
        if problem:
            return problem
        if not _close(got, want):
            others = [k for k in range(n) if k != r and _close(got, full_grad.chunk(n, dim)[k])]
            if others:
                return f"{what}'s gradient is rank {others[0]}'s slice, not rank {r}'s: use the weights you were given"
            if _close(got, n * want):
                return f"{what}'s gradient is {n} times too large: its upstream gradient was summed over the ranks twice"
            return f"{what}'s gradient is wrong; {_diff(got, want)}"
    counts = res["counts"]
    fw, bw = counts.get("forward all_reduce", 0), counts.get("backward all_reduce", 0)
    others = {k: c for k, c in counts.items() if not k.endswith(" all_reduce")}
    if fw != 1 or bw != 1 or others:
        why = (" — f applied to x separately for gate and for up? Apply f once and feed its output to both"
               if bw > 1 else "")
        return (f"right values, but {fw} all-reduce(s) in forward and {bw} in backward"
                + (f" (and {others})" if others else "") + f"{why}. Megatron's MLP needs exactly one each: g forward, "
                f"f backward")
    return None


def _ce_reference(full, targets, n):
    chunks = full.chunk(n, -1)
    vl = full.shape[-1] // n
    m = full.max(-1).values
    sum_exp = (full - m[:, None]).exp().sum(-1)
    tgt = full.gather(1, targets[:, None]).squeeze(1) - m
    owner = targets // vl
    own_max = torch.stack([c.max(-1).values for c in chunks])  # [n, N]
    out = dict(losses=F.cross_entropy(full, targets, reduction="none"), softmax=full.softmax(-1), variants={})
    v = out["variants"]
    v["own max"] = [((torch.stack([(c - own_max[k][:, None]).exp().sum(-1) for k, c in enumerate(chunks)]).sum(0)).log()
                     - (full.gather(1, targets[:, None]).squeeze(1) - own_max.gather(0, owner[None]).squeeze(0)))] * n
    v["local sum"] = [(chunks[r] - m[:, None]).exp().sum(-1).log() - tgt for r in range(n)]
    v["target not summed"] = [sum_exp.log() - torch.where(owner == r, tgt, torch.zeros_like(tgt)) for r in range(n)]
    every = sum(c.gather(1, (targets % vl)[:, None]).squeeze(1) - m for c in chunks)
    clamped = sum(c.gather(1, (targets - k * vl).clamp(0, vl - 1)[:, None]).squeeze(1) - m for k, c in enumerate(chunks))
    v["target everywhere"] = [sum_exp.log() - every] * n
    v["target clamped"] = [sum_exp.log() - clamped] * n
    column0 = sum(c.gather(1, torch.where(owner == k, targets - k * vl, 0)[:, None]).squeeze(1) - m
                  for k, c in enumerate(chunks))  # the mask used for the index, not for the logit
    v["target unmasked"] = [sum_exp.log() - column0] * n
    out["softmax_variants"] = {"local": [c.softmax(-1) for c in chunks],
                               "local sum": [(c - m[:, None]).exp() / (c - m[:, None]).exp().sum(-1, keepdim=True)
                                             for c in chunks],
                               "unnormalised": [(c - m[:, None]).exp() for c in chunks],
                               "own max": [(c - own_max[k][:, None]).exp() / sum_exp[:, None] for k, c in enumerate(chunks)]}
    return out


CE_VARIANTS = {
    "own max": "matches using each rank's OWN row maximum: the ranks' exponentials are then scaled differently "
               "(each by e^-(its own max)) and adding them is meaningless. All-reduce the row max with op=dist.ReduceOp.MAX first",
    "local sum": "matches log of THIS rank's sum of exponentials: the softmax's denominator covers the whole "
                 "vocabulary; all-reduce sum_exp",
    "target not summed": "the target's logit is only known to the rank whose columns hold it: on the others it "
                         "counts as 0 here. All-reduce it (a sum: the owner contributes it, every other rank 0)",
    "target everywhere": "every rank added a logit for the target (targets % (n_vocab/n)?): only the rank whose columns "
                         "hold it (lo <= target < lo + n_vocab/n) contributes it; mask the others to 0 before the all-reduce",
    "target clamped": "every rank added a logit for the target (clamped index?): only the rank whose columns hold it "
                      "(lo <= target < lo + n_vocab/n) contributes it; mask the others to 0 before the all-reduce",
    "target unmasked": "the ranks that do not hold a row's target added their column 0's logit to it (the index was "
                       "masked to 0, the logit was not): set their contribution to 0 before the all-reduce",
}
SOFTMAX_VARIANTS = {
    "local": "this rank's columns were normalised by their own sum (a local softmax): divide exp(z - m) by the "
             "all-reduced sum over the whole vocabulary",
    "local sum": "exp(z - m) divided by this rank's own sum of exponentials: divide by the all-reduced sum over the "
                 "whole vocabulary (in a row whose maximum lives on another rank, this rank's sum is 0: nan)",
    "unnormalised": "these are exp(z - m), never divided by sum_exp",
    "own max": "exp(z - m_r) with this rank's own maximum: use the all-reduced (global) m",
}


def compare_vocab_parallel_cross_entropy(n, results):
    full, targets, w = ce_inputs()
    ref = _ce_reference(full, targets, n)
    onehot = F.one_hot(targets, VOCAB).to(full.dtype)
    grad = (ref["softmax"] - onehot) * w[:, None]
    for r, res in enumerate(results):
        problem = _ce_problem(res, r, n, ref, grad)
        if problem:
            return f"rank {r}: {problem}"
    return None


def _ce_problem(res, r, n, ref, grad):
    if "returned" in res:
        return f"returned {res['returned']}; expected a pair (losses [T], softmax [T, n_vocab/n]) of tensors"
    losses, softmax = res["losses"], res["softmax"]
    want = ref["losses"]
    if losses.shape != want.shape:
        extra = " (a mean? return one loss per token)" if losses.dim() == 0 else ""
        return f"losses has shape {list(losses.shape)}, expected [{N_TOK}] (one per token){extra}"
    if not _close(losses, want):
        for variant, why in CE_VARIANTS.items():
            if _close(losses, ref["variants"][variant][r]):
                return f"losses wrong — {why}"
        bad = (~torch.isfinite(losses)).nonzero().flatten().tolist()
        if bad and losses[bad[0]] != float("-inf"):
            return (f"losses {losses[bad[0]].item()} in row {bad[0]}, whose largest logit is 120: exp overflowed. "
                    f"Subtract the row maximum over the WHOLE vocabulary (all-reduce MAX) before exponentiating")
        if bad:
            return (f"losses -inf in row {bad[0]}: the log of a sum of exponentials that is 0. That row's largest "
                    f"logit (120) is in another rank's columns, so this rank's exp(z - m) are all 0: only the sum "
                    f"over ALL ranks' columns is right (all-reduce sum_exp)")
        return f"losses wrong; {_diff(losses, want)}"
    want_sm = ref["softmax"].chunk(n, -1)[r]
    problem = _shape_problem(softmax, want_sm, "softmax (this rank's columns)")
    if problem:
        return problem
    if not _close(softmax, want_sm):
        for variant, why in SOFTMAX_VARIANTS.items():
            if _close(softmax, ref["softmax_variants"][variant][r]):
                return f"softmax wrong — {why}"
        others = [k for k in range(n) if k != r and _close(softmax, ref["softmax"].chunk(n, -1)[k])]
        if others:
            return f"softmax holds rank {others[0]}'s columns, not rank {r}'s"
        return f"softmax wrong; {_diff(softmax, want_sm)}"
    want_g = grad.chunk(n, -1)[r]
    if res["grad"] is None or not _close(res["grad"], want_g):
        return "the logits' gradient (softmax - one_hot(target)) is wrong although losses and softmax are right"
    counts = res["counts"]
    fw = counts.get("forward all_reduce", 0)
    others = {k: c for k, c in counts.items() if not k.endswith(" all_reduce") or k.startswith("backward")}
    if fw != 3 or others:
        return (f"right values, but {_counts_text(counts, 'forward')} in forward"
                + (f" and {_counts_text(counts, 'backward')} in backward" if others else "")
                + ": three all-reduces of T numbers (max, sum of exponentials, target logit), never the logits")
    return None


def compare_partition(n, results):
    x = partition_input()
    for r, res in enumerate(results):
        problem = _piece_problem(res, r, n, x) or _rebuild_problem(res, r, n, x)
        if problem:
            return f"rank {r}: {problem}"
    return None


DIM_NAMES = {0: "dim 0, the batch", 1: "dim 1, the sequence"}


def _piece_problem(res, r, n, x):
    piece, want = res["piece"], x.chunk(n, -1)[r]
    if not _close(res["x_after"], x):
        return "keep_my_piece changed x in place: the layer input must stay as it was (the forward still uses it)"
    for dim, name in DIM_NAMES.items():  # the right size of data, cut along the wrong dimension
        if x.shape[dim] % n == 0 and _close(piece, x.chunk(n, dim)[r]):
            return (f"keep_my_piece cut {name}: the piece is the hidden columns, dim -1, [r·h/n, (r+1)·h/n) (tp "
                    f"divides h always; the sequence need not divide)")
    if _close(piece, x.reshape(-1).chunk(n)[r]):
        return ("keep_my_piece kept a flat 1/n of x (what Megatron-LM does); here the piece is the hidden columns "
                "[b, s, h/n], dim -1")
    problem = _shape_problem(piece, want, "keep_my_piece's piece")
    if problem:
        return problem
    if not _close(piece, want):
        other = next((k for k in range(n) if _close(piece, x.chunk(n, -1)[k])), None)
        if other is not None:
            return (f"keep_my_piece kept rank {other}'s columns [{other * PH // n}, {(other + 1) * PH // n}); rank {r} "
                    f"keeps [{r * PH // n}, {(r + 1) * PH // n}): index by dist.get_rank(group)")
        return f"keep_my_piece's piece is wrong: {_diff(piece, want)}"
    if res["shares"]:
        return ("keep_my_piece returned a view of x: it shares x's storage, so keeping it keeps all of x alive and "
                "saves nothing; return a copy (.clone())")
    if any(k.startswith("forward") for k in res["counts"]):
        return (f"keep_my_piece called {_counts_text(res['counts'], 'forward')}: every rank already holds x, keeping "
                f"a piece needs no communication")
    return None


def _rebuild_problem(res, r, n, x):
    got, pieces = res["rebuilt"], x.chunk(n, -1)
    if _close(got, torch.cat(pieces, 0)):
        return ("rebuild_input stacked the pieces along dim 0 (the batch), as all_gather_into_tensor does: they are "
                "columns, concatenate them along the last dim (torch.cat(parts, dim=-1))")
    problem = _shape_problem(got, x, "rebuild_input's output")
    if problem:
        return problem
    if not _close(got, x):
        blocks = got.chunk(n, -1)
        holders = [next((k for k in range(n) if _close(b, pieces[k])), None) for b in blocks]
        wrong = next((j for j, k in enumerate(holders) if k is not None and k != j), None)
        if wrong is not None:
            return (f"columns [{wrong * PH // n}, {(wrong + 1) * PH // n}) hold rank {holders[wrong]}'s piece, they "
                    f"belong to rank {wrong}: put the pieces in rank order (all_gather's list is in rank order)")
        return f"rebuild_input's output is wrong: {_diff(got, x)}"
    counts = {k.split()[1]: c for k, c in res["counts"].items() if k.startswith("backward")}
    if counts not in ({"all_gather": 1}, {"all_gather_into_tensor": 1}):
        return (f"rebuild_input called {_counts_text(res['counts'], 'backward')}: one all-gather is enough (each rank "
                f"receives the n-1 pieces it lacks)")
    return None


COMPARE = {"f_and_g": compare_f_and_g, "parallel_mlp": compare_parallel_mlp,
           "vocab_parallel_cross_entropy": compare_vocab_parallel_cross_entropy, "partition": compare_partition}
SUCCESS = {"f_and_g": "outputs and input gradients of f and g equal the unsharded ones on every rank; f: one "
                      "all-reduce backward, g: one forward",
           "parallel_mlp": f"output, x's gradient and every weight slice's gradient equal the unsharded MLP's "
                           f"(b={B}, s={S}, h={H}, h_ff={I}); one all-reduce forward, one backward",
           "vocab_parallel_cross_entropy": f"per-token losses, softmax columns and the logits' gradient equal "
                                           f"F.cross_entropy on the full [{N_TOK}, {VOCAB}] logits (one logit of 120: "
                                           f"no overflow); three all-reduces of T numbers",
           "partition": f"each rank keeps a copy of its hidden columns of the [{PB}, {PS}, {PH}] input (no "
                        f"communication), and rebuild_input gives every rank the whole input with one all-gather"}


# ------------------------------------------------------------------------------------------- the puzzle
def _lesson():
    sys.path.insert(0, str(HERE.parent))
    import _common

    return _common.load_lesson("05_tensor_parallel")


def _mistakes(L):
    """Planners that make one classic mistake each, with what to tell a learner whose answers match theirs."""
    mc, s, G, MiB = L.puzzle_model(), L.PUZZLE["seq_len"], L.PUZZLE["global_batch"], L.MiB
    states = {t: sum(L.rank_state_bytes(mc, t).values()) for t in L.valid_tps(mc)}

    def planner(held=lambda t, sp, b: L.rank_bytes(mc, t, sp, b), allowed=lambda t, sp, b: True,
                key=lambda x: (x[0], -x[2], x[1])):
        return lambda budget: min((x for x in L.layouts(mc) if allowed(*x) and held(*x) <= budget * MiB),
                                  key=key, default=None)

    return {
        "every micro-batch": (planner(held=lambda t, sp, b: states[t] + L.activation_bytes(mc, s, G, t, sp)),
                              f"you counted the activations of all {G} sequences of the step; with gradient "
                              f"accumulation only ONE micro-batch's are alive at a time (each is freed in its "
                              f"backward), so a smaller micro-batch is the cheap way to fit"),
        "tp before accumulation": (planner(key=lambda x: (-x[2], x[0], x[1])),
                                   "you raised tp to keep a large micro-batch; accumulating smaller micro-batches "
                                   "fits too and costs far less than tp's blocking collectives: fewest tp ranks first"),
        "sp always": (planner(allowed=lambda t, sp, b: sp or t == 1),
                      "sp is not free memory here: at tp=2 ours keeps MORE activations than tp alone (each "
                      "projection's own copy of the gathered input, section 4b); turn it on only when it is what "
                      "makes a larger micro-batch fit"),
        "never sp": (planner(allowed=lambda t, sp, b: not sp),
                     "at tp=4, sp's smaller norms save just enough for a larger micro-batch: when sp is what makes "
                     "it fit, it beats halving the micro-batch"),
        "states only": (planner(held=lambda t, sp, b: states[t]),
                        "you left out the activations: a rank holds its model states AND one micro-batch's "
                        "activations (lesson.activation_bytes)"),
        "activations only": (planner(held=lambda t, sp, b: L.activation_bytes(mc, s, b, t, sp)),
                             "you left out the model states: parameters, gradients and AdamW's moments "
                             "(lesson.rank_state_bytes), 16 bytes per parameter a rank holds"),
    }


def _describe(x):
    return "None (nothing fits)" if x is None else f"tp={x[0]}{' + sp' if x[1] else ''}, micro-batch {x[2]}"


def _plan_problem(L, got, budget, answers, mistakes):
    """What is wrong with `got` for `budget` (None if it is the fastest layout that fits), from the formulas."""
    mc, G, MiB = L.puzzle_model(), L.PUZZLE["global_batch"], L.MiB
    best = L.best_plan(budget, mc)

    def held(x):
        return f"{L.rank_bytes(mc, *x) / MiB:.2f} MiB per rank"

    if got is not None and not (isinstance(got, tuple) and len(got) == 3 and isinstance(got[0], int)):
        return f"plan({budget}) returned {got!r}; return (tp, sp, micro_batch_size), or None when nothing fits"
    if got == best:
        return None
    if got is None:
        why = f"{_describe(best)} fits: {held(best)}"
    elif L.tp_problem(mc, got[0]) or (got[1] and got[0] == 1) or G % got[2]:
        why = (L.tp_problem(mc, got[0]) or ("sp needs tp >= 2" if got[1] and got[0] == 1 else
               f"micro_batch_size {got[2]} does not divide the global batch of {G} sequences"))
    elif L.rank_bytes(mc, *got) > budget * MiB:
        act = L.activation_bytes(mc, L.PUZZLE["seq_len"], got[2], got[0], got[1])
        why = (f"needs {held(got)} (model states {(L.rank_bytes(mc, *got) - act) / MiB:.2f} + one "
               f"micro-batch's activations {act / MiB:.2f}) > {budget} MiB")
    elif best is None:
        why = "nothing fits: even the smallest layout needs " + held(min(L.layouts(mc), key=lambda x: L.rank_bytes(mc, *x)))
    else:
        why = (f"fits ({held(got)}), but {_describe(best)} fits too ({held(best)}) and is faster: "
               + ("fewer tp ranks" if best[0] < got[0] else "a larger micro-batch" if best[2] > got[2] else
                  "sp off costs fewer calls" if got[1] else "sp lets the larger micro-batch fit"))
    match = [m for m, (fn, _) in mistakes.items() if all(fn(b) == a for b, a in answers.items())]
    return f"plan({budget}) = {_describe(got)}: {why}" + (f" — {mistakes[match[0]][1]}" if match else "")


def _plan_step(tp, sp, micro_batch_size):
    """On each of tp ranks: one real training step of the layout; the bytes this rank holds (model states after
    the step, and the activations the step schedule counted for one micro-batch)."""
    from picotron.mesh import Mesh

    L = _lesson()
    cfg = L.make_cfg(L.PUZZLE["size"], tp=tp, sp=sp, seq_len=L.PUZZLE["seq_len"], micro_batch_size=micro_batch_size,
                     grad_acc=L.PUZZLE["global_batch"] // micro_batch_size)
    v = L.Variant("plan", cfg, Mesh.init(tp=tp))
    v.step(1, record=False)
    return sum(v.states.values()) + v.activation_bytes


def check_plan(path, report, timeout_s):
    what, L = EXERCISES["plan"], _lesson()
    try:
        fn = load(path, "ex05").plan
        answers = {}
        for budget in L.PUZZLE["budgets_mib"]:
            x = fn(budget)
            answers[budget] = (int(x[0]), bool(x[1]), int(x[2])) if isinstance(x, (tuple, list)) and len(x) == 3 else x
    except Exception as e:  # noqa: BLE001 - any bug in the learner's code is a failed check
        report.fail(what, f"{type(e).__name__}: {e}{where(e, path)}")
        return
    mistakes = _mistakes(L)
    for budget, got in answers.items():
        problem = _plan_problem(L, got, budget, answers, mistakes)
        if problem:
            return report.fail(what, problem)
    measured = []
    for budget, x in answers.items():
        if x is not None and x[0] > 1:  # the answers that need several processes: one real step each
            try:
                held = run_on_ranks(_plan_step, x[0], *x, timeout_s=max(timeout_s, 180))
            except (RankError, RankTimeout) as e:
                return report.fail(what, f"the real step of {_describe(x)} failed: {str(e).splitlines()[0]}")
            want = L.rank_bytes(L.puzzle_model(), *x)
            if max(held) > budget * L.MiB or max(abs(h / want - 1) for h in held) > 0.005:
                return report.fail(what, f"one real step of {_describe(x)} held {max(held) / L.MiB:.2f} MiB on its "
                                         f"fullest rank, the formula says {want / L.MiB:.2f}, the budget is {budget}")
            measured.append(f"{_describe(x)} held {max(held) / L.MiB:.2f} MiB on its fullest rank (<= {budget})")
    report.ok(what, ": the fastest layout that fits, for all budgets (" + "; ".join(
        f"{b} MiB: {_describe(x)}" for b, x in answers.items()) + "); one real step each: " + "; ".join(measured))


# ------------------------------------------------------------------------------------- async TP's ring order
RING_SIZES = (2, 3, 4, 8)


def _ring_problem(got, rank, n):
    """What is wrong with ring_steps(rank, n) == got (None if it is the all-gather-matmul's order)."""
    right, left = (rank + 1) % n, (rank - 1) % n
    call = f"ring_steps({rank}, {n})"
    if not isinstance(got, (list, tuple)) or len(got) != n or not all(
            isinstance(t, (list, tuple)) and len(t) == 3 for t in got):
        return f"{call} returned {got!r}; return {n} tuples (chunk, send_to, recv_from), one per step"
    chunks = [int(t[0]) for t in got]
    if chunks[0] != rank:
        return (f"{call}: at step 0 rank {rank} multiplies chunk {chunks[0]}, but it holds only its own chunk, "
                f"{rank}, then: the first matmul starts before anything has arrived")
    if n > 2 and chunks[1] == right:
        return (f"{call}: at step 1 rank {rank} multiplies chunk {right}, its RIGHT neighbour's; chunks travel to the "
                f"right, so what arrives comes from the left: chunk {left} (step i: chunk (rank - i) mod n)")
    if sorted(chunks) != list(range(n)):
        twice = sorted({c for c in chunks if chunks.count(c) > 1})
        missing = sorted(set(range(n)) - set(chunks))
        return f"{call}: rank {rank} multiplies chunk(s) {twice} more than once and never {missing}"
    for i, (chunk, to, frm) in enumerate(got):
        if i == n - 1:
            if to is not None or frm is not None:
                return (f"{call}: the last step still sends to {to} / receives from {frm}; by then every rank has "
                        f"every chunk: {n - 1} messages, not {n} (an extra send nobody receives hangs on NCCL)")
            continue
        if to != right:
            return (f"{call}: at step {i} rank {rank} sends to {to}; chunks travel one way around the ring, to the "
                    f"right neighbour, {right}")
        if frm != left:
            return (f"{call}: at step {i} rank {rank} receives from {frm}; its next chunk comes from its left "
                    f"neighbour, {left}, the rank that sends to it")
        if chunk != (rank - i) % n:
            return (f"{call}: at step {i} rank {rank} multiplies chunk {chunk}, but what it holds then is what its "
                    f"left neighbour held at step {i - 1}: chunk {(rank - i) % n}")
    return None


def check_ring(path, report):
    what = EXERCISES["ring"]
    try:
        fn = load(path, "ex05").ring_steps
        for n in RING_SIZES:
            for rank in range(n):
                problem = _ring_problem(fn(rank, n), rank, n)
                if problem:
                    return report.fail(what, problem)
    except Exception as e:  # noqa: BLE001 - any bug in the learner's code is a failed check
        return report.fail(what, f"{type(e).__name__}: {e}{where(e, path)}")
    report.ok(what, f": every rank multiplies its own chunk first, then what its left neighbour passes on, sends "
                    f"to its right, {'/'.join(map(str, RING_SIZES))} ranks: each chunk once, n - 1 messages")


def check_one(name, path, report, timeout_s):
    if name == "plan":
        return check_plan(path, report, timeout_s)
    if name == "ring":
        return check_ring(path, report)
    on_ranks(lambda n: f"{EXERCISES[name]} on {n} ranks", WORLD_SIZES[name],
             lambda n: run_on_ranks(_on_rank, n, str(path), name, str(SOLUTIONS), timeout_s=timeout_s),
             lambda n, results: (COMPARE[name](n, results), f": {SUCCESS[name]}"), report, path, timeout_s)


check, main = entry_points("Check lesson 05's exercises (on 2 and 4 processes).", EXERCISES, check_one,
                           LEARNER, SOLUTIONS, TIMEOUT_S, "ex05")


if __name__ == "__main__":
    sys.exit(main())
