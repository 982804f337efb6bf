"""Lesson 07, "On a GPU pod": the pipeline's messages recorded on gloo and replayed under NCCL's rules.

`naive_1f1b` runs one 1F1B step of a toy two-stage model with its messages posted the way picotron's executor
first posted them — single isend/irecv on the pipeline group, the receive of the NEXT action posted before
this action's send — which gloo runs happily. `direction_groups_1f1b` is its second version: the same order,
each message one batch on a group of its direction (0 -> 1 and 1 -> 0). `picotron_1f1b` runs one step of the
real executor (`picotron.pipeline_parallel.Pipeline`: the messages in the one order of
`pipeline_schedules.with_messages`, one batch each on the group of the two ranks). The notebook records them on
every rank (picotron.nccl_rules.run_recorded) and replays them as NCCL would run them.
"""
import torch
import torch.distributed as dist

from picotron import pipeline_schedules as ps

HIDDEN = 16


def naive_1f1b(m=2, by_direction=False):
    """One 1F1B step on p = world size toy stages (a tanh layer each); returns this rank's sum of outputs.
    by_direction: each message one batch on the group of its direction instead of a single isend / irecv."""
    rank, p = dist.get_rank(), dist.get_world_size()
    if by_direction:  # every rank makes every group, in one order: new_group is collective
        down = {r: dist.new_group([r, r + 1]) for r in range(p - 1)}  # r -> r + 1 (activations)
        up = {r: dist.new_group([r, r + 1]) for r in range(p - 1)}    # r + 1 -> r (gradients)

    def message(op, t, peer):
        if not by_direction:
            return (dist.isend if op == "send" else dist.irecv)(t, peer)
        forward = (op == "send") == (peer > rank)  # the message travels towards the last stage
        group = (down if forward else up)[min(rank, peer)]
        return dist.batch_isend_irecv([dist.P2POp(dist.isend if op == "send" else dist.irecv, t, peer, group)])[0]
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
            pending[src[1]] = buf, message("recv", buf, src[0])  # posted one action ahead

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
                sends.append(message("send", y.detach(), nxt))  # ... and the send after the compute
        else:
            x, y = saved.pop(a.mb)
            y.backward(torch.ones_like(y) if rank == p - 1 else got)
            if rank > 0:
                sends.append(message("send", x.grad, prev))
    for s in sends:
        s.wait()
    return total


def direction_groups_1f1b(m=2):
    """naive_1f1b's order with each message one batch on the group of its direction (the executor's second
    version): every communicator carries one direction, in the order both ends post it."""
    return naive_1f1b(m, by_direction=True)


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
