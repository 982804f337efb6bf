"""Lesson 10: the notebook is its source and runs in FAST mode with every check holding; the exercise checker passes
the solutions, fails the stubs naming NotImplementedError, and names typical mistakes (a flat range taken from the
whole tensor, a box written through a strided copy, a missing piece loaded as zeros, Young without its factor 2,
Daly without its −C, a level-1 step taken with a missing shard, a peer copy looked for on the wrong node); the
experiment's formulas by hand (Young, Daly, the waste model, two levels, the failure
rate from the Llama 3 run) and its simulation against the model.

No timing is asserted here: the notebook prints its timings but checks none of them.
"""
import math
import sys
from pathlib import Path

import pytest
from _lessons import solution_tools

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lessons"))

run_checker, mutate, fails_with = solution_tools("10_checkpoints_and_faults")


@pytest.fixture(scope="module")
def lesson():
    import _common

    return _common.load_lesson("10_checkpoints_and_faults")


def test_checker_passes_the_solutions():
    code, out = run_checker("--solutions", as_learner=True)
    assert code == 0, out
    assert "all checks passed" in out and "FAIL" not in out
    assert out.count("  ok  ") == 4, out


def test_checker_fails_the_stubs_naming_not_implemented():
    code, out = run_checker()
    assert code == 1, out
    for name in ("cut", "assemble", "interval", "resume_point"):
        assert f"FAIL  {name}: NotImplementedError: not written yet" in out, out


def test_checker_names_cut_mistakes(tmp_path):
    out = fails_with(tmp_path, "cut", ("return region if flat is None else region.reshape(-1)[flat[0]:flat[1]]",
                                       "return region if flat is None else full.reshape(-1)[flat[0]:flat[1]]"))
    assert "FAIL  cut: a row-parallel weight, tp 2 x ZeRO-1 over dp 2, entry 0 (offsets (0, 0), box (12, 5), flat " \
           "(0, 30)): you took elements 0..29 of the whole tensor flattened; the range counts inside the rank's box" in out, out
    out = fails_with(tmp_path, "cut", ("full[tuple(slice(o, o + n) for o, n in zip(offsets, box))]",
                                       "full[tuple(slice(o, n) for o, n in zip(offsets, box))]"))  # box read as an end
    assert "FAIL  cut: a row-parallel weight, tp 2 x ZeRO-1 over dp 2, entry 2 (offsets (0, 5), box (12, 5), flat " \
           "(0, 30)): shape (0,), expected (30,)" in out, out


def test_checker_names_assemble_mistakes(tmp_path):
    out = fails_with(tmp_path, "assemble", ("        full[where], covered[where] = region, have\n", ""),
                     ("region, have = full[where].clone(), covered[where].clone()",
                      "region, have = full[where], covered[where]"),
                     ("region.view(-1)[a:b]", "region.reshape(-1)[a:b]"), ("have.view(-1)[a:b]", "have.reshape(-1)[a:b]"))
    assert "FAIL  assemble: a row-parallel weight, tp 2 x ZeRO-1 over dp 2, pieces in rank order: raised " \
           "ValueError(no piece holds element (0, 0)) but the pieces cover every element: a box cut along a later " \
           "dimension is a strided view" in out, out
    out = fails_with(tmp_path, "assemble", ("        full[where], covered[where] = region, have\n",
                                            "        covered[where] = have\n"),
                     ("region, have = full[where].clone(), covered[where].clone()",
                      "region, have = full[where], covered[where].clone()"),
                     ("region.view(-1)[a:b]", "region.reshape(-1)[a:b]"))
    assert "pieces in rank order: element (0, 0) is 0, expected 1: it is still 0, so that piece's values never " \
           "reached the tensor" in out, out
    out = fails_with(tmp_path, "assemble", ("    if not bool(covered.all()):", "    if False:"))
    assert "the last piece missing: returned a tensor (elements nobody wrote read as zeros)" in out, out


def test_checker_names_interval_mistakes(tmp_path):
    out = fails_with(tmp_path, "interval", ("young = math.sqrt(2 * cost_s * mtbf_s)", "young = math.sqrt(cost_s * mtbf_s)"))
    assert "FAIL  interval: C = 60 s, θ = 10800 s: young = 1138.42" not in out  # the message shows the learner's value
    assert "young = 804.984, expected 1138.42: sqrt(C·θ) lacks the factor 2" in out, out
    out = fails_with(tmp_path, "interval", ("x / 9) - cost_s", "x / 9)"))
    assert "daly = " in out and "Daly subtracts the save's cost C" in out, out


def test_checker_names_resume_point_mistakes(tmp_path):
    out = fails_with(tmp_path, "resume_point", ("if all(", "if any("))  # one surviving shard taken for the step
    assert "FAIL  resume_point: 3 nodes of 2 ranks, nodes 1 and 2 lost (a rank and its peer copy both gone) (level 2 " \
           "at step 6): returned (1, 8), expected (2, 6): took a level-1 step with a missing shard: rank 2's shard of " \
           "step 8 is neither on node 1 (its own) nor on node 2 (the next node: its peer copy)" in out, out
    out = fails_with(tmp_path, "resume_point", ("(r // per_node + 1) % nodes, step)",
                                                "(r // per_node - 1) % nodes, step)"))  # the previous node
    assert "3 nodes of 2 ranks, node 1 lost (level 2 at step 6): returned (2, 6), expected (1, 8): passed over level-1 " \
           "step 8, complete on the nodes' disks; rank 2's shard survives only as its peer copy on node 2, the next " \
           "node (not node 0, the previous one)" in out, out
    out = fails_with(tmp_path, "resume_point", ("        if step <= level2_step:\n            break",
                                                "        if False:\n            break"))  # level 2 forgotten
    assert "level 2 newer than every level-1 step (level 2 at step 12): returned (1, 11), expected (2, 12): level-1 " \
           "step 11 is not newer than level 2's step 12" in out, out


def test_young_daly_and_the_waste_model(lesson):
    C, M = 60.0, 3 * 3600.0
    assert lesson.young(C, M) == pytest.approx(math.sqrt(2 * 60 * 10800))
    x = C / (2 * M)
    assert lesson.daly(C, M) == pytest.approx(math.sqrt(2 * C * M) * (1 + math.sqrt(x) / 3 + x / 9) - C)
    assert lesson.daly(900, 300) == 300  # C >= 2M: the interval is M
    # the waste model's minimum is at Young's interval (derivative -C/T² + 1/(2M) = 0)
    grid = [lesson.young(C, M) * f for f in (0.8, 0.9, 1.0, 1.1, 1.25)]
    wastes = [lesson.waste_model(t, C, M, 300) for t in grid]
    assert wastes.index(min(wastes)) == 2
    # Llama 3: 419 unexpected interruptions in 54 days on 16,384 GPUs -> a job MTBF of about 3.1 hours
    assert lesson.mtbf_hours(16384) == pytest.approx(54 * 24 / 419)
    assert lesson.mtbf_hours(8) == pytest.approx(54 * 24 * 16384 / 419 / 8)


def test_two_levels_by_hand(lesson):
    c1, c2, M, R, p = 2.0, 60.0, 3 * 3600.0, 300.0, 0.9
    t1, t2, w = lesson.two_level(c1, c2, M, R, p)
    assert t1 == pytest.approx(math.sqrt(2 * c1 * M / p)) and t2 == pytest.approx(math.sqrt(2 * c2 * M / (1 - p)))
    assert w == pytest.approx(c1 / t1 + c2 / t2 + (p * t1 / 2 + (1 - p) * t2 / 2 + R) / M)
    assert w < lesson.waste_model(lesson.young(c2, M), c2, M, R)  # a cheap first level helps


def test_the_simulation_agrees_with_the_model(lesson):
    """Months of work at one interval: the simulated share of lost time within 15% of the first-order model (which
    ignores failures during saves and restarts); no failures at all: only the saving costs."""
    C, M, R = 60.0, 3 * 3600.0, 300.0
    t = lesson.young(C, M)
    sim = sum(lesson.simulate_waste(t, C, M, R, 3600 * 24 * 60, seed=s) for s in range(3)) / 3
    assert sim == pytest.approx(lesson.waste_model(t, C, M, R), rel=0.15)
    no_failures = lesson.simulate_waste(1000.0, 10.0, 1e15, R, 100_000.0)
    assert no_failures == pytest.approx(10.0 / 1010.0, rel=1e-6)


def test_restarts_are_parsed_from_the_output(lesson):
    lines = [(1.0, "step     7/9 | loss 4.5000 | lr"),
             (1.5, "picotron: fault injected: rank 1 loses its node and kills itself during step 8"),
             (9.0, "restart 1: resuming from level 1 (node-local) step 6, rank 1 from the next node's copy at step 7"),
             (9.5, "step     7/9 | loss 4.5000 | lr"), (10.0, "step     8/9 | loss 4.2500 | lr"),
             (11.0, "picotron: fault injected: rank 0 kills itself during step 9"),
             (18.0, "restart 2: resuming from OUT/checkpoints/step_000008 at step 9"),
             (19.5, "step     9/9 | loss 4 | lr")]
    assert lesson.restarts(lines) == [dict(killed=8, resumed=6, level=1, redone=2, seconds=8.5),
                                      dict(killed=9, resumed=8, level=2, redone=1, seconds=8.5)]


def test_attempts_are_parsed_from_the_output(lesson):
    text = "\n".join(["step     1/4 | loss 5.5000 | lr", "step     2/4 | loss 5.0000 | lr",
                      "picotron: fault injected: rank 1 kills itself during step 3",
                      "restart 1: resuming from OUT/checkpoints/step_000002 at step 3",
                      "step     3/4 | loss 4.5000 | lr", "step     4/4 | loss 4.0000 | lr"])
    assert lesson.attempts(text) == [[(1, 5.5), (2, 5.0), ("fault", "step 3")], [(3, 4.5), (4, 4.0)]]


def test_notebook_runs_in_fast_mode(run_notebook):
    text = run_notebook("10_checkpoints_and_faults", timeout=600)
    assert "✗" not in text, text
    assert text.count("✓") >= 15, text
    assert "NotImplementedError: not written yet" in text  # the exercise cell ran the checker on the stubs
    assert "the final loss equals the run without faults, bit for bit" in text
    assert "picotron | Mesh" not in text  # the children's progress lines stay out of the notebook
