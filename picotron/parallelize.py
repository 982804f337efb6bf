"""The one place that knows in which order the parallel strategies apply.

    run = parallelize(cfg, mesh)      # on every rank, with the same cfg

builds this rank's part of the model and everything a training step needs:

    1. the model on the meta device (shapes only: no memory, no init cost);
    2. tensor parallelism swaps linears, embedding and norms for sharded ones (mesh.tp; nothing at tp = 1);
       context parallelism swaps every attention core for ring (or all-gather) attention (mesh.cp);
       expert parallelism keeps this rank's experts in every MoE layer and gives it the all-to-all (mesh.ep);
       pipeline parallelism keeps this rank's stages (chunks) of the layers, names unchanged;
    3. materialise on the device and initialise: every value depends on the seed and the parameter's name
       only, so every layout starts from the same weights, each rank holding its slices (in fp32, then
       rounded to the precision recipe's parameter dtype: picotron.precision); just before, --kernels and
       --dtype fp8 route the norms, SwiGLUs and linears through picotron.kernels and picotron.fp8;
    4. activation recomputation;
    5. wrap for gradient synchronisation over mesh.dp_cp: data parallelism, ZeRO-1/2, ZeRO-3, or `Local`
       when there is one replica (HSDP, --dp-shard: ZeRO over mesh.dp_shard, replicated over mesh.dp_replicate);
    6. the optimizer (ZeRO-1/2: a sharded one whose step all-gathers the updated chunks), the step schedule
       (gradient accumulation, or with pp > 1 the pipeline schedule run by `pipeline_parallel.Pipeline`),
       the loss (vocab-parallel under tp) and the model that generates text. (Checkpoints read the
       optimizer's tensors and their placements: picotron.checkpoint.)

`train.py` uses only what this returns (and `token_positions`, the tokens its loader keeps), so adding a
strategy means adding it here (and its own module), not another `if` in the training loop.

The rules, checked by `validate(cfg)` before any process group exists (`cli(argv)`: parse, validate, and on a
broken rule print one sentence and exit with status 2): picotron.config's rules of the settings themselves,
then each strategy's own (its module's `check(cfg, model_config)`: its values alone), then which strategies
combine (`combination_problem`, one table), then the data, the checkpoint to resume and the devices. They live
in picotron.rules, which imports no torch: the trainer refuses a bad command before torch loads.
"""
import json
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch

from picotron import (config, context_parallel, data_parallel, expert_parallel, fp8, marks, pipeline_parallel,
                      pipeline_schedules, precision, schedule, tensor_parallel, zero, zero3, zero_bubble)
from picotron import muon
from picotron.config import ConfigError
from picotron.model import DecoderLayer, Llama, loss_fn, use_kernels
from picotron.moe import MoE
from picotron.rules import combination_problem, validate  # noqa: F401 (the rules, without torch: picotron.rules)


@dataclass
class Parallelized:
    """Everything one rank needs to train: the result of `parallelize`."""
    model: torch.nn.Module     # wrapped for gradient sync (the GradSync protocol); forward(inputs, positions)
    raw: torch.nn.Module       # the Llama inside (this rank's shards), for inspection and evaluation
    optimizer: object          # .step(), .param_groups, .state, .state_dict(), .load_state_dict()
    schedule: object           # .run(model, micro_batches, loss_fn) -> the global-batch loss; .evaluate(...)
    loss_fn: object            # loss_fn(logits, targets) -> mean loss of this rank's tokens
    sampler: torch.nn.Module   # ids -> logits over the whole vocabulary, for generating text
    description: str           # the strategies in use, for the start-up line
    scaler: precision.LossScaler = None  # fp16's loss scale (S = 1, never updated, for every other recipe)
    masters_of: list = None    # under a master copy (bf16-params, fp16): the low-precision tensors the masters stand for

    @property
    def params(self):
        """The parameters the optimizer updates on this rank (ZeRO: its pieces), with their placements."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    @property
    def grad_params(self):
        """The tensors the backward leaves gradients in, with their placements: `params`, or under a master copy
        (bf16-params, fp16) the low-precision ones the fp32 masters are copies of."""
        return self.params if self.masters_of is None else self.masters_of


def pipeline_schedule(cfg, pp_size=None):
    """The pipeline schedule of this run (micro-batches = grad_acc), or None with one stage."""
    pp_size = cfg.pp if pp_size is None else pp_size
    if pp_size == 1:
        return None
    return pipeline_schedules.build(cfg.pp_schedule, pp_size, cfg.grad_acc,
                                    pipeline_schedules.chunks_of(cfg.pp_schedule, cfg.pp_chunks))


def build_model(cfg, mesh, store=None):
    """Steps 1-4: this rank's shards of the model, initialised, on mesh.device (not yet wrapped): a Llama,
    or with pp > 1 a PipelineStage holding this rank's chunks. `store`: a split schedule's WeightGradStore."""
    mc = cfg.model_config()

    def whole():
        with torch.device("meta"):
            model = Llama(mc)
        tensor_parallel.apply(model, mesh.tp, sp=cfg.sp, overlap=cfg.async_tp)  # a no-op when tp = 1
        context_parallel.apply(model, mesh.cp, impl=cfg.cp_impl, layout=cfg.cp_layout)  # a no-op when cp = 1
        expert_parallel.apply(model, mesh.ep, mesh.cp, overlap=cfg.ep_overlap)  # a no-op when ep = cp = 1
        return model

    plan = pipeline_schedule(cfg, mesh.pp.size)
    if plan is None:
        model = whole()
    else:  # this stage's layers (names, hence init, unchanged)
        model = pipeline_parallel.keep_stage(whole, plan, mesh.pp.rank, mc, cfg.seq_len)
    if cfg.kernels != "plain":  # fused RMSNorm and SwiGLU (picotron.kernels)
        use_kernels(model, cfg.kernels)
    if precision.recipe(cfg).fp8:  # the decoder layers' linears through FP8 matmuls (picotron.fp8)
        fp8.apply(model, cfg.fp8_recipe)
    marks.materialize(model, mesh.device)  # to_empty; the placements are kept by name on the modules
    if plan is not None:
        pipeline_parallel.mark_stage(model, plan, mesh.pp)
    model.init_weights(cfg.seed)  # in fp32, then rounded to the recipe's parameter dtype
    precision.cast_parameters(model, precision.recipe(cfg).param_dtype)
    if store is not None:
        zero_bubble.defer_weight_grads(model, store)
    model.recompute = cfg.recompute
    if cfg.compile:  # each decoder layer compiled on its own: the strategies' hooks stay around it, in eager
        for layer in model.modules():
            if isinstance(layer, DecoderLayer):
                layer.compile()
    for module in model.modules():  # MoE: the aux loss's weight per micro-batch, per tp rank (see tensor_parallel),
        if isinstance(module, MoE):  # and times cp (each cp rank's share of it: see expert_parallel)
            module.aux_weight = mc.router_aux_loss_coef / cfg.grad_acc / mesh.tp.size * mesh.cp.size
    return marks.check(model)  # every parameter carries its placement record: clipping, ZeRO, checkpoints read it


def build_optimizer(groups, cfg, device, scaler=None, exchange=None):
    """AdamW over (decay, no_decay) parameter lists: weight decay on matrices only (not on norm gains); under
    bf16-params and fp16, over fp32 master copies of the parameters (precision.MasterWeights).
    --optimizer muon: picotron.muon.Muon instead (AdamW for what is not a hidden matrix), `exchange` its
    muon.Exchange (where each matrix's pieces are, from the placements)."""
    decay, no_decay = groups
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    adamw = partial(torch.optim.AdamW, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")
    if cfg.optimizer == "muon":
        adamw = muon.maker(exchange, cfg)
    return precision.MasterWeights(groups, adamw, scaler) if precision.recipe(cfg).master else adamw(groups)


def wrap_for_sync(raw, cfg, axis, axis_of=None, replicate=None):
    """Step 5: the gradient-sync wrapper over `axis` (dp x cp; with HSDP the mesh's dp_shard axis, and `replicate`
    its dp_replicate axis, over which ZeRO's gradient shards are all-reduced: picotron.zero, "HSDP"); `axis_of(p)`,
    from the placements: where each gradient is summed (experts: their replicas, the mesh's edp axis). With pp > 1,
    ZeRO-2/3 follow the pipeline's no_sync: each chunk's gradients are reduce-scattered once, at its last backward
    (ZeRO-3 keeps a chunk's layers gathered over the step: picotron.zero3)."""
    piped = cfg.pp > 1
    if cfg.zero == 3:
        return zero3.Zero3(raw, axis, accumulate=piped, reshard_after_forward=not piped, replicate=replicate)
    if cfg.zero:
        return zero.wrap(raw, axis, cfg.zero, bucket_mb=cfg.bucket_mb, axis_of=axis_of, accumulate=piped,
                         replicate=replicate)
    return data_parallel.wrap(raw, axis, impl=cfg.dp_impl, bucket_mb=cfg.bucket_mb, axis_of=axis_of)


def autocast_for(cfg, device):
    """The mixed-precision context of a forward: autocast to the recipe's matmul dtype, or nothing (fp32)."""
    dtype = precision.recipe(cfg).autocast
    if dtype is not None:
        return partial(torch.autocast, device.type, dtype=dtype)
    return nullcontext


def parallelize(cfg, mesh, recorder=None):
    """This rank's model, optimizer, schedule, loss and sampler for `cfg` on `mesh`.

    `recorder`: a metrics.Recorder that counts (and times) every collective of the model and its gradient sync
    (lessons; the schedule's 4-byte average of the loss for the log is left out)."""
    loss_axis = mesh.dp_cp
    if cfg.zero and cfg.dp_shard and cfg.dp_shard * mesh.cp.size != mesh.dp_shard.size:
        raise ValueError(f"dp_shard={cfg.dp_shard} but the mesh's shard groups have {mesh.dp_shard.size} ranks; build "
                         f"the mesh with Mesh.init(..., dp_shard=cfg.dp_shard).")
    if recorder is not None:
        mesh = mesh.recorded(recorder)
    plan = pipeline_schedule(cfg, mesh.pp.size)
    store = zero_bubble.WeightGradStore() if plan is not None and plan.split else None
    raw = build_model(cfg, mesh, store)
    hsdp = cfg.zero and mesh.dp_replicate.size > 1  # ZeRO within the shard groups, replicated across them
    model = wrap_for_sync(raw, cfg, mesh.dp_shard if hsdp else mesh.dp_cp,
                          partial(marks.sync_axis, mesh=mesh) if mesh.ep.size > 1 else None,
                          replicate=mesh.dp_replicate if hsdp else None)
    scaler = precision.loss_scaler(cfg)
    exchange = muon.Exchange(raw, model, mesh.tp, cfg.muon_impl) if cfg.optimizer == "muon" else None
    optimizer = build_optimizer(model.optimizer_groups(), cfg, mesh.device, scaler, exchange)
    masters_of = optimizer.model_params if precision.recipe(cfg).master else None  # precision.MasterWeights
    if cfg.zero in (1, 2):  # the step updates this rank's chunk, then all-gathers every chunk
        optimizer = zero.ShardedOptimizer(optimizer, model)
    tp = mesh.tp.size > 1
    autocast = autocast_for(cfg, mesh.device)
    if plan is None:
        steps = schedule.OneStage(loss_axis, mesh.device, autocast, tokens=mesh.cp)
        sampler = tensor_parallel.FullVocabLogits(raw, mesh.tp, sp=cfg.sp) if tp else raw
    else:  # the step engine runs the pipeline schedule; text and evaluation go through the stages too
        steps = pipeline_parallel.Pipeline(plan, mesh, raw.config.hidden_size, seq_div=mesh.tp.size if cfg.sp else 1,
                                           ends=mesh.pp_ends, autocast=autocast, store=store,
                                           dtype=precision.recipe(cfg).param_dtype)
        sampler = pipeline_parallel.PipelineSampler(
            raw, steps, head=partial(tensor_parallel.gather_vocab, axis=mesh.tp) if tp else None)
    if mesh.cp.size > 1:  # text: every rank runs the prompt whole (attention not split)
        sampler = context_parallel.WholeSequence(sampler, raw)
    loss = partial(tensor_parallel.loss_fn, axis=mesh.tp) if tp else loss_fn  # tp: vocab-parallel
    return Parallelized(
        model=model, raw=raw, optimizer=optimizer, schedule=steps, loss_fn=precision.scaled(loss, scaler),
        sampler=sampler, description=describe(cfg, mesh), scaler=scaler, masters_of=masters_of)


def describe(cfg, mesh):
    """What the start-up line says of the parallel strategies in use, e.g. 'ZeRO-3 over dp*cp=2 | tp=2 + sp'."""
    parts = []
    if cfg.zero and mesh.dp_replicate.size > 1:
        parts.append(f"HSDP: ZeRO-{cfg.zero} over dp_shard*cp={mesh.dp_shard.size}, "
                     f"{mesh.dp_replicate.size} replicas (dp_replicate)")
    elif cfg.zero:
        parts.append(f"ZeRO-{cfg.zero} over dp*cp={mesh.dp_cp.size}")
    elif mesh.dp_cp.size > 1:
        over = f" over dp*cp={mesh.dp_cp.size}" if mesh.cp.size > 1 else ""
        parts.append(f"data parallel{over} ({cfg.dp_impl}" + (f", {cfg.bucket_mb:g} MiB buckets)" if cfg.dp_impl == "bucket"
                                                          else ")"))
    if mesh.tp.size > 1:
        parts.append(f"tensor parallel tp={mesh.tp.size}" + (" + sequence parallel" if cfg.sp else ""))
    if mesh.pp.size > 1:
        v = pipeline_schedules.chunks_of(cfg.pp_schedule, cfg.pp_chunks)
        parts.append(f"pipeline pp={mesh.pp.size} ({cfg.pp_schedule}, {cfg.grad_acc} micro-batches"
                     + (f", {v} chunks per rank)" if v > 1 else ")"))
    if mesh.cp.size > 1:
        parts.append(f"context parallel cp={mesh.cp.size} ({cfg.cp_impl}, {cfg.cp_layout})")
    if mesh.ep.size > 1:
        E, copies = cfg.model_config().num_local_experts, mesh.edp.size
        parts.append(f"expert parallel ep={mesh.ep.size} ({E // mesh.ep.size} of {E} experts per rank, "
                     f"{copies} cop{'y' if copies == 1 else 'ies'} of each)")
    if cfg.collectives == "ours":
        parts.append("collectives from send/recv (lesson 02)")
    return " | ".join(parts) or "one process"


# ------------------------------------------------------------------------------------------------ the rules
# each strategy's own rule is its module's check(cfg, model_config) -> one sentence or None; the rules' code
# (rules.RULES), combination_problem and validate are in picotron.rules, which imports no torch (a refusal is instant)


def cli(argv=None, world_size=None, any_world_size=False, says=True):
    """config.parse_args + validate; a bad setting prints 'picotron: error: <one sentence>' and exits with status 2.
    says=False: another process says it (under torchrun every rank finds the same error: rank 0 alone says it)."""
    try:
        cfg = config.parse_args(argv)
        validate(cfg, world_size, any_world_size)
        return cfg
    except ConfigError as e:
        if says:
            print(f"picotron: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def token_positions(cfg, mesh):
    """The positions of every sequence this rank's loader keeps: under context parallelism its share of the
    tokens, in context_parallel's layout; else None (all of them)."""
    if mesh.cp.size == 1:
        return None
    return context_parallel.positions(cfg.seq_len, mesh.cp.size, mesh.cp.rank, cfg.cp_layout)


if __name__ == "__main__":  # python -m picotron.parallelize --tp 2 ...: print the resolved, validated settings
    print(json.dumps(cli(sys.argv[1:]).to_dict(), indent=2))
