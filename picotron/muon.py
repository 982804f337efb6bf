"""Muon: orthogonalised momentum for the hidden matrices, AdamW for the rest; and how to run it on shards.

The idea (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks",
kellerjordan.github.io/posts/muon). For a weight matrix W (A x B) with gradient G, keep SGD momentum with Nesterov,

    M_t = μ M_{t-1} + G_t,        U_t = G_t + μ M_t                     (μ = 0.95)

and step along the orthogonal matrix nearest to U_t: O_t = U V^T where U_t = U Σ V^T, every singular value set
to 1. An SVD per step is too slow, so O_t is approximated by five Newton–Schulz iterations of the quintic

    X_0 = U_t / ||U_t||_F,    X_{k+1} = a X_k + (b A_k + c A_k²) X_k,   A_k = X_k X_k^T,   (a, b, c) = (3.4445, -4.7750, 2.0315)

whose coefficients push every singular value of X_0 (in (0, 1] after the normalisation) into a band around 1,
roughly [0.7, 1.2], not exactly to 1: fast rather than exact. The blog post runs it in bf16 on the GPU; here it
runs in fp32, so that a sharded run can be checked against one process to the parity tolerance.

The scale (Liu et al. 2025, "Muon is Scalable for LLM Training", arXiv 2502.16982, section 2.2). O_t's RMS is
about 1/sqrt(max(A, B)), far from AdamW's ~0.2-0.4; Liu et al. scale it to AdamW's RMS so that the same learning
rate and weight decay work for both, and decay the weights as AdamW does (decoupled):

    W_t = W_{t-1} - η (0.2 · sqrt(max(A, B)) · O_t + λ W_{t-1})

Which matrices. Muon is for the hidden layers' matrices: inside the decoder layers, q/k/v/o, gate/up/down and each
expert's w1/w2/w3 (each its own matrix; the router too). The embedding, the LM head and the norms' gains go to
AdamW, as in both sources. `Muon` is one torch.optim.Optimizer holding both kinds (the state of a Muon tensor is
its `momentum_buffer`; of an AdamW tensor `step`, `exp_avg`, `exp_avg_sq`, as torch's AdamW keeps them), so
checkpoints save, resume and reshard it as they do AdamW's: every state tensor has its parameter's shape.

Why sharding fights it. The momentum is elementwise, so it stays wherever the gradient is: a tp slice, a ZeRO
piece. But Newton–Schulz needs the WHOLE matrix (X X^T mixes every element with every other): before it, the
pieces must meet. `Exchange` does it from the placements (picotron.marks), two ways (`--muon-impl`):

    gather  every rank all-gathers the whole update and runs Newton–Schulz on it, redundantly, then keeps its own
            part (Liu et al.'s "Distributed Muon", section 2.3, over ZeRO-1's dp group). ZeRO: one all-gather of each
            unit holding a Muon matrix (the unit's padded size, as ZeRO's own parameter all-gather); tp: one
            all-gather of each matrix cut over tp (its full size).
    owner   each whole matrix gets one owner rank on the axis its pieces are cut over (round-robin by size,
            `planner.owner_of`): one all-to-all sends every piece to its matrix's owner, the owner runs Newton–Schulz,
            a second all-to-all sends the pieces of the result back. Each rank orthogonalises ~1/n of the matrices
            and sends ~2/n of what gather sends (Jordan's modded-nanogpt already shares the matrices out so, each rank
            orthogonalising every n-th one and all-gathering the results). One sharding axis only: ZeRO's or tp's.

The bytes of both, per rank: picotron.planner.muon_bytes_per_step. A matrix whole on every rank (plain data
parallelism) needs no communication: every rank runs Newton–Schulz on it (what gather does; owner too).
"""
import math

import torch

from picotron import marks
from picotron.planner import owner_of

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Jordan et al. 2024: the quintic's (a, b, c)
IMPLS = ("gather", "owner")


def newton_schulz(g, steps=5, eps=1e-7):
    """The orthogonal matrix nearest to `g` (a 2-D tensor), approximately: `steps` iterations of the quintic in fp32.
    Each singular value of the result lies near 1 (about [0.7, 1.2]); its singular vectors are g's."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    tall = x.size(0) > x.size(1)
    if tall:  # iterate on the wide side: X X^T is the smaller square
        x = x.T
    x = x / (torch.linalg.matrix_norm(x) + eps)  # every singular value in (0, 1]
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def update_scale(shape):
    """Liu et al. 2025's factor, 0.2·sqrt(max(A, B)): an orthogonal update's RMS matched to AdamW's (~0.2)."""
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


def muon_update(u, steps=5):
    """The step direction of a whole matrix from its (Nesterov) momentum `u`: scaled Newton–Schulz."""
    return newton_schulz(u, steps) * update_scale(u.shape)


def is_hidden_matrix(name, p):
    """Muon's matrices: 2-D parameters inside the decoder layers (not the embedding, the LM head, the norms). A
    pipeline stage names them "chunks.0.layers.3....": a "layers" part anywhere in the name."""
    return "layers" in name.split(".") and len(marks.placement(p).shape) == 2


def source(t):
    """The model parameter an optimizer tensor stands for: itself, the parameter of a ZeRO piece (`flat`), or of an
    fp32 master copy (`master_for`)."""
    where = marks.placement(t)
    if where.flat is not None:
        return where.flat[0]
    return t if where.master_for is None else where.master_for


class Exchange:
    """Brings each Muon matrix's update together from wherever its pieces are, orthogonalises it, and hands back
    this rank's pieces. Built once per run from the model (`raw`: the Llama or pipeline stage, its parameter names
    say which are Muon's), the gradient-sync wrapper (`sync`: ZeRO's units, if any) and the tp axis.

    The axes come from the placements: a ZeRO piece (`flat`) is cut over its unit's axis (dp x cp, the experts' edp,
    HSDP's dp_shard), a tp slice (`split_dim`, "tp" in its dims) over tp. Every rank of an axis runs the same
    collectives in the same order: units in the wrapper's order, matrices in the model's order."""

    def __init__(self, raw, sync=None, tp=None, impl="gather", ns_steps=5):
        if impl not in IMPLS:
            raise ValueError(f"muon impl {impl!r}: pick one of {IMPLS}.")
        self.impl, self.ns_steps, self.tp = impl, ns_steps, tp
        self.matrices = [p for name, p in raw.named_parameters() if is_hidden_matrix(name, p)]
        self.muon_ids = {id(p) for p in self.matrices}
        self.unit_of = getattr(sync, "unit_of", {}) or {}
        units = getattr(sync, "units", []) or []
        self.units = [u for u in units if any(id(p) in self.muon_ids for p in u.params)]
        self.zero = bool(self.unit_of)
        cut = [p for p in self.matrices if self._tp_cut(p)]
        if impl == "owner" and self.zero and cut:
            raise ValueError("muon impl 'owner' reassembles a matrix over one axis, but these matrices are cut over "
                             "tp and ZeRO both; use impl 'gather'.")

    def is_muon(self, t):
        return id(source(t)) in self.muon_ids

    def _tp_cut(self, p):
        where = marks.placement(p)
        return self.tp is not None and self.tp.size > 1 and where.split_dim is not None and "tp" in where.dims

    # -- where a rank's piece of a ZeRO unit's parameter lies ---------------------------------------------------
    @staticmethod
    def _piece_range(unit, p, rank):
        """(first element, count) of parameter p that rank `rank` of its unit's axis holds (count 0: none)."""
        off = unit.offsets[[id(q) for q in unit.params].index(id(p))]
        lo, hi = max(rank * unit.chunk, off), min((rank + 1) * unit.chunk, off + p.numel())
        return (lo - off, hi - lo) if hi > lo else (0, 0)

    # -- the step: {optimizer tensor: its update piece} -> {optimizer tensor: orthogonalised, scaled piece} ------
    @torch.no_grad()
    def orthogonalize(self, updates):
        """`updates`: {optimizer tensor: U (its shape)} for every Muon tensor of this rank (zeros where a tensor had
        no gradient: the collectives must run all the same). Returns {tensor: this rank's piece of the scaled O}."""
        by_source = {id(source(t)): t for t in updates}
        if self.impl == "owner":
            return self._owner(updates, by_source)
        local = self._gather_units(updates, by_source) if self.zero else \
            {id(source(t)): u for t, u in updates.items()}
        out = {}
        for p in self.matrices:
            u = local.get(id(p))
            if u is None:  # a matrix this rank holds nothing of (another pipeline stage)
                continue
            cut = self._tp_cut(p)
            o = muon_update(self._gather_tp(p, u) if cut else u, self.ns_steps)
            if cut:
                o = marks.placement(p).take(o, p.shape)
            t = by_source.get(id(p))
            if t is not None:
                out[t] = self._cut_piece(t, o)
        return out

    def _cut_piece(self, t, o):
        """This optimizer tensor's elements of o (p's local update): a ZeRO piece's flat range, else all of it."""
        where = marks.placement(t)
        if where.flat is None:
            return o.reshape(t.shape)
        _, at, n = where.flat
        return o.reshape(-1)[at:at + n].reshape(t.shape)

    def _gather_units(self, updates, by_source):
        """ZeRO: each unit holding a Muon matrix all-gathers the chunk of updates (zeros where not Muon's); returns
        {id(p): p's whole local update} for every Muon matrix of those units."""
        local = {}
        for unit in self.units:
            chunk = torch.zeros(unit.chunk, dtype=torch.float32, device=unit.params[0].device)
            for p, off in zip(unit.params, unit.offsets):
                t = by_source.get(id(p))
                if t is not None and id(p) in self.muon_ids:
                    _, at, n = marks.placement(t).flat
                    chunk[off + at - unit.lo: off + at - unit.lo + n] = updates[t].reshape(-1)
            full = torch.empty(unit.padded, dtype=torch.float32, device=chunk.device)
            unit.axis.all_gather_into(full, chunk, label=f"muon all-gather {unit.name}")
            for p, off in zip(unit.params, unit.offsets):
                if id(p) in self.muon_ids:
                    local[id(p)] = full[off:off + p.numel()].view(p.shape)
        return local

    def _gather_tp(self, p, u):
        """A tp slice's update -> the whole matrix's: all-gather over tp, the slices joined along split_dim."""
        parts = torch.empty(self.tp.size * u.numel(), dtype=torch.float32, device=u.device)
        self.tp.all_gather_into(parts, u.float().reshape(-1).contiguous(), label="muon all-gather tp")
        return torch.cat(parts.view(self.tp.size, *u.shape).unbind(0), dim=marks.placement(p).split_dim)

    # -- owner: one all-to-all to the owners, Newton–Schulz there, one all-to-all back -------------------------
    def _axes(self):
        """[(axis, [matrices cut over it])], in the order every rank runs them: ZeRO units' axes, or tp."""
        groups = []
        if self.zero:
            for unit in self.units:
                ms = [p for p in unit.params if id(p) in self.muon_ids]
                same = next((g for g in groups if g[0] is unit.axis), None)
                if same is None:
                    groups.append((unit.axis, ms))
                else:
                    same[1].extend(ms)
        else:
            cut = [p for p in self.matrices if self._tp_cut(p)]
            if cut:
                groups.append((self.tp, cut))
        return groups

    def _lengths(self, axis, p):
        """Elements of p's update each rank of `axis` holds, in rank order."""
        if self.zero:
            return [self._piece_range(self.unit_of[p], p, r)[1] for r in range(axis.size)]
        return [p.numel()] * axis.size  # a tp slice: every rank holds one of equal size

    def _join(self, p, parts):
        """The owner's whole matrix from the pieces of every rank (rank order)."""
        if self.zero:
            return torch.cat(parts).view(p.shape)
        dim = marks.placement(p).split_dim
        return torch.cat([x.view(p.shape) for x in parts], dim=dim)

    def _split(self, axis, p, o):
        """The owner's result cut into every rank's piece (rank order), flat."""
        if self.zero:
            return list(o.reshape(-1).split(self._lengths(axis, p)))
        dim = marks.placement(p).split_dim
        return [x.reshape(-1) for x in o.chunk(axis.size, dim=dim)]

    def _owner(self, updates, by_source):
        out = {}
        done = set()
        for axis, ms in self._axes():
            n, me = axis.size, axis.rank
            owner = owner_of([math.prod(marks.placement(p).shape) if not self.zero else p.numel() for p in ms], n)
            lengths = {id(p): self._lengths(axis, p) for p in ms}
            device = ms[0].device

            def held(p):
                t = by_source.get(id(p))
                # this rank's piece as a flat vector (a ZeRO piece's elements; a tp slice flattened)
                return updates[t].reshape(-1).float() if t is not None else torch.zeros(0, device=device)
            # to the owners: rank j receives, for each matrix it owns, every rank's piece
            send = [held(p) for j in range(n) for p, o in zip(ms, owner) if o == j]
            in_splits = [sum(lengths[id(p)][me] for p, o in zip(ms, owner) if o == j) for j in range(n)]
            out_splits = [sum(lengths[id(p)][i] for p, o in zip(ms, owner) if o == me) for i in range(n)]
            got = torch.empty(sum(out_splits), device=device)
            axis.all_to_all_into(got, torch.cat(send) if send else torch.zeros(0, device=device), out_splits,
                                 in_splits, label="muon all-to-all to owners")
            mine = [p for p, o in zip(ms, owner) if o == me]
            per_rank = list(got.split(out_splits))  # from rank i: its pieces of my matrices, in order
            results = []
            for k, p in enumerate(mine):
                parts = []
                for i in range(n):
                    before = sum(lengths[id(q)][i] for q in mine[:k])
                    parts.append(per_rank[i][before:before + lengths[id(p)][i]])
                o = muon_update(self._join(p, parts), self.ns_steps)
                results.append(self._split(axis, p, o))
            # back: rank i receives, from each owner, its pieces of that owner's matrices
            back = [results[k][i] for i in range(n) for k in range(len(mine))]
            got_back = torch.empty(sum(in_splits), device=device)
            axis.all_to_all_into(got_back, torch.cat(back) if back else torch.zeros(0, device=device),
                                 in_splits, out_splits, label="muon all-to-all from owners")
            from_owner = list(got_back.split(in_splits))
            seen = [0] * n
            for p, o in zip(ms, owner):
                k = lengths[id(p)][me]
                piece = from_owner[o][seen[o]:seen[o] + k]
                seen[o] += k
                t = by_source.get(id(p))
                if t is not None:
                    out[t] = piece.view(t.shape)
                done.add(id(p))
        for t, u in updates.items():  # whole on this rank (not cut over any axis): orthogonalised here
            if id(source(t)) not in done:
                out[t] = muon_update(u.float(), self.ns_steps)
        return out


class Muon(torch.optim.Optimizer):
    """Muon for the hidden matrices, AdamW for every other tensor, one optimizer (torch.optim's interface).

        Muon(groups, exchange, lr=, betas=, weight_decay=, momentum=0.95)

    `groups`: [{"params": [...], "weight_decay": ...}, ...] as the trainer builds them for AdamW, kept as they are (in
    their order: precision.MasterWeights pairs its masters with the parameters by position); each tensor is Muon's
    (`exchange.is_muon`: a hidden matrix) or AdamW's. The learning rate the trainer sets on every group is both kinds'
    η, and a group's weight decay both kinds' λ."""

    def __init__(self, groups, exchange, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, momentum=0.95,
                 nesterov=True):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov)
        super().__init__(groups, defaults)
        self.exchange = exchange

    @torch.no_grad()
    def step(self, closure=None):
        updates, muons = {}, []
        for group in self.param_groups:
            mu = group["momentum"]
            for p in group["params"]:
                if not self.exchange.is_muon(p):
                    self._adamw(group, p)
                    continue
                muons.append((group, p))
                if p.grad is None:  # no gradient: no update, but the collectives run the same on every rank
                    updates[p] = torch.zeros_like(p, dtype=torch.float32)
                    continue
                buf = self.state[p].get("momentum_buffer")
                if buf is None:
                    buf = self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                buf.mul_(mu).add_(p.grad)
                updates[p] = p.grad.add(buf, alpha=mu) if group["nesterov"] else buf.clone()
        if not updates:
            return
        ortho = self.exchange.orthogonalize(updates)
        for group, p in muons:
            if p.grad is None:
                continue
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(ortho[p].to(p.dtype), alpha=-group["lr"])

    def _adamw(self, group, p):
        """torch.optim.AdamW's update (the single-tensor one), same state names: checkpoints read them alike."""
        (b1, b2), lr, wd, eps = group["betas"], group["lr"], group["weight_decay"], group["eps"]
        if p.grad is None:
            return
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        t = state["step"].item()
        g = p.grad
        p.mul_(1 - lr * wd)
        state["exp_avg"].lerp_(g, 1 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
        bias1, bias2 = 1 - b1 ** t, 1 - b2 ** t
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(bias2)).add_(eps)
        p.addcdiv_(state["exp_avg"], denom, value=-lr / bias1)


def maker(exchange, cfg):
    """make(groups) -> Muon with the run's settings: what parallelize.build_optimizer hands precision.MasterWeights
    (which gives it the fp32 masters' groups) or calls itself."""
    def make(groups):
        return Muon(groups, exchange, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay,
                    momentum=cfg.muon_momentum)
    return make
