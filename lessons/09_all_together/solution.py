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


def memory_by_part(params, layout, activations, stage):
    """EXERCISE 3: bf16 mixed precision holds 2 + 2 + 12 bytes per parameter; ZeRO cuts them over the dp x cp ranks
    (the ranks that hold the same parameters), stage by stage; 1F1B keeps pp - stage micro-batches alive, at most m."""
    shard = layout.dp * layout.cp
    z = layout.zero
    alive = min(layout.pp - stage, layout.grad_acc)
    return {"params": 2 * params / (shard if z >= 3 else 1),
            "grads": 2 * params / (shard if z >= 2 else 1),
            "optimizer": 12 * params / (shard if z >= 1 else 1),
            "activations": activations * alive}


def choose(candidates, memory_gib, step_seconds, budget_gib, global_seqs):
    """EXERCISE 4 (budget_gib: 71.7 GiB, an H100's 79.6 less 10% headroom; then 35.6 GiB, an A100 40GB's 39.6 less
    10%): (1) fit in memory, (2) reach the global batch, (3) the fastest of what is left: with the same
    batch for all, the shortest step is the most tokens per second."""
    rejected, kept = [], []
    for layout in candidates:
        if memory_gib(layout) > budget_gib:
            rejected.append((layout, "memory"))
        elif layout.dp * layout.micro_batch_size * layout.grad_acc != global_seqs:
            rejected.append((layout, "batch"))
        else:
            kept.append(layout)
    best = min(kept, key=step_seconds) if kept else None
    return best, rejected


def clock_shifts(markers, hosts):
    """EXERCISE 5: each machine's ranks shifted together, by the earliest of its ranks' barrier marks: the first to
    leave the barrier is the closest to the instant it released everyone; the others were late for a core."""
    first = {}
    for rank, t in markers.items():
        first[hosts[rank]] = min(t, first.get(hosts[rank], t))
    return {rank: first[hosts[rank]] for rank in markers}
