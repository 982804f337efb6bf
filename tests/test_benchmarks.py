"""The benchmarks still run: each one at its --smoke size (benchmarks/_smoke.py: a tiny model, 2 rounds) on 2 gloo
ranks, and it prints its comparison line.

A smoke test, never a timing test: the ratios of 2 rounds on a shared CI machine mean nothing and are not
checked. What is checked is that the benchmark builds both sides (ours through `parallelize` and the step
engine, torch's DDP / FSDP2 / DTensor / pipelining schedules through theirs; cp_bench: our ring attention
against our all-gather), takes its steps, and reports; before this file a benchmark could rot unseen between
the sessions that quote its ratios. (kernels_bench.py runs in one process.)

Time: at --smoke a benchmark's own work takes about a second; what is left is starting the processes (torchrun and
2 ranks importing torch: about 20 s on a loaded 2-core machine). Every timeout here is a hang guard, far above that,
never a speed requirement: a busy machine must not fail these tests by time alone.

Tiers: the two-rank benchmarks (torchrun's start, about 20 s each) and the torch.compile one (a minute of cold
compiling) are the heavy tier's, `./run.sh test heavy`; the kernels' benchmark without compile stays in the default one.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from picotron import compat
from picotron.launch import run_torchrun

ROOT = Path(__file__).resolve().parents[1]
HANG_GUARD_S = 600  # a hang guard only: each test takes seconds to a minute even on a loaded machine


def newer(feature, *values):
    """A case that compares with a torch feature newer than picotron's floor: skipped, with its sentence, without it."""
    why = compat.missing(feature)
    return pytest.param(*values, marks=pytest.mark.skipif(why is not None, reason=why or ""))


@pytest.mark.heavy
@pytest.mark.parametrize("script,args,expect", [
    ("dp_vs_ddp.py", [], "throughput / DDP's: median"),
    newer("fsdp2", "zero_vs_fsdp.py", [], "our throughput / FSDP2's: median"),
    newer("dtensor_tp", "tp_vs_dtensor.py", ["--sp"], "our throughput / DTensor's: median"),
    newer("pipelining", "pp_vs_torch.py", [], "our throughput / torch's: median"),
    ("cp_bench.py", [], "ring zigzag throughput / all-gather zigzag's: median"),
    ("async_tp_bench.py", [], "overlapped throughput / blocking's: median"),
])
def test_benchmark_runs_on_two_ranks(script, args, expect):
    out = run_torchrun(ROOT / "benchmarks" / script, 2, ["--smoke", *args], timeout_s=HANG_GUARD_S, cwd=ROOT).stdout
    assert expect in out, out[-2000:]


def kernels_bench(*args):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels_bench.py"), "--smoke", *args],
                         capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_kernels_benchmark_runs():
    """One process: flash attention vs SDPA and eager, the model step per precision recipe; without torch.compile,
    whose compiling takes tens of seconds whatever the size (the next test has it)."""
    out = kernels_bench("--skip-compile")
    for expect in ("ours throughput / sdpa's: median", "--dtype fp8 vs plain fp32", "torch.compile variants are left out"):
        assert expect in out, out[-2000:]
    assert "--compile vs plain" not in out, out[-2000:]


@pytest.mark.heavy
def test_kernels_benchmark_compiles():
    """The torch.compile variants too: fused RMSNorm/SwiGLU and the model with --compile and --kernels compile. About
    a minute on a loaded 2-core machine with a cold compile cache (compiling, not the tiny work): the heavy tier's.
    tests/test_kernels.py compiles the fused kernels on their own by default."""
    out = kernels_bench()
    for expect in ("compile throughput / plain's: median", "--compile vs plain fp32", "--kernels compile vs plain"):
        assert expect in out, out[-2000:]
