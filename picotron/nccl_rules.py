"""NCCL's rules, checked without a GPU: record what every rank sends, receives and reduces (on gloo), then
replay it as NCCL would run it and name the first operation that would wait forever or not match.

gloo forgives what NCCL does not (the same code that trains on a laptop can hang on a pod). The replay holds
each rank's recorded operations to these rules, each from NVIDIA's NCCL user guide
(https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/ , sections named below) or torch's documentation:

  one order            "Using multiple NCCL communicators concurrently" (usage/communicators.html): NCCL kernels
  (several groups)     block waiting for data, any CUDA call may synchronise the device, so "applications should
                       ensure operations are submitted in the same order across ranks"; launching them on
                       different streams "might work provided they can fit within the GPU, but could break at
                       any time". The replay runs each rank's operations, on ALL its communicators, as ONE queue
                       in the order its host issued them, each completing only at the head of that queue and
                       meeting its peers' at the heads of theirs, as if each GPU ran one NCCL kernel at a time.
                       Finishing under it is sufficient for NCCL's rule: there is one order every rank follows.
  send / receive       "Point-to-point communication" (usage/p2p.html) and the ncclSend / ncclRecv API pages:
                       "Rank peer needs to call ncclRecv with the same datatype and the same count"; each call
                       "is blocking for the GPU" until its partner's runs. Single isend/irecv between two ranks
                       go on ONE communicator and ONE stream for both directions (torch's ProcessGroupNCCL makes
                       one per pair), in the order posted, tags ignored; sizes must agree. The pair's
                       communicator is made at their first message, which blocks the host until the peer posts
                       its own first one (torch's `batch_isend_irecv` documentation).
  batch_isend_irecv    "Group calls" (usage/groups.html) and usage/p2p.html: "calls within a group can be seen as
                       progressing independently, hence should never block each other", while the group "will be
                       blocking until that group of calls completes". One grouped call on the group's
                       communicator: its ops are posted together and meet the peers' batches at the head of their
                       queues; it completes as a whole.
  collectives          "CUDA Stream Semantics" (usage/streams.html): a call is enqueued on its stream and runs in
                       that order; every member of the group issues the same ones, same op, same size
                       (all-to-all: what i sends j is what j expects from i).
  wait()               the host waits until the operation (its whole batch) is done; a blocking call
                       (send, recv, all_reduce without async_op) is an issue and a wait.

The replay first runs the per-communicator model (every communicator its own stream, the streams of a rank
independent: what NCCL does when kernels fit side by side), then the one-order model; `replay(traces,
order="per-communicator")` runs the first alone. (Group communicators are made when the group is made —
Mesh.init passes device_id, so torch connects them eagerly.) This is stricter than NCCL where NCCL is lenient
(a wait() there blocks the GPU stream, not the host; NCCL may buffer a small send), and as strict where it is not.

Use:
    with nccl_rules.Recorder() as rec:   # in every rank: patches torch.distributed while active
        ...run the step...
    trace = rec.trace                    # picklable: send it home (launch.run_on_ranks returns it)
    verdict = nccl_rules.replay(traces)  # one trace per rank, in rank order
    assert verdict.ok, verdict           # else: each rank's first stuck or mismatched operation, with file:line
"""
import os
import sys
import threading
from collections import deque

import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

P2P = ("isend", "irecv", "send", "recv")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "all_to_all", "all_to_all_single", "broadcast", "reduce", "gather", "scatter", "barrier",
               "all_gather_single", "reduce_scatter_single", "all_gather_object", "broadcast_object_list",
               "gather_object", "scatter_object_list", "all_reduce_coalesced")
BLOCKING = {"send": "isend", "recv": "irecv"}  # the blocking forms: issue + wait
_HERE = os.path.dirname(os.path.abspath(__file__))
_PLUMBING = {os.path.join(_HERE, name) for name in ("nccl_rules.py", "p2p.py", "mesh.py")}


# ============================================================================================ recording
class _Handle:
    """A work handle whose wait() is recorded; everything else goes to the real one."""

    def __init__(self, work, hid, rec):
        self._work, self._hid, self._rec = work, hid, rec

    def wait(self, *a, **k):
        self._rec._event(dict(op="wait", handle=self._hid))
        return self._work.wait(*a, **k) if self._work is not None else True

    def __getattr__(self, name):
        return getattr(self._work, name)


def _nbytes(t):
    return t.numel() * t.element_size() if t is not None and hasattr(t, "numel") else 0


def _group_info(group):
    group = group or dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    return getattr(group, "group_name", None) or ",".join(map(str, ranks)), ranks


class Recorder:
    """While active (a context manager, in one rank), every torch.distributed point-to-point message and
    collective is recorded in `trace`: the group, the peer, the bytes, the batch it belongs to, waits on its
    handle, and where in picotron it was issued. The real operation still runs (on gloo)."""

    def __init__(self):
        self.trace = dict(rank=None, groups={}, events=[])
        self._saved, self._depth, self._next = [], threading.local(), 0

    # ------------------------------------------------------------------------------ patching
    def __enter__(self):
        self.trace["rank"] = dist.get_rank() if dist.is_initialized() else None
        names = [n for n in P2P + COLLECTIVES + ("batch_isend_irecv",) if hasattr(_c10d, n)]
        for name in names:
            real = getattr(_c10d, name)
            wrapped = self._wrap(name, real)
            for mod in (dist, _c10d):
                if getattr(mod, name, None) is real:
                    self._saved.append((mod, name, real))
                    setattr(mod, name, wrapped)
        return self

    def __exit__(self, *exc):
        for mod, name, real in reversed(self._saved):
            setattr(mod, name, real)
        self._saved = []

    def _wrap(self, name, real):
        rec = self

        def wrapped(*args, **kwargs):
            if getattr(rec._depth, "n", 0):  # inside another recorded call (gloo's batch, object collectives)
                return real(*args, **kwargs)
            rec._depth.n = 1
            try:
                if rec.trace["rank"] is None:
                    rec.trace["rank"] = dist.get_rank()
                return rec._record(name, real, args, kwargs)
            finally:
                rec._depth.n = 0
        wrapped.__name__, wrapped.__wrapped__ = name, real
        return wrapped

    def _event(self, ev):
        self.trace["events"].append(ev)

    def _where(self):
        """file:line function of the nearest caller outside this module, torch and the plumbing every message
        goes through (picotron/p2p.py, the mesh's axes): the line of the strategy that sent it."""
        f = sys._getframe(2)
        while f is not None:
            path = f.f_code.co_filename
            if os.path.abspath(path) not in _PLUMBING and f"{os.sep}torch{os.sep}" not in path:
                return f"{os.path.relpath(path, os.path.dirname(_HERE))}:{f.f_lineno} {f.f_code.co_name}"
            f = f.f_back
        return "?"

    def _group(self, group):
        name, ranks = _group_info(group)
        self.trace["groups"][name] = ranks
        return name, ranks

    def _hid(self):
        self._next += 1
        return self._next

    # ------------------------------------------------------------------------------ one call
    def _record(self, name, real, args, kwargs):
        where = self._where()
        if name == "batch_isend_irecv":
            ops = args[0] if args else kwargs["p2p_op_list"]
            hid = self._hid()
            for op in ops:
                gname, ranks = self._group(op.group)
                kind = "isend" if getattr(op.op, "__name__", "") == "isend" else "irecv"
                self._event(dict(op=kind, comm=gname, peer=_peer(op, ranks), bytes=_nbytes(op.tensor), batch=hid,
                                 handle=hid, where=where))
            works = real(*args, **kwargs)
            return [_Handle(w, hid, self) for w in works]
        if name in P2P:
            tensor = args[0] if args else kwargs.get("tensor")
            peer_kw = "dst" if name in ("isend", "send") else "src"
            peer = args[1] if len(args) > 1 else kwargs.get(peer_kw)
            group = args[2] if len(args) > 2 else kwargs.get("group")
            gname, ranks = self._group(group)
            if peer is None:  # group_dst / group_src
                gp = kwargs.get("group_" + peer_kw)
                peer = ranks[gp] if gp is not None else None
            hid = self._hid()
            self._event(dict(op=BLOCKING.get(name, name), comm=gname, peer=peer, bytes=_nbytes(tensor), batch=None,
                             handle=hid, where=where))
            work = real(*args, **kwargs)
            if name in BLOCKING:
                self._event(dict(op="wait", handle=hid))
                return work
            return _Handle(work, hid, self)
        # a collective
        group = kwargs.get("group")
        if group is None:
            group = _positional_group(name, args)
        gname, _ = self._group(group)
        hid = self._hid()
        self._event(dict(op=name, comm=gname, sig=_signature(name, args, kwargs), handle=hid, where=where))
        work = real(*args, **kwargs)
        if kwargs.get("async_op") and work is not None:
            return _Handle(work, hid, self)
        self._event(dict(op="wait", handle=hid))
        return work


def run_recorded(fn, *args, **kwargs):
    """(fn(*args, **kwargs), this rank's trace): what a test runs on every rank (launch.run_on_ranks) to
    replay the whole run afterwards."""
    with Recorder() as rec:
        out = fn(*args, **kwargs)
    return out, rec.trace


def _peer(op, ranks):
    peer = getattr(op, "peer", None)
    if peer is None and getattr(op, "group_peer", None) is not None:
        peer = ranks[op.group_peer]
    return peer


_GROUP_POS = {"all_reduce": 2, "all_gather": 2, "all_gather_into_tensor": 2, "reduce_scatter": 3,
              "reduce_scatter_tensor": 3, "all_to_all": 2, "all_to_all_single": 4, "broadcast": 2, "reduce": 3,
              "gather": 3, "scatter": 3, "barrier": 0, "all_gather_single": 2, "reduce_scatter_single": 3,
              "all_gather_object": 2, "broadcast_object_list": 2, "gather_object": 3, "scatter_object_list": 3}


def _positional_group(name, args):
    i = _GROUP_POS.get(name)
    return args[i] if i is not None and len(args) > i and not isinstance(args[i], (int, bool)) else None


def _signature(name, args, kwargs):
    """What every member of a collective must agree on: bytes (and root), or per-peer sizes for all-to-all."""
    def arg(i, key):
        return args[i] if len(args) > i else kwargs.get(key)

    if name == "all_to_all_single":
        out, inp = arg(0, "output"), arg(1, "input")
        outs, ins = arg(2, "output_split_sizes"), arg(3, "input_split_sizes")
        n = dist.get_world_size(kwargs.get("group") or _positional_group(name, args))
        row_in = _nbytes(inp) // max(1, inp.shape[0]) if inp.dim() else 0
        row_out = _nbytes(out) // max(1, out.shape[0]) if out.dim() else 0
        ins = list(ins) if ins else [inp.shape[0] // n] * n
        outs = list(outs) if outs else [out.shape[0] // n] * n
        return dict(send=[int(x) * row_in for x in ins], recv=[int(x) * row_out for x in outs])
    if name == "all_to_all":
        return dict(send=[_nbytes(t) for t in arg(1, "input_tensor_list")],
                    recv=[_nbytes(t) for t in arg(0, "output_tensor_list")])
    if name in ("broadcast",):
        return dict(bytes=_nbytes(arg(0, "tensor")), root=arg(1, "src"))
    if name in ("reduce",):
        return dict(bytes=_nbytes(arg(0, "tensor")), root=arg(1, "dst"))
    if name in ("all_reduce",):
        return dict(bytes=_nbytes(arg(0, "tensor")))
    if name in ("all_gather_into_tensor", "all_gather_single"):
        return dict(bytes=_nbytes(arg(0, "output_tensor")))
    if name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        return dict(bytes=_nbytes(arg(1, "input")))
    if name == "all_gather":
        return dict(bytes=sum(_nbytes(t) for t in arg(0, "tensor_list")))
    if name == "reduce_scatter":
        return dict(bytes=sum(_nbytes(t) for t in arg(1, "input_list")))
    return {}


# ============================================================================================== replay
class Verdict:
    """`ok`, and otherwise `problems`: one line per rank naming its first stuck or mismatched operation."""

    def __init__(self, ok, problems, ops):
        self.ok, self.problems, self.ops = ok, problems, ops

    def __bool__(self):
        return self.ok

    def __str__(self):
        if self.ok:
            return f"NCCL replay: every operation matched and completed ({self.ops} operations)."
        return "NCCL replay: " + "\n  ".join(self.problems)

    __repr__ = __str__


def _describe(op):
    if op["op"] in ("isend", "irecv"):
        arrow = "to" if op["op"] == "isend" else "from"
        kind = ("batched " if op["batch"] else "") + op["op"]
        on = f" on group [{op['ranks']}]" if op["batch"] and op.get("ranks") else ""
        return f"{kind} of {op['bytes']:,} B {arrow} rank {op['peer']}{on} ({op['where']})"
    sig = ", ".join(f"{k} {v}" for k, v in op.get("sig", {}).items())
    return f"{op['op']}({sig}) on group [{op['ranks']}] ({op['where']})"


class _Item:
    """One entry of a stream: a collective, a single message, or a batch of messages."""

    def __init__(self, ops, key):
        self.ops, self.key, self.done = ops, key, False
        self.matched = [False] * len(ops)


def replay(traces, order="one"):
    """Replay each rank's recorded operations (traces in rank order, or {rank: trace}) under NCCL's rules.

    order="one" (the default): both models below must finish, the per-communicator one first (its findings are
    the more specific), then the one-order one. order="per-communicator": today's per-stream rules alone (every
    communicator its own stream, running concurrently with the others), the model NCCL does not promise."""
    if order not in ("one", "per-communicator"):
        raise ValueError(f"order={order!r}: pick 'one' (NCCL's rule for several communicators) or 'per-communicator'.")
    verdict = _replay(traces, serial=False)
    if verdict.ok and order == "one":
        verdict = _replay(traces, serial=True)
    return verdict


def _replay(traces, serial):
    """One replay. serial=False: a stream per communicator (per pair for single messages), the streams of a rank
    independent. serial=True: ONE stream per rank holding all its operations on all its communicators in the
    order the host issued them; an operation completes only at the head of that stream, meeting its peers' at
    the heads of theirs (on the same communicator)."""
    traces = {t["rank"]: t for t in (traces.values() if isinstance(traces, dict) else traces)}
    groups = {}
    for t in traces.values():
        groups.update(t["groups"])
    events = {r: t["events"] for r, t in traces.items()}
    pc = {r: 0 for r in events}
    streams = {}       # stream key (the comm's, or ("device",) when serial) -> {rank: deque of _Item}
    items = {}         # (rank, handle) -> _Item
    arrived = {}       # pair comm key -> ranks that reached their first message on it
    errors = []
    nops = sum(1 for evs in events.values() for e in evs if e["op"] != "wait")

    def comm_of(rank, ev):
        if ev["op"] in ("isend", "irecv") and not ev["batch"]:
            lo, hi = sorted((rank, ev["peer"]))
            return ("pair", ev["comm"], lo, hi)
        return ("group", ev["comm"])

    def issue(rank):
        """Advance the host of `rank` as far as it can go; True if it moved."""
        moved, evs = False, events[rank]
        while pc[rank] < len(evs):
            ev = evs[pc[rank]]
            if ev["op"] == "wait":
                item = items.get((rank, ev["handle"]))
                if item is not None and not item.done:
                    return moved
                pc[rank] += 1
                moved = True
                continue
            key = comm_of(rank, ev)
            if key[0] == "pair":
                seen = arrived.setdefault(key, set())
                seen.add(rank)
                if len(seen) < 2:  # the pair's communicator is being made: wait for the peer's first message
                    return moved
            op = dict(ev, rank=rank, ranks=",".join(map(str, groups.get(ev["comm"], []))))
            batch = ev.get("batch")
            if batch and (rank, batch) in items:  # another op of a batch already queued
                items[rank, batch].ops.append(op)
                items[rank, batch].matched.append(False)
            else:
                item = _Item([op], key)
                items[rank, ev["handle"]] = item
                streams.setdefault(("device",) if serial else key, {}).setdefault(rank, deque()).append(item)
            pc[rank] += 1
            moved = True
        return moved

    def heads(key):
        return {r: q[0] for r, q in streams[key].items() if q}

    def pop(key, rank):
        item = streams[key][rank].popleft()
        item.done = True

    def match_messages(key):
        """Match the messages at the heads of the streams of `key`; True if something completed."""
        hs, moved = heads(key), False
        for r, item in hs.items():
            for i, op in enumerate(item.ops):
                if item.matched[i] or op["op"] not in ("isend", "irecv"):
                    continue
                peer = hs.get(op["peer"])
                if peer is None or peer.key != item.key:  # (serial: the peer's head is on another communicator)
                    continue
                want = "irecv" if op["op"] == "isend" else "isend"
                for j, other in enumerate(peer.ops):
                    if peer.matched[j] or other.get("peer") != r or other["op"] not in ("isend", "irecv"):
                        continue
                    if other["op"] != want:
                        if item.key[0] == "pair":  # one FIFO: the first unmatched op toward us decides
                            break
                        continue
                    if other["bytes"] != op["bytes"]:
                        errors.append(f"mismatch: rank {r}'s {_describe(op)} meets rank {op['peer']}'s "
                                      f"{_describe(other)}")
                    item.matched[i] = peer.matched[j] = True
                    moved = True
                    break
                if item.key[0] == "pair":
                    break  # a single message is alone in its item
        for r, item in hs.items():
            if item.ops[0]["op"] in ("isend", "irecv") and all(item.matched):
                pop(key, r)
                moved = True
        return moved

    def match_collectives(key):
        """Complete the collectives at the heads of the streams of `key` whose every member has it at its head."""
        comms = {item.key for item in heads(key).values() if item.ops[0]["op"] not in ("isend", "irecv")}
        return any([match_collective(key, comm) for comm in sorted(comms)])

    def match_collective(key, comm):
        hs = heads(key)
        members = groups.get(comm[1], [])
        if any(m not in hs or hs[m].key != comm or hs[m].ops[0]["op"] in ("isend", "irecv") for m in members):
            return False
        hs = {m: hs[m] for m in members}
        ref = hs[members[0]].ops[0]
        for m in members[1:]:
            op = hs[m].ops[0]
            if op["op"] != ref["op"] or (op.get("sig", {}) != ref.get("sig", {}) and "send" not in ref.get("sig", {})):
                errors.append(f"mismatch on group [{ref['ranks']}]: rank {members[0]} runs {_describe(ref)}, "
                              f"rank {m} runs {_describe(op)}")
                return False
        if "send" in ref.get("sig", {}):  # all-to-all: what i sends to j is what j expects from i
            for i, a in enumerate(members):
                for j, b in enumerate(members):
                    sent, got = hs[a].ops[0]["sig"]["send"][j], hs[b].ops[0]["sig"]["recv"][i]
                    if sent != got:
                        errors.append(f"mismatch in {ref['op']} on group [{ref['ranks']}]: rank {a} sends "
                                      f"{sent:,} B to rank {b}, which expects {got:,} B ({hs[b].ops[0]['where']})")
                        return False
        for m in members:
            pop(key, m)
        return True

    while not errors:
        moved = False
        for r in events:
            moved |= issue(r)
        for key in list(streams):
            moved |= match_messages(key)
            moved |= match_collectives(key)
        if not moved:
            break
    if errors:
        return Verdict(False, errors[:8], nops)
    problems = []
    for r in sorted(events):
        stuck = [q[0] for s in streams.values() for rr, q in s.items() if rr == r and q]
        if pc[r] == len(events[r]) and not stuck:
            continue
        line = f"rank {r}: "
        if pc[r] < len(events[r]):
            ev = events[r][pc[r]]
            if ev["op"] == "wait":
                item = items.get((r, ev["handle"]))
                line += f"the host waits for its {_describe(item.ops[0])}" if item else "the host waits"
            else:
                line += f"the host is stuck making the pair communicator for its first {_describe(ev | {'rank': r})}"
        else:
            line += "the host finished"
        if stuck:
            line += ("; its one queue is stuck at " if serial else "; its streams are stuck at ") + \
                "; ".join(_describe(i.ops[0]) for i in stuck[:3])
        problems.append(line)
    if problems:
        problems.insert(0, "DEADLOCK under NCCL's rule for several communicators (each rank's operations on all its "
                           "groups complete in the order it issued them, meeting its peers' in theirs):" if serial else
                           "DEADLOCK (no operation can make progress):")
        return Verdict(False, problems, nops)
    return Verdict(True, [], nops)



