"""Placements: each parameter carries one record of how it is laid out over the grid; clipping, init and
checkpoints read it.

A strategy that cuts a parameter into pieces (or copies it) says so in the parameter's `Placement`. The record
is kept where torch's own module operations keep it: on the module that holds the parameter, keyed by the
parameter's name there (`place(module, name, ...)`), as DTensor keeps its placements inside what the module
holds. `to_empty`, `deepcopy`, `load_state_dict(assign=True)` and a swap of the Parameter
on conversion all make new Parameter objects but keep the modules' attributes, so the record outlives them.
Code that sees only tensors (the global gradient norm, ZeRO's pieces, a checkpoint) reads `placement(p)`: what
the parameter carries, given by `place` and given again by `attach(model)` after an operation that made new
Parameter objects. A tensor that carries none is refused (`NoPlacement`), never read as replicated: a slice
read as a whole tensor would be counted wrongly, silently. (A parameter never placed is replicated and whole.)
The record's fields:

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

    marks.place(layer, "weight", dims=("tp",), shape=(64, 128), offsets=(32, 0), split_dim=0)   # tensor_parallel
    marks.records(model)["layers.0.self_attn.q_proj.weight"].take(full, w.shape)  # this rank's rows (init_weights)
    marks.placement(w)                          # what the tensor carries (clipping, ZeRO, checkpoints)

`place` adds dims to those the parameter has (kept in grid order) and replaces the other fields it is given, so
strategies compose: tp places its slices on the meta device, pipeline adds "pp" later. `materialize(model,
device)` is `to_empty` then `attach`; `Llama.to_empty` and `load_state_dict` attach too, and
`parallelize.build_model` checks (`check`) that every parameter carries its record before training.

"ep" is not a dimension of its own but a part of dp (picotron.mesh): an expert is replicated over dp's other
part, edp, and over cp. So a gradient placed over ("ep",) is counted where the rank's edp coordinate is 0, and it
is summed over the mesh's `edp` axis, not `dp_cp` (`sync_axis`).

"dp_shard" is the same kind of part of dp (HSDP, picotron.mesh): a ZeRO piece cut over the shard group is placed
over ("dp_shard", "cp") and is replicated over dp's other part, the replicate groups (the blocks of dp_shard
consecutive dp ranks hold the same pieces). So it is counted where the rank's block index (dp // dp_shard) is 0.

Global-norm clipping. Every rank sums the squares of its own gradients, but counts a replicated gradient
only on the rank whose coordinate is 0 along each dimension it is replicated over; one all-reduce over the
world then adds every element of the model's gradient exactly once. No all-reduce at all when nothing is
sharded (plain data parallelism: every rank already holds the whole, identical gradient).
"""
from dataclasses import dataclass, field, replace

import torch

GRID = ("dp", "pp", "cp", "tp")
DIMS = GRID + ("ep", "dp_shard")  # what a placement's dims may name


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

    def merged(self, dims=(), **fields):
        """This placement with `dims` added (kept in DIMS order) and the other `fields` replaced: how strategies
        compose (tp places its slices on the meta device, pipeline adds "pp" later)."""
        dims = tuple(d for d in DIMS if d in set(dims) | set(self.dims))
        return replace(self, dims=dims, **fields)

    def take(self, full, shape):
        """This tensor's slice of `full` (a tensor of the full `self.shape`): the block of `shape` at `offsets`."""
        for d, (at, n) in enumerate(zip(self.offsets or (0,) * full.dim(), shape)):
            full = full.narrow(d, at, n)
        return full


class NoPlacement(RuntimeError):
    """A tensor that carries no placement: refused, never read as replicated (a sharded slice read as a whole
    replicated tensor would be counted wrongly by clipping and checkpoints, silently)."""


def _owner(module, name):
    """(the module that holds parameter `name` of `module`, its name there): "layers.0.mlp.w1.weight" ->
    (module.layers[0].mlp.w1, "weight")."""
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def place(module, name, *, dims=(), **fields):
    """Record how parameter `name` of `module` (a dotted name: "layers.0.self_attn.q_proj.weight") is laid out, and
    return the parameter. The record (its placement so far, `dims` added, the other `fields` replaced) is kept on
    the module that holds the parameter, keyed by the parameter's name there: torch's own module operations
    (to_empty, deepcopy, load_state_dict(assign=True), a swap of the Parameter) keep a module's attributes, so the
    record outlives the Parameter object. The parameter also carries it (what `placement(p)` reads)."""
    owner, leaf = _owner(module, name)
    held = owner.__dict__.setdefault("_placements", {})  # plain attribute: deepcopy copies it, to_empty keeps it
    held[leaf] = held.get(leaf, Placement()).merged(dims, **fields)
    return tag(getattr(owner, leaf), held[leaf])


def tag(t, where):
    """Let tensor `t` carry `where` (a Placement) and return `t`: for a wrapper's own tensors, which no module holds
    (ZeRO's pieces, the fp32 master copies); a module's parameters get theirs from `place` and `attach`."""
    t._placement = where
    return t


def records(module):
    """{name: Placement} for every parameter of `module` (a tied one under its first name), read from the records
    `place` keeps on the modules that hold them. A parameter never placed is replicated and whole: `Placement()`."""
    out = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        held = sub.__dict__.get("_placements", {})
        for leaf in sub._parameters:
            name = f"{path}.{leaf}" if path else leaf
            p = sub._parameters[leaf]
            if p is not None and name not in out:
                out[name] = _filled(held.get(leaf, Placement()), p)
    return {name: out[name] for name, _ in module.named_parameters()}  # named_parameters' order and names


def attach(module):
    """Let every parameter of `module` carry its record again, and return `module`: call it after anything that makes
    new Parameter objects (to_empty, deepcopy, load_state_dict(assign=True), a swap on conversion). Until then,
    `placement` refuses the new ones (NoPlacement)."""
    for name, where in records(module).items():
        tag(module.get_parameter(name), where)
    return module


def placement(p):
    """`p`'s Placement, with `shape` and `offsets` filled in (those of `p` itself when it is whole). A tensor
    that carries none raises NoPlacement: it was made, or replaced, after the model was placed."""
    where = p.__dict__.get("_placement")
    if where is None:
        raise NoPlacement(f"a tensor of shape {tuple(p.shape)} carries no placement (picotron.marks): it was made or "
                          "replaced after the model was placed (to_empty, deepcopy, load_state_dict(assign=True), a "
                          "swap on conversion); call marks.attach(model) after such an operation (marks.materialize "
                          "does it for to_empty).")
    return _filled(where, p)


def _filled(where, p):
    """`where` with `shape` and `offsets` filled in: those of `p` itself when it is whole."""
    return replace(where, shape=tuple(p.shape), offsets=(0,) * p.dim()) if where.shape is None else where


def check(module):
    """Raise NoPlacement unless every parameter of `module` carries its own record (what parallelize.build_model
    asserts before training: clipping, ZeRO and checkpoints read the parameters' placements)."""
    lost = [name for name, where in records(module).items()
            if (held := module.get_parameter(name).__dict__.get("_placement")) is None
            or _filled(held, module.get_parameter(name)) != where]
    if lost:
        raise NoPlacement(f"{len(lost)} parameter(s) do not carry their placement record ({', '.join(lost[:3])}"
                          f"{', ...' if len(lost) > 3 else ''}): replaced after the model was placed; call "
                          "marks.attach(model) after the operation that replaced them.")
    return module


def materialize(module, device):
    """`module.to_empty(device=device)`, every parameter carrying its placement again (`attach`: to_empty makes new
    Parameter objects; the records, kept on the modules, are unchanged)."""
    module.to_empty(device=device)
    return attach(module)


def counted_here(p, mesh):
    """True on exactly one rank of each group holding the same values of `p` (coordinate 0 where replicated).
    A copy (the pipeline's last-stage copy of a tied embedding, `copy_of`) is never counted: stage 0 counts it."""
    where = placement(p)
    if where.copy_of is not None:
        return False
    coords = dict(mesh.coords)
    if "ep" in where.dims:  # an expert: replicated over edp only, the part of dp that is not ep
        coords["dp"] //= mesh.ep.size  # the block's index: ranks at the same place in each block hold it
    if "dp_shard" in where.dims:  # an HSDP piece: replicated over the blocks of dp_shard dp ranks
        coords["dp"] //= mesh.dp_shard.size // mesh.cp.size  # the block's index (replicas differ only in it)
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
    sizes = {**mesh.sizes, "ep": mesh.ep.size, "dp_shard": mesh.dp_shard.size}
    if all(n == 1 for n in sizes.values()) or not any(sizes[d] > 1 for p in params for d in placement(p).dims):
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
