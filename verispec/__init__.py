"""verispec: exact speculative decoding with classifier-free guidance."""

from .sampling_params import SamplingParams
from .sample import DraftLogits, DraftProbs, SamplingMetadata, rejection_sample

__version__ = "0.1.0"

__all__ = [
    "DraftLogits",
    "DraftProbs",
    "SamplingMetadata",
    "SamplingParams",
    "rejection_sample",
]
