"""Lesson 01 exercises: write each function, then run the checker
    ./run.sh python lessons/01_single_device/check.py                      # all exercises
    ./run.sh python lessons/01_single_device/check.py count_parameters     # just one
It runs your function on several inputs against the reference (and against measurement) and says what is
off; for the puzzle, plan_step, it also runs your choice for a couple of steps on the CPU. The lesson notebook (lessons/01_single_device/01_single_device.ipynb) has everything you need; the solutions are in solution.py
(look after trying).
"""
import torch
import torch.nn.functional as F

from experiment import peak_bound  # noqa: F401  (this folder's experiment.py, section 4b; for plan_step)


def count_parameters(cfg) -> int:
    """Exact number of parameters of picotron's Llama for `cfg` (a picotron.model.ModelConfig), computed
    from the shapes alone (do not build the model).

    Per layer: q_proj, k_proj, v_proj, o_proj (no biases; with grouped-query attention K and V have
    cfg.num_key_value_heads * cfg.head_dim outputs), a SwiGLU MLP (gate_proj, up_proj, down_proj) and two
    RMSNorm weight vectors. Plus the embedding, the final norm and lm_head, which shares the embedding's
    matrix when cfg.tie_word_embeddings is True."""
    raise NotImplementedError("not written yet")


def model_state_bytes(n_params, dtype="fp32", optimizer="adamw") -> dict:
    """Bytes of the model states of the textbook recipe, as {"params": ..., "grads": ..., "optimizer": ...}.

    dtype "fp32": everything in fp32. dtype "bf16": mixed precision with bf16 params and grads, and an fp32
    master copy of the weights kept by the optimizer. optimizer "adamw" keeps two fp32 moments per
    parameter; "sgd" (no momentum) keeps none."""
    raise NotImplementedError("not written yet")


def activation_bytes_per_layer(cfg, seq_len, micro_batch_size) -> int:
    """Bytes autograd saves for backward in ONE decoder layer of picotron's Llama, fp32, no recomputation,
    for cfg.attn_impl "sdpa" (flash-style kernel) or "eager" (explicit softmax). Do not count parameters,
    count a tensor shared by several ops once, and leave out the RoPE cos/sin tables (one pair for the
    whole model). Hint: the saved-tensor table of the lesson, section 2."""
    raise NotImplementedError("not written yet")


def accumulate_gradients(model, input_ids, targets, k) -> float:
    """Gradient accumulation. Split the batch (input_ids, targets: [B, s], B divisible by k) into k
    micro-batches; run forward and backward on each so that afterwards every p.grad equals the gradient
    of the mean cross-entropy over the WHOLE batch (p.grad starts as None). Return that mean loss (float).
    The loss of one micro-batch: F.cross_entropy(logits.float().view(-1, vocab), targets.reshape(-1))."""
    raise NotImplementedError("not written yet")


def plan_step(model_config, seq_len, global_batch, budget_bytes) -> dict:
    """The puzzle. One training step of `model_config` (fp32, AdamW, one device) on `global_batch` sequences of
    `seq_len` tokens must fit in `budget_bytes` of device memory, at the highest throughput. Choose
    {"micro_batch_size": b, "grad_acc": m, "recompute": "none" | "selective" | "full"}.

    - The global batch is fixed: b * m == global_batch.
    - It fits when peak_bound(model_config, seq_len, b, "fp32", recompute) <= budget_bytes: the planner's count
      plus the backward's working set, the bound section 4b checks against the allocator. (The checker also
      runs your choice and measures the allocator's peak.)
    - The fastest choice that fits repeats the least work: recomputation first ("none" < "selective" <
      "full": each re-runs more of the forward during the backward), then the fewest micro-batches (each is
      another pass over all the weights with smaller matmuls).
    Precision is not part of the choice: on a CPU bf16 may be slower than fp32 (section 4e).
    Return None if nothing fits."""
    raise NotImplementedError("not written yet")


def phase_ms(trace) -> dict:
    """Read a trace that `picotron.train --profile A:B` wrote (section 4h): `trace` is the dict json.load gives for
    OUT/traces/rank0.json. Return {phase: milliseconds} of picotron's phases summed over the profiled steps, a phase
    being a range's name up to its " mb=" (so "forward mb=0" and "forward mb=1" both count as "forward"): "forward",
    "backward", "wait", "clip grad norm", "optimizer step". Only complete events ("ph" == "X") that are ranges
    someone named ("cat" == "user_annotation": torch's own operators have other categories) count; leave out the
    "step N" ranges and the marker "picotron: profile start". Times in a trace ("ts", "dur") are microseconds."""
    raise NotImplementedError("not written yet")
