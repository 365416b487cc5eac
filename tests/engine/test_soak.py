"""A seeded random workload through several engines, checking the bookkeeping after every step.

Random parameters (greedy, seeded and unseeded sampling, CFG with negative prompts longer and
shorter than the token budget, stop strings and stop ids, max_tokens 1..64, per-request K),
requests arriving while others run, random aborts, KV caches small enough to force preemption,
token budgets from 8 to 512, with and without an n-gram drafter, with prefix caching (prompts
and negative prompts often share a prefix) and without, on models with a sliding window whose
blocks behind it are released. After every step the prefix verifier checks the block accounting
(reference counts, nothing free while held) and every cached block's keys and values against
its hash. At the end every block is free or cached, every request
finished exactly once (or was aborted) with a reason, and every seeded sampled request gives the
tokens it gives alone in a fresh engine (no cache hits there: batch invariance across hits and
misses).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from verispec import SamplingParams
from verispec.engine.engine import LLMEngine, RequestOutput
from verispec.spec_decode.ngram import NgramDrafter

from ..tiny import tiny_engine, tiny_model
from .prefix_verifier import PrefixVerifier

VOCAB = 16
# Shared prefixes: a system prompt longer than some token budgets, a short one, a negative prompt.
SYSTEM = ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3], [2, 7, 1, 8, 2, 8])
NEGATIVE = [6, 6, 0, 1, 2, 6, 6, 0, 1]


@dataclass(frozen=True)
class Setup:
    budget: int
    num_blocks: int
    k: int  # 0: no drafter
    max_seqs: int = 8
    prefix_caching: bool = True
    window: int | None = None  # a model whose every layer slides, blocks behind it released

    def engine(self, model) -> LLMEngine:
        drafter = NgramDrafter(1, 3, self.k) if self.k else None
        return tiny_engine(model, drafter, k=self.k, num_blocks=self.num_blocks, block_size=4,
                           budget=self.budget, max_seqs=self.max_seqs, eos=VOCAB - 1,
                           prefix_caching=self.prefix_caching)


SETUPS = [Setup(8, 40, 4), Setup(13, 30, 3), Setup(24, 48, 0), Setup(64, 36, 5, max_seqs=16), Setup(512, 120, 4, max_seqs=32),
          Setup(13, 30, 3, prefix_caching=False), Setup(64, 36, 5, max_seqs=16, prefix_caching=False),
          Setup(13, 24, 3, window=5), Setup(64, 40, 5, max_seqs=16, window=9)]


def random_request(rng: random.Random, k: int) -> tuple[list[int], SamplingParams, int | None]:
    prompt = [rng.randrange(VOCAB - 1) for _ in range(rng.choice([1, 2, 5, 12, 30]))]
    if rng.random() < 0.3:
        prompt = (prompt[:3] * 8)[: len(prompt) + 6]  # repetitive: the n-gram drafter gets accepted
    if rng.random() < 0.5:
        prompt = rng.choice(SYSTEM) + prompt
    kind = rng.choice(["greedy", "seeded", "seeded", "unseeded"])
    kw = dict(max_tokens=rng.randint(1, 64), ignore_eos=rng.random() < 0.7)
    if kind != "greedy":
        kw.update(temperature=rng.choice([0.5, 1.0, 1.5]), top_k=rng.choice([None, 3]), top_p=rng.choice([1.0, 0.9]))
        if kind == "seeded":
            kw["seed"] = rng.randrange(2**31)
    else:
        kw["temperature"] = 0
    if rng.random() < 0.3:
        kw["guidance_scale"] = rng.choice([0.5, 1.5, 3.0])
        if rng.random() < 0.7:
            kw["negative_prompt"] = [rng.randrange(VOCAB - 1) for _ in range(rng.choice([1, 3, 10, 25]))]
            if rng.random() < 0.5:
                kw["negative_prompt"] = NEGATIVE + kw["negative_prompt"][:3]
    if rng.random() < 0.3:
        kw["stop"] = [f"t{rng.randrange(VOCAB)}" for _ in range(rng.randint(1, 2))] + ["t3 t4"]
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [rng.randrange(VOCAB)]
    num_spec = rng.choice([None, 0, 1, 2, 6]) if k and rng.random() < 0.5 else None
    return prompt, SamplingParams(**kw), num_spec


def check_bookkeeping(engine: LLMEngine, verifier: PrefixVerifier) -> None:
    verifier.check()
    blocks = engine.blocks
    running = {s.seq_id: (r, s) for r in engine.scheduler.running for s in r.seqs}
    assert set(blocks.seq_ids()) == set(running)
    for request, seq in running.values():
        assert blocks.num_tokens(seq.seq_id) == seq.num_computed <= request.num_tokens(seq)
    for request in engine.scheduler.waiting:
        assert not any(blocks.has(s.seq_id) for s in request.seqs) and not request.finished


def soak(model, setup: Setup, rng: random.Random, num_requests: int):
    engine = setup.engine(model)
    verifier = PrefixVerifier(engine)
    queue = [random_request(rng, setup.k) for _ in range(num_requests)]
    submitted: dict[str, tuple] = {}
    finished: dict[str, RequestOutput] = {}
    aborted: set[str] = set()
    steps = 0
    while queue or engine.has_unfinished():
        for _ in range(rng.choice([0, 0, 1, 3]) if engine.has_unfinished() else 1):
            if queue:
                prompt, params, num_spec = queue.pop()
                rid = engine.add_request(prompt, params, num_speculative_tokens=num_spec)
                submitted[rid] = (prompt, params, num_spec)
        for out in engine.step():
            assert out.request_id not in finished and out.request_id not in aborted
            if out.finished:
                assert out.finish_reason in ("stop", "length", "error")
                assert (out.error is not None) == (out.finish_reason == "error")
                finished[out.request_id] = out
        live = [rid for rid in submitted if rid not in finished and rid not in aborted]
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            engine.abort(victim)
            aborted.add(victim)
        check_bookkeeping(engine, verifier)
        steps += 1
        assert steps < 20_000
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert set(finished) | aborted == set(submitted) and not set(finished) & aborted
    assert not engine._requests and not engine._decoders
    if engine.drafter is not None:
        assert not engine.drafter._buffers
    if setup.prefix_caching:
        assert engine.scheduler.prefix_stats.hits > 0 and verifier.num_checked > 0
    return submitted, finished


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: f"budget{s.budget}-blocks{s.num_blocks}-k{s.k}"
                         + ("" if s.prefix_caching else "-nocache") + (f"-window{s.window}" if s.window else ""))
def test_soak(setup: Setup) -> None:
    model = tiny_model(seed=0, scale=2.0, eos=(VOCAB - 1,), window=setup.window)
    rng = random.Random(setup.budget)
    submitted, finished = soak(model, setup, rng, num_requests=60)
    reasons = {o.finish_reason for o in finished.values()}
    assert {"stop", "length"} <= reasons
    for rid, out in finished.items():
        prompt, params, num_spec = submitted[rid]
        if params.seed is None or params.greedy:
            continue
        alone = setup.engine(model)
        again = alone.add_request(prompt, params, num_speculative_tokens=num_spec)
        while alone.has_unfinished():
            outs = alone.step()
        assert outs[-1].request_id == again
        assert (outs[-1].finish_reason, outs[-1].token_ids) == (out.finish_reason, out.token_ids), rid
