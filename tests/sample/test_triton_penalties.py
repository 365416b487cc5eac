"""Penalties, logit bias and token masks on the Triton backend (the shared torch pre-stage in
front of the unchanged kernels): a few chi-square cases of test_penalty_distribution.py, and
agreement with the native path on the same random streams. Under the Triton interpreter on CPU
(tests/conftest.py), at the harness's small vocabulary."""

from __future__ import annotations

import pytest
import torch

from verispec import SamplingParams
from verispec.sample import DraftLogits, DraftProbs

from .harness import World
from .test_penalties import _batch, _verify
from .test_penalty_distribution import OUTPUT, PROMPT
from .test_triton import DEVICE, needs_triton, triton_sampler

N = 40_000

CASES = [
    (SamplingParams(presence_penalty=1.5), "repeat"),
    (SamplingParams(repetition_penalty=1.8, guidance_scale=2.0, min_p=0.05), "logits"),
    (SamplingParams(frequency_penalty=1.0, logit_bias={0: 1.0}, banned_token_ids=[3], top_k=4), "onehot-repeat"),
]


@needs_triton
@pytest.mark.parametrize("params,kind", CASES, ids=[kind for _, kind in CASES])
def test_emitted_tokens_follow_the_penalised_target(params: SamplingParams, kind: str) -> None:
    world = World(params, kind, seed=5, prompt=PROMPT, output=OUTPUT)
    for name, result in world.tests(N, sampler=triton_sampler).items():
        assert result.passed, f"{name}: {result}"


@needs_triton
@pytest.mark.parametrize("kind", ["probs", "logits", "onehot"])
def test_decisions_and_greedy_tokens_match_native(kind: str) -> None:
    """Mixed batch (every adjustment, CFG, filters, greedy, unadjusted requests), drafts that
    repeat: same acceptance decisions, accepted tokens and greedy tokens as the native path."""
    batch = _batch(0)
    draft = {"probs": DraftProbs(batch["probs"]), "logits": DraftLogits(batch["draft_logits"]), "onehot": None}[kind]
    native = _verify(batch, draft, backend="native")
    moved = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    fast = _verify(moved, None if draft is None else type(draft)(draft[0].to(DEVICE)), backend="triton")
    assert fast.num_accepted.cpu().tolist() == native.num_accepted.tolist()
    assert sum(native.num_accepted.tolist()) > 5
    for b, n in enumerate(native.num_accepted.tolist()):
        assert fast.token_ids[b, :n].cpu().tolist() == native.token_ids[b, :n].tolist()
        if batch["params"][b].greedy:
            assert int(fast.token_ids[b, n]) == int(native.token_ids[b, n])
