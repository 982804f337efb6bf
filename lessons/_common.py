"""Tiny helpers shared by every lesson notebook and experiment script.

    FAST            True when PICOTRON_FAST=1: short settings so a notebook runs in ~2 minutes on 2 CPU cores
    ROOT            the repository root (put on sys.path, so `import picotron` works from lessons/)
    run_dir(name)   runs/lessons/<name>/, created
    launch(...)     run a lesson's experiment.py with torchrun on N processes; returns its printed output
    run_experiment(lesson, only, nproc, *args)   a notebook's run(): launch its experiment.py, print its output
                                                 less picotron.train's chatter (TRAINING_CHATTER)
    say(mesh, text)  print on rank 0 only (an experiment's commentary)
    load_json/save_json, load_lesson(name) (import lessons/<name>/experiment.py as a module)
    SIZES, make_cfg(size, **kw), tokens()   the lessons' models (picotron Configs) and the embedded corpus
    cli(lesson, experiments, ...)           the command line every experiment.py shares (--out, --only, --fast)
    saved(name, file, record, t0, rank)     save one experiment's results and say where they went
    environment(mesh, **extra), run_experiments(names, run, file_of, env, ...)   the loop every experiment.py ends with
    show_source(obj, start, stop)   print the lines of a function between two markers
    interactive(draw, controls)     labelled ipywidgets controls above one figure they redraw (a static image headless)
    parity(got, ref)                the parity standard applied to two loss curves (window, drift beyond it)
    parity_checks(label, got, ref)  the ✓/✗ lines a lesson prints for them
    (figures several lessons draw, the parity plot among them: lessons/_plots.py)
    check(name, ok, detail, busy)   print one check line: ✓, ✗, or ? (a timing check the machine was too busy to decide)
    summary() / tally(text)         the lesson's count of ✓, ? and ✗ (printed / read back from its output)
    LoadWindow, others_share(...)   the share of the machine's cores other programs used while something was timed

Where the lessons run, one setting read here and nowhere else (see "Lessons on a GPU pod" in docs/gpu_pods.md):
    PICOTRON_DEVICE   auto (default) | cpu | cuda. auto: cuda when torch sees a GPU, else cpu. launch() hands the
                      choice to every process it starts: cuda + nccl with one GPU per process, or cpu + gloo.
    PICOTRON_NPROC    the processes of a lesson's main run where the lesson lets you choose (LESSONS[..]["choose"]:
                      8, one node's layout, in lessons 02-10; 16 or 8 in 09); unset, each lesson runs its own counts
                      (LESSONS), everywhere. What 8 GPUs should show: lessons/_node.py.
    device(), gpu_count(), on_gpu()    the choice; gpu_count() calls no torch.cuda function but is_available() on a CPU
    nproc(lesson, default)             PICOTRON_NPROC, or the lesson's default
    sized(lesson, settings, fast)      a lesson's CPU settings with its GPU_SETTINGS row on top when on GPUs
    fits(lesson, nproc) / experiment_device(lesson)   refuse, in one sentence, more processes than GPUs
"""
import argparse
import functools
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FAST = os.environ.get("PICOTRON_FAST", "0") == "1"
# OpenMP threads that wait for each other sleep instead of spinning: on a shared machine a spinning thread takes the
# core its partner needs, and a 2-thread run became 2-10x slower on a busy 2-core machine; an idle machine loses little.
# Every experiment imports this module before torch, and launch()'s processes inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# torch.profiler's C++ library (kineto) writes "USDT: ... profiler_start" and "... profiler_stop" to stderr at every
# profile, whatever its log level below 6 (6 silences its errors too; a failed profile still raises in Python).
os.environ.setdefault("KINETO_LOG_LEVEL", "6")


# ------------------------------------------------------------------------ where the lessons run: one setting
DEVICES = ("auto", "cpu", "cuda")

# What each lesson launches (its notebook's torchrun process counts, the same on CPU and GPUs: they are part of the
# lesson) and, where the count is the learner's choice, what PICOTRON_NPROC picks (docs/gpu_pods.md: "Lessons on a GPU pod").
LESSONS = {
    "00_gpu_primer": dict(nproc=(1, 2)),
    "01_single_device": dict(nproc=(1,)),
    "02_collectives": dict(nproc=(2, 3, 4, 8), choose={4: "4 ranks", 8: "8 ranks"}),
    "03_data_parallel": dict(nproc=(1, 2, 4, 8), choose={4: "dp4", 8: "dp8"}),
    "04_zero": dict(nproc=(1, 2, 4, 8), choose={4: "dp4", 8: "dp8"}),
    "05_tensor_parallel": dict(nproc=(1, 2, 4, 8), choose={4: "tp4", 8: "tp8, 8 KV heads"}),
    "06_context_parallel": dict(nproc=(2, 4), choose={8: "cp8"}),
    "07_pipeline_parallel": dict(nproc=(2,), choose={8: "pp8, 16 layers"}),
    "08_expert_parallel": dict(nproc=(2, 4), choose={8: "dp8-ep8, 8 experts"}),
    "09_all_together": dict(nproc=(8, 16), choose={16: "dp2-pp2-cp2-tp2", 8: "dp1-pp2-cp2-tp2"}),
    "10_checkpoints_and_faults": dict(nproc=(2,), choose={8: "dp8, tp2-dp4, pp2-dp4"}),
    "11_precision_and_kernels": dict(nproc=(2,)),
}

# On GPUs a lesson's settings change by its row here and by nothing else; every check is the CPU lesson's. The timed
# experiments grow (a CPU-sized step is all launch latency on a GPU); the experiments that count bytes or compare
# losses keep their CPU sizes (what they check does not depend on size). A row's "fast" entries apply in FAST mode.
GPU_SETTINGS = {
    "00_gpu_primer": dict(  # bf16 matmuls up to 8192 (the tensor cores), working sets past the 50 MB L2, a larger step
        dtype="bf16", mm_sizes=(256, 512, 1024, 2048, 4096, 8192), big_mib=1024, tile_rows=4096,
        sweep_bytes=[64 * 2**10 * 2**k for k in range(16)], launch_n=4096, launch_count=50, trace_seq_len=512,
        trace_micro_batch_size=8, overlap_n=8192, overlap_reps=20, overlap_mib=512, overlap_dtype="bf16",
        fast=dict(mm_sizes=(512, 2048, 8192), sweep_bytes=[64 * 2**10 * 4**k for k in range(8)])),
    "01_single_device": dict(  # throughput in bf16 at s = 1024, and the SmolLM models on top of the lessons' three
        throughput_sizes=("tiny", "small", "medium", "smollm-135m", "smollm-360m"), throughput_seq_len=1024,
        throughput_micro_batch_size=16, throughput_steps=20, throughput_dtype="bf16",
        fast=dict(throughput_sizes=("tiny", "small"))),
    "02_collectives": dict(  # message sizes up to 256 MiB (nccl-tests' range), where NVLink reaches its bandwidth
        sizes=[2**10 * 2**k for k in range(19)], ring_sizes=[2**10 * 2**k for k in range(19)],
        fast=dict(sizes=[2**10 * 4**k for k in range(10)], ring_sizes=[2**10 * 4**k for k in range(10)])),
    "03_data_parallel": dict(  # the timed runs and the scaling runs: the medium model, 8 x 512 tokens per rank
        size="medium", seq_len=512, micro_batch_size=8, steps=50, warmup=3,
        scaling_size="medium", scaling_seq_len=512, scaling_micro_batch_size=8, fast=dict(steps=20)),
    "04_zero": dict(size="medium", tl_seq_len=512, tl_micro_batch_size=8),
    "05_tensor_parallel": dict(size="medium", seq_len=1024, micro_batch_size=8, steps=40, warmup=3, dtensor_steps=100,
                               parity_seq_len=128, fast=dict(steps=10, dtensor_steps=20)),
    "06_context_parallel": dict(balance_seq=4096, train_seq=4096, fast=dict(train_seq=1024)),
    "07_pipeline_parallel": dict(size="medium", seq_len=512, micro_batch_size=4, max_steps=16, warmup=2,
                                 parity_steps=10, parity_seq_len=64, fast=dict(max_steps=10)),
    "08_expert_parallel": dict(seq_len=256),
    "09_all_together": dict(seq_len=512),
    "10_checkpoints_and_faults": dict(),  # what saving costs is bytes and the file system's time: the same sizes
    "11_precision_and_kernels": dict(),  # the notebook's own measurements run in its kernel, on the CPU
}


class DoesNotFit(RuntimeError):
    """A lesson asked for more processes than this machine has GPUs (the message is one sentence saying what to do)."""


def device_setting():
    """PICOTRON_DEVICE: "auto" (the default), "cpu" or "cuda"; anything else is refused in one sentence."""
    value = os.environ.get("PICOTRON_DEVICE", "").strip().lower() or "auto"
    if value not in DEVICES:
        raise ValueError(f"PICOTRON_DEVICE={os.environ['PICOTRON_DEVICE']!r} is not one of {', '.join(DEVICES)}; "
                         f"unset it (auto: cuda when torch sees a GPU) or pick one of them.")
    return value


def gpu_count():
    """The GPUs torch sees; 0 when PICOTRON_DEVICE=cpu or without CUDA (then no torch.cuda function but
    is_available() is called)."""
    if device_setting() == "cpu":
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device():
    """"cuda" or "cpu": where the lessons' processes run (PICOTRON_DEVICE, auto: cuda when torch sees a GPU)."""
    setting, n = device_setting(), gpu_count()
    if setting == "cuda" and n == 0:
        raise RuntimeError("PICOTRON_DEVICE=cuda but torch sees no CUDA GPU; unset it or set PICOTRON_DEVICE=cpu.")
    return "cuda" if n else "cpu"


def on_gpu():
    return device() == "cuda"


def nproc(lesson, default):
    """PICOTRON_NPROC if set (one of the counts `lesson` lets you choose, LESSONS[lesson]["choose"]), else `default`.
    Only the lessons with a choice read it; the others' counts are part of the lesson."""
    value = os.environ.get("PICOTRON_NPROC", "").strip()
    if not value:
        return default
    choose = LESSONS[lesson]["choose"]
    if not value.isdigit() or int(value) not in choose:
        counts = " or ".join(f"{n} ({name})" for n, name in sorted(choose.items()))
        raise ValueError(f"PICOTRON_NPROC={value}: lesson {lesson[:2]} runs {counts} processes; pick one, or unset "
                         f"it for {default}.")
    return int(value)


def sized(lesson, settings, fast=False, device_type=None):
    """`settings` (a lesson's CPU settings, FAST or full) with the lesson's GPU_SETTINGS row on top when it runs on
    GPUs (`device_type`: the mesh's, else device())."""
    if (device_type or device()) != "cuda":
        return settings
    row = dict(GPU_SETTINGS[lesson])
    faster = row.pop("fast", {})
    return {**settings, **row, **(faster if fast else {})}


def does_not_fit(lesson, processes, gpus):
    """The one sentence for `processes` processes of `lesson` on a machine with `gpus` GPUs."""
    choose = {n: name for n, name in LESSONS.get(lesson, {}).get("choose", {}).items() if n <= gpus}
    smaller = "".join(f", PICOTRON_NPROC={n} for its {n}-process layout ({name})" for n, name in sorted(choose.items()))
    if processes > 8 and gpus and processes % gpus == 0:  # more than a node holds: torchrun on several nodes
        elsewhere = f"run its experiment on {processes // gpus} nodes (docs/gpu_pods.md: Lessons on a GPU pod)"
    else:
        elsewhere = f"run it on a machine with at least {processes} GPUs"
    return (f"lesson {lesson[:2]} runs {processes} processes; this machine has {gpus} GPU{'s' if gpus != 1 else ''}: "
            f"set PICOTRON_DEVICE=cpu to run it on CPU{smaller}, or {elsewhere}.")


def fits(lesson, processes):
    """Raise DoesNotFit (one sentence) if `lesson` would start more processes than there are GPUs, on GPUs."""
    if device() == "cuda" and processes > gpu_count():
        raise DoesNotFit(does_not_fit(lesson, processes, gpu_count()))


def experiment_device(lesson):
    """The device an experiment's processes use: what launch() chose (PICOTRON_DEVICE; started by hand with torchrun:
    the same setting). More processes on this node than GPUs: the one sentence, on the node's first process, and exit."""
    dev = device()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if dev == "cuda" and local > gpu_count():
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(does_not_fit(lesson, local, gpu_count()), file=sys.stderr, flush=True)
        sys.exit(2)
    return dev


SIZES = {"small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4),  # 3.3 M parameters
         "medium": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6)}


def make_cfg(size="small", **kw):
    """A picotron Config of the lessons' small or medium model (no sampling, no evaluation), with `kw` on top."""
    from picotron.config import Config

    return Config(**{"preset": "tiny", "sample_tokens": 0, "eval_every": 0, **SIZES[size], **kw})


@functools.lru_cache(maxsize=1)
def tokens():
    """The embedded Shakespeare as byte tokens (what picotron.train reads), loaded once per process."""
    from picotron import data

    tok = data.get_tokenizer("byte")
    return data.TokenData(tok.encode_tensor(data.load_text("shakespeare")), tok.vocab_size)


def cli(lesson, experiments, doc, default=None, argv=None, extra=(), namespace=None):
    """Parse an experiment script's command line: --out (runs/lessons/<lesson>/), --only (a comma-separated subset
    of `experiments`, default `default` or all), --fast, plus `extra` (a list of (flags, kwargs) for add_argument).
    A name outside `experiments` is refused with the list. Returns (args, names, out), the folder created."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "runs" / "lessons" / lesson))
    p.add_argument("--only", default=",".join(default or experiments), help=f"comma-separated subset of {experiments}")
    p.add_argument("--fast", action="store_true", default=FAST, help="short settings (or PICOTRON_FAST=1)")
    for flags, kwargs in extra:
        p.add_argument(*flags, **kwargs)
    args = p.parse_args(argv, namespace=namespace)
    names = args.only.split(",")
    if any(name not in experiments for name in names):
        p.error(f"--only {args.only!r}: pick a comma-separated subset of {', '.join(experiments)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return args, names, out


def saved(name, file, record, t0, rank=0):
    """On rank 0: write `record` (plus the seconds since t0) to `file` and print `== name: N s -> file`."""
    if rank == 0:
        seconds = time.perf_counter() - t0
        save_json(dict(record, seconds=seconds), file)
        path = os.path.relpath(file)  # short (and free of home directories) in notebooks
        print(f"== {name}: {seconds:.1f} s -> {file if path.startswith('..') else path}", flush=True)


def environment(mesh, **extra):
    """What every saved experiment records about where it ran (device, backend, world size, torch, threads, cores),
    plus the lesson's own `extra` fields (its settings, ...)."""
    import torch

    return dict(device=str(mesh.device), backend=mesh.backend, world_size=mesh.world_size, torch=torch.__version__,
                threads=torch.get_num_threads(), cores=os.cpu_count(), **extra)


def run_experiments(names, run, file_of, env, rank=0, skip=lambda name: None, after=lambda name: None, say=print):
    """The loop every experiment.py ends with: for each name, `skip(name)` (a reason to skip it, told with `say`, or
    None), then `result = run(name)`, saved with `env` to `file_of(name)` on rank 0 (`saved`), then `after(name)`."""
    for name in names:
        why = skip(name)
        if why:
            say(f"== {name}: {why}; skipped")
            continue
        t0 = time.perf_counter()
        result = run(name)
        saved(name, file_of(name), dict(env, results=result), t0, rank)
        after(name)


def run_dir(name):
    path = ROOT / "runs" / "lessons" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_json(obj, path):
    Path(path).write_text(json.dumps(obj, indent=1))


def load_json(path):
    return json.loads(Path(path).read_text())


def load_lesson(name):
    """Import lessons/<name>/experiment.py (the experiment of lesson <name>, e.g. "03_data_parallel") as a module."""
    spec = importlib.util.spec_from_file_location(f"lesson_{name}", ROOT / "lessons" / name / "experiment.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch(script, args=(), nproc=1, timeout_s=3600, quiet=False):
    """`torchrun --nproc_per_node nproc lessons/<script> args` (script: e.g. "03_data_parallel/experiment.py"), with the CPU's cores shared between the
    processes (OMP_NUM_THREADS = cores // nproc: more threads than cores makes CPU runs 10x slower), on device()
    (PICOTRON_DEVICE): on GPUs one per process, and more processes than GPUs is refused in one sentence (DoesNotFit).
    Prints the script's output (unless quiet) and returns it; raises with its tail if it fails or hangs."""
    from picotron.launch import run_torchrun

    dev = device()  # PICOTRON_DEVICE, resolved here once: every process of the run gets the same answer
    fits(Path(script).parts[0], nproc)
    threads = max(1, (os.cpu_count() or 1) // nproc)
    # paths inside the repository go relative to it (the cwd of the run), so printed paths stay short and free of
    # home directories in a notebook's outputs
    args = [str(a.relative_to(ROOT)) if isinstance(a, Path) and ROOT in a.parents else str(a) for a in args]
    result = run_torchrun(ROOT / "lessons" / script, nproc, args, timeout_s=timeout_s,
                          env={"OMP_NUM_THREADS": str(threads), "PICOTRON_DEVICE": dev}, cwd=ROOT)
    if not quiet:
        print(result.stdout.rstrip())
    return result.stdout


# The lines a lesson's notebook leaves out of an experiment's printed output: picotron.train's per-step lines and its
# banner, and its closing summary ("done: loss ... -> ..., tokens/s, MFU").
TRAINING_CHATTER = ("step ", "picotron |", "done: ")


def run_experiment(lesson, only, nproc=2, *args, hide=TRAINING_CHATTER):
    """What a lesson's notebook calls run(): `torchrun --nproc_per_node nproc lessons/<lesson>/experiment.py --out
    runs/lessons/<lesson> --only <only> [args]` (launch), then prints what it printed, less the lines that start with
    one of `hide`. The experiment writes its results there as JSON, which the notebook then reads and plots."""
    out = launch(f"{lesson}/experiment.py", ["--out", run_dir(lesson), "--only", only, *args], nproc=nproc, quiet=True)
    print("\n".join(line for line in out.splitlines() if not line.startswith(hide)))


def say(mesh, text):
    """Print `text` on rank 0 only (an experiment's running commentary, once for all its processes)."""
    if mesh.rank == 0:
        print(text, flush=True)


def show_source(obj, start=None, stop=None):
    """Print the source of a function or class, optionally only from the first line containing `start`
    to the first later line containing `stop` (inclusive): quoting the code as it is, never a copy."""
    import inspect

    lines = inspect.getsource(obj).splitlines()
    first = next((i for i, line in enumerate(lines) if start and start in line), 0)
    last = next((i for i, line in enumerate(lines) if i >= first and stop and stop in line), len(lines) - 1)
    print("\n".join(lines[first:last + 1]))


HEADLESS = "PICOTRON_HEADLESS"  # "1" in the kernels lessons/_notebook.py starts: committed notebooks and tests


def interactive(draw, controls):
    """`controls(ipywidgets)` -> {draw's argument: widget}, above one figure drawn by `draw(**their values)`.

    In Jupyter (a live kernel): every control labelled (its `description`, else its argument's name), and under them
    the figure, drawn first with the defaults, then again after a change. Sliders send their value when released
    (continuous_update=False), and a redraw waits until the kernel has taken the changes that arrived meanwhile:
    one slow draw (lesson 09's planner search) for the latest values, not one per value on the way.
    In a notebook executed without a browser (lessons/_notebook.py sets PICOTRON_HEADLESS=1: the committed notebooks,
    the tests): the default figure only, a plain image that static viewers (GitHub) show; the controls are built
    (so a broken one fails the tests) and closed."""
    try:
        import ipywidgets as w
        from IPython.display import display
    except ImportError:
        draw()
        print("pip install ipywidgets for the interactive version")
        return
    widgets = controls(w)
    for name, c in widgets.items():
        c.description = c.description or name
        if hasattr(c, "continuous_update"):
            c.continuous_update = False
    width = f"{0.6 * max(len(c.description) for c in widgets.values()) + 1:.1f}em"  # every label whole, aligned
    for c in widgets.values():
        c.style.description_width = width
    if os.environ.get(HEADLESS) == "1":
        draw()
        for c in widgets.values():
            c.close()
        return
    figure, pending = w.Output(), []

    def redraw():
        pending.clear()
        figure.outputs = _outputs_of(draw, {name: c.value for name, c in widgets.items()})  # one swap, no flicker

    def changed(_):
        import asyncio

        try:  # on the kernel's event loop, a moment later: the changes queued behind this one are taken first
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (not an ipykernel): draw now
            return redraw()
        if not pending:  # a redraw is already waiting: it will read the latest values
            pending.append(loop.call_later(0.1, redraw))
    for c in widgets.values():
        c.observe(changed, "value")
    display(w.VBox([*widgets.values(), figure]))
    redraw()


def _outputs_of(draw, values):
    """What draw(**values) prints and shows (plt.show's figures), in order, as notebook outputs, its error's traceback
    included. (Drawing inside `with output_widget:` instead works only while the kernel handles the browser's message:
    the browser drops what a redraw run later, on the event loop, shows there.)"""
    import contextlib
    import io
    import traceback

    from IPython import get_ipython
    from IPython.core.displaypub import CapturingDisplayPublisher

    outputs, text = [], io.StringIO()

    def printed():
        if text.getvalue():
            outputs.append({"output_type": "stream", "name": "stdout", "text": text.getvalue()})
            text.seek(0), text.truncate()

    class Shown(CapturingDisplayPublisher):
        def publish(self, data, metadata=None, *args, **kwargs):
            printed()
            outputs.append({"output_type": "display_data", "data": data, "metadata": metadata or {}})

    shell = get_ipython()
    shell.display_pub, kept = Shown(), shell.display_pub
    try:
        with contextlib.redirect_stdout(text):
            draw(**values)
    except Exception:  # noqa: BLE001 - shown under the controls, as a cell shows its error
        text.write(traceback.format_exc())
    finally:
        shell.display_pub = kept
    printed()
    return tuple(outputs)


# ------------------------------------------------------------------------- what the experiment scripts share
def gather(obj, mesh):
    """Every rank's `obj` (anything picklable), as a list by rank, on every rank."""
    import torch.distributed as dist

    out = [None] * mesh.world_size
    dist.all_gather_object(out, obj)
    return out


def run_interleaved(variants, steps, warmup, group):
    """warmup + steps steps of every variant (objects with .step(step, record)), one step of each in turn, the
    order rotating every step and a barrier before each: slow drift of a shared machine hits all alike. Returns the
    share of the machine's cores other programs used during the recorded steps (others_share; the same on every
    rank of `group`): what a timing check reads to tell a busy machine."""
    import torch.distributed as dist

    window = None
    for s in range(warmup + steps):
        if s == warmup:
            window = LoadWindow()
        k = s % len(variants)
        for v in variants[k:] + variants[:k]:
            dist.barrier(group)
            v.step(s + 1, record=s >= warmup)
    load = window.stop() if window else LoadWindow().stop()
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, load, group=group)
    return others_share(every)


def union_length(intervals):
    """Total length covered by a list of (start, end) intervals, overlaps counted once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


# ------------------------------------------------------------------- checks, and a machine too busy to time
# A check prints one line: "✓ name: detail" when it holds, "✗ name: detail" when it does not. A check of a *time*
# (a bubble, a balance, an overlap) may instead print "? name: detail — inconclusive: the machine was busy (...),
# rerun": only when it missed AND a quantity measured during that very measurement (printed in the line) shows that
# other programs took the cores. Parity, bytes, counts and memory never get the third mark: busy or not, they hold.
PASS, INCONCLUSIVE, FAIL = "✓", "?", "✗"
MARKS = (PASS, INCONCLUSIVE, FAIL)
# other programs' share of the machine's cores (LoadWindow) above which a timing check that missed is inconclusive:
# a quiet machine measures under 5% (a 2-core laptop with a browser and Jupyter idling: a few percent)
BUSY_SHARE = 0.10
_counts = {mark: 0 for mark in MARKS}


def check(name, ok, detail, busy=None):
    """Print one check line and count it. ✓ if `ok`; otherwise ✗, unless `busy` (given only by timing checks) is a
    short phrase naming the measured disturbance, e.g. busy_reason(share): then "?" and "inconclusive: the machine was
    busy (<busy>), rerun". Returns the mark."""
    mark = PASS if ok else INCONCLUSIVE if busy else FAIL
    _counts[mark] += 1
    tail = f" — inconclusive: the machine was busy ({busy}), rerun" if mark == INCONCLUSIVE else ""
    print(f"{mark} {name}: {detail}{tail}")
    return mark


def busy_reason(share, limit=BUSY_SHARE, what="while it was measured"):
    """The phrase check() prints as `busy` when other programs' measured share of the cores passes `limit`, else
    None (then a missed timing check is ✗)."""
    if share is None or share < limit:
        return None
    return f"other programs used {share:.0%} of the {os.cpu_count()} cores {what}, above {limit:.0%}"


def summary():
    """Print the lesson's summary line: its checks (those check() printed in this process), counted by mark."""
    c = _counts
    print(f"checks: {c[PASS]} {PASS} hold, {c[INCONCLUSIVE]} {INCONCLUSIVE} inconclusive (the machine was busy: rerun "
          f"them), {c[FAIL]} {FAIL} fail")


def tally(text):
    """{"passed": n, "inconclusive": [lines], "failed": [lines]} of the check lines in a lesson's printed output."""
    lines = text.splitlines()
    return dict(passed=sum(line.startswith(PASS + " ") for line in lines),
                inconclusive=[line for line in lines if line.startswith(INCONCLUSIVE + " ")],
                failed=[line for line in lines if line.startswith(FAIL + " ")])


def machine_busy_seconds():
    """Core-seconds the machine's cores have been busy since boot, all processes together (Linux: /proc/stat;
    steal, time a hypervisor gave the core to another guest, counts as busy), or None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user..steal (guest time is inside user)


class LoadWindow:
    """What a process needs to tell, afterwards, how much of the machine other programs used during a window:
    `start()`, then `stop()` -> {wall, busy (the machine's busy core-seconds, None if unknown), own (this process's
    CPU seconds, all its threads), load (1-minute load average, the fallback)}. Gather every process's stop() and
    hand the list to others_share()."""

    def __init__(self):
        self.start()

    def start(self):
        self.t0, self.b0, self.c0 = time.perf_counter(), machine_busy_seconds(), time.process_time()
        return self

    def stop(self):
        b1 = machine_busy_seconds()
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        return dict(wall=time.perf_counter() - self.t0, busy=None if b1 is None or self.b0 is None else b1 - self.b0,
                    own=time.process_time() - self.c0, load=load)


def others_share(windows, cores=None):
    """Other programs' share of the machine's cores over one window measured by every process of ours
    (LoadWindow.stop() of each): (busy core-seconds - our processes' CPU seconds) / (cores x wall), in [0, 1].
    Without /proc/stat: the 1-minute load average beyond our processes, per core (coarser)."""
    cores = cores or os.cpu_count() or 1
    wall = max(w["wall"] for w in windows)
    if wall <= 0:
        return 0.0
    if all(w["busy"] is not None for w in windows):
        busy = statistics.median(w["busy"] for w in windows)  # the same machine, read by each process
        share = (busy - sum(w["own"] for w in windows)) / (cores * wall)
    elif windows[0]["load"] is not None:
        share = (windows[0]["load"] - len(windows)) / cores
    else:
        return None
    return min(1.0, max(0.0, share))


# ------------------------------------------------------------------------------- the parity standard
# docs/reference.md#parity-standard: fp32, same seed, same global batch: the per-step loss within PARITY_TOL relative
# for the first PARITY_STEPS steps. Later steps drift apart (summation order differs; Adam amplifies it), so a
# lesson that runs longer reports that drift against DRIFT_BOUND, a looser bound it states, not as parity.
PARITY_TOL, PARITY_STEPS, DRIFT_BOUND = 1e-5, 10, 1e-3


def rel_diffs(got, ref):
    """|got - ref| / |ref|, step by step."""
    return [abs(a - b) / abs(b) for a, b in zip(got, ref)]


def parity(got, ref, window=PARITY_STEPS, tol=PARITY_TOL, bound=DRIFT_BOUND):
    """The parity standard applied to two per-step loss curves.

    Returns window (steps compared), worst (max relative difference over them), ok (worst <= tol and at least
    `window` steps), and, for the steps after the window: n_beyond, beyond (their max, None if none), drift_ok
    (beyond <= bound), first_over (the first step, 1-based, whose difference exceeds tol; None if none)."""
    d = rel_diffs(got, ref)
    head, tail = d[:window], d[window:]
    worst = max(head) if head else float("inf")
    beyond = max(tail) if tail else None
    first_over = next((i + 1 for i, x in enumerate(d) if x > tol), None)
    return dict(window=len(head), worst=worst, ok=len(head) >= window and worst <= tol, n_steps=len(d),
                n_beyond=len(tail), beyond=beyond, drift_ok=beyond is None or beyond <= bound, first_over=first_over,
                tol=tol, bound=bound)


def parity_checks(label, got, ref, where="lesson 03, section 5"):
    """The check lines a lesson prints for one pair of loss curves: (name, ok, detail) for the parity window and,
    if the run is longer, for the drift after it (`where`: where the lesson explains that drift)."""
    p = parity(got, ref)
    lines = [(f"parity {label}", p["ok"], f"per-step loss within {p['tol']:.0e} relative over steps 1-{PARITY_STEPS} "
              f"(the parity standard): max {p['worst']:.1e} over the {p['window']} steps compared")]
    if p["n_beyond"]:
        lines.append((f"drift {label}", p["drift_ok"], f"steps {p['window'] + 1}-{p['n_steps']} within {p['bound']:.0e} "
                      f"relative (a bound on rounding amplified by AdamW, not parity; {where}): max {p['beyond']:.1e}"))
    return lines
