"""Lesson 07, "On a GPU pod": the pipeline's messages recorded on gloo and replayed under NCCL's rules.

`naive_1f1b` runs one 1F1B step of a toy two-stage model with its messages posted the way picotron's executor
first posted them — single isend/irecv on the pipeline group, the receive of the NEXT action posted before
this action's send — which gloo runs happily. `picotron_1f1b` runs one step of the real executor
(`picotron.pipeline_parallel.Pipeline`: a group per direction, one batch per message). The notebook records
both on every rank (picotron.nccl_rules.run_recorded) and replays them as NCCL would run them.
"""
import torch
import torch.distributed as dist

from picotron import pipeline_schedules as ps

HIDDEN = 16


def naive_1f1b(m=2):
    """One 1F1B step on p = world size toy stages (a tanh layer each); returns this rank's sum of outputs."""
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    w = torch.randn(HIDDEN, HIDDEN, requires_grad=True)
    acts = ps.one_f_one_b(p, m).ranks[rank]
    prev, nxt = rank - 1, rank + 1
    pending, saved, sends, total = {}, {}, [], 0.0

    def needs(a):  # (peer, key) this action receives from, or None
        if a.kind == "F" and rank > 0:
            return prev, ("F", a.mb)
        if a.kind == "B" and rank < p - 1:
            return nxt, ("B", a.mb)
        return None

    def post(a):
        src = needs(a)
        if src is not None and src[1] not in pending:
            buf = torch.empty(2, HIDDEN)
            pending[src[1]] = buf, dist.irecv(buf, src[0])  # a single message, posted one action ahead

    for k, a in enumerate(acts):
        post(a)
        if k + 1 < len(acts):
            post(acts[k + 1])
        got = None
        if needs(a) is not None:
            got, work = pending.pop(needs(a)[1])
            work.wait()
        if a.kind == "F":
            x = torch.ones(2, HIDDEN) * (a.mb + 1) if rank == 0 else got.requires_grad_()
            y = torch.tanh(x @ w)
            saved[a.mb] = x, y
            total += float(y.detach().sum())
            if rank < p - 1:
                sends.append(dist.isend(y.detach(), nxt))  # ... and the send after the compute
        else:
            x, y = saved.pop(a.mb)
            y.backward(torch.ones_like(y) if rank == p - 1 else got)
            if rank > 0:
                sends.append(dist.isend(x.grad, prev))
    for s in sends:
        s.wait()
    return total


def picotron_1f1b(m=2):
    """One step of picotron's own executor on the tiny model, pp = world size, 1F1B; returns the step's loss."""
    from picotron import train as train_mod
    from picotron.config import Config
    from picotron.mesh import Mesh
    from picotron.parallelize import parallelize

    cfg = Config(pp=dist.get_world_size(), pp_schedule="1f1b", grad_acc=m, seq_len=32, micro_batch_size=2)
    with Mesh.init(pp=cfg.pp) as mesh:
        _, loader = train_mod.load_data(cfg, mesh)
        run = parallelize(cfg, mesh)
        return float(run.schedule.run(run.model, loader.micro_batches(1), run.loss_fn))
