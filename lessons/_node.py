"""What one node of 8 GPUs should show, lesson by lesson: the planner's predictions for each lesson's experiment
at its GPU size (its row of _common.GPU_SETTINGS), and the command that measures them. Every lesson's section
"On an 8-GPU node you should see" calls `show(lesson)`.

    NODE          the picotron.plan.hardware.GPUS key of the node: 8 H100 SXM on NVLink
    Row           (what, predicted, how): one prediction, its value with its unit, and what predicted it
    PREDICTORS    lesson -> function() -> [Row]   
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
from dataclasses import replace

import _common  # noqa: F401  (puts the repository root on sys.path)
from picotron import expert_parallel, kernels, planner
from picotron.config import Config
from picotron.plan import GiB, MiB, link, ring_time, step_time
from picotron.plan.hardware import GPUS, HBM_BANDWIDTH, at_dtype, ridge, roofline
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



# ------------------------------------------------------------------------------------- lessons 06-11

FLOOR = "plan.step_time; a floor: no kernel launches"


def _gpu_settings(lesson, fast=False):
    """A lesson's experiment settings as they run on GPUs (its GPU_SETTINGS row on top), and the experiment module."""
    lesson_module = _common.load_lesson(lesson)
    if lesson in ("10_checkpoints_and_faults", "11_precision_and_kernels"):  # settings without a device: the row
        return _common.sized(lesson, lesson_module.settings(fast), fast, "cuda"), lesson_module  # on top by hand
    return lesson_module.settings(fast, "cuda"), lesson_module


def lesson_06():
    """Context parallelism: the lesson's train run at GPU size (the small model, fp32, b = 2 sequences of 4,096
    tokens, one sequence cut over cp ranks): the step time at cp = 1, 2, 4, 8 and the ring's exposed share, the bytes
    a rank sends, ring against all-gather and Ulysses at cp = 8, the activations per GPU, and zig-zag's balance."""
    st, lesson = _gpu_settings("06_context_parallel")
    hw, s, b = at_dtype(NODE, "fp32"), st["train_seq"], st["train_b"]
    mc = model(st["size"], max_position_embeddings=max(1024, s))
    rows = []
    for c in (1, 2, 4, RANKS):
        t = step_time(mc, Layout(cp=c, micro_batch_size=b), s, hw, dtype="fp32")
        rows.append(Row(f"step time, cp={c}, {st['size']}, fp32, {b}x{s:,} tokens", f"{ms(t['total'])}, ring "
                          f"exposed {share(t['cp'], t['total'])}", FLOOR))
    sent = planner.cp_bytes_per_step(RANKS, b, s, mc.num_key_value_heads, mc.head_dim, mc.num_hidden_layers, elem=4)
    rows.append(Row(f"K/V bytes a rank sends per step, ring, cp=8 ({planner.cp_messages_per_layer(RANKS)} "
                      f"messages a layer)", f"{sent / MiB:.1f} MiB", "planner.cp_bytes_per_step (§4c counts it)"))
    for impl in ("allgather", "ulysses"):
        t = step_time(mc, Layout(cp=RANKS, cp_impl=impl, micro_batch_size=b), s, hw, dtype="fp32")
        rows.append(Row(f"step time, cp=8, {impl}", f"{ms(t['total'])}, exposed {share(t['cp'], t['total'])}",
                          FLOOR))
    one, eight = (planner.memory_per_gpu(mc, Layout(cp=c, micro_batch_size=b), s, dtype="fp32")["activations"]
                  for c in (1, RANKS))
    rows.append(Row(f"activations per GPU, cp=1 vs cp=8, s={s:,}", f"{gib(one)} vs {gib(eight)}",
                      "planner.memory_per_gpu"))
    rows.append(Row("attention max/min of 8 ranks, contiguous vs zig-zag (causal blocks at half cost)",
                      f"{lesson.predicted_ratio(RANKS, 'contiguous', 0.5):.1f} vs "
                      f"{lesson.predicted_ratio(RANKS, 'zigzag', 0.5):.1f}", "§2(c)'s block counts (lesson.pairs)"))
    return rows


def lesson_07_layout(st, name, p=RANKS):
    """The bubble run's layout of schedule `name` on p stages at the largest m of the settings."""
    m = st["ms"][-1] if name != "dualpipe" else st["dual_m"]
    return Layout(pp=p, pp_schedule=name, pp_chunks=2 if name == "interleaved" else 1, grad_acc=m,
                  micro_batch_size=st["micro_batch_size"])


def lesson_07():
    """Pipeline parallelism at pp = 8: the medium model with 16 layers (at_world: a layer per chunk of ZB-V's 2p),
    fp32, m = 16 micro-batches of 4 x 512 tokens: each schedule's bubble share and step time, and the busiest stage's
    activations, AFAB against 1F1B."""
    st, lesson = _gpu_settings("07_pipeline_parallel")
    st = lesson.at_world(st, RANKS)
    hw, s = at_dtype(NODE, "fp32"), st["seq_len"]
    mc = model(st["size"], num_hidden_layers=st["layers"])
    rows = []
    for name in ("afab", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe"):
        layout = lesson_07_layout(st, name)
        t = step_time(mc, layout, s, hw, dtype="fp32")
        label = "interleaved v=2" if name == "interleaved" else name
        rows.append(Row(f"{label}, pp=8, m={layout.grad_acc}: bubble share; step time",
                          f"{share(t['bubble'], t['total'])}; {ms(t['total'])}", FLOOR))
    acts = {name: planner.memory_per_gpu(mc, lesson_07_layout(st, name), s, dtype="fp32")["activations"]
            for name in ("afab", "1f1b")}
    rows.append(Row("activations of the busiest stage, AFAB vs 1F1B", f"{gib(acts['afab'])} vs "
                      f"{gib(acts['1f1b'])}", "planner.memory_per_gpu"))
    return rows


def lesson_08():
    """Expert parallelism at ep = 8: tiny-moe with 8 experts (at_world), fp32, 8 sequences of 256 tokens per rank:
    the all-to-all bytes a rank sends per step (balanced routing), their time, and the model states per GPU at
    ep = 1 against ep = 8."""
    st, lesson = _gpu_settings("08_expert_parallel")
    st = lesson.at_world(st, RANKS)
    hw, s, b = at_dtype(NODE, "fp32"), st["seq_len"], st["micro_batch_size"]
    mc = model(st["preset"], experts=st["experts"])
    sent = expert_parallel.bytes_per_step_formula(b * s, mc.num_experts_per_tok, mc.hidden_size, RANKS,
                                                  mc.num_hidden_layers)
    t = step_time(mc, Layout(dp=RANKS, ep=RANKS, micro_batch_size=b), s, hw, dtype="fp32")
    rows = [Row(f"all-to-all bytes a rank sends per step, ep=8, {b}x{s} tokens, top-{mc.num_experts_per_tok}",
                  f"{sent / MiB:.1f} MiB", "expert_parallel.bytes_per_step_formula (§5 counts it)"),
            Row("all-to-all time per step, ep=8 (16 all-to-alls over NVLink)", ms(t["ep"]),
                  "plan.step_time's ep part: ring α-β, mostly α"),
            Row("step time, tiny-moe", "not modelled", "its step is kernel launches; the time model counts FLOPs")]
    for e in (1, RANKS):
        mem = planner.memory_per_gpu(mc, Layout(dp=RANKS, ep=e, micro_batch_size=b), s, dtype="fp32")
        rows.append(Row(f"model states per GPU, ep={e}", f"{(mem['params'] + mem['grads'] + mem['optimizer']) / MiB:.1f} MiB",
                          "planner.memory_per_gpu"))
    return rows


def lesson_09():
    """The 4-D run at 8 ranks (dp1-pp2-cp2-tp2, the tiny model, fp32, 4 micro-batches of 4 x 512 tokens, 1F1B): the
    memory per GPU, the communication time of each axis (the time model's α-β parts) and the bubble."""
    st, lesson = _gpu_settings("09_all_together")
    hw, s, d = at_dtype(NODE, "fp32"), st["seq_len"], lesson.LAYOUTS[RANKS]
    mc = model(st["preset"])
    layout = Layout(**d, micro_batch_size=st["micro_batch_size"], grad_acc=st["grad_acc"])
    t = step_time(mc, layout, s, hw, dtype="fp32")
    mem = planner.memory_per_gpu(mc, layout, s, dtype="fp32")
    name = lesson.layout_name(d)
    return [Row(f"memory per GPU, {name}, s={s}", f"{mem['total'] / MiB:.1f} MiB", "planner.memory_per_gpu"),
            Row("tp all-reduces per step (4 a layer and micro-batch)", ms(t["tp"]), "plan.step_time, α-β"),
            Row("cp ring, exposed per step", ms(t["cp"]), "plan.step_time, α-β less the attention"),
            Row("pp sends per step", ms(t["pp"]), "plan.step_time, α-β"),
            Row(f"1F1B bubble, p=2, m={st['grad_acc']}", share(t["bubble"], t["total"]),
                  "of the step: (p-1)/(m+p-1)"),
            Row("step time, MFU, tiny model", "not modelled", "its step is kernel launches; the time model counts FLOPs")]


# An assumed write bandwidth of one node's local NVMe, bytes/s: NOT a datasheet figure (drives and file systems differ
# by 10x); the rows that use it say so.
ASSUMED_DISK = 2e9


def owned_params(mc, layout, seq_len):
    """Parameters the busiest rank writes into a checkpoint: every distinct value is written once, by its owner
    (picotron.checkpoint). Without ZeRO a dp replica owns nothing, so the busiest writer (dp rank 0) owns its whole tp
    and pp slice; with ZeRO (any stage) each dp rank owns its shard of the weights and their moments, what ZeRO-3
    holds. Read off planner.memory_per_gpu's fp32 weights (4 bytes each)."""
    if layout.zero:
        layout = replace(layout, zero=3)
    return planner.memory_per_gpu(mc, layout, seq_len, dtype="fp32")["params"] / planner.RECIPES["ours"][0]


def lesson_10():
    """Checkpoints at 8 ranks: the medium model's checkpoint (fp32 weights and AdamW's two moments), the bytes the
    busiest rank writes in each of the 8-rank layouts (layouts(8)), the save time at an assumed disk bandwidth, and
    Young's interval at Llama 3's failure rate scaled to 8 GPUs."""
    st, lesson = _gpu_settings("10_checkpoints_and_faults")
    size = st["cost_sizes"][-1]
    mc = model(size)
    states = planner.model_state_bytes(mc.num_params())
    whole = states["params"] + states["optimizer"]
    rows = [Row(f"checkpoint, {size} ({mc.num_params() / 1e6:.0f} M parameters), the node", f"{whole / MiB:.0f} MiB",
                  "planner.model_state_bytes: weights + moments, 12 bytes a parameter")]
    for name, d in lesson.layouts(RANKS).items():
        written = planner.model_state_bytes(owned_params(mc, Layout(**d, micro_batch_size=st["micro_batch_size"]),
                                                         st["seq_len"]))
        rows.append(Row(f"bytes the busiest rank writes, {name}",
                          f"{(written['params'] + written['optimizer']) / MiB:.0f} MiB",
                          "the parameters it owns (planner.memory_per_gpu) x 12 bytes"))
    save = whole / ASSUMED_DISK
    rows.append(Row(f"save time, the node's {whole / MiB:.0f} MiB at an ASSUMED {ASSUMED_DISK / 1e9:.0f} GB/s disk",
                      ms(save), "bytes / the assumed bandwidth; not a measured disk"))
    mtbf = lesson.mtbf_hours(RANKS) * 3600
    rows.append(Row(f"Young's interval, MTBF {lesson.mtbf_hours(RANKS) / 24:.0f} days (Llama 3's rate, 8 GPUs)",
                      f"{lesson.young(save, mtbf) / 60:.0f} min", "lesson.young(save time, MTBF)"))
    return rows


# Lesson 11 §6's attention layer (Llama-3-8B-like: 32 query heads, 8 KV heads, d = 128, bf16, tiles of 128) at 4,096
ATTENTION = dict(a=32, kv=8, s=4096, d=128, elem=2, tile=128)


def lesson_11():
    """Precision and kernels on one H100 (its experiments run in one process; the two-process comm experiment counts
    bytes that do not change with size): a step of SmolLM-360M (1,024 tokens x 4) in bf16 against fp32, FP8 (not
    modelled), and §6's attention intensity against the H100's ridge, per query head (Triton, FlashAttention-2) and
    per KV head."""
    _, lesson = _gpu_settings("11_precision_and_kernels")
    mc, layout, s = model("smollm-360m"), Layout(micro_batch_size=4), 1024
    rows = []
    for dtype in ("bf16", "fp32"):
        t = step_time(mc, layout, s, at_dtype(NODE, dtype), dtype=dtype)
        rows.append(Row(f"step time, smollm-360m, {dtype}, 4x{s:,} tokens, one H100", f"{ms(t['total'])} "
                          f"({t['tokens_per_s']:,.0f} tokens/s)", "plan.step_time (./run.sh gpu-check measures it)"))
    rows.append(Row("step time, fp8", "not modelled", "the time model has bf16 and fp32 peaks; FP8's casts and "
                      "scales are not in it"))
    a, kv, s, d, elem, tile = (ATTENTION[k] for k in ("a", "kv", "s", "d", "elem", "tile"))
    flops = lesson.attention_flops(1, a, s, d, "tiled", tile, tile)
    hw = GPUS[NODE]
    top = ridge(hw.peak, HBM_BANDWIDTH[NODE])
    for label, heads in (("per query head (Triton, FA-2)", a), ("per KV head", kv)):
        intensity = flops / kernels.attention_bytes(1, a, heads, s, d, elem, tile, tile, impl="tiled")
        reach = roofline(hw.peak, HBM_BANDWIDTH[NODE], intensity) / hw.peak
        rows.append(Row(f"attention intensity, {label}, s={s:,}, bf16, ridge {top:.0f}",
                          f"{intensity:.0f} FLOP/byte, {reach:.0%} of the peak at most",
                          "kernels.attention_bytes, hardware.roofline"))
    return rows


PREDICTORS = {"01_single_device": lesson_01, "02_collectives": lesson_02, "03_data_parallel": lesson_03,
              "04_zero": lesson_04, "05_tensor_parallel": lesson_05, "06_context_parallel": lesson_06,
              "07_pipeline_parallel": lesson_07, "08_expert_parallel": lesson_08, "09_all_together": lesson_09,
              "10_checkpoints_and_faults": lesson_10, "11_precision_and_kernels": lesson_11}


def command(lesson):
    """The command that runs `lesson` in full on one 8-GPU node, its 8-rank layout where it has one."""
    eight = 8 in _common.LESSONS[lesson].get("choose", {})
    return (f"{'PICOTRON_NPROC=8 ' if eight else ''}./run.sh python lessons/_notebook.py {lesson} --run full "
            f"--out /tmp/nb")


COMMANDS = {lesson: command(lesson) for lesson in _common.LESSONS}


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
