"""How long one optimizer step of a layout takes: `step_time`, an α-β model of every strategy's collectives, the
pipeline's bubble and the overlap each strategy allows, with the FLOPs and bytes of picotron.planner (and
pipeline_schedules' bubbles): this module counts seconds, not bytes.

The time model (every term in one function, `step_time`), for one rank of the busiest pipeline stage:
  compute   FLOPs per token (6N + 12·L·h·s, the trainer's count, attention not halved for causality; + the recomputed
            forward: 2N + 4·L·h·s with full recomputation, the attention core's 4·L·h·s with selective) × the step's
            tokens ÷ GPUs × the busiest rank's share of the layers (and the head), at peak × efficiency. One
            efficiency for every run (EFFICIENCY), not tuned per run.
  tp        per layer and micro-batch 4 all-reduces of b·(s/cp)·h elements (2 forward, 2 backward; with sp the same
            bytes as all-gathers + reduce-scatters; full recomputation repeats the 2 forward ones); not overlapped.
            With async TP (sp): each of the 8 collectives a collective matmul, only the excess of each ring step's
            message over one chunk's matmul exposed (planner.async_tp_exposed_seconds).
  cp        ring attention: per layer and micro-batch the bytes context_parallel sends (planner.cp_bytes_per_step:
            (cp−1) K/V blocks forward, (cp−1) K/V + cp fp32 dK/dV backward), overlapped with that layer's attention
            compute: only the excess counts. Ulysses (Jacobs et al. 2023,
            arXiv:2309.14509): per layer and micro-batch 4 all-to-alls forward (q, k, v, the output) and 4 backward,
            each of a rank's b·(s/cp)·heads·d elements (k, v: its KV heads, repeated until cp divides them), (cp−1)/cp
            of them leaving; not overlapped; full recomputation repeats the forward's 4.
  ep        per MoE layer and micro-batch 4 all-to-alls (dispatch and combine, forward and backward) of the k copies
            of each token; not overlapped. With --ep-overlap the rows travel in two parts, each part's all-to-all under
            the other part's experts (and the shared expert): planner.ep_overlap_exposed_seconds per pass.
  pp        point-to-point: per micro-batch and chunk one activation forward and one gradient backward; the bubble:
            the schedule's idle fraction B (1F1B/AFAB (p−1)/(m+p−1), interleaved (p−1)/(vm+p−1), ZB-H1
            (p−1)/(3m+p−1), ZB-V from the simulator, DualPipe DeepSeek-V3's Table 2: idle (p/2−1)(F&B + B − 3W) =
            2(p/2−1) with F = W = 1, B = 2, F&B = F + B, against 3m busy) stretches the busy time by 1/(1−B).
  dp        over dp×cp, gradients in the recipe's precision: ZeRO-0/1 one all-reduce (reduce-scatter + all-gather)
            hidden behind the last micro-batch's backward (2/3 of its compute); ZeRO-2/3 keep only a shard of the
            gradients, so without pp they reduce-scatter every micro-batch's, hidden behind every backward, then
            all-gather the parameters (ZeRO-3: for every micro-batch's forward and backward, hidden behind all the
            compute). With pp > 1 they sum a chunk's gradients over its micro-batches and reduce-scatter them once, at
            the chunk's last backward (the trainer's accumulate=True), ZeRO-3 gathering the stage once per step
            (torchtitan's reshard_after_forward=False under a pipeline): ZeRO-1's traffic, hidden as ZeRO-1's, behind
            the last micro-batch's backward only (and the whole gradients held until then: planner.memory_per_stage
            counts them at the schedule's peak). DualPipe's two copies of each stage also all-reduce their gradients
            (2 ranks, once per step). Only the excess counts.
            HSDP (dp_shard): the same collectives over a shard group of dp_shard x cp ranks, on NVLink when the group
            (`shard_span` consecutive ranks) lies in a node, then the gradient shard (1/(dp_shard·cp) of the
            gradients) all-reduced over the dp/dp_shard replicas on the network, as picotron.zero does it: once, after
            the last reduce-scatter, not overlapped.
Collectives are rings: all-reduce 2(n−1)·α + 2(n−1)/n·bytes/bw; all-gather, reduce-scatter, all-to-all
(n−1)·α + (n−1)/n·bytes/bw; a send α + bytes/bw. A group is on NVLink when each of its copies lies in one node
(grid order dp, pp, cp, tp with tp fastest: tp spans tp ranks, cp tp·cp, pp tp·cp·pp, ep tp·cp·pp·ep, dp all;
the span must divide the GPUs per node), on the network otherwise.

What it ignores: kernels' efficiency changing with the matmul shapes, the optimizer step and data loading, network
contention between groups, stragglers, imbalanced expert routing, and memory beyond what autograd keeps and the
model states (temporaries, the allocator's cache, communication buffers: BLOOM's published 60 GB per GPU against
our 40 GiB shows how much). docs/reference.md#finding-a-layout-the-planner has the derivations and the published
runs with their sources.
"""
import math

from picotron.pipeline_schedules import bubble_formula, build, layer_costs, simulate
from picotron.planner import RECIPES, chunks_held, cp_bytes_per_step, cp_messages_per_layer, stage_layers
from picotron.planner import async_tp_layer_seconds
from picotron.planner import ep_overlap_exposed_seconds


def ring_time(kind, n, nbytes, alpha, bw):
    """One collective over n ranks on a ring (nccl-tests' bus-bandwidth convention): an all-reduce is a
    reduce-scatter then an all-gather, 2(n−1) steps each moving 1/n of the buffer; the others take n−1 steps."""
    if n <= 1:
        return 0.0
    steps, share = (2 * (n - 1), 2 * (n - 1) / n) if kind == "all_reduce" else (n - 1, (n - 1) / n)
    return steps * alpha + share * nbytes / bw


def link(hw, span):
    """(α, bandwidth) of a group spanning `span` consecutive ranks: NVLink when every such group lies inside a node
    (span divides the GPUs per node), the network otherwise."""
    inside = span <= hw.gpus_per_node and hw.gpus_per_node % span == 0
    return (hw.intra_alpha, hw.intra_bw) if inside else (hw.inter_alpha, hw.inter_bw)


def shard_span(layout):
    """How many consecutive ranks one HSDP shard group spans (grid order dp, pp, cp, tp): its cp ranks alone (tp·cp)
    when dp_shard = 1, else dp_shard whole dp coordinates (tp·cp·pp each). On NVLink when that divides a node."""
    return layout.tp * layout.cp * (layout.pp * layout.dp_shard if layout.dp_shard > 1 else 1)


def dualpipe_bubble(p, m, F=1.0, B=2.0, W=1.0):
    """DualPipe's idle fraction of the step: DeepSeek-V3's Table 2 gives the idle time (p/2 − 1)(F&B + B − 3W), F, B, W
    a stage's forward, whole backward and weight-gradient part for one micro-batch, F&B an overlapped forward and
    backward pair, here F + B (no overlap of computation with communication modelled). A rank computes m micro-batches
    on a stage's share of the layers (m/2 from each end, each through its two stages): m(F + B) busy."""
    idle = (p / 2 - 1) * ((F + B) + B - 3 * W)
    return idle / (idle + m * (F + B))


def _bubble(layout):
    """The idle fraction of a step under this layout's schedule (pipeline_schedules.bubble_formula; ZB-V from its
    simulation, DualPipe from its Table 2)."""
    p, m, v = layout.pp, layout.grad_acc, layout.pp_chunks
    if p == 1:
        return 0.0
    if layout.pp_schedule == "zb-v":
        return simulate(build("zb-v", p, m)).bubble
    if layout.pp_schedule == "dualpipe":
        return dualpipe_bubble(p, m)
    return bubble_formula(layout.pp_schedule, p, m, v)


def _chunks(layout):
    """Chunks (stages) a pipeline rank holds: interleaved v, zb-v and DualPipe 2, else 1."""
    return len(chunks_held(layout, 0)[1])


def busiest_share(mc, layout, seq_len):
    """(share of the model's FLOPs on the busiest pipeline rank, its layers): 1/pp when the stages balance; the
    layers are cut as the pipeline cuts them (split_layers: the head's matmul counts, the embedding does not)."""
    if layout.pp == 1:
        return 1.0, mc.num_hidden_layers
    costs = layer_costs(mc, seq_len)
    cuts = stage_layers(mc, chunks_held(layout, 0)[0], seq_len, layout.bare_ends)
    # DualPipe: each micro-batch passes one of a rank's two stages (half from each end): the mean of the two
    runs = 2 if layout.pp_schedule == "dualpipe" else 1
    best = (0.0, 0)
    for rank in range(layout.pp):
        held = chunks_held(layout, rank)[1]
        flops = sum(sum(costs[1 + lo:1 + hi]) + (costs[-1] if st == len(cuts) - 1 else 0)
                    for st in held for lo, hi in [cuts[st]])
        best = max(best, (flops / runs, sum(cuts[st][1] - cuts[st][0] for st in held) / runs))
    return best[0] / sum(costs), best[1]


def _async_tp_per_layer(mc, layout, tokens, el, rate, alpha, bw):
    """Async TP's exposed tp seconds per layer and micro-batch (planner.async_tp_layer_seconds: each ring step hidden
    under one chunk's matmul); full recomputation redoes the forward's two collective matmuls, the attention pair and
    the MLP pair: + half the forward and backward's exposure, as the blocking model adds 2 of its 4 all-reduces."""
    exposed = async_tp_layer_seconds(mc, tokens, layout.tp, el, rate, alpha, bw)
    return exposed * (1.5 if layout.recompute in ("full", "partitioned") else 1.0)


# ------------------------------------------------------------------------------ --ep-overlap (expert all-to-alls)
def _ep_overlap_per_layer(mc, layout, tokens, el, rate, alpha, bw):
    """--ep-overlap's exposed all-to-all seconds per MoE layer and micro-batch of `tokens` tokens on one rank, forward
    and backward (planner.ep_overlap_exposed_seconds): one part's all-to-all carries half of the k copies of each
    token; one part's experts compute on as many rows as it sent (balanced routing), 2·3·h·i/tp FLOPs a row forward,
    twice that backward; the shared experts run on every token."""
    e, t, h, k = layout.ep, layout.tp, mc.hidden_size, mc.num_experts_per_tok
    a = ring_time("all_to_all", e, tokens * k * h * el / 2, alpha, bw)
    row = 2 * 3 * h * mc.expert_size / t / rate  # one row through one expert, forward
    experts, shared = tokens * k / 2 * row, tokens * mc.n_shared_experts * row
    return ep_overlap_exposed_seconds(a, experts, shared) + ep_overlap_exposed_seconds(a, 2 * experts, 2 * shared)
# ------------------------------------------------------------------------------------------ end --ep-overlap


def step_time(mc, layout, seq_len, hw, dtype="bf16", recipe="mixed"):
    """Predicted seconds of one optimizer step by part (module docstring), with tokens/s, model FLOP/s per GPU
    (`tflops`: 6N + 12·L·h·s per token, no recomputation), `hardware_tflops` (with the recomputed forward) and MFU
    against the datasheet peak."""
    L, h, s = mc.num_hidden_layers, mc.hidden_size, seq_len
    t, c, p, d, e, m, b = layout.tp, layout.cp, layout.pp, layout.dp, layout.ep, layout.grad_acc, layout.micro_batch_size
    el = 2 if dtype == "bf16" else 4
    gpus = layout.gpus
    tokens = d * m * b * s
    per_token = mc.flops_per_token(s)
    extra = {"full": per_token / 3, "partitioned": per_token / 3, "selective": 4 * L * h * s, "none": 0}[layout.recompute]
    share, layers = busiest_share(mc, layout, s)
    rate = hw.peak * hw.efficiency
    compute = (per_token + extra) * tokens / gpus * (share * p) / rate  # the busiest rank's FLOPs
    local = b * (s // c)  # tokens of one micro-batch on one rank
    # tensor parallelism: 4 all-reduces of the activation per layer and micro-batch (+2 with full recompute)
    calls = 4 + (2 if layout.recompute in ("full", "partitioned") else 0)
    tp = m * layers * calls * ring_time("all_reduce", t, local * h * el, *link(hw, t))
    if getattr(layout, "async_tp", False) and layout.sp and t > 1:  # async TP: the collective matmul (its own block)
        tp = m * layers * _async_tp_per_layer(mc, layout, local, el, rate, *link(hw, t))
    if layout.recompute == "partitioned":  # + the all-gather of each layer's checkpoint before its recompute
        tp += m * layers * ring_time("all_gather", t, local * h * 4, *link(hw, t))
    # context parallelism: the bytes a rank's attention sends per layer and micro-batch (planner.cp_bytes_per_step,
    # what context_parallel sends) over the link of its group, plus α per message (planner.cp_messages_per_layer: the
    # ring's 3cp − 2, the all-gather's 2(cp − 1)) hide under the attention core's compute where it is longer; Ulysses'
    # 8 all-to-alls of cp − 1 steps are not overlapped (full recomputation repeats the forward's 4)
    cp = 0.0
    if c > 1:
        a_link = link(hw, t * c)
        nbytes = cp_bytes_per_step(c, b, s, mc.num_key_value_heads // t, mc.head_dim, layers=1, elem=el,
                                   impl=layout.cp_impl, heads=mc.num_attention_heads // t)
        if layout.cp_impl == "ulysses":
            again = 1.5 if layout.recompute in ("full", "partitioned") else 1.0
            cp = m * layers * again * (cp_messages_per_layer(c, "ulysses") * a_link[0] + nbytes / a_link[1])
        else:
            steps = cp_messages_per_layer(c, layout.cp_impl)
            attn_compute = 12 * h * s * local / t / rate  # forward + backward, this rank's heads
            cp = m * layers * max(0.0, steps * a_link[0] + nbytes / a_link[1] - attn_compute)
    # expert parallelism: 4 all-to-alls of the k copies of each token per MoE layer and micro-batch
    ep = 0.0
    if mc.is_moe and e > 1:
        ep = m * layers * 4 * ring_time("all_to_all", e, local * mc.num_experts_per_tok * h * el,
                                        *link(hw, t * c * p * e))
        if getattr(layout, "ep_overlap", False):  # --ep-overlap (its own block): two parts, each under the other's
            ep = m * layers * _ep_overlap_per_layer(mc, layout, local, el, rate, *link(hw, t * c * p * e))
    # pipeline: one activation and one gradient per micro-batch and chunk, then the bubble
    v = 1 if layout.pp_schedule == "dualpipe" else _chunks(layout)  # DualPipe: a micro-batch crosses a rank once
    p_link = link(hw, t * c * p)
    pp_p2p = 2 * m * v * (p_link[0] + local * h * el / (t if layout.sp else 1) / p_link[1]) if p > 1 else 0.0
    busy = compute + tp + cp + ep + pp_p2p
    bubble_fraction = _bubble(layout)
    bubble = busy * bubble_fraction / (1 - bubble_fraction) if bubble_fraction < 1 else math.inf
    # data parallelism over dp x cp, in the recipe's gradient precision: ZeRO-0/1 all-reduce (reduce-scatter +
    # all-gather) once, overlapped with the last micro-batch's backward; ZeRO-2/3 without pp hold only their shard of
    # the gradients, so they reduce-scatter every micro-batch's (overlapped with every backward) and all-gather the
    # updated parameters (ZeRO-3: for every micro-batch's forward and backward instead, overlapped with all the
    # compute). With pp, ZeRO-2/3 accumulate as ZeRO-1 does (picotron.zero, zero3: `accumulate=True`): a chunk's
    # gradients are reduce-scattered once, at its last backward, and ZeRO-3 gathers the stage once per step, keeping it
    # for all its micro-batches (torchtitan's reshard_after_forward=False under a pipeline). The last backward is the
    # step's end on the first stage (1F1B's cool-down), so nothing but that backward is there to hide it under.
    # DualPipe holds two stages (2x the parameters) and sums each stage's gradients between its two ranks too: an
    # all-reduce over 2 on the pp link, hidden like dp's.
    params = mc.num_params() / (t * p) * (2 if layout.pp_schedule == "dualpipe" and p > 1 else 1)
    grad_bytes = params * (4 if dtype == "fp32" else RECIPES[recipe][1])
    dp_link = link(hw, gpus)
    n = d * c
    replicas = 0.0  # HSDP: ZeRO's collectives within a shard group, on NVLink where the group lies in a node; then
    if layout.zero and 0 < layout.dp_shard < d:  # the gradient shard (1/n_s) all-reduced over the replicas on the
        n, dp_link = layout.shard, link(hw, shard_span(layout))  # network, after the last reduce-scatter
        replicas = ring_time("all_reduce", d // layout.dp_shard, grad_bytes / n, *link(hw, gpus))  # (not overlapped)
    twins = ring_time("all_reduce", 2, grad_bytes, *p_link) if layout.pp_schedule == "dualpipe" and p > 1 else 0.0
    if layout.zero >= 2 and p == 1:  # a reduce-scatter per micro-batch, each under its own backward
        gathers = 2 * m if layout.zero == 3 else 1
        dp_total = (m * ring_time("reduce_scatter", n, grad_bytes, *dp_link)
                    + gathers * ring_time("all_gather", n, params * el, *dp_link))
        # ZeRO-3 gathers before every forward and backward: all the compute hides it
        overlap = compute if layout.zero == 3 else (2 / 3) * compute
    elif layout.zero >= 2:  # pp > 1: the gradients summed over the micro-batches (accumulate=True), one
        # reduce-scatter per chunk at its last backward and one all-gather per step: ZeRO-1's traffic at ZeRO-1's time,
        # hidden as ZeRO-1's, behind the last micro-batch's backward (ZeRO-3's gather, at the first forward, would hide
        # under that forward instead: not counted, to keep the three stages' pipelines charged alike)
        dp_total = (ring_time("reduce_scatter", n, grad_bytes, *dp_link)
                    + ring_time("all_gather", n, params * el, *dp_link))
        overlap = (2 / 3) * compute / m
    else:
        dp_total = ring_time("all_reduce", n, grad_bytes, *dp_link)
        overlap = (2 / 3) * compute / m
    dp = max(0.0, dp_total + twins - overlap) + replicas
    total = busy + bubble + dp
    out = {"compute": compute, "tp": tp, "cp": cp, "ep": ep, "pp": pp_p2p, "bubble": bubble, "dp": dp, "total": total}
    out["tokens_per_s"] = tokens / total
    out["tflops"] = per_token * tokens / total / gpus / 1e12
    out["hardware_tflops"] = (per_token + extra) * tokens / total / gpus / 1e12
    out["mfu"] = per_token * tokens / total / gpus / hw.peak
    return out

