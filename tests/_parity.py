"""The parity standard as test code, shared by the strategies' tests: one step's full gradients from any layout,
then the comparison with the single-process run (every gradient, loss and gradient norm per step, val loss)."""
import pytest
import torch

from picotron import marks
from picotron.tensor_parallel import gather_from_tp

# a whole model's parity run: 3 steps, a validation at the end (tests/test_parity_matrix.py, tests/test_async_tp.py)
SMALL = dict(seq_len=32, micro_batch_size=2, sample_tokens=0, log_every=1000, eval_every=3, eval_batches=1,
             lr=3e-3, warmup_steps=2, steps=3, grad_clip=1.0)


def model_child(layout, out):
    """In each rank: one step's gradients (gathered whole, `layout_grads`), then the 3-step training run of SMALL +
    `layout` and its records (rank 0's) and summary: what `assert_matches` compares with one process."""
    from picotron import train as train_mod
    from picotron.config import Config
    from picotron.mesh import Mesh
    from picotron.metrics import read_metrics
    from picotron.parallelize import parallelize

    cfg = Config(out=out, **{**SMALL, **layout})
    degrees = dict(dp=cfg.dp, pp=cfg.pp, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep)
    with Mesh.init(**degrees) as mesh:
        _, loader = train_mod.load_data(cfg, mesh)
        run = parallelize(cfg, mesh)
        run.schedule.run(run.model, loader.micro_batches(1), run.loss_fn)
        grads = layout_grads(run, mesh, cfg)
        mesh.world.all_reduce(torch.zeros(1))
    with Mesh.init(**degrees) as mesh:
        summary = train_mod.train(cfg, mesh)
        records = read_metrics(out)[0] if mesh.rank == 0 else None
    return grads, records, summary


def layout_grads(run, mesh, cfg, every_replica=False):
    """{name: full gradient} of the parameters this rank holds, after one step of `run` (what `parallelize` built):
    ZeRO's shards gathered over their unit's axis, then tensor-parallel slices gathered over tp (names as in the
    single-process model: a pipeline's chunks keep the layers' own indices). Only the first rank of
    each group of replicas returns them (the others: {}), so each gradient is compared once per holder;
    `every_replica`: every rank with tp rank 0 returns them (HSDP: each replica's own copy compared too)."""
    grads = {}
    if cfg.zero:  # each rank holds the mean gradient of its shard of every unit
        names = {p: n for chunk in getattr(run.raw, "chunks", [run.raw]) for n, p in chunk.named_parameters()}
        for unit in run.model.units:
            flat = torch.empty(unit.grad_shard.numel() * unit.axis.size)
            unit.axis.all_gather_into(flat, unit.grad_shard.contiguous())
            for p, off in zip(unit.params, unit.offsets):
                if marks.placement(p).copy_of is None:
                    grads[names[p]] = gather_from_tp(flat[off:off + p.numel()].view(p.shape),
                                                     marks.placement(p).split_dim, mesh.tp)
    else:
        for chunk in getattr(run.raw, "chunks", [run.raw]):
            for name, p in chunk.named_parameters():
                if marks.placement(p).copy_of is None:
                    grads[name] = gather_from_tp(p.grad, marks.placement(p).split_dim, mesh.tp)
    return grads if mesh.tp.rank == 0 and (every_replica or mesh.edp.rank == 0) else {}


def assert_matches(results, reference, label):
    """`results`: each rank's (grads, metrics records, summary) — the records from rank 0; `reference`: the one
    process's. Every gradient within 1e-5, none left uncompared; loss and grad norm per step within 1e-5 relative;
    the last validation loss too."""
    ref_grads, ref_records, _ = reference
    seen = set()
    for grads, _, _ in results:
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{label}: {name}: {m}")
            seen.add(name)
    assert seen == set(ref_grads), f"{label}: gradients not compared: {sorted(set(ref_grads) - seen)}"
    records = results[0][1]
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in records] == pytest.approx([r[key] for r in ref_records], rel=1e-5), f"{label}: {key}"
    assert records[-1]["val_loss"] == pytest.approx(ref_records[-1]["val_loss"], rel=1e-5), f"{label}: val_loss"
