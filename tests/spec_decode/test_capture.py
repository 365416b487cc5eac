"""A learned drafter that does not pay steps aside (LLMEngine._feature_requests, _prefix_limit):
with the adaptive K at 0 the target runs its plain pass except for prompts and the few steps
before a probe, probes still draft, greedy output stays plain decoding's; the target takes a
prompt's whole cached prefix for a request that may have holes in its features, only what the
head can restore for a batch-invariant (seeded) one, whose drafts do not depend on the batch."""

from __future__ import annotations

import pytest
import torch

from verispec import SamplingParams
from verispec.config import CacheConfig, DraftCost, EngineConfig, SpeculativeConfig
from verispec.engine.engine import FEATURE_LEAD, LLMEngine
from verispec.spec_decode.adaptive import PROBE_BACKOFF
from verispec.spec_decode.eagle import EagleDrafter
from verispec.spec_decode.hybrid import HybridDrafter
from verispec.spec_decode.ngram import NgramDrafter

from .. import learned
from ..tiny import run_all, word_tokenizer

PROMPT = list(range(3, 23))  # 20 tokens: 5 blocks of 4


def _config(spec: SpeculativeConfig) -> EngineConfig:
    return EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512,
                        cache=CacheConfig(4, 1024), speculative=spec)


def _engine(draft_cost: DraftCost | None = None, adaptive: bool = True,
            lookup: bool = False) -> tuple[LLMEngine, list[str]]:
    """An engine with an untrained EAGLE head (behind prompt lookup: `lookup`) whose drafting is
    priced `draft_cost` (at 0.3 of a step a call, K stays 0 and only probes draft, 37 steps apart
    and more), and the log of its target passes ("plain" / "captured")."""
    drafter = EagleDrafter(learned.untrained("eagle"), num_blocks=1024, block_size=4)
    drafter.class_priors = ()  # an untrained head: the generic prior, not the shipped head's HEAD_PRIOR
    if lookup:
        drafter = HybridDrafter(NgramDrafter(min_n=2, num_speculative_tokens=3), drafter)
    spec = SpeculativeConfig(method="ngram+eagle" if lookup else "eagle", num_speculative_tokens=3,
                             adaptive=adaptive, draft_cost=draft_cost, row_cost=0.1 if draft_cost else None)
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
    engine, passes = _engine(DraftCost(per_call=0.3))
    tokens, drafted = _generate(engine, GREEDY)
    plain = LLMEngine(learned.target(), word_tokenizer(learned.VOCAB), _config(SpeculativeConfig()))
    assert tokens == _generate(plain, GREEDY)[0]
    # Probes drafted: they had their predecessor's feature from the steps before them.
    assert drafted >= 2  # probes at steps 37 and 148
    assert passes.count("plain") > len(passes) / 2
    # Captured: the prompt's pass, each probe and FEATURE_LEAD steps before it.
    assert passes.count("captured") <= 1 + drafted * (FEATURE_LEAD + 1)


def _read_features(engine: LLMEngine, request_id: str) -> list[tuple[int, int, torch.Tensor]]:
    """Logs the features the drafter reads for one request: (begin, end, features)."""
    store, log = engine.drafter.store, []
    features = store.features

    def spy(rid, begin, end):
        got = features(rid, begin, end)
        if rid == request_id:
            log.append((begin, end, got.clone()))
        return got

    store.features = spy
    return log


def test_a_seeded_requests_features_and_drafts_are_its_own_whatever_the_batch() -> None:
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=150, ignore_eos=True)
    alone, passes_alone = _engine(DraftCost(per_call=0.3))
    read_alone = _read_features(alone, "r")
    want = _generate(alone, seeded)
    # Beside it, unseeded requests probing on the engine's schedule make it capture at other steps.
    beside, passes_beside = _engine(DraftCost(per_call=0.3))
    read_beside = _read_features(beside, "r")
    for i in range(3):
        beside.add_request(PROMPT[i:], SamplingParams(temperature=0.9, max_tokens=150, ignore_eos=True),
                           request_id=f"other{i}")
    assert _generate(beside, seeded) == want and want[1] >= 2  # probes at its steps 37 and 111
    assert passes_beside.count("captured") > passes_alone.count("captured") + 3
    assert passes_alone.count("plain") > len(passes_alone) / 2
    # The head read the same features alone and in company, with the same holes (rows of zeros;
    # the values as close as the target's batched products leave them).
    assert len(read_alone) == len(read_beside) >= 3  # the prompt (absorbed) and each probe
    for (b1, e1, f1), (b2, e2, f2) in zip(read_alone, read_beside):
        assert (b1, e1) == (b2, e2)
        assert torch.equal(f1.eq(0).all(dim=1), f2.eq(0).all(dim=1))
        torch.testing.assert_close(f1, f2, atol=1e-3, rtol=1e-3)
    assert any(f.eq(0).all(dim=1).any() for _, _, f in read_alone)


@pytest.mark.parametrize("params,whole", [(GREEDY, True),
                                          (SamplingParams(temperature=0.8, max_tokens=8), True),
                                          (SamplingParams(temperature=0.8, seed=1, max_tokens=8), False)])
def test_the_target_takes_the_whole_cached_prefix_unless_the_request_is_seeded(params, whole: bool) -> None:
    engine, _ = _engine(DraftCost(per_call=0.3))
    engine.drafter.absorb = lambda requests: None  # (the next test takes the prompt into the head)
    # A first request fills the target's prefix cache; the head, never drafting on the prompt, has none of it.
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), request_id="first")
    run_all(engine)
    before = engine.scheduler.prefix_stats.hits
    _generate(engine, params)
    hits = engine.scheduler.prefix_stats.hits - before
    assert hits == (16 if whole else 0)  # whole blocks, leaving the prompt's last token to compute


def test_a_seeded_prompt_reaches_the_heads_cache_without_drafting() -> None:
    """At K = 0 a seeded request's prompt goes into the head's cache right after it is computed
    (Drafter.absorb), so the next seeded request with that prompt takes it from the target's
    prefix cache too, and draws the same tokens."""
    engine, passes = _engine(DraftCost(per_call=0.3))
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=4, ignore_eos=True)
    first = _generate(engine, seeded)
    before = engine.scheduler.prefix_stats.hits
    engine.add_request(PROMPT, seeded, request_id="again")
    again = run_all(engine)["again"]
    assert engine.scheduler.prefix_stats.hits - before == 16 and again.token_ids == first[0]
    assert passes.count("plain") >= 4  # it drafted nothing: its K stayed 0


def test_a_drafter_whose_probes_stopped_paying_takes_no_prompt_but_a_seeded_request_does() -> None:
    """Stepped aside (AdaptiveK.stepped_aside: its backoff at the most, a new request's first probe
    far away), the drafter is fed no prompt: the prefill runs the target's plain pass and the head
    does nothing; output stays plain decoding's. A seeded request, whose K is its own, still takes
    its prompt into the head."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine, passes = _engine(DraftCost(per_call=0.3))
    engine.adaptive._backoff = PROBE_BACKOFF  # as after four probes in a row that did not pay
    assert engine.adaptive.stepped_aside
    fed = []
    engine.drafter.head.forward = lambda *args: fed.append(args) or pytest.fail("the head ran")
    tokens, drafted = _generate(engine, params)
    plain = LLMEngine(learned.target(), word_tokenizer(learned.VOCAB), _config(SpeculativeConfig()))
    assert tokens == _generate(plain, params)[0] and drafted == 0
    assert passes == ["plain"] * len(passes) and not fed

    engine, passes = _engine(DraftCost(per_call=0.3))
    engine.adaptive._backoff = PROBE_BACKOFF
    _generate(engine, SamplingParams(temperature=0.8, seed=2, max_tokens=4, ignore_eos=True))
    assert passes[0] == "captured" and passes[1:] == ["plain"] * (len(passes) - 1)


def test_a_stepped_aside_hybrid_captures_nothing_for_its_lookup_drafts() -> None:
    """The hybrid's lookup drafts read no features: once its head has stepped aside, a request
    whose K comes from a lookup match leaves the target its plain pass (at batch 16 the pass had
    captured in 114 of 128 steps, for three head probes); before that, its features are kept
    for the head that may draft for it next."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for aside in (False, True):
        engine, passes = _engine(DraftCost(per_call=0.3), lookup=True)
        if aside:
            engine.adaptive._backoff = PROBE_BACKOFF
        engine.drafter.draft_class = lambda request_id, token_ids: 3  # a 3-token match, every step
        _generate(engine, params)
        ks = engine.adaptive.table(1, free_drafts=True)
        assert ks[round(engine.adaptive.class_prior(3) * 100)] > 0  # the lookup's K: above 0
        steps = passes[1:]  # after the prompt's pass
        assert steps == ["plain"] * len(steps) if aside else steps.count("captured") > len(steps) / 2
