"""What a request asks its output to match, checked without a tokenizer.

A *grammar spec* is one of SamplingParams' structured-output fields turned into the grammar
engine's (llguidance's) grammar text: json_schema (a JSON Schema, dict or JSON text),
json_object (any JSON object), regex (llguidance's own automata: no backtracking), grammar
(Lark, or GBNF as llama.cpp writes it, converted to Lark). The grammar text is also the key of
the compiled-grammar cache (compiler.py), which applies the engine's size and depth limits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

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
    def from_field(cls, kind: str, value: object) -> GrammarSpec:
        """ValueError naming `kind` when the value is malformed or llguidance refuses it (its
        message included). llguidance's own limits (grammar size, lexer fuel) bound the check."""
        import llguidance

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
            grammar = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_LAYOUT)
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{kind}={value!r} is invalid: expected a non-empty string")
            source = value
            if kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(source)
            else:
                from llguidance.gbnf_to_lark import any_to_lark

                try:
                    lark = any_to_lark(source)
                except Exception as error:  # the GBNF converter raises whatever its parser meets
                    raise ValueError(f"grammar is not valid Lark or GBNF: {error}") from None
                grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        else:
            raise ValueError(f"kind={kind!r} is invalid: expected one of {KINDS}")
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            raise ValueError(f"{kind} is invalid: {one_line(messages[0])}")
        return cls(kind, source, depth, grammar)

    def check_limits(self, max_bytes: int, max_depth: int) -> None:
        """ValueError naming the limit when the spec is larger or deeper than allowed."""
        size = len(self.source.encode("utf-8"))
        if size > max_bytes:
            raise ValueError(f"{self.kind} has {size} bytes: expected at most {max_bytes} (the "
                             "grammar size limit, max_grammar_bytes)")
        if self.depth > max_depth:
            raise ValueError(f"{self.kind} is nested {self.depth} levels deep: expected at most "
                             f"{max_depth} (the schema depth limit, max_schema_depth)")


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
