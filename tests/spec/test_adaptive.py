"""AdaptiveK: K follows each request's acceptance, and falls back to probing when it is poor."""

from __future__ import annotations

import pytest

from verispec.spec.adaptive import AdaptiveK
from verispec.spec.metrics import expected_emitted_tokens


@pytest.mark.parametrize("batch", [1, 16])
def test_k_maximises_tokens_per_cost(batch: int) -> None:
    ctl = AdaptiveK(max_k=8, row_cost=0.1)
    cost = batch * 0.1 / (1 + batch * 0.1)
    for alpha in (0.0, 0.3, 0.6, 0.9, 1.0):
        best = ctl.table(batch)[round(alpha * 100)]
        rate = lambda k: expected_emitted_tokens(alpha, k) / (1 + cost * k)  # noqa: E731
        assert all(rate(best) >= rate(k) - 1e-12 for k in range(9))
    assert ctl.table(batch)[0] == 0 and ctl.table(batch)[100] == 8


def test_bigger_batches_speculate_less() -> None:
    ctl = AdaptiveK(max_k=8, row_cost=0.1)
    assert all(a >= b for a, b in zip(ctl.table(1), ctl.table(16)))
    assert ctl.table(1)[50] > ctl.table(16)[50]


def test_acceptance_raises_and_rejection_lowers_k() -> None:
    ctl = AdaptiveK(max_k=6, row_cost=0.1)
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


@pytest.mark.parametrize("kwargs", [{"max_k": -1}, {"max_k": 3, "row_cost": 0}, {"max_k": 3, "decay": 0}])
def test_bad_settings_are_named(kwargs) -> None:
    name = [k for k in kwargs if k != "max_k"] or ["max_k"]
    with pytest.raises(ValueError, match=name[-1]):
        AdaptiveK(**kwargs)
