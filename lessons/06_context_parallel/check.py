"""Checker for lesson 06's exercises.

    ./run.sh python lessons/06_context_parallel/check.py [name ...] [--solutions | --module my.py] [--timeout S]
(what each option does, and the call from the notebook: lessons/_checker.py; here --timeout defaults to 30 s.)

merge (in this process, then on 2 and 3 processes): random queries, keys and values in float64, the keys cut in
two (and in three, merged one after the other); your merge of the two halves' results must equal softmax
attention over all keys, output and log-sum-exp, to 1e-10. A wrong one is compared with the usual mistakes (the
plain sum or mean of the two outputs, the max or the sum of the two lse's, the weights swapped) and the first
wrong value is named (batch, head, query). Then scores near 1000 in fp32, where e^lse is inf: the result must be
finite and right to 1e-4. Then picotron's own ring attention (`RingAttention`, zig-zag) runs on 2 and 3 real
processes with your merge in place of the library's: each rank's output must be its piece of full causal
attention; the checker names the rank that differs.

heads_send_buffer (in this process): each simulated rank's buffer goes through an all-to-all played by hand (rank
r receives block r of every buffer), lined up along the sequence as picotron's seq_to_heads does; every rank must
then hold its contiguous group of heads over the whole sequence. Named: the rank axis not first, a reshape
straight to [cp, b, H/cp, t, d] (no transpose: it cuts the batch), heads taken every cp-th (a strided group).

zigzag_positions and step_blocks (in this process): every rank of several (seq_len, cp), against the reference
layout and ring; the checker names the rank (and step) and the first wrong position or block, and says what your
answer matches instead when it is a known mistake (the contiguous layout, the chunks in the wrong order, the ring
turning the wrong way, a causal block called whole, a block from the future).

How it works: as in every multi-rank checker (lessons/_checker.py), each child runs `_on_rank` (below).
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # lessons/: _checker, which puts the repository root on sys.path too
from _checker import _Failure, entry_points, in_process, load, on_ranks, rendezvous, where  # noqa: E402

import torch  # noqa: E402

from picotron import context_parallel as cpm, hooks  # noqa: E402
from picotron.launch import run_on_ranks  # noqa: E402


LEARNER = HERE / "exercise.py"
SOLUTIONS = HERE / "solution.py"
TIMEOUT_S = 30.0
EXERCISES = {"merge": "merge", "zigzag_positions": "zigzag_positions", "step_blocks": "step_blocks",
             "heads_send_buffer": "heads_send_buffer"}
WORLD_SIZES = (2, 3)  # merge inside the real ring
LAYOUTS = ((8, 1), (8, 2), (16, 2), (24, 3), (32, 4), (48, 4))  # (seq_len, cp) for exercise 2
CPS = (1, 2, 3, 4, 5)  # for exercise 3
A2A_CASES = ((2, 8, 2, 4, 4), (2, 4, 3, 5, 2), (3, 6, 4, 3, 3), (1, 4, 2, 2, 1))  # (b, H, t, d, cp), exercise 4


def randn(seed, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ------------------------------------------------------------------------------------------ exercise 1
def attend(q, k, v):
    """Softmax attention of q [b, a, q, d] over k, v [b, a, n, d] (no mask), and the log-sum-exp of the scores."""
    s = q @ k.transpose(-2, -1)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def _mistakes(o1, l1, o2, l2):
    """The usual wrong merges, by name: (out, lse) each."""
    new = torch.logaddexp(l1, l2)
    w1, w2 = torch.exp(l1 - new).unsqueeze(-1), torch.exp(l2 - new).unsqueeze(-1)
    right = o1 * w1 + o2 * w2
    return {
        "out is the plain SUM of the two outputs: each is normalised over its own keys, so weigh each by its share "
        "of the total, e^(lse_i - L) with L = logaddexp(lse, lse_b)": (o1 + o2, None),
        "out is the plain MEAN of the two outputs: right only when both key sets have the same log-sum-exp; weigh "
        "each by e^(lse_i - L), L = logaddexp(lse, lse_b)": ((o1 + o2) / 2, None),
        "the weights are swapped: out goes with e^(lse - L), out_b with e^(lse_b - L)": (o1 * w2 + o2 * w1, None),
        "out is weighted by e^lse_i without dividing by their sum (e^(lse_i) / (e^lse + e^lse_b) = e^(lse_i - L))":
            (o1 * torch.exp(l1).unsqueeze(-1) + o2 * torch.exp(l2).unsqueeze(-1), None),
        "the new lse is max(lse, lse_b): it must be log(e^lse + e^lse_b) = torch.logaddexp(lse, lse_b), which is "
        "larger than both": (right, torch.maximum(l1, l2)),
        "the new lse is lse + lse_b: that is the log of the PRODUCT of the two sums; the union's sum of "
        "exponentials is their SUM: torch.logaddexp(lse, lse_b)": (right, l1 + l2),
    }


def _as_pair(got):
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return None, f"returned {type(got).__name__} {str(got)[:80]!r}; return the pair (out, lse)"
    o, l = got
    if not (torch.is_tensor(o) and torch.is_tensor(l)):
        return None, f"returned ({type(o).__name__}, {type(l).__name__}); return two tensors (out, lse)"
    return (o, l), None


def _first_wrong(got, want, what, shape_names=("batch", "head", "query")):
    """' what at (batch 0, head 1, query 3): got x, expected y' for the first element off, or None."""
    if got.shape != want.shape:
        return f"{what} has shape {list(got.shape)}, expected {list(want.shape)}"
    bad = ~torch.isclose(got, want, rtol=1e-10, atol=1e-10)
    if not bad.any():
        return None
    idx = [int(i) for i in bad.nonzero()[0]]
    where_ = ", ".join(f"{n} {i}" for n, i in zip(shape_names, idx))
    extra = f", element {idx[3]}" if len(idx) > 3 else ""
    return f"{what} at ({where_}{extra}): got {got[tuple(idx)].item():.6g}, expected {want[tuple(idx)].item():.6g}"


def _problem_merge(fn, path):
    b, a, nq, d = 2, 3, 5, 4
    q, k, v = randn(1, b, a, nq, d), randn(2, b, a, 16, d), randn(3, b, a, 16, d)
    o1, l1 = attend(q, k[..., :7, :], v[..., :7, :])
    o2, l2 = attend(q, k[..., 7:, :], v[..., 7:, :])
    want_o, want_l = attend(q, k, v)
    try:
        got = fn(None, None, o1.clone(), l1.clone())
    except Exception as e:  # noqa: BLE001
        if isinstance(e, NotImplementedError):
            raise
        return (f"merge(None, None, out_b, lse_b) (the ring's first block: nothing merged yet, return the block as "
                f"it is) raised {type(e).__name__}: {e}{where(e, path)}")
    got, problem = _as_pair(got)
    if problem:
        return f"merge(None, None, out_b, lse_b) (the ring's first block) {problem}"
    if not (torch.equal(got[0], o1) and torch.equal(got[1], l1)):
        return "merge(None, None, out_b, lse_b) (the ring's first block, nothing merged yet) must return (out_b, lse_b)"
    got, problem = _as_pair(fn(o1.clone(), l1.clone(), o2.clone(), l2.clone()))
    if problem:
        return problem
    o, l = got
    for name, (mo, ml) in _mistakes(o1, l1, o2, l2).items():
        if o.shape == mo.shape and torch.allclose(o, mo, rtol=1e-10, atol=1e-10) and (
                ml is None or (l.shape == ml.shape and torch.allclose(l, ml, rtol=1e-10, atol=1e-10))):
            if ml is not None or not torch.allclose(o, want_o, rtol=1e-10, atol=1e-10):
                return f"keys cut 7 + 9, float64: {name}"
    for got_, want_, what in ((o, want_o, "out"), (l, want_l, "lse")):
        wrong = _first_wrong(got_, want_, what)
        if wrong:
            return f"keys cut 7 + 9, float64: {wrong} (softmax attention over all 16 keys)"
    # three blocks, merged one after the other (what a ring of 3 does)
    parts = [attend(q, k[..., i:j, :], v[..., i:j, :]) for i, j in ((0, 3), (3, 11), (11, 16))]
    acc = (None, None)
    for ob, lb in parts:
        acc, problem = _as_pair(fn(acc[0], acc[1], ob, lb))
        if problem:
            return f"keys cut 3 + 8 + 5, merged in turn: {problem}"
    for got_, want_, what in ((acc[0], want_o, "out"), (acc[1], want_l, "lse")):
        wrong = _first_wrong(got_, want_, what)
        if wrong:
            return f"keys cut 3 + 8 + 5, merged in turn: {wrong}"
    # large scores in fp32: e^lse overflows
    qb = randn(4, 1, 2, 3, 8, dtype=torch.float32) * 0 + 1.0
    kb = torch.full((1, 2, 10, 8), 125.0) + randn(5, 1, 2, 10, 8, dtype=torch.float32)  # scores near 1000
    vb = randn(6, 1, 2, 10, 8, dtype=torch.float32)
    ref_o, ref_l = attend(qb.double(), kb.double(), vb.double())
    p1, p2 = attend(qb, kb[..., :4, :], vb[..., :4, :]), attend(qb, kb[..., 4:, :], vb[..., 4:, :])
    got, problem = _as_pair(fn(p1[0], p1[1], p2[0], p2[1]))
    if problem:
        return f"scores near 1000 (fp32): {problem}"
    o, l = got
    if not (torch.isfinite(o).all() and torch.isfinite(l).all()):
        bad = "out" if not torch.isfinite(o).all() else "lse"
        return (f"scores near 1000 (fp32): your {bad} holds inf or nan — e^lse overflows fp32 past about 88 (e^1000 "
                f"is inf, and inf / inf is nan). Never form e^lse: L = torch.logaddexp(lse, lse_b), then weigh by "
                f"e^(lse - L) and e^(lse_b - L), both at most 1")
    if not (torch.allclose(o.double(), ref_o, rtol=1e-4, atol=1e-4) and torch.allclose(l.double(), ref_l, rtol=1e-6)):
        return (f"scores near 1000 (fp32): finite but wrong: max |out - reference| "
                f"{(o.double() - ref_o).abs().max():.2e}, max |lse - reference| {(l.double() - ref_l).abs().max():.2e}")
    return None


def _scenario_ring(mod, rank, n):
    """picotron's RingAttention (zig-zag) with the learner's merge, on this rank's piece of a random sequence."""
    cpm.merge = mod.merge  # RingAttention looks `merge` up in its module at each call
    from picotron.mesh import Mesh

    with Mesh.init(cp=n) as mesh:
        q, k, v = _ring_inputs(n)
        mine = [cpm.split(t, n, rank, "zigzag", dim=2) for t in (q, k, v)]
        with torch.no_grad():
            out = cpm.RingAttention.apply(*mine, mesh.cp, "zigzag", hooks.Phases())
    return out.detach().clone()


def _ring_inputs(n):
    return randn(10, 1, 4, 8 * n, 8), randn(11, 1, 2, 8 * n, 8), randn(12, 1, 2, 8 * n, 8)


def compare_ring(n, results):
    q, k, v = _ring_inputs(n)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for r, got in enumerate(results):
        want = cpm.split(full, n, r, "zigzag", dim=2)
        if not torch.is_tensor(got) or got.shape != want.shape:
            return f"rank {r}: the ring returned {type(got).__name__}, expected a tensor of shape {list(want.shape)}"
        if not torch.allclose(got, want, rtol=1e-9, atol=1e-9):
            return (f"rank {r}: its output differs from its piece of full causal attention by up to "
                    f"{(got - want).abs().max():.2e} (the chunks {cpm.chunks_of(r, n)} of {2 * n})")
    return None


# ---------------------------------------------------------------------------------- exercises 2 and 3
def _positions_problem(fn, path):
    for s, cp in LAYOUTS:
        c = s // (2 * cp)
        for r in range(cp):
            want = cpm.positions(s, cp, r, "zigzag").tolist()
            head = f"seq_len={s}, cp={cp} (2·cp = {2 * cp} chunks of {c}), rank {r}"
            raw = fn(s, cp, r)
            try:
                got = [int(x) for x in (raw.tolist() if torch.is_tensor(raw) else raw)]
            except (TypeError, ValueError):
                return f"{head}: returned {type(raw).__name__} {str(raw)[:60]!r}, not a 1-D tensor of positions"
            if got == want:
                continue
            if len(got) != len(want):
                return (f"{head}: holds {len(got)} positions; every rank holds seq_len / cp = {len(want)}: two chunks "
                        f"of seq_len / (2·cp) = {c} tokens")
            if got == cpm.positions(s, cp, r, "contiguous").tolist():
                return (f"{head}: {_show(got)} is the CONTIGUOUS layout (chunks {2 * r} and {2 * r + 1}); zig-zag "
                        f"pairs an early and a late chunk: chunks {r} and {2 * cp - 1 - r}")
            if sorted(got) == sorted(want):
                return (f"{head}: the right positions in the wrong order: {_show(got)}; chunk {r} comes first, then "
                        f"chunk {2 * cp - 1 - r} (the order the ring's q.chunk(2) and the loader use)")
            chunks = _chunks(got, c)
            if chunks:
                return (f"{head}: your positions are chunks {chunks}, expected chunks ({r}, {2 * cp - 1 - r}) = "
                        f"{_show(want)}")
            i = next(i for i, (x, y) in enumerate(zip(got, want)) if x != y)
            return (f"{head}: local token {i} has position {got[i]}, expected {want[i]}; yours {_show(got)}, expected "
                    f"{_show(want)}")
    return None


def _chunks(pos, c):
    """The chunk indices of `pos` when it is whole chunks of c tokens, else None."""
    if not pos or len(pos) % c:
        return None
    out = []
    for i in range(0, len(pos), c):
        piece = pos[i:i + c]
        if piece[0] % c or piece != list(range(piece[0], piece[0] + c)):
            return None
        out.append(piece[0] // c)
    return tuple(out)


def _show(pos, limit=12):
    return "[" + ", ".join(map(str, pos[:limit])) + (", ...]" if len(pos) > limit else "]")


def _blocks_of(got):
    out = []
    for item in got:
        q, k, seen = item
        out.append((int(q), int(k), str(seen)))
    return out


def _blocks_problem(fn, path):
    for cp in CPS:
        for r in range(cp):
            for step in range(cp):
                want = sorted(_reference_blocks(r, step, cp))
                head = f"cp={cp}, rank {r}, ring step {step}"
                raw = fn(r, step, cp)
                try:
                    got = _blocks_of(raw)
                except (TypeError, ValueError):
                    return (f"{head}: returned {str(raw)[:60]!r}; return a list of (query chunk, key chunk, "
                            f"'all' | 'causal') tuples")
                if sorted(got) == want:
                    continue
                if len(set(got)) != len(got):
                    dup = next(b for b in got if got.count(b) > 1)
                    return f"{head}: block {dup} is listed twice"
                src = (r - step) % cp
                wrong_way = sorted(_reference_blocks(r, step, cp, src=(r + step) % cp))
                if cp > 2 and sorted(got) == wrong_way and wrong_way != want:
                    return (f"{head}: you computed with the K/V of rank {(r + step) % cp}; the ring passes blocks to "
                            f"rank + 1, so after {step} step(s) rank {r} holds the K/V of rank (r - step) mod cp = "
                            f"{src} (chunks {cpm.chunks_of(src, cp)})")
                for q, k, seen in got:
                    if k > q:
                        return (f"{head}: block (query chunk {q}, key chunk {k}) is listed ({seen!r}), but key chunk "
                                f"{k} comes after query chunk {q}: every key in it is in the future of every query: "
                                f"skip it")
                    if k == q and seen != "causal":
                        return (f"{head}: block ({q}, {k}) is a chunk against itself: 'causal' (query i sees keys "
                                f"0..i of it), not {seen!r}")
                    if k < q and seen != "all":
                        return (f"{head}: block ({q}, {k}): key chunk {k} lies wholly before query chunk {q}: 'all' "
                                f"(seen whole), not {seen!r}")
                missing = [b for b in want if b not in got]
                extra = [b for b in got if b not in want]
                if missing:
                    return (f"{head}: block {missing[0]} is missing (rank {r} holds query chunks "
                            f"{cpm.chunks_of(r, cp)} and, at this step, the K/V of rank {src}: chunks "
                            f"{cpm.chunks_of(src, cp)})")
                return (f"{head}: block {extra[0]} is not computed at this step (rank {r} holds the K/V of rank {src}: "
                        f"chunks {cpm.chunks_of(src, cp)})")
    return None


def _reference_blocks(rank, step, cp, src=None):
    src = (rank - step) % cp if src is None else src
    return [(q, k, cpm.visibility(q, k)) for q in cpm.chunks_of(rank, cp) for k in cpm.chunks_of(src, cp)
            if cpm.visibility(q, k) != "none"]


# ---------------------------------------------------------------------------------------------- exercise 4
def _a2a_problem(fn, path):
    """Every simulated rank's buffer through an all-to-all (rank r receives block r of every rank's buffer, in rank
    order), lined up along the sequence as picotron's seq_to_heads does: rank r must hold head group r, all tokens."""
    for b, h, t, d, cp in A2A_CASES:
        g = h // cp
        full = randn(20, b, h, cp * t, d)  # the whole sequence; rank r holds tokens r·t .. (r+1)·t - 1
        pieces = [full[:, :, r * t:(r + 1) * t].clone() for r in range(cp)]
        head = f"b={b}, H={h} heads, t={t} tokens per rank, d={d}, cp={cp}"
        bufs = []
        for r, x in enumerate(pieces):
            got = fn(x.clone(), cp)
            if not torch.is_tensor(got):
                return f"{head}: rank {r}'s buffer is {type(got).__name__}, expected a tensor [cp, b, H/cp, t, d]"
            if list(got.shape) == [b, cp, g, t, d] and cp != b:
                return (f"{head}: your buffer has shape [b, cp, H/cp, t, d]; the all-to-all cuts dim 0 into one block "
                        f"per rank, so the rank axis must come first: transpose(0, 1) -> [cp, b, H/cp, t, d]")
            if list(got.shape) != [cp, b, g, t, d]:
                return f"{head}: your buffer has shape {list(got.shape)}, expected [cp, b, H/cp, t, d] = {[cp, b, g, t, d]}"
            if b > 1 and cp > 1 and torch.equal(got, x.reshape(cp, b, g, t, d)):
                return (f"{head}: you reshaped [b, H, t, d] straight to [cp, b, H/cp, t, d]; a reshape keeps memory "
                        f"order, so dim 0 then cuts through the BATCH (block 0 = batch row 0's first heads...), not the "
                        f"heads: reshape to [b, cp, H/cp, t, d], then transpose(0, 1)")
            bufs.append(got)
        for r in range(cp):
            received = torch.stack([bufs[i][r] for i in range(cp)])  # block i came from rank i
            mine = received.permute(1, 2, 0, 3, 4).reshape(b, g, cp * t, d)
            want = full[:, r * g:(r + 1) * g]
            if torch.equal(mine, want):
                continue
            if cp > 1 and g > 1 and torch.equal(mine, full[:, r::cp]):
                return (f"{head}: after the all-to-all rank {r} holds heads {list(range(r, h, cp))} (every cp-th: you "
                        f"cut the heads as [b, H/cp, cp, ...]); it must hold the contiguous group "
                        f"{list(range(r * g, (r + 1) * g))}, so that a group of query heads stays with its KV head: "
                        f"reshape as [b, cp, H/cp, t, d]")
            bad = (mine != want).nonzero()[0].tolist()
            return (f"{head}: after the all-to-all rank {r} holds a wrong value at (batch {bad[0]}, its head {bad[1]} = "
                    f"head {r * g + bad[1]}, position {bad[2]}): block j of your buffer must be heads j·H/cp .. "
                    f"(j+1)·H/cp - 1 of this rank's tokens, unchanged")
    return None


def _in_process(name, path, report, problem_of, success):
    return in_process(name, path, report, problem_of, success, "ex06", label=EXERCISES[name])


def _on_rank(path, name):
    """Runs on every rank: the ring with the learner's merge; returns this rank's output, or raises _Failure."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    try:
        mod = load(path, "ex06")
    except Exception as e:  # noqa: BLE001
        raise _Failure(f"cannot import {Path(path).name}: {type(e).__name__}: {e}{where(e, path)}") from None
    try:
        results = _scenario_ring(mod, rank, n)
    except Exception as e:  # noqa: BLE001 - any bug in the learner's code is a failed check
        raise _Failure(f"{type(e).__name__}: {e}{where(e, path)}") from None
    rendezvous(n, "check06/done")
    return results


SUCCESS = {
    "merge": ": two and three key blocks merge into softmax attention over all keys (float64, 1e-10); finite and "
             "right with scores near 1000 in fp32",
    "zigzag_positions": ": every rank's positions for (seq_len, cp) in " + ", ".join(f"({s}, {c})" for s, c in LAYOUTS),
    "step_blocks": ": every rank and ring step for cp = " + ", ".join(map(str, CPS)),
    "heads_send_buffer": ": through a simulated all-to-all every rank holds its head group over the whole sequence, "
                         "for (b, H, t, d, cp) in " + ", ".join(map(str, A2A_CASES)),
}


def check_one(name, path, report, timeout_s):
    if name == "zigzag_positions":
        return _in_process(name, path, report, _positions_problem, SUCCESS[name])
    if name == "step_blocks":
        return _in_process(name, path, report, _blocks_problem, SUCCESS[name])
    if name == "heads_send_buffer":
        return _in_process(name, path, report, _a2a_problem, SUCCESS[name])
    if not _in_process(name, path, report, _problem_merge, SUCCESS[name]):
        return None  # the real ring would only repeat it
    on_ranks(lambda n: f"merge inside picotron's ring on {n} ranks", WORLD_SIZES,
             lambda n: run_on_ranks(_on_rank, n, str(path), name, timeout_s=timeout_s),
             lambda n, results: (compare_ring(n, results), ": every rank's output is its piece (zig-zag) of full "
                                                           "causal attention"), report, path, timeout_s)
    return None


check, main = entry_points("Check lesson 06's exercises (the merge also inside the real ring on 2 and 3 processes).",
                           EXERCISES, check_one, LEARNER, SOLUTIONS, TIMEOUT_S, "ex06")


if __name__ == "__main__":
    sys.exit(main())
