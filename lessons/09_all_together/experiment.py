"""Lesson 09's experiments: every strategy at once. The 4-D grid and its links (pure functions of picotron.mesh),
one 4-D training run on CPU processes with every rank's timeline, and the notebook's formulas and plots.

    torchrun --nproc_per_node 16 lessons/09_all_together/experiment.py            # dp2 x pp2 x cp2 x tp2
    PICOTRON_FAST=1 torchrun --nproc_per_node 8 lessons/09_all_together/experiment.py   # pp2 x cp2 x tp2

Rank 0 writes OUT/run4d_<layout>.json. run4d: `picotron.train` on the layout for `steps` steps (the real trainer:
losses, gradient norms, each rank's memory), then `timed_steps` more steps built and stepped as train builds them
(`parallelize` with a Recorder on every axis, a timeline on the pipeline executor and on every ring-attention core):
every rank's events of the last one (pipeline actions, ring attention and its waits, each collective with its axis,
the pipeline's receives, clipping, the optimizer step), every collective's bytes by axis; then one process with the
same global batch (grad_acc x dp micro-batches) on rank 0, the reference of the parity check.
"""
import functools
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/
import _common  # noqa: E402  (puts the repository root on sys.path)
from _common import gather, say  # noqa: E402
from _plots import FONT, legend_below, plot_parity_below  # noqa: E402  (figure helpers several lessons share)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from picotron import context_parallel, hooks, marks, metrics, parallelize as par  # noqa: E402
from picotron.config import Config  # noqa: E402
from picotron.mesh import ORDER, Mesh, grid_coords, grid_rank, group_ranks  # noqa: E402
from picotron.metrics import read_metrics  # noqa: E402
from picotron.train import load_data, lr_at, train  # noqa: E402

MiB = 2**20
AXES = ("tp", "cp", "pp", "dp")  # fastest- to slowest-varying: the order of the drawing
AXIS_COLORS = {"tp": "#c44e52", "cp": "#8172b2", "pp": "#55a868", "dp": "#4c72b0", "dp_cp": "#4c72b0",
               "world": "#937860", "pp_ends": "#da8bc3"}
LINKS = {"intra": "inside a node (NVLink, ~450 GB/s per GPU)", "inter": "between nodes (InfiniBand, ~50 GB/s per GPU)"}
LINK_COLORS = {"intra": "#2a9d8f", "inter": "#e76f51"}
WHAT_TRAVELS = {"tp": "activations: all-reduces inside every layer, forward and backward (on the critical path)",
                "cp": "K/V blocks around a ring, every layer (under the attention compute)",
                "pp": "one activation per micro-batch and stage boundary, its gradient back",
                "dp": "gradients, once per step (under the backward); with cp: over dp x cp"}


LAYOUTS = {16: dict(dp=2, pp=2, cp=2, tp=2), 8: dict(dp=1, pp=2, cp=2, tp=2)}  # the run's layout by process count


def settings(fast, device_type=None):
    """The 4-D run: the tiny model (h = 128, 4 layers), 128-token sequences, 4 micro-batches of 4 per step and dp
    rank (1F1B over the pp = 2 stages). Full: dp2 x pp2 x cp2 x tp2, 16 processes; FAST: pp2 x cp2 x tp2, 8
    (PICOTRON_NPROC=8 or 16 picks one; on GPUs _common.GPU_SETTINGS["09_all_together"] on top)."""
    n = _common.nproc("09_all_together", 8 if fast else 16)
    layout = dict(LAYOUTS[n])
    st = dict(preset="tiny", layout=layout, seq_len=128, micro_batch_size=4, grad_acc=4,
              steps=10 if fast else 20, warmup_steps=5, timed_steps=2, gpus_per_node=4)
    return _common.sized("09_all_together", st, fast, device_type)


def configs_at(nproc, fast=False):
    """The Configs the main run (run4d) trains on `nproc` processes (8 or 16), at GPU size (GPU_SETTINGS on top):
    the 4-D layout of LAYOUTS (its one-process reference, on rank 0, is not an nproc-process run)."""
    st = dict(settings(fast, "cuda"), layout=LAYOUTS[nproc])
    return [make_cfg(st, **st["layout"])]


def layout_name(layout):
    return "-".join(f"{d}{layout.get(d, 1)}" for d in ORDER)


def make_cfg(st, **kw):
    """A picotron Config of the 4-D run (no sampling, no evaluation), with `kw` on top."""
    return Config(**{"preset": st["preset"], "seq_len": st["seq_len"], "micro_batch_size": st["micro_batch_size"],
                     "grad_acc": st["grad_acc"], "steps": st["steps"], "warmup_steps": st["warmup_steps"],
                     "sample_tokens": 0, "eval_every": 0, "log_every": 10**6, **kw})


# ---------------------------------------------------------------------------------------- the grid and its links
def node_of(rank, gpus_per_node):
    """Launchers give consecutive ranks to the GPUs of one node: rank r sits on node r // gpus_per_node."""
    return rank // gpus_per_node


def link_of(ranks, gpus_per_node):
    """'intra' when every rank of a group sits on one node, else 'inter' (its traffic crosses the network)."""
    return "intra" if len({node_of(r, gpus_per_node) for r in ranks}) == 1 else "inter"


def groups_and_links(sizes, gpus_per_node):
    """Per axis (tp, cp, pp, dp): its groups (picotron.mesh.group_ranks), the link class of each, and how many
    nodes the widest one spans."""
    out = {}
    for axis in AXES:
        groups = group_ranks(sizes, axis)
        links = [link_of(g, gpus_per_node) for g in groups]
        out[axis] = dict(size=len(groups[0]), groups=groups, links=links,
                         nodes=max(len({node_of(r, gpus_per_node) for r in g}) for g in groups))
    return out


def groups_with_order(sizes, order):
    """The groups of each axis if ranks were numbered with `order` (slowest to fastest) instead of picotron's
    (dp, pp, cp, tp): what a different choice of the fastest axis would put on one node."""
    sizes = {d: sizes.get(d, 1) for d in ORDER}
    out = {}
    for axis in ORDER:
        groups = {}
        for rank in range(math.prod(sizes.values())):
            c, r = {}, rank
            for d in reversed(order):
                r, c[d] = divmod(r, sizes[d])
            groups.setdefault(tuple(c[d] for d in order if d != axis), []).append(rank)
        out[axis] = sorted(groups.values())
    return out


# ---------------------------------------------------------------------------------------------- measuring
class AxisRecorder(metrics.Recorder):
    """A Recorder whose timeline events also name the axis (tp, cp, pp, dp_cp, world, pp_ends) and the kind of the
    collective (all_reduce, ...): the Gantt colours them by axis."""

    def collective(self, kind, nbytes, work, label, start, axis=None, **info):
        return super().collective(kind, nbytes, work, label, start, axis=axis, axis_name=axis, op=kind, **info)


class TimedRun:
    """The layout built as picotron.train builds it (`parallelize`, here with an AxisRecorder on every axis) and
    stepped as it steps (learning rate, schedule.run, clipping, optimizer step, zero_grad), every piece on one
    Timeline per rank: pipeline actions (F, B), each wait for a pipeline message, ring attention and its waits, every
    collective, clipping and the optimizer step."""

    def __init__(self, cfg, mesh):
        self.cfg, self.mesh = cfg, mesh
        self.tl = metrics.Timeline(mesh.device, mesh.rank)
        self.recorder = AxisRecorder(self.tl)
        torch.manual_seed(cfg.seed)
        self.run = par.parallelize(cfg, mesh, recorder=self.recorder)
        self.recorded = mesh.recorded(self.recorder)  # clipping's all-reduce over the world, counted and timed
        self.loader = load_data(cfg, mesh)[1]
        sch = self.run.schedule
        hooks.watch(sch, listener=self.tl.record)  # the engine's phases (a pipeline's F, B, W), on the timeline
        hooks.watch(sch, listener=metrics.ActivationPeak(self.run.model))  # counted as picotron.train counts them
        if hasattr(sch, "_receive"):  # the pipeline's wait for a message from the neighbouring stage
            receive = sch._receive

            def timed(a):
                t0 = self.tl.now()
                x = receive(a)
                if self.tl.now() - t0 > 0:
                    self.tl.add("pp wait", t0, self.tl.now(), kind="p2p", axis_name="pp", of=a.kind, micro=a.mb)
                return x
            sch._receive = timed
        hooks.watch(*context_parallel.cores(self.run.raw), listener=self.tl.record)  # ring steps and their waits

    def step(self, step):
        """One step; returns this rank's events (absolute seconds: comparable across the processes of one machine),
        its collectives and the ring's messages (kind, bytes, axis) and the pipeline's point-to-point bytes."""
        run, tl = self.run, self.tl
        sch = run.schedule
        self.recorder.reset()
        dist.barrier()
        tl.events.clear()
        t0 = tl.now()
        for group in run.optimizer.param_groups:
            group["lr"] = lr_at(step, self.cfg)
        loss = sch.run(run.model, self.loader.micro_batches(step), run.loss_fn)
        with tl.record("clip", kind="compute"):
            marks.clip_grad_norm(run.params, self.cfg.grad_clip, self.recorded)
        with tl.record("optimizer", kind="compute"):
            run.optimizer.step()
        run.model.zero_grad(set_to_none=True)
        t1 = tl.now()
        t0, t1 = (tl.seconds(t) for t in (t0, t1))  # on a GPU: when the GPU got there
        base = tl.t0
        return dict(rank=self.mesh.rank, coords=self.mesh.coords, loss=float(loss), start=t0 + base, end=t1 + base,
                    events=[dict(e, start=e["start"] + base, end=e["end"] + base) for e in tl.events],
                    log=list(self.recorder.log))


def _curve(cfg):
    rows, summary = read_metrics(cfg.out)
    return dict(losses=[r["loss"] for r in rows], grad_norms=[r["grad_norm"] for r in rows],
                step_time=[r["step_time"] for r in rows], tokens_per_s=summary["tokens_per_s"])


def exp_run4d(mesh, st, out):
    """picotron.train on the layout; then timed steps with every rank's timeline; then one process on rank 0."""
    layout = {d: mesh.sizes[d] for d in ORDER}
    name = layout_name(layout)
    cfg = make_cfg(st, **layout, out=str(Path(out) / f"run4d_{name}"))
    t0 = time.perf_counter()
    summary, run = train(cfg, mesh, return_model=True)
    mem = dict(run.model.memory(), optimizer=metrics.optimizer_bytes(run.optimizer),
               activations=summary["mem"]["activations"])  # the last step's, as the trainer counted them
    params = sum(p.numel() for p in run.raw.parameters())
    tensors = sum(1 for _ in run.raw.parameters())
    train_s = time.perf_counter() - t0
    del run
    every_mem = gather(dict(mem=mem, params=params, tensors=tensors, coords=mesh.coords), mesh)
    say(mesh, f"{name}: {st['steps']} steps of picotron.train in {train_s:.1f} s")
    timed = TimedRun(cfg, mesh)
    steps = []
    for s in range(1, st["timed_steps"] + 1):
        steps.append(gather(timed.step(s), mesh))
    result = dict(layout=layout, name=name, world=mesh.world_size, train_s=train_s, ranks=every_mem, settings=st,
                  timed=steps[-1], timed_steps=[[r["end"] - r["start"] for r in ranks] for ranks in steps],
                  hidden=cfg.model_config().hidden_size, kv_heads=cfg.model_config().num_key_value_heads,
                  head_dim=cfg.model_config().head_dim, layers=cfg.model_config().num_hidden_layers)
    if mesh.rank == 0:
        result["run"] = _curve(cfg)
        ref = make_cfg(st, grad_acc=st["grad_acc"] * layout["dp"], out=str(Path(out) / f"run4d_reference_{name}"))
        t0 = time.perf_counter()
        summary, one = train(ref, Mesh.local(mesh.device), return_model=True)
        result["reference"] = dict(_curve(ref), mem=dict(one.model.memory(),
                                                          optimizer=metrics.optimizer_bytes(one.optimizer),
                                                          activations=summary["mem"]["activations"]),
                                   seconds=time.perf_counter() - t0)
    dist.barrier()
    return result


EXPERIMENTS = ("run4d",)


# ------------------------------------------------------------------------------------- what the run should send
def stage_layers(layers, pp, stage):
    """The decoder layers on pipeline stage `stage` when they split evenly (the tiny model: 4 layers, 2 stages)."""
    return layers // pp


def bytes_formula(res, coords):
    """What one rank should send per step, by axis, from the layout and the model's shapes (fp32, no sp):
    tp: per micro-batch and layer, two all-reduces of the b·(s/cp)·h activations forward (after attention's o_proj
        and the MLP's down_proj: g) and two backward (before q/k/v and gate/up: f's gradient); the first stage adds
        the vocab-parallel embedding's all-reduce, the last the head's f in backward (b·(s/cp)·h) and the
        vocab-parallel cross-entropy's three all-reduces of b·(s/cp) numbers (max, sum of exponentials, target logit);
    cp: the ring's K/V blocks (picotron.context_parallel.bytes_per_step_formula, with the kv heads of one tp rank);
    pp: each micro-batch's activation (first stage) or its gradient (last stage), b·(s/cp)·h;
    dp_cp: every gradient this rank holds, once (4 bytes per parameter), plus the 4-byte loss averaged for the log;
    world: the 4-byte sum of squares of the gradient norm."""
    from picotron.context_parallel import bytes_per_step_formula

    lay, st = res["layout"], res["settings"]
    b, s, h = st["micro_batch_size"], st["seq_len"] // lay["cp"], res["hidden"]
    m, L = st["grad_acc"], stage_layers(res["layers"], lay["pp"], coords["pp"])
    first, last = coords["pp"] == 0, coords["pp"] == lay["pp"] - 1
    act = b * s * h * 4
    out = {}
    if lay["tp"] > 1:
        out["tp"] = m * ((4 * L + first + last) * act + last * 3 * b * s * 4)
    if lay["cp"] > 1:
        out["cp"] = bytes_per_step_formula(lay["cp"], b, st["seq_len"], res["kv_heads"] // lay["tp"], res["head_dim"],
                                           L, micro_batches=m)
    if lay["pp"] > 1:
        out["pp"] = m * act
    if lay["dp"] * lay["cp"] > 1:
        out["dp_cp"] = 4 * res["ranks"][grid_rank(coords, lay)]["params"] + 4
    out["world"] = 4
    return out


def measured_bytes(rank_result):
    """What one rank sent in the timed step, by axis: the Recorder's collectives and the ring's and the pipeline's
    messages (the pipeline's 4-byte broadcast of the loss to the first stage left out: it is for the log, like the
    loss's average over dp_cp, which is kept, being on the same axis as the gradients)."""
    out = {}
    for kind, nbytes, axis in rank_result["log"]:
        if axis == "pp" and kind == "broadcast":
            continue
        out[axis] = out.get(axis, 0) + nbytes
    return out


COMM_CLASSES = ("tp", "cp", "pp", "dp_cp", "world")


def event_class(e):
    """What a timeline event is: 'F'/'B' (pipeline actions), 'clip', 'optimizer', 'attention' (ring compute, inside
    F and B), or a communication class: 'tp', 'cp' (waiting for the ring), 'pp' (waiting for a neighbour's
    message), 'dp_cp' (the gradient all-reduce and the loss's average), 'world' (the gradient norm), None."""
    name = e["name"]
    if name in ("forward", "backward", "weight"):
        return {"forward": "F", "backward": "B", "weight": "W"}[name]
    if name in ("clip", "optimizer"):
        return name
    if name.startswith("attention"):
        return "attention"
    if name == "wait":
        return "cp"
    if e.get("axis_name") in COMM_CLASSES:
        return e["axis_name"]
    return None


def shares(rank_result):
    """Seconds of this rank's step: the step, its compute (pipeline actions, clipping and the optimizer, minus the
    communication inside them), each communication class (the union of its intervals), and idle (nothing running:
    waiting for the other stage before the first action or after the last)."""
    ev, t0, t1 = rank_result["events"], rank_result["start"], rank_result["end"]
    by = {c: [(e["start"], e["end"]) for e in ev if event_class(e) == c] for c in COMM_CLASSES}
    work = [(e["start"], e["end"]) for e in ev if event_class(e) in ("F", "B", "W", "clip", "optimizer")]
    comm_all = _common.union_length([iv for c in COMM_CLASSES for iv in by[c]])
    busy = _common.union_length(work + [iv for c in COMM_CLASSES for iv in by[c]])
    out = dict(step=t1 - t0, compute=busy - comm_all, idle=(t1 - t0) - busy)
    out.update({c: _common.union_length(by[c]) for c in COMM_CLASSES})
    return out


# ------------------------------------------------------------------------------ the planner: memory and time
def memory_rows(res):
    """Per rank of the 4-D run: (measured bytes, the planner's `memory_per_stage` row for its stage, recipe "ours")."""
    from picotron import planner

    st = res["settings"]
    layout = planner.Layout(**res["layout"], micro_batch_size=st["micro_batch_size"], grad_acc=st["grad_acc"])
    pred = planner.memory_per_stage(model_of(st["preset"]), layout, st["seq_len"], "fp32", "ours")
    return [(x["mem"], pred[x["coords"]["pp"]]) for x in res["ranks"]]


LLAMA3_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)
JOBS = {"smollm-1.7b": 2048, "llama3-8b": 8192, "llama3-70b": 8192}  # each model's training context (tokens)
GLOBAL_TOKENS = 4 * 2**20  # 4M tokens per optimizer step


def model_of(name):
    """A preset, or Llama 3 70B (Meta's config.json: h 8192, 80 layers, 64 heads, 8 KV heads, i 28672)."""
    from picotron.model import PRESETS, ModelConfig

    if name == "llama3-70b" and name not in PRESETS:
        return ModelConfig(**LLAMA3_70B)
    return ModelConfig.from_preset(name)


def reason_class(why):
    """The step of the decision procedure a rejection belongs to: 'memory' (step 1), 'batch' (step 2), 'tp' (tp
    wider than a node), or 'shape' (the model's shapes: heads, layers, the sequence's chunks; a combination
    picotron refuses)."""
    if why.startswith("does not fit"):
        return "memory"
    if why.startswith("the global batch"):
        return "batch"
    if "crosses nodes" in why:
        return "tp"
    return "shape"


@functools.lru_cache(maxsize=64)  # a search takes seconds; the notebook and its widget ask some jobs twice
def decide(name, gpus, memory_gib=None, seq_len=None, tokens=GLOBAL_TOKENS, gpu="h100-80gb", headroom=None):
    """picotron.plan.search for one job: the model, GPUs (8 per node), memory per GPU (default the GPU's) of which a
    layout may use all but `headroom` (default plan.HEADROOM, 10%: the CUDA context, NCCL's buffers, the allocator's
    fragmentation, as `python -m picotron.plan` keeps), the sequence (default the model's training context) and the
    global batch in tokens. Returns the plan, the card and the hardware as the search saw it (`hw`: its usable
    memory), the job, the rejections counted by step, and the first rejected candidate in the search's order.
    Cached: the same arguments return the same dict (read it, never change it)."""
    from dataclasses import replace

    from picotron import plan

    card = plan.GPUS[gpu] if memory_gib is None else replace(plan.GPUS[gpu], memory=memory_gib * 2**30)
    headroom = plan.HEADROOM if headroom is None else headroom
    hw = plan.usable(card, headroom)
    seq_len = seq_len or JOBS[name]
    mc = model_of(name)
    result = plan.search(mc, gpus, hw, seq_len, tokens // seq_len)
    counts = {}
    for _, why in result.rejected:
        counts[reason_class(why)] = counts.get(reason_class(why), 0) + 1
    return dict(name=name, mc=mc, gpus=gpus, card=card, headroom=headroom, hw=hw, seq_len=seq_len,
                global_seqs=tokens // seq_len, plan=result, counts=counts,
                first_rejected=result.rejected[0] if result.rejected else None)


STEP_PARTS = ("compute", "tp", "cp", "ep", "pp", "bubble", "dp")
STEP_COLORS = {"compute": "#6baed6", "tp": AXIS_COLORS["tp"], "cp": AXIS_COLORS["cp"], "ep": "#e377c2",
               "pp": AXIS_COLORS["pp"], "bubble": "#d9d9d9", "dp": AXIS_COLORS["dp"]}
MEM_PARTS = ("params", "grads", "optimizer", "activations")
MEM_COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52"}


# ----------------------------------------------------------------------------- plots (for the notebook)
def _cell(sizes, rank):
    """Where a rank is drawn: row = (dp, pp), column = (cp, tp): with tp fastest, a row is consecutive ranks."""
    c = grid_coords(rank, sizes)
    return c["cp"] * sizes["tp"] + c["tp"], c["dp"] * sizes["pp"] + c["pp"]


def plot_grid4d(sizes, gpus_per_node):
    """One panel per axis (tp, cp, pp, dp): every rank at its cell (row = dp, pp; column = cp, tp), shaded by its
    node; the groups of that axis (picotron.mesh.group_ranks) joined, green inside a node, orange across nodes."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch, Rectangle

    sizes = {d: sizes.get(d, 1) for d in ORDER}
    info = groups_and_links(sizes, gpus_per_node)
    cols, rows = sizes["cp"] * sizes["tp"], sizes["dp"] * sizes["pp"]
    n = math.prod(sizes.values())
    fig, axes = plt.subplots(1, 4, figsize=(3.3 * 4, 3.0 * rows / max(cols, 1) + 1.6))
    shades = ["#f1f1f1", "#d9d9d9"]
    for ax, axis in zip(axes, AXES):
        for rank in range(n):
            x, y = _cell(sizes, rank)
            c = grid_coords(rank, sizes)
            ax.add_patch(Rectangle((x + 0.08, -y - 0.92), 0.84, 0.84, facecolor=shades[node_of(rank, gpus_per_node) % 2],
                                   edgecolor="#777777", lw=0.6))
            ax.text(x + 0.5, -y - 0.38, str(rank), ha="center", va="center", fontsize=10, weight="bold")
            ax.text(x + 0.5, -y - 0.72, "".join(str(c[d]) for d in ORDER), ha="center", va="center", fontsize=6.5,
                    color="#555555")
        for g, link in zip(info[axis]["groups"], info[axis]["links"]):
            pts = [_cell(sizes, r) for r in g]
            for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
                far = abs(x1 - x0) + abs(y1 - y0) > 1  # not neighbours: an arc around the cells between them
                ax.add_patch(FancyArrowPatch((x0 + 0.5, -y0 - 0.5), (x1 + 0.5, -y1 - 0.5), arrowstyle="-",
                                             connectionstyle=f"arc3,rad={0.45 if far else 0}", shrinkA=11, shrinkB=11,
                                             color=LINK_COLORS[link], lw=2.2, alpha=0.9, zorder=3))
        k = info[axis]
        inter = sum(x == "inter" for x in k["links"])
        ax.set_title(f"{axis}: {len(k['groups'])} groups of {k['size']}\n"
                     + ("all inside a node" if not inter else f"{inter} of {len(k['groups'])} cross nodes"),
                     fontsize=9, color=AXIS_COLORS[axis])
        ax.set(xlim=(0, cols), ylim=(-rows - 0.05, 0.05), aspect="equal")
        ax.axis("off")
    handles = [Line2D([], [], color=LINK_COLORS[k], lw=2.5, label=v) for k, v in LINKS.items()]
    handles.append(Rectangle((0, 0), 1, 1, facecolor=shades[0], edgecolor="#777777",
                             label=f"a node of {gpus_per_node} GPUs (shades alternate); small digits: dp pp cp tp"))
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=FONT, frameon=False)
    fig.suptitle(f"{' x '.join(f'{d}={sizes[d]}' for d in ORDER)} = {n} ranks, {gpus_per_node} per node: rank = "
                 f"((dp·{sizes['pp']} + pp)·{sizes['cp']} + cp)·{sizes['tp']} + tp", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


GANTT_COLORS = {"F": "#9ecae1", "B": "#fdae6b", "W": "#a1d99b", "clip": "#bdbdbd", "optimizer": "#636363",
                "tp": AXIS_COLORS["tp"], "cp": AXIS_COLORS["cp"], "pp": AXIS_COLORS["pp"], "dp_cp": AXIS_COLORS["dp"],
                "world": AXIS_COLORS["world"]}
GANTT_LABELS = {"F": "forward of a micro-batch (pipeline action)", "B": "backward of a micro-batch",
                "clip": "gradient clipping", "optimizer": "optimizer step",
                "tp": "tp all-reduce (activations)", "cp": "cp: waiting for the next K/V (or dK/dV) block",
                "pp": "pp: waiting for the neighbour stage's message", "dp_cp": "dp x cp all-reduce (gradients)",
                "world": "all-reduce of the gradient norm (world)"}


def plot_timeline4d(res):
    """One training step, one band per rank (rank 0 on top): the upper lane its work (pipeline actions F and B, the
    clipping and the optimizer step), the lower lane its communication by axis."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    every = res["timed"]
    W = len(every)
    t0 = min(r["start"] for r in every)
    span = max(r["end"] for r in every) - t0
    fig, ax = plt.subplots(figsize=(13, 0.52 * W + 1.8))
    for r in every:
        y = r["rank"]
        for e in r["events"]:
            c = event_class(e)
            if c is None or c == "attention":
                continue
            upper = c in ("F", "B", "W", "clip", "optimizer")
            ax.barh(y - 0.17 if upper else y + 0.2, 1e3 * (e["end"] - e["start"]), left=1e3 * (e["start"] - t0),
                    height=0.4 if upper else 0.3, color=GANTT_COLORS[c], lw=0)
            if c in ("F", "B") and e["end"] - e["start"] > span / 50:
                ax.text(1e3 * (e["start"] + e["end"] - 2 * t0) / 2, y - 0.17, f"{c}{e.get('micro', '')}", fontsize=6,
                        ha="center", va="center")
    lay = res["layout"]
    ax.set_yticks(range(W), [f"rank {r['rank']}  " + " ".join(f"{d}{r['coords'][d]}" for d in ORDER) for r in every],
                  fontsize=7)
    for r in every[1:]:  # a thin line between pipeline stages' blocks of ranks
        if r["coords"]["pp"] != every[r["rank"] - 1]["coords"]["pp"]:
            ax.axhline(r["rank"] - 0.5, color="#999999", lw=0.6)
    ax.set_ylim(W - 0.5, -0.6)
    ax.set_xlim(0, 1e3 * span)
    ax.set_xlabel("ms since the step started (all processes share one clock)", fontsize=FONT)
    ax.set_title(f"one training step of {layout_name(lay)} ({W} processes, {res['settings']['grad_acc']} micro-batches, "
                 f"1F1B): upper lane work, lower lane communication", fontsize=9, loc="left")
    ax.tick_params(axis="x", labelsize=FONT)
    handles = [Patch(color=GANTT_COLORS[k], label=v) for k, v in GANTT_LABELS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=FONT, frameon=False)
    fig.tight_layout(rect=(0, 1.1 / (0.52 * W + 1.8), 1, 1))
    return fig


# ------------------------------------------------------------------ the trainer's own trace (--profile, section 2b)
TRACE_LAYOUT = dict(tp=2, pp=2)


def trace_args(folder, device):
    """`picotron.train`'s flags for section 2b: tp2 x pp2 on 4 processes, 3 steps of 4 micro-batches, step 3 profiled."""
    flags = dict(preset="tiny", tp=2, pp=2, grad_acc=4, micro_batch_size=2, seq_len=64, steps=3, profile="3",
                 eval_every=0, sample_tokens=0, log_every=3, device=device, out=folder)
    return [a for k, v in flags.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def trace_class(name, args):
    """What a range or collective of a picotron trace is, in the classes of `event_class` (None: not drawn: the
    messages' own events, from posting to their wait, and the ranges around the step)."""
    first = name.split()[0]
    if first in ("forward", "backward", "weight"):
        return {"forward": "F", "backward": "B", "weight": "W"}[first]
    if name in ("clip grad norm", "optimizer step"):
        return name.split()[0]
    if name.startswith("wait p2p"):
        return "pp"
    if name == "wait":
        return "cp"
    if args.get("collective") not in (None, "p2p") and args.get("axis_name") in COMM_CLASSES:
        return args["axis_name"]
    return None


def trace_rows(merged):
    """{rank: [(class, start ms, end ms, name)]} of a merged trace (picotron.trace.merge), each rank's step range
    ({rank: (start ms, end ms)}) and the rows' names ({rank: "rank r (dp d, pp p, cp c, tp t)"})."""
    from picotron import trace

    rows, steps = {}, {}
    for pid, name, start, end, args in trace.phases(merged):
        if name.startswith("step "):
            steps[pid] = (start / 1e3, end / 1e3)
        c = trace_class(name, args)
        if c is not None:
            rows.setdefault(pid, []).append((c, start / 1e3, end / 1e3, name))
    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"}
    return rows, steps, names


def messages_after_sends(rows, names):
    """Every pipeline message received after it was sent, on the merged clock: for each micro-batch, the receiving
    stage's wait inside its forward (backward) ends after the sending stage's forward (backward) of that micro-batch
    ends (its send is posted after it). [(receiver, micro-batch, kind, wait end - send's action end, ms)]."""
    import re

    stage = {r: int(re.search(r"pp (\d+)", n).group(1)) for r, n in names.items()}
    tp = {r: int(re.search(r"tp (\d+)", n).group(1)) for r, n in names.items()}
    out = []
    for r, events in rows.items():
        for c, start, end, name in events:
            if c not in ("F", "B"):
                continue
            src_stage = stage[r] - 1 if c == "F" else stage[r] + 1
            sender = [q for q in rows if stage[q] == src_stage and tp[q] == tp[r]]
            if not sender:
                continue  # the first stage's forwards and the last stage's backwards receive nothing
            waits = [e for k, s_, e, _ in events if k == "pp" and start <= s_ <= end]
            sent = [e for k, _, e, n in rows[sender[0]] if k == c and n.split()[1] == name.split()[1]]
            if waits and sent:
                out.append((r, name.split()[1], c, max(waits) - sent[0]))
    return out


def plot_trace_timeline(merged):
    """The profiled step of every rank, read from OUT/traces/merged.json: one band per rank (rank 0 on top), the upper
    lane its work (F, B, clipping, the optimizer step), the lower lane its communication and waits, in section 2's
    colours."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows, steps, names = trace_rows(merged)
    ranks = sorted(rows)
    t0 = min(s for s, _ in steps.values())
    span = max(e for _, e in steps.values()) - t0
    fig, ax = plt.subplots(figsize=(13, 0.6 * len(ranks) + 1.8))
    for y in ranks:
        for c, start, end, name in rows[y]:
            upper = c in ("F", "B", "W", "clip", "optimizer")
            ax.barh(y - 0.17 if upper else y + 0.2, end - start, left=start - t0, height=0.4 if upper else 0.3,
                    color=GANTT_COLORS[c], lw=0)
            if c in ("F", "B") and end - start > span / 50:
                ax.text((start + end) / 2 - t0, y - 0.17, f"{c}{name.split()[1][3:]}", fontsize=6, ha="center",
                        va="center")
    ax.set_yticks(ranks, [names[r] for r in ranks], fontsize=7)
    ax.set_ylim(len(ranks) - 0.5, -0.6)
    ax.set_xlim(0, span)
    ax.set_xlabel("ms since the first rank left the start barrier (merged.json: one clock)", fontsize=FONT)
    ax.set_title("the profiled step of tp2 x pp2, drawn from picotron's trace (OUT/traces/merged.json): upper lane "
                 "work, lower lane communication", fontsize=9, loc="left")
    ax.tick_params(axis="x", labelsize=FONT)
    shown = {c for r in ranks for c, *_ in rows[r]}
    handles = [Patch(color=GANTT_COLORS[k], label=v) for k, v in GANTT_LABELS.items() if k in shown]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=FONT, frameon=False)
    fig.tight_layout(rect=(0, 1.1 / (0.6 * len(ranks) + 1.8), 1, 1))
    return fig


def plot_shares(res):
    """Per rank: where its step went (compute, each communication class, idle), stacked, in ms."""
    import matplotlib.pyplot as plt

    every = res["timed"]
    fig, ax = plt.subplots(figsize=(11, 3.2))
    parts = [("compute", "#6baed6", "compute (F, B, clipping, optimizer)")] + \
        [(c, GANTT_COLORS[c], GANTT_LABELS[c]) for c in COMM_CLASSES] + [("idle", "#eeeeee", "idle (nothing to do)")]
    bottom = [0.0] * len(every)
    for key, color, label in parts:
        vals = [1e3 * shares(r)[key] for r in every]
        ax.bar(range(len(every)), vals, 0.7, bottom=bottom, color=color, label=label, edgecolor="white", lw=0.3)
        bottom = [a + b for a, b in zip(bottom, vals)]
    ax.set_xticks(range(len(every)), [str(r["rank"]) for r in every], fontsize=FONT)
    ax.set(xlabel="rank", ylabel="ms of the step", title="where each rank's step went")
    ax.title.set_fontsize(9)
    legend_below(ax, ncol=4, dy=-0.22)
    fig.tight_layout()
    return fig


def matrix_table(matrix):
    """The parity matrix's rows as a grid: {(layout name, preset): {variant suffix: row}}, suffix '' (plain), '+sp',
    '+zero1', '+sp+zero1' (the ep = 2 rows of tiny-moe under their own layout names)."""
    grid = {}
    for r in matrix["rows"]:
        base, _, rest = r["variant"].partition("+")
        flags = [f for f in rest.split("+") if f and f != "ep2"] if rest else []
        key = base + ("+ep2" if r["layout"].get("ep", 1) > 1 else "")
        grid.setdefault(key, {})["+".join(flags)] = r
    return grid


MATRIX_COLUMNS = ("", "sp", "zero1", "sp+zero1")


def plot_matrix(matrix):
    """Every variant of the parity matrix: rows = layouts (1 to 16 processes, dense then MoE), columns = plain, +sp,
    +ZeRO-1, +both; the colour is the worst gradient difference relative to its tensor's largest gradient (log),
    grey = refused by the configuration, blank = not a variant (sp needs tp = 2, ZeRO-1 needs dp·cp > 1)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    grid = matrix_table(matrix)
    keys = sorted(grid, key=lambda k: ("+ep2" in k, k))
    fig, ax = plt.subplots(figsize=(8.5, 0.26 * len(keys) + 1.6))
    norm = LogNorm(1e-8, 1e-5)
    cmap = plt.get_cmap("viridis")
    for y, key in enumerate(keys):
        for x, col in enumerate(MATRIX_COLUMNS):
            r = grid[key].get(col)
            if r is None:
                continue
            if r.get("refused"):
                ax.add_patch(plt.Rectangle((x, y), 0.96, 0.9, color="#cccccc"))
                ax.text(x + 0.48, y + 0.45, "refused", ha="center", va="center", fontsize=6)
                continue
            v = max(r["grad_rel"], 1e-8)
            ax.add_patch(plt.Rectangle((x, y), 0.96, 0.9, color=cmap(norm(v))))
            ax.text(x + 0.48, y + 0.45, f"{r['grad_rel']:.0e} {'✓' if r['passed'] else '✗'} {r['wall_s']:.0f}s",
                    ha="center", va="center", fontsize=6, color="white" if norm(v) < 0.6 else "black")
    ax.set_xlim(0, len(MATRIX_COLUMNS))
    ax.set_ylim(len(keys), 0)
    ax.set_xticks([x + 0.48 for x in range(len(MATRIX_COLUMNS))], ["plain", "+ sp", "+ ZeRO-1", "+ sp + ZeRO-1"],
                  fontsize=FONT)
    ax.set_yticks([y + 0.45 for y in range(len(keys))],
                  [f"{k}  ({next(iter(grid[k].values()))['processes']} proc.)" for k in keys], fontsize=6.5)
    ax.tick_params(length=0)
    sm = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
    fig.colorbar(sm, ax=ax, shrink=0.6, label="worst |Δgrad| / max |grad| of its tensor, one step")
    ax.set_title("the parity matrix (figures/09_parity_matrix.json): every variant against one process", fontsize=9)
    fig.tight_layout()
    return fig


def plot_memory_check(pm):
    """Every layout of benchmarks/planner_memory.py: its worst rank's measured bytes by part (bars) against the
    planner's prediction for its stage (black ticks: the total), fp32, recipe "ours"."""
    import matplotlib.pyplot as plt

    rows = pm["rows"]
    fig, ax = plt.subplots(figsize=(13, 3.6))
    for x, r in enumerate(rows):
        bottom = 0.0
        for part in MEM_PARTS:
            ax.bar(x, r["measured"][part] / MiB, 0.7, bottom=bottom, color=MEM_COLORS[part], label=part if x == 0 else None)
            bottom += r["measured"][part] / MiB
        ax.plot(x, sum(r["predicted"][k] for k in MEM_PARTS) / MiB, "k_", ms=11, mew=2,
                label="predicted total" if x == 0 else None)
    names = [",".join(f"{k}{v}" if not isinstance(v, (bool, str)) else (k if v is True else str(v))
                      for k, v in r["layout"].items()) or "one process" for r in rows]
    ax.set_xticks(range(len(rows)), names, rotation=60, ha="right", fontsize=6.5)
    ax.set(ylabel="MiB on the worst rank", title="the planner's memory against 30 measured layouts (tiny and tiny-moe, "
                                                  f"s = {pm['settings']['seq_len']}, micro-batch "
                                                  f"{pm['settings']['micro_batch_size']}, fp32)")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=FONT, ncol=5, frameon=False)
    fig.tight_layout()
    return fig


def plot_time_check(pt):
    """Every layout of benchmarks/planner_time.py: measured step time (x) against the planner's prediction (y) on this
    machine as plan.cpu_hardware describes it (left), and the predicted step by part beside the measured total (right)."""
    import matplotlib.pyplot as plt

    rows = pt["rows"]
    order = sorted(range(len(rows)), key=lambda i: rows[i]["measured"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.4), gridspec_kw=dict(width_ratios=[1, 2]))
    two = [i for i in order if rows[i]["processes"] == 2]
    for k, i in enumerate(order):
        if rows[i]["processes"] == 2:
            ax1.plot(rows[i]["measured"], rows[i]["predicted"], "o", color="C0", ms=4)
            ax1.annotate(str(k + 1), (rows[i]["measured"], rows[i]["predicted"]), fontsize=6.5, xytext=(2, 2),
                         textcoords="offset points")
    lo = min(min(rows[i]["measured"], rows[i]["predicted"]) for i in two) * 0.95
    hi = max(max(rows[i]["measured"], rows[i]["predicted"]) for i in two) * 1.03
    ax1.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax1.set(xlim=(lo, hi), ylim=(lo, hi), xlabel="measured step time (s)", ylabel="predicted (s)",
            title=f"the {len(two)} two-process layouts (numbered as on the right): Spearman "
                  f"{pt['spearman_two_process']:.2f}")
    for x, i in enumerate(order):
        bottom = 0.0
        for part in ("compute", "tp", "cp", "pp", "bubble", "dp"):
            v = rows[i]["parts"][part]
            ax2.bar(x - 0.18, v, 0.36, bottom=bottom, color=STEP_COLORS[part], label=part if x == 0 else None)
            bottom += v
        ax2.bar(x + 0.18, rows[i]["measured"], 0.36, color="0.6", label="measured" if x == 0 else None)
    ax2.set_xticks(range(len(rows)), [f"{x + 1}: {rows[i]['name']}" + (" (1 proc.)" if rows[i]["processes"] == 1 else "")
                                      for x, i in enumerate(order)], rotation=60, ha="right", fontsize=6)
    ax2.set(ylabel="seconds per step", title=f"predicted by part (left bar) and measured (grey), fastest first; "
                                             f"Spearman over all {len(rows)}: {pt['spearman']:.2f}")
    ax2.legend(fontsize=FONT, ncol=7, frameon=False)
    for ax in (ax1, ax2):
        ax.title.set_fontsize(9)
    fig.tight_layout()
    return fig


def plot_decisions(rows):
    """The best layout the planner finds for each model (lines) against the number of GPUs: predicted MFU (left) and
    memory per GPU of that layout (right), each point labelled with its degrees."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.8))
    for name in dict.fromkeys(r["name"] for r in rows):
        mine = [r for r in rows if r["name"] == name and r["plan"].ranked]
        xs = [r["gpus"] for r in mine]
        line, = ax1.plot(xs, [100 * r["plan"].ranked[0][2]["mfu"] for r in mine], "o-", label=name)
        ax2.plot(xs, [r["plan"].ranked[0][1]["total"] / 2**30 for r in mine], "o-", color=line.get_color(), label=name)
        for r in mine:
            lay = r["plan"].ranked[0][0]
            short = "·".join(f"{d}{getattr(lay, d)}" for d in ("tp", "pp", "cp", "dp") if getattr(lay, d) > 1)
            ax1.annotate(short + (f" z{lay.zero}" if lay.zero else ""), (r["gpus"], 100 * r["plan"].ranked[0][2]["mfu"]),
                         fontsize=6, xytext=(3, 3), textcoords="offset points", color=line.get_color())
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ticks = sorted({r["gpus"] for r in rows})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("GPUs (H100 80 GB, 8 per node)", fontsize=FONT)
        ax.tick_params(labelsize=FONT)
        legend_below(ax, ncol=3, dy=-0.18)
    from picotron import plan

    ax1.axhline(100 * plan.EFFICIENCY, color="k", ls=":", lw=0.8)
    ax1.text(ax1.get_xlim()[0], 100 * plan.EFFICIENCY - 0.3, f" dotted: the assumed kernel efficiency, "
             f"{100 * plan.EFFICIENCY:.0f}% (plan.EFFICIENCY, an input of the model): MFU's ceiling", fontsize=6, va="top")
    ax1.set_ylim(top=100 * plan.EFFICIENCY + 1.5)
    ax1.set(ylabel="predicted MFU of the best layout (%)", title="step 3: the fastest layout that fits and reaches "
                                                                 "the batch")
    hw, card = rows[0]["hw"], rows[0].get("card", rows[0]["hw"])
    ax2.axhline(hw.memory / 2**30, color="k", ls="--", lw=0.8)
    ax2.set(ylabel="GiB per GPU (busiest stage)", title=f"its memory (dashed: the {hw.memory / 2**30:.1f} GiB a layout "
                                                         f"may use of an {card.name.split()[0]}'s "
                                                         f"{card.memory / 2**30:.1f})")
    for ax in (ax1, ax2):
        ax.title.set_fontsize(9)
    fig.tight_layout()
    return fig


def distinct(ranked, top):
    """The fastest layout of each shape (dp, tp, pp, cp, ep), in rank order, at most `top` of them: many layouts tie
    (the same degrees with another ZeRO stage or micro-batch size), and one of each shape says more."""
    seen, out = set(), []
    for row in ranked:
        key = tuple(getattr(row[0], d) for d in ("dp", "tp", "pp", "cp", "ep"))
        if key not in seen:
            seen.add(key)
            out.append(row)
        if len(out) == top:
            break
    return out


def plot_plan(job, top=6):
    """The fastest layout of each of the `top` fastest shapes of one job: memory per GPU by part against the budget
    (left) and the predicted step time by part (right), with tokens/s and MFU."""
    import matplotlib.pyplot as plt

    ranked = distinct(job["plan"].ranked, top)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.45 * max(len(ranked), 1) + 1.9))
    names = [str(lay).replace(",recompute-", ",rc-") for lay, _, _ in ranked]
    for y, (lay, mem, t) in enumerate(ranked):
        left = 0.0
        for part in MEM_PARTS:
            ax1.barh(y, mem[part] / 2**30, left=left, color=MEM_COLORS[part], label=part if y == 0 else None)
            left += mem[part] / 2**30
        left = 0.0
        for part in STEP_PARTS:
            if t[part] > 0:
                ax2.barh(y, t[part], left=left, color=STEP_COLORS[part], label=part if part not in
                         [p for q in ranked[:y] for p in STEP_PARTS if q[2][p] > 0] else None)
                left += t[part]
        ax2.text(left, y, f" {t['tokens_per_s']:,.0f} tok/s, MFU {100 * t['mfu']:.0f}%", va="center", fontsize=7)
    ax1.axvline(job["hw"].memory / 2**30, color="k", ls="--", lw=1, label="usable memory per GPU")
    for ax in (ax1, ax2):
        ax.set_yticks(range(len(ranked)), names if ax is ax1 else [""] * len(ranked), fontsize=6.5)
        ax.set_ylim(len(ranked) - 0.5, -0.5)
        ax.tick_params(axis="x", labelsize=FONT)
        legend_below(ax, ncol=4, dy=-0.25 if len(ranked) > 3 else -0.4)
    ax1.set_xlabel("GiB per GPU (bf16 mixed precision: 2 + 2 + 12 bytes per parameter)", fontsize=FONT)
    ax2.set_xlabel("predicted seconds per step", fontsize=FONT)
    ax2.set_xlim(0, max((t["total"] for _, _, t in ranked), default=1) * 1.45)
    card = job.get("card", job["hw"])
    fig.suptitle(f"{job['name']} on {job['gpus']} x {card.name} ({card.memory / 2**30:.1f} GiB, "
                 f"{job['hw'].memory / 2**30:.1f} usable), sequences of "
                 f"{job['seq_len']}, {job['global_seqs']} per step: {len(job['plan'].ranked)} layouts fit, "
                 f"{len(job['plan'].rejected)} rejected", fontsize=9)
    fig.tight_layout()
    return fig


def plot_parity(pairs):
    return plot_parity_below(pairs, "the 4-D run", height=4.0)


# ------------------------------------------------------------------------------------------------ main
def main(argv=None):
    args, names, out = _common.cli("09_all_together", EXPERIMENTS, __doc__, argv=argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    st = settings(args.fast)
    layout = st["layout"]
    if world != math.prod(layout.values()):
        sys.exit(f"the layout {layout_name(layout)} needs {math.prod(layout.values())} processes: torchrun "
                 f"--nproc_per_node {math.prod(layout.values())} lessons/09_all_together/experiment.py")
    mesh = Mesh.init(**layout, device=_common.experiment_device("09_all_together"))
    with mesh:  # on success every rank meets at a barrier before the groups go (Mesh.destroy)
        _common.run_experiments(names, lambda name: globals()[f"exp_{name}"](mesh, st, out),
                                lambda name: out / f"{name}_{layout_name(layout)}.json",
                                _common.environment(mesh, settings=st), mesh.rank)


if __name__ == "__main__":
    main()
