"""Compiling grammar specs for one model's tokenizer: limits, a time limit and an LRU cache.

A compiled grammar is a pristine llguidance matcher (its lexer and parser built over the
tokenizer's token trie); each request gets a deep copy, so a schema many requests use compiles
once. Compilation runs on the caller's thread (LLMEngine.prepare_request, which the server runs
off the engine thread and off its event loop) with llguidance's limits, and a wall-clock limit on
top: a grammar still compiling then is refused (its worker thread ends within llguidance's fuel
limits).

Compiling includes the first mask, so that a grammar no output can satisfy (an empty language:
a regex of no character, a schema whose $refs only loop) or one whose first mask already exhausts
llguidance's budgets is refused here, as a ValueError naming the field, rather than failing
during generation.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from ..config import StructuredOutputConfig
from .matcher import GrammarMatcher
from .spec import GrammarSpec, one_line


class GrammarCompiler:
    """Compiles GrammarSpecs for a tokenizer (verispec.model.Tokenizer) whose logits have
    `vocab_size` columns; `eos_token_ids` end a grammar's output. Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 config: StructuredOutputConfig = StructuredOutputConfig()) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self.config = config
        self._lock = threading.Lock()
        self._lltokenizer = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher for `spec`, at the start of the output. ValueError naming the limit
        or with llguidance's message when the spec is refused."""
        c = self.config
        spec.check_limits(c.max_grammar_bytes, c.max_schema_depth)
        with self._lock:
            compiled = self._cache.get(spec.grammar)
            if compiled is not None:
                self._cache.move_to_end(spec.grammar)
                return GrammarMatcher(compiled.deep_copy(), self.vocab_size)
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec.grammar] = compiled
            self._cache.move_to_end(spec.grammar)
            while len(self._cache) > c.cache_size:
                self._cache.popitem(last=False)
        return GrammarMatcher(compiled.deep_copy(), self.vocab_size)

    def _compile(self, spec: GrammarSpec):  # -> llguidance.LLMatcher
        import llguidance

        tokenizer = self.lltokenizer()
        future = self._pool.submit(_compile_and_start, tokenizer, spec.grammar, self.vocab_size)
        try:
            compiled, error = future.result(timeout=self.config.compile_timeout_s)
        except FutureTimeout:
            raise ValueError(f"{spec.kind} took more than {self.config.compile_timeout_s} s to compile "
                             "(the compile time limit, compile_timeout_s)") from None
        if error is not None:
            raise ValueError(f"{spec.kind} {error}")
        return compiled

    def lltokenizer(self):  # -> llguidance.LLTokenizer
        """llguidance's view of the tokenizer, built once (about half a second for 49k tokens)."""
        with self._lock:
            if self._lltokenizer is None:
                self._lltokenizer = _lltokenizer(self._tokenizer, self.vocab_size, self._eos)
            return self._lltokenizer


def _compile_and_start(tokenizer, grammar: str, vocab_size: int):  # -> (llguidance.LLMatcher, str | None)
    """The compiled matcher and, when it is refused, why (after the field's name)."""
    import llguidance

    compiled = llguidance.LLMatcher(tokenizer, grammar, log_level=0,
                                    limits=llguidance.LLParserLimits(verbose_errors=False))
    if compiled.is_error():
        return compiled, f"is invalid: {one_line(compiled.get_error())}"
    words = (vocab_size + 31) // 32
    bits = np.zeros(words, dtype=np.int32)
    # Twice, on two copies: the copies of a compiled grammar share its lexer's derivative cache
    # and expression budget, so a grammar whose first mask (nearly) spends that budget, such as
    # (a{1000}){1000}, passes once and then fails on every request's first mask.
    for _ in range(2):
        probe = compiled.deep_copy()
        probe.unsafe_compute_mask_ptr(bits.ctypes.data, words * 4)
        if probe.is_error() and not _dead_end(probe.get_error()):
            return compiled, (f"exhausts the grammar engine's budget in its first token masks "
                              f"({one_line(probe.get_error())}): llguidance's parser limits, e.g. its lexer's "
                              "expressions (max_lexer_states) and fuel (step_lexer_fuel)")
    if probe.is_error() or not bits.any():
        return compiled, ("allows no output: no token can begin it (its language is empty, e.g. a regex "
                          "that matches no character or a schema whose $refs only refer to each other)")
    return compiled, None


def _dead_end(error: str) -> bool:
    """Whether llguidance's error says that no token continues (rather than a limit ran out)."""
    return "NoExtensionBias" in error or "no token" in error.lower()


def _lltokenizer(tokenizer, vocab_size: int, eos: list[int]):
    import llguidance

    try:  # a Hugging Face tokenizer.json that llguidance reads itself (byte-level BPE, ...)
        return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    except ValueError:
        pass
    # Otherwise each token stands for the bytes it decodes to on its own, and text is tokenized
    # greedily (longest token first), which is how llguidance splits the bytes a grammar forces.
    size = tokenizer.vocab_size
    tokens = [tokenizer.decode([i], skip_special_tokens=False).encode("utf-8") if i < size else b""
              for i in range(vocab_size)]
    ids = {t: i for i, t in reversed(list(enumerate(tokens))) if t}
    longest = max(map(len, ids), default=1)

    class Words:
        eos_token_id = eos[0] if eos else 0
        bos_token_id = tokenizer.bos_token_id
        special_token_ids = [i for i in eos if i < vocab_size]

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: bytes) -> list[int]:
            out, at = [], 0
            while at < len(text):
                n = next((n for n in range(min(longest, len(text) - at), 0, -1) if text[at : at + n] in ids), 0)
                if n == 0:
                    at += 1  # a byte no token spells cannot be forced
                    continue
                out.append(ids[text[at : at + n]])
                at += n
            return out

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Words()), n_vocab=vocab_size, eos_token=eos)
