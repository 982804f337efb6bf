"""Run folders: every run of the main job writes a folder of its own, and no run's results are ever replaced.

    python -m picotron.train                  a new folder: runs/main, then runs/main-2, runs/main-3, ...
    python -m picotron.train --out DIR        DIR, if it holds no run yet (an empty or absent folder)
    python -m picotron.train --resume         continue a run from its newest checkpoint, as it was (below)
    python -m picotron.train --resume-from runs/main-2/checkpoints/step_000200
                                              a new run that starts from that checkpoint (any run's, any step);
                                              the run it came from is left as it was

`--resume` continues a run as it was: its settings are its checkpoint's (config.json), and the flags given now
override only what they name (`--resume --steps 1200` trains the same model, same layout, on to step 1200; add
`--dp 4` and it is resharded). Which run, without `--out`: among runs/main*, the newest with a checkpoint that was
started with the flags given now, apart from those a continuation may change (CONTINUATION: --steps, --out,
checkpoints, logging, faults, nodes, --profile); if none was, the only run with a checkpoint; if there are several, it refuses
with one sentence naming each, what it was started with, and the `--out` to pass. So after `./run.sh` and then
`./run.sh --preset tiny-moe` (runs/main-2), `./run.sh --resume --steps 1200` continues runs/main.

A folder holds a run once it has `run.json` (written when the run claims it: the command, the settings it names),
`metrics.jsonl` or `checkpoints/`. Claiming is atomic: `run.json` is created with O_EXCL, so two runs started
together never share a folder, and a run only claims once its settings passed their checks (a refused run leaves
nothing behind).

Every rule is checked before any process starts, and before torch is imported (`read_command`: this module, like
picotron.config, needs no torch), so a broken one is one sentence at once (`RunFolderError`): `--resume` where there
is no checkpoint, `--out` at a folder that holds a run without `--resume`, several nodes without one shared `--out`.
Under a launcher the processes check without claiming (each sees the same folder before any of them writes: the
process group forms only after every rank checked), and a restart after a lost rank (torchrun --max-restarts)
continues its own folder. What the launcher said (rank, world size, which restart, the folder the launching
process claimed) comes in as a `place` (picotron.launch.place, read once by the trainer): this module reads no
environment.

The commands a message hands back (`command`: "continue with ...") are the one the user typed, pasteable: the
launcher they used (`./run.sh`, which says so in $PICOTRON_LAUNCHER and keeps its own defaults out of the flags,
or this Python's `-m picotron.train`), each flag once, none they did not type. A run started from Python (a test,
a lesson: `train(cfg, mesh)`) has no command line of its own: its commands are built from its settings
(`flags_of`), never from sys.argv (which would be pytest's or jupyter's).
"""
import dataclasses
import glob
import json
import os
import re
import shlex
import shutil
import socket
import sys
import time
from typing import Optional

from picotron import config

BASE = "runs/main"
CLAIM = "run.json"
# Settings a continuation may change and still be the same run (how long, where, what it saves and prints):
# ignored when --resume looks for the run the flags given now name.
CONTINUATION = ("resume", "resume_from", "out", "steps", "faults", "max_restarts", "save_every", "save_final",
                "keep_checkpoints", "async_save", "local_save_every", "local_dir", "ranks_per_node", "eval_every",
                "eval_batches", "log_every", "sample_tokens", "timeout_s", "nnodes", "node_rank", "rdzv_endpoint",
                "rdzv_id", "profile")
# A checkpoint's settings --resume does not take over: where this run writes and what it was asked to inject.
NOT_INHERITED = ("out", "resume", "resume_from", "faults", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id",
                 "profile")


class RunFolderError(ValueError):
    """A run-folder rule is broken; the message is one sentence: the folder, the rule, a fix."""


# ------------------------------------------------------------------ checkpoint folders (picotron.checkpoint's)
def step_dir(out, step):
    return os.path.join(out, "checkpoints", f"step_{step:06d}")


def latest(out):
    """The newest complete checkpoint folder of a run, or None."""
    try:
        with open(os.path.join(out, "checkpoints", "latest")) as f:
            return os.path.join(out, "checkpoints", f.read().strip())
    except FileNotFoundError:
        return None


def step_of(folder):
    return int(os.path.basename(folder).rsplit("_", 1)[-1])


# ------------------------------------------------------------------------------------------- run folders
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
    ckpt = latest(folder)
    parts.append(f"a checkpoint at step {step_of(ckpt)}" if ckpt else "no checkpoint")
    return " and ".join(parts)


def resolve_checkpoint(path):
    """A checkpoint folder (step_NNNNNN) or a run folder (its newest checkpoint) -> the checkpoint folder."""
    if os.path.isfile(os.path.join(path, "config.json")) and os.path.basename(os.path.normpath(path)).startswith("step_"):
        return os.path.normpath(path)
    newest = latest(path)
    if newest is None:
        raise RunFolderError(f"--resume-from {path} is neither a checkpoint folder (RUN/checkpoints/step_NNNNNN) nor a "
                             f"run folder with a checkpoint; pass one of those (e.g. "
                             f"{os.path.join(BASE, 'checkpoints', 'step_000100')}).")
    return newest


def new_folder(base=BASE):
    """The folder a new run would claim: the first of base, base-2, ... that holds no run."""
    n = 1
    while holds_run(base if n == 1 else f"{base}-{n}"):
        n += 1
    return base if n == 1 else f"{base}-{n}"


# ------------------------------------------------------------------------------------------------ --resume
def started_with(folder):
    """The settings a run's command line named (a dict), from its run.json; None if unknown."""
    try:
        with open(os.path.join(folder, CLAIM)) as f:
            record = json.load(f)
        if "given" in record:
            return record["given"]
        return config.given(record["command"][3:])  # older run.json: [python, -m, picotron.train, flags...]
    except (OSError, ValueError, KeyError, TypeError, SystemExit):
        return None


def _what_names_the_run(given):
    return {k: v for k, v in (given or {}).items() if k not in CONTINUATION}


def _started_text(folder):
    given = started_with(folder)
    if given is None:
        return "started by an unknown command"
    named = config.flags(_what_names_the_run(given))
    return f"started with {' '.join(named)}" if named else "started with no flags"


def to_resume(given_now, base=BASE):
    """The run `--resume` without --out continues (the rule is the module docstring's): its folder."""
    held = [r for r in numbered(base) if holds_run(r)]
    if not held:
        raise RunFolderError(f"--resume: there is no earlier run in {base}* to continue; start one without --resume "
                             f"(or pass --out DIR of the run to continue).")
    saved = [r for r in held if latest(r)]
    if not saved:
        return held[-1]  # prepare says it has no checkpoint, and what to do
    wanted = _what_names_the_run(given_now)
    same = [r for r in saved if (given := started_with(r)) is not None and _what_names_the_run(given) == wanted]
    if same or len(saved) == 1:
        return (same or saved)[-1]
    now = " ".join(config.flags(_what_names_the_run(given_now))) or "no flags"
    shown = [f"--out {r} ({_started_text(r)}, checkpoint at step {step_of(latest(r))})" for r in saved[::-1][:6]]
    more = f", and {len(saved) - 6} older" if len(saved) > 6 else ""
    raise RunFolderError(f"--resume without --out: {len(saved)} runs have a checkpoint and none was started with the "
                         f"flags given now ({now}), so it cannot tell which to continue; add the --out of the one you "
                         f"mean: {', '.join(shown)}{more}.")


def saved_settings(out):
    """The settings of the run in `out` that --resume takes over (its newest checkpoint's config.json), or {}."""
    newest = latest(out)
    try:
        with open(os.path.join(newest, "config.json")) as f:
            saved = json.load(f)
    except (TypeError, OSError, ValueError):  # no checkpoint, or unreadable: prepare / resume_problem say so
        return {}
    names = {f.name for f in dataclasses.fields(config.Config)}
    return {k: v for k, v in saved.items() if k in names and k not in NOT_INHERITED}


def _model_flags(saved):
    """The flags that make `saved`'s model (a Config): --preset and its overrides."""
    keys = ("preset",) + config.MODEL_FIELDS + ("attn_impl", "tie_word_embeddings") + tuple(config.MOE_FIELDS)
    return " ".join(config.flags({k: getattr(saved, k) for k in keys if getattr(saved, k) is not None}))


def resume_problem(cfg, folder=None, base=BASE):
    """Why `--resume` cannot continue from cfg.out's newest checkpoint (or `--resume-from` from `folder`): one
    sentence naming the --out (or the flags) that would work, or None if it can.

    Compares the checkpoint's config.json with cfg before any process starts: the resolved model shape must
    be the same (names the first field that differs); the layout may differ (the checkpoint is resharded)."""
    resuming, folder = folder is None, folder or (latest(cfg.out) if cfg.out else None)
    if folder is None:
        return None  # nothing saved yet: the run starts from step 1 (the trainer says so)
    try:
        with open(os.path.join(folder, "config.json")) as f:
            saved = type(cfg).from_dict(json.load(f), source=os.path.join(folder, "config.json"))
    except (OSError, ValueError) as e:
        others = [r for r in numbered(base) if latest(r) and os.path.abspath(r) != os.path.abspath(cfg.out or "")]
        fix = f"continue another run (--resume --out {others[-1]})" if others else "resume another checkpoint"
        return f"checkpoint {folder} cannot be read ({e}); {fix}, or start a new run without --resume."
    was, now = dataclasses.asdict(saved.model_config()), dataclasses.asdict(cfg.model_config())
    for name in was:
        if was[name] != now[name] and name != "attn_impl":
            head = f"checkpoint {folder} holds a model with {name}={was[name]}, but this run asks for {name}={now[name]}"
            if not resuming:
                return f"{head}; pass the checkpoint's model settings ({_model_flags(saved)}) or another checkpoint."
            return (f"{head} (a model flag given now: --resume reuses the run's own settings); drop that flag to "
                    f"continue --out {cfg.out}, or pass --out {new_folder(base)} without --resume to start a new run "
                    f"with this model.")
    step = step_of(folder)
    if step >= cfg.steps:
        where = f"--resume --out {cfg.out}" if resuming else f"--resume-from {folder}"
        return (f"the checkpoint {folder} is at step {step} >= --steps {cfg.steps}, so there is nothing to do; train "
                f"further with a higher --steps ({where} --steps {2 * step}).")
    return None


def resume_notes(cfg, folder):
    """What differs from the run that wrote `folder` and what that means for exactness (lines, maybe none)."""
    with open(os.path.join(folder, "config.json")) as f:
        saved = json.load(f)
    notes = []
    layout = ("dp", "tp", "pp", "cp", "ep", "zero", "sp", "pp_schedule", "pp_chunks")
    changed = [f"{k} {saved.get(k)} -> {getattr(cfg, k)}" for k in layout if saved.get(k) != getattr(cfg, k)]
    if changed:
        notes.append(f"resharding the checkpoint ({', '.join(changed)}): the same values, but sums in another order, "
                     f"so losses match the uninterrupted run to ~1e-6, not bit for bit")
    batch = ("seed", "seq_len", "micro_batch_size", "grad_acc")
    was = saved.get("dp", 1) * saved.get("micro_batch_size", 1) * saved.get("grad_acc", 1)
    now = cfg.dp * cfg.micro_batch_size * cfg.grad_acc
    if was != now or any(saved.get(k) != getattr(cfg, k) for k in ("seed", "seq_len")):
        notes.append(f"the data differs from the run that wrote it ({', '.join(batch)}, global batch {was} -> {now} "
                     f"sequences): training goes on, but not as that run would have")
    return notes


# ------------------------------------------------------------------------------------------------ claiming
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
    return {"command": command(argv), "given": config.given(argv), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
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
        out = cfg.out or to_resume(config.given(argv), base)
        if cfg.nnodes > 1:  # this node may not see the shared folder: the ranks agree on it once they meet
            return out, f"== this run continues {out}/ from its newest checkpoint"
        newest = latest(out)
        if newest is None:
            others = [r for r in numbered(base) if r != out and latest(r)]
            where = (f"{out} holds {what_it_holds(out)}" if holds_run(out) else f"{out} holds no run")
            fix = (f"continue another run with --resume --out {others[-1]} (it has {what_it_holds(others[-1])}), or "
                   if others else "")
            raise RunFolderError(f"--resume needs a checkpoint, but {where}; {fix}start a new run without --resume "
                                 f"(runs keep a checkpoint every --save-every steps and at their last step).")
        problem = resume_problem(dataclasses.replace(cfg, out=out), base=base)
        if problem:
            raise RunFolderError(problem)
        return out, (f"== this run continues {out}/ from its checkpoint at step {step_of(newest)}, with that run's "
                     f"settings (flags given now override them)")
    source = None
    if cfg.resume_from:
        source = resolve_checkpoint(cfg.resume_from)
        problem = resume_problem(cfg, source, base=base)
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


# ---------------------------------------------------------------------------- the command line, before torch
def refuse(message, says=True):
    """A broken rule on the command line: one sentence (if `says`: from rank 0 only, every rank finds the same),
    status 2."""
    if says:
        print(f"picotron: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def read_command(argv, place):
    """The run's settings from its command line, checked without importing torch: parsed (with --resume, the
    run's own settings under the flags given now), the settings' own rules (picotron.config.check) and the run
    folder's (`folder`, without claiming). A broken rule: one sentence, exit status 2. The strategies' rules
    (picotron.rules.validate) come next, without torch too (picotron.train.read_command). `place`: what the
    launcher said (picotron.launch.Place)."""
    try:
        cfg = config.parse_args(argv)
        if cfg.resume and not cfg.resume_from and (cfg.out or cfg.nnodes == 1):
            out = cfg.out or to_resume(config.given(argv))
            cfg = dataclasses.replace(config.parse_args(argv, saved=saved_settings(out)), out=out)
        config.check(cfg)
        folder(cfg, argv, place, claim=False)
    except (config.ConfigError, RunFolderError) as e:
        refuse(e, place.says)
    return cfg


def folder(cfg, argv, place, claim=True):
    """(cfg with its folder, argv naming it): the folder this run writes, by this module's rules, checked (and
    claimed if `claim`) before any process group exists; a broken rule: one sentence, status 2. Workers this
    process starts are handed the folder with --out (and its claim with $PICOTRON_RUN_FOLDER: `place.claimed`); a
    restart after a lost rank continues its own folder."""
    under_launcher, world = place.launched, place.world_size
    if under_launcher and (place.attempt > 0 or (cfg.out and place.claimed == os.path.abspath(cfg.out))):
        return cfg, argv  # the launching process checked and claimed it
    try:
        if under_launcher and world > 1 and cfg.out is None:
            raise RunFolderError(f"under torchrun the {world} processes must write one folder; pass --out DIR (or "
                                 f"start the job with `python -m picotron.train --dp {world} ...` without torchrun: "
                                 f"it picks a new runs/main-N itself).")
        out, line = prepare(cfg, argv, claim=claim and (not under_launcher or world == 1))
    except RunFolderError as e:
        refuse(e, place.says)
    if claim and place.says:
        print(line, flush=True)
    return dataclasses.replace(cfg, out=out), argv + ["--out", out]


# --------------------------------------------------------------------------- commands handed back to the user
def launcher():
    """How the user starts training, as they would type it: ./run.sh when run.sh started this run (it says so in
    $PICOTRON_LAUNCHER: picotron.config.launcher), else this Python's `-m picotron.train`: `python` if the shell
    finds this one under that name, else its path (outside .venv a bare `python` may be another, without torch)."""
    named = config.launcher()
    if named:
        return named
    for name in ("python", "python3"):
        found = shutil.which(name)
        if found and os.path.abspath(found) == os.path.abspath(sys.executable):
            return f"{name} -m picotron.train"
    here = os.getcwd() + os.sep
    path = os.path.relpath(sys.executable) if sys.executable.startswith(here) else sys.executable
    return f"{shlex.quote(path)} -m picotron.train"


def _flags_of(argv):
    """[(setting, its tokens)] of a command line: ['--steps', '9', '--no-sp'] -> [('steps', ['--steps', '9']),
    ('sp', ['--no-sp'])]."""
    switches = {name for name, kind in config._field_types().items() if kind in (bool, Optional[bool])}
    out, i = [], 0
    while i < len(argv):
        flag, eq, _ = argv[i].partition("=")
        name = flag.lstrip("-").replace("-", "_")
        name = name[3:] if name.startswith("no_") and name[3:] in switches else name
        takes_value = flag.startswith("--") and not eq and name not in switches | {"help", "version"}
        out.append((name, argv[i:i + 1 + takes_value]))
        i += 1 + takes_value
    return out


def flags_of(cfg):
    """The flags that make `cfg` on the command line, for a run that has none of its own (started from Python:
    a test, a lesson): each setting that differs from the defaults (and the launcher's), in the Config's order."""
    base = config.Config.from_dict(config.launcher_defaults()).to_dict()
    return config.flags({k: v for k, v in cfg.to_dict().items() if v != base[k] and v is not None})


def command(argv, add=(), drop=()):
    """The command a message hands back, pasteable: the launcher, then the user's flags `argv` without the settings
    in `drop`, then `add` (flags, e.g. ['--resume', '--out', 'runs/main']); each setting once, the last one given
    winning, as for argparse: `./run.sh --steps 1200 --resume --out runs/main`."""
    flags = [(name, tokens) for name, tokens in _flags_of([*map(str, argv), *map(str, add)]) if name not in drop]
    last = {name: i for i, (name, _) in enumerate(flags)}
    kept = [t for i, (name, tokens) in enumerate(flags) if last[name] == i for t in tokens]
    return " ".join([launcher(), *map(shlex.quote, kept)])
