"""Penalties, logit bias and token masks under speculation, proven distributionally: the
two-token world of harness.py (chi-square per position and joint, false alarm 1e-6) with a
prompt and an output so far, every new parameter alone and combined with temperature, top-k,
top-p, min-p and CFG, for probability, logit and one-hot drafts, including drafts that repeat
the output and each other (so that each row's own history matters)."""

from __future__ import annotations

import pytest

from verispec import SamplingParams
from verispec.sample import penalties, rejection

from .harness import World

N = 40_000
PROMPT, OUTPUT = (2, 5), (1, 3, 1)

CASES = [
    (SamplingParams(presence_penalty=1.5), "repeat"),
    (SamplingParams(frequency_penalty=1.0), "onehot-repeat"),
    (SamplingParams(repetition_penalty=2.0), "logits"),
    (SamplingParams(repetition_penalty=0.5), "uniform"),
    (SamplingParams(logit_bias={1: 2.0, 4: -3.0}), "uniform"),
    (SamplingParams(allowed_token_ids=[0, 1, 2, 4]), "onehot"),
    (SamplingParams(banned_token_ids=[1, 3]), "logits"),
    (SamplingParams(allowed_token_ids=[0, 1, 4], frequency_penalty=1.0), "disjoint"),
    (SamplingParams(presence_penalty=1.0, temperature=0.6), "overconfident"),
    (SamplingParams(frequency_penalty=0.8, top_k=3), "repeat"),
    (SamplingParams(repetition_penalty=1.8, top_p=0.7), "onehot-repeat"),
    (SamplingParams(logit_bias={0: 1.5, 2: -1.0}, min_p=0.1), "logits"),
    (SamplingParams(guidance_scale=2.0, presence_penalty=1.5, banned_token_ids=[4]), "same"),
    (SamplingParams(guidance_scale=3.0, repetition_penalty=1.5, temperature=0.7, top_p=0.9), "logits"),
    (SamplingParams(temperature=0.8, top_k=4, top_p=0.9, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.5,
                    presence_penalty=0.5, logit_bias={3: 1.0}, banned_token_ids=[0]), "repeat"),
    (SamplingParams(temperature=0, presence_penalty=2.0, logit_bias={2: 0.5}), "repeat"),
]


def _id(params: SamplingParams, kind: str) -> str:
    set_fields = {k: v for k, v in vars(params).items() if v != getattr(SamplingParams(), k)}
    return kind + "-" + "-".join(f"{k}={dict(v) if k == 'logit_bias' else v}" for k, v in set_fields.items())


@pytest.mark.parametrize("params,kind", CASES, ids=[_id(p, k) for p, k in CASES])
def test_emitted_tokens_follow_the_penalised_target(params: SamplingParams, kind: str) -> None:
    world = World(params, kind, seed=len(kind) + len(CASES[0]), prompt=PROMPT, output=OUTPUT)
    for name, result in world.tests(N).items():
        assert result.passed, f"{name}: {result}"


def test_a_per_request_penalty_fails_the_statistic(monkeypatch: pytest.MonkeyPatch) -> None:
    """The statistic has power: penalising every row with the output alone (dropping the drafts
    before it, as a per-request penalty would) over-accepts repeated drafts."""
    real = penalties.preceding_drafts
    monkeypatch.setattr(rejection, "preceding_drafts", lambda ids, first, num, m: real(ids, first, num * 0, m))
    world = World(SamplingParams(presence_penalty=1.5), "repeat", seed=3, prompt=PROMPT, output=OUTPUT)
    results = world.tests(N)
    assert results["position 1"].passed, results  # row 1 has no draft before it
    assert not results["joint"].passed, results
