"""The accelerators a plan is made for: `Hardware` (a peak, a memory, the links inside a node and across) and the
`GPUS` table of datasheet figures with their sources; `usable` keeps the headroom free.

Headroom: a layout may fill only 1 − HEADROOM (0.9) of each GPU's memory by default (`usable`; `--headroom 0.2`
keeps 20% free, `--headroom 0` none): the memory model (picotron.planner) counts the parameters, gradients, optimizer
state and what autograd keeps, not the CUDA context, NCCL's buffers, the allocator's fragmentation or the
temporaries, which take several GiB of an 80 GB card. The header of every answer says how much is usable.
`--published` judges the published runs by the same rule and prints each one's margin (plan.published).
"""
from dataclasses import dataclass, replace

GiB = 1024 ** 3
MiB = 1024 ** 2
# Achieved / datasheet FLOP/s of a layer's kernels (matmuls, attention, norms, elementwise): one round value for
# every prediction, not fitted per run. A large bf16 matmul alone reaches about 0.8 of the H100's datasheet peak.
EFFICIENCY = 0.6


@dataclass(frozen=True)
class Hardware:
    """One kind of accelerator and its links. peak: dense bf16 FLOP/s (fp32 on a CPU: what it measured); memory: the
    bytes a process sees (nvidia-smi's total); α: seconds per ring step; bw: bytes/s per device and direction."""
    name: str
    peak: float
    memory: float
    gpus_per_node: int = 8
    intra_alpha: float = 5e-6
    intra_bw: float = 300e9
    inter_alpha: float = 10e-6
    inter_bw: float = 25e9
    efficiency: float = EFFICIENCY
    source: str = ""


GPUS = {  # datasheet dense bf16 peaks, memory as nvidia-smi / torch report it, NVLink per direction, network per GPU
    "a100-40gb": Hardware("A100 40GB SXM", 312e12, 40537 * MiB, 8, 5e-6, 300e9, 10e-6, 25e9,
                          source="NVIDIA A100 datasheet (312 TFLOP/s bf16 dense; NVLink 3: 600 GB/s both ways; nvidia-smi "
                                 "shows 40,537 MiB); DGX A100: 8 x 200 Gb/s HDR InfiniBand per node"),
    "a100-80gb": Hardware("A100 80GB SXM", 312e12, 85_056_798_720, 8, 5e-6, 300e9, 10e-6, 25e9,
                          source="NVIDIA A100 datasheet (torch reports 85,056,798,720 bytes = 79.2 GiB); DGX A100 / "
                                 "Selene: 8 x 200 Gb/s HDR InfiniBand per node"),
    "h100-80gb": Hardware("H100 80GB SXM", 989.5e12, 81559 * MiB, 8, 5e-6, 450e9, 10e-6, 50e9,
                          source="NVIDIA H100 datasheet (989.5 TFLOP/s bf16 dense; NVLink 4: 900 GB/s both ways; "
                                 "nvidia-smi shows 81,559 MiB); 400 Gb/s InfiniBand or RoCE per GPU"),
    "h200": Hardware("H200 141GB SXM", 989.5e12, 143771 * MiB, 8, 5e-6, 450e9, 10e-6, 50e9,
                     source="NVIDIA H200 datasheet (H100's compute, 141 GB HBM3e; nvidia-smi shows 143,771 MiB); "
                            "400 Gb/s per GPU"),
}


# Of each GPU's memory, the fraction a plan leaves free by default for what the memory model does not count: the CUDA
# context and kernels' modules (0.5-1 GiB), NCCL's buffers (hundreds of MiB per communicator), the caching allocator's
# fragmentation and the temporaries of the largest op, several GiB on an 80 GB card together. `--headroom 0` drops it.
HEADROOM = 0.1


def usable(hw, headroom=HEADROOM):
    """`hw` with the memory a plan may fill: all but `headroom` (a fraction) of the card's."""
    if not 0 <= headroom < 1:
        raise ValueError(f"--headroom {headroom} must be a fraction in [0, 1); e.g. --headroom 0.1 keeps 10% of each "
                         f"GPU's memory free.")
    return replace(hw, memory=hw.memory * (1 - headroom))


def cpu_hardware(peak, alpha, bw, cores, memory=16 * GiB, efficiency=1.0):
    """This machine as the planner sees it: `peak` measured (picotron.metrics.measured_matmul_peak on one thread),
    the gloo link's α (s) and bandwidth (bytes/s) measured between two processes, one 'GPU' per core."""
    return Hardware("this CPU", peak, memory, cores, alpha, bw, alpha, bw, efficiency, source="measured")



# fp32 matmuls without TF32 (torch's default, float32_matmul_precision "highest") run on the CUDA cores, not the tensor
# cores: datasheet dense FP32 FLOP/s. The lessons' GPU runs train in fp32 unless a row of their GPU_SETTINGS says bf16.
FP32_PEAK = {"a100-40gb": 19.5e12, "a100-80gb": 19.5e12, "h100-80gb": 66.9e12, "h200": 66.9e12}  # A100, H100 SXM datasheets


def at_dtype(key, dtype="bf16"):
    """GPUS[key] as it computes in `dtype`: bf16 its tensor-core peak; fp32 (no TF32) its FP32_PEAK."""
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"dtype={dtype!r}; use 'bf16' or 'fp32'.")
    hw = GPUS[key]
    return hw if dtype == "bf16" else replace(hw, peak=FP32_PEAK[key])


# ------------------------------------------------------------------------------- the roofline (lesson 00)
# Main-memory (HBM) bandwidth, bytes/s: NVIDIA A100 datasheet (40GB SXM: 1,555 GB/s HBM2; 80GB SXM: 2,039 GB/s HBM2e),
# H100 datasheet (SXM: 3.35 TB/s HBM3), H200 datasheet (SXM: 4.8 TB/s HBM3e).
HBM_BANDWIDTH = {"a100-40gb": 1.555e12, "a100-80gb": 2.039e12, "h100-80gb": 3.35e12, "h200": 4.8e12}


def ridge(peak, bandwidth):
    """The roofline's ridge point, FLOP per byte: the arithmetic intensity at which moving an operation's bytes takes
    as long as computing its FLOPs, peak / bandwidth. An operation with fewer FLOPs per byte is memory-bound (it cannot
    reach the peak, whatever its kernel), one with more can be compute-bound (Williams, Waterman & Patterson 2009,
    "Roofline", CACM 52(4), section 2). H100 SXM, bf16: 989.5e12 / 3.35e12 ≈ 295."""
    return peak / bandwidth


def roofline(peak, bandwidth, intensity):
    """The most FLOP/s an operation of `intensity` FLOP/byte can attain: min(peak, bandwidth × intensity)
    (Williams et al. 2009, section 2): the bandwidth's slope below the ridge, the flat peak above it."""
    return min(peak, bandwidth * intensity)


def op_cost(kind, shape, elem):
    """(FLOPs, bytes moved to and from main memory) of one operation, each tensor read or written once, `elem` bytes
    an element: the counts the roofline puts on its x axis (intensity = FLOPs / bytes).
        "matmul" (m, n, k): C[m, n] = A[m, k] @ B[k, n]: 2mnk FLOPs (a multiply and an add per term); A, B read, C
                            written: elem·(mk + kn + mn) bytes
        "rmsnorm" (r, h):   y = x / sqrt(mean(x²) + eps) · w over r rows of h: 4 FLOPs an element (square, sum,
                            scale, weight; the per-row root left out); x read, y written, w read: elem·(2rh + h)
        "add" (n,):         z = x + y: n FLOPs; x, y read, z written: 3n·elem
        "copy" (n,):        no FLOPs; n·elem read, n·elem written"""
    if kind == "matmul":
        m, n, k = shape
        return 2 * m * n * k, elem * (m * k + k * n + m * n)
    if kind == "rmsnorm":
        r, h = shape
        return 4 * r * h, elem * (2 * r * h + h)
    if kind == "add":
        return shape[0], 3 * shape[0] * elem
    if kind == "copy":
        return 0, 2 * shape[0] * elem
    raise ValueError(f"op_cost: kind {kind!r} is not one of matmul, rmsnorm, add, copy; pick one of them.")


def intensity(kind, shape, elem):
    """Arithmetic intensity, FLOPs per byte moved, of op_cost(kind, shape, elem)."""
    flops, moved = op_cost(kind, shape, elem)
    return flops / moved
