"""Lesson 07 exercises: pipeline parallelism by hand. Write the pieces marked EXERCISE, then
    ./run.sh python lessons/07_pipeline_parallel/check.py                      # all exercises
    ./run.sh python lessons/07_pipeline_parallel/check.py one_f_one_b_rank     # just one (or forward_step, sync_tied_grads,
                                                                               # dualpipe_place)
Exercise 1 is checked by picotron's simulator: your list for stage r (the argument i) runs together with the reference lists of
the other stages, for several (p, m); the checker names the first action that cannot run (a deadlock and who
waits for whom, a B before its F, a micro-batch missing or twice) and, when it runs, whether it keeps 1F1B's
memory (at most p - r micro-batches) and its step time. Exercises 2 and 3 run on 2 and 3 real processes (gloo)
and say which rank holds what wrong tensor, or which rank hangs on which line of this file. Exercise 4 is checked
against picotron's DualPipe schedule for several (p, m), and the checker says what your placement mixes up. The lesson notebook
(lessons/07_pipeline_parallel/07_pipeline_parallel.ipynb) reads picotron/pipeline_schedules.py and pipeline_parallel.py,
which do all of this for the whole model; the solutions are in solution.py (look after trying).

What you may use:
    Action(kind, mb, chunk)     kind "F" (forward) or "B" (backward); mb the micro-batch 0..m-1; chunk 0 here
    dist.irecv(t, src=r, group=group) / dist.isend(t, dst=r, group=group)
                                start receiving into / sending tensor t from / to global rank r; each returns a
                                request whose .wait() blocks until the message is through
    dist.all_reduce(t, group=group)   every rank of `group` gets the sum of their `t`, IN PLACE; every rank of
                                the group must call it, and a rank outside the group must not
"""
import torch  # noqa: F401
import torch.distributed as dist  # noqa: F401

from picotron.pipeline_schedules import Action  # noqa: F401


def one_f_one_b_rank(i, p, m):
    """EXERCISE 1: the 1F1B schedule of ONE stage, as data: the ordered list of Actions stage i (0 <= i < p; the lesson's r) runs
    for one step of m micro-batches.

    Stage i cannot start the backward of micro-batch 0 before it has come through the stages after it and back,
    so it first runs a few forwards (the warm-up: how many keep stage i busy until then?); then it alternates one
    forward and one backward (the oldest micro-batch in flight) until the forwards run out; then it runs the
    backwards still owed (the cool-down). Every micro-batch has exactly one F and one B on each stage, its F first.
    Use Action("F", k, 0) and Action("B", k, 0). (m may be smaller than p.)"""
    raise NotImplementedError("not written yet")


def forward_step(stage, x, prev, next, shape, group=None):
    """EXERCISE 2: one forward step of a pipeline stage, with its messages.

    stage   this rank's layers (a module: y = stage(x))
    x       the input: the batch on the first stage (prev is None); None on the others
    prev    the global rank of the previous stage, or None on the first stage
    next    the global rank of the next stage, or None on the last stage
    shape   the shape of the activation that arrives from `prev` (float32)

    On a stage after the first, receive the activation from `prev` (irecv into a new float32 tensor of `shape`,
    wait for it), and make it require a gradient (the backward will need x.grad to send back). Run the stage. On a
    stage before the last, send the output on to `next` (isend, and wait before returning); send the output
    detached from the graph: autograd stays on this rank. Return (x, y): the input this stage computed from and its
    output (with its graph)."""
    raise NotImplementedError("not written yet")


def sync_tied_grads(embedding, head, group=None):
    """EXERCISE 3: keep tied embeddings equal across stages.

    When the LM head shares the embedding matrix, the first stage holds it as its embedding and the last stage
    holds a copy as its head; both start equal. After the backward, each copy's .grad holds only what its own
    stage contributed; the true gradient of the shared matrix is their SUM. Make both copies' gradients that sum,
    so the optimizer moves them alike and they stay equal.

    embedding   the first stage's copy (a Parameter with .grad) on the first stage's rank, else None
    head        the last stage's copy on the last stage's rank, else None
    group       a process group of exactly the first and the last stage's ranks (None when one rank holds both)
    Every rank calls this; a middle stage gets (None, None) and must do nothing. When one rank holds both copies
    (one stage, or the V shape), add them in memory: no message."""
    raise NotImplementedError("not written yet")


def dualpipe_place(stage, mb, p, m):
    """EXERCISE 4: where DualPipe runs stage `stage` (0 <= stage < p) of micro-batch `mb` (0 <= mb < m): the pair
    (rank, chunk).

    Rank r holds two chunks: chunk 0 is stage r, chunk 1 a copy of stage p-1-r. Micro-batches 0..m/2-1 enter at
    rank 0 and travel down on the chunks 0 (stage s on rank s); micro-batches m/2..m-1 enter at rank p-1 and travel
    up on the chunks 1: their stage 0 runs on rank p-1, their last stage on rank 0. (p and m are even, m >= 2p.)"""
    raise NotImplementedError("not written yet")
