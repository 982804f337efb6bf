"""Checker for lesson 08's exercises.

    ./run.sh python lessons/08_expert_parallel/check.py [name ...] [--solutions | --module my.py] [--timeout S]
(what each option does, and the call from the notebook: lessons/_checker.py; here --timeout defaults to 30 s.)

top_k_route, dispatch_permutation, aux_loss (in this process): random routers for several (tokens, E, k), against
picotron.moe (`route`, the sort in `MoE.forward`, `aux_loss`). The checker names the first wrong token, expert or
pair, and says what a wrong answer matches instead when it is a known mistake: weights not renormalised, raw
logits as weights, the k least probable experts, the softmax over the tokens; an expert missing from the counts,
token indices instead of pair indices, experts in descending order, an unstable sort; Switch's fraction
normalised by k, the factor E missing, P averaged over the chosen experts only, a loss that no gradient crosses.

two_part_exposed (in this process): the exposed seconds of --ep-overlap's two-part schedule for a grid of (a, c, s)
(one part's all-to-all, one part's experts, the shared expert) against picotron.planner.ep_overlap_exposed_seconds; it
names the blocking 4a, the end of combine 2 instead of the exposure, combine 2 forgotten, a link that carries two
all-to-alls at once, and the closed form 2a − s used outside its regime.

deepseek_router_step (in this process): random logits and a bias large enough to change choices, for the same
(tokens, E, k), against picotron.moe.route (sigmoid, with the bias) and the update b + γ·sign(mean load − load);
it names the bias leaking into the gates, a choice that ignores the bias, a softmax for the sigmoid, gates not
normalised, the update's sign reversed, an update proportional to the load error, the step returned without b.

exchange_splits (on 2 and 4 processes): every rank's counts are random; its (send, recv) must be the reference's;
the checker names the rank and the peer whose split is wrong, or the ranks stuck in a collective.

How it works: as in every multi-rank checker (lessons/_checker.py), each child runs `_on_rank` (below).
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # lessons/: _checker, which puts the repository root on sys.path too
from _checker import _Failure, entry_points, in_process, load, on_ranks, rendezvous, where  # noqa: E402

import torch  # noqa: E402

from picotron import moe  # noqa: E402
from picotron.launch import run_on_ranks  # noqa: E402


LEARNER = HERE / "exercise.py"
SOLUTIONS = HERE / "solution.py"
TIMEOUT_S = 30.0
EXERCISES = {"top_k_route": "top_k_route", "dispatch_permutation": "dispatch_permutation", "aux_loss": "aux_loss",
             "exchange_splits": "exchange_splits", "deepseek_router_step": "deepseek_router_step",
             "two_part_exposed": "two_part_exposed"}
ROUTERS = ((6, 4, 2), (10, 8, 2), (7, 8, 1), (9, 8, 3), (12, 16, 4))  # (tokens, E, k)
WORLD_SIZES = (2, 4)
SPLIT_EXPERTS = 8


def _logits(n, E, seed):
    return torch.randn(n, E, generator=torch.Generator().manual_seed(seed)) * 2


def _experts(n, E, k, seed, skip=()):
    """k distinct experts per token (never those in `skip`)."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(E) if e not in skip])
    return torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(n)])


def _by_expert(weights, experts):
    """Per token: {expert: weight}."""
    return [dict(zip(e.tolist(), w.tolist())) for w, e in zip(weights, experts)]


# ------------------------------------------------------------------------------------------ exercise 1
def _route_problem(fn, path):
    for n, E, k in ROUTERS:
        logits = _logits(n, E, 100 * E + k)
        head = f"{n} tokens, E={E}, k={k}"
        got = fn(logits.clone(), k)
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(torch.is_tensor(t) for t in got)):
            return f"{head}: returned {type(got).__name__} {str(got)[:60]!r}; return the pair (weights, experts)"
        w, e = got
        if tuple(w.shape) != (n, k) or tuple(e.shape) != (n, k):
            return f"{head}: weights {list(w.shape)} and experts {list(e.shape)}; both must be [tokens, k] = [{n}, {k}]"
        want_w, want_e, probs = moe.route(logits, k)
        for t in range(n):
            mine, theirs = set(e[t].tolist()), set(want_e[t].tolist())
            if mine == theirs:
                continue
            p = ", ".join(f"{x:.3f}" for x in probs[t].tolist())
            if mine == set(probs[t].topk(k, largest=False).indices.tolist()):
                return f"{head}, token {t}: you chose the k LEAST probable experts {sorted(mine)} (probabilities {p})"
            if mine == set(torch.softmax(logits, 0)[t].topk(k).indices.tolist()):
                return (f"{head}, token {t}: experts {sorted(mine)} are the top-k of a softmax over the TOKENS (dim 0); "
                        f"the softmax is over each token's E experts (dim -1): expected {sorted(theirs)}")
            if len(mine) < k:
                return f"{head}, token {t}: expert listed twice: {e[t].tolist()}"
            return f"{head}, token {t}: experts {sorted(mine)} chosen, the {k} most probable are {sorted(theirs)} ({p})"
        if w.dtype != torch.float32:
            return f"{head}: weights are {w.dtype}; compute the softmax in fp32 (logits.float())"
        mine, theirs = _by_expert(w, e), _by_expert(want_w, want_e)
        top = probs.gather(1, e)
        if k > 1 and torch.allclose(w, top, atol=1e-6):
            return (f"{head}: token 0's weights sum to {float(w[0].sum()):.4f}, not 1: these are the chosen "
                    f"probabilities; renormalise them over the k chosen (divide by their sum), as Mixtral does")
        if torch.allclose(w, logits.gather(1, e), atol=1e-6):
            return f"{head}: the weights are the raw logits of the chosen experts; take the softmax, then renormalise"
        for t in range(n):
            for x, wx in theirs[t].items():
                if abs(mine[t][x] - wx) > 1e-5:
                    return (f"{head}, token {t}, expert {x}: weight {mine[t][x]:.5f}, expected {wx:.5f} (the token's "
                            f"chosen probabilities renormalised to sum to 1)")
    logits = _logits(5, 8, 7).to(torch.bfloat16)
    w, e = fn(logits, 2)
    want_w, _, _ = moe.route(logits, 2)
    if w.dtype != torch.float32 or not torch.allclose(w.float(), want_w, atol=1e-5):
        return (f"logits in bf16: weights {w.dtype}, max error {(w.float() - want_w).abs().max():.1e}; take the "
                f"softmax in fp32 (logits.float()): routing decisions made in bf16 are coarse")
    return None


# ------------------------------------------------------------------------------------------ exercise 2
def _dispatch_problem(fn, path):
    cases = [(n, E, k, ()) for n, E, k in ROUTERS] + [(9, 6, 2, (2, 5))]  # experts 2 and 5 chosen by no token
    for n, E, k, skip in cases:
        experts = _experts(n, E, k, 7 * n + E, skip)
        flat = experts.flatten()
        head = f"{n} tokens, E={E}, k={k}"
        got = fn(experts.clone(), E)
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(torch.is_tensor(t) for t in got)):
            return f"{head}: returned {type(got).__name__} {str(got)[:60]!r}; return the pair (order, counts)"
        order, counts = (t.flatten() for t in got)
        want_counts = torch.bincount(flat, minlength=E)
        if counts.numel() != E:
            missing = f" (experts {list(skip)} were chosen by no token: bincount(..., minlength=E))" if skip else ""
            return f"{head}: counts has {counts.numel()} entries, expected one per expert: {E}{missing}"
        if not torch.equal(counts.long(), want_counts):
            x = int((counts.long() != want_counts).nonzero()[0])
            return f"{head}: counts[{x}] = {int(counts[x])}, expected {int(want_counts[x])} (pairs that chose expert {x})"
        want = torch.argsort(flat, stable=True)
        if torch.equal(order.long(), want):
            continue
        if order.numel() == n * k and torch.equal(order.long(), want // k):
            return (f"{head}: your order holds TOKEN indices ({order[:6].tolist()}...), expected PAIR indices (token "
                    f"p // k, choice p % k): {want[:6].tolist()}...; the combine needs the pair to find its weight")
        if order.numel() != n * k or not torch.equal(torch.sort(order.long()).values, torch.arange(n * k)):
            return f"{head}: order must be a permutation of the {n * k} pairs 0..{n * k - 1}; got {order.tolist()[:12]}..."
        seq = flat[order.long()]
        if k * n > 1 and bool((seq[1:] <= seq[:-1]).all()) or torch.equal(seq, torch.sort(flat, descending=True).values):
            return f"{head}: experts come in DESCENDING order ({seq[:8].tolist()}...): expert 0's pairs first"
        if not bool((seq[1:] >= seq[:-1]).all()):
            i = int((seq[1:] < seq[:-1]).nonzero()[0])
            return (f"{head}: position {i + 1} holds a pair of expert {int(seq[i + 1])} after one of expert "
                    f"{int(seq[i])}: sort the pairs by expert")
        for x in range(E):
            mine = order[seq == x].tolist()
            if mine != sorted(mine):
                return (f"{head}: expert {x}'s pairs {mine} are not in token order (pairs of tokens "
                        f"{[p // k for p in mine]}); an unstable sort reorders equal keys: torch.argsort(..., "
                        f"stable=True). The capacity (first come, first served) and a reproducible sum need it")
    return None


# ------------------------------------------------------------------------------------------ exercise 3
def _aux_problem(fn, path):
    for n, E, k in ROUTERS:
        logits = _logits(n, E, 3 * n + E).requires_grad_()
        probs = torch.softmax(logits, -1)
        experts = probs.topk(k, -1).indices
        head = f"{n} tokens, E={E}, k={k}"
        got = fn(probs, experts.clone(), E)
        if not torch.is_tensor(got) or got.numel() != 1:
            return f"{head}: returned {str(got)[:60]!r}; return a scalar tensor"
        want = moe.aux_loss(probs, experts, E)
        g, w = float(got.detach()), float(want.detach())
        if abs(g - w) > 1e-5 * abs(w):
            f = torch.bincount(experts.flatten(), minlength=E).float() / n
            chosen_mean = (torch.zeros_like(probs).scatter(1, experts, probs.gather(1, experts))).mean(0)
            if abs(g - w / k) < 1e-5 * w and k > 1:
                return (f"{head}: aux = {g:.5f} = expected / k: you normalised f by the n·k choices (Σf = 1); HF "
                        f"Mixtral's f_e is expert e's choices per TOKEN (Σf = k), so balanced routing gives k, not 1")
            if abs(g - w / E) < 1e-5 * w:
                return f"{head}: aux = {g:.5f} = expected / E: the factor E is missing (it makes balance give k for any E)"
            if abs(g - float(E * (f * chosen_mean).sum())) < 1e-5 * w:
                return (f"{head}: aux = {g:.5f}: your P_e averages only the CHOSEN probabilities; P_e is the mean "
                        f"of expert e's probability over all tokens (probs.mean(0)): expected {w:.5f}")
            return f"{head}: aux = {g:.6f}, expected {w:.6f}"
        if not got.requires_grad:
            return (f"{head}: the value is right but no gradient reaches probs (detached, or computed from "
                    f"Python numbers): the router learns to balance only through P_e")
        (gg,) = torch.autograd.grad(got, logits, retain_graph=True)
        (wg,) = torch.autograd.grad(moe.aux_loss(probs, experts, E), logits)
        if not torch.allclose(gg, wg, rtol=1e-5, atol=1e-7):
            t, x = (int(i) for i in (gg - wg).abs().argmax().item().__divmod__(E))
            return (f"{head}: the gradient differs: d aux / d logits[{t}, {x}] = {gg[t, x]:.3e}, expected "
                    f"{wg[t, x]:.3e} (f must be a constant count; only P carries the gradient)")
    E, k = 8, 2
    balanced = fn(torch.full((16, E), 1 / E), torch.arange(32).view(16, 2) % E, E)
    if abs(float(balanced) - k) > 1e-6:
        return (f"perfectly balanced routing (every expert equally probable and equally chosen): aux = "
                f"{float(balanced):.4f}, expected k = {k}")
    return None


# ------------------------------------------------------------------------------------------ exercise 5
def _deepseek_problem(fn, path):
    gamma = 0.01
    for n, E, k in ROUTERS:
        logits = _logits(n, E, 11 * n + E)
        bias = torch.randn(E, generator=torch.Generator().manual_seed(5 * E + k)) * 0.5
        head = f"{n} tokens, E={E}, k={k}"
        got = fn(logits.clone(), k, bias.clone(), gamma)
        if not (isinstance(got, (tuple, list)) and len(got) == 3 and all(torch.is_tensor(t) for t in got)):
            return f"{head}: returned {type(got).__name__} {str(got)[:60]!r}; return (weights, experts, new_bias)"
        w, e, b = got
        if tuple(w.shape) != (n, k) or tuple(e.shape) != (n, k) or tuple(b.shape) != (E,):
            return (f"{head}: weights {list(w.shape)}, experts {list(e.shape)}, new_bias {list(b.shape)}; expected "
                    f"[{n}, {k}], [{n}, {k}], [{E}]")
        want_w, want_e, _ = moe.route(logits, k, "sigmoid", bias)
        s = torch.sigmoid(logits)
        for t in range(n):
            mine, theirs = set(e[t].tolist()), set(want_e[t].tolist())
            if mine == theirs:
                continue
            if mine == set(s[t].topk(k).indices.tolist()):
                return (f"{head}, token {t}: experts {sorted(mine)} are the top-k of the sigmoids alone: the bias was "
                        f"ignored in the choice (choose by sigmoid + bias): expected {sorted(theirs)}")
            if mine == set((torch.softmax(logits[t], -1) + bias).topk(k).indices.tolist()) or \
                    mine == set(torch.softmax(logits[t], -1).topk(k).indices.tolist()):
                return (f"{head}, token {t}: experts {sorted(mine)} come from a softmax; DeepSeek-V3 scores each expert "
                        f"on its own with a sigmoid: expected {sorted(theirs)}")
            return (f"{head}, token {t}: experts {sorted(mine)} chosen; the {k} largest sigmoid + bias are "
                    f"{sorted(theirs)}")
        mine, theirs = _by_expert(w, e), _by_expert(want_w, want_e)
        leaked = (s + bias).gather(1, e)
        wrong = [(t, x) for t in range(n) for x, wx in theirs[t].items() if abs(mine[t][x] - wx) > 1e-5]
        if wrong and (torch.allclose(w, leaked / leaked.sum(-1, keepdim=True), atol=1e-6)
                      or torch.allclose(w, leaked, atol=1e-6)):
            return (f"{head}: the bias leaked into the gates: the weights are made of sigmoid + bias; the bias only "
                    f"chooses the experts, the gates are the chosen sigmoids alone (normalised), so the loss never "
                    f"sees it")
        if wrong and torch.allclose(w, s.gather(1, e), atol=1e-6):
            return (f"{head}: token 0's weights sum to {float(w[0].sum()):.4f}, not 1: these are the chosen sigmoids; "
                    f"normalise them over the k chosen (divide by their sum)")
        if wrong:
            t, x = wrong[0]
            return (f"{head}, token {t}, expert {x}: weight {mine[t][x]:.5f}, expected {theirs[t][x]:.5f} (the chosen "
                    f"sigmoids normalised to sum to 1)")
        load = torch.bincount(want_e.flatten(), minlength=E).float()
        step = gamma * torch.sign(load.mean() - load)
        if torch.allclose(b, bias - step, atol=1e-7) and step.abs().sum() > 0:
            x = int(step.abs().argmax())
            return (f"{head}: sign of the update reversed: expert {x} took {int(load[x])} choices (mean "
                    f"{float(load.mean()):.2f}) and its bias went {'up' if b[x] > bias[x] else 'down'}; an "
                    f"overloaded expert's bias must go DOWN: b + γ·sign(mean load − load)")
        if torch.allclose(b, bias + gamma * (load.mean() - load), atol=1e-6):
            return (f"{head}: the bias moved by γ times the load error; the rule moves each bias by exactly ±γ "
                    f"(the sign of the error), whatever its size")
        if torch.allclose(b, step, atol=1e-7):
            return f"{head}: new_bias is the step alone; return the old bias plus the step"
        if not torch.allclose(b, bias + step, atol=1e-7):
            x = int((b - bias - step).abs().argmax())
            return (f"{head}: new_bias[{x}] = {float(b[x]):.4f}, expected {float(bias[x] + step[x]):.4f} (expert {x}: "
                    f"load {int(load[x])}, mean {float(load.mean()):.2f}, γ = {gamma})")
    return None


# ------------------------------------------------------------------------------------------ exercise 4
# ------------------------------------------------------------------------------------------ exercise 6
EXPOSED_CASES = ((1.0, 2.0, 0.0), (1.0, 2.0, 0.5), (2.0, 1.0, 0.0), (2.0, 1.0, 0.5), (1.0, 0.0, 0.0), (1.0, 5.0, 3.0),
                 (3.0, 2.0, 1.0), (1.0, 1.0, 0.0), (0.5, 3.0, 2.0), (2.0, 1.5, 2.5))  # (a, c, s)


def _parallel_link(a, c, s):
    """The schedule on a link that carries several all-to-alls at once (a mistake): dispatch 2 ends at a."""
    x1 = max(a, s)
    x2 = max(a, x1 + c)
    return max(x1 + c + a, x2 + c) + a - (s + 2 * c)


def _exposed_problem(fn, path):
    from picotron.planner import ep_overlap_exposed_seconds as want_of

    for a, c, sh in EXPOSED_CASES:
        head = f"a={a:g}, c={c:g}, s={sh:g}"
        got = fn(a, c, sh)
        try:
            got = float(got)
        except (TypeError, ValueError):
            return f"{head}: returned {type(got).__name__} {str(got)[:60]!r}; return a number of seconds"
        want = want_of(a, c, sh)
        if abs(got - want) < 1e-9:
            continue
        close = lambda x: abs(got - x) < 1e-9  # noqa: E731
        if close(4 * a):
            hint = ("that is the blocking exchange's 4a: nothing hidden; part 1's experts run while dispatch 2 "
                    "travels, part 2's while combine 1 does")
        elif close(want + sh + 2 * c):
            hint = "that is when combine 2 ends; subtract the compute (s + 2c) to get what was exposed"
        elif close(2 * a - sh) and (c < a or sh > a):  # (the closed form, outside the regime where it holds)
            hint = ("2a − s holds only when the experts cover a part's all-to-all (c ≥ a) and the shared expert fits "
                    "under the first dispatch (s ≤ a); here " + ("c < a: the link is busier than the compute"
                                                                  if c < a else "s > a: it hides at most a"))
        elif close(want - a):
            hint = "combine 2 is missing: nothing runs after it, so its a seconds are always exposed"
        elif close(_parallel_link(a, c, sh)):
            hint = ("your link carried two all-to-alls at once; it carries one at a time, in launch order: "
                    "dispatch 2 arrives at 2a, combine 1 waits for it")
        else:
            hint = "follow the timeline event by event: when does each all-to-all start, when each computation?"
        return f"{head}: returned {got:g}, expected {want:g}: {hint}"
    return None


def _counts(rank, n):
    g = torch.Generator().manual_seed(40 + 10 * n + rank)
    return torch.randint(0, 20, (SPLIT_EXPERTS,), generator=g)


def reference_splits(n):
    counts = [_counts(r, n) for r in range(n)]
    L = SPLIT_EXPERTS // n
    send = [[int(c[j * L:(j + 1) * L].sum()) for j in range(n)] for c in counts]
    return [(send[r], [send[j][r] for j in range(n)]) for r in range(n)]


def compare_splits(n, results):
    want = reference_splits(n)
    L = SPLIT_EXPERTS // n
    for r, (got, (ws, wr)) in enumerate(zip(results, want)):
        try:
            s, rv = ([int(x) for x in (t.tolist() if torch.is_tensor(t) else t)] for t in got)
        except (TypeError, ValueError):
            return f"rank {r}: returned {str(got)[:60]!r}; return (send, recv), two lists of {n} ints"
        if len(s) != n or len(rv) != n:
            return f"rank {r}: send has {len(s)} entries and recv {len(rv)}; one per rank of the group: {n}"
        for j in range(n):
            if s[j] != ws[j]:
                return (f"rank {r}: send[{j}] = {s[j]}, expected {ws[j]}: the rows of its counts for rank {j}'s "
                        f"experts {j * L}..{(j + 1) * L - 1}")
        for j in range(n):
            if rv[j] != wr[j]:
                hint = " (that is its own send[j]: recv[j] is what rank j sends to it)" if rv[j] == ws[j] else ""
                return f"rank {r}: recv[{j}] = {rv[j]}, expected {wr[j]}, rank {j}'s send[{r}]{hint}"
    return None


def _on_rank(path, name):
    """Runs on every rank: the learner's exchange_splits on this rank's counts; returns (send, recv)."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    try:
        mod = load(path, "ex08")
    except Exception as e:  # noqa: BLE001
        raise _Failure(f"cannot import {Path(path).name}: {type(e).__name__}: {e}{where(e, path)}") from None
    try:
        send, recv = mod.exchange_splits(_counts(rank, n).clone(), None)
        result = (torch.as_tensor(send).tolist(), torch.as_tensor(recv).tolist())
    except Exception as e:  # noqa: BLE001 - any bug in the learner's code is a failed check
        raise _Failure(f"{type(e).__name__}: {e}{where(e, path)}") from None
    rendezvous(n, "check08/done")
    return result


def _in_process(name, path, report, problem_of, success):
    return in_process(name, path, report, problem_of, success, "ex08")


CASES = ", ".join(f"({n}, {E}, {k})" for n, E, k in ROUTERS)
SUCCESS = {
    "top_k_route": f": Mixtral's weights and experts for (tokens, E, k) in {CASES}, and fp32 from bf16 logits",
    "dispatch_permutation": f": order and counts for {CASES} and E=6 with two experts unchosen",
    "aux_loss": f": value and gradient for {CASES}; k at perfect balance",
    "deepseek_router_step": f": DeepSeek-V3's experts, gates and bias update for {CASES}, a bias that changes choices",
    "two_part_exposed": f": the exposed seconds of the two-part schedule for {len(EXPOSED_CASES)} (a, c, s), against "
                        f"picotron.planner.ep_overlap_exposed_seconds (both regimes, a shared expert longer than a)",
}
PROBLEMS = {"top_k_route": _route_problem, "dispatch_permutation": _dispatch_problem, "aux_loss": _aux_problem,
            "deepseek_router_step": _deepseek_problem, "two_part_exposed": _exposed_problem}


def check_one(name, path, report, timeout_s):
    if name in PROBLEMS:
        return _in_process(name, path, report, PROBLEMS[name], SUCCESS[name])
    on_ranks(lambda n: f"exchange_splits on {n} ranks", WORLD_SIZES,
             lambda n: run_on_ranks(_on_rank, n, str(path), name, timeout_s=timeout_s),
             lambda n, results: (compare_splits(n, results), f": every rank's send and recv ({SPLIT_EXPERTS} experts, "
                                                             f"{SPLIT_EXPERTS // n} per rank)"),
             report, path, timeout_s)
    return None


check, main = entry_points("Check lesson 08's exercises (exchange_splits on 2 and 4 processes).",
                           EXERCISES, check_one, LEARNER, SOLUTIONS, TIMEOUT_S, "ex08")


if __name__ == "__main__":
    sys.exit(main())
