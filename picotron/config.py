"""One dataclass holds every setting of a run, each with its `--help` text; the command line is built from it.

Where a setting comes from, lowest priority first:

    Config() defaults  <  the launcher's defaults (./run.sh: --steps 600 ...)  <  with --resume, the run's own
    settings (its checkpoint's config.json, picotron.runs)  <  --config run.json  <  command-line flags

`parse_args(argv)` reads them; `check(cfg)` applies the rules of the settings themselves (known names, ranges,
the model's shape, faults, nodes) and raises ConfigError with ONE sentence: the value, the rule and a fix.
The rules of which strategies combine, and each strategy's own (its module's `check`), are picotron.rules':
`picotron.rules.validate` runs this module's check, then theirs, then reads the data and the checkpoint and looks
at the devices, all before `torch.distributed` is initialised and, as here, without torch; `picotron.parallelize.cli`
prints the one sentence and exits with status 2:

    $ python -m picotron.train --tp 3
    picotron: error: tp=3 does not divide num_attention_heads=8; pick tp in {1, 2, 4}.

Settings come from the command line and two environment variables a launcher sets (PICOTRON_LAUNCHER,
PICOTRON_LAUNCHER_DEFAULTS: `launcher`, `launcher_defaults`); this module and picotron.launch (the launcher's
RANK, WORLD_SIZE, ...: `launch.place`) are where the environment is read, and picotron.launch's docstring lists
every variable picotron reads.

This module imports nothing of picotron but leaves (picotron.model_config, picotron.faults) and no torch, so
`--help` is instant, a bad setting is refused before torch loads (`picotron.runs.read_command`), and every
module may import the option tuples below from here.

The parallel degrees and the process grid
-----------------------------------------
    dp  data parallel      replicas of the model, each on different samples
    pp  pipeline parallel  the layers cut into pp consecutive stages
    cp  context parallel   the sequence cut into 2*cp chunks (zig-zag: rank r gets chunks r and 2cp-1-r)
    tp  tensor parallel    every weight matrix cut into tp slices (heads, MLP columns, vocabulary)
    ep  expert parallel    experts spread over the data-parallel ranks (ep divides dp)

The world size must equal dp*pp*cp*tp; `picotron.mesh` lays the ranks out on that grid with tp varying
fastest, so tensor-parallel peers (the chattiest) get neighbouring ranks, on one node.
"""
import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
import typing
from dataclasses import dataclass, field
from typing import Optional

from picotron import faults
from picotron.model_config import PRESETS, ModelConfig

# The values a setting may take, defined once: the command line, the checks and the strategies read them here.
DTYPES = ("fp32", "bf16", "bf16-params", "fp16", "fp8")  # picotron.precision: what each keeps in which dtype
FP8_RECIPES = ("tensor", "blockwise")  # --dtype fp8's scales: picotron.fp8 (per tensor), picotron.fp8_blockwise
DP_IMPLS = ("naive", "overlap", "bucket", "ddp")
ATTN_IMPLS = ("sdpa", "eager", "flash")
KERNELS = ("plain", "compile", "triton", "auto")
RECOMPUTE = ("none", "selective", "full", "partitioned")
PP_SCHEDULES = ("afab", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe")
CP_IMPLS = ("ring", "allgather", "ulysses")
CP_LAYOUTS = ("zigzag", "contiguous")
ZERO_STAGES = (0, 1, 2, 3)
DEVICES = ("auto", "cpu", "cuda")
COLLECTIVES = ("torch", "ours")
ON_NONFINITE = ("stop", "skip")
OPTIMIZERS = ("adamw", "muon")  # picotron.muon: Newton–Schulz-orthogonalised momentum for the hidden matrices
MUON_IMPLS = ("gather", "owner")  # picotron.muon.Exchange: how a sharded matrix meets for Newton–Schulz
MAX_LR = 1.0  # Adam's step is about lr per weight: beyond 1, every weight moves more than its own scale
MODEL_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings")
MOE_FIELDS = {"experts": "num_local_experts", "top_k": "num_experts_per_tok", "capacity_factor": "capacity_factor",
              "aux_loss_coef": "router_aux_loss_coef", "router": "scoring_func", "shared_experts": "n_shared_experts",
              "expert_size": "moe_intermediate_size", "routed_scaling": "routed_scaling_factor",
              "bias_update_speed": "bias_update_speed"}
ROUTERS = ("softmax", "sigmoid")


class ConfigError(ValueError):
    """A setting breaks a rule; the message is one sentence: the value, the rule, a fix."""


def option(default, help, choices=None):
    """A Config field: its default, what `--help` says of it and, if the values are a closed set, which."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class Config:
    """Every setting of a run; each field's help is what `--help` says of it, its choices the values it may take."""
    # model
    preset: str = option("tiny", "model shape: tiny (0.85 M parameters, the lessons' model) or a real model's shape",
                         PRESETS)
    # parallel layout
    dp: int = option(1, "data-parallel degree: model replicas, each on its own rows of the batch")
    tp: int = option(1, "tensor-parallel degree: every weight matrix split over tp ranks (heads, MLP columns, "
                        "vocabulary)")
    pp: int = option(1, "pipeline-parallel degree: the layers cut into pp stages, micro-batches (--grad-acc) "
                        "flowing through")
    cp: int = option(1, "context-parallel degree: every sequence cut over cp ranks, attention passing K/V around a "
                        "ring")
    ep: int = option(1, "expert-parallel degree: the experts of every MoE layer spread over ep of the dp ranks (ep "
                        "divides dp), tokens sent to them and back with all-to-alls")
    dp_impl: str = option("bucket", "how data parallelism exchanges gradients: one all-reduce per tensor after "
                                    "backward (naive), per tensor during backward (overlap), in buckets during "
                                    "backward (bucket), or torch's DDP (ddp)", DP_IMPLS)
    bucket_mb: float = option(25.0, "gradient bucket size in MiB for --dp-impl bucket and ZeRO-1/2")
    zero: int = option(0, "ZeRO stage over the dp ranks: 1 shards the optimizer state, 2 also the gradients, 3 also "
                          "the parameters; 0 = plain data parallelism", ZERO_STAGES)
    sp: bool = option(False, "sequence parallelism on top of --tp: the norms and the activations between the "
                             "tensor-parallel blocks are split along the sequence over the tp ranks")
    dp_shard: int = option(0, "HSDP, hybrid sharded data parallelism, with --zero: ZeRO shards over groups of dp_shard "
                              "consecutive dp ranks (with their cp ranks) and the dp/dp_shard groups are replicas that "
                              "all-reduce their gradient shards; 0 = one group of all dp ranks (plain ZeRO)")
    async_tp: bool = option(False, "async tensor parallelism with --sp: each block's all-gather before its column-"
                                   "parallel matmuls and reduce-scatter after its row-parallel one cut into tp ring "
                                   "steps, each overlapped with the partial matmul of a chunk that has arrived")
    ep_overlap: bool = option(False, "with --ep: each micro-batch's routed tokens cut in two parts, one part's "
                                     "all-to-alls travelling while the other part's experts compute")
    pp_schedule: str = option("1f1b", "pipeline schedule with --pp: all forwards then all backwards (afab), one "
                                      "forward one backward (1f1b), 1f1b over --pp-chunks chunks per rank "
                                      "(interleaved), zero bubble at 1f1b's memory (zb-h1), zero bubble with two "
                                      "chunks per rank in a V (zb-v), micro-batches fed from both ends with every stage "
                                      "on two ranks (dualpipe: even --pp, even --grad-acc >= 2*pp)", PP_SCHEDULES)
    pp_chunks: int = option(1, "model chunks per rank for --pp-schedule interleaved (v); the bubble shrinks v-fold")
    cp_impl: str = option("ring", "how attention sees the other cp ranks' keys and values: passed around a ring, "
                                  "overlapped with compute (ring), gathered whole once (allgather), or all-to-all "
                                  "from a share of the tokens to a share of the heads (ulysses)", CP_IMPLS)
    cp_layout: str = option("zigzag", "which tokens each cp rank holds: chunks r and 2cp-1-r of 2cp, balancing the "
                                      "causal work (zigzag), or one contiguous block (contiguous)", CP_LAYOUTS)
    # batch and schedule
    steps: int = option(200, "optimizer steps to run")
    seq_len: int = option(128, "tokens per sequence")
    micro_batch_size: int = option(16, "sequences per micro-batch on each data-parallel rank")
    grad_acc: int = option(1, "micro-batches accumulated per optimizer step (global batch = dp x grad_acc x "
                              "micro_batch_size)")
    dtype: str = option("fp32", "precision recipe: fp32; bf16 (autocast for the matmuls, parameters and optimizer "
                                "state stay fp32); bf16-params (bf16 parameters and gradients, fp32 master weights "
                                "and moments in the optimizer); fp16 (the same in fp16, with loss scaling); fp8 "
                                "(the decoder's matmuls in FP8, per-tensor or blockwise scales: --fp8-recipe, "
                                "simulated on CPU)", DTYPES)
    fp8_recipe: str = option("tensor", "with --dtype fp8, the scales: tensor (one per tensor, E4M3 forward, E5M2 "
                                       "gradients) or blockwise (DeepSeek-V3: one per 1x128 tile of activations and "
                                       "gradients, per 128x128 block of weights, E4M3 everywhere)", FP8_RECIPES)
    loss_scale: str = option("dynamic", "fp16's loss scaling: dynamic (halve on overflow and skip the step, double "
                                        "after 2000 clean steps), none, or a number (a static scale)")
    kernels: str = option("plain", "RMSNorm and SwiGLU: plain (PyTorch ops), compile (torch.compile fuses each), "
                                   "triton (hand-written Triton kernels: a CUDA GPU, or TRITON_INTERPRET=1 on a "
                                   "CPU) or auto (triton on a GPU, else compile)", KERNELS)
    compile: bool = option(False, "torch.compile every decoder layer (the first steps pay for compiling)")
    recompute: str = option("none", "activation recomputation: none, selective (attention scores), full (each "
                                    "layer from its input) or partitioned (full, each tp rank keeping 1/tp of the "
                                    "input, all-gathered in backward: ZeRO-R; --tp 2 or more, no --sp)", RECOMPUTE)
    seed: int = option(0, "seed of the initial weights and of the batches (the same for every layout)")
    # output and checkpoints (out=None: the main job claims a new runs/main-N, picotron.runs)
    out: Optional[str] = option(None, "the run's folder (metrics.jsonl, checkpoints/); it must not hold another "
                                      "run, whose results would be replaced")
    save_every: int = option(0, "write a checkpoint every K steps to OUT/checkpoints (0 = only the last step's, "
                                "with --save-final; Ctrl-C still saves one)")
    save_final: bool = option(True, "write a checkpoint of the last step, for --resume and `python -m "
                                    "picotron.export OUT`")
    resume: bool = option(False, "continue the run in OUT from its newest checkpoint with that run's settings, the "
                                 "flags given now overriding what they name (--steps 1200; a new layout is "
                                 "resharded); without --out, the newest runs/main* started with the same flags apart "
                                 "from --steps, --out, checkpoints, logging and faults, else the only one with a "
                                 "checkpoint, else a refusal naming each with the --out to pass")
    resume_from: str = option("", "start a new run from this checkpoint (RUN/checkpoints/step_NNNNNN, or a run "
                                  "folder: its newest); the run it came from is left as it was")
    keep_checkpoints: int = option(3, "how many of the newest checkpoints to keep (older ones are deleted; "
                                      "0 = keep all)")
    async_save: bool = option(False, "write checkpoints in a background thread (training pauses only to copy the "
                                     "tensors to host memory)")
    local_save_every: int = option(0, "level 1 (multi-level checkpoints): every K steps each rank writes its whole "
                                      "state to its node's --local-dir and a copy to the next node's; a restart "
                                      "resumes from the newest step complete at either level (0 = off; K < "
                                      "--save-every)")
    local_dir: str = option("", "level 1's node-local folder, one node_N subfolder per node (empty: OUT/local, "
                                "whose node_N folders stand for each node's local disk on one machine)")
    ranks_per_node: int = option(0, "level 1's nodes: this many consecutive ranks share one (0: torchrun's processes "
                                    "per machine; on one machine e.g. 1 acts out one node per rank)")
    # faults: what survives them (picotron.faults, picotron.checkpoint)
    max_restarts: int = option(0, "restart the job this many times after a rank dies (torchrun --max-restarts); "
                                  "each restart resumes from the newest checkpoint")
    on_nonfinite: str = option("stop", "when the loss or gradient norm is inf/NaN: stop (say which step) or skip "
                                       "(drop that step's update)", ON_NONFINITE)
    faults: str = option("", "inject faults to test recovery: kill@STEP[:rN], kill-save@STEP[:rN], "
                             "lose-node@STEP[:rN] (its level-1 folder deleted too), nan@STEP, "
                             "comma-separated")
    # optimizer (AdamW, warm-up then cosine decay to min_lr)
    lr: float = option(3e-3, "peak learning rate of AdamW, reached after the warm-up")
    min_lr: float = option(3e-4, "learning rate at the last step (cosine decay from lr)")
    warmup_steps: int = option(20, "steps of linear warm-up from 0 to lr")
    weight_decay: float = option(0.1, "AdamW weight decay, on matrices only")
    beta1: float = option(0.9, "AdamW beta1, in [0, 1)")
    beta2: float = option(0.95, "AdamW beta2, in [0, 1)")
    optimizer: str = option("adamw", "adamw, or muon: the decoder layers' matrices by Newton–Schulz-orthogonalised "
                                     "momentum scaled to AdamW's update size (same --lr), the rest by AdamW "
                                     "(picotron.muon)", OPTIMIZERS)
    muon_momentum: float = option(0.95, "Muon's Nesterov momentum, in [0, 1)")
    muon_impl: str = option("gather", "how a sharded matrix meets for Newton–Schulz: gather (every rank all-gathers "
                                      "it and orthogonalises it) or owner (one rank per matrix: all-to-all to it and "
                                      "back)", MUON_IMPLS)
    grad_clip: float = option(1.0, "clip the global gradient norm to this value (0 = no clipping)")
    # logging, evaluation, data, runtime
    log_every: int = option(10, "print a progress line every K steps")
    eval_every: int = option(50, "validation loss every K steps (0 = never)")
    eval_batches: int = option(8, "validation batches per evaluation")
    data: str = option("shakespeare", "training text: shakespeare (embedded), a .txt file, a folder of .txt files, "
                                      "or hf:DATASET (needs the datasets package and network)")
    tokenizer: str = option("byte", "byte (UTF-8 bytes, 256 ids, no files) or a Hugging Face tokenizer name or "
                                    "local folder")
    device: str = option("auto", "auto picks cuda + nccl when torch sees GPUs (one per process on each node, else "
                                 "an error that names --device cpu), cpu + gloo when it sees none", DEVICES)
    timeout_s: int = option(300, "seconds any collective may wait before the job stops with an error (a dead rank "
                                 "cannot hang it)")
    # --- traces (picotron/trace.py)
    profile: Optional[str] = option(None, "profile optimizer steps A to B, both included (A:B, or A for one step) "
                                          "with torch.profiler: OUT/traces/rank{R}.json per rank with picotron's "
                                          "phases and collectives as named ranges, merged.json with every rank on "
                                          "one clock (open in ui.perfetto.dev) and, on CUDA, memory_rank{R}.pickle "
                                          "(pytorch.org/memory_viz)")
    # --- end traces
    # several machines (the launcher's: `python -m picotron.train --dp 16 --nnodes 2 ...` on every node)
    nnodes: int = option(1, "machines the job runs on; each runs the same command (dp*pp*cp*tp / nnodes processes "
                            "each), torchrun's rendezvous at --rdzv-endpoint joins them")
    node_rank: Optional[int] = option(None, "this machine's number, 0 to nnodes-1 (0 = the --rdzv-endpoint host): "
                                            "node R gets ranks R*n to R*n+n-1 (torchrun's static rendezvous); "
                                            "without it torchrun numbers the nodes itself (c10d)")
    rdzv_endpoint: str = option("", "HOST:PORT every node can reach, the same on every node (with --node-rank: node "
                                    "0's address)")
    rdzv_id: str = option("picotron", "the job's name at the rendezvous, the same on every node")
    collectives: str = option("torch", "which collectives every strategy runs on: torch.distributed's own (torch) "
                                       "or lesson 02's, written from send/recv (ours)", COLLECTIVES)
    sample_tokens: int = option(200, "length of the text sample printed at the end (0 = none)")
    # optional model overrides (None = the preset's value)
    vocab_size: Optional[int] = option(None, "model override: vocab_size")
    hidden_size: Optional[int] = option(None, "model override: hidden_size")
    intermediate_size: Optional[int] = option(None, "model override: intermediate_size")
    num_hidden_layers: Optional[int] = option(None, "model override: num_hidden_layers")
    num_attention_heads: Optional[int] = option(None, "model override: num_attention_heads")
    num_key_value_heads: Optional[int] = option(None, "model override: num_key_value_heads")
    max_position_embeddings: Optional[int] = option(None, "model override: max_position_embeddings")
    attn_impl: Optional[str] = option(None, "attention kernel: sdpa (torch's fused attention), eager (the "
                                            "written-out softmax) or flash (picotron.kernels' tiled attention with "
                                            "an online softmax: Triton kernels on CUDA, plain-PyTorch tiles on a CPU, "
                                            "a slow reference)", ATTN_IMPLS)
    tie_word_embeddings: Optional[bool] = option(None, "the LM head shares the embedding matrix (with --pp: two "
                                                       "copies on the first and last stage, their gradients summed)")
    # mixture of experts (None = the preset's; --preset tiny-moe has 4 experts, top-2)
    experts: Optional[int] = option(None, "experts per MoE layer (0 = the dense MLP); e.g. --preset tiny --experts "
                                          "4, or --preset tiny-moe")
    top_k: Optional[int] = option(None, "experts each token is routed to (Mixtral: 2)")
    capacity_factor: Optional[float] = option(None, "with experts: each expert takes at most ceil(c x seq_len x "
                                                    "top_k / experts) tokens of a sequence, the rest dropped and "
                                                    "counted (0 = no limit)")
    aux_loss_coef: Optional[float] = option(None, "weight of the load-balancing auxiliary loss added to the "
                                                  "loss (0 = none)")
    # DeepSeek-V3's routing (--preset tiny-deepseek-moe): sigmoid affinities, shared and fine-grained experts,
    # auxiliary-loss-free balancing by a per-expert bias
    router: Optional[str] = option(None, "with experts: softmax (Mixtral: top-k of the softmax) or sigmoid "
                                         "(DeepSeek-V3: top-k of sigmoid + bias, the gates the chosen sigmoids "
                                         "normalised)", ROUTERS)
    shared_experts: Optional[int] = option(None, "with experts: experts every token passes through besides its top_k "
                                                 "(DeepSeekMoE; 0 = none)")
    expert_size: Optional[int] = option(None, "with experts: each expert's hidden size (fine-grained experts: smaller "
                                              "than the MLP's; 0 = intermediate_size)")
    routed_scaling: Optional[float] = option(None, "with experts: the routed experts' gates multiplied by this "
                                                   "(DeepSeek-V3: 2.5; default 1)")
    bias_update_speed: Optional[float] = option(None, "with experts: γ of auxiliary-loss-free balancing, each "
                                                      "expert's routing bias moved by ±γ after each step by its load "
                                                      "(DeepSeek-V3: 0.001; 0 = off)")

    @property
    def world_size(self):
        """Processes this layout needs: one per cell of the (dp, pp, cp, tp) grid."""
        return self.dp * self.pp * self.cp * self.tp

    @property
    def global_batch_size(self):
        """Sequences per optimizer step, summed over data-parallel ranks and accumulation steps."""
        return self.dp * self.grad_acc * self.micro_batch_size

    @property
    def dp_replicate(self):
        """HSDP's replicas: the dp ranks cut into groups of dp_shard (0: one group, plain ZeRO)."""
        return self.dp // self.dp_shard if self.dp_shard else 1

    @property
    def tokens_per_step(self):
        return self.global_batch_size * self.seq_len

    def model_config(self):
        """The preset's `ModelConfig` with any overrides (hidden_size=..., ...) applied."""
        if self.preset not in PRESETS:
            raise ConfigError(f"preset={self.preset!r} is not a known model; pick one of {', '.join(PRESETS)}.")
        overrides = {k: getattr(self, k) for k in MODEL_FIELDS + ("attn_impl", "tie_word_embeddings")
                     if getattr(self, k) is not None}
        for ours, theirs in MOE_FIELDS.items():  # our short flags, Hugging Face Mixtral's field names
            if getattr(self, ours) is not None:
                overrides[theirs] = getattr(self, ours)
        return dataclasses.replace(ModelConfig.from_preset(self.preset), **overrides)

    def to_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values, source="the config"):
        """Build from a plain dict (e.g. a JSON file), checking names and types; unknown keys are errors."""
        return cls(**_checked(values, source))

    @classmethod
    def load(cls, path):
        try:
            with open(path) as f:
                values = json.load(f)
        except OSError as e:
            raise ConfigError(f"config file {path!r} cannot be read ({e.strerror}); check the --config path.") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {path!r} is not valid JSON (line {e.lineno}: {e.msg}); fix the file.") from None
        if not isinstance(values, dict):
            raise ConfigError(f"config file {path!r} holds a {type(values).__name__}, not an object; "
                              f"write {{\"field\": value, ...}}.")
        return cls.from_dict(values, source=path)

    @classmethod
    def read(cls, path):
        """The settings a JSON file names (a dict, checked), without the defaults of the others."""
        values = cls.load(path).to_dict()
        with open(path) as f:
            return {name: values[name] for name in (k.replace("-", "_") for k in json.load(f))}


def _field_types():
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def _checked(values, source):
    types, out = _field_types(), {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in types:
            raise ConfigError(f"{key!r} in {source} is not a setting; valid names are the fields of "
                              f"picotron.config.Config ({', '.join(list(types)[:6])}, ...).")
        kind = types[name]
        optional = typing.get_origin(kind) is typing.Union
        kind = typing.get_args(kind)[0] if optional else kind
        ok = (value is None and optional) or (
            isinstance(value, bool) if kind is bool else
            isinstance(value, int) and not isinstance(value, bool) if kind is int else
            isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else
            isinstance(value, kind))
        if not ok:
            raise ConfigError(f"{name}={value!r} in {source} has type {type(value).__name__} but must be "
                              f"{kind.__name__}; fix the value in {source}.")
        out[name] = float(value) if kind is float and value is not None else value
    return out


# ----------------------------------------------------------------------------------------------- validation
def check(cfg):
    """Raise ConfigError for the first broken rule of the settings themselves; return the run's ModelConfig.

    The rules of the strategies (each one's own, and which combine) are `picotron.rules.validate`'s."""
    _check_names(cfg)
    _check_positive(cfg)
    mc = cfg.model_config()
    _check_model(cfg, mc)
    _check_faults(cfg)
    _check_nodes(cfg)
    _check_levels(cfg)
    return mc


def _check_names(cfg):
    for f in dataclasses.fields(cfg):
        allowed, value = f.metadata["choices"], getattr(cfg, f.name)
        if allowed is not None and value not in allowed and not (value is None and f.default is None):
            raise ConfigError(f"{f.name}={value!r} is not one of the known values; pick one of "
                              f"{', '.join(map(str, allowed))}.")
    if not (cfg.data == "shakespeare" or cfg.data.startswith("hf:") or os.path.exists(cfg.data)):
        raise ConfigError(f"data={cfg.data!r} is neither 'shakespeare', 'hf:<dataset>' nor an existing file or "
                          f"directory; pass --data shakespeare or the path of a .txt file.")


def _choices(xs):
    return "{" + ", ".join(str(x) for x in xs) + "}"


def _fits(n, limit=64):
    """Degrees d <= limit (and <= n) that divide n, the candidates a message proposes."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _check_positive(cfg):
    at_least = {"dp": 1, "tp": 1, "pp": 1, "pp_chunks": 1, "cp": 1, "ep": 1, "steps": 1, "seq_len": 1, "micro_batch_size": 1,
                "grad_acc": 1, "log_every": 1, "timeout_s": 1, "seed": 0, "save_every": 0, "warmup_steps": 0,
                "keep_checkpoints": 0, "max_restarts": 0, "local_save_every": 0, "ranks_per_node": 0,
                "eval_every": 0, "eval_batches": 0, "sample_tokens": 0, "experts": 0, "top_k": 1, "shared_experts": 0,
                "expert_size": 0, "dp_shard": 0}
    at_least.update({k: 1 for k in MODEL_FIELDS})
    for name, low in at_least.items():
        value = getattr(cfg, name)
        if value is not None and value < low:
            flag = "--" + name.replace("_", "-")
            what = "a positive integer" if low == 1 else "zero or more"
            raise ConfigError(f"{name}={value} must be {what}; pass {flag} {low} or more.")
    for f in dataclasses.fields(cfg):  # argparse and JSON accept inf and nan: nothing can train with them
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{f.name}={value} is not a finite number; pass a finite --{f.name.replace('_', '-')} "
                              f"(the default is {getattr(Config(), f.name)}).")
    if not cfg.lr > 0:
        raise ConfigError(f"lr={cfg.lr} must be positive; pass --lr 3e-3 (the default) or another positive rate.")
    if cfg.lr > MAX_LR:
        raise ConfigError(f"lr={cfg.lr:g} is above {MAX_LR:g}: Adam moves every weight by about lr per step, so the "
                          f"run would diverge at once; pass --lr 3e-3 (the default) or another rate below {MAX_LR:g}.")
    if not 0 <= cfg.min_lr <= cfg.lr:
        raise ConfigError(f"min_lr={cfg.min_lr} must lie between 0 and lr={cfg.lr}; pass --min-lr {cfg.lr / 10:g}.")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(cfg, name) < 1:
            raise ConfigError(f"{name}={getattr(cfg, name)} must lie in [0, 1); pass --{name} 0.9 or 0.95.")
    if not 0 <= cfg.muon_momentum < 1:
        raise ConfigError(f"muon_momentum={cfg.muon_momentum} must lie in [0, 1); pass --muon-momentum 0.95.")
    for name in ("weight_decay", "grad_clip", "bucket_mb", "capacity_factor", "aux_loss_coef", "bias_update_speed"):
        if (getattr(cfg, name) or 0) < 0:
            raise ConfigError(f"{name}={getattr(cfg, name)} must not be negative; pass --{name.replace('_', '-')} 0 "
                              f"to switch it off.")
    if cfg.eval_every and not cfg.eval_batches:
        raise ConfigError(f"eval_every={cfg.eval_every} needs eval_batches >= 1 but eval_batches=0; pass "
                          f"--eval-batches 8 or --eval-every 0 to skip evaluation.")


def _check_model(cfg, mc):
    if mc.hidden_size % mc.num_attention_heads:
        raise ConfigError(f"hidden_size={mc.hidden_size} is not divisible by num_attention_heads="
                          f"{mc.num_attention_heads}; pick num_attention_heads in {_choices(_fits(mc.hidden_size))}.")
    if mc.num_attention_heads % mc.num_key_value_heads:
        raise ConfigError(f"num_key_value_heads={mc.num_key_value_heads} does not divide num_attention_heads="
                          f"{mc.num_attention_heads} (each KV head serves a whole group of query heads); pick "
                          f"num_key_value_heads in {_choices(_fits(mc.num_attention_heads))}.")
    if cfg.seq_len > mc.max_position_embeddings:
        raise ConfigError(f"seq_len={cfg.seq_len} exceeds max_position_embeddings={mc.max_position_embeddings} of "
                          f"preset {cfg.preset!r}; pass --seq-len {mc.max_position_embeddings} or less.")
    if cfg.tokenizer == "byte" and mc.vocab_size < 256:
        raise ConfigError(f"vocab_size={mc.vocab_size} is too small for the byte tokenizer, which needs 256 ids; "
                          f"pass --vocab-size 256.")


def _check_faults(cfg):
    problem = faults.problem(cfg)
    if problem:
        raise ConfigError(problem)
    if cfg.max_restarts and not cfg.save_every:
        raise ConfigError(f"max_restarts={cfg.max_restarts} without checkpoints would restart from step 1 each time; "
                          f"pass --save-every K (e.g. --save-every {max(1, cfg.steps // 10)}).")


def _check_nodes(cfg):
    if cfg.nnodes < 1:
        raise ConfigError(f"nnodes={cfg.nnodes} must be a positive integer; pass --nnodes 1 or more.")
    if cfg.world_size % cfg.nnodes:
        good = [d for d in range(1, cfg.world_size + 1) if cfg.world_size % d == 0]
        raise ConfigError(f"dp*pp*cp*tp = {cfg.world_size} processes do not split evenly over nnodes={cfg.nnodes} "
                          f"(every node runs the same number); pick --nnodes in {_choices(good)} or degrees whose "
                          f"product is a multiple of {cfg.nnodes}.")
    if cfg.node_rank is not None and not 0 <= cfg.node_rank < cfg.nnodes:
        others = "1 on the other" if cfg.nnodes == 2 else f"1 to {cfg.nnodes - 1} on the others"
        fix = "leave --node-rank out on one machine" if cfg.nnodes == 1 else \
            f"pass --node-rank 0 on the --rdzv-endpoint host and {others}"
        raise ConfigError(f"node_rank={cfg.node_rank} is not a node of nnodes={cfg.nnodes}; {fix}.")
    if cfg.nnodes > 1 and not cfg.rdzv_endpoint:
        raise ConfigError(f"nnodes={cfg.nnodes} needs a place where the nodes meet; pass --rdzv-endpoint HOST:PORT, "
                          f"the first node's address and a free port, the same on every node (like 10.0.0.1:29500).")
    if cfg.rdzv_endpoint:
        host, _, port = cfg.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"rdzv_endpoint={cfg.rdzv_endpoint!r} is not HOST:PORT; pass the first node's address "
                              f"and a free port, like --rdzv-endpoint 10.0.0.1:29500.")


def _check_levels(cfg):
    """Level 1 (--local-save-every) in front of level 2 (--save-every): picotron.checkpoint."""
    if not cfg.local_save_every:
        if cfg.local_dir or cfg.ranks_per_node:
            flag = "--local-dir" if cfg.local_dir else "--ranks-per-node"
            raise ConfigError(f"{flag} configures level-1 checkpoints, which are off (local_save_every=0); pass "
                              f"--local-save-every K (below --save-every) or drop {flag}.")
        return
    if not cfg.save_every or cfg.local_save_every >= cfg.save_every:
        raise ConfigError(f"local_save_every={cfg.local_save_every} must be below save_every={cfg.save_every}: level "
                          f"1 is the frequent level in front of level 2 (the shared folder, the only one that "
                          f"survives losing a node and its peer); pass e.g. --save-every "
                          f"{4 * cfg.local_save_every}.")
    if cfg.ranks_per_node and cfg.world_size % cfg.ranks_per_node:
        raise ConfigError(f"ranks_per_node={cfg.ranks_per_node} does not divide the {cfg.world_size} ranks into "
                          f"whole nodes; pick --ranks-per-node in {_choices(_fits(cfg.world_size))}.")
    if cfg.ranks_per_node and cfg.nnodes > 1 and cfg.ranks_per_node != cfg.world_size // cfg.nnodes:
        raise ConfigError(f"ranks_per_node={cfg.ranks_per_node} disagrees with the {cfg.world_size // cfg.nnodes} "
                          f"processes on each of nnodes={cfg.nnodes} machines; leave --ranks-per-node out (the "
                          f"machines are the nodes).")


def placement_note(cfg, per_node):
    """One sentence when tensor- and context-parallel peers would sit on different nodes (their traffic is
    per layer, on the critical path: it wants NVLink, not the network), else None. `per_node`: processes per node.
    The grid puts tp fastest, then cp, so a tp·cp group is tp·cp consecutive ranks; nodes hold consecutive ranks."""
    group = cfg.tp * cfg.cp
    if group == 1 or per_node >= cfg.world_size:
        return None
    what = "tp" if cfg.cp == 1 else "cp" if cfg.tp == 1 else "tp·cp"
    procs = f"{per_node} process{'es' if per_node > 1 else ''}"
    if group > per_node:
        return (f"{what} = {group} spans {math.ceil(group / per_node)} nodes of {procs}: their per-layer traffic "
                f"would cross the network; keep {what} <= {per_node}.")
    if per_node % group:
        return (f"{what} = {group} does not divide the {procs} per node, so some {what} groups straddle two nodes "
                f"and their per-layer traffic would cross the network; pick {what} dividing {per_node}.")
    return None


# ------------------------------------------------------------------------------------------------------ CLI
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's full usage block
        print(f"picotron: error: {message}; see --help.", file=sys.stderr)
        raise SystemExit(2)


def build_parser():
    """Flags mirror the Config fields in kebab case; defaults are suppressed so only given flags override."""
    from picotron import __version__

    launcher_name, defaults_of_launcher = launcher(), os.environ.get(LAUNCHER_DEFAULTS)
    p = _Parser(prog=launcher_name or "python -m picotron.train", usage="%(prog)s [--config F.json] [--FLAG VALUE ...]",
                argument_default=argparse.SUPPRESS, formatter_class=argparse.RawDescriptionHelpFormatter,
                description=DESCRIPTION + (f"\n\n{launcher_name} sets {defaults_of_launcher} (a flag given here wins)."
                                           if launcher_name and defaults_of_launcher else ""))
    p.add_argument("--config", metavar="F.json", help="JSON file of settings; flags given here override it")
    p.add_argument("--version", action="version", version=f"picotron {__version__}")
    types = _field_types()
    defaults = Config()
    for f in dataclasses.fields(Config):
        name, kind, choices = f.name, types[f.name], f.metadata["choices"]
        optional = typing.get_origin(kind) is typing.Union
        kind = typing.get_args(kind)[0] if optional else kind
        flag = "--" + name.replace("_", "-")
        default = "a new folder runs/main, runs/main-2, ...; with --resume the run the flags name, as --resume " \
            "says" if name == "out" else \
            "the preset's" if optional else repr(getattr(defaults, name))
        helptext = f.metadata["help"] + (f"; one of {', '.join(map(str, choices))}" if choices else "") + \
            f" (default: {default})"
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, help=helptext)
        else:
            metavar = "{" + ",".join(map(str, choices)) + "}" if choices and name != "preset" else \
                "N" if kind is int else "X" if kind is float else name.upper()
            p.add_argument(flag, type=kind, metavar=metavar, help=helptext)
    return p


DESCRIPTION = """\
Train a Llama-style model on the embedded Shakespeare (or your text), on one process or many.

Works today: data parallelism (--dp), ZeRO-1/2/3 (--zero) and HSDP (--dp-shard), tensor parallelism (--tp) with
sequence parallelism (--sp) and async TP (--async-tp), pipeline parallelism (--pp, --pp-schedule; the micro-batches are --grad-acc), context
parallelism (--cp, --cp-impl, --cp-layout), gradient accumulation, activation recomputation, expert parallelism (--ep, with a mixture-of-experts
model: --preset tiny-moe or --experts E; --ep-overlap), checkpoints, precision recipes (--dtype bf16, bf16-params, fp16, fp8).

Several processes on one machine: `python -m picotron.train --dp 2 --tp 2` starts them itself (with torchrun,
one per cell of the dp x pp x cp x tp grid); several machines: the same command on each, plus --nnodes N
--rdzv-endpoint HOST:PORT (and --node-rank R), or torchrun --nnodes N ... -m picotron.train ... on each.
Bad settings stop before any process starts, with one sentence: the value, the rule, a fix."""


# How a launcher (run.sh) says what it is and which flags are its own defaults: the commands a message hands back
# start with it and leave those flags out (the user did not type them); they sit below everything the user gives.
LAUNCHER, LAUNCHER_DEFAULTS = "PICOTRON_LAUNCHER", "PICOTRON_LAUNCHER_DEFAULTS"


def given(argv):
    """The settings a command line names (a dict: field -> value): its --config file's, then its flags'."""
    ns = vars(build_parser().parse_args(argv))
    path = ns.pop("config", None)
    values = Config.read(path) if path else {}
    values.update(_checked(ns, "the command line"))
    return values


def launcher():
    """How the user starts training when a launcher says so ($PICOTRON_LAUNCHER, e.g. "./run.sh"), else None."""
    return os.environ.get(LAUNCHER) or None


def launcher_defaults():
    """The settings the launcher sets below the user's flags ($PICOTRON_LAUNCHER_DEFAULTS, e.g. run.sh's --steps 600)."""
    return given(shlex.split(os.environ.get(LAUNCHER_DEFAULTS, "")))


def flags(values):
    """The command-line flags that set `values` (a dict: field -> value): {"preset": "tiny-moe", "sp": True} ->
    ['--preset', 'tiny-moe', '--sp']."""
    out = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return out


def parse_args(argv=None, saved=None):
    """Config from defaults < the launcher's defaults < `saved` (--resume: the run's own settings) < --config file <
    flags. Not validated: call `picotron.rules.validate` (or `picotron.parallelize.cli`, both in one)."""
    values = launcher_defaults()
    values.update(saved or {})
    values.update(given(argv))
    return Config.from_dict(values, source="the command line")


if __name__ == "__main__":  # python -m picotron.config --tp 2 ...: the resolved, validated settings; the rules of
    import runpy            # which strategies combine live in picotron.parallelize, so it is the one that answers

    runpy.run_module("picotron.parallelize", run_name="__main__", alter_sys=True)
