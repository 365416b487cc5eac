"""Drafters and speculation bookkeeping."""

from verispec.spec_decode.base import DraftBatch, Drafter, DraftRequest
from verispec.spec_decode.metrics import SpecDecodeStats
from verispec.spec_decode.ngram import NgramDrafter

__all__ = ["Drafter", "DraftRequest", "DraftBatch", "NgramDrafter", "SpecDecodeStats"]
