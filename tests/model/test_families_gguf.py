"""The family checkpoints of test_families converted to GGUF as llama.cpp's converter writes
them (tensor names from the gguf package's own map; q/k rows permuted for llama only; Gemma's
norms stored as 1 + w; Phi-3's projections fused and its longrope factors as tensors) load to
transformers' logits."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch

from transformers import AutoModelForCausalLM

from verispec.model import converted_checkpoint_dir, load_model

from .conftest import llama_cpp_permute, write_shape, write_tiny_vocab
from .test_families import FAMILIES, _ids, make_hf
from .test_llama import hf_logits, run_schedule

# test_families id -> (GGUF architecture, options changed). Gemma 2/3 use head_dim for
# query_pre_attn_scalar: llama.cpp scales by head_dim ** -0.5 except in the 27B models; its
# qwen2 has no sliding window (Qwen2.5 checkpoints leave it off).
_HEAD_DIM_SCALAR = {"query_pre_attn_scalar": 16}
CONVERTED = {"llama-linear-tied": ("llama", {}), "llama3-rope-biases": ("llama", {}),
             "qwen2-sliding-tied": ("qwen2", {"use_sliding_window": False}),
             "qwen3": ("qwen3", {}), "gemma": ("gemma", {}),
             "gemma2": ("gemma2", _HEAD_DIM_SCALAR), "gemma3": ("gemma3", _HEAD_DIM_SCALAR),
             "phi3-longrope-sliding": ("phi3", {})}


def llama_cpp_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """What llama.cpp's converter writes for Llama 3.1's rope scaling: one divisor per
    frequency."""
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        old = rope["original_max_position_embeddings"]
        low, high = old / rope["low_freq_factor"], old / rope["high_freq_factor"]
        if wavelen < high:
            factors.append(1.0)
        elif wavelen > low:
            factors.append(rope["factor"])
        else:
            smooth = (old / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(path, hf, arch: str, q8: bool = False) -> None:
    """q8: matrices stored as Q8_0 blocks (the rest float32, as llama.cpp keeps norms)."""
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    write_shape(writer, cfg)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.head_dim)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(rope, cfg.head_dim))
    if rope["rope_type"] == "longrope":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_tensor("rope_factors_long.weight", torch.tensor(rope["long_factor"]).numpy())
        writer.add_tensor("rope_factors_short.weight", torch.tensor(rope["short_factor"]).numpy())
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":  # one bool per layer, True where it slides
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, key, None):
            getattr(writer, f"add_{key}")(getattr(cfg, key))
    write_tiny_vocab(writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.numpy().copy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias",
                                              "k_proj.bias")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            array = array + 1
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if q8 and array.ndim == 2:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name", list(CONVERTED))
def test_gguf_of_each_family_matches_transformers(name, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path / "cache"))
    model_type, options = FAMILIES[name]
    arch, changes = CONVERTED[name]
    hf = make_hf(model_type, {**options, **changes}, seed=3)
    write_gguf(tmp_path / "tiny.gguf", hf, arch)
    for _ in range(2):  # converted, then from the cached checkpoint directory
        model, _ = load_model(tmp_path / "tiny.gguf", progress=False)
        ids = _ids(40, 4)
        (logits,) = run_schedule(model, [ids], [[40]])
        torch.testing.assert_close(logits, hf_logits(hf, ids), atol=1e-4, rtol=1e-4)
    # The converted directory is the family's own checkpoint for transformers too (Phi-3's
    # tensors fused again, llama.cpp's rope_freqs as an equivalent longrope).
    again = AutoModelForCausalLM.from_pretrained(converted_checkpoint_dir(tmp_path / "tiny.gguf"))
    assert type(again) is type(hf)
    torch.testing.assert_close(hf_logits(again.eval(), ids), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama3-rope-biases", "phi3-longrope-sliding", "gemma3"])
def test_gguf_blocks_run_as_stored(name, tmp_path, monkeypatch) -> None:
    """quantization='gguf' keeps Q8_0 blocks: un-permuted (llama), split and fused again (Phi-3),
    they are the widened model's weights; the logits stay close to it."""
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path / "cache"))
    model_type, options = FAMILIES[name]
    arch, changes = CONVERTED[name]
    write_gguf(tmp_path / "q8.gguf", make_hf(model_type, {**options, **changes}, seed=3), arch,
               q8=True)
    stored, _ = load_model(tmp_path / "q8.gguf", quantization="gguf", progress=False)
    wide, _ = load_model(tmp_path / "q8.gguf", progress=False)
    for layer, float_layer in zip(stored.layers, wide.layers):
        for proj in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            weight = getattr(float_layer, proj).weight
            rows = getattr(layer, proj).dense_rows(torch.arange(weight.shape[0]))
            assert torch.equal(rows, weight), proj
            # One product per fused layer: q, k, v (gate, up) stacked again as blocks.
            assert [p.kind for p in getattr(layer, proj).parts] == ["Q8_0"], proj
    ids = _ids(40, 4)
    (ours,) = run_schedule(stored, [ids], [[40]])
    (widened,) = run_schedule(wide, [ids], [[40]])
    assert (ours - widened).abs().max() < 0.15 * widened.abs().max()  # int8 activations
