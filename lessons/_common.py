"""Tiny helpers shared by every lesson notebook and experiment script.

    FAST            True when PICOTRON_FAST=1: short settings so a notebook runs in ~2 minutes on 2 CPU cores
    ROOT            the repository root (put on sys.path, so `import picotron` works from lessons/)
    run_dir(name)   runs/lessons/<name>/, created
    launch(...)     run a lesson script with torchrun on N processes; returns its printed output
    load_json/save_json, load_lesson(name) (import lessons/<name>.py although it starts with a digit)
    show_source(obj, start, stop)   print the lines of a function between two markers
"""
import importlib.util
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FAST = os.environ.get("PICOTRON_FAST", "0") == "1"


def run_dir(name):
    path = ROOT / "runs" / "lessons" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_json(obj, path):
    Path(path).write_text(json.dumps(obj, indent=1))


def load_json(path):
    return json.loads(Path(path).read_text())


def load_lesson(name):
    """Import lessons/<name>.py as a module (file names like 01_single_device.py are not identifiers)."""
    spec = importlib.util.spec_from_file_location(f"lesson_{name}", ROOT / "lessons" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch(script, args=(), nproc=1, timeout_s=900, quiet=False):
    """`torchrun --nproc_per_node nproc lessons/<script> args`, with the CPU's cores shared between the
    processes (OMP_NUM_THREADS = cores // nproc: more threads than cores makes CPU runs 10x slower).
    Prints the script's output (unless quiet) and returns it; raises with its tail if it fails or hangs."""
    from picotron.launch import run_torchrun

    threads = max(1, (os.cpu_count() or 1) // nproc)
    result = run_torchrun(ROOT / "lessons" / script, nproc, [str(a) for a in args], timeout_s=timeout_s,
                          env={"OMP_NUM_THREADS": str(threads)}, cwd=ROOT)
    if not quiet:
        print(result.stdout.rstrip())
    return result.stdout


def show_source(obj, start=None, stop=None):
    """Print the source of a function or class, optionally only from the first line containing `start`
    to the first later line containing `stop` (inclusive): quoting the code as it is, never a copy."""
    import inspect

    lines = inspect.getsource(obj).splitlines()
    first = next((i for i, line in enumerate(lines) if start and start in line), 0)
    last = next((i for i, line in enumerate(lines) if i >= first and stop and stop in line), len(lines) - 1)
    print("\n".join(lines[first:last + 1]))


# ------------------------------------------------------------------------- what the experiment scripts share
def gather(obj, mesh):
    """Every rank's `obj` (anything picklable), as a list by rank, on every rank."""
    import torch.distributed as dist

    out = [None] * mesh.world_size
    dist.all_gather_object(out, obj)
    return out


def run_interleaved(variants, steps, warmup, group):
    """warmup + steps steps of every variant (objects with .step(step, record)), one step of each in turn, the
    order rotating every step and a barrier before each: slow drift of a shared machine hits all alike."""
    import torch.distributed as dist

    for s in range(warmup + steps):
        k = s % len(variants)
        for v in variants[k:] + variants[:k]:
            dist.barrier(group)
            v.step(s + 1, record=s >= warmup)


def union_length(intervals):
    """Total length covered by a list of (start, end) intervals, overlaps counted once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def plot_parity(pairs, what="each run"):
    """pairs: {label: (losses, reference losses)}: both curves, and their relative difference against the
    course's parity standard (1e-5)."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
    for label, (got, ref) in pairs.items():
        steps = range(1, len(got) + 1)
        ax1.plot(steps, ref, "k-", lw=3, alpha=0.3)
        ax1.plot(steps, got, "o--", ms=3, label=label)
        ax2.semilogy(steps, [max(abs(a - b) / abs(b), 1e-9) for a, b in zip(got, ref)], "o-", ms=3, label=label)
    ax1.set(xlabel="step", ylabel="loss", title=f"{what} (dashed) over one process (grey)")
    ax1.legend(fontsize=7)
    ax2.axhline(1e-5, color="#c44e52", ls="--", lw=1, label="parity standard 1e-5")
    ax2.set(xlabel="step", ylabel="|Δloss| / loss", title="relative difference (1e-9: equal)", ylim=(1e-10, 1e-3))
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig
