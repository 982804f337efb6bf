"""Lesson 02: the alpha-beta model and trace helpers, the simple ring all-reduce, the exercise checker (solutions
pass; stubs, wrong values, wrong shapes, a non-tree broadcast, a hang and wrong puzzle answers are each reported
with the reason), and the notebook end to end in FAST mode (it launches the benchmark with torchrun on 4 processes).

Timings are never asserted: the benchmark's numbers are shown in the notebook, not tested.
"""
import math
import sys
from pathlib import Path

import pytest
from _lessons import checker

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lessons"))

import _common  # noqa: E402

lesson = _common.load_lesson("02_collectives")


# --------------------------------------------------------------------------------- the model (no processes)
def test_fit_recovers_alpha_beta():
    sizes = [2**k for k in range(10, 27)]
    alpha, beta = 50e-6, 1 / 2e9
    fit = lesson.fit_alpha_beta(sizes, [alpha + beta * n for n in sizes])
    assert fit["alpha_us"] == pytest.approx(50.0, rel=1e-6)
    assert fit["inv_beta_GBps"] == pytest.approx(2.0, rel=1e-6)
    assert fit["max_rel_err"] < 1e-9
    flat = lesson.fit_alpha_beta(sizes, [alpha] * len(sizes))  # latency-bound everywhere: beta stays positive
    assert flat["beta"] > 0 and flat["alpha"] == pytest.approx(alpha, rel=1e-3)


@pytest.mark.parametrize("n", [4, 8, 64, 512])
def test_crossover_is_where_tree_and_ring_cost_the_same(n):
    a, b = 20e-6, 1 / 50e9
    x = lesson.crossover_bytes(n, a, b)
    assert lesson.tree_allreduce_time(n, x, a, b) == pytest.approx(lesson.ring_allreduce_time(n, x, a, b), rel=1e-9)
    assert lesson.tree_allreduce_time(n, x / 2, a, b) < lesson.ring_allreduce_time(n, x / 2, a, b)
    assert lesson.tree_allreduce_time(n, 2 * x, a, b) > lesson.ring_allreduce_time(n, 2 * x, a, b)
    assert lesson.crossover_bytes(3, a, b) is None  # 2 ring steps each way = 2 tree rounds each way: no latency gain
    link = lesson.per_link(dict(alpha=2 * (n - 1) * a, beta=2 * (n - 1) / n * b), n)
    assert link["alpha_step"] == pytest.approx(a) and link["beta_link"] == pytest.approx(b)


@pytest.mark.parametrize("n", range(1, 10))
def test_expected_bytes_of_the_tree(n):
    N = 1000 * n
    bcast = lesson.expected_sent("broadcast", n, N)
    assert sum(bcast) == (n - 1) * N  # every rank but the root receives the whole tensor once
    assert max(bcast) == math.ceil(math.log2(n)) * N if n > 1 else bcast == [0]
    assert lesson.expected_sent("all_reduce", n, N) == [2 * (n - 1) * N // n] * n


def _simple_ring_on_rank(length):
    import torch
    import torch.distributed as dist

    ring = _common.load_lesson("02_collectives").simple_ring_all_reduce
    x = torch.randint(-1000, 1000, (length,), generator=torch.Generator().manual_seed(dist.get_rank()))
    ours, ref = x.clone(), x.clone()
    ring(ours)
    dist.all_reduce(ref)
    return torch.equal(ours, ref)


@pytest.mark.parametrize("n", [2, 3])
def test_simple_ring_equals_the_builtin(n):
    from picotron.launch import run_on_ranks

    assert run_on_ranks(_simple_ring_on_rank, n, 1001, timeout_s=60) == [True] * n


def test_encoding_decodes_sums():
    for sources in ([0], [1, 3], [0, 1, 2, 3], [2, 5, 7]):
        for chunk in range(8):
            assert lesson.decode(sum(lesson.encode(r, chunk) for r in sources)) == (sources, chunk)


# ------------------------------------------------------------------------------------------- the checker
run_checker = checker('02_collectives', timeout=120)


def test_checker_passes_the_solutions():
    code, out = run_checker("--solutions", as_learner=True)
    assert code == 0, out
    assert "all checks passed" in out and "FAIL" not in out
    for name in ("ring_all_gather", "ring_reduce_scatter", "tree_broadcast"):
        for n in (2, 3, 4):
            assert f"ok    {name} on {n} ranks" in out, out
    assert "ok    ring_or_tree: the model" in out, out
    assert "ok    ring_or_tree on 4 ranks, emulated link (20 ms per message, 20 MB/s): 1,024 B: the tree measured" in out, out


def test_checker_fails_the_stubs_naming_not_implemented():
    code, out = run_checker()
    assert code == 1, out
    for name in ("ring_all_gather", "ring_reduce_scatter", "tree_broadcast"):
        assert f"FAIL  {name} on 2 ranks: rank " in out, out
    assert "FAIL  ring_or_tree: allreduce_time('ring', n=4, " in out, out
    assert out.count("NotImplementedError: not written yet") == 4, out


WRONG = '''
import torch
import torch.distributed as dist

def _swap(a, dst, b, src):
    for r in [dist.isend(a, dst), dist.irecv(b, src)]:
        r.wait()

def ring_all_gather(tensor):  # forgets its own piece: the output is one piece short
    rank, n = dist.get_rank(), dist.get_world_size()
    pieces = [torch.empty_like(tensor) for _ in range(n)]
    pieces[rank].copy_(tensor)
    for step in range(n - 1):
        _swap(pieces[(rank - step) % n], (rank + 1) % n, pieces[(rank - step - 1) % n], (rank - 1) % n)
    return torch.cat(pieces[:rank] + pieces[rank + 1:])

def ring_reduce_scatter(tensor):  # copies what it receives instead of adding it
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = [c.clone() for c in torch.tensor_split(tensor, n)]
    for step in range(n - 1):
        s, r = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = torch.empty_like(chunks[r])
        _swap(chunks[s], (rank + 1) % n, incoming, (rank - 1) % n)
        chunks[r] = incoming
    return chunks[rank]

def tree_broadcast(tensor, src):  # right values, but the source sends to everybody itself
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == src:
        for dst in range(n):
            if dst != src:
                dist.send(tensor, dst)
    else:
        dist.recv(tensor, src)

def allreduce_time(algorithm, n, nbytes, alpha, beta):  # the ring: only its reduce-scatter half
    if algorithm == "ring":
        return (n - 1) * alpha + (n - 1) / n * nbytes * beta
    return 2 * (n - 1).bit_length() * (alpha + nbytes * beta)

def ring_or_tree(n, nbytes, alpha, beta):
    return "ring", 1.0
'''

PUZZLE = '''
import math

def allreduce_time(algorithm, n, nbytes, alpha, beta):  # right, but ring_or_tree returns the inverse factor
    if algorithm == "ring":
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta
    return 2 * math.log2(n) * (alpha + nbytes * beta) if n == 1000 else 2 * math.ceil(math.log2(n)) * (alpha + nbytes * beta)

def ring_or_tree(n, nbytes, alpha, beta):
    ring, tree = allreduce_time("ring", n, nbytes, alpha, beta), allreduce_time("tree", n, nbytes, alpha, beta)
    return ("ring", ring / tree) if ring < tree else ("tree", tree / ring)
'''

HANG = '''
import torch
import torch.distributed as dist

def ring_all_gather(tensor):  # every rank waits to receive before anybody sends
    rank, n = dist.get_rank(), dist.get_world_size()
    incoming = torch.empty_like(tensor)
    dist.recv(incoming, (rank - 1) % n)
    dist.send(tensor, (rank + 1) % n)
    return torch.cat([tensor, incoming])
'''


def test_checker_reports_wrong_values_shapes_and_pattern(tmp_path):
    wrong = tmp_path / "wrong.py"
    wrong.write_text(WRONG)
    code, out = run_checker("--module", str(wrong))
    assert code == 1, out
    assert "FAIL  ring_all_gather on 2 ranks, length 5 int64: rank 0 output has shape [5], expected [10]" in out, out
    # n=2, length 12: rank 0 gets rank 1's chunk 0 (200, 201, ...) instead of the sum (300, 302, ...)
    assert ("FAIL  ring_reduce_scatter on 2 ranks, length 12 int64: rank 0: element 0 is 200, expected 300 (5 more "
            "elements differ) — rank 0's contribution is missing") in out, out
    assert "ok    tree_broadcast on 2 ranks" in out  # one receiver: a star is a tree
    assert ("FAIL  tree_broadcast on 4 ranks, length 5 int64, src 0: right values, but rank 0 sent 3 messages; in a "
            "binomial tree no rank sends more than ceil(log2 4) = 2") in out, out
    assert ("FAIL  ring_or_tree: allreduce_time('ring', n=4, nbytes=1024, alpha=5e-06, beta=2e-11) returned 1.50154e-05 s, "
            "the model gives 3.00307e-05 s — that is a reduce-scatter (or an all-gather) alone") in out, out


def test_checker_names_the_puzzle_mistakes(tmp_path):
    puzzle = tmp_path / "puzzle.py"
    puzzle.write_text(PUZZLE)
    code, out = run_checker("--module", str(puzzle), "ring_or_tree")
    assert code == 1, out
    assert ("FAIL  ring_or_tree: ring_or_tree(n=4, nbytes=1024, alpha=5e-06, beta=2e-11): factor 0.6687, expected 1.495: "
            "return T_slower / T_faster (>= 1), not its inverse") in out, out
    assert "emulated link" not in out, out  # a wrong answer stops before the real run
    puzzle.write_text(PUZZLE.replace("ring / tree) if ring < tree else (\"tree\", tree / ring)",
                                     "tree / ring) if ring < tree else (\"tree\", ring / tree)"))
    code, out = run_checker("--module", str(puzzle), "ring_or_tree")
    assert code == 1, out
    assert ("allreduce_time('tree', n=1000, nbytes=1024, alpha=5e-06, beta=2e-11) returned 0.000100066 s, the model gives "
            "0.00010041 s — rounds are whole: ceil(log2 n) (n = 1000 needs 10 rounds, not 9.97)") in out, out


def test_checker_reports_a_hang_within_its_timeout(tmp_path):
    hang = tmp_path / "hang.py"
    hang.write_text(HANG)
    # timeout=300: a hang guard for the checker itself; its own 4 s timeout is what ends the exercise
    code, out = run_checker("--module", str(hang), "ring_all_gather", "--timeout", "4", timeout=300)
    assert code == 1, out
    assert "FAIL  ring_all_gather on 2 ranks: hang: ranks 0, 1 are still waiting after 4 s" in out, out
    assert "rank 0 waits in ring_all_gather, line 8: dist.recv(incoming, (rank - 1) % n)" in out, out
    assert "on 3 ranks" not in out  # a hang ends the exercise: it would hang again


# ------------------------------------------------------------------------------------------ the notebook
def test_notebook_runs_in_fast_mode(run_notebook):
    text = run_notebook("02_collectives")
    assert "✗" not in text, text
    assert text.count("✓") >= 8, text
    assert "NotImplementedError: not written yet" in text  # the learner's stubs, checked at the end
