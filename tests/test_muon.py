"""Muon, distributed (picotron.muon): the Newton–Schulz iteration, the optimizer against a plain reference written
here, parity with one process under dp, ZeRO-1/2/3 and tp for both exchanges (gather, owner), the bytes of the
exchange against picotron.planner.muon_bytes_per_step, NCCL's rules, exact resume, and the refusals."""
import math
import tempfile

import pytest
import torch

from picotron import marks, muon, nccl_rules, planner
from picotron.config import Config, ConfigError
from picotron.launch import run_on_ranks
from picotron.mesh import Mesh
from picotron.metrics import Recorder, read_metrics
from picotron.parallelize import parallelize, validate
from picotron.tensor_parallel import gather_from_tp
from tests._reference import PARITY, single_process

MUON = dict(PARITY, optimizer="muon", warmup_steps=0, lr=0.02)  # lr 0.02: Muon's step moves the weights visibly


# ----------------------------------------------------------------------------------------------- the math
def test_newton_schulz_sets_every_singular_value_near_one_and_keeps_the_vectors():
    torch.manual_seed(0)
    for shape in [(32, 128), (128, 32), (64, 64)]:
        k = min(shape)
        u, _ = torch.linalg.qr(torch.randn(shape[0], k))
        v, _ = torch.linalg.qr(torch.randn(shape[1], k))
        g = u @ torch.diag(torch.logspace(0, -1.5, k)) @ v.T * 7.0  # singular values spread over 30x, any scale
        x = muon.newton_schulz(g)
        s = torch.linalg.svdvals(x)
        assert s.min() > 0.65 and s.max() < 1.25, (shape, s.min(), s.max())  # the quintic's band, ~[0.7, 1.2]
        inner = u.T @ x @ v  # g's singular vectors diagonalise x: the same directions, new magnitudes
        off = inner - torch.diag(torch.diagonal(inner))
        assert off.abs().max() < 1e-4, shape
    assert muon.update_scale((128, 384)) == pytest.approx(0.2 * math.sqrt(384))


def test_owner_of_balances_by_size_and_is_the_same_everywhere():
    sizes = [100, 100, 10, 10, 10, 300]
    owner = planner.owner_of(sizes, 3)
    loads = [sum(s for s, o in zip(sizes, owner) if o == r) for r in range(3)]
    assert owner == planner.owner_of(sizes, 3) and sorted(loads) == [110, 120, 300]
    assert planner.owner_of([5] * 4, 4) == [0, 1, 2, 3]


def _plain_muon_reference(model, batches, lr, wd, steps):
    """Muon written out plainly: SGD momentum with Nesterov, the quintic in fp32, Liu et al.'s scale, decoupled
    decay; torch's own AdamW (the single-tensor one) for what is not a hidden matrix."""
    from picotron.model import loss_fn
    hidden = [p for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2]
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in ids]
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": wd},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                              lr=lr, betas=(0.9, 0.95), foreach=False)
    bufs, losses = {id(p): torch.zeros_like(p) for p in hidden}, []
    for x, y in batches[:steps]:
        model.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
        adamw.step()
        with torch.no_grad():
            for p in hidden:
                b = bufs[id(p)]
                b.mul_(0.95).add_(p.grad)
                u = p.grad.add(b, alpha=0.95)
                x_ = u.T if u.shape[0] > u.shape[1] else u
                x_ = x_ / (x_.norm() + 1e-7)
                for _ in range(5):
                    a = x_ @ x_.T
                    x_ = 3.4445 * x_ + (-4.7750 * a + 2.0315 * a @ a) @ x_
                o = x_.T if u.shape[0] > u.shape[1] else x_
                p.mul_(1 - lr * wd)
                p.add_(o * (0.2 * math.sqrt(max(p.shape))), alpha=-lr)
    return losses


STEPS = 3


def test_one_process_muon_is_the_plain_reference():
    """picotron.muon.Muon (one process) against the reference above: every loss and parameter after 3 steps."""
    from picotron.model import Llama, loss_fn
    torch.manual_seed(0)
    mc = Config(preset="tiny").model_config()
    a, b = Llama(mc), Llama(mc)
    a.init_weights(0)
    b.init_weights(0)
    marks.attach(a)
    batches = [(torch.randint(0, mc.vocab_size, (2, 16)), torch.randint(0, mc.vocab_size, (2, 16))) for _ in range(3)]
    want = _plain_muon_reference(b, batches, lr=0.02, wd=0.1, steps=STEPS)
    decay = [p for p in a.parameters() if p.dim() >= 2]
    opt = muon.Muon([{"params": decay, "weight_decay": 0.1},
                     {"params": [p for p in a.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                    muon.Exchange(a), lr=0.02, betas=(0.9, 0.95))
    got = []
    for x, y in batches[:STEPS]:
        a.zero_grad()
        loss = loss_fn(a(x), y)
        loss.backward()
        got.append(loss.item())
        opt.step()
    assert got == pytest.approx(want, rel=1e-6)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    kinds = {n: set(opt.state[p]) for n, p in a.named_parameters()}
    assert kinds["layers.0.self_attn.q_proj.weight"] == {"momentum_buffer"}
    assert kinds["embed_tokens.weight"] == {"step", "exp_avg", "exp_avg_sq"}


# ------------------------------------------------------------------------------- parity with one process
def _full_params(run, mesh, cfg):
    """{name: the whole parameter} after training (ZeRO-3 gathered, tp slices joined; a pipeline's chunks under the
    layers' own names, a tied copy left to stage 0), on tp rank 0 of the first replica (edp: every expert once); {}
    elsewhere."""
    if cfg.zero == 3:
        split = {n: w.split_dim for n, w in marks.records(run.raw).items()}
        held = {n: (p, split[n]) for n, p in run.model.full_parameters().items()}
    else:
        held = {n: (p.detach(), marks.placement(p).split_dim) for chunk in getattr(run.raw, "chunks", [run.raw])
                for n, p in chunk.named_parameters() if marks.placement(p).copy_of is None}
    full = {n: gather_from_tp(p.float(), dim, mesh.tp) for n, (p, dim) in held.items()}
    return full if mesh.tp.rank == 0 and mesh.edp.rank == 0 else {}  # experts: each ep rank its own


def _parity_child(layout, out):
    from picotron.train import train
    cfg = Config(out=out, **{**MUON, **layout})
    with Mesh.init(dp=cfg.dp, pp=cfg.pp, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep, dp_shard=cfg.dp_shard) as mesh:
        _, run = train(cfg, mesh, return_model=True)
        params = _full_params(run, mesh, cfg)
        return (read_metrics(out)[0] if mesh.rank == 0 else None), params


def _assert_parity(layout):
    world = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)
    ref = dict(grad_acc=layout.get("grad_acc", 1) * layout.get("dp", 1), **({"preset": layout["preset"]}
                                                                            if "preset" in layout else {}))
    ref_records, ref_params = single_process(_parity_child, ref)
    results = run_on_ranks(_parity_child, world, layout, tempfile.mkdtemp(prefix="picotron-muon-"), timeout_s=240)
    records = results[0][0]
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in records] == pytest.approx([r[key] for r in ref_records], rel=1e-5), (layout, key)
    assert records[-1]["val_loss"] == pytest.approx(ref_records[-1]["val_loss"], rel=1e-5), layout
    assert records[-1]["loss"] != ref_records[0]["loss"]  # it trained
    seen = set()
    for _, params in results:
        for name, p in params.items():
            # rtol 1e-5; atol 1e-5 for Muon's matrices (an element of a step is ~lr·0.2·sqrt(max(A, B))·|O_ij|, ~4e-3
            # here: the sums' order under dp x tp moves an element by ~1e-6) and 1e-4 for AdamW's tensors: AdamW
            # moves every element by ~lr whatever its gradient's size, so an element whose gradient is ~0 (an unused
            # vocabulary row of the LM head) moves by the rounding of its sum's order; 1e-4 is 1/200 of one step
            hidden = "layers" in name.split(".") and p.dim() == 2
            torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-5 if hidden else 1e-4,
                                       msg=lambda m: f"{layout} {name}: {m}")
            seen.add(name)
    assert seen == set(ref_params), f"{layout}: parameters not compared: {sorted(set(ref_params) - seen)}"


def test_zero1_muon_matches_one_process():
    """The default tier's decisive case: dp=2 ZeRO-1, each matrix's pieces gathered across the flat chunks."""
    _assert_parity(dict(dp=2, zero=1))


@pytest.mark.heavy
@pytest.mark.parametrize("layout", [dict(dp=2), dict(dp=2, zero=2), dict(dp=2, zero=3), dict(tp=2),
                                    dict(dp=2, zero=1, muon_impl="owner"), dict(dp=2, zero=3, muon_impl="owner"),
                                    dict(tp=2, muon_impl="owner"), dict(tp=2, sp=True, muon_impl="owner"),
                                    dict(dp=2, tp=2, zero=1), dict(dp=2, pp=2, grad_acc=2, zero=1),
                                    dict(preset="tiny-moe", dp=2, ep=2, zero=1),
                                    dict(preset="tiny-moe", dp=2, ep=2, zero=1, muon_impl="owner"),
                                    dict(dp=4, dp_shard=2, zero=1), dict(dp=4, dp_shard=2, zero=3, muon_impl="owner")],
                         ids=lambda l: "-".join(f"{k}{v}" for k, v in l.items()))
def test_muon_matches_one_process(layout):
    _assert_parity(layout)


def _bf16_child(out):
    from picotron.train import train
    cfg = Config(out=out, **{**MUON, "dtype": "bf16-params"})
    with Mesh.init() as mesh:
        _, run = train(cfg, mesh, return_model=True)
        masters = {marks.placement(m).master_for: m for m in run.optimizer.masters}
        q = run.raw.layers[0].self_attn.q_proj.weight
        return (q.dtype, set(run.optimizer.state[masters[q]]), torch.equal(q, masters[q].to(q.dtype)),
                [r["loss"] for r in read_metrics(out)[0]])


def test_muon_under_bf16_params_updates_the_fp32_masters(tmp_path):
    """bf16-params: Muon sees the fp32 master copies (precision.MasterWeights), keeps their momentum, and the bf16
    parameters are the masters rounded."""
    dtype, kinds, rounded, losses = run_on_ranks(_bf16_child, 1, str(tmp_path), timeout_s=180)[0]
    assert dtype == torch.bfloat16 and kinds == {"momentum_buffer"} and rounded
    assert losses[-1] < losses[0], losses


# ------------------------------------------------------------------------------------- bytes vs the formula
def _bytes_child(layout):
    """One step with a recorder; the bytes of Muon's exchange alone (the inner optimizer's step) and the formula's
    inputs read from the layout: each unit's (local elements, Muon?, cut over tp?)."""
    cfg = Config(**{**MUON, **layout})
    with Mesh.init(dp=cfg.dp, tp=cfg.tp, dp_shard=cfg.dp_shard) as mesh:
        from picotron import train as train_mod
        _, loader = train_mod.load_data(cfg, mesh)
        recorder = Recorder()
        run = parallelize(cfg, mesh, recorder)
        run.schedule.run(run.model, loader.micro_batches(1), run.loss_fn)
        recorder.reset()
        inner = run.optimizer.optimizer if cfg.zero in (1, 2) else run.optimizer
        inner.step()
        ex = inner.exchange
        desc = lambda p: (p.numel(), id(p) in ex.muon_ids, ex._tp_cut(p))  # noqa: E731
        units = [[desc(p) for p in u.params] for u in run.model.units] if cfg.zero else \
            [[desc(p) for p in run.raw.parameters()]]
        n = run.model.units[0].axis.size if cfg.zero else 1
        rank = run.model.units[0].axis.rank if cfg.zero else mesh.tp.rank
        want = planner.muon_bytes_per_step(cfg.muon_impl, units, n=n, tp=mesh.tp.size, rank=rank)
        return dict(recorder.bytes), want["buffers"]


@pytest.mark.heavy
@pytest.mark.parametrize("layout", [dict(dp=2, zero=1), dict(dp=2, zero=1, muon_impl="owner"),
                                    dict(dp=2, zero=3, muon_impl="owner"), dict(tp=2), dict(tp=2, muon_impl="owner"),
                                    dict(dp=2, tp=2, zero=1), dict(dp=4, dp_shard=2, zero=1, muon_impl="owner")],
                         ids=lambda l: "-".join(f"{k}{v}" for k, v in l.items()))
def test_exchange_bytes_equal_the_formula(layout):
    world = layout.get("dp", 1) * layout.get("tp", 1)
    for measured, formula in run_on_ranks(_bytes_child, world, layout, timeout_s=240):
        assert measured == pytest.approx(formula), layout
        assert measured, layout  # something was exchanged


def test_formula_gather_and_owner_on_a_small_case():
    """Two units of 10 elements over n = 2 (chunks of 5): a 6-element matrix and a 4-element norm, then an 8 and a 2."""
    units = [[(6, True, False), (4, False, False)], [(8, True, False), (2, False, False)]]
    g = planner.muon_bytes_per_step("gather", units, n=2)
    assert g["buffers"] == {"all_gather": 2 * 10 * 4} and g["sent"] == 2 * 5 * 4
    # owner: sizes [6, 8] -> the 8 to rank 0, the 6 to rank 1; rank 0 holds 5 of the 6 and 5 of the 8
    o0 = planner.muon_bytes_per_step("owner", units, n=2, rank=0)
    assert o0["buffers"] == {"all_to_all": (10 + 8) * 4} and o0["sent"] == (5 + 3) * 4
    o1 = planner.muon_bytes_per_step("owner", units, n=2, rank=1)  # rank 1 holds 1 of the 6 and 3 of the 8
    assert o1["buffers"] == {"all_to_all": (4 + 6) * 4} and o1["sent"] == (3 + 5) * 4


# ------------------------------------------------------------------------------------------- NCCL's rules
def _train_child(layout, out):
    from picotron.train import train
    cfg = Config(out=out, **{**MUON, **layout})
    with Mesh.init(dp=cfg.dp, pp=cfg.pp, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep, dp_shard=cfg.dp_shard) as mesh:
        train(cfg, mesh)


def _replayed(tmp_path, layout, world):
    results = run_on_ranks(nccl_rules.run_recorded, world, _train_child, layout, str(tmp_path / "run"),
                           timeout_s=120 + 30 * world)
    verdict = nccl_rules.replay([trace for _, trace in results])
    assert verdict.ok, f"{layout}: {verdict}"
    return verdict


@pytest.mark.heavy
@pytest.mark.parametrize("layout", [dict(dp=2, zero=1), dict(dp=2, zero=1, muon_impl="owner"),
                                    dict(dp=2, tp=2, zero=1), dict(dp=2, tp=2, muon_impl="owner"),
                                    dict(dp=2, zero=3, muon_impl="owner"),
                                    dict(preset="tiny-moe", dp=4, ep=2, zero=1, muon_impl="owner"),
                                    dict(dp=4, dp_shard=2, zero=1, muon_impl="owner")],
                         ids=lambda l: "-".join(f"{k}{v}" for k, v in l.items()))
def test_muon_exchange_obeys_nccl_rules(tmp_path, layout):
    _replayed(tmp_path, layout, layout.get("dp", 1) * layout.get("tp", 1))


# ------------------------------------------------------------------------------------------------ resume
def _resume_child(layout, out, steps, save_every=0, resume=False):
    from picotron.train import train
    cfg = Config(out=out, **{**MUON, **layout, "steps": steps, "save_every": save_every, "resume": resume})
    with Mesh.init(dp=cfg.dp, tp=cfg.tp) as mesh:
        train(cfg, mesh)
        return read_metrics(out)[0] if mesh.rank == 0 else None


@pytest.mark.heavy
def test_muon_resume_is_bit_for_bit(tmp_path):
    """dp2 + ZeRO-2 with Muon: the momentum pieces are saved and loaded like Adam's moments, so the resumed losses
    equal the uninterrupted run's exactly."""
    from tests.test_checkpoint import rewind
    layout = dict(dp=2, zero=2)
    ref = run_on_ranks(_resume_child, 2, layout, str(tmp_path / "ref"), 4, timeout_s=240)[0]
    cut = str(tmp_path / "cut")
    run_on_ranks(_resume_child, 2, layout, cut, 4, 2, timeout_s=240)
    rewind(cut, 2)
    resumed = run_on_ranks(_resume_child, 2, layout, cut, 4, 0, True, timeout_s=240)[0]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in ref]


def _reshard_child(layout, src, out):
    """Build `layout` with Muon, load the checkpoint `src` (written at another layout), save it again here."""
    from picotron import checkpoint, reshard
    cfg = Config(out=out, **{**MUON, **layout})
    with Mesh.init(dp=cfg.dp, tp=cfg.tp) as mesh:
        run = parallelize(cfg, mesh)
        step = reshard.load(src, run, mesh)
        saver = checkpoint.Saver(out, cfg, mesh)
        saver.save(step, run)
        saver.close()


@pytest.mark.heavy
def test_muon_state_reshards_like_adams(tmp_path):
    """Written at dp2 + ZeRO-2 (flat pieces), loaded at tp=2 (slices) and saved again: the consolidated model, the
    momentum of every Muon matrix and AdamW's moments are the same tensors."""
    from picotron import checkpoint, reshard
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run_on_ranks(_resume_child, 2, dict(dp=2, zero=2), a, 2, 2, timeout_s=240)
    run_on_ranks(_reshard_child, 2, dict(tp=2), checkpoint.latest(a), b, timeout_s=240)
    x, y = reshard.consolidate(checkpoint.latest(a)), reshard.consolidate(checkpoint.latest(b))
    assert set(x["optimizer"]["layers.0.self_attn.q_proj.weight"]) == {"momentum_buffer"}
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(x["optimizer"]["embed_tokens.weight"])
    assert set(x["params"]) == set(y["params"]) and set(x["optimizer"]) == set(y["optimizer"])
    for name, value in x["params"].items():
        assert torch.equal(value, y["params"][name]), name
    for name, kinds in x["optimizer"].items():
        assert set(kinds) == set(y["optimizer"][name]), name
        for k, v in kinds.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(y["optimizer"][name][k])), (name, k)


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("settings, says", [
    (dict(optimizer="muon", muon_impl="owner", dp=2, tp=2, zero=1), "cut over tp and ZeRO both"),
    (dict(muon_impl="owner"), "but the optimizer is 'adamw'; add --optimizer muon"),
    (dict(optimizer="muon", muon_momentum=1.0), "muon_momentum=1.0 must lie in [0, 1)"),
])
def test_refusals_are_one_sentence(settings, says):
    cfg = Config(**settings)
    with pytest.raises(ConfigError, match=None) as e:
        validate(cfg, any_world_size=True)
    assert says in str(e.value), str(e.value)
