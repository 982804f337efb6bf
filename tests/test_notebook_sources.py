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


def committed_problems(folder, figures=ROOT / "figures"):
    """What is wrong with lessons/NN_topic/NN_topic.ipynb as a committed notebook ([] if nothing): it must be one
    full-mode run of its current source made by `./run.sh figures` (figures/make.py stamps it), print FAST=False,
    hold every check, and embed exactly the images of figures/NN_k.png, byte for byte, each naming its file."""
    import base64
    import hashlib

    nb = json.loads((folder / f"{folder.name}.ipynb").read_text(encoding="utf-8"))
    problems = []
    stamp = nb.get("metadata", {}).get("picotron", {})
    if stamp.get("made_by") != "./run.sh figures":
        problems.append("not made by ./run.sh figures (no stamp in its metadata)")
    if stamp.get("fast") is not False:
        problems.append(f"its stamp says fast={stamp.get('fast')!r}: a committed notebook is a full-mode run")
    if stamp.get("source_sha256") != hashlib.sha256((folder / f"{folder.name}.py").read_bytes()).hexdigest():
        problems.append(f"its outputs come from another version of {folder.name}.py: ./run.sh figures {folder.name[:2]}")
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    printed = "".join("".join(o.get("text", "")) for o in outputs)
    if "FAST=False" not in printed or "FAST=True" in printed:
        problems.append("its output does not say FAST=False (a FAST run's outputs were committed)")
    failed = [line for line in printed.splitlines() if line.startswith("✗")]
    errors = [o.get("ename") for o in outputs if o.get("output_type") == "error"]
    if failed or errors:
        problems.append(f"{len(failed)} failed checks and errors {errors} in its outputs")
    number = folder.name[:2]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    for k, output in enumerate(images, 1):
        name = f"figures/{number}_{k}.png"
        if output.get("metadata", {}).get("figure") != name:
            problems.append(f"image {k} names {output.get('metadata', {}).get('figure')!r}, not {name}")
        path = figures / f"{number}_{k}.png"
        png = output["data"]["image/png"]
        if not path.is_file() or path.read_bytes() != base64.b64decode("".join(png) if isinstance(png, list) else png):
            problems.append(f"image {k} differs from {name} (or it is missing)")
    extra = sorted(p.name for p in figures.glob(f"{number}_[0-9]*.png") if int(p.stem.split("_")[1]) > len(images))
    if extra:
        problems.append(f"figures/ holds {extra}, which the notebook does not embed")
    return problems


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name[:2])
def test_committed_notebook_is_a_full_run_and_figures_hold_its_images(folder):
    problems = committed_problems(folder)
    assert not problems, f"lessons/{folder.name}/{folder.name}.ipynb: " + "; ".join(problems) + \
        f" — make it with ./run.sh figures {folder.name[:2]} (full mode, an idle machine)"


def test_the_committed_notebook_check_names_each_defect(tmp_path):
    """committed_problems on a made-up lesson: a clean one passes; a FAST run, an edited source, a changed or extra
    figure, a failed check are each named."""
    import base64
    import hashlib

    folder, figures = tmp_path / "lessons" / "99_demo", tmp_path / "figures"
    folder.mkdir(parents=True)
    figures.mkdir()
    (folder / "99_demo.py").write_text("# %%\nprint(1)\n")
    png = b"\x89PNG fake image"
    (figures / "99_1.png").write_bytes(png)
    image = {"output_type": "display_data", "metadata": {"figure": "figures/99_1.png"},
             "data": {"image/png": base64.b64encode(png).decode()}}
    text = {"output_type": "stream", "name": "stdout", "text": "FAST=False\n✓ something holds\n"}

    def write(fast=False, printed=text):
        nb = {"cells": [{"cell_type": "code", "source": "print(1)", "outputs": [printed, image], "metadata": {}}],
              "metadata": {"picotron": {"made_by": "./run.sh figures", "fast": fast, "source_sha256":
                                        hashlib.sha256((folder / "99_demo.py").read_bytes()).hexdigest()}}}
        (folder / "99_demo.ipynb").write_text(json.dumps(nb))

    write()
    assert committed_problems(folder, figures) == []
    write(fast=True, printed={**text, "text": "FAST=True\n✗ something fails\n"})
    problems = " | ".join(committed_problems(folder, figures))
    assert "fast=True" in problems and "FAST=False" in problems and "1 failed checks" in problems
    write()
    (folder / "99_demo.py").write_text("# %%\nprint(2)\n")
    assert "another version of 99_demo.py" in " | ".join(committed_problems(folder, figures))
    write()
    (figures / "99_1.png").write_bytes(png + b"!")
    (figures / "99_2.png").write_bytes(png)
    problems = " | ".join(committed_problems(folder, figures))
    assert "image 1 differs from figures/99_1.png" in problems and "99_2.png" in problems
