"""Checker for lesson 00's exercises: runs your functions on many inputs against picotron's own roofline
(picotron.plan.hardware: op_cost, roofline) and names the usual slips.

    ./run.sh python lessons/00_gpu_primer/check.py [name ...]          # your lessons/00_gpu_primer/exercise.py
    ./run.sh python lessons/00_gpu_primer/check.py --solutions         # the reference solutions (must pass)
    ./run.sh python lessons/00_gpu_primer/check.py --module my.py      # any file defining the same functions
From the lesson's notebook: `import check as checker; checker.check()` (returns True when everything passes).
Exit status 0 when every check passes, 1 otherwise.
"""
import argparse
import math
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # lessons/: _checker, which puts the repository root on sys.path too

from _checker import check_all, load  # noqa: E402

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


def intensity_slips(m, n, k, elem):
    """What the usual slips give for this shape: {hint: their value}."""
    flops = 2 * m * n * k
    return {
        "forgot the factor 2: each of the k terms of an output is a multiply AND an add": flops / 2 /
        (elem * (m * k + k * n + m * n)),
        "counted C's bytes twice: C is only written, not read (it starts empty)": flops / (elem * (m * k + k * n + 2 * m * n)),
        "left C's bytes out: the result is written to main memory too": flops / (elem * (m * k + k * n)),
        "counted elements, not bytes: multiply the element count by elem": flops / (m * k + k * n + m * n),
        "divided by elem twice, or multiplied the FLOPs by elem": flops / (elem * elem * (m * k + k * n + m * n)),
        "bytes over FLOPs: intensity is FLOPs per byte": elem * (m * k + k * n + m * n) / flops,
    }


def check_intensity(mod, report):
    for m, n, k, elem in SHAPES:
        what = f"intensity(m={m}, n={n}, k={k}, elem={elem})"
        done, got = call(report, what, mod.intensity, m, n, k, elem)
        if not done:
            return
        want = hardware.intensity("matmul", (m, n, k), elem)
        if close(got, want):
            continue
        hint = next((h for h, v in intensity_slips(m, n, k, elem).items() if close(got, v)), "")
        report.fail(what, f"got {got!r}, expected {want:.6g} FLOP/byte" + (f" — {hint}" if hint else ""))
        return
    report.ok("intensity", f": {len(SHAPES)} shapes, e.g. 4096³ in bf16: "
                           f"{hardware.intensity('matmul', (4096, 4096, 4096), 2):.0f} FLOP/byte")


def check_attainable(mod, report):
    for peak, bw in DEVICES:
        for i in INTENSITIES:
            what = f"attainable(peak={peak:.4g}, bandwidth={bw:.4g}, intensity={i})"
            done, got = call(report, what, mod.attainable, peak, bw, i)
            if not done:
                return
            want = hardware.roofline(peak, bw, i)
            if close(got, want):
                continue
            slips = {"took the max: the roof is the LOWER of the two limits (min)": max(peak, bw * i),
                     "bandwidth × intensity alone: above the ridge the peak caps it": bw * i,
                     "the peak alone: below the ridge the bandwidth limits it (bandwidth × intensity)": peak,
                     "divided by the intensity: bytes/s × FLOPs/byte = FLOP/s, multiply": min(peak, bw / i)}
            hint = next((h for h, v in slips.items() if close(got, v)), "")
            report.fail(what, f"got {got!r}, expected {want:.6g} FLOP/s" + (f" — {hint}" if hint else ""))
            return
    ridge = hardware.ridge(*DEVICES[0])
    report.ok("attainable", f": {len(DEVICES) * len(INTENSITIES)} cases; the H100's ridge in bf16 is {ridge:.0f} FLOP/byte")


def check_min_seconds(mod, report):
    for peak, bw in DEVICES:
        for m, n, k, elem in SHAPES:
            flops, moved = hardware.op_cost("matmul", (m, n, k), elem)
            what = f"min_seconds(flops={flops:,}, nbytes={moved:,}, peak={peak:.4g}, bandwidth={bw:.4g})"
            done, got = call(report, what, mod.min_seconds, flops, moved, peak, bw)
            if not done:
                return
            want = flops / hardware.roofline(peak, bw, flops / moved)
            if close(got, want):
                continue
            slips = {"added the two times: overlapped, they do not add; the longer one decides (max)":
                     flops / peak + moved / bw,
                     "took the shorter time: the operation is done only when both its FLOPs and its bytes are (max)":
                     min(flops / peak, moved / bw),
                     "the compute time alone: a memory-bound operation waits for its bytes": flops / peak,
                     "the memory time alone: a compute-bound operation waits for its FLOPs": moved / bw}
            hint = next((h for h, v in slips.items() if close(got, v)), "")
            report.fail(what, f"got {got!r} s, expected {want:.6g} s" + (f" — {hint}" if hint else ""))
            return
    report.ok("min_seconds", f": {len(DEVICES) * len(SHAPES)} cases, = FLOPs / attainable FLOP/s")


CHECKS = {"intensity": check_intensity, "attainable": check_attainable, "min_seconds": check_min_seconds}


def check_one(name, path, report):
    mod = load(path, "ex00")
    if not hasattr(mod, name):
        report.fail(name, f"{Path(path).name} has no function {name}")
        return
    CHECKS[name](mod, report)


def check(names=None, module=None):
    """Check the named exercises (default: all) of `module` (a path; default: your exercise file)."""
    return check_all(names, Path(module).resolve() if module else LEARNER, list(CHECKS), check_one, "ex00")


def main(argv=None):
    p = argparse.ArgumentParser(description="Check lesson 00's exercises.")
    p.add_argument("names", nargs="*", help=f"exercises to check (default all): {', '.join(CHECKS)}")
    p.add_argument("--solutions", action="store_true", help="check the reference solutions")
    p.add_argument("--module", help="check this file instead of lessons/00_gpu_primer/exercise.py")
    args = p.parse_args(argv)
    return 0 if check(args.names, SOLUTIONS if args.solutions else args.module) else 1


if __name__ == "__main__":
    sys.exit(main())
