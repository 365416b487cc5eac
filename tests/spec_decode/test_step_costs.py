"""StepCosts: the cost model's constants fitted to step times; CostCache: kept between runs and
distrusted when damaged; CostLearner through the engine: learned prices for greedy and unseeded
requests, the declared ones for seeded requests."""

from __future__ import annotations

import json
import logging
import random

import pytest

from tests.tiny import run_all, tiny_engine, tiny_model
from verispec import SamplingParams
from verispec.config import DraftCost
from verispec.engine import engine as engine_module
from verispec.files import seal
from verispec.runtime import row_cost as row_cost_module
from verispec.runtime.row_cost import measure_row_cost
from verispec.spec_decode.adaptive import AdaptiveK
from verispec.spec_decode.cost_cache import CostCache
from verispec.spec_decode.cost_learner import CostLearner, batch_class
from verispec.spec_decode.ngram import NgramDrafter
from verispec.spec_decode.step_costs import LearnedCosts, StepCosts

EAGLE_LIKE = DraftCost(per_call=0.5, per_request=0.05, per_position=0.1, per_row=0.02)


def _passes(costs: StepCosts, a: float, b: float, rows: list[int], n: int, noise: float = 0.02, seed: int = 0):
    rng = random.Random(seed)
    for i in range(n):
        r = rows[i % len(rows)]
        costs.observe_pass(r, (a + b * r) * (1 + rng.uniform(-noise, noise)))


def test_the_row_cost_is_fitted_from_passes_of_several_row_counts() -> None:
    costs = StepCosts(row_cost=0.3)
    _passes(costs, a=2.5e-3, b=1.7e-3, rows=[1, 2, 1, 6], n=200)
    assert costs.learned.row_cost == pytest.approx(0.68, rel=0.05)
    assert costs.fixed_seconds == pytest.approx(2.5e-3, rel=0.05)


def test_one_row_count_leaves_the_prior_row_cost() -> None:
    costs = StepCosts(row_cost=0.3)
    assert costs.learned == LearnedCosts(0.3, 0.0, 0.0)  # nothing seen: the prior (no declared draft cost)
    _passes(costs, a=2.5e-3, b=1.7e-3, rows=[1], n=50)
    assert costs.learned.row_cost == 0.3
    # a + b at one row is all the passes say; the prior splits it.
    assert costs.fixed_seconds * 1.3 == pytest.approx(4.2e-3, rel=0.03)


def test_the_fit_follows_a_machine_that_changes_and_shrugs_off_a_pause() -> None:
    costs = StepCosts(row_cost=0.3)
    _passes(costs, a=2e-3, b=0.4e-3, rows=[1, 3], n=100)
    costs.observe_pass(1, 1.0)  # a 1 s pause of the machine
    assert costs.learned.row_cost == pytest.approx(0.2, rel=0.25)
    _passes(costs, a=2e-3, b=1.4e-3, rows=[1, 3], n=500)  # each row now costs 3.5x
    assert costs.learned.row_cost == pytest.approx(0.7, rel=0.05)


def test_draft_scales_are_fitted_to_calls() -> None:
    costs = StepCosts(row_cost=0.3, draft_cost=EAGLE_LIKE)
    a = 2.5e-3
    _passes(costs, a=a, b=0.75e-3, rows=[1, 2], n=50)
    rng = random.Random(1)
    for i in range(200):
        depth, n = 1 + i % 4, 1 + (i // 4) % 3
        first = EAGLE_LIKE(1, n)
        truth = 1.2 * first + 3.0 * (EAGLE_LIKE(depth, n) - first)  # a costlier position than declared
        costs.observe_call(depth, n, truth * costs.fixed_seconds * (1 + rng.uniform(-0.02, 0.02)))
    learned = costs.learned
    assert learned.first_scale == pytest.approx(1.2, rel=0.05)
    assert learned.rest_scale == pytest.approx(3.0, rel=0.05)
    row_cost, draft_cost = costs.snapshot()
    assert draft_cost(4, 2) == pytest.approx(1.2 * EAGLE_LIKE(1, 2) + 3.0 * (EAGLE_LIKE(4, 2) - EAGLE_LIKE(1, 2)),
                                             rel=0.05)
    assert draft_cost(0, 2) == draft_cost(3, 0) == 0.0


def test_depths_never_drafted_keep_the_prior_price_per_position() -> None:
    costs = StepCosts(row_cost=0.3, draft_cost=EAGLE_LIKE)
    _passes(costs, a=2.5e-3, b=0.75e-3, rows=[1, 2], n=50)
    for _ in range(100):
        costs.observe_call(1, 1, 2.0 * EAGLE_LIKE(1, 1) * costs.fixed_seconds)
    assert costs.learned.first_scale == pytest.approx(2.0, rel=0.05)
    assert costs.learned.rest_scale == pytest.approx(1.0)


def test_a_drafter_that_declares_nothing_is_learned_from_zero() -> None:
    costs = StepCosts(row_cost=0.3, draft_cost=DraftCost())
    assert costs.snapshot()[1](4, 1) == 0.0
    _passes(costs, a=2e-3, b=0.6e-3, rows=[1, 2], n=50)
    for i in range(100):
        depth = 1 + i % 4
        costs.observe_call(depth, 1, (0.4 + 0.2 * depth) * costs.fixed_seconds)
    assert costs.snapshot()[1](4, 1) == pytest.approx(1.2, rel=0.05)


@pytest.mark.parametrize("kwargs", [dict(row_cost=0), dict(row_cost=0.3, prior_weight=0),
                                    dict(row_cost=0.3, decay=1.5)])
def test_bad_settings_are_named(kwargs) -> None:
    with pytest.raises(ValueError, match="StepCosts"):
        StepCosts(**kwargs)


def test_the_cache_keeps_the_fit_per_key(tmp_path) -> None:
    path = tmp_path / "costs.json"
    CostCache("machine A", path).save(LearnedCosts(0.65, 1.2, 3.1))
    CostCache("machine B", path).save(LearnedCosts(0.3, 1.0, 0.9))
    assert CostCache("machine A", path).load() == LearnedCosts(0.65, 1.2, 3.1)
    assert CostCache("machine B", path).load() == LearnedCosts(0.3, 1.0, 0.9)
    assert CostCache("machine C", path).load() is None


@pytest.mark.parametrize("damage", ["flip", "garbage", "range", "format"])
def test_a_damaged_cache_is_ignored_with_a_logged_line(tmp_path, caplog, damage: str) -> None:
    path = tmp_path / "costs.json"
    cache = CostCache("machine A", path)
    cache.save(LearnedCosts(0.65, 1.2, 3.1))
    if damage == "garbage":
        path.write_bytes(b"\x00\xff not json")
    else:
        saved = json.loads(path.read_text())
        entry = saved[cache.key]
        if damage == "flip":  # one value changed, the file's checksum not
            entry["row_cost"] = 0.066
        elif damage == "range":  # checksum right, value impossible
            entry["row_cost"] = -1.0
        else:
            entry["format"] = 999
        path.write_text(json.dumps(saved))
        if damage != "flip":
            seal(path)
    with caplog.at_level(logging.WARNING):
        assert cache.load() is None
    assert "cost cache" in caplog.text
    cache.save(LearnedCosts(0.5, 1.0, 1.0))  # and it is rewritten whole
    assert cache.load() == LearnedCosts(0.5, 1.0, 1.0)


def test_the_learner_reprices_the_gate_and_saves_the_fit(tmp_path) -> None:
    gate = AdaptiveK(max_k=4, row_cost=0.3, draft_cost=EAGLE_LIKE)
    cache = CostCache("k", tmp_path / "c.json")
    learner = CostLearner(gate, 0.3, EAGLE_LIKE, cache, every=8, first_save=32)
    declared = gate.table(1, declared=True)
    for i in range(40):
        learner.observe_pass(1 + i % 2, 2e-3 + 2e-3 * (1 + i % 2))  # each row costs a whole a
        learner.observe_call(1, 1, 3 * EAGLE_LIKE(1, 1) * 2e-3)
    assert gate.row_cost == pytest.approx(1.0, rel=0.1)
    assert gate.table(1) != declared and gate.table(1, declared=True) == declared
    assert all(k <= d for k, d in zip(gate.table(1), declared))  # dearer rows and calls: fewer drafts
    saved = cache.batch(1).load()
    assert saved is not None and saved.row_cost == pytest.approx(1.0, rel=0.1)
    # A new learner with the same key starts where this one stopped.
    again = AdaptiveK(max_k=4, row_cost=0.3, draft_cost=EAGLE_LIKE)
    CostLearner(again, 0.3, EAGLE_LIKE, cache)
    assert again.row_cost == saved.row_cost


def test_each_batch_class_has_its_own_fit(tmp_path) -> None:
    # Rows cost more per row in a batch of 16 than a lone request's verify rows do (measured on a
    # Skylake-SP Xeon: ~1.7 ms against ~1.0 ms in an 8.5 ms step); one line through both
    # overpriced batch 1's rows, and the cache carried that into the next batch-1 run.
    gate = AdaptiveK(max_k=4, row_cost=0.3, draft_cost=EAGLE_LIKE)
    cache = CostCache("k", tmp_path / "c.json")
    learner = CostLearner(gate, 0.3, EAGLE_LIKE, cache, every=8, first_save=32, warmup=0)
    for i in range(40):
        learner.observe_pass(1 + i % 5, 8e-3 + 1e-3 * (1 + i % 5), requests=1)
    assert learner.batch == 1 and gate.row_cost == pytest.approx(0.125, rel=0.15)
    for i in range(40):
        rows = 16 + 16 * (i % 3)
        learner.observe_pass(rows, 8e-3 + 2e-3 * rows, requests=16 + i % 3)
    assert learner.batch == 16 and gate.row_cost == pytest.approx(0.25, rel=0.2)
    learner.observe_pass(3, 11e-3, requests=1)  # back to one request: its own fit at once
    assert gate.row_cost == pytest.approx(0.125, rel=0.15)
    assert cache.batch(1).load().row_cost == pytest.approx(0.125, rel=0.15)
    assert cache.batch(16).load().row_cost == pytest.approx(0.25, rel=0.2)
    again = AdaptiveK(max_k=4, row_cost=0.3, draft_cost=EAGLE_LIKE)
    CostLearner(again, 0.3, EAGLE_LIKE, cache)  # starts at batch 1: batch 1's fit
    assert again.row_cost == pytest.approx(0.125, rel=0.15)


def test_batch_classes_are_powers_of_two() -> None:
    assert [batch_class(n) for n in (0, 1, 2, 3, 4, 7, 8, 15, 16, 17, 33)] == [1, 1, 2, 2, 4, 4, 8, 8, 16, 16, 32]


def _repetitive_prompts():
    return [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 7, 8, 9, 7, 8]]


def test_the_engine_learns_costs_and_seeded_requests_keep_the_declared_prices(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("VERISPEC_LEARN_COSTS", "1")
    model = tiny_model(3, vocab=16, scale=4.0)

    def run(seed: int | None, learned: LearnedCosts | None, temperature: float = 1.0):
        if learned is not None:  # as if this machine had learned very different prices, kept
            cache = tiny_engine(model, NgramDrafter(1, 3, 4), k=4).costs.cache
            for batch in (1, 2):
                cache.batch(batch).save(learned)
        engine = tiny_engine(model, NgramDrafter(1, 3, 4), k=4)
        if learned is not None:
            engine.costs.every = 10**9
        for i, prompt in enumerate(_repetitive_prompts()):
            engine.add_request(prompt, SamplingParams(temperature=temperature, max_tokens=40,
                                                      seed=None if seed is None else seed + i))
        done = run_all(engine)
        return engine, [done[rid].token_ids for rid in sorted(done)], sum(
            out.stats.num_draft_tokens for out in done.values())

    engine, _, _ = run(None, None)
    assert engine.costs is not None and engine.costs.observed_passes > 10
    # Seeded: the same draws whatever the machine learned (K from the declared constants).
    _, cheap, cheap_drafts = run(5, LearnedCosts(0.01, 0.0, 0.0))
    _, dear, dear_drafts = run(5, LearnedCosts(50.0, 50.0, 50.0))
    assert cheap == dear and cheap_drafts == dear_drafts > 0
    # Greedy: priced with what was learned, exact either way; dear prices leave only probes.
    _, cheap, cheap_drafts = run(None, LearnedCosts(0.01, 0.0, 0.0), temperature=0.0)
    _, dear, dear_drafts = run(None, LearnedCosts(50.0, 50.0, 50.0), temperature=0.0)
    assert cheap == dear
    assert cheap_drafts > 4 * max(dear_drafts, 1)
    monkeypatch.setenv("VERISPEC_LEARN_COSTS", "0")  # the switch the test suite runs under
    assert tiny_engine(model, NgramDrafter(1, 3, 4), k=4).costs is None


def test_a_quantized_model_learns_its_costs_per_kernel(tmp_path, monkeypatch) -> None:
    # What a verify row costs depends on the kernel (avx512bw's extra row is about half avx2's),
    # so a fit learned under one kernel must not price another's steps.
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("VERISPEC_LEARN_COSTS", "1")
    model = tiny_model(3, vocab=16, quantization=(4, 32))
    keys = {}
    for kernel in ("avx2", "generic"):
        monkeypatch.setattr(engine_module, "default_kernel", lambda kernel=kernel: kernel)
        keys[kernel] = tiny_engine(model, NgramDrafter(1, 3, 4), k=4).costs.cache.key
    assert keys["avx2"] != keys["generic"]
    monkeypatch.setattr(engine_module, "default_kernel", lambda: "avx2")
    assert tiny_engine(model, NgramDrafter(1, 3, 4), k=4).costs.cache.key == keys["avx2"]


def test_a_fresh_engine_prices_rows_as_passes_timed_at_load(tmp_path, monkeypatch) -> None:
    # The declared row cost is a guess across CPUs (0.6 for 4-bit weights, 0.16 measured on a
    # Skylake-SP Xeon): where it is too dear the gate never drafts, so passes of more than one
    # row never come to correct it. A fresh engine times its own; a later one keeps that.
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("VERISPEC_LEARN_COSTS", "1")
    model = tiny_model(3, vocab=16)
    measured = []
    monkeypatch.setattr(engine_module, "measure_row_cost", lambda *args: measured.append(args) or 0.05)
    engine = tiny_engine(model, NgramDrafter(1, 3, 4), k=4)
    assert len(measured) == 1 and engine.adaptive.row_cost == pytest.approx(0.05)
    assert engine.adaptive.table(1) != engine.adaptive.table(1, declared=True)  # cheaper rows: more drafts
    assert engine.costs.cache.batch(1).load().row_cost == pytest.approx(0.05)
    again = tiny_engine(model, NgramDrafter(1, 3, 4), k=4)
    assert len(measured) == 1 and again.adaptive.row_cost == pytest.approx(0.05)
    # Timings that do not fit (None) leave the declared price.
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path / "other"))
    monkeypatch.setattr(engine_module, "measure_row_cost", lambda *args: None)
    unmeasured = tiny_engine(model, NgramDrafter(1, 3, 4), k=4)
    assert unmeasured.adaptive.row_cost == unmeasured.adaptive.declared_row_cost


@pytest.mark.parametrize("quantization", [None, (4, 32)])
def test_the_row_cost_is_timed_on_a_scratch_sequence_that_is_freed(quantization, monkeypatch) -> None:
    model = tiny_model(3, vocab=16, quantization=quantization)
    engine = tiny_engine(model)
    reference = tiny_engine(model)
    for e in (engine, reference):
        e.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=12))
    expected = run_all(reference)
    engine.step()  # a request mid-flight: its cache must come through untouched
    free = engine.blocks.num_free_blocks
    clock = [0.0]
    runner_forward = engine.runner.forward

    def forward(feeds):  # as if a pass took 8 ms and 1 ms a row
        clock[0] += 8e-3 + 1e-3 * sum(len(f.token_ids) for f in feeds)
        return runner_forward(feeds)

    monkeypatch.setattr(engine.runner, "forward", forward)
    monkeypatch.setattr(row_cost_module.time, "perf_counter", lambda: clock[0])
    row_cost = measure_row_cost(engine.runner, engine.blocks, model.config.vocab_size, model.padded_rows)
    assert row_cost == pytest.approx(1 / 8)
    assert engine.blocks.num_free_blocks == free
    monkeypatch.undo()
    assert [o.token_ids for o in run_all(engine).values()] == [o.token_ids for o in expected.values()]
    full = tiny_engine(model, num_blocks=4)  # no room for the scratch sequence: nothing timed
    assert measure_row_cost(full.runner, full.blocks, model.config.vocab_size, model.padded_rows) is None
