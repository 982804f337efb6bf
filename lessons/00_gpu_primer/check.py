"""Checker for lesson 00's exercises: runs your functions on many inputs against picotron's own roofline
(picotron.plan.hardware: op_cost, roofline) and names the usual slips.

    ./run.sh python lessons/00_gpu_primer/check.py [name ...]          # your lessons/00_gpu_primer/exercise.py
    ./run.sh python lessons/00_gpu_primer/check.py --solutions         # the reference solutions (must pass)
    ./run.sh python lessons/00_gpu_primer/check.py --module my.py      # any file defining the same functions
From the lesson's notebook: `import check as checker; checker.check()` (returns True when everything passes).
Exit status 0 when every check passes, 1 otherwise.
"""
import math
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # lessons/: _checker, which puts the repository root on sys.path too

from _checker import entry_points, load  # noqa: E402

from picotron.plan import hardware  # noqa: E402

LEARNER = HERE / "exercise.py"
SOLUTIONS = HERE / "solution.py"
# (m, n, k, elem): square and not, fp32 and bf16, a matrix-vector product (m = 1), Llama-3-8B's MLP on 4,096 tokens
SHAPES = [(512, 512, 512, 4), (4096, 4096, 4096, 2), (1, 4096, 4096, 2), (4096, 14336, 4096, 2), (128, 64, 1000, 4),
          (3, 5, 7, 2)]
# (peak FLOP/s, bandwidth B/s): an H100 SXM in bf16 (datasheet), this kind of CPU core (measured in the lesson)
DEVICES = [(hardware.GPUS["h100-80gb"].peak, hardware.HBM_BANDWIDTH["h100-80gb"]), (80e9, 20e9)]
INTENSITIES = [0.0833, 0.5, 3.0, 100.0, 295.0, 1000.0]


def close(a, b):
    return isinstance(a, (int, float)) and not isinstance(a, bool) and math.isclose(a, b, rel_tol=1e-9)


def call(report, what, fn, *args):
    """Run the learner's function; an exception becomes a one-line failure naming the line."""
    try:
        return True, fn(*args)
    except NotImplementedError as e:
        report.fail(what, f"NotImplementedError: {e or 'not written yet'}")
    except Exception as e:  # noqa: BLE001 - any bug in the learner's code is a failed check, not a crash
        line = traceback.extract_tb(e.__traceback__)[-1]
        report.fail(what, f"{type(e).__name__}: {e} (line {line.lineno}: {line.line})")
    return False, None


def judge(report, cases, fn, want, slips, unit):
    """Run the learner's `fn` on every (what, args) of `cases` against `want(*args)`. On a wrong answer, report the
    first case it got wrong, with the hint of the slip (`slips`: {hint: what that slip computes}) that gives every
    answer it returned (else every wrong one): one slip can agree with the reference on some cases. True if all hold."""
    results = []
    for what, args in cases:
        done, got = call(report, what, fn, *args)
        if not done:
            return False
        results.append((args, got, what))
    wrong = [r for r in results if not close(r[1], want(*r[0]))]
    if not wrong:
        return True
    hint = next((h for group in (results, wrong) for h, f in slips.items()
                 if all(close(got, f(*args)) for args, got, _ in group)), "")
    args, got, what = wrong[0]
    report.fail(what, f"got {got!r}, expected {want(*args):.6g} {unit}" + (f" — {hint}" if hint else ""))
    return False


def _bytes(m, n, k):
    return m * k + k * n + m * n  # elements of A, B and C


INTENSITY_SLIPS = {
    "forgot the factor 2: each of the k terms of an output is a multiply AND an add":
        lambda m, n, k, e: m * n * k / (e * _bytes(m, n, k)),
    "counted C's bytes twice: C is only written, not read (it starts empty)":
        lambda m, n, k, e: 2 * m * n * k / (e * (_bytes(m, n, k) + m * n)),
    "left C's bytes out: the result is written to main memory too":
        lambda m, n, k, e: 2 * m * n * k / (e * (m * k + k * n)),
    "counted elements, not bytes: multiply the element count by elem":
        lambda m, n, k, e: 2 * m * n * k / _bytes(m, n, k),
    "divided by elem twice, or multiplied the FLOPs by elem":
        lambda m, n, k, e: 2 * m * n * k / (e * e * _bytes(m, n, k)),
    "bytes over FLOPs: intensity is FLOPs per byte": lambda m, n, k, e: e * _bytes(m, n, k) / (2 * m * n * k),
}
ATTAINABLE_SLIPS = {
    "took the max: the roof is the LOWER of the two limits (min)": lambda p, b, i: max(p, b * i),
    "bandwidth × intensity alone: above the ridge the peak caps it": lambda p, b, i: b * i,
    "the peak alone: below the ridge the bandwidth limits it (bandwidth × intensity)": lambda p, b, i: p,
    "divided by the intensity: bytes/s × FLOPs/byte = FLOP/s, multiply": lambda p, b, i: min(p, b / i),
}
SECONDS_SLIPS = {
    "added the two times: overlapped, they do not add; the longer one decides (max)": lambda f, q, p, b: f / p + q / b,
    "took the shorter time: the operation is done only when both its FLOPs and its bytes are (max)":
        lambda f, q, p, b: min(f / p, q / b),
    "the compute time alone: a memory-bound operation waits for its bytes": lambda f, q, p, b: f / p,
    "the memory time alone: a compute-bound operation waits for its FLOPs": lambda f, q, p, b: q / b,
}


def check_intensity(mod, report):
    cases = [(f"intensity(m={m}, n={n}, k={k}, elem={e})", (m, n, k, e)) for m, n, k, e in SHAPES]
    if judge(report, cases, mod.intensity, lambda m, n, k, e: hardware.intensity("matmul", (m, n, k), e),
             INTENSITY_SLIPS, "FLOP/byte"):
        report.ok("intensity", f": {len(SHAPES)} shapes, e.g. 4096³ in bf16: "
                               f"{hardware.intensity('matmul', (4096, 4096, 4096), 2):.0f} FLOP/byte")


def check_attainable(mod, report):
    cases = [(f"attainable(peak={p:.4g}, bandwidth={b:.4g}, intensity={i})", (p, b, i))
             for p, b in DEVICES for i in INTENSITIES]
    if judge(report, cases, mod.attainable, hardware.roofline, ATTAINABLE_SLIPS, "FLOP/s"):
        report.ok("attainable", f": {len(cases)} cases; the H100's ridge in bf16 is "
                                f"{hardware.ridge(*DEVICES[0]):.0f} FLOP/byte")


def check_min_seconds(mod, report):
    cases = []
    for p, b in DEVICES:
        for m, n, k, e in SHAPES:
            f, q = hardware.op_cost("matmul", (m, n, k), e)
            cases.append((f"min_seconds(flops={f:,}, nbytes={q:,}, peak={p:.4g}, bandwidth={b:.4g})", (f, q, p, b)))
    if judge(report, cases, mod.min_seconds, lambda f, q, p, b: f / hardware.roofline(p, b, f / q), SECONDS_SLIPS, "s"):
        report.ok("min_seconds", f": {len(cases)} cases, = FLOPs / attainable FLOP/s")


CHECKS = {"intensity": check_intensity, "attainable": check_attainable, "min_seconds": check_min_seconds}


def check_one(name, path, report, timeout_s=None):  # in this process: no timeout to apply
    mod = load(path, "ex00")
    if not hasattr(mod, name):
        report.fail(name, f"{Path(path).name} has no function {name}")
        return
    CHECKS[name](mod, report)


check, main = entry_points("Check lesson 00's exercises (in this process).", list(CHECKS), check_one, LEARNER,
                           SOLUTIONS, None, "ex00")


if __name__ == "__main__":
    sys.exit(main())
