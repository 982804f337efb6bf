"""Lesson 00 exercises: write each function, then run the checker
    ./run.sh python lessons/00_gpu_primer/check.py                 # all exercises
    ./run.sh python lessons/00_gpu_primer/check.py intensity       # just one
It runs your function on many inputs against the reference and names the usual slips. The lesson notebook
(lessons/00_gpu_primer/00_gpu_primer.ipynb, section 1) has everything you need; the solutions are in solution.py
(look after trying).
"""


def intensity(m, n, k, elem) -> float:
    """Arithmetic intensity, FLOPs per byte, of C = A @ B with A of shape m×k and B of shape k×n, each element `elem`
    bytes (4 for fp32, 2 for bf16): the FLOPs of the product over the bytes moved if A and B are each read once from
    main memory and C is written once."""
    raise NotImplementedError("not written yet")


def attainable(peak, bandwidth, intensity) -> float:
    """The roofline: the most FLOP/s an operation of `intensity` FLOPs per byte can attain on a device of `peak`
    FLOP/s and `bandwidth` bytes/s of main memory."""
    raise NotImplementedError("not written yet")


def min_seconds(flops, nbytes, peak, bandwidth) -> float:
    """The least time an operation of `flops` FLOPs that moves `nbytes` bytes can take on that device, if its
    computing and its memory traffic overlap perfectly."""
    raise NotImplementedError("not written yet")
