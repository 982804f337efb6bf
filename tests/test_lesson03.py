"""Lesson 03: the exercise checker (the solutions pass; the stubs fail naming NotImplementedError; a wrong gradient is
reported with its rank, its parameter and the likely cause; a hang with the waiting rank and its line; a wrong
answer to the bucket-size puzzle with the slip it matches), the timeline model the widget draws, the emulated link's
sizing, and the notebook end to end in FAST mode.

No timing is asserted: on a shared CPU timings are measurements, not pass/fail criteria.
"""
import sys
from pathlib import Path

import pytest
from _lessons import checker

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "lessons" / "03_data_parallel" / "solution.py"
sys.path.insert(0, str(ROOT / "lessons"))


run_checker = checker('03_data_parallel', timeout=240)


def test_checker_passes_the_solutions():
    code, out = run_checker("--solutions", as_learner=True)
    assert code == 0, out
    assert "all checks passed" in out and "FAIL" not in out
    assert out.count("  ok  ") == 8, out  # 3 exercises x 2 world sizes, the puzzle's model check and its real run
    assert "best_bucket_mb, measured on an emulated link: your " in out and "emulated link: " in out, out


def test_checker_fails_the_stubs_naming_not_implemented():
    code, out = run_checker()
    assert code == 1, out
    for what in ("NaiveDP.average_gradient", "BucketedDP.on_gradient_ready", "BucketedDP.no_sync",
                 "exposed_time + best_bucket_mb: exposed_time ("):
        assert f"FAIL  {what}" in out, out
    assert out.count(" on 2 ranks: rank ") == 3 and out.count("NotImplementedError: not written yet") == 4, out
    assert "measured on an emulated link" not in out  # no real run before the model check passes
    assert "on 3 ranks" not in out  # it stops at the first world size


def wrong_solutions(tmp_path):
    """The solutions with two bugs: rank 1 forgets to divide by the world size (after the all-reduce, so only its
    own copy is off), and only rank 0 launches the bucket all-reduces (so it waits forever)."""
    text = SOLUTIONS.read_text()
    bugs = [("        p.grad.div_(self.world_size)  # all-reduce sums: divide first (or after), once\n"
             "        dist.all_reduce(p.grad, group=self.group)",
             "        dist.all_reduce(p.grad, group=self.group)\n"
             "        if dist.get_rank() == 0:\n"
             "            p.grad.div_(self.world_size)"),
            ("            if self.sync:\n                bucket.buffer.div_",
             "            if self.sync and dist.get_rank() == 0:\n                bucket.buffer.div_")]
    for old, new in bugs:
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "wrong.py"
    path.write_text(text)
    return path


def test_checker_names_the_rank_of_a_wrong_gradient_and_of_a_hang(tmp_path):
    code, out = run_checker("--module", str(wrong_solutions(tmp_path)), "average_gradient", "on_gradient_ready",
                            "--timeout", "5")
    assert code == 1, out
    assert "FAIL  NaiveDP.average_gradient on 2 ranks: wrong gradient on rank 1 for parameter " in out, out
    assert "off by a factor 2 = the world size: all_reduce SUMS the ranks' gradients" in out, out
    assert "on 3 ranks: wrong gradient on rank 1 for parameter " in out and "off by a factor 3" in out, out
    assert "hang: rank 0 still waiting after 5 s" in out, out
    assert "rank 1 finished and waited for it" in out, out
    assert "rank 0 waits in finish_sync, line " in out and "bucket.work.wait()" in out, out


def puzzle_with(tmp_path, old, new):
    text = SOLUTIONS.read_text()
    assert old in text, old
    path = tmp_path / "puzzle.py"
    path.write_text(text.replace(old, new))
    return path


@pytest.mark.parametrize("old, new, message", [
    ("link_free = max(ready, link_free) + latency", "link_free = ready + latency",
     "your all-reduces start as soon as their bucket is ready, even while the previous one is still on the link"),
    ("2 * (n - 1) / n * size / bandwidth", "size / bandwidth",
     "a ring all-reduce over n ranks sends 2(n-1)/n of the buffer per rank"),
    ("    return min(candidates, key=lambda mb:", "    return max(candidates) or min(candidates, key=lambda mb:",
     "you chose 256 MiB (1 bucket), which leaves "),
])
def test_checker_names_the_slip_in_a_wrong_puzzle_answer(tmp_path, old, new, message):
    code, out = run_checker("--module", str(puzzle_with(tmp_path, old, new)), "bucket_size")
    assert code == 1, out
    assert "FAIL  exposed_time + best_bucket_mb: " in out and message in out, out
    assert "measured on an emulated link" not in out, out


# ------------------------------------------------------------------------------------- the widget's model
@pytest.fixture(scope="module")
def lesson():
    import _common

    return _common.load_lesson("03_data_parallel")


def test_model_timeline_one_bucket_is_all_exposed(lesson):
    sizes, n = [4 * 1000] * 10, 4
    buckets, exposed = lesson.model_timeline(sizes, backward_s=1.0, bucket_bytes=1e9, latency_s=0.01, busbw=1e6, n=n)
    assert len(buckets) == 1 and buckets[0][0] == pytest.approx(1.0)  # ready when backward ends
    assert exposed == pytest.approx(0.01 + 2 * (n - 1) / n * 40_000 / 1e6)


def test_model_timeline_hides_all_but_the_last_bucket(lesson):
    sizes = [1000] * 10
    buckets, exposed = lesson.model_timeline(sizes, backward_s=1.0, bucket_bytes=0, latency_s=0.001, busbw=1e9, n=2)
    assert len(buckets) == 10  # bucket_bytes=0: one per tensor
    assert [b[0] for b in buckets] == pytest.approx([0.1 * (k + 1) for k in range(10)])
    assert exposed == pytest.approx(0.001 + 1000 / 1e9)  # only the last tensor's all-reduce sticks out
    _, slow = lesson.model_timeline(sizes, backward_s=1.0, bucket_bytes=0, latency_s=0.2, busbw=1e9, n=2)
    assert slow > 0.2  # messages longer than the compute between them queue up


def test_the_solution_of_the_puzzle_is_the_lessons_model(lesson):
    import random

    import _checker
    solution = _checker.load(SOLUTIONS, "sol03")
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([4, 1000, 65536, 2**20]) for _ in range(rng.randint(1, 40))]
        args = (rng.uniform(0.01, 1), rng.choice([0, 1000, 2**16, 2**20, 2**30]), rng.uniform(1e6, 1e10),
                rng.uniform(0, 0.02), rng.randint(2, 64))
        _, exposed = lesson.model_timeline(sizes, args[0], args[1], args[3], args[2], args[4])
        assert solution.exposed_time(sizes, *args) == pytest.approx(exposed, rel=1e-9, abs=1e-12)


def test_choose_link_sizes_the_link_from_backward(lesson):
    grad_bytes, backward = 13_100_000, 0.14
    bandwidth, latency = lesson.choose_link(grad_bytes, backward, n=2)
    assert grad_bytes / bandwidth == pytest.approx(0.4 * backward, rel=0.05)  # all gradients: 40% of backward
    assert latency == pytest.approx(backward / 30, rel=0.05)
    buckets, exposed = lesson.model_timeline([grad_bytes / 39] * 39, backward, 2**20, latency, bandwidth)
    _, one = lesson.model_timeline([grad_bytes / 39] * 39, backward, 2**30, latency, bandwidth)
    _, per_tensor = lesson.model_timeline([grad_bytes / 39] * 39, backward, 0, latency, bandwidth)
    assert exposed < 0.5 * one and exposed < 0.5 * per_tensor  # on such a link the middle sizes win clearly


# ------------------------------------------------------------------------------------- the notebook
def test_notebook_runs_in_fast_mode(run_notebook):
    text = run_notebook("03_data_parallel", timeout=600)
    assert "✗" not in text, text
    assert text.count("✓") >= 13, text
    assert "emulated link: " in text, text
    assert "NotImplementedError: not written yet" in text  # the exercise cell ran the checker on the stubs


# ------------------------------------------------------------------------------------- the parity check
def test_parity_compares_the_window_and_reports_the_drift_after_it():
    """The parity standard compares the first 10 steps within 1e-5; later steps are drift, against 1e-3."""
    import _common

    ref = [5.0 - 0.1 * i for i in range(30)]
    drifting = [r * (1 + 1e-7 * 1.35**i) for i, r in enumerate(ref)]  # rounding that Adam amplifies: 1e-7 -> 6e-4
    p = _common.parity(drifting, ref)
    assert p["ok"] and p["window"] == 10 and p["worst"] < 1e-5
    assert p["n_beyond"] == 20 and p["first_over"] == 17 and p["beyond"] > 1e-5 and p["drift_ok"]
    buggy = list(ref)
    buggy[1] *= 1 + 4e-3  # a wrong gradient shows at step 2
    assert not _common.parity(buggy, ref)["ok"]
    assert not _common.parity([r * (1 + 2e-3) for r in ref], ref)["drift_ok"]
    assert not _common.parity(ref[:9], ref[:9])["ok"]  # fewer steps than the standard: no parity claim
    short = _common.parity(ref[:10], ref[:10])
    assert short["ok"] and short["n_beyond"] == 0 and short["beyond"] is None and short["drift_ok"]
