"""ZeRO stage 3: each rank keeps 1/n of the parameters, gathers a layer only while it computes (Rajbhandari
et al. 2020, section 5.3; the same scheme as torch's FSDP). The stages' shared machinery, the flat units and
the table of what each stage keeps, are in `picotron.zero`; read that first.

    forward   AG root, AG L0 | L0 fwd, AG L1 | L1 fwd, AG L2 | ...      (free Li after its forward)
    backward  AG L3 | L3 bwd, AG L2 | L2 bwd, AG L1 | ...               (RS the grads of Li, free Li)

Phases (picotron.hooks): each layer's forward and backward ("forward layer 3", "backward layer 3"), from the
moment the layer is ready to compute to the end of its work, for whoever listens (a lesson draws them); the
collectives are counted and timed on the axis.

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

    Units: each module of `module.layers` (a transformer layer), plus a root unit with everything else. A
    unit's parameters are views of one flat buffer whose storage is freed (resized to 0 bytes) between uses
    and re-filled by an all-gather: tensors autograd saved for backward stay valid views of it.
    """

    def __init__(self, module, axis, prefetch=True):
        super().__init__(module, axis, 3)
        self.prefetch = prefetch
        self.phases = hooks.Phases()
        layers = list(module.layers)
        in_layers = {p for layer in layers for p in layer.parameters()}
        root = [p for p in module.parameters() if p not in in_layers]
        for name, params in [("root", root)] + [(f"layer {i}", list(l.parameters())) for i, l in enumerate(layers)]:
            unit = FlatUnit(name, params, self.axis)
            full = unit.flat([p.detach() for p in params])
            unit.shard = full[unit.lo:unit.hi].clone()  # this rank's fp32 parameters, kept for good
            unit.grad_shard = unit.grad_flat = unit.phase = None
            unit.full = full
            unit.use_as_storage(full)
            unit.state = "gathered"
            self._free(unit, count=False)
            self.units.append(unit)
            for p in params:
                self.unit_of[p] = unit
                p.register_post_accumulate_grad_hook(self._grad_ready)
        self._make_pieces()
        self.in_backward = False
        module.register_forward_pre_hook(self._root_pre_forward)
        module.register_forward_hook(self._root_post_forward)
        for k, layer in enumerate(layers, start=1):
            layer.register_forward_pre_hook(partial(self._pre_forward, k))
            layer.register_forward_hook(partial(self._post_forward, k))

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
        nxt = k - 1 if self.in_backward else k + 1
        if self.prefetch and 1 <= nxt < len(self.units):
            self._gather(self.units[nxt])
        self._open_phase(k)

    def _open_phase(self, k):
        """Layer k starts computing: open its phase ("forward layer i" or "backward layer i"; a recomputation
        inside the backward stays in the backward's phase). `_close_phase` ends it."""
        unit = self.units[k]
        if k > 0 and unit.phase is None:
            unit.phase = self.phases(("backward " if self.in_backward else "forward ") + unit.name)
            unit.phase.__enter__()

    def _close_phase(self, k):
        unit = self.units[k]
        if unit.phase is not None:
            unit.phase, phase = None, unit.phase
            phase.__exit__(None, None, None)

    # -- hooks -------------------------------------------------------------------------------------------
    def _root_pre_forward(self, module, args):
        self.in_backward = False
        self._use(0)

    def _root_post_forward(self, module, args, output):
        if torch.is_grad_enabled() and output.requires_grad:
            output.register_hook(self._root_pre_backward)
        else:
            self._free(self.units[0])  # no backward follows (evaluation, generation)

    def _root_pre_backward(self, grad):
        self.in_backward = True
        self._grad_buffer(self.units[0])
        if self.prefetch and len(self.units) > 1:
            self._gather(self.units[-1])

    def _grad_buffer(self, unit):
        """At the start of a unit's backward: one zeroed flat buffer, each p.grad a view of it, so autograd
        accumulates straight into what the reduce-scatter sends (no second copy of the gradients)."""
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
        if torch.is_grad_enabled() and output.requires_grad:
            output.register_hook(partial(self._pre_backward, k))  # fires when the gradient reaches layer k
        self._free(self.units[k])

    def _pre_backward(self, k, grad):
        self._use(k)
        self._grad_buffer(self.units[k])

    def _grad_ready(self, p):
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
