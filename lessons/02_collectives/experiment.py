"""Lesson 02, the experiment: the collectives of picotron/collectives.py (written from send/recv) next to
torch.distributed's own, on N processes; a dozen-line ring all-reduce next to picotron's pipelined one.

    torchrun --nproc_per_node 4 lessons/02_collectives/experiment.py --out runs/lessons/02_collectives [--only ring]
    PICOTRON_FAST=1 torchrun ...   (or --fast)    short settings (fewer sizes and repeats)

Each experiment writes OUT/<name>.json, which the notebook plots with the plot_* functions below:
    correctness  every collective, ours and the built-in on the same inputs (int64 bit for bit, float32 close;
                 SUM/MAX/MIN/AVG; the world and a sub-group); the before/after pictures on encoded chunks
    trace        the ring all-reduce message by message, and the bytes every rank sends in every collective
    ring         simple_ring_all_reduce (below) against the built-in (results) and against picotron's ring (time)
    bandwidth    time, algbw and busbw (nccl-tests convention) over message sizes, ours and the built-in
                 interleaved repeat by repeat, with alpha-beta fits
A repeat's time is the slowest rank's (after a barrier); we keep the median over repeats.
"""
import copy
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/
import _common  # noqa: E402  (puts the repository root on sys.path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from picotron import collectives as C  # noqa: E402
from picotron import metrics  # noqa: E402
from picotron.mesh import Mesh  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renames *_into_tensor; we time both names
KiB, MiB = 2**10, 2**20
COLLECTIVES = ("broadcast", "reduce", "all_reduce", "naive_all_reduce", "gather", "all_gather",
               "all_gather_into_tensor", "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all")
INPLACE = ("broadcast", "reduce", "all_reduce", "naive_all_reduce")
RATIO_AT, VOLUME_BYTES = 16 * MiB, 768 * KiB  # 768 KiB: n = 2, 3, 4, 6, 8 divide it; one piece per chunk
DEVICE = torch.device("cpu")  # where the tensors live: main() sets the mesh's device
SETTINGS = {  # sizes are nccl-tests "bytes": the whole buffer of all_reduce, the whole output of all_gather, ...
    "fast": dict(sizes=[KiB * 4**k for k in range(8)], ring_sizes=[KiB * 4**k for k in range(9)], warmup=1,
                 min_repeats=5, max_repeats=15, budget_s=0.25),
    "full": dict(sizes=[KiB * 2**k for k in range(17)], ring_sizes=[KiB * 2**k for k in range(17)], warmup=2,
                 min_repeats=7, max_repeats=60, budget_s=1.2),
}


# ------------------------------------------------------------------------------- the simplest ring all-reduce
def simple_ring_all_reduce(tensor, incoming=None):
    """Sum a contiguous `tensor` (at least n elements) over all ranks, in place: the ring, one whole chunk per
    step. `incoming` is the receive buffer (at least one chunk; default a new one each call)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(tensor.view(-1), n)  # views: the result lands in `tensor`
    incoming = torch.empty_like(chunks[0]) if incoming is None else incoming
    for step in range(2 * (n - 1)):  # n - 1 reduce-scatter steps, then n - 1 all-gather steps
        send, recv = chunks[(rank - step - 1) % n], chunks[(rank - step - 2) % n]
        got = incoming[:recv.numel()]
        requests = [dist.isend(send, (rank + 1) % n), dist.irecv(got, (rank - 1) % n)]  # post both, then wait:
        for request in requests:  # no rank can block in a send while its neighbour blocks in one too
            request.wait()
        if step < n - 1:
            recv += got  # reduce-scatter: one more rank's contribution
        else:
            recv.copy_(got)  # all-gather: a finished chunk


def picotron_ring(t, piece_bytes):
    """picotron's all_reduce with pipelining pieces of `piece_bytes` (huge: one piece per chunk, no pipelining)."""
    old, C.PIECE_BYTES = C.PIECE_BYTES, piece_bytes
    try:
        C.all_reduce(t)
    finally:
        C.PIECE_BYTES = old


# ------------------------------------------------------------------------------- one collective, ready to run
def prepare(name, rank, members, root, length, m, make, empty, op=dist.ReduceOp.SUM, group=None):
    """Buffers for collective `name` and call(L) that runs library L (picotron.collectives or torch.distributed)
    on them. In-place collectives get a tensor of `length` elements, the others one piece of `m` elements per
    member; make(k, i) is piece i of this rank's input, empty(k) an output. Returns (call, inputs, outputs):
    this rank's input tensors and its DEFINED outputs (reduce: only on the root; gather: the root's list)."""
    n, kw, at_root = len(members), dict(group=group), rank == root
    if name in INPLACE:
        t = make(length, 0)
        calls = {"broadcast": lambda L: L.broadcast(t, src=root, **kw),
                 "reduce": lambda L: L.reduce(t, root, op=op, **kw), "all_reduce": lambda L: L.all_reduce(t, op=op, **kw),
                 "naive_all_reduce": lambda L: getattr(L, "naive_all_reduce", dist.all_reduce)(t, op=op, **kw)}
        return calls[name], [t], [] if name == "reduce" and not at_root else [t]
    ins = [make(m, i) for i in range(n)] if name in ("scatter", "reduce_scatter", "all_to_all") else [make(m, 0)]
    outs = [empty(m) for _ in range(n)] if name in ("gather", "all_gather", "all_to_all") else [empty(m)]
    if name == "all_gather_into_tensor":
        outs = [empty(m * n)]
    if name == "reduce_scatter_tensor":
        ins = [torch.cat([make(m, i) for i in range(n)])]
    calls = {"gather": lambda L: L.gather(ins[0], outs if at_root else None, dst=root, **kw),
             "all_gather": lambda L: L.all_gather(outs, ins[0], **kw),
             "all_gather_into_tensor": lambda L: L.all_gather_into_tensor(outs[0], ins[0], **kw),
             "scatter": lambda L: L.scatter(outs[0], ins if at_root else None, src=root, **kw),
             "reduce_scatter": lambda L: L.reduce_scatter(outs[0], ins, op=op, **kw),
             "reduce_scatter_tensor": lambda L: L.reduce_scatter_tensor(outs[0], ins[0], op=op, **kw),
             "all_to_all": lambda L: L.all_to_all(outs, ins, **kw)}
    return (calls[name], ins if name != "scatter" or at_root else [],
            outs if name != "gather" or at_root else [])


def zeros(k, i=0, dtype=torch.float32):
    return torch.zeros(k, dtype=dtype)


def for_timing(name, nbytes, n, rank):
    """(call, exact bytes in the nccl-tests convention) for `name` at about `nbytes`, float32 zeros (repeated
    in-place sums never overflow; only the time matters)."""
    length, m = max(1, nbytes // 4), max(1, nbytes // (4 * n))
    call, _, _ = prepare(name, rank, list(range(n)), 0, length, m, zeros, zeros)
    return call, 4 * (length if name in INPLACE else m * n)


# ---------------------------------------------------------------------------------------------- timing
def max_over_ranks(values):
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def measure(fns, s):
    """Median over repeats of the slowest rank's time (after a barrier), per fn; the fns take turns within every
    repeat (who goes first alternates) so a disturbance on a shared machine hits them alike. (medians, repeats)"""
    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        metrics.sync(DEVICE)  # on a GPU: until the kernels ran, not only until they were queued
        return time.perf_counter() - t0
    for _ in range(s["warmup"]):
        for f in fns:
            f()
    probe = max_over_ranks([sum(timed(f) for f in fns)])[0]  # the same on every rank
    repeats = int(min(max(s["budget_s"] / max(probe, 1e-9), s["min_repeats"]), s["max_repeats"]))
    times = [[] for _ in fns]
    for k in range(repeats):
        order = list(enumerate(fns))
        for i, f in order if k % 2 == 0 else order[::-1]:
            times[i].append(timed(f))
    slowest = max_over_ranks([t for row in times for t in row])  # max over ranks, repeat by repeat
    return [statistics.median(slowest[i * repeats:(i + 1) * repeats]) for i in range(len(fns))], repeats


# ------------------------------------------------------------------------------------- alpha-beta model
def fit_alpha_beta(nbytes, seconds):
    """T = alpha + beta * bytes by least squares on the RELATIVE error (each size counts alike, as on a log-log
    plot). alpha >= 0, beta > 0. Returns alpha (s), beta (s/byte), alpha_us, inv_beta_GBps, max_rel_err."""
    import numpy as np

    x, y = np.asarray(nbytes, float), np.asarray(seconds, float)
    (alpha, beta), *_ = np.linalg.lstsq(np.stack([1 / y, x / y], 1), np.ones_like(y), rcond=None)
    if alpha < 0:  # no measurable latency: fit through the origin
        alpha, beta = 0.0, float(np.sum(x / y) / np.sum((x / y) ** 2))
    beta = max(float(beta), 1e-15)  # latency-bound at every size
    return dict(alpha=float(alpha), beta=beta, alpha_us=1e6 * float(alpha), inv_beta_GBps=1e-9 / beta,
                max_rel_err=float(np.max(np.abs((alpha + beta * x) / y - 1))))


def per_link(fit, n):
    """The ring all-reduce fit T = a + b*N read as T = 2(n-1)*alpha_step + 2(n-1)/n * N * beta_link."""
    return dict(alpha_step=fit["alpha"] / (2 * (n - 1)), beta_link=fit["beta"] * n / (2 * (n - 1)))


def ring_allreduce_time(n, nbytes, alpha, beta):
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta


def tree_allreduce_time(n, nbytes, alpha, beta):
    """Binomial-tree reduce then broadcast, the whole message at every hop (our naive_all_reduce)."""
    return 2 * math.ceil(math.log2(n)) * (alpha + nbytes * beta)


def crossover_bytes(n, alpha, beta):
    """Message size below which the tree all-reduce beats the ring (None if it never does)."""
    steps = math.ceil(math.log2(n))
    gain, cost = (n - 1 - steps) * 2 * alpha, (2 * steps - 2 * (n - 1) / n) * beta
    return gain / cost if gain > 0 and cost > 0 else None


# ------------------------------------------------------------------------------- watching and encoding
class Recorder:
    """While active, records every message sent through dist.isend / dist.send: dict(peer, nbytes, data (a
    copy, with keep=True)). picotron.collectives looks dist.isend up at call time, so this sees every message;
    what a rank receives is what its neighbours sent, so the sends tell the whole story."""

    def __init__(self, keep=False):
        self.keep, self.sent = keep, []

    def __enter__(self):
        self.real = dist.isend, dist.send

        def wrap(real):
            def send(tensor, dst=None, *args, **kwargs):
                self.sent.append(dict(peer=int(dst), nbytes=tensor.numel() * tensor.element_size(),
                                      data=tensor.detach().clone() if self.keep else None))
                return real(tensor, dst, *args, **kwargs)
            return send
        dist.isend, dist.send = map(wrap, self.real)
        return self

    def __exit__(self, *exc):
        dist.isend, dist.send = self.real


# Rank r's chunk c holds 2**r + 256*c, so a sum over a set S of ranks of chunk c is (bitmask of S) + 256*c*|S|,
# which decodes back to (S, c) whatever order the algorithm added in (integers: exact). n <= 8.
def encode(rank, chunk):
    return (1 << rank) + 256 * chunk


def decode(value):
    sources = [r for r in range(8) if int(value) % 256 >> r & 1]
    return sources, (int(value) // 256) // max(1, len(sources))


def cells(tensors):
    """Tensors as decoded cells [{from: [ranks], chunk: c}], in order."""
    return [dict(zip(("from", "chunk"), decode(v))) for t in tensors for v in t.reshape(-1).tolist()]


def shown_value(sources, chunk):
    """The readable value of a cell in the ring pictures: rank r's chunk c starts as 10(r+1) + c; sums add up."""
    return sum(10 * (s + 1) + chunk for s in sources)


# ---------------------------------------------------------------------------------------- experiments
def ours_and_builtin(name, rank, members, root, length, m, make, empty, op=dist.ReduceOp.SUM, group=None):
    """Collective `name` run by ours and by the built-in on equal fresh inputs (make() gives a new input maker
    for each): (this rank's inputs before the call, our defined outputs, the built-in's)."""
    runs = []
    for L in (C, dist) if rank in members else ():
        call, ins, outs = prepare(name, rank, members, root, length, m, make(), empty, op, group)
        before = [t.clone() for t in ins]
        call(L)
        runs.append((before, outs))
    return (runs[0][0], runs[0][1], runs[1][1]) if runs else ([], [], [])


def exp_correctness(mesh, fast, out):
    """Ours == built-in for every collective: int64 must be bit for bit, float32 is reported (|diff|, bits)."""
    n, rank, S = mesh.world_size, mesh.rank, dist.ReduceOp
    sub = sorted(set(range(0, n, 2)) | {n - 1}) if n >= 3 else list(range(n))  # n=4: [0, 2, 3]
    cases = ([(c, torch.int64, S.SUM) for c in COLLECTIVES] + [(c, torch.float32, S.SUM) for c in COLLECTIVES]
             + [(c, torch.int64, op) for c in ("all_reduce", "reduce", "reduce_scatter_tensor") for op in (S.MAX, S.MIN)]
             + [("all_reduce", torch.float32, S.AVG)])
    rows = []
    for where, group, members in (("world", None, list(range(n))), (f"ranks {sub}", dist.new_group(sub), sub)):
        for i, (name, dtype, op) in enumerate(cases):
            def make(i=i, dtype=dtype):  # the same seeded values for ours and the built-in
                g = torch.Generator(DEVICE).manual_seed(1000 * i + rank)
                return lambda k, _: (torch.randint(-1000, 1000, (k,), generator=g) if dtype == torch.int64
                                     else torch.randn(k, generator=g))
            _, ours, builtin = ours_and_builtin(name, rank, members, members[-1], 1001, 333, make,
                                                lambda k: torch.full((k,), -7, dtype=dtype), op, group)
            unequal = sum(not torch.equal(a, b) for a, b in zip(ours, builtin)) + (len(ours) != len(builtin))
            diff = max([(a.double() - b.double()).abs().max().item() for a, b in zip(ours, builtin)] or [0.0])
            unequal, diff = max_over_ranks([float(unequal), diff])
            rows.append(dict(collective=name, group=where, dtype=str(dtype)[6:], op=str(op).split(".")[-1],
                             bitwise_equal=unequal == 0, max_abs_diff=diff))
    ints, floats = [r for r in rows if r["dtype"] == "int64"], [r for r in rows if r["dtype"] == "float32"]
    if rank == 0:
        print(f"correctness: int64 bit for bit {sum(r['bitwise_equal'] for r in ints)}/{len(ints)}; float32 bit for "
              f"bit {sum(r['bitwise_equal'] for r in floats)}/{len(floats)}, max |diff| "
              f"{max(r['max_abs_diff'] for r in floats):.2e}", flush=True)
    return dict(world_size=n, sub_group=sub, rows=rows, pictures=pictures(mesh))


def pictures(mesh):
    """Before/after of each collective from OUR implementation on encoded chunks, and whether the built-in gave
    the same on the same input (where the API defines it). Root 0. {name: {before, after, defined,
    equal_builtin}}, per-rank lists of decoded cells ([] = no buffer on that rank)."""
    n, rank, result = mesh.world_size, mesh.rank, {}

    def encoded(k, i):  # piece i of this rank's input: chunks i, i+1, ...
        return torch.tensor([encode(rank, i + c) for c in range(k)])
    for name in ("broadcast", "scatter", "gather", "all_gather", "all_to_all", "reduce", "all_reduce", "reduce_scatter"):
        before, after, builtin = ours_and_builtin(name, rank, list(range(n)), 0, n, 1, lambda: encoded,
                                                  lambda k: zeros(k, dtype=torch.int64))
        defined = not (name == "reduce" and rank != 0)  # reduce leaves the others' undefined (ours: as they were)
        everyone = _common.gather(dict(before=cells(before), after=cells(after if defined else before), defined=defined,
                                       equal=len(after) == len(builtin) and all(map(torch.equal, after, builtin))), mesh)
        result[name] = {key: [e[key] for e in everyone] for key in ("before", "after", "defined")}
        result[name]["equal_builtin"] = all(e["equal"] for e in everyone)
    return result


def exp_trace(mesh, fast, out):
    """The ring all-reduce, message by message, and the bytes each rank sends in every collective."""
    n, rank = mesh.world_size, mesh.rank
    x = torch.tensor([encode(rank, c) for c in range(n)])
    with Recorder(keep=True) as rec:
        C.all_reduce(x)
    trace = build_trace(_common.gather(dict(sends=[(e["peer"], e["data"].view(torch.int64).item()) for e in rec.sent],
                                            final=x.tolist()), mesh), n)
    volume = {}
    for name in COLLECTIVES + ("barrier",):
        call, size = (lambda L: L.barrier(), 0) if name == "barrier" else for_timing(name, VOLUME_BYTES, n, rank)
        dist.barrier()
        with Recorder() as rec:
            call(C)
        volume[name] = dict(bytes=size, sent=_common.gather(sum(e["nbytes"] for e in rec.sent), mesh),
                            expected_sent=expected_sent(name, n, size))
    if rank == 0:
        ok = all(v["sent"] == v["expected_sent"] for v in volume.values())
        print(f"trace: {len(trace['frames']) - 1} steps on {n} ranks, replay == all_reduce's result: "
              f"{trace['consistent']}; bytes sent == formula: {ok}")
    return dict(world_size=n, ring=trace, volume=volume)


def build_trace(per_rank, n):
    """Frames of the ring all-reduce: frame 0 is the start, frame k the state after step k with the messages of
    step k (rank r's k-th send). A message adds to the receiver's chunk (reduce-scatter: the receiver's own
    contribution is not in it yet) or replaces it (all-gather: a finished chunk)."""
    state = [[dict(sources=[r], value=shown_value([r], c)) for c in range(n)] for r in range(n)]
    frames = [dict(step=0, phase="start", messages=[], state=copy.deepcopy(state))]
    for k in range(len(per_rank[0]["sends"])):
        messages = []
        for r in range(n):
            dst, code = per_rank[r]["sends"][k]
            sources, chunk = decode(code)
            messages.append(dict(src=r, dst=dst, chunk=chunk, sources=sources, value=shown_value(sources, chunk)))
        for m in messages:
            old = state[m["dst"]][m["chunk"]]
            sources = m["sources"] if m["dst"] in m["sources"] else sorted(old["sources"] + m["sources"])
            state[m["dst"]][m["chunk"]] = dict(sources=sources, value=shown_value(sources, m["chunk"]))
        phase = "reduce-scatter" if any(len(m["sources"]) < n for m in messages) else "all-gather"
        frames.append(dict(step=k + 1, phase=phase, messages=messages, state=copy.deepcopy(state)))
    consistent = all(decode(per_rank[r]["final"][c]) == (state[r][c]["sources"], c) for r in range(n) for c in range(n))
    return dict(n=n, frames=frames, consistent=consistent)


def expected_sent(name, n, N, root=0):
    """Bytes each rank sends in OUR algorithms (N in the nccl-tests convention, divisible by n), root 0."""
    share = N // n
    if name == "barrier":
        return [math.ceil(math.log2(n))] * n if n > 1 else [0]  # 1-byte tokens
    if name in ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor",
                "all_to_all"):
        return [(2 if name == "all_reduce" else 1) * (n - 1) * share] * n
    if name in ("gather", "scatter"):
        return [(n - 1) * share * (name == "scatter") if r == root else share * (name == "gather") for r in range(n)]
    bcast = [len(C._tree((r - root) % n, n)[1]) * N for r in range(n)]  # the whole tensor to every child
    reduce = [0 if r == root else N for r in range(n)]
    return {"broadcast": bcast, "reduce": reduce, "naive_all_reduce": [a + b for a, b in zip(bcast, reduce)]}[name]


def exp_ring(mesh, fast, out, timing=True):
    """simple_ring_all_reduce: equal to the built-in (int64, bit for bit, uneven lengths), the bytes it sends,
    and its time against picotron's ring, without and with pipelining, and the built-in; plus the time of one
    chunk's addition (what pipelining could hide behind the transfers)."""
    n, rank = mesh.world_size, mesh.rank
    lengths = [n, 1001, 4097]  # 1001 and 4097: no n in 2..6 divides them
    equal = []
    for length in lengths:
        x = torch.randint(-1000, 1000, (length,), generator=torch.Generator(DEVICE).manual_seed(length + rank))
        ours, ref = x.clone(), x.clone()
        simple_ring_all_reduce(ours)
        dist.all_reduce(ref)
        equal.append(max_over_ranks([float(not torch.equal(ours, ref))])[0] == 0)
    sent = {}
    for name, fn in (("simple", simple_ring_all_reduce), ("picotron", C.all_reduce)):
        with Recorder() as rec:
            fn(zeros(VOLUME_BYTES // 4))
        sent[name] = _common.gather(sum(e["nbytes"] for e in rec.sent), mesh)
    result = dict(world_size=n, lengths=lengths, equal=equal, volume_bytes=VOLUME_BYTES, sent=sent,
                  piece_bytes=C.PIECE_BYTES, sizes=[], time={k: [] for k in RING_VARIANTS}, add=[])
    if rank == 0:
        print(f"simple ring on {n} ranks == built-in (int64, lengths {lengths}): {equal}", flush=True)
    s = _common.sized("02_collectives", SETTINGS["fast" if fast else "full"], fast)
    for nbytes in s["ring_sizes"] if timing else []:
        t = zeros(nbytes // 4)
        incoming, a, b = (zeros(-(-t.numel() // n)) for _ in range(3))  # incoming: kept between calls, as picotron's
        fns = {"simple": lambda: simple_ring_all_reduce(t, incoming), "one piece": lambda: picotron_ring(t, 1 << 62),
               "pieces": lambda: picotron_ring(t, C.PIECE_BYTES), "built-in": lambda: dist.all_reduce(t)}
        for k, v in zip(RING_VARIANTS, measure([fns[k] for k in RING_VARIANTS], s)[0]):
            result["time"][k].append(v)
        result["add"].append(measure([lambda: a.add_(b)], s)[0][0])  # one chunk's addition
        result["sizes"].append(nbytes)
    return result


RING_VARIANTS = ("simple", "one piece", "pieces", "built-in")


def exp_bandwidth(mesh, fast, out):
    n, rank = mesh.world_size, mesh.rank
    s = _common.sized("02_collectives", SETTINGS["fast" if fast else "full"], fast)
    results = {}
    for name in COLLECTIVES:
        rows = dict(bytes=[], repeats=[], ours=[], builtin=[])
        for nbytes in s["sizes"]:
            call, size = for_timing(name, nbytes, n, rank)
            (t_ours, t_builtin), repeats = measure([lambda: call(C), lambda: call(dist)], s)
            for key, value in zip(rows, (size, repeats, t_ours, t_builtin)):
                rows[key].append(value)
        factor = C.BUSBW_FACTOR[name](n)
        entry = dict(builtin_name="all_reduce" if name == "naive_all_reduce" else name, factor=factor,
                     bytes=rows["bytes"], repeats=rows["repeats"])
        for impl in ("ours", "builtin"):
            algbw = [b / t / 1e9 for b, t in zip(rows["bytes"], rows[impl])]
            entry[impl] = dict(time=rows[impl], algbw=algbw, busbw=[a * factor for a in algbw],
                               fit=fit_alpha_beta(rows["bytes"], rows[impl]))
        results[name] = entry
    (t_ours, t_builtin), repeats = measure([C.barrier, dist.barrier], dict(s, min_repeats=20, max_repeats=50))
    ratio = {name: r["builtin"]["time"][r["bytes"].index(RATIO_AT)] / r["ours"]["time"][r["bytes"].index(RATIO_AT)]
             for name, r in results.items() if RATIO_AT in r["bytes"]}
    return dict(world_size=n, sizes=s["sizes"], results=results, barrier=dict(ours=t_ours, builtin=t_builtin,
                repeats=repeats), ratio_at=RATIO_AT, ratio=ratio)


# ------------------------------------------------------------------------ plots (for the notebook)
RANK_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"]
SUBSCRIPT = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")


def plot_panels(panels, xlabel, ncols=2, size=(5.2, 3.2)):
    """Line plots, at most two per row: panels = [dict(title, ylabel, lines=[(label, x, y, style)], xscale="log",
    yscale="linear", hline=None, ylim0=False)]. One legend for all, under the panels: never over the data."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    ncols = min(ncols, len(panels))
    rows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(rows, ncols, figsize=(size[0] * ncols, size[1] * rows), squeeze=False)
    legend = {}
    for ax, p in zip(axes.flat, panels):
        for label, x, y, style in p["lines"]:
            legend.setdefault(label, ax.plot(x, y, **style)[0])
        if p.get("hline") is not None:
            ax.axhline(p["hline"], color="k", lw=0.8)
        ax.set(xscale=p.get("xscale", "log"), yscale=p.get("yscale", "linear"), xlabel=xlabel, ylabel=p["ylabel"],
               title=p.get("title", ""))
        if p.get("ylim0"):
            ax.set_ylim(bottom=0)
        if p.get("yscale") == "log":  # plain numbers; minor labels (2, 5) only on a short axis
            lo, hi = ax.get_ylim()
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if hi / lo < 100 and f"{v:e}"[0] in "25"
                                                       else ""))
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.legend(legend.values(), legend.keys(), loc="upper center", bbox_to_anchor=(0.5, 0), fontsize=9, frameon=False,
               ncol=min(len(legend), 2 if max(map(len, legend)) > 30 else 4))
    return fig


def label(sources, n, chunk=None):
    """a, a+b, ... (a = rank 0), Σ for all ranks; with a chunk index as subscript when given."""
    sub = "" if chunk is None else str(chunk).translate(SUBSCRIPT)
    return "Σ" + sub if len(sources) == n and n > 2 else "+".join("abcdefgh"[r] + sub for r in sources)


def draw_grid(ax, rows, n, x0=0.0, y0=0.0, names=True, dim=None, marked=(), fontsize=9):
    """One row per rank, one cell per entry {from: [ranks], label}: a stripe per contributing rank; cells in
    `marked` ((rank, column) pairs) get a black border, rows with dim[r] are faded."""
    import matplotlib.patches as patches

    for r, row in enumerate(rows):
        y, faded = y0 + n - 1 - r, bool(dim and dim[r])
        if names:
            ax.text(x0 - 0.15, y + 0.4, f"rank {r}", ha="right", va="center", fontsize=9)
        if not row:
            ax.text(x0 + 0.1, y + 0.4, "—", va="center", color="gray")
        for j, c in enumerate(row):
            k = len(c["from"])
            for i, s in enumerate(c["from"]):
                ax.add_patch(patches.Rectangle((x0 + j + i / k, y), 1 / k, 0.8, color=RANK_COLORS[s], lw=0,
                                               alpha=0.25 if faded else 1))
            hit = (r, j) in marked
            ax.add_patch(patches.Rectangle((x0 + j, y), 1, 0.8, fill=False, edgecolor="black" if hit else "white",
                                           lw=2.5 if hit else 1))
            ax.text(x0 + j + 0.5, y + 0.4, c["label"], ha="center", va="center", fontsize=fontsize, fontweight="bold",
                    color="black" if faded else "white")


CAPTIONS = dict(broadcast="broadcast(t, src=0): the root's tensor everywhere", reduce="reduce(t, dst=0): the sum, "
                "on the root only", scatter="scatter(out, list, src=0): piece r of the root to rank r",
                gather="gather(x, list, dst=0): everyone's piece, on the root", all_gather="all_gather(list, x): "
                "everyone's piece, everywhere", all_to_all="all_to_all(outs, ins): piece j of rank r to rank j",
                all_reduce="all_reduce(t): the sum, everywhere", reduce_scatter="reduce_scatter(out, list): chunk r "
                "of the sum on rank r")


def plot_collectives(pics, names):
    """One panel per collective (at most 4): each rank's buffer before → after, from our implementation.
    Colours are the ranks the data came from (stripes: a sum), letters the ranks, subscripts the chunks."""
    import matplotlib.pyplot as plt

    n = len(next(iter(pics.values()))["before"])
    fig, axes = plt.subplots(-(-len(names) // 2), 2, figsize=(11, (0.45 * n + 0.9) * -(-len(names) // 2)), squeeze=False)
    for ax, name in zip(axes.flat, names):
        p, chunked = pics[name], name not in ("gather", "all_gather")  # one piece per rank there: no subscript
        show = [[dict(c, label=label(c["from"], n, c["chunk"] if chunked else None)) for c in row] for row in p["before"]]
        draw_grid(ax, show, n)
        show = [[dict(c, label=label(c["from"], n, c["chunk"] if chunked else None)) for c in row] for row in p["after"]]
        draw_grid(ax, show, n, x0=n + 1.6, names=False, dim=[not d for d in p["defined"]])
        ax.annotate("", xy=(n + 1.3, n / 2), xytext=(n + 0.3, n / 2), arrowprops=dict(arrowstyle="-|>", color="gray", lw=2))
        ax.set(xlim=(-1.5, 2 * n + 1.7), ylim=(-0.3, n + 0.1))
        ax.set_title(CAPTIONS[name] + ("\n(faded: undefined by the API; ours leaves it)" if not all(p["defined"]) else ""),
                     fontsize=10)
        ax.axis("off")
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def plot_ring_steps(trace, first, last):
    """Steps first..last (at most 4) of the ring all-reduce: per step, rows are ranks and columns chunks; a
    cell's stripes are the ranks its value sums (a = rank 0, Σ = all); a black border marks what just arrived."""
    import matplotlib.pyplot as plt

    n, steps = trace["n"], range(first, last + 1)
    fig, axes = plt.subplots(1, len(steps), figsize=(2.75 * len(steps) + 0.6, 0.5 * n + 1.2), squeeze=False)
    for i, (ax, k) in enumerate(zip(axes[0], steps)):
        frame = trace["frames"][k]
        rows = [[dict(c, **{"from": c["sources"], "label": label(c["sources"], n)}) for c in row] for row in frame["state"]]
        draw_grid(ax, rows, n, names=i == 0, marked={(m["dst"], m["chunk"]) for m in frame["messages"]})
        for c in range(n):
            ax.text(c + 0.5, n - 0.05, f"chunk {c}", ha="center", va="bottom", fontsize=8, color="dimgray")
        ax.set(xlim=(-1.3 if i == 0 else -0.1, n + 0.1), ylim=(-0.1, n + 0.3), title=f"step {k}: {frame['phase']}")
        ax.axis("off")
    fig.tight_layout()
    return fig


def plot_ring_step(trace, step):
    """The ring all-reduce after `step` (0 = the start): ranks around a circle, each with its n chunks and their
    values; arrows are this step's messages, a black border marks the chunk just received."""
    import matplotlib.pyplot as plt

    n, frame = trace["n"], trace["frames"][step]
    fig, ax = plt.subplots(figsize=(9, 6.8))
    radius, width = 2.6, float(n)
    centres = [(radius * math.sin(2 * math.pi * r / n), radius * math.cos(2 * math.pi * r / n)) for r in range(n)]
    for r, (cx, cy) in enumerate(centres):
        ax.text(cx, cy + 0.75, f"rank {r}", ha="center", fontsize=10, color=RANK_COLORS[r], fontweight="bold")
        for c, cell in enumerate(frame["state"][r]):
            ax.text(cx - width / 2 + c + 0.5, cy - 0.65, f"{cell['value']}", ha="center", va="center", fontsize=8,
                    color="dimgray")
    for r, (cx, cy) in enumerate(centres):
        row = [{"from": c["sources"], "label": label(c["sources"], n, j)} for j, c in enumerate(frame["state"][r])]
        draw_grid(ax, [row], 1, x0=cx - width / 2, y0=cy - 0.4, names=False, fontsize=8,
                  marked={(0, m["chunk"]) for m in frame["messages"] if m["dst"] == r})
    for m in frame["messages"]:
        (x0, y0), (x1, y1) = centres[m["src"]], centres[m["dst"]]
        dx, dy = x1 - x0, y1 - y0
        d = math.hypot(dx, dy)
        s = 1.25 / d
        ax.annotate("", xy=(x1 - dx * s, y1 - dy * s), xytext=(x0 + dx * s, y0 + dy * s),
                    arrowprops=dict(arrowstyle="-|>", lw=2, color="gray", connectionstyle="arc3,rad=0.25"))
        ax.text((x0 + x1) / 2 + 0.42 * dy / d, (y0 + y1) / 2 - 0.42 * dx / d, f"{label(m['sources'], n, m['chunk'])}\n"
                f"={m['value']}", ha="center", va="center", fontsize=9, bbox=dict(boxstyle="round", fc="white", ec="lightgray"))
    what = {"start": "start: rank r holds its own tensor, cut into n chunks",
            "reduce-scatter": "reduce-scatter: send one chunk right, ADD the one received",
            "all-gather": "all-gather: send one finished chunk right, COPY the one received"}[frame["phase"]]
    ax.set_title(f"ring all-reduce, step {step}/{len(trace['frames']) - 1} — {what}", fontsize=11)
    ax.set(xlim=(-radius - width / 2 - 0.5, radius + width / 2 + 0.5), ylim=(-radius - 1.2, radius + 1.3), aspect="equal")
    ax.axis("off")
    return fig


def plot_bandwidth(bw, names):
    """busbw against message size, ours (filled) and the built-in (hollow), each with its alpha-beta fit drawn as
    the bus bandwidth it predicts, factor * N / (alpha + beta N)."""
    import numpy as np

    panels = []
    for name in names:
        r = bw["results"][name]
        x = np.array(r["bytes"], float)
        grid = np.geomspace(x[0], x[-1], 100)
        lines = []
        for impl, who, color, face in (("ours", "ours", "#c44e52", "#c44e52"), ("builtin", "built-in", "#4c72b0", "white")):
            fit = r[impl]["fit"]
            lines += [(f"{who}, measured", x, r[impl]["busbw"], dict(ls="", marker="o", color=color, mfc=face, ms=5)),
                      (f"{who}, α–β fit", grid, r["factor"] * grid / (fit["alpha"] + fit["beta"] * grid) / 1e9,
                       dict(ls="--", color=color, lw=1))]
        panels.append(dict(title=name, ylabel="busbw GB/s", lines=lines, ylim0=True))
    return plot_panels(panels, "bytes (nccl-tests size)", size=(4.8, 3.0))


def plot_ratio(bw):
    import matplotlib.pyplot as plt

    names = list(bw["ratio"])
    fig, ax = plt.subplots(figsize=(9, 3))
    ax.bar(range(len(names)), [bw["ratio"][k] for k in names],
           color=["#c44e52" if k == "all_reduce" else "#8c8c8c" for k in names])
    ax.axhline(1.0, color="k", lw=1)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=9)
    ax.set(ylabel="busbw ours / built-in",
           title=f"at {bw['ratio_at'] // MiB} MiB, {bw['world_size']} ranks (> 1: ours is faster)")
    fig.tight_layout()
    return fig


def plot_naive_vs_ring(bw):
    """Time and busbw against size: ring all-reduce (ours), tree reduce + broadcast (ours), the built-in."""
    ring, naive = bw["results"]["all_reduce"], bw["results"]["naive_all_reduce"]
    series = (("ring all-reduce (ours)", ring["ours"], "#c44e52"), ("tree reduce + tree broadcast (ours)", naive["ours"],
              "#55a868"), ("built-in all_reduce", ring["builtin"], "#4c72b0"))
    return plot_panels([dict(title=title, ylabel=ylabel, yscale=yscale, lines=[
        (name, ring["bytes"], [scale * v for v in s[key]], dict(marker="o", ms=3, color=color)) for name, s, color in series])
        for title, ylabel, key, scale, yscale in (("time", "ms", "time", 1e3, "log"),
                                                  ("bus bandwidth, 2(n−1)/n · M / time", "busbw GB/s", "busbw", 1, "linear"))],
        "bytes")


def plot_model(ns, alpha, beta, sizes=None, ratio=True):
    """The alpha-beta model over message sizes: T_tree / T_ring per world size (ratio=True; dots at the
    crossovers, below 1 the tree wins), or both times for one world size."""
    import numpy as np

    sizes = np.geomspace(KiB, 1024 * MiB, 200) if sizes is None else np.asarray(sizes, float)
    colors = [f"C{i}" for i in range(len(ns))]
    if not ratio:
        n = ns[0]
        lines = [("ring: 2(n−1)α + 2(n−1)/n·Nβ", sizes, ring_allreduce_time(n, sizes, alpha, beta) * 1e3, {}),
                 ("tree: 2⌈log₂n⌉(α + Nβ)", sizes, tree_allreduce_time(n, sizes, alpha, beta) * 1e3, {})]
        x = crossover_bytes(n, alpha, beta)
        title = f"n = {n}: the tree wins below {x / MiB:.2f} MiB" if x else f"n = {n}: the tree never wins"
        return plot_panels([dict(title=title, ylabel="ms", yscale="log", lines=lines)], "message bytes M", size=(7, 3.4))
    lines = []
    for n, color in zip(ns, colors):
        ratio = tree_allreduce_time(n, sizes, alpha, beta) / ring_allreduce_time(n, sizes, alpha, beta)
        lines.append((f"n = {n}", sizes, ratio, dict(color=color)))
        x = crossover_bytes(n, alpha, beta)
        if x:
            lines.append(("crossover: tree = ring", [x], [1], dict(ls="", marker="o", color=color, mec="k")))
    return plot_panels([dict(title=f"α = {alpha * 1e6:.0f} µs per message, 1/β = {1e-9 / beta:.2f} GB/s per link",
                             ylabel="T_tree / T_ring", yscale="log", hline=1, lines=lines)], "message bytes M", size=(7, 3.4))


def plot_ring_variants(ring):
    """Time of the four all-reduces over message sizes, and each one's time over the simple ring's; dashed: the
    one-piece ring minus every addition it makes (n-1 chunks), the best pipelining could do."""
    n, x, T = ring["world_size"], ring["sizes"], ring["time"]
    names = {"simple": "simple_ring_all_reduce (one chunk per step)",
             "one piece": "picotron's ring, one piece per chunk (double-buffered)",
             "pieces": f"picotron's ring, {ring['piece_bytes'] // MiB} MiB pieces (pipelined)", "built-in": "built-in (gloo)"}
    colors = dict(zip(names, ("#8c8c8c", "#4c72b0", "#c44e52", "#55a868")))
    best = [max(t - (n - 1) * a, 0) / s for t, a, s in zip(T["one piece"], ring["add"], T["simple"])]
    return plot_panels([
        dict(title="time", ylabel="ms", yscale="log", lines=[(names[k], x, [1e3 * v for v in T[k]],
                                                             dict(marker="o", ms=3, color=colors[k])) for k in names]),
        dict(title="time / time of the simple ring (< 1: faster)", ylabel="ratio", hline=1, lines=[
            (names[k], x, [v / s for v, s in zip(T[k], T["simple"])], dict(marker="o", ms=3, color=colors[k]))
            for k in names if k != "simple"] + [("one piece, if all n−1 additions were hidden", x, best,
                                                 dict(ls="--", color=colors["pieces"]))])], "bytes")


EXPERIMENTS = ("correctness", "trace", "ring", "bandwidth")


def configs_at(nproc, fast=False):
    """The Configs this lesson trains on `nproc` processes: none. Its experiments time collectives on buffers at the
    world size torchrun gives them (the notebook's NPROC: 4, or 8 with PICOTRON_NPROC=8), with no training run."""
    return []


def main(argv=None):
    args, names, out = _common.cli("02_collectives", EXPERIMENTS, __doc__, argv=argv, extra=[
        (["--no-timing"], dict(action="store_true", help="ring: check results and bytes only"))])
    global DEVICE
    mesh = Mesh.init(dp=int(os.environ.get("WORLD_SIZE", "1")), device=_common.experiment_device("02_collectives"))
    DEVICE = mesh.device
    if DEVICE.type == "cuda":  # every tensor the experiments make lives where the collectives run (nccl)
        torch.set_default_device(DEVICE)
    with mesh:  # on success every rank meets at a barrier before the groups go (Mesh.destroy)
        _common.run_experiments(
            names, lambda name: globals()[f"exp_{name}"](mesh, args.fast, out, **(
                dict(timing=not args.no_timing) if name == "ring" else {})),
            lambda name: out / f"{name}.json", _common.environment(mesh, fast=args.fast, cpus=os.cpu_count()),
            mesh.rank, after=lambda name: dist.barrier())


if __name__ == "__main__":
    main()
