"""row_stats with each row split across programs: for top-k / top-p at a large vocabulary and
too few rows to fill the device (one program per row leaves the other SMs idle).

Program (row, split) reads columns [split * split_width, ...) of its row. Its results go to
partial buffers, and the next launch folds them together in a fixed order (tl.max / tl.min /
tl.sum over the splits of a loaded tile), so nothing depends on how programs are scheduled and
no atomics are used. Launches, none waiting on the host:

    stats       per split: max, sum of exp(y - max), min, first argmax
    pass x N    fold the previous launch's partials (the stats, or the last pass) into the row's
                bracket, then evaluate the pivots of threshold.py on the split's columns;
                N = max_passes for top-k, then as many for top-p (a pass whose row has settled
                reads nothing)
    min-p       (when some request uses min-p) fold the last pass; per split, the mass kept
    finish      one program per row: fold what is left, write row_max, lse, threshold, p(x)

Every program of a launch folds the same partials in the same order, so all agree on the
bracket; split 0 also stores it (the row's state, double-buffered by launch parity so that a
launch never overwrites what its own programs read). Counts, minima, maxima and the argmax
combine exactly, so argmax and top-k thresholds equal the unsplit kernel's; masses are float
sums in another order, equal to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..metadata import SamplingMetadata
from . import tiles
from .pipeline import kept, order_key, key_value, processed_tile, sampling_probs
from .rows import RowStats, row_context
from .threshold import narrow, pivot_partials, pivot_values

_QUANTITIES = tl.constexpr(4)  # per pivot: count, mass, smallest value above, largest below


def split_row_stats(
    logits: torch.Tensor,  # [num_rows, V] target logits, or draft logits
    uncond_logits: torch.Tensor | None,  # [num_rows, V] CFG rows when some request is guided, else None
    draft_token_ids: torch.Tensor,  # [num_draft_tokens]
    cu_num_draft_tokens: torch.Tensor,  # [B + 1] on the device
    sampling: SamplingMetadata,
    is_target: bool,
    t: tiles.SplitTiles,
    out: RowStats,
) -> None:
    """Fills `out` as row_stats would; some request has top-k or top-p (not all greedy)."""
    num_rows, vocab = logits.shape
    device = logits.device
    batch = sampling.batch_size
    splits = t.num_splits
    part_stats = tiles.empty((num_rows, splits, 3), torch.float32, device)
    part_argmax = tiles.empty((num_rows, splits), torch.int32, device)
    state_keys = tiles.empty((2, 2, num_rows), torch.int64, device)  # [parity, (lo, hi), row]
    state_mass = tiles.empty((2, 2, num_rows), torch.float32, device)  # [parity, (lo mass, goal), row]
    pivots = tiles.empty((2, num_rows, splits, 4, t.num_pivots), torch.float32, device)
    min_p_mass = tiles.empty((num_rows, splits), torch.float32, device)
    row = dict(
        logits_ptr=logits,
        uncond_ptr=logits if uncond_logits is None else uncond_logits,
        cu_ptr=cu_num_draft_tokens,
        temperature_ptr=sampling.temperature,
        gamma_ptr=sampling.guidance_scale,
        num_rows=num_rows,
        batch=batch,
        vocab=vocab,
        search_steps=max(batch.bit_length(), 1),
        IS_TARGET=int(is_target),
        HAS_CFG=uncond_logits is not None,
    )
    folds = dict(
        top_k_ptr=sampling.top_k,
        top_p_ptr=sampling.top_p,
        row_max_ptr=out.row_max,
        state_keys_ptr=state_keys,
        state_mass_ptr=state_mass,
        pivots_ptr=pivots,
        num_splits=splits,
        SPLITS_BLOCK=triton.next_power_of_2(splits),
        NUM_PIVOTS=t.num_pivots,
    )
    grid = (num_rows, splits)
    _stats_kernel[grid](**row, split_width=t.split_width, part_stats_ptr=part_stats,
                        part_argmax_ptr=part_argmax, BLOCK_V=t.block_v, num_warps=t.num_warps)
    searches = [by_mass for by_mass, on in ((False, sampling.any_top_k), (True, sampling.any_top_p)) if on]
    launch = 0
    previous = None  # BY_MASS of the last pass; None: the stats come next
    for by_mass in searches:
        for i in range(t.max_passes):
            _pass_kernel[grid](**row, **folds, split_width=t.split_width, part_stats_ptr=part_stats,
                               part_argmax_ptr=part_argmax, argmax_ptr=out.argmax, parity=launch % 2,
                               FROM_STATS=previous is None,
                               FOLD_BY_MASS=bool(previous), START=i == 0, BY_MASS=by_mass,
                               BLOCK_V=t.search_block_v, num_warps=t.num_warps)
            previous = by_mass
            launch += 1
    has_min_p = sampling.any_min_p
    if has_min_p:
        _min_p_kernel[grid](**row, **folds, split_width=t.split_width, min_p_ptr=sampling.min_p,
                            min_p_mass_ptr=min_p_mass, parity=launch % 2, FOLD_BY_MASS=previous, BLOCK_V=t.block_v,
                            num_warps=t.num_warps)
        launch += 1
    _finish_kernel[(num_rows,)](
        **row, **folds, ids_ptr=draft_token_ids, min_p_ptr=sampling.min_p, min_p_mass_ptr=min_p_mass,
        lse_ptr=out.lse, threshold_ptr=out.threshold, gathered_ptr=out.gathered, parity=launch % 2,
        FOLD_BY_MASS=previous, HAS_MIN_P=has_min_p,
    )


@triton.jit
def _columns(split, split_width, vocab):
    """The split's columns [first, end)."""
    first = split * split_width
    return first, tl.minimum(first + split_width, vocab)


@triton.jit
def _stats_kernel(
    logits_ptr,  # [num_rows, vocab_size]
    uncond_ptr,  # [num_rows, vocab_size] (HAS_CFG)
    cu_ptr,  # [batch_size + 1]
    temperature_ptr,  # [batch_size] float32
    gamma_ptr,  # [batch_size] float32
    part_stats_ptr,  # [num_rows, num_splits, 3] float32 out: max, sum exp(y - max), min
    part_argmax_ptr,  # [num_rows, num_splits] int32 out: column of the split's first maximum
    num_rows,
    batch,
    vocab,
    search_steps,
    split_width,
    IS_TARGET: tl.constexpr,
    HAS_CFG: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) + tl.arange(0, 1)
    split = tl.program_id(1)
    live = rows < num_rows
    _, _, _, temperature, gamma = row_context(rows, live, cu_ptr, temperature_ptr, gamma_ptr, batch,
                                              search_steps, IS_TARGET)
    row_offset = rows.to(tl.int64) * vocab
    first, end = _columns(split, split_width, vocab)
    part_max = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    part_min = tl.full([1], float("inf"), tl.float32)
    best = tl.zeros([1], tl.int32) + first
    for start in range(first, end, BLOCK_V):
        y, mask = processed_tile(logits_ptr, uncond_ptr, row_offset, live, start, end,
                                 gamma, temperature, HAS_CFG, BLOCK_V)
        chunk_max = tl.max(y, axis=1)
        best = tl.where(chunk_max > part_max, start + tl.argmax(y, axis=1), best)
        new_max = tl.maximum(part_max, chunk_max)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # all -inf so far: no NaN
        total = total * tl.exp(part_max - shift) + tl.sum(tl.exp(y - shift[:, None]), axis=1)
        part_min = tl.minimum(part_min, tl.min(tl.where(mask, y, float("inf")), axis=1))
        part_max = new_max
    slot = rows.to(tl.int64) * tl.num_programs(1) + split
    tl.store(part_stats_ptr + slot * 3, part_max)
    tl.store(part_stats_ptr + slot * 3 + 1, total)
    tl.store(part_stats_ptr + slot * 3 + 2, part_min)
    tl.store(part_argmax_ptr + slot, best)


@triton.jit
def _searching(
    req,  # [1] request of the row
    live,  # [1] bool
    lo_key,  # [1] int64
    hi_key,  # [1] int64
    top_k_ptr,  # [batch_size] int64, 0 = off
    top_p_ptr,  # [batch_size] float32, 1 = off
    BY_MASS: tl.constexpr,
):
    """[1] bool: the row's search (top-p when BY_MASS, else top-k) is on and not settled."""
    if BY_MASS:
        active = tl.load(top_p_ptr + req, mask=live, other=1.0) < 1.0
    else:
        active = tl.load(top_k_ptr + req, mask=live, other=0) > 0
    return live & active & (hi_key - lo_key > 1)


@triton.jit
def _folded(
    rows,  # [1] int32
    req,  # [1]
    live,  # [1] bool
    top_k_ptr,
    top_p_ptr,
    state_keys_ptr,  # [2, 2, num_rows] int64
    state_mass_ptr,  # [2, 2, num_rows] float32
    pivots_ptr,  # [2, num_rows, num_splits, 4, NUM_PIVOTS] float32
    num_rows,
    num_splits,
    parity,  # the previous launch's is 1 - parity
    BY_MASS: tl.constexpr,  # of the previous pass
    SPLITS_BLOCK: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
):
    """The bracket the previous pass leaves: ([1] lo_key, [1] hi_key, [1] lo_mass, [1] goal)."""
    before = 1 - parity
    lo_key = tl.load(state_keys_ptr + (before * 2) * num_rows + rows)
    hi_key = tl.load(state_keys_ptr + (before * 2 + 1) * num_rows + rows)
    lo_mass = tl.load(state_mass_ptr + (before * 2) * num_rows + rows)
    goal = tl.load(state_mass_ptr + (before * 2 + 1) * num_rows + rows)
    searching = _searching(req, live, lo_key, hi_key, top_k_ptr, top_p_ptr, BY_MASS)
    # Unread (and never written) where the row did not search: narrow keeps its bracket then.
    splits = tl.arange(0, SPLITS_BLOCK)[:, None]
    pivot = tl.arange(0, NUM_PIVOTS)[None, :]
    mask = (splits < num_splits) & searching
    slot = (before * num_rows + rows.to(tl.int64)) * num_splits + splits
    base = pivots_ptr + slot * (_QUANTITIES * NUM_PIVOTS) + pivot
    count = tl.sum(tl.load(base, mask=mask, other=0.0), axis=0)[None, :]
    mass = tl.sum(tl.load(base + NUM_PIVOTS, mask=mask, other=0.0), axis=0)[None, :]
    above = tl.min(tl.load(base + 2 * NUM_PIVOTS, mask=mask, other=float("inf")), axis=0)[None, :]
    below = tl.max(tl.load(base + 3 * NUM_PIVOTS, mask=mask, other=float("-inf")), axis=0)[None, :]
    lo_key, hi_key, lo_mass = narrow(lo_key, hi_key, lo_mass, searching, goal, count, mass, above, below,
                                     BY_MASS, NUM_PIVOTS)
    return lo_key, hi_key, lo_mass, goal


@triton.jit
def _store_state(state_keys_ptr, state_mass_ptr, rows, num_rows, parity, lo_key, hi_key, lo_mass, goal,
                 writer):
    tl.store(state_keys_ptr + (parity * 2) * num_rows + rows, lo_key, mask=writer)
    tl.store(state_keys_ptr + (parity * 2 + 1) * num_rows + rows, hi_key, mask=writer)
    tl.store(state_mass_ptr + (parity * 2) * num_rows + rows, lo_mass, mask=writer)
    tl.store(state_mass_ptr + (parity * 2 + 1) * num_rows + rows, goal, mask=writer)


@triton.jit
def _pass_kernel(
    logits_ptr,  # [num_rows, vocab_size]
    uncond_ptr,  # [num_rows, vocab_size] (HAS_CFG)
    cu_ptr,  # [batch_size + 1]
    temperature_ptr,  # [batch_size] float32
    gamma_ptr,  # [batch_size] float32
    top_k_ptr,  # [batch_size] int64, 0 = off
    top_p_ptr,  # [batch_size] float32, 1 = off
    part_stats_ptr,  # [num_rows, num_splits, 3] float32 (FROM_STATS)
    part_argmax_ptr,  # [num_rows, num_splits] int32 (FROM_STATS)
    row_max_ptr,  # [num_rows] float32, out (FROM_STATS), else in
    argmax_ptr,  # [num_rows] int32 out (FROM_STATS and IS_TARGET)
    state_keys_ptr,  # [2, 2, num_rows] int64: lo and hi keys, by parity
    state_mass_ptr,  # [2, 2, num_rows] float32: mass(y >= lo) and the goal, by parity
    pivots_ptr,  # [2, num_rows, num_splits, 4, NUM_PIVOTS] float32: pivot partials, by parity
    num_rows,
    batch,
    vocab,
    search_steps,
    num_splits,
    split_width,
    parity,  # this launch writes state and partials [parity], reads [1 - parity]
    IS_TARGET: tl.constexpr,
    HAS_CFG: tl.constexpr,
    FROM_STATS: tl.constexpr,  # the first pass: fold the statistics partials
    FOLD_BY_MASS: tl.constexpr,  # else fold the previous pass, a top-p pass when True
    START: tl.constexpr,  # the first pass of this search: a fresh bracket from the folded one
    BY_MASS: tl.constexpr,  # this search is top-p, else top-k
    SPLITS_BLOCK: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) + tl.arange(0, 1)
    split = tl.program_id(1)
    live = rows < num_rows
    writer = tl.where(split == 0, live, False)
    req, _, _, temperature, gamma = row_context(rows, live, cu_ptr, temperature_ptr, gamma_ptr, batch,
                                                search_steps, IS_TARGET)
    if FROM_STATS:
        splits = tl.arange(0, SPLITS_BLOCK)[None, :]
        in_row = splits < num_splits
        slot = rows[:, None].to(tl.int64) * num_splits + splits
        part_max = tl.load(part_stats_ptr + slot * 3, mask=in_row, other=float("-inf"))
        part_sum = tl.load(part_stats_ptr + slot * 3 + 1, mask=in_row, other=0.0)
        part_min = tl.load(part_stats_ptr + slot * 3 + 2, mask=in_row, other=float("inf"))
        row_max = tl.max(part_max, axis=1)
        shift = tl.where(row_max == float("-inf"), 0.0, row_max)[:, None]
        lo_mass = tl.sum(tl.where(part_max == float("-inf"), 0.0, part_sum * tl.exp(part_max - shift)), axis=1)
        lo_key = order_key(tl.min(part_min, axis=1))
        tl.store(row_max_ptr + rows, row_max, mask=writer)
        if IS_TARGET:
            # The first split holding the row's maximum has its first maximum (all -inf: column 0).
            part_argmax = tl.load(part_argmax_ptr + slot, mask=in_row, other=vocab)
            best = tl.min(tl.where(part_max == row_max[:, None], part_argmax, vocab), axis=1)
            tl.store(argmax_ptr + rows, best, mask=writer)
    else:
        row_max = tl.load(row_max_ptr + rows)
        lo_key, hi_key, lo_mass, goal = _folded(
            rows, req, live, top_k_ptr, top_p_ptr, state_keys_ptr, state_mass_ptr, pivots_ptr,
            num_rows, num_splits, parity, FOLD_BY_MASS, SPLITS_BLOCK, NUM_PIVOTS,
        )
    if START:  # always, after FROM_STATS
        hi_key = order_key(row_max) + 1
        if BY_MASS:
            goal = tl.load(top_p_ptr + req, mask=live, other=1.0) * lo_mass
        else:
            top_k = tl.load(top_k_ptr + req, mask=live, other=0)
            goal = tl.minimum(top_k, vocab).to(tl.float32)
    _store_state(state_keys_ptr, state_mass_ptr, rows, num_rows, parity, lo_key, hi_key, lo_mass, goal, writer)
    searching = _searching(req, live, lo_key, hi_key, top_k_ptr, top_p_ptr, BY_MASS)
    if tl.max(searching.to(tl.int32), axis=0) > 0:
        first, end = _columns(split, split_width, vocab)
        count, mass, above, below = pivot_partials(
            logits_ptr, uncond_ptr, rows.to(tl.int64) * vocab, searching, gamma, temperature, row_max,
            pivot_values(lo_key, hi_key, NUM_PIVOTS), first, end, HAS_CFG, 1, BLOCK_V, NUM_PIVOTS,
        )
        pivot = tl.arange(0, NUM_PIVOTS)[None, :]
        base = pivots_ptr + ((parity * num_rows + rows[:, None].to(tl.int64)) * num_splits + split) \
            * (_QUANTITIES * NUM_PIVOTS) + pivot
        tl.store(base, count)
        tl.store(base + NUM_PIVOTS, mass)
        tl.store(base + 2 * NUM_PIVOTS, above)
        tl.store(base + 3 * NUM_PIVOTS, below)


@triton.jit
def _min_p_kernel(
    logits_ptr,  # [num_rows, vocab_size]
    uncond_ptr,  # [num_rows, vocab_size] (HAS_CFG)
    cu_ptr,  # [batch_size + 1]
    temperature_ptr,  # [batch_size] float32
    gamma_ptr,  # [batch_size] float32
    top_k_ptr,  # [batch_size] int64
    top_p_ptr,  # [batch_size] float32
    min_p_ptr,  # [batch_size] float32, 0 = off
    row_max_ptr,  # [num_rows] float32
    state_keys_ptr,  # [2, 2, num_rows] int64
    state_mass_ptr,  # [2, 2, num_rows] float32
    pivots_ptr,  # [2, num_rows, num_splits, 4, NUM_PIVOTS] float32
    min_p_mass_ptr,  # [num_rows, num_splits] float32 out: the split's mass kept by every filter
    num_rows,
    batch,
    vocab,
    search_steps,
    num_splits,
    split_width,
    parity,
    IS_TARGET: tl.constexpr,
    HAS_CFG: tl.constexpr,
    FOLD_BY_MASS: tl.constexpr,  # the last pass was top-p, else top-k
    SPLITS_BLOCK: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) + tl.arange(0, 1)
    split = tl.program_id(1)
    live = rows < num_rows
    req, _, _, temperature, gamma = row_context(rows, live, cu_ptr, temperature_ptr, gamma_ptr, batch,
                                                search_steps, IS_TARGET)
    row_max = tl.load(row_max_ptr + rows)
    lo_key, hi_key, lo_mass, goal = _folded(
        rows, req, live, top_k_ptr, top_p_ptr, state_keys_ptr, state_mass_ptr, pivots_ptr,
        num_rows, num_splits, parity, FOLD_BY_MASS, SPLITS_BLOCK, NUM_PIVOTS,
    )
    _store_state(state_keys_ptr, state_mass_ptr, rows, num_rows, parity, lo_key, hi_key, lo_mass, goal,
                 tl.where(split == 0, live, False))
    min_p = tl.load(min_p_ptr + req, mask=live, other=0.0)
    filtered = live & (min_p > 0)
    threshold = key_value(lo_key)[:, None]
    log_min_p = tl.log(min_p)[:, None]
    first, end = _columns(split, split_width, vocab)
    mass = tl.zeros([1], tl.float32)
    for start in range(first, end, BLOCK_V):
        y, mask = processed_tile(logits_ptr, uncond_ptr, rows.to(tl.int64) * vocab, filtered, start, end,
                                 gamma, temperature, HAS_CFG, BLOCK_V)
        keep = mask & kept(y, threshold, row_max[:, None], log_min_p, True)
        mass += tl.sum(tl.where(keep, tl.exp(y - row_max[:, None]), 0.0), axis=1)
    tl.store(min_p_mass_ptr + rows.to(tl.int64) * num_splits + split, mass, mask=filtered)


@triton.jit
def _finish_kernel(
    logits_ptr,  # [num_rows, vocab_size]
    uncond_ptr,  # [num_rows, vocab_size] (HAS_CFG)
    cu_ptr,  # [batch_size + 1]
    temperature_ptr,  # [batch_size] float32
    gamma_ptr,  # [batch_size] float32
    top_k_ptr,  # [batch_size] int64
    top_p_ptr,  # [batch_size] float32
    ids_ptr,  # [num_draft_tokens] draft token ids
    min_p_ptr,  # [batch_size] float32 (HAS_MIN_P)
    row_max_ptr,  # [num_rows] float32
    state_keys_ptr,  # [2, 2, num_rows] int64
    state_mass_ptr,  # [2, 2, num_rows] float32
    pivots_ptr,  # [2, num_rows, num_splits, 4, NUM_PIVOTS] float32
    min_p_mass_ptr,  # [num_rows, num_splits] float32 (HAS_MIN_P)
    lse_ptr,  # [num_rows] float32 out
    threshold_ptr,  # [num_rows] float32 out
    gathered_ptr,  # [num_draft_tokens] float32 out
    num_rows,
    batch,
    vocab,
    search_steps,
    num_splits,
    parity,
    IS_TARGET: tl.constexpr,
    HAS_CFG: tl.constexpr,
    FOLD_BY_MASS: tl.constexpr,  # the last pass was top-p, else top-k
    HAS_MIN_P: tl.constexpr,  # the min-p launch ran and holds the folded bracket
    SPLITS_BLOCK: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
):
    rows = tl.program_id(0) + tl.arange(0, 1)
    live = rows < num_rows
    req, draft_index, has_draft, temperature, gamma = row_context(
        rows, live, cu_ptr, temperature_ptr, gamma_ptr, batch, search_steps, IS_TARGET)
    row_max = tl.load(row_max_ptr + rows)
    log_min_p = tl.full([1], float("-inf"), tl.float32)
    if HAS_MIN_P:
        before = 1 - parity
        threshold = key_value(tl.load(state_keys_ptr + (before * 2) * num_rows + rows))
        kept_mass = tl.load(state_mass_ptr + (before * 2) * num_rows + rows)
        min_p = tl.load(min_p_ptr + req, mask=live, other=0.0)
        log_min_p = tl.log(min_p)
        filtered = live & (min_p > 0)
        splits = tl.arange(0, SPLITS_BLOCK)[None, :]
        parts = tl.load(min_p_mass_ptr + rows[:, None].to(tl.int64) * num_splits + splits,
                        mask=filtered[:, None] & (splits < num_splits), other=0.0)
        kept_mass = tl.where(filtered, tl.sum(parts, axis=1), kept_mass)
    else:
        lo_key, _, kept_mass, _ = _folded(
            rows, req, live, top_k_ptr, top_p_ptr, state_keys_ptr, state_mass_ptr, pivots_ptr,
            num_rows, num_splits, parity, FOLD_BY_MASS, SPLITS_BLOCK, NUM_PIVOTS,
        )
        threshold = key_value(lo_key)
    lse = row_max + tl.log(kept_mass)
    tl.store(lse_ptr + rows, lse, mask=live)
    tl.store(threshold_ptr + rows, threshold, mask=live)
    # Out-of-range ids read column 0 here; the chain rejects them whatever this says.
    x = tl.load(ids_ptr + draft_index, mask=has_draft, other=0).to(tl.int64)
    x = tl.minimum(tl.maximum(x, 0), vocab - 1)
    p_x = sampling_probs(
        logits_ptr, uncond_ptr, rows.to(tl.int64) * vocab + x, has_draft, gamma, temperature,
        row_max, lse, threshold, log_min_p, HAS_CFG, HAS_MIN_P,
    )
    tl.store(gathered_ptr + draft_index, p_x, mask=has_draft)
