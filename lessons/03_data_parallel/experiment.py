"""Lesson 03, the experiment: data parallelism, measured. How much of the gradient all-reduce hides behind the
backward pass (naive -> overlapped -> bucketed), throughput against bucket size and against torch's
DistributedDataParallel, gradient accumulation with no_sync, scaling from 1 to 4 ranks, memory per rank, and
the loss of dp ranks against one process.

    torchrun --nproc_per_node 2 lessons/03_data_parallel/experiment.py --out runs/lessons/03_data_parallel --only timeline
    PICOTRON_FAST=1 torchrun ...        # short settings (CI, the notebook's FAST mode)

Each experiment writes OUT/<name>.json (rank 0), the scaling one OUT/scaling_dp<N>.json:
    allreduce   all-reduce time against message size on this machine, fitted to T = a + b·bytes
    timeline    a few steps of: compute only (no communication at all), naive, and the bucketed DataParallel
                with buckets of 0 (one per tensor: "overlap"), 0.25, 1, 4 and 25 MiB, steps interleaved; every
                rank's events (forward, backward, each all-reduce from launch to completion, the final wait,
                optimizer) and tokens/s: the timelines, and the throughput against bucket size
    ddp         our bucketed DataParallel against torch's DDP: same model, bucket size, batches; steps alternate
    accumulate  4 micro-batches per step: no_sync on the first three vs an all-reduce after every micro-batch
    scaling     picotron.train with dp = world size (launch it with 1, 2 and 4 processes): tokens/s, memory per
                rank, loss per step; with 1 process also the single-process references for the parity check
                (grad_acc = 2 and 4: the same global batch as dp = 2 and 4)

Every timed comparison runs its variants in ONE process group, each on its own copy of the model (identical
weights), one step of each in turn (the order rotating), with a barrier before every step: slow drift of the
machine (another job, thermal) hits all variants alike. A step's time is the slowest rank's.
`model_timeline` (the widget's model) and the plot_* functions are imported by the notebook.
"""
import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/
import _common  # noqa: E402  (puts the repository root on sys.path)
from _common import gather, run_interleaved, union_length  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from picotron import data, data_parallel, metrics, parallelize, schedule  # noqa: E402
from picotron import train as trainer  # noqa: E402
from picotron.config import Config  # noqa: E402
from picotron.mesh import Mesh  # noqa: E402
from picotron.model import loss_fn  # noqa: E402

# "small": the tiny preset widened (3.3 M parameters, 12.5 MiB of fp32 gradients in 39 tensors): small enough
# for a 2-core CPU, big enough that the all-reduce is a visible part of a step.
SIZES = {"small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4),
         "medium": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6)}
MiB = 2**20
STEPS = None  # --steps: timed steps per variant of the timed experiments (default: settings())


def settings(fast, mesh):
    """Model and per-rank batch of the timed experiments, and the number of timed steps per variant."""
    on_gpu = mesh.device.type == "cuda"
    if on_gpu:
        return dict(size="medium", seq_len=512, micro_batch_size=8, steps=20 if fast else 50, warmup=3)
    return dict(size="small", seq_len=64, micro_batch_size=2, steps=10 if fast else 40, warmup=2)


def make_cfg(size="small", **kw):
    return Config(**{"preset": "tiny", "sample_tokens": 0, "eval_every": 0, **SIZES[size], **kw})


@functools.lru_cache(maxsize=1)
def tokens():
    """The embedded Shakespeare as byte tokens (what picotron.train reads), loaded once per process."""
    tok = data.get_tokenizer("byte")
    return data.TokenData(tok.encode_tensor(data.load_text("shakespeare")), tok.vocab_size)


# ------------------------------------------------------------------------------------------ one variant
class Variant:
    """One way of training (impl, bucket size) on its own copy of the model, with its own timeline.

    Built from picotron's pieces as `parallelize` builds them: the model, a gradient-sync wrapper over the dp x cp
    axis (recorded: a metrics.Recorder counts the bytes of every all-reduce and puts each on the timeline, from
    launch to completion), AdamW, and the step engine (schedule.OneStage), whose timeline gets each micro-batch's
    forward and backward and the final wait. impl "none" (compute only): every rank trains alone, as a one-process
    mesh would (`Local`, no replicas to average over): nothing is exchanged, not even the loss. `make_wrapper`
    (raw, axis) -> GradSync replaces `data_parallel.wrap` (benchmarks/dp_vs_ddp.py's candidate variants)."""

    def __init__(self, name, cfg, mesh, impl, bucket_mb=25.0, grad_acc=1, sync_every=False, record_comm=True,
                 make_wrapper=None):
        self.name, self.impl, self.bucket_mb, self.sync_every = name, impl, bucket_mb, sync_every
        self.device = mesh.device
        self.timeline = metrics.Timeline(mesh.device, mesh.rank, enabled=False)  # on for the timed steps only
        self.recorder = metrics.Recorder(self.timeline if record_comm else None)
        self.raw = parallelize.build_model(cfg, mesh)
        replicas = mesh.dp_cp
        if make_wrapper is not None:
            self.model = make_wrapper(self.raw, mesh.dp_cp.recorded(self.recorder))
        elif impl == "none":
            self.model, replicas = data_parallel.Local(self.raw), Mesh.local(mesh.device).dp_cp
        else:
            self.model = data_parallel.wrap(self.raw, mesh.dp_cp.recorded(self.recorder), impl, bucket_mb)
        self.optimizer = parallelize.build_optimizer(self.model.optimizer_groups(), cfg, mesh.device)
        self.schedule = schedule.OneStage(replicas, mesh.device, timeline=self.timeline)
        self.loader = data.DataLoader(tokens(), seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size,
                                      grad_acc=grad_acc, dp_size=mesh.dp.size, dp_rank=mesh.dp.rank, seed=cfg.seed)
        self.times, self.step_starts, self.sent = [], [], []
        self.n_buckets = len(self.model.buckets) if isinstance(self.model, data_parallel.DataParallel) else None

    def forward_backward(self, batches):
        """Forward and backward over the micro-batches and the wait for the gradient sync: one call of the step
        engine (no_sync on all but the last micro-batch); with sync_every, one call per micro-batch, each loss
        divided by k, so the gradients are synchronised after every micro-batch and add up to the same sum."""
        if not self.sync_every:
            return self.schedule.run(self.model, batches, loss_fn)
        k = len(batches)
        return sum(self.schedule.run(self.model, [b], lambda logits, y: loss_fn(logits, y) / k) for b in batches)

    def step(self, step, record=True):
        """One optimizer step; with record, its time, its events and the bytes its all-reduces covered."""
        batches = self.loader.micro_batches(step)
        self.timeline.enabled = record  # warm-up steps leave no events
        self.recorder.reset()
        t0 = time.perf_counter()
        if record:
            self.step_starts.append(self.timeline.now())
        self.forward_backward(batches)
        with self.timeline.record("optimizer"):
            self.optimizer.step()
            self.model.zero_grad(set_to_none=True)
        metrics.sync(self.device)
        if record:
            self.times.append(time.perf_counter() - t0)
            self.sent.append(self.recorder.bytes.get("all_reduce", 0))


def summarise(variants, mesh, tokens_per_step):
    """Per variant: each step's time (the slowest rank's), median, quartiles, tokens/s, every rank's events and
    the bytes its all-reduces covered in each step (the recorder's count)."""
    rows = []
    for v in variants:
        per_rank = gather(dict(times=v.times, events=v.timeline.events, starts=v.step_starts, sent=v.sent), mesh)
        times = [max(r["times"][i] for r in per_rank) for i in range(len(v.times))]
        q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        rows.append(dict(name=v.name, impl=v.impl, bucket_mb=v.bucket_mb, n_buckets=v.n_buckets,
                         step_times=times, median=statistics.median(times), q1=q[0], q3=q[2],
                         tokens_per_s=tokens_per_step / statistics.median(times),
                         events=[r["events"] for r in per_rank], step_starts=[r["starts"] for r in per_rank],
                         sent=[r["sent"] for r in per_rank]))
    return rows


def phases(row, rank=None):
    """Median per step of: forward, backward, wait (end of backward -> all-reduces done), optimizer, the total
    time the all-reduces were running (union of their intervals), how many there were and the MiB they covered
    (the recorder's count), for one rank or the max over ranks."""
    out = []
    for r, events in enumerate(row["events"]):
        if rank is not None and r != rank:
            continue
        starts = row["step_starts"][r] + [float("inf")]
        per_step = []
        for i in range(len(starts) - 1):
            ev = [e for e in events if starts[i] <= e["start"] < starts[i + 1]]
            d = {name: sum(e["end"] - e["start"] for e in ev if e["name"] == name)
                 for name in ("forward", "backward", "wait", "optimizer")}
            comm = [e for e in ev if e.get("kind") == "comm"]  # the recorder's events: every all-reduce
            d["comm"] = union_length([(e["start"], e["end"]) for e in comm])
            d["n_allreduce"] = len(comm)
            d["mib_sent"] = row["sent"][r][i] / MiB
            per_step.append(d)
        out.append({k: statistics.median(d[k] for d in per_step) for k in per_step[0]})
    return out[0] if rank is not None else {k: max(o[k] for o in out) for k in out[0]}


def grad_tensor_bytes(mc):
    """fp32 bytes of each gradient tensor, in the order backward produces them (the reverse of the forward)."""
    from picotron.model import Llama

    with torch.device("meta"):
        return [4 * p.numel() for p in reversed(list(Llama(mc).parameters()))]


def env_info(mesh, fast, st):
    cfg = make_cfg(st["size"])
    mc = cfg.model_config()
    return dict(device=str(mesh.device), backend=mesh.backend, world_size=mesh.world_size, torch=torch.__version__,
                threads=torch.get_num_threads(), cores=os.cpu_count(), fast=fast, size=st["size"],
                model=SIZES[st["size"]], num_params=mc.num_params(), grad_bytes=4 * mc.num_params(),
                grad_tensor_bytes=grad_tensor_bytes(mc),
                seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"], steps=st["steps"],
                warmup=st["warmup"], flops_per_token=mc.flops_per_token(st["seq_len"]))


# --------------------------------------------------------------------------------------------- experiments
def exp_allreduce(mesh, fast, out):
    """Median time of one all-reduce per message size; T = a + b·bytes fitted by least squares."""
    sizes = [2**k for k in range(10, 25, 2 if fast else 1)]  # 1 KiB .. 16 MiB
    reps = 5 if fast else 20
    rows = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, device=mesh.device)
        dist.all_reduce(x, group=mesh.dp_cp.group)  # warm up this size
        times = []
        for _ in range(reps):
            dist.barrier(mesh.dp_cp.group)
            metrics.sync(mesh.device)
            t0 = time.perf_counter()
            dist.all_reduce(x, group=mesh.dp_cp.group)
            metrics.sync(mesh.device)
            times.append(time.perf_counter() - t0)
        t = max(gather(statistics.median(times), mesh))
        rows.append(dict(bytes=nbytes, time=t, algbw=nbytes / t,
                         busbw=nbytes / t * 2 * (mesh.world_size - 1) / mesh.world_size))
        if mesh.rank == 0:
            print(f"all-reduce {nbytes / 1024:>8.0f} KiB: {1e3 * t:8.3f} ms | bus bandwidth "
                  f"{rows[-1]['busbw'] / 1e9:6.2f} GB/s", flush=True)
    a, b = fit_line([r["bytes"] for r in rows], [r["time"] for r in rows])
    n = mesh.world_size
    if mesh.rank == 0:
        print(f"fit: T = {1e6 * a:.0f} µs + bytes / ({2 * (n - 1) / n / b / 1e9:.2f} GB/s · n/(2(n-1)))", flush=True)
    return dict(rows=rows, latency_s=a, s_per_byte=b, busbw=2 * (n - 1) / n / b)


def fit_line(xs, ys):
    """Least squares y = a + b·x, weighting each point by 1/y (relative errors: small messages count too)."""
    w = [1 / y**2 for y in ys]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx, sxy = sum(wi * x * x for wi, x in zip(w, xs)), sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    b = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    return (sy - b * sx) / sw, b


def timed(mesh, fast, specs, st=None, grad_acc=1, record_comm=True):
    """Build the variants (name, impl, bucket_mb, sync_every), run them interleaved, summarise."""
    st = st or dict(settings(fast, mesh), **({"steps": STEPS} if STEPS else {}))
    cfg = make_cfg(st["size"], seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"], dp=mesh.dp.size)
    variants = [Variant(name, cfg, mesh, impl, bucket_mb, grad_acc=grad_acc, sync_every=sync_every,
                        record_comm=record_comm) for name, impl, bucket_mb, sync_every in specs]
    dist.barrier()
    for v in variants:  # one common origin for every timeline, right after a barrier: ranks are comparable
        v.timeline.t0 = time.perf_counter()
    run_interleaved(variants, st["steps"], st["warmup"], mesh.dp_cp.group)
    tokens_per_step = mesh.dp.size * grad_acc * st["micro_batch_size"] * st["seq_len"]
    rows = summarise(variants, mesh, tokens_per_step)
    for row in rows:
        row["phases"] = phases(row)
        row["phases_by_rank"] = [phases(row, r) for r in range(mesh.world_size)]
    return rows, st


def report(rows, base=None):
    if dist.get_rank() != 0:
        return
    for r in rows:
        p = r["phases"]
        extra = f" | step − compute-only {1e3 * (r['median'] - base):+7.1f} ms" if base is not None else ""
        print(f"{r['name']:<16} step {1e3 * r['median']:7.1f} ms [{1e3 * r['q1']:.1f}, {1e3 * r['q3']:.1f}] | "
              f"{r['tokens_per_s']:>8,.0f} tok/s | backward {1e3 * p['backward']:6.1f} ms | wait after backward "
              f"{1e3 * p['wait']:6.1f} ms | all-reduces {p['n_allreduce']:.0f} running {1e3 * p['comm']:6.1f} ms"
              + extra, flush=True)


BUCKET_SIZES = (0, 0.25, 1, 4, 25)  # MiB; 0 = one bucket per parameter tensor ("overlap")


def exp_timeline(mesh, fast, out):
    """compute only, naive, and the bucketed DataParallel at every size of BUCKET_SIZES, interleaved."""
    specs = [("compute only", "none", 0, False), ("naive", "naive", 0, False)] + [
        ("overlap" if mb == 0 else f"bucket {mb:g} MiB", "overlap" if mb == 0 else "bucket", mb, False)
        for mb in BUCKET_SIZES]
    rows, st = timed(mesh, fast, specs)
    report(rows, rows[0]["median"])
    return dict(settings=st, rows=rows)


def exp_ddp(mesh, fast, out):
    """Ours vs DDP at two bucket sizes; steps alternate. The paired ratio of each round is kept (its spread
    says how much to trust the median)."""
    st = settings(fast, mesh)
    st["steps"] = STEPS or (st["steps"] if fast else 100)
    sizes = [1, 25]
    specs = [s for mb in sizes for s in ((f"ours {mb} MiB", "bucket", mb, False), (f"ddp {mb} MiB", "ddp", mb, False))]
    rows, st = timed(mesh, fast, specs, st, record_comm=False)  # DDP records no timeline: neither do we here
    by = {r["name"]: r for r in rows}
    ratios = {}
    for mb in sizes:
        ours, ddp = by[f"ours {mb} MiB"]["step_times"], by[f"ddp {mb} MiB"]["step_times"]
        paired = [d / o for o, d in zip(ours, ddp)]  # throughput ratio ours/DDP = DDP time / our time
        q = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
        ratios[mb] = dict(median=statistics.median(paired), q1=q[0], q3=q[2], n=len(paired),
                          of_medians=statistics.median(ddp) / statistics.median(ours))
        if mesh.rank == 0:
            print(f"bucket {mb:>3} MiB: ours {1e3 * statistics.median(ours):7.2f} ms/step, DDP "
                  f"{1e3 * statistics.median(ddp):7.2f} ms/step -> ours/DDP throughput {ratios[mb]['median']:.3f} "
                  f"(paired, {len(paired)} rounds, IQR {q[0]:.3f}-{q[2]:.3f})", flush=True)
    for r in rows:  # DDP has no timeline; ours' events are not needed here
        r.pop("events"), r.pop("step_starts")
    return dict(settings=st, rows=rows, ratios=ratios)


def exp_accumulate(mesh, fast, out):
    """k micro-batches per step with no_sync on the first k-1, or an all-reduce after each one. Same gradients
    (checked on the first step), k times the bytes."""
    st = settings(fast, mesh)
    k = 4
    specs = [("compute only", "none", 0, False), ("no_sync", "bucket", 1, False),
             ("sync every micro-batch", "bucket", 1, True)]
    cfg = make_cfg(st["size"], seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"], dp=mesh.dp.size)
    # the gradient check: one step of each on the same batches, before any optimizer step
    check = [Variant(name, cfg, mesh, impl, mb, grad_acc=k, sync_every=se) for name, impl, mb, se in specs[1:]]
    grads = []
    for v in check:
        v.timeline.enabled = False
        v.forward_backward(v.loader.micro_batches(1))
        grads.append([p.grad.clone() for p in v.raw.parameters()])
    diff = max((a - b).abs().max().item() for a, b in zip(*grads))
    scale = max(a.abs().max().item() for a in grads[0])
    del check, grads
    st = dict(st, steps=max(3, st["steps"] // 2))
    rows, st = timed(mesh, fast, specs, st, grad_acc=k)
    n = mesh.world_size
    for r in rows:
        r["bytes_sent_per_rank"] = r["phases"]["mib_sent"] * MiB * 2 * (n - 1) / n
    report(rows, rows[0]["median"])
    if mesh.rank == 0:
        print(f"max |grad(no_sync) - grad(sync every micro-batch)| = {diff:.1e} (largest gradient {scale:.1e})",
              flush=True)
    return dict(settings=st, k=k, rows=rows, max_grad_diff=diff, max_grad=scale)


def exp_scaling(mesh, fast, out):
    """picotron.train with dp = world size, the same micro-batch per rank (weak scaling)."""
    steps = 10 if fast else 30  # the parity standard compares 10 steps; the full run shows the drift after
    st = dict(size="small", seq_len=64 if fast else 128, micro_batch_size=2 if fast else 8)
    common = dict(steps=steps, seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"], warmup_steps=2,
                  log_every=steps, lr=3e-3)
    n = mesh.world_size
    cfg = make_cfg(st["size"], dp=n, out=str(Path(out) / f"scaling_dp{n}"), **common)
    summary = trainer.train(cfg, mesh)
    result = dict(settings=dict(st, steps=steps), dp=n, threads=torch.get_num_threads(), cores=os.cpu_count(),
                  summary=summary, mem_by_rank=gather(summary["mem"], mesh), references={})
    if mesh.rank == 0:
        history = metrics.read_metrics(cfg.out)[0]
        result["loss"] = [r["loss"] for r in history]
        result["step_times"] = [r["step_time"] for r in history]
        # tokens/s from the MEDIAN steady step (the trainer's summary uses the mean: one disturbed step on a
        # shared machine would move it)
        result["tokens_per_s"] = cfg.tokens_per_step / statistics.median(result["step_times"][1:])
    if n == 1:  # the single-process runs with the same global batch as dp = 2 and dp = 4
        for acc in (2, 4):
            ref = make_cfg(st["size"], grad_acc=acc, out=str(Path(out) / f"scaling_ref_acc{acc}"), **common)
            trainer.train(ref, mesh)
            result["references"][acc] = [r["loss"] for r in metrics.read_metrics(ref.out)[0]]
    return result


EXPERIMENTS = ("allreduce", "timeline", "ddp", "accumulate", "scaling")


# ------------------------------------------------------------------------------------ the widget's model
def model_timeline(grad_bytes, backward_s, bucket_bytes, latency_s, busbw, n=2):
    """A model of one backward pass with bucketed all-reduces overlapped with it (what the widget draws).

    grad_bytes: the gradient tensors' sizes in the order backward produces them. Backward compute is spread
    over them in proportion to their size (matmul FLOPs are proportional to the parameters). Buckets fill in
    that order and close at bucket_bytes (0: one bucket per tensor); a bucket is ready when its last tensor
    is; its all-reduce takes latency + 2(n-1)/n·bytes/busbw and starts when it is ready AND the previous one is
    done (one communication channel). Returns (buckets [(ready, start, end, bytes)], exposed seconds after
    backward ends)."""
    total = sum(grad_bytes)
    buckets, size, done = [], 0, 0
    for i, nb in enumerate(grad_bytes):
        size += nb
        done += nb
        if size >= bucket_bytes or i == len(grad_bytes) - 1:
            buckets.append([backward_s * done / total, size])
            size = 0
    out, free = [], 0.0
    for ready, nb in buckets:
        start = max(ready, free)
        free = start + latency_s + 2 * (n - 1) / n * nb / busbw
        out.append((ready, start, free, nb))
    return out, max(0.0, free - backward_s)


# ----------------------------------------------------------------------------- plots (for the notebook)
COLORS = {"forward": "#4c72b0", "backward": "#55a868", "optimizer": "#8172b2", "wait": "#c44e52"}


def plot_timelines(rows, step=-1, ranks=None, title=""):
    """Gantt chart: per variant and rank, a compute row (forward, backward, wait, optimizer) and a
    communication row (each all-reduce from launch to completion), for one step; time from its start."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n_ranks = len(rows[0]["events"])
    ranks = list(range(n_ranks)) if ranks is None else ranks
    fig, axes = plt.subplots(len(rows), 1, figsize=(11, 0.9 + 0.75 * len(ranks) * len(rows)), sharex=True)
    axes = [axes] if len(rows) == 1 else axes
    xmax = 0
    for ax, row in zip(axes, rows):
        labels = []
        for j, r in enumerate(ranks):
            starts = row["step_starts"][r]
            i = step % len(starts)
            t0 = min(row["step_starts"][q][i] for q in range(n_ranks))
            t1 = starts[i + 1] if i + 1 < len(starts) else float("inf")
            ev = [e for e in row["events"][r] if starts[i] <= e["start"] < t1]
            y_comp, y_comm = 2 * j, 2 * j + 1
            for e in ev:
                x, w = 1e3 * (e["start"] - t0), 1e3 * (e["end"] - e["start"])
                xmax = max(xmax, x + w)
                if e.get("kind") == "comm":
                    k = e.get("bucket", len(labels))
                    ax.broken_barh([(x, w)], (y_comm - 0.35, 0.7), color=plt.cm.tab20(k % 20), edgecolor="k", lw=0.3)
                else:
                    ax.broken_barh([(x, w)], (y_comp - 0.35, 0.7), color=COLORS[e["name"]])
            labels += [f"rank {r} compute", f"rank {r} comm"]
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_ylim(len(labels) - 0.5, -0.5)
        p = row["phases"]
        ax.set_title(f"{row['name']}: step {1e3 * row['median']:.0f} ms (median), wait after backward "
                     f"{1e3 * p['wait']:.1f} ms, {p['n_allreduce']:.0f} all-reduces", fontsize=9, loc="left")
    axes[-1].set_xlabel("ms since the step started")
    axes[-1].set_xlim(0, 1.02 * xmax)
    fig.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()] +
               [Patch(color=plt.cm.tab20(0), label="all-reduce (one colour per bucket)")],
               loc="upper right", fontsize=7, ncol=5)
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


def plot_phases(rows, base=None):
    """Stacked median phase times per variant; a dashed line at the compute-only step."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.45 * len(rows)))
    for j, row in enumerate(rows):
        left = 0
        for name in ("forward", "backward", "wait", "optimizer"):
            w = 1e3 * row["phases"][name]
            ax.barh(j, w, left=left, color=COLORS[name], label=name if j == 0 else None)
            left += w
        ax.text(left, j, f" {1e3 * row['median']:.0f} ms", va="center", fontsize=8)
    if base is not None:
        ax.axvline(1e3 * base, color="k", ls="--", lw=1, label="compute only")
    ax.set_yticks(range(len(rows)), [r["name"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (median; slowest rank)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def plot_allreduce(result, n):
    """Measured all-reduce time against message size, and the fitted line T = a + b·bytes."""
    import matplotlib.pyplot as plt

    rows = result["rows"]
    xs = [r["bytes"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
    ax1.loglog(xs, [1e3 * r["time"] for r in rows], "o", label="measured (median)")
    ax1.loglog(xs, [1e3 * (result["latency_s"] + result["s_per_byte"] * x) for x in xs], "k--",
               label=f"{1e6 * result['latency_s']:.0f} µs + bytes / "
                     f"{result['busbw'] * n / (2 * (n - 1)) / 1e9:.2f} GB/s")
    ax1.set(xlabel="bytes per rank", ylabel="ms", title=f"one all-reduce, {n} ranks")
    ax1.legend(fontsize=8)
    ax2.semilogx(xs, [r["busbw"] / 1e9 for r in rows], "o-")
    ax2.set(xlabel="bytes per rank", ylabel="GB/s", title="bus bandwidth = 2(n-1)/n · bytes / time")
    fig.tight_layout()
    return fig


def predicted_step(row_compute, grad_bytes, allreduce, bucket_mb, n):
    """The overlap model's step time: compute-only step + what sticks out after backward."""
    backward = row_compute["phases"]["backward"]
    _, exposed = model_timeline(grad_bytes, backward, bucket_mb * MiB, allreduce["latency_s"], allreduce["busbw"], n)
    return row_compute["median"] + exposed


def plot_buckets(rows, grad_bytes=None, allreduce=None, n=2, tokens_per_step=None):
    """tokens/s against bucket size (measured, with quartiles), compute only and naive as lines, and the
    overlap model's prediction where the all-reduce fit is given."""
    import matplotlib.pyplot as plt

    base = next(r for r in rows if r["impl"] == "none")
    naive = next((r for r in rows if r["impl"] == "naive"), None)
    sweep = [r for r in rows if r["impl"] in ("overlap", "bucket")]
    xs = [max(r["bucket_mb"], 0.05) for r in sweep]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    tps = [r["tokens_per_s"] for r in sweep]
    lo = [r["tokens_per_s"] * r["median"] / r["q3"] for r in sweep]
    hi = [r["tokens_per_s"] * r["median"] / r["q1"] for r in sweep]
    ax.errorbar(xs, tps, yerr=[[t - l for t, l in zip(tps, lo)], [h - t for t, h in zip(tps, hi)]], fmt="o-",
                capsize=3, label="bucketed DataParallel (measured; bars: quartiles)")
    for r, x in zip(sweep, xs):
        ax.annotate(f"{r['n_buckets']} bucket{'s' if r['n_buckets'] > 1 else ''}", (x, r["tokens_per_s"]),
                    textcoords="offset points", xytext=(0, -14), ha="center", fontsize=7)
    ax.axhline(base["tokens_per_s"], color="k", ls="--", lw=1, label="compute only (no communication)")
    if naive:
        ax.axhline(naive["tokens_per_s"], color="#c44e52", ls=":", lw=1.5, label="naive (blocking, per tensor)")
    if allreduce and grad_bytes and tokens_per_step:
        pred = [tokens_per_step / predicted_step(base, grad_bytes, allreduce, r["bucket_mb"], n) for r in sweep]
        ax.plot(xs, pred, "s--", color="gray", ms=4, label="overlap model (all-reduce fit + compute-only backward)")
    ax.set_xscale("log")
    ax.set_xticks(xs, ["per tensor" if r["bucket_mb"] == 0 else f"{r['bucket_mb']:g}" for r in sweep])
    ax.set(xlabel="bucket size (MiB)", ylabel="tokens/s (all ranks)", title="throughput against bucket size")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def plot_ddp(result):
    """Per round, the throughput ratio ours/DDP (DDP's step time / ours), as a histogram per bucket size."""
    import matplotlib.pyplot as plt

    by = {r["name"]: r for r in result["rows"]}
    sizes = list(result["ratios"])
    fig, axes = plt.subplots(1, len(sizes) + 1, figsize=(4 * (len(sizes) + 1), 3.2))
    for ax, mb in zip(axes, sizes):
        ours, ddp = by[f"ours {mb} MiB"]["step_times"], by[f"ddp {mb} MiB"]["step_times"]
        paired = [d / o for o, d in zip(ours, ddp)]
        ax.hist(paired, bins=20, color="#4c72b0")
        r = result["ratios"][mb]
        ax.axvline(r["median"], color="k", lw=1.5, label=f"median {r['median']:.3f}")
        ax.axvline(1.0, color="#c44e52", ls="--", lw=1, label="1 = as fast as DDP")
        ax.set(xlabel="ours / DDP throughput, per round", title=f"bucket {mb} MiB, {r['n']} rounds")
        ax.legend(fontsize=7)
    names = list(by)
    axes[-1].bar(names, [1e3 * by[k]["median"] for k in names],
                 color=["#4c72b0" if k.startswith("ours") else "#dd8452" for k in names])
    axes[-1].errorbar(names, [1e3 * by[k]["median"] for k in names],
                      yerr=[[1e3 * (by[k]["median"] - by[k]["q1"]) for k in names],
                            [1e3 * (by[k]["q3"] - by[k]["median"]) for k in names]], fmt="none", color="k", capsize=3)
    axes[-1].set(ylabel="ms per step (median, quartiles)", title="step time")
    axes[-1].tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    return fig


def plot_accumulate(result, n):
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["impl"] != "none"]
    base = next(r for r in result["rows"] if r["impl"] == "none")
    names = [r["name"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3))
    ax1.bar(names, [r["bytes_sent_per_rank"] / MiB for r in rows], color=["#55a868", "#c44e52"])
    ax1.set(ylabel="MiB sent per rank per step", title=f"{result['k']} micro-batches per step, {n} ranks")
    ax2.bar(names, [1e3 * r["median"] for r in rows], color=["#55a868", "#c44e52"])
    ax2.axhline(1e3 * base["median"], color="k", ls="--", lw=1, label="compute only")
    ax2.set(ylabel="ms per step (median)", title="time")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_scaling(runs):
    """tokens/s and per-rank step time against dp (runs: {dp: scaling_dp<dp>.json's content})."""
    import matplotlib.pyplot as plt

    dps = sorted(runs)
    tps = [runs[d]["results"]["tokens_per_s"] for d in dps]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
    ax1.plot(dps, tps, "o-", label="measured")
    ax1.plot(dps, [tps[0] * d for d in dps], "k--", lw=1, label="ideal with one device per rank (× dp)")
    ax1.plot(dps, [tps[0]] * len(dps), ":", color="gray", label="ideal on a fixed set of cores")
    ax1.set(xlabel="dp (processes)", ylabel="tokens/s (all ranks)", xticks=dps,
            title="weak scaling: same micro-batch per rank")
    ax1.legend(fontsize=7)
    cores = runs[dps[0]]["results"]["cores"]
    labels = [f"dp={d}\n{runs[d]['results']['threads']} thread{'s' if runs[d]['results']['threads'] > 1 else ''}"
              f"/rank" for d in dps]
    ax2.bar(labels, [1e3 * statistics.median(runs[d]["results"]["step_times"][1:]) for d in dps], color="#4c72b0")
    ax2.set(ylabel="ms per step (median)", title=f"step time ({cores} cores: dp={max(dps)} oversubscribes)"
            if max(dps) > cores else "step time")
    fig.tight_layout()
    return fig


PARTS = ("params", "grads", "optimizer", "activations")
PART_COLORS = dict(params="#4c72b0", grads="#dd8452", optimizer="#55a868", activations="#c44e52")


def plot_memory(runs):
    """Bytes per rank by category for each dp (every rank of each run), next to what ZeRO-1/2/3 would keep
    per rank at the largest dp (formula: the model states divided as
    docs/reference.md#zero-memory-and-communication-per-rank says)."""
    import matplotlib.pyplot as plt

    bars = {}
    for d in sorted(runs):
        for r, mem in enumerate(runs[d]["results"]["mem_by_rank"]):
            bars[f"dp={d}\nrank {r}"] = mem
    dmax = max(runs)
    m = runs[dmax]["results"]["mem_by_rank"][0]
    for stage, divided in (("ZeRO-1", ("optimizer",)), ("ZeRO-2", ("optimizer", "grads")),
                           ("ZeRO-3", ("optimizer", "grads", "params"))):
        bars[f"{stage}\ndp={dmax}\n(formula)"] = {k: m[k] / dmax if k in divided else m[k] for k in PARTS}
    fig, ax = plt.subplots(figsize=(max(7, 0.7 * len(bars)), 3.4))
    for j, (label, mem) in enumerate(bars.items()):
        bottom = 0
        formula = "formula" in label
        for part in PARTS:
            ax.bar(j, mem[part] / MiB, bottom=bottom, color=PART_COLORS[part], hatch="//" if formula else None,
                   edgecolor="white", label=part if j == 0 else None)
            bottom += mem[part] / MiB
    ax.set_xticks(range(len(bars)), list(bars), fontsize=7)
    ax.set(ylabel="MiB per rank", title="what each rank holds: data parallelism replicates all model states")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def plot_model_timeline(grad_bytes, backward_s, bucket_mb, latency_s, busbw, n=2, title=""):
    """The widget's figure: the modelled backward pass with its buckets' all-reduces (left), and the exposed
    communication against bucket size with the same inputs (right)."""
    import matplotlib.pyplot as plt

    buckets, exposed = model_timeline(grad_bytes, backward_s, bucket_mb * MiB, latency_s, busbw, n)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 2.8), gridspec_kw=dict(width_ratios=[3, 2]))
    ax1.broken_barh([(0, 1e3 * backward_s)], (0.65, 0.7), color=COLORS["backward"])
    for k, (ready, start, end, nb) in enumerate(buckets):
        ax1.broken_barh([(1e3 * start, 1e3 * (end - start))], (1.65, 0.7), color=plt.cm.tab20(k % 20),
                        edgecolor="k", lw=0.3)
        ax1.plot([1e3 * ready] * 2, [1.35, 1.65], color="gray", lw=0.5)
    ax1.axvspan(1e3 * backward_s, 1e3 * (backward_s + exposed), color=COLORS["wait"], alpha=0.25)
    ax1.set_yticks([1, 2], ["backward", "all-reduce"])
    ax1.set_ylim(2.6, 0.4)
    ax1.set(xlabel="ms", title=f"{len(buckets)} bucket(s): exposed {1e3 * exposed:.2f} ms "
                               f"({100 * exposed / backward_s:.0f}% of backward) {title}")
    sizes = [0] + [2.0**k for k in range(-4, 9)]
    exp = [model_timeline(grad_bytes, backward_s, mb * MiB, latency_s, busbw, n)[1] for mb in sizes]
    xs = [max(mb, 2**-5) for mb in sizes]
    ax2.semilogx(xs, [1e3 * e for e in exp], "o-", ms=3)
    ax2.semilogx([max(bucket_mb, 2**-5)], [1e3 * exposed], "o", color=COLORS["wait"], ms=8)
    total = latency_s + 2 * (n - 1) / n * sum(grad_bytes) / busbw
    ax2.axhline(1e3 * total, color="k", ls=":", lw=1, label="one all-reduce of everything, after backward")
    ax2.set(xlabel="bucket MiB (leftmost: one per tensor)", ylabel="exposed ms", title="exposed communication")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig


plot_parity = functools.partial(_common.plot_parity, what="dp ranks")  # for the notebook


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(_common.ROOT / "runs" / "lessons" / "03_data_parallel"))
    p.add_argument("--only", default=",".join(EXPERIMENTS), help=f"comma-separated subset of {EXPERIMENTS}")
    p.add_argument("--fast", action="store_true", default=_common.FAST, help="short settings (or PICOTRON_FAST=1)")
    p.add_argument("--steps", type=int, help="timed steps (rounds) per variant in timeline/ddp/accumulate")
    args = p.parse_args(argv)
    global STEPS
    STEPS = args.steps
    names = args.only.split(",")
    if any(name not in EXPERIMENTS for name in names):
        p.error(f"--only {args.only!r}: pick a comma-separated subset of {', '.join(EXPERIMENTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = Mesh.init(dp=world)
    try:
        st = settings(args.fast, mesh)
        env = env_info(mesh, args.fast, st)
        for name in names:
            if world == 1 and name != "scaling":
                if mesh.rank == 0:
                    print(f"== {name}: needs at least 2 processes (torchrun --nproc_per_node 2); skipped", flush=True)
                continue
            t0 = time.perf_counter()
            result = globals()[f"exp_{name}"](mesh, args.fast, out)
            file = out / (f"{name}_dp{world}.json" if name == "scaling" else f"{name}.json")
            if mesh.rank == 0:
                _common.save_json(dict(env, results=result, seconds=time.perf_counter() - t0), file)
                path = os.path.relpath(file)  # short (and free of home directories) in notebooks
                print(f"== {name}: {time.perf_counter() - t0:.1f} s -> {file if path.startswith('..') else path}",
                      flush=True)
    finally:
        mesh.destroy()


if __name__ == "__main__":
    main()
