"""Large runs whose layout and throughput were published (`PUBLISHED`, each with its source and what we assumed),
evaluated by the same memory and time model and ranked among every layout of their job (`evaluate_published`). They
ran on other software: only each strategy's own rules and the memory judge them, not picotron's trainer. The memory
rule is every search's: a layout may fill 1 − headroom of the card (plan.HEADROOM, 0.9 by default), and each run's
margin is printed; a run that trained but would not fit says the model over-counts it (Llama 3 405B did, by 0.01 GiB,
until its own cut, bare-ends, was modelled: 0.99 GiB less at its busiest rank).
"""
from dataclasses import dataclass, field, replace

from picotron.model_config import PRESETS, ModelConfig
from picotron.plan.hardware import GPUS, HEADROOM, Hardware, usable
from picotron.plan.search import SPACE, Plan, check_layout, rank_of, search, why_faster
from picotron.plan.time_model import step_time
from picotron.planner import Layout

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
              Layout(dp=128, tp=8, pp=16, sp=True, zero=2, pp_schedule="interleaved", pp_chunks=8, micro_batch_size=1,
                     grad_acc=16, recompute="none", bare_ends=True), 8192, 2048, 400,
              "Llama Team, The Llama 3 Herd of Models (arXiv:2407.21783) Table 4: 16,384 H100, tp 8, cp 1, pp 16, dp 128, "
              "seq 8192, 16M tokens per batch, 400 TFLOP/s per GPU, 41% BF16 MFU; §3.3.2: an interleaved schedule, "
              "FSDP sharding optimizer states and gradients (weights kept after the forward), 'pre-train Llama 3 on "
              "sequences of 8K tokens without activation checkpointing'",
              counts_recompute=False, recipe="mixed-fp32-grads",
              notes="chunks per rank not published: 126 layers = 16 x 8 - 2 suggests 8 with the first and last chunks "
                    "holding only the embedding and the head (§3.3.2 takes one layer off the first and the last stage "
                    "to balance them), modelled as such (bare-ends; picotron's own pipeline needs a layer "
                    "in every chunk); sp assumed; its FSDP as ZeRO-2 with fp32 gradients (weights whole during the "
                    "step; §3.3.2's 'FP32 gradient accumulation during backward computation over multiple micro-batches' "
                    "and fp32 reduce-scatter: a chunk's whole gradients summed in fp32 over its micro-batches, held "
                    "during the step, reduce-scattered once, at its last backward)"),
]


def evaluate_published(run, rank=True, headroom=HEADROOM):
    """For one published run: {fits, why, memory, usable, card, time, predicted_tflops (counted as published: with the
    recomputed forward where it was), ratio (predicted / published)}, judged as every search judges a layout: against
    the card less `headroom` (`usable` bytes; `card`: the whole); with rank: its place among every layout of the job
    that fits so (rank, of, best, why_best) and among those its software offered (rank_available, of_available,
    best_available, why_available), plus above / above_less_recompute / above_fewer_stages (the layouts ranked above
    it). A run outside the searched space (Llama 3's bare-ends) is placed by its tokens/s and counted in `of`."""
    mc = ModelConfig(**run.model)
    hw = usable(run.hardware, headroom)
    mem, why = check_layout(mc, run.layout, run.seq_len, hw, run.global_seqs, recipe=run.recipe, rules=False)
    time = step_time(mc, run.layout, run.seq_len, hw, recipe=run.recipe)
    predicted = time["hardware_tflops" if run.counts_recompute else "tflops"]
    out = dict(fits=why is None, why=why, memory=mem, usable=hw.memory, card=run.hardware.memory, time=time,
               predicted_tflops=predicted, ratio=predicted / run.tflops)
    if rank:
        # the full space plus the run's own schedule (so that its layout is a candidate)
        own = {"schedules": tuple(dict.fromkeys(SPACE["schedules"] + ((run.layout.pp_schedule, run.layout.pp_chunks),))),
               "micro_batches": tuple(sorted(set(SPACE["micro_batches"]) | {run.layout.micro_batch_size}))}
        plan = search(mc, run.gpus, hw, run.seq_len, run.global_seqs, recipe=run.recipe, space=own,
                      rules=False)  # its own software ran it, not picotron: only the model's shapes and memory
        k, of = _place(plan, run.layout, time, out["fits"])
        above = [lay for lay, _, _ in plan.ranked[:(k or 1) - 1]]
        out.update(rank=k, of=of, best=plan.ranked[0] if plan.ranked else None,
                   above=len(above),
                   above_less_recompute=sum(RECOMPUTE_ORDER[a.recompute] < RECOMPUTE_ORDER[run.layout.recompute]
                                            for a in above),
                   above_fewer_stages=sum(a.pp < run.layout.pp for a in above))
        out["why_best"] = why_faster(time, plan.ranked[0][2]) if plan.ranked else ""
        narrow = {**own, **run.available,
                  "micro_batches": own["micro_batches"]}
        narrow["schedules"] = tuple(sch for sch in narrow["schedules"])
        kept = Plan([r for r in plan.ranked if _within(r[0], narrow)], [])
        k2, of2 = _place(kept, run.layout, time, out["fits"])
        out.update(rank_available=k2, of_available=of2,
                   best_available=kept.ranked[0] if kept.ranked else None,
                   why_available=why_faster(time, kept.ranked[0][2]) if kept.ranked else "")
    return out


def _place(plan, layout, time, fits):
    """(rank, of): the layout's 1-based rank among the plan's ranked layouts; one the search did not try (a cut of other
    software's) goes in by its tokens/s, and counts. (None, len) when it does not fit."""
    k = rank_of(plan, layout)
    if k is not None or not fits:
        return k, len(plan.ranked)
    return 1 + sum(t["tokens_per_s"] > time["tokens_per_s"] for _, _, t in plan.ranked), len(plan.ranked) + 1


def _within(layout, space):
    """Whether `layout` lies in `space` (SPACE overridden)."""
    sp_ = {**SPACE, **space}
    return (layout.zero in sp_["zero"] and layout.sp in sp_["sp"] + ((False,) if layout.tp == 1 else ())
            and layout.cp in sp_["cp"] and layout.recompute in sp_["recompute"]
            and (layout.cp == 1 or layout.cp_impl in sp_["cp_impls"])
            and (layout.pp == 1 or (layout.pp_schedule, layout.pp_chunks) in sp_["schedules"])
            and layout.micro_batch_size in sp_["micro_batches"])


RECOMPUTE_ORDER = {"none": 0, "selective": 1, "full": 2, "partitioned": 3}

