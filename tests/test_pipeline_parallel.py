"""Pipeline parallelism on real processes: every schedule matches the single process (the parity standard:
same seed, same global batch, fp32; per-step loss within 1e-5 relative; every gradient, stage by stage).

The schedules themselves are checked by the simulator in test_pipeline_schedules.py.
"""
import json
import shutil

import pytest
import torch

from picotron import marks, nccl_rules
from picotron import train as train_mod
from picotron.config import Config, ConfigError
from picotron.launch import run_on_ranks
from picotron.mesh import Mesh
from picotron.metrics import read_metrics
from picotron.parallelize import parallelize, validate
from picotron.tensor_parallel import gather_from_tp
from picotron.train import train

SMALL = dict(seq_len=32, micro_batch_size=2, sample_tokens=0, log_every=1000, eval_every=0, lr=1e-2,
             warmup_steps=2, steps=3, grad_clip=1.0)


def _grads(run, mesh):
    """{parameter name: full gradient} of this rank's stage chunks (tp slices gathered), after one step."""
    out = {}
    for chunk in run.raw.stages().chunks:  # (model.Stages: a whole model is one chunk)
        for name, p in chunk.named_parameters():
            copy_of = marks.placement(p).copy_of
            if copy_of is not None:  # a tied head (its gradient is the embedding's), or a DualPipe copy
                name = f"{copy_of} (copy on pp rank {mesh.pp.rank})"
            out[name] = gather_from_tp(p.grad, marks.placement(p).split_dim, mesh.tp)
    return out


def _child(layout, out):
    cfg = Config(out=out, **{**SMALL, **layout})
    with Mesh.init(dp=cfg.dp, pp=cfg.pp, tp=cfg.tp) as mesh:
        _, loader = train_mod.load_data(cfg, mesh)
        run = parallelize(cfg, mesh)
        run.schedule.run(run.model, loader.micro_batches(1), run.loss_fn)
        if cfg.zero == 1:  # each rank holds the mean gradient of its shard only: all-gather the shards
            for unit in run.model.units:
                mesh.dp_cp.all_gather_into(unit.grad_full, unit.grad_full[unit.lo:unit.hi].clone())
        grads = _grads(run, mesh)  # every tp rank takes part in the gathers
        grads = grads if mesh.dp.rank == 0 and mesh.tp.rank == 0 else {}
        mesh.world.all_reduce(torch.zeros(1))  # everyone done with the first step before training anew
    cfg2 = Config(out=out, **{**SMALL, **layout})
    with Mesh.init(dp=cfg.dp, pp=cfg.pp, tp=cfg.tp) as mesh:
        summary = train(cfg2, mesh)
        records = read_metrics(out)[0] if mesh.rank == 0 else None
    return grads, records, summary


def _reference(layout, out):
    """The single process on the same global batch: dp x grad_acc micro-batches of the same size."""
    ref = {"grad_acc": layout.get("grad_acc", 1) * layout.get("dp", 1),
           **{k: v for k, v in layout.items() if k in ("recompute", "tie_word_embeddings", "num_hidden_layers")}}
    return run_on_ranks(_child, 1, ref, out, timeout_s=120)[0]


def _check(tmp_path, layout, ref_layout=None):
    world = layout.get("dp", 1) * layout.get("pp", 1) * layout.get("tp", 1)
    recorded = run_on_ranks(nccl_rules.run_recorded, world, _child, layout, str(tmp_path / "pp"), timeout_s=240)
    results = [out for out, _ in recorded]
    verdict = nccl_rules.replay([trace for _, trace in recorded])  # NCCL's ordering rules, every message
    assert verdict.ok, f"{layout}: {verdict}"
    ref_grads, ref_records, _ = _reference(ref_layout or layout, str(tmp_path / "ref"))
    seen = set()
    for grads, _, _ in results:
        for name, g in grads.items():
            want = ref_grads[name.split(" (copy")[0]]
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-7, msg=lambda m: f"{layout}: {name}: {m}")
            seen.add(name)
    assert seen >= set(ref_grads), f"parameters no stage holds: {sorted(set(ref_grads) - seen)}"
    records = results[0][1]
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in ref_records], rel=1e-5)
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in ref_records], rel=1e-5)


SCHEDULES = [("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 1)]


@pytest.mark.parametrize("schedule,chunks", SCHEDULES)
def test_every_schedule_matches_one_process_at_pp2(tmp_path, schedule, chunks):
    _check(tmp_path, dict(pp=2, pp_schedule=schedule, pp_chunks=chunks, grad_acc=4))


L8 = dict(num_hidden_layers=8)  # pp = 4 with two chunks per rank needs 8 stages


@pytest.mark.parametrize("schedule,chunks", [  # by default the two hardest at pp = 4 (the others: pp = 2, tied at pp 4)
    pytest.param(s, c, marks=pytest.mark.heavy) if s in ("afab", "1f1b", "zb-h1") else (s, c) for s, c in SCHEDULES])
def test_every_schedule_matches_one_process_at_pp4(tmp_path, schedule, chunks):
    _check(tmp_path, dict(pp=4, pp_schedule=schedule, pp_chunks=chunks, grad_acc=8, **L8))


@pytest.mark.parametrize("schedule,chunks,pp", [("1f1b", 1, 2), ("zb-v", 1, 2), ("interleaved", 2, 4), ("afab", 1, 4)])
def test_tied_embeddings_across_stages(tmp_path, schedule, chunks, pp):
    """The first stage's embedding and the last stage's head are two copies of one matrix: their gradients
    are summed (an all-reduce between the two ranks; in memory on zb-v's rank 0, which holds both ends),
    and the gradient equals the single process's tied gradient."""
    _check(tmp_path, dict(pp=pp, pp_schedule=schedule, pp_chunks=chunks, grad_acc=pp * 2, tie_word_embeddings=True,
                          **(L8 if pp == 4 else {})))


@pytest.mark.parametrize("schedule,recompute", [("1f1b", "full"), ("zb-h1", "full"), ("zb-v", "selective"),
                                                ("interleaved", "selective")])
def test_schedules_with_recompute(tmp_path, schedule, recompute):
    _check(tmp_path, dict(pp=2, pp_schedule=schedule, pp_chunks=2 if schedule == "interleaved" else 1, grad_acc=4,
                          recompute=recompute))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved"])
def test_pp2_dp2(tmp_path, schedule):
    """Each dp replica runs the pipeline on its rows; a stage's gradients are averaged over its dp group once,
    during the last backward (and W) of each chunk."""
    _check(tmp_path, dict(pp=2, dp=2, pp_schedule=schedule, pp_chunks=2 if schedule == "interleaved" else 1,
                          grad_acc=4))


@pytest.mark.parametrize("schedule,sp", [("1f1b", False), ("1f1b", True), ("zb-v", True), ("zb-h1", False)])
def test_pp2_tp2(tmp_path, schedule, sp):
    """Tensor-parallel stages: activations travel between the same tp rank of neighbouring stages ([b, s/tp, h]
    with sp); split schedules defer the tensor-parallel linears' weight gradients too."""
    _check(tmp_path, dict(pp=2, tp=2, sp=sp, pp_schedule=schedule, grad_acc=4))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_pp2_dp2_zero1(tmp_path, schedule):
    _check(tmp_path, dict(pp=2, dp=2, zero=1, pp_schedule=schedule, grad_acc=4))


def _eval_sample_child(layout):
    cfg = Config(**{**SMALL, **layout})
    with Mesh.init(dp=cfg.dp, pp=cfg.pp, tp=cfg.tp) as mesh:
        _, loader = train_mod.load_data(cfg, mesh)
        run = parallelize(cfg, mesh)
        val = run.schedule.evaluate(run.raw, list(loader.val_batches(2)), run.loss_fn)
        ids = torch.tensor([[10, 20, 30, 40, 50]])
        logits = run.sampler(ids)
        return val, logits


@pytest.mark.parametrize("layout", [dict(pp=2, pp_schedule="zb-v"), dict(pp=2, tp=2, sp=True),
                                    dict(pp=4, pp_schedule="interleaved", pp_chunks=2, grad_acc=4, **L8),
                                    pytest.param(dict(pp=4, pp_schedule="dualpipe", grad_acc=8), marks=pytest.mark.heavy)])
def test_evaluation_and_text_go_through_the_pipeline(layout):
    """The validation loss and the full-vocabulary logits of the sampler, on every rank, equal one process's."""
    world = layout.get("pp", 1) * layout.get("tp", 1)
    ref_val, ref_logits = run_on_ranks(_eval_sample_child, 1, {k: v for k, v in layout.items()
                                                               if k == "num_hidden_layers"}, timeout_s=120)[0]
    for val, logits in run_on_ranks(_eval_sample_child, world, layout, timeout_s=120):
        assert val == pytest.approx(ref_val, rel=1e-5)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("settings,message", [
    (dict(pp=2, dp=2, dp_impl="ddp"), "dp_impl='ddp' with pp=2 is not supported"),
    (dict(pp=8), "needs 8 stages of at least one layer each but the model has num_hidden_layers=4"),
    (dict(pp=2, pp_schedule="interleaved", pp_chunks=2, grad_acc=3), "needs grad_acc=3"),
    (dict(pp=2, pp_schedule="1f1b", pp_chunks=2), "pp_chunks=2 applies to the interleaved schedule only"),
    (dict(pp=2, pp_schedule="interleaved"), "pp_chunks=1 is plain 1F1B"),
    (dict(pp=2, pp_schedule="zb-v", num_hidden_layers=3), "needs 4 stages"),
    (dict(pp=3, pp_schedule="dualpipe", grad_acc=6), "needs an even pp and an even grad_acc >= 2[*]pp"),
    (dict(pp=2, pp_schedule="dualpipe", grad_acc=3), "got pp=2, grad_acc=3; pass an even --pp and --grad-acc 4"),
    (dict(pp=4, pp_schedule="dualpipe", grad_acc=6), "got pp=4, grad_acc=6; pass an even --pp and --grad-acc 8"),
    (dict(pp=2, pp_schedule="dualpipe", pp_chunks=2, grad_acc=4), "zb-v and dualpipe always use 2"),
    (dict(pp=2, dp=2, zero=1, pp_schedule="dualpipe", grad_acc=4), "zero=1 with pp_schedule='dualpipe' is not"),
    (dict(pp=2, pp_schedule="dualpipe", grad_acc=4, dtype="fp8"), "dtype='fp8' with pp_schedule='dualpipe'"),
    (dict(pp=2, pp_schedule="dualpipe", grad_acc=4, preset="tiny-moe"), "experts with pp_schedule='dualpipe' are not"),
])
def test_bad_pipeline_settings_get_one_sentence(settings, message):
    cfg = Config(**settings)
    with pytest.raises(ConfigError, match=message) as e:
        validate(cfg, cfg.world_size)
    assert str(e.value).count(". ") == 0 and "\n" not in str(e.value)


def test_one_stage_pipeline_is_gradient_accumulation():
    """The executor with a one-stage schedule (the whole model as one chunk) is today's step engine: the same
    loss and gradients as schedule.OneStage."""
    from picotron import pipeline_parallel as pp, pipeline_schedules, zero_bubble
    from picotron.model import Llama
    cfg = Config(grad_acc=3, **SMALL)
    mesh = Mesh.local()
    run = parallelize(cfg, mesh)
    _, loader = train_mod.load_data(cfg, mesh)
    batches = loader.micro_batches(1)
    want = run.schedule.run(run.model, batches, run.loss_fn)
    mc = cfg.model_config()
    for name in ("afab", "1f1b", "zb-h1"):
        plan = pipeline_schedules.build(name, 1, 3)
        with torch.device("meta"):
            stage = pp.keep_stage(lambda: Llama(mc), plan, 0, mc, cfg.seq_len)
        marks.materialize(stage, "cpu")
        pp.mark_stage(stage, plan, mesh.pp)
        stage.init_weights(cfg.seed)
        store = zero_bubble.WeightGradStore() if plan.split else None
        if store:
            zero_bubble.defer_weight_grads(stage, store)
        from picotron.data_parallel import Local
        got = pp.Pipeline(plan, mesh, mc.hidden_size, store=store).run(Local(stage), batches, run.loss_fn)
        assert got.item() == pytest.approx(want.item(), rel=1e-6), name
        for (n, p), q in zip(stage.chunks[0].named_parameters(), run.raw.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name} {n}: {m}")


def _resume_child(out, steps, resume):
    cfg = Config(out=out, pp=2, pp_schedule="zb-v", grad_acc=4, save_every=2, resume=resume,
                 **{**SMALL, "steps": steps})
    with Mesh.init(pp=2) as mesh:
        train(cfg, mesh)
        return [r["loss"] for r in read_metrics(out)[0]] if mesh.rank == 0 else None


def test_pipeline_checkpoint_resumes_exactly(tmp_path):
    """Each rank saves its own stages; a resumed run continues with the uninterrupted run's losses, bit for bit."""
    whole = run_on_ranks(_resume_child, 2, str(tmp_path / "a"), 4, False, timeout_s=180)[0]
    run_on_ranks(_resume_child, 2, str(tmp_path / "b"), 2, False, timeout_s=180)
    resumed = run_on_ranks(_resume_child, 2, str(tmp_path / "b"), 4, True, timeout_s=180)[0]
    assert resumed == whole


@pytest.mark.parametrize("layout", [
    dict(pp=2, grad_acc=4, tie_word_embeddings=True),
    pytest.param(dict(pp=4, grad_acc=8), marks=pytest.mark.heavy),
    pytest.param(dict(pp=4, grad_acc=10, tie_word_embeddings=True), marks=pytest.mark.heavy),
    pytest.param(dict(pp=2, dp=2, grad_acc=4), marks=pytest.mark.heavy),
], ids=lambda l: "-".join(f"{k}{v}" for k, v in l.items()))
def test_dualpipe_matches_one_process(tmp_path, layout):
    """DualPipe: every stage on two ranks (rank r's chunk 1 is rank p-1-r's chunk 0), half the micro-batches
    entering at each end. Both copies of every parameter end the step with the single process's gradient
    (the two directions' parts summed between mirror ranks), the loss is the sum of the two last stages', and
    clipping counts each copy once (the grad norms match)."""
    _check(tmp_path, dict(pp_schedule="dualpipe", **layout))


def _dualpipe_resume_child(out, steps, resume, layout):
    cfg = Config(out=out, save_every=2, resume=resume, **{**SMALL, "steps": steps, "grad_acc": 4, **layout})
    with Mesh.init(pp=cfg.pp) as mesh:
        train(cfg, mesh)
        return [r["loss"] for r in read_metrics(out)[0]] if mesh.rank == 0 else None


@pytest.mark.heavy
def test_dualpipe_checkpoint_keeps_one_copy_and_resumes(tmp_path):
    """A DualPipe checkpoint holds each stage once (chunk 0's, the canonical place; the copies are `copy_of`):
    resumed as DualPipe it continues bit for bit, resumed as one process (resharded) to the parity tolerance."""
    dual = dict(pp=2, pp_schedule="dualpipe")
    whole = run_on_ranks(_dualpipe_resume_child, 2, str(tmp_path / "a"), 4, False, dual, timeout_s=180)[0]
    run_on_ranks(_dualpipe_resume_child, 2, str(tmp_path / "b"), 2, False, dual, timeout_s=180)
    folder = tmp_path / "b/checkpoints/step_000002"
    names = [s["name"] for r in range(2) for s in json.loads((folder / f"rank_{r:05d}.json").read_text())["slices"]]
    assert len(names) == len(set(names)) and "embed_tokens.weight" in names, names  # every parameter once
    resumed = run_on_ranks(_dualpipe_resume_child, 2, str(tmp_path / "b"), 4, True, dual, timeout_s=180)[0]
    assert resumed == whole
    shutil.copytree(tmp_path / "b/checkpoints/step_000002", tmp_path / "c/checkpoints/step_000002")
    (tmp_path / "c/checkpoints/latest").write_text("step_000002")
    one = run_on_ranks(_dualpipe_resume_child, 1, str(tmp_path / "c"), 4, True, dict(pp=1), timeout_s=180)[0]
    assert one[-2:] == pytest.approx(whole[-2:], rel=1e-5)
