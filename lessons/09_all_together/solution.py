"""Lesson 09 exercises — reference solutions. (The exercise file, lessons/09_all_together/exercise.py, is the
same file with the marked pieces left to write.)"""
ORDER = ("dp", "pp", "cp", "tp")  # slowest- to fastest-varying


def place(rank, sizes):
    """EXERCISE 1: peel the coordinates off the rank, fastest axis (tp) first; a group along an axis = every rank
    that agrees with this one on the other three coordinates."""
    coords, r = {}, rank
    for d in reversed(ORDER):
        r, coords[d] = divmod(r, sizes[d])
    coords = {d: coords[d] for d in ORDER}
    groups = {}
    for axis in ORDER:
        ranks = []
        for i in range(sizes[axis]):
            c = dict(coords, **{axis: i})
            ranks.append(((c["dp"] * sizes["pp"] + c["pp"]) * sizes["cp"] + c["cp"]) * sizes["tp"] + c["tp"])
        groups[axis] = ranks
    return coords, groups


def step_batch(global_batch_tokens, seq_len, micro_batch_size, sizes):
    """EXERCISE 4: only the dp replicas read different sequences (cp cuts each sequence, tp and pp cut the model);
    the rest is gradient accumulation; 1F1B idles (pp - 1) of (m + pp - 1) slots."""
    if global_batch_tokens % seq_len:
        raise ValueError(f"{global_batch_tokens} tokens are not a whole number of {seq_len}-token sequences")
    sequences = global_batch_tokens // seq_len
    per_step = sizes["dp"] * micro_batch_size
    if sequences % per_step:
        raise ValueError(f"{sequences} sequences are not a multiple of dp x micro-batch = {per_step}")
    grad_acc = sequences // per_step
    return dict(sequences=sequences, grad_acc=grad_acc,
                tokens_per_micro_batch=micro_batch_size * seq_len // sizes["cp"],
                bubble=(sizes["pp"] - 1) / (grad_acc + sizes["pp"] - 1))
