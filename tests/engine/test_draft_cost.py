"""The adaptive K charges drafting its declared cost (Drafter.draft_cost, or
SpeculativeConfig.draft_cost): a drafter costlier than its drafts only probes."""

from __future__ import annotations

import dataclasses
import math

import pytest

from verispec import LLM, SamplingParams
from verispec.config import CacheConfig, DraftCost, EngineConfig, SpeculativeConfig
from verispec.engine.engine import LLMEngine
from verispec.spec_decode.adaptive import PROBE_COST
from verispec.spec_decode.draft_model import DraftModelDrafter, draft_model_cost
from verispec.spec_decode.eagle import EAGLE_COST, EAGLE_COST_QUANTIZED
from verispec.spec_decode.ngram import NGRAM_COST, NGRAM_COST_QUANTIZED, NgramDrafter

from ..tiny import run_all, tiny_model, word_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
REPETITIVE = [1, 2, 3, 4] * 6


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, scale=3.0)


def engine(target, drafter, draft_cost: DraftCost | None = None, max_num_seqs: int = 64) -> LLMEngine:
    config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=512, cache=CacheConfig(4, 256),
                          speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4, draft_cost=draft_cost))
    return LLMEngine(target, word_tokenizer(), config, drafter)


def drafted(engine: LLMEngine, prompts, params) -> tuple[list[list[int]], int]:
    """(outputs, draft tokens verified)."""
    ids = [engine.add_request(p, params[i] if isinstance(params, list) else params) for i, p in enumerate(prompts)]
    done = run_all(engine)
    return [done[i].token_ids for i in ids], sum(done[i].stats.num_draft_tokens for i in ids)


def test_a_drafter_declaring_a_high_cost_only_probes(target) -> None:
    poor = lambda cost: DraftModelDrafter(tiny_model(seed=4, scale=1.0), 256, 4, cost)  # noqa: E731
    long = dataclasses.replace(GREEDY, max_tokens=200)
    free_out, free_drafts = drafted(engine(target, poor(DraftCost())), [[5, 6, 7]], long)
    costly = engine(target, poor(DraftCost(per_position=0.8)))
    costly_out, costly_drafts = drafted(costly, [[5, 6, 7]], long)
    # One draft per probe, spaced by what a probe costs: 8 steps x 0.82 / PROBE_COST.
    interval = costly.adaptive.probe_interval_at(1)
    assert interval == math.ceil(8 * 0.82 / PROBE_COST)
    assert costly_out == free_out
    assert free_drafts > 200 // interval + 1 >= costly_drafts > 0


def test_in_a_closed_batch_a_request_that_finishes_first_does_not_draft(target) -> None:
    """Nothing waiting, a batch runs as long as its longest request: the drafts of one that
    finishes well before it save nobody a step (spec_decode/adaptive.py finish_shares), also
    where the long one has no max_tokens (the room left in the context bounds it) or may end at
    EOS (it may also run to its max_tokens). With a request waiting for its slot they pay as
    ever."""
    short = dataclasses.replace(GREEDY, max_tokens=16)
    long = dataclasses.replace(GREEDY, max_tokens=96)
    other = [9, 7, 13, 11, 14, 5]

    def short_drafts(prompts, params, max_num_seqs: int = 4) -> tuple[int, list[list[int]]]:
        e = engine(target, NgramDrafter(1, 3, 4), max_num_seqs=max_num_seqs)
        ids = [e.add_request(p, q) for p, q in zip(prompts, params)]
        done = run_all(e)
        return done[ids[0]].stats.num_draft_tokens, [done[i].token_ids for i in ids]

    alone, alone_out = short_drafts([REPETITIVE], [short])
    closed, closed_out = short_drafts([REPETITIVE, other], [short, long])
    queued, queued_out = short_drafts([REPETITIVE, other, other], [short, long, long], max_num_seqs=2)
    unbounded, _ = short_drafts([REPETITIVE, other], [short, dataclasses.replace(long, max_tokens=None)])
    eos, _ = short_drafts([REPETITIVE, other], [short, dataclasses.replace(long, ignore_eos=False)])
    assert alone >= 8 and closed == unbounded == eos == 0 and queued >= 4, (alone, closed, queued, unbounded, eos)
    assert closed_out[0] == queued_out[0] == alone_out[0] and closed_out[1] == queued_out[1]


def test_the_config_overrides_the_drafters_declaration(target) -> None:
    """n-gram drafts on a repetitive prompt are nearly free and often right; priced at 50 target
    steps per call they are not worth it."""
    _, free_drafts = drafted(engine(target, NgramDrafter(1, 3, 4)), [REPETITIVE], GREEDY)
    _, costly_drafts = drafted(engine(target, NgramDrafter(1, 3, 4), DraftCost(per_call=50.0)),
                                  [REPETITIVE], GREEDY)
    assert free_drafts > 20 and costly_drafts <= 40 // 8 + 1


def test_seeded_request_is_batch_invariant_with_a_drafter_cost_that_grows_with_the_batch(target) -> None:
    """Priced at batch 1, a seeded request's K ignores the others, even when drafting for them
    costs more (per request) than drafting alone."""
    cost = DraftCost(per_request=0.05, per_position=0.05)

    def run(prompts, params):
        drafter = DraftModelDrafter(tiny_model(seed=1, scale=3.0), 256, 4, cost)
        return drafted(engine(target, drafter), prompts, params)[0]

    seeded = SamplingParams(temperature=0.9, seed=77, max_tokens=24, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    alone = run([REPETITIVE], seeded)[0]
    assert run([[5, 6, 7], [9, 9, 9], REPETITIVE, [3]], [other, GREEDY, seeded, other])[2] == alone


def test_draft_model_cost_is_the_ratio_of_weight_bytes() -> None:
    small, big = tiny_model(seed=1, hidden=16), tiny_model(seed=0, hidden=32)
    ratio = sum(p.numel() for p in small.parameters()) / sum(p.numel() for p in big.parameters())
    cost = draft_model_cost(small, big, row_cost=0.1)
    assert 0 < ratio < 1 and cost == DraftCost(per_position=ratio, per_row=0.1 * ratio)
    assert cost(3, 2) == pytest.approx(3 * (ratio + 0.2 * ratio)) and cost(0, 2) == 0
    # An int4 copy: 4-bit blocks (with float16 scales and minimums) against float32 weights.
    int4 = tiny_model(seed=0, hidden=32, quantization=(4, 32))
    assert 0.1 < draft_model_cost(int4, big, row_cost=0.1).per_position < 0.35


def test_the_cost_model_follows_the_targets_weights(target) -> None:
    """A quantized target's step is several times cheaper than a float one's, so an extra row
    and a drafter's call cost more of it: the engine prices both by the target's kind, unless
    SpeculativeConfig says otherwise."""
    quantized = LLM(draft="ngram+eagle", progress=False)
    wide = LLM(draft="ngram+eagle", dtype="float32", progress=False)
    for llm, row_cost, costs in ((quantized, 0.6, (NGRAM_COST_QUANTIZED, EAGLE_COST_QUANTIZED)),
                                 (wide, 0.1, (NGRAM_COST, EAGLE_COST))):
        engine = llm.engine
        assert engine.model.row_cost == row_cost and engine.adaptive.row_cost == row_cost
        assert (engine.drafter.lookup.cost, engine.drafter.learned.cost) == costs
        assert engine.drafter.draft_cost(2, 3) == costs[0](2, 3) + costs[1](2, 3)
    config = EngineConfig(max_model_len=512, cache=CacheConfig(4, 256),
                          speculative=SpeculativeConfig(method="ngram", row_cost=0.7))
    assert LLMEngine(target, word_tokenizer(), config, NgramDrafter()).adaptive.row_cost == 0.7
    with pytest.raises(ValueError, match="row_cost=0 is invalid: expected a number > 0 or None"):
        SpeculativeConfig(method="ngram", row_cost=0)
