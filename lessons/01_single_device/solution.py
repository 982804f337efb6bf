"""Lesson 01, reference solutions. Try lessons/01_single_device/exercise.py first, then compare:
    ./run.sh python lessons/01_single_device/check.py                 # checks your file
    ./run.sh python lessons/01_single_device/check.py --solutions     # checks this one
"""
import torch.nn.functional as F

from experiment import peak_bound  # this folder's experiment.py: the planner's count + the backward's working set


def count_parameters(cfg) -> int:
    """Exact parameter count of picotron's Llama for a ModelConfig."""
    h, i, v, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * cfg.head_dim        # K and V width: fewer heads than Q with GQA
    attention = h * h + 2 * h * kv + h * h              # q_proj, k_proj + v_proj, o_proj (no biases)
    mlp = 3 * h * i                                     # SwiGLU: gate_proj, up_proj, down_proj
    norms = 2 * h                                       # input_layernorm, post_attention_layernorm
    embedding = v * h
    lm_head = 0 if cfg.tie_word_embeddings else v * h   # tied: the same matrix as the embedding
    return embedding + L * (attention + mlp + norms) + h + lm_head  # + h: the final norm


def model_state_bytes(n_params, dtype="fp32", optimizer="adamw") -> dict:
    """Textbook bytes of the model states: {"params", "grads", "optimizer"}.

    fp32: params 4, grads 4, Adam moments 8 per parameter. bf16 mixed precision: params 2, grads 2, and
    the optimizer holds an fp32 master copy (4) besides the moments. SGD (no momentum) has no moments."""
    moments = 8 if optimizer == "adamw" else 0
    if dtype == "fp32":
        return {"params": 4 * n_params, "grads": 4 * n_params, "optimizer": moments * n_params}
    return {"params": 2 * n_params, "grads": 2 * n_params, "optimizer": (4 + moments) * n_params}


def activation_bytes_per_layer(cfg, seq_len, micro_batch_size) -> int:
    """Bytes autograd saves for ONE decoder layer in fp32 without recomputation (cfg.attn_impl sdpa|eager)."""
    s, b, h, i, a = seq_len, micro_batch_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    kv = cfg.num_key_value_heads * cfg.head_dim
    norm = 4 * s * b * h + 4 * s * b + 4 * s * b * h      # input x, rstd, x * rstd
    qkv_input = 4 * s * b * h                            # one tensor, shared by q_proj, k_proj, v_proj
    if cfg.attn_impl == "sdpa":                          # q, k, v after RoPE + output + logsumexp
        core = 4 * s * b * (h + 2 * kv) + 4 * s * b * h + 4 * a * s * b
    else:                                                # q, k and v repeated to a heads, mask, softmax,
        core = 4 * 4 * s * b * h + s * s + 4 * a * s * s * b  # and a copy of the output for o_proj
    mlp = 4 * s * b * h + 4 * 4 * s * b * i              # shared input; gate, silu(gate), up, product
    return 2 * norm + qkv_input + core + mlp


def accumulate_gradients(model, input_ids, targets, k) -> float:
    """Split the batch into k micro-batches and accumulate gradients in p.grad so that they equal the
    gradients of the mean cross-entropy over the whole batch. Returns the whole batch's mean loss."""
    total = 0.0
    for x, y in zip(input_ids.chunk(k), targets.chunk(k)):
        logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1)) / k
        loss.backward()                                  # adds into p.grad: no zero_grad in between
        total += loss.item()
    return total


def plan_step(model_config, seq_len, global_batch, budget_bytes) -> dict:
    """The fastest choice that fits: the least recomputation, then the biggest micro-batch (fewest passes)."""
    sizes = sorted((b for b in range(1, global_batch + 1) if global_batch % b == 0), reverse=True)
    for recompute in ("none", "selective", "full"):      # recomputation repeats work: as little as we can
        for b in sizes:                                  # then as few micro-batches as fit
            if peak_bound(model_config, seq_len, b, "fp32", recompute) <= budget_bytes:
                return {"micro_batch_size": b, "grad_acc": global_batch // b, "recompute": recompute}
    return None                                          # not even micro-batch 1 with full recomputation


def phase_ms(trace) -> dict:
    """The named ranges of the trace, by phase, in ms (a trace counts microseconds)."""
    out = {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e.get("cat") != "user_annotation":
            continue  # metadata, flows, and torch's operators (cpu_op, kernel, ...)
        name = e["name"]
        if name.startswith("step ") or name == "picotron: profile start":
            continue
        phase = name.split(" mb=")[0]
        out[phase] = out.get(phase, 0.0) + e["dur"] / 1e3
    return out
