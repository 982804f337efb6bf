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


def solution_tools(name, timeout=240):
    """(run_checker, mutate, fails_with) for lesson `name`'s exercise checker:
    mutate(tmp_path, (old, new), ...)   the lesson's solution.py with those replacements, as a new file;
    fails_with(tmp_path, exercise, (old, new), ...)   runs the checker on that file for one exercise, asserts it fails
                                                      and returns what it printed (the test then asserts the message)."""
    run_checker = checker(name, timeout)
    solutions = ROOT / "lessons" / name / "solution.py"

    def mutate(tmp_path, *bugs):
        # a new name each time: a same-size edit within the same second would be imported from cached bytecode
        path = tmp_path / f"wrong{len(list(tmp_path.glob('wrong*.py')))}.py"
        text = solutions.read_text()
        for old, new in bugs:
            assert old in text, old
            text = text.replace(old, new)
        path.write_text(text)
        return path

    def fails_with(tmp_path, exercise, *bugs):
        code, out = run_checker("--module", str(mutate(tmp_path, *bugs)), exercise)
        assert code == 1, out
        return out

    return run_checker, mutate, fails_with
