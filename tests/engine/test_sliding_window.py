"""KV blocks behind a sliding window go back to the pool (runtime/kv_cache.py, sliding windows):
outputs are the same with and without releasing them, with every drafter and CFG, through
preemption and prefix-cache hits; a sequence holds only its window's blocks after each step; a
generation far longer than the cache runs when its window fits."""

from __future__ import annotations

import pytest
import torch

from verispec import SamplingParams
from verispec.config import CacheConfig, EngineConfig, SpeculativeConfig
from verispec.engine.engine import LLMEngine
from verispec.spec_decode.draft_model import DraftModelDrafter
from verispec.spec_decode.eagle import EagleDrafter
from verispec.spec_decode.heads import HeadConfig, new_head
from verispec.model.quant.kernels import compiled_kernels
from verispec.spec_decode.ngram import NgramDrafter

from ..tiny import tiny_engine, tiny_model, word_tokenizer
from .prefix_verifier import PrefixVerifier

VOCAB, WINDOW, BLOCK = 16, 6, 4


def target():
    return tiny_model(seed=0, scale=2.0, window=WINDOW)


def requests() -> list[tuple[list[int], SamplingParams]]:
    """Greedy and seeded requests, one with CFG and a negative prompt longer than the window,
    two sharing a prompt (prefix-cache hits), a repetitive one (n-gram drafts accepted)."""
    shared = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    return [
        (shared, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)),
        (shared + [2], SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)),
        ([1, 2, 3] * 4, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
        ([7, 7, 1, 2, 3, 7, 7, 1], SamplingParams(temperature=1.2, seed=11, max_tokens=30, ignore_eos=True)),
        ([4, 4, 2], SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True,
                                   guidance_scale=1.5, negative_prompt=[6, 0, 1, 2, 6, 6, 0, 1, 9])),
    ]


def drafter(kind: str, model):
    if kind == "ngram":
        return NgramDrafter(1, 3, 3)
    if kind == "draft":
        return DraftModelDrafter(tiny_model(seed=1, scale=3.0, window=WINDOW), num_blocks=64, block_size=BLOCK)
    if kind == "eagle":  # its head attends to everything over a cache of its own
        return EagleDrafter(new_head(HeadConfig.for_target("eagle", model.config), model, torch.arange(VOCAB)),
                            num_blocks=64, block_size=BLOCK)
    return None


def engine(model, kind: str, free: bool, num_blocks: int) -> LLMEngine:
    # The method only turns speculation on; the drafter object is what drafts (as tiny_engine).
    spec = SpeculativeConfig(method="none" if kind == "none" else "ngram", num_speculative_tokens=3,
                             adaptive=False)
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=512,
                          cache=CacheConfig(BLOCK, num_blocks, True, free), speculative=spec)
    return LLMEngine(model, word_tokenizer(VOCAB), config, drafter(kind, model))


def run(engine: LLMEngine, check=None) -> dict[str, tuple]:
    """All requests at once, then after two steps one more with the first one's prompt (cached
    by then, unless evicted)."""
    ids = [engine.add_request(*r) for r in requests()]
    done = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        if steps == 3:
            ids.append(engine.add_request(requests()[0][0], SamplingParams(temperature=0, max_tokens=8)))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.finish_reason, out.token_ids, out.stats.num_draft_tokens,
                                        out.stats.num_accepted_tokens)
        if check is not None:
            check(engine)
    return {i: done[i] for i in ids}


def held_blocks(blocks, seq_id) -> int:
    return len(blocks.block_table(seq_id)) - blocks.num_holes(seq_id)


@pytest.mark.parametrize("kind", ["none", "ngram", "draft", "eagle"])
def test_outputs_and_drafts_equal_with_blocks_released(kind) -> None:
    """A cache of 13 blocks (the four requests need 11-13 each without releasing, 29 together
    with CFG's companion) against a roomy one that keeps every block: the same tokens, drafts
    and acceptances; after every step each sequence holds exactly the blocks its window still
    reads, and the prefix verifier's invariants hold."""
    model = target()
    verifier = None
    seen = {"holes": 0, "preempted": 0}

    def check(e: LLMEngine) -> None:
        verifier.check()
        for request in e.scheduler.running:
            for seq in request.seqs:
                n = seq.num_computed
                assert e.blocks.num_tokens(seq.seq_id) == n
                assert held_blocks(e.blocks, seq.seq_id) == -(-n // BLOCK) - max(0, n - WINDOW + 1) // BLOCK
                seen["holes"] += e.blocks.num_holes(seq.seq_id)
        if kind == "draft":
            for rid in e.drafter.blocks.seq_ids():
                assert held_blocks(e.drafter.blocks, rid) <= 5  # window + one call's feed, never all of it

    released = engine(model, kind, True, 13)
    verifier = PrefixVerifier(released)
    schedule = released.scheduler.schedule

    def counted():
        plan = schedule()
        seen["preempted"] += len(plan.preempted)
        return plan

    released.scheduler.schedule = counted
    got = run(released, check)
    want = run(engine(model, kind, False, 256))
    if kind == "eagle":
        # The head drafts over holes for the greedy requests (spec_decode/features.py): where the
        # target took a prefix from its cache (kept in the roomy one, evicted or preempted in the
        # small one) their drafts differ, never their tokens; seeded requests' drafts match too.
        invariant = [p.seed is not None for _, p in requests()] + [False]
        assert [g if keep else g[:2] for g, keep in zip(got.values(), invariant)] == \
            [w if keep else w[:2] for w, keep in zip(want.values(), invariant)]
    else:
        assert list(got.values()) == list(want.values())
    assert all(reason == "length" for reason, *_ in got.values())
    assert seen["holes"] > 0 and seen["preempted"]
    if kind != "none":
        assert sum(accepted for *_, accepted in got.values()) > 0
    assert released.blocks.num_free_blocks == released.blocks.num_blocks


def test_long_generation_fits_a_small_cache() -> None:
    """200 tokens through a cache of 6 blocks of 4 (24 slots): refused when blocks are kept, run
    to the end when they are released, with the tokens of a cache that holds everything."""
    model = target()
    prompt, params = [5, 3, 2, 7, 1, 4, 4, 2, 9, 11], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    outputs = {}
    for name, free, num_blocks in (("kept", False, 6), ("released", True, 6), ("roomy", False, 128)):
        e = tiny_engine(model, NgramDrafter(1, 3, 3), k=3, num_blocks=num_blocks, block_size=BLOCK,
                        budget=16, free_out_of_window=free)
        rid = e.add_request(prompt, params)
        while e.has_unfinished():
            for out in e.step():
                if out.finished:
                    outputs[name] = out
    assert outputs["kept"].finish_reason == "error" and "KV-cache blocks" in outputs["kept"].error
    assert outputs["released"].finish_reason == "length" == outputs["roomy"].finish_reason
    assert outputs["released"].token_ids == outputs["roomy"].token_ids and len(outputs["roomy"].token_ids) == 200


def test_only_all_sliding_models_release() -> None:
    """Gemma 2/3-style local and global layers: the global layers read every key, so nothing is
    released (ModelConfig.cache_window is None)."""
    model = target()
    assert model.config.cache_window == WINDOW
    mixed = tiny_model(seed=0, window=WINDOW)
    config = mixed.config.__class__(**{**mixed.config.__dict__,
                                       "layer_types": ("sliding_attention", "full_attention")})
    assert config.cache_window is None
    e = tiny_engine(model, block_size=BLOCK, free_out_of_window=False)
    assert e.blocks.window is None and tiny_engine(model, block_size=BLOCK).blocks.window == WINDOW


def test_quantized_rows_under_a_window() -> None:
    """int8 weights attend row by row (window included) over a cache that is not zero-filled:
    greedy speculative output with blocks released equals plain output with blocks kept, token
    for token (the kernel never reads a released block, and its rows do not depend on the batch)."""
    model = tiny_model(seed=0, scale=2.0, window=WINDOW, quantization=(8, 32))
    assert model.rowwise_attention or compiled_kernels() is None
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [[1, 2, 3] * 4, [5, 3, 2, 7, 1, 4, 4, 2, 9, 11]]
    outputs = []
    for drafter, free, num_blocks in ((None, False, 256), (NgramDrafter(1, 3, 3), True, 12)):
        e = tiny_engine(model, drafter, k=3 if drafter else 0, num_blocks=num_blocks, block_size=BLOCK,
                        budget=16, free_out_of_window=free)
        ids = [e.add_request(p, params) for p in prompts]
        done = {}
        while e.has_unfinished():
            done.update({o.request_id: o for o in e.step() if o.finished})
        outputs.append([done[i].token_ids for i in ids])
        accepted = sum(done[i].stats.num_accepted_tokens for i in ids)
    assert outputs[0] == outputs[1] and accepted > 0
