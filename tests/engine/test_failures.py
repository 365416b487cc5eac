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
    else:  # the detokenizer, while the victim's emitted tokens are appended
        decoder = engine._decoders[victim]
        push = decoder.push
        decoder.push = lambda ids: _raise() if hit(victim) else push(ids)


def _raise():
    raise Injected("injected fault")


def run(target, where: str | None):
    drafter = DraftModelDrafter(target, num_blocks=256, block_size=4)  # drafts well: K stays up
    engine = tiny_engine(target, drafter, k=4, budget=24, num_blocks=60)
    ids = [engine.add_request(p, params(i)) for i, p in enumerate(PROMPTS)]
    if where is not None:
        inject(engine, where, ids[VICTIM])
    done = run_all(engine)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks and not drafter._cached
    assert not engine._requests and not engine.has_unfinished()
    return [done[i] for i in ids]


@pytest.mark.parametrize("where", ["forward", "drafter", "detokenizer"])
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
