"""Exactness, proven distributionally: chi-square goodness of fit at a 1e-6 false-alarm rate.

Every case draws N = 100,000 independent requests through the two-token world of harness.py and
tests the first emitted token, the second, and their joint distribution against the reference
pipeline's target distributions.
"""

from __future__ import annotations

import pytest
import torch

from verispec import SamplingMetadata, SamplingParams
from verispec.sample import DraftProbs, rejection_sample

from ..stats import chi_square
from .harness import DRAFT_KINDS, V, World

N = 100_000

CASES = [
    *[(SamplingParams(), kind) for kind in DRAFT_KINDS],
    *[(SamplingParams(temperature=t), kind) for t in (0.3, 1.7) for kind in ("uniform", "logits", "overconfident")],
    *[(SamplingParams(top_k=3), kind) for kind in ("uniform", "overconfident", "logits", "disjoint")],
    *[(SamplingParams(top_p=0.7), kind) for kind in ("uniform", "logits", "onehot")],
    *[(SamplingParams(min_p=0.2), kind) for kind in ("uniform", "onehot", "logits")],
    (SamplingParams(temperature=0.7, top_k=4, top_p=0.8, min_p=0.05), "logits"),
    *[(SamplingParams(guidance_scale=g), kind) for g in (1.5, 3.0) for kind in ("uniform", "same", "logits", "onehot")],
    (SamplingParams(guidance_scale=3.0, temperature=0.7, top_p=0.9), "overconfident"),
    (SamplingParams(temperature=0), "uniform"),
]


@pytest.mark.parametrize(
    "params,kind", CASES, ids=[f"{kind}-{p.temperature}-{p.top_k}-{p.top_p}-{p.min_p}-{p.guidance_scale}" for p, kind in CASES]
)
def test_emitted_tokens_follow_target(params: SamplingParams, kind: str) -> None:
    world = World(params, kind, seed=len(kind) + int(params.temperature * 10))
    for name, result in world.tests(N).items():
        assert result.passed, f"{name}: {result}"


def test_mixed_k_in_one_batch_each_follows_target() -> None:
    """Ragged K (0, 1, 3) in one batch: the first emitted token of every request follows p1."""
    world = World(SamplingParams(temperature=0.9, top_k=5), "uniform", seed=7)
    g = torch.Generator().manual_seed(3)
    ks = torch.tensor([0, 1, 3]).repeat(N // 3)
    n = ks.numel()
    cu = torch.cat([torch.zeros(1, dtype=torch.long), ks.cumsum(0)])
    ids = torch.randint(0, V, (int(cu[-1]),), generator=g)
    target = torch.empty(int(cu[-1]) + n, V)
    first_row = cu[:-1] + torch.arange(n)
    target[first_row] = world.t1
    other = torch.ones(target.shape[0], dtype=torch.bool)
    other[first_row] = False
    target[other] = torch.randn(int(other.sum()), V, generator=g)
    sampling = SamplingMetadata.from_params([world.params] * n, seeds=list(range(n)))
    probs = DraftProbs(torch.full((int(cu[-1]), V), 1 / V))
    out = rejection_sample(target, ids, cu, sampling, draft=probs)
    assert out.token_ids.shape == (n, 4)
    for k in (0, 1, 3):
        result = chi_square(out.token_ids[ks == k, 0], world.p1)
        assert result.passed, f"K={k}: {result}"
        assert bool((out.num_emitted[ks == k] <= k + 1).all())


def _resample_from_p_on_reject(target, ids, cu, sampling, draft, uncond) -> torch.Tensor:
    """A WRONG verifier (for K = 2): on rejection it draws from p instead of max(p - q, 0)."""
    if ids.numel() == 0:  # the harness's draft-free second step
        return rejection_sample(target, ids, cu, sampling, uncond_logits=uncond).token_ids
    n = sampling.batch_size
    p = target.softmax(-1).reshape(n, 3, V)
    x = ids.reshape(n, 2)
    q = draft.probs.reshape(n, 2, V)
    px = p[:, :2].gather(2, x[..., None])[..., 0]
    qx = q.gather(2, x[..., None])[..., 0]
    accept = torch.rand(n, 2) * qx < px
    num_accepted = accept.long().cumprod(1).sum(1)
    final = torch.multinomial(p[torch.arange(n), num_accepted], 1)[:, 0]
    slot = torch.arange(3)[None]
    padded = torch.cat([x, torch.zeros(n, 1, dtype=torch.long)], 1)
    n_acc = num_accepted[:, None]
    return torch.where(slot < n_acc, padded, torch.where(slot == n_acc, final[:, None], -1))


def test_suite_catches_a_wrong_residual() -> None:
    """The statistic has power: a verifier that forgets to subtract q fails it."""
    world = World(SamplingParams(), "uniform", seed=11)
    results = world.tests(N, sampler=_resample_from_p_on_reject)
    assert not results["joint"].passed, results
    assert not results["position 1"].passed, results
