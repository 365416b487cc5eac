"""The sampling pipeline, element by element, as the kernels evaluate it (processors.py natively).

A *processed* logit y is the guided logit (CFG combine of the conditional and unconditional
rows) divided by the effective temperature (1 for greedy requests). A row's sampling
distribution is then p_v = exp(y_v - lse) on the *kept* tokens, those with y_v >= threshold
(top-k and top-p, see threshold.py) and y_v - row_max >= log(min_p), and 0 elsewhere. Processed
rows are never stored: every pass over a row recomputes them from the logits it reads.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def processed_logits(
    logits_ptr,  # [num_rows, vocab_size] conditional (or plain) logits, any float dtype
    uncond_ptr,  # [num_rows, vocab_size] unconditional logits; read only when HAS_CFG
    offsets,  # [...] int64 element offsets into both
    mask,  # [...] bool, False outside the row
    gamma,  # [...] float32 guidance scale (broadcast against offsets)
    temperature,  # [...] float32 effective temperature, > 0
    HAS_CFG: tl.constexpr,
):
    """[...] float32 processed logits; -inf outside the mask and where the logit is NaN.

    Guided rows are u + gamma (c - u) as in processors.cfg_combine; rows with gamma = 1 keep the
    conditional logit bit for bit and never read the unconditional row. NaN (a token both
    branches rule out, or garbage when unvalidated) means ruled out.
    """
    x = tl.load(logits_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_CFG:
        guided = mask & (gamma != 1.0)
        x_u = tl.load(uncond_ptr + offsets, mask=guided, other=0.0).to(tl.float32)
        x = tl.where(guided, x_u + gamma * (x - x_u), x)
    x = tl.where(mask & (x == x), x, float("-inf"))
    return x / temperature


@triton.jit
def processed_tile(
    logits_ptr,  # [num_rows, vocab_size]
    uncond_ptr,  # [num_rows, vocab_size] (HAS_CFG)
    row_offset,  # [ROWS] int64, offset of each row's first element
    active,  # [ROWS] bool, rows to read; the others come back -inf
    start,  # first column of the tile
    vocab,
    gamma,  # [ROWS] float32 guidance scale
    temperature,  # [ROWS] float32 effective temperature
    HAS_CFG: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """([ROWS, BLOCK_V] float32 processed logits, [ROWS, BLOCK_V] bool in-row mask) of the
    columns start .. start + BLOCK_V of each row: the unit every full-row pass reads."""
    cols = start + tl.arange(0, BLOCK_V)
    mask = active[:, None] & (cols[None, :] < vocab)
    y = processed_logits(
        logits_ptr, uncond_ptr, row_offset[:, None] + cols[None, :], mask,
        gamma[:, None], temperature[:, None], HAS_CFG,
    )
    return y, mask


@triton.jit
def kept(
    y,  # [...] float32 processed logits
    threshold,  # [...] float32 smallest value top-k / top-p keep (-inf: none)
    row_max,  # [...] float32 largest processed logit of the row
    log_min_p,  # [...] float32 log(min_p); -inf when off
    HAS_MIN_P: tl.constexpr,
):
    """[...] bool: the token survives every filter (processors.apply_* masks, same comparisons)."""
    keep = y >= threshold
    if HAS_MIN_P:
        keep = keep & (y - row_max >= log_min_p)
    return keep


@triton.jit
def sampling_probs(
    logits_ptr,  # [num_rows, vocab_size]
    uncond_ptr,  # [num_rows, vocab_size] (HAS_CFG)
    offsets,  # [...] int64
    mask,  # [...] bool
    gamma,  # [...] float32
    temperature,  # [...] float32
    row_max,  # [...] float32
    lse,  # [...] float32, row_max + log(mass of the kept tokens)
    threshold,  # [...] float32
    log_min_p,  # [...] float32
    HAS_CFG: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
):
    """[...] float32 p_v of the request's sampling distribution; 0 outside the mask."""
    y = processed_logits(logits_ptr, uncond_ptr, offsets, mask, gamma, temperature, HAS_CFG)
    keep = mask & kept(y, threshold, row_max, log_min_p, HAS_MIN_P)
    return tl.where(keep, tl.exp(y - lse), 0.0)


@triton.jit
def order_key(y):
    """[...] float32 (not NaN) -> [...] int64 keys in the order of the values.

    The float bits as int32, negatives flipped so that larger floats get larger keys; -0.0 and
    +0.0 share key 0 because they compare equal.
    """
    bits = y.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(y == 0.0, 0, key).to(tl.int64)


@triton.jit
def key_value(key):
    """[...] int64 key (int32 range) -> [...] float32, the inverse of order_key."""
    k = key.to(tl.int32)
    return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
