"""Hugging Face checkpoint directories: config.json + *.safetensors (+ tokenizer files).

Reads the Llama family only, and refuses what the model does not implement (rope scaling,
biases, other activations) instead of running it wrongly. Also writes such a directory: the
GGUF loader caches its dequantized weights in this form (loadable by transformers too).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from verispec.model.config import ModelConfig

_ARCHITECTURES = ("LlamaForCausalLM",)


def _unsupported(directory: Path, what: str, value: object, expected: str) -> ValueError:
    return ValueError(f"model={str(directory)!r} is not supported: config.json has "
                      f"{what}={value!r}, expected {expected}")


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


def _rope_theta(raw: dict[str, Any], directory: Path) -> object:
    # transformers < 5 writes rope_theta + rope_scaling; 5.x writes rope_parameters.
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    if not isinstance(scaling, dict):
        raise _unsupported(directory, "rope_scaling", scaling, "an object or null")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        raise _unsupported(directory, "rope type", rope_type, "'default' (plain Llama RoPE)")
    return raw.get("rope_theta", params.get("rope_theta", 10000.0))


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
    architectures = raw.get("architectures") or []
    if raw.get("model_type") != "llama" and not set(map(str, architectures)) & set(_ARCHITECTURES):
        raise _unsupported(directory, "model_type", raw.get("model_type"), "'llama'")
    for key, ok in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if raw.get(key, ok) != ok:
            raise _unsupported(directory, key, raw[key], repr(ok))
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
            rope_theta=_rope_theta(raw, directory),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings") or False,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos),
        )
    except ValueError as error:
        raise ValueError(f"model={str(directory)!r} has an invalid config.json: {error}") from None


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in the directory (shards included)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model={str(directory)!r} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            weights.update(load_file(str(path)))
        except SafetensorError as error:
            raise ValueError(f"{str(path)!r} is not a valid safetensors file: {error}") from None
    return weights


def write_checkpoint(directory: Path, config: ModelConfig,
                     weights: dict[str, torch.Tensor]) -> None:
    """config.json + model.safetensors in transformers' layout (tokenizer files are separate)."""
    raw = {
        "architectures": list(_ARCHITECTURES),
        "model_type": "llama",
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
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    save_file({name: t.contiguous() for name, t in weights.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
