"""FP8 matmuls with per-tensor scaling: the decoder layers' linear layers computed from 8-bit operands.

Why FP8. A Hopper or Ada tensor core multiplies 8-bit floats at twice its bf16 rate (H100 SXM: about 1,979 dense
FP8 TFLOP/s against 989 bf16), and an 8-bit operand is half the bytes to move and, saved for backward, half the
activation memory. The price is precision: 8 bits leave 2 or 3 for the mantissa. Two formats exist (Micikevicius
et al. 2022, "FP8 Formats for Deep Learning", https://arxiv.org/abs/2209.05433):

    format   bits s/e/m   bias   largest                  smallest normal / subnormal   unit roundoff u
    E4M3     1/4/3        7      448   = 1.75·2^8         2^-6  / 2^-9                  2^-4  (6.25 %)
    E5M2     1/5/2        15     57344 = 1.75·2^15        2^-14 / 2^-16                 2^-3  (12.5 %)

E4M3 here is torch's float8_e4m3fn ("finite"): no infinities, and only S.1111.111 is NaN, which frees the
exponent 1111 for numbers up to 448 (IEEE style it would stop at 240). E5M2 is IEEE-like (inf and NaN in the
top exponent). u is half the gap between 1 and the next number: any number inside the normal range is rounded
with a relative error of at most u; below it the error is at most half the smallest subnormal (2^-10, 2^-17).

Why E4M3 forward and E5M2 backward (Transformer Engine's "HYBRID" format). Weights and activations after a norm
live in a few binades and want the extra mantissa bit; gradients spread over many more orders of magnitude
(across tokens, layers and the course of training) and want the range: E5M2 spans 32 binades, E4M3 18.

Per-tensor scaling. Even E5M2's range is too narrow to hold a tensor wherever its values happen to sit (a
gradient of 1e-6 is below its smallest subnormal). So each tensor t is multiplied by a scale s before the cast,
and the matmul's result is divided by the two operands' scales:

    s = fmax / amax(t)            amax = max |t|, floored at 1e-12 so an all-zero tensor gets a finite scale
    t_q = fp8(clamp(t·s, ±fmax))  round to nearest, ties to even; the largest |t| lands on fmax
    a bᵀ ≈ (a_q b_qᵀ) / (s_a s_b) the 8-bit products accumulated in fp32, then rescaled

"Current" scaling (this module): s from this very tensor, each call. Transformer Engine's older default,
"delayed" scaling, takes s from a history of past amaxes (up to 1,024 steps) to save the extra read of the
tensor; we do not, because (1) the current scale never saturates on a tensor larger than its predecessors,
(2) the result is a function of the inputs alone: activation recomputation (--recompute full) redoes the same
forward bit for bit, and a resumed run needs no amax history in its checkpoint, and (3) the libraries went the
same way: torchao deleted delayed scaling in 2025 for lack of users next to the more accurate dynamic scaling
(https://github.com/pytorch/ao/issues/1680), and Transformer Engine added `Float8CurrentScaling`
(https://docs.nvidia.com/deeplearning/transformer-engine/user-guide/examples/fp8_primer.html). One scale per
tensor is the coarsest choice: a single outlier makes every other element use fewer binades. DeepSeek-V3
(https://arxiv.org/abs/2412.19437, section 3.3) scales 1×128 tiles of activations and 128×128 blocks of weights
instead (--fp8-recipe blockwise: picotron/fp8_blockwise.py), and Blackwell's MXFP8 one scale per 32 elements.

The three matmuls of a linear layer y = x Wᵀ (x [M, K], W [N, K]), as real FP8 training does them:

    forward   y      = (x_q  · w_qᵀ) / (s_x s_w)     x_q, w_q E4M3, saved for backward (1 byte per element)
    backward  grad_x = (g_q  · w_q ) / (s_g s_w)     g_q = grad_y in E5M2 with its own scale s_g
              grad_w = (g_qᵀ · x_q ) / (s_g s_x)

The backward treats the rounding as the identity (a straight-through estimator): it is the gradient of the
exact linear map at the rounded operands. A bias (none in picotron's model) is added in fp32, and its gradient
is the sum of the unrounded grad_y.

How the product is computed. On an NVIDIA GPU with FP8 tensor cores (compute capability 8.9 or more) and K, N
multiples of 16, `torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=...)`: a row-major, b column-major,
scale_a and scale_b the INVERSE scales 1/s as fp32 tensors of one element (it computes (a·scale_a)(b·scale_b),
accumulates in fp32 and rounds to out_dtype in its epilogue: bf16 for the forward under autocast, as F.linear's).
Elsewhere (CPU, older GPUs, other shapes) a simulation: the FP8 operands cast back to fp32 and multiplied by an
fp32 matmul, the result rounded to out_dtype. The quantization (amax, scale, clamp, cast) is one plain function,
compiled with torch.compile on CUDA (two fused kernels instead of five passes over the tensor), plain on the CPU. What is exact in that simulation: the operands are the same FP8 numbers bit for bit (the cast is
the same rounding); each product of two FP8 numbers (at most 4 + 4 significant bits, exponents within fp32's
range) is exact in fp32, as it is in the tensor core; FP8 numbers are exactly representable in TF32, so even a
GPU that runs fp32 matmuls in TF32 multiplies them exactly. What is not: the accumulation. The fp32 sum of K
products depends on the order of the additions (|error| ≤ about K·2^-24·Σ|products|, far less in practice), and
Hopper's FP8 tensor cores do not accumulate in full fp32: DeepSeek-V3 measured about 14 bits of accumulator
precision on H800 and promoted partial sums to fp32 every 128 products to fix it. The rescale by 1/s_a·1/s_b
costs a few fp32 roundings, ordered differently in cuBLAS's epilogue. So the simulation equals an ideal FP8
tensor core with an fp32 accumulator, to within fp32 summation order; it reproduces the FP8 rounding errors
exactly and any hardware accumulator's extra error not at all.

Where FP8 is used. `apply` routes every linear layer inside the decoder layers through `fp8_linear`: q, k, v, o
and gate, up, down (the experts' w1, w3, w2 with experts), also as tensor parallelism's ColumnParallelLinear and
RowParallelLinear, whose collectives are untouched (they move the high-precision outputs and gradients). The
embedding, the final norm, the LM head, the MoE router, attention's softmax(QKᵀ)V and the norms stay in higher
precision, as DeepSeek-V3 keeps them (section 3.3.1: the embedding, the output head, MoE gating, normalization
and attention): they are cheap next to the decoder's matmuls, and the logits and the router's discrete choices
are where an 8-bit error costs most. Under tensor parallelism each rank scales its own shard (the weight's
slice, and a row-parallel layer's slice of the input), a finer scaling than one scale for the whole matrix, so
tp > 1 does not reproduce tp = 1 bit for bit (Transformer Engine can all-reduce the amax over the tp group; we
do not).

The API:
    E4M3, E5M2                           the two formats (torch dtypes)
    quantize(t, fmt, scale=None)         -> (t_fp8, scale): current scaling unless a scale is given
    dequantize(t_fp8, scale, dtype=fp32) -> t_fp8 / scale
    fp8_linear(x, weight, bias=None)     F.linear's signature, result shape and dtype (autocast's under autocast,
                                         x's otherwise), computed as above
    apply(module, recipe="tensor")       in place, returns module: every linear layer of every DecoderLayer
                                         inside `module` (a Llama, a pipeline stage) computes through fp8_linear
                                         (recipe="blockwise": picotron.fp8_blockwise's 1×128 / 128×128 scales)

`apply` changes no parameter and no name (the state dict and checkpoints are unchanged; it only sets an attribute
the forward reads: tensor parallelism's `matmul`, nn.Linear's `forward`). Call it after every module swap
(tensor_parallel.apply, expert parallelism, pipeline stages), on the meta device or later. It takes the same seam
as the split pipeline schedules' deferred weight gradients (zero_bubble.defer_weight_grads), so the two do
not combine: whichever is applied last wins (FP8 applied after it: weight gradients computed in B, correct but
not deferred; applied before it: FP8 silently replaced). Autocast is switched off inside fp8_linear (its fp32
products must not be rounded to bf16 before the rescale), and only its result follows autocast: bf16 under the
fp8 recipe's bf16 autocast, so the rest of the layer saves bf16 tensors for backward, as in the bf16 recipe, and
the linears themselves save 1-byte E4M3 operands (fewer activation bytes than bf16 autocast in total).
"""
from functools import lru_cache, partial

import torch
from torch import nn

from picotron.model import DecoderLayer
from picotron.moe import MoE
from picotron.tensor_parallel import ColumnParallelLinear, RowParallelLinear

E4M3 = torch.float8_e4m3fn  # forward operands: activations and weights
E5M2 = torch.float8_e5m2    # gradients
AMAX_FLOOR = 1e-12          # the smallest amax a scale is computed from


# ------------------------------------------------------------------------------------------ quantization
def current_scale(t, fmt):
    """fmax / amax(t) as an fp32 scalar tensor (no host sync): t's largest magnitude maps onto the format's max."""
    amax = t.detach().abs().amax().float() if t.numel() else t.new_zeros((), dtype=torch.float32)
    return torch.finfo(fmt).max / amax.clamp(min=AMAX_FLOOR)


def _quantize(t, fmt, scale=None):
    """The readable definition (and the CPU path): amax, scale, multiply, clamp, cast, each its own operation."""
    if scale is None:
        scale = current_scale(t, fmt)
    return saturate(t.detach().float() * scale, fmt), scale


def saturate(t, fmt):
    """t (fp32, already scaled) clamped to ±fmax and cast to fmt: round to nearest even, no overflow to NaN."""
    fmax = torch.finfo(fmt).max
    return t.clamp(-fmax, fmax).to(fmt)


@lru_cache(maxsize=None)
def _quantize_compiled():
    """_quantize compiled (on first use): on a GPU the amax reduction and the scale-clamp-cast pass become two
    fused kernels instead of five separate passes over the tensor (abs, amax, multiply, clamp, cast)."""
    return torch.compile(_quantize, dynamic=None)


def _quantizer(t):
    """The function that quantizes t: compiled on a GPU with FP8 (Triton casts to E4M3 from capability 8.9 on),
    unless we are already inside a torch.compile trace (which fuses it anyway); the plain one everywhere else (the
    CPU, older GPUs). The same operations in the same order (tests/test_fp8.py compares them bit for bit on a GPU)."""
    if t.is_cuda and _fp8_tensor_cores(t) and not torch.compiler.is_compiling():
        return _quantize_compiled()
    return _quantize


def quantize(t, fmt, scale=None):
    """(t·scale in `fmt`, scale): t·scale computed in fp32, saturated at ±fmax, rounded to nearest even.
    scale=None: the current scale of t."""
    return _quantizer(t)(t, fmt, scale)


def dequantize(t_fp8, scale, dtype=torch.float32):
    return (t_fp8.float() / scale).to(dtype)


# ------------------------------------------------------------------------------------------------ matmul
@lru_cache(maxsize=None)
def _capability(index):
    return torch.cuda.get_device_capability(index)


def _fp8_tensor_cores(t):
    """Whether t lives on an NVIDIA GPU that multiplies FP8 in hardware (Ada 8.9, Hopper 9.0, Blackwell 10+)."""
    return (t.is_cuda and torch.version.hip is None and hasattr(torch, "_scaled_mm")
            and _capability(t.device.index) >= (8, 9))


def _scaled_matmul(a, scale_a, b, scale_b, out_dtype=torch.float32):
    """(a · bᵀ) / (scale_a · scale_b) from FP8 a [M, K] and b [N, K], accumulated in fp32, returned in out_dtype
    (the kernel rescales and rounds in its epilogue; the simulation rounds the fp32 result the same way)."""
    inv_a, inv_b = scale_a.reciprocal(), scale_b.reciprocal()
    if _fp8_tensor_cores(a) and a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0:
        return torch._scaled_mm(a.contiguous(), b.contiguous().t(), inv_a, inv_b, out_dtype=out_dtype)
    return ((a.float() @ b.float().t()) * (inv_a * inv_b)).to(out_dtype)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype):
        with torch.autocast(x.device.type, enabled=False):
            x_q, s_x = quantize(x.reshape(-1, x.shape[-1]), E4M3)
            w_q, s_w = quantize(weight, E4M3)
            if bias is None:
                y = _scaled_matmul(x_q, s_x, w_q, s_w, out_dtype)  # one rounding, fp32 -> out_dtype
            else:
                y = (_scaled_matmul(x_q, s_x, w_q, s_w) + bias.float()).to(out_dtype)
        ctx.save_for_backward(x_q, s_x, w_q, s_w)  # what backward needs: 1 byte per element
        ctx.x_shape, ctx.dtypes = x.shape, (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x_q, s_x, w_q, s_w = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        grad_x = grad_w = grad_b = None
        with torch.autocast(grad_y.device.type, enabled=False):
            g = grad_y.reshape(-1, grad_y.shape[-1])
            g_q, s_g = quantize(g, E5M2)
            if need_x:
                grad_x = _scaled_matmul(g_q, s_g, w_q.t(), s_w, x_dtype).reshape(ctx.x_shape)
            if need_w:
                grad_w = _scaled_matmul(g_q.t(), s_g, x_q.t(), s_x, w_dtype)
            if need_b:
                grad_b = g.float().sum(0).to(b_dtype)
        return grad_x, grad_w, grad_b, None


def fp8_linear(x, weight, bias=None):
    """F.linear(x, weight, bias) with E4M3 operands forward and E5M2 gradients backward (module docstring).

    The result's dtype is F.linear's: autocast's dtype (bf16) under autocast, x's dtype otherwise. Under the fp8
    recipe (bf16 autocast) the linears thus return bf16, and everything after them (attention, SwiGLU, the
    residual's next norm) runs and is saved for backward as in the bf16 recipe; only the matmuls differ."""
    return _FP8Linear.apply(x, weight, bias, linear_out_dtype(x))


def linear_out_dtype(x):
    """The dtype F.linear would return for input x: autocast's under autocast, x's otherwise (both recipes)."""
    kind = x.device.type
    autocast = torch.is_autocast_enabled(kind) and x.is_floating_point()
    return torch.get_autocast_dtype(kind) if autocast else x.dtype


# ------------------------------------------------------------------------------------------------- apply
def _linear_forward(module, linear, x):
    return linear(x, module.weight, module.bias)


def apply(module, recipe="tensor"):
    """Route every linear layer of every DecoderLayer in `module` through fp8_linear, in place; return module.
    The MoE router stays in high precision, and so does everything outside the decoder layers. recipe="blockwise":
    through picotron.fp8_blockwise.fp8_linear_blockwise instead (DeepSeek-V3's 1×128 / 128×128 scales)."""
    linear = fp8_linear
    if recipe == "blockwise":
        from picotron.fp8_blockwise import fp8_linear_blockwise as linear
    for layer in [m for m in module.modules() if isinstance(m, DecoderLayer)]:
        routers = {id(m.gate) for m in layer.modules() if isinstance(m, MoE)}
        for m in layer.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                m.matmul = linear
            elif type(m) is nn.Linear and id(m) not in routers:
                m.forward = partial(_linear_forward, m, linear)
    return module
