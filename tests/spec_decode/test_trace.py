"""StepRecord.origins and ends_in_bonus: which emitted token came from where."""

from __future__ import annotations

import pytest

from verispec import SamplingParams
from verispec.config import CacheConfig, EngineConfig, SpeculativeConfig
from verispec.engine.engine import LLMEngine
from verispec.spec_decode.medusa import MedusaDrafter
from verispec.spec_decode.trace import StepRecord, TokenOrigin, ends_in_bonus

from .. import learned
from ..tiny import word_tokenizer

A, R, B, P = TokenOrigin.ACCEPTED, TokenOrigin.RECOVERED, TokenOrigin.BONUS, TokenOrigin.PLAIN


def test_a_rejection_ends_in_the_recovered_token() -> None:
    assert StepRecord(3, num_draft=4, num_accepted=2, bonus=False).origins(3) == [A, A, R]


def test_every_draft_accepted_ends_in_the_bonus_token() -> None:
    assert StepRecord(1, num_draft=3, num_accepted=3, bonus=True).origins(4) == [A, A, A, B]


def test_a_step_without_drafts_emits_a_plain_token() -> None:
    assert StepRecord(1, num_draft=0, num_accepted=0, bonus=True).origins(1) == [P]


def test_a_stop_keeps_the_first_tokens_origins() -> None:
    assert StepRecord(2, num_draft=3, num_accepted=3, bonus=True).origins(2) == [A, A]


@pytest.mark.parametrize("n", [-1, 4])
def test_more_tokens_than_the_step_emitted_are_refused(n: int) -> None:
    with pytest.raises(ValueError, match=f"num_tokens={n} is invalid"):
        StepRecord(1, num_draft=3, num_accepted=2, bonus=False).origins(n)


def test_a_chain_ends_in_a_bonus_only_when_every_draft_was_accepted() -> None:
    assert ends_in_bonus(3, None, [0, 1, 2])
    assert not ends_in_bonus(3, None, [0, 1])
    assert ends_in_bonus(0, None, [])


def test_a_tree_ends_in_a_bonus_when_the_path_ends_at_a_leaf() -> None:
    parents = [-1, -1, 0, 0, 2]  # root -> 0, 1; 0 -> 2, 3; 2 -> 4
    assert ends_in_bonus(5, parents, [0, 2, 4])  # 4 is a leaf
    assert ends_in_bonus(5, parents, [1])  # so is 1
    assert not ends_in_bonus(5, parents, [0])  # 2 and 3 were rejected
    assert not ends_in_bonus(5, parents, [])  # 0 and 1 were rejected


def test_a_full_tree_steps_last_token_is_a_bonus_exactly_after_a_leaf() -> None:
    """Medusa's static tree (3, 1) through the engine, greedy: a step that verified all 6 nodes
    ends in a bonus exactly when it accepted a path of 2 (only depth-2 nodes are leaves); an
    accepted depth-1 node has a rejected child, so the token after it is recovered."""
    target, prompts = learned.target(), learned.prompts(4, seed=11)
    spec = SpeculativeConfig(method="medusa", tree=(3, 1), adaptive=False)
    config = EngineConfig(max_num_batched_tokens=4096, max_model_len=512, cache=CacheConfig(4, 8192),
                          speculative=spec)
    engine = LLMEngine(target, word_tokenizer(target.config.vocab_size), config,
                       MedusaDrafter(learned.trained("medusa")))
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), request_id=str(i))
    records = []
    while engine.has_unfinished():
        records += [(out.new_step, len(out.new_token_ids)) for out in engine.step() if out.new_step is not None]
    full = [r for r, _ in records if r.num_draft == 6]
    assert all(r.bonus == (r.num_accepted == 2) for r in full)
    assert {r.num_accepted for r in full} == {0, 1, 2}
    assert all(n == r.num_accepted + 1 for r, n in records)
