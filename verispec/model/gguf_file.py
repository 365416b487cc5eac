"""Reading a llama.cpp GGUF file: config, tokenizer and dequantized weights in HF names.

Quantized tensors (Q4_1, Q8_0, ...) are dequantized to float32 with the gguf package. llama.cpp's
converter permutes the rows of the q and k projections so that its rotary kernel can rotate
adjacent pairs (x0, x1), (x2, x3), ...; our rotary rotates halves (x_i, x_{i + d/2}) as Hugging
Face does, so the permutation is undone here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from tqdm import tqdm

from verispec.model.config import ModelConfig
from verispec.model.gguf_vocab import build_bpe_tokenizer
from verispec.model.tokenizer import Tokenizer

_MISSING = object()

# GGUF tensor name -> Hugging Face name ("{i}" is the layer index).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass
class GGUFCheckpoint:
    """Everything a GGUF file holds, translated: weights are float32 in HF names and layout."""

    config: ModelConfig
    tokenizer: Tokenizer
    weights: dict[str, torch.Tensor]


class _Metadata:
    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self.reader, self.path = reader, path

    def get(self, key: str, default: object = _MISSING) -> object:
        field = self.reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise ValueError(f"model={str(self.path)!r} lacks GGUF metadata key {key!r}")
            return default
        return field.contents()


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:  # [heads * head_dim, hidden]
    # llama.cpp wrote rows (head, half, pair) as (head, pair, half); swap them back.
    return weight.reshape(heads, weight.shape[0] // heads // 2, 2, -1).swapaxes(1, 2) \
        .reshape(weight.shape)


def _read_config(meta: _Metadata, tensor_names: set[str], vocab_size: int) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"model={str(meta.path)!r} is not supported: general.architecture="
                         f"{arch!r}, expected 'llama'")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise ValueError(f"model={str(meta.path)!r} is not supported: it uses rope scaling "
                         f"({scaling!r}); only plain Llama RoPE is implemented")
    hidden = int(meta.get(f"{arch}.embedding_length"))
    heads = int(meta.get(f"{arch}.attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rotary_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(f"model={str(meta.path)!r} is not supported: rope.dimension_count="
                         f"{rotary_dim}, expected head_dim={head_dim} (partial rotary)")
    eos = [int(meta.get(f"tokenizer.ggml.{key}_token_id", -1)) for key in ("eos", "eot", "eom")]
    bos = meta.get("tokenizer.ggml.bos_token_id", None)
    return ModelConfig(
        vocab_size=int(meta.get(f"{arch}.vocab_size", vocab_size)),
        hidden_size=hidden,
        intermediate_size=int(meta.get(f"{arch}.feed_forward_length")),
        num_layers=int(meta.get(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(t for t in eos if t >= 0)),
    )


def _read_tokenizer(meta: _Metadata, config: ModelConfig) -> Tokenizer:
    backend = build_bpe_tokenizer(
        model=meta.get("tokenizer.ggml.model"),
        pre=meta.get("tokenizer.ggml.pre", "default"),
        tokens=meta.get("tokenizer.ggml.tokens"),
        token_types=meta.get("tokenizer.ggml.token_type"),
        merges=meta.get("tokenizer.ggml.merges"),
        bos_token_id=config.bos_token_id,
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    )
    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    return Tokenizer(backend, config.bos_token_id, eos, meta.get("tokenizer.chat_template", None))


def read_gguf(path: Path, progress: bool) -> GGUFCheckpoint:
    """Parse and dequantize a GGUF file (seconds for a 135M model)."""
    reader = GGUFReader(str(path))
    meta = _Metadata(reader, path)
    tensor_names = {t.name for t in reader.tensors}
    config = _read_config(meta, tensor_names, len(meta.get("tokenizer.ggml.tokens")))
    weights: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc=f"Dequantizing {path.name}", unit="tensor",
                       disable=not progress):
        name = _hf_name(tensor.name)
        if name is None:
            raise ValueError(f"model={str(path)!r} has tensor {tensor.name!r}, which a Llama "
                             f"model does not use")
        # Unquantized tensors come back as read-only views of the memory-mapped file.
        array = np.require(dequantize(tensor.data, tensor.tensor_type), np.float32, ["C", "W"])
        if name.endswith("q_proj.weight"):
            array = _unpermute(array, config.num_heads)
        elif name.endswith("k_proj.weight"):
            array = _unpermute(array, config.num_kv_heads)
        weights[name] = torch.from_numpy(np.ascontiguousarray(array))
    return GGUFCheckpoint(config, _read_tokenizer(meta, config), weights)
