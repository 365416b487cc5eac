"""Tokenizer: round trips, special tokens, chat templates, streaming detokenization."""

from __future__ import annotations

import json

import pytest
import tokenizers

from verispec.model import IncrementalDecoder, Tokenizer
from verispec.model.chat_template import CHATML_TEMPLATE

from .conftest import tiny_tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "Ünïcödé: naïve café, 日本語のテキスト, Ελληνικά, emoji 🙂👍🏽 and 𝔘𝔫𝔦",
    "numbers 1234567 and 3.14159",
]


@pytest.fixture(scope="module")
def smollm(embedded) -> Tokenizer:
    return embedded[1]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(smollm, text) -> None:
    assert smollm.decode(smollm.encode(text)) == text


def test_special_tokens(smollm) -> None:
    assert smollm.encode("<|im_start|>") == [1]
    assert smollm.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    ids = smollm.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[-1] == 2 == smollm.eos_token_id
    assert smollm.decode(ids) == "user\nhi"
    assert smollm.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert smollm.vocab_size == 49152
    assert smollm.encode("hi")[0] != smollm.bos_token_id  # SmolLM2 adds no BOS


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decoder_never_splits_characters(smollm, text) -> None:
    ids = smollm.encode(text)
    decoder = smollm.incremental_decoder()
    chunks = [decoder.push([token]) for token in ids]
    assert "".join(chunks) == text
    assert not any("\ufffd" in chunk for chunk in chunks)
    # Multi-token pushes give the same text.
    decoder = IncrementalDecoder(smollm)
    assert "".join(decoder.push(ids[i : i + 3]) for i in range(0, len(ids), 3)) == text


def test_incremental_decoder_holds_back_partial_utf8(smollm) -> None:
    ids = smollm.encode("🙂")
    assert len(ids) > 1  # a 4-byte character spread over byte-level tokens
    decoder = smollm.incremental_decoder()
    assert [decoder.push([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.push(ids[-1:]) == "🙂"


def test_incremental_decoder_skips_special_tokens(smollm) -> None:
    ids = smollm.encode("<|im_start|>assistant\nSure!<|im_end|>")
    assert "".join(smollm.incremental_decoder().push([t]) for t in ids) == "assistant\nSure!"


def test_chat_template_from_the_model(smollm) -> None:
    prompt = smollm.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                      "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                      "<|im_start|>assistant\n")
    no_prompt = smollm.apply_chat_template([{"role": "system", "content": "Be brief."}],
                                           add_generation_prompt=False)
    assert no_prompt == "<|im_start|>system\nBe brief.<|im_end|>\n"


def test_chat_template_falls_back_to_chatml() -> None:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    messages = [{"role": "user", "content": "the"}]
    assert tokenizer.apply_chat_template(messages) == \
        "<|im_start|>user\nthe<|im_end|>\n<|im_start|>assistant\n"
    tokenizer.chat_template = CHATML_TEMPLATE
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == \
        "<|im_start|>user\nthe<|im_end|>\n"


def test_bad_input_is_named(smollm) -> None:
    with pytest.raises(ValueError, match="messages="):
        smollm.apply_chat_template([{"content": "no role"}])
    with pytest.raises(TypeError, match="text="):
        smollm.encode(None)


def test_save_and_reload(tmp_path) -> None:
    tokenizer = tiny_tokenizer()
    tokenizer.save(tmp_path)
    again = Tokenizer.from_directory(tmp_path)
    text = "<|im_start|>user\nthe winter<|im_end|>"
    assert again.encode(text) == tokenizer.encode(text)
    assert (again.bos_token_id, again.eos_token_id) == (1, 2)
    assert again.chat_template == CHATML_TEMPLATE


def test_the_saved_json_is_the_quick_form_of_the_same_tokenizer(tmp_path, smollm) -> None:
    """tokenizer.json is read at every start-up, so it is written as it loads fastest: on one line,
    merges as "a b"; what is read back is the tokenizer saved."""
    smollm.save(tmp_path)
    text = (tmp_path / "tokenizer.json").read_text(encoding="utf-8")
    merges = json.loads(text)["model"]["merges"]
    assert "\n" not in text and len(merges) == 48900 and all(isinstance(m, str) for m in merges)
    assert Tokenizer.from_directory(tmp_path).backend.to_str() == smollm.backend.to_str()


def test_merges_of_tokens_with_spaces_keep_their_pairs(tmp_path) -> None:
    """"a b" cannot spell the merge of "a " and "b": such a vocabulary keeps ["a ", "b"] (read as
    "a  b" it would not load)."""
    vocab = {"a": 0, " ": 1, "b": 2, "a ": 3, "a b": 4}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [("a", " "), ("a ", "b")]))
    Tokenizer(backend, None, None).save(tmp_path)
    assert json.loads((tmp_path / "tokenizer.json").read_text())["model"]["merges"] == [["a", " "], ["a ", "b"]]
    again = Tokenizer.from_directory(tmp_path)
    assert again.backend.to_str() == backend.to_str() and again.encode("a b") == [4]


def test_qwen2_pre_tokenizer_splits_single_digits() -> None:
    """GGUF tokenizer.ggml.pre='qwen2' (Qwen2/2.5/3): Llama 3's split, digits one by one."""
    from verispec.model.gguf_vocab import _PRE_TOKENIZERS

    def pieces(pre: str) -> list[str]:
        return [p for p, _ in _PRE_TOKENIZERS[pre]().pre_tokenize_str("it's 12345 ok")]

    assert pieces("qwen2") == ["it", "'s", "Ġ", "1", "2", "3", "4", "5", "Ġok"]
    assert pieces("llama3") == ["it", "'s", "Ġ", "123", "45", "Ġok"]
