"""The acceptance chain and the final-row race, in one kernel.

Program (tile, split) walks the drafts of REQUESTS requests (docs/design.md, "The rule":
acceptance and greedy), which reads a few scalars per draft, then races over columns [split *
split_width, ...) of each request's final row: the row after its accepted drafts, holding the
*recovered* token at a rejection (residual max(p - q, 0); p without x for a one-hot drafter) or
the *bonus* token when every draft was accepted. Several splits per request each redo the cheap
chain rather than wait for one another; split 0 writes the outputs, and
final_sample.finish_split_races picks the sampled tokens from the partial winners. With one
split the kernel writes everything itself.

Greedy requests take the target argmax from row_stats, at the same place in the same launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..metadata import SamplingMetadata
from ..types import PLACEHOLDER_TOKEN_ID, RejectionOutput
from . import tiles
from .final_sample import finish_split_races, pack, race, winner
from .pipeline import sampling_probs
from .rows import RowStats
from .streams import ACCEPT, SAMPLE, exponential, stream, uniform

DRAFT_ONE_HOT = tl.constexpr(0)
DRAFT_PROBS = tl.constexpr(1)
DRAFT_LOGITS = tl.constexpr(2)
_PLACEHOLDER = tl.constexpr(PLACEHOLDER_TOKEN_ID)


def accept_and_sample(
    target: torch.Tensor,  # [num_rows, V] target logits, or probabilities when target_stats is None
    target_stats: RowStats | None,
    uncond_logits: torch.Tensor | None,  # [num_rows, V] CFG rows (logits only), or None
    draft: torch.Tensor | None,  # [num_draft_tokens, V] probabilities, or logits when draft_stats is given
    draft_stats: RowStats | None,
    draft_token_ids: torch.Tensor,  # [num_draft_tokens]
    cu_num_draft_tokens: torch.Tensor,  # [B + 1] on the device
    keys: torch.Tensor,  # [B] int64 random keys
    sampling: SamplingMetadata | None,  # None: probabilities in, every request sampled
    max_spec_len: int,
) -> RejectionOutput:
    batch = keys.shape[0]
    vocab = target.shape[1]
    device = target.device
    any_greedy = sampling is not None and not sampling.all_random
    all_greedy = sampling is not None and sampling.all_greedy
    t = tiles.request_tiles(batch, vocab, device, racing=not all_greedy)
    out = RejectionOutput(
        token_ids=tiles.empty((batch, max_spec_len + 1), torch.int64, device),
        num_emitted=tiles.empty(batch, torch.int64, device),
        num_accepted=tiles.empty(batch, torch.int64, device),
    )
    # Pointer arguments that the compiled variant never reads get any tensor.
    unused = keys
    split = t.num_splits > 1
    partial = tiles.empty((batch, t.num_splits, 2), torch.int64, device) if split else unused
    target_stats_ptrs = (unused,) * 5 if target_stats is None else tuple(target_stats)
    draft_stats_ptrs = (unused,) * 4 if draft_stats is None else (
        draft_stats.row_max, draft_stats.lse, draft_stats.threshold, draft_stats.gathered,
    )
    if draft is None:
        draft_kind = DRAFT_ONE_HOT.value
    else:
        draft_kind = (DRAFT_PROBS if draft_stats is None else DRAFT_LOGITS).value
    has_cfg = uncond_logits is not None and sampling is not None and sampling.any_cfg
    is_greedy = sampling.is_greedy.view(torch.uint8) if any_greedy else None
    _chain_kernel[(triton.cdiv(batch, t.requests), t.num_splits)](
        out.token_ids,
        out.num_accepted,
        out.num_emitted,
        partial,
        cu_num_draft_tokens,
        draft_token_ids,
        keys,
        unused if is_greedy is None else is_greedy,
        unused if sampling is None else sampling.temperature,
        unused if sampling is None else sampling.min_p,
        unused if sampling is None else sampling.guidance_scale,
        target,
        uncond_logits if has_cfg else target,
        *target_stats_ptrs,
        target if draft is None else draft,
        *draft_stats_ptrs,
        batch,
        vocab,
        max_spec_len,
        t.split_width,
        TARGET_PROBS=target_stats is None,
        DRAFT_KIND=draft_kind,
        HAS_CFG=has_cfg,
        HAS_MIN_P=sampling is not None and sampling.any_min_p,
        ANY_GREEDY=any_greedy,
        ALL_GREEDY=all_greedy,
        SPLIT=split,
        REQUESTS=t.requests,
        BLOCK_V=t.block_v,
        num_warps=t.num_warps,
    )
    if split:
        finish_split_races(out.token_ids, out.num_accepted, partial, is_greedy, t.requests)
    return out


@triton.jit
def _chain_kernel(
    token_ids_ptr,  # [batch_size, max_spec_len + 1] int64 out
    num_accepted_ptr,  # [batch_size] int64 out
    num_emitted_ptr,  # [batch_size] int64 out
    partial_ptr,  # [batch_size, num_splits, 2] int64 out, packed race winners (SPLIT)
    cu_ptr,  # [batch_size + 1] cumulative draft counts
    ids_ptr,  # [num_draft_tokens] draft token ids
    keys_ptr,  # [batch_size] int64 random keys
    greedy_ptr,  # [batch_size] uint8 (ANY_GREEDY)
    temperature_ptr,  # [batch_size] float32 (logits in)
    min_p_ptr,  # [batch_size] float32 (HAS_MIN_P)
    gamma_ptr,  # [batch_size] float32 (HAS_CFG)
    target_ptr,  # [num_rows, vocab_size] logits, or probabilities (TARGET_PROBS)
    uncond_ptr,  # [num_rows, vocab_size] (HAS_CFG)
    row_max_ptr,  # [num_rows] float32 (logits in)
    lse_ptr,  # [num_rows] float32 (logits in)
    threshold_ptr,  # [num_rows] float32 (logits in)
    argmax_ptr,  # [num_rows] int32 (ANY_GREEDY)
    p_draft_ptr,  # [num_draft_tokens] float32 p(x) (logits in)
    draft_ptr,  # [num_draft_tokens, vocab_size] probabilities or logits (DRAFT_KIND)
    q_row_max_ptr,  # [num_draft_tokens] float32 (DRAFT_LOGITS)
    q_lse_ptr,  # [num_draft_tokens] float32 (DRAFT_LOGITS)
    q_threshold_ptr,  # [num_draft_tokens] float32 (DRAFT_LOGITS)
    q_draft_ptr,  # [num_draft_tokens] float32 q(x) (DRAFT_LOGITS)
    batch,
    vocab,
    max_spec_len,
    split_width,
    TARGET_PROBS: tl.constexpr,
    DRAFT_KIND: tl.constexpr,
    HAS_CFG: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    ANY_GREEDY: tl.constexpr,
    ALL_GREEDY: tl.constexpr,
    SPLIT: tl.constexpr,
    REQUESTS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    req = tl.program_id(0) * REQUESTS + tl.arange(0, REQUESTS)
    split = tl.program_id(1)
    live = req < batch
    first_draft = tl.load(cu_ptr + req, mask=live, other=0).to(tl.int64)
    num_draft = tl.load(cu_ptr + req + 1, mask=live, other=0).to(tl.int64) - first_draft
    first_row = first_draft + req
    key = tl.load(keys_ptr + req, mask=live, other=0)
    greedy = tl.zeros([REQUESTS], tl.int1)
    if ANY_GREEDY:
        greedy = tl.load(greedy_ptr + req, mask=live, other=0) != 0

    num_accepted = tl.zeros([REQUESTS], tl.int64)
    walking = live
    for i in range(max_spec_len):
        walking = walking & (i < num_draft)
        x = tl.load(ids_ptr + first_draft + i, mask=walking, other=-1).to(tl.int64)
        in_range = (x >= 0) & (x < vocab)  # out-of-range ids (unvalidated input) are rejected
        x = tl.minimum(tl.maximum(x, 0), vocab - 1)
        if ANY_GREEDY:
            # Rule 4: a greedy request accepts while the draft is the target argmax.
            top = tl.load(argmax_ptr + first_row + i, mask=walking & greedy, other=-1)
            accept_greedy = x == top
        if not ALL_GREEDY:
            sampled = walking & ~greedy
            if TARGET_PROBS:
                p = tl.load(target_ptr + (first_row + i) * vocab + x, mask=sampled, other=0.0)
            else:
                p = tl.load(p_draft_ptr + first_draft + i, mask=sampled, other=0.0)
            if DRAFT_KIND == DRAFT_PROBS:
                q = tl.load(draft_ptr + (first_draft + i) * vocab + x, mask=sampled, other=0.0)
            elif DRAFT_KIND == DRAFT_LOGITS:
                q = tl.load(q_draft_ptr + first_draft + i, mask=sampled, other=0.0)
            else:
                q = tl.full([REQUESTS], 1.0, tl.float32)
            u = uniform(key, tl.zeros([REQUESTS], tl.int64) + i, ACCEPT)
            # Rule 1: accept with probability min(1, p / q) as u * q < p; q = 0 rejects.
            q64 = q.to(tl.float64)
            accept_sampled = (q64 > 0) & (u * q64 < p.to(tl.float64))
        if ALL_GREEDY:
            accept = accept_greedy
        elif ANY_GREEDY:
            accept = tl.where(greedy, accept_greedy, accept_sampled)
        else:
            accept = accept_sampled
        walking = walking & in_range & accept
        num_accepted += walking.to(tl.int64)

    # Rules 2 and 3: the final row is the first rejected position, or the bonus row.
    final_row = first_row + num_accepted
    final_draft = first_draft + num_accepted
    rejected = num_accepted < num_draft
    final_token = tl.full([REQUESTS], _PLACEHOLDER, tl.int64)
    if ANY_GREEDY:
        top = tl.load(argmax_ptr + final_row, mask=live & greedy, other=0).to(tl.int64)
        final_token = tl.where(greedy, top, final_token)
    if not ALL_GREEDY:
        racing = live & ~greedy
        # A slot whose id is out of range (a caller's -1 placeholder) drafted nothing: its
        # token follows p, whatever q says.
        final_id = tl.load(ids_ptr + final_draft, mask=racing & rejected, other=-1)
        residual = racing & rejected & (final_id >= 0) & (final_id < vocab)
        stream_bits = stream(key, num_accepted, SAMPLE)[:, None]
        if not TARGET_PROBS:
            temperature = tl.load(temperature_ptr + req, mask=racing, other=1.0)
            temperature = tl.where(temperature > 0, temperature, 1.0)[:, None]
            gamma = tl.load(gamma_ptr + req, mask=racing, other=1.0)[:, None]
            row_max = tl.load(row_max_ptr + final_row, mask=racing, other=0.0)[:, None]
            lse = tl.load(lse_ptr + final_row, mask=racing, other=0.0)[:, None]
            threshold = tl.load(threshold_ptr + final_row, mask=racing, other=0.0)[:, None]
            log_min_p = tl.full([REQUESTS, 1], float("-inf"), tl.float32)
            if HAS_MIN_P:
                log_min_p = tl.log(tl.load(min_p_ptr + req, mask=racing, other=0.0))[:, None]
        if DRAFT_KIND == DRAFT_ONE_HOT:
            rejected_id = tl.where(residual, final_id, -1)[:, None]
        if DRAFT_KIND == DRAFT_LOGITS:
            q_row_max = tl.load(q_row_max_ptr + final_draft, mask=residual, other=0.0)[:, None]
            q_lse = tl.load(q_lse_ptr + final_draft, mask=residual, other=0.0)[:, None]
            q_threshold = tl.load(q_threshold_ptr + final_draft, mask=residual, other=0.0)[:, None]
        best_w = tl.zeros([REQUESTS], tl.float32)
        best_w_index = tl.zeros([REQUESTS], tl.int32)
        best_p = tl.zeros([REQUESTS], tl.float32)
        best_p_index = tl.zeros([REQUESTS], tl.int32)
        split_start = split * split_width
        for chunk in range(0, split_width, BLOCK_V):
            start = split_start + chunk
            cols = start + tl.arange(0, BLOCK_V)[None, :]
            mask = racing[:, None] & (cols < vocab) & (cols < split_start + split_width)
            if TARGET_PROBS:
                p = tl.load(target_ptr + final_row[:, None] * vocab + cols, mask=mask, other=0.0)
                p = p.to(tl.float32)
            else:
                p = sampling_probs(
                    target_ptr, uncond_ptr, final_row[:, None] * vocab + cols, mask, gamma,
                    temperature, row_max, lse, threshold, log_min_p, HAS_CFG, HAS_MIN_P,
                )
            if DRAFT_KIND == DRAFT_ONE_HOT:
                w = tl.where(cols == rejected_id, 0.0, p)
            else:
                q_mask = mask & residual[:, None]
                if DRAFT_KIND == DRAFT_PROBS:
                    q = tl.load(draft_ptr + final_draft[:, None] * vocab + cols, mask=q_mask, other=0.0)
                    q = q.to(tl.float32)
                else:
                    q = sampling_probs(
                        draft_ptr, draft_ptr, final_draft[:, None] * vocab + cols, q_mask, 1.0,
                        temperature, q_row_max, q_lse, q_threshold, log_min_p, False, HAS_MIN_P,
                    )
                w = tl.where(residual[:, None], tl.maximum(p - q, 0.0), p)
            expo = exponential(stream_bits, cols)
            best_w, best_w_index = race(best_w, best_w_index, w, expo, start)
            best_p, best_p_index = race(best_p, best_p_index, p, expo, start)
        packed_w = pack(best_w, best_w_index)
        packed_p = pack(best_p, best_p_index)
        if SPLIT:
            partial = partial_ptr + (req.to(tl.int64) * tl.num_programs(1) + split) * 2
            tl.store(partial, packed_w, mask=racing)
            tl.store(partial + 1, packed_p, mask=racing)
        else:
            # A residual with no mass means the rejection had probability 0: sample p instead.
            final_token = tl.where(racing, winner(packed_w, packed_p), final_token)

    # Split 0 writes the accepted drafts, the final token (a placeholder that
    # finish_split_races fills when the race was split) and placeholders after it.
    writer = tl.where(split == 0, live, False)
    slots = max_spec_len + 1
    for s in range(slots):
        accepted = s < num_accepted
        x = tl.load(ids_ptr + first_draft + s, mask=writer & accepted, other=0).to(tl.int64)
        token = tl.where(accepted, x, tl.where(s == num_accepted, final_token, _PLACEHOLDER))
        tl.store(token_ids_ptr + req.to(tl.int64) * slots + s, token, mask=writer)
    tl.store(num_accepted_ptr + req, num_accepted, mask=writer)
    tl.store(num_emitted_ptr + req, num_accepted + 1, mask=writer)
