"""The engine end to end on tiny random models: exactness, stops, memory, batching."""

from __future__ import annotations

import pytest
import torch

from verispec import SamplingParams
from verispec.config import CacheConfig, EngineConfig, SpeculativeConfig
from verispec.engine.engine import LLMEngine, _stop_prefix_len
from verispec.runtime.kv_cache import BlockManager
from verispec.runtime.runner import Feed, ModelRunner
from verispec.sample.reference import reference_probs
from verispec.spec_decode.draft_model import DraftModelDrafter
from verispec.spec_decode.ngram import NgramDrafter

from ..stats import chi_square
from ..tiny import run_all, tiny_engine, tiny_model, word_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7], [9, 9, 9, 9, 9, 9], list(range(16)) * 2, [3]]


def generate(engine, prompts, params) -> list[list[int]]:
    ids = [engine.add_request(p, params if isinstance(params, SamplingParams) else params[i])
           for i, p in enumerate(prompts)]
    done = run_all(engine)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks, "blocks leaked"
    return [done[i].token_ids for i in ids]


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, scale=3.0)


def drafters(target_model):
    return {
        "ngram": lambda: NgramDrafter(1, 3, 4),
        "draft model": lambda: DraftModelDrafter(tiny_model(seed=1, scale=3.0), num_blocks=256, block_size=4),
        "self draft": lambda: DraftModelDrafter(target_model, num_blocks=256, block_size=4),
    }


@pytest.mark.parametrize("name", ["ngram", "draft model", "self draft"])
def test_greedy_speculative_equals_greedy_plain(target, name: str) -> None:
    plain = generate(tiny_engine(target), PROMPTS, GREEDY)
    drafter = drafters(target)[name]
    batched = generate(tiny_engine(target, drafter(), k=4), PROMPTS, GREEDY)
    alone = [generate(tiny_engine(target, drafter(), k=4), [p], GREEDY)[0] for p in PROMPTS]
    assert batched == plain
    assert alone == plain


def test_speculation_accepts_and_saves_steps(target) -> None:
    engine = tiny_engine(target, drafters(target)["self draft"](), k=4)
    rid = engine.add_request(PROMPTS[0], GREEDY)
    out = run_all(engine)[rid]
    assert out.stats.acceptance_rate == 1.0  # the target drafting for itself, greedy
    assert out.stats.num_steps < len(out.token_ids) / 3


def test_preemption_keeps_greedy_output(target) -> None:
    plain = generate(tiny_engine(target), PROMPTS, GREEDY)
    tight = tiny_engine(target, NgramDrafter(1, 3, 4), k=4, num_blocks=24, block_size=4)
    assert generate(tight, PROMPTS, GREEDY) == plain


def test_chunked_prefill_keeps_greedy_output(target) -> None:
    plain = generate(tiny_engine(target), PROMPTS, GREEDY)
    assert generate(tiny_engine(target, NgramDrafter(1, 3, 4), k=4, budget=7), PROMPTS, GREEDY) == plain


def test_draft_model_cache_is_kept_and_rolled_back(target) -> None:
    drafter = DraftModelDrafter(tiny_model(seed=1, scale=3.0), num_blocks=256, block_size=4)
    fed = []
    forward = drafter.runner.forward
    drafter.runner.forward = lambda feeds: (fed.append(sum(len(f.token_ids) for f in feeds)), forward(feeds))[1]
    engine = tiny_engine(target, drafter, k=4)
    prompt = list(range(16)) * 2
    rid = engine.add_request(prompt, GREEDY)
    out = run_all(engine)[rid]
    # Rebuilding would feed the whole context every step; keep-and-rollback feeds each token about once.
    assert sum(fed) <= len(prompt) + 2 * len(out.token_ids) + 4 * out.stats.num_steps
    assert rid not in drafter._cached and drafter.blocks.num_free_blocks == drafter.blocks.num_blocks


def _dist(model, tokens: list[int], params: SamplingParams) -> torch.Tensor:
    """The target's sampling distribution after `tokens` (fresh cache)."""
    blocks = BlockManager(64, 4)
    blocks.allocate("s", len(tokens))
    logits = ModelRunner(model, blocks).forward([Feed("s", tokens, 0, 1)])[0]
    return reference_probs(logits, params)


def test_sampled_output_follows_target_with_a_poor_draft_model() -> None:
    """First two emitted tokens from the engine, over 40,000 seeded requests, against
    p1(y1) p2(y2 | y1) computed from the target directly (chi-square, false alarm 1e-6)."""
    target = tiny_model(seed=3, vocab=8, scale=0.3)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    poor = DraftModelDrafter(tiny_model(seed=4, vocab=8, scale=1.0), num_blocks=4096, block_size=4)
    engine = tiny_engine(target, poor, k=3, num_blocks=8192, budget=4096, max_seqs=1024)
    prompt = [1, 2, 3]
    n = 40_000
    for i in range(n):
        engine.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i))
    done = run_all(engine)
    pairs = torch.tensor([o.token_ids[:2] for o in done.values()])
    drafted = sum(o.stats.num_draft_tokens for o in done.values())
    accepted = sum(o.stats.num_accepted_tokens for o in done.values())
    assert drafted > 0 and 0 < accepted < drafted  # the draft is poor but not useless
    p1 = _dist(target, prompt, params)
    p2 = torch.stack([_dist(target, prompt + [y], params) for y in range(8)])
    joint = p1[:, None] * p2
    assert chi_square(pairs[:, 0], p1).passed
    assert chi_square(pairs[:, 0] * 8 + pairs[:, 1], joint.reshape(-1)).passed


def test_seeded_request_is_batch_invariant(target) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=20, ignore_eos=True)
    alone = generate(tiny_engine(target, NgramDrafter(1, 3, 4), k=4), [PROMPTS[0]], params)[0]
    others = [SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True)] * 4
    batched = generate(tiny_engine(target, NgramDrafter(1, 3, 4), k=4), PROMPTS[1:] + [PROMPTS[0]], others + [params])
    assert batched[-1] == alone


@pytest.mark.parametrize("budget", [8, 10, 12, 13, 14, 16, 20, 32, 48])
def test_seeded_requests_are_batch_invariant_under_any_token_budget(target, budget) -> None:
    """A tight budget used to trim a seeded request's drafts to fit older requests, which
    changed the random numbers it consumed; now it waits for a step with room instead."""
    def sampled(seed, **kw):
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True, **kw)

    seeded = [(PROMPTS[0], sampled(5)), (PROMPTS[2], sampled(6, guidance_scale=1.5, negative_prompt=[2, 3])),
              (PROMPTS[4], sampled(7, top_k=4))]
    others = [(PROMPTS[1], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)),
              (PROMPTS[3], GREEDY), (PROMPTS[0], SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True))]

    def run(batch):
        engine = tiny_engine(target, NgramDrafter(1, 3, 4), k=4, budget=budget)
        return generate(engine, [p for p, _ in batch], [sp for _, sp in batch])

    alone = [run([r])[0] for r in seeded]
    assert run(others + seeded)[len(others):] == alone
    assert run(seeded + others)[: len(seeded)] == alone
    mixed = run([others[0], seeded[1], others[1], seeded[0], others[2], seeded[2]])
    assert mixed[1::2] == [alone[1], alone[0], alone[2]]


def test_stop_conditions(target) -> None:
    engine = tiny_engine(target, NgramDrafter(1, 3, 4), k=4)
    free_run = generate(engine, [PROMPTS[1]], GREEDY)[0]
    stop_token = free_run[5]
    first = free_run.index(stop_token)
    engine = tiny_engine(target, NgramDrafter(1, 3, 4), k=4)
    a = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_token]))
    b = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=3))
    stop_text = f"t{free_run[3]} t{free_run[4]}"
    c = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, stop=[stop_text]))
    done = run_all(engine)
    assert done[a].token_ids == free_run[: first + 1] and done[a].finish_reason == "stop"
    assert done[b].token_ids == free_run[:3] and done[b].finish_reason == "length"
    assert done[c].finish_reason == "stop" and stop_text not in done[c].text
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize("k", [0, 4])
def test_streamed_text_never_shows_a_stop_string_begun_in_an_earlier_step(target, k) -> None:
    free_run = generate(tiny_engine(target), [PROMPTS[1]], GREEDY)[0]
    engine = tiny_engine(target, NgramDrafter(1, 3, 4) if k else None, k=k)
    stop = f"t{free_run[3]} t{free_run[4]}"  # spans two steps when tokens come one at a time
    plain = engine.add_request(PROMPTS[1], GREEDY)
    stopped = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))
    streamed = {plain: "", stopped: ""}
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            streamed[out.request_id] += out.new_text
            assert out.text == streamed[out.request_id]
            if out.finished:
                final[out.request_id] = out.text
    full = "".join(f" t{t}" for t in free_run)  # the output continues the prompt's words
    assert streamed[stopped] == final[stopped] == full[: full.index(stop)]
    assert streamed[plain] == final[plain] == full


@pytest.mark.parametrize("k", [0, 4])
@pytest.mark.parametrize("reverse", [False, True])
def test_stop_strings_completed_by_one_token_cut_at_the_earliest(target, k, reverse) -> None:
    free_run = generate(tiny_engine(target), [PROMPTS[1]], GREEDY)[0]
    full = "".join(f" t{t}" for t in free_run)  # the output continues the prompt's words
    short, long = f"t{free_run[5]}", f"t{free_run[3]} t{free_run[4]} t{free_run[5]}"
    assert full.index(short) + len(short) == full.index(long) + len(long)  # both end on token 5
    stops = [long, short] if reverse else [short, long]
    engine = tiny_engine(target, NgramDrafter(1, 3, 4) if k else None, k=k)
    rid = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, stop=stops))
    streamed = ""
    while engine.has_unfinished():
        for out in engine.step():
            streamed += out.new_text
    assert out.finish_reason == "stop"
    assert out.text == streamed == full[: full.index(long)]


def test_stop_prefix_len() -> None:
    assert _stop_prefix_len("abc END", ("ENDING", "xyz")) == 3
    assert _stop_prefix_len("abc EN", ("END",)) == 2
    assert _stop_prefix_len("abc E", ("x", "END", "E!")) == 1
    assert _stop_prefix_len("abc", ("END",)) == 0
    assert _stop_prefix_len("", ("END",)) == 0


def test_eos_stops_unless_ignored() -> None:
    model = tiny_model(seed=0, scale=3.0)
    free_run = generate(tiny_engine(model), [PROMPTS[1]], GREEDY)[0]
    eos = free_run[4]
    engine = tiny_engine(model, eos=eos)
    a = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24))
    b = engine.add_request(PROMPTS[1], GREEDY)
    done = run_all(engine)
    assert done[a].token_ids[-1] == eos and len(done[a].token_ids) == free_run.index(eos) + 1
    assert done[b].token_ids == free_run


def test_max_tokens_beyond_the_context_is_refused_naming_it(target) -> None:
    config = EngineConfig(max_model_len=48, cache=CacheConfig(4, 40))
    engine = LLMEngine(target, word_tokenizer(), config)
    prompt = PROMPTS[0]
    room = 48 - len(prompt)
    with pytest.raises(ValueError, match=rf"max_tokens={2**70} is too large: the prompt has {len(prompt)} "
                                         rf"tokens and max_model_len is 48, so at most {room} can be generated"):
        engine.add_request(prompt, SamplingParams(max_tokens=2**70))
    with pytest.raises(ValueError, match=r"max_tokens=29 is too large: .*\(negative_prompt 20\).* at most 28"):
        engine.add_request(prompt, SamplingParams(max_tokens=29, guidance_scale=1.5, negative_prompt=[1] * 20))
    full = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=room, ignore_eos=True))
    assert len(run_all(engine)[full].token_ids) == room


def test_max_tokens_none_runs_until_the_context_is_full(target) -> None:
    config = EngineConfig(max_model_len=48, cache=CacheConfig(4, 40),
                          speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    engine = LLMEngine(target, word_tokenizer(), config, NgramDrafter(1, 3, 4))
    prompt = PROMPTS[0]
    plain = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    cfg = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True,
                                                    guidance_scale=1.5, negative_prompt=[1] * 20))
    done = run_all(engine)
    assert done[plain].finish_reason == "length" and len(done[plain].token_ids) == 48 - len(prompt)
    # Every sequence stays within max_model_len, the companion's longer prefix included.
    assert done[cfg].finish_reason == "length" and len(done[cfg].token_ids) == 48 - 20
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_request_larger_than_the_cache_fails_with_its_reason(target) -> None:
    engine = tiny_engine(target, num_blocks=8, block_size=4)
    big = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=40))
    small = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=5))
    done = run_all(engine)
    assert done[big].finish_reason == "error" and not done[big].token_ids
    assert done[big].error == "the request needs 11 KV-cache blocks (42 tokens at 4 per block) but the cache has 8"
    assert done[small].finish_reason == "length" and done[small].error is None


def test_abort_frees_blocks(target) -> None:
    engine = tiny_engine(target, NgramDrafter(1, 3, 4), k=4)
    rid = engine.add_request(PROMPTS[3], GREEDY)
    engine.step()
    engine.abort(rid)
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_bad_requests_are_rejected_with_clear_errors(target) -> None:
    engine = tiny_engine(target)
    with pytest.raises(ValueError, match=r"prompt=\[1, 99\] holds 99 at index 1: expected .* in \[0, 16\)"):
        engine.add_request([1, 99])
    with pytest.raises(ValueError, match=r"prompt=\[\] is empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="prompt has 600 tokens"):
        engine.add_request([1] * 600)
    with pytest.raises(ValueError, match="negative_prompt has 600 tokens"):
        engine.add_request([1], SamplingParams(guidance_scale=2.0, negative_prompt=[1] * 600))
    with pytest.raises(TypeError, match="params is dict"):
        engine.add_request([1], {"temperature": 0})
    engine.add_request([1], request_id="x")
    with pytest.raises(ValueError, match="request_id='x' is already in use"):
        engine.add_request([1], request_id="x")


@pytest.mark.parametrize("prompt,error,message", [
    ({"prompt": "t1"}, TypeError, r"prompt=\{'prompt': 't1'\} is a dict: expected a str, or a non-empty list"),
    ([True], TypeError, r"prompt=\[True\] holds True \(bool\) at index 0"),
    ([1, 2.0], TypeError, r"holds 2.0 \(float\) at index 1"),
    ((3, -1), ValueError, r"prompt=\(3, -1\) holds -1 at index 1"),
    (7, TypeError, r"prompt=7 is a int"),
])
def test_prompts_must_be_text_or_token_ids(target, prompt, error, message) -> None:
    engine = tiny_engine(target)
    with pytest.raises(error, match=message):
        engine.add_request(prompt)
    assert not engine.has_unfinished()
