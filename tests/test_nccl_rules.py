"""NCCL's rules, proven without a GPU (picotron.nccl_rules): every rank's communication is recorded on gloo and
replayed as NCCL would run it — one FIFO stream per pair for single messages (both directions, tags ignored),
a batch as one grouped call on its group's stream, collectives in issue order with the same op and size on
every member, the pair communicator made at first contact (the host waits for the peer), and the host's waits.

First the replay itself on hand-written traces (each rule, and the two hangs a pod met: the pipeline's
"receive before send" and the ring whose ranks all first receive from their left), then real runs: every
pipeline schedule at pp 2 and 4, lesson 02's collectives at 2, 3 and 4 ranks with chunks cut into several
pieces, context parallelism (ring, all-gather and Ulysses), experts' all-to-alls, data parallelism and ZeRO, tensor +
sequence parallelism, evaluation and the text sample through the pipeline. The parity matrix
(tests/test_parity_matrix.py) replays each of its layouts the same way, and one run here is repeated under
torch's own cross-rank consistency check (TORCH_DISTRIBUTED_DEBUG=DETAIL).
"""
import os

import pytest
import torch
import torch.distributed as dist

from picotron import collectives, nccl_rules
from picotron.config import Config
from picotron.launch import run_on_ranks
from picotron.mesh import Mesh
from picotron.train import train

# ------------------------------------------------------------------------------- the replay, by hand


def _msg(op, peer, nbytes=4, batch=None, handle=None, where="x.py:1 f", comm="0"):
    return dict(op=op, comm=comm, peer=peer, bytes=nbytes, batch=batch, handle=handle, where=where)


def _trace(rank, events, groups=None):
    return dict(rank=rank, groups=groups or {"0": [0, 1]}, events=events)


def _wait(h):
    return dict(op="wait", handle=h)


def test_receive_before_send_deadlocks_with_single_messages():
    # both ranks: receive from the other, then send to it (the pipeline executor's old order at a 1F1B turn)
    t0 = _trace(0, [_msg("isend", 1, handle=1), _msg("irecv", 1, handle=2), _msg("isend", 1, handle=3),
                    _wait(2), _wait(1), _wait(3)])
    t1 = _trace(1, [_msg("irecv", 0, handle=1), _msg("irecv", 0, handle=2), _msg("isend", 0, handle=3),
                    _wait(1), _wait(2), _wait(3)])
    v = nccl_rules.replay([t0, t1])
    assert not v.ok and "DEADLOCK" in str(v), v
    assert "rank 0" in str(v) and "rank 1" in str(v), v


def test_the_same_exchange_as_one_batch_completes():
    t0 = _trace(0, [_msg("isend", 1, batch=1, handle=1), _msg("irecv", 1, batch=1, handle=1), _wait(1)])
    t1 = _trace(1, [_msg("irecv", 0, batch=1, handle=1), _msg("isend", 0, batch=1, handle=1), _wait(1)])
    v = nccl_rules.replay([t0, t1])
    assert v.ok, v
    # without the batch, both sides post their send first on the pair's one FIFO: each send waits for a receive
    s0 = _trace(0, [_msg("isend", 1, handle=1), _msg("irecv", 1, handle=2), _wait(2), _wait(1)])
    s1 = _trace(1, [_msg("isend", 0, handle=1), _msg("irecv", 0, handle=2), _wait(2), _wait(1)])
    assert not nccl_rules.replay([s0, s1]).ok


def test_tags_are_ignored_and_sizes_must_match():
    t0 = _trace(0, [_msg("isend", 1, nbytes=4194304, handle=1), _wait(1)])
    t1 = _trace(1, [_msg("irecv", 0, nbytes=3611392, handle=1), _wait(1)])
    v = nccl_rules.replay([t0, t1])
    assert not v.ok and "mismatch" in str(v) and "4,194,304" in str(v) and "3,611,392" in str(v), v


def test_first_contact_cycle_in_a_ring_hangs():
    # every rank first receives from its left: making the pair communicators waits in a circle
    groups = {"0": [0, 1, 2]}
    traces = [_trace(r, [_msg("irecv", (r - 1) % 3, handle=1, comm="0"), _msg("isend", (r + 1) % 3, handle=2, comm="0"),
                         _wait(1), _wait(2)], groups) for r in range(3)]
    v = nccl_rules.replay(traces)
    assert not v.ok and "pair communicator" in str(v), v
    # the same step as one batch per rank completes
    traces = [_trace(r, [_msg("irecv", (r - 1) % 3, batch=1, handle=1), _msg("isend", (r + 1) % 3, batch=1, handle=1),
                         _wait(1)], groups) for r in range(3)]
    assert nccl_rules.replay(traces).ok


def test_collectives_must_agree_in_order_op_and_size():
    def coll(op, nbytes, h):
        return dict(op=op, comm="0", sig=dict(bytes=nbytes), handle=h, where="x.py:2 g")
    ok = [_trace(r, [coll("all_reduce", 8, 1), _wait(1), coll("all_gather_into_tensor", 16, 2), _wait(2)])
          for r in range(2)]
    assert nccl_rules.replay(ok).ok
    swapped = [_trace(0, [coll("all_reduce", 8, 1), _wait(1)]), _trace(1, [coll("all_gather_into_tensor", 8, 1), _wait(1)])]
    assert "mismatch" in str(nccl_rules.replay(swapped))
    sizes = [_trace(0, [coll("all_reduce", 8, 1), _wait(1)]), _trace(1, [coll("all_reduce", 12, 1), _wait(1)])]
    assert "mismatch" in str(nccl_rules.replay(sizes))
    missing = [_trace(0, [coll("all_reduce", 8, 1), _wait(1)]), _trace(1, [])]
    assert "DEADLOCK" in str(nccl_rules.replay(missing))


def test_all_to_all_sizes_are_checked_per_pair():
    def a2a(send, recv):
        return dict(op="all_to_all_single", comm="0", sig=dict(send=send, recv=recv), handle=1, where="x.py:3 h")
    good = [_trace(0, [a2a([4, 8], [4, 12]), _wait(1)]), _trace(1, [a2a([12, 0], [8, 0]), _wait(1)])]
    assert nccl_rules.replay(good).ok
    bad = [_trace(0, [a2a([4, 8], [4, 12]), _wait(1)]), _trace(1, [a2a([16, 0], [8, 0]), _wait(1)])]
    assert "mismatch" in str(nccl_rules.replay(bad))


def test_a_wait_blocks_the_host_until_the_peer_matches():
    # rank 0 waits for its receive before it sends; rank 1 does the same: a real deadlock whatever the streams
    t0 = _trace(0, [_msg("irecv", 1, batch=1, handle=1), _wait(1), _msg("isend", 1, batch=2, handle=2), _wait(2)])
    t1 = _trace(1, [_msg("irecv", 0, batch=1, handle=1), _wait(1), _msg("isend", 0, batch=2, handle=2), _wait(2)])
    v = nccl_rules.replay([t0, t1])
    assert not v.ok and "host waits" in str(v), v


def _toy_1f1b_on_direction_groups():
    """pp 2, 1F1B, 2 micro-batches, each direction on a group of its own ("01": 0 -> 1, "10": 1 -> 0), every
    message one batch, the receives posted one action ahead (the executor before the one-order rule)."""
    groups = {"01": [0, 1], "10": [0, 1]}
    t0 = _trace(0, [_msg("isend", 1, batch=1, handle=1, comm="01", where="send F0"),
                    _msg("irecv", 1, batch=2, handle=2, comm="10", where="recv B0"),
                    _msg("isend", 1, batch=3, handle=3, comm="01", where="send F1"),
                    _wait(2), _msg("irecv", 1, batch=4, handle=4, comm="10", where="recv B1"), _wait(4),
                    _wait(1), _wait(3)], groups)
    t1 = _trace(1, [_msg("irecv", 0, batch=1, handle=1, comm="01", where="recv F0"),
                    _msg("irecv", 0, batch=2, handle=2, comm="01", where="recv F1"), _wait(1),
                    _msg("isend", 0, batch=3, handle=3, comm="10", where="send B0"), _wait(2),
                    _msg("isend", 0, batch=4, handle=4, comm="10", where="send B1"), _wait(3), _wait(4)], groups)
    return t0, t1


def test_one_order_across_communicators_catches_the_receive_posted_ahead():
    t0, t1 = _toy_1f1b_on_direction_groups()
    # each communicator on its own, running beside the other: every message meets its partner
    assert nccl_rules.replay([t0, t1], order="per-communicator").ok
    # NCCL's rule for several communicators: rank 0 waits in "recv B0" (link 1->0) for rank 1, which waits in
    # "recv F1" (link 0->1) for rank 0, whose "send F1" is queued behind its "recv B0"
    v = nccl_rules.replay([t0, t1])
    assert not v.ok and "several communicators" in str(v), v
    assert "recv B0" in str(v) and "recv F1" in str(v), v


def test_one_order_completes_when_every_rank_posts_in_the_schedules_order():
    groups = {"01": [0, 1], "10": [0, 1]}
    # the same messages, each rank posting them in the order of one timeline: F0, F1, B0, B1
    t0 = _trace(0, [_msg("isend", 1, batch=1, handle=1, comm="01"), _msg("isend", 1, batch=2, handle=2, comm="01"),
                    _msg("irecv", 1, batch=3, handle=3, comm="10"), _wait(3),
                    _msg("irecv", 1, batch=4, handle=4, comm="10"), _wait(4), _wait(1), _wait(2)], groups)
    t1 = _trace(1, [_msg("irecv", 0, batch=1, handle=1, comm="01"), _wait(1),
                    _msg("irecv", 0, batch=2, handle=2, comm="01"), _msg("isend", 0, batch=3, handle=3, comm="10"),
                    _wait(2), _msg("isend", 0, batch=4, handle=4, comm="10"), _wait(3), _wait(4)], groups)
    assert nccl_rules.replay([t0, t1]).ok
    # Megatron's way: "send F1 + receive B0" and "send B0 + receive F1" each one batch on one group
    g = {"pp": [0, 1]}
    m0 = _trace(0, [_msg("isend", 1, batch=1, handle=1, comm="pp"), _wait(1),
                    _msg("isend", 1, batch=2, handle=2, comm="pp"), _msg("irecv", 1, batch=2, handle=2, comm="pp"),
                    _wait(2), _msg("irecv", 1, batch=3, handle=3, comm="pp"), _wait(3)], g)
    m1 = _trace(1, [_msg("irecv", 0, batch=1, handle=1, comm="pp"), _wait(1),
                    _msg("isend", 0, batch=2, handle=2, comm="pp"), _msg("irecv", 0, batch=2, handle=2, comm="pp"),
                    _wait(2), _msg("isend", 0, batch=3, handle=3, comm="pp"), _wait(3)], g)
    assert nccl_rules.replay([m0, m1]).ok


def test_one_order_holds_collectives_on_two_groups_to_one_order():
    def coll(comm, h):
        return dict(op="all_reduce", comm=comm, sig=dict(bytes=8), handle=h, where=f"x.py:{h} {comm}")
    groups = {"a": [0, 1], "b": [0, 1]}
    # rank 0 starts the all-reduce on a, then b; rank 1 b, then a (async, waited at the end): each group alone is
    # fine, the two orders are not
    t0 = _trace(0, [coll("a", 1), coll("b", 2), _wait(1), _wait(2)], groups)
    t1 = _trace(1, [coll("b", 1), coll("a", 2), _wait(1), _wait(2)], groups)
    assert nccl_rules.replay([t0, t1], order="per-communicator").ok
    assert "several communicators" in str(nccl_rules.replay([t0, t1]))
    t1 = _trace(1, [coll("a", 1), coll("b", 2), _wait(1), _wait(2)], groups)
    assert nccl_rules.replay([t0, t1]).ok
    with pytest.raises(ValueError, match="order="):
        nccl_rules.replay([t0, t1], order="any")


# --------------------------------------------------------------------------------------- real runs
SMALL = dict(seq_len=32, micro_batch_size=2, sample_tokens=4, log_every=1000, eval_every=1, eval_batches=1, lr=3e-3,
             warmup_steps=1, steps=1, grad_clip=1.0)


def _train_child(layout, out):
    cfg = Config(out=out, **{**SMALL, **layout})
    with Mesh.init(dp=cfg.dp, pp=cfg.pp, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep, collectives=cfg.collectives) as mesh:
        train(cfg, mesh)
    return None


def _replayed(tmp_path, layout, world):
    results = run_on_ranks(nccl_rules.run_recorded, world, _train_child, layout, str(tmp_path / "run"),
                           timeout_s=120 + 30 * world)
    verdict = nccl_rules.replay([trace for _, trace in results])
    assert verdict.ok, f"{layout}: {verdict}"
    return verdict


PIPELINES = [dict(pp=2, pp_schedule="afab", grad_acc=2), dict(pp=2, pp_schedule="1f1b", grad_acc=4),
             dict(pp=2, pp_schedule="interleaved", pp_chunks=2, grad_acc=4), dict(pp=2, pp_schedule="zb-h1", grad_acc=4),
             dict(pp=2, pp_schedule="zb-v", grad_acc=4), dict(pp=4, pp_schedule="1f1b", grad_acc=8),
             dict(pp=4, pp_schedule="afab", grad_acc=4), dict(pp=4, pp_schedule="zb-h1", grad_acc=8),
             dict(pp=4, pp_schedule="interleaved", pp_chunks=2, grad_acc=8, num_hidden_layers=8),
             dict(pp=4, pp_schedule="zb-v", grad_acc=8, num_hidden_layers=8),
             dict(pp=2, pp_schedule="dualpipe", grad_acc=4), dict(pp=4, pp_schedule="dualpipe", grad_acc=8)]


@pytest.mark.parametrize("layout", PIPELINES, ids=lambda l: f"pp{l['pp']}-{l['pp_schedule']}")
def test_every_pipeline_schedule_obeys_nccl_rules(tmp_path, layout):
    _replayed(tmp_path, layout, layout["pp"])


COMPOSED = [dict(dp=2, pp=2, grad_acc=4, zero=2), dict(dp=2, pp=2, grad_acc=4, zero=3, pp_schedule="zb-v"),
            dict(dp=2, tp=2, pp=2, grad_acc=4, zero=3, pp_schedule="interleaved", pp_chunks=2),
            pytest.param(dict(dp=2, pp=2, grad_acc=4, zero=2, pp_schedule="zb-v"), marks=pytest.mark.heavy),
            pytest.param(dict(dp=2, pp=2, grad_acc=4, zero=3), marks=pytest.mark.heavy),
            pytest.param(dict(dp=2, tp=2, pp=2, grad_acc=4), marks=pytest.mark.heavy),
            pytest.param(dict(dp=2, pp=2, grad_acc=4, pp_schedule="dualpipe", tp=2, sp=True),
                         marks=pytest.mark.heavy)]


@pytest.mark.parametrize("layout", COMPOSED, ids=lambda l: "-".join(f"{k}{v}" for k, v in l.items()))
def test_pipelines_composed_with_zero_tp_and_dp_obey_nccl_rules(tmp_path, layout):
    """The layouts that could not complete under the one-order rule before the executor followed
    pipeline_schedules.with_messages: the pipeline's messages among ZeRO's, tp's and dp's collectives."""
    _replayed(tmp_path, layout, layout.get("dp", 1) * layout["pp"] * layout.get("tp", 1))


LAYOUTS = [dict(cp=2, cp_impl="ring"), dict(cp=2, cp_impl="allgather"), dict(cp=2, tp=2, sp=True),
           dict(cp=2, cp_impl="ulysses", collectives="ours"), dict(cp=2, tp=2, cp_impl="ulysses"),
           dict(preset="tiny-moe", dp=2, ep=2), dict(preset="tiny-moe", dp=4, ep=2, zero=1),
           dict(dp=2, dp_impl="overlap"), dict(dp=2, zero=2), dict(dp=2, zero=3), dict(dp=2, tp=2, sp=True, zero=1),
           dict(dp=2, pp=2, grad_acc=2, zero=1), dict(dp=3, collectives="ours", zero=1), dict(tp=2, recompute="partitioned")]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "-".join(f"{k}{v}" for k, v in l.items()))
def test_every_strategy_obeys_nccl_rules(tmp_path, layout):
    world = layout.get("dp", 1) * layout.get("pp", 1) * layout.get("cp", 1) * layout.get("tp", 1)
    _replayed(tmp_path, layout, world)


def _collectives_child(piece_bytes):
    """Every one of lesson 02's collectives, with tensors cut into several pieces of `piece_bytes`."""
    collectives.PIECE_BYTES = piece_bytes
    n, me = dist.get_world_size(), dist.get_rank()
    numel = 5 * piece_bytes // 4 * n + 3  # several pieces per chunk, chunks of unequal length
    x = torch.arange(numel, dtype=torch.float32) + me
    collectives.all_reduce(x)
    assert torch.allclose(x, torch.arange(numel, dtype=torch.float32) * n + n * (n - 1) / 2)
    out = torch.empty(numel * n)
    collectives.all_gather_into_tensor(out, torch.full((numel,), float(me)))
    rs = torch.empty(numel)
    collectives.reduce_scatter_tensor(rs, torch.ones(numel * n))
    collectives.broadcast(x, src=n - 1)
    collectives.reduce(x, dst=1 % n)
    a2a = torch.empty(n * 7)
    collectives.all_to_all_single(a2a, torch.arange(n * 7, dtype=torch.float32))
    collectives.barrier()
    return None


@pytest.mark.parametrize("world", [2, 3, 4])
def test_our_collectives_obey_nccl_rules(world):
    results = run_on_ranks(nccl_rules.run_recorded, world, _collectives_child, 4096, timeout_s=120)
    verdict = nccl_rules.replay([trace for _, trace in results])
    assert verdict.ok, verdict


def _detail_child(layout, out):
    """The same run under torch's own check: with TORCH_DISTRIBUTED_DEBUG=DETAIL every collective is first
    compared across ranks (op, shapes, dtypes) and a disagreement raises instead of hanging."""
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()
    _train_child(layout, out)
    return dist.get_debug_level() == dist.DebugLevel.DETAIL


def test_torch_detail_consistency_check_passes(tmp_path):
    layout = dict(dp=2, pp=2, tp=2, sp=True, zero=1, grad_acc=2)
    assert all(run_on_ranks(_detail_child, 8, layout, str(tmp_path / "run"), init_group=False, timeout_s=300))


def test_pipeline_links_are_one_group_per_pair_of_ring_neighbours():
    from picotron.mesh import pipeline_links
    assert pipeline_links(1) == []
    assert pipeline_links(2) == [(0, 1)]
    four = pipeline_links(4)
    assert four == [(0, 1), (0, 3), (1, 2), (2, 3)]  # the interleaved turn wraps: 3 -> 0
