"""Lesson 11's experiments: number formats, fp16's loss scaling, the recipes' bytes, FP8 scaling, attention's memory
traffic and tiling, fused kernels and a profile, measured through picotron's own seams (`picotron.precision`,
`picotron.fp8`, `picotron.kernels`, `parallelize` and its step).

    torchrun --nproc_per_node 2 lessons/11_precision_and_kernels/experiment.py [--only comm]
    PICOTRON_FAST=1 ...    # short settings (the notebook's FAST mode)

The one experiment that needs two processes, comm: the bytes each recipe's collectives move at dp 2 (the bucketed
all-reduce of the gradients) and at dp 2 + ZeRO-3 (parameters all-gathered, gradients reduce-scattered), counted
by a metrics.Recorder during one step; rank 0 writes OUT/comm.json.

Everything else runs in the notebook's process (one process, small tensors): the functions below measure, the
plot_* functions draw. The model of sections 2 and 4 is MINI, a 2-layer, 64-wide Llama (0.13 M parameters) that
trains 30 steps in about 2 seconds.
"""
import contextlib
import io
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/
import _common  # noqa: E402  (puts the repository root on sys.path)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from picotron import fp8, fp8_blockwise, kernels, metrics, precision  # noqa: E402
from picotron.plan import hardware  # noqa: E402
from picotron.config import Config  # noqa: E402
from picotron.marks import clip_grad_norm  # noqa: E402
from picotron.mesh import Mesh  # noqa: E402
from picotron.model import AttentionCore, DecoderLayer, loss_fn as model_loss, rope_cos_sin  # noqa: E402
from picotron.parallelize import parallelize  # noqa: E402
from picotron.train import load_data, lr_at  # noqa: E402

EXPERIMENTS = ("comm",)
MiB = 2**20
FONT = 8
# The model of sections 2 and 4: picotron's tiny preset made smaller, so a 30-step run takes ~2 s on a CPU core.
MINI = dict(preset="tiny", hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, seq_len=64, micro_batch_size=4, warmup_steps=3, lr=3e-3, sample_tokens=0,
            eval_every=0, log_every=10**6)
# What one micro-batch of 256 tokens stands for in section 2: a step of V times more tokens (~10^6, a realistic
# LLM step), whose mean loss gives each token a 1/V smaller share of every gradient.
V = 4096
COLORS = {"fp32": "#4c72b0", "bf16": "#55a868", "bf16-params": "#8c8c8c", "fp16": "#dd8452", "fp8": "#c44e52",
          "fp8-blockwise": "#937860", "E4M3": "#c44e52", "E5M2": "#8172b2"}
# H100 SXM datasheet (dense bf16 tensor-core peak; HBM3 bandwidth), from plan.hardware, their one home: the balance
# point of section 6 (lesson 00 measures this machine's).
H100 = dict(flops=hardware.GPUS["h100-80gb"].peak, bandwidth=hardware.HBM_BANDWIDTH["h100-80gb"])
H100_RIDGE = hardware.ridge(H100["flops"], H100["bandwidth"])


def settings(fast):
    return dict(fp16_steps=30 if fast else 60, scale_steps=40, fp8_steps=30 if fast else 60,
                attn_seqs=(256, 512, 1024) if fast else (256, 512, 1024, 2048),
                fused_rows=2048 if fast else 8192, compile_steps=6 if fast else 20, repeats=3 if fast else 7)


def mini_cfg(**kw):
    return Config(**{**MINI, "steps": 30, **kw})


def quiet():
    """Swallow what picotron prints (the start-up line, progress lines) inside a notebook cell."""
    return contextlib.redirect_stdout(io.StringIO())


@contextlib.contextmanager
def silent_stderr():
    """File descriptor 2 sent to /dev/null meanwhile: the profiler's C++ library writes a line to it on start and
    stop, past Python's sys.stderr."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


# ===================================================================================== 1. number formats
FORMATS = {  # name: (torch dtype, exponent bits e, mantissa bits m, has infinities)
    "fp32": (torch.float32, 8, 23, True),
    "bf16": (torch.bfloat16, 8, 7, True),
    "fp16": (torch.float16, 5, 10, True),
    "E4M3": (torch.float8_e4m3fn, 4, 3, False),
    "E5M2": (torch.float8_e5m2, 5, 2, True),
}


def format_formulas(name):
    """A format's numbers from its bits alone (IEEE 754; Micikevicius et al. 2022 for FP8): bias 2^(e-1) - 1;
    smallest normal 2^(1 - bias); smallest subnormal 2^(1 - bias - m); unit roundoff u = 2^-(m+1) (half the gap
    above 1); largest (2 - 2^-m)·2^(2^e - 2 - bias) when the top exponent is kept for inf/NaN, and E4M3fn's
    (2 - 2^(1-m))·2^(2^e - 1 - bias) = 448: it uses the top exponent too, all but the NaN pattern S.1111.111."""
    _, e, m, has_inf = FORMATS[name]
    bias = 2 ** (e - 1) - 1
    if has_inf:
        largest = (2 - 2.0 ** -m) * 2.0 ** (2 ** e - 2 - bias)
    else:
        largest = (2 - 2.0 ** (1 - m)) * 2.0 ** (2 ** e - 1 - bias)
    normal, subnormal = 2.0 ** (1 - bias), 2.0 ** (1 - bias - m)
    return dict(e=e, m=m, bias=bias, max=largest, normal=normal, subnormal=subnormal, u=2.0 ** -(m + 1),
                eps=2.0 ** -m, binades=math.log2(largest / subnormal))


def cast(x, name):
    """x (float64) rounded to the format and back to float64: what storing it in that format keeps."""
    return x.to(FORMATS[name][0]).double()


def rounding_sweep(name, per_binade=1000, seed=0):
    """Magnitudes spread evenly in log2 over the format's whole range and beyond (2 binades below the smallest
    subnormal, 1 above the largest), random within each binade; each cast through the format. Returns x, the
    cast values y and the relative error |y - x| / x (1 where y = 0, inf where y is inf)."""
    f = format_formulas(name)
    lo, hi = math.log2(f["subnormal"]) - 2, math.log2(f["max"]) + 1
    n = int((hi - lo) * per_binade)
    g = torch.Generator().manual_seed(seed)
    x = torch.exp2(lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64))
    y = cast(x, name)
    return x, y, (y - x).abs() / x


def measure_format(name):
    """What casting shows about a format: the smallest positive value it returns (its smallest subnormal), the
    largest relative error inside the normal range (its unit roundoff), what happens below half the smallest
    subnormal (zero) and above the largest number (inf, or the largest number if the cast saturates)."""
    f = format_formulas(name)
    x, y, rel = rounding_sweep(name)
    normal = (x >= f["normal"]) & (x <= f["max"])
    tiny = x < f["subnormal"] / 2
    big = x > f["max"] * (1 + f["u"])  # beyond rounding back to the largest number
    top = y[big]
    return dict(smallest_positive=float(y[y > 0].min()), max_rel_normal=float(rel[normal].max()),
                below_half_subnormal_zero=bool((y[tiny] == 0).all()),
                above_max=("inf" if bool(torch.isinf(top).all()) else "saturates" if bool((top == f["max"]).all())
                           else "mixed"),
                samples=len(x))


def plot_formats(names=tuple(FORMATS)):
    """Left: each format's range on a log2 axis (subnormals light, normals dark, u written at the right).
    Right: the relative rounding error measured by casting, the worst per quarter binade, against 2^-(m+1)."""
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.6), width_ratios=[1, 1.2])
    for j, name in enumerate(names):
        f, c = format_formulas(name), COLORS.get(name, "k")
        lo, mid, hi = math.log2(f["subnormal"]), math.log2(f["normal"]), math.log2(f["max"])
        ax.barh(j, mid - lo, left=lo, color=c, alpha=0.3, height=0.6)
        ax.barh(j, hi - mid, left=mid, color=c, height=0.6)
        ax.text(hi + 2, j, f"max {f['max']:.4g}\nu = 2^-{f['m'] + 1}", va="center", fontsize=7)
    ax.set_yticks(range(len(names)), names, fontsize=FONT)
    ax.invert_yaxis()
    ax.set_xlim(-160, 200)
    ax.set_xlabel("log2 |x|  (light: subnormals, dark: normal numbers)", fontsize=FONT)
    ax.set_title("the range of each format", fontsize=9)
    for name in names:
        f, c = format_formulas(name), COLORS.get(name, "k")
        x, _, rel = rounding_sweep(name, per_binade=400)
        bins = torch.floor(torch.log2(x) * 4)
        worst = torch.full((int(bins.max() - bins.min()) + 1,), 0.0, dtype=torch.float64)
        worst.scatter_reduce_(0, (bins - bins.min()).long(), rel.clamp(max=1.0), "amax")
        xs = (torch.arange(len(worst)) + bins.min() + 0.5) / 4
        bx.plot(xs, worst.clamp(min=1e-9), "-", color=c, lw=1.2, label=name)
        bx.plot([math.log2(f["normal"]), math.log2(f["max"])], [f["u"]] * 2, ":", color=c, lw=1)
    bx.set_yscale("log")
    bx.set_ylim(1e-8, 2)
    bx.set_xlim(-155, 135)
    bx.set_xlabel("log2 |x|", fontsize=FONT)
    bx.set_ylabel("worst |fl(x) − x| / x  (1: flushed to 0)", fontsize=FONT)
    bx.set_title("relative rounding error, measured by casting (dotted: 2^-(m+1))", fontsize=9)
    bx.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    for a in (ax, bx):
        a.tick_params(labelsize=FONT)
    fig.tight_layout()
    return fig


# ========================================================================= 2. fp16: underflow, loss scaling
def decoder_outputs(model):
    """The modules whose outputs' gradients we watch: every submodule of every decoder layer (norms, attention,
    its projections, the MLP and its projections)."""
    return [(n, m) for n, m in model.named_modules()
            if ".layers." in f".{n}" and not isinstance(m, DecoderLayer) and not n.endswith(".core")]


def activation_grads(dtype="fp32", scale=1.0, v=V, step=1):
    """One micro-batch of MINI at its initialisation through forward and backward with the loss divided by v (the
    gradient as one micro-batch of a v-times larger step sees it), in `dtype` with the loss scale `scale`
    (fp16: S = scale; fp32: none). Returns every decoder submodule's output gradient, flattened, as the backward
    produced it (fp16 values, S times the gradient) in float32."""
    kw = dict(dtype=dtype, loss_scale="none") if dtype == "fp16" else {}
    cfg, mesh = mini_cfg(**kw), Mesh.local()
    run = parallelize(cfg, mesh)
    if scale != 1.0:
        run.scaler.scale, run.scaler.dynamic = float(scale), True  # the identity's backward multiplies by it
    _, loader = load_data(cfg, mesh)
    got = []

    def watch(module, inputs, output):
        if torch.is_tensor(output) and output.requires_grad:
            output.register_hook(lambda g: got.append(g.detach().float().flatten()))
    handles = [m.register_forward_hook(watch) for _, m in decoder_outputs(run.raw)]
    loss_fn = precision.scaled(model_loss, run.scaler)
    run.schedule.run(run.model, loader.micro_batches(step), lambda lg, y: loss_fn(lg, y) / v)
    for h in handles:
        h.remove()
    return torch.cat(got)


def fp16_bands(g):
    """Shares of the nonzero values of g (a gradient in fp32) that fp16 would flush to zero (below half its
    smallest subnormal), keep as subnormals (fewer bits), keep as normal numbers, or overflow."""
    f = format_formulas("fp16")
    a = g.abs().double()
    a = a[a > 0]
    n = len(a)
    return dict(zero=float((a < f["subnormal"] / 2).sum()) / n,
                subnormal=float(((a >= f["subnormal"] / 2) & (a < f["normal"])).sum()) / n,
                normal=float(((a >= f["normal"]) & (a <= f["max"])).sum()) / n,
                overflow=float((a > f["max"]).sum()) / n)


def plot_grad_histogram(g32, scale):
    """log2 |g| of the fp32 activation gradients, as they are and times the loss scale S, over fp16's zones."""
    import matplotlib.pyplot as plt

    f = format_formulas("fp16")
    a = g32.abs().double()
    a = a[a > 0]
    fig, ax = plt.subplots(figsize=(10, 3.2))
    lo, hi = math.log2(f["subnormal"]), math.log2(f["normal"])
    ax.axvspan(-60, lo - 1, color="#c44e52", alpha=0.12, lw=0)
    ax.axvspan(lo - 1, hi, color="#dd8452", alpha=0.15, lw=0)
    ax.axvspan(math.log2(f["max"]), 30, color="#c44e52", alpha=0.12, lw=0)
    bins = torch.arange(-56, 24, 0.5)
    for shift, label, c in ((0, "as computed (S = 1)", "k"), (math.log2(scale), f"times S = 2^{math.log2(scale):.0f}",
                                                                 COLORS["fp16"])):
        h, _ = torch.histogram(torch.log2(a) + shift, bins=bins.double())
        ax.stairs((h / len(a)).numpy(), bins.numpy(), color=c, lw=1.5, label=label)
    top = 1.3 * ax.get_ylim()[1]
    ax.set_ylim(0, top)
    for x, text in ((lo - 13, "rounded to 0\n(< 2^-25)"), (lo + 1, "subnormal:\nfewer bits"),
                    (hi + 3, "normal: 11 bits"), (math.log2(f["max"]) + 0.5, "overflow\n(inf)")):
        ax.text(x, top * 0.95, text, fontsize=7, va="top")
    ax.set_xlim(-56, 22)
    ax.set_xlabel("log2 |activation gradient|  (every decoder submodule's output, one micro-batch, loss / V)",
                  fontsize=FONT)
    ax.set_ylabel("share of the gradient elements", fontsize=FONT)
    ax.set_title("MINI's activation gradients against fp16's range", fontsize=9)
    ax.legend(fontsize=7, loc="upper right", bbox_to_anchor=(1.0, 0.75))
    ax.tick_params(labelsize=FONT)
    fig.tight_layout()
    return fig


def train_curve(steps, v=1.0, start_scale=None, growth_interval=None, watch=None, **kw):
    """`steps` steps of MINI with picotron's step (train.py's, without its logging): the lr schedule,
    schedule.run with loss_fn = run.loss_fn / v (run.loss_fn carries fp16's loss scale), the global gradient
    norm (clip_grad_norm with max_norm 0: measured, not clipped), the loss scale's update, optimizer.step() unless
    the gradients overflowed. kw: Config fields (dtype, loss_scale, ...); start_scale / growth_interval change
    fp16's dynamic scaler; watch(run) installs hooks before the first step.

    Per step: the loss (times v: the loss itself), S before the step, whether any gradient held an inf/NaN (read
    off the tensors), whether the step was skipped, the share of gradient elements exactly zero, and whether the
    weights moved."""
    cfg, mesh = mini_cfg(steps=steps, **kw), Mesh.local()
    torch.manual_seed(0)
    run = parallelize(cfg, mesh)
    if start_scale is not None:
        run.scaler.scale = float(start_scale)
    if growth_interval is not None:
        run.scaler.growth_interval = growth_interval
    if watch is not None:
        watch(run)
    _, loader = load_data(cfg, mesh)
    out = {k: [] for k in ("loss", "scale", "nonfinite", "skipped", "zero_share", "moved", "grad_norm")}
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        for group in run.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = run.schedule.run(run.model, loader.micro_batches(step), lambda lg, y: run.loss_fn(lg, y) / v)
        grads = [p.grad for p in run.grad_params if p.grad is not None]
        out["scale"].append(run.scaler.scale)
        out["nonfinite"].append(any(not bool(torch.isfinite(g).all()) for g in grads))
        out["zero_share"].append(sum(int((g == 0).sum()) for g in grads) / sum(g.numel() for g in grads))
        norm = clip_grad_norm(run.grad_params, 0.0, mesh, grad_scale=run.scaler.scale)
        overflow = not math.isfinite(norm)
        run.scaler.update(run.scaler.dynamic and overflow)
        before = float(sum(p.detach().double().sum() for p in run.grad_params))
        if not overflow:
            run.optimizer.step()
        run.model.zero_grad(set_to_none=True)
        out["moved"].append(float(sum(p.detach().double().sum() for p in run.grad_params)) != before)
        out["skipped"].append(overflow)
        out["grad_norm"].append(norm)
        out["loss"].append(float(loss) * v)
    out["seconds"] = time.perf_counter() - t0
    out["final_scale"] = run.scaler.scale
    return out


def plot_fp16_runs(runs, v):
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.3))
    styles = {"fp32": ("-", 4, 0.3), "fp16, no loss scaling": ("-", 1.5, 1), "fp16, dynamic loss scaling": ("--", 1.5, 1)}
    for (label, r), c in zip(runs.items(), ("k", "#c44e52", "#dd8452")):
        st, lw, alpha = styles[label]
        steps = range(1, len(r["loss"]) + 1)
        ax.plot(steps, r["loss"], st, color=c, lw=lw, alpha=alpha, label=label)
        bx.plot(steps, [100 * z for z in r["zero_share"]], st, color=c, lw=lw, alpha=alpha, label=label)
    ax.set_xlabel("step", fontsize=FONT)
    ax.set_ylabel("training loss", fontsize=FONT)
    ax.set_title(f"MINI, each micro-batch weighted as 1/{v} of a step", fontsize=9)
    bx.set_xlabel("step", fontsize=FONT)
    bx.set_ylabel("% of gradient elements exactly 0", fontsize=FONT)
    bx.set_ylim(0, 100)
    bx.set_title("gradients lost to underflow", fontsize=9)
    for a in (ax, bx):
        a.legend(fontsize=7)
        a.tick_params(labelsize=FONT)
    fig.tight_layout()
    return fig


def plot_scale(run, start, growth):
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.2))
    steps = list(range(1, len(run["scale"]) + 1))
    ax.step(steps, [math.log2(s) for s in run["scale"]], where="mid", color=COLORS["fp16"], label="log2 S at the step")
    skipped = [s for s, k in zip(steps, run["skipped"]) if k]
    ax.plot(skipped, [math.log2(run["scale"][s - 1]) for s in skipped], "x", color="#c44e52", ms=7,
            label="overflow: step skipped, S halved")
    ax.set_xlabel("step", fontsize=FONT)
    ax.set_ylabel("log2 of the loss scale S", fontsize=FONT)
    ax.set_title(f"dynamic loss scaling from S = 2^{math.log2(start):.0f} (doubling after {growth} clean steps)",
                 fontsize=9)
    bx.plot(steps, run["loss"], "o-", ms=2.5, color=COLORS["fp16"])
    bx.plot(skipped, [run["loss"][s - 1] for s in skipped], "x", color="#c44e52", ms=7)
    bx.set_xlabel("step", fontsize=FONT)
    bx.set_ylabel("training loss", fontsize=FONT)
    bx.set_title("the loss meanwhile (x: skipped steps, no update)", fontsize=9)
    ax.legend(fontsize=7)
    for a in (ax, bx):
        a.tick_params(labelsize=FONT)
    fig.tight_layout()
    return fig


# ======================================================================================= 3. recipes' bytes
def recipe_memory(recipes=tuple(precision.RECIPES), seq_len=128, micro_batch_size=8):
    """Per recipe, picotron's tiny preset after one step (forward, backward, optimizer step): the bytes of
    parameters, gradients (run.model.memory()), the optimizer's state split into master copy and moments
    (metrics.optimizer_bytes), the activations saved for backward (metrics.ActivationPeak; `saved_by_dtype`: the
    same bytes by dtype), against
    precision.model_state_bytes."""
    rows = []
    for name in recipes:
        cfg = Config(preset="tiny", dtype=name, seq_len=seq_len, micro_batch_size=micro_batch_size, sample_tokens=0,
                     eval_every=0)
        mesh = Mesh.local()
        run = parallelize(cfg, mesh)
        activations = run.schedule.phases.listen(metrics.ActivationPeak(run.model))  # as the trainer counts them
        _, loader = load_data(cfg, mesh)
        run.schedule.run(run.model, loader.micro_batches(1), run.loss_fn)
        mem = run.model.memory()
        run.optimizer.step()
        masters = metrics.tensor_bytes(getattr(run.optimizer, "masters", ()))
        rows.append(dict(recipe=name, params=mem["params"], grads=mem["grads"], masters=masters,
                         moments=metrics.optimizer_bytes(run.optimizer) - masters,
                         activations=activations.bytes, num_params=run.raw.num_params(),
                         saved_by_dtype={str(k).replace("torch.", ""): v for k, v in activations.by_dtype.items()},
                         tensors=len(list(run.raw.parameters())),
                         formula=precision.model_state_bytes(run.raw.num_params(), name),
                         about=precision.RECIPES[name].about))
    return rows


PARTS = {"params": "#4c72b0", "grads": "#dd8452", "masters": "#8c8c8c", "moments": "#55a868", "activations": "#c9c9f0"}


def plot_recipe_memory(rows, comm):
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.6), width_ratios=[1.2, 1])
    for j, r in enumerate(rows):
        bottom = 0.0
        for part, c in PARTS.items():
            ax.bar(j, r[part] / r["num_params"], bottom=bottom, color=c, width=0.6, label=part if j == 0 else None)
            bottom += r[part] / r["num_params"]
        states = (r["params"] + r["grads"] + r["masters"] + r["moments"]) / r["num_params"]
        ax.text(j, bottom, f"{states:.2f}\n+ {r['activations'] / r['num_params']:.1f}", ha="center", va="bottom",
                fontsize=7)
    ax.axhline(16, color="k", ls=":", lw=1)
    ax.set_xticks(range(len(rows)), [r["recipe"] for r in rows], fontsize=FONT)
    ax.set_ylabel("bytes per parameter", fontsize=FONT)
    ax.set_ylim(0, max(sum(r[p] for p in PARTS) / r["num_params"] for r in rows) * 1.4)
    ax.set_title("measured after one step (label: model states + activations)", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", ncol=5, columnspacing=0.8, handlelength=1.2)
    labels = list(comm)
    for k, (kind, c) in enumerate((("all_reduce", "#8172b2"), ("all_gather", "#4c72b0"),
                                   ("reduce_scatter", "#dd8452"))):
        xs = [j + (k - 1) * 0.27 for j in range(len(labels))]
        bx.bar(xs, [comm[l]["bytes"].get(kind, 0) / comm[l]["num_params"] for l in labels], 0.27, color=c,
               label=kind.replace("_", "-"))
    bx.set_xticks(range(len(labels)), [f"{comm[l]['recipe']}\n{comm[l]['layout'].replace('dp2 ', '')}" for l in labels],
                  fontsize=7)
    bx.set_ylabel("bytes per parameter, one step, rank 0", fontsize=FONT)
    bx.set_title("collectives at dp = 2: bucketed all-reduce, or ZeRO-3 (a Recorder)", fontsize=9)
    bx.legend(fontsize=7)
    for a in (ax, bx):
        a.tick_params(labelsize=FONT)
    fig.tight_layout()
    return fig


COMM_RECIPES = ("fp32", "bf16", "bf16-params")


def exp_comm(mesh, st, out):
    """Rank by rank, for each recipe: dp 2 (bucketed all-reduce) and dp 2 + ZeRO-3, one step's collectives."""
    from picotron.metrics import Recorder

    results = {}
    for layout, extra in (("dp2", dict(dp_impl="bucket")), ("dp2 ZeRO-3", dict(zero=3))):
        for name in COMM_RECIPES:
            cfg = Config(preset="tiny", dtype=name, dp=2, seq_len=64, micro_batch_size=4, sample_tokens=0,
                         eval_every=0, **extra)
            rec = Recorder()
            run = parallelize(cfg, mesh, recorder=rec)
            _, loader = load_data(cfg, mesh)
            rec.reset()
            run.schedule.run(run.model, loader.micro_batches(1), run.loss_fn)
            run.optimizer.step()
            results[f"{name} {layout}"] = dict(bytes=dict(rec.bytes), calls=dict(rec.calls),
                                               num_params=run.raw.num_params(), recipe=name, layout=layout)
    return results


# ==================================================================================================== 4. FP8
def capture(steps=10, layer=1):
    """MINI trained `steps` steps (fp32), then one more micro-batch: the input of layer `layer`'s down_proj (an
    activation: the SwiGLU product), its weight, and the gradient of its output (plain mean loss, no V)."""
    got = {}

    def watch(run):
        lin = run.raw.layers[layer].mlp.down_proj

        def fwd(module, inputs, output):
            got["activation"] = inputs[0].detach().clone()
            output.register_hook(lambda g: got.__setitem__("gradient", g.detach().clone()))
        got["hook"] = lin.register_forward_hook(fwd)
        got["module"] = lin
    train_curve(steps + 1, watch=watch)  # the hook keeps the last step's tensors
    got["hook"].remove()
    got["weight"] = got.pop("module").weight.detach().clone()
    return {k: got[k] for k in ("activation", "weight", "gradient")}


def fp8_stats(t, fmt, scaled=True):
    """Quantize t to `fmt` (picotron.fp8.quantize: current per-tensor scaling, or scale 1) and back: the relative
    error ‖t̂ − t‖ / ‖t‖, the share of nonzero elements flushed to 0, the share saturated at ±fmax, the scale."""
    scale = fp8.current_scale(t, fmt) if scaled else torch.tensor(1.0)
    q, _ = fp8.quantize(t, fmt, scale)
    back = fp8.dequantize(q, scale)
    nz = t != 0
    fmax = torch.finfo(fmt).max
    return dict(rel=float((back - t).norm() / t.norm()), zero=float(((back == 0) & nz).sum() / nz.sum()),
                saturated=float(((t.float() * scale).abs() > fmax * (1 + 1e-6)).sum() / t.numel()), scale=float(scale))


def binades_below_max(t, share=0.01):
    """How many binades the smallest `share` of |t|'s nonzero values lie below its largest: log2(amax / q)."""
    a = t.abs().flatten().float()
    a = a[a > 0]
    return math.log2(float(a.max()) / float(torch.quantile(a[:2**24], share)))


def amax_history(steps):
    """MINI trained in fp32 (plain loss); every step, each decoder linear's input amax and output-gradient amax:
    how far apart the tensors' ranges lie, and how far each one moves during training. Also the loss curve."""
    hist = {"activation": {}, "gradient": {}}

    def watch(run):
        for name, m in run.raw.named_modules():
            if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}":
                def fwd(module, inputs, output, name=name):
                    hist["activation"].setdefault(name, []).append(float(inputs[0].detach().abs().max()))
                    output.register_hook(lambda g: hist["gradient"].setdefault(name, []).append(float(g.abs().max())))
                m.register_forward_hook(fwd)
    run = train_curve(steps, watch=watch)
    return hist, run


def spread_binades(series):
    """log2(max / min) over every tensor's every step: the range one shared (or stale) scale would have to span."""
    values = [x for v in series.values() for x in v if x > 0]
    return math.log2(max(values) / min(values))


def plot_fp8_tensors(tensors, hist):
    """Left: each tensor's |values| (log2) with E4M3's and E5M2's windows once the per-tensor scale maps its amax
    onto the format's max. Right: amax of every decoder linear's input and output gradient over training."""
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.4))
    bins = torch.arange(-40, 4, 0.25).double()
    peak = 0.0
    for (name, t), c in zip(tensors.items(), ("#4c72b0", "#8c8c8c", "#dd8452")):
        a = t.abs().flatten().double()
        a = torch.log2(a[a > 0] / a.max())  # relative to amax: the scaled picture
        h, _ = torch.histogram(a, bins=bins)
        ax.stairs((h / len(a)).numpy(), bins.numpy(), color=c, lw=1.3, label=name)
        peak = max(peak, float(h.max() / len(a)))
    top = 1.45 * peak
    ax.set_ylim(0, top)
    for fmt, y, c in (("E4M3", 0.93, COLORS["E4M3"]), ("E5M2", 0.8, COLORS["E5M2"])):
        f = format_formulas(fmt)
        lo, mid = math.log2(f["subnormal"] / f["max"]), math.log2(f["normal"] / f["max"])
        ax.plot([lo, mid], [y * top] * 2, ":", color=c, lw=2)
        ax.plot([mid, 0], [y * top] * 2, "-", color=c, lw=2)
        ax.text(lo - 0.5, y * top, f"{fmt} (scaled)", color=c, fontsize=7, ha="right", va="center")
    ax.set_xlim(-40, 1)
    ax.set_xlabel("log2(|t| / amax)  (the scale puts amax at the format's max, 0 here)", fontsize=FONT)
    ax.set_ylabel("share of elements", fontsize=FONT)
    ax.set_title("one tensor each (layer 1's down_proj); dotted: subnormals", fontsize=9)
    ax.legend(fontsize=7, loc="center left")
    for kind, c in (("activation", "#4c72b0"), ("gradient", "#dd8452")):
        for j, (name, v) in enumerate(hist[kind].items()):
            bx.plot(range(1, len(v) + 1), [math.log2(x) for x in v], "-", color=c, lw=0.8, alpha=0.7,
                    label=("activations: each linear's input" if kind == "activation" else
                           "gradients: each linear's output gradient") if j == 0 else None)
    bx.set_xlabel("step", fontsize=FONT)
    bx.set_ylabel("log2 amax", fontsize=FONT)
    bx.set_title("amax of the 14 decoder linears over training", fontsize=9)
    bx.set_ylim(top=bx.get_ylim()[1] + 7)
    bx.legend(fontsize=7, loc="upper right", ncol=2)
    for a in (ax, bx):
        a.tick_params(labelsize=FONT)
    fig.tight_layout()
    return fig


def fp8_linear_errors(x, w, g):
    """fp8_linear against fp32 F.linear (forward, grad_x, grad_w: relative errors), the same for bf16 operands, and
    fp8_linear against the explicit dequantize-then-multiply it must equal."""
    def run(fn, dtype=torch.float32):
        xx, ww = (t.detach().to(dtype).clone().requires_grad_() for t in (x, w))
        y = fn(xx, ww)
        y.backward(g.to(dtype))
        return y.detach().float(), xx.grad.float(), ww.grad.float()

    ref = run(F.linear)
    ours = run(fp8.fp8_linear)
    half = run(F.linear, torch.bfloat16)
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    x_q, s_x = fp8.quantize(x, fp8.E4M3)
    w_q, s_w = fp8.quantize(w, fp8.E4M3)
    explicit = fp8.dequantize(x_q, s_x) @ fp8.dequantize(w_q, s_w).t()
    return dict(fp8=[rel(a, b) for a, b in zip(ours, ref)], bf16=[rel(a, b) for a, b in zip(half, ref)],
                explicit=rel(ours[0], explicit))


def plot_fp8_curves(curves):
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.2))
    ref = curves["fp32"]["loss"]
    for name, r in curves.items():
        steps = range(1, len(r["loss"]) + 1)
        ax.plot(steps, r["loss"], "-", lw=1.3 if name != "fp32" else 4, alpha=1 if name != "fp32" else 0.3,
                color=COLORS.get(name) if name != "fp32" else "k", label=name)
        if name != "fp32":
            bx.semilogy(steps, [max(abs(a - b) / b, 1e-7) for a, b in zip(r["loss"], ref)], "-",
                        color=COLORS.get(name), label=name)
    ax.set_xlabel("step", fontsize=FONT)
    ax.set_ylabel("training loss", fontsize=FONT)
    ax.set_title("MINI: --dtype fp8, bf16, fp32", fontsize=9)
    bx.set_xlabel("step", fontsize=FONT)
    bx.set_ylabel("|loss − fp32| / fp32", fontsize=FONT)
    bx.set_title("relative difference to fp32", fontsize=9)
    for a in (ax, bx):
        a.legend(fontsize=7)
        a.tick_params(labelsize=FONT)
    fig.tight_layout()
    return fig


# ======================================================================================= 5. fine-grained FP8
def quant_errors(t, others=None):
    """Relative error ‖t̂ − t‖/‖t‖ of t (2-D: the last axis is the channels) quantized per tensor (E4M3 and E5M2),
    per 1×128 tile and per 128×128 block (E4M3), over the elements `others` (a boolean mask; all by default)."""
    t2 = t.reshape(-1, t.shape[-1]).float()
    m = torch.ones_like(t2, dtype=torch.bool) if others is None else others.reshape(t2.shape)
    err = lambda back: float((back - t2)[m].norm() / t2[m].norm())  # noqa: E731
    tiles = fp8_blockwise.dequantize_tiles(*fp8_blockwise.quantize_tiles(t2))
    return {"tensor E4M3": err(fp8.dequantize(*fp8.quantize(t2, fp8.E4M3))),
            "tensor E5M2": err(fp8.dequantize(*fp8.quantize(t2, fp8.E5M2))), "tiles E4M3": err(tiles),
            "blocks E4M3": err(fp8_blockwise.dequantize_blocks(*fp8_blockwise.quantize_blocks(t2)))}


def gemm_errors(x, w, g, linear):
    """Relative errors of y, grad_x and grad_w of `linear(x, w)` (backward with g) against fp32 F.linear."""
    def run(fn):
        xx, ww = (t.detach().clone().requires_grad_() for t in (x, w))
        y = fn(xx, ww)
        y.backward(g)
        return y.detach(), xx.grad, ww.grad

    return [float((a - b).norm() / b.norm()) for a, b in zip(run(linear), run(F.linear))]


def with_outlier(x, kind, magnitude, index=3):
    """x [b, s, K] with one token (kind "token": a 'massive activation') or one channel ("channel": an outlier
    feature) multiplied by `magnitude`; and the mask of the other elements."""
    x2 = x.reshape(-1, x.shape[-1]).clone()
    others = torch.ones_like(x2, dtype=torch.bool)
    if kind == "token":
        x2[index] *= magnitude
        others[index] = False
    else:
        x2[:, index] *= magnitude
        others[:, index] = False
    return x2, others


def outlier_sweep(x, w, magnitudes=(1, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6)):
    """For each kind of outlier and magnitude: the other elements' quantization error (per tensor, per tile), and
    the relative error of x·Wᵀ on the other tokens' rows, per-tensor fp8_linear against the blockwise one."""
    rows = []
    for kind in ("token", "channel"):
        for mag in magnitudes:
            x2, others = with_outlier(x, kind, mag)
            exact = x2 @ w.t()
            keep = others.all(1) if kind == "token" else torch.ones(len(x2), dtype=torch.bool)  # tokens without it
            out = lambda fn: float((fn(x2, w) - exact)[keep].norm() / exact[keep].norm())  # noqa: E731
            rows.append(dict(kind=kind, magnitude=mag, **quant_errors(x2, others),
                             out_tensor=out(fp8.fp8_linear), out_tiles=out(fp8_blockwise.fp8_linear_blockwise)))
    return rows


def accumulation_sweep(ks=(128, 256, 512, 1024, 2048, 4096), bits=14, m=8, n=8, seed=0):
    """The largest relative error of a·bᵀ (FP8 operands quantized per tile, positive products: the worst case for an
    accumulator that chops) summed in a `bits`-bit accumulator, never promoted and promoted every 128 products,
    against the exact sum (float64); and fp32's own accumulation, for scale."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for k in ks:
        a, b = (torch.rand(r, k, generator=gen) for r in (m, n))
        a = fp8_blockwise.dequantize_tiles(*fp8_blockwise.quantize_tiles(a)).double()
        b = fp8_blockwise.dequantize_tiles(*fp8_blockwise.quantize_tiles(b)).double()
        exact = a @ b.t()
        err = lambda y: float(((y.double() - exact).abs() / exact).max())  # noqa: E731
        rows.append(dict(k=k, never=err(fp8_blockwise.limited_matmul(a, b, bits, None)),
                         promoted=err(fp8_blockwise.limited_matmul(a, b, bits, fp8_blockwise.TILE)),
                         fp32=err(fp8_blockwise.limited_matmul(a, b, 24, None))))
    return rows


def plot_blockwise(sweep, acc, bits=14):
    """Left: the ordinary elements' error against the outlier's magnitude, one scale per tensor or per tile.
    Right: the accumulation error against K, never promoted or promoted every 128 products."""
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.3))
    for kind, ls in (("token", "-"), ("channel", "--")):
        rs = [r for r in sweep if r["kind"] == kind]
        mags = [r["magnitude"] for r in rs]
        ax.loglog(mags, [r["tensor E4M3"] for r in rs], ls, color=COLORS["fp8"], marker="o", ms=3,
                  label=f"one scale per tensor, {kind} outlier")
        ax.loglog(mags, [r["tiles E4M3"] for r in rs], ls, color=COLORS["fp8-blockwise"], marker="s", ms=3,
                  label=f"one scale per 1×128 tile, {kind} outlier")
    ax.set_xlabel("outlier magnitude (× the others)", fontsize=FONT)
    ax.set_ylabel("relative error of the other elements", fontsize=FONT)
    ax.set_title("E4M3 quantization of layer 1's down_proj input, one outlier added", fontsize=9)
    ks = [r["k"] for r in acc]
    for key, label, c in (("never", f"{bits}-bit accumulator, never promoted", COLORS["fp8"]),
                          ("promoted", f"{bits}-bit, promoted to fp32 every 128", COLORS["fp8-blockwise"]),
                          ("fp32", "fp32 accumulator (24 bits)", COLORS["fp32"])):
        bx.loglog(ks, [max(r[key], 1e-9) for r in acc], "-", marker="o", ms=3, color=c, label=label)
    bx.set_xscale("log", base=2)
    bx.set_xlabel("K (products summed)", fontsize=FONT)
    bx.set_ylabel("largest relative error of a·bᵀ", fontsize=FONT)
    bx.set_title("the accumulator (a chopping model, not a measurement of H800)", fontsize=9)
    for a in (ax, bx):
        a.legend(fontsize=6.5)
        a.tick_params(labelsize=FONT)
    fig.tight_layout()
    return fig


# ============================================================================================== 6. attention
def attention_flops(b, a, s, d, impl="naive", block_q=64, block_k=64, causal=True):
    """FLOPs of one attention forward as each implementation computes it: naive forms the whole s×s (2·s²·d for
    q kᵀ and again for P v, per head); tiled computes only the tiles a causal mask does not skip."""
    if impl == "naive":
        return 4 * b * a * s * s * d
    pairs = sum((min(q0 + block_q, s) - q0) * (min(k0 + block_k, s) - k0) for q0 in range(0, s, block_q)
                for k0 in kernels.key_tiles(q0, min(q0 + block_q, s), s, block_k, causal))
    return 4 * b * a * d * pairs


class MainMemoryCounter(TorchDispatchMode):
    """Counts, inside flash_attention's forward, the traffic of a real tiled kernel: bytes of q, k, v tiles loaded
    (the `.to(float32)` copies taken of slices of the input tensors: a tile brought into fast memory) and bytes
    written back (`copy_` into the output tensors: a tile of out, a slice of lse). Everything else (the tile's
    scores, its probabilities, the running max and sum) would live in registers and shared memory."""

    def __init__(self, inputs):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in inputs}
        self.read = self.written = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].untyped_storage().data_ptr() in self.storages:
            self.read += args[0].numel() * args[0].element_size()
        elif func is torch.ops.aten.copy_.default:
            self.written += args[0].numel() * args[0].element_size()
        return out


def counted_flash_bytes(b, a, kv, s, d, dtype=torch.bfloat16, block=64):
    """Run kernels.flash_attention's forward on bf16 inputs under MainMemoryCounter: the bytes a tiled kernel
    moves, counted, to hold against kernels.attention_bytes(impl="tiled")."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, a, s, d, generator=g).to(dtype)
    k = torch.randn(b, kv, s, d, generator=g).to(dtype)
    v = torch.randn(b, kv, s, d, generator=g).to(dtype)
    with torch.no_grad(), MainMemoryCounter([q, k, v]) as c:
        kernels.flash_attention(q, k, v, causal=True, block_q=block, block_k=block)
    return c.read + c.written


class OpBytes(TorchDispatchMode):
    """Every aten op that computes (views and aliases skipped): (name, bytes read, bytes written), as an op-by-op
    execution moves them through main memory."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        if not schema.is_mutable and any(r.alias_info for r in schema.returns):
            return out  # a view: no data moves
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts if torch.is_tensor(t))  # noqa: E731
        self.ops.append((func.__name__, nbytes(tree_flatten((args, kwargs))[0]), nbytes(tree_flatten(out)[0])))
        return out

    @property
    def total(self):
        return sum(r + w for _, r, w in self.ops)


def attention_inputs(b, a, kv, s, d, dtype=torch.float32, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, a, s, d, generator=g, dtype=dtype)
    k = torch.randn(b, kv, s, d, generator=g, dtype=dtype)
    v = torch.randn(b, kv, s, d, generator=g, dtype=dtype)
    cos, sin = rope_cos_sin(torch.arange(s), d, 10000.0)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)] + [cos.to(dtype), sin.to(dtype)]


def flash_against_sdpa(b=2, a=4, kv=2, s=200, d=16, block=64):
    """kernels.flash_attention against F.scaled_dot_product_attention in float64 (causal, GQA, s not a multiple of
    the tile): the largest absolute difference of the output and of dq, dk, dv."""
    q, k, v, _, _ = attention_inputs(b, a, kv, s, d, torch.float64)
    do = torch.randn(b, a, s, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = []
    for fn in (lambda: kernels.flash_attention(q, k, v, causal=True, block_q=block, block_k=block),
               lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)):
        for t in (q, k, v):
            t.grad = None
        y = fn()
        y.backward(do)
        out.append([y.detach()] + [t.grad.clone() for t in (q, k, v)])
    return [float((x - y).abs().max()) for x, y in zip(*out)]


def time_attention(impls, seqs, b=1, a=8, kv=4, d=64, repeats=3):
    """Forward + backward of AttentionCore(impl) (RoPE + causal attention, as in the model) in fp32: the best of
    `repeats` runs per impl and s, the impls alternating so a busy machine slows them alike; and the bytes autograd
    saved for backward (metrics.ActivationCounter)."""
    times = {i: {} for i in impls}
    saved = {i: {} for i in impls}
    for s in seqs:
        args = attention_inputs(b, a, kv, s, d)
        for impl in impls:
            core = AttentionCore(impl)
            with metrics.ActivationCounter() as c:
                core(*args).sum().backward()
            saved[impl][s] = c.bytes
        for _ in range(repeats):
            for impl in impls:
                core = AttentionCore(impl)
                t0 = time.perf_counter()
                core(*args).sum().backward()
                dt = time.perf_counter() - t0
                times[impl][s] = min(times[impl].get(s, float("inf")), dt)
    return times, saved


def memory_bandwidth(mib=256, repeats=5):
    """Bytes per second of a large copy (read + write), the best of a few: this machine's main-memory bandwidth."""
    src = torch.ones(mib * MiB // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best


def plot_attention(rows, times, saved, balance, cfg):
    """(a) bytes per forward against s, naive and tiled; (b) arithmetic intensity against the balance points
    (tiled twice: K/V tiles loaded once per KV head, as flash_attention does, or once per query head, as the
    Triton kernel and FlashAttention-2 do);
    (c) measured time; (d) bytes saved for backward."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 6.4))
    (ax, bx), (cx, dx) = axes
    s = [r["s"] for r in rows]
    ax.loglog(s, [r["naive"] for r in rows], "o-", color="#c44e52", label="naive: 3 kernels, s² written and read")
    ax.loglog(s, [r["tiled"] for r in rows], "o-", color="#55a868", label=f"tiled, B_q = {cfg['block']}, K/V per KV head")
    ax.loglog(s, [r["io"] for r in rows], "k:", label="q, k, v read + out written once")
    ax.set_xlabel("sequence length s", fontsize=FONT)
    ax.set_ylabel("bytes per forward (bf16)", fontsize=FONT)
    ax.set_title(f"attention's memory traffic, {cfg['label']}", fontsize=9)
    ax.legend(fontsize=7)
    bx.semilogx(s, [r["naive_intensity"] for r in rows], "o-", color="#c44e52", label="naive")
    bx.semilogx(s, [r["tiled_intensity"] for r in rows], "o-", color="#55a868", label="tiled, K/V per KV head")
    bx.semilogx(s, [r["per_q_head_intensity"] for r in rows], "s--", color="#8172b2",
                label="tiled, K/V per query head (Triton, FA-2)")
    for (label, value), c in zip(balance.items(), ("#4c72b0", "k")):
        bx.axhline(value, color=c, ls="--", lw=1)
        bx.text(s[0], value * 1.08, label, fontsize=7, color=c)
    bx.set_yscale("log")
    bx.set_xlabel("sequence length s", fontsize=FONT)
    bx.set_ylabel("FLOPs per byte moved", fontsize=FONT)
    bx.set_title("arithmetic intensity against machine balance (peak / bandwidth)", fontsize=9)
    bx.legend(fontsize=7, loc="lower right")
    colors = {"sdpa": "#4c72b0", "eager": "#c44e52", "flash": "#55a868"}
    for impl, t in times.items():
        cx.loglog(list(t), [1e3 * x for x in t.values()], "o-", color=colors[impl], label=impl)
        dx.loglog(list(saved[impl]), [x / MiB for x in saved[impl].values()], "o-", color=colors[impl], label=impl)
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    for a in (cx, dx):
        a.set_xticks(list(next(iter(times.values()))), [str(x) for x in next(iter(times.values()))])
        a.xaxis.set_minor_formatter(NullFormatter())
        a.yaxis.set_major_formatter(ScalarFormatter())
        a.yaxis.set_minor_formatter(NullFormatter())
    cx.set_xlabel("sequence length s", fontsize=FONT)
    cx.set_ylabel("ms, forward + backward (best of runs)", fontsize=FONT)
    cx.set_title("measured on this CPU, fp32 (flash: plain-PyTorch loops)", fontsize=9)
    dx.set_xlabel("sequence length s", fontsize=FONT)
    dx.set_ylabel("MiB saved for backward", fontsize=FONT)
    dx.set_title("activations saved (metrics.ActivationCounter)", fontsize=9)
    for a in (ax, bx, cx, dx):
        a.tick_params(labelsize=FONT)
    cx.legend(fontsize=7)
    dx.legend(fontsize=7)
    fig.tight_layout()
    return fig


# ========================================================================================= 7. fused kernels
def rms_norm_plain_bytes(rows, h, elem=4):
    """Bytes the op-by-op RMSNorm forward (kernels.rms_norm_plain, fp32) moves, N = rows·h: x² (read N, write N),
    its mean (read N, write rows), + eps (rows, rows), rsqrt (rows, rows), x·rstd (read N + rows, write N),
    weight·(...) (read h + N, write N): 7N + 6·rows + h elements."""
    n = rows * h
    return elem * (7 * n + 6 * rows + h)


def fused_bytes(kind, rows, h, elem=4, backward=False, programs=256):
    """What the fused kernels of picotron/kernels.py (the Triton ones) read and write, N = rows·h.
    rms_norm forward: x, w in; y and one fp32 rstd per row out. Backward: dy, x, w, rstd in; dx and each
    program's fp32 partial dw row out, then the partial rows summed (read P·h, write h).
    swiglu forward: gate, up in; y out. Backward: dy, gate, up in; dgate, dup out."""
    n = rows * h
    if kind == "rms_norm":
        if not backward:
            return elem * (2 * n + h) + 4 * rows
        p = min(rows, programs)
        return elem * (3 * n + h) + 4 * rows + 4 * p * h * 2 + elem * h
    if not backward:
        return elem * 3 * n
    return elem * 5 * n


def count_plain(kind, rows, h):
    """Bytes the plain (op-by-op) kernel moves, counted op by op (OpBytes): forward, then backward."""
    g = torch.Generator().manual_seed(0)
    if kind == "rms_norm":
        args = [torch.randn(rows, h, generator=g).requires_grad_(), torch.randn(h, generator=g).requires_grad_()]
        fn = lambda x, w: kernels.rms_norm_plain(x, w, 1e-5)  # noqa: E731
    else:
        args = [torch.randn(rows, h, generator=g).requires_grad_() for _ in range(2)]
        fn = kernels.swiglu_plain
    dy = torch.randn(rows, h, generator=g)
    with OpBytes() as fwd:
        y = fn(*args)
    with OpBytes() as bwd:
        y.backward(dy)
    return fwd, bwd


def compare_impls(kind, rows, h, impls=("plain", "compile"), repeats=3):
    """Forward + backward of kernels.rms_norm / swiglu per impl: the results against plain's (largest relative
    difference of y and of every input gradient) and the best time of `repeats` runs (impls alternating)."""
    g = torch.Generator().manual_seed(0)
    if kind == "rms_norm":
        base = [torch.randn(rows, h, generator=g), torch.rand(h, generator=g) + 0.5]
        fn = lambda impl, x, w: kernels.rms_norm(x, w, 1e-5, impl=impl)  # noqa: E731
    else:
        base = [torch.randn(rows, h, generator=g) for _ in range(2)]
        fn = lambda impl, a, b: kernels.swiglu(a, b, impl=impl)  # noqa: E731
    dy = torch.randn(rows, h, generator=g)

    def once(impl):
        args = [t.clone().requires_grad_() for t in base]
        t0 = time.perf_counter()
        y = fn(impl, *args)
        y.backward(dy)
        return time.perf_counter() - t0, [y.detach()] + [a.grad for a in args]

    results = {impl: once(impl)[1] for impl in impls}  # the first call of "compile" compiles
    ref = results["plain"]
    diff = {impl: max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(r, ref))
            for impl, r in results.items()}
    best = {impl: float("inf") for impl in impls}
    for _ in range(repeats):
        for impl in impls:
            best[impl] = min(best[impl], once(impl)[0])
    return diff, best


def compile_run(compile, steps):
    """picotron.train on MINI with --compile on or off: the per-step losses and step times (metrics.jsonl)."""
    from picotron.metrics import read_metrics
    from picotron.train import train

    out = _common.run_dir("11_precision_and_kernels") / f"compile_{int(compile)}"
    cfg = mini_cfg(steps=steps, compile=compile, out=str(out))
    t0 = time.perf_counter()
    with quiet():
        train(cfg, Mesh.local())
    rows = read_metrics(out)[0]
    return dict(loss=[r["loss"] for r in rows], step_time=[r["step_time"] for r in rows],
                seconds=time.perf_counter() - t0)


def plot_fused(rows, times):
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.2))
    labels = list(rows)
    for k, (what, c) in enumerate((("plain", "#c44e52"), ("fused", "#55a868"))):
        ax.bar([j + (k - 0.5) * 0.38 for j in range(len(labels))], [rows[l][what] / MiB for l in labels], 0.38,
               color=c, label=f"{what} ({'counted op by op' if what == 'plain' else 'what the fused kernel moves'})")
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("MiB read + written", fontsize=FONT)
    ax.set_title("memory traffic, fp32", fontsize=9)
    ax.set_ylim(0, 1.3 * max(max(r["plain"], r["fused"]) for r in rows.values()) / MiB)
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    impls = list(next(iter(times.values())))
    for k, impl in enumerate(impls):
        bx.bar([j + (k - (len(impls) - 1) / 2) * 0.38 for j in range(len(times))],
               [1e3 * times[l][impl] for l in times], 0.38, label=impl, color=("#c44e52", "#55a868", "#4c72b0")[k])
    bx.set_xticks(range(len(times)), list(times), fontsize=7)
    bx.set_ylabel("ms, forward + backward (best of runs)", fontsize=FONT)
    bx.set_title("measured on this CPU", fontsize=9)
    bx.legend(fontsize=7)
    for a in (ax, bx):
        a.tick_params(labelsize=FONT)
    fig.tight_layout()
    return fig


# ================================================================================================ 8. profile
GROUPS = (("loss", ("logsoftmax", "nllloss", "crossentropy")),
          ("matmul", ("mm", "addmm", "bmm", "matmul", "linear")),
          ("attention", ("scaleddotproduct", "flashattention", "softmax")),
          ("optimizer", ("optimizer", "adam", "foreach", "lerp", "addcmul", "addcdiv")),
          ("copies and casts", ("copy", "tocopy", "to", "cat", "clone", "contiguous", "fill", "zero", "empty",
                                "repeatinterleave", "stack")),
          ("elementwise and norms", ("mul", "add", "div", "silu", "sigmoid", "pow", "rsqrt", "mean", "sum", "neg",
                                     "sqrt", "exp", "sub", "rsub", "embedding", "where", "maskedfill", "cos", "sin",
                                     "norm", "clamp")))


def group_of(op):
    """The group of a profiler row: aten::mm, MmBackward0 (autograd's node) and their kin by name; what is left
    (data sampling, bookkeeping) is "other"."""
    name = op.split("::")[-1].lower().replace("_", "")
    for suffix in ("backward0", "backward"):
        if name.endswith(suffix) and len(name) > len(suffix):
            name = name[:-len(suffix)]
    for group, keys in GROUPS:
        if any(name == k or (len(k) >= 5 and k in name) for k in keys):
            return group
    return "other"


def profile_step(seq_len=128, micro_batch_size=8):
    """One training step of picotron's tiny preset (after one step of warm-up) under torch.profiler, with FLOP
    counting: per operator its self CPU time, calls and counted FLOPs; the step's wall time inside the profiler
    and outside it (the next step), and the decoder's and head's linear parameters (for 6·P·tokens)."""
    from torch.profiler import ProfilerActivity, profile

    cfg = Config(preset="tiny", seq_len=seq_len, micro_batch_size=micro_batch_size, sample_tokens=0, eval_every=0)
    mesh = Mesh.local()
    run = parallelize(cfg, mesh)
    _, loader = load_data(cfg, mesh)

    def step(s):
        run.schedule.run(run.model, loader.micro_batches(s), run.loss_fn)
        clip_grad_norm(run.grad_params, cfg.grad_clip, mesh)
        run.optimizer.step()
        run.model.zero_grad(set_to_none=True)
    step(1)
    t0 = time.perf_counter()
    with silent_stderr(), profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        step(2)
    wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    step(3)
    plain = time.perf_counter() - t0
    ops = [dict(op=e.key, self_s=e.self_cpu_time_total / 1e6, calls=e.count, flops=e.flops)
           for e in prof.key_averages()]
    linear = sum(m.weight.numel() for m in run.raw.modules() if isinstance(m, torch.nn.Linear))
    return dict(ops=sorted(ops, key=lambda r: -r["self_s"]), wall=wall, plain=plain, linear_params=linear,
                tokens=seq_len * micro_batch_size, flops_per_token=run.raw.config.flops_per_token(seq_len))


def short_op(op):
    """A profiler row's name, short enough for a label: no aten:: prefix, SDPA's CPU kernel abbreviated."""
    return op.replace("aten::", "").replace("_scaled_dot_product_flash_attention_for_cpu", "sdpa_flash_cpu")[:40]


def plot_profile(prof, top=14):
    import matplotlib.pyplot as plt

    colors = {"matmul": "#4c72b0", "attention": "#55a868", "optimizer": "#8172b2", "loss": "#937860",
              "copies and casts": "#8c8c8c", "elementwise and norms": "#dd8452", "other": "#cccccc"}
    ops = [r for r in prof["ops"] if r["self_s"] > 0]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8), width_ratios=[1.5, 1])
    shown = ops[:top][::-1]
    ax.barh(range(len(shown)), [1e3 * r["self_s"] for r in shown], color=[colors[group_of(r["op"])] for r in shown])
    ax.set_yticks(range(len(shown)), [f"{short_op(r['op'])} ×{r['calls']}" for r in shown], fontsize=7)
    ax.set_xlabel("self CPU time, ms", fontsize=FONT)
    ax.set_title(f"top {top} operators of one step (tiny, {prof['tokens']} tokens)", fontsize=9)
    totals = {}
    for r in ops:
        totals[group_of(r["op"])] = totals.get(group_of(r["op"]), 0.0) + r["self_s"]
    names = sorted(totals, key=totals.get)
    bx.barh(range(len(names)), [1e3 * totals[n] for n in names], color=[colors[n] for n in names])
    bx.set_yticks(range(len(names)), names, fontsize=7)
    bx.set_xlabel("self CPU time, ms", fontsize=FONT)
    bx.set_title("grouped", fontsize=9)
    for a in (ax, bx):
        a.tick_params(labelsize=FONT)
    fig.tight_layout()
    return fig, totals


# ================================================================================================= 9. widget
def view_stats(t, name, log2_scale):
    """t times 2^log2_scale stored in format `name`, then divided back: the relative error ‖t̂ − t‖/‖t‖ and the
    shares of t's nonzero elements flushed to zero, kept as subnormals, and beyond the largest number."""
    f = format_formulas(name)
    scale = 2.0 ** log2_scale
    x = t.double().flatten() * scale
    y = cast(x, name)
    nz = x != 0
    a = x.abs()
    n = int(nz.sum())
    finite = torch.isfinite(y)
    err = torch.where(finite, y - x, torch.zeros_like(x))
    return dict(rel=float(err.norm() / x.norm()) if bool(finite.all()) else float("inf"),
                zero=int(((y == 0) & nz).sum()) / n,
                subnormal=int(((a < f["normal"]) & (y != 0)).sum()) / n,
                overflow=int((a > f["max"]).sum()) / n, n=n)


def draw_view(t, label, name, log2_scale):
    import matplotlib.pyplot as plt

    f = format_formulas(name)
    a = t.abs().double().flatten()
    a = torch.log2(a[a > 0]) + log2_scale
    lo, mid, hi = math.log2(f["subnormal"]), math.log2(f["normal"]), math.log2(f["max"])
    left, right = min(float(a.min()), lo) - 2, max(float(a.max()), hi) + 2
    fig, ax = plt.subplots(figsize=(10, 2.8))
    ax.axvspan(left, lo - 1, color="#c44e52", alpha=0.12, lw=0)
    ax.axvspan(lo - 1, mid, color="#dd8452", alpha=0.15, lw=0)
    ax.axvspan(mid, hi, color="#55a868", alpha=0.12, lw=0)
    ax.axvspan(hi, right, color="#c44e52", alpha=0.12, lw=0)
    bins = torch.linspace(left, right, 160).double()
    h, _ = torch.histogram(a, bins=bins)
    ax.stairs((h / len(a)).numpy(), bins.numpy(), color="k", lw=1.2)
    ax.set_xlim(left, right)
    st = view_stats(t, name, log2_scale)
    ax.set_xlabel(f"log2 |{label} × 2^{log2_scale:g}|   (red: flushed to 0 / overflow, orange: subnormal, green: "
                  f"normal)", fontsize=FONT)
    ax.set_ylabel("share of elements", fontsize=FONT)
    ax.set_title(f"{label} in {name}: relative error {st['rel']:.2e}, flushed to 0 {100 * st['zero']:.2f}%, "
                 f"subnormal {100 * st['subnormal']:.2f}%, overflow {100 * st['overflow']:.2f}%", fontsize=9)
    ax.tick_params(labelsize=FONT)
    fig.tight_layout()
    return fig, st


# ------------------------------------------------------------------------------------------------ main
def main(argv=None):
    args, names, out = _common.cli("11_precision_and_kernels", EXPERIMENTS, __doc__, argv=argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 2:
        sys.exit("run on 2 processes: torchrun --nproc_per_node 2 lessons/11_precision_and_kernels/experiment.py")
    st = _common.sized("11_precision_and_kernels", settings(args.fast), args.fast)
    with Mesh.init(dp=world, device=_common.experiment_device("11_precision_and_kernels")) as mesh:
        _common.run_experiments(names, lambda name: globals()[f"exp_{name}"](mesh, st, out),
                                lambda name: out / f"{name}.json", _common.environment(mesh, settings=st), mesh.rank)


if __name__ == "__main__":
    main()
