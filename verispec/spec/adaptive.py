"""Per-request K: speculate as far as it pays, from the acceptance each request has shown.

Cost model: a verify step with k draft tokens costs (1 + c·k) plain decode steps, c being the
relative cost of one more verified (and drafted) token; each draft is accepted with probability
alpha. Tokens per unit of time are then E(alpha, k) / (1 + c·k), with E the expected emitted
tokens per step (metrics.expected_emitted_tokens); K is its argmax over 0..max_k.

alpha is estimated per request from a decaying count of accepted and rejected drafts (the first
rejection of a step counts once; drafts after it were never judged), starting from a prior worth
`prior_weight` drafts. A request whose K dropped to 0 probes with one draft every
`probe_interval` steps, so text that turns repetitive regains speculation.

K only changes speed: whatever K a request gets from its own past, its output is exact (and,
since it depends on nothing else in the batch, seeded requests stay batch invariant).
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
    def __init__(self, max_k: int, draft_token_cost: float = 0.1, prior: float = 0.3,
                 prior_weight: float = 1.0, decay: float = 0.9, probe_interval: int = 8) -> None:
        for name, value, ok in (
            ("max_k", max_k, isinstance(max_k, int) and max_k >= 0),
            ("draft_token_cost", draft_token_cost, draft_token_cost > 0),
            ("prior", prior, 0 <= prior <= 1),
            ("prior_weight", prior_weight, prior_weight > 0),
            ("decay", decay, 0 < decay <= 1),
            ("probe_interval", probe_interval, isinstance(probe_interval, int) and probe_interval >= 1),
        ):
            if not ok:
                raise ValueError(f"{name}={value!r} is invalid for AdaptiveK")
        self.max_k, self.cost, self.prior, self.prior_weight = max_k, draft_token_cost, prior, prior_weight
        self.decay, self.probe_interval = decay, probe_interval
        self._estimates: dict[str, _Estimate] = {}
        # The best k for each acceptance level on a fine grid, computed once.
        self._table = [self._best_k(i / 100) for i in range(101)]

    def _best_k(self, alpha: float) -> int:
        rates = [expected_emitted_tokens(alpha, k) / (1 + self.cost * k) for k in range(self.max_k + 1)]
        return max(range(self.max_k + 1), key=lambda k: (rates[k], -k))

    def alpha(self, request_id: str) -> float:
        e = self._estimates.get(request_id, _Estimate())
        return (e.accepted + self.prior * self.prior_weight) / (e.judged + self.prior_weight)

    def num_draft_tokens(self, request_id: str) -> int:
        """K for the request's next step."""
        k = self._table[round(self.alpha(request_id) * 100)]
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
