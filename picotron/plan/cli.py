"""Find a layout: `python -m picotron.plan --preset llama3-8b --gpus 64 --gpu h100-80gb --seq-len 8192 --global-batch-tokens 4M`.

The command line of picotron.plan: `main` reads the job (the training command's model flags, the GPUs, the batch),
then ranks every layout (`search`), or evaluates one (`--layout tp8,pp16,dp128`: every layout a table row or
--published prints, e.g. `dp2,tp4,pp2,cp4,ulysses,sp,zero1,interleaved-v2,mbs2,ga32`, is accepted verbatim and
evaluates the same), or the published runs (`--published`), and prints the table.
"""
import argparse
import sys
from dataclasses import replace

from picotron.config import MODEL_FIELDS, MOE_FIELDS
from picotron.model_config import PRESETS, ModelConfig
from picotron.plan.hardware import GPUS, HEADROOM, GiB, usable
from picotron.plan.published import PUBLISHED, evaluate_published
from picotron.plan.search import bounding, check_layout, fewest_gpus, least_memory, search
from picotron.plan.time_model import link, step_time
from picotron.planner import Layout, memory_per_stage

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
                        f"published runs by the same rule and prints each one's margin")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch-tokens", default="1M", help="tokens per optimizer step: 4M, 512K (K = 1024) or a number")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="element size of activations and messages")
    p.add_argument("--recipe", choices=("mixed", "mixed-fp32-grads", "ours"), default="mixed",
                   help="bytes per parameter and activations: bf16 mixed precision 2+2+12 (default), with fp32 gradient "
                        "accumulation 2+4+12, or picotron's fp32 trainer 4+4+8"),
    p.add_argument("--layout", default=None, help="evaluate this layout, e.g. tp8,pp16,dp128 (+ zero1, shard8 (HSDP: "
                                                  "ZeRO within groups of 8 dp ranks), sp, mbs2, ga8, "
                                                  "interleaved-v2, dualpipe, ulysses, recompute-full): any layout a "
                                                  "table row or --published shows")
    p.add_argument("--max-tp", type=int, default=None, help="search tp up to this (beyond a node: flagged)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--published", action="store_true", help="evaluate and rank the published runs instead")
    return p


def _job(ns):
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
    flag = "  *" if hw is not None and link(hw, layout.tp)[1] != hw.intra_bw else ""
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


def margin(total, usable, card, headroom):
    """How a layout's memory stands against the usable part of the card: '88.8% of the 79.6 GiB card, 1.0 GiB under the
    71.7 GiB usable (10% kept free)', or '... over ...'."""
    kept = f" ({100 * headroom:g}% kept free)" if headroom else ""
    side = "under" if total <= usable else "over"
    return (f"{100 * total / card:.1f}% of the {card / GiB:.1f} GiB card, {abs(usable - total) / GiB:.2f} GiB {side} the "
            f"{usable / GiB:.1f} GiB usable{kept}")


def print_published(runs=None, rank=True, out=print, headroom=HEADROOM):
    """The published runs against the model, judged by the headroom every search keeps: fits (or by how much it does
    not: the model over-counts a run that trained), its margin, predicted vs published throughput, rank and why others
    rank higher."""
    for run in runs or PUBLISHED:
        r = evaluate_published(run, rank=rank, headroom=headroom)
        mem = r["memory"]
        if mem is None:  # refused before its memory means anything (a shape)
            out(f"{run.name}: {run.gpus:,} x {run.hardware.name}, {run.layout}: REJECTED: {r['why']}")
            continue
        shown = (f"{mem['total'] / GiB:.1f} GiB per GPU" + (f" (published {run.memory_gb:.0f} GB)" if run.memory_gb else "")
                 + ": " + margin(mem["total"], r["usable"], r["card"], headroom))
        out(f"{run.name}: {run.gpus:,} x {run.hardware.name}, {run.layout}: "
            f"{'fits, ' if r['fits'] else 'DOES NOT FIT (the model over-counts a run that trained), '}{shown}; predicted "
            f"{r['predicted_tflops']:.0f} TFLOP/s per GPU vs published {run.tflops:.0f} ({r['ratio']:.2f}x)")
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
            usable(GPUS["h100-80gb"], ns.headroom)  # (one sentence for a headroom out of range)
            print_published(headroom=ns.headroom)
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
            if link(hw, layout.tp)[1] != hw.intra_bw:
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
            if t and link(hw, layout.tp)[1] != hw.intra_bw:
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
        if any(link(hw, lay.tp)[1] != hw.intra_bw for lay, _, _ in plan.ranked[:ns.top]):
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
