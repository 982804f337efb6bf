"""Lesson 02 exercises: three collectives from point-to-point messages, and a puzzle (ring or tree?). Write each
function, then run
    ./run.sh python lessons/02_collectives/check.py                      # all exercises, on 2, 3 and 4 processes
    ./run.sh python lessons/02_collectives/check.py ring_all_gather      # just one
    ./run.sh python lessons/02_collectives/check.py ring_or_tree         # the puzzle
The checker starts real processes (gloo, one default process group: rank = dist.get_rank(), n =
dist.get_world_size()), runs your function on every rank and tells you which rank is wrong, where, and why
— or which ranks hang. Use only dist.send / dist.recv / dist.isend / dist.irecv (the checker switches the
built-in collectives off). Solutions: lessons/02_collectives/solution.py (look after trying).

Reminders (torch.distributed):
    req = dist.isend(tensor, dst)    start sending; returns at once, `req.wait()` before touching `tensor` again
    req = dist.irecv(buffer, src)    start receiving into `buffer` (right shape and dtype); `req.wait()`
    dist.send(tensor, dst), dist.recv(buffer, src)   the blocking versions
A blocking send and a blocking recv posted in the wrong order on two ranks can wait for each other forever:
in a ring, start the send and the receive together (isend + irecv, then wait for both).
"""
import torch
import torch.distributed as dist


def ring_all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """All-gather around a ring. Every rank holds a 1-D `tensor` of the same length L; return a new 1-D
    tensor of length n*L that is every rank's tensor concatenated in rank order (rank 0's first), the same
    on every rank (what dist.all_gather_into_tensor computes).

    The ring: rank r only ever sends to its right neighbour (r + 1) % n and receives from its left
    neighbour (r - 1) % n. Keep n pieces; start with your own in slot r. In step j = 0 .. n-2 send the
    piece in slot (r - j) % n to the right, and receive the piece for slot (r - j - 1) % n from the left.
    Every rank sends n - 1 messages of L elements: (n-1)/n of the output, the least anyone can."""
    raise NotImplementedError("not written yet")


def ring_reduce_scatter(tensor: torch.Tensor) -> torch.Tensor:
    """Reduce-scatter (sum) around a ring. Every rank holds a 1-D `tensor` of the same length L (any L >= n,
    not necessarily a multiple of n). Cut it into n chunks with torch.tensor_split(tensor, n) (the first
    L % n chunks are one element longer). Return, on rank r, chunk r of the element-wise SUM over all ranks
    — a new tensor of that chunk's length; do not change `tensor`.

    The ring: in step j = 0 .. n-2, rank r sends its running sum of chunk (r - j - 1) % n to the right
    neighbour, receives the left neighbour's running sum of chunk (r - j - 2) % n and adds it into its own.
    After n - 1 steps, chunk r on rank r has collected all n contributions."""
    raise NotImplementedError("not written yet")


def tree_broadcast(tensor: torch.Tensor, src: int) -> None:
    """Broadcast along a binomial tree, in place, like dist.broadcast(tensor, src): afterwards every rank's
    `tensor` holds src's values. Return nothing.

    Number the ranks relative to the source, v = (rank - src) % n. In round j = 0, 1, 2, ... (while 2**j < n)
    the ranks that already have the data (v < 2**j) send it to v + 2**j (if that is < n), and the ranks with
    2**j <= v < 2**(j+1) receive it from v - 2**j. Convert relative ranks back with (v + src) % n. The data
    reaches everyone in ceil(log2 n) rounds, and no rank sends more than ceil(log2 n) messages."""
    raise NotImplementedError("not written yet")


# ------------------------------------------------------------------------------ puzzle: ring or tree?
def allreduce_time(algorithm: str, n: int, nbytes: float, alpha: float, beta: float) -> float:
    """Seconds that an all-reduce of `nbytes` bytes over `n` ranks takes in the alpha-beta model:
        "ring": picotron's all_reduce — a ring reduce-scatter, then a ring all-gather (the tensor cut in n chunks);
        "tree": picotron's naive_all_reduce — a binomial-tree reduce onto one rank, then a binomial-tree
                broadcast from it, the whole tensor at every hop.
    The model: one message costs alpha seconds plus beta seconds per byte; every rank can send one message and receive
    one at the same time; a message that needs the data of an earlier one waits for it. Count the steps (or
    rounds) that must happen one after the other and what each one moves."""
    raise NotImplementedError("not written yet")


def ring_or_tree(n: int, nbytes: float, alpha: float, beta: float) -> tuple:
    """Which all-reduce is faster here, and by how much: ("ring" or "tree", T_slower / T_faster), a factor >= 1.
    Use allreduce_time. Then answer the notebook's questions with this machine's alpha and beta."""
    raise NotImplementedError("not written yet")
