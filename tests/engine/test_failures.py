"""Failure isolation: an exception while serving one request fails that request alone."""

from __future__ import annotations

import pytest

from verispec import SamplingParams
from verispec.spec_decode.draft_model import DraftModelDrafter

from ..tiny import run_all, tiny_engine, tiny_model

PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7], [9, 9, 9, 9, 9, 9], list(range(16)) * 2, [3]]
VICTIM = 2  # the request that fails: CFG, so both of its sequences must be freed; mild, so it drafts well


def params(i: int) -> SamplingParams:
    if i == VICTIM:
        return SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, guidance_scale=1.05, negative_prompt=[4, 5])
    return SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


class Injected(RuntimeError):
    pass


def inject(engine, where: str, victim: str) -> None:
    """Makes one stage raise whenever it handles `victim`, once it has emitted 5 tokens."""
    def hit(request_id: str) -> bool:
        request = engine._requests.get(request_id)
        return request is not None and request.request_id == victim and len(request.output_token_ids) >= 5

    if where == "forward":
        forward = engine.runner.forward
        engine.runner.forward = lambda feeds: (
            _raise() if any(hit(f.seq_id.split("#")[0]) for f in feeds) else forward(feeds))
    elif where == "drafter":
        propose = engine.drafter.propose
        engine.drafter.propose = lambda requests: (
            _raise() if any(hit(r.request_id) for r in requests) else propose(requests))
    elif where == "schedule":
        plan = engine.scheduler._plan
        engine.scheduler._plan = lambda request, budget: (
            _raise() if hit(request.request_id) else plan(request, budget))
    else:  # the detokenizer, while the victim's emitted tokens are appended
        decoder = engine._decoders[victim]
        push = decoder.push
        decoder.push = lambda ids: _raise() if hit(victim) else push(ids)


def _raise():
    raise Injected("injected fault")


def run(target, where: str | None):
    # At a fixed K every request drafts every step, so the drafter meets the victim for sure.
    drafter = DraftModelDrafter(target, num_blocks=256, block_size=4)
    engine = tiny_engine(target, drafter, k=4, budget=24, num_blocks=60, adaptive=False)
    ids = [engine.add_request(p, params(i)) for i, p in enumerate(PROMPTS)]
    if where is not None:
        inject(engine, where, ids[VICTIM])
    done = run_all(engine)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks and not drafter._cached
    assert not engine._requests and not engine.has_unfinished()
    return [done[i] for i in ids]


@pytest.mark.parametrize("where", ["forward", "drafter", "detokenizer", "schedule"])
def test_a_failing_request_fails_alone(where) -> None:
    target = tiny_model(seed=0, scale=3.0)
    healthy = run(target, None)
    faulty = run(target, where)
    victim = faulty[VICTIM]
    assert victim.finished and victim.finish_reason == "error"
    assert victim.error == "Injected: injected fault"
    assert len(victim.token_ids) >= 5 and victim.token_ids == healthy[VICTIM].token_ids[: len(victim.token_ids)]
    for i, (a, b) in enumerate(zip(healthy, faulty)):
        if i != VICTIM:
            assert (b.finish_reason, b.token_ids, b.error) == (a.finish_reason, a.token_ids, None)


def test_a_drafter_release_that_raises_does_not_escape_step() -> None:
    """release raising (after dropping its state) on every request's finish: step() logs it and
    goes on; every request still completes with its tokens."""
    target = tiny_model(seed=0, scale=3.0)
    healthy = run(target, None)
    drafter = DraftModelDrafter(target, num_blocks=256, block_size=4)
    release = drafter.release

    def raising(request_id: str) -> None:
        release(request_id)
        raise Injected("release failed")

    drafter.release = raising
    engine = tiny_engine(target, drafter, k=4, budget=24, num_blocks=60)
    ids = [engine.add_request(p, params(i)) for i, p in enumerate(PROMPTS)]
    done = run_all(engine)
    assert [(done[i].finish_reason, done[i].token_ids) for i in ids] == \
        [(h.finish_reason, h.token_ids) for h in healthy]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and not drafter._cached


def test_a_preempted_request_whose_release_raises_fails_alone() -> None:
    target = tiny_model(seed=0, scale=3.0)
    drafter = DraftModelDrafter(target, num_blocks=256, block_size=4)
    engine = tiny_engine(target, drafter, k=4, budget=24, num_blocks=60)
    ids = [engine.add_request(p, params(i)) for i, p in enumerate(PROMPTS)]
    for _ in range(3):
        engine.step()
    victim = engine._requests[ids[VICTIM]]
    release = drafter.release

    def raising(request_id: str) -> None:
        release(request_id)
        if request_id == victim.request_id:
            raise Injected("release failed")

    drafter.release = raising
    # For one step the cache cannot hold the victim: it and the requests newer than it are preempted.
    engine.scheduler._fits = lambda request, plan: False if request is victim else fits(request, plan)
    fits = type(engine.scheduler)._fits.__get__(engine.scheduler)
    assert victim in engine.scheduler.running
    (out,) = [o for o in engine.step() if o.request_id == victim.request_id]
    del engine.scheduler._fits
    assert out.finish_reason == "error" and out.error == "Injected: release failed"
    done = run_all(engine)
    assert all(done[i].finish_reason == "length" for i in ids if i != victim.request_id)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_scheduling_that_raises_for_no_one_request_fails_all_cleanly() -> None:
    target = tiny_model(seed=0, scale=3.0)
    drafter = DraftModelDrafter(target, num_blocks=256, block_size=4)
    engine = tiny_engine(target, drafter, k=4, budget=24, num_blocks=60)
    ids = [engine.add_request(p, params(i)) for i, p in enumerate(PROMPTS)]
    engine.step()
    engine.scheduler._cost = lambda plan: _raise()  # outside any one request's try
    outputs = engine.step()
    del engine.scheduler._cost
    assert sorted(o.request_id for o in outputs) == sorted(ids)
    assert all(o.finish_reason == "error" and o.error == "Injected: injected fault" for o in outputs)
    assert not engine.has_unfinished() and engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not drafter._cached
    again = engine.add_request(PROMPTS[0], params(0))
    assert run_all(engine)[again].finish_reason == "length"
