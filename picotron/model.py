"""A Llama-style decoder-only transformer, written to be read (and to match Hugging Face's Llama exactly).

    input_ids [b, s]
      -> embed_tokens                                   [b, s, h]      v·h parameters, no FLOPs (a lookup)
      -> L x DecoderLayer  (pre-norm, two residual branches)
           x = x + o_proj(Attention(RoPE(q_proj(n)), RoPE(k_proj(n)), v_proj(n)))   n = input_layernorm(x)
           x = x + down_proj(silu(gate_proj(n)) * up_proj(n))                      n = post_attention_layernorm(x)
      -> norm -> lm_head                                [b, s, v]      v·h parameters (shared when tied)

Shapes (h = hidden_size, a = heads, k = KV heads, d = h/a = head_dim, i = intermediate_size):
q_proj h->a·d, k_proj/v_proj h->k·d (grouped-query attention: each KV head serves a/k query heads; k = a
is plain multi-head attention), o_proj a·d->h, gate/up_proj h->i, down_proj i->h. RMSNorm has one weight
vector of size h and no bias; no Linear has a bias.

With experts (`num_local_experts` E > 0, picotron.moe) the MLP becomes Mixtral's sparse block, `block_sparse_moe`:
a router (E x h) sends each token to `num_experts_per_tok` k of E SwiGLU experts (w1 = gate, w3 = up, w2 = down),
so the layer holds E·3·h·i parameters but a token uses k·3·h·i of them (`num_params(active=True)`).

Where parameters go, per layer: attention 2h² + 2h·k·d, MLP 3·h·i, norms 2h; plus v·h for the embedding and
v·h again for an untied lm_head (`ModelConfig.num_params` counts them exactly). Where FLOPs go: each
parameter in a matmul costs 2 FLOPs per token forward and 4 backward (the 6N rule), and attention adds
QK^T and (softmax)V, 2·2·s·h per token per layer forward, hence 12·L·h·s per token for a training step
(`ModelConfig.flops_per_token`).

Positions enter only through RoPE, applied to q and k in the Hugging Face "rotate_half" layout (HF's
checkpoint converter permutes q/k weights for it), so HF weights load as-is. cos/sin are recomputed in every
forward from the positions (cheap: s·d/2 values) - no buffers, so a model built on the meta device and
materialised with `to_empty` needs nothing special (the one buffer, DeepSeek routing's bias, is zeroed by init).

The model knows nothing about parallelism. Things the parallel strategies may rely on (its seams):
  * sub-module names equal HF's (minus the "model." prefix), so the state dict maps 1:1 to a checkpoint;
  * `layers` is keyed by each layer's GLOBAL index ("0", "1", ...): a pipeline stage that keeps layers 8-15
    still calls them layers.8 ... layers.15, so names, and hence initial values, do not depend on the layout;
  * an absent `embed_tokens`, `norm` or `lm_head` (None: another pipeline stage owns it) is a pass-through:
    the model then takes hidden states in or gives them out;
  * attention reads head counts from the tensor shapes, so sharded (tensor-parallel) projections just work;
  * a MoE block's experts are keyed by global index too (experts.0 ... experts.E-1), and its `exchange` (None
    here) is where expert parallelism sends the rows sorted by expert away and gets the outputs back;
  * `Attention.core`, a submodule with no parameters (`AttentionCore`), is the one place where tokens see
    each other (`attn_impl`: "sdpa", "eager" or "flash", picotron.kernels' tiled attention): context
    parallelism swaps it; `forward(input_ids, position_ids=None)` takes explicit positions ([s] or [b, s])
    for the same reason, and the step engine passes them with every batch;
  * `init_weights(seed)` draws every parameter from a generator seeded by (seed, parameter name) only, so
    every layout initialises identically. A strategy that shards a parameter places it (`picotron.marks`:
    the full shape and the slice's offsets in it, a record kept on the module by parameter name, so `to_empty`
    and `load_state_dict(assign=True)` keep it); `init_weights` then draws the full tensor and keeps the slice;
  * `stages()` says what a gradient wrapper (data_parallel, zero, zero3) and the pipeline executor may read of a
    model (`Stages`: its chunks, their pipeline stages, the tied pair held apart): a whole model is one chunk,
    stage 0, nothing tied apart; a pipeline stage (picotron.pipeline_parallel) answers the same question;
  * `partition` (None here) says how recompute="partitioned" cuts a layer's input into this rank's piece and
    rebuilds it in backward (`keep`, `rebuild`): tensor parallelism sets it (ZeRO-R's partitioned checkpoints).

The shape (`ModelConfig`, the named `PRESETS`) lives in picotron.model_config, a leaf without torch that
the command line reads; this module's names for them still work.

Each RMSNorm and dense MLP has a `kernel` attribute, "plain" (the PyTorch ops written here) unless
`use_kernels(model, impl)` routes them through picotron.kernels' fused RMSNorm and SwiGLU.
"""
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from picotron import kernels, marks
from picotron.model_config import HF_DEFAULTS, PRESETS, ModelConfig  # noqa: F401 (picotron.model's names too)
from picotron.moe import MoE


# ----------------------------------------------------------------------------------------------- layers
class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) * weight, computed in float32 (as HF does) and cast back."""
    kernel = "plain"  # or a picotron.kernels impl ("auto", "triton", "compile"): see use_kernels

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        if self.kernel != "plain":
            return kernels.rms_norm(x, self.weight, self.eps, impl=self.kernel)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(position_ids, head_dim: int, theta: float):
    """cos, sin of shape [..., s, head_dim] for the given positions (HF layout: the d/2 frequencies twice)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim)
    angles = position_ids.float()[..., None] * inv_freq  # [..., s, d/2]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """Rotate each pair (x[j], x[j + d/2]) of every head by angle position·theta^(-2j/d)."""
    return x * cos + rotate_half(x) * sin


class AttentionCore(nn.Module):
    """RoPE + causal softmax(q k^T / sqrt(d)) v: the one place where tokens see each other. No parameters;
    a strategy that splits the sequence (context parallelism) replaces this module."""

    def __init__(self, attn_impl: str = "sdpa"):
        super().__init__()
        self.attn_impl = attn_impl

    def forward(self, q, k, v, cos, sin):
        """q: [b, a, s, d], k/v: [b, k, s, d], cos/sin: [s, d] or [b, 1, s, d] -> [b, a, s, d]."""
        q, k = apply_rope(q, cos.to(q.dtype), sin.to(q.dtype)), apply_rope(k, cos.to(k.dtype), sin.to(k.dtype))
        groups = q.shape[1] // k.shape[1]
        if self.attn_impl == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1)
        if self.attn_impl == "flash":
            return kernels.flash_attention(q, k, v, causal=True)
        if self.attn_impl != "eager":
            raise ValueError(f"unknown attn_impl {self.attn_impl!r}; use 'sdpa', 'eager' or 'flash'.")
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # [b, a, s, s]: the 5·a·s/h term
        s_q, s_k = scores.shape[-2:]
        future = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v

    def extra_repr(self):
        return self.attn_impl


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.core = AttentionCore(config.attn_impl)
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)

    def forward(self, x, cos, sin, recompute: bool = False):
        b, s, _ = x.shape
        # [b, s, heads·d] -> [b, heads, s, d]; head counts come from the weights' shapes (TP shards them).
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        if recompute:  # selective recomputation: drop the s×s part, recompute it in backward
            out = checkpoint(self.core, q, k, v, cos, sin, use_reentrant=False)
        else:
            out = self.core(q, k, v, cos, sin)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    kernel = "plain"  # or a picotron.kernels impl: see use_kernels

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        if self.kernel != "plain":
            return self.down_proj(kernels.swiglu(self.gate_proj(x), self.up_proj(x), impl=self.kernel))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_moe:  # Mixtral's name, so the state dict maps 1:1 to its checkpoints
            self.block_sparse_moe = MoE(config)
        else:
            self.mlp = MLP(config)

    @property
    def feed_forward(self):
        """The MLP, or the mixture of experts that replaces it."""
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def forward(self, x, cos, sin, selective: bool = False):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, recompute=selective)
        return x + self.feed_forward(self.post_attention_layernorm(x))


def checkpoint_partitioned(layer, x, cos, sin, partition):
    """layer(x, cos, sin) with full recomputation that keeps only `partition.keep(x)`, this rank's piece of the
    input, and rebuilds the input with `partition.rebuild(piece)` (the other ranks' pieces) just before the layer
    is redone in backward: ZeRO-R's partitioned activation checkpointing (tensor_parallel.HiddenSlices).

    torch's checkpoint saves the tensors it is given, so it is given the piece; the whole input reaches the first
    forward through `whole` and is dropped there. The forward's autograd graph is the plain one (the checkpoint
    only swaps the tensors the layer saves for recomputed ones), so the input's gradient is exactly full
    recomputation's."""
    if not torch.is_grad_enabled():  # nothing is saved: no piece to keep
        return layer(x, cos, sin)
    whole, needs_grad = [x], x.requires_grad

    def run(piece, cos, sin):
        if whole:  # the forward: the input itself
            return layer(whole.pop(), cos, sin)
        # the recomputation, inside backward: the whole input again, requiring grad as the first time did (so the
        # ops save the same tensors)
        return layer(partition.rebuild(piece).requires_grad_(needs_grad), cos, sin)

    return checkpoint(run, partition.keep(x), cos, sin, use_reentrant=False)


def use_kernels(model, impl: str = "auto"):
    """Send every RMSNorm and dense MLP of `model` through picotron.kernels' fused RMSNorm and SwiGLU (impl
    "auto", "triton" or "compile"), or back through the plain ops ("plain"). The same arithmetic, so the
    same results up to rounding; parameters are untouched. (SequenceParallelRMSNorm and the experts of a MoE
    keep their own forward.)"""
    if impl not in kernels.IMPLS:
        raise ValueError(f"unknown kernel impl {impl!r}; use one of {kernels.IMPLS}.")
    for m in model.modules():
        if isinstance(m, (RMSNorm, MLP)):
            m.kernel = impl
    return model


# ------------------------------------------------------------------------------------------------ model
class Layers(nn.ModuleDict):
    """The decoder layers, keyed by their global index: `layers[3]` is layer 3 and is named "layers.3" on
    whichever rank holds it, even when a pipeline stage keeps only some of them. Iterating gives the layers
    (in index order), as a ModuleList would."""

    def __init__(self, layers):
        super().__init__({str(i): layer for i, layer in layers})

    def __getitem__(self, index):
        return super().__getitem__(str(index))

    def __iter__(self):
        return iter(self.values())

    def indices(self):
        return [int(k) for k in self.keys()]


@dataclass(frozen=True)
class Stages:
    """What a model holds, as gradient wrappers and the pipeline executor read it (the one contract between them):

        chunks  the modules a forward runs through, each a Llama holding some layers (a whole model: itself)
        ids     the pipeline stage each chunk is (a whole model: stage 0)
        tied    the names, in the model, of the parameters on this rank that are an embedding and its copy held
                apart (a pipeline's first-stage embedding and last-stage head): none, one or both. Their
                gradients are summed after the backward (pipeline_parallel.sync_tied). Names, not tensors:
                a name still finds the parameter after to_empty or a swap.
    """
    chunks: tuple
    ids: tuple
    tied: tuple = ()

    def tied_params(self, model):
        """The tied parameters of `model` (the module these Stages describe), in the order of `tied`."""
        return [model.get_parameter(name) for name in self.tied]


def _attach_after_load(module, incompatible_keys):
    """load_state_dict(assign=True) puts new Parameter objects in: let them carry their placements again."""
    marks.attach(module)


class Llama(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.recompute = "none"  # "none" | "selective" | "full" | "partitioned"; set by the trainer
        self.partition = None  # "partitioned": how a layer's input is cut and rebuilt (tensor_parallel sets it)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = Layers((i, DecoderLayer(config)) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.register_load_state_dict_post_hook(_attach_after_load)

    def tie_weights(self):
        """Make lm_head share the embedding matrix when the config says so (to_empty unties: we re-tie)."""
        if self.config.tie_word_embeddings and self.lm_head is not None and self.embed_tokens is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def to_empty(self, *, device, recurse: bool = True):
        """torch's to_empty (new Parameter objects), then the tie made again and every parameter given its
        placement again (picotron.marks: the records stay on the modules; the new tensors carry them)."""
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return marks.attach(self)

    def stages(self):
        """A whole model (or one chunk): one chunk, stage 0, nothing tied apart (a tied head IS the embedding)."""
        return Stages(chunks=(self,), ids=(0,))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # parameters() counts a tied matrix once

    def forward(self, input_ids, position_ids=None):
        """input_ids [b, s] (int64) -> logits [b, s, vocab]. position_ids ([s] or [b, s]) default to 0..s-1.

        Without an embedding the input is already hidden states [b, s, h]; without norm and head the output
        is too (pipeline stages)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)
        if cos.dim() == 3:  # per-sequence positions [b, s, d]: broadcast over the heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if self.recompute not in ("none", "selective", "full", "partitioned"):
            raise ValueError(f"recompute={self.recompute!r}; use 'none', 'selective', 'full' or 'partitioned'.")
        if self.recompute == "partitioned" and self.partition is None:
            raise ValueError("recompute='partitioned' needs a partition of the layer inputs over ranks that hold the "
                             "same copy (tensor parallelism sets one); use recompute='full'.")
        x = input_ids if self.embed_tokens is None else self.embed_tokens(input_ids)
        for layer in self.layers:
            if self.recompute == "full":  # keep only each layer's input; redo the layer in backward
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            elif self.recompute == "partitioned":  # keep only this rank's piece of it
                x = checkpoint_partitioned(layer, x, cos, sin, self.partition)
            else:
                x = layer(x, cos, sin, selective=self.recompute == "selective")
        if self.norm is not None:
            x = self.norm(x)
        return x if self.lm_head is None else self.lm_head(x)

    # ---------------------------------------------------------------------------------------- init
    def init_std(self, name: str) -> float:
        """std = initializer_range, divided by sqrt(2L) for the two projections that write into the
        residual stream (o_proj, down_proj): GPT-2's scheme, keeping the residual's variance independent
        of depth. Hugging Face's Llama init uses no such scaling; that only matters for training from
        scratch, never for loading weights."""
        std = self.config.initializer_range
        if name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")):  # w2: an expert's down projection
            std /= math.sqrt(2 * self.config.num_hidden_layers)
        return std

    @torch.no_grad()
    def init_weights(self, seed: int = 0):
        """Fill every parameter from `init_tensor(name, shape, seed, std)`: norms 1, the rest normal; buffers 0."""
        self.tie_weights()
        placed = marks.records(self)  # kept by name on the modules: right even after a plain to_empty
        for name, p in self.named_parameters():  # a tied lm_head.weight is skipped: it is embed_tokens
            where = placed[name]  # a slice (tensor parallelism) draws the full tensor and keeps its part
            if name.endswith("norm.weight"):
                full = torch.ones(where.shape)
            else:
                full = init_tensor(name, where.shape, seed, self.init_std(name))
            p.copy_(where.take(full, p.shape))
        for b in self.buffers():  # the MoE routing bias (DeepSeek-V3) starts at zero
            b.zero_()
        return self

    # ---------------------------------------------------------------------------- Hugging Face I/O
    @classmethod
    def from_hf(cls, directory, dtype=None) -> "Llama":
        """Load a Hugging Face Llama checkpoint directory (config.json + model.safetensors, or shards listed
        in model.safetensors.index.json). dtype=None keeps the stored dtype."""
        from safetensors.torch import load_file

        directory = Path(directory)
        try:
            config = ModelConfig.from_hf_dict(json.loads((directory / "config.json").read_text()))
        except ValueError as e:
            raise ValueError(f"{directory / 'config.json'}: {e}") from None
        index = directory / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
            else ["model.safetensors"]
        state = {}
        for f in files:
            for name, t in load_file(directory / f).items():
                if not name.endswith("rotary_emb.inv_freq"):  # old checkpoints stored this buffer
                    state[name.removeprefix("model.")] = t if dtype is None else t.to(dtype)
        if config.tie_word_embeddings:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict(state, strict=True, assign=True)
        model.tie_weights()
        return model

    def save_hf(self, directory):
        """Write config.json + model.safetensors in the LlamaForCausalLM layout (one file, no sharding)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {}
        for name, t in self.state_dict().items():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # HF stores a tied matrix once, as model.embed_tokens.weight
            key = name if name.startswith("lm_head.") else "model." + name
            state[key] = t.detach().cpu().contiguous()
        hf_config = self.config.to_dict()
        hf_config["torch_dtype"] = str(self.embed_tokens.weight.dtype).removeprefix("torch.")
        (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        save_file(state, directory / "model.safetensors", metadata={"format": "pt"})


def init_tensor(name: str, shape, seed: int, std: float) -> torch.Tensor:
    """A float32 CPU tensor ~ N(0, std²) that depends only on (seed, name, shape), never on the process,
    device or parallel layout. The generator's seed is a stable hash (crc32, not Python's randomised
    hash()) of the seed and the parameter's name."""
    g = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return torch.randn(tuple(shape), generator=g) * std


def loss_fn(logits, targets):
    """Mean cross-entropy over every token: logits [b, s, v] (any dtype; computed in fp32), targets [b, s]."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


@torch.no_grad()
def generate(model, input_ids, max_new_tokens: int, temperature: float = 1.0, top_k=None, generator=None):
    """Append max_new_tokens sampled tokens to input_ids [b, s] (no KV cache: the whole context is re-run
    each step, cropped to max_position_embeddings). temperature 0 = greedy. Sampling happens on the CPU so
    a CPU `generator` works whatever the model's device."""
    context_len = model.config.max_position_embeddings
    for _ in range(max_new_tokens):
        logits = model(input_ids[:, -context_len:])[:, -1].float().cpu()
        if temperature == 0:
            next_ids = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_ids = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        input_ids = torch.cat([input_ids, next_ids.to(input_ids.device)], dim=1)
    return input_ids
