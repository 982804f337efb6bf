"""Placements: each parameter carries one record of how it is laid out over the grid; clipping, init and
checkpoints read it.

A strategy that cuts a parameter into pieces (or copies it) says so in the parameter's `Placement`, attached
with `place(p, ...)` and read with `placement(p)` (an unplaced parameter reads as replicated: the same values,
and after the gradient sync the same gradient, on every rank). Code that must see every element exactly once
(the global gradient norm, a checkpoint, the layout-independent init) reads the record instead of asking which
strategies are on. The record's fields:

    dims        the grid dimensions the tensor is sharded over ("dp", "pp", "cp", "tp", "ep"; () = replicated)
    shape       the full tensor's shape, and `offsets` where this rank's slice starts in it
    split_dim   the dimension tensor parallelism cuts (None: not cut)
    flat        a ZeRO piece: (the parameter, its first element, how many) of the flattened parameter
    copy_of     the name of the parameter this one is a copy of (pipeline: the last stage's tied LM head)
    master_for  the low-precision parameter an fp32 master copy stands for

One example per strategy (tp rank 1 of 2, q_proj.weight a 64 x 128 matrix):

    strategy          the tensor                      its Placement
    tensor parallel   q_proj.weight's rows 32-63      dims ("tp",), shape (64, 128), offsets (32, 0), split_dim 0
    ZeRO (dp x cp)    a 1-D piece of that slice       dims ("dp", "cp", "tp"), flat (q_proj.weight, 1024, 2048)
    pipeline          every parameter of a stage      "pp" added to its dims; the last stage's tied LM head also
                                                      copy_of "embed_tokens.weight" (stage 0 counts it)
    expert parallel   an expert's w1                  dims ("ep",): replicated over the rest of dp (edp)
    bf16-params/fp16  the fp32 master of p            p's placement, with master_for p

    marks.place(w, dims=("tp",), shape=(64, 128), offsets=(32, 0), split_dim=0)   # tensor_parallel, on meta
    marks.placement(w).take(full, w.shape)     # this rank's rows of the full matrix (Llama.init_weights)

`place` adds dims to those the tensor has (kept in grid order) and replaces the other fields it is given, so
strategies compose: tp places its slices on the meta device, pipeline adds "pp" later. `to_empty` makes new
Parameter objects, which would drop the records: a parallel model is materialised with `materialize(model,
device)`, which keeps each record by parameter name and attaches it again.

"ep" is not a dimension of its own but a part of dp (picotron.mesh): an expert is replicated over dp's other
part, edp, and over cp. So a gradient placed over ("ep",) is counted where the rank's edp coordinate is 0, and it
is summed over the mesh's `edp` axis, not `dp_cp` (`sync_axis`).

Global-norm clipping. Every rank sums the squares of its own gradients, but counts a replicated gradient
only on the rank whose coordinate is 0 along each dimension it is replicated over; one all-reduce over the
world then adds every element of the model's gradient exactly once. No all-reduce at all when nothing is
sharded (plain data parallelism: every rank already holds the whole, identical gradient).
"""
from dataclasses import dataclass, field, replace

import torch

GRID = ("dp", "pp", "cp", "tp")
DIMS = GRID + ("ep",)  # what a placement's dims may name


@dataclass(frozen=True)
class Placement:
    """Where a tensor sits in the whole model (see the module docstring); the default is replicated and whole."""
    dims: tuple = ()          # grid dimensions it is sharded over, in DIMS order
    shape: tuple = None       # the full tensor's shape (None: the tensor is whole: its own shape)
    offsets: tuple = None     # where this slice starts in the full tensor (None: at 0 in every dimension)
    split_dim: int = None     # the dimension tensor parallelism cuts (None: not cut)
    flat: tuple = field(default=None, compare=False)  # ZeRO piece: (parameter, first element, count), flattened
    copy_of: str = None       # the name of the parameter this tensor is a copy of
    master_for: torch.Tensor = field(default=None, compare=False)  # the parameter an fp32 master stands for

    def take(self, full, shape):
        """This tensor's slice of `full` (a tensor of the full `self.shape`): the block of `shape` at `offsets`."""
        for d, (at, n) in enumerate(zip(self.offsets or (0,) * full.dim(), shape)):
            full = full.narrow(d, at, n)
        return full


def place(p, base=None, *, dims=(), **fields):
    """Attach `p`'s placement and return `p`: `base` (default: the placement `p` has already) with `dims` added
    and the other `fields` replaced."""
    base = getattr(p, "_placement", Placement()) if base is None else base
    dims = tuple(d for d in DIMS if d in set(dims) | set(base.dims))
    p._placement = replace(base, dims=dims, **fields)
    return p


def placement(p):
    """`p`'s Placement, with `shape` and `offsets` filled in (those of `p` itself when it is whole)."""
    where = getattr(p, "_placement", Placement())
    if where.shape is None:
        where = replace(where, shape=tuple(p.shape), offsets=(0,) * p.dim())
    return where


def materialize(module, device):
    """`module.to_empty(device=device)`, keeping every parameter's placement: to_empty makes new Parameter
    objects (without the old ones' attributes), so the records are kept by parameter name and attached again."""
    kept = {name: p._placement for name, p in module.named_parameters(remove_duplicate=False)
            if hasattr(p, "_placement")}
    module.to_empty(device=device)
    for name, p in module.named_parameters(remove_duplicate=False):
        if name in kept:
            p._placement = kept[name]
    return module


def counted_here(p, mesh):
    """True on exactly one rank of each group holding the same values of `p` (coordinate 0 where replicated).
    A copy (the pipeline's last-stage copy of a tied embedding, `copy_of`) is never counted: stage 0 counts it."""
    where = placement(p)
    if where.copy_of is not None:
        return False
    coords = dict(mesh.coords)
    if "ep" in where.dims:  # an expert: replicated over edp only, the part of dp that is not ep
        coords["dp"] //= mesh.ep.size  # the block's index: ranks at the same place in each block hold it
    return all(coords[d] == 0 for d in GRID if d not in where.dims)


def sync_axis(p, mesh):
    """The axis over which `p`'s gradient is summed by data parallelism or ZeRO: the experts' replicas (edp) for
    an expert, dp x cp for everything else."""
    return mesh.edp if "ep" in placement(p).dims else mesh.dp_cp


def clip_grad_norm(params, max_norm, mesh, grad_scale=1.0):
    """Scale the gradients so their global L2 norm is at most max_norm (0: never); return the norm before.
    `grad_scale`: the gradients hold grad_scale times the gradient (fp16's loss scale S): the norm is divided by it.

    "Global" is over every gradient element of the whole model, each counted once, whatever the layout:
    the placements say which gradients are slices (summed over the ranks) and which are copies (counted once)."""
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]) if grads else \
        torch.zeros(0, device=mesh.device)
    sizes = {**mesh.sizes, "ep": mesh.ep.size}
    if not any(sizes[d] > 1 for p in params for d in placement(p).dims):
        total = torch.linalg.vector_norm(norms)  # every rank holds the whole gradient
    else:
        here = torch.tensor([counted_here(p, mesh) for p in params], dtype=torch.float32, device=norms.device)
        square = (norms.square() * here).sum()
        mesh.world.all_reduce(square)
        total = square.sqrt()
    total = total / grad_scale
    if max_norm > 0:  # 0 = no clipping (the norm is still measured and logged)
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale)
    return total.item()
