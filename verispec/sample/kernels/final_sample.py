"""The final token of a request: one exponential race over its final row.

Drawing v with probability w_v / sum(w) is argmax_v w_v / E_v with E_v ~ Exp(1) independent
(the exponential race): one pass, no normalisation, no prefix sum, and any split of the row
across programs combines by taking the best of the partial winners. Two races share the same
E_v: one over the weights w (the residual at a rejection, p for a bonus) and one over p, the
fallback when the residual has no mass, which happens exactly when no w_v is positive.

Scores are >= 0, a zero weight scores 0 and never wins (races start from 0 and need a strictly
better score), and ties go to the smaller column, in a program and across splits alike.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOW32 = tl.constexpr(0xFFFFFFFF)


@triton.jit
def race(
    best,  # [R] float32 best score so far
    best_index,  # [R] int32 its column
    weights,  # [R, C] float32 >= 0, unnormalised
    expo,  # [R, C] float32 Exp(1) variates of the same columns
    start,  # first column of the chunk
):
    """Folds one chunk of columns into the race; returns the new (best, best_index)."""
    score = weights / expo
    score = tl.where(score == score, score, 0.0)  # NaN weights (unvalidated garbage) are 0
    chunk_best = tl.max(score, axis=1)
    chunk_index = start + tl.argmax(score, axis=1)
    better = chunk_best > best
    return tl.where(better, chunk_best, best), tl.where(better, chunk_index, best_index)


@triton.jit
def pack(best, best_index):
    """[R] score >= 0 and column -> [R] int64 that orders by score, then by smaller column."""
    return (best.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (_LOW32 - best_index.to(tl.int64))


@triton.jit
def winner(packed_weights, packed_target):
    """[R] int64 packed winners of both races -> [R] int64 column: the residual's when it has mass."""
    packed = tl.where((packed_weights >> 32) > 0, packed_weights, packed_target)
    return _LOW32 - (packed & _LOW32)


def finish_split_races(
    token_ids: torch.Tensor,  # [B, max_K + 1] int64, the sampled token's slot still to fill
    num_accepted: torch.Tensor,  # [B] int64
    partial: torch.Tensor,  # [B, num_splits, 2] int64 packed winners (weights race, p race)
    is_greedy: torch.Tensor | None,  # [B] uint8; None when no request is greedy
    requests: int,
) -> None:
    """Writes each sampled request's final token from the winners of its split race."""
    batch, num_splits, _ = partial.shape
    _finish_kernel[(triton.cdiv(batch, requests),)](
        token_ids,
        num_accepted,
        partial,
        partial if is_greedy is None else is_greedy,
        batch,
        num_splits,
        token_ids.shape[1],
        ANY_GREEDY=is_greedy is not None,
        REQUESTS=requests,
        SPLITS_BLOCK=triton.next_power_of_2(num_splits),
    )


@triton.jit
def _finish_kernel(
    token_ids_ptr,  # [batch_size, max_spec_len + 1] int64
    num_accepted_ptr,  # [batch_size] int64
    partial_ptr,  # [batch_size, num_splits, 2] int64
    greedy_ptr,  # [batch_size] uint8 (ANY_GREEDY)
    batch,
    num_splits,
    slots,  # max_spec_len + 1
    ANY_GREEDY: tl.constexpr,
    REQUESTS: tl.constexpr,
    SPLITS_BLOCK: tl.constexpr,
):
    req = tl.program_id(0) * REQUESTS + tl.arange(0, REQUESTS)
    sampled = req < batch
    if ANY_GREEDY:
        sampled = sampled & (tl.load(greedy_ptr + req, mask=sampled, other=1) == 0)
    split = tl.arange(0, SPLITS_BLOCK)
    mask = sampled[:, None] & (split[None, :] < num_splits)
    offsets = (req[:, None].to(tl.int64) * num_splits + split[None, :]) * 2
    packed_weights = tl.max(tl.load(partial_ptr + offsets, mask=mask, other=0), axis=1)
    packed_target = tl.max(tl.load(partial_ptr + offsets + 1, mask=mask, other=0), axis=1)
    n = tl.load(num_accepted_ptr + req, mask=sampled, other=0)
    token = winner(packed_weights, packed_target)
    tl.store(token_ids_ptr + req.to(tl.int64) * slots + n, token, mask=sampled)
