"""Where the lessons run: PICOTRON_DEVICE and PICOTRON_NPROC, read in lessons/_common.py and nowhere else.

The GPU side is checked with torch.cuda monkeypatched (this suite runs on CPUs): auto picks cuda when torch sees
GPUs, a lesson that needs more processes than GPUs is refused in one sentence before anything starts, and on the
CPU path no torch.cuda function but is_available() is called. Also: the tables behind it stay true to the lessons
(every notebook's process counts are the ones LESSONS declares; every GPU_SETTINGS key is a setting the lesson has).
"""
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lessons"))
import _common  # noqa: E402

FOLDERS = sorted(p.name for p in (ROOT / "lessons").glob("[0-9][0-9]_*") if p.is_dir())


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n): torch sees n CUDA GPUs (n = 0: none)."""
    def see(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.delenv("PICOTRON_DEVICE", raising=False)
    monkeypatch.delenv("PICOTRON_NPROC", raising=False)
    return see


def test_auto_is_cuda_when_torch_sees_a_gpu(gpus, monkeypatch):
    gpus(0)
    assert (_common.device_setting(), _common.device(), _common.gpu_count(), _common.on_gpu()) == ("auto", "cpu", 0, False)
    gpus(8)
    assert (_common.device(), _common.gpu_count()) == ("cuda", 8)
    monkeypatch.setenv("PICOTRON_DEVICE", " CPU ")  # case and spaces forgiven
    assert (_common.device(), _common.gpu_count()) == ("cpu", 0)
    monkeypatch.setenv("PICOTRON_DEVICE", "cuda")
    assert _common.device() == "cuda"


def test_bad_settings_are_one_sentence(gpus, monkeypatch):
    gpus(0)
    monkeypatch.setenv("PICOTRON_DEVICE", "tpu")
    with pytest.raises(ValueError, match=r"^PICOTRON_DEVICE='tpu' is not one of auto, cpu, cuda; unset it"):
        _common.device()
    monkeypatch.setenv("PICOTRON_DEVICE", "cuda")
    with pytest.raises(RuntimeError, match=r"^PICOTRON_DEVICE=cuda but torch sees no CUDA GPU; unset it or set "
                                           r"PICOTRON_DEVICE=cpu\.$"):
        _common.device()
    monkeypatch.delenv("PICOTRON_DEVICE")
    monkeypatch.setenv("PICOTRON_NPROC", "5")
    with pytest.raises(ValueError, match=r"^PICOTRON_NPROC=5: lesson 09 runs 8 \(dp1-pp2-cp2-tp2\) or 16 "
                                         r"\(dp2-pp2-cp2-tp2\) processes; pick one, or unset it for 16\.$"):
        _common.nproc("09_all_together", 16)


def test_the_cpu_path_calls_no_cuda_function_but_is_available(gpus, monkeypatch):
    gpus(0)
    for name in ("device_count", "get_device_name", "get_device_capability", "synchronize", "set_device"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: pytest.fail("a torch.cuda function ran on the CPU path"))
    assert _common.device() == "cpu"
    _common.fits("09_all_together", 16)  # on CPU any count runs (gloo processes)
    monkeypatch.setenv("PICOTRON_DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("PICOTRON_DEVICE=cpu asks torch nothing"))
    assert _common.device() == "cpu"


def test_more_processes_than_gpus_is_refused_in_one_sentence(gpus, monkeypatch):
    gpus(8)
    _common.fits("09_all_together", 8)
    with pytest.raises(_common.DoesNotFit) as e:
        _common.fits("09_all_together", 16)
    assert str(e.value) == ("lesson 09 runs 16 processes; this machine has 8 GPUs: set PICOTRON_DEVICE=cpu to run it "
                            "on CPU, PICOTRON_NPROC=8 for its 8-process layout (dp1-pp2-cp2-tp2), or run its "
                            "experiment on 2 nodes (docs/gpu_pods.md: Lessons on a GPU pod).")
    gpus(1)
    with pytest.raises(_common.DoesNotFit, match=r"^lesson 03 runs 4 processes; this machine has 1 GPU: set "
                                                 r"PICOTRON_DEVICE=cpu to run it on CPU, or run it on a machine with "
                                                 r"at least 4 GPUs\.$"):
        _common.fits("03_data_parallel", 4)


def test_launch_refuses_before_starting_anything(gpus, monkeypatch):
    import picotron.launch

    gpus(8)
    monkeypatch.setattr(picotron.launch, "run_torchrun", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(_common.DoesNotFit, match="^lesson 09 runs 16 processes; this machine has 8 GPUs"):
        _common.launch("09_all_together/experiment.py", ["--only", "run4d"], nproc=16)


def test_launch_hands_the_device_to_every_process(gpus, monkeypatch):
    import picotron.launch

    seen = {}

    def fake(script, nproc, args, timeout_s, env, cwd):
        seen.update(env, nproc=nproc)
        return type("Done", (), {"stdout": ""})()
    monkeypatch.setattr(picotron.launch, "run_torchrun", fake)
    gpus(0)
    _common.launch("03_data_parallel/experiment.py", [], nproc=4, quiet=True)
    assert seen["PICOTRON_DEVICE"] == "cpu" and seen["nproc"] == 4
    gpus(4)
    _common.launch("03_data_parallel/experiment.py", [], nproc=4, quiet=True)
    assert seen["PICOTRON_DEVICE"] == "cuda"


def test_an_experiment_started_by_hand_says_it_does_not_fit(gpus, monkeypatch, capsys):
    gpus(8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit) as e:
        _common.experiment_device("09_all_together")
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("lesson 09 runs 16 processes; this machine has 8 GPUs:")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # e.g. one node of two, 8 processes each
    assert _common.experiment_device("09_all_together") == "cuda"


def test_nproc_picks_lesson_09s_layout(gpus, monkeypatch):
    gpus(0)
    lesson = _common.load_lesson("09_all_together")
    assert lesson.settings(False)["layout"] == dict(dp=2, pp=2, cp=2, tp=2)
    assert lesson.settings(True)["layout"] == dict(dp=1, pp=2, cp=2, tp=2)
    monkeypatch.setenv("PICOTRON_NPROC", "8")
    assert lesson.settings(False)["layout"] == dict(dp=1, pp=2, cp=2, tp=2)
    monkeypatch.setenv("PICOTRON_NPROC", "16")
    assert lesson.settings(True)["layout"] == dict(dp=2, pp=2, cp=2, tp=2)


def test_sized_puts_the_gpu_row_on_top_only_on_gpus(gpus):
    gpus(0)
    cpu = dict(size="small", seq_len=128, micro_batch_size=4, steps=30, dtensor_steps=60)
    assert _common.sized("05_tensor_parallel", cpu) is cpu
    on_gpu = _common.sized("05_tensor_parallel", cpu, fast=False, device_type="cuda")
    assert (on_gpu["size"], on_gpu["seq_len"], on_gpu["steps"], on_gpu["dtensor_steps"]) == ("medium", 1024, 40, 100)
    fast = _common.sized("05_tensor_parallel", cpu, fast=True, device_type="cuda")
    assert (fast["steps"], fast["dtensor_steps"]) == (10, 20) and "fast" not in fast
    gpus(2)
    assert _common.sized("05_tensor_parallel", cpu)["size"] == "medium"  # device() decides without a device_type


def test_every_lesson_has_a_row_and_its_notebook_launches_the_declared_counts():
    assert sorted(_common.LESSONS) == FOLDERS and sorted(_common.GPU_SETTINGS) == FOLDERS
    for name in FOLDERS:
        source = (ROOT / "lessons" / name / f"{name}.py").read_text()
        counts = {int(n) for n in re.findall(r"\bnproc=(\d+)", source)}
        assert counts <= set(_common.LESSONS[name]["nproc"]), (name, counts)


@pytest.mark.parametrize("name", [n for n in FOLDERS if n not in ("02_collectives",)])
def test_gpu_settings_only_change_settings_the_lesson_has(name, gpus):
    """A GPU_SETTINGS key that the lesson's settings do not have would be silently ignored (a typo, or a
    setting renamed): each row may only change what the CPU settings define."""
    gpus(0)
    lesson = _common.load_lesson(name)
    for fast in (True, False):
        cpu = lesson.settings(fast) if name != "01_single_device" else lesson.settings(fast, "cpu")
        extra = {k for k in _common.GPU_SETTINGS[name] if k != "fast"} | set(_common.GPU_SETTINGS[name].get("fast", {}))
        if name == "03_data_parallel":
            cpu = lesson.all_settings(fast)
        assert extra <= set(cpu), (name, extra - set(cpu))


def test_collectives_gpu_row_matches_its_settings():
    lesson = _common.load_lesson("02_collectives")
    for mode in ("fast", "full"):
        row = _common.sized("02_collectives", lesson.SETTINGS[mode], mode == "fast", device_type="cuda")
        assert set(row) == set(lesson.SETTINGS[mode]) and max(row["sizes"]) == 256 * 2**20
