"""Top-k and top-p thresholds by a multi-pivot search over the row values: no sort.

Both filters keep the tokens whose processed logit y is >= a threshold t, and both thresholds
are "the largest row value t whose f(t) still reaches a goal", for a non-increasing f:
- top-k: f(t) = count(y >= t), goal = min(k, V): t is the k-th largest value, ties kept;
- top-p: f(t) = mass(y >= t) = sum exp(y - row_max) over y >= t, goal = top_p * (mass kept by
  top-k): t is the smallest nucleus threshold t* of SamplingParams, ties kept.

The search keeps a bracket [lo, hi) of order keys (pipeline.order_key) with f(lo) >= goal and
f(hi) < goal, lo a row value. Each pass reads the row once and evaluates f at NUM_PIVOTS keys
spread evenly over the bracket, together with, for every pivot, the smallest row value at or
above it and the largest below it; the bracket then shrinks to the row values between the last
pivot that reaches the goal and the first that does not. It ends when no key lies strictly
inside, so lo is the threshold exactly, after at most ceil(32 / log2(NUM_PIVOTS + 1)) + 1 passes
and usually far fewer (the bracket snaps to the row's own values). Counts and masses use the
same comparisons as the final mask, so ties are counted exactly as they are kept.

A pass is split in two so that a row can also be searched by many programs (split_rows.py):
pivot_partials reads some columns of the row, and narrow folds the pass's totals into the
bracket. Counts, minima and maxima of partials combine exactly; masses are float sums.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pipeline import key_value, order_key, processed_tile


@triton.jit
def pivot_values(
    lo_key,  # [ROWS] int64
    hi_key,  # [ROWS] int64
    NUM_PIVOTS: tl.constexpr,
):
    """[ROWS, NUM_PIVOTS] float32: the pivots of a pass, spread evenly over the bracket's keys."""
    rank = tl.arange(0, NUM_PIVOTS)[None, :] + 1
    return key_value(lo_key[:, None] + rank * (hi_key - lo_key)[:, None] // (NUM_PIVOTS + 1))


@triton.jit
def pivot_partials(
    logits_ptr,  # [num_rows, vocab_size]
    uncond_ptr,  # [num_rows, vocab_size] (HAS_CFG)
    row_offset,  # [ROWS] int64, offset of each row's first element
    searching,  # [ROWS] bool, rows to read; the others come back as no values
    gamma,  # [ROWS] float32
    temperature,  # [ROWS] float32 effective temperature
    row_max,  # [ROWS] float32 largest processed logit
    pivot,  # [ROWS, NUM_PIVOTS] float32
    first,  # first column to read, a multiple of BLOCK_V
    end,  # one past the last column to read (<= vocab)
    HAS_CFG: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
):
    """Over columns [first, end) of each row, per pivot: (count(y >= pivot), mass(y >= pivot),
    smallest y >= pivot (inf: none), largest y < pivot (-inf: none)), each [ROWS, NUM_PIVOTS]."""
    pivot3 = pivot[:, :, None]  # [ROWS, NUM_PIVOTS, 1]
    count = tl.zeros([ROWS, NUM_PIVOTS], tl.float32)
    mass = tl.zeros([ROWS, NUM_PIVOTS], tl.float32)
    above = tl.full([ROWS, NUM_PIVOTS], float("inf"), tl.float32)
    below = tl.full([ROWS, NUM_PIVOTS], float("-inf"), tl.float32)
    for start in range(first, end, BLOCK_V):
        y, mask = processed_tile(logits_ptr, uncond_ptr, row_offset, searching, start, end,
                                 gamma, temperature, HAS_CFG, BLOCK_V)
        weight = tl.exp(y - row_max[:, None])[:, None, :]
        y3 = y[:, None, :]
        ge = (y3 >= pivot3) & mask[:, None, :]
        count += tl.sum(ge.to(tl.float32), axis=2)
        mass += tl.sum(tl.where(ge, weight, 0.0), axis=2)
        above = tl.minimum(above, tl.min(tl.where(ge, y3, float("inf")), axis=2))
        below = tl.maximum(below, tl.max(tl.where(ge, float("-inf"), y3), axis=2))
    return count, mass, above, below


@triton.jit
def narrow(
    lo_key,  # [ROWS] int64
    hi_key,  # [ROWS] int64
    lo_mass,  # [ROWS] float32, mass(y >= lo)
    searching,  # [ROWS] bool, rows whose pass ran; the others keep their bracket
    goal,  # [ROWS] float32
    count,  # [ROWS, NUM_PIVOTS] float32, the pass's totals (pivot_partials over the whole row)
    mass,  # [ROWS, NUM_PIVOTS] float32
    above,  # [ROWS, NUM_PIVOTS] float32
    below,  # [ROWS, NUM_PIVOTS] float32
    BY_MASS: tl.constexpr,  # f is the mass (top-p), else the count (top-k)
    NUM_PIVOTS: tl.constexpr,
):
    """The bracket after one pass: (lo_key, hi_key, lo_mass)."""
    rank = tl.arange(0, NUM_PIVOTS)[None, :] + 1
    if BY_MASS:
        reached = mass >= goal[:, None]
    else:
        reached = count >= goal[:, None]
    # f is non-increasing in the pivot, so the pivots that reach the goal are a prefix.
    num_reached = tl.sum(reached.to(tl.int32), axis=1)
    last = rank == num_reached[:, None]
    first_short = rank == num_reached[:, None] + 1
    raise_lo = searching & (num_reached > 0)
    lower_hi = searching & (num_reached < NUM_PIVOTS)
    new_lo = tl.min(tl.where(last, above, float("inf")), axis=1)
    new_hi = tl.max(tl.where(first_short, below, float("-inf")), axis=1)
    return (
        tl.where(raise_lo, order_key(new_lo), lo_key),
        tl.where(lower_hi, order_key(new_hi) + 1, hi_key),
        tl.where(raise_lo, tl.sum(tl.where(last, mass, 0.0), axis=1), lo_mass),
    )


@triton.jit
def largest_threshold(
    logits_ptr,  # [num_rows, vocab_size]
    uncond_ptr,  # [num_rows, vocab_size] (HAS_CFG)
    row_offset,  # [ROWS] int64, offset of each row's first element
    active,  # [ROWS] bool, rows that search; the others return lo unchanged
    gamma,  # [ROWS] float32
    temperature,  # [ROWS] float32 effective temperature
    row_max,  # [ROWS] float32 largest processed logit
    goal,  # [ROWS] float32
    lo,  # [ROWS] float32, a row value with f(lo) >= goal
    lo_mass,  # [ROWS] float32, mass(y >= lo)
    vocab,
    BY_MASS: tl.constexpr,
    HAS_CFG: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
    MAX_PASSES: tl.constexpr,
):
    """The whole search in one program per ROWS rows. Returns (threshold, mass(y >= threshold)),
    both [ROWS] float32."""
    lo_key = order_key(lo)
    hi_key = order_key(row_max) + 1
    searching = active & (hi_key - lo_key > 1)
    passes = 0
    while (tl.max(searching.to(tl.int32), axis=0) > 0) & (passes < MAX_PASSES):
        pivot = pivot_values(lo_key, hi_key, NUM_PIVOTS)
        count, mass, above, below = pivot_partials(
            logits_ptr, uncond_ptr, row_offset, searching, gamma, temperature, row_max, pivot,
            0, vocab, HAS_CFG, ROWS, BLOCK_V, NUM_PIVOTS,
        )
        lo_key, hi_key, lo_mass = narrow(lo_key, hi_key, lo_mass, searching, goal, count, mass,
                                         above, below, BY_MASS, NUM_PIVOTS)
        searching = searching & (hi_key - lo_key > 1)
        passes += 1
    return key_value(lo_key), lo_mass
