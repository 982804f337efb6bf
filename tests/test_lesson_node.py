"""Every lesson's "On an 8-GPU node you should see" (lessons/_node.py): its section, its predictions and its 8-rank mode.

Default tier (no processes, no notebooks): every lesson's source has the section, before its exercises, calling
`_node.show` on itself; `show` prints, under a header saying they are predictions, at least one row whose value is a
number, and the command that measures them; the predictions are computed, not typed (another GPU gives other
numbers, and the rows agree with the planner's functions called here); every Config a lesson trains at
PICOTRON_NPROC=8 (its experiment's configs_at(8)) passes picotron.rules.validate at world size 8, the rules the
trainer applies before any process group exists. Heavy tier: lesson 03's main experiment at PICOTRON_NPROC=8 on
CPU (8 gloo processes, FAST), its dp = 8 run within the parity standard of one process with grad_acc = 8.
"""
import dataclasses
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lessons"))
import _common  # noqa: E402
import _node  # noqa: E402

from picotron import rules  # noqa: E402
from picotron.plan import link, ring_time, step_time  # noqa: E402
from picotron.plan.hardware import at_dtype  # noqa: E402
from picotron.planner import Layout  # noqa: E402

FOLDERS = sorted(p.name for p in (ROOT / "lessons").glob("[0-9][0-9]_*") if p.is_dir())
HEADINGS = ("On an 8-GPU node you should see", "On an H100 you should see")  # lesson 00 runs on one GPU
SHOWN = [name for name in FOLDERS if not name.startswith("00")]  # lesson 00 (one GPU, helper prose) shows no table
EIGHT = [name for name in FOLDERS if 8 in _common.LESSONS.get(name, {}).get("choose", {})]
TRAINS_NO_MODEL = {"02_collectives": "it times collectives on buffers, not training runs"}


@pytest.mark.parametrize("name", FOLDERS)
def test_every_lesson_has_the_section_before_its_exercises(name):
    source = (ROOT / "lessons" / name / f"{name}.py").read_text(encoding="utf-8")
    headings = re.findall(r"^# ##+ (?:\d+\. )?(.+)$", source, re.M)
    node = [i for i, h in enumerate(headings) if h.strip() in HEADINGS]
    assert node, f"{name}: no markdown heading '{HEADINGS[0]}'"
    exercises = [i for i, h in enumerate(headings) if h.strip().startswith("Exercises")]
    if name in SHOWN:  # (lesson 00, the GPU primer, is laid out by its own brief)
        assert not exercises or node[0] < exercises[0], f"{name}: the section comes after the exercises"
        assert f'_node.show("{name}")' in source, f"{name}: the section does not call _node.show({name!r})"


@pytest.mark.parametrize("name", SHOWN)
def test_show_prints_predictions_with_a_number_and_the_command(name, capsys):
    _node.show(name)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Predictions (picotron's planner, one 8×H100 SXM node; not measured here):"
    assert lines[-1] == f"Measure them on a pod: {_node.COMMANDS[name]}"
    rows = _node.PREDICTORS[name]()
    assert rows and all(isinstance(r, _node.Row) and r.what and r.how for r in rows)
    assert any(_node.is_number(r.predicted) for r in rows), (name, rows)
    assert len(lines) == len(rows) + 2
    eight = 8 in _common.LESSONS[name].get("choose", {})
    assert _node.COMMANDS[name].startswith("PICOTRON_NPROC=8 ") == eight, _node.COMMANDS[name]


def test_is_number():
    assert _node.is_number("1.11 ms") and _node.is_number("3,911,547 (MFU 60%)") and _node.is_number("0.285 GiB / 1 GiB")
    assert not _node.is_number("not modelled") and not _node.is_number("")


# the lessons with a row from the time model or the rings (lesson 10's bytes and assumed disk do not depend on the GPU)
TIMED = [name for name, rows in _node.PREDICTORS.items() if any(m in r.how for r in rows() for m in ("step_time", "ring_time"))]


@pytest.mark.parametrize("name", TIMED)
def test_the_predictions_are_computed_not_typed(name, monkeypatch):
    """Another node (A100s: other peak, other NVLink) changes some predicted number of every lesson that times."""
    h100 = [r.predicted for r in _node.PREDICTORS[name]()]
    monkeypatch.setattr(_node, "NODE", "a100-80gb")
    a100 = [r.predicted for r in _node.PREDICTORS[name]()]
    assert h100 != a100, (name, h100)


def test_the_rows_agree_with_the_planner():
    """Lessons 02, 03 and 05: a row against the planner's function called here."""
    hw = at_dtype("h100-80gb", "bf16")
    big = max(_common.GPU_SETTINGS["02_collectives"]["sizes"])
    row = next(r for r in _node.lesson_02() if r.what.startswith("all-reduce, 256 MiB"))
    assert row.predicted == _node.ms(ring_time("all_reduce", 8, big, *link(hw, 8)))
    fp32 = at_dtype("h100-80gb", "fp32")
    assert fp32.peak < hw.peak  # the lessons' fp32 runs: CUDA cores, not tensor cores
    g = _common.GPU_SETTINGS["03_data_parallel"]
    mc = _node.model(g["scaling_size"])
    t = step_time(mc, Layout(dp=8, micro_batch_size=g["scaling_micro_batch_size"]), g["scaling_seq_len"], fp32, "fp32")
    assert next(r for r in _node.lesson_03() if "dp=8" in r.what).predicted.startswith(_node.ms(t["total"]))
    tp8 = next(r for r in _node.lesson_05() if "tp=8" in r.what)
    assert tp8.predicted.startswith(_node.ms(step_time(
        _node.lesson_05_model(), Layout(tp=8, micro_batch_size=_common.GPU_SETTINGS["05_tensor_parallel"]["micro_batch_size"]),
        _common.GPU_SETTINGS["05_tensor_parallel"]["seq_len"], fp32, "fp32")["total"]))


@pytest.mark.parametrize("name", EIGHT)
def test_the_eight_rank_configs_pass_the_trainers_rules(name, monkeypatch):
    """What PICOTRON_NPROC=8 trains is a run the trainer accepts at world size 8 (on CPU: the rules on the layout are
    the device's too)."""
    monkeypatch.setenv("PICOTRON_NPROC", "8")
    monkeypatch.setenv("PICOTRON_DEVICE", "cpu")
    lesson = _common.load_lesson(name)
    for fast in (True, False):
        configs = lesson.configs_at(8, fast)
        if name in TRAINS_NO_MODEL:
            assert configs == [], name
            continue
        assert configs, f"{name}: configs_at(8) is empty"
        for cfg in configs:
            assert cfg.world_size == 8, (name, cfg.world_size)
            rules.validate(dataclasses.replace(cfg, device="cpu"), world_size=8)


def test_picotron_nproc_8_adds_the_eight_rank_runs(monkeypatch):
    monkeypatch.delenv("PICOTRON_NPROC", raising=False)
    lesson = _common.load_lesson("03_data_parallel")
    assert lesson.scaling_counts() == (1, 2, 4)
    assert [c.grad_acc for c in lesson.configs_at(1)] == [1, 2, 4]
    monkeypatch.setenv("PICOTRON_NPROC", "8")
    assert lesson.scaling_counts() == (1, 2, 4, 8)
    assert [c.grad_acc for c in lesson.configs_at(1)] == [1, 2, 4, 8]


@pytest.mark.heavy
def test_lesson_03_runs_its_main_experiment_at_eight_ranks(tmp_path, monkeypatch):
    """PICOTRON_NPROC=8, FAST, on CPU: the scaling run at dp = 1 (with its references) and at dp = 8, 8 gloo processes;
    dp = 8 trains as one process with grad_acc = 8 does (the parity standard)."""
    monkeypatch.setenv("PICOTRON_NPROC", "8")
    monkeypatch.setenv("PICOTRON_FAST", "1")
    monkeypatch.setenv("PICOTRON_DEVICE", "cpu")
    for n in (1, 8):
        _common.launch("03_data_parallel/experiment.py", ["--out", tmp_path, "--only", "scaling"], nproc=n, quiet=True)
    one = _common.load_json(tmp_path / "scaling_dp1.json")["results"]
    eight = _common.load_json(tmp_path / "scaling_dp8.json")["results"]
    assert eight["dp"] == 8 and len(eight["mem_by_rank"]) == 8
    p = _common.parity(eight["loss"], one["references"]["8"])
    assert p["ok"], p
