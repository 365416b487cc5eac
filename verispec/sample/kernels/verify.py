"""Logits in: the Triton path of rejection_sample, with the contract of rejection._native.

Two launches in the common case, three with draft logits, none of them waiting on the host:
row_stats over the target rows (CFG, temperature, filters, p(x), argmax), row_stats over the
draft logit rows when the draft comes as logits (q(x)), then the chain-and-race kernel (plus a
small combine when the final-row race is split across programs).
"""

from __future__ import annotations

import torch

from ..metadata import SamplingMetadata
from ..types import Draft, DraftLogits, RejectionOutput
from .chain import accept_and_sample
from .row_stats import row_stats


def rejection_sample_triton(
    target_logits: torch.Tensor,  # [num_draft_tokens + B, V] float32 / bfloat16 / float16
    draft_token_ids: torch.Tensor,  # [num_draft_tokens] int
    cu_num_draft_tokens: torch.Tensor,  # [B + 1] int, leading 0
    sampling: SamplingMetadata,
    draft: Draft,
    uncond_logits: torch.Tensor | None,  # [num_draft_tokens + B, V] CFG rows, or None
    max_num_draft_tokens: int,
) -> RejectionOutput:
    """Same arguments and semantics as rejection._native; tensors on a CUDA device (or any
    device under TRITON_INTERPRET=1)."""
    cu = cu_num_draft_tokens.to(target_logits.device)
    target = target_logits.contiguous()
    ids = draft_token_ids.contiguous()
    uncond = uncond_logits.contiguous() if uncond_logits is not None and sampling.any_cfg else None
    target_stats = row_stats(target, uncond, ids, cu, sampling, is_target=True)
    draft_rows, draft_stats = None, None
    if draft is not None and not sampling.all_greedy:  # greedy requests never read q
        if isinstance(draft, DraftLogits):
            draft_rows = draft.logits.contiguous()
            draft_stats = row_stats(draft_rows, None, ids, cu, sampling, is_target=False)
        else:
            draft_rows = draft.probs.contiguous()
    return accept_and_sample(
        target, target_stats, uncond, draft_rows, draft_stats, ids, cu, sampling.keys, sampling,
        max_num_draft_tokens,
    )
