"""Parameter marks: each parameter says which grid dimensions it is sharded over; clipping reads them.

A strategy that cuts a parameter into pieces marks it: tensor parallelism marks its slices ("tp",), ZeRO
marks the optimizer's pieces with the dimensions of its axis ("dp", "cp") on top of the parameter's own,
pipeline parallelism marks every parameter of a stage ("pp",) (and the last stage's copy of a tied embedding
as a copy, counted once), expert parallelism marks its experts ("ep",). An unmarked parameter is replicated: the same
values (and, after the gradient sync, the same gradient) on every rank of the dimensions it is not sharded
over. Code that must see every element exactly once (the global gradient norm, a parameter count) reads the
marks instead of asking which strategies are on.

    p = ColumnParallelLinear(...).weight    sharded_over(p) == ("tp",)
    norm weight under ZeRO + tp             sharded_over(piece) == ("dp", "cp"): replicated over tp
    an expert's w1 at ep = 2                sharded_over(p) == ("ep",): replicated over the rest of dp (edp)

"ep" is not a dimension of its own but a part of dp (picotron.mesh): an expert is replicated over dp's other
part, edp, and over cp. So a gradient marked ("ep",) is counted where the rank's edp coordinate is 0, and it is
summed over the mesh's `edp` axis, not `dp_cp` (`sync_axis`).

Global-norm clipping. Every rank sums the squares of its own gradients, but counts a replicated gradient
only on the rank whose coordinate is 0 along each dimension it is replicated over; one all-reduce over the
world then adds every element of the model's gradient exactly once. No all-reduce at all when nothing is
sharded (plain data parallelism: every rank already holds the whole, identical gradient).
"""
import torch

GRID = ("dp", "pp", "cp", "tp")
DIMS = GRID + ("ep",)  # what a mark may name


def mark(p, dims):
    """Record that parameter `p` is sharded over grid dimensions `dims` (added to any earlier marks)."""
    p.sharded_over = tuple(d for d in DIMS if d in set(dims) | set(sharded_over(p)))
    return p


def sharded_over(p):
    """The grid dimensions `p` is sharded over; () for a replicated parameter."""
    return getattr(p, "sharded_over", ())


def counted_here(p, mesh):
    """True on exactly one rank of each group holding the same values of `p` (coordinate 0 where replicated).
    A pipeline's second copy of a tied embedding (`p.is_copy`) is never counted: stage 0 counts it."""
    if getattr(p, "is_copy", False):
        return False
    dims = sharded_over(p)
    coords = dict(mesh.coords)
    if "ep" in dims:  # an expert: replicated over edp only, the part of dp that is not ep
        coords["dp"] //= mesh.ep.size  # the block's index: ranks at the same place in each block hold it
    return all(coords[d] == 0 for d in GRID if d not in dims)


def sync_axis(p, mesh):
    """The axis over which `p`'s gradient is summed by data parallelism or ZeRO: the experts' replicas (edp) for
    an expert, dp x cp for everything else."""
    return mesh.edp if "ep" in sharded_over(p) else mesh.dp_cp


def clip_grad_norm(params, max_norm, mesh, grad_scale=1.0):
    """Scale the gradients so their global L2 norm is at most max_norm (0: never); return the norm before.
    `grad_scale`: the gradients hold grad_scale times the gradient (fp16's loss scale S): the norm is divided by it.

    "Global" is over every gradient element of the whole model, each counted once, whatever the layout:
    the marks say which gradients are slices (summed over the ranks) and which are copies (counted once)."""
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]) if grads else \
        torch.zeros(0, device=mesh.device)
    sizes = {**mesh.sizes, "ep": mesh.ep.size}
    if not any(sizes[d] > 1 for p in params for d in sharded_over(p)):
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
