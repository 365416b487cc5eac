"""Structured output through the engine on tiny random models over a 7-letter vocabulary
(test_distribution.py's tokenizer): every output matches its grammar and stops when the grammar
is complete; greedy output with n-gram drafts, a sampling draft model and trees equals greedy
output without speculation; a sampling drafter proposes only grammar-allowed tokens; n-gram
proposals the grammar forbids are cut before verification; a request whose grammar cannot go on
fails alone; the compiled-grammar cache and limits."""

from __future__ import annotations

import re

import pytest

from verispec import SamplingParams
from verispec.config import CacheConfig, EngineConfig, SpeculativeConfig, StructuredOutputConfig
from verispec.engine.engine import LLMEngine
from verispec.spec_decode.draft_model import DraftModelDrafter
from verispec.spec_decode.ngram import NgramDrafter
from verispec.structured import GrammarCompiler, GrammarSpec

from ..tiny import run_all, tiny_model
from .test_distribution import EOS, LETTERS, V, letter_tokenizer

REGEXES = [r"(ab|cd)+e", r"a[bc]{2,5}(d|ef)", r"f(a|b)*c"]
SPECULATED = REGEXES[:2]  # greedy equality with every drafter (the third: output checks only)
PROMPTS = [[0, 1, 0, 1, 0, 1], [2, 3, 2, 3], [0, 1, 2, 3, 4, 5]]


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=1, vocab=V, scale=3.0, eos=(EOS,))


def engine(model, drafter=None, k: int = 0, tree=None, structured=StructuredOutputConfig()) -> LLMEngine:
    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=256, max_model_len=256,
                          cache=CacheConfig(4, 256, True),
                          speculative=SpeculativeConfig(method="none" if drafter is None else "ngram",
                                                        num_speculative_tokens=k, tree=tree),
                          structured=structured)
    return LLMEngine(model, letter_tokenizer(), config, drafter)


def run(e: LLMEngine, params: list[SamplingParams]) -> list:
    ids = [e.add_request(p, q) for p in PROMPTS for q in params]
    done = run_all(e)
    assert e.blocks.num_free_blocks == e.blocks.num_blocks
    return [done[i] for i in ids]


def text(token_ids: list[int]) -> str:
    return "".join(LETTERS[t] for t in token_ids if t != EOS)


def params_for(regex: str) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=40, regex=regex),
            SamplingParams(temperature=1.0, seed=3, max_tokens=40, regex=regex)]


@pytest.mark.parametrize("regex", REGEXES)
def test_outputs_match_and_speculation_changes_no_greedy_output(target, regex: str) -> None:
    params = params_for(regex)
    plain = run(engine(target), params)
    for out in plain:
        assert re.fullmatch(regex, text(out.token_ids)), (regex, out.token_ids)
        assert out.finish_reason == "stop"
    if regex not in SPECULATED:
        return
    greedy = [o.token_ids for o in plain[::2]]
    draft_model = DraftModelDrafter(tiny_model(seed=2, vocab=V, scale=2.0, eos=(EOS,)), num_blocks=256, block_size=4)
    for e in (engine(target, NgramDrafter(1, 3, 4), k=4), engine(target, draft_model, k=3),
              engine(target, NgramDrafter(1, 3, 4), k=6, tree=(2, 2, 1))):
        outs = run(e, params)
        assert [o.token_ids for o in outs[::2]] == greedy
        for out in outs:
            assert re.fullmatch(regex, text(out.token_ids)), (regex, out.token_ids)


def test_a_sampling_drafter_proposes_only_allowed_tokens(target) -> None:
    drafter = DraftModelDrafter(tiny_model(seed=4, vocab=V, eos=(EOS,)), num_blocks=256, block_size=4)
    proposed = []
    real = drafter.propose

    def spy(requests):
        batch = real(requests)
        for r, tokens in zip(requests, batch.token_ids):
            valid = tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens  # nothing follows the end
            proposed.append(r.grammar.valid_prefix(valid) == len(valid))
        return batch

    drafter.propose = spy
    outs = run(engine(target, drafter, k=3), [SamplingParams(temperature=1.0, seed=9, max_tokens=40, regex=REGEXES[1])])
    assert proposed and all(proposed)
    assert sum(o.stats.num_draft_tokens for o in outs) > 0


def test_forbidden_ngram_proposals_are_cut(target) -> None:
    """The prompts repeat "ab"; lookup proposes "ab..." where the grammar allows only c / d."""
    e = engine(target, NgramDrafter(1, 3, 4), k=4)
    rid = e.add_request([0, 1, 0, 1, 0, 1, 0], SamplingParams(temperature=0, max_tokens=12, regex=r"[cd]+e"))
    out = run_all(e)[rid]
    assert re.fullmatch(r"[cd]+e", text(out.token_ids))
    assert out.stats.num_draft_tokens == out.stats.num_accepted_tokens  # nothing sent to a sure rejection


def test_a_request_that_cannot_continue_fails_alone(target) -> None:
    e = engine(target, NgramDrafter(1, 3, 4), k=4)
    # "z" is no token: after "a" the grammar allows nothing.
    bad = e.add_request([0, 1], SamplingParams(temperature=0, max_tokens=8, regex="az"))
    good = e.add_request([0, 1], SamplingParams(temperature=0, max_tokens=8, regex="ab+c"))
    done = run_all(e)
    assert done[bad].finish_reason == "error" and "cannot continue" in done[bad].error
    assert done[good].finish_reason == "stop" and re.fullmatch("ab+c", text(done[good].token_ids))
    assert e.blocks.num_free_blocks == e.blocks.num_blocks


def test_compiled_grammars_are_cached_and_limited(target) -> None:
    compiler = GrammarCompiler(letter_tokenizer(), V, [EOS], StructuredOutputConfig(cache_size=2))
    spec = GrammarSpec.from_field("regex", "ab+c")
    first = compiler.matcher(spec)
    first.advance(0)  # a matcher is the request's own: the cached grammar stays at the start
    assert compiler.matcher(spec).masks([[]])[0].nonzero().flatten().tolist() == [0]
    assert list(compiler._cache) == [spec.grammar]  # noqa: SLF001 -- one compilation for both
    for rx in ("a", "b", "c"):
        compiler.matcher(GrammarSpec.from_field("regex", rx))
    assert len(compiler._cache) == 2  # noqa: SLF001 -- least recently used dropped

    e = engine(target, structured=StructuredOutputConfig(max_grammar_bytes=10))
    with pytest.raises(ValueError, match=r"regex has 11 bytes: expected at most 10 .*max_grammar_bytes"):
        e.add_request([0], SamplingParams(regex="a" * 11))
    shallow = engine(target, structured=StructuredOutputConfig(max_schema_depth=3))
    deep = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}}
    with pytest.raises(ValueError, match=r"json_schema is nested 5 levels deep: expected at most 3 .*max_schema_depth"):
        shallow.add_request([0], SamplingParams(json_schema=deep))
    slow = engine(target, structured=StructuredOutputConfig(compile_timeout_s=1e-9))
    # Thousands of alternatives take milliseconds to compile: never done within a nanosecond.
    many = "(" + "|".join("a" + "b" * (i % 50) + "c" * (i // 50) for i in range(3000)) + ")"
    with pytest.raises(ValueError, match=r"regex took more than 1e-09 s to compile .*compile_timeout_s"):
        slow.add_request([0], SamplingParams(regex=many))
    assert not any(x.has_unfinished() for x in (e, shallow, slow))


@pytest.mark.parametrize("kwargs,message", [
    (dict(json_object=True, regex="a"), r"json_object and regex are both set: expected at most one of"),
    (dict(json_schema={"type": "objectx"}), r"json_schema is invalid: .*objectx"),
    (dict(json_schema="{nope"), r"json_schema is not valid JSON"),
    (dict(json_schema=[1]), r"json_schema=\[1\] is invalid: expected a JSON Schema"),
    (dict(regex="(ab"), r"(?s)regex is invalid: .*unclosed group"),
    (dict(grammar="start: foo"), r"(?s)grammar is invalid: .*unknown name"),
    (dict(regex=""), r"regex='' is invalid: expected a non-empty string"),
    (dict(json_object="yes"), r"json_object='yes' is invalid: expected a bool"),
])
def test_sampling_params_are_validated(kwargs, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_gbnf_and_lark_grammars_are_accepted() -> None:
    assert SamplingParams(grammar='root ::= "yes" | "no"').grammar_spec.kind == "grammar"
    assert SamplingParams(grammar='start: "yes" | "no"').grammar_spec.kind == "grammar"
    assert SamplingParams(json_object=True).grammar_spec.source == '{"type": "object"}'
