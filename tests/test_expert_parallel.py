"""Mixture of experts and expert parallelism.

The MoE model: its logits equal transformers' MixtralForCausalLM on the same weights (fp32), both ways through the
Hugging Face files; its aux loss equals HF's load_balancing_loss_func; Mixtral-8x7B's parameter count is the
published one; capacity drops exactly the choices beyond ceil(c·s·k/E) per sequence.

On real processes: dispatch then combine is the identity on token ids (no row lost or duplicated); the MoE layer at
ep = 2 and 4 equals all experts on one process, forward and backward; the whole model per the parity standard (same
seed, same global batch, fp32; per-step loss and gradient norm within 1e-5 relative; every gradient, experts gathered
from the ranks that hold them) at ep = 2 and 4, ep2 x tp2 (+ sp), ep2 with ZeRO-1, ep2 x pp2; a negative test
(expert gradients divided by their own group's size instead of dp) that the parity check catches.

DeepSeek-V3's router (sigmoid scores, a routing bias for the choice only, shared and fine-grained experts): the router
and the bias update by hand; the parity standard at ep 2 (ep 4, ep2 x tp2, ep2 x pp2: heavy) with the routing biases
after 3 steps equal to the one process's, bit for bit, on every rank; experts with cp (softmax router with the aux
loss at cp 2; DeepSeek's at dp2 x cp2 x ep2); a resume whose routing biases come back from the checkpoint.
"""
import pytest
import torch
from _parity import assert_matches, layout_grads
from _reference import PARITY, single_process

from picotron import expert_parallel, moe, nccl_rules
from picotron.checkpoint import canonical
from picotron import train as train_mod
from picotron.config import Config, ConfigError
from picotron.launch import run_on_ranks
from picotron.mesh import Mesh, expert_groups
from picotron.metrics import read_metrics
from picotron.model import Llama, ModelConfig
from picotron.parallelize import parallelize, validate
from picotron.train import train


DEEPSEEK = dict(num_local_experts=8, num_experts_per_tok=3, router_aux_loss_coef=0.0, scoring_func="sigmoid",
                n_shared_experts=1, moe_intermediate_size=96, bias_update_speed=0.05)


def _model(layers=2, **kw):
    mc = ModelConfig.from_preset("tiny-moe", num_hidden_layers=layers, **kw)
    model = Llama(mc).init_weights(0)
    with torch.no_grad():  # a router that prefers some experts: uneven counts, dispatch sizes that vary
        for i, layer in enumerate(model.layers):
            layer.block_sparse_moe.gate.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(i))
    return model


# ------------------------------------------------------------------------------------------ the model alone
def test_mixtral_logits_equal_transformers_both_ways(tmp_path):
    from transformers import MixtralForCausalLM  # in requirements.txt: a missing package must fail, not skip

    ours = _model().eval()
    ours.save_hf(tmp_path / "ours")
    hf = MixtralForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(ours(ids), want, rtol=1e-5, atol=1e-5)
        hf.save_pretrained(tmp_path / "theirs")
        torch.testing.assert_close(Llama.from_hf(tmp_path / "theirs")(ids), want, rtol=1e-5, atol=1e-5)


def test_aux_loss_is_hf_load_balancing_loss_for_one_layer():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) * 2
    _, experts, probs = moe.route(logits, 2)
    ours = moe.aux_loss(probs, experts, 8)
    assert ours.item() == pytest.approx(load_balancing_loss_func((logits,), 8, 2).item(), rel=1e-6)
    # every expert equally likely and equally chosen: aux = k
    assert moe.aux_loss(torch.full((8, 8), 1 / 8), torch.arange(16).view(8, 2) % 8, 8).item() == pytest.approx(2.0)


def test_mixtral_8x7b_parameters_are_the_published_ones():
    mc = ModelConfig.from_preset("mixtral-8x7b")
    assert round(mc.num_params() / 1e9, 1) == 46.7  # "Mixtral of Experts": 46.7B total
    assert round(mc.num_params(active=True) / 1e9, 1) == 12.9  # 12.9B active per token
    with torch.device("meta"):
        assert Llama(ModelConfig.from_preset("tiny-moe")).num_params() == ModelConfig.from_preset("tiny-moe").num_params()


def test_capacity_drops_the_choices_beyond_the_limit_in_token_order():
    experts = torch.tensor([[0, 1], [0, 1], [0, 2], [3, 0]])  # one sequence of 4 tokens, k = 2, E = 4
    keep = moe.capacity_keep(experts, seq_len=4, num_experts=4, capacity_factor=1.0)  # capacity ceil(4·2/4) = 2
    assert keep.tolist() == [True, True, True, True, False, True, True, False]  # expert 0's 3rd and 4th choice
    assert moe.capacity_keep(experts, 4, 4, 0.0).all()
    model = _model(capacity_factor=0.5)
    model(torch.randint(0, 256, (2, 16)))
    assert sum(layer.block_sparse_moe.dropped for layer in model.layers) > 0


def test_aux_loss_reaches_the_router_as_if_added_to_the_loss():
    """The gradient with aux_weight w equals the gradient of (output + w·aux), aux taken from the same forward."""
    model = _model(layers=1)
    block = model.layers[0].block_sparse_moe
    x = torch.randn(2, 16, 128, generator=torch.Generator().manual_seed(1))
    block.aux_weight = 0.0
    y = block(x)
    _, experts, probs = moe.route(block.gate(x.view(-1, 128)), block.k)
    (y.sum() + 0.3 * moe.aux_loss(probs, experts, block.num_experts)).backward()
    want = block.gate.weight.grad.clone()
    block.zero_grad()
    block.aux_weight = 0.3
    block(x).sum().backward()
    torch.testing.assert_close(block.gate.weight.grad, want, rtol=1e-6, atol=1e-7)
    assert block.last_aux.item() == pytest.approx(moe.aux_loss(probs, experts, 4).item())


def test_deepseek_router_chooses_by_score_plus_bias_and_gates_without_it():
    """DeepSeek-V3 eq. 13-16: the bias moves the choice only; gates = the chosen sigmoids normalised, times the scale."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.9])  # sigmoid: .88 .73 .50 .27; +bias: expert 3 (1.17) beats expert 0
    w, e, probs = moe.route(logits, 2, "sigmoid", bias, scale=2.5)
    s = torch.sigmoid(logits)[0]
    assert sorted(e[0].tolist()) == [0, 3]
    want = {i: (s[i] / (s[0] + s[3]) * 2.5).item() for i in (0, 3)}
    assert {int(i): v for i, v in zip(e[0], w[0].tolist())} == pytest.approx(want, rel=1e-6)
    torch.testing.assert_close(probs[0], s / s.sum())
    w0, e0, _ = moe.route(logits, 2, "sigmoid")  # without the bias: the two largest sigmoids
    assert sorted(e0[0].tolist()) == [0, 1] and w0.sum().item() == pytest.approx(1.0)


def test_bias_update_moves_each_expert_by_gamma_against_its_load():
    block = _model(layers=1, **DEEPSEEK).layers[0].block_sparse_moe
    assert "e_score_correction_bias" not in block.state_dict()  # a buffer, not a weight: no gradient, no optimizer
    assert not any("bias" in n for n, _ in block.named_parameters())
    moe.update_bias(block, torch.tensor([10, 4, 6, 6, 2, 12, 0, 8]))  # mean 6
    assert block.e_score_correction_bias.tolist() == pytest.approx([-0.05, 0.05, 0, 0, 0.05, -0.05, 0.05, -0.05])


def test_deepseek_shapes_and_config_round_trip():
    mc = ModelConfig.from_preset("tiny-deepseek-moe")
    with torch.device("meta"):
        model = Llama(mc)
    assert model.num_params() == mc.num_params()  # shared + fine-grained experts counted
    block = model.layers[0].block_sparse_moe
    assert block.experts["0"].w1.out_features == 96 and block.shared_experts.w1.out_features == 96
    d = mc.to_dict()
    assert d["scoring_func"] == "sigmoid" and d["topk_method"] == "noaux_tc" and d["n_shared_experts"] == 1
    assert ModelConfig.from_hf_dict(d) == mc
    assert "scoring_func" not in ModelConfig.from_preset("tiny-moe").to_dict()  # Mixtral's config.json unchanged


# --------------------------------------------------------------------------------------- on real processes
def _layer_child(ep, seed):
    """The MoE layer at ep ranks (each with its own tokens) against all experts on this process."""
    with Mesh.init(dp=torch.distributed.get_world_size(), ep=ep) as mesh:
        full = _model(layers=1).layers[0].block_sparse_moe
        full.aux_weight = 0.5
        mine = expert_parallel.apply(_model(layers=1), mesh.ep).layers[0].block_sparse_moe  # this rank's experts
        mine.aux_weight = 0.5
        g = torch.Generator().manual_seed(seed + mesh.rank)
        x = torch.randn(2, 12, 128, generator=g)
        dy = torch.randn(2, 12, 128, generator=g)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_full, y_mine = full(x1), mine(x2)
        y_full.backward(dy)
        y_mine.backward(dy)
        grads = {n: p.grad for n, p in mine.named_parameters()}
        want = {n: p.grad for n, p in full.named_parameters()}
        return y_mine.detach(), y_full.detach(), x2.grad, x1.grad, grads, want, dict(mine.exchange.rows)


@pytest.mark.parametrize("ep", [2, 4])
def test_moe_layer_equals_all_experts_on_one_process(ep):
    """Forward and input gradient on every rank; expert gradients summed over the ranks that sent tokens equal the
    sum of the single-process gradients over the same tokens; router gradient per rank."""
    results = run_on_ranks(_layer_child, ep, ep, 0, timeout_s=120)
    for rank, (y, y_ref, dx, dx_ref, grads, ref, _) in enumerate(results):
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} output: {m}")
        torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} input grad: {m}")
        torch.testing.assert_close(grads["gate.weight"], ref["gate.weight"], rtol=1e-5, atol=1e-6)
    total = {}  # each expert's gradient lives on one rank and holds every rank's tokens: the sum of the references
    for *_, ref, _ in results:
        for n, g in ref.items():
            total[n] = total.get(n, 0) + g
    for rank, (*_, grads, _, _) in enumerate(results):
        for n, g in grads.items():
            if ".experts." in n:
                torch.testing.assert_close(g, total[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {n}: {m}")


def _round_trip_child(ep):
    """Token ids as the rows: dispatch + combine with identity experts gives every row back, each expert receives
    exactly the ids that chose it."""
    with Mesh.init(dp=ep, ep=ep) as mesh:
        E, k, n = 8, 2, 20
        ex = expert_parallel.Exchange(mesh.ep, E)
        g = torch.Generator().manual_seed(mesh.rank)
        chosen = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
        ids = (mesh.rank * 1000 + torch.arange(n)).double()
        order = torch.argsort(chosen.flatten(), stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=E)
        rows = torch.stack([ids[order // k], chosen.flatten()[order].double()], 1)
        got, local_counts, ctx = ex.dispatch(rows, counts)
        mine = range(mesh.ep.rank * E // ep, (mesh.ep.rank + 1) * E // ep)
        ok_experts = torch.equal(got[:, 1], torch.cat([torch.full((int(c),), float(e)) for e, c in zip(mine, local_counts)]))
        back = ex.combine(got, ctx)
        return torch.equal(back, rows), ok_experts, got[:, 0].tolist(), len(order)


@pytest.mark.parametrize("ep", [2, 4])
def test_dispatch_and_combine_lose_and_duplicate_nothing(ep):
    results = run_on_ranks(_round_trip_child, ep, ep)
    assert all(r[0] for r in results), "combine(dispatch(rows)) != rows"
    assert all(r[1] for r in results), "a row reached a rank that does not hold its expert, or out of expert order"
    received = sorted(i for r in results for i in r[2])
    sent = sorted(float(rank * 1000 + t) for rank in range(ep) for t in range(20) for _ in range(2))
    assert received == sent  # every (token, choice) row arrived exactly once


def test_expert_groups():
    assert expert_groups((4, 1, 1, 1), 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert expert_groups((4, 1, 1, 2), 2) == ([[0, 2], [1, 3], [4, 6], [5, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
    assert expert_groups((2, 1, 2, 1), 2) == ([[0, 2], [1, 3]], [[0, 1], [2, 3]])


# ------------------------------------------------------------------------------------------ the whole model
SMALL = dict(PARITY, preset="tiny-moe")


def _model_child(layout, out, wrong_divisor=False):
    cfg = Config(out=out, **{**SMALL, **layout})
    with Mesh.init(dp=cfg.dp, pp=cfg.pp, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep) as mesh:
        _, loader = train_mod.load_data(cfg, mesh)
        run = parallelize(cfg, mesh)
        run.schedule.run(run.model, loader.micro_batches(1), run.loss_fn)
        if wrong_divisor:  # the trap: each expert's gradient averaged over its own replicas (edp), not over dp x cp
            for name, p in run.raw.named_parameters():
                if ".experts." in name:
                    p.grad.mul_(mesh.dp_cp.size / mesh.edp.size)
        grads = layout_grads(run, mesh, cfg)
        mesh.world.all_reduce(torch.zeros(1))
    if wrong_divisor:
        return grads, None, None
    with Mesh.init(dp=cfg.dp, pp=cfg.pp, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep) as mesh:
        summary, run = train(cfg, mesh, return_model=True)
        records = read_metrics(out)[0] if mesh.rank == 0 else None
    bias = {canonical(n): b.tolist() for n, b in run.raw.named_buffers()}  # DeepSeek's routing bias after training
    return grads, records, dict(summary, bias=bias)


def _reference(layout):
    parallel = ("dp", "ep", "tp", "sp", "pp", "pp_schedule", "pp_chunks", "zero", "grad_acc", "cp", "ep_overlap")
    ref = {"grad_acc": layout.get("grad_acc", 1) * layout.get("dp", 1),
           **{k: v for k, v in layout.items() if k not in parallel}}  # the model's own settings (capacity, ...)
    return single_process(_model_child, ref, timeout_s=120)  # once per settings in the session (tests/_reference.py)


def _check(tmp_path, layout, replay=False):
    """The parity standard for `layout`; replay=True: each rank's communication is also recorded and replayed under
    NCCL's rules (picotron.nccl_rules, as tests/test_nccl_rules.py does for its layouts)."""
    world = layout.get("dp", 1) * layout.get("pp", 1) * layout.get("tp", 1) * layout.get("cp", 1)
    if replay:
        recorded = run_on_ranks(nccl_rules.run_recorded, world, _model_child, layout, str(tmp_path / "ep"),
                                timeout_s=300)
        results = [out for out, _ in recorded]
        verdict = nccl_rules.replay([trace for _, trace in recorded])
        assert verdict.ok, f"{layout}: {verdict}"
    else:
        results = run_on_ranks(_model_child, world, layout, str(tmp_path / "ep"), timeout_s=300)
    reference = _reference(layout)
    assert_matches(results, reference, layout)
    return results, reference


@pytest.mark.parametrize("layout", [
    dict(dp=2, ep=2),  # ep = dp: every expert on one rank (edp = 1), its gradient still divided by dp
    dict(dp=4, ep=4),
    dict(dp=4, ep=2),  # experts replicated over edp = 2: summed there
    dict(dp=2, ep=2, tp=2),
    dict(dp=2, ep=2, tp=2, sp=True),
    dict(dp=2, ep=2, zero=1),
    dict(dp=4, ep=2, zero=2),  # expert units cut over edp = 2, dense units over dp = 4
    dict(dp=2, ep=2, pp=2, grad_acc=2),
    dict(dp=2, ep=2, pp=2, grad_acc=2, pp_schedule="zb-v"),  # a split backward: experts' weight gradients deferred
    dict(dp=2, ep=2, capacity_factor=1.0),
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_whole_model_matches_one_process(tmp_path, layout):
    _check(tmp_path, layout)


# DeepSeek-V3 routing: sigmoid scores, 1 shared + 8 fine-grained experts, top-3; γ = 0.05 (not 0.001) so that the
# bias changes choices within the 3 steps; and the aux loss on too (DeepSeek-V3's complementary one, weight 0.01)
DS = dict(preset="tiny-deepseek-moe", bias_update_speed=0.05, aux_loss_coef=0.01)


@pytest.mark.parametrize("layout", [
    dict(dp=2, ep=2, **DS),
    pytest.param(dict(dp=4, ep=4, **DS), marks=pytest.mark.heavy),
    pytest.param(dict(dp=2, ep=2, tp=2, **DS), marks=pytest.mark.heavy),  # shared expert cut like the others
    pytest.param(dict(dp=2, ep=2, pp=2, grad_acc=2, **DS), marks=pytest.mark.heavy),  # each stage its own layers' bias
    dict(cp=2),  # experts with cp: softmax router, the aux loss's statistics summed over the sequence's ranks
    pytest.param(dict(cp=2, **DS), marks=pytest.mark.heavy),
    dict(dp=2, cp=2, ep=2, **DS),  # cp with ep and DeepSeek's router: the bias's loads over dp x cp
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items() if k not in ("preset", "aux_loss_coef")))
def test_deepseek_routing_and_experts_with_cp_match_one_process(tmp_path, layout):
    """The parity standard, and the routing biases after 3 steps equal the one process's on every rank (their
    loads are counted over the whole step's tokens: every replica moves them alike), and moved. Every rank's
    communication (the routing statistics' all-reduce over cp among it) replayed under NCCL's rules."""
    results, (_, _, ref) = _check(tmp_path, layout, replay=True)
    for rank, (*_, summary) in enumerate(results):
        assert summary["bias"] == {n: ref["bias"][n] for n in summary["bias"]}, f"rank {rank}: routing bias differs"
    assert set().union(*(r[2]["bias"] for r in results)) == set(ref["bias"])
    if "bias_update_speed" in layout:
        assert ref["bias"] and all(any(v != 0 for v in b) for b in ref["bias"].values())


def _resume_child(out, steps, resume):
    cfg = Config(out=out, dp=2, ep=2, save_every=2, resume=resume, **{**SMALL, **DS, "steps": steps, "eval_every": 0})
    with Mesh.init(dp=2, ep=2) as mesh:
        train(cfg, mesh)
        return [r["loss"] for r in read_metrics(out)[0]] if mesh.rank == 0 else None


def test_checkpoint_resumes_exactly(tmp_path):
    """Each rank saves its own experts (and the routing biases: DeepSeek's router, whose choices depend on them); a
    resumed run continues with the uninterrupted run's losses, bit for bit."""
    whole = run_on_ranks(_resume_child, 2, str(tmp_path / "a"), 4, False, timeout_s=180)[0]
    run_on_ranks(_resume_child, 2, str(tmp_path / "b"), 2, False, timeout_s=180)
    resumed = run_on_ranks(_resume_child, 2, str(tmp_path / "b"), 4, True, timeout_s=180)[0]
    assert resumed == whole


def test_export_refuses_deepseek_routing(tmp_path, monkeypatch):
    """transformers' Mixtral would load the files and route by softmax without the shared experts: one sentence
    (before any tensor is read: the checkpoint's config is enough)."""
    from picotron import export

    monkeypatch.setattr(export, "folder_of", lambda path: path)
    monkeypatch.setattr(export.reshard, "consolidate", lambda folder: {"config": Config(**DS).to_dict()})
    with pytest.raises(ValueError, match=r"DeepSeek-V3's routing fields \(scoring_func='sigmoid', n_shared_experts=1"):
        export.export(str(tmp_path / "run"), str(tmp_path / "hf"))


def test_the_parity_check_catches_expert_gradients_divided_by_their_own_group():
    grads = run_on_ranks(_model_child, 2, dict(dp=2, ep=2), str(tmp_dir := __import__("tempfile").mkdtemp()), True,
                         timeout_s=120)
    ref = _reference(dict(dp=2))[0]
    worst = max(((g[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for g, _, _ in grads for n in g
                if ".experts." in n)
    assert worst > 0.5, worst


def test_bad_settings_get_one_sentence():
    def error(**kw):
        with pytest.raises(ConfigError) as e:
            validate(Config(**kw), any_world_size=True)
        return str(e.value)
    assert error(dp=4, ep=3, preset="tiny-moe").startswith("ep=3 does not divide dp=4")
    assert error(dp=2, ep=2).startswith("ep=2 needs a model with experts")
    assert error(dp=8, ep=8, preset="tiny-moe").startswith("ep=8 does not divide the 4 experts (")
    assert error(dp=8, ep=8, preset="tiny-moe").endswith("so ep must divide both); pick ep in {1, 2, 4}.")
    # the rule names every number it depends on: with dp=3 and 4 experts only ep=1 fits, and it says so
    assert error(dp=3, ep=3, preset="tiny-moe").endswith(
        "dp=3 data-parallel ranks and each holds an equal share of the 4 experts, so ep must divide both); pick ep in "
        "{1} (with dp=3 only ep=1 fits; e.g. --dp 4 --ep 4 puts the experts on 4 ranks).")
    assert error(preset="tiny-moe", top_k=5).startswith("top_k=5 is more than the 4 experts")
    assert error(preset="tiny-moe", cp=2, capacity_factor=1.0).startswith(
        "capacity_factor=1.0 with cp=2 is not supported (an expert's capacity fills in token order")
    assert error(preset="tiny-deepseek-moe", routed_scaling=0.0).startswith("routed_scaling_factor=0.0 must be positive")
    assert error(preset="tiny-moe", router="cosine").startswith("router='cosine' is not one of the known values")
    validate(Config(preset="tiny-deepseek-moe", cp=2, dp=2, ep=2), any_world_size=True)
    assert "zero=3" in error(preset="tiny-moe", dp=2, zero=3)
    assert error(preset="tiny-moe", capacity_factor=-1.0).startswith("capacity_factor=-1.0 must not be negative")
    validate(Config(preset="tiny", experts=4, dp=4, ep=4, tp=2), any_world_size=True)
