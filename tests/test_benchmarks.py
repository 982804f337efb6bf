"""The benchmarks still run: each one on 2 gloo ranks for 2 rounds, and it prints its comparison line.

A smoke test, never a timing test: the ratios of 2 rounds on a shared CI machine mean nothing and are not
checked. What is checked is that the benchmark builds both sides (ours through `parallelize` and the step
engine, torch's DDP / FSDP2 / DTensor / pipelining schedules through theirs; cp_bench: our ring attention
against our all-gather), takes its steps, and reports; before this file a benchmark could rot unseen between
the sessions that quote its ratios.
"""
from pathlib import Path

import pytest

from picotron.launch import run_torchrun

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script,args,expect", [
    ("dp_vs_ddp.py", ["--bucket-mb", "1"], "throughput / DDP's: median"),
    ("zero_vs_fsdp.py", [], "our throughput / FSDP2's: median"),
    ("tp_vs_dtensor.py", ["--sp"], "our throughput / DTensor's: median"),
    ("pp_vs_torch.py", ["--num-hidden-layers", "4", "--seq-len", "32", "--micro-batch-size", "2",
                        "--micro-batches", "4"], "our throughput / torch's: median"),
    ("cp_bench.py", ["--num-hidden-layers", "2", "--seq-len", "32", "--micro-batch-size", "1"],
     "ring zigzag throughput / all-gather zigzag's: median"),
])
def test_benchmark_runs_on_two_ranks(script, args, expect):
    out = run_torchrun(ROOT / "benchmarks" / script, 2, ["--steps", "2", "--warmup", "1", *args],
                       timeout_s=300, cwd=ROOT).stdout
    assert expect in out, out[-2000:]
