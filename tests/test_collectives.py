"""picotron.collectives against torch.distributed's own collectives, bit for bit, on real gloo processes.

One launch per world size runs every check inside the ranks (a launch costs ~0.1 s, a collective ~1 ms) and
returns the list of what differed, so a failure names the collective, the case and the rank. Values are
small integers, so sums and products are exact in every dtype and the order of additions cannot matter:
any difference is a bug (a wrong chunk, a wrong peer, a wrong rank translation), never rounding.
Where gloo has no built-in (uneven all_gather / all_to_all / gather, int16 reductions) the expected result
is computed locally: every rank can regenerate every other rank's input from its seed.
"""
import time
import warnings
import zlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

import picotron.collectives as C
from picotron.launch import run_on_ranks

OPS = {"SUM": ReduceOp.SUM, "AVG": ReduceOp.AVG, "MAX": ReduceOp.MAX, "MIN": ReduceOp.MIN, "PRODUCT": ReduceOp.PRODUCT}
FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
DTYPES = (torch.int64, torch.int32, torch.uint8) + FLOATS
SHAPES = [(), (1,), (5,), (37,), (1031,), (3, 5, 7), (0,)]


# ----------------------------------------------------------------------------------------- run on every rank
def _data(rank, case, shape, dtype, op=None):
    """Rank `rank`'s input for `case`: small integers, reproducible on any rank."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((rank, case)).encode()))
    lo, hi = (-2, 3) if op == "PRODUCT" else (-16, 17)  # |sum| <= 8*16 and |product| <= 2**8: exact in bf16
    if dtype == torch.uint8:
        lo = 0
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def _bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


class _Checker:
    def __init__(self, tag):
        self.tag, self.fails, self.count = tag, [], 0

    def same(self, what, got, want):
        self.count += 1
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(_bits(got), _bits(want)):
            bad = (got != want).reshape(-1).nonzero()[:3].reshape(-1).tolist() if got.shape == want.shape else "-"
            self.fails.append(f"rank {dist.get_rank()} {self.tag} {what}: got {got.dtype}{tuple(got.shape)} "
                              f"{got.reshape(-1)[:6].tolist()}, want {want.dtype}{tuple(want.shape)} "
                              f"{want.reshape(-1)[:6].tolist()} (first differing indices {bad})")


def _reductions(ck, ranks, group, full):
    me = ranks.index(dist.get_rank())
    n = len(ranks)
    cases = [(s, d, o) for s in [(5,), (1031,), (3, 5, 7)] for d in DTYPES for o in OPS if o != "AVG" or d in FLOATS]
    cases += [(s, d, "SUM") for s in SHAPES for d in (torch.int64, torch.bfloat16)]
    cases += [(s, torch.float32, "MAX") for s in SHAPES]
    if not full:  # on a sub-group what matters is the rank translation: fewer dtypes and shapes
        cases = [(s, d, o) for s, d, o in cases if s in [(37,), (1031,), (0,)] and d in (torch.int64, torch.float32)]
    for shape, dtype, o in cases:
        op, case = OPS[o], (shape, str(dtype), o)
        x = _data(me, case, shape, dtype, o)
        want = x.clone()
        dist.all_reduce(want, ReduceOp.SUM if o == "AVG" else op, group=group)
        if o == "AVG":
            want.div_(n)  # AVG is SUM / n
        for name, fn in [("all_reduce", C.all_reduce), ("naive_all_reduce", C.naive_all_reduce)]:
            got = x.clone()
            fn(got, op, group=group)
            ck.same(f"{name} {case}", got, want)
        if o in ("SUM", "MAX") and len(shape) == 1:  # reduce (to every root for one length), reduce_scatter
            for dst in ranks if shape == (37,) else ranks[-1:]:
                got, ref = x.clone(), x.clone()
                C.reduce(got, dst, op, group=group)
                dist.reduce(ref, dst, op, group=group)
                ck.same(f"reduce dst={dst} {case}", got, ref if dst == dist.get_rank() else x)  # others untouched
            sizes = [(shape[0] + i) % 7 for i in range(n)]  # uneven, some empty
            inputs = [_data(me, (case, i), (sizes[i],), dtype, o) for i in range(n)]
            got, ref = torch.zeros(sizes[me], dtype=dtype), torch.zeros(sizes[me], dtype=dtype)
            C.reduce_scatter(got, [t.clone() for t in inputs], op, group=group)
            dist.reduce_scatter(ref, inputs, op, group=group)
            ck.same(f"reduce_scatter sizes={sizes} {case}", got, ref)
            big = _data(me, case, (n * shape[0],), dtype, o)
            got, ref = torch.zeros(shape[0], dtype=dtype), torch.zeros(shape[0], dtype=dtype)
            keep = big.clone()
            C.reduce_scatter_tensor(got, big, op, group=group)
            dist.reduce_scatter_tensor(ref, big, op, group=group)
            ck.same(f"reduce_scatter_tensor {case}", got, ref)
            ck.same(f"reduce_scatter_tensor leaves its input {case}", big, keep)
    # int16 has no gloo all_reduce: compare with the sum computed here from every rank's input
    x = _data(me, "i16", (37,), torch.int16)
    C.all_reduce(x, group=group)
    ck.same("all_reduce int16", x, sum(_data(i, "i16", (37,), torch.int16) for i in range(n)))
    # a non-contiguous tensor is reduced in place, like torch does
    base = _data(me, "nc", (6, 9), torch.float32)
    got, ref = base.clone().t(), base.clone().t()
    C.all_reduce(got, group=group)
    dist.all_reduce(ref, group=group)
    ck.same("all_reduce non-contiguous", got, ref)
    try:
        C.all_reduce(torch.ones(3, dtype=torch.int64), ReduceOp.AVG, group=group)
        ck.fails.append(f"rank {dist.get_rank()} {ck.tag}: AVG of an integer tensor did not raise (gloo raises)")
    except RuntimeError:
        pass


def _movements(ck, ranks, group, full):
    me = ranks.index(dist.get_rank())
    n = len(ranks)
    for shape in SHAPES if full else [(), (37,), (0,)]:
        dtypes = (torch.int64, torch.bfloat16, torch.float32, torch.int16, torch.bool, torch.uint8)
        for dtype in dtypes if full else dtypes[:2]:
            case = (shape, str(dtype))
            x = _data(me, case, shape, dtype)
            every = [_data(i, case, shape, dtype) for i in range(n)]  # every rank's input, regenerated here
            for src in ranks if shape == (37,) else ranks[-1:]:
                got = x.clone()
                C.broadcast(got, src, group=group)
                ck.same(f"broadcast src={src} {case}", got, every[ranks.index(src)])
            out = [torch.full(shape, 7).to(dtype) for _ in range(n)]
            C.all_gather(out, x, group=group)
            ck.same(f"all_gather {case}", torch.stack(out), torch.stack(every))
            out = torch.zeros((n,) + shape, dtype=dtype)
            C.all_gather_into_tensor(out, x, group=group)
            ck.same(f"all_gather_into_tensor {case}", out, torch.stack(every))
            for root in ranks if shape == (37,) else ranks[:1]:
                r = ranks.index(root)
                out = [torch.zeros(shape, dtype=dtype) for _ in range(n)] if root == ranks[me] else None
                C.gather(x, out, dst=root, group=group)
                if out is not None:
                    ck.same(f"gather dst={root} {case}", torch.stack(out), torch.stack(every))
                got = torch.zeros(shape, dtype=dtype)
                parts = [_data(r, (case, "s", i), shape, dtype) for i in range(n)]
                C.scatter(got, parts if root == ranks[me] else None, src=root, group=group)
                ck.same(f"scatter src={root} {case}", got, parts[me])
            out = [torch.zeros(shape, dtype=dtype) for _ in range(n)]
            C.all_to_all(out, [_data(me, (case, "a", j), shape, dtype) for j in range(n)], group=group)
            ck.same(f"all_to_all {case}", torch.stack(out), torch.stack([_data(i, (case, "a", me), shape, dtype)
                                                                         for i in range(n)]))
    # the same against the built-ins where gloo has them (equal sizes, common dtypes)
    for dtype in (torch.int64, torch.float32, torch.bfloat16):
        x = _data(me, "b", (2, 5), dtype)
        for root in ranks:
            got, ref = x.clone(), x.clone()
            C.broadcast(got, root, group=group)
            dist.broadcast(ref, root, group=group)
            ck.same(f"broadcast vs built-in src={root} {dtype}", got, ref)
            out = [torch.zeros(2, 5, dtype=dtype) for _ in range(n)] if root == ranks[me] else None
            ref = [torch.zeros(2, 5, dtype=dtype) for _ in range(n)] if root == ranks[me] else None
            C.gather(x, out, root, group=group)
            dist.gather(x, ref, root, group=group)
            if out is not None:
                ck.same(f"gather vs built-in dst={root} {dtype}", torch.stack(out), torch.stack(ref))
            parts = [x + 100 * i for i in range(n)] if root == ranks[me] else None
            got, ref = torch.zeros_like(x), torch.zeros_like(x)
            C.scatter(got, parts, root, group=group)
            dist.scatter(ref, parts, root, group=group)
            ck.same(f"scatter vs built-in src={root} {dtype}", got, ref)
        out, ref = [torch.zeros_like(x) for _ in range(n)], [torch.zeros_like(x) for _ in range(n)]
        C.all_gather(out, x, group=group)
        dist.all_gather(ref, x, group=group)
        ck.same(f"all_gather vs built-in {dtype}", torch.stack(out), torch.stack(ref))
        out, ref = torch.zeros(n * 2, 5, dtype=dtype), torch.zeros(n * 2, 5, dtype=dtype)
        C.all_gather_into_tensor(out, x, group=group)
        dist.all_gather_into_tensor(ref, x, group=group)
        ck.same(f"all_gather_into_tensor vs built-in {dtype}", out, ref)
        ins = [x + 10 * j for j in range(n)]
        out, ref = [torch.zeros_like(x) for _ in range(n)], [torch.zeros_like(x) for _ in range(n)]
        C.all_to_all(out, ins, group=group)
        dist.all_to_all(ref, ins, group=group)
        ck.same(f"all_to_all vs built-in {dtype}", torch.stack(out), torch.stack(ref))
    # uneven sizes per rank (NCCL allows them; gloo's built-in does not): all_gather, gather, all_to_all
    size = lambda i, j=0: (3 * i + 2 * j) % 5  # noqa: E731  (rank i's piece for rank j; some are empty)
    x = _data(me, "u", (size(me),), torch.int64)
    out = [torch.zeros(size(i), dtype=torch.int64) for i in range(n)]
    C.all_gather(out, x, group=group)
    ck.same("all_gather uneven", torch.cat(out), torch.cat([_data(i, "u", (size(i),), torch.int64) for i in range(n)]))
    out = [torch.zeros(size(i), dtype=torch.int64) for i in range(n)] if me == 0 else None
    C.gather(x, out, ranks[0], group=group)
    if me == 0:
        ck.same("gather uneven", torch.cat(out), torch.cat([_data(i, "u", (size(i),), torch.int64) for i in range(n)]))
    out = [torch.zeros(size(i, me), dtype=torch.int64) for i in range(n)]
    C.all_to_all(out, [_data(me, ("u", j), (size(me, j),), torch.int64) for j in range(n)], group=group)
    ck.same("all_to_all uneven", torch.cat(out),
            torch.cat([_data(i, ("u", me), (size(i, me),), torch.int64) for i in range(n)]))
    # non-contiguous outputs, async_op handles
    out = [torch.zeros(5, 2, dtype=torch.float32).t() for _ in range(n)]
    w = C.all_gather(out, _data(me, "nc", (2, 5), torch.float32), group=group, async_op=True)
    w.wait()
    ck.same("all_gather non-contiguous outputs", torch.stack(out),
            torch.stack([_data(i, "nc", (2, 5), torch.float32) for i in range(n)]))


def _check_everything(subgroups=()):
    """On every rank: all checks on the world, then on each sub-group (given as global ranks)."""
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renames the *_tensor built-ins
    world = list(range(dist.get_world_size()))
    groups = [(world, None)] + [(ranks, dist.new_group(ranks)) for ranks in subgroups]  # collective: all ranks
    groups = [(dist.get_process_group_ranks(g) if g else ranks, g) for ranks, g in groups]  # torch sorts them
    fails, count = [], 0
    default, C.PIECE_BYTES = C.PIECE_BYTES, 256  # tiny pieces exercise the pipelined ring (empty pieces too)
    for ranks, group in groups:
        ck = _Checker(f"[group {ranks}]")
        if dist.get_rank() in ranks:
            _reductions(ck, ranks, group, full=group is None)
            _movements(ck, ranks, group, full=group is None)
            C.barrier(group)
        else:  # outside the group every collective is a no-op that returns None, as in torch
            x = torch.ones(3)
            outs = [C.all_reduce(x, group=group), C.broadcast(x, ranks[0], group=group), C.barrier(group),
                    C.all_gather([x.clone()], x, group=group), C.reduce(x, ranks[0], group=group),
                    C.reduce_scatter_tensor(x[:1], x, group=group), C.all_to_all([x], [x], group=group)]
            if outs != [None] * 7 or not torch.equal(x, torch.ones(3)):
                ck.fails.append(f"rank {dist.get_rank()} outside {ranks}: not a no-op")
        fails += ck.fails
        count += ck.count
    ck = _Checker("[world, bigger tensors]")
    for piece, length in [(default, 3000 * len(world) + 3), (1 << 16, 40960 * len(world) + 3)]:  # 1, 2.5 pieces
        C.PIECE_BYTES = piece
        x = _data(dist.get_rank(), "big", (length,), torch.int32)
        got, want = x.clone(), x.clone()
        C.all_reduce(got)
        dist.all_reduce(want)
        ck.same(f"all_reduce piece={piece} length={length}", got, want)
    C.PIECE_BYTES = default
    return fails + ck.fails, count + ck.count


WORLDS = {1: (), 2: (), 3: (), 4: ([1, 3], [0, 2, 3]), 8: ([0, 3, 5, 6, 7], [6, 2])}


@pytest.mark.parametrize("world", [pytest.param(w, marks=pytest.mark.heavy) if w == 8 else w for w in sorted(WORLDS)])
def test_collectives_equal_builtins_bit_for_bit(world):  # 8 processes on 2 cores: --heavy (4 has subgroups too)
    results = run_on_ranks(_check_everything, world, WORLDS[world], timeout_s=150)
    fails = [f for rank_fails, _ in results for f in rank_fails]
    assert all(count > 100 for _, count in results), [count for _, count in results]
    assert not fails, f"{len(fails)} mismatches, the first ones:\n" + "\n".join(fails[:20])


# ----------------------------------------------------------------------------------------------- barrier
def _time_barrier(late_rank, delay_s):
    """(when this rank arrived at the barrier, when it left): wall-clock times, one clock for every process here."""
    if dist.get_rank() == late_rank:
        time.sleep(delay_s)
    arrived = time.time()
    C.barrier()
    left = time.time()
    C.barrier()  # and the barrier is reusable right away
    return arrived, left


@pytest.mark.parametrize("world", [3, 5])
def test_barrier_blocks_until_the_last_rank_arrives(world):
    """No rank leaves before the last one arrives (one rank sleeps first, so it is late): an order of events, not a
    duration, so a busy machine cannot fail it by being slow."""
    times = run_on_ranks(_time_barrier, world, world - 1, 0.5)
    last_arrival = max(arrived for arrived, _ in times)
    assert all(left >= last_arrival for _, left in times), times


# ------------------------------------------------------------------------------------- no allocation per step
def _count_allocations():
    """The tensors two all_reduces allocate, for a tensor of many pieces (4 ring steps x 6 pieces)."""
    calls = []
    for name in ("empty", "empty_like", "zeros", "zeros_like", "cat", "clone"):
        real = getattr(torch, name)
        setattr(torch, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    C.PIECE_BYTES = 64
    x = torch.arange(1031, dtype=torch.float32)
    C.all_reduce(x)
    C.all_reduce(x)
    return calls, x[:3].tolist()


def test_all_reduce_allocates_one_buffer_and_keeps_it():
    for calls, head in run_on_ranks(_count_allocations, 3):
        assert calls == ["empty"] and head == [0.0, 9.0, 18.0], (calls, head)


# ------------------------------------------------------------------------------------------- cost model
def test_busbw_factors_follow_nccl_tests():
    assert C.BUSBW_FACTOR["all_reduce"](4) == 1.5 and C.BUSBW_FACTOR["all_gather"](4) == 0.75
    assert C.BUSBW_FACTOR["reduce_scatter"](8) == 7 / 8 and C.BUSBW_FACTOR["broadcast"](8) == 1.0
    for name in C.BUSBW_FACTOR:
        assert callable(getattr(C, name)), name
