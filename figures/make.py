"""Regenerate every figure in figures/ from real runs on this machine: `./run.sh figures`.

Each lesson's experiment script is run with its default (real-lesson) settings and its own plot functions
draw the PNGs, so the README shows exactly what the notebooks show. PICOTRON_FAST=1 gives a quick pass.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "lessons"))
import _common  # noqa: E402  (puts the repository root on sys.path)

from picotron.metrics import read_metrics  # noqa: E402


def save(fig, name):
    fig.savefig(HERE / name, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote figures/{name}")


def main_job():
    """The loss curve of `./run.sh`'s main job."""
    out = _common.run_dir("figures") / "main"
    steps = 100 if _common.FAST else 600
    subprocess.run([sys.executable, "-m", "picotron.train", "--steps", str(steps), "--eval-every", str(steps // 6),
                    "--out", str(out)], check=True, cwd=_common.ROOT)
    rows, summary = read_metrics(out)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1, label="train loss")
    val = [r for r in rows if "val_loss" in r]
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(f"tiny Llama on Shakespeare, {summary['device']}: {summary['tokens_per_s']:,.0f} tokens/s, "
                 f"MFU {100 * summary['mfu']:.0f}% of measured peak", fontsize=9)
    ax.legend()
    save(fig, "01_main_job_loss.png")


def lesson01():
    lesson = _common.load_lesson("01_single_device")
    out = _common.run_dir("figures") / "01_single_device"
    _common.launch("01_single_device.py", ["--out", out], quiet=True)
    load = lambda name: json.loads((out / f"{name}.json").read_text())
    save(lesson.plot_memory(load("memory")["results"]), "01_memory.png")
    save(lesson.plot_recompute(load("recompute")["results"]), "01_recompute.png")
    save(lesson.plot_accumulate(load("accumulate")["results"]), "01_accumulate.png")
    save(lesson.plot_precision(load("precision")["results"]), "01_precision.png")
    save(lesson.plot_throughput(load("throughput")["results"]), "01_throughput.png")


def lesson04(out=None):
    """ZeRO: memory per stage against the formulas, the ZeRO-3 timeline, ours against FSDP2. `out`: a folder
    that already holds the experiment's JSON files (then nothing is run)."""
    lesson = _common.load_lesson("04_zero")
    if out is None:
        out = _common.run_dir("figures") / "04_zero"
        for nproc, only in ((2, "memory,timeline,fsdp"), (4, "memory"), (1, "fsdp_memory")):
            _common.launch("04_zero.py", ["--out", out, "--only", only], nproc=nproc, quiet=True)
    load = lambda name: json.loads((Path(out) / f"{name}.json").read_text())["results"]
    save(lesson.plot_memory({n: load(f"memory_dp{n}") for n in (2, 4)}), "04_memory.png")
    save(lesson.plot_timeline(load("timeline")["rows"], title="ZeRO-3, one step, 2 ranks"), "04_timeline.png")
    save(lesson.plot_fsdp(load("fsdp"), load("fsdp_memory")["memory"]), "04_fsdp.png")


if __name__ == "__main__":
    os.chdir(_common.ROOT)
    main_job()
    lesson01()
    lesson04()
