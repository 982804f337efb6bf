"""The model's shape: `ModelConfig` (Hugging Face Llama / Mixtral field names) and the named `PRESETS`.

A leaf: no torch, nothing else of picotron, so the command line (picotron.config) can name the presets, and
resolve a run's model, before torch is imported. `picotron.model` builds the network from a ModelConfig.
"""
from dataclasses import asdict, dataclass


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
    # DeepSeek-V3's router and experts (arXiv:2412.19437 §2.1), in its Hugging Face names (DeepseekV3Config)
    scoring_func: str = "softmax"  # "sigmoid": affinities s_i = sigmoid(u·e_i), gates = the chosen s_i / their sum
    n_shared_experts: int = 0  # experts every token passes through (DeepSeekMoE), besides its k routed ones
    moe_intermediate_size: int = 0  # each expert's hidden size (fine-grained: smaller); 0 = intermediate_size
    routed_scaling_factor: float = 1.0  # the routed experts' gates multiplied by it (DeepSeek-V3: 2.5)
    bias_update_speed: float = 0.0  # γ > 0: aux-loss-free balancing (topk_method "noaux_tc"), a per-expert bias
    # added to the scores for the choice only, moved by ±γ after each step (the report: 0.001); not an HF field

    @property
    def expert_size(self) -> int:
        """The hidden size of one expert (routed or shared)."""
        return self.moe_intermediate_size or self.intermediate_size

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
        """Parameters of one layer's feed-forward: 3·h·i dense; (E + N_s)·3·h·i + E·h (router) with E routed and
        N_s shared experts of hidden size i, or with active=True only the k routed experts a token passes
        through (and the shared ones, and the router)."""
        if not self.is_moe:
            return 3 * self.hidden_size * self.intermediate_size
        expert = 3 * self.hidden_size * self.expert_size
        return ((self.num_experts_per_tok if active else self.num_local_experts) + self.n_shared_experts) * expert \
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
        moe = ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "capacity_factor") + DEEPSEEK
        d = {k: v for k, v in asdict(self).items() if k != "attn_impl" and (self.is_moe or k not in moe)}
        if self.is_moe:  # DeepSeek's fields only where they differ from Mixtral's routing (picotron's own keys there)
            d = {k: v for k, v in d.items() if k not in DEEPSEEK or v != getattr(ModelConfig, k)}
            if self.bias_update_speed:
                d["topk_method"] = "noaux_tc"
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
        if model_type == "mixtral":  # picotron's own keys (save_hf writes them): capacity, DeepSeek-V3's routing
            c.update({k: type(getattr(cls, k))(d[k]) for k in ("capacity_factor",) + DEEPSEEK if d.get(k) is not None})
        return cls(**c)


# DeepSeek-V3's routing fields: written into a Mixtral config.json only when set (transformers' Mixtral ignores them,
# so such a model's logits are picotron's alone: Mixtral routes by softmax, without shared experts)
DEEPSEEK = ("scoring_func", "n_shared_experts", "moe_intermediate_size", "routed_scaling_factor", "bias_update_speed")

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
    # DeepSeek-V3's MoE at the tiny size (its report §2.1.2; DeepSeekMoE for the shared and fine-grained experts):
    # 8 routed experts of a quarter of the MLP width, 3 per token, plus 1 shared: 4 x 96 = 384 active, like tiny-moe's
    # 2 x 192; sigmoid affinities, balanced by the bias update (γ = 0.001), no auxiliary loss.
    "tiny-deepseek-moe": dict(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                              num_local_experts=8, num_experts_per_tok=3, router_aux_loss_coef=0.0,
                              scoring_func="sigmoid", n_shared_experts=1, moe_intermediate_size=96,
                              bias_update_speed=0.001),
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
