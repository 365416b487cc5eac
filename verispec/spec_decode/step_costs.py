"""The adaptive K's cost constants, learned from the step times the engine sees.

Terms: a *pass* is an engine step's work past drafting (the target's forward pass over the
step's rows, verification, the step's bookkeeping), timed as a whole. A pass over R rows (padded
as the model pads them, LlamaModel.padded_rows) costs a + b·R seconds; the *row cost* is
r = b / a, spec_decode/adaptive.py's row_cost. A drafting *call* for n requests, the deepest
drafting `depth` tokens, costs, in units of a,

    s_first · D(1, n) + s_rest · (D(depth, n) - D(1, n)),

where D is what the drafter declares (Drafter.draft_cost, e.g. a verispec.config.DraftCost) and
the two scales s (1 at first) are learned: a call with its first position, and the positions
after it, are the two parts whose prices move apart between CPUs (on an AVX2 core an EAGLE
position costs ~3x what it does on an AVX-512 VNNI one). A drafter that declares nothing gets
the shapes 1 and depth - 1 with scales starting at 0.

Why learned: the constants differ several-fold between CPUs (an extra row of the 4-bit target
costs 0.3 a on an AVX-512 VNNI core and 0.63-0.72 a on an AVX2 one) and between loads of the
machine; constants measured elsewhere keep a drafter drafting where it loses.

Both fits are least squares over decayed sums (each observation's weight shrinks by `decay` per
later one of its kind, so the fits follow a machine whose speed changes), pulled toward a prior
worth `prior_weight` observations: the declared constants, or the last run's fit on this machine
(spec_decode/cost_cache.py). Until passes of two row counts have been seen the prior alone
decides the row cost, and a drafting depth never seen keeps the prior's per-position price.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config import DraftCost


@dataclass(frozen=True)
class LearnedCosts:
    """A snapshot of the fits: row_cost = b / a, and the two draft-cost scales."""

    row_cost: float
    first_scale: float
    rest_scale: float


def _solve2(m: tuple[float, float, float], v: tuple[float, float]) -> tuple[float, float] | None:
    """Solves [[m0, m1], [m1, m2]] x = v; None when the system is singular."""
    det = m[0] * m[2] - m[1] * m[1]
    if abs(det) <= 1e-12 * (abs(m[0]) + abs(m[2])) ** 2:
        return None
    return (m[2] * v[0] - m[1] * v[1]) / det, (m[0] * v[1] - m[1] * v[0]) / det


class _Decayed2:
    """Decayed sums of a two-feature least-squares problem: Σ w·f fᵀ and Σ w·f y."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.m = [0.0, 0.0, 0.0]  # f0², f0·f1, f1²
        self.v = [0.0, 0.0]
        self.weight = 0.0

    def add(self, f0: float, f1: float, y: float) -> None:
        d = self.decay
        self.m = [d * self.m[0] + f0 * f0, d * self.m[1] + f0 * f1, d * self.m[2] + f1 * f1]
        self.v = [d * self.v[0] + f0 * y, d * self.v[1] + f1 * y]
        self.weight = d * self.weight + 1


class StepCosts:
    """Learns a, b and the draft-cost scales (module docstring).

    row_cost: the prior r; draft_cost: the drafter's declared D (the prior's shape); prior: a
    LearnedCosts to start from instead (a previous run's fit), whose row_cost replaces r and
    whose scales replace 1. The declared D is probed once, at depth 1 and 2 for one request, to
    tell whether it declares anything.
    """

    def __init__(self, row_cost: float, draft_cost: Callable[[int, int], float] = DraftCost(),
                 prior: LearnedCosts | None = None, prior_weight: float = 1.0, decay: float = 0.99) -> None:
        if not (row_cost > 0 and prior_weight > 0 and 0 < decay <= 1):
            raise ValueError(f"row_cost={row_cost!r}, prior_weight={prior_weight!r}, decay={decay!r} "
                             "are invalid for StepCosts: expected row_cost > 0, prior_weight > 0, 0 < decay <= 1")
        declares = draft_cost(1, 1) > 0 or draft_cost(2, 1) > 0
        self._shape = draft_cost if declares else lambda depth, n: float(depth)
        start = 1.0 if declares else 0.0
        self.prior = prior or LearnedCosts(row_cost, start, start)
        self.prior_weight = prior_weight
        self._passes = _Decayed2(decay)  # features (1, padded rows), seconds
        self._calls = _Decayed2(decay)  # features (call shape, position shape), seconds
        self._pass_rows: set[int] = set()
        self._a = self._b = None
        self.observed_passes = 0

    def observe_pass(self, padded_rows: int, seconds: float) -> None:
        """A pass over `padded_rows` rows took `seconds`."""
        if padded_rows <= 0 or not seconds > 0:
            return
        predicted = self._predicted_pass(padded_rows)
        # One pause of the machine (a page fault, another process) must not move the fit far.
        if predicted is not None:
            seconds = min(seconds, 1.5 * predicted)
        self._passes.add(1.0, float(padded_rows), seconds)
        self._pass_rows.add(padded_rows)
        self.observed_passes += 1
        self._a = self._b = None

    def observe_call(self, depth: int, num_requests: int, seconds: float) -> None:
        """A drafting call, the deepest drafting `depth` tokens for `num_requests` requests, took `seconds`."""
        if depth <= 0 or num_requests <= 0 or not seconds > 0:
            return
        a = self.fixed_seconds
        if a is None:
            return  # no pass seen yet: nothing to measure the call against
        f0, f1 = self._features(depth, num_requests)
        learned = self.learned
        predicted = a * (learned.first_scale * f0 + learned.rest_scale * f1)
        if predicted > 0:
            seconds = min(seconds, 1.5 * predicted)
        self._calls.add(f0, f1, seconds)

    def _features(self, depth: int, num_requests: int) -> tuple[float, float]:
        first = self._shape(1, num_requests)
        return first, self._shape(depth, num_requests) - first

    def _fit_pass(self) -> tuple[float, float] | None:
        """(a, b): least squares over the passes, plus prior_weight·(b - r·a)², which pins b to
        the prior's row cost where the passes cannot (one row count only)."""
        if self._a is None and self._passes.weight > 0:
            r, w = self.prior.row_cost, self.prior_weight
            m, v = self._passes.m, self._passes.v
            # Scaled by the spread of the row counts seen, so that the prior weighs like w passes
            # do in telling b apart from a (and still decides b when every pass had one count).
            mean = m[1] / m[0]
            spread = w * max(m[2] / m[0] - mean * mean, 1e-3)
            solved = _solve2((m[0] + spread * r * r, m[1] - spread * r, m[2] + spread), (v[0], v[1]))
            if solved is not None and solved[0] > 0:
                self._a, self._b = solved[0], max(solved[1], 0.0)
        return None if self._a is None else (self._a, self._b)

    def _predicted_pass(self, padded_rows: int) -> float | None:
        fit = self._fit_pass()
        return None if fit is None else fit[0] + fit[1] * padded_rows

    @property
    def fixed_seconds(self) -> float | None:
        """a, in seconds; None before the first pass."""
        fit = self._fit_pass()
        return None if fit is None else fit[0]

    @property
    def learned(self) -> LearnedCosts:
        """The current fit (the prior before anything was seen)."""
        fit = self._fit_pass()
        if fit is None:
            return self.prior
        a, b = fit
        # With passes of one row count only, b is the prior's alone: keep its exact value.
        row_cost = b / a if len(self._pass_rows) > 1 else self.prior.row_cost
        scales = (self.prior.first_scale, self.prior.rest_scale)
        if self._calls.weight > 0:
            # Ridge toward the prior scales, as prior_weight calls of one request at depth 2
            # would pull (a scale no call has informed, such as the later positions' of a
            # drafter only ever asked for one, stays the prior's).
            f0, f1 = self._features(2, 1)
            l0, l1 = self.prior_weight * max(f0 * f0, 1e-6), self.prior_weight * max(f1 * f1, 1e-6)
            m, v = self._calls.m, self._calls.v
            solved = _solve2((m[0] + l0, m[1], m[2] + l1),
                             (v[0] / a + l0 * scales[0], v[1] / a + l1 * scales[1]))
            if solved is not None:
                scales = (max(solved[0], 0.0), max(solved[1], 0.0))
        return LearnedCosts(max(row_cost, 1e-3), *scales)

    def snapshot(self) -> tuple[float, Callable[[int, int], float]]:
        """(row_cost, draft cost in units of a with DraftCost's call signature), frozen at the
        current fit: what the adaptive gate prices steps with until the next snapshot."""
        learned, features = self.learned, self._features

        def draft_cost(depth: int, num_requests: int) -> float:
            if depth <= 0 or num_requests <= 0:
                return 0.0
            f0, f1 = features(depth, num_requests)
            return learned.first_scale * f0 + learned.rest_scale * f1

        return learned.row_cost, draft_cost
