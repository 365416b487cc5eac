"""Log-probabilities through the engine: every emitted token's record equals log-softmax of the
target's processed row computed independently (a full forward pass over the context, then the
float64 oracle), whether the token was accepted, recovered or a bonus; streaming hands out the
same records; requests that do not ask get none."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verispec import SamplingParams
from verispec.runtime.kv_cache import BlockManager
from verispec.runtime.runner import Feed, ModelRunner
from verispec.sample.reference import reference_probs
from verispec.spec_decode.draft_model import DraftModelDrafter
from verispec.spec_decode.ngram import NgramDrafter

from ..tiny import run_all, tiny_engine, tiny_model

PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7, 5, 6, 7]]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0.8, top_k=8, seed=3, max_tokens=20, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=1.2, presence_penalty=1.0, seed=4, max_tokens=20, ignore_eos=True, logprobs=0),
]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0, scale=3.0)


def oracle_logprobs(model, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """[len(output), V] float64: the log-distribution each output token was drawn from."""
    tokens = prompt + output
    blocks = BlockManager(64, 4)
    blocks.allocate("s", len(tokens))
    logits = ModelRunner(model, blocks).forward([Feed("s", tokens, 0, len(tokens))])
    params = dataclasses.replace(params, temperature=1.0) if params.greedy else params
    return torch.stack([
        reference_probs(logits[len(prompt) - 1 + j], params, None, prompt, output[:j]).log()
        for j in range(len(output))
    ])


def assert_records_match_the_oracle(model, prompt: list[int], out, params: SamplingParams) -> None:
    """Every record of `out` (a finished RequestOutput): its token, log-probability and top
    alternatives as oracle_logprobs computes them."""
    assert [r.token_id for r in out.logprobs] == out.token_ids
    expected = oracle_logprobs(model, prompt, out.token_ids, params)
    for j, record in enumerate(out.logprobs):
        assert record.logprob == pytest.approx(float(expected[j, record.token_id]), abs=1e-4)
        top = expected[j].sort(descending=True)
        n = min(params.logprobs, int(torch.isfinite(top.values).sum()))
        assert [i for i, _ in record.top] == top.indices[:n].tolist()
        assert [v for _, v in record.top] == pytest.approx(top.values[:n].tolist(), abs=1e-4)


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "top-k", "presence"])
def test_engine_logprobs_match_the_oracle(model, params: SamplingParams) -> None:
    # A draft model close to the target: drafts get accepted and rejected.
    drafter = DraftModelDrafter(tiny_model(seed=1, scale=3.0), num_blocks=256, block_size=4)
    engine = tiny_engine(model, drafter, k=4)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done = run_all(engine)
    accepted = rejected = 0
    for rid, prompt in zip(ids, PROMPTS):
        out = done[rid]
        accepted += out.stats.num_accepted_tokens
        rejected += out.stats.num_draft_tokens - out.stats.num_accepted_tokens
        assert_records_match_the_oracle(model, prompt, out, params)
    assert accepted > 0 and rejected > 0  # records of accepted, recovered and bonus tokens


def test_streamed_records_add_up_and_are_off_by_default(model) -> None:
    engine = tiny_engine(model, NgramDrafter(1, 3, 4), k=4)
    asked = engine.add_request(PROMPTS[0], PARAMS[1])
    plain = engine.add_request(PROMPTS[0], dataclasses.replace(PARAMS[1], logprobs=None))
    streamed = {asked: [], plain: []}
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == asked:
                assert len(out.new_logprobs) == len(out.new_token_ids)
                streamed[asked] += out.new_logprobs
            else:
                assert out.logprobs is None and out.new_logprobs is None
            final[out.request_id] = out
    assert streamed[asked] == final[asked].logprobs
    assert final[asked].token_ids == final[plain].token_ids  # asking costs nothing in tokens


def test_penalised_logprobs_reuse_the_verifiers_adjusted_rows(model, monkeypatch) -> None:
    """With penalties the pre-stage (each row penalised with its own history) runs once, in
    rejection_sample; the log-probabilities read its rows and still match the oracle."""
    from verispec.sample import logprobs

    def again(*args, **kwargs):
        raise AssertionError("the penalty pre-stage ran a second time for log-probabilities")

    monkeypatch.setattr(logprobs, "adjust_rows", again)
    params = PARAMS[2]
    drafter = DraftModelDrafter(tiny_model(seed=1, scale=3.0), num_blocks=256, block_size=4)
    engine = tiny_engine(model, drafter, k=4)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done = run_all(engine)
    for rid, prompt in zip(ids, PROMPTS):
        assert done[rid].finish_reason == "length"
        assert_records_match_the_oracle(model, prompt, done[rid], params)
