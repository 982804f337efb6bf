"""Checkpoints: sharded, atomic, asynchronous if asked, and loadable into any other layout.

The files (what a step's folder holds, and the index that makes any layout able to load it) are
picotron.checkpoint_format's; level 1 (node-local copies) is picotron.checkpoint_local's; loading, into this layout
or another, is picotron.reshard's.

Atomic. Every rank writes into `step_000120.tmp/` (each file as `.part`, flushed and fsync'ed, then renamed);
after a barrier rank 0 renames the folder to `step_000120/`, then replaces the pointer `latest` (written to
a temporary file, fsync'ed, renamed). A rename within one file system is atomic on POSIX, so a crash at any
moment leaves `latest` naming a complete checkpoint: the old one or the new one. Then all but the newest
`keep` checkpoints are removed.

Asynchronous (`--async-save`). The step's tensors are copied to host memory (the only pause training sees),
then a background thread writes them and commits, coordinated over a process group of its own (gloo), so
its barriers never interleave with the training's collectives. Never two writes at once: the next save, and
the end of training, first wait for the one in flight.

Exact resume. The model and Adam's moments are saved bit for bit; the learning rate is a function of the
step; the batches are a pure function of (seed, step, rank) (`picotron.data`), so the data position is the
step; the model draws no random numbers in training (no dropout), and each rank's RNG state is saved and
restored anyway when the layout is the same. Same layout: the resumed losses are identical to the
uninterrupted run's, bit for bit. Another layout: the values loaded are identical, but the sums of the next
steps run in another order (all-reduce over other ranks, matmuls cut elsewhere), so the losses agree to the
parity tolerance (~1e-6 relative in fp32), not bit for bit.

Two levels (`--local-save-every K1`): the checkpoint above is level 2, slow (a shared filesystem) and the only
one that survives anything; level 1, each rank's whole state on its node's local disk and a copy on the next
node, frequent and fast, is picotron.checkpoint_local's (the Saver writes both; `Saver(..., local=Local)`).

Several nodes. Every rank writes its own file into one folder and rank 0 commits it, so every node must see
the same OUT (a shared filesystem). The Saver checks that once, at start-up (rank 0 writes a probe file, every
rank reads it), and a resume is agreed: rank 0 reads `latest`, sends its step to every rank, and every rank
checks it sees that folder (`agreed_latest`). Either failure is one sentence on every rank, not a hang.
"""
import glob
import json
import os
import shutil
import threading
import time
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist

from picotron import marks
# Slice, canonical and placements (the index) and Local (level 1) are also reachable from here, where readers of
# an older picotron found them
from picotron.checkpoint_format import Slice, canonical, fsync_dir, index_text, placements, write_atomic  # noqa: F401
from picotron.checkpoint_local import Local  # noqa: F401
from picotron.runs import latest, resume_notes, resume_problem, step_dir, step_of  # noqa: F401 (see 'folders')


# ------------------------------------------------------------------------------------------ folders
# step_dir(out, step), latest(out) (the newest complete checkpoint folder, or None), step_of(folder),
# resume_problem(cfg, folder) (why --resume cannot continue, in one sentence) and resume_notes(cfg, folder) read
# files only: they live in picotron.runs, imported above, which needs no torch (the command line checks
# checkpoints before torch loads).


class NotShared(RuntimeError):
    """Some ranks do not see the checkpoint folder rank 0 sees (nodes without a shared filesystem); one sentence."""


def _blind(flag, rank, world_size, group, device="cpu"):
    """The ranks whose `flag` is true (every rank learns the whole list: one all-reduce of world_size numbers)."""
    flags = torch.zeros(world_size, device=device)
    flags[rank] = float(bool(flag))
    dist.all_reduce(flags, group=group)
    return [r for r, f in enumerate(flags.tolist()) if f]


def _who(ranks):
    """"rank 5 does", "ranks 4 and 5 do", "ranks 4, 5, 6 and 7 do", "ranks 4, 5, 6 and 9 more do"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]} does"
    head, tail = (ranks[:-1], str(ranks[-1])) if len(ranks) <= 4 else (ranks[:3], f"{len(ranks) - 3} more")
    return f"ranks {', '.join(map(str, head))} and {tail} do"


def agreed_latest(out, mesh):
    """The checkpoint folder every rank resumes from, or None: rank 0 reads `latest` and sends its step to every
    rank (so they load the same step whatever their own `latest` says), and every rank checks that it sees that
    folder. A rank that does not (another node without a shared filesystem) makes every rank raise NotShared
    with the same sentence: no rank goes on to wait for it. Two small collectives over the world, once."""
    if mesh.world_size == 1:
        return latest(out)
    folder = latest(out) if mesh.rank == 0 else None
    t = torch.tensor([step_of(folder) if folder else -1], dtype=torch.int64, device=mesh.device)
    mesh.world.broadcast(t)
    step = int(t.item())  # (once, at start-up)
    if step < 0:
        return None
    folder = step_dir(out, step)
    blind = _blind(not os.path.isdir(folder), mesh.rank, mesh.world_size, mesh.world.group, mesh.device)
    if blind:
        raise NotShared(f"{_who(blind)} not see {folder} that rank 0 resumes from: every node must see the same "
                        f"checkpoint folder (a shared filesystem), or copy it there.")
    return folder


# ------------------------------------------------------------------------------------------- saving
def snapshot(run, mesh, step, everything=False):
    """This rank's part of the checkpoint, copied to host memory: ({key: tensor}, index entries, meta).
    everything: every tensor this rank holds, replicas too (level 1: a rank restores itself from its own file)."""
    tensors, index = {}, []
    state = run.optimizer.state
    for i, (q, s) in enumerate(placements(run)):
        if not everything and not marks.counted_here(q, mesh):
            continue  # another rank writes these values
        key = str(i)
        tensors[f"{key}.value"] = q.detach().to("cpu", copy=True)
        scalars = {}
        for kind, v in state.get(q, {}).items():  # Adam: exp_avg, exp_avg_sq (tensors like q), step (a scalar)
            if torch.is_tensor(v) and v.shape == q.shape:
                tensors[f"{key}.{kind}"] = v.detach().to("cpu", copy=True)
            else:
                scalars[kind] = float(v)
        index.append({"key": key, **asdict(s), "scalars": scalars})
    meta = {"rank": mesh.rank, "world_size": mesh.world_size, "step": step, "layout": dict(mesh.sizes, ep=mesh.ep.size),
            "rng": torch.get_rng_state(),  # and buffers (MoE's routing bias: the same on every replica)
            "buffers": {canonical(n): b.detach().to("cpu", copy=True) for n, b in run.raw.named_buffers()}}
    if mesh.device.type == "cuda":
        meta["cuda_rng"] = torch.cuda.get_rng_state(mesh.device)
    if run.scaler is not None and run.scaler.dynamic:  # fp16: the loss scale and its clock
        meta["loss_scale"] = run.scaler.state_dict()
    return tensors, index, meta


class Saver:
    """Writes checkpoints for one run: `save(step, run)`, then `close()` (waits for a write in flight).

    keep: how many complete checkpoints to keep (the newest). asynchronous: write in a background thread.
    on_write(step): called on every rank while its file is half written (fault injection; None in training)."""

    def __init__(self, out, cfg, mesh, keep=3, asynchronous=False, on_write=None, local=None):
        self.out, self.cfg, self.mesh, self.keep, self.asynchronous = out, cfg, mesh, keep, asynchronous
        self.on_write, self.local = on_write, local  # level 1's places (a checkpoint_local.Local), or None
        self.root = os.path.join(out, "checkpoints")
        self.thread, self.error, self.newest, self.newest_local = None, None, latest(out), None
        self.times = []  # per save (this rank): {"step", "level", "start", "snapshot_s", "write_start", "write_s",
        #                                         "bytes"}
        self.group = None
        if mesh.world_size > 1:  # the writer's own group: its barriers never meet the training's collectives
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.timeout_s))
        if mesh.rank == 0:  # leftovers of a write that a crash cut short
            for tmp in glob.glob(os.path.join(self.root, "step_*.tmp")):
                shutil.rmtree(tmp, ignore_errors=True)
        self._barrier()
        if self.group is not None:
            self._check_shared()

    def _check_shared(self):
        """Every rank must see the files rank 0 writes in `root` (rank 0 commits the folder the others wrote into):
        rank 0 writes a probe with a token of this run, every rank reads it, then rank 0 removes it. Raises
        NotShared on every rank if some do not see it (nodes without a shared filesystem)."""
        token = [f"{os.getpid()}-{time.time_ns()}" if self.mesh.rank == 0 else None]
        dist.broadcast_object_list(token, src=0, group=self.group)
        probe = os.path.join(self.root, ".shared-probe")
        if self.mesh.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            write_atomic(probe, lambda f: f.write(token[0].encode()))
        self._barrier()
        try:
            with open(probe) as f:
                seen = f.read() == token[0]
        except OSError:
            seen = False
        blind = _blind(not seen, self.mesh.rank, self.mesh.world_size, self.group)
        if self.mesh.rank == 0:
            os.remove(probe)
        if blind:
            raise NotShared(f"{_who(blind)} not see the files rank 0 writes in {self.root}: every node must write "
                            f"its checkpoints to the same folder (a shared filesystem); pass an --out that every "
                            f"node sees.")

    def _barrier(self):
        if self.group is not None:
            dist.barrier(group=self.group)

    def save(self, step, run, level=2):
        """Checkpoint the state after `step`'s update: level 2 in OUT/checkpoints, level 1 on the nodes' local disks
        (each rank's whole state, and a copy on the next node). Asynchronous: returns once the tensors are on the
        host."""
        self.wait()  # never two writes at once
        t0 = time.perf_counter()
        payload = snapshot(run, self.mesh, step, everything=level == 1)
        record = {"step": step, "level": level, "snapshot_s": time.perf_counter() - t0, "start": t0,
                  "bytes": sum(t.numel() * t.element_size() for t in payload[0].values())}
        self.times.append(record)
        write = self._write if level == 2 else lambda *a: self.local.write(self, *a)  # level 1: checkpoint_local
        if self.asynchronous:
            self.thread = threading.Thread(target=self._write_guarded, args=(write, step, payload, record),
                                           daemon=True, name=f"checkpoint step {step}")
            self.thread.start()
        else:
            write(step, payload, record)
        return step_dir(self.out, step) if level == 2 else self.local.folder(self.mesh.rank, step)

    def wait(self):
        """Wait for the write in flight (if any); raise its error if it failed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"writing a checkpoint failed: {error}") from error

    def close(self):
        """Wait for the write in flight, then free the writer's process group (the Saver is done)."""
        self.wait()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    def _write_guarded(self, write, step, payload, record):
        try:
            write(step, payload, record)
        except BaseException as e:  # re-raised by the next wait() on the main thread
            self.error = e

    def _write(self, step, payload, record):
        tensors, index, meta = payload
        t0 = time.perf_counter()
        final = step_dir(self.out, step)
        tmp = final + ".tmp"
        os.makedirs(tmp, exist_ok=True)
        base = os.path.join(tmp, f"rank_{self.mesh.rank:05d}")
        if self.mesh.rank == 0:
            write_atomic(os.path.join(tmp, "config.json"),
                          lambda f: f.write(json.dumps(self.cfg.to_dict(), indent=1).encode()))

        def write_tensors(f):
            torch.save({"tensors": tensors, "meta": meta}, f)
            if self.on_write is not None:
                f.flush()
                self.on_write(step)  # a fault injected here dies with the file half written
        write_atomic(base + ".pt", write_tensors)
        text = index_text(meta, index)
        write_atomic(base + ".json", lambda f: f.write(text.encode()))  # one slice per line
        self._barrier()  # every rank's files are complete
        if self.mesh.rank == 0:
            self._commit(tmp, final)
        self._barrier()
        self.newest = final
        record["write_start"], record["write_s"] = t0, time.perf_counter() - t0

    def forget_local_after(self, step):
        """After a resume from `step`: level-1 steps written after it (by the attempt that failed) are stale."""
        if self.local is not None:
            self.local.forget_after(self, step)

    def _commit(self, tmp, final):
        fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)  # a checkpoint of the same step from an earlier attempt
        os.replace(tmp, final)
        pointer = os.path.join(self.root, "latest")
        write_atomic(pointer, lambda f: f.write(os.path.basename(final).encode()))
        fsync_dir(self.root)
        done = sorted(d for d in glob.glob(os.path.join(self.root, "step_*")) if not d.endswith(".tmp"))
        for old in done[:-self.keep] if self.keep > 0 else []:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
