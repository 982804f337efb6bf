"""What the exercise checkers share: importing the learner's file afresh, turning a child's exception into
one line, and the ok/FAIL report. Each checkNN.py adds its own cases and the messages that name mistakes."""
import importlib.util
import re
import traceback
from pathlib import Path


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


def cli(argv, description, check, exercises, learner, solutions, timeout_s):
    """The command line every checker shares: [names ...] [--solutions | --module FILE] [--timeout S]."""
    import argparse

    p = argparse.ArgumentParser(description=description)
    p.add_argument("names", nargs="*", help=f"exercises to check (default all): {', '.join(exercises)}")
    p.add_argument("--solutions", action="store_true", help="check the reference solutions")
    p.add_argument("--module", help=f"check this file instead of {Path(learner).relative_to(Path(learner).parents[2])}")
    p.add_argument("--timeout", type=float, default=timeout_s, help="seconds before a launch counts as a hang")
    args = p.parse_args(argv)
    module = solutions if args.solutions else args.module
    return 0 if check(args.names, module, args.timeout) else 1
