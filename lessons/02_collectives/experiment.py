"""Lesson 02, the experiment: the collectives of picotron/collectives.py (written from send/recv) next to
torch.distributed's own, on N processes, in one run.

    torchrun --nproc_per_node 4 lessons/02_collectives/experiment.py --out runs/lessons/02_collectives [--only bandwidth]
    PICOTRON_FAST=1 torchrun ...   (or --fast)    short settings: 1 KiB .. 16 MiB, fewer repeats (CI, ~1 min)

Each experiment writes OUT/<name>.json, which the notebook plots:
    correctness  every collective, ours and the built-in on the same inputs: int64 (must be bit for bit) and
                 float32, SUM/MAX/MIN/AVG, on the whole world and on a sub-group of non-contiguous ranks; and
                 the before/after "pictures" (which rank's chunk ends up where) from our implementation
    trace        the ring all-reduce recorded message by message (who sends which chunk to whom in each of the
                 2(n-1) steps, with the values), and the bytes every rank sends in every collective
    bandwidth    time, algbw and busbw (nccl-tests convention) from 1 KiB to 64 MiB, ours and the built-in
                 interleaved repeat by repeat; alpha-beta fits; the ours / built-in ratio at 16 MiB
Timing: warm-up, then for each repeat a barrier, the call, and the time on every rank; a repeat's time is the
slowest rank's (a collective is done when the last rank is done); we report the median over repeats.
The fit, model and plot_* functions are imported by the notebook (`_common.load_lesson("02_collectives")`).
"""
import argparse
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
BUILTIN_OF = {"naive_all_reduce": "all_reduce"}  # what each of ours is measured against
RATIO_AT = 16 * MiB
SETTINGS = {  # sizes are nccl-tests "bytes": the whole buffer of all_reduce, the whole output of all_gather, ...
    "fast": dict(sizes=[KiB * 4**k for k in range(8)], warmup=1, min_repeats=5, max_repeats=15, budget_s=0.25),
    "full": dict(sizes=[KiB * 2**k for k in range(17)], warmup=2, min_repeats=7, max_repeats=60, budget_s=1.2),
}


# --------------------------------------------------------------------------- the calls, ours and built-in
def calls(name, nbytes, n, rank, device, root=0, dtype=torch.float32):
    """Buffers for one collective at message size `nbytes` (nccl-tests convention) and the two calls on them,
    {"ours": fn, "builtin": fn}, plus the exact size in bytes. Both write into the same buffers (zeros, so
    repeated in-place sums never overflow); only the time matters here."""
    el = torch.tensor([], dtype=dtype).element_size()
    m = max(1, nbytes // (el * n))  # elements of one rank's piece

    def z(k):
        return torch.zeros(k, dtype=dtype, device=device)

    lib = {"ours": C, "builtin": dist}
    if name in ("broadcast", "reduce", "all_reduce", "naive_all_reduce"):
        t = z(max(1, nbytes // el))
        size = t.numel() * el
        fns = {"broadcast": lambda L: L.broadcast(t, src=root), "reduce": lambda L: L.reduce(t, dst=root),
               "all_reduce": lambda L: L.all_reduce(t),
               "naive_all_reduce": lambda L: (L.naive_all_reduce if L is C else L.all_reduce)(t)}[name]
        return {k: (lambda L=L: fns(L)) for k, L in lib.items()}, size
    size = m * n * el
    if name == "gather":
        x, outs = z(m), [z(m) for _ in range(n)] if rank == root else None
        fns = lambda L: L.gather(x, outs, dst=root)  # noqa: E731
    elif name == "all_gather":
        x, outs = z(m), [z(m) for _ in range(n)]
        fns = lambda L: L.all_gather(outs, x)  # noqa: E731
    elif name == "all_gather_into_tensor":
        x, out = z(m), z(m * n)
        fns = lambda L: L.all_gather_into_tensor(out, x)  # noqa: E731
    elif name == "scatter":
        out, ins = z(m), [z(m) for _ in range(n)] if rank == root else None
        fns = lambda L: L.scatter(out, ins, src=root)  # noqa: E731
    elif name == "reduce_scatter":
        out, ins = z(m), [z(m) for _ in range(n)]
        fns = lambda L: L.reduce_scatter(out, ins)  # noqa: E731
    elif name == "reduce_scatter_tensor":
        out, inp = z(m), z(m * n)
        fns = lambda L: L.reduce_scatter_tensor(out, inp)  # noqa: E731
    elif name == "all_to_all":
        outs, ins = [z(m) for _ in range(n)], [z(m) for _ in range(n)]
        fns = lambda L: L.all_to_all(outs, ins)  # noqa: E731
    else:
        raise ValueError(f"unknown collective {name!r}; pick from {COLLECTIVES}")
    return {k: (lambda L=L: fns(L)) for k, L in lib.items()}, size


# ---------------------------------------------------------------------------------------------- timing
def max_over_ranks(values, device):
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def timed(fn, device):
    dist.barrier()  # everybody starts together
    metrics.sync(device)
    t0 = time.perf_counter()
    fn()
    metrics.sync(device)
    return time.perf_counter() - t0


def measure(fns, device, s):
    """Median over repeats of the slowest rank's time, for each fn; the fns take turns within every repeat
    (and which goes first alternates) so that a disturbance (another process on a shared machine) hits them
    alike. Returns (medians, repeats)."""
    for _ in range(s["warmup"]):
        for f in fns:
            f()
    probe = max_over_ranks([sum(timed(f, device) for f in fns)], device)[0]  # the same on every rank
    repeats = int(min(max(s["budget_s"] / max(probe, 1e-9), s["min_repeats"]), s["max_repeats"]))
    times = [[] for _ in fns]
    for k in range(repeats):
        order = list(enumerate(fns))
        for i, f in order if k % 2 == 0 else order[::-1]:  # who goes first alternates, too
            times[i].append(timed(f, device))
    slowest = max_over_ranks([t for row in times for t in row], device)  # max over ranks, repeat by repeat
    return [statistics.median(slowest[i * repeats:(i + 1) * repeats]) for i in range(len(fns))], repeats


# ------------------------------------------------------------------------------------- alpha-beta model
def fit_alpha_beta(nbytes, seconds):
    """T = alpha + beta * bytes by least squares on the RELATIVE error (each size counts the same, as on a
    log-log plot; plain least squares would fit only the largest sizes). alpha >= 0, beta > 0.
    Returns alpha (s), beta (s/byte), alpha_us, inv_beta_GBps (1/beta: the large-message algbw) and the
    worst relative misfit."""
    import numpy as np

    x, y = np.asarray(nbytes, float), np.asarray(seconds, float)
    (alpha, beta), *_ = np.linalg.lstsq(np.stack([1 / y, x / y], 1), np.ones_like(y), rcond=None)
    if alpha < 0:  # no measurable latency: fit through the origin
        alpha, beta = 0.0, float(np.sum(x / y) / np.sum((x / y) ** 2))
    if beta <= 0:  # latency-bound at every size
        beta = 1e-15
    misfit = float(np.max(np.abs((alpha + beta * x) / y - 1)))
    return dict(alpha=float(alpha), beta=float(beta), alpha_us=1e6 * float(alpha), inv_beta_GBps=1e-9 / float(beta),
                max_rel_err=misfit)


def model_time(fit, nbytes):
    return fit["alpha"] + fit["beta"] * nbytes


def per_link(fit, n):
    """The ring all-reduce fit T = a + b*N read as T = 2(n-1)*alpha_step + 2(n-1)/n * N * beta_link: one
    message's latency and one link's time per byte (1/beta_link = the busbw asymptote)."""
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


# ---------------------------------------------------------------------------------- watching send/recv
class _Watched:
    """A request whose wait() also records the received data (it exists only once the receive completed)."""

    def __init__(self, work, done):
        self.work, self.done, self.fired = work, done, False

    def wait(self, *args, **kwargs):
        result = self.work.wait(*args, **kwargs)
        if not self.fired:
            self.fired = True
            self.done()
        return result

    def __getattr__(self, name):
        return getattr(self.work, name)


class Recorder:
    """While active, records every point-to-point call made through torch.distributed (send, recv, isend,
    irecv) as {kind, peer, nbytes[, data]}: picotron.collectives looks up dist.isend & co. at call time, so
    swapping the module's attributes sees every message it sends. With keep_values, a copy of the bytes sent
    (at the send) and received (once the receive has completed)."""
    NAMES = ("send", "recv", "isend", "irecv")

    def __init__(self, keep_values=False):
        self.keep_values, self.events = keep_values, []

    def _event(self, kind, tensor, peer):
        event = dict(kind=kind, peer=None if peer is None else int(peer), nbytes=tensor.numel() * tensor.element_size())
        self.events.append(event)
        return event

    def _keep(self, event, tensor):
        if self.keep_values:
            event["data"] = tensor.detach().cpu().clone()

    def __enter__(self):
        real = self.real = {name: getattr(dist, name) for name in self.NAMES}

        def make_send(name):
            def send(tensor, dst=None, *args, **kwargs):
                self._keep(self._event("send", tensor, dst if dst is not None else kwargs.get("group_dst")), tensor)
                return real[name](tensor, dst, *args, **kwargs)
            return send

        def irecv(tensor, src=None, *args, **kwargs):
            event = self._event("recv", tensor, src if src is not None else kwargs.get("group_src"))
            return _Watched(real["irecv"](tensor, src, *args, **kwargs), lambda: self._keep(event, tensor))

        def recv(tensor, src=None, *args, **kwargs):
            event = self._event("recv", tensor, src if src is not None else kwargs.get("group_src"))
            result = real["recv"](tensor, src, *args, **kwargs)
            self._keep(event, tensor)
            return result

        dist.send, dist.isend, dist.irecv, dist.recv = make_send("send"), make_send("isend"), irecv, recv
        return self

    def __exit__(self, *exc):
        for name, fn in self.real.items():
            setattr(dist, name, fn)

    def of(self, kind):
        return [e for e in self.events if e["kind"] == kind]


# ------------------------------------------------------------------------------------- chunk encoding
# For the pictures and the trace, every element says where it came from: rank r's chunk c holds
# 2**r + 256*c, so a sum over a set S of ranks of chunk c is (bitmask of S) + 256*c*|S|, which decodes back
# to (S, c) whatever the algorithm added in which order (integers: exact). n <= 8.
def encode(rank, chunk):
    return (1 << rank) + 256 * chunk


def decode(value):
    mask = int(value) % 256
    sources = [r for r in range(8) if mask >> r & 1]
    return sources, (int(value) // 256) // max(1, len(sources))


def cells(tensor_or_list):
    """A rank's buffer(s) as decoded cells [{from: [ranks], chunk: c}]."""
    values = torch.cat([t.reshape(-1) for t in tensor_or_list]) if isinstance(tensor_or_list, (list, tuple)) \
        else tensor_or_list.reshape(-1)
    return [dict(zip(("from", "chunk"), decode(v))) for v in values.tolist()]


# ---------------------------------------------------------------------------------------- experiments
def exp_correctness(mesh, fast, out):
    """Ours == built-in for every collective: int64 must be bit for bit, float32 is reported (|diff|, bits)."""
    n, rank, device = mesh.world_size, mesh.rank, mesh.device
    sub = sorted(set(range(0, n, 2)) | {n - 1}) if n >= 3 else list(range(n))  # n=4: [0, 2, 3]
    sub_group = dist.new_group(sub)
    rows = []
    settings = [("world", None, list(range(n))), (f"ranks {sub}", sub_group, sub)]
    cases = [(name, torch.int64, dist.ReduceOp.SUM) for name in COLLECTIVES] + \
            [(name, torch.int64, op) for name in ("all_reduce", "reduce", "reduce_scatter_tensor")
             for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN)] + \
            [(name, torch.float32, dist.ReduceOp.SUM) for name in COLLECTIVES] + [("all_reduce", torch.float32, dist.ReduceOp.AVG)]
    for where, group, members in settings:
        root = members[-1]  # a root that is neither 0 nor (in the sub-group) its own group rank
        for i, (name, dtype, op) in enumerate(cases):
            ours = run_case(name, C, group, members, dtype, op, root, seed=i, device=device)
            builtin = run_case(name, dist, group, members, dtype, op, root, seed=i, device=device)
            unequal = sum(not torch.equal(a, b) for a, b in zip(ours, builtin)) + (len(ours) != len(builtin))
            diff = max([(a.double() - b.double()).abs().max().item() for a, b in zip(ours, builtin) if a.numel()] or [0.0])
            unequal, diff = max_over_ranks([float(unequal), diff], device)
            rows.append(dict(collective=name, group=where, dtype=str(dtype).replace("torch.", ""),
                             op=str(op).split(".")[-1], root=root, bitwise_equal=unequal == 0, max_abs_diff=diff))
            if rank == 0 and (dtype == torch.int64 and unequal or diff > 1e-3):
                print(f"MISMATCH {rows[-1]}", flush=True)
    dist.barrier()
    ints, floats = [r for r in rows if r["dtype"] == "int64"], [r for r in rows if r["dtype"] == "float32"]
    if rank == 0:
        print(f"correctness: int64 bit for bit {sum(r['bitwise_equal'] for r in ints)}/{len(ints)}; float32 bit for bit "
              f"{sum(r['bitwise_equal'] for r in floats)}/{len(floats)}, max |diff| "
              f"{max(r['max_abs_diff'] for r in floats):.2e}", flush=True)
    return dict(world_size=n, sub_group=sub, rows=rows, pictures=pictures(mesh))


def run_case(name, L, group, members, dtype, op, root, seed, device, length=1001, piece=333):
    """Call collective `name` of library L (picotron.collectives or torch.distributed) once on fresh inputs
    (the same for both libraries: seeded by case and rank); return this rank's DEFINED outputs (for reduce
    only dst's tensor, for gather only dst's list)."""
    rank = dist.get_rank()
    if rank not in members:
        return []
    n = len(members)
    g = torch.Generator().manual_seed(1000 * seed + rank)

    def rand(k):
        x = torch.randint(-1000, 1000, (k,), generator=g) if dtype == torch.int64 else torch.randn(k, generator=g)
        return x.to(device)

    def empty(k):
        return torch.full((k,), -7, dtype=dtype, device=device)

    kw = dict(group=group)
    if name in ("all_reduce", "naive_all_reduce"):
        t = rand(length)
        (C.naive_all_reduce if name == "naive_all_reduce" and L is C else L.all_reduce)(t, op=op, **kw)
        return [t]
    if name == "broadcast":
        t = rand(length)
        L.broadcast(t, src=root, **kw)
        return [t]
    if name == "reduce":
        t = rand(length)
        L.reduce(t, dst=root, op=op, **kw)
        return [t] if rank == root else []
    if name == "gather":
        x, outs = rand(piece), [empty(piece) for _ in range(n)] if rank == root else None
        L.gather(x, outs, dst=root, **kw)
        return outs or []
    if name == "all_gather":
        x, outs = rand(piece), [empty(piece) for _ in range(n)]
        L.all_gather(outs, x, **kw)
        return outs
    if name == "all_gather_into_tensor":
        x, out = rand(piece), empty(piece * n)
        L.all_gather_into_tensor(out, x, **kw)
        return [out]
    if name == "scatter":
        out, ins = empty(piece), [rand(piece) for _ in range(n)] if rank == root else None
        L.scatter(out, ins, src=root, **kw)
        return [out]
    if name == "reduce_scatter":
        out, ins = empty(piece), [rand(piece) for _ in range(n)]
        L.reduce_scatter(out, ins, op=op, **kw)
        return [out]
    if name == "reduce_scatter_tensor":
        out, inp = empty(piece), rand(piece * n)
        L.reduce_scatter_tensor(out, inp, op=op, **kw)
        return [out]
    if name == "all_to_all":
        outs, ins = [empty(piece) for _ in range(n)], [rand(piece) for _ in range(n)]
        L.all_to_all(outs, ins, **kw)
        return outs
    raise ValueError(name)


PICTURES = ("broadcast", "scatter", "gather", "all_gather", "all_to_all", "reduce", "all_reduce", "reduce_scatter")


def pictures(mesh):
    """Before/after of each collective, from OUR implementation on encoded chunks (rank r's chunk c is
    2**r + 256*c), checked against the built-in on the same input wherever the API defines the result. Root 0. Returns {name: {before, after,
    defined, root, equal_builtin}} with per-rank lists of decoded cells ([] = no buffer on that rank)."""
    n, rank, device = mesh.world_size, mesh.rank, mesh.device
    root, result = 0, {}

    def chunks(count=n):
        return torch.tensor([encode(rank, c) for c in range(count)], dtype=torch.int64, device=device)

    for name in PICTURES:
        afters = []
        for L in (C, dist):
            own, single = chunks(), chunks(1)
            if name in ("broadcast", "reduce", "all_reduce"):
                before, t = [own], own.clone()
                {"broadcast": lambda: L.broadcast(t, src=root), "reduce": lambda: L.reduce(t, dst=root),
                 "all_reduce": lambda: L.all_reduce(t)}[name]()
                after = [t]
            elif name == "gather":
                before, outs = [single], [torch.zeros_like(single) for _ in range(n)] if rank == root else None
                L.gather(single, outs, dst=root)
                after = outs or []
            elif name == "all_gather":
                before, outs = [single], [torch.zeros_like(single) for _ in range(n)]
                L.all_gather(outs, single)
                after = outs
            elif name == "scatter":
                ins = list(own.split(1)) if rank == root else None
                before, out = ins or [], torch.zeros_like(single)
                L.scatter(out, ins, src=root)
                after = [out]
            elif name == "reduce_scatter":
                before, out = list(own.split(1)), torch.zeros_like(single)
                L.reduce_scatter(out, [x.clone() for x in before])
                after = [out]
            else:  # all_to_all
                before, outs = list(own.split(1)), [torch.zeros_like(single) for _ in range(n)]
                L.all_to_all(outs, [x.clone() for x in before])
                after = outs
            afters.append((before, after))
        (before, after), (_, after_builtin) = afters
        defined = not (name == "reduce" and rank != root)  # reduce leaves the others' tensors undefined
        equal = not defined or (len(after) == len(after_builtin) and all(map(torch.equal, after, after_builtin)))
        mine = dict(before=cells(before) if before else [], after=cells(after) if after else [],
                    defined=defined, equal=equal)
        everyone = [None] * n
        dist.all_gather_object(everyone, mine)
        result[name] = dict(before=[e["before"] for e in everyone], after=[e["after"] for e in everyone],
                            defined=[e["defined"] for e in everyone], root=root,
                            equal_builtin=all(e["equal"] for e in everyone))
    return result


VOLUME_BYTES = 768 * KiB  # divisible by 2, 3, 4, 6, 8: exact per-rank shares; below PIECE_BYTES per chunk


def exp_trace(mesh, fast, out):
    """The ring all-reduce, message by message, and the bytes each rank sends in every collective."""
    n, rank, device = mesh.world_size, mesh.rank, mesh.device
    runs = {}
    for kind, values in (("encoded", [encode(rank, c) for c in range(n)]),
                         ("values", [10 * (rank + 1) + c for c in range(n)])):  # rank 0: 10 11 12 13, rank 1: 20 ...
        x = torch.tensor(values, dtype=torch.int64, device=device)
        with Recorder(keep_values=True) as rec:
            C.all_reduce(x)
        runs[kind] = dict(
            sends=[(e["peer"], e["data"].view(torch.int64).tolist()) for e in rec.of("send")],
            recvs=[(e["peer"], e["data"].view(torch.int64).tolist()) for e in rec.of("recv")],
            start=values, final=x.cpu().tolist())
    everyone = [None] * n
    dist.all_gather_object(everyone, runs)
    trace = build_trace(everyone, n)

    volume = {}
    for name in COLLECTIVES + ("barrier",):
        if name == "barrier":
            fn, size = C.barrier, 0
        else:
            fns, size = calls(name, VOLUME_BYTES, n, rank, device)
            fn = fns["ours"]
        dist.barrier()
        with Recorder() as rec:
            fn()
        mine = [sum(e["nbytes"] for e in rec.of("send")), sum(e["nbytes"] for e in rec.of("recv")),
                len(rec.of("send")), len(rec.of("recv"))]
        everyone = [None] * n
        dist.all_gather_object(everyone, mine)
        volume[name] = dict(bytes=size, sent=[e[0] for e in everyone], received=[e[1] for e in everyone],
                            messages_sent=[e[2] for e in everyone], messages_received=[e[3] for e in everyone],
                            expected_sent=expected_sent(name, n, size))
    if rank == 0:
        print(f"trace: {len(trace['frames']) - 1} steps on {n} ranks, derived state == all_reduce's result: "
              f"{trace['consistent']}", flush=True)
        for name, v in volume.items():
            print(f"volume  {name:<24} N={v['bytes']:>8,} B  sent per rank {v['sent']}  expected {v['expected_sent']}",
                  flush=True)
    return dict(world_size=n, ring=trace, volume=volume)


def build_trace(per_rank, n):
    """Frames of the ring all-reduce: frame 0 is the start, frame k the state after step k and the messages
    of step k. Rank r's k-th send is its message of step k; what it receives in step k is added into its
    chunk (reduce-scatter: the chunk does not contain r's contribution yet) or copied over it (all-gather)."""
    def cell(sources, chunk, value):
        return dict(sources=sorted(sources), chunk=chunk, value=value)

    state = [[cell([r], c, per_rank[r]["values"]["start"][c]) for c in range(n)] for r in range(n)]
    frames = [dict(step=0, phase="start", messages=[], state=copy.deepcopy(state))]
    for k in range(len(per_rank[0]["encoded"]["sends"])):
        messages = []
        for r in range(n):
            peer, (code,) = per_rank[r]["encoded"]["sends"][k]
            _, (value,) = per_rank[r]["values"]["sends"][k]
            sources, chunk = decode(code)
            messages.append(dict(src=r, dst=peer, chunk=chunk, sources=sources, value=value))
        for r in range(n):
            _, (code,) = per_rank[r]["encoded"]["recvs"][k]
            _, (value,) = per_rank[r]["values"]["recvs"][k]
            sources, chunk = decode(code)
            old = state[r][chunk]
            if r in sources:  # all-gather: a finished chunk replaces ours
                state[r][chunk] = cell(sources, chunk, value)
            else:  # reduce-scatter: one more contribution
                state[r][chunk] = cell(old["sources"] + sources, chunk, old["value"] + value)
        phase = "reduce-scatter" if any(len(m["sources"]) < n for m in messages) else "all-gather"
        frames.append(dict(step=k + 1, phase=phase, messages=messages, state=copy.deepcopy(state)))
    consistent = all(decode(per_rank[r]["encoded"]["final"][c]) == (state[r][c]["sources"], c)
                     and per_rank[r]["values"]["final"][c] == state[r][c]["value"] for r in range(n) for c in range(n))
    return dict(n=n, frames=frames, consistent=consistent)


def expected_sent(name, n, N, root=0):
    """Bytes each rank sends in OUR algorithms (N in the nccl-tests convention, divisible by n), root 0."""
    share = N // n
    if name == "barrier":
        return [math.ceil(math.log2(n))] * n if n > 1 else [0]  # 1-byte tokens
    if name == "all_reduce":
        return [2 * (n - 1) * share] * n
    if name in ("reduce_scatter", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor", "all_to_all"):
        return [(n - 1) * share] * n
    if name == "gather":
        return [0 if r == root else share for r in range(n)]
    if name == "scatter":
        return [(n - 1) * share if r == root else 0 for r in range(n)]

    def children(v):  # binomial tree, relative ranks: v sends to v + 2^j for every 2^j below its lowest set bit
        limit = v & -v if v else 1 << math.ceil(math.log2(n))  # the root: every 2^j < n
        return sum(1 for j in range(n.bit_length() + 1) if (1 << j) < limit and v + (1 << j) < n)
    tree_bcast = [children((r - root) % n) * N for r in range(n)]
    tree_reduce = [0 if r == root else N for r in range(n)]
    return {"broadcast": tree_bcast, "reduce": tree_reduce,
            "naive_all_reduce": [a + b for a, b in zip(tree_bcast, tree_reduce)]}[name]


def exp_bandwidth(mesh, fast, out, max_bytes=None, collectives=COLLECTIVES, min_repeats=None):
    n, rank, device = mesh.world_size, mesh.rank, mesh.device
    s = dict(SETTINGS["fast" if fast else "full"])
    if min_repeats:
        s.update(min_repeats=min_repeats, max_repeats=max(min_repeats, s["max_repeats"]))
    sizes = [b for b in s["sizes"] if max_bytes is None or b <= max_bytes]
    results = {}
    for name in collectives:
        rows = dict(bytes=[], repeats=[], ours=[], builtin=[])
        for nbytes in sizes:
            fns, size = calls(name, nbytes, n, rank, device)
            (t_ours, t_builtin), repeats = measure([fns["ours"], fns["builtin"]], device, s)
            for key, value in (("bytes", size), ("repeats", repeats), ("ours", t_ours), ("builtin", t_builtin)):
                rows[key].append(value)
            del fns
        factor = C.BUSBW_FACTOR[name](n)
        entry = dict(builtin_name=BUILTIN_OF.get(name, name), factor=factor, bytes=rows["bytes"], repeats=rows["repeats"])
        for impl in ("ours", "builtin"):
            times = rows[impl]
            algbw = [b / t / 1e9 for b, t in zip(rows["bytes"], times)]
            entry[impl] = dict(time=times, algbw=algbw, busbw=[a * factor for a in algbw],
                               fit=fit_alpha_beta(rows["bytes"], times))
        results[name] = entry
        if rank == 0:
            j = rows["bytes"].index(RATIO_AT) if RATIO_AT in rows["bytes"] else len(sizes) - 1
            fo, fb = entry["ours"]["fit"], entry["builtin"]["fit"]
            print(f"{name:<23} {rows['bytes'][j] / MiB:5.0f} MiB: ours {1e3 * rows['ours'][j]:7.2f} ms busbw "
                  f"{entry['ours']['busbw'][j]:6.2f} GB/s | built-in {1e3 * rows['builtin'][j]:7.2f} ms "
                  f"{entry['builtin']['busbw'][j]:6.2f} GB/s | ratio {rows['builtin'][j] / rows['ours'][j]:4.2f} | "
                  f"fit ours a={fo['alpha_us']:7.1f} us 1/b={fo['inv_beta_GBps']:5.2f} GB/s, built-in "
                  f"a={fb['alpha_us']:7.1f} us 1/b={fb['inv_beta_GBps']:5.2f} GB/s", flush=True)
    (t_ours, t_builtin), repeats = measure([C.barrier, dist.barrier], device, dict(s, min_repeats=20, max_repeats=50))
    ratio = {name: r["builtin"]["time"][r["bytes"].index(RATIO_AT)] / r["ours"]["time"][r["bytes"].index(RATIO_AT)]
             for name, r in results.items() if RATIO_AT in r["bytes"]}
    if rank == 0:
        print(f"barrier: ours {1e6 * t_ours:.0f} us, built-in {1e6 * t_builtin:.0f} us", flush=True)
    return dict(world_size=n, sizes=sizes, results=results, barrier=dict(ours=t_ours, builtin=t_builtin, repeats=repeats),
                ratio_at=RATIO_AT, ratio=ratio)


# ------------------------------------------------------------------------ plots (for the notebook)
RANK_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"]
LETTERS = "abcdefgh"
SUBSCRIPT = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")


def cell_label(sources, chunk, n, chunked=True):
    sub = str(chunk).translate(SUBSCRIPT) if chunked else ""
    if len(sources) == n and n > 2:
        return "Σ" + sub
    return "+".join(LETTERS[r] + sub for r in sources)


def draw_cell(ax, x, y, sources, label, w=1.0, h=0.8, dim=False, edge="white", lw=1.0, fontsize=9):
    import matplotlib.patches as patches

    alpha = 0.25 if dim else 1.0
    for i, r in enumerate(sources):  # one stripe per contributing rank
        ax.add_patch(patches.Rectangle((x + i * w / len(sources), y), w / len(sources), h,
                                       color=RANK_COLORS[r % len(RANK_COLORS)], alpha=alpha, lw=0))
    ax.add_patch(patches.Rectangle((x, y), w, h, fill=False, edgecolor=edge, lw=lw))
    ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=fontsize, color="black" if dim else "white",
            fontweight="bold")


def draw_buffers(ax, rows, n, chunked, dim=None, title=""):
    """One row per rank: its cells, left to right."""
    for r, row in enumerate(rows):
        y = n - 1 - r
        ax.text(-0.2, y + 0.4, f"rank {r}", ha="right", va="center", fontsize=9)
        if not row:
            ax.text(0.1, y + 0.4, "—", va="center", color="gray")
        for j, c in enumerate(row):
            draw_cell(ax, j, y, c["from"], cell_label(c["from"], c["chunk"], n, chunked), dim=bool(dim and dim[r]))
    ax.set_xlim(-1.6, max([n] + [len(r) for r in rows]) + 0.1)  # the same scale in every panel
    ax.set_ylim(-0.2, n)
    ax.set_title(title, fontsize=10)
    ax.axis("off")


CAPTIONS = {
    "broadcast": "broadcast(t, src=0): the root's tensor everywhere",
    "scatter": "scatter(out, list, src=0): piece i of the root goes to rank i",
    "gather": "gather(x, list, dst=0): everyone's piece, on the root",
    "all_gather": "all_gather(list, x): everyone's piece, everywhere",
    "all_to_all": "all_to_all(outs, ins): piece j of rank i goes to rank j (a transpose)",
    "reduce": "reduce(t, dst=0): the sum, on the root only",
    "all_reduce": "all_reduce(t): the sum, everywhere",
    "reduce_scatter": "reduce_scatter(out, list): chunk i of the sum, on rank i",
}


def plot_collectives(pics, names):
    """Before → after, per rank, for each collective: colours are the ranks the data came from (stripes: a
    sum of several ranks' data), a letter names the rank, the subscript the chunk."""
    import matplotlib.pyplot as plt

    n = len(next(iter(pics.values()))["before"])
    fig, axes = plt.subplots(len(names), 2, figsize=(9, 0.5 * (n + 1) * len(names)), squeeze=False)
    for (ax1, ax2), name in zip(axes, names):
        p = pics[name]
        chunked = name not in ("gather", "all_gather")  # there every rank has one piece: no subscript
        draw_buffers(ax1, p["before"], n, chunked, title=f"{name}: before")
        undefined = [not d for d in p["defined"]]
        draw_buffers(ax2, p["after"], n, chunked, dim=undefined,
                     title=f"after{' (dimmed: not defined by the API, ours leaves it as it was)' if any(undefined) else ''}")
        ax1.annotate("", xy=(1.08, 0.5), xytext=(1.0, 0.5), xycoords="axes fraction",
                     arrowprops=dict(arrowstyle="-|>", color="gray", lw=2))
        ax2.text(0, -0.15, CAPTIONS.get(name, ""), transform=ax2.transAxes, fontsize=8, color="dimgray", va="top")
    fig.tight_layout()
    return fig


def plot_ring_step(trace, step, ax=None):
    """The ring all-reduce after `step` (0 = the start): ranks around a circle, each with its n chunks;
    arrows are this step's messages (the chunk they carry), a thick border marks the chunk just received."""
    import matplotlib.pyplot as plt

    n, frame = trace["n"], trace["frames"][step]
    if ax is None:
        fig, ax = plt.subplots(figsize=(9, 6.8))
    else:
        fig = ax.figure
    radius, width = 2.6, n * 1.0
    centres = [(radius * math.sin(2 * math.pi * r / n), radius * math.cos(2 * math.pi * r / n)) for r in range(n)]
    received = {(m["dst"], m["chunk"]) for m in frame["messages"]}
    for r, (cx, cy) in enumerate(centres):
        ax.text(cx, cy + 0.75, f"rank {r}", ha="center", fontsize=10, color=RANK_COLORS[r % len(RANK_COLORS)],
                fontweight="bold")
        for c, cell in enumerate(frame["state"][r]):
            x = cx - width / 2 + c
            hit = (r, c) in received
            draw_cell(ax, x, cy - 0.4, cell["sources"], cell_label(cell["sources"], c, n), edge="black" if hit else "white",
                      lw=2.5 if hit else 1.0, fontsize=7)
            ax.text(x + 0.5, cy - 0.65, f"{cell['value']}", ha="center", va="center", fontsize=7, color="dimgray")
    for m in frame["messages"]:
        (x0, y0), (x1, y1) = centres[m["src"]], centres[m["dst"]]
        dx, dy = x1 - x0, y1 - y0
        d = math.hypot(dx, dy)
        shrink = 1.25 / d
        ax.annotate("", xy=(x1 - dx * shrink, y1 - dy * shrink), xytext=(x0 + dx * shrink, y0 + dy * shrink),
                    arrowprops=dict(arrowstyle="-|>", lw=2, color="gray", connectionstyle="arc3,rad=0.25"))
        mx, my = (x0 + x1) / 2 + 0.35 * dy / d * 1.2, (y0 + y1) / 2 - 0.35 * dx / d * 1.2
        ax.text(mx, my, f"{cell_label(m['sources'], m['chunk'], n)}\n={m['value']}", ha="center", va="center",
                fontsize=8, bbox=dict(boxstyle="round", fc="white", ec="lightgray"))
    total = len(trace["frames"]) - 1
    what = {"start": "start: rank r holds its own tensor, cut into n chunks",
            "reduce-scatter": "reduce-scatter: send one chunk right, ADD the one received",
            "all-gather": "all-gather: send one finished chunk right, COPY the one received"}[frame["phase"]]
    ax.set_title(f"ring all-reduce, step {step}/{total} — {what}", fontsize=10)
    ax.set_xlim(-radius - width / 2 - 0.5, radius + width / 2 + 0.5)
    ax.set_ylim(-radius - 1.2, radius + 1.3)
    ax.set_aspect("equal")
    ax.axis("off")
    return fig


def plot_ring_all_steps(trace):
    """Every step of the ring all-reduce side by side: rows are ranks, columns chunks; a black border marks the
    chunk a rank received in that step."""
    import matplotlib.pyplot as plt

    n, frames = trace["n"], trace["frames"]
    fig, axes = plt.subplots(1, len(frames), figsize=(2.1 * len(frames), 0.55 * n + 0.9))
    for ax, frame in zip(axes, frames):
        received = {(m["dst"], m["chunk"]) for m in frame["messages"]}
        for r in range(n):
            for c, cell in enumerate(frame["state"][r]):
                hit = (r, c) in received
                label = cell_label(cell["sources"], c, n) if len(cell["sources"]) in (1, n) else ""  # colours say the rest
                draw_cell(ax, c, n - 1 - r, cell["sources"], label, w=0.95, h=0.85,
                          edge="black" if hit else "white", lw=2 if hit else 0.5, fontsize=6)
        ax.set_xlim(-0.1, n)
        ax.set_ylim(-0.1, n)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(f"step {frame['step']}\n{frame['phase']}", fontsize=8)
    axes[0].text(-0.3, n / 2, "ranks 0..n-1 (top to bottom)", rotation=90, ha="right", va="center", fontsize=7)
    fig.tight_layout()
    return fig


def plot_bandwidth(bw, names=None, metric="busbw"):
    """busbw (or algbw) against message size, ours (filled) vs built-in (hollow), with each alpha-beta fit
    drawn as the bandwidth it predicts: factor * N / (alpha + beta N)."""
    import matplotlib.pyplot as plt
    import numpy as np

    names = names or list(bw["results"])
    cols = 4
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.1 * cols, 2.5 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        r = bw["results"][name]
        x = np.array(r["bytes"], float)
        grid = np.geomspace(x[0], x[-1], 100)
        for impl, color, face in (("ours", "#c44e52", "#c44e52"), ("builtin", "#4c72b0", "white")):
            factor = r["factor"] if metric == "busbw" else 1.0
            ax.plot(x, r[impl][metric], "o", color=color, mfc=face, ms=4,
                    label=f"{'ours' if impl == 'ours' else 'built-in ' + r['builtin_name']}")
            fit = r[impl]["fit"]
            ax.plot(grid, factor * grid / model_time(fit, grid) / 1e9, "--", color=color, lw=1,
                    label=f"α={fit['alpha_us']:.0f}µs 1/β={fit['inv_beta_GBps']:.2f}GB/s")
        ax.set(xscale="log", title=name, xlabel="bytes (nccl-tests size)", ylabel=f"{metric} GB/s")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=6.5, loc="upper left")
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    fig.suptitle(f"{bw['world_size']} ranks: measured {metric} (points) and the α–β model (dashed)", fontsize=10)
    fig.tight_layout()
    return fig


def plot_ratio(bw):
    import matplotlib.pyplot as plt

    names = list(bw["ratio"])
    fig, ax = plt.subplots(figsize=(9, 2.8))
    ax.bar(range(len(names)), [bw["ratio"][k] for k in names], color=["#c44e52" if k == "all_reduce" else "#8c8c8c" for k in names])
    ax.axhline(1.0, color="k", lw=1)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="busbw ours / built-in", title=f"at {bw['ratio_at'] // MiB} MiB, {bw['world_size']} ranks "
           "(> 1: ours is faster)")
    fig.tight_layout()
    return fig


def plot_naive_vs_ring(bw):
    """Time against size: ring all-reduce (ours), naive tree reduce+broadcast (ours), the built-in."""
    import matplotlib.pyplot as plt
    import numpy as np

    ring, naive = bw["results"]["all_reduce"], bw["results"]["naive_all_reduce"]
    x = np.array(ring["bytes"], float)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
    for label, series, color in (("ring all-reduce (ours)", ring["ours"], "#c44e52"),
                                 ("naive: tree reduce + tree broadcast (ours)", naive["ours"], "#55a868"),
                                 ("built-in all_reduce", ring["builtin"], "#4c72b0")):
        ax1.plot(x, np.array(series["time"]) * 1e3, "o-", color=color, ms=3, label=label)
        ax2.plot(x, series["busbw"], "o-", color=color, ms=3, label=label)
    ax1.set(xscale="log", yscale="log", xlabel="bytes", ylabel="ms", title="time")
    ax2.set(xscale="log", xlabel="bytes", ylabel="busbw GB/s", title="bus bandwidth (2(n-1)/n · N / time)")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_tree_vs_ring(alpha, beta, ns=(4, 8, 64, 512), sizes=None):
    """The alpha-beta model: time of the tree all-reduce over the ring's, against message size, for several
    world sizes; below 1 the tree wins. Dots mark the crossovers."""
    import matplotlib.pyplot as plt
    import numpy as np

    sizes = np.geomspace(KiB, 1024 * MiB, 200) if sizes is None else np.asarray(sizes, float)
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for n in ns:
        ratio = tree_allreduce_time(n, sizes, alpha, beta) / ring_allreduce_time(n, sizes, alpha, beta)
        line, = ax.plot(sizes, ratio, label=f"n = {n}")
        x = crossover_bytes(n, alpha, beta)
        if x:
            ax.plot([x], [1], "o", color=line.get_color())
    ax.axhline(1, color="k", lw=1)
    ax.set(xscale="log", yscale="log", xlabel="message bytes N", ylabel="T_tree / T_ring",
           title=f"α = {alpha * 1e6:.1f} µs per message, 1/β = {1e-9 / beta:.2f} GB/s per link")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


EXPERIMENTS = ("correctness", "trace", "bandwidth")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(_common.ROOT / "runs" / "lessons" / "02_collectives"))
    p.add_argument("--only", default=",".join(EXPERIMENTS), help=f"comma-separated subset of {EXPERIMENTS}")
    p.add_argument("--fast", action="store_true", default=_common.FAST, help="short settings (or PICOTRON_FAST=1)")
    p.add_argument("--max-mib", type=float, default=None, help="bandwidth: largest message size in MiB")
    p.add_argument("--collectives", default=",".join(COLLECTIVES), help="bandwidth: comma-separated subset")
    p.add_argument("--min-repeats", type=int, default=None, help="bandwidth: at least this many repeats per size")
    args = p.parse_args(argv)
    names = args.only.split(",")
    if any(name not in EXPERIMENTS for name in names):
        p.error(f"--only {args.only!r}: pick a comma-separated subset of {', '.join(EXPERIMENTS)}")
    collectives = tuple(args.collectives.split(","))
    if any(name not in COLLECTIVES for name in collectives):
        p.error(f"--collectives {args.collectives!r}: pick a comma-separated subset of {', '.join(COLLECTIVES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = Mesh.init(dp=world)
    try:
        env = dict(device=str(mesh.device), backend=mesh.backend, world_size=world, torch=torch.__version__,
                   threads=torch.get_num_threads(), fast=args.fast, cpus=os.cpu_count())
        for name in names:
            t0 = time.perf_counter()
            kwargs = {} if name != "bandwidth" else dict(
                max_bytes=int(args.max_mib * MiB) if args.max_mib else None, collectives=collectives,
                min_repeats=args.min_repeats)
            result = globals()[f"exp_{name}"](mesh, args.fast, out, **kwargs)
            if mesh.rank == 0:
                _common.save_json(dict(env, results=result, seconds=time.perf_counter() - t0), out / f"{name}.json")
                path = os.path.relpath(out / f"{name}.json")
                print(f"== {name}: {time.perf_counter() - t0:.1f} s -> {out / f'{name}.json' if path.startswith('..') else path}",
                      flush=True)
            dist.barrier()
    finally:
        mesh.destroy()


if __name__ == "__main__":
    main()
