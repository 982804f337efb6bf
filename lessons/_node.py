"""What one node of 8 GPUs should show, lesson by lesson: the planner's predictions for each lesson's experiment
at its GPU size (its row of _common.GPU_SETTINGS), and the command that measures them. Every lesson's section
"On an 8-GPU node you should see" calls `show(lesson)`.

    NODE          the picotron.plan.hardware.GPUS key of the node: 8 H100 SXM on NVLink
    Row           (what, predicted, how): one prediction, its value with its unit, and what predicted it
    PREDICTORS    lesson -> function() -> [Row]   (lessons 01-05 here, 06-11 in _node_late.py)
    COMMANDS      lesson -> the command that measures them on a pod
    show(lesson)  print the rows as a small table under a header that says they are predictions, then the command

Nothing here measures: every number comes from picotron.planner and picotron.plan (their one home), none is
retyped. Where the model cannot predict what a lesson measures, the row says "not modelled". The time model's
assumptions (one kernel efficiency, 0.6 of the peak, for every shape; no launch overhead; α-β rings) are in
picotron/plan/time_model.py; a tiny model's step on a GPU is mostly launch overhead, so its predicted times are
floors, not estimates.
"""
import re
from collections import namedtuple

import _common  # noqa: F401  (puts the repository root on sys.path)
from picotron import planner
from picotron.config import Config
from picotron.plan import GiB, MiB, link, ring_time, step_time
from picotron.plan.hardware import at_dtype
from picotron.planner import Layout

NODE = "h100-80gb"  # one node of 8 H100 80GB SXM, NVLink 4 inside it
RANKS = 8
Row = namedtuple("Row", "what predicted how")
TIME_MODEL = "plan.step_time"
# Below this many parameters a model's step on an H100 is mostly kernel launches (lesson 01 measures it), which the
# time model does not count: its rows say "not modelled" instead of a number far too fast.
LAUNCH_BOUND = 10e6


# ------------------------------------------------------------------------------------------------ helpers
def gpu_row(lesson):
    """The lesson's GPU_SETTINGS row in full mode (what `--run full` on a pod trains)."""
    row = dict(_common.GPU_SETTINGS[lesson])
    row.pop("fast", None)
    return row


def model(size, **overrides):
    """The model config of a lesson's size: 'small'/'medium' (_common.SIZES) or a preset ('tiny', 'smollm-135m')."""
    cfg = _common.make_cfg(size, **overrides) if size in _common.SIZES else Config(preset=size, **overrides)
    return cfg.model_config()


def ms(seconds):
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} µs"


def gib(nbytes):
    return f"{nbytes / GiB:.3g} GiB"


def share(part, whole):
    return f"{100 * part / whole:.0f}%"


# ----------------------------------------------------------------------------------------------- lessons
def lesson_01():
    """One H100: tokens/s and MFU of the throughput run (bf16, 16 x 1,024 tokens) for each model, and the memory
    model's bytes of the largest."""
    row, hw = gpu_row("01_single_device"), at_dtype(NODE, "bf16")
    s, b = row["throughput_seq_len"], row["throughput_micro_batch_size"]
    layout, rows = Layout(micro_batch_size=b), []
    for size in row["throughput_sizes"]:
        mc = model(size)
        if mc.num_params() < LAUNCH_BOUND:
            rows.append(Row(f"tokens/s, {size} ({mc.num_params() / 1e6:.1f} M)", "not modelled",
                            "its step is kernel launches; the time model counts FLOPs"))
            continue
        t = step_time(mc, layout, s, hw, dtype="bf16")
        rows.append(Row(f"tokens/s, {size} ({mc.num_params() / 1e6:.0f} M), bf16, {b}x{s:,} tokens",
                        f"{t['tokens_per_s']:,.0f} (MFU {t['mfu']:.0%})", TIME_MODEL))
    mc = model(row["throughput_sizes"][-1])
    mem = planner.memory_per_gpu(mc, layout, s, dtype="bf16", recipe="ours")
    rows.append(Row(f"memory, {row['throughput_sizes'][-1]}, bf16, {b}x{s:,} tokens", gib(mem["total"]),
                    "planner.memory_per_gpu; no CUDA context"))
    return rows


def lesson_02():
    """All-reduce, all-gather and reduce-scatter over the node's 8 GPUs (NVLink), on a ring: the time of the largest
    and smallest messages of the lesson's GPU sweep and the all-reduce's bus bandwidth (nccl-tests' convention)."""
    sizes, hw = gpu_row("02_collectives")["sizes"], at_dtype(NODE)
    alpha, bw = link(hw, RANKS)
    big, small = max(sizes), min(sizes)
    from picotron.collectives import BUSBW_FACTOR  # nccl-tests' convention: busbw = algbw * factor(n)

    t = ring_time("all_reduce", RANKS, big, alpha, bw)
    busbw = BUSBW_FACTOR["all_reduce"](RANKS) * big / t
    return [Row(f"all-reduce, {big // MiB} MiB, 8 ranks", ms(t), "plan.ring_time, NVLink"),
            Row(f"all-reduce bus bandwidth, {big // MiB} MiB", f"{busbw / 1e9:.0f} GB/s", "plan.ring_time"),
            Row(f"all-gather, {big // MiB} MiB in all, 8 ranks", ms(ring_time("all_gather", RANKS, big, alpha, bw)),
                "plan.ring_time"),
            Row(f"all-reduce, {small // 1024} KiB, 8 ranks", ms(ring_time("all_reduce", RANKS, small, alpha, bw)),
                "plan.ring_time: latency-bound"),
            Row("tree vs ring, small messages", "not modelled", "the planner's collectives are rings only")]


def lesson_03():
    """Data parallelism on the node: the medium model in fp32, s = 512, 8 x 512 tokens per rank (weak scaling):
    the step time at dp = 1, 2, 4, 8 and the share of it the gradient all-reduce leaves exposed."""
    row, hw = gpu_row("03_data_parallel"), at_dtype(NODE, "fp32")
    mc, s, b = model(row["scaling_size"]), row["scaling_seq_len"], row["scaling_micro_batch_size"]
    rows = []
    for n in (1, 2, 4, RANKS):
        t = step_time(mc, Layout(dp=n, micro_batch_size=b), s, hw, dtype="fp32")
        rows.append(Row(f"step, dp={n}, {row['scaling_size']}, fp32, {b}x{s} tokens/rank",
                        f"{ms(t['total'])}, {t['tokens_per_s']:,.0f} tokens/s, all-reduce exposed "
                        f"{share(t['dp'], t['total'])}", TIME_MODEL))
    grads = 4 * mc.num_params()
    whole = ring_time("all_reduce", RANKS, grads, *link(hw, RANKS))
    rows.append(Row(f"gradient all-reduce, {grads / MiB:.0f} MiB, 8 ranks", ms(whole),
                    "plan.ring_time; hidden under backward"))
    return rows


def lesson_04():
    """ZeRO on the node: memory per GPU at stages 0-3 over 8 ranks (medium model, fp32, 8 x 512 tokens per rank),
    the bytes each rank sends per step and the step time."""
    row, hw = gpu_row("04_zero"), at_dtype(NODE, "fp32")
    mc, s, b = model(row["size"]), row["tl_seq_len"], row["tl_micro_batch_size"]
    n_params, rows = mc.num_params(), []
    for z in range(4):
        layout = Layout(dp=RANKS, zero=z, micro_batch_size=b)
        mem = planner.memory_per_gpu(mc, layout, s, dtype="fp32", recipe="ours")
        states = mem["params"] + mem["grads"] + mem["optimizer"]
        sent = 4 * sum(planner.zero_comm_elements(n_params, z).values()) * (RANKS - 1) / RANKS
        t = step_time(mc, layout, s, hw, dtype="fp32")
        rows.append(Row(f"ZeRO-{z}, dp=8: model states / total memory per GPU", f"{gib(states)} / {gib(mem['total'])}",
                        "planner.memory_per_gpu"))
        rows.append(Row(f"ZeRO-{z}, dp=8: bytes sent per rank per step; step time", f"{sent / MiB:.0f} MiB; "
                        f"{ms(t['total'])}", "planner.zero_comm_elements; " + TIME_MODEL))
    return rows


def lesson_05_model():
    """Lesson 05's model on the node: its GPU size with 8 KV heads (tp = 8 needs a whole KV head per rank)."""
    return model(gpu_row("05_tensor_parallel")["size"], num_key_value_heads=RANKS)


def lesson_05():
    """Tensor parallelism on the node: the medium model with 8 KV heads, fp32, 8 x 1,024 tokens: step time and
    the share of it in tp's all-reduces (4 per layer, not overlapped) at tp = 1, 2, 4, 8; memory per GPU at tp = 8."""
    row, hw = gpu_row("05_tensor_parallel"), at_dtype(NODE, "fp32")
    mc, s, b = lesson_05_model(), row["seq_len"], row["micro_batch_size"]
    rows = []
    for t in (1, 2, 4, RANKS):
        p = step_time(mc, Layout(tp=t, micro_batch_size=b), s, hw, dtype="fp32")
        rows.append(Row(f"step time, tp={t}, {row['size']} (8 KV heads), fp32, {b}x{s:,} tokens",
                        f"{ms(p['total'])}, in all-reduces {share(p['tp'], p['total'])}", TIME_MODEL))
    mem = planner.memory_per_gpu(mc, Layout(tp=RANKS, micro_batch_size=b), s, dtype="fp32", recipe="ours")
    one = planner.memory_per_gpu(mc, Layout(micro_batch_size=b), s, dtype="fp32", recipe="ours")
    rows.append(Row("memory per GPU, tp=8 vs one GPU", f"{gib(mem['total'])} vs {gib(one['total'])}",
                    "planner.memory_per_gpu"))
    return rows


PREDICTORS = {"01_single_device": lesson_01, "02_collectives": lesson_02, "03_data_parallel": lesson_03,
              "04_zero": lesson_04, "05_tensor_parallel": lesson_05}


def command(lesson):
    """The command that runs `lesson` in full on one 8-GPU node, its 8-rank layout where it has one."""
    eight = 8 in _common.LESSONS[lesson].get("choose", {})
    return (f"{'PICOTRON_NPROC=8 ' if eight else ''}./run.sh python lessons/_notebook.py {lesson} --run full "
            f"--out /tmp/nb")


COMMANDS = {lesson: command(lesson) for lesson in _common.LESSONS}

from _node_late import PREDICTORS as _late  # noqa: E402  (lessons 06-11, in a module of their own)

PREDICTORS.update(_late)


def show(lesson):
    """Print the predictions for `lesson` as a table, then the command that measures them."""
    rows = PREDICTORS[lesson]()
    print("Predictions (picotron's planner, one 8×H100 SXM node; not measured here):")
    widths = [max(len(str(r[i])) for r in rows) for i in range(2)]
    for r in rows:
        print(f"  {r.what:<{widths[0]}}  {r.predicted:>{widths[1]}}  ({r.how})")
    print(f"Measure them on a pod: {COMMANDS[lesson]}")


def is_number(text):
    """Whether a predicted value starts with a number (what the tests ask of at least one row per lesson)."""
    return re.match(r"^\d[\d,.]*", str(text)) is not None
