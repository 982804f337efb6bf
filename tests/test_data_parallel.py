"""Data parallelism against the single-process run (the parity standard, docs/reference.md#parity-standard).

dp ranks with micro-batch b and grad_acc G see exactly the rows that one process sees with micro-batch b and
grad_acc dp*G (picotron.data lays a step's rows out rank-major), so per-step losses must agree within 1e-5
relative and the averaged gradients slice by slice within 1e-5; only the order of additions differs.
"""
import dataclasses
import os
import tempfile

import pytest
import torch

from picotron import data_parallel
from picotron.config import Config
from picotron.launch import run_on_ranks
from picotron.mesh import Mesh
from picotron.metrics import read_metrics
from picotron.model import loss_fn
from picotron.parallelize import build_model, parallelize
from picotron.train import load_data, train

SMALL = dict(seq_len=32, micro_batch_size=2, sample_tokens=0, log_every=1000, eval_every=0, lr=1e-2,
             warmup_steps=2)
STEPS = 10


def step_gradients(cfg, mesh):
    """One step's averaged gradients on this rank: the trainer's own parts (parallelize, its schedule)."""
    cfg = dataclasses.replace(cfg, bucket_mb=0.05)  # small buckets: several of them
    run = parallelize(cfg, mesh)
    _, loader = load_data(cfg, mesh)
    run.schedule.run(run.model, loader.micro_batches(1), run.loss_fn)
    return {n: p.grad.clone() for n, p in run.raw.named_parameters()}


def run_dp(dp, grad_acc, impl, out):
    """Child: 10 training steps and one step's gradients with this layout; rank 0 returns the losses."""
    cfg = Config(dp=dp, grad_acc=grad_acc, dp_impl=impl, steps=STEPS, out=out, **SMALL)
    with Mesh.init(dp=dp) as mesh:
        grads = step_gradients(cfg, mesh)
        train(cfg, mesh)
        losses = [r["loss"] for r in read_metrics(out)[0]] if mesh.rank == 0 else None
    return losses, grads


@pytest.fixture(scope="module")
def reference():
    """Single process, grad_acc = dp * G: losses and gradients for every global batch used below."""
    results = {}
    with Mesh.init() as mesh, tempfile.TemporaryDirectory() as tmp:
        for acc in (1, 2, 3, 4, 6, 8):
            cfg = Config(grad_acc=acc, steps=STEPS, out=os.path.join(tmp, str(acc)), **SMALL)
            grads = step_gradients(cfg, mesh)
            train(cfg, mesh)
            results[acc] = [r["loss"] for r in read_metrics(cfg.out)[0]], grads
    return results


CASES = [(2, 1, "naive"), (2, 2, "overlap"), (2, 1, "bucket"), (2, 2, "bucket"), (2, 2, "ddp"),
         (3, 1, "bucket"), (3, 2, "naive"), (4, 1, "overlap"), (4, 2, "bucket")]


@pytest.mark.parametrize("dp,grad_acc,impl", CASES)
def test_data_parallel_matches_single_process(reference, tmp_path, dp, grad_acc, impl):
    results = run_on_ranks(run_dp, dp, dp, grad_acc, impl, str(tmp_path), timeout_s=180)
    ref_losses, ref_grads = reference[dp * grad_acc]
    losses = results[0][0]
    assert losses == pytest.approx(ref_losses, rel=1e-5), (losses, ref_losses)
    for rank, (_, grads) in enumerate(results):
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"rank {rank}, {name}: {m}")


def test_buckets_are_views_and_follow_backward_order():
    """Each p.grad is a view into its bucket; buckets are filled from the last layer to the first."""
    results = run_on_ranks(_bucket_layout, 2)
    assert results[0] == results[1]
    first_bucket_names, n_buckets, all_views = results[0]
    assert n_buckets > 1 and all_views
    assert first_bucket_names[0] == "lm_head.weight"


def _bucket_layout():
    cfg = Config(dp=2, **SMALL)
    with Mesh.init(dp=2) as mesh:
        raw = build_model(cfg, mesh)
        model = data_parallel.DataParallel(raw, mesh.dp_cp, bucket_mb=0.1)
        names = {p: n for n, p in raw.named_parameters()}
        views = all(p.grad.untyped_storage().data_ptr() == b.buffer.untyped_storage().data_ptr()
                    for b in model.buckets for p in b.params)
        return [names[p] for p in model.buckets[0].params], len(model.buckets), views


def test_no_sync_sends_nothing_until_the_last_micro_batch():
    assert run_on_ranks(_no_sync_child, 2) == [True, True]


def _no_sync_child():
    cfg = Config(dp=2, **SMALL)
    with Mesh.init(dp=2) as mesh:
        raw = build_model(cfg, mesh)
        model = data_parallel.DataParallel(raw, mesh.dp_cp)
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(mesh.rank))  # differs by rank
        with model.no_sync():
            loss_fn(model(x), x).backward()
        local = raw.lm_head.weight.grad.clone()
        assert all(b.work is None for b in model.buckets)  # nothing was sent
        other = [torch.zeros_like(local) for _ in range(2)]
        torch.distributed.all_gather(other, local)
        return not torch.equal(other[0], other[1])  # the replicas' gradients still differ
