"""DraftModelDrafter samples from, and hands over, the request's whole pipeline: penalties
counted over the output followed by its own drafts so far, logit bias and masks included."""

from __future__ import annotations

import pytest
import torch

from verispec import SamplingParams
from verispec.runtime.kv_cache import BlockManager
from verispec.runtime.runner import Feed, ModelRunner
from verispec.sample.reference import reference_probs
from verispec.spec_decode.base import DraftRequest
from verispec.spec_decode.draft_model import DraftModelDrafter

from ..tiny import tiny_model

PROMPT, OUTPUT = [1, 2, 3], [4, 4, 5]
PARAMS = [
    SamplingParams(temperature=0.9, presence_penalty=1.5, repetition_penalty=1.4, frequency_penalty=0.5,
                   logit_bias={2: 1.0}, banned_token_ids=[0], top_k=8),
    SamplingParams(temperature=0, presence_penalty=2.0, allowed_token_ids=[4, 5, 6, 7]),
    SamplingParams(min_p=0.05),  # no adjustment, in the same batch
]


def _logits(model, tokens: list[int]) -> torch.Tensor:  # [V] the model's next-token logits, fresh cache
    blocks = BlockManager(64, 4)
    blocks.allocate("s", len(tokens))
    return ModelRunner(model, blocks).forward([Feed("s", tokens, 0, 1)])[0]


def test_q_rows_are_the_penalised_pipeline_of_the_drafts_own_history() -> None:
    model = tiny_model(seed=1, scale=2.0)
    drafter = DraftModelDrafter(model, num_blocks=256, block_size=4)
    requests = [DraftRequest(f"r{i}", PROMPT + OUTPUT, 4, p, seed=10 + i, step=2, num_prompt_tokens=len(PROMPT))
                for i, p in enumerate(PARAMS * 4)]
    batch = drafter.propose(requests)
    row = 0
    for request, drafts in zip(requests, batch.token_ids):
        assert len(drafts) == 4
        for i, token in enumerate(drafts):
            history = OUTPUT + drafts[:i]
            expected = reference_probs(_logits(model, PROMPT + history), request.params, None, PROMPT, history)
            if request.params.greedy:
                assert token == int(expected.argmax())
            else:
                torch.testing.assert_close(batch.probs[row].double(), expected, atol=1e-5, rtol=1e-4)
                assert expected[token] > 0
            row += 1


def test_num_prompt_tokens_is_checked() -> None:
    with pytest.raises(ValueError, match=r"num_prompt_tokens=4 is invalid: expected an integer in \[0, 3\]"):
        DraftRequest("r", [1, 2, 3], 2, SamplingParams(), seed=0, step=0, num_prompt_tokens=4)
    request = DraftRequest("r", [1, 2, 3], 2, SamplingParams(), seed=0, step=0, num_prompt_tokens=1)
    assert list(request.prompt_token_ids) == [1] and list(request.output_token_ids) == [2, 3]


def test_a_seeded_request_is_batch_invariant_when_the_draft_cache_is_full() -> None:
    """Older unseeded requests with long prompts would fill the draft model's cache; the seeded
    request is served first (evicting them), so it drafts and emits as it does alone."""
    from ..tiny import run_all, tiny_engine

    target, draft = tiny_model(seed=0, scale=3.0), tiny_model(seed=0, scale=3.0)
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)

    def run(others: int) -> tuple[list[int], int]:
        drafter = DraftModelDrafter(draft, num_blocks=14, block_size=4)  # 56 slots
        engine = tiny_engine(target, drafter, k=4, budget=256)
        for i in range(others):
            engine.add_request([(i * 5 + j) % 15 + 1 for j in range(20)],
                               SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True))
        rid = engine.add_request([3, 1, 4, 1, 5, 9], seeded)
        out = run_all(engine)[rid]
        assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks
        return out.token_ids, out.stats.num_draft_tokens

    alone, drafted = run(0)
    assert drafted > 0
    for others in (1, 3):
        assert run(others) == (alone, drafted)
