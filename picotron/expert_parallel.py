"""Expert parallelism: the experts of every MoE layer spread over ep ranks, tokens sent to them and back with
two all-to-alls (Lepikhin et al. 2020, "GShard", section 2; Fedus et al. 2022, "Switch Transformers", section 2.2).

A mixture-of-experts layer (picotron.moe) holds E experts, and a token uses k of them. Data parallelism would keep
all E on every rank; expert parallelism keeps E/ep on each rank of an ep group and moves the TOKENS instead:

    rank 0: experts 0,1        tokens of rank 0 --.   .-- tokens of rank 1
    rank 1: experts 2,3                            \\ /
                          dispatch (all-to-all):   X    each token row goes to the rank that holds its expert
                                                   / \\
                          experts compute on the rows they received (from every rank of the group)
                          combine (all-to-all):    the outputs go back where their tokens came from

Per MoE layer and micro-batch, each rank sends the rows of its n tokens that chose experts elsewhere, about
n·k·(ep−1)/ep rows of h values, once to dispatch and once to combine, and the backward pass the same again:
4·n·k·h·(ep−1)/ep elements when the routing is balanced (`bytes_per_step_formula`). The sizes vary from step to
step, so the token counts per expert go first (an all-to-all of E numbers), then the rows with those splits.

The ep axis is carved out of dp (picotron.mesh): the ranks of an ep group see different data AND hold
different experts. So there are two kinds of parameters: the dense ones (attention, norms, embedding, the
router), replicated over dp x cp as before, and the experts, placed over ("ep",) and replicated only over the mesh's
`edp` axis (dp/ep x cp ranks). `marks.sync_axis` tells data parallelism and ZeRO where to sum each gradient;
both divide by dp x cp, because an expert's gradient already contains the tokens of its whole ep group.

Under tensor parallelism each expert is itself cut like a dense MLP (w1, w3 column-parallel, w2 row-parallel)
and the ep all-to-alls run between ranks of the same tp coordinate (each tp column holds the same tokens):
picotron.tensor_parallel handles the block's entry and exit.

Experts with context parallelism: cp splits every sequence over the cp ranks, but the load-balancing loss's
statistics (f_i, P_i) belong to the whole micro-batch: `SequenceSum` adds the cp ranks' partial sums (one all-reduce
of 2E numbers per MoE layer and micro-batch; its backward is the identity, so each rank's router gradient holds only
its own tokens' part and the aux weight is multiplied by cp, like the LM loss's mean over cp). The routing bias's
loads are summed over dp x cp by `moe.step_stats`. A finite capacity is refused with cp (`check`): its first-come
order runs along the whole sequence, which no cp rank sees.

Rules (`check`, in picotron.rules): ep divides dp and the number of experts; the model has experts; top_k at most
the experts; no finite capacity with cp. Which strategies it does not combine with (ZeRO-3; torch's DDP) is
picotron.rules' table, `combination_problem`.
"""
import torch

from picotron import marks
from picotron.moe import MoE
# check(cfg, model_config), this strategy's rule, lives in picotron.rules: no torch there, so a refusal is instant
from picotron.rules import expert_parallel_rule as check


class AllToAll(torch.autograd.Function):
    """Rows exchanged over the ep axis: forward sends in_splits[j] rows to rank j and receives out_splits[j]
    from it; backward sends the gradients back the same way (an all-to-all with the splits swapped)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, axis, exchange, name):
        ctx.splits, ctx.axis, ctx.exchange, ctx.name = (out_splits, in_splits), axis, exchange, name
        return exchange.send(x, out_splits, in_splits, name)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return ctx.exchange.send(grad.contiguous(), in_splits, out_splits, ctx.name + "-backward"), \
            None, None, None, None, None


class SequenceSum(torch.autograd.Function):
    """Forward: the sum over the cp ranks (all-reduce); backward: the identity (each rank keeps its own part)."""

    @staticmethod
    def forward(ctx, t, axis):
        t = t.clone()
        axis.all_reduce(t, label="all-reduce routing statistics")
        return t

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Sequence:
    """moe.MoE's `sequence` seam under context parallelism: the ranks holding parts of the same sequences."""

    def __init__(self, axis):
        self.axis, self.size = axis, axis.size

    def sum(self, t):
        return SequenceSum.apply(t, self.axis)


class Exchange:
    """What moe.MoE calls when its experts are spread over `axis`: dispatch rows sorted by global expert, get
    them back after this rank's experts ran. Counts what it sends: `rows` {kind: rows sent to other ranks}."""

    def __init__(self, axis, num_experts):
        self.axis, self.local = axis, num_experts // axis.size
        self.rows = {}

    def send(self, x, out_splits, in_splits, name):
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        self.axis.all_to_all_into(out, x.contiguous(), out_splits, in_splits, label=f"all-to-all {name}")
        self.rows[name] = self.rows.get(name, 0) + sum(in_splits) - in_splits[self.axis.rank]
        return out

    def dispatch(self, rows, counts):
        """rows: this rank's (token, choice) rows sorted by expert; counts[e]: how many for each global expert
        (rows past sum(counts), the choices capacity dropped, sorted last, are not sent). Returns the rows for
        this rank's experts, grouped by local expert (every source rank's in turn), their counts per local
        expert (a list) and what combine needs. The host reads the counts ONCE (one device-to-host copy of both
        count vectors): the all-to-all needs its splits as numbers, and per-element reads would each sync."""
        n, L = self.axis.size, self.local
        received = torch.empty_like(counts)  # received[src·L + e]: rows rank src has for my e-th expert
        self.axis.all_to_all_into(received, counts.contiguous(), label="all-to-all counts")
        both = torch.cat([counts, received]).tolist()  # the one sync of the dispatch
        mine = [both[n * L + i:n * L + i + L] for i in range(0, n * L, L)]  # mine[src][e]
        send = [sum(both[j * L:(j + 1) * L]) for j in range(n)]  # rows to each rank (its experts are contiguous)
        recv = [sum(row) for row in mine]
        got = AllToAll.apply(rows[:sum(send)], recv, send, self.axis, self, "dispatch")  # source-major blocks
        # regroup source-major -> expert-major, so that each local expert's rows are contiguous: block (src, e)
        # starts at starts[src][e] in `got`; expert-major, the blocks go e by e, every source in turn
        starts = [sum(recv[:s]) + sum(mine[s][:e]) for s in range(n) for e in range(L)]
        blocks = [(starts[s * L + e], mine[s][e]) for e in range(L) for s in range(n)]
        lens = torch.tensor([c for _, c in blocks], device=rows.device)
        shift = torch.tensor([b for b, _ in blocks], device=rows.device) - (torch.cumsum(lens, 0) - lens)
        total = sum(recv)
        order = torch.arange(total, device=rows.device) + torch.repeat_interleave(shift, lens, output_size=total)
        return got[order], [sum(mine[s][e] for s in range(n)) for e in range(L)], (order, send, recv)

    def combine(self, out, ctx):
        """The experts' outputs (expert-major) back to the ranks their rows came from, in dispatch order."""
        order, send, recv = ctx
        source_major = torch.empty_like(out).index_copy(0, order, out)  # undo the regrouping
        return AllToAll.apply(source_major, send, recv, self.axis, self, "combine")


def apply(model, axis, cp=None, overlap=False):
    """Keep this rank's experts in every MoE layer of `model` (on the meta device, before init), place them over
    ("ep",) and give each layer the `Exchange` over `axis` (the mesh's ep axis); with `cp` (the mesh's cp axis,
    size > 1) each layer's routing statistics are summed over it. ep = cp = 1: nothing changes."""
    if overlap:
        raise NotImplementedError("expert all-to-alls under compute: being built (issue 43)")
    for layer in model.layers:
        moe = layer.feed_forward
        if not isinstance(moe, MoE):
            continue
        if cp is not None and cp.size > 1:
            moe.sequence = Sequence(cp)
        if axis.size == 1:
            continue
        E, n = moe.num_experts, axis.size
        if E % n:
            raise ValueError(f"ep={n} does not divide num_local_experts={E}.")
        mine = range(axis.rank * E // n, (axis.rank + 1) * E // n)
        for e in moe.experts.indices():
            if e not in mine:
                del moe.experts[str(e)]
        moe.exchange = Exchange(axis, E)
        for name, _ in moe.experts.named_parameters():  # a record kept on the module: to_empty keeps it
            marks.place(moe.experts, name, dims=("ep",))
    return model


def exchanges(model):
    """The Exchange of every MoE layer this rank holds (for counting what the all-to-alls sent)."""
    return [m.exchange for m in model.modules() if isinstance(m, MoE) and m.exchange is not None]


def bytes_per_step_formula(tokens, k, hidden, ep, layers, elem=4):
    """All-to-all bytes one rank sends to the others per step if routing is balanced: per MoE layer, its
    tokens·k rows of `hidden` values, (ep−1)/ep of them elsewhere, four times (dispatch and combine, forward
    and backward). The measured count uses the real routing (`Exchange.rows`)."""
    return 4 * layers * tokens * k * hidden * elem * (ep - 1) // ep
