"""GGUF files with SentencePiece vocabularies (tokenizer.ggml.model "llama": Llama 2, Mistral 7B,
Gemma, Phi-3) tokenize as sentencepiece itself does.

Tiny BPE models are trained with sentencepiece (identity normalization and no whitespace
clean-up, as in those models), written into GGUF files the way llama.cpp's converter writes them
(pieces, scores, token types; user-defined tokens with real spaces and score -1000), and read back
through the loader. Three shapes: Llama's (space prefix, byte fallback), Gemma's (no prefix,
runs of spaces as user-defined tokens) and one without byte tokens (unknown characters -> <unk>).
"""

from __future__ import annotations

import io
import random
import re

import gguf
import pytest
import sentencepiece

from verispec import LLM, SamplingParams
from verispec.model import load_model
from verispec.model.gguf_file import read_gguf

from .conftest import make_hf_tiny
from .test_loader import write_tiny_gguf

_CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world! Hello there, hello.",
           "Numbers 12345 and 2024-11-26, prices $3.50.", "  indented  code\n\tline two\n",
           "naïve café résumé", "über straße", "数字 中文 测试", "emoji 🙂 ok"] * 20
# Llama 2 has no <|end|>; Phi-3 and fine-tunes add such control tokens.
_CONTROL = ["<|end|>"]
SHAPES = {  # name -> (add_dummy_prefix, byte_fallback, user-defined symbols)
    "llama": (True, True, ["<tool>"]),
    "gemma": (False, True, ["\u2581\u2581\u2581", "<tool>"]),
    "no-byte-fallback": (True, False, ["<tool>"]),
}
# Spaces, leading spaces, newlines and tabs, digits, accents, CJK, characters the tiny
# vocabularies lack (byte fallback or <unk>), 4-byte UTF-8 (emoji), then random mixes of them.
_ALPHABET = list("abcdefghijklmnopqrstuvwxyzTHE.,!?$-0123456789\n\t") + [" "] * 6 + list(
    "éïßü中文数字🙂😀Ωж€")
_FIXED = ["", " ", "  ", "Hello", " Hello", "  Hello  world\n", "\n\nx", "12345", "naïve café",
          "数字中文", "🙂😀", "Ω€ж", "tab\there", "end "]


def _texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return _FIXED + ["".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, 30)))
                     for _ in range(count)]


def train(shape: str) -> sentencepiece.SentencePieceProcessor:
    prefix, fallback, user = SHAPES[shape]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS), model_writer=model, model_type="bpe",
        vocab_size=400 if fallback else 150, byte_fallback=fallback,
        character_coverage=0.98 if fallback else 1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=prefix, split_digits=True,
        allow_whitespace_only_pieces=True, user_defined_symbols=user,
        control_symbols=_CONTROL, minloglevel=2)
    return sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())


def spm_vocab(sp, user: list[str]) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) as llama.cpp's convert_hf_to_gguf.py writes them."""
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        piece, score = sp.id_to_piece(i), sp.get_score(i)
        kind = (gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL
                if sp.is_control(i) else gguf.TokenType.UNUSED if sp.is_unused(i)
                else gguf.TokenType.BYTE if sp.is_byte(i) else gguf.TokenType.NORMAL)
        if piece in user:  # added tokens: "pre-normalized" spaces, score -1000
            piece, score, kind = piece.replace("\u2581", " "), -1000.0, gguf.TokenType.USER_DEFINED
        tokens.append(piece)
        scores.append(score)
        types.append(int(kind))
    return tokens, scores, types


def write_spm_gguf(path, shape: str, sp, add_bos: bool | None = None, name: str | None = None,
                   chat_template: str | None = None, model: str = "llama") -> None:
    tokens, scores, types = spm_vocab(sp, SHAPES[shape][2])

    def write_vocab(writer) -> None:
        writer.add_tokenizer_model(model)
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(sp.bos_id())
        writer.add_eos_token_id(sp.eos_id())
        writer.add_unk_token_id(sp.unk_id())
        writer.add_add_space_prefix(SHAPES[shape][0])
        if add_bos is not None:  # absent: llama.cpp's default for SentencePiece, true
            writer.add_add_bos_token(add_bos)
        if name is not None:
            writer.add_name(name)
        if chat_template is not None:
            writer.add_chat_template(chat_template)

    write_tiny_gguf(path, make_hf_tiny(tied=True, vocab_size=len(tokens)), write_vocab)


@pytest.fixture(scope="module", params=list(SHAPES))
def spm_file(request, tmp_path_factory):
    """(shape, sentencepiece processor, GGUF path) for each shape."""
    sp = train(request.param)
    path = tmp_path_factory.mktemp("spm") / f"{request.param}.gguf"
    write_spm_gguf(path, request.param, sp)
    return request.param, sp, path


def test_encode_and_decode_match_sentencepiece(spm_file) -> None:
    shape, sp, path = spm_file
    tokenizer = read_gguf(path, progress=False).tokenizer
    unknown = sp.unk_id()
    for text in _texts(400):
        ids = sp.encode(text)
        assert tokenizer.encode(text, add_special_tokens=False) == ids, text
        # sentencepiece spells <unk> " ⁇ "; llama.cpp and transformers drop it as special.
        if unknown not in ids:
            assert tokenizer.decode(ids) == sp.decode(ids), text
        # llama.cpp adds BOS to SentencePiece text unless the file says otherwise.
        assert tokenizer.encode(text) == [sp.bos_id()] + ids
    # Any sequence of ordinary and user-defined tokens and the byte tokens of whole characters
    # decodes as sentencepiece decodes it.
    rng = random.Random(1)
    ordinary = [[i] for i in range(sp.vocab_size())
                if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))]
    if SHAPES[shape][1]:
        ordinary += [[sp.piece_to_id(f"<0x{b:02X}>") for b in c.encode()] for c in "é€🙂\n"]
    for _ in range(200):
        ids = sum(rng.choices(ordinary, k=rng.randint(1, 12)), [])
        assert tokenizer.decode(ids) == sp.decode(ids), ids
    if SHAPES[shape][1]:
        # A byte run that is not UTF-8 becomes one U+FFFD per byte, as Hugging Face's
        # ByteFallback decoder does (sentencepiece keeps the run's valid bytes: "\ufffdR").
        assert tokenizer.decode([sp.piece_to_id("<0xF0>"), sp.piece_to_id("<0x52>")]) == "\ufffd" * 2


def test_special_tokens_split_the_text_as_in_llama_cpp(spm_file) -> None:
    """Control and user-defined tokens are matched whole in text; each stretch of text between
    them is tokenized on its own, so it gets its own space prefix (llama.cpp, and Llama 2's own
    Hugging Face tokenizer, do the same). A control token decodes to nothing unless asked."""
    shape, sp, path = spm_file
    tokenizer = read_gguf(path, progress=False).tokenizer
    end, tool = sp.piece_to_id("<|end|>"), sp.piece_to_id("<tool>")
    text = "a</s>b<tool> c<|end|>\n d"
    expected = (sp.encode("a") + [sp.eos_id()] + sp.encode("b") + [tool] + sp.encode(" c")
                + [end] + sp.encode("\n d"))
    assert tokenizer.encode(text, add_special_tokens=False) == expected
    assert tokenizer.decode(expected) == sp.decode(expected).replace("<|end|>", "")
    assert tokenizer.decode(expected, skip_special_tokens=False).count("<|end|>") == 1


def test_streaming_decode_matches_decode(spm_file) -> None:
    """Pieces pushed token by token (byte-fallback characters arrive in 2-4 tokens) add up to
    the decoded text."""
    _, sp, path = spm_file
    tokenizer = read_gguf(path, progress=False).tokenizer
    for text in _texts(40, seed=2):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if sp.unk_id() in ids:
            continue
        stream = tokenizer.incremental_decoder()
        assert "".join(stream.push([i]) for i in ids) == tokenizer.decode(ids), text
        # After a prompt, the output keeps the space its first token starts with, and each
        # token's text (logprobs) joins into it.
        prompt = tokenizer.encode("Say:")
        stream = tokenizer.incremental_decoder(context=prompt)
        after = tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)):]
        assert "".join(stream.push([i]) for i in ids) == after, text
        if not any(sp.is_byte(i) for i in ids):
            assert "".join(tokenizer.token_text(i) for i in ids) == after, text


def test_phi3_special_tokens_swallow_the_whitespace_after_them(tmp_path) -> None:
    """llama.cpp strips the whitespace after a special token for files named Phi-3 (as Phi-3's
    tokenizer.json does), so the chat template's newline after <|user|> disappears."""
    sp = train("llama")
    write_spm_gguf(tmp_path / "phi.gguf", "llama", sp, name="Phi-3 Mini 4k Instruct")
    write_spm_gguf(tmp_path / "other.gguf", "llama", sp, name="Llama 2 7B")
    end = sp.piece_to_id("<|end|>")
    phi = read_gguf(tmp_path / "phi.gguf", progress=False).tokenizer
    other = read_gguf(tmp_path / "other.gguf", progress=False).tokenizer
    assert phi.encode("<|end|>\n hi</s> x", add_special_tokens=False) == (
        [end] + sp.encode("hi") + [sp.eos_id()] + sp.encode("x"))
    assert other.encode("<|end|>\n hi</s> x", add_special_tokens=False) == (
        [end] + sp.encode("\n hi") + [sp.eos_id()] + sp.encode(" x"))


_LLAMA2_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
                    "[INST] {{ m['content'] }} [/INST]{% else %} {{ m['content'] }}{{ eos_token }}"
                    "{% endif %}{% endfor %}")


@pytest.mark.parametrize("add_bos", [None, False])
def test_llm_chat_and_generate_follow_the_file(add_bos, tmp_path, monkeypatch) -> None:
    """The file's chat template writes BOS once; generate adds it unless add_bos_token is false;
    the turn-ending <|end|> stops generation like EOS; the cached checkpoint directory
    (tokenizer.json) tokenizes the same."""
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path / "cache"))
    sp = train("llama")
    path = tmp_path / "llama2.gguf"
    write_spm_gguf(path, "llama", sp, add_bos=add_bos, chat_template=_LLAMA2_TEMPLATE)
    bos = [sp.bos_id()] if add_bos is None else []
    model, _ = load_model(path, progress=False)
    assert model.config.eos_token_ids == (sp.eos_id(), sp.piece_to_id("<|end|>"))
    llm = LLM(str(path), draft=None, kv_cache_gib=0.001, progress=False)  # from the cache
    params = SamplingParams(max_tokens=2, temperature=0)
    messages = [{"role": "user", "content": "Hello  world"},
                {"role": "assistant", "content": "hi"}, {"role": "user", "content": "数字?"}]
    (chat,) = llm.chat(messages, params, use_tqdm=False)
    assert chat.prompt_token_ids == ([sp.bos_id()] + sp.encode("[INST] Hello  world [/INST] hi")
                                     + [sp.eos_id()] + sp.encode("[INST] 数字? [/INST]"))
    (plain,) = llm.generate(" Hello", params, use_tqdm=False)
    assert plain.prompt_token_ids == bos + sp.encode(" Hello")
    # The output text continues the prompt's (a first "▁" token reads " "), and structured
    # output works through the rebuilt vocabulary.
    tokenizer = llm.tokenizer
    for out in llm.generate(["Hello", "数字"], SamplingParams(max_tokens=6, temperature=0),
                            use_tqdm=False):
        prompt = tokenizer.decode(out.prompt_token_ids)
        assert out.text == tokenizer.decode(out.prompt_token_ids + out.token_ids)[len(prompt):]
    (digits,) = llm.generate("n=", SamplingParams(max_tokens=4, temperature=0, regex=r" [0-9]{3}"),
                             use_tqdm=False)
    assert re.fullmatch(r" [0-9]{3}", digits.text)


def test_unsupported_vocabulary_is_refused_in_one_line(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path / "cache"))
    write_spm_gguf(tmp_path / "t5.gguf", "llama", train("llama"), model="t5")
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model='t5', expected one of gpt2 "
                                         r"\(byte-level BPE\), llama \(SentencePiece BPE\)$"):
        load_model(tmp_path / "t5.gguf", progress=False)
