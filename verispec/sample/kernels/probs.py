"""Probabilities in, with FlashInfer's chain_speculative_sampling contract.

For callers that already hold the distributions after their sampling pipeline: target and draft
rows are read as they are (no normaliser to compute, so no statistics pass), every request is
sampled (no greedy), and every request has the same K. One launch, plus the combine of a split
final-row race.
"""

from __future__ import annotations

import torch

from ..types import RejectionOutput
from .chain import accept_and_sample


def rejection_sample_probs_triton(
    draft_probs: torch.Tensor,  # [B, K, V]
    draft_token_ids: torch.Tensor,  # [B, K] int
    target_probs: torch.Tensor,  # [B, K + 1, V]
    keys: torch.Tensor,  # [B] int64 random keys
) -> RejectionOutput:
    batch, k, vocab = draft_probs.shape
    device = target_probs.device
    if k > 0:
        cu = torch.arange(0, (batch + 1) * k, k, device=device)
    else:
        cu = torch.zeros(batch + 1, dtype=torch.int64, device=device)
    return accept_and_sample(
        target_probs.contiguous().view(batch * (k + 1), vocab),
        None,
        None,
        draft_probs.contiguous().view(batch * k, vocab),
        None,
        draft_token_ids.contiguous().view(batch * k),
        cu,
        keys,
        None,
        k,
    )
