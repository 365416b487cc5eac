"""What a request asks its output to match, checked without a tokenizer.

A *grammar spec* is one of SamplingParams' structured-output fields turned into the grammar
engine's (llguidance's) grammar text: json_schema (a JSON Schema, dict or JSON text),
json_object (any JSON object), regex (llguidance's own automata: no backtracking), grammar
(Lark, or GBNF as llama.cpp writes it, converted to Lark). The grammar text is also the key of
the compiled-grammar cache (compiler.py), which applies the engine's size and depth limits.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..config import StructuredOutputConfig

KINDS = ("json_schema", "json_object", "regex", "grammar")
# JSON is written on one line as json.dumps writes it ({"a": 1, "b": [2, 3]}): free whitespace
# would let a model indent at length, and fixed separators are easy drafts. A schema's own
# "x-guidance" options override this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GrammarSpec:
    """kind: the SamplingParams field it came from (KINDS); source: that field's text (a schema
    as canonical JSON); depth: a schema's nesting depth (0 for regexes and grammars);
    grammar: llguidance's grammar text."""

    kind: str
    source: str
    depth: int
    grammar: str

    @classmethod
    def from_field(cls, kind: str, value: object, limits: StructuredOutputConfig | None = None) -> GrammarSpec:
        """ValueError naming `kind` when the value is malformed or llguidance refuses it (its
        message included). llguidance's own limits (grammar size, lexer fuel) bound the check.
        With `limits`, a spec past its size or depth is refused before llguidance sees it (a
        grammar of megabytes takes it seconds). The grammar text of a source is cached."""
        depth = 0
        if kind == "json_object":
            value = {"type": "object"}
        if kind in ("json_schema", "json_object"):
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except (ValueError, RecursionError) as error:
                    raise ValueError(f"json_schema is not valid JSON: {error}") from None
            if not isinstance(value, (dict, bool)):
                raise ValueError(f"json_schema={value!r} is invalid: expected a JSON Schema "
                                 "(an object or a boolean, as a dict or as JSON text)")
            depth = json_depth(value)
            try:
                source = json.dumps(value, allow_nan=False)  # key order matters: properties come in it
            except (TypeError, ValueError, RecursionError) as error:
                raise ValueError(f"json_schema cannot be written as JSON: {error}") from None
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{kind}={value!r} is invalid: expected a non-empty string")
            source = value
        else:
            raise ValueError(f"kind={kind!r} is invalid: expected one of {KINDS}")
        if limits is not None:
            _check_limits(kind, source, depth, limits.max_grammar_bytes, limits.max_schema_depth)
        return cls(kind, source, depth, _GRAMMARS.get(kind, source))

    def check_limits(self, max_bytes: int, max_depth: int) -> None:
        """ValueError naming the limit when the spec is larger or deeper than allowed."""
        _check_limits(self.kind, self.source, self.depth, max_bytes, max_depth)


def _check_limits(kind: str, source: str, depth: int, max_bytes: int, max_depth: int) -> None:
    size = len(source.encode("utf-8"))
    if size > max_bytes:
        raise ValueError(f"{kind} has {size} bytes: expected at most {max_bytes} (the "
                         "grammar size limit, max_grammar_bytes)")
    if depth > max_depth:
        raise ValueError(f"{kind} is nested {depth} levels deep: expected at most "
                         f"{max_depth} (the schema depth limit, max_schema_depth)")


def _grammar(kind: str, source: str) -> str:
    """llguidance's grammar text for a field's source (json_object's is a json_schema's);
    ValueError naming `kind` when llguidance refuses it."""
    import llguidance

    if kind in ("json_schema", "json_object"):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_LAYOUT)
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(source)
    else:
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(source)
        except Exception as error:  # the GBNF converter raises whatever its parser meets
            raise ValueError(f"grammar is not valid Lark or GBNF: {error}") from None
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"{kind} is invalid: {one_line(messages[0])}")
    return grammar


class _GrammarCache:
    """The grammar texts of recent sources, least recently used dropped first past `max_bytes`
    of sources: a server builds a request's SamplingParams once per sample (n), and clients
    repeat their schemas, while building one can take llguidance 100 ms (20,000 choices)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._texts: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, kind: str, source: str) -> str:
        key = (kind, source)
        with self._lock:
            if key in self._texts:
                self._texts.move_to_end(key)
                return self._texts[key]
        grammar = _grammar(kind, source)
        if len(source) + len(grammar) <= self.max_bytes:
            with self._lock:
                if key not in self._texts:
                    self._texts[key] = grammar
                    self._bytes += len(source) + len(grammar)
                while self._bytes > self.max_bytes:
                    (_, old), text = self._texts.popitem(last=False)
                    self._bytes -= len(old) + len(text)
        return grammar


_GRAMMARS = _GrammarCache(max_bytes=32 * 1024 * 1024)


def one_line(message: str) -> str:
    """llguidance's multi-line message (source excerpts, carets) on one line, as errors are here."""
    return "; ".join(line.strip() for line in message.splitlines() if line.strip().strip("^"))


def json_depth(value: object) -> int:
    """Nesting depth of a JSON document, iteratively (a hostile schema cannot overflow the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest
