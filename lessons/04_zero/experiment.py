"""Lesson 04, the experiment: ZeRO, measured. What each rank holds under data parallelism and ZeRO-1/2/3 next to
the formulas, the bytes every stage puts through its collectives, ZeRO-3's all-gathers with and without
prefetch on a per-rank timeline, our ZeRO-3 against torch's FSDP2, and the losses against one process.

    torchrun --nproc_per_node 4 lessons/04_zero/experiment.py --out runs/lessons/04_zero --only memory,comm
    torchrun --nproc_per_node 2 lessons/04_zero/experiment.py --only timeline,fsdp,parity
    torchrun --nproc_per_node 1 lessons/04_zero/experiment.py --only parity,fsdp_memory     # one process
    PICOTRON_FAST=1 torchrun ...        # short settings (CI, the notebook's FAST mode)

Each experiment writes OUT/<name>.json (rank 0); memory, comm and parity write OUT/<name>_dp<N>.json:
    memory       one training step of each stage (0 = plain bucketed DataParallel, 1, 2, 3) on its own copy of
                 the model: the bytes of parameters, gradients and optimizer state every rank keeps (the
                 wrappers' own accounting, `memory()` + `metrics.optimizer_bytes`) next to
                 `planner.zero_model_state_bytes`; ZeRO-3's transient peak; each unit's flat layout
    comm         a few steps of each stage, interleaved: the bytes each kind of collective covered per step (a
                 `metrics.Recorder` on the dp x cp axis counts them) next to `planner.zero_comm_elements`, and
                 the step time of each stage
    timeline     ZeRO-3 with and without prefetch, interleaved: every rank's events (the schedule's forward /
                 backward / wait, each layer's forward and backward, each all-gather and reduce-scatter from
                 launch to completion, the optimizer step)
    fsdp         our ZeRO-3 against torch's FSDP2 (`benchmarks/zero_vs_fsdp.compare`), steps alternating
    fsdp_memory  (one process) each of the two alone on 2 fresh ranks: peak memory above the baseline
    parity       picotron.train with --zero 0..3 at dp = world size, 2 micro-batches per step; with one
                 process, the single-process reference with the same global batch (grad_acc = 2·dp)

Every variant is built the way picotron.train builds a run (`parallelize`, with a Recorder on its dp x cp
axis) and steps the way it steps (`schedule.run`, `marks.clip_grad_norm`, `optimizer.step`, `zero_grad`).
Every timed comparison runs its variants in ONE process group, one step of each in turn (order rotating),
a barrier before every step; a step's time is the slowest rank's. `memory_per_gpu` (the widget's model) and
the plot_* functions are imported by the notebook.
"""
import argparse
import dataclasses
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

from picotron import data, marks, metrics, planner, schedule, zero3  # noqa: E402
from picotron import train as trainer  # noqa: E402
from picotron.config import Config  # noqa: E402
from picotron.mesh import Mesh  # noqa: E402
from picotron.model import loss_fn  # noqa: E402
from picotron.parallelize import build_model, build_optimizer, parallelize  # noqa: E402

# "small": the tiny preset widened (3.3 M parameters in 39 tensors), as in lesson 03.
SIZES = {"small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4),
         "medium": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6)}
MiB = 2**20
BUCKET_MB = 4.0  # stages 0-2: buckets of ~4 MiB, so the small model makes a few units (12.5 MiB of fp32 params)
STAGE_NAMES = {0: "DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
PARTS = ("params", "grads", "optimizer")
PART_COLORS = dict(params="#4c72b0", grads="#dd8452", optimizer="#55a868")
PARITY_GRAD_ACC = 2  # micro-batches per step of the parity runs (ZeRO-1 accumulates under no_sync)


def settings(fast, mesh):
    """Model and per-rank batch of the timed experiments, and the number of timed steps per variant."""
    if mesh.device.type == "cuda":
        return dict(size="medium", seq_len=512, micro_batch_size=8, steps=10 if fast else 40, warmup=3,
                    fsdp_steps=20 if fast else 100, parity_steps=10 if fast else 20)
    return dict(size="small", seq_len=64, micro_batch_size=2, steps=3 if fast else 20, warmup=1 if fast else 2,
                fsdp_steps=8 if fast else 60, parity_steps=10 if fast else 20)


def make_cfg(size="small", **kw):
    return Config(**{"preset": "tiny", "sample_tokens": 0, "eval_every": 0, **SIZES[size], **kw})


@functools.lru_cache(maxsize=1)
def tokens():
    """The embedded Shakespeare as byte tokens (what picotron.train reads), loaded once per process."""
    tok = data.get_tokenizer("byte")
    return data.TokenData(tok.encode_tensor(data.load_text("shakespeare")), tok.vocab_size)


# ------------------------------------------------------------------------------------------ one variant
class Variant:
    """One way of training (stage 0 = bucketed DataParallel, 1, 2 or 3) on its own copy of the model, built as
    picotron.train builds a run (`parallelize`) with a `metrics.Recorder` on its dp x cp axis: the recorder, not
    the algorithm, counts the bytes of every collective and, with `timeline`, puts each one on the timeline, next
    to the schedule's forward / backward / wait and (ZeRO-3) each layer's forward and backward."""

    def __init__(self, name, stage, cfg, mesh, prefetch=True, timeline=False):
        self.name, self.stage, self.mesh, self.device = name, stage, mesh, mesh.device
        self.cfg = cfg = dataclasses.replace(cfg, zero=stage, dp_impl="bucket", bucket_mb=BUCKET_MB)
        self.timeline = metrics.Timeline(mesh.device, mesh.rank, enabled=timeline)
        self.recorder = metrics.Recorder(self.timeline if timeline else None)
        if prefetch:
            run = parallelize(cfg, mesh, recorder=self.recorder)
            self.raw, self.model, self.optimizer = run.raw, run.model, run.optimizer
            self.schedule, self.loss_fn = run.schedule, run.loss_fn
        else:  # ZeRO-3 without prefetch, an option parallelize does not offer: the same pieces, by hand
            assert stage == 3, "prefetch=False is a ZeRO-3 option"
            self.raw = build_model(cfg, mesh)
            self.model = zero3.Zero3(self.raw, mesh.dp_cp.recorded(self.recorder), prefetch=False)
            self.optimizer = build_optimizer(self.model.optimizer_groups(), cfg, mesh.device)
            self.schedule, self.loss_fn = schedule.OneStage(mesh.dp_cp, mesh.device), loss_fn
        self.schedule.timeline = self.timeline if timeline else None  # "forward" / "backward" / "wait" events
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]  # ZeRO: its pieces
        self.psi = self.raw.config.num_params()
        self.recorder.reset()  # DataParallel's start-up broadcast of rank 0's weights is no step's traffic
        self.loader = data.DataLoader(tokens(), seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size,
                                      grad_acc=1, dp_size=mesh.dp.size, dp_rank=mesh.dp.rank, seed=cfg.seed)
        self.times, self.step_starts, self.losses, self.steps_run = [], [], [], 0
        self.mem = None

    def step(self, step, record=True):
        """One optimizer step, as picotron.train takes it; its time, and what the rank keeps (`self.mem`)."""
        batches = self.loader.micro_batches(step)
        metrics.sync(self.device)
        t0 = time.perf_counter()
        if record:
            self.step_starts.append(self.timeline.now())
        loss = self.schedule.run(self.model, batches, self.loss_fn)  # forward, backward, the gradient sync
        marks.clip_grad_norm(self.params, self.cfg.grad_clip, self.mesh)
        mem = self.model.memory()  # after the gradient sync, before the step: the gradients are still there
        with self.timeline.record("optimizer", kind="compute"):
            self.optimizer.step()  # ZeRO-1/2: ends with the all-gather of every rank's updated chunk
        mem["optimizer"] = metrics.optimizer_bytes(self.optimizer)
        self.model.zero_grad(set_to_none=True)
        self.losses.append(loss.item())
        metrics.sync(self.device)
        self.steps_run += 1
        if record:
            self.times.append(time.perf_counter() - t0)
        self.mem = mem


def step_stats(times):
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return dict(median=statistics.median(times), q1=q[0], q3=q[2])


def slowest(v, mesh):
    """Each step's time as the slowest rank's."""
    per_rank = gather(v.times, mesh)
    return [max(r[i] for r in per_rank) for i in range(len(v.times))]


def units_layout(model):
    """The flat view of every unit: numel, chunk, padded, and where each parameter starts (for the picture)."""
    names = {p: n for n, p in model.module.named_parameters()}
    return [dict(name=u.name, numel=u.numel, chunk=u.chunk, padded=u.padded,
                 params=[(names[p], off, p.numel()) for p, off in zip(u.params, u.offsets)]) for u in model.units]


def env_info(mesh, fast, st):
    mc = make_cfg(st["size"]).model_config()
    return dict(device=str(mesh.device), backend=mesh.backend, world_size=mesh.world_size, torch=torch.__version__,
                threads=torch.get_num_threads(), cores=os.cpu_count(), fast=fast, size=st["size"],
                model=SIZES[st["size"]], num_params=mc.num_params(), seq_len=st["seq_len"],
                micro_batch_size=st["micro_batch_size"], bucket_mb=BUCKET_MB)


def timed_cfg(st, mesh):
    return make_cfg(st["size"], seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"], dp=mesh.dp.size)


# --------------------------------------------------------------------------------------------- experiments
def exp_memory(mesh, fast, out):
    """One step of each stage; the model states every rank keeps, next to the formula (recipe "ours")."""
    st = settings(fast, mesh)
    cfg = timed_cfg(st, mesh)
    n, rows = mesh.dp_cp.size, []
    for stage in (0, 1, 2, 3):
        v = Variant(STAGE_NAMES[stage], stage, cfg, mesh)
        v.step(1, record=False)
        formula = planner.zero_model_state_bytes(v.psi, stage, n, recipe="ours")
        row = dict(stage=stage, name=v.name, psi=v.psi, mem_by_rank=gather(v.mem, mesh), formula=formula,
                   n_tensors=len(list(v.raw.parameters())))
        if stage:
            row.update(units=units_layout(v.model), n_pieces=len(v.model.pieces),
                       padding_elements=sum(u.padded - u.numel for u in v.model.units))
        rows.append(row)
        if mesh.rank == 0:
            m = row["mem_by_rank"][0]
            print(f"{v.name:<7} dp={n}, rank 0: " + "  ".join(
                f"{k} {m[k] / MiB:6.2f} MiB (formula {formula[k] / MiB:6.2f}, {m[k] / formula[k] - 1:+6.1%})"
                for k in PARTS) + (f"  | ZeRO-3 transient peak {m['zero_transient_peak'] / MiB:.2f} MiB"
                                   if stage == 3 else ""), flush=True)
        del v
    return dict(settings=st, n=n, rows=rows)


def exp_comm(mesh, fast, out):
    """A few steps of every stage, interleaved: bytes per step through each collective, and step times."""
    st = settings(fast, mesh)
    cfg = timed_cfg(st, mesh)
    variants = [Variant(STAGE_NAMES[s], s, cfg, mesh) for s in (0, 1, 2, 3)]
    run_interleaved(variants, st["steps"], st["warmup"], mesh.dp_cp.group)
    n, rows = mesh.dp_cp.size, []
    for v in variants:
        times = slowest(v, mesh)
        per_step = {k: b / v.steps_run for k, b in v.recorder.bytes.items()}
        root = v.model.units[0].numel if v.stage == 3 else 0
        predicted = planner.zero_comm_elements(v.psi, v.stage, root)
        rows.append(dict(stage=v.stage, name=v.name, psi=v.psi, root_params=root, bytes_per_step=per_step,
                         predicted_elements=predicted, step_times=times, **step_stats(times),
                         tokens_per_s=mesh.dp.size * st["micro_batch_size"] * st["seq_len"] / statistics.median(times)))
        if mesh.rank == 0:
            total = sum(per_step.values()) * (2 if v.stage == 0 else 1)
            print(f"{v.name:<7} per step: " + ", ".join(f"{k} {b / MiB:6.2f} MiB" for k, b in per_step.items())
                  + f" = {total / (4 * v.psi):.3f} x 4Ψ bytes | step {1e3 * rows[-1]['median']:6.1f} ms (median)",
                  flush=True)
    return dict(settings=st, n=n, rows=rows)


def exp_timeline(mesh, fast, out):
    """ZeRO-3 with and without prefetch: every rank's events of a few interleaved steps."""
    st = settings(fast, mesh)
    cfg = timed_cfg(st, mesh)
    variants = [Variant("prefetch", 3, cfg, mesh, prefetch=True, timeline=True),
                Variant("no prefetch", 3, cfg, mesh, prefetch=False, timeline=True)]
    dist.barrier()
    for v in variants:  # one common origin for every timeline, right after a barrier: ranks are comparable
        v.timeline.t0 = time.perf_counter()
    run_interleaved(variants, st["steps"], st["warmup"], mesh.dp_cp.group)
    rows = []
    for v in variants:
        times = slowest(v, mesh)
        events = gather(v.timeline.events, mesh)
        starts = gather(v.step_starts, mesh)
        row = dict(name=v.name, prefetch=v.model.prefetch, step_times=times, **step_stats(times), events=events,
                   step_starts=starts, n_layers=len(v.model.units) - 1)
        row["overlap"] = overlap_stats(row)
        rows.append(row)
        if mesh.rank == 0:
            o = row["overlap"]
            print(f"ZeRO-3, {v.name:<11}: step {1e3 * row['median']:6.1f} ms (median of {len(times)}) | layer "
                  f"all-gathers per step {o['n_gathers']:.0f}, {o['hidden_fraction']:.0%} of their time under "
                  f"layer compute | waiting on gathers outside compute {1e3 * o['exposed_gather_s']:.1f} ms",
                  flush=True)
    return dict(settings=st, rows=rows)


def overlap_stats(row):
    """Median per step over the ranks' last step...: how many layer all-gathers, and how much of their time ran
    while some layer was computing on the same rank."""
    per = []
    for r, events in enumerate(row["events"]):
        starts = row["step_starts"][r] + [float("inf")]
        for i in range(len(starts) - 1):
            ev = [e for e in events if starts[i] <= e["start"] < starts[i + 1]]
            compute = [(e["start"], e["end"]) for e in ev if e.get("kind") == "compute"]
            gathers = [(e["start"], e["end"]) for e in ev if e["name"].startswith("all-gather layer")]
            total = union_length(gathers)
            hidden = union_length([(max(a, c), min(b, d)) for a, b in gathers for c, d in compute
                                   if max(a, c) < min(b, d)])
            per.append(dict(n_gathers=len(gathers), gather_s=total, hidden_s=hidden))
    med = {k: statistics.median(p[k] for p in per) for k in per[0]}
    med["hidden_fraction"] = med["hidden_s"] / med["gather_s"] if med["gather_s"] else 0.0
    med["exposed_gather_s"] = med["gather_s"] - med["hidden_s"]
    return med


def _bench():
    from benchmarks import zero_vs_fsdp  # the repository root is on sys.path (_common)

    return zero_vs_fsdp


def exp_fsdp(mesh, fast, out):
    """Ours vs FSDP2, one step of each in turn; the per-round throughput ratio (FSDP2's time / ours)."""
    st = settings(fast, mesh)
    bench = _bench()
    cfg = bench.make_cfg(st["size"], seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"], dp=mesh.dp.size)
    rows = bench.compare(cfg, mesh, st["fsdp_steps"], warmup=st["warmup"] + 1)
    med, q1, q3 = bench.paired(rows)
    if mesh.rank == 0:
        for r in rows:
            s = r["states"]
            print(f"{r['name']:<6} {1e3 * r['median']:7.2f} ms/step (median) | model states per rank: " +
                  ", ".join(f"{k} {s[k] / MiB:.2f} MiB" for k in PARTS), flush=True)
        print(f"our throughput / FSDP2's: median {med:.3f} of {len(rows[0]['step_times'])} paired rounds "
              f"(quartiles {q1:.3f}-{q3:.3f})", flush=True)
    return dict(settings=st, rows=rows, ratio=dict(median=med, q1=q1, q3=q3, n=len(rows[0]["step_times"])))


def exp_fsdp_memory(mesh, fast, out):
    """(One process.) Each of ours and FSDP2 alone on 2 fresh ranks: peak memory above the pre-model baseline."""
    st = settings(fast, mesh)
    steps = 3 if fast else 5
    result = _bench().memory_main(st["size"], st["seq_len"], st["micro_batch_size"], dp=2, steps=steps)
    for name, r in result.items():
        print(f"{name:<6} alone on 2 ranks, {steps} steps: peak {r['peak'] / MiB:7.2f} MiB above the baseline | "
              "model states " + ", ".join(f"{k} {v / MiB:.2f} MiB" for k, v in r["states"].items()), flush=True)
    return dict(settings=dict(st, steps=steps), dp=2, memory=result)


def exp_parity(mesh, fast, out):
    """picotron.train for --zero 0..3 at dp = world size (or, with one process, the reference)."""
    st = settings(fast, mesh)
    n = mesh.dp_cp.size
    common = dict(steps=st["parity_steps"], seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"],
                  warmup_steps=2, log_every=st["parity_steps"], lr=3e-3, bucket_mb=BUCKET_MB)
    result = dict(settings=dict(st, grad_acc=PARITY_GRAD_ACC), dp=n, losses={}, mem_by_rank={})
    if n == 1:  # the references: one process, the global batch of dp = 2 and dp = 4
        for dp in (2, 4):
            acc = dp * PARITY_GRAD_ACC
            cfg = make_cfg(st["size"], grad_acc=acc, out=str(Path(out) / f"parity_ref_acc{acc}"), **common)
            trainer.train(cfg, mesh)
            result["losses"][f"reference_acc{acc}"] = [r["loss"] for r in metrics.read_metrics(cfg.out)[0]]
        return result
    for stage in (0, 1, 2, 3):
        cfg = make_cfg(st["size"], dp=n, zero=stage, grad_acc=PARITY_GRAD_ACC,
                       out=str(Path(out) / f"parity_dp{n}_zero{stage}"), **common)
        summary = trainer.train(cfg, mesh)
        result["mem_by_rank"][stage] = gather(summary["mem"], mesh)
        if mesh.rank == 0:
            result["losses"][stage] = [r["loss"] for r in metrics.read_metrics(cfg.out)[0]]
    return result


EXPERIMENTS = ("memory", "comm", "timeline", "fsdp", "fsdp_memory", "parity")
ONE_PROCESS = ("fsdp_memory",)  # starts its own ranks: launch it with one process
ANY_WORLD = ("parity",)


# ------------------------------------------------------------------------------------ the widget's model
def memory_per_gpu(n_params, n, recipe="ours"):
    """Model-state bytes per GPU for DP and ZeRO-1/2/3 over n ranks: {stage: {params, grads, optimizer,
    total}} (planner.zero_model_state_bytes; no padding, no Adam step counters, no activations)."""
    out = {}
    for stage in (0, 1, 2, 3):
        b = planner.zero_model_state_bytes(n_params, stage, n, recipe=recipe)
        out[stage] = dict(b, total=sum(b.values()))
    return out


def smallest_dp_that_fits(n_params, stage, capacity_bytes, recipe="ours", n_max=4096):
    """The smallest power of two n (up to n_max) whose model states per GPU fit in capacity_bytes under
    `stage`, or None (stages 0 and 1 keep whole copies of something: they may never fit)."""
    n = 1
    while n <= n_max:
        if memory_per_gpu(n_params, n, recipe)[stage]["total"] <= capacity_bytes:
            return n
        n *= 2
    return None


# ----------------------------------------------------------------------------- plots (for the notebook)
def plot_flat_units(units, n, title=""):
    """Each unit as one flat vector cut into n equal chunks (one colour per rank), parameter boundaries as
    ticks, the padding hatched: what `FlatUnit` computes."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 0.55 + 0.42 * len(units)))
    for j, u in enumerate(units):
        width = u["padded"]
        for r in range(n):
            ax.barh(j, u["chunk"] / width, left=r * u["chunk"] / width, color=plt.cm.Pastel1(r % 9),
                    edgecolor="k", lw=0.6, label=f"rank {r}'s chunk" if j == 0 else None)
        if u["padded"] > u["numel"]:
            ax.barh(j, (u["padded"] - u["numel"]) / width, left=u["numel"] / width, color="none", hatch="////",
                    edgecolor="#c44e52", lw=0, label="padding" if j == 0 else None)
        for _, off, _ in u["params"][1:]:
            ax.plot([off / width] * 2, [j - 0.4, j + 0.4], color="k", lw=0.5)
        ax.text(1.005, j, f"{u['numel']:,} elements in {len(u['params'])} tensors, chunk {u['chunk']:,}"
                          f" (+{u['padded'] - u['numel']} padding)", va="center", fontsize=7)
    ax.set_yticks(range(len(units)), [u["name"] for u in units], fontsize=8)
    ax.set_ylim(len(units) - 0.5, -0.5)
    ax.set_xlim(0, 1)
    ax.set_xlabel("position in the unit's flat vector (fraction); thin ticks: where a parameter tensor starts")
    ax.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=n + 1, frameon=False)
    ax.set_title(title, fontsize=9, loc="right")
    fig.tight_layout()
    return fig


def plot_memory(results):
    """results: {n: memory experiment result}. Per n, per stage: rank 0's measured bytes (solid) next to the
    formula (hatched), stacked params / grads / optimizer."""
    import matplotlib.pyplot as plt

    ns = sorted(results)
    fig, axes = plt.subplots(1, len(ns), figsize=(5.5 * len(ns), 3.4), sharey=True, squeeze=False)
    for ax, n in zip(axes[0], ns):
        for j, row in enumerate(results[n]["rows"]):
            for dx, mem, hatch in ((-0.2, row["mem_by_rank"][0], None), (0.2, row["formula"], "//")):
                bottom = 0
                for part in PARTS:
                    ax.bar(j + dx, mem[part] / MiB, 0.38, bottom=bottom, color=PART_COLORS[part], hatch=hatch,
                           edgecolor="white", label=part if (j == 0 and hatch is None) else None)
                    bottom += mem[part] / MiB
            ax.text(j, bottom, f"{bottom:.1f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(results[n]["rows"])), [r["name"] for r in results[n]["rows"]])
        ax.set_title(f"dp={n}: left measured (rank 0), right formula (hatched)", fontsize=9)
    axes[0][0].set_ylabel("MiB per rank (model states)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_comm(results):
    """results: {n: comm experiment result}. Bytes per step through each collective in units of the
    parameter bytes (4Ψ), measured bars, the planner's prediction as black markers."""
    import matplotlib.pyplot as plt

    ns = sorted(results)
    colors = {"all_reduce": "#8172b2", "reduce_scatter": "#dd8452", "all_gather": "#4c72b0"}
    fig, axes = plt.subplots(1, len(ns), figsize=(5 * len(ns), 3.2), sharey=True, squeeze=False)
    for ax, n in zip(axes[0], ns):
        for j, row in enumerate(results[n]["rows"]):
            unit = 4 * row["psi"]
            bottom = 0
            for kind, b in row["bytes_per_step"].items():
                size = b / unit * (2 if kind == "all_reduce" else 1)  # all-reduce = reduce-scatter + all-gather
                ax.bar(j, size, bottom=bottom, color=colors[kind], label=kind.replace("_", "-") +
                       (" (counted as RS + AG)" if kind == "all_reduce" else "") if n == ns[0] else None)
                bottom += size
            pred = sum(row["predicted_elements"].values()) / row["psi"]
            ax.plot([j - 0.35, j + 0.35], [pred] * 2, "k-", lw=2, label="planner.zero_comm_elements"
                    if (j == 0 and n == ns[0]) else None)
            ax.text(j, bottom + 0.05, f"{bottom:.3f}", ha="center", fontsize=7)
        ax.set_xticks(range(len(results[n]["rows"])), [r["name"] for r in results[n]["rows"]])
        ax.set_title(f"dp={n}", fontsize=9)
    axes[0][0].set_ylabel("bytes per step / 4Ψ")
    handles, labels = [], []
    for ax in axes[0]:
        h, lab = ax.get_legend_handles_labels()
        for hh, ll in zip(h, lab):
            if ll not in labels:
                handles.append(hh)
                labels.append(ll)
    axes[0][0].legend(handles, labels, fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


LANE_COLORS = {"forward": "#4c72b0", "backward": "#55a868", "optimizer": "#8172b2",
               "all-gather": "#dd8452", "reduce-scatter": "#c44e52"}
PHASE_COLORS = {"forward": "0.85", "backward": "0.85", "wait": "#f3c9c9"}  # the schedule's timeline, as bands


def plot_timeline(rows, step=-1, ranks=None, title=""):
    """Per variant and rank, three lanes: compute (each layer's forward and backward, the optimizer; the
    schedule's whole forward and backward passes as a grey band, its wait for the gradient sync as a pink one),
    all-gathers, reduce-scatters. One step; time from its start."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n_ranks = len(rows[0]["events"])
    ranks = list(range(n_ranks)) if ranks is None else ranks
    fig, axes = plt.subplots(len(rows), 1, figsize=(11, 0.9 + 0.62 * 3 * len(ranks) * len(rows)), sharex=True)
    axes = [axes] if len(rows) == 1 else axes
    xmax = 0
    for ax, row in zip(axes, rows):
        labels = []
        for j, r in enumerate(ranks):
            starts = row["step_starts"][r]
            i = step % len(starts)
            t0 = min(row["step_starts"][q][i] for q in range(n_ranks))
            t1 = starts[i + 1] if i + 1 < len(starts) else float("inf")
            y = {"compute": 3 * j, "all-gather": 3 * j + 1, "reduce-scatter": 3 * j + 2}
            for e in row["events"][r]:
                if not starts[i] <= e["start"] < t1:
                    continue
                x, w = 1e3 * (e["start"] - t0), 1e3 * (e["end"] - e["start"])
                xmax = max(xmax, x + w)
                name, kind = e["name"], e.get("kind")
                if kind is None:  # the schedule's phases: forward, backward, wait (for the last reduce-scatters)
                    ax.broken_barh([(x, w)], (y["compute"] - 0.45, 0.9), color=PHASE_COLORS.get(name, "0.85"),
                                   zorder=0)
                elif kind == "compute":
                    kind = name.split()[0]
                    ax.broken_barh([(x, w)], (y["compute"] - 0.32, 0.64), color=LANE_COLORS[kind], edgecolor="k",
                                   lw=0.3)
                    if kind != "optimizer":
                        ax.text(x + w / 2, y["compute"], name.split()[-1], ha="center", va="center", fontsize=6,
                                color="white")
                else:
                    lane = "all-gather" if name.startswith("all-gather") else "reduce-scatter"
                    seen_at_wait = e.get("end_observed_at_wait", False)
                    ax.broken_barh([(x, w)], (y[lane] - 0.32, 0.64), color=LANE_COLORS[lane], edgecolor="k", lw=0.3,
                                   alpha=0.55 if seen_at_wait else 1.0)
                    ax.text(x + w / 2, y[lane], name.split()[-1] if "layer" in name or "bucket" in name else "root",
                            ha="center", va="center", fontsize=6)
            labels += [f"rank {r} compute", f"rank {r} all-gather", f"rank {r} reduce-scatter"]
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_ylim(len(labels) - 0.5, -0.5)
        o = row["overlap"]
        ax.set_title(f"ZeRO-3, {row['name']}: step {1e3 * row['median']:.1f} ms (median); "
                     f"{o['hidden_fraction']:.0%} of the layer all-gathers' time under layer compute",
                     fontsize=9, loc="left")
    axes[-1].set_xlabel("ms since the step started (the earliest rank's start)")
    axes[-1].set_xlim(0, 1.02 * xmax)
    fig.legend(handles=[Patch(color=c, label=k) for k, c in LANE_COLORS.items()] +
               [Patch(color="0.85", label="forward / backward pass"),
                Patch(color=PHASE_COLORS["wait"], label="wait for the gradient sync"),
                Patch(color=LANE_COLORS["reduce-scatter"], alpha=0.55, label="end seen only at the wait")],
               loc="upper right", fontsize=7, ncol=4)
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def plot_fsdp(fsdp, memory=None):
    """Left: the per-round throughput ratio ours/FSDP2; middle: step times; right (if given): peak memory above
    the baseline and the model states, each alone on fresh ranks."""
    import matplotlib.pyplot as plt

    rows = {r["name"]: r for r in fsdp["rows"]}
    ours, fs = rows["ours"]["step_times"], rows["fsdp2"]["step_times"]
    ratios = [f / o for o, f in zip(ours, fs)]
    k = 3 if memory else 2
    fig, axes = plt.subplots(1, k, figsize=(4.2 * k, 3.2))
    axes[0].hist(ratios, bins=max(5, min(20, len(ratios) // 2)), color="#4c72b0")
    r = fsdp["ratio"]
    axes[0].axvline(r["median"], color="k", lw=1.5, label=f"median {r['median']:.2f}")
    axes[0].axvline(1.0, color="#c44e52", ls="--", lw=1, label="1 = as fast as FSDP2")
    axes[0].set(xlabel="ours / FSDP2 throughput, per round", title=f"{r['n']} paired rounds")
    axes[0].legend(fontsize=7)
    names = ["ours", "fsdp2"]
    meds = [1e3 * statistics.median(rows[k]["step_times"]) for k in names]
    axes[1].bar(["ours (ZeRO-3)", "FSDP2"], meds, color=["#4c72b0", "#dd8452"])
    axes[1].set(ylabel="ms per step (median, slowest rank)", title="step time")
    if memory:
        x = range(len(names))
        axes[2].bar([i - 0.2 for i in x], [memory[k]["peak"] / MiB for k in names], 0.38, color="#8172b2",
                    label="peak above baseline")
        axes[2].bar([i + 0.2 for i in x], [sum(memory[k]["states"].values()) / MiB for k in names], 0.38,
                    color="#55a868", label="model states")
        axes[2].set_xticks(list(x), ["ours (ZeRO-3)", "FSDP2"])
        axes[2].set(ylabel="MiB per rank (rank 0)", title="memory, each alone on 2 ranks")
        axes[2].legend(fontsize=7, loc="center")
    fig.tight_layout()
    return fig


def plot_memory_model(n_params, n, stage, recipe="ours", capacity_gb=80.0, title=""):
    """The widget's figure: model states per GPU for DP and ZeRO-1/2/3 at n ranks (the chosen stage
    outlined), and the chosen stage's bytes per GPU against n, with the GPU's capacity as a line."""
    import matplotlib.pyplot as plt

    GB = 1e9
    per = memory_per_gpu(n_params, n, recipe)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.2), gridspec_kw=dict(width_ratios=[3, 2]))
    for s in range(4):
        bottom = 0
        for part in PARTS:
            ax1.bar(s, per[s][part] / GB, bottom=bottom, color=PART_COLORS[part], label=part if s == 0 else None,
                    edgecolor="k" if s == stage else "white", lw=2 if s == stage else 0.5)
            bottom += per[s][part] / GB
        ax1.text(s, bottom, f"{bottom:,.1f} GB", ha="center", va="bottom", fontsize=8)
    ax1.axhline(capacity_gb, color="#c44e52", ls="--", lw=1, label=f"{capacity_gb:g} GB per GPU")
    ax1.set_xticks(range(4), [STAGE_NAMES[s] for s in range(4)])
    ax1.set(ylabel="GB per GPU (model states only)", title=f"{n_params / 1e9:.2f} B parameters, n={n}, "
                                                           f"recipe {recipe!r} {title}")
    ax1.legend(fontsize=7)
    ns = [2**k for k in range(0, 11)]
    ax2.loglog(ns, [memory_per_gpu(n_params, k, recipe)[stage]["total"] / GB for k in ns], "o-", ms=3,
               label=STAGE_NAMES[stage])
    ax2.loglog([n], [per[stage]["total"] / GB], "o", color="k", ms=7)
    ax2.axhline(capacity_gb, color="#c44e52", ls="--", lw=1)
    ax2.set(xlabel="data-parallel ranks n", ylabel="GB per GPU", title=f"{STAGE_NAMES[stage]} against n")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig


plot_parity = functools.partial(_common.plot_parity, what="each stage")  # for the notebook


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(_common.ROOT / "runs" / "lessons" / "04_zero"))
    p.add_argument("--only", default=",".join(EXPERIMENTS), help=f"comma-separated subset of {EXPERIMENTS}")
    p.add_argument("--fast", action="store_true", default=_common.FAST, help="short settings (or PICOTRON_FAST=1)")
    args = p.parse_args(argv)
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
            if world == 1 and name not in ONE_PROCESS + ANY_WORLD:
                if mesh.rank == 0:
                    print(f"== {name}: needs at least 2 processes (torchrun --nproc_per_node 2); skipped", flush=True)
                continue
            if world > 1 and name in ONE_PROCESS:
                if mesh.rank == 0:
                    print(f"== {name}: starts its own ranks; launch it with one process; skipped", flush=True)
                continue
            t0 = time.perf_counter()
            result = globals()[f"exp_{name}"](mesh, args.fast, out)
            file = out / (f"{name}_dp{world}.json" if name in ("memory", "comm", "parity") else f"{name}.json")
            if mesh.rank == 0:
                _common.save_json(dict(env, results=result, seconds=time.perf_counter() - t0), file)
                path = os.path.relpath(file)  # short (and free of home directories) in notebooks
                print(f"== {name}: {time.perf_counter() - t0:.1f} s -> {file if path.startswith('..') else path}",
                      flush=True)
    finally:
        mesh.destroy()


if __name__ == "__main__":
    main()
