"""The training loop: `python -m picotron.train --preset tiny --steps 200` (world size 1 needs no torchrun).

`parallelize(cfg, mesh)` builds this rank's model, optimizer, schedule and loss (and `token_positions`
says which tokens of every sequence this rank's loader keeps); the loop imports and knows no strategy.
`train` is the loop; `one_step`, one optimizer step, in order:

    lr = warm-up then cosine schedule(step)
    loss = schedule.run(model, micro_batches, loss_fn)   # forward + backward of every micro-batch, the
                                                         # gradients synchronised; the global-batch loss
    clip the global gradient norm to grad_clip           # each gradient element counted once (its placement)
    judge: stop if the loss or the norm is not finite    # before the update: the weights stay sane
    optimizer.step(), zero the gradients                 # (--on-nonfinite skip: drop the update, go on)
                                                         # (fp16: an overflow skips the step, halves the
                                                         # loss scale; picotron.precision)

Around it, per step, the loop: the validation loss every eval_every steps, one line of metrics.jsonl, a checkpoint every
save_every steps (picotron.checkpoint: sharded, atomic, maybe async; with --local-save-every, a level-1 one on the
nodes' local disks in between, picotron.checkpoint_local), a progress line, and after a Ctrl-C the
stop, every rank after the same step, with a checkpoint (a second Ctrl-C stops at once: `interruptible`).
What the run prints is picotron.messages'; where it starts (step 1, or a checkpoint's next step) picotron.resume's.

Faults. Under torchrun with --max-restarts N, a job whose rank died starts again and resumes by itself from
the newest complete checkpoint, at either level (restart `attempt` > 0 acts as --resume); --faults injects
deaths, and lost nodes, to try it.

With one pipeline stage, `schedule.run` is gradient accumulation: for each of grad_acc micro-batches,
logits = model(x) (under bf16 autocast if --dtype bf16; parameters stay fp32), loss = cross_entropy / grad_acc,
loss.backward() (gradients add up in p.grad), the replicas exchanging gradients during the last backward.

Mixed precision (--dtype, picotron.precision): bf16 autocasts the matmuls over fp32 parameters, gradients and
optimizer state; bf16-params and fp16 keep bf16/fp16 parameters and gradients and an fp32 master copy in the
optimizer; fp16 scales the loss so small gradients do not underflow; fp8 runs the decoder's matmuls in FP8.

Every step writes one line to OUT/metrics.jsonl (loss, lr, grad_norm, tokens, tokens_per_s, mfu, memory by
category), every `log_every` steps a progress line, every `eval_every` steps the validation loss, and at the
end a summary line and a short text sample from the trained model.

The command line and the launcher's environment are read once, in `main` (and `read_command` before torch loads:
--help and refusals answer at once); what the loop needs of them comes down as arguments.
"""
import math
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from picotron import config, launch, rules, runs  # no torch: the command line is read and checked before torch loads


def read_command(argv, place):
    """This command's settings, every rule checked before any process starts, without torch: the settings' own and
    the run folder's (picotron.runs.read_command), then the strategies', the data's and the devices' (picotron.rules;
    torch loads there only to count the GPUs for several processes). A broken rule: one sentence, exit status 2.
    `place`: what the launcher said (picotron.launch.place)."""
    cfg = runs.read_command(argv, place)
    try:
        rules.validate(cfg, place.world_size if place.launched else None, any_world_size=not place.launched,
                       per_node=place.per_node() if place.launched else None)
    except config.ConfigError as e:
        runs.refuse(e, place.says)
    return cfg


if __name__ == "__main__":  # `python -m picotron.train ...`: --help, --version and every refusal answer now, not
    place = launch.place()  # after seconds (a minute on a busy machine) of importing torch; main() reads the
    read_command(sys.argv[1:], place)  # command again, in milliseconds

import torch  # noqa: E402

from picotron import data, faults, metrics, moe, precision, resume, trace  # noqa: E402
from picotron.checkpoint import step_dir  # noqa: E402
from picotron.checkpoint_local import local_of  # noqa: E402
from picotron.config import Config  # noqa: E402
from picotron.marks import clip_grad_norm  # noqa: E402
from picotron.mesh import Mesh  # noqa: E402
from picotron.messages import (CTRL_C, INTERRUPTED_EARLY, Stopped, divergence_message, done_line,  # noqa: E402
                               interrupted, progress_line, resume_hint, skipped_line, startup_lines,
                               warn_if_diverging)
from picotron.model import generate  # noqa: E402
from picotron.parallelize import autocast_for, parallelize, token_positions  # noqa: E402


@contextmanager
def interruptible(announce=True):
    """Ctrl-C (SIGINT) asks the loop to stop after the current step, which then saves a checkpoint.

    Yields a function telling whether a stop was asked for. A second Ctrl-C, a second or more after the
    first, stops at once (KeyboardInterrupt). Under torchrun each worker gets the signal from the agent.
    """
    asked = []

    def handler(signum, frame):
        if asked and time.monotonic() - asked[0] > 1.0:
            raise KeyboardInterrupt
        if not asked:
            asked.append(time.monotonic())
            if announce:
                print(CTRL_C, file=sys.stderr, flush=True)

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread (a notebook's worker thread): leave Ctrl-C alone
        yield lambda: False
        return
    try:
        yield lambda: bool(asked)
    finally:
        signal.signal(signal.SIGINT, previous)


def lr_at(step, cfg):
    """Linear warm-up over `warmup_steps`, then cosine decay from lr to min_lr at the last step (1-based)."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(1, cfg.warmup_steps)
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def load_data(cfg, mesh):
    """The tokenizer and this rank's loader (its dp rank's rows, its cp rank's tokens of them; the tp ranks of a
    replica read the same)."""
    tokenizer = data.get_tokenizer(cfg.tokenizer)
    tokens = tokenizer.encode_tensor(data.load_text(cfg.data))
    try:
        data.check_size(cfg.data, len(tokens), cfg.seq_len)
    except data.DataError as e:
        raise Stopped(f"picotron: error: {e}", 2) from None
    loader = data.DataLoader(data.TokenData(tokens, tokenizer.vocab_size),
                             seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size, grad_acc=cfg.grad_acc,
                             dp_size=mesh.dp.size, dp_rank=mesh.dp.rank, seed=cfg.seed,
                             positions=token_positions(cfg, mesh))  # cp: this rank's tokens of every row
    return tokenizer, loader


@dataclass
class Job:
    """What a training run holds while it runs (built by `setup`): what the loop and `one_step` pass around."""
    cfg: Config
    mesh: Mesh
    run: object             # what parallelize built: model, raw, optimizer, schedule, loss_fn, scaler, sampler
    tokenizer: object
    loader: object          # this rank's batches (picotron.data)
    injector: object        # --faults (picotron.faults)
    speed: "Speed"
    activations: object     # the step's activation peak (metrics.ActivationPeak)
    saver: object           # checkpoints (picotron.checkpoint.Saver)
    start: int              # the first step this start runs (1, or a checkpoint's next step)
    log: object             # OUT/metrics.jsonl (rank 0 writes it)
    argv: list = None       # the command line, for the commands messages hand back; None: built from cfg
    history: list = field(default_factory=list)  # the records of this start's steps
    warned: bool = False    # the loss-climbs warning was printed (once per start)
    trace: object = trace.Off()  # --profile: torch.profiler over a range of steps (picotron.trace)

    @property
    def says(self):
        return self.mesh.rank == 0


def setup(cfg, mesh, argv=None, attempt=0):
    """Everything the loop needs, built on this rank: the data, the parallel model (`parallelize`), the faults, the
    speed's yardsticks, the checkpoint writer and the step to start at (a resume loads the checkpoint here)."""
    if cfg.out is None:
        raise ValueError("cfg.out is None: pass the run's folder (the command line claims a new runs/main-N itself, "
                         "picotron.runs)")
    torch.manual_seed(cfg.seed)
    tokenizer, loader = load_data(cfg, mesh)
    tracer = trace.for_run(cfg, mesh)  # --profile: its recorder times the collectives; else Off, nothing installed
    run = parallelize(cfg, mesh, recorder=tracer.recorder)
    tracer.watch(run)  # the phases as the trace's named ranges
    activations = run.schedule.phases.listen(metrics.ActivationPeak(run.model))  # the step's peak (picotron.hooks)
    local = local_of(cfg, mesh)  # level 1's places (--local-save-every), or None
    injector = faults.Injector(cfg.faults, mesh.rank, mesh.world_size,  # --faults: deaths and NaNs on purpose
                               node_dir=local and local.folder(mesh.rank), attempt=attempt)
    speed = Speed(cfg, mesh, run.raw.config)  # tokens and FLOPs per step; the matmul peak that MFU divides by
    start, saver = resume.start_or_resume(cfg, mesh, run, injector, local, attempt)  # step 1, or a checkpoint's next
    log = metrics.MetricsLog(cfg.out, enabled=mesh.rank == 0, resume_step=start if start > 1 else None)
    if mesh.rank == 0:
        for line in startup_lines(cfg, mesh, run, speed, torch.get_num_threads(), lr_at(cfg.steps, cfg)):
            print(line, flush=True)
    return Job(cfg, mesh, run, tokenizer, loader, injector, speed, activations, saver, start, log, argv, trace=tracer)


def train(cfg, mesh, return_model=False, argv=None, attempt=0):
    """Run cfg.steps optimizer steps on this rank's part of the mesh; return the summary dict (and, with
    return_model, what `parallelize` built, trained: tests and lessons inspect .model, .raw, .optimizer).
    argv: the command line (the commands messages hand back; None: built from cfg); attempt: which start of the
    job this is (torchrun's restarts; > 0 resumes by itself)."""
    job = setup(cfg, mesh, argv, attempt)
    t_start = time.perf_counter()
    try:
        with interruptible(announce=job.says) as stop_asked:  # Ctrl-C: stop after this step, with a checkpoint
            for step in range(job.start, cfg.steps + 1):
                try:
                    with job.trace.step(step):  # --profile: the profiler starts and stops at its steps
                        record = one_step(step, job)
                    if cfg.eval_every and (step % cfg.eval_every == 0 or step in (job.start, cfg.steps)):
                        record["val_loss"] = job.run.schedule.evaluate(
                            job.run.raw, job.loader.val_batches(cfg.eval_batches), job.run.loss_fn)
                except KeyboardInterrupt:  # a second Ctrl-C: stop at once, without saving a half-done step
                    job.saver.wait()
                    raise interrupted(cfg, job.saver.newest, f"during step {step}/{cfg.steps}", argv) from None
                after_step(job, record)
                if step < cfg.steps and mesh.agree(stop_asked()):  # every rank stops after the same step
                    raise stop_after(step, job)
        if cfg.save_final and job.saver.newest != step_dir(cfg.out, cfg.steps):
            job.saver.save(cfg.steps, job.run)  # the trained model, for --resume, --resume-from and picotron.export
        job.saver.close()  # the last write in flight ends before the run does
    except Stopped:
        job.log.close()  # the steps so far stay in metrics.jsonl
        raise
    summary = finish(job, elapsed_s=time.perf_counter() - t_start)
    return (summary, job.run) if return_model else summary


def one_step(step, job):
    """Optimizer step `step` on this rank: forward and backward of every micro-batch, clip, update; return its
    line of metrics.jsonl (without the validation loss: the loop adds it)."""
    cfg, mesh, run, speed = job.cfg, job.mesh, job.run, job.speed
    model, optimizer, device = run.model, run.optimizer, mesh.device
    metrics.reset_device_peak(device)
    t0 = time.perf_counter()
    lr = lr_at(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = run.schedule.run(model, job.loader.micro_batches(step), job.injector.loss_fn(step, run.loss_fn))
    scale = run.scaler.scale  # fp16: the gradients are S times the gradient (S = 1 otherwise)
    with job.trace.range("clip grad norm"):
        grad_norm = clip_grad_norm(run.grad_params, cfg.grad_clip, mesh, grad_scale=scale)
    mem = model.memory()  # gradients still alive here
    loss_value = float(loss)  # .item(): waits for the device
    job.injector.maybe_kill("kill", step)  # mid-step: gradients computed, the update not yet applied
    finite, overflow = judge(step, loss_value, grad_norm, job)
    if finite:
        with job.trace.range("optimizer step"):
            optimizer.step()
    model.zero_grad(set_to_none=True)
    metrics.sync(device)
    dt = time.perf_counter() - t0
    mem.update(optimizer=metrics.optimizer_bytes(optimizer), activations=job.activations.bytes,
               device_peak=metrics.device_peak_bytes(device), rss_peak=metrics.process_peak_rss_bytes())
    record = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
              "tokens": step * speed.tokens, "step_time": dt, "tokens_per_s": speed.tokens / dt,
              "mfu": speed.mfu(step, dt), "mem": mem}
    if not finite:  # --on-nonfinite skip, or fp16's overflow: this step changed nothing
        record["skipped"] = True
    if run.scaler.dynamic:
        record.update(loss_scale=scale, overflow=overflow, overflows=run.scaler.skipped)
    if speed.datasheet:
        record["mfu_datasheet"] = speed.flops / dt / (speed.datasheet * mesh.world_size)
    experts = moe.step_stats(run.raw, mesh.dp_cp, balance=finite)  # MoE: routing of this step (this pipeline
    # stage's layers), and the routing bias's update (DeepSeek-V3) by its loads when the step was applied
    if experts is not None:
        record["moe"] = experts
    return record


def judge(step, loss_value, grad_norm, job):
    """(finite, overflow) after a step's backward: whether its update may apply, and whether fp16's dynamic loss
    scale overflowed (then S halves and the step is skipped; clean steps grow S: picotron.precision). Any other
    inf/NaN stops the run before the update, with --on-nonfinite stop (the same on every rank: all stop)."""
    cfg, scaler = job.cfg, job.run.scaler
    finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
    overflow = scaler.dynamic and math.isfinite(loss_value) and not finite  # fp16: S too large
    scaler.update(overflow)
    if not finite and not overflow and cfg.on_nonfinite == "stop":
        job.saver.wait()
        raise Stopped(divergence_message(cfg, step, loss_value, grad_norm, step in job.injector.nan_steps,
                                         job.saver.newest, job.argv), 1)
    return finite, overflow


def after_step(job, record):
    """After a step: its line of metrics.jsonl, a checkpoint when one is due (level 2 every save_every steps, level
    1 every local_save_every), the progress line, and once a warning if the loss climbs."""
    cfg, step, history = job.cfg, record["step"], job.history
    job.log.write(record)
    history.append(record)
    skipped = skipped_line(record, job.run.scaler.scale) if job.says else None
    if skipped:
        print(skipped, flush=True)
    if cfg.save_every and step % cfg.save_every == 0:
        job.saver.save(step, job.run)
    elif cfg.local_save_every and step % cfg.local_save_every == 0 and \
            not (cfg.save_final and step == cfg.steps):  # (the last step's is level 2's)
        job.saver.save(step, job.run, level=1)  # each rank's state on its node's disk and its peer's
    if job.says and (step % cfg.log_every == 0 or step in (1, cfg.steps) or "val_loss" in record):
        mc = job.run.raw.config
        print(progress_line(record, cfg.steps, aux=bool(mc.num_local_experts and mc.router_aux_loss_coef)),
              flush=True)  # aux: the load-balancing loss, when it is part of the loss
    if job.says and not job.warned:
        job.warned = warn_if_diverging(history, cfg)


def stop_after(step, job):
    """Ctrl-C: the Stopped that ends the run after `step`, once that step's checkpoint is written."""
    job.saver.wait()
    if job.saver.newest != step_dir(job.cfg.out, step):
        job.saver.save(step, job.run)
    job.saver.wait()
    return interrupted(job.cfg, job.saver.newest, f"after step {step}/{job.cfg.steps}", job.argv)


def finish(job, elapsed_s):
    """The end of a run: the summary line of metrics.jsonl, the done line and the sample text; the summary."""
    summary = summarize(job, elapsed_s)
    summary["saves"] = save_times(job.saver.times)
    job.log.write(summary)
    job.log.close()
    if job.says:
        print(done_line(job.history, summary, job.cfg.out), flush=True)
    if job.cfg.sample_tokens:  # every rank generates (the same text): under ZeRO-3 and tp each forward is collective
        text = sample_text(job.run.sampler, job.tokenizer, job.cfg, job.mesh.device)
        if job.says:
            print("---- sample ----\n" + text + "\n----------------", flush=True)
    return summary


class Speed:
    """Tokens and model FLOPs per step, and the matmul peak MFU divides by: measured at start-up, and measured
    again (and raised) when a step runs faster than it, which means the machine was busy at start-up."""

    def __init__(self, cfg, mesh, mc):
        self.tokens = mesh.dp.size * cfg.grad_acc * cfg.micro_batch_size * cfg.seq_len
        self.flops_per_token = metrics.flops_per_token(mc, cfg.seq_len)
        self.flops = self.flops_per_token * self.tokens
        self.device, self.dtype, self.world_size = mesh.device, precision.recipe(cfg).compute_dtype, mesh.world_size
        self.at_start = self.peak = metrics.measured_matmul_peak(self.device, self.dtype)
        self.datasheet = metrics.datasheet_peak(self.device)
        self.loud = mesh.rank == 0

    def mfu(self, step, dt):
        """Model FLOPs utilisation of a step that took dt seconds."""
        achieved = self.flops / dt / self.world_size  # model FLOP/s per process
        if achieved > self.peak:  # faster than the peak: it was measured while the machine was busy
            self.peak = max(metrics.measured_matmul_peak(self.device, self.dtype, again=True), achieved)
            if self.loud:
                print(f"picotron: note: step {step} ran at {achieved / 1e9:.1f} GFLOP/s, above the matmul peak measured "
                      f"at start-up ({self.at_start / 1e9:.1f} GFLOP/s: the machine was busy then); measured again: "
                      f"MFU now uses {self.peak / 1e9:.1f} GFLOP/s", flush=True)
        return achieved / self.peak


def summarize(job, elapsed_s):
    """The run's last line of metrics.jsonl: speed over the steady steps, the final and validation losses."""
    history, speed, run = job.history, job.speed, job.run
    steady = history[1:] or history  # the first step pays for warm-up (allocations, kernel selection)
    step_time = sum(r["step_time"] for r in steady) / len(steady)
    val_loss = next((r["val_loss"] for r in reversed(history) if "val_loss" in r), None)
    summary = {"summary": True, "steps": job.cfg.steps, "final_loss": history[-1]["loss"], "val_loss": val_loss,
               "tokens_per_s": speed.tokens / step_time,
               "mfu": speed.flops / step_time / (speed.peak * job.mesh.world_size),
               "peak_flops_measured": speed.peak, "peak_flops_measured_at_start": speed.at_start,
               "peak_flops_datasheet": speed.datasheet,
               "flops_per_token": speed.flops_per_token, "num_params": run.raw.config.num_params(),
               "elapsed_s": elapsed_s, "world_size": job.mesh.world_size,
               "device": str(job.mesh.device), "mem": history[-1]["mem"]}
    if run.scaler.dynamic:
        summary.update(loss_scale=run.scaler.scale, overflows=run.scaler.skipped)
    return summary


def save_times(times):
    """This rank's checkpoint saves by level: how many, and the mean seconds to copy the state to host memory
    (snapshot) and to write it (level 1: the node's disk and the peer's copy; level 2: the shared folder)."""
    out = {}
    for level in (1, 2):
        mine = [t for t in times if t["level"] == level and "write_s" in t]
        if mine:
            out[f"level_{level}"] = {k: sum(t[k] for t in mine) / len(mine) for k in ("snapshot_s", "write_s", "bytes")}
            out[f"level_{level}"]["count"] = len(mine)
    return out


def sample_text(sampler, tokenizer, cfg, device):
    """cfg.sample_tokens tokens after a newline, from `sampler` (its forward runs on `device`). Each draw happens
    on the CPU (`model.generate` moves the last logits there) with a CPU generator seeded with cfg.seed, so the
    text is the same on every rank and every device; a generator on the model's device (CUDA) cannot draw from
    CPU probabilities."""
    prompt = torch.tensor([tokenizer.encode("\n")], device=device)
    with autocast_for(cfg, device)():
        out = generate(sampler, prompt, cfg.sample_tokens, temperature=0.8, top_k=40,
                       generator=torch.Generator("cpu").manual_seed(cfg.seed))
    return data.printable(tokenizer, out[0].tolist()).strip()


def main(argv, place=None):
    """`python -m picotron.train ARGV`: the command line `argv` and the launcher's environment (`place`, by default
    read here: picotron.launch.place) are read once, here, and passed down."""
    place = place or launch.place()
    # Checked before any process group exists; a broken rule exits 2 with one sentence: the settings (--resume: the
    # run's own, under the flags given now), the run folder, the strategies', the data and the devices
    # (`read_command`); then the folder is claimed.
    cfg = read_command(argv, place)
    cfg, argv = runs.folder(cfg, list(argv), place)  # claimed (a new run), and handed to the workers by --out
    if not place.launched and (cfg.world_size > 1 or cfg.max_restarts or cfg.nnodes > 1):  # start them ourselves
        nodes = dict(nnodes=cfg.nnodes, node_rank=cfg.node_rank, rdzv_endpoint=cfg.rdzv_endpoint, rdzv_id=cfg.rdzv_id)
        raise SystemExit(launch.torchrun_main("picotron.train", cfg.world_size // cfg.nnodes, argv,
                                              max_restarts=cfg.max_restarts, claimed=cfg.out,
                                              hint=lambda: resume_hint(cfg, runs.latest(cfg.out), argv), **nodes))
    if place.says:  # tp / cp peers on different nodes: allowed, but say what it costs
        note = config.placement_note(cfg, place.per_node(cfg.world_size))
        if note:
            print(f"picotron: warning: {note}", flush=True)
    try:
        mesh = Mesh.init(dp=cfg.dp, pp=cfg.pp, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep, timeout_s=cfg.timeout_s,
                         device=None if cfg.device == "auto" else cfg.device, collectives=cfg.collectives, place=place,
                         dp_shard=cfg.dp_shard)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    # the one line that ends the job: from rank 0, and on several nodes from each node's first process too
    # (each node's console shows its own processes only)
    says = mesh.rank == 0 or (mesh.local_rank == 0 and mesh.per_node < mesh.world_size)
    try:
        train(cfg, mesh, argv=argv, attempt=place.attempt)
    except Stopped as e:
        if says:
            print(e, file=sys.stderr, flush=True)
        raise SystemExit(e.code) from None
    except KeyboardInterrupt:  # before the first step (building the model, measuring the matmul peak)
        if says:
            print(INTERRUPTED_EARLY, file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    else:
        # every rank meets at a barrier first: then no rank's last collective is still being released by its
        # backend's thread while the interpreter shuts down (gloo on torch 2.5 aborts the process then)
        mesh.destroy(wait=True)
    finally:
        mesh.destroy()  # after an error: no barrier (a peer may be gone); after success: nothing left to do


if __name__ == "__main__":
    main(sys.argv[1:], place)
