"""Regenerate every figure in figures/ from real runs on this machine: `./run.sh figures [NN ...]`.

Every lesson notebook (or the ones named: 01, 03_data_parallel, ...) is built from its source and executed top
to bottom, in its own folder, with the full settings its prose describes; the executed notebook is saved in place
(the committed notebooks carry these outputs) and its k-th figure is written to figures/NN_k.png, so the README,
the notebooks and figures/ show the same runs. The main job's loss curve is figures/01_main_job_loss.png; the 4D run
against one process (`./run.sh figures 4d`) is figures/4d_run_loss.png.
Each executed notebook is stamped (metadata "picotron": made by `./run.sh figures`, FAST or full, its source's
SHA-256) and each image output names the file it was written to; tests/test_notebook_sources.py refuses a committed
notebook that is not a full run of its current source, or whose images differ from figures/ byte for byte.
PICOTRON_FAST=1 gives a quick pass (FAST settings, stamped FAST: the test refuses it, so it is not for committing).
Exit status 1 if a lesson's check fails. `--no-run` only writes the figures of the notebooks as they are.
"""
import base64
import os
import subprocess
import sys
import time
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


FOUR_D = ["--dp", "2", "--pp", "2", "--cp", "2", "--tp", "2", "--grad-acc", "4", "--micro-batch-size", "4"]


def four_d():
    """The README's 4D run: dp2 x pp2 x cp2 x tp2 = 16 CPU processes (picotron.train starts them), against one process
    with the same global batch (8 micro-batches of 4 sequences), from the same seed."""
    steps = 20 if _common.FAST else 100
    runs = {"16 processes: dp2 · pp2 · cp2 · tp2": FOUR_D,
            "one process, 8 micro-batches": ["--grad-acc", "8", "--micro-batch-size", "4"]}
    curves = {}
    for i, (label, flags) in enumerate(runs.items()):
        out = _common.run_dir("figures") / f"4d-{i}"
        subprocess.run([sys.executable, "-m", "picotron.train", *flags, "--steps", str(steps), "--eval-every", "25",
                        "--sample-tokens", "0", "--out", str(out)], check=True, cwd=_common.ROOT)
        curves[label] = read_metrics(out)[0]
    (a, rows4d), (b, rows1) = curves.items()
    fig, (ax, dx) = plt.subplots(1, 2, figsize=(10, 3.2))
    for (label, rows), style in zip(curves.items(), ("-", "--")):
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], style, lw=1.2, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=8)
    ax.set_title("the tiny Llama, same seed and global batch", fontsize=9)
    for key, label in (("loss", "loss"), ("grad_norm", "gradient norm")):
        dx.semilogy([r["step"] for r in rows1], [max(abs(x[key] - y[key]) / abs(y[key]), 1e-9)
                                                 for x, y in zip(rows4d, rows1)], lw=1, label=label)
    dx.axhline(1e-5, color="grey", ls=":", lw=1, label="parity standard (1e-5)")
    dx.set_xlabel("step")
    dx.set_ylabel("relative difference, 16 processes vs 1")
    dx.legend(fontsize=8)
    dx.set_title("float32 rounding, summed in another order, grows with training", fontsize=9)
    save(fig, "4d_run_loss.png")


MADE_BY = "./run.sh figures"  # the stamp a committed notebook carries (tests/test_notebook_sources.py checks it)


def source_sha(folder):
    """The SHA-256 of a lesson's source, lessons/NN_topic/NN_topic.py: the stamp names what the outputs came from."""
    import hashlib

    return hashlib.sha256((folder / f"{folder.name}.py").read_bytes()).hexdigest()


def lesson(folder, fast, run=True):
    """Build and execute one lesson's notebook in place; write its figures as figures/NN_k.png, k = 1, 2, ...

    An executed notebook is stamped in its metadata ("picotron": who made it, FAST or full, the source's SHA-256)
    and each image output names its file ("figure": "figures/NN_k.png"), so tests/test_notebook_sources.py can
    prove that a committed notebook is one full run of its current source and that figures/ holds its images.
    `--no-run` writes the figures of the notebook as it is and leaves its stamp alone."""
    import _notebook
    import nbformat

    nb_path, t0 = folder / f"{folder.name}.ipynb", time.perf_counter()
    if run:
        _notebook.build(folder / f"{folder.name}.py", nb_path)
        failed, passed, errors = _notebook.execute(nb_path, fast)
    else:
        failed, passed, errors = _notebook.results(nbformat.read(nb_path, as_version=4))
    number = folder.name[:2]
    for old in HERE.glob(f"{number}_[0-9]*.png"):
        old.unlink()
    nb = nbformat.read(nb_path, as_version=4)
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    for k, output in enumerate(images, 1):
        (HERE / f"{number}_{k}.png").write_bytes(base64.b64decode(output["data"]["image/png"]))
        output.setdefault("metadata", {})["figure"] = f"figures/{number}_{k}.png"
    if run:
        nb.metadata["picotron"] = {"made_by": MADE_BY, "fast": bool(fast), "source_sha256": source_sha(folder),
                                   "checks_hold": passed, "checks_fail": len(failed), "errors": len(errors)}
    nbformat.write(nb, nb_path)
    unsure = _notebook.inconclusive(nb)
    print(f"lesson {folder.name} ({time.perf_counter() - t0:.0f} s, {'FAST' if fast else 'full'}): {passed} checks "
          f"hold, {len(unsure)} inconclusive (the machine was busy: rerun), {len(failed)} fail, {len(errors)} errors; "
          f"wrote figures/{number}_1..{len(images)}.png"
          + ("  (FAST outputs: not for committing)" if fast else ""), flush=True)
    for line in unsure + failed + errors:
        print("   ", line)
    return not (failed or errors)


if __name__ == "__main__":
    os.chdir(_common.ROOT)
    run = "--no-run" not in sys.argv
    wanted = [a for a in sys.argv[1:] if a != "--no-run"]
    folders = [d for d in sorted((_common.ROOT / "lessons").glob("[0-9][0-9]_*")) if d.is_dir()
               and (not wanted or any(d.name.startswith(w) for w in wanted))]
    if not wanted and run:
        main_job()
    if run and (not wanted or "4d" in wanted):
        four_d()
    ok = [lesson(d, _common.FAST, run) for d in folders]
    sys.exit(0 if all(ok) else 1)
