"""Tokenizer: text <-> token ids, chat templates, and streaming detokenization.

A thin layer over a `tokenizers.Tokenizer` (the Rust library behind Hugging Face's fast
tokenizers), built from a tokenizer.json or from a GGUF vocabulary (see gguf_vocab.py).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers.decoders import DecodeStream

from verispec.model.chat_template import CHATML_TEMPLATE, render_chat
from verispec.model.hf_checkpoint import read_json

# Prompt ids an IncrementalDecoder decodes before the output: enough for any token to read as it
# does in running text.
_CONTEXT_TOKENS = 4


def _token_content(value: object) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_chat_template(directory: Path, tokenizer_config: dict[str, Any]) -> str | None:
    # transformers >= 4.43 may save the template beside the config rather than in it.
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


def _quick_json(backend: tokenizers.Tokenizer) -> str:
    """`backend` as a tokenizer.json that loads fastest (it is read at every start-up): on one
    line, and BPE merges in the "a b" form tokenizers reads beside ["a", "b"] where no merged
    token holds a space: 0.06 s to load the embedded model's, against 0.095 s pretty-printed with
    pairs. The same tokenizer either way (backend.to_str() of the loaded one is unchanged)."""
    data = json.loads(backend.to_str())
    merges = data["model"].get("merges")
    if merges and all(isinstance(m, list) and " " not in m[0] and " " not in m[1] for m in merges):
        data["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


class Tokenizer:
    """Text <-> token ids for one model, with its chat template.

    special tokens: the vocabulary's control tokens (<|im_start|>, <|endoftext|>, ...). In text
        they are matched whole, so "<|im_start|>" encodes as one id; `decode` drops them when
        skip_special_tokens.
    BOS: `encode` adds it only when the model was trained with it (the backend's post-processor
        decides: SmolLM2 adds none, Llama 3 does).
    EOS: the token that ends a reply; the model config lists every stop token.
    """

    def __init__(self, backend: tokenizers.Tokenizer, bos_token_id: int | None,
                 eos_token_id: int | None, chat_template: str | None = None) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template

    @classmethod
    def from_directory(cls, directory: str | Path, bos_token_id: int | None = None,
                       eos_token_id: int | None = None) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json, chat_template.jinja) from a directory.

        The BOS/EOS named in tokenizer_config.json win over the ids passed as fallbacks."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"model={str(directory)!r} has no tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        # tokenizers reports every malformed file as a plain Exception; nothing else runs here.
        except Exception as error:
            raise ValueError(f"{str(path)!r} is not a valid tokenizer file: {error}") from None
        config_path = directory / "tokenizer_config.json"
        config = read_json(config_path) if config_path.is_file() else {}

        def special_id(key: str, fallback: int | None) -> int | None:
            content = _token_content(config.get(key))
            token_id = backend.token_to_id(content) if content is not None else None
            return fallback if token_id is None else token_id

        return cls(backend, special_id("bos_token", bos_token_id),
                   special_id("eos_token", eos_token_id), _read_chat_template(directory, config))

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json, readable by from_directory and by
        transformers."""
        directory = Path(directory)
        (directory / "tokenizer.json").write_text(_quick_json(self.backend), encoding="utf-8")
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for key, token_id in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id)):
            if token_id is not None:
                config[key] = self.backend.id_to_token(token_id)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                                         encoding="utf-8")

    @functools.cached_property
    def longest_token(self) -> int:
        """Characters of the vocabulary's longest token string (byte-level and byte-fallback
        spellings are never shorter than the text they stand for)."""
        return max((len(token) for token in self.backend.get_vocab(with_added_tokens=True)), default=1)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. add_special_tokens=False leaves out a BOS the model would
        otherwise get (for text whose chat template already wrote it)."""
        if not isinstance(text, str):
            raise TypeError(f"text={text!r} is invalid: expected a str")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """What one token adds to running text: `decode([token_id])`, except that a
        SentencePiece token keeps the leading space that decode drops at the start of a text
        ("▁world" reads " world"), so the tokens of an output join into its text."""
        alone = self.decode([token_id], skip_special_tokens)
        return self.decode([token_id, token_id], skip_special_tokens)[len(alone):]

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **variables: Any) -> str:
        """The prompt text for a conversation, from the model's template (ChatML if none).

        Encode the result with add_special_tokens=False: templates write their own BOS."""
        def token(token_id: int | None) -> str:
            return "" if token_id is None else self.backend.id_to_token(token_id)

        variables = {"bos_token": token(self.bos_token_id), "eos_token": token(self.eos_token_id),
                     **variables}
        return render_chat(self.chat_template or CHATML_TEMPLATE, messages,
                           add_generation_prompt, **variables)

    def incremental_decoder(self, skip_special_tokens: bool = True,
                            context: Sequence[int] = ()) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens, context)


class IncrementalDecoder:
    """Streaming detokenizer for one sequence: feed generated ids, get the text they complete.

    Text is held back while the ids so far end inside a multi-byte UTF-8 character (or inside
    a word whose spacing depends on what follows), so chunks never split a character and their
    concatenation equals decoding all ids at once.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 context: Sequence[int] = ()) -> None:
        """context: the ids before the first pushed one (a prompt's). The text is what the
        pushed ids add after them, so a SentencePiece token that starts the output keeps its
        space (" Paris" after "The capital is", as vLLM and llama.cpp print it; decode alone
        strips it). A context that ends inside a character is not used: the first pushed ids
        would complete it."""
        self._backend = tokenizer.backend
        tail = list(context)[-_CONTEXT_TOKENS:]
        if tail and tokenizer.decode(tail, skip_special_tokens).endswith("\ufffd"):
            tail = []
        self._stream = DecodeStream(ids=tail or None, skip_special_tokens=skip_special_tokens)

    def push(self, token_ids: Iterable[int]) -> str:
        """The text newly completed by `token_ids` ("" when they complete none yet)."""
        pieces = (self._stream.step(self._backend, token_id) for token_id in token_ids)
        return "".join(piece for piece in pieces if piece is not None)
