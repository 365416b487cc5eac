"""ModelConfig validation and LlamaModel construction errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verispec.model import LlamaModel, ModelConfig
from verispec.model.config import RopeScaling

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
    ("hidden_act", "relu", "one of"),
    ("sliding_window", 0, "None or a positive int"),
    ("layer_types", ("sliding_attention",), "num_layers=2 entries"),
    ("attn_logit_softcap", -1.0, "None or a positive number"),
    ("norm_weight_offset", 0.5, "0.0 or 1.0"),
    ("qk_norm", "yes", "bool"),
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
    assert caches[0].dtype == torch.float32
    # SDPA (bfloat16 here) needs zeros in unwritten slots; the row-by-row attention reads none.
    sdpa = LlamaModel(ModelConfig(**GOOD), dtype=torch.bfloat16)
    assert not sdpa.rowwise_attention and not sdpa.allocate_kv_cache(3, 8)[0].any()


@pytest.mark.parametrize("fields,expected", [
    (dict(rope_type="ntk"), "rope_scaling.rope_type='ntk'"),
    (dict(rope_type="llama3", factor=8.0), "rope_scaling.original_max_position_embeddings=None"),
    (dict(rope_type="linear", factor=0.0), "rope_scaling.factor=0.0"),
    (dict(rope_type="longrope", original_max_position_embeddings=64, short_factor=(1.0,),
          long_factor=(1.0,)), "head_dim / 2 = 8 entries"),
])
def test_invalid_rope_scaling_is_named(fields, expected) -> None:
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(**GOOD, rope_scaling=RopeScaling(**fields))


def test_config_round_trips_through_a_dict() -> None:
    config = ModelConfig(**GOOD, sliding_window=8, layer_types=("sliding_attention", "full_attention"),
                         rope_scaling=RopeScaling("longrope", original_max_position_embeddings=64,
                                                  short_factor=(1.0,) * 8, long_factor=(2.0,) * 8))
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert [config.window_of(i) for i in range(2)] == [8, None]
