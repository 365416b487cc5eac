"""AdaptiveK: K follows each request's acceptance, and falls back to probing when it is poor;
TreeGate: the same for whole trees."""

from __future__ import annotations

import itertools
import math

import pytest

from verispec.config import DraftCost
from verispec.spec_decode.adaptive import (
    DRAFT_MARGIN, FINISH_SLACK, PROBE_BACKOFF, PROBE_COST, AdaptiveK, DraftClaim, TreeGate, finish_shares,
)
from verispec.spec_decode.metrics import expected_emitted_tokens


DRAFT_COSTS = [DraftCost(), DraftCost(per_call=0.05, per_request=0.01), DraftCost(per_position=0.1, per_row=0.01)]


@pytest.mark.parametrize("draft_cost", DRAFT_COSTS)
@pytest.mark.parametrize("batch", [1, 16])
def test_k_maximises_tokens_per_cost(batch: int, draft_cost: DraftCost) -> None:
    ctl = AdaptiveK(max_k=8, row_cost=0.1, draft_cost=draft_cost)
    cost = batch * 0.1 / (1 + batch * 0.1)
    ks = set()
    for alpha in (0.0, 0.3, 0.6, 0.9, 1.0):
        best = ctl.table(batch)[round(alpha * 100)]
        ks.add(best)
        rate = lambda k: expected_emitted_tokens(alpha, k) / (  # noqa: E731
            1 + cost * k + draft_cost(k, batch) / (1 + batch * 0.1))
        top = max(range(9), key=rate)
        # The best K, unless it beats no drafts by less than the margin.
        assert best == (top if rate(top) >= (1 + DRAFT_MARGIN) * rate(0) else 0)
    assert ctl.table(batch)[0] == 0 and ctl.table(batch)[100] == 8 and len(ks) > 2


def test_a_drafter_costlier_than_its_drafts_gets_no_drafts() -> None:
    free = AdaptiveK(max_k=4, row_cost=0.1)
    costly = AdaptiveK(max_k=4, row_cost=0.1, draft_cost=DraftCost(per_position=0.6))
    for ctl in (free, costly):
        _confident(ctl, "a", 1, 2)
    assert 0.45 < free.alpha("a") < 0.55
    assert free.num_draft_tokens("a") >= 2
    assert costly.num_draft_tokens("a") == 0
    # A declared cost of 0 is the free drafter's table.
    assert AdaptiveK(max_k=4, draft_cost=DraftCost()).table(16) == free.table(16)


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


def _probe_calls(ctl: AdaptiveK, request_id: str, calls: int, declared: bool = False) -> list[int]:
    """The 1-based calls of num_draft_tokens, among `calls`, that answered with drafts."""
    return [i for i in range(1, calls + 1) if ctl.num_draft_tokens(request_id, declared=declared)]


def test_a_request_at_zero_probes_again_ever_more_rarely_while_its_probes_fail() -> None:
    ctl = AdaptiveK(max_k=4, probe_interval=3)
    for _ in range(40):
        ctl.observe("a", 4, 0)
    # An interval, then 2, 4, 8 and 16 = PROBE_BACKOFF intervals apart, and no further.
    interval = ctl.probe_interval_at(1)
    assert PROBE_BACKOFF == 16
    assert _probe_calls(ctl, "a", 47 * interval) == [interval * n for n in (1, 3, 7, 15, 31, 47)]
    # A new request starts as far apart as the last probes left off; a seeded one (declared) alone.
    ctl.num_draft_tokens("c", declared=True)
    for request_id in ("b", "c"):
        for _ in range(40):
            ctl.observe(request_id, 4, 0)
    assert _probe_calls(ctl, "b", 16 * interval) == [16 * interval]
    assert _probe_calls(ctl, "c", interval, declared=True) == [interval]
    # A probe that pays ("b"'s last call was one) halves where new requests start.
    for _ in range(40):
        ctl.observe("b", 4, 4)
    assert ctl.num_draft_tokens("b") > 0
    for _ in range(40):
        ctl.observe("d", 4, 0)
    assert _probe_calls(ctl, "d", 8 * interval) == [8 * interval]
    # Drafts that pay again reset the interval.
    for _ in range(40):
        ctl.observe("a", 4, 4)
    assert ctl.num_draft_tokens("a") > 0
    for _ in range(40):
        ctl.observe("a", 4, 0)
    assert _probe_calls(ctl, "a", 3 * interval) == [interval, 3 * interval]
    ctl.release("a")
    assert ctl.num_draft_tokens("a") > 0


@pytest.mark.parametrize("kwargs", [{"max_k": -1}, {"max_k": 3, "row_cost": 0}, {"max_k": 3, "decay": 0}])
def test_bad_settings_are_named(kwargs) -> None:
    name = [k for k in kwargs if k != "max_k"] or ["max_k"]
    with pytest.raises(ValueError, match=name[-1]):
        AdaptiveK(**kwargs)


def _padded(rows: int) -> int:  # a BLAS that pads to multiples of 16 rows
    return -(-rows // 16) * 16


def _confident(ctl: AdaptiveK, request_id: str, accepted: int, judged: int) -> None:
    for _ in range(30):
        ctl.observe(request_id, judged, accepted)


def test_allot_keeps_drafts_that_fit_in_the_padding_and_trims_a_costly_cliff() -> None:
    ctl = AdaptiveK(max_k=5, row_cost=0.1)
    for i in range(16):
        _confident(ctl, f"r{i}", 1, 2)  # acceptance near 0.5
    claims = [DraftClaim(f"r{i}", 5, fixed=False) for i in range(12)]
    # 12 decode rows pad to 16: four drafts ride for free, more would cross into 32 rows.
    allotted = ctl.allot(claims, base_rows=12, base_tokens=12, padded_rows=_padded)
    assert sum(allotted) == 4 and all(k <= 1 for k in allotted)
    # 16 decode rows fill the padding: any draft costs a second block of 16 rows for ~0.5 tokens.
    claims = [DraftClaim(f"r{i}", 5, fixed=False) for i in range(16)]
    assert ctl.allot(claims, base_rows=16, base_tokens=16, padded_rows=_padded) == [0] * 16


def test_a_prompt_chunk_in_the_step_makes_no_draft_look_cheap() -> None:
    """Rows of a prompt chunk emit no token this step: counted in the step's rate, a long chunk
    made a draft accepted one time in five look worth its row. Drafts are judged against the
    decode rows alone; where padding makes rows cost alike, the chunk still takes its room."""
    ctl = AdaptiveK(max_k=4, row_cost=0.1)
    for _ in range(10):  # one draft of four accepted
        for accepted in (1, 0, 0, 0):
            ctl.observe("weak", 1, accepted)
    _confident(ctl, "strong", 9, 10)
    claims = [DraftClaim("weak", 4, fixed=False), DraftClaim("strong", 4, fixed=False)]
    plain = dict(base_tokens=4, padded_rows=lambda rows: rows)
    with_chunk = ctl.allot(claims, base_rows=4 + 500, prompt_rows=500, **plain)
    assert with_chunk == ctl.allot(claims, base_rows=4, **plain)
    assert with_chunk[0] == 0 and with_chunk[1] > 0
    # Counted in (the old rule), the chunk lets the weak request's drafts through.
    assert ctl.allot(claims, base_rows=4 + 500, **plain)[0] > 0
    # 12 decode rows pad to 16: four drafts ride free, unless a chunk of 4 took that room.
    padded = dict(base_tokens=12, padded_rows=_padded)
    free = ctl.allot(claims, base_rows=12, **padded)
    assert sum(free) == 4 and sum(ctl.allot(claims, base_rows=16, prompt_rows=4, **padded)) < 4


def test_allot_keeps_fixed_claims_and_gives_confident_requests_more() -> None:
    ctl = AdaptiveK(max_k=4, row_cost=0.1)
    _confident(ctl, "sure", 4, 4)
    _confident(ctl, "unsure", 0, 4)
    claims = [DraftClaim("sure", 4, fixed=False), DraftClaim("unsure", 4, fixed=False),
              DraftClaim("probe", 1, fixed=True), DraftClaim("cfg", 2, fixed=True, rows_per_draft=2)]
    allotted = ctl.allot(claims, base_rows=5, base_tokens=4, padded_rows=lambda rows: rows)
    assert allotted[0] == 4 and allotted[1] == 0 and allotted[2:] == [1, 2]
    # Without padding and with rows nearly free, drafts accepted for sure are all kept.
    assert ctl.allot(claims[:1], base_rows=1, base_tokens=1, padded_rows=lambda rows: rows) == [4]


@pytest.mark.parametrize("draft_cost", DRAFT_COSTS + [DraftCost(per_position=0.25), DraftCost(per_call=0.6)])
@pytest.mark.parametrize("padded", [_padded, lambda rows: rows])
def test_allot_maximises_expected_tokens_per_cost(padded, draft_cost: DraftCost) -> None:
    """Against every allotment, each priced with its rows, its deepest draft and how many
    requests draft."""
    ctl = AdaptiveK(max_k=3, row_cost=0.2, draft_cost=draft_cost)
    alphas = {"a": (19, 20), "b": (6, 10), "c": (6, 10), "d": (2, 10)}
    for rid, (acc, judged) in alphas.items():
        _confident(ctl, rid, acc, judged)
    claims = [DraftClaim(rid, 3, fixed=False) for rid in alphas]
    allotted = ctl.allot(claims, base_rows=4, base_tokens=4, padded_rows=padded)

    def rate(ks: tuple[int, ...]) -> float:
        tokens = sum(expected_emitted_tokens(ctl.alpha(c.request_id), k) for c, k in zip(claims, ks))
        return tokens / (1 + 0.2 * padded(4 + sum(ks)) + draft_cost(max(ks), sum(k > 0 for k in ks)))

    best = max(rate(ks) for ks in itertools.product(range(4), repeat=len(claims)))
    assert rate(tuple(allotted)) >= best - 1e-12


def test_finish_shares_split_the_finish_among_the_longest() -> None:
    assert finish_shares([]) == []
    assert finish_shares([40.0]) == [1.0]
    # Within FINISH_SLACK (and a step) of the longest, requests share the finish alike.
    near = 100 * (1 - FINISH_SLACK) - 0.5
    assert finish_shares([100.0, near, 30.0, 99.0]) == [1 / 3, 1 / 3, 0.0, 1 / 3]
    assert finish_shares([5.0, 5.0]) == [0.5, 0.5]


def test_with_nothing_waiting_only_drafts_on_the_critical_path_pay() -> None:
    """A closed batch runs as long as its longest request: accepted drafts of a request that
    finishes earlier save only its own later rows, so they never pay for the rows they take;
    those of the longest save whole steps, and pay as they would alone. With requests waiting
    (shares None) every token counts alike, as with equal shares."""
    ctl = AdaptiveK(max_k=4, row_cost=0.1)
    _confident(ctl, "copy", 19, 20)
    _confident(ctl, "open", 5, 10)
    claims = [DraftClaim("copy", 4, fixed=False), DraftClaim("open", 4, fixed=False)]
    plain = dict(base_rows=16, base_tokens=16, padded_rows=lambda rows: rows)
    queued = ctl.allot(claims, **plain)
    assert queued == ctl.allot(claims, **plain, shares=[1 / 16, 1 / 16]) and queued[0] > 0
    # The copying request is expected to finish first: its drafts stop; the open one's pay.
    critical = ctl.allot(claims, **plain, shares=[0.0, 1.0])
    assert critical[0] == 0 and critical[1] > queued[1]
    # Off the path altogether (a request that does not draft runs longest): nothing drafts.
    assert ctl.allot(claims, **plain, shares=[0.0, 0.0]) == [0, 0]
    # A fixed claim (a probe) keeps its drafts whatever they are worth.
    probe = DraftClaim("open", 1, fixed=True)
    assert ctl.allot([claims[0], probe], **plain, shares=[0.0, 0.0]) == [0, 1]
    with pytest.raises(ValueError, match="shares"):
        ctl.allot(claims, **plain, shares=[1.0])
    gate = TreeGate(nodes=4, depth=2, row_cost=0.1)
    _productive(gate, "copy", 3)
    tree_claims = [DraftClaim("copy", 4, fixed=False)]
    assert gate.allot(tree_claims, **plain) == [4]
    assert gate.allot(tree_claims, **plain, shares=[0.0]) == [0]


def test_allot_prices_the_depth_of_a_drafter_that_runs_a_pass_per_position() -> None:
    """Free, the confident request drafts deepest; when each draft position costs a pass, the
    step is better spent on everybody's first draft."""
    for cost, expected in ((DraftCost(), [3, 2, 2]), (DraftCost(per_position=0.4), [1, 1, 1])):
        ctl = AdaptiveK(max_k=3, row_cost=0.05, draft_cost=cost)
        for rid, (acc, judged) in {"a": (19, 20), "b": (1, 2), "c": (1, 2)}.items():
            _confident(ctl, rid, acc, judged)
        claims = [DraftClaim(rid, 3, fixed=False) for rid in "abc"]
        assert ctl.allot(claims, base_rows=3, base_tokens=3, padded_rows=lambda rows: rows) == expected


def test_allot_charges_fixed_claims_their_drafting() -> None:
    """A fixed claim already pays for a drafting call: others' drafts up to its depth are
    cheaper than the call alone would make them."""
    cost = DraftCost(per_call=1.0)
    ctl = AdaptiveK(max_k=2, row_cost=0.05, draft_cost=cost)
    _confident(ctl, "r", 1, 2)  # acceptance near 0.5
    claim = DraftClaim("r", 2, fixed=False)
    assert ctl.allot([claim], base_rows=1, base_tokens=1, padded_rows=lambda rows: rows) == [0]
    probe = DraftClaim("probe", 2, fixed=True)
    assert ctl.allot([claim, probe], base_rows=2, base_tokens=2, padded_rows=lambda rows: rows) == [2, 2]


def test_costly_probes_wait_longer() -> None:
    """A probe that costs more than PROBE_COST of a step waits in proportion, so that probing
    with an expensive drafter costs about what probing with a cheap one does."""
    cheap = AdaptiveK(max_k=4, row_cost=0.1, probe_interval=8)
    costly = AdaptiveK(max_k=4, row_cost=0.1, probe_interval=8, draft_cost=DraftCost(per_call=0.6, per_position=0.3))
    row = 0.1 / 1.1  # a probe's row, relative to a one-row step
    probe_cost = row + 0.9 / 1.1  # its row and its call
    assert cheap.probe_interval_at(1) == math.ceil(8 * max(1.0, row / PROBE_COST)) < 12
    assert costly.probe_interval_at(1) == math.ceil(8 * probe_cost / PROBE_COST)
    # Recalibrated to a free drafter, the costly gate probes as the cheap one; declared
    # lookups keep the constructor's constants.
    costly.recalibrate(0.1, DraftCost())
    assert costly.probe_interval_at(1) == cheap.probe_interval_at(1)
    assert costly.probe_interval_at(1, declared=True) == math.ceil(8 * probe_cost / PROBE_COST)


def test_probes_are_flagged_spaced_by_batch_cost_and_shared_by_the_batch() -> None:
    ctl = AdaptiveK(max_k=4, row_cost=0.1, probe_interval=4)
    intervals = [ctl.probe_interval_at(b) for b in (1, 2, 4, 16)]
    assert intervals[0] == math.ceil(4 * max(1.0, (0.1 / 1.1) / PROBE_COST)) and intervals == sorted(intervals)
    assert intervals[-1] > intervals[0] * 5
    for rid in ("a", "b"):
        _confident(ctl, rid, 0, 4)
    ctl.num_draft_tokens("a", 2, engine_step=1)  # "a" has idled one step longer than "b"
    probes = {rid: [] for rid in ("a", "b")}
    for step in range(2, 80):
        for rid in probes:
            if ctl.num_draft_tokens(rid, 2, engine_step=step) == 1:
                assert ctl.probing(rid)
                probes[rid].append(step)
            else:
                assert not ctl.probing(rid)
    # Each probes on the first shared step (a multiple of the interval) after idling an interval,
    # then 2x and 4x as far apart: "b", a step behind, waits for the next shared step, and the
    # two probe together from then on.
    i = ctl.probe_interval_at(2)
    assert PROBE_BACKOFF >= 16 and 8 * i < 80 < 16 * i
    assert probes["a"] == [i, 4 * i, 8 * i] and probes["b"] == [2 * i, 4 * i, 8 * i]


def _productive(gate: TreeGate, request_id: str, accepted: int) -> None:
    for _ in range(40):
        gate.observe(request_id, gate.nodes, accepted)


def test_a_tree_pays_alone_when_it_is_accepted_and_not_in_a_big_batch() -> None:
    gate = TreeGate(nodes=6, depth=3, row_cost=0.1)
    _productive(gate, "good", 3)  # 4 tokens per step
    _productive(gate, "poor", 0)
    assert gate.tokens("good") == pytest.approx(4, abs=0.3) and gate.tokens("poor") < 1.1  # the prior weighs in
    assert gate.num_draft_tokens("good", 1) == 6
    assert gate.num_draft_tokens("good", 64) == 0  # 6 rows per request nearly six steps' cost there
    assert gate.num_draft_tokens("poor", 1) == 0
    # A fresh request starts from the prior: a chain of depth 3 accepted with probability 0.3.
    assert gate.tokens("new") == pytest.approx(1 + 0.3 + 0.09 + 0.027)


def test_a_request_without_a_tree_probes_with_a_whole_tree() -> None:
    gate = TreeGate(nodes=5, depth=2, probe_interval=3)
    _productive(gate, "a", 0)
    # Five probe rows cost 5 x 0.1 / 1.1 = 0.45 of a step: 3 x 0.45 / PROBE_COST steps apart.
    i = gate.probe_interval_at(1)
    assert i == math.ceil(3 * (0.5 / 1.1) / PROBE_COST)
    assert [gate.num_draft_tokens("a") for _ in range(3 * i)] == [0] * (i - 1) + [5] + [0] * (2 * i - 1) + [5]
    assert gate.probing("a")
    # Before its first tree is judged a request probes, whatever the batch.
    assert gate.num_draft_tokens("fresh", 64) == 5 and gate.probing("fresh")


@pytest.mark.parametrize("draft_cost", DRAFT_COSTS)
def test_tree_allot_keeps_whole_trees_and_maximises_tokens_per_cost(draft_cost: DraftCost) -> None:
    """Against every subset of the optional claims: the trees kept are the best subset's."""
    gate = TreeGate(nodes=4, depth=2, row_cost=0.1, draft_cost=draft_cost)
    for i, accepted in enumerate([0, 1, 2, 3, 0, 2, 1]):
        _productive(gate, str(i), accepted)
    claims = [DraftClaim(str(i), 4, fixed=i == 4) for i in range(7)]
    allotted = gate.allot(claims, base_rows=7, base_tokens=7, padded_rows=_padded)
    assert all(a in (0, 4) for a in allotted) and allotted[4] == 4

    def rate(kept) -> float:
        drafting = [i for i in range(7) if i in kept or claims[i].fixed]
        tokens = 7 + sum(gate.tokens(str(i)) - 1 for i in drafting)
        cost = 1 + 0.1 * _padded(7 + 4 * len(drafting)) + draft_cost(2, 2 * len(drafting))
        return tokens / cost

    optional = [i for i in range(7) if not claims[i].fixed]
    best = max(rate(set(c)) for n in range(8) for c in itertools.combinations(optional, n))
    assert rate({i for i, a in enumerate(allotted) if a}) == pytest.approx(best)
    # Rows priced ever steeper: only the probe's tree stays.
    assert gate.allot(claims, 7, 7, lambda rows: rows ** 3) == [0, 0, 0, 0, 4, 0, 0]


@pytest.mark.parametrize("kwargs", [{"nodes": 0, "depth": 1}, {"nodes": 3, "depth": 4}, {"nodes": 3, "depth": 2, "decay": 2}])
def test_bad_tree_gate_settings_are_named(kwargs) -> None:
    name = "decay" if "decay" in kwargs else "nodes" if kwargs["nodes"] == 0 else "depth"
    with pytest.raises(ValueError, match=f"{name}=.* is invalid for TreeGate"):
        TreeGate(**kwargs)


CLASSES = (0.0, 0.1, 0.4, 0.9)  # as a lookup declares them: by match length, 0 = no match


def test_a_request_drafts_as_soon_as_its_context_turns_to_a_class_that_pays() -> None:
    ctl = AdaptiveK(max_k=4, row_cost=0.3, class_priors=CLASSES)
    assert ctl.num_draft_tokens("a", draft_class=1) == 0  # a 1-token match: mostly chance
    assert ctl.num_draft_tokens("a", draft_class=3) >= 3  # a long match: copied text, at once
    for _ in range(5):
        ctl.observe("a", 4, 0)  # this request's long matches fail
    assert ctl.num_draft_tokens("a", draft_class=3) == 0
    # Each class keeps its own counts: the failures were class 3's, not class 2's.
    assert ctl.num_draft_tokens("a", draft_class=2) == ctl.num_draft_tokens("fresh", draft_class=2) > 0
    assert ctl.num_draft_tokens("a", draft_class=3) == 0
    # Nothing to draft (no match) is not idling: no probe comes of it.
    assert all(ctl.num_draft_tokens("b", draft_class=None) == 0 for _ in range(10 * ctl.probe_interval))


def test_class_priors_learn_from_every_request_and_seeded_requests_keep_the_declared_ones() -> None:
    ctl = AdaptiveK(max_k=4, row_cost=0.3, class_priors=CLASSES)
    assert ctl.class_prior(3) == ctl.class_prior(3, declared=True) == 0.9
    for i in range(20):
        ctl.num_draft_tokens(f"r{i}", draft_class=3)
        ctl.observe(f"r{i}", 4, 0)
    assert ctl.class_prior(3) < 0.2 and ctl.class_prior(3, declared=True) == 0.9
    assert ctl.num_draft_tokens("new", draft_class=3) == 0
    assert ctl.num_draft_tokens("seeded", declared=True, draft_class=3) >= 3
    assert ctl.class_prior(7, declared=True) == 0.9  # past the declared classes: the last one's


def test_a_free_class_is_priced_by_its_rows_alone() -> None:
    """The hybrid's lookup drafts ride beside a head whose calls cost the drafter's draft_cost."""
    costly = DraftCost(per_call=2.0)
    ctl = AdaptiveK(max_k=4, row_cost=0.1, draft_cost=costly, class_priors=(0.6, 0.6), free_classes=frozenset({1}))
    assert ctl.num_draft_tokens("head", draft_class=0) == 0
    assert ctl.num_draft_tokens("lookup", draft_class=1) == AdaptiveK(max_k=4, row_cost=0.1).table(1)[60] > 0
    assert ctl.priced("head") and not ctl.priced("lookup")
    claims = [DraftClaim("head", 4, fixed=False), DraftClaim("lookup", 4, fixed=False)]
    allotted = ctl.allot(claims, base_rows=2, base_tokens=2, padded_rows=lambda rows: rows)
    assert allotted[0] == 0 and allotted[1] > 0
