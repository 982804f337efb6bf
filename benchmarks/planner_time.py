"""The planner's time model against measurement: `python benchmarks/planner_time.py [--out FILE.json]`.

What this machine can time honestly is two ranks on its two cores: every layout below runs on one process or two,
one thread each (never more processes than cores), the same model, sequence and global batch (16 sequences per
step), fp32. Each layout trains `--steps` steps; the first two are dropped (allocations, thread pools), a step's time
is the slowest rank's, and the layout's time the median of the rest. The layouts run in `--rounds` rounds, one after
the other in each, so slow drift of the machine spreads over all of them; the median over rounds is kept, and
how well one round's times rank the layouts as another's do is reported beside the model's.

The planner sees this machine as `plan.cpu_hardware`: the matmul peak measured on one thread (alone for the one-process
layouts, beside a second process doing the same for the two-process ones: two busy cores share the memory bandwidth
and caches), gloo's α and bandwidth fitted to back-to-back all-reduces between two processes (T = 2α + bytes/bw on two
ranks). Its one free number, the efficiency
(achieved FLOP/s over the matmul peak), is fitted on the one-process run alone; every other prediction follows from
the model. Reported: per layout predicted/measured, and the rank correlation (Spearman) of predicted and measured
step times over all layouts — what matters to a planner that ranks.
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from picotron import plan, planner  # noqa: E402
from picotron.config import Config  # noqa: E402
from picotron.launch import run_on_ranks  # noqa: E402

MODEL = dict(vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4)
SETTINGS = dict(MODEL, seq_len=256, micro_batch_size=4, grad_acc=4, sample_tokens=0, log_every=1000, eval_every=0,
                warmup_steps=1)
LAYOUTS = [
    {}, {"recompute": "full"},
    {"dp": 2, "grad_acc": 2}, {"dp": 2, "grad_acc": 2, "zero": 1}, {"dp": 2, "grad_acc": 2, "zero": 2},
    {"dp": 2, "grad_acc": 2, "zero": 3}, {"dp": 2, "grad_acc": 2, "recompute": "full"},
    {"dp": 2, "micro_batch_size": 1, "grad_acc": 8},
    {"tp": 2}, {"tp": 2, "sp": True}, {"tp": 2, "micro_batch_size": 16, "grad_acc": 1},
    {"cp": 2}, {"cp": 2, "cp_layout": "contiguous"}, {"cp": 2, "cp_impl": "allgather"},
    {"pp": 2, "pp_schedule": "afab"}, {"pp": 2}, {"pp": 2, "pp_schedule": "interleaved", "pp_chunks": 2},
    {"pp": 2, "pp_schedule": "zb-h1"}, {"pp": 2, "pp_schedule": "zb-v"},
    {"pp": 2, "micro_batch_size": 1, "grad_acc": 16},
]


def _child(layout, out, steps):
    from picotron import metrics
    from picotron.mesh import Mesh
    from picotron.train import train
    cfg = Config(out=out, steps=steps, **{**SETTINGS, **layout})
    times = []
    write = metrics.MetricsLog.write

    def keep(self, record):
        if "step_time" in record:
            times.append(record["step_time"])
        return write(self, record)

    metrics.MetricsLog.write = keep  # every rank's times, not only rank 0's file
    with Mesh.init(dp=cfg.dp, pp=cfg.pp, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep) as mesh:
        train(cfg, mesh)
    return times


def measure(layout, folder, steps):
    """The layout's step time: per step the slowest rank, then the median of the steps after the first two."""
    cfg = Config(**{**SETTINGS, **layout})
    ranks = run_on_ranks(_child, cfg.world_size, layout, folder, steps, timeout_s=900)
    per_step = np.max(np.array(ranks), axis=0)
    return float(np.median(per_step[2:]))


def _link_child(sizes, reps):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    out = []
    for n in sizes:
        x = torch.ones(n // 4)
        for _ in range(3):
            dist.all_reduce(x)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):  # back to back: a barrier before each would add its own skew
            dist.all_reduce(x)
        out.append((time.perf_counter() - t0) / reps)
    return out


def measure_link(sizes=tuple(2 ** k for k in range(12, 25, 2)), reps=20):
    """gloo between two processes: (α, bandwidth) from T = 2α + bytes/bw, least squares on the relative error."""
    seconds = np.max(np.array(run_on_ranks(_link_child, 2, list(sizes), reps, timeout_s=300)), axis=0)
    x, y = np.array(sizes, float), seconds
    (a2, inv_bw), *_ = np.linalg.lstsq(np.stack([1 / y, x / y], 1), np.ones_like(y), rcond=None)
    return dict(alpha=max(float(a2) / 2, 0.0), bw=1 / float(inv_bw), sizes=list(sizes), seconds=seconds.tolist())


def _peak_child():
    import torch

    from picotron import metrics
    torch.set_num_threads(1)
    return metrics.measured_matmul_peak(torch.device("cpu"))


def ranks(x):
    """1-based ranks, ties sharing their average rank (as Spearman's coefficient wants)."""
    x = np.asarray(x, float)
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        r[x == v] = r[x == v].mean()
    return r


def spearman(a, b):
    """Spearman's rank correlation: Pearson's r of the (tie-averaged) ranks."""
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def name_of(layout):
    cfg = Config(**{**SETTINGS, **layout})
    extra = [layout[k] for k in ("cp_layout", "cp_impl") if k in layout]
    return ",".join([str(planner.Layout.from_config(cfg))] + extra)


def predict(layout, hw):
    cfg = Config(**{**SETTINGS, **layout})
    return plan.step_time(cfg.model_config(), planner.Layout.from_config(cfg), cfg.seq_len, hw, dtype="fp32",
                          recipe="ours")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    ap.add_argument("--steps", type=int, default=7, help="steps per run; the first two are dropped")
    ap.add_argument("--rounds", type=int, default=3, help="times each layout runs (the median is kept)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    peak = run_on_ranks(_peak_child, 1, init_group=False, timeout_s=300)[0]
    peak2 = float(np.mean(run_on_ranks(_peak_child, 2, init_group=False, timeout_s=300)))
    link = measure_link()
    print(f"matmul peak on one thread {peak / 1e9:.1f} GFLOP/s alone, {peak2 / 1e9:.1f} beside a second process; "
          f"gloo between two processes: alpha {link['alpha'] * 1e6:.0f} us, {link['bw'] / 1e9:.2f} GB/s", flush=True)
    runs = [[] for _ in LAYOUTS]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for i, layout in enumerate(LAYOUTS):
                runs[i].append(measure(layout, os.path.join(tmp, f"{r}-{i}"), args.steps))
                print(f"round {r + 1}: {json.dumps(layout):62s} {runs[i][-1]:.3f} s", flush=True)
    measured = [float(np.median(x)) for x in runs]
    raw = plan.cpu_hardware(peak, link["alpha"], link["bw"], cores=2)
    efficiency = predict(LAYOUTS[0], raw)["total"] / measured[0]  # the one free number, from one process alone
    # each layout's 'GPU' is a core as it runs: alone for one process, beside the other core's process for two
    hardware = {n: plan.cpu_hardware(pk, link["alpha"], link["bw"], cores=2, efficiency=efficiency)
                for n, pk in ((1, peak), (2, peak2))}
    rows = []
    for layout, m, x in zip(LAYOUTS, measured, runs):
        cfg = Config(**{**SETTINGS, **layout})
        p = predict(layout, hardware[cfg.world_size])
        rows.append(dict(layout=layout, name=name_of(layout), processes=cfg.world_size,
                         measured=m, rounds=x, predicted=p["total"], ratio=p["total"] / m,
                         parts={k: p[k] for k in ("compute", "tp", "cp", "pp", "bubble", "dp")}))
        print(f"{rows[-1]['name']:40s} {cfg.world_size} procs  measured {m:.3f} s  predicted {p['total']:.3f} s  "
              f"ratio {p['total'] / m:.2f}", flush=True)
    two = [r for r in rows if r["processes"] == 2]
    rho = spearman([r["predicted"] for r in rows], [r["measured"] for r in rows])
    rho2 = spearman([r["predicted"] for r in two], [r["measured"] for r in two])
    # the measurement's own repeatability: how well one round ranks the layouts as another does
    pairs = [(a, b) for a in range(args.rounds) for b in range(a + 1, args.rounds)]
    between = [spearman([x[a] for x in runs], [x[b] for x in runs]) for a, b in pairs]
    print(f"{len(rows)} layouts in {time.perf_counter() - t0:.0f} s; efficiency fitted on one process "
          f"{efficiency:.2f}; Spearman rank correlation {rho:.2f} over all, {rho2:.2f} over the {len(two)} two-process "
          f"layouts; predicted/measured {min(r['ratio'] for r in rows):.2f} to {max(r['ratio'] for r in rows):.2f}; "
          f"one round against another: Spearman " + ", ".join(f"{x:.2f}" for x in between))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": SETTINGS, "peak": peak, "peak_beside": peak2, "link": link, "efficiency": efficiency, "spearman": rho,
                       "spearman_two_process": rho2, "spearman_between_rounds": between, "steps": args.steps, "rounds": args.rounds, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
