"""Prefix caching: the block manager's hash chains, sharing and eviction, and the engine's
output with caching on and off (greedy and seeded sampled, every drafter, CFG, trees, n > 1,
preemption, aborts), checked after every step by the prefix verifier."""

from __future__ import annotations

import pytest

from verispec import SamplingParams
from verispec.config import CacheConfig, DynamicTree, EngineConfig, SpeculativeConfig, TreeShape
from verispec.engine.engine import LLMEngine, RequestOutput
from verispec.runtime.kv_cache import BlockManager
from verispec.runtime.prefix_cache import extend_chain, identity_key
from verispec.spec_decode.base import Drafter
from verispec.spec_decode.draft_model import DraftModelDrafter
from verispec.spec_decode.eagle import EagleDrafter
from verispec.spec_decode.medusa import MedusaDrafter
from verispec.spec_decode.ngram import NgramDrafter

from .. import learned
from ..tiny import tiny_model, word_tokenizer
from .prefix_verifier import PrefixVerifier, check_blocks

ROOT = identity_key("test")


def _chain(tokens: list[int], size: int = 4, root: bytes = ROOT) -> list[bytes]:
    return extend_chain([], root, tokens, size, len(tokens))


def _published(bm: BlockManager, seq: str, tokens: list[int]) -> None:
    bm.allocate(seq, len(tokens))
    bm.publish(seq, _chain(tokens), tokens)


def test_a_published_prefix_is_found_shared_and_evicted_last_block_first() -> None:
    bm = BlockManager(6, 4, prefix_root=ROOT)
    tokens = list(range(10))
    _published(bm, "a", tokens)  # blocks 0, 1 full, 2 partial (never published)
    assert bm.prefix.num_cached == 2
    hit = bm.cached_prefix(_chain(tokens[:9]), tokens)
    assert hit == bm.block_table("a")[:2]
    assert bm.cached_prefix(_chain([0, 1, 2, 3, 9, 9, 9, 9]), [0, 1, 2, 3, 9, 9, 9, 9]) == hit[:1]
    assert bm.cached_prefix(_chain(tokens, root=identity_key("other model")), tokens) == []
    bm.allocate("b", 1, cached=hit)
    assert bm.num_tokens("b") == 9 and bm.block_table("b")[:2] == hit
    assert [bm.ref_count(b) for b in hit] == [2, 2]
    bm.free("a")
    assert [bm.ref_count(b) for b in hit] == [1, 1] and bm.num_free_blocks == 3
    bm.free("b")
    check_blocks(bm)
    assert bm.num_free_blocks == 6 and bm.prefix.num_evictable == 2
    # Plain free blocks go first; then the cached ones, the chain's deeper block before its parent.
    bm.allocate("c", 16)
    assert bm.prefix.num_cached == 2
    bm.append("c", 4)
    assert bm.prefix.num_cached == 1 and bm.cached_prefix(_chain(tokens[:8]), tokens) == hit[:1]
    bm.append("c", 4)
    assert bm.prefix.num_cached == 0 and bm.num_free_blocks == 0
    check_blocks(bm)


def test_a_hit_is_confirmed_against_the_tokens_and_needs_its_parent() -> None:
    bm = BlockManager(3, 4, prefix_root=ROOT)
    bm.allocate("x", 4)
    bm.publish("x", _chain([5, 5, 5, 5]), [1, 2, 3, 4])  # a (simulated) collision: hash of other tokens
    assert bm.cached_prefix(_chain([5, 5, 5, 5]), [5, 5, 5, 5]) == []
    bm = BlockManager(3, 4, prefix_root=ROOT)
    _published(bm, "a", [1, 2, 3, 4])
    bm.free("a")
    tokens = [1, 2, 3, 4, 8, 8, 8, 8]
    bm.allocate("b", 8)
    bm.publish("b", _chain(tokens)[:1], tokens)  # already cached in a's block: b's copy stays private
    assert bm.prefix.num_cached == 1 and bm.block_table("b")[0] not in bm.prefix.entries()
    bm.allocate("c", 4)  # evicts a's block
    bm.publish("b", _chain(tokens), tokens)  # its parent is cached nowhere: no lookup could reach it
    assert bm.prefix.num_cached == 0
    with pytest.raises(ValueError, match="only full blocks"):
        bm.publish("c", _chain([6, 6, 6, 6, 1]) + [b"x" * 16], [6, 6, 6, 6, 1])
    check_blocks(bm)


def test_allocation_counts_evictable_hits_against_the_free_blocks() -> None:
    bm = BlockManager(3, 4, prefix_root=ROOT)
    _published(bm, "a", list(range(8)))
    bm.free("a")
    hit = bm.cached_prefix(_chain(list(range(8))), list(range(8)))
    assert len(hit) == 2 and bm.num_free_blocks == 3
    assert bm.can_allocate("b", 4, cached=hit) and not bm.can_allocate("b", 5, cached=hit)
    with pytest.raises(RuntimeError, match="need 2 blocks, 1 free"):
        bm.allocate("b", 5, cached=hit)
    check_blocks(bm)
    with pytest.raises(ValueError, match="expected cached blocks"):
        BlockManager(3, 4).allocate("b", 0, cached=[0])


# --- the engine ---

VOCAB = 16
SYSTEM = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]  # 13 tokens: 3 full blocks of 4
USERS = [[7, 2], [7, 2, 0, 0, 1], [11, 12, 13, 14, 10, 9], [7], [2, 2, 2, 2, 2, 2, 2, 2, 2]]


def _engine(model, drafter: Drafter | None = None, caching: bool = True, k: int = 3, num_blocks: int = 512,
            budget: int = 256, tree: TreeShape | None = None, method: str = "ngram") -> LLMEngine:
    """`method` only names the drafter in the config (the drafter object is what runs)."""
    spec = SpeculativeConfig(method="none" if drafter is None else method, num_speculative_tokens=k, tree=tree,
                             adaptive=False)
    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=budget, max_model_len=512,
                          cache=CacheConfig(4, num_blocks, caching), speculative=spec)
    return LLMEngine(model, word_tokenizer(model.config.vocab_size), config, drafter)


def _params(i: int, cfg: bool = False, max_tokens: int = 8) -> SamplingParams:
    """Greedy for even i, seeded sampling for odd i; with `cfg`, guidance with a shared negative prompt."""
    kw = dict(max_tokens=max_tokens, ignore_eos=True)
    if cfg:
        kw.update(guidance_scale=1.5, negative_prompt=[6, 6, 0, 1, 2, 6, 6] if i % 3 else None)
    return SamplingParams(temperature=0, **kw) if i % 2 == 0 else SamplingParams(temperature=1.0, seed=100 + i, **kw)


def _serve(engine: LLMEngine, waves: list[list[tuple[list[int], SamplingParams]]]) -> dict[str, RequestOutput]:
    """Each wave is queued once the previous one finished; the verifier checks every step."""
    verifier = PrefixVerifier(engine)
    done: dict[str, RequestOutput] = {}
    n = 0
    for wave in waves:
        for prompt, params in wave:
            engine.add_request(prompt, params, request_id=str(n))
            n += 1
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            verifier.check()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and not engine.blocks.seq_ids()
    return done


def _chats(cfg: bool = False, max_tokens: int = 8) -> list[list[tuple[list[int], SamplingParams]]]:
    """One chat alone (a miss), then the others at once (hits beside misses), then them all again
    (every request hits, n > 1 style: the same prompts again)."""
    chats = [(SYSTEM + u, _params(i, cfg, max_tokens)) for i, u in enumerate(USERS)]
    return [chats[:1], chats[1:] + [([9, 9, 8] + u, _params(7, cfg, max_tokens)) for u in USERS[:2]], chats]


def _same_on_and_off(make, cfg: bool = False, max_tokens: int = 8, same_drafts: bool = False,
                     ) -> tuple[LLMEngine, dict[str, RequestOutput]]:
    """Runs the chats with caching off and on; asserts identical outputs (and, with
    `same_drafts`, identical drafts and acceptances: the drafter's state is what it would have
    computed); returns the caching engine and its outputs."""
    outputs = []
    for caching in (False, True):
        engine = make(caching)
        outputs.append((engine, _serve(engine, _chats(cfg, max_tokens))))
    (_, off), (on_engine, on) = outputs
    assert {r: o.token_ids for r, o in on.items()} == {r: o.token_ids for r, o in off.items()}
    if same_drafts:
        assert {r: o.stats for r, o in on.items()} == {r: o.stats for r, o in off.items()}
    assert all(o.num_cached_tokens == 0 for o in off.values())
    assert all(o.finish_reason == "length" for o in on.values())
    return on_engine, on


def test_plain_decoding_is_the_same_with_and_without_caching_and_hits_where_prefixes_repeat() -> None:
    model = tiny_model(seed=0, scale=2.0)
    engine, on = _same_on_and_off(lambda caching: _engine(model, caching=caching))
    assert on["0"].num_cached_tokens == 0  # alone in a fresh cache
    # Beside each other: the system prompt's 3 full blocks (the first chat's 4th block holds its output).
    assert [on[str(i)].num_cached_tokens for i in range(1, 7)] == [12, 12, 12, 12, 0, 0]
    # The same prompts again: every full block short of the last token (prompts of 15, 18, 19, 14, 22).
    assert [on[str(i)].num_cached_tokens for i in range(7, 12)] == [12, 16, 16, 12, 20]
    stats = engine.scheduler.prefix_stats
    assert 0 < stats.hits < stats.queries


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_speculation_is_the_same_with_and_without_caching(drafter: str) -> None:
    model = tiny_model(seed=0, scale=2.0)

    def make(caching: bool) -> LLMEngine:
        d = NgramDrafter(1, 3, 3) if drafter == "ngram" else DraftModelDrafter(tiny_model(seed=1, scale=2.0), 256, 4)
        return _engine(model, d, caching)

    _, on = _same_on_and_off(make)
    assert sum(o.stats.num_accepted_tokens for o in on.values()) > 0
    assert sum(o.num_cached_tokens for o in on.values()) > 0


def test_cfg_companions_share_the_negative_prompt() -> None:
    model = tiny_model(seed=0, scale=2.0)
    engine, on = _same_on_and_off(lambda caching: _engine(model, NgramDrafter(1, 3, 3), caching), cfg=True)
    conditional = sum(o.num_cached_tokens for o in on.values())
    assert engine.scheduler.prefix_stats.hits > conditional > 0  # the companions hit too


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_learned_heads_are_the_same_with_and_without_caching(kind: str) -> None:
    """Medusa reads only the newest feature: the target caches prefixes. EAGLE's head needs the
    feature of every position: its own prefix cache restores them, and the target skips only
    what the head has."""
    target = learned.target()

    def make(caching: bool) -> LLMEngine:
        head = learned.trained(kind)
        d = EagleDrafter(head, num_blocks=512, block_size=4, prefix_caching=caching) if kind == "eagle" \
            else MedusaDrafter(head)
        return _engine(target, d, caching, method=kind)

    engine, on = _same_on_and_off(make, same_drafts=True)
    assert sum(o.stats.num_accepted_tokens for o in on.values()) > 0
    assert sum(o.num_cached_tokens for o in on.values()) > 0
    if kind == "eagle":
        head = engine.drafter.blocks
        assert head.prefix.num_cached > 0 and head.num_free_blocks == head.num_blocks


@pytest.mark.parametrize("kind,tree", [("ngram", (3, 2, 1)), ("medusa", DynamicTree(8, 3, 3))])
def test_trees_are_the_same_with_and_without_caching(kind: str, tree: TreeShape) -> None:
    target = learned.target() if kind == "medusa" else tiny_model(seed=0, scale=2.0)

    def make(caching: bool) -> LLMEngine:
        d = MedusaDrafter(learned.trained("medusa")) if kind == "medusa" else NgramDrafter(1, 3, 3)
        return _engine(target, d, caching, tree=tree, method=kind)

    _, on = _same_on_and_off(make)
    assert sum(o.stats.num_accepted_tokens for o in on.values()) > 0 and sum(o.num_cached_tokens for o in on.values()) > 0


@pytest.mark.parametrize("budget", [5, 256])
def test_preemption_and_chunked_prefill_with_a_small_cache(budget: int) -> None:
    """24 blocks of 4 for 12 requests: the newest are preempted and recomputed, and the cache
    keeps being evicted and refilled (a cache full of cached blocks still admits requests)."""
    model = tiny_model(seed=0, scale=2.0)
    engine, _ = _same_on_and_off(
        lambda caching: _engine(model, NgramDrafter(1, 3, 3), caching, num_blocks=24, budget=budget), max_tokens=24)
    assert engine.scheduler.prefix_stats.hits > 0


def test_a_cache_full_of_cached_blocks_admits_new_requests() -> None:
    model = tiny_model(seed=0, scale=2.0)
    engine = _engine(model, num_blocks=10)
    waves = [[([i, (i + 1) % 15] * 8, _params(0, max_tokens=4))] for i in range(6)]  # 16 + 4 tokens each
    done = _serve(engine, waves)
    assert len(done) == 6 and all(o.finish_reason == "length" for o in done.values())
    assert engine.blocks.prefix.num_cached == engine.blocks.prefix.num_evictable > 0


def test_a_request_larger_than_the_cache_fails_as_before() -> None:
    model = tiny_model(seed=0, scale=2.0)
    messages = []
    for caching in (False, True):
        engine = _engine(model, caching=caching, num_blocks=6)
        done = _serve(engine, [[(SYSTEM + SYSTEM, _params(0))], [(SYSTEM + SYSTEM, _params(0))]])
        assert {o.finish_reason for o in done.values()} == {"error"}
        messages.append([o.error for o in done.values()])
    assert messages[0] == messages[1] and "KV-cache blocks" in messages[0][0]


def test_aborted_requests_leave_their_blocks_cached_and_others_unchanged() -> None:
    model = tiny_model(seed=0, scale=2.0)
    outputs = []
    for caching in (False, True):
        engine = _engine(model, NgramDrafter(1, 3, 3), caching)
        verifier = PrefixVerifier(engine)
        for i, u in enumerate(USERS):
            engine.add_request(SYSTEM + u, _params(i), request_id=str(i))
        done = {}
        for step in range(40):
            if step == 3:
                engine.abort("1")
                engine.add_request(SYSTEM + USERS[1], _params(1), request_id="again")
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
            verifier.check()
        assert not engine.has_unfinished() and "1" not in done
        outputs.append(done)
    assert outputs[0] == outputs[1]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
