"""Lesson 05's experiments: tensor (and sequence) parallelism measured through picotron's own seam (`parallelize`,
as picotron.train runs it), and the notebook's formulas, puzzle planner and plots.

    torchrun --nproc_per_node 2 lessons/05_tensor_parallel/experiment.py [--only comm,memory,scaling,dtensor,parity]
    torchrun --nproc_per_node 4 lessons/05_tensor_parallel/experiment.py --only grid --dp 2    # dp=2 x tp=2, ZeRO-1
    torchrun --nproc_per_node 2 lessons/05_tensor_parallel/experiment.py --only partitioned     # ZeRO-R's Pa
    torchrun --nproc_per_node 2 lessons/05_tensor_parallel/experiment.py --only asynctp         # the collective matmul
    PICOTRON_FAST=1 ...    # short settings (the notebook's FAST mode)

Rank 0 writes OUT/<name>_tp<t>.json (grid: OUT/grid_dp<d>_tp<t>.json); with one process the references. comm: every
collective of one step at 2 and at 4 layers (per layer, against `megatron_pattern`); memory: activations by part
and model states against the formulas; scaling: steps of sp off and on, interleaved; dtensor: ours against torch's
DTensor (benchmarks/tp_vs_dtensor.py); parity: picotron.train at tp = world size; grid: picotron.train on a
dp x tp grid with ZeRO-1 (its groups, the rows each rank reads, the losses); partitioned: no, full and partitioned
recomputation (the bytes kept per layer, the all-gathers, the step times); asynctp: blocking sp against async TP's
collective matmul on the same layers, weights and batch (benchmarks/async_tp_bench.py: timelines, exposed
communication per layer against planner.async_tp_layer_seconds, the throughput ratio, and the two variants' outputs
and gradients compared). Timed variants share one process group, one step of each in turn; a step takes as long as
its slowest rank.
"""
from collections import Counter
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/
import _common  # noqa: E402  (puts the repository root on sys.path)
from _common import SIZES, gather, make_cfg, run_interleaved, say  # noqa: E402
from _plots import FONT, legend_below, plot_parity_below, stacked_bar  # noqa: E402  (shared figure helpers)

import torch  # noqa: E402

from picotron import data, marks, metrics, planner, tensor_parallel  # noqa: E402
from picotron.config import Config  # noqa: E402
from picotron.mesh import Axis, Mesh, grid_coords, group_ranks  # noqa: E402
from picotron.model import Llama, ModelConfig  # noqa: E402
from picotron.parallelize import parallelize  # noqa: E402
# With sp, the copies of a block's all-gathered input [b, s, h] autograd keeps: our all-gather returns a transposed
# view and F.linear keeps a contiguous copy of it per projection reading it (q, k, v; gate, up): 3 and 2. Without sp
# they share the norm's output: 1 and 1. (The memory experiment measures which is the case.)
from picotron.planner import SP_INPUT_COPIES  # noqa: E402
from picotron.train import load_data, train  # noqa: E402

# SIZES["small"]: the tiny preset widened (3.3 M parameters), as in lessons 03 and 04: 8 heads, 4 KV heads, so tp = 1,
# 2, 4.
MiB = 2**20
OPS = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
       "broadcast": "broadcast"}  # metrics.Recorder's kinds of collective, as the lesson prints them
PARTS = ("params", "grads", "optimizer")
LAYER_PARTS = ("norm (input)", "attention", "norm (post-attention)", "mlp")
MODEL_PARTS = ("embedding", "final norm", "lm_head", "loss")
COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52",
          "model states": "0.65", "all_reduce": "#8172b2", "all_gather": "#4c72b0", "reduce_scatter": "#dd8452",
          "compute and the rest": "#8da0cb", "inside collectives": "#fc8d62",
          **dict(zip(LAYER_PARTS, ["#8da0cb", "#fc8d62", "#a6d854", "#e78ac3"]))}
RANK_COLORS = ["#8dd3c7", "#fdb462", "#bebada", "#fb8072", "#80b1d3", "#b3de69", "#fccde5", "#d9d9d9"]


def settings(fast, device_type=None):
    """Model and batch of the experiments (every tp rank sees the whole batch), and the steps per variant; on GPUs
    _common.GPU_SETTINGS["05_tensor_parallel"] on top (device_type: the mesh's, else _common.device())."""
    st = dict(size="small", seq_len=128, micro_batch_size=4, steps=3 if fast else 30, warmup=1 if fast else 3,
              dtensor_steps=4 if fast else 60, parity_steps=10 if fast else 20, parity_seq_len=64,
              partitioned_steps=3 if fast else 10, asynctp_steps=4 if fast else 20, asynctp_link_ratio=2.0)
    return _common.sized("05_tensor_parallel", st, fast, device_type)


# ------------------------------------------------------------------- shard shapes, without processes
def tp_problem(mc, tp):
    """Why tensor parallelism cannot cut this model tp ways (`tensor_parallel.check`'s sentence), or None."""
    return tensor_parallel.check(Config(tp=tp), mc)


def _require(mc, tp):
    if tp_problem(mc, tp):
        raise ValueError(tp_problem(mc, tp))


def _kind(name):
    """(how tensor parallelism cuts a parameter, the dimension it cuts: None = replicated)."""
    if name.endswith("norm.weight"):
        return "replicated", None
    if name.startswith(("embed_tokens", "lm_head")):
        return ("vocab-parallel (rows)" if name.startswith("embed") else "column-parallel (vocabulary)"), 0
    return ("row-parallel", 1) if name.endswith(("o_proj.weight", "down_proj.weight")) else ("column-parallel", 0)


def shard_shapes(mc, tp, sp=False):
    """{rank: [dict(name, full, shard, dim, lo, hi, kind)]}: what each rank holds of layer 0, the embedding, the
    final norm and the LM head (a tied head listed as the embedding's matrix), from `tensor_parallel.apply` on a
    one-layer copy on the meta device over `Axis.alone("tp", tp, rank)`. dim: the dimension cut (None: replicated);
    [lo, hi): this rank's rows or columns. Raises ValueError for a tp that does not cut the model into whole slices."""
    _require(mc, tp)
    out = {}
    for rank in range(tp):
        with torch.device("meta"):
            model = Llama(replace(mc, num_hidden_layers=1))
        tensor_parallel.apply(model, Axis.alone("tp", tp, rank), sp=sp)
        out[rank] = []
        for name, p in model.named_parameters():
            kind, dim = _kind(name)
            where = marks.placement(p)  # what tensor_parallel.apply placed on it: the full shape, the cut dimension
            dim, full = (where.split_dim if tp > 1 else dim), where.shape
            lo, hi = (0, full[0]) if dim is None else (rank * full[dim] // tp, (rank + 1) * full[dim] // tp)
            out[rank].append(dict(name=name, full=full, shard=tuple(p.shape), dim=dim, lo=lo, hi=hi, kind=kind))
        if mc.tie_word_embeddings:
            emb = next(r for r in out[rank] if r["name"] == "embed_tokens.weight")
            out[rank].append(dict(emb, name="lm_head.weight", kind="tied to embed_tokens.weight"))
    return out


def valid_tps(mc, candidates=(1, 2, 3, 4, 5, 6, 8, 16, 32, 64)):
    return [t for t in candidates if tp_problem(mc, t) is None]


def params_per_rank(mc, tp):
    """Every matrix (embedding and LM head included) divided by tp; the 2L + 1 norm weights replicated."""
    replicated = (2 * mc.num_hidden_layers + 1) * mc.hidden_size
    return (mc.num_params() - replicated) // tp + replicated


# ------------------------------------------------------------------------------------------- formulas
def rank_state_bytes(mc, tp, recipe="ours"):
    """Model-state bytes per rank (planner.model_state_bytes of the parameters a rank holds). "ours": fp32 params 4
    + grads 4 + AdamW 8 per parameter + AdamW's 4-byte step per tensor (what our trainer holds); "mixed": the
    textbook bf16 recipe 2 + 2 + 12 (docs/reference.md)."""
    n = params_per_rank(mc, tp)
    if recipe == "mixed":
        return planner.model_state_bytes(n, "bf16")
    return planner.model_state_bytes(n, "fp32", tensors=planner.param_tensors(mc))



def activation_parts(mc, seq_len, micro_batch_size, tp=1, sp=False):
    """Bytes one rank keeps for backward, by part (fp32, sdpa, no recomputation): exact for our code. Per layer
    (t = tp): each norm 8sbh + 4sb (with sp /t); attention: its whole input 4sbh (sp: SP_INPUT_COPIES of it), q, k,
    v after RoPE and the output of this rank's heads 4sb(2h + 2kd)/t, the logsumexp 4a·sb/t; mlp: its whole input
    (sp: copies), gate, silu, up, product 16sb·i/t. Outside: the ids (t = 1: the loader's rows 8b(s+1); else 9sb
    with the mask), the RoPE tables 8sd, the final norm, the LM head's input 4sbh, the loss (t = 1: log-softmax
    4sbv + targets 8sb + 4; else this rank's softmax columns 4sbv/t + local targets and mask 9sb)."""
    s, b, h, i, a, v = (seq_len, micro_batch_size, mc.hidden_size, mc.intermediate_size, mc.num_attention_heads,
                        mc.vocab_size)
    kd, t, sbh, sb = mc.num_key_value_heads * mc.head_dim, tp, s * b * h, s * b
    norm = (8 * sbh + 4 * sb) / (t if sp else 1)
    copies = SP_INPUT_COPIES if sp and t > 1 else {"attention": 1, "mlp": 1}
    return {"per layer": {"norm (input)": norm, "norm (post-attention)": norm,
                          "attention": copies["attention"] * 4 * sbh + (4 * sb * (2 * h + 2 * kd) + 4 * a * sb) / t,
                          "mlp": copies["mlp"] * 4 * sbh + 16 * sb * i / t},
            "model": {"embedding": 8 * b * (s + 1) if t == 1 else 9 * sb, "rope tables": 8 * s * mc.head_dim,
                      "final norm": norm, "lm_head": 4 * sbh,
                      "loss": 4 * sb * v + 8 * sb + 4 if t == 1 else 4 * sb * v / t + 9 * sb}}


def activation_bytes(mc, seq_len, micro_batch_size, tp=1, sp=False):
    parts = activation_parts(mc, seq_len, micro_batch_size, tp, sp)
    return mc.num_hidden_layers * sum(parts["per layer"].values()) + sum(parts["model"].values())


def replicated_and_sharded(mc, seq_len, micro_batch_size, sp=False):
    """Our per-layer formula as R + S/t bytes (R whole on every rank, S divided by t), read off t = 2 and 4."""
    two, four = (sum(activation_parts(mc, seq_len, micro_batch_size, t, sp)["per layer"].values()) for t in (2, 4))
    return 2 * four - two, 4 * (two - four)


def memory_per_rank(mc, tp, sp=False, seq_len=4096, micro_batch_size=1, flash=True):
    """The widget's bytes per rank: model states (mixed precision, 16 per parameter held) + the layers'
    activations (Korthikanti's bf16 formula x L). Raises ValueError for a tp the model does not allow."""
    _require(mc, tp)
    out = rank_state_bytes(mc, tp, recipe="mixed")
    out["activations"] = mc.num_hidden_layers * planner.korthikanti_bytes_per_layer(
        seq_len, micro_batch_size, mc.hidden_size, mc.num_attention_heads, tp=tp, sp=sp, flash=flash)
    return out | {"total": sum(out.values())}


def megatron_pattern(b, s, h, sp, elem=4):
    """Megatron's collectives per layer, {phase: {(op, bytes): calls}}: without sp 2 all-reduces of the b·s·h
    activation forward (the g's) and 2 backward (the f's); with sp each becomes an all-gather entering a block and
    a reduce-scatter leaving it, both ways, plus (ours) the all-reduce of the norm weights' gradients (h each)."""
    act = elem * b * s * h
    if not sp:
        return {"forward": {("all_reduce", act): 2}, "backward": {("all_reduce", act): 2}}
    both = {("all_gather", act): 2, ("reduce_scatter", act): 2}
    return {"forward": both, "backward": {**both, ("all_reduce", elem * h): 2}}


# ----------------------------------------------------------------------------------------- the puzzle
# Exercise 4: train the 'small' model on global batches of 8 sequences of 128 tokens (dp = 1, so micro-batch x
# accumulation = 8) within a budget of MiB per rank, as fast as possible. check.py grades answers with these.
PUZZLE = dict(size="small", seq_len=128, global_batch=8, budgets_mib=(160, 100, 64, 40, 23, 12))


def puzzle_model():
    return ModelConfig.from_preset("tiny", **SIZES[PUZZLE["size"]])


def rank_bytes(mc, tp, sp, micro_batch_size, seq_len=PUZZLE["seq_len"]):
    """The puzzle's bytes per rank: model states + ONE micro-batch's activations (each freed in its backward)."""
    return sum(rank_state_bytes(mc, tp).values()) + activation_bytes(mc, seq_len, micro_batch_size, tp, sp)


def layouts(mc, global_batch=PUZZLE["global_batch"]):
    """Every (tp, sp, micro_batch_size) of the job, fastest first by the puzzle's ranking: the fewest tp ranks,
    then the largest micro-batch, then sp off."""
    every = [(t, sp, b) for t in valid_tps(mc) for sp in ((False, True) if t > 1 else (False,))
             for b in range(1, global_batch + 1) if global_batch % b == 0]
    return sorted(every, key=lambda x: (x[0], -x[2], x[1]))


def best_plan(budget_mib, mc=None):
    """The fastest layout that fits `budget_mib` MiB per rank, or None."""
    mc = mc or puzzle_model()
    return next((x for x in layouts(mc) if rank_bytes(mc, *x) <= budget_mib * MiB), None)


# ----------------------------------------------------------------------------------- measuring tools
def by_phase(recorder):
    """[(phase, kind, bytes, seconds)] of every collective `recorder` counted, in order; phase: the schedule's event
    it started in on their shared timeline ("forward" with the loss, "backward", "wait"), else "step" (clipping).
    Seconds: call to return (gloo blocks: the transfer plus the wait for the slowest peer)."""
    phases = [e for e in recorder.timeline.events if e.get("kind") != "comm"]
    comms = [e for e in recorder.timeline.events if e.get("kind") == "comm"]
    if len(comms) != len(recorder.log):  # tensor parallelism's collectives are synchronous: one event each
        raise RuntimeError(f"{len(recorder.log)} collectives counted but {len(comms)} timed: an asynchronous one?")
    return [(next((p["name"] for p in phases if p["start"] <= e["start"] <= p["end"]), "step"), kind, nbytes,
             e["end"] - e["start"]) for (kind, nbytes, _axis), e in zip(recorder.log, comms)]


def counts(calls, phase):
    """{(kind, bytes): calls} of one phase of `by_phase`'s list."""
    return dict(Counter((kind, nbytes) for p, kind, nbytes, _ in calls if p == phase))


class PartCounter(metrics.ActivationCounter):
    """An ActivationCounter that also credits each saved storage to the part of the model running when autograd
    saved it (hooks on the embedding, each layer's norms, attention and MLP, the final norm, the LM head; outside
    them: the loss): `.parts[label]`."""

    def __init__(self, model):
        super().__init__(model)
        self.parts, self._stack, self._handles = {}, ["loss"], []
        self._modules = [("embedding", model.embed_tokens), ("final norm", model.norm), ("lm_head", model.lm_head)]
        for k, layer in enumerate(model.layers):
            self._modules += [(f"{k}/{p}", m) for p, m in zip(LAYER_PARTS, (
                layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp))]

    def _pack(self, t):
        before = self.bytes
        super()._pack(t)
        self.parts[self._stack[-1]] = self.parts.get(self._stack[-1], 0) + self.bytes - before
        return t

    def __enter__(self):
        for label, m in self._modules:
            self._handles += [m.register_forward_pre_hook(lambda *_, label=label: self._stack.append(label)),
                              m.register_forward_hook(lambda *_: self._stack.pop() and None)]  # None: output kept
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        return super().__exit__(*exc)

    def summary(self, n_layers):
        """{"per layer": the LAST layer's parts, "model": the rest ("rope tables": the first layer's attention minus
        the last's), "total"}."""
        layer = {p: self.parts.get(f"{n_layers - 1}/{p}", 0) for p in LAYER_PARTS}
        model = {p: self.parts.get(p, 0) for p in MODEL_PARTS} | {
            "rope tables": self.parts.get("0/attention", 0) - layer["attention"]}
        return {"per layer": layer, "model": model, "total": self.bytes}


class Variant:
    """One layout, built and stepped as picotron.train does: `parallelize(cfg, mesh)`, then per step `schedule.run`
    (forward, loss, backward), `marks.clip_grad_norm`, `optimizer.step()`, `zero_grad()`. Built once on
    `mesh.recorded(recorder)`: the same groups, with every collective of the model, its gradient sync and the
    clipping counted and timed by one `metrics.Recorder`, on a Timeline shared with the schedule (`by_phase`)."""

    def __init__(self, name, cfg, mesh):
        self.name, self.cfg, self.device = name, cfg, mesh.device
        self.recorder = metrics.Recorder(metrics.Timeline(mesh.device, mesh.rank))
        self.mesh = mesh.recorded(self.recorder)
        self.run = parallelize(cfg, self.mesh)
        self.activations = metrics.ActivationPeak(self.run.model)  # what autograd keeps, as the trainer counts it
        self.run.schedule.phases.listen(self.activations)
        self.run.schedule.phases.listen(self.recorder.timeline.record)  # the phases, on the collectives' timeline
        self.loader = load_data(cfg, mesh)[1]  # the trainer's loader: every tp rank reads the same rows
        self.calls, self.times, self.comm_times, self.losses = [], [], [], []  # calls: (phase, kind, bytes, s)
        self.activation_bytes = self.parts = self.states = None

    def step(self, step, record=True):
        run = self.run
        self.recorder.reset()
        self.recorder.timeline.events.clear()
        metrics.sync(self.device)
        t0 = time.perf_counter()
        loss = run.schedule.run(run.model, self.loader.micro_batches(step), run.loss_fn)
        marks.clip_grad_norm(run.params, self.cfg.grad_clip, self.mesh)
        states = run.model.memory()  # params and grads, as picotron.train measures them: before the update
        run.optimizer.step()
        run.model.zero_grad(set_to_none=True)
        self.losses.append(loss.item())
        metrics.sync(self.device)
        elapsed, calls = time.perf_counter() - t0, by_phase(self.recorder)
        self.calls += calls
        if record:
            self.times.append(elapsed)
            self.comm_times.append(sum(c[3] for c in calls))
        self.states = {k: states[k] for k in PARTS[:2]} | {"optimizer": metrics.optimizer_bytes(run.optimizer)}
        self.activation_bytes = self.activations.bytes

    def count_parts(self, step):
        """The bytes autograd keeps, by part (`PartCounter`), over one more forward and loss of step `step`'s first
        micro-batch, nothing trained (the schedule counts only the total; the two must agree)."""
        x, y, positions = (t.to(self.device) for t in self.loader.micro_batches(step)[0])
        counter = PartCounter(self.run.raw)
        with self.run.schedule.autocast(), counter:
            self.run.loss_fn(self.run.model(x, positions), y)
        self.parts = counter.summary(len(self.run.raw.layers))


def slowest(values, mesh):
    """Per step, the largest value over the ranks."""
    return [max(r) for r in zip(*gather(values, mesh))]


def tp_counts():
    """The tp of the main runs (4(a)-(c): comm, memory, scaling): 1, 2 and 4, and 8 with PICOTRON_NPROC=8."""
    return (1, 2, 4) if _common.nproc("05_tensor_parallel", 4) == 4 else (1, 2, 4, 8)


def model_overrides():
    """The model's changes for the main runs: with PICOTRON_NPROC=8, 8 KV heads (4 in SIZES), at every tp of them,
    so that tp = 8 has a whole KV head per rank (rules.tp_shape_problem) and all the runs compare one model."""
    return {"num_key_value_heads": 8} if max(tp_counts()) == 8 else {}


def variant_configs(t, st, **kw):
    """The Configs of the main runs at tp = t, sp off (and on, at t > 1)."""
    return [make_cfg(st["size"], tp=t, sp=sp, seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"],
                     **model_overrides(), **kw) for sp in ((False, True) if t > 1 else (False,))]


def configs_at(nproc, fast=False):
    """The Configs the lesson's main runs train on `nproc` processes (tests/test_lesson_node.py validates them at
    world size 8)."""
    return variant_configs(nproc, settings(fast))


def variants(mesh, st, **kw):
    """The experiment's layouts on this mesh, sp off (and on, at tp > 1)."""
    t = mesh.tp.size
    return [Variant(f"tp={t}" + " + sp" * cfg.sp, cfg, mesh) for cfg in variant_configs(t, st, **kw)]


def _keys_to_str(d):
    """{phase: {(op, bytes): calls}} -> {phase: {"op bytes": calls}} (JSON keys must be strings)."""
    return {p: {f"{op} {nb}": c for (op, nb), c in sorted(inner.items())} for p, inner in d.items()}


def parse_counts(d):
    """The inverse of _keys_to_str."""
    return {p: {(k.split()[0], int(k.split()[1])): c for k, c in inner.items()} for p, inner in d.items()}


# --------------------------------------------------------------------------------------------- experiments
def exp_comm(mesh, st, out, lo=2, hi=4):
    """One forward + backward + clipping at lo and hi layers, sp off and on: every collective, counted."""
    rows, (b, s, h) = [], (st["micro_batch_size"], st["seq_len"], SIZES[st["size"]]["hidden_size"])
    for shallow, deep in zip(variants(mesh, st, num_hidden_layers=lo), variants(mesh, st, num_hidden_layers=hi)):
        for v in (shallow, deep):
            v.step(1)
        n = {layers: {p: counts(v.calls, p) for p in ("forward", "backward", "wait", "step")}
             for layers, v in ((lo, shallow), (hi, deep))}
        per_layer = {p: {k: c for k in n[hi][p].keys() | n[lo][p].keys()
                         if (c := (n[hi][p].get(k, 0) - n[lo][p].get(k, 0)) / (hi - lo))} for p in n[hi]}
        outside = {p: {k: c for k in n[lo][p].keys() | per_layer[p].keys()
                       if (c := n[lo][p].get(k, 0) - lo * per_layer[p].get(k, 0))} for p in n[lo]}
        expected = megatron_pattern(b, s, h, deep.cfg.sp)
        rows.append(dict(name=deep.name, sp=deep.cfg.sp, b=b, s=s, h=h, per_layer=_keys_to_str(per_layer),
                         outside=_keys_to_str(outside), expected=_keys_to_str(expected),
                         matches=all(per_layer[p] == expected[p] for p in expected),
                         calls=[list(c) for c in deep.calls]))  # the deeper model's calls, in order
        say(mesh, f"{deep.name:<10} per layer: " + " | ".join(f"{p}: " + ", ".join(
            f"{c:g} {OPS[op]} of {nb / 1024:.0f} KiB" for (op, nb), c in sorted(per_layer[p].items()))
            for p in expected) + f"  -> Megatron's pattern: {'yes' if rows[-1]['matches'] else 'NO'}")
    return dict(rows=rows)


def exp_memory(mesh, st, out):
    """One step of each variant: activations by part (and in total), model states per rank, with formulas."""
    rows, t, s, b = [], mesh.tp.size, st["seq_len"], st["micro_batch_size"]
    for v in variants(mesh, st):
        v.step(1, record=False)
        v.count_parts(1)
        mc, sp = v.run.raw.config, v.cfg.sp
        rows.append(dict(name=v.name, sp=sp, parts_by_rank=gather(v.parts, mesh), states_by_rank=gather(v.states, mesh),
                         schedule_by_rank=gather(v.activation_bytes, mesh), formula=activation_parts(mc, s, b, t, sp),
                         formula_total=activation_bytes(mc, s, b, t, sp), formula_states=rank_state_bytes(mc, t),
                         params_per_rank=sum(p.numel() for p in v.run.raw.parameters())))
        say(mesh, f"{v.name:<10} rank 0: activations {v.parts['total'] / MiB:6.2f} MiB (formula "
                   f"{rows[-1]['formula_total'] / MiB:6.2f}, the step schedule's count {v.activation_bytes / MiB:6.2f}) | "
                   "model states " + ", ".join(f"{k} {v.states[k] / MiB:.2f}" for k in PARTS) + " MiB")
    return dict(rows=rows)


def exp_scaling(mesh, st, out):
    """Steps of sp off and sp on, interleaved: step time, tokens/s, time inside collectives."""
    vs, rows = variants(mesh, st), []
    run_interleaved(vs, st["steps"], st["warmup"], mesh.tp.group)
    tokens_per_step = st["micro_batch_size"] * st["seq_len"]
    act = 4 * tokens_per_step * SIZES[st["size"]]["hidden_size"]
    for v in vs:
        times, comm = slowest(v.times, mesh), slowest(v.comm_times, mesh)
        per_call = {op: dict(median_s=statistics.median(secs), per_step=len(secs) / (st["steps"] + st["warmup"]))
                    for op in OPS if (secs := [c[3] for c in v.calls if c[1] == op and c[2] == act])}
        q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        rows.append(dict(name=v.name, sp=v.cfg.sp, step_times=times, comm_times=comm, q1=q[0], q3=q[2],
                         median=statistics.median(times),
                         comm_median=statistics.median(comm), tokens_per_s=tokens_per_step / statistics.median(times)))
        say(mesh, f"{v.name:<10} {1e3 * rows[-1]['median']:7.1f} ms/step, {rows[-1]['tokens_per_s']:7,.0f} tokens/s, "
                   f"{1e3 * rows[-1]['comm_median']:6.1f} ms in collectives" + "".join(
                       f" | {c['per_step']:g} {OPS[op]}s of {act // 1024} KiB per step, {1e3 * c['median_s']:.2f} ms each"
                       for op, c in per_call.items()))
    return dict(threads=torch.get_num_threads(), rows=rows)


def exp_dtensor(mesh, st, out):
    """Ours vs torch's DTensor tensor parallelism, sp off and on, one step of each in turn: per-round throughput
    ratio, both one's losses and model states; and the unsharded model's losses on the same batches."""
    from benchmarks import tp_vs_dtensor as bench  # the repository root is on sys.path (_common)

    result = dict(tp=mesh.tp.size, runs={})
    for sp in (False, True):
        rows = bench.compare(bench.make_cfg(st["size"], seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"],
                                            tp=mesh.tp.size, sp=sp), mesh, st["dtensor_steps"], warmup=st["warmup"] + 1)
        med, q1, q3 = bench.paired(rows)
        name = f"tp={mesh.tp.size}" + " + sp" * sp
        result["runs"][name] = dict(sp=sp, rows=rows,
                                    ratio=dict(median=med, q1=q1, q3=q3, n=len(rows[0]["step_times"])))
        say(mesh, f"{name:<10} " + " | ".join(f"{r['name']} {1e3 * r['median']:7.2f} ms/step" for r in rows) +
                   f" | ours / DTensor throughput: median {med:.3f} (quartiles {q1:.3f}-{q3:.3f})")
    ref = Variant("one process", make_cfg(st["size"], seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"]),
                  Mesh.local(mesh.device))  # in each process, no collectives
    for step in range(len(rows[0]["losses"])):
        ref.step(step + 1, record=False)
    return result | {"reference_losses": ref.losses}


def _trained(mesh, st, out, name, **kw):
    """picotron.train on this mesh with the parity settings: (cfg, its summary, the per-step losses on rank 0)."""
    cfg = make_cfg(st["size"], steps=st["parity_steps"], seq_len=st["parity_seq_len"], warmup_steps=2, lr=3e-3,
                   log_every=st["parity_steps"], out=str(Path(out) / name), **kw)
    summary = train(cfg, mesh)
    return cfg, summary, ([r["loss"] for r in metrics.read_metrics(cfg.out)[0]] if mesh.rank == 0 else None)


def exp_parity(mesh, st, out):
    """picotron.train at tp = world size, sp off and on (one process: the reference)."""
    t = mesh.tp.size
    return dict(losses={"reference" if t == 1 else f"tp={t}" + " + sp" * sp:
                        _trained(mesh, st, out, f"parity_tp{t}" + "_sp" * sp, tp=t, sp=sp, micro_batch_size=2)[2]
                        for sp in ((False, True) if t > 1 else (False,))})


def exp_grid(mesh, st, out, micro_batch_size=2, global_batch=8):
    """picotron.train on the mesh's dp x tp grid, ZeRO-1 over dp, `global_batch` sequences per step (one process:
    the reference). Each rank reports its coordinates, its axes' ranks, the global rows its loader reads at step 1
    (numbered as one process reads them) and its model states."""
    dp, tp = mesh.dp.size, mesh.tp.size
    kw = dict(dp=dp, tp=tp, zero=int(dp > 1), micro_batch_size=micro_batch_size,
              grad_acc=global_batch // (micro_batch_size * dp))
    _, loader = load_data(make_cfg(st["size"], seq_len=st["parity_seq_len"], **kw), mesh)  # the trainer's loader
    one = data.DataLoader(loader.data, seq_len=loader.seq_len, micro_batch_size=micro_batch_size,
                          grad_acc=global_batch // micro_batch_size, seed=loader.seed)  # one process, same batch
    every = torch.cat([m.inputs for m in one.micro_batches(1)])
    rows = [next(i for i, r in enumerate(every) if torch.equal(r, x))
            for m in loader.micro_batches(1) for x in m.inputs]
    cfg, summary, losses = _trained(mesh, st, out, f"grid_dp{dp}_tp{tp}", **kw)
    me = dict(rank=mesh.rank, coords=mesh.coords, tp_ranks=mesh.tp.ranks, dp_ranks=mesh.dp.ranks, rows=rows,
              states={k: summary["mem"][k] for k in PARTS})
    return dict(config=kw | dict(seq_len=cfg.seq_len, global_batch=loader.global_batch), ranks=gather(me, mesh),
                losses=losses, groups={a: group_ranks(mesh.sizes, a) for a in ("tp", "dp")},
                tp_alone_states=rank_state_bytes(cfg.model_config(), tp))  # tp without ZeRO, for comparison


def exp_partitioned(mesh, st, out, lo=2, hi=4):
    """No recomputation, full recomputation, and full with each layer's input partitioned over tp (ZeRO-R's Pa), at
    lo and hi layers: the bytes autograd keeps per rank (the step schedule's count; per layer: the difference over
    hi - lo layers), every all-gather the recorder counts, and steps of the hi-layer variants interleaved."""
    t, b, s = mesh.tp.size, st["micro_batch_size"], st["seq_len"]
    modes = ("none", "full") + (("partitioned",) if t > 1 else ())  # partitioned needs tp >= 2

    def build(mode, layers):
        return Variant(f"tp={t} {mode}", make_cfg(st["size"], tp=t, recompute=mode, seq_len=s, micro_batch_size=b,
                                                  num_hidden_layers=layers), mesh)

    shallow, deep = {m: build(m, lo) for m in modes}, {m: build(m, hi) for m in modes}
    for v in shallow.values():
        v.step(1, record=False)
    others = _common.run_interleaved(list(deep.values()), st["partitioned_steps"], st["warmup"], mesh.tp.group)
    mc, rows = deep["none"].run.raw.config, []
    for m in modes:
        v = deep[m]  # its recorder holds the last step's collectives (Variant.step resets it)
        times = slowest(v.times, mesh)
        rows.append(dict(mode=m, saved_by_rank=gather(v.activation_bytes, mesh),
                         per_layer_by_rank=gather((v.activation_bytes - shallow[m].activation_bytes) / (hi - lo), mesh),
                         all_gather_bytes=v.recorder.bytes.get("all_gather", 0),
                         all_gather_calls=v.recorder.calls.get("all_gather", 0),
                         step_times=times, median=statistics.median(times), losses=v.losses))
        say(mesh, f"tp={t} {m:<12} keeps {rows[-1]['per_layer_by_rank'][0] / MiB:6.3f} MiB per layer (rank 0), "
                   f"{rows[-1]['all_gather_calls']} all-gathers of {rows[-1]['all_gather_bytes'] / MiB:.2f} MiB per step, "
                   f"{1e3 * rows[-1]['median']:7.1f} ms/step")
    return dict(t=t, b=b, s=s, h=mc.hidden_size, layers=hi, others_share=others, rows=rows,
                formula_per_layer=partitioned_formula(mc, s, b, t))


def exp_asynctp(mesh, st, out):
    """Blocking sp against async TP (the collective matmul) on the lesson's layers, one forward + backward of each in
    turn (benchmarks/async_tp_bench.py), over an emulated link on a CPU (none on GPUs); then both variants' outputs
    and every gradient on one input, compared."""
    from benchmarks import async_tp_bench as bench  # the repository root is on sys.path (_common)

    mc = ModelConfig.from_preset("tiny", **SIZES[st["size"]])
    ratio = st["asynctp_link_ratio"] if mesh.device.type == "cpu" else 0  # GPUs: the real interconnect
    res = bench.compare(mesh, mc, st["seq_len"], st["micro_batch_size"], st["asynctp_steps"], st["warmup"], ratio)
    runs = {name: bench.Layers(mc, mesh, name == "overlapped", None, st["seq_len"], st["micro_batch_size"])
            for name in ("blocking", "overlapped")}
    results = {name: run.results() for name, run in runs.items()}
    worst = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
                for a, b in zip(results["overlapped"], results["blocking"]))
    res["parity"] = dict(tensors=len(results["blocking"]), worst_relative=max(gather(worst, mesh)))
    for line in bench.report(res).splitlines():
        say(mesh, line)
    say(mesh, f"outputs and gradients, overlapped against blocking: {res['parity']['tensors']} tensors, worst "
              f"difference {res['parity']['worst_relative']:.1e} of the tensor's largest value")
    return res


def partitioned_formula(mc, seq_len, micro_batch_size, tp):
    """Bytes a rank keeps per layer, fp32: none = activation_parts' layer; full = its input 4sbh; partitioned = 4sbh/t."""
    sbh = seq_len * micro_batch_size * mc.hidden_size
    none = sum(activation_parts(mc, seq_len, micro_batch_size, tp)["per layer"].values())
    return {"none": none, "full": 4 * sbh} | ({"partitioned": 4 * sbh / tp} if tp > 1 else {})


EXPERIMENTS = ("comm", "memory", "scaling", "dtensor", "parity", "grid", "partitioned", "asynctp")
NEEDS_TP = ("comm", "dtensor", "asynctp")  # meaningless with one process


# ----------------------------------------------------------------------------- plots (for the notebook)
def _bars(ax, x, parts, width=0.8, hatch=None, label=True, **kw):
    """_plots.stacked_bar in this lesson's COLORS, thin edges; returns its top."""
    return stacked_bar(ax, x, parts, COLORS, width, hatch, label, **{"lw": 0.5, **kw})


def _pairs(ax, rows, measured, formula, keys, scale=MiB, total=False):
    """Per row a measured stacked bar (solid) beside the formula's (hatched), x-labelled with the row's name."""
    for x, r in enumerate(rows):
        for dx, src, hatch in ((-0.2, measured(r), None), (0.2, formula(r), "//")):
            top = _bars(ax, x + dx, {k: src[k] / scale for k in keys}, 0.38, hatch, label=x == 0 and hatch is None)
        if total:
            ax.text(x, top, f"{top:.1f}", ha="center", va="bottom", fontsize=FONT)
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows], fontsize=FONT)


def plot_shards(mc, tp, sp=False, rank=0, title=""):
    """Layer 0's parameters, the embedding and the LM head drawn to one scale per panel (width = input features,
    height = output features), cut into tp slices along the dimension tp splits, one colour per rank; replicated
    norm weights dotted grey; under each its full shape and rank `rank`'s shard."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    rows = shard_shapes(mc, tp, sp)[rank]
    layer = [r for r in rows if r["name"].startswith("layers.0.")]
    outer = [r for r in rows if r["name"] in ("embed_tokens.weight", "lm_head.weight")]
    fig, axes = plt.subplots(1, 2, figsize=(14, 3.0), gridspec_kw=dict(width_ratios=[len(layer) - 0.8, 2.4]))
    for ax, items, min_width in ((axes[0], layer, 0.0), (axes[1], outer, 0.3)):
        scale, x = 1 / max(max(r["full"]) for r in items if len(r["full"]) == 2), 0.0
        for r in items:
            name = r["name"].split(".")[-2].replace("_layernorm", " norm").replace("post_attention", "post-attn")
            slot = 0.5 if len(r["full"]) == 1 else 1.0
            cx = x + slot / 2
            if len(r["full"]) == 1:  # a norm weight: a thin bar, the same on every rank
                ax.add_patch(Rectangle((cx - 0.04, 0), 0.08, r["full"][0] * scale, facecolor="0.85", edgecolor="k",
                                       lw=0.6, hatch="...."))
                label = f"{name}\n[{r['full'][0]:,}]"
            else:
                (out_f, in_f), w = r["full"], max(r["full"][1] * scale, min_width)
                hgt = out_f * scale
                for k in range(tp):  # columns split: rank 0 on the left; rows split: rank 0 on top
                    ax.add_patch(Rectangle(*(((cx - w / 2 + k * w / tp, 0), w / tp, hgt) if r["dim"] == 1 else
                                             ((cx - w / 2, hgt - (k + 1) * hgt / tp), w, hgt / tp)),
                                           facecolor=RANK_COLORS[k % 8], edgecolor="k", lw=0.4))
                label = f"{name}\n{out_f:,}×{in_f:,}\nr{rank}: {r['shard'][0]:,}×{r['shard'][1]:,}"
                label += "\n(tied)" if r["kind"].startswith("tied") else ""
            ax.text(cx, -0.04, label, ha="center", va="top", fontsize=FONT)
            x += slot + 0.15
        ax.set(xlim=(-0.08, x - 0.07), ylim=(-0.5, 1.02))
        ax.set_aspect("equal", adjustable="box")
        ax.axis("off")
    axes[0].set_title(f"layer 0 of {mc.num_hidden_layers} (every layer alike), one scale", fontsize=10)
    axes[1].set_title("embedding, LM head (own scale)", fontsize=10)
    handles = [Rectangle((0, 0), 1, 1, facecolor=RANK_COLORS[k], edgecolor="k", lw=0.4, label=f"rank {k}")
               for k in range(min(tp, 8))]
    handles.append(Rectangle((0, 0), 1, 1, facecolor="0.85", edgecolor="k", hatch="....", label="replicated"))
    fig.legend(handles=handles, loc="lower center", fontsize=FONT, ncol=len(handles), frameon=False)
    fig.suptitle(title or f"tp={tp}{' + sp' if sp else ''}: what each rank holds", fontsize=11, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    return fig


def shard_table(mc, tp, sp=False, max_ranks=4):
    """Text: every parameter of layer 0, the embedding, the final norm and the LM head, with each rank's shape
    and slice (the first max_ranks ranks)."""
    shapes, ranks = shard_shapes(mc, tp, sp), range(min(tp, max_ranks))
    cells = {(k, j): "x".join(map(str, q["shard"])) + ("" if q["dim"] is None or tp == 1 else
                                                        f" {'rows' if q['dim'] == 0 else 'cols'} {q['lo']}:{q['hi']}")
             for k in ranks for j, q in enumerate(shapes[k])}
    w = max(len(c) for c in cells.values()) + 3
    lines = [f"{'parameter':<42}{'full shape':>13}  {'how':<30}" + "".join(f"{f'rank {k}':>{w}}" for k in ranks)]
    lines += [f"{r['name']:<42}{'x'.join(map(str, r['full'])):>13}  {r['kind']:<30}" +
              "".join(f"{cells[k, j]:>{w}}" for k in ranks) for j, r in enumerate(shapes[0])]
    return "\n".join(lines + ([f"(ranks {max_ranks}..{tp - 1}: the next slices, alike)"] if tp > max_ranks else []))


def plot_memory_model(mc, tp, sp=False, seq_len=4096, micro_batch_size=1, flash=True, capacity_gb=80.0, title=""):
    """The widget's GB per rank (textbook formulas) for every tp the model allows, sp off and on, the chosen one
    outlined, the GPU's capacity dashed."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 3.8))
    x, ticks, labels = 0, [], []
    for t in [t for t in valid_tps(mc) if t <= 64]:
        for s_p in ((False, True) if t > 1 else (False,)):  # at tp = 1 sp changes nothing
            m, chosen = memory_per_rank(mc, t, s_p, seq_len, micro_batch_size, flash), t == tp and (s_p == sp or t == 1)
            top = _bars(ax, x, {k: m[k] / 1e9 for k in (*PARTS, "activations")}, label=x == 0,
                        edgecolor="k" if chosen else "white", lw=2 if chosen else 0.5)
            ax.text(x, top, f"{top:,.1f}", ha="center", va="bottom", fontsize=FONT)
            ticks.append(x)
            labels.append(f"tp={t}" + ("\n+sp" if s_p else ""))
            x += 1
        x += 0.5
    ax.axhline(capacity_gb, color="#c44e52", ls="--", lw=1, label=f"{capacity_gb:g} GB per GPU")
    ax.set_xticks(ticks, labels, fontsize=FONT)
    ax.set_ylabel("GB per GPU")
    ax.set_title(f"{title} per rank: model states (16 bytes per parameter held) + the layers' activations (Korthikanti, "
                 f"bf16{', no s² scores' if flash else ''}), s={seq_len}, b={micro_batch_size}", fontsize=9, loc="left")
    legend_below(ax, ncol=5, dy=-0.22)
    fig.tight_layout()
    return fig


def plot_comm(results):
    """results: {tp: comm result}. Per tp and sp: the collectives per layer, forward and backward, counted (bars)
    and Megatron's pattern (black outline), in b·s·h activations, an all-reduce counted as the reduce-scatter plus
    all-gather a ring does (so the bars compare bytes moved)."""
    import matplotlib.pyplot as plt

    weight = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 3.6), sharey=True, squeeze=False)
    for ax, t in zip(axes[0], sorted(results)):
        ticks = []
        for row in results[t]["rows"]:
            act = 4 * row["b"] * row["s"] * row["h"]
            got, exp = parse_counts(row["per_layer"]), parse_counts(row["expected"])
            for phase in ("forward", "backward"):
                x = len(ticks) + 0.5 * row["sp"]
                _bars(ax, x, {op: sum(weight[op] * c * nb / act for (o, nb), c in got[phase].items() if o == op)
                              for op in weight}, 0.7)
                ax.bar(x, sum(weight[o] * c * nb / act for (o, nb), c in exp[phase].items()), 0.86, fill=False,
                       edgecolor="k", lw=1.2, label="Megatron's pattern")
                ticks.append((x, f"{'+sp' if row['sp'] else 'no sp'}\n{phase}"))
        ax.set_xticks(*zip(*ticks), fontsize=FONT)
        ax.set_title(f"tp={t}: collectives per layer", fontsize=10)
    axes[0][0].set_ylabel("buffers moved / (b·s·h activation)")
    names = {"all_reduce": "all-reduce (as reduce-scatter + all-gather)", "all_gather": "all-gather",
             "reduce_scatter": "reduce-scatter", "Megatron's pattern": "Megatron's pattern"}
    handles = {lab: h for h, lab in zip(*axes[0][0].get_legend_handles_labels())}
    fig.legend([handles[k] for k in names], names.values(), loc="lower center", ncol=4, fontsize=FONT, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def plot_activations(results, mc, seq_len, micro_batch_size):
    """results: {tp: memory result}. Left: one layer's activations per rank against tp, sp off and on: measured
    (rank 0), our formula (lines), Korthikanti's shape scaled to our tp = 1 (dotted). Right: rank 0's layer by
    part, measured beside the formula (hatched)."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw=dict(width_ratios=[1, 1.5]))
    grid, (s, b, h, a) = [1, 2, 3, 4, 6, 8], (seq_len, micro_batch_size, mc.hidden_size, mc.num_attention_heads)
    one, k1 = (sum(activation_parts(mc, s, b, 1)["per layer"].values()),
               planner.korthikanti_bytes_per_layer(s, b, h, a, flash=True))
    rows = [r for t in sorted(results) for r in results[t]["rows"]]
    for sp, color in ((False, "#4c72b0"), (True, "#c44e52")):
        ts = [t for t in grid if t > 1 or not sp]
        meas = [(int(r["name"].split("=")[1].split()[0]), sum(r["parts_by_rank"][0]["per layer"].values()) / MiB)
                for r in rows if r["sp"] == sp or r["name"] == "tp=1"]
        ax1.plot(*zip(*meas), "o", color=color, ms=7, label="measured" + " + sp" * sp)
        ax1.plot(ts, [sum(activation_parts(mc, s, b, t, sp)["per layer"].values()) / MiB for t in ts], "-",
                 color=color, lw=1, label="our formula" + " + sp" * sp)
        korthikanti = [planner.korthikanti_bytes_per_layer(s, b, h, a, tp=t, sp=sp, flash=True) for t in ts]
        ax1.plot(ts, [one * k / k1 / MiB for k in korthikanti], ":", color=color, lw=1.5,
                 label="Korthikanti" + " + sp" * sp + " (scaled)")
    ax1.set(xlabel="tp", ylabel="MiB per layer per rank", title="one layer's activations, per rank", xticks=grid)
    legend_below(ax1, ncol=2, dy=-0.18)
    _pairs(ax2, rows, lambda r: r["parts_by_rank"][0]["per layer"], lambda r: r["formula"]["per layer"], LAYER_PARTS)
    ax2.set(ylabel="MiB per layer (rank 0)", title="by part: measured (left), formula (right, hatched)")
    legend_below(ax2, ncol=4, dy=-0.12)
    fig.tight_layout()
    return fig


RECOMPUTE_COLORS = {"none": "#c44e52", "full": "#4c72b0", "partitioned": "#55a868"}


def plot_partitioned(results):
    """results: {tp: partitioned result}. Left: the bytes the layers keep per rank (L x the measured per-layer
    difference, the fullest rank) for no, full and partitioned recomputation against tp, formula outlined, log
    scale. Right: the step time of each (median, the slowest rank)."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw=dict(width_ratios=[1.4, 1]))
    ts, width = sorted(results), 0.26
    for i, t in enumerate(ts):
        res = results[t]
        for j, mode in enumerate(RECOMPUTE_COLORS):
            row = next((r for r in res["rows"] if r["mode"] == mode), None)
            if row is None:
                continue
            x = i + (j - 1) * width
            kept = res["layers"] * max(row["per_layer_by_rank"]) / MiB
            ax1.bar(x, kept, width * 0.9, color=RECOMPUTE_COLORS[mode], label=mode)
            ax1.bar(x, res["layers"] * res["formula_per_layer"][mode] / MiB, width * 0.9, fill=False, edgecolor="k",
                    lw=1, label="formula")
            ax1.text(x, kept * 1.08, f"{kept:.2g}", ha="center", va="bottom", fontsize=FONT)
            ax2.bar(x, 1e3 * row["median"], width * 0.9, color=RECOMPUTE_COLORS[mode])
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(ts)), [f"tp={t}" for t in ts], fontsize=FONT)
    ax1.set_yscale("log")
    ax1.set(ylabel="MiB per rank (all layers)", title="what the layers keep for backward, per rank")
    ax2.set(ylabel="ms per step (median)", title="step time (a shared CPU: shown, not judged)")
    handles = {lab: h for h, lab in zip(*ax1.get_legend_handles_labels())}
    legend_below(ax1, ncol=4, dy=-0.16, handles=list(handles.values()), labels=list(handles))
    fig.tight_layout()
    return fig


def plot_memory(results):
    """results: {tp: memory result}. Rank 0's bytes per variant, stacked params / grads / optimizer / activations:
    measured (solid) beside the formulas (hatched)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.8))
    _pairs(ax, [r for t in sorted(results) for r in results[t]["rows"]],
           lambda r: r["states_by_rank"][0] | {"activations": r["parts_by_rank"][0]["total"]},
           lambda r: r["formula_states"] | {"activations": r["formula_total"]}, (*PARTS, "activations"), total=True)
    ax.set(ylabel="MiB per rank (rank 0)", title="memory per rank: measured (left), formulas (right, hatched)")
    legend_below(ax, ncol=4, dy=-0.12)
    fig.tight_layout()
    return fig


def plot_scaling(results, oversubscribed=4):
    """results: {tp: scaling result}. Left: tokens/s against tp, sp off and on (bars: quartiles); right: each
    variant's median step split into time inside collectives and the rest."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.9))
    tps = sorted(results)
    rows = [(t, r) for t in tps for r in results[t]["rows"]]
    for sp, color in ((False, "#4c72b0"), (True, "#c44e52")):
        pts = [(t, r) for t, r in rows if r["sp"] == sp or t == 1]
        ax1.plot([t for t, _ in pts], [r["tokens_per_s"] for _, r in pts], "o-", color=color, label="tp" + " + sp" * sp)
        for t, r in pts:
            ax1.plot([t, t], [r["tokens_per_s"] * r["median"] / q for q in (r["q3"], r["q1"])], color=color, lw=3,
                     alpha=0.4)
    if max(tps) >= oversubscribed:
        ax1.axvspan(oversubscribed - 0.3, max(tps) + 0.3, color="0.9", zorder=0, label="more ranks than cores")
    ax1.set(xlabel="tp (ranks)", ylabel="tokens/s (median step)", title="throughput: the same batch on every rank",
            xticks=tps, ylim=(0, None))
    legend_below(ax1, ncol=3)
    for x, (t, r) in enumerate(rows):
        comm, med = 1e3 * r["comm_median"], 1e3 * r["median"]
        _bars(ax2, x, {"compute and the rest": med - comm, "inside collectives": comm}, 0.7, label=x == 0)
        ax2.text(x, med, f"{comm / med:.0%}", ha="center", va="bottom", fontsize=FONT)
    ax2.set_xticks(range(len(rows)), [r["name"].replace(" + ", "\n+") for _, r in rows], fontsize=FONT)
    ax2.set(ylabel="ms per step (median, slowest rank)", title="where the step goes (label: share in collectives)")
    ax2.set_ylim(0, ax2.get_ylim()[1] * 1.1)
    legend_below(ax2, ncol=2)
    fig.tight_layout()
    return fig


def plot_dtensor(res):
    """Per sp setting: the per-round throughput ratio ours / DTensor's (histogram), the two step times, and each
    one's loss against the unsharded model's on the same batches, step by step."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4.0))
    colors = {False: "#4c72b0", True: "#c44e52"}
    for x, (name, run) in enumerate(res["runs"].items()):
        ours, theirs = (row["step_times"] for row in run["rows"])
        ratios = [b / a for a, b in zip(ours, theirs)]
        axes[0].hist(ratios, bins=max(5, min(20, len(ratios) // 2)), color=colors[run["sp"]], alpha=0.6,
                     label=f"{name}: median {run['ratio']['median']:.2f}")
        axes[0].axvline(run["ratio"]["median"], color=colors[run["sp"]], lw=1.5)
        for k, row in enumerate(run["rows"]):
            axes[1].bar(x + 0.4 * k, 1e3 * statistics.median(row["step_times"]), 0.38,
                        color=["#4c72b0", "#dd8452"][k], label=row["name"] if x == 0 else None)
            rel = [max(abs(a - b) / abs(b), 1e-9) for a, b in zip(row["losses"], res["reference_losses"])]
            axes[2].semilogy(range(1, len(rel) + 1), rel, ["-", "--"][k], color=colors[run["sp"]], lw=1,
                             label=f"{row['name']}, {name}")
    axes[0].axvline(1.0, color="k", ls="--", lw=1, label="1 = as fast as DTensor")
    axes[0].set(xlabel="ours / DTensor throughput, per round", ylabel="rounds", title="paired rounds")
    axes[1].set_xticks([i + 0.2 for i in range(len(res["runs"]))], list(res["runs"]))
    axes[1].set(ylabel="ms per step (median, slowest rank)", title=f"tp={res['tp']}: step time")
    axes[2].axhline(1e-5, color="k", ls=":", lw=1, label="1e-5")
    axes[2].set(xlabel="step", ylabel="|Δloss| / loss vs one process", ylim=(1e-9, 1),
                title="against the unsharded model")
    for ax, n in zip(axes, (1, 2, 2)):
        legend_below(ax, ncol=n)
    fig.tight_layout()
    return fig


def plot_parity(pairs, what="each layout"):
    return plot_parity_below(pairs, what, height=4.2)


def plot_grid(sizes, micro_batch_size, grad_acc):
    """The dp x tp grid as picotron.mesh lays it out: each rank at its `grid_coords`; left the tp groups, right the
    dp groups (`group_ranks`), outlined; each dp replica with the global rows it reads (row = (dp_rank · grad_acc +
    micro_step) · micro_batch_size + i, picotron.data)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Rectangle

    dp, tp, per = sizes["dp"], sizes["tp"], micro_batch_size * grad_acc
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    notes = {"tp": "same rows, 1/tp of every matrix:\nactivations all-reduced 4x per layer",
             "dp": "same shard, different rows: gradients\nreduce-scattered once per step (ZeRO-1)"}
    for ax, axis, edge in ((axes[0], "tp", "#c44e52"), (axes[1], "dp", "#4c72b0")):
        for rank in range(dp * tp):
            c = grid_coords(rank, sizes)
            ax.add_patch(Rectangle((c["tp"] + 0.12, dp - 0.88 - c["dp"]), 0.76, 0.76, facecolor=RANK_COLORS[rank % 8],
                                   edgecolor="k", lw=0.6))
            ax.text(c["tp"] + 0.5, dp - 0.5 - c["dp"], f"rank {rank}\ndp={c['dp']} tp={c['tp']}", ha="center",
                    va="center", fontsize=9)
        for ranks in group_ranks(sizes, axis):
            cs = [grid_coords(r, sizes) for r in ranks]
            x0, y0 = min(c["tp"] for c in cs), dp - 1 - max(c["dp"] for c in cs)
            ax.add_patch(FancyBboxPatch((x0 + 0.05, y0 + 0.05), max(c["tp"] for c in cs) - x0 + 0.9,
                                        dp - min(c["dp"] for c in cs) - y0 - 0.1, boxstyle="round,pad=0.02",
                                        fill=False, edgecolor=edge, lw=2.2, ls="--"))
        ax.set(xlim=(0, tp), ylim=(-0.05, dp + 0.05), aspect="equal")
        ax.set_xticks([i + 0.5 for i in range(tp)], [f"tp rank {i}" for i in range(tp)], fontsize=FONT)
        ax.set_yticks([dp - 0.5 - d for d in range(dp)],
                      [f"dp replica {d}\nrows {d * per}-{(d + 1) * per - 1}" for d in range(dp)], fontsize=FONT)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title(f"{axis} groups: {group_ranks(sizes, axis)}", fontsize=10, color=edge)
        ax.set_xlabel(notes[axis], fontsize=FONT)
    fig.suptitle(f"dp={dp} x tp={tp}: rank = dp_rank·{tp} + tp_rank; global batch = {micro_batch_size} x {grad_acc} "
                 f"x {dp} = {per * dp} rows", fontsize=10)
    fig.tight_layout()
    return fig


ASYNC_COLORS = {"compute": "#8da0cb", "matmul": "#66c2a5", "blocked": "#e41a1c", "message": "#fdb462"}


def plot_async_timelines(res, t_max=None):
    """Rank 0's last forward + backward of the layers, blocking above, overlapped below: what computes, what is in
    flight on the (emulated) link, and where the compute waits for communication (red: exposed)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(2, 1, figsize=(11, 4.2), sharex=True)
    for ax, (name, row) in zip(axes, res["runs"].items()):
        ev = row["events"]
        step = next(e for e in ev if e["name"] == "step")
        t0 = step["start"]

        def bar(y, e, color):
            ax.barh(y, 1e3 * (e["end"] - e["start"]), left=1e3 * (e["start"] - t0), height=0.7, color=color, lw=0)

        bar(2, step, ASYNC_COLORS["compute"])
        for e in ev:
            if e["name"] in ("ag-matmul", "rs-matmul"):
                bar(2, e, ASYNC_COLORS["matmul"])
            elif e["name"] == "wait" or (e.get("kind") == "comm" and e["name"] in ("all-gather", "reduce-scatter")):
                bar(2, e, ASYNC_COLORS["blocked"])
                if not row.get("link_spans"):  # no emulated link: the message as the recorder saw it
                    bar(1, e, ASYNC_COLORS["message"])
            elif e.get("kind") == "comm" and e["name"].startswith("async-tp") and not row.get("link_spans"):
                bar(1, e, ASYNC_COLORS["message"])
        for start, end in row.get("link_spans") or []:  # when the emulated link carried each message
            bar(1, dict(start=start, end=end), ASYNC_COLORS["message"])
        exposed = 1e3 * row["exposed_per_layer_s"]
        ax.set_title(f"{name}: {1e3 * (step['end'] - step['start']):.0f} ms for one forward + backward, exposed "
                     f"communication {exposed:.1f} ms per layer (median over rounds)", fontsize=FONT)
        ax.set_yticks([1, 2], ["link", "compute"])
        ax.set_ylim(0.4, 2.6)
    axes[-1].set_xlabel("ms since the step began (rank 0)")
    if t_max:
        axes[-1].set_xlim(0, t_max)
    link = res["link"]["label"] if res.get("link") else "the real interconnect"
    legend_below(axes[-1], ncol=2, dy=-0.45, handles=[Patch(color=ASYNC_COLORS[k], label=lab) for k, lab in (
        ("compute", "compute (everything else)"), ("matmul", "one chunk's matmul (the collective matmuls)"),
        ("message", f"the link carries a message ({link})"), ("blocked", "compute waits: exposed"))])
    fig.tight_layout()
    return fig


def plot_async_exposed(res):
    """Exposed tp communication per layer, measured (all of it, and the part spent waiting for the emulated link)
    against the planner's model on the same link, for both."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    names = list(res["runs"])
    x = range(len(names))
    ax.bar([i - 0.27 for i in x], [1e3 * res["runs"][n]["exposed_per_layer_s"] for n in names], 0.26,
           color="#fcae91", label="measured: all the time blocked (median)")
    if "model" in res:
        ax.bar(list(x), [1e3 * res["runs"][n]["link_bound_per_layer_s"] for n in names], 0.26,
               color=ASYNC_COLORS["blocked"], label="measured: blocked while the link carried a message")
        ax.bar([i + 0.27 for i in x], [1e3 * res["model"][n] for n in names], 0.26, color="0.6",
               label="model: planner.async_tp_layer_seconds")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("ms per layer (forward + backward)")
    ax.set_title("exposed tensor-parallel communication per layer", fontsize=FONT)
    legend_below(ax, ncol=1, dy=-0.18)
    fig.tight_layout()
    return fig


def plot_puzzle(mc=None, budgets=PUZZLE["budgets_mib"]):
    """Every layout of the puzzle, fastest first: MiB per rank (model states + one micro-batch's activations, the
    formulas), the budgets dashed."""
    import matplotlib.pyplot as plt

    mc, ls = mc or puzzle_model(), layouts(mc or puzzle_model())
    fig, ax = plt.subplots(figsize=(13, 3.8))
    for x, (t, sp, b) in enumerate(ls):
        _bars(ax, x, {"model states": sum(rank_state_bytes(mc, t).values()) / MiB,
                      "activations": activation_bytes(mc, PUZZLE["seq_len"], b, t, sp) / MiB},
              hatch="//" if sp else None, label=x == 0)
    for y in budgets:
        ax.axhline(y, color="k", ls="--", lw=0.8)
        ax.text(1.005, y, f"{y} MiB", va="center", ha="left", fontsize=FONT, transform=ax.get_yaxis_transform())
    ax.set_xticks(range(len(ls)), [f"tp={t}{'+sp' if sp else ''}\nb={b}" for t, sp, b in ls], fontsize=FONT)
    ax.set(xlim=(-0.6, len(ls) - 0.4), ylabel="MiB per rank (formula)",
           title=f"the puzzle's layouts, fastest first: {PUZZLE['global_batch']} x {PUZZLE['seq_len']} tokens per step "
                 "= micro-batch b x accumulation (hatched: sp)")
    legend_below(ax, ncol=2)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------------ main
def main(argv=None):
    args, names, out = _common.cli("05_tensor_parallel", EXPERIMENTS, __doc__, EXPERIMENTS[:5], argv, extra=[
        (["--dp"], dict(type=int, default=1, help="data-parallel degree (grid only); tp = world size / dp"))])
    if args.dp > 1 and names != ["grid"]:
        sys.exit(f"--dp {args.dp} with --only {args.only}: only the grid experiment has a dp axis; run --only grid")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = Mesh.init(dp=args.dp, tp=world // args.dp, device=_common.experiment_device("05_tensor_parallel"))
    with mesh:  # on success every rank meets at a barrier before the groups go (Mesh.destroy)
        st = settings(args.fast, mesh.device.type)
        _common.run_experiments(
            names, lambda name: globals()[f"exp_{name}"](mesh, st, out),
            lambda name: out / f"{name}{f'_dp{args.dp}' if args.dp > 1 else ''}_tp{mesh.tp.size}.json",
            _common.environment(mesh, dp=args.dp, tp=mesh.tp.size, settings=st), mesh.rank,
            skip=lambda name: "needs tp >= 2 (torchrun --nproc_per_node 2)" if world == 1 and name in NEEDS_TP else None,
            say=lambda text: say(mesh, text))


if __name__ == "__main__":
    main()
