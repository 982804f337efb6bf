"""Expert parallelism with its all-to-alls under compute (--ep-overlap, picotron.expert_parallel.OverlappedExchange).

The layer: at ep = 2 (and 4), with and without DeepSeek's shared expert, the overlapped MoE layer equals all experts on
one process, forward and backward (every rank's output and input gradient, the router's gradient, each expert's
gradient summed over the ranks whose tokens it saw), and sends exactly the rows the blocking exchange sends. The
schedule: on every rank the ep group's all-to-alls come in the order the docstring draws (dispatch 1, dispatch 2,
combine 1, combine 2; backward: combine-backward 1, 2, dispatch-backward 1, 2) and part 1's experts run while
part 2's dispatch is in flight. The whole model per the parity standard (tests/_parity.py) against one process, with
each rank's communication replayed under NCCL's rules, both models (per communicator, and one order across the ep,
dp and cp groups): dp2 x ep2 (DeepSeek's router, shared experts), and, heavy, ep 4, ep2 x tp2 (+ sp), dp2 x cp2 x
ep2, ep2 with ZeRO-1, ep2 x pp2 and full recomputation.
"""
import pytest
import torch
from _parity import assert_matches

from picotron import expert_parallel, metrics, nccl_rules
from picotron.launch import run_on_ranks
from picotron.mesh import Mesh
from picotron.model import Llama, ModelConfig

import test_expert_parallel as tep

DEEPSEEK = dict(num_local_experts=8, num_experts_per_tok=3, router_aux_loss_coef=0.0, scoring_func="sigmoid",
                n_shared_experts=1, moe_intermediate_size=96, bias_update_speed=0.05)


def _model(shared, layers=1):
    mc = ModelConfig.from_preset("tiny-moe", num_hidden_layers=layers, **(DEEPSEEK if shared else {}))
    model = Llama(mc).init_weights(0)
    with torch.no_grad():  # a router that prefers some experts: uneven counts, odd halves
        for i, layer in enumerate(model.layers):
            layer.block_sparse_moe.gate.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(i))
    return model


def _layer_child(ep, shared):
    """The overlapped layer and the blocking one at ep ranks against all experts on this process; the ep group's
    all-to-alls in the order they were issued, and the timeline of the overlapped forward."""
    with Mesh.init(dp=torch.distributed.get_world_size(), ep=ep) as mesh:
        full = _model(shared).layers[0].block_sparse_moe
        rec = metrics.Recorder(metrics.Timeline("cpu", mesh.rank))
        ep_axis = mesh.ep.recorded(rec)
        mine = expert_parallel.apply(_model(shared), ep_axis, overlap=True).layers[0].block_sparse_moe
        blocking = expert_parallel.apply(_model(shared), mesh.ep).layers[0].block_sparse_moe
        assert isinstance(mine.exchange, expert_parallel.OverlappedExchange)
        for m in (full, mine, blocking):
            m.aux_weight = 0.5
        for e in mine.experts.values():  # the experts' compute, on the same timeline as the all-to-alls
            e.register_forward_pre_hook(lambda mod, a: rec.timeline.add("expert start", rec.now(), rec.now()))
        g = torch.Generator().manual_seed(7 + mesh.rank)
        x = torch.randn(2, 12, 128, generator=g)
        dy = torch.randn(2, 12, 128, generator=g)
        xs = [x.clone().requires_grad_() for _ in range(3)]
        ys = []
        for m, xi in zip((full, mine, blocking), xs):  # each forward and backward in turn: the trace's order
            ys.append(m(xi))
            ys[-1].backward(dy)
        labels = [e["name"] for e in rec.timeline.events if e["name"].startswith("all-to-all") or e["name"] == "expert start"]
        issued = [label for kind, _, _ in rec.log for label in [kind]]
        grads = {n: p.grad for n, p in mine.named_parameters()}
        want = {n: p.grad for n, p in full.named_parameters()}
        return (ys[1].detach(), ys[0].detach(), xs[1].grad, xs[0].grad, grads, want, dict(mine.exchange.rows),
                dict(blocking.exchange.rows), labels, issued, ys[2].detach())


def _schedule(trace):
    """The ep group's operations of one rank's trace, as issue ("a2a") and wait tokens numbered in issue order."""
    ep = next(e["comm"] for e in trace["events"] if e["op"] == "all_to_all_single")
    number, tokens = {}, []
    for e in trace["events"]:
        if e["op"] == "all_to_all_single" and e["comm"] == ep:
            number[e["handle"]] = len(number)
            tokens.append(f"a2a{number[e['handle']]}")
        elif e["op"] == "wait" and e["handle"] in number:
            tokens.append(f"wait{number[e['handle']]}")
    return tokens


# counts; dispatch 1, 2; wait 1 (experts 1 run while 2 travels); combine 1; wait 2 (experts 2 under combine 1);
# combine 2; wait both. The backward: the same shape with combine-backward first, then dispatch-backward.
FORWARD = "a2a0 wait0 a2a1 a2a2 wait1 a2a3 wait2 a2a4 wait3 wait4".split()
BACKWARD = "a2a5 a2a6 wait5 a2a7 wait6 a2a8 wait7 wait8".split()


@pytest.mark.parametrize("ep,shared", [(2, True), pytest.param(2, False, marks=pytest.mark.heavy),
                                       pytest.param(4, True, marks=pytest.mark.heavy)])
def test_overlapped_layer_equals_all_experts_on_one_process(ep, shared):
    """Forward and input gradient on every rank, the router's gradient, each expert's gradient summed over every
    rank's tokens; the rows sent equal the blocking exchange's; the ep group's all-to-alls issued and waited for in
    the two-part order, forward and backward, on every rank."""
    results = run_on_ranks(nccl_rules.run_recorded, ep, _layer_child, ep, shared, timeout_s=120)
    total = {}
    for (*_, want, _, _, _, _, _), _ in results:
        for n, g in want.items():
            total[n] = total.get(n, 0) + g
    for rank, ((y, y_ref, dx, dx_ref, grads, want, rows, blocking_rows, _, _, y_blocking), trace) in enumerate(results):
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} output: {m}")
        torch.testing.assert_close(y, y_blocking, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} vs blocking: {m}")
        torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} input grad: {m}")
        assert set(grads) < set(want) and any(n.startswith("experts.") for n in grads)  # this rank's experts, the router
        for n, g in grads.items():
            expect = total[n] if n.startswith("experts.") else want[n]
            torch.testing.assert_close(g, expect, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {n}: {m}")
        assert rows == blocking_rows and set(rows) == {"dispatch", "combine", "dispatch-backward", "combine-backward"}
        tokens = _schedule(trace)
        # the trace holds the overlapped layer and then the blocking one (a2a counts, dispatch, combine, ...)
        assert tokens[:len(FORWARD) + len(BACKWARD)] == FORWARD + BACKWARD, f"rank {rank}: {tokens}"
    held = {n for (_, _, _, _, grads, *_), _ in results for n in grads}
    assert held == set(total), f"not every gradient compared: {sorted(set(total) - held)}"
    verdict = nccl_rules.replay([trace for _, trace in results])
    assert verdict.ok, verdict


def test_the_parts_split_each_experts_rows_in_halves():
    """The pure piece: part 1 takes the first ceil(c/2) rows of each expert, part 2 the rest, both sorted by expert;
    the permutation puts part 1's rows first (on one process: the ep axis of one rank sends to itself)."""
    axis = Mesh.local().ep
    ex = expert_parallel.OverlappedExchange(axis, 3)
    counts = torch.tensor([3, 0, 2])  # rows 0-2 expert 0, rows 3-4 expert 2
    job = expert_parallel._TwoParts(ex, counts, None, None, grad=False)
    assert job.perm.tolist() == [0, 1, 3, 2, 4] and job.sizes == [3, 2]
    assert [p.local for p in job.parts] == [[2, 0, 1], [1, 0, 1]]


# ------------------------------------------------------------------------------------------ the whole model
def _replayed(tmp_path, layout):
    """The parity standard for `layout` against one process (tests/test_expert_parallel.py's children and cached
    reference), every rank's communication recorded and replayed under NCCL's rules: each communicator on its own,
    then one order across all of them (the ep group's async all-to-alls among dp's, ZeRO's, tp's and cp's)."""
    world = layout.get("dp", 1) * layout.get("pp", 1) * layout.get("tp", 1) * layout.get("cp", 1)
    recorded = run_on_ranks(nccl_rules.run_recorded, world, tep._model_child, layout, str(tmp_path / "ep"),
                            timeout_s=300)
    traces = [trace for _, trace in recorded]
    for order in ("per-communicator", "one"):
        verdict = nccl_rules.replay(traces, order=order)
        assert verdict.ok, f"{layout} ({order}): {verdict}"
    for trace in traces:  # the overlapped exchange ran: two all-to-alls in flight at once on the ep group
        tokens = _schedule(trace)
        assert any(a.startswith("a2a") and b.startswith("a2a") for a, b in zip(tokens, tokens[1:])), tokens[:12]
    results = [out for out, _ in recorded]
    reference = tep._reference(layout)
    assert_matches(results, reference, layout)
    return results, reference


DS = tep.DS
OVERLAP = dict(ep_overlap=True)


@pytest.mark.parametrize("layout", [
    dict(dp=2, ep=2, **OVERLAP, **DS),  # shared expert under the first dispatch, the routing bias, the aux loss
    pytest.param(dict(dp=2, ep=2, **OVERLAP), marks=pytest.mark.heavy),  # tiny-moe: softmax router, no shared
    pytest.param(dict(dp=4, ep=4, **OVERLAP), marks=pytest.mark.heavy),
    pytest.param(dict(dp=4, ep=4, **OVERLAP, **DS), marks=pytest.mark.heavy),
    pytest.param(dict(dp=4, ep=2, zero=1, **OVERLAP), marks=pytest.mark.heavy),  # experts replicated over edp
    pytest.param(dict(dp=2, ep=2, tp=2, **OVERLAP, **DS), marks=pytest.mark.heavy),
    pytest.param(dict(dp=2, ep=2, tp=2, sp=True, **OVERLAP), marks=pytest.mark.heavy),
    pytest.param(dict(dp=2, cp=2, ep=2, **OVERLAP, **DS), marks=pytest.mark.heavy),
    pytest.param(dict(dp=2, ep=2, pp=2, grad_acc=2, **OVERLAP), marks=pytest.mark.heavy),
    pytest.param(dict(dp=2, ep=2, pp=2, grad_acc=2, pp_schedule="zb-v", **OVERLAP), marks=pytest.mark.heavy),
    pytest.param(dict(dp=2, ep=2, recompute="full", **OVERLAP, **DS), marks=pytest.mark.heavy),
    pytest.param(dict(dp=2, ep=2, capacity_factor=1.0, **OVERLAP), marks=pytest.mark.heavy),
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items() if k not in ("preset", "aux_loss_coef", "ep_overlap")))
def test_whole_model_matches_one_process_and_replays_clean(tmp_path, layout):
    results, (_, _, ref) = _replayed(tmp_path, layout)
    for rank, (*_, summary) in enumerate(results):
        assert summary["bias"] == {n: ref["bias"][n] for n in summary["bias"]}, f"rank {rank}: routing bias differs"


# ------------------------------------------------------------------------------------------ the planner
def test_exposed_time_formula_and_the_time_model():
    """planner.ep_overlap_exposed_seconds in its two regimes (compute covers a part's all-to-all: the first dispatch
    and the last combine, less the shared expert, never less than that last combine; it does not: 4a − 2c − s),
    nothing to hide under: the blocking 4a;
    step_time charges it for an ep layout with ep_overlap, and less than the blocking all-to-alls."""
    from picotron.plan.hardware import GPUS
    from picotron.plan.time_model import step_time
    from picotron.planner import Layout, ep_overlap_exposed_seconds as exposed

    assert exposed(1.0, 2.0) == 2.0 and exposed(1.0, 2.0, 0.5) == 1.5 and exposed(1.0, 5.0, 3.0) == 1.0  # the last combine, always
    assert exposed(2.0, 1.0) == 6.0 and exposed(2.0, 1.0, 0.5) == 5.5
    assert exposed(1.0, 0.0) == 4.0  # no compute: the four part-all-to-alls back to back, as blocking
    assert exposed(1.0, 2.0, 0.0, 1.0) == 1.0  # work after combine 2's launch hides part of it
    assert exposed(2.0, 1.0, 0.0, 0.5) == 6.0  # ... not when the link is the bottleneck
    mc = ModelConfig.from_preset("mixtral-8x7b")
    blocking, overlapped = (step_time(mc, Layout.parse("dp8,ep8,zero1,mbs1,ga16", ep_overlap=o), 4096, GPUS["h100-80gb"])
                            for o in (False, True))
    assert 0 < overlapped["ep"] < blocking["ep"] and overlapped["compute"] == blocking["compute"]
    assert Layout.parse("dp8,ep8,ep-overlap").ep_overlap and "ep-overlap" in str(Layout(dp=8, ep=8, ep_overlap=True))


@pytest.mark.heavy
def test_the_benchmark_runs_on_two_ranks():
    """benchmarks/ep_overlap_bench.py at its --smoke size builds both exchanges, steps them and prints the paired
    ratio (a smoke test: the ratio of 2 rounds means nothing and is not checked)."""
    from pathlib import Path

    from picotron.launch import run_torchrun

    root = Path(__file__).resolve().parents[1]
    out = run_torchrun(root / "benchmarks" / "ep_overlap_bench.py", 2, ["--smoke"], timeout_s=600, cwd=root).stdout
    assert "overlapped throughput / blocking's: median" in out, out[-2000:]
