"""A checkpoint's files: what a step's folder holds, the index that lets any layout load it, and writing a file
so that a crash never leaves half of it (picotron.checkpoint saves, picotron.checkpoint_local keeps node-local
copies, picotron.reshard loads).

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

A file is written atomically (`write_atomic`): into `NAME.part`, flushed and fsync'ed, then renamed to NAME; a
rename within one file system is atomic on POSIX.
"""
import json
import os
import re
from dataclasses import dataclass

from picotron import marks


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


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path, write):
    """write(f) into path + '.part', flush and fsync it, then rename it to path."""
    with open(path + ".part", "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".part", path)


def index_text(meta, index):
    """A rank's .json: its meta (without the RNG states and buffers), then one slice per line."""
    info = {k: v for k, v in meta.items() if "rng" not in k and k != "buffers"}
    return json.dumps(info)[:-1] + ', "slices": [\n' + ",\n".join(json.dumps(e) for e in index) + "\n]}\n"
