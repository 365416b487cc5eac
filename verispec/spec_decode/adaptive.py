"""Per-request K: speculate as far as it pays, from the acceptance each request has shown.

Cost model: a step over R rows costs a + b·R (a fixed part: weights read, launches, Python; b
per row), plus a·D(depth, n) when n requests draft, the deepest `depth` tokens: what the drafter
declares its call costs (Drafter.draft_cost, verispec.config.DraftCost; 0 for a free drafter,
about 0.07 for a Medusa call, 0.09 per draft position for EAGLE on the float32 embedded model on
CPU; several times more against its 4-bit step, which is that much cheaper).
With B running requests, giving each k more rows costs (1 + c·k + d(k)) times the step, where
c = B·r / (1 + B·r), r = b / a is `row_cost` (the target's own, LlamaModel.row_cost: 0.1 for
float32 weights on CPU, where a speculated token is nearly free alone and nearly a full step at
batch 16; 0.6 for 4-bit blocks, whose one-row step only reads the weights), and
d(k) = D(k, B) / (1 + B·r). Each draft is accepted with probability alpha; tokens per unit of
time are E(alpha, k) / (1 + c·k + d(k)), with E the expected emitted tokens per step
(metrics.expected_emitted_tokens); K is its argmax over 0..max_k. A drafter that costs more
than its drafts bring gets K = 0 (and probes); so does one whose best K promises less than
DRAFT_MARGIN more tokens per unit of cost than none.

alpha is estimated per request from a decaying count of accepted and rejected drafts (the first
rejection of a step counts once; drafts after it were never judged), starting from a prior worth
`prior_weight` drafts. A drafter that tells its drafts' class before drafting
(Drafter.draft_class: the n-gram lookup's match length) gets one estimate per request and class,
each starting from the class's prior: for seeded requests the drafter's declared class_priors,
for the rest what all requests' drafts of that class have shown (a decaying count that starts
at the declared prior), so a request drafts as soon as its context turns to a class that pays
(a long match: copied text) and not before. Drafts of the drafter's free classes
(Drafter.free_classes: the hybrid's lookup drafts, beside a head whose calls its draft cost
describes) are priced by their rows alone.

A request whose K dropped to 0 probes with one draft every `probe_interval` steps, so text that
turns repetitive regains speculation; in a batch of B the interval grows by c(B) / c(1) (a probe
row costs that much more of the step there), and all such requests of the batch probe on the
same engine step (the first one after the request has idled that long: a request shorter than
the interval never probes). Each probe after which K stays 0 doubles the request's interval, up
to PROBE_BACKOFF times (a drafter that does not pay on this text then costs a sixteenth of what
its probes would); a K above 0 resets it. A new request starts with the drafter's backoff, which
doubles with every probe that fails and halves with every probe that pays, whichever request
made it (up to PROBE_BACKOFF too): a drafter that pays on no request of this machine's traffic
(EAGLE where the head's passes cost more than its drafts bring) soon stops probing at every
request's start; a seeded request starts at 1 (batch invariant). Intervals that are powers of
two apart keep a batch's probes on shared steps.

Per step, `allot` then trims the drafts of all requests together against the real shape of the
step's cost, a + b·rows(R) + a·D(depth, n) where rows(R) is what a pass over R rows costs like
(the model pads rows on CPU: 17 rows cost what 32 do, see verispec/model/linear.py) and depth
is the most drafts any request keeps. Rows of prompt chunks in the step are left out of the
yardstick (their price is the prompt's): counted in, a step with a long chunk emits so few
tokens per unit of its cost that drafts accepted one time in ten looked worth their rows (at
batch 16 on the 4-bit target, drafts of acceptance 0.09-0.27 ran in such steps). The drafts
with the largest expected gain (alpha^j for a request's j-th draft) are kept while they raise
the expected tokens per unit of cost, every
prefix of that order priced with its own rows, depth and drafting requests, and the search is
repeated with each cap on the depth (a drafter that runs one pass per position can pay more
for one request's fourth draft than for four requests' first). A K chosen per request cannot
see that one extra row can cost a whole padding step for everybody.

Trees (TreeGate) use the same cost model, each request's whole tree or none of it: a tree's
worth is measured as tokens per tree step rather than per-draft acceptance.

What a token is worth depends on what waits. With requests queued, every token brings a
free slot nearer: all tokens alike, the rate above. With nothing queued, the batch runs for as
many steps as its longest request, and the fixed cost a is paid on every one of them: a draft
of a request that would finish before the longest saves, when accepted, only its own row of a
later step, and costs a row now, so it never pays; one of a request on the critical path
saves a whole step. `allot` therefore values a request's tokens at r + s (in units of a), s
its share of the batch's finish (`finish_shares`): 1/|C| for the requests C expected to run
longest (remaining tokens over the tokens a step emits for it at its K; within FINISH_SLACK
of the longest counts), 0 for the rest. The engine takes every request to run to its
max_tokens (EOS may end it sooner, but which request then runs longest nobody knows, and the
bound never drafts for a request sure to finish first); with requests queued, every
request's share is 1/B, the rate above.

K only changes speed: whatever K a request gets from its past, its output is exact. K does
decide which random numbers a sampled request consumes, so the engine prices seeded sampled
requests at batch size 1: their K then depends on their own history only, and they stay batch
invariant; greedy and unseeded requests get the batch-size-aware K.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .metrics import expected_emitted_tokens

# The most a request's probe may cost, as a share of a step, at the base probe interval; a
# costlier probe (a bigger batch, an expensive drafter call) waits longer (probe_interval_at).
PROBE_COST = 0.25
# The most a request's probe interval grows while its probes keep finding K = 0 (module docstring).
PROBE_BACKOFF = 16
# How much more tokens per unit of cost drafts must promise than the step without them: what
# the cost model misses (a step's time varies by a few percent with the machine's load, and
# bench/draft_cost.py's fits of one run differ as much), so drafts that only break even on
# paper, which lose as often as they win, are left out.
DRAFT_MARGIN = 0.03
# How far short of the longest running request's expected remaining steps a request may fall
# and still share the batch's finish (finish_shares): tokens per step are estimates, and
# requests admitted a step or two apart run alike.
FINISH_SLACK = 0.1
# Acceptance assumed of a drafter before any of its drafts is judged, without declared classes.
PRIOR = 0.3
# Per judged draft, the decay of the count behind a class's prior that all requests share: about
# the last 100 drafts of the class.
CLASS_DECAY = 0.99
# How many drafts the declared prior of a class counts for in the count all requests share.
CLASS_PRIOR_WEIGHT = 3.0
# How many drafts that shared count's estimate counts for in a request's own. A request's drafts
# of a class mostly differ by luck from everybody's (the EAGLE head's first drafts on open text:
# ~0.5 on every request), and a request whose estimate a few lucky drafts lifted past the
# break-even drafted where it lost: at 3, three accepted drafts in a row took a class judged
# 0.47 by all to 0.74, past the head's break-even (~0.6), and the hybrid drafted a sixth of the
# open text's steps at 0.46-0.57. At 8 a request needs about ten drafts at 0.8 to get there.
REQUEST_PRIOR_WEIGHT = 8.0


@dataclass(frozen=True)
class DraftClaim:
    """A request's bid for draft rows in one step.

    slots: the K it may draft this step; fixed: it keeps all of them (a probe, or a seeded sampled
    request, whose drafts must not depend on the batch); rows_per_draft: 2 with a CFG companion.
    """

    request_id: str
    slots: int
    fixed: bool
    rows_per_draft: int = 1


@dataclass
class _Estimate:
    """A request's decaying counts of its drafts of the class it drafts now (`accepted`,
    `judged`) and of its other classes (`others`), and its probing state."""

    accepted: float = 0.0
    judged: float = 0.0
    draft_class: int = 0
    others: dict[int, tuple[float, float]] = field(default_factory=dict)
    idle_steps: int = 0
    probing: bool = False
    backoff: int = 1  # the probe interval's multiplier, a power of two up to PROBE_BACKOFF

    def switch(self, draft_class: int) -> None:
        """Makes `draft_class` the class whose counts `accepted` and `judged` are."""
        if draft_class != self.draft_class:
            self.others[self.draft_class] = (self.accepted, self.judged)
            self.accepted, self.judged = self.others.pop(draft_class, (0.0, 0.0))
            self.draft_class = draft_class


def free(depth: int, num_requests: int) -> float:
    """The draft cost of a drafter that costs nothing (Drafter.draft_cost's default)."""
    return 0.0


def finish_shares(remaining_steps: Sequence[float]) -> list[float]:
    """Each request's share of the batch's finish when nothing waits (module docstring): 1/|C|
    for the requests C expected to run within FINISH_SLACK of the longest, 0 for the rest."""
    if not remaining_steps:
        return []
    line = max(remaining_steps) * (1 - FINISH_SLACK) - 1
    critical = [steps >= line for steps in remaining_steps]
    return [1 / sum(critical) if c else 0.0 for c in critical]


class _Gate(ABC):
    """What the chain's adaptive K and the tree gate share: the cost model's constants, the
    per-request estimates, and probing. Subclasses say what a request prefers alone at a batch
    size (_preferred) and what a probe drafts (probe_size)."""

    def __init__(self, row_cost: float, prior: float, prior_weight: float, decay: float,
                 probe_interval: int, draft_cost: Callable[[int, int], float], probe_size: int,
                 checks: tuple[tuple[str, object, bool], ...] = ()) -> None:
        for name, value, ok in (
            *checks,
            ("row_cost", row_cost, row_cost > 0),
            ("prior", prior, 0 <= prior <= 1),
            ("prior_weight", prior_weight, prior_weight > 0),
            ("decay", decay, 0 < decay <= 1),
            ("probe_interval", probe_interval, isinstance(probe_interval, int) and probe_interval >= 1),
        ):
            if not ok:
                raise ValueError(f"{name}={value!r} is invalid for {type(self).__name__}")
        self.row_cost, self.prior, self.prior_weight = row_cost, prior, prior_weight
        self.decay, self.draft_cost = decay, draft_cost
        self._intervals: dict[tuple[int, bool], int] = {}  # probe_interval_at, per (batch size, declared)
        self.probe_interval = probe_interval
        self.declared_row_cost, self.declared_draft_cost = row_cost, draft_cost
        self.probe_size = probe_size
        self._estimates: dict[str, _Estimate] = {}
        self._backoff = 1  # where a new request's backoff starts (module docstring)

    def recalibrate(self, row_cost: float, draft_cost: Callable[[int, int], float]) -> None:
        """Prices steps with these constants from now on (measured ones: spec_decode/step_costs.py);
        `declared` lookups keep the constructor's."""
        if not row_cost > 0:
            raise ValueError(f"row_cost={row_cost!r} is invalid for {type(self).__name__}: expected > 0")
        self.row_cost, self.draft_cost = row_cost, draft_cost
        self._intervals = {key: n for key, n in self._intervals.items() if key[1]}
        self._forget_tables()

    @property
    def probe_interval(self) -> int:
        return self._probe_interval

    @probe_interval.setter
    def probe_interval(self, steps: int) -> None:
        self._probe_interval = steps
        self._intervals = {}

    def _forget_tables(self) -> None:
        """Drops what was computed from the constants (subclasses' caches)."""

    def _constants(self, declared: bool) -> tuple[float, Callable[[int, int], float]]:
        return (self.declared_row_cost, self.declared_draft_cost) if declared else (self.row_cost, self.draft_cost)

    def _row_cost_at(self, batch_size: int, declared: bool = False) -> float:
        """c: the cost of one more row per request, relative to the step, at this batch size."""
        row_cost = self._constants(declared)[0]
        return batch_size * row_cost / (1 + batch_size * row_cost)

    def probe_interval_at(self, batch_size: int, declared: bool = False) -> int:
        """Steps between probes: probe_interval for a probe alone that costs at most PROBE_COST
        of a step, proportionally longer for a costlier one (a bigger batch, where a probe row
        costs more of the step; a drafter whose call is a good part of a step), so that probing
        costs every batch size and drafter about the same share of the time."""
        key = (batch_size, declared)
        if key not in self._intervals:
            reference = min(self._probe_cost(1, declared), PROBE_COST)
            self._intervals[key] = math.ceil(
                self.probe_interval * max(1.0, self._probe_cost(batch_size, declared) / reference) - 1e-9)
        return self._intervals[key]

    def _probe_cost(self, batch_size: int, declared: bool) -> float:
        """What probing every one of `batch_size` requests adds to a step, relative to the step."""
        return self._row_cost_at(batch_size, declared) * self.probe_size \
            + self._probe_draft_cost(batch_size, declared) / (1 + batch_size * self._constants(declared)[0])

    def _probe_draft_cost(self, batch_size: int, declared: bool) -> float:
        """What drafting a probe for each of `batch_size` requests costs, in units of a."""
        return self._constants(declared)[1](self.probe_size, batch_size)

    @abstractmethod
    def _preferred(self, request_id: str, batch_size: int, declared: bool) -> int:
        """Drafts the request is worth alone, from its estimate, at this batch size, priced with
        the declared constants or the current ones."""

    def num_draft_tokens(self, request_id: str, batch_size: int = 1,
                         engine_step: int | None = None, declared: bool = False,
                         draft_class: int | None = 0) -> int:
        """Drafts for the request's next step, among `batch_size` running requests, whose drafts
        would be of `draft_class` (Drafter.draft_class; None: the drafter has nothing to draft).

        engine_step: the number of that step in the engine; given, requests at 0 probe together
        on every probe_interval-th engine step, so that the probe rows of a batch share one step
        (and its padding) instead of spreading over all of them. Left out, a request probes
        after probe_interval steps of its own (what a seeded request needs to stay batch
        invariant). declared: price with the constructor's constants, not recalibrate's (a
        seeded request's K must not depend on how fast the machine happened to be)."""
        batch_size = max(1, batch_size)
        e = self._estimate(request_id, declared)
        if draft_class is not None:
            e.switch(draft_class)
        k = 0 if draft_class is None else self._preferred(request_id, batch_size, declared)
        if k > 0:
            if e.probing and not declared:  # the last probe paid
                self._backoff = max(1, self._backoff // 2)
            e.backoff = 1
        elif e.probing:  # the last probe did not pay
            e.backoff = min(2 * e.backoff, PROBE_BACKOFF)
            if not declared:
                self._backoff = min(2 * self._backoff, PROBE_BACKOFF)
        e.probing = False
        # A step with nothing to draft is not idle: a probe could not draft either.
        if k == 0 and self.probe_size > 0 and draft_class is not None:
            e.idle_steps += 1
            interval = self.probe_interval_at(batch_size, declared) * e.backoff
            due = e.idle_steps >= interval and (engine_step is None or engine_step % interval == 0)
            if due:
                e.idle_steps = 0
                e.probing = True
                return self.probe_size
        return k

    def probes_within(self, request_id: str, steps: int, batch_size: int = 1,
                      engine_step: int | None = None, declared: bool = False) -> bool:
        """Whether a request at K = 0 probes within the next `steps` calls of num_draft_tokens
        with these arguments (engine_step: that of the first), so that what a probe needs from
        the steps before it (the hidden states a learned drafter reads) can be kept from those
        steps alone."""
        e = self._estimates.get(request_id) or self._fresh(declared)
        interval = self.probe_interval_at(max(1, batch_size), declared) * e.backoff
        if engine_step is None:
            return e.idle_steps + steps >= interval
        # The j-th call from now is a shared probe step; it probes once the request has idled enough.
        return any(e.idle_steps + j + 1 >= interval for j in range((-engine_step) % interval, steps, interval))

    def _estimate(self, request_id: str, declared: bool = False) -> _Estimate:
        e = self._estimates.get(request_id)
        if e is None:
            e = self._estimates[request_id] = self._fresh(declared)
        return e

    def _fresh(self, declared: bool) -> _Estimate:
        """A new request's estimate: its probes spaced as the drafter's last probes left them
        (a batch-invariant request's as if it were alone)."""
        return _Estimate(backoff=1 if declared else self._backoff)

    @property
    def stepped_aside(self) -> bool:
        """Whether the drafter's probes have stopped paying (its backoff is at PROBE_BACKOFF): a
        new request then waits the longest before it probes."""
        return self._backoff >= PROBE_BACKOFF

    def _prompt_cost(self, base_rows: int, prompt_rows: int, padded_rows: Callable[[int], int]) -> float:
        """What the step's prompt-chunk rows cost, in units of a: left out of the rate its drafts
        are judged by (module docstring); where padding makes rows cost alike, what they add."""
        return self.row_cost * (padded_rows(base_rows) - padded_rows(base_rows - prompt_rows))

    def _worth(self, claims: list[DraftClaim], shares: Sequence[float] | None, base_tokens: float,
               ) -> tuple[float, list[float]]:
        """What the step's tokens without drafts are worth, and what one more token of each
        claim's request is, in units of a (module docstring): r + its share of the batch's finish."""
        if shares is None:
            shares = [1 / base_tokens] * len(claims)
        elif len(shares) != len(claims):
            raise ValueError(f"shares has {len(shares)} entries for {len(claims)} claims")
        return self.row_cost * base_tokens + 1, [self.row_cost + s for s in shares]

    @abstractmethod
    def expected_tokens(self, request_id: str, slots: int) -> float:
        """Tokens a step is expected to emit for the request with `slots` drafts."""

    def probing(self, request_id: str) -> bool:
        """Whether the request's last drafts came from a probe rather than from its acceptance."""
        e = self._estimates.get(request_id)
        return e is not None and e.probing

    def release(self, request_id: str) -> None:
        self._estimates.pop(request_id, None)


class AdaptiveK(_Gate):
    """draft_cost(depth, num_requests): the drafter's declared cost of one call (module
    docstring; Drafter.draft_cost or a verispec.config.DraftCost)."""

    def __init__(self, max_k: int, row_cost: float = 0.1, prior: float = PRIOR,
                 prior_weight: float = 1.0, decay: float = 0.9, probe_interval: int = 8,
                 draft_cost: Callable[[int, int], float] = free, class_priors: tuple[float, ...] = (),
                 free_classes: frozenset[int] = frozenset()) -> None:
        super().__init__(row_cost, prior, prior_weight, decay, probe_interval, draft_cost, probe_size=min(1, max_k),
                         checks=(("max_k", max_k, isinstance(max_k, int) and max_k >= 0),
                                 ("class_priors", class_priors, all(0 <= p <= 1 for p in class_priors))))
        self.max_k = max_k
        self.class_priors, self.free_classes = tuple(class_priors), frozenset(free_classes)
        self._class_counts: dict[int, tuple[float, float]] = {}  # per class, all requests' (accepted, judged)
        self._tables: dict[tuple[int, bool, bool], list[int]] = {}
        # Expected tokens per step at acceptance 0.00 .. 1.00 and k = 0 .. max_k: the tables'
        # part that no cost changes, computed once (recalibrate rebuilds the tables often).
        self._emitted = np.array([[expected_emitted_tokens(i / 100, k) for k in range(max_k + 1)]
                                  for i in range(101)])  # [101, max_k + 1]

    def _forget_tables(self) -> None:
        self._tables = {key: table for key, table in self._tables.items() if key[1]}

    def table(self, batch_size: int, declared: bool = False, free_drafts: bool = False) -> list[int]:
        """The best k for acceptance 0.00, 0.01, ..., 1.00 at this batch size (computed once per
        set of constants), for drafts that cost their calls or only their rows (free_drafts)."""
        key = (batch_size, declared, free_drafts)
        if key not in self._tables:
            row_cost, draft_cost = self._constants(declared)
            c, step = self._row_cost_at(batch_size, declared), 1 + batch_size * row_cost
            costs = [1 + c * k + (0.0 if free_drafts else draft_cost(k, batch_size) / step)
                     for k in range(self.max_k + 1)]
            # Per acceptance, the k of most tokens per unit of cost (the smallest of equals), or
            # 0 where it beats no drafts by less than DRAFT_MARGIN.
            rates = self._emitted / np.asarray(costs)
            best = rates.argmax(axis=1)
            pays = rates[np.arange(len(best)), best] >= (1 + DRAFT_MARGIN) * rates[:, 0]
            self._tables[key] = np.where(pays, best, 0).tolist()
        return self._tables[key]

    def alpha(self, request_id: str, declared: bool = False) -> float:
        """The request's acceptance estimate for drafts of the class it drafts now."""
        e = self._estimates.get(request_id, _Estimate())
        if not self.class_priors:
            return (e.accepted + self.prior * self.prior_weight) / (e.judged + self.prior_weight)
        # A class's prior says more than a generic one: a lucky draft or two must not outweigh it.
        prior = self.class_prior(e.draft_class, declared)
        return (e.accepted + prior * REQUEST_PRIOR_WEIGHT) / (e.judged + REQUEST_PRIOR_WEIGHT)

    def class_prior(self, draft_class: int, declared: bool = False) -> float:
        """Where a request's estimate for a class starts (module docstring): the declared prior
        (the last one for classes past the declared ones), or what all requests' drafts of the
        class have shown, the declared prior counting for CLASS_PRIOR_WEIGHT drafts."""
        if not self.class_priors:
            return self.prior
        start = self.class_priors[min(draft_class, len(self.class_priors) - 1)]
        if declared:
            return start
        accepted, judged = self._class_counts.get(draft_class, (0.0, 0.0))
        return (accepted + start * CLASS_PRIOR_WEIGHT) / (judged + CLASS_PRIOR_WEIGHT)

    def _preferred(self, request_id: str, batch_size: int, declared: bool) -> int:
        table = self.table(batch_size, declared, free_drafts=not self.priced(request_id))
        return table[round(self.alpha(request_id, declared) * 100)]

    def expected_tokens(self, request_id: str, slots: int) -> float:
        return expected_emitted_tokens(self.alpha(request_id), slots)

    def priced(self, request_id: str) -> bool:
        """Whether the request's drafts cost the drafter's calls: not those of a free class (the
        hybrid's lookup drafts beside its head, which the drafter's cost describes)."""
        e = self._estimates.get(request_id)
        return e is None or e.draft_class not in self.free_classes

    def allot(
        self,
        claims: list[DraftClaim],
        base_rows: int,
        base_tokens: float,
        padded_rows: Callable[[int], int],
        prompt_rows: int = 0,
        shares: Sequence[float] | None = None,
    ) -> list[int]:
        """Draft tokens per claim for one step (module docstring).

        base_rows: rows the step runs without the claims' drafts; base_tokens: tokens it emits
        without them (one per sampling request); padded_rows: rows a pass over R rows costs like;
        prompt_rows: the rows of base_rows that feed prompt chunks rather than sampled tokens;
        shares: per claim, its request's share of the batch's finish (finish_shares over the
        running requests, when nothing waits); None: every sampling request's alike.
        """
        rows = base_rows
        tokens, worth = self._worth(claims, shares, base_tokens)  # tokens: their worth, in units of a
        sunk = self._prompt_cost(base_rows, prompt_rows, padded_rows)
        depth = drafting = 0  # the fixed claims' deepest priced draft, and how many of them draft
        # (expected worth, j, rows, claim, priced: whether it costs the drafter's call) per optional draft
        gains: list[tuple[float, int, int, int, bool]] = []
        for i, claim in enumerate(claims):
            alpha, priced = self.alpha(claim.request_id), self.priced(claim.request_id)
            if claim.fixed:
                rows += claim.slots * claim.rows_per_draft
                tokens += (expected_emitted_tokens(alpha, claim.slots) - 1) * worth[i]
                if priced:
                    depth, drafting = max(depth, claim.slots), drafting + (claim.slots > 0)
            else:
                gains.extend((alpha ** j * worth[i], j, claim.rows_per_draft, i, priced)
                             for j in range(1, claim.slots + 1))
        # A request's j-th draft gains no more than its (j-1)-th and the sort is stable, so every
        # prefix of this order (of its drafts up to any depth cap) keeps a prefix of each
        # request's drafts: its first draft comes first, and makes it a drafting request.
        gains.sort(key=lambda g: -g[0])

        def rate(rows: int, tokens: float, depth: int, drafting: int) -> float:
            return tokens / (1 + self.row_cost * padded_rows(rows) - sunk + self.draft_cost(depth, drafting))

        kept: list[tuple[float, int, int, int, bool]] = []
        best_rate = rate(rows, tokens, depth, drafting) * (1 + DRAFT_MARGIN)
        # Free drafts alone too: a priced draft early in the order would charge every prefix
        # after it the drafter's call.
        free_only = [g for g in gains if not g[4]]
        for pool in (gains, free_only) if 0 < len(free_only) < len(gains) else (gains,):
            for cap in range(1, max((g[1] for g in pool), default=0) + 1):
                capped = [g for g in pool if g[1] <= cap]
                r, t, d, n = rows, tokens, depth, drafting
                for m, (gain, j, extra_rows, _, priced) in enumerate(capped, start=1):
                    r, t = r + extra_rows, t + gain
                    if priced:
                        d, n = max(d, j), n + (j == 1)
                    current = rate(r, t, d, n)
                    if current > best_rate:
                        kept, best_rate = capped[:m], current
        allotted = [claim.slots if claim.fixed else 0 for claim in claims]
        for g in kept:
            allotted[g[3]] += 1
        return allotted

    def observe(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        e = self._estimate(request_id)
        judged = num_accepted + (1 if num_accepted < num_draft else 0)
        e.accepted = self.decay * e.accepted + num_accepted
        e.judged = self.decay * e.judged + judged
        if self.class_priors:
            accepted, before = self._class_counts.get(e.draft_class, (0.0, 0.0))
            fade = CLASS_DECAY ** judged
            self._class_counts[e.draft_class] = (fade * accepted + num_accepted, fade * before + judged)


class TreeGate(_Gate):
    """Tree or nothing, per request: a tree's nodes cost rows whatever is accepted, so in a
    large batch a tree can cost more than it brings (module docstring's cost model).

    tokens: a request's expected tokens per tree step (accepted nodes + 1), from a decaying
    average over its tree steps, starting from a prior worth `prior_weight` steps: what a chain
    of `depth` drafts accepted with probability `prior` would emit. A tree of n nodes for one
    request, among B, costs 1 + c·n + d (as a chain of n drafts would; its drafting is priced
    as `depth` passes feeding about n / depth nodes each); the request drafts its tree when
    tokens beats that, nothing otherwise, and then probes with a whole tree (its first tree is a
    probe too). `allot` keeps the trees of the step's most productive requests while they raise
    the tokens per unit of the step's real cost, like AdaptiveK.allot with one bundle of rows per
    request.
    """

    def __init__(self, nodes: int, depth: int, row_cost: float = 0.1, prior: float = PRIOR,
                 prior_weight: float = 1.0, decay: float = 0.9, probe_interval: int = 8,
                 draft_cost: Callable[[int, int], float] = free) -> None:
        super().__init__(row_cost, prior, prior_weight, decay, probe_interval, draft_cost, probe_size=nodes,
                         checks=(("nodes", nodes, isinstance(nodes, int) and nodes >= 1),
                                 ("depth", depth, isinstance(depth, int) and 1 <= depth <= nodes)))
        self.nodes, self.depth = nodes, depth
        self.prior_gain = sum(prior ** j for j in range(1, depth + 1))

    def tokens(self, request_id: str) -> float:
        e = self._estimates.get(request_id, _Estimate())
        return 1 + (e.accepted + self.prior_gain * self.prior_weight) / (e.judged + self.prior_weight)

    def expected_tokens(self, request_id: str, slots: int) -> float:
        return min(self.tokens(request_id), 1 + slots)

    def _tree_draft_cost(self, num_requests: int, declared: bool = False) -> float:
        return self._constants(declared)[1](self.depth, num_requests * math.ceil(self.nodes / self.depth))

    def _probe_draft_cost(self, batch_size: int, declared: bool) -> float:
        return self._tree_draft_cost(batch_size, declared)

    def _preferred(self, request_id: str, batch_size: int, declared: bool) -> int:
        if self._unjudged(request_id):
            return self.nodes
        cost = 1 + self._row_cost_at(batch_size, declared) * self.nodes \
            + self._tree_draft_cost(batch_size, declared) / (1 + batch_size * self._constants(declared)[0])
        return self.nodes if self.tokens(request_id) > cost else 0

    def allot(
        self,
        claims: list[DraftClaim],
        base_rows: int,
        base_tokens: float,
        padded_rows: Callable[[int], int],
        prompt_rows: int = 0,
        shares: Sequence[float] | None = None,
    ) -> list[int]:
        """Nodes per claim for one step: all of its slots or none (AdaptiveK.allot's arguments)."""
        rows, drafting = base_rows, 0
        tokens, worth = self._worth(claims, shares, base_tokens)
        sunk = self._prompt_cost(base_rows, prompt_rows, padded_rows)
        optional: list[tuple[float, int, int]] = []  # (worth of the expected extra tokens, rows, claim)
        for i, claim in enumerate(claims):
            gain = (self.expected_tokens(claim.request_id, claim.slots) - 1) * worth[i]
            if claim.fixed:
                rows, tokens = rows + claim.slots * claim.rows_per_draft, tokens + gain
                drafting += claim.slots > 0
            elif claim.slots > 0:
                optional.append((gain, claim.slots * claim.rows_per_draft, i))
        optional.sort(key=lambda g: -g[0])

        def rate(rows: int, tokens: float, drafting: int) -> float:
            return tokens / (1 + self.row_cost * padded_rows(rows) - sunk + self._tree_draft_cost(drafting))

        kept, best_rate = 0, rate(rows, tokens, drafting)
        for m, (gain, extra_rows, _) in enumerate(optional, start=1):
            rows, tokens, drafting = rows + extra_rows, tokens + gain, drafting + 1
            if rate(rows, tokens, drafting) > best_rate:
                kept, best_rate = m, rate(rows, tokens, drafting)
        allotted = [claim.slots if claim.fixed else 0 for claim in claims]
        for _, _, i in optional[:kept]:
            allotted[i] = claims[i].slots
        return allotted

    def probing(self, request_id: str) -> bool:
        """Also true until the request's first tree is judged: a tree is all or nothing, and the
        prior alone never pays for a large one, so without this first probe a request would
        wait for its first regular probe to show what its trees are worth."""
        e = self._estimates.get(request_id)
        return self._unjudged(request_id) or (e is not None and e.probing)

    def _unjudged(self, request_id: str) -> bool:
        e = self._estimates.get(request_id)
        return e is None or e.judged == 0

    def observe(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        """num_draft: the tree's nodes; num_accepted: the accepted path's length."""
        if num_draft == 0:
            return
        e = self._estimate(request_id)
        e.accepted = self.decay * e.accepted + num_accepted
        e.judged = self.decay * e.judged + 1
