"""Fine-grained FP8 (DeepSeek-V3's recipe): one scale per 1×128 tile of activations, per 128×128 block of weights.

Why tiles. Per-tensor scaling (picotron/fp8.py) maps the tensor's largest |t| onto the format's max, 448 for E4M3.
One outlier — LLM activations have a few channels tens to hundreds of times larger than the rest (Dettmers et al.
2022, "LLM.int8()", https://arxiv.org/abs/2208.07339; Xiao et al. 2023, "SmoothQuant") — sets that scale for every
element, and pushes the ordinary ones down the window, into the subnormals or to zero. With a scale per 128
consecutive elements an outlier costs only its own tile. DeepSeek-V3 (https://arxiv.org/abs/2412.19437, section
3.3.2, "Fine-Grained Quantization"):

    activations and gradients   one scale per 1×128 tile: per token (row), per 128 channels along the contraction
    weights                      one scale per 128×128 block: 128 output × 128 input channels
    format                       E4M3 for every tensor, gradients included ("we adopt the E4M3 format on all
                                 tensors for higher precision"): the fine scales give each tile its own window,
                                 so the range E5M2 bought is no longer needed, and the extra mantissa bit is
    scale                        d = amax(tile) / 448, stored in fp32; t_q = fp8(t / d); t ≈ t_q · d
                                 (computed online from the tile itself, each call: "current" scaling)

(d is the DEquantizing factor, DeepSeek's and torch.nn.functional.scaled_mm's convention; picotron/fp8.py's
per-tensor s = 448 / amax is its reciprocal. An all-zero tile gets amax floored at 1e-12, a finite d.) A shape
whose length along the tiles is not a multiple of 128 has a shorter last tile, scaled on its own (the tiny model's
64 channels are one tile of 64): nothing is padded into the data, and no shape is refused.

The three GEMMs of y = x Wᵀ (x [M, K] tokens × input channels, W [N, K]), each contracting along the axis the
tiles run along, so that one K-slice of 128 has ONE scale per row of each operand:

    forward  y      = x · Wᵀ   contracts K:  x per 1×128 tile along K,            W per 128×128 block
    dgrad    grad_x = g · W    contracts N:  g per 1×128 tile along N,            W per 128×128 block (its transpose)
    wgrad    grad_W = gᵀ · x   contracts M:  g per 128×1 tile (128 tokens × 1 channel), x per 128×1 tile

The wgrad operands are tiled along the TOKENS, because that is the axis wgrad sums over. DeepSeek-V3 describes
their workflow in section 3.5.2 ("Support for Transposed GEMM Operations"): the activations quantized into 1×128
tiles in the forward pass are stored, and in the backward pass "read out, dequantized, transposed, re-quantized into
128×1 tiles". We do exactly that (so backward keeps only the 1-byte x_q and its scales), and quantize the
high-precision output gradient twice, per 1×128 tile for dgrad and per 128×1 tile for wgrad.

Promotion, the accumulation interval N_C = 128 (section 3.3.2, "Increasing Accumulation Precision"). On H800 the
FP8 tensor cores keep only about 14 bits of the running sum (DeepSeek measured it); summing K = 4096 products that
way gave up to about 2 % relative error. Their kernel lets the tensor core sum one 128-wide K-slice (4 WGMMAs), then
copies that partial sum to fp32 registers on the CUDA cores, multiplies it by the slice's two scales and adds it to
an fp32 accumulator. The per-slice scales make this necessary anyway: a scale changes every 128 elements of K, so
the slices cannot be summed before they are rescaled. Our simulation computes the same thing slice by slice:

    y = Σ_j  ( x_q[:, j] · w_q[:, j]ᵀ ) · d_x[:, j] · d_w[j]        j over the ⌈K/128⌉ slices, acc in fp32

with each slice's 128 FP8 products exact in fp32 (a product of two E4M3 numbers has at most 8 significant bits)
and summed in fp32: the promoted, full-precision-accumulator kernel DeepSeek describes, to within fp32 summation
order. `limited_matmul` models the within-slice accumulator with a chosen number of mantissa bits (a model of the
hardware, not a measurement of it), to show why promotion is needed: lesson 11 plots the error against K with and
without it.

Memory of the scales: one fp32 per 128 elements of an activation or gradient, 4/128 = 3.1 % on top of its 1-byte
data; one per 16,384 weight elements (0.02 %).

On a GPU (unmeasured: no GPU has run this code yet). Hopper (sm90) with cuBLASLt ≥ 12.9 has blockwise scaled GEMMs
(DeepSeek's pairs: 1×128 with 128×128, 1×128 with 1×128), exposed by torch.nn.functional.scaled_mm with
ScalingType.BlockWise1x128 / BlockWise128x128; the scales are dequantizing factors, the 1×128 ones [rows, K/128]
stored outer-dimension-major, the 128×128 ones [K/128 padded to a multiple of 4, N/128] (torch's
_scaled_block1x128_block128x128 states these layouts). `_gpu_matmul` calls it for all three GEMMs when the
contraction and the output columns are multiples of 128 and the result is wanted in bf16 or fp32; anything else, on
the GPU too, runs the simulation (correct, and slow: fp32 matmuls, one per K-slice). `benchmarks/gpu_check.py`'s
fp8-blockwise row trains with it, and tests/test_fp8_blockwise.py's CUDA test compares it with the simulation.
Tensor parallelism: each rank tiles its own shard (as picotron/fp8.py scales its shard); with shard widths that
are multiples of 128 the tiles are the same as tp = 1's.

The API:
    quantize_tiles(t, tile=128)             t [R, C] -> (t_q E4M3 [R, C], d fp32 [R, ⌈C/tile⌉]): 1×tile tiles
    quantize_blocks(w, block=128)           w [N, K] -> (w_q, d [⌈N/block⌉, ⌈K/block⌉]): block×block blocks
    dequantize_tiles / dequantize_blocks    t_q · d, each scale spread over its tile / block
    blockwise_matmul(a_q, d_a, b_q, d_b)    a [M, K] 1×128 tiles, b [N, K] with per-row (1×128) scales: a · bᵀ
    limited_matmul(a, b, bits, interval)    a · bᵀ with a `bits`-bit within-slice accumulator, promoted every
                                            `interval` products (interval=None: never)
    fp8_linear_blockwise(x, weight, bias)   F.linear's signature, computed by the three GEMMs above
"""
import torch
import torch.nn.functional as F

from picotron.fp8 import AMAX_FLOOR, E4M3, _capability, linear_out_dtype, saturate

TILE = 128  # DeepSeek-V3's tile (1×128), block (128×128) and promotion interval N_C
FMAX = torch.finfo(E4M3).max  # 448


# ------------------------------------------------------------------------------------------ quantization
def _tiles(t, tile):
    """t [R, C] as fp32 [R, n, tile], zero-padded at the end of each row (zeros change no amax); n = ⌈C/tile⌉."""
    rows, cols = t.shape
    n = -(-cols // tile)
    return F.pad(t.detach().float(), (0, n * tile - cols)).view(rows, n, tile)


def quantize_tiles(t, tile=TILE, fmt=E4M3):
    """(t_q, d): t [R, C] cut into 1×tile tiles along its last axis (the last one shorter when tile ∤ C); each tile
    divided by its own d = amax / fmax (fp32), saturated and cast to fmt. d has shape [R, ⌈C/tile⌉]."""
    rows, cols = t.shape
    tiles = _tiles(t, tile)
    d = tiles.abs().amax(-1).clamp(min=AMAX_FLOOR) / torch.finfo(fmt).max
    q = saturate(tiles / d[..., None], fmt).view(rows, -1)[:, :cols]
    return q, d


def quantize_blocks(w, block=TILE, fmt=E4M3):
    """(w_q, d): w [N, K] cut into block×block blocks (shorter ones at the bottom and right edges), each divided by
    its own d = amax / fmax; d has shape [⌈N/block⌉, ⌈K/block⌉]."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = F.pad(w.detach().float(), (0, kb * block - k, 0, nb * block - n)).view(nb, block, kb, block)
    d = padded.abs().amax(dim=(1, 3)).clamp(min=AMAX_FLOOR) / torch.finfo(fmt).max
    q = saturate(padded / d[:, None, :, None], fmt).view(nb * block, kb * block)[:n, :k]
    return q, d


def spread(d, shape, rows_per, cols_per):
    """The scales d spread over a tensor of `shape`: each repeated over its rows_per × cols_per elements."""
    return d.repeat_interleave(rows_per, 0)[:shape[0]].repeat_interleave(cols_per, 1)[:, :shape[1]]


def dequantize_tiles(q, d, tile=TILE):
    return q.float() * spread(d, q.shape, 1, tile)


def dequantize_blocks(q, d, block=TILE):
    return q.float() * spread(d, q.shape, block, block)


# ------------------------------------------------------------------------------------------------ matmul
def blockwise_matmul(a_q, d_a, b_q, d_b, out_dtype=torch.float32, tile=TILE):
    """a · bᵀ from FP8 a_q [M, K] with 1×tile scales d_a [M, ⌈K/tile⌉] and b_q [N, K] with per-row scales
    d_b [N, ⌈K/tile⌉] (a 128×128 block's scale repeated over its rows: `spread(d, (N, nk), 128, 1)`).
    Slice by slice along K: the exact FP8 products of one slice summed in fp32, multiplied by the slice's two
    scales, added to an fp32 accumulator (the promotion every `tile` products); rounded once to out_dtype."""
    (m, k), n = a_q.shape, b_q.shape[0]
    acc = torch.zeros(m, n, dtype=torch.float32, device=a_q.device)
    for j, k0 in enumerate(range(0, k, tile)):
        part = a_q[:, k0:k0 + tile].float() @ b_q[:, k0:k0 + tile].float().t()
        acc += part * d_a[:, j, None] * d_b[None, :, j]
    return acc.to(out_dtype)


def round_mantissa(t, bits):
    """t with its significand chopped (rounded toward zero) to `bits` bits: a model of an accumulator that aligns
    each addend to the running sum's exponent and drops the bits shifted out."""
    m, e = torch.frexp(t)  # t = m · 2^e, |m| in [0.5, 1)
    return torch.ldexp(torch.trunc(m * 2.0 ** bits) / 2.0 ** bits, e)


def limited_matmul(a, b, bits=14, interval=TILE):
    """a [M, K] · b [N, K]ᵀ (float64 in, float64 out) summing the K products one at a time in an accumulator of
    `bits` significant bits; every `interval` products (None: never) the partial sum is promoted: added to an exact
    (float64) total and the limited accumulator restarted. A model of DeepSeek-V3's section 3.3.2, not the
    hardware's exact behaviour."""
    a, b = a.double(), b.double()
    total = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64)
    part = torch.zeros_like(total)
    for i in range(a.shape[1]):
        part = round_mantissa(part + a[:, i, None] * b[None, :, i], bits)
        if interval is not None and (i + 1) % interval == 0:
            total, part = total + part, torch.zeros_like(part)
    return total + part


# ------------------------------------------------------------------------------------------ the GPU path
def _gpu_ready(a_q, b_q, out_dtype):
    """Whether torch's blockwise scaled GEMM can compute this product: an NVIDIA Hopper GPU (sm90), a torch with
    torch.nn.functional.scaled_mm, K and N multiples of 128, a bf16 or fp32 result. Never true on the CPU."""
    return (a_q.is_cuda and torch.version.hip is None and hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")
            and _capability(a_q.device.index)[0] == 9 and out_dtype in (torch.bfloat16, torch.float32)
            and a_q.shape[1] % TILE == 0 and b_q.shape[0] % TILE == 0)


def _outer_major(d):
    """d [R, C] stored column-major (C × R contiguous, then viewed back): the scale layout cuBLASLt reads."""
    return d.t().contiguous().t()


def scaled_mm_operands(a_q, d_a, b_q, d_b, b_blocks):
    """(mat_a, mat_b, scale_a, scale_b) as torch.nn.functional.scaled_mm takes them for a · bᵀ: a_q [M, K] row-major
    with d_a [M, K/128] (strides 1, M); mat_b = bᵀ [K, N] column-major, with d_b [N/128, K/128] (b_blocks) as
    [L4, N/128] (strides 1, L4; L4 = K/128 rounded up to a multiple of 4, the padding 1.0) or d_b [N, K/128] as
    [N, K/128] (strides 1, N). Pure layout: tests/test_fp8_blockwise.py checks it on the CPU."""
    if b_blocks:
        kb = d_b.shape[1]
        scale_b = F.pad(d_b, (0, -(-kb // 4) * 4 - kb), value=1.0).contiguous().t()
    else:
        scale_b = _outer_major(d_b)
    return a_q.contiguous(), b_q.contiguous().t(), _outer_major(d_a), scale_b


def _gpu_matmul(a_q, d_a, b_q, d_b, b_blocks, out_dtype):
    """a · bᵀ by torch.nn.functional.scaled_mm on a Hopper GPU (UNMEASURED: no GPU has run it; the CUDA test in
    tests/test_fp8_blockwise.py, which ./run.sh gpu-check runs, compares it with the simulation)."""
    st = F.ScalingType
    mat_a, mat_b, scale_a, scale_b = scaled_mm_operands(a_q, d_a, b_q, d_b, b_blocks)
    return F.scaled_mm(mat_a, mat_b, scale_a, st.BlockWise1x128, scale_b,
                       st.BlockWise128x128 if b_blocks else st.BlockWise1x128, output_dtype=out_dtype)


def _matmul(a_q, d_a, b_q, d_b, b_blocks, out_dtype):
    """a · bᵀ: on a Hopper GPU by the blockwise scaled GEMM when it applies, else by the simulation."""
    if _gpu_ready(a_q, b_q, out_dtype):
        return _gpu_matmul(a_q, d_a, b_q, d_b, b_blocks, out_dtype)
    if b_blocks:
        d_b = spread(d_b, (b_q.shape[0], d_b.shape[1]), TILE, 1)
    return blockwise_matmul(a_q, d_a, b_q, d_b, out_dtype)


# ------------------------------------------------------------------------------------------ the layer
class _BlockwiseFP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype):
        with torch.autocast(x.device.type, enabled=False):
            x_q, d_x = quantize_tiles(x.reshape(-1, x.shape[-1]))
            w_q, d_w = quantize_blocks(weight)
            if bias is None:
                y = _matmul(x_q, d_x, w_q, d_w, True, out_dtype)
            else:
                y = (_matmul(x_q, d_x, w_q, d_w, True, torch.float32) + bias.float()).to(out_dtype)
        ctx.save_for_backward(x_q, d_x, w_q, d_w)  # 1 byte per element, plus the scales
        ctx.x_shape, ctx.dtypes = x.shape, (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x_q, d_x, w_q, d_w = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        grad_x = grad_w = grad_b = None
        with torch.autocast(grad_y.device.type, enabled=False):
            g = grad_y.reshape(-1, grad_y.shape[-1])
            if need_x:  # g [M, N] per 1×128 tile along N; Wᵀ [K, N]: the same blocks, transposed
                g_q, d_g = quantize_tiles(g)
                grad_x = _matmul(g_q, d_g, w_q.t(), d_w.t(), True, x_dtype).reshape(ctx.x_shape)
            if need_w:  # gᵀ [N, M] and xᵀ [K, M] per 1×128 tile along M: 128×1 tiles of g and x (section 3.5.2)
                gt_q, d_gt = quantize_tiles(g.t())
                xt_q, d_xt = quantize_tiles(dequantize_tiles(x_q, d_x).t())
                grad_w = _matmul(gt_q, d_gt, xt_q, d_xt, False, w_dtype)
            if need_b:
                grad_b = g.float().sum(0).to(b_dtype)
        return grad_x, grad_w, grad_b, None


def fp8_linear_blockwise(x, weight, bias=None):
    """F.linear(x, weight, bias) with E4M3 operands in all three GEMMs, scaled per 1×128 tile and 128×128 block
    (module docstring). The result's dtype is F.linear's: autocast's under autocast, x's otherwise."""
    return _BlockwiseFP8Linear.apply(x, weight, bias, linear_out_dtype(x))
