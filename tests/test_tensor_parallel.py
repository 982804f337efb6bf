"""Tensor (and sequence) parallelism against the unsharded model (the parity standard, docs/reference.md#parity-standard).

Each layer against its unsharded twin, forward and backward (the column-parallel forward and the embedding
exactly: no reduction order changes there); the whole model at tp = 2 and 4, with and without sp, and
combined with dp = 2 (plain, ZeRO-1, ZeRO-3): per-step losses within 1e-5 relative of the single process,
one step's gradients slice by slice; every Linear and Embedding sharded; the collectives of one forward and
backward counted against Megatron's pattern.
"""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from picotron import marks, tensor_parallel
from picotron.config import Config
from picotron.launch import run_on_ranks
from picotron.mesh import Axis, Mesh
from picotron.metrics import read_metrics
from picotron.model import Llama, ModelConfig
from picotron.tensor_parallel import (ColumnParallelLinear, FullVocabLogits, RowParallelLinear, VocabParallelEmbedding,
                                      gather_from_tp)
from picotron.model import loss_fn
from picotron.parallelize import build_model, parallelize
from picotron.train import load_data, train

SMALL = dict(seq_len=32, micro_batch_size=2, sample_tokens=0, log_every=1000, eval_every=4, eval_batches=1, lr=1e-2,
             warmup_steps=2, bucket_mb=0.05)
STEPS = 5


def sharded_model(config, axis, sp=False):
    """This rank's shard of a model; `axis`: a mesh's tp axis, or Axis.alone("tp", n, r) to build rank r's shard
    of a tp = n layout in this process, without any process group."""
    with torch.device("meta"):
        model = Llama(config)
    tensor_parallel.apply(model, axis, sp=sp)
    return marks.materialize(model, "cpu").init_weights(0)


def slice_of(layer, full):
    """This rank's slice of a full weight, where the layer's placement says it sits (picotron.marks)."""
    return marks.placement(layer.weight).take(full, layer.weight.shape)


# ------------------------------------------------------------------------------ sharding, in this process
@pytest.mark.parametrize("tied,sp", [(False, False), (True, True)])
def test_every_linear_and_embedding_is_sharded_and_initialised_as_a_slice(tied, sp):
    """No nn.Linear or nn.Embedding survives apply (the LM head included: a peer left it whole); names stay
    those of the unsharded model; each shard holds exactly its slice of the full model's initial weights."""
    config = ModelConfig.from_preset("tiny", tie_word_embeddings=tied)
    full = Llama(config).init_weights(0)
    ref = dict(full.named_parameters())
    for rank in range(2):
        model = sharded_model(config, Axis.alone("tp", 2, rank), sp)
        left = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
        assert not left, f"left unsharded: {left}"
        assert isinstance(model.lm_head, ColumnParallelLinear) and model.lm_head.weight.shape == (128, 128)
        assert isinstance(model.embed_tokens, VocabParallelEmbedding)
        assert (model.lm_head.weight is model.embed_tokens.weight) == tied
        assert [n for n, _ in model.named_parameters()] == list(ref)
        assert list(model.state_dict()) == list(full.state_dict())
        for name, p in model.named_parameters():
            dim = marks.placement(p).split_dim
            assert (dim is None) == (p.dim() == 1), name  # matrices sharded, norm weights replicated
            assert marks.placement(p).dims == (() if dim is None else ("tp",)), name  # what clipping reads
            expected = ref[name] if dim is None else ref[name].chunk(2, dim)[rank]
            assert torch.equal(p, expected), name


def test_kv_heads_fewer_than_tp_is_a_clear_error():
    with torch.device("meta"):
        model = Llama(ModelConfig.from_preset("tiny"))  # 8 query heads, 4 KV heads
    with pytest.raises(ValueError, match=r"tp=8 is more than num_key_value_heads=4 .* pick tp in \{1, 2, 4\}"):
        tensor_parallel.apply(model, Axis.alone("tp", 8, 0))


# ------------------------------------------------------------------------------ layers against their twins
def layers_child():
    n = dist.get_world_size()
    with Mesh.init(tp=n) as mesh:
        r = mesh.tp.rank
        torch.manual_seed(0)  # the same full tensors on every rank
        b, s, h, o, v = 2, 8, 16, 24, 32
        x, w, gy = torch.randn(b, s, h), torch.randn(o, h), torch.randn(b, s, o)
        w2, x2, gy2 = torch.randn(h, o), torch.randn(b, s, o), torch.randn(b, s, h)
        for sp in (False, True):
            seq = (lambda t: t.chunk(n, 1)[r]) if sp else (lambda t: t)  # with sp a rank holds s/n tokens

            # column-parallel: forward exact, backward slice by slice
            col = ColumnParallelLinear(h, o, mesh.tp, sp=sp)
            col.weight.data.copy_(slice_of(col, w))
            xl = seq(x).clone().requires_grad_()
            y = col(xl)
            xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
            yf = F.linear(xf, wf)
            # exact: no communication, no reduction, the same matmul as the unsharded layer restricted to its rows
            # (against the full product's slice only close: a BLAS may block a wider matmul differently)
            assert torch.equal(y, F.linear(x, w.chunk(n, 0)[r])), f"column forward, sp={sp}, rank {r}"
            torch.testing.assert_close(y, yf.chunk(n, -1)[r], rtol=1e-6, atol=1e-6)
            (y * gy.chunk(n, -1)[r]).sum().backward()
            (yf * gy).sum().backward()
            torch.testing.assert_close(xl.grad, seq(xf.grad), msg=lambda m: f"column input grad, sp={sp}: {m}")
            torch.testing.assert_close(col.weight.grad, wf.grad.chunk(n, 0)[r], msg=lambda m: f"column weight grad: {m}")

            # row-parallel: takes this rank's input features; output summed (sp: this rank's tokens of it)
            row = RowParallelLinear(o, h, mesh.tp, sp=sp)
            row.weight.data.copy_(slice_of(row, w2))
            xl = x2.chunk(n, -1)[r].clone().requires_grad_()
            y = row(xl)
            xf, wf = x2.clone().requires_grad_(), w2.clone().requires_grad_()
            yf = F.linear(xf, wf)
            torch.testing.assert_close(y, seq(yf), msg=lambda m: f"row forward, sp={sp}: {m}")
            (y * seq(gy2)).sum().backward()
            (yf * gy2).sum().backward()
            torch.testing.assert_close(xl.grad, xf.grad.chunk(n, -1)[r], msg=lambda m: f"row input grad: {m}")
            torch.testing.assert_close(row.weight.grad, wf.grad.chunk(n, 1)[r], msg=lambda m: f"row weight grad: {m}")

            # vocab-parallel embedding: exact forward (one nonzero term per sum), weight gradient by rows
            table, ids, ge = torch.randn(v, h), torch.randint(0, v, (b, s)), torch.randn(b, s, h)
            emb = VocabParallelEmbedding(v, h, mesh.tp, sp=sp)
            emb.weight.data.copy_(slice_of(emb, table))
            tf = table.clone().requires_grad_()
            y, yf = emb(ids), F.embedding(ids, tf)
            assert torch.equal(y, seq(yf)), f"embedding forward, sp={sp}, rank {r}"
            (y * seq(ge)).sum().backward()
            (yf * ge).sum().backward()
            torch.testing.assert_close(emb.weight.grad, tf.grad.chunk(n, 0)[r], msg=lambda m: f"embedding grad: {m}")

        # vocab-parallel cross-entropy: never sees the full logits
        logits, targets = torch.randn(b, s, v) * 3, torch.randint(0, v, (b, s))
        local = logits.chunk(n, -1)[r].clone().requires_grad_()
        full = logits.clone().requires_grad_()
        loss = tensor_parallel.loss_fn(local, targets, mesh.tp)
        ref = loss_fn(full, targets)
        torch.testing.assert_close(loss, ref, msg=lambda m: f"cross-entropy: {m}")
        (2 * loss).backward()
        (2 * ref).backward()
        torch.testing.assert_close(local.grad, full.grad.chunk(n, -1)[r], msg=lambda m: f"cross-entropy grad: {m}")

        # a whole (tied) model in one forward/backward, and the full-vocabulary logits for generation
        config = ModelConfig.from_preset("tiny", tie_word_embeddings=True, num_hidden_layers=2)
        ref_model = Llama(config).init_weights(0)
        ids = torch.randint(0, 256, (2, 17))  # 16 positions: sp splits them over tp = 2 or 4
        ref_loss = loss_fn(ref_model(ids[:, :-1]), ids[:, 1:])
        ref_loss.backward()
        for sp in (False, True):
            model = sharded_model(config, mesh.tp, sp)
            loss = tensor_parallel.loss_fn(model(ids[:, :-1]), ids[:, 1:], mesh.tp)
            torch.testing.assert_close(loss, ref_loss, msg=lambda m: f"tied model loss, sp={sp}: {m}")
            loss.backward()
            for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
                grad = gather_from_tp(p.grad, marks.placement(p).split_dim, mesh.tp)
                torch.testing.assert_close(grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}, sp={sp}: {m}")
            with torch.no_grad():
                for length in (1, 5, 8):  # sp pads to a multiple of tp
                    torch.testing.assert_close(FullVocabLogits(model, mesh.tp, sp)(ids[:, :length]), ref_model(ids[:, :length]),
                                               msg=lambda m: f"full-vocabulary logits, length {length}, sp={sp}: {m}")
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_layers_match_their_unsharded_twins(tp):
    assert run_on_ranks(layers_child, tp, timeout_s=120) == [True] * tp


# ------------------------------------------------------------------------------------- the whole model
def step_gradients(cfg, mesh):
    """One step's gradients as full tensors: tp slices concatenated, ZeRO chunks put back together. The
    trainer's own parts run the step (parallelize, its schedule)."""
    run = parallelize(cfg, mesh)
    raw, model = run.raw, run.model
    _, loader = load_data(cfg, mesh)
    run.schedule.run(model, loader.micro_batches(1), run.loss_fn)
    grads = {p: p.grad for p in raw.parameters()}
    if cfg.zero:  # each dp rank has its chunk of every unit: gather the chunks over dp x cp
        for unit in model.units:
            chunks = [torch.zeros_like(unit.grad_shard) for _ in range(mesh.dp_cp.size)]
            dist.all_gather(chunks, unit.grad_shard.contiguous(), group=mesh.dp_cp.group)
            flat = torch.cat(chunks)
            for p, off in zip(unit.params, unit.offsets):
                grads[p] = flat[off:off + p.numel()].view(p.shape)
    return {n: gather_from_tp(grads[p], marks.placement(p).split_dim, mesh.tp) for n, p in raw.named_parameters()}


def run_layout(tp, sp, dp, stage, out, extra):
    cfg = Config(tp=tp, sp=sp, dp=dp, zero=stage, steps=STEPS, out=out, **{**SMALL, **extra})
    with Mesh.init(dp=dp, tp=tp) as mesh:
        grads = step_gradients(cfg, mesh)
        train(cfg, mesh)
        records = read_metrics(out)[0] if mesh.rank == 0 else None
    return records, grads


@pytest.fixture(scope="module")
def reference():
    """The single process with grad_acc = dp: per-step records and one step's gradients."""
    results = {}
    with Mesh.init() as mesh, tempfile.TemporaryDirectory() as tmp:
        for acc in (1, 2):
            cfg = Config(grad_acc=acc, steps=STEPS, out=os.path.join(tmp, str(acc)), **SMALL)
            grads = step_gradients(cfg, mesh)
            train(cfg, mesh)
            results[acc] = read_metrics(cfg.out)[0], grads
    return results


LAYOUTS = [  # tp, sp, dp, zero stage, extra settings
    (2, False, 1, 0, {}),
    (2, True, 1, 0, {"sample_tokens": 4}),  # the text sample: full-vocabulary logits, padded for sp
    (4, False, 1, 0, {}),
    (4, True, 1, 0, {"sample_tokens": 4}),
    (2, False, 2, 0, {}),
    (2, True, 2, 1, {}),
    (2, True, 2, 3, {}),
    (2, False, 1, 0, {"recompute": "partitioned"}),  # ZeRO-R's partitioned checkpoints
    pytest.param(4, False, 1, 0, {"recompute": "partitioned"}, marks=pytest.mark.heavy),
    pytest.param(2, False, 2, 0, {"recompute": "partitioned"}, marks=pytest.mark.heavy),
    pytest.param(2, False, 2, 3, {"recompute": "partitioned"}, marks=pytest.mark.heavy),  # ZeRO-3 regathers too
]


@pytest.mark.parametrize("tp,sp,dp,stage,extra", LAYOUTS)
def test_model_matches_single_process(reference, tmp_path, tp, sp, dp, stage, extra):
    results = run_on_ranks(run_layout, tp * dp, tp, sp, dp, stage, str(tmp_path), extra, timeout_s=240)
    ref_records, ref_grads = reference[dp]
    records = results[0][0]
    for key in ("loss", "val_loss"):  # the logged loss is the true mean over the global batch
        got, want = ([r.get(key) for r in rs] for rs in (records, ref_records))
        assert [g is None for g in got] == [w is None for w in want]
        assert [g for g in got if g is not None] == pytest.approx([w for w in want if w is not None], rel=1e-5), key
    for rank, (_, grads) in enumerate(results):
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"gradient, rank {rank}, {name}: {m}")


# ------------------------------------------------------------------------------ counting the collectives
def count_child(layers, sp):
    """Every all-reduce, all-gather and reduce-scatter of one forward and one backward, with its full-buffer
    bytes (an all-gather's output, a reduce-scatter's input), as the mesh's recorder logs them:
    {phase: {(op, bytes): calls}}."""
    from picotron import metrics
    cfg = Config(tp=2, sp=sp, num_hidden_layers=layers, **SMALL)
    with Mesh.init(tp=2) as mesh:
        model = build_model(cfg, mesh)
        x = torch.randint(0, 256, (2, 33))
        recorder = mesh.comm.recorder = metrics.Recorder()  # every axis of this mesh reports to it
        loss = tensor_parallel.loss_fn(model(x[:, :-1]), x[:, 1:], mesh.tp)
        forward = len(recorder.log)
        loss.backward()
        counts = {"forward": {}, "backward": {}}
        for i, (op, nbytes, _) in enumerate(recorder.log):
            phase = counts["forward" if i < forward else "backward"]
            phase[op, nbytes] = phase.get((op, nbytes), 0) + 1
        return counts


def test_collectives_per_layer_follow_megatrons_pattern():
    """Per layer: 2 all-reduces of b·s·h forward and 2 backward; with sp each becomes an all-gather and a
    reduce-scatter of the same bytes (plus the norm weights' gradient all-reduces). Outside the layers: the
    embedding, the LM head's input and three all-reduces of b·s numbers in the loss."""
    b, s, h = 2, 32, 128
    act, tok, vec = 4 * b * s * h, 4 * b * s, 4 * h  # bytes of one activation, one number per token, a norm weight
    AR, AG, RS = "all_reduce", "all_gather", "reduce_scatter"
    for sp in (False, True):
        small, big = run_on_ranks(count_child, 2, 2, sp, timeout_s=120)[0], run_on_ranks(count_child, 2, 4, sp,
                                                                                          timeout_s=120)[0]
        if not sp:
            layer = {"forward": {(AR, act): 2}, "backward": {(AR, act): 2}}
            rest = {"forward": {(AR, act): 1, (AR, tok): 3}, "backward": {(AR, act): 1}}
        else:
            layer = {"forward": {(AG, act): 2, (RS, act): 2}, "backward": {(AG, act): 2, (RS, act): 2, (AR, vec): 2}}
            rest = {"forward": {(RS, act): 1, (AG, act): 1, (AR, tok): 3},
                    "backward": {(AG, act): 1, (RS, act): 1, (AR, vec): 1}}
        for layers, counts in ((2, small), (4, big)):
            for phase in ("forward", "backward"):
                expected = {k: rest[phase].get(k, 0) + layers * layer[phase].get(k, 0)
                            for k in set(rest[phase]) | set(layer[phase])}
                assert counts[phase] == expected, (sp, layers, phase, counts[phase], expected)
        # the same volume either way: an all-reduce of B bytes = a reduce-scatter of B + an all-gather of B
        per_layer = {p: {k: big[p].get(k, 0) - small[p].get(k, 0) for k in big[p]} for p in big}
        volume = {op: sum(k[1] * c / 2 for p in per_layer for k, c in per_layer[p].items() if k[0] == op and k[1] == act)
                  for op in (AR, AG, RS)}
        assert volume == ({AR: 4 * act, AG: 0, RS: 0} if not sp else {AR: 0, AG: 4 * act, RS: 4 * act}), volume


# ------------------------------------------------------------------- partitioned checkpoints (ZeRO-R's Pa)
def partition_child(layers):
    """One forward and backward with recompute "full" and then "partitioned": the bytes autograd saved (counted as
    the trainer counts them), every collective, and the gradients gathered whole."""
    from picotron import metrics
    n = dist.get_world_size()
    out = {}
    with Mesh.init(tp=n) as mesh:
        x = torch.randint(0, 256, (2, 33))
        for mode in ("full", "partitioned"):
            model = build_model(Config(tp=n, recompute=mode, num_hidden_layers=layers, **SMALL), mesh)
            recorder = mesh.comm.recorder = metrics.Recorder()
            with metrics.ActivationCounter(model) as counter:
                loss = tensor_parallel.loss_fn(model(x[:, :-1]), x[:, 1:], mesh.tp)
            forward = list(recorder.log)
            loss.backward()
            mesh.comm.recorder = None
            out[mode] = dict(saved=counter.bytes, forward=forward, backward=recorder.log[len(forward):], loss=loss.item(),
                             grads={name: gather_from_tp(p.grad, marks.placement(p).split_dim, mesh.tp)
                                    for name, p in model.named_parameters()})
    return out


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.heavy)])
def test_partitioned_checkpoints_keep_one_tp_th_and_gather_once_per_layer(tp):
    """Against full recomputation on the same ranks: each layer's saved input shrinks from b·s·h to b·s·h/tp
    numbers per rank (the rest of what is saved does not change); the backward adds one all-gather of the b·s·h
    input per layer, before that layer's recomputed collectives; loss and gradients are bit for bit the same."""
    b, s, h, layers = 2, 32, 128, 2
    act = 4 * b * s * h  # one fp32 layer input
    results = run_on_ranks(partition_child, tp, layers, timeout_s=120)
    for rank, res in enumerate(results):
        full, part = res["full"], res["partitioned"]
        assert full["saved"] - part["saved"] == layers * act * (tp - 1) // tp, (rank, full["saved"], part["saved"])
        assert part["forward"] == full["forward"]
        gathers = [i for i, entry in enumerate(part["backward"]) if entry == ("all_gather", act, "tp")]
        assert len(gathers) == layers, part["backward"]
        assert [e for i, e in enumerate(part["backward"]) if i not in gathers] == full["backward"]
        assert gathers[0] == 1, "first the LM head's f, then the last layer's input is gathered, before its recomputation"
        assert part["loss"] == full["loss"]
        for name, g in part["grads"].items():
            assert torch.equal(g, full["grads"][name]), f"rank {rank}: {name}"


@pytest.mark.parametrize("settings,sentence", [
    (dict(recompute="partitioned"), r"recompute='partitioned' with tp=1 has nothing to partition .* use --recompute full"),
    (dict(recompute="partitioned", tp=2, sp=True), r"recompute='partitioned' with --sp is already what --recompute full "
                                                   r"does .*; use --recompute full\."),
])
def test_partitioned_needs_tp_without_sp(settings, sentence):
    from picotron.config import ConfigError
    from picotron.parallelize import validate
    with pytest.raises(ConfigError, match=sentence):
        validate(Config(**settings), any_world_size=True)


def pipeline_partition_child(layout, out):
    """The parity matrix's run (tests/_parity.py): one step's gradients gathered whole, then a short training."""
    from _parity import layout_grads
    cfg = Config(out=out, **{**SMALL, "steps": 3, **layout})
    with Mesh.init(dp=cfg.dp, pp=cfg.pp, tp=cfg.tp) as mesh:
        _, loader = load_data(cfg, mesh)
        run = parallelize(cfg, mesh)
        run.schedule.run(run.model, loader.micro_batches(1), run.loss_fn)
        grads = layout_grads(run, mesh, cfg)
        mesh.world.all_reduce(torch.zeros(1))
    with Mesh.init(dp=cfg.dp, pp=cfg.pp, tp=cfg.tp) as mesh:
        summary = train(cfg, mesh)
        records = read_metrics(out)[0] if mesh.rank == 0 else None
    return grads, records, summary


@pytest.mark.heavy
def test_partitioned_with_pipeline_matches_single_process(tmp_path):
    """tp 2 x pp 2 (1F1B, 2 micro-batches): every stage's layers keep 1/tp of their inputs; the parity standard."""
    from _parity import assert_matches
    layout = dict(tp=2, pp=2, grad_acc=2, recompute="partitioned")
    reference = run_on_ranks(pipeline_partition_child, 1, dict(grad_acc=2), str(tmp_path / "one"), timeout_s=180)[0]
    results = run_on_ranks(pipeline_partition_child, 4, layout, str(tmp_path / "tp2pp2"), timeout_s=300)
    assert_matches(results, reference, "tp2 x pp2, recompute partitioned")
