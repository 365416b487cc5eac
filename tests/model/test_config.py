"""ModelConfig validation and LlamaModel construction errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verispec.model import LlamaModel, ModelConfig

GOOD = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, rope_theta=5000.0, bos_token_id=1, eos_token_ids=(2,))


def test_valid_config_is_frozen() -> None:
    config = ModelConfig(**GOOD)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_layers = 3


@pytest.mark.parametrize("field,value,expected", [
    ("vocab_size", 0, "positive int"),
    ("num_layers", 2.0, "positive int"),
    ("num_kv_heads", 3, "divisor of num_heads=4"),
    ("head_dim", 15, "even"),
    ("rms_norm_eps", -1e-6, "positive number"),
    ("rope_theta", 0.5, "> 1"),
    ("tie_word_embeddings", 1, "bool"),
    ("bos_token_id", 128, r"\[0, vocab_size=128\)"),
    ("eos_token_ids", [2], "tuple"),
    ("eos_token_ids", (2, -1), "tuple"),
])
def test_invalid_field_is_named(field, value, expected) -> None:
    with pytest.raises(ValueError, match=expected) as error:
        ModelConfig(**{**GOOD, field: value})
    assert f"ModelConfig.{field}={value!r}" in str(error.value)


def test_model_rejects_bad_dtype_and_cache_sizes() -> None:
    with pytest.raises(ValueError, match="dtype=torch.float16"):
        LlamaModel(ModelConfig(**GOOD), dtype=torch.float16)
    model = LlamaModel(ModelConfig(**GOOD))
    with pytest.raises(ValueError, match="block_size=0"):
        model.allocate_kv_cache(4, 0)
    caches = model.allocate_kv_cache(3, 8)
    assert len(caches) == 2 and caches[0].shape == (2, 3, 8, 2, 16)
    assert caches[0].dtype == torch.float32 and not caches[0].any()
