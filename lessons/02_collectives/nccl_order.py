"""Lesson 02, "What NCCL does on a real node": the ring recorded on gloo and replayed under NCCL's rules.

`dozen_line_ring` runs this lesson's simplest ring all-reduce (experiment.simple_ring_all_reduce: a single
isend to the right and irecv from the left per step); `picotron_ring` runs picotron.collectives.all_reduce
(one batched exchange per step and piece). The notebook records both on every rank
(picotron.nccl_rules.run_recorded) and replays them as NCCL would run them.
"""
import torch
import torch.distributed as dist

import experiment
from picotron import collectives


def dozen_line_ring(numel=12):
    """All-reduce of a small tensor with the dozen-line ring; returns this rank's result as a list."""
    t = torch.arange(numel, dtype=torch.float32) + dist.get_rank()
    experiment.simple_ring_all_reduce(t)
    return t.tolist()


def picotron_ring(numel=12):
    t = torch.arange(numel, dtype=torch.float32) + dist.get_rank()
    collectives.all_reduce(t)
    return t.tolist()
