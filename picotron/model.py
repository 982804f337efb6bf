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
materialised with `to_empty` needs nothing special.

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
    the full shape and the slice's offsets in it); `init_weights` then draws the full tensor and keeps the slice.

Each RMSNorm and dense MLP has a `kernel` attribute, "plain" (the PyTorch ops written here) unless
`use_kernels(model, impl)` routes them through picotron.kernels' fused RMSNorm and SwiGLU.
"""
import json
import math
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from picotron import kernels, marks
from picotron.moe import MoE


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    attn_impl: str = "sdpa"  # "sdpa": fused kernel; "eager": explicit softmax that stores the s×s scores;
    # "flash": picotron.kernels.flash_attention, the tiled online softmax in plain PyTorch (a reference: slow)
    # mixture of experts (picotron.moe; 0 experts = the dense SwiGLU MLP), in Hugging Face Mixtral's names
    num_local_experts: int = 0
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.01
    capacity_factor: float = 0.0  # 0: no limit (not a Mixtral field: a training option, GShard/Switch)

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; pick one of {sorted(PRESETS)}.")
        return cls(**{**PRESETS[name], **overrides})

    def ffn_params(self, active=False) -> int:
        """Parameters of one layer's feed-forward: 3·h·i dense; E·3·h·i + E·h (router) with experts, or with
        active=True only the k experts a token passes through (and the router)."""
        mlp = 3 * self.hidden_size * self.intermediate_size
        if not self.is_moe:
            return mlp
        return (self.num_experts_per_tok if active else self.num_local_experts) * mlp \
            + self.num_local_experts * self.hidden_size

    def num_params(self, active=False) -> int:
        """Exact parameter count of `Llama(self)` (a tied lm_head counts once); active=True: those one token
        uses (with experts: k of E per layer)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        per_layer = 2 * h * h + 2 * h * kv + self.ffn_params(active) + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * per_layer + h + head

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward) = 6·N_matmul + 12·L·h·s.

        N_matmul counts the parameters used in a matmul: every Linear including lm_head, not the embedding
        lookup and not the norm weights. The attention term counts the full s×s score matrix (PaLM's
        convention), although causal kernels skip about half of it."""
        h, L = self.hidden_size, self.num_hidden_layers
        n_matmul = self.num_params(active=True) - (2 * L + 1) * h  # with experts: the k a token passes through
        if not self.tie_word_embeddings:
            n_matmul -= self.vocab_size * h
        return 6 * n_matmul + 12 * L * h * seq_len

    def to_dict(self) -> dict:
        """The Hugging Face `config.json` of this model (LlamaForCausalLM, or MixtralForCausalLM with experts)."""
        moe = ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "capacity_factor")
        d = {k: v for k, v in asdict(self).items() if k != "attn_impl" and (self.is_moe or k not in moe)}
        d.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                 head_dim=self.head_dim, attention_bias=False, mlp_bias=False,
                 rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta})  # transformers >= 5
        if self.is_moe:
            for k in ("attention_bias", "mlp_bias"):
                del d[k]
            d.update(architectures=["MixtralForCausalLM"], model_type="mixtral", output_router_logits=False,
                     router_jitter_noise=0.0, sliding_window=None)
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        """Read a Hugging Face `config.json` of a LlamaForCausalLM or MixtralForCausalLM as transformers 4 or 5
        writes it: an absent or null key means what it means to transformers (HF_DEFAULTS; a null
        num_key_value_heads or head_dim is derived from the head count); a field we cannot honour is refused."""
        model_type = d.get("model_type") or ("mixtral" if "num_local_experts" in d else "llama")
        if model_type not in HF_DEFAULTS:
            raise ValueError(f"unsupported config: model_type={model_type!r}, but picotron reads only 'llama' and "
                             f"'mixtral' configs (other families differ in ways their config.json does not spell out).")
        defaults = HF_DEFAULTS[model_type]
        c = {**defaults, **{k: v for k, v in d.items() if k in defaults and v is not None}}
        if c["num_key_value_heads"] is None or ("num_key_value_heads" in d and d["num_key_value_heads"] is None):
            c["num_key_value_heads"] = c["num_attention_heads"]  # what LlamaConfig (and Mixtral in 4.x) do with null
        h, a, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        ropes = [r for r in (d.get("rope_parameters"), d.get("rope_scaling")) if r]  # transformers 5, 4
        theta = next((r["rope_theta"] for r in ropes if r.get("rope_theta") is not None), c["rope_theta"])
        partial = next((r["partial_rotary_factor"] for r in (*ropes, d) if r.get("partial_rotary_factor") is not None),
                       1)
        head_dim = d.get("head_dim")
        # MixtralConfig has no attention_bias/mlp_bias: transformers ignores them there, and so do we
        biases = [k for k in ("attention_bias", "mlp_bias") if d.get(k)] if model_type == "llama" else []
        problems = [f"rope_type={t!r}, but picotron has only plain RoPE (rope_type 'default'); its frequencies differ "
                    f"from that scaling's, so load a checkpoint without rope scaling"
                    for t in {r.get("rope_type", r.get("type", "default")) for r in ropes} if t != "default"]
        problems += [
            f"partial_rotary_factor={partial}, but picotron rotates the whole head (factor 1)" if partial != 1 else "",
            f"hidden_act={d['hidden_act']!r}, but picotron's MLP is SwiGLU ('silu' only)"
            if d.get("hidden_act", "silu") != "silu" else "",
            f"{' and '.join(f'{k}=true' for k in biases)}, but picotron's Linear layers have no bias" if biases else "",
            f"hidden_size={h} is not a multiple of num_attention_heads={a}" if h % a else "",
            f"head_dim={head_dim}, but picotron's attention always has head_dim = hidden_size/num_attention_heads = "
            f"{h}/{a} = {h // a}, so it can load only checkpoints where the two agree"
            if head_dim is not None and not h % a and head_dim != h // a else "",
            f"num_attention_heads={a} is not a multiple of num_key_value_heads={kv} (each KV head serves a whole "
            f"number of query heads)" if a % kv else "",
            f"sliding_window={d['sliding_window']}, but picotron has only full causal attention (equal only when no "
            f"sequence is longer than the window: then set it to null)" if d.get("sliding_window") is not None else "",
            f"attention_dropout={d['attention_dropout']}, but picotron has no dropout; set it to 0.0 (inference does "
            f"not use it)" if d.get("attention_dropout") else "",
            f"router_jitter_noise={d['router_jitter_noise']}, but picotron's router has no noise; set it to 0.0 "
            f"(inference does not use it)" if d.get("router_jitter_noise") else "",
            "quantization_config is set, but picotron loads only unquantized weights" if d.get("quantization_config")
            else "",
        ]
        if any(problems):
            raise ValueError(f"unsupported {model_type} config: {'; '.join(p for p in problems if p)}.")
        c["rope_theta"] = float(theta)
        c["rms_norm_eps"], c["initializer_range"] = float(c["rms_norm_eps"]), float(c["initializer_range"])
        c["tie_word_embeddings"] = bool(c["tie_word_embeddings"])
        if model_type == "mixtral" and d.get("capacity_factor") is not None:  # picotron's own key (save_hf writes it)
            c["capacity_factor"] = float(d["capacity_factor"])
        return cls(**c)


# What a key that config.json leaves out means: the defaults of transformers' LlamaConfig and MixtralConfig, the
# same in transformers 4 and 5 (tests/test_hf_files.py checks them against the installed version).
_HF_COMMON = dict(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                  rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.02)
HF_DEFAULTS = {
    "llama": dict(_HF_COMMON, intermediate_size=11008, num_key_value_heads=None, max_position_embeddings=2048,
                  rms_norm_eps=1e-6),
    "mixtral": dict(_HF_COMMON, intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=4096 * 32,
                    rms_norm_eps=1e-5, rope_theta=1e6, num_local_experts=8, num_experts_per_tok=2,
                    router_aux_loss_coef=0.001),
}

PRESETS = {
    # Lessons and tests: byte-level vocabulary, fast on a laptop CPU.
    "tiny": dict(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024),
    # HuggingFaceTB/SmolLM-{135M,360M,1.7B} (tied embeddings), meta-llama/Meta-Llama-3-8B (untied).
    "smollm-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                        tie_word_embeddings=True),
    "smollm-360m": dict(vocab_size=49152, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                        num_attention_heads=15, num_key_value_heads=5, max_position_embeddings=2048,
                        tie_word_embeddings=True),
    "smollm-1.7b": dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048,
                        tie_word_embeddings=True),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0),
    # Mixture of experts: the tiny model with 4 experts of half the MLP width, 2 per token (lessons, tests);
    # mistralai/Mixtral-8x7B-v0.1 (46.7 B parameters, 12.9 B active).
    "tiny-moe": dict(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                     num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01),
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                         rope_theta=1e6, num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.02),
    # Large models for the planner (python -m picotron.plan): meta-llama/Meta-Llama-3-70B and Llama 3.1 405B (the
    # Llama 3 paper, Table 3; pre-trained at 8K tokens: 3.1's longer context uses a RoPE scaling we do not model).
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
                       rope_theta=500000.0),
    "llama3-405b": dict(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                        num_attention_heads=128, num_key_value_heads=8, max_position_embeddings=8192,
                        rope_theta=500000.0),
    # BLOOM-176B's size as a Llama (bigscience/bloom: h 14336, 70 layers, 112 heads, vocabulary 250,880, tied): BLOOM
    # has ALiBi instead of RoPE, LayerNorms with biases (and one after the embedding) and a 4h GELU MLP; here a SwiGLU
    # of i = 8h/3 has the same 8h² parameters and FLOPs, so 176.2 B parameters against BLOOM's 176.25 B.
    "bloom-176b": dict(vocab_size=250880, hidden_size=14336, intermediate_size=38229, num_hidden_layers=70,
                       num_attention_heads=112, num_key_value_heads=112, max_position_embeddings=2048,
                       tie_word_embeddings=True),
}


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


class Llama(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.recompute = "none"  # "none" | "selective" | "full"; set by the trainer
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = Layers((i, DecoderLayer(config)) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self):
        """Make lm_head share the embedding matrix when the config says so (to_empty unties: we re-tie)."""
        if self.config.tie_word_embeddings and self.lm_head is not None and self.embed_tokens is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def to_empty(self, *, device, recurse: bool = True):
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return self

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
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute={self.recompute!r}; use 'none', 'selective' or 'full'.")
        x = input_ids if self.embed_tokens is None else self.embed_tokens(input_ids)
        for layer in self.layers:
            if self.recompute == "full":  # keep only each layer's input; redo the layer in backward
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
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
        """Fill every parameter from `init_tensor(name, shape, seed, std)`: norms 1, the rest normal."""
        self.tie_weights()
        for name, p in self.named_parameters():  # a tied lm_head.weight is skipped: it is embed_tokens
            where = marks.placement(p)  # a slice (tensor parallelism) draws the full tensor and keeps its part
            if name.endswith("norm.weight"):
                full = torch.ones(where.shape)
            else:
                full = init_tensor(name, where.shape, seed, self.init_std(name))
            p.copy_(where.take(full, p.shape))
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
