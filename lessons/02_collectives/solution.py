"""Lesson 02, reference solutions. Try lessons/02_collectives/exercise.py first, then compare:
    ./run.sh python lessons/02_collectives/check.py                 # checks your file
    ./run.sh python lessons/02_collectives/check.py --solutions     # checks this one
"""
import math

import torch
import torch.distributed as dist


def _exchange(send_buf, dst, recv_buf, src):
    """Send one buffer and receive another at the same time. Posting both before waiting is what keeps a
    ring from deadlocking: with blocking send-then-recv every rank could sit in send, each waiting for its
    neighbour to post the matching recv."""
    requests = [dist.isend(send_buf, dst), dist.irecv(recv_buf, src)]
    for request in requests:
        request.wait()


def ring_all_gather(tensor: torch.Tensor) -> torch.Tensor:
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    pieces = [torch.empty_like(tensor) for _ in range(n)]
    pieces[rank].copy_(tensor)
    for step in range(n - 1):
        # forward what arrived in the previous step (at step 0: our own piece); receive the next one
        _exchange(pieces[(rank - step) % n], right, pieces[(rank - step - 1) % n], left)
    return torch.cat(pieces)


def ring_reduce_scatter(tensor: torch.Tensor) -> torch.Tensor:
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = [c.clone() for c in torch.tensor_split(tensor, n)]  # running sums; uneven sizes are fine
    for step in range(n - 1):
        send_idx, recv_idx = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = torch.empty_like(chunks[recv_idx])
        _exchange(chunks[send_idx], right, incoming, left)
        chunks[recv_idx] += incoming  # one more contribution to chunk recv_idx
    return chunks[rank]  # after n - 1 steps: all n contributions


def tree_broadcast(tensor: torch.Tensor, src: int) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    v = (rank - src) % n  # rank relative to the source: the source is 0
    mask = 1
    while mask < n:  # round j: mask = 2**j ranks have the data
        if v < mask and v + mask < n:
            dist.send(tensor, (v + mask + src) % n)
        elif mask <= v < 2 * mask:
            dist.recv(tensor, (v - mask + src) % n)
        mask *= 2


def allreduce_time(algorithm: str, n: int, nbytes: float, alpha: float, beta: float) -> float:
    if algorithm == "ring":  # 2(n - 1) steps one after the other, each moving one chunk of nbytes / n
        return 2 * (n - 1) * (alpha + nbytes / n * beta)
    rounds = math.ceil(math.log2(n))  # the ranks holding the data double each round
    return 2 * rounds * (alpha + nbytes * beta)  # reduce up the tree, then broadcast down: whole messages


def ring_or_tree(n: int, nbytes: float, alpha: float, beta: float) -> tuple:
    ring, tree = allreduce_time("ring", n, nbytes, alpha, beta), allreduce_time("tree", n, nbytes, alpha, beta)
    return ("ring", tree / ring) if ring <= tree else ("tree", ring / tree)
