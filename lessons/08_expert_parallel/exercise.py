"""Lesson 08 exercises: a mixture-of-experts layer's bookkeeping by hand. Write the pieces marked EXERCISE, then
    ./run.sh python lessons/08_expert_parallel/check.py                  # all exercises
    ./run.sh python lessons/08_expert_parallel/check.py top_k_route      # just one (or dispatch_permutation, aux_loss,
                                                                         #   exchange_splits, deepseek_router_step,
                                                                         #   two_part_exposed)
Exercises 1-3 are checked in this process against picotron.moe on random routers (several token counts, E and k);
the checker names the token, expert or value that is wrong and recognises the usual mistakes (weights not
renormalised, an unstable sort, Switch's fraction normalised by k...). Exercise 4 runs on 2 and 4 real processes
(gloo): the checker names the rank whose splits are wrong. Exercise 5 (DeepSeek-V3's router) runs in this process, and
exercise 6 (the exposed time of --ep-overlap's two-part schedule) too, against picotron.planner. The lesson notebook
(lessons/08_expert_parallel/08_expert_parallel.ipynb) reads picotron/moe.py and picotron/expert_parallel.py,
which do all of this for the whole model; the solutions are in solution.py (look after trying).

What you may use:
    torch.softmax(x, dim=-1), t.topk(k, dim=-1) -> (values, indices), t.sum(-1, keepdim=True)
    torch.sigmoid(x), t.gather(-1, index), torch.sign(t)
    torch.argsort(t, stable=True), torch.bincount(t, minlength=E), t.flatten()
    torch.distributed.all_to_all_single(out, t, group=group)   (each rank's t cut in equal blocks, one per rank)
    torch.distributed.all_gather(list_of_tensors, t, group=group)
"""
import torch  # noqa: F401
import torch.distributed as dist  # noqa: F401


def top_k_route(logits, k):
    """EXERCISE 1: Mixtral's router. logits [n, E] (one row per token). Return (weights, experts), both [n, k]:
    the k most probable experts of each token (softmax over the E logits, in fp32) and their weights, the chosen
    probabilities renormalised to sum to 1 per token. Any order of the k choices within a token."""
    raise NotImplementedError("not written yet")


def dispatch_permutation(experts, num_experts):
    """EXERCISE 2: the dispatch permutation. experts [n, k]: each token's k chosen experts. Flatten the (token,
    choice) pairs token-major (pair p = token p // k, choice p % k) and return (order, counts): `order` [n·k] the
    pair indices sorted by expert, pairs of the same expert in token order (a stable sort), so that expert 0's
    pairs come first, then expert 1's...; `counts` [num_experts] how many pairs each expert got (zeros included)."""
    raise NotImplementedError("not written yet")


def aux_loss(probs, experts, num_experts):
    """EXERCISE 3: the load-balancing loss (Switch Transformers eq. 4, in Hugging Face Mixtral's form).
    probs [n, E]: every token's router probabilities; experts [n, k]: its chosen experts (n tokens). Return the
    scalar E · Σ_e f_e · P_e, with f_e = (pairs that chose expert e) / n (the number of TOKENS: Σ f_e = k) and P_e
    the mean probability of expert e over the tokens. It must be differentiable through probs (f is a count)."""
    raise NotImplementedError("not written yet")


def exchange_splits(counts, group=None):
    """EXERCISE 4 (runs on every rank of `group`, the ep ranks): counts [E] (int64) are this rank's rows for each
    global expert; rank j of the group holds experts j·E/ep .. (j+1)·E/ep - 1 (ep = the group's size). Return
    (send, recv), two lists of ep ints: send[j] = rows this rank sends to rank j, recv[j] = rows it receives from
    rank j (what rank j's send[this rank] is). The all-to-all of the rows needs both as its splits; the ranks
    only know their own counts, so they must exchange them first (one collective)."""
    raise NotImplementedError("not written yet")


def deepseek_router_step(logits, k, bias, gamma):
    """EXERCISE 5: DeepSeek-V3's router on one batch, then its bias update. logits [n, E], bias [E] (fp32), gamma
    a float. Return (weights, experts, new_bias): experts [n, k] = the k largest sigmoid(logits) + bias per token
    (the bias only CHOOSES); weights [n, k] = the chosen sigmoid(logits), without the bias, normalised to sum to 1
    per token; new_bias = bias + gamma · sign(mean load − load_i), load_i = how many of the n tokens chose expert
    i in this batch (an overloaded expert's bias goes down). Any order of the k choices within a token."""
    raise NotImplementedError("not written yet")


def two_part_exposed(a, c, s):
    """EXERCISE 6: the seconds of one pass of an MoE layer (its forward, say) that --ep-overlap's all-to-alls leave
    exposed (section 10). The routed rows travel in two parts: dispatch 1 and dispatch 2 are launched at once, the
    shared expert (s seconds) runs while they travel, part 1's experts (c seconds) run as soon as dispatch 1 has
    arrived, then combine 1 is launched and part 2's experts run once dispatch 2 has arrived, then combine 2.
    Each all-to-all takes a seconds on this rank's link, which carries ONE at a time, in launch order (dispatch 2
    starts when dispatch 1 is done; combine 1 waits for the link too); the compute runs one thing at a time.
    Return the end of combine 2 minus the compute (s + 2c): the time the layer took beyond its computation."""
    raise NotImplementedError("not written yet")
