"""ZeRO stage 3: each rank keeps 1/n of the parameters, gathers a layer only while it computes (Rajbhandari
et al. 2020, section 5.3; the same scheme as torch's FSDP). The stages' shared machinery, the flat units and
the table of what each stage keeps, are in `picotron.zero`; read that first.

    forward   AG root, AG L0 | L0 fwd, AG L1 | L1 fwd, AG L2 | ...      (free Li after its forward)
    backward  AG L3 | L3 bwd, AG L2 | L2 bwd, AG L1 | ...               (RS the grads of Li, free Li)

Phases (picotron.hooks): each layer's forward and backward ("forward layer 3", "backward layer 3"), from the
moment the layer is ready to compute to the end of its work, for whoever listens (a lesson draws them); the
collectives are counted and timed on the axis.

With a pipeline (picotron.pipeline_parallel; `accumulate=True`), each chunk of the stage has its own root (the
embedding on the first stage, norm and head on the last, none between) and layers. The executor runs every
backward of a chunk but its last under `no_sync()`: the gradients add up in each unit's flat buffer and are
reduce-scattered once, at the chunk's last backward (or W). The layers are then either kept gathered from their
first use in the step to that last backward (`reshard_after_forward=False`, what parallelize picks: all-gather Ψ_stage
per step, the stage's whole parameters held during the step beside its whole gradients), or freed after every
forward and backward and gathered again (all-gather Ψ_root + 2m·Ψ_layers per step, a few layers held). Measured
in lesson 04, section 7 (dp 2 x pp 2, 1F1B, m = 8, 4 layers per stage): resharding all-gathers 15.7 times the bytes
for a quarter less held whole at the peak (18.5 instead of 24.5 MiB per rank); keeping is also torchtitan's default
with pp and Llama 3's choice. A W (split schedules) needs no weights: dW = gᵀx.

Caveat: every forward all-gathers collectively, so every rank must run the same forwards, evaluation and
text generation included; a forward on rank 0 alone waits for the others until the timeout ends it.
"""
from contextlib import contextmanager
from functools import partial

import torch

from picotron import hooks
from picotron.zero import FlatUnit, ShardedGradSync


class Zero3(ShardedGradSync):
    """ZeRO stage 3: each rank keeps 1/n of the parameters; a unit is gathered only while it computes.

    Units: each module of a chunk's `layers` (a transformer layer), plus a root unit with everything else, for each
    chunk the model holds (`module.stages()`, model.Stages: a whole model is one chunk; a pipeline stage one or two) (a chunk with neither embedding nor head has no
    root). A unit's parameters are views of one flat buffer whose storage is freed (resized to 0 bytes) between
    uses and re-filled by an all-gather: tensors autograd saved for backward stay valid views of it.

    `accumulate` (pipeline): follow `no_sync()`, gradients summed locally over the micro-batches and reduce-scattered
    once, at the chunk's last backward. `reshard_after_forward` (pipeline): free a layer after each forward and
    backward and gather it again for the next (True), or keep every unit gathered from its first use in the step
    to the chunk's last backward (False, the default with a pipeline: see the module docstring). `replicate` (HSDP):
    `axis` is one shard group, the parameters are gathered within it only, and the gradient shards are all-reduced
    over `replicate` once a step (picotron.zero, "HSDP").
    """

    def __init__(self, module, axis, prefetch=True, accumulate=False, reshard_after_forward=True, replicate=None):
        super().__init__(module, axis, 3, accumulate=accumulate, replicate=replicate)
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        self.phases = hooks.Phases()
        self.next_of = {}  # (unit index, in backward) -> the unit computing next in this chunk, to prefetch
        chunks = self.stages.chunks  # (model.Stages: a whole model is one chunk)
        for chunk, stage in zip(chunks, self.stages.ids):
            layers = list(chunk.layers)
            in_layers = {p for layer in layers for p in layer.parameters()}
            root = [p for p in chunk.parameters() if p not in in_layers]
            tied = [p for p in root if p in set(self.tied)]  # a tied embedding's copy: a unit of its own (sync_tied)
            name = "root" if len(chunks) == 1 else f"root of stage {stage}"
            roots = [self._add_unit(f"{name} (tied)", [p], layer=False) for p in tied]
            rest = [p for p in root if p not in set(tied)]
            roots += [self._add_unit(name, rest, layer=False)] if rest else []
            ks = [self._add_unit(f"layer {i}", list(l.parameters()), layer=True)
                  for i, l in zip(chunk.layers.indices(), layers)]
            for i, k in enumerate(ks):
                self.next_of[(k, False)] = ks[i + 1] if i + 1 < len(ks) else None
                self.next_of[(k, True)] = ks[i - 1] if i > 0 else None
            for k in roots:
                self.next_of[(k, False)] = ks[0] if ks else None
            chunk.register_forward_pre_hook(partial(self._root_pre_forward, roots, ks))
            chunk.register_forward_hook(partial(self._root_post_forward, roots, ks))
            for k, layer in zip(ks, layers):
                layer.register_forward_pre_hook(partial(self._pre_forward, k))
                layer.register_forward_hook(partial(self._post_forward, k))
        self._make_pieces()
        self.in_backward = False

    def _add_unit(self, name, params, layer):
        unit = FlatUnit(name, params, self.axis, layer=layer)
        unit.full = unit.flat([p.detach() for p in params])
        unit.shard = unit.full[unit.lo:unit.hi].clone()  # this rank's fp32 parameters, kept for good
        unit.use_as_storage(unit.full)
        self._free(unit, count=False)
        self.units.append(unit)
        for p in params:
            self.unit_of[p] = unit
            p.register_post_accumulate_grad_hook(self._grad_ready)
        return len(self.units) - 1

    # -- gather and free ---------------------------------------------------------------------------------
    def _gather(self, unit):
        """Start the all-gather of a unit's parameters (no-op if it is gathered or on its way)."""
        if unit.state == "free":
            unit.full.untyped_storage().resize_(unit.nbytes())
            unit.work = self.axis.all_gather_into(unit.full, unit.shard, async_op=True, label=f"all-gather {unit.name}")
            unit.state = "gathering"
            self._track(unit.nbytes())

    def _wait(self, unit):
        if unit.state == "gathering":
            unit.work.wait()
            unit.work, unit.state = None, "gathered"

    def _free(self, unit, count=True):
        if unit.state != "free":
            self._wait(unit)  # never free a buffer a collective is still writing
            unit.full.untyped_storage().resize_(0)
            unit.state = "free"
            if count:
                self._track(-unit.nbytes())

    def _use(self, k):
        """Make unit k ready to compute; start fetching the unit that computes after it."""
        self._gather(self.units[k])
        self._wait(self.units[k])
        nxt = self.next_of.get((k, self.in_backward))
        if self.prefetch and nxt is not None:
            self._gather(self.units[nxt])
        self._open_phase(k)

    def _open_phase(self, k):
        """Layer k starts computing: open its phase ("forward layer i" or "backward layer i"; a recomputation
        inside the backward stays in the backward's phase). `_close_phase` ends it."""
        unit = self.units[k]
        if unit.layer and unit.phase is None:
            unit.phase = self.phases(("backward " if self.in_backward else "forward ") + unit.name)
            unit.phase.__enter__()

    def _close_phase(self, k):
        unit = self.units[k]
        if unit.phase is not None:
            unit.phase, phase = None, unit.phase
            phase.__exit__(None, None, None)

    # -- hooks (`roots`: the chunk's root units, none to two; `ks`: its layers' units) -----------------------
    def _root_pre_forward(self, roots, ks, module, args):
        self.in_backward = False
        for k in roots:
            self._use(k)
        if not roots and self.prefetch and ks:
            self._gather(self.units[ks[0]])

    def _root_post_forward(self, roots, ks, module, args, output):
        if torch.is_grad_enabled() and output.requires_grad:
            output.register_hook(partial(self._root_pre_backward, roots, ks))
        else:
            for k in roots:
                self._free(self.units[k])  # no backward follows (evaluation, generation)

    def _root_pre_backward(self, roots, ks, grad):
        self.in_backward = True
        for k in roots:
            self._grad_buffer(self.units[k])
        if self.prefetch and ks:
            self._gather(self.units[ks[-1]])

    def _grad_buffer(self, unit):
        """At the start of a unit's backward: one zeroed flat buffer, each p.grad a view of it, so autograd
        accumulates straight into what the reduce-scatter sends (no second copy of the gradients). Under
        `accumulate` it stays from the unit's first backward of the step to its reduce-scatter."""
        if unit.grad_flat is None:
            self._drain(keep=0)  # the previous unit's reduce-scatter (overlapped with this unit's all-gather) is done
            unit.grad_flat = torch.zeros_like(unit.full)
            self._track(unit.nbytes())
            for p, off in zip(unit.params, unit.offsets):
                p.grad = unit.grad_flat[off:off + p.numel()].view_as(p)

    def _pre_forward(self, k, module, args):
        self._use(k)

    def _post_forward(self, k, module, args, output):
        if self.in_backward:
            return  # a recomputation (activation checkpointing) inside backward: its backward follows now
        self._close_phase(k)
        backward = torch.is_grad_enabled() and output.requires_grad
        if backward:
            output.register_hook(partial(self._pre_backward, k))  # fires when the gradient reaches layer k
            if self.accumulate and args[0].requires_grad:  # fires when layer k's input has its gradient: B is over
                args[0].register_hook(partial(self._post_backward, k))
        if self.reshard_after_forward or not backward:
            self._free(self.units[k])

    def _pre_backward(self, k, grad):
        done = self.next_of[(k, False)]  # the layer after k: the gradient reaching k's output ends its backward
        if self.accumulate and done is not None:
            self._post_backward(done, grad)  # now, before k - 1 is prefetched (its own hook comes after this one)
        self._use(k)
        self._grad_buffer(self.units[k])

    def _post_backward(self, k, grad):
        """(accumulate) Layer k's backward of one micro-batch is over: its weights are no longer read (a split
        schedule's W needs only the stashed inputs and output gradients), so they may go."""
        self._close_phase(k)
        if self.reshard_after_forward:
            self._free(self.units[k])  # (a no-op the second time)

    def _grad_ready(self, p):
        if self.accumulate and not self.sync:
            return  # under no_sync the gradients only add up in the unit's flat buffer
        unit = self.unit_of[p]
        unit.ready += 1
        if unit.ready < len(unit.params):
            return
        unit.ready = 0  # every parameter of the unit has its gradient: its backward is over
        self._close_phase(self.units.index(unit))
        self._track(-unit.nbytes())  # _send_gradients counts the buffer again while it is in flight
        self._send_gradients(unit)
        self._free(unit)

    @contextmanager
    def gathered(self):
        """Every unit gathered for the duration of the block (inspection, saving in HF format)."""
        for u in self.units:
            self._gather(u)
        for u in self.units:
            self._wait(u)
        try:
            with torch.no_grad():
                yield self.module
        finally:
            for u in self.units:
                self._free(u)
