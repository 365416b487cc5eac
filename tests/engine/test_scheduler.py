"""The scheduler over a real BlockManager, without a model: budgets, chunking, preemption, CFG."""

from __future__ import annotations

import random

from verispec.config import CacheConfig, EngineConfig
from verispec.runtime.kv_cache import BlockManager
from verispec.engine.request import FinishReason, Request
from verispec.engine.scheduler import Scheduler
from verispec.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, budget=32, max_seqs=8, max_len=4096):
    config = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                          cache=CacheConfig(block_size, num_blocks))
    blocks = BlockManager(num_blocks, block_size)
    return Scheduler(config, blocks), blocks


def request(i: int, prompt_len: int, k: int = 0, max_tokens: int = 100, uncond: list[int] | None = None) -> Request:
    return Request(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), seed=i,
                   arrival=i, num_speculative_tokens=k, max_speculative_tokens=k, uncond_token_ids=uncond)


def emit(sched: Scheduler, accepted=lambda plan: 0) -> list:
    """One step: every sampling request accepts `accepted(plan)` drafts and emits that + 1 tokens."""
    out = sched.schedule()
    for plan in out.scheduled:
        n = min(accepted(plan), plan.num_draft_slots) if plan.samples else 0
        sched.commit(plan, n)
        if plan.samples:
            plan.request.output_token_ids.extend([7] * (n + 1))
    return out.scheduled


def test_long_prompt_is_prefilled_in_chunks_and_samples_once_complete() -> None:
    sched, blocks = make(budget=16)
    r = request(0, 40)
    sched.add(r)
    fed = []
    while not r.output_token_ids:
        (plan,) = emit(sched)
        fed.append((plan.num_new[0], plan.samples))
    assert fed == [(16, False), (16, False), (8, True)]
    assert r.seqs[0].num_computed == 40 and blocks.num_tokens("r0") == 40


def test_decode_reserves_k_slots_and_rolls_back_rejected() -> None:
    sched, blocks = make()
    r = request(0, 5, k=4)
    sched.add(r)
    (plan,) = emit(sched, accepted=lambda p: 2)
    assert plan.samples and plan.num_new == [5] and plan.num_draft_slots == 4
    assert r.seqs[0].num_computed == 7 and blocks.num_tokens("r0") == 7  # 5 fed + 2 accepted
    assert len(r.output_token_ids) == 3
    (plan,) = emit(sched, accepted=lambda p: 0)
    assert plan.num_new == [1] and blocks.num_tokens("r0") == 8


def test_k_is_capped_by_remaining_tokens() -> None:
    sched, _ = make()
    r = request(0, 5, k=6, max_tokens=3)
    sched.add(r)
    (plan,) = emit(sched)
    assert plan.num_draft_slots == 2


def test_newest_is_preempted_when_blocks_run_out_and_resumes_later() -> None:
    sched, blocks = make(num_blocks=6, block_size=4, budget=64)
    a, b = request(0, 8, max_tokens=12), request(1, 8, max_tokens=12)
    sched.add(a)
    sched.add(b)
    emit(sched)  # both prefilled: 3 blocks each (9 slots after the first token is pending)
    preempted = []
    for _ in range(10):
        out = sched.schedule()
        preempted += out.preempted
        for plan in out.scheduled:
            sched.commit(plan, 0)
            plan.request.output_token_ids.append(7)
            if plan.request.remaining_tokens == 0:
                sched.finish(plan.request, FinishReason.LENGTH)
    assert preempted and preempted[0] is b
    while sched.has_unfinished:
        for plan in emit(sched):
            if plan.request.remaining_tokens <= 0:
                sched.finish(plan.request, FinishReason.LENGTH)
    assert b.finished and len(b.output_token_ids) >= 12
    assert blocks.num_free_blocks == 6


def test_request_larger_than_the_cache_fails_without_blocking_others() -> None:
    sched, blocks = make(num_blocks=4, block_size=4)
    huge, small = request(0, 30), request(1, 3, max_tokens=4)
    sched.add(huge)
    sched.add(small)
    out = sched.schedule()
    assert out.failed == [huge] and huge.finish_reason is FinishReason.ERROR
    assert [p.request for p in out.scheduled] == [small]


def test_cfg_sequences_move_together() -> None:
    sched, blocks = make(budget=10)
    r = request(0, 12, k=2, uncond=[5, 6, 7])
    sched.add(r)
    plans = []
    while not r.output_token_ids:
        (plan,) = emit(sched)
        plans.append(plan)
        if not plan.samples:
            assert all(s.num_computed < r.num_tokens(s) for s in r.seqs)
    final = plans[-1]
    assert final.samples and len(final.num_new) == 2
    assert blocks.has("r0#uncond")
    sched.finish(r, FinishReason.STOP)
    assert blocks.num_free_blocks == blocks.num_blocks


def test_random_traffic_never_leaks_blocks() -> None:
    rng = random.Random(0)
    sched, blocks = make(num_blocks=40, block_size=4, budget=48, max_seqs=6)
    pending = [request(i, rng.randint(1, 30), k=rng.randint(0, 5), max_tokens=rng.randint(1, 20),
                       uncond=[1, 2] if rng.random() < 0.3 else None) for i in range(60)]
    steps = 0
    while pending or sched.has_unfinished:
        if pending and rng.random() < 0.5:
            sched.add(pending.pop())
        for plan in emit(sched, accepted=lambda p: rng.randint(0, p.num_draft_slots)):
            r = plan.request
            if rng.random() < 0.02:
                sched.finish(r, FinishReason.ABORT)
            elif r.remaining_tokens <= 0:
                sched.finish(r, FinishReason.LENGTH)
        for r in list(sched.running):
            for s in r.seqs:
                assert blocks.num_tokens(s.seq_id) == s.num_computed
        steps += 1
        assert steps < 5000
    assert blocks.num_free_blocks == blocks.num_blocks


def seeded(i: int, prompt_len: int, k: int, uncond: list[int] | None = None) -> Request:
    return Request(f"s{i}", list(range(1, prompt_len + 1)), SamplingParams(seed=i, max_tokens=100), seed=i,
                   arrival=i, num_speculative_tokens=k, max_speculative_tokens=k, uncond_token_ids=uncond)


def test_seeded_sampled_request_gets_its_full_k_or_waits() -> None:
    sched, _ = make(budget=10)
    old, new = request(0, 1, k=4), seeded(1, 1, k=6)
    sched.add(old)
    sched.add(new)
    # The first step admits both: old costs 1 + 4, new would need 1 + 6 > 5 and waits untrimmed.
    assert [(p.request, p.num_draft_slots) for p in emit(sched)] == [(old, 4)]
    sched.finish(old, FinishReason.ABORT)
    assert [(p.request, p.num_draft_slots) for p in emit(sched)] == [(new, 6)]
    # An unseeded request in its place is trimmed to the budget instead.
    sched, _ = make(budget=10)
    sched.add(request(0, 1, k=4))
    sched.add(request(1, 1, k=6))
    assert [p.num_draft_slots for p in emit(sched)] == [4, 4]


def test_seeded_k_that_never_fits_a_step_is_cut_the_same_in_any_batch() -> None:
    for others in (0, 3):
        sched, _ = make(budget=10, max_seqs=8)
        for i in range(others):
            sched.add(request(i, 2, max_tokens=3))
        r = seeded(9, 3, k=6, uncond=[5])
        sched.add(r)
        ks = []
        while not r.output_token_ids:
            for p in emit(sched):
                if p.request is r and p.samples:
                    ks.append(p.num_draft_slots)
                elif p.request.remaining_tokens <= 0:
                    sched.finish(p.request, FinishReason.LENGTH)
        assert ks == [4]  # 2 sequences x (4 + 1) rows fill the budget of 10 exactly


def test_admission_takes_turns_across_groups() -> None:
    """One request's fan-out (group "a", 6 sequences queued first) does not queue a later request
    (group "b") behind all of it: b is admitted as soon as a slot is free."""
    sched, _ = make(max_seqs=2, budget=64)
    fan_out = [request(i, 4, max_tokens=3) for i in range(6)]
    late = request(6, 4, max_tokens=3)
    for r in fan_out:
        r.group = "a"
        sched.add(r)
    late.group = "b"
    sched.add(late)
    admitted = [plan.request.request_id for plan in emit(sched)]
    assert admitted == ["r0", "r6"]


def test_requests_without_a_group_are_admitted_in_arrival_order() -> None:
    sched, _ = make(max_seqs=3, budget=64)
    for i in range(5):
        sched.add(request(i, 4, max_tokens=3))
    assert [plan.request.request_id for plan in emit(sched)] == ["r0", "r1", "r2"]
