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
nodes' local disks in between), a progress line, and after a Ctrl-C the
stop, every rank after the same step, with a checkpoint (a second Ctrl-C stops at once: `interruptible`).

Faults. Under torchrun with --max-restarts N, a job whose rank died starts again and resumes by itself from
the newest complete checkpoint, at either level (`faults.attempt()` > 0 acts as --resume); --faults injects
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
"""
import math
import os
import signal
import sys
import time
from contextlib import contextmanager

from picotron import config, faults, rules, runs  # no torch: the command line is read and checked before torch loads


def read_command(argv, under_launcher):
    """This command's settings, every rule checked before any process starts, without torch: the settings' own and
    the run folder's (picotron.runs.read_command), then the strategies', the data's and the devices' (picotron.rules;
    torch loads there only to count the GPUs for several processes). A broken rule: one sentence, exit status 2."""
    cfg = runs.read_command(argv, under_launcher)
    try:
        rules.validate(cfg, any_world_size=not under_launcher)
    except config.ConfigError as e:
        runs.refuse(e)
    return cfg


if __name__ == "__main__":  # `python -m picotron.train ...`: --help, --version and every refusal answer now, not
    read_command(sys.argv[1:], "WORLD_SIZE" in os.environ)  # after seconds (a minute on a busy machine) of
    # importing torch; main() reads the command again, in milliseconds

import torch  # noqa: E402

from picotron import checkpoint, data, launch, metrics, moe, precision, reshard  # noqa: E402
from picotron.config import Config  # noqa: E402
from picotron.marks import clip_grad_norm  # noqa: E402
from picotron.mesh import Mesh  # noqa: E402
from picotron.model import generate  # noqa: E402
from picotron.parallelize import autocast_for, parallelize, token_positions  # noqa: E402


class Stopped(Exception):
    """The run stopped early on purpose: `message` is the one line for the user, `code` the exit status."""

    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


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
                print("\npicotron: Ctrl-C: stopping after this step (press it again to stop at once)",
                      file=sys.stderr, flush=True)

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread (a notebook's worker thread): leave Ctrl-C alone
        yield lambda: False
        return
    try:
        yield lambda: bool(asked)
    finally:
        signal.signal(signal.SIGINT, previous)


def resume_hint(cfg, folder, argv=None, lr=None):
    """Where the newest checkpoint is and the exact command that continues from it, as the user would paste it
    (picotron.runs.command: their launcher and flags, without --faults: an injected fault would fire again), or
    that there is none and the command that starts again."""
    argv = sys.argv[1:] if argv is None else argv
    lower = ["--lr", f"{lr:.2g}"] if lr is not None else []
    if folder is None:
        return ("no checkpoint was saved (--save-every K keeps one every K steps); start again with "
                f"{runs.command(argv, add=lower, drop=('faults', 'resume', 'resume_from', 'out'))}")
    return (f"newest checkpoint {folder}; continue with "
            f"{runs.command(argv, add=[*lower, '--resume', '--out', cfg.out], drop=('faults', 'resume_from'))}")


def divergence_message(cfg, step, loss_value, grad_norm, injected, folder, argv=None):
    """The one sentence after a non-finite step: what happened, and advice that fits the settings in force
    (never "clip harder" at the clipping already used; an injected NaN is named as such)."""
    head = (f"picotron: stopped: the run diverged at step {step}: loss {loss_value}, gradient norm {grad_norm}; it "
            f"stopped before applying that update")
    if injected:
        return (f"{head}; that NaN was injected by --faults nan@{step}, as asked (--on-nonfinite skip would drop the "
                f"step and go on); {resume_hint(cfg, folder, argv)}.")
    lower = cfg.lr / 3
    tips = [f"lower --lr (now {cfg.lr:g}; e.g. {lower:.2g})"]
    if not cfg.grad_clip:
        tips.append("clip the gradient norm (--grad-clip 1)")
    elif cfg.grad_clip > 1:
        tips.append(f"clip harder (--grad-clip 1; now {cfg.grad_clip:g})")
    if cfg.warmup_steps < 100 and step <= 2 * max(cfg.warmup_steps, 1):
        tips.append(f"warm up longer (--warmup-steps {max(100, 2 * cfg.warmup_steps)}; now {cfg.warmup_steps})")
    tips.append("pass --on-nonfinite skip to drop such steps")
    advice = ", ".join(tips[:-1]) + f", or {tips[-1]}" if len(tips) > 1 else tips[0]
    return f"{head}; {advice}; {resume_hint(cfg, folder, argv, lr=lower)}."


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


def train(cfg, mesh, return_model=False):
    """Run cfg.steps optimizer steps on this rank's part of the mesh; return the summary dict (and, with
    return_model, what `parallelize` built, trained: tests and lessons inspect .model, .raw, .optimizer)."""
    if cfg.out is None:
        raise ValueError("cfg.out is None: pass the run's folder (the command line claims a new runs/main-N itself, "
                         "picotron.runs)")
    is_logger = mesh.rank == 0
    torch.manual_seed(cfg.seed)
    tokenizer, loader = load_data(cfg, mesh)
    run = parallelize(cfg, mesh)
    activations = run.schedule.phases.listen(metrics.ActivationPeak(run.model))  # the step's peak (picotron.hooks)
    local = checkpoint.local_of(cfg, mesh)  # level 1's places (--local-save-every), or None
    injector = faults.Injector(cfg.faults, mesh.rank, mesh.world_size,  # --faults: deaths and NaNs on purpose
                               node_dir=local and local.folder(mesh.rank))
    speed = Speed(cfg, mesh, run.raw.config)  # tokens and FLOPs per step; the matmul peak that MFU divides by
    start, saver = start_or_resume(cfg, mesh, run, injector, local)  # step 1, or the step after a checkpoint's
    log = metrics.MetricsLog(cfg.out, enabled=is_logger, resume_step=start if start > 1 else None)
    if is_logger:
        announce(cfg, mesh, run, speed)
    history, t_start, warned = [], time.perf_counter(), False
    aux = bool(run.raw.config.num_local_experts and run.raw.config.router_aux_loss_coef)  # aux loss in the loss?
    try:
        with interruptible(announce=is_logger) as stop_asked:  # Ctrl-C: stop after this step, with a checkpoint
            for step in range(start, cfg.steps + 1):
                try:
                    record = one_step(step, cfg, mesh, run, loader, injector, saver, speed, activations)
                    if cfg.eval_every and (step % cfg.eval_every == 0 or step in (start, cfg.steps)):
                        record["val_loss"] = run.schedule.evaluate(run.raw, loader.val_batches(cfg.eval_batches),
                                                                   run.loss_fn)
                except KeyboardInterrupt:  # a second Ctrl-C: stop at once, without saving a half-done step
                    raise interrupted(cfg, saver, f"during step {step}/{cfg.steps}") from None
                log.write(record)
                history.append(record)
                if is_logger:
                    say_if_skipped(record, run.scaler)
                if cfg.save_every and step % cfg.save_every == 0:
                    saver.save(step, run)
                elif cfg.local_save_every and step % cfg.local_save_every == 0 and \
                        not (cfg.save_final and step == cfg.steps):  # (the last step's is level 2's)
                    saver.save(step, run, level=1)  # each rank's state on its node's disk and its peer's
                if is_logger and (step % cfg.log_every == 0 or step in (1, cfg.steps) or "val_loss" in record):
                    print(progress_line(record, cfg.steps, aux=aux), flush=True)
                if is_logger and not warned:
                    warned = warn_if_diverging(history, cfg)
                if step < cfg.steps and mesh.agree(stop_asked()):  # every rank stops after the same step
                    raise stop_after(step, cfg, run, saver)
        if cfg.save_final and saver.newest != checkpoint.step_dir(cfg.out, cfg.steps):
            saver.save(cfg.steps, run)  # the trained model, for --resume, --resume-from and picotron.export
        saver.close()  # the last write in flight ends before the run does
    except Stopped:
        log.close()  # the steps so far stay in metrics.jsonl
        raise
    summary = summarize(history, cfg, mesh, run, speed, elapsed_s=time.perf_counter() - t_start)
    summary["saves"] = save_times(saver.times)
    log.write(summary)
    log.close()
    if is_logger:
        print(done_line(history, summary, cfg.out), flush=True)
    if cfg.sample_tokens:  # every rank generates (the same text): under ZeRO-3 and tp each forward is collective
        text = sample_text(run.sampler, tokenizer, cfg, mesh.device)
        if is_logger:
            print("---- sample ----\n" + text + "\n----------------", flush=True)
    return (summary, run) if return_model else summary


def one_step(step, cfg, mesh, run, loader, injector, saver, speed, activations):
    """Optimizer step `step` on this rank: forward and backward of every micro-batch, clip, update; return its
    line of metrics.jsonl (without the validation loss: the loop adds it)."""
    model, optimizer, device = run.model, run.optimizer, mesh.device
    metrics.reset_device_peak(device)
    t0 = time.perf_counter()
    lr = lr_at(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = run.schedule.run(model, loader.micro_batches(step), injector.loss_fn(step, run.loss_fn))
    scale = run.scaler.scale  # fp16: the gradients are S times the gradient (S = 1 otherwise)
    grad_norm = clip_grad_norm(run.grad_params, cfg.grad_clip, mesh, grad_scale=scale)
    mem = model.memory()  # gradients still alive here
    loss_value = float(loss)  # .item(): waits for the device
    injector.maybe_kill("kill", step)  # mid-step: gradients computed, the update not yet applied
    finite, overflow = judge(step, loss_value, grad_norm, cfg, run.scaler, injector, saver)
    if finite:
        optimizer.step()
    model.zero_grad(set_to_none=True)
    metrics.sync(device)
    dt = time.perf_counter() - t0
    mem.update(optimizer=metrics.optimizer_bytes(optimizer), activations=activations.bytes,
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


def judge(step, loss_value, grad_norm, cfg, scaler, injector, saver):
    """(finite, overflow) after a step's backward: whether its update may apply, and whether fp16's dynamic loss
    scale overflowed (then S halves and the step is skipped; clean steps grow S: picotron.precision). Any other
    inf/NaN stops the run before the update, with --on-nonfinite stop (the same on every rank: all stop)."""
    finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
    overflow = scaler.dynamic and math.isfinite(loss_value) and not finite  # fp16: S too large
    scaler.update(overflow)
    if not finite and not overflow and cfg.on_nonfinite == "stop":
        saver.wait()
        raise Stopped(divergence_message(cfg, step, loss_value, grad_norm, step in injector.nan_steps,
                                         saver.newest), 1)
    return finite, overflow


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


def start_or_resume(cfg, mesh, run, injector, local=None):
    """(the first step to run, the checkpoint Saver): step 1, or with --resume (or a restart after a lost rank)
    the step after the newest checkpoint's, loaded into `run` in this layout (--resume-from: another run's).
    With level 1 (`local`), the newest step complete at either level: level 1's if it is newer than level 2's
    and every rank's shard survives on its node or on its peer (picotron.checkpoint.agreed_local)."""
    resume = cfg.resume or faults.attempt() > 0  # a restart after a lost rank resumes by itself
    try:  # several nodes: rank 0 picks the checkpoint, every rank must see it; and every rank must see OUT
        start, folder = 1, checkpoint.agreed_latest(cfg.out, mesh) if resume else None
        saver = checkpoint.Saver(cfg.out, cfg, mesh, keep=cfg.keep_checkpoints, asynchronous=cfg.async_save,
                                 on_write=lambda step: injector.maybe_kill("kill-save", step), local=local)
        # level 1 newer than level 2? (every rank asks: an all-gather over the writer's group, the same answer)
        level1 = checkpoint.agreed_local(saver, checkpoint.step_of(folder) if folder else 0) if resume else None
        if folder is None and level1 is None and cfg.resume_from:  # a new run from another run's checkpoint
            folder = runs.resolve_checkpoint(cfg.resume_from)
        if folder is None and level1 is None and cfg.resume:  # (on one node the command line refused this before)
            raise Stopped(f"picotron: error: --resume needs a checkpoint, but rank 0 sees none in {cfg.out}/checkpoints; "
                          f"start a new run without --resume, or pass the --out of a run with one.", 2)
    except checkpoint.NotShared as e:
        raise Stopped(f"picotron: error: {e}", 2) from None
    if level1:
        start = checkpoint.load_local(saver, *level1, run) + 1
    elif folder:
        start = reshard.load(folder, run, mesh) + 1
    if resume:
        saver.forget_local_after(start - 1)  # level-1 steps the failed attempt wrote after it are stale
    if mesh.rank == 0 and (resume or folder):
        why = f"restart {faults.attempt()}: " if faults.attempt() else ""
        if level1:
            step, lost, _ = level1
            peers = f", rank{'s' * (len(lost) > 1)} {', '.join(map(str, lost))} from the next node's copy" \
                if lost else ""
            print(f"{why}resuming from level 1 (node-local) step {step}{peers} at step {start}", flush=True)
        else:
            print(f"{why}resuming from {folder} at step {start}" if folder else  # (no folder: only a restart gets here)
                  f"{why}no checkpoint in {cfg.out}/checkpoints yet, starting from step 1", flush=True)
        for note in checkpoint.resume_notes(cfg, folder) if folder and not level1 else []:
            print(f"picotron: note: {note}", flush=True)
    if start > cfg.steps:
        raise Stopped(f"picotron: error: the checkpoint in {cfg.out} is at step {start - 1} >= --steps {cfg.steps}; "
                      f"nothing to do (raise --steps to train further).", 2)
    return start, saver


def announce(cfg, mesh, run, speed):
    """The start-up line: the grid, the model, the strategies, the batch, the precision, the matmul peak."""
    mc = run.raw.config
    changed = [f"{k}={getattr(cfg, k)}" for k in config.MODEL_FIELDS + tuple(config.MOE_FIELDS)
               if getattr(cfg, k) is not None]
    name = cfg.preset + (f" ({', '.join(changed)})" if changed else "")
    active = f" ({mc.num_params(active=True) / 1e6:.2f} M active per token)" if mc.is_moe else ""
    threads = torch.get_num_threads()
    print(f"picotron | {mesh} | model {name}: {mc.num_params() / 1e6:.2f} M parameters{active} | {run.description} | "
          f"{speed.tokens} tokens/step | {cfg.dtype} | recompute {cfg.recompute} | {threads} "
          f"thread{'s' if threads > 1 else ''}/process | measured {speed.at_start / 1e9:.1f} GFLOP/s matmul peak | "
          f"writes {cfg.out}", flush=True)
    if cfg.warmup_steps > cfg.steps:
        print(f"picotron: note: warmup_steps={cfg.warmup_steps} > steps={cfg.steps}, so the learning rate never "
              f"reaches lr={cfg.lr:g} (it ends at {lr_at(cfg.steps, cfg):.2g}); pass --warmup-steps "
              f"{max(0, cfg.steps // 10)} for a short run.", flush=True)


def say_if_skipped(record, scaler):
    """The line for a step that changed nothing: fp16's overflow, or an inf/NaN under --on-nonfinite skip."""
    step = record["step"]
    if record.get("overflow"):
        print(f"picotron: step {step} skipped: the fp16 gradients overflowed at loss scale "
              f"{record['loss_scale']:g}; the scale is now {scaler.scale:g}", flush=True)
    elif record.get("skipped"):
        print(f"picotron: step {step} skipped: loss {record['loss']}, gradient norm "
              f"{record['grad_norm']} (--on-nonfinite skip); the weights are those of step {step - 1}", flush=True)


def stop_after(step, cfg, run, saver):
    """Ctrl-C: the Stopped that ends the run after `step`, once that step's checkpoint is written."""
    saver.wait()
    if saver.newest != checkpoint.step_dir(cfg.out, step):
        saver.save(step, run)
    return interrupted(cfg, saver, f"after step {step}/{cfg.steps}")


def interrupted(cfg, saver, when):
    """The Stopped of a Ctrl-C (status 130), once the checkpoint writes in flight have ended: where to resume."""
    saver.wait()
    return Stopped(f"picotron: stopped: interrupted {when}; {resume_hint(cfg, saver.newest)}.", 130)


def summarize(history, cfg, mesh, run, speed, elapsed_s):
    """The run's last line of metrics.jsonl: speed over the steady steps, the final and validation losses."""
    steady = history[1:] or history  # the first step pays for warm-up (allocations, kernel selection)
    step_time = sum(r["step_time"] for r in steady) / len(steady)
    val_loss = next((r["val_loss"] for r in reversed(history) if "val_loss" in r), None)
    summary = {"summary": True, "steps": cfg.steps, "final_loss": history[-1]["loss"], "val_loss": val_loss,
               "tokens_per_s": speed.tokens / step_time,
               "mfu": speed.flops / step_time / (speed.peak * mesh.world_size),
               "peak_flops_measured": speed.peak, "peak_flops_measured_at_start": speed.at_start,
               "peak_flops_datasheet": speed.datasheet,
               "flops_per_token": speed.flops_per_token, "num_params": run.raw.config.num_params(),
               "elapsed_s": elapsed_s, "world_size": mesh.world_size,
               "device": str(mesh.device), "mem": history[-1]["mem"]}
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


def warn_if_diverging(history, cfg):
    """Print one warning, and return True, when the newest loss is well above the first of this start (1 nat and
    20% more): the model then predicts worse than it did untrained, which almost always means the learning rate is
    too high (--lr 0.9 climbs from 5.57 to 12.6 while every step is finite: --on-nonfinite never fires)."""
    first, now = history[0], history[-1]
    if not now["loss"] > first["loss"] + max(1.0, 0.2 * first["loss"]):
        return False
    smaller = Config.lr if cfg.lr > Config.lr else cfg.lr / 10
    print(f"picotron: warning: the loss rose from {first['loss']:.2f} at step {first['step']} to {now['loss']:.2f} at "
          f"step {now['step']}: the run is diverging, most likely because the learning rate is too high; stop it "
          f"(Ctrl-C) and pass a smaller --lr (e.g. --lr {smaller:.2g}; now {cfg.lr:g}).", flush=True)
    return True


def done_line(history, summary, out=None):
    """The last line: the losses, the speed and the time of this start (after a restart or --resume: since it
    resumed, which it says; every step of the run is in metrics.jsonl)."""
    val = f"val {summary['val_loss']:.3f}, " if summary["val_loss"] is not None else ""
    first, last = history[0]["step"], history[-1]["step"]
    part = "" if first == 1 else \
        f" (steps {first}-{last}, since resuming at step {first}; every step is in {out or 'OUT'}/metrics.jsonl)"
    return (f"done{part}: loss {history[0]['loss']:.3f} -> {summary['final_loss']:.3f}, {val}"
            f"{summary['tokens_per_s']:,.0f} tokens/s, MFU {100 * summary['mfu']:.1f}% of the measured matmul peak, "
            f"{summary['elapsed_s']:.0f} s")


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


def progress_line(r, steps, aux=True):
    """The progress line of a step; `aux`: show the load-balancing loss (False when its coefficient is 0: it is
    not part of the loss then, and a number beside the loss would read as if it were)."""
    mem = r["mem"]
    peak = mem["device_peak"] if mem["device_peak"] is not None else mem["rss_peak"]
    line = (f"step {r['step']:>5}/{steps} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | grad {r['grad_norm']:.2f} | "
            f"{r['tokens_per_s']:>9,.0f} tok/s | MFU {100 * r['mfu']:5.1f}% | act {metrics.human_bytes(mem['activations'])}"
            f" | peak {metrics.human_bytes(peak)}")
    if "moe" in r:  # the load-balancing loss (k when balanced) and the choices dropped by capacity
        line += (f" | aux {r['moe']['aux']:.3f}" if aux else "") + \
            (f" | dropped {r['moe']['dropped']}" if r["moe"]["dropped"] else "")
    return line + (f" | val {r['val_loss']:.4f}" if "val_loss" in r else "")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    under_launcher = "WORLD_SIZE" in os.environ  # torchrun (or a test harness) started this process
    # Checked before any process group exists; a broken rule exits 2 with one sentence: the settings (--resume: the
    # run's own, under the flags given now), the run folder, the strategies', the data and the devices
    # (`read_command`); then the folder is claimed.
    cfg = read_command(argv, under_launcher)
    cfg, argv = runs.folder(cfg, argv, under_launcher)  # claimed (a new run), and handed to the workers by --out
    if not under_launcher and (cfg.world_size > 1 or cfg.max_restarts or cfg.nnodes > 1):  # start them ourselves
        nodes = dict(nnodes=cfg.nnodes, node_rank=cfg.node_rank, rdzv_endpoint=cfg.rdzv_endpoint, rdzv_id=cfg.rdzv_id)
        os.environ[runs.CLAIMED] = os.path.abspath(cfg.out)  # the workers' folder, checked here: they need not again
        raise SystemExit(launch.torchrun_main("picotron.train", cfg.world_size // cfg.nnodes, argv,
                                              max_restarts=cfg.max_restarts,
                                              hint=lambda: resume_hint(cfg, checkpoint.latest(cfg.out), argv), **nodes))
    if os.environ.get("RANK", "0") == "0":  # tp / cp peers on different nodes: allowed, but say what it costs
        note = config.placement_note(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", cfg.world_size)))
        if note:
            print(f"picotron: warning: {note}", flush=True)
    try:
        mesh = Mesh.init(dp=cfg.dp, pp=cfg.pp, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep, timeout_s=cfg.timeout_s,
                         device=None if cfg.device == "auto" else cfg.device, collectives=cfg.collectives)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    # the one line that ends the job: from rank 0, and on several nodes from each node's first process too
    # (each node's console shows its own processes only)
    says = mesh.rank == 0 or (mesh.local_rank == 0 and int(os.environ.get("LOCAL_WORLD_SIZE", mesh.world_size))
                              < mesh.world_size)
    try:
        train(cfg, mesh)
    except Stopped as e:
        if says:
            print(e, file=sys.stderr, flush=True)
        raise SystemExit(e.code) from None
    except KeyboardInterrupt:  # before the first step (building the model, measuring the matmul peak)
        if says:
            print("picotron: stopped: interrupted before the first step; nothing was saved.", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    else:
        # every rank meets at a barrier first: then no rank's last collective is still being released by its
        # backend's thread while the interpreter shuts down (gloo on torch 2.5 aborts the process then)
        mesh.destroy(wait=True)
    finally:
        mesh.destroy()  # after an error: no barrier (a peer may be gone); after success: nothing left to do


if __name__ == "__main__":
    main(sys.argv[1:])
