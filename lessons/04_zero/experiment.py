"""Lesson 04, the experiment: ZeRO, measured. The notebook launches it with torchrun; each experiment writes
OUT/<name>.json (`stages` and `parity`: OUT/<name>_dp<N>.json) from rank 0:

    stages       DP (lesson 03's buckets) and ZeRO-1/2/3, one step of each in turn: what every rank keeps and the
                 bytes per step of each kind of collective (a metrics.Recorder on the axes), with the formulas
    timeline     ZeRO-3 with and without prefetch, every rank's events: on gloo, then over an emulated link
    fsdp         our ZeRO-3 against torch's FSDP2, steps alternating; fsdp_memory (one process): each alone
    parity       picotron.train --zero 0..3 at dp = world size; with one process, the one-process references
    pipeline     ZeRO-1/2/3 on a pp = 2 pipeline (dp = world size / 2, 1F1B): the bytes of each collective per step
                 on every rank, with ZeRO-3's layers kept gathered over the step or freed after every use
    hsdp         HSDP at dp = world size: ZeRO-1 and ZeRO-3 with every shard size dp_shard dividing dp, the bytes of each
                 step on the shard link and on the replicate link counted apart on every rank, with the formula
                 (planner.hsdp_bytes_per_step), the losses, what each rank keeps, and the NCCL replay of one run
    muon         ZeRO-1 at dp = world size with --optimizer muon (gather and owner) and AdamW: the bytes of Muon's
                 exchange per rank against planner.muon_bytes_per_step, the optimizer step's time split into
                 Newton–Schulz and the rest, and the losses

    PICOTRON_FAST=1 torchrun --nproc_per_node 2 lessons/04_zero/experiment.py --only stages,timeline

Variants are built as picotron.train builds a run (`parallelize`) and step as it steps; timed variants run in one
process group, one step of each in turn, a barrier before each; a step's time is the slowest rank's.
"""
import dataclasses
import os
from contextlib import nullcontext
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/
import _common  # noqa: E402  (puts the repository root on sys.path)
from _common import gather, make_cfg, run_interleaved, tokens, union_length  # noqa: E402
import _plots  # noqa: E402  (figure helpers several lessons share)
from _plots import stacked_bar  # noqa: E402

import torch.distributed as dist  # noqa: E402

from picotron import data, hooks, link as link_mod, marks, metrics, nccl_rules, planner, zero3  # noqa: E402
from picotron import train as trainer  # noqa: E402
from picotron.mesh import Axis, Mesh  # noqa: E402
from picotron.parallelize import build_model, parallelize  # noqa: E402

MiB = 2**20
BUCKET_MB = 4.0  # stages 0-2: ~4 MiB buckets, so the small model (12.5 MiB of fp32 parameters) makes a few units
STAGE_NAMES = {0: "DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
PARTS = ("params", "grads", "optimizer")
PART_COLORS = dict(params="#4c72b0", grads="#dd8452", optimizer="#55a868")
LINK_RATIO = 0.8  # the emulated link: a layer's all-gather takes this fraction of the layer's measured forward
LINK_LATENCY = 1e-4


def settings(fast, mesh=None):
    """Model, tokens per rank (the timeline's `tl_*`: enough compute per layer to hide a transfer behind), steps; on
    GPUs _common.GPU_SETTINGS["04_zero"] on top (the mesh's device decides, else _common.device())."""
    st = dict(size="small", seq_len=64, micro_batch_size=2,
              tl_seq_len=128, tl_micro_batch_size=8, steps=3 if fast else 20, tl_steps=5 if fast else 12,
              warmup=1 if fast else 2, fsdp_steps=8 if fast else 60, parity_steps=10 if fast else 20,
              pp_micro_batches=4 if fast else 8, hsdp_steps=3 if fast else 10,
              muon_steps=3 if fast else 12)
    return _common.sized("04_zero", st, fast, mesh.device.type if mesh else None)


class Variant:
    """Stage 0 (bucketed DataParallel), 1, 2 or 3 on its own copy of the model, built by `parallelize` with a
    Recorder on its axes: it counts every collective's bytes and, with `timeline`, times each one and listens to
    ZeRO-3's phases (each layer's forward and backward)."""

    def __init__(self, name, stage, cfg, mesh, prefetch=True, timeline=False):
        self.name, self.stage, self.mesh = name, stage, mesh
        self.cfg = cfg = dataclasses.replace(cfg, zero=stage, dp_impl="bucket", bucket_mb=BUCKET_MB)
        self.timeline = metrics.Timeline(mesh.device, mesh.rank, enabled=timeline)
        self.recorder = metrics.Recorder(self.timeline if timeline else None)
        run = parallelize(cfg, mesh, recorder=self.recorder)
        self.model, self.optimizer, self.schedule, self.loss_fn, self.params = \
            run.model, run.optimizer, run.schedule, run.loss_fn, run.params
        self.model.prefetch = prefetch  # ZeRO-3's option (off: a layer is gathered only when it computes)
        if timeline:
            hooks.watch(self.model, listener=self.recorder.phase)
        self.activations = metrics.ActivationPeak(self.model)  # what autograd keeps, as the trainer counts it
        self.schedule.phases.listen(self.activations)
        if timeline:
            self.schedule.phases.listen(self.timeline.record)  # each micro-batch's forward and backward, the wait
        self.psi = run.raw.config.num_params()
        self.recorder.reset()  # DataParallel's start-up broadcast is no step's traffic
        self.loader = data.DataLoader(tokens(), seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size,
                                      grad_acc=cfg.grad_acc, dp_size=mesh.dp.size, dp_rank=mesh.dp.rank, seed=cfg.seed)
        self.times, self.step_starts, self.steps_run, self.mem = [], [], 0, None

    def step(self, step, record=True):
        """One optimizer step as picotron.train takes it; its time, and what the rank keeps (`self.mem`)."""
        batches = self.loader.micro_batches(step)
        metrics.sync(self.mesh.device)
        t0 = time.perf_counter()
        if record:
            self.step_starts.append(self.timeline.now())
        self.schedule.run(self.model, batches, self.loss_fn)  # forward, backward, the gradient sync
        marks.clip_grad_norm(self.params, self.cfg.grad_clip, self.mesh)
        mem = self.model.memory()  # after the gradient sync, before the step: the gradients are still there
        with self.timeline.record("optimizer", kind="compute"):
            self.optimizer.step()  # ZeRO-1/2: ends with the all-gather of every rank's updated chunk
        self.model.zero_grad(set_to_none=True)
        metrics.sync(self.mesh.device)
        self.steps_run += 1
        if record:
            self.times.append(time.perf_counter() - t0)
        self.mem = dict(mem, optimizer=metrics.optimizer_bytes(self.optimizer),
                        activations=self.activations.bytes)

    def stats(self):
        """Step times (each the slowest rank's) with their median and quartiles."""
        t = [max(ts) for ts in zip(*gather(self.times, self.mesh))]
        q = statistics.quantiles(t, n=4) if len(t) > 1 else t * 3
        return dict(step_times=t, median=statistics.median(t), q1=q[0], q3=q[-1])


def units_layout(model):
    """The flat view of every unit: numel, chunk, padded, and where each parameter starts (for the picture)."""
    names = {p: n for n, p in model.module.named_parameters()}
    return [dict(name=u.name, numel=u.numel, chunk=u.chunk, padded=u.padded,
                 params=[(names[p], off, p.numel()) for p, off in zip(u.params, u.offsets)]) for u in model.units]


def flat_layout(n, size="small"):
    """ZeRO-3's units of the lesson's model at dp = n, as rank 0 would cut them: built in this process on an axis
    without a process group (building a Zero3 runs no collective)."""
    cfg = make_cfg(size)
    return units_layout(zero3.Zero3(build_model(cfg, Mesh.local()), Axis.alone("dp", n, 0)))


# --------------------------------------------------------------------------------------------- experiments
def counts():
    """The dp of the stage comparison and the parity runs: 2 and 4, and 8 with PICOTRON_NPROC=8 (one GPU node)."""
    return (2, 4) if _common.nproc("04_zero", 4) == 4 else (2, 4, 8)


def stages_config(n, st):
    """The Config the stage comparison builds its four variants from (Variant sets zero, dp_impl and bucket_mb)."""
    return make_cfg(st["size"], seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"], dp=n)


def parity_configs(n, st, out):
    """{name: Config} of the parity runs at dp = n: ZeRO-0..3 with 2 micro-batches per step; with n = 1 the
    references with the same global batch (grad_acc = 2·dp) for every dp of counts()."""
    common = dict(steps=st["parity_steps"], seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"],
                  warmup_steps=2, log_every=st["parity_steps"], lr=3e-3, bucket_mb=BUCKET_MB)
    runs = {f"reference_acc{2 * dp}": dict(grad_acc=2 * dp) for dp in counts()} if n == 1 else \
        {stage: dict(dp=n, zero=stage, grad_acc=2) for stage in range(4)}
    return {key: make_cfg(st["size"], out=str(Path(out) / f"parity_dp{n}_{key}"), **common, **kw)
            for key, kw in runs.items()}


def configs_at(nproc, fast=False):
    """The Configs the lesson's main experiments train on `nproc` processes: the stage comparison's four (as Variant
    builds them) and the parity runs (tests/test_lesson_node.py validates them at world size 8)."""
    st = settings(fast)
    base = stages_config(nproc, st)
    stages = [dataclasses.replace(base, zero=s, dp_impl="bucket", bucket_mb=BUCKET_MB) for s in range(4)]
    return stages + list(parity_configs(nproc, st, _common.run_dir("04_zero")).values())


def exp_stages(mesh, st, out):
    """Every stage, one step of each in turn: the model states each rank keeps and the bytes per step."""
    cfg = stages_config(mesh.dp.size, st)
    variants = [Variant(STAGE_NAMES[s], s, cfg, mesh) for s in range(4)]
    run_interleaved(variants, st["steps"], st["warmup"], mesh.dp_cp.group)
    rows = []
    for v in variants:
        root = v.model.units[0].numel if v.stage == 3 else 0
        row = dict(stage=v.stage, name=v.name, psi=v.psi, mem_by_rank=gather(v.mem, mesh),
                   formula=planner.zero_model_state_bytes(v.psi, v.stage, mesh.dp_cp.size, recipe="ours"),
                   bytes_per_step={k: b / v.steps_run for k, b in v.recorder.bytes.items()},
                   predicted_elements=planner.zero_comm_elements(v.psi, v.stage, root), **v.stats())
        if v.stage:
            row["units"] = units_layout(v.model)
        rows.append(row)
    return dict(n=mesh.dp_cp.size, rows=rows)


def overlap_stats(row):
    """Median over the ranks' recorded steps: how many layer all-gathers per step, how long they ran (`gather_s`,
    overlaps counted once), how much of that ran while a layer computed on the same rank (`hidden_s`)."""
    per = []
    for r, events in enumerate(row["events"]):
        starts = row["step_starts"][r] + [float("inf")]
        for i in range(len(starts) - 1):
            ev = [e for e in events if starts[i] <= e["start"] < starts[i + 1]]
            compute = [(e["start"], e["end"]) for e in ev if e.get("kind") == "compute"]
            gathers = [(e["start"], e["end"]) for e in ev if e["name"].startswith("all-gather layer")]
            hidden = union_length([(max(a, c), min(b, d)) for a, b in gathers for c, d in compute
                                   if max(a, c) < min(b, d)])
            per.append(dict(n_gathers=len(gathers), gather_s=union_length(gathers), hidden_s=hidden))
    med = {k: statistics.median(p[k] for p in per) for k in per[0]}
    med["hidden_fraction"] = med["hidden_s"] / med["gather_s"] if med["gather_s"] else 0.0
    med["exposed_gather_s"] = med["gather_s"] - med["hidden_s"]
    return med


def timeline_rows(mesh, st, cfg):
    """ZeRO-3 with and without prefetch on `mesh`, interleaved: every rank's events and step times."""
    variants = [Variant("prefetch", 3, cfg, mesh, timeline=True), Variant("no prefetch", 3, cfg, mesh, False, True)]
    dist.barrier()
    for v in variants:  # one common origin, right after a barrier: the ranks' timelines are comparable
        v.timeline.t0 = time.perf_counter()
    busy = run_interleaved(variants, st["tl_steps"], st["warmup"], mesh.dp_cp.group)
    rows = []
    for v in variants:
        row = dict(name=v.name, prefetch=v.model.prefetch, events=gather(v.timeline.events, mesh), busy=busy,
                   step_starts=gather(v.step_starts, mesh), n_layers=len(v.model.units) - 1, **v.stats())
        rows.append(dict(row, overlap=overlap_stats(row)))
    return rows


def prefetch_gain(rows):
    """{prefetch, no prefetch} rows -> what prefetch took off the critical path (`moved`: the layer all-gathers'
    time outside compute, less) and what the step gained, in seconds: `gain` between the fastest steps (a shared
    machine's other load only ever adds time), `paired` the median over the paired rounds."""
    on, off = rows
    return dict(moved=off["overlap"]["exposed_gather_s"] - on["overlap"]["exposed_gather_s"], n=len(on["step_times"]),
                gain=min(off["step_times"]) - min(on["step_times"]),
                paired=statistics.median(b - a for a, b in zip(on["step_times"], off["step_times"])))


def exp_timeline(mesh, st, out):
    """ZeRO-3's timeline with and without prefetch on gloo; then over an emulated link whose all-gather of one
    layer takes LINK_RATIO of the layer's forward as measured in the gloo run."""
    cfg = make_cfg(st["size"], seq_len=st["tl_seq_len"], micro_batch_size=st["tl_micro_batch_size"], dp=mesh.dp.size)
    rows = timeline_rows(mesh, st, cfg)
    forwards = [e["end"] - e["start"] for ev in rows[0]["events"] for e in ev if e["name"].startswith("forward layer")]
    t_forward = statistics.median(forwards)
    n, layer_bytes = mesh.dp_cp.size, 4 * flat_layout(mesh.dp_cp.size, st["size"])[1]["padded"]  # fp32, padded
    wire = link_mod.TRAFFIC["all_gather_into_tensor"](n) * layer_bytes
    bandwidth = float(f"{wire / (LINK_RATIO * t_forward - LINK_LATENCY):.2g}")
    link = link_mod.EmulatedLink(bandwidth, LINK_LATENCY)
    return dict(rows=rows, link_rows=timeline_rows(mesh.over(link), st, cfg),
                link=dict(label=link.label(), layer_bytes=layer_bytes, t_forward=t_forward,
                          t_gather=link.seconds("all_gather_into_tensor", layer_bytes, n)))


def exp_fsdp(mesh, st, out):
    """Ours vs FSDP2, one step of each in turn; the per-round throughput ratio (FSDP2's time / ours)."""
    from benchmarks import zero_vs_fsdp as bench  # the repository root is on sys.path (_common)

    cfg = bench.make_cfg(st["size"], seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"], dp=mesh.dp.size)
    rows = bench.compare(cfg, mesh, st["fsdp_steps"], warmup=st["warmup"] + 1)
    med, q1, q3 = bench.paired(rows)
    return dict(rows=rows, ratio=dict(median=med, q1=q1, q3=q3, n=len(rows[0]["step_times"])))


def exp_fsdp_memory(mesh, st, out):
    """(One process.) Each of ours and FSDP2 alone on 2 fresh ranks: peak memory above the pre-model baseline."""
    from benchmarks import zero_vs_fsdp as bench

    steps = 3 if st["steps"] < 10 else 5
    return dict(steps=steps, memory=bench.memory_main(st["size"], st["seq_len"], st["micro_batch_size"], 2, steps))


def exp_parity(mesh, st, out):
    """picotron.train with --zero 0..3 at dp = world size, 2 micro-batches per step; with one process, the
    references with the same global batch (grad_acc = 2·dp) for dp = 2 and 4 (and 8: counts())."""
    n = mesh.dp_cp.size
    losses = {}
    for key, cfg in parity_configs(n, st, out).items():
        trainer.train(cfg, mesh)
        if mesh.rank == 0:
            losses[key] = [r["loss"] for r in metrics.read_metrics(cfg.out)[0]]
    return dict(dp=n, losses=losses)


# ---------------------------------------------------------------------------------------- ZeRO with a pipeline
PP_LAYERS = 8  # 4 per stage: enough for ZeRO-3's freed layers to make a difference next to the 2 in flight
PP_VARIANTS = (("ZeRO-1", 1, False), ("ZeRO-2", 2, False), ("ZeRO-3 kept", 3, False), ("ZeRO-3 resharded", 3, True))


def pp_zero_elements(stage, units, m, reshard=False):
    """What one pipeline rank's ZeRO collectives cover per step, in elements (whole buffers, as the Recorder counts),
    from its units [(padded elements, is a layer)] and the m micro-batches: every gradient reduce-scattered once,
    at its chunk's last backward; the parameters all-gathered once per step (ZeRO-1/2 after the optimizer step,
    ZeRO-3 kept at their first use), or, ZeRO-3 resharded, each layer before each F and each B (the roots once)."""
    total = sum(n for n, _ in units)
    layers = sum(n for n, layer in units if layer)
    gathered = total - layers + 2 * m * layers if stage == 3 and reshard else total
    return {"all_gather": gathered, "reduce_scatter": total}


def exp_pipeline(mesh, st, out):
    """ZeRO-1/2/3 on a pp = 2 pipeline (1F1B, m micro-batches, dp = world / 2), each variant built by `parallelize`
    with a Recorder on the axes: per rank, the bytes per step of the second step (the first one's are the same) and
    the peak of the full buffers ZeRO held during it (`zero_transient_peak`: gathered parameters, whole gradients)."""
    m = st["pp_micro_batches"]
    cfg = make_cfg(st["size"], seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"], dp=mesh.dp.size, pp=2,
                   grad_acc=m, pp_schedule="1f1b", bucket_mb=BUCKET_MB, num_hidden_layers=PP_LAYERS)
    loader = data.DataLoader(tokens(), seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size, grad_acc=m,
                             dp_size=mesh.dp.size, dp_rank=mesh.dp.rank, seed=cfg.seed)
    rows = []
    for name, stage, reshard in PP_VARIANTS:
        recorder = metrics.Recorder()
        run = parallelize(dataclasses.replace(cfg, zero=stage), mesh, recorder=recorder)
        if stage == 3:
            run.model.reshard_after_forward = reshard  # parallelize keeps them (False) under a pipeline
        for step in range(2):
            recorder.reset()  # what the second step sent
            run.model.memory()  # (resets the transient peak)
            run.schedule.run(run.model, loader.micro_batches(step), run.loss_fn)
            marks.clip_grad_norm(run.params, cfg.grad_clip, mesh)
            mem = run.model.memory()
            run.optimizer.step()
            run.model.zero_grad(set_to_none=True)
        units = [(u.padded, bool(getattr(u, "layer", False))) for u in run.model.units]
        mine = dict(pp_rank=mesh.pp.rank, units=units, psi=sum(u.numel for u in run.model.units),
                    bytes={k: recorder.bytes.get(k, 0) for k in ("all_gather", "reduce_scatter")},
                    calls={k: recorder.calls.get(k, 0) for k in ("all_gather", "reduce_scatter")},
                    predicted=pp_zero_elements(stage, units, m, reshard), mem=mem)
        rows.append(dict(name=name, stage=stage, reshard=reshard, by_rank=gather(mine, mesh)))
    return dict(m=m, dp=mesh.dp.size, pp=2, rows=rows)


def plot_pipeline(res):
    """Per variant, pipeline rank 0 and 1 side by side: the bytes per step of each collective (left) and the full
    buffers ZeRO held at the peak of the step (right), both over 4Ψ_stage; the formula as black lines."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for j, row in enumerate(res["rows"]):
        for i in range(res["pp"]):  # the first dp rank of each stage (the others hold as much)
            r = next(x for x in row["by_rank"] if x["pp_rank"] == i)
            x, norm = j + (i - 0.5) * 0.38, 4 * r["psi"]
            parts = {k.replace("_", "-"): b / norm for k, b in r["bytes"].items()}
            stacked_bar(ax1, x, parts, COMM_COLORS, 0.34, label=j == 0 and i == 0)
            ax1.plot([x - 0.17, x + 0.17], [sum(r["predicted"].values()) / r["psi"]] * 2, "k-", lw=2,
                     label="formula" if j == 0 and i == 0 else None)
            ax2.bar(x, r["mem"]["zero_transient_peak"] / norm, 0.34, color=["#4c72b0", "#55a868"][i],
                    label=f"pipeline rank {i}" if j == 0 else None)
    for ax, ylabel in ((ax1, "bytes per step / 4Ψ_stage"), (ax2, "whole buffers at the peak / 4Ψ_stage")):
        ax.set_xticks(range(len(res["rows"])), [row["name"] for row in res["rows"]], fontsize=8)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8, frameon=False)
    ax1.set_title(f"ZeRO traffic, pp=2 x dp={res['dp']}, m={res['m']} micro-batches")
    ax2.set_title("held whole during the step, beyond the states kept\n(ZeRO-1 keeps whole gradients always)",
                  fontsize=9)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------------------- HSDP
HSDP_STAGES = (1, 3)
SHARD_AXES = {"dp_shard": "shard", "dp_cp": "shard", "dp_replicate": "replicate"}  # (no HSDP: ZeRO's axis is dp_cp)


def link_bytes(log, n_shard, n_replicate):
    """From a Recorder's log of one step [(kind, whole-buffer bytes, axis)]: {"shard" | "replicate": {kind: bytes}}
    (the buffers, what the formula's "buffers" say) and the bytes a rank SENDS on each link by the ring's share:
    (n-1)/n of a reduce-scatter's or all-gather's buffer, 2(n-1)/n of an all-reduce's."""
    buffers, sent = {"shard": {}, "replicate": {}}, {"shard": 0.0, "replicate": 0.0}
    for kind, nbytes, axis in log:
        where = SHARD_AXES.get(axis)
        if where is None:
            continue
        n = n_shard if where == "shard" else n_replicate
        buffers[where][kind] = buffers[where].get(kind, 0) + nbytes
        sent[where] += (2 if kind == "all_reduce" else 1) * (n - 1) / n * nbytes
    return buffers, sent


def exp_hsdp(mesh, st, out):
    """HSDP at dp = world size (pp = cp = tp = 1): for ZeRO-1 and ZeRO-3 and every dp_shard dividing dp (1: every rank a
    group of its own, i.e. data parallelism's all-reduce; dp: one group, plain ZeRO), a mesh with those shard and
    replicate groups (Mesh.init(dp=..., dp_shard=...)), `hsdp_steps` steps built by `parallelize` with a Recorder on
    the axes. Per rank: the last step's bytes on each link and the formula's (from its units, padded), the losses,
    what it keeps. The 2 x 2 ZeRO-3 run is also recorded and replayed under NCCL's rules."""
    world = mesh.world_size
    cfg = make_cfg(st["size"], seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"], dp=world,
                   bucket_mb=BUCKET_MB)
    loader = data.DataLoader(tokens(), seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size, grad_acc=1,
                             dp_size=world, dp_rank=mesh.dp.rank, seed=cfg.seed)
    rows, replay = [], None
    for stage in HSDP_STAGES:
        for ds in (k for k in range(1, world + 1) if world % k == 0):
            with Mesh.init(dp=world, dp_shard=ds) as sub:
                recorder = metrics.Recorder()
                run = parallelize(dataclasses.replace(cfg, zero=stage, dp_shard=ds), sub, recorder=recorder)
                traced = stage == 3 and 1 < ds < world and replay is None
                losses = []
                with nccl_rules.Recorder() if traced else nullcontext() as rec:
                    for step in range(st["hsdp_steps"]):
                        recorder.reset()  # what the last step sent
                        losses.append(float(run.schedule.run(run.model, loader.micro_batches(step), run.loss_fn)))
                        marks.clip_grad_norm(run.params, cfg.grad_clip, sub)
                        mem = run.model.memory()
                        run.optimizer.step()
                        run.model.zero_grad(set_to_none=True)
                if traced:
                    traces = gather(rec.trace, sub)
                    replay = dict(dp_shard=ds, stage=stage, per_communicator=str(nccl_rules.replay(
                        traces, order="per-communicator")), one_order=str(nccl_rules.replay(traces)),
                        ok=nccl_rules.replay(traces).ok)
                units = run.model.units
                psi = sum(u.padded for u in units)
                root = sum(u.padded for u in units if not u.layer) if stage == 3 else 0
                formula = planner.hsdp_bytes_per_step(psi, stage, sub.dp_shard.size, sub.dp_replicate.size, root)
                buffers, sent = link_bytes(recorder.log, sub.dp_shard.size, sub.dp_replicate.size)
                mine = dict(buffers=buffers, sent=sent, formula=formula, psi=sum(u.numel for u in units),
                            mem=dict(mem, optimizer=metrics.optimizer_bytes(run.optimizer)),
                            groups=dict(shard=sub.dp_shard.ranks, replicate=sub.dp_replicate.ranks))
                rows.append(dict(stage=stage, dp_shard=ds, n_shard=sub.dp_shard.size,
                                 n_replicate=sub.dp_replicate.size, losses=losses, by_rank=gather(mine, sub)))
    return dict(dp=world, rows=rows, replay=replay)


def plot_hsdp(res):
    """Per ZeRO stage, against dp_shard: the bytes one rank sends per step on the shard link (within a group: a node)
    and on the replicate link (across groups: the network), measured on rank 0, in units of the fp32 parameters'
    4Ψ; the formula (planner.hsdp_bytes_per_step) as black markers."""
    plt = _plt()
    stages = sorted({r["stage"] for r in res["rows"]})
    fig, axes = plt.subplots(1, len(stages), figsize=(5.2 * len(stages), 3.8), sharey=True)
    colors = {"shard": "#4c72b0", "replicate": "#c44e52"}
    for ax, stage in zip(axes, stages):
        rows = [r for r in res["rows"] if r["stage"] == stage]
        for j, row in enumerate(rows):
            r = row["by_rank"][0]
            norm = 4 * r["psi"]
            for i, where in enumerate(("shard", "replicate")):
                x = j + (i - 0.5) * 0.36
                ax.bar(x, r["sent"][where] / norm, 0.34, color=colors[where],
                       label=(f"{where} link ({'within' if where == 'shard' else 'across'} groups), measured"
                              if j == 0 else None))
                ax.plot(x, r["formula"]["dp_" + where] / norm, "k_", ms=22, mew=2.5,
                        label="formula" if j == 0 and i == 0 else None)
        ax.set_xticks(range(len(rows)), [f"dp_shard={r['dp_shard']}\n({r['n_replicate']} replica"
                                         f"{'s' if r['n_replicate'] > 1 else ''})" for r in rows], fontsize=8)
        ax.set_title(f"ZeRO-{stage} at dp={res['dp']}: bytes per rank per step", fontsize=10)
        ax.legend(fontsize=7, frameon=False)
    axes[0].set_ylabel("bytes sent per rank / 4Ψ")
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------ Muon on ZeRO's pieces
MUON_RUNS = (("adamw", "gather"), ("muon", "gather"), ("muon", "owner"))


def muon_units(run):
    """The formula's inputs from a built run: each ZeRO unit's (elements, a Muon matrix?, cut over tp?) per parameter."""
    ex = run.optimizer.optimizer.exchange
    return [[(p.numel(), id(p) in ex.muon_ids, ex._tp_cut(p)) for p in u.params] for u in run.model.units]


def exp_muon(mesh, st, out):
    """ZeRO-1 at dp = world size, `muon_steps` steps each of AdamW, Muon (gather) and Muon (owner), on the same batches.
    Each Muon step: the inner optimizer's step (momentum, the exchange, Newton–Schulz, the update) timed apart from
    ZeRO's own all-gather of the updated chunks, with the time inside Newton–Schulz summed (muon.muon_update wrapped);
    a Recorder counts the exchange's collectives. Per rank: bytes, the formula's, the Newton–Schulz FLOPs it ran."""
    from picotron import muon
    world = mesh.world_size
    loader = data.DataLoader(tokens(), seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"], grad_acc=1,
                             dp_size=world, dp_rank=mesh.dp.rank, seed=0)
    plain, ns = muon.muon_update, {"s": 0.0, "flops": 0}

    def timed(u, steps=5):
        t = time.perf_counter()
        o = plain(u, steps)
        ns["s"] += time.perf_counter() - t
        ns["flops"] += planner.muon_ns_flops(u.shape, steps)
        return o
    rows = []
    muon.muon_update = timed
    try:
        for optimizer, impl in MUON_RUNS:
            cfg = make_cfg(st["size"], seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"], dp=world,
                           zero=1, bucket_mb=BUCKET_MB, optimizer=optimizer, muon_impl=impl, lr=3e-3, warmup_steps=0)
            recorder = metrics.Recorder()
            run = parallelize(cfg, mesh, recorder=recorder)
            losses, steps = [], []
            for step in range(st["muon_steps"]):
                losses.append(float(run.schedule.run(run.model, loader.micro_batches(step), run.loss_fn)))
                marks.clip_grad_norm(run.params, cfg.grad_clip, mesh)
                recorder.reset()
                ns.update(s=0.0, flops=0)
                dist.barrier()
                t0 = time.perf_counter()
                run.optimizer.optimizer.step()  # Muon (or AdamW) on this rank's chunk: the exchange is in here
                t1 = time.perf_counter()
                exchanged = dict(recorder.bytes)
                run.optimizer.zero.gather_updated_params()  # ZeRO-1's own all-gather of the updated chunks
                t2 = time.perf_counter()
                run.model.zero_grad(set_to_none=True)
                steps.append(dict(optimizer_s=t1 - t0, ns_s=ns["s"], gather_s=t2 - t1, ns_flops=ns["flops"],
                                  bytes=exchanged))
            mine = dict(steps=steps)
            if optimizer == "muon":
                rank = run.model.units[0].axis.rank
                mine["formula"] = planner.muon_bytes_per_step(impl, muon_units(run), n=world, rank=rank)
                ex = run.optimizer.optimizer.exchange
                sizes = [p.numel() for p in ex.matrices]
                owner = planner.owner_of(sizes, world)
                every = sum(planner.muon_ns_flops(p.shape) for p in ex.matrices)
                mine["ns_flops_formula"] = every if impl == "gather" else \
                    sum(planner.muon_ns_flops(p.shape) for p, o in zip(ex.matrices, owner) if o == rank)
                mine["psi_muon"] = sum(sizes)
                mine["psi"] = sum(u.numel for u in run.model.units)
            rows.append(dict(optimizer=optimizer, impl=impl, losses=losses, by_rank=gather(mine, mesh)))
    finally:
        muon.muon_update = plain
    return dict(dp=world, rows=rows)


def plot_muon(res):
    """Left: the bytes of Muon's exchange per rank per step (measured, each rank; the formula as black markers), gather
    against owner. Middle: the optimizer step's time (median over the steps, rank 0) split into Newton–Schulz and the
    rest (collectives, copies, elementwise). Right: the losses of AdamW and Muon on the same batches."""
    plt = _plt()
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(14, 3.8))
    muons = [r for r in res["rows"] if r["optimizer"] == "muon"]
    for j, row in enumerate(muons):
        for k, r in enumerate(row["by_rank"]):
            x = j + (k - (len(row["by_rank"]) - 1) / 2) * 0.18
            a1.bar(x, sum(r["steps"][-1]["bytes"].values()) / MiB, 0.16, color=f"C{k}", label=f"rank {k}" if j == 0 else None)
            a1.plot(x, sum(r["formula"]["buffers"].values()) / MiB, "k_", ms=12, mew=2,
                    label="formula" if j == 0 and k == 0 else None)
    a1.set_xticks(range(len(muons)), [r["impl"] for r in muons])
    a1.set_ylabel("MiB per rank per step (buffers)")
    a1.set_title(f"Muon's exchange at dp={res['dp']}, ZeRO-1", fontsize=10)
    a1.legend(fontsize=7, frameon=False)
    for j, row in enumerate(res["rows"]):
        st = row["by_rank"][0]["steps"]
        opt = statistics.median(s["optimizer_s"] for s in st) * 1e3
        nsm = statistics.median(s["ns_s"] for s in st) * 1e3
        a2.bar(j, nsm, 0.6, color="#c44e52", label="Newton–Schulz" if j == 0 else None)
        a2.bar(j, max(opt - nsm, 0.0), 0.6, bottom=nsm, color="#8c8c8c", label="the rest" if j == 0 else None)
    a2.set_xticks(range(len(res["rows"])), [f"{r['optimizer']}\n{r['impl'] if r['optimizer'] == 'muon' else ''}"
                                            for r in res["rows"]])
    a2.set_ylabel("ms (rank 0, median step)")
    a2.set_title("the optimizer step's time", fontsize=10)
    a2.legend(fontsize=7, frameon=False)
    for row in res["rows"]:
        a3.plot(range(1, len(row["losses"]) + 1), row["losses"], marker="o", ms=3,
                label=row["optimizer"] + (f" ({row['impl']})" if row["optimizer"] == "muon" else ""))
    a3.set_xlabel("step")
    a3.set_ylabel("training loss")
    a3.set_title("same batches, same lr", fontsize=10)
    a3.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    return fig


EXPERIMENTS = ("stages", "timeline", "fsdp", "fsdp_memory", "parity", "pipeline", "hsdp", "muon")
ONE_PROCESS, ANY_WORLD, PER_DP = ("fsdp_memory",), ("parity",), ("stages", "parity")
PIPELINE = ("pipeline",)  # on a (world / 2) x 2 mesh of dp x pp


# ------------------------------------------------------------------------------------ the widget's model
def memory_per_gpu(n_params, n, recipe="ours"):
    """Model-state bytes per GPU for DP and ZeRO-1/2/3 over n ranks: {stage: {params, grads, optimizer, total}}."""
    return {s: dict(b, total=sum(b.values())) for s in range(4)
            for b in [planner.zero_model_state_bytes(n_params, s, n, recipe=recipe)]}


def smallest_dp_that_fits(n_params, stage, capacity_bytes, recipe="ours", n_max=4096):
    """The smallest power of two n (up to n_max) whose model states per GPU fit under `stage`, or None."""
    return next((2**k for k in range(n_max.bit_length()) if 2**k <= n_max and
                 memory_per_gpu(n_params, 2**k, recipe)[stage]["total"] <= capacity_bytes), None)


# ----------------------------------------------------------------------------- plots (for the notebook)
def _plt():
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "legend.fontsize": 8, "axes.titlesize": 9, "xtick.labelsize": 8,
                         "ytick.labelsize": 8})
    return plt


def plot_flat_units(units, n, zoom=12):
    """Top: each unit as one flat vector cut into n equal chunks (one colour per rank), parameter boundaries as
    ticks. Bottom: the last `zoom` positions of the largest unit, one cell each: the padding, hatched."""
    plt = _plt()
    fig, (ax, az) = plt.subplots(2, 1, figsize=(11, 1.6 + 0.4 * len(units)), height_ratios=[len(units), 1.6])
    colors = [plt.cm.Pastel1(r % 9) for r in range(n)]
    for j, u in enumerate(units):
        for r in range(n):
            ax.barh(j, 1 / n, left=r / n, color=colors[r], edgecolor="k", lw=0.6)
        for _, off, _ in u["params"][1:]:
            ax.plot([off / u["padded"]] * 2, [j - 0.4, j + 0.4], color="k", lw=0.5)
        ax.text(1.01, j, f"{u['numel']:,} in {len(u['params'])} tensors: {n} × {u['chunk']:,}"
                         f" − {u['padded'] - u['numel']} padding", va="center", fontsize=8)
    ax.set(yticks=range(len(units)), yticklabels=[u["name"] for u in units], xlim=(0, 1), ylim=(len(units) - 0.5, -0.5),
           xlabel="position in the unit's flat vector (fraction); thin ticks: where a parameter tensor starts")
    ax.set_title(f"ZeRO-3's units at dp={n}, rank r owns chunk r", loc="left")
    u = max(units, key=lambda u: (u["padded"] - u["numel"], u["numel"]))
    name, off, numel = u["params"][-1]
    for i in range(u["padded"] - zoom, u["padded"]):
        pad = i >= u["numel"]
        az.bar(i, 1, 1, color=colors[i // u["chunk"]], edgecolor="k", lw=0.6, hatch="////" if pad else None)
        az.text(i, 0.5, "pad" if pad else f"{i - off}", ha="center", va="center", fontsize=8)
    az.set(xlim=(u["padded"] - zoom - 0.5, u["padded"] - 0.5), yticks=[],
           xlabel=f"position in {u['name']}'s flat vector")
    az.set_title(f"zoom: the end of {u['name']} (cells: element index inside {name}), owned by rank "
                 f"{(u['padded'] - 1) // u['chunk']}", loc="left")
    az.ticklabel_format(useOffset=False, style="plain")
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, fc=c, ec="k", lw=0.6) for c in colors] +
               [plt.Rectangle((0, 0), 1, 1, fc="w", ec="k", hatch="////")],
               labels=[f"rank {r}'s chunk" for r in range(n)] + ["padding (zeros)"], loc="lower center", ncol=n + 1,
               frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def _per_dp(results, draw, ylabel, legend_loc):
    """One panel per dp of the `stages` results, a group of bars per stage drawn by draw(ax, j, row, first)."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(results), figsize=(5.3 * len(results), 3.4), sharey=True, squeeze=False)
    for ax, (n, res) in zip(axes[0], sorted(results.items())):
        for j, row in enumerate(res["rows"]):
            draw(ax, j, row, first=ax is axes[0][0] and j == 0)
        ax.set_xticks(range(len(res["rows"])), [r["name"] for r in res["rows"]])
        ax.set_title(f"dp={n}")
    axes[0][0].set_ylabel(ylabel)
    handles = dict(zip(*reversed(axes[0][0].get_legend_handles_labels())))
    fig.legend(handles.values(), handles.keys(), frameon=False, **legend_loc)
    return fig


def plot_memory(results):
    """{n: stages result}: per stage, rank 0's measured model states (left) next to the formula (right, hatched)."""
    def draw(ax, j, row, first):
        stacked_bar(ax, j - 0.2, {k: row["mem_by_rank"][0][k] / MiB for k in PARTS}, PART_COLORS, 0.38, label=first)
        top = stacked_bar(ax, j + 0.2, {k: row["formula"][k] / MiB for k in PARTS}, PART_COLORS, 0.38, "//", False)
        ax.text(j, top, f"{top:.1f}", ha="center", va="bottom", fontsize=8)
    fig = _per_dp(results, draw, "MiB per rank: measured (rank 0) | formula (hatched)", dict(loc="center right"))
    fig.tight_layout(rect=(0, 0, 0.9, 1))
    return fig


COMM_COLORS = {"all-reduce (as RS + AG)": "#8172b2", "reduce-scatter": "#dd8452", "all-gather": "#4c72b0"}


def plot_comm(results):
    """{n: stages result}: bytes per step through each collective / 4Ψ, the planner's prediction as black lines."""
    def draw(ax, j, row, first):
        parts = {("all-reduce (as RS + AG)" if k == "all_reduce" else k.replace("_", "-")):
                 b / (4 * row["psi"]) * (2 if k == "all_reduce" else 1) for k, b in row["bytes_per_step"].items()}
        top = stacked_bar(ax, j, parts, COMM_COLORS, 0.8)
        ax.plot([j - 0.35, j + 0.35], [sum(row["predicted_elements"].values()) / row["psi"]] * 2, "k-", lw=2,
                label="planner.zero_comm_elements")
        ax.text(j, top + 0.05, f"{top:.3f}", ha="center", fontsize=8)
    fig = _per_dp(results, draw, "bytes per step / 4Ψ", dict(loc="lower center", ncol=4))
    fig.axes[0].set_ylim(0, 3.4)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


LANE_COLORS = {"forward": "#4c72b0", "backward": "#55a868", "optimizer": "#8172b2", "all-gather": "#dd8452",
               "reduce-scatter": "#c44e52"}


def plot_timeline(rows, rank=0, step=-1, title=""):
    """One step of rank `rank` per variant (a panel each), three lanes: compute (each layer's forward and backward,
    the optimizer; the schedule's passes as a grey band, its final wait in pink), all-gathers, reduce-scatters."""
    plt = _plt()
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(rows), 1, figsize=(11, 1.2 + 1.5 * len(rows)), sharex=True, squeeze=False)
    xmax = 0
    for ax, row in zip(axes[:, 0], rows):
        starts = row["step_starts"][rank]
        i = step % len(starts)
        t0 = min(s[i] for s in row["step_starts"])
        t1 = starts[i + 1] if i + 1 < len(starts) else float("inf")
        events = [e for e in row["events"][rank] if starts[i] <= e["start"] < t1]
        span = 1e3 * (max(e["end"] for e in events) - t0)
        xmax = max(xmax, span)
        for e in events:
            x, w, name, kind = 1e3 * (e["start"] - t0), 1e3 * (e["end"] - e["start"]), e["name"], e.get("kind")
            if kind is None:  # the schedule's phases: forward, backward, wait
                ax.broken_barh([(x, w)], (-0.45, 0.9), color="#f3c9c9" if name == "wait" else "0.88", zorder=0)
                continue
            lane = {"compute": 0, "comm": 1 if name.startswith("all-gather") else 2}[kind]
            color = LANE_COLORS[name.split()[0] if kind == "compute" else ("all-gather", "reduce-scatter")[lane - 1]]
            ax.broken_barh([(x, w)], (lane - 0.32, 0.64), color=color, edgecolor="k", lw=0.3,
                           alpha=0.55 if e.get("end_observed_at_wait") else 1.0)
            if name != "optimizer" and w > 0.012 * span:
                ax.text(x + w / 2, lane, "R" if name.endswith("root") else name.split()[-1], ha="center",
                        va="center", fontsize=8, color="white" if kind == "compute" else "black")
        ax.set(yticks=[0, 1, 2], yticklabels=["compute", "all-gather", "reduce-scatter"], ylim=(2.5, -0.5))
        o = row["overlap"]
        ax.set_title(f"{row['name']}: step {1e3 * row['median']:.1f} ms (median); {o['hidden_fraction']:.0%} of the "
                     f"layer all-gathers' time under layer compute", loc="left")
    axes[-1, 0].set(xlabel=f"ms since the step started (rank {rank}; numbers: layers, R: root)", xlim=(0, 1.02 * xmax))
    fig.legend(handles=[Patch(color=c, label=k) for k, c in LANE_COLORS.items()] +
               [Patch(color="0.88", label="forward / backward pass"), Patch(color="#f3c9c9", label="final wait"),
                Patch(color=LANE_COLORS["reduce-scatter"], alpha=0.55, label="end seen only at the wait")],
               loc="lower center", ncol=4, frameon=False)
    fig.suptitle(title, x=0.01, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0.12 if len(rows) > 1 else 0.2, 1, 1))
    return fig


def plot_fsdp(fsdp, memory):
    """Left: the per-round throughput ratio ours / FSDP2; right: peak memory above the baseline and the model
    states, each alone on fresh ranks."""
    plt = _plt()
    rows, r = {x["name"]: x for x in fsdp["rows"]}, fsdp["ratio"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
    ax1.hist([f / o for o, f in zip(rows["ours"]["step_times"], rows["fsdp2"]["step_times"])], color="#4c72b0",
             bins=max(5, min(20, r["n"] // 2)))
    ax1.axvline(r["median"], color="k", lw=1.5, label=f"median {r['median']:.2f}")
    ax1.axvline(1.0, color="#c44e52", ls="--", lw=1, label="1 = as fast as FSDP2")
    ax1.set(xlabel="ours / FSDP2 throughput, per round", ylabel="rounds", title=f"{r['n']} paired rounds")
    for dx, label, color, get in ((-0.2, "peak above baseline", "#8172b2", lambda m: m["peak"]),
                                  (0.2, "model states", "#55a868", lambda m: sum(m["states"].values()))):
        ax2.bar([dx, 1 + dx], [get(memory[k]) / MiB for k in ("ours", "fsdp2")], 0.38, color=color, label=label)
    ax2.set_xticks([0, 1], ["ours (ZeRO-3)", "FSDP2"])
    ax2.set(ylabel="MiB per rank (rank 0)", title="memory, each alone on 2 ranks")
    for ax in (ax1, ax2):
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    fig.tight_layout()
    return fig


def plot_parity(pairs):
    """_plots.plot_parity with its legends moved off the data: the curves' beside the panels, the bounds' below."""
    fig = _plots.plot_parity(pairs, what="each stage")
    ax1, ax2 = fig.axes
    for ax in fig.axes:
        ax.get_legend().remove()
    fig.legend(*ax1.get_legend_handles_labels(), loc="center right", frameon=False, fontsize=8)
    bounds = [(h, lab) for h, lab in zip(*ax2.get_legend_handles_labels()) if lab not in pairs]
    ax2.legend(*zip(*bounds), loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False, fontsize=8)
    fig.set_size_inches(11, 3.8)
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    return fig


def plot_memory_model(n_params, n, stage, recipe="ours", capacity_gb=80.0, title=""):
    """The widget: model states per GPU for each stage at n ranks, and the chosen stage against n."""
    plt = _plt()
    GB, per = 1e9, memory_per_gpu(n_params, n, recipe)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.4), gridspec_kw=dict(width_ratios=[3, 2]))
    for s in range(4):
        top = stacked_bar(ax1, s, {k: per[s][k] / GB for k in PARTS}, PART_COLORS, 0.8, label=s == 0)
        ax1.bar(s, top, 0.8, fill=False, edgecolor="k" if s == stage else "none", lw=2)
        ax1.text(s, top, f"{top:,.1f} GB", ha="center", va="bottom", fontsize=8)
    ax1.axhline(capacity_gb, color="#c44e52", ls="--", lw=1, label=f"{capacity_gb:g} GB per GPU")
    ax1.set_xticks(range(4), [STAGE_NAMES[s] for s in range(4)])
    ax1.set(ylabel="GB per GPU (model states only)", ylim=(0, 1.18 * max(per[0]["total"] / GB, capacity_gb)),
            title=f"{n_params / 1e9:.2f} B parameters, n={n}, recipe {recipe!r} {title}")
    ns = [2**k for k in range(11)]
    ax2.loglog(ns, [memory_per_gpu(n_params, k, recipe)[stage]["total"] / GB for k in ns], "o-", ms=3)
    ax2.loglog([n], [per[stage]["total"] / GB], "o", color="k", ms=7)
    ax2.axhline(capacity_gb, color="#c44e52", ls="--", lw=1)
    ax2.set(xlabel="data-parallel ranks n", ylabel="GB per GPU", title=f"{STAGE_NAMES[stage]} against n")
    fig.legend(*ax1.get_legend_handles_labels(), loc="lower center", ncol=4, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def main(argv=None):
    args, names, out = _common.cli("04_zero", EXPERIMENTS, __doc__, argv=argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for pp, group in ((1, [n for n in names if n not in PIPELINE]), (2, [n for n in names if n in PIPELINE])):
        if not group or (pp == 2 and world % 4):
            if group:
                print(f"== {group[0]}: launch it with 4 processes (or a multiple of 4); skipped")
            continue
        with Mesh.init(dp=world // pp, pp=pp, device=_common.experiment_device("04_zero")) as mesh:
            st = settings(args.fast, mesh)
            _common.run_experiments(
                group, lambda name: globals()[f"exp_{name}"](mesh, st, out),
                lambda name: out / (f"{name}_dp{world}.json" if name in PER_DP else f"{name}.json"),
                _common.environment(mesh, settings=st), mesh.rank,
                skip=lambda name: f"launch it with {'one process' if name in ONE_PROCESS else '2+ processes'}"
                if (world == 1) != (name in ONE_PROCESS) and name not in ANY_WORLD else None)


if __name__ == "__main__":
    main()
