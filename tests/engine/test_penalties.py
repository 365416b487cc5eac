"""Penalties, logit bias and token masks in the engine, on tiny random models: greedy output
equals a token-by-token reference decode, speculation (n-gram and draft model) changes nothing,
and bad token ids are rejected when the request is added."""

from __future__ import annotations

import pytest
import torch

from verispec import SamplingParams
from verispec.runtime.kv_cache import BlockManager
from verispec.runtime.runner import Feed, ModelRunner
from verispec.sample.reference import reference_probs
from verispec.spec_decode.draft_model import DraftModelDrafter
from verispec.spec_decode.ngram import NgramDrafter

from ..tiny import run_all, tiny_engine, tiny_model

PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7], [9, 9, 9, 9, 9, 9], list(range(16)), [3]]


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **kwargs)


ADJUSTED = {
    "repetition": greedy(repetition_penalty=1.6),
    "presence": greedy(presence_penalty=1.5),
    "frequency+bias": greedy(frequency_penalty=0.7, logit_bias={3: 2.0, 9: -5.0}),
    "banned": greedy(banned_token_ids=[1, 2, 9]),
    "allowed+repetition": greedy(allowed_token_ids=[0, 4, 5, 6, 7], repetition_penalty=2.0),
}


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, scale=3.0)


def generate(engine, prompts, params: SamplingParams) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    done = run_all(engine)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return [done[i].token_ids for i in ids]


def reference_decode(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy, one token at a time: each step recomputes the logits of the whole context and
    takes the argmax of the reference pipeline with the output so far as history."""
    output: list[int] = []
    while len(output) < params.max_tokens:
        tokens = prompt + output
        blocks = BlockManager(64, 4)
        blocks.allocate("s", len(tokens))
        logits = ModelRunner(model, blocks).forward([Feed("s", tokens, 0, 1)])[0]
        output.append(int(reference_probs(logits, params, None, prompt, output).argmax()))
    return output


@pytest.mark.parametrize("name", list(ADJUSTED))
def test_greedy_output_is_the_reference_decode(target, name: str) -> None:
    params = ADJUSTED[name]
    plain = generate(tiny_engine(target), PROMPTS, greedy())
    adjusted = generate(tiny_engine(target), PROMPTS, params)
    assert adjusted == [reference_decode(target, p, params) for p in PROMPTS]
    assert adjusted != plain  # the adjustment changed the output
    for out in adjusted:
        assert not set(out) & set(params.banned_token_ids)
        assert params.allowed_token_ids is None or set(out) <= set(params.allowed_token_ids)


def test_a_large_bias_makes_its_token_emitted(target) -> None:
    out = generate(tiny_engine(target), PROMPTS[:2], greedy(logit_bias={11: 100.0}))
    assert out == [[11] * 16] * 2


@pytest.mark.parametrize("name", list(ADJUSTED))
def test_greedy_speculative_equals_greedy_plain(target, name: str) -> None:
    """The self-drafting model proposes with the same penalties from its own history, so it
    agrees with the target at every position (acceptance 1)."""
    params = ADJUSTED[name]
    plain = generate(tiny_engine(target), PROMPTS, params)
    assert generate(tiny_engine(target, NgramDrafter(1, 3, 4), k=4), PROMPTS, params) == plain
    # A draft model as large as its target never pays (each position costs a pass), so the
    # adaptive K would keep it from drafting: K stays fixed.
    engine = tiny_engine(target, DraftModelDrafter(target, num_blocks=256, block_size=4), k=4, adaptive=False)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done = run_all(engine)
    assert [done[i].token_ids for i in ids] == plain
    assert all(done[i].stats.acceptance_rate == 1.0 for i in ids)


def test_bad_token_ids_are_rejected_at_add_request(target) -> None:
    engine = tiny_engine(target)
    with pytest.raises(ValueError, match=r"logit_bias contains token id 16: expected ids in \[0, 16\)"):
        engine.add_request([1, 2], greedy(logit_bias={16: 1.0}))
    with pytest.raises(ValueError, match=r"banned_token_ids contains token id 99"):
        engine.add_request([1, 2], greedy(banned_token_ids=[3, 99]))
    with pytest.raises(ValueError, match=r"allowed_token_ids contains token id 16"):
        engine.add_request([1, 2], greedy(allowed_token_ids=[16]))
    assert not engine.has_unfinished()
