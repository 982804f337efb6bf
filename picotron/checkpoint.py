"""Saving and resuming a run, atomically and exactly.

A checkpoint is a folder `OUT/checkpoints/step_000120/` holding one file per rank (`rank_00000.pt`: its
model shard, its optimizer state, the step) and `config.json`. A file `OUT/checkpoints/latest` names the
newest complete folder. Two rules make it safe and exact:

* Atomic: everything is written into `step_000120.tmp/`, then the folder is renamed, then `latest` is
  replaced by renaming a temporary file onto it. A crash at any moment leaves either the old checkpoint or
  the new one, never half of one. (A rename within one filesystem is atomic on POSIX.)
* Exact: a resumed run must do what the uninterrupted run would have done. The model and the optimizer's
  moments are saved bit for bit; the learning rate is a function of the step; the batches are a pure
  function of (seed, step, rank) (`picotron.data`), and the model has no dropout, so there is no random
  state to carry. Losses after resuming are identical, not merely close (tests/test_train.py).

This first version saves each rank's own state. Loading into a different layout (re-sharding) comes with
the checkpointing lesson.
"""
import dataclasses
import json
import os
import shutil

import torch


def step_dir(out, step):
    return os.path.join(out, "checkpoints", f"step_{step:06d}")


def save(out, step, model, optimizer, cfg, mesh):
    """Write this step's checkpoint: every rank its own file, rank 0 the folder's rename and `latest`."""
    final = step_dir(out, step)
    tmp = final + ".tmp"
    if mesh.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=1)
    barrier(mesh)  # the tmp folder exists before anyone writes into it
    state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "world_size": mesh.world_size}
    path = os.path.join(tmp, f"rank_{mesh.rank:05d}.pt")
    torch.save(state, path + ".part")
    os.replace(path + ".part", path)
    barrier(mesh)  # every rank's file is complete
    if mesh.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest = os.path.join(out, "checkpoints", "latest")
        with open(latest + ".tmp", "w") as f:
            f.write(os.path.basename(final))
        os.replace(latest + ".tmp", latest)
    barrier(mesh)
    return final


def latest(out):
    """The newest complete checkpoint folder of a run, or None."""
    try:
        with open(os.path.join(out, "checkpoints", "latest")) as f:
            return os.path.join(out, "checkpoints", f.read().strip())
    except FileNotFoundError:
        return None


# What must match for a checkpoint to load: the model's shape and how it is cut into shards.
LAYOUT_FIELDS = ("dp", "tp", "pp", "pp_schedule", "pp_chunks", "cp", "ep", "zero", "sp")


def resume_problem(cfg):
    """Why `--resume` cannot continue from cfg.out's newest checkpoint (one sentence), or None if it can.

    Compares the checkpoint's config.json with cfg before any process starts: the resolved model shape
    (names the first field that differs) and the parallel layout (each rank's file holds its own shards)."""
    folder = latest(cfg.out)
    if folder is None:
        return None  # nothing saved yet: the run starts from step 1 (the trainer says so)
    try:
        with open(os.path.join(folder, "config.json")) as f:
            saved = type(cfg).from_dict(json.load(f), source=os.path.join(folder, "config.json"))
    except (OSError, ValueError) as e:
        return f"checkpoint {folder} cannot be read ({e}); resume from another --out or start anew without --resume."
    was, now = dataclasses.asdict(saved.model_config()), dataclasses.asdict(cfg.model_config())
    for name in was:
        if was[name] != now[name]:
            return (f"checkpoint {folder} holds a model with {name}={was[name]}, this run asks for {name}={now[name]}; "
                    f"resume with the checkpoint's model settings (--preset {saved.preset} and its overrides) or "
                    f"pass a new --out to start another run.")
    for name in LAYOUT_FIELDS:
        if getattr(saved, name) != getattr(cfg, name):
            return (f"checkpoint {folder} was written with {name}={getattr(saved, name)}, this run has "
                    f"{name}={getattr(cfg, name)}, and each rank's file holds its own shards; resume with "
                    f"{name}={getattr(saved, name)} (loading into another layout is not supported yet).")
    step = int(os.path.basename(folder).rsplit("_", 1)[-1])
    if step >= cfg.steps:
        return (f"the checkpoint in {cfg.out} is at step {step} >= --steps {cfg.steps}; nothing to do (raise --steps "
                f"to train further).")
    return None


def load(folder, model, optimizer, mesh):
    """Restore this rank's model and optimizer state from a checkpoint folder; return its step."""
    state = torch.load(os.path.join(folder, f"rank_{mesh.rank:05d}.pt"), map_location=mesh.device, weights_only=True)
    if state["world_size"] != mesh.world_size:
        raise RuntimeError(f"checkpoint {folder} was written by {state['world_size']} ranks, this run has "
                           f"{mesh.world_size}; resume with the same layout.")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]


def barrier(mesh):
    if mesh.world_size > 1:
        torch.distributed.barrier()
