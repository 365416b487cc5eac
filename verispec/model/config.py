"""ModelConfig: the shape of a decoder checkpoint, independent of the file it came from.

Both loaders (GGUF metadata, Hugging Face config.json) translate into this one frozen dataclass,
so the model code never looks at a file format. Every supported family (Llama 2/3.x, Mistral,
Qwen2/2.5/3, Gemma 1/2/3, Phi-3) is the same decoder with options; the defaults are plain Llama,
and a default config runs exactly the computation plain Llama did before the options existed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn", "longrope", "freq_factors")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")


def _require(name: str, value: object, expected: str, ok: bool) -> None:
    if not ok:
        raise ValueError(f"ModelConfig.{name}={value!r} is invalid: expected {expected}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_or_none(value: object) -> bool:
    return value is None or (_is_number(value) and value > 0)


@dataclass(frozen=True)
class RopeScaling:
    """A rotary scaling scheme, with Hugging Face's parameter names (rope_parameters).

    rope_type: "linear" (positions divided by factor), "dynamic" (NTK: the base grows with the
        sequence beyond original_max_position_embeddings), "llama3" (Llama 3.1's per-band
        wavelength scaling), "yarn", "longrope" (Phi-3: short_factor up to
        original_max_position_embeddings, long_factor beyond, per token), "freq_factors"
        (llama.cpp's rope_freqs tensor, how GGUF files store Llama 3.1's scaling: frequency i
        is divided by short_factor[i]).
    attention_factor: what cos and sin are multiplied by (yarn, longrope); None: derived from
        factor as transformers derives it.
    """

    rope_type: str
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        def need(name: str, expected: str, ok: bool) -> None:
            _require(f"rope_scaling.{name}", getattr(self, name), expected, ok)

        need("rope_type", f"one of {ROPE_TYPES}", self.rope_type in ROPE_TYPES)
        need("factor", "a positive number", _is_number(self.factor) and self.factor > 0)
        need("original_max_position_embeddings", "None or a positive int",
             self.original_max_position_embeddings is None
             or (_is_int(self.original_max_position_embeddings)
                 and self.original_max_position_embeddings > 0))
        for name in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            need(name, "a positive number", _is_number(getattr(self, name)) and getattr(self, name) > 0)
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            need(name, "None or a positive number", _positive_or_none(getattr(self, name)))
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            need(name, "a tuple of positive numbers", isinstance(value, tuple)
                 and all(_is_number(v) and v > 0 for v in value))
        if self.rope_type in ("llama3", "yarn", "longrope"):
            need("original_max_position_embeddings", f"an int for rope_type={self.rope_type!r}",
                 self.original_max_position_embeddings is not None)
        if self.rope_type == "llama3":
            need("high_freq_factor", f"> low_freq_factor={self.low_freq_factor}",
                 self.high_freq_factor > self.low_freq_factor)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only transformer.

    num_heads: query heads; num_kv_heads: key/value heads (grouped-query attention shares each
        key/value head among num_heads // num_kv_heads query heads).
    head_dim: width of one head; rotary embeddings rotate all of it (rotate-half convention).
    rope_theta: base of the rotary frequencies (10000 in Llama 2, 100000 in SmolLM2).
    rope_scaling: a RopeScaling scheme, None for plain RoPE.
    local_rope_theta: the base of the sliding-window layers' plain RoPE when it differs from the
        full-attention layers' (Gemma 3: 10000 local, 1e6 global); None: they share one.
    max_position_embeddings: the context length the checkpoint was trained for.
    tie_word_embeddings: the LM head reuses the token embedding matrix.
    bos_token_id: beginning-of-sequence token, or None when the vocabulary has none.
    eos_token_ids: every token that ends generation (a chat model often has several).
    qkv_bias, o_bias, mlp_bias: the projections have biases (Qwen2: q/k/v).
    qk_norm: queries and keys are RMS-normed per head before rotary (Qwen3, Gemma 3).
    hidden_act: the gate's activation in the gated MLP: "silu" (SwiGLU) or
        "gelu_pytorch_tanh" (GeGLU, Gemma).
    norm_weight_offset: added to every RMSNorm weight at load (Gemma multiplies by 1 + w).
    embedding_scale: the input embeddings are multiplied by it (Gemma: sqrt(hidden_size)).
    sandwich_norms: the attention and MLP outputs are normed too before joining the residual
        (Gemma 2/3: post_attention_layernorm and post_feedforward_layernorm; the MLP's input
        norm is then pre_feedforward_layernorm).
    attention_scale: the scale of the attention scores; None: head_dim ** -0.5 (Gemma 2/3:
        query_pre_attn_scalar ** -0.5).
    attn_logit_softcap, final_logit_softcap: scores and logits become cap * tanh(x / cap)
        (Gemma 2); None for none.
    sliding_window: a sliding-window layer's query at position p attends keys at positions
        > p - sliding_window only; None for none.
    layer_types: "full_attention" or "sliding_attention" per layer; () means every layer slides
        when sliding_window is set (Mistral), none otherwise.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: RopeScaling | None = None
    local_rope_theta: float | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    norm_weight_offset: float = 0.0
    embedding_scale: float = 1.0
    sandwich_norms: bool = False
    attention_scale: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            _require(name, value, "a positive int", _is_int(value) and value > 0)
        _require("num_kv_heads", self.num_kv_heads,
                 f"a divisor of num_heads={self.num_heads}",
                 self.num_heads % self.num_kv_heads == 0)
        _require("head_dim", self.head_dim, "an even number (rotate-half rotary embeddings)",
                 self.head_dim % 2 == 0)
        _require("rms_norm_eps", self.rms_norm_eps, "a positive number",
                 _is_number(self.rms_norm_eps) and self.rms_norm_eps > 0)
        for name in ("rope_theta", "local_rope_theta"):
            value = getattr(self, name)
            _require(name, value, "a number > 1",
                     (value is None and name == "local_rope_theta")
                     or (_is_number(value) and value > 1))
        for name in ("tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias", "qk_norm",
                     "sandwich_norms"):
            _require(name, getattr(self, name), "a bool", isinstance(getattr(self, name), bool))
        in_vocab = f"an int in [0, vocab_size={self.vocab_size})"
        _require("bos_token_id", self.bos_token_id, f"None or {in_vocab}",
                 self.bos_token_id is None
                 or (_is_int(self.bos_token_id) and 0 <= self.bos_token_id < self.vocab_size))
        _require("eos_token_ids", self.eos_token_ids, f"a tuple of {in_vocab}",
                 isinstance(self.eos_token_ids, tuple)
                 and all(_is_int(t) and 0 <= t < self.vocab_size for t in self.eos_token_ids))
        _require("rope_scaling", self.rope_scaling, "None or a RopeScaling",
                 self.rope_scaling is None or isinstance(self.rope_scaling, RopeScaling))
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type in ("longrope", "freq_factors"):
            half = self.head_dim // 2
            long = scaling.long_factor if scaling.rope_type == "longrope" else scaling.short_factor
            _require("rope_scaling", scaling,
                     f"short_factor (and long_factor for longrope) of head_dim / 2 = {half} entries",
                     len(scaling.short_factor) == len(long) == half)
        _require("hidden_act", self.hidden_act, f"one of {ACTIVATIONS}", self.hidden_act in ACTIVATIONS)
        _require("norm_weight_offset", self.norm_weight_offset, "0.0 or 1.0",
                 self.norm_weight_offset in (0.0, 1.0))
        _require("embedding_scale", self.embedding_scale, "a positive number",
                 _is_number(self.embedding_scale) and self.embedding_scale > 0)
        for name in ("attention_scale", "attn_logit_softcap", "final_logit_softcap"):
            _require(name, getattr(self, name), "None or a positive number",
                     _positive_or_none(getattr(self, name)))
        _require("sliding_window", self.sliding_window, "None or a positive int",
                 self.sliding_window is None
                 or (_is_int(self.sliding_window) and self.sliding_window > 0))
        _require("layer_types", self.layer_types,
                 f"() or a tuple of num_layers={self.num_layers} entries from {LAYER_TYPES}",
                 isinstance(self.layer_types, tuple)
                 and (not self.layer_types or len(self.layer_types) == self.num_layers)
                 and all(t in LAYER_TYPES for t in self.layer_types))

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (0-based), None where it attends everything."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def cache_window(self) -> int | None:
        """How far back any layer still reads: when every layer slides, the keys at positions
        <= p - sliding_window are never read again once every query sits at p or later (the
        engine frees their blocks); None when some layer attends everything."""
        windows = {self.window_of(layer) for layer in range(self.num_layers)}
        return None if None in windows else self.sliding_window

    def rope_of(self, layer: int) -> tuple[float, RopeScaling | None]:
        """(theta, scaling) of layer `layer`'s rotary embeddings."""
        if self.local_rope_theta is not None and self.window_of(layer) is not None:
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_scaling

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (a JSON object, or torch.save(weights_only=True)); `from_dict`
        reads it back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        raw = dict(raw)
        raw["eos_token_ids"] = tuple(raw.get("eos_token_ids", ()))
        raw["layer_types"] = tuple(raw.get("layer_types", ()))
        scaling = raw.get("rope_scaling")
        if isinstance(scaling, dict):
            scaling = dict(scaling)
            for key in ("short_factor", "long_factor"):
                scaling[key] = tuple(scaling.get(key, ()))
            raw["rope_scaling"] = RopeScaling(**scaling)
        return cls(**raw)

    def weight_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(Hugging Face name, shape) of every tensor a checkpoint must hold, layer by layer;
        lazily, so that checking a config with an absurd num_layers stops at the first gap.
        Names are Llama's for every family (the loaders split Phi-3's fused projections);
        sandwich norms add Gemma 2's pre_feedforward_layernorm and post_feedforward_layernorm,
        and post_attention_layernorm then norms the attention output."""
        hidden, inter, head = self.hidden_size, self.intermediate_size, self.head_dim
        q_width, kv_width = self.num_heads * head, self.num_kv_heads * head
        yield "model.embed_tokens.weight", (self.vocab_size, hidden)
        yield "model.norm.weight", (hidden,)
        if not self.tie_word_embeddings:
            yield "lm_head.weight", (self.vocab_size, hidden)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", (hidden,)
            yield p + "post_attention_layernorm.weight", (hidden,)
            if self.sandwich_norms:
                yield p + "pre_feedforward_layernorm.weight", (hidden,)
                yield p + "post_feedforward_layernorm.weight", (hidden,)
            for name, rows, cols, bias in (("q", q_width, hidden, self.qkv_bias),
                                           ("k", kv_width, hidden, self.qkv_bias),
                                           ("v", kv_width, hidden, self.qkv_bias),
                                           ("o", hidden, q_width, self.o_bias)):
                yield p + f"self_attn.{name}_proj.weight", (rows, cols)
                if bias:
                    yield p + f"self_attn.{name}_proj.bias", (rows,)
            if self.qk_norm:
                yield p + "self_attn.q_norm.weight", (head,)
                yield p + "self_attn.k_norm.weight", (head,)
            for name, rows, cols in (("gate", inter, hidden), ("up", inter, hidden),
                                     ("down", hidden, inter)):
                yield p + f"mlp.{name}_proj.weight", (rows, cols)
                if self.mlp_bias:
                    yield p + f"mlp.{name}_proj.bias", (rows,)
