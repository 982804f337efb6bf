"""The planner's memory model against measurement: `python benchmarks/planner_memory.py [--out FILE.json]`.

Each layout below trains one step of a small model on CPU processes (gloo, one thread each); every rank reports the
bytes the trainer accounts at the step's end (`mem` in metrics.jsonl: parameters, gradients, optimizer state, the
activations autograd kept at the schedule's peak). `planner.memory_per_stage(...)[its stage]` predicts them. The
table: per layout the worst rank's total ratio, and the predicted vs measured parts of that rank. Expert layouts
depend on the routing (how many rows each rank receives); the planner assumes balanced experts.
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from picotron import planner  # noqa: E402
from picotron.config import Config  # noqa: E402
from picotron.launch import run_on_ranks  # noqa: E402

SETTINGS = dict(seq_len=64, micro_batch_size=2, sample_tokens=0, log_every=1000, eval_every=0, steps=1, warmup_steps=1)
PARTS = ("params", "grads", "optimizer", "activations")
LAYOUTS = [
    {}, {"dp": 2}, {"tp": 2}, {"tp": 2, "sp": True}, {"tp": 4}, {"tp": 4, "sp": True}, {"cp": 2}, {"cp": 4},
    {"cp": 2, "cp_impl": "allgather"}, {"cp": 2, "cp_layout": "contiguous"},
    {"pp": 2, "grad_acc": 4}, {"pp": 2, "grad_acc": 4, "pp_schedule": "afab"}, {"pp": 4, "grad_acc": 8},
    {"pp": 2, "grad_acc": 4, "pp_schedule": "interleaved", "pp_chunks": 2}, {"pp": 2, "grad_acc": 4, "pp_schedule": "zb-h1"},
    {"pp": 2, "grad_acc": 4, "pp_schedule": "zb-v"},
    {"dp": 2, "zero": 1}, {"dp": 2, "zero": 2}, {"dp": 2, "zero": 3}, {"dp": 4, "zero": 3},
    {"recompute": "full"}, {"recompute": "selective"}, {"micro_batch_size": 8}, {"seq_len": 256},
    {"dp": 2, "tp": 2, "pp": 2, "grad_acc": 2}, {"dp": 2, "cp": 2, "tp": 2, "sp": True, "zero": 1},
    {"pp": 2, "cp": 2, "tp": 2, "grad_acc": 2},
    {"preset": "tiny-moe"}, {"preset": "tiny-moe", "dp": 2, "ep": 2}, {"preset": "tiny-moe", "tp": 2},
]


def _runs(layout):
    """Whether picotron's trainer takes this layout (parallelize's rules; the names it knows: picotron.config)."""
    from picotron import config, parallelize
    cfg = Config(**{**SETTINGS, **layout})
    known = cfg.pp_schedule in config.PP_SCHEDULES and cfg.cp_impl in config.CP_IMPLS
    return known and parallelize.combination_problem(cfg, cfg.model_config()) is None


# Measured once the trainer has them: Ulysses (the planner: + o_proj's input and repeated KV heads), DualPipe (two
# stages per rank, p + 1 stage activations), partitioned checkpoints. Not ZeRO-2 or ZeRO-3 with a pipeline: the
# planner counts what the stage holds at its peak during the step (ZeRO-2/3: the whole gradients between a chunk's
# first and last backward; ZeRO-3: also the stage's parameters gathered), which the trainer's end-of-step accounting
# does not see (freed by then); tests/test_planner_memory.py and lesson 04 measure that peak.
LAYOUTS += [lay for lay in ({"cp": 2, "cp_impl": "ulysses"}, {"pp": 4, "grad_acc": 8, "pp_schedule": "dualpipe"},
                            {"tp": 2, "recompute": "partitioned"})
            if _runs(lay)]


def _child(layout, out):
    stage, mem = last_mem(layout, out)
    return stage, {k: mem[k] for k in PARTS}


def last_mem(layout, out):
    """In each rank: train SETTINGS + `layout`, then (pp stage, this rank's last `mem` record, whole)."""
    from picotron import metrics
    from picotron.mesh import Mesh
    from picotron.train import train
    cfg = Config(out=out, **{**SETTINGS, **layout})
    records = []
    write = metrics.MetricsLog.write

    def keep(self, record):
        records.append(record)
        return write(self, record)

    metrics.MetricsLog.write = keep  # every rank's record, not only rank 0's file
    with Mesh.init(dp=cfg.dp, pp=cfg.pp, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep) as mesh:
        train(cfg, mesh)
        return mesh.pp.rank, records[-1]["mem"]


def measure(layout, folder):
    """[(stage, {part: bytes})] of every rank, and the planner's per-stage prediction."""
    cfg = Config(**{**SETTINGS, **layout})
    ranks = run_on_ranks(_child, cfg.world_size, layout, folder, timeout_s=600)
    return ranks, planner.memory_per_stage(cfg.model_config(), planner.Layout.from_config(cfg), cfg.seq_len, cfg.dtype)


def compare(layout, ranks, predicted):
    worst = None
    for stage, measured in ranks:
        total = sum(measured.values())
        ratio = predicted[stage]["total"] / total
        if worst is None or abs(ratio - 1) > abs(worst["ratio"] - 1):
            worst = dict(stage=stage, ratio=ratio, measured=measured, predicted={k: predicted[stage][k] for k in PARTS})
    return dict(layout=layout, processes=len(ranks), **worst)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args()
    rows, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, layout in enumerate(LAYOUTS):
            row = compare(layout, *measure(layout, os.path.join(tmp, str(i))))
            rows.append(row)
            parts = " ".join(f"{k[:3]} {row['measured'][k] / 2**20:.2f}/{row['predicted'][k] / 2**20:.2f}" for k in PARTS)
            print(f"{json.dumps(layout):72s} {row['processes']:2d} procs  predicted/measured total {row['ratio']:.3f}  "
                  f"(MiB measured/predicted: {parts})", flush=True)
    dense = [r for r in rows if r["layout"].get("preset") != "tiny-moe"]
    print(f"{len(rows)} layouts ({len(dense)} dense) in {time.perf_counter() - t0:.0f} s; worst total ratio, dense: "
          f"{max(abs(r['ratio'] - 1) for r in dense):.1%}; with experts: {max(abs(r['ratio'] - 1) for r in rows):.1%}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": SETTINGS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
