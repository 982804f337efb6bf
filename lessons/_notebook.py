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
    python lessons/_notebook.py 03_data_parallel --run fast    # build a copy and execute it in FAST mode, into
                                                               # runs/lessons/03_data_parallel/ (--out DIR: there)
    python lessons/_notebook.py --scratch [--fresh] [NN ...]   # the learners' copies ./run.sh lessons opens

Executing prints how long it took and the lesson's ✓/✗ check lines that failed; the exit status is 1 when a
check failed or a cell raised. The committed notebooks carry the outputs of a full run, and only
`./run.sh figures NN` (figures/make.py) rewrites them: an executed copy goes elsewhere, and Jupyter
(`./run.sh lessons`) opens copies in runs/notebooks/ (`scratch`), never the tracked notebooks.

Ctrl-C while a notebook executes stops it at once (`run_cells`): the kernel is interrupted as Jupyter's stop
button does, so the running cell's launch stops its processes, and the KeyboardInterrupt goes on.
"""
import argparse
import json
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
    try:
        run_cells(nb, cwd or Path(path).parent, timeout_s)
    except nbclient.exceptions.CellExecutionError:
        pass  # the error is in the cell's outputs, reported below
    nbformat.write(nb, path)
    return results(nb)


def run_cells(nb, cwd, timeout_s=6000):
    """Execute the notebook `nb` (in memory) top to bottom in a fresh kernel started in `cwd`; stop at the first
    cell that raises (nbclient's CellExecutionError). Returns nb, its outputs filled in.

    Ctrl-C (KeyboardInterrupt) stops it at once. nbclient's own `execute()` takes SIGINT and SIGTERM for itself:
    it shuts the kernel down and goes on with a dead-kernel error, while a torchrun the cell launched (in a
    session of its own, picotron.launch.run_torchrun) keeps running. Here the cells run one by one with
    Python's own handler: on Ctrl-C the kernel is interrupted as Jupyter's stop button does, so the cell's
    launch stops the processes it started; what is left of them after a few seconds is killed with the kernel."""
    import nbclient

    client = nbclient.NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                                     resources={"metadata": {"path": str(cwd)}})
    left = {}
    try:
        # no browser: the widgets draw their default figure as a plain image (lessons/_common.interactive)
        with client.setup_kernel(env={**os.environ, "PICOTRON_HEADLESS": "1"}, **_encrypted()):
            try:  # (unlike execute(), setup_kernel installs no signal handlers)
                info = client.wait_for_reply(client.kc.kernel_info())
                if info and "language_info" in info["content"]:
                    nb.metadata["language_info"] = info["content"]["language_info"]
                for index, cell in enumerate(nb.cells):
                    client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
            except KeyboardInterrupt:
                left = _interrupt(client)
                raise
    finally:
        _kill(left)
    return nb


def _encrypted():
    """The kernel's sockets encrypted (CurveZMQ keys from the kernel manager, jupyter_client 8.10+): ipykernel 7.4+
    otherwise warns "Kernel is running over TCP without encryption" in every run. Older versions: plain TCP, no warning."""
    import zmq
    from jupyter_client.manager import KernelManager

    if "transport_encryption" in KernelManager.class_trait_names() and zmq.has("curve"):
        return {"transport_encryption": "required"}
    return {}


def _interrupt(client, grace_s=5.0):
    """Interrupt the kernel (SIGINT to its process group, Jupyter's way) and wait up to grace_s for the processes
    it started in sessions of their own (torchrun) to end; return {pid: start time} of the kernel's processes."""
    import asyncio
    import signal

    from jupyter_core.utils import ensure_event_loop

    loop = ensure_event_loop()
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]  # the interrupted cell's wait for its reply
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.wait(pending, timeout=5))
    for task in pending:
        if task.done() and not task.cancelled():
            task.exception()  # taken: nbclient's "kernel died" for the cancelled wait is no news
    pid = getattr(getattr(client.km, "provisioner", None), "pid", None)
    if not pid or not hasattr(os, "killpg"):
        return {}
    tree = _process_tree(pid)
    try:
        group = os.getpgid(pid)
        os.killpg(group, signal.SIGINT)
    except OSError:
        return tree
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p, start) and _pgid(p) != group for p, start in tree.items()):
        time.sleep(0.1)
    return tree


def _process_tree(pid):
    """{pid: start time} of every process below `pid`, from /proc (Linux; elsewhere {})."""
    parents = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return {}
    for entry in entries:
        stat = _stat(int(entry))
        if stat:
            parents.setdefault(int(stat[1]), []).append((int(entry), stat[19]))
    tree, todo = {}, [pid]
    while todo:
        for child, start in parents.get(todo.pop(), ()):
            if child not in tree:
                tree[child] = start
                todo.append(child)
    return tree


def _stat(pid):
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, ..., [19] start time), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _alive(pid, start):
    stat = _stat(pid)
    return stat is not None and stat[19] == start and stat[0] != "Z"


def _pgid(pid):
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _kill(tree):
    """SIGKILL every process of `tree` ({pid: start time}) still alive (the same process: its start time)."""
    import signal

    for pid, start in tree.items():
        if _alive(pid, start):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _outputs(nb):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def _printed(nb):
    return "".join(o.get("text", "") for o in _outputs(nb)).splitlines()


def results(nb):
    """(failed ✓/✗ lines, passed count, error outputs) of an executed notebook."""
    checks = [line for line in _printed(nb) if line.startswith(("✓", "✗"))]
    errors = [f"{o.get('ename')}: {o.get('evalue', '')[:300]}" for o in _outputs(nb) if o.get("output_type") == "error"]
    return [c for c in checks if c.startswith("✗")], sum(c.startswith("✓") for c in checks), errors


def inconclusive(nb):
    """The '?' check lines of an executed notebook: timing checks that missed while the machine was measurably busy
    (lessons/_common.check); counted apart from ✓ and ✗."""
    return [line for line in _printed(nb) if line.startswith("? ")]


# ------------------------------------------------------------------- the learners' copies (./run.sh lessons)
NOTEBOOKS = LESSONS.parent / "runs" / "notebooks"
STAMP = ".copied.json"  # in each copy's folder: what it was made from, and what was written


def scratch(into=NOTEBOOKS, names=(), fresh=False, lessons=LESSONS):
    """Make or refresh the learners' copies of the committed notebooks: into/NN_topic/NN_topic.ipynb, the tracked
    notebook (outputs included, less its widgets': _copy_text) behind one first cell that moves the kernel into
    lessons/NN_topic/, so the copy imports and launches what the original does, and holds the FAST switch. Each copy
    is signed trusted (_sign), so its widgets work after you reopen it. The tracked files are only read.

    A copy is made when it is missing, and made again from the tracked notebook when that changed since the copy
    was made, unless the learner changed the copy after the tracked notebook's last change: that one is kept
    (fresh=True replaces it too). A copy the learner changed is never lost: before it is replaced it is kept
    alongside as NN_topic.before-<date>.ipynb. Returns [(lesson, what happened)]; `lessons`: where the lessons are."""
    into = Path(into)
    done = []
    for folder in sorted(Path(lessons).resolve().glob("[0-9][0-9]_*")):
        tracked = folder / f"{folder.name}.ipynb"
        if not tracked.is_file() or (names and not any(folder.name.startswith(Path(n).name) for n in names)):
            continue
        copy = into / folder.name / tracked.name
        stamp_path = copy.parent / STAMP
        try:
            stamp = json.loads(stamp_path.read_text())
        except (OSError, ValueError):
            stamp = None
        source = _sha(tracked.read_bytes())
        if not copy.exists():
            what = "made"
        else:
            edited = stamp is None or _sha(copy.read_bytes()) != stamp.get("copy")
            changed = stamp is None or stamp.get("from") != source or stamp.get("root") != str(folder)
            if not (changed or fresh):
                done.append((folder.name, "as it was"))
                continue
            if edited and not fresh and copy.stat().st_mtime >= tracked.stat().st_mtime:
                done.append((folder.name, "kept"))  # the learner's changes are newer than the tracked notebook's
                continue
            what = "made again"
            if edited:
                what += f" (yours is kept as {_backup(copy).relative_to(into)})"
        text = _copy_text(tracked, folder)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(text, encoding="utf-8")
        _sign(copy)
        stamp_path.write_text(json.dumps({"from": source, "copy": _sha(copy.read_bytes()), "root": str(folder)}))
        done.append((folder.name, what))
    return done


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _copy_text(tracked, folder):
    """The tracked notebook's JSON with one code cell in front (it moves the kernel into the lesson's folder and is the
    FAST switch), less its widgets' outputs and saved state: their models lived in the kernel that made them, so
    Jupyter could only show their text ("VBox(children=...")."""
    nb = json.loads(tracked.read_text(encoding="utf-8"))
    source = (f"# A copy of lessons/{folder.name}/{tracked.name} (./run.sh lessons made it): your edits and outputs stay\n"
              f"# here. Like the original, it runs in the lesson's folder, next to its experiment.py and exercise.py.\n"
              f"# FAST mode, short settings (about a minute a lesson on 2 CPU cores; the numbers differ from the prose's):\n"
              f"# change \"0\" to \"1\" (or start PICOTRON_FAST=1 ./run.sh lessons), restart the kernel and run again.\n"
              f"import os; os.chdir({str(folder)!r}); os.environ.setdefault(\"PICOTRON_FAST\", \"0\")\n"
              f"print(\"FAST mode: short settings\" if os.environ[\"PICOTRON_FAST\"] == \"1\" else \"the full lesson "
              f"(FAST mode: see this cell)\")")
    cell = {"cell_type": "code", "execution_count": None, "id": "picotron-copy", "metadata": {}, "outputs": [],
            "source": source.splitlines(keepends=True)}
    if (nb.get("nbformat"), nb.get("nbformat_minor", 0)) < (4, 5):
        del cell["id"]  # cell ids came with nbformat 4.5
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            c["outputs"] = [o for o in c["outputs"] if WIDGET_VIEW not in o.get("data", {})]
    nb["metadata"].pop("widgets", None)
    nb["cells"].insert(0, cell)
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def _sign(copy):
    """Record the copy as trusted in Jupyter's signature database (nbformat's NotebookNotary, the one Jupyter reads).
    Its outputs are the committed notebook's, from the lessons you cloned. Unsigned, it would open "Not Trusted", and
    Jupyter would save it unsigned again as long as one committed output was left (any cell not re-run): widgets
    would show as text each time it is reopened."""
    import nbformat
    from nbformat.sign import NotebookNotary

    NotebookNotary().sign(nbformat.read(copy, as_version=4))


def _backup(copy):
    stem, n = f"{copy.stem}.before-{time.strftime('%Y%m%d-%H%M%S', time.localtime(copy.stat().st_mtime))}", 1
    target = copy.with_name(f"{stem}.ipynb")
    while target.exists():
        n += 1
        target = copy.with_name(f"{stem}-{n}.ipynb")
    copy.rename(target)
    return target


def _sha(data):
    import hashlib

    return hashlib.sha256(data).hexdigest()


def scratch_report(done, into):
    """The one line ./run.sh lessons prints first, then one line per copy the learner should know about."""
    counts = {}
    for _, what in done:
        key = what.split(" (")[0]
        counts[key] = counts.get(key, 0) + 1
    lines = [f"== Jupyter on {_shown(into)}/: your copies of the lesson notebooks ("
             + ", ".join(f"{n} {what}" for what, n in counts.items())
             + "); lessons/ stays as committed. A copy is made again when its lesson's notebook changes, unless you "
               "changed the copy since (--fresh: all again; a copy you changed is kept alongside)"]
    for name, what in done:
        if what == "kept":
            lines.append(f"   {name}: kept yours; lessons/{name}/{name}.ipynb changed before your last edit "
                         f"(./run.sh lessons --fresh {name[:2]} makes it again and keeps yours alongside)")
        elif "yours is kept" in what:
            lines.append(f"   {name}: {what}")
    return "\n".join(lines)


def _shown(path):
    """path relative to the working directory when it is below it, else absolute."""
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else str(Path(path).resolve())


def main(argv=None):
    p = argparse.ArgumentParser(description="Build a lesson's notebook from its percent-format source; "
                                "optionally execute a copy of it. Or (--scratch) make the copies Jupyter opens.")
    p.add_argument("lessons", nargs="*", help="lesson folders, e.g. 03_data_parallel (or lessons/03_data_parallel); "
                                              "with --scratch, prefixes (03) and none for all")
    p.add_argument("--run", choices=("fast", "full"), help="build a copy and execute it: FAST or full settings")
    p.add_argument("--out", help="with --run: write the executed notebook into this folder "
                                 "(default runs/lessons/NN_topic/, next to the lesson's results)")
    p.add_argument("--scratch", action="store_true", help="make or refresh the copies ./run.sh lessons opens")
    p.add_argument("--into", default=os.environ.get("PICOTRON_NOTEBOOKS", str(NOTEBOOKS)),
                   help="with --scratch: where the copies go (default $PICOTRON_NOTEBOOKS or runs/notebooks)")
    p.add_argument("--fresh", action="store_true", help="with --scratch: make every copy again, even one you "
                                                         "changed (it is kept alongside)")
    args = p.parse_args(argv)
    if args.scratch:
        print(scratch_report(scratch(args.into, args.lessons, args.fresh), args.into), flush=True)
        return 0
    if not args.lessons:
        p.error("name a lesson, e.g. 03_data_parallel")
    status = 0
    for name in args.lessons:
        folder = LESSONS / Path(name).name
        nb = folder / f"{folder.name}.ipynb"
        if args.run:  # build the copy that runs: the committed notebook keeps its outputs (./run.sh figures NN)
            out = Path(args.out) if args.out else LESSONS.parent / "runs" / "lessons" / folder.name
            out.mkdir(parents=True, exist_ok=True)
            nb = out / nb.name
        build(folder / f"{folder.name}.py", nb)
        if not args.run:
            print(f"built {_shown(nb)}")
            continue
        start = time.time()
        failed, passed, errors = execute(nb, args.run == "fast", cwd=folder)
        import nbformat

        unsure = inconclusive(nbformat.read(str(nb), as_version=4)) if Path(nb).is_file() else []
        print(f"{folder.name} ({args.run}): {time.time() - start:.0f} s, {passed} checks hold, {len(unsure)} "
              f"inconclusive (the machine was busy: rerun), {len(failed)} fail, {len(errors)} errors; the executed "
              f"notebook: {_shown(nb)}", flush=True)
        for line in unsure + failed + errors:
            print("   ", line)
        status |= bool(failed or errors)
    return status


if __name__ == "__main__":
    sys.exit(main())
