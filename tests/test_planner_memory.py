"""The planner's memory model against real runs: a few layouts of benchmarks/planner_memory.py (which measures 30)
train one step on gloo processes; every rank's accounted bytes must be within 10% of the planner's prediction
for its pipeline stage in total, and the model states (exact in the planner) within 0.1%."""
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
