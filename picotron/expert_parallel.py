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

The all-to-alls under compute (--ep-overlap, `OverlappedExchange`). Blocking, nothing runs while the rows travel:
the experts wait for the dispatch, the next layer for the combine. With the overlap each micro-batch's routed rows
are cut in two parts AFTER routing, capacity and the aux loss were decided on the whole micro-batch (part 1: the
first half of each expert's rows; both parts stay sorted by expert), and each part has its own dispatch and combine:

    link     [dispatch 1][dispatch 2]            [combine 1]  [combine 2]
    compute  [shared expert]  [experts on part 1]  [experts on part 2]

so each middle all-to-all travels under the other part's experts; only the first dispatch (less the shared expert)
and the last combine stay exposed: planner.ep_overlap_exposed_seconds. The backward mirrors it (_TwoParts). The same
rows travel, in twice the messages (the bytes above, plus one all-to-all of 2E counts instead of E); an expert's
output for a row depends on that row alone, so the result is the unsplit layer's. DeepSeek-V3 technical report
(arXiv:2412.19437) §3.2.2 overlaps the all-to-alls of one micro-batch with another's compute (DualPipe); Megatron-LM's
--overlap-moe-expert-parallel-comm does the same; here the two parts come from one micro-batch.

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
        order = expert_major(mine, recv, rows.device)
        return got[order], [sum(mine[s][e] for s in range(n)) for e in range(L)], (order, send, recv)

    def combine(self, out, ctx):
        """The experts' outputs (expert-major) back to the ranks their rows came from, in dispatch order."""
        order, send, recv = ctx
        source_major = torch.empty_like(out).index_copy(0, order, out)  # undo the regrouping
        return AllToAll.apply(source_major, send, recv, self.axis, self, "combine")


class OverlappedExchange(Exchange):
    """The Exchange of --ep-overlap: the micro-batch's routed rows cut into two parts, each with its own dispatch
    and combine, so that one part's all-to-all travels while the other part's experts (or the shared expert)
    compute (the module docstring's schedule). moe.MoE calls `overlap` instead of dispatch and combine; the
    routing, the capacity and the aux loss were decided on the whole micro-batch before, and an expert's output for
    a row depends on that row alone, so the result is the unsplit layer's."""

    def overlap(self, rows, counts, experts, weights, flat, shared):
        """rows: this rank's (token, choice) rows sorted by expert (dropped choices last), counts[e] the kept rows
        of each global expert; experts(rows, counts) runs this rank's experts, whose parameters are `weights`;
        flat: every token (the shared expert's input), shared: the shared expert or None. Returns (the experts'
        outputs of the kept rows, in `rows`' order; shared(flat) or None)."""
        job = _TwoParts(self, counts, experts, shared, grad=torch.is_grad_enabled())
        job.weights = [w for w in weights if w.requires_grad]
        out, shared_out = _Overlapped.apply(rows[:job.total], flat, job)
        return out, (shared_out if shared is not None else None)

    def start(self, x, out_splits, in_splits, name, part):
        """Launch one part's all-to-all (asynchronous); `.wait()` on what it returns gives the rows received."""
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        work = self.axis.all_to_all_into(out, x.contiguous(), out_splits, in_splits, async_op=True,
                                         label=f"all-to-all {name} {part}")
        self.rows[name] = self.rows.get(name, 0) + sum(in_splits) - in_splits[self.axis.rank]
        return _Pending(work, out)


class _Pending:
    def __init__(self, work, out):
        self.work, self.out = work, out

    def wait(self):
        self.work.wait()
        return self.out


class _Part:
    """One part's plan: rows it sends to each rank (send), receives from each (recv), the regrouping of what it
    receives, source-major -> expert-major (order) and back (inv), and its rows per local expert (local)."""

    def __init__(self, send, recv, order, local):
        self.send, self.recv, self.order, self.inv, self.local = send, recv, order, inverse(order), local


def inverse(perm):
    """The permutation that undoes `perm`: x[perm][inverse(perm)] == x. (Rows move by gathers, index_select, only:
    on a CPU index_copy moves them one by one.)"""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


class _TwoParts:
    """One MoE layer's two-part schedule, forward and backward (what _Overlapped runs):

        forward                                    backward
        dispatch 1, dispatch 2 launched            combine-backward 1, 2 launched
        shared expert          (under both)        shared expert's backward     (under both)
        wait 1; experts on part 1  (under 2)       wait 1; experts' backward 1  (under 2)
        combine 1 launched                         dispatch-backward 1 launched
        wait 2; experts on part 2  (under 1)       wait 2; experts' backward 2  (under 1)
        combine 2 launched; wait both              dispatch-backward 2 launched; the weights' gradients
                                                   of both parts accumulated, once; wait both

    Every rank issues the same four all-to-alls on the ep group in the same order (NCCL's rule); the counts go
    first, one all-to-all of 2E numbers for both parts, read by the host once. Part 1 takes the first half
    (rounded up) of each expert's rows, part 2 the rest: both parts stay sorted by expert."""

    def __init__(self, exchange, counts, experts, shared, grad):
        self.exchange, self.experts, self.shared, self.grad = exchange, experts, shared, grad
        axis, L, E = exchange.axis, exchange.local, counts.numel()
        n = axis.size
        first = (counts + 1) // 2
        halves = torch.stack([first, counts - first])  # [part, E]
        sent = halves.view(2, n, L).transpose(0, 1).contiguous()  # [rank j, part, j's experts]
        received = torch.empty_like(sent)  # [source rank, part, my experts]
        axis.all_to_all_into(received, sent, label="all-to-all counts")
        numbers = torch.cat([halves.flatten(), received.flatten()]).tolist()  # the one sync of the layer
        self.parts = []
        for p in range(2):
            c = numbers[p * E:(p + 1) * E]
            mine = [numbers[2 * E + s * 2 * L + p * L:2 * E + s * 2 * L + (p + 1) * L] for s in range(n)]
            recv = [sum(m) for m in mine]
            self.parts.append(_Part([sum(c[j * L:(j + 1) * L]) for j in range(n)], recv,
                                    expert_major(mine, recv, counts.device),
                                    [sum(mine[s][e] for s in range(n)) for e in range(L)]))
        sizes = [sum(part.send) for part in self.parts]
        self.total = sum(sizes)
        # the kept rows' positions, part 1's then part 2's: row r of expert e is in part 1 if it is among e's first
        begin = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts, output_size=self.total)
        within = torch.arange(self.total, device=counts.device) - begin
        later = within >= torch.repeat_interleave(first, counts, output_size=self.total)
        self.perm = torch.argsort(later.to(torch.int32), stable=True)
        self.inv, self.sizes = inverse(self.perm), sizes

    def forward(self, rows, flat):
        ex = self.exchange
        parts = rows.index_select(0, self.perm).split(self.sizes)
        pending = [ex.start(x, p.recv, p.send, "dispatch", f"part {i + 1}")
                   for i, (x, p) in enumerate(zip(parts, self.parts))]
        shared_out = self._shared(flat)  # under both dispatches
        combines, self.saved = [], []
        for i, (wait, part) in enumerate(zip(pending, self.parts)):
            got = wait.wait()  # part i has arrived; the other part is still travelling (or its combine is)
            leaf = got.index_select(0, part.order).requires_grad_(self.grad)  # expert-major: each local expert's rows contiguous
            with torch.set_grad_enabled(self.grad):
                out = self.experts(leaf, part.local)
            self.saved.append((leaf, out))
            combines.append(ex.start(out.detach().index_select(0, part.inv), part.send, part.recv, "combine", f"part {i + 1}"))
        back = torch.cat([c.wait() for c in combines])  # part 1's rows, then part 2's
        return back.index_select(0, self.inv), shared_out

    def _shared(self, flat):
        self.shared_in = flat.detach().requires_grad_(self.grad)
        if self.shared is None:
            self.shared_out = flat.new_zeros(0)
            return self.shared_out
        with torch.set_grad_enabled(self.grad):
            self.shared_out = self.shared(self.shared_in)
        return self.shared_out.detach()

    def backward(self, grad_out, grad_shared):
        ex = self.exchange
        grads = grad_out.index_select(0, self.perm).split(self.sizes)
        pending = [ex.start(g, p.recv, p.send, "combine-backward", f"part {i + 1}")
                   for i, (g, p) in enumerate(zip(grads, self.parts))]
        grad_flat = None
        if self.shared is not None and grad_shared is not None:  # under both combine-backwards
            torch.autograd.backward(self.shared_out, grad_shared)
            grad_flat = self.shared_in.grad
        sends, weight_grads = [], [None] * len(self.weights)
        for i, (wait, part, (leaf, out)) in enumerate(zip(pending, self.parts, self.saved)):
            # the experts' backward on part i: its rows' gradient and the weights', not yet accumulated (a weight's
            # accumulation hook, which data parallelism counts, must fire once per backward, not once per part)
            g, *dw = torch.autograd.grad(out, [leaf, *self.weights], wait.wait().index_select(0, part.order), allow_unused=True)
            weight_grads = [a if b is None else b if a is None else a + b for a, b in zip(weight_grads, dw)]
            g = g if g is not None else torch.zeros_like(leaf)
            sends.append(ex.start(g.index_select(0, part.inv), part.send, part.recv, "dispatch-backward", f"part {i + 1}"))
        _accumulate_once(self.weights, weight_grads)  # under the last dispatch-backward
        back = torch.cat([s.wait() for s in sends])
        self.saved, self.shared_in, self.shared_out = [], None, None
        return back.index_select(0, self.inv), grad_flat


def _accumulate_once(weights, grads):
    """Each weight's gradient accumulated by autograd (its hooks fire once), as if the backward had reached it.
    (Weights whose gradient is deferred, zero-bubble's split backward, have none here: their layers keep it.)"""
    pairs = [(w, g) for w, g in zip(weights, grads) if g is not None]
    if pairs:
        with torch.enable_grad():
            handle = _Accumulate.apply(tuple(g for _, g in pairs), *(w for w, _ in pairs))
        torch.autograd.backward(handle)


class _Accumulate(torch.autograd.Function):
    """A zero-size output whose backward hands each weight the gradient it was given."""

    @staticmethod
    def forward(ctx, grads, *weights):
        ctx.grads = grads
        return weights[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        grads, ctx.grads = ctx.grads, None
        return (None, *grads)


class _Overlapped(torch.autograd.Function):
    """rows, flat -> (the experts' outputs of rows, the shared expert's of flat), each all-to-all under another
    part's compute, forward and backward (_TwoParts). The experts' own graphs live inside: their backward runs
    here, part by part, and accumulates their weights' gradients as usual (hooks fire)."""

    @staticmethod
    def forward(ctx, rows, flat, job):
        ctx.job = job
        return job.forward(rows, flat)

    @staticmethod
    def backward(ctx, grad_out, grad_shared):
        grad_rows, grad_flat = ctx.job.backward(grad_out.contiguous(), grad_shared)
        return grad_rows, grad_flat, None


def expert_major(mine, recv, device):
    """The permutation that regroups received rows source-major -> expert-major (each local expert's rows
    contiguous): mine[src][e] rows came from rank src for local expert e, recv[src] = their sum. Block (src, e)
    starts at starts[src][e] in the received rows; expert-major, the blocks go e by e, every source in turn."""
    n, L = len(mine), len(mine[0])
    starts = [sum(recv[:s]) + sum(mine[s][:e]) for s in range(n) for e in range(L)]
    blocks = [(starts[s * L + e], mine[s][e]) for e in range(L) for s in range(n)]
    lens = torch.tensor([c for _, c in blocks], device=device)
    shift = torch.tensor([b for b, _ in blocks], device=device) - (torch.cumsum(lens, 0) - lens)
    total = sum(recv)
    return torch.arange(total, device=device) + torch.repeat_interleave(shift, lens, output_size=total)


def apply(model, axis, cp=None, overlap=False):
    """Keep this rank's experts in every MoE layer of `model` (on the meta device, before init), place them over
    ("ep",) and give each layer the `Exchange` over `axis` (the mesh's ep axis); with `cp` (the mesh's cp axis,
    size > 1) each layer's routing statistics are summed over it. ep = cp = 1: nothing changes."""
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
        moe.exchange = (OverlappedExchange if overlap else Exchange)(axis, E)
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
