"""Hugging Face config.json of each supported family -> ModelConfig, and fused checkpoint tensors
-> the Llama names the model loads.

One function per family difference, not per family: every family is Llama plus options
(verispec.model.config). Anything a family can set that the model does not implement (partial
rotary, an unknown rope type, a multimodal wrapper) is refused with one line naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from verispec.model.config import LAYER_TYPES, ROPE_TYPES, ModelConfig, RopeScaling
from verispec.model.quant.formats import QuantizedWeight

# model_type -> the architectures entry transformers writes for it.
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
_GEMMAS = ("gemma", "gemma2", "gemma3_text")
# freq_factors is llama.cpp's, not a config.json rope type.
HF_ROPE_TYPES = ("default",) + tuple(t for t in ROPE_TYPES if t != "freq_factors")


class Unsupported(ValueError):
    """A checkpoint option the model does not implement (the message names it)."""


def _unsupported(directory: Path, what: str, value: object, expected: str) -> Unsupported:
    return Unsupported(f"model={str(directory)!r} is not supported: config.json has "
                       f"{what}={value!r}, expected {expected}")


def family_of(raw: dict[str, Any], directory: Path) -> str:
    """The model_type, from model_type or (older files) architectures."""
    model_type = raw.get("model_type")
    if model_type in FAMILIES:
        return model_type
    by_architecture = {v: k for k, v in FAMILIES.items()}
    for name in raw.get("architectures") or []:
        if model_type is None and name in by_architecture:
            return by_architecture[name]
    raise _unsupported(directory, "model_type", model_type,
                       f"one of {', '.join(FAMILIES)} (text-only checkpoints)")


def _scaling(params: dict[str, Any], raw: dict[str, Any], directory: Path,
             max_positions: object) -> tuple[object, RopeScaling | None]:
    """(theta, scaling) from one rope_parameters (or rope_scaling) object."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = {"su": "longrope"}.get(rope_type, rope_type)  # Phi-3's first config.json files
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _unsupported(directory, "partial_rotary_factor", partial, "1.0 (rotary over the whole head)")
    if rope_type == "default":
        return theta, None
    if rope_type not in HF_ROPE_TYPES:
        raise _unsupported(directory, "rope type", rope_type, f"one of {HF_ROPE_TYPES}")
    original = params.get("original_max_position_embeddings",
                          raw.get("original_max_position_embeddings"))
    factor = params.get("factor")
    if factor is None and rope_type in ("longrope", "yarn") and isinstance(original, int) \
            and isinstance(max_positions, int) and original > 0:
        factor = max_positions / original
    optional = {key: params[key] for key in ("low_freq_factor", "high_freq_factor", "beta_fast",
                                              "beta_slow", "attention_factor", "mscale",
                                              "mscale_all_dim", "truncate")
                if params.get(key) is not None}
    for key in ("short_factor", "long_factor"):
        if params.get(key) is not None:
            optional[key] = tuple(params[key])
    return theta, RopeScaling(rope_type, factor=1.0 if factor is None else factor,
                              original_max_position_embeddings=original, **optional)


def _rope(raw: dict[str, Any], family: str, directory: Path) -> dict[str, Any]:
    """rope_theta, rope_scaling and local_rope_theta. transformers < 5 wrote rope_theta +
    rope_scaling (+ Gemma 3's rope_local_base_freq); 5.x writes rope_parameters, keyed by layer
    type for Gemma 3."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise _unsupported(directory, "rope_parameters", params, "an object or null")
    max_positions = raw.get("max_position_embeddings")
    if set(params) & set(LAYER_TYPES):
        theta, scaling = _scaling(params.get("full_attention") or {}, raw, directory, max_positions)
        local, local_scaling = _scaling(params.get("sliding_attention") or {}, raw, directory,
                                        max_positions)
        if local_scaling is not None:
            raise _unsupported(directory, "sliding_attention rope type", local_scaling.rope_type,
                               "'default'")
        return {"rope_theta": theta, "rope_scaling": scaling, "local_rope_theta": local}
    theta, scaling = _scaling(params, raw, directory, max_positions)
    out = {"rope_theta": theta, "rope_scaling": scaling}
    if family == "gemma3_text":
        out["local_rope_theta"] = raw.get("rope_local_base_freq", 10000.0)
    return out


def _layer_types(raw: dict[str, Any], family: str) -> dict[str, Any]:
    """sliding_window and layer_types (transformers' defaults where an older file lacks them)."""
    window = raw.get("sliding_window")
    layers = raw.get("num_hidden_layers")
    types = raw.get("layer_types")
    if family in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        window = None
    if window is None or not isinstance(layers, int):
        return {"sliding_window": window}
    if types is None and family in ("qwen2", "qwen3"):
        first = raw.get("max_window_layers", layers)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    elif types is None and family in ("gemma2", "gemma3_text"):
        period = 2 if family == "gemma2" else raw.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % period else "full_attention"
                 for i in range(layers)]
    return {"sliding_window": window, "layer_types": tuple(types or ())}


def _bool(raw: dict[str, Any], key: str, default: bool) -> object:
    value = raw.get(key)
    return default if value is None else value


def config_fields(raw: dict[str, Any], directory: Path) -> dict[str, Any]:
    """ModelConfig's family-specific fields from config.json (the shapes are read elsewhere)."""
    family = family_of(raw, directory)
    gemma = family in _GEMMAS
    act = raw.get("hidden_activation") or raw.get("hidden_act") or \
        ("gelu_pytorch_tanh" if gemma else "silu")
    if gemma and act == "gelu":  # Gemma's first releases said "gelu" for the tanh form, as
        act = "gelu_pytorch_tanh"  # transformers reads it too
    bias = _bool(raw, "attention_bias", False)
    fields: dict[str, Any] = {
        "hidden_act": act,
        "tie_word_embeddings": _bool(raw, "tie_word_embeddings", gemma),
        "qkv_bias": True if family == "qwen2" else bias,
        "o_bias": False if family == "qwen2" else bias,
        "mlp_bias": _bool(raw, "mlp_bias", False),
        "qk_norm": family in ("qwen3", "gemma3_text"),
        **_rope(raw, family, directory),
        **_layer_types(raw, family),
    }
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise _unsupported(directory, "hidden_act", act, "'silu' or 'gelu_pytorch_tanh'")
    if gemma:
        hidden = raw.get("hidden_size")
        fields.update(norm_weight_offset=1.0,
                      embedding_scale=hidden ** 0.5 if isinstance(hidden, int) and hidden > 0 else 1.0)
    if family in ("gemma2", "gemma3_text"):
        scalar = raw.get("query_pre_attn_scalar", 256)
        fields.update(sandwich_norms=True,
                      attention_scale=scalar ** -0.5 if isinstance(scalar, (int, float)) and scalar > 0 else scalar,
                      attn_logit_softcap=raw.get("attn_logit_softcapping",
                                                 50.0 if family == "gemma2" else None),
                      final_logit_softcap=raw.get("final_logit_softcapping",
                                                  30.0 if family == "gemma2" else None))
    return fields


Weight = torch.Tensor | QuantizedWeight


def _split_rows(tensor: Weight, widths: list[int]) -> list[Weight]:
    if isinstance(tensor, torch.Tensor):
        return list(tensor.split(widths))  # views, no copy
    starts = [sum(widths[:i]) for i in range(len(widths))]
    return [tensor.select_rows(torch.arange(s, s + w)) for s, w in zip(starts, widths)]


def fuse_for(model_type: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of split_fused for a family whose transformers class holds fused tensors
    (Phi-3); other families' weights are returned as they are."""
    if model_type != "phi3":
        return weights
    out = dict(weights)
    for name in weights:
        if name.endswith("self_attn.q_proj.weight"):
            base = name[: -len("q_proj.weight")]
            out[base + "qkv_proj.weight"] = torch.cat([out.pop(f"{base}{x}_proj.weight") for x in "qkv"])
        elif name.endswith("mlp.gate_proj.weight"):
            base = name[: -len("gate_proj.weight")]
            out[base + "gate_up_proj.weight"] = torch.cat([out.pop(base + "gate_proj.weight"),
                                                           out.pop(base + "up_proj.weight")])
    return out


def split_fused(weights: dict[str, Weight], config: ModelConfig) -> dict[str, Weight]:
    """Phi-3's fused self_attn.qkv_proj and mlp.gate_up_proj split into Llama's q/k/v and
    gate/up: the model fuses them again in its own layout."""
    q_width = config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    out: dict[str, Weight] = {}
    for name, tensor in weights.items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith("self_attn.qkv_proj") and tensor.shape[0] == q_width + 2 * kv_width:
            base = prefix[: -len("qkv_proj")]
            for part, piece in zip("qkv", _split_rows(tensor, [q_width, kv_width, kv_width])):
                out[f"{base}{part}_proj.{leaf}"] = piece
        elif prefix.endswith("mlp.gate_up_proj") and tensor.shape[0] == 2 * inter:
            base = prefix[: -len("gate_up_proj")]
            gate, up = _split_rows(tensor, [inter, inter])
            out[f"{base}gate_proj.{leaf}"], out[f"{base}up_proj.{leaf}"] = gate, up
        else:
            out[name] = tensor
    return out
