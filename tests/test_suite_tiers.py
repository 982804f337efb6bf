"""The suite's tiers and its stop button.

Tiers (tests/conftest.py's TIERS, docs/tests.md): every test is in exactly one of default, lessons, heavy, load and
browser. `./run.sh test` runs the default tier (12 minutes on 2 idle cores), `./run.sh test lessons` the notebooks and
the checkers' runs on wrong answers, `./run.sh test heavy` the runs with more processes, `./run.sh test load` lessons 06
and 07 under a competing load (not in CI), `./run.sh test all` the four;
`./run.sh test quick` runs tests/quick.txt's list (3.5 minutes). The quick list cannot go stale: every entry must name
a test that collects. The tests below read the tiers off one real collection, so a tier cannot lose what it promises.

Ctrl-C (SIGINT, sent to the whole process group as a terminal does) and SIGTERM (to pytest alone, as `kill` or a CI
timeout does) end the run at once with pytest's KeyboardInterrupt summary, while a test is deep in a launch: processes
from run_on_ranks, or a notebook whose cell runs torchrun. Nothing it started may be left running.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import LESSONS_FILES, ROOT, quick_entries

PROBE = "PICOTRON_SIGNAL_PROBE"  # set by the tests below for the pytest they start: where the probes say "ready"

# A pytest plugin for the collection below: every test's tier and whether the quick list names it, as JSON.
TIER_PROBE = """
import json, os

def pytest_collection_finish(session):
    import conftest  # tests/conftest.py, imported by then
    with open(os.environ["TIER_PROBE_OUT"], "w") as f:
        json.dump({i.nodeid: [conftest.tier_of(i), bool(i.get_closest_marker("quick"))] for i in session.items}, f)
"""


# ------------------------------------------------------------------------------------------------------- tiers
@pytest.fixture(scope="module")
def tiers(tmp_path_factory):
    """{node id: (tier, in the quick list)} of every test, from one real collection of every tier."""
    folder = tmp_path_factory.mktemp("tiers")
    (folder / "tier_probe.py").write_text(TIER_PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]),
           "TIER_PROBE_OUT": str(folder / "tiers.json")}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-p", "tier_probe", "--tier=all", "--tier=browser"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return {k: tuple(v) for k, v in json.loads((folder / "tiers.json").read_text()).items()}


def test_every_quick_entry_names_a_test_and_every_strategy_has_one(tiers):
    entries = quick_entries()
    assert len(entries) == len(set(entries)), "tests/quick.txt lists a test twice"
    for module in ("collectives", "config", "first_hour", "data_parallel", "zero", "tensor_parallel",
                   "pipeline_parallel", "context_parallel", "expert_parallel", "nccl_rules", "checkpoint", "train",
                   "model", "parallelize", "hsdp", "async_tp", "ep_overlap", "trace"):
        assert any(e.startswith(f"tests/test_{module}.py") for e in entries), f"the quick tier has no test_{module}"
    assert not any("notebook_runs" in e for e in entries), "a notebook takes a minute: not in the quick tier"
    for entry in entries:  # a renamed or removed test would shrink the list without anyone noticing
        assert any(c == entry or c.startswith(entry + "::") or c.split("[")[0] == entry for c in tiers), entry
    quick = [n for n, (tier, q) in tiers.items() if q]
    assert len(quick) >= 60, len(quick)
    assert not [n for n in quick if tiers[n][0] in ("heavy", "browser")], "the quick list is for a 2-core laptop"


def test_the_tiers_hold_what_they_promise(tiers):
    by_tier = {}
    for node, (tier, _) in tiers.items():
        by_tier.setdefault(tier, []).append(node)
    assert set(by_tier) == {"default", "lessons", "heavy", "load", "browser"}
    default, lessons, heavy = (set(by_tier[t]) for t in ("default", "lessons", "heavy"))
    # the twelve notebooks' executions (lessons 00-11), and the checkers' runs on wrong answers, are the lessons tier's
    notebooks = [n for n in tiers if n.endswith("::test_notebook_runs_in_fast_mode")]
    assert len(notebooks) == 12 and set(notebooks) <= lessons
    assert not [n for n in default if "::test_checker_" in n]
    for nn in range(0, 12):  # every lesson's checker on its solutions, in the lessons tier
        assert f"tests/test_lesson{nn:02d}.py::test_checker_passes_the_solutions" in lessons, nn
    # the load tier: lessons 06 and 07 whole under a competing load (left out of CI), nothing else
    assert {n.split("::")[0] for n in by_tier["load"]} == {"tests/test_lesson_load.py"}
    assert [n for n in by_tier["load"] if "test_notebook_in_fast_mode_under_load" in n]
    # no 16-process run by default: the matrix's four-degree variants are heavy
    assert [n for n in heavy if "dp2-pp2-cp2-tp2" in n] and not [n for n in default if "dp2-pp2-cp2-tp2" in n]
    # the same coverage: every test file with a test outside the lessons and browser tiers keeps one by default
    files = {n.split("::")[0] for n in default | heavy} - set(LESSONS_FILES)
    assert not files - {n.split("::")[0] for n in default}, files - {n.split("::")[0] for n in default}


def test_a_stale_quick_entry_stops_the_quick_run(tmp_path, monkeypatch):
    import conftest

    stale = tmp_path / "quick.txt"
    stale.write_text("tests/test_suite_tiers.py::test_that_was_renamed\n")
    monkeypatch.setattr(conftest, "QUICK_LIST", str(stale))
    config = type("Config", (), {"getoption": lambda self, flag: flag == conftest.QUICK_FLAG})()
    item = type("Item", (), {"nodeid": "tests/test_suite_tiers.py::test_x", "add_marker": lambda self, m: None})()
    with pytest.raises(pytest.UsageError, match="test_that_was_renamed"):
        conftest._quick_tier(config, [item])


# ------------------------------------------------------------------------------ probes (run only by the tests below)
probe = pytest.mark.skipif(PROBE not in os.environ, reason="started by test_a_signal_ends_the_run")


def _ready(name):
    Path(os.environ[PROBE], f"ready-{name}").touch()


def _sleep_on_a_rank():
    _ready(f"rank{os.environ['RANK']}")
    time.sleep(600)


@probe
def test_probe_ranks():
    from picotron.launch import run_on_ranks

    run_on_ranks(_sleep_on_a_rank, 2, timeout_s=600)


@probe
def test_probe_notebook(run_notebook):
    import nbformat

    folder = Path(os.environ[PROBE])
    script = folder / "sleeper.py"
    script.write_text("import os, pathlib, time\n"
                      f"pathlib.Path({str(folder)!r}, 'ready-torchrun' + os.environ['RANK']).touch()\n"
                      "time.sleep(600)\n")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        f"from picotron.launch import run_torchrun\nrun_torchrun({str(script)!r}, 2, timeout_s=600)")])
    nbformat.write(nb, folder / "probe.ipynb")
    run_notebook(str(folder / "probe.ipynb"), timeout=600)


# --------------------------------------------------------------------------------------------------- the signals
def _interrupted_on_rank_1():
    if os.environ["RANK"] == "1":
        raise KeyboardInterrupt  # what Ctrl-C raises in a rank
    time.sleep(30)


def test_a_rank_stopped_by_ctrl_c_stops_the_caller():
    """A rank's KeyboardInterrupt is the user's Ctrl-C, not a failed rank: run_on_ranks raises KeyboardInterrupt
    (not RankError, which a test would report as failed and the suite go on from), and stops the other rank."""
    from picotron.launch import run_on_ranks

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_on_ranks(_interrupted_on_rank_1, 2, timeout_s=60)
    assert time.monotonic() - start < 20


def _probe_processes(folder):
    """pids of the processes whose environment carries PROBE=folder (the pytest started here, and all below it)."""
    token = f"{PROBE}={folder}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if token in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                pass
    return found


@pytest.mark.skipif(not os.path.isdir("/proc") or not hasattr(os, "killpg"), reason="needs Linux's /proc")
@pytest.mark.parametrize("probe_name,sig", [pytest.param("ranks", signal.SIGINT, marks=pytest.mark.heavy),
                                            pytest.param("notebook", signal.SIGINT, marks=pytest.mark.heavy),
                                            pytest.param("ranks", signal.SIGTERM, marks=pytest.mark.heavy),
                                            ("notebook", signal.SIGTERM)],
                         ids=["ranks-SIGINT", "notebook-SIGINT", "ranks-SIGTERM", "notebook-SIGTERM"])
def test_a_signal_ends_the_run(tmp_path, probe_name, sig):
    """pytest on a test that waits deep in a launch: the signal ends the run in seconds, as interrupted (exit status
    2, "KeyboardInterrupt"), not as a failed test the suite goes on from; no process it started is left."""
    want = 2
    env = {**os.environ, PROBE: str(tmp_path), "OMP_NUM_THREADS": "1"}
    # Python's own Ctrl-C handler even where this pytest was started with SIGINT ignored (`cmd &` in a script),
    # which its children would inherit: a terminal's foreground pytest has it
    run = ("import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); "
           f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_suite_tiers.py::test_probe_{probe_name}']))")
    proc = subprocess.Popen([sys.executable, "-c", run],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group, the terminal's foreground one
    try:
        deadline = time.monotonic() + 180
        while len(list(tmp_path.glob("ready-*"))) < want:
            assert proc.poll() is None, f"the probe ended before it was ready:\n{proc.communicate()[0]}"
            assert time.monotonic() < deadline, "the probe did not start within 180 s"
            time.sleep(0.2)
        time.sleep(0.5)
        start = time.monotonic()
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # Ctrl-C in a terminal: the whole foreground process group
        else:
            proc.send_signal(sig)  # `kill PID`: pytest alone
        out = proc.communicate(timeout=60)[0]
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out
    assert "KeyboardInterrupt" in out and " failed" not in out and " passed" not in out, out
    assert took < 30, f"{took:.0f} s from the signal to the end:\n{out}"
    left = _probe_processes(tmp_path)
    deadline = time.monotonic() + 10  # the fork server notices its parent is gone and exits by itself
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _probe_processes(tmp_path)
    names = [open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ")[:150] for p in left if os.path.exists(f"/proc/{p}")]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"left running after the run ended: {names}\n{out}"
