"""Lesson 00, reference solutions. Try lessons/00_gpu_primer/exercise.py first, then compare:
    ./run.sh python lessons/00_gpu_primer/check.py                 # checks your file
    ./run.sh python lessons/00_gpu_primer/check.py --solutions     # checks this one
"""


def intensity(m, n, k, elem) -> float:
    """FLOPs per byte of C[m, n] = A[m, k] @ B[k, n]."""
    flops = 2 * m * n * k                       # each of the m·n outputs: k multiplies and k adds
    moved = elem * (m * k + k * n + m * n)      # A read, B read, C written: once each, in bytes
    return flops / moved


def attainable(peak, bandwidth, intensity) -> float:
    """min(peak, bandwidth × intensity): the slope of the memory below the ridge, the flat peak above it."""
    return min(peak, bandwidth * intensity)


def min_seconds(flops, nbytes, peak, bandwidth) -> float:
    """Both must be done: the longer of the compute time and the memory time (they overlap, they do not add)."""
    return max(flops / peak, nbytes / bandwidth)
