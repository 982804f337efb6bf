"""Expert parallelism's all-to-alls blocking against under compute (--ep-overlap), side by side in one run.

    torchrun --nproc_per_node 2 benchmarks/ep_overlap_bench.py [--steps 20] [--preset tiny-deepseek-moe]
             [--seq-len 64] [--micro-batch-size 8] [--link auto|none|BANDWIDTH,LATENCY]

The same model (identical weights), the same batches, dp = ep = the world size, built as picotron builds it
(lessons/08_expert_parallel/experiment.py's `OverlapVariant`: parallelize with the ep axis's all-to-alls on their own
emulated link, picotron.link, their waits timed). One step of each variant in turn, the order rotating, a barrier
before each (`run_interleaved`); each round gives a paired ratio, blocking's step time / overlapped's = the
overlapped throughput relative to blocking; we print its median with its quartiles, and each variant's median
exposed all-to-all time (the waits). A step's time is the slowest rank's.

--link auto (the default): a link on which one part's all-to-all takes about one part's experts' forward time
(`choose_ep_link`), where overlap has most to hide; none: gloo alone (on a CPU the "link" is the same two cores that
compute, so there is nothing to hide under: this shows the split's own cost).

Measured on a 2-core CPU shared with other jobs (gloo, tiny-deepseek-moe, 8x64 tokens per rank, 20 rounds): see the
lesson 08 section 10 and the closing note of issue 43; on a GPU the planner's model (python -m picotron.plan, layout
item 'ep-overlap') gives the prediction.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lessons"))
import _common  # noqa: E402
from benchmarks import _smoke  # noqa: E402  (--smoke, the test's size)

import torch.distributed as dist  # noqa: E402

from picotron.mesh import Mesh  # noqa: E402

lesson = _common.load_lesson("08_expert_parallel")


def round_times(variant, mesh):
    """Each timed round's step time, the slowest rank's."""
    mine = [s["end"] - s["start"] for s in variant.steps]
    every = lesson.gather(mine, mesh)
    return [max(times) for times in zip(*every)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="timed rounds")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--preset", default="tiny-deepseek-moe")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--link", default="auto", help="auto, none, or BANDWIDTH,LATENCY (bytes/s, s)")
    args, _ = _smoke.parse(p, seq_len=16, micro_batch_size=2)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = Mesh.init(dp=world, ep=world)
    st = dict(overlap_latency=2e-4, overlap_link_ratio=1.0)
    cfg = lesson.make_cfg(dict(preset=args.preset, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size),
                          dp=world, ep=world, steps=args.steps + args.warmup, warmup_steps=1, aux_loss_coef=0.01,
                          out=str(ROOT / "runs" / "benchmarks" / "ep_overlap"))
    with mesh:
        if args.link == "auto":
            link = lesson.choose_ep_link(cfg, mesh, st)
        elif args.link == "none":
            link = None
        else:
            link = tuple(float(x) for x in args.link.split(","))
        variants = [lesson.OverlapVariant(name, overlap, cfg, mesh, link)
                    for name, overlap in (("blocking", False), ("overlapped", True))]
        dist.barrier()
        t0 = time.perf_counter()
        others = lesson.run_interleaved(variants, args.steps, args.warmup, mesh.world.group)
        blocking, overlapped = (round_times(v, mesh) for v in variants)
        exposed = [statistics.median(lesson.gather(statistics.median(lesson.exposed(s) for s in v.steps), mesh))
                   for v in variants]
        if mesh.rank == 0:
            where = lesson.EmulatedLink(*link).label() if link else "no emulated link (gloo alone)"
            print(f"{args.preset}, dp = ep = {world}, {args.micro_batch_size}x{args.seq_len} tokens per rank, "
                  f"{args.steps} rounds, {where}, {time.perf_counter() - t0:.0f} s (other programs used "
                  f"{100 * (others or 0):.0f}% of the cores):")
            for name, times, waits in zip(("blocking", "overlapped"), (blocking, overlapped), exposed):
                print(f"  {name:<11} {1e3 * statistics.median(times):7.1f} ms/step, exposed all-to-all "
                      f"{1e3 * waits:6.1f} ms (median rank)")
            paired = [b / o for b, o in zip(blocking, overlapped)]
            q = statistics.quantiles(paired, n=4) if len(paired) > 1 else (paired[0], paired[0], paired[0])
            print(f"  overlapped throughput / blocking's: median {statistics.median(paired):.3f} "
                  f"(quartiles {q[0]:.3f}-{q[2]:.3f})", flush=True)


if __name__ == "__main__":
    main()
