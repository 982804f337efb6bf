"""Loading a checkpoint written at any layout into any other (resharding), and consolidating it.

    step = reshard.load(folder, run, mesh)     # on every rank of the new layout: its slices, Adam's state
    whole = reshard.consolidate(folder)        # one process: every full tensor (export, comparisons)

A checkpoint's index (`picotron.checkpoint`) says, for every tensor a rank wrote, the parameter's name, its full
shape, the box (offsets and shape) of the rank's tensor-parallel or expert slice, and for a ZeRO piece the range
of that box's flattened elements. The new layout's ranks compute the same entries for the tensors THEY hold
(`checkpoint.placements`). Then each rank, one parameter at a time, assembles the full tensor from the pieces that
carry its name (reading only those, memory-mapped) and cuts its own slices out: ZeRO-3 at dp 4 → one process,
dp2·tp2·pp2 + ZeRO-1 → tp 4, the same code. It checks that every element it needs was written (a missing rank
file is an error, never zeros). Peak extra memory: one full parameter and its moments.

The values loaded are identical in every layout; what changes in a new layout is the order in which the next
steps sum (other all-reduce groups, matmuls cut elsewhere), so losses then agree to the parity tolerance, not
bit for bit. In the same layout each rank's RNG state is restored too, and the resume is exact.
"""
import glob
import json
import os

import torch

from picotron.checkpoint import canonical, placements


class Reader:
    """A checkpoint folder's indexes, and its tensors on demand (memory-mapped: only what is asked is read)."""

    def __init__(self, folder):
        self.folder = folder
        paths = sorted(glob.glob(os.path.join(folder, "rank_*.json")))
        if not paths:
            raise FileNotFoundError(f"checkpoint {folder} has no rank_*.json index (not a picotron checkpoint?)")
        self.ranks = [json.load(open(p)) for p in paths]
        self.world_size = self.ranks[0]["world_size"]
        if len(self.ranks) != self.world_size:
            raise FileNotFoundError(f"checkpoint {folder} was written by {self.world_size} ranks but holds "
                                    f"{len(self.ranks)} index files")
        self.step = self.ranks[0]["step"]
        self.sources = {}  # name -> [(rank, entry)]
        for r in self.ranks:
            for e in r["slices"]:
                self.sources.setdefault(e["name"], []).append((r["rank"], e))
        self._files = {}

    def file(self, rank):
        if rank not in self._files:
            self._files[rank] = torch.load(os.path.join(self.folder, f"rank_{rank:05d}.pt"), map_location="cpu",
                                           mmap=True, weights_only=True)
        return self._files[rank]

    def names(self):
        return sorted(self.sources)

    def assemble(self, name):
        """{kind: the full tensor} for one parameter ("value", "exp_avg", ...), its scalars (Adam's step),
        and a mask of the elements the checkpoint holds."""
        entries = self.sources[name]
        shape = tuple(entries[0][1]["shape"])
        kinds = [k.split(".", 1)[1] for k in self.file(entries[0][0])["tensors"] if k.split(".")[0] == entries[0][1]["key"]]
        full = {k: None for k in kinds}
        covered = torch.zeros(shape, dtype=torch.bool)
        boxes = {}
        for rank, e in entries:  # the pieces of each box (a ZeRO over dp cuts a tp slice into flat ranges)
            boxes.setdefault((tuple(e["offsets"]), tuple(e["box"])), []).append((rank, e))
        for (offsets, box), pieces in boxes.items():
            where = tuple(slice(o, o + n) for o, n in zip(offsets, box))
            numel = int(torch.Size(box).numel())
            have = torch.zeros(numel, dtype=torch.bool)
            bufs = {}
            for rank, e in pieces:
                a, b = e["flat"] if e["flat"] is not None else (0, numel)
                have[a:b] = True
                for k in kinds:
                    t = self.file(rank)["tensors"][f"{e['key']}.{k}"]
                    if k not in bufs:
                        bufs[k] = torch.zeros(numel, dtype=t.dtype)
                    bufs[k][a:b] = t.reshape(-1)
            for k in kinds:
                if full[k] is None:
                    full[k] = torch.zeros(shape, dtype=bufs[k].dtype)
                full[k][where] = bufs[k].view(box)
            covered[where] |= have.view(box)
        return full, entries[0][1]["scalars"], covered


def load(folder, run, mesh):
    """Fill this rank's parameters, optimizer state and buffers from `folder`, written at any layout; return its step.

    Each rank assembles, one parameter at a time, the full tensors of the names it holds and cuts its slices
    out (peak extra memory: one full parameter and its moments). Same layout: each rank's RNG state too."""
    reader = Reader(folder)
    targets = placements(run)
    by_name = {}
    for i, (q, s) in enumerate(targets):
        by_name.setdefault(s.name, []).append((i, q, s))
    opt_state = run.optimizer.state_dict()
    state = {}
    for name, wanted in by_name.items():
        if name not in reader.sources:
            raise KeyError(f"checkpoint {folder} holds no {name} (written for another model?)")
        full, scalars, covered = reader.assemble(name)
        for i, q, s in wanted:
            if s.shape != tuple(full["value"].shape):
                raise ValueError(f"checkpoint {folder}: {name} has shape {tuple(full['value'].shape)}, this model "
                                 f"{s.shape}")
            if not bool(s.cut(covered).all()):
                raise ValueError(f"checkpoint {folder} lacks part of {name} (a rank's file missing or cut short?)")
            with torch.no_grad():
                q.copy_(s.cut(full["value"]).reshape(q.shape))
            moments = {k: s.cut(t).reshape(q.shape).clone() for k, t in full.items() if k != "value"}
            if moments:
                state[i] = {**{k: torch.tensor(v, dtype=torch.float32) for k, v in scalars.items()}, **moments}
        del full
    if state:
        opt_state["state"] = state
        run.optimizer.load_state_dict(opt_state)
    for after in (getattr(run.optimizer, "after_load", None), getattr(run.model, "after_load", None)):
        if after is not None:
            after()  # masters rounded into the parameters (bf16-params, fp16), then ZeRO-1/2's full parameters
    mine = dict(run.raw.named_buffers())  # MoE's routing bias (every replica wrote the same; a stage its layers')
    saved = {n: b for r in range(reader.world_size) if mine
             for n, b in reader.file(r)["meta"].get("buffers", {}).items()}
    with torch.no_grad():
        for n, b in mine.items():
            if canonical(n) not in saved:
                raise KeyError(f"checkpoint {folder} holds no {canonical(n)} (written for another model?)")
            b.copy_(saved[canonical(n)])
    scale = reader.file(0)["meta"].get("loss_scale")
    if scale is not None and run.scaler is not None and run.scaler.dynamic:
        run.scaler.load_state_dict(scale)
    if reader.world_size == mesh.world_size and reader.ranks[mesh.rank]["layout"] == dict(mesh.sizes, ep=mesh.ep.size):
        meta = reader.file(mesh.rank)["meta"]
        torch.set_rng_state(meta["rng"])
        if "cuda_rng" in meta and mesh.device.type == "cuda":
            torch.cuda.set_rng_state(meta["cuda_rng"], mesh.device)
    return reader.step


def consolidate(folder):
    """The whole model from a checkpoint, in one process: {"step", "config", "params": {name: full tensor},
    "optimizer": {name: {"exp_avg": ..., "exp_avg_sq": ..., "step": ...}}}."""
    reader = Reader(folder)
    params, optimizer = {}, {}
    for name in reader.names():
        full, scalars, covered = reader.assemble(name)
        if not bool(covered.all()):
            raise ValueError(f"checkpoint {folder} lacks part of {name} (a rank's file missing or cut short?)")
        params[name] = full.pop("value")
        optimizer[name] = {**full, **scalars}
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    return {"step": reader.step, "config": config, "params": params, "optimizer": optimizer}
