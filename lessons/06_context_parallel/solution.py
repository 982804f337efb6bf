"""Lesson 06 exercises — reference solutions. (The exercise file, lessons/06_context_parallel/exercise.py, is the
same file with the marked pieces left to write.)"""
import torch


def merge(out, lse, out_b, lse_b):
    """EXERCISE 1: the attention over the union of two key sets from each set's output and log-sum-exp."""
    if out is None:  # the first block: nothing to merge with yet
        return out_b, lse_b
    new = torch.logaddexp(lse, lse_b)  # log(e^lse + e^lse_b), without ever forming e^lse
    w, w_b = torch.exp(lse - new), torch.exp(lse_b - new)  # each <= 1, and w + w_b = 1
    return out * w.unsqueeze(-1) + out_b * w_b.unsqueeze(-1), new


def zigzag_positions(seq_len, cp, rank):
    """EXERCISE 2: the true positions of the tokens `rank` holds under the zig-zag layout, in its local order."""
    c = seq_len // (2 * cp)  # 2·cp chunks of c tokens
    first, second = rank, 2 * cp - 1 - rank  # one early chunk, one late chunk
    return torch.cat([torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)])


def step_blocks(rank, step, cp):
    """EXERCISE 3: the blocks `rank` computes at ring step `step` (zig-zag layout)."""
    src = (rank - step) % cp  # each step every rank receives from rank - 1: after j steps it holds rank - j's K/V
    mine, theirs = (rank, 2 * cp - 1 - rank), (src, 2 * cp - 1 - src)
    out = []
    for q in mine:
        for k in theirs:
            if k < q:
                out.append((q, k, "all"))  # an earlier chunk: seen whole
            elif k == q:
                out.append((q, k, "causal"))  # its own chunk: the causal mask inside it
    return out  # k > q: a later chunk, skipped


def heads_send_buffer(x, cp):
    """EXERCISE 4: Ulysses' send buffer: this rank's tokens of every head, cut into one head group per rank."""
    b, h, t, d = x.shape
    blocks = x.reshape(b, cp, h // cp, t, d)  # head h = group j·(h/cp) + i: contiguous groups
    return blocks.transpose(0, 1)  # [cp, b, h/cp, t, d]: block j (dim 0) = head group j, for rank j
