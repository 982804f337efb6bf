"""picotron.kernels: tiled attention against torch's SDPA, fused RMSNorm and SwiGLU against the plain ops, the
model's hooks, and the bytes model of attention."""
import functools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from picotron import kernels
from picotron.kernels import attention_bytes, flash_attention
from picotron.model import RMSNorm, Llama, ModelConfig, loss_fn, use_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def qkv(b, a, kv, s, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, a, s, d, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(b, kv, s, d, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(b, kv, s, d, generator=g, dtype=dtype).requires_grad_()
    return q, k, v


def out_and_grads(fn, q, k, v, seed=1):
    """fn(q, k, v) and d(Σ out·dO)/d(q, k, v) for a fixed random dO."""
    out = fn(q, k, v)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


# ------------------------------------------------------------------------------------------- flash attention
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("kv", [1, 2, 4], ids=["kv1", "kv2", "kv4"])
@pytest.mark.parametrize("s", [37, 5, 48])  # not a multiple of either block; shorter than one; several whole
def test_flash_matches_sdpa_float64(s, kv, causal):
    q, k, v = qkv(2, 4, kv, s, 8, torch.float64)
    ours = out_and_grads(lambda *t: flash_attention(*t, causal=causal, block_q=16, block_k=8), q, k, v)
    ref = out_and_grads(lambda *t: F.scaled_dot_product_attention(*t, is_causal=causal, enable_gqa=kv != 4),
                        q, k, v)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=name)


@pytest.mark.parametrize("blocks", [(16, 16), (8, 32), (64, 64)])
def test_flash_matches_sdpa_float32(blocks):
    q, k, v = qkv(2, 6, 3, 50, 16, torch.float32)
    ours = out_and_grads(lambda *t: flash_attention(*t, block_q=blocks[0], block_k=blocks[1]), q, k, v)
    ref = out_and_grads(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True), q, k, v)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)


def test_flash_keeps_only_inputs_output_and_lse():
    """What forward saves for backward: q, k, v, out and one log-sum-exp per row, nothing of size s×s."""
    b, a, kv, s, d = 1, 4, 2, 40, 8
    q, k, v = qkv(b, a, kv, s, d, torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        flash_attention(q, k, v, block_q=8, block_k=8)
    assert sorted(saved) == sorted([b * a * s * d, b * kv * s * d, b * kv * s * d, b * a * s * d, b * a * s])


def test_flash_impl_choice_and_its_sentences():
    """auto is the plain tiles on a CPU; an unknown impl, or triton where it cannot run, is one sentence."""
    q, k, v = qkv(1, 4, 2, 8, 8, torch.float32)
    assert torch.equal(flash_attention(q, k, v), flash_attention(q, k, v, impl="plain"))
    with pytest.raises(ValueError, match="use 'auto', 'plain' or 'triton'"):
        flash_attention(q, k, v, impl="fast")
    if not kernels.triton_runs_on("cpu"):
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            flash_attention(q, k, v, impl="triton")


def test_flash_rejects_bad_shapes():
    q, k, v = qkv(1, 4, 3, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="kv dividing a"):
        flash_attention(q, k, v)


def test_key_tiles_skip_the_future():
    assert list(kernels.key_tiles(0, 4, 10, 4, causal=True)) == [0]
    assert list(kernels.key_tiles(4, 8, 10, 4, causal=True)) == [0, 4]
    assert list(kernels.key_tiles(8, 10, 10, 4, causal=True)) == [0, 4, 8]
    assert list(kernels.key_tiles(0, 4, 10, 4, causal=False)) == [0, 4, 8]


def test_attention_bytes_by_hand():
    """b 1, a 2, kv 1, s 10, d 4, bf16 (2 bytes), tiles of 4 queries and 4 keys."""
    args = dict(b=1, a=2, kv_heads=1, s=10, d=4, elem=2, block_q=4, block_k=4)
    q_and_out = 2 * (1 * 2 * 10 * 4) * 2  # q read, out written: 2·80 elements·2 bytes = 320
    # naive: + k and v read once (2·40·2 = 160), S written and read, P written and read (4·2·100·2 = 1600)
    assert attention_bytes(**args, impl="naive") == q_and_out + 160 + 1600 == 2080
    # tiled, no mask: 3 query tiles each read all 10 keys and values (3·2·10·4·2 = 480), lse 4·2·10 = 80
    assert attention_bytes(**args, impl="tiled", causal=False) == q_and_out + 480 + 80 == 880
    # causal: the tiles of queries 0-3, 4-7, 8-9 read keys 0-3, 0-7, 0-9: 22 rows (2·22·4·2 = 352)
    assert attention_bytes(**args, impl="tiled", causal=True) == q_and_out + 352 + 80 == 752
    # one query tile: K and V read once; the tiled count is the naive one without the s² term (plus lse)
    one = dict(args, block_q=10)
    assert attention_bytes(**one, impl="tiled", causal=False) == attention_bytes(**one, impl="naive") - 1600 + 80


# ------------------------------------------------------------------------------------------------ the model
# h 48 and i 100 are no powers of two (the Triton kernels' masks matter); the fused-op cases below use the
# shapes of this model's norms and MLPs at b 2, s 24, so torch.compile compiles each op once for the file.
SMALL = dict(vocab_size=96, hidden_size=48, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rope_theta=500.0)


def logits_and_grads(model, ids):
    """The logits of ids and every parameter's gradient of the next-token loss."""
    model.zero_grad()
    logits = model(ids)
    loss_fn(logits[:, :-1].contiguous(), ids[:, 1:]).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_model_outputs(a, b, atol):
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=atol, msg="logits")
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=0, atol=atol, msg=name)


def test_model_with_flash_attention_matches_sdpa():
    ids = torch.randint(0, 96, (2, 80), generator=torch.Generator().manual_seed(0))  # 2 tiles of 64 queries
    outs = {}
    for impl in ("sdpa", "flash"):
        model = Llama(ModelConfig(**SMALL, attn_impl=impl)).init_weights(0)
        outs[impl] = logits_and_grads(model, ids)
    assert_same_model_outputs(outs["flash"], outs["sdpa"], atol=1e-5)


def test_kernels_plain_is_the_model_arithmetic():
    """kernels.rms_norm_plain, the reference the fused RMSNorm is checked against, is model.RMSNorm exactly."""
    norm = RMSNorm(32, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(32))
    x = torch.randn(3, 5, 32, dtype=torch.bfloat16)
    assert torch.equal(norm(x), kernels.rms_norm_plain(x, norm.weight, 1e-5))


def test_use_kernels_sets_every_norm_and_mlp():
    model = use_kernels(Llama(ModelConfig(**SMALL)), "compile")
    kinds = {type(m).__name__: m.kernel for m in model.modules() if hasattr(m, "kernel")}
    assert kinds == {"RMSNorm": "compile", "MLP": "compile"}
    assert use_kernels(model, "plain").norm.kernel == "plain"
    with pytest.raises(ValueError, match="unknown kernel impl"):
        use_kernels(model, "cuda")


def test_model_with_compiled_kernels_matches_plain():
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    model = Llama(ModelConfig(**SMALL)).init_weights(0)
    plain = logits_and_grads(model, ids)
    fused = logits_and_grads(use_kernels(model, "compile"), ids)
    assert_same_model_outputs(fused, plain, atol=1e-5)


# ------------------------------------------------------------------------------------------ fused RMSNorm, SwiGLU
def rms_norm_case(dtype, device="cpu"):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 24, 48, generator=g).to(device, dtype)
    w = (1 + 0.5 * torch.randn(48, generator=g)).to(device, dtype)
    return (x.requires_grad_(), w.requires_grad_()), lambda x, w, impl: kernels.rms_norm(x, w, 1e-5, impl)


def swiglu_case(dtype, device="cpu"):
    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(2, 24, 100, generator=g).to(device, dtype).requires_grad_() for _ in range(2))
    return (gate, up), kernels.swiglu


def check_fused(impl, op, dtype, device="cpu"):
    """The fused op's output and input gradients against the plain op's: to 1e-5 in float32; in bfloat16, no
    further from the float64 result than twice the plain op's own error."""
    inputs, fn = (rms_norm_case if op == "rms_norm" else swiglu_case)(dtype, device)
    ref64 = [t.detach().double().requires_grad_() for t in inputs]

    def run(impl, ins):
        y = fn(*ins, impl)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)
        return (y, *torch.autograd.grad(y, ins, dy))

    fused, plain, exact = run(impl, inputs), run("plain", inputs), run("plain", ref64)
    for name, f, p, e in zip(("out", "grad 0", "grad 1"), fused, plain, exact):
        assert f.dtype == p.dtype and f.shape == p.shape, name
        if dtype == torch.float32:
            torch.testing.assert_close(f, p, rtol=0, atol=1e-5, msg=name)
        else:
            err, plain_err = ((t.double() - e).abs().max().item() for t in (f, p))
            assert err <= 2 * plain_err + 1e-6, f"{op} {name}: fused error {err}, plain error {plain_err}"


@pytest.mark.parametrize("op", ["rms_norm", "swiglu"])
def test_compiled_matches_plain(op):
    check_fused("compile", op, torch.float32)


def test_auto_on_cpu_is_compile_and_bad_impls_say_so():
    (x, w), _ = rms_norm_case(torch.float32)
    assert kernels._choose("auto", x) == "compile"
    with pytest.raises(ValueError, match="unknown kernel impl"):
        kernels.rms_norm(x, w, 1e-5, impl="fast")


def test_triton_matches_plain():
    """On CUDA: the compiled kernels. Without a GPU: Triton's interpreter, which must be switched on before
    triton is imported, so this test reruns itself in a child process with TRITON_INTERPRET=1."""
    pytest.importorskip("triton", reason="triton is not installed (pip install triton; on a CPU the kernels "
                                         "then run under its interpreter)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not kernels.triton_runs_on(device):
        env = dict(os.environ, TRITON_INTERPRET="1")
        child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                f"{__file__}::test_triton_matches_plain"],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert child.returncode == 0 and "1 passed" in child.stdout, child.stdout[-4000:] + child.stderr[-2000:]
        return
    for op in ("rms_norm", "swiglu"):
        for dtype in (torch.float32, torch.bfloat16):
            check_fused("triton", op, dtype, device)


# ------------------------------------------------------------------------------------ Triton flash attention
def rerun_interpreted(test_name):
    """Rerun tests/test_kernels.py::test_name in a child process with TRITON_INTERPRET=1 (the interpreter must
    be switched on before triton is imported); True if this process should return (the child ran it)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install triton; on a CPU the kernels "
                                         "then run under its interpreter)")
    if kernels.triton_runs_on("cuda" if torch.cuda.is_available() else "cpu"):
        return False
    env = dict(os.environ, TRITON_INTERPRET="1")
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            f"{__file__}::{test_name}"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
    assert child.returncode == 0 and "1 passed" in child.stdout, child.stdout[-4000:] + child.stderr[-2000:]
    return True


def triton_flash_vs_sdpa(b, a, kv, s, d, causal, dtype, device, blocks=(16, 16)):
    """Max |error| of the Triton kernels' out, lse, dq, dk, dv and of SDPA's in dtype, both against SDPA (and
    the log-sum-exp written out) in float64 on the same inputs; small tiles so s spans several, ragged."""
    from picotron.flash_triton import flash_attention_triton
    q, k, v = (t.detach().to(device) for t in qkv(b, a, kv, s, d, dtype))
    dout = torch.randn(b, a, s, d, generator=torch.Generator().manual_seed(1)).to(device, dtype)

    def grads(fn, q, k, v):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out, lse = fn(q, k, v)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), dout.to(out.dtype)))

    def sdpa(q, k, v):
        scores = q @ k.repeat_interleave(a // kv, 1).transpose(-2, -1) / d ** 0.5
        if causal:
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=device).triu(1), float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        return out, scores.float().logsumexp(-1)
    ours = grads(lambda *t: flash_attention_triton(*t, causal, *blocks, return_lse=True), q, k, v)
    exact = grads(sdpa, *(t.double() for t in (q, k, v)))
    theirs = grads(sdpa, q, k, v)
    for t, e in zip(ours, exact):
        assert t.shape == e.shape and t.dtype in (dtype, torch.float32)
    return ([(t.double() - e).abs().max().item() for t, e in zip(ours, exact)],
            [(t.double() - e).abs().max().item() for t, e in zip(theirs, exact)])


def test_triton_flash_matches_sdpa(monkeypatch):
    """picotron.flash_triton's kernels against SDPA in float64, forward (out, lse) and backward (dq, dk, dv):
    fp32 to 1e-5 (measured ~1e-6); bf16 no further than 3x SDPA's own bf16 error + 5e-3 (measured on CPU: out
    9e-3, dq 1.3e-2, dk 1.4e-2, dv 3.6e-2 on values of order 1; SDPA's 4.5e-3, 6.5e-3, 1.3e-2, 1.9e-2: P is
    rounded to bf16 before P v, as in FlashAttention). Causal and not, GQA 4 heads over 2, s 48 and 80
    (no multiple of the tiles: 16 × 16, or 32 queries × 16 keys), head dims 16, 32 and 12 (padded to 16); future
    keys changed leave the causal output untouched; and the model's call path. On CUDA compiled; on a CPU
    interpreted, in a child process."""
    if rerun_interpreted("test_triton_flash_matches_sdpa"):
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = ("out", "lse", "dq", "dk", "dv")
    for s, d, causal, blocks in ((48, 16, True, (16, 16)), (80, 32, False, (16, 16)), (80, 12, True, (32, 16))):
        ours, _ = triton_flash_vs_sdpa(1, 4, 2, s, d, causal, torch.float32, device, blocks)
        assert max(ours) < 1e-5, (s, d, causal, blocks, dict(zip(names, ours)))
    ours, theirs = triton_flash_vs_sdpa(1, 4, 2, 48, 16, True, torch.bfloat16, device)
    for name, e, e_sdpa in zip(names, ours, theirs):
        assert e <= 3 * e_sdpa + 5e-3, f"bf16 {name}: ours {e:.2e}, SDPA's {e_sdpa:.2e}"

    # causal: keys and values 30.. replaced by others; outputs 0..29 are bitwise the same, 30.. are not
    from picotron.flash_triton import flash_attention_triton
    q, k, v = (t.detach().to(device) for t in qkv(1, 4, 2, 48, 16, torch.float32))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 30:], v2[:, :, 30:] = (3 * torch.randn(2, 18, 16).to(device) for _ in range(2))
    before, after = (flash_attention_triton(q, kk, vv, True, 16, 16) for kk, vv in ((k, v), (k2, v2)))
    assert torch.equal(before[:, :, :30], after[:, :, :30])
    assert not torch.allclose(before[:, :, 30:], after[:, :, 30:], atol=1e-3)

    with pytest.raises(ValueError, match="block_k dividing block_q"):
        flash_attention_triton(q, k, v, True, 16, 32)
    with pytest.raises(ValueError, match="one dtype"):
        flash_attention_triton(q, k.bfloat16(), v, True, 16, 16)

    # the model's call path: AttentionCore's "flash" with the Triton kernels against "sdpa" (head dim 12)
    monkeypatch.setattr(kernels, "flash_attention", functools.partial(kernels.flash_attention, impl="triton"))
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0)).to(device)
    outs = {impl: logits_and_grads(Llama(ModelConfig(**SMALL, attn_impl=impl)).init_weights(0).to(device), ids)
            for impl in ("sdpa", "flash")}
    assert_same_model_outputs(outs["flash"], outs["sdpa"], atol=1e-5)
