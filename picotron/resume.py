"""Where a run starts: step 1, or the step after the newest checkpoint, at either level, loaded into this layout.

    start, saver = resume.start_or_resume(cfg, mesh, run, injector, local, attempt)

A run resumes with --resume, and by itself after a lost rank (torchrun --max-restarts: `attempt` > 0, which
picotron.launch.place reads). Which checkpoint: the newest complete one at SOME level. Level 2 (OUT/checkpoints,
picotron.checkpoint): rank 0 reads `latest` and every rank checks it sees that folder (`agreed_latest`); it loads
into any layout (picotron.reshard). Level 1 (the nodes' disks, picotron.checkpoint_local): taken if it is newer and
every rank's shard survives on its node or on its peer's (`agreed_local`), in the same layout only. --resume-from:
another run's checkpoint, for a new run. Before any process started, picotron.runs checked the folder and the
model (`resume_problem`); what is left here needs the ranks together.
"""
from picotron import checkpoint, checkpoint_local, reshard, runs
from picotron.messages import Stopped


def start_or_resume(cfg, mesh, run, injector, local=None, attempt=0):
    """(the first step to run, the checkpoint Saver): step 1, or with --resume (or restart `attempt` after a lost
    rank) the step after the newest checkpoint's, loaded into `run` in this layout (--resume-from: another run's).
    With level 1 (`local`), the newest step complete at either level: level 1's if it is newer than level 2's
    and every rank's shard survives on its node or on its peer (picotron.checkpoint_local.agreed_local)."""
    resume = cfg.resume or attempt > 0  # a restart after a lost rank resumes by itself
    try:  # several nodes: rank 0 picks the checkpoint, every rank must see it; and every rank must see OUT
        start, folder = 1, checkpoint.agreed_latest(cfg.out, mesh) if resume else None
        saver = checkpoint.Saver(cfg.out, cfg, mesh, keep=cfg.keep_checkpoints, asynchronous=cfg.async_save,
                                 on_write=lambda step: injector.maybe_kill("kill-save", step), local=local)
        # level 1 newer than level 2? (every rank asks: an all-gather over the writer's group, the same answer)
        level1 = checkpoint_local.agreed_local(saver, runs.step_of(folder) if folder else 0) if resume else None
        if folder is None and level1 is None and cfg.resume_from:  # a new run from another run's checkpoint
            folder = runs.resolve_checkpoint(cfg.resume_from)
        if folder is None and level1 is None and cfg.resume:  # (on one node the command line refused this before)
            raise Stopped(f"picotron: error: --resume needs a checkpoint, but rank 0 sees none in {cfg.out}/checkpoints; "
                          f"start a new run without --resume, or pass the --out of a run with one.", 2)
    except checkpoint.NotShared as e:
        raise Stopped(f"picotron: error: {e}", 2) from None
    if level1:
        start = checkpoint_local.load_local(saver, *level1, run) + 1
    elif folder:
        start = reshard.load(folder, run, mesh) + 1
    if resume:
        saver.forget_local_after(start - 1)  # level-1 steps the failed attempt wrote after it are stale
    if mesh.rank == 0 and (resume or folder):
        say_where(cfg, folder, level1, start, attempt)
    if start > cfg.steps:
        raise Stopped(f"picotron: error: the checkpoint in {cfg.out} is at step {start - 1} >= --steps {cfg.steps}; "
                      f"nothing to do (raise --steps to train further).", 2)
    return start, saver


def say_where(cfg, folder, level1, start, attempt):
    """The line that says where the run resumes from (and what differs from the run that wrote it)."""
    why = f"restart {attempt}: " if attempt else ""
    if level1:
        step, lost, _ = level1
        peers = f", rank{'s' * (len(lost) > 1)} {', '.join(map(str, lost))} from the next node's copy" if lost else ""
        print(f"{why}resuming from level 1 (node-local) step {step}{peers} at step {start}", flush=True)
    else:
        print(f"{why}resuming from {folder} at step {start}" if folder else  # (no folder: only a restart gets here)
              f"{why}no checkpoint in {cfg.out}/checkpoints yet, starting from step 1", flush=True)
    for note in runs.resume_notes(cfg, folder) if folder and not level1 else []:
        print(f"picotron: note: {note}", flush=True)
