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
