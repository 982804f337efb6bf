"""What one node of 8 GPUs should show in lessons 06-11: the predictions behind `_node.show` for the later lessons
(lessons/_node.py has the first five, the table's format and the commands; it adds these with PREDICTORS.update).

    PREDICTORS    lesson -> function() -> [Row]: each lesson's experiment at its GPU size (_common.GPU_SETTINGS, full
                  mode) and at 8 ranks where the lesson has an 8-rank mode (its `configs_at(8)`), predicted by
                  picotron.planner and picotron.plan (their one home; nothing is retyped here)

Every function reads the lesson's own settings (experiment.settings, sized for GPUs), so a row changes when the
lesson's experiment does. Times are the time model's: one kernel efficiency for every shape, no launch overhead;
for the lessons' small models (a few million parameters) a GPU step is largely kernel launches, so a predicted
step time is a floor, and for the tiny ones (under _node.LAUNCH_BOUND) it is "not modelled". Memory and bytes do
not depend on that: they are counts.
"""
from dataclasses import replace

import _common
from picotron import expert_parallel, kernels, planner
from picotron.plan import step_time
from picotron.plan.hardware import GPUS, HBM_BANDWIDTH, at_dtype, ridge, roofline
from picotron.planner import Layout

RANKS = 8
FLOOR = "plan.step_time; a floor: no kernel launches"


def _node():
    """lessons/_node.py (Row, NODE, gpu_row, model and the formats), imported when first needed: it imports this
    module while it loads, so this one cannot import it at the top."""
    import _node

    return _node


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
    n = _node()
    st, lesson = _gpu_settings("06_context_parallel")
    hw, s, b = at_dtype(n.NODE, "fp32"), st["train_seq"], st["train_b"]
    mc = n.model(st["size"], max_position_embeddings=max(1024, s))
    rows = []
    for c in (1, 2, 4, RANKS):
        t = step_time(mc, Layout(cp=c, micro_batch_size=b), s, hw, dtype="fp32")
        rows.append(n.Row(f"step time, cp={c}, {st['size']}, fp32, {b}x{s:,} tokens", f"{n.ms(t['total'])}, ring "
                          f"exposed {n.share(t['cp'], t['total'])}", FLOOR))
    sent = planner.cp_bytes_per_step(RANKS, b, s, mc.num_key_value_heads, mc.head_dim, mc.num_hidden_layers, elem=4)
    rows.append(n.Row(f"K/V bytes a rank sends per step, ring, cp=8 ({planner.cp_messages_per_layer(RANKS)} "
                      f"messages a layer)", f"{sent / n.MiB:.1f} MiB", "planner.cp_bytes_per_step (§4c counts it)"))
    for impl in ("allgather", "ulysses"):
        t = step_time(mc, Layout(cp=RANKS, cp_impl=impl, micro_batch_size=b), s, hw, dtype="fp32")
        rows.append(n.Row(f"step time, cp=8, {impl}", f"{n.ms(t['total'])}, exposed {n.share(t['cp'], t['total'])}",
                          FLOOR))
    one, eight = (planner.memory_per_gpu(mc, Layout(cp=c, micro_batch_size=b), s, dtype="fp32")["activations"]
                  for c in (1, RANKS))
    rows.append(n.Row(f"activations per GPU, cp=1 vs cp=8, s={s:,}", f"{n.gib(one)} vs {n.gib(eight)}",
                      "planner.memory_per_gpu"))
    rows.append(n.Row("attention max/min of 8 ranks, contiguous vs zig-zag (causal blocks at half cost)",
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
    n = _node()
    st, lesson = _gpu_settings("07_pipeline_parallel")
    st = lesson.at_world(st, RANKS)
    hw, s = at_dtype(n.NODE, "fp32"), st["seq_len"]
    mc = n.model(st["size"], num_hidden_layers=st["layers"])
    rows = []
    for name in ("afab", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe"):
        layout = lesson_07_layout(st, name)
        t = step_time(mc, layout, s, hw, dtype="fp32")
        label = "interleaved v=2" if name == "interleaved" else name
        rows.append(n.Row(f"{label}, pp=8, m={layout.grad_acc}: bubble share; step time",
                          f"{n.share(t['bubble'], t['total'])}; {n.ms(t['total'])}", FLOOR))
    acts = {name: planner.memory_per_gpu(mc, lesson_07_layout(st, name), s, dtype="fp32")["activations"]
            for name in ("afab", "1f1b")}
    rows.append(n.Row("activations of the busiest stage, AFAB vs 1F1B", f"{n.gib(acts['afab'])} vs "
                      f"{n.gib(acts['1f1b'])}", "planner.memory_per_gpu"))
    return rows


def lesson_08():
    """Expert parallelism at ep = 8: tiny-moe with 8 experts (at_world), fp32, 8 sequences of 256 tokens per rank:
    the all-to-all bytes a rank sends per step (balanced routing), their time, and the model states per GPU at
    ep = 1 against ep = 8."""
    n = _node()
    st, lesson = _gpu_settings("08_expert_parallel")
    st = lesson.at_world(st, RANKS)
    hw, s, b = at_dtype(n.NODE, "fp32"), st["seq_len"], st["micro_batch_size"]
    mc = n.model(st["preset"], experts=st["experts"])
    sent = expert_parallel.bytes_per_step_formula(b * s, mc.num_experts_per_tok, mc.hidden_size, RANKS,
                                                  mc.num_hidden_layers)
    t = step_time(mc, Layout(dp=RANKS, ep=RANKS, micro_batch_size=b), s, hw, dtype="fp32")
    rows = [n.Row(f"all-to-all bytes a rank sends per step, ep=8, {b}x{s} tokens, top-{mc.num_experts_per_tok}",
                  f"{sent / n.MiB:.1f} MiB", "expert_parallel.bytes_per_step_formula (§5 counts it)"),
            n.Row("all-to-all time per step, ep=8 (16 all-to-alls over NVLink)", n.ms(t["ep"]),
                  "plan.step_time's ep part: ring α-β, mostly α"),
            n.Row("step time, tiny-moe", "not modelled", "its step is kernel launches; the time model counts FLOPs")]
    for e in (1, RANKS):
        mem = planner.memory_per_gpu(mc, Layout(dp=RANKS, ep=e, micro_batch_size=b), s, dtype="fp32")
        rows.append(n.Row(f"model states per GPU, ep={e}", f"{(mem['params'] + mem['grads'] + mem['optimizer']) / n.MiB:.1f} MiB",
                          "planner.memory_per_gpu"))
    return rows


def lesson_09():
    """The 4-D run at 8 ranks (dp1-pp2-cp2-tp2, the tiny model, fp32, 4 micro-batches of 4 x 512 tokens, 1F1B): the
    memory per GPU, the communication time of each axis (the time model's α-β parts) and the bubble."""
    n = _node()
    st, lesson = _gpu_settings("09_all_together")
    hw, s, d = at_dtype(n.NODE, "fp32"), st["seq_len"], lesson.LAYOUTS[RANKS]
    mc = n.model(st["preset"])
    layout = Layout(**d, micro_batch_size=st["micro_batch_size"], grad_acc=st["grad_acc"])
    t = step_time(mc, layout, s, hw, dtype="fp32")
    mem = planner.memory_per_gpu(mc, layout, s, dtype="fp32")
    name = lesson.layout_name(d)
    return [n.Row(f"memory per GPU, {name}, s={s}", f"{mem['total'] / n.MiB:.1f} MiB", "planner.memory_per_gpu"),
            n.Row("tp all-reduces per step (4 a layer and micro-batch)", n.ms(t["tp"]), "plan.step_time, α-β"),
            n.Row("cp ring, exposed per step", n.ms(t["cp"]), "plan.step_time, α-β less the attention"),
            n.Row("pp sends per step", n.ms(t["pp"]), "plan.step_time, α-β"),
            n.Row(f"1F1B bubble, p=2, m={st['grad_acc']}", n.share(t["bubble"], t["total"]),
                  "of the step: (p-1)/(m+p-1)"),
            n.Row("step time, MFU, tiny model", "not modelled", "its step is kernel launches; the time model counts FLOPs")]


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
    n = _node()
    st, lesson = _gpu_settings("10_checkpoints_and_faults")
    size = st["cost_sizes"][-1]
    mc = n.model(size)
    states = planner.model_state_bytes(mc.num_params())
    whole = states["params"] + states["optimizer"]
    rows = [n.Row(f"checkpoint, {size} ({mc.num_params() / 1e6:.0f} M parameters), the node", f"{whole / n.MiB:.0f} MiB",
                  "planner.model_state_bytes: weights + moments, 12 bytes a parameter")]
    for name, d in lesson.layouts(RANKS).items():
        written = planner.model_state_bytes(owned_params(mc, Layout(**d, micro_batch_size=st["micro_batch_size"]),
                                                         st["seq_len"]))
        rows.append(n.Row(f"bytes the busiest rank writes, {name}",
                          f"{(written['params'] + written['optimizer']) / n.MiB:.0f} MiB",
                          "the parameters it owns (planner.memory_per_gpu) x 12 bytes"))
    save = whole / ASSUMED_DISK
    rows.append(n.Row(f"save time, the node's {whole / n.MiB:.0f} MiB at an ASSUMED {ASSUMED_DISK / 1e9:.0f} GB/s disk",
                      n.ms(save), "bytes / the assumed bandwidth; not a measured disk"))
    mtbf = lesson.mtbf_hours(RANKS) * 3600
    rows.append(n.Row(f"Young's interval, MTBF {lesson.mtbf_hours(RANKS) / 24:.0f} days (Llama 3's rate, 8 GPUs)",
                      f"{lesson.young(save, mtbf) / 60:.0f} min", "lesson.young(save time, MTBF)"))
    return rows


# Lesson 11 §6's attention layer (Llama-3-8B-like: 32 query heads, 8 KV heads, d = 128, bf16, tiles of 128) at 4,096
ATTENTION = dict(a=32, kv=8, s=4096, d=128, elem=2, tile=128)


def lesson_11():
    """Precision and kernels on one H100 (its experiments run in one process; the two-process comm experiment counts
    bytes that do not change with size): a step of SmolLM-360M (1,024 tokens x 4) in bf16 against fp32, FP8 (not
    modelled), and §6's attention intensity against the H100's ridge, per query head (Triton, FlashAttention-2) and
    per KV head."""
    n = _node()
    _, lesson = _gpu_settings("11_precision_and_kernels")
    mc, layout, s = n.model("smollm-360m"), Layout(micro_batch_size=4), 1024
    rows = []
    for dtype in ("bf16", "fp32"):
        t = step_time(mc, layout, s, at_dtype(n.NODE, dtype), dtype=dtype)
        rows.append(n.Row(f"step time, smollm-360m, {dtype}, 4x{s:,} tokens, one H100", f"{n.ms(t['total'])} "
                          f"({t['tokens_per_s']:,.0f} tokens/s)", "plan.step_time (./run.sh gpu-check measures it)"))
    rows.append(n.Row("step time, fp8", "not modelled", "the time model has bf16 and fp32 peaks; FP8's casts and "
                      "scales are not in it"))
    a, kv, s, d, elem, tile = (ATTENTION[k] for k in ("a", "kv", "s", "d", "elem", "tile"))
    flops = lesson.attention_flops(1, a, s, d, "tiled", tile, tile)
    hw = GPUS[n.NODE]
    top = ridge(hw.peak, HBM_BANDWIDTH[n.NODE])
    for label, heads in (("per query head (Triton, FA-2)", a), ("per KV head", kv)):
        intensity = flops / kernels.attention_bytes(1, a, heads, s, d, elem, tile, tile, impl="tiled")
        reach = roofline(hw.peak, HBM_BANDWIDTH[n.NODE], intensity) / hw.peak
        rows.append(n.Row(f"attention intensity, {label}, s={s:,}, bf16, ridge {top:.0f}",
                          f"{intensity:.0f} FLOP/byte, {reach:.0%} of the peak at most",
                          "kernels.attention_bytes, hardware.roofline"))
    return rows


PREDICTORS = {"06_context_parallel": lesson_06, "07_pipeline_parallel": lesson_07, "08_expert_parallel": lesson_08,
              "09_all_together": lesson_09, "10_checkpoints_and_faults": lesson_10,
              "11_precision_and_kernels": lesson_11}
