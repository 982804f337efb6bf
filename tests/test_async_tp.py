"""Async tensor parallelism (picotron/async_tp.py, --async-tp): the ring's order, the two collective matmuls against
the blocking collectives they replace (forward and backward), the whole model against one process (the parity
standard, tests/_parity.py) with its communication replayed under NCCL's rules (picotron.nccl_rules: the
per-communicator model and the one-order-across-communicators model), and the refusals.

Default tier: the pure ring orders, the two functions on 2 and 3 ranks, tp2·sp against one process, the planner's
formula and time model, the refusals. Heavy: tp 4, dp 2 × tp 2 (ZeRO-1, ZeRO-3), pp 2 × tp 2 (1F1B, interleaved),
full recompute, the MoE model (its attention overlapped, its experts blocking), cp 2 × tp 2, bf16, and
dp 2 × pp 2 × tp 2 (8 processes), and the split (zero-bubble) schedules ZB-H1, ZB-V and DualPipe, whose weight
gradients the collective matmuls hand to the schedule's store."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _parity import SMALL, assert_matches, model_child

from picotron import nccl_rules
from picotron.async_tp import all_gather_matmul, matmul_reduce_scatter, reduce_scatter_order, ring_order
from picotron.config import Config, ConfigError
from picotron.launch import run_on_ranks
from picotron.mesh import Mesh
from picotron.metrics import read_metrics
from picotron.parallelize import validate
from picotron.tensor_parallel import GatherSequence, ReduceScatterSequence
from picotron.train import train



# ------------------------------------------------------------------------------------------ the ring's order
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_orders_visit_every_chunk_once_and_agree_between_neighbours(n):
    for r in range(n):
        steps = ring_order(r, n)
        assert sorted(c for _, c, _, _ in steps) == list(range(n)) and steps[0][1] == r  # starts with its own
        assert all(to == (r + 1) % n and frm == (r - 1) % n for i, _, to, frm in steps[:-1])
        assert steps[-1][2:] == (None, None)  # the last chunk is multiplied, not passed on
        for i, c, _, _ in steps[1:]:  # what r multiplies at step i is what its left neighbour held at step i-1
            assert c == ring_order((r - 1) % n, n)[i - 1][1]
        rs = reduce_scatter_order(r, n)
        assert sorted(c for _, c in rs) == list(range(n)) and rs[-1][1] == r  # ends with its own chunk, complete
        for i, c in rs[1:]:  # the running sum received at step i is the left neighbour's step i-1 chunk
            assert c == reduce_scatter_order((r - 1) % n, n)[i - 1][1]


# --------------------------------------------------------------------- the two functions, against blocking
def _functions_child():
    """all_gather_matmul against all-gather + matmuls, matmul_reduce_scatter against matmul + reduce-scatter, values
    and every gradient, on this process's tp ranks (the whole world)."""
    with Mesh.init(tp=dist.get_world_size()) as mesh:
        axis, n, r = mesh.tp, mesh.tp.size, mesh.tp.rank
        g = torch.Generator().manual_seed(0)
        b, s, h, o = 2, 4 * n, 8, 6
        x_all = torch.randn(b, s, h, generator=g)
        ws = [torch.randn(o + k, h, generator=g) for k in range(3)]
        dys = [torch.randn(b, s, o + k, generator=g) for k in range(3)]
        mine = x_all[:, r * s // n:(r + 1) * s // n]

        def run(overlapped):
            x = mine.clone().requires_grad_()
            w = [t.clone().requires_grad_() for t in ws]
            if overlapped:
                full, ys = all_gather_matmul(x, axis, w)
            else:
                full = GatherSequence.apply(x, axis)
                ys = [F.linear(full, t) for t in w]
            sum((y * d).sum() for y, d in zip(ys, dys)).backward()
            return [full.detach(), *[y.detach() for y in ys], x.grad, *[t.grad for t in w]]

        for got, want in zip(run(True), run(False)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(run(True)[0], x_all)  # the gathered input, rank 0's tokens first

        w_row = torch.randn(h, o, generator=g)  # rows: this rank's o input features of the full n·o
        x_row = torch.randn(b, s, o, generator=g) + r
        dy = torch.randn(b, s // n, h, generator=g) + r

        def run_row(overlapped):
            x, w = x_row.clone().requires_grad_(), w_row.clone().requires_grad_()
            y = (matmul_reduce_scatter(x, w, axis) if overlapped
                 else ReduceScatterSequence.apply(F.linear(x, w), axis))
            (y * dy).sum().backward()
            return [y.detach(), x.grad, w.grad]

        for got, want in zip(run_row(True), run_row(False)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    return True


@pytest.mark.parametrize("n", [2, 3])
def test_collective_matmuls_match_the_blocking_collectives(n):
    assert run_on_ranks(_functions_child, n, timeout_s=120) == [True] * n


# ------------------------------------------------------------------- the whole model, with NCCL's replay
_model_child = model_child  # tests/_parity.py: one step's gradients, then the 3-step run


_REFERENCES = {}


def _reference(layout, tmp_path):
    """The single process on the layout's global batch (dp · grad_acc micro-batches), once per settings."""
    keep = {k: v for k, v in layout.items() if k in ("preset", "recompute", "dtype")}
    ref = dict(keep, grad_acc=layout.get("dp", 1) * layout.get("grad_acc", 1))
    key = tuple(sorted(ref.items()))
    if key not in _REFERENCES:
        _REFERENCES[key] = run_on_ranks(_model_child, 1, ref, str(tmp_path / "reference"), timeout_s=180)[0]
    return _REFERENCES[key]


LAYOUTS = [dict(tp=2),
           pytest.param(dict(tp=4), marks=pytest.mark.heavy),
           pytest.param(dict(dp=2, tp=2, zero=1), marks=pytest.mark.heavy),
           pytest.param(dict(pp=2, tp=2, grad_acc=2), marks=pytest.mark.heavy),
           pytest.param(dict(pp=2, tp=2, grad_acc=4, pp_schedule="interleaved", pp_chunks=2),
                        marks=pytest.mark.heavy),
           pytest.param(dict(tp=2, recompute="full"), marks=pytest.mark.heavy),
           pytest.param(dict(tp=2, preset="tiny-moe"), marks=pytest.mark.heavy),
           pytest.param(dict(dp=2, tp=2, zero=3), marks=pytest.mark.heavy),
           pytest.param(dict(dp=2, pp=2, tp=2, grad_acc=2, zero=1), marks=pytest.mark.heavy),
           pytest.param(dict(cp=2, tp=2), marks=pytest.mark.heavy),
           pytest.param(dict(pp=2, tp=2, grad_acc=4, pp_schedule="zb-h1"), marks=pytest.mark.heavy),
           pytest.param(dict(pp=2, tp=2, grad_acc=4, pp_schedule="zb-v"), marks=pytest.mark.heavy),
           pytest.param(dict(dp=2, pp=2, tp=2, grad_acc=4, pp_schedule="dualpipe"), marks=pytest.mark.heavy)]


def _name(layout):
    return "-".join(f"{k}{v}" for k, v in layout.items())


@pytest.mark.parametrize("layout", LAYOUTS, ids=_name)
def test_async_tp_matches_one_process_and_obeys_nccl_rules(tmp_path, layout):
    full = dict(layout, sp=True, async_tp=True)
    world = full.get("dp", 1) * full.get("pp", 1) * full.get("cp", 1) * full["tp"]
    ref = _reference(full, tmp_path)
    recorded = run_on_ranks(nccl_rules.run_recorded, world, _model_child, full, str(tmp_path / "run"),
                            timeout_s=120 + 30 * world)
    results = [r for r, _ in recorded]
    assert_matches(results, ref, _name(full))
    verdict = nccl_rules.replay([trace for _, trace in recorded])  # both models: per communicator, one order
    assert verdict.ok, f"{_name(full)}: {verdict}"
    sends = [e for _, trace in recorded for e in trace["events"] if e.get("op") == "isend" and e.get("batch")]
    assert sends, "the async-TP ring posted no batched send: the collective matmul did not run"


def test_bf16_runs_with_async_tp(tmp_path):
    """bf16 autocast goes through the ring's matmuls (losses close to blocking sp's, not equal: other roundings)."""
    base = dict(SMALL, tp=2, sp=True, dtype="bf16", steps=2, eval_every=2)

    def losses(extra, name):
        out = str(tmp_path / name)
        run_on_ranks(_bf16_child, 2, dict(base, **extra), out, timeout_s=180)
        return [r["loss"] for r in read_metrics(out)[0]]

    assert losses({"async_tp": True}, "async") == pytest.approx(losses({}, "blocking"), rel=2e-2)


def _bf16_child(settings, out):
    cfg = Config(out=out, **settings)
    with Mesh.init(tp=cfg.tp) as mesh:
        train(cfg, mesh)


test_bf16_runs_with_async_tp = pytest.mark.heavy(test_bf16_runs_with_async_tp)


# ------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("settings,words", [
    (dict(tp=2, sp=True, async_tp=True, dtype="fp8"), "dtype='fp8'"),
    (dict(tp=2, async_tp=True), "add --sp"),
    (dict(async_tp=True), "tp=1"),
])
def test_async_tp_refusals_are_one_sentence(settings, words):
    with pytest.raises(ConfigError, match="async-tp") as err:
        validate(Config(**settings), any_world_size=True)
    assert words in str(err.value) and str(err.value).count(". ") <= 1


# ---------------------------------------------------------------------------------------------- the planner
def test_exposed_formula_hides_what_a_chunk_matmul_covers():
    from picotron.planner import async_tp_exposed_seconds
    alpha, bw, chunk = 1e-6, 1e9, 1e6  # one ring step: 1 us + 1 ms
    msg = alpha + chunk / bw
    assert async_tp_exposed_seconds(4, chunk, 0.0, alpha, bw) == pytest.approx(3 * msg)  # nothing to hide under
    assert async_tp_exposed_seconds(4, chunk, 0.4e-3, alpha, bw) == pytest.approx(3 * (msg - 0.4e-3))
    assert async_tp_exposed_seconds(4, chunk, 2e-3, alpha, bw) == 0.0  # the matmul outlasts every message
    assert async_tp_exposed_seconds(1, chunk, 0.0, alpha, bw) == 0.0


def test_time_model_counts_async_tp_only_where_it_applies():
    import dataclasses

    from picotron.model_config import ModelConfig
    from picotron.plan.hardware import GPUS
    from picotron.plan.search import candidates
    from picotron.plan.time_model import step_time
    from picotron.planner import Layout, async_tp_layer_seconds

    mc, hw = ModelConfig.from_preset("llama3-8b"), GPUS["h100-80gb"]
    lay = Layout.parse("tp8,sp,mbs1,ga8")
    assert Layout.parse(str(dataclasses.replace(lay, async_tp=True))).async_tp
    blocking, overlapped = step_time(mc, lay, 4096, hw), step_time(mc, dataclasses.replace(lay, async_tp=True), 4096, hw)
    rate = hw.peak * hw.efficiency
    per_layer = async_tp_layer_seconds(mc, 4096, 8, 2, rate, hw.intra_alpha, hw.intra_bw)
    assert overlapped["tp"] == pytest.approx(8 * mc.num_hidden_layers * per_layer)
    assert 0 < overlapped["tp"] < blocking["tp"]  # tp 8: a chunk's matmul no longer covers its message
    assert blocking["tp"] == pytest.approx(8 * mc.num_hidden_layers * async_tp_layer_seconds(
        mc, 4096, 8, 2, rate, hw.intra_alpha, hw.intra_bw, overlap=False))  # the blocking model, the same bytes
    assert overlapped["total"] == pytest.approx(blocking["total"] - blocking["tp"] + overlapped["tp"])
    no_sp = Layout.parse("tp8,mbs1,ga8")  # without sp the flag changes nothing (rules refuse it)
    assert step_time(mc, dataclasses.replace(no_sp, async_tp=True), 4096, hw) == step_time(mc, no_sp, 4096, hw)
    found = list(candidates(mc, 8, hw, 4096, 8, space={"async_tp": (False, True), "zero": (1,), "cp": (1,),
                                                         "recompute": ("none",), "micro_batches": (1,)}))
    assert any(l.async_tp for l in found) and all(l.sp and l.tp > 1 for l in found if l.async_tp)
    assert not any(l.async_tp for l in candidates(mc, 8, hw, 4096, 8))  # off unless asked
