"""Shared test set-up: make `import picotron` work without `pip install -e .`.

Multi-rank tests use `picotron.launch.run_on_ranks`; the functions they run on each rank must live at
module level in a test file (children import them by name), and the children inherit this sys.path.

The tiers (docs/tests.md; `TIERS` below): every test is in one of default, lessons, heavy, load and browser, and
`--tier=NAME` (repeatable; `all` = default, lessons, heavy and load) runs those; no flag, the default tier. `--quick` runs
the list in tests/quick.txt (3.5 minutes on an idle 2-core machine: each strategy's fastest parity test, the
configuration messages, collectives, a few NCCL replays, no notebook), whatever tier each of its tests is in.

Ctrl-C (SIGINT) stops the run at once with pytest's KeyboardInterrupt summary, and so does SIGTERM (turned into a
KeyboardInterrupt here): the running test's launches stop their processes (picotron.launch; a notebook's kernel is
interrupted, lessons/_notebook.run_cells), and whatever this session started that is still alive when the
interrupted session ends is killed (every process it starts carries PICOTRON_TEST_SESSIONS in its environment).
"""
import importlib.util
import os
import re
import signal
import sys
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# The rank processes of run_on_ranks fork from a server that has imported torch; within one test session the
# project's code does not change, so the server imports picotron's modules once too (picotron.launch._context),
# and picotron.warm does there what each rank process would do first.
os.environ.setdefault("PICOTRON_PRELOAD", "picotron.train,picotron.nccl_rules,picotron.collectives,picotron.warm")
# run_on_ranks' hang guard for tests that name none: far above any such test's time on a loaded 2-core machine, so
# a slow machine never fails a test by time alone (tests of the timeout itself pass their own, small, timeout_s).
os.environ.setdefault("PICOTRON_RANK_TIMEOUT_S", "300")


def _notebook_module():
    """lessons/_notebook.py (the notebook runner that figures/make.py and the CLI use too)."""
    if "_notebook" not in sys.modules:
        spec = importlib.util.spec_from_file_location("_notebook", os.path.join(ROOT, "lessons", "_notebook.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["_notebook"] = module
    return sys.modules["_notebook"]


@pytest.fixture
def run_notebook(monkeypatch):
    """Execute lessons/<name>/<name>.ipynb (or the notebook at the path `name`) top to bottom in FAST mode (in its
    folder, as Jupyter does); return the text its code cells printed. Ctrl-C stops it (lessons/_notebook.run_cells)."""
    import nbclient  # noqa: F401  in requirements.txt: a missing package must fail the test, not skip it
    import nbformat

    def run(name, timeout=300):
        monkeypatch.setenv("PICOTRON_FAST", "1")
        path = name if name.endswith(".ipynb") else os.path.join(ROOT, "lessons", name, f"{name}.ipynb")
        nb = nbformat.read(path, as_version=4)
        _notebook_module().run_cells(nb, os.path.dirname(os.path.abspath(path)), timeout)
        return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)

    return run


# ------------------------------------------------------------------------------------------------------ the tiers
# Every test belongs to exactly one tier (docs/tests.md); `./run.sh test NAME` runs one, `./run.sh test all` every
# one but the browser's. A test outside the tiers asked for is skipped, with the command that runs it, or, when the
# default tier is not asked for either, left out of the run.
TIERS = {
    "default": "every module and strategy: each parity layout at 2-4 processes (three at 8), every rule's message, "
               "the main job, collectives, the NCCL replays, the lessons' experiments' own functions",
    "lessons": "the twelve notebooks executed in FAST mode, the exercise checkers on the solutions and on wrong "
               "answers, the lessons under load",
    "heavy": "more processes on the default tier's code paths: the whole parity matrix (up to 16 processes), every "
             "schedule at pp = 4, 8-process collectives, more reshard pairs, the benchmarks' smoke runs",
    "load": "whole lessons 06 and 07 and their timing checks at every cp and schedule with every core kept busy by "
            "another program: each check holds or says inconclusive, never fails (run before changing a timing check)",
    "browser": "the lessons' widgets in JupyterLab and Notebook 7 in headless Chromium (needs chromium and playwright)",
}
ALL = ("default", "lessons", "heavy", "load")  # `--tier all`; the browser tier needs a browser, so it is asked for by name

# The lessons tier, by name, so that a new lesson's tests land in it without a marker: in tests/test_lessonNN.py the
# notebook executions (test_notebook_*) and the checker runs (test_checker_*); and every
# test of tests/test_lesson_load.py (the timing checks under a competing load).
LESSON_FILE = re.compile(r"tests/test_lesson\d\d\.py$")
LESSONS_FILES = ("tests/test_lesson_load.py",)
LESSONS_KEPT = ()  # (each lesson's checker on its solutions is the lessons tier's too: 10-20 s each)

# The quick tier: a list, not a tier of its own: tests/quick.txt, 3.5 minutes on an idle 2-core machine.
QUICK_FLAG = "--quick"
QUICK_LIST = os.path.join(ROOT, "tests", "quick.txt")

# Older spellings, kept: each adds its tier to those asked for.
ADD_FLAGS = {"--heavy": "heavy", "--parity-matrix": "heavy", "--lessons": "lessons", "--browser": "browser"}


def tier_of(item):
    """The one tier `item` belongs to: its marker (browser, heavy, parity_matrix, lessons), else its file and name."""
    path, name = item.nodeid.split("::")[0], item.nodeid.split("::")[-1].split("[")[0]
    if item.get_closest_marker("browser"):
        return "browser"
    if item.get_closest_marker("load"):
        return "load"
    if item.get_closest_marker("heavy") or item.get_closest_marker("parity_matrix"):
        return "heavy"
    if item.get_closest_marker("lessons") or path in LESSONS_FILES or LESSON_FILE.search(path) and (
            name.startswith("test_notebook") or name.startswith("test_checker") and name not in LESSONS_KEPT):
        return "lessons"
    return "default"


def chosen_tiers(config):
    tiers = set()
    for name in config.getoption("--tier") or ["default"]:
        tiers |= set(ALL) if name == "all" else {name}
    return tiers | {tier for flag, tier in ADD_FLAGS.items() if config.getoption(flag)}


def quick_entries(path=None):
    """tests/quick.txt's entries: a node id (`tests/f.py::test[id]`), a test with all its parameters
    (`tests/f.py::test`) or a whole file (`tests/f.py`); `#` starts a comment."""
    with open(path or QUICK_LIST, encoding="utf-8") as f:
        return [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]


def _in_quick(nodeid, entry):
    return nodeid == entry or nodeid.startswith(entry + "::") or nodeid.split("[")[0] == entry


def pytest_addoption(parser):
    parser.addoption("--tier", action="append", choices=sorted(TIERS) + ["all"],
                     help="run this tier (repeatable; default: default). " +
                          "; ".join(f"{k}: {v}" for k, v in TIERS.items()) + "; all: default, lessons, heavy and load")
    parser.addoption(QUICK_FLAG, action="store_true", default=False,
                     help="run only the quick tier, the tests listed in tests/quick.txt (3.5 minutes on 2 idle cores)")
    for flag, tier in ADD_FLAGS.items():
        parser.addoption(flag, action="store_true", default=False, help=f"also run the {tier} tier (= --tier {tier})")


def pytest_configure(config):
    for marker in ("heavy", "parity_matrix"):
        config.addinivalue_line("markers", f"{marker}: in the heavy tier ({TIERS['heavy']}); --tier heavy")
    config.addinivalue_line("markers", f"lessons: in the lessons tier ({TIERS['lessons']}); --tier lessons")
    config.addinivalue_line("markers", f"load: in the load tier ({TIERS['load']}); --tier load")
    config.addinivalue_line("markers", f"browser: in the browser tier ({TIERS['browser']}); --tier browser")
    config.addinivalue_line("markers", f"quick: in the quick list (tests/quick.txt, {QUICK_FLAG}); set by conftest")
    _own_the_signals()


def pytest_collection_modifyitems(config, items):
    if config.getoption(QUICK_FLAG):  # the quick list is a selection of its own, whatever tier its tests are in
        return _quick_tier(config, items)
    tiers, dropped = chosen_tiers(config), []
    for item in items:
        tier = tier_of(item)
        if tier in tiers:
            continue
        if "default" in tiers:
            item.add_marker(pytest.mark.skip(reason=f"in the {tier} tier: ./run.sh test {tier} (pytest --tier {tier})"))
        else:
            dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        gone = set(map(id, dropped))
        items[:] = [item for item in items if id(item) not in gone]
    _quick_tier(config, items)


def _quick_tier(config, items):
    """Mark the quick tier's tests `quick` (so `-m quick` works too); with --quick, keep only them."""
    entries = quick_entries()
    kept, dropped = [], []
    for item in items:
        if any(_in_quick(item.nodeid, e) for e in entries):
            item.add_marker(pytest.mark.quick)
            kept.append(item)
        else:
            dropped.append(item)
    if not config.getoption(QUICK_FLAG):
        return
    files = {item.nodeid.split("::")[0] for item in items}
    unmatched = [e for e in entries if not os.path.exists(os.path.join(ROOT, e.split("::")[0]))
                 or e.split("::")[0] in files and not any(_in_quick(i.nodeid, e) for i in items)]
    if unmatched:  # a renamed or removed test: the tier must not shrink without anyone noticing
        raise pytest.UsageError(f"tests/quick.txt names tests that do not exist: {', '.join(unmatched)}")
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


# ------------------------------------------------------------------------------ Ctrl-C and SIGTERM end the run
SESSIONS_VAR = "PICOTRON_TEST_SESSIONS"  # every process this session starts inherits it: how leftovers are found
_SESSION = f"{os.getpid()}-{time.time_ns()}"


def _sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise KeyboardInterrupt("SIGTERM")


def _own_the_signals():
    """SIGTERM becomes a KeyboardInterrupt (by default it would end pytest with no clean-up, leaving its children
    running); and this session's mark goes into the environment its processes inherit."""
    os.environ[SESSIONS_VAR] = " ".join(filter(None, (os.environ.get(SESSIONS_VAR), _SESSION)))
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _sigterm)


def pytest_runtest_setup(item):
    # again before each test: a library may have put its own handler in (nbclient's execute() resets SIGTERM)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is not _sigterm:
        signal.signal(signal.SIGTERM, _sigterm)


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        stopped = stop_leftovers(_SESSION)
        if stopped:
            print(f"\nconftest: stopped {len(stopped)} process(es) this interrupted session had started "
                  f"(pids {', '.join(map(str, stopped))})", file=sys.stderr, flush=True)


def session_processes(session):
    """The pids of the processes (other than this one) whose environment carries `session` in SESSIONS_VAR
    (Linux /proc; elsewhere none are found)."""
    found, token = [], f"{SESSIONS_VAR}=".encode()
    try:
        pids = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if any(v.startswith(token) and session.encode() in v[len(token):].split() for v in env):
            found.append(pid)
    return found


def stop_leftovers(session, grace_s=3.0):
    """SIGTERM the processes of `session` still alive, then SIGKILL those left after grace_s; return their pids."""
    pids = session_processes(session)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in set(session_processes(session)) & set(pids):  # still there (and still ours: not a reused pid)
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and set(session_processes(session)) & set(pids):
            time.sleep(0.1)
    return pids
