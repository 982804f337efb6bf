"""Faults on purpose: kill a rank mid-step or mid-checkpoint, poison a loss, to show what survives.

    --faults "kill@7"             the last rank dies (SIGKILL, no goodbye) in the middle of step 7
    --faults "kill@7:r0,kill@13"  rank 0 dies in step 7; after the restart, the last rank dies in step 13
    --faults "kill-save@10:r1"    rank 1 dies while writing the checkpoint of step 10 (its file half written)
    --faults "nan@4"              the loss of step 4 is NaN on every rank (see --on-nonfinite)
    --faults "lose-node@9:r1"     rank 1's node is lost in step 9: its level-1 folder (--local-save-every) is
                                  deleted, then rank 1 dies; the restart finds that node's shards on its peer

A kill is real: the process gets SIGKILL between the backward and the optimizer step, while its peers wait
in a collective. torchrun sees the death and stops the other workers; with `--max-restarts N` it starts them
all again and the trainer resumes from the newest complete checkpoint (`picotron.train`). The i-th kill
listed fires in the i-th attempt only (torchrun's TORCHELASTIC_RESTART_COUNT, which picotron.launch.place reads
and the trainer passes in), so a restarted run is not
killed again at the same step: with faults at random steps the job still ends, with the final loss of the
run that never failed (the resume is exact).
"""
import os
import re
import shutil
import signal

_ITEM = re.compile(r"^(kill|kill-save|lose-node|nan)@(\d+)(?::r(\d+))?$")


def parse(spec):
    """[(kind, step, rank or None)] from a --faults string; ValueError with one sentence if it is malformed."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        m = _ITEM.match(item)
        if not m:
            raise ValueError(f"faults item {item!r} is not kill@STEP, kill-save@STEP, lose-node@STEP or nan@STEP (a "
                             f"rank as :rN after a kill, e.g. kill@7:r1); pass e.g. --faults \"kill@7,nan@12\".")
        out.append((m.group(1), int(m.group(2)), None if m.group(3) is None else int(m.group(3))))
    return out


def problem(cfg):
    """One sentence if cfg.faults cannot be used with this run, else None."""
    try:
        items = parse(cfg.faults)
    except ValueError as e:
        return str(e)
    for kind, step, rank in items:
        if not 1 <= step <= cfg.steps:
            return f"faults item {kind}@{step} is outside steps 1..{cfg.steps}; pick a step in that range."
        if rank is not None and rank >= cfg.world_size:
            return (f"faults item {kind}@{step}:r{rank} names rank {rank} but the run has {cfg.world_size} "
                    f"rank{'s' if cfg.world_size > 1 else ''}; pick r0..r{cfg.world_size - 1}.")
        saves = [k for k in (cfg.save_every, getattr(cfg, "local_save_every", 0)) if k]
        if kind == "kill-save" and not any(step % k == 0 for k in saves):
            return (f"faults item kill-save@{step} names a step without a checkpoint (save_every={cfg.save_every}); "
                    f"pick a multiple of --save-every (or of --local-save-every).")
    return None  # more kills than --max-restarts is allowed: the job then ends at a kill, which is worth seeing too


class Injector:
    """The faults of this run, for one rank: `maybe_kill(where, step)` and `loss_fn(step, loss_fn)`.
    node_dir: this rank's node's level-1 folder, which lose-node deletes (None: no level 1). attempt: which start
    of the job this is (0, then 1, 2, ... after each torchrun restart: picotron.launch.Place.attempt)."""

    def __init__(self, spec, rank, world_size, node_dir=None, attempt=0):
        self.rank, self.world_size, self.node_dir = rank, world_size, node_dir
        items = parse(spec or "")
        kills = [(k, s, r) for k, s, r in items if k != "nan"]
        mine = kills[attempt] if attempt < len(kills) else None  # this attempt's kill, if any
        self.kill = mine
        self.nan_steps = {s for k, s, _ in items if k == "nan"}

    def maybe_kill(self, where, step):
        """Die now (SIGKILL) if this attempt's kill is (where, step) on this rank."""
        if self.kill is None:
            return
        kind, at, rank = self.kill
        rank = self.world_size - 1 if rank is None else rank
        if kind.replace("lose-node", "kill") == where and at == step and rank == self.rank:
            if kind == "lose-node" and self.node_dir:  # the machine and its local disk are gone
                shutil.rmtree(self.node_dir, ignore_errors=True)
            print(f"picotron: fault injected: rank {self.rank} {'loses its node and ' * (kind == 'lose-node')}kills "
                  f"itself during {'step' if where == 'kill' else 'the checkpoint of step'} {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def loss_fn(self, step, loss_fn):
        """`loss_fn`, or at a nan@STEP step one whose loss (hence every gradient) is NaN on every rank."""
        if step not in self.nan_steps:
            return loss_fn
        return lambda logits, targets: loss_fn(logits, targets) * float("nan")
