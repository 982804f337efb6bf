"""`./run.sh lessons` opens Jupyter on copies of the lesson notebooks (runs/notebooks/NN_topic/NN_topic.ipynb), never on
the tracked ones: running a lesson must not rewrite a committed notebook (only ./run.sh figures NN does). The copies
run as the originals do (they import lessons/_common.py and this lesson's experiment.py), a copy the learner changed is
never lost, and one changed after its lesson's notebook is kept."""
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lessons"))
import _notebook  # noqa: E402


@pytest.fixture(autouse=True)
def _signatures(tmp_path, monkeypatch):
    """The copies are signed into Jupyter's signature database (lessons/_notebook._sign): here, one of the test's own."""
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "jupyter"))


def _fingerprint(folder):
    """{path: (sha256, mtime)} of every file under folder (lessons/), caches aside."""
    return {str(p): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file() and "__pycache__" not in p.parts
            and ".ipynb_checkpoints" not in p.parts}


def test_run_sh_lessons_prepares_copies_and_leaves_lessons_untouched(tmp_path):
    import nbformat

    before = _fingerprint(ROOT / "lessons")
    into = tmp_path / "notebooks"
    env = {**os.environ, "PICOTRON_NOTEBOOKS": str(into)}
    out = subprocess.run(["bash", "run.sh", "lessons", "--prepare-only"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    first = out.stdout.strip().splitlines()[-1]  # (set-up lines, if any, come before)
    lessons = sorted(d.name for d in (ROOT / "lessons").glob("[0-9][0-9]_*") if d.is_dir())
    assert first.startswith(f"== Jupyter on {into}/") and f"{len(lessons)} made" in first, out.stdout
    for name in lessons:
        copy = nbformat.read(into / name / f"{name}.ipynb", as_version=4)
        tracked = nbformat.read(ROOT / "lessons" / name / f"{name}.ipynb", as_version=4)
        # the tracked notebook's cells and outputs, less its widgets' (their models lived in the kernel that made them)
        assert [(c.cell_type, c.source, c.get("outputs")) for c in copy.cells[1:]] == \
               [(c.cell_type, c.source, [o for o in c.get("outputs", []) if _notebook.WIDGET_VIEW not in o.get("data", {})]
                 if c.cell_type == "code" else None) for c in tracked.cells], f"{name}: not the tracked notebook"
        assert "widgets" not in copy.metadata
        assert f"os.chdir({str(ROOT / 'lessons' / name)!r})" in copy.cells[0].source
        assert 'os.environ.setdefault("PICOTRON_FAST", "0")' in copy.cells[0].source  # the FAST switch
        assert _trusted(copy, tmp_path / "jupyter"), f"{name}: the copy is not signed: it would open Not Trusted"
    assert _fingerprint(ROOT / "lessons") == before, "preparing the copies changed a file under lessons/"
    again = subprocess.run(["bash", "run.sh", "lessons", "--prepare-only"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
    assert f"({len(lessons)} as it was)" in again.stdout, again.stdout


def _trusted(nb, data_dir):
    """Whether Jupyter (its signature database in data_dir) opens `nb` trusted."""
    from nbformat.sign import NotebookNotary

    return NotebookNotary(data_dir=str(data_dir)).check_signature(nb)


def test_interactive_labels_its_controls_and_draws_a_plain_figure_headless(monkeypatch):
    """lessons/_common.interactive: every control gets a label (its argument's name unless it has one) and sliders
    send their value on release; executed headless (PICOTRON_HEADLESS=1, as lessons/_notebook.py runs notebooks) it
    draws the default figure once, without widgets. (tests/test_browser.py drives the live widget.)"""
    import _common

    monkeypatch.setenv("PICOTRON_HEADLESS", "1")
    made, drawn = {}, []

    def controls(w):
        made.update(n=w.IntSlider(value=1), s=w.Dropdown(options=["x", "y"], description="schedule"),
                    t=w.ToggleButtons(options=["p", "q"]))
        return made
    _common.interactive(lambda **kw: drawn.append(kw), controls)
    assert drawn == [{}]
    assert {k: c.description for k, c in made.items()} == {"n": "n", "s": "schedule", "t": "t"}
    assert made["n"].continuous_update is False


def test_a_copy_runs_where_its_lesson_does(tmp_path, monkeypatch):
    """The copy's first cells in its own folder (as Jupyter starts the kernel there): lesson 01's set-up cell imports
    lessons/_common.py, picotron and the lesson's experiment.py, and prints where its results go."""
    import nbformat

    _notebook.scratch(tmp_path, ["01"])
    path = tmp_path / "01_single_device" / "01_single_device.ipynb"
    nb = nbformat.read(path, as_version=4)
    nb.cells = [c for c in nb.cells if c.cell_type == "code"][:2]
    monkeypatch.setenv("PICOTRON_FAST", "1")
    _notebook.run_cells(nb, path.parent, timeout_s=300)
    text = "".join(o.get("text", "") for c in nb.cells for o in c.outputs)
    assert "FAST=True, results in runs/lessons/01_single_device" in text, text


def _lesson(root, text):
    """A one-lesson lessons/ folder in root, its notebook printing `text`."""
    import nbformat

    folder = root / "lessons" / "01_probe"
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(f"print({text!r})")]),
                   folder / "01_probe.ipynb")
    return folder / "01_probe.ipynb"


def _later(path, than):
    """Make path's modification time a few seconds after `than`'s (the file systems' clocks are coarse)."""
    t = than.stat().st_mtime + 5
    os.utime(path, (t, t))


def test_the_rules_of_a_copy(tmp_path):
    into = tmp_path / "notebooks"
    tracked = _lesson(tmp_path, "v1")
    lessons = tracked.parent.parent
    copy = into / "01_probe" / "01_probe.ipynb"

    def scratch(fresh=False):
        return dict(_notebook.scratch(into, fresh=fresh, lessons=lessons))["01_probe"]

    assert scratch() == "made" and "v1" in copy.read_text()
    assert scratch() == "as it was"
    # the tracked notebook changes (git pull): an untouched copy is made again
    _lesson(tmp_path, "v2")
    _later(tracked, copy)
    assert scratch() == "made again" and "v2" in copy.read_text()
    assert list(copy.parent.glob("*.before-*")) == []
    # the learner changes the copy after the tracked notebook's last change: it is theirs, even when that changes later
    copy.write_text(copy.read_text().replace("v2", "mine"))
    _later(copy, tracked)
    assert scratch() == "as it was" and "mine" in copy.read_text()
    _lesson(tmp_path, "v3")
    _later(copy, tracked)  # changed by the learner after the new tracked notebook: kept
    assert scratch() == "kept" and "mine" in copy.read_text()
    report = _notebook.scratch_report([("01_probe", "kept")], into)
    assert "kept yours" in report and "--fresh 01" in report
    # the tracked notebook changes after the learner's last edit: made again, the learner's kept alongside
    _later(tracked, copy)
    what = scratch()
    assert what.startswith("made again (yours is kept as 01_probe/01_probe.before-"), what
    assert "v3" in copy.read_text()
    backups = list(copy.parent.glob("01_probe.before-*.ipynb"))
    assert len(backups) == 1 and "mine" in backups[0].read_text()
    # --fresh: every copy again, a changed one kept alongside
    copy.write_text(copy.read_text().replace("v3", "mine again"))
    _later(copy, tracked)
    assert scratch(fresh=True).startswith("made again (yours is kept as")
    assert "v3" in copy.read_text() and len(list(copy.parent.glob("01_probe.before-*.ipynb"))) == 2


def test_executing_a_lesson_from_the_command_line_writes_a_copy(tmp_path, monkeypatch):
    """`python lessons/_notebook.py NN --run fast|full` builds and executes a copy: by default into runs/lessons/NN/,
    never the committed notebook (its cells are replaced by a quick stand-in here)."""
    calls = []
    monkeypatch.setattr(_notebook, "execute", lambda nb, fast, cwd: calls.append((Path(nb), fast, cwd)) or ([], 1, []))
    before = _fingerprint(ROOT / "lessons" / "03_data_parallel")
    assert _notebook.main(["03_data_parallel", "--run", "fast", "--out", str(tmp_path)]) == 0
    assert calls[-1] == (tmp_path / "03_data_parallel.ipynb", True, _notebook.LESSONS / "03_data_parallel")
    assert (tmp_path / "03_data_parallel.ipynb").is_file()
    monkeypatch.setattr(_notebook, "build", lambda src, dst: calls.append(("build", Path(dst))))
    assert _notebook.main(["03_data_parallel", "--run", "full"]) == 0
    assert calls[-2] == ("build", ROOT / "runs" / "lessons" / "03_data_parallel" / "03_data_parallel.ipynb")
    assert _fingerprint(ROOT / "lessons" / "03_data_parallel") == before
