"""Lesson 05, the experiment: tensor parallelism (+ sequence parallelism), measured. The collectives of every
layer counted against Megatron's pattern, the activations and model states each rank keeps against the
formulas with and without sp, throughput against tp, our tensor parallelism against torch's DTensor one, and
the losses of tp = 2 and 4 against one process.

    torchrun --nproc_per_node 2 lessons/05_tensor_parallel/experiment.py --out runs/lessons/05_tensor_parallel --only comm,memory
    torchrun --nproc_per_node 4 lessons/05_tensor_parallel/experiment.py --only comm,memory,scaling,parity
    torchrun --nproc_per_node 1 lessons/05_tensor_parallel/experiment.py --only memory,scaling,parity    # tp = 1
    PICOTRON_FAST=1 torchrun ...        # short settings (CI, the notebook's FAST mode)

Every experiment runs at tp = world size (dp = 1) and writes OUT/<name>_tp<N>.json (rank 0):
    comm      one training step (forward, backward, clipping) of the model with 2 and with 4 layers, sp off and
              on: every all-reduce, all-gather and reduce-scatter of the mesh's axes, with its full-buffer bytes,
              the time spent in it and the phase it ran in (a `metrics.Recorder` on the mesh, its timeline shared
              with the step schedule's: `by_phase`). Per layer = (4 layers - 2 layers) / 2, against
              `megatron_pattern`; what is left is the embedding, the LM head and the loss
    memory    one step of each variant (sp off and on): the bytes autograd keeps for backward (the step
              schedule's own count), by part of the model (`PartCounter`, a per-module
              `metrics.ActivationCounter`, over one more forward of the same batch), and the model states each
              rank keeps, against `activation_parts` / `model_state_bytes` (exact for our code) and Korthikanti's
    scaling   a few steps of sp off and sp on, interleaved: step time (the slowest rank's), tokens/s and the
              time spent inside collectives
    dtensor   ours against torch's DTensor tensor parallelism (`benchmarks/tp_vs_dtensor.compare`), steps
              alternating, per-round throughput ratio
    parity    picotron.train with --tp N, sp off and on; with one process, the single-process reference

Every variant trains through picotron's own seam (`parallelize`: the model, its optimizer, the step schedule and
the loss; `marks.clip_grad_norm`): what is measured is the code `picotron.train` runs. Every timed comparison runs
its variants in ONE process group, one step of each in turn (order rotating), a barrier before every step; a
step's time is the slowest rank's. The widget's functions (`shard_shapes`, `memory_per_rank`) need no processes
(`Axis.alone` builds any rank's shard), and the plot_* functions are imported by the notebook.
"""
import argparse
import functools
import os
import statistics
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/
import _common  # noqa: E402  (puts the repository root on sys.path)
from _common import gather, run_interleaved  # noqa: E402

import torch  # noqa: E402

from picotron import data, marks, metrics, planner, tensor_parallel  # noqa: E402
from picotron.config import Config  # noqa: E402
from picotron.mesh import Axis, Mesh  # noqa: E402
from picotron.model import Llama  # noqa: E402
from picotron.parallelize import parallelize  # noqa: E402
from picotron.train import train  # noqa: E402

# "small": the tiny preset widened (3.3 M parameters), as in lessons 03 and 04: 8 heads, 4 KV heads, so tp = 1, 2, 4.
SIZES = {"small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4),
         "medium": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6)}
MiB = 2**20
COMM_LAYERS = (2, 4)  # the comm experiment's two depths: per layer = their difference / 2
OPS = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
       "broadcast": "broadcast"}  # metrics.Recorder's kinds of collective, as the lesson prints them
PARTS = ("params", "grads", "optimizer")
PART_COLORS = dict(params="#4c72b0", grads="#dd8452", optimizer="#55a868", activations="#c44e52")
LAYER_PARTS = ("norm (input)", "attention", "norm (post-attention)", "mlp")
MODEL_PARTS = ("embedding", "final norm", "lm_head", "loss")


def settings(fast, device_type="cpu"):
    """Model and batch of the experiments (every tp rank sees the whole batch), and the steps per variant."""
    if device_type == "cuda":
        return dict(size="medium", seq_len=1024, micro_batch_size=8, steps=10 if fast else 40, warmup=3,
                    dtensor_steps=20 if fast else 100, parity_steps=10 if fast else 20, parity_seq_len=128)
    return dict(size="small", seq_len=128, micro_batch_size=4, steps=3 if fast else 30, warmup=1 if fast else 3,
                dtensor_steps=4 if fast else 60, parity_steps=10 if fast else 20, parity_seq_len=64)


def make_cfg(size="small", **kw):
    return Config(**{"preset": "tiny", "sample_tokens": 0, "eval_every": 0, **SIZES[size], **kw})


@functools.lru_cache(maxsize=1)
def tokens():
    """The embedded Shakespeare as byte tokens (what picotron.train reads), loaded once per process."""
    tok = data.get_tokenizer("byte")
    return data.TokenData(tok.encode_tensor(data.load_text("shakespeare")), tok.vocab_size)


# ------------------------------------------------------------------- shard shapes, without processes
def tp_problem(mc, tp):
    """Why tensor parallelism cannot cut this model tp ways (`tensor_parallel.check`'s sentence), or None."""
    return tensor_parallel.check(Config(tp=tp), mc)


def check_tp(mc, tp):
    """Raise ValueError with tensor_parallel's sentence when tp does not cut the model into whole slices."""
    problem = tp_problem(mc, tp)
    if problem:
        raise ValueError(problem)


def shard_shapes(mc, tp, sp=False):
    """What every rank of tp holds: {rank: [dict(name, full, shard, dim, lo, hi, kind)]} for layer 0's
    parameters, the embedding, the final norm and the LM head (a tied LM head is listed as the embedding's
    matrix). Computed without processes: `tensor_parallel.apply` on a one-layer copy of the model on the meta
    device, over `Axis.alone("tp", tp, rank)` (an axis with no process group) for each rank. dim: the dimension
    the tensor is cut along (None: replicated); [lo, hi): this rank's rows (dim 0) or columns (dim 1) of the
    full matrix. Raises ValueError when tp does not split the heads, KV heads, MLP columns and vocabulary into
    whole slices."""
    check_tp(mc, tp)
    out = {}
    for rank in range(tp):
        with torch.device("meta"):
            model = Llama(replace(mc, num_hidden_layers=1))
        tensor_parallel.apply(model, Axis.alone("tp", tp, rank), sp=sp)
        rows = []
        for name, p in model.named_parameters():
            dim = getattr(p, "tp_dim", None) if tp > 1 else (None if p.dim() == 1 else _split_dim(name))
            full = tuple(getattr(p, "full_shape", p.shape))
            lo, hi = (0, full[0]) if dim is None else (rank * full[dim] // tp, (rank + 1) * full[dim] // tp)
            rows.append(dict(name=name, full=full, shard=tuple(p.shape), dim=dim, lo=lo, hi=hi, kind=_kind(name)))
        if mc.tie_word_embeddings:
            emb = next(r for r in rows if r["name"] == "embed_tokens.weight")
            rows.append(dict(emb, name="lm_head.weight", kind="tied to embed_tokens.weight"))
        out[rank] = rows
    return out


def _split_dim(name):
    """The dimension tensor parallelism would cut (shown at tp = 1 too): rows, except row-parallel layers."""
    return 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0


def _kind(name):
    if name.endswith("norm.weight"):
        return "replicated"
    if name.startswith("embed_tokens"):
        return "vocab-parallel (rows)"
    if name.startswith("lm_head"):
        return "column-parallel (vocabulary)"
    return "row-parallel" if name.endswith(("o_proj.weight", "down_proj.weight")) else "column-parallel"


def valid_tps(mc, candidates=(1, 2, 3, 4, 5, 6, 8, 16, 32, 64)):
    """The degrees tensor_parallel.apply accepts for this model."""
    return [t for t in candidates if tp_problem(mc, t) is None]


def params_per_rank(mc, tp):
    """Parameters one rank holds: every matrix (and the embedding, the LM head) divided by tp; the
    2L + 1 RMSNorm weight vectors replicated."""
    replicated = (2 * mc.num_hidden_layers + 1) * mc.hidden_size
    return (mc.num_params() - replicated) // tp + replicated


# ------------------------------------------------------------------------------------------- formulas
def model_state_bytes(mc, tp, recipe="ours"):
    """Model-state bytes per rank at tensor-parallel degree tp. recipe "ours": fp32 params 4 + grads 4 + AdamW
    moments 8 per parameter, + AdamW's 4-byte step counter per tensor (what our trainer holds); "mixed": the
    textbook bf16 recipe 2 + 2 + 12 (docs/reference.md#model-states)."""
    n = params_per_rank(mc, tp)
    if recipe == "mixed":
        return dict(planner.model_state_bytes(n, "bf16"))
    b = planner.model_state_bytes(n, "fp32")
    b["optimizer"] += 4 * planner.param_tensors(mc)
    return b


# With sp, how many copies of a block's all-gathered input [b, s, h] autograd keeps: tensor_parallel's all-gather
# returns a transposed (non-contiguous) view, and F.linear keeps a contiguous copy of a non-contiguous input for
# its weight gradient, one per projection reading it (q, k, v; gate, up). A contiguous all-gather output would
# make these 1 and 1, as without sp (the memory experiment measures which is the case).
SP_INPUT_COPIES = {"attention": 3, "mlp": 2}


def activation_parts(mc, seq_len, micro_batch_size, tp=1, sp=False):
    """Bytes one rank keeps for backward, by part, in fp32 with sdpa attention and no recomputation: exact for
    our code (the `memory` experiment checks it). {"per layer": {part: bytes}, "model": {part: bytes}}.

    Per layer (s tokens, b sequences, h hidden, i MLP, a heads, k·d KV features; t = tp):
        each norm              x, x·rsqrt, rsqrt: 8sbh + 4sb; with sp only this rank's s/t tokens: /t
        attention              its input, whole (the norm's output; with sp the all-gather's, see
                               SP_INPUT_COPIES): 4sbh, + q, k, v
                               after RoPE and the output, of this rank's heads: 4sb(2h + 2kd)/t, + the
                               logsumexp 4·a·sb/t
        mlp                    its input, whole (with sp: SP_INPUT_COPIES): 4sbh, + gate, silu(gate), up, their
                               product: 16sb·i/t
    Outside the layers: the embedding's token ids (t = 1: the loader's (s+1)-token rows, 8b(s+1); t > 1: the
    shifted ids 8sb and the outside-my-rows mask sb), the RoPE tables 8sd (shared by the layers), the final
    norm (as a norm), the LM head's whole input 4sbh, and the loss: t = 1 log-softmax 4sbv + targets 8sb + 4;
    t > 1 this rank's softmax columns 4sbv/t, the local targets 8sb and their mask sb.
    """
    s, b, h, i, a, v = (seq_len, micro_batch_size, mc.hidden_size, mc.intermediate_size, mc.num_attention_heads,
                        mc.vocab_size)
    kd, t = mc.num_key_value_heads * mc.head_dim, tp
    sbh, sb = s * b * h, s * b
    norm = (8 * sbh + 4 * sb) / (t if sp else 1)
    copies = SP_INPUT_COPIES if sp and t > 1 else {"attention": 1, "mlp": 1}
    layer = {"norm (input)": norm,
             "attention": copies["attention"] * 4 * sbh + (4 * sb * (2 * h + 2 * kd) + 4 * a * sb) / t,
             "norm (post-attention)": norm,
             "mlp": copies["mlp"] * 4 * sbh + 16 * sb * i / t}
    model = {"embedding": 8 * b * (s + 1) if t == 1 else 9 * sb,
             "rope tables": 2 * s * mc.head_dim * 4,
             "final norm": norm,
             "lm_head": 4 * sbh,
             "loss": 4 * sb * v + 8 * sb + 4 if t == 1 else 4 * sb * v / t + 9 * sb}
    return {"per layer": layer, "model": model}


def activation_bytes(mc, seq_len, micro_batch_size, tp=1, sp=False):
    parts = activation_parts(mc, seq_len, micro_batch_size, tp, sp)
    return mc.num_hidden_layers * sum(parts["per layer"].values()) + sum(parts["model"].values())


def replicated_and_sharded(mc, seq_len, micro_batch_size, sp=False):
    """Our per-layer formula as R + S/t (bytes): R kept whole on every rank, S divided by tp (read off t = 2 and 4:
    at t = 1 there is nothing to gather)."""
    two, four = (sum(activation_parts(mc, seq_len, micro_batch_size, t, sp)["per layer"].values()) for t in (2, 4))
    sharded = 4 * (two - four)
    return two - sharded / 2, sharded


def korthikanti_bytes_per_layer(s, b, h, a, tp=1, sp=False, flash=False):
    """Korthikanti et al. 2022 (GPT, bf16, dropout, 4h MLP), per layer and rank: sbh(10 + 24/t + 5as/(ht));
    with sp sbh/t (34 + 5as/h). flash=True drops the 5as/h term (scores never stored: flash attention, or
    selective recomputation)."""
    scores = 0 if flash else 5 * a * s / h
    if sp:
        return s * b * h / tp * (34 + scores)
    return s * b * h * (10 + 24 / tp + scores / tp)


def memory_per_rank(mc, tp, sp=False, seq_len=4096, micro_batch_size=1, flash=True):
    """The widget's model: bytes per rank of model states (textbook mixed precision, 16 bytes per parameter
    this rank holds) and of the layers' activations (Korthikanti's bf16 formula x L). Raises ValueError for a tp
    the model does not allow."""
    check_tp(mc, tp)
    out = model_state_bytes(mc, tp, recipe="mixed")
    out["activations"] = mc.num_hidden_layers * korthikanti_bytes_per_layer(
        seq_len, micro_batch_size, mc.hidden_size, mc.num_attention_heads, tp, sp, flash)
    out["total"] = sum(out.values())
    return out


def megatron_pattern(b, s, h, sp, elem=4):
    """Megatron's collectives per transformer layer and phase, {phase: {(op, bytes): calls}}: f and g once each
    in attention and in the MLP. Without sp: 2 all-reduces of the b·s·h activation forward (the two g's) and 2
    backward (the two f's). With sp each all-reduce becomes an all-gather (entering the block) and a
    reduce-scatter (leaving it) of the same full buffer, forward and backward, plus (ours) the all-reduce of the
    two norm weights' gradients (h numbers each) in backward."""
    act = elem * b * s * h
    if not sp:
        return {"forward": {("all_reduce", act): 2}, "backward": {("all_reduce", act): 2}}
    return {"forward": {("all_gather", act): 2, ("reduce_scatter", act): 2},
            "backward": {("all_gather", act): 2, ("reduce_scatter", act): 2,
                         ("all_reduce", elem * h): 2}}


def ring_bytes_sent(op, nbytes, n):
    """Bytes one rank sends for a collective over a full buffer of nbytes (ring algorithms, lesson 02)."""
    return (2 if op == "all_reduce" else 1) * (n - 1) / n * nbytes


# ----------------------------------------------------------------------------------- measuring tools
def by_phase(recorder):
    """[(phase, kind, bytes, seconds)] of every collective `recorder` counted, in call order. `kind` is the
    Recorder's ("all_reduce", "all_gather", "reduce_scatter"), bytes its full buffer (the all-reduced tensor, an
    all-gather's output, a reduce-scatter's input). The phase is the step schedule's event the collective
    started in, on the timeline the two share ("forward", with the loss; "backward"; "wait", the gradient
    sync's), "step" after it (clipping). Seconds: from the call to its return; gloo's collectives block, so
    that is the transfer plus the wait for the slowest peer (NCCL's return once queued: on a GPU it would be
    a launch's time)."""
    events = recorder.timeline.events
    phases = [e for e in events if e.get("kind") != "comm"]
    comms = [e for e in events if e.get("kind") == "comm"]
    if len(comms) != len(recorder.log):  # tensor parallelism's collectives are synchronous: one event each
        raise RuntimeError(f"{len(recorder.log)} collectives counted but {len(comms)} timed: an asynchronous one?")
    out = []
    for (kind, nbytes, _axis), e in zip(recorder.log, comms):
        phase = next((p["name"] for p in phases if p["start"] <= e["start"] <= p["end"]), "step")
        out.append((phase, kind, nbytes, e["end"] - e["start"]))
    return out


def counts(calls, phase):
    """{(kind, bytes): number of calls} of one phase of `by_phase`'s list."""
    out = {}
    for p, kind, nbytes, _ in calls:
        if p == phase:
            out[(kind, nbytes)] = out.get((kind, nbytes), 0) + 1
    return out


class PartCounter(metrics.ActivationCounter):
    """metrics.ActivationCounter that also attributes each saved storage to the part of the model running when
    autograd saved it (forward hooks on the embedding, every layer's two norms, attention and MLP, the final
    norm and the LM head; outside them: the loss). `.parts[label]`; `.bytes` is the total, as before."""

    def __init__(self, model):
        super().__init__(model)
        self.parts, self._stack, self._handles = {}, ["loss"], []
        self._modules = [("embedding", model.embed_tokens), ("final norm", model.norm), ("lm_head", model.lm_head)]
        for k, layer in enumerate(model.layers):
            self._modules += [(f"{k}/norm (input)", layer.input_layernorm), (f"{k}/attention", layer.self_attn),
                              (f"{k}/norm (post-attention)", layer.post_attention_layernorm), (f"{k}/mlp", layer.mlp)]

    def _push(self, label, module, args):
        self._stack.append(label)

    def _pop(self, module, args, output):
        self._stack.pop()

    def _pack(self, t):
        before = self.bytes
        super()._pack(t)
        if self.bytes > before:
            self.parts[self._stack[-1]] = self.parts.get(self._stack[-1], 0) + self.bytes - before
        return t

    def __enter__(self):
        for label, m in self._modules:
            self._handles += [m.register_forward_pre_hook(partial(self._push, label)), m.register_forward_hook(self._pop)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        return super().__exit__(*exc)

    def summary(self, n_layers):
        """{"per layer": the LAST layer's parts (the first layer's attention also holds the RoPE tables, which
        all layers share), "model": embedding, final norm, lm_head, loss and "rope tables" (first layer's
        attention minus the last's), "total"}."""
        last = n_layers - 1
        layer = {p: self.parts.get(f"{last}/{p}", 0) for p in LAYER_PARTS}
        model = {p: self.parts.get(p, 0) for p in MODEL_PARTS}
        model["rope tables"] = self.parts.get("0/attention", 0) - layer["attention"]
        return {"per layer": layer, "model": model, "total": self.bytes}


# ------------------------------------------------------------------------------------------ one variant
class Variant:
    """One layout of the model, built and stepped by picotron's seam, exactly as picotron.train does:
    `parallelize(cfg, mesh)` (this rank's shards at tp = world size, its AdamW, the step schedule, the loss:
    vocab-parallel under tp), then per step `schedule.run` (forward, loss, backward), `marks.clip_grad_norm`,
    `optimizer.step()`, `zero_grad()`. A loader gives every tp rank the same rows.

    While it steps, a `metrics.Recorder` on the mesh counts and times every collective of its axes, on a
    Timeline it shares with the schedule (forward / backward / wait events): `by_phase` says which ran where."""

    def __init__(self, name, cfg, mesh):
        self.name, self.cfg, self.device = name, cfg, mesh.device
        self.recorder = metrics.Recorder(metrics.Timeline(mesh.device, mesh.rank))
        self.mesh = mesh.recorded(self.recorder)  # the same groups; every axis's collectives counted and timed
        self.run = parallelize(cfg, mesh, recorder=self.recorder)  # built on that recorded mesh
        self.run.schedule.timeline = self.recorder.timeline
        self.loader = data.DataLoader(tokens(), seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size,
                                      grad_acc=1, dp_size=1, dp_rank=0, seed=cfg.seed)
        self.calls = []  # (phase, kind, bytes, seconds) of every collective of every step, in order
        self.times, self.comm_times, self.losses = [], [], []
        self.activation_bytes = self.parts = self.states = None

    def step(self, step, record=True):
        run, recorder = self.run, self.recorder
        recorder.reset()
        recorder.timeline.events.clear()
        metrics.sync(self.device)
        t0 = time.perf_counter()
        loss = run.schedule.run(run.model, self.loader.micro_batches(step), run.loss_fn)
        marks.clip_grad_norm(run.params, self.cfg.grad_clip, self.mesh)
        states = run.model.memory()  # params and grads, as picotron.train measures them: before the update
        run.optimizer.step()
        run.model.zero_grad(set_to_none=True)
        self.losses.append(loss.item())
        metrics.sync(self.device)
        elapsed = time.perf_counter() - t0
        calls = by_phase(recorder)
        self.calls += calls
        if record:
            self.times.append(elapsed)
            self.comm_times.append(sum(c[3] for c in calls))
        states["optimizer"] = metrics.optimizer_bytes(run.optimizer)  # AdamW's moments exist after its first step
        self.states, self.activation_bytes = states, run.schedule.activation_bytes

    def count_parts(self, step):
        """The bytes autograd keeps, by part of the model (`PartCounter`): one more forward and loss of step
        `step`'s batch, its graph dropped, nothing trained (the schedule counts only the total, which
        `activation_bytes` holds after a step; the two must agree)."""
        x, y, positions = (t.to(self.device) for t in self.loader.micro_batches(step)[0])
        counter = PartCounter(self.run.raw)
        with self.run.schedule.autocast(), counter:
            self.run.loss_fn(self.run.model(x, positions), y)
        self.parts = counter.summary(len(self.run.raw.layers))


def step_stats(times):
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return dict(median=statistics.median(times), q1=q[0], q3=q[2])


def slowest(values, mesh):
    """Per step, the largest value over the ranks (a step takes as long as its slowest rank)."""
    per_rank = gather(values, mesh)
    return [max(r[i] for r in per_rank) for i in range(len(values))]


def env_info(mesh, fast, st):
    mc = make_cfg(st["size"]).model_config()
    return dict(device=str(mesh.device), backend=mesh.backend, world_size=mesh.world_size, tp=mesh.tp.size,
                torch=torch.__version__, threads=torch.get_num_threads(), cores=os.cpu_count(), fast=fast,
                size=st["size"], model=SIZES[st["size"]], num_params=mc.num_params(), seq_len=st["seq_len"],
                micro_batch_size=st["micro_batch_size"])


def sp_variants(mesh):
    return (False, True) if mesh.tp.size > 1 else (False,)


def variant_name(tp, sp):
    return f"tp={tp}" + (" + sp" if sp else "")


# --------------------------------------------------------------------------------------------- experiments
def exp_comm(mesh, fast, out):
    """One forward + backward + clipping at 2 and 4 layers, sp off and on: every collective, counted."""
    st = settings(fast, mesh.device.type)
    rows = []
    for sp in sp_variants(mesh):
        per_depth = {}
        for layers in COMM_LAYERS:
            cfg = make_cfg(st["size"], tp=mesh.tp.size, sp=sp, seq_len=st["seq_len"],
                           micro_batch_size=st["micro_batch_size"], num_hidden_layers=layers)
            v = Variant(variant_name(mesh.tp.size, sp), cfg, mesh)
            v.step(1)
            per_depth[layers] = {p: counts(v.calls, p) for p in ("forward", "backward", "wait", "step")}
            calls = v.calls
            del v
        lo, hi = COMM_LAYERS
        per_layer = {p: {k: (per_depth[hi][p].get(k, 0) - per_depth[lo][p].get(k, 0)) / (hi - lo)
                         for k in set(per_depth[hi][p]) | set(per_depth[lo][p])} for p in per_depth[hi]}
        per_layer = {p: {k: c for k, c in d.items() if c} for p, d in per_layer.items()}
        outside = {p: {k: c for k, c in ((k, per_depth[lo][p].get(k, 0) - lo * per_layer[p].get(k, 0))
                                         for k in set(per_depth[lo][p]) | set(per_layer[p])) if c}
                   for p in per_depth[lo]}
        b, s, h = st["micro_batch_size"], st["seq_len"], SIZES[st["size"]]["hidden_size"]
        expected = megatron_pattern(b, s, h, sp)
        row = dict(name=variant_name(mesh.tp.size, sp), sp=sp, b=b, s=s, h=h,
                   per_layer=_keys_to_str(per_layer), outside=_keys_to_str(outside),
                   expected=_keys_to_str(expected),
                   matches=all(per_layer.get(p, {}) == expected[p] for p in ("forward", "backward")),
                   calls=[list(c) for c in calls])  # the deeper model's calls, in order (for the table)
        rows.append(row)
        if mesh.rank == 0:
            print(f"{row['name']:<10} per layer: " + " | ".join(
                f"{p}: " + ", ".join(f"{c:g} {OPS[op]} of {nb / 1024:.0f} KiB" for (op, nb), c in sorted(per_layer[p].items()))
                for p in ("forward", "backward")) + f"  -> Megatron's pattern: {'yes' if row['matches'] else 'NO'}",
                flush=True)
    return dict(settings=st, tp=mesh.tp.size, rows=rows)


def _keys_to_str(d):
    """{phase: {(op, bytes): calls}} -> {phase: {"op bytes": calls}} (JSON keys must be strings)."""
    return {p: {f"{op} {nb}": c for (op, nb), c in sorted(inner.items())} for p, inner in d.items()}


def parse_counts(d):
    """The inverse of _keys_to_str: {phase: {(op, bytes): calls}}."""
    return {p: {(k.split()[0], int(k.split()[1])): c for k, c in inner.items()} for p, inner in d.items()}


def exp_memory(mesh, fast, out):
    """One step of each variant: activations by part (and in total), model states per rank, with formulas."""
    st = settings(fast, mesh.device.type)
    rows = []
    for sp in sp_variants(mesh):
        cfg = make_cfg(st["size"], tp=mesh.tp.size, sp=sp, seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"])
        v = Variant(variant_name(mesh.tp.size, sp), cfg, mesh)
        v.step(1, record=False)
        v.count_parts(1)
        mc = v.run.raw.config
        formula = activation_parts(mc, st["seq_len"], st["micro_batch_size"], mesh.tp.size, sp)
        row = dict(name=v.name, sp=sp, parts_by_rank=gather(v.parts, mesh), states_by_rank=gather(v.states, mesh),
                   schedule_by_rank=gather(v.activation_bytes, mesh),
                   formula=formula, formula_total=activation_bytes(mc, st["seq_len"], st["micro_batch_size"],
                                                                   mesh.tp.size, sp),
                   formula_states=model_state_bytes(mc, mesh.tp.size),
                   params_per_rank=sum(p.numel() for p in v.run.raw.parameters()))
        rows.append(row)
        if mesh.rank == 0:
            got = row["parts_by_rank"][0]
            m = row["states_by_rank"][0]
            print(f"{v.name:<10} rank 0: activations {got['total'] / MiB:6.2f} MiB (formula {row['formula_total'] / MiB:6.2f}, "
                  f"the step schedule's count {row['schedule_by_rank'][0] / MiB:6.2f}), "
                  f"per layer {sum(got['per layer'].values()) / MiB:5.2f} MiB | model states " +
                  ", ".join(f"{k} {m[k] / MiB:.2f}" for k in PARTS) + " MiB", flush=True)
        del v
    return dict(settings=st, tp=mesh.tp.size, rows=rows)


def exp_scaling(mesh, fast, out):
    """Steps of sp off and sp on, interleaved: step time, tokens/s, time inside collectives."""
    st = settings(fast, mesh.device.type)
    variants = [Variant(variant_name(mesh.tp.size, sp),
                        make_cfg(st["size"], tp=mesh.tp.size, sp=sp, seq_len=st["seq_len"],
                                 micro_batch_size=st["micro_batch_size"]), mesh) for sp in sp_variants(mesh)]
    run_interleaved(variants, st["steps"], st["warmup"], mesh.tp.group)
    rows = []
    tokens_per_step = st["micro_batch_size"] * st["seq_len"]
    act = 4 * tokens_per_step * SIZES[st["size"]]["hidden_size"]
    for v in variants:
        times = slowest(v.times, mesh)
        comm = slowest(v.comm_times, mesh)
        per_call = {}  # the activation-sized collectives: median seconds per call on this rank, and calls per step
        for op in OPS:
            secs = [c[3] for c in v.calls if c[1] == op and c[2] == act]
            if secs:
                per_call[op] = dict(median_s=statistics.median(secs), per_step=len(secs) / (st["steps"] + st["warmup"]))
        row = dict(name=v.name, sp=v.cfg.sp, step_times=times, comm_times=comm, **step_stats(times),
                   comm_median=statistics.median(comm), tokens_per_s=tokens_per_step / statistics.median(times),
                   losses=v.losses, per_call=gather(per_call, mesh))
        rows.append(row)
        if mesh.rank == 0:
            print(f"{v.name:<10} {1e3 * row['median']:7.1f} ms/step (median of {len(times)}, quartiles "
                  f"{1e3 * row['q1']:.1f}-{1e3 * row['q3']:.1f}), {row['tokens_per_s']:7,.0f} tokens/s, "
                  f"{1e3 * row['comm_median']:6.1f} ms in collectives ({row['comm_median'] / row['median']:.0%})" +
                  "".join(f" | {c['per_step']:g} {OPS[op]}s of {act // 1024} KiB per step, {1e3 * c['median_s']:.2f} ms each"
                          for op, c in row["per_call"][0].items()), flush=True)
    return dict(settings=st, tp=mesh.tp.size, threads=torch.get_num_threads(), rows=rows)


def _bench():
    from benchmarks import tp_vs_dtensor  # the repository root is on sys.path (_common)

    return tp_vs_dtensor


def exp_dtensor(mesh, fast, out):
    """Ours vs torch's DTensor tensor parallelism, sp off and on, one step of each in turn; per-round throughput
    ratio, the losses of both (same weights, same batches) and the model states each keeps; and the losses of the
    unsharded model on the same batches (computed in each process, no communication)."""
    st = settings(fast, mesh.device.type)
    bench = _bench()
    result = dict(settings=st, tp=mesh.tp.size, runs={})
    for sp in (False, True):
        cfg = bench.make_cfg(st["size"], seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"],
                             tp=mesh.tp.size, sp=sp)
        rows = bench.compare(cfg, mesh, st["dtensor_steps"], warmup=st["warmup"] + 1)
        med, q1, q3 = bench.paired(rows)
        name = variant_name(mesh.tp.size, sp)
        result["runs"][name] = dict(sp=sp, rows=rows, ratio=dict(median=med, q1=q1, q3=q3, n=len(rows[0]["step_times"])))
        if mesh.rank == 0:
            print(f"{name:<10} " + " | ".join(f"{r['name']} {1e3 * r['median']:7.2f} ms/step" for r in rows) +
                  f" | our throughput / DTensor's: median {med:.3f} of {len(rows[0]['step_times'])} paired rounds "
                  f"(quartiles {q1:.3f}-{q3:.3f})", flush=True)
    # the unsharded model on the same batches, with the same optimizer and clipping, in each process (no
    # collectives): how far two float orderings drift apart over these many steps at this learning rate
    ref = Variant("one process", make_cfg(st["size"], seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"]),
                  Mesh.local(mesh.device))
    for step in range(len(rows[0]["losses"])):
        ref.step(step + 1, record=False)
    result["reference_losses"] = ref.losses
    return result


def exp_parity(mesh, fast, out):
    """picotron.train at tp = world size, sp off and on (one process: the reference)."""
    st = settings(fast, mesh.device.type)
    t = mesh.tp.size
    common = dict(steps=st["parity_steps"], seq_len=st["parity_seq_len"], micro_batch_size=2, warmup_steps=2,
                  log_every=st["parity_steps"], lr=3e-3)
    result = dict(settings=st, tp=t, losses={}, mem_by_rank={})
    for sp in sp_variants(mesh):
        name = "reference" if t == 1 else variant_name(t, sp)
        cfg = make_cfg(st["size"], tp=t, sp=sp, out=str(Path(out) / f"parity_tp{t}{'_sp' if sp else ''}"), **common)
        summary = train(cfg, mesh)
        result["mem_by_rank"][name] = gather(summary["mem"], mesh)
        if mesh.rank == 0:
            result["losses"][name] = [r["loss"] for r in metrics.read_metrics(cfg.out)[0]]
    return result


EXPERIMENTS = ("comm", "memory", "scaling", "dtensor", "parity")
NEEDS_TP = ("comm", "dtensor")  # meaningless with one process


# ----------------------------------------------------------------------------- plots (for the notebook)
RANK_COLORS = ["#8dd3c7", "#fdb462", "#bebada", "#fb8072", "#80b1d3", "#b3de69", "#fccde5", "#d9d9d9"]


def _rank_color(r):
    return RANK_COLORS[r % len(RANK_COLORS)]


def plot_shards(mc, tp, sp=False, rank=0, title=""):
    """Layer 0's parameters and the embedding and LM head, each in its own slot: matrices drawn to one scale per
    panel (width = input features, height = output features), cut into tp slices along the dimension tensor
    parallelism splits, one colour per rank; replicated norm weights hatched grey. Below each: its full shape
    and rank `rank`'s shard."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    rows = shard_shapes(mc, tp, sp)[rank]
    layer = [r for r in rows if r["name"].startswith("layers.0.")]
    outer = [r for r in rows if r["name"] in ("embed_tokens.weight", "lm_head.weight")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 2.7), gridspec_kw=dict(width_ratios=[len(layer) - 0.8, 2.2]))

    def draw(ax, items, min_width=0.0):
        scale = 1 / max(max(r["full"]) for r in items if len(r["full"]) == 2)
        x = 0.0
        for r in items:
            full = r["full"]
            slot = 0.45 if len(full) == 1 else 1.0
            cx = x + slot / 2
            if len(full) == 1:  # a norm weight: a thin bar, the same on every rank
                hgt = full[0] * scale
                ax.add_patch(Rectangle((cx - 0.04, 0), 0.08, hgt, facecolor="0.85", edgecolor="k", lw=0.6, hatch="...."))
                label = f"{_short(r['name'])}\n[{full[0]:,}]"
            else:
                out_f, in_f = full
                w, hgt = max(in_f * scale, min_width), out_f * scale
                for k in range(tp):
                    if r["dim"] == 1:  # columns (input features) split: vertical bands, rank 0 on the left
                        patch = (cx - w / 2 + k * w / tp, 0), w / tp, hgt
                    else:  # rows (output features, vocabulary) split: horizontal bands, rank 0 on top
                        patch = (cx - w / 2, hgt - (k + 1) * hgt / tp), w, hgt / tp
                    ax.add_patch(Rectangle(*patch, facecolor=_rank_color(k), edgecolor="k", lw=0.4))
                label = f"{_short(r['name'])}\n{out_f:,}×{in_f:,}\nrank {rank}: {r['shard'][0]:,}×{r['shard'][1]:,}"
                if r["kind"].startswith("tied"):
                    label += "\n(tied: the embedding)"
            ax.text(cx, -0.04, label, ha="center", va="top", fontsize=6.5)
            x += slot + 0.12
        ax.set_xlim(-0.06, x - 0.06)
        ax.set_ylim(-0.4, 1.02)
        ax.set_aspect("equal", adjustable="box")
        ax.axis("off")

    draw(ax1, layer)
    ax1.set_title(f"layer 0 of {mc.num_hidden_layers} (every layer alike), one scale", fontsize=9)
    draw(ax2, outer, min_width=0.3)
    ax2.set_title("embedding, LM head (own scale)", fontsize=9)
    handles = [Rectangle((0, 0), 1, 1, facecolor=_rank_color(k), edgecolor="k", lw=0.4, label=f"rank {k}")
               for k in range(min(tp, 8))]
    handles.append(Rectangle((0, 0), 1, 1, facecolor="0.85", edgecolor="k", hatch="....", label="replicated"))
    fig.legend(handles=handles, loc="upper right", fontsize=7, ncol=min(tp, 8) + 1, frameon=False)
    fig.suptitle(title or f"tp={tp}{' + sp' if sp else ''}: what each rank holds", fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig


def _short(name):
    name = name.replace("layers.0.", "").replace(".weight", "").replace("self_attn.", "").replace("mlp.", "")
    return {"input_layernorm": "input norm", "post_attention_layernorm": "post-attn norm"}.get(name, name)


def shard_table(mc, tp, sp=False, max_ranks=4):
    """Text: every parameter of layer 0, the embedding, the final norm and the LM head, with each rank's shape
    and slice (the first max_ranks ranks)."""
    shapes = shard_shapes(mc, tp, sp)
    ranks = range(min(tp, max_ranks))
    cells = {}
    for k in ranks:
        for j, q in enumerate(shapes[k]):
            where = "" if q["dim"] is None or tp == 1 else f" {'rows' if q['dim'] == 0 else 'cols'} {q['lo']}:{q['hi']}"
            cells[k, j] = "x".join(map(str, q["shard"])) + where
    width = max(len(c) for c in cells.values()) + 3
    lines = [f"{'parameter':<42}{'full shape':>13}  {'how':<30}" + "".join(f"{'rank ' + str(k):>{width}}" for k in ranks)]
    for j, r in enumerate(shapes[0]):
        lines.append(f"{r['name']:<42}{'x'.join(map(str, r['full'])):>13}  {r['kind']:<30}"
                     + "".join(f"{cells[k, j]:>{width}}" for k in ranks))
    if tp > max_ranks:
        lines.append(f"(ranks {max_ranks}..{tp - 1}: the next slices, alike)")
    return "\n".join(lines)


def plot_memory_model(mc, tp, sp=False, seq_len=4096, micro_batch_size=1, flash=True, capacity_gb=80.0, title=""):
    """The widget's right-hand figure: bytes per rank (textbook formulas) for every tp the model allows, sp off
    and on, the chosen one outlined, and the GPU's capacity as a line."""
    import matplotlib.pyplot as plt

    GB = 1e9
    tps = [t for t in valid_tps(mc) if t <= 64]
    fig, ax = plt.subplots(figsize=(11, 3.2))
    keys = ("params", "grads", "optimizer", "activations")
    x = 0
    ticks, labels = [], []
    for t in tps:
        for s_p in ((False, True) if t > 1 else (False,)):  # at tp = 1 sp changes nothing
            m = memory_per_rank(mc, t, s_p, seq_len, micro_batch_size, flash)
            bottom = 0
            chosen = t == tp and (s_p == sp or t == 1)
            for k in keys:
                ax.bar(x, m[k] / GB, 0.8, bottom=bottom, color=PART_COLORS[k], label=k if x == 0 else None,
                       edgecolor="k" if chosen else "white", lw=2 if chosen else 0.5)
                bottom += m[k] / GB
            ax.text(x, bottom, f"{bottom:,.1f}", ha="center", va="bottom", fontsize=7)
            ticks.append(x)
            labels.append(f"tp={t}" + ("\n+sp" if s_p else ""))
            x += 1
        x += 0.5
    ax.axhline(capacity_gb, color="#c44e52", ls="--", lw=1, label=f"{capacity_gb:g} GB per GPU")
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set_ylabel("GB per GPU")
    ax.set_title(f"per rank: model states (16 bytes per parameter held, mixed precision) + activations of the "
                 f"layers (Korthikanti, bf16{', no s² scores' if flash else ''}), s={seq_len}, b={micro_batch_size} "
                 f"{title}", fontsize=8, loc="left")
    ax.legend(fontsize=7, ncol=5, loc="upper right")
    fig.tight_layout()
    return fig


def plot_comm(results):
    """results: {tp: comm result}. Per tp and sp: the collectives per layer, forward and backward, measured
    (bars) next to Megatron's pattern (black outline), in units of one b·s·h activation, an all-reduce counted as
    the reduce-scatter plus all-gather a ring does (so the bars compare bytes moved)."""
    import matplotlib.pyplot as plt

    colors = {"all_reduce": "#8172b2", "all_gather": "#4c72b0", "reduce_scatter": "#dd8452"}
    labels_of = {"all_reduce": "all-reduce (counted as RS + AG)", "all_gather": "all-gather",
                 "reduce_scatter": "reduce-scatter"}
    weight = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
    tps = sorted(results)
    fig, axes = plt.subplots(1, len(tps), figsize=(5.2 * len(tps), 3.2), sharey=True, squeeze=False)
    for ax, t in zip(axes[0], tps):
        x, ticks, labels = 0, [], []
        for row in results[t]["rows"]:
            act = 4 * row["b"] * row["s"] * row["h"]
            got, exp = parse_counts(row["per_layer"]), parse_counts(row["expected"])
            for phase in ("forward", "backward"):
                bottom = 0
                for op in colors:
                    n = sum(weight[op] * c * nb / act for (o, nb), c in got.get(phase, {}).items() if o == op)
                    if n:
                        ax.bar(x, n, 0.7, bottom=bottom, color=colors[op], label=labels_of[op])
                        bottom += n
                want = sum(weight[o] * c * nb / act for (o, nb), c in exp[phase].items())
                ax.bar(x, want, 0.86, fill=False, edgecolor="k", lw=1.2, label="Megatron's pattern")
                ticks.append(x)
                labels.append(f"{'+sp' if row['sp'] else 'no sp'}\n{phase}")
                x += 1
            x += 0.5
        ax.set_xticks(ticks, labels, fontsize=7)
        ax.set_title(f"tp={t}: collectives per layer", fontsize=9)
    axes[0][0].set_ylabel("buffers moved / (b·s·h activation)")
    handles, seen = [], set()
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in seen:
                seen.add(lab)
                handles.append(h)
    axes[0][0].legend(handles=handles, fontsize=7, loc="lower left")
    fig.tight_layout()
    return fig


def plot_activations(results, mc, seq_len, micro_batch_size):
    """results: {tp: memory result}. Left: activations per layer per rank against tp, sp off and on: measured
    (points, rank 0) and our formula (lines), Korthikanti's shape scaled to our tp = 1 (dotted). Right: rank 0's
    activations by part, stacked, for every variant."""
    import matplotlib.pyplot as plt

    tps = sorted(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.6), gridspec_kw=dict(width_ratios=[1, 1.5]))
    grid = [1, 2, 3, 4, 6, 8]
    one = sum(activation_parts(mc, seq_len, micro_batch_size, 1)["per layer"].values())
    s, b, h, a = seq_len, micro_batch_size, mc.hidden_size, mc.num_attention_heads
    for sp, color in ((False, "#4c72b0"), (True, "#c44e52")):
        meas = [(t, sum(r["parts_by_rank"][0]["per layer"].values())) for t in tps for r in results[t]["rows"]
                if r["sp"] == sp or t == 1]
        ax1.plot([t for t, _ in meas], [m / MiB for _, m in meas], "o", color=color, ms=7,
                 label=f"measured{' + sp' if sp else ''} (rank 0)")
        ts = [t for t in grid if t > 1 or not sp]  # sp needs tp > 1
        ax1.plot(ts, [sum(activation_parts(mc, s, b, t, sp)["per layer"].values()) / MiB for t in ts], "-",
                 color=color, lw=1, label=f"our formula{' + sp' if sp else ''}")
        k1 = korthikanti_bytes_per_layer(s, b, h, a, 1, False, flash=True)
        ax1.plot(ts, [one * korthikanti_bytes_per_layer(s, b, h, a, t, sp, flash=True) / k1 / MiB for t in ts], ":",
                 color=color, lw=1.5, label=f"Korthikanti{' + sp' if sp else ''}, scaled to our tp=1")
    ax1.set(xlabel="tp", ylabel="MiB per layer per rank", title="activations of one layer, per rank")
    ax1.set_xticks(grid)
    ax1.legend(fontsize=7)
    parts = LAYER_PARTS
    colors = dict(zip(parts, ["#8da0cb", "#fc8d62", "#a6d854", "#e78ac3"]))
    x, ticks, labels = 0, [], []
    for t in tps:
        for r in results[t]["rows"]:
            got = r["parts_by_rank"][0]["per layer"]
            want = r["formula"]["per layer"]
            for dx, src, hatch in ((-0.2, got, None), (0.2, want, "//")):
                bottom = 0
                for p in parts:
                    ax2.bar(x + dx, src[p] / MiB, 0.38, bottom=bottom, color=colors[p], hatch=hatch, edgecolor="white",
                            label=p if (x == 0 and hatch is None) else None)
                    bottom += src[p] / MiB
            ticks.append(x)
            labels.append(r["name"])
            x += 1
    ax2.set_xticks(ticks, labels, fontsize=8)
    ax2.set(ylabel="MiB per layer (rank 0)", title="by part: measured (left), formula (right, hatched)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_memory(results):
    """results: {tp: memory result}. Rank 0's bytes per variant, stacked params / grads / optimizer /
    activations: measured (solid) next to the formulas (hatched)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.4))
    x, ticks, labels = 0, [], []
    for t in sorted(results):
        for r in results[t]["rows"]:
            got = dict(r["states_by_rank"][0], activations=r["parts_by_rank"][0]["total"])
            want = dict(r["formula_states"], activations=r["formula_total"])
            for dx, src, hatch in ((-0.2, got, None), (0.2, want, "//")):
                bottom = 0
                for k in (*PARTS, "activations"):
                    ax.bar(x + dx, src[k] / MiB, 0.38, bottom=bottom, color=PART_COLORS[k], hatch=hatch,
                           edgecolor="white", label=k if (x == 0 and hatch is None) else None)
                    bottom += src[k] / MiB
            ax.text(x, bottom, f"{bottom:.1f}", ha="center", va="bottom", fontsize=7)
            ticks.append(x)
            labels.append(r["name"])
            x += 1
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set(ylabel="MiB per rank (rank 0)", title="memory per rank: measured (left), formulas (right, hatched)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_scaling(results, oversubscribed=4):
    """results: {tp: scaling result}. Left: tokens/s against tp, sp off and on; right: each variant's median
    step split into time inside collectives and the rest."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.4))
    tps = sorted(results)
    for sp, color in ((False, "#4c72b0"), (True, "#c44e52")):
        pts = [(t, r) for t in tps for r in results[t]["rows"] if r["sp"] == sp or t == 1]
        ax1.plot([t for t, _ in pts], [r["tokens_per_s"] for _, r in pts], "o-", color=color,
                 label="tp" + (" + sp" if sp else ""))
        for t, r in pts:
            lo, hi = (r["tokens_per_s"] * r["median"] / q for q in (r["q3"], r["q1"]))
            ax1.plot([t, t], [lo, hi], color=color, lw=3, alpha=0.4)
    ax1.axvspan(oversubscribed - 0.3, max(tps) + 0.3, color="0.9", zorder=0,
                label="more ranks than cores (oversubscribed)") if max(tps) >= oversubscribed else None
    ax1.set(xlabel="tp (ranks)", ylabel="tokens/s (median step)", title="throughput: the same batch on every rank")
    ax1.set_xticks(tps)
    ax1.set_ylim(bottom=0)
    ax1.legend(fontsize=7)
    x, ticks, labels = 0, [], []
    for t in tps:
        for r in results[t]["rows"]:
            comm, med = 1e3 * r["comm_median"], 1e3 * r["median"]
            ax2.bar(x, med - comm, 0.7, color="#8da0cb", label="compute and the rest" if x == 0 else None)
            ax2.bar(x, comm, 0.7, bottom=med - comm, color="#fc8d62", label="inside collectives" if x == 0 else None)
            ax2.text(x, med, f"{comm / med:.0%}", ha="center", va="bottom", fontsize=7)
            ticks.append(x)
            labels.append(r["name"].replace(" + ", "\n+"))
            x += 1
    ax2.set_xticks(ticks, labels, fontsize=8)
    ax2.set(ylabel="ms per step (median, slowest rank)", title="where the step goes (label: share in collectives)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_dtensor(res):
    """Per sp setting: the per-round throughput ratio ours / DTensor's (histogram), the two step times, and each
    one's loss against the unsharded model's on the same batches, step by step."""
    import matplotlib.pyplot as plt

    runs, ref = res["runs"], res["reference_losses"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.2))
    colors = {False: "#4c72b0", True: "#c44e52"}
    x = 0
    for name, run in runs.items():
        ours, theirs = run["rows"][0]["step_times"], run["rows"][1]["step_times"]
        ratios = [b / a for a, b in zip(ours, theirs)]
        r = run["ratio"]
        axes[0].hist(ratios, bins=max(5, min(20, len(ratios) // 2)), color=colors[run["sp"]], alpha=0.6,
                     label=f"{name}: median {r['median']:.2f}")
        axes[0].axvline(r["median"], color=colors[run["sp"]], lw=1.5)
        for k, row in enumerate(run["rows"]):
            axes[1].bar(x + 0.4 * k, 1e3 * statistics.median(row["step_times"]), 0.38,
                        color=["#4c72b0", "#dd8452"][k], label=row["name"] if x == 0 else None)
            rel = [max(abs(a - b) / abs(b), 1e-9) for a, b in zip(row["losses"], ref)]
            axes[2].semilogy(range(1, len(rel) + 1), rel, ["-", "--"][k], color=colors[run["sp"]], lw=1,
                             label=f"{row['name']}, {name}")
        x += 1
    axes[0].axvline(1.0, color="k", ls="--", lw=1, label="1 = as fast as DTensor")
    axes[0].set(xlabel="ours / DTensor throughput, per round", title="paired rounds")
    axes[0].legend(fontsize=7)
    axes[1].set_xticks([i + 0.2 for i in range(len(runs))], list(runs))
    axes[1].set(ylabel="ms per step (median, slowest rank)", title=f"tp={res['tp']}: step time")
    axes[1].legend(fontsize=7)
    axes[2].axhline(1e-5, color="k", ls=":", lw=1)
    axes[2].set(xlabel="step", ylabel="|Δloss| / loss vs one process", ylim=(1e-9, 1), title="against the unsharded model")
    axes[2].legend(fontsize=6)
    fig.tight_layout()
    return fig


plot_parity = functools.partial(_common.plot_parity, what="each layout")  # for the notebook


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(_common.ROOT / "runs" / "lessons" / "05_tensor_parallel"))
    p.add_argument("--only", default=",".join(EXPERIMENTS), help=f"comma-separated subset of {EXPERIMENTS}")
    p.add_argument("--fast", action="store_true", default=_common.FAST, help="short settings (or PICOTRON_FAST=1)")
    args = p.parse_args(argv)
    names = args.only.split(",")
    if any(name not in EXPERIMENTS for name in names):
        p.error(f"--only {args.only!r}: pick a comma-separated subset of {', '.join(EXPERIMENTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = Mesh.init(tp=world)
    try:
        st = settings(args.fast, mesh.device.type)
        env = env_info(mesh, args.fast, st)
        for name in names:
            if world == 1 and name in NEEDS_TP:
                if mesh.rank == 0:
                    print(f"== {name}: needs tp >= 2 (torchrun --nproc_per_node 2); skipped", flush=True)
                continue
            t0 = time.perf_counter()
            result = globals()[f"exp_{name}"](mesh, args.fast, out)
            file = out / f"{name}_tp{world}.json"
            if mesh.rank == 0:
                _common.save_json(dict(env, results=result, seconds=time.perf_counter() - t0), file)
                path = os.path.relpath(file)  # short (and free of home directories) in notebooks
                print(f"== {name}: {time.perf_counter() - t0:.1f} s -> {file if path.startswith('..') else path}",
                      flush=True)
    finally:
        mesh.destroy()


if __name__ == "__main__":
    main()
