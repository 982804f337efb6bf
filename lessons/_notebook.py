"""Each lesson's notebook is written as a plain Python file in the *percent* format (the one jupytext, VS Code,
PyCharm and Spyder read as cells), so its code can be linted, diffed and reviewed like any other code:

    # %% [markdown]
    # # Lesson 03 — Data parallelism
    # Prose, each line behind "# " (a bare "#" is an empty line).

    # %%
    import _common
    print("a code cell")

Anything before the first `# %%` line (the file's docstring) is not part of the notebook. Each lesson folder
lessons/NN_topic/ holds both: NN_topic.py (edit this) and NN_topic.ipynb (built from it).

    python lessons/_notebook.py 03_data_parallel               # build the notebook from its source (no outputs)
    python lessons/_notebook.py 03_data_parallel --run fast    # build, then execute it in place in FAST mode
    python lessons/_notebook.py 03_data_parallel --run full --out /tmp/full   # full settings, into another folder

Executing prints how long it took and the lesson's ✓/✗ check lines that failed; the exit status is 1 when a
check failed or a cell raised. The committed notebooks carry the outputs of a FAST run.
"""
import argparse
import os
import sys
import time
from pathlib import Path

LESSONS = Path(__file__).resolve().parent

CELL = "# %%"
MARKDOWN = "# %% [markdown]"


def cells(text):
    """[(kind, source)] of a percent-format file: kind "markdown" or "code"."""
    out, kind, lines = [], None, []

    def close():
        if kind is not None:
            while lines and not lines[-1].strip():
                lines.pop()
            out.append((kind, "\n".join(lines)))

    for line in text.splitlines():
        if line.rstrip() in (CELL, MARKDOWN):
            close()
            kind, lines = ("markdown" if line.rstrip() == MARKDOWN else "code"), []
        elif line.startswith(CELL):
            raise ValueError(f"unknown cell marker {line!r}: use '{CELL}' or '{MARKDOWN}'")
        elif kind == "markdown":
            if line and not line.startswith("#"):
                raise ValueError(f"a markdown cell's line must start with '#': {line!r}")
            lines.append(line[2:] if line.startswith("# ") else line[1:])
        elif kind == "code":
            if lines or line.strip():  # no blank lines at a cell's start
                lines.append(line)
    close()
    return out


def to_percent(cell_list, header=""):
    """The percent-format text of [(kind, source)] (the inverse of `cells`)."""
    parts = [header.rstrip("\n") + "\n"] if header else []
    for kind, source in cell_list:
        if kind == "markdown":
            body = "\n".join(("# " + line) if line else "#" for line in source.split("\n"))
            parts.append(f"{MARKDOWN}\n{body}\n")
        else:
            parts.append(f"{CELL}\n{source}\n")
    return "\n".join(parts)


def build(src, dst):
    """Write the notebook `dst` from the percent-format file `src` (cells without outputs)."""
    import nbformat as nbf

    with open(src, encoding="utf-8") as f:
        found = cells(f.read())
    new = {"markdown": nbf.v4.new_markdown_cell, "code": nbf.v4.new_code_cell}
    nb = nbf.v4.new_notebook(cells=[new[kind](source) for kind, source in found], metadata={
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}})
    nbf.write(nb, dst)
    return nb


def execute(path, fast, timeout_s=6000, cwd=None):
    """Run the notebook at `path` top to bottom in `cwd` (default: its folder; PICOTRON_FAST=1 if fast) and save
    it with its outputs. Returns (failed ✓/✗ lines, passed count, error outputs)."""
    import nbclient
    import nbformat

    os.environ["PICOTRON_FAST"] = "1" if fast else "0"
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                                     resources={"metadata": {"path": str(cwd or Path(path).parent)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError:
        pass  # the error is in the cell's outputs, reported below
    nbformat.write(nb, path)
    return results(nb)


def results(nb):
    """(failed ✓/✗ lines, passed count, error outputs) of an executed notebook."""
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs)
    checks = [line for line in text.splitlines() if line.startswith(("✓", "✗"))]
    errors = [f"{o.get('ename')}: {o.get('evalue', '')[:300]}" for o in outputs if o.get("output_type") == "error"]
    return [c for c in checks if c.startswith("✗")], sum(c.startswith("✓") for c in checks), errors


def main(argv=None):
    p = argparse.ArgumentParser(description="Build a lesson's notebook from its percent-format source; "
                                "optionally execute it.")
    p.add_argument("lessons", nargs="+", help="lesson folders, e.g. 03_data_parallel (or lessons/03_data_parallel)")
    p.add_argument("--run", choices=("fast", "full"), help="execute after building: FAST or full settings")
    p.add_argument("--out", help="with --run: write the executed notebook into this folder (default: in place)")
    args = p.parse_args(argv)
    status = 0
    for name in args.lessons:
        folder = LESSONS / Path(name).name
        nb = folder / f"{folder.name}.ipynb"
        if args.run and args.out:  # build the copy that runs there: the committed notebook keeps its outputs
            Path(args.out).mkdir(parents=True, exist_ok=True)
            nb = Path(args.out) / nb.name
        build(folder / f"{folder.name}.py", nb)
        if not args.run:
            print(f"built {nb.relative_to(LESSONS.parent)}")
            continue
        start = time.time()
        failed, passed, errors = execute(nb, args.run == "fast", cwd=folder)
        print(f"{folder.name} ({args.run}): {time.time() - start:.0f} s, {passed} checks hold, {len(failed)} fail, "
              f"{len(errors)} errors", flush=True)
        for line in failed + errors:
            print("   ", line)
        status |= bool(failed or errors)
    return status


if __name__ == "__main__":
    sys.exit(main())
