"""Reading a llama.cpp GGUF file: config, tokenizer and weights in HF names.

Architectures (general.architecture): llama (Llama 2/3.x, Mistral, SmolLM2), qwen2, qwen3,
gemma, gemma2, gemma3 (text) and phi3. Options are read from the metadata where llama.cpp writes
them, from the tensors present (biases, q/k norms, sandwich norms, rope_freqs, Phi-3's
rope_factors_long/short) and otherwise from what llama.cpp hard-codes for the architecture
(Gemma: 1 + w norms stored as such, GeGLU, sqrt(hidden) embedding scale; Gemma 2: every other
layer sliding; Gemma 3: every sixth layer global, local rope base 10000).

Quantized tensors are either kept as stored (`stored=True`: Q4_0, Q4_1, Q8_0 and Q4_K as
QuantizedWeight, verispec.model.quant; other types widened to float32 with a logged note) or all
dequantized to float32 with the gguf package. llama.cpp's
converter permutes the rows of the q and k projections so that its rotary kernel can rotate
adjacent pairs (x0, x1), (x2, x3), ...; our rotary rotates halves (x_i, x_{i + d/2}) as Hugging
Face does, so the permutation is undone here (llama only: llama.cpp's other architectures use
the rotate-half rotary and store q and k as they are).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType, ReaderTensor
from gguf.quants import dequantize
from tqdm import tqdm

from verispec.model.config import ModelConfig, RopeScaling
from verispec.model.families import split_fused
from verispec.model.gguf_vocab import TOKENIZER_MODELS, build_bpe_tokenizer, build_spm_tokenizer
from verispec.model.quant.formats import GGUF_TYPES, QuantizedWeight, from_gguf
from verispec.model.tokenizer import Tokenizer

_MISSING = object()
_log = logging.getLogger("verispec")

# GGUF tensor name -> Hugging Face name ("{i}" is the layer index). With sandwich norms (Gemma
# 2/3) ffn_norm is the MLP's input norm and post_attention_norm the attention output's.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",
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
# Rotary scaling stored as tensors: read into the config, not loaded as weights.
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# general.architecture -> Hugging Face model_type.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
                 "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3"}
_GEMMAS = ("gemma", "gemma2", "gemma3")
# llama.cpp's layer counts of Gemma 2 27B and Gemma 3 27B, whose scores it scales by
# (hidden / heads) ** -0.5 instead of head_dim ** -0.5 (query_pre_attn_scalar).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Texts of the tokens that end a turn in llama.cpp's end-of-generation list (the ones of the
# families with SentencePiece vocabularies and their fine-tunes).
_TURN_ENDS = frozenset({"<end_of_turn>", "<|end|>", "<|endoftext|>", "<|eot_id|>", "<|im_end|>",
                        "<|eom_id|>", "<|end_of_text|>", "<EOT>"})


@dataclass
class GGUFCheckpoint:
    """Everything a GGUF file holds, translated: weights in HF names and layout, float32 or (read
    with stored=True) QuantizedWeight."""

    config: ModelConfig
    tokenizer: Tokenizer
    weights: dict[str, torch.Tensor | QuantizedWeight]
    model_type: str = "llama"  # the Hugging Face family (families.FAMILIES)


class _BoundedReader(GGUFReader):
    """GGUFReader that refuses a metadata array longer than the rest of the file can hold.

    The reader walks an array item by item, and reading past the end of the file yields empty
    items instead of failing, so a crafted length (2**62) would loop for ever."""

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list, list]:
        if raw_type == GGUFValueType.ARRAY:
            item_type = GGUFValueType(int(self._get(orig_offs, np.uint32)[0]))
            length = int(self._get(orig_offs + 4, np.uint64)[0])
            scalar = self.gguf_scalar_to_np.get(item_type)
            # The fewest bytes one item can take: a scalar's width, a string's or array's header.
            item_bytes = (np.dtype(scalar).itemsize if scalar is not None
                          else 8 if item_type == GGUFValueType.STRING else 12)
            left = len(self.data) - orig_offs - 12
            if length * item_bytes > left:
                raise ValueError(f"a metadata array at byte {orig_offs} claims {length} "
                                 f"{item_type.name} items, more than the {left} bytes left hold")
        return super()._get_field_parts(orig_offs, raw_type)


def _open(path: Path) -> GGUFReader:
    try:
        return _BoundedReader(str(path))
    # What the reader raises on a malformed file: bad magic, version or type codes (ValueError),
    # reads past the end (IndexError), duplicate keys (KeyError), absurd sizes (OverflowError).
    except (ValueError, IndexError, KeyError, OverflowError) as error:
        raise ValueError(f"model={str(path)!r} is not a valid GGUF file: {error}") from None


class _Metadata:
    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self.reader, self.path = reader, path

    def get(self, key: str, kind: type | tuple[type, ...], default: object = _MISSING) -> Any:
        """The value of `key`, which must be an instance of `kind` (bool is no int here)."""
        field = self.reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise ValueError(f"model={str(self.path)!r} lacks GGUF metadata key {key!r}")
            return default
        value = field.contents()
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            expected = " or ".join(k.__name__ for k in kinds)
            raise ValueError(f"model={str(self.path)!r} has GGUF metadata {key}={value!r}: "
                             f"expected {expected}")
        return value


def _hf_name(gguf_name: str, arch: str, sandwich: bool) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        name = _LAYER_NAMES[parts[2]]
        if parts[2] == "ffn_norm" and sandwich:
            name = "pre_feedforward_layernorm"
        elif parts[2] == "ffn_up" and arch == "phi3":
            name = "mlp.gate_up_proj"  # llama.cpp keeps Phi-3's gate and up fused
        return f"model.layers.{parts[1]}.{name}.{parts[3]}"
    return None


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:  # [heads * head_dim, hidden]
    # llama.cpp wrote rows (head, half, pair) as (head, pair, half); swap them back.
    return weight.reshape(heads, weight.shape[0] // heads // 2, 2, -1).swapaxes(1, 2) \
        .reshape(weight.shape)


def _factors(tensors: dict[str, ReaderTensor], name: str) -> tuple[float, ...]:
    return tuple(float(v) for v in np.asarray(dequantize(tensors[name].data,
                                                         tensors[name].tensor_type)).ravel())


def _rope_scaling(meta: _Metadata, arch: str, tensors: dict[str, ReaderTensor],
                  context: int) -> RopeScaling | None:
    if "rope_factors_long.weight" in tensors:
        original = meta.get(f"{arch}.rope.scaling.original_context_length", int, context)
        return RopeScaling("longrope", factor=context / original,
                           original_max_position_embeddings=original,
                           attention_factor=meta.get(f"{arch}.rope.scaling.attn_factor",
                                                     (int, float), None),
                           short_factor=_factors(tensors, "rope_factors_short.weight"),
                           long_factor=_factors(tensors, "rope_factors_long.weight"))
    if "rope_freqs.weight" in tensors:
        return RopeScaling("freq_factors", short_factor=_factors(tensors, "rope_freqs.weight"))
    kind = meta.get(f"{arch}.rope.scaling.type", str, "none")
    if kind == "none":
        return None
    factor = meta.get(f"{arch}.rope.scaling.factor", (int, float), 1.0)
    if kind == "linear":
        return RopeScaling("linear", factor=factor)
    if kind == "yarn":
        return RopeScaling("yarn", factor=factor,
                           original_max_position_embeddings=meta.get(
                               f"{arch}.rope.scaling.original_context_length", int),
                           beta_fast=meta.get(f"{arch}.rope.scaling.yarn_beta_fast", (int, float), 32.0),
                           beta_slow=meta.get(f"{arch}.rope.scaling.yarn_beta_slow", (int, float), 1.0))
    raise ValueError(f"model={str(meta.path)!r} is not supported: {arch}.rope.scaling.type="
                     f"{kind!r}, expected one of 'none', 'linear', 'yarn'")


def _family_options(meta: _Metadata, arch: str, layers: int, hidden: int, heads: int,
                    head_dim: int) -> dict[str, object]:
    """What llama.cpp stores or hard-codes for Gemma and for sliding windows (module docstring)."""
    options: dict[str, object] = {}
    window = meta.get(f"{arch}.attention.sliding_window", int, None)
    if window is not None and window > 0:
        options["sliding_window"] = window
        # A period (every period-th layer global) or one bool per layer (True: sliding).
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern", (int, list),
                           {"gemma2": 2, "gemma3": 6}.get(arch))
        if isinstance(pattern, int) and pattern > 0:
            pattern = [bool((i + 1) % pattern) for i in range(layers)]
        if isinstance(pattern, list):
            options["layer_types"] = tuple("sliding_attention" if sliding else "full_attention"
                                           for sliding in pattern)
    if arch in _GEMMAS:
        options.update(hidden_act="gelu_pytorch_tanh", norm_weight_offset=1.0,
                       embedding_scale=hidden ** 0.5)
    scale = meta.get(f"{arch}.attention.scale", (int, float), None)
    if scale is not None:
        options["attention_scale"] = float(scale)
    elif arch in _GEMMA_27B_LAYERS:
        scalar = hidden / heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim
        options["attention_scale"] = scalar ** -0.5
    for key, field in (("attn_logit_softcapping", "attn_logit_softcap"),
                       ("final_logit_softcapping", "final_logit_softcap")):
        value = meta.get(f"{arch}.{key}", (int, float), None)
        if value is not None and value > 0:
            options[field] = float(value)
    if arch == "gemma3":
        options["local_rope_theta"] = 10000.0
    return options


def _stop_tokens(meta: _Metadata, tokens: list[str], spm: bool) -> tuple[int, ...]:
    """EOS, EOT and EOM ids; for a SentencePiece vocabulary (spm) also the turn-ending tokens
    that llama.cpp recognises by their text, since its converter does not write them for Gemma
    (<end_of_turn>) or Phi-3 (<|end|>), whose Hugging Face generation configs stop at them."""
    # llama.cpp's ids for a SentencePiece file that names none: 2 is </s>.
    ids = [meta.get(f"tokenizer.ggml.{key}_token_id", int, 2 if spm and key == "eos" else -1)
           for key in ("eos", "eot", "eom")]
    if spm:
        ids += [i for i, token in enumerate(tokens) if token in _TURN_ENDS]
    return tuple(dict.fromkeys(i for i in ids if 0 <= i < len(tokens)))


def _read_config(meta: _Metadata, tensors: dict[str, ReaderTensor],
                 tokens: list[str]) -> tuple[ModelConfig, str]:
    """The config and the Hugging Face model_type."""
    arch = meta.get("general.architecture", str)
    if arch not in ARCHITECTURES:
        raise ValueError(f"model={str(meta.path)!r} is not supported: general.architecture="
                         f"{arch!r}, expected one of {', '.join(ARCHITECTURES)}")
    hidden = meta.get(f"{arch}.embedding_length", int)
    heads = meta.get(f"{arch}.attention.head_count", int)
    layers = meta.get(f"{arch}.block_count", int)
    head_dim = meta.get(f"{arch}.attention.key_length", int, hidden // heads if heads > 0 else 0)
    rotary_dim = meta.get(f"{arch}.rope.dimension_count", int, head_dim)
    if rotary_dim != head_dim:
        raise ValueError(f"model={str(meta.path)!r} is not supported: rope.dimension_count="
                         f"{rotary_dim}, expected head_dim={head_dim} (partial rotary)")
    context = meta.get(f"{arch}.context_length", int, 2048)
    spm = meta.get("tokenizer.ggml.model", str, None) == "llama"
    try:
        config = ModelConfig(
            vocab_size=meta.get(f"{arch}.vocab_size", int, len(tokens)),
            hidden_size=hidden,
            intermediate_size=meta.get(f"{arch}.feed_forward_length", int),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=meta.get(f"{arch}.attention.head_count_kv", int, heads),
            head_dim=head_dim,
            rms_norm_eps=meta.get(f"{arch}.attention.layer_norm_rms_epsilon", (int, float)),
            rope_theta=meta.get(f"{arch}.rope.freq_base", (int, float), 10000.0),
            max_position_embeddings=context,
            tie_word_embeddings="output.weight" not in tensors,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id", int, 1 if spm else None),
            eos_token_ids=_stop_tokens(meta, tokens, spm),
            rope_scaling=_rope_scaling(meta, arch, tensors, context),
            qkv_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
            o_bias="blk.0.attn_output.bias" in tensors,
            mlp_bias="blk.0.ffn_down.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            sandwich_norms="blk.0.post_ffw_norm.weight" in tensors,
            **_family_options(meta, arch, layers, hidden, heads, head_dim),
        )
    except ValueError as error:
        raise ValueError(f"model={str(meta.path)!r} has invalid GGUF metadata: {error}") from None
    return config, ARCHITECTURES[arch]


def _tokenizer_model(meta: _Metadata) -> str:
    model = meta.get("tokenizer.ggml.model", str)
    if model not in TOKENIZER_MODELS:
        supported = ", ".join(f"{name} ({kind})" for name, kind in TOKENIZER_MODELS.items())
        raise ValueError(f"model={str(meta.path)!r} is not supported: tokenizer.ggml.model="
                         f"{model!r}, expected one of {supported}")
    return model


def _read_tokenizer(meta: _Metadata, config: ModelConfig) -> Tokenizer:
    tokens = meta.get("tokenizer.ggml.tokens", list)
    token_types = meta.get("tokenizer.ggml.token_type", list)
    if len(token_types) != len(tokens):
        raise ValueError(f"model={str(meta.path)!r} has {len(token_types)} GGUF token types "
                         f"for {len(tokens)} tokens: expected one per token")
    spm = _tokenizer_model(meta) == "llama"
    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    specials = dict(
        bos_token_id=config.bos_token_id, eos_token_id=eos,
        # llama.cpp adds BOS to SentencePiece text unless the file says otherwise.
        add_bos=meta.get("tokenizer.ggml.add_bos_token", bool, spm),
        add_eos=meta.get("tokenizer.ggml.add_eos_token", bool, False))
    if spm:
        scores = meta.get("tokenizer.ggml.scores", list)
        if len(scores) != len(tokens):
            raise ValueError(f"model={str(meta.path)!r} has {len(scores)} GGUF token scores "
                             f"for {len(tokens)} tokens: expected one per token")
        unk = meta.get("tokenizer.ggml.unknown_token_id", int, None)
        build = functools.partial(
            build_spm_tokenizer, tokens, scores, token_types,
            unk_token_id=unk if unk is not None and 0 <= unk < len(tokens) else None,
            add_space_prefix=meta.get("tokenizer.ggml.add_space_prefix", bool, True),
            rstrip_special=any(name in meta.get("general.name", str, "").lower()
                               for name in ("phi-3", "phi3")))
    else:
        build = functools.partial(build_bpe_tokenizer, meta.get("tokenizer.ggml.pre", str, "default"),
                                  tokens, token_types, meta.get("tokenizer.ggml.merges", list))
    try:
        backend = build(**specials)
    # tokenizers reports a malformed vocabulary (a merge of unknown tokens, ...) as a plain
    # Exception; nothing else runs inside this call.
    except Exception as error:
        raise ValueError(f"model={str(meta.path)!r} has an unusable GGUF vocabulary: "
                         f"{error}") from None
    return Tokenizer(backend, config.bos_token_id, eos,
                     meta.get("tokenizer.chat_template", str, None))


def _heads_of(name: str, config: ModelConfig, arch: str) -> int | None:
    """The head count whose rows llama.cpp permuted in this tensor (None: not permuted)."""
    if arch != "llama":
        return None
    if name.endswith(("attn_q.weight", "attn_q.bias")):
        return config.num_heads
    if name.endswith(("attn_k.weight", "attn_k.bias")):
        return config.num_kv_heads
    return None


def _convert_tensor(tensor: ReaderTensor, config: ModelConfig, arch: str,
                    stored: bool) -> torch.Tensor | QuantizedWeight:
    heads = _heads_of(tensor.name, config, arch)
    kind = tensor.tensor_type.name
    if stored and kind in GGUF_TYPES:
        weight = from_gguf(np.asarray(tensor.data), kind, int(tensor.shape[0]))
        if heads is None:
            return weight
        order = _unpermute(np.arange(weight.shape[0]), heads)
        return weight.select_rows(torch.from_numpy(np.ascontiguousarray(order)))
    if stored and tensor.data.ndim == 2 and kind not in ("F32", "F16", "BF16"):
        _log.warning("verispec: tensor %s is %s, which no kernel runs as stored: widened to "
                     "float32", tensor.name, kind)
    # Unquantized tensors come back as read-only views of the memory-mapped file.
    array = np.require(dequantize(tensor.data, tensor.tensor_type), np.float32, ["C", "W"])
    if heads is not None:
        array = _unpermute(array, heads)
    if arch in _GEMMAS and tensor.name.endswith("norm.weight"):
        array = array - 1.0  # llama.cpp stores Gemma's 1 + w; the checkpoint names hold w
    return torch.from_numpy(np.ascontiguousarray(array))


def read_gguf(path: Path, progress: bool, stored: bool = False) -> GGUFCheckpoint:
    """Parse a GGUF file and dequantize its weights (seconds for a 135M model), or with
    `stored` keep the block types the kernels run as they are (a fraction of a second)."""
    reader = _open(path)
    meta = _Metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    config, model_type = _read_config(meta, tensors, meta.get("tokenizer.ggml.tokens", list))
    _tokenizer_model(meta)  # an unsupported vocabulary is refused before any weight is read
    arch = meta.get("general.architecture", str)
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    for tensor in tqdm(reader.tensors, desc=f"{'Reading' if stored else 'Dequantizing'} "
                       f"{path.name}", unit="tensor", disable=not progress):
        if tensor.name in _ROPE_TENSORS:
            continue
        name = _hf_name(tensor.name, arch, config.sandwich_norms)
        if name is None:
            raise ValueError(f"model={str(path)!r} has tensor {tensor.name!r}, which a "
                             f"{arch} model does not use")
        try:
            weights[name] = _convert_tensor(tensor, config, arch, stored)
        # dequantize raises NotImplementedError for quantization types it lacks, and numpy a
        # ValueError when the q/k rows do not split into the config's heads.
        except (NotImplementedError, ValueError) as error:
            raise ValueError(f"model={str(path)!r} has tensor {tensor.name!r} "
                             f"({tensor.tensor_type.name}, shape {tensor.shape.tolist()}) that "
                             f"cannot be read: {error}") from None
    return GGUFCheckpoint(config, _read_tokenizer(meta, config), split_fused(weights, config),
                          model_type)
