"""Our bucketed DataParallel against torch's DistributedDataParallel, side by side in one run.

    torchrun --nproc_per_node 2 benchmarks/dp_vs_ddp.py [--steps 200] [--bucket-mb 1,25] [--size small]
             [--seq-len 64] [--micro-batch-size 2]

Same model (identical weights), same bucket size, same batches. One step of each variant in turn, the order
rotating, a barrier before every step (lessons/03_data_parallel/experiment.py's `run_interleaved`), so drift of the machine
hits all alike. Each round gives a paired ratio (DDP's step time / the variant's = the variant's throughput
relative to DDP); we print the median with its quartiles. A step's time is the slowest rank's.

Variants: "ours" (picotron.data_parallel.DataParallel as it is), "ours, post-divide" (the same, but the bucket is
divided by n after its all-reduce has completed, in finish_sync, instead of before it is sent, in the
backward hook: a candidate fix; on 2 CPU ranks it made no measurable difference), and "ddp"
(DistributedDataParallel, gradient_as_bucket_view=True). Only the ratios mean anything; the absolute times depend
on the machine and its load.

Measured on a 2-core CPU (gloo, no other job running), 300 rounds, small model, 2x64 tokens per rank:
    bucket  1 MiB: ours 0.968 (quartiles 0.916-1.027), ours post-divide 0.966 (0.906-1.037) of DDP's throughput
    bucket 25 MiB: ours 0.979 (0.919-1.034),            ours post-divide 0.974 (0.926-1.030)
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lessons"))
import _common  # noqa: E402
from benchmarks import _smoke  # noqa: E402  (--smoke, the test's size; a package import: lessons import these scripts)

import torch.distributed as dist  # noqa: E402

from picotron import data_parallel  # noqa: E402
from picotron.mesh import Mesh  # noqa: E402

lesson = _common.load_lesson("03_data_parallel")


class PostDivide(data_parallel.DataParallel):
    """DataParallel with the division by n moved from before the all-reduce to after it has completed."""

    def _hook(self, p):
        bucket = self.bucket_of[p]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            bucket.ready = 0
            if self.sync:
                bucket.work = self.axis.all_reduce(bucket.buffer, async_op=True,
                                                   label=f"all-reduce bucket {bucket.index}")

    def finish_sync(self):
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
                bucket.buffer.div_(self.axis.size)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="timed rounds")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-mb", default="1,25")
    p.add_argument("--size", default="small", choices=list(_common.SIZES))
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=2)
    args, tiny = _smoke.parse(p, seq_len=16, micro_batch_size=1, bucket_mb="1")
    import os

    mesh = Mesh.init(dp=int(os.environ.get("WORLD_SIZE", "1")))
    cfg = _common.make_cfg(args.size, **tiny, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size, dp=mesh.dp.size)
    with mesh:  # on success every rank meets at a barrier before the groups go (Mesh.destroy)
        for mb in (float(x) for x in args.bucket_mb.split(",")):
            ours = lesson.Variant("ours", cfg, mesh, "bucket", mb, record_comm=False)
            post = lesson.Variant("ours, post-divide", cfg, mesh, "bucket", mb, record_comm=False,
                                  make_wrapper=lambda raw, axis: PostDivide(raw, axis, bucket_mb=mb))
            ddp = lesson.Variant("ddp", cfg, mesh, "ddp", mb, record_comm=False)
            variants = [ours, post, ddp]
            dist.barrier()
            t0 = time.perf_counter()
            lesson.run_interleaved(variants, args.steps, args.warmup, mesh.dp_cp.group)
            rows = lesson.summarise(variants, mesh, 1)
            if mesh.rank == 0:
                ref = rows[-1]["step_times"]
                print(f"bucket {mb:g} MiB, {mesh.world_size} ranks, {args.steps} rounds, model {args.size} "
                      f"({cfg.model_config().num_params() / 1e6:.1f} M), {args.micro_batch_size}x{args.seq_len} tokens "
                      f"per rank, {time.perf_counter() - t0:.0f} s:")
                for r in rows:
                    paired = [d / o for o, d in zip(r["step_times"], ref)]
                    q = statistics.quantiles(paired, n=4)
                    print(f"  {r['name']:<18} {1e3 * r['median']:7.2f} ms/step | throughput / DDP's: median "
                          f"{statistics.median(paired):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})", flush=True)
            del variants, ours, post, ddp


if __name__ == "__main__":
    main()
