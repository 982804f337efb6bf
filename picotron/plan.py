"""Find a layout: `python -m picotron.plan --preset llama3-8b --gpus 64 --gpu h100-80gb --seq-len 8192 --global-batch-tokens 4M`.

The Ultra-Scale Playbook's procedure, as a program: (1) fit in memory, (2) reach the global batch, (3) among what
remains, take the fastest. `planner.memory_per_stage` gives the bytes of a layout; this module adds

  * `Hardware` and the `GPUS` table (datasheet peaks and links, with sources);
  * `step_time`: seconds of one optimizer step by part, from an α-β model of every strategy's collectives;
  * `search`: every layout of a job, ranked by predicted tokens/s, and the rejected ones with their reason;
  * `PUBLISHED`: large runs whose layout and throughput were published, evaluated and ranked by the same model;
  * the command line (`--layout tp8,pp16,dp128` evaluates one layout instead of searching).

The time model (every term in one function, `step_time`), for one rank of the busiest pipeline stage:
  compute   FLOPs per token (6N + 12·L·h·s, the trainer's count; + the recomputed forward: 2N + 4·L·h·s with full
            recomputation, the attention core's 4·L·h·s with selective) × the step's tokens ÷ GPUs, at
            peak × efficiency. One efficiency for every run (EFFICIENCY), not tuned per run.
  tp        per layer and micro-batch 4 all-reduces of b·(s/cp)·h elements (2 forward, 2 backward; with sp the same
            bytes as all-gathers + reduce-scatters; full recomputation repeats the 2 forward ones); not overlapped.
  cp        ring attention: per layer and micro-batch (cp−1) K/V blocks forward, (cp−1) K/V + (cp−1) dK/dV backward,
            overlapped with that layer's attention compute: only the excess counts.
  ep        per MoE layer and micro-batch 4 all-to-alls (dispatch and combine, forward and backward) of the k copies
            of each token; not overlapped.
  pp        point-to-point: per micro-batch and chunk one activation forward and one gradient backward; the bubble:
            the schedule's idle fraction B (1F1B/AFAB (p−1)/(m+p−1), interleaved (p−1)/(vm+p−1), ZB-H1
            (p−1)/(3m+p−1), ZB-V from the simulator) stretches the busy time by 1/(1−B).
  dp        gradient all-reduce over dp×cp (ZeRO-1/2: reduce-scatter + all-gather, the same bytes; ZeRO-3 also
            gathers the parameters for every micro-batch's forward and backward), overlapped with the last
            micro-batch's backward (2/3 of its compute): only the excess counts.
Collectives are rings: all-reduce 2(n−1)·α + 2(n−1)/n·bytes/bw; all-gather, reduce-scatter, all-to-all
(n−1)·α + (n−1)/n·bytes/bw; a send α + bytes/bw. A group is inside a node when the ranks it spans fit in one
(grid order dp, pp, cp, tp with tp fastest: tp spans tp ranks, cp tp·cp, pp tp·cp·pp, ep tp·cp·pp·ep, dp all).

What it ignores: kernels' efficiency changing with the matmul shapes, the optimizer step and data loading, network
contention between groups, stragglers, and imbalanced expert routing. docs/reference.md#finding-a-layout-the-planner
has the derivations and the published runs with their sources.
"""
import argparse
import math
import sys
from dataclasses import dataclass, replace

from picotron.planner import Layout, memory_per_gpu, stage_layers

GiB = 1024 ** 3
EFFICIENCY = 0.6  # achieved / datasheet FLOP/s of the model's kernels; one value for every prediction


@dataclass(frozen=True)
class Hardware:
    """One kind of accelerator and its links. peak: dense bf16 FLOP/s (fp32 on a CPU: what it measured)."""
    name: str
    peak: float
    memory: float  # bytes per device
    gpus_per_node: int = 8
    intra_alpha: float = 5e-6  # s per ring step inside a node
    intra_bw: float = 300e9  # bytes/s per device and direction
    inter_alpha: float = 10e-6
    inter_bw: float = 25e9
    efficiency: float = EFFICIENCY
    source: str = ""


GPUS = {  # datasheet dense bf16 peaks, memory, NVLink per direction, network per GPU
    "a100-40gb": Hardware("A100 40GB SXM", 312e12, 40e9, 8, 5e-6, 300e9, 10e-6, 25e9,
                          source="NVIDIA A100 datasheet (312 TFLOP/s bf16 dense; NVLink 3: 600 GB/s both ways); "
                                 "DGX A100: 8 x 200 Gb/s HDR InfiniBand per node"),
    "a100-80gb": Hardware("A100 80GB SXM", 312e12, 80e9, 8, 5e-6, 300e9, 10e-6, 25e9,
                          source="NVIDIA A100 datasheet; DGX A100 / Selene: 8 x 200 Gb/s HDR InfiniBand per node"),
    "h100-80gb": Hardware("H100 80GB SXM", 989.5e12, 80e9, 8, 5e-6, 450e9, 10e-6, 50e9,
                          source="NVIDIA H100 datasheet (989.5 TFLOP/s bf16 dense; NVLink 4: 900 GB/s both ways); "
                                 "400 Gb/s InfiniBand or RoCE per GPU"),
    "h200": Hardware("H200 141GB SXM", 989.5e12, 141e9, 8, 5e-6, 450e9, 10e-6, 50e9,
                     source="NVIDIA H200 datasheet (H100's compute, 141 GB HBM3e); 400 Gb/s per GPU"),
}


def cpu_hardware(peak, alpha, bw, cores, memory=16 * GiB, efficiency=1.0):
    """This machine as the planner sees it: `peak` measured (picotron.metrics.measured_matmul_peak on one thread),
    the gloo link's α (s) and bandwidth (bytes/s) measured between two processes, one 'GPU' per core."""
    return Hardware("this CPU", peak, memory, cores, alpha, bw, alpha, bw, efficiency, source="measured")


# --------------------------------------------------------------------------------------------- the time model
def _ring(kind, n, nbytes, alpha, bw):
    if n <= 1:
        return 0.0
    steps, share = (2 * (n - 1), 2 * (n - 1) / n) if kind == "all_reduce" else (n - 1, (n - 1) / n)
    return steps * alpha + share * nbytes / bw


def _link(hw, span):
    """(α, bandwidth) of a group spanning `span` consecutive ranks: NVLink inside a node, the network across."""
    return (hw.intra_alpha, hw.intra_bw) if span <= hw.gpus_per_node else (hw.inter_alpha, hw.inter_bw)


def _bubble(layout):
    from picotron.pipeline_parallel import bubble_formula, build, simulate
    p, m, v = layout.pp, layout.grad_acc, layout.pp_chunks
    if p == 1:
        return 0.0
    if layout.pp_schedule == "zb-v":
        return simulate(build("zb-v", p, m)).bubble
    return bubble_formula(layout.pp_schedule, p, m, v)


def step_time(mc, layout, seq_len, hw, dtype="bf16"):
    """Predicted seconds of one optimizer step by part (module docstring), with tokens/s, model FLOP/s per GPU
    (`tflops`: 6N + 12Lhs per token, no recomputation) and MFU against the datasheet peak."""
    L, h, s = mc.num_hidden_layers, mc.hidden_size, seq_len
    t, c, p, d, e, m, b = layout.tp, layout.cp, layout.pp, layout.dp, layout.ep, layout.grad_acc, layout.micro_batch_size
    el = 2 if dtype == "bf16" else 4
    gpus = layout.gpus
    tokens = d * m * b * s
    per_token = mc.flops_per_token(s)
    extra = {"full": per_token / 3, "selective": 4 * L * h * s, "none": 0}[layout.recompute]
    compute = (per_token + extra) * tokens / gpus / (hw.peak * hw.efficiency)
    layers = max(hi - lo for lo, hi in stage_layers(mc, p, s))  # the busiest stage's layers
    local = b * (s // c)  # tokens of one micro-batch on one rank
    # tensor parallelism: 4 all-reduces of the activation per layer and micro-batch (+2 with full recompute)
    calls = 4 + (2 if layout.recompute == "full" else 0)
    tp = m * layers * calls * _ring("all_reduce", t, local * h * el, *_link(hw, t))
    # context parallelism: the ring's K/V blocks, hidden under the attention core's compute where it is longer
    kv = mc.num_key_value_heads * mc.head_dim
    block = 2 * local * kv * el / t
    a_link = _link(hw, t * c)
    ring = 4 * (c - 1) * (a_link[0] + block / a_link[1]) if c > 1 else 0.0
    attn_compute = 12 * h * s * local / t / (hw.peak * hw.efficiency)  # forward + backward, this rank's heads
    cp = m * layers * max(0.0, ring - attn_compute)
    # expert parallelism: 4 all-to-alls of the k copies of each token per MoE layer and micro-batch
    ep = 0.0
    if mc.is_moe and e > 1:
        ep = m * layers * 4 * _ring("all_to_all", e, local * mc.num_experts_per_tok * h * el, *_link(hw, t * c * p * e))
    # pipeline: one activation and one gradient per micro-batch and chunk, then the bubble
    v = layout.pp_chunks if layout.pp_schedule == "interleaved" else 2 if layout.pp_schedule == "zb-v" else 1
    p_link = _link(hw, t * c * p)
    pp_p2p = 2 * m * v * (p_link[0] + local * h * el / (t if layout.sp else 1) / p_link[1]) if p > 1 else 0.0
    busy = compute + tp + cp + ep + pp_p2p
    bubble_fraction = _bubble(layout)
    bubble = busy * bubble_fraction / (1 - bubble_fraction) if bubble_fraction < 1 else math.inf
    # data parallelism over dp x cp: the gradients (ZeRO-3: + the parameter gathers), overlapped with backward
    params = mc.num_params() / (t * p)
    grad_bytes = params * (4 if dtype == "fp32" else 2)
    dp_link = _link(hw, gpus)
    n = d * c
    dp_total = _ring("all_reduce", n, grad_bytes, *dp_link)
    if layout.zero == 3:
        dp_total += 2 * m * _ring("all_gather", n, params * el, *dp_link)
    overlap = (2 / 3) * compute / m * (m if layout.zero == 3 else 1)
    dp = max(0.0, dp_total - overlap)
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


def check_layout(mc, layout, seq_len, hw, global_seqs, dtype="bf16", recipe="mixed"):
    """(memory row, None) if the layout can run this job, else (memory row or None, one sentence why not)."""
    heads, kv = mc.num_attention_heads, mc.num_key_value_heads
    if heads % layout.tp or kv % layout.tp:
        return None, f"tp={layout.tp} does not divide the {heads} attention heads and {kv} KV heads"
    if layout.tp > hw.gpus_per_node:
        return None, f"tp={layout.tp} crosses nodes of {hw.gpus_per_node} GPUs (its 4 all-reduces per layer would run on the network)"
    if seq_len % (2 * layout.cp):
        return None, f"seq_len {seq_len} does not split into 2·cp = {2 * layout.cp} chunks"
    if layout.pp * (layout.pp_chunks if layout.pp_schedule == "interleaved" else 1) > mc.num_hidden_layers:
        return None, f"pp={layout.pp} (x{layout.pp_chunks} chunks) has more stages than the {mc.num_hidden_layers} layers"
    if layout.pp_schedule == "interleaved" and layout.grad_acc % layout.pp:
        return None, f"interleaved needs the micro-batches ({layout.grad_acc}) to be a multiple of pp={layout.pp}"
    if layout.zero >= 2 and layout.pp > 1:
        return None, f"ZeRO-{layout.zero} with pp={layout.pp}: gradients would be cut every micro-batch (picotron refuses it)"
    if mc.is_moe and (mc.num_local_experts % layout.ep or layout.dp % layout.ep):
        return None, f"ep={layout.ep} must divide the {mc.num_local_experts} experts and dp={layout.dp}"
    if layout.dp * layout.micro_batch_size * layout.grad_acc != global_seqs:
        return None, (f"the global batch of {global_seqs} sequences is not dp·mbs·grad_acc = {layout.dp}·"
                      f"{layout.micro_batch_size}·{layout.grad_acc}")
    mem = memory_per_gpu(mc, layout, seq_len, dtype, recipe)
    if mem["total"] > hw.memory:
        parts = ", ".join(f"{k} {mem[k] / GiB:.1f}" for k in ("params", "grads", "optimizer", "activations"))
        return mem, f"does not fit: {mem['total'] / GiB:.1f} GiB > {hw.memory / GiB:.1f} GiB ({parts})"
    return mem, None


def candidates(mc, gpus, hw, seq_len, global_seqs, micro_batches=(1, 2, 4, 8)):
    """Every layout of the job: tp (inside a node), cp, pp, dp = the rest, ep (MoE), ZeRO 0-3, sp, micro-batch
    size, recomputation, 1F1B or interleaved (v = 2)."""
    for tp in _divisors(gpus, hw.gpus_per_node):
        for cp in (k for k in _divisors(gpus // tp) if k & (k - 1) == 0 and k <= 16):
            for pp in _divisors(gpus // (tp * cp), mc.num_hidden_layers):
                dp = gpus // (tp * cp * pp)
                for ep in (_divisors(math.gcd(dp, mc.num_local_experts)) if mc.is_moe else [1]):
                    for mbs in micro_batches:
                        if global_seqs % (dp * mbs):
                            yield Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, micro_batch_size=mbs, grad_acc=0)
                            continue
                        ga = global_seqs // (dp * mbs)
                        for zero in (0, 1, 2, 3):
                            for sp in ((False, True) if tp > 1 else (False,)):
                                for recompute in ("none", "selective", "full"):
                                    for sched, v in ((("1f1b", 1), ("interleaved", 2)) if pp > 1 else (("1f1b", 1),)):
                                        yield Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, sp=sp, zero=zero, pp_schedule=sched,
                                                     pp_chunks=v, micro_batch_size=mbs, grad_acc=ga, recompute=recompute)


@dataclass
class Plan:
    ranked: list  # [(layout, memory row, time row)], fastest first
    rejected: list  # [(layout, reason)]


def search(mc, gpus, hw, seq_len, global_seqs, dtype="bf16", recipe="mixed"):
    """Rank every feasible layout by predicted tokens/s (ties: less memory); keep each rejected one's reason."""
    ranked, rejected = [], []
    for layout in candidates(mc, gpus, hw, seq_len, global_seqs):
        if layout.grad_acc == 0:
            rejected.append((layout, f"the global batch of {global_seqs} sequences is not divisible by dp·mbs = "
                                     f"{layout.dp}·{layout.micro_batch_size}"))
            continue
        mem, why = check_layout(mc, layout, seq_len, hw, global_seqs, dtype, recipe)
        if why:
            rejected.append((layout, why))
        else:
            ranked.append((layout, mem, step_time(mc, layout, seq_len, hw, dtype)))
    ranked.sort(key=lambda r: (-r[2]["tokens_per_s"], r[1]["total"]))
    return Plan(ranked, rejected)


def rank_of(plan, layout):
    """1-based rank of `layout` in the plan (ignoring nothing), or None if it was not a candidate or was rejected."""
    return next((i for i, (lay, _, _) in enumerate(plan.ranked, 1) if lay == layout), None)


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


def _gpt(h, layers, heads, vocab):
    """A GPT-style model as a Llama of equal size: 4h² attention, SwiGLU with i = 8h/3 (3·h·i = 8h², the 4h GELU
    MLP's parameters and FLOPs), tied embeddings."""
    return dict(vocab_size=vocab, hidden_size=h, intermediate_size=round(8 * h / 3), num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=2048,
                tie_word_embeddings=True)


JEAN_ZAY = replace(GPUS["a100-80gb"], name="A100 80GB (Jean Zay)", inter_bw=4 * 100e9 / 8 / 8,
                   source="BLOOM paper §3.4.1: 48 nodes of 8 A100 80GB, NVLink inside, 4 x 100 Gb/s Omni-Path per node")
PUBLISHED = [
    Published("BLOOM-176B", _gpt(14336, 70, 112, 250880), 384, JEAN_ZAY,
              Layout(dp=8, tp=4, pp=12, zero=1, micro_batch_size=2, grad_acc=128, recompute="full"), 2048, 2048, 150,
              "BigScience, BLOOM (arXiv:2211.05100) §3.4: tp 4, pp 12, dp 8, ZeRO-1, global batch 2048 x 2048 tokens, "
              "about 150 TFLOP/s per GPU"),
    Published("Megatron GPT 145.6B", _gpt(12288, 80, 96, 51200), 1536, GPUS["a100-80gb"],
              Layout(dp=24, tp=8, pp=8, pp_schedule="interleaved", pp_chunks=2, micro_batch_size=1, grad_acc=96,
                     recompute="full"), 2048, 2304, 148,
              "Narayanan et al. 2021 (arXiv:2104.04473) Table 1: tp 8, pp 8, 1536 A100, batch 2304, 148 TFLOP/s per GPU"),
    Published("Megatron GPT 1T", _gpt(25600, 128, 160, 51200), 3072, GPUS["a100-80gb"],
              Layout(dp=6, tp=8, pp=64, pp_schedule="interleaved", pp_chunks=2, micro_batch_size=1, grad_acc=512,
                     recompute="full"), 2048, 3072, 163,
              "Narayanan et al. 2021 Table 1: tp 8, pp 64, 3072 A100, batch 3072, 163 TFLOP/s per GPU (52% of peak)"),
    Published("Llama 3 405B", dict(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                                    num_attention_heads=128, num_key_value_heads=8, max_position_embeddings=8192),
              16384, GPUS["h100-80gb"], Layout(dp=128, tp=8, pp=16, sp=True, zero=1, pp_schedule="interleaved",
                                               pp_chunks=4, micro_batch_size=1, grad_acc=16, recompute="full"), 8192, 2048,
              400, "Llama 3 paper (arXiv:2407.21783) Table 4: 16,384 H100, tp 8, cp 1, pp 16, dp 128, seq 8192, "
                   "16M tokens per batch, an interleaved schedule, 400 TFLOP/s per GPU (41% MFU: model FLOPs). Not "
                   "stated there: sp, the ZeRO stage, the chunks per rank and recomputation; we take sp, ZeRO-1, v = 4 "
                   "and full recomputation (without it the first stage does not fit 80 GB in this model)",
              counts_recompute=False),
]


def evaluate_published(run, rank=True):
    """{fits, why, memory, time, predicted_tflops (counted as published: with the recomputed forward), ratio, rank,
    of, best} for one published run; rank=False skips the search (seconds for the largest runs)."""
    from picotron.model import ModelConfig
    mc = ModelConfig(**run.model)
    mem, why = check_layout(mc, run.layout, run.seq_len, run.hardware, run.global_seqs)
    time = step_time(mc, run.layout, run.seq_len, run.hardware)
    predicted = time["hardware_tflops" if run.counts_recompute else "tflops"]
    out = dict(fits=why is None, why=why, memory=mem, time=time, predicted_tflops=predicted, ratio=predicted / run.tflops)
    if rank:
        plan = search(mc, run.gpus, run.hardware, run.seq_len, run.global_seqs)
        k = rank_of(plan, run.layout)
        above = [lay for lay, _, _ in plan.ranked[:(k or 1) - 1]]
        out.update(rank=k, of=len(plan.ranked), best=plan.ranked[0] if plan.ranked else None,
                   above_less_recompute=sum(RECOMPUTE_ORDER[a.recompute] < RECOMPUTE_ORDER[run.layout.recompute]
                                            for a in above),
                   above_fewer_stages=sum(a.pp < run.layout.pp for a in above), above=len(above))
    return out


RECOMPUTE_ORDER = {"none": 0, "selective": 1, "full": 2}


# ----------------------------------------------------------------------------------------------- command line
def _tokens(text):
    """'4M', '512K', '1G' or a plain number of tokens."""
    t = str(text).strip().upper()
    scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if scale > 1 else t) * scale)
    except ValueError:
        raise ValueError(f"--global-batch-tokens {text!r} is not a number of tokens; write e.g. 4M, 512K or 1048576.")


def build_parser():
    from picotron.config import MODEL_FIELDS
    from picotron.model import PRESETS
    p = argparse.ArgumentParser(prog="python -m picotron.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    for field in MODEL_FIELDS:
        p.add_argument("--" + field.replace("_", "-"), type=int, default=None)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--gpu", default="h100-80gb", help=f"one of {', '.join(GPUS)}")
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--memory-gib", type=float, default=None, help="memory per GPU (default: the GPU's)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch-tokens", default="1M")
    p.add_argument("--layout", default=None, help="evaluate this layout, e.g. tp8,pp16,dp128,zero1,mbs1")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--published", action="store_true", help="evaluate the published runs instead")
    return p


class PlanError(ValueError):
    pass


def _job(ns):
    from picotron.config import MODEL_FIELDS
    from picotron.model import ModelConfig
    if ns.gpu not in GPUS:
        raise PlanError(f"--gpu {ns.gpu!r} is not known; pick one of {', '.join(GPUS)}.")
    hw = GPUS[ns.gpu]
    if ns.gpus_per_node:
        hw = replace(hw, gpus_per_node=ns.gpus_per_node)
    if ns.memory_gib:
        hw = replace(hw, memory=ns.memory_gib * GiB)
    if ns.gpus < 1:
        raise PlanError(f"--gpus {ns.gpus} must be at least 1.")
    overrides = {f: getattr(ns, f) for f in MODEL_FIELDS if getattr(ns, f, None) is not None}
    mc = ModelConfig.from_preset(ns.preset, **overrides)
    tokens = _tokens(ns.global_batch_tokens)
    if tokens % ns.seq_len or tokens < ns.seq_len:
        raise PlanError(f"--global-batch-tokens {tokens} is not a whole number of sequences of --seq-len {ns.seq_len}; "
                        f"use a multiple of {ns.seq_len} (e.g. {max(1, tokens // ns.seq_len) * ns.seq_len}).")
    return mc, hw, tokens // ns.seq_len


def _row(layout, mem, t):
    return (f"{str(layout):52s} {mem['total'] / GiB:7.1f} {t['total']:8.3f} {t['tokens_per_s']:11,.0f} "
            f"{100 * t['mfu']:5.1f}%  " + " ".join(f"{k} {100 * t[k] / t['total']:.0f}%" for k in
                                                   ("compute", "tp", "cp", "ep", "pp", "bubble", "dp") if t[k] > 0))


HEADER = f"{'layout':52s} {'GiB/GPU':>7s} {'step s':>8s} {'tokens/s':>11s} {'MFU':>6s}  step time by part"


def main(argv=None):
    ns = build_parser().parse_args(argv)
    try:
        if ns.published:
            for run in PUBLISHED:
                r = evaluate_published(run, rank=run.gpus <= 4096)
                where = f"rank {r['rank']} of {r['of']}" if r.get("rank") else "not ranked"
                print(f"{run.name}: {run.gpus} x {run.hardware.name}, {run.layout}: "
                      f"{'fits' if r['fits'] else 'REJECTED: ' + r['why']}; predicted {r['predicted_tflops']:.0f} "
                      f"TFLOP/s per GPU vs published {run.tflops:.0f} ({r['ratio']:.2f}x); {where}")
                if r.get("rank"):
                    best, _, t = r["best"]
                    print(f"    of the {r['above']} predicted faster, {r['above_less_recompute']} recompute less and "
                          f"{r['above_fewer_stages']} use fewer pipeline stages; the fastest: {best} "
                          f"({t['tokens_per_s'] / r['time']['tokens_per_s']:.2f}x its tokens/s)")
            return 0
        mc, hw, seqs = _job(ns)
        if ns.layout:
            layout = Layout.parse(ns.layout)
            if layout.gpus != ns.gpus:
                raise PlanError(f"--layout {ns.layout!r} uses {layout.gpus} GPUs (dp·tp·pp·cp), not --gpus {ns.gpus}; "
                                f"change a degree or --gpus.")
            if "ga" not in ns.layout:
                layout = replace(layout, grad_acc=max(1, seqs // (layout.dp * layout.micro_batch_size)))
            mem, why = check_layout(mc, layout, ns.seq_len, hw, seqs)
            t = step_time(mc, layout, ns.seq_len, hw)
            print(f"{ns.preset} ({mc.num_params() / 1e9:.2f} B parameters) on {ns.gpus} x {hw.name}, seq {ns.seq_len}, "
                  f"{seqs} sequences per step")
            print(f"{layout}: " + ("fits" if why is None else "does not run: " + why))
            if mem:
                print("memory per GPU (GiB): " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in mem.items()))
            print(HEADER)
            print(_row(layout, mem or {"total": float("nan")}, t))
            return 0 if why is None else 1
        plan = search(mc, ns.gpus, hw, ns.seq_len, seqs)
        print(f"{ns.preset} ({mc.num_params() / 1e9:.2f} B parameters) on {ns.gpus} x {hw.name}, seq {ns.seq_len}, "
              f"{seqs} sequences ({seqs * ns.seq_len:,} tokens) per step: {len(plan.ranked)} layouts fit, "
              f"{len(plan.rejected)} rejected")
        print(HEADER)
        for layout, mem, t in plan.ranked[:ns.top]:
            print(_row(layout, mem, t))
        reasons = {}
        for layout, why in plan.rejected:
            key = why.split(":")[0] if why.startswith("does not fit") else why.split(" ")[0] + " " + why.split(" ")[1]
            reasons.setdefault(key, (0, layout, why))
            reasons[key] = (reasons[key][0] + 1, *reasons[key][1:])
        print("rejected, by reason (one example each):")
        for key, (n, layout, why) in sorted(reasons.items(), key=lambda kv: -kv[1][0]):
            print(f"  {n:6d} x  {layout}: {why}")
        return 0 if plan.ranked else 1
    except (PlanError, ValueError) as e:
        print(f"picotron.plan: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
