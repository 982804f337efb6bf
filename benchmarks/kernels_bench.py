"""Kernels and precision recipes against what a user would pick instead, side by side in one process.

    python benchmarks/kernels_bench.py [--rounds 15] [--seq-lens 256,1024] [--size small] [--steps-model 3]
    python benchmarks/kernels_bench.py --smoke [--skip-compile]  # the tests' size: that it runs (compiling: a minute)
    python benchmarks/kernels_bench.py --gpu-attention-only     # on a CUDA GPU: the Triton flash attention alone

Each comparison times both sides in the same round, the order alternating, and reports the median of the paired
ratios with their quartiles (a ratio > 1: ours is faster). Before timing, both sides' results are compared
(the benchmark stops if they disagree):

  attention   picotron.kernels.flash_attention (tiles and an online softmax in plain PyTorch) against torch's
              F.scaled_dot_product_attention (a fused kernel) and the written-out softmax ('eager'), forward +
              backward, at each sequence length; also the bytes each moves (kernels.attention_bytes)
  rms_norm    kernels.rms_norm with impl=compile (torch.compile's fused code) against the plain ops
  swiglu      kernels.swiglu, the same
  model step  a training step of the lessons' model: --compile (every decoder layer compiled), --kernels
              compile, and each --dtype recipe, against the plain fp32 step

  gpu attention  (CUDA and triton only; otherwise one line says it is skipped) picotron.flash_triton's Triton
              kernels against SDPA with its flash backend and against the plain-PyTorch tiles, forward + backward,
              causal, bf16, b·s = 16,384 tokens, 16 heads · d 128 or 32 heads · d 64 (hidden 2,048, no GQA: SDPA's
              flash backend wants K and V per head), s = 2,048 and 8,192: ms, tokens/s, TFLOP/s and the ratio to
              SDPA (issue 34's target: >= 0.7). The plain tiles get at most 3 rounds (seconds each at s = 8,192).

On a CPU the plain-PyTorch flash attention is slower than SDPA's C++ kernel (it is a reference: Python loops
over tiles); its point is memory (no s x s tensor) and the algorithm. On a GPU the Triton and compiled kernels
are where fusion pays: rerun there.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lessons"))
from _common import SIZES, make_cfg  # noqa: E402  (the lessons' models; puts ROOT on sys.path)
from benchmarks import _smoke  # noqa: E402  (--smoke, the test's size; a package import: lessons import these scripts)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from picotron import kernels  # noqa: E402
from picotron.mesh import Mesh  # noqa: E402
from picotron.parallelize import parallelize  # noqa: E402
from picotron.train import load_data  # noqa: E402


def timed(fn):
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # GPU work is asynchronous: wait for it before reading the clock
    return time.perf_counter() - t0


def backward_step(fn, inputs, dout):
    """A step to time: fn()'s forward and its backward from dout, the inputs' old gradients dropped first."""
    def step():
        for t in inputs:
            t.grad = None
        fn().backward(dout)
    return step


def paired(rounds, ours, theirs):
    """Median and quartiles of theirs' time / ours' time over rounds (alternating which goes first)."""
    ours(), theirs()  # warm-up (compilation, allocations)
    ratios, t_ours, t_theirs = [], [], []
    for r in range(rounds):
        a, b = (timed(ours), timed(theirs)) if r % 2 == 0 else tuple(reversed((timed(theirs), timed(ours))))
        ratios.append(b / a)
        t_ours.append(a)
        t_theirs.append(b)
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return statistics.median(t_ours), statistics.median(t_theirs), statistics.median(ratios), q[0], q[2]


def report(name, ours, theirs, result):
    a, b, med, lo, hi = result
    print(f"  {name:<44} {ours} {1e3 * a:8.2f} ms, {theirs} {1e3 * b:8.2f} ms | {ours} throughput / {theirs}'s: "
          f"median {med:.2f} (quartiles {lo:.2f}-{hi:.2f})", flush=True)


def attention(rounds, seq_lens):
    b, a, kv, d = 2, 8, 4, 32
    print(f"attention forward + backward, b={b}, {a} query heads over {kv} KV heads of d={d}, fp32:")
    for s in seq_lens:
        g = torch.Generator().manual_seed(s)
        q, k, v = (torch.randn(b, h, s, d, generator=g, requires_grad=True) for h in (a, kv, kv))
        dout = torch.randn(b, a, s, d, generator=g)

        run = lambda fn: backward_step(fn, (q, k, v), dout)  # noqa: E731
        flash = run(lambda: kernels.flash_attention(q, k, v, causal=True))
        sdpa = run(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))

        def eager():
            kk, vv = k.repeat_interleave(a // kv, 1), v.repeat_interleave(a // kv, 1)
            scores = (q @ kk.transpose(-2, -1)) / d ** 0.5
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
            return torch.softmax(scores, -1) @ vv
        eager = run(eager)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        got = kernels.flash_attention(q, k, v, causal=True)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            raise SystemExit(f"flash attention disagrees with SDPA at s={s}: {(got - want).abs().max():.2e}")
        naive, tiled = (kernels.attention_bytes(b, a, kv, s, d, 4, impl=i) for i in ("naive", "tiled"))
        print(f"  s={s}: bytes moved by one forward: written out {naive / 2**20:.1f} MiB, tiled {tiled / 2**20:.1f} MiB "
              f"({naive / tiled:.1f}x less)")
        report(f"s={s}: flash (ours, plain PyTorch) vs SDPA", "ours", "sdpa", paired(rounds, flash, sdpa))
        report(f"s={s}: flash (ours) vs eager", "ours", "eager", paired(rounds, flash, eager))


def gpu_attention(rounds):
    """Triton flash attention vs SDPA (flash backend) vs the plain tiles on one CUDA GPU, bf16, causal."""
    if not torch.cuda.is_available() or kernels.triton is None:
        print("gpu attention: skipped (needs a CUDA GPU and the triton package; on a CPU the Triton kernels only run "
              "under the interpreter, see tests/test_kernels.py)")
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    print(f"gpu attention, causal, bf16, forward + backward on {torch.cuda.get_device_name()}:")
    for s in (2048, 8192):
        for d in (64, 128):
            b, a = 16384 // s, 2048 // d
            g = torch.Generator(device="cuda").manual_seed(s + d)
            q, k, v, dout = (torch.randn(b, a, s, d, generator=g, device="cuda", dtype=torch.bfloat16)
                             for _ in range(4))
            q, k, v = (t.requires_grad_() for t in (q, k, v))

            step = lambda fn: backward_step(fn, (q, k, v), dout)  # noqa: E731

            def sdpa():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            triton_fa = step(lambda: kernels.flash_attention(q, k, v, causal=True, impl="triton"))
            plain = step(lambda: kernels.flash_attention(q, k, v, causal=True, impl="plain"))
            with torch.no_grad():
                err = (kernels.flash_attention(q, k, v, impl="triton").float() - sdpa().float()).abs().max().item()
            if err > 3e-2:
                raise SystemExit(f"Triton flash attention disagrees with SDPA at s={s}, d={d}: {err:.2e}")
            flops = 3.5 * 4 * b * a * s * s * d / 2  # forward 4·s²·d per head, halved by the mask; backward 2.5x
            fast = paired(rounds, triton_fa, step(sdpa))  # the first call autotunes the kernels' tiles
            t_sdpa = fast[1]
            plain()  # warm-up
            t_plain = statistics.median(timed(plain) for _ in range(min(rounds, 3)))
            print(f"  s={s} d={d} (b={b}, {a} heads): triton {1e3 * fast[0]:.2f} ms "
                  f"({b * s / fast[0]:,.0f} tokens/s, {flops / fast[0] / 1e12:.0f} TFLOP/s), sdpa flash "
                  f"{1e3 * t_sdpa:.2f} ms ({flops / t_sdpa / 1e12:.0f} TFLOP/s), plain tiles {1e3 * t_plain:.1f} ms | "
                  f"triton throughput / sdpa's: median {fast[2]:.2f} (quartiles {fast[3]:.2f}-{fast[4]:.2f}), "
                  f"plain tiles / sdpa: {t_sdpa / t_plain:.3f}; max |out - sdpa| {err:.1e}", flush=True)


def fused(rounds, shape=(8, 256, 1024), inner=2816, compile=True):
    impls = ["compile"] * compile + (["triton"] if kernels.triton_runs_on("cpu") else [])
    if not impls:
        return
    print(f"fused RMSNorm and SwiGLU, forward + backward, fp32 {list(shape)} (SwiGLU's inputs {[*shape[:2], inner]}):")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.ones(shape[-1], requires_grad=True)
    gate, up = (torch.randn(*shape[:2], inner, generator=g, requires_grad=True) for _ in range(2))
    for impl in impls:
        def norm(i):
            return lambda: kernels.rms_norm(x, w, 1e-5, impl=i).sum().backward()

        def glu(i):
            return lambda: kernels.swiglu(gate, up, impl=i).sum().backward()
        if not torch.allclose(kernels.rms_norm(x, w, 1e-5, impl=impl), kernels.rms_norm(x, w, 1e-5, impl="plain"),
                              rtol=1e-5, atol=1e-5):
            raise SystemExit(f"rms_norm impl={impl} disagrees with the plain ops")
        report(f"rms_norm {impl} vs plain", impl, "plain", paired(rounds, norm(impl), norm("plain")))
        report(f"swiglu {impl} vs plain", impl, "plain", paired(rounds, glu(impl), glu("plain")))


def model_steps(rounds, size, steps, compile=True, **tiny):
    mesh = Mesh.local()
    variants = {"plain fp32": {}, "--compile": dict(compile=True), "--kernels compile": dict(kernels="compile"),
                "--dtype bf16": dict(dtype="bf16"), "--dtype bf16-params": dict(dtype="bf16-params"),
                "--dtype fp8": dict(dtype="fp8")}
    if not compile:
        variants = {k: v for k, v in variants.items() if "compile" not in k}
    runs = {}
    for name, kw in variants.items():
        cfg = make_cfg(size, **tiny, **kw)
        run = parallelize(cfg, mesh)
        _, loader = load_data(cfg, mesh)
        runs[name] = (run, loader)
    cfg = make_cfg(size, **tiny)
    print(f"a training step of the lessons' '{size}' model{' made tiny' * bool(tiny)} (h={cfg.model_config().hidden_size}), "
          f"{cfg.micro_batch_size} x {cfg.seq_len} tokens, {steps} steps per timing:")

    def stepper(name):
        run, loader = runs[name]

        def go():
            for i in range(steps):
                run.schedule.run(run.model, loader.micro_batches(i + 1), run.loss_fn)
                run.optimizer.step()
                run.model.zero_grad(set_to_none=True)
        return go
    for name in variants:
        if name != "plain fp32":
            report(name + " vs plain fp32", "this", "plain", paired(rounds, stepper(name), stepper("plain fp32")))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--seq-lens", default="256,1024")
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--steps-model", type=int, default=3)
    p.add_argument("--gpu-attention-only", action="store_true", help="only the Triton flash attention on a GPU")
    p.add_argument("--skip-compile", action="store_true", help="leave out the torch.compile variants (compiling "
                                                                 "takes tens of seconds on a CPU, whatever the size)")
    args, tiny = _smoke.parse(p, argv, rounds=2, seq_lens="32", steps_model=1)
    torch.manual_seed(0)
    print(f"kernels and precision recipes, one process ({torch.get_num_threads()} threads), {args.rounds} rounds:")
    gpu_attention(args.rounds)
    if args.gpu_attention_only:
        return
    attention(args.rounds, [int(s) for s in args.seq_lens.split(",")])
    compile = not args.skip_compile
    if not compile:
        print("--skip-compile: the torch.compile variants are left out")
    fused(args.rounds, *([(2, 32, 64), 128] if args.smoke else []), compile=compile)
    model_steps(args.rounds, args.size, args.steps_model, compile, **tiny and dict(tiny, seq_len=32, micro_batch_size=2))


if __name__ == "__main__":
    main()
