"""The one place that knows in which order the parallel strategies apply.

    run = parallelize(cfg, mesh)      # on every rank, with the same cfg

builds this rank's part of the model and everything a training step needs:

    1. the model on the meta device (shapes only: no memory, no init cost);
    2. tensor parallelism swaps linears, embedding and norms for sharded ones (mesh.tp; nothing at tp = 1);
       (context parallelism will swap the attention core, expert parallelism the MLP, and pipeline
       parallelism keep this stage's layers here, in that order: see the slots below);
    3. materialise on the device and initialise: every value depends on the seed and the parameter's name
       only, so every layout starts from the same weights, each rank holding its slices;
    4. activation recomputation;
    5. wrap for gradient synchronisation over mesh.dp_cp: data parallelism, ZeRO-1/2, ZeRO-3, or `Local`
       when there is one replica;
    6. the optimizer (ZeRO-1/2: a sharded one whose step all-gathers the updated chunks), the step schedule,
       the loss (vocab-parallel under tp), what a checkpoint saves, and the model that generates text.

`train.py` uses only what this returns, so adding a strategy means adding it here (and its own module), not
another `if` in the training loop. Each strategy's rules live in its module's `check(cfg, model_config)`.
"""
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch

from picotron import data_parallel, schedule, tensor_parallel, zero, zero3
from picotron.model import Llama, loss_fn


@dataclass
class Parallelized:
    """Everything one rank needs to train: the result of `parallelize`."""
    model: torch.nn.Module     # wrapped for gradient sync (the GradSync protocol); forward(inputs, positions)
    raw: torch.nn.Module       # the Llama inside (this rank's shards), for inspection and evaluation
    optimizer: object          # .step(), .param_groups, .state, .state_dict(), .load_state_dict()
    schedule: object           # .run(model, micro_batches, loss_fn) -> the global-batch loss; .evaluate(...)
    loss_fn: object            # loss_fn(logits, targets) -> mean loss of this rank's tokens
    checkpoint: object         # what a checkpoint saves and loads (.state_dict / .load_state_dict)
    sampler: torch.nn.Module   # ids -> logits over the whole vocabulary, for generating text
    description: str           # the strategies in use, for the start-up line

    @property
    def params(self):
        """The parameters the optimizer updates on this rank (ZeRO: its pieces), with their marks."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]


def build_model(cfg, mesh):
    """Steps 1-4: this rank's shards of the model, initialised, on mesh.device (not yet wrapped)."""
    with torch.device("meta"):
        model = Llama(cfg.model_config())
    tensor_parallel.apply(model, mesh.tp, sp=cfg.sp)  # a no-op when tp = 1
    # slots, in this order: context_parallel.apply (attention core), expert_parallel.apply (MLP),
    # pipeline_parallel.keep_stage (this stage's layers; names and hence init unchanged)
    model.to_empty(device=mesh.device)
    model.init_weights(cfg.seed)
    model.recompute = cfg.recompute
    return model


def build_optimizer(groups, cfg, device):
    """AdamW over (decay, no_decay) parameter lists: weight decay on matrices only (not on norm gains)."""
    decay, no_decay = groups
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")


def wrap_for_sync(raw, cfg, axis):
    """Step 5: the gradient-sync wrapper over `axis` (dp x cp)."""
    if cfg.zero == 3:
        return zero3.Zero3(raw, axis)
    if cfg.zero:
        return zero.wrap(raw, axis, cfg.zero, bucket_mb=cfg.bucket_mb)
    return data_parallel.wrap(raw, axis, impl=cfg.dp_impl, bucket_mb=cfg.bucket_mb)


def autocast_for(cfg, device):
    """The mixed-precision context of a forward: bf16 autocast, or nothing (fp32)."""
    if cfg.dtype == "bf16":
        return partial(torch.autocast, device.type, dtype=torch.bfloat16)
    return nullcontext


def parallelize(cfg, mesh, recorder=None):
    """This rank's model, optimizer, schedule, loss, checkpoint state and sampler for `cfg` on `mesh`.

    `recorder`: a metrics.Recorder that counts (and times) every collective of the model and its gradient sync
    (lessons; the schedule's 4-byte average of the loss for the log is left out)."""
    loss_axis = mesh.dp_cp
    if recorder is not None:
        mesh = mesh.recorded(recorder)
    raw = build_model(cfg, mesh)
    model = wrap_for_sync(raw, cfg, mesh.dp_cp)
    optimizer = build_optimizer(model.optimizer_groups(), cfg, mesh.device)
    if cfg.zero in (1, 2):  # the step updates this rank's chunk, then all-gathers every chunk
        optimizer = zero.ShardedOptimizer(optimizer, model)
    tp = mesh.tp.size > 1
    return Parallelized(
        model=model, raw=raw, optimizer=optimizer,
        schedule=schedule.OneStage(loss_axis, mesh.device, autocast_for(cfg, mesh.device)),
        loss_fn=partial(tensor_parallel.loss_fn, axis=mesh.tp) if tp else loss_fn,  # tp: vocab-parallel
        checkpoint=model if cfg.zero else raw,  # ZeRO: each rank saves its shards; else the (tp-sharded) model
        sampler=tensor_parallel.FullVocabLogits(raw, mesh.tp, sp=cfg.sp) if tp else raw,
        description=describe(cfg, mesh))


def describe(cfg, mesh):
    """What the start-up line says of the parallel strategies in use, e.g. 'ZeRO-3 over dp*cp=2 | tp=2 + sp'."""
    parts = []
    if cfg.zero:
        parts.append(f"ZeRO-{cfg.zero} over dp*cp={mesh.dp_cp.size}")
    elif mesh.dp_cp.size > 1:
        parts.append(f"data parallel ({cfg.dp_impl}" + (f", {cfg.bucket_mb:g} MiB buckets)" if cfg.dp_impl == "bucket"
                                                          else ")"))
    if mesh.tp.size > 1:
        parts.append(f"tensor parallel tp={mesh.tp.size}" + (" + sequence parallel" if cfg.sp else ""))
    if cfg.collectives == "ours":
        parts.append("collectives from send/recv (lesson 02)")
    return " | ".join(parts) or "one process"


STRATEGIES = (data_parallel, zero, tensor_parallel)  # each exports check(cfg, model_config); config calls them
