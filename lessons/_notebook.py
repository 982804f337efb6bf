"""Each lesson's notebook is written as a plain Python file in the *percent* format (the one jupytext, VS Code,
PyCharm and Spyder read as cells), so its code can be linted, diffed and reviewed like any other code:

    # %% [markdown]
    # # Lesson 03 — Data parallelism
    # Prose, each line behind "# " (a bare "#" is an empty line).

    # %%
    import _common
    print("a code cell")

Anything before the first `# %%` line (the file's docstring) is not part of the notebook.

    python lessons/_notebook.py lessons/notebook_src/03_data_parallel.py lessons/03_data_parallel.ipynb  # build
    PICOTRON_FAST=1 jupyter nbconvert --to notebook --execute --inplace lessons/03_data_parallel.ipynb  # run

`build` writes the cells with no outputs; the committed notebooks are then executed in FAST mode.
"""
import sys

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


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    build(sys.argv[1], sys.argv[2])
