"""Precision recipes: which dtype each tensor of training lives in, and what keeps low precision safe.

    --dtype       parameters  gradients  the optimizer holds                 matmuls  bytes of model states
    fp32          fp32        fp32       fp32 moments                        fp32     4 + 4 + 8  = 16 Ψ
    bf16          fp32        fp32       fp32 moments                        bf16     4 + 4 + 8  = 16 Ψ   (autocast)
    bf16-params   bf16        bf16       fp32 master copy + fp32 moments     bf16     2 + 2 + 12 = 16 Ψ
    fp16          fp16        fp16       fp32 master copy + fp32 moments     fp16     2 + 2 + 12 = 16 Ψ   + loss scaling
    fp8           fp32        fp32       fp32 moments                        fp8      4 + 4 + 8  = 16 Ψ   (picotron.fp8;
                                                                                       --fp8-recipe blockwise: fp8_blockwise)

(Ψ parameters; the ZeRO paper's "2 + 2 + K" with K = 12 for Adam's master copy and two moments. ZeRO divides
the optimizer's share, then the gradients', then the parameters' by the data-parallel ranks; with bf16
parameters ZeRO-3 gathers bf16, half the bytes of fp32.) Activations are what autocast makes them: bf16/fp16
out of every matmul; norms, softmax and the loss computed in fp32 (picotron.model does that itself).

Why a master copy. bf16 keeps 8 significant bits: the neighbours of 1.0 are 1 - 2^-8 and 1 + 2^-7, so an
update of lr·1 = 3e-4 added to a bf16 weight of 1.0 is rounded away. The optimizer therefore keeps an fp32 copy of
every parameter, adds the update there, and rounds the result into the bf16 parameter the next forward uses
(Micikevicius et al. 2018, https://arxiv.org/abs/1710.03740; Rajbhandari et al. 2020 (ZeRO),
https://arxiv.org/abs/1910.02054, section 3.1).

Why loss scaling (fp16 only). fp16 has 5 exponent bits: its smallest normal number is 2^-14 ≈ 6.1e-5, its
smallest subnormal 2^-24 ≈ 6e-8; a gradient below that is zero. Gradients of a mean loss over thousands of
tokens are that small. Multiplying the loss by S (here through an identity whose backward multiplies by S, so
the logged loss stays the loss) shifts every gradient of the backward pass up by S, into fp16's range; the
optimizer divides by S in fp32. Too large an S overflows (inf): dynamic loss scaling starts high (2^16), halves S
and skips the step when any gradient is not finite, and doubles it after `growth_interval` steps without an
overflow (torch.amp.GradScaler and Megatron-LM do the same). bf16 has fp32's 8 exponent bits: no scaling needed.

The pieces, each small:
    RECIPES[name]            the table above, as data (param_dtype, autocast dtype, master copy, loss scaling)
    cast_parameters(model)   parameters (not buffers) to the recipe's dtype, keeping every parameter's placement
    MasterWeights            an optimizer over fp32 copies of the model's low-precision parameters
    LossScaler               S, its update rule and the count of skipped steps
    scaled(loss_fn, scaler)  the loss function whose backward multiplies by S
"""
from dataclasses import dataclass
from typing import Optional

import torch

from picotron import marks, planner
# check(cfg, model_config), the recipe's rule, lives in picotron.rules: no torch there, so a refusal is instant
from picotron.rules import precision_rule as check
from picotron.zero import WrappedOptimizer


@dataclass(frozen=True)
class Recipe:
    name: str
    param_dtype: torch.dtype            # parameters and their gradients
    autocast: Optional[torch.dtype]     # the matmuls' dtype under autocast (None: no autocast)
    master: bool                        # the optimizer keeps an fp32 copy of each parameter
    loss_scaling: bool                  # gradients can underflow (fp16)
    fp8: bool = False                   # the decoder layers' linears in FP8 (picotron.fp8)
    about: str = ""

    @property
    def compute_dtype(self):
        """The dtype of the matmuls' inputs (the peak MFU is measured against); fp8 is simulated on CPU."""
        return self.autocast or torch.float32


RECIPES = {r.name: r for r in (
    Recipe("fp32", torch.float32, None, False, False, about="fp32 everywhere"),
    Recipe("bf16", torch.float32, torch.bfloat16, False, False,
           about="bf16 autocast over fp32 parameters, gradients and moments"),
    Recipe("bf16-params", torch.bfloat16, torch.bfloat16, True, False,
           about="bf16 parameters and gradients, fp32 master weights and moments in the optimizer"),
    Recipe("fp16", torch.float16, torch.float16, True, True,
           about="fp16 parameters and gradients, fp32 master weights and moments, loss scaling"),
    Recipe("fp8", torch.float32, torch.bfloat16, False, False, fp8=True,
           about="FP8 matmuls in the decoder layers (e4m3 forward, e5m2 gradients, per-tensor scales), "
                 "bf16 autocast elsewhere, fp32 parameters"),
)}


def recipe(cfg):
    return RECIPES[cfg.dtype]


def model_state_bytes(num_params, name):
    """Bytes per rank of parameters, gradients and optimizer state without sharding: the table above, counted by
    planner.model_state_bytes (the formula's one home) for this recipe's parameter dtype."""
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[RECIPES[name].param_dtype]
    return planner.model_state_bytes(num_params, dtype)


def cast_parameters(model, dtype):
    """Every parameter of `model` to `dtype`, in place: the Parameter objects (and their placements) stay, only their
    data changes; buffers (the MoE routing bias, fp32) are left alone."""
    if dtype == torch.float32:
        return model
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(dtype)
    return model


# ------------------------------------------------------------------------------------------ loss scaling
class LossScaler:
    """The loss scale S and its update (dynamic: halve on overflow, double after `growth_interval` clean steps).

    `scale=None` with dynamic=False: no scaling (S = 1). The numbers are torch.amp.GradScaler's defaults."""

    def __init__(self, scale=2.0 ** 16, dynamic=True, growth_interval=2000, growth_factor=2.0, backoff_factor=0.5):
        self.scale = float(scale) if scale is not None else 1.0
        self.dynamic = dynamic
        self.growth_interval, self.growth_factor, self.backoff_factor = growth_interval, growth_factor, backoff_factor
        self.clean_steps = 0   # steps since the last overflow (or growth)
        self.skipped = 0       # overflowing steps skipped so far

    def update(self, overflow):
        """After a step: an overflow halves S (the step was skipped); growth_interval clean steps double it."""
        if not self.dynamic:
            return
        if overflow:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped += 1
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0

    def state_dict(self):
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, state):
        self.scale, self.clean_steps, self.skipped = state["scale"], state["clean_steps"], state["skipped"]


def loss_scaler(cfg):
    """The run's LossScaler: --loss-scale dynamic (fp16's default), none, or a number (a static scale)."""
    if not recipe(cfg).loss_scaling or cfg.loss_scale == "none":
        return LossScaler(None, dynamic=False)
    if cfg.loss_scale == "dynamic":
        return LossScaler()
    return LossScaler(float(cfg.loss_scale), dynamic=False)


class _ScaleGrad(torch.autograd.Function):
    """y = x in forward; in backward the gradient times `scale`: as if the loss had been multiplied by it."""

    @staticmethod
    def forward(ctx, x, scaler):
        ctx.scaler = scaler
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scaler.scale, None


def scaled(loss_fn, scaler):
    """loss_fn whose backward starts from S instead of 1 (its value unchanged); loss_fn itself when S = 1."""
    if not scaler.dynamic and scaler.scale == 1.0:
        return loss_fn

    def fn(logits, targets):
        return _ScaleGrad.apply(loss_fn(logits, targets), scaler)
    return fn


# -------------------------------------------------------------------------------------- master weights
class MasterWeights(WrappedOptimizer):
    """An optimizer over fp32 copies of low-precision parameters (torch.optim's interface: param_groups, state,
    step, state_dict, load_state_dict; all but step passed through to the wrapped one, zero.WrappedOptimizer).

        MasterWeights(groups, make, scaler)   groups: [{"params": [bf16 or fp16 tensors], ...}];
                                              make(groups) -> AdamW; scaler: the LossScaler (fp16) or None

    The wrapped optimizer sees the fp32 masters (each carries its parameter's placement, with `master_for`: the
    parameter; picotron.marks). step(), a few whole-list operations (torch._foreach_*: one call for all the tensors,
    fused into one kernel per chunk of tensors on a GPU) instead of a Python loop of small ones:
        master.grad = parameter.grad in fp32 / S      for every parameter with a gradient, one foreach copy (+ div)
        the inner step over all the masters           AdamW's foreach or fused path (fused=True on CUDA)
        parameter = master rounded to bf16/fp16       one foreach copy back; the fp32 gradients freed
    The fp32 gradients exist only during step(): the model states between steps stay 2 + 2 + 12 bytes per
    parameter (during the step, 4 more bytes per parameter for those gradients, freed before it returns)."""

    def __init__(self, groups, make, scaler=None):
        self.model_params, master_groups = [], []
        for group in groups:
            masters = []
            for p in group["params"]:
                m = marks.tag(p.detach().float().clone(), marks.placement(p).merged(master_for=p))
                masters.append(m)
                self.model_params.append(p)
            master_groups.append({**group, "params": masters})
        super().__init__(make(master_groups))
        self.masters = [m for g in self.optimizer.param_groups for m in g["params"]]
        self.scaler = scaler

    @torch.no_grad()
    def step(self):
        pairs = [(p, m) for p, m in zip(self.model_params, self.masters) if p.grad is not None]
        if not pairs:
            return
        params, masters = [p for p, _ in pairs], [m for _, m in pairs]
        grads = [torch.empty_like(m) for m in masters]
        torch._foreach_copy_(grads, [p.grad for p in params])  # bf16/fp16 -> fp32
        if self.scaler is not None and self.scaler.scale != 1.0:
            torch._foreach_div_(grads, self.scaler.scale)  # in fp32: no underflow
        for m, g in zip(masters, grads):
            m.grad = g
        self.optimizer.step()  # one step over all the masters (one whose parameter has no gradient is skipped)
        for m in masters:
            m.grad = None
        torch._foreach_copy_(params, masters)  # fp32 -> bf16/fp16, rounded to nearest even

    @torch.no_grad()
    def after_load(self):
        """The masters were filled from a checkpoint: round them into the model's parameters."""
        for p, m in zip(self.model_params, self.masters):
            p.copy_(m)
