"""A mixture-of-experts feed-forward (Mixtral's sparse MoE block), written to be read.

A dense layer's MLP is replaced by E expert MLPs and a router; each token goes to k of them (Shazeer et al.
2017; Fedus et al. 2022, "Switch Transformers"; Jiang et al. 2024, "Mixtral of Experts"):

    n = x @ gate.weightᵀ                      [tokens, E]   the router's logits
    p = softmax(n)                            [tokens, E]   (in fp32)
    w, e = top-k(p); w = w / Σw               [tokens, k]   Mixtral: softmax first, then top-k, renormalised
    y_t = Σ_j w_tj · Expert_{e_tj}(x_t)       Expert = SwiGLU: w2(silu(w1 x) * w3 x)

Parameters grow with E, FLOPs per token with k: Mixtral-8x7B holds 46.7 B parameters but each token passes
through 2 of 8 experts, about 12.9 B. The price is the bookkeeping: the tokens of a batch are regrouped by
expert (the *dispatch*), each expert runs on its rows, and the outputs are put back in token order, weighted
(the *combine*). Here the regrouping is one stable sort of the (token, choice) pairs by expert:

    pairs  (t0,e=2) (t0,e=0) (t1,e=1) (t1,e=2) ...      flattened top-k choices, token-major
    order  argsort(e, stable)                          -> expert 0's rows, then expert 1's, ...
    rows   x[order // k]                               each expert's tokens, contiguous, in token order
    out    index_add(order // k, Expert(rows) · w[order])

Expert parallelism (picotron.expert_parallel) puts different experts on different ranks; with that sort the rows
for one rank's experts are contiguous, so it only has to hand them to `exchange.dispatch` and get them back from
`exchange.combine` (two all-to-alls). This module calls the two seams and knows nothing else about ranks.

Load balance. Nothing in the language-model loss keeps the router from sending most tokens to a few experts
(they then learn faster and attract more). The auxiliary loss of Switch (eq. 4-6), in Hugging Face Mixtral's
form: aux = E · Σ_i f_i · P_i, f_i the fraction of the tokens that picked expert i among their k (Σf = k), P_i
the mean router probability of expert i; it is k at perfect balance (f_i = k/E, P_i = 1/E) and grows as the
routing concentrates. (HF sums f and P over all layers before multiplying; here each layer has its own aux and
the model's is their mean, as in Switch and GShard: equal when the layers route alike.) Its gradient reaches
the router through `AuxLoss`, an identity on the block's output whose backward also returns aux_weight for the
aux: the loss the optimizer sees is LM + aux_weight · aux without `forward` returning anything but logits.

Capacity (`capacity_factor` c > 0, GShard/Switch): expert i takes at most ceil(c · s · k / E) tokens of each
sequence of s tokens, first come first served in token order; the choices beyond are dropped (their weight
is lost, the residual carries the token), and counted. Per sequence, so the decision does not depend on how the
batch is split over ranks. c = 0: no limit, nothing dropped (Mixtral's inference).

DeepSeek-V3's router (`scoring_func="sigmoid"`; DeepSeek-V3 technical report, arXiv:2412.19437, §2.1.2, eq. 12-16):

    s = sigmoid(n)                            [tokens, E]   each expert's affinity, on its own (no softmax)
    e = top-k(s + b)                          [tokens, k]   b: a per-expert bias, used ONLY for the choice
    w = s[e] / Σ s[e] · routed_scaling_factor               the gates: the chosen affinities, without b
    y_t = Σ_j w_tj · Expert_{e_tj}(x_t) + Σ_shared Shared(x_t)

with DeepSeekMoE's shared experts (arXiv:2401.06066, §3.2: `n_shared_experts` N_s experts every token passes
through, one SwiGLU of N_s times the expert width, as in HF's DeepseekV3MoE) and fine-grained experts (more,
smaller ones: `moe_intermediate_size`). Auxiliary-loss-free balancing (`bias_update_speed` γ > 0): after each
optimizer step b_i += γ·sign(mean load − load_i), load_i = the tokens that chose expert i in the whole step (every
data-parallel rank's: `step_stats` sums them first), so an overloaded expert is chosen less next step and an idle
one more, while the gates, hence the LM loss's gradient, never see b. b is a buffer (no gradient, no optimizer
state), zero at init, the same on every replica, saved in checkpoints (picotron.checkpoint). With sigmoid scores
the aux loss (if its weight is not 0) takes P_i from the normalised affinities s / Σs (the report's eq. 17-20).

Context parallelism splits each sequence over the cp ranks: the aux loss's f_i and P_i are then sums over them
(`sequence`, a seam like `exchange`: picotron.expert_parallel.SequenceSum), and finite capacity is refused there.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    """One SwiGLU expert in Mixtral's names: w1 (gate) and w3 (up) h->i, w2 (down) i->h."""

    def __init__(self, hidden, intermediate):
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.ModuleDict):
    """The experts keyed by their GLOBAL index ("0".."E-1"): a rank that keeps experts 4-7 still calls them
    experts.4 ... experts.7, so names, and hence initial values, do not depend on the layout."""

    def __init__(self, experts):
        super().__init__({str(i): e for i, e in experts})

    def indices(self):
        return [int(k) for k in self.keys()]


class AuxLoss(torch.autograd.Function):
    """y = out in forward; in backward, out's gradient passes through and `aux` receives `weight`: as if
    weight·aux had been added to the loss (Megatron-LM's MoEAuxLossAutoScaler does the same)."""

    @staticmethod
    def forward(ctx, out, aux, weight):
        ctx.weight = weight
        ctx.save_for_backward(aux)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.weight), None


def route(logits, k, scoring="softmax", bias=None, scale=1.0):
    """(weights [n, k] in fp32, experts [n, k], probs [n, E] fp32). softmax: softmax, top-k, renormalise (Mixtral);
    sigmoid: the same on sigmoids (DeepSeek-V3), probs = the sigmoids / their sum (what the aux loss averages).
    A bias [E] (aux-loss-free balancing) shifts the choice only; the weights are then multiplied by `scale`."""
    scores = torch.softmax(logits.float(), dim=-1) if scoring == "softmax" else torch.sigmoid(logits.float())
    experts = (scores if bias is None else scores + bias).topk(k, dim=-1).indices  # the bias picks...
    weights = scores.gather(-1, experts)  # ...but the gates are the scores alone
    probs = scores if scoring == "softmax" else scores / scores.sum(-1, keepdim=True)
    return weights / weights.sum(-1, keepdim=True) * scale, experts, probs


def aux_loss(probs, experts, num_experts, sequence=None):
    """E · Σ_i f_i · P_i (HF Mixtral's load_balancing_loss_func for one layer): f_i = choices of expert i per
    token (Σf = k), P_i = mean probability of expert i. Differentiable through P only. `sequence`: the ranks the
    sequences are split over (context parallelism): both sums taken over all of their tokens."""
    stats = torch.cat([torch.bincount(experts.flatten(), minlength=num_experts).to(probs.dtype), probs.sum(0)])
    n = probs.shape[0]
    if sequence is not None:
        stats, n = sequence.sum(stats), n * sequence.size
    counts, total = stats.split(num_experts)
    return num_experts * (counts / n * total / n).sum()


def update_bias(block, load):
    """Aux-loss-free balancing (DeepSeek-V3 §2.1.2): b_i += γ · sign(mean load − load_i), load over the step."""
    load = load.to(block.e_score_correction_bias.dtype)
    block.e_score_correction_bias += block.bias_update_speed * torch.sign(load.mean() - load)


def capacity_keep(experts, seq_len, num_experts, capacity_factor):
    """A bool mask over the flattened (token, choice) pairs: False for those beyond expert capacity
    ceil(c·s·k/E) within their sequence, counting in token order (then choice order). All True if c = 0."""
    flat = experts.flatten()
    if capacity_factor <= 0:
        return torch.ones_like(flat, dtype=torch.bool)
    k = experts.shape[-1]
    capacity = math.ceil(capacity_factor * seq_len * k / num_experts)
    per_seq = flat.view(-1, seq_len * k)  # [sequences, s·k], token-major
    onehot = F.one_hot(per_seq, num_experts)  # [b, s·k, E]
    place = (onehot.cumsum(1) * onehot).sum(-1)  # 1-based arrival index of each pair at its expert
    return (place <= capacity).flatten()


class MoE(nn.Module):
    """The sparse MoE block: router `gate` (E x h, no bias), `experts` (Experts) and, with N_s > 0 shared experts,
    `shared_experts` (one Expert N_s times as wide). Replaces the MLP.

    After each training forward: `last_aux` (this layer's aux, detached), `counts` (tokens routed per expert, before
    capacity; summed over forwards until someone resets it to None) and `dropped` (pairs
    dropped by capacity, summed likewise): what the lessons plot."""

    def __init__(self, config):
        super().__init__()
        h, E = config.hidden_size, config.num_local_experts
        self.num_experts, self.k = E, config.num_experts_per_tok
        self.capacity_factor = config.capacity_factor
        self.aux_weight = config.router_aux_loss_coef  # the step engine divides it by the micro-batches
        self.scoring, self.scale = config.scoring_func, config.routed_scaling_factor
        self.bias_update_speed = config.bias_update_speed
        self.gate = nn.Linear(h, E, bias=False)
        self.experts = Experts((i, Expert(h, config.expert_size)) for i in range(E))
        # (None: a plain attribute, so the state dict has no entry; declared, so no one has to ask whether it exists)
        self.shared_experts = Expert(h, config.expert_size * config.n_shared_experts) if config.n_shared_experts else None
        if self.bias_update_speed:  # not in state_dict (not a weight of HF's files); checkpoints save it themselves
            self.register_buffer("e_score_correction_bias", torch.zeros(E), persistent=False)
        self.exchange = None  # expert parallelism: .dispatch(rows, counts) -> (rows, counts, ctx); .combine(rows, ctx)
        self.sequence = None  # context parallelism: .sum(t) over the ranks that hold one sequence, and .size
        self.counts, self.dropped = None, 0  # made on the first forward (the model may be built on meta)
        self.last_aux = None

    def forward(self, x):
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        bias = getattr(self, "e_score_correction_bias", None)
        weights, experts, probs = route(self.gate(flat), self.k, self.scoring, bias, self.scale)
        aux = aux_loss(probs, experts, self.num_experts, self.sequence)
        keep = capacity_keep(experts, s, self.num_experts, self.capacity_factor)
        chosen = experts.flatten()
        sort_by = chosen.masked_fill(~keep, self.num_experts)  # a dropped choice sorts last, as "expert E"
        order = torch.argsort(sort_by, stable=True)
        counts = torch.bincount(sort_by, minlength=self.num_experts + 1)[:-1]  # kept rows per expert
        rows = flat[order // self.k]  # the dispatch permutation: each expert's tokens, contiguous (dropped last)
        shared = None
        if self.exchange is None:
            sizes = counts.tolist()  # the host reads the counts once per layer (split needs numbers)
            out = self.run_experts(rows[:sum(sizes)], sizes)
        elif hasattr(self.exchange, "overlap"):  # --ep-overlap: the all-to-alls under the experts' compute
            out, shared = self.exchange.overlap(rows, counts, self.run_experts, list(self.experts.parameters()), flat,
                                                self.shared_experts)
        else:  # the exchange reads the counts once, with the other ranks'
            rows, local_counts, ctx = self.exchange.dispatch(rows, counts)
            out = self.exchange.combine(self.run_experts(rows, local_counts), ctx)
        order = order[:out.shape[0]]  # the kept choices (a shape: known on the host, no sync)
        out = (out * weights.flatten()[order, None].to(out.dtype)).to(flat.dtype)
        y = torch.zeros_like(flat).index_add(0, order // self.k, out)  # the combine: back to token order
        if self.shared_experts is not None:  # every token, unweighted
            y = y + (self.shared_experts(flat) if shared is None else shared)
        if self.training:  # the statistics of training steps only (not of evaluation or text sampling)
            routed = torch.bincount(chosen, minlength=self.num_experts)
            self.counts = routed if self.counts is None else self.counts + routed
            self.dropped = self.dropped + (~keep).sum()  # stays on the device (read once per step)
            self.last_aux = aux.detach()
        if self.training and torch.is_grad_enabled() and self.aux_weight:
            y = AuxLoss.apply(y, aux, self.aux_weight)
        return y.view(b, s, h)

    def run_experts(self, rows, counts):
        """Each of this rank's experts (in index order) on its slice of `rows` (counts[j] rows for the j-th, a list)."""
        outs = [expert(part) for expert, part in zip(self.experts.values(), rows.split(list(counts)))]
        return torch.cat(outs) if outs else rows

    def extra_repr(self):
        return (f"experts={self.num_experts}, top_k={self.k}, capacity_factor={self.capacity_factor}, "
                f"scoring={self.scoring}, bias_update_speed={self.bias_update_speed}")


def step_stats(model, axis=None, balance=True):
    """What the MoE layers of `model` (this rank's) saw since the last call, then reset: {"aux": the mean of the
    layers' last aux loss, "tokens_per_expert": [per layer: tokens routed to each expert], "dropped": choices
    dropped by capacity}, counts summed over `axis` (the dp x cp ranks: the whole step's tokens; a collective,
    so every rank of the axis calls it). None for a dense model. balance: then each layer's routing bias (if it
    has one) moves by these loads (`update_bias`): the same loads on every replica, the same bias."""
    blocks = [m for m in model.modules() if isinstance(m, MoE)]
    if not blocks or any(b.counts is None for b in blocks):
        return None
    counts = torch.stack([b.counts for b in blocks])
    dropped = torch.as_tensor(sum(b.dropped for b in blocks), dtype=torch.float32, device=counts.device).reshape(1)
    if axis is not None:
        axis.all_reduce(counts)
        axis.all_reduce(dropped)
    aux = float(sum(b.last_aux for b in blocks) / len(blocks))
    for b, load in zip(blocks, counts):
        if balance and b.bias_update_speed:
            update_bias(b, load)
    for b in blocks:
        b.counts, b.dropped = None, 0
    return {"aux": aux, "tokens_per_expert": counts.tolist(), "dropped": int(dropped.item())}
