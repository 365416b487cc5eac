"""Shared fixtures: tiny random Hugging Face Llama checkpoints, a tiny byte-level BPE vocabulary,
and the embedded SmolLM2 model (loaded once per session; its dequantized cache makes reruns fast).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from verispec.model import Tokenizer, load_model
from verispec.model.chat_template import CHATML_TEMPLATE
from verispec.model.gguf_vocab import build_bpe_tokenizer

TINY_VOCAB = 128
TINY_CONFIG = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, rope_theta=5000.0,
                   max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġ", "a"), ("i", "n"), ("e", "r"), ("o", "n"), ("r", "e"),
           ("a", "n"), ("Ġt", "he"), ("Ġ", "s"), ("o", "r"), ("e", "n"), ("Ġ", "w"), ("Ġ", "c")]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """GGUF-style (tokens, token types, merges): 3 control tokens, printable ASCII in GPT-2's
    byte-to-unicode spelling (space is 'Ġ', newline 'Ċ'), then merged tokens, 128 in all."""
    chars = ["Ġ" if c == " " else c for c in map(chr, range(32, 127))] + ["Ċ"]
    merged = [a + b for a, b in _MERGES]
    tokens = SPECIALS + chars + merged
    tokens += [f"<unused{i}>" for i in range(TINY_VOCAB - len(tokens))]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, [f"{a} {b}" for a, b in _MERGES]


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    # What llama.cpp's convert_hf_to_gguf.py does to q_proj and k_proj.
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]) \
        .swapaxes(1, 2).reshape(weight.shape)


def write_shape(writer, cfg) -> None:
    """A Hugging Face config's layer count, context and widths into a gguf.GGUFWriter."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)


def write_tiny_vocab(writer) -> None:
    """The tiny vocabulary, BOS 1, EOS 2 and the ChatML template into a gguf.GGUFWriter."""
    tokens, types, merges = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHATML_TEMPLATE)


def tiny_tokenizer() -> Tokenizer:
    tokens, types, merges = tiny_vocab()
    backend = build_bpe_tokenizer("smollm", tokens, types, merges, bos_token_id=1,
                                  add_bos=False)
    return Tokenizer(backend, bos_token_id=1, eos_token_id=2, chat_template=CHATML_TEMPLATE)


def make_hf_tiny(tied: bool, seed: int = 0, **changes) -> LlamaForCausalLM:
    """changes: TINY_CONFIG entries to replace (vocab_size for another vocabulary)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, "tie_word_embeddings": tied, **changes})).eval()
    with torch.no_grad():
        for param in model.parameters():  # random norms too, so that a swapped norm shows
            if param.dim() == 1:
                param.uniform_(0.5, 1.5)
        if not tied:
            model.lm_head.weight.mul_(5)
    return model


# Llama 3 style: the tokenizer adds BOS to encoded text and the template writes it too.
BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_bos_chat_checkpoint(directory: Path) -> str:
    """An untied tiny checkpoint whose tokenizer adds BOS and whose chat template (BOS_TEMPLATE)
    writes one too: the case where a rendered chat must be encoded without special tokens."""
    make_hf_tiny(tied=False).save_pretrained(directory)
    tokens, types, merges = tiny_vocab()
    backend = build_bpe_tokenizer("llama-bpe", tokens, types, merges, bos_token_id=0, add_bos=True)
    Tokenizer(backend, bos_token_id=0, eos_token_id=2, chat_template=BOS_TEMPLATE).save(directory)
    return str(directory)


@pytest.fixture(scope="session", params=[True, False], ids=["tied", "untied"])
def tiny_checkpoint(request, tmp_path_factory) -> tuple[LlamaForCausalLM, Path]:
    """A random tiny HF Llama and the directory it was saved to (with a tokenizer)."""
    hf = make_hf_tiny(tied=request.param)
    directory = tmp_path_factory.mktemp("tied" if request.param else "untied")
    hf.save_pretrained(directory)
    tiny_tokenizer().save(directory)
    return hf, directory


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct, fp32: (model, tokenizer)."""
    return load_model(progress=False)
