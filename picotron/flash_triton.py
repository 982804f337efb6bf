"""Flash attention as Triton kernels: the algorithm of picotron.kernels' docstring, a tile in on-chip memory.

`kernels.flash_attention(..., impl="plain")` is the readable reference (a Python loop over small tensors); this
file is the same arithmetic written as GPU programs, in FlashAttention-2's structure (Dao 2023, Algorithms 1, 2):

  forward   one program per (query tile, batch·query head): it loads its Q tile once, walks over the key tiles
            with the online softmax (running max m, running sum l, unnormalised acc, fp32 in registers) and
            writes out = acc / l and lse = m + log(l). Causal: the key tiles wholly before the query tile run
            without a mask, those crossing the diagonal with one, those after it are never visited.
  backward  three kernels and no atomics (deterministic sums, no fp32 scratch copy of dq):
            _bwd_delta_kernel  D = rowsum(dO ∘ O), one number per query row;
            _bwd_dkdv_kernel   one program per (key tile, batch·KV head): its dk and dv stay in registers while
                               it walks over the query tiles that see the tile, for every query head of its GQA
                               group in turn (K and V are never repeated; the group's contributions add up);
            _bwd_dq_kernel     one program per (query tile, batch·query head): dq over the key tiles it sees.
            Both recompute P = exp(S - lse) from the saved lse. FlashAttention-2 adds dq with atomics inside the
            dk/dv loop instead: one recomputation of S and dP fewer, but sums in a varying order and an fp32
            buffer for dq; the Triton tutorial's fused attention, like this file, recomputes.

GQA: query head h reads KV head h // (a/kv) through pointer arithmetic, nothing is copied. A head dim that is
no power of two (the test models' 12) is padded to the next one (at least 16, tl.dot's minimum) by masked
loads: the zero columns add nothing to q·k and are never stored. Scores go through exp2 with log2(e) folded
into the scale (the Triton tutorial's trick: one multiply fewer per score); lse is stored in natural-log units,
torch.logsumexp's. Inputs fp32, bf16 or fp16; every sum in fp32; fp32 matmuls in IEEE precision, not TF32.
q, k, v may have any strides but a contiguous last dim (the model's are transposed views: no copies). Under
torch.compile the wrapper is left out of the graph (a graph break) and the kernels run as they are.

Tiles: the forward and dq kernels take BLOCK_M queries against tiles of BLOCK_N keys, the dk/dv kernel BLOCK_N
keys against tiles of BLOCK_M queries; the outer tile a multiple of the inner one (the causal split into
unmasked and diagonal tiles relies on it). On CUDA they are autotuned among a few configurations (128 × 64 with
4 warps, 128 × 32, 64 × 64, ...: `_tuned`; the choice is timed once per shape), unless the caller fixes them
(block_q × block_k, block_k dividing block_q; the tests use 16 × 16). Runs compiled on CUDA tensors, or on CPU
tensors under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported; slow, for the tests).
"""
import math

import torch
import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x · log2(e))


# ================================================================================================== forward
@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a @ b with fp32 accumulation; PRECISION "ieee" (fp32 inputs: no TF32), "tf32" (bf16/fp16 inputs: the
    tensor cores), or "upcast": both operands to fp32 first, used under the interpreter, whose tl.dot gets bf16
    wrong (triton 3.x); a product of two bf16 numbers is exact in fp32, so this is the tensor cores' sum."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _fwd_inner(acc, m, l, q, K, V, sks, svs, q_idx, lo, hi, s, qk_scale,
               CAUSAL: tl.constexpr, MASK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """The online softmax over key tiles lo, lo + BLOCK_N, ... < hi; MASK: mask keys past s or the query."""
    d = tl.arange(0, BLOCK_D)
    for k0 in range(lo, hi, BLOCK_N):
        k_idx = k0 + tl.arange(0, BLOCK_N)
        kv_mask = (k_idx[:, None] < s) & (d[None, :] < HEAD_DIM)
        k = tl.load(K + k_idx[:, None] * sks + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + k_idx[:, None] * svs + d[None, :], mask=kv_mask, other=0.0)
        x = _dot(q, tl.trans(k), PRECISION) * qk_scale  # scores · log2(e), [BLOCK_M, BLOCK_N]
        if MASK:
            keep = k_idx[None, :] < s
            if CAUSAL:
                keep = keep & (k_idx[None, :] <= q_idx[:, None])
            x = tl.where(keep, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 1))  # the new running max
        p = tl.exp2(x - m_new[:, None])  # this tile's probabilities, up to the final 1/l
        rescale = tl.exp2(m - m_new)  # exp2(-inf) = 0 on the first tile
        l = rescale * l + tl.sum(p, 1)
        acc = rescale[:, None] * acc + _dot(p.to(v.dtype), v, PRECISION)
        m = m_new
    return acc, m, l


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, qk_scale, s, A, G,
                sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos,
                CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """out and lse of one tile of BLOCK_M queries of one (batch, query head)."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    q0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)  # batch · A + query head
    b, h = (bh // A).to(tl.int64), bh % A
    kvh = h // G  # the KV head of this query head's group
    q_idx = q0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    q_mask = (q_idx[:, None] < s) & (d[None, :] < HEAD_DIM)
    q = tl.load(Q + b * sqb + h * sqh + q_idx[:, None] * sqs + d[None, :], mask=q_mask, other=0.0)
    K, V = K + b * skb + kvh * skh, V + b * svb + kvh * svh
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (of scores · log2(e))
    l = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(x - m)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # running Σ exp2(x - m) v
    if CAUSAL:  # tiles before q0 are wholly visible; q0 .. q0 + BLOCK_M cross the diagonal; later ones skipped
        lo, hi = q0, tl.minimum(q0 + BLOCK_M, s)
    else:  # every tile visible; only the last, ragged one needs a mask
        lo, hi = (s // BLOCK_N) * BLOCK_N, s
    acc, m, l = _fwd_inner(acc, m, l, q, K, V, sks, svs, q_idx, 0, lo, s, qk_scale,
                           CAUSAL, False, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION)
    acc, m, l = _fwd_inner(acc, m, l, q, K, V, sks, svs, q_idx, lo, hi, s, qk_scale,
                           CAUSAL, True, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION)
    tl.store(O + b * sob + h * soh + q_idx[:, None] * sos + d[None, :], (acc / l[:, None]).to(O.dtype.element_ty),
             mask=q_mask)
    tl.store(LSE + bh.to(tl.int64) * s + q_idx, (m + tl.log2(l)) / LOG2E, mask=q_idx < s)  # natural log


# ================================================================================================= backward
@triton.jit
def _bwd_delta_kernel(O, DO, DELTA, s, A, sob, soh, sos, sdb, sdh, sds,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """D = rowsum(dO ∘ O) (= Σ_j P_ij dP_ij) for BLOCK_M rows of one (batch, query head)."""
    bh = tl.program_id(1)
    b, h = (bh // A).to(tl.int64), bh % A
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < s) & (d[None, :] < HEAD_DIM)
    o = tl.load(O + b * sob + h * soh + rows[:, None] * sos + d[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sds + d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * s + rows, tl.sum(o * do, 1), mask=rows < s)


@triton.jit
def _dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, sqs, sds, k_idx, lo, hi, s, qk_scale,
                MASK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                PRECISION: tl.constexpr):
    """dk, dv of one key tile from the query tiles lo, lo + BLOCK_M, ... < hi, all transposed ([keys, queries])
    so no tile needs a transpose before its matmul; MASK: the causal mask (the diagonal tiles)."""
    d = tl.arange(0, BLOCK_D)
    for q0 in range(lo, hi, BLOCK_M):
        q_idx = q0 + tl.arange(0, BLOCK_M)
        q_mask = (q_idx[:, None] < s) & (d[None, :] < HEAD_DIM)
        q = tl.load(Q + q_idx[:, None] * sqs + d[None, :], mask=q_mask, other=0.0)
        do = tl.load(DO + q_idx[:, None] * sds + d[None, :], mask=q_mask, other=0.0)
        lse = tl.load(LSE + q_idx, mask=q_idx < s, other=float("inf"))  # rows past s: P = 0
        delta = tl.load(DELTA + q_idx, mask=q_idx < s, other=0.0)
        xT = _dot(k, tl.trans(q), PRECISION) * qk_scale  # S^T · log2(e)
        if MASK:
            xT = tl.where(k_idx[:, None] <= q_idx[None, :], xT, float("-inf"))
        pT = tl.exp2(xT - lse[None, :] * LOG2E)  # P^T, recomputed from lse
        dv += _dot(pT.to(do.dtype), do, PRECISION)  # dv += P^T dO
        dpT = _dot(v, tl.trans(do), PRECISION)  # dP^T = V dO^T
        dsT = pT * (dpT - delta[None, :])  # dS = P ∘ (dP - D)
        dk += _dot(dsT.to(q.dtype), q, PRECISION)  # dk += dS^T q (· scale at the end)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, qk_scale, sm_scale, s, A, KV, G,
                     sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds,
                     CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """dk and dv of one tile of BLOCK_N keys of one (batch, KV head), summed over the G query heads it serves."""
    tl.static_assert(BLOCK_N % BLOCK_M == 0)
    k0 = tl.program_id(0) * BLOCK_N
    bkv = tl.program_id(1)  # batch · KV + KV head
    b, j = (bkv // KV).to(tl.int64), bkv % KV
    k_idx = k0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    kv_mask = (k_idx[:, None] < s) & (d[None, :] < HEAD_DIM)
    k = tl.load(K + b * skb + j * skh + k_idx[:, None] * sks + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + j * svh + k_idx[:, None] * svs + d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for i in range(G):  # the query heads j·G .. j·G + G - 1 share this K/V tile
        h = j * G + i
        Qh, DOh = Q + b * sqb + h * sqh, DO + b * sdb + h * sdh
        row0 = (b * A + h) * s  # this head's rows of lse and D
        if CAUSAL:  # queries k0 .. k0 + BLOCK_N cross the diagonal, later ones see the whole tile
            dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, LSE + row0, DELTA + row0, sqs, sds, k_idx,
                                 k0, tl.minimum(k0 + BLOCK_N, s), s, qk_scale,
                                 True, HEAD_DIM, BLOCK_D, BLOCK_M, PRECISION)
            lo = k0 + BLOCK_N
        else:
            lo = 0
        dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, LSE + row0, DELTA + row0, sqs, sds, k_idx, lo, s, s,
                             qk_scale, False, HEAD_DIM, BLOCK_D, BLOCK_M, PRECISION)
    tl.store(DK + b * skb + j * skh + k_idx[:, None] * sks + d[None, :], (dk * sm_scale).to(DK.dtype.element_ty),
             mask=kv_mask)
    tl.store(DV + b * svb + j * svh + k_idx[:, None] * svs + d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, qk_scale, sm_scale, s, A, G,
                   sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds,
                   CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """dq of one tile of BLOCK_M queries of one (batch, query head): Σ over key tiles of dS k · scale."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    q0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = (bh // A).to(tl.int64), bh % A
    K, V = K + b * skb + (h // G) * skh, V + b * svb + (h // G) * svh
    q_idx = q0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    q_mask = (q_idx[:, None] < s) & (d[None, :] < HEAD_DIM)
    q = tl.load(Q + b * sqb + h * sqh + q_idx[:, None] * sqs + d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + q_idx[:, None] * sds + d[None, :], mask=q_mask, other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * s + q_idx, mask=q_idx < s, other=0.0) * LOG2E
    delta = tl.load(DELTA + bh.to(tl.int64) * s + q_idx, mask=q_idx < s, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:  # the same split of the key tiles as the forward's
        lo, hi = q0, tl.minimum(q0 + BLOCK_M, s)
    else:
        lo, hi = (s // BLOCK_N) * BLOCK_N, s
    for k0 in range(0, hi, BLOCK_N):
        k_idx = k0 + tl.arange(0, BLOCK_N)
        kv_mask = (k_idx[:, None] < s) & (d[None, :] < HEAD_DIM)
        k = tl.load(K + k_idx[:, None] * sks + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + k_idx[:, None] * svs + d[None, :], mask=kv_mask, other=0.0)
        x = _dot(q, tl.trans(k), PRECISION) * qk_scale
        if k0 >= lo:  # a diagonal or ragged tile: mask keys past s or (causal) past the query
            keep = k_idx[None, :] < s
            if CAUSAL:
                keep = keep & (k_idx[None, :] <= q_idx[:, None])
            x = tl.where(keep, x, float("-inf"))
        p = tl.exp2(x - lse[:, None])
        dp = _dot(do, tl.trans(v), PRECISION)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, PRECISION)
    tl.store(DQ + b * sqb + h * sqh + q_idx[:, None] * sqs + d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=q_mask)


# ==================================================================================================== host
def _tuned(kernel, tiles):
    """kernel autotuned over (BLOCK_M, BLOCK_N, warps, pipeline stages): on CUDA each config is timed once per
    (s, head dim, causal) on first use and the fastest kept; a config that does not fit is dropped."""
    configs = [triton.Config(dict(BLOCK_M=m, BLOCK_N=n), num_warps=w, num_stages=st) for m, n, w, st in tiles]
    return triton.autotune(configs, key=["s", "HEAD_DIM", "CAUSAL"])(kernel)


# (BLOCK_M queries, BLOCK_N keys, warps, stages); the tile along the inner loop divides the other (see the kernels)
_fwd_tuned = _tuned(_fwd_kernel, [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 4), (64, 64, 4, 3)])
_dq_tuned = _tuned(_bwd_dq_kernel, [(128, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 3)])
_dkdv_tuned = _tuned(_bwd_dkdv_kernel, [(32, 128, 4, 3), (32, 128, 8, 3), (64, 128, 8, 3), (32, 64, 4, 3),
                                        (64, 64, 4, 3)])


def _launch(kernel, tuned, tiles, rows, programs, *args, **meta):
    """kernel[grid](*args, **meta), one program per tile of `rows` ("BLOCK_M" or "BLOCK_N") rows and per entry of
    `programs`: the autotuned version when tiles is None (CUDA, no tiles asked for), else the tiles given."""
    s = meta.pop("s_len")
    grid = lambda m: (triton.cdiv(s, m[rows]), programs)  # noqa: E731  (m: the kernel's arguments, tiles included)
    if tiles is None:
        return tuned[grid](*args, **meta)
    return kernel[grid](*args, BLOCK_M=tiles[0], BLOCK_N=tiles[1], num_warps=4 if meta["HEAD_DIM"] <= 64 else 8,
                        **meta)


def _check_tiles(q, block_q, block_k):
    """None on CUDA without tiles asked for (autotuned), else (block_q, block_k), 128 × 64 by default."""
    if q.is_cuda and block_q is None and block_k is None:
        return None
    block_q, block_k = block_q or 128, block_k or 64
    if block_q % block_k or block_k < 16 or block_q & (block_q - 1) or block_k & (block_k - 1):
        raise ValueError(f"flash_attention(impl='triton'): block_q={block_q}, block_k={block_k}; the tiles must be "
                         f"powers of two >= 16 with block_k dividing block_q, e.g. 128 and 64.")
    return block_q, block_k


def _rows(t):
    """t itself if its last dim is contiguous and nothing is broadcast (stride 0: the outputs made `_like` it
    would overlap), else a contiguous copy; the kernels take any other strides (the model's k and v are
    transposed views of [b, s, heads, d])."""
    return t if t.stride(-1) == 1 and 0 not in t.stride() else t.contiguous()


def _like(t):
    """An uninitialised tensor with t's shape and strides (torch.empty_like drops strides that leave gaps)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


class TritonFlashAttention(torch.autograd.Function):
    """Flash attention through the kernels above: q [b, a, s, d], k/v [b, kv, s, d] -> [b, a, s, d].
    Saves q, k, v, out and lse [b, a, s] (fp32) for backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, block_q, block_k):
        if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"flash_attention(impl='triton'): q, k, v of dtypes {q.dtype}, {k.dtype}, {v.dtype}; "
                             f"the kernels take one dtype among float32, bfloat16 and float16 (cast them).")
        q, k, v = (_rows(t) for t in (q, k, v))
        (b, a, s, d), kv = q.shape, k.shape[1]
        tiles = _check_tiles(q, block_q, block_k)
        out = _like(q)
        lse = torch.empty(b, a, s, dtype=torch.float32, device=q.device)
        precision = "ieee" if q.dtype == torch.float32 else "upcast" if not q.is_cuda else "tf32"  # see _dot
        meta = dict(CAUSAL=causal, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), PRECISION=precision)
        _launch(_fwd_kernel, _fwd_tuned, tiles, "BLOCK_M", b * a,
                q, k, v, out, lse, LOG2E.value / math.sqrt(d), s, a, a // kv,
                *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], s_len=s, **meta)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        ctx.config = (tiles, meta)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):  # dlse: lse is returned for the tests only, never differentiated
        q, k, v, out, lse = ctx.saved_tensors
        tiles, meta = ctx.config
        (b, a, s, d), kv = q.shape, k.shape[1]
        dout = _rows(dout.to(q.dtype))  # the kernels' matmuls take operands of one dtype
        sm_scale = 1.0 / math.sqrt(d)
        delta = torch.empty_like(lse)
        _bwd_delta_kernel[(triton.cdiv(s, 64), b * a)](out, dout, delta, s, a, *out.stride()[:3], *dout.stride()[:3],
                                                       HEAD_DIM=d, BLOCK_D=meta["BLOCK_D"], BLOCK_M=64)
        dq, dk, dv = _like(q), _like(k), _like(v)  # the kernels write each with its input's strides
        strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3])
        # dk/dv: tiles of block_q keys against tiles of block_k queries (block_k divides block_q, as it must)
        _launch(_bwd_dkdv_kernel, _dkdv_tuned, tiles and tiles[::-1], "BLOCK_N", b * kv,
                q, k, v, dout, lse, delta, dk, dv, LOG2E.value * sm_scale, sm_scale, s, a, kv, a // kv, *strides,
                s_len=s, **meta)
        _launch(_bwd_dq_kernel, _dq_tuned, tiles, "BLOCK_M", b * a,
                q, k, v, dout, lse, delta, dq, LOG2E.value * sm_scale, sm_scale, s, a, a // kv, *strides,
                s_len=s, **meta)
        return dq, dk, dv, None, None, None


@torch.compiler.disable  # under --compile the layer's graph breaks here and the kernels run as they are
def flash_attention_triton(q, k, v, causal: bool = True, block_q=None, block_k=None, return_lse: bool = False):
    """Flash attention by the Triton kernels; q [b, a, s, d], k/v [b, kv, s, d] (kv dividing a) -> [b, a, s, d],
    and lse [b, a, s] (fp32, natural log) with return_lse. Tiles: autotuned on CUDA unless block_q/block_k are
    given; 128 × 64 otherwise."""
    out, lse = TritonFlashAttention.apply(q, k, v, causal, block_q, block_k)
    return (out, lse) if return_lse else out
