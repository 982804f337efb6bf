"""Lesson 04: the exercise checker (the solutions pass; the stubs fail naming NotImplementedError; wrong answers are
reported with their rank, chunk and likely cause, ZeRO-3's last layer freed or every layer kept, an fp32 all-gather,
a rounded master copy, a plan that does not fit or is not the fastest; a hang with the waiting rank and its line), the
widget's memory model, the flat layout at dp = 3, and the notebook end to end in FAST mode.

No timing is asserted: on a shared CPU timings are measurements, not pass/fail criteria.
"""
import sys
from pathlib import Path

import pytest
from _lessons import checker

from picotron import planner

ROOT = Path(__file__).resolve().parents[1]
CHECKER = ROOT / "lessons" / "04_zero" / "check.py"
SOLUTIONS = ROOT / "lessons" / "04_zero" / "solution.py"
sys.path.insert(0, str(ROOT / "lessons"))


run_checker = checker('04_zero', timeout=240)


def test_checker_passes_the_solutions():
    code, out = run_checker("--solutions", timeout=900, as_learner=True)
    assert code == 0, out
    assert "all checks passed" in out and "FAIL" not in out
    assert out.count("  ok  ") == 13, out  # shard_range, the puzzle, pp_traffic, hsdp_groups, owner_of once, the others on
    # 2 and 3 ranks
    assert "12.52 -> 11.01 MiB all-gathered per step" in out, out  # the last layer: one gather less per micro-batch
    assert "12.52 -> 6.26 MiB all-gathered per step" in out, out  # bf16: half
    assert "64 MiB: ZeRO-1 micro-batch 2, 59.6 MiB measured" in out, out  # the ranks measured what the formulas say


def test_checker_fails_the_stubs_naming_not_implemented():
    code, out = run_checker()
    assert code == 1, out
    for what in ("shard_range on many sizes", "reduce_scatter_gradients on 2 ranks", "ShardedAdamW.step on 2 ranks",
                 "KeepLastLayer._post_forward on 2 ranks", "Bf16Gather._gather/_wait on 2 ranks"):
        assert f"FAIL  {what}: rank " in out, out
    assert "FAIL  plan (the puzzle): NotImplementedError: not written yet" in out, out
    assert "FAIL  pp_zero_traffic: NotImplementedError: not written yet" in out, out
    assert "FAIL  hsdp_groups: NotImplementedError: not written yet" in out, out
    assert "FAIL  owner_of: NotImplementedError: not written yet" in out, out
    assert out.count("NotImplementedError: not written yet") == 9, out
    assert "on 3 ranks" not in out  # it stops at the first world size


def mutate(tmp_path, *bugs):
    """The solutions with the given (old, new) replacements."""
    text = SOLUTIONS.read_text()
    for old, new in bugs:
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "wrong.py"
    path.write_text(text)
    return path


def test_checker_explains_wrong_chunks_and_a_missing_mean(tmp_path):
    path = mutate(tmp_path,
                  ("chunk = max(1, math.ceil(numel / n))", "chunk = max(1, numel // n)"),  # rounds down: misses elements
                  ("    flat.div_(n)  # the sum", "    pass  # flat.div_(n)  # the sum"))  # a sum, not a mean
    code, out = run_checker("--module", str(path), "shard_range", "reduce_scatter_gradients")
    assert code == 1, out
    assert "FAIL  shard_range on many sizes: shard_range(10, 4, 0) returned (0, 2), expected (0, 3)" in out, out
    assert "Round UP, chunk = ceil(numel / n) = 3" in out, out
    assert "FAIL  reduce_scatter_gradients on 2 ranks: unit 0 (3 tensors, 29 elements, n=2: chunk 15, padded 30), " \
           "rank 0:" in out, out
    assert "the SUM over the 2 ranks, not the mean: divide by n = 2 (once)" in out, out
    assert "the SUM over the 3 ranks" in out, out  # and again on 3 ranks


def test_checker_names_a_missing_all_gather_and_a_hang(tmp_path):
    no_gather = mutate(tmp_path, ("        dist.all_gather_into_tensor(self.flat, p.clone(), group=self.group)",
                                  "        pass"))
    code, out = run_checker("--module", str(no_gather), "sharded_adamw")
    assert code == 1, out
    assert "FAIL  ShardedAdamW.step on 2 ranks: a unit of 29 elements (n=2: chunk 15, padded 30), rank 0, after step 1: " \
           "chunk 1 (elements 15..29) is wrong" in out, out
    assert "it still holds its values from before this step. Chunk 1 is rank 1's to update" in out, out

    hang = mutate(tmp_path, ("        dist.all_gather_into_tensor(self.flat, p.clone(), group=self.group)",
                             "        if self.rank == 0:\n"
                             "            dist.all_gather_into_tensor(self.flat, p.clone(), group=self.group)"))
    code, out = run_checker("--module", str(hang), "sharded_adamw", "--timeout", "5")
    assert code == 1, out
    assert "FAIL  ShardedAdamW.step on 2 ranks: hang: rank 0 still waiting after 5 s" in out, out
    assert "rank 1 finished and waited for it" in out, out
    assert "rank 0 waits in step, line " in out and "dist.all_gather_into_tensor(self.flat" in out, out
    assert "on 3 ranks" not in out  # a hang is not retried on the next world size


def test_checker_recognises_adam_without_bias_correction(tmp_path):
    path = mutate(tmp_path, ("        bias1, bias2 = 1 - self.beta1 ** self.t, 1 - self.beta2 ** self.t",
                             "        bias1, bias2 = 1.0, 1.0"))
    code, out = run_checker("--module", str(path), "sharded_adamw")
    assert code == 1, out
    assert "after step 1: chunk 0 (elements 0..14) is wrong" in out, out
    assert "matches Adam WITHOUT bias correction" in out, out


KEEP = "        if k < len(self.units) - 1 or not backward_follows:  # keep the last layer only if a backward comes"


@pytest.mark.parametrize("line, message", [
    ("        if True:", "layer 3 is still gathered twice: once for its forward, again right at the start of the "
                       "backward"),
    ("        if not backward_follows:", "every layer stays gathered from its forward to its backward"),
    ("        if k < len(self.units) - 1:", "after a forward under torch.no_grad() (evaluation) layer 3 stayed gathered"),
])
def test_checker_names_what_keep_last_layer_got_wrong(tmp_path, line, message):
    code, out = run_checker("--module", str(mutate(tmp_path, (KEEP, line))), "keep_last_layer")
    assert code == 1, out
    assert "FAIL  KeepLastLayer._post_forward on 2 ranks: rank 0: " in out and message in out, out


@pytest.mark.parametrize("bugs, message", [
    ([("unit.send = unit.shard.to(torch.bfloat16)", "unit.send = unit.shard"),
      ("dtype=torch.bfloat16, device=unit.shard.device", "dtype=torch.float32, device=unit.shard.device")],
     "as many as plain ZeRO-3: the all-gathers still carry fp32"),
    ([("            unit.full.copy_(unit.received)", "            pass")], "unit.full does not hold the gathered"),
    ([("            unit.send = unit.shard.to(torch.bfloat16)",
       "            unit.shard.copy_(unit.shard.to(torch.bfloat16))\n            unit.send = unit.shard.to(torch.bfloat16)")],
     "hold only bf16 values after 2 steps: the shard itself was rounded"),
])
def test_checker_names_what_bf16_gather_got_wrong(tmp_path, bugs, message):
    code, out = run_checker("--module", str(mutate(tmp_path, *bugs)), "bf16_gather")
    assert code == 1, out
    assert "FAIL  Bf16Gather._gather/_wait on 2 ranks: rank 0: " in out and message in out, out


def test_puzzle_messages_say_what_is_wrong():
    import importlib.util
    spec = importlib.util.spec_from_file_location("check04", CHECKER)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    f = check.puzzle_facts()
    assert f["in_flight"] == {0: 0, 1: 0, 2: 8_919_040, 3: 10_493_952}  # as exercise.py states them
    assert check.plan_problem(f, 64, dict(zero=1, micro_batch_size=2)) is None
    assert check.plan_problem(f, 100, dict(zero=0, micro_batch_size=4)) is None  # DP and ZeRO-1 tie there
    assert check.plan_problem(f, 100, dict(zero=1, micro_batch_size=4)) is None
    assert "does not fit" in check.plan_problem(f, 100, dict(zero=3, micro_batch_size=8))
    assert "ZeRO-3 all-gathers twice and reduce-scatters once per micro-batch" in \
        check.plan_problem(f, 64, dict(zero=3, micro_batch_size=2))
    assert "ZeRO-2 reduce-scatters after every micro-batch" in check.plan_problem(f, 64, dict(zero=2, micro_batch_size=1))
    assert "moves the fewest bytes, but in 8 micro-batches" in check.plan_problem(f, 64, dict(zero=0, micro_batch_size=1))
    assert "return dict(zero=0|1|2|3, micro_batch_size=b)" in check.plan_problem(f, 64, dict(zero=1, micro_batch_size=3))
    assert check.plan_problem(f, 47, dict(zero=3, micro_batch_size=1)) is None  # only ZeRO-3 fits


# ------------------------------------------------------------------------------------- the widget's model
@pytest.fixture(scope="module")
def lesson():
    import _common

    return _common.load_lesson("04_zero")


def test_memory_model_is_the_zero_paper_table(lesson):
    psi, n = 7.5e9, 64  # the ZeRO paper's figure 1: 7.5 B parameters, 64 GPUs, K = 12
    per = lesson.memory_per_gpu(psi, n, recipe="mixed")
    assert [per[s]["total"] / 1e9 for s in range(4)] == pytest.approx([120, 31.4, 16.6, 1.875], rel=3e-3)
    ours = lesson.memory_per_gpu(psi, n, recipe="ours")
    assert ours[0]["total"] == 16 * psi and ours[3]["total"] == pytest.approx(16 * psi / n)
    assert ours[2] == dict(planner.zero_model_state_bytes(psi, 2, n), total=4 * psi + 12 * psi / n)


def test_smallest_dp_that_fits(lesson):
    psi, cap = 8e9, 80e9  # Llama-3-8B-like, mixed precision: 128 GB of model states
    assert lesson.smallest_dp_that_fits(psi, 0, cap, "mixed") is None  # plain DP never fits
    assert lesson.smallest_dp_that_fits(psi, 3, cap, "mixed") == 2  # 64 GB each
    assert lesson.smallest_dp_that_fits(psi, 1, cap, "mixed") == 2  # 32 + 96/2 = 80 GB: just fits
    assert lesson.smallest_dp_that_fits(psi, 1, 79e9, "mixed") == 4  # 32 + 96/4 = 56 GB
    assert lesson.smallest_dp_that_fits(psi, 1, 30e9, "mixed") is None  # 32 GB of params + grads: never


def test_flat_layout_at_dp3_has_padding(lesson):
    layout = lesson.flat_layout(3)
    assert [u["name"] for u in layout] == ["root", "layer 0", "layer 1", "layer 2", "layer 3"]
    assert [u["padded"] - u["numel"] for u in layout] == [0, 1, 1, 1, 1]  # 786,944 = 3 x 262,315 - 1
    assert all(u["padded"] == 3 * u["chunk"] for u in layout)


def test_prefetch_gain_pairs_the_rounds(lesson):
    on = dict(step_times=[1.0, 2.0, 1.5], overlap=dict(exposed_gather_s=0.1))
    off = dict(step_times=[1.5, 2.2, 2.5], overlap=dict(exposed_gather_s=0.6))
    g = lesson.prefetch_gain([on, off])
    assert g["moved"] == pytest.approx(0.5) and g["n"] == 3
    assert g["gain"] == pytest.approx(0.5) and g["paired"] == pytest.approx(0.5)  # fastest 1.5 vs 1.0; gains .5 .2 1


def test_overlap_stats_counts_hidden_gather_time(lesson):
    events = [dict(name="all-gather layer 1", start=0.0, end=2.0),
              dict(name="forward layer 0", start=1.0, end=3.0, kind="compute"),
              dict(name="all-gather layer 2", start=4.0, end=5.0)]
    row = dict(events=[events], step_starts=[[0.0]])
    o = lesson.overlap_stats(row)
    assert o["n_gathers"] == 2 and o["gather_s"] == pytest.approx(3.0) and o["hidden_s"] == pytest.approx(1.0)
    assert o["hidden_fraction"] == pytest.approx(1 / 3) and o["exposed_gather_s"] == pytest.approx(2.0)


# ------------------------------------------------------------------------------------- the notebook
def test_notebook_runs_in_fast_mode(run_notebook):
    text = run_notebook("04_zero", timeout=600)
    assert "✗" not in text, text
    assert text.count("✓") >= 20, text
    assert "NotImplementedError: not written yet" in text  # the exercise cell ran the checker on the stubs


def test_checker_explains_zero_with_a_pipeline(tmp_path):
    """Exercise 7: a reduce-scatter per micro-batch (ZeRO-2's habit without a pipeline) and the roots resharded
    like the layers are each named."""
    per_micro_batch = mutate(tmp_path, ('return {"all_gather": gathered, "reduce_scatter": total}',
                                        'return {"all_gather": gathered, "reduce_scatter": m * total}'))
    code, out = run_checker("--module", str(per_micro_batch), "pp_traffic")
    assert code == 1, out
    assert "FAIL  pp_zero_traffic: pp_zero_traffic(1, root=1000, layers=6000, m=4, reshard=False) returned" in out, out
    assert "a reduce-scatter per micro-batch; under the pipeline's no_sync" in out, out
    roots_too = mutate(tmp_path, ("gathered = root + 2 * m * layers if", "gathered = 2 * m * total if"))
    code, out = run_checker("--module", str(roots_too), "pp_traffic")
    assert code == 1, out
    assert "the roots are gathered once per step" in out, out


def test_checker_explains_hsdp_groups(tmp_path):
    """Exercise 8: strided shard groups (ZeRO's blocks confused with its replicas) and shard groups without their cp
    ranks are each named."""
    strided = mutate(tmp_path, ("for d in range(b * dp_shard, (b + 1) * dp_shard)",
                                "for d in range(b, dp, dp // dp_shard)"))
    code, out = run_checker("--module", str(strided), "hsdp_groups")
    assert code == 1, out
    assert "FAIL  hsdp_groups: hsdp_groups(dp=4, dp_shard=2, cp=1) returned" in out, out
    assert "your shard groups are strided" in out, out
    no_cp = mutate(tmp_path, ("for d in range(b * dp_shard, (b + 1) * dp_shard) for c in range(cp)]",
                              "for d in range(b * dp_shard, (b + 1) * dp_shard) for c in range(1)]"))
    code, out = run_checker("--module", str(no_cp), "hsdp_groups")
    assert code == 1, out
    assert "a shard group holds every cp rank" in out, out


def test_checker_explains_owner_of(tmp_path):
    """Exercise 9: owners dealt out in turn (round-robin by position) and every matrix on one rank are each named."""
    turns = mutate(tmp_path, ("for k in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):\n"
                              "        r = min(range(n), key=lambda r: (load[r], r))",
                              "for k in range(len(sizes)):\n        r = k % n"))
    code, out = run_checker("--module", str(turns), "owner_of")
    assert code == 1, out
    assert "FAIL  owner_of: owner_of([1, 5, 3, 3], 2) returned [0, 1, 0, 1]" in out, out
    assert "round-robin by position" in out, out
    one = mutate(tmp_path, ("        r = min(range(n), key=lambda r: (load[r], r))", "        r = 0"))
    code, out = run_checker("--module", str(one), "owner_of")
    assert code == 1, out
    assert "every matrix went to rank 0" in out, out
