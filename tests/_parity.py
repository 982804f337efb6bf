"""The parity standard as test code, shared by the strategies' tests: one step's full gradients from any layout,
then the comparison with the single-process run (every gradient, loss and gradient norm per step, val loss)."""
import pytest
import torch

from picotron import marks
from picotron.tensor_parallel import gather_from_tp


def layout_grads(run, mesh, cfg):
    """{name: full gradient} of the parameters this rank holds, after one step of `run` (what `parallelize` built):
    ZeRO's shards gathered over their unit's axis, then tensor-parallel slices gathered over tp (names as in the
    single-process model: a pipeline's chunks keep the layers' own indices). Only the first rank of
    each group of replicas returns them (the others: {}), so each gradient is compared once per holder."""
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
    return grads if mesh.edp.rank == 0 and mesh.tp.rank == 0 else {}


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
