"""Level-1 checkpoints: each rank's whole state on its node's local disk, and a copy on the next node.

Two levels (`--local-save-every K1`, picotron's multi-level checkpointing). The checkpoint of picotron.checkpoint
is level 2: slow (a shared filesystem), the only one that survives anything. Level 1 is fast and frequent: every K1 steps each
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

The Saver (picotron.checkpoint) writes level 1 when asked (`saver.save(step, run, level=1)`) through its `Local`,
handing over its `snapshot` with every tensor; the files are level 2's (picotron.checkpoint_format), in one folder
per node.
"""
import glob
import io
import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from picotron import p2p
from picotron.checkpoint_format import index_text, placements, write_atomic
from picotron.runs import step_of

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

    def write(self, saver, step, payload, record):
        """The Saver's level-1 write (`saver.save(step, run, level=1)`): this rank's file into its node's folder,
        and the same bytes to its peer (the rank in its place on the next node), which writes them into its own
        node's folder; the previous node's rank sends us its own."""
        tensors, index, meta = payload
        t0 = time.perf_counter()
        rank = saver.mesh.rank
        buf = io.BytesIO()
        torch.save({"tensors": tensors, "meta": meta}, buf)
        shard = (buf.getvalue(), index_text({**meta, "run": self.run}, index).encode())
        folder = self.folder(rank, step)
        os.makedirs(folder, exist_ok=True)
        _write_shard(folder, rank, *shard, on_write=None if saver.on_write is None else lambda: saver.on_write(step))
        if self.nodes > 1:  # one batch of messages each way round the ring of nodes (gloo: the writer's group)
            copy = _transfer(saver.group, send_to=self.holder(rank), parts=shard, recv_from=self.source(rank))
            _write_shard(folder, self.source(rank), *copy)
        saver._barrier()  # every shard of this step is written, here and at the peers
        if rank % self.per_node == 0:  # the node's first rank prunes its folder: the newest LOCAL_KEEP steps stay
            for old in self.steps(rank)[:-LOCAL_KEEP]:
                shutil.rmtree(self.folder(rank, old), ignore_errors=True)
        saver.newest_local = step
        record["write_start"], record["write_s"] = t0, time.perf_counter() - t0

    def forget_after(self, saver, step):
        """After a resume from `step`: level-1 steps written after it (by the attempt that failed) are stale; the
        node's first rank removes them, once every rank has read what it needs."""
        saver._barrier()
        rank = saver.mesh.rank
        if rank % self.per_node == 0:
            for later in [s for s in self.steps(rank) if s > step]:
                shutil.rmtree(self.folder(rank, later), ignore_errors=True)

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
    torchrun's processes on this machine (mesh.per_node: LOCAL_WORLD_SIZE), else all."""
    if not cfg.local_save_every:
        return None
    per_node = cfg.ranks_per_node or mesh.per_node
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
    write_atomic(base + ".pt", write_data)
    write_atomic(base + ".json", lambda f: f.write(index))


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
