"""Classifier-free guidance in the engine, with and without speculation."""

from __future__ import annotations

import dataclasses
import pytest
import torch
from transformers.generation.logits_process import UnbatchedClassifierFreeGuidanceLogitsProcessor

from verispec import SamplingParams
from verispec.engine import engine as engine_module
from verispec.runtime.kv_cache import BlockManager
from verispec.runtime.runner import Feed, ModelRunner
from verispec.model import load_model
from verispec.sample.processors import process_logits
from verispec.sample.reference import reference_probs
from verispec.spec_decode.draft_model import DraftModelDrafter
from verispec.spec_decode.ngram import NgramDrafter

from ..stats import chi_square
from ..tiny import run_all, tiny_checkpoint, tiny_engine, tiny_model

VOCAB = 16


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """The same random tiny Llama as an HF model and as ours (loaded from its checkpoint)."""
    directory = tmp_path_factory.mktemp("tiny-hf")
    hf = tiny_checkpoint(directory, vocab=VOCAB)
    model, _ = load_model(str(directory), progress=False)
    return hf, model


def _greedy_cfg(scale: float, negative: list[int] | None, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, guidance_scale=scale, negative_prompt=negative,
                          max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("scale,negative", [(1.5, None), (3.0, [7, 8, 9]), (0.5, [2])])
def test_guided_distribution_matches_hf_processor(hf_pair, monkeypatch, scale, negative) -> None:
    hf, model = hf_pair
    captured = []
    original = engine_module.rejection_sample

    def capture(target, ids, cu, sampling, draft=None, uncond_logits=None, **kw):
        rows = torch.arange(target.shape[0])
        captured.append(process_logits(target, rows, sampling, uncond_logits).log_softmax(-1))
        return original(target, ids, cu, sampling, draft=draft, uncond_logits=uncond_logits, **kw)

    monkeypatch.setattr(engine_module, "rejection_sample", capture)
    engine = tiny_engine(model)
    prompt = [1, 5, 3, 12, 4]
    rid = engine.add_request(prompt, _greedy_cfg(scale, negative))
    ours = run_all(engine)[rid].token_ids
    processor = UnbatchedClassifierFreeGuidanceLogitsProcessor(
        scale, hf, unconditional_ids=None if negative is None else torch.tensor([negative]))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for step, token in enumerate(ours):
            scores = hf(ids).logits[:, -1]
            guided = processor(ids, scores).log_softmax(-1)
            torch.testing.assert_close(captured[step][0], guided[0], atol=1e-4, rtol=1e-4)
            assert int(guided.argmax()) == token
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)


def test_greedy_cfg_matches_hf_generate(hf_pair) -> None:
    hf, model = hf_pair
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    engine = tiny_engine(model, NgramDrafter(1, 3, 4), k=4)
    rid = engine.add_request(prompt, _greedy_cfg(2.0, [6, 6], max_tokens=16))
    ours = run_all(engine)[rid].token_ids
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                          guidance_scale=2.0, negative_prompt_ids=torch.tensor([[6, 6]]))
    assert ours == out[0, len(prompt):].tolist()


PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7], [9, 9, 9, 9, 9, 9], list(range(16)) * 2]


@pytest.mark.parametrize("drafter", ["ngram", "draft model"])
def test_greedy_speculative_cfg_equals_greedy_plain_cfg(drafter) -> None:
    target = tiny_model(seed=0, scale=3.0)
    params = [_greedy_cfg(1.5, None, 20), _greedy_cfg(3.0, [4, 4, 2], 20), SamplingParams(temperature=0, max_tokens=20), _greedy_cfg(0.7, [1], 20)]

    def run(engine):
        ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
        done = run_all(engine)
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        return [done[i].token_ids for i in ids]

    make = {"ngram": lambda: NgramDrafter(1, 3, 4),
            "draft model": lambda: DraftModelDrafter(tiny_model(seed=1, scale=3.0), 256, 4)}[drafter]
    assert run(tiny_engine(target, make(), k=4)) == run(tiny_engine(target))
    # A KV cache small enough to force preemption of CFG pairs changes nothing either.
    assert run(tiny_engine(target, make(), k=4, num_blocks=40)) == run(tiny_engine(target))


def _guided(model, tokens: list[int], uncond: list[int], params: SamplingParams) -> torch.Tensor:
    blocks = BlockManager(64, 4)
    blocks.allocate("c", len(tokens))
    blocks.allocate("u", len(uncond))
    logits = ModelRunner(model, blocks).forward([Feed("c", tokens, 0, 1), Feed("u", uncond, 0, 1)])
    return reference_probs(logits[0], params, logits[1])


def test_speculative_cfg_output_follows_guided_distribution() -> None:
    """20,000 seeded requests, a poor draft model, gamma = 1.5 with a negative prompt: the first two
    emitted tokens against the guided p1(y1) p2(y2 | y1) (chi-square, false alarm 1e-6)."""
    vocab = 8
    target = tiny_model(seed=3, vocab=vocab, scale=0.3)
    poor = DraftModelDrafter(tiny_model(seed=4, vocab=vocab, scale=1.0), num_blocks=4096, block_size=4)
    engine = tiny_engine(target, poor, k=3, num_blocks=8192, budget=4096, max_seqs=1024)
    prompt, negative = [1, 2, 3], [5, 6]
    n = 20_000
    base = SamplingParams(temperature=2.0, max_tokens=3, ignore_eos=True, guidance_scale=1.5, negative_prompt=negative)
    for i in range(n):
        engine.add_request(prompt, dataclasses.replace(base, seed=i))
    done = run_all(engine)
    pairs = torch.tensor([o.token_ids[:2] for o in done.values()])
    drafted = sum(o.stats.num_draft_tokens for o in done.values())
    assert 0 < sum(o.stats.num_accepted_tokens for o in done.values()) < drafted
    p1 = _guided(target, prompt, negative, base)
    p2 = torch.stack([_guided(target, prompt + [y], negative + [y], base) for y in range(vocab)])
    assert chi_square(pairs[:, 0], p1).passed
    assert chi_square(pairs[:, 0] * vocab + pairs[:, 1], (p1[:, None] * p2).reshape(-1)).passed


def test_mixed_batch_gives_each_request_its_solo_tokens() -> None:
    """CFG and plain, speculating and not, sampled with seeds: batched == alone."""
    target = tiny_model(seed=0, scale=2.0)
    requests = [
        (PROMPTS[0], SamplingParams(temperature=0.8, seed=1, guidance_scale=2.0, max_tokens=15, ignore_eos=True), 4),
        (PROMPTS[1], SamplingParams(temperature=1.0, seed=2, max_tokens=15, ignore_eos=True), 0),
        (PROMPTS[2], SamplingParams(temperature=1.2, seed=3, guidance_scale=1.5, negative_prompt=[3, 3], max_tokens=15, ignore_eos=True), 0),
        (PROMPTS[3], SamplingParams(temperature=0.9, top_k=5, seed=4, max_tokens=15, ignore_eos=True), 4),
    ]

    def run(batch):
        engine = tiny_engine(target, NgramDrafter(1, 3, 4), k=4)
        ids = [engine.add_request(p, sp, num_speculative_tokens=k) for p, sp, k in batch]
        done = run_all(engine)
        return [done[i].token_ids for i in ids]

    together = run(requests)
    alone = [run([r])[0] for r in requests]
    assert together == alone


@pytest.mark.parametrize("budget", [4, 8, 16])
def test_negative_prompt_longer_than_the_budget(budget) -> None:
    """The conditional sequence has nothing to feed while the long companion is prefilled in
    chunks: it must feed nothing (an empty chunk used to crash every request of the step)."""
    target = tiny_model(seed=0, scale=3.0)
    requests = [([3], _greedy_cfg(1.5, [1, 2, 3, 4, 5] * 5, 8)), ([5, 6, 7], SamplingParams(temperature=0, max_tokens=8)),
                ([9, 9], _greedy_cfg(2.0, [4] * 11, 8))]

    def run(engine):
        ids = [engine.add_request(p, sp) for p, sp in requests]
        done = run_all(engine)
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        return [(done[i].finish_reason, done[i].token_ids) for i in ids]

    expected = run(tiny_engine(target))
    assert all(reason == "length" for reason, _ in expected)
    assert run(tiny_engine(target, budget=budget)) == expected
    assert run(tiny_engine(target, NgramDrafter(1, 3, 3), k=3, budget=budget)) == expected
    alone = tiny_engine(target, budget=budget)
    rid = alone.add_request(*requests[0])
    assert run_all(alone)[rid].token_ids == expected[0][1]


def test_cfg_request_needs_a_budget_of_two_tokens() -> None:
    engine = tiny_engine(tiny_model(seed=0), budget=1)
    rid = engine.add_request([3, 4], _greedy_cfg(1.5, None, 4))
    plain = engine.add_request([3, 4], SamplingParams(temperature=0, max_tokens=4))
    done = run_all(engine)
    assert done[rid].finish_reason == "error" and "max_num_batched_tokens=1 is too small" in done[rid].error
    assert done[plain].finish_reason == "length"
