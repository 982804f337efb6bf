"""Checkpoints: sharded, atomic, asynchronous if asked, and loadable into any other layout.

What a step's checkpoint holds, `OUT/checkpoints/step_000120/`:

    config.json            the run's settings (model, layout, seed, batch)
    rank_00003.pt          rank 3's tensors: each slice it is the one holder of (values + Adam's moments),
                           its RNG state
    rank_00003.json        rank 3's index: for each slice, where it sits in the full tensor

An index entry says `name` (the parameter's name in the whole model, the same in every layout: the layers
keep their global numbers, experts theirs), `shape` (the full tensor's), `offsets` and `box` (the corner and
shape of this rank's tensor-parallel or expert slice) and `flat` (ZeRO: the elements [a, b) of that box,
flattened, that this rank's optimizer piece holds; null otherwise):

    layers.0.mlp.down_proj.weight  shape [64, 128]  offsets [0, 64]  box [64, 64]  flat [1024, 3072]
      = full[0:64, 64:128].flatten()[1024:3072]       (tp rank 1 of 2, dp rank 1 of a ZeRO over 2)

Each element of the model is written exactly once: a rank writes a slice only where it is the first holder
of those values (`marks.counted_here`: coordinate 0 along every dimension the slice is replicated over).

Loading into another layout (resharding, `picotron.reshard`) needs nothing else: the new layout's ranks compute
the same (name, offsets, box, flat) of every tensor THEY hold and cut their slices out of the full tensors the
pieces assemble into.

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

Two levels (`--local-save-every K1`, picotron's multi-level checkpointing). The checkpoint above is level 2:
slow (a shared filesystem), the only one that survives anything. Level 1 is fast and frequent: every K1 steps each
rank writes its WHOLE state (every tensor it holds, replicas included, so that it can restore itself alone) to
its node's local disk, `LOCAL/node_003/step_000120/rank_00013.pt` + `.json` (LOCAL: `--local-dir`, by default
OUT/local, whose node_N folders stand for each node's disk on one machine), and sends the same bytes to its peer:
the rank with the same place on the next node (rank + ranks_per_node), which writes them into ITS node's folder.
A lost node's shards then survive on the next node. Nodes are consecutive ranks (torchrun's order), ranks_per_node
of them (`--ranks-per-node`, by default torchrun's processes per machine); with one node there is no peer, and
the peer copy is skipped (level 1 then survives a lost process, not a lost machine). Each file is written
atomically (`.part`, fsync, rename; the `.json` last, so its presence says the shard is complete); each node keeps
its newest two level-1 steps. A step that is a multiple of `--save-every` writes level 2 only (it survives
everything level 1 does): no promotion of level-1 files, whose replicas would be written twice to the shared
folder and which a lost node no longer has.

Resume from the newest step complete at SOME level (`agreed_local`, then `load_local`): every rank reports the
level-1 steps it holds, its own shard and its peer copy (one all-gather); a step newer than level 2's is taken if
every rank's shard is in its own node's folder or in its peer's; a rank whose own copy is lost gets it back from
the peer (one batch of messages), writes it again and loads it, and a peer copy that was lost is sent again (so a
second lost node is survived too); else level 2 (resharded if the layout changed; level 1 needs the same layout,
the same model and the same run).

Several nodes. Every rank writes its own file into one folder and rank 0 commits it, so every node must see
the same OUT (a shared filesystem). The Saver checks that once, at start-up (rank 0 writes a probe file, every
rank reads it), and a resume is agreed: rank 0 reads `latest`, sends its step to every rank, and every rank
checks it sees that folder (`agreed_latest`). Either failure is one sentence on every rank, not a hang.
"""
import glob
import io
import json
import os
import re
import shutil
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from picotron import marks, p2p
from picotron.runs import latest, resume_problem, step_dir, step_of  # noqa: F401 (see 'folders')


# ------------------------------------------------------------------------------------------- the index
@dataclass(frozen=True)
class Slice:
    """Where one tensor a rank holds sits in the full model."""
    name: str               # the parameter's name in the whole model
    shape: tuple            # the full tensor's shape
    offsets: tuple          # the corner of this rank's box (tensor-parallel slice) in the full tensor
    box: tuple              # the box's shape
    flat: tuple = None      # ZeRO: [a, b) of the flattened box held by this piece; None: the whole box

    def cut(self, full):
        """This slice of `full` (a tensor of `shape`)."""
        region = full[tuple(slice(o, o + n) for o, n in zip(self.offsets, self.box))]
        return region if self.flat is None else region.reshape(-1)[self.flat[0]:self.flat[1]]


def canonical(name):
    """A parameter's name in the whole model: a pipeline stage's chunk prefix removed."""
    return re.sub(r"^chunks\.\d+\.", "", name)


def placements(run):
    """[(tensor, Slice)] for every tensor the optimizer updates on this rank (ZeRO: its pieces; under a master copy
    the fp32 masters, so a resume is exact), in the optimizer's order. Read off each tensor's placement
    (picotron.marks): a master's `master_for`, a piece's `flat`, a slice's `shape` and `offsets`, a pipeline's copy
    of a tied embedding (`copy_of`: it holds embed_tokens.weight)."""
    names = {p: canonical(n) for n, p in run.raw.named_parameters()}
    out = []
    for q in run.params:
        where, flat = marks.placement(q), None
        base = q if where.master_for is None else where.master_for  # an fp32 master saves for its parameter
        if where.flat is not None:
            base, at, n = where.flat
            flat = (at, at + n)
        whole = marks.placement(base)
        name = whole.copy_of or names[base]
        out.append((q, Slice(name, whole.shape, whole.offsets, tuple(base.shape), flat)))
    return out


# ------------------------------------------------------------------------------------------ folders
# step_dir(out, step), latest(out) (the newest complete checkpoint folder, or None), step_of(folder) and
# resume_problem(cfg, folder) (why --resume cannot continue, in one sentence) read files only: they live in
# picotron.runs, imported above, which needs no torch (the command line checks checkpoints before torch loads).


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


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path, write):
    """write(f) into path + '.part', flush and fsync it, then rename it to path."""
    with open(path + ".part", "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".part", path)


def _index_text(meta, index):
    """A rank's .json: its meta (without the RNG states and buffers), then one slice per line."""
    info = {k: v for k, v in meta.items() if "rng" not in k and k != "buffers"}
    return json.dumps(info)[:-1] + ', "slices": [\n' + ",\n".join(json.dumps(e) for e in index) + "\n]}\n"


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
        self.on_write, self.local = on_write, local  # local: level 1's places (a Local), or None
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
            _write_atomic(probe, lambda f: f.write(token[0].encode()))
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
        write = self._write if level == 2 else self._write_local
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
            _write_atomic(os.path.join(tmp, "config.json"),
                          lambda f: f.write(json.dumps(self.cfg.to_dict(), indent=1).encode()))

        def write_tensors(f):
            torch.save({"tensors": tensors, "meta": meta}, f)
            if self.on_write is not None:
                f.flush()
                self.on_write(step)  # a fault injected here dies with the file half written
        _write_atomic(base + ".pt", write_tensors)
        text = _index_text(meta, index)
        _write_atomic(base + ".json", lambda f: f.write(text.encode()))  # one slice per line
        self._barrier()  # every rank's files are complete
        if self.mesh.rank == 0:
            self._commit(tmp, final)
        self._barrier()
        self.newest = final
        record["write_start"], record["write_s"] = t0, time.perf_counter() - t0

    def _write_local(self, step, payload, record):
        """Level 1: this rank's file into its node's folder, and the same bytes to its peer (the rank in its place on
        the next node), which writes them into its own node's folder; the previous node's rank sends us its own."""
        tensors, index, meta = payload
        t0 = time.perf_counter()
        loc, rank = self.local, self.mesh.rank
        buf = io.BytesIO()
        torch.save({"tensors": tensors, "meta": meta}, buf)
        shard = (buf.getvalue(), _index_text({**meta, "run": loc.run}, index).encode())
        folder = loc.folder(rank, step)
        os.makedirs(folder, exist_ok=True)
        _write_shard(folder, rank, *shard, on_write=None if self.on_write is None else lambda: self.on_write(step))
        if loc.nodes > 1:  # one batch of messages each way round the ring of nodes (gloo: the writer's group)
            copy = _transfer(self.group, send_to=loc.holder(rank), parts=shard, recv_from=loc.source(rank))
            _write_shard(folder, loc.source(rank), *copy)
        self._barrier()  # every shard of this step is written, here and at the peers
        if rank % loc.per_node == 0:  # the node's first rank prunes its folder: the newest LOCAL_KEEP steps stay
            for old in loc.steps(rank)[:-LOCAL_KEEP]:
                shutil.rmtree(loc.folder(rank, old), ignore_errors=True)
        self.newest_local = step
        record["write_start"], record["write_s"] = t0, time.perf_counter() - t0

    def forget_local_after(self, step):
        """After a resume from `step`: level-1 steps written after it (by the attempt that failed) are stale; the
        node's first rank removes them, once every rank has read what it needs."""
        if self.local is None:
            return
        self._barrier()
        if self.mesh.rank % self.local.per_node == 0:
            for later in [s for s in self.local.steps(self.mesh.rank) if s > step]:
                shutil.rmtree(self.local.folder(self.mesh.rank, later), ignore_errors=True)

    def _commit(self, tmp, final):
        _fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)  # a checkpoint of the same step from an earlier attempt
        os.replace(tmp, final)
        pointer = os.path.join(self.root, "latest")
        _write_atomic(pointer, lambda f: f.write(os.path.basename(final).encode()))
        _fsync_dir(self.root)
        done = sorted(d for d in glob.glob(os.path.join(self.root, "step_*")) if not d.endswith(".tmp"))
        for old in done[:-self.keep] if self.keep > 0 else []:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------- level 1: the nodes' disks
LOCAL_KEEP = 2  # level-1 steps each node keeps (the newest: a crash during one write leaves the one before)
LOCAL_HELD = 8  # level-1 steps each rank reports when a resume is agreed (more than a node keeps)


@dataclass(frozen=True)
class Local:
    """Where level 1 lives: node n's folder `root/node_00n` (ranks n·per_node .. n·per_node + per_node - 1);
    rank r's peer copy is kept by `holder(r)`, the rank in its place on the next node (the ring of nodes).
    run: what every level-1 file says it belongs to (the run's folder, layout, model, batch), so a resume never
    takes a shard of another run or another layout."""
    root: str
    per_node: int
    world_size: int
    run: str

    @property
    def nodes(self):
        return self.world_size // self.per_node

    def folder(self, rank, step=None):
        """Rank `rank`'s node's level-1 folder (of `step`)."""
        node = os.path.join(self.root, f"node_{rank // self.per_node:03d}")
        return node if step is None else os.path.join(node, f"step_{step:06d}")

    def holder(self, rank):
        return (rank + self.per_node) % self.world_size

    def source(self, rank):
        return (rank - self.per_node) % self.world_size

    def steps(self, rank):
        """The level-1 steps in rank's node's folder, oldest first."""
        return sorted(step_of(d) for d in glob.glob(os.path.join(self.folder(rank), "step_*"))
                      if re.fullmatch(r"step_\d+", os.path.basename(d)))

    def holds(self, rank, of):
        """The level-1 steps for which rank's node's folder holds a complete shard of rank `of` of this run."""
        out = []
        for step in self.steps(rank):
            try:
                with open(os.path.join(self.folder(rank, step), f"rank_{of:05d}.json")) as f:
                    head = json.load(f)
            except (OSError, ValueError):
                continue  # absent, or (a crash) cut short: not a shard
            if head.get("run") == self.run and head.get("step") == step and head.get("rank") == of:
                out.append(step)
        return out


def local_of(cfg, mesh):
    """Level 1's places for this run (`--local-save-every`), or None. Ranks per node: --ranks-per-node, else
    torchrun's processes on this machine (LOCAL_WORLD_SIZE), else all."""
    if not cfg.local_save_every:
        return None
    per_node = cfg.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", mesh.world_size))
    run = {"out": os.path.abspath(cfg.out), "layout": dict(mesh.sizes, ep=mesh.ep.size),
           "model": asdict(cfg.model_config()),
           **{k: getattr(cfg, k) for k in ("zero", "sp", "pp_schedule", "pp_chunks", "dtype", "seed", "seq_len",
                                            "micro_batch_size", "grad_acc")}}
    return Local(os.path.abspath(cfg.local_dir or os.path.join(cfg.out, "local")), per_node, mesh.world_size,
                 json.dumps(run, sort_keys=True))


def _write_shard(folder, rank, data, index, on_write=None):
    """rank's level-1 files in `folder`, each atomically; the .json last: its presence says the shard is whole."""
    base = os.path.join(folder, f"rank_{rank:05d}")

    def write_data(f):
        f.write(data)
        if on_write is not None:
            f.flush()
            on_write()  # a fault injected here dies with the file half written
    _write_atomic(base + ".pt", write_data)
    _write_atomic(base + ".json", lambda f: f.write(index))


def _transfer(group, send_to=None, parts=(), recv_from=None, count=2):
    """Send the byte strings `parts` to rank `send_to` and/or receive `count` of them from rank `recv_from`: one
    batch of messages for the sizes, one for the bytes (picotron.p2p: the way NCCL needs them)."""
    sizes = torch.tensor([len(p) for p in parts], dtype=torch.int64)
    theirs = torch.zeros(count, dtype=torch.int64)
    ops = [("send", sizes, send_to)] * (send_to is not None) + [("recv", theirs, recv_from)] * (recv_from is not None)
    p2p.wait_all(p2p.exchange(ops, group))
    data = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8) if send_to is not None else None
    got = torch.empty(int(theirs.sum()), dtype=torch.uint8)
    ops = [("send", data, send_to)] * (send_to is not None) + [("recv", got, recv_from)] * (recv_from is not None)
    p2p.wait_all(p2p.exchange(ops, group))
    cuts = [0, *torch.cumsum(theirs, 0).tolist()]
    return [got[a:b].numpy().tobytes() for a, b in zip(cuts, cuts[1:])] if recv_from is not None else None


def agreed_local(saver, after):
    """(step, ranks whose own copy is lost, ranks whose peer copy is lost) of the newest level-1 step newer than
    `after` (level 2's step, or 0) that is complete: every rank's shard in its own node's folder or in its
    holder's; or None. Every rank
    reports the newest steps it holds of its own and of its source (one all-gather over the writer's group), so
    every rank finds the same answer."""
    loc, mesh = saver.local, saver.mesh
    if loc is None:
        return None
    mine = torch.full((2, LOCAL_HELD), -1, dtype=torch.int64)
    for row, of in ((0, mesh.rank), (1, loc.source(mesh.rank))):
        held = [s for s in loc.holds(mesh.rank, of) if s > after][-LOCAL_HELD:] if row == 0 or loc.nodes > 1 else []
        mine[row, :len(held)] = torch.tensor(held, dtype=torch.int64)
    every = [mine]
    if saver.group is not None:
        every = [torch.empty_like(mine) for _ in range(mesh.world_size)]
        dist.all_gather(every, mine, group=saver.group)
    own = [set(t[0].tolist()) - {-1} for t in every]
    copy = [set(t[1].tolist()) - {-1} for t in every]  # copy[h]: the steps rank h holds of its source's shard
    for step in sorted(set().union(*own), reverse=True):
        if all(step in own[r] or step in copy[loc.holder(r)] for r in range(mesh.world_size)):
            lost = [r for r in range(mesh.world_size) if step not in own[r]]
            return step, lost, [r for r in range(mesh.world_size) if loc.nodes > 1 and step not in copy[loc.holder(r)]]
    return None


def load_local(saver, step, lost, unpaired, run):
    """Load level-1 `step` into `run` (the same layout that wrote it). A rank in `lost` gets its shard back from
    its holder (one batch of messages) and writes it into its node's folder again; then a rank in `unpaired`
    (whose holder lost its copy) sends its shard to its holder again, so that every shard of `step` is on two
    nodes before training goes on (a second lost node is survived too). Returns step."""
    loc, mesh, rank = saver.local, saver.mesh, saver.mesh.rank
    folder = loc.folder(rank, step)
    os.makedirs(folder, exist_ok=True)

    def read(of):
        return [open(os.path.join(folder, f"rank_{of:05d}{ext}"), "rb").read() for ext in (".pt", ".json")]
    src, holder = loc.source(rank), loc.holder(rank)
    if lost:  # back to the rank that lost it: from its holder
        got = _transfer(saver.group, send_to=src if src in lost else None, parts=read(src) if src in lost else (),
                        recv_from=holder if rank in lost else None)
        if got is not None:
            _write_shard(folder, rank, *got)
    if unpaired:  # a copy to the holder that lost it (a rank is never in both lists: the step would be incomplete)
        got = _transfer(saver.group, send_to=holder if rank in unpaired else None,
                        parts=read(rank) if rank in unpaired else (), recv_from=src if src in unpaired else None)
        if got is not None:
            _write_shard(folder, src, *got)
    with open(os.path.join(folder, f"rank_{rank:05d}.json")) as f:
        entries = {e["key"]: e for e in json.load(f)["slices"]}
    data = torch.load(os.path.join(folder, f"rank_{rank:05d}.pt"), map_location="cpu", weights_only=True)
    tensors, meta = data["tensors"], data["meta"]
    opt_state, state = run.optimizer.state_dict(), {}
    for i, (q, s) in enumerate(placements(run)):
        e = entries[str(i)]
        if e["name"] != s.name or tuple(e["box"]) != s.box:
            raise ValueError(f"level-1 shard {folder}/rank_{rank:05d} holds {e['name']} {e['box']} where this run has "
                             f"{s.name} {s.box}: written by another layout")
        with torch.no_grad():
            q.copy_(tensors[f"{i}.value"])
        moments = {k.split(".", 1)[1]: v.clone() for k, v in tensors.items() if k.startswith(f"{i}.")
                   and not k.endswith(".value")}
        if moments:
            state[i] = {**{k: torch.tensor(v, dtype=torch.float32) for k, v in e["scalars"].items()}, **moments}
    if state:
        opt_state["state"] = state
        run.optimizer.load_state_dict(opt_state)
    for after in (getattr(run.optimizer, "after_load", None), getattr(run.model, "after_load", None)):
        if after is not None:
            after()  # as reshard.load: masters rounded into the parameters, ZeRO-1/2's full parameters gathered
    if meta.get("loss_scale") is not None and run.scaler is not None and run.scaler.dynamic:
        run.scaler.load_state_dict(meta["loss_scale"])
    torch.set_rng_state(meta["rng"])
    if "cuda_rng" in meta and mesh.device.type == "cuda":
        torch.cuda.set_rng_state(meta["cuda_rng"], mesh.device)
    saver.newest_local = step
    return step


# ------------------------------------------------------------------------------- before any process
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
