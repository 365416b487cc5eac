"""The model: one decoder for Llama, Mistral, Qwen2/3, Gemma 1/2/3 and Phi-3 over a paged KV
cache, its loaders and tokenizer."""

from verispec.model.attention import AttentionMetadata
from verispec.model.config import ModelConfig
from verispec.model.llama import LlamaModel
from verispec.model.loader import converted_checkpoint_dir, default_model_path, load_model
from verispec.model.tokenizer import IncrementalDecoder, Tokenizer

__all__ = [
    "AttentionMetadata",
    "IncrementalDecoder",
    "LlamaModel",
    "ModelConfig",
    "Tokenizer",
    "converted_checkpoint_dir",
    "default_model_path",
    "load_model",
]
