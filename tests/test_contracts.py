"""The contracts between the parts, checked where they are easiest to break.

1. Placements (picotron.marks) outlive what torch's module operations do to parameters. The record is kept on the
   module that holds a parameter, by name: `to_empty`, `deepcopy`, `load_state_dict(assign=True)` and a swap of
   the Parameter on conversion all make new Parameter objects, and after each of them the layout-independent init
   still gives rank 1 of tp = 2 its slice of the full tensor. A tensor that lost what it carries is refused
   loudly (`marks.NoPlacement`), never read as replicated; `marks.attach` gives it back. Once on two gloo
   processes, the whole way: build_model at tp = 2, a plain to_empty, init, compare with the single model.
2. Stages (model.Stages): the one thing gradient wrappers and the pipeline executor read of a model. A whole Llama
   and a pipeline stage both answer it; ZeRO and ZeRO-3 cut their units from it; the tied embedding is summed by
   the one `pipeline_parallel.sync_tied`; every FlatUnit field is declared up front; the strategy files ask no
   object what it has (no hasattr / getattr between strategies).
"""
import ast
import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from picotron import marks, pipeline_parallel, pipeline_schedules, tensor_parallel, zero, zero3
from picotron.config import Config
from picotron.launch import run_on_ranks
from picotron.mesh import Axis, Mesh
from picotron.model import Llama, ModelConfig, Stages

TINY = ModelConfig.from_preset("tiny")  # k_proj: 4 KV heads x 16 = 64 rows of 128: rank 1 of tp = 2 holds 32-63
K_PROJ = "layers.0.self_attn.k_proj.weight"


def tp_rank1_on_meta(config=TINY):
    """Rank 1's shard of a tp = 2 model, on the meta device (no process group: Axis.alone)."""
    with torch.device("meta"):
        model = Llama(config)
    return tensor_parallel.apply(model, Axis.alone("tp", 2, 1))


def full_model(config=TINY):
    return Llama(config).init_weights(0)


def assert_rank1_slices(model, full):
    """Every parameter of `model` is rank 1's slice of the full model's (where its record says it sits)."""
    whole = dict(full.named_parameters())
    for name, where in marks.records(model).items():
        p = model.get_parameter(name)
        assert torch.equal(p, where.take(whole[name], p.shape)), name
    k = model.get_parameter(K_PROJ)
    assert k.shape == (32, 128) and torch.equal(k, whole[K_PROJ][32:])


# ------------------------------------------------------------------------------- 1. placements survive
def test_plain_to_empty_keeps_the_record_and_the_init_takes_the_slice():
    """The reproduction: a plain Module.to_empty makes new Parameters; init_weights still draws the full 64 x 128
    tensor and keeps rows 32-63 (the record is on the module). The new tensors carry nothing until attach: a
    reader that sees only tensors (clipping) is refused, not told "replicated"."""
    model = tp_rank1_on_meta()
    nn.Module.to_empty(model, device="cpu")
    model.init_weights(0)
    assert_rank1_slices(model, full_model())
    with pytest.raises(marks.NoPlacement, match="carries no placement"):
        marks.placement(model.get_parameter(K_PROJ))
    with pytest.raises(marks.NoPlacement, match=r"parameter\(s\) do not carry"):
        marks.check(model)
    marks.check(marks.attach(model))
    assert marks.placement(model.get_parameter(K_PROJ)).dims == ("tp",)


def test_llama_to_empty_keeps_the_placement():
    model = tp_rank1_on_meta().to_empty(device="cpu").init_weights(0)
    marks.check(model)  # every tensor carries its record again
    where = marks.placement(model.get_parameter(K_PROJ))
    assert (where.dims, where.shape, where.offsets, where.split_dim) == (("tp",), (64, 128), (32, 0), 0)
    assert_rank1_slices(model, full_model())


def hand_sharded():
    """A plain Llama whose k_proj in layer 0 is rank 1's rows of tp = 2, placed by hand (no Axis, no process group
    inside: a tensor-parallel model holds its axis, which deepcopy cannot copy)."""
    model = Llama(TINY)
    k = model.get_submodule(K_PROJ.rsplit(".", 1)[0])
    k.weight = nn.Parameter(torch.empty(32, 128))
    marks.place(model, K_PROJ, dims=("tp",), shape=(64, 128), offsets=(32, 0), split_dim=0)
    return marks.attach(model).init_weights(0)


def test_deepcopy_keeps_the_records_and_refuses_the_untagged_copy():
    model = hand_sharded()
    twin = copy.deepcopy(model)
    assert marks.records(twin) == marks.records(model)  # the records travel with the modules
    with pytest.raises(marks.NoPlacement):
        marks.placement(twin.get_parameter(K_PROJ))  # Parameter.__deepcopy__ drops what the tensor carries
    twin.init_weights(0)
    assert_rank1_slices(twin, full_model())
    assert marks.placement(marks.attach(twin).get_parameter(K_PROJ)).offsets == (32, 0)


def test_load_state_dict_assign_keeps_the_placement():
    source = marks.materialize(tp_rank1_on_meta(), "cpu").init_weights(0)
    model = tp_rank1_on_meta()  # on meta: assign=True puts the source's tensors in as new Parameters
    model.load_state_dict({k: v.detach().clone() for k, v in source.state_dict().items()}, assign=True)
    marks.check(model)  # Llama's load_state_dict hook attached them
    assert marks.placement(model.get_parameter(K_PROJ)).dims == ("tp",)
    assert_rank1_slices(model, full_model())


def test_swap_on_conversion_is_refused_loudly_then_attached():
    model = marks.materialize(tp_rank1_on_meta(), "cpu").init_weights(0)
    before = marks.records(model)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.float64)  # torch.utils.swap_tensors: the Parameter's contents and attributes swapped out
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    with pytest.raises(marks.NoPlacement):
        marks.placement(model.get_parameter(K_PROJ))
    assert marks.records(model) == before
    marks.check(marks.attach(model))
    # a hand-made swap (a new Parameter in a lower precision) alike: the module keeps the record by name
    layer = model.get_submodule(K_PROJ.rsplit(".", 1)[0])
    layer.weight = nn.Parameter(layer.weight.detach().to(torch.bfloat16))
    with pytest.raises(marks.NoPlacement):
        marks.placement(layer.weight)
    assert marks.records(model)[K_PROJ].offsets == (32, 0)


def test_a_never_placed_parameter_is_replicated_and_whole():
    model = Llama(TINY)
    assert all(w.dims == () and w.offsets == (0,) * len(w.shape) for w in marks.records(model).values())
    with pytest.raises(marks.NoPlacement):  # but a bare tensor is not read as anything
        marks.placement(nn.Parameter(torch.zeros(3)))


def _tp2_child():
    """Rank r of tp = 2 on gloo: build_model (which checks every record), then the reported reproduction (the model
    on meta, Llama.to_empty, init) and a plain Module.to_empty, each compared with the single-process model;
    clipping refuses parameters that lost what they carry instead of counting them as replicated."""
    with Mesh.init(tp=2) as mesh:
        return _tp2_checks(mesh)


def _tp2_checks(mesh):
    from picotron.parallelize import build_model
    cfg = Config(tp=2, seq_len=32, micro_batch_size=2)
    built = build_model(cfg, mesh)  # asserts every parameter carries its record (marks.check)
    full = dict(Llama(cfg.model_config()).init_weights(cfg.seed).named_parameters())
    numel = sum(t.numel() for t in full.values())
    out = {}
    for how in ("Llama.to_empty", "Module.to_empty"):
        with torch.device("meta"):
            model = tensor_parallel.apply(Llama(cfg.model_config()), mesh.tp)
        if how == "Llama.to_empty":
            model.to_empty(device="cpu")
        else:
            nn.Module.to_empty(model, device="cpu")
        model.init_weights(cfg.seed)
        for name, p in model.named_parameters():
            where = marks.records(model)[name]
            assert torch.equal(p, where.take(full[name], p.shape)), (how, name)
            assert torch.equal(p, built.get_parameter(name)), (how, name)
        params = list(model.parameters())
        for p in params:
            p.grad = torch.ones_like(p)
        try:
            norm = marks.clip_grad_norm(params, 0.0, mesh)  # every element once: sqrt(number of parameters)
        except marks.NoPlacement:
            norm = "refused"
        out[how] = norm
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        built.to(torch.float64)  # a swap on conversion: the tensors' attributes go with the old contents
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        marks.check(built)
        out["swap"] = "kept"
    except marks.NoPlacement:
        out["swap"] = "refused"
    return out, numel


def test_tp2_to_empty_keeps_rank1_slice_and_clipping_refuses_a_lost_record():
    for out, numel in run_on_ranks(_tp2_child, 2, timeout_s=240):
        assert out["Llama.to_empty"] == pytest.approx(numel ** 0.5, rel=1e-6)  # kept: each element counted once
        assert out["Module.to_empty"] == "refused" and out["swap"] == "refused"


# --------------------------------------------------------------------------------------------- 2. stages
def _stage(name="1f1b", p=2, rank=1, tied=True):
    mc = dataclasses.replace(TINY, tie_word_embeddings=tied)
    plan = pipeline_schedules.build(name, p, 4, pipeline_schedules.chunks_of(name, 1))
    with torch.device("meta"):
        stage = pipeline_parallel.keep_stage(lambda: Llama(mc), plan, rank, mc, 32)
    marks.materialize(stage, "cpu")
    return pipeline_parallel.mark_stage(stage, plan, Axis.alone("pp", p, rank)).init_weights(0), plan


def test_whole_model_and_pipeline_stage_answer_the_same_contract():
    model = Llama(TINY)
    assert model.stages() == Stages(chunks=(model,), ids=(0,), tied=())
    last, _ = _stage(rank=1)  # the last of two stages, tied embeddings: its own copy of the head
    st = last.stages()
    assert isinstance(st, Stages) and st.ids == (1,) and st.chunks == tuple(last.chunks)
    assert st.tied == ("chunks.0.lm_head.weight",) and st.tied_params(last) == [last.chunks[0].lm_head.weight]
    first, _ = _stage(rank=0)
    assert first.stages().tied == ("chunks.0.embed_tokens.weight",)
    v, plan = _stage("zb-v", rank=0)  # the V: rank 0 holds stage 0 and the last stage, both ends
    assert v.stages().ids == (0, 3) and len(v.stages().tied) == 2
    marks.check(v)
    assert marks.placement(v.stages().tied_params(v)[1]).copy_of == "embed_tokens.weight"
    untied, _ = _stage(rank=1, tied=False)
    assert untied.stages().tied == ()


def test_tied_copy_survives_to_empty_by_name():
    """The tied pair is names: after a plain to_empty the stage still finds (and initialises) the head's copy."""
    stage, _ = _stage(rank=1)
    nn.Module.to_empty(stage, device="cpu")
    stage.init_weights(0)
    head = stage.stages().tied_params(stage)[0]
    assert head is stage.chunks[0].lm_head.weight
    assert torch.equal(head, full_model(dataclasses.replace(TINY, tie_word_embeddings=True)).embed_tokens.weight)


def test_zero_reads_the_stages():
    """ZeRO-2 and ZeRO-3 cut their units from `stages()`: one unit per tied end, ZeRO-3 a root per chunk that has
    one and a unit per layer; `tied_grads()` hands sync_tied the shards, the plain wrapper the whole gradients."""
    stage, _ = _stage("zb-v", rank=0)
    z2 = zero.ZeroDataParallel(stage, Axis.alone("dp", 2, 0), 2)
    assert z2.tied == stage.stages().tied_params(stage)
    assert [len(z2.unit_of[p].params) for p in z2.tied] == [1, 1]
    stage3, _ = _stage("zb-v", rank=0)
    z3 = zero3.Zero3(stage3, Axis.alone("dp", 2, 0))
    names = [u.name for u in z3.units]
    assert "root of stage 0 (tied)" in names and "root of stage 3 (tied)" in names
    layers = sum(len(list(c.layers)) for c in stage3.stages().chunks)
    assert sum(u.layer for u in z3.units) == layers
    whole = zero3.Zero3(Llama(TINY).init_weights(0), Axis.alone("dp", 2, 0))
    assert [u.name for u in whole.units if not u.layer] == ["root"]
    from picotron.data_parallel import Local
    local = Local(_stage("zb-v", rank=0)[0])
    for p in local.stages.tied_params(local.module):
        p.grad = torch.ones_like(p)
    assert len(local.tied_grads()) == 2


class _Ends:
    """A stand-in for the axis of the two end ranks: records what would be all-reduced."""

    def __init__(self):
        self.reduced = []

    def all_reduce(self, t, label=None):
        self.reduced.append(t)


def test_sync_tied_is_one_function_for_whole_gradients_and_shards():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])
    ends = _Ends()
    pipeline_parallel.sync_tied([a, b], ends)  # one rank holds both ends: summed in memory
    assert a.tolist() == b.tolist() == [11.0, 22.0] and ends.reduced == []
    pipeline_parallel.sync_tied([a], ends)  # one end here: all-reduced with the other end's rank
    assert ends.reduced == [a]
    assert not hasattr(zero.ShardedGradSync, "sync_tied")  # no second copy in the ZeRO wrapper


def test_flat_unit_declares_every_field():
    unit = zero.FlatUnit("u", [nn.Parameter(torch.zeros(5))], Axis.alone("dp", 2, 0))
    for name in ("full", "shard", "grad_full", "grad_shard", "grad_flat", "layer", "state", "phase", "work",
                 "holding", "ready"):
        assert name in vars(unit), name


PROBES = {"hasattr", "getattr"}
ALLOWED = {("zero.py", "__getattr__")}  # ShardedOptimizer passes unknown names on to the optimizer it wraps


@pytest.mark.parametrize("file", ["zero.py", "zero3.py", "pipeline_parallel.py", "parallelize.py",
                                  "data_parallel.py", "expert_parallel.py", "zero_bubble.py", "precision.py"])
def test_strategies_ask_no_object_what_it_has(file):
    """Wrappers, the executor and the assembly read declared contracts (Stages, GradSync, FlatUnit), never
    hasattr / getattr on another strategy's objects."""
    tree = ast.parse((Path(__file__).parent.parent / "picotron" / file).read_text())
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and (file, fn.name) not in ALLOWED:
            found += [f"{fn.name}:{c.lineno}" for c in ast.walk(fn) if isinstance(c, ast.Call)
                      and isinstance(c.func, ast.Name) and c.func.id in PROBES]
    assert found == [], f"{file} probes objects at {found}"
