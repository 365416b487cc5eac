"""A `tokenizers` tokenizer rebuilt from a GGUF file's vocabulary (tokenizer.ggml.* keys).

Two kinds of vocabulary (tokenizer.ggml.model), the ones llama.cpp calls BPE and SPM:

- "gpt2": byte-level BPE (SmolLM2, Llama 3, Qwen, most recent models). How text is split before
  BPE depends on tokenizer.ggml.pre; the table below mirrors llama.cpp's for the supported
  pre-tokenizer families.
- "llama": a SentencePiece BPE vocabulary (Llama 2, Mistral 7B, Gemma 1-3, Phi-3). The file has
  no merges: SentencePiece merges the adjacent pair whose concatenation is the highest-scoring
  token, so the merges are recovered from the tokens and their scores (tokenizer.ggml.scores).
  Spaces are spelled U+2581 ("▁"); with add_space_prefix (default true) every stretch of text
  that starts the input or follows a special token gets one in front, as llama.cpp and Llama 2's
  Hugging Face tokenizer do. Characters outside the vocabulary become their UTF-8 bytes, tokens
  <0x00>..<0xFF> (byte fallback), or the unknown token where the vocabulary has no byte tokens.

Token types (llama.cpp's llama_token_type): control and unknown tokens are special (matched
whole in text, dropped by decode(skip_special_tokens=True)); user-defined ones are matched whole
and kept; unused ones are never produced from text.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors)

# llama.cpp's llama_token_type.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
# tokenizer.ggml.model -> what it is, for the refusal of the others.
TOKENIZER_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE"}
_SPACE = "\u2581"

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
    pre: str,
    tokens: list[str],
    token_types: list[int],
    merges: list[str],
    bos_token_id: int | None,
    add_bos: bool,
    eos_token_id: int | None = None,
    add_eos: bool = False,
) -> Tokenizer:
    """The byte-level BPE tokenizer that tokenizer.ggml.{pre, tokens, token_type, merges}
    describe (tokenizer.ggml.model "gpt2")."""
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"tokenizer.ggml.pre={pre!r} is not supported: expected one of "
                         f"{sorted(_PRE_TOKENIZERS)}")
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    return _with_specials(tokenizer, tokens, token_types, bos_token_id if add_bos else None,
                          eos_token_id if add_eos else None)


def spm_merges(tokens: Sequence[str], scores: Sequence[float],
               token_types: Sequence[int]) -> list[tuple[str, str]]:
    """BPE merges, best first, equivalent to SentencePiece's rule of merging the adjacent pair
    whose concatenation is the highest-scoring token.

    Every split of a normal token into two normal tokens is a merge ranked by the whole token's
    score (ties: lower id first); user-defined, control, byte and unused tokens are never
    produced by merging (user-defined ones are matched whole before BPE runs)."""
    normal = {token: i for i, (token, kind) in enumerate(zip(tokens, token_types))
              if kind == _NORMAL}
    ranked = []
    for token, i in normal.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[i], i, normal[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_spm_tokenizer(
    tokens: list[str],
    scores: Sequence[float],
    token_types: list[int],
    bos_token_id: int | None,
    add_bos: bool,
    eos_token_id: int | None = None,
    add_eos: bool = False,
    unk_token_id: int | None = None,
    add_space_prefix: bool = True,
    rstrip_special: bool = False,
) -> Tokenizer:
    """The SentencePiece BPE tokenizer that tokenizer.ggml.{tokens, scores, token_type,
    add_space_prefix} describe (tokenizer.ggml.model "llama"; module docstring).

    rstrip_special: special tokens swallow the whitespace that follows them in text, except
    <unk>, <s> and <|endoftext|> (what llama.cpp does for models named Phi-3, as Phi-3's own
    tokenizer.json does)."""
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = tokens[unk_token_id] if unk_token_id is not None else None
    tokenizer = Tokenizer(models.BPE(vocab, spm_merges(tokens, scores, token_types),
                                     unk_token=unk, fuse_unk=True, byte_fallback=True))
    # The prefix is a normalizer, not a Metaspace pre-tokenizer: normalizers run on each stretch
    # of text between special tokens, so each gets its "▁", and one that starts with spaces
    # still gets it (SentencePiece's " a" is "▁▁a").
    escape = normalizers.Replace(" ", _SPACE)
    tokenizer.normalizer = (normalizers.Sequence([normalizers.Prepend(_SPACE), escape])
                            if add_space_prefix else escape)
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    keep_space = {"<unk>", "<s>", "<|endoftext|>"}
    rstrip = ({token for token, kind in zip(tokens, token_types)
               if kind in (_CONTROL, _UNKNOWN, _USER_DEFINED) and token not in keep_space}
              if rstrip_special else set())
    return _with_specials(tokenizer, tokens, token_types, bos_token_id if add_bos else None,
                          eos_token_id if add_eos else None, rstrip)


def _with_specials(tokenizer: Tokenizer, tokens: list[str], token_types: list[int],
                   bos_token_id: int | None, eos_token_id: int | None,
                   rstrip: set[str] = frozenset()) -> Tokenizer:
    """Control/unknown tokens as special tokens, user-defined ones as added tokens (both matched
    whole in raw text, as llama.cpp does), and the BOS / EOS that encode adds (None: none)."""
    def added(kinds: tuple[int, ...], special: bool) -> list[AddedToken]:
        return [AddedToken(token, special=special, normalized=False, rstrip=token in rstrip)
                for token, kind in zip(tokens, token_types) if kind in kinds]

    tokenizer.add_special_tokens(added((_CONTROL, _UNKNOWN), special=True))
    tokenizer.add_tokens(added((_USER_DEFINED,), special=False))
    ends = [i for i in (bos_token_id, eos_token_id) if i is not None]
    if ends:
        bos = f"{tokens[bos_token_id]} " if bos_token_id is not None else ""
        eos = f" {tokens[eos_token_id]}" if eos_token_id is not None else ""
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}$A{eos}", pair=f"{bos}$A{eos} {bos}$B:1{eos}",
            special_tokens=[(tokens[i], i) for i in dict.fromkeys(ends)])
    return tokenizer
