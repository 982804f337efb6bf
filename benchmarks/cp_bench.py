"""Context parallelism: ring attention (zig-zag and contiguous layouts) against the all-gather baseline and Ulysses'
all-to-alls, in one run.

    torchrun --nproc_per_node C benchmarks/cp_bench.py [--steps 10] [--warmup 2] [--size small] [--seq-len 1024]
             [--micro-batch-size 2] [--grad-acc 1]
             [--variants ring/zigzag,ring/contiguous,allgather/zigzag,ulysses/zigzag]
    python benchmarks/repeat.py --runs 5 --nproc C cp_bench.py [flags]     # the median over fresh runs

C = the number of context-parallel ranks (cp = C, dp = 1: every rank holds 2 of the 2·C chunks of every sequence).
Each variant is picotron.train's model and step at --cp C --cp-impl IMPL --cp-layout LAYOUT: `parallelize(cfg,
mesh)`, this rank's tokens from `train.load_data` (the same rows on every variant, each rank its chunks of them),
per step `schedule.run`, `marks.clip_grad_norm`, `optimizer.step()`, `zero_grad()`. Every variant starts from the
same weights (the initialisation depends on the seed and the names only).

Before timing, one step of each from the same weights: the global-batch losses and gradient norms must agree to
1e-5 relative (fp32; the ring merges blocks by log-sum-exp, the all-gather and Ulysses call SDPA once), or the
script stops.
Timing: one step of each variant in turn, the order rotating, a barrier before every step; a step's time is the
slowest rank's. Printed per variant: the median step time and tokens/s; per pair of variants, the median of the
paired ratios of the same round with its quartiles (ring zig-zag against all-gather zig-zag: the cost of the
ring against gathering K/V once; zig-zag against contiguous under the ring: what balancing the causal work buys;
Ulysses zig-zag against ring zig-zag: all-to-alls over heads against the ring).

Also per variant:
  bytes     what one rank sent along cp per step (K/V forward and dK/dV backward), counted by a metrics.Recorder
            on the axes (`parallelize(..., recorder=)`, reset every step): the ring's messages, and (cp-1)/cp of the
            all-gather's, reduce-scatter's and all-to-alls' buffers (the rest is the rank's own), next to
            `context_parallel.bytes_per_step_formula`;
  balance   each rank's attention compute per step: the cores' "attention" and "attention-backward" phases as
            events of a metrics.Timeline listening to them (the ring's waits are separate "wait" events, reported
            beside), the median step per
            rank, and max/min across ranks, next to the ratio predicted by counting the (query chunk, key chunk)
            pairs each rank computes (a diagonal pair costs a full one: the mask does not skip work). The
            all-gather's and Ulysses' attention is one SDPA call whose backward autograd runs unseen: forward only.
"""
import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lessons"))
from _common import SIZES, make_cfg, run_interleaved  # noqa: E402  (the lessons' models; puts ROOT on sys.path)
from benchmarks import _smoke  # noqa: E402  (--smoke, the test's size; a package import: lessons import these scripts)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from picotron import context_parallel as cpm, hooks, marks, metrics  # noqa: E402
from picotron.mesh import Mesh  # noqa: E402
from picotron.parallelize import parallelize  # noqa: E402
from picotron.train import load_data  # noqa: E402

VARIANTS = ("ring/zigzag", "ring/contiguous", "allgather/zigzag", "ulysses/zigzag", "allgather/contiguous",
            "ulysses/contiguous")
# (variant, baseline, what the ratio says): baseline's step time / variant's = variant's throughput relative to it
PAIRS = (("ring/zigzag", "allgather/zigzag", "ring zigzag throughput / all-gather zigzag's"),
         ("ring/zigzag", "ring/contiguous", "ring zigzag throughput / ring contiguous's"),
         ("ulysses/zigzag", "ring/zigzag", "ulysses zigzag throughput / ring zigzag's"))
ATTENTION = ("attention", "attention-backward")


class Variant:
    """One (impl, layout) built and stepped as picotron.train does; per recorded step: this rank's time, the
    bytes its attention cores sent, its attention compute and its ring waits (seconds)."""

    def __init__(self, name, cfg, mesh):
        self.name, self.cfg, self.mesh = name, cfg, mesh
        self.recorder = metrics.Recorder()
        self.run = parallelize(cfg, mesh, recorder=self.recorder)
        self.loader = load_data(cfg, mesh)[1]
        self.timeline = metrics.Timeline(mesh.device, mesh.rank)
        hooks.watch(*cpm.cores(self.run.raw), listener=self.timeline.record)
        self.times, self.sent, self.attention, self.wait = [], [], [], []
        self.loss = self.grad_norm = None

    def step(self, step, record=True):
        run = self.run
        self.recorder.reset()
        self.timeline.events.clear()
        metrics.sync(self.mesh.device)
        t0 = time.perf_counter()
        loss = run.schedule.run(run.model, self.loader.micro_batches(step), run.loss_fn)
        self.grad_norm = marks.clip_grad_norm(run.params, self.cfg.grad_clip, self.mesh)
        run.optimizer.step()
        run.model.zero_grad(set_to_none=True)
        self.loss = loss.item()
        metrics.sync(self.mesh.device)
        if record:
            self.times.append(time.perf_counter() - t0)
            self.sent.append(sent_along_cp(self.recorder, self.mesh.cp.size))
            ev = self.timeline.events
            self.attention.append(sum(e["end"] - e["start"] for e in ev if e["name"] in ATTENTION))
            self.wait.append(sum(e["end"] - e["start"] for e in ev if e["name"] == "wait"))
        return self.loss


def sent_along_cp(recorder, cp):
    """Bytes this rank sent along the cp axis: the ring's messages, and (cp-1)/cp of the buffer of each all-gather,
    reduce-scatter and all-to-all (the rest is the rank's own piece)."""
    return sum(nbytes if kind == "send" else nbytes // cp * (cp - 1) for kind, nbytes, axis in recorder.log
               if axis == "cp")


def check_first_step(variants, mesh, tol=1e-5):
    """One step of each from the same weights: {name: (loss, grad norm)} and the largest relative difference to
    the first variant's; raises if it exceeds tol."""
    got = {}
    for v in variants:
        dist.barrier(mesh.cp.group)
        got[v.name] = (v.step(1, record=False), v.grad_norm)
    l0, g0 = got[variants[0].name]
    rel = max(max(abs(l - l0) / abs(l0), abs(g - g0) / abs(g0)) for l, g in got.values())
    if rel > tol:
        raise SystemExit(f"first step differs (relative {rel:.2e} > {tol}): "
                         + ", ".join(f"{n} loss {l!r} grad norm {g!r}" for n, (l, g) in got.items()))
    return got, rel


def predicted_balance(cp, layout):
    """max/min over ranks of the (query chunk, key chunk) pairs a rank computes (visibility 'all' or 'causal')."""
    work = [sum(cpm.visibility(q, k) != "none" for q in cpm.chunks_of(r, cp, layout) for k in range(2 * cp))
            for r in range(cp)]
    return max(work) / min(work), work


def quartiles(r):
    q = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
    return statistics.median(r), q[0], q[2]


def collect(v, mesh):
    """Slowest rank's time per step; per rank: median attention, median wait, bytes of the last step."""
    t = torch.tensor(v.times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.cp.group)
    mine = torch.tensor([statistics.median(v.attention), statistics.median(v.wait), float(v.sent[-1]),
                         float(max(v.sent) - min(v.sent))], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(mesh.cp.size)]
    dist.all_gather(every, mine, group=mesh.cp.group)
    return dict(times=t.tolist(), attention=[e[0].item() for e in every], wait=[e[1].item() for e in every],
                sent=[int(e[2].item()) for e in every], sent_varies=any(e[3].item() for e in every))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="timed rounds (one step of every variant each)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--size", default="small", choices=list(SIZES))
    p.add_argument("--num-hidden-layers", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=1024, help="long enough that attention is most of a step")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--grad-acc", type=int, default=1)
    p.add_argument("--variants", default=",".join(VARIANTS[:4]), help=f"comma-separated subset of {','.join(VARIANTS)}")
    args, tiny = _smoke.parse(p, num_hidden_layers=2, seq_len=32, micro_batch_size=1)
    names = args.variants.split(",")
    if any(n not in VARIANTS for n in names) or len(set(names)) != len(names):
        p.error(f"--variants {args.variants!r}: pick a comma-separated subset of {','.join(VARIANTS)}")
    cp = int(os.environ.get("WORLD_SIZE", "1"))
    if cp < 2:
        p.error("run it with torchrun --nproc_per_node C, C >= 2 (the cp ranks)")
    kw = dict(**tiny, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size, grad_acc=args.grad_acc, cp=cp,
              max_position_embeddings=max(1024, args.seq_len))
    if args.num_hidden_layers:
        kw["num_hidden_layers"] = args.num_hidden_layers
    base = make_cfg(args.size, **kw)
    for n in names:  # Ulysses needs cp to divide the heads: its one sentence before any process group
        problem = cpm.check(dataclasses.replace(base, cp_impl=n.split("/")[0]), base.model_config())
        if problem:
            p.error(f"--variants {n}: {problem}")
    mesh = Mesh.init(cp=cp)
    threads = torch.get_num_threads()
    with mesh:  # on success every rank meets at a barrier before the groups go (Mesh.destroy)
        t0 = time.perf_counter()
        variants = [Variant(n, dataclasses.replace(base, cp_impl=n.split("/")[0], cp_layout=n.split("/")[1]), mesh)
                    for n in names]
        first, rel = check_first_step(variants, mesh)
        run_interleaved(variants, args.steps, args.warmup, mesh.cp.group)
        rows = {v.name: collect(v, mesh) for v in variants}
        if mesh.rank == 0:
            mc, b, s, m = base.model_config(), args.micro_batch_size, args.seq_len, args.grad_acc
            print(f"CP ring vs all-gather vs Ulysses, cp={cp} ({mesh.device.type}/{mesh.backend}, {threads} thread"
                  f"{'s' if threads > 1 else ''} per rank), {args.steps} rounds, model {args.size} "
                  f"{mc.num_hidden_layers} layers ({mc.num_params() / 1e6:.1f} M, {mc.num_attention_heads} heads "
                  f"over {mc.num_key_value_heads} KV heads of {mc.head_dim}), {m} x {b}x{s} tokens per step "
                  f"({s // cp} per rank per row), fp32, {time.perf_counter() - t0:.0f} s:")
            print("  first step: " + ", ".join(f"{n} loss {l:.7f} grad norm {g:.7f}" for n, (l, g) in first.items())
                  + f" | max relative difference {rel:.1e}")
            for n, r in rows.items():
                med = statistics.median(r["times"])
                print(f"  {n:<20} {1e3 * med:8.1f} ms/step  {m * b * s / med:8.0f} tokens/s")
            print("  bytes sent per step per rank (attention K/V + dK/dV; Ulysses: q, k, v, out and their gradients), "
                  "counted vs bytes_per_step_formula:")
            for n, r in rows.items():
                form = cpm.bytes_per_step_formula(cp, b, s, mc.num_key_value_heads, mc.head_dim, mc.num_hidden_layers,
                                                  elem=4, impl=n.split("/")[0], micro_batches=m,
                                                  heads=mc.num_attention_heads)
                ok = all(x == form for x in r["sent"]) and not r["sent_varies"]
                print(f"    {n:<20} {' '.join(f'{x / 2**20:.3f}' for x in r['sent'])} MiB (ranks 0..{cp - 1}), "
                      f"formula {form / 2**20:.3f} MiB: {'equal' if ok else 'DIFFERENT'}")
            print("  attention compute per rank (median step; ring: forward + backward, all-gather and Ulysses: "
                  "forward only), "
                  "max/min across ranks vs predicted by chunk pairs; ring waits beside:")
            for n, r in rows.items():
                att, impl, layout = r["attention"], *n.split("/")
                pred, work = predicted_balance(cp, layout)
                pred_txt = f"predicted {pred:.2f} ({'/'.join(map(str, work))} pairs)" if impl == "ring" else \
                    "predicted 1.00 (SDPA over the whole sequence, masked)"
                wait = f"; waits {' '.join(f'{1e3 * w:.1f}' for w in r['wait'])} ms" if impl == "ring" else ""
                print(f"    {n:<20} {' '.join(f'{1e3 * a:.1f}' for a in att)} ms, max/min {max(att) / min(att):.2f}, "
                      f"{pred_txt}{wait}")
            for a, base_name, label in PAIRS:
                if a in rows and base_name in rows:
                    med, q1, q3 = quartiles([tb / ta for ta, tb in zip(rows[a]["times"], rows[base_name]["times"])])
                    print(f"  {label}: median {med:.3f} (quartiles {q1:.3f}-{q3:.3f})", flush=True)


if __name__ == "__main__":
    main()
