"""Find a layout: `python -m picotron.plan --preset llama3-8b --gpus 64 --gpu h100-80gb --seq-len 8192 --global-batch-tokens 4M`.

The Ultra-Scale Playbook's procedure, as a program: (1) fit in memory, (2) reach the global batch, (3) among what
remains, take the fastest. `planner.memory_per_stage` gives the bytes of a layout; this module adds

  * `Hardware` and the `GPUS` table (datasheet peaks and links, with sources);
  * `step_time`: seconds of one optimizer step by part, from an α-β model of every strategy's collectives;
  * `search`: every layout of a job, ranked by predicted tokens/s, and the rejected ones with their reason;
  * when none fits: `least_memory` (the least any layout needs, and which), `fewest_gpus` (the fewest at which one
    fits) and `bounding` (the refusals that keep out a layout needing less; the others are not listed);
  * `PUBLISHED`: large runs whose layout and throughput were published, evaluated and ranked by the same model;
  * the command line (`--layout tp8,pp16,dp128` evaluates one layout instead of searching; every layout a table row
    or --published prints, e.g. `dp2,tp4,pp2,cp4,ulysses,sp,zero1,interleaved-v2,mbs2,ga32`, is accepted verbatim and
    evaluates the same).

Runs or not: a layout picotron's trainer refuses is refused with the trainer's sentence (`trainer_problem`: the rules
`picotron.rules` applies, each strategy's rule and `combination_problem`; no copy here). DualPipe and Ulysses
are modelled by name whether or not this trainer has them yet (picotron.config's PP_SCHEDULES, CP_IMPLS); the search
offers them once it does. The published runs ran on other software: only the model's shapes and memory judge them.

Headroom: a layout may fill only 1 − HEADROOM (0.9) of each GPU's memory by default (`usable`; `--headroom 0.2`
keeps 20% free, `--headroom 0` none): the model below counts the parameters, gradients, optimizer state and what
autograd keeps, not the CUDA context, NCCL's buffers, the allocator's fragmentation or the temporaries, which take
several GiB of an 80 GB card. The header of every answer says how much is usable. `--published` judges the published
runs against the whole card (they ran).

The time model (every term in one function, `step_time`), for one rank of the busiest pipeline stage:
  compute   FLOPs per token (6N + 12·L·h·s, the trainer's count, attention not halved for causality; + the recomputed
            forward: 2N + 4·L·h·s with full recomputation, the attention core's 4·L·h·s with selective) × the step's
            tokens ÷ GPUs × the busiest rank's share of the layers (and the head), at peak × efficiency. One
            efficiency for every run (EFFICIENCY), not tuned per run.
  tp        per layer and micro-batch 4 all-reduces of b·(s/cp)·h elements (2 forward, 2 backward; with sp the same
            bytes as all-gathers + reduce-scatters; full recomputation repeats the 2 forward ones); not overlapped.
  cp        ring attention: per layer and micro-batch (cp−1) K/V blocks forward, (cp−1) K/V + (cp−1) dK/dV backward,
            overlapped with that layer's attention compute: only the excess counts. Ulysses (Jacobs et al. 2023,
            arXiv:2309.14509): per layer and micro-batch 4 all-to-alls forward (q, k, v, the output) and 4 backward,
            each of a rank's b·(s/cp)·heads·d elements (k, v: its KV heads, repeated until cp divides them), (cp−1)/cp
            of them leaving; not overlapped; full recomputation repeats the forward's 4.
  ep        per MoE layer and micro-batch 4 all-to-alls (dispatch and combine, forward and backward) of the k copies
            of each token; not overlapped.
  pp        point-to-point: per micro-batch and chunk one activation forward and one gradient backward; the bubble:
            the schedule's idle fraction B (1F1B/AFAB (p−1)/(m+p−1), interleaved (p−1)/(vm+p−1), ZB-H1
            (p−1)/(3m+p−1), ZB-V from the simulator, DualPipe DeepSeek-V3's Table 2: idle (p/2−1)(F&B + B − 3W) =
            2(p/2−1) with F = W = 1, B = 2, F&B = F + B, against 3m busy) stretches the busy time by 1/(1−B).
  dp        over dp×cp, gradients in the recipe's precision: ZeRO-0/1 one all-reduce (reduce-scatter + all-gather)
            hidden behind the last micro-batch's backward (2/3 of its compute); ZeRO-2/3 keep only a shard of the
            gradients, so they reduce-scatter every micro-batch's, hidden behind every backward, then all-gather the
            parameters (ZeRO-3: for every micro-batch's forward and backward, hidden behind all the compute; with
            pp > 1 once per step, the stage keeping them gathered for all its micro-batches, as torchtitan's
            reshard_after_forward=False under a pipeline: ZeRO-2's traffic, hidden as ZeRO-2's). DualPipe's two
            copies of each stage also all-reduce their gradients (2 ranks, once per step). Only the excess counts.
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
import argparse
import math
import sys
from dataclasses import dataclass, field, replace

from picotron.config import CP_IMPLS as TRAINER_CP_IMPLS, PP_SCHEDULES as TRAINER_PP_SCHEDULES
from picotron.pipeline_schedules import bubble_formula, build, layer_costs, simulate
from picotron.planner import (RECIPES, Layout, chunks_held, memory_per_gpu, memory_per_stage, stage_layers,
                              ulysses_kv_heads)

GiB = 1024 ** 3
MiB = 1024 ** 2
# Achieved / datasheet FLOP/s of a layer's kernels (matmuls, attention, norms, elementwise): one round value for
# every prediction, not fitted per run. A large bf16 matmul alone reaches about 0.8 of the H100's datasheet peak.
EFFICIENCY = 0.6


@dataclass(frozen=True)
class Hardware:
    """One kind of accelerator and its links. peak: dense bf16 FLOP/s (fp32 on a CPU: what it measured); memory: the
    bytes a process sees (nvidia-smi's total); α: seconds per ring step; bw: bytes/s per device and direction."""
    name: str
    peak: float
    memory: float
    gpus_per_node: int = 8
    intra_alpha: float = 5e-6
    intra_bw: float = 300e9
    inter_alpha: float = 10e-6
    inter_bw: float = 25e9
    efficiency: float = EFFICIENCY
    source: str = ""


GPUS = {  # datasheet dense bf16 peaks, memory as nvidia-smi / torch report it, NVLink per direction, network per GPU
    "a100-40gb": Hardware("A100 40GB SXM", 312e12, 40537 * MiB, 8, 5e-6, 300e9, 10e-6, 25e9,
                          source="NVIDIA A100 datasheet (312 TFLOP/s bf16 dense; NVLink 3: 600 GB/s both ways; nvidia-smi "
                                 "shows 40,537 MiB); DGX A100: 8 x 200 Gb/s HDR InfiniBand per node"),
    "a100-80gb": Hardware("A100 80GB SXM", 312e12, 85_056_798_720, 8, 5e-6, 300e9, 10e-6, 25e9,
                          source="NVIDIA A100 datasheet (torch reports 85,056,798,720 bytes = 79.2 GiB); DGX A100 / "
                                 "Selene: 8 x 200 Gb/s HDR InfiniBand per node"),
    "h100-80gb": Hardware("H100 80GB SXM", 989.5e12, 81559 * MiB, 8, 5e-6, 450e9, 10e-6, 50e9,
                          source="NVIDIA H100 datasheet (989.5 TFLOP/s bf16 dense; NVLink 4: 900 GB/s both ways; "
                                 "nvidia-smi shows 81,559 MiB); 400 Gb/s InfiniBand or RoCE per GPU"),
    "h200": Hardware("H200 141GB SXM", 989.5e12, 143771 * MiB, 8, 5e-6, 450e9, 10e-6, 50e9,
                     source="NVIDIA H200 datasheet (H100's compute, 141 GB HBM3e; nvidia-smi shows 143,771 MiB); "
                            "400 Gb/s per GPU"),
}


# Of each GPU's memory, the fraction a plan leaves free by default for what the memory model does not count: the CUDA
# context and kernels' modules (0.5-1 GiB), NCCL's buffers (hundreds of MiB per communicator), the caching allocator's
# fragmentation and the temporaries of the largest op, several GiB on an 80 GB card together. `--headroom 0` drops it.
HEADROOM = 0.1


def usable(hw, headroom=HEADROOM):
    """`hw` with the memory a plan may fill: all but `headroom` (a fraction) of the card's."""
    if not 0 <= headroom < 1:
        raise ValueError(f"--headroom {headroom} must be a fraction in [0, 1); e.g. --headroom 0.1 keeps 10% of each "
                         f"GPU's memory free.")
    return replace(hw, memory=hw.memory * (1 - headroom))


def cpu_hardware(peak, alpha, bw, cores, memory=16 * GiB, efficiency=1.0):
    """This machine as the planner sees it: `peak` measured (picotron.metrics.measured_matmul_peak on one thread),
    the gloo link's α (s) and bandwidth (bytes/s) measured between two processes, one 'GPU' per core."""
    return Hardware("this CPU", peak, memory, cores, alpha, bw, alpha, bw, efficiency, source="measured")


# --------------------------------------------------------------------------------------------- the time model
def _ring(kind, n, nbytes, alpha, bw):
    """One collective over n ranks on a ring (nccl-tests' bus-bandwidth convention): an all-reduce is a
    reduce-scatter then an all-gather, 2(n−1) steps each moving 1/n of the buffer; the others take n−1 steps."""
    if n <= 1:
        return 0.0
    steps, share = (2 * (n - 1), 2 * (n - 1) / n) if kind == "all_reduce" else (n - 1, (n - 1) / n)
    return steps * alpha + share * nbytes / bw


def _link(hw, span):
    """(α, bandwidth) of a group spanning `span` consecutive ranks: NVLink when every such group lies inside a node
    (span divides the GPUs per node), the network otherwise."""
    inside = span <= hw.gpus_per_node and hw.gpus_per_node % span == 0
    return (hw.intra_alpha, hw.intra_bw) if inside else (hw.inter_alpha, hw.inter_bw)


def dualpipe_bubble(p, m, F=1.0, B=2.0, W=1.0):
    """DualPipe's idle fraction of the step: DeepSeek-V3's Table 2 gives the idle time (p/2 − 1)(F&B + B − 3W), F, B, W
    a stage's forward, whole backward and weight-gradient part for one micro-batch, F&B an overlapped forward and
    backward pair, here F + B (no overlap of computation with communication modelled). A rank computes m micro-batches
    on a stage's share of the layers (m/2 from each end, each through its two stages): m(F + B) busy."""
    idle = (p / 2 - 1) * ((F + B) + B - 3 * W)
    return idle / (idle + m * (F + B))


def _bubble(layout):
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
    cuts = stage_layers(mc, chunks_held(layout, 0)[0], seq_len)
    # DualPipe: each micro-batch passes one of a rank's two stages (half from each end): the mean of the two
    runs = 2 if layout.pp_schedule == "dualpipe" else 1
    best = (0.0, 0)
    for rank in range(layout.pp):
        held = chunks_held(layout, rank)[1]
        flops = sum(sum(costs[1 + lo:1 + hi]) + (costs[-1] if st == len(cuts) - 1 else 0)
                    for st in held for lo, hi in [cuts[st]])
        best = max(best, (flops / runs, sum(cuts[st][1] - cuts[st][0] for st in held) / runs))
    return best[0] / sum(costs), best[1]


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
    tp = m * layers * calls * _ring("all_reduce", t, local * h * el, *_link(hw, t))
    if layout.recompute == "partitioned":  # + the all-gather of each layer's checkpoint before its recompute
        tp += m * layers * _ring("all_gather", t, local * h * 4, *_link(hw, t))
    # context parallelism: the ring's K/V blocks, hidden under the attention core's compute where it is longer;
    # Ulysses' 4 all-to-alls forward (q, k, v, out) and 4 backward, each rank's b·(s/cp) tokens of a tp rank's heads
    # (KV heads repeated until cp divides them), (cp−1)/cp of it leaving, not overlapped (+4 with full recompute)
    kv = mc.num_key_value_heads * mc.head_dim
    block = 2 * local * kv * el / t
    a_link = _link(hw, t * c)
    if c > 1 and layout.cp_impl == "ulysses":
        kv_heads = ulysses_kv_heads(mc.num_key_value_heads // t, c)
        q_bytes, kv_bytes = local * h / t * el, local * kv_heads * mc.head_dim * el
        one = 2 * _ring("all_to_all", c, q_bytes, *a_link) + 2 * _ring("all_to_all", c, kv_bytes, *a_link)  # q,out; k,v
        cp = m * layers * one * (3 if layout.recompute in ("full", "partitioned") else 2)
    else:
        ring = 4 * (c - 1) * (a_link[0] + block / a_link[1]) if c > 1 else 0.0
        attn_compute = 12 * h * s * local / t / rate  # forward + backward, this rank's heads
        cp = m * layers * max(0.0, ring - attn_compute)
    # expert parallelism: 4 all-to-alls of the k copies of each token per MoE layer and micro-batch
    ep = 0.0
    if mc.is_moe and e > 1:
        ep = m * layers * 4 * _ring("all_to_all", e, local * mc.num_experts_per_tok * h * el, *_link(hw, t * c * p * e))
    # pipeline: one activation and one gradient per micro-batch and chunk, then the bubble
    v = 1 if layout.pp_schedule == "dualpipe" else _chunks(layout)  # DualPipe: a micro-batch crosses a rank once
    p_link = _link(hw, t * c * p)
    pp_p2p = 2 * m * v * (p_link[0] + local * h * el / (t if layout.sp else 1) / p_link[1]) if p > 1 else 0.0
    busy = compute + tp + cp + ep + pp_p2p
    bubble_fraction = _bubble(layout)
    bubble = busy * bubble_fraction / (1 - bubble_fraction) if bubble_fraction < 1 else math.inf
    # data parallelism over dp x cp, in the recipe's gradient precision: ZeRO-0/1 all-reduce (reduce-scatter +
    # all-gather) once, overlapped with the last micro-batch's backward; ZeRO-2/3 hold only their shard of the
    # gradients, so they reduce-scatter every micro-batch's (overlapped with every backward) and all-gather the updated
    # parameters (ZeRO-3: for every micro-batch's forward and backward instead, overlapped with all the compute; with
    # pp once per step, the stage keeping them gathered for all its micro-batches: torchtitan's
    # reshard_after_forward=False under a pipeline). DualPipe holds two stages (2x the parameters) and sums each stage's
    # gradients between its two ranks too: an all-reduce over 2 on the pp link, hidden like dp's.
    params = mc.num_params() / (t * p) * (2 if layout.pp_schedule == "dualpipe" and p > 1 else 1)
    grad_bytes = params * (4 if dtype == "fp32" else RECIPES[recipe][1])
    dp_link = _link(hw, gpus)
    n = d * c
    twins = _ring("all_reduce", 2, grad_bytes, *p_link) if layout.pp_schedule == "dualpipe" and p > 1 else 0.0
    if layout.zero >= 2:
        gathers = (1 if p > 1 else 2 * m) if layout.zero == 3 else 1
        dp_total = m * _ring("reduce_scatter", n, grad_bytes, *dp_link) + gathers * _ring("all_gather", n, params * el,
                                                                                          *dp_link)
        # ZeRO-3 without pp gathers before every forward and backward: all the compute hides it; with pp its one
        # gather per step is ZeRO-2's all-gather moved to the step's start: hidden like ZeRO-2's, behind the backwards
        overlap = compute if layout.zero == 3 and p == 1 else (2 / 3) * compute
    else:
        dp_total = _ring("all_reduce", n, grad_bytes, *dp_link)
        overlap = (2 / 3) * compute / m
    dp = max(0.0, dp_total + twins - overlap)
    total = busy + bubble + dp
    out = {"compute": compute, "tp": tp, "cp": cp, "ep": ep, "pp": pp_p2p, "bubble": bubble, "dp": dp, "total": total}
    out["tokens_per_s"] = tokens / total
    out["tflops"] = per_token * tokens / total / gpus / 1e12
    out["hardware_tflops"] = (per_token + extra) * tokens / total / gpus / 1e12
    out["mfu"] = per_token * tokens / total / gpus / hw.peak
    return out


# ------------------------------------------------------------------------------------------------- the search
def _divisors(n, limit=None):
    return [k for k in range(1, n + 1) if n % k == 0 and (limit is None or k <= limit)]


def trainer_problem(mc, layout, seq_len, dtype="bf16"):
    """The sentence with which picotron's trainer refuses this layout, or None: the same rules its `validate` applies
    before any process group exists (picotron.rules: each strategy's rule, then `combination_problem`), so the
    planner keeps no copy of them."""
    from picotron import rules
    from picotron.config import CP_IMPLS, PP_SCHEDULES, Config
    for name, value, known in (("pp_schedule", layout.pp_schedule, PP_SCHEDULES), ("cp_impl", layout.cp_impl, CP_IMPLS)):
        if value not in known:
            return f"{name}={value!r} is not in this picotron's trainer (it has {', '.join(known)})"
    cfg = Config(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, sp=layout.sp, zero=layout.zero,
                 pp_schedule=layout.pp_schedule, pp_chunks=layout.pp_chunks, cp_impl=layout.cp_impl,
                 micro_batch_size=layout.micro_batch_size, grad_acc=max(1, layout.grad_acc),
                 recompute=layout.recompute, seq_len=seq_len, dtype="fp32" if dtype == "fp32" else "bf16-params")
    for rule in rules.RULES + (rules.combination_problem,):
        problem = rule(cfg, mc)
        if problem:
            return problem
    return None


def check_layout(mc, layout, seq_len, hw, global_seqs, dtype="bf16", recipe="mixed", cross_node_tp=False,
                 rules=True):
    """(memory row, None) if the layout can run this job, else (memory row or None, one sentence why not). A tp group
    wider than a node is refused unless `cross_node_tp` (then it runs, its all-reduces on the network). `rules`: also
    refuse what picotron's trainer refuses (`trainer_problem`); off for runs of other software (PUBLISHED), judged only
    by the shapes the model needs and their memory."""
    heads, kv = mc.num_attention_heads, mc.num_key_value_heads
    if global_seqs % (layout.dp * layout.micro_batch_size):
        return None, _indivisible(global_seqs, layout)
    if heads % layout.tp or kv % layout.tp:
        return None, f"tp={layout.tp} does not divide the {heads} attention heads and {kv} KV heads"
    if (layout.tp > hw.gpus_per_node or hw.gpus_per_node % layout.tp) and not cross_node_tp:
        return None, (f"tp={layout.tp} crosses nodes of {hw.gpus_per_node} GPUs (its 4 all-reduces per layer would run "
                      f"on the network)")
    if seq_len % (2 * layout.cp):
        return None, f"seq_len {seq_len} does not split into 2·cp = {2 * layout.cp} chunks"
    if layout.pp * _chunks(layout) > mc.num_hidden_layers:
        return None, f"pp={layout.pp} (x{_chunks(layout)} chunks) has more stages than the {mc.num_hidden_layers} layers"
    if layout.pp_schedule == "interleaved" and layout.pp_chunks > 1 and layout.grad_acc % layout.pp:
        return None, f"interleaved needs the micro-batches ({layout.grad_acc}) to be a multiple of pp={layout.pp}"
    if mc.is_moe and (mc.num_local_experts % layout.ep or layout.dp % layout.ep):
        return None, f"ep={layout.ep} must divide the {mc.num_local_experts} experts and dp={layout.dp}"
    if not mc.is_moe and layout.ep > 1:
        return None, f"ep={layout.ep} needs a model with experts"
    problem = trainer_problem(mc, layout, seq_len, dtype) if rules else None
    if problem:
        return None, problem
    # what the model's formulas assume (the trainer's own checks say it too, in their words)
    if layout.pp > 1 and layout.pp_schedule == "dualpipe" and (layout.pp % 2 or layout.grad_acc < 2 * layout.pp):
        return None, (f"dualpipe needs an even pp ({layout.pp}) and at least 2·pp = {2 * layout.pp} micro-batches "
                      f"({layout.grad_acc}): half enter from each end")
    if layout.cp > 1 and layout.cp_impl == "ulysses" and (heads // layout.tp) % layout.cp:
        return None, f"ulysses with cp={layout.cp} needs the {heads // layout.tp} heads per tp rank divisible by cp"
    if layout.dp * layout.micro_batch_size * layout.grad_acc != global_seqs:
        return None, (f"the global batch of {global_seqs} sequences is not dp·mbs·grad_acc = {layout.dp}·"
                      f"{layout.micro_batch_size}·{layout.grad_acc}")
    mem = memory_per_gpu(mc, layout, seq_len, dtype, recipe)
    if mem["total"] > hw.memory:
        parts = ", ".join(f"{k} {mem[k] / GiB:.1f}" for k in ("params", "grads", "optimizer", "activations"))
        return mem, f"does not fit: {mem['total'] / GiB:.1f} GiB > {hw.memory / GiB:.1f} GiB ({parts})"
    return mem, None


def _indivisible(global_seqs, layout):
    return (f"the global batch of {global_seqs} sequences is not divisible by dp·mbs = {layout.dp}·"
            f"{layout.micro_batch_size}")


SPACE = dict(  # what `candidates` enumerates; a run's `available` narrows it
    max_tp=None,  # None: a node
    cp=(1, 2, 4, 8, 16),
    zero=(0, 1, 2, 3),
    sp=(False, True),
    recompute=("none", "selective", "full"),
    schedules=(("1f1b", 1), ("interleaved", 2)),
    micro_batches=(1, 2, 4, 8),
    cp_impls=("ring", "ulysses"),  # with cp > 1
)
# DualPipe and Ulysses are searched once picotron's trainer has them (picotron.config's PP_SCHEDULES and CP_IMPLS)
SPACE["schedules"] += (("dualpipe", 1),) * ("dualpipe" in TRAINER_PP_SCHEDULES)
SPACE["cp_impls"] = tuple(c for c in SPACE["cp_impls"] if c in TRAINER_CP_IMPLS)


def candidates(mc, gpus, hw, seq_len, global_seqs, space=None):
    """Every layout of the job in `space` (SPACE by default): tp dividing a node (or whole nodes up to max_tp), cp, pp
    up to the layers,
    dp = the rest, ep (MoE), micro-batch size, ZeRO stage, sp, recomputation, pipeline schedule. A micro-batch size
    that does not divide the batch comes out once, with grad_acc = 0."""
    sp_ = {**SPACE, **(space or {})}
    node = hw.gpus_per_node
    for tp in (k for k in _divisors(gpus, sp_["max_tp"] or node) if (node % k == 0 if k <= node else k % node == 0)):
        for cp in (k for k in _divisors(gpus // tp) if k in sp_["cp"]):
            for pp in _divisors(gpus // (tp * cp), mc.num_hidden_layers):
                dp = gpus // (tp * cp * pp)
                for ep in (_divisors(math.gcd(dp, mc.num_local_experts)) if mc.is_moe else [1]):
                    for mbs in sp_["micro_batches"]:
                        if global_seqs % (dp * mbs):
                            yield Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, micro_batch_size=mbs, grad_acc=0)
                            continue
                        ga = global_seqs // (dp * mbs)
                        for zero in sp_["zero"]:
                            for sp in (sp_["sp"] if tp > 1 else (False,)):
                                for recompute in sp_["recompute"]:
                                    for sched, v in (sp_["schedules"] if pp > 1 else (("1f1b", 1),)):
                                        for impl in (sp_["cp_impls"] if cp > 1 else ("ring",)):
                                            yield Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, sp=sp, zero=zero,
                                                         pp_schedule=sched, pp_chunks=v, cp_impl=impl,
                                                         micro_batch_size=mbs, grad_acc=ga, recompute=recompute)


@dataclass
class Plan:
    ranked: list  # [(layout, memory row, time row)], fastest first
    rejected: list  # [(layout, reason)]
    short: list = field(default_factory=list)  # [(layout, memory row)]: the rejected ones refused for memory alone


def search(mc, gpus, hw, seq_len, global_seqs, dtype="bf16", recipe="mixed", space=None, rules=True):
    """Rank every feasible layout by predicted tokens/s (ties: less memory, then fewer strategies); keep each rejected
    one's reason. tp wider than a node is searched only when space["max_tp"] asks for it (then it runs, flagged).
    `rules`: refuse what picotron's trainer refuses (check_layout)."""
    ranked, rejected, short = [], [], []
    cross = bool(space and (space.get("max_tp") or 0) > hw.gpus_per_node)
    for layout in candidates(mc, gpus, hw, seq_len, global_seqs, space):
        if layout.grad_acc == 0:
            rejected.append((layout, _indivisible(global_seqs, layout)))
            continue
        mem, why = check_layout(mc, layout, seq_len, hw, global_seqs, dtype, recipe, cross_node_tp=cross, rules=rules)
        if why:
            rejected.append((layout, why))
            if mem is not None:  # everything but its memory would run
                short.append((layout, mem))
        else:
            ranked.append((layout, mem, step_time(mc, layout, seq_len, hw, dtype, recipe)))
    ranked.sort(key=lambda r: (-float(f"{r[2]['tokens_per_s']:.9g}"), r[1]["total"], _complexity(r[0])))
    return Plan(ranked, rejected, short)


# ------------------------------------------------------------------------------------- when no layout fits
def least_memory(plan):
    """(layout, memory row) of the layout needing the least memory per GPU among those refused for memory alone (every
    other rule holds), or None: what the job needs at the least, whatever the layout."""
    return min(plan.short, key=lambda r: r[1]["total"], default=None)


def counts_above(gpus, per_node):
    """The GPU counts above `gpus` a job may take, in order: below a node the divisors of a node (tp's rule), then
    whole nodes."""
    n = gpus + 1
    while True:
        if n % per_node == 0 or (n < per_node and per_node % n == 0):
            yield n
        n += 1


def fewest_gpus(mc, gpus, hw, seq_len, global_seqs, dtype="bf16", recipe="mixed", space=None, tries=16):
    """(n, plan at n): the fewest GPUs above `gpus` at which a layout fits, or (None, the last count searched) after
    `tries` searches. A count whose GPUs together cannot hold the model states (RECIPES' bytes per parameter: each
    parameter's are held at least once, so some GPU holds at least their n-th part) is skipped without a search."""
    states = sum(RECIPES[recipe]) * mc.num_params() * (1 - 1e-6)  # (1e-6: tp's cuts round a few elements down)
    for n in counts_above(gpus, hw.gpus_per_node):
        if states / n > hw.memory:
            continue
        found = search(mc, n, hw, seq_len, global_seqs, dtype, recipe, space)
        tries -= 1
        if found.ranked or tries == 0:
            return (n if found.ranked else None), (found if found.ranked else n)


def bounding(mc, plan, least, seq_len, hw, global_seqs, dtype="bf16", recipe="mixed", space=None):
    """The layouts refused for a rule, not for memory, that would need less memory than `least` (a memory row): the
    rules that bound the answer. A refusal whose layouts would need more (or whose shapes leave no memory to count:
    tp not dividing the heads, the batch) changes nothing: lift it and still no layout fits."""
    cross = bool(space and (space.get("max_tp") or 0) > hw.gpus_per_node)
    out = []
    for layout, why in plan.rejected:
        if layout.grad_acc == 0 or why.startswith("does not fit"):
            continue
        mem, _ = check_layout(mc, layout, seq_len, hw, global_seqs, dtype, recipe, cross_node_tp=cross, rules=False)
        if mem is not None and mem["total"] < least["total"]:
            out.append((layout, why, mem))
    return out


def _complexity(layout):
    return (sum(getattr(layout, k) > 1 for k in ("tp", "pp", "cp", "ep")) + layout.sp + layout.zero,
            str(layout))


def rank_of(plan, layout):
    """1-based rank of `layout` in the plan, or None if it was not a candidate or was rejected."""
    return next((i for i, (lay, _, _) in enumerate(plan.ranked, 1) if lay == layout), None)


def why_faster(slow, fast):
    """One clause: the parts of the step where `fast` (a step_time row) saves the most time over `slow`."""
    gains = sorted(((slow[k] - fast[k], k) for k in ("compute", "tp", "cp", "ep", "pp", "bubble", "dp")), reverse=True)
    said = [f"{k} {slow[k]:.2f} -> {fast[k]:.2f} s" for g, k in gains if g > 0.02 * slow["total"]][:3]
    return ", ".join(said) or "about the same parts"


# -------------------------------------------------------------------------------------------- published runs
@dataclass(frozen=True)
class Published:
    name: str
    model: dict  # ModelConfig fields
    gpus: int
    hardware: Hardware
    layout: Layout
    seq_len: int
    global_seqs: int
    tflops: float  # published TFLOP/s per GPU
    source: str
    counts_recompute: bool = True  # the published figure counts the recomputed forward (Megatron's eq. 3)
    available: dict = field(default_factory=dict)  # the search space the run's software offered (SPACE overrides)
    memory_gb: float = 0.0  # published memory per GPU (GB), 0 if not published
    recipe: str = "mixed"  # the bytes per parameter of its precision recipe (planner.RECIPES)
    notes: str = ""  # what we had to assume


def _gpt(h, layers, heads, vocab):
    """A GPT-style model as a Llama of equal size: 4h² attention, SwiGLU with i = 8h/3 (3·h·i = 8h², the 4h GELU
    MLP's parameters and FLOPs), tied embeddings."""
    return dict(vocab_size=vocab, hidden_size=h, intermediate_size=round(8 * h / 3), num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=2048,
                tie_word_embeddings=True)


def _preset(name):
    from picotron.model import PRESETS
    return dict(PRESETS[name])


JEAN_ZAY = replace(GPUS["a100-80gb"], name="A100 80GB (Jean Zay)", inter_bw=4 * 100e9 / 8 / 8,
                   source="BLOOM paper §3.4.1: 48 nodes of 8 A100 80GB, NVLink inside, 4 x 100 Gb/s Omni-Path per node")
# What each run's software offered (2021-22 Megatron: no ZeRO, no sequence parallelism or selective recomputation, which
# Korthikanti et al. added in 2022; no context parallelism; Megatron-DeepSpeed's pipeline: 1F1B only).
MEGATRON_2021 = dict(zero=(0,), sp=(False,), cp=(1,), recompute=("none", "full"),
                     schedules=(("1f1b", 1), ("interleaved", 2)))
MEGATRON_DEEPSPEED_2022 = dict(zero=(0, 1), sp=(False,), cp=(1,), recompute=("none", "full"), schedules=(("1f1b", 1),))
PUBLISHED = [
    Published("BLOOM-176B", _preset("bloom-176b"), 384, JEAN_ZAY,
              Layout(dp=8, tp=4, pp=12, zero=1, micro_batch_size=2, grad_acc=128, recompute="full"), 2048, 2048, 150,
              "BigScience, tr11-176B-ml.slurm (github.com/bigscience-workshop/bigscience, train/tr11-176B-ml): TP_SIZE=4, "
              "PP_SIZE=12, MICRO_BATCH_SIZE=2, GLOBAL_BATCH_SIZE=2048, SEQ_LEN=2048, --checkpoint-activations, bf16 "
              "optimizer 'its own zero stage 1'; the BigScience 176B model page: 384 A100 80GB, 'one copy of the model "
              "takes 48 GPUs (using 60 GB of memory on each GPU)', 'about 150 TFLOPs'; BLOOM paper (arXiv:2211.05100) §3.4",
              available=MEGATRON_DEEPSPEED_2022, memory_gb=60, recipe="mixed-fp32-grads",
              notes="ALiBi and a 4h GELU MLP described as a Llama of the same size (bloom-176b preset); DeepSpeed's "
                    "BF16 optimizer accumulates gradients in fp32"),
    Published("Megatron GPT 145.6B", _gpt(12288, 80, 96, 51200), 1536, GPUS["a100-80gb"],
              Layout(dp=24, tp=8, pp=8, pp_schedule="interleaved", pp_chunks=2, micro_batch_size=1, grad_acc=96,
                     recompute="full"), 2048, 2304, 148,
              "Narayanan et al. 2021 (arXiv:2104.04473) Table 1: 96 heads, h 12288, 80 layers, tp 8, pp 8, 1536 A100, "
              "batch 2304, 148 TFLOP/s per GPU (47% of peak)", available=MEGATRON_2021,
              notes="micro-batch 1, 2 chunks per rank and full recomputation assumed"),
    Published("Megatron GPT 1T", _gpt(25600, 128, 160, 51200), 3072, GPUS["a100-80gb"],
              Layout(dp=6, tp=8, pp=64, pp_schedule="interleaved", pp_chunks=2, micro_batch_size=1, grad_acc=512,
                     recompute="full"), 2048, 3072, 163,
              "Narayanan et al. 2021 Table 1: 160 heads, h 25600, 128 layers, tp 8, pp 64, 3072 A100, batch 3072, "
              "163 TFLOP/s per GPU (52% of peak)", available=MEGATRON_2021,
              notes="micro-batch 1, 2 chunks per rank and full recomputation assumed"),
    Published("Llama 3 405B", _preset("llama3-405b"), 16384, GPUS["h100-80gb"],
              Layout(dp=128, tp=8, pp=16, sp=True, zero=2, pp_schedule="interleaved", pp_chunks=7, micro_batch_size=1,
                     grad_acc=16, recompute="none"), 8192, 2048, 400,
              "Llama Team, The Llama 3 Herd of Models (arXiv:2407.21783) Table 4: 16,384 H100, tp 8, cp 1, pp 16, dp 128, "
              "seq 8192, 16M tokens per batch, 400 TFLOP/s per GPU, 41% BF16 MFU; §3.3.2: an interleaved schedule, "
              "FSDP sharding optimizer states and gradients (weights kept after the forward), 'pre-train Llama 3 on "
              "sequences of 8K tokens without activation checkpointing'",
              counts_recompute=False, recipe="mixed-fp32-grads",
              notes="chunks per rank not published: 126 layers = 16 x 8 - 2 suggests 8 with the first and last chunks "
                    "holding only the embedding and the head (as the paper describes); our pipeline needs a layer in "
                    "every chunk, so v = 7; sp assumed; its FSDP as ZeRO-2 with fp32 gradients (weights whole during the "
                    "step, gradients reduce-scattered in fp32 every micro-batch)"),
]


def evaluate_published(run, rank=True):
    """For one published run: {fits, why, memory, time, predicted_tflops (counted as published: with the recomputed
    forward where it was), ratio (predicted / published)}; with rank: its place among every layout of the job
    (rank, of, best, why_best) and among those its software offered (rank_available, of_available, best_available,
    why_available), plus above / above_less_recompute / above_fewer_stages (the layouts ranked above it)."""
    from picotron.model import ModelConfig
    mc = ModelConfig(**run.model)
    mem, why = check_layout(mc, run.layout, run.seq_len, run.hardware, run.global_seqs, recipe=run.recipe, rules=False)
    time = step_time(mc, run.layout, run.seq_len, run.hardware, recipe=run.recipe)
    predicted = time["hardware_tflops" if run.counts_recompute else "tflops"]
    out = dict(fits=why is None, why=why, memory=mem, time=time, predicted_tflops=predicted, ratio=predicted / run.tflops)
    if rank:
        # the full space plus the run's own schedule (so that its layout is a candidate)
        own = {"schedules": tuple(dict.fromkeys(SPACE["schedules"] + ((run.layout.pp_schedule, run.layout.pp_chunks),))),
               "micro_batches": tuple(sorted(set(SPACE["micro_batches"]) | {run.layout.micro_batch_size}))}
        plan = search(mc, run.gpus, run.hardware, run.seq_len, run.global_seqs, recipe=run.recipe, space=own,
                      rules=False)  # its own software ran it, not picotron: only the model's shapes and memory
        k = rank_of(plan, run.layout)
        above = [lay for lay, _, _ in plan.ranked[:(k or 1) - 1]]
        out.update(rank=k, of=len(plan.ranked), best=plan.ranked[0] if plan.ranked else None,
                   above=len(above),
                   above_less_recompute=sum(RECOMPUTE_ORDER[a.recompute] < RECOMPUTE_ORDER[run.layout.recompute]
                                            for a in above),
                   above_fewer_stages=sum(a.pp < run.layout.pp for a in above))
        out["why_best"] = why_faster(time, plan.ranked[0][2]) if plan.ranked else ""
        narrow = {**own, **run.available,
                  "micro_batches": own["micro_batches"]}
        narrow["schedules"] = tuple(sch for sch in narrow["schedules"])
        kept = Plan([r for r in plan.ranked if _within(r[0], narrow)], [])
        k2 = rank_of(kept, run.layout)
        out.update(rank_available=k2, of_available=len(kept.ranked),
                   best_available=kept.ranked[0] if kept.ranked else None,
                   why_available=why_faster(time, kept.ranked[0][2]) if kept.ranked else "")
    return out


def _within(layout, space):
    """Whether `layout` lies in `space` (SPACE overridden)."""
    sp_ = {**SPACE, **space}
    return (layout.zero in sp_["zero"] and layout.sp in sp_["sp"] + ((False,) if layout.tp == 1 else ())
            and layout.cp in sp_["cp"] and layout.recompute in sp_["recompute"]
            and (layout.cp == 1 or layout.cp_impl in sp_["cp_impls"])
            and (layout.pp == 1 or (layout.pp_schedule, layout.pp_chunks) in sp_["schedules"])
            and layout.micro_batch_size in sp_["micro_batches"])


RECOMPUTE_ORDER = {"none": 0, "selective": 1, "full": 2, "partitioned": 3}


# ----------------------------------------------------------------------------------------------- command line
def _tokens(text):
    """'4M', '512K', '1G' or a plain number of tokens (K = 1024)."""
    t = str(text).strip().upper()
    scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        value = float("nan")
    if not (value >= 1 and value == int(value)):
        raise PlanError(f"--global-batch-tokens {text!r} is not a number of tokens; write e.g. 4M, 512K or 1048576.")
    return int(value)


class PlanError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        print(f"picotron.plan: error: {message}; see --help.", file=sys.stderr)
        raise SystemExit(2)


def build_parser():
    """The training command's model flags (a preset, then any ModelConfig field, the MoE flags), then the job."""
    from picotron.config import MODEL_FIELDS, MOE_FIELDS
    p = _Parser(prog="python -m picotron.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-8b", help="a model preset (picotron.model.PRESETS); default llama3-8b")
    for name in MODEL_FIELDS:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, metavar="N", help=f"model override: {name}")
    p.add_argument("--experts", type=int, default=None, metavar="E", help="experts per MoE layer (0 = dense)")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="experts per token")
    p.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--attn-impl", choices=("sdpa", "eager"), default=None)
    assert {"experts", "top_k"} <= set(MOE_FIELDS)
    p.add_argument("--gpus", type=int, default=None, help="GPUs in all (default: --nodes x --gpus-per-node, the "
                                                         "layout's, or 8)")
    p.add_argument("--nodes", type=int, default=None)
    p.add_argument("--gpu", default="h100-80gb", help=f"one of {', '.join(GPUS)}")
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--memory-gib", type=float, default=None, help="memory per GPU (default: the GPU's); the "
                                                                       "headroom is kept free of it too")
    p.add_argument("--headroom", type=float, default=HEADROOM, metavar="FRACTION",
                   help=f"fraction of each GPU's memory a layout may not use, for what the memory model does not count "
                        f"(the CUDA context, NCCL's buffers, the allocator's fragmentation); default {HEADROOM:g} "
                        f"({100 * HEADROOM:g}%%); --headroom 0 plans to the last byte. --published judges the "
                        f"published runs against the whole card")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch-tokens", default="1M", help="tokens per optimizer step: 4M, 512K (K = 1024) or a number")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="element size of activations and messages")
    p.add_argument("--recipe", choices=("mixed", "mixed-fp32-grads", "ours"), default="mixed",
                   help="bytes per parameter and activations: bf16 mixed precision 2+2+12 (default), with fp32 gradient "
                        "accumulation 2+4+12, or picotron's fp32 trainer 4+4+8"),
    p.add_argument("--layout", default=None, help="evaluate this layout, e.g. tp8,pp16,dp128 (+ zero1, sp, mbs2, ga8, "
                                                  "interleaved-v2, dualpipe, ulysses, recompute-full): any layout a "
                                                  "table row or --published shows")
    p.add_argument("--max-tp", type=int, default=None, help="search tp up to this (beyond a node: flagged)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--published", action="store_true", help="evaluate and rank the published runs instead")
    return p


def _job(ns):
    from picotron.config import MODEL_FIELDS, MOE_FIELDS
    from picotron.model import PRESETS, ModelConfig
    if ns.preset not in PRESETS:
        raise PlanError(f"--preset {ns.preset!r} is not a known model; pick one of {', '.join(PRESETS)} (or describe it "
                        f"with --hidden-size, --num-hidden-layers, ...).")
    if ns.gpu not in GPUS:
        raise PlanError(f"--gpu {ns.gpu!r} is not known; pick one of {', '.join(GPUS)}.")
    hw = GPUS[ns.gpu]
    for flag in ("gpus", "nodes", "gpus_per_node", "seq_len", "top", "max_tp"):
        value = getattr(ns, flag)
        if value is not None and value < 1:
            raise PlanError(f"--{flag.replace('_', '-')} {value} must be at least 1.")
    if ns.gpus_per_node:
        hw = replace(hw, gpus_per_node=ns.gpus_per_node)
    if ns.memory_gib is not None:
        if not ns.memory_gib > 0:
            raise PlanError(f"--memory-gib {ns.memory_gib} must be positive; e.g. --memory-gib 40.")
        hw = replace(hw, memory=ns.memory_gib * GiB)
    card, hw = hw, usable(hw, ns.headroom)
    overrides = {f: getattr(ns, f) for f in MODEL_FIELDS if getattr(ns, f, None) is not None}
    for ours in ("experts", "top_k"):
        if getattr(ns, ours) is not None:
            overrides[MOE_FIELDS[ours]] = getattr(ns, ours)
    for name in ("tie_word_embeddings", "attn_impl"):
        if getattr(ns, name) is not None:
            overrides[name] = getattr(ns, name)
    bad = next((f"--{k.replace('_', '-')} {v}" for k, v in overrides.items() if isinstance(v, int) and not
                isinstance(v, bool) and v < (0 if k == "num_local_experts" else 1)), None)
    if bad:
        raise PlanError(f"{bad} must be a positive number.")
    mc = ModelConfig.from_preset(ns.preset, **overrides)
    base = ModelConfig.from_preset(ns.preset)
    changed = [f"{k}={v}" for k, v in overrides.items() if getattr(base, k) != v]
    name = ns.preset + (" with " + ", ".join(changed) if changed else "")  # what the model is, not only its preset
    if mc.hidden_size % mc.num_attention_heads or mc.num_attention_heads % mc.num_key_value_heads:
        raise PlanError(f"hidden_size {mc.hidden_size}, {mc.num_attention_heads} heads and {mc.num_key_value_heads} KV "
                        f"heads do not nest (heads must divide hidden_size, KV heads the heads); change one of them.")
    nodes_gpus = ns.nodes * hw.gpus_per_node if ns.nodes else None
    if ns.gpus and nodes_gpus and ns.gpus != nodes_gpus:
        raise PlanError(f"--gpus {ns.gpus} is not --nodes {ns.nodes} x {hw.gpus_per_node} GPUs per node; give one of them.")
    gpus = ns.gpus or nodes_gpus or (Layout.parse(ns.layout).gpus if ns.layout else 8)
    tokens = _tokens(ns.global_batch_tokens)
    if tokens % ns.seq_len:
        raise PlanError(f"--global-batch-tokens {tokens} is not a whole number of sequences of --seq-len {ns.seq_len}; "
                        f"use a multiple of {ns.seq_len} (e.g. {max(1, tokens // ns.seq_len) * ns.seq_len}).")
    return dict(name=name, mc=mc, card=card, hw=hw, gpus=gpus, seqs=tokens // ns.seq_len)


def _row(layout, mem, t, hw=None, why=None):
    """One table row; the layout first, as --layout reads it. A layout refused before its memory means anything (a
    shape, the batch) shows a dash and the refusal; a tp wider than a node ends in '*'."""
    if mem is None or t is None:
        return f"{str(layout):52s} {'—':>7s}  refused: {why}"
    flag = "  *" if hw is not None and _link(hw, layout.tp)[1] != hw.intra_bw else ""
    return (f"{str(layout):52s} {mem['total'] / GiB:7.1f} {t['total']:8.3f} {t['tokens_per_s']:11,.0f} "
            f"{100 * t['mfu']:5.1f}%  " + " ".join(f"{k} {100 * t[k] / t['total']:.0f}%" for k in
                                                   ("compute", "tp", "cp", "ep", "pp", "bubble", "dp") if t[k] > 0)
            + flag)


HEADER = f"{'layout':52s} {'GiB/GPU':>7s} {'step s':>8s} {'tokens/s':>11s} {'MFU':>6s}  step time by part"


def _describe(job, seq_len, headroom):
    """The header: the model (a preset, or what overrides it), the GPUs, the memory a layout may use, the batch."""
    hw, card, seqs = job["hw"], job["card"], job["seqs"]
    mem = (f"{hw.memory / GiB:.1f} GiB usable: {100 * headroom:g}% of the {card.memory / GiB:.1f} GiB kept free"
           if headroom else f"{card.memory / GiB:.1f} GiB, no headroom")
    return (f"{job['name']} ({job['mc'].num_params() / 1e9:.2f} B parameters) on {job['gpus']} x {card.name} ({mem}, "
            f"{hw.gpus_per_node} per node), seq {seq_len}, {seqs} sequences ({seqs * seq_len:,} tokens) per step")


def print_published(runs=None, rank=True, out=print):
    """The published runs against the model: fits, predicted vs published throughput, rank and why others rank higher."""
    for run in runs or PUBLISHED:
        r = evaluate_published(run, rank=rank)
        mem = r["memory"]
        shown = f"{mem['total'] / GiB:.1f} GiB per GPU" + (f" (published {run.memory_gb:.0f} GB)" if run.memory_gb else "")
        out(f"{run.name}: {run.gpus:,} x {run.hardware.name}, {run.layout}: "
            f"{'fits, ' + shown if r['fits'] else 'REJECTED: ' + r['why']}; predicted {r['predicted_tflops']:.0f} "
            f"TFLOP/s per GPU vs published {run.tflops:.0f} ({r['ratio']:.2f}x)")
        if r.get("rank"):
            best, _, t = r["best"]
            out(f"    rank {r['rank']} of {r['of']}; of the {r['above']} above it {r['above_less_recompute']} recompute "
                f"less; the fastest, {best}, {t['tokens_per_s'] / r['time']['tokens_per_s']:.2f}x: {r['why_best']}")
            if r.get("rank_available"):
                best, _, t = r["best_available"]
                out(f"    with what its software offered: rank {r['rank_available']} of {r['of_available']}; the fastest, "
                    f"{best}, {t['tokens_per_s'] / r['time']['tokens_per_s']:.2f}x: {r['why_available']}")
        if run.notes:
            out(f"    assumed: {run.notes}")


def _no_fit(job, plan, least, ns, space):
    """When memory keeps out every layout: print the least memory any layout needs (and which) and the fewest GPUs at
    which one fits; return the rejected layouts worth listing, [(layout, why)] by memory, least first: those refused
    for memory and those refused by a rule though they would need less (`bounding`)."""
    mc, hw, seqs = job["mc"], job["hw"], job["seqs"]
    layout, mem = least
    parts = ", ".join(f"{k} {mem[k] / GiB:.1f}" for k in ("params", "grads", "optimizer", "activations"))
    print(f"least memory per GPU of any layout: {mem['total'] / GiB:.1f} GiB > {hw.memory / GiB:.1f} GiB usable, with "
          f"{layout} ({parts})")
    n, found = fewest_gpus(mc, job["gpus"], hw, ns.seq_len, seqs, ns.dtype, ns.recipe, space)
    if n is None:
        print(f"fewest GPUs above {job['gpus']} at which a layout fits: more than {found} (the search stops there); "
              f"a shorter --seq-len, a smaller model or GPUs with more memory")
    else:
        best, need, t = found.ranked[0]
        print(f"fewest GPUs above {job['gpus']} at which a layout fits: {n} x {job['card'].name}, e.g. {best}: "
              f"{need['total'] / GiB:.1f} GiB, {t['tokens_per_s']:,.0f} tokens/s; --gpus {n} ranks them")
    why = dict(plan.rejected)
    listed = [(lay, why[lay], m) for lay, m in plan.short] + bounding(mc, plan, mem, ns.seq_len, hw, seqs, ns.dtype,
                                                                      ns.recipe, space)
    return [(lay, text) for lay, text, m in sorted(listed, key=lambda r: r[2]["total"])]


def main(argv=None):
    ns = build_parser().parse_args(argv)
    try:
        if ns.published:
            print_published()
            return 0
        job = _job(ns)
        mc, hw, gpus, seqs = job["mc"], job["hw"], job["gpus"], job["seqs"]
        if ns.layout:
            layout = Layout.parse(ns.layout)
            if layout.gpus != gpus:
                raise PlanError(f"--layout {ns.layout!r} uses {layout.gpus} GPUs (dp·tp·pp·cp), not {gpus}; "
                                f"change a degree or --gpus.")
            if "ga" not in ns.layout:  # the micro-batches that make the batch (0, printed without ga: none do)
                per = layout.dp * layout.micro_batch_size
                layout = replace(layout, grad_acc=seqs // per if seqs % per == 0 else 0)
            mem, why = check_layout(mc, layout, ns.seq_len, hw, seqs, ns.dtype, ns.recipe, cross_node_tp=True)
            model_why = None
            if mem is None and why:  # refused by picotron's trainer: the model's figures all the same, if it has them
                mem, model_why = check_layout(mc, layout, ns.seq_len, hw, seqs, ns.dtype, ns.recipe, cross_node_tp=True,
                                              rules=False)
            t = step_time(mc, layout, ns.seq_len, hw, ns.dtype, ns.recipe) if mem else None  # none if refused early
            print(_describe(job, ns.seq_len, ns.headroom))
            if _link(hw, layout.tp)[1] != hw.intra_bw:
                print(f"note: tp={layout.tp} crosses nodes of {hw.gpus_per_node}: its all-reduces run on the network")
            print(f"{layout}: " + ("fits" if why is None else "does not run: " + why))
            if mem and why and not why.startswith("does not fit"):
                print("the model's figures for it all the same (as another trainer would run it): "
                      + ("fits" if model_why is None else model_why))
            if mem:
                stages = [r["total"] / GiB for r in memory_per_stage(mc, layout, ns.seq_len, ns.dtype, ns.recipe)]
                print("memory per GPU (GiB), busiest stage: " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in mem.items())
                      + ("; total per stage: " + ", ".join(f"{x:.1f}" for x in stages) if len(stages) > 1 else ""))
            print(HEADER)
            print(_row(layout, mem, t, hw, why))
            if t and _link(hw, layout.tp)[1] != hw.intra_bw:
                print(f"* tp crosses nodes of {hw.gpus_per_node} GPUs")
            if t:
                print(f"predicted: {t['total']:.3f} s per step, {t['tokens_per_s']:,.0f} tokens/s, {t['tflops']:.0f} "
                      f"TFLOP/s per GPU of model FLOPs, MFU {100 * t['mfu']:.1f}% (efficiency {hw.efficiency:.2f} of "
                      f"the peak)")
            return 0 if why is None else 1
        space = {"max_tp": ns.max_tp} if ns.max_tp else None
        plan = search(mc, gpus, hw, ns.seq_len, seqs, ns.dtype, ns.recipe, space)
        print(_describe(job, ns.seq_len, ns.headroom) + f": {len(plan.ranked)} layouts fit, {len(plan.rejected)} "
              f"rejected")
        print(HEADER)
        for layout, mem, t in plan.ranked[:ns.top]:
            print(_row(layout, mem, t, hw))
        if any(_link(hw, lay.tp)[1] != hw.intra_bw for lay, _, _ in plan.ranked[:ns.top]):
            print(f"* tp crosses nodes of {hw.gpus_per_node} GPUs")
        least = None if plan.ranked else least_memory(plan)
        if not plan.ranked:
            print(f"{'(no layout fits)':52s} {'—':>7s}")
        if least is None:  # some fit (or none has its memory counted): every reason, its first example
            shown, heading = plan.rejected, "one example each"
        else:  # memory keeps every layout out: what it takes, and only the rules that keep a smaller one out
            shown = _no_fit(job, plan, least, ns, space)
            heading = "the one needing the least memory each; only the reasons that keep out a layout needing less"
        reasons = {}
        for layout, why in shown:
            key = why.split(":")[0] if why.startswith("does not fit") else " ".join(why.split(" ")[:2])
            n, first, text = reasons.get(key, (0, layout, why))
            reasons[key] = (n + 1, first, text)
        print(f"rejected, by reason ({heading}):")
        for key, (n, layout, why) in sorted(reasons.items(), key=lambda kv: -kv[1][0]):
            print(f"  {n:6d} x  {layout}: {why}")
        if len(shown) < len(plan.rejected):
            print(f"  {len(plan.rejected) - len(shown):6d} more refused for reasons that keep out no layout needing less "
                  f"memory (a shape, the batch, a combination the trainer lacks)")
        return 0 if plan.ranked else 1
    except ValueError as e:
        print(f"picotron.plan: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
