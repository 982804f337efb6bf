"""Run folders: every run of the main job writes a folder of its own, and no run's results are ever replaced.

    python -m picotron.train                  a new folder: runs/main, then runs/main-2, runs/main-3, ...
    python -m picotron.train --out DIR        DIR, if it holds no run yet (an empty or absent folder)
    python -m picotron.train --resume         continue the newest runs/main* (or --out DIR) from its newest checkpoint
    python -m picotron.train --resume-from runs/main-2/checkpoints/step_000200
                                              a new run that starts from that checkpoint (any run's, any step);
                                              the run it came from is left as it was

A folder holds a run once it has `run.json` (written when the run claims it), `metrics.jsonl` or `checkpoints/`.
Claiming is atomic: the folder's `run.json` is created with O_EXCL, so two runs started together never share a
folder, and a run only claims once its settings passed their checks (a refused run leaves nothing behind).

Every rule is checked before any process starts, and a broken one is one sentence (`RunFolderError`):
`--resume` where there is no checkpoint, `--out` at a folder that holds a run without `--resume`, several nodes
without one shared `--out`. Under a launcher the processes check without claiming (each sees the same folder
before any of them writes: the process group forms only after every rank checked), and a restart after a lost
rank (torchrun --max-restarts) continues its own folder.
"""
import glob
import json
import os
import re
import socket
import sys
import time

from picotron import checkpoint

BASE = "runs/main"
CLAIM = "run.json"


class RunFolderError(ValueError):
    """A run-folder rule is broken; the message is one sentence: the folder, the rule, a fix."""


def holds_run(folder):
    """True if `folder` has a run's files (its claim, its metrics or its checkpoints)."""
    return any(os.path.exists(os.path.join(folder, name)) for name in (CLAIM, "metrics.jsonl", "checkpoints"))


def numbered(base=BASE):
    """The existing folders base, base-2, base-3, ... in the order of their numbers."""
    found = []
    for path in glob.glob(glob.escape(base)) + glob.glob(glob.escape(base) + "-*"):
        m = re.fullmatch(re.escape(base) + r"(?:-(\d+))?", path)
        if m and os.path.isdir(path):
            found.append((int(m.group(1) or 1), path))
    return [p for _, p in sorted(found)]


def what_it_holds(folder):
    """A few words on what a run folder holds, for messages."""
    parts = []
    try:
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            steps = [json.loads(line).get("step") for line in f if line.strip()]
        steps = [s for s in steps if s is not None]
        parts.append(("an empty metrics.jsonl" if not steps else f"metrics of step {steps[0]}" if len(set(steps)) == 1
                      else f"metrics of steps {min(steps)}-{max(steps)}"))
    except (OSError, ValueError):
        pass
    ckpt = checkpoint.latest(folder)
    parts.append(f"a checkpoint at step {checkpoint.step_of(ckpt)}" if ckpt else "no checkpoint")
    return " and ".join(parts)


def resolve_checkpoint(path):
    """A checkpoint folder (step_NNNNNN) or a run folder (its newest checkpoint) -> the checkpoint folder."""
    if os.path.isfile(os.path.join(path, "config.json")) and os.path.basename(os.path.normpath(path)).startswith("step_"):
        return os.path.normpath(path)
    newest = checkpoint.latest(path)
    if newest is None:
        raise RunFolderError(f"--resume-from {path} is neither a checkpoint folder (RUN/checkpoints/step_NNNNNN) nor a "
                             f"run folder with a checkpoint; pass one of those (e.g. "
                             f"{os.path.join(BASE, 'checkpoints', 'step_000100')}).")
    return newest


def _claim(folder, record):
    """Create folder/run.json exclusively; False if another run has it (or the folder holds a run)."""
    os.makedirs(folder, exist_ok=True)
    if holds_run(folder):
        return False
    try:
        fd = os.open(os.path.join(folder, CLAIM), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    return True


def _record(cfg, argv):
    return {"command": [sys.executable, "-m", "picotron.train", *map(str, argv)], "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "host": socket.gethostname(), "pid": os.getpid(), "resume_from": cfg.resume_from or None}


def prepare(cfg, argv, base=BASE, claim=True):
    """The folder this run writes, checked (and claimed if `claim`): returns (out, line to print).

    `cfg.out` None: no --out was given. Raises RunFolderError (one sentence) when a rule is broken."""
    if cfg.resume and cfg.resume_from:
        raise RunFolderError(f"--resume continues a run in place and --resume-from {cfg.resume_from} starts a new one "
                             f"from a checkpoint; pass one of them.")
    if cfg.nnodes > 1 and cfg.out is None:
        raise RunFolderError("several nodes (--nnodes) must write one folder that every node sees; pass --out DIR, "
                             "the same shared path on every node.")
    if cfg.resume:
        out = cfg.out
        if out is None:
            runs = [r for r in numbered(base) if holds_run(r)]
            if not runs:
                raise RunFolderError(f"--resume: there is no earlier run in {base}* to continue; start one without "
                                     f"--resume (or pass --out DIR of the run to continue).")
            out = runs[-1]
        if cfg.nnodes > 1:  # this node may not see the shared folder: the ranks agree on it once they meet
            return out, f"== this run continues {out}/ from its newest checkpoint"
        newest = checkpoint.latest(out)
        if newest is None:
            others = [r for r in numbered(base) if r != out and checkpoint.latest(r)]
            where = (f"{out} holds {what_it_holds(out)}" if holds_run(out) else f"{out} holds no run")
            fix = (f"continue another run with --resume --out {others[-1]} (it has {what_it_holds(others[-1])}), or "
                   if others else "")
            raise RunFolderError(f"--resume needs a checkpoint, but {where}; {fix}start a new run without --resume "
                                 f"(runs keep a checkpoint every --save-every steps and at their last step).")
        problem = checkpoint.resume_problem(cfg, newest)
        if problem:
            raise RunFolderError(problem)
        return out, f"== this run continues {out}/ from its checkpoint at step {checkpoint.step_of(newest)}"
    source = None
    if cfg.resume_from:
        source = resolve_checkpoint(cfg.resume_from)
        problem = checkpoint.resume_problem(cfg, source)
        if problem:
            raise RunFolderError(problem)
    record = _record(cfg, argv)
    if cfg.out is not None:
        out = cfg.out
        if holds_run(out):
            raise RunFolderError(f"--out {out} already holds a run ({what_it_holds(out)}) and a new run would replace "
                                 f"its results; continue it with --resume, or pass a new --out (or none: a new "
                                 f"{base}-N).")
        if claim and cfg.nnodes == 1 and not _claim(out, record):  # (several nodes: one folder, claimed by none)
            raise RunFolderError(f"--out {out} was just claimed by another run started at the same time; pass a new "
                                 f"--out.")
    else:
        n = 1
        while True:
            out = base if n == 1 else f"{base}-{n}"
            if not holds_run(out):
                if not claim or _claim(out, record):
                    break
            n += 1
    if source:
        return out, f"== this run writes {out}/, a new run from {source} (that run is kept as it was; --out DIR to choose)"
    return out, f"== this run writes {out}/ (earlier runs are kept; --out DIR to choose)"
