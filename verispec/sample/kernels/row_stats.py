"""Per-row statistics of processed rows, and the probability of each row's draft token.

One program handles ROWS rows. The first pass reads each row once and keeps online softmax
statistics (max, rescaled sum of exponentials, min) and the argmax; top-k / top-p add the
threshold searches of threshold.py and min-p one pass for the mass it keeps. The outputs are
enough to evaluate any p_v of the row later without a second full pass (pipeline.sampling_probs):

    row_max    largest processed logit;
    lse        row_max + log(mass of the kept tokens), the log normaliser;
    threshold  the top-k / top-p threshold (the row minimum when neither filters the row);
    argmax     of the guided logits (target rows), what greedy requests accept and emit;
    gathered   p(x) (target rows) or q(x) (draft logit rows) of the draft token x at the row.

Rows come as rows.py says. When top-k or top-p filter and there are too few rows to fill the
device, each row is split across many programs instead (split_rows.py), with the same outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..metadata import SamplingMetadata
from . import tiles
from .pipeline import kept, processed_tile, sampling_probs
from .rows import RowStats, row_context
from .split_rows import split_row_stats
from .threshold import largest_threshold


def row_stats(
    logits: torch.Tensor,  # [num_rows, V] target logits, or draft logits
    uncond_logits: torch.Tensor | None,  # [num_rows, V] CFG rows of a target, or None
    draft_token_ids: torch.Tensor,  # [num_draft_tokens]
    cu_num_draft_tokens: torch.Tensor,  # [B + 1] on the device
    sampling: SamplingMetadata,
    is_target: bool,
) -> RowStats:
    """Target rows (is_target) or draft logit rows (no CFG, no argmax)."""
    num_rows, vocab = logits.shape
    batch = sampling.batch_size
    device = logits.device
    filters = not sampling.all_greedy
    t = tiles.row_tiles(num_rows, vocab)
    stats = RowStats(
        row_max=tiles.empty(num_rows, torch.float32, device),
        lse=tiles.empty(num_rows, torch.float32, device),
        threshold=tiles.empty(num_rows, torch.float32, device),
        argmax=tiles.empty(num_rows if is_target else 0, torch.int32, device),
        gathered=tiles.empty(draft_token_ids.shape[0], torch.float32, device),
    )
    has_cfg = is_target and uncond_logits is not None and sampling.any_cfg
    searches = filters and (sampling.any_top_k or sampling.any_top_p)
    split = tiles.split_tiles(num_rows, vocab, device) if searches else None
    if split is not None:
        split_row_stats(logits, uncond_logits if has_cfg else None, draft_token_ids, cu_num_draft_tokens,
                        sampling, is_target, split, stats)
        return stats
    _row_stats_kernel[(triton.cdiv(num_rows, t.rows),)](
        logits,
        uncond_logits if has_cfg else logits,
        cu_num_draft_tokens,
        draft_token_ids,
        sampling.temperature,
        sampling.top_k,
        sampling.top_p,
        sampling.min_p,
        sampling.guidance_scale,
        stats.row_max,
        stats.lse,
        stats.threshold,
        stats.argmax,
        stats.gathered,
        num_rows,
        batch,
        vocab,
        max(batch.bit_length(), 1),
        IS_TARGET=int(is_target),
        HAS_CFG=has_cfg,
        HAS_TOP_K=filters and sampling.any_top_k,
        HAS_TOP_P=filters and sampling.any_top_p,
        HAS_MIN_P=filters and sampling.any_min_p,
        ALL_GREEDY=sampling.all_greedy,
        ROWS=t.rows,
        BLOCK_V=t.block_v,
        SEARCH_BLOCK_V=t.search_block_v,
        NUM_PIVOTS=t.num_pivots,
        MAX_PASSES=t.max_passes,
        num_warps=t.num_warps,
    )
    return stats


@triton.jit
def _row_stats_kernel(
    logits_ptr,  # [num_rows, vocab_size]
    uncond_ptr,  # [num_rows, vocab_size] (HAS_CFG)
    cu_ptr,  # [batch_size + 1]
    ids_ptr,  # [num_draft_tokens]
    temperature_ptr,  # [batch_size] float32, 0 for greedy
    top_k_ptr,  # [batch_size] int64, 0 = off
    top_p_ptr,  # [batch_size] float32, 1 = off
    min_p_ptr,  # [batch_size] float32, 0 = off
    gamma_ptr,  # [batch_size] float32 guidance scale
    row_max_ptr,  # [num_rows] float32 out
    lse_ptr,  # [num_rows] float32 out
    threshold_ptr,  # [num_rows] float32 out
    argmax_ptr,  # [num_rows] int32 out (IS_TARGET)
    gathered_ptr,  # [num_draft_tokens] float32 out
    num_rows,
    batch,
    vocab,
    search_steps,
    IS_TARGET: tl.constexpr,  # 1: target rows (a bonus row per request, argmax); 0: draft rows
    HAS_CFG: tl.constexpr,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    ALL_GREEDY: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SEARCH_BLOCK_V: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
    MAX_PASSES: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < num_rows
    req, draft_index, has_draft, temperature, gamma = row_context(
        rows, live, cu_ptr, temperature_ptr, gamma_ptr, batch, search_steps, IS_TARGET)
    row_offset = rows.to(tl.int64) * vocab

    # Pass 1: online max / sum of exponentials / min, and the argmax, in one read of the row.
    row_max = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    row_min = tl.full([ROWS], float("inf"), tl.float32)
    best = tl.zeros([ROWS], tl.int32)
    for start in range(0, vocab, BLOCK_V):
        y, mask = processed_tile(logits_ptr, uncond_ptr, row_offset, live, start, vocab,
                                 gamma, temperature, HAS_CFG, BLOCK_V)
        chunk_max = tl.max(y, axis=1)
        if IS_TARGET:
            best = tl.where(chunk_max > row_max, start + tl.argmax(y, axis=1), best)
        if not ALL_GREEDY:
            new_max = tl.maximum(row_max, chunk_max)
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # all -inf so far: no NaN
            total = total * tl.exp(row_max - shift) + tl.sum(tl.exp(y - shift[:, None]), axis=1)
            if HAS_TOP_K or HAS_TOP_P:
                row_min = tl.minimum(row_min, tl.min(tl.where(mask, y, float("inf")), axis=1))
        row_max = tl.maximum(row_max, chunk_max)
    if IS_TARGET:
        tl.store(argmax_ptr + rows, best, mask=live)

    if not ALL_GREEDY:
        threshold = tl.full([ROWS], float("-inf"), tl.float32)
        kept_mass = total
        if HAS_TOP_K or HAS_TOP_P:
            threshold = row_min
        if HAS_TOP_K:
            top_k = tl.load(top_k_ptr + req, mask=live, other=0)
            goal = tl.minimum(top_k, vocab).to(tl.float32)
            threshold, kept_mass = largest_threshold(
                logits_ptr, uncond_ptr, row_offset, live & (top_k > 0), gamma, temperature,
                row_max, goal, threshold, kept_mass, vocab,
                False, HAS_CFG, ROWS, SEARCH_BLOCK_V, NUM_PIVOTS, MAX_PASSES,
            )
        if HAS_TOP_P:
            top_p = tl.load(top_p_ptr + req, mask=live, other=1.0)
            threshold, kept_mass = largest_threshold(
                logits_ptr, uncond_ptr, row_offset, live & (top_p < 1.0), gamma, temperature,
                row_max, top_p * kept_mass, threshold, kept_mass, vocab,
                True, HAS_CFG, ROWS, SEARCH_BLOCK_V, NUM_PIVOTS, MAX_PASSES,
            )
        log_min_p = tl.full([ROWS], float("-inf"), tl.float32)
        if HAS_MIN_P:
            min_p = tl.load(min_p_ptr + req, mask=live, other=0.0)
            log_min_p = tl.log(min_p)
            filtered = live & (min_p > 0)
            min_p_mass = tl.zeros([ROWS], tl.float32)
            for start in range(0, vocab, BLOCK_V):
                y, mask = processed_tile(logits_ptr, uncond_ptr, row_offset, filtered, start, vocab,
                                         gamma, temperature, HAS_CFG, BLOCK_V)
                keep = mask & kept(y, threshold[:, None], row_max[:, None], log_min_p[:, None], True)
                min_p_mass += tl.sum(tl.where(keep, tl.exp(y - row_max[:, None]), 0.0), axis=1)
            kept_mass = tl.where(filtered, min_p_mass, kept_mass)
        lse = row_max + tl.log(kept_mass)
        tl.store(row_max_ptr + rows, row_max, mask=live)
        tl.store(lse_ptr + rows, lse, mask=live)
        tl.store(threshold_ptr + rows, threshold, mask=live)

        # Out-of-range ids read column 0 here; the chain rejects them whatever this says.
        x = tl.load(ids_ptr + draft_index, mask=has_draft, other=0).to(tl.int64)
        x = tl.minimum(tl.maximum(x, 0), vocab - 1)
        p_x = sampling_probs(
            logits_ptr, uncond_ptr, row_offset + x, has_draft, gamma, temperature,
            row_max, lse, threshold, log_min_p, HAS_CFG, HAS_MIN_P,
        )
        tl.store(gathered_ptr + draft_index, p_x, mask=has_draft)
