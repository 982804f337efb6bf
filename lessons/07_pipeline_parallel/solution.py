"""Lesson 07 exercises — reference solutions. (The exercise file, lessons/07_pipeline_parallel/exercise.py, is the
same file with the marked pieces left to write.)"""
import torch
import torch.distributed as dist

from picotron.pipeline_schedules import Action


def one_f_one_b_rank(i, p, m):
    """EXERCISE 1: stage i's 1F1B action list."""
    warm = min(p - i - 1, m)  # the forwards that must run before the first backward can come back to stage i
    acts = [Action("F", k, 0) for k in range(warm)]
    for k in range(m - warm):  # steady state: one forward, then the backward of the oldest micro-batch in flight
        acts += [Action("F", warm + k, 0), Action("B", k, 0)]
    acts += [Action("B", k, 0) for k in range(m - warm, m)]  # cool-down: the backwards still owed
    return acts


def forward_step(stage, x, prev, next, shape, group=None):
    """EXERCISE 2: one forward step of a pipeline stage."""
    if prev is not None:  # not the first stage: the activation comes from the previous rank
        x = torch.empty(shape)
        dist.irecv(x, src=prev, group=group).wait()
        x.requires_grad_()  # its gradient is what the backward sends back to `prev`
    y = stage(x)
    if next is not None:  # not the last stage: hand the output on (detached: autograd stays on this rank)
        dist.isend(y.detach().contiguous(), dst=next, group=group).wait()
    return x, y


def sync_tied_grads(embedding, head, group=None):
    """EXERCISE 3: both copies of a tied matrix get the sum of their gradients."""
    if embedding is not None and head is not None:  # one rank holds both ends (the V shape): no message
        embedding.grad.add_(head.grad)
        head.grad.copy_(embedding.grad)
        return
    for w in (embedding, head):
        if w is not None:  # only the first and the last stage call it: the group holds those two ranks
            dist.all_reduce(w.grad, group=group)


def dualpipe_place(stage, mb, p, m):
    """EXERCISE 4: DualPipe's (rank, chunk) for a stage of a micro-batch."""
    if mb < m // 2:  # fed in at rank 0: the chunks 0, stage s on rank s
        return stage, 0
    return p - 1 - stage, 1  # fed in at rank p-1: the copies, stage s on rank p-1-s
