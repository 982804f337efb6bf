"""Lesson 03, the experiment: data parallelism, measured. Each experiment writes OUT/<name>.json (rank 0):

    allreduce   all-reduce time against message size, fitted to T = a + b·bytes
    timeline    compute only (nothing sent), naive, and the bucketed DataParallel with buckets of 0 (one per tensor:
                "overlap") to 25 MiB (one for all): every rank's events and step times, on this machine
    emulated    the same over an EmulatedLink (picotron/link.py) sized from this machine's backward (choose_link)
    ddp         our DataParallel against torch's DistributedDataParallel
    accumulate  4 micro-batches per step: no_sync vs a sync after every micro-batch, here and emulated
    scaling     picotron.train with dp = world size (writes scaling_dp<N>.json; launch with 1, 2 and 4 processes)

    torchrun --nproc_per_node 2 lessons/03_data_parallel/experiment.py --only timeline [--link 3e8,4e-3] [--steps 10]
    PICOTRON_FAST=1 torchrun ...        # short settings (CI, the notebook's FAST mode)

A timed comparison runs its variants in ONE launch, each on its own copy of the model, one step of each in turn (the
order rotating, a barrier before each): drift of a shared machine hits all alike. A step's time is the slowest rank's.
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
from _common import gather, make_cfg, run_interleaved, tokens, union_length  # noqa: E402
import _plots  # noqa: E402  (figure helpers several lessons share)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from picotron import data, data_parallel, metrics, parallelize, schedule  # noqa: E402
from picotron import train as trainer  # noqa: E402
from picotron.link import EmulatedLink  # noqa: E402
from picotron.mesh import Mesh  # noqa: E402
from picotron.model import Llama, loss_fn  # noqa: E402

# "small": the tiny preset widened (3.3 M parameters, 12.5 MiB of fp32 gradients in 39 tensors)
MiB = 2**20
BUCKET_SIZES, EMULATED_SIZES = (0, 0.25, 1, 4, 25), (0, 0.25, 0.5, 1, 2, 4, 25)  # MiB; 0: one bucket per tensor
EMULATED = dict(micro_batch_size=8)  # 4x the tokens: backward dwarfs the real copy that runs under the emulated link
ARGS = argparse.Namespace(steps=None, link=None, fast=_common.FAST)  # the command line's options
OUT = _common.ROOT / "runs" / "lessons" / "03_data_parallel"
COLORS = {"forward": "#4c72b0", "backward": "#55a868", "wait": "#c44e52", "optimizer": "#8172b2"}  # the phases


def all_settings(fast, mesh=None):
    """The timed experiments' settings and the scaling runs' (scaling_*); on GPUs with
    _common.GPU_SETTINGS["03_data_parallel"] on top (the mesh's device decides, else _common.device())."""
    st = dict(size="small", seq_len=64, micro_batch_size=2, steps=10 if fast else 40, warmup=2,
              scaling_size="small", scaling_seq_len=64 if fast else 128, scaling_micro_batch_size=2 if fast else 8)
    return _common.sized("03_data_parallel", st, fast, mesh.device.type if mesh else None)


def settings(fast, mesh=None):
    """Model, per-rank batch, timed steps per variant and warm-up steps of the timed experiments."""
    st = all_settings(fast, mesh)
    return dict(size=st["size"], seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"],
                steps=ARGS.steps or st["steps"], warmup=st["warmup"])


def grad_tensor_bytes(mc, nbytes=4):
    """Bytes of each gradient tensor, in the order backward produces them (the reverse of the forward)."""
    with torch.device("meta"):
        return [nbytes * p.numel() for p in reversed(list(Llama(mc).parameters()))]


class Variant:
    """One way of training, on its own copy of the model, with its own timeline, built as `parallelize` builds it:
    the model, a gradient-sync wrapper over the dp x cp axis (held to an emulated `link`'s time if given; a
    metrics.Recorder counts and times every all-reduce), AdamW, and the step engine (which times forward, backward and
    the wait). impl "none" (compute only): each rank trains alone (`Local`). `make_wrapper(raw, axis)` replaces
    `data_parallel.wrap` (benchmarks/dp_vs_ddp.py)."""

    def __init__(self, name, cfg, mesh, impl, bucket_mb=25.0, grad_acc=1, sync_every=False, record_comm=True,
                 make_wrapper=None, link=None):
        self.name, self.impl, self.bucket_mb, self.sync_every = name, impl, bucket_mb, sync_every
        self.device = mesh.device
        self.timeline = metrics.Timeline(mesh.device, mesh.rank, enabled=False)  # on for the timed steps only
        self.recorder = metrics.Recorder(self.timeline if record_comm else None)
        axis = (mesh.dp_cp.over(link) if link else mesh.dp_cp).recorded(self.recorder)
        self.raw = parallelize.build_model(cfg, mesh)
        replicas = mesh.dp_cp
        if make_wrapper is not None:
            self.model = make_wrapper(self.raw, axis)
        elif impl == "none":
            self.model, replicas = data_parallel.Local(self.raw), Mesh.local(mesh.device).dp_cp
        else:
            self.model = data_parallel.wrap(self.raw, axis, impl, bucket_mb)
        self.optimizer = parallelize.build_optimizer(self.model.optimizer_groups(), cfg, mesh.device)
        self.schedule = schedule.OneStage(replicas, mesh.device)
        self.schedule.phases.listen(self.timeline.record)  # its forward, backward and wait, on this timeline
        self.loader = data.DataLoader(tokens(), seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size,
                                      grad_acc=grad_acc, dp_size=mesh.dp.size, dp_rank=mesh.dp.rank, seed=cfg.seed)
        self.times, self.step_starts, self.sent = [], [], []
        self.n_buckets = len(getattr(self.model, "buckets", ())) or None

    def forward_backward(self, batches):
        """The step engine once (no_sync on all but the last micro-batch); with sync_every, once per micro-batch,
        each loss divided by k: a gradient sync after every micro-batch, the same sum in the end."""
        if not self.sync_every:
            return self.schedule.run(self.model, batches, loss_fn)
        return sum(self.schedule.run(self.model, [b], lambda out, y: loss_fn(out, y) / len(batches)) for b in batches)

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


def quartiles(xs):
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else list(xs) * 3
    return statistics.median(xs), q[0], q[2]


def summarise(variants, mesh, tokens_per_step):
    """Per variant: each step's time (the slowest rank's), median, quartiles, tokens/s, and every rank's events,
    step starts and bytes all-reduced per step."""
    rows = []
    for v in variants:
        per_rank = gather(dict(times=v.times, events=v.timeline.events, starts=v.step_starts, sent=v.sent), mesh)
        times = [max(r["times"][i] for r in per_rank) for i in range(len(v.times))]
        med, q1, q3 = quartiles(times)
        rows.append(dict(name=v.name, impl=v.impl, bucket_mb=v.bucket_mb, n_buckets=v.n_buckets, step_times=times,
                         median=med, q1=q1, q3=q3, tokens_per_s=tokens_per_step / med,
                         events=[r["events"] for r in per_rank], step_starts=[r["starts"] for r in per_rank],
                         sent=[r["sent"] for r in per_rank]))
    return rows


def phases(row):
    """Medians per step, the largest over ranks, of each phase in COLORS, comm (time some all-reduce ran),
    n_allreduce and mib_sent; and link_wait: each step's SHORTER wait of the ranks (the rank that finishes backward
    first also waits for the other to launch its all-reduces; the last one waits only for the link)."""
    per_rank = []
    for events, starts, sent in zip(row["events"], row["step_starts"], row["sent"]):
        bounds, steps = starts + [float("inf")], []
        for i in range(len(starts)):
            ev = [e for e in events if bounds[i] <= e["start"] < bounds[i + 1]]
            comm = [(e["start"], e["end"]) for e in ev if e.get("kind") == "comm"]
            steps.append(dict({k: sum(e["end"] - e["start"] for e in ev if e["name"] == k) for k in COLORS},
                              comm=union_length(comm), n_allreduce=len(comm), mib_sent=sent[i] / MiB))
        per_rank.append(steps)
    out = {k: max(statistics.median(d[k] for d in steps) for steps in per_rank) for k in per_rank[0][0]}
    out["link_wait"] = statistics.median(min(s[i]["wait"] for s in per_rank) for i in range(len(per_rank[0])))
    return out


def timed(mesh, st, specs, grad_acc=1, record_comm=True, show=True):
    """Build the variants (dicts of Variant's arguments; "link": (bandwidth, latency) puts one on its own emulated
    link), run them interleaved, summarise. With compute only first, each row gets `exposed`: its step time minus
    compute only's in the same round (median, quartiles): what communication costs the step."""
    cfg = make_cfg(st["size"], seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"], dp=mesh.dp.size)
    variants = [Variant(cfg=cfg, mesh=mesh, grad_acc=grad_acc, record_comm=record_comm,
                        **dict(s, link=EmulatedLink(*s["link"]) if s.get("link") else None)) for s in specs]
    dist.barrier()
    for v in variants:  # one common origin for every timeline, right after a barrier: ranks are comparable
        v.timeline.t0 = time.perf_counter()
    busy = run_interleaved(variants, st["steps"], st["warmup"], mesh.dp_cp.group)
    rows = summarise(variants, mesh, mesh.dp.size * grad_acc * st["micro_batch_size"] * st["seq_len"])
    for r in rows:
        r["phases"] = phases(r)
        r["busy"] = busy  # other programs' share of the cores while the variants ran (_common.others_share)
        if rows[0]["impl"] == "none":
            r["exposed"] = quartiles([t - b for t, b in zip(r["step_times"], rows[0]["step_times"])])
    if mesh.rank == 0 and show:
        print(table(rows), flush=True)
    return rows


def table(rows):
    """The rows as a text table (what the experiment prints)."""
    cols = [("variant", "", 34), ("step ms", "(median)", 9), ("exposed ms", "(paired)", 12), ("backward", "ms", 10),
            ("wait after", "backward ms", 13), ("shorter", "wait ms", 9), ("all-", "reduces", 8), ("comm", "ms", 7)]
    lines = ["".join(f"{c[i]:<{w}}" if j == 0 else f"{c[i]:>{w}}" for j, (*c, w) in enumerate(cols)) for i in (0, 1)]
    for r in rows:
        p = r["phases"]
        lines.append(f"{r['name']:<34}{1e3 * r['median']:9.1f}{1e3 * r.get('exposed', [0])[0]:12.1f}"
                     f"{1e3 * p['backward']:10.1f}{1e3 * p['wait']:13.1f}{1e3 * p['link_wait']:9.1f}"
                     f"{p['n_allreduce']:8.0f}{1e3 * p['comm']:7.1f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- the emulated link
def choose_link(grad_bytes, backward_s, n=2):
    """(bandwidth bytes/s, latency s) of an emulated link on which communication costs as much as it can hide:
    the ring all-reduce of all `grad_bytes` takes 40% of `backward_s` on the wire, and each message pays a latency
    of backward_s / 30 (so per-tensor messages pay their latency many times over). Two significant digits."""
    bandwidth = 2 * (n - 1) / n * grad_bytes / (0.4 * backward_s)
    return float(f"{bandwidth:.2g}"), float(f"{backward_s / 30:.2g}")


def measure_backward(mesh, cfg, steps=3, warmup=2):
    """Compute-only backward time here (median over a few steps, the slowest rank's): what a link is sized from."""
    v = Variant("calibration", cfg, mesh, "none")
    for s in range(warmup + steps):
        v.step(s + 1, record=s >= warmup)
    return max(gather(statistics.median(e["end"] - e["start"] for e in v.timeline.events if e["name"] == "backward"),
                      mesh))


def the_link(mesh, st):
    """--link's emulated link, or one chosen from this machine's backward with settings `st`: a dict."""
    backward = None
    if ARGS.link:
        bandwidth, latency = (float(x) for x in ARGS.link.split(","))
    else:
        cfg = make_cfg(st["size"], seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"], dp=mesh.dp.size)
        backward = measure_backward(mesh, cfg)
        bandwidth, latency = choose_link(4 * cfg.model_config().num_params(), backward, mesh.dp_cp.size)
    return dict(bandwidth=bandwidth, latency=latency, label=EmulatedLink(bandwidth, latency).label(),
                measured_backward=backward)


# --------------------------------------------------------------------------------------------- experiments
def exp_allreduce(mesh, fast):
    """Median time of one all-reduce per message size (the slowest rank's); T = a + b·bytes fitted."""
    import numpy as np

    rows, n = [], mesh.world_size
    for nbytes in [2**k for k in range(10, 25, 2 if fast else 1)]:  # 1 KiB .. 16 MiB
        x = torch.ones(nbytes // 4, device=mesh.device)
        dist.all_reduce(x, group=mesh.dp_cp.group)  # warm up this size
        times = []
        for _ in range(5 if fast else 20):
            dist.barrier(mesh.dp_cp.group)
            metrics.sync(mesh.device)
            t0 = time.perf_counter()
            dist.all_reduce(x, group=mesh.dp_cp.group)
            metrics.sync(mesh.device)
            times.append(time.perf_counter() - t0)
        t = max(gather(statistics.median(times), mesh))
        rows.append(dict(bytes=nbytes, time=t, busbw=nbytes / t * 2 * (n - 1) / n))
    xs, ts = np.array([r["bytes"] for r in rows], float), np.array([r["time"] for r in rows])
    b, a = np.polyfit(xs, ts, 1, w=1 / ts)  # least squares on relative errors: small messages count too
    return dict(rows=rows, latency_s=float(a), s_per_byte=float(b), busbw=2 * (n - 1) / n / float(b))


def sweep(sizes, link=None):
    """compute only, naive, and the bucketed DataParallel at each size (0: one bucket per tensor, "overlap")."""
    return [dict(name="compute only", impl="none"), dict(name="naive", impl="naive", link=link)] + [
        dict(name="overlap" if mb == 0 else f"bucket {mb:g} MiB", impl="overlap" if mb == 0 else "bucket",
             bucket_mb=mb, link=link) for mb in sizes]


def exp_timeline(mesh, fast):
    st = settings(fast, mesh)
    return dict(settings=st, rows=timed(mesh, st, sweep(BUCKET_SIZES)))


def exp_emulated(mesh, fast):
    st = dict(settings(fast, mesh), **EMULATED, steps=ARGS.steps or (6 if fast else 20))
    link = the_link(mesh, st)
    if mesh.rank == 0:
        print(link["label"], flush=True)
    rows = timed(mesh, st, sweep(EMULATED_SIZES, (link["bandwidth"], link["latency"])))
    return dict(settings=st, link=link, rows=rows)


def exp_ddp(mesh, fast):
    """Ours vs DDP at two bucket sizes, steps alternating; each round's paired ratio says how far to trust it."""
    st = dict(settings(fast, mesh), steps=ARGS.steps or (10 if fast else 100))
    specs = [dict(name=f"{who} {mb} MiB", impl=impl, bucket_mb=mb) for mb in (1, 25)
             for who, impl in (("ours", "bucket"), ("ddp", "ddp"))]
    rows = timed(mesh, st, specs, record_comm=False, show=False)
    ratios = {}
    for mb in (1, 25):
        ours, ddp = (next(r["step_times"] for r in rows if r["name"] == f"{w} {mb} MiB") for w in ("ours", "ddp"))
        paired = [d / o for o, d in zip(ours, ddp)]  # throughput ratio ours/DDP = DDP's time / ours
        ratios[mb] = dict(zip(("median", "q1", "q3"), quartiles(paired)), n=len(paired), paired=paired)
    return dict(settings=st, rows=[{k: v for k, v in r.items() if k not in ("events", "step_starts")} for r in rows],
                ratios=ratios)


def exp_accumulate(mesh, fast):
    """k micro-batches per step, one bucket: no_sync on the first k-1, or a sync after each one; on this machine
    and over the emulated link. Same gradients (checked on one step first), k times the bytes."""
    st, k = settings(fast, mesh), 4
    st["steps"] = max(4, st["steps"] // 2)
    link = the_link(mesh, st)
    specs = [dict(name="compute only", impl="none")] + [
        dict(name=what + where, impl="bucket", bucket_mb=25, sync_every=every, link=lk)
        for where, lk in (("", None), (", emulated", (link["bandwidth"], link["latency"])))
        for what, every in (("no_sync", False), ("sync every micro-batch", True))]
    cfg = make_cfg(st["size"], seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"], dp=mesh.dp.size)
    grads = []
    for s in specs[1:3]:  # one step of each from the same weights and batches
        v = Variant(cfg=cfg, mesh=mesh, grad_acc=k, **s)
        v.forward_backward(v.loader.micro_batches(1))
        grads.append([p.grad.clone() for p in v.raw.parameters()])
    rows = timed(mesh, st, specs, grad_acc=k)
    for r in rows:
        r["bytes_sent_per_rank"] = r["phases"]["mib_sent"] * MiB * 2 * (mesh.world_size - 1) / mesh.world_size
    return dict(settings=st, k=k, rows=rows, link=link, max_grad=max(a.abs().max().item() for a in grads[0]),
                max_grad_diff=max((a - b).abs().max().item() for a, b in zip(*grads)))


def scaling_counts():
    """The dp of the scaling runs: 1, 2 and 4, and 8 with PICOTRON_NPROC=8 (_common.nproc: one GPU node)."""
    return (1, 2, 4) if _common.nproc("03_data_parallel", 4) == 4 else (1, 2, 4, 8)


def scaling_configs(n, fast, mesh=None):
    """The Configs of the scaling run at dp = n: the run itself, and with n = 1 also the references, one process
    with grad_acc = 2, 4 (and 8) (the same global batch as those dp) for the parity check. On GPUs their sizes are
    GPU_SETTINGS' scaling_* (the mesh's device decides, else _common.device())."""
    steps = 10 if fast else 30  # the parity standard compares 10 steps; the full run shows the drift after
    sized = all_settings(fast, mesh)
    common = dict(steps=steps, seq_len=sized["scaling_seq_len"], micro_batch_size=sized["scaling_micro_batch_size"],
                  warmup_steps=2, log_every=steps, lr=3e-3)
    run = make_cfg(sized["scaling_size"], dp=n, out=str(OUT / f"scaling_dp{n}"), **common)
    refs = [make_cfg(sized["scaling_size"], grad_acc=acc, out=str(OUT / f"scaling_ref_acc{acc}"), **common)
            for acc in scaling_counts()[1:]] if n == 1 else []
    return [run] + refs


def configs_at(nproc, fast=False):
    """The Configs the lesson's main experiment (scaling) trains on `nproc` processes (tests/test_lesson_node.py
    validates them at world size 8, as the trainer does before any process group exists)."""
    return scaling_configs(nproc, fast)


def exp_scaling(mesh, fast):
    """picotron.train with dp = world size, the same micro-batch per rank (weak scaling); with one process also the
    references with grad_acc = 2, 4 (and 8) (the same global batch as dp = 2, 4, 8) for the parity check."""
    n = mesh.world_size
    cfg, *refs = scaling_configs(n, fast, mesh)
    summary = trainer.train(cfg, mesh)
    st = dict(size=all_settings(fast, mesh)["scaling_size"], seq_len=cfg.seq_len,
              micro_batch_size=cfg.micro_batch_size)
    result = dict(settings=dict(st, steps=cfg.steps), dp=n, threads=torch.get_num_threads(), cores=os.cpu_count(),
                  mem_by_rank=gather(summary["mem"], mesh), references={})
    if mesh.rank == 0:
        history = metrics.read_metrics(cfg.out)[0]
        result.update(loss=[r["loss"] for r in history], step_times=[r["step_time"] for r in history])
        # tokens/s from the MEDIAN steady step (the trainer's summary uses the mean, which one slow step moves)
        result["tokens_per_s"] = cfg.tokens_per_step / statistics.median(result["step_times"][1:])
    for ref in refs:
        trainer.train(ref, mesh)
        result["references"][ref.grad_acc] = [r["loss"] for r in metrics.read_metrics(ref.out)[0]]
    return result


EXPERIMENTS = ("allreduce", "timeline", "emulated", "ddp", "accumulate", "scaling")


# ------------------------------------------------------------------------------------ the overlap model
def model_timeline(grad_bytes, backward_s, bucket_bytes, latency_s, busbw, n=2):
    """One backward pass with bucketed all-reduces overlapping it (section 2's formula; the widget's model).

    grad_bytes: the gradient tensors' sizes in the order backward produces them; backward's time is spread over
    them in proportion to their size. Buckets fill in that order and close at bucket_bytes (0: one per tensor);
    a bucket is ready when its last tensor is; its all-reduce takes latency + 2(n-1)/n·bytes/busbw and starts
    when it is ready AND the previous one is done (one link, first in first out). Returns
    (buckets [(ready, start, end, bytes)], exposed: seconds of communication left after backward ends)."""
    total, ready, size, done = sum(grad_bytes), [], 0, 0
    for i, nb in enumerate(grad_bytes):
        size, done = size + nb, done + nb
        if size >= bucket_bytes or i == len(grad_bytes) - 1:
            ready.append((backward_s * done / total, size))
            size = 0
    out, free = [], 0.0
    for t, nb in ready:
        start = max(t, free)
        free = start + latency_s + 2 * (n - 1) / n * nb / busbw
        out.append((t, start, free, nb))
    return out, max(0.0, free - backward_s)


def exposed_rows(rows, grad_bytes, latency_s, busbw, n=2):
    """Per bucketed variant: (name, bucket MiB, n buckets, exposed (median, q1, q3), shorter wait after backward,
    backward, the overlap model's exposed time given that variant's own backward)."""
    return [(r["name"], r["bucket_mb"], r["n_buckets"], r["exposed"], r["phases"]["link_wait"], r["phases"]["backward"],
             model_timeline(grad_bytes, r["phases"]["backward"], r["bucket_mb"] * MiB, latency_s, busbw, n)[1])
            for r in rows if r["impl"] in ("overlap", "bucket")]


# ----------------------------------------------------------------------------- plots (for the notebook)
def _plt():
    import matplotlib.pyplot as plt

    return plt


def plot_timelines(rows, step=-1, title=""):
    """Gantt chart of one step: per variant and rank, a compute row (the phases) and a communication row (each
    all-reduce from launch to completion, one colour per bucket); time from the earliest rank's start."""
    from matplotlib.patches import Patch

    plt, n_ranks = _plt(), len(rows[0]["events"])
    fig, axes = plt.subplots(len(rows), 1, figsize=(11, 1.1 + 0.75 * n_ranks * len(rows)), sharex=True)
    for ax, row in zip(axes, rows):
        for r in range(n_ranks):
            starts = row["step_starts"][r]
            i = step % len(starts)
            t0, t1 = min(s[i] for s in row["step_starts"]), (starts + [float("inf")])[i + 1]
            for k, e in enumerate(e for e in row["events"][r] if starts[i] <= e["start"] < t1):
                comm = e.get("kind") == "comm"
                ax.broken_barh([(1e3 * (e["start"] - t0), 1e3 * (e["end"] - e["start"]))],
                               (2 * r + comm - 0.35, 0.7), edgecolor="k" if comm else "none", lw=0.3,
                               color=plt.cm.tab20(e.get("bucket", k) % 20) if comm else COLORS[e["name"]])
        ax.set_yticks(range(2 * n_ranks), [f"rank {r} {w}" for r in range(n_ranks) for w in ("compute", "comm")],
                      fontsize=8)
        ax.set_ylim(2 * n_ranks - 0.5, -0.5)
        ax.set_title(f"{row['name']}: step {1e3 * row['median']:.0f} ms (median), wait after backward "
                     f"{1e3 * row['phases']['wait']:.1f} ms, {row['phases']['n_allreduce']:.0f} all-reduces",
                     fontsize=9, loc="left")
    axes[-1].set_xlabel("ms since the step started")
    axes[-1].set_xlim(left=0)
    fig.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()] +
               [Patch(color=plt.cm.tab20(0), label="all-reduce (a colour per bucket)")],
               loc="lower center", fontsize=8, ncol=5)
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    return fig


def plot_phases(rows, title="where the time goes"):
    """Stacked median phase times per variant; a dashed line at the compute-only step."""
    fig, ax = _plt().subplots(figsize=(9, 0.9 + 0.4 * len(rows)))
    for j, row in enumerate(rows):
        widths = [1e3 * row["phases"][k] for k in COLORS]
        ax.barh([j] * 4, widths, left=[sum(widths[:i]) for i in range(4)], color=list(COLORS.values()),
                label=list(COLORS) if j == 0 else None)
        ax.text(sum(widths), j, f" {1e3 * row['median']:.0f} ms", va="center", fontsize=8)
    ax.axvline(1e3 * rows[0]["median"], color="k", ls="--", lw=1, label="compute only")
    ax.set_yticks(range(len(rows)), [r["name"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="ms per step (median phase times; slowest rank)", title=title, xlim=(0, 1.12 * ax.get_xlim()[1]))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig


def plot_allreduce(result, n):
    """Measured all-reduce time against message size with the fitted line, and the bus bandwidth."""
    xs = [r["bytes"] for r in result["rows"]]
    fig, (ax1, ax2) = _plt().subplots(1, 2, figsize=(10, 3.2))
    ax1.loglog(xs, [1e3 * r["time"] for r in result["rows"]], "o", label="measured (median)")
    ax1.loglog(xs, [1e3 * (result["latency_s"] + result["s_per_byte"] * x) for x in xs], "k--",
               label=f"fit: {1e6 * result['latency_s']:.0f} µs + bytes / {1e-9 / result['s_per_byte']:.2f} GB/s")
    ax1.set(xlabel="bytes per rank", ylabel="ms", title=f"one all-reduce, {n} ranks (gloo, this machine)")
    ax1.legend(fontsize=8)
    ax2.semilogx(xs, [r["busbw"] / 1e9 for r in result["rows"]], "o-")
    ax2.set(xlabel="bytes per rank", ylabel="GB/s", title="bus bandwidth = 2(n-1)/n · bytes / time")
    fig.tight_layout()
    return fig


def plot_exposed(rows, grad_bytes, latency_s, busbw, n=2, title=""):
    """Exposed communication against bucket size: measured (step − compute only, paired rounds), the measured
    wait after backward, and the overlap model's wait."""
    pts = exposed_rows(rows, grad_bytes, latency_s, busbw, n)
    xs, med = [max(p[1], 0.1) for p in pts], [1e3 * p[3][0] for p in pts]
    fig, ax = _plt().subplots(figsize=(10, 3.6))
    err = [[m - 1e3 * p[3][1] for m, p in zip(med, pts)], [1e3 * p[3][2] - m for m, p in zip(med, pts)]]
    ax.errorbar(xs, med, yerr=err, fmt="o-", capsize=3, label="measured: step − compute only\n(paired: quartiles)")
    ax.plot(xs, [1e3 * p[4] for p in pts], "^:", color="#c44e52",
            label="measured: wait after backward\n(the shorter of the ranks')")
    ax.plot(xs, [1e3 * p[6] for p in pts], "s--", color="gray", label="overlap model of the wait\n(its own backward)")
    ax.axhline(1e3 * (latency_s + 2 * (n - 1) / n * sum(grad_bytes) / busbw), color="k", ls=":", lw=1,
               label="one all-reduce of every gradient")
    ax.axhline(0, color="k", lw=0.5)
    for p, x in zip(pts, xs):
        ax.annotate(f"{p[2]}", (x, 0.97), xycoords=("data", "axes fraction"), ha="center", va="top", fontsize=8)
    ax.set_xscale("log")
    ax.set_xticks(xs, ["per tensor" if p[1] == 0 else f"{p[1]:g}" for p in pts])
    ax.minorticks_off()
    ax.set_ylim(top=1.12 * ax.get_ylim()[1])
    ax.set(xlabel="bucket size (MiB); the numbers at the top: how many buckets", ylabel="ms per step", title=title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig


def plot_ddp(result):
    """The paired throughput ratio ours/DDP of every round, per bucket size."""
    fig, ax = _plt().subplots(figsize=(6, 3.2))
    ax.boxplot([r["paired"] for r in result["ratios"].values()])
    ax.set_xticks(range(1, len(result["ratios"]) + 1),
                  [f"bucket {mb} MiB\n{r['n']} rounds" for mb, r in result["ratios"].items()])
    ax.axhline(1.0, color="#c44e52", ls="--", lw=1, label="1 = as fast as DDP")
    ax.set(ylabel="ours / DDP throughput, per round", title="ours against DDP, paired rounds (box: quartiles)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_accumulate(result, n):
    """Bytes per step, and exposed time per step (paired, median and quartiles), on this machine and emulated."""
    rows = result["rows"][1:]
    names = [r["name"].replace(", emulated", "\n(emulated)").replace(" every ", " every\n") for r in rows]
    colors = ["#55a868" if "no_sync" in r["name"] else "#c44e52" for r in rows]
    fig, (ax1, ax2) = _plt().subplots(1, 2, figsize=(11, 3.4))
    ax1.bar(names, [r["bytes_sent_per_rank"] / MiB for r in rows], color=colors)
    ax1.set(ylabel="MiB sent per rank per step", title=f"{result['k']} micro-batches per step, {n} ranks")
    med = [1e3 * r["exposed"][0] for r in rows]
    err = [[m - 1e3 * r["exposed"][1] for m, r in zip(med, rows)],
           [1e3 * r["exposed"][2] - m for m, r in zip(med, rows)]]
    ax2.bar(names, med, color=colors, capsize=4, yerr=err, label="step − compute only (paired; quartiles)")
    ax2.plot(names, [1e3 * r["phases"]["link_wait"] for r in rows], "kD", ms=6, label="wait after backward (per step)")
    ax2.axhline(0, color="k", lw=0.8)
    ax2.legend(fontsize=8, loc="upper left")
    ax2.set(ylabel="ms per step", title=f"what it costs; (emulated): over an {result['link']['label']}")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    return fig


def plot_scaling(runs):
    """tokens/s against dp (runs: {dp: scaling_dp<dp>.json's content}), with both ideals."""
    dps = sorted(runs)
    tps = [runs[d]["results"]["tokens_per_s"] for d in dps]
    fig, ax = _plt().subplots(figsize=(7, 3.4))
    ax.plot(dps, tps, "o-", label="measured (median step)")
    ax.plot(dps, [tps[0] * d for d in dps], "k--", lw=1, label="ideal with one device per rank (× dp)")
    ax.plot(dps, [tps[0]] * len(dps), ":", color="gray", label=f"ideal on {runs[dps[0]]['results']['cores']} cores")
    ax.set(xlabel="dp (processes)", ylabel="tokens/s (all ranks)", xticks=dps,
           title="weak scaling: same micro-batch per rank")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


PARTS = ("params", "grads", "optimizer", "activations")


def plot_memory(runs):
    """Bytes per rank by category, every rank of each dp, and (hatched) what ZeRO-1/2/3 would keep per rank at the
    largest dp (docs/reference.md#zero-memory-and-communication-per-rank)."""
    bars = {f"dp={d}\nrank {r}": m for d in sorted(runs) for r, m in enumerate(runs[d]["results"]["mem_by_rank"])}
    dmax = max(runs)
    m = runs[dmax]["results"]["mem_by_rank"][0]
    for stage in (1, 2, 3):  # ZeRO-k divides the optimizer state, then the gradients, then the parameters
        bars[f"ZeRO-{stage}\ndp={dmax}\n(formula)"] = {k: m[k] / (dmax if k in PARTS[3 - stage:3] else 1)
                                                       for k in PARTS}
    fig, ax = _plt().subplots(figsize=(max(7, 0.75 * len(bars)), 3.6))
    for j, (label, mem) in enumerate(bars.items()):
        heights = [mem[k] / MiB for k in PARTS]
        ax.bar([j] * 4, heights, bottom=[sum(heights[:i]) for i in range(4)], edgecolor="white",
               color=("#4c72b0", "#dd8452", "#55a868", "#c44e52"), hatch="//" if "formula" in label else None,
               label=list(PARTS) if j == 0 else None)
    ax.set_xticks(range(len(bars)), list(bars), fontsize=8)
    ax.set(ylabel="MiB per rank", title="what each rank holds: data parallelism replicates all model states")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def plot_model_timeline(grad_bytes, backward_s, bucket_mb, latency_s, busbw, n=2, title=""):
    """The widget's figure: the modelled backward and its buckets' all-reduces; exposed time against bucket size."""
    plt = _plt()
    buckets, exposed = model_timeline(grad_bytes, backward_s, bucket_mb * MiB, latency_s, busbw, n)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.2), gridspec_kw=dict(width_ratios=[3, 2]))
    ax1.broken_barh([(0, 1e3 * backward_s)], (0.65, 0.7), color=COLORS["backward"])
    for k, (ready, start, end, _) in enumerate(buckets):
        ax1.broken_barh([(1e3 * start, 1e3 * (end - start))], (1.65, 0.7), color=plt.cm.tab20(k % 20),
                        edgecolor="k", lw=0.3)
        ax1.plot([1e3 * ready] * 2, [1.35, 1.65], color="gray", lw=0.5)
    ax1.axvspan(1e3 * backward_s, 1e3 * (backward_s + exposed), color=COLORS["wait"], alpha=0.25)
    ax1.set_yticks([1, 2], ["backward", "all-reduce"])
    ax1.set_ylim(2.6, 0.4)
    ax1.set(xlabel="ms", title=f"{len(buckets)} bucket(s): exposed {1e3 * exposed:.2f} ms "
                               f"({100 * exposed / backward_s:.0f}% of backward){title}")
    sizes = [0] + [2.0**k for k in range(-4, 9)]
    xs = [max(mb, 2**-5) for mb in sizes]
    ax2.semilogx(xs, [1e3 * model_timeline(grad_bytes, backward_s, mb * MiB, latency_s, busbw, n)[1] for mb in sizes],
                 "o-", ms=3)
    ax2.semilogx([max(bucket_mb, 2**-5)], [1e3 * exposed], "o", color=COLORS["wait"], ms=8)
    ax2.axhline(1e3 * (latency_s + 2 * (n - 1) / n * sum(grad_bytes) / busbw), color="k", ls=":", lw=1,
                label="one all-reduce of everything")
    ax2.set(xlabel="bucket MiB (leftmost: one per tensor)", ylabel="exposed ms", title="exposed communication")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig


plot_parity = functools.partial(_plots.plot_parity, what="dp ranks")  # for the notebook


def main(argv=None):
    global OUT
    _, names, OUT = _common.cli("03_data_parallel", EXPERIMENTS, __doc__, argv=argv, namespace=ARGS, extra=[
        (["--steps"], dict(type=int, help="timed steps (rounds) per variant of the timed experiments")),
        (["--link"], dict(help="BANDWIDTH,LATENCY (bytes/s, s) of the emulated link (default: chosen from backward)"))])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = Mesh.init(dp=world, device=_common.experiment_device("03_data_parallel"))
    with mesh:  # on success every rank meets at a barrier before the groups go (Mesh.destroy)
        st = settings(ARGS.fast, mesh)
        mc = make_cfg(st["size"]).model_config()
        env = _common.environment(mesh, fast=ARGS.fast, size=st["size"], num_params=mc.num_params(),
                                  grad_bytes=4 * mc.num_params(), grad_tensor_bytes=grad_tensor_bytes(mc),
                                  seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"])
        _common.run_experiments(
            names, lambda name: globals()[f"exp_{name}"](mesh, ARGS.fast),
            lambda name: OUT / (f"{name}_dp{world}.json" if name == "scaling" else f"{name}.json"), env, mesh.rank,
            skip=lambda name: "needs at least 2 processes (torchrun --nproc_per_node 2)" if world == 1 and name != "scaling" else None)


if __name__ == "__main__":
    main()
