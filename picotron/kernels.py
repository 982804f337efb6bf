"""Kernels: attention tiled so the s×s matrix never exists, and RMSNorm and SwiGLU fused into one pass each.

Why. A GPU does ~1,000 FLOPs in the time it moves ~3 bytes to or from its main memory (H100: 989 TFLOP/s bf16
against 3.35 TB/s), so an operation that does few FLOPs per byte it moves runs at the speed of memory, not of
arithmetic. Written op by op, attention and the small layers around the matmuls are such operations: every op
reads its inputs from main memory and writes its output back, and the next op reads it again.

1. Attention, softmax(q k^T / sqrt(d)) v, written out (`AttentionCore`'s "eager" path) writes the s×s scores
   S, reads them for the softmax, writes the probabilities P and reads them for P v: 4·s² elements moved per
   head against 4·s·d for q, k, v and the output, 4·d FLOPs per score either way: s/d times more bytes than
   the inputs and outputs themselves, 32x for s = 4,096 and d = 128 (`attention_bytes`). Flash attention
   (Dao et al. 2022, FlashAttention-2 2023) never forms S: it walks over tiles of keys for one tile of queries
   at a time, keeping the tile's scores in fast memory, and merges the tiles with the ONLINE SOFTMAX (Milakov
   and Gimelshein 2018). For each query row, with running max m, running sum l and unnormalised output acc:

       S_j   = q k_j^T / sqrt(d)                      scores against key tile j
       m'    = max(m, rowmax(S_j))                    the new running max
       P_j   = exp(S_j - m')                          this tile's probabilities, up to the final 1/l
       l     = exp(m - m')·l + rowsum(P_j)            rescale the old sum to the new max, add the tile's
       acc   = exp(m - m')·acc + P_j v_j              the same for the output
       out   = acc / l,   lse = m + log(l)            after the last tile; lse = log Σ_j exp(S_ij)

   Causal attention skips the tiles wholly above the diagonal (about half of them) and masks the diagonal
   ones. Forward keeps only q, k, v, out and lse (one number per row) for backward, which recomputes each
   tile's probabilities from lse instead of storing them (FlashAttention-2, Algorithm 2):

       P_ij = exp(S_ij - lse_i),   dv_j += P^T do,   dP = do v_j^T,
       D_i  = rowsum(do ∘ out)  (= Σ_j P_ij dP_ij),   dS = P ∘ (dP - D),
       dq  += dS k_j / sqrt(d),   dk_j += dS^T q / sqrt(d).

   `flash_attention(impl="plain")` does exactly this in plain PyTorch, a loop over tiles: a reference to read
   and test, not a fast kernel (here a "tile" is just a small tensor). Grouped-query attention shares one K/V
   tile among the a/k query heads of its group by broadcasting, so K and V are never repeated to all heads.
   The real kernel is picotron/flash_triton.py, the same arithmetic in Triton, FlashAttention-2's structure:
   one program per query tile keeps its Q tile, m, l and acc in registers and its K/V tiles in shared memory
   (forward); backward is a kernel for D = rowsum(dO ∘ O), one for dk/dv (a program per key tile walks the
   query tiles of every head of its GQA group) and one for dq (a program per query tile), no atomics. Tiles
   of 32 to 128 rows (128 × 64 ...), autotuned on CUDA; head dims padded to a power of two; fp32, bf16 or fp16
   in, fp32 sums. `flash_attention(impl="auto")`, what `--attn-impl flash` calls, takes the Triton kernels
   for CUDA tensors when triton imports and the plain tiles otherwise; on a CPU the kernels run only under
   Triton's interpreter (the tests check them against SDPA there).

2. RMSNorm (y = x / sqrt(mean(x²) + eps) · w) and SwiGLU (y = silu(gate) · up) are a handful of elementwise
   ops and a reduction: written in PyTorch each op is one kernel moving the whole tensor, and autograd keeps
   the intermediates. Fused, a kernel reads x (or gate and up) once and writes y once; backward reads them
   again and recomputes the rest. Four implementations of each, chosen by `impl`:
     "triton"   hand-written Triton kernels, forward and backward (the Triton tutorials' layer norm, reduced
                to RMSNorm). On CUDA they are compiled; without a GPU they run under Triton's interpreter
                (TRITON_INTERPRET=1 in the environment before triton is imported: numpy executes each program
                instance in turn, slowly, but the same source is run and tested on a laptop);
     "compile"  torch.compile of the plain code: inductor writes the fused kernel itself (C++ on a CPU, Triton
                on a GPU), forward and backward;
     "plain"    the op-by-op PyTorch reference, the arithmetic of `model.RMSNorm` and `model.MLP`;
     "auto"     "triton" for CUDA tensors when triton imports, otherwise "compile".

Sources:
  FlashAttention-2 (Dao 2023), https://arxiv.org/abs/2307.08691 ; FlashAttention (Dao et al. 2022),
  https://arxiv.org/abs/2205.14135 ; online softmax (Milakov and Gimelshein 2018), https://arxiv.org/abs/1805.02867
  Triton tutorials (fused softmax, layer norm, fused attention), https://triton-lang.org/main/getting-started/tutorials/
  Triton's interpreter, https://triton-lang.org/main/programming-guide/chapter-3/debugging.html
  Fused RMSNorm and SwiGLU for LLM training (Liger Kernel), https://arxiv.org/abs/2410.10989
"""
import functools
import math

import torch
import torch.nn.functional as F

from picotron.config import KERNELS

# The kernels' rule (picotron.rules.kernels_rule, checked before any process starts) asks `triton_runs_on` below
# whether this machine runs them; this module imports nothing of the rules, so the two stay out of a circle.

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton: the "compile" and "plain" paths remain
    triton = None

IMPLS = KERNELS  # plain, compile, triton, auto (the --kernels values)


# ======================================================================================= flash attention
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what picotron.flash_triton's kernels take


def key_tiles(q0: int, q1: int, s_k: int, block_k: int, causal: bool):
    """Start of every key tile that queries q0..q1-1 look at: all of them, or under a causal mask only
    those starting at or before the last query (query i sees keys 0..i), so future tiles are skipped."""
    end = min(s_k, q1) if causal else s_k
    return range(0, end, block_k)


def _scores(q_tile, k_tile, q0: int, k0: int, causal: bool, scale: float):
    """S = q k^T · scale for one tile pair, [b, kv, g, bq, bk]; keys after the query set to -inf (causal).

    q_tile [b, kv, g, bq, d] and k_tile [b, kv, 1, bk, d]: the matmul broadcasts the group's one K tile to
    its g query heads."""
    s = (q_tile @ k_tile.transpose(-2, -1)) * scale
    bq, bk = s.shape[-2:]
    if causal and k0 + bk - 1 > q0:  # only a tile that crosses the diagonal needs a mask
        q_pos = torch.arange(q0, q0 + bq, device=s.device)
        k_pos = torch.arange(k0, k0 + bk, device=s.device)
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return s


def _flash_forward(q, k, v, causal, block_q, block_k):
    """out [b, kv, g, s, d] and lse [b, kv, g, s] by the online softmax, one query tile at a time."""
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(q.shape[-1])
    s_q, s_k = q.shape[-2], k.shape[-2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=acc_dtype, device=q.device)
    for q0 in range(0, s_q, block_q):
        q1 = min(q0 + block_q, s_q)
        q_tile = q[..., q0:q1, :].to(acc_dtype)
        m = torch.full(q_tile.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)  # running max
        l = torch.zeros_like(m)  # running sum of exp(S - m)
        acc = torch.zeros_like(q_tile)  # running Σ exp(S - m) v
        for k0 in key_tiles(q0, q1, s_k, block_k, causal):
            k1 = min(k0 + block_k, s_k)
            s = _scores(q_tile, k[..., k0:k1, :].to(acc_dtype), q0, k0, causal, scale)
            m_new = torch.maximum(m, s.amax(-1))  # finite: key tile 0 always holds a visible key
            p = torch.exp(s - m_new[..., None])
            rescale = torch.exp(m - m_new)  # exp(-inf) = 0 on the first tile
            l = rescale * l + p.sum(-1)
            acc = rescale[..., None] * acc + p @ v[..., k0:k1, :].to(acc_dtype)
            m = m_new
        out[..., q0:q1, :] = (acc / l[..., None]).to(q.dtype)
        lse[..., q0:q1] = m + torch.log(l)
    return out, lse


def _flash_backward(q, k, v, out, lse, dout, causal, block_q, block_k):
    """dq, dk, dv (FlashAttention-2's backward): outer loop over key tiles, whose dk and dv accumulate
    locally; inner loop over the query tiles that see them, each recomputing its probabilities from lse."""
    acc_dtype = lse.dtype
    scale = 1.0 / math.sqrt(q.shape[-1])
    s_q, s_k = q.shape[-2], k.shape[-2]
    D = (dout.to(acc_dtype) * out.to(acc_dtype)).sum(-1)  # rowsum(dO ∘ O) = Σ_j P_ij dP_ij
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for k0 in range(0, s_k, block_k):
        k1 = min(k0 + block_k, s_k)
        k_tile, v_tile = k[..., k0:k1, :].to(acc_dtype), v[..., k0:k1, :].to(acc_dtype)
        dk_tile, dv_tile = torch.zeros_like(k_tile), torch.zeros_like(v_tile)
        for q0 in range(0, s_q, block_q):
            q1 = min(q0 + block_q, s_q)
            if k0 not in key_tiles(q0, q1, s_k, block_k, causal):
                continue  # this key tile lies wholly in these queries' future
            q_tile, do_tile = q[..., q0:q1, :].to(acc_dtype), dout[..., q0:q1, :].to(acc_dtype)
            p = torch.exp(_scores(q_tile, k_tile, q0, k0, causal, scale) - lse[..., q0:q1, None])
            dp = do_tile @ v_tile.transpose(-2, -1)
            ds = p * (dp - D[..., q0:q1, None])  # the softmax's backward, row by row
            # the g query heads of a group share this K/V tile: their contributions add up (sum over dim 2)
            dv_tile += (p.transpose(-2, -1) @ do_tile).sum(2, keepdim=True)
            dk_tile += (ds.transpose(-2, -1) @ q_tile).sum(2, keepdim=True) * scale
            dq[..., q0:q1, :] += (ds @ k_tile) * scale
        dk[..., k0:k1, :], dv[..., k0:k1, :] = dk_tile, dv_tile
    return dq.to(q.dtype), dk, dv


class FlashAttention(torch.autograd.Function):
    """Tiled attention on grouped views: q [b, kv, g, s, d], k/v [b, kv, 1, s, d]. Saves q, k, v, out, lse."""

    @staticmethod
    def forward(ctx, q, k, v, causal, block_q, block_k):
        out, lse = _flash_forward(q, k, v, causal, block_q, block_k)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (causal, block_q, block_k)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _flash_backward(q, k, v, out, lse, dout, *ctx.config)
        return dq, dk, dv, None, None, None


def flash_attention(q, k, v, causal: bool = True, block_q=None, block_k=None, impl: str = "auto"):
    """softmax(q k^T / sqrt(d)) v, tile by tile: q [b, a, s, d], k/v [b, kv, s, d] with kv dividing a (query
    head h uses KV head h // (a/kv), as `F.scaled_dot_product_attention(..., enable_gqa=True)`) -> [b, a, s, d].
    causal: query i sees keys 0..i (SDPA's is_causal). impl: "plain" the PyTorch tiles above (64 × 64 by
    default), "triton" the kernels of picotron.flash_triton (128 × 64), "auto" triton for CUDA tensors when
    triton imports, otherwise plain."""
    b, a, s, d = q.shape
    kv = k.shape[1]
    if a % kv or k.shape != v.shape or k.shape[0] != b or k.shape[-1] != d:
        raise ValueError(f"flash_attention: q {tuple(q.shape)} with k {tuple(k.shape)}, v {tuple(v.shape)}: "
                         f"want q [b, a, s, d], k and v [b, kv, s, d], kv dividing a.")
    if impl not in ("auto", "plain", "triton"):
        raise ValueError(f"flash_attention: impl={impl!r}; use 'auto', 'plain' or 'triton'.")
    if impl == "auto":  # the kernels take fp32, bf16 and fp16 (float64 stays on the plain tiles)
        impl = "triton" if triton is not None and q.is_cuda and q.dtype in TRITON_DTYPES else "plain"
    if impl == "triton":
        if not triton_runs_on(q.device):
            raise ValueError("flash_attention(impl='triton') needs triton and a CUDA tensor, or on a CPU "
                             "TRITON_INTERPRET=1 in the environment before triton is imported (the interpreter).")
        from picotron.flash_triton import flash_attention_triton  # compiles the kernels' Python on first use
        return flash_attention_triton(q, k, v, causal, block_q, block_k)
    out = FlashAttention.apply(q.unflatten(1, (kv, a // kv)), k.unsqueeze(2), v.unsqueeze(2),
                               causal, block_q or 64, block_k or 64)
    return out.flatten(1, 2)


def attention_bytes(b, a, kv_heads, s, d, elem, block_q=64, block_k=64, impl="tiled", causal=True) -> int:
    """Bytes one attention forward moves to or from main memory, elem bytes per element (2 for bf16).

    naive (three kernels, mask and scale fused into the softmax):
        S = q k^T reads q, k, writes S; P = softmax(S) reads S, writes P; out = P v reads P, v, writes out:
        elem·(2·b·a·s·d + 2·b·kv·s·d + 4·b·a·s²)      (the causal mask saves nothing: S is formed whole)
    tiled (flash_attention): each query tile reads its q once and writes its out once, plus lse (fp32), and
        reads the K and V tiles it sees, once per query tile and KV head (the g query heads of a group share
        them); non-causal that is all s keys for each of ceil(s/block_q) query tiles:
        elem·(2·b·a·s·d + 2·b·kv·d·Σ_tiles keys_seen) + 4·b·a·s
    The s² term is gone: the bytes grow like s²/block_q instead of s², and block_q = s would read K and V
    once. Backward moves about twice as much in both (the naive one reads P again; the tiled one recomputes
    it)."""
    q_and_out = 2 * b * a * s * d * elem
    if impl == "naive":
        return q_and_out + 2 * b * kv_heads * s * d * elem + 4 * b * a * s * s * elem
    if impl != "tiled":
        raise ValueError(f"attention_bytes: impl={impl!r}; use 'naive' or 'tiled'.")
    keys_seen = sum(min(k0 + block_k, s) - k0
                    for q0 in range(0, s, block_q)
                    for k0 in key_tiles(q0, min(q0 + block_q, s), s, block_k, causal))
    return q_and_out + 2 * b * kv_heads * d * keys_seen * elem + 4 * b * a * s


# =========================================================================== fused RMSNorm and SwiGLU
def rms_norm_plain(x, weight, eps: float):
    """x / sqrt(mean(x²) + eps) · weight, the norm in float32 and cast back (model.RMSNorm's arithmetic)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def swiglu_plain(gate, up):
    """silu(gate) · up = gate · sigmoid(gate) · up (model.MLP's arithmetic)."""
    return F.silu(gate) * up


if triton is not None:
    @triton.jit
    def _rms_norm_fwd_kernel(X, W, Y, RSTD, N, eps, BLOCK: tl.constexpr):
        """One program per row: rstd = 1/sqrt(mean(x²) + eps), y = (x·rstd rounded to x's dtype)·w."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        x_hat = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row * N + cols, (x_hat * w).to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW_PART, M, N, BLOCK: tl.constexpr):
        """Each program walks rows pid, pid + P, ...: dx = rstd·(g - x̂·mean(g·x̂)) with g = dy·w, and sums
        dy·x̂ over its rows into one partial dw row (the host adds the P partial rows)."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(pid, M, tl.num_programs(0)):
            offs = tl.cast(row, tl.int64) * N + cols
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row)
            x_hat = x * rstd
            g = dy * w  # d loss / d x̂
            dx = (g - x_hat * (tl.sum(g * x_hat, axis=0) / N)) * rstd
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
            dw += dy * x_hat
        tl.store(DW_PART + pid * N + cols, dw, mask=mask)

    @triton.jit
    def _swiglu_fwd_kernel(G, U, Y, n, BLOCK: tl.constexpr):
        """y = g·sigmoid(g)·u over one block of elements, in float32."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + offs, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
        """du = dy·silu(g); dg = dy·u·silu'(g), silu'(g) = sig(g)·(1 + g·(1 - sig(g)))."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        tl.store(DU + offs, (dy * g * sig).to(DU.dtype.element_ty), mask=mask)
        tl.store(DG + offs, (dy * u * sig * (1 + g * (1 - sig))).to(DG.dtype.element_ty), mask=mask)


class TritonRMSNorm(torch.autograd.Function):
    """RMSNorm through the two Triton kernels; saves x, w and one rstd per row."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        (M, N), block = x2.shape, triton.next_power_of_2(x2.shape[-1])
        y = torch.empty(x2.shape, dtype=torch.result_type(x, weight), device=x.device)
        rstd = torch.empty(M, dtype=torch.float32, device=x.device)
        _rms_norm_fwd_kernel[(M,)](x2, weight, y, rstd, N, eps, BLOCK=block)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        (M, N), block = x2.shape, triton.next_power_of_2(x2.shape[-1])
        programs = min(M, 256)
        dx = torch.empty_like(x2)
        dw_part = torch.empty(programs, N, dtype=torch.float32, device=x2.device)
        _rms_norm_bwd_kernel[(programs,)](dy.reshape(M, N).contiguous(), x2, weight, rstd, dx, dw_part, M, N,
                                          BLOCK=block)
        return dx.view(dy.shape), dw_part.sum(0).to(weight.dtype), None


class TritonSwiGLU(torch.autograd.Function):
    """silu(gate)·up through the two Triton kernels; saves gate and up (what the plain op saves too)."""
    BLOCK = 1024

    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty(gate.shape, dtype=torch.result_type(gate, up), device=gate.device)
        n = gate.numel()
        _swiglu_fwd_kernel[(triton.cdiv(n, TritonSwiGLU.BLOCK),)](gate, up, y, n, BLOCK=TritonSwiGLU.BLOCK)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dg, du, n = torch.empty_like(gate), torch.empty_like(up), gate.numel()
        _swiglu_bwd_kernel[(triton.cdiv(n, TritonSwiGLU.BLOCK),)](dy.contiguous(), gate, up, dg, du, n,
                                                                 BLOCK=TritonSwiGLU.BLOCK)
        return dg, du


def triton_interprets() -> bool:
    """Whether Triton runs our kernels under its interpreter: Triton decides when @triton.jit makes a kernel (from
    TRITON_INTERPRET, which it reads itself), so we ask a kernel what it was made as."""
    return triton is not None and type(_rms_norm_fwd_kernel).__name__ == "InterpretedFunction"


def triton_runs_on(device) -> bool:
    """Whether the Triton kernels can run on tensors of `device`: compiled on CUDA, or interpreted."""
    return triton is not None and (torch.device(device).type == "cuda" or triton_interprets())


@functools.cache
def _compiled(fn):
    """torch.compile(fn), made once per function on first use (compiling costs seconds)."""
    return torch.compile(fn)


def _choose(impl: str, x) -> str:
    """The implementation `impl` stands for on x's device; a sentence if it cannot run there."""
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel impl {impl!r}; use one of {IMPLS}.")
    if impl == "auto":
        return "triton" if triton is not None and x.is_cuda else "compile"
    if impl == "triton" and not triton_runs_on(x.device):
        raise ValueError("impl='triton' needs triton (pip install triton) and a CUDA tensor, or on a CPU "
                         "TRITON_INTERPRET=1 in the environment before triton is imported (the interpreter).")
    return impl


def rms_norm(x, weight, eps: float, impl: str = "auto"):
    """RMSNorm of x [..., h] with weight [h]; impl one of IMPLS (see the module docstring)."""
    impl = _choose(impl, x)
    if impl == "triton":
        return TritonRMSNorm.apply(x, weight, eps)
    return (_compiled(rms_norm_plain) if impl == "compile" else rms_norm_plain)(x, weight, eps)


def swiglu(gate, up, impl: str = "auto"):
    """silu(gate) · up, gate and up of one shape; impl one of IMPLS (see the module docstring)."""
    impl = _choose(impl, gate)
    if impl == "triton":
        return TritonSwiGLU.apply(gate, up)
    return (_compiled(swiglu_plain) if impl == "compile" else swiglu_plain)(gate, up)
