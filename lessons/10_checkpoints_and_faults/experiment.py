"""Lesson 10's experiments: checkpoints and faults measured through picotron's own seams (`picotron.checkpoint`'s
Saver, load and consolidate, `picotron.train` with --faults and --max-restarts), and the lesson's formulas.

    torchrun --nproc_per_node 2 lessons/10_checkpoints_and_faults/experiment.py [--only cost,async,dcp,levels]
    torchrun --nproc_per_node 8 lessons/10_checkpoints_and_faults/experiment.py    # cost, async, dcp at 8 (layouts)
    PICOTRON_FAST=1 ...    # short settings (the notebook's FAST mode)

Rank 0 writes OUT/<name>.json. cost: for each model size and layout on 2 ranks, one training step, then a
synchronous save (every rank's bytes, the snapshot and the write time) and a load (time), the median of a few
rounds. async: the same training steps with no checkpoint, a synchronous one and an asynchronous one every few
steps, each step's time and each save's snapshot and write intervals (a timeline); in full mode two rounds in
opposite orders, each mode keeping its quicker one. dcp: our save and load against
`torch.distributed.checkpoint` saving and loading the same tensors, in turn, in one run (replicated over dp 2, and
split over tp 2, where DCP gets one key per rank for the split tensors). levels (only when named): a level-1 save
(each rank's whole state on its "node's" folder and a copy on the other's: two nodes of one rank) against a
level-2 save (the shared folder), in turn, dp2 + ZeRO-1.

From one process (the notebook calls these directly; they start their own processes): `fault_demo` runs
picotron.train without faults and with ranks killed at chosen steps (torchrun restarts it, it resumes);
`resume_demo` resumes one run from its middle checkpoint in four ways (same layout, another layout, another
data seed, the optimizer state dropped); `round_trips` reshards checkpoints between layouts and compares them
element by element; `levels_demo` loses nodes (SIGKILL + their level-1 folder deleted) with and without level 1
and times each restart from the kill to the killed step done again. The Young/Daly interval, a simulation of the
time lost to failures, and two-level checkpointing are plain functions below.
"""
import contextlib
import io
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/
import _common  # noqa: E402  (puts the repository root on sys.path)
from _common import gather  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from picotron import checkpoint, marks, reshard  # noqa: E402
from picotron.mesh import Mesh  # noqa: E402
from picotron.parallelize import parallelize  # noqa: E402
from picotron.train import load_data  # noqa: E402

EXPERIMENTS = ("cost", "async", "dcp", "levels")
DEFAULT = ("cost", "async", "dcp")  # levels: only when named (--only levels)
MiB = 2**20
FONT = 8
LAYOUTS = {"dp2": dict(dp=2), "dp2+zero1": dict(dp=2, zero=1), "dp2+zero3": dict(dp=2, zero=3), "tp2": dict(tp=2),
           "pp2": dict(pp=2, grad_acc=2)}


def layouts(W):
    """cost's layouts on W processes: LAYOUTS at W = 2; on more (8 with PICOTRON_NPROC=8) the same five with the
    rest of the ranks data parallel: dpW, dpW+zero1, dpW+zero3, tp2+dp(W/2), pp2+dp(W/2)."""
    if W == 2:
        return dict(LAYOUTS)
    return {f"dp{W}": dict(dp=W), f"dp{W}+zero1": dict(dp=W, zero=1), f"dp{W}+zero3": dict(dp=W, zero=3),
            f"tp2+dp{W // 2}": dict(tp=2, dp=W // 2), f"pp2+dp{W // 2}": dict(pp=2, dp=W // 2, grad_acc=2)}
# Llama 3 405B's pre-training (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4): 466 interruptions in
# a 54-day snapshot on up to 16,384 H100 GPUs, 47 planned and 419 unexpected (about 78% of these hardware).
LLAMA3 = dict(gpus=16384, days=54, unexpected=419, planned=47)


def settings(fast):
    return dict(seq_len=64, micro_batch_size=4,
                cost_sizes=("tiny", "small") if fast else ("tiny", "small", "medium"), cost_rounds=1 if fast else 3,
                async_size="small" if fast else "medium", async_steps=8 if fast else 16, async_every=2 if fast else 4,
                async_rounds=1 if fast else 2,
                dcp_sizes=("small",) if fast else ("small", "medium"), dcp_rounds=2 if fast else 4,
                demo_steps=20 if fast else 30, demo_every=3 if fast else 5,
                levels_sizes=("small",) if fast else ("small", "medium"), levels_rounds=2 if fast else 4,
                level1_every=2, level2_every=4)


def make_cfg(size, **kw):
    """The lesson's models: picotron's tiny preset (0.85 M parameters) or the lessons' small / medium."""
    from picotron.config import Config

    if size == "tiny":
        return Config(**{"preset": "tiny", "sample_tokens": 0, "eval_every": 0, **kw})
    return _common.make_cfg(size, **kw)


# ------------------------------------------------------------------------------------------ a training rank
class Trainer:
    """One rank of a layout: picotron's step (schedule, clipping, AdamW) without the logging of picotron.train."""

    def __init__(self, cfg, mesh):
        self.cfg, self.mesh = cfg, mesh
        _, self.loader = load_data(cfg, mesh)
        self.run = parallelize(cfg, mesh)

    def step(self, step):
        from picotron.marks import clip_grad_norm

        run = self.run
        loss = run.schedule.run(run.model, self.loader.micro_batches(step), run.loss_fn)
        clip_grad_norm(run.params, self.cfg.grad_clip, self.mesh)
        run.optimizer.step()
        run.model.zero_grad(set_to_none=True)
        return float(loss)


def dir_bytes(path):
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# ------------------------------------------------------------------------------------------------- cost
def exp_cost(mesh, st, out):
    """Per size and layout: bytes each rank writes, snapshot + write seconds, load seconds (median of rounds)."""
    rows = []
    for size in st["cost_sizes"]:
        for name, layout in layouts(mesh.world_size).items():
            if mesh.world_size != math.prod(layout.get(d, 1) for d in ("dp", "tp", "pp", "cp")):
                continue
            cfg = make_cfg(size, seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"], **layout)
            with Mesh.init(**{d: layout.get(d, 1) for d in ("dp", "pp", "cp", "tp")}) as sub:
                trainer = Trainer(cfg, sub)
                trainer.step(1)
                saves, loads, nbytes = [], [], None
                for r in range(st["cost_rounds"]):
                    folder = out / "cost" / f"{size}_{name}_{r}"
                    saver = checkpoint.Saver(str(folder), cfg, sub, keep=1)
                    dist.barrier()
                    t0 = time.perf_counter()
                    saver.save(1, trainer.run)
                    saver.close()
                    t = torch.tensor([time.perf_counter() - t0])
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    saves.append(t.item())
                    rec = saver.times[-1]
                    nbytes = gather(dict(bytes=rec["bytes"], snapshot_s=rec["snapshot_s"], write_s=rec["write_s"]), sub)
                    dist.barrier()
                    t0 = time.perf_counter()
                    reshard.load(checkpoint.latest(str(folder)), trainer.run, sub)
                    t = torch.tensor([time.perf_counter() - t0])
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    loads.append(t.item())
                total = trainer.run.raw.config.num_params() if sub.rank == 0 else None
                on_disk = dir_bytes(checkpoint.latest(str(folder))) if sub.rank == 0 else None
                if sub.rank == 0:
                    shutil.rmtree(out / "cost", ignore_errors=True)
                rows.append(dict(size=size, layout=name, params=total, per_rank=nbytes, save_s=statistics.median(saves),
                                 load_s=statistics.median(loads), on_disk=on_disk))
                if sub.rank == 0:
                    print(f"  {size:<6} {name:<10} bytes per rank {[b['bytes'] // 1024 for b in nbytes]} KiB, save "
                          f"{1e3 * rows[-1]['save_s']:.0f} ms, load {1e3 * rows[-1]['load_s']:.0f} ms", flush=True)
    return rows


# ------------------------------------------------------------------------------------------------ async
def exp_async(mesh, st, out):
    """dp2 (dp = the world size) + ZeRO-1: the same steps with no checkpoint, synchronous ones and asynchronous ones;
    each step's start and end and each save's intervals (times relative to the run's start, rank by rank)."""
    runs, W = {}, mesh.world_size
    cfg = make_cfg(st["async_size"], seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"], dp=W, zero=1)
    modes = ("none", "sync", "async")
    # rounds in opposite orders; each mode keeps its quicker round, so a disturbance of the machine during one
    # round (another program on the cores) does not decide the comparison
    for mode in [m for r in range(st["async_rounds"]) for m in (modes if r % 2 == 0 else modes[::-1])]:
        with Mesh.init(dp=W) as sub:
            trainer = Trainer(cfg, sub)
            folder = out / "async" / mode
            saver = checkpoint.Saver(str(folder), cfg, sub, keep=2, asynchronous=mode == "async")
            trainer.step(1)  # warm-up, not timed
            dist.barrier()
            origin = time.perf_counter()
            steps = []
            for s in range(2, st["async_steps"] + 2):
                t0 = time.perf_counter()
                trainer.step(s)
                if mode != "none" and s % st["async_every"] == 0:
                    saver.save(s, trainer.run)
                steps.append((s, t0 - origin, time.perf_counter() - origin))
            saver.close()
            end = time.perf_counter() - origin
            saves = [dict(step=r["step"], start=r["start"] - origin, snapshot_s=r["snapshot_s"],
                          write_start=r["write_start"] - origin, write_s=r["write_s"], bytes=r["bytes"])
                     for r in saver.times]
            mine = gather(dict(steps=steps, saves=saves, end=end), sub)
            if mode not in runs or mine[0]["end"] < runs[mode][0]["end"]:
                runs[mode] = mine
            if sub.rank == 0:
                shutil.rmtree(out / "async", ignore_errors=True)
                spans = [b - a for _, a, b in steps]
                print(f"  {mode:<5} mean step {1e3 * statistics.mean(spans):.0f} ms, run {end:.2f} s", flush=True)
    return dict(runs=runs, size=st["async_size"], every=st["async_every"],
                params=make_cfg(st["async_size"]).model_config().num_params())


# -------------------------------------------------------------------------------------------------- dcp
def dcp_state(run, mesh):
    """The same tensors for torch.distributed.checkpoint: parameters and Adam's moments by name. Split tensors
    (tp) get the rank in their key: plain tensors with one key are taken as replicated (and written once)."""
    names = {p: n for n, p in run.raw.named_parameters()}
    state = {}
    for p in run.params:
        key = names[p] + (f"@tp{mesh.tp.rank}" if marks.placement(p).split_dim is not None else "")
        state[key] = p.data
        for kind, v in run.optimizer.state[p].items():
            if torch.is_tensor(v) and v.dim():
                state[f"{key}.{kind}"] = v
    return state


def dcp_layouts(W):
    """dcp's two layouts on W processes: replicated (dp W) and split over tp 2 (the rest data parallel)."""
    return ((f"dp{W}", dict(dp=W)), ("tp2" if W == 2 else f"tp2+dp{W // 2}", dict(tp=2, dp=W // 2)))


def exp_dcp(mesh, st, out):
    """Ours and DCP in turn on the same state, rounds alternating the order: save and load seconds (slowest
    rank), bytes on disk."""
    import torch.distributed.checkpoint as dcp

    rows = []
    for size in st["dcp_sizes"]:
        for name, layout in dcp_layouts(mesh.world_size):
            cfg = make_cfg(size, seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"], **layout)
            with Mesh.init(**layout) as sub:
                trainer = Trainer(cfg, sub)
                trainer.step(1)
                times = {k: [] for k in ("ours_save", "ours_load", "dcp_save", "dcp_load")}
                sizes = {}
                for r in range(st["dcp_rounds"]):
                    order = ("ours", "dcp") if r % 2 == 0 else ("dcp", "ours")
                    for who in order:
                        folder = out / "dcp" / f"{who}_{size}_{name}_{r}"
                        for what in ("save", "load"):
                            dist.barrier()
                            t0 = time.perf_counter()
                            if who == "ours" and what == "save":
                                saver = checkpoint.Saver(str(folder), cfg, sub, keep=1)
                                saver.save(1, trainer.run)
                                saver.close()
                            elif who == "ours":
                                reshard.load(checkpoint.latest(str(folder)), trainer.run, sub)
                            elif what == "save":
                                dcp.save(dcp_state(trainer.run, sub), checkpoint_id=str(folder))
                            else:
                                dcp.load(dcp_state(trainer.run, sub), checkpoint_id=str(folder))
                            t = torch.tensor([time.perf_counter() - t0])
                            dist.all_reduce(t, op=dist.ReduceOp.MAX)
                            times[f"{who}_{what}"].append(t.item())
                        dist.barrier()
                        if sub.rank == 0:
                            sizes[who] = dir_bytes(folder)
                            shutil.rmtree(folder, ignore_errors=True)
                row = dict(size=size, layout=name, params=cfg.model_config().num_params(), bytes=sizes,
                           **{k: statistics.median(v) for k, v in times.items()})
                rows.append(row)
                if sub.rank == 0:
                    print(f"  {size:<6} {name}: save ours {1e3 * row['ours_save']:.0f} ms / DCP {1e3 * row['dcp_save']:.0f}"
                          f" ms, load ours {1e3 * row['ours_load']:.0f} ms / DCP {1e3 * row['dcp_load']:.0f} ms", flush=True)
    return rows


# ----------------------------------------------------------------------------------------------- levels
def exp_levels(mesh, st, out):
    """Per size: a level-1 save (two nodes of one rank: each rank's whole state into its node's folder, the same
    bytes sent to the other rank, which writes them into its own) against a level-2 save (each rank's distinct
    values into the shared folder, committed by rank 0), in turn; seconds of the slowest rank (median of rounds),
    and the bytes each rank's node holds afterwards."""
    rows = []
    for size in st["levels_sizes"]:
        cfg = make_cfg(size, seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"], dp=2, zero=1)
        with Mesh.init(dp=2) as sub:
            trainer = Trainer(cfg, sub)
            trainer.step(1)
            times, held = {1: [], 2: []}, {}
            for r in range(st["levels_rounds"]):
                folder = out / "levels" / f"{size}_{r}"
                local = checkpoint.Local(str(folder / "local"), 1, 2, "lesson 10")  # two nodes of one rank each
                saver = checkpoint.Saver(str(folder), cfg, sub, keep=1, local=local)
                for level in ((1, 2) if r % 2 == 0 else (2, 1)):
                    dist.barrier()
                    t0 = time.perf_counter()
                    saver.save(1, trainer.run, level=level)
                    saver.wait()
                    t = torch.tensor([time.perf_counter() - t0])
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    times[level].append(t.item())
                saver.close()
                dist.barrier()
                if sub.rank == 0:
                    held = {1: [dir_bytes(local.folder(n)) for n in (0, 1)],
                            2: dir_bytes(checkpoint.latest(str(folder)))}
                    shutil.rmtree(folder, ignore_errors=True)
            row = dict(size=size, params=cfg.model_config().num_params(), level1_s=statistics.median(times[1]),
                       level2_s=statistics.median(times[2]), held=held)
            rows.append(row)
            if sub.rank == 0:
                print(f"  {size:<6} level 1 {1e3 * row['level1_s']:.0f} ms, level 2 {1e3 * row['level2_s']:.0f} ms",
                      flush=True)
    return rows


# ----------------------------------------------------------------------------- runs of picotron.train
QUICK = ["--seq-len", "32", "--micro-batch-size", "4", "--sample-tokens", "0", "--eval-every", "0", "--log-every", "1",
         "--warmup-steps", "2"]
_STEP = re.compile(r"^step +(\d+)/\d+ \| loss ([0-9.]+)")


def picotron(*args, timeout=600):
    """Run `python -m picotron.train args` (it starts torchrun itself for several processes); (code, stdout, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(_common.ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "picotron.train", *map(str, args), *QUICK], capture_output=True,
                          text=True, cwd=_common.ROOT, env=env, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def attempts(stdout):
    """The (step, loss) lines of each attempt of a run (a restart begins a new list), from its progress lines."""
    runs = [[]]
    for line in stdout.splitlines():
        if line.startswith("picotron: fault injected"):
            runs[-1].append(("fault", line.split("during ")[1]))
        elif "resuming from" in line and line.startswith("restart"):
            runs.append([])
        m = _STEP.match(line)
        if m:
            runs[-1].append((int(m.group(1)), float(m.group(2))))
    return runs


def fault_demo(out, fast):
    """The same run (dp2 + ZeRO-1) without faults and with three: rank 1 killed mid-step, rank 0 killed while
    writing a checkpoint, rank 1 killed again; torchrun restarts it each time (--max-restarts 3)."""
    st = settings(fast)
    n, every = st["demo_steps"], st["demo_every"]
    kills = [every + 1, 2 * every, 3 * every + 2]  # mid-step, in a write, mid-step
    faults = f"kill@{kills[0]}:r1,kill-save@{kills[1]}:r0,kill@{kills[2]}:r1"
    common = ["--dp", 2, "--zero", 1, "--steps", n, "--save-every", every]
    clean, faulty = Path(out) / "clean", Path(out) / "faulty"
    for d in (clean, faulty):
        shutil.rmtree(d, ignore_errors=True)
    t0 = time.perf_counter()
    code_clean, out_clean, err_clean = picotron(*common, "--out", clean)
    t1 = time.perf_counter()
    code, stdout, stderr = picotron(*common, "--out", faulty, "--faults", faults, "--max-restarts", 3)
    t2 = time.perf_counter()
    from picotron.metrics import read_metrics
    return dict(faults=faults, steps=n, every=every, code=(code_clean, code), clean=attempts(out_clean)[0],
                attempts=attempts(stdout), seconds=(t1 - t0, t2 - t1),
                final=(read_metrics(str(clean))[0][-1]["loss"] if code_clean == 0 else None,
                       read_metrics(str(faulty))[0][-1]["loss"] if code == 0 else None),
                losses=([r["loss"] for r in read_metrics(str(clean))[0]] if code_clean == 0 else [],
                        [r["loss"] for r in read_metrics(str(faulty))[0]] if code == 0 else []),
                lines=[line for line in (stdout + stderr).splitlines() if line.startswith(("picotron: ", "restart"))],
                error=None if code == 0 and code_clean == 0 else (err_clean + stderr)[-2000:])


def timed_picotron(*args, timeout=900):
    """picotron(*args), each line of its output stamped with the seconds since the start: (code, [(t, line)])."""
    env = {**os.environ, "PYTHONPATH": str(_common.ROOT), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "picotron.train", *map(str, args), *QUICK], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=_common.ROOT, env=env)
    lines = [(time.perf_counter() - t0, line.rstrip("\n")) for line in proc.stdout]
    return proc.wait(timeout=timeout), lines


_RESUMED = re.compile(r"^restart \d+: (?:resuming from (level 1)?.* at step (\d+)|no checkpoint .* from step (\d+))")


def restarts(lines):
    """For each kill of a faulty run: the step killed, the checkpoint step it resumed from and its level (1 or 2;
    0: none, step 1), the steps redone (the killed one included), and the seconds from the kill to that step done
    again (the restart, then the steps redone)."""
    out, pending = [], None
    for t, line in lines:
        if line.startswith("picotron: fault injected"):
            pending = dict(killed=int(line.rsplit(" ", 1)[1]), t_kill=t)
        m = _RESUMED.match(line)
        if m and pending:
            start = int(m.group(2) or m.group(3))
            level = 1 if m.group(1) else 2 if m.group(2) else 0
            pending.update(resumed=start - 1, level=level, redone=pending["killed"] - (start - 1))
        m = _STEP.match(line)
        if m and pending and "resumed" in pending and int(m.group(1)) == pending["killed"]:
            pending["seconds"] = t - pending.pop("t_kill")
            out.append(pending)
            pending = None
    return out


def levels_demo(out, fast):
    """dp2 as two nodes of one rank (--ranks-per-node 1), level 2 every K2 steps; a node lost (lose-node: its
    level-1 folder deleted, then SIGKILL) at steps spread over one interval, with level 1 every K1 steps (its
    peer's copy survives) and without (only level 2 survives); and the clean run with level 1. One kill per
    attempt, torchrun restarting each time. The checkpoint a kill resumes from: the newest multiple of K1 (with
    level 1) or of K2 (without) before the killed step."""
    st = settings(fast)
    k1, k2 = st["level1_every"], st["level2_every"]
    # the kills: FAST one (the last step of an interval); full: every step of a level-2 interval (the mean of the
    # steps redone is then the model's)
    kills = [2 * k2] if fast else list(range(k2 + 1, 2 * k2 + 1))
    steps = 2 * k2 + k1 + 1  # (the last attempt then writes a level-1 save too: its summary line times both levels)
    common = ["--dp", 2, "--zero", 1, "--steps", steps, "--save-every", k2]
    level1 = ["--local-save-every", k1, "--ranks-per-node", 1]
    runs = {}
    for label, options, kills in [("clean", level1, [])] * (not fast) + [("level 1", level1, kills),
                                                                         ("level 2 only", [], kills)]:
        d = Path(out) / label.replace(" ", "_")
        shutil.rmtree(d, ignore_errors=True)
        faults = ",".join(f"lose-node@{k}:r{i % 2}" for i, k in enumerate(kills))
        extra = ["--faults", faults, "--max-restarts", len(kills)] if kills else []
        code, lines = timed_picotron(*common, *options, *extra, "--out", d)
        from picotron.metrics import read_metrics
        records = read_metrics(str(d))[0] if code == 0 else []
        runs[label] = dict(code=code, kills=kills, restarts=restarts(lines), losses=[r["loss"] for r in records],
                           step_s=statistics.median(r["step_time"] for r in records) if records else None,
                           saves=next((json.loads(l)["saves"] for l in open(d / "metrics.jsonl") if '"summary"' in l),
                                      None) if code == 0 else None,
                           tail=[l for _, l in lines[-8:]] if code else [])
    return dict(k1=k1, k2=k2, steps=steps, runs=runs)


def strip_moments(folder):
    """A copy of what a checkpoint without the optimizer state holds: every rank file keeps only the values."""
    import json

    for path in Path(folder).glob("rank_*.pt"):
        state = torch.load(path, weights_only=True)
        state["tensors"] = {k: v for k, v in state["tensors"].items() if k.endswith(".value")}
        torch.save(state, path)
        index = json.loads(path.with_suffix(".json").read_text())
        for e in index["slices"]:
            e["scalars"] = {}
        path.with_suffix(".json").write_text(json.dumps(index))


def resume_demo(out, fast):
    """One run (one process, 2 micro-batches a step) and four resumes from its middle checkpoint: in the same
    layout, resharded to dp2 + ZeRO-1 (the same global batch), with another data seed (the data position lost),
    and from a checkpoint without Adam's state."""
    st = settings(fast)
    n, mid = st["demo_steps"], st["demo_steps"] // 2
    base = Path(out) / "base"
    shutil.rmtree(base, ignore_errors=True)
    common = ["--steps", n, "--save-every", mid]
    code, _, err = picotron("--grad-acc", 2, *common, "--out", base)
    if code:
        raise RuntimeError(err[-2000:])
    from picotron.metrics import read_metrics
    ref = [r["loss"] for r in read_metrics(str(base))[0]]
    # --resume reuses the run's own settings (grad_acc=2): on dp = 2 the same global batch is --grad-acc 1
    ways = {"same layout": ["--grad-acc", 2], "resharded to dp2 + ZeRO-1": ["--dp", 2, "--zero", 1, "--grad-acc", 1],
            "another data seed": ["--grad-acc", 2, "--seed", 1], "no optimizer state": ["--grad-acc", 2]}
    curves = {}
    for label, args in ways.items():
        d = Path(out) / label.replace(" ", "_")
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(base / "checkpoints" / f"step_{mid:06d}", d / "checkpoints" / f"step_{mid:06d}")
        (d / "checkpoints" / "latest").write_text(f"step_{mid:06d}")
        if label == "no optimizer state":
            strip_moments(d / "checkpoints" / f"step_{mid:06d}")
        # a resumed run writes metrics from the checkpoint's step on (the earlier lines are the base run's)
        code, stdout, err = picotron(*args, *common, "--out", d, "--resume")
        if code:
            raise RuntimeError(f"{label}: {err[-2000:]}")
        curves[label] = [r["loss"] for r in read_metrics(str(d))[0]]  # the steps after the resume, full floats
    return dict(steps=n, mid=mid, reference=ref, curves=curves)


def _train_and_save(layout, out, steps):
    from picotron.config import Config
    from picotron.train import train

    cfg = Config(out=out, steps=steps, save_every=steps, seq_len=32, micro_batch_size=2, sample_tokens=0,
                 eval_every=0, log_every=1000, warmup_steps=2, **layout)
    with Mesh.init(**{d: getattr(cfg, d) for d in ("dp", "pp", "cp", "tp", "ep")}) as m:
        with contextlib.redirect_stdout(io.StringIO()):  # its progress lines are not the point here
            train(cfg, m)


def _load_and_save(layout, src, out):
    from picotron.config import Config

    cfg = Config(out=out, seq_len=32, micro_batch_size=2, sample_tokens=0, eval_every=0, **layout)
    with Mesh.init(**{d: getattr(cfg, d) for d in ("dp", "pp", "cp", "tp", "ep")}) as m:
        run = parallelize(cfg, m)
        step = reshard.load(src, run, m)
        saver = checkpoint.Saver(out, cfg, m)
        saver.save(step, run)
        saver.close()


PAIRS = [("dp2·tp2·pp2 + ZeRO-1", dict(dp=2, tp=2, pp=2, zero=1, grad_acc=2), "tp4", dict(tp=4)),
         ("ZeRO-3 over dp4", dict(dp=4, zero=3), "one process", dict()),
         ("cp2·pp2", dict(cp=2, pp=2, grad_acc=2), "dp2", dict(dp=2)),
         ("one process", dict(), "dp2·tp2 + ZeRO-3", dict(dp=2, tp=2, zero=3)),
         ("tp2 + sp, dp2 + ZeRO-2", dict(tp=2, sp=True, dp=2, zero=2), "pp2 interleaved",
          dict(pp=2, pp_schedule="interleaved", pp_chunks=2, grad_acc=2)),
         ("MoE dp2·ep2 + ZeRO-1", dict(preset="tiny-moe", dp=2, ep=2, zero=1), "MoE tp2", dict(preset="tiny-moe", tp=2))]


def world(layout):
    return math.prod(layout.get(d, 1) for d in ("dp", "tp", "pp", "cp"))


def round_trips(out, fast):
    """Train 2 steps at a layout and save; load that checkpoint at another layout and save again; compare the two
    consolidated checkpoints element by element. One row per pair: elements compared and the ones that differ."""
    from picotron.launch import run_on_ranks

    rows = []
    for src_name, src, dst_name, dst in [PAIRS[1]] if fast else PAIRS:
        a, b = Path(out) / "a", Path(out) / "b"
        for d in (a, b):
            shutil.rmtree(d, ignore_errors=True)
        t0 = time.perf_counter()
        run_on_ranks(_train_and_save, world(src), src, str(a), 2, timeout_s=300)
        run_on_ranks(_load_and_save, world(dst), dst, checkpoint.latest(str(a)), str(b), timeout_s=300)
        one, two = reshard.consolidate(checkpoint.latest(str(a))), reshard.consolidate(checkpoint.latest(str(b)))
        tensors = differ = 0
        for name, p in one["params"].items():
            for x, y in [(p, two["params"][name])] + [(v, two["optimizer"][name][k]) for k, v in
                                                      one["optimizer"][name].items() if torch.is_tensor(v)]:
                tensors += x.numel()
                differ += int((x != y).sum())
            differ += sum(v != two["optimizer"][name][k] for k, v in one["optimizer"][name].items()
                          if not torch.is_tensor(v))
        rows.append(dict(src=src_name, dst=dst_name, ranks=(world(src), world(dst)), elements=tensors, differ=differ,
                         seconds=time.perf_counter() - t0))
    return rows


# ------------------------------------------------------------------------------- how often to checkpoint
def mtbf_hours(gpus, source=LLAMA3):
    """The job's mean time between unexpected interruptions on `gpus` GPUs, scaled from a published run (failures
    taken to be independent, so their rate grows with the number of GPUs)."""
    per_gpu_hours = source["days"] * 24 * source["gpus"] / source["unexpected"]
    return per_gpu_hours / gpus


def young(cost, mtbf):
    """Young (1974): the interval between checkpoints that loses the least time, to first order: sqrt(2 C M)."""
    return math.sqrt(2 * cost * mtbf)


def daly(cost, mtbf):
    """Daly (2006), a higher-order estimate: sqrt(2CM)·[1 + (1/3)·sqrt(C/2M) + (1/9)·(C/2M)] − C, for C < 2M (else M)."""
    if cost >= 2 * mtbf:
        return mtbf
    x = cost / (2 * mtbf)
    return math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - cost


def waste_model(interval, cost, mtbf, restart):
    """The share of the time lost, to first order: saving (C/T) + redone work (T/2 per failure) + restarts (R)."""
    return cost / interval + (interval / 2 + restart) / mtbf


def simulate_waste(interval, cost, mtbf, restart, work, seed=0):
    """Monte Carlo: run `work` seconds of training, a checkpoint costing `cost` after every `interval` seconds of
    work, failures arriving at random (exponential gaps of mean `mtbf`, during work, saves or restarts alike);
    a failure loses the work since the last complete checkpoint and costs `restart`. Returns lost / total time."""
    import random

    rng = random.Random(seed)
    done = clock = 0.0
    next_fail = rng.expovariate(1 / mtbf)
    while done < work:
        segment = min(interval, work - done) + cost  # work, then the save that makes it safe
        if clock + segment <= next_fail:
            clock += segment
            done += segment - cost
            continue
        clock = next_fail + restart  # everything since the last save is lost; the restart itself may fail too
        while rng.random() < 1 - math.exp(-restart / mtbf):
            clock += restart
        next_fail = clock + rng.expovariate(1 / mtbf)
    return (clock - work) / clock


def two_level(c_memory, c_disk, mtbf, restart, p_memory):
    """Two levels (a copy in a peer's memory, then disk): a share p of failures is recovered from the peer's copy
    (one node lost, its partner alive), the rest from disk. Each level's Young interval for the failures it
    serves, T1 = sqrt(2 C1 M / p), T2 = sqrt(2 C2 M / (1 - p)); returns (T1, T2, waste), the waste to first order
    C1/T1 + C2/T2 + (p T1/2 + (1 - p) T2/2 + R) / M."""
    t1 = math.sqrt(2 * c_memory * mtbf / p_memory)
    t2 = math.sqrt(2 * c_disk * mtbf / (1 - p_memory)) if p_memory < 1 else float("inf")
    waste = c_memory / t1 + (c_disk / t2 if p_memory < 1 else 0) + (p_memory * t1 / 2 + (1 - p_memory) * t2 / 2
                                                                      * (p_memory < 1) + restart) / mtbf
    return t1, t2, waste


# ------------------------------------------------------------------------------------------------ plots
def plot_cost(rows):
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
    sizes = sorted({r["size"] for r in rows}, key=[r["size"] for r in rows].index)
    layouts = sorted({r["layout"] for r in rows}, key=[r["layout"] for r in rows].index)
    big = [r for r in rows if r["size"] == sizes[-1]]
    x = range(len(big))
    for rank, color in ((0, "#4c72b0"), (1, "#dd8452")):
        ax1.bar([i + (rank - 0.5) * 0.38 for i in x], [r["per_rank"][rank]["bytes"] / MiB for r in big], 0.38,
                color=color, label=f"rank {rank}")
    ideal = 12 * big[0]["params"] / MiB
    ax1.axhline(ideal, color="k", lw=1, ls="--", label="12 bytes × Ψ (the whole state)")
    ax1.axhline(ideal / 2, color="gray", lw=1, ls=":", label="half of it")
    ax1.set_xticks(list(x), [r["layout"] for r in big], fontsize=FONT)
    ax1.set_ylabel("MiB each rank writes", fontsize=FONT)
    ax1.set_title(f"what each rank writes ({sizes[-1]}: {big[0]['params'] / 1e6:.1f} M parameters)", fontsize=9)
    ax1.legend(fontsize=7)
    for layout in layouts:
        pts = [(r["params"] * 12 / MiB, r["save_s"], r["load_s"]) for r in rows if r["layout"] == layout]
        line, = ax2.plot([p[0] for p in pts], [1e3 * p[1] for p in pts], "o-", ms=3, label=f"{layout} save")
        ax2.plot([p[0] for p in pts], [1e3 * p[2] for p in pts], "s--", ms=3, color=line.get_color(), alpha=0.6)
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("state size, MiB (12 bytes per parameter); dashed: load", fontsize=FONT)
    ax2.set_ylabel("ms (slowest rank)", fontsize=FONT)
    ax2.set_title("save and load time against model size", fontsize=9)
    ax2.legend(fontsize=6.5, ncol=2)
    for ax in (ax1, ax2):
        ax.tick_params(labelsize=FONT)
    fig.tight_layout()
    return fig


def plot_async(res, rank=0):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 2.8))
    for y, mode in enumerate(("none", "sync", "async")):
        r = res["runs"][mode][rank]
        for s, a, b in r["steps"]:
            ax.barh(y, b - a, left=a, height=0.5, color="#8fbc8f", edgecolor="white", lw=0.5)
        for sv in r["saves"]:
            ax.barh(y, sv["snapshot_s"], left=sv["start"], height=0.5, color="#c44e52")
            if mode == "sync":
                ax.barh(y, sv["write_s"], left=sv["write_start"], height=0.5, color="#dd8452")
            else:
                ax.barh(y + 0.33, sv["write_s"], left=sv["write_start"], height=0.15, color="#dd8452")
        ax.text(r["end"], y, f" {r['end']:.2f} s", va="center", fontsize=7)
    ax.set_yticks([0, 1, 2], ["no checkpoint", "synchronous", "asynchronous"], fontsize=FONT)
    ax.set_ylim(2.6, -0.5)
    ax.set_xlabel(f"seconds, rank {rank} (green: training steps; red: copying the state to host memory; orange: "
                  f"writing; async: the writer thread, the thin bar under its row)", fontsize=FONT)
    ax.tick_params(labelsize=FONT)
    ax.set_title(f"a checkpoint every {res['every']} steps, {res['size']} model ({res['params'] / 1e6:.1f} M "
                 f"parameters), dp2 + ZeRO-1", fontsize=9)
    fig.tight_layout()
    return fig


def plot_faults(demo):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.4))
    steps = [s for s, _ in demo["clean"]]
    ax.plot(steps, [x for _, x in demo["clean"]], "k-", lw=4, alpha=0.25, label="without faults")
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2"]
    for i, att in enumerate(demo["attempts"]):
        pts = [(s, x) for s, x in att if isinstance(s, int)]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, color=colors[i % 5],
                    label=f"attempt {i}" + (" (start)" if i == 0 else f" (restart {i}, resumed at step {pts[0][0]})"))
        for s, what in att:
            if s == "fault":
                at = int(what.rsplit(" ", 1)[1])
                ax.axvline(at, color=colors[i % 5], ls=":", lw=1)
                ax.text(at, ax.get_ylim()[1] if ax.lines else 0, f" killed: {what}", rotation=90, va="top",
                        fontsize=6.5, color=colors[i % 5])
    for s in range(demo["every"], demo["steps"] + 1, demo["every"]):
        ax.axvline(s, color="gray", lw=0.5, alpha=0.4)
    ax.set_xlabel(f"step (grey lines: a checkpoint every {demo['every']} steps)", fontsize=FONT)
    ax.set_ylabel("loss", fontsize=FONT)
    ax.legend(fontsize=7)
    ax.tick_params(labelsize=FONT)
    ax.set_title(f"--faults \"{demo['faults']}\" --max-restarts 3", fontsize=9)
    fig.tight_layout()
    return fig


def plot_levels(lv):
    """Per lost node, with level 1 (the peer's copy survives) and without (only level 2): the steps redone against
    the model (K+1)/2, and the seconds from the kill to the killed step done again (the redone steps' share
    hatched: their count times the median step time)."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
    labels = [("level 1", lv["k1"], "#4c72b0"), ("level 2 only", lv["k2"], "#dd8452")]
    for i, (label, every, color) in enumerate(labels):
        r = lv["runs"][label]
        redone = [x["redone"] for x in r["restarts"]]
        seconds = [x["seconds"] for x in r["restarts"]]
        if not redone:
            continue
        ax1.bar(i, sum(redone) / len(redone), 0.6, color=color)
        ax1.plot(range(i, i + 1), [(every + 1) / 2], "k_", ms=40, mew=2)
        mean = sum(redone) / len(redone)
        ax1.text(i, mean, f" {mean:.1f}", ha="center", va="bottom", fontsize=7)
        mean_s = sum(seconds) / len(seconds)
        work = sum(redone) / len(redone) * (r["step_s"] or 0)
        ax2.bar(i, mean_s, 0.6, color=color, alpha=0.5)
        ax2.bar(i, work, 0.6, color=color, hatch="//", edgecolor="k")
        ax2.text(i, mean_s, f" {mean_s:.1f} s", ha="center", va="bottom", fontsize=7)
    names = [f"level 1 every {lv['k1']}\n(the peer's copy survives)", f"level 2 only, every {lv['k2']}"]
    for ax in (ax1, ax2):
        ax.set_xticks([0, 1], names, fontsize=FONT)
        ax.tick_params(labelsize=FONT)
    ax1.set_ylabel("steps redone per lost node (bars)\nmodel (K+1)/2 (black)", fontsize=FONT)
    ax2.set_ylabel("seconds from the kill to the killed step\ndone again (hatched: the steps redone)", fontsize=FONT)
    ax1.set_title("work redone, by the level that survived", fontsize=9)
    ax2.set_title("time lost: the restart, then the steps redone", fontsize=9)
    fig.tight_layout()
    return fig


def plot_resume(demo):
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
    n, mid, ref = demo["steps"], demo["mid"], demo["reference"]
    ax1.plot(range(1, n + 1), ref, "k-", lw=4, alpha=0.25, label="uninterrupted")
    for label, curve in demo["curves"].items():
        steps = range(mid + 1, mid + 1 + len(curve))
        ax1.plot(steps, curve, "o-", ms=2.5, label=label)
        ax2.semilogy(steps, [max(abs(a - b) / abs(b), 1e-10) for a, b in zip(curve, ref[mid:])], "o-", ms=2.5,
                     label=label)
    ax1.axvline(mid, color="gray", ls=":")
    ax1.set_xlabel(f"step (resumed from the checkpoint of step {mid})", fontsize=FONT)
    ax1.set_ylabel("loss", fontsize=FONT)
    ax2.axhline(1e-5, color="k", ls="--", lw=1, label="parity tolerance 1e-5")
    ax2.set_xlabel("step", fontsize=FONT)
    ax2.set_ylabel("|loss − uninterrupted| / uninterrupted (1e-10: equal)", fontsize=FONT)
    for ax in (ax1, ax2):
        ax.legend(fontsize=6.5)
        ax.tick_params(labelsize=FONT)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------------ main
def configs_at(nproc, fast=False):
    """The Configs the main run (cost, async, dcp: the notebook's launch in section 5) trains and saves on `nproc`
    processes (GPU_SETTINGS on top: the 8-process mode is for a node of GPUs): every size in every layout of
    `layouts`, the async run, DCP's layouts."""
    st = _common.sized("10_checkpoints_and_faults", settings(fast), fast, "cuda")
    kw = dict(seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"])
    out = [make_cfg(size, **kw, **layout) for size in st["cost_sizes"] for layout in layouts(nproc).values()]
    out.append(make_cfg(st["async_size"], **kw, dp=nproc, zero=1))
    return out + [make_cfg(size, **kw, **layout) for size in st["dcp_sizes"] for _, layout in dcp_layouts(nproc)]


def main(argv=None):
    args, names, out = _common.cli("10_checkpoints_and_faults", EXPERIMENTS, __doc__, default=DEFAULT, argv=argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % 2 or ("levels" in names and world != 2):
        sys.exit("run on 2 processes (or 8, without levels: PICOTRON_NPROC=8): torchrun --nproc_per_node 2 "
                 "lessons/10_checkpoints_and_faults/experiment.py")
    st = _common.sized("10_checkpoints_and_faults", settings(args.fast), args.fast)
    with Mesh.init(dp=world, device=_common.experiment_device("10_checkpoints_and_faults")) as mesh:  # the world; each experiment makes its layouts' groups inside it
        _common.run_experiments(names, lambda name: globals()[f"exp_{name}"](mesh, st, out),
                                lambda name: out / f"{name}.json", _common.environment(mesh, settings=st), mesh.rank)


if __name__ == "__main__":
    main()
