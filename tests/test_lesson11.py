"""Lesson 11: the notebook is its source and runs in FAST mode with every check holding; the exercise checker passes
the solutions, fails the stubs naming NotImplementedError, and names typical mistakes (an accumulator or a running sum
not rescaled when the max grows, exp of unshifted scores, a missing division, lse without its max; a count of clean
steps not reset, growth one step late, an overflow not skipped; a scale upside down, E5M2's maximum, an all-zero
tensor's infinite scale, the wrong dtype; for 1×128 tiles a scale upside down, the ragged tail dropped, the row's amax
instead of the tile's, a zero tile's scale of 0, E5M2's maximum); the experiment's formulas and counters by hand (the formats' numbers, fp16's
bands, attention's FLOPs and bytes, the plain RMSNorm's bytes, the fused kernels' bytes, the widget's shares, the
profiler's groups) and its training loop's loss-scale bookkeeping.

No timing is asserted here: the notebook prints its timings but checks none of them.
"""
import math
import sys
from pathlib import Path

import pytest
import torch
from _lessons import solution_tools

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lessons"))

run_checker, mutate, fails_with = solution_tools("11_precision_and_kernels")


@pytest.fixture(scope="module")
def lesson():
    import _common

    return _common.load_lesson("11_precision_and_kernels")


def test_checker_passes_the_solutions():
    code, out = run_checker("--solutions", as_learner=True)
    assert code == 0, out
    assert "all checks passed" in out and "FAIL" not in out
    assert out.count("  ok  ") == 4, out


def test_checker_fails_the_stubs_naming_not_implemented():
    code, out = run_checker()
    assert code == 1, out
    for name in ("online_softmax_attention", "update", "quantize_e4m3", "quantize_tiles"):
        assert f"FAIL  {name}: NotImplementedError: not written yet" in out, out


def test_checker_names_online_softmax_mistakes(tmp_path):
    ex = "online_softmax_attention"
    head = "FAIL  online_softmax_attention: random scores (q [6, 8], k and v [37, 8]), block 1: row 0: "
    out = fails_with(tmp_path, ex, ("acc = rescale[:, None] * acc + p @ v", "acc = acc + p @ v"))
    assert head in out and "the running output acc is not rescaled by exp(μ − μ')" in out, out
    out = fails_with(tmp_path, ex, ("l = rescale * l + p.sum(dim=1)", "l = l + p.sum(dim=1)"))
    assert head in out and "the running sum l is not rescaled by exp(μ − μ')" in out, out
    out = fails_with(tmp_path, ex, ("return acc / l[:, None], m + torch.log(l)", "return acc, m + torch.log(l)"))
    assert "the output is acc without the final division by the running sum l" in out, out
    out = fails_with(tmp_path, ex, ("return acc / l[:, None], m + torch.log(l)", "return acc / l[:, None], torch.log(l)"))
    assert head + "lse = " in out and "lse = μ + log(l), the running max μ added back" in out, out
    # no running max at all: right on small scores, NaN once exp(s) overflows
    out = fails_with(tmp_path, ex, ("m_new = torch.maximum(m, s.amax(dim=1))", "m_new = torch.zeros_like(m)"))
    assert "FAIL  online_softmax_attention: scores around ±1000" in out and "random scores" not in out, out
    assert "exp(s) overflows float64 above ~709: subtract the running max μ before exp" in out, out


def test_checker_names_update_mistakes(tmp_path):
    out = fails_with(tmp_path, "update", ("return scale * backoff_factor, 0, True",
                                          "return scale * backoff_factor, clean_steps, True"))
    assert "FAIL  update: sequence A (growth_interval 3), step 5 (overflow=True, from S = 2^17 after 1 clean step): " \
           "returned (scale 2^16, clean_steps 1, skip True), expected (scale 2^16, clean_steps 0, skip True): an " \
           "overflow resets the count of clean steps to 0" in out, out
    out = fails_with(tmp_path, "update", ("if clean_steps == growth_interval:", "if clean_steps > growth_interval:"))
    assert "step 3 (overflow=False, from S = 2^16 after 2 clean steps)" in out and "not when it exceeds it" in out, out
    out = fails_with(tmp_path, "update", ("return scale * backoff_factor, 0, True", "return scale * backoff_factor, 0, False"))
    assert "an overflowing step must be skipped" in out, out
    out = fails_with(tmp_path, "update", ("return scale * growth_factor, 0, False",
                                          "return scale * growth_factor, clean_steps, False"))
    assert "after growing S the count of clean steps starts again from 0" in out, out


def test_checker_names_quantize_mistakes(tmp_path):
    ex = "quantize_e4m3"
    out = fails_with(tmp_path, ex, ("scale = fmax / amax", "scale = amax / fmax"))
    assert "FAIL  quantize_e4m3: randn × 0.01 [64, 32]: scale = " in out and "the scale is upside down" in out, out
    out = fails_with(tmp_path, ex, ("fmax = torch.finfo(torch.float8_e4m3fn).max", "fmax = torch.finfo(torch.float8_e5m2).max"))
    assert "57344 is E5M2's largest number; E4M3's" in out, out
    out = fails_with(tmp_path, ex, (".clamp(min=1e-12)", ""))
    assert "FAIL  quantize_e4m3: all zeros [16]: scale = inf: floor amax at 1e-12" in out, out
    out = fails_with(tmp_path, ex, (".to(torch.float8_e4m3fn), scale", ".to(torch.float8_e5m2), scale"))
    assert "t_fp8 has dtype torch.float8_e5m2; cast to torch.float8_e4m3fn" in out, out


def test_checker_names_tile_mistakes(tmp_path):
    ex, head = "quantize_tiles", "FAIL  quantize_tiles: randn [8, 300] (tiles of 128, 128 and 44): "
    out = fails_with(tmp_path, ex, ("d = part.abs().amax(dim=1).clamp(min=1e-12) / fmax",
                                    "d = fmax / part.abs().amax(dim=1).clamp(min=1e-12)"))
    assert head + "row 0, tile 0 (columns 0..127)" in out and "the scale is upside down" in out, out
    out = fails_with(tmp_path, ex, ("n = -(-cols // tile)", "n = cols // tile"))
    assert head + "scales have shape (8, 2), expected (8, 3)" in out and "a shorter tile of their own" in out, out
    out = fails_with(tmp_path, ex, ("d = part.abs().amax(dim=1).clamp(min=1e-12) / fmax",
                                    "d = x.abs().amax(dim=1).clamp(min=1e-12) / fmax"))
    assert "the amax of the whole row (or tensor)" in out, out
    out = fails_with(tmp_path, ex, (".clamp(min=1e-12) / fmax", " / fmax"))
    assert "FAIL  quantize_tiles: randn [4, 200] with a zero tile: row 1, tile 1 (columns 128..199): scale 0" in out \
        and "floor amax at 1e-12" in out, out
    out = fails_with(tmp_path, ex, ("fmax = torch.finfo(torch.float8_e4m3fn).max", "fmax = torch.finfo(torch.float8_e5m2).max"))
    assert "57344 is E5M2's largest number" in out, out


def test_format_numbers_by_hand(lesson):
    f = lesson.format_formulas("fp16")
    assert (f["max"], f["normal"], f["subnormal"], f["u"]) == (65504.0, 2.0**-14, 2.0**-24, 2.0**-11)
    f = lesson.format_formulas("E4M3")  # no infinities: the top exponent holds 256..448
    assert (f["max"], f["normal"], f["subnormal"], f["u"], f["bias"]) == (448.0, 2.0**-6, 2.0**-9, 2.0**-4, 7)
    f = lesson.format_formulas("E5M2")
    assert (f["max"], f["normal"], f["subnormal"]) == (57344.0, 2.0**-14, 2.0**-16)
    assert lesson.format_formulas("bf16")["normal"] == lesson.format_formulas("fp32")["normal"] == 2.0**-126
    m = lesson.measure_format("fp16")
    assert m["smallest_positive"] == 2.0**-24 and m["above_max"] == "inf" and m["below_half_subnormal_zero"]
    assert 0.95 * 2.0**-11 / (1 + 2.0**-11) <= m["max_rel_normal"] <= 2.0**-11


def test_fp16_bands_and_the_widget_by_hand(lesson):
    t = torch.tensor([2.0**-30, -(2.0**-20), 1.0, 1e5, 0.0])  # flushed, subnormal, normal, overflow; the 0 is ignored
    assert lesson.fp16_bands(t) == dict(zero=0.25, subnormal=0.25, normal=0.25, overflow=0.25)
    s = lesson.view_stats(t, "fp16", 0)
    assert (s["zero"], s["subnormal"], s["overflow"], s["n"]) == (0.25, 0.25, 0.25, 4) and s["rel"] == math.inf
    s = lesson.view_stats(t[:3], "fp16", 12)  # x 2^12: 2^-18 is subnormal, 2^-8 and 2^12 normal
    assert (s["zero"], s["subnormal"], s["overflow"]) == (0.0, 1 / 3, 0.0) and s["rel"] < 2.0**-11


def test_attention_flops_and_bytes(lesson):
    from picotron import kernels

    # non-causal tiles cover the whole s x s: the same FLOPs as the naive form; causal with s = 2 tiles: 3 of 4 tiles
    assert lesson.attention_flops(1, 2, 128, 16, "tiled", 64, 64, causal=False) == lesson.attention_flops(1, 2, 128, 16)
    assert lesson.attention_flops(1, 2, 128, 16, "tiled", 64, 64) == 4 * 2 * 16 * 3 * 64 * 64
    for shape in ((1, 4, 2, 128, 16), (2, 2, 1, 100, 8)):  # the counter watches the loads and stores of the tiles
        assert lesson.counted_flash_bytes(*shape, block=32) == kernels.attention_bytes(*shape, 2, 32, 32, impl="tiled")


def test_tiled_intensity_limits_depend_on_who_loads_k_and_v(lesson):
    """Section 6: K/V loaded once per KV head (flash_attention) tends to 2aB_q/(a_kv·elem); once per query head
    (the Triton kernel, FlashAttention-2: kv_heads = a in the count) to 2B_q/elem, below an H100's ~295 at B_q = 128."""
    from picotron import kernels

    a, kv, s, d, bq, elem = 32, 8, 2**15, 128, 128, 2
    flops = lesson.attention_flops(1, a, s, d, "tiled", bq, bq)
    per_kv_head = flops / kernels.attention_bytes(1, a, kv, s, d, elem, bq, bq, impl="tiled")
    per_q_head = flops / kernels.attention_bytes(1, a, a, s, d, elem, bq, bq, impl="tiled")
    assert abs(per_kv_head / (2 * a * bq / (kv * elem)) - 1) < 0.05 and per_kv_head < 2 * a * bq / (kv * elem)
    assert abs(per_q_head / (2 * bq / elem) - 1) < 0.02 and per_q_head < 2 * bq / elem < 295


def test_fused_and_plain_bytes(lesson):
    fwd, bwd = lesson.count_plain("rms_norm", 8, 16)
    assert fwd.total == lesson.rms_norm_plain_bytes(8, 16) == 4 * (7 * 128 + 6 * 8 + 16)
    assert [name for name, _, _ in fwd.ops] == ["pow.Tensor_Scalar", "mean.dim", "add.Tensor", "rsqrt.default",
                                                "mul.Tensor", "mul.Tensor"]
    fwd, _ = lesson.count_plain("swiglu", 8, 16)
    assert fwd.total == 4 * 5 * 128  # silu: N in, N out; the product: 2N in, N out
    assert lesson.fused_bytes("swiglu", 8, 16) == 4 * 3 * 128 and lesson.fused_bytes("swiglu", 8, 16, backward=True) == 4 * 5 * 128
    assert lesson.fused_bytes("rms_norm", 8, 16) == 4 * (2 * 128 + 16) + 4 * 8


def test_profile_groups(lesson):
    cases = {"aten::mm": "matmul", "MmBackward0": "matmul", "aten::_log_softmax": "loss",
             "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention", "aten::silu_backward": "elementwise and norms",
             "Optimizer.step#AdamW.step": "optimizer", "aten::_to_copy": "copies and casts", "aten::mul_": "elementwise and norms",
             "aten::lerp_": "optimizer", "aten::randint": "other"}
    assert {op: lesson.group_of(op) for op in cases} == cases


def test_the_training_loop_skips_exactly_the_overflowing_steps(lesson):
    """fp16 from S = 2^30: the first steps overflow; each is skipped (the weights stay) and halves S."""
    r = lesson.train_curve(4, dtype="fp16", start_scale=2.0**30, growth_interval=2)
    assert r["skipped"] == r["nonfinite"] and r["skipped"][0]
    assert r["moved"] == [not s for s in r["skipped"]]
    for i in range(3):
        assert r["scale"][i + 1] == r["scale"][i] / 2 if r["skipped"][i] else r["scale"][i + 1] >= r["scale"][i]


def test_notebook_runs_in_fast_mode(run_notebook):
    text = run_notebook("11_precision_and_kernels", timeout=600)
    assert "✗" not in text, text
    assert text.count("✓") >= 40, text
    assert "NotImplementedError: not written yet" in text  # the exercise cell ran the checker on the stubs
    assert "fp16 without loss scaling fails" in text and "tiled attention = SDPA (float64)" in text
    assert "picotron | Mesh" not in text and "USDT" not in text  # no progress lines, no profiler chatter
