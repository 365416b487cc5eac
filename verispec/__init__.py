"""verispec: exact speculative decoding with classifier-free guidance."""

from .config import CacheConfig, DraftCost, DynamicTree, EngineConfig, SpeculativeConfig, StructuredOutputConfig
from .sampling_params import SamplingParams
from .sample import DraftLogits, DraftProbs, SamplingMetadata, rejection_sample


def __getattr__(name: str):
    # LLM pulls in the model and engine; import it on first use so the sampler stays light.
    if name == "LLM":
        from .engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'verispec' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "CacheConfig",
    "DraftCost",
    "DynamicTree",
    "EngineConfig",
    "SpeculativeConfig",
    "StructuredOutputConfig",
    "DraftLogits",
    "LLM",
    "DraftProbs",
    "SamplingMetadata",
    "SamplingParams",
    "rejection_sample",
]
