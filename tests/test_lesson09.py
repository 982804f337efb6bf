"""Lesson 09: the notebook is its source and runs in FAST mode with every check holding; the exercise checker passes
the solutions, fails the stubs naming NotImplementedError, and names typical mistakes (dp numbered fastest, a group
along the wrong axis or out of order; the sequences divided over dp x cp or over every rank, the micro-batch
forgotten, a rank's tokens not divided by cp, the bubble relative to the useful time, an impossible batch
accepted); the experiment's helpers (links of the groups, another numbering, the bytes formula against a
hand count, the timeline's classes and shares, the parity matrix's table) by hand.

No timing is asserted here: the notebook prints its timings but checks none of them.
"""
import json
import re
import sys
from pathlib import Path

import pytest
from _lessons import solution_tools

from picotron.mesh import group_ranks

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "lessons" / "09_all_together"
sys.path.insert(0, str(ROOT / "lessons"))

run_checker, mutate, fails_with = solution_tools("09_all_together")


@pytest.fixture(scope="module")
def lesson():
    import _common

    return _common.load_lesson("09_all_together")


# ------------------------------------------------------------------------------------------- the checker
def test_checker_passes_the_solutions():
    code, out = run_checker("--solutions", as_learner=True)
    assert code == 0, out
    assert "all checks passed" in out and "FAIL" not in out
    assert out.count("  ok  ") == 5, out


def test_checker_fails_the_stubs_naming_not_implemented():
    code, out = run_checker()
    assert code == 1, out
    for name in ("place", "step_batch", "memory_by_part", "choose", "clock_shifts"):
        assert f"FAIL  {name}: NotImplementedError: not written yet" in out, out


def test_checker_names_placement_mistakes(tmp_path):
    out = fails_with(tmp_path, "place", ("    for d in reversed(ORDER):\n        r, coords[d]",
                                         "    for d in ORDER:\n        r, coords[d]"))
    assert "FAIL  place: dp2·pp2·cp2·tp2, rank 1: coordinates" in out and "you numbered dp fastest" in out, out
    # the tp group built along dp: the ranks that differ in dp
    out = fails_with(tmp_path, "place", ("            c = dict(coords, **{axis: i})",
                                         "            c = dict(coords, **{({'tp': 'dp'}).get(axis, axis): i % sizes["
                                         "({'tp': 'dp'}).get(axis, axis)]})"))
    assert "rank 0: tp group [0, 8], expected [0, 1]: that is its dp group" in out, out
    out = fails_with(tmp_path, "place", ("        groups[axis] = ranks", "        groups[axis] = ranks[::-1]"))
    assert "rank 0: dp group [8, 0], expected [0, 8]: the right ranks, but in the order of their dp" in out, out


def test_checker_names_batch_mistakes(tmp_path):
    out = fails_with(tmp_path, "step_batch", ('per_step = sizes["dp"] * micro_batch_size',
                                              'per_step = sizes["dp"] * sizes["cp"] * micro_batch_size'))
    assert "dp4·pp2·cp2·tp4: grad_acc = 16, expected 32: you divided by dp x cp" in out, out
    out = fails_with(tmp_path, "step_batch", ('per_step = sizes["dp"] * micro_batch_size',
                                              'per_step = sizes["dp"] * sizes["pp"] * sizes["cp"] * sizes["tp"] '
                                              '* micro_batch_size'))
    assert ("dp128·pp16·cp1·tp8: raised ValueError('1024 sequences are not a multiple of dp x micro-batch = 16384'), "
            "but this batch is reachable: 1024 sequences = dp 128 x micro-batch 1 x 8 micro-steps") in out, out
    out = fails_with(tmp_path, "step_batch", ('per_step = sizes["dp"] * micro_batch_size', 'per_step = sizes["dp"]'))
    assert "you forgot the micro-batch size" in out, out
    out = fails_with(tmp_path, "step_batch", ('micro_batch_size * seq_len // sizes["cp"]', 'micro_batch_size * seq_len'))
    assert "cp cuts every sequence, so each rank holds seq_len / cp tokens" in out, out
    out = fails_with(tmp_path, "step_batch", ('bubble=(sizes["pp"] - 1) / (grad_acc + sizes["pp"] - 1)',
                                              'bubble=(sizes["pp"] - 1) / grad_acc'))
    assert "(pp-1)/m is the bubble relative to the useful time" in out, out
    out = fails_with(tmp_path, "step_batch", ("    if sequences % per_step:\n        raise", "    if False:\n        raise"))
    assert "no whole number of micro-steps gives this batch" in out and "raise ValueError" in out, out


def test_checker_names_memory_mistakes(tmp_path):
    out = fails_with(tmp_path, "memory_by_part", ('"optimizer": 12 * params', '"optimizer": 8 * params'))
    assert "optimizer = " in out and "8 bytes per parameter are AdamW's moments" in out, out
    out = fails_with(tmp_path, "memory_by_part", ("shard = layout.dp * layout.cp", "shard = layout.dp"))
    assert "llama3-8b, s=8192, dp4,cp2,zero3,mbs1,ga8, stage 0" in out and "you sharded over dp = 4" in out, out
    out = fails_with(tmp_path, "memory_by_part", ('(shard if z >= 2 else 1)', '(shard if z >= 1 else 1)'))
    assert "dp8,tp2,pp4,zero1,mbs1,ga16, stage 0" in out and "ZeRO-1 does not shard the grads" in out, out
    out = fails_with(tmp_path, "memory_by_part", ("alive = min(layout.pp - stage, layout.grad_acc)",
                                                  "alive = layout.grad_acc"))
    assert "activations = " in out and "is AFAB's peak; 1F1B keeps pp - stage" in out, out
    out = fails_with(tmp_path, "memory_by_part", ("alive = min(layout.pp - stage, layout.grad_acc)",
                                                  "alive = layout.pp - stage"))
    assert "dp4,pp8,zero1,mbs1,ga3, stage 0" in out and "only m = 3 micro-batches exist" in out, out


def test_checker_names_choice_mistakes(tmp_path):
    out = fails_with(tmp_path, "choose", ("        elif layout.dp * layout.micro_batch_size * layout.grad_acc != global_seqs:\n"
                                          "            rejected.append((layout, \"batch\"))\n", ""))
    assert re.search(r"you kept dp16,zero3,mbs1,ga8 \([\d.]+ GiB, 128 sequences per step\): it runs 128 sequences per "
                     r"step, not 256", out), out
    out = fails_with(tmp_path, "choose", ("best = min(kept, key=step_seconds)", "best = min(kept, key=memory_gib)"))
    assert re.search(r"you picked tp8,pp2,1f1b,mbs1,ga256, the one needing the least memory \([\d.]+ GiB\); step 3 "
                     r"maximises throughput: dp8,tp2,sp,zero1,mbs1,ga32 takes", out), out
    # the batch checked first: a layout failing both gets the wrong reason
    out = fails_with(tmp_path, "choose", (
        "        if memory_gib(layout) > budget_gib:\n            rejected.append((layout, \"memory\"))\n"
        "        elif layout.dp * layout.micro_batch_size * layout.grad_acc != global_seqs:\n"
        "            rejected.append((layout, \"batch\"))",
        "        if layout.dp * layout.micro_batch_size * layout.grad_acc != global_seqs:\n"
        "            rejected.append((layout, \"batch\"))\n        elif memory_gib(layout) > budget_gib:\n"
        "            rejected.append((layout, \"memory\"))"))
    assert re.search(r"you rejected dp8,tp2,mbs1,ga8 \([\d.]+ GiB, 64 sequences per step\) for 'batch', expected "
                     r"'memory' \(it fails both", out), out
    out = fails_with(tmp_path, "choose", ("memory_gib(layout) > budget_gib", "memory_gib(layout) > 80"))
    assert re.search(r"on 16 GPUs of 71.7 GiB.*you kept dp16,zero1,mbs1,ga16 \([\d.]+ GiB, 256 sequences per step\): "
                     r"it needs 73.6 GiB > 71.7", out), out


def test_checker_names_clock_mistakes(tmp_path):
    out = fails_with(tmp_path, "clock_shifts", ("return {rank: first[hosts[rank]] for rank in markers}",
                                                "return dict(markers)"))
    assert "4 ranks on 1 machine(s), rank 1: shift 1300.0 µs, expected 1000.0: you shifted every rank by its own " \
           "marker, which adds its lag in leaving the barrier (300 µs)" in out, out
    out = fails_with(tmp_path, "clock_shifts", ("return {rank: first[hosts[rank]] for rank in markers}",
                                                "return {rank: min(markers.values()) for rank in markers}"))
    assert "4 ranks on 2 machine(s), rank 2: shift 1000.0 µs, expected 5001900.0: one shift for every rank keeps " \
           "the machines' clocks apart" in out, out
    out = fails_with(tmp_path, "clock_shifts", ("min(t, first.get(hosts[rank], t))", "max(t, first.get(hosts[rank], t))"))
    assert "that is the machine's LAST rank to leave the barrier" in out, out


# ------------------------------------------------------------------------------------- the experiment's helpers
def test_links_follow_the_rank_order(lesson):
    sizes = dict(dp=2, pp=2, cp=2, tp=2)
    info = lesson.groups_and_links(sizes, 4)
    assert info["tp"]["groups"] == group_ranks(sizes, "tp")
    assert set(info["tp"]["links"]) == {"intra"} and set(info["cp"]["links"]) == {"intra"}
    assert set(info["pp"]["links"]) == {"inter"} and info["dp"]["nodes"] == 2
    assert lesson.link_of([0, 3], 4) == "intra" and lesson.link_of([3, 4], 4) == "inter"
    # picotron's own order reproduces the mesh; the reversed one makes tp's groups strided
    same = lesson.groups_with_order(sizes, ("dp", "pp", "cp", "tp"))
    assert all(same[a] == group_ranks(sizes, a) for a in ("dp", "pp", "cp", "tp"))
    assert lesson.groups_with_order(sizes, ("tp", "cp", "pp", "dp"))["tp"][0] == [0, 8]
    big = lesson.groups_and_links(dict(dp=8, pp=4, cp=1, tp=8), 8)
    assert big["tp"]["nodes"] == 1 and big["pp"]["nodes"] == 4 and big["dp"]["nodes"] == 8


def _fake_result(lesson, layout, params=1000):
    st = dict(lesson.settings(False), layout=layout)
    ranks = [dict(params=params, coords=None)] * (layout["dp"] * layout["pp"] * layout["cp"] * layout["tp"])
    return dict(layout=layout, settings=st, hidden=128, kv_heads=4, head_dim=16, layers=4, ranks=ranks)


def test_bytes_formula_by_hand(lesson):
    res = _fake_result(lesson, dict(dp=2, pp=2, cp=2, tp=2))
    b, s, h, m = 4, 64, 128, 4  # micro-batch 4, 128 tokens over cp = 2, 4 micro-batches
    first = lesson.bytes_formula(res, dict(dp=0, pp=0, cp=0, tp=0))
    last = lesson.bytes_formula(res, dict(dp=1, pp=1, cp=1, tp=1))
    # 2 layers per stage: 4 all-reduces each + the embedding's (first) / the head's f + 3 small ones (last)
    assert first["tp"] == m * 9 * b * s * h * 4
    assert last["tp"] == m * (9 * b * s * h * 4 + 3 * b * s * 4)
    # ring: a block is K and V of 2 kv heads (4 over tp = 2): forward 1 block, backward 1 block + 2 dK/dV
    block = 2 * b * 2 * s * 16 * 4
    assert first["cp"] == m * 2 * 4 * block
    assert first["pp"] == last["pp"] == m * b * s * h * 4
    assert first["dp_cp"] == 4 * 1000 + 4 and first["world"] == 4
    res1 = _fake_result(lesson, dict(dp=1, pp=2, cp=1, tp=1))
    assert set(lesson.bytes_formula(res1, dict(dp=0, pp=0, cp=0, tp=0))) == {"pp", "world"}


def test_measured_bytes_and_shares(lesson):
    rank = dict(log=[("all_reduce", 100, "tp"), ("all_reduce", 50, "tp"), ("broadcast", 4, "pp"),
                     ("all_reduce", 8, "dp_cp"), ("all_reduce", 4, "world"), ("send", 10, "cp"), ("send", 20, "cp"),
                     ("send", 12, "pp"), ("send", 18, "pp")],
                start=0.0, end=10.0,
                events=[dict(name="forward", start=0.0, end=4.0), dict(name="all-reduce", axis_name="tp", start=1.0,
                                                                          end=2.0),
                        dict(name="wait", start=1.5, end=3.0), dict(name="backward", start=5.0, end=9.0),
                        dict(name="all-reduce bucket 0", axis_name="dp_cp", start=8.0, end=9.5),
                        dict(name="optimizer", kind="compute", start=9.5, end=10.0)])
    assert lesson.measured_bytes(rank) == {"tp": 150, "dp_cp": 8, "world": 4, "cp": 30, "pp": 30}
    sh = lesson.shares(rank)
    assert sh["step"] == 10.0 and sh["tp"] == 1.0 and sh["cp"] == 1.5 and sh["dp_cp"] == 1.5
    assert sh["idle"] == pytest.approx(1.0)  # 4-5 s: nothing running
    assert sh["compute"] == pytest.approx(10.0 - 1.0 - (3.0 - 1.0) - 1.5)  # comm counted once where they overlap
    assert [lesson.event_class(e) for e in rank["events"]] == ["F", "tp", "cp", "B", "dp_cp", "optimizer"]


def test_the_matrix_table(lesson):
    matrix = json.loads((ROOT / "figures" / "09_parity_matrix.json").read_text())
    grid = lesson.matrix_table(matrix)
    assert sum(len(v) for v in grid.values()) == len(matrix["rows"])
    assert set(grid["dp2-pp2-cp2-tp2"]) == {"", "sp", "zero1", "sp+zero1"}
    assert set(grid["dp1-pp1-cp1-tp1"]) == {""}
    assert all(r["passed"] and not r.get("refused") for r in grid["dp2-pp2-cp2-tp2+ep2"].values())  # experts with cp run


def test_plots_draw(lesson):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.close(lesson.plot_grid4d(dict(dp=2, pp=2, cp=2, tp=2), 4))
    plt.close(lesson.plot_grid4d(dict(dp=3, pp=1, cp=1, tp=4), 8))
    plt.close(lesson.plot_matrix(json.loads((ROOT / "figures" / "09_parity_matrix.json").read_text())))


def test_trace_rows_and_messages_from_a_merged_trace(lesson, tmp_path):
    """Section 2b's helpers on a hand-made merged trace of pp2 (tp1): the rows by class, and the receive's wait
    inside stage 1's forward ending after stage 0's forward of that micro-batch (and not, when stage 1's clock is
    shifted 5 ms early)."""
    def x(pid, name, ts, dur, **args):
        return {"ph": "X", "cat": "user_annotation", "name": name, "pid": pid, "tid": 1, "ts": ts, "dur": dur,
                "args": args}
    events = [x(0, "step 3", 0, 900), x(0, "forward mb=0 chunk=0 stage=0", 10, 100),
              x(1, "step 3", 0, 900), x(1, "forward mb=0 chunk=0 stage=1", 20, 200), x(1, "wait p2p", 25, 90),
              dict(x(1, "all-reduce", 300, 50, axis_name="dp_cp", collective="all_reduce", bytes=8),
                   cat="picotron collective"),
              dict(x(1, "p2p activation", 5, 100, axis_name="pp", collective="p2p", bytes_sent=0),
                   cat="picotron collective")]
    events += [{"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                "args": {"name": f"rank {r} (dp 0, pp {r}, cp 0, tp 0)"}} for r in (0, 1)]
    rows, steps, names = lesson.trace_rows({"traceEvents": events})
    assert [c for c, *_ in rows[1]] == ["F", "pp", "dp_cp"] and steps[0] == (0.0, 0.9)
    assert lesson.messages_after_sends(rows, names) == [(1, "mb=0", "F", pytest.approx(0.005))]
    early = {r: [(c, s - (0.01 if r == 1 else 0), e - (0.01 if r == 1 else 0), n) for c, s, e, n in v]
             for r, v in rows.items()}
    assert lesson.messages_after_sends(early, names)[0][3] < 0
    assert lesson.trace_args("runs/x", "cpu")[:4] == ["--preset", "tiny", "--tp", "2"]


# ------------------------------------------------------------------------------------------ the notebook
def test_notebook_runs_in_fast_mode(run_notebook):
    text = run_notebook("09_all_together", timeout=600)
    assert "✗" not in text, text
    assert text.count("✓") >= 9, text
    assert "NotImplementedError: not written yet" in text  # the exercise cell ran the checker on the stubs
    assert "every rank's bytes per step, on every axis, are the formula's" in text
