"""The README's examples come from the code as it is: the planner's block (docs/planner.md, where the README sends a
reader) is its output line for line, the main job's example has the lines and fields a run prints now, and the corpus
is the size the README says."""
import io
import os
import re
import shlex
import subprocess
import sys
from contextlib import redirect_stdout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()
PLANNER_DOC = open(os.path.join(ROOT, "docs", "planner.md")).read()


def block_after(command_prefix, text=README):
    """The fenced block of `text` whose first line starts with `$ command_prefix`: (command, the lines after it)."""
    blocks, inside = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            inside = [] if inside is None else blocks.append(inside)
        elif inside is not None:
            inside.append(line)
    for lines in blocks:
        if lines and lines[0].startswith("$ " + command_prefix):
            return lines[0][2:], lines[1:]
    raise AssertionError(f"no block starts with '$ {command_prefix}'")


def test_the_planner_block_is_its_output():
    from picotron import plan

    command, shown = block_after("./run.sh python -m picotron.plan", PLANNER_DOC)
    buf = io.StringIO()
    with redirect_stdout(buf):
        words = shlex.split(command)
        plan.main(words[words.index("picotron.plan") + 1:])
    printed = buf.getvalue().splitlines()
    shown = [line for line in shown if line.strip() != "..."]
    at = 0  # every shown line appears in the output, in order (the README leaves some rejection reasons out)
    for line in shown:
        assert line in printed[at:], f"README line not in `{command}`'s output (or out of order):\n{line}\n\n" + \
            "\n".join(printed[:12])
        at = printed.index(line, at) + 1


def test_the_corpus_is_the_size_the_readme_says():
    from picotron import data

    n = len(data.load_text("shakespeare").encode("utf-8"))
    said = {float(x) for x in re.findall(r"([0-9.]+) M bytes", README)}
    assert said == {round(n / 1e6, 2)}, (said, n)


def _fields(line):
    """A progress or banner line's field names: each ' | ' part with its numbers taken out (and the padding that
    aligns them: 'MFU   5.1%' and 'MFU  22.9%' are the same field)."""
    parts = [re.sub(r"\s+", " ", re.sub(r"[-+]?[0-9][0-9,.e+-]*", "#", p.strip())) for p in line.split(" | ")]
    return [re.sub(r"\(.*\)|runs/main\S*", "", p).strip() for p in parts]


def test_the_main_jobs_example_has_the_lines_a_run_prints(tmp_path):
    """The README's `$ ./run.sh` block against a short real run of the same job: the same kinds of lines in the same
    order, each with the same fields (the numbers are those of the full run on the README's machine)."""
    command, shown = block_after("./run.sh")
    proc = subprocess.run([sys.executable, "-m", "picotron.train", "--steps", "600", "--eval-every", "100",
                           "--save-every", "100", "--steps", "2", "--eval-every", "1", "--log-every", "1",
                           "--sample-tokens", "20"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr
    printed = proc.stdout.splitlines()

    def first(lines, prefix):
        return next(line for line in lines if line.startswith(prefix))

    for prefix in ("== this run writes", "picotron | ", "step ", "done: ", "---- sample ----"):
        ours, theirs = first(shown, prefix), first(printed, prefix)
        if prefix == "picotron | ":  # the README shortens the mesh's coordinates to "..."
            ours, theirs = ours.split(" | ", 1)[1], theirs.split(" | ", 1)[1]
        assert _fields(ours) == _fields(theirs), f"README:\n{ours}\nrun:\n{theirs}"
    order = [p for line in printed for p in ("== this run", "picotron | ", "step ", "done: ", "---- sample")
             if line.startswith(p)]
    shown_order = [p for line in shown for p in ("== this run", "picotron | ", "step ", "done: ", "---- sample")
                   if line.startswith(p)]
    assert list(dict.fromkeys(order)) == list(dict.fromkeys(shown_order))
