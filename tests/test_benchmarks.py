"""The benchmarks still run: each one on 2 gloo ranks for 2 rounds, and it prints its comparison line.

A smoke test, never a timing test: the ratios of 2 rounds on a shared CI machine mean nothing and are not
checked. What is checked is that the benchmark builds both sides (ours through `parallelize` and the step
engine, torch's DDP / FSDP2 / DTensor / pipelining schedules through theirs; cp_bench: our ring attention
against our all-gather), takes its steps, and reports; before this file a benchmark could rot unseen between
the sessions that quote its ratios. (kernels_bench.py runs in one process.)
"""
from pathlib import Path

import pytest

from picotron import compat
from picotron.launch import run_torchrun

ROOT = Path(__file__).resolve().parents[1]


def newer(feature, *values):
    """A case that compares with a torch feature newer than picotron's floor: skipped, with its sentence, without it."""
    why = compat.missing(feature)
    return pytest.param(*values, marks=pytest.mark.skipif(why is not None, reason=why or ""))


@pytest.mark.parametrize("script,args,expect", [
    ("dp_vs_ddp.py", ["--bucket-mb", "1"], "throughput / DDP's: median"),
    newer("fsdp2", "zero_vs_fsdp.py", [], "our throughput / FSDP2's: median"),
    newer("dtensor_tp", "tp_vs_dtensor.py", ["--sp"], "our throughput / DTensor's: median"),
    newer("pipelining", "pp_vs_torch.py", ["--num-hidden-layers", "4", "--seq-len", "32", "--micro-batch-size", "2",
                                           "--micro-batches", "4"], "our throughput / torch's: median"),
    ("cp_bench.py", ["--num-hidden-layers", "2", "--seq-len", "32", "--micro-batch-size", "1"],
     "ring zigzag throughput / all-gather zigzag's: median"),
])
def test_benchmark_runs_on_two_ranks(script, args, expect):
    out = run_torchrun(ROOT / "benchmarks" / script, 2, ["--steps", "2", "--warmup", "1", *args],
                       timeout_s=300, cwd=ROOT).stdout
    assert expect in out, out[-2000:]


def test_kernels_benchmark_runs():
    """One process: flash attention vs SDPA and eager, fused RMSNorm/SwiGLU vs plain, the model step per recipe."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels_bench.py"), "--rounds", "2",
                          "--steps-model", "1", "--seq-lens", "64"], capture_output=True, text=True, timeout=600,
                         cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    for expect in ("ours throughput / sdpa's: median", "compile throughput / plain's: median",
                   "--dtype fp8 vs plain fp32"):
        assert expect in out.stdout, out.stdout[-2000:]
