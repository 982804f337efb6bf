"""Our tensor parallelism against torch's DTensor tensor parallelism (`torch.distributed.tensor.parallel`),
side by side in one run.

    torchrun --nproc_per_node 2 benchmarks/tp_vs_dtensor.py [--steps 60] [--size small] [--seq-len 64]
             [--micro-batch-size 2] [--sp]
    python benchmarks/tp_vs_dtensor.py --memory          # each alone on 2 fresh ranks: peak memory

Same model (identical weights: both start from the same full initialisation), same batches, same AdamW and
global-norm clipping, the same Megatron layout on both sides: q, k, v, gate and up column-parallel, o and down
row-parallel, the embedding split over the vocabulary, the LM head's logits left split over the vocabulary
and a vocabulary-parallel cross-entropy (ours: `tensor_parallel.loss_fn`; DTensor's: `loss_parallel()`).
With `--sp` both also run sequence parallelism (DTensor: `SequenceParallel` on the norms, the layer inputs
re-laid out by `PrepareModuleInput`). Our side is what picotron.train runs: `parallelize(cfg, mesh)`, then per
step `schedule.run`, `marks.clip_grad_norm`, `optimizer.step()`, `zero_grad()`; DTensor's side is torch's
own, with the same AdamW settings (`parallelize.build_optimizer`).

One step of each variant in turn, the order rotating, a barrier before every step; a step's time is the
slowest rank's; printed: the median of the paired ratios (DTensor's step time / ours = our throughput
relative to DTensor's) and its quartiles. Memory: the model states each rank keeps (local shards), and with
`--memory` the peak of the process's memory during a few steps above what it held before the model was built,
each variant alone in fresh processes (CPU: anonymous resident memory sampled every millisecond; GPU: the
allocator's peak).
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.zero_vs_fsdp import SIZES, RSSPeak, local_bytes, make_cfg, tokens  # noqa: E402  (same models, corpus)
from benchmarks import _smoke  # noqa: E402  (--smoke, the test's size)
from picotron import compat, data, data_parallel, marks, metrics  # noqa: E402
from picotron.config import Config  # noqa: E402
from picotron.mesh import Mesh  # noqa: E402
from picotron.model import Llama  # noqa: E402
from picotron.parallelize import build_optimizer, parallelize  # noqa: E402

def dtensor_model(cfg, mesh):
    """The unsharded Llama, initialised like ours, then sharded by torch's parallelize_module."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    with torch.device("meta"):
        model = Llama(cfg.model_config())
    model.to_empty(device=mesh.device)
    model.init_weights(cfg.seed)
    dmesh = DeviceMesh.from_group(mesh.tp.group, mesh.device.type)
    sp = cfg.sp
    seq = Shard(1)  # with sp the residual stream is split along the sequence
    for layer in model.layers:
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(output_layouts=seq if sp
                                                                                              else Replicate()),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=seq if sp else Replicate())}
        if sp:
            plan.update({"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
                         # attention(x, cos, sin): only x is laid out, all-gathered along the sequence
                         "self_attn": PrepareModuleInput(input_layouts=(seq, None, None), use_local_output=True,
                                                         desired_input_layouts=(Replicate(), None, None)),
                         "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                                   use_local_output=True)})
        parallelize_module(layer, dmesh, plan)
    top = {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sp else Replicate()),
           "lm_head": ColwiseParallel(input_layouts=seq if sp else Replicate(), output_layouts=Shard(-1),
                                      use_local_output=False)}
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, dmesh, top)
    return model


def dtensor_clip_grad_norm(params, max_norm):
    """Global-norm clipping of a model whose matrices are DTensors and whose norm weights are plain tensors (tp
    without sp): torch's clip_grad_norm_ refuses the mix, so the two groups are normed apart (one collective for
    the DTensors, as torchtitan does it), combined, and each group scaled by the same coefficient."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    square = torch.nn.utils.get_total_norm(sharded).full_tensor() ** 2
    if plain:
        square = square + torch.nn.utils.get_total_norm(plain) ** 2
    total = square.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(sharded, DTensor.from_local(coef, sharded[0].device_mesh, run_check=False))
    if plain:
        torch._foreach_mul_(plain, coef)
    return total


class Variant:
    """One tensor-parallel copy of the model with its optimizer: "ours" (picotron's seam, `parallelize`) or
    "dtensor" (torch's parallelize_module, with our AdamW settings). `.step(step)` -> the loss."""

    def __init__(self, name, cfg, mesh):
        self.name, self.cfg, self.mesh = name, cfg, mesh
        if name == "ours":
            self.run = parallelize(cfg, mesh)
            self.model, self.optimizer, self.params = self.run.model, self.run.optimizer, self.run.params
            self._step = self._ours
        elif name == "dtensor":
            self.model = dtensor_model(cfg, mesh)
            # the rule our wrappers apply (weight decay on matrices only), read off the same protocol
            self.optimizer = build_optimizer(data_parallel.Local(self.model).optimizer_groups(), cfg, mesh.device)
            self.params = list(self.model.parameters())
            self._step = self._dtensor
        else:
            raise ValueError(name)
        self.loader = data.DataLoader(tokens(), seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size,
                                      grad_acc=1, dp_size=mesh.dp.size, dp_rank=mesh.dp.rank, seed=cfg.seed)
        self.times, self.states = [], None

    def _ours(self, batches):
        """picotron.train's step, up to the optimizer: the schedule (forward, loss, backward), then clipping."""
        loss = self.run.schedule.run(self.model, batches, self.run.loss_fn)
        marks.clip_grad_norm(self.params, self.cfg.grad_clip, self.mesh)
        return loss

    def _dtensor(self, batches):
        from torch.distributed.tensor.parallel import loss_parallel

        (x, y, _positions), = batches  # one micro-batch
        x, y = x.to(self.mesh.device), y.to(self.mesh.device)
        logits = self.model(x)
        with loss_parallel():  # the backward of the parallel loss must run inside it too
            loss = F.cross_entropy(logits.flatten(0, 1), y.reshape(-1))
            loss.backward()
        dtensor_clip_grad_norm(self.params, self.cfg.grad_clip)
        return loss.full_tensor()

    def step(self, step, record=True):
        batches = self.loader.micro_batches(step)
        metrics.sync(self.mesh.device)
        t0 = time.perf_counter()
        loss = self._step(batches)
        states = {"params": local_bytes(self.params), "grads": local_bytes(p.grad for p in self.params)}
        self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        value = loss.item()
        metrics.sync(self.mesh.device)
        if record:
            self.times.append(time.perf_counter() - t0)
        states["optimizer"] = sum(local_bytes(v for v in s.values() if torch.is_tensor(v))
                                  for s in self.optimizer.state.values())
        self.states = states
        return value


def compare(cfg, mesh, steps, warmup=3):
    """Interleaved timed steps of ours and DTensor; one dict per variant (times are the slowest rank's)."""
    variants = [Variant("ours", cfg, mesh), Variant("dtensor", cfg, mesh)]
    losses = {v.name: [] for v in variants}
    for s in range(warmup + steps):
        k = s % len(variants)
        for v in variants[k:] + variants[:k]:
            dist.barrier(mesh.tp.group)
            losses[v.name].append(v.step(s + 1, record=s >= warmup))
    rows = []
    for v in variants:
        t = torch.tensor(v.times, dtype=torch.float64)
        mesh.tp.all_reduce(t, op=dist.ReduceOp.MAX)
        rows.append(dict(name=v.name, step_times=t.tolist(), median=statistics.median(t.tolist()),
                         states=v.states, losses=losses[v.name]))
    return rows


def paired(rows):
    """Per round: DTensor's time / ours (our throughput relative to DTensor's): median and quartiles."""
    ours, other = rows[0]["step_times"], rows[1]["step_times"]
    r = [o2 / o1 for o1, o2 in zip(ours, other)]
    q = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
    return statistics.median(r), q[0], q[2]


def memory_alone(name, cfg_dict, steps):
    """Child (run_on_ranks): one variant alone; bytes above the pre-model baseline at the peak."""
    cfg = Config(**cfg_dict)
    with Mesh.init(tp=cfg.tp) as mesh:
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


def memory_main(size="small", seq_len=64, micro_batch_size=2, tp=2, sp=False, steps=5):
    """From one process: each variant alone on tp fresh ranks; {name: {"peak", "states"}} of rank 0."""
    from picotron.launch import run_on_ranks
    cfg = make_cfg(size, seq_len=seq_len, micro_batch_size=micro_batch_size, tp=tp, sp=sp).to_dict()
    return {name: run_on_ranks(memory_alone, tp, name, cfg, steps, timeout_s=300)[0] for name in ("ours", "dtensor")}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="timed rounds")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--size", default="small", choices=list(SIZES))
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--sp", action="store_true", help="sequence parallelism on both sides")
    p.add_argument("--memory", action="store_true", help="(one process) each variant alone: peak memory")
    args, tiny = _smoke.parse(p, seq_len=16, micro_batch_size=1)
    if compat.missing("dtensor_tp"):  # a comparison with a torch feature newer than picotron's floor
        sys.exit(compat.missing("dtensor_tp"))
    if args.memory:
        for name, r in memory_main(args.size, args.seq_len, args.micro_batch_size, sp=args.sp).items():
            print(f"{name:<8} peak above baseline {r['peak'] / 2**20:7.2f} MiB | model states "
                  + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in r["states"].items()))
        return
    mesh = Mesh.init(tp=int(os.environ.get("WORLD_SIZE", "1")))
    cfg = make_cfg(args.size, **tiny, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size, tp=mesh.tp.size,
                   sp=args.sp)
    with mesh:  # a normal end waits for every rank before the groups go (Mesh.__exit__)
        t0 = time.perf_counter()
        rows = compare(cfg, mesh, args.steps, args.warmup)
        if mesh.rank == 0:
            med, q1, q3 = paired(rows)
            print(f"TP{' + SP' if args.sp else ''} ours vs DTensor, {mesh.world_size} ranks ({mesh.device.type}/"
                  f"{mesh.backend}), {args.steps} rounds, model {args.size} "
                  f"({cfg.model_config().num_params() / 1e6:.1f} M), {args.micro_batch_size}x{args.seq_len} tokens, "
                  f"{time.perf_counter() - t0:.0f} s:")
            for r in rows:
                st = r["states"]
                print(f"  {r['name']:<8} {1e3 * r['median']:7.2f} ms/step | model states per rank: params "
                      f"{st['params'] / 2**20:.2f} MiB, grads {st['grads'] / 2**20:.2f} MiB, optimizer "
                      f"{st['optimizer'] / 2**20:.2f} MiB | losses {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
            print(f"  our throughput / DTensor's: median {med:.3f} (quartiles {q1:.3f}-{q3:.3f})", flush=True)


if __name__ == "__main__":
    main()
