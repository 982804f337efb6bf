"""What the exercise checkers share: importing the learner's file afresh, turning a child's exception into
one line, and the ok/FAIL report. Each lesson's check.py adds its own cases and the messages that name mistakes.

Every lesson's checker runs the same way (`entry_points` and `cli` below make its check() and main()):

    ./run.sh python lessons/NN_topic/check.py [name ...]       # your lessons/NN_topic/exercise.py (default: all)
    ./run.sh python lessons/NN_topic/check.py --solutions      # the reference solutions (must pass)
    ./run.sh python lessons/NN_topic/check.py --module my.py   # any file defining the same functions
    ./run.sh python lessons/NN_topic/check.py --timeout 5      # seconds before a launch counts as a hang (each
                                                               # checker has its own default; it says which)
From the lesson's notebook: `import check as checker; checker.check()` (returns True when everything passes).
Exit status 0 when every check passes, 1 otherwise.

How a multi-rank checker works: picotron.launch.run_on_ranks pickles the function it runs by reference, so the
children run the checker's `_on_rank` (at module level in its check.py). That imports YOUR file by path (`load`),
runs it, and meets the other ranks at a store-based `rendezvous` before returning, so a rank stuck in a collective or
a receive shows up as a hang rather than as a peer that left; `hang_message` then names the line of your file where
each stuck rank waits, and `on_ranks` runs one exercise on each world size and reports what it finds.
"""
import importlib.util
import linecache
import re
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the repository root, for `import picotron` (as lessons/_common.py does)
    sys.path.insert(0, str(ROOT))


class _Failure(Exception):
    """Raised in a child with a one-line description; the parent reads it from the traceback text."""


def load(path, prefix="ex"):
    """Import a file afresh (so edits made since the last check are seen)."""
    spec = importlib.util.spec_from_file_location(f"{prefix}_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def where(exc, path):
    """' (line N: source)' of the innermost frame in the learner's file, or ''."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == Path(path).resolve()]
    return f" (line {frames[-1].lineno}: {frames[-1].line})" if frames else ""


def in_process(name, path, report, problem_of, success, prefix, label=None):
    """Check one single-process exercise: load the learner's function `name`, ask `problem_of(fn, path)` for the
    first problem (None if none), report it under `label` (default: the name). Any exception in the learner's code
    is a failed check naming its line."""
    label = label or name
    try:
        fn = getattr(load(path, prefix), name)
        problem = problem_of(fn, path)
    except Exception as e:  # noqa: BLE001 - any bug in the learner's code is a failed check
        report.fail(label, f"{type(e).__name__}: {e}{where(e, path)}")
        return False
    if problem:
        report.fail(label, problem)
        return False
    report.ok(label, success)
    return True


def failure_message(e):
    """One line from a RankError: the learner's exception as the child described it."""
    found = re.findall(r"_Failure: (.*)", e.traceback or "")
    if found:
        return f"rank {e.rank}: {found[-1]}"
    return str(e).splitlines()[0] + (f" {e.traceback.strip().splitlines()[-1]}" if e.traceback else "")


class Report:
    def __init__(self):
        self.failed = 0

    def ok(self, what, detail=""):
        print(f"  ok    {what}{detail}", flush=True)

    def fail(self, what, why):
        self.failed += 1
        print(f"  FAIL  {what}: {why}", flush=True)


def check_all(names, path, exercises, check_one, prefix):
    """Check the named exercises (default: all of `exercises`) of the learner's file at `path`, one
    `check_one(name, path, report)` each, printing ok / FAIL lines; True when everything passed."""
    unknown = [n for n in names or () if n not in exercises]
    if unknown:
        print(f"unknown exercise {unknown[0]!r}; pick from {', '.join(exercises)}")
        return False
    try:
        load(path, prefix)
    except Exception as e:  # noqa: BLE001 - a syntax error in the learner's file
        print(f"cannot import {path}: {type(e).__name__}: {e}")
        return False
    here = Path(__file__).resolve().parent
    report = Report()
    for name in names or exercises:
        print(f"{name}  ({path.relative_to(here) if path.is_relative_to(here) else path})", flush=True)
        check_one(name, path, report)
    print("all checks passed" if not report.failed else f"{report.failed} check(s) failed")
    return report.failed == 0


def attempt(launch, report, what, path, timeout_s):
    """One multi-rank run: launch()'s results, or None once a hang (with the waiting ranks' lines) or a rank's
    exception has been reported as the failure of `what`."""
    from picotron.launch import RankError, RankTimeout

    try:
        return launch()
    except RankTimeout as e:
        report.fail(what, hang_message(e, path, timeout_s))
    except RankError as e:
        report.fail(what, failure_message(e))
    return None


def on_ranks(what, world_sizes, launch, judge, report, path, timeout_s):
    """The loop every multi-rank exercise shares: for each n in world_sizes, results = launch(n) (run_on_ranks);
    a hang is reported with the waiting ranks' lines and ends the exercise (it would hang again), an exception is
    reported as one line (and ends it if nothing is written yet), else judge(n, results) -> a problem or None.
    `what(n)`: the label of one run; `judge` may return (problem, detail) to say what was right."""
    from picotron.launch import RankError, RankTimeout

    for n in world_sizes:
        try:
            results = launch(n)
        except RankTimeout as e:
            report.fail(what(n), hang_message(e, path, timeout_s))
            return
        except RankError as e:
            message = failure_message(e)
            report.fail(what(n), message)
            if "NotImplementedError" in message or "cannot import" in message:
                return
            continue
        problem, detail = judge(n, results)
        if problem:
            report.fail(what(n), problem)
        else:
            report.ok(what(n), detail)


def entry_points(description, exercises, check_one, learner, solutions, timeout_s, prefix):
    """check(names, module, timeout_s) -> True when all passed (what a notebook calls) and main(argv) (the command
    line): the two functions every lesson's check.py exports, around its check_one(name, path, report, timeout_s)."""
    def check(names=None, module=None, timeout_s=timeout_s):
        """Check the named exercises (default: all) of `module` (a path; default: your exercise file)."""
        path = Path(module).resolve() if module else learner
        return check_all(names, path, exercises, lambda name, p, report: check_one(name, p, report, timeout_s), prefix)

    def main(argv=None):
        return cli(argv, description, check, exercises, learner, solutions, timeout_s)

    return check, main


def cli(argv, description, check, exercises, learner, solutions, timeout_s):
    """The command line every checker shares: [names ...] [--solutions | --module FILE] [--timeout S] (--timeout
    only where the exercises launch processes: timeout_s not None)."""
    import argparse

    p = argparse.ArgumentParser(description=description)
    p.add_argument("names", nargs="*", help=f"exercises to check (default all): {', '.join(exercises)}")
    p.add_argument("--solutions", action="store_true", help="check the reference solutions")
    p.add_argument("--module", help=f"check this file instead of {Path(learner).relative_to(Path(learner).parents[2])}")
    if timeout_s is not None:  # None: the exercises run in this process, nothing is launched
        p.add_argument("--timeout", type=float, default=timeout_s, help="seconds before a launch counts as a hang")
    args = p.parse_args(argv)
    module = solutions if args.solutions else args.module
    return 0 if check(args.names, module, getattr(args, "timeout", timeout_s)) else 1


def rendezvous(n, key):
    """In a child: wait until all n ranks got here, through the process group's store (not a collective), so
    that a rank stuck in a collective shows up as a hang rather than as a peer that left."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.add(key, 1)
    while int(store.add(key, 0)) < n:
        time.sleep(0.01)


def hang_message(e, path, timeout_s,
                 hint="a collective that not every rank calls, or calls in a different order or with different sizes?"):
    """'hang: rank 0 still waiting after 10 s ...' naming the ranks stuck in the learner's code and the line
    where each one waits (from the stacks run_on_ranks collects); ranks that finished wait at the rendezvous."""
    name = Path(path).name
    stuck, lines = [], []
    stacks = dict(re.findall(r"--- where rank (\d+) was.*?---\n(.*?)(?=\n--- where rank|\Z)", str(e), re.S))
    for r in e.ranks:
        stack = stacks.get(str(r), "")
        frame = re.search(rf'File "([^"]*{re.escape(name)})", line (\d+) in (\w+)', stack)
        if frame:
            stuck.append(r)
            source = linecache.getline(frame.group(1), int(frame.group(2))).strip()
            lines.append(f"        rank {r} waits in {frame.group(3)}, line {frame.group(2)}: {source}")
        elif "rendezvous" not in stack:
            stuck.append(r)
    if not lines:
        return (f"ranks {', '.join(map(str, e.ranks))} still running after {timeout_s:g} s, but none of them waits in "
                f"{name}: the machine may just be busy (rerun with a longer --timeout){_innermost(stacks)}")
    finished = [r for r in e.ranks if r not in stuck]
    who = f"rank {stuck[0]}" if len(stuck) == 1 else "ranks " + ", ".join(map(str, stuck))
    head = f"hang: {who} still waiting after {timeout_s:g} s ({hint})"
    if finished:
        head += f"; rank{'s' if len(finished) > 1 else ''} {', '.join(map(str, finished))} finished and waited for it"
    return "\n".join([head] + lines)


def _innermost(stacks):
    """' (rank r was in f, file:line; ...)' from the stacks run_on_ranks collected, or ''."""
    where = []
    for r, stack in sorted(stacks.items()):
        frame = re.search(r'File "([^"]*)", line (\d+) in (\w+)', stack)
        if frame:
            where.append(f"rank {r} was in {frame.group(3)}, {Path(frame.group(1)).name}:{frame.group(2)}")
    return f" ({'; '.join(where)})" if where else ""
