"""Lessons 06-11's "On an 8-GPU node you should see" rows (lessons/_node.py) against their homes (default tier,
pure: no processes). tests/test_lesson_node.py checks every lesson's section, table and 8-rank Configs; here a row of
each later lesson is held to the function it must come from, and lesson 10's writer count to the checkpoint's rule.
"""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lessons"))
import _common  # noqa: E402
import _node  # noqa: E402

from picotron import expert_parallel, pipeline_schedules, planner  # noqa: E402
from picotron.planner import Layout  # noqa: E402


def row(rows, start):
    return next(r for r in rows if r.what.startswith(start))


def test_lesson_06_bytes_are_the_planners():
    st = _common.load_lesson("06_context_parallel").settings(False, "cuda")
    mc = _node.model(st["size"])
    sent = planner.cp_bytes_per_step(8, st["train_b"], st["train_seq"], mc.num_key_value_heads, mc.head_dim,
                                     mc.num_hidden_layers)
    assert row(_node.lesson_06(), "K/V bytes a rank sends").predicted == f"{sent / _node.MiB:.1f} MiB"


def test_lesson_07_bubbles_are_the_schedules_formulas():
    """Without dp the step's idle share is the schedule's bubble: (p-1)/(m+p-1) for 1F1B at p = 8, m = 16."""
    rows = _node.lesson_07()
    for name in ("1f1b", "interleaved", "zb-h1"):
        label = "interleaved v=2" if name == "interleaved" else name
        want = pipeline_schedules.bubble_formula(name, 8, 16, 2 if name == "interleaved" else 1)
        assert row(rows, f"{label}, pp=8, m=16").predicted.startswith(_node.share(want, 1) + ";"), name


def test_lesson_08_bytes_are_expert_parallels_formula():
    st = _common.load_lesson("08_expert_parallel").settings(False, "cuda")
    mc = _node.model(st["preset"], experts=8)
    want = expert_parallel.bytes_per_step_formula(st["micro_batch_size"] * st["seq_len"], mc.num_experts_per_tok,
                                                  mc.hidden_size, 8, mc.num_hidden_layers)
    assert row(_node.lesson_08(), "all-to-all bytes").predicted == f"{want / _node.MiB:.1f} MiB"


@pytest.mark.parametrize("layout, share", [(dict(dp=8), 1), (dict(dp=8, zero=1), 1 / 8), (dict(dp=8, zero=3), 1 / 8)])
def test_lesson_10_writers_follow_the_checkpoints_rule(layout, share):
    """Every value written once: plain dp's rank 0 writes the whole model, ZeRO's ranks 1/8 each (lesson 10 §5 checks
    the same on CPU: 12 bytes a parameter over the ranks)."""
    mc = _node.model("medium")
    owned = _node.owned_params(mc, Layout(**layout, micro_batch_size=4), 64)
    assert owned == pytest.approx(share * mc.num_params())


def test_lesson_11_has_no_eight_rank_mode_and_says_why():
    assert 8 not in _common.LESSONS["11_precision_and_kernels"].get("choose", {})
    source = (ROOT / "lessons" / "11_precision_and_kernels" / "11_precision_and_kernels.py").read_text()
    assert "This lesson has no 8-rank mode" in source
