"""Checker for lesson 02's exercises: runs your collective on 2, 3 and 4 real processes (gloo, through
picotron.launch.run_on_ranks) and says exactly what is wrong — which rank, which element, which shape, which
message went where — or which ranks hang, and on which line of your file they wait.

    ./run.sh python lessons/02_collectives/check.py [name ...] [--solutions | --module my.py] [--timeout S]
(what each option does, and the call from the notebook: lessons/_checker.py; here --timeout defaults to 10 s.)

How it works: run_on_ranks pickles the function it runs by reference, so the children run `_on_rank` (below,
at module level), which imports YOUR file by path inside each child, counts every send/isend (destination
and size), switches off the built-in collectives, runs your function on deterministic inputs and returns
the outputs. The parent computes the expected outputs with plain torch (torch.cat, sum, tensor_split) and
compares. The puzzle (ring_or_tree) is checked against the alpha-beta model (experiment.py's) on many cases,
naming the usual mistakes, then against a real run of picotron's ring and tree all-reduce on 4 processes
over an emulated link (`_SlowLink`: every message takes alpha + bytes * beta, slept, on top of the real
transfer), where this CPU's own overheads are small next to the link's time.
"""
import linecache
import math
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # lessons/: _checker, which puts the repository root on sys.path too
from _checker import _Failure, entry_points, failure_message, load, where  # noqa: E402

import torch  # noqa: E402

from picotron.launch import RankError, RankTimeout, run_on_ranks  # noqa: E402

import _common  # noqa: E402

MODEL = _common.load_lesson("02_collectives")  # experiment.py: the alpha-beta model the puzzle is checked against

LEARNER = HERE / "exercise.py"
SOLUTIONS = HERE / "solution.py"
WORLD_SIZES = (2, 3, 4)
TIMEOUT_S = 10.0

# (length, dtype[, src]) per exercise: odd lengths, lengths that n does not divide, a length-1 tensor, a
# source that is not rank 0 (src -1 means the last rank).
CASES = {
    "ring_all_gather": [(5, "int64"), (1, "int64"), (6, "float32")],
    "ring_reduce_scatter": [(12, "int64"), (7, "int64"), (10, "float32")],
    "tree_broadcast": [(5, "int64", 0), (3, "int64", -1), (4, "float32", 1)],
    # the puzzle: (n, nbytes, alpha, beta) on a GPU-like link (5 us, 50 GB/s) and a CPU-like one (500 us, 1 GB/s)
    "ring_or_tree": [(n, N, a, b) for n in (4, 64, 3, 5, 8, 2, 1000) for N in (1024, 300_000, 64 * 2**20)
                     for a, b in ((5e-6, 1 / 50e9), (500e-6, 1 / 1e9))],
}
# The real run: 4 processes, an emulated link slow enough (20 ms per message, 20 MB/s) that this CPU's own costs
# (a few ms per step when the machine is busy) are small next to it. Measured / predicted must lie in MARGIN:
# a sleep never ends early (the -10% allows for the skew of the barrier), the CPU's own overheads only add.
PUZZLE_LINK, PUZZLE_N, PUZZLE_SIZES, PUZZLE_REPEATS, MARGIN = (20e-3, 20e6), 4, (1024, 2 * 2**20), 4, (0.9, 1.5)
BUILTINS = ("all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
            "reduce_scatter_single", "all_reduce", "broadcast", "reduce", "scatter", "gather", "all_to_all",
            "all_to_all_single")


def make_input(length, dtype, rank):
    """Rank r's tensor: 100·(r+1) + [0, 1, 2, ...], so every value says whose it is (rank 2: 300, 301, ...)."""
    return (100 * (rank + 1) + torch.arange(length)).to(getattr(torch, dtype))


# --------------------------------------------------------------------------------------- in each child
def _forbidden(name):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"dist.{name} is the collective you are building: use only send/recv/isend/irecv")
    return refuse


def _plain(value):
    if not torch.is_tensor(value):
        return None
    return dict(shape=list(value.shape), dtype=str(value.dtype).replace("torch.", ""), values=value.flatten().tolist())


def _on_rank(path, name, cases):
    """Runs on every rank (module level, so run_on_ranks can pickle it): import the learner's file by path,
    run `name` on each case, return [{out, sends, input_changed, returned}] for this rank."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    sends = []  # (dst, numel) of every send of the current case

    def counted(real):
        def send(*args, **kwargs):
            tensor = args[0] if args else kwargs.get("tensor")
            dst = args[1] if len(args) > 1 else kwargs.get("dst", kwargs.get("group_dst"))
            sends.append((dst, tensor.numel() if torch.is_tensor(tensor) else None))
            return real(*args, **kwargs)
        return send

    dist.send, dist.isend = counted(dist.send), counted(dist.isend)
    for builtin in BUILTINS:
        if hasattr(dist, builtin):
            setattr(dist, builtin, _forbidden(builtin))
    try:
        fn = getattr(load(path, "ex02"), name)
    except Exception as e:  # noqa: BLE001
        raise _Failure(f"cannot import {Path(path).name}: {type(e).__name__}: {e}{where(e, path)}") from None
    results = []
    for case in cases:
        x = make_input(case[0], case[1], rank)
        original = x.clone()
        sends.clear()
        try:
            returned = fn(x, case[2] % n) if name == "tree_broadcast" else fn(x)
        except Exception as e:  # noqa: BLE001 - any bug in the learner's code is a failed check
            raise _Failure(f"{label(case, n)}: {type(e).__name__}: {e}{where(e, path)}") from None
        out = x if name == "tree_broadcast" else returned
        results.append(dict(out=_plain(out), sends=list(sends), returned=type(returned).__name__,
                            input_changed=name != "tree_broadcast" and not torch.equal(x, original)))
    return results


# ------------------------------------------------------------------------------------------ the parent
def label(case, n):
    text = f"length {case[0]} {case[1]}"
    return text + (f", src {case[2] % n}" if len(case) > 2 else "")


def fmt(v):
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def first_difference(rank, got, expected):
    """'rank r: element j is X, expected Y' (+ how many more), or None when equal."""
    exp = expected.flatten().tolist()
    bad = [j for j, (a, b) in enumerate(zip(got["values"], exp)) if a != b]
    if not bad:
        return None
    j = bad[0]
    more = f" ({len(bad) - 1} more elements differ)" if len(bad) > 1 else ""
    return f"rank {rank}: element {j} is {fmt(got['values'][j])}, expected {fmt(exp[j])}{more}"


def check_output(rank, got, expected, returned):
    """Shape, dtype and values of one rank's output; a message or None."""
    if got is None:
        return f"rank {rank} returned {returned}; return the output tensor"
    if got["shape"] != list(expected.shape):
        return f"rank {rank} output has shape {got['shape']}, expected {list(expected.shape)}"
    if got["dtype"] != str(expected.dtype).replace("torch.", ""):
        return f"rank {rank} output has dtype {got['dtype']}, expected {str(expected.dtype).replace('torch.', '')}"
    return first_difference(rank, got, expected)


def same(got, tensor):
    return got is not None and got["shape"] == list(tensor.shape) and got["values"] == tensor.flatten().tolist()


def ring_pattern(results, n, what):
    """Every rank sends n - 1 messages, all to its right neighbour."""
    for r, res in enumerate(results):
        wrong = [d for d, _ in res["sends"] if d is not None and d != (r + 1) % n]
        if wrong:
            return (f"right values, but rank {r} sent a message to rank {wrong[0]}: in a ring every rank sends only "
                    f"to its right neighbour (rank + 1) % n = {(r + 1) % n}")
        if len(res["sends"]) != n - 1:
            return f"right values, but rank {r} sent {len(res['sends'])} messages; a ring {what} sends n - 1 = {n - 1}"
    return None


def compare_ring_all_gather(case, n, results):
    inputs = [make_input(case[0], case[1], r) for r in range(n)]
    expected = torch.cat(inputs)
    for r, res in enumerate(results):
        problem = check_output(r, res["out"], expected, res["returned"])
        if problem and problem.startswith(f"rank {r}: element"):
            j = int(re.search(r"element (\d+)", problem).group(1))
            s, L = j // case[0], case[0]
            piece = torch.tensor(res["out"]["values"][s * L:(s + 1) * L], dtype=expected.dtype)
            owner = next((t for t in range(n) if torch.equal(piece, inputs[t])), None)
            if owner is not None:
                problem += (f" — elements {s * L}..{s * L + L - 1} hold rank {owner}'s tensor, but slot {s} is rank "
                            f"{s}'s: check which slot each step receives into")
        if problem:
            return problem
    return ring_pattern(results, n, "all-gather")


def compare_ring_reduce_scatter(case, n, results):
    inputs = [make_input(case[0], case[1], r) for r in range(n)]
    total = torch.stack(inputs).sum(0)
    chunks = torch.tensor_split(total, n)
    for r, res in enumerate(results):
        expected, got = chunks[r], res["out"]
        problem = check_output(r, got, expected, res["returned"])
        if problem and "shape" in problem and case[0] % n:
            sizes = [len(c) for c in chunks]
            problem += (f" — {case[0]} elements on {n} ranks split into chunks of {sizes} (torch.tensor_split: the "
                        f"first {case[0] % n} get one extra element)")
        elif problem and "element" in problem:
            own = [torch.tensor_split(x, n)[r] for x in inputs]
            other = next((k for k in range(n) if k != r and same(got, chunks[k])), None)
            missing = next((t for t in range(n) if same(got, expected - own[t])), None)
            twice = next((t for t in range(n) if same(got, expected + own[t])), None)
            if other is not None:
                problem += f" — that is chunk {other} of the sum; rank {r} must end with chunk {r} (check the step indices)"
            elif same(got, own[r]):
                problem += f" — that is rank {r}'s own input chunk: nothing was added"
            elif missing is not None:
                problem += f" — rank {missing}'s contribution is missing (one step too few, or copied instead of added?)"
            elif twice is not None:
                problem += f" — rank {twice}'s contribution is counted twice"
        if problem:
            return problem
        if res["input_changed"]:
            return f"right values, but rank {r} changed its input tensor: add into copies (clone), the caller keeps its data"
    return ring_pattern(results, n, "reduce-scatter")


def compare_tree_broadcast(case, n, results):
    src = case[2] % n
    expected = make_input(case[0], case[1], src)
    for r, res in enumerate(results):
        problem = check_output(r, res["out"], expected, res["returned"])
        if problem and same(res["out"], make_input(case[0], case[1], r)):
            problem += (f" — rank {r} still holds its own data: it never received (or received into a copy; the "
                        f"broadcast is in place)")
        if problem:
            return problem
    bound = math.ceil(math.log2(n))
    counts = [len(res["sends"]) for res in results]
    busiest = max(range(n), key=lambda r: counts[r])
    if counts[busiest] > bound:
        return (f"right values, but rank {busiest} sent {counts[busiest]} messages; in a binomial tree no rank sends "
                f"more than ceil(log2 {n}) = {bound}: the ranks that already have the data forward it")
    if sum(counts) != n - 1:
        return f"right values, but {sum(counts)} messages in all; a broadcast needs n - 1 = {n - 1} (one per receiver)"
    return None


COMPARE = {"ring_all_gather": compare_ring_all_gather, "ring_reduce_scatter": compare_ring_reduce_scatter,
           "tree_broadcast": compare_tree_broadcast}


def hang_message(e, path, timeout_s):
    """'hang: ranks 0, 2 still waiting after 10 s (...)' and, per late rank, the line of the learner's file
    where it waits (from the stacks run_on_ranks collects)."""
    ranks = e.ranks
    who = f"rank {ranks[0]} is" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks)) + " are"
    lines = [f"hang: {who} still waiting after {timeout_s:g} s (a send without a matching recv, or a recv that "
             f"nobody sends to?)"]
    name = Path(path).name
    for r, stack in re.findall(r"--- where rank (\d+) was.*?---\n(.*?)(?=\n--- where rank|\Z)", str(e), re.S):
        frame = re.search(rf'File "([^"]*{re.escape(name)})", line (\d+) in (\w+)', stack)
        if frame:
            source = linecache.getline(frame.group(1), int(frame.group(2))).strip()
            lines.append(f"        rank {r} waits in {frame.group(3)}, line {frame.group(2)}: {source}")
    return "\n".join(lines)


# -------------------------------------------------------------------------------- the puzzle: ring or tree?
def model_time(algorithm, n, N, a, b):
    return (MODEL.ring_allreduce_time if algorithm == "ring" else MODEL.tree_allreduce_time)(n, N, a, b)


def close(x, y, rel=1e-6):
    return isinstance(x, (int, float)) and abs(x - y) <= rel * abs(y)


def diagnose(algorithm, n, N, a, b, got):
    """' — why', when `got` is one of the usual wrong formulas, else ''."""
    rounds = math.ceil(math.log2(n))
    usual = {"ring": [
        ((n - 1) * a + (n - 1) / n * N * b, "that is a reduce-scatter (or an all-gather) alone; a ring all-reduce is "
                                           "both, one after the other: 2(n - 1) steps"),
        (2 * (n - 1) * (a + N * b), "a ring step moves one chunk, M/n bytes, not the whole message"),
        (2 * n * a + 2 * N * b, "n - 1 steps per phase, not n: a rank already holds its own chunk"),
        (2 * (n - 1) / n * N * b, "the latency term is missing: each of the 2(n - 1) steps pays alpha"),
        (2 * (n - 1) * a, "the bandwidth term is missing: every rank sends 2(n - 1)/n * M bytes, beta seconds each")],
        "tree": [
        (rounds * (a + N * b), "that is one tree (a reduce or a broadcast); the naive all-reduce runs two, one after "
                               "the other"),
        (2 * math.log2(n) * (a + N * b), f"rounds are whole: ceil(log2 n) (n = {n} needs {rounds} rounds, not "
                                         f"{math.log2(n):.3g})"),
        (2 * n.bit_length() * (a + N * b), f"ceil(log2 {n}) = {rounds}, but {n}.bit_length() = {n.bit_length()} "
                                           f"((n - 1).bit_length() is ceil(log2 n))"),
        (2 * rounds * a + 2 * (n - 1) / n * N * b, "a tree hop carries the whole message, M bytes, not a chunk"),
        (2 * rounds * N * b, "the latency term is missing: every round pays alpha"),
        (2 * rounds * a, "the bandwidth term is missing: every round moves M bytes, beta seconds each"),
        (2 * (n - 1) * (a + N * b), "a binomial tree needs ceil(log2 n) rounds each way, not n - 1: the ranks that "
                                    "have the data double every round")]}
    for value, why in usual[algorithm]:
        if close(got, value):
            return f" — {why}"
    other = "tree" if algorithm == "ring" else "ring"
    if close(got, model_time(other, n, N, a, b)):
        return f" — that is the {other}'s time: check which algorithm you computed for {algorithm!r}"
    want = model_time(algorithm, n, N, a, b)
    if close(got, 1e3 * want) or close(got, 1e6 * want):
        return " — return seconds (not ms or µs)"
    return ""


def winner_of(ring, tree):
    return ("ring", tree / ring) if ring <= tree else ("tree", ring / tree)


def check_answer(answer, want, what):
    """A message when ring_or_tree's `answer` is not `want` = (winner, factor), else None."""
    if not (isinstance(answer, tuple) and len(answer) == 2 and answer[0] in ("ring", "tree")
            and isinstance(answer[1], (int, float))):
        return f"{what} returned {answer!r}; return a tuple (\"ring\" or \"tree\", how many times faster)"
    (winner, factor), (right, times) = answer, want
    if winner != right:
        return f"{what} says {winner!r}, but the {right} is faster, by {times:.4g}x" + (
            " (you named the slower one)" if close(factor, times, 1e-3) or close(factor, 1 / times, 1e-3) else "")
    if close(factor, 1 / times, 1e-3) and times != 1:
        return f"{what}: factor {factor:.4g}, expected {times:.4g}: return T_slower / T_faster (>= 1), not its inverse"
    if not close(factor, times, 1e-6):
        return f"{what}: factor {factor:.4g}, expected {times:.4g} (T_slower / T_faster from the model)"
    return None


class _SlowLink:
    """While active, every dist.isend / dist.irecv also takes the time of a link with `alpha` s per message and
    `bandwidth` B/s: a rank's messages leave one after the other (its one link out), each ends alpha + bytes /
    bandwidth after it leaves; the sender tells the receiver when (an 8-byte header), and both wait until then.
    The waiting is a sleep: it costs no CPU (monotonic clock, the same in every process on this machine)."""

    def __init__(self, alpha, bandwidth):
        self.alpha, self.bandwidth, self.free = alpha, bandwidth, 0.0

    def __enter__(self):
        import torch.distributed as dist

        self.dist, self.real = dist, (dist.isend, dist.irecv)
        dist.isend, dist.irecv = self.isend, self.irecv

    def __exit__(self, *exc):
        self.dist.isend, self.dist.irecv = self.real

    def isend(self, tensor, dst=None, group=None, tag=0):
        nbytes = tensor.numel() * tensor.element_size()
        end = self.free = max(time.perf_counter(), self.free) + self.alpha + nbytes / self.bandwidth
        header = torch.tensor([end], dtype=torch.float64)
        return _Until([self.real[0](header, dst, group, tag), self.real[0](tensor, dst, group, tag)], lambda: end)

    def irecv(self, tensor, src=None, group=None, tag=0):
        header = torch.empty(1, dtype=torch.float64)
        return _Until([self.real[1](header, src, group, tag), self.real[1](tensor, src, group, tag)], header.item)


class _Until:
    def __init__(self, works, end):
        self.works, self.end = works, end

    def wait(self, timeout=None):
        for w in self.works:
            w.wait()
        time.sleep(max(0.0, self.end() - time.perf_counter()))
        return True


def _puzzle_on_rank(link, sizes, repeats):
    """In each child: picotron's ring and tree all-reduce over the slow link; {size: {algorithm: [seconds]}}."""
    import torch.distributed as dist
    from picotron import collectives as C

    assert max(sizes) <= C.PIECE_BYTES  # whole messages, as in the model (no pipelining)
    times = {}
    with _SlowLink(*link):
        for N in sizes:
            t = torch.zeros(N // 4)
            runs = {"ring": lambda: C.all_reduce(t), "tree": lambda: C.naive_all_reduce(t)}
            times[N] = {k: [] for k in runs}
            for i in range(repeats + 1):  # the first is a warm-up
                for k, run in runs.items():
                    dist.barrier()
                    start = time.perf_counter()
                    run()
                    if i:
                        times[N][k].append(time.perf_counter() - start)
    return times


def check_puzzle(path, report, timeout_s):
    module, name = load(path, "ex02"), "ring_or_tree"
    missing = [f for f in ("allreduce_time", name) if not hasattr(module, f)]
    if missing:
        report.fail(name, f"{path.name} has no function {missing[0]}")
        return
    for n, N, a, b in CASES[name]:  # 1. the model
        for algorithm in ("ring", "tree"):
            what = f"allreduce_time({algorithm!r}, n={n}, nbytes={N}, alpha={a:g}, beta={b:g})"
            try:
                got = module.allreduce_time(algorithm, n, N, a, b)
            except Exception as e:  # noqa: BLE001 - any bug in the learner's code is a failed check
                report.fail(name, f"{what}: {type(e).__name__}: {e}{where(e, path)}")
                return
            want = model_time(algorithm, n, N, a, b)
            if not close(got, want):
                shown = f"{got:.6g}" if isinstance(got, (int, float)) else repr(got)
                report.fail(name, f"{what} returned {shown} s, the model gives {want:.6g} s"
                            + diagnose(algorithm, n, N, a, b, got))
                return
        what = f"ring_or_tree(n={n}, nbytes={N}, alpha={a:g}, beta={b:g})"
        try:
            answer = module.ring_or_tree(n, N, a, b)
        except Exception as e:  # noqa: BLE001
            report.fail(name, f"{what}: {type(e).__name__}: {e}{where(e, path)}")
            return
        problem = check_answer(answer, winner_of(model_time("ring", n, N, a, b), model_time("tree", n, N, a, b)), what)
        if problem:
            report.fail(name, problem)
            return
    report.ok(f"{name}: the model", f": allreduce_time and ring_or_tree on {len(CASES[name])} cases (n = 2 .. 1000, "
              f"1 KiB .. 64 MiB, GPU-like and CPU-like links)")
    alpha, bandwidth = PUZZLE_LINK  # 2. a real run
    what = (f"{name} on {PUZZLE_N} ranks, emulated link ({alpha * 1e3:g} ms per message, {bandwidth / 1e6:g} MB/s)")
    try:
        results = run_on_ranks(_puzzle_on_rank, PUZZLE_N, PUZZLE_LINK, PUZZLE_SIZES, PUZZLE_REPEATS,
                               timeout_s=max(timeout_s, 120))
    except (RankTimeout, RankError) as e:
        report.fail(what, f"the measurement did not finish: {str(e).splitlines()[0]}")
        return
    lines = []
    for N in PUZZLE_SIZES:  # a repeat's time is its slowest rank's; noise only adds, so keep the fastest repeat
        measured = {k: min(max(r[N][k][i] for r in results) for i in range(PUZZLE_REPEATS)) for k in ("ring", "tree")}
        predicted = {k: module.allreduce_time(k, PUZZLE_N, N, alpha, 1 / bandwidth) for k in measured}
        for k in measured:
            if not MARGIN[0] <= measured[k] / predicted[k] <= MARGIN[1]:
                report.fail(what, f"{N:,} bytes: the {k} took {1e3 * measured[k]:.1f} ms, you predicted "
                            f"{1e3 * predicted[k]:.1f} ms: outside x{MARGIN[0]}..x{MARGIN[1]} (a busy machine adds "
                            f"time: rerun; if it persists, the model misses something)")
                return
        winner, factor = module.ring_or_tree(PUZZLE_N, N, alpha, 1 / bandwidth)
        right, times = winner_of(measured["ring"], measured["tree"])
        if right != winner:
            report.fail(what, f"{N:,} bytes: you say the {winner} is faster, but the {right} was: ring "
                        f"{1e3 * measured['ring']:.1f} ms, tree {1e3 * measured['tree']:.1f} ms")
            return
        lines.append(f"{N:,} B: the {right} measured {times:.2f}x faster (you said {factor:.2f}x; ring "
                     f"{1e3 * measured['ring']:.0f} ms, tree {1e3 * measured['tree']:.0f} ms)")
    report.ok(what, ": " + "; ".join(lines))


def check_one(name, path, report, timeout_s):
    if name == "ring_or_tree":
        check_puzzle(path, report, timeout_s)
        return
    if not hasattr(load(path, "ex02"), name):
        report.fail(name, f"{path.name} has no function {name}")
        return
    cases = CASES[name]
    for n in WORLD_SIZES:
        what = f"{name} on {n} ranks"
        try:
            results = run_on_ranks(_on_rank, n, str(path), name, cases, timeout_s=timeout_s)
        except RankTimeout as e:
            report.fail(what, hang_message(e, path, timeout_s))
            return  # it would hang again on the next world size
        except RankError as e:
            message = failure_message(e)
            report.fail(what, message)
            if "NotImplementedError" in message or "cannot import" in message:
                return
            continue
        for i, case in enumerate(cases):
            problem = COMPARE[name](case, n, [res[i] for res in results])
            if problem:
                report.fail(f"{what}, {label(case, n)}", problem)
                break
        else:
            counts = [len(res[-1]["sends"]) for res in results]
            pattern = (f"every rank sent {n - 1} message(s), each to its right neighbour" if name.startswith("ring") else
                       f"{sum(counts)} message(s), at most {max(counts)} from one rank")
            report.ok(what, f": {'; '.join(label(c, n) for c in cases)}; {pattern}")


check, main = entry_points("Check lesson 02's exercises on 2, 3 and 4 processes (the puzzle: model, then a real run).", CASES, check_one,
                           LEARNER, SOLUTIONS, TIMEOUT_S, "ex02")


if __name__ == "__main__":
    sys.exit(main())
