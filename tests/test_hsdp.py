"""HSDP (--dp-shard): ZeRO within shard groups, replicated across them, against the single process.

The parity standard (tests/_parity.py): dp ranks with grad_acc G see the rows one process sees with grad_acc dp*G,
so the per-step loss, gradient norm and validation loss agree within 1e-5 relative and every gradient, shard by
shard, within 1e-5, here on EVERY replica (each replica's shards are gathered over its own shard group and compared:
a replica that skipped the all-reduce across replicas would hold the mean of its own half of the batch).

Each run's communication is recorded and replayed under NCCL's rules (the per-communicator model and the
one-order-across-communicators model), as tests/test_nccl_rules.py does, and one step's collectives are counted per
axis and compared, on every rank, with picotron.planner.hsdp_bytes_per_step: the reduce-scatters and all-gathers on
the dp_shard axis, the all-reduce of the shards on the dp_replicate axis.

Default tier: the pure pieces (the groups, the clipping count, the formula's limits) and one 4-process run, ZeRO-3 at
dp 4 = 2 x 2 with 2 micro-batches (parity, bytes and replay at once). Heavy: ZeRO-1 and 2, dp x cp, with tp and with
pp (8 processes), and the checkpoints (exact resume, and into another layout and back).
"""
import dataclasses
import types

import pytest
import torch
from _parity import assert_matches, layout_grads
from _reference import PARITY, single_process

from picotron import marks, nccl_rules, planner, reshard
from picotron import train as train_mod
from picotron.config import Config
from picotron.launch import run_on_ranks
from picotron.mesh import Mesh, grid_coords, shard_groups
from picotron.metrics import Recorder, read_metrics
from picotron.parallelize import parallelize

SETTINGS = dict(PARITY, bucket_mb=0.05)  # small buckets: several units in stages 1-2


def degrees(cfg):
    return dict(dp=cfg.dp, pp=cfg.pp, cp=cfg.cp, tp=cfg.tp, dp_shard=cfg.dp_shard)


# ------------------------------------------------------------------------------------------- pure pieces
def test_shard_and_replicate_groups():
    assert shard_groups(dict(dp=4), 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert shard_groups(dict(dp=8), 4) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
    # every cp rank of a block is in its shard group; replicas share the cp coordinate
    assert shard_groups(dict(dp=4, cp=2), 2) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
    assert shard_groups(dict(dp=4, cp=2), 1) == ([[0, 1], [2, 3], [4, 5], [6, 7]],
                                                 [[0, 2, 4, 6], [1, 3, 5, 7]])
    # tp and pp peers are never in one group
    sizes = dict(dp=4, pp=2, tp=2)
    shard, replicate = shard_groups(sizes, 2)
    for group in shard + replicate:
        coords = [grid_coords(r, sizes) for r in group]
        assert len({(c["pp"], c["tp"]) for c in coords}) == 1, group
    assert all(len({grid_coords(r, sizes)["dp"] // 2 for r in g}) == 1 for g in shard)
    assert all(len({grid_coords(r, sizes)["dp"] % 2 for r in g}) == 1 for g in replicate)
    assert shard_groups(dict(dp=4), 0) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])  # no HSDP: one block
    with pytest.raises(ValueError, match="does not divide"):
        shard_groups(dict(dp=4), 3)


def _mesh_child():
    import torch.distributed as dist
    out = {}
    for ds in (0, 2):
        with Mesh.init(dp=4, dp_shard=ds) as mesh:
            t = torch.tensor([float(dist.get_rank())])
            sums = {}
            for name in ("dp_shard", "dp_replicate"):
                axis = mesh.__dict__[name]
                x = t.clone()
                axis.all_reduce(x)
                sums[name] = (axis.ranks, axis.dims, x.item())
            out[ds] = dict(sums=sums, same_group=mesh.dp_shard.group is mesh.dp_cp.group)
    return out


def test_mesh_builds_the_shard_and_replicate_groups():
    """Mesh.init(dp=4, dp_shard=2): each rank's two axes hold its block and its replicas, with groups of their own (an
    all-reduce of the ranks sums each group); without HSDP the shard axis IS dp x cp's group and the replicas are one."""
    for rank, out in enumerate(run_on_ranks(_mesh_child, 4, timeout_s=120)):
        shard, replicate = [g for g in shard_groups(dict(dp=4), 2)[0] if rank in g][0], [rank % 2, rank % 2 + 2]
        assert out[2]["sums"] == {"dp_shard": (shard, ("dp_shard", "cp"), float(sum(shard))),
                                  "dp_replicate": (replicate, ("dp",), float(sum(replicate)))}, out
        assert out[0]["sums"]["dp_shard"] == ([0, 1, 2, 3], ("dp", "cp"), 6.0) and out[0]["same_group"]
        assert out[0]["sums"]["dp_replicate"] == ([rank], ("dp",), float(rank))


def _fake_mesh(dp, dp_shard, cp=1, rank_dp=0, rank_cp=0):
    axis = types.SimpleNamespace
    return types.SimpleNamespace(coords=dict(dp=rank_dp, pp=0, cp=rank_cp, tp=0), sizes=dict(dp=dp, pp=1, cp=cp, tp=1),
                                 ep=axis(size=1), dp_shard=axis(size=dp_shard * cp), cp=axis(size=cp))


def test_an_hsdp_piece_is_counted_once_over_the_replicas():
    """A ZeRO piece cut over ("dp_shard", "cp") is different on the ranks of a block and the same on the replicas:
    clipping and checkpoints count it on block 0 only (each of its dp_shard x cp ranks), never on block 1."""
    piece = marks.tag(torch.zeros(3), marks.Placement().merged(("dp_shard", "cp")))
    for cp in (1, 2):
        counted = {(d, c): marks.counted_here(piece, _fake_mesh(4, 2, cp, d, c)) for d in range(4) for c in range(cp)}
        assert counted == {(d, c): d < 2 for d in range(4) for c in range(cp)}, counted
    whole = marks.tag(torch.zeros(3), marks.Placement().merged(("dp", "cp")))  # plain ZeRO: every rank its own
    assert all(marks.counted_here(whole, _fake_mesh(4, 4, 1, d)) for d in range(4))


def test_hsdp_bytes_formula_at_its_limits():
    psi = 1000
    for zero in (1, 2, 3):
        # one shard group of all n ranks: plain ZeRO, nothing crosses the replicate axis
        plain = planner.hsdp_bytes_per_step(psi, zero, 4, 1, root_params=100)
        comm = planner.zero_comm_elements(psi, zero, 100)
        assert plain["dp_shard"] == pytest.approx(3 / 4 * 4 * sum(comm.values()))
        assert plain["dp_replicate"] == 0 and plain["buffers"]["dp_replicate"] == {}
    dp = planner.hsdp_bytes_per_step(psi, 1, 1, 4)  # shard groups of one rank: data parallelism's ring all-reduce
    assert dp["dp_shard"] == 0 and dp["dp_replicate"] == pytest.approx(2 * 3 / 4 * 4 * psi)
    hs = planner.hsdp_bytes_per_step(psi, 3, 2, 2, root_params=100)  # dp 4 = 2 x 2
    assert hs["dp_replicate"] == pytest.approx(2 * 1 / 2 * 4 * psi / 2)
    assert hs["buffers"] == {"dp_shard": {"all_gather": 4 * 1900, "reduce_scatter": 4 * 1000},
                             "dp_replicate": {"all_reduce": 4 * 500}}


# ------------------------------------------------------------------------------------- one run, many checks
def _bytes_of_one_step(cfg, mesh):
    """One recorded step of one micro-batch: {axis: {kind: buffer bytes}} counted by a metrics.Recorder, and the
    formula's buffers for Ψ as the units hold it (padded), this rank's."""
    recorder = Recorder()
    cfg = dataclasses.replace(cfg, grad_acc=1, out=None)
    run = parallelize(cfg, mesh, recorder=recorder)
    _, loader = train_mod.load_data(cfg, mesh)
    run.schedule.run(run.model, loader.micro_batches(1), run.loss_fn)
    marks.clip_grad_norm(run.params, 1.0, mesh)
    run.optimizer.step()
    counted = {}
    for kind, nbytes, axis in recorder.log:
        if axis in ("dp_shard", "dp_replicate"):
            counted.setdefault(axis, {}).setdefault(kind, 0)
            counted[axis][kind] += nbytes
    units = run.model.units
    psi = sum(u.padded for u in units)
    root = sum(u.padded for u in units if not u.layer) if cfg.zero == 3 else 0
    formula = planner.hsdp_bytes_per_step(psi, cfg.zero, mesh.dp_shard.size, mesh.dp_replicate.size, root,
                                          pipeline=cfg.pp > 1)
    return counted, {k: v for k, v in formula["buffers"].items() if v}


def _child(layout, out):
    """One step's gradients, the bytes of one recorded step, then the 3-step training run's records."""
    cfg = Config(out=out, **{**SETTINGS, **layout})
    with Mesh.init(**degrees(cfg)) as mesh:
        _, loader = train_mod.load_data(cfg, mesh)
        run = parallelize(cfg, mesh)
        run.schedule.run(run.model, loader.micro_batches(1), run.loss_fn)
        grads = layout_grads(run, mesh, cfg, every_replica=True)  # every replica's copy compared
        sent = _bytes_of_one_step(cfg, mesh) if cfg.zero and layout.get("dp_shard") else None
        mesh.world.all_reduce(torch.zeros(1))
    with Mesh.init(**degrees(cfg)) as mesh:
        summary = train_mod.train(cfg, mesh)
        records = read_metrics(out)[0] if mesh.rank == 0 else None
    return (grads, records, summary), sent


def _reference(layout):
    settings = {**SETTINGS, "grad_acc": layout.get("grad_acc", 1) * layout["dp"],
                **{k: v for k, v in layout.items() if k in ("preset", "tp_size")}}
    return single_process(_ref_child, settings)


def _ref_child(settings, out):
    return _child(settings, out)[0]


def check_layout(tmp_path, layout):
    world = layout["dp"] * layout.get("pp", 1) * layout.get("cp", 1) * layout.get("tp", 1)
    ref = _reference(layout)
    recorded = run_on_ranks(nccl_rules.run_recorded, world, _child, layout, str(tmp_path / "run"),
                            timeout_s=240 + 30 * world)
    traces = [trace for _, trace in recorded]
    for order in ("per-communicator", "one"):  # "one": both models, the one-order one too
        verdict = nccl_rules.replay(traces, order=order)
        assert verdict.ok, f"{layout}, {order}: {verdict}"
    results = [r for (r, _), _ in recorded]
    assert_matches(results, ref, str(layout))
    assert sum(bool(g) for g, _, _ in results) == world // layout.get("tp", 1)  # every replica compared
    for rank, ((_, sent), _) in enumerate(recorded):
        counted, formula = sent
        assert counted == formula, f"{layout}, rank {rank}: counted {counted}, formula {formula}"
        assert set(counted) == {"dp_shard", "dp_replicate"}, counted  # both links carry bytes, counted apart


@pytest.mark.parametrize("layout", [
    dict(dp=4, dp_shard=2, zero=3, grad_acc=2),
    pytest.param(dict(dp=4, dp_shard=2, zero=1, grad_acc=2), marks=pytest.mark.heavy),
    pytest.param(dict(dp=4, dp_shard=2, zero=2, grad_acc=2), marks=pytest.mark.heavy),
    pytest.param(dict(dp=2, cp=2, dp_shard=1, zero=2, grad_acc=2), marks=pytest.mark.heavy),  # shard group = cp
    pytest.param(dict(dp=4, tp=2, dp_shard=2, zero=1, sp=True), marks=pytest.mark.heavy),
    pytest.param(dict(dp=4, tp=2, dp_shard=2, zero=3), marks=pytest.mark.heavy),
    pytest.param(dict(dp=4, pp=2, dp_shard=2, zero=1, grad_acc=2), marks=pytest.mark.heavy),
    pytest.param(dict(dp=4, pp=2, dp_shard=2, zero=2, grad_acc=4, pp_schedule="zb-h1"), marks=pytest.mark.heavy),
    pytest.param(dict(dp=4, pp=2, dp_shard=2, zero=3, grad_acc=2), marks=pytest.mark.heavy),
], ids=lambda l: "-".join(f"{k}{v}" for k, v in l.items()))
def test_hsdp_matches_one_process_sends_the_formula_and_obeys_nccl_rules(tmp_path, layout):
    check_layout(tmp_path, layout)


# --------------------------------------------------------------------------------------------- checkpoints
CKPT = dict(SETTINGS, eval_every=0, steps=4, save_every=2, keep_checkpoints=0)


def _ckpt_child(layout, out, resume_from):
    cfg = Config(out=out, resume_from=resume_from or "", **{**CKPT, **layout})
    with Mesh.init(**degrees(cfg)) as mesh:
        train_mod.train(cfg, mesh)
        return read_metrics(out)[0] if mesh.rank == 0 else None


@pytest.mark.heavy
@pytest.mark.parametrize("zero", [1, 3])
def test_hsdp_checkpoint_resumes_exactly_and_loads_into_other_layouts(tmp_path, zero):
    """Save at steps 2 and 4 under HSDP (dp 4 = 2 x 2); a run resumed from step 2 repeats steps 3-4 bit for bit; the
    step-2 checkpoint consolidates into the same tensors as plain ZeRO's (dp 4) at the same step, and plain ZeRO's
    resumes under HSDP (and HSDP's under plain ZeRO) with the uninterrupted losses within the parity tolerance."""
    hsdp, plain = dict(dp=4, dp_shard=2, zero=zero), dict(dp=4, zero=zero)
    full = run_on_ranks(_ckpt_child, 4, hsdp, str(tmp_path / "hsdp"), None, timeout_s=300)[0]
    run_on_ranks(_ckpt_child, 4, plain, str(tmp_path / "plain"), None, timeout_s=300)
    step2 = {src: str(tmp_path / src / "checkpoints" / "step_000002") for src in ("hsdp", "plain")}
    a, b = reshard.consolidate(step2["hsdp"]), reshard.consolidate(step2["plain"])
    assert a["params"].keys() == b["params"].keys() and a["params"]
    for name in a["params"]:  # two Adam steps apart in summation order only: close in norm (tests/test_zero.py's
        # assert_params_close says why not element by element: Adam's sign flips where a gradient element is ~0)
        pairs = [(a["params"][name], b["params"][name])] + [(a["optimizer"][name][k], b["optimizer"][name][k])
                                                            for k in ("exp_avg", "exp_avg_sq")]
        for x, y in pairs:
            assert x.shape == y.shape and (x - y).norm() <= 1e-4 * y.norm() + 1e-9, (name, (x - y).norm(), y.norm())
    want = [r["loss"] for r in full if r["step"] > 2]
    for src, dst, exact in (("hsdp", hsdp, True), ("plain", hsdp, False), ("hsdp", plain, False)):
        out = tmp_path / f"{src}-to-{'hsdp' if dst is hsdp else 'plain'}"
        resumed = run_on_ranks(_ckpt_child, 4, dst, str(out), step2[src], timeout_s=300)[0]
        losses = [r["loss"] for r in resumed if r["step"] > 2]
        assert len(losses) == 2, resumed
        if exact:
            assert losses == want, (src, losses, want)
        else:
            assert losses == pytest.approx(want, rel=1e-5), (src, losses, want)
