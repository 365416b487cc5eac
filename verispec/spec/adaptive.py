"""Per-request K: speculate as far as it pays, from the acceptance each request has shown.

Cost model: a step over R rows costs a + b·R (a fixed part: weights read, launches, Python; b
per row). With B running requests, giving each k more rows costs (1 + c·k) times the step, where
c = B·r / (1 + B·r) and r = b / a is `row_cost` (about 0.1 for the default model on CPU: a
speculated token is nearly free alone, and nearly a full step at batch 16). Each draft is accepted
with probability alpha; tokens per unit of time are E(alpha, k) / (1 + c·k), with E the expected
emitted tokens per step (metrics.expected_emitted_tokens); K is its argmax over 0..max_k.

alpha is estimated per request from a decaying count of accepted and rejected drafts (the first
rejection of a step counts once; drafts after it were never judged), starting from a prior worth
`prior_weight` drafts. A request whose K dropped to 0 probes with one draft every
`probe_interval` steps, so text that turns repetitive regains speculation.

K only changes speed: whatever K a request gets from its past, its output is exact. K does
decide which random numbers a sampled request consumes, so the engine prices seeded sampled
requests at batch size 1: their K then depends on their own history only, and they stay batch
invariant; greedy and unseeded requests get the batch-size-aware K.
"""

from __future__ import annotations

from dataclasses import dataclass

from .metrics import expected_emitted_tokens


@dataclass
class _Estimate:
    accepted: float = 0.0
    judged: float = 0.0
    idle_steps: int = 0


class AdaptiveK:
    def __init__(self, max_k: int, row_cost: float = 0.1, prior: float = 0.3,
                 prior_weight: float = 1.0, decay: float = 0.9, probe_interval: int = 8) -> None:
        for name, value, ok in (
            ("max_k", max_k, isinstance(max_k, int) and max_k >= 0),
            ("row_cost", row_cost, row_cost > 0),
            ("prior", prior, 0 <= prior <= 1),
            ("prior_weight", prior_weight, prior_weight > 0),
            ("decay", decay, 0 < decay <= 1),
            ("probe_interval", probe_interval, isinstance(probe_interval, int) and probe_interval >= 1),
        ):
            if not ok:
                raise ValueError(f"{name}={value!r} is invalid for AdaptiveK")
        self.max_k, self.row_cost, self.prior, self.prior_weight = max_k, row_cost, prior, prior_weight
        self.decay, self.probe_interval = decay, probe_interval
        self._estimates: dict[str, _Estimate] = {}
        self._tables: dict[int, list[int]] = {}

    def table(self, batch_size: int) -> list[int]:
        """The best k for acceptance 0.00, 0.01, ..., 1.00 at this batch size (computed once)."""
        if batch_size not in self._tables:
            cost = batch_size * self.row_cost / (1 + batch_size * self.row_cost)
            self._tables[batch_size] = [self._best_k(i / 100, cost) for i in range(101)]
        return self._tables[batch_size]

    def _best_k(self, alpha: float, cost: float) -> int:
        rates = [expected_emitted_tokens(alpha, k) / (1 + cost * k) for k in range(self.max_k + 1)]
        return max(range(self.max_k + 1), key=lambda k: (rates[k], -k))

    def alpha(self, request_id: str) -> float:
        e = self._estimates.get(request_id, _Estimate())
        return (e.accepted + self.prior * self.prior_weight) / (e.judged + self.prior_weight)

    def num_draft_tokens(self, request_id: str, batch_size: int = 1) -> int:
        """K for the request's next step, among `batch_size` running requests."""
        k = self.table(max(1, batch_size))[round(self.alpha(request_id) * 100)]
        if k == 0 and self.max_k > 0:
            e = self._estimates.setdefault(request_id, _Estimate())
            e.idle_steps += 1
            if e.idle_steps >= self.probe_interval:
                e.idle_steps = 0
                return 1
        return k

    def observe(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        e = self._estimates.setdefault(request_id, _Estimate())
        e.accepted = self.decay * e.accepted + num_accepted
        e.judged = self.decay * e.judged + num_accepted + (1 if num_accepted < num_draft else 0)

    def release(self, request_id: str) -> None:
        self._estimates.pop(request_id, None)
