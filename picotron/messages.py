"""What the trainer says: its lines and one-sentence stops, built from the run's settings and records.

    startup_lines      the start-up line (grid, model, strategies, batch, precision, matmul peak) and a note
    progress_line      one step's line: loss, lr, gradient norm, tokens/s, MFU, memory (MoE: aux, dropped)
    skipped_line       a step that changed nothing: fp16's overflow, or an inf/NaN under --on-nonfinite skip
    warn_if_diverging  one warning when the loss climbs well above the first (a learning rate too high)
    done_line          the last line: the losses, the speed and the time of this start
    divergence_message why the run stopped at a non-finite step, and advice that fits its settings
    resume_hint        where the newest checkpoint is, and the exact command that continues from it
    CTRL_C, INTERRUPTED_EARLY   what Ctrl-C prints, and a stop before the first step

`Stopped` is how the run ends on purpose (a divergence, Ctrl-C, a refusal after the process group formed): its
message is the one line for the user, its code the exit status; picotron.train's main prints it.

The commands a message hands back are the user's own (picotron.runs.command: their launcher and flags), or for a
run started from Python (a test, a lesson: no command line of its own) built from its settings
(picotron.runs.flags_of), never from sys.argv.
"""
from picotron import runs
from picotron.metrics import human_bytes
from picotron.config import MODEL_FIELDS, MOE_FIELDS, Config

CTRL_C = "\npicotron: Ctrl-C: stopping after this step (press it again to stop at once)"
INTERRUPTED_EARLY = "picotron: stopped: interrupted before the first step; nothing was saved."


class Stopped(Exception):
    """The run stopped early on purpose: `message` is the one line for the user, `code` the exit status."""

    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


def resume_hint(cfg, folder, argv=None, lr=None):
    """Where the newest checkpoint is and the exact command that continues from it, as the user would paste it
    (picotron.runs.command: their launcher and flags `argv`, without --faults: an injected fault would fire
    again; argv None, a run started from Python: the flags of its settings), or that there is none and the
    command that starts again."""
    argv = runs.flags_of(cfg) if argv is None else argv
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


def interrupted(cfg, folder, when, argv=None):
    """The Stopped of a Ctrl-C (status 130): when it stopped, and where to resume."""
    return Stopped(f"picotron: stopped: interrupted {when}; {resume_hint(cfg, folder, argv)}.", 130)


def startup_lines(cfg, mesh, run, speed, threads, end_lr):
    """The start-up line: the grid, the model, the strategies, the batch, the precision, the matmul peak; and a
    note when the warm-up is longer than the run (`end_lr`: the learning rate at the last step)."""
    mc = run.raw.config
    changed = [f"{k}={getattr(cfg, k)}" for k in MODEL_FIELDS + tuple(MOE_FIELDS) if getattr(cfg, k) is not None]
    name = cfg.preset + (f" ({', '.join(changed)})" if changed else "")
    active = f" ({mc.num_params(active=True) / 1e6:.2f} M active per token)" if mc.is_moe else ""
    lines = [f"picotron | {mesh} | model {name}: {mc.num_params() / 1e6:.2f} M parameters{active} | "
             f"{run.description} | {speed.tokens} tokens/step | {cfg.dtype} | recompute {cfg.recompute} | {threads} "
             f"thread{'s' if threads > 1 else ''}/process | measured {speed.at_start / 1e9:.1f} GFLOP/s matmul peak | "
             f"writes {cfg.out}"]
    if cfg.warmup_steps > cfg.steps:
        lines.append(f"picotron: note: warmup_steps={cfg.warmup_steps} > steps={cfg.steps}, so the learning rate never "
                     f"reaches lr={cfg.lr:g} (it ends at {end_lr:.2g}); pass --warmup-steps "
                     f"{max(0, cfg.steps // 10)} for a short run.")
    return lines


def skipped_line(record, scale):
    """The line for a step that changed nothing (fp16's overflow, or an inf/NaN under --on-nonfinite skip), or
    None; `scale`: fp16's loss scale now."""
    step = record["step"]
    if record.get("overflow"):
        return (f"picotron: step {step} skipped: the fp16 gradients overflowed at loss scale "
                f"{record['loss_scale']:g}; the scale is now {scale:g}")
    if record.get("skipped"):
        return (f"picotron: step {step} skipped: loss {record['loss']}, gradient norm "
                f"{record['grad_norm']} (--on-nonfinite skip); the weights are those of step {step - 1}")
    return None


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


def progress_line(r, steps, aux=True):
    """The progress line of a step; `aux`: show the load-balancing loss (False when its coefficient is 0: it is
    not part of the loss then, and a number beside the loss would read as if it were)."""
    mem = r["mem"]
    peak = mem["device_peak"] if mem["device_peak"] is not None else mem["rss_peak"]
    line = (f"step {r['step']:>5}/{steps} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | grad {r['grad_norm']:.2f} | "
            f"{r['tokens_per_s']:>9,.0f} tok/s | MFU {100 * r['mfu']:5.1f}% | act {human_bytes(mem['activations'])}"
            f" | peak {human_bytes(peak)}")
    if "moe" in r:  # the load-balancing loss (k when balanced) and the choices dropped by capacity
        line += (f" | aux {r['moe']['aux']:.3f}" if aux else "") + \
            (f" | dropped {r['moe']['dropped']}" if r["moe"]["dropped"] else "")
    return line + (f" | val {r['val_loss']:.4f}" if "val_loss" in r else "")
