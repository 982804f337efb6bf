"""The one-GPU check: does everything that only runs on a GPU work on this one, and how fast is it?

    ./run.sh gpu-check                          # on one CUDA GPU: about 5 minutes on an H100
    ./run.sh gpu-check --out runs/gpu_check     # also writes the table as runs/gpu_check/gpu_check.json
    ./run.sh gpu-check --cpu-smoke              # the same table on the CPU with tiny settings (what CI runs)
    python benchmarks/gpu_check.py --only main,bf16,tests

Each row is one fresh process with its own time limit: `python -m picotron.train` for a few steps (the main job
as ./run.sh starts it; then the larger model in every precision recipe --dtype fp32, bf16, bf16-params, fp16, fp8,
and fp8 with --fp8-recipe blockwise;
bf16 with --kernels triton, --attn-impl flash and --compile; bf16 under torchrun at world size 1, i.e. an NCCL process
group), and pytest on the tests whose code takes a CUDA path when torch sees a GPU (found by reading tests/: a test
function that calls torch.cuda.is_available(), or a skipif on cuda / a cuda or gpu marker). The numbers come from
the run's own metrics.jsonl (picotron.metrics.read_metrics): tokens/s and MFU are the medians over the steps after the first two (warm-up,
compilation), MFU against the matmul peak the run measured on this device in its compute dtype; peak memory is the
device's peak (torch.cuda.max_memory_allocated, reset each step; on the CPU the process's peak RSS). A training row
passes when the process exits 0, every loss is finite and, over 5 or more steps, the last loss is below the first.
A failed row says why in one line (picotron's own error sentence, the exception's last line, or the time limit).

It prints ONE table and writes it as JSON (--out). Rows stop starting once --budget-s is spent (default 330 s, so
the whole check stays under 6 minutes on an H100). Without a CUDA GPU it says so in one sentence and exits 0;
--cpu-smoke runs the same rows on the CPU (gloo instead of NCCL, Triton under its interpreter, the tests only
collected) with the tiny model, to prove the script itself works. Exit status: 0 when no row failed, else 1.
"""
import argparse
import ast
import importlib.util
import json
import math
import os
import re
import statistics
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("fp32", "bf16", "bf16-params", "fp16", "fp8")
# Sized so that the whole check takes about 5 minutes on an H100: start-up (CUDA context, the matmul-peak
# measurement) dominates each row; --compile's first steps compile every decoder layer.
GPU = dict(preset="smollm-360m", seq_len=1024, micro_batch_size=4, steps=8, budget_s=330, limit_s=150,
           compile_limit_s=240, tests_limit_s=240)
SMOKE = dict(preset="tiny", seq_len=64, micro_batch_size=4, steps=3, budget_s=600, limit_s=120,
             compile_limit_s=240, tests_limit_s=120)
WARMUP_STEPS = 2  # steps left out of the medians (allocations, kernel selection, compilation)


def rows(st, device):
    """[(key, name, kind, argv)]: kind "train" (python -m picotron.train argv), "torchrun" (the same under
    torchrun, one process) or "tests" (pytest argv); key: what --only names."""
    model = ["--preset", st["preset"], "--seq-len", str(st["seq_len"]), "--micro-batch-size", str(st["micro_batch_size"])]
    short = ["--steps", str(st["steps"]), "--warmup-steps", "1", "--eval-every", "0", "--sample-tokens", "0",
             "--log-every", str(st["steps"]), "--device", device]
    bf16 = model + short + ["--dtype", "bf16"]
    backend = "nccl" if device == "cuda" else "gloo"
    return ([("main", "main job (./run.sh's tiny model)", "train", short)]
            + [(dtype, f"--dtype {dtype}", "train", model + short + ["--dtype", dtype]) for dtype in PRECISIONS]
            + [("fp8-blockwise", "--dtype fp8 --fp8-recipe blockwise", "train",  # picotron/fp8_blockwise.py
                model + short + ["--dtype", "fp8", "--fp8-recipe", "blockwise"])]
            + [("triton", "bf16 --kernels triton", "train", bf16 + ["--kernels", "triton"]),
               ("flash", "bf16 --attn-impl flash", "train", bf16 + ["--attn-impl", "flash"]),
               ("nccl", f"bf16, torchrun world 1 ({backend})", "torchrun", bf16),
               ("tests", "tests with a CUDA path", "tests", cuda_tests()),
               ("compile", "bf16 --compile", "train", bf16 + ["--compile"])])  # last: the slowest


def cuda_tests():
    """The test functions in tests/ that take a CUDA path on a GPU, as pytest node ids: their code calls
    torch.cuda.is_available(), or a decorator skips them without cuda or marks them cuda/gpu."""
    ids = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        text = path.read_text()
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and (
                    "torch.cuda.is_available()" in ast.get_source_segment(text, node)
                    or any(re.search(r"skip.*cuda|mark\.(cuda|gpu)\b", ast.get_source_segment(text, d))
                           for d in node.decorator_list)):
                ids.append(f"tests/{path.name}::{node.name}")
    return ids


# ------------------------------------------------------------------------------------------------ one row
def reason_of(output, limit=160):
    """One line saying why a process failed: picotron's own error sentence, else the last exception line, else
    pytest's summary, else the last line it printed."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for pick in (lambda l: l.startswith(("picotron: error:", "picotron: stopped:", "run.sh:")),
                 lambda l: re.match(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b.*:", l),
                 lambda l: re.match(r"^(FAILED|ERROR) ", l),
                 lambda l: re.search(r"\d+ (failed|error)", l)):
        hits = [line for line in lines if pick(line)]
        if hits:
            return shorten(hits[-1], limit)
    return shorten(lines[-1], limit) if lines else "no output"


def shorten(text, limit):
    return text if len(text) <= limit else text[:limit - 1] + "…"


def numbers(out_dir):
    """tokens/s, MFU (medians after the warm-up steps), peak bytes, losses of a run directory's metrics.jsonl."""
    from picotron.metrics import read_metrics

    history, summary = read_metrics(out_dir)
    steady = history[WARMUP_STEPS:] or history[1:] or history
    peaks = [r["mem"].get("device_peak") or r["mem"].get("rss_peak") for r in history if r.get("mem")]
    return dict(tokens_per_s=statistics.median(r["tokens_per_s"] for r in steady),
                mfu=statistics.median(r["mfu"] for r in steady),
                peak_bytes=max((p for p in peaks if p is not None), default=None),
                peak_kind="device" if history and history[-1]["mem"].get("device_peak") is not None else "RSS",
                losses=[r["loss"] for r in history], steps=len(history), summary=summary is not None)


def run_process(cmd, limit_s, env):
    """Run cmd in the repository, in a session of its own: (its output, exit status), or (the output so far, None)
    when it was still running after limit_s seconds (then killed)."""
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=limit_s, start_new_session=True)
        return proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        return (e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")), None


def child_env(cuda):
    """The environment of every row's process: the repository importable; on a CPU one thread per process and
    Triton's kernels under its interpreter."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    if not cuda:
        env.update(OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"), TRITON_INTERPRET="1")
    return env


def run_row(key, name, kind, argv, out, limit_s, env):
    """Run one row; return its record for the table."""
    t0 = time.perf_counter()
    record = dict(key=key, run=name, kind=kind, tokens_per_s=None, mfu=None, peak_bytes=None, ok=False, status="fail",
                  reason="", seconds=None)
    if kind == "tests":
        if not argv:
            record.update(ok=True, status="pass", reason="no test in tests/ takes a CUDA path", seconds=0.0)
            return record
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *argv]
    else:
        run_dir = out / key
        shutil.rmtree(run_dir, ignore_errors=True)  # this check's scratch run: a run never writes over another
        argv = argv + ["--out", str(run_dir)]
        if kind == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                   "-m", "picotron.train", *argv]
        else:
            cmd = [sys.executable, "-m", "picotron.train", *argv]
    record["command"] = " ".join(["python" if c == sys.executable else c for c in cmd])
    output, code = run_process(cmd, limit_s, env)
    record["seconds"] = time.perf_counter() - t0
    if code is None:
        record["reason"] = f"still running after its {limit_s:.0f} s limit (last output: {reason_of(output, 80)})"
        return record
    if kind == "tests":
        summary = next((line.strip("= ") for line in reversed(output.splitlines()) if re.search(
            r"\d+ (passed|failed|error|skipped|tests? collected)", line)), "")
        ok = code == 0
        record.update(ok=ok, status="pass" if ok else "fail", reason=summary if ok else reason_of(output))
        return record
    if code != 0:
        record["reason"] = reason_of(output)
        return record
    try:
        got = numbers(run_dir)
    except (OSError, ValueError, KeyError, StopIteration, statistics.StatisticsError) as e:
        record["reason"] = f"exited 0 but its metrics.jsonl could not be read ({type(e).__name__}: {e})"
        return record
    record.update({k: got[k] for k in ("tokens_per_s", "mfu", "peak_bytes", "peak_kind")},
                  loss_first=got["losses"][0], loss_last=got["losses"][-1])
    losses = got["losses"]
    if not all(math.isfinite(x) for x in losses):
        record["reason"] = f"a loss is not finite: {losses}"
    elif got["steps"] >= 5 and not losses[-1] < losses[0]:
        record["reason"] = f"the loss did not fall over {got['steps']} steps ({losses[0]:.3f} -> {losses[-1]:.3f})"
    else:
        record.update(ok=True, status="pass", reason=f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return record


# ------------------------------------------------------------------------------------------------ the table
def fmt_bytes(n):
    return "-" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def table(records):
    """The table as text: run, tokens/s, MFU, peak memory, pass/fail and the reason."""
    head = ("run", "tokens/s", "MFU (measured peak)", "peak memory", "result")
    lines = [(r["run"], "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}",
              "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
              fmt_bytes(r["peak_bytes"]) + (" (RSS)" if r.get("peak_kind") == "RSS" and r["peak_bytes"] else ""),
              r["status"] + (f": {r['reason']}" if r["reason"] else "")) for r in records]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head[:-1])]
    row = lambda cells: " | ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths))) + " | " + cells[-1]
    return "\n".join([row(head), "-+-".join("-" * w for w in widths) + "-+-" + "-" * 6] + [row(line) for line in lines])


def describe_device(cuda):
    import torch

    if cuda:
        return (f"{torch.cuda.get_device_name(0)} (torch {torch.__version__}, CUDA {torch.version.cuda}, "
                f"compute capability {'.'.join(map(str, torch.cuda.get_device_capability(0)))})")
    return f"CPU, {os.cpu_count()} cores (torch {torch.__version__})"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "runs" / "gpu_check"), help="folder for the runs and gpu_check.json")
    p.add_argument("--cpu-smoke", action="store_true", help="run the table on the CPU with tiny settings")
    p.add_argument("--only", default="", help="comma-separated subset of: main, fp32, bf16, bf16-params, fp16, fp8, "
                                              "fp8-blockwise, "
                                              "triton, flash, nccl, tests, compile")
    p.add_argument("--preset", help="model of the precision/kernel rows (GPU default smollm-360m, smoke tiny)")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--steps", type=int, help="steps per training row (GPU default 8)")
    p.add_argument("--budget-s", type=float, help="no row starts after this many seconds (GPU default 330)")
    args = p.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        print("gpu_check: torch sees no CUDA GPU here, so there is nothing to check (--cpu-smoke runs the same table "
              "on the CPU with tiny settings).")
        return 0
    st = dict(GPU if cuda else SMOKE)
    st.update({k: v for k, v in dict(preset=args.preset, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                                      steps=args.steps, budget_s=args.budget_s).items() if v is not None})
    device = "cuda" if cuda else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = child_env(cuda)
    todo = rows(st, device)
    if args.only:
        keep = [k.strip() for k in args.only.split(",") if k.strip()]
        unknown = sorted(set(keep) - {r[0] for r in todo})
        if unknown:
            p.error(f"--only {','.join(unknown)}: pick from {', '.join(r[0] for r in todo)}")
        todo = [r for r in todo if r[0] in keep]
    print(f"gpu_check on {describe_device(cuda)}: {st['preset']} at s = {st['seq_len']}, micro-batch "
          f"{st['micro_batch_size']}, {st['steps']} steps per run; {len(todo)} runs, budget {st['budget_s']:.0f} s",
          flush=True)
    records, t0 = [], time.perf_counter()
    for key, name, kind, argv_ in todo:
        left = st["budget_s"] - (time.perf_counter() - t0)
        skipped = dict(key=key, run=name, kind=kind, tokens_per_s=None, mfu=None, peak_bytes=None, seconds=0.0)
        limit = st["compile_limit_s"] if key == "compile" else st["tests_limit_s"] if kind == "tests" else st["limit_s"]
        if kind == "tests" and not cuda:  # the smoke only collects them (on a CPU they would rerun under emulation)
            argv_ = ["--collect-only", *argv_]
        if left <= 0:
            records.append(dict(skipped, ok=False, status="skip", reason=f"the check's {st['budget_s']:.0f} s budget "
                                                                           f"was spent"))
        elif key == "triton" and importlib.util.find_spec("triton") is None:
            records.append(dict(skipped, ok=not cuda, status="fail" if cuda else "skip",
                                reason="triton is not installed (pip install triton)"))
        else:
            records.append(run_row(key, name, kind, argv_, out, max(30.0, min(limit, left + 60)), env))
        r = records[-1]
        print(f"  {r['run']}: {r['status']} ({r['seconds']:.0f} s)", flush=True)
    text = table(records)
    print(text)
    result = dict(device=describe_device(cuda), cuda=cuda, settings=st, warmup_steps_left_out=WARMUP_STEPS,
                  seconds=time.perf_counter() - t0, rows=records, table=text)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    print(f"written: {out / 'gpu_check.json'} ({result['seconds']:.0f} s)")
    return 0 if all(r["status"] != "fail" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
