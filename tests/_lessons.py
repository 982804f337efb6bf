"""What the lesson tests share: running a lesson's exercise checker as a learner does, in its own process."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checker(name, timeout=240):
    """A function run(*args) -> (exit code, everything printed) for lessons/<name>/check.py ARGS.

    run(..., as_learner=True) runs `python lessons/<name>/check.py ARGS` in its own process, from the repository
    root, exactly as a learner types it (each lesson's full `--solutions` run goes this way). Otherwise the checker
    runs inside this test process, as the lesson's notebook runs it (`import check; check.main(argv)`): its
    rank processes are still fresh (forked from the fork server that already imported torch, picotron.launch), but
    the two interpreter start-ups and torch imports of a separate checker process (~4 s on 2 cores) are saved, for
    ~120 checker runs in the suite. `check` is imported afresh each time, so no state is carried between runs.
    The in-process run has no wall-clock timeout of its own: every launch inside a checker has its deadline."""
    folder = ROOT / "lessons" / name
    script = folder / "check.py"

    def run(*args, timeout=timeout, as_learner=False):
        if as_learner:
            proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                                  timeout=timeout, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
            return proc.returncode, proc.stdout + proc.stderr
        return _in_process(folder, list(args))

    return run


def _in_process(folder, argv):
    """`check.main(argv)` of the checker in `folder`, imported afresh as `check` (the name its rank processes
    import it by: run_on_ranks pickles `check._on_rank` by reference); (exit code, printed text)."""
    import contextlib
    import importlib
    import io
    import traceback

    saved_path = list(sys.path)
    sys.path.insert(0, str(folder))
    sys.modules.pop("check", None)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = importlib.import_module("check").main(argv)
            except SystemExit as e:  # argparse's --help or a usage error
                code = e.code if isinstance(e.code, int) else 1
            except Exception:  # noqa: BLE001 - a bug in the checker itself: report it as the process would
                traceback.print_exc()
                code = 1
    finally:
        sys.modules.pop("check", None)
        sys.path[:] = saved_path
    return code, out.getvalue()


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
