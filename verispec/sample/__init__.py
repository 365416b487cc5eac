"""Everything between logits and emitted tokens; knows nothing of models or schedulers."""

from .metadata import SamplingMetadata
from .rejection import rejection_sample, rejection_sample_probs
from .tree import TreeOutput, verify_tree
from .types import PLACEHOLDER_TOKEN_ID, DraftLogits, DraftProbs, RejectionOutput

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "DraftLogits",
    "DraftProbs",
    "RejectionOutput",
    "SamplingMetadata",
    "TreeOutput",
    "rejection_sample",
    "rejection_sample_probs",
    "verify_tree",
]
