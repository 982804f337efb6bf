"""How many bytes does one training step hold? A memory model you can check against the measurement.

Lesson 01 builds this model for ONE device; later lessons divide its terms by the parallel degrees.
Notation: Ψ parameters, L layers, h hidden size, a attention heads, k KV heads, d = h/a head dim,
i intermediate (MLP) size, v vocabulary, s sequence length, b micro-batch size, p bytes of one activation
element (4 in fp32, 2 under bf16 autocast).

Model states (what lives for the whole run)
-------------------------------------------
Our trainer keeps the parameters, their gradients and AdamW's two moments in fp32, whatever --dtype says:

    params 4Ψ + grads 4Ψ + AdamW (exp_avg, exp_avg_sq) 8Ψ = 16Ψ     (+ 4 bytes per tensor: Adam's step)

The textbook mixed-precision recipe (ZeRO paper; docs/reference.md#model-states) holds bf16 params and grads
plus an fp32 master copy: 2Ψ + 2Ψ + (4 + 8)Ψ = 16Ψ, the same total (`model_state_bytes`). Mixed precision does
not shrink the model states; it shrinks activations and speeds up the matmuls.

Activations (what autograd keeps from forward for backward)
-----------------------------------------------------------
Listing the tensors autograd saves in one decoder layer (lesson 01 does it with saved-tensor hooks,
`metrics.ActivationCounter`) gives, per layer, with sdpa attention and no recomputation:

    input_layernorm           x, x·rstd (fp32: the residual stream is fp32)   8sbh + 4sb (rstd)
    q/k/v_proj inputs         the normed x: one tensor in fp32, one bf16 cast per Linear under autocast
                                                                   fp32 4sbh | bf16 3·2sbh
    RoPE                      cos, sin [s, d] (fp32: shared by all layers; bf16: 4 casts per layer, 8sd)
    sdpa (flash-style)        q, k, v after RoPE, output, logsumexp   p·sbh·(2 + 2k/a) + 4asb
    o_proj input              the sdpa output itself (a view): 0
    post_attention_layernorm  as input_layernorm                    8sbh + 4sb
    mlp                       gate/up input (fp32 4sbh | bf16 2·2sbh), gate out, silu out, up out,
                              down input                          + 4·p·sbi
    autocast weight copies    bf16 only: the bf16 copy of every weight is saved for backward: 2 bytes per
                              matmul parameter (this IS the "2Ψ bf16 params" of the textbook recipe)

With attn_impl="eager" the attention core instead saves q (p·sbh), k and v repeated to all a heads
(2p·sbh), the causal mask (s² bytes), the fp32 softmax output (4·a·s²·b), under bf16 its bf16 copy
(2·a·s²·b), and a copy of the output for o_proj (p·sbh): the s² terms that flash kernels never store
(they recompute the scores in backward from q, k, v and the logsumexp).

Recomputation: "selective" checkpoints the attention core, so it keeps only its inputs (q, k, v before
RoPE: p·sbh(1 + 2k/a)) and o_proj keeps the core's output (p·sbh); "full" checkpoints whole layers and
keeps only each layer's input (4sbh, fp32 residual); "partitioned" (ZeRO-R's partitioned activation
checkpointing, Rajbhandari et al. 2020 §6.1) keeps 1/t of that input on each tp rank and all-gathers it before the
layer's recompute (plan.step_time adds the all-gather).

Outside the layers: the token ids (8b(s+1): they are a view of the loader's (s+1)-token windows, so whole
rows stay alive), the final norm (8sbh + 4sb), the lm_head input (p·sbh; bf16 also its weight copy 2vh),
the fp32 log-softmax (4sbv), the targets (8sb) and the loss's 4-byte normaliser.

This is exact for our code on this torch version (tests/test_lesson01.py checks it against the counter).
Korthikanti et al. (2022) count 34·sbh + 5·a·s²·b bytes per layer for GPT-3 in pure bf16 with dropout;
`korthikanti_bytes_per_layer` gives that, and lesson 01 explains each difference.
"""
import math

from picotron.config import CP_IMPLS, PP_SCHEDULES, RECOMPUTE  # what the planner models: the trainer's own

BYTES = {"fp32": 4, "bf16": 2}


def _check(dtype, recompute, optimizer="adamw"):
    if dtype not in BYTES:
        raise ValueError(f"dtype={dtype!r}; use 'fp32' or 'bf16'.")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}; use one of {RECOMPUTE}.")
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer={optimizer!r}; use 'adamw' or 'sgd'.")


def param_tensors(mc) -> int:
    """Number of parameter tensors: 7 matrices + 2 norm vectors per layer, embedding, final norm, lm_head."""
    return 9 * mc.num_hidden_layers + 2 + (0 if mc.tie_word_embeddings else 1)


def matmul_params_per_layer(mc) -> int:
    """Weights of one layer's seven Linear layers: 2h² + 2h·k·d + 3·h·i."""
    h, kv = mc.hidden_size, mc.num_key_value_heads * mc.head_dim
    return 2 * h * h + 2 * h * kv + 3 * h * mc.intermediate_size


def model_state_bytes(n_params, dtype="fp32", optimizer="adamw", tensors=0):
    """The textbook bytes of model states by the parameters' dtype: fp32 4+4+8; bf16 (or fp16) mixed precision
    2+2+(4 master + 8). `tensors`: parameter tensors, each with AdamW's 4-byte step counter (what our trainer holds
    on top; 0 leaves them out, as the textbook does)."""
    if dtype not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"dtype={dtype!r}; use 'fp32', 'bf16' or 'fp16'.")
    _check("fp32", "none", optimizer)
    P, G, K = RECIPES["ours" if dtype == "fp32" else "mixed"]
    if optimizer != "adamw":  # plain SGD keeps no moments (nor a step counter), only the master copy
        K, tensors = K - 8, 0
    return {"params": P * n_params, "grads": G * n_params, "optimizer": K * n_params + 4 * tensors}


def zero_model_state_bytes(n_params, zero=0, n=1, dtype="fp32", recipe="ours"):
    """Model-state bytes per rank under ZeRO stage `zero` over n data-parallel ranks (ZeRO paper, fig. 1):

        stage 0 (DP)  P + G + K        stage 1  P + G + K/n        stage 2  P + (G + K)/n    stage 3  (P + G + K)/n

    recipe "ours": P = G = 4Ψ (fp32 parameters are their own master copy), K = 8Ψ (AdamW's two moments).
    recipe "mixed": the textbook mixed precision (docs/reference.md#model-states), P = G = 2Ψ, K = 12Ψ (fp32
    master + moments).
    Padding (each unit rounded up to a multiple of n elements) and Adam's 4-byte step counters come on top."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero!r}; use 0, 1, 2 or 3.")
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r}; use one of {', '.join(RECIPES)}.")
    P, G, K = (x * n_params for x in RECIPES[recipe])
    return {"params": P / n if zero >= 3 else P, "grads": G / n if zero >= 2 else G, "optimizer": K / n if zero >= 1 else K}


def zero_comm_elements(n_params, zero=0, root_params=0):
    """Elements covered by the collectives of one optimizer step (one micro-batch), per rank, in units of
    whole buffers: DP all-reduces Ψ, which a ring does as a reduce-scatter plus an all-gather, so 2Ψ; ZeRO-1
    and -2 reduce-scatter the gradients and all-gather the updated parameters: 2Ψ; ZeRO-3 all-gathers the
    parameters for the forward and again for the backward and reduce-scatters the gradients: 3Ψ, minus the
    root unit's second all-gather (it stays gathered from forward to backward). A ring sends (n-1)/n of each."""
    if zero == 3:
        return {"all_gather": 2 * n_params - root_params, "reduce_scatter": n_params}
    return {"all_gather": n_params, "reduce_scatter": n_params}


# --- Muon, distributed (issue 44): what a sharded matrix costs to orthogonalise (picotron.muon) ----------------
def owner_of(sizes, n):
    """Muon's owner impl: the rank (0..n-1) that orthogonalises each matrix, given their `sizes` (elements).
    Largest first, each to the least-loaded rank so far (ties: the lowest rank): the longest-processing-time rule,
    so every rank's Newton–Schulz work is about 1/n of the whole. The same answer on every rank: no message."""
    load, owner = [0] * n, [0] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        r = min(range(n), key=lambda r: (load[r], r))
        owner[k], load[r] = r, load[r] + sizes[k]
    return owner


def muon_ns_flops(shape, steps=5):
    """FLOPs of Newton–Schulz on one A x B matrix (m = min, k = max): per iteration X X^T (2m²k), S² (2m³) and
    (bS + cS²) X (2m²k), the additions left out: steps · (4m²k + 2m³)."""
    m, k = min(shape), max(shape)
    return steps * (4 * m * m * k + 2 * m ** 3)


def muon_bytes_per_step(impl, units, n=1, tp=1, rank=0, elem=4):
    """Bytes of Muon's exchange in one optimizer step, per rank: {"buffers": {kind: whole buffers, what
    metrics.Recorder counts}, "sent": bytes this rank sends}. (picotron.muon.Exchange; Liu et al. 2025, section 2.3.)

    `units`: ZeRO's units in order (ZeRO-1/2's buckets, ZeRO-3's layers), each a list of (elements of this rank's
    local tensor, is a Muon matrix, is cut over tp) per parameter; without ZeRO one unit of them all and n = 1.
    `n`: ZeRO's group; `tp`: the tp degree; `rank`: this rank's index on the axis the matrices are cut over. One ZeRO
    axis: with experts (ep) their units are cut over edp, another group, which this formula does not model apart.

        gather  ZeRO: all-gather each unit holding a Muon matrix, padded to a multiple of n (U):  buffer U, sends (n-1)/n U
                tp: all-gather each matrix cut over tp, of full size M:                          buffer M, sends (tp-1)/tp M
        owner   one axis (ZeRO's n, or tp): all-to-all this rank's pieces to their owners (buffer: all its pieces
                of Muon matrices, ~Ψ_muon/n), then all-to-all the owner's results back (buffer: the matrices it owns,
                ~Ψ_muon/n): ~2Ψ_muon/n, against gather's ~Ψ. Owners from `owner_of` by size.
    """
    buffers, sent = {}, 0.0

    def add(kind, buffer, out):
        nonlocal sent
        buffers[kind] = buffers.get(kind, 0) + buffer * elem
        sent += out * elem
    if impl == "gather":
        for unit in units:
            if n > 1 and any(muon for _, muon, _ in unit):
                padded = max(1, math.ceil(sum(e for e, _, _ in unit) / n)) * n
                add("all_gather", padded, (n - 1) / n * padded)
        for unit in units:
            for e, muon, cut in unit:
                if muon and cut and tp > 1:
                    add("all_gather", e * tp, (tp - 1) * e)
        return {"buffers": buffers, "sent": sent}
    if impl != "owner":
        raise ValueError(f"impl={impl!r}; use 'gather' or 'owner'.")
    if n > 1:  # pieces of ZeRO's flat units: rank r holds [r·chunk, (r+1)·chunk) of each unit
        mine, full = [], []
        for unit in units:
            chunk, off = max(1, math.ceil(sum(e for e, _, _ in unit) / n)), 0
            for e, muon, _ in unit:
                if muon:
                    mine.append(max(0, min((rank + 1) * chunk, off + e) - max(rank * chunk, off)))
                    full.append(e)
                off += e
    elif tp > 1:  # tp slices: equal pieces of every cut matrix
        mine = [e for unit in units for e, muon, cut in unit if muon and cut]
        full = [e * tp for e in mine]
    else:
        return {"buffers": buffers, "sent": sent}
    owner = owner_of(full, n if n > 1 else tp)
    if full:
        add("all_to_all", sum(mine), sum(m for m, o in zip(mine, owner) if o != rank))
        owned = [(m, f) for m, f, o in zip(mine, full, owner) if o == rank]
        add("all_to_all", sum(f for _, f in owned), sum(f - m for m, f in owned))
    return {"buffers": buffers, "sent": sent}


# --- HSDP (issue 43): the bytes on each link of a hybrid-sharded step ------------------------------------------
def hsdp_bytes_per_step(n_params, zero, n_shard, n_replicate, root_params=0, elem=4, pipeline=False):
    """Bytes one rank SENDS in one optimizer step (one micro-batch) of ZeRO-`zero` under HSDP, per axis:
    {"dp_shard": ..., "dp_replicate": ...}, and the collectives' whole buffers ("buffers", nccl-tests' N, what
    metrics.Recorder counts). ZeRO's collectives run within the shard group of n_s = `n_shard` ranks (a ring sends
    (n_s-1)/n_s of each buffer: zero_comm_elements' reduce-scatter Ψ and all-gathers Ψ, or 2Ψ - root for ZeRO-3);
    then each rank's gradient shard, Ψ/n_s, is all-reduced over the n_r = `n_replicate` replicas (a ring sends
    2(n_r-1)/n_r of it):

        dp_shard      (n_s-1)/n_s · (RS Ψ + AG Ψ | 2Ψ - root) · elem      the fast links (within a node)
        dp_replicate  2(n_r-1)/n_r · Ψ/n_s · elem                         the slow links (across nodes)

    `pipeline`: ZeRO-3 under a pipeline keeps each unit gathered through the step, one all-gather of Ψ (picotron.zero3).
    n_s = dp·cp (n_r = 1) is plain ZeRO; n_s = 1 is plain data parallelism's all-reduce. Ψ as the units hold it
    (each padded to a multiple of n_s) makes it exact. (torchtitan's HSDP, FSDP's hybrid sharding: Zhao et al.
    2023, "PyTorch FSDP", section 3.2.)"""
    shard = zero_comm_elements(n_params, 1 if pipeline else zero, root_params)
    chunk = n_params / n_shard
    buffers = {"dp_shard": {k: v * elem for k, v in shard.items() if n_shard > 1},
               "dp_replicate": {"all_reduce": chunk * elem} if n_replicate > 1 else {}}
    return {"dp_shard": (n_shard - 1) / n_shard * sum(shard.values()) * elem,
            "dp_replicate": 2 * (n_replicate - 1) / n_replicate * chunk * elem, "buffers": buffers}


def activation_terms_per_layer(mc, seq_len, micro_batch_size, dtype="fp32", recompute="none"):
    """Bytes one decoder layer keeps for backward, by part (see the module docstring). Exact for our code."""
    _check(dtype, recompute)
    s, b, h, i, a = seq_len, micro_batch_size, mc.hidden_size, mc.intermediate_size, mc.num_attention_heads
    kvd = mc.num_key_value_heads * mc.head_dim  # K and V have k·d = h·k/a features (GQA: fewer than Q)
    p, bf16 = BYTES[dtype], dtype == "bf16"
    sbh, sb = s * b * h, s * b
    if recompute in ("full", "partitioned"):  # partitioned: the same checkpoint, cut over tp (_layer_activations)
        return {"layer input (checkpoint)": 4 * sbh}
    norm = 8 * sbh + 4 * sb
    qkv_in = 3 * 2 * sbh if bf16 else 4 * sbh
    rope = 4 * 2 * s * mc.head_dim if bf16 else 0  # fp32 cos/sin are shared by all layers: see model_level
    if recompute == "selective":
        core = p * sb * (h + 2 * kvd) + p * sbh  # q, k, v before RoPE + the core's output
        rope = 0  # the bf16 casts of cos/sin now happen inside the checkpoint
    elif mc.attn_impl in ("sdpa", "flash"):  # both save q, k, v, the output and an fp32 log-sum-exp per row
        core = p * sb * (2 * h + 2 * kvd) + 4 * a * sb  # q, k, v after RoPE, output; fp32 logsumexp
    elif mc.attn_impl == "eager":
        core = 4 * p * sbh + s * s + 4 * a * s * s * b + (2 * a * s * s * b if bf16 else 0)
    else:
        raise ValueError(f"attn_impl={mc.attn_impl!r}; use 'sdpa', 'flash' or 'eager'.")
    terms = {
        "input_layernorm": norm,
        "self_attn": qkv_in + rope + core,
        "post_attention_layernorm": norm,
        "mlp": (2 * 2 * sbh if bf16 else 4 * sbh) + 4 * p * s * b * i,
    }
    if bf16:
        terms["bf16 weight copies"] = 2 * matmul_params_per_layer(mc)
    return terms


def activation_bytes_per_layer(mc, seq_len, micro_batch_size, dtype="fp32", recompute="none") -> int:
    return sum(activation_terms_per_layer(mc, seq_len, micro_batch_size, dtype, recompute).values())


def model_level_activation_bytes(mc, seq_len, micro_batch_size, dtype="fp32", recompute="none") -> int:
    """Bytes kept outside the decoder layers: ids, RoPE tables, final norm, lm_head, loss."""
    s, b, h, v = seq_len, micro_batch_size, mc.hidden_size, mc.vocab_size
    bf16 = dtype == "bf16"
    rope_shared = 0 if (bf16 and recompute == "none") else 2 * s * mc.head_dim * 4
    lm_head = (2 * s * b * h + 2 * v * h) if bf16 else 4 * s * b * h
    ids = 8 * b * (s + 1)  # int64 ids: a view of the loader's (s+1)-token windows keeps whole rows alive
    return ids + rope_shared + (8 * s * b * h + 4 * s * b) + lm_head + 4 * s * b * v + 8 * s * b + 4


def activation_bytes(mc, seq_len, micro_batch_size, dtype="fp32", recompute="none") -> int:
    """All bytes autograd keeps for backward in one forward of the whole model and its loss."""
    return (mc.num_hidden_layers * activation_bytes_per_layer(mc, seq_len, micro_batch_size, dtype, recompute)
            + model_level_activation_bytes(mc, seq_len, micro_batch_size, dtype, recompute))


def korthikanti_bytes_per_layer(seq_len, micro_batch_size, hidden_size, num_heads, recompute="none", tp=1, sp=False,
                                flash=False):
    """Korthikanti et al. 2022 (GPT, pure bf16, dropout, 4h MLP), per layer and rank: sbh(34 + 5as/h); selective
    drops the s² term, and so does flash=True (the s x s scores are never stored); full keeps 2sbh (the layer input).
    With tensor parallelism over tp ranks sbh(10 + 24/tp + 5as/(h·tp)), and with sp as well sbh/tp·(34 + 5as/h)
    (their Table 2); full recomputation with sp keeps 2sbh/tp."""
    s, b, h, a, t = seq_len, micro_batch_size, hidden_size, num_heads, tp
    if recompute in ("full", "partitioned"):
        return 2 * s * b * h / t if sp and t > 1 else 2 * s * b * h
    flash = flash or recompute == "selective"
    if t == 1:
        return 34 * s * b * h + (0 if flash else 5 * a * s * s * b)
    scores = 0 if flash else 5 * a * s / h
    return s * b * h / t * (34 + scores) if sp else s * b * h * (10 + 24 / t + scores / t)


def memory_estimate(model_config, seq_len, micro_batch_size, dtype="fp32", recompute="none", optimizer="adamw"):
    """Bytes held by our trainer on one device at the end of a forward pass (the activation peak), by
    category: {params, grads, optimizer, activations, total}.

    params, grads: fp32, 4Ψ each (our trainer keeps fp32 master weights; autocast casts on the fly).
    optimizer: AdamW's exp_avg and exp_avg_sq, 8Ψ, + one 4-byte step counter per parameter tensor.
    activations: `activation_bytes` (bf16: including autocast's saved bf16 weight copies).
    total: their sum, counting grads and optimizer state as alive (from the second step on they are: the
    gradients are set to None after the step, but the peak of the backward pass holds all of them).
    Temporaries (the logits before the loss, one layer's recomputation, kernels' workspaces) come on top.
    """
    _check(dtype, recompute, optimizer)
    out = model_state_bytes(model_config.num_params(), "fp32", optimizer, tensors=param_tensors(model_config))
    out["activations"] = activation_bytes(model_config, seq_len, micro_batch_size, dtype, recompute)
    out["total"] = sum(out.values())
    return out


def fp8_scale_bytes(rows, cols, tile=128, block=False):
    """Bytes of the fp32 scales of a [rows, cols] tensor in fine-grained FP8 (picotron/fp8_blockwise.py, DeepSeek-V3
    §3.3.2): one per 1×tile tile along the last axis, 4·rows·⌈cols/tile⌉ (3.1 % of the 1-byte data when tile = 128
    divides cols), or with block one per tile×tile block, 4·⌈rows/tile⌉·⌈cols/tile⌉."""
    return 4 * (-(-rows // tile) if block else rows) * -(-cols // tile)


# ======================================================================================= any layout
# Everything above is one device. Below: the same bytes for one rank of a dp x pp x cp x tp (x ep) layout,
# by dividing each term by the degree that splits it. The rules, each from the strategy's own module:
#   tp   shards every matmul weight of attention and MLP, the embedding and the head (vocabulary-parallel);
#        norms stay whole. Activations: what lives per head or per intermediate feature (q, k, v, the core's
#        output and logsumexp, the MLP's inner tensors, the logits) is split; the hidden-size tensors around
#        them (norm inputs and outputs, the inputs of q/k/v and gate/up) stay whole, unless sp splits them.
#   sp   splits the hidden-size tensors of the norms and the residual stream over tp (sequence positions).
#   cp   every token-wise activation is s/cp tokens long; nothing of the model states is split. Ulysses (all-to-all
#        from s/cp tokens of every head to all s tokens of heads/cp) keeps as many elements in its attention kernel,
#        plus o_proj's input, now a tensor of its own (the all-to-all back), and K/V heads repeated until cp divides
#        them; the ring's K/V blocks in flight are temporaries (not counted), Ulysses has none.
#   pp   a stage holds its layers (split_layers: balanced by FLOPs, the embedding on the first stage, the final
#        norm and head on the last); its activations are one micro-batch's times the micro-batches alive at the
#        schedule's peak on that stage (the simulator's count: AFAB m, 1F1B p - i, ...). DualPipe (DeepSeek-V3,
#        arXiv:2412.19437, Table 2): rank r holds stages r and p-1-r of ONE cut into p stages (every stage twice in
#        the pipeline: 2x parameters, gradients and optimizer state per rank); its activations are counted from
#        our schedule's action lists like the others' (Table 2 says p + 1 stage micro-batches for DeepSeek's own).
#   ep   a rank holds E/ep experts of every MoE layer (each cut by tp like an MLP).
#   ZeRO over the dp x cp ranks (experts: over dp x cp / ep): 1 the optimizer state, 2 + gradients, 3 + params.
#        HSDP (dp_shard): over one shard group, dp_shard x cp ranks, instead: the replicas hold the same shards.
#        ZeRO-3 with pp keeps a stage's gathered parameters from its first micro-batch's forward to the step's end
#        (torchtitan's reshard_after_forward=False under a pipeline): whole parameters + this rank's shard.
from dataclasses import dataclass  # noqa: E402

from picotron.pipeline_schedules import build, split_layers  # noqa: E402

DEGREES = ("dp", "tp", "pp", "cp", "ep")
# With sp, the copies of a block's all-gathered input [b, s, h] autograd keeps: the all-gather returns a transposed
# view and each projection reading it (q, k, v; gate, up) keeps its own contiguous copy (lesson 05 measures it).
SP_INPUT_COPIES = {"attention": 3, "mlp": 2}


@dataclass(frozen=True)
class Layout:
    """A parallel layout and the per-rank batch settings: what a training command line fixes."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sp: bool = False
    zero: int = 0
    pp_schedule: str = "1f1b"
    pp_chunks: int = 1
    cp_impl: str = "ring"
    micro_batch_size: int = 1
    grad_acc: int = 1
    recompute: str = "none"
    async_tp: bool = False  # the collective matmul (picotron.async_tp; needs sp): 'async-tp' in the text form
    dp_shard: int = 0  # HSDP: ZeRO within groups of dp_shard dp ranks (x cp), replicated across them; 0 = all of dp
    ep_overlap: bool = False  # expert all-to-alls under compute (two parts; needs ep > 1): 'ep-overlap' in the text
    bare_ends: bool = False  # Llama 3's cut (§3.3.2): the first chunk holds only the embedding, the last only the
    # final norm, head and loss; the layers go to the chunks between: 'bare-ends' in the text. Other software's: picotron's
    # pipeline puts a layer in every chunk (plan.search.trainer_problem refuses it), so only --published and --layout use it

    @property
    def shard(self) -> int:
        """The ranks ZeRO shards over: dp x cp, or with HSDP dp_shard x cp (one shard group): 'shard4' in the text."""
        return (self.dp_shard or self.dp) * self.cp

    @property
    def gpus(self) -> int:
        """Processes (GPUs) the layout needs: dp·tp·pp·cp (the ep ranks are carved out of the dp ranks)."""
        return self.dp * self.tp * self.pp * self.cp

    @classmethod
    def parse(cls, text, **overrides):
        """'tp8,pp16,dp128' in any order (missing degrees = 1), with optional items 'sp', 'zero1', 'mbs2', 'ga8',
        'recompute-full', '1f1b' (or another schedule), 'v2' (interleaved chunks; 'interleaved-v2' says both, as
        str() prints it), 'ulysses' (or another --cp-impl). Reads back what str() writes. One sentence if it cannot."""
        values = {}
        for item in (t.strip() for t in str(text).replace(" ", ",").split(",")):
            if not item:
                continue
            key = next((k for k in ("zero", "mbs", "ga", "dp", "tp", "pp", "cp", "ep", "v", "shard")
                        if item.startswith(k) and item[len(k):].isdigit()), None)
            chunks = item.rpartition("-v")  # 'interleaved-v2': the schedule and its chunks in one item
            if key:
                number = int(item[len(key):])
                if number < (0 if key == "zero" else 1) or (key == "zero" and number > 3):
                    raise ValueError(f"layout item {item!r} in {text!r}: " + (
                        "ZeRO's stage is 0, 1, 2 or 3" if key == "zero" else f"{key} must be at least 1") + ".")
                values[{"mbs": "micro_batch_size", "ga": "grad_acc", "v": "pp_chunks", "shard": "dp_shard"}.get(key, key)] \
                    = number
            elif item == "sp":
                values["sp"] = True
            elif item == "async-tp":
                values["async_tp"] = True
            elif item == "ep-overlap":
                values["ep_overlap"] = True
            elif item == "bare-ends":
                values["bare_ends"] = True
            elif item in PP_SCHEDULES:
                values["pp_schedule"] = item
            elif item in CP_IMPLS:
                values["cp_impl"] = item
            elif chunks[0] == "interleaved" and chunks[2].isdigit() and int(chunks[2]) >= 1:
                values["pp_schedule"], values["pp_chunks"] = "interleaved", int(chunks[2])
            elif item.startswith("recompute-") and item[10:] in RECOMPUTE:
                values["recompute"] = item[10:]
            else:
                raise ValueError(f"layout item {item!r} in {text!r} is not one of dp/tp/pp/cp/ep/zero/mbs/ga/v/shard followed by a "
                                 f"number, 'sp', 'async-tp', 'ep-overlap', 'bare-ends', 'recompute-none|selective|full', a schedule ({', '.join(PP_SCHEDULES)}), "
                                 f"'interleaved-v<chunks>' or a cp_impl ({', '.join(CP_IMPLS)}); e.g. 'tp8,pp16,dp128'.")
        return cls(**{**values, **overrides})

    @classmethod
    def from_config(cls, cfg):
        return cls(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep, sp=cfg.sp, zero=cfg.zero,
                   pp_schedule=cfg.pp_schedule, pp_chunks=cfg.pp_chunks, cp_impl=cfg.cp_impl, micro_batch_size=cfg.micro_batch_size,
                   grad_acc=cfg.grad_acc, recompute=cfg.recompute, async_tp=cfg.async_tp, dp_shard=cfg.dp_shard,
                   ep_overlap=cfg.ep_overlap)

    def __str__(self):
        """'dp2,tp4,pp2,cp2,ulysses,sp,zero1,interleaved-v2,mbs2,ga32': what `parse` reads back as this layout."""
        parts = [f"{k}{getattr(self, k)}" for k in DEGREES if getattr(self, k) > 1] or ["dp1"]
        parts += [self.cp_impl] * (self.cp_impl != "ring")
        parts += ["sp"] * self.sp + ["async-tp"] * self.async_tp + [f"zero{self.zero}"] * (self.zero > 0)
        parts += [f"shard{self.dp_shard}"] * (self.dp_shard > 0)  # HSDP
        parts += ["ep-overlap"] * self.ep_overlap
        if self.pp > 1:
            parts.append(self.pp_schedule + (f"-v{self.pp_chunks}" if self.pp_schedule == "interleaved" else ""))
        parts += ["bare-ends"] * self.bare_ends
        parts += [f"mbs{self.micro_batch_size}"] + [f"ga{self.grad_acc}"] * (self.grad_acc > 0)  # 0: no whole number
        return ",".join(parts + [f"recompute-{self.recompute}"] * (self.recompute != "none"))


def stage_layers(mc, pp, seq_len, bare_ends=False):
    """Layers per pipeline stage, [(lo, hi), ...] as the pipeline cuts them (balanced by FLOPs). bare_ends (Llama 3's
    cut, its paper's §3.3.2: one layer fewer on the first and the last stage, to balance them): stage 0 holds
    only the embedding and stage pp-1 only the final norm and head, (0, 0) and (L, L); the L layers are spread evenly
    over the pp-2 stages between (126 layers in 16 x 8 - 2 chunks: one each)."""
    L = mc.num_hidden_layers
    if bare_ends:
        k = pp - 2
        if not 1 <= k <= L:
            raise ValueError(f"bare-ends needs between 3 and {L + 2} pipeline chunks in all (the embedding's, the "
                             f"head's and at least one layer each between), not {pp}.")
        return [(0, 0)] + [(i * L // k, (i + 1) * L // k) for i in range(k)] + [(L, L)]
    if pp == 1:
        return [(0, L)]
    key = (repr(mc), pp, seq_len)
    if key not in _SPLITS:
        _SPLITS[key] = split_layers(mc, pp, seq_len)
    return _SPLITS[key]


_SPLITS = {}


def chunks_held(layout, rank):
    """(stages in the cut, the stages pipeline rank `rank` holds in chunk order): interleaved r, r + p, ...; the V of
    zb-v r and 2p-1-r; DualPipe's r and p-1-r of p stages (each stage on two ranks); otherwise stage r."""
    p, s = layout.pp, layout.pp_schedule
    if p == 1:
        return 1, [0]
    if s == "interleaved":
        return p * layout.pp_chunks, [rank + p * k for k in range(layout.pp_chunks)]
    if s == "zb-v":
        return 2 * p, [rank, 2 * p - 1 - rank]
    if s == "dualpipe":
        return p, [rank, p - 1 - rank]
    return p, [rank]


def _replay(schedule, pp, m, v):
    """Per rank, the chunk-activation counts (n_0, ..., n_{v-1}) alive after each of its forwards, keeping only the
    maximal ones (no other moment has at least as many of every chunk). A rank runs its action list in order, so
    this needs no timing: a forward adds its chunk's activations, its backward (W when the backward is split) frees
    them; the trainer counts the pipeline's so (metrics.ActivationPeak on pipeline_parallel.Pipeline's phases)."""
    key = (schedule, pp, m, v)
    if key not in _REPLAYS:
        sch = build(schedule, pp, m, v if schedule == "interleaved" else 1)
        free = "W" if sch.split else "B"
        out = []
        for acts in sch.ranks:
            n, seen = [0] * sch.v, set()
            for a in acts:
                if a.kind == "F":
                    n[a.chunk] += 1
                    seen.add(tuple(n))
                elif a.kind == free:
                    n[a.chunk] -= 1
            out.append(tuple(x for x in seen if not any(y != x and all(q >= r for q, r in zip(y, x)) for y in seen)))
        _REPLAYS[key] = out
    return _REPLAYS[key]


_REPLAYS = {}


def _replay_grads(schedule, pp, m, v):
    """As `_replay`, for ZeRO-2/3 under a pipeline (zero.py, zero3.py: `accumulate=True`): per rank the maximal
    moments (after each forward and each gradient-producing action: B, or W when split) as (counts, states), states[c]
    the gradients chunk c holds then: 0 none yet this step, 1 its shard (its last backward is done: reduce-scattered),
    2 its whole gradients (from its first backward to its last). A moment is dropped only when another has at least
    as much of everything."""
    key = ("grads", schedule, pp, m, v)
    if key not in _REPLAYS:
        sch = build(schedule, pp, m, v if schedule == "interleaved" else 1)
        free = "W" if sch.split else "B"
        out = []
        for acts in sch.ranks:
            total = [sum(1 for a in acts if a.kind == free and a.chunk == c) for c in range(sch.v)]
            n, done, seen = [0] * sch.v, [0] * sch.v, set()
            for a in acts:
                if a.kind == "F":
                    n[a.chunk] += 1
                elif a.kind == free:
                    n[a.chunk] -= 1
                    done[a.chunk] += 1
                else:
                    continue
                seen.add(tuple(n) + tuple(0 if d == 0 else 1 if d == t else 2 for d, t in zip(done, total)))
            out.append(tuple((x[:sch.v], x[sch.v:]) for x in seen
                             if not any(y != x and all(q >= r for q, r in zip(y, x)) for y in seen)))
        _REPLAYS[key] = out
    return _REPLAYS[key]


def alive_at_peak(schedule, pp, m, v):
    """Micro-batch activations (chunks) alive at each rank's peak: AFAB m, 1F1B min(p - i, m), interleaved and
    zero-bubble their own (the same count as `pipeline_schedules.simulate(...).peak_alive`)."""
    return tuple(max(sum(x) for x in rank) for rank in _replay(schedule, pp, m, v))


def _params_of_stage(mc, layout, lo, hi, first, last):
    """(dense, expert) parameters one rank of this stage holds (before ZeRO-3)."""
    h, v, t = mc.hidden_size, mc.vocab_size, layout.tp
    kv = mc.num_key_value_heads * mc.head_dim
    attn = (2 * h * h + 2 * h * kv) // t
    if mc.is_moe:
        ffn_dense, ffn_expert = mc.num_local_experts * h, mc.num_local_experts // layout.ep * 3 * h * mc.intermediate_size // t
    else:
        ffn_dense, ffn_expert = 3 * h * mc.intermediate_size // t, 0
    n = hi - lo
    dense = n * (attn + ffn_dense + 2 * h)
    if first:
        dense += v * h // t
    if last:
        dense += h + (v * h // t if (not mc.tie_word_embeddings or layout.pp > 1 or not first) else 0)
    return dense, n * ffn_expert


def _layer_activations(mc, layout, seq_len, dtype):
    """Bytes one decoder layer keeps for one micro-batch on one rank (recipe "ours")."""
    t, c, b = layout.tp, layout.cp, layout.micro_batch_size
    s = seq_len // c
    terms = activation_terms_per_layer(mc, s, b, dtype, layout.recompute)
    if layout.recompute in ("full", "partitioned"):  # partitioned (ZeRO-R's Pa): each tp rank keeps 1/t of it
        return terms["layer input (checkpoint)"] / (t if layout.sp or layout.recompute == "partitioned" else 1)
    h, sb = mc.hidden_size, s * b
    norm = terms["input_layernorm"]
    qkv_in = 3 * 2 * sb * h if dtype == "bf16" else 4 * sb * h
    core = terms["self_attn"] - qkv_in
    mlp_in = 2 * 2 * sb * h if dtype == "bf16" else 4 * sb * h
    mlp_inner = terms["mlp"] - mlp_in
    moe_rows = 0
    if mc.is_moe:  # k of E experts per token: the inner tensors of k MLPs (cut by tp); whole rows of h features:
        k, E = mc.num_experts_per_tok, mc.num_local_experts  # the sorted rows, the experts' outputs and their
        mlp_inner = mlp_inner * k  # weighted copy (with ep also the rows received and sent back); the router's
        moe_rows = (3 + 3 * (layout.ep > 1)) * BYTES[dtype] * sb * k * h + 4 * sb * E + 44 * sb * k  # softmax
    if layout.sp and t > 1:  # our all-gather hands each projection its own contiguous copy of the gathered input
        qkv_in, mlp_in = SP_INPUT_COPIES["attention"] * qkv_in, SP_INPUT_COPIES["mlp"] * mlp_in
    out = 2 * norm / (t if layout.sp else 1) + qkv_in + core / t + mlp_in + mlp_inner / t + moe_rows
    return out + terms.get("bf16 weight copies", 0) / t + ulysses_extra_bytes(mc, layout, seq_len, BYTES[dtype])


def ulysses_kv_heads(kv_heads, cp):
    """How many KV heads Ulysses sends (this tp rank's): kv_heads when cp divides them, else the fewest copies (each
    KV head repeated next to itself) that cp divides and that still group the query heads evenly: lcm(kv_heads, cp).
    context_parallel.ulysses_attention repeats them so."""
    return math.lcm(kv_heads, cp)


def ulysses_buffer_bytes(heads, kv_heads, cp, b, seq_len, head_dim, elem=4):
    """The buffers of one layer's four forward all-to-alls on one rank (q, k, v, the output: this rank's s/cp tokens
    of every head, `heads` query heads and ulysses_kv_heads KV heads): (2a + 2kh')·b·(s/cp)·d·elem bytes; (cp-1)/cp
    of each leaves the rank, and the backward's four send as much again."""
    return (2 * heads + 2 * ulysses_kv_heads(kv_heads, cp)) * b * (seq_len // cp) * head_dim * elem


def cp_bytes_per_step(cp, b, seq_len, kv_heads, head_dim, layers, elem=4, impl="ring", micro_batches=1, heads=None):
    """Bytes one rank sends per optimizer step for attention under cp (recomputation adds its forwards); the head
    counts are this rank's (per tp rank). context_parallel's three cores send exactly this (lesson 06 counts it).

    A block is one rank's K and V: 2·b·kh·(s/cp)·d elements. ring: cp-1 blocks forward, cp-1 again in backward
    (the ring is walked again rather than keeping every block), and cp dK/dV blocks, accumulated in fp32 (the
    last one goes home): 3cp - 2 messages per layer (`cp_messages_per_layer`); allgather: cp-1 blocks out in the gather and cp-1 gradient
    blocks in the reduce-scatter. ulysses (needs `heads`, the query heads): four all-to-alls forward, of q, k, v
    and the output (`ulysses_buffer_bytes`), of which (cp-1)/cp leave the rank; backward sends as much again."""
    if impl == "ulysses":
        one = ulysses_buffer_bytes(heads, kv_heads, cp, b, seq_len, head_dim, elem)
        return layers * micro_batches * 2 * one * (cp - 1) // cp
    block = 2 * b * kv_heads * (seq_len // cp) * head_dim
    if impl == "ring":
        per_layer = block * (2 * (cp - 1) * elem + cp * max(elem, 4))
    else:
        per_layer = block * 2 * (cp - 1) * elem
    return layers * micro_batches * per_layer


def cp_messages_per_layer(cp, impl="ring"):
    """Messages (ring or all-to-all steps) one rank sends per layer and micro-batch under cp, forward and backward: the
    α count beside `cp_bytes_per_step`'s bytes. ring 3cp - 2 (cp-1 K/V blocks forward, cp-1 again in backward, cp
    dK/dV blocks); allgather 2(cp-1) (the gather's steps and the reduce-scatter's); ulysses 8(cp-1) (eight all-to-alls of
    cp-1 steps; full recomputation repeats the forward's four)."""
    if cp <= 1:
        return 0
    return {"ring": 3 * cp - 2, "allgather": 2 * (cp - 1), "ulysses": 8 * (cp - 1)}[impl]


def ulysses_extra_bytes(mc, layout, seq_len, elem):
    """Bytes one layer keeps under Ulysses beyond the ring's: o_proj's input (the all-to-all back from the kernel's
    output, b·(s/cp)·h/t elements) and the repeated K/V heads (lcm(k/t, cp) - k/t heads of s/cp tokens, K and V).
    0 for the ring and all-gather, with cp = 1, and under recomputation (the checkpoint keeps only its inputs)."""
    if layout.cp_impl != "ulysses" or layout.cp == 1 or layout.recompute != "none":
        return 0
    c, t, b = layout.cp, layout.tp, layout.micro_batch_size
    kv = mc.num_key_value_heads // t
    return elem * b * (seq_len // c) * (mc.hidden_size / t + 2 * mc.head_dim * (ulysses_kv_heads(kv, c) - kv))


def _edge_activations(mc, layout, seq_len, dtype, first, last):
    """Bytes outside the layers for one micro-batch: RoPE's tables on every stage; token ids on the first; final norm,
    head input, the fp32 log-softmax over this rank's slice of the vocabulary and the targets on the last."""
    t, c, b = layout.tp, layout.cp, layout.micro_batch_size
    s, h, v = seq_len // c, mc.hidden_size, mc.vocab_size
    sb = s * b
    out = 0 if (dtype == "bf16" and layout.recompute == "none") else 2 * s * mc.head_dim * 4  # RoPE's cos, sin
    if first:  # tp > 1: the vocabulary-parallel embedding keeps its local ids and their mask instead (9 bytes a token)
        out += 8 * b * (s + 1) if t == 1 else 9 * sb
    if last:
        norm = (8 * sb * h + 4 * sb) / (t if layout.sp else 1)
        head_in = (2 * sb * h + 2 * v * h / t) if dtype == "bf16" else 4 * sb * h
        out += norm + head_in + 4 * sb * v / t + (8 * sb + 4 if t == 1 else 9 * sb)
    return out


# Bytes per parameter (params, grads, optimizer state) of each recipe: "ours" = picotron's trainer (fp32 weights are
# their own master copy, AdamW's two moments); "mixed" = the ZeRO paper's bf16 mixed precision (bf16 weights and
# gradients, an fp32 master copy and the moments); "mixed-fp32-grads" = the same with gradients accumulated in fp32, as
# Megatron-LM does under bf16, DeepSpeed's BF16 optimizer and Llama 3 (its paper, section 3.3.2) do.
RECIPES = {"ours": (4, 4, 8), "mixed": (2, 2, 12), "mixed-fp32-grads": (2, 4, 12)}


def memory_per_stage(mc, layout, seq_len, dtype="fp32", recipe="ours"):
    """[{params, grads, optimizer, activations, total}] in bytes, one per pipeline stage, for ONE rank of it at
    the step's peak. recipe "ours": what picotron's trainer holds and accounts (fp32 parameters, gradients and
    AdamW moments, `activation_bytes` of our code); "mixed": the textbook bf16 recipe for planning GPU runs
    (2 + 2 + 12 bytes per parameter, `mixed_activation_bytes_per_layer`); "mixed-fp32-grads": 2 + 4 + 12 (RECIPES). The activations at the peak: each chunk
    of layers the rank holds times its micro-batches alive at the worst moment of the schedule (`_replay`)."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r}; use one of {', '.join(RECIPES)}.")
    _check(dtype, layout.recompute)
    shard = layout.shard  # the ranks ZeRO shards over (HSDP: one shard group)
    eshard = max(1, shard // layout.ep)
    stages, held0 = chunks_held(layout, 0)
    v = len(held0)
    cuts = stage_layers(mc, stages, seq_len, layout.bare_ends)
    if layout.pp == 1:
        vectors = [((1,),)]
    else:  # DualPipe too: our schedule's own counts (pipeline_schedules.dualpipe), not Table 2's p + 1
        vectors = _replay(layout.pp_schedule, layout.pp, layout.grad_acc, v)
    if recipe == "ours":
        layer = _layer_activations(mc, layout, seq_len, dtype)
        edge = lambda first, last: _edge_activations(mc, layout, seq_len, dtype, first, last)  # noqa: E731
    else:
        layer = mixed_activation_bytes_per_layer(mc, seq_len // layout.cp, layout.micro_batch_size, layout.tp,
                                                 layout.sp, layout.recompute) + ulysses_extra_bytes(mc, layout, seq_len, 2)
        edge = lambda first, last: _mixed_edge(mc, layout, seq_len, first, last)  # noqa: E731
    P, G, K = RECIPES[recipe]
    out = []
    for rank in range(layout.pp):
        held = chunks_held(layout, rank)[1]  # chunk c of this rank is stage held[c]
        dense = expert = 0
        chunk_bytes, chunk_params = [], []
        for st in held:
            lo, hi = cuts[st]
            first, last = st == 0, st == stages - 1
            d, e = _params_of_stage(mc, layout, lo, hi, first, last)
            dense, expert = dense + d, expert + e
            chunk_params.append(d + e)
            chunk_bytes.append((hi - lo) * layer + edge(first, last))
        z = layout.zero
        units = dense / (shard if z >= 1 else 1) + expert / (eshard if z >= 1 else 1)
        whole = dense + expert
        acts = max(sum(n * b for n, b in zip(counts, chunk_bytes)) for counts in vectors[rank])
        grads = G * (units if z >= 2 else whole)
        if z >= 2 and layout.pp > 1:  # each chunk's whole gradients from its first backward to its last, then its
            # shard (zero.py, zero3.py: accumulate=True); the peak is the moment of the most activations + gradients
            acts, grads = max(((sum(n * b for n, b in zip(counts, chunk_bytes)),
                                sum(0 if q == 0 else G * w * (1 if q == 2 else units / whole)
                                    for q, w in zip(states, chunk_params)))
                               for counts, states in _replay_grads(layout.pp_schedule, layout.pp, layout.grad_acc, v)[rank]),
                              key=sum)
        # ZeRO-3 with pp keeps the gathered parameters for all its micro-batches, beside this rank's shard
        row = {"params": P * (units + (whole if layout.pp > 1 else 0) if z >= 3 else whole),
               "grads": grads,
               "optimizer": K * units,
               "activations": acts}
        row = {k: int(round(x)) for k, x in row.items()}
        row["total"] = sum(row.values())
        out.append(row)
    return out


def mixed_activation_bytes_per_layer(mc, seq_len, micro_batch_size, tp=1, sp=False, recompute="none"):
    """Bytes one decoder layer keeps for backward in a bf16 Megatron-style implementation of OUR layer (RMSNorm,
    GQA, SwiGLU, no dropout, flash attention), counted the way Korthikanti et al. 2022 (section 4.1) count GPT's:

        whole under tp (split by sp):  the inputs of the two norms, of q/k/v and of gate/up     2·4 = 8 sbh
        split by tp:                   q 2sbh, k and v 2·2sbh·k/a, the attention output 2sbh
                                       (the kernel's and o_proj's input: one tensor), gate and up
                                       outputs 2·2sbi, their product (down's input) 2sbi        sbh(4 + 4k/a + 6i/h)
        eager attention only:          the bf16 softmax 2·a·s²·b (flash kernels keep no s² term)

    so sbh(8 + (4 + 4k/a + 6i/h)/t) with tp, sbh(12 + 4k/a + 6i/h)/t with tp and sp. GPT's layer (k = a, a 4h GELU
    MLP keeping its input and output, 16sbh, two dropout masks 2sbh) gives their 34: sbh(10 + 24/t). "selective"
    drops the s² term (Korthikanti's selective recomputation); "full" keeps the layer input, 2sbh (/t with sp).
    Experts: the MLP's split part k times, plus the k routed copies of each row in and out (4k·sbh)."""
    s, b, h, a, t = seq_len, micro_batch_size, mc.hidden_size, mc.num_attention_heads, tp
    sbh = s * b * h
    if recompute in ("full", "partitioned"):
        return 2 * sbh / (t if sp or recompute == "partitioned" else 1)
    k = mc.num_experts_per_tok if mc.is_moe else 1
    ffn = 6 * mc.intermediate_size / h * k + (4 * k if mc.is_moe else 0)
    split = 4 + 4 * mc.num_key_value_heads / a + ffn
    core = 2 * a * s * s * b / t if (mc.attn_impl == "eager" and recompute == "none") else 0
    return (sbh * (8 + split) / t if sp else sbh * (8 + split / t)) + core


def _mixed_edge(mc, layout, seq_len, first, last):
    """Bytes outside the layers for one micro-batch, bf16 recipe: the ids on the first stage; on the last the final
    norm's and the head's inputs (2sbh each, /t with sp) and the fp32 log-probabilities of this rank's vocabulary."""
    s, b, h, t = seq_len // layout.cp, layout.micro_batch_size, mc.hidden_size, layout.tp
    out = 8 * s * b if first else 0
    if last:
        out += 4 * s * b * h / (t if layout.sp else 1) + 4 * s * b * mc.vocab_size / t
    return out


def memory_per_gpu(mc, layout, seq_len, dtype="fp32", recipe="ours"):
    """The busiest stage's `memory_per_stage` row (by total)."""
    return max(memory_per_stage(mc, layout, seq_len, dtype, recipe), key=lambda r: r["total"])


# ============================================================================ async TP (the collective matmul)
def async_tp_exposed_seconds(n, chunk_bytes, chunk_matmul_s, alpha, bw):
    """Seconds of communication one collective matmul over n tp ranks leaves exposed (picotron.async_tp): its n−1
    ring steps each send one chunk (`chunk_bytes`: one rank's b·s/n·h activations), α + chunk_bytes/bw, while one
    chunk's matmul (`chunk_matmul_s`) runs; a step is exposed by what its message takes beyond that matmul:

        T_exposed = (n − 1) · max(0, α + chunk_bytes/bw − t_chunk_matmul)

    against the blocking collective's (n − 1) · (α + chunk_bytes/bw) (a ring all-gather or reduce-scatter of the n
    chunks). Wang et al. 2023 (ASPLOS'23), section 3; the JAX scaling book's collective matmul."""
    if n <= 1:
        return 0.0
    return (n - 1) * max(0.0, alpha + chunk_bytes / bw - chunk_matmul_s)


def async_tp_layer_seconds(mc, tokens, tp, elem, rate, alpha, bw, overlap=True):
    """Seconds of tensor-parallel communication per decoder layer and micro-batch of `tokens` tokens (b·s/cp) on one
    rank, forward and backward, with sp: four collective matmuls forward (q/k/v and gate/up all-gather-matmuls, the
    o and down matmul-reduce-scatters) and four backward (each the other kind: dx of an all-gather-matmul is a
    matmul-reduce-scatter, hidden under the dx matmuls of its chunks; an all-gather-matmul's backward, hidden under
    dx and dW). A chunk's matmul: its block's matmul FLOPs / tp (this rank's columns) / tp (one chunk of the tokens)
    at `rate` FLOP/s. overlap=False: the blocking collectives, 8 · (tp − 1) · (α + chunk/bw). An MoE model's
    feed-forward stays blocking (its experts read routed tokens, not sequence chunks)."""
    t, h, d = tp, mc.hidden_size, mc.head_dim
    if t <= 1:
        return 0.0
    chunk = tokens / t * h * elem
    msg = alpha + chunk / bw
    if not overlap:
        return 8 * (t - 1) * msg
    qkv = 2 * tokens * h * (mc.num_attention_heads + 2 * mc.num_key_value_heads) * d
    out = 2 * tokens * mc.num_attention_heads * d * h
    up, down = 2 * tokens * h * 2 * mc.intermediate_size, 2 * tokens * mc.intermediate_size * h
    per_chunk = {name: f / t / t / rate for name, f in (("qkv", qkv), ("o", out), ("up", up), ("down", down))}
    forward_mm = [per_chunk["qkv"], per_chunk["o"]] + ([] if mc.is_moe else [per_chunk["up"], per_chunk["down"]])
    backward_mm = [per_chunk["qkv"], 2 * per_chunk["o"]] + ([] if mc.is_moe else [per_chunk["up"], 2 * per_chunk["down"]])
    exposed = sum(async_tp_exposed_seconds(t, chunk, mm, alpha, bw) for mm in forward_mm + backward_mm)
    return exposed + (4 * (t - 1) * msg if mc.is_moe else 0.0)  # the MoE feed-forward's blocking pair, both ways
# ---------------------------------------------------------------------------------------------- end async TP


# ================================================================ expert all-to-alls under compute (--ep-overlap)
def ep_overlap_exposed_seconds(a2a_s, experts_s, shared_s=0.0, tail_s=0.0):
    """Seconds of one pass (forward, or backward with the backward's compute) of an MoE layer that its all-to-alls
    leave exposed when the routed rows travel in two parts (picotron.expert_parallel._TwoParts): `a2a_s` one part's
    all-to-all, `experts_s` one part's experts, `shared_s` the shared expert's compute (DeepSeek-V3, 0 without),
    `tail_s` the part of part 2's work done after its combine was launched (0 on a GPU, where a launch is free).
    One link per rank carries one all-to-all at a time, in issue order; the compute runs one thing at a time:

        dispatch 1 ends at a, dispatch 2 at 2a; the shared expert runs from 0 to s
        experts 1 start at x1 = max(a, s), end at x1 + c; combine 1 runs from max(2a, x1 + c) for a
        experts 2 start at x2 = max(2a, x1 + c), end at x2 + c; combine 2 starts when combine 1 has left the link
        and part 2 has launched it (at x2 + c − tail)
        exposed = when both combine 2 and the compute are done − (s + 2c)
        T_exposed = 2a − min(s, a)  when c ≥ a (the first dispatch, less the shared expert under it, and the last
        combine, which nothing follows; each middle all-to-all hidden under the other part's experts), 4a − 2c − s
        when a ≥ c ≥ s

    against the blocking exchange's 4a (dispatch and combine of both halves, nothing under them). DeepSeek-V3
    technical report (arXiv:2412.19437) §3.2.2: the all-to-alls of one micro-batch under another's compute; Megatron-LM
    --overlap-moe-expert-parallel-comm."""
    a, c, s, t = a2a_s, experts_s, shared_s, tail_s
    x1 = max(a, s)
    combine1 = max(2 * a, x1 + c) + a
    x2 = max(2 * a, x1 + c)
    combine2 = max(combine1, x2 + c - t) + a
    return max(combine2, x2 + c) - (s + 2 * c)
# ----------------------------------------------------------------------------------------------- end --ep-overlap
