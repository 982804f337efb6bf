"""What the lesson tests share: running a lesson's exercise checker as a learner does, in its own process."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checker(name, timeout=240):
    """A function that runs `python lessons/<name>/check.py ARGS...` from the repository root (one thread per
    process, as the lessons launch it) and returns its exit code and everything it printed."""
    script = ROOT / "lessons" / name / "check.py"

    def run(*args, timeout=timeout):
        proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return proc.returncode, proc.stdout + proc.stderr

    return run
