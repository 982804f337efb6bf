"""ZeRO: shard what data parallelism keeps n copies of (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", section 5).

Data parallelism keeps on every one of its n ranks all the parameters, all the gradients and all of Adam's
state, n identical copies. But after the gradients are summed, each rank could update just 1/n of the
parameters and hand the result to the others. ZeRO shards the model states over the dp x cp group:

    stage   each rank keeps                           bytes per rank (Ψ parameters)   communication per step
    DP      params, grads, optimizer state            4Ψ + 4Ψ + 8Ψ                    all-reduce = RS + AG: 2Ψ
    ZeRO-1  params, grads, 1/n of optimizer state     4Ψ + 4Ψ + 8Ψ/n                  reduce-scatter + all-gather: 2Ψ
    ZeRO-2  params, 1/n of grads and optimizer state  4Ψ + (4Ψ + 8Ψ)/n                reduce-scatter + all-gather: 2Ψ
    ZeRO-3  1/n of everything                         (4Ψ + 4Ψ + 8Ψ)/n                2 all-gathers + reduce-scatter: 3Ψ

The bytes are those of this project's recipe: parameters stay fp32 and bf16 runs through autocast, so a
parameter is its own master copy and Adam's two moments are k = 8 bytes. (docs/reference.md, "ZeRO: memory and
communication per rank", gives the classic mixed-precision version, bf16 params and grads + fp32 master + moments:
2Ψ + 2Ψ + 12Ψ.)

The flat view. Each *unit* (a bucket of parameters in stages 1-2, one transformer layer in stage 3) is seen
as one flat vector, padded with zeros to a multiple of n and cut into n equal chunks; rank r owns chunk r:

    unit   [ q_proj.weight | k_proj.weight | ... | down_proj.weight | pad ]
    chunk  [     rank 0     |     rank 1     |     rank 2     |     rank 3     ]    (a chunk may cut a tensor)

A reduce-scatter of the flat gradient leaves on rank r the sum of chunk r only; an all-gather of the chunks
rebuilds the flat parameters. The optimizer sees only this rank's chunk, as one 1-D piece per tensor that
the chunk touches (weight decay still goes to matrices only). Adam is elementwise, so each element is
updated exactly as in data parallelism: same loss, same parameters.

Stage 3 over time. A unit's parameters exist only while it computes; the next one's all-gather is started
early ("prefetch") so that it runs while the current unit computes:

    forward   AG root, AG L0 | L0 fwd, AG L1 | L1 fwd, AG L2 | ...      (free Li after its forward)
    backward  AG L3 | L3 bwd, AG L2 | L2 bwd, AG L1 | ...               (RS the grads of Li, free Li)

The root unit (embedding, final norm, LM head) stays gathered from the start of the forward to the end of
the backward, as FSDP2 does for its root: the LM head is the last thing the forward uses and the first the
backward does. So stage 3 all-gathers 2Ψ minus the root once, and reduce-scatters Ψ.

Gradient accumulation: stage 1 keeps full local gradients, so under `no_sync()` they add up locally and one
reduce-scatter follows the last micro-batch. Stages 2 and 3 keep no full gradient: by default they reduce-scatter
after every micro-batch and add into the gradient shard (`no_sync` changes nothing there).

With a pipeline (`accumulate=True`, what parallelize passes when pp > 1) stages 2 and 3 follow `no_sync()` as
stage 1 does: the executor (picotron.pipeline_parallel.Pipeline) runs every backward of a chunk but its last under
`no_sync()`, so a chunk's full gradients add up locally over its m micro-batches and are reduce-scattered once, at
the chunk's last backward (torch.distributed.pipelining does the same with FSDP: `set_requires_gradient_sync(False)`
on all but the last backward). The price is memory during the step: the stage's full gradients, 4Ψ_stage bytes,
from its first backward to its last (between steps, only the shards). The alternative, a reduce-scatter after
every micro-batch, keeps no full gradient but sends m times as much: a pipeline runs m >= pp micro-batches per
step, often 4-8 pp, so that is the bigger cost. (Stage 3 with a pipeline: picotron.zero3.)

The optimizer's pieces are placed as sharded over dp x cp (`picotron.marks`), so the trainer's one global-norm
clipping counts each gradient element once, whatever else is on.

Experts (expert parallelism) are sharded over ep already and replicated only over the rest of dp x cp, the
mesh's `edp` axis: their units are cut over that axis instead (`axis_of(p)`, from the placements), while every
gradient is still divided by the dp x cp size, the number of batch shards it was summed over.

HSDP (hybrid sharded data parallelism: torchtitan's data_parallel_shard_degree x data_parallel_replicate_degree,
Megatron's distributed-optimizer instances; PyTorch FSDP's hybrid sharding, Zhao et al. 2023; ZeRO++'s hpZ, Wang et
al. 2023, keeps a secondary copy of the parameters within a node for the same reason). ZeRO over all n = dp x cp
ranks sends every byte of every stage over the slowest link of the group: on a pod, the network between nodes.
HSDP shards over a smaller group of n_s ranks (`axis`: the mesh's dp_shard axis, a node) and keeps
n_r = n / n_s replicas of that sharded model (`replicate`: the mesh's dp_replicate axis, across nodes):

    gradients   reduce-scatter within the shard group   (n_s-1)/n_s · Ψ      on the fast links
                then all-reduce the shard across replicas 2(n_r-1)/n_r · Ψ/n_s   on the slow ones: 1/n_s of DP's
    parameters  all-gather within the shard group        (n_s-1)/n_s · Ψ      (ZeRO-3: every layer, twice)

(bytes sent per rank, in units of the parameters' bytes; picotron.planner.hsdp_bytes_per_step.) The all-reduce
runs in `finish_sync`, once per step on the summed shard, after the last reduce-scatter; the division is by n
(the batch shards of the mean), not n_s. Memory divides by n_s instead of n: the price of the cheaper network.

ZeRO-1/2 here: `ZeroDataParallel` syncs the gradients (reduce-scatter into shards) and `ShardedOptimizer` is the
optimizer: its step updates this rank's chunk and then all-gathers every chunk, so that every rank holds the
updated parameters again. Stage 3 is in `picotron.zero3`.

Caveat (stage 3, zero3.py): every forward all-gathers collectively, so every rank must run the same forwards, evaluation
and text generation included; a forward on rank 0 alone waits for the others until the timeout ends it.
"""
import math

import torch
from torch import nn

from picotron import marks
from picotron.data_parallel import GradSync, buckets


class FlatUnit:
    """Parameters seen as one flat vector of `padded` = n·`chunk` elements; this rank owns [lo, hi).

    Every field a stage uses is declared here (None where that stage does not use it), so reading a unit never
    has to ask what it has:

        full        the flat parameters: ZeRO-1/2 always; ZeRO-3 a buffer whose storage exists only while gathered
        shard       this rank's chunk of the parameters (ZeRO-1/2: a view of `full`; ZeRO-3: its own copy)
        grad_full   ZeRO-1: the full flat gradient, each p.grad a view of it
        grad_shard  this rank's chunk of the summed gradient (what the optimizer's pieces view)
        grad_flat   ZeRO-3: the flat gradient buffer autograd accumulates into during the unit's backward
        layer       ZeRO-3: a transformer layer (True) or a root (False); `state`: "free", "gathering" or
                    "gathered"; `phase`: the open hooks.Phases context of the layer's forward or backward
    """

    def __init__(self, name, params, axis, layer=False):
        self.name, self.params, self.axis = name, list(params), axis
        rank, n = axis.rank, axis.size
        sizes = [p.numel() for p in self.params]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.numel = sum(sizes)
        self.chunk = max(1, math.ceil(self.numel / n))
        self.padded = self.chunk * n
        self.lo, self.hi = rank * self.chunk, (rank + 1) * self.chunk
        self.ready = 0  # gradients accumulated so far in this backward
        self.holding = False  # (accumulate) full gradients kept over the micro-batches, not yet reduce-scattered
        self.work = None  # the collective in flight on this unit, if any
        self.full = self.shard = self.grad_full = self.grad_shard = self.grad_flat = None  # (see the docstring)
        self.layer, self.state, self.phase = layer, "gathered", None

    def flat(self, tensors):
        """Concatenate `tensors` (one per parameter, same shapes) into one zero-padded flat vector."""
        p0 = self.params[0]
        out = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        for t, off in zip(tensors, self.offsets):
            out[off:off + t.numel()].copy_(t.reshape(-1))
        return out

    def use_as_storage(self, flat):
        """From now on every parameter is a view of `flat`: writing `flat` writes the parameters."""
        for p, off in zip(self.params, self.offsets):
            p.data = flat[off:off + p.numel()].view_as(p)

    def pieces(self):
        """(parameter, start in this rank's chunk, length, start in the flattened parameter) for each tensor the
        chunk touches."""
        for p, off in zip(self.params, self.offsets):
            a, b = max(self.lo, off), min(self.hi, off + p.numel())
            if a < b:
                yield p, a - self.lo, b - a, a - off

    def nbytes(self):
        return self.padded * self.params[0].element_size()


class ShardedGradSync(GradSync):
    """What the stages share: the axis, the optimizer's pieces, the reduce-scatter pipeline, checkpoints."""

    def __init__(self, module, axis, stage, axis_of=None, accumulate=False, replicate=None):
        super().__init__(module)
        self.stage, self.axis = stage, axis
        self.replicate = replicate  # HSDP: the replicas of this shard group; each shard's gradient all-reduced over it
        self.batch_shards = axis.size * (replicate.size if replicate is not None else 1)  # the mean divides by this
        self._replicas_due = False  # a reduce-scatter ran since the last all-reduce over the replicas
        self.accumulate = accumulate  # stages 2-3: under no_sync keep the full gradients, reduce-scatter the sum once
        self.axis_of = axis_of or (lambda p: axis)  # the axis a parameter's unit is cut over (experts: edp)
        self.n, self.rank = axis.size, axis.rank
        self.units = []
        self.unit_of = {}  # parameter -> its unit
        self.transient = self.transient_peak = 0  # bytes of gathered params + gradient buckets in flight
        self._pending = []  # reduce-scatters in flight: (unit, work, flat gradient buffer)
        # a pipeline's tied embedding: the first stage's matrix and the last stage's copy, each a unit of its own
        self.tied = self.stages.tied_params(module)

    def _make_pieces(self):
        """The optimizer's parameters: 1-D views of each unit's shard, their .grad views of the gradient shard.
        Each piece is placed (`picotron.marks`) as sharded over this axis on top of its parameter's own dims, and
        says which elements of its parameter it holds (`flat`: the parameter, the first element, the count;
        checkpoints read it to place the piece in the full tensor)."""
        self.pieces = []  # (piece, is a matrix, unit, start, length)
        for unit in self.units:
            for p, start, length, at in unit.pieces():
                where = marks.placement(p)
                piece = marks.tag(nn.Parameter(unit.shard[start:start + length]), marks.Placement().merged(
                    unit.axis.dims + where.dims, flat=(p, at, length), copy_of=where.copy_of))
                self.pieces.append((piece, p.dim() >= 2, unit, start, length))
        self._attach_piece_grads()

    def _attach_piece_grads(self):
        for piece, _, unit, start, length in self.pieces:
            piece.grad = None if unit.grad_shard is None else unit.grad_shard[start:start + length]

    def optimizer_groups(self):
        """(pieces that get weight decay, pieces that do not): what to hand the optimizer."""
        return [q[0] for q in self.pieces if q[1]], [q[0] for q in self.pieces if not q[1]]

    def _track(self, nbytes):
        self.transient += nbytes
        self.transient_peak = max(self.transient_peak, self.transient)

    def _send_gradients(self, unit):
        """Stages 2-3: the unit's gradients as one flat buffer (ZeRO-3: autograd wrote them into it; ZeRO-2:
        copied), the per-parameter gradients dropped, then an asynchronous reduce-scatter of the buffer."""
        flat = unit.grad_flat if unit.grad_flat is not None else unit.flat([p.grad for p in unit.params])
        unit.grad_flat = None
        if unit.holding:  # (accumulate) the gradients held over the micro-batches are this flat buffer now
            unit.holding = False
            self._track(-unit.nbytes())
        for p in unit.params:
            p.grad = None
        flat.div_(self.batch_shards)  # the sum over ranks becomes the mean
        work = unit.axis.reduce_scatter_into(flat[unit.lo:unit.hi], flat, async_op=True,  # in place: chunk r gets the sum
                                             label=f"reduce-scatter {unit.name}")
        self._pending.append((unit, work, flat))
        self._replicas_due = True
        self._track(flat.numel() * flat.element_size())
        self._drain(keep=1)  # at most two buffers in flight: memory stays bounded

    def _drain(self, keep=0):
        """Finish the oldest reduce-scatters (and any already done) and add their chunk to the gradient shard."""
        while self._pending and (len(self._pending) > keep or self._pending[0][1].is_completed()):
            unit, work, flat = self._pending.pop(0)
            work.wait()
            if unit.grad_shard is None:  # the first micro-batch of the step: allocated only now
                unit.grad_shard = flat[unit.lo:unit.hi].clone()
            else:
                unit.grad_shard.add_(flat[unit.lo:unit.hi])
            self._track(-flat.numel() * flat.element_size())

    def finish_sync(self):
        """Wait for every reduce-scatter: call after the last backward, before clipping and the optimizer."""
        for unit in self.units:
            if unit.work is not None and self.stage == 1:
                unit.work.wait()
                unit.work = None
        self._drain(keep=0)
        if self.replicate is not None and self._replicas_due:  # (once per step, however often this is called)
            self._all_reduce_replicas()
        self._replicas_due = False
        self._attach_piece_grads()

    def _all_reduce_replicas(self):
        """HSDP: sum each unit's gradient shard over the replicas (the same shard on every replica), all started
        at once in the units' order, then waited for: 1/n_s of the gradient crosses the replicate axis."""
        works = [self.replicate.all_reduce(u.grad_shard, async_op=True, label=f"all-reduce {u.name} over replicas")
                 for u in self.units if u.grad_shard is not None]
        for w in works:
            w.wait()

    def tied_grads(self):
        """A pipeline's tied embedding (pipeline_parallel.sync_tied sums these after finish_sync): the first stage's
        matrix and the last stage's copy are units of one shape, cut alike, so this rank's shards of the two hold
        the same elements."""
        return [self.unit_of[p].grad_shard for p in self.tied]

    def zero_grad(self, set_to_none=True):
        """Zero the gradient shards in place (the optimizer's pieces keep views of them)."""
        for unit in self.units:
            if self.stage == 1:
                unit.grad_full.zero_()  # the shard is a view of it
            else:  # freed: between steps (and in the forward) stages 2-3 hold no gradient at all
                unit.grad_shard = None
                for p in unit.params:
                    p.grad = None
        self._attach_piece_grads()

    def memory(self):
        """Bytes this rank keeps between steps (our accounting), and the peak of the transient buffers."""
        params = sum(u.nbytes() if self.stage < 3 else u.shard.numel() * u.shard.element_size() for u in self.units)
        grads = sum(0 if g is None else g.nbytes for g in (u.grad_full if self.stage == 1 else u.grad_shard
                                                            for u in self.units))
        peak, self.transient_peak = self.transient_peak, self.transient
        return {"params": params, "grads": grads, "optimizer": 0, "zero_transient_peak": peak}

    def full_parameters(self):
        """{name: a copy of the whole parameter} on every rank (gathers them in stage 3)."""
        with self.gathered() if self.stage == 3 else torch.no_grad():
            return {name: p.detach().clone() for name, p in self.module.named_parameters()}

    # -- checkpoints (picotron.checkpoint writes and fills the optimizer's pieces, each rank its own) ------
    def after_load(self):
        """The pieces were filled from a checkpoint: stages 1-2 rebuild every rank's full parameters."""
        if self.stage < 3:
            self.gather_updated_params()


class ZeroDataParallel(ShardedGradSync):
    """ZeRO stages 1 and 2: full parameters on every rank; gradients and optimizer state sharded.

    Parameters live in buckets of about `bucket_mb` MiB (filled in backward order, as in data_parallel.py);
    each parameter is a view of its bucket's flat buffer, and this rank's chunk of that buffer is what its
    optimizer updates. `ShardedOptimizer.step` then all-gathers every chunk (`gather_updated_params`).
    """

    def __init__(self, module, axis, stage, bucket_mb=25.0, axis_of=None, accumulate=False, replicate=None):
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel does stages 1 and 2, not {stage}; stage 3 is zero3.Zero3.")
        super().__init__(module, axis, stage, axis_of, accumulate, replicate)
        params = [p for p in module.parameters() if p.requires_grad]
        by_axis = {}  # one set of buckets per axis (experts: edp; the rest: dp x cp)
        for p in params:
            if p not in set(self.tied):  # (a set: `in` a list would compare tensors by value)
                by_axis.setdefault(self.axis_of(p), []).append(p)
        for group in by_axis.values():
            for bucket in buckets(group, bucket_mb):
                self._add_unit(bucket)
        for p in self.tied:  # alone in its unit: its shards line up with the other end's (sync_tied)
            self._add_unit([p])
        self._make_pieces()
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _add_unit(self, params):
        unit = FlatUnit(f"bucket {len(self.units)}", params, self.axis_of(params[0]))
        unit.full = unit.flat([p.detach() for p in params])
        unit.use_as_storage(unit.full)
        unit.shard = unit.full[unit.lo:unit.hi]  # the fp32 parameters this rank updates: a view, no copy
        if self.stage == 1:  # full gradients, each p.grad a view of the buffer (accumulation adds in place)
            unit.grad_full = torch.zeros_like(unit.full)
            for p, off in zip(params, unit.offsets):
                p.grad = unit.grad_full[off:off + p.numel()].view_as(p)
            unit.grad_shard = unit.grad_full[unit.lo:unit.hi]
        else:  # only the chunk's gradient is kept
            unit.grad_shard = None  # created by the first reduce-scatter of a step
        self.units.append(unit)
        for p in params:
            self.unit_of[p] = unit

    def _grad_ready(self, p):
        unit = self.unit_of[p]
        if not self.sync and (self.stage == 1 or self.accumulate):  # under no_sync: gradients add up, nothing counted
            if self.stage == 2 and not unit.holding:  # the unit's full gradients, held until its synced backward
                unit.holding = True
                self._track(unit.nbytes())
            return
        unit.ready += 1
        if unit.ready < len(unit.params):
            return
        unit.ready = 0  # the last gradient of this unit just arrived
        if self.stage == 2:
            self._send_gradients(unit)
        elif self.sync:
            unit.grad_full.div_(self.batch_shards)
            unit.work = unit.axis.reduce_scatter_into(unit.grad_full[unit.lo:unit.hi], unit.grad_full, async_op=True,
                                                      label=f"reduce-scatter {unit.name}")
            self._replicas_due = True

    def forward(self, *args, **kwargs):
        if any(u.work is not None for u in self.units):  # stage 1: never accumulate into a buffer in flight
            self.finish_sync()
        return self.module(*args, **kwargs)

    def gather_updated_params(self):
        """After the optimizer step: every rank sends its updated chunk to all (in place, one per bucket)."""
        works = [u.axis.all_gather_into(u.full, u.shard, async_op=True, label=f"all-gather {u.name}")
                 for u in self.units]
        for w in works:
            w.wait()


class WrappedOptimizer:
    """An optimizer around another, `self.optimizer`: torch.optim's interface (param_groups, state, state_dict,
    load_state_dict) passed through; a subclass says what its `step` adds (ShardedOptimizer here, and
    precision.MasterWeights)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)


class ShardedOptimizer(WrappedOptimizer):
    """ZeRO-1/2's optimizer: `optimizer` (over this rank's pieces) updates this rank's chunk of every bucket,
    then the chunks are all-gathered, so every rank holds all the updated parameters for the next forward."""

    def __init__(self, optimizer, zero):
        super().__init__(optimizer)
        self.zero = zero

    def step(self):
        self.optimizer.step()
        self.zero.gather_updated_params()

    def __getattr__(self, name):  # what a master-copy optimizer adds (model_params, masters, after_load, ...)
        return getattr(self.__dict__["optimizer"], name)


def wrap(model, axis, stage, bucket_mb=25.0, axis_of=None, accumulate=False, replicate=None):
    """ZeRO stage 1 or 2 over `axis` (the mesh's dp_cp axis, or with HSDP its dp_shard axis and `replicate` its
    dp_replicate axis; `axis_of(p)`: another axis for some parameters, the experts' edp; `accumulate`: stage 2 follows
    no_sync, as under a pipeline); stage 3 is picotron.zero3.Zero3."""
    if stage in (1, 2):
        return ZeroDataParallel(model, axis, stage, bucket_mb=bucket_mb, axis_of=axis_of, accumulate=accumulate,
                                replicate=replicate)
    raise ValueError(f"ZeRO stage {stage!r}: zero.wrap does stages 1 and 2; stage 3 is picotron.zero3.Zero3.")
