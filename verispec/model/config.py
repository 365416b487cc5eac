"""ModelConfig: the shape of a Llama-family checkpoint, independent of the file it came from.

Both loaders (GGUF metadata, Hugging Face config.json) translate into this one frozen dataclass,
so the model code never looks at a file format. Only plain Llama is described: no rope scaling,
no biases, no sliding window; the loaders reject checkpoints that need any of those.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


def _require(name: str, value: object, expected: str, ok: bool) -> None:
    if not ok:
        raise ValueError(f"ModelConfig.{name}={value!r} is invalid: expected {expected}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a Llama-family decoder.

    num_heads: query heads; num_kv_heads: key/value heads (grouped-query attention shares each
        key/value head among num_heads // num_kv_heads query heads).
    head_dim: width of one head; rotary embeddings rotate all of it (rotate-half convention).
    rope_theta: base of the rotary frequencies (10000 in Llama 2, 100000 in SmolLM2).
    max_position_embeddings: the context length the checkpoint was trained for.
    tie_word_embeddings: the LM head reuses the token embedding matrix.
    bos_token_id: beginning-of-sequence token, or None when the vocabulary has none.
    eos_token_ids: every token that ends generation (a chat model often has several).
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
        _require("rope_theta", self.rope_theta, "a number > 1",
                 _is_number(self.rope_theta) and self.rope_theta > 1)
        _require("tie_word_embeddings", self.tie_word_embeddings, "a bool",
                 isinstance(self.tie_word_embeddings, bool))
        in_vocab = f"an int in [0, vocab_size={self.vocab_size})"
        _require("bos_token_id", self.bos_token_id, f"None or {in_vocab}",
                 self.bos_token_id is None
                 or (_is_int(self.bos_token_id) and 0 <= self.bos_token_id < self.vocab_size))
        _require("eos_token_ids", self.eos_token_ids, f"a tuple of {in_vocab}",
                 isinstance(self.eos_token_ids, tuple)
                 and all(_is_int(t) and 0 <= t < self.vocab_size for t in self.eos_token_ids))

    def weight_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(Hugging Face name, shape) of every tensor a checkpoint must hold, layer by layer;
        lazily, so that checking a config with an absurd num_layers stops at the first gap."""
        hidden, inter = self.hidden_size, self.intermediate_size
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        yield "model.embed_tokens.weight", (self.vocab_size, hidden)
        yield "model.norm.weight", (hidden,)
        if not self.tie_word_embeddings:
            yield "lm_head.weight", (self.vocab_size, hidden)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", (hidden,)
            yield p + "post_attention_layernorm.weight", (hidden,)
            yield p + "self_attn.q_proj.weight", (q_width, hidden)
            yield p + "self_attn.k_proj.weight", (kv_width, hidden)
            yield p + "self_attn.v_proj.weight", (kv_width, hidden)
            yield p + "self_attn.o_proj.weight", (hidden, q_width)
            yield p + "mlp.gate_proj.weight", (inter, hidden)
            yield p + "mlp.up_proj.weight", (inter, hidden)
            yield p + "mlp.down_proj.weight", (hidden, inter)
