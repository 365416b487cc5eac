"""Everything between logits and emitted tokens; knows nothing of models or schedulers."""

from .metadata import SamplingMetadata
from .rejection import rejection_sample, rejection_sample_probs
from .types import PLACEHOLDER_TOKEN_ID, DraftLogits, DraftProbs, RejectionOutput

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "DraftLogits",
    "DraftProbs",
    "RejectionOutput",
    "SamplingMetadata",
    "rejection_sample",
    "rejection_sample_probs",
]
