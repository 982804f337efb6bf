"""--profile (picotron/trace.py): each rank's Chrome trace parses and holds picotron's phases and collectives, the
merged trace holds every rank on one clock, profiling changes no loss, a bad range is refused, and the barriers the
profiled range adds replay clean under picotron/nccl_rules.py."""
import json
import os

import pytest

from picotron import config, nccl_rules, rules, trace
from picotron.config import Config
from picotron.launch import run_on_ranks

SMALL = dict(seq_len=32, micro_batch_size=2, sample_tokens=0, log_every=1000, eval_every=0, lr=3e-3,
             warmup_steps=1, steps=3, grad_clip=1.0)


def _train_child(layout, out):
    """One training run of SMALL + layout on this rank: rank 0's per-step losses."""
    from picotron.mesh import Mesh
    from picotron.metrics import read_metrics
    from picotron.train import train

    cfg = Config(out=out, **{**SMALL, **layout})
    with Mesh.init(dp=cfg.dp, pp=cfg.pp, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep) as mesh:
        train(cfg, mesh)
        return [r["loss"] for r in read_metrics(out)[0]] if mesh.rank == 0 else None


def _load(path):
    with open(path) as f:
        return json.load(f)


def _names(rows):
    return {name.split()[0] for _, name, *_ in rows}


# ------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("value", ["0:2", "3:2", "2:9", "a:b", "1:2:3", "", "9"])
def test_a_bad_range_is_refused_in_one_sentence(value):
    cfg = Config(steps=4, profile=value)
    with pytest.raises(config.ConfigError, match=r"profile=.* is not a range of this run's optimizer steps .*"
                                                 r"pass e\.g\. --profile 2:3") as e:
        rules.validate(cfg)
    assert str(e.value).replace("e.g. ", "").count(". ") == 0 and str(e.value).endswith(".")


def test_a_good_range_passes():
    assert rules.profile_steps("2:3") == (2, 3) and rules.profile_steps("4") == (4, 4)
    rules.validate(Config(steps=4, profile="1:4"))
    rules.validate(Config(steps=4, profile="3"))


# --------------------------------------------------------------------------------------- the merge
def _fake_rank(folder, rank, clock_us, base_ns, phases, host="node0"):
    """A rank's trace as the profiler writes it, on its machine's clock: its marker at `clock_us`, then `phases`
    (name, start after the marker µs, duration µs)."""
    events = [{"ph": "M", "name": "process_name", "pid": 4000 + rank, "tid": 0, "args": {"name": "python"}},
              {"ph": "M", "name": "thread_name", "pid": 4000 + rank, "tid": 7, "args": {"name": "thread 7 (python)"}},
              {"ph": "X", "cat": "user_annotation", "name": trace.START, "pid": 4000 + rank, "tid": 7,
               "ts": clock_us, "dur": 1.0},
              {"ph": "s", "id": 1, "pid": 4000 + rank, "tid": 7, "ts": clock_us, "name": "flow", "cat": "ac2g"}]
    events += [{"ph": "X", "cat": "user_annotation", "name": name, "pid": 4000 + rank, "tid": 7,
                "ts": clock_us + start, "dur": dur} for name, start, dur in phases]
    where = {"rank": rank, "dp": rank % 2, "pp": rank // 2, "cp": 0, "tp": 0, "device": "cpu", "host": host}
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump({"traceEvents": events, "baseTimeNanoseconds": base_ns, "picotron": where}, f)


def test_merge_aligns_machines_on_the_start_marker_and_keeps_one_machines_clock(tmp_path):
    """Ranks 0 and 1 share node0's clock: rank 1 left the barrier 300 µs late, and stays 300 µs late. Rank 2 is on
    node1, whose clock is 5 s ahead and whose file counts from another base: its marker lands on node0's first one,
    its phases keep their distance from it. Rows and ids are per rank; a missing rank is named."""
    _fake_rank(tmp_path, 0, 1000.0, 10**18, [("forward mb=0", 10.0, 50.0)])
    _fake_rank(tmp_path, 1, 1300.0, 10**18, [("forward mb=0", 10.0, 50.0)])
    _fake_rank(tmp_path, 2, 2000.0 + 5e6, 10**18 - 10**9, [("forward mb=0", 30.0, 50.0)], host="node1")
    assert trace.merge(str(tmp_path), 4) == [3]
    merged = _load(tmp_path / "merged.json")
    starts = {(pid, name): t for pid, name, t, _, _ in trace.phases(merged)}
    assert [starts[(r, trace.START)] for r in range(3)] == [0.0, 300.0, 0.0]
    assert [starts[(r, "forward mb=0")] for r in range(3)] == [10.0, 310.0, 30.0]
    # node1's marker on its own clock: 5 s + 1000 µs after node0's, less the 1 s its file's base is behind
    assert merged["picotron"]["clock_offsets_us"] == {"0": 0.0, "1": 0.0, "2": pytest.approx(1000.0 + 5e6 - 1e6)}
    assert merged["picotron"]["barrier_skew_us"] == {"0": 0.0, "1": 300.0, "2": 0.0}
    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"}
    assert names == {0: "rank 0 (dp 0, pp 0, cp 0, tp 0)", 1: "rank 1 (dp 1, pp 0, cp 0, tp 0)",
                     2: "rank 2 (dp 0, pp 1, cp 0, tp 0)"}
    assert sorted(e["id"] for e in merged["traceEvents"] if "id" in e) == ["0:1", "1:1", "2:1"]


def test_collectives_are_packed_on_lanes_in_the_trace_clock(tmp_path):
    """Two overlapping collectives (host seconds) land on two rows, at the marker's trace time plus their distance
    from the marker's host time, with their axis and bytes."""
    path = str(tmp_path / "rank0.json")
    _fake_rank(tmp_path, 0, 1000.0, 0, [])
    events = [{"name": "all-reduce", "start": 2.0, "end": 2.5, "kind": "comm", "axis_name": "dp", "bytes": 64},
              {"name": "all-gather", "start": 2.1, "end": 2.2, "kind": "comm", "axis_name": "tp", "bytes": 8},
              {"name": "all-reduce", "start": 2.6, "end": 2.7, "kind": "comm", "axis_name": "dp", "bytes": 64}]
    trace.add_collectives(path, events, mark=1.5, where={"rank": 0, "dp": 0, "pp": 0, "cp": 0, "tp": 0, "host": "n"})
    comm = [e for e in _load(path)["traceEvents"] if e.get("cat") == "picotron collective"]
    assert [(e["name"], e["tid"] - trace.COMM_TID) for e in comm] == [("all-reduce", 0), ("all-gather", 1),
                                                                         ("all-reduce", 0)]
    assert comm[0]["ts"] == pytest.approx(1000.0 + 0.5e6) and comm[0]["dur"] == pytest.approx(0.5e6)
    assert comm[1]["args"] == {"axis_name": "tp", "bytes": 8}


# ------------------------------------------------------------------------------------------ real runs
def test_one_process_profile_writes_a_trace_with_the_phases(tmp_path):
    """One process, steps 2 to 3: rank0.json parses and holds both steps, each micro-batch's forward and backward,
    the clip and the optimizer step inside their step; merged.json holds the one rank. The same run without
    --profile writes no traces and has the same losses, to the bit."""
    out = str(tmp_path / "run")
    profiled = run_on_ranks(_train_child, 1, dict(profile="2:3", grad_acc=2), out, timeout_s=300)[0]
    plain = run_on_ranks(_train_child, 1, dict(grad_acc=2), str(tmp_path / "plain"), timeout_s=300)[0]
    assert profiled == plain and len(plain) == 3
    assert not os.path.exists(tmp_path / "plain" / "traces")
    rows = trace.phases(_load(os.path.join(out, "traces", "rank0.json")))
    names = [name for _, name, *_ in rows]
    assert [n for n in names if n.startswith("step ")] == ["step 2", "step 3"]
    for want in ("forward mb=0", "forward mb=1", "backward mb=0", "backward mb=1", "clip grad norm",
                 "optimizer step"):
        assert names.count(want) == 2, (want, names)
    steps = [(s, e) for _, n, s, e, _ in rows if n.startswith("step ")]
    for _, n, s, e, _ in rows:
        if n != trace.START and not n.startswith("step "):
            assert any(a <= s and e <= b for a, b in steps), f"{n} is outside the profiled steps"
    merged = _load(os.path.join(out, "traces", "merged.json"))
    assert merged["picotron"]["missing"] == [] and list(merged["picotron"]["ranks"]) == ["0"]
    assert not os.path.exists(os.path.join(out, "traces", "memory_rank0.pickle"))  # CPU: no CUDA snapshot


def _four_ranks(tmp_path, name, layout):
    out = str(tmp_path / name)
    losses = run_on_ranks(_train_child, 4, layout, out, timeout_s=600)[0]
    return out, losses


@pytest.mark.heavy
def test_four_ranks_dp2_pp2_trace_every_rank_in_one_merged_view_with_unchanged_losses(tmp_path):
    """dp=2 x pp=2: four rank files and a merged.json with four named rows, each with its F and B of every micro-batch,
    its dp all-reduce and (pipeline) messages; the ranks' first step starts together; and the losses are those
    of the same run without --profile, to the bit."""
    layout = dict(dp=2, pp=2, grad_acc=4, pp_schedule="1f1b")
    out, profiled = _four_ranks(tmp_path, "profiled", dict(layout, profile="2:3"))
    _, plain = _four_ranks(tmp_path, "plain", layout)
    assert profiled == plain
    assert not os.path.exists(os.path.join(tmp_path, "plain", "traces"))
    folder = os.path.join(out, "traces")
    assert sorted(os.listdir(folder)) == ["merged.json", "rank0.json", "rank1.json", "rank2.json", "rank3.json"]
    merged = _load(os.path.join(folder, "merged.json"))
    rows = trace.phases(merged)
    assert sorted({pid for pid, *_ in rows}) == [0, 1, 2, 3]
    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"}
    assert names == {r: f"rank {r} (dp {r // 2}, pp {r % 2}, cp 0, tp 0)" for r in range(4)}
    for r in range(4):
        mine = [(name, args) for pid, name, _, _, args in rows if pid == r]
        for mb in range(4):
            for kind in ("forward", "backward"):
                assert sum(n.startswith(f"{kind} mb={mb} ") for n, _ in mine) == 2, (r, kind, mb)
        axes = {a.get("axis_name") for _, a in mine if "axis_name" in a}
        kinds = {a.get("collective") for _, a in mine if "collective" in a}
        assert {"dp_cp", "pp"} <= axes and {"all_reduce", "p2p"} <= kinds, (r, axes, kinds)
        assert all(a["bytes"] > 0 for _, a in mine if a.get("collective", "p2p") != "p2p")
        assert any(a["bytes_sent"] > 0 for _, a in mine if a.get("collective") == "p2p")
    # one machine, one clock: nothing shifted; every rank leaves the start barrier (and starts step 2) within 100 ms
    # of the first, on two cores shared by four processes
    assert set(merged["picotron"]["clock_offsets_us"].values()) == {0.0}
    skew = merged["picotron"]["barrier_skew_us"]
    first = {pid: s for pid, n, s, *_ in rows if n == "step 2"}
    marker = {pid: s for pid, n, s, *_ in rows if n == trace.START}
    assert sorted(first) == [0, 1, 2, 3] and max(first.values()) - min(first.values()) < 100e3
    assert all(marker[r] == pytest.approx(skew[str(r)], abs=1.0) for r in range(4)), (marker, skew)


@pytest.mark.heavy
def test_profiled_range_obeys_nccl_rules(tmp_path):
    """The profiled range's two world barriers, among dp=2 x pp=2's collectives and messages, replay clean under both
    models (replay's default checks the per-communicator one, then the one order across communicators)."""
    layout = dict(dp=2, pp=2, grad_acc=2, steps=2, profile="1:2")
    results = run_on_ranks(nccl_rules.run_recorded, 4, _train_child, layout, str(tmp_path / "run"), timeout_s=600)
    verdict = nccl_rules.replay([t for _, t in results])
    assert verdict.ok, verdict
    assert os.path.exists(tmp_path / "run" / "traces" / "merged.json")
