"""Our ZeRO-3 against torch's FSDP2 (`torch.distributed.fsdp.fully_shard`), side by side in one run.

    torchrun --nproc_per_node 2 benchmarks/zero_vs_fsdp.py [--steps 60] [--size small] [--seq-len 64]
             [--micro-batch-size 2] [--memory]

Same model (identical weights), same batches, same AdamW and clipping, both sharding each transformer layer
and the root (embedding, final norm, LM head) separately, both reshard after forward and prefetch the next
layer. Ours is what `parallelize` builds for --zero 3; FSDP2 sits behind the same gradient-sync protocol, so
one step engine (`schedule.OneStage.run`) drives both, then clipping, the optimizer step, zero_grad. One step of each variant in turn, the order rotating, a barrier before every step, so drift of the
machine hits all alike; a step's time is the slowest rank's; we print the median of the paired ratios
(FSDP2's step time / ours = our throughput relative to FSDP2) with its quartiles.

Memory per rank, two ways: the model states each keeps between steps (parameters, gradients and optimizer
state; their sharded bytes), and the peak of the process's memory during the steps above what it held
before the model was built (on a GPU: the allocator's peak; on a CPU: anonymous resident memory sampled
every millisecond, each variant alone in fresh processes, `--memory`).
"""
import argparse
import dataclasses
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lessons"))
from _common import SIZES, make_cfg, tokens  # noqa: E402,F401  (the lessons' models and corpus; puts ROOT on sys.path)
from benchmarks import _smoke  # noqa: E402  (--smoke, the test's size; a package import: lessons import these scripts)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from picotron import compat, data, data_parallel, marks, metrics, schedule  # noqa: E402
from picotron.config import Config  # noqa: E402
from picotron.mesh import Mesh  # noqa: E402
from picotron.model import loss_fn  # noqa: E402
from picotron.parallelize import autocast_for, build_model, build_optimizer, parallelize  # noqa: E402

class FSDP2(data_parallel.GradSync):
    """torch's FSDP2 behind our gradient-sync protocol (as data_parallel.TorchDDP is torch's DDP): `fully_shard` on
    every transformer layer and on the root, the units of our ZeRO-3. FSDP2 reduce-scatters inside backward and
    waits for it at the end of backward, so `finish_sync` has nothing to do; `memory` counts each DTensor's local
    shard (what this rank keeps)."""

    def __init__(self, module, axis):
        super().__init__(module)
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
        dmesh = DeviceMesh.from_group(axis.group, next(module.parameters()).device.type)
        for layer in module.layers:
            fully_shard(layer, mesh=dmesh)
        fully_shard(module, mesh=dmesh)

    def memory(self):
        params = list(self.module.parameters())
        return {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params)}


class Variant:
    """One sharded copy of the model with its optimizer: "ours" (`parallelize` with --zero 3) or "fsdp2"."""

    def __init__(self, name, cfg, mesh):
        self.name, self.cfg, self.mesh = name, cfg, mesh
        if name == "ours":
            run = parallelize(dataclasses.replace(cfg, zero=3), mesh)
            self.model, self.optimizer, self.schedule, self.loss_fn = run.model, run.optimizer, run.schedule, run.loss_fn
            self.clip = lambda: marks.clip_grad_norm(run.params, cfg.grad_clip, mesh)  # our pieces carry their marks
        elif name == "fsdp2":
            raw = build_model(cfg, mesh)
            self.model = FSDP2(raw, mesh.dp_cp)
            self.optimizer = build_optimizer(self.model.optimizer_groups(), cfg, mesh.device)
            self.schedule = schedule.OneStage(mesh.dp_cp, mesh.device, autocast_for(cfg, mesh.device))
            self.loss_fn = loss_fn
            self.clip = lambda: torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.grad_clip)  # DTensor-aware
        else:
            raise ValueError(name)
        self.loader = data.DataLoader(tokens(), seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size,
                                      grad_acc=1, dp_size=mesh.dp.size, dp_rank=mesh.dp.rank, seed=cfg.seed)
        self.times, self.states = [], None

    def step(self, step, record=True):
        batches = self.loader.micro_batches(step)
        metrics.sync(self.mesh.device)
        t0 = time.perf_counter()
        loss = self.schedule.run(self.model, batches, self.loss_fn)  # forward, backward, the gradient sync
        self.clip()
        states = self.model.memory()  # gradients still alive here
        self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        loss = loss.item()
        metrics.sync(self.mesh.device)
        if record:
            self.times.append(time.perf_counter() - t0)
        states["optimizer"] = sum(local_bytes(v for v in s.values() if torch.is_tensor(v))
                                  for s in self.optimizer.state.values())
        self.states = {k: states[k] for k in ("params", "grads", "optimizer")}
        return loss


def local_bytes(tensors):
    """Bytes this rank holds of each tensor (a DTensor's local shard)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def compare(cfg, mesh, steps, warmup=3):
    """Interleaved timed steps of ours and FSDP2; returns one dict per variant (times are the slowest rank's)."""
    variants = [Variant("ours", cfg, mesh), Variant("fsdp2", cfg, mesh)]
    losses = {v.name: [] for v in variants}
    for s in range(warmup + steps):
        k = s % len(variants)
        for v in variants[k:] + variants[:k]:
            dist.barrier(mesh.dp_cp.group)
            losses[v.name].append(v.step(s + 1, record=s >= warmup))
    rows = []
    for v in variants:
        t = torch.tensor(v.times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.dp_cp.group)
        rows.append(dict(name=v.name, step_times=t.tolist(), median=statistics.median(t.tolist()),
                         states=v.states, losses=losses[v.name]))
    return rows


def paired(rows):
    """Per round: FSDP2's time / ours (our throughput relative to FSDP2's): median and quartiles."""
    ours, fsdp = rows[0]["step_times"], rows[1]["step_times"]
    r = [f / o for o, f in zip(ours, fsdp)]
    q = statistics.quantiles(r, n=4)
    return statistics.median(r), q[0], q[2]


class RSSPeak:
    """Peak resident memory of this process, sampled every millisecond by a thread, above a baseline."""

    def __init__(self):
        self.base = self.peak = self.now()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    now = staticmethod(metrics.process_anon_rss_bytes)

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, self.now())
            time.sleep(0.001)

    def stop(self):
        self._stop = True
        self._thread.join()
        return self.peak - self.base


def memory_alone(name, cfg_dict, steps):
    """Child (run_on_ranks): one variant alone; bytes above the pre-model baseline at the peak."""
    cfg = Config(**cfg_dict)
    with Mesh.init(dp=cfg.dp) as mesh:
        tokens()
        metrics.malloc_returns_freed_memory()  # CPU: freed tensors leave the resident set (see metrics)
        if mesh.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            sampler = RSSPeak()
        v = Variant(name, cfg, mesh)
        for s in range(steps):
            v.step(s + 1)
        peak = torch.cuda.max_memory_allocated() - base if mesh.device.type == "cuda" else sampler.stop()
        return {"peak": peak, "states": v.states}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="timed rounds")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--size", default="small", choices=list(SIZES))
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--memory", action="store_true", help="also measure each variant's peak memory alone")
    args, tiny = _smoke.parse(p, seq_len=16, micro_batch_size=1)
    if compat.missing("fsdp2"):  # a comparison with a torch feature newer than picotron's floor
        sys.exit(compat.missing("fsdp2"))
    mesh = Mesh.init(dp=int(os.environ.get("WORLD_SIZE", "1")))
    cfg = make_cfg(args.size, **tiny, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size, dp=mesh.dp.size)
    with mesh:  # a normal end waits for every rank before the groups go (Mesh.__exit__)
        t0 = time.perf_counter()
        rows = compare(cfg, mesh, args.steps, args.warmup)
        if mesh.rank == 0:
            med, q1, q3 = paired(rows)
            print(f"ZeRO-3 vs FSDP2, {mesh.world_size} ranks ({mesh.device.type}/{mesh.backend}), {args.steps} rounds, "
                  f"model {args.size} ({cfg.model_config().num_params() / 1e6:.1f} M), "
                  f"{args.micro_batch_size}x{args.seq_len} tokens per rank, {time.perf_counter() - t0:.0f} s:")
            for r in rows:
                st = r["states"]
                print(f"  {r['name']:<6} {1e3 * r['median']:7.2f} ms/step | model states per rank: params "
                      f"{st['params'] / 2**20:.2f} MiB, grads {st['grads'] / 2**20:.2f} MiB, optimizer "
                      f"{st['optimizer'] / 2**20:.2f} MiB | loss after {len(r['losses'])} steps {r['losses'][-1]:.4f}")
            print(f"  our throughput / FSDP2's: median {med:.3f} (quartiles {q1:.3f}-{q3:.3f})", flush=True)
    if args.memory and int(os.environ.get("RANK", "0")) == 0:
        print("memory alone (run with --memory from a single process: python benchmarks/zero_vs_fsdp.py --memory)")


def memory_main(size="small", seq_len=64, micro_batch_size=2, dp=2, steps=5):
    """From one process: each variant alone on dp fresh ranks; {name: {"peak", "states"}} of rank 0."""
    from picotron.launch import run_on_ranks
    cfg = make_cfg(size, seq_len=seq_len, micro_batch_size=micro_batch_size, dp=dp).to_dict()
    return {name: run_on_ranks(memory_alone, dp, name, cfg, steps, timeout_s=300)[0] for name in ("ours", "fsdp2")}


if __name__ == "__main__":
    if "RANK" not in os.environ and "--memory" in sys.argv:
        for name, r in memory_main().items():
            print(f"{name:<6} peak above baseline {r['peak'] / 2**20:7.2f} MiB | model states "
                  + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in r["states"].items()))
    else:
        main()
