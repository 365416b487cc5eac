"""AdaptiveK: K follows each request's acceptance, and falls back to probing when it is poor."""

from __future__ import annotations

import pytest

from verispec.spec.adaptive import AdaptiveK
from verispec.spec.metrics import expected_emitted_tokens


def test_k_maximises_tokens_per_cost() -> None:
    ctl = AdaptiveK(max_k=8, draft_token_cost=0.1)
    for alpha in (0.0, 0.3, 0.6, 0.9, 1.0):
        best = ctl._table[round(alpha * 100)]
        rate = lambda k: expected_emitted_tokens(alpha, k) / (1 + 0.1 * k)  # noqa: E731
        assert all(rate(best) >= rate(k) - 1e-12 for k in range(9))
    assert ctl._table[0] == 0 and ctl._table[100] == 8


def test_acceptance_raises_and_rejection_lowers_k() -> None:
    ctl = AdaptiveK(max_k=6, draft_token_cost=0.1)
    start = ctl.num_draft_tokens("a")
    for _ in range(10):
        ctl.observe("a", 6, 6)
    assert ctl.num_draft_tokens("a") == 6 > start
    for _ in range(40):
        ctl.observe("a", 6, 0)
    assert ctl.num_draft_tokens("a") == 0
    assert ctl.num_draft_tokens("b") == start  # requests are independent


def test_a_request_at_zero_probes_again() -> None:
    ctl = AdaptiveK(max_k=4, probe_interval=3)
    for _ in range(40):
        ctl.observe("a", 4, 0)
    ks = [ctl.num_draft_tokens("a") for _ in range(6)]
    assert ks == [0, 0, 1, 0, 0, 1]
    ctl.release("a")
    assert ctl.num_draft_tokens("a") > 0


@pytest.mark.parametrize("kwargs", [{"max_k": -1}, {"max_k": 3, "draft_token_cost": 0}, {"max_k": 3, "decay": 0}])
def test_bad_settings_are_named(kwargs) -> None:
    name = [k for k in kwargs if k != "max_k"] or ["max_k"]
    with pytest.raises(ValueError, match=name[-1]):
        AdaptiveK(**kwargs)
