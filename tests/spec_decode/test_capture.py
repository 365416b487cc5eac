"""A learned drafter that does not pay steps aside (LLMEngine._capture, _prefix_limit): with the
adaptive K at 0 the target runs its plain pass except for prompts and the few steps before a
probe, every probe still drafts, greedy output stays plain decoding's; the target takes a
prompt's whole cached prefix for a request that may have holes in its features, only what the
head can restore for a batch-invariant (seeded) one, which also keeps every feature."""

from __future__ import annotations

import pytest

from verispec import SamplingParams
from verispec.config import CacheConfig, DraftCost, EngineConfig, SpeculativeConfig
from verispec.engine.engine import FEATURE_LEAD, LLMEngine
from verispec.spec_decode.eagle import EagleDrafter

from .. import learned
from ..tiny import run_all, word_tokenizer

PROMPT = list(range(3, 23))  # 20 tokens: 5 blocks of 4


def _config(spec: SpeculativeConfig) -> EngineConfig:
    return EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512,
                        cache=CacheConfig(4, 1024), speculative=spec)


def _engine(draft_cost: DraftCost | None = None, adaptive: bool = True) -> tuple[LLMEngine, list[str]]:
    """An engine with an untrained EAGLE head whose drafting is priced `draft_cost` (at a step a
    call, K stays 0 and only probes draft, 32 steps apart and more), and the log of its target
    passes ("plain" / "captured")."""
    drafter = EagleDrafter(learned.untrained("eagle"), num_blocks=1024, block_size=4)
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=3, adaptive=adaptive, draft_cost=draft_cost,
                             row_cost=0.1 if draft_cost else None)
    engine = LLMEngine(learned.target(), word_tokenizer(learned.VOCAB), _config(spec), drafter)
    passes: list[str] = []
    forward, forward_hidden = engine.runner.forward, engine.runner.forward_hidden

    def plain(feeds):
        passes.append("plain")
        return forward(feeds)

    def captured(feeds, layers):
        passes.append("captured")
        return forward_hidden(feeds, layers)

    engine.runner.forward, engine.runner.forward_hidden = plain, captured
    return engine, passes


def _generate(engine: LLMEngine, params: SamplingParams, prompt: list[int] = PROMPT) -> tuple[list[int], int]:
    """(tokens, drafts verified) of one request."""
    engine.add_request(prompt, params, request_id="r")
    out = run_all(engine)["r"]
    return out.token_ids, out.stats.num_draft_tokens


GREEDY = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def test_a_drafter_at_k_zero_leaves_the_target_its_plain_pass_and_still_probes() -> None:
    engine, passes = _engine(DraftCost(per_call=1.0))
    tokens, drafted = _generate(engine, GREEDY)
    plain = LLMEngine(learned.target(), word_tokenizer(learned.VOCAB), _config(SpeculativeConfig()))
    assert tokens == _generate(plain, GREEDY)[0]
    # Probes drafted: they had their predecessor's feature from the steps before them.
    assert drafted >= 3
    assert passes.count("plain") > len(passes) / 2
    # Captured: the prompt's pass, each probe and FEATURE_LEAD steps before it.
    assert passes.count("captured") <= 1 + drafted * (FEATURE_LEAD + 1)


def test_seeded_requests_keep_every_feature() -> None:
    engine, passes = _engine(DraftCost(per_call=1.0))
    _generate(engine, SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True))
    assert set(passes) == {"captured"}


@pytest.mark.parametrize("params,whole", [(GREEDY, True),
                                          (SamplingParams(temperature=0.8, max_tokens=8), True),
                                          (SamplingParams(temperature=0.8, seed=1, max_tokens=8), False)])
def test_the_target_takes_the_whole_cached_prefix_unless_the_request_is_seeded(params, whole: bool) -> None:
    engine, _ = _engine(DraftCost(per_call=1.0))
    # A first request fills the target's prefix cache; the head, never drafting on the prompt, has none of it.
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), request_id="first")
    run_all(engine)
    before = engine.scheduler.prefix_stats.hits
    _generate(engine, params)
    hits = engine.scheduler.prefix_stats.hits - before
    assert hits == (16 if whole else 0)  # whole blocks, leaving the prompt's last token to compute
