"""Tensor parallelism: every weight matrix cut into tp slices, each rank computing with its slice
(Shoeybi et al. 2019, "Megatron-LM", section 3), and sequence parallelism on top of it (Korthikanti et al.
2022, "Reducing Activation Recomputation in Large Transformer Models", section 4).

The idea. A linear layer y = x Wᵀ can be split two ways. Column-parallel: rank r keeps the rows W_r of W (a
slice of the OUTPUT features) and computes y_r = x W_rᵀ, its slice of y, from the whole x. Row-parallel: rank
r keeps the columns of W that read ITS slice x_r of the input and computes a partial sum x_r W_rᵀ; the sum
over ranks is y. Chain the two and the slice in between never has to be assembled:

    MLP        x --f--> gate_r, up_r (column) --> silu(gate_r)·up_r --> down_r (row) --g--> y
    attention  x --f--> q_r, k_r, v_r (column, whole heads) --> attention of rank r's heads --> o_r (row) --g--> y

f and g are Megatron's conjugate operators, written below as autograd Functions:
    f = copy_to_tp:      forward identity (x is already on every rank), backward all-reduce (each rank's
                         gradient of x only covers its slice of the heads or columns: sum them)
    g = reduce_from_tp:  forward all-reduce (sum the partial outputs), backward identity

Communication per transformer layer (b·s·h activations of b sequences of s tokens, hidden size h): one g in
attention and one in the MLP forward, one f of each backward: 2 all-reduces forward + 2 backward, each of
b·s·h elements (a ring all-reduce sends 2(n-1)/n of that per rank). On top: the vocab-parallel embedding's
all-reduce (forward), the LM head's f (backward) and three all-reduces of b·s numbers in the loss. Nothing
is overlapped: these collectives sit on the critical path, which is why tp stays within one node.

The vocabulary is split too: rank r owns rows [r·v/n, (r+1)·v/n) of the embedding (tokens outside its range
look up zeros; the all-reduce fills them in) and of the LM head, whose logits stay sharded: the cross-entropy
below needs only three all-reduces of one number per token (max, sum of exponentials, the target's logit),
never the b·s·v logits.

Sequence parallelism (--sp). Between the blocks, tensor parallelism leaves the residual stream and the
RMSNorms replicated: n copies of the same b·s·h activations and the same work. SP cuts them along the
sequence instead, each rank keeping s/n tokens. An all-reduce is a reduce-scatter followed by an all-gather,
so g becomes a reduce-scatter along the sequence (sum the partial outputs, keep my tokens) and f an
all-gather along the sequence (every rank needs all tokens for the matmuls and attention):

    [b, s/n, h] -norm-> all-gather -> [b, s, h] -> column ... row -> reduce-scatter -> [b, s/n, h] -> + residual

Same volume as before, per layer 2 all-gathers + 2 reduce-scatters forward and the same backward (the
conjugates swap: all-gather forward / reduce-scatter backward and vice versa), and activation memory outside
the blocks divided by n. The RMSNorm weights stay replicated but each rank sees only its tokens, so their
gradients are partial: `SequenceParallelRMSNorm` passes its weight through f, whose backward all-reduces
that gradient over tp (one all-reduce of h numbers per norm per backward).

Partitioned checkpoints (--recompute partitioned; Rajbhandari et al. 2020, "ZeRO", section 6.1, Pa). Without sp
every tp rank holds the same layer input [b, s, h], so full recomputation keeps tp identical copies of each
checkpoint. `HiddenSlices` keeps rank r's h/n columns of it instead (b·s·h/n numbers: the saved checkpoints per
rank drop by n) and all-gathers the columns just before the layer is redone in backward: one all-gather of b·s·h
numbers per layer per micro-batch, in backward only (each rank receives (n-1)/n of it). With sp the inputs
are split over tp already (each rank's s/n tokens): full recomputation keeps 1/n of them with no extra gather.

`apply(model, axis, sp)` swaps the model's modules in place, on the meta device, before `marks.materialize` and
`init_weights`; `axis` is the mesh's tp axis (or `Axis.alone("tp", n, r)` to build rank r's shard with no
processes). Parameter names stay those of the unsharded model, and each sharded weight carries its placement
(`picotron.marks`): sharded over ("tp",), the full shape and this slice's offsets in it (init_weights draws the
full tensor and keeps this rank's slice, so every layout starts from the same weights), and `split_dim`, the
dimension it is cut along. Parameters without one are replicated over tp, and global-norm clipping counts those
once. `check(cfg, model_config)`
holds the rules the degrees must follow.
Heads are never split: tp must divide the query heads and the KV heads (no KV-head replication here).

Async TP (--async-tp, with --sp; `apply(..., overlap=True)`): each block's all-gather and the q/k/v (gate/up)
matmuls become ONE collective matmul, and each row-parallel matmul and its reduce-scatter another, both cut into
tp ring steps that overlap the chunks' matmuls (picotron.async_tp, which explains the ring). The LM head's
all-gather too. An MoE block's experts read the routed tokens, not a chunk of the sequence: its feed-forward keeps
the blocking all-gather and reduce-scatter, its attention overlaps. Off by default: without it nothing here changes.
"""
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from picotron import marks
from picotron.async_tp import all_gather_matmul, matmul_reduce_scatter
from picotron.hooks import Phases
from picotron.model import RMSNorm
from picotron.moe import MoE
# check(cfg, model_config), this strategy's rule, lives in picotron.rules: no torch there, so a refusal is instant
from picotron.rules import tensor_parallel_rule as check, tp_shape_problem


# --------------------------------------------------------------------------- the communication operators
def _all_reduce(x, axis, op=dist.ReduceOp.SUM):
    x = x.clone(memory_format=torch.contiguous_format)  # a fresh buffer: the caller's tensor may be shared
    axis.all_reduce(x, op=op)
    return x


def _all_gather_sequence(x, axis):
    """[b, s/n, ...] on each rank -> [b, s, ...], rank 0's tokens first. The collective concatenates along
    dim 0, so the sequence goes first for it and back to dim 1 afterwards."""
    local = x.transpose(0, 1).contiguous()
    out = local.new_empty((axis.size * local.shape[0],) + local.shape[1:])
    axis.all_gather_into(out, local)
    return out.transpose(0, 1)


def _reduce_scatter_sequence(x, axis):
    """[b, s, ...] partial sums on each rank -> [b, s/n, ...]: the sum over ranks of this rank's tokens."""
    n, s = axis.size, x.shape[1]
    if s % n:
        raise ValueError(f"sequence parallelism splits the sequence over tp={n} ranks but it has {s} tokens; "
                         f"use a sequence length that is a multiple of {n}.")
    full = x.transpose(0, 1).contiguous()
    out = full.new_empty((s // n,) + full.shape[1:])
    axis.reduce_scatter_into(out, full)
    return out.transpose(0, 1)


class CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.axis), None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, axis):
        return _all_reduce(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherSequence(torch.autograd.Function):
    """sp's f: all-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return _all_gather_sequence(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_sequence(grad, ctx.axis), None


class ReduceScatterSequence(torch.autograd.Function):
    """sp's g: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return _reduce_scatter_sequence(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_sequence(grad, ctx.axis), None


def enter_tp(x, axis, sp=False):
    """Into a tensor-parallel region (before column-parallel layers): f, or with sp the sequence all-gather."""
    return GatherSequence.apply(x, axis) if sp else CopyToTP.apply(x, axis)


def leave_tp(y, axis, sp=False):
    """Out of it (after a row-parallel layer): g, or with sp the sequence reduce-scatter."""
    return ReduceScatterSequence.apply(y, axis) if sp else ReduceFromTP.apply(y, axis)


class HiddenSlices:
    """How recompute="partitioned" saves a layer input that every tp rank holds whole (model.checkpoint_partitioned):
    rank r keeps columns [r·h/n, (r+1)·h/n) of each token's hidden vector, h/n always being whole (n divides the
    heads, so h = heads·head_dim); backward rebuilds [b, s, h] with one all-gather over tp, ranks in order."""

    def __init__(self, axis):
        self.axis = axis

    def keep(self, x):
        """[b, s, h] -> this rank's [b, s, h/n], a copy: a view would keep the whole input's storage alive."""
        piece = x.detach().chunk(self.axis.size, dim=-1)[self.axis.rank]
        return piece.clone(memory_format=torch.contiguous_format)

    def rebuild(self, piece):
        """[b, s, h/n] on each rank -> [b, s, h], the ranks' columns side by side."""
        return gather_from_tp(piece, -1, self.axis)


# ------------------------------------------------------------------------------------------------- layers
class _Sharded(nn.Module):
    """Holds `weight`: this rank's slice, along dimension `dim`, of a matrix of shape `shape`. The linear
    layers multiply through `matmul` (F.linear; a split pipeline schedule routes it to defer the weight
    gradient)."""
    matmul = staticmethod(F.linear)

    def __init__(self, shape, dim, axis, device=None, dtype=None):
        super().__init__()
        self.dim = dim
        self.axis, self.rank, self.size = axis, axis.rank, axis.size
        local = list(shape)
        local[dim] //= self.size
        self.weight = nn.Parameter(torch.empty(local, device=device, dtype=dtype))
        # what Llama.init_weights, clipping, checkpoints and the tests read (picotron.marks)
        marks.place(self, "weight", dims=axis.dims, shape=tuple(shape), split_dim=dim,
                    offsets=tuple(self.rank * n if d == dim else 0 for d, n in enumerate(local)))

    def extra_repr(self):
        whole = marks.placement(self.weight).shape
        return f"shape={whole}, shard={tuple(self.weight.shape)}, split dim {self.dim} over tp={self.size}"


class ColumnParallelLinear(_Sharded):
    """y_r = x W_rᵀ: W's output features split over the ranks; the output stays split ([..., out/n]).

    The input must first enter the tensor-parallel region (f, or the all-gather with sp). `enter=False` when
    the caller has done it already, once for several layers reading the same input (q, k and v; gate and up):
    three f's would all-reduce the input's gradient three times."""

    def __init__(self, in_features, out_features, axis, sp=False, enter=True, overlap=False, device=None,
                 dtype=None):
        super().__init__((out_features, in_features), 0, axis, device, dtype)
        self.sp, self.enter, self.overlap = sp, enter, overlap
        if overlap:  # async TP: the collective matmul's phases (chunk matmuls, waits), for whoever measures
            self.phases = Phases()

    def forward(self, x):
        if self.overlap:
            return self._overlapped(x)
        if self.enter:
            x = enter_tp(x, self.axis, self.sp)
        return self.matmul(x, self.weight)

    def _overlapped(self, x):
        """Async TP: enter=True gathers and multiplies in one ring; enter=False takes the output its block's
        collective matmul computed (`_enter_block_overlapped`) from this very input."""
        store = _plain_matmul(self)
        if self.enter:
            return all_gather_matmul(x, self.axis, [self.weight], self.phases, store)[1][0]
        gathered, y = self.__dict__.pop("pending", (None, None))
        if gathered is not x:
            raise RuntimeError("an async-TP column-parallel layer ran on an input its block's collective matmul did "
                               "not gather; call it only inside its attention or MLP block.")
        return y


class RowParallelLinear(_Sharded):
    """y = Σ_r x_r W_rᵀ: W's input features split; takes this rank's slice of the input, returns the full
    output (g), or with sp this rank's tokens of it (reduce-scatter)."""

    def __init__(self, in_features, out_features, axis, sp=False, leave=True, overlap=False, device=None,
                 dtype=None):
        super().__init__((out_features, in_features), 1, axis, device, dtype)
        self.sp, self.leave = sp, leave  # leave=False: return the partial sum (an MoE block leaves once, later)
        self.overlap = overlap and leave  # async TP: the matmul and its reduce-scatter as one ring
        if self.overlap:
            self.phases = Phases()

    def forward(self, x):
        if self.overlap:
            return matmul_reduce_scatter(x, self.weight, self.axis, self.phases, _plain_matmul(self))
        y = self.matmul(x, self.weight)
        return leave_tp(y, self.axis, self.sp) if self.leave else y


def _plain_matmul(layer):
    """Async TP multiplies with F.linear's arithmetic inside its ring: refuse a layer whose matmul was replaced (FP8),
    except by the zero-bubble split backward's, whose store then receives the weight gradients; returns that store
    (picotron.zero_bubble.WeightGradStore) or None."""
    store = getattr(layer, "weight_grads", None)
    if "matmul" in layer.__dict__ and store is None:
        raise NotImplementedError("async TP's collective matmul cannot use a replaced matmul (FP8); drop --async-tp "
                                  "or --dtype fp8 (picotron.rules refuses the pair).")
    return store


class VocabParallelEmbedding(_Sharded):
    """Rank r keeps the embedding rows of tokens [r·v/n, (r+1)·v/n); other tokens look up zeros, and the
    all-reduce (with sp: the reduce-scatter along the sequence) adds the one rank that has each row."""

    def __init__(self, num_embeddings, embedding_dim, axis, sp=False, device=None, dtype=None):
        super().__init__((num_embeddings, embedding_dim), 0, axis, device, dtype)
        self.sp = sp
        self.lo = self.rank * (num_embeddings // self.size)

    def forward(self, ids):
        outside = (ids < self.lo) | (ids >= self.lo + self.weight.shape[0])
        out = F.embedding((ids - self.lo).masked_fill(outside, 0), self.weight)
        return leave_tp(out.masked_fill(outside[..., None], 0.0), self.axis, self.sp)


class PartialGradLinear(nn.Linear):
    """A replicated linear (an MoE router) used inside the tp region, where the gradient reaching it is only
    this rank's part (it weighs partial expert outputs): the weight goes through f, so its gradient is summed
    over the tp group in backward."""

    def __init__(self, in_features, out_features, axis, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)
        self.axis = axis

    def forward(self, x):
        return F.linear(x, CopyToTP.apply(self.weight, self.axis))


class SequenceParallelRMSNorm(RMSNorm):
    """model.RMSNorm's arithmetic on this rank's tokens; the weight goes through f, so its gradient, a sum
    over this rank's tokens only, is summed over the tp group in backward (before it is accumulated)."""

    def __init__(self, size, eps, axis):
        super().__init__(size, eps)
        self.axis = axis

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return CopyToTP.apply(self.weight, self.axis) * x32.to(x.dtype)


# ----------------------------------------------------------------------------------- vocab-parallel loss
class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from logits split over the vocabulary ([N, v/n] here, vocabulary offset lo).

    loss = log Σ_v exp(z_v - m) - (z_target - m), m = max_v z_v. Three all-reduces of N numbers: the max, the
    sum of exponentials, the target's logit (found on one rank, zero elsewhere). Backward needs none:
    d loss / d z_v = softmax_v - [v = target], and each rank has its own columns of softmax."""

    @staticmethod
    def forward(ctx, logits, targets, axis, lo):
        m = _all_reduce(logits.max(dim=-1).values, axis, dist.ReduceOp.MAX)
        exp = (logits - m[:, None]).exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), axis)
        inside = (targets >= lo) & (targets < lo + logits.shape[-1])
        local = (targets - lo).masked_fill(~inside, 0)
        target_logit = (logits.gather(1, local[:, None]).squeeze(1) - m).masked_fill(~inside, 0.0)
        target_logit = _all_reduce(target_logit, axis)
        ctx.save_for_backward(exp.div_(sum_exp[:, None]), local, inside)  # softmax, this rank's columns
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, inside = ctx.saved_tensors
        grad = softmax.clone()
        grad[torch.arange(len(local), device=grad.device), local] -= inside.to(grad.dtype)
        return grad * grad_loss[:, None], None, None, None


def loss_fn(logits, targets, axis):
    """Mean cross-entropy over all tokens from vocab-sharded logits [b, s, v/n] (model.loss_fn's twin)."""
    v_local = logits.shape[-1]
    losses = VocabParallelCrossEntropy.apply(logits.float().reshape(-1, v_local), targets.reshape(-1),
                                             axis, axis.rank * v_local)
    return losses.mean()


class FullVocabLogits(nn.Module):
    """model(ids) -> logits over the whole vocabulary (all-gathered over tp), for generation only. With sp the
    ids are padded on the right to a multiple of tp: causal attention keeps earlier positions unaffected."""

    def __init__(self, model, axis, sp=False):
        super().__init__()
        self.model, self.config, self.axis, self.sp = model, model.config, axis, sp

    def forward(self, ids):
        s, n = ids.shape[1], self.axis.size
        if self.sp and s % n:
            ids = F.pad(ids, (0, n - s % n))
        return gather_vocab(self.model(ids)[:, :s], self.axis)


def gather_vocab(logits, axis):
    """[b, s, v/n] on each tp rank -> [b, s, v], the ranks' vocabulary slices side by side."""
    logits, n = logits.contiguous(), axis.size
    parts = logits.new_empty((n * logits.shape[0],) + logits.shape[1:])  # ranks' [b, s, v/n] stacked along b
    axis.all_gather_into(parts, logits)
    return torch.cat(parts.chunk(n), dim=-1)


# ---------------------------------------------------------------------------------------------- apply
def _enter_block(axis, sp, module, args):
    """Forward pre-hook on an attention or MLP block: its input enters the tp region once, for q, k and v."""
    return (enter_tp(args[0], axis, sp),) + tuple(args[1:])


def _enter_block_overlapped(axis, columns, module, args):
    """Async TP's forward pre-hook on an attention or MLP block: one collective matmul gathers the input and
    multiplies it by every column layer's weight (q, k, v or gate, up); each layer then returns its output. The
    block receives the gathered input, as without overlap."""
    gathered, ys = all_gather_matmul(args[0], axis, [c.weight for c in columns], columns[0].phases,
                                     _plain_matmul(columns[0]))
    for c, y in zip(columns, ys):
        c.pending = (gathered, y)
    return (gathered,) + tuple(args[1:])


def _swap(parent, name, new):
    """Replace parent.<name> by `new`; if the old module holds real weights (not meta), keep their slice."""
    old = getattr(parent, name)
    if old.weight.device.type != "meta":
        with torch.no_grad():
            new.weight.copy_(marks.placement(new.weight).take(old.weight, new.weight.shape))
    setattr(parent, name, new)


def apply(model, axis, sp=False, overlap=False):
    """Shard `model` (a Llama) over `axis` (the mesh's tp axis) in place and return it; tp=1 leaves it untouched."""
    n = axis.size
    if n == 1:
        return marks.attach(model)  # every parameter carries its placement on return (here: replicated)
    problem = tp_shape_problem(model.config, n)
    if problem:
        raise ValueError(problem)
    w = model.embed_tokens.weight
    kw = dict(device=w.device, dtype=w.dtype)

    overlap = bool(overlap and sp)  # async TP decomposes sp's collectives (picotron.rules refuses it without sp)

    def column(lin, enter, overlapped=overlap):
        return ColumnParallelLinear(lin.in_features, lin.out_features, axis, sp=sp, enter=enter,
                                    overlap=overlapped, **kw)

    def row(lin, leave=True, overlapped=overlap):
        return RowParallelLinear(lin.in_features, lin.out_features, axis, sp=sp, leave=leave, overlap=overlapped,
                                 **kw)

    def norm(old):
        with torch.device(w.device):
            return SequenceParallelRMSNorm(old.weight.shape[0], old.eps, axis)

    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.feed_forward
        for name in ("q_proj", "k_proj", "v_proj"):  # whole heads per rank: rows [r·a/n·d, (r+1)·a/n·d)
            _swap(attn, name, column(getattr(attn, name), enter=False))
        _swap(attn, "o_proj", row(attn.o_proj))
        moe = isinstance(mlp, MoE)
        if moe:  # MoE: every expert cut like an MLP; the block enters and leaves once (blocking, also with overlap)
            _moe(mlp, axis, sp, partial(column, overlapped=False), partial(row, overlapped=False), kw)
        else:
            _swap(mlp, "gate_proj", column(mlp.gate_proj, enter=False))
            _swap(mlp, "up_proj", column(mlp.up_proj, enter=False))
            _swap(mlp, "down_proj", row(mlp.down_proj))
        if overlap:  # async TP: the block's all-gather and its column matmuls as one ring
            attn.register_forward_pre_hook(partial(_enter_block_overlapped, axis, [attn.q_proj, attn.k_proj,
                                                                                   attn.v_proj]))
        else:
            attn.register_forward_pre_hook(partial(_enter_block, axis, sp))
        if overlap and not moe:
            mlp.register_forward_pre_hook(partial(_enter_block_overlapped, axis, [mlp.gate_proj, mlp.up_proj]))
        else:
            mlp.register_forward_pre_hook(partial(_enter_block, axis, sp))
        if sp:
            _swap(layer, "input_layernorm", norm(layer.input_layernorm))
            _swap(layer, "post_attention_layernorm", norm(layer.post_attention_layernorm))
    emb = model.embed_tokens
    _swap(model, "embed_tokens", VocabParallelEmbedding(emb.num_embeddings, emb.embedding_dim, axis, sp=sp, **kw))
    if sp:
        _swap(model, "norm", norm(model.norm))
    _swap(model, "lm_head", column(model.lm_head, enter=True))  # logits stay split over the vocabulary
    model.tie_weights()  # tied: the LM head uses the embedding's shard (same rows, same split)
    if not sp:  # every rank holds the same layer input: recompute="partitioned" keeps 1/n of it
        model.partition = HiddenSlices(axis)
    return marks.attach(model)  # the tied head and the new modules' parameters carry their placements too


def _moe(moe, axis, sp, column, row, kw):
    """A mixture-of-experts block under tp: each expert's w1/w3 column-parallel, w2 row-parallel WITHOUT the
    all-reduce; the block's output (the weighted sum of partial expert outputs) leaves the tp region once, so
    the router's gradient is partial too (`PartialGradLinear`), and so is the auxiliary loss's: the step
    engine's `aux_weight` is divided by tp (every tp rank adds the same aux). Shared experts (DeepSeek) alike."""
    for expert in [*moe.experts.values(), *([moe.shared_experts] if moe.shared_experts is not None else [])]:
        _swap(expert, "w1", column(expert.w1, enter=False))
        _swap(expert, "w3", column(expert.w3, enter=False))
        _swap(expert, "w2", row(expert.w2, leave=False))
    gate = moe.gate
    _swap(moe, "gate", PartialGradLinear(gate.in_features, gate.out_features, axis, **kw))
    moe.register_forward_hook(lambda module, args, out: leave_tp(out, axis, sp))


def gather_from_tp(t, dim, axis):
    """The full tensor from its tp slices along `dim` (None: replicated, a copy), e.g. a parameter or its
    gradient: gather_from_tp(p.grad, marks.placement(p).split_dim, mesh.tp)."""
    if dim is None or axis.size == 1:
        return t.detach().clone()
    parts = t.new_empty((axis.size * t.shape[0],) + t.shape[1:])  # the ranks' slices stacked along dim 0
    axis.all_gather_into(parts, t.detach().contiguous())
    return torch.cat(parts.chunk(axis.size), dim=dim)
