"""Lesson 06 exercises: context parallelism by hand. Write the pieces marked EXERCISE, then
    ./run.sh python lessons/06_context_parallel/check.py                 # all exercises
    ./run.sh python lessons/06_context_parallel/check.py merge           # just one (or zigzag_positions, step_blocks,
                                                                         #   heads_send_buffer)
Exercise 1 is checked in this process against softmax attention computed whole (including scores of 1000, where
a merge that forms e^lse overflows), then inside picotron's real ring attention on 2 and 3 processes (gloo): the
checker swaps the library's merge for yours and names the rank whose output differs from full causal attention.
Exercises 2 and 3 are checked for several (seq_len, cp): the checker names the rank, the position or the block
that is wrong, and what your answer looks like instead (the contiguous layout, the ring turning the wrong way, a
causal block called whole...). Exercise 4 is checked by playing Ulysses' all-to-all between simulated ranks:
after it each rank must hold its group of heads over the whole sequence; the checker names a strided head group
and a reshape without the transpose. The lesson notebook (lessons/06_context_parallel/06_context_parallel.ipynb)
reads picotron/context_parallel.py, which does all of this for the whole model; the solutions are in solution.py
(look after trying).

What you may use:
    torch.logaddexp(a, b)     log(e^a + e^b), elementwise, computed without forming e^a or e^b
    torch.exp, torch.arange(lo, hi), torch.cat([t1, t2])
    t.unsqueeze(-1)           [..., q] -> [..., q, 1]: to weigh each query's row of an [..., q, d] output
    t.reshape(shape), t.transpose(i, j)   (a reshape keeps the elements' memory order; a transpose swaps two dims)
"""
import torch  # noqa: F401


def merge(out, lse, out_b, lse_b):
    """EXERCISE 1: attention over the union of two sets of keys, from each set's result.

    out, out_b   [..., q, d]: softmax attention of the same q queries over key set A and over key set B, each
                 normalised over its own keys: out = sum_j exp(s_j - lse) v_j over j in A
    lse, lse_b   [..., q]: the log-sum-exp of each query's scores over A and over B: lse = log sum_j exp(s_j)
    Return (out_ab, lse_ab): the attention over A and B together and its log-sum-exp. The first call of a ring
    has nothing merged yet: out and lse are None; return the second block as it is.

    Both results must stay finite in fp32 whatever the scores (the checker uses scores near 1000, where e^lse
    overflows): never form e^lse itself, only e^(lse - L) with L the new log-sum-exp."""
    raise NotImplementedError("not written yet")


def zigzag_positions(seq_len, cp, rank):
    """EXERCISE 2: the zig-zag index map. The sequence 0..seq_len-1 is cut into 2·cp equal chunks; rank `rank` holds
    chunk `rank` and chunk 2·cp-1-rank, in that order. Return the true positions of its seq_len/cp tokens, in its
    local order, as a 1-D integer tensor (these positions are what RoPE is given, and what the loader picks out of
    every row). Example: seq_len 8, cp 2: rank 0 holds [0, 1, 6, 7], rank 1 holds [2, 3, 4, 5]."""
    raise NotImplementedError("not written yet")


def step_blocks(rank, step, cp):
    """EXERCISE 3: what rank `rank` computes at ring step `step` (0 <= step < cp), zig-zag layout.

    At each step every rank sends the K/V block it holds to rank + 1 and receives one from rank - 1 (mod cp); at
    step 0 it holds its own. Its queries are its two chunks (exercise 2); the K/V it holds are the two chunks of the
    rank it came from. Return the list of (query chunk, key chunk, visibility) blocks it computes, visibility "all"
    (an earlier key chunk: seen whole) or "causal" (its own chunk: the causal mask inside it); a later key chunk is
    in the future of every query of the query chunk: skipped, not listed. Any order."""
    raise NotImplementedError("not written yet")


def heads_send_buffer(x, cp):
    """EXERCISE 4: Ulysses' all-to-all, the send side. x [b, H, t, d] is this rank's t = s/cp tokens of all H heads.
    The all-to-all (torch.distributed.all_to_all_single) cuts its input along dim 0 into cp blocks and sends block j
    to rank j; rank j must receive ITS group of heads, heads j·H/cp .. (j+1)·H/cp - 1 (contiguous: with GQA a group
    of query heads sits over its KV head). Return the buffer [cp, b, H/cp, t, d] whose block j (dim 0) is head group
    j. (After the exchange rank j holds every rank's tokens of its heads and lines them up along the sequence: that
    side, and the attention, are done for you: picotron/context_parallel.py, `seq_to_heads`.)"""
    raise NotImplementedError("not written yet")
