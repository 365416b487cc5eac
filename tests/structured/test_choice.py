"""guided_choice's grammar: quotes, backslashes and separators inside choices are kept apart
(the grammar matches exactly the choices), duplicates collapse, bad lists are refused."""

from __future__ import annotations

import pytest

from verispec.structured import GrammarCompiler, GrammarSpec
from verispec.structured.choice import choice_grammar

from ..model.conftest import tiny_tokenizer

TRICKY = ['a", "b', "c\\", '"', "d, e", "a"]


def test_tricky_choices_are_matched_exactly() -> None:
    tok = tiny_tokenizer()
    compiler = GrammarCompiler(tok, tok.vocab_size, [tok.eos_token_id])
    spec = GrammarSpec.from_field("grammar", choice_grammar(TRICKY + ["a"]))
    assert spec.grammar.count("|") == len(TRICKY) - 1  # one branch per distinct choice
    for text, accepted in [*((c, True) for c in TRICKY), ('a"', False), ("b", False), ('", "', False)]:
        matcher = compiler.matcher(spec)
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        assert (matcher.valid_prefix(ids) == len(ids)) is accepted, text


@pytest.mark.parametrize("bad", [[], ["a", ""], "ab", [1]])
def test_bad_choices(bad) -> None:
    with pytest.raises(ValueError, match="^guided_choice is invalid"):
        choice_grammar(bad)
