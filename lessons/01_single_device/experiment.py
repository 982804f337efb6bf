"""Lesson 01, the experiment: where the memory of one training step goes on ONE device, and what the three
single-device tools (activation recomputation, gradient accumulation, bf16 autocast) buy and cost.

    python lessons/01_single_device/experiment.py --out runs/lessons/01_single_device [--only memory,recompute]
    torchrun --nproc_per_node 1 lessons/01_single_device/experiment.py --out ...      # the same, under torchrun
    PICOTRON_FAST=1 python lessons/01_single_device/experiment.py ...                 # short settings (CI, ~1 min)

Each experiment writes OUT/<name>.json, which the notebook plots:
    memory      one real training step per (model size, sequence length, dtype): bytes of params, grads,
                optimizer state (walking the tensors) and activations (saved-tensor hooks), next to
                picotron.planner.memory_estimate
    recompute   none / selective / full, for sdpa and eager attention: activation bytes, forward+backward
                time, and loss and gradients compared with no recomputation
    accumulate  one batch of B sequences vs k micro-batches of B/k: gradients and activation bytes
    precision   fp32 vs bf16 autocast: two short runs of picotron.train (loss curves, tokens/s, memory)
    throughput  tokens/s and MFU against the measured matmul peak for a few model sizes (picotron.train)
`saved_tensors_table` and the plot_* functions are imported by the notebook.
"""
import argparse
import functools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/
import _common  # noqa: E402  (puts the repository root on sys.path)

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from picotron import data, metrics, planner  # noqa: E402
from picotron import train as trainer  # noqa: E402
from picotron.parallelize import parallelize  # noqa: E402
from picotron.config import Config  # noqa: E402
from picotron.mesh import Mesh  # noqa: E402
from picotron.model import DecoderLayer, rope_cos_sin  # noqa: E402

# Model sizes of the sweeps: the "tiny" preset (byte vocabulary) widened and deepened.
SIZES = {
    "tiny": {},
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4),
    "medium": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6),
}
GPU_SIZES = {"smollm-135m": dict(preset="smollm-135m"), "smollm-360m": dict(preset="smollm-360m")}


# ------------------------------------------------------------------------ the saved-tensor table
def saved_tensors_table(model_config, seq_len=16, batch=2, dtype="fp32", recompute="none"):
    """Every tensor autograd saves in ONE decoder layer's forward: module, op, shape, dtype, bytes, note.

    Two hooks do the work: forward pre/post hooks keep track of the current sub-module, a TorchFunctionMode
    remembers the torch function being called, and a saved-tensor hook records what autograd keeps.
    A storage already saved counts once (note "same storage"); parameters are not activations."""
    torch.manual_seed(0)
    layer = DecoderLayer(model_config)
    stack, current, rows, seen = ["layer"], [""], [], set()
    for name, module in layer.named_modules():
        if name:
            module.register_forward_pre_hook(lambda m, a, n=name: stack.append(n))
            module.register_forward_hook(lambda m, a, o: stack.pop() and None)
    params = {p.untyped_storage().data_ptr(): n for n, p in layer.named_parameters()}
    shapes = {tuple(p.shape) for p in layer.parameters()}
    x = torch.randn(batch, seq_len, model_config.hidden_size, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(seq_len), model_config.head_dim, model_config.rope_theta)
    rope = {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}

    class RememberOp(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            current[0] = getattr(func, "__name__", str(func)).strip("_")
            return func(*args, **(kwargs or {}))

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        note, nbytes, base = "", t.untyped_storage().nbytes(), t if t._base is None else t._base
        if ptr in params:
            note, nbytes = f"parameter {params[ptr]}: not an activation", 0
        elif ptr in seen:
            note, nbytes = "same storage as a tensor above", 0
        elif ptr in rope:
            note = "RoPE table: one for all layers"
        elif t.dtype == torch.bfloat16 and base.dim() == 2 and tuple(base.shape) in shapes:  # W.t() of a copy
            note = "autocast's bf16 copy of the weight"
        seen.add(ptr)
        rows.append(dict(module=stack[-1], op=current[0], shape=tuple(t.shape),
                         dtype=str(t.dtype).replace("torch.", ""), bytes=nbytes, note=note))
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    with autocast, RememberOp(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if recompute == "full":
            torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)
        else:
            layer(x, cos, sin, selective=recompute == "selective")
    return rows


def print_table(rows):
    print(f"{'module':<26}{'op':<30}{'shape':<18}{'dtype':<10}{'bytes':>9}  note")
    for r in rows:
        print(f"{r['module']:<26}{r['op']:<30}{str(r['shape']):<18}{r['dtype']:<10}{r['bytes']:>9,}  {r['note']}")
    print(f"{'total (each storage once, parameters excluded)':<84}{sum(r['bytes'] for r in rows):>9,}")


def by_part(rows):
    """Sum the table's bytes by part of the layer, in planner.activation_terms_per_layer's names."""
    parts = {}
    for r in rows:
        if r["note"].startswith("autocast"):
            part = "bf16 weight copies"
        elif r["note"].startswith("RoPE"):
            part = "RoPE tables (shared)"
        else:
            part = r["module"].split(".")[0]
        parts[part] = parts.get(part, 0) + r["bytes"]
    return parts


# ------------------------------------------------------------------------------- one real step
def make_cfg(size="tiny", **kw):
    overrides = dict(SIZES[size] if size in SIZES else GPU_SIZES[size])
    return Config(**{"preset": "tiny", "sample_tokens": 0, **overrides, **kw})


@functools.lru_cache(maxsize=1)
def shakespeare_tokens():
    tok = data.get_tokenizer("byte")
    return data.TokenData(tok.encode_tensor(data.load_text("shakespeare")), tok.vocab_size)


def batches(cfg, step=1):
    """The trainer's own data: step `step`'s micro-batches of the embedded Shakespeare (byte tokens)."""
    loader = data.DataLoader(shakespeare_tokens(), seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size,
                             grad_acc=cfg.grad_acc, seed=cfg.seed)
    return loader.micro_batches(step)


def forward_backward(run, micro_batches):
    """Forward and backward of one step's micro-batches through the trainer's step engine (`run.schedule`:
    loss / k per micro-batch, gradients add up in p.grad, bf16 autocast if cfg.dtype says so).
    Returns (loss, activation bytes of the first micro-batch, seconds)."""
    device = run.schedule.device
    metrics.sync(device)
    t0 = time.perf_counter()
    loss = float(run.schedule.run(run.model, micro_batches, run.loss_fn))  # float(): waits for the device
    metrics.sync(device)
    return loss, run.schedule.activation_bytes, time.perf_counter() - t0


def measure(cfg, mesh, steps=1, keep_grads=False):
    """`steps` real training steps (AdamW included) of a freshly initialised model on the same batch, on ONE
    device (`Mesh.local`: no process group, no replicas): measured memory by category, the fastest steady
    forward+backward time, the first loss (and gradients)."""
    device = mesh.device
    run = parallelize(cfg, Mesh.local(device))  # what the trainer builds: model, AdamW, step engine, loss
    micro = batches(cfg)
    times = []
    for step in range(steps):
        metrics.reset_device_peak(device)
        loss, act, dt = forward_backward(run, micro)
        if step == 0:
            first_loss = loss
            grads = [p.grad.detach().clone() for p in run.raw.parameters()] if keep_grads else None
        mem = run.model.memory()  # params and grads, by walking the tensors
        run.optimizer.step()
        mem["optimizer"] = metrics.optimizer_bytes(run.optimizer)  # the state AdamW creates at its first step
        run.model.zero_grad(set_to_none=True)
        mem.update(activations=act, device_peak=metrics.device_peak_bytes(device))
        times.append(dt)
    steady = times[1:] or times  # the first step pays for allocations and kernel selection
    return dict(mem=mem, time=min(steady), loss=first_loss, grads=grads)  # min: least disturbed by other work


def row(cfg, size, result):
    mc = cfg.model_config()
    est = planner.memory_estimate(mc, cfg.seq_len, cfg.micro_batch_size, cfg.dtype, cfg.recompute)
    return dict(size=size, n_params=mc.num_params(), seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size,
                dtype=cfg.dtype, recompute=cfg.recompute, attn_impl=mc.attn_impl, measured=result["mem"],
                estimate=est, time=result["time"], loss=result["loss"])


# --------------------------------------------------------------------------------- experiments
def exp_memory(mesh, fast, out):
    sizes = ["tiny", "small"] if fast else ["tiny", "small", "medium"]
    seqs, b = ([64, 128, 256], 2) if fast else ([128, 256, 512], 8)
    runs = [(s, L, "fp32") for s in sizes for L in seqs] + [("tiny", L, "bf16") for L in seqs]
    rows = []
    for size, seq, dtype in runs:
        cfg = make_cfg(size, seq_len=seq, micro_batch_size=b, dtype=dtype)
        rows.append(row(cfg, size, measure(cfg, mesh)))
        r = rows[-1]
        print(f"memory  {size:<7}{dtype:<5} s={seq:<4} activations measured {r['measured']['activations']:>12,} "
              f"B, planner {r['estimate']['activations']:>12,} B", flush=True)
    return rows


def exp_recompute(mesh, fast, out):
    seq, b, steps = (256, 2, 4) if fast else (512, 8, 6)
    rows = []
    for impl in ("sdpa", "eager"):
        ref = None
        for mode in ("none", "selective", "full"):
            cfg = make_cfg("small", seq_len=seq, micro_batch_size=b, recompute=mode, attn_impl=impl)
            res = measure(cfg, mesh, steps=steps, keep_grads=True)
            ref = ref or res
            r = row(cfg, "small", res)
            r["max_grad_diff"] = max((g - g0).abs().max().item() for g, g0 in zip(res["grads"], ref["grads"]))
            r["loss_diff"] = abs(res["loss"] - ref["loss"])
            rows.append(r)
            print(f"recompute {impl:<6}{mode:<10} activations {r['measured']['activations']:>12,} B | "
                  f"fwd+bwd {1e3 * r['time']:7.1f} ms | max |grad - grad(none)| {r['max_grad_diff']:.1e}", flush=True)
    return rows


def exp_accumulate(mesh, fast, out):
    global_batch, seq, ks = (8, 128, [1, 2, 4, 8]) if fast else (32, 256, [1, 2, 4, 8, 16])
    rows, ref = [], None
    for k in ks:
        cfg = make_cfg("tiny", seq_len=seq, micro_batch_size=global_batch // k, grad_acc=k)
        res = measure(cfg, mesh, steps=2, keep_grads=True)
        ref = ref or res
        r = row(cfg, "tiny", res)
        r.update(grad_acc=k, max_grad_diff=max((g - g0).abs().max().item() for g, g0 in zip(res["grads"], ref["grads"])),
                 max_grad=max(g0.abs().max().item() for g0 in ref["grads"]), loss_diff=abs(res["loss"] - ref["loss"]))
        rows.append(r)
        print(f"accumulate k={k:<3} micro-batch {global_batch // k:<3} activations {r['measured']['activations']:>11,} B"
              f" | max |grad - grad(k=1)| {r['max_grad_diff']:.1e} | loss {r['loss']:.6f}", flush=True)
    return rows


def exp_precision(mesh, fast, out):
    steps, seq, b = (20, 64, 4) if fast else (100, 128, 8)
    runs = {}
    for dtype in ("fp32", "bf16"):
        cfg = make_cfg("tiny", steps=steps, seq_len=seq, micro_batch_size=b, dtype=dtype, warmup_steps=max(1, steps // 10),
                       eval_every=max(1, steps // 4), log_every=max(1, steps // 4), out=str(Path(out) / f"precision_{dtype}"))
        trainer.train(cfg, mesh)
        history, summary = metrics.read_metrics(cfg.out)
        runs[dtype] = dict(steps=[r["step"] for r in history], loss=[r["loss"] for r in history],
                           val=[(r["step"], r["val_loss"]) for r in history if "val_loss" in r],
                           summary=summary, estimate=planner.memory_estimate(cfg.model_config(), seq, b, dtype))
    return runs


def exp_throughput(mesh, fast, out):
    on_gpu = mesh.device.type == "cuda"
    sizes = ["tiny", "small", "medium"] + (list(GPU_SIZES) if on_gpu else [])
    seq, b, steps = (1024, 16, 20) if on_gpu else ((128, 8, 4) if fast else (256, 8, 10))
    dtype = "bf16" if on_gpu else "fp32"  # CPUs without bf16 units emulate it (see the precision experiment)
    rows = []
    for size in (sizes[:2] if fast else sizes):
        cfg = make_cfg(size, steps=steps, seq_len=seq, micro_batch_size=b, dtype=dtype, eval_every=0, log_every=steps,
                       warmup_steps=1, out=str(Path(out) / f"throughput_{size}"))
        summary = trainer.train(cfg, mesh)
        rows.append(dict(size=size, dtype=dtype, seq_len=seq, micro_batch_size=b, **{k: summary[k] for k in (
            "num_params", "tokens_per_s", "mfu", "flops_per_token", "peak_flops_measured", "peak_flops_datasheet")}))
    return rows


# ------------------------------------------------------------------------ plots (for the notebook)
PARTS = ("params", "grads", "optimizer", "activations")
COLORS = dict(params="#4c72b0", grads="#dd8452", optimizer="#55a868", activations="#c44e52")
MB = 2**20


def stacked_bar(ax, x, breakdown, width=0.38, hatch=None, label=True, scale=MB):
    bottom = 0
    for part in PARTS:
        ax.bar(x, breakdown[part] / scale, width, bottom=bottom, color=COLORS[part], hatch=hatch,
               edgecolor="white", label=part if label else None)
        bottom += breakdown[part] / scale


def plot_memory(rows):
    """Measured (solid) beside planner (hatched) stacked bars, one pair per (size, dtype, seq)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(rows)), 3.6))
    for j, r in enumerate(rows):
        stacked_bar(ax, j - 0.2, r["measured"], label=j == 0)
        stacked_bar(ax, j + 0.2, r["estimate"], hatch="//", label=False)
    ax.set_xticks(range(len(rows)), [f"{r['size']}\n{r['dtype']} s={r['seq_len']}" for r in rows], fontsize=8)
    ax.set_ylabel("MiB")
    ax.set_title(f"One training step, micro-batch {rows[0]['micro_batch_size']}: measured (left) vs "
                 "planner.memory_estimate (right, hatched)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_recompute(rows):
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
    modes = ["none", "selective", "full"]
    for j, impl in enumerate(("sdpa", "eager")):
        sel = {r["recompute"]: r for r in rows if r["attn_impl"] == impl}
        xs = [m + 0.38 * (j - 0.5) for m in range(3)]
        ax1.bar(xs, [sel[m]["measured"]["activations"] / MB for m in modes], 0.38, label=f"{impl} measured")
        ax1.plot(xs, [sel[m]["estimate"]["activations"] / MB for m in modes], "k_", ms=18,
                 label="planner" if j == 0 else None)
        ax2.bar(xs, [1e3 * sel[m]["time"] for m in modes], 0.38, label=impl)
    r0 = rows[0]
    ax1.set(xticks=range(3), xticklabels=modes, ylabel="activation MiB",
            title=f"held for backward (s={r0['seq_len']}, b={r0['micro_batch_size']})")
    ax2.set(xticks=range(3), xticklabels=modes, ylabel="ms", title="forward + backward time")
    ax1.legend(fontsize=8), ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_accumulate(rows):
    import matplotlib.pyplot as plt

    ks = [r["grad_acc"] for r in rows]
    act = [r["measured"]["activations"] / MB for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
    ax1.bar([str(k) for k in ks], act, color=COLORS["activations"], label="measured")
    ax1.plot([str(k) for k in ks], [act[0] / k for k in ks], "ko--", label="(k=1) / k")
    ax1.set(xlabel="k micro-batches per step", ylabel="activation MiB", title="activations of one micro-batch")
    ax1.legend(fontsize=8)
    ax2.bar([str(k) for k in ks], [max(r["max_grad_diff"], 1e-12) for r in rows], color="gray")
    ax2.set(yscale="log", ylim=(1e-12, 1), xlabel="k", title="max |grad(k) - grad(k=1)|  (fp32 rounding)")
    fig.tight_layout()
    return fig


def plot_precision(runs):
    import matplotlib.pyplot as plt

    fig, (ax1, ax4, ax2, ax3) = plt.subplots(1, 4, figsize=(14, 3.2), gridspec_kw=dict(width_ratios=[2, 2, 1, 1]))
    for dtype, r in runs.items():
        ax1.plot(r["steps"], r["loss"], label=f"{dtype} train")
        if r["val"]:
            ax1.plot(*zip(*r["val"]), "o--", label=f"{dtype} val")
    ax1.set(xlabel="step", ylabel="loss", title="same seed, same batches (the curves overlap)")
    ax1.legend(fontsize=8)
    fp32, bf16 = runs["fp32"], runs["bf16"]  # the difference, which the overlapping curves hide
    ax4.plot(fp32["steps"], [b - a for a, b in zip(fp32["loss"], bf16["loss"])], color="#4c72b0",
             label="train (one batch per step)")
    if fp32["val"] and bf16["val"]:
        ax4.plot([s for s, _ in fp32["val"]], [b - a for (_, a), (_, b) in zip(fp32["val"], bf16["val"])], "o--",
                 color="#dd8452", label="validation (held-out mean)")
    ax4.axhline(0, color="k", lw=0.8)
    ax4.set(xlabel="step", ylabel="loss: bf16 − fp32", title="the difference")
    ax4.legend(fontsize=8)
    names = list(runs)
    ax2.bar(names, [runs[d]["summary"]["tokens_per_s"] for d in names], color=["#4c72b0", "#dd8452"])
    ax2.set(title="tokens/s", yscale="log")
    ax3.bar(names, [runs[d]["summary"]["mem"]["activations"] / MB for d in names], color=COLORS["activations"])
    ax3.set(title="activation MiB")
    fig.tight_layout()
    return fig


def plot_throughput(rows):
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
    labels = [f"{r['size']}\n{r['num_params'] / 1e6:.1f}M" for r in rows]
    ax1.bar(labels, [r["tokens_per_s"] for r in rows])
    ax1.set(ylabel="tokens/s", title=f"{rows[0]['dtype']}, s={rows[0]['seq_len']}, b={rows[0]['micro_batch_size']}")
    ax2.bar(labels, [100 * r["mfu"] for r in rows], label="of the measured matmul peak")
    if rows[0]["peak_flops_datasheet"]:
        ax2.bar(labels, [100 * r["mfu"] * r["peak_flops_measured"] / r["peak_flops_datasheet"] for r in rows],
                0.5, label="of the datasheet peak")
    ax2.set(ylabel="MFU %", title="model FLOPs utilisation", ylim=(0, 100))
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_estimate(estimates, limit_gb=80, title=""):
    """Horizontal stacked bars of planner estimates {label: breakdown} in GB, with a device-memory line."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 1.3 + 0.55 * len(estimates)))
    for j, (label, est) in enumerate(estimates.items()):
        left = 0
        for part in PARTS:
            ax.barh(j, est[part] / 1e9, left=left, color=COLORS[part], label=part if j == 0 else None)
            left += est[part] / 1e9
        ax.text(left, j, f" {left:,.1f} GB", va="center", fontsize=8)
    top = max(sum(est[p] for p in PARTS) for est in estimates.values()) / 1e9
    ax.axvline(limit_gb, color="k", ls="--", lw=1)
    ax.text(limit_gb, -0.5, f" {limit_gb} GB GPU", fontsize=8, va="bottom")
    ax.set_yticks(range(len(estimates)), list(estimates), fontsize=8)
    ax.set(xlim=(0, 1.2 * max(top, limit_gb)), ylim=(len(estimates) - 0.5, -0.5 - 0.6),
           xlabel="GB (10⁹ bytes)", title=title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


EXPERIMENTS = ("memory", "recompute", "accumulate", "precision", "throughput")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(_common.ROOT / "runs" / "lessons" / "01_single_device"))
    p.add_argument("--only", default=",".join(EXPERIMENTS), help=f"comma-separated subset of {EXPERIMENTS}")
    p.add_argument("--fast", action="store_true", default=_common.FAST, help="short settings (or PICOTRON_FAST=1)")
    args = p.parse_args(argv)
    names = args.only.split(",")
    if any(name not in EXPERIMENTS for name in names):
        p.error(f"--only {args.only!r}: pick a comma-separated subset of {', '.join(EXPERIMENTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mesh = Mesh.init()
    try:
        env = dict(device=str(mesh.device), torch=torch.__version__, threads=torch.get_num_threads(), fast=args.fast)
        for name in names:
            t0 = time.perf_counter()
            result = globals()[f"exp_{name}"](mesh, args.fast, out)
            _common.save_json(dict(env, results=result, seconds=time.perf_counter() - t0), out / f"{name}.json")
            path = os.path.relpath(out / f"{name}.json")  # short (and free of home directories) in notebooks
            print(f"== {name}: {time.perf_counter() - t0:.1f} s -> {out / f'{name}.json' if path.startswith('..') else path}",
                  flush=True)
    finally:
        mesh.destroy()


if __name__ == "__main__":
    main()
