"""benchmarks/gpu_check.py still works: on this CPU its --cpu-smoke runs three of its rows (the main job, the
torchrun world-1 run, the CUDA tests collected) and writes the table as JSON; without --cpu-smoke and without a GPU
it says so in one sentence and exits 0. Its failure reasons are one line. A smoke test, never a timing test."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


def run(*args, timeout=170):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # a GPU machine runs it as a CPU one
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.heavy  # the heavy tier: a whole subprocess run of every recipe (18 s)
def test_cpu_smoke_prints_one_table_and_writes_it(tmp_path):
    proc = run("--cpu-smoke", "--only", "main,nccl,tests", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {r["key"]: r for r in result["rows"]}
    assert list(rows) == ["main", "nccl", "tests"] and all(r["status"] == "pass" for r in rows.values()), rows
    for key in ("main", "nccl"):
        assert rows[key]["tokens_per_s"] > 0 and 0 < rows[key]["mfu"] < 1 and rows[key]["peak_bytes"] > 0
    assert "gloo" in rows["nccl"]["run"] and "tests collected" in rows["tests"]["reason"]
    assert result["table"] in proc.stdout
    assert proc.stdout.count("| result") == 1  # one table
    header = result["table"].splitlines()[0]
    assert [c.strip() for c in header.split("|")] == ["run", "tokens/s", "MFU (measured peak)", "peak memory", "result"]


def test_without_a_gpu_it_says_so_and_exits_0():
    proc = run(timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip().count("\n") == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("gpu_check: torch sees no CUDA GPU here, so there is nothing to check")


def test_rows_cover_every_recipe_and_kernel_and_find_the_cuda_tests():
    keys = [r[0] for r in gpu_check.rows(gpu_check.GPU, "cuda")]
    assert keys == ["main", "fp32", "bf16", "bf16-params", "fp16", "fp8", "fp8-blockwise", "triton", "flash", "nccl",
                    "tests", "compile"]
    tests = gpu_check.cuda_tests()
    assert "tests/test_fp8_blockwise.py::test_gpu_blockwise_scaled_mm_matches_the_simulation" in tests
    assert "tests/test_mesh.py::test_pick_device" in tests and "tests/test_kernels.py::test_triton_matches_plain" in tests


def test_a_failure_is_one_line_naming_its_cause():
    out = "step 1\nTraceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out of memory. Tried\n"
    assert gpu_check.reason_of(out) == "torch.OutOfMemoryError: CUDA out of memory. Tried"
    out = "picotron | ...\npicotron: error: tp=3 does not divide num_attention_heads=8; pick tp in {1, 2, 4, 8}\nx\n"
    assert gpu_check.reason_of(out).startswith("picotron: error: tp=3 does not divide")
    assert gpu_check.reason_of("=== 1 failed, 2 passed in 3.0s ===") == "=== 1 failed, 2 passed in 3.0s ==="
    assert len(gpu_check.reason_of("RuntimeError: " + "x" * 500)) == 160
