"""Point-to-point messages posted the way NCCL needs them: every exchange is ONE `batch_isend_irecv`.

gloo forgives a lot that NCCL does not. On NCCL:
- single `isend`/`irecv` between two ranks run on one communicator and one CUDA stream for BOTH directions,
  in the order they were posted, tags ignored, and a receive holds that stream until its send arrives. So if
  rank 0 posts "receive from 1, then send to 1" while rank 1 posts the same, both streams wait forever;
- the first single message between two ranks creates their communicator, which blocks the host until the
  peer reaches its own first message to us: a ring in which every rank first receives from its left hangs.
A batch (`batch_isend_irecv`) is one grouped NCCL call on the group's own communicator (made when the group
was made): all its sends and receives are posted together, so the order inside it does not matter, and it
meets the peers' batches in the order every rank posts them. Batches alone are not enough: NCCL asks that the
operations on ALL of a rank's communicators be submitted in one order its peers follow too (a GPU may run one NCCL
kernel at a time), so whoever posts batches on several groups keeps them in such an order (the pipeline:
pipeline_schedules.with_messages). Megatron-LM and torch.distributed.pipelining post their pipeline messages this
way; `tests/test_nccl_rules.py` replays every layout's messages under these rules (picotron.nccl_rules) to prove
that ours never wait on each other.

On gloo a batch is just its isend/irecv in order (tags kept), so the same code runs on a laptop.
"""
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d


def exchange(ops, group=None):
    """Post `ops` — [("send" | "recv", tensor, global peer rank), ...] — as one batch; return the handles
    (wait on all of them; on NCCL the batch completes as a whole). Empty tensors and an empty list post nothing.

    When somebody has wrapped dist.isend / dist.irecv for themselves (lesson 02's message counters do), the
    ops go through those wrappers one by one, in the same order."""
    ops = [(kind, t, peer) for kind, t, peer in ops if t.numel()]
    if not ops:
        return []
    isend, irecv = dist.isend, dist.irecv
    if isend is not _c10d.isend or irecv is not _c10d.irecv:  # wrapped by a lesson's tool: keep them in the loop
        return [(isend if kind == "send" else irecv)(t, peer, group) for kind, t, peer in ops]
    return dist.batch_isend_irecv([dist.P2POp(isend if kind == "send" else irecv, t, peer, group)
                                   for kind, t, peer in ops])


def wait_all(works):
    for w in works:
        w.wait()
