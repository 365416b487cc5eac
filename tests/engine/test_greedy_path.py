"""Plain greedy requests skip the sampler (verispec.sample.greedy): the same tokens and the same
accepted drafts as through rejection_sample, which a request asking for logprobs still takes."""

from __future__ import annotations

import dataclasses

import pytest

from verispec import SamplingParams
from verispec.engine import engine as engine_module
from verispec.spec_decode.draft_model import DraftModelDrafter

from ..tiny import run_all, tiny_engine, tiny_model

PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7, 5, 6, 7], [9, 3]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _run(params: SamplingParams, monkeypatch) -> tuple[list, int]:
    calls = []
    real = engine_module.rejection_sample
    monkeypatch.setattr(engine_module, "rejection_sample", lambda *a, **k: calls.append(1) or real(*a, **k))
    # A draft model close to the target: drafts get accepted and rejected.
    engine = tiny_engine(tiny_model(seed=0, scale=3.0),
                         DraftModelDrafter(tiny_model(seed=1, scale=3.0), num_blocks=256, block_size=4), k=4)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done = run_all(engine)
    return [(done[r].token_ids, done[r].stats.num_accepted_tokens, done[r].stats.num_draft_tokens)
            for r in ids], len(calls)


def test_the_host_rule_emits_what_the_sampler_emits(monkeypatch: pytest.MonkeyPatch) -> None:
    host, host_calls = _run(GREEDY, monkeypatch)
    sampler, sampler_calls = _run(dataclasses.replace(GREEDY, logprobs=0), monkeypatch)
    assert host_calls == 0 and sampler_calls > 0
    assert host == sampler
    accepted = sum(a for _, a, _ in host)
    assert 0 < accepted < sum(d for _, _, d in host)  # drafts both accepted and rejected
