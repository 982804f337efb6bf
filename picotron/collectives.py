"""Collectives built from point-to-point messages, with the arguments and results of torch.distributed's own.

Every strategy in picotron is a pattern of a few collectives. Each one here is written with nothing but
`dist.isend` / `dist.irecv` (+ wait), so you can see what NCCL and gloo do inside. Before → after, 3 ranks
(rank 0 | rank 1 | rank 2), ⊕ the reduction (SUM, AVG, MAX, MIN, PRODUCT):

  broadcast       a | . | .                       →  a | a | a
  reduce          a | b | c                       →  a⊕b⊕c | . | .
  all_reduce      a | b | c                       →  a⊕b⊕c | a⊕b⊕c | a⊕b⊕c
  reduce_scatter  a0 a1 a2 | b0 b1 b2 | c0 c1 c2  →  a0⊕b0⊕c0 | a1⊕b1⊕c1 | a2⊕b2⊕c2
  all_gather      a | b | c                       →  a b c | a b c | a b c
  gather          a | b | c                       →  a b c | . | .
  scatter         a b c | . | .                   →  a | b | c
  all_to_all      a0 a1 a2 | b0 b1 b2 | c0 c1 c2  →  a0 b0 c0 | a1 b1 c1 | a2 b2 c2

  collective      algorithm here             steps      bytes sent by the busiest rank
  broadcast       binomial tree              ⌈log2 n⌉   ⌈log2 n⌉·N  (the root sends to each child)
  reduce          binomial tree, reversed    ⌈log2 n⌉   N, but the root receives and reduces ⌈log2 n⌉·N
  all_reduce      ring reduce-scatter + all-gather  2(n−1)   2(n−1)/n·N  (the lower bound, for any n)
  reduce_scatter  ring                       n−1        (n−1)/n·N
  all_gather      ring                       n−1        (n−1)/n·N
  gather, scatter straight to / from the root  1        (n−1)/n·N  (at the root)
  all_to_all      pairwise exchanges         n−1        (n−1)/n·N
  barrier         dissemination              ⌈log2 n⌉   ⌈log2 n⌉ bytes
N is the tensor for all_reduce / broadcast / reduce, the whole output of all_gather / gather and the whole
input of reduce_scatter / scatter / all_to_all (the nccl-tests convention).

Ring all-reduce. Cut the tensor into n chunks (boundaries as torch.tensor_split); each rank sends to its
right neighbour and receives from its left one. Reduce-scatter: in step t = 0..n−2 rank r sends chunk
(r−t−1) mod n and reduces the chunk it receives into its chunk (r−t−2) mod n; after n−1 steps rank r holds
chunk r reduced over all ranks. All-gather: in step t rank r sends chunk (r−t) mod n and stores the chunk
(r−t−1) mod n it receives; after n−1 more steps every rank has every reduced chunk. What a rank receives
in one step is what it sends in the next, so each chunk is cut into pieces of PIECE_BYTES that travel on
their own: piece j moves on as soon as it has arrived and been reduced, overlapping the next transfer.
Binomial tree: in round k every rank holding the data sends it 2^k ranks further, so the holders double
each round; reduce runs the tree backwards, reducing on the way. Both are pipelined in pieces too, so for
large N the depth of the tree costs only a few pieces. Dissemination barrier: in round k rank r signals
(r+2^k) mod n and waits for (r−2^k) mod n; after ⌈log2 n⌉ rounds each rank has heard from all others.

Cost model (α–β): T = α·steps + β·bytes, α the latency of a message, β the time per byte.
  ring all_reduce          2(n−1)·α  + 2(n−1)/n·N·β     the bandwidth term does not grow with n: large N
  reduce + broadcast       2⌈log2 n⌉·α + 2⌈log2 n⌉·N·β   (naive_all_reduce) fewer steps: small N, many ranks
Bandwidth as nccl-tests reports it: algbw = N / T and busbw = algbw · BUSBW_FACTOR[name](n) — 2(n−1)/n for
all-reduce, (n−1)/n for all-gather, reduce-scatter, all-to-all, gather, scatter, 1 for broadcast and reduce —
the speed of the busiest link, comparable across algorithms and with the hardware's bandwidth.

As in torch.distributed: src/dst are GLOBAL ranks, `group` the process group (default: the world); a rank
outside the group returns None at once; all_reduce and broadcast work in place (non-contiguous tensors
too); only dst's tensor is defined after reduce (ours leaves the others untouched); AVG is SUM / n (for an
integer tensor it raises, as on gloo); async_op=True runs the collective now and returns a completed
handle. Bytes travel as uint8 views, so any dtype works (only the reduction, done with torch, sees it).
NCCL's rules: every exchange in the rings, all-to-all and the barrier is one batch (send + receive posted
together, picotron.p2p), posted in the same order on every rank; the trees, gather and scatter send each
piece one way only. tests/test_nccl_rules.py replays all of them under NCCL's ordering rules at 2, 3, 4 ranks.
"""
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from picotron import p2p

PIECE_BYTES = 4 << 20  # pipelining grain of rings and trees (on CPU/gloo 4 MiB beat 1 MiB: ~100 µs CPU a message)

BUSBW_FACTOR = {  # nccl-tests convention: busbw = algbw * factor(n)
    "all_reduce": lambda n: 2 * (n - 1) / n, "naive_all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n, "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n, "all_gather_into_tensor": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n, "gather": lambda n: (n - 1) / n, "scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0,
}


# ------------------------------------------------------------------------------------------------ helpers
class _Done:
    """What async_op=True returns: the collective already ran, so wait() has nothing to wait for."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def _members(group):
    """(my rank in the group or -1, the group's global ranks in group-rank order)."""
    group = dist.group.WORLD if group is None else group
    return dist.get_rank(group), dist.get_process_group_ranks(group)


def _flat(t):
    """A contiguous 1-D view of t (t itself when contiguous, else a copy to write back with t.copy_)."""
    return (t if t.is_contiguous() else t.contiguous()).view(-1)


def _write_back(t, flat):
    if not t.is_contiguous():  # _flat worked on a copy: put the result where the caller expects it
        t.copy_(flat.view(t.shape))


def _bytes(t):
    return t.view(torch.uint8)  # t is contiguous 1-D: the same memory seen as bytes, whatever the dtype


_SCRATCH = {}  # (device, use) -> a byte buffer kept between calls, like NCCL's own buffers


def _scratch(numel, like, use):
    """`numel` elements of like's dtype, from a buffer reused across calls: fresh memory on the CPU costs a
    page fault per 4 KiB, which made a 64 MiB all-reduce 30% slower. (So: no two collectives at once.)"""
    nbytes, key = numel * like.element_size(), (like.device, use)
    if key not in _SCRATCH or _SCRATCH[key].numel() < nbytes:
        _SCRATCH[key] = None  # free the old one first
        _SCRATCH[key] = torch.empty(nbytes, dtype=torch.uint8, device=like.device)
    return _SCRATCH[key][:nbytes].view(like.dtype)


def _combine(acc, x, op):
    """acc ⊕= x, in place (no new tensor)."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        acc.add_(x)
    elif op == ReduceOp.PRODUCT:
        acc.mul_(x)
    elif op == ReduceOp.MAX:
        torch.maximum(acc, x, out=acc)
    elif op == ReduceOp.MIN:
        torch.minimum(acc, x, out=acc)
    else:
        raise ValueError(f"op={op} is not supported; use ReduceOp.SUM, AVG, MAX, MIN or PRODUCT.")


def _finish(t, op, n):
    if op == ReduceOp.AVG:
        t.div_(n)  # SUM / n exactly as gloo does (it raises for integer tensors, so does this)


def _exchange(send_t, to, recv_t, frm, group):
    """Send to `to` and receive from `frm` (global ranks) as ONE batch (picotron.p2p.exchange); the handles.

    One batch, not two single messages: on NCCL the single messages between two ranks run in order on one
    stream (a receive posted before the matching send on the other side waits forever), and the first one
    between two ranks blocks until the peer posts too (a ring where everyone first receives from its left
    hangs). A batch is posted whole on the group's own communicator, and every rank posts its batches in the
    same order, so they meet."""
    return p2p.exchange([("send", _bytes(send_t), to), ("recv", _bytes(recv_t), frm)], group)


def _wait(*works):  # (isend + wait rather than dist.send: the blocking call costs far more Python time here)
    for w in works:
        if w is not None:
            w.wait()


# --------------------------------------------------------------------------------------------------- ring
def _ring(chunks, steps, op, me, ranks, group):
    """Run ring steps over `chunks` (n contiguous 1-D tensors, one per group rank).

    steps: a list of (chunk to send, chunk to receive, reduce?) per step; what a rank receives in step t is
    what it sends in step t+1. Each chunk is cut into pieces of PIECE_BYTES, and (step t, piece j) is one
    exchange — send piece j of this step's chunk to the right, receive piece j from the left — posted as
    soon as piece j of step t−1 has arrived (and been reduced into place): the pieces of one step are in
    flight together, and transfers overlap the reductions. Every rank posts its exchanges in the same order
    (step by step, piece by piece), so on NCCL each one meets its neighbours' (see _exchange). Gathered
    pieces land in place; reduced ones land in a scratch buffer first.

    No receive is posted a step ahead (an earlier version did, double-buffered): under NCCL's rule for several
    communicators each rank's operations run as one queue, and a receive at its head would wait for a send that
    every rank holds behind its own receive. Measured side by side on an idle 2-core CPU (4 gloo ranks, median of
    21, built-in = 1): this ring 0.94-0.99x at 16 MiB and 1.00x at 64 MiB, the double-buffered one 0.96-1.01x
    and 1.08x; cutting chunks into 1 MiB pieces to win the overlap back costs more per message here (0.87x).
    """
    n, T = len(ranks), len(steps)
    left, right = ranks[(me - 1) % n], ranks[(me + 1) % n]
    per = max(1, PIECE_BYTES // chunks[0].element_size())
    longest = max(c.numel() for c in chunks)
    pieces = range(-(-longest // per))
    if any(s[2] for s in steps):
        buf = _scratch(longest, chunks[0], "ring")

    def piece(t, j):
        return t[j * per:(j + 1) * per]

    def post(t, j):  # exchange (step t, piece j): returns where it lands and its handles
        send_i, recv_i, red = steps[t]
        into = piece(chunks[recv_i], j)
        if red:
            into = piece(buf, j)[:into.numel()]
        return into, _exchange(piece(chunks[send_i], j), right, into, left, group)

    pending = {(0, j): post(0, j) for j in pieces}
    for t, (_, recv_i, red) in enumerate(steps):
        for j in pieces:
            into, works = pending.pop((t, j))
            _wait(*works)
            if red and into.numel():
                _combine(piece(chunks[recv_i], j), into, op)
            if t + 1 < T:
                pending[t + 1, j] = post(t + 1, j)


def _rs_steps(me, n):  # after these, rank me holds chunk me reduced over all ranks
    return [((me - t - 1) % n, (me - t - 2) % n, True) for t in range(n - 1)]


def _ag_steps(me, n):  # rank me starts with chunk me; after these, every rank holds every chunk
    return [((me - t) % n, (me - t - 1) % n, False) for t in range(n - 1)]


# ------------------------------------------------------------------------------------ the ring collectives
def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce `tensor` over the group, result in place on every rank: ring reduce-scatter + ring all-gather."""
    me, ranks = _members(group)
    if me < 0:
        return None
    n, flat = len(ranks), _flat(tensor)
    if n > 1 and flat.numel():
        _ring(list(torch.tensor_split(flat, n)), _rs_steps(me, n) + _ag_steps(me, n), op, me, ranks, group)
    _finish(flat, op, n)
    _write_back(tensor, flat)
    return _Done() if async_op else None


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    """output on group rank i = input_list[i] reduced over the group (input_list is left untouched): ring."""
    me, ranks = _members(group)
    if me < 0:
        return None
    n, total = len(ranks), sum(x.numel() for x in input_list)
    work = torch.cat([x.reshape(-1) for x in input_list], out=_scratch(total, output, "work"))  # reduced in place
    chunks = list(torch.split(work, [x.numel() for x in input_list]))
    if n > 1 and work.numel():
        _ring(chunks, _rs_steps(me, n), op, me, ranks, group)
    _finish(chunks[me], op, n)
    output.copy_(chunks[me].view(output.shape))
    return _Done() if async_op else None


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """Tensor form: input is n equal blocks (along dim 0); output on group rank i = block i reduced."""
    if _members(group)[0] < 0:
        return None
    n = dist.get_world_size(group)
    if input.numel() != n * output.numel():
        raise ValueError(f"input has {input.numel()} elements; reduce_scatter_tensor needs {n} x output "
                         f"({output.numel()}).")
    return reduce_scatter(output, list(torch.tensor_split(input.reshape(-1), n)), op, group, async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """tensor_list[i] = group rank i's `tensor`, on every rank (sizes may differ per rank): ring."""
    me, ranks = _members(group)
    if me < 0:
        return None
    outs = [_flat(t) for t in tensor_list]
    outs[me].copy_(tensor.reshape(-1))
    if len(ranks) > 1:
        _ring(outs, _ag_steps(me, len(ranks)), None, me, ranks, group)
    for t, o in zip(tensor_list, outs):
        _write_back(t, o)
    return _Done() if async_op else None


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """Tensor form: output_tensor = the group's inputs concatenated (or stacked) in group-rank order."""
    me, ranks = _members(group)
    if me < 0:
        return None
    if output_tensor.numel() != len(ranks) * input_tensor.numel():
        raise ValueError(f"output_tensor has {output_tensor.numel()} elements; all_gather_into_tensor needs "
                         f"{len(ranks)} x input_tensor ({input_tensor.numel()}).")
    flat = _flat(output_tensor)
    all_gather(list(torch.tensor_split(flat, len(ranks))), input_tensor, group)
    _write_back(output_tensor, flat)
    return _Done() if async_op else None


# ------------------------------------------------------------------------------------ the tree collectives
def _tree(v, n):
    """Binomial tree over relative ranks 0..n-1, root 0: (my parent or None, my children, farthest first).

    v's parent is v with its lowest set bit cleared; its children add each smaller power of two. Round k of
    a broadcast is every holder sending 2^k further, so the holders double: ⌈log2 n⌉ rounds.
    """
    low = v & -v if v else 1 << (n - 1).bit_length()
    return (v - low if v else None), [v + m for m in (1 << k for k in reversed(range(low.bit_length() - 1)))
                                      if v + m < n]


def _pieces(t):
    return torch.split(t, max(1, PIECE_BYTES // t.element_size()))  # views, pipelined down/up the tree


def broadcast(tensor, src, group=None, async_op=False):
    """Every rank's `tensor` becomes src's (src a global rank): binomial tree, pipelined in pieces (a rank
    forwards piece j to its children as soon as it has it)."""
    me, ranks = _members(group)
    if me < 0:
        return None
    n, flat, root = len(ranks), _flat(tensor), ranks.index(src)
    parent, kids = _tree((me - root) % n, n)
    pieces = _pieces(flat)
    got = [None] * len(pieces) if parent is None else [
        dist.irecv(_bytes(p), ranks[(root + parent) % n], group) for p in pieces]
    sends = []
    for p, w in zip(pieces, got):
        _wait(w)
        sends += [dist.isend(_bytes(p), ranks[(root + k) % n], group) for k in kids]
    _wait(*sends)
    _write_back(tensor, flat)
    return _Done() if async_op else None


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False):
    """dst's `tensor` becomes the reduction over the group (others' tensors are left as they were): the
    broadcast tree backwards, pipelined; a rank reduces piece j of its children into its own, then sends it up."""
    me, ranks = _members(group)
    if me < 0:
        return None
    n, flat, root = len(ranks), _flat(tensor), ranks.index(dst)
    v = (me - root) % n
    parent, kids = _tree(v, n)
    acc = _scratch(flat.numel(), flat, "work").copy_(flat) if kids and v else flat  # a middle rank reduces
    # into a copy: the caller's tensor stays as it was
    pieces, window = _pieces(acc), 2  # receive up to `window` pieces per child ahead
    slots = torch.empty(len(kids), window, pieces[0].numel() if pieces else 0, dtype=acc.dtype, device=acc.device)

    def post(c, j):
        return dist.irecv(_bytes(slots[c, j % window, :pieces[j].numel()]), ranks[(root + kids[c]) % n], group) \
            if j < len(pieces) else None

    pending = {(c, j): post(c, j) for c in range(len(kids)) for j in range(window)}
    sends = []
    for j, p in enumerate(pieces):
        for c in range(len(kids)):  # children in a fixed order: the same additions on every run
            _wait(pending.pop((c, j)))
            _combine(p, slots[c, j % window, :p.numel()], op)
            pending[c, j + window] = post(c, j + window)
        if parent is not None:
            sends.append(dist.isend(_bytes(p), ranks[(root + parent) % n], group))
    _wait(*sends)
    if v == 0:
        _finish(acc, op, n)
        _write_back(tensor, acc)
    return _Done() if async_op else None


def naive_all_reduce(tensor, op=ReduceOp.SUM, group=None):
    """All-reduce the simple way, to compare: reduce onto the group's first rank, then broadcast from it."""
    me, ranks = _members(group)
    if me < 0:
        return None
    reduce(tensor, ranks[0], ReduceOp.SUM if op == ReduceOp.AVG else op, group)
    broadcast(tensor, ranks[0], group)
    _finish(tensor, op, len(ranks))


# ---------------------------------------------------------------------------------- the direct collectives
def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    """gather_list[i] on dst = group rank i's `tensor`; everyone sends straight to dst."""
    me, ranks = _members(group)
    if me < 0:
        return None
    if ranks[me] != dst:
        if tensor.numel():
            _wait(dist.isend(_bytes(_flat(tensor)), dst, group))
        return _Done() if async_op else None
    outs = [_flat(t) for t in gather_list]
    works = [dist.irecv(_bytes(o), ranks[i], group) for i, o in enumerate(outs) if i != me and o.numel()]
    outs[me].copy_(tensor.reshape(-1))
    _wait(*works)
    for t, o in zip(gather_list, outs):
        _write_back(t, o)
    return _Done() if async_op else None


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    """tensor on group rank i = src's scatter_list[i]; src sends straight to everyone."""
    me, ranks = _members(group)
    if me < 0:
        return None
    if ranks[me] != src:
        flat = _flat(tensor)
        if flat.numel():
            _wait(dist.irecv(_bytes(flat), src, group))
        _write_back(tensor, flat)
        return _Done() if async_op else None
    ins = [x.reshape(-1).contiguous() for x in scatter_list]
    works = [dist.isend(_bytes(x), ranks[i], group) for i, x in enumerate(ins) if i != me and x.numel()]
    tensor.copy_(scatter_list[me].reshape(tensor.shape))
    _wait(*works)
    return _Done() if async_op else None


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    """output_tensor_list[j] on rank i = input_tensor_list[i] on rank j: pairwise exchanges. In round s rank
    r sends to r+s and receives from r−s (so no rank is swamped); all rounds are posted at once."""
    me, ranks = _members(group)
    if me < 0:
        return None
    n = len(ranks)
    outs = [_flat(t) for t in output_tensor_list]
    ins = [x.reshape(-1).contiguous() for x in input_tensor_list]
    outs[me].copy_(ins[me])
    works = []  # every round posted at once, in the same order on every rank
    for s in range(1, n):
        to, frm = (me + s) % n, (me - s) % n
        works += _exchange(ins[to], ranks[to], outs[frm], ranks[frm], group)
    _wait(*works)
    for t, o in zip(output_tensor_list, outs):
        _write_back(t, o)
    return _Done() if async_op else None


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    """The tensor form of all_to_all: `input` cut along dim 0 into one block per rank (input_split_sizes rows
    each, or equal blocks), `output` made of the blocks received, in rank order (expert parallelism's dispatch)."""
    me, ranks = _members(group)
    if me < 0:
        return None
    n = len(ranks)
    outs = list(output.split(output_split_sizes or [output.shape[0] // n] * n))
    ins = list(input.split(input_split_sizes or [input.shape[0] // n] * n))
    return all_to_all(outs, ins, group=group, async_op=async_op)


def barrier(group=None, async_op=False, device_ids=None):
    """Return only when every rank of the group has entered: dissemination, ⌈log2 n⌉ rounds of 1 byte."""
    me, ranks = _members(group)
    if me < 0:
        return None
    n = len(ranks)
    device = "cuda" if "nccl" in str(dist.get_backend(group)) else "cpu"  # NCCL moves only GPU tensors
    token = torch.zeros(2, dtype=torch.uint8, device=device)  # [0] to send, [1] to receive
    k = 1
    while k < n:  # round: signal rank +k, wait for rank -k
        _wait(*_exchange(token[:1], ranks[(me + k) % n], token[1:], ranks[(me - k) % n], group))
        k <<= 1
    token.cpu()  # on a GPU: wait until the receives really happened (no CUDA-only call on the CPU path)
    return _Done() if async_op else None
