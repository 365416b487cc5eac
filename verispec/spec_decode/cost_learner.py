"""CostLearner: the engine's step and drafting times in, the adaptive gate's prices out.

The engine reports each drafting call and each decode step's work past drafting (LLMEngine.step);
StepCosts fits the cost model's constants to them (spec_decode/step_costs.py), and every
`every` steps the gate (spec_decode/adaptive.py) is re-priced with the fit. The fit is saved
per machine, model and drafter (spec_decode/cost_cache.py) after `first_save` steps and every
`save_every` after that, and a later engine with the same key starts from it.

Only greedy and unseeded requests are priced with what was learned: a seeded request's K
decides which random numbers it consumes, so it keeps the declared constants (the gate's
`declared` lookups) and its output does not depend on how fast the machine was.
"""

from __future__ import annotations

from collections.abc import Callable

from .adaptive import AdaptiveK, TreeGate
from .cost_cache import CostCache
from .step_costs import StepCosts


class CostLearner:
    """gate: the engine's AdaptiveK or TreeGate, priced at first with row_cost and draft_cost
    (the declared constants); cache: where the fit is kept between runs, None for nowhere.
    warmup: passes not counted at the start (first calls run cold: allocation, page faults)."""

    def __init__(self, gate: AdaptiveK | TreeGate, row_cost: float, draft_cost: Callable[[int, int], float],
                 cache: CostCache | None, every: int = 16, first_save: int = 64, save_every: int = 1024,
                 warmup: int = 2) -> None:
        self.gate, self.cache = gate, cache
        self.every, self.first_save, self.save_every, self.warmup = every, first_save, save_every, warmup
        self.costs = StepCosts(row_cost, draft_cost, prior=None if cache is None else cache.load())
        self._seen = 0
        gate.recalibrate(*self.costs.snapshot())

    def observe_call(self, depth: int, num_requests: int, seconds: float) -> None:
        if self._seen >= self.warmup:
            self.costs.observe_call(depth, num_requests, seconds)

    def observe_pass(self, padded_rows: int, seconds: float) -> None:
        self._seen += 1
        if self._seen <= self.warmup:
            return
        self.costs.observe_pass(padded_rows, seconds)
        n = self.costs.observed_passes
        if n % self.every == 0:
            self.gate.recalibrate(*self.costs.snapshot())
        if self.cache is not None and (n == self.first_save or n % self.save_every == 0):
            self.cache.save(self.costs.learned)
