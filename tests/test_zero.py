"""ZeRO-1/2/3 against plain data parallelism and the single-process run (DESIGN.md's parity standard).

dp ranks with grad_acc G see exactly the rows one process sees with grad_acc dp*G, so per-step losses must
agree within 1e-5 relative, one step's gradients slice by slice (each rank's chunk, put back together),
and the parameters after training. dp = 3 makes uneven chunks (padding); bf16 autocast and activation
recomputation must not change the story either.
"""
import os
import tempfile

import pytest
import torch

from picotron import data, zero
from picotron.config import Config
from picotron.launch import run_on_ranks
from picotron.mesh import Mesh
from picotron.metrics import read_metrics
from picotron.train import build_model, loss_fn, train

SMALL = dict(seq_len=32, micro_batch_size=2, sample_tokens=0, log_every=1000, eval_every=0, lr=1e-2,
             warmup_steps=2, bucket_mb=0.05)  # small buckets: several units in stages 1-2
STEPS = 6


def step_gradients(cfg, mesh):
    """One step's gradients: the single process's p.grad, or the chunks of every rank put back together."""
    model = raw = build_model(cfg, mesh)
    if cfg.zero:
        model = zero.wrap(raw, mesh, cfg.zero, bucket_mb=cfg.bucket_mb)
    tokens = data.TokenData.load().train
    for micro in range(cfg.grad_acc):
        x, y = data.get_batch(tokens, 1, micro, seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size,
                              grad_acc=cfg.grad_acc, dp_size=mesh.dp_size, dp_rank=mesh.dp_rank, seed=cfg.seed)
        ctx = model.no_sync() if cfg.zero and micro < cfg.grad_acc - 1 else torch.enable_grad()
        with ctx, torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.dtype == "bf16"):
            (loss_fn(model(x), y) / cfg.grad_acc).backward()
    if not cfg.zero:
        return {n: p.grad.clone() for n, p in raw.named_parameters()}
    model.finish_gradient_sync()
    names = {p: n for n, p in raw.named_parameters()}
    grads = {}
    for unit in model.units:
        chunks = [torch.zeros_like(unit.grad_shard) for _ in range(mesh.dp_size)]
        torch.distributed.all_gather(chunks, unit.grad_shard.contiguous())
        flat = torch.cat(chunks)
        for p, off in zip(unit.params, unit.offsets):
            grads[names[p]] = flat[off:off + p.numel()].view(p.shape).clone()
    return grads


def run_zero(stage, dp, grad_acc, out, extra):
    cfg = Config(dp=dp, zero=stage, grad_acc=grad_acc, steps=STEPS, out=out, **SMALL, **extra)
    with Mesh.init(dp=dp) as mesh:
        grads = step_gradients(cfg, mesh)
        _, model = train(cfg, mesh, return_model=True)
        params = (model.full_parameters() if cfg.zero else  # plain data parallelism: every rank has it all
                  {n: p.detach().clone() for n, p in model.module.named_parameters()})
        losses = [r["loss"] for r in read_metrics(out)[0]] if mesh.rank == 0 else None
    return losses, grads, params


def single(acc, out, extra):
    cfg = Config(grad_acc=acc, steps=STEPS, out=out, **SMALL, **extra)
    with Mesh.init() as mesh:
        grads = step_gradients(cfg, mesh)
        _, model = train(cfg, mesh, return_model=True)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return [r["loss"] for r in read_metrics(out)[0]], grads, params


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(acc, **extra):
        key = (acc, tuple(sorted(extra.items())))
        if key not in cache:
            with tempfile.TemporaryDirectory() as tmp:
                cache[key] = single(acc, tmp, extra)
        return cache[key]
    return get


CASES = [(stage, dp, acc) for stage in (1, 2, 3) for dp, acc in ((2, 2), (3, 1), (4, 2))]


@pytest.mark.parametrize("stage,dp,grad_acc", CASES)
def test_zero_matches_single_process(reference, tmp_path, stage, dp, grad_acc):
    check(reference(dp * grad_acc), run_on_ranks(run_zero, dp, stage, dp, grad_acc, str(tmp_path), {},
                                                  timeout_s=240))


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_bf16_and_recompute_match_single_process(reference, tmp_path, stage):
    """bf16 autocast over fp32 master shards, and full recomputation (ZeRO-3 re-gathers inside backward).

    The first step's gradients meet the strict standard. Later steps cannot: the global norm summed over
    shards differs from the single process's by one rounding (4.8e-7 of 6.1), and bf16's 8-bit mantissa turns
    that into a 1e-4 loss difference within two steps (measured with one process, ZeRO-1 with n=1 against
    no ZeRO: identical until clipping is switched on). So losses within 1e-3, parameters within 2% in norm."""
    extra = {"dtype": "bf16", "recompute": "full"}
    check(reference(4, **extra), run_on_ranks(run_zero, 2, stage, 2, 2, str(tmp_path), extra, timeout_s=240),
          loss_rtol=1e-3, param_norm=2e-2)


def check(ref, results, loss_rtol=1e-5, param_norm=None):
    ref_losses, ref_grads, ref_params = ref
    assert results[0][0] == pytest.approx(ref_losses, rel=loss_rtol), (results[0][0], ref_losses)
    for rank, (_, grads, params) in enumerate(results):
        assert grads.keys() == ref_grads.keys() and params.keys() == ref_params.keys()
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"gradient, rank {rank}, {name}: {m}")
            if param_norm is None:
                assert_params_close(params[name], ref_params[name], f"rank {rank}, {name}")
            else:
                diff = (params[name] - ref_params[name]).norm()
                assert diff <= param_norm * ref_params[name].norm(), f"rank {rank}, {name}: norm of diff {diff}"


def assert_params_close(p, ref, where):
    """Parameters after STEPS Adam steps. Adam divides by sqrt(v): where a gradient element is ~0, the order
    of additions can flip its sign and move that element by up to 2·lr per step. So: all but 0.1% of the
    elements within 1e-4 relative, none off by more than 2·lr·STEPS, and the tensor within 2e-4 in norm.
    (A wrong chunk or offset fails all three at once.) Observed at dp=2, grad_acc=2, fp32: plain data
    parallelism 1e-5 in norm, 2.7e-5 at most; ZeRO-1 1.1e-5, 4.2e-5; ZeRO-3 4.6e-5, 1.8e-4 (one element)."""
    diff = (p - ref).abs()
    off = (diff > 1e-4 * ref.abs() + 1e-6).sum().item()
    assert off <= 1e-3 * p.numel(), f"parameter after {STEPS} steps, {where}: {off} of {p.numel()} elements differ"
    assert diff.max() <= 2 * SMALL["lr"] * STEPS, f"parameter after {STEPS} steps, {where}: max diff {diff.max()}"
    assert diff.norm() <= 2e-4 * ref.norm() + 1e-7, f"parameter after {STEPS} steps, {where}: norm of diff {diff.norm()}"
