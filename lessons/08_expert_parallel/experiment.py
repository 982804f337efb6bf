"""Lesson 08's experiments: mixture of experts and expert parallelism measured through picotron's own seams
(`picotron.train`, `parallelize` with a `metrics.Recorder`, the MoE layers' counts and each layer's `Exchange`),
and the notebook's formulas and plots.

    torchrun --nproc_per_node 2 lessons/08_expert_parallel/experiment.py [--only balance,bytes,scaling,parity,router,overlap]
    torchrun --nproc_per_node 4 lessons/08_expert_parallel/experiment.py --only bytes,scaling,parity
    torchrun --nproc_per_node 8 lessons/08_expert_parallel/experiment.py --only bytes,scaling,parity  # 8 experts
    PICOTRON_FAST=1 ...    # short settings (the notebook's FAST mode)

Rank 0 writes OUT/<name>_ep<W>.json (W = the world size). balance: picotron.train on tiny-moe at dp = ep = 2,
without and with the auxiliary loss, the routing of every step (record["moe"]), then the dropped fraction of
both trained models against the capacity factor. bytes: training steps at ep = W with every collective counted
and timed (a Recorder with a Timeline; attention and experts timed by module hooks), the rows each Exchange sent
against the rows the measured routing predicts, and against the balanced formula. scaling: ep = 1 (experts
replicated), 2 (and 4) at the same global batch, one step of each in turn: model-state bytes per rank against
the formula and tokens/s. parity: picotron.train at ep = W (and dp4 x ep2, ep2 x tp2 on 4 processes) against one
process with the same global batch, and the trap: expert gradients divided by their own group (edp), not dp x cp.
router: DeepSeek-V3's router (tiny-deepseek-moe) at dp = ep = W without balancing, with the aux loss and with the
bias update, every step's loads and loss, and the bias run's final routing biases. overlap: blocking against
--ep-overlap (tiny-deepseek-moe at dp = ep = W, one step of each in turn, each exchange on its own emulated link):
step times, the waits for the row all-to-alls (the exposed communication) against planner.ep_overlap_exposed_seconds
from the measured link times and compute, one step of each on a timeline.
"""
import copy
import dataclasses
import math
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/
import _common  # noqa: E402  (puts the repository root on sys.path)
from _common import gather, run_interleaved, say  # noqa: E402
from _plots import FONT, legend_below, plot_parity_below  # noqa: E402  (figure helpers several lessons share)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from picotron import expert_parallel, marks, metrics, moe, parallelize as par, planner  # noqa: E402
from picotron.config import Config  # noqa: E402
from picotron.link import EmulatedLink  # noqa: E402
from picotron.mesh import Axis, Comm, Mesh  # noqa: E402
from picotron.model import ModelConfig  # noqa: E402
from picotron.train import load_data, train  # noqa: E402

MiB = 2**20
KINDS = ("dispatch", "combine", "dispatch-backward", "combine-backward")
KIND_COLORS = {"dispatch": "#4c72b0", "combine": "#dd8452", "dispatch-backward": "#55a868",
               "combine-backward": "#c44e52"}
EXPERT_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860", "#da8bc3", "#8c8c8c"]


def settings(fast, device_type=None):
    """tiny-moe (h = 128, 4 experts of i = 192, top-2, 4 layers), 8 sequences of 64 tokens per rank and step (on GPUs
    _common.GPU_SETTINGS["08_expert_parallel"] on top; device_type: the mesh's, else _common.device())."""
    st = dict(preset="tiny-moe", seq_len=64, micro_batch_size=8,
              balance_steps=60 if fast else 200, aux_coefs=(0.0, 0.01), capacities=(0.5, 0.75, 1.0, 1.25, 1.5, 2.0),
              bytes_steps=2 if fast else 4,
              scale_steps=2 if fast else 6, scale_warmup=1,
              parity_steps=10, parity_seq_len=32, parity_mbs=2, parity_grad_acc=2,
              router_preset="tiny-deepseek-moe", router_steps=30 if fast else 200, router_aux=0.01, router_gamma=0.01,
              overlap_preset="tiny-deepseek-moe", overlap_seq_len=64, overlap_mbs=8, overlap_steps=4 if fast else 10,
              overlap_warmup=1, overlap_latency=2e-4, overlap_link_ratio=1.0)
    return _common.sized("08_expert_parallel", st, fast, device_type)


def at_world(st, W):
    """The settings on W processes: ep = W needs W to divide the experts; tiny-moe's 4 do for W = 2 and 4, and for
    W = 8 (PICOTRON_NPROC=8) every MoE model of the lesson gets 8 (tiny-deepseek-moe has 8 already)."""
    return dict(st, experts=None if 4 % W == 0 else W)


def make_cfg(st, **kw):
    """A picotron Config of the lesson's MoE model (no sampling, no evaluation), with `kw` on top (and the experts
    at_world set, if any)."""
    experts = {"experts": st["experts"]} if st.get("experts") else {}
    return Config(**{"preset": st["preset"], "seq_len": st["seq_len"], "micro_batch_size": st["micro_batch_size"],
                     "sample_tokens": 0, "eval_every": 0, "log_every": 10**6, **experts, **kw})


def model_config(st=None, **kw):
    return ModelConfig.from_preset((st or {}).get("preset", "tiny-moe"), **kw)


# ------------------------------------------------------------------------------------- the formulas
def route_by_hand(logits, k):
    """Mixtral's routing spelled out: (probs, top-k probs, their experts, the renormalised weights)."""
    probs = torch.softmax(logits.float(), dim=-1)
    top, experts = probs.topk(k, dim=-1)
    return probs, top, experts, top / top.sum(-1, keepdim=True)


def send_matrix(counts_by_rank, ep):
    """rows[r][j]: the (token, choice) rows rank r sends to rank j, from counts_by_rank[r][e] (rank r's rows for
    expert e; rank j holds experts j·E/ep .. (j+1)·E/ep - 1, contiguous in the sort)."""
    E = len(counts_by_rank[0])
    L = E // ep
    return [[sum(c[j * L:(j + 1) * L]) for j in range(ep)] for c in counts_by_rank]


def predicted_rows(counts_by_rank, ep):
    """Per rank: {kind: rows sent to OTHER ranks} by one MoE layer's all-to-alls (forward and backward), from the
    routing alone. dispatch: my rows for other ranks' experts; combine: the outputs of the rows others sent me;
    backward: the gradients travel back the other way (dispatch-backward = combine, combine-backward = dispatch)."""
    m = send_matrix(counts_by_rank, ep)
    out = []
    for r in range(ep):
        away = sum(m[r]) - m[r][r]
        home = sum(m[j][r] for j in range(ep)) - m[r][r]
        out.append({"dispatch": away, "combine": home, "dispatch-backward": home, "combine-backward": away})
    return out


def predicted_a2a_bytes(counts_by_rank, ep, hidden, elem=4):
    """Per rank: the bytes the Recorder counts for one MoE layer's all-to-alls: it counts each call's whole
    input buffer, the block a rank keeps for itself included: the counts (E int64), dispatch (all my rows),
    combine (all rows I received), and their backwards (the same two sizes again)."""
    m = send_matrix(counts_by_rank, ep)
    E = len(counts_by_rank[0])
    return [8 * E + 2 * elem * hidden * (sum(m[r]) + sum(m[j][r] for j in range(ep))) for r in range(ep)]


def model_state_parts(mc, ep=1, elem=4):
    """Parameters one rank holds with the experts spread over ep ranks: the dense part (attention, norms,
    embedding, routers) and E/ep experts per layer; fp32 AdamW keeps 4 copies of each (weights, gradients, two
    moments), plus a 4-byte step counter per tensor."""
    total = mc.num_params()
    expert = 3 * mc.hidden_size * mc.intermediate_size
    experts_all = mc.num_hidden_layers * mc.num_local_experts * expert
    dense = total - experts_all
    held_experts = experts_all // ep
    return dict(dense=dense, experts=held_experts, params=dense + held_experts,
                bytes=4 * elem * (dense + held_experts))


def expected_dropped(E, k, c, s):
    """The fraction of (token, choice) pairs capacity drops when every token picks k distinct experts uniformly at
    random: expert e's load in a sequence of s tokens is Binomial(s, k/E), its capacity ceil(κ·s·k/E) (κ: c here)."""
    if c <= 0:
        return 0.0
    cap, p = math.ceil(c * s * k / E), k / E
    if p >= 1:  # every expert gets every token
        return max(0, s - cap) / s
    log_pmf = lambda n: (math.lgamma(s + 1) - math.lgamma(n + 1) - math.lgamma(s - n + 1) + n * math.log(p)
                         + (s - n) * math.log1p(-p))  # in logs: s = 4096 overflows floats otherwise
    over = sum(math.exp(log_pmf(n)) * (n - cap) for n in range(cap + 1, s + 1))
    return E * over / (s * k)


def load_ratio(tokens_per_expert):
    """Per layer: the busiest expert's tokens over the mean (1 = perfectly balanced, E/k = one expert takes all)."""
    return [max(row) / (sum(row) / len(row)) for row in tokens_per_expert]


def window_ratio(records, last):
    """The load ratio of each layer over the last `last` steps' tokens summed."""
    rows = [r["moe"]["tokens_per_expert"] for r in records[-last:]]
    summed = [[sum(r[layer][e] for r in rows) for e in range(len(rows[0][0]))] for layer in range(len(rows[0]))]
    return load_ratio(summed)


def widget_numbers(preset="mixtral-8x7b", E=8, k=2, ep=8, c=1.25, tokens=4096, elem=2):
    """What the widget shows for one GPU: parameters (dense, experts held), model states with mixed-precision Adam
    (elem-byte weights and gradients, fp32 master and two moments: 2·elem + 12 bytes per parameter), the
    all-to-all bytes per step for `tokens` tokens per GPU (balanced routing), and the fraction of choices a
    capacity factor c would drop under uniformly random routing of sequences of `tokens` tokens."""
    mc = ModelConfig.from_preset(preset, num_local_experts=E, num_experts_per_tok=min(k, E))
    parts = model_state_parts(mc, ep)
    per_param = 2 * elem + 12
    return dict(dense=parts["dense"], experts=parts["experts"], total=mc.num_params(),
                active=mc.num_params(active=True), state_bytes=per_param * parts["params"],
                dense_bytes=per_param * parts["dense"], expert_bytes=per_param * parts["experts"],
                a2a_bytes=expert_parallel.bytes_per_step_formula(tokens, min(k, E), mc.hidden_size, ep,
                                                                 mc.num_hidden_layers, elem),
                dropped=expected_dropped(E, min(k, E), c, tokens), mc=mc)


# ------------------------------------------------------------------------------------------- measuring
def time_step(preset, steps=6, seq_len=64, batch=8, **kw):
    """One process: median seconds of a forward + backward of `preset` on batch x seq_len tokens."""
    from picotron.model import Llama

    torch.manual_seed(0)
    model = Llama(ModelConfig.from_preset(preset, **kw)).init_weights(0)
    ids = torch.randint(0, 256, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        logits = model(ids[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def _records(cfg, mesh):
    return metrics.read_metrics(cfg.out)[0] if mesh.rank == 0 else None


def exp_balance(mesh, st, out):
    """tiny-moe at dp = ep = 2 without and with the auxiliary loss: every step's routing; then both trained models'
    dropped fraction against the capacity factor on one batch."""
    result, W = dict(runs={}, capacities=list(st["capacities"])), mesh.world_size
    for coef in st["aux_coefs"]:
        cfg = make_cfg(st, dp=W, ep=W, steps=st["balance_steps"], aux_loss_coef=coef, warmup_steps=10,
                       out=str(Path(out) / f"balance_aux{coef:g}"))
        with Mesh.init(dp=W, ep=W) as sub:
            _, run = train(cfg, sub, return_model=True)
            recs = _records(cfg, sub)
            x, _, positions = load_data(cfg, sub)[1].micro_batches(st["balance_steps"] + 1)[0]
            blocks = [m for m in run.raw.modules() if isinstance(m, moe.MoE)]
            dropped = []
            with torch.no_grad():
                for c in st["capacities"]:
                    for b in blocks:
                        b.capacity_factor = c
                    run.raw(x, positions)
                    stats = moe.step_stats(run.raw, sub.dp_cp)
                    dropped.append(stats["dropped"] / (sum(stats["tokens_per_expert"][0]) * len(blocks)))
        if mesh.rank == 0:
            result["runs"][f"{coef:g}"] = dict(
                coef=coef, loss=[r["loss"] for r in recs], aux=[r["moe"]["aux"] for r in recs],
                tokens_per_expert=[r["moe"]["tokens_per_expert"] for r in recs], dropped=dropped)
            last = max(1, len(recs) // 10)
            say(mesh, f"aux coef {coef:g}: loss {recs[0]['loss']:.3f} -> {recs[-1]['loss']:.3f}, aux "
                       f"{recs[0]['moe']['aux']:.3f} -> {recs[-1]['moe']['aux']:.3f}; load max/mean per layer over the "
                       f"last {last} steps " + " ".join(f"{x:.2f}" for x in window_ratio(recs, last))
                       + "; dropped at c = " + ", ".join(f"{c:g}: {d:.3f}" for c, d in zip(st["capacities"], dropped)))
    mc = model_config(st, **({"num_local_experts": st["experts"]} if st.get("experts") else {}))
    result["uniform"] = [expected_dropped(mc.num_local_experts, mc.num_experts_per_tok, c, st["seq_len"])
                         for c in st["capacities"]]
    return result


def timed_modules(model, timeline):
    """Forward and backward hooks that put every layer's attention and every expert on `timeline` (compute)."""
    handles = []
    for i, layer in enumerate(model.layers):
        named = [("attention", layer.self_attn)] + [(f"expert {e}", m) for e, m in
                                                      layer.block_sparse_moe.experts.items()]
        for name, m in named:
            starts = {}

            def pre(mod, args, name=name, starts=starts, i=i):
                starts["f"] = timeline.now()

            def post(mod, args, output, name=name, starts=starts, i=i):
                timeline.add(name, starts["f"], timeline.now(), kind="compute", layer=i, phase="forward")

            def bpre(mod, grad_output, name=name, starts=starts, i=i):
                starts["b"] = timeline.now()

            def bpost(mod, grad_input, grad_output, name=name, starts=starts, i=i):
                timeline.add(name, starts["b"], timeline.now(), kind="compute", layer=i, phase="backward")

            handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post),
                        m.register_full_backward_pre_hook(bpre), m.register_full_backward_hook(bpost)]
    return handles


def exp_bytes(mesh, st, out):
    """Training steps at ep = W: per step and rank, the rows every Exchange sent (by kind) and the Recorder's
    all-to-all bytes, against what this step's routing (every rank's tokens per expert) predicts, and the balanced
    formula; the last step's events (collectives, attention, experts) on a timeline."""
    W = mesh.world_size
    cfg = make_cfg(st, dp=W, ep=W, steps=st["bytes_steps"], warmup_steps=1, out=str(Path(out) / f"bytes_ep{W}"))
    timeline = metrics.Timeline(mesh.device, mesh.rank)
    recorder = metrics.Recorder(timeline)
    with Mesh.init(dp=W, ep=W) as sub:
        torch.manual_seed(cfg.seed)
        run = par.parallelize(cfg, sub, recorder=recorder)
        loader = load_data(cfg, sub)[1]
        exchanges = expert_parallel.exchanges(run.raw)
        mc = run.raw.config
        timed_modules(run.raw, timeline)
        steps = []
        for step in range(1, st["bytes_steps"] + 1):
            for ex in exchanges:
                ex.rows = {}
            recorder.reset()
            timeline.events.clear()
            dist.barrier(sub.world.group)
            t0 = timeline.now()
            run.schedule.run(run.model, loader.micro_batches(step), run.loss_fn)
            marks.clip_grad_norm(run.params, cfg.grad_clip, sub)
            run.optimizer.step()
            run.model.zero_grad(set_to_none=True)
            t1 = timeline.now()
            t0, t1 = (timeline.seconds(t) for t in (t0, t1))  # on a GPU: when the GPU got there
            local = moe.step_stats(run.raw)["tokens_per_expert"]  # this rank's routing, per layer (then reset)
            rows = {k: sum(ex.rows.get(k, 0) for ex in exchanges) for k in KINDS}
            mine = dict(rows=rows, a2a=recorder.bytes.get("all_to_all", 0), calls=dict(recorder.calls),
                        bytes=dict(recorder.bytes), counts=local)
            every = gather(mine, mesh)
            steps.append(every)
        base = timeline.t0
        events = gather(dict(events=[dict(e, start=e["start"] + base, end=e["end"] + base)
                                     for e in timeline.events], call=(t0 + base, t1 + base)), mesh)
    tokens = cfg.micro_batch_size * cfg.seq_len * cfg.grad_acc
    formula = expert_parallel.bytes_per_step_formula(tokens, mc.num_experts_per_tok, mc.hidden_size, W,
                                                     mc.num_hidden_layers)
    rows_out = []
    for s, every in enumerate(steps):
        layers = len(every[0]["counts"])
        pred_rows = [{k: 0 for k in KINDS} for _ in range(W)]
        pred_a2a = [0] * W
        for layer in range(layers):
            by_rank = [every[r]["counts"][layer] for r in range(W)]
            for r, p in enumerate(predicted_rows(by_rank, W)):
                for k in KINDS:
                    pred_rows[r][k] += p[k]
            for r, b in enumerate(predicted_a2a_bytes(by_rank, W, mc.hidden_size)):
                pred_a2a[r] += b
        rows_out.append(dict(step=s + 1, measured=[e["rows"] for e in every], predicted=pred_rows,
                             a2a=[e["a2a"] for e in every], a2a_predicted=pred_a2a,
                             bytes=[e["bytes"] for e in every], counts=[e["counts"] for e in every]))
        sent = [sum(e["rows"].values()) * mc.hidden_size * 4 for e in every]
        say(mesh, f"ep={W} step {s + 1}: rows sent to other ranks per rank " + " ".join(
            str(sum(e["rows"].values())) for e in every) + " -> " + " ".join(f"{b / MiB:.3f}" for b in sent)
             + f" MiB (balanced formula {formula / MiB:.3f} MiB); Recorder all-to-all " + " ".join(
            f"{e['a2a'] / MiB:.3f}" for e in every) + " MiB (predicted " + " ".join(
            f"{b / MiB:.3f}" for b in pred_a2a) + ")")
    return dict(ep=W, tokens=tokens, hidden=mc.hidden_size, k=mc.num_experts_per_tok, E=mc.num_local_experts,
                layers=mc.num_hidden_layers, formula=formula, steps=rows_out, events=events)


class Stepper:
    """One layout (dp = W, ep) built as picotron.train builds it, stepped as it steps: each recorded step's time
    (the slowest rank's) and this rank's model-state bytes (parameters, gradients, optimizer state)."""

    def __init__(self, cfg, mesh):
        self.cfg, self.mesh = cfg, mesh
        torch.manual_seed(cfg.seed)
        self.run = par.parallelize(cfg, mesh)
        self.loader = load_data(cfg, mesh)[1]
        self.times, self.mem = [], None

    def step(self, step, record=True):
        run = self.run
        t0 = time.perf_counter()
        run.schedule.run(run.model, self.loader.micro_batches(step), run.loss_fn)
        marks.clip_grad_norm(run.params, self.cfg.grad_clip, self.mesh)
        mem = run.model.memory()
        run.optimizer.step()
        mem["optimizer"] = metrics.optimizer_bytes(run.optimizer)
        run.model.zero_grad(set_to_none=True)
        moe.step_stats(run.raw)  # reset the counts
        dt = torch.tensor([time.perf_counter() - t0])
        self.mesh.world.all_reduce(dt, op=dist.ReduceOp.MAX)
        self.mem = mem
        if record:
            self.times.append(dt.item())


def exp_scaling(mesh, st, out):
    """dp = W with ep = 1 (every expert on every rank), 2, ... W, the same global batch, one step of each in turn:
    model-state bytes per rank against `model_state_parts`, tokens/s (median step)."""
    W = mesh.world_size
    eps = [e for e in (1, 2, 4, 8) if e <= W and W % e == 0]
    meshes = {ep: Mesh.init(dp=W, ep=ep) for ep in eps}
    try:
        variants = {ep: Stepper(make_cfg(st, dp=W, ep=ep), meshes[ep]) for ep in eps}
        run_interleaved(list(variants.values()), st["scale_steps"], st["scale_warmup"], mesh.world.group)
        rows = {}
        for ep, v in variants.items():
            mc = v.run.raw.config
            n_tensors = sum(1 for _ in v.run.raw.parameters())
            parts = model_state_parts(mc, ep)
            med = statistics.median(v.times)
            tokens = W * v.cfg.micro_batch_size * v.cfg.seq_len * v.cfg.grad_acc
            rows[ep] = dict(mem=gather(v.mem, mesh), parts=parts, formula=parts["bytes"] + 4 * n_tensors,
                            n_tensors=n_tensors, times=v.times, step_s=med, tokens_per_s=tokens / med)
            say(mesh, f"W={W} ep={ep}: model states per rank {sum(v.mem.values()) / MiB:.2f} MiB (formula "
                       f"{rows[ep]['formula'] / MiB:.2f}: {parts['dense'] / 1e6:.3f} M dense + {parts['experts'] / 1e6:.3f} M "
                       f"of experts); step {1e3 * med:.0f} ms (median of {len(v.times)}), {tokens / med:.0f} tokens/s")
    finally:
        for m in meshes.values():
            m.destroy()
    return dict(world=W, rows=rows)


# --------------------------------------------------------------------------------------------- parity
@contextmanager
def experts_divided_by_edp():
    """Inside: every expert's gradient is divided by its own group's size (edp) instead of dp x cp: the trap. Done as
    a hook that multiplies it by dp·cp / edp before the data-parallel sum divides by dp·cp."""
    original = par.build_model

    def build(cfg, mesh, store=None):
        model = original(cfg, mesh, store)
        factor = mesh.dp_cp.size / mesh.edp.size
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.register_hook(lambda g: g * factor)
        return model

    par.build_model = build
    try:
        yield
    finally:
        par.build_model = original


def _trained(mesh, st, out, name, **kw):
    """picotron.train on `mesh` with the parity settings: per-step (losses, gradient norms) on rank 0."""
    cfg = make_cfg(st, **{**dict(steps=st["parity_steps"], seq_len=st["parity_seq_len"],
                                 micro_batch_size=st["parity_mbs"], grad_acc=st["parity_grad_acc"], warmup_steps=2,
                                 lr=3e-3, out=str(Path(out) / name)), **kw})
    train(cfg, mesh)
    recs = _records(cfg, mesh)
    return ([r["loss"] for r in recs], [r["grad_norm"] for r in recs]) if recs else (None, None)


def parity_runs(W):
    """(label, degrees, reference) of the parity runs on W processes: 2: ep = 2 (dp = 2); more (4, or 8 with
    PICOTRON_NPROC=8): ep = W, dp = W x ep = 2, ep = 2 x tp = 2 (dp = W/2)."""
    if W == 2:
        return [("ep=2", dict(dp=2, ep=2), "dp=2")]
    return [(f"ep={W}", dict(dp=W, ep=W), f"dp={W}"), (f"dp={W} x ep=2", dict(dp=W, ep=2), f"dp={W}"),
            ("ep=2 x tp=2", dict(dp=W // 2, ep=2, tp=2), f"dp={W // 2}")]


def exp_parity(mesh, st, out):
    """2 processes: ep = 2 (dp = 2) and the trap; 4 (or 8) processes: ep = W, dp = W x ep = 2, ep = 2 x tp = 2
    (parity_runs). References (one process, grad_acc x dp: the same global batch) trained by rank 0 alone."""
    W, result = mesh.world_size, dict(losses={}, grad_norms={}, reference={}, ref_of={})
    runs = parity_runs(W)
    for label, kw, ref in runs:
        with Mesh.init(dp=kw["dp"], ep=kw["ep"], tp=kw.get("tp", 1)) as sub:
            losses, norms = _trained(sub, st, out, "parity_" + label.replace(" ", ""), **kw)
        result["losses"][label], result["grad_norms"][label], result["ref_of"][label] = losses, norms, ref
    if W == 2:
        with experts_divided_by_edp(), Mesh.init(dp=2, ep=2) as sub:
            losses, norms = _trained(sub, st, out, "parity_trap", dp=2, ep=2)
        label = "experts / edp"
        result["losses"][label], result["grad_norms"][label], result["ref_of"][label] = losses, norms, "dp=2"
    if mesh.rank == 0:
        local = Mesh.local(mesh.device)
        for ref in sorted(set(result["ref_of"].values())):
            dp = int(ref.split("=")[1])
            losses, norms = _trained(local, st, out, f"parity_reference_{ref}", grad_acc=dp * st["parity_grad_acc"])
            result["reference"][ref] = dict(losses=losses, grad_norms=norms)
    dist.barrier()
    return result


EXPERIMENTS = ("balance", "bytes", "scaling", "parity", "router", "overlap")


def configs_at(nproc, fast=False):
    """The Configs the main run (bytes, scaling, parity: the notebook's `run("bytes,scaling,parity", nproc=...)`)
    trains on `nproc` processes, at GPU size (GPU_SETTINGS on top: the 8-process mode is for a node of GPUs): bytes at
    dp = ep = nproc, scaling at every ep dividing nproc, the parity runs (parity_runs)."""
    st = at_world(settings(fast, "cuda"), nproc)
    out = [make_cfg(st, dp=nproc, ep=nproc, steps=st["bytes_steps"], warmup_steps=1)]
    out += [make_cfg(st, dp=nproc, ep=e) for e in (1, 2, 4, 8) if e <= nproc and nproc % e == 0]
    for _, kw, _ in parity_runs(nproc):
        out.append(make_cfg(st, **{**dict(steps=st["parity_steps"], seq_len=st["parity_seq_len"],
                                          micro_batch_size=st["parity_mbs"], grad_acc=st["parity_grad_acc"],
                                          warmup_steps=2, lr=3e-3), **kw}))
    return out


# ----------------------------------------------------------------------------- plots (for the notebook)
def bias_replay(tokens_per_expert, gamma):
    """DeepSeek-V3's bias update replayed from the recorded loads ([steps][layers][E], each step's whole batch), in
    fp32 as the model does it: b += γ·sign(mean − load) after every step. [layers][E], the bias after the last."""
    bias = torch.zeros(torch.tensor(tokens_per_expert[0]).shape)
    for loads in tokens_per_expert:
        load = torch.tensor(loads, dtype=torch.float32)
        bias += gamma * torch.sign(load.mean(-1, keepdim=True) - load)
    return bias


def exp_router(mesh, st, out):
    """DeepSeek-V3's router (tiny-deepseek-moe: sigmoid scores, 8 fine-grained experts, top-3, 1 shared) at dp = ep =
    W, three ways over the same steps and batches: no balancing, the auxiliary loss (α), the bias update (γ); every
    step's loads and loss, and the bias run's final biases (every layer; rank 0's, the same on every rank)."""
    W, result = mesh.world_size, dict(runs={}, gamma=st["router_gamma"], alpha=st["router_aux"])
    ways = {"none": dict(aux_loss_coef=0.0, bias_update_speed=0.0),
            "aux": dict(aux_loss_coef=st["router_aux"], bias_update_speed=0.0),
            "bias": dict(aux_loss_coef=0.0, bias_update_speed=st["router_gamma"])}
    for name, kw in ways.items():
        cfg = make_cfg(st, preset=st["router_preset"], dp=W, ep=W, steps=st["router_steps"], warmup_steps=10,
                       out=str(Path(out) / f"router_{name}"), **kw)
        with Mesh.init(dp=W, ep=W) as sub:
            _, run = train(cfg, sub, return_model=True)
            recs = _records(cfg, sub)
            bias = [b.e_score_correction_bias.tolist() for b in run.raw.modules()
                    if isinstance(b, moe.MoE) and b.bias_update_speed]
        if mesh.rank == 0:
            result["runs"][name] = dict(loss=[r["loss"] for r in recs],
                                        tokens_per_expert=[r["moe"]["tokens_per_expert"] for r in recs], bias=bias)
            ratio = [statistics.mean(load_ratio(r["moe"]["tokens_per_expert"])) for r in recs]
            say(mesh, f"{name}: loss {recs[0]['loss']:.3f} -> {recs[-1]['loss']:.3f}; busiest/mean expert load "
                       f"(mean of layers) {ratio[0]:.2f} -> {statistics.mean(ratio[-10:]):.2f} (last 10 steps)")
    return result


def plot_routing(logits, k):
    """A few tokens' router: the probabilities (bars), the k chosen (dark) and their renormalised weights; right:
    the dispatch permutation, (token, choice) pairs in token order -> sorted by expert (stable)."""
    import matplotlib.pyplot as plt

    probs, top, experts, weights = route_by_hand(logits, k)
    n, E = probs.shape
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 3.6), gridspec_kw=dict(width_ratios=[1.2, 1]))
    w = 0.8 / E
    for e in range(E):
        chosen = (experts == e).any(-1)
        ax.bar([t + (e - E / 2 + 0.5) * w for t in range(n)], probs[:, e], w,
               color=[EXPERT_COLORS[e] if c else "white" for c in chosen], edgecolor=EXPERT_COLORS[e],
               label=f"expert {e}")
    for t in range(n):
        ax.text(t, probs[t].max() + 0.05, " ".join(f"{int(x)}:{y:.2f}" for x, y in zip(experts[t], weights[t])),
                ha="center", fontsize=7)
    ax.set_xticks(range(n), [f"token {t}" for t in range(n)], fontsize=FONT)
    ax.set(ylabel="router probability (softmax)", ylim=(0, 1.1),
           title=f"filled: the top-{k}; above: expert:weight after renormalising")
    ax.title.set_fontsize(9)
    legend_below(ax, ncol=E, dy=-0.12)
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    for i in range(len(flat)):
        ax2.text(0, -i, f"t{i // k}→e{int(flat[i])}", ha="center", va="center", fontsize=7,
                 bbox=dict(boxstyle="round", fc=EXPERT_COLORS[int(flat[i])], alpha=0.35))
    for j, i in enumerate(order.tolist()):
        ax2.text(1, -j, f"t{i // k}→e{int(flat[i])}", ha="center", va="center", fontsize=7,
                 bbox=dict(boxstyle="round", fc=EXPERT_COLORS[int(flat[i])], alpha=0.35))
        ax2.plot([0.12, 0.88], [-i, -j], color=EXPERT_COLORS[int(flat[i])], lw=0.8)
    ax2.set_xlim(-0.3, 1.3)
    ax2.set_ylim(-len(flat) + 0.3, 0.8)
    ax2.axis("off")
    ax2.set_title("pairs in token order (left) → order = argsort(expert, stable) (right)", fontsize=9)
    fig.tight_layout()
    return fig


def plot_balance(res):
    """Per run (rows) and layer (columns): each expert's share of the step's choices over training (a heat map),
    then the aux loss and the load ratio per step."""
    import matplotlib.pyplot as plt

    runs = res["runs"]
    layers = len(next(iter(runs.values()))["tokens_per_expert"][0])
    fig, axes = plt.subplots(len(runs), layers, figsize=(2.9 * layers, 2.3 * len(runs)), squeeze=False,
                             layout="constrained")
    for row, (coef, r) in enumerate(runs.items()):
        t = torch.tensor(r["tokens_per_expert"], dtype=torch.float64)  # [steps, layers, E]
        share = t / t.sum(-1, keepdim=True)
        E = share.shape[-1]
        for layer in range(layers):
            ax = axes[row, layer]
            im = ax.imshow(share[:, layer].T, aspect="auto", cmap="magma", vmin=0, vmax=min(1.0, 2.5 / E),
                           interpolation="nearest")
            ax.set_yticks(range(E), [f"e{e}" for e in range(E)], fontsize=6)
            ax.tick_params(axis="x", labelsize=6)
            if row == 0:  # the layer above its column, the run left of its row: no title inside the grid
                ax.set_title(f"layer {layer}", fontsize=9, pad=4)
            if layer == 0:
                ax.set_ylabel(f"α = {coef}", fontsize=9)
            if row == len(runs) - 1:
                ax.set_xlabel("step", fontsize=FONT)
    fig.colorbar(im, ax=axes, shrink=0.8, label=f"share of the step's choices (balanced: 1/E = {1 / E:.2f})")
    fig.suptitle("each expert's share of the choices per step; rows: the aux-loss coefficient α", fontsize=9)
    return fig


def plot_balance_curves(res, window):
    """The aux loss per step (k at perfect balance) and the mean over layers of max/mean load per step."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.2))
    for coef, r in res["runs"].items():
        steps = range(1, len(r["aux"]) + 1)
        ratio = [statistics.mean(load_ratio(x)) for x in r["tokens_per_expert"]]
        smooth = [statistics.mean(ratio[max(0, i - window + 1):i + 1]) for i in range(len(ratio))]
        ax1.plot(steps, r["aux"], lw=1, label=f"aux coef {coef}")
        line, = ax2.plot(steps, ratio, lw=0.6, alpha=0.4)
        ax2.plot(steps, smooth, lw=1.8, color=line.get_color(), label=f"aux coef {coef} ({window}-step mean)")
    k = 2
    ax1.axhline(k, color="k", ls=":", lw=1, label="perfect balance (= k)")
    ax1.set(xlabel="step", ylabel="aux = E·Σ f_e P_e (mean of the layers)", title="the auxiliary loss")
    ax2.axhline(1, color="k", ls=":", lw=1)
    ax2.set(xlabel="step", ylabel="busiest expert / mean (mean of layers)", title="load imbalance per step")
    for ax in (ax1, ax2):
        ax.title.set_fontsize(9)
        legend_below(ax, ncol=2, dy=-0.2)
    fig.tight_layout()
    return fig


def plot_capacity(res):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    cs = res["capacities"]
    for coef, r in res["runs"].items():
        ax.plot(cs, r["dropped"], "o-", label=f"trained with aux coef {coef}")
    ax.plot(cs, res["uniform"], "k--", lw=1, label="uniformly random routing (binomial)")
    ax.set(xlabel="capacity factor κ", ylabel="fraction of choices dropped",
           title="capacity ceil(κ·s·k/E) per expert and sequence: what it drops")
    ax.title.set_fontsize(9)
    legend_below(ax, ncol=1, dy=-0.2)
    fig.tight_layout()
    return fig


def plot_bytes(results):
    """Per ep and rank: the bytes sent to other ranks per step (measured, by kind, stacked) against the routing's
    prediction (black tick) and the balanced formula (dashed)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 3.3), squeeze=False)
    for ax, res in zip(axes[0], results):
        W, h = res["ep"], res["hidden"]
        last = res["steps"][-1]
        bottom = [0.0] * W
        for kind in KINDS:
            vals = [last["measured"][r][kind] * h * 4 / MiB for r in range(W)]
            ax.bar(range(W), vals, 0.6, bottom=bottom, color=KIND_COLORS[kind], label=kind)
            bottom = [a + b for a, b in zip(bottom, vals)]
        pred = [sum(last["predicted"][r].values()) * h * 4 / MiB for r in range(W)]
        ax.plot(range(W), pred, "_", color="k", ms=30, mew=2, label="predicted from the routing")
        ax.axhline(res["formula"] / MiB, color="#8172b2", ls="--", lw=1.2, label="balanced formula")
        ax.set_xticks(range(W), [f"rank {r}" for r in range(W)], fontsize=FONT)
        ax.set(ylabel="MiB sent to other ranks per step", title=f"ep = {W}: step {last['step']}, {res['layers']} "
                                                                 f"layers, {res['tokens']} tokens per rank")
        ax.title.set_fontsize(9)
        legend_below(ax, ncol=3, dy=-0.12)
    fig.tight_layout()
    return fig


def plot_timeline(res):
    """One training step at ep = W, one row per rank: attention and experts (forward, backward), the all-to-alls
    and the gradient all-reduces."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    every = res["events"]
    W = len(every)
    t0 = min(m["call"][0] for m in every)
    span = max(m["call"][1] for m in every) - t0
    colors = {"attention": "#8da0cb", "expert": "#a6d854", "a2a": "#e31a1c", "counts": "#fb9a99",
              "all-reduce": "#ff7f00", "other": "#999999"}
    fig, ax = plt.subplots(figsize=(13, 0.7 * W + 1.4))
    for r, mine in enumerate(every):
        for e in mine["events"]:
            name = e["name"]
            if name.startswith("all-to-all counts"):
                c, y, hgt = colors["counts"], r + 0.22, 0.3
            elif name.startswith("all-to-all"):
                c, y, hgt = colors["a2a"], r + 0.22, 0.3
            elif e.get("kind") == "comm":
                c, y, hgt = colors["all-reduce"], r + 0.22, 0.3
            elif name == "attention":
                c, y, hgt = colors["attention"], r - 0.12, 0.38
            elif name.startswith("expert"):
                c, y, hgt = colors["expert"], r - 0.12, 0.38
            else:
                c, y, hgt = colors["other"], r - 0.12, 0.38
            start = 1e3 * (e["start"] - t0)
            ax.barh(y, 1e3 * (e["end"] - e["start"]), left=start, height=hgt, color=c,
                    alpha=0.55 if e.get("phase") == "backward" else 1.0, lw=0)
    ax.set_yticks(range(W), [f"rank {r}" for r in range(W)], fontsize=FONT)
    ax.set_ylim(W - 0.4, -0.5)
    ax.set_xlim(0, 1e3 * span)
    ax.set_xlabel("ms since the step started", fontsize=FONT)
    ax.set_title(f"one training step at ep = {W}: compute (upper half of a row; pale = backward) and "
                 f"collectives (lower half)", fontsize=9, loc="left")
    handles = [Patch(color=colors["attention"], label="attention"), Patch(color=colors["expert"], label="an expert"),
               Patch(color=colors["counts"], label="all-to-all of the counts"),
               Patch(color=colors["a2a"], label="all-to-all of the rows (dispatch, combine, their backwards)"),
               Patch(color=colors["all-reduce"], label="gradient all-reduce (buckets)")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=5, fontsize=FONT,
              frameon=False)
    fig.tight_layout()
    return fig


def timeline_shares(res):
    """Per rank: seconds of the step, of all-to-alls (union of their intervals), of attention and of experts."""
    out = []
    for mine in res["events"]:
        ev = mine["events"]
        a2a = [(e["start"], e["end"]) for e in ev if e["name"].startswith("all-to-all")]
        out.append(dict(step=mine["call"][1] - mine["call"][0], a2a=_common.union_length(a2a),
                        n_a2a=len(a2a),
                        attention=sum(e["end"] - e["start"] for e in ev if e["name"] == "attention"),
                        experts=sum(e["end"] - e["start"] for e in ev if e["name"].startswith("expert"))))
    return out


def plot_scaling(results):
    """Left: model-state bytes per rank against ep (measured bars, the formula's dense and expert parts as
    ticks); right: tokens/s against ep."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.4))
    xs, labels, k = [], [], 0
    for res in results:
        for ep, r in sorted(res["rows"].items(), key=lambda x: int(x[0])):
            m = r["mem"][0]
            dense = r["parts"]["dense"] * 16 / MiB
            ax1.bar(k, dense, 0.6, color="#8da0cb", label="dense part (formula)" if k == 0 else None)
            ax1.bar(k, r["parts"]["experts"] * 16 / MiB, 0.6, bottom=dense, color="#a6d854",
                    label="experts held (formula)" if k == 0 else None)
            ax1.plot(k, sum(m.values()) / MiB, "k_", ms=22, mew=2, label="measured" if k == 0 else None)
            ax2.bar(k, r["tokens_per_s"], 0.6, color="#4c72b0")
            ax2.text(k, r["tokens_per_s"], f"{r['tokens_per_s']:.0f}", ha="center", va="bottom", fontsize=FONT)
            xs.append(k)
            labels.append(f"{res['world']} proc.\nep={ep}")
            k += 1
        k += 0.5
    for ax in (ax1, ax2):
        ax.set_xticks(xs, labels, fontsize=FONT)
    ax1.set(ylabel="MiB per rank (params + grads + AdamW)", title="model states per rank (fp32)")
    ax2.set(ylabel="tokens / s (median step)", title="throughput, same global batch (2 CPU cores)")
    ax1.title.set_fontsize(9)
    ax2.title.set_fontsize(9)
    legend_below(ax1, ncol=3, dy=-0.22)
    fig.tight_layout()
    return fig


def plot_parity(pairs):
    # diff_ylim: the trap (expert gradients divided by edp, not dp x cp) leaves the parity range
    return plot_parity_below(pairs, "each ep run", diff_ylim=(1e-10, 1e-1))


def plot_widget(preset="mixtral-8x7b", E=8, k=2, ep=8, c=1.25, tokens=4096):
    """Per GPU: model states (dense part, experts held; bf16 weights and gradients, fp32 AdamW) for ep = 1..E
    (the chosen ep highlighted), the all-to-all bytes per step, and the dropped fraction against c."""
    import matplotlib.pyplot as plt

    eps = [e for e in range(1, E + 1) if E % e == 0]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13, 3.4))
    GBy = 1e9
    for e in eps:
        n = widget_numbers(preset, E, k, e, c, tokens)
        alpha = 1.0 if e == ep else 0.35
        ax1.bar(str(e), n["dense_bytes"] / GBy, color="#8da0cb", alpha=alpha, label="dense" if e == 1 else None)
        ax1.bar(str(e), n["expert_bytes"] / GBy, bottom=n["dense_bytes"] / GBy, color="#a6d854", alpha=alpha,
                label="experts held" if e == 1 else None)
        ax2.bar(str(e), n["a2a_bytes"] / GBy, color="#e31a1c", alpha=alpha)
    ax1.set(xlabel="ep", ylabel="GB per GPU", title=f"model states: bf16 weights + grads, fp32 AdamW ({preset}, E={E})")
    ax1.legend(fontsize=FONT, frameon=False)
    ax2.set(xlabel="ep", ylabel="GB sent per GPU per step", title=f"all-to-all, {tokens} tokens per GPU, k={k}, bf16")
    cs = [x / 20 for x in range(5, 61)]
    ax3.plot(cs, [expected_dropped(E, min(k, E), x, tokens) for x in cs], "k-", lw=1.2)
    ax3.plot([c], [expected_dropped(E, min(k, E), c, tokens)], "o", color="#c44e52")
    ax3.set(xlabel="capacity factor κ", ylabel="fraction dropped", yscale="log", ylim=(1e-6, 1),
            title=f"dropped if routing were uniformly random, s={tokens}")
    for ax in (ax1, ax2, ax3):
        ax.title.set_fontsize(8)
    fig.tight_layout()
    return fig


def plot_router(res, window=10):
    """Busiest/mean expert load per step (mean over layers) and the loss, for the three ways of balancing."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.2))
    labels = {"none": "no balancing", "aux": f"aux loss (α = {res['alpha']:g})",
              "bias": f"bias update (γ = {res['gamma']:g})"}
    for name, r in res["runs"].items():
        steps = range(1, len(r["loss"]) + 1)
        ratio = [statistics.mean(load_ratio(x)) for x in r["tokens_per_expert"]]
        smooth = [statistics.mean(ratio[max(0, i - window + 1):i + 1]) for i in range(len(ratio))]
        line, = ax1.plot(steps, ratio, lw=0.6, alpha=0.35)
        ax1.plot(steps, smooth, lw=1.8, color=line.get_color(), label=f"{labels[name]} ({window}-step mean)")
        ax2.plot(steps, r["loss"], lw=1, color=line.get_color(), label=labels[name])
    ax1.axhline(1, color="k", ls=":", lw=1)
    ax1.set(xlabel="step", ylabel="busiest expert / mean (mean of layers)", title="load imbalance per step")
    ax2.set(xlabel="step", ylabel="training loss", title="the language-model loss")
    for ax in (ax1, ax2):
        ax.title.set_fontsize(9)
        legend_below(ax, ncol=1, dy=-0.2)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------------ main
# ---------------------------------------------------------------- the all-to-alls under compute (--ep-overlap)
class WaitTimed:
    """The collectives an Axis calls (torch.distributed's signatures), with every all-to-all's WAIT on `timeline`: a
    blocking one from its call to its return, an asynchronous one from `wait()` to its return. That is the exposed
    communication: time this rank's compute stood still ("wait rows"; the int64 counts: "wait counts"). Each wait
    also keeps when the emulated link finished its message (`link_end`): the wait beyond it was for the peer."""

    def __init__(self, real, timeline):
        self.real, self.timeline = real, timeline

    def all_to_all_single(self, out, t, *args, async_op=False, **kw):
        name = "wait counts" if t.dtype == torch.int64 else "wait rows"
        start = self.timeline.now()
        timed = _TimedWait(self.real.all_to_all_single(out, t, *args, async_op=True, **kw), self.timeline, name)
        if not async_op:  # blocking: the caller waits from the call on
            timed.wait(start)
            return None
        return timed

    def __getattr__(self, name):
        return getattr(self.real, name)


class _TimedWait:
    def __init__(self, work, timeline, name):
        self.work, self.timeline, self.name = work, timeline, name

    def wait(self, start=None):
        start = self.timeline.now() if start is None else start
        self.work.wait()
        end = getattr(self.work, "end", None)  # the emulated link's end (picotron.link._LinkWork), host seconds
        self.timeline.add(self.name, start, self.timeline.now(), kind="wait",
                          link_end=None if end is None else end - self.timeline.t0)
        return True

    def __getattr__(self, name):
        return getattr(self.work, name)


def timed_experts(model, timeline):
    """Hooks that put every routed expert and shared expert, forward and backward, on `timeline` (compute)."""
    for i, layer in enumerate(model.layers):
        block = layer.block_sparse_moe
        named = [("expert", m) for m in block.experts.values()]
        named += [("shared expert", block.shared_experts)] if block.shared_experts is not None else []
        for name, m in named:
            starts = {}
            m.register_forward_pre_hook(lambda mod, a, s=starts: s.__setitem__("f", timeline.now()))
            m.register_forward_hook(lambda mod, a, o, s=starts, n=name, i=i: timeline.add(
                n, s["f"], timeline.now(), kind="compute", layer=i, phase="forward"))
            m.register_full_backward_pre_hook(lambda mod, g, s=starts: s.__setitem__("b", timeline.now()))
            m.register_full_backward_hook(lambda mod, gi, go, s=starts, n=name, i=i: timeline.add(
                n, s["b"], timeline.now(), kind="compute", layer=i, phase="backward"))


class OverlapVariant:
    """One way of exchanging (blocking, or --ep-overlap's two parts) on its own copy of the model, built as picotron
    builds it (`parallelize`) but with the ep axis's all-to-alls on its own emulated link (picotron.link: the bytes a
    rank sends to the others take latency + bytes / bandwidth, the waiting costs no core) and their waits timed."""

    def __init__(self, name, overlap, cfg, mesh, link):
        self.name, self.link = name, EmulatedLink(*link) if link else None
        self.timeline = metrics.Timeline(mesh.device, mesh.rank, enabled=False)  # on for the timed steps only
        self.recorder = metrics.Recorder(self.timeline)
        ep = mesh.ep
        ops = self.link.ops(ep.comm.ops) if self.link else ep.comm.ops
        view = copy.copy(mesh)  # the same groups; only the ep axis changes (never destroy the copy)
        view.ep = Axis(ep.name, ep.ranks, ep.group, ep.rank, ep.dims, Comm(WaitTimed(ops, self.timeline), self.recorder))
        torch.manual_seed(cfg.seed)
        self.run = par.parallelize(dataclasses.replace(cfg, ep_overlap=overlap), view)
        self.run.schedule.phases.listen(self.timeline.record)  # forward, backward and the gradients' wait
        timed_experts(self.run.raw, self.timeline)
        self.loader = load_data(cfg, mesh)[1]
        self.cfg, self.mesh, self.steps = cfg, mesh, []

    def step(self, step, record=True):
        run, tl = self.run, self.timeline
        tl.enabled = record
        tl.events.clear()
        if self.link:
            self.link.log.clear()
        t0 = tl.now()
        run.schedule.run(run.model, self.loader.micro_batches(step), run.loss_fn)
        run.optimizer.step()
        run.model.zero_grad(set_to_none=True)
        moe.step_stats(run.raw)  # reset the routing counts
        t1 = tl.now()
        if record:
            base = tl.t0
            link_log = [(kind, nbytes, s - base, e - base) for kind, nbytes, s, e in (self.link.log if self.link else [])]
            self.steps.append(dict(start=tl.seconds(t0), end=tl.seconds(t1), events=[dict(e) for e in tl.events],
                                   link=link_log))
        tl.enabled = False


def overlap_terms(step, layers=None):
    """From one recorded step of the overlapped variant: per pass of an MoE layer (forward or backward, in the order
    they ran) the measured (a, c, s) of planner.ep_overlap_exposed_seconds. a: one part's all-to-all on the link (the
    mean link time of the pass's four row messages). c and s: the time the rank spent working in the schedule's
    slots, read off the launches and the waits (a pass launches part 1 and 2, waits for 1, works on 1 and launches
    its next all-to-all, waits for 2, works on 2 and launches its next, waits for both): s from launching part 1 to
    waiting for it (the shared expert), c the mean of the two parts' time from their arrival to the next wait (their
    experts and the launch after them), t (tail) what part 2 did after launching its combine (the launch's own
    cost; in the backward, accumulating the weights' gradients). The slots hold all the work done there (the
    regrouping, the launches, the weight gradients), which module hooks on the experts would miss. Returns
    (a, c, s, t) per pass. `layers`: unused (the passes are counted from the events)."""
    launches = sorted((e for e in step["events"] if e["name"].startswith("all-to-all") and " part " in e["name"]),
                      key=lambda e: e["start"])
    waits = sorted((e for e in step["events"] if e["name"] == "wait rows"), key=lambda e: e["start"])
    links = [e - s for kind, nbytes, s, e in step["link"] if kind == "all_to_all_single" and nbytes > 1024]
    out = []
    for k in range(min(len(launches), len(waits)) // 4):
        L, W = launches[4 * k:4 * k + 4], waits[4 * k:4 * k + 4]
        a = statistics.mean(links[4 * k:4 * k + 4]) if len(links) >= 4 * k + 4 else 0.0
        s = max(0.0, W[0]["start"] - L[0]["start"])
        c = (max(0.0, W[1]["start"] - W[0]["end"]) + max(0.0, W[2]["start"] - W[1]["end"])) / 2
        t = max(0.0, W[2]["start"] - L[3]["start"])
        out.append((a, c, s, t))
    return out


def exposed(step, link_only=False):
    """Seconds this rank waited for the row all-to-alls during the step (the exposed communication); link_only: only
    until the emulated link had carried each message (what the planner's formula models; the rest of a wait is for
    the peer: a rank that got there first waits for the other's launch, a cost of imbalance, not of the link)."""
    waits = [e for e in step["events"] if e["name"] == "wait rows"]
    if link_only:
        return sum(max(0.0, min(e["end"], e["link_end"]) - e["start"]) for e in waits if e.get("link_end") is not None)
    return sum(e["end"] - e["start"] for e in waits)


def choose_ep_link(cfg, mesh, st):
    """(bandwidth, latency) of an emulated link on which one part's all-to-all takes about as long as one part's
    experts compute in the forward (measured here, blocking, without a link): where overlapping has the most to hide.
    Every rank gets the same link (the slowest rank's compute, the mean bytes)."""
    probe = OverlapVariant("probe", False, cfg, mesh, None)
    for s in range(2):
        probe.step(s + 1, record=s == 1)
    step = probe.steps[-1]
    layers = cfg.model_config().num_hidden_layers
    forward = [e["end"] - e["start"] for e in step["events"] if e["name"] == "expert" and e.get("phase") == "forward"]
    c = sum(forward) / layers / 2  # one part's experts, per layer
    tokens = cfg.micro_batch_size * cfg.seq_len * cfg.grad_acc
    mc = cfg.model_config()
    W = mesh.ep.size
    part_bytes = tokens * mc.num_experts_per_tok / 2 * (W - 1) / W * mc.hidden_size * 4 / cfg.grad_acc
    c = max(gather(c, mesh))
    latency = st["overlap_latency"]
    bandwidth = part_bytes / max(c * st["overlap_link_ratio"] - latency, 1e-4)
    return bandwidth, latency


def exp_overlap(mesh, st, out):
    """Blocking against --ep-overlap on the same run (tiny-deepseek-moe at dp = ep = W, one step of each in turn,
    each on its own emulated link sized so that one part's all-to-all takes about as long as one part's experts):
    per step and rank the step time, the exposed communication (the waits for the row all-to-alls), and the
    planner's prediction from the measured link times and compute; one step of each on a timeline."""
    W = mesh.world_size
    cfg = make_cfg(st, preset=st["overlap_preset"], dp=W, ep=W, steps=st["overlap_steps"], warmup_steps=1,
                   seq_len=st["overlap_seq_len"], micro_batch_size=st["overlap_mbs"], aux_loss_coef=0.01,
                   out=str(Path(out) / f"overlap_ep{W}"))
    mc = cfg.model_config()
    with Mesh.init(dp=W, ep=W, device=mesh.device.type) as sub:
        link = choose_ep_link(cfg, sub, st)
        variants = [OverlapVariant("blocking", False, cfg, sub, link), OverlapVariant("overlapped", True, cfg, sub, link)]
        others = run_interleaved(variants, st["overlap_steps"], st["overlap_warmup"], sub.world.group)
        mine = {v.name: v.steps for v in variants}
        every = gather(mine, mesh)
    layers = mc.num_hidden_layers
    result = dict(ep=W, link=dict(bandwidth=link[0], latency=link[1], label=EmulatedLink(*link).label()),
                  others_share=others, layers=layers, micro_batches=cfg.grad_acc, ranks=[])
    for r, runs in enumerate(every):
        row = {}
        for name, steps in runs.items():
            times = [s["end"] - s["start"] for s in steps]
            waits = [exposed(s) for s in steps]
            row[name] = dict(step=statistics.median(times), exposed=statistics.median(waits), times=times, waits=waits,
                             link_exposed=statistics.median(exposed(s, link_only=True) for s in steps))
        predicted = [sum(planner.ep_overlap_exposed_seconds(*t) for t in overlap_terms(s, layers))
                     for s in runs["overlapped"]]
        blocking_link = [sum(e - s0 for kind, nbytes, s0, e in s["link"] if kind == "all_to_all_single" and nbytes > 1024)
                         for s in runs["blocking"]]
        row["overlapped"]["predicted"] = statistics.median(predicted)
        row["blocking"]["predicted"] = statistics.median(blocking_link)
        row["terms"] = overlap_terms(runs["overlapped"][-1], layers)
        result["ranks"].append(row)
    result["timeline"] = {name: [dict(events=runs[name][-1]["events"], start=runs[name][-1]["start"],
                                      end=runs[name][-1]["end"], link=runs[name][-1]["link"]) for runs in every]
                          for name in ("blocking", "overlapped")}
    for r, row in enumerate(result["ranks"]):
        say(mesh, f"rank {r}: step {1e3 * row['blocking']['step']:.1f} ms blocking, {1e3 * row['overlapped']['step']:.1f} "
                  f"ms overlapped; waited for the rows {1e3 * row['blocking']['exposed']:.1f} -> "
                  f"{1e3 * row['overlapped']['exposed']:.1f} ms, for the link {1e3 * row['blocking']['link_exposed']:.1f}"
                  f" -> {1e3 * row['overlapped']['link_exposed']:.1f} ms (planner: {1e3 * row['blocking']['predicted']:.1f}"
                  f" -> {1e3 * row['overlapped']['predicted']:.1f} ms)")
    return result


def overlap_checks(res):
    """The section's checks, as (name, ok, detail, busy) for _common.check: each rank's exposed all-to-all time
    overlapped against blocking; the planner's formula from the measured a, c, s against the measured exposure, both
    exchanges (the mean over ranks: a rank's waits also hold its peer's lateness)."""
    busy = _common.busy_reason(res["others_share"])
    ranks = res["ranks"]
    ratio = [r["overlapped"]["link_exposed"] / r["blocking"]["link_exposed"] for r in ranks]
    out = [("--ep-overlap hides the all-to-alls: the time waited for the link at most 3/4 of blocking's on every rank",
            max(ratio) <= 0.75, "overlapped / blocking per rank " + ", ".join(f"{x:.2f}" for x in ratio), busy)]
    for name in ("blocking", "overlapped"):
        measured = statistics.mean(r[name]["link_exposed"] for r in ranks)
        predicted = statistics.mean(r[name]["predicted"] for r in ranks)
        off = abs(measured - predicted)
        out.append((f"{name}: measured time waited for the link = the planner's "
                    + ("link time of its all-to-alls" if name == "blocking" else "ep_overlap_exposed_seconds(a, c, s, t)"),
                    off <= max(0.35 * predicted, 3e-3),
                    f"{1e3 * measured:.1f} ms measured, {1e3 * predicted:.1f} ms predicted per step (mean of the ranks; "
                    f"within 35% or 3 ms)", busy))
    return out


def plot_overlap(res):
    """Rank 0's last step, blocking above and --ep-overlap below on one time axis (each from its own start): the
    experts and the shared expert (forward; pale: backward), the all-to-alls on the emulated link, and the waits for
    them (what is exposed); right: each rank's waits per step (pale: all of it; dark: until the link was done) against
    the planner's exposed time (black)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = {"expert": "#a6d854", "shared expert": "#66a61e", "link": "#fdae61", "wait rows": "#e31a1c",
              "wait counts": "#fb9a99", "phase": "#eeeeee"}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw=dict(width_ratios=[3, 1]))
    names = ("blocking", "overlapped")
    span = 0.0
    for row, name in enumerate(names):
        step = res["timeline"][name][0]
        t0 = step["start"]
        span = max(span, step["end"] - t0)
        for e in step["events"]:
            x, w = 1e3 * (e["start"] - t0), 1e3 * (e["end"] - e["start"])
            if e["name"] in ("forward", "backward"):
                ax.barh(row, w, left=x, height=0.9, color=colors["phase"], lw=0, zorder=0)
                ax.text(x + 1, row - 0.3, e["name"], fontsize=7, color="#777777", va="center")
            elif e["name"] in ("expert", "shared expert"):
                ax.barh(row - 0.05, w, left=x, height=0.3, color=colors[e["name"]], lw=0, zorder=2,
                        alpha=0.55 if e.get("phase") == "backward" else 1.0)
            elif e["name"] in ("wait rows", "wait counts"):
                ax.barh(row + 0.22, w, left=x, height=0.14, color=colors[e["name"]], lw=0, zorder=2)
        for kind, nbytes, s, e in step["link"]:
            ax.barh(row + 0.36, 1e3 * (e - s), left=1e3 * (s - t0), height=0.1, color=colors["link"], lw=0.3,
                    edgecolor="white", zorder=2)
    ax.set_yticks(range(2), names, fontsize=FONT)
    ax.set_ylim(1.6, -0.6)
    ax.set_xlim(0, 1e3 * span)
    ax.set_xlabel("ms since the step started (rank 0)", fontsize=FONT)
    ax.set_title(f"one training step at ep = {res['ep']}, each exchange on its own {res['link']['label']}",
                 fontsize=9, loc="left")
    handles = [Patch(color=colors["expert"], label="routed experts"), Patch(color=colors["shared expert"],
               label="shared expert"), Patch(color=colors["link"], label="all-to-all on the link"),
               Patch(color=colors["wait rows"], label="waiting for rows (exposed)"),
               Patch(color=colors["wait counts"], label="waiting for counts")]
    legend_below(ax, handles=handles, ncol=5)
    W = len(res["ranks"])
    xs = range(W)
    for i, name in enumerate(names):
        bx.bar([x + 0.4 * i - 0.2 for x in xs], [1e3 * r[name]["exposed"] for r in res["ranks"]], width=0.35,
               color=["#e31a1c", "#4c72b0"][i], alpha=0.35, label=f"{name}: waited (for the peer too)")
        bx.bar([x + 0.4 * i - 0.2 for x in xs], [1e3 * r[name]["link_exposed"] for r in res["ranks"]], width=0.35,
               color=["#e31a1c", "#4c72b0"][i], label=f"{name}: waited for the link")
        bx.scatter([x + 0.4 * i - 0.2 for x in xs], [1e3 * r[name]["predicted"] for r in res["ranks"]], color="black",
                   marker="_", s=300, zorder=3, label="planner" if i else None)
    bx.set_xticks(list(xs), [f"rank {r}" for r in xs], fontsize=FONT)
    bx.set_ylabel("ms per step waited for the rows", fontsize=FONT)
    legend_below(bx, ncol=1, dy=-0.16)
    fig.tight_layout()
    return fig


def main(argv=None):
    args, names, out = _common.cli("08_expert_parallel", EXPERIMENTS, __doc__, argv=argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        sys.exit("run it on 2 or 4 processes: torchrun --nproc_per_node 2 lessons/08_expert_parallel/experiment.py")
    mesh = Mesh.init(dp=world, device=_common.experiment_device("08_expert_parallel"))
    with mesh:  # on success every rank meets at a barrier before the groups go (Mesh.destroy)
        st = at_world(settings(args.fast, mesh.device.type), world)
        _common.run_experiments(names, lambda name: globals()[f"exp_{name}"](mesh, st, out),
                                lambda name: out / f"{name}_ep{world}.json", _common.environment(mesh, settings=st),
                                mesh.rank)


if __name__ == "__main__":
    main()
