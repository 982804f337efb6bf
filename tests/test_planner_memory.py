"""The planner's memory model against real runs: a few layouts of benchmarks/planner_memory.py (which measures 30)
train one step on gloo processes; every rank's accounted bytes must be within 10% of the planner's prediction
for its pipeline stage in total, and the model states (exact in the planner) within 0.1%. ZeRO-2 with a pipeline: the
whole gradients it holds during the step (the trainer's `zero_transient_peak`) against the planner's gradients."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the ranks import it by name too
import planner_memory as bench  # noqa: E402


@pytest.mark.parametrize("layout", [
    {"dp": 2, "zero": 2},
    {"tp": 2, "sp": True},
    {"pp": 2, "grad_acc": 4, "pp_schedule": "afab"},
    {"pp": 2, "cp": 2, "tp": 2, "grad_acc": 2},
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_predicted_memory_matches_what_every_rank_accounts(tmp_path, layout):
    ranks, predicted = bench.measure(layout, str(tmp_path))
    for stage, measured in ranks:
        want = predicted[stage]
        assert sum(measured.values()) == pytest.approx(want["total"], rel=0.10), (stage, measured, want)
        for part in ("params", "grads", "optimizer"):
            assert measured[part] == pytest.approx(want[part], rel=1e-3), (stage, part, measured, want)


def test_zero2_with_a_pipeline_holds_the_stage_s_whole_gradients_as_predicted(tmp_path):
    """ZeRO-2 under a pipeline (zero.py, accumulate=True) sums a chunk's gradients over its micro-batches in the whole
    buffers and reduce-scatters them once, at its last backward: during the step it holds 4Ψ_stage bytes of
    gradients, the planner's `grads` for this layout (ZeRO-1's); between steps only the shard, 1/dp of it. Each rank's
    `mem` record holds both: its gradient shards at the step's end and the peak of the whole gradients."""
    from picotron import planner
    from picotron.config import Config
    from picotron.launch import run_on_ranks
    layout = {"dp": 2, "pp": 2, "zero": 2, "grad_acc": 4}
    cfg = Config(**{**bench.SETTINGS, **layout})
    predicted = planner.memory_per_stage(cfg.model_config(), planner.Layout.from_config(cfg), cfg.seq_len, cfg.dtype)
    ranks = run_on_ranks(bench.last_mem, cfg.world_size, layout, str(tmp_path), timeout_s=600)
    for stage, mem in ranks:
        want = predicted[stage]
        assert want["grads"] == want["params"]  # fp32: 4 bytes a parameter each, the whole stage
        assert mem["zero_transient_peak"] == pytest.approx(want["grads"], rel=1e-3), (stage, mem, want)  # padding
        assert mem["grads"] == pytest.approx(want["grads"] / cfg.dp, rel=1e-3), (stage, mem, want)
