"""Async TP (the collective matmul, picotron/async_tp.py) against blocking sequence parallelism, side by side in one
run: the same decoder layers, the same weights and the same batch, one forward and backward of each in turn.

    torchrun --nproc_per_node 2 benchmarks/async_tp_bench.py [--steps 20] [--size small] [--seq-len 128]
             [--micro-batch-size 4] [--link-ratio 0.5 | --no-link]

What it measures, per variant and round (the slowest rank's): the time of one forward + backward of the layers, and
the EXPOSED tensor-parallel communication per layer, the time the compute was blocked on the block's collectives:
blocking, the all-gathers and reduce-scatters themselves (they are synchronous); overlapped, the waits on ring
steps (the `wait` phases of picotron.async_tp). The norms' weight all-reduces (h numbers each) are the same in
both and left out. Printed: the median of the paired throughput ratios (blocking's time / overlapped's) and the
exposed milliseconds per layer of each, with the planner's prediction (planner.async_tp_layer_seconds) for the same
link and the measured matmul rate.

The link. On a CPU the ranks' bytes move through the same cores that multiply, and a local transfer is nearly
free: nothing to hide. So by default every tp collective and ring step is held to an emulated link
(picotron.link.EmulatedLink, messages=True) whose bandwidth makes one ring step's message take `--link-ratio` times
one chunk's q/k/v matmul at the measured matmul rate (latency 0.1 ms): the regime where the overlap decides. The
link is a model, labelled so; on GPUs pass --no-link to measure the real interconnect.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import _smoke  # noqa: E402
from picotron import hooks, marks, metrics, planner, tensor_parallel  # noqa: E402
from picotron.link import EmulatedLink  # noqa: E402
from picotron.mesh import Mesh  # noqa: E402
from picotron.model import Llama, rope_cos_sin  # noqa: E402
from picotron.model_config import ModelConfig  # noqa: E402

SIZES = {"small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4),  # lessons' 3.3 M model
         "medium": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4)}
LATENCY = 1e-4
BLOCK_COLLECTIVES = ("all-gather", "reduce-scatter")


def model_config(size="small", **overrides):
    return ModelConfig.from_preset("tiny", **{**SIZES.get(size, {}), **overrides})


def chunk_matmul_seconds(mc, tokens, tp, rate):
    """One chunk's q/k/v matmul at `rate` FLOP/s: the time a ring step's message can hide under in attention."""
    return 2 * tokens / tp * mc.hidden_size * (mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim / tp / rate


def choose_link(mc, tokens, tp, rate, ratio):
    """An emulated link on which one ring step (tokens/tp rows of h fp32) takes `ratio` × one chunk's q/k/v matmul."""
    chunk_bytes = tokens / tp * mc.hidden_size * 4
    seconds = ratio * chunk_matmul_seconds(mc, tokens, tp, rate)
    return EmulatedLink(chunk_bytes / max(seconds - LATENCY, seconds / 2), LATENCY, messages=True)


class Layers:
    """This rank's shard of the model's decoder layers (sp, and the collective matmul if `overlap`), on a tp axis
    recorded by its own Recorder and Timeline (and held to `link`'s time)."""

    def __init__(self, mc, mesh, overlap, link, seq_len, micro_batch_size, seed=0):
        self.link = link
        self.recorder = metrics.Recorder(metrics.Timeline(mesh.device, mesh.rank))
        self.recorder.time_messages = True
        axis = (mesh.tp.over(link) if link is not None else mesh.tp).recorded(self.recorder)
        with torch.device("meta"):
            model = Llama(mc)
        tensor_parallel.apply(model, axis, sp=True, overlap=overlap)
        self.model = marks.materialize(model, mesh.device).init_weights(seed)
        hooks.watch(self.model, listener=self.recorder.phase)
        n, r, s = axis.size, axis.rank, seq_len
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(micro_batch_size, s, mc.hidden_size, generator=g)
        self.x = x[:, r * s // n:(r + 1) * s // n].to(mesh.device)  # this rank's tokens
        self.grad = torch.randn(micro_batch_size, s, mc.hidden_size, generator=g)[:, r * s // n:(r + 1) * s // n]
        self.grad = self.grad.to(mesh.device)
        self.cos, self.sin = (t.to(mesh.device) for t in rope_cos_sin(torch.arange(s), mc.head_dim, mc.rope_theta))
        self.layers = len(self.model.layers)

    def step(self):
        """One forward and backward of the layers: (seconds, this rank's timeline events)."""
        tl = self.recorder.timeline
        tl.events = []
        self.recorder.reset()  # the bytes and calls of this step alone
        if self.link is not None:
            self.link.log.clear()  # the messages of this step alone
        x = self.x.clone().requires_grad_()
        metrics.sync(x.device)
        t0 = time.perf_counter()
        with tl.record("step", kind="step"):
            h = x
            for layer in self.model.layers:
                h = layer(h, self.cos, self.sin)
            h.backward(self.grad)
        metrics.sync(x.device)
        elapsed = time.perf_counter() - t0
        self.model.zero_grad(set_to_none=True)
        spans = [] if self.link is None else [(start - tl.t0, end - tl.t0) for _, _, start, end in self.link.log]
        return elapsed, list(tl.events), spans


    def results(self):
        """One forward and backward: [the layers' output, the input's gradient, every parameter's gradient]."""
        x = self.x.clone().requires_grad_()
        h = x
        for layer in self.model.layers:
            h = layer(h, self.cos, self.sin)
        h.backward(self.grad)
        out = [h.detach(), x.grad] + [p.grad.clone() for p in self.model.layers.parameters()]
        self.model.zero_grad(set_to_none=True)
        return out


def blocked(events, overlap):
    """[(start, end)] of the times the compute was blocked on the blocks' tp communication in one step's events:
    the blocking collectives themselves, or the waits on ring steps."""
    if overlap:
        return [(e["start"], e["end"]) for e in events if e["name"] == "wait"]
    return [(e["start"], e["end"]) for e in events if e.get("kind") == "comm" and e["name"] in BLOCK_COLLECTIVES]


def exposed_seconds(events, overlap):
    """Seconds the compute was blocked on the blocks' tp communication in one step's events."""
    return sum(b - a for a, b in blocked(events, overlap))


def link_bound_seconds(events, overlap, spans):
    """The part of the blocked time during which the emulated link still carried a message (`spans`: its messages,
    one after another): the wait for the link, what the planner's formula models; the rest is waiting for the
    other rank (its skew on a shared machine) and the transfer's own work."""
    total = 0.0
    for a, b in blocked(events, overlap):
        for s, e in spans:
            total += max(0.0, min(b, e) - max(a, s))
    return total


def compare(mesh, mc, seq_len, micro_batch_size, rounds, warmup=1, link_ratio=0.5, rate=None):
    """Both variants, one step of each in turn (the order rotating), a barrier before each; returns a dict: per
    variant the step times and exposed seconds per layer (each round's slowest rank), rank 0's events of the last
    round; the link, the matmul rate and the planner's prediction per layer."""
    tp = mesh.tp.size
    tokens = micro_batch_size * seq_len
    if rate is None:  # the slowest rank's measured matmul rate: one link for every rank
        rates = [None] * tp
        dist.all_gather_object(rates, metrics.measured_matmul_peak(mesh.device), group=mesh.tp.group)
        rate = min(rates)
    link = choose_link(mc, tokens, tp, rate, link_ratio) if link_ratio else None
    runs = {"blocking": Layers(mc, mesh, False, link, seq_len, micro_batch_size),
            "overlapped": Layers(mc, mesh, True, link, seq_len, micro_batch_size)}
    rows = {name: dict(times=[], exposed=[], link_bound=[], events=None) for name in runs}
    for k in range(rounds + warmup):
        for name in (list(runs) if k % 2 == 0 else list(runs)[::-1]):
            dist.barrier(group=mesh.tp.group)
            seconds, events, spans = runs[name].step()
            exposed = exposed_seconds(events, name == "overlapped") / runs[name].layers
            bound = link_bound_seconds(events, name == "overlapped", spans) / runs[name].layers
            both = [None] * tp
            dist.all_gather_object(both, (seconds, exposed, bound), group=mesh.tp.group)
            if k >= warmup:
                rows[name]["times"].append(max(b[0] for b in both))
                rows[name]["exposed"].append(max(b[1] for b in both))
                rows[name]["link_bound"].append(max(b[2] for b in both))
                rows[name]["events"] = events
                rows[name]["link_spans"] = spans  # when the link carried each message (rank's timeline seconds)
                rows[name]["bytes"] = dict(runs[name].recorder.bytes)  # the whole buffers; "send": what left
                rows[name]["calls"] = dict(runs[name].recorder.calls)
    out = dict(tp=tp, tokens=tokens, rate=rate, layers=mc.num_hidden_layers, runs=rows,
               link=None if link is None else dict(bandwidth=link.bandwidth, latency=link.latency, label=link.label(),
                                                    ratio=link_ratio))
    if link is not None:  # the planner's formula on the same link and the measured matmul rate (forward + backward)
        args = (mc, tokens, tp, 4, rate, link.latency, link.bandwidth)
        out["model"] = dict(blocking=planner.async_tp_layer_seconds(*args, overlap=False),
                            overlapped=planner.async_tp_layer_seconds(*args))
    ratios = [b / o for b, o in zip(rows["blocking"]["times"], rows["overlapped"]["times"])]
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    out["ratio"] = dict(median=statistics.median(ratios), q1=q[0], q3=q[2], n=len(ratios))
    for name in rows:
        rows[name]["median_s"] = statistics.median(rows[name]["times"])
        rows[name]["exposed_per_layer_s"] = statistics.median(rows[name]["exposed"])
        rows[name]["link_bound_per_layer_s"] = statistics.median(rows[name]["link_bound"])
    return out


def report(res):
    runs = res["runs"]
    lines = [f"tp={res['tp']}, {res['tokens']} tokens per micro-batch, {res['layers']} layers, matmul rate "
             f"{res['rate'] / 1e9:.1f} GFLOP/s, " + (res["link"]["label"] if res["link"] else "no emulated link")]
    for name, row in runs.items():
        model = (f", of which waiting for the link {1e3 * row['link_bound_per_layer_s']:.2f} ms (model "
                 f"{1e3 * res['model'][name]:.2f} ms)") if "model" in res else ""
        lines.append(f"{name:<11} {1e3 * row['median_s']:8.2f} ms per forward+backward, exposed tp communication "
                     f"{1e3 * row['exposed_per_layer_s']:6.2f} ms per layer{model}")
    r = res["ratio"]
    lines.append(f"overlapped throughput / blocking's: median {r['median']:.3f} (quartiles {r['q1']:.3f}-{r['q3']:.3f}, "
                 f"{r['n']} rounds)")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--link-ratio", type=float, default=0.5,
                        help="one ring step's emulated message time / one chunk's q/k/v matmul time")
    parser.add_argument("--no-link", action="store_true", help="the real interconnect (GPUs)")
    args, smoke = _smoke.parse(parser, argv, seq_len=16, micro_batch_size=2)
    with Mesh.init(tp=int(__import__("os").environ.get("WORLD_SIZE", "1"))) as mesh:
        if mesh.tp.size < 2:
            sys.exit("run it on 2 or more processes: torchrun --nproc_per_node 2 benchmarks/async_tp_bench.py")
        res = compare(mesh, model_config(args.size, **smoke), args.seq_len, args.micro_batch_size, args.steps,
                      args.warmup, 0 if args.no_link else args.link_ratio)
        if mesh.rank == 0:
            print(report(res), flush=True)


if __name__ == "__main__":
    main()
