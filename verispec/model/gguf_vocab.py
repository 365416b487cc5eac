"""A `tokenizers` BPE tokenizer rebuilt from a GGUF file's vocabulary (tokenizer.ggml.* keys).

Only GPT-2 style byte-level BPE (tokenizer.ggml.model == "gpt2") is supported: SmolLM2, Llama 3
and most recent models. How text is split before BPE depends on tokenizer.ggml.pre; the table
below mirrors llama.cpp's for the supported pre-tokenizer families.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 / 2.5 / 3: Llama 3's split with single digits.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # StarCoder's family (SmolLM2 included) splits numbers into single digits first.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _llama3() -> pre_tokenizers.PreTokenizer:
    return _split_then_bytes(_LLAMA3_SPLIT)


def _qwen2() -> pre_tokenizers.PreTokenizer:
    return _split_then_bytes(_QWEN2_SPLIT)


_PRE_TOKENIZERS = {
    "default": _gpt2, "gpt2": _gpt2, "gpt-2": _gpt2,
    "starcoder": _digits_then_gpt2, "smollm": _digits_then_gpt2, "refact": _digits_then_gpt2,
    "llama-bpe": _llama3, "llama3": _llama3, "qwen2": _qwen2,
}


def build_bpe_tokenizer(
    model: str,
    pre: str,
    tokens: list[str],
    token_types: list[int],
    merges: list[str],
    bos_token_id: int | None,
    add_bos: bool,
) -> Tokenizer:
    """The tokenizer that tokenizer.ggml.{model, pre, tokens, token_type, merges} describe."""
    if model != "gpt2":
        raise ValueError(f"tokenizer.ggml.model={model!r} is not supported: expected 'gpt2' "
                         f"(byte-level BPE)")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"tokenizer.ggml.pre={pre!r} is not supported: expected one of "
                         f"{sorted(_PRE_TOKENIZERS)}")
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens are matched whole in text and skipped when decoding; user-defined ones are
    # matched whole but kept.
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i, kind in enumerate(token_types) if kind == _CONTROL])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                          for i, kind in enumerate(token_types) if kind == _USER_DEFINED])
    if add_bos and bos_token_id is not None:
        bos = tokens[bos_token_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1", special_tokens=[(bos, bos_token_id)])
    return tokenizer
