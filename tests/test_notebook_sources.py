"""Every lesson notebook is built from its percent-format source (lessons/NN_topic/NN_topic.py, see
lessons/_notebook.py): the committed notebook's cells must be exactly the source's, so an edit made in one and
not the other fails here (rebuild with `python lessons/_notebook.py SRC NB`, then execute it)."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lessons"))
import _notebook  # noqa: E402

FOLDERS = sorted(p for p in (ROOT / "lessons").glob("[0-9][0-9]_*") if p.is_dir())
SOURCES = [d / f"{d.name}.py" for d in FOLDERS]
# What every lesson folder holds: the notebook, its source, the experiment, the exercise, its checker, the solution.
PARTS = ("{name}.ipynb", "{name}.py", "experiment.py", "exercise.py", "check.py", "solution.py")


def test_every_lesson_folder_is_complete():
    assert len(FOLDERS) >= 5
    for d in FOLDERS:
        missing = [part.format(name=d.name) for part in PARTS if not (d / part.format(name=d.name)).is_file()]
        assert not missing, f"lessons/{d.name}/ lacks {missing}"


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_notebook_cells_are_its_source(src):
    nb = json.loads(src.with_suffix(".ipynb").read_text(encoding="utf-8"))
    committed = [(c["cell_type"], "".join(c["source"])) for c in nb["cells"]]
    built = _notebook.cells(src.read_text(encoding="utf-8"))
    for i, (got, want) in enumerate(zip(committed, built)):
        assert got == want, f"{src.stem}.ipynb cell {i} differs from {src.relative_to(ROOT)}: rebuild and execute it"
    assert len(committed) == len(built)


def test_percent_format_round_trips():
    cells = [("markdown", "# Title\n\ntext with `code`"), ("code", "x = 1\n\nprint(x)"), ("markdown", "end")]
    assert _notebook.cells(_notebook.to_percent(cells, '"""header"""')) == cells
    with pytest.raises(ValueError, match="must start with '#'"):
        _notebook.cells("# %% [markdown]\nnot a comment\n")
