"""Lesson 11 exercises: the online softmax at the heart of flash attention, fp16's loss-scale rule, FP8's
per-tensor scaling, and DeepSeek-V3's 1×128 tiles. Write the pieces marked EXERCISE, then
    ./run.sh python lessons/11_precision_and_kernels/check.py                            # all exercises
    ./run.sh python lessons/11_precision_and_kernels/check.py online_softmax_attention   # just one (or update, quantize_e4m3, quantize_tiles)
Everything is checked in this process against torch.softmax, picotron.precision.LossScaler and picotron.fp8: the
checker names the row, the step or the element that is wrong, and recognises the usual mistakes (an accumulator not
rescaled when the running max grows, exp of unshifted scores overflowing, a count of clean steps that an overflow
does not reset, a scale upside down...). The solutions are in solution.py (look after trying).
"""
import torch

E4M3 = torch.float8_e4m3fn  # exercises 3 and 4's format


def online_softmax_attention(q, k, v, block):
    """EXERCISE 1: softmax(q kᵀ / sqrt(d)) v for q [n, d], k and v [m, d] (no mask), reading k and v `block` rows
    at a time, never forming the n × m matrix: keep for each query row a running max μ_i, a running sum
    l_i = Σ exp(s_ij − μ_i) and a running output acc_i = Σ exp(s_ij − μ_i) v_j over the blocks seen so far; when
    a new block raises the max to μ', multiply l and acc by exp(μ − μ') before adding the block's terms.
    Return (out [n, d], lse [n]): out = acc / l after the last block, lse = μ + log l (= log Σ_j exp(s_ij)).
    The last block may be shorter than `block`."""
    raise NotImplementedError("not written yet")


def update(scale, clean_steps, overflow, growth_interval=2000, growth_factor=2.0, backoff_factor=0.5):
    """EXERCISE 2: one step of dynamic loss scaling, as torch.amp.GradScaler and picotron.precision.LossScaler do
    it. `scale`: the loss scale S the step's backward used; `clean_steps`: steps without an overflow since the
    last change of S; `overflow`: whether any gradient of this step is inf or NaN. Return
    (new scale, new clean_steps, skip): an overflow skips the step and multiplies S by backoff_factor; otherwise
    the step counts as clean, and the growth_interval-th clean step in a row multiplies S by growth_factor (the
    count starting again from 0)."""
    raise NotImplementedError("not written yet")


def quantize_e4m3(t):
    """EXERCISE 3: per-tensor current scaling into FP8 E4M3 (torch.float8_e4m3fn): scale = fmax / amax with
    fmax = torch.finfo(E4M3).max = 448 and amax = max |t| floored at 1e-12 (so an all-zero tensor gets a finite scale);
    return (t·scale computed in float32, clamped to ±fmax, cast to E4M3, scale) with scale a float32 tensor."""
    raise NotImplementedError("not written yet")


def quantize_tiles(x, tile=128):
    """EXERCISE 4: fine-grained FP8 as DeepSeek-V3 scales activations (picotron/fp8_blockwise.py): x [R, C] cut into
    1 × tile tiles along its LAST axis (per row, `tile` consecutive elements; the last tile shorter when tile does not
    divide C). Each tile gets its own dequantizing scale d = amax(tile) / 448 in float32 (amax floored at 1e-12), and
    its elements become (x / d) clamped to ±448 and cast to E4M3. Return (x_fp8 [R, C], scales [R, ⌈C / tile⌉])."""
    raise NotImplementedError("not written yet")
