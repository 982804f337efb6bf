"""picotron.fp8_blockwise (DeepSeek-V3's fine-grained FP8) against references written from its definition.

The scales: one per 1×128 tile (per row, 128 consecutive elements) or 128×128 block, exactly amax / 448 in fp32,
the last tile or block shorter when 128 does not divide the shape, the tile's largest element landing on ±448. The
product: blockwise_matmul equals Σ over K-slices of the dequantized slices' product (float64 here) within fp32's
accumulation bound. The layer: forward, dgrad and wgrad are the straight-through gradients at the operands
quantized as the module's docstring says (g per 1×128 for dgrad; gᵀ and the dequantized-then-requantized x per
128×1 for wgrad), in float64 here. Where tiles pay: a token 10^5 times the others leaves the other elements at
E4M3's error with tiles and flushes them with one scale per tensor. The limited accumulator: promotion every 128
products keeps its error small at K = 4096 where a never-promoted 14-bit sum drifts. The configuration: the recipe
needs --dtype fp8; apply routes the decoder's linears; the tiny model trains along fp32's curve; at tp = 2 each
rank's shard is tiled on its own (heavy); recomputation reproduces the loss bit for bit (heavy).
"""
import pytest
import torch

from picotron import fp8, fp8_blockwise as fb, marks, tensor_parallel
from picotron.config import Config
from picotron.fp8 import E4M3
from picotron.launch import run_on_ranks
from picotron.mesh import Axis, Mesh
from picotron.model import Llama, ModelConfig
from picotron.rules import ConfigError, validate
from picotron.tensor_parallel import ColumnParallelLinear, RowParallelLinear

EPS32 = 2.0 ** -24
U = 2.0 ** -4  # E4M3's unit roundoff


def rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# ------------------------------------------------------------------------------------------ quantization
def test_tile_scales_are_amax_over_448_with_a_ragged_tail():
    t = rand(5, 300, seed=1) * torch.logspace(-3, 3, 300)  # each tile its own range; 300 = 128 + 128 + 44
    q, d = fb.quantize_tiles(t)
    assert q.dtype == E4M3 and q.shape == t.shape and d.shape == (5, 3) and d.dtype == torch.float32
    for j, (a, b) in enumerate(((0, 128), (128, 256), (256, 300))):
        amax = t[:, a:b].abs().amax(1)
        assert torch.equal(d[:, j], amax / 448.0), j
        # the tile's largest element lands on ±448, every element is t / d rounded to E4M3
        assert torch.equal(q[:, a:b].float().abs().amax(1), torch.full((5,), 448.0))
        assert torch.equal(q[:, a:b].view(torch.uint8), (t[:, a:b] / d[:, j, None]).to(E4M3).view(torch.uint8))
    assert (fb.dequantize_tiles(q, d) - t).abs().le(U * t.abs() + 2.0 ** -10 * fb.spread(d, t.shape, 1, 128)).all()


def test_block_scales_cover_128_by_128_with_ragged_edges_and_zero_blocks():
    w = rand(200, 300, seed=2)
    w[128:, 256:] = 0  # an all-zero block: a finite scale, zeros back
    q, d = fb.quantize_blocks(w)
    assert d.shape == (2, 3)
    for i, (r0, r1) in enumerate(((0, 128), (128, 200))):
        for j, (c0, c1) in enumerate(((0, 128), (128, 256), (256, 300))):
            amax = w[r0:r1, c0:c1].abs().max().clamp(min=1e-12)
            assert torch.equal(d[i, j], amax / 448.0), (i, j)
            assert torch.equal(q[r0:r1, c0:c1].view(torch.uint8),
                               (w[r0:r1, c0:c1] / d[i, j]).to(E4M3).view(torch.uint8)), (i, j)
    assert torch.isfinite(d).all() and not fb.dequantize_blocks(q, d)[128:, 256:].any()


def test_tiles_keep_the_other_tokens_where_one_scale_per_tensor_flushes_them():
    """A 'massive activation' (one token 10^5 × the others): per tensor, E4M3's window (2^-9 .. 448, 17.8 binades)
    cannot hold both, the ordinary elements fall into the subnormals or to 0; per 1×128 tile each token has its
    own scale, and they keep E4M3's rounding error."""
    x = rand(64, 256, seed=3)
    x[5] *= 1e5
    others = torch.ones_like(x, dtype=torch.bool)
    others[5] = False
    err = lambda xh: float((xh - x)[others].norm() / x[others].norm())
    per_tensor = err(fp8.dequantize(*fp8.quantize(x, E4M3)))
    tiles = err(fb.dequantize_tiles(*fb.quantize_tiles(x)))
    assert tiles < U / 2 and per_tensor > 10 * tiles, (per_tensor, tiles)


# ------------------------------------------------------------------------------------------------ matmul
def reference_product(a_deq, b_deq):
    """float64 a · bᵀ of dequantized operands, and fp32's accumulation bound on computing it slice by slice."""
    a64, b64 = a_deq.double(), b_deq.double()
    return a64 @ b64.t(), (a64.shape[1] + 4) * EPS32 * (a64.abs() @ b64.abs().t())


@pytest.mark.parametrize("m, k, n", [(7, 300, 130), (16, 64, 192), (3, 256, 256)], ids=str)
def test_blockwise_matmul_is_the_dequantized_product_slice_by_slice(m, k, n):
    a, w = rand(m, k, seed=4), rand(n, k, seed=5, scale=0.05)
    a_q, d_a = fb.quantize_tiles(a)
    w_q, d_w = fb.quantize_blocks(w)
    y = fb._matmul(a_q, d_a, w_q, d_w, True, torch.float32)
    ref, bound = reference_product(fb.dequantize_tiles(a_q, d_a), fb.dequantize_blocks(w_q, d_w))
    assert ((y.double() - ref).abs() <= bound).all()
    # and a per-row (1×128) right operand
    b_q, d_b = fb.quantize_tiles(w)
    ref, bound = reference_product(fb.dequantize_tiles(a_q, d_a), fb.dequantize_tiles(b_q, d_b))
    assert ((fb.blockwise_matmul(a_q, d_a, b_q, d_b).double() - ref).abs() <= bound).all()


def test_linear_is_the_straight_through_product_of_its_quantized_operands():
    """Forward, dgrad and wgrad in float64 from the operands quantized as the docstring says, ragged shapes
    (K = 192 = 128 + 64, N = 200, M = 2·70 tokens); and within FP8's error of the exact fp32 linear."""
    x, w, gy = rand(2, 70, 192, seed=6), rand(200, 192, seed=7, scale=0.05), rand(2, 70, 200, seed=8)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fb.fp8_linear_blockwise(xr, wr)
    y.backward(gy)
    x2, g2 = x.reshape(-1, 192), gy.reshape(-1, 200)
    xq, dx = fb.quantize_tiles(x2)
    w_deq = fb.dequantize_blocks(*fb.quantize_blocks(w))
    cases = {"y": (y.reshape(-1, 200), fb.dequantize_tiles(xq, dx), w_deq),
             "grad_x": (xr.grad.reshape(-1, 192), fb.dequantize_tiles(*fb.quantize_tiles(g2)), w_deq.t()),
             "grad_w": (wr.grad, fb.dequantize_tiles(*fb.quantize_tiles(g2.t())),
                        fb.dequantize_tiles(*fb.quantize_tiles(fb.dequantize_tiles(xq, dx).t())))}
    exact = {"y": x2 @ w.t(), "grad_x": g2 @ w, "grad_w": g2.t() @ x2}
    for name, (ours, a, b) in cases.items():
        ref, bound = reference_product(a, b)
        assert ours.dtype == torch.float32 and ((ours.double() - ref).abs() <= bound).all(), name
        assert float((ours.detach() - exact[name]).norm() / exact[name].norm()) < 2 * U, name
    assert y.shape == (2, 70, 200) and xr.grad.shape == x.shape


def test_under_autocast_the_result_is_bf16_and_the_cpu_never_calls_scaled_mm(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("scaled_mm called on the CPU")

    monkeypatch.setattr(torch.nn.functional, "scaled_mm", refuse, raising=False)
    x, w = rand(4, 256, seed=9).requires_grad_(), rand(256, 256, seed=10).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fb.fp8_linear_blockwise(x, w)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == w.grad.dtype == torch.float32


def test_promotion_every_128_products_bounds_the_limited_accumulator():
    """A 14-bit accumulator (chopped) summing K = 4096 positive products drifts by about K·2^-14 relative without
    promotion; promoted every 128 products, by about 128·2^-14; with 53 bits it is float64's sum."""
    a, b = rand(2, 4096, seed=11).abs(), rand(3, 4096, seed=12).abs()
    exact = a.double() @ b.double().t()
    err = lambda y: float(((y - exact).abs() / exact).max())
    never, promoted = err(fb.limited_matmul(a, b, 14, None)), err(fb.limited_matmul(a, b, 14, 128))
    assert never > 0.02 and promoted < 0.01 and promoted < never / 4, (never, promoted)
    assert err(fb.limited_matmul(a, b, 53, None)) < 1e-12


def test_scaled_mm_operands_have_the_layouts_torch_checks():
    """The layouts torch's CUDA code requires of DeepSeek-style scales (aten/src/ATen/native/cuda/ScaledBlas.cpp,
    _scaled_block1x128_block128x128 and _scaled_block1x128_block1x128), checked here on the CPU: mat_a row-major,
    mat_b column-major; scale_a [M, ⌈K/128⌉] strides (1, M); 128×128 scale_b [round_up(⌈K/128⌉, 4), ⌈N/128⌉]
    strides (1, round_up(⌈K/128⌉, 4)); 1×128 scale_b [N, ⌈K/128⌉] strides (1, N). And the values are the scales."""
    m, k, n = 256, 384, 256  # K/128 = 3, padded to 4
    a_q, d_a = fb.quantize_tiles(rand(m, k, seed=18))
    w_q, d_w = fb.quantize_blocks(rand(n, k, seed=19))
    b_q, d_b = fb.quantize_tiles(rand(n, k, seed=19))
    mat_a, mat_b, s_a, s_b = fb.scaled_mm_operands(a_q, d_a, w_q, d_w, True)
    assert mat_a.shape == (m, k) and mat_a.stride() == (k, 1) and mat_b.shape == (k, n) and mat_b.stride() == (1, k)
    assert s_a.shape == (m, 3) and s_a.stride() == (1, m) and torch.equal(s_a, d_a)
    assert s_b.shape == (4, 2) and s_b.stride() == (1, 4) and torch.equal(s_b[:3], d_w.t()) and (s_b[3] == 1).all()
    _, mat_b, _, s_b = fb.scaled_mm_operands(a_q, d_a, b_q, d_b, False)
    assert mat_b.stride() == (1, k) and s_b.shape == (n, 3) and s_b.stride() == (1, n) and torch.equal(s_b, d_b)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
                         and hasattr(torch.nn.functional, "scaled_mm")),
                    reason="needs a Hopper GPU (sm90) and torch.nn.functional.scaled_mm")
def test_gpu_blockwise_scaled_mm_matches_the_simulation():
    """On Hopper: torch.nn.functional.scaled_mm with 1×128 / 128×128 scales (forward, dgrad) and 1×128 / 1×128 (wgrad)
    equals the simulation run on the CPU, in bf16 and fp32, to a bf16 rounding plus the tensor cores' accumulator
    within each 128-slice (2^-7 relative, 2^-9 of the largest). K = 384: the 128×128 scales' K-blocks padded 3 -> 4."""
    for m, k, n in ((256, 512, 384), (128, 384, 256)):
        a, w = rand(m, k, seed=13), rand(n, k, seed=14, scale=0.05)
        a_q, d_a = fb.quantize_tiles(a)
        w_q, d_w = fb.quantize_blocks(w)
        b_q, d_b = fb.quantize_tiles(w)
        cases = {"1x128 · 128x128": (a_q, d_a, w_q, d_w, True), "1x128 · 1x128": (a_q, d_a, b_q, d_b, False)}
        for name, (aq, da, bq, db, blocks) in cases.items():
            cpu = fb._matmul(aq, da, bq, db, blocks, torch.float32)
            for dtype in (torch.bfloat16, torch.float32):
                qs = [t.cuda() for t in (aq, da, bq, db)]
                assert fb._gpu_ready(qs[0], qs[2], dtype)
                gpu = fb._matmul(*qs, blocks, dtype)
                assert gpu.dtype == dtype
                torch.testing.assert_close(gpu.cpu().float(), cpu, rtol=2.0 ** -7,
                                           atol=2.0 ** -9 * cpu.abs().max().item(), msg=f"{name} {dtype} {m, k, n}")
    # the layer on the GPU (all three GEMMs by scaled_mm) against the layer on the CPU
    x, w, gy = rand(256, 512, seed=15), rand(384, 512, seed=16, scale=0.05), rand(256, 384, seed=17)
    outs = []
    for dev in ("cpu", "cuda"):
        xr, wr = x.to(dev).requires_grad_(), w.to(dev).requires_grad_()
        with torch.autocast(dev, dtype=torch.bfloat16):
            y = fb.fp8_linear_blockwise(xr, wr)
        y.backward(gy.to(dev).to(y.dtype))
        outs.append([t.detach().cpu().float() for t in (y, xr.grad, wr.grad)])
    for name, g, c in zip(("y", "grad_x", "grad_w"), outs[1], outs[0]):
        torch.testing.assert_close(g, c, rtol=2.0 ** -7, atol=2.0 ** -9 * c.abs().max().item(), msg=name)


# ------------------------------------------------------------------------------------------ the settings
def test_the_recipe_needs_fp8_and_is_valid_with_it():
    with pytest.raises(ConfigError) as e:
        validate(Config(fp8_recipe="blockwise"), 1)
    assert str(e.value).startswith("--fp8-recipe blockwise with dtype='fp32' does nothing") and "--dtype fp8" in str(e.value)
    validate(Config(dtype="fp8", fp8_recipe="blockwise"), 1)
    validate(Config(dtype="fp8"), 1)
    with pytest.raises(ConfigError, match="is not one of the known values"):
        validate(Config(dtype="fp8", fp8_recipe="mx"), 1)


def test_apply_blockwise_routes_the_decoder_linears_and_the_tp_shards():
    config = ModelConfig.from_preset("tiny")
    model = fp8.apply(Llama(config).init_weights(0), "blockwise")
    x = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    seen = {}

    def record(mod, args, out, name):
        seen.setdefault(name, (mod, args[0], out))

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, args, out, name=name: record(mod, args, out, name))
    model(x)
    for name, (m, inp, out) in seen.items():
        expected = fb.fp8_linear_blockwise(inp, m.weight) if name.startswith("layers.") else inp @ m.weight.t()
        assert torch.equal(out, expected), name
    with torch.device("meta"):
        model = Llama(config)
    tensor_parallel.apply(model, Axis.alone("tp", 2, 0))
    fp8.apply(marks.materialize(model, "cpu").init_weights(0), "blockwise")
    for name, m in model.named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            assert (m.matmul is fb.fp8_linear_blockwise) == (name != "lm_head"), name


def test_tiny_model_trains_in_blockwise_fp8_along_the_fp32_curve():
    """The same 20 AdamW steps as tests/test_fp8.py's per-tensor test, each step's loss within u_E4M3/2 of fp32's."""
    from test_fp8 import train_losses

    ref, ours = train_losses(False), train_losses(True, recipe="blockwise")
    assert torch.isfinite(ours).all() and ours[-1] < ours[0] - 2
    rel = (ours - ref).abs() / ref
    assert (rel <= U / 2).all() and rel.max() > 0, f"largest relative deviation {rel.max():.4f} at step {rel.argmax()}"


# -------------------------------------------------------------------------------- processes (heavy)
def tp_child():
    """At tp = 2 the MLP of layer 0 in blockwise FP8 against the per-shard computation done by hand."""
    import torch.nn.functional as F

    config = ModelConfig.from_preset("tiny")
    full = Llama(config).init_weights(0).layers[0].mlp
    torch.manual_seed(0)
    x, gy = torch.randn(2, 8, config.hidden_size), torch.randn(2, 8, config.hidden_size)
    xf = x.clone().requires_grad_()
    weights = [m.weight.detach().clone().requires_grad_() for m in (full.gate_proj, full.up_proj, full.down_proj)]
    wg, wu, wd = weights
    lin = fb.fp8_linear_blockwise
    y = sum(lin(F.silu(lin(xf, wg.chunk(2, 0)[q])) * lin(xf, wu.chunk(2, 0)[q]), wd.chunk(2, 1)[q]) for q in range(2))
    (y * gy).sum().backward()
    with Mesh.init(tp=2) as mesh:
        r = mesh.tp.rank
        with torch.device("meta"):
            model = Llama(config)
        tensor_parallel.apply(model, mesh.tp)
        mlp = fp8.apply(marks.materialize(model, "cpu").init_weights(0), "blockwise").layers[0].mlp
        xl = x.clone().requires_grad_()
        out = mlp(xl)
        (out * gy).sum().backward()
        same = [torch.equal(out.detach(), y.detach())]
        torch.testing.assert_close(xl.grad, xf.grad, rtol=1e-5, atol=1e-6 * xf.grad.abs().max().item())
        for m, w, dim in zip((mlp.gate_proj, mlp.up_proj, mlp.down_proj), weights, (0, 0, 1)):
            same.append(torch.equal(m.weight.grad, w.grad.chunk(2, dim)[r]))
    return same


@pytest.mark.heavy
def test_tensor_parallel_tiles_each_shard_on_its_own():
    assert run_on_ranks(tp_child, 2, timeout_s=180) == [[True] * 4] * 2


@pytest.mark.heavy
def test_recompute_full_reproduces_the_blockwise_loss_bit_for_bit():
    """--recompute full redoes each layer's forward in backward: the tiles' scales come from the tensors alone,
    so the recomputed FP8 operands, hence the gradients and the losses, are the same bit for bit."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lessons" / "11_precision_and_kernels"))
    import experiment

    a = experiment.train_curve(4, dtype="fp8", fp8_recipe="blockwise")["loss"]
    b = experiment.train_curve(4, dtype="fp8", fp8_recipe="blockwise", recompute="full")["loss"]
    assert a == b and all(map(lambda v: v == v, a))
