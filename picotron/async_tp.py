"""Async tensor parallelism: the collective matmul (Wang et al. 2023, "Overlap Communication with Dependent
Computation via Decomposition in Large Deep Learning Models", ASPLOS'23, section 3; the JAX scaling book, "Sharded
matrices", its collective-matmul example; torchtitan's async TP, which reports 1.04-1.16x on H100s).

The problem. With sequence parallelism (picotron.tensor_parallel) every block starts with an all-gather of its
input along the sequence and ends with a reduce-scatter of its output: [b, s/n, h] -> [b, s, h] -> column matmuls
... row matmul -> [b, s, h] partial sums -> [b, s/n, h]. Both collectives sit on the critical path: the matmul
after the all-gather needs all of it, the reduce-scatter needs the whole matmul before it.

The idea. Neither really needs all of it at once. The matmul is row-wise in the tokens: rank r can multiply the
chunk of s/n tokens it already has while the next chunk travels. Cut the all-gather into n-1 ring steps (send what
I hold to my right neighbour, receive from my left) and multiply one chunk per step:

    all-gather-matmul (rank r, n ranks)       step i = 0 .. n-1
        holds chunk (r - i) mod n              multiplies it: y[chunk] = x_chunk Wᵀ
        while sending it to r+1 and receiving chunk (r - i - 1) mod n from r-1   (not at the last step)

    matmul-reduce-scatter (rank r)             step i = 0 .. n-1
        computes its partial sum of chunk (r - i - 1) mod n, adds the running sum received from r-1,
        sends the result on to r+1 (at the last step, i = n-1, the chunk is r's own: complete, kept)

Each step's message (b·s/n·h numbers) is in flight while a chunk multiplies, so only the first step's matmul (the
reduce-scatter: the last message) is never hidden; the rest is hidden wherever a chunk's matmul takes longer than
a chunk's message. Exposed communication per collective (planner.async_tp_exposed_seconds):

    T_exposed = (n - 1) · max(0, t_msg - t_mm)  + the latency-bound remainder of the step that has no matmul
    with t_msg = α + (b·s/n·h·bytes)/β (one ring step) and t_mm = one chunk's matmul (1/n of the block's)

Backward is the same pair, swapped (section 3.2 of the paper): the gradient of an all-gather-matmul's input is a
matmul-reduce-scatter of dy·W (its weight gradient dyᵀ·x uses the gathered x saved in forward), and the
gradient of a matmul-reduce-scatter's input is an all-gather-matmul of dy (each arriving chunk of dy gives its
chunk of dx = dy·W and adds dy_chunkᵀ·x_chunk to dW). Communication volume: the same as the collectives it
replaces ((n-1)/n of the buffer per rank), in n-1 messages instead of one: n-1 latencies.

Several matmuls read one gathered input (q, k and v; gate and up): `all_gather_matmul(x, axis, [Wq, Wk, Wv])` runs
one ring and multiplies each arriving chunk by all three, and returns the gathered input too (torch's
`_fused_all_gather_matmul` does the same), so the block sees the [b, s, h] tensor it expects.

NCCL. Each ring step is ONE batch (`Axis.exchange`: send right and receive left posted together on the tp group),
every rank posts the same steps in the same order, and nothing is posted on another group between a step and its
wait: the replay of tests/test_async_tp.py checks both NCCL models (picotron.nccl_rules).

Composition. A split (zero-bubble) pipeline schedule defers weight gradients: given its store
(picotron.zero_bubble.WeightGradStore), the collective matmuls take the weights detached, compute only the input
gradients in their rings and hand (weight, input, output gradient) to the store for the schedule's W. FP8 replaces
the matmul itself and is refused (picotron.rules); bf16 autocast applies inside the rings as around F.linear.

The phases `ag-matmul`, `rs-matmul` (one chunk's matmul) and `wait` (time blocked on a ring step's message: the
EXPOSED communication) go to a `hooks.Phases` the layers hold, so a timeline can show what overlapped.
"""
from contextlib import nullcontext

import torch
import torch.nn.functional as F


def ring_order(rank, n):
    """The chunk rank `rank` multiplies at each step of an all-gather-matmul, and whom it sends to / receives from:
    [(step, chunk, send_to, recv_from)], recv_from None at the last step (nothing left to travel)."""
    right, left = (rank + 1) % n, (rank - 1) % n
    return [(i, (rank - i) % n, right if i < n - 1 else None, left if i < n - 1 else None) for i in range(n)]


def reduce_scatter_order(rank, n):
    """The chunk whose partial sum rank `rank` computes at each step of a matmul-reduce-scatter: [(step, chunk)];
    the last one is its own."""
    return [(i, (rank - i - 1) % n) for i in range(n)]


def _phase(phases, name, **info):
    return phases(name, **info) if phases is not None else nullcontext()


def _step(axis, send, recv, label):
    """One ring step: `send` to the right neighbour and `recv` from the left, one batch on the tp group."""
    n, r = axis.size, axis.rank
    return axis.exchange([("send", send, axis.ranks[(r + 1) % n]), ("recv", recv, axis.ranks[(r - 1) % n])], label)


def _wait(works, phases, step):
    with _phase(phases, "wait", step=step):
        for w in works:
            w.wait()


def ring_all_gather(local, axis, use, phases=None, label="async-tp all-gather"):
    """Pass `local` (this rank's chunk, contiguous) around the ring; call use(chunk_index, chunk, step) on each chunk
    while the next one travels."""
    n, chunk = axis.size, local
    for step, j, _, _ in ring_order(axis.rank, n):
        works = []
        if step < n - 1:
            incoming = torch.empty_like(chunk)
            works = _step(axis, chunk, incoming, label)
        use(j, chunk, step)
        if step < n - 1:
            _wait(works, phases, step)
            chunk = incoming
    return chunk


def ring_reduce_scatter(partial, axis, phases=None, label="async-tp reduce-scatter"):
    """Σ over ranks of this rank's chunk, where partial(j, step) is this rank's (contiguous) contribution to chunk j:
    each step computes one partial sum while the running sum of the step before travels."""
    total, works, incoming = None, [], None
    for step, j in reduce_scatter_order(axis.rank, axis.size):
        mine = partial(j, step)
        if step:
            _wait(works, phases, step - 1)
            mine = mine + incoming
        if step < axis.size - 1:
            incoming = torch.empty_like(mine)
            works = _step(axis, mine, incoming, label)
        total = mine
    return total


def _autocast_state(t):
    kind = t.device.type
    return kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


class AllGatherMatmul(torch.autograd.Function):
    """(x [b, s/n, h], weights W_k [o_k, h]) -> (x gathered [b, s, h], y_k = x Wₖᵀ [b, s, o_k] ...): the all-gather
    along the sequence decomposed into ring steps under the chunks' matmuls. Backward: dx by a matmul-reduce-scatter
    of Σ_k dy_k W_k, dW_k = dy_kᵀ x."""

    @staticmethod
    def forward(ctx, x, axis, phases, deferred, *weights):
        b, piece, h = x.shape
        n = axis.size
        full = x.new_empty(b, piece * n, h)
        ys = [None] * len(weights)

        def use(j, chunk, step):
            with _phase(phases, "ag-matmul", step=step):
                cut = slice(j * piece, (j + 1) * piece)
                full[:, cut] = chunk
                for k, w in enumerate(weights):
                    part = F.linear(chunk, w)
                    if ys[k] is None:
                        ys[k] = part.new_empty(b, piece * n, part.shape[-1])
                    ys[k][:, cut] = part

        ring_all_gather(x.contiguous(), axis, use, phases)
        ctx.save_for_backward(full, *weights)
        ctx.axis, ctx.phases, ctx.piece, ctx.cast = axis, phases, piece, _autocast_state(x)
        ctx.deferred = deferred
        ctx.set_materialize_grads(False)
        return (full, *ys)

    @staticmethod
    def backward(ctx, grad_full, *grad_ys):
        full, *weights = ctx.saved_tensors
        piece, (kind, cast, dtype) = ctx.piece, ctx.cast
        with torch.autocast(kind, dtype=dtype, enabled=cast):
            def partial(j, step):
                cut = slice(j * piece, (j + 1) * piece)
                with _phase(ctx.phases, "rs-matmul", step=step):
                    p = grad_full[:, cut] if grad_full is not None else None
                    for g, w in zip(grad_ys, weights):
                        if g is not None:
                            term = g[:, cut] @ w.to(g.dtype)
                            p = term if p is None else p + term
                    return (p if p is not None else full.new_zeros(full[:, cut].shape)).contiguous()

            dx = ring_reduce_scatter(partial, ctx.axis, ctx.phases)
            if ctx.deferred is not None:  # a split backward: the weight gradients go to its store (zero_bubble)
                store, params = ctx.deferred
                store.take([(p, full.detach(), g.detach()) for p, g in zip(params, grad_ys) if g is not None])
                dws = [None] * len(weights)
            else:
                dws = [None if g is None else (g.flatten(0, 1).t() @ full.flatten(0, 1).to(g.dtype)).to(w.dtype)
                       for g, w in zip(grad_ys, weights)]
        return (dx.to(full.dtype), None, None, None, *dws)


class MatmulReduceScatter(torch.autograd.Function):
    """(x [b, s, i/n] this rank's input features, W [o, i/n]) -> [b, s/n, o]: Σ over ranks of x Wᵀ, this rank's
    tokens, the reduce-scatter decomposed into ring steps under the chunks' matmuls. Backward: an all-gather of dy
    under the matmuls dx[chunk] = dy_chunk W and dW += dy_chunkᵀ x[chunk]."""

    @staticmethod
    def forward(ctx, x, weight, axis, phases, deferred):
        n = axis.size
        b, s, _ = x.shape
        if s % n:
            raise ValueError(f"sequence parallelism splits the sequence over tp={n} ranks but it has {s} tokens; "
                             f"use a sequence length that is a multiple of {n}.")
        piece = s // n

        def partial(j, step):
            with _phase(phases, "rs-matmul", step=step):
                return F.linear(x[:, j * piece:(j + 1) * piece], weight).contiguous()

        out = ring_reduce_scatter(partial, axis, phases)
        ctx.save_for_backward(x, weight)
        ctx.axis, ctx.phases, ctx.piece, ctx.cast = axis, phases, piece, _autocast_state(x)
        ctx.deferred = deferred
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        piece, (kind, cast, dtype) = ctx.piece, ctx.cast
        dx, dw = torch.empty_like(x), None
        gathered = None if ctx.deferred is None else grad.new_empty(x.shape[:2] + grad.shape[2:])
        with torch.autocast(kind, dtype=dtype, enabled=cast):
            def use(j, g, step):
                nonlocal dw
                cut = slice(j * piece, (j + 1) * piece)
                with _phase(ctx.phases, "ag-matmul", step=step):
                    dx[:, cut] = g @ weight.to(g.dtype)
                    if gathered is not None:  # a split backward: dW later, from the whole dy (zero_bubble)
                        gathered[:, cut] = g
                        return
                    term = g.flatten(0, 1).t() @ x[:, cut].flatten(0, 1).to(g.dtype)
                    dw = term.float() if dw is None else dw + term.float()

            ring_all_gather(grad.contiguous(), ctx.axis, use, ctx.phases)
        if gathered is not None:
            store, (param,) = ctx.deferred
            store.take([(param, x.detach(), gathered)])
            return dx, None, None, None, None
        return dx, dw.to(weight.dtype), None, None, None


def all_gather_matmul(x, axis, weights, phases=None, store=None):
    """(gathered x, [x W_kᵀ for each W_k]) from this rank's tokens x: see AllGatherMatmul. `store`: a zero-bubble
    WeightGradStore, which then receives the weight gradients (the weights enter detached, as in its own linear)."""
    if store is None:
        full, *ys = AllGatherMatmul.apply(x, axis, phases, None, *weights)
    else:
        full, *ys = AllGatherMatmul.apply(x, axis, phases, (store, tuple(weights)), *[w.detach() for w in weights])
    return full, ys


def matmul_reduce_scatter(x, weight, axis, phases=None, store=None):
    """This rank's tokens of Σ over ranks of x Wᵀ: see MatmulReduceScatter (`store`: as in all_gather_matmul)."""
    if store is None:
        return MatmulReduceScatter.apply(x, weight, axis, phases, None)
    return MatmulReduceScatter.apply(x, weight.detach(), axis, phases, (store, (weight,)))
