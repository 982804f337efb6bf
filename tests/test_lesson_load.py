"""The lessons' timing checks on a busy machine: a check of a time (a bubble, a balance, an overlap) either holds or
says "? ... inconclusive: the machine was busy (other programs used X% of the cores ...), rerun", never ✗, when
other programs keep the cores busy (here: one busy process per core, started and killed by the test, on top of
whatever else runs). The third mark is counted apart from ✓ and ✗ (`_common.check`, `summary`, `tally`), and is
given only when the measurement itself saw the load (`_common.LoadWindow`, `others_share`).

The default test runs lesson 06's balance (cp = 2) and lesson 07's bubble (1F1B) in FAST mode under the load and
executes the notebooks' own check cells on their results; the load tier (`./run.sh test load`) runs every cp and schedule, and both notebooks whole, under the load.
"""
import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lessons"))
import _common  # noqa: E402
import _notebook  # noqa: E402

# what a laptop's browser and idle-but-not-quite Jupyter look like to the lessons: matmuls and a 32 MiB array
# streamed through the caches, on one thread, until killed
LOAD = """
import torch
torch.set_num_threads(1)
a, b, big = torch.randn(512, 512), torch.randn(512, 512), torch.randn(8 * 2**20)
while True:
    a @ b
    big.mul_(1.0000001)
"""


@contextlib.contextmanager
def background_load(n=None):
    """One busy process per core (or n), killed on the way out."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", LOAD], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for _ in range(n or os.cpu_count() or 2)]
    try:
        time.sleep(1.0)  # let them start computing
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def run_cells(lesson, needles, namespace):
    """Execute the code cells of lessons/<lesson>/<lesson>.py that contain any of `needles` (the lesson's own check
    code), in `namespace`; return what they printed."""
    cells = _notebook.cells((ROOT / "lessons" / lesson / f"{lesson}.py").read_text(encoding="utf-8"))
    code = [src for kind, src in cells if kind == "code" and any(n in src for n in needles)]
    assert code, f"no code cell of {lesson} contains {needles}"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for src in code:
            exec(compile(src, f"{lesson}.py", "exec"), namespace)
    return out.getvalue()


def assert_no_fail(text, at_least):
    marks = _common.tally(text)
    assert not marks["failed"], text
    assert marks["passed"] + len(marks["inconclusive"]) >= at_least, text
    for line in marks["inconclusive"]:  # a "?" always names what it measured: the other programs' load, or (lesson
        # 07's bubble against its formula) how much one kind of action's time varied, the spread
        assert "inconclusive: the machine was busy (" in line and line.endswith("rerun"), line
        assert "(other programs used" in line or "(spread)" in line, line
    return marks


# ------------------------------------------------------------------------------------------ the third mark
def test_check_counts_inconclusive_apart_from_pass_and_fail(monkeypatch, capsys):
    monkeypatch.setattr(_common, "_counts", {mark: 0 for mark in _common.MARKS})
    busy = _common.busy_reason(0.4, what="during the step")
    assert busy == f"other programs used 40% of the {os.cpu_count()} cores during the step, above 10%"
    assert _common.busy_reason(0.05) is None and _common.busy_reason(None) is None  # quiet, or not measured
    assert _common.check("holds", True, "1 < 2", busy) == "✓"  # a check that holds is ✓, busy or not
    assert _common.check("parity", False, "1e-3 off") == "✗"  # no measured load: ✗
    assert _common.check("bubble", False, "41.9% vs 33.3%", busy) == "?"
    assert _common.check("bubble, quiet", False, "41.9% vs 33.3%", _common.busy_reason(0.02)) == "✗"
    _common.summary()
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0] == "✓ holds: 1 < 2" and lines[1] == "✗ parity: 1e-3 off"
    assert lines[2] == ("? bubble: 41.9% vs 33.3% — inconclusive: the machine was busy (other programs used 40% of the "
                        f"{os.cpu_count()} cores during the step, above 10%), rerun")
    assert lines[3].startswith("✗ bubble, quiet")
    assert lines[4] == "checks: 1 ✓ hold, 1 ? inconclusive (the machine was busy: rerun them), 2 ✗ fail"
    t = _common.tally(text)
    assert t["passed"] == 1 and len(t["inconclusive"]) == 1 and len(t["failed"]) == 2


def test_others_share_is_what_other_programs_used():
    cores = 2
    # 2 cores for 1 s: 1.5 core-seconds busy, of which our two processes used 0.5 + 0.3: others 0.7 of 2
    windows = [dict(wall=1.0, busy=1.5, own=0.5, load=3.0), dict(wall=0.98, busy=1.5, own=0.3, load=3.0)]
    assert _common.others_share(windows, cores) == pytest.approx(0.35)
    assert _common.others_share([dict(wall=1.0, busy=0.4, own=0.5, load=0.0)], cores) == 0.0  # clock granularity
    # no /proc/stat (macOS): the 1-minute load average beyond our processes, per core
    assert _common.others_share([dict(wall=1.0, busy=None, own=0.5, load=3.0)] * 2, cores) == pytest.approx(0.5)
    if _common.machine_busy_seconds() is None:
        pytest.skip("no /proc/stat here: the live measurement is the load-average fallback")
    with background_load():
        w = _common.LoadWindow()
        time.sleep(1.0)
        share = _common.others_share([w.stop()])
    assert share > 0.5, share  # one busy process per core, nothing of ours running


# --------------------------------------------------------------------------- the lessons' checks under load
def _balance_and_bubble(tmp_path, cps, schedules):
    """Lesson 06's balance at each cp and lesson 07's bubble for `schedules`, FAST, under one busy process per core;
    then the notebooks' check cells on their results. Returns (06's check lines, 07's)."""
    with background_load():
        for cp in cps:
            _common.launch("06_context_parallel/experiment.py", ["--out", tmp_path / "06", "--only", "balance",
                                                                 "--fast"], nproc=cp, quiet=True, timeout_s=900)
        _common.launch("07_pipeline_parallel/experiment.py", ["--out", tmp_path / "07", "--only", "bubble", "--fast",
                                                              "--schedules", ",".join(schedules)], nproc=2, quiet=True,
                       timeout_s=900)
    bal = {c: json.loads((tmp_path / "06" / f"balance_cp{c}.json").read_text())["results"] for c in cps}
    six = run_cells("06_context_parallel", ["zig-zag balances the ranks", "transfers hide under the compute"],
                    dict(bal=bal, r2=bal[2], check=_common.check, _common=_common))
    rows = json.loads((tmp_path / "07" / "bubble_pp2.json").read_text())["results"]["rows"]
    seven = run_cells("07_pipeline_parallel", ["measured bubble within 5 points of the formula"],
                      dict(rows=rows, lesson=_common.load_lesson("07_pipeline_parallel"), check=_common.check,
                           _common=_common))
    print(six + seven)
    return six, seven, bal, rows


def test_timing_checks_of_06_and_07_hold_or_say_busy_under_load(tmp_path):
    six, seven, bal, rows = _balance_and_bubble(tmp_path, (2,), ("1f1b",))
    assert_no_fail(six, 4)  # zig-zag, contiguous's ratio, its order, the hidden transfers
    assert_no_fail(seven, 4)  # 1F1B at m = 2, 4, 8, and the bubble shrinking with m
    # the load was measured where the checks decide: one busy process per core takes a large share of the cores
    assert bal[2]["busy"] > _common.BUSY_SHARE, bal[2]["busy"]
    assert max(r["busy"] for r in rows) > _common.BUSY_SHARE, [r["busy"] for r in rows]


@pytest.mark.load
def test_timing_checks_of_06_and_07_at_every_cp_and_schedule_under_load(tmp_path):
    six, seven, _, rows = _balance_and_bubble(tmp_path, (2, 4), ("afab", "1f1b", "interleaved", "zb-h1", "zb-v"))
    assert_no_fail(six, 7)
    assert_no_fail(seven, 15)


@pytest.mark.load
@pytest.mark.parametrize("lesson", ["06_context_parallel", "07_pipeline_parallel"])
def test_notebook_in_fast_mode_under_load_has_no_fail(lesson, run_notebook):
    with background_load():
        text = run_notebook(lesson, timeout=1800)
    marks = assert_no_fail(text, 39 if lesson.startswith("06") else 45)
    summary = [line for line in text.splitlines() if line.startswith("checks: ")]
    print(f"{lesson}, FAST, under load: {summary}\n" + "\n".join(marks["inconclusive"]))
    assert summary == [f"checks: {marks['passed']} ✓ hold, {len(marks['inconclusive'])} ? inconclusive (the machine "
                       f"was busy: rerun them), 0 ✗ fail"], summary


def test_the_notebook_runner_counts_inconclusive_checks_apart():
    """lessons/_notebook.py and figures/make.py report ✓, ?, ✗ separately: a '?' is neither a pass nor a failure."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("pass")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="✓ a: ok\n? b: late — inconclusive: the "
                                           "machine was busy (x), rerun\n✗ c: wrong\n✓ d: ok\n")]
    nb.cells.append(cell)
    failed, passed, errors = _notebook.results(nb)
    assert (failed, passed, errors) == (["✗ c: wrong"], 2, [])
    assert [line[:4] for line in _notebook.inconclusive(nb)] == ["? b:"]
