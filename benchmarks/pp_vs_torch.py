"""Our pipeline parallelism against torch's `torch.distributed.pipelining`, schedule by schedule, in one run.

    torchrun --nproc_per_node P benchmarks/pp_vs_torch.py [--steps 20] [--warmup 3] [--size small]
             [--num-hidden-layers 8] [--seq-len 128] [--micro-batch-size 4] [--micro-batches 8]
             [--schedules afab,1f1b,interleaved,zb-h1,zb-v]

P = the number of pipeline ranks (2 or 4). Each of our schedules faces torch's matching one:

    afab              ScheduleGPipe
    1f1b              Schedule1F1B
    interleaved (v=2) ScheduleInterleaved1F1B            (chunk c of rank r is stage c·P + r on both sides)
    zb-h1             ScheduleInterleavedZeroBubble with ONE stage per rank (torch's ZB1P: at v=1 it is ZB-H1,
                      1F1B's order with the backward split into input and weight gradients, W's in the cool-down)
    zb-v              ScheduleZBVZeroBubble               (V placement on both sides: rank r holds stages r and
                      2P-1-r)

Same model split on both sides: torch's `PipelineStage`s wrap this rank's chunks of our own Llama, built by
`parallelize.build_model` for the same schedule (so the same `split_layers` ranges, the same initial weights,
embedding on the first stage, norm and LM head on the last, plain nn.Linear layers without our weight-gradient
store); a stage's forward takes token ids (first stage) or hidden states and the last gives logits. Same
micro-batches (ours get the m micro-batches of the step, torch's schedule their concatenation, which it cuts
back into the same m along the batch dimension), same loss (`model.loss_fn`, the mean cross-entropy of a
micro-batch; torch averages over the micro-batches by scaling the gradients by 1/m, we divide each loss by m),
the global-batch loss handed to every rank on both sides, then on both sides the same global-norm clipping
(`marks.clip_grad_norm`), the same AdamW (`parallelize.build_optimizer`), `optimizer.step()`, `zero_grad()`.
Our side is exactly picotron.train's step (`parallelize(cfg, mesh)` then `run.schedule.run`); torch's schedule
is asked for no merged outputs (`return_outputs=False`).

Before timing, each pair runs one step from the same weights and the script prints both first-step losses
and gradient norms (fp32: the relative difference must be <= 1e-5, or the script stops), and at the end both
losses after the timed steps. Timing: one step of each variant in turn, the order rotating, a barrier before
every step; a step's time is the slowest rank's; printed: each side's median step time and the median of the
paired ratios (torch's step time / ours = our throughput relative to torch's) with its quartiles.

Point-to-point traffic: a metrics.Recorder on the mesh counts the bytes our executor sends (its messages go
through the pipeline links' Axis.exchange; one step, summed over ranks), printed next to the formula 2·(S-1)·m·b·s·h·4 bytes (S stages
= P·v; activations forward, their gradients backward, fp32). With the V shape one boundary (stage P-1 -> P)
stays on one rank, handed over in memory: there we send 2·(S-2)·m·b·s·h·4.
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
from _common import SIZES, make_cfg, tokens  # noqa: E402  (the lessons' models and corpus; puts ROOT on sys.path)
from benchmarks import _smoke  # noqa: E402  (--smoke, the test's size; a package import: lessons import these scripts)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from picotron import compat, data, data_parallel, marks, metrics, pipeline_schedules  # noqa: E402
from picotron.mesh import Mesh  # noqa: E402
from picotron.model import loss_fn  # noqa: E402
from picotron.parallelize import build_model, build_optimizer, parallelize  # noqa: E402

# our schedule -> (torch's schedule class name, chunks per rank, what the pairing is)
PAIRS = {"afab": ("ScheduleGPipe", 1, "GPipe"),
         "1f1b": ("Schedule1F1B", 1, "1F1B"),
         "interleaved": ("ScheduleInterleaved1F1B", 2, "interleaved 1F1B, v=2"),
         "zb-h1": ("ScheduleInterleavedZeroBubble", 1, "torch's ZB1P at one stage per rank = ZB-H1"),
         "zb-v": ("ScheduleZBVZeroBubble", 2, "ZB-V, V placement")}


def schedule_cfg(base, name, m):
    """`base` with pipeline schedule `name` over m micro-batches (interleaved: 2 chunks per rank)."""
    return dataclasses.replace(base, pp_schedule=name, pp_chunks=PAIRS[name][1] if name == "interleaved" else 1,
                               grad_acc=m)


class Variant:
    """One pipelined copy of the model with its optimizer: "ours" (`parallelize`: our schedule run by
    `pipeline_parallel.Pipeline`) or "torch" (this rank's chunks of the same split, each a torch `PipelineStage`,
    run by torch's matching schedule). `.step(step)` -> the global-batch loss (the same on every rank)."""

    def __init__(self, name, cfg, mesh):
        self.name, self.cfg, self.mesh = name, cfg, mesh
        if name == "ours":
            self.sent = metrics.Recorder()  # counts the executor's messages (and the few collectives: not read)
            self.run = parallelize(cfg, mesh, recorder=self.sent)
            self.model, self.optimizer, self.params = self.run.model, self.run.optimizer, self.run.params
            self._step = self._ours
        elif name == "torch":
            self._build_torch(cfg, mesh)
            self._step = self._torch
        else:
            raise ValueError(name)
        self.loader = data.DataLoader(tokens(), seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size,
                                      grad_acc=cfg.grad_acc, dp_size=1, dp_rank=0, seed=cfg.seed)
        self.times, self.p2p, self.grad_norm = [], [], None

    def _build_torch(self, cfg, mesh):
        from torch.distributed import pipelining

        # the same chunks our side holds (same layer ranges, stage placement and initial weights), plain layers
        self.model = build_model(cfg, mesh)
        plan = pipeline_schedules.build(cfg.pp_schedule, mesh.pp.size, cfg.grad_acc,
                                        pipeline_schedules.chunks_of(cfg.pp_schedule, cfg.pp_chunks))
        self.plan = plan
        stages = [pipelining.PipelineStage(chunk, s, plan.stages, mesh.device, group=mesh.pp.group)
                  for chunk, s in zip(self.model.chunks, self.model.stage_ids)]
        cls = getattr(pipelining, PAIRS[cfg.pp_schedule][0])
        self.schedule = cls(stages if issubclass(cls, pipelining.schedules.PipelineScheduleMulti) else stages[0],
                            n_microbatches=cfg.grad_acc, loss_fn=loss_fn)
        self.has_last = plan.where(plan.stages - 1)[0] == mesh.pp.rank
        # the rule our wrappers apply (weight decay on matrices only), read off the same protocol
        self.optimizer = build_optimizer(data_parallel.Local(self.model).optimizer_groups(), cfg, mesh.device)
        self.params = list(self.model.parameters())

    def _ours(self, batches):
        """picotron.train's step, up to the optimizer: the schedule (forward, loss, backward), then clipping."""
        self.sent.reset()
        loss = self.run.schedule.run(self.model, batches, self.run.loss_fn)
        self.p2p.append(self.sent.bytes.get("send", 0))
        self.grad_norm = marks.clip_grad_norm(self.params, self.cfg.grad_clip, self.mesh)
        return loss

    def _torch(self, batches):
        x = torch.cat([b[0] for b in batches]).to(self.mesh.device)  # torch's schedule cuts it into the same m
        y = torch.cat([b[1] for b in batches]).to(self.mesh.device)
        losses = []
        self.schedule.step(x, target=y, losses=losses, return_outputs=False)
        loss = torch.stack(losses).mean().detach() if self.has_last else torch.zeros((), device=self.mesh.device)
        self.mesh.pp.broadcast(loss, index=self.plan.where(self.plan.stages - 1)[0])  # every rank has it (as ours)
        self.grad_norm = marks.clip_grad_norm(self.params, self.cfg.grad_clip, self.mesh)
        return loss

    def step(self, step, record=True):
        batches = self.loader.micro_batches(step)
        metrics.sync(self.mesh.device)
        t0 = time.perf_counter()
        loss = self._step(batches)
        self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        value = loss.item()
        metrics.sync(self.mesh.device)
        if record:
            self.times.append(time.perf_counter() - t0)
        return value


def check_first_step(variants, mesh, tol=1e-5):
    """One step of each from the same weights: (loss, grad norm) per variant; raises if they differ."""
    got = {}
    for v in variants:
        dist.barrier(mesh.pp.group)
        got[v.name] = (v.step(1, record=False), v.grad_norm)
    (l0, g0), (l1, g1) = got["ours"], got["torch"]
    rel = max(abs(l1 - l0) / abs(l0), abs(g1 - g0) / abs(g0))
    if rel > tol:
        raise SystemExit(f"first step differs: ours loss {l0!r} grad norm {g0!r}, torch's loss {l1!r} grad norm "
                         f"{g1!r} (relative {rel:.2e} > {tol})")
    return got, rel


def compare(cfg, mesh, steps, warmup):
    """First-step agreement, then interleaved timed steps of ours and torch's: one dict per variant."""
    variants = [Variant("ours", cfg, mesh), Variant("torch", cfg, mesh)]
    first, rel = check_first_step(variants, mesh)
    losses = {v.name: [] for v in variants}
    for s in range(warmup + steps):
        k = s % len(variants)
        for v in variants[k:] + variants[:k]:
            dist.barrier(mesh.pp.group)
            losses[v.name].append(v.step(s + 2, record=s >= warmup))
    rows = []
    for v in variants:
        t = torch.tensor(v.times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.pp.group)
        p2p = torch.tensor(v.p2p[-1] if v.p2p else 0, dtype=torch.float64)
        dist.all_reduce(p2p, group=mesh.pp.group)  # summed over ranks
        rows.append(dict(name=v.name, step_times=t.tolist(), median=statistics.median(t.tolist()),
                         first=first[v.name], losses=losses[v.name], p2p=int(p2p.item())))
    return rows, rel


def paired(rows):
    """Per round: torch's time / ours (our throughput relative to torch's): median and quartiles."""
    ours, other = rows[0]["step_times"], rows[1]["step_times"]
    r = [o2 / o1 for o1, o2 in zip(ours, other)]
    q = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
    return statistics.median(r), q[0], q[2]


def p2p_formula(cfg, p):
    """2·(S-1)·m·b·s·h·4 bytes per step, summed over ranks (S = p·v stages)."""
    v = pipeline_schedules.chunks_of(cfg.pp_schedule, cfg.pp_chunks)
    h = cfg.model_config().hidden_size
    return 2 * (p * v - 1) * cfg.grad_acc * cfg.micro_batch_size * cfg.seq_len * h * 4


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="timed rounds per schedule")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--size", default="small", choices=list(SIZES))
    p.add_argument("--num-hidden-layers", type=int, default=8, help="P stages x 2 chunks need 2P layers")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8, help="m, the micro-batches of a step (--grad-acc)")
    p.add_argument("--schedules", default=",".join(PAIRS), help=f"comma-separated subset of {','.join(PAIRS)}")
    args, tiny = _smoke.parse(p, num_hidden_layers=4, seq_len=16, micro_batch_size=1, micro_batches=4)  # 2P layers
    if compat.missing("pipelining"):  # a comparison with a torch feature newer than picotron's floor
        sys.exit(compat.missing("pipelining"))
    names = args.schedules.split(",")
    if any(n not in PAIRS for n in names):
        p.error(f"--schedules {args.schedules!r}: pick a comma-separated subset of {','.join(PAIRS)}")
    pp = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = Mesh.init(pp=pp)
    base = make_cfg(args.size, **tiny, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size, pp=pp,
                    num_hidden_layers=args.num_hidden_layers)
    threads = torch.get_num_threads()
    with mesh:  # on success every rank meets at a barrier before the groups go (Mesh.destroy)
        for name in names:
            cfg = schedule_cfg(base, name, args.micro_batches)
            t0 = time.perf_counter()
            rows, rel = compare(cfg, mesh, args.steps, args.warmup)
            if mesh.rank == 0:
                med, q1, q3 = paired(rows)
                mc = cfg.model_config()
                v = pipeline_schedules.chunks_of(name, cfg.pp_chunks)
                cuts = pipeline_schedules.split_layers(mc, pp * v, cfg.seq_len)
                print(f"PP {name} vs torch {PAIRS[name][0]} ({PAIRS[name][2]}), {pp} ranks x {v} chunk"
                      f"{'s' if v > 1 else ''} ({mesh.device.type}/{mesh.backend}, {threads} thread"
                      f"{'s' if threads > 1 else ''} per rank), {args.steps} rounds, model {args.size} "
                      f"{mc.num_hidden_layers} layers ({mc.num_params() / 1e6:.1f} M) split {cuts}, "
                      f"m={cfg.grad_acc} x {cfg.micro_batch_size}x{cfg.seq_len} tokens, "
                      f"{time.perf_counter() - t0:.0f} s:")
                (l0, g0), (l1, g1) = rows[0]["first"], rows[1]["first"]
                print(f"  first step: loss ours {l0:.7f} torch {l1:.7f} | grad norm ours {g0:.7f} torch {g1:.7f} | "
                      f"max relative difference {rel:.1e}; loss after {len(rows[0]['losses']) + 1} steps: ours "
                      f"{rows[0]['losses'][-1]:.5f} torch {rows[1]['losses'][-1]:.5f}")
                for r in rows:
                    print(f"  {r['name']:<6} {1e3 * r['median']:8.2f} ms/step")
                form = p2p_formula(cfg, pp)
                note = " (V: one boundary in memory, 2·(S-2)·m·b·s·h·4 = " \
                       f"{form * (pp * v - 2) // (pp * v - 1) / 2**20:.2f} MiB)" if name == "zb-v" else ""
                print(f"  our p2p bytes per step, all ranks: {rows[0]['p2p'] / 2**20:.2f} MiB counted, formula "
                      f"2·(S-1)·m·b·s·h·4 = {form / 2**20:.2f} MiB{note}")
                print(f"  our throughput / torch's: median {med:.3f} (quartiles {q1:.3f}-{q3:.3f})", flush=True)


if __name__ == "__main__":
    main()
