"""Pipeline parallelism on real processes: every schedule matches the single process (the parity standard:
same seed, same global batch, fp32; per-step loss within 1e-5 relative; every gradient, stage by stage).

The schedules themselves are checked by the simulator in test_pipeline_schedules.py.
"""
import pytest
import torch

from picotron import pipeline_parallel as pp_mod
from picotron import train as train_mod
from picotron.config import Config, ConfigError, validate
from picotron.launch import run_on_ranks
from picotron.mesh import Mesh
from picotron.metrics import read_metrics
from picotron.model import ModelConfig
from picotron.parallelize import parallelize
from picotron.tensor_parallel import gather_from_tp
from picotron.train import train

SMALL = dict(seq_len=32, micro_batch_size=2, sample_tokens=0, log_every=1000, eval_every=0, lr=1e-2,
             warmup_steps=2, steps=3, grad_clip=1.0)


def _grads(run, mesh):
    """{parameter name: full gradient} of this rank's stage chunks (tp slices gathered), after one step."""
    out = {}
    chunks = run.raw.chunks if hasattr(run.raw, "chunks") else [run.raw]
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if getattr(p, "is_copy", False):
                name = "lm_head.weight (tied copy)"
            out[name] = gather_from_tp(p.grad, getattr(p, "tp_dim", None), mesh.tp)
    return out


def _child(layout, out):
    cfg = Config(out=out, **{**SMALL, **layout})
    with Mesh.init(dp=cfg.dp, pp=cfg.pp, tp=cfg.tp) as mesh:
        _, loader = train_mod.load_data(cfg, mesh)
        run = parallelize(cfg, mesh)
        run.schedule.run(run.model, loader.micro_batches(1), run.loss_fn)
        grads = _grads(run, mesh) if mesh.dp.rank == 0 and mesh.tp.rank == 0 else {}
        mesh.world.all_reduce(torch.zeros(1))  # everyone done with the first step before training anew
    cfg2 = Config(out=out, **{**SMALL, **layout})
    with Mesh.init(dp=cfg.dp, pp=cfg.pp, tp=cfg.tp) as mesh:
        summary = train(cfg2, mesh)
        records = read_metrics(out)[0] if mesh.rank == 0 else None
    return grads, records, summary


def _reference(layout, out):
    """The single process on the same global batch: dp x grad_acc micro-batches of the same size."""
    ref = {**SMALL, "grad_acc": layout.get("grad_acc", 1) * layout.get("dp", 1),
           **{k: v for k, v in layout.items() if k in ("recompute", "tie", "num_hidden_layers")}}
    return run_on_ranks(_child, 1, {k: v for k, v in ref.items() if k in Config.__dataclass_fields__}, out,
                        timeout_s=120)[0]


def _check(tmp_path, layout, ref_layout=None):
    world = layout.get("dp", 1) * layout.get("pp", 1) * layout.get("tp", 1)
    results = run_on_ranks(_child, world, layout, str(tmp_path / "pp"), timeout_s=240)
    ref_grads, ref_records, _ = _reference(ref_layout or layout, str(tmp_path / "ref"))
    records = results[0][1]
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in ref_records], rel=1e-5)
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in ref_records], rel=1e-5)
    seen = set()
    for grads, _, _ in results:
        for name, g in grads.items():
            want = ref_grads["embed_tokens.weight" if name.startswith("lm_head.weight (tied") else name]
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-7, msg=lambda m: f"{layout}: {name}: {m}")
            seen.add(name)
    assert seen >= set(ref_grads), f"parameters no stage holds: {sorted(set(ref_grads) - seen)}"


SCHEDULES = [("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 1)]


@pytest.mark.parametrize("schedule,chunks", SCHEDULES)
def test_every_schedule_matches_one_process_at_pp2(tmp_path, schedule, chunks):
    _check(tmp_path, dict(pp=2, pp_schedule=schedule, pp_chunks=chunks, grad_acc=4))
