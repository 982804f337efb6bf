"""Checker for lesson 11's exercises.

    ./run.sh python lessons/11_precision_and_kernels/check.py [name ...] [--solutions | --module my.py]
(what each option does, and the call from the notebook: lessons/_checker.py.) Everything runs in this process.

online_softmax_attention: float64 inputs against softmax(q kᵀ/√d) v and logsumexp computed whole, for block sizes
from 1 to more than the keys (a last block shorter than the others); scores around ±1000 as well, where exp of an
unshifted score overflows. Names the case, the block size and the first wrong row, and recognises the accumulator
or the running sum not rescaled when the max grows, a missing final division, lse without its max, and exp of
unshifted scores.
update: sequences of steps with and without overflows (growth_interval 3, and the defaults), each step given the
right state, against picotron.precision.LossScaler; names the first wrong step and recognises a count of clean steps
that an overflow (or a growth) does not reset, growth one step late or early, growth and backoff swapped, and a
skip decision inverted.
quantize_e4m3: small, large, outlier, all-zero and 3-D tensors against picotron.fp8.quantize; names the tensor and
the first wrong element, and recognises a scale upside down, E5M2's maximum instead of E4M3's, an all-zero tensor
whose scale is not finite, and a result not in float8_e4m3fn.
quantize_tiles: ragged and whole tiles, an outlier token, a zero tile, tile sizes 128 and 32, against
picotron.fp8_blockwise.quantize_tiles; names the tensor and the first wrong scale or element, and recognises scales of
the wrong shape (tiles along the wrong axis, the ragged tail dropped), a scale upside down (448 / amax: that is the
per-tensor multiplier, not the dequantizing factor), a scale of the whole row or tensor instead of the tile,
E5M2's maximum, and an all-zero tile whose scale is not finite.
"""
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # lessons/: _checker, which puts the repository root on sys.path too
from _checker import entry_points, in_process  # noqa: E402

import torch  # noqa: E402

from picotron import fp8, fp8_blockwise, precision  # noqa: E402


LEARNER = HERE / "exercise.py"
SOLUTIONS = HERE / "solution.py"
TIMEOUT_S = 30.0
EXERCISES = {"online_softmax_attention": "online_softmax_attention", "update": "update",
             "quantize_e4m3": "quantize_e4m3", "quantize_tiles": "quantize_tiles"}


# ------------------------------------------------------------------------------------------ exercise 1
ATTENTION_CASES = (  # label, rows n, keys m, d, block sizes, how large q is (scores scale with it)
    ("random scores", 6, 37, 8, (1, 4, 16, 37, 64), 1.0),
    ("scores around ±1000", 6, 37, 8, (4, 16), 300.0),
)


def _attention_inputs(n, m, d, magnitude, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, d, generator=g, dtype=torch.float64) * magnitude
    k = torch.randn(m, d, generator=g, dtype=torch.float64)
    # keys that score higher and higher along the sequence, so that most blocks raise each row's running max
    k = k + torch.linspace(0, 2, m, dtype=torch.float64)[:, None] * q.mean(0) / (q.mean(0).norm() + 1e-12)
    v = torch.randn(m, d, generator=g, dtype=torch.float64)
    return q, k, v


def _blocks(q, k, v, block, rescale_acc=True, rescale_sum=True, shift=True):
    """The online softmax with chosen parts left out: the mistakes the checker recognises."""
    n, d = q.shape
    m = torch.full((n,), float("-inf"), dtype=q.dtype)
    l = torch.zeros(n, dtype=q.dtype)
    acc = torch.zeros(n, v.shape[1], dtype=q.dtype)
    for j in range(0, k.shape[0], block):
        s = q @ k[j:j + block].t() / math.sqrt(d)
        m_new = torch.maximum(m, s.amax(dim=1)) if shift else torch.zeros(n, dtype=q.dtype)
        p = torch.exp(s - m_new[:, None])
        r = torch.exp(m - m_new) if shift else torch.ones(n, dtype=q.dtype)
        l = (r if rescale_sum else 1) * l + p.sum(dim=1)
        acc = (r[:, None] if rescale_acc else 1) * acc + p @ v[j:j + block]
        m = m_new
    return acc, l, m


ATTENTION_MISTAKES = (
    (dict(rescale_acc=False), lambda acc, l, m: acc / l[:, None],
     "the running output acc is not rescaled by exp(μ − μ') when a block raises the max: the earlier blocks keep "
     "weights computed against an older, smaller max"),
    (dict(rescale_sum=False), lambda acc, l, m: acc / l[:, None],
     "the running sum l is not rescaled by exp(μ − μ') when a block raises the max (acc is): the normaliser mixes "
     "terms computed against different maxima"),
    (dict(rescale_acc=False, rescale_sum=False), lambda acc, l, m: acc / l[:, None],
     "neither acc nor l is rescaled by exp(μ − μ') when a block raises the max"),
    ({}, lambda acc, l, m: acc, "the output is acc without the final division by the running sum l"),
)


def _attention_problem(fn, path):
    for label, n, m, d, blocks, magnitude in ATTENTION_CASES:
        q, k, v = _attention_inputs(n, m, d, magnitude)
        s = q @ k.t() / math.sqrt(d)
        want_out, want_lse = torch.softmax(s, dim=1) @ v, torch.logsumexp(s, dim=1)
        for block in blocks:
            head = f"{label} (q [{n}, {d}], k and v [{m}, {d}]), block {block}"
            got = fn(q.clone(), k.clone(), v.clone(), block)
            if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(torch.is_tensor(t) for t in got)):
                return f"{head}: returned {type(got).__name__}; return (out, lse), two tensors"
            out, lse = got
            if tuple(out.shape) != (n, d) or tuple(lse.reshape(-1).shape) != (n,):
                return f"{head}: shapes {tuple(out.shape)} and {tuple(lse.shape)}, expected ({n}, {d}) and ({n},)"
            out, lse = out.double(), lse.double().reshape(-1)
            if not bool(torch.isfinite(out).all()):
                i = int((~torch.isfinite(out)).any(1).nonzero()[0])
                hint = ""
                if magnitude > 1:
                    hint = (f": the scores reach {float(s.abs().max()):.0f}, and exp(s) overflows float64 above "
                            f"~709: subtract the running max μ before exp (exp(s − μ) ≤ 1)")
                return f"{head}: row {i} of out is {out[i, :3].tolist()}...{hint}"
            if not torch.allclose(out, want_out, rtol=1e-9, atol=1e-12):
                i = int((~torch.isclose(out, want_out, rtol=1e-9, atol=1e-12)).any(1).nonzero()[0])
                j = int((~torch.isclose(out[i], want_out[i], rtol=1e-9, atol=1e-12)).nonzero()[0])
                hint = ""
                for kw, finish, why in ATTENTION_MISTAKES:
                    wrong = finish(*_blocks(q, k, v, block, **kw))
                    if torch.allclose(out, wrong, rtol=1e-9, atol=1e-12):
                        hint = f": {why}"
                        break
                return (f"{head}: row {i}: out[{i}, {j}] = {out[i, j].item():.6g}, expected "
                        f"{want_out[i, j].item():.6g}{hint}")
            if not torch.allclose(lse, want_lse, rtol=1e-9, atol=1e-9):
                i = int((~torch.isclose(lse, want_lse, rtol=1e-9, atol=1e-9)).nonzero()[0])
                _, l, mx = _blocks(q, k, v, block)
                hint = ": lse = μ + log(l), the running max μ added back" if math.isclose(
                    lse[i].item(), math.log(l[i].item()), rel_tol=1e-9) and mx[i] != 0 else ""
                return f"{head}: row {i}: lse = {lse[i].item():.6g}, expected {want_lse[i].item():.6g}{hint}"
    return None


# ------------------------------------------------------------------------------------------ exercise 2
SEQUENCES = (  # label, growth_interval (None: the defaults), starting scale, overflow flags step by step
    ("sequence A (growth_interval 3)", 3, 2.0 ** 16,
     [False, False, False, False, True, False, False, True, True, False, False, False, False, False, False, False]),
    ("sequence B (the defaults: growth_interval 2000)", None, 2.0 ** 30,
     [True] * 5 + [False] * 1996 + [True] + [False] * 2001),
)


def _variants(scale, clean, overflow, interval, growth=2.0, backoff=0.5):
    """(what the mistake returns, why) for the mistakes the checker recognises, from one state."""
    out = []
    if overflow:
        out.append(((scale * backoff, clean, True), "an overflow resets the count of clean steps to 0"))
        out.append(((scale * backoff, clean + 1, True), "an overflow resets the count of clean steps to 0 (it is no "
                                                        "clean step)"))
        out.append(((scale * growth, 0, True), "on an overflow S shrinks (times backoff_factor 0.5), it does not grow"))
        out.append(((scale * backoff, 0, False), "an overflowing step must be skipped: its gradients hold inf or NaN"))
        out.append(((scale, 0, True), "an overflow must halve S (times backoff_factor), or the next step overflows "
                                      "again"))
    else:
        c = clean + 1
        if c == interval:
            out.append(((scale, c, False), f"S grows on the clean step that makes {interval} in a row: when the count "
                                           f"reaches growth_interval (==), not when it exceeds it"))
            out.append(((scale * growth, c, False), "after growing S the count of clean steps starts again from 0"))
        if c == interval - 1:
            out.append(((scale * growth, 0, False), f"S grew after {c} clean steps, one early: grow when the count "
                                                    f"reaches growth_interval = {interval}"))
        out.append(((scale, c, True), "a clean step is not skipped (only an overflow is)"))
        out.append(((scale * backoff, 0, False), "a clean step does not shrink S"))
    return out


def _update_problem(fn, path):
    for label, interval, start, flags in SEQUENCES:
        ref = precision.LossScaler(start, growth_interval=interval or 2000)
        for step, overflow in enumerate(flags, 1):
            scale, clean = ref.scale, ref.clean_steps
            got = fn(scale, clean, overflow) if interval is None else fn(scale, clean, overflow, growth_interval=interval)
            ref.update(overflow)
            want = (ref.scale, ref.clean_steps, overflow)
            head = (f"{label}, step {step} (overflow={overflow}, from S = 2^{math.log2(scale):g} after {clean} clean "
                    f"step{'s' if clean != 1 else ''})")
            if not (isinstance(got, (tuple, list)) and len(got) == 3):
                return f"{head}: returned {got!r}; return (scale, clean_steps, skip)"
            got = (float(got[0]), int(got[1]), bool(got[2]))
            if got != (float(want[0]), want[1], want[2]):
                hint = next((f": {why}" for wrong, why in _variants(scale, clean, overflow, interval or 2000)
                             if got == (float(wrong[0]), wrong[1], wrong[2])), "")
                return (f"{head}: returned (scale 2^{math.log2(got[0]) if got[0] > 0 else float('nan'):g}, clean_steps "
                        f"{got[1]}, skip {got[2]}), expected (scale 2^{math.log2(want[0]):g}, clean_steps {want[1]}, "
                        f"skip {want[2]}){hint}")
    return None


# ------------------------------------------------------------------------------------------ exercise 3
def _tensors():
    g = torch.Generator().manual_seed(0)
    outlier = torch.randn(64, 32, generator=g) * 0.1
    outlier[7, 3] = 1e4
    return (("randn × 0.01 [64, 32]", torch.randn(64, 32, generator=g) * 0.01),
            ("randn × 1000 [64, 32]", torch.randn(64, 32, generator=g) * 1000),
            ("an outlier of 1e4 among randn × 0.1 [64, 32]", outlier),
            ("an activation-like [2, 8, 48]", torch.randn(2, 8, 48, generator=g).exp() - 1),
            ("all zeros [16]", torch.zeros(16)))


def _quantize_problem(fn, path):
    fmax4, fmax5 = torch.finfo(fp8.E4M3).max, torch.finfo(fp8.E5M2).max
    for label, t in _tensors():
        want_q, want_s = fp8.quantize(t, fp8.E4M3)
        got = fn(t.clone())
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and torch.is_tensor(got[0])):
            return f"{label}: returned {type(got).__name__}; return (t_fp8, scale)"
        q, s = got[0], float(torch.as_tensor(got[1]).float())
        amax = float(t.abs().max())
        if not math.isfinite(s):
            hint = ": floor amax at 1e-12 before dividing (picotron.fp8.AMAX_FLOOR)" if amax == 0 else ""
            return f"{label}: scale = {s}{hint}"
        if not math.isclose(s, float(want_s), rel_tol=1e-6):
            hint = ""
            if amax > 0 and math.isclose(s, amax / fmax4, rel_tol=1e-6):
                hint = ": the scale is upside down: fmax / amax maps the largest |t| onto 448, amax / fmax onto ~0"
            elif amax > 0 and math.isclose(s, fmax5 / amax, rel_tol=1e-6):
                hint = f": {fmax5:g} is E5M2's largest number; E4M3's (torch.finfo(torch.float8_e4m3fn).max) is {fmax4:g}"
            return f"{label}: scale = {s:.6g}, expected {float(want_s):.6g}{hint}"
        if q.dtype != fp8.E4M3:
            return f"{label}: t_fp8 has dtype {q.dtype}; cast to torch.float8_e4m3fn"
        if tuple(q.shape) != tuple(t.shape):
            return f"{label}: t_fp8 has shape {tuple(q.shape)}, expected {tuple(t.shape)}"
        a, b = q.float().reshape(-1), want_q.float().reshape(-1)
        if not torch.equal(a, b):
            i = int((a != b).nonzero()[0])
            idx = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), t.shape))
            return (f"{label}: element {idx} (t = {t.reshape(-1)[i].item():.6g}) quantized to {a[i].item():g}, "
                    f"expected {b[i].item():g} (t·scale = {t.reshape(-1)[i].item() * float(want_s):.6g})")
    return None


# ------------------------------------------------------------------------------------------ exercise 4
def _tile_tensors():
    g = torch.Generator().manual_seed(1)
    outlier = torch.randn(6, 256, generator=g)
    outlier[2] *= 1e5  # a 'massive activation': one token far above the others
    zeros = torch.randn(4, 200, generator=g)
    zeros[1, 128:] = 0  # an all-zero tile (the ragged one)
    return (("randn [8, 300] (tiles of 128, 128 and 44)", torch.randn(8, 300, generator=g), 128),
            ("an outlier token × 1e5 in randn [6, 256]", outlier, 128),
            ("randn [4, 200] with a zero tile", zeros, 128),
            ("randn × 1e-3 [5, 96], tile 32", torch.randn(5, 96, generator=g) * 1e-3, 32))


def _tiles_problem(fn, path):
    fmax4, fmax5 = torch.finfo(fp8.E4M3).max, torch.finfo(fp8.E5M2).max
    for label, x, tile in _tile_tensors():
        want_q, want_d = fp8_blockwise.quantize_tiles(x, tile)
        got = fn(x.clone(), tile=tile)
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(torch.is_tensor(t) for t in got)):
            return f"{label}: returned {type(got).__name__}; return (x_fp8, scales), two tensors"
        q, d = got
        rows, cols = x.shape
        if tuple(d.shape) != tuple(want_d.shape):
            hint = ""
            if tuple(d.shape) == (-(-rows // tile), cols):
                hint = ": the tiles run along the rows' axis; a 1 × tile tile is one row's `tile` consecutive columns"
            elif tuple(d.shape) == (rows, cols // tile):
                hint = f": the last {cols % tile} columns form a shorter tile of their own: ⌈C / tile⌉, not C // tile"
            elif d.numel() in (1, rows):
                hint = ": one scale per tile, not per tensor or per row"
            return f"{label}: scales have shape {tuple(d.shape)}, expected {tuple(want_d.shape)} (rows, ⌈C / tile⌉){hint}"
        d = d.float()
        if not torch.isfinite(d).all():
            return f"{label}: a scale is {float(d[~torch.isfinite(d)][0])}: floor amax at 1e-12 before dividing"
        bad = ~torch.isclose(d, want_d, rtol=1e-6, atol=0)
        if bad.any():
            r, j = (int(v) for v in bad.nonzero()[0])
            part = x[r, j * tile:(j + 1) * tile]
            amax, got_d, hint = float(part.abs().max()), float(d[r, j]), ""
            if amax == 0 and got_d == 0:
                hint = ": this tile is all zeros; floor amax at 1e-12 before dividing, or x / d is 0 / 0 = NaN"
            elif amax > 0 and math.isclose(got_d, fmax4 / amax, rel_tol=1e-6):
                hint = (": the scale is upside down: d = amax / 448 is the dequantizing factor (x ≈ x_fp8 · d), "
                        "448 / amax the per-tensor multiplier of exercise 3")
            elif amax > 0 and math.isclose(got_d, amax / fmax5, rel_tol=1e-6):
                hint = f": {fmax5:g} is E5M2's largest number; E4M3's is {fmax4:g}"
            elif math.isclose(got_d, float(x[r].abs().max()) / fmax4, rel_tol=1e-6) or math.isclose(
                    got_d, float(x.abs().max()) / fmax4, rel_tol=1e-6):
                hint = ": that is the amax of the whole row (or tensor); each tile takes the amax of its own elements"
            return (f"{label}: row {r}, tile {j} (columns {j * tile}..{min((j + 1) * tile, cols) - 1}): scale "
                    f"{got_d:.6g}, expected amax / 448 = {float(want_d[r, j]):.6g}{hint}")
        if q.dtype != fp8.E4M3:
            return f"{label}: x_fp8 has dtype {q.dtype}; cast to torch.float8_e4m3fn"
        if tuple(q.shape) != tuple(x.shape):
            return f"{label}: x_fp8 has shape {tuple(q.shape)}, expected {tuple(x.shape)}"
        a, b = q.float(), want_q.float()
        if not torch.equal(a, b):
            r, c = (int(v) for v in (a != b).nonzero()[0])
            return (f"{label}: element ({r}, {c}) (x = {x[r, c].item():.6g}) quantized to {a[r, c].item():g}, "
                    f"expected {b[r, c].item():g} (x / d = {x[r, c].item() / float(want_d[r, c // tile]):.6g})")
    return None


SUCCESS = {
    "online_softmax_attention": f": {sum(len(c[4]) for c in ATTENTION_CASES)} block sizes over "
                                f"{len(ATTENTION_CASES)} cases (scores up to ±1000) equal softmax(q kᵀ/√d) v and logsumexp",
    "update": f": {sum(len(s[3]) for s in SEQUENCES):,} steps of {len(SEQUENCES)} sequences equal LossScaler's",
    "quantize_e4m3": f": {len(_tensors())} tensors equal picotron.fp8.quantize's, bit for bit",
    "quantize_tiles": f": {len(_tile_tensors())} tensors' tiles and scales equal picotron.fp8_blockwise.quantize_tiles's, "
                      f"bit for bit",
}
PROBLEMS = {"online_softmax_attention": _attention_problem, "update": _update_problem,
            "quantize_e4m3": _quantize_problem, "quantize_tiles": _tiles_problem}


def check_one(name, path, report, timeout_s):
    return in_process(name, path, report, PROBLEMS[name], SUCCESS[name], "ex11")


check, main = entry_points("Check lesson 11's exercises (in this process).", EXERCISES, check_one, LEARNER,
                           SOLUTIONS, TIMEOUT_S, "ex11")


if __name__ == "__main__":
    sys.exit(main())
