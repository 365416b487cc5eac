"""CostLearner: the engine's step and drafting times in, the adaptive gate's prices out.

The engine reports each drafting call and each decode step's work past drafting (LLMEngine.step);
StepCosts fits the cost model's constants to them (spec_decode/step_costs.py), and every
`every` steps the gate (spec_decode/adaptive.py) is re-priced with the fit. The fit is saved
per machine, model and drafter (spec_decode/cost_cache.py) after `first_save` steps and every
`save_every` after that, and a later engine with the same key starts from it.

One fit per batch class (the step's sampling requests rounded down to a power of two: 1, 2, 4,
...), because a pass's time is not one line in its rows: on a 2-core Intel Xeon (Skylake-SP,
4-bit target) a verify row of a lone request added ~1.0 ms to an 8.5 ms step, a row of a
sixteenth request ~1.7 ms, and one line through both priced batch 1's rows at 0.3 of the step
instead of 0.12; the cache then carried batch 16's price into every later batch-1 run. The
gate is priced with the fit of the class the engine ran last, re-priced as soon as it changes.

Only greedy and unseeded requests are priced with what was learned: a seeded request's K
decides which random numbers it consumes, so it keeps the declared constants (the gate's
`declared` lookups) and its output does not depend on how fast the machine was.

Where no earlier run's batch-1 fit is kept, the engine times a few passes at load (`calibrate`,
runtime/row_cost.py) and the batch-1 fit starts from the row cost they show instead of the
declared one: a declared price too dear for this machine keeps the gate from drafting, and so
from the passes of several row counts that would correct it.

VERISPEC_LEARN_COSTS=0 turns learning off for every engine of the process (the declared
constants throughout, as SpeculativeConfig.learn_costs=False does for one): for runs whose
drafting must not depend on the machine's load, such as the test suite's.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from .adaptive import AdaptiveK, TreeGate
from .cost_cache import CostCache
from .step_costs import StepCosts


ENV = "VERISPEC_LEARN_COSTS"


def learning_enabled() -> bool:
    """Whether $VERISPEC_LEARN_COSTS lets engines learn their step costs (anything but "0")."""
    return os.environ.get(ENV, "1") != "0"


def batch_class(requests: int) -> int:
    """The power of two at or below `requests` (at least 1): steps of one class share a fit."""
    return 1 << (max(requests, 1).bit_length() - 1)


class CostLearner:
    """gate: the engine's AdaptiveK or TreeGate, priced at first with row_cost and draft_cost
    (the declared constants, where each batch class's fit starts without a saved one); cache:
    where the fits are kept between runs (one entry per batch class), None for nowhere.
    warmup: passes not counted at the start (first calls run cold: allocation, page faults)."""

    def __init__(self, gate: AdaptiveK | TreeGate, row_cost: float, draft_cost: Callable[[int, int], float],
                 cache: CostCache | None, every: int = 16, first_save: int = 64, save_every: int = 1024,
                 warmup: int = 2) -> None:
        self.gate, self.cache = gate, cache
        self.every, self.first_save, self.save_every, self.warmup = every, first_save, save_every, warmup
        self._declared = row_cost, draft_cost
        self._fits: dict[int, StepCosts] = {}
        self._kept: set[int] = set()  # batch classes whose fit started from the cache's
        self.batch = 1  # the class of the last step seen
        self._seen = 0
        gate.recalibrate(*self.costs.snapshot())

    @property
    def costs(self) -> StepCosts:
        """The fit of the batch class the engine ran last."""
        fit = self._fits.get(self.batch)
        if fit is None:
            prior = None if self.cache is None else self.cache.batch(self.batch).load()
            if prior is not None:
                self._kept.add(self.batch)
            fit = self._fits[self.batch] = StepCosts(*self._declared, prior=prior)
        return fit

    def calibrate(self, measure: Callable[[], float | None]) -> None:
        """Starts the batch-1 fit from `measure()`'s row cost (timed passes: runtime/row_cost.py;
        None when they could not run) unless an earlier run's batch-1 fit is kept, and keeps it
        for the next engine on this machine."""
        if 1 in self._kept:
            return
        row_cost = measure()
        if row_cost is None:
            return
        fit = self._fits[1] = StepCosts(row_cost, self._declared[1])
        if self.batch == 1:
            self.gate.recalibrate(*fit.snapshot())
        if self.cache is not None:
            self.cache.batch(1).save(fit.learned)

    @property
    def observed_passes(self) -> int:
        """Passes counted, over every batch class."""
        return sum(fit.observed_passes for fit in self._fits.values())

    def observe_call(self, depth: int, num_requests: int, seconds: float) -> None:
        if self._seen >= self.warmup:
            self.costs.observe_call(depth, num_requests, seconds)

    def observe_pass(self, padded_rows: int, seconds: float, requests: int = 1) -> None:
        """A decode step's pass over `padded_rows` rows for `requests` sampling requests took `seconds`."""
        self._seen += 1
        if self._seen <= self.warmup:
            return
        batch = batch_class(requests)
        switched, self.batch = batch != self.batch, batch
        costs = self.costs
        costs.observe_pass(padded_rows, seconds)
        n = costs.observed_passes
        if switched or n % self.every == 0:
            self.gate.recalibrate(*costs.snapshot())
        if self.cache is not None and (n == self.first_save or n % self.save_every == 0):
            self.cache.batch(self.batch).save(costs.learned)
