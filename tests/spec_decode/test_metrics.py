import math

import pytest
import torch

from verispec.spec_decode import SpecDecodeStats
from verispec.spec_decode.metrics import (
    best_num_speculative_tokens,
    expected_acceptance,
    expected_emitted_tokens,
    should_use_speculation,
    speedup,
)

# Monte-Carlo tolerances come from Hoeffding's inequality: the mean of N independent draws in an
# interval of width w is within w * sqrt(ln(2 / delta) / (2 N)) of its expectation except with
# probability delta. With delta = 1e-6 per check, a correct implementation practically never
# fails (and the seeds are fixed), while a wrong formula is off by far more.
FALSE_ALARM = 1e-6


def hoeffding(num_draws: int, width: float, num_checks: int = 1) -> float:
    return width * math.sqrt(math.log(2 * num_checks / FALSE_ALARM) / (2 * num_draws))


# ---------------------------------------------------------------------------- SpecDecodeStats


def test_stats_observe_and_rates():
    stats = SpecDecodeStats()
    assert stats.acceptance_rate == 0.0
    assert stats.mean_acceptance_length == 1.0
    assert stats.per_position_acceptance == []
    stats.observe(3, 2)
    stats.observe(5, 0)
    stats.observe(0, 0)  # a step without drafts: one emitted token, not a draft
    assert stats.num_drafts == 2
    assert stats.num_draft_tokens == 8
    assert stats.num_accepted_tokens == 2
    assert stats.num_emitted_tokens == 3 + 1 + 1
    assert stats.num_steps == 3
    assert stats.draft_per_position == [2, 2, 2, 1, 1]
    assert stats.accepted_per_position == [1, 1]
    assert stats.acceptance_rate == 2 / 8
    assert stats.mean_acceptance_length == 1 + 2 / 2
    assert stats.per_position_acceptance == [0.5, 0.5, 0.0, 0.0, 0.0]


def test_stats_merge_and_summary():
    a, b = SpecDecodeStats(), SpecDecodeStats()
    a.observe(2, 2)
    b.observe(4, 3)
    b.observe(4, 1)
    a.merge(b)
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == (3, 10, 6)
    assert a.num_emitted_tokens == 9
    assert a.draft_per_position == [3, 3, 2, 2]
    assert a.accepted_per_position == [3, 2, 1]
    assert b.num_drafts == 2  # merge leaves its argument alone
    summary = a.summary()
    assert summary == {
        "num_steps": 3,
        "num_drafts": 3,
        "num_draft_tokens": 10,
        "num_accepted_tokens": 6,
        "num_emitted_tokens": 9,
        "acceptance_rate": 0.6,
        "mean_acceptance_length": 3.0,
        "per_position_acceptance": [1.0, 2 / 3, 0.5, 0.0],
    }


@pytest.mark.parametrize("args, name", [((2, 3), "num_accepted=3"), ((-1, 0), "num_draft=-1"),
                                        ((2, -1), "num_accepted=-1")])
def test_stats_observe_validates(args, name):
    with pytest.raises(ValueError, match=name):
        SpecDecodeStats().observe(*args)


# ---------------------------------------------------------------------------- closed forms


def test_expected_emitted_tokens_hand_values():
    assert expected_emitted_tokens(0.5, 2) == pytest.approx(1.75)  # 1 + .5 + .25
    assert expected_emitted_tokens(0.8, 3) == pytest.approx((1 - 0.8**4) / 0.2)
    assert expected_emitted_tokens(1.0, 4) == 5.0
    assert expected_emitted_tokens(0.0, 4) == 1.0
    assert expected_emitted_tokens(0.7, 0) == 1.0
    assert expected_emitted_tokens([0.9, 0.5, 0.2]) == pytest.approx(1 + 0.9 + 0.45 + 0.09)
    assert expected_emitted_tokens([0.9, 0.5, 0.2], 2) == pytest.approx(2.35)
    assert expected_emitted_tokens([0.6] * 5) == pytest.approx(expected_emitted_tokens(0.6, 5))
    # Accurate near alpha = 1, where (1 - a^(k+1)) / (1 - a) cancels.
    assert expected_emitted_tokens(1 - 1e-12, 5) == pytest.approx(6 - 15e-12, rel=1e-15)


def test_expected_acceptance_hand_values():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.1, 0.1, 0.4, 0.4])
    assert expected_acceptance(p, q).item() == pytest.approx(0.1 + 0.1 + 0.2)
    assert expected_acceptance(p, p).item() == pytest.approx(1.0)
    disjoint = torch.tensor([0.0, 0.0, 0.0, 1.0])
    assert expected_acceptance(p, disjoint).item() == 0.0
    # Batched: [2, 3, V] -> [2, 3], and equal to 1 - TV.
    g = torch.Generator().manual_seed(0)
    pb = torch.rand(2, 3, 7, generator=g).softmax(-1)
    qb = torch.rand(2, 3, 7, generator=g).softmax(-1)
    out = expected_acceptance(pb, qb)
    assert out.shape == (2, 3)
    torch.testing.assert_close(out, 1 - 0.5 * (pb - qb).abs().sum(-1))


def test_speedup_hand_values():
    assert speedup(0.5, 2, 0.1, 1.0) == pytest.approx(1.75 / 1.2)
    assert speedup(0.5, 2, 1.0, 1.0) == pytest.approx(1.75 / 3)
    assert speedup(0.9, 0, 0.1, 1.0) == 1.0
    assert speedup(0.5, 3, 0.0, 2.0) == pytest.approx(1.875)  # free drafter: speedup = E
    assert should_use_speculation(0.5, 2, 0.1, 1.0)
    assert not should_use_speculation(0.5, 2, 1.0, 1.0)
    assert not should_use_speculation(0.9, 0, 0.1, 1.0)


def test_best_num_speculative_tokens():
    # speedup(0.8, k, 0.05, 1) rises to 3.092 at k = 8, then falls (3.078 at k = 9).
    assert best_num_speculative_tokens(0.8, 0.05, 1.0) == 8
    brute = max(range(17), key=lambda k: (speedup(0.8, k, 0.05, 1.0), -k))
    assert brute == 8
    assert best_num_speculative_tokens(0.8, 0.05, 1.0, max_k=3) == 3
    assert best_num_speculative_tokens(0.1, 0.5, 1.0) == 0  # drafting never pays
    assert best_num_speculative_tokens(0.0, 0.0, 1.0) == 0  # ties go to the smaller k
    assert best_num_speculative_tokens(1.0, 0.0, 1.0, max_k=5) == 5
    assert best_num_speculative_tokens([0.9, 0.9, 0.1, 0.9], 0.1, 1.0) == 2
    assert best_num_speculative_tokens([1.0, 1.0], 0.0, 1.0) == 2  # capped by len(alpha)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: expected_emitted_tokens(1.5, 2), "alpha=1.5"),
        (lambda: expected_emitted_tokens(-0.1, 2), "alpha=-0.1"),
        (lambda: expected_emitted_tokens(float("nan"), 2), "alpha=nan"),
        (lambda: expected_emitted_tokens(0.5, -1), "k=-1"),
        (lambda: expected_emitted_tokens(0.5, 1.5), "k=1.5"),
        (lambda: expected_emitted_tokens(0.5), "k=None"),
        (lambda: expected_emitted_tokens([0.5, 2.0]), r"alpha\[1\]=2.0"),
        (lambda: expected_emitted_tokens([0.5, 0.5], 3), r"k=3 .*len\(alpha\)=2"),
        (lambda: speedup(0.5, -2, 0.1, 1.0), "k=-2"),
        (lambda: speedup(0.5, 2, -0.1, 1.0), "t_draft=-0.1"),
        (lambda: speedup(0.5, 2, 0.1, 0.0), "t_target=0.0"),
        (lambda: speedup(0.5, 2, 0.1, float("inf")), "t_target=inf"),
        (lambda: should_use_speculation(2, 2, 0.1, 1.0), "alpha=2"),
        (lambda: best_num_speculative_tokens(0.5, 0.1, 1.0, max_k=-1), "max_k=-1"),
        (lambda: expected_acceptance(torch.ones(3), torch.ones(4)), r"\(3,\) and \(4,\)"),
    ],
)
def test_analysis_validates(call, name):
    with pytest.raises(ValueError, match=name):
        call()


# ---------------------------------------------------------------------------- Monte Carlo


@pytest.mark.parametrize("alpha, k", [(0.7, 4), (0.95, 6), ([0.9, 0.6, 0.3, 0.8], 4)])
def test_expected_emitted_tokens_matches_simulation(alpha, k):
    n = 200_000
    g = torch.Generator().manual_seed(1)
    alphas = torch.tensor(alpha if isinstance(alpha, list) else [alpha] * k)
    accepted_each = torch.rand(n, k, generator=g) < alphas  # independent per-position coins
    num_accepted = accepted_each.int().cumprod(dim=1).sum(dim=1)  # up to the first rejection
    stats = SpecDecodeStats()
    for a in num_accepted.tolist():
        stats.observe(k, a)
    expected = expected_emitted_tokens(alpha, k)
    # Emitted tokens lie in [1, k + 1]: width k.
    tol = hoeffding(n, width=k)
    assert abs(stats.num_emitted_tokens / n - expected) < tol
    assert abs(stats.mean_acceptance_length - expected) < tol


def test_expected_acceptance_matches_rejection_rule_frequency():
    """Empirical frequency of "accept x ~ q with probability min(1, p(x)/q(x))", compared as
    u * q(x) < p(x), against sum_v min(p_v, q_v)."""
    g = torch.Generator().manual_seed(2)
    vocab = 8
    dirichlet = torch.distributions.Dirichlet(torch.ones(vocab))
    torch.manual_seed(3)
    pairs = [(dirichlet.sample(), dirichlet.sample()) for _ in range(4)]
    sparse_q = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25, 0.0, 0.0, 0.0])
    sparse_p = torch.tensor([0.3, 0.1, 0.0, 0.0, 0.2, 0.4, 0.0, 0.0])
    over_confident_q = torch.tensor([0.93] + [0.01] * 7)
    pairs += [(sparse_p, sparse_q), (pairs[0][0], over_confident_q), (pairs[1][0], pairs[1][0])]
    n = 200_000
    tol = hoeffding(n, width=1.0, num_checks=len(pairs))
    for p, q in pairs:
        x = torch.multinomial(q, n, replacement=True, generator=g)
        u = torch.rand(n, generator=g)
        frequency = (u * q[x] < p[x]).double().mean().item()
        assert abs(frequency - expected_acceptance(p, q).item()) < tol
