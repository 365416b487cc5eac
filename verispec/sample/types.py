"""The types shared by the verifier (rejection.py) and its kernels: below both, so the layers
read top-down. Terms (draft, target, accepted, emitted) as in rejection.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Union

import torch

if TYPE_CHECKING:
    from .metadata import SamplingMetadata

PLACEHOLDER_TOKEN_ID = -1  # fills token_ids after a request's emitted tokens


class DraftProbs(NamedTuple):
    """Draft distributions as probabilities (already through the sampling pipeline)."""

    probs: torch.Tensor  # [num_draft_tokens, V]


class DraftLogits(NamedTuple):
    """Draft distributions as raw logits; the verifier applies the request's pipeline (no CFG)."""

    logits: torch.Tensor  # [num_draft_tokens, V]


Draft = Union[DraftProbs, DraftLogits, None]


@dataclass(frozen=True)
class RejectionOutput:
    token_ids: torch.Tensor  # [B, max_K + 1] int64, PLACEHOLDER_TOKEN_ID after the emitted tokens
    num_emitted: torch.Tensor  # [B] int64, num_accepted + 1
    num_accepted: torch.Tensor  # [B] int64
    # Set when a request adjusts its logits (penalties, logit bias, token masks): the target rows
    # after that pre-stage, which log-probabilities read rather than running it again.
    adjusted: AdjustedRows | None = None


@dataclass(frozen=True)
class AdjustedRows:
    """Target rows after the pre-stage of penalties, logit bias and token masks, each penalised
    with its own history (rejection.adjust_rows), and the metadata to process them with."""

    target_logits: torch.Tensor  # [num_draft_tokens + B, V] float32
    sampling: SamplingMetadata
