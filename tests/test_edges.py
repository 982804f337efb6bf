"""The environment and the command line are read at the edges only (issue 42), and passed down from there.

picotron.config reads the settings' (PICOTRON_LAUNCHER, PICOTRON_LAUNCHER_DEFAULTS), picotron.launch the
launcher's (RANK, WORLD_SIZE, LOCAL_RANK, ...: `launch.place`), picotron.data Hugging Face's own; a module's
`if __name__ == "__main__":` block reads its command line. Every other module takes what it needs as arguments, so
a test or a lesson that calls it gets what it passes, not what the process it runs in happens to have (pytest's
argv, a notebook's environment). The full list of variables is picotron.launch's docstring.
"""
import ast
import pathlib
import sys

from picotron import launch, runs
from picotron.config import Config
from picotron.messages import resume_hint

PICOTRON = pathlib.Path(__file__).resolve().parent.parent / "picotron"
EDGES = {"config.py", "launch.py", "data.py"}  # data.py: HF_HUB_OFFLINE and HF_ENDPOINT, Hugging Face's own


def _main_blocks(tree):
    """The line ranges of `if __name__ == "__main__":` blocks (a module's own command line: an edge)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and \
                isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__":
            out.append((node.lineno, node.end_lineno))
    return out


def reads(path):
    """[(line, what)] where `path` reads os.environ, os.getenv or sys.argv (or imports them by name), outside its
    `if __name__ == "__main__":` blocks."""
    tree = ast.parse(path.read_text())
    blocks = _main_blocks(tree)
    found = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                (node.value.id, node.attr) in (("os", "environ"), ("os", "getenv"), ("os", "putenv"), ("sys", "argv")):
            what = f"{node.value.id}.{node.attr}"
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "sys") and \
                any(a.name in ("environ", "getenv", "argv") for a in node.names):
            what = f"from {node.module} import ..."
        if what and not any(a <= node.lineno <= b for a, b in blocks):
            found.append((node.lineno, what))
    return sorted(found)


def test_the_environment_and_argv_are_read_at_the_edges_only():
    stray = [f"picotron/{name}:{line}: {what}" for p in sorted(PICOTRON.rglob("*.py"))
             if (name := p.relative_to(PICOTRON).as_posix()) not in EDGES for line, what in reads(p)]
    assert not stray, ("read the environment or sys.argv at the edges (picotron.config, picotron.launch.place, a "
                       "`__main__` block) and pass the value down:\n" + "\n".join(stray))
    assert all((PICOTRON / name).exists() for name in EDGES)  # (a renamed file must be renamed here too)


def test_the_checker_finds_a_read(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os, sys\nx = os.environ.get('RANK')\ny = sys.argv[1:]\n"
                   "if __name__ == '__main__':\n    print(sys.argv)\n")
    assert reads(bad) == [(2, "os.environ"), (3, "sys.argv")]


def test_place_reads_what_launchers_set():
    assert launch.place({}) == launch.Place()
    p = launch.place({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                      "TORCHELASTIC_RESTART_COUNT": "2", launch.CLAIMED: "/runs/main"})
    assert (p.launched, p.rank, p.world_size, p.local_rank, p.per_node(), p.attempt, p.claimed, p.says) == \
        (True, 3, 8, 1, 2, 2, "/runs/main", False)
    assert launch.place({"WORLD_SIZE": "4"}).per_node() == 4 and launch.place({"WORLD_SIZE": "4"}).says


def test_resume_hint_under_pytest_is_built_from_the_runs_settings_not_sys_argv(monkeypatch):
    """A run started from Python (train(cfg, mesh) in a test or a lesson) has no command line of its own; its hint
    used to paste the process's: `python -m picotron.train -x -q ... tests/test_runs.py --resume --out ...`."""
    monkeypatch.setattr(sys, "argv", ["pytest", "-x", "-q", "-p", "no:cacheprovider", "tests/test_runs.py"])
    monkeypatch.delenv("PICOTRON_LAUNCHER", raising=False)
    monkeypatch.delenv("PICOTRON_LAUNCHER_DEFAULTS", raising=False)
    cfg = Config(out="runs/x", steps=7, lr=0.5, faults="nan@3")
    hint = resume_hint(cfg, "runs/x/checkpoints/step_000005")
    assert hint.startswith("newest checkpoint runs/x/checkpoints/step_000005; continue with ")
    assert hint.endswith(" -m picotron.train --steps 7 --lr 0.5 --resume --out runs/x"), hint
    assert "pytest" not in hint and "-x" not in hint.split() and "nan@3" not in hint
    assert resume_hint(cfg, None).endswith(" -m picotron.train --steps 7 --lr 0.5")
    # under ./run.sh: its name, and none of its own defaults (the user did not type them)
    monkeypatch.setenv("PICOTRON_LAUNCHER", "./run.sh")
    monkeypatch.setenv("PICOTRON_LAUNCHER_DEFAULTS", "--steps 600 --save-every 100")
    hint = resume_hint(Config(out="runs/main", steps=600, save_every=100, lr=0.5), "runs/main/checkpoints/step_000100")
    assert hint.endswith("continue with ./run.sh --lr 0.5 --resume --out runs/main"), hint
    assert runs.flags_of(Config(out="runs/main", steps=600, save_every=100)) == ["--out", "runs/main"]
