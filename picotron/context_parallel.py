"""Context parallelism: every sequence cut over the cp ranks; attention passes K/V around a ring (or all-to-alls).

Everything in a transformer layer but attention works token by token, so a rank holding only some of a
sequence's tokens can run it alone. Attention needs every earlier token's key and value. Three ways to give
them to it:

    ring        each rank keeps its queries; the K/V blocks travel the ring of cp ranks (rank r sends to
                r+1, receives from r-1), one block per step for cp steps, the next block in flight while the
                current one is computed. Each step's partial output is merged into the running one with the
                log-sum-exp of its scores (the online softmax), so the result is exactly full attention.
                Backward walks the ring again: dQ stays, dK/dV travel with their block and arrive home last.
    allgather   gather all of K/V once (an all-gather; its backward is a reduce-scatter), attend locally:
                simple, but every rank holds the whole K/V for a moment (the baseline).
    ulysses     swap what is split (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509): an all-to-all
                turns each rank's s/cp tokens of every head into the whole sequence of h/cp heads, for q, k
                and v; attention runs locally over the whole sequence; a fourth all-to-all turns the output
                back into s/cp tokens of every head. Four all-to-alls per layer forward, four in backward
                (an all-to-all's gradient is the inverse all-to-all). Needs the query heads (per tp rank)
                divisible by cp; KV heads fewer than that (GQA) are replicated until they divide (see
                `ulysses_kv_heads`). A rank sends (cp-1)/cp of its q, k, v and output: bytes per rank that
                shrink as 1/cp, where the ring's stay those of the whole K/V.

Layouts: the sequence is cut into 2·cp chunks of c = s/(2·cp) tokens, and each rank holds two of them.

    contiguous  rank r holds chunks 2r and 2r+1 (one block). Causal: the last rank attends to everything,
                the first to its own block only: the work is unbalanced, ranks wait for the slowest.
    zigzag      rank r holds chunks r and 2cp-1-r. Every rank gets one early and one late chunk, and at
                every ring step exactly half of a block's (query chunk, key chunk) pairs are visible.

    cp = 2, 4 chunks:   contiguous  rank 0: [0 1]  rank 1: [2 3]
                        zigzag      rank 0: [0 3]  rank 1: [1 2]

Causal masking, chunk by chunk: a query chunk qc sees a key chunk kc whole when kc < qc, with the causal
mask when kc == qc (only at the ring's first step, a rank's own block), and not at all when kc > qc
(skipped: no compute). Positions: each rank's tokens keep their true positions (`positions`), which the
loader hands out with the tokens and RoPE uses; nothing else in the model needs to know.

GQA: only the KV heads travel (a/k times fewer bytes than the repeated heads); a block is computed with the
query heads grouped over their KV head, never repeating K/V.

Ulysses keeps the layouts: the gathered sequence arrives in layout order (rank 0's tokens, then rank 1's...)
and is put back in position order before the causal attention, and back in layout order after it.

    context_parallel.apply(model, mesh.cp, impl="ring", layout="zigzag")   # swaps every Attention.core

Gradients of every (replicated) parameter are then averaged over dp x cp by the data-parallel wrapper:
context ranks see different tokens of the same sequences, so their gradients differ and must be averaged,
also when dp = 1.
"""
import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from picotron import hooks
from picotron.config import CP_IMPLS as IMPLS, CP_LAYOUTS as LAYOUTS  # --cp-impl's and --cp-layout's values
from picotron.model import AttentionCore, apply_rope
# the bytes every core sends per step, and the KV heads Ulysses repeats, live with the other formulas (no torch there)
from picotron.planner import cp_bytes_per_step as bytes_per_step_formula, ulysses_kv_heads  # noqa: F401
# check(cfg, model_config), this strategy's rule, lives in picotron.rules: no torch there, so a refusal is instant
from picotron.rules import context_parallel_rule as check


# ================================================================================= who holds which tokens
def chunks_of(rank, cp, layout="zigzag"):
    """The two chunk indices (of 2·cp) rank `rank` holds, in the order they sit in its local sequence."""
    if layout == "zigzag":
        return (rank, 2 * cp - 1 - rank)
    if layout == "contiguous":
        return (2 * rank, 2 * rank + 1)
    raise ValueError(f"unknown cp layout {layout!r}; use one of {LAYOUTS}.")


def positions(seq_len, cp, rank, layout="zigzag"):
    """The true positions (0..seq_len-1) of the tokens rank `rank` holds, in its local order: [seq_len / cp]."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len={seq_len} does not split into 2*cp={2 * cp} equal chunks.")
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunks_of(rank, cp, layout)])


def split(x, cp, rank, layout="zigzag", dim=1):
    """This rank's tokens of a full sequence tensor (its positions along `dim`)."""
    return x.index_select(dim, positions(x.shape[dim], cp, rank, layout).to(x.device))


def unsplit(pieces, layout="zigzag", dim=1):
    """The full sequence from every rank's piece (pieces[r] = split(x, cp, r)): the inverse of `split`."""
    cp = len(pieces)
    s = pieces[0].shape[dim] * cp
    order = torch.cat([positions(s, cp, r, layout) for r in range(cp)])
    full = torch.cat(pieces, dim=dim)
    return full.index_select(dim, torch.argsort(order).to(full.device))


def visibility(q_chunk, k_chunk):
    """How query chunk q_chunk sees key chunk k_chunk under the causal mask: 'all', 'causal' or 'none'."""
    return "all" if k_chunk < q_chunk else "causal" if k_chunk == q_chunk else "none"


# ================================================================================= one block, by hand
def _acc_dtype(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _scores(q, k, causal, scale):
    """Grouped scores [b, kv_heads, group, cq, ck] in the accumulation dtype (fp32, or fp64 for fp64 inputs)."""
    b, a, cq, d = q.shape
    kh = k.shape[1]
    qg = q.reshape(b, kh, a // kh, cq, d).to(_acc_dtype(q))
    s = (qg @ k.to(qg.dtype).unsqueeze(2).transpose(-2, -1)) * scale
    if causal:  # the diagonal block: query i sees keys 0..i of it
        future = torch.ones(cq, k.shape[2], dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def block_forward(q, k, v, causal, scale):
    """softmax(q k^T · scale) v over one block, and the log-sum-exp of each query's scores.

    q [b, a, cq, d], k/v [b, kh, ck, d] (a multiple of kh query heads) -> out [b, a, cq, d], lse [b, a, cq],
    both in the accumulation dtype. out is normalised: out = exp(s - lse) v."""
    b, a, cq, d = q.shape
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = p @ v.to(p.dtype).unsqueeze(2)
    return out.reshape(b, a, cq, d), lse.reshape(b, a, cq)


def merge(out, lse, out_b, lse_b):
    """The attention over the union of two key sets from each set's normalised output and log-sum-exp.

    With L = log(e^lse + e^lse_b) (computed as logaddexp: no exp of a large number is ever formed), the
    weights e^(lse - L) and e^(lse_b - L) are each at most 1, and sum to 1: out = w·out + w_b·out_b."""
    if out is None:
        return out_b, lse_b
    new = torch.logaddexp(lse, lse_b)
    return (out * torch.exp(lse - new).unsqueeze(-1) + out_b * torch.exp(lse_b - new).unsqueeze(-1)), new


def block_backward(q, k, v, dout, lse, delta, causal, scale):
    """Gradients of one block's share of the attention, given the FINAL lse and delta = rowsum(dout * out).

    With P = exp(S - lse) (this block's probabilities under the full softmax): dV = P^T dout,
    dP = dout V^T, dS = P * (dP - delta), dQ = dS K · scale, dK = dS^T Q · scale. Returns dq [b, a, cq, d]
    and dk, dv [b, kh, ck, d] (summed over each KV head's group of query heads), in the accumulation dtype."""
    b, a, cq, d = q.shape
    kh = k.shape[1]
    s = _scores(q, k, causal, scale)
    p = torch.exp(s - lse.reshape(b, kh, a // kh, cq).unsqueeze(-1))
    dog = dout.reshape(b, kh, a // kh, cq, d).to(p.dtype)
    dv = (p.transpose(-2, -1) @ dog).sum(2)
    dp = dog @ v.to(p.dtype).unsqueeze(2).transpose(-2, -1)
    ds = p * (dp - delta.reshape(b, kh, a // kh, cq).unsqueeze(-1))
    dq = (ds @ k.to(p.dtype).unsqueeze(2)) * scale
    dk = (ds.transpose(-2, -1) @ q.reshape(b, kh, a // kh, cq, d).to(p.dtype)).sum(2) * scale
    return dq.reshape(b, a, cq, d), dk, dv


# ================================================================================= the ring
class _Ring:
    """One exchange per ring step: send a tensor to the next rank, receive the same shape from the previous,
    posted as one batch (`Axis.exchange`, picotron.p2p): on NCCL two single messages could each wait for the
    other's partner. `what` ("kv" or "dkv") names the message, for whoever counts the axis's traffic."""

    def __init__(self, axis, phases):
        self.axis, self.phases = axis, phases
        n, r = axis.size, axis.rank
        self.next, self.prev = axis.ranks[(r + 1) % n], axis.ranks[(r - 1) % n]

    def start(self, t, what):
        buf = torch.empty_like(t)
        t = t.contiguous()
        works = self.axis.exchange([("send", t, self.next), ("recv", buf, self.prev)], label=what)
        return buf, works, t  # keep t alive until the send completes

    def finish(self, pending, step, what):
        buf, works, _ = pending
        with self.phases("wait", step=step, what=what):
            for w in works:
                w.wait()
        return buf


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence, K/V passed around `axis`."""

    @staticmethod
    def forward(ctx, q, k, v, axis, layout, phases):
        with torch.autocast(q.device.type, enabled=False):  # the block math stays in fp32 under bf16 autocast
            return RingAttention._forward(ctx, q, k, v, axis, layout, phases)

    @staticmethod
    def _forward(ctx, q, k, v, axis, layout, phases):
        n, r = axis.size, axis.rank
        scale = 1.0 / math.sqrt(q.shape[-1])
        ring, mine = _Ring(axis, phases), chunks_of(r, n, layout)
        qs = q.chunk(2, dim=2)
        outs, lses = [None, None], [None, None]
        kv = torch.stack([k, v])  # one message per step: [2, b, kv_heads, s/cp, d]
        for step in range(n):
            pending = ring.start(kv, "kv") if step + 1 < n else None  # the next block travels meanwhile
            theirs = chunks_of((r - step) % n, n, layout)
            with phases("attention", step=step):
                for i in range(2):
                    for j, (kc, vc) in enumerate(zip(kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2))):
                        seen = visibility(mine[i], theirs[j])
                        if seen != "none":
                            o, l = block_forward(qs[i], kc, vc, seen == "causal", scale)
                            outs[i], lses[i] = merge(outs[i], lses[i], o, l)
            if pending is not None:
                kv = ring.finish(pending, step, "kv")
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.axis, ctx.layout, ctx.phases, ctx.scale = axis, layout, phases, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            return RingAttention._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        axis, layout, phases, scale = ctx.axis, ctx.layout, ctx.phases, ctx.scale
        n, r = axis.size, axis.rank
        ring, mine = _Ring(axis, phases), chunks_of(r, n, layout)
        delta = (dout.to(out.dtype) * out).sum(-1)  # rowsum(dO * O) with the final O
        qs, dos = q.chunk(2, dim=2), dout.chunk(2, dim=2)
        lse_i, delta_i = lse.chunk(2, dim=2), delta.chunk(2, dim=2)
        dq = [torch.zeros_like(t, dtype=out.dtype) for t in qs]
        kv = torch.stack([k, v])
        dkv, dkv_pending = None, None  # the gradient of the block held now, as far as the ranks before got
        for step in range(n):
            kv_pending = ring.start(kv, "kv") if step + 1 < n else None
            theirs = chunks_of((r - step) % n, n, layout)
            mine_dkv = torch.zeros(kv.shape, dtype=out.dtype, device=kv.device)
            with phases("attention-backward", step=step):
                for i in range(2):
                    for j, (kc, vc) in enumerate(zip(kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2))):
                        seen = visibility(mine[i], theirs[j])
                        if seen != "none":
                            g_q, g_k, g_v = block_backward(qs[i], kc, vc, dos[i], lse_i[i], delta_i[i],
                                                           seen == "causal", scale)
                            dq[i] += g_q
                            mine_dkv[0].chunk(2, dim=2)[j].add_(g_k)
                            mine_dkv[1].chunk(2, dim=2)[j].add_(g_v)
            if dkv_pending is not None:  # what the previous ranks added to this block's gradient
                mine_dkv += ring.finish(dkv_pending, step, "dkv")
            dkv = mine_dkv
            dkv_pending = ring.start(dkv, "dkv")  # on to the next rank, which holds this block next (or owns it)
            if kv_pending is not None:
                kv = ring.finish(kv_pending, step, "kv")
        dkv = ring.finish(dkv_pending, n, "dkv")  # my own block's gradient, home after a full turn
        return torch.cat(dq, dim=2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


# ================================================================================= the all-gather baseline
class _GatherSequence(torch.autograd.Function):
    """All-gather along `axis` (dim 0 of the result = the rank); backward: reduce-scatter (the sum of every
    rank's gradient for this rank's piece)."""

    @staticmethod
    def forward(ctx, t, axis):
        t = t.contiguous()
        out = torch.empty((axis.size * t.shape[0],) + t.shape[1:], dtype=t.dtype, device=t.device)
        axis.all_gather_into(out, t)
        ctx.axis = axis
        return out.view((axis.size,) + t.shape)

    @staticmethod
    def backward(ctx, grad):
        piece = torch.empty(grad.shape[1:], dtype=grad.dtype, device=grad.device)
        ctx.axis.reduce_scatter_into(piece, grad.contiguous().view((-1,) + grad.shape[2:]))
        return piece, None


def allgather_attention(q, k, v, axis, layout, phases):
    """Gather every rank's K/V once, then attend this rank's queries to the whole sequence (masked by position)."""
    n, s = axis.size, q.shape[2] * axis.size
    kv = _GatherSequence.apply(torch.stack([k, v]), axis)  # [n, 2, b, kh, s/n, d], in rank order
    k_all = torch.cat(list(kv[:, 0]), dim=2)
    v_all = torch.cat(list(kv[:, 1]), dim=2)
    k_pos = torch.cat([positions(s, n, r, layout) for r in range(n)]).to(q.device)
    q_pos = positions(s, n, axis.rank, layout).to(q.device)
    with phases("attention"):
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=q_pos[:, None] >= k_pos[None, :],
                                              enable_gqa=q.shape[1] != k.shape[1])


# ================================================================================= Ulysses: all-to-all
class _AllToAll(torch.autograd.Function):
    """t [cp, ...]: block j goes to rank j; the result's block i came from rank i (`Axis.all_to_all_into`).
    Its gradient is the same exchange again: what rank i sent me as block i, I send back to it as block i."""

    @staticmethod
    def forward(ctx, t, axis, label):
        t = t.contiguous()
        out = torch.empty_like(t)  # (contiguous too: empty_like keeps a strided t's strides)
        axis.all_to_all_into(out, t, label=label)
        ctx.axis, ctx.label = axis, label
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        ctx.axis.all_to_all_into(out, grad, label=ctx.label + "-backward")
        return out, None, None


def seq_to_heads(x, axis, label="all-to-all"):
    """[b, H, s/cp, d] (this rank's tokens, every head) -> [b, H/cp, s, d] (every rank's tokens in rank order,
    this rank's H/cp heads): head group j is sent to rank j, rank i's tokens arrive as block i."""
    n = axis.size
    b, h, c, d = x.shape
    send = x.reshape(b, n, h // n, c, d).transpose(0, 1)  # [cp, b, H/cp, s/cp, d]: block j = head group j
    got = _AllToAll.apply(send, axis, label)  # block i = rank i's tokens of my heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * c, d)


def heads_to_seq(y, axis, label="all-to-all out"):
    """The inverse of seq_to_heads: [b, H/cp, s, d] -> [b, H, s/cp, d]."""
    n = axis.size
    b, g, s, d = y.shape
    send = y.reshape(b, g, n, s // n, d).permute(2, 0, 1, 3, 4)  # block j = rank j's tokens
    got = _AllToAll.apply(send, axis, label)  # block i = head group i of my tokens
    return got.transpose(0, 1).reshape(b, n * g, s // n, d)


def ulysses_attention(q, k, v, axis, layout, phases):
    """All-to-all q, k, v to the whole sequence of H/cp heads, causal attention, all-to-all back."""
    n, a, kh = axis.size, q.shape[1], k.shape[1]
    if a % n:
        raise ValueError(f"ulysses: {a} query heads on this rank do not split over cp={n}.")
    copies = ulysses_kv_heads(kh, n) // kh
    if copies > 1:  # GQA with fewer KV heads than cp divides: head i's copies serve its query heads
        k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
    q, k, v = (seq_to_heads(t, axis, f"all-to-all {what}") for t, what in ((q, "q"), (k, "k"), (v, "v")))
    reorder = layout != "contiguous"  # contiguous: rank order already is position order
    if reorder:  # slot i of the gathered sequence holds position order[i] (rank 0's chunks, then rank 1's, ...)
        order = torch.cat([positions(q.shape[2], n, r, layout) for r in range(n)]).to(q.device)
        q, k, v = (t.index_select(2, torch.argsort(order)) for t in (q, k, v))  # in position order
    with phases("attention"):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    if reorder:
        out = out.index_select(2, order)  # back in layout order
    return heads_to_seq(out, axis, "all-to-all out")


# ================================================================================= the model's seam
class ContextParallelAttention(nn.Module):
    """What replaces `model.AttentionCore` under cp: RoPE at each token's true position (the positions came
    with the batch), then ring, all-gather or Ulysses attention over `axis`.

    `phases` (picotron.hooks): each ring step's compute ("attention", "attention-backward") and each wait for a
    message ("wait"), for whoever listens (a lesson draws them); the bytes it sends are counted where they are
    sent, on the axis (`Axis.exchange`, the collectives). `whole = True` (see `whole_sequence`) makes it plain
    causal attention over a full, unsplit sequence, which every rank then computes alike: what generating text
    needs."""

    def __init__(self, axis, impl="ring", layout="zigzag"):
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"unknown cp impl {impl!r}; use one of {IMPLS}.")
        chunks_of(0, 1, layout)  # validates the name
        self.axis, self.impl, self.layout = axis, impl, layout
        self.whole = False
        self.phases = hooks.Phases()

    def forward(self, q, k, v, cos, sin):
        q, k = apply_rope(q, cos.to(q.dtype), sin.to(q.dtype)), apply_rope(k, cos.to(k.dtype), sin.to(k.dtype))
        if self.whole or self.axis.size == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        if self.impl == "ring":
            return RingAttention.apply(q, k, v, self.axis, self.layout, self.phases)
        if self.impl == "ulysses":
            return ulysses_attention(q, k, v, self.axis, self.layout, self.phases)
        return allgather_attention(q, k, v, self.axis, self.layout, self.phases)

    def extra_repr(self):
        return f"cp={self.axis.size}, {self.impl}, {self.layout}"


def cores(model):
    """Every ContextParallelAttention in `model`."""
    return [m for m in model.modules() if isinstance(m, ContextParallelAttention)]


def apply(model, axis, impl="ring", layout="zigzag"):
    """Swap every layer's attention core of `model` (a Llama) for context-parallel attention over `axis` (the
    mesh's cp axis), in place; cp = 1 leaves the model untouched. The batches must then hold this rank's
    tokens (`split`) with their positions."""
    if axis.size == 1:
        return model
    for i, layer in zip(model.layers.indices(), model.layers):
        attn = layer.self_attn
        if not isinstance(attn.core, AttentionCore):
            raise ValueError(f"layer {i}'s attention core is already {type(attn.core).__name__}.")
        attn.core = ContextParallelAttention(axis, impl, layout)
    return model


@contextmanager
def whole_sequence(model):
    """Inside: the model's context-parallel cores attend over the full sequence each rank is given."""
    found = cores(model)
    for c in found:
        c.whole = True
    try:
        yield
    finally:
        for c in found:
            c.whole = False


class WholeSequence(nn.Module):
    """ids -> logits through `inner` with full-sequence attention in `model` (text generation under cp:
    every rank runs the same prompt whole, so ZeRO-3's gathers and tp's collectives stay in step)."""

    def __init__(self, inner, model):
        super().__init__()
        self.inner, self.model, self.config = inner, model, model.config

    def forward(self, ids):
        with whole_sequence(self.model):
            return self.inner(ids)
