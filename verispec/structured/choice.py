"""vLLM's guided_choice (the output is exactly one of a list of strings) as a Lark grammar.

The choices are one terminal, an alternation the grammar engine's lexer compiles into one
automaton, rather than one parser rule with a branch per choice: llguidance's Earley parser holds
at most 2,000 items in one row, so a rule of 5,000 branches failed at the first token, while the
lexer takes 10,000 choices (tests/serve/test_hostile_grammars.py) and more, up to max_grammar_bytes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from itertools import repeat


_CHUNK = 2_000  # choices per C-level call: about a millisecond of holding the interpreter


def choice_grammar(choices: Sequence[str], max_bytes: int | None = None) -> str:
    """ValueError naming guided_choice unless `choices` is a non-empty list of non-empty strings
    whose grammar has at most `max_bytes` (as UTF-8; None: any size), found before the rest of
    an oversized list is built."""
    # all() over map() runs in C: a generator's Python frame per choice took 50 ms at 100,000.
    if isinstance(choices, str) or not isinstance(choices, Sequence) or not choices \
            or not all(map(isinstance, choices, repeat(str))) or not all(choices):
        raise ValueError("guided_choice is invalid: expected a non-empty list of non-empty strings")
    # Duplicates would only make the automaton larger. json.dumps of a list is C code, about 10x
    # faster than one call per choice, but it holds the interpreter while it runs (100 ms at
    # 100,000 choices on a loaded machine, every other thread stalled): a chunk at a time.
    # '", "' occurs in a dump only between two strings, since a quote inside a string is escaped.
    head, tail = "start: CHOICE\nCHOICE: ", "\n"
    seen: dict[str, None] = {}
    alternatives = []
    size = len(head) + len(tail)
    for at in range(0, len(choices), _CHUNK):
        new = [c for c in dict.fromkeys(choices[at:at + _CHUNK]) if c not in seen]
        seen.update(dict.fromkeys(new))
        if new:
            alternatives.append(json.dumps(new, ensure_ascii=False)[1:-1].replace('", "', '" | "'))
            size += len(alternatives[-1].encode()) + (3 if len(alternatives) > 1 else 0)
        if max_bytes is not None and size > max_bytes:
            raise ValueError(f"guided_choice has more than {max_bytes} bytes as a grammar (its first {min(at + _CHUNK, len(choices))} "
                             f"choices): expected at most {max_bytes} (the grammar size limit, max_grammar_bytes)")
    return head + " | ".join(alternatives) + tail
