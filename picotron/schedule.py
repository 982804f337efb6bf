"""The step engine: a schedule runs one optimizer step's micro-batches through the model.

    loss = schedule.run(model, micro_batches, loss_fn)

`model` follows the gradient-sync protocol (`data_parallel.GradSync`), `micro_batches` is a list of
`data.Batch` (inputs, targets, positions; moved to the device as each is used), `loss_fn(logits, targets)`
the mean loss of one micro-batch. `run` leaves the step's gradients, synchronised, in the parameters and
returns the mean loss of the global batch, the same number on every rank. The optimizer step is not its
business.

`OneStage` is gradient accumulation: the whole model on this rank, k micro-batches one after the other,
each loss divided by k so the gradients add up to the gradient of the mean. The replicas exchange gradients
once, during the last backward (`no_sync` around the others). It is the trivial pipeline schedule, one stage;
with several stages `pipeline_parallel.Pipeline` runs AFAB, 1F1B, interleaved or zero-bubble schedules under
the same contract (and, given a one-stage schedule, does exactly what OneStage does).

The engine measures nothing itself: it names its phases (`self.phases`, picotron.hooks), "forward" and
"backward" of each micro-batch and the final "wait" for the gradient sync, and whoever measures listens (the
trainer counts activations with `metrics.ActivationPeak`, a lesson puts the phases on a timeline).
"""
from contextlib import nullcontext

import torch

from picotron import hooks


class OneStage:
    """Gradient accumulation over the micro-batches; the loss averaged over `replicas` (the dp x cp axis).
    `phases`: each micro-batch's "forward" and "backward" and the final "wait" for the gradient sync, for
    listeners (picotron.hooks)."""

    def __init__(self, replicas, device, autocast=nullcontext, tokens=None):
        self.replicas, self.device, self.autocast = replicas, device, autocast
        self.tokens = tokens  # the cp axis: ranks holding different tokens of the same rows (evaluation averages)
        self.phases = hooks.Phases()

    def _to_device(self, batch):
        """(inputs, targets, positions) on the device; positions None (0..s-1) for an (inputs, targets) pair."""
        x, y, *positions = (t.to(self.device, non_blocking=True) for t in batch)
        return x, y, (positions[0] if positions else None)

    def run(self, model, micro_batches, loss_fn):
        k, total = len(micro_batches), 0.0
        for i, batch in enumerate(micro_batches):
            x, y, positions = self._to_device(batch)
            with self.autocast(), (model.no_sync() if i < k - 1 else nullcontext()):
                with self.phases("forward", micro=i):
                    loss = loss_fn(model(x, positions), y) / k
                with self.phases("backward", micro=i):
                    loss.backward()
            total += loss.detach()
        with self.phases("wait"):
            model.finish_sync()  # the last backward started the sync: wait for it
        return self.replicas.mean(total)  # each replica saw its own rows: the mean over the global batch

    @torch.no_grad()
    def evaluate(self, model, batches, loss_fn):
        """The mean loss over `batches`, forward only (every rank runs it: ZeRO-3 and tp forwards are collective);
        under cp each rank sees its tokens of each batch, and the mean is taken over the cp ranks."""
        model.eval()
        losses = []
        for batch in batches:
            x, y, positions = self._to_device(batch)
            with self.autocast():
                loss = loss_fn(model(x, positions), y).float()
            losses.append((loss if self.tokens is None else self.tokens.mean(loss)).item())
        model.train()
        return sum(losses) / len(losses)
