"""benchmarks/mfu_table.py, the GPU MFU table: on a CPU it says there is nothing to measure, and its smoke mode runs
our bf16 row and the transformers loop end to end (tiny preset), so the one GPU command is known to work."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "mfu_table.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_without_a_gpu_it_says_so_and_exits_0():
    import torch

    if torch.cuda.is_available():
        return  # on a GPU the full table would run: not a test
    out = run()
    assert out.returncode == 0 and "torch sees no CUDA GPU" in out.stdout, out.stdout + out.stderr


@pytest.mark.heavy  # the heavy tier: a subprocess training both loops (14 s)
def test_cpu_smoke_runs_ours_and_the_transformers_loop(tmp_path):
    out = run("--cpu-smoke", "--only", "bf16,hf", "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads((tmp_path / "mfu_table.json").read_text())
    rows = {r["key"]: r for r in result["shapes"]["tiny"]}
    assert set(rows) == {"bf16", "hf"}
    for r in rows.values():
        assert r["ok"] and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1.5, r
    assert rows["bf16"]["vs_bf16"] == 1.0 and rows["hf"]["vs_bf16"] > 0
    assert "transformers Llama, same loop" in out.stdout and "vs bf16" in out.stdout
    assert run("--only", "nope", "--cpu-smoke").returncode == 2  # an unknown row is refused by argparse


def test_each_target_is_held_to_its_own_base_row():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import mfu_table

    recs = [dict(key=k, tokens_per_s=v) for k, v in
            dict(bf16=100.0, **{"hf-compile": 80.0, "compile": 120.0, "bf16-params": 101.0, "fp8": 105.0}).items()]
    lines = mfu_table.target_lines("smollm-1.7b", recs)
    assert "bf16-params / bf16 >= 1.0: 1.01 pass" in lines[0]
    assert "fp8 / bf16 >= 1.1: 1.05 MISS" in lines[1]
    assert "fp8-block / bf16 >= 1.1: no ratio" in lines[2]  # the row did not run: said, not passed
    assert "compile / hf-compile >= 1.3: 1.50 pass" in lines[3]
    assert len(mfu_table.target_lines("smollm-360m", recs)) == 2  # the FP8 targets are the 1.7B shape's
    assert {r[0] for r in mfu_table.rows("tiny", mfu_table.SMOKE, "cpu")} >= {t[0] for t in mfu_table.TARGETS}
