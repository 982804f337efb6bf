"""Lesson 06's experiments: context parallelism measured through picotron's own seam (`parallelize`, as
picotron.train runs it, and the attention core `context_parallel.ContextParallelAttention`), and the notebook's
formulas and plots.

    torchrun --nproc_per_node 2 lessons/06_context_parallel/experiment.py [--only balance,train,parity]
    torchrun --nproc_per_node 4 lessons/06_context_parallel/experiment.py --only memory,balance,train,parity
    torchrun --nproc_per_node 4 lessons/06_context_parallel/experiment.py --only ulysses    # cp = 2 (x dp 2) and 4
    torchrun --nproc_per_node 8 lessons/06_context_parallel/experiment.py --only balance,train,parity,ulysses  # cp = 8
    PICOTRON_FAST=1 ...    # short settings (the notebook's FAST mode)

Rank 0 writes OUT/<name>_cp<c>.json (c = the world size). memory: the bytes autograd keeps in one forward of one
rank's tokens (metrics.ActivationCounter) for cp = 1, 2, 4 (every divisor of the world size; the others are data
parallel), ring and all-gather, against `activation_parts`, and the longest sequence under a budget. balance: the
ring attention core alone, forward and backward, zig-zag and contiguous, each ring step's compute timed on every
rank (its CPU time too, which oversubscribed ranks do not inflate), the waits, one block's transfer alone, and the
share of the machine's cores other programs used during each call (_common.LoadWindow).
train: training steps of the model at cp = world size, ring (zig-zag and contiguous) and all-gather interleaved
(tokens/s), the bytes every attention core sent against `bytes_per_step_formula`. parity: picotron.train at cp =
world size (and cp = 2 x dp = 2 on 4 processes) against one process, and the trap: cp = 2, dp = 1 with the
gradients NOT averaged over cp. ulysses: training steps at every cp in (2, 4, 8) dividing the world size (the rest
data parallel) and s = cp x a fixed number of tokens per rank, the ring and Ulysses (both zig-zag) in turn: step
times, the bytes of every all-to-all and ring message against the formulas, the activation bytes one forward keeps.
"""
import os
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/
import _common  # noqa: E402  (puts the repository root on sys.path)
from _common import gather, make_cfg, run_interleaved, say  # noqa: E402
from _plots import FONT, legend_below, plot_parity_below  # noqa: E402  (figure helpers several lessons share)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from picotron import context_parallel as cpm, data_parallel, hooks, marks, metrics, parallelize as par  # noqa: E402
from picotron import planner  # noqa: E402
from picotron.mesh import Mesh  # noqa: E402
from picotron.model import ModelConfig, rope_cos_sin  # noqa: E402
from picotron.train import load_data, train  # noqa: E402

MiB = 2**20
LAYOUT_COLORS = {"zigzag": "#4c72b0", "contiguous": "#dd8452"}
RANK_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860", "#da8bc3", "#8c8c8c"]
VARIANTS = (("ring", "zigzag"), ("ring", "contiguous"), ("allgather", "zigzag"))


def settings(fast, device_type=None):
    """The experiments' model (the lessons' 'small' one: h = 256, 8 heads over 4 KV heads of d = 32, 4 layers) and
    sequence lengths. Attention grows with s, the rest of a layer does not: the balance and throughput runs use
    sequences long enough for attention to be most of the work (on GPUs longer: _common.GPU_SETTINGS)."""
    st = dict(size="small", b=1,
              mem_seqs=(128, 256, 512) if fast else (256, 512, 1024, 2048), budget_mib=16 if fast else 64,
              balance_seq=2048, balance_repeats=9 if fast else 11,
              train_seq=256 if fast else 1024, train_b=2, train_steps=2 if fast else 6, train_warmup=1,
              parity_steps=10 if fast else 20, parity_seq_len=64, parity_layers=4, parity_grad_acc=2,
              ulysses_tokens=64 if fast else 512, ulysses_steps=2 if fast else 6)
    return _common.sized("06_context_parallel", st, fast, device_type)


def model_config(st, **kw):
    return ModelConfig.from_preset("tiny", **{**_common.SIZES[st["size"]], **kw})


# ------------------------------------------------------------------------------------- the formulas
def activation_parts(mc, s, b, cp=1, impl="ring"):
    """Bytes one rank's forward keeps for backward (fp32, no recomputation), by part, with t = s/cp tokens per rank:
    the project's count (picotron/planner.py, lesson 01) with s -> t, plus what context parallelism changes.

    per layer   norms 2(8tbh + 4tb); attention: q/k/v projections' input 4tbh, the core's q and out 4tbh each,
                k and v 4tb·kd each (kd = k·d: the KV heads), one fp32 log-sum-exp per query and head 4atb;
                ring: o_proj's input is a copy (the ring's output is [b, a, t, d]; o_proj reads [b, t, h]) 4tbh;
                all-gather: k and v are the WHOLE sequence's (4sb·kd each) and sdpa keeps its mask as fp32 [t, s];
                mlp 4tbh + 16tbi
    model       ids and targets (cp = 1: two views of one (s+1)-token window, 8b(s+1); cp > 1: each rank's tokens
                are picked out, two new tensors, 16tb), RoPE's cos and sin at this rank's positions 8t·d, final
                norm 8tbh + 4tb, lm_head input 4tbh, log-softmax 4tbv, the loss's 4-byte normaliser"""
    t = s // cp
    h, i, a, d, v = mc.hidden_size, mc.intermediate_size, mc.num_attention_heads, mc.head_dim, mc.vocab_size
    kd = mc.num_key_value_heads * d
    kv_len = s if impl == "allgather" and cp > 1 else t
    attention = 4 * t * b * h + 8 * t * b * h + 8 * kv_len * b * kd + 4 * a * t * b
    if cp > 1 and impl == "ring":
        attention += 4 * t * b * h
    if cp > 1 and impl == "allgather":
        attention += 4 * t * s
    layer = {"norms": 2 * (8 * t * b * h + 4 * t * b), "attention": attention, "mlp": 4 * t * b * h + 16 * t * b * i}
    model = {"ids and targets": 8 * b * (s + 1) if cp == 1 else 16 * t * b, "rope": 8 * t * d,
             "final norm": 8 * t * b * h + 4 * t * b, "lm_head": 4 * t * b * h, "loss": 4 * t * b * v + 4}
    return dict(layer=layer, model=model)


def activation_bytes(mc, s, b, cp=1, impl="ring"):
    parts = activation_parts(mc, s, b, cp, impl)
    return mc.num_hidden_layers * sum(parts["layer"].values()) + sum(parts["model"].values())


def longest_fitting(mc, b, cp, budget, impl="ring", limit=1 << 22):
    """The longest s (a multiple of 2·cp) whose activations per rank fit `budget` bytes, by the formula."""
    step, s = 2 * cp, 0
    while s + step <= limit and activation_bytes(mc, s + step, b, cp, impl) <= budget:
        s += step
    return s


def pairs(rank, cp, layout, causal_weight=1.0):
    """The work of `rank` over a whole ring, in (query chunk, key chunk) pairs: a visible pair counts 1, a causal
    (diagonal) one `causal_weight` (1: ours computes the whole block and masks it; 1/2: a kernel that skips the
    masked half), a future one 0 (skipped)."""
    mine = cpm.chunks_of(rank, cp, layout)
    total = 0.0
    for src in range(cp):
        for qc in mine:
            for kc in cpm.chunks_of(src, cp, layout):
                seen = cpm.visibility(qc, kc)
                total += 1.0 if seen == "all" else causal_weight if seen == "causal" else 0.0
    return total


def predicted_times(cp, layout, t_all, t_causal):
    """Each rank's attention time over the ring if a whole block costs t_all and a causal one t_causal."""
    out = []
    for r in range(cp):
        whole = pairs(r, cp, layout, causal_weight=0.0)
        out.append(whole * t_all + (pairs(r, cp, layout) - whole) * t_causal)
    return out


def predicted_ratio(cp, layout, causal_weight=1.0):
    """max / min over ranks of `pairs`: the slowest rank's attention work over the fastest's."""
    work = [pairs(r, cp, layout, causal_weight) for r in range(cp)]
    return max(work) / min(work)


def step_blocks(rank, step, cp, layout="zigzag"):
    """The (query chunk, key chunk, 'all' | 'causal') blocks `rank` computes at ring step `step`: it holds the K/V
    of rank (rank - step) mod cp (each step every rank receives from rank - 1); future blocks are skipped."""
    src = (rank - step) % cp
    out = []
    for qc in cpm.chunks_of(rank, cp, layout):
        for kc in cpm.chunks_of(src, cp, layout):
            seen = cpm.visibility(qc, kc)
            if seen != "none":
                out.append((qc, kc, seen))
    return out


def ring_by_hand(q, k, v, cp, layout="zigzag"):
    """Ring attention simulated in one process, with the library's block_forward and merge: every rank's output
    (unsplit into sequence order) and, per rank and step, the blocks computed. What the ring does, minus the
    messages: at step j rank r works with the K/V of rank (r - j) mod cp."""
    scale = 1.0 / q.shape[-1] ** 0.5
    qs = [cpm.split(q, cp, r, layout, dim=2) for r in range(cp)]
    kvs = [(cpm.split(k, cp, r, layout, dim=2), cpm.split(v, cp, r, layout, dim=2)) for r in range(cp)]
    outs, log = [], {}
    for r in range(cp):
        mine = cpm.chunks_of(r, cp, layout)
        o, lse = [None, None], [None, None]
        for step in range(cp):
            src = (r - step) % cp
            kc, vc = (t.chunk(2, dim=2) for t in kvs[src])
            theirs = cpm.chunks_of(src, cp, layout)
            for i, qi in enumerate(qs[r].chunk(2, dim=2)):
                for j in range(2):
                    seen = cpm.visibility(mine[i], theirs[j])
                    log.setdefault((r, step), []).append((mine[i], theirs[j], seen))
                    if seen != "none":
                        ob, lb = cpm.block_forward(qi, kc[j], vc[j], seen == "causal", scale)
                        o[i], lse[i] = cpm.merge(o[i], lse[i], ob, lb)
        outs.append(torch.cat(o, dim=2))
    return cpm.unsplit(outs, layout, dim=2), log


def naive_merge(out, lse, out_b, lse_b):
    """The merge written with e^lse itself: right in exact arithmetic, inf / inf = nan in fp32 once a score passes
    about 88 (e^88.7 is fp32's largest)."""
    w, w_b = torch.exp(lse).unsqueeze(-1), torch.exp(lse_b).unsqueeze(-1)
    return (out * w + out_b * w_b) / (w + w_b), torch.log(torch.exp(lse) + torch.exp(lse_b))


# ------------------------------------------------------------------------------------------- measuring
class CpuTimeline(metrics.Timeline):
    """A Timeline whose events also carry the CPU time this thread spent inside them (`cpu`): with more ranks than
    cores a rank waits for a core inside its events, which inflates their wall time but not their CPU time."""

    @contextmanager
    def record(self, name, **info):
        c0 = time.thread_time()
        with super().record(name, **info) as event:
            yield event
        event["cpu"] = time.thread_time() - c0


class SentBytes(metrics.Recorder):
    """A metrics.Recorder that also adds up what this rank sent along the cp axis by what it carried: `sent["kv"]`
    (K/V blocks) and `sent["dkv"]` (their gradients). The ring's messages carry the attention core's label ("kv",
    "dkv"); of the all-gather of K/V and its backward's reduce-scatter of dK/dV over a buffer of B bytes, (cp-1)/cp·B
    leave this rank (the rest is its own piece). Ulysses' all-to-alls: `buffers["a2a forward"]` (the whole buffers
    of the forward's, nccl-tests' N) and `sent["a2a forward"]`, `sent["a2a backward"]` ((cp-1)/cp of them)."""

    def __init__(self, cp, timeline=None):
        super().__init__(timeline)
        self.cp, self.sent, self.buffers = cp, {"kv": 0, "dkv": 0}, {}

    def collective(self, kind, nbytes, work, label, start, axis=None, **info):
        if axis == "cp" and kind == "all_to_all":  # Ulysses: q, k, v, out forward; their gradients backward
            key = "a2a backward" if label.endswith("-backward") else "a2a forward"
            self.buffers[key] = self.buffers.get(key, 0) + nbytes
            self.sent[key] = self.sent.get(key, 0) + nbytes // self.cp * (self.cp - 1)
        elif axis == "cp":
            self.sent[{"all_gather": "kv", "reduce_scatter": "dkv"}[kind]] += nbytes // self.cp * (self.cp - 1)
        return super().collective(kind, nbytes, work, label, start, axis=axis, **info)

    def message(self, nbytes, label, axis=None):
        if axis == "cp":
            self.sent[label] += nbytes
        super().message(nbytes, label, axis=axis)

    def reset(self):
        super().reset()
        self.sent, self.buffers = {"kv": 0, "dkv": 0}, {}


def exp_memory(mesh, st, out):
    """Activation bytes of one forward of one rank's tokens (through parallelize, the loader and the loss) for every
    cp dividing the world size (the other ranks: data parallel), ring and all-gather, at every sequence length of
    the settings; then the longest sequence within the budget, by the formula, checked by measuring it and the next
    length up. One model per (cp, impl): nothing in it depends on the sequence length (RoPE is computed from each
    batch's positions)."""
    world, rows, fits = mesh.world_size, [], []
    cps = [c for c in (1, 2, 4, 8) if world % c == 0]
    budget, longest = st["budget_mib"] * MiB, 8192
    for cp in cps:
        for impl in (("ring", "allgather") if cp > 1 else ("ring",)):
            sub = Mesh.init(dp=world // cp, cp=cp)
            try:
                cfg = make_cfg(st["size"], seq_len=2 * cp, micro_batch_size=st["b"], dp=world // cp, cp=cp,
                               cp_impl=impl, max_position_embeddings=longest)
                run = par.parallelize(cfg, sub)
                mc = run.raw.config
                for s in st["mem_seqs"]:
                    mine = _saved_bytes(run, cfg, sub, s, mesh)
                    rows.append(dict(cp=cp, impl=impl, s=s, measured=mine[0], every_rank=mine,
                                     formula=activation_bytes(mc, s, st["b"], cp, impl),
                                     parts=activation_parts(mc, s, st["b"], cp, impl)))
                    say(mesh, f"cp={cp} {impl:<9} s={s:<5}: {mine[0] / MiB:7.2f} MiB per rank measured, formula "
                               f"{rows[-1]['formula'] / MiB:7.2f}")
                if impl == "ring":
                    s_max = longest_fitting(mc, st["b"], cp, budget, limit=longest - 2 * cp)
                    at, above = (_saved_bytes(run, cfg, sub, x, mesh)[0] for x in (s_max, s_max + 2 * cp))
                    fits.append(dict(cp=cp, s_max=s_max, at=at, above=above, budget=budget))
                    say(mesh, f"budget {st['budget_mib']} MiB, cp={cp}: longest s = {s_max} ({at / MiB:.2f} MiB "
                               f"measured); s = {s_max + 2 * cp}: {above / MiB:.2f} MiB")
            finally:
                sub.destroy()
    return dict(rows=rows, fits=fits, b=st["b"], layers=mc.num_hidden_layers)


def _saved_bytes(run, cfg, sub, s, mesh):
    """Every rank's bytes autograd keeps in one forward (and the loss) of its tokens of a step-1 batch of length s."""
    x, y, positions = load_data(replace(cfg, seq_len=s), sub)[1].micro_batches(1)[0]
    with metrics.ActivationCounter(run.model) as counter:
        loss = run.loss_fn(run.model(x, positions), y)
    del loss
    return gather(counter.bytes, mesh)


def _qkv(st, s, seed=0):
    """The small model's attention inputs for a whole sequence: q [1, 8, s, 32], k, v [1, 4, s, 32], dout."""
    mc = model_config(st)
    g = torch.Generator().manual_seed(seed)
    a, kh, d = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    return [torch.randn(st["b"], n, s, d, generator=g) for n in (a, kh, kh, a)]


def exchange_alone(axis, block, reps):
    """Seconds one ring step's exchange takes with nothing else running: send `block` to the next rank, receive the
    previous rank's (the ring's own `_Ring`), median of `reps`."""
    ring, times = cpm._Ring(axis, hooks.Phases()), []
    for _ in range(reps):
        dist.barrier(axis.group)
        t0 = time.perf_counter()
        ring.finish(ring.start(block, "kv"), 0, "kv")
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def exp_balance(mesh, st, out):
    """The ring attention core alone at cp = world size, forward and backward, the two layouts in turn (repeats
    alternate them): per rank and repeat, each ring step's compute (CPU and wall seconds) and the waits; the events
    of the quietest repeat of each layout for the timeline; one block's exchange timed alone."""
    axis, cp, s = mesh.cp, mesh.cp.size, st["balance_seq"]
    q, k, v, dout = _qkv(st, s)
    cores, timelines, sent, inputs = {}, {}, {}, {}
    for layout in cpm.LAYOUTS:
        sent[layout] = SentBytes(cp)  # on the core's axis: what it sends
        cores[layout] = cpm.ContextParallelAttention(axis.recorded(sent[layout]), "ring", layout)
        timelines[layout] = CpuTimeline(mesh.device, mesh.rank)
        cores[layout].phases.listen(timelines[layout].record)  # each ring step's compute and wait: an event
        cos, sin = rope_cos_sin(cpm.positions(s, cp, axis.rank, layout), q.shape[-1], 10000.0)
        inputs[layout] = [cpm.split(t, cp, axis.rank, layout, dim=2) for t in (q, k, v, dout)] + [cos, sin]
    runs = {layout: [] for layout in cpm.LAYOUTS}
    for rep in range(st["balance_repeats"] + 1):  # the first of each layout warms up
        for layout in (cpm.LAYOUTS if rep % 2 == 0 else cpm.LAYOUTS[::-1]):
            core, tl = cores[layout], timelines[layout]
            qi, ki, vi, di, cos, sin = inputs[layout]
            qi, ki, vi = (t.clone().requires_grad_() for t in (qi, ki, vi))
            sent[layout].reset()  # the bytes: this call's only
            dist.barrier(axis.group)
            tl.events.clear()
            window = _common.LoadWindow()  # how much of the machine other programs use meanwhile
            t0 = tl.now()
            core(qi, ki, vi, cos, sin).backward(di)
            t1 = tl.now()
            load = window.stop()
            t0, t1 = (tl.seconds(t) for t in (t0, t1))  # on a GPU: when the GPU got there
            base = tl.t0
            events = [dict(e, start=e["start"] + base, end=e["end"] + base) for e in tl.events]
            every = gather(dict(events=events, call=(t0 + base, t1 + base), load=load), mesh)
            if rep > 0:
                runs[layout].append(every)
    block = torch.stack([inputs["zigzag"][1], inputs["zigzag"][2]])
    alone = max(gather(exchange_alone(axis, block, 9), mesh))
    reps = {layout: [summarize(every, cp) for every in runs[layout]] for layout in cpm.LAYOUTS}
    t_all, t_causal = block_costs(reps["zigzag"], cp)
    shares = {layout: [_common.others_share([m["load"] for m in every]) or 0.0 for every in runs[layout]]
              for layout in cpm.LAYOUTS}
    result = dict(cp=cp, s=s, b=st["b"], block_bytes=block.numel() * block.element_size(), exchange_alone_s=alone,
                  t_all=t_all, t_causal=t_causal, layouts={},
                  busy=statistics.median(sum(shares.values(), [])))  # other programs' share of the cores, median call
    for layout in cpm.LAYOUTS:
        rs = reps[layout]
        per_rank = {what: [sum(min(r[what][k][j] for r in rs) for j in range(cp)) for k in range(cp)]
                    for what in ("fwd_cpu", "bwd_cpu")}  # each ring step's quietest repeat: noise filtered step by step
        per_rank["cpu"] = [f + b for f, b in zip(per_rank["fwd_cpu"], per_rank["bwd_cpu"])]
        per_rank.update({what: [statistics.median(r[what][k] for r in rs) for k in range(cp)]
                         for what in ("wall", "wait_kv", "wait_dkv", "call")})
        quiet = min(range(len(rs)), key=lambda j: max(rs[j]["call"]))
        res = dict(per_rank=per_rank, reps=rs, events=runs[layout][quiet],
                   ratio=max(per_rank["cpu"]) / min(per_rank["cpu"]),
                   ratio_fwd=max(per_rank["fwd_cpu"]) / min(per_rank["fwd_cpu"]),
                   ratio_bwd=max(per_rank["bwd_cpu"]) / min(per_rank["bwd_cpu"]),
                   predicted=predicted_ratio(cp, layout), predicted_ideal=predicted_ratio(cp, layout, 0.5),
                   predicted_costs=predicted_ratio(cp, layout, t_causal / t_all),
                   pairs=[pairs(r, cp, layout) for r in range(cp)], bytes=dict(sent[layout].sent),
                   shares=shares[layout], busy=statistics.median(shares[layout]))
        result["layouts"][layout] = res
        say(mesh, f"cp={cp} {layout:<10} s={s}: attention per rank, forward + backward (CPU ms, each step's least of "
                   f"{len(rs)}) " + " ".join(f"{1e3 * x:7.1f}" for x in per_rank["cpu"])
                   + f" -> max/min {res['ratio']:.2f} (pairs predict {res['predicted']:.2f}, with the measured block "
                     f"costs {res['predicted_costs']:.2f}); forward alone {res['ratio_fwd']:.2f}, backward alone "
                     f"{res['ratio_bwd']:.2f}; the call per rank (ms, median) "
                   + " ".join(f"{1e3 * x:.0f}" for x in per_rank["call"]))
    say(mesh, f"block costs (forward + backward, CPU): whole {1e3 * t_all:.1f} ms, causal {1e3 * t_causal:.1f} ms; "
               f"other programs used {result['busy']:.0%} of the cores (median over the calls)")
    say(mesh, f"one K/V block ({result['block_bytes'] / 1024:.0f} KiB) exchanged alone: {1e3 * alone:.2f} ms")
    return result


def block_costs(reps, cp):
    """(t_all, t_causal): CPU seconds (forward + backward) of one whole block and of one causal (diagonal) block, read
    off zig-zag's ring steps: every step after the first computes two whole blocks, step 0 two causal blocks and
    one whole. Each rank's and step's least over the repeats, then the median over ranks and steps."""
    least = [[min(r["fwd_cpu"][k][j] for r in reps) + min(r["bwd_cpu"][k][j] for r in reps) for j in range(cp)]
             for k in range(cp)]
    t_all = statistics.median(x[j] / 2 for x in least for j in range(1, cp))
    return t_all, (statistics.median(x[0] for x in least) - t_all) / 2


def summarize(every, cp):
    """Per rank (lists by rank) of one forward + backward of the core: CPU seconds of each ring step's attention
    compute, forward and backward (fwd_cpu[rank][step], bwd_cpu[rank][step]); wall seconds of all that compute, of
    the waits for K/V and for dK/dV, and of the whole call."""
    out = {k: [0.0] * cp for k in ("wall", "wait_kv", "wait_dkv", "call")}
    out.update(fwd_cpu=[[0.0] * cp for _ in range(cp)], bwd_cpu=[[0.0] * cp for _ in range(cp)])
    for r, mine in enumerate(every):
        for e in mine["events"]:
            if e["name"] in ("attention", "attention-backward"):
                out["fwd_cpu" if e["name"] == "attention" else "bwd_cpu"][r][e["step"]] += e["cpu"]
                out["wall"][r] += e["end"] - e["start"]
            elif e["name"] == "wait":
                out[f"wait_{e['what']}"][r] += e["end"] - e["start"]
        out["call"][r] = mine["call"][1] - mine["call"][0]
    return out


class Stepper:
    """One variant (impl, layout) built as picotron.train builds it (`parallelize`, here with a SentBytes recorder on
    its axes), stepped as it steps; each recorded step's time (the slowest rank's) and the bytes its attention cores
    sent along cp."""

    def __init__(self, cfg, mesh):
        self.cfg, self.mesh = cfg, mesh
        self.recorder = SentBytes(mesh.cp.size)
        self.run = par.parallelize(cfg, mesh, recorder=self.recorder)
        self.loader = load_data(cfg, mesh)[1]
        self.times, self.sent, self.buffers, self.losses = [], [], [], []

    def step(self, step, record=True):
        run = self.run
        self.recorder.reset()
        t0 = time.perf_counter()
        loss = run.schedule.run(run.model, self.loader.micro_batches(step), run.loss_fn)
        marks.clip_grad_norm(run.params, self.cfg.grad_clip, self.mesh)
        run.optimizer.step()
        run.model.zero_grad(set_to_none=True)
        dt = torch.tensor([time.perf_counter() - t0])
        self.mesh.cp.all_reduce(dt, op=dist.ReduceOp.MAX)
        if record:
            self.times.append(dt.item())
            self.sent.append(dict(self.recorder.sent))
            self.buffers.append(dict(self.recorder.buffers))
            self.losses.append(loss.item())


def exp_train(mesh, st, out):
    """Training steps at cp = world size, ring zig-zag, ring contiguous and all-gather, one step of each in turn:
    tokens/s (median step), the bytes sent per step against the formula."""
    cp, s, b = mesh.cp.size, st["train_seq"], st["train_b"]
    variants = {f"{impl}, {layout}": Stepper(make_cfg(st["size"], seq_len=s, micro_batch_size=b, cp=cp, cp_impl=impl,
                                                      cp_layout=layout, max_position_embeddings=max(1024, s)), mesh)
                for impl, layout in VARIANTS}
    run_interleaved(list(variants.values()), st["train_steps"], st["train_warmup"], mesh.cp.group)
    mc = next(iter(variants.values())).run.raw.config
    rows = {}
    for name, v in variants.items():
        impl = v.cfg.cp_impl
        formula = cpm.bytes_per_step_formula(cp, b, s, mc.num_key_value_heads, mc.head_dim, mc.num_hidden_layers,
                                             elem=4, impl=impl)
        sent = gather(v.sent, mesh)
        med = statistics.median(v.times)
        rows[name] = dict(impl=impl, layout=v.cfg.cp_layout, times=v.times, step_s=med, tokens_per_s=b * s / med,
                          sent=sent, formula=formula, losses=v.losses,
                          formula_parts=dict(block=2 * b * mc.num_key_value_heads * (s // cp) * mc.head_dim * 4))
        say(mesh, f"cp={cp} {name:<17} s={s}: step {1e3 * med:6.0f} ms (median of {len(v.times)}), "
                   f"{b * s / med:7.0f} tokens/s; sent per step {sum(sent[0][-1].values()) / MiB:.3f} MiB "
                   f"(formula {formula / MiB:.3f})")
    return dict(cp=cp, s=s, b=b, layers=mc.num_hidden_layers, kv_heads=mc.num_key_value_heads, head_dim=mc.head_dim,
                rows=rows)


# -------------------------------------------------------------------------------------------- ulysses
def ulysses_forward_bytes(mc, b, s, cp, elem=4):
    """The buffers of one layer's four forward all-to-alls on one rank (q, k, v, out: this rank's s/cp tokens of
    every head, a query heads and kh' = ulysses_kv_heads KV heads): (2a + 2kh')·b·(s/cp)·d·elem; (cp-1)/cp of it
    leaves the rank, and the backward sends as much again."""
    return planner.ulysses_buffer_bytes(mc.num_attention_heads, mc.num_key_value_heads, cp, b, s, mc.head_dim, elem)


def exp_ulysses(mesh, st, out):
    """Ulysses against the ring (both zig-zag) at every cp of (2, 4, 8) dividing the world size (the other ranks:
    data parallel, so every cp runs on the same processes), s = cp x the tokens per rank of the settings (the same
    s/cp for every cp): training steps one of each in turn (the median step), the bytes of every all-to-all and
    ring message against the formulas, and the activation bytes one forward keeps (metrics.ActivationCounter)."""
    world, b, runs = mesh.world_size, st["train_b"], []
    for cp in [c for c in (2, 4, 8) if world % c == 0]:
        sub = Mesh.init(dp=world // cp, cp=cp)
        try:
            runs.append(_ulysses_at(sub, st, b, st["ulysses_tokens"] * cp, mesh))
        finally:
            sub.destroy()
    return dict(runs=runs)


def _ulysses_at(sub, st, b, s, mesh):
    cp = sub.cp.size
    variants = {impl: Stepper(make_cfg(st["size"], seq_len=s, micro_batch_size=b, dp=sub.dp.size, cp=cp,
                                       cp_impl=impl, max_position_embeddings=max(1024, s)), sub)
                for impl in ("ring", "ulysses")}
    busy = run_interleaved(list(variants.values()), st["ulysses_steps"], st["train_warmup"], mesh.world.group)
    mc = variants["ring"].run.raw.config
    L = mc.num_hidden_layers
    rows = {}
    for impl, v in variants.items():
        med = statistics.median(v.times)
        rows[impl] = dict(times=v.times, step_s=med, sent=gather(v.sent, mesh), buffers=gather(v.buffers, mesh),
                          formula=cpm.bytes_per_step_formula(cp, b, s, mc.num_key_value_heads, mc.head_dim, L,
                                                             impl=impl, heads=mc.num_attention_heads),
                          activations=_saved_bytes(v.run, v.cfg, sub, s, mesh), losses=v.losses)
        say(mesh, f"cp={cp} x dp={sub.dp.size} {impl:<8} s={s}: step {1e3 * med:6.0f} ms (median of {len(v.times)}); "
                   f"sent per step {sum(rows[impl]['sent'][0][-1].values()) / MiB:.3f} MiB (formula "
                   f"{rows[impl]['formula'] / MiB:.3f}); activations {rows[impl]['activations'][0] / MiB:.2f} MiB")
    return dict(cp=cp, dp=sub.dp.size, s=s, b=b, layers=L, heads=mc.num_attention_heads,
                kv_heads=mc.num_key_value_heads, head_dim=mc.head_dim,
                forward_formula=ulysses_forward_bytes(mc, b, s, cp), busy=busy, rows=rows)


# --------------------------------------------------------------------------------------------- parity
def _trained(mesh, st, out, name, **kw):
    """picotron.train on `mesh` with the parity settings: (per-step losses on rank 0, what parallelize built)."""
    kw = dict(dict(num_hidden_layers=st["parity_layers"], steps=st["parity_steps"], seq_len=st["parity_seq_len"],
                   micro_batch_size=2, grad_acc=st["parity_grad_acc"], warmup_steps=2, lr=3e-3,
                   log_every=st["parity_steps"], out=str(Path(out) / name)), **kw)
    cfg = make_cfg(st["size"], **kw)
    _, run = train(cfg, mesh, return_model=True)
    losses = [r["loss"] for r in metrics.read_metrics(cfg.out)[0]] if mesh.rank == 0 else None
    return losses, run


def replica_spread(run, axis):
    """The largest |difference| between this rank's parameters and those of the other ranks of `axis` (replicas
    that should be equal), after training."""
    flat = torch.cat([p.detach().reshape(-1) for p in run.raw.parameters()])
    every = [torch.empty_like(flat) for _ in range(axis.size)]
    dist.all_gather(every, flat, group=axis.group)
    return max((x - every[0]).abs().max().item() for x in every)


@contextmanager
def not_averaged_over_cp():
    """Inside: parallelize wraps the model for NO gradient sync (`data_parallel.Local`), as a trainer that averages
    over dp only does at dp = 1: each cp rank steps with the gradient of its own tokens' loss."""
    original = par.wrap_for_sync
    par.wrap_for_sync = lambda raw, cfg, axis, axis_of=None, **_: data_parallel.Local(raw)
    try:
        yield
    finally:
        par.wrap_for_sync = original


def parity_runs(world):
    """(label, the Config's degrees) of the parity runs on `world` processes: 2: cp = 2 zig-zag, contiguous and
    all-gather; more (4, or 8 with PICOTRON_NPROC=8): cp = world and cp = world/2 x dp = 2."""
    if world == 2:
        return [(f"cp={world}", dict(cp=world)), (f"cp={world}, contiguous", dict(cp=world, cp_layout="contiguous")),
                (f"cp={world}, all-gather", dict(cp=world, cp_impl="allgather"))]
    return [(f"cp={world}", dict(cp=world)), (f"cp={world // 2} x dp=2", dict(cp=world // 2, dp=2))]


def exp_parity(mesh, st, out):
    """2 processes: cp = 2 (zig-zag, contiguous, all-gather) and the trap (not averaged over cp); 4 (or 8)
    processes: cp = 4 and cp = 2 x dp = 2 (parity_runs). References (cp = 1, the same global batch) trained by rank 0
    alone."""
    world, result = mesh.world_size, dict(losses={}, reference={}, spread={})
    runs = parity_runs(world)
    for label, kw in runs:
        sub = Mesh.init(dp=kw.get("dp", 1), cp=kw["cp"])
        try:
            losses, run = _trained(sub, st, out, "parity_" + label.replace(" ", "").replace(",", "_"), **kw)
            result["losses"][label] = losses
            result["spread"][label] = replica_spread(run, sub.world)
        finally:
            sub.destroy()
    if world == 2:
        with not_averaged_over_cp():
            losses, run = _trained(mesh, st, out, "parity_not_averaged", cp=world)
        result["losses"]["not averaged"] = losses
        result["spread"]["not averaged"] = replica_spread(run, mesh.world)
    if mesh.rank == 0:
        local = Mesh.local(mesh.device)
        result["reference"]["dp=1"] = _trained(local, st, out, "parity_reference")[0]
        if world > 2:
            result["reference"]["dp=2"] = _trained(local, st, out, "parity_reference_dp2",
                                                   grad_acc=2 * st["parity_grad_acc"])[0]
    dist.barrier()
    return result


EXPERIMENTS = ("memory", "balance", "train", "parity", "ulysses")


def configs_at(nproc, fast=False):
    """The Configs the main run (balance, train, parity; the notebook's `run("balance,train,parity", nproc=...)`)
    trains on `nproc` processes, at GPU size (GPU_SETTINGS on top: the 8-process mode is for a node of GPUs): train's
    three variants at cp = nproc, then the parity runs (parity_runs). PICOTRON_NPROC=8 runs them at cp = 8."""
    st = settings(fast, "cuda")
    s, b = st["train_seq"], st["train_b"]
    out = [make_cfg(st["size"], seq_len=s, micro_batch_size=b, cp=nproc, cp_impl=impl, cp_layout=layout,
                    max_position_embeddings=max(1024, s)) for impl, layout in VARIANTS]
    for _, kw in parity_runs(nproc):
        out.append(make_cfg(st["size"], num_hidden_layers=st["parity_layers"], steps=st["parity_steps"],
                            seq_len=st["parity_seq_len"], micro_batch_size=2, grad_acc=st["parity_grad_acc"],
                            warmup_steps=2, lr=3e-3, **kw))
    return out


# ----------------------------------------------------------------------------- plots (for the notebook)
def plot_memory(res):
    """Left: activations per rank against s, measured (dots) and the formula (lines), ring for every cp and all-gather
    dashed, the budget and the longest s under it. Right: one layer's parts per rank at the longest s measured."""
    import matplotlib.pyplot as plt

    rows, fits = res["rows"], res["fits"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw=dict(width_ratios=[1.4, 1]))
    colors = {1: "#333333", 2: "#4c72b0", 4: "#dd8452", 8: "#55a868"}
    for (cp, impl) in sorted({(r["cp"], r["impl"]) for r in rows}):
        rs = sorted((r for r in rows if r["cp"] == cp and r["impl"] == impl), key=lambda r: r["s"])
        ls, mk = ("-", "o") if impl == "ring" else ("--", "x")
        ax1.plot([r["s"] for r in rs], [r["formula"] / MiB for r in rs], ls, color=colors[cp], lw=1, alpha=0.8)
        ax1.plot([r["s"] for r in rs], [r["measured"] / MiB for r in rs], mk, color=colors[cp], ms=6, mew=2,
                 label=f"cp={cp}" + ("" if cp == 1 else f", {impl}"))
    budget = fits[0]["budget"] / MiB
    ax1.axhline(budget, color="#c44e52", lw=1, ls=":")
    for f in fits:
        ax1.plot([f["s_max"]], [f["at"] / MiB], "*", color=colors[f["cp"]], ms=12)
        ax1.annotate(f"s={f['s_max']}", (f["s_max"], f["at"] / MiB), textcoords="offset points", xytext=(4, -12),
                     fontsize=FONT, color=colors[f["cp"]])
    ax1.text(ax1.get_xlim()[0], budget, f" budget {budget:g} MiB", va="bottom", fontsize=FONT, color="#c44e52")
    ax1.set(xlabel="sequence length s (tokens)", ylabel="MiB per rank (activations of one forward)",
            title="measured (markers) and the formula (lines); stars: the longest s within the budget")
    ax1.title.set_fontsize(9)
    legend_below(ax1, ncol=5, dy=-0.14)
    s = max(r["s"] for r in rows)
    cases = [r for r in rows if r["s"] == s]
    labels = [f"cp={r['cp']}" + ("" if r["cp"] == 1 else f"\n{r['impl']}") for r in cases]
    bottom = [0.0] * len(cases)
    part_colors = {"norms": "#8da0cb", "attention": "#fc8d62", "mlp": "#a6d854"}
    for part, color in part_colors.items():
        vals = [r["parts"]["layer"][part] / MiB for r in cases]
        ax2.bar(range(len(cases)), vals, bottom=bottom, color=color, label=part)
        bottom = [x + y for x, y in zip(bottom, vals)]
    ax2.set_xticks(range(len(cases)), labels, fontsize=FONT)
    ax2.set(ylabel="MiB per layer and rank (formula)", title=f"one layer's activations by part, s = {s}")
    ax2.title.set_fontsize(9)
    legend_below(ax2, ncol=3, dy=-0.22)
    fig.tight_layout()
    return fig


def plot_balance(results):
    """Per rank, the attention forward's compute (CPU ms, median over repeats) for both layouts, one panel per cp,
    with the prediction from the pairs (scaled to the zig-zag mean)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 3.4), squeeze=False)
    for ax, res in zip(axes[0], results):
        cp = res["cp"]
        w = 0.38
        for j, layout in enumerate(cpm.LAYOUTS):
            r = res["layouts"][layout]
            x = [k + (j - 0.5) * w for k in range(cp)]
            ax.bar(x, [1e3 * t for t in r["per_rank"]["cpu"]], w, color=LAYOUT_COLORS[layout],
                   label=f"{layout}: max/min {r['ratio']:.2f} (predicted {r['predicted_costs']:.2f}; block counts "
                         f"{r['predicted']:.2f})")
            ax.plot(x, [1e3 * t for t in predicted_times(cp, layout, res["t_all"], res["t_causal"])], "_", color="k",
                    ms=14, mew=2)
        ax.plot([], [], "_", color="k", ms=10, mew=2, label="predicted: whole blocks x t_whole + causal blocks x "
                                                            "t_causal (from zig-zag's steps)")
        ax.set_xticks(range(cp), [f"rank {k}" for k in range(cp)], fontsize=FONT)
        ax.set(ylabel="CPU ms (forward + backward)", title=f"cp = {cp}, s = {res['s']}: each rank's ring attention")
        ax.title.set_fontsize(9)
        legend_below(ax, ncol=1, dy=-0.12)
    fig.tight_layout()
    return fig


def plot_ring_timeline(res, layouts=cpm.LAYOUTS):
    """The quietest forward + backward of the core for each layout, one row per rank: each ring step's compute
    (forward blue, backward orange, the step written in it), the waits (red), and above each bar a thin grey line
    from the step's start to the end of its wait: the next K/V block (backward: and a dK/dV block) in flight."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    cp = res["cp"]
    fig, axes = plt.subplots(len(layouts), 1, figsize=(13, (0.75 * cp + 1.0) * len(layouts)), squeeze=False)
    colors = {"attention": "#4c72b0", "attention-backward": "#dd8452", "wait": "#c44e52"}
    for ax, layout in zip(axes[:, 0], layouts):
        every = res["layouts"][layout]["events"]
        t0 = min(m["call"][0] for m in every)
        span = max(m["call"][1] for m in every) - t0
        for r, mine in enumerate(every):
            ev = mine["events"]
            for e in ev:
                s, d = 1e3 * (e["start"] - t0), 1e3 * (e["end"] - e["start"])
                if e["name"] == "wait":
                    ax.barh(r + 0.05, d, left=s, height=0.6, color=colors["wait"])
                    continue
                ax.barh(r + 0.05, d, left=s, height=0.6, color=colors[e["name"]], edgecolor="white", lw=1.0)
                if d > 1e3 * span / 12:  # wide enough to say it in words
                    ax.text(s + d / 2, r + 0.05, f"step {e['step']}", ha="center", va="center", fontsize=10,
                            color="white")
                elif d > 1e3 * span / 40:  # the number alone
                    ax.text(s + d / 2, r + 0.05, str(e["step"]), ha="center", va="center", fontsize=10,
                            color="white")
                what = "kv"
                waits = [w for w in ev if w["name"] == "wait" and w["step"] == e["step"] and w["what"] == what
                         and w["start"] >= e["start"]]
                if waits:
                    end = 1e3 * (waits[0]["end"] - t0)
                    ax.plot([s, end], [r - 0.35, r - 0.35], color="0.45", lw=1.6, solid_capstyle="butt")
        ax.set_yticks(range(cp), [f"rank {k}" for k in range(cp)], fontsize=FONT)
        ax.set_ylim(cp - 0.5, -0.6)
        ax.set_xlim(0, 1e3 * span)
        ax.set_title(f"{layout}: one attention layer's forward and backward, cp = {cp}, s = {res['s']} (written in a "
                     f"bar: its ring step)", fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=FONT)
    axes[-1, 0].set_xlabel("ms since the call started", fontsize=FONT)
    handles = [Patch(color=colors["attention"], label="forward: a ring step's blocks"),
               Patch(color=colors["attention-backward"], label="backward: a ring step's blocks"),
               Patch(color=colors["wait"], label="waiting (for K/V or dK/dV)"),
               Line2D([], [], color="0.45", lw=1.6, label="the next K/V block requested (sent at the step's start, "
                                                          "waited for at its end)")]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=FONT, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def plot_throughput(results):
    """tokens/s per variant (median step), one group per cp."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [f"{i}, {l}" for i, l in VARIANTS]
    colors = ["#4c72b0", "#dd8452", "#55a868"]
    w = 0.8 / len(names)
    for g, res in enumerate(results):
        for j, name in enumerate(names):
            r = res["rows"][name]
            ax.bar(g + (j - 1) * w, r["tokens_per_s"], w, color=colors[j], label=name if g == 0 else None)
            ax.text(g + (j - 1) * w, r["tokens_per_s"], f"{r['tokens_per_s']:.0f}", ha="center", va="bottom",
                    fontsize=FONT)
    ax.set_xticks(range(len(results)), [f"cp = {r['cp']} ({r['cp']} processes), s = {r['s']}" for r in results],
                  fontsize=FONT)
    ax.set(ylabel="tokens / s (median step)", title="training throughput: ring against all-gather")
    ax.title.set_fontsize(9)
    legend_below(ax, ncol=3, dy=-0.14)
    fig.tight_layout()
    return fig


def plot_ulysses(results):
    """Ulysses against the ring at the same tokens per rank: the bytes a rank sends per step against cp (the
    formulas as lines, the measurements as points), the activation bytes one forward keeps, the median step time."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.3), gridspec_kw=dict(width_ratios=[1.4, 1, 1]))
    r0 = results[0]
    t = r0["s"] // r0["cp"]
    colors = {"ring": LAYOUT_COLORS["zigzag"], "ulysses": "#55a868"}
    ax = axes[0]
    for impl, color in colors.items():
        cps = [c for c in range(2, 9) if impl == "ring" or r0["heads"] % c == 0]  # Ulysses: c divides the heads
        line = [cpm.bytes_per_step_formula(c, r0["b"], t * c, r0["kv_heads"], r0["head_dim"], r0["layers"], impl=impl,
                                           heads=r0["heads"]) / MiB for c in cps]
        ax.plot(cps, line, ".-", color=color, lw=1.2, ms=4, label=f"{impl}: formula")
        ax.plot([r["cp"] for r in results], [sum(r["rows"][impl]["sent"][0][-1].values()) / MiB for r in results],
                "o", color=color, label=f"{impl}: measured (rank 0)")
    ax.set(xlabel=f"cp (s = cp x {t} tokens; Ulysses: the c dividing a = {r0['heads']})",
           ylabel="MiB sent per rank per step", ylim=(0, None))
    ax.set_title("bytes per rank at the same tokens per rank: the ring's grow with cp", fontsize=9)
    ax.legend(fontsize=FONT, frameon=False)
    w = 0.38
    for ax, what, unit, scale in ((axes[1], "activations", "MiB kept by one forward (rank 0)", MiB),
                                  (axes[2], "step_s", "median step (ms)", 1e-3)):
        for j, (impl, color) in enumerate(colors.items()):
            xs = [g + (j - 0.5) * w for g in range(len(results))]
            ys = [(r["rows"][impl][what][0] if what == "activations" else r["rows"][impl][what]) / scale
                  for r in results]
            ax.bar(xs, ys, w, color=color, label=impl)
            for x, y in zip(xs, ys):
                ax.text(x, y, f"{y:.1f}" if what == "activations" else f"{y:.0f}", ha="center", va="bottom",
                        fontsize=FONT)
        ax.set_xticks(range(len(results)), [f"cp = {r['cp']} x dp = {r['dp']}\ns = {r['s']}" for r in results],
                      fontsize=FONT)
        ax.set_ylabel(unit, fontsize=FONT)
        ax.set_title("activation memory" if what == "activations" else "time per step (CPU, shared)", fontsize=9)
        ax.set_ylim(0, 1.25 * ax.get_ylim()[1])
        ax.legend(fontsize=FONT, frameon=False, loc="upper left", ncol=2)
    fig.tight_layout()
    return fig


def plot_parity(pairs):
    # diff_ylim: the run not averaged over cp leaves the parity range
    return plot_parity_below(pairs, "each cp run", diff_ylim=(1e-10, 1e-1))


def plot_widget(cp=4, layout="zigzag", step=0):
    """The ring at one step: the (query chunk, key chunk) grid of the causal attention, each block coloured by the
    rank that computes it at this step, pale where it is computed at another step,
    white where it is in the future (skipped), hatched on the diagonal (the causal blocks); right: every rank's work over the whole ring, in pairs."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    n = 2 * cp
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw=dict(width_ratios=[1.25, 1]))
    owner = {c: r for r in range(cp) for c in cpm.chunks_of(r, cp, layout)}
    now = {(qc, kc): (r, seen) for r in range(cp) for qc, kc, seen in step_blocks(r, step, cp, layout)}
    for qc in range(n):
        for kc in range(n):
            seen = cpm.visibility(qc, kc)
            if (qc, kc) in now:
                r, seen = now[(qc, kc)]
                face, alpha = RANK_COLORS[r % len(RANK_COLORS)], 1.0
            elif seen != "none":
                face, alpha = RANK_COLORS[owner[qc] % len(RANK_COLORS)], 0.18
            else:
                face, alpha = "white", 1.0
            ax.add_patch(Rectangle((kc, qc), 1, 1, facecolor=face, alpha=alpha, edgecolor="0.7", lw=0.5))
            if seen == "causal":  # the diagonal: hatched at every step, computed now or not
                ax.add_patch(Rectangle((kc, qc), 1, 1, facecolor="none", edgecolor="0.25", lw=0, hatch="///"))
    ax.set_xlim(0, n)
    ax.set_ylim(n, 0)
    ax.set_aspect("equal")
    ticks = [f"{c}\n(r{owner[c]})" for c in range(n)]
    ax.set_xticks([c + 0.5 for c in range(n)], ticks, fontsize=6 if n > 8 else FONT)
    ax.set_yticks([c + 0.5 for c in range(n)], [f"{c} (r{owner[c]})" for c in range(n)], fontsize=6 if n > 8 else FONT)
    ax.set_xlabel("key chunk (rank holding it)", fontsize=FONT)
    ax.set_ylabel("query chunk (rank holding it)", fontsize=FONT)
    held = ", ".join(f"r{r}: K/V of r{(r - step) % cp}" for r in range(cp))
    ax.set_title(f"{layout}, cp={cp}, ring step {step}: {held}", fontsize=8 if cp <= 4 else 6, loc="left")
    handles = [Patch(color=RANK_COLORS[r % len(RANK_COLORS)], label=f"rank {r} computes it now") for r in range(cp)]
    handles += [Patch(facecolor="white", edgecolor="k", hatch="///", label="causal (diagonal) block"),
                Patch(facecolor="0.85", label="pale: another step"), Patch(facecolor="white", edgecolor="0.7",
                                                                           label="future: skipped")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=FONT, frameon=False)
    for j, lay in enumerate(cpm.LAYOUTS):
        work = [pairs(r, cp, lay) for r in range(cp)]
        ax2.bar([r + (j - 0.5) * 0.38 for r in range(cp)], work, 0.38, color=LAYOUT_COLORS[lay],
                label=f"{lay}: max/min {max(work) / min(work):.2f}", alpha=1.0 if lay == layout else 0.45)
    ax2.set_xticks(range(cp), [f"r{r}" for r in range(cp)], fontsize=FONT)
    ax2.set(ylabel="blocks computed over the ring", title="work per rank (a causal block counts whole)")
    ax2.title.set_fontsize(9)
    ax2.legend(fontsize=FONT, frameon=False, loc="upper left")
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------------ main
def main(argv=None):
    args, names, out = _common.cli("06_context_parallel", EXPERIMENTS, __doc__, argv=argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        sys.exit("run it on 2 or more processes: torchrun --nproc_per_node 2 lessons/06_context_parallel/experiment.py")
    mesh = Mesh.init(cp=world, device=_common.experiment_device("06_context_parallel"))
    with mesh:  # on success every rank meets at a barrier before the groups go (Mesh.destroy)
        st = settings(args.fast, mesh.device.type)
        _common.run_experiments(names, lambda name: globals()[f"exp_{name}"](mesh, st, out),
                                lambda name: out / f"{name}_cp{world}.json", _common.environment(mesh, cp=world, settings=st),
                                mesh.rank)


if __name__ == "__main__":
    main()
