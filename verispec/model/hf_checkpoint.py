"""Hugging Face checkpoint directories: config.json + *.safetensors (+ tokenizer files).

Reads the families of verispec.model.families (Llama, Mistral, Qwen2/3, Gemma 1/2/3, Phi-3),
and refuses what the model does not implement instead of running it wrongly. Also writes such a
directory: the GGUF loader caches its dequantized weights in this form, with the exact
ModelConfig under config.json's "verispec_config" (read back first), and the family's own keys
so that transformers loads it too.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from verispec.model.config import ModelConfig
from verispec.model.families import FAMILIES, config_fields, fuse_for, split_fused

# config.json key holding ModelConfig.to_dict() in directories this module writes.
OWN_CONFIG_KEY = "verispec_config"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a checkpoint file; ValueError naming the file when it is not one."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError both are
        raise ValueError(f"{str(path)!r} is not valid UTF-8 JSON: {error}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{str(path)!r} holds a JSON {type(raw).__name__}: expected an object")
    return raw


def _as_ids(value: object) -> list[object]:
    # One id or a list of them; ModelConfig checks that they are ids.
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _required(raw: dict[str, Any], key: str, directory: Path) -> object:
    if raw.get(key) is None:
        raise ValueError(f"model={str(directory)!r} is invalid: config.json lacks {key!r}")
    return raw[key]


def _default_head_dim(hidden: object, heads: object) -> int | None:
    # None when either is not a positive int: ModelConfig then names that one, checked first.
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (hidden, heads))
    return hidden // heads if ok else None


def read_config(directory: Path) -> ModelConfig:
    """ModelConfig from config.json (+ generation_config.json for the stop tokens).

    Every problem (a missing key, a value of the wrong type or size) is a ValueError naming the
    directory and the key."""
    raw = read_json(directory / "config.json")
    if isinstance(raw.get(OWN_CONFIG_KEY), dict):
        try:
            return ModelConfig.from_dict(raw[OWN_CONFIG_KEY])
        except (TypeError, ValueError) as error:
            raise ValueError(f"model={str(directory)!r} has an invalid config.json "
                             f"{OWN_CONFIG_KEY}: {error}") from None
    fields = config_fields(raw, directory)
    eos = _as_ids(raw.get("eos_token_id"))
    generation_path = directory / "generation_config.json"
    if generation_path.is_file():
        generation = read_json(generation_path)
        eos += [t for t in _as_ids(generation.get("eos_token_id")) if t not in eos]
    hidden = _required(raw, "hidden_size", directory)
    heads = _required(raw, "num_attention_heads", directory)
    try:
        return ModelConfig(
            vocab_size=_required(raw, "vocab_size", directory),
            hidden_size=hidden,
            intermediate_size=_required(raw, "intermediate_size", directory),
            num_layers=_required(raw, "num_hidden_layers", directory),
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or _default_head_dim(hidden, heads),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos),
            **fields,
        )
    except ValueError as error:
        raise ValueError(f"model={str(directory)!r} has an invalid config.json: {error}") from None


def read_weights(directory: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in the directory (shards included), fused
    projections split into Llama's names (families.split_fused)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model={str(directory)!r} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            weights.update(load_file(str(path)))
        except SafetensorError as error:
            raise ValueError(f"{str(path)!r} is not a valid safetensors file: {error}") from None
    return split_fused(weights, config)


def _family_keys(config: ModelConfig) -> dict[str, Any]:
    """The keys beyond Llama's that transformers reads for the config's options."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "freq_factors":
        # transformers has no such type; its longrope with equal factors and no attention
        # factor divides each frequency the same way.
        rope.update(rope_type="longrope", factor=1.0, attention_factor=1.0,
                    original_max_position_embeddings=config.max_position_embeddings,
                    short_factor=list(scaling.short_factor), long_factor=list(scaling.short_factor))
    elif scaling is not None:
        rope.update({k: list(v) if isinstance(v, tuple) else v
                     for k, v in dataclasses.asdict(scaling).items() if v is not None and v != ()})
    original = rope.get("original_max_position_embeddings")
    if config.local_rope_theta is not None:
        rope = {"full_attention": rope, "sliding_attention": {
            "rope_type": "default", "rope_theta": config.local_rope_theta}}
    keys: dict[str, Any] = {"rope_parameters": rope, "attention_bias": config.o_bias,
                            "mlp_bias": config.mlp_bias, "sliding_window": config.sliding_window,
                            "use_sliding_window": config.sliding_window is not None}
    if original is not None:  # Phi3Config's own default would override the rope's
        keys["original_max_position_embeddings"] = original
    if config.layer_types:
        keys["layer_types"] = list(config.layer_types)
    if config.attention_scale is not None:
        scalar = config.attention_scale ** -2
        keys["query_pre_attn_scalar"] = round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar
    keys["attn_logit_softcapping"] = config.attn_logit_softcap
    keys["final_logit_softcapping"] = config.final_logit_softcap
    keys["hidden_activation"] = config.hidden_act
    return keys


def write_checkpoint(directory: Path, config: ModelConfig, weights: dict[str, torch.Tensor],
                     model_type: str = "llama") -> None:
    """config.json + model.safetensors in transformers' layout (tokenizer files are separate);
    model_type: one of families.FAMILIES, what transformers builds from it."""
    raw = {
        "architectures": [FAMILIES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids),
        "pad_token_id": None,  # not a family default that may lie outside this vocabulary
        "hidden_act": config.hidden_act,
        "torch_dtype": "float32",
        **_family_keys(config),
        OWN_CONFIG_KEY: config.to_dict(),
    }
    (directory / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    save_file({name: t.contiguous() for name, t in fuse_for(model_type, weights).items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
