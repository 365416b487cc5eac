"""Drafters and speculation bookkeeping."""

from verispec.spec.base import DraftBatch, Drafter, DraftRequest
from verispec.spec.metrics import SpecDecodeStats
from verispec.spec.ngram import NgramDrafter

__all__ = ["Drafter", "DraftRequest", "DraftBatch", "NgramDrafter", "SpecDecodeStats"]
