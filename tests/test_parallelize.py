"""The composition seam: parallelize(), the step engine, the gradient-sync protocol, parameter marks, the
model's seams, and every strategy on lesson 02's own collectives (--collectives ours).

The strategies' parity with the single process is proven in their own test files (test_data_parallel,
test_zero, test_tensor_parallel), which build through this seam; here: the seam's own contracts.
"""
import ast
import inspect

import pytest
import torch

from picotron import data_parallel, marks, metrics, parallelize as par_mod, train as train_mod, zero
from picotron.config import Config
from picotron.launch import run_on_ranks
from picotron.mesh import Axis, Mesh
from picotron.metrics import Recorder, read_metrics
from picotron.model import Llama, ModelConfig, loss_fn, rope_cos_sin
from picotron.parallelize import parallelize
from picotron.train import train

SMALL = dict(seq_len=32, micro_batch_size=2, sample_tokens=0, log_every=1000, eval_every=0, lr=1e-2,
             warmup_steps=2, steps=4)


# ------------------------------------------------------------------------------------- the loop's shape
def test_train_py_knows_no_strategy():
    """train.py imports no strategy module and asks no object what it is (no hasattr)."""
    tree = ast.parse(inspect.getsource(train_mod))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names} | \
               {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    for strategy in ("data_parallel", "zero", "zero3", "tensor_parallel", "picotron.zero", "picotron.tensor_parallel",
                     "picotron.data_parallel", "picotron.zero3"):
        assert strategy not in imported, strategy
    calls = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    assert "hasattr" not in calls


def test_every_strategy_owns_its_rules():
    """validate asks each strategy module's check() for its own values, then parallelize's table for which
    strategies combine; their sentences come out unchanged."""
    from picotron import config, context_parallel, expert_parallel, pipeline_parallel, precision, rules, tensor_parallel
    strategies = (tensor_parallel, context_parallel, pipeline_parallel, expert_parallel, precision)
    # each module's check is its rule, and validate runs it; the kernels' rule asks picotron.kernels (which would
    # close a circle if it imported its rule back); --profile's (picotron.trace) is the trainer's, not a strategy's
    assert [s.check for s in strategies] + [rules.kernels_rule, rules.profile_rule] == list(rules.RULES)
    mc = ModelConfig.from_preset("tiny")
    assert tensor_parallel.check(Config(tp=3), mc).startswith("tp=3 does not divide num_attention_heads=8")
    assert par_mod.combination_problem(Config(zero=1), mc).startswith("zero=1 with dp=1 has nothing to shard over")
    assert par_mod.combination_problem(Config(dp=2, tp=2, pp=2, cp=2, sp=True, zero=1), mc) is None
    with pytest.raises(config.ConfigError, match="tp=3 does not divide"):
        par_mod.validate(Config(tp=3), 3)
    with pytest.raises(config.ConfigError, match="dp_impl='ddp' runs torch's DistributedDataParallel"):
        par_mod.validate(Config(dp=2, dp_impl="ddp", collectives="ours"), 2)


# ---------------------------------------------------------------------------------- one process, Mesh.local
def test_one_process_goes_through_the_same_seam():
    """At dp = 1 the model is still wrapped (Local: the protocol, no communication) and the schedule's loss
    is the plain accumulated loss."""
    mesh = Mesh.local()
    cfg = Config(grad_acc=2, **SMALL)
    run = parallelize(cfg, mesh)
    assert isinstance(run.model, data_parallel.Local) and run.raw is run.model.module
    _, loader = train_mod.load_data(cfg, mesh)
    batches = loader.micro_batches(1)
    activations = run.schedule.phases.listen(metrics.ActivationPeak(run.model))  # as the trainer counts them
    loss = run.schedule.run(run.model, batches, run.loss_fn)
    ref = Llama(cfg.model_config()).init_weights(cfg.seed)
    want = sum(loss_fn(ref(b.inputs), b.targets) / 2 for b in batches)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    for (name, p), q in zip(run.raw.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name}: {m}")
    assert activations.bytes > 0


@pytest.mark.parametrize("impl", ["naive", "overlap", "bucket", "ddp"])
def test_every_wrapper_speaks_the_protocol(impl):
    """Each gradient-sync wrapper has exactly the protocol's methods (the engine calls nothing else)."""
    names = ("forward", "no_sync", "finish_sync", "zero_grad", "memory", "optimizer_groups")
    for cls in (data_parallel.Local, data_parallel.NaiveDataParallel, data_parallel.DataParallel,
                data_parallel.TorchDDP, zero.ZeroDataParallel):
        assert issubclass(cls, data_parallel.GradSync)
        assert all(callable(getattr(cls, n)) for n in names)


# ------------------------------------------------------------------------------------------- marks, clipping
def _clip_child(tp, dp, stage):
    """The global gradient norm of one step on this layout (each element counted once, from the placements)."""
    cfg = Config(tp=tp, dp=dp, zero=stage, **SMALL)
    with Mesh.init(dp=dp, tp=tp) as mesh:
        run = parallelize(cfg, mesh)
        _, loader = train_mod.load_data(cfg, mesh)
        run.schedule.run(run.model, loader.micro_batches(1), run.loss_fn)
        marked = {marks.placement(p).dims for p in run.params}
        return marks.clip_grad_norm(run.params, 0.0, mesh), marked


@pytest.mark.parametrize("tp,dp,stage,marked", [
    (2, 1, 0, {(), ("tp",)}),  # norm weights replicated over tp, matrices sharded
    (1, 2, 2, {("dp", "cp")}),  # ZeRO's pieces: sharded over its axis
    (2, 2, 3, {("dp", "cp"), ("dp", "cp", "tp")}),  # both
])
def test_clip_grad_norm_counts_each_element_once(tp, dp, stage, marked):
    """One all-reduce gives the single process's norm whatever the layout: the placements say what is a slice."""
    mesh = Mesh.local()
    cfg = Config(grad_acc=dp, **SMALL)
    run = parallelize(cfg, mesh)
    _, loader = train_mod.load_data(cfg, mesh)
    run.schedule.run(run.model, loader.micro_batches(1), run.loss_fn)
    want = torch.nn.utils.clip_grad_norm_(run.raw.parameters(), float("inf")).item()
    for norm, got in run_on_ranks(_clip_child, tp * dp, tp, dp, stage, timeout_s=120):
        assert norm == pytest.approx(want, rel=1e-5)
        assert got == marked


# ----------------------------------------------------------------------------------------- model seams
def test_layers_keep_their_global_names_when_others_are_dropped():
    """A pipeline stage keeps some layers: their names, hence their initial values, are those of the full
    model; without embedding, norm and head the model maps hidden states to hidden states."""
    config = ModelConfig.from_preset("tiny")
    full = Llama(config).init_weights(3)
    with torch.device("meta"):
        stage = Llama(config)
    for i in (0, 1):
        del stage.layers[str(i)]
    stage.embed_tokens = stage.norm = stage.lm_head = None
    stage.to_empty(device="cpu").init_weights(3)
    assert stage.layers.indices() == [2, 3]
    ref = dict(full.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(p, ref[name]), name
    h = torch.randn(2, 8, config.hidden_size)
    cos, sin = rope_cos_sin(torch.arange(8), config.head_dim, config.rope_theta)
    torch.testing.assert_close(stage(h), full.layers[3](full.layers[2](h, cos, sin), cos, sin))


def test_attention_core_is_a_swappable_module_and_positions_travel_with_the_batch():
    config = ModelConfig.from_preset("tiny", num_hidden_layers=1)
    model = Llama(config).init_weights(0)
    ids = torch.randint(0, 256, (2, 8))
    assert torch.equal(model(ids), model(ids, torch.arange(8)))
    assert torch.equal(model(ids), model(ids, torch.arange(8).expand(2, 8)))
    seen = []

    class Spy(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, q, k, v, cos, sin):
            seen.append(q.shape)
            return self.inner(q, k, v, cos, sin)
    model.layers[0].self_attn.core = Spy(model.layers[0].self_attn.core)
    model(ids)
    assert seen == [(2, 8, 8, 16)]


# ------------------------------------------------------------------------------ --collectives ours|torch
def _collectives_child(impl, tp, dp, stage, out):
    cfg = Config(tp=tp, dp=dp, zero=stage, collectives=impl, out=out, **SMALL)
    with Mesh.init(dp=dp, tp=tp, collectives=impl) as mesh:
        train(cfg, mesh)
        return [(r["loss"], r["grad_norm"]) for r in read_metrics(out)[0]] if mesh.rank == 0 else None


@pytest.mark.parametrize("tp,dp,stage", [(1, 2, 0), (2, 1, 0), (1, 2, 3)])
def test_every_strategy_runs_on_our_own_collectives(tmp_path, tp, dp, stage):
    """The whole stack on lesson 02's send/recv collectives: the same losses as on torch.distributed's."""
    theirs = run_on_ranks(_collectives_child, tp * dp, "torch", tp, dp, stage, str(tmp_path / "torch"), timeout_s=180)[0]
    ours = run_on_ranks(_collectives_child, tp * dp, "ours", tp, dp, stage, str(tmp_path / "ours"), timeout_s=180)[0]
    assert [l for l, _ in ours] == pytest.approx([l for l, _ in theirs], rel=1e-5)
    assert [g for _, g in ours] == pytest.approx([g for _, g in theirs], rel=1e-5)


def test_recorder_counts_what_an_axis_sends():
    """A recorded axis counts full-buffer bytes per kind; size-1 axes send nothing."""
    rec = Recorder()
    axis = Axis.alone("dp").recorded(rec)
    t = torch.ones(10)
    axis.all_reduce(t)
    assert rec.bytes == {} and torch.equal(t, torch.ones(10))
    assert Mesh.local().dp_cp.mean(torch.tensor(3.0)).item() == 3.0


def _recorded_tp_child():
    cfg = Config(tp=2, **SMALL)
    with Mesh.init(tp=2) as mesh:
        rec = Recorder()
        run = parallelize(cfg, mesh, recorder=rec)
        rec.reset()
        x = torch.randint(0, 256, (cfg.micro_batch_size, cfg.seq_len))
        run.schedule.run(run.model, [(x, x, torch.arange(cfg.seq_len))], run.loss_fn)
        act = cfg.micro_batch_size * cfg.seq_len * cfg.model_config().hidden_size * 4
        return (mesh.comm.recorder, {axis for _, _, axis in rec.log},
                sum(kind == "all_reduce" and nbytes == act for kind, nbytes, _ in rec.log),
                cfg.model_config().num_hidden_layers)


def test_parallelize_records_every_axis_of_the_run():
    """parallelize(recorder=...) builds on a recorded copy of the mesh: tensor parallelism's all-reduces are
    counted (Megatron's 2 forward + 2 backward per layer, the embedding's forward and the LM head's backward),
    and the caller's mesh is left unrecorded."""
    for recorder, axes, n_act, layers in run_on_ranks(_recorded_tp_child, 2, timeout_s=120):
        assert recorder is None
        assert axes == {"tp"}
        assert n_act == 4 * layers + 2
