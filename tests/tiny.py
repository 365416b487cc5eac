"""Tiny random Llama models and a word-level tokenizer, for engine tests that need no download.

Token i is the word "t{i}"; text is words separated by spaces.
"""

from __future__ import annotations

import tokenizers
import torch
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from verispec.engine.engine import LLMEngine
from verispec.config import CacheConfig, EngineConfig, SpeculativeConfig
from verispec.model import LlamaModel, ModelConfig, Tokenizer
from verispec.model.loader import quantize_weights
from verispec.spec_decode.base import Drafter


def tiny_model(seed: int, vocab: int = 16, hidden: int = 32, layers: int = 2, scale: float = 1.0,
               eos: tuple[int, ...] = (), quantization: tuple[int, int] | None = None,
               window: int | None = None) -> LlamaModel:
    """Random weights; `scale` sharpens (>1) or flattens (<1) the output distributions;
    `quantization` (bits, group size): the same weights rounded to blocks (int4 / int8);
    `window`: every layer slides (Mistral)."""
    config = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                         num_heads=4, num_kv_heads=2, head_dim=hidden // 4, rope_theta=5000.0,
                         max_position_embeddings=512, tie_word_embeddings=False, eos_token_ids=eos,
                         sliding_window=window)
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, std: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    kv = config.num_kv_heads * config.head_dim
    weights = {
        "model.embed_tokens.weight": w(vocab, hidden, std=1.0),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": w(vocab, hidden, std=scale),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": w(hidden, hidden),
            p + "self_attn.k_proj.weight": w(kv, hidden),
            p + "self_attn.v_proj.weight": w(kv, hidden),
            p + "self_attn.o_proj.weight": w(hidden, hidden),
            p + "mlp.gate_proj.weight": w(2 * hidden, hidden),
            p + "mlp.up_proj.weight": w(2 * hidden, hidden),
            p + "mlp.down_proj.weight": w(hidden, 2 * hidden),
        })
    if quantization is not None:
        weights = quantize_weights(weights, *quantization)
    model = LlamaModel(config, quantized=quantization is not None)
    model.load_weights(weights)
    return model.eval()


def tiny_checkpoint(directory, seed: int = 0, vocab: int = 16, sharpen: float = 20.0):
    """Saves a random tiny Hugging Face Llama (+ word tokenizer) to `directory`; returns the HF model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rope_theta=5000.0,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(sharpen)  # sharper distributions make greedy decisions robust
    hf.save_pretrained(directory)
    word_tokenizer(vocab).save(directory)
    return hf


def word_tokenizer(vocab: int = 16, eos: int | None = None) -> Tokenizer:
    backend = tokenizers.Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    return Tokenizer(backend, bos_token_id=None, eos_token_id=eos)


def tiny_engine(model: LlamaModel, drafter: Drafter | None = None, k: int = 0, num_blocks: int = 256,
                block_size: int = 4, budget: int = 256, max_seqs: int = 64, eos: int | None = None,
                prefix_caching: bool = True, free_out_of_window: bool = True,
                static_step: bool | None = None, adaptive: bool = True, tree=None) -> LLMEngine:
    method = "none" if drafter is None else "ngram"
    config = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=512,
                          cache=CacheConfig(block_size, num_blocks, prefix_caching, free_out_of_window),
                          speculative=SpeculativeConfig(method=method, num_speculative_tokens=k,
                                                        adaptive=adaptive, tree=tree),
                          static_step=static_step)
    return LLMEngine(model, word_tokenizer(model.config.vocab_size, eos), config, drafter)


def run_all(engine: LLMEngine) -> dict:
    """Steps until every request finished; final outputs by request id."""
    done = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        assert steps < 100_000
    return done
