"""A debug verifier of the prefix cache for engine tests: block accounting with shared blocks,
and every cached block's keys and values against what its hash says it holds."""

from __future__ import annotations

from collections import Counter

import torch

from verispec.engine.engine import LLMEngine
from verispec.runtime.kv_cache import HOLE, BlockManager
from verispec.runtime.prefix_cache import block_hash
from verispec.runtime.runner import Feed, ModelRunner


def check_blocks(blocks: BlockManager) -> None:
    """Reference counts match the block tables, a block held by several sequences is cached,
    and every block is exactly one of: held, plain free, evictable cached. Released blocks
    (sliding windows) are the first entries of a table, and only where the manager has a window."""
    for seq in blocks.seq_ids():
        table, holes = blocks.block_table(seq), blocks.num_holes(seq)
        assert table[:holes] == [HOLE] * holes and HOLE not in table[holes:]
        assert holes == 0 or blocks.window is not None
    held = Counter(b for seq in blocks.seq_ids() for b in blocks.block_table(seq) if b != HOLE)
    assert all(blocks.ref_count(b) == held[b] for b in range(blocks.num_blocks))
    free = set(blocks._free)
    assert len(free) == len(blocks._free)
    evictable = {b for b in range(blocks.num_blocks) if blocks.prefix is not None and blocks.prefix.is_evictable(b)}
    assert not free & evictable and not (free | evictable) & set(held)
    assert len(free) + len(evictable) + len(held) == blocks.num_blocks == blocks.num_free_blocks + len(held)
    cached = blocks.prefix.entries() if blocks.prefix is not None else {}
    assert all(b in cached for b, n in held.items() if n > 1)
    assert evictable <= set(cached)


class PrefixVerifier:
    """Call `check` after every engine step."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.prefixes: dict[bytes, list[int]] = {}  # hash -> the whole token prefix it stands for
        self.expected: dict[bytes, list[torch.Tensor]] = {}  # hash -> per layer [2, block_size, kv_heads, head_dim]
        self.seen: dict[tuple[int, bytes], list[torch.Tensor]] = {}  # (block, hash) -> its K/V when first checked
        self.num_checked = 0

    def check(self) -> None:
        blocks = self.engine.blocks
        check_blocks(blocks)
        if blocks.prefix is None:
            return
        entries = blocks.prefix.entries()
        todo = dict(entries)
        while todo:  # parents first: a block is registered only while its parent is cached
            ready = {b: e for b, e in todo.items() if e.parent == blocks.prefix.root or e.parent in self.prefixes}
            assert ready, f"cached blocks whose parent chain was never cached: {sorted(todo)}"
            for b, e in ready.items():
                assert block_hash(e.parent, e.token_ids) == e.hash
                assert len(e.token_ids) == blocks.block_size
                head = [] if e.parent == blocks.prefix.root else self.prefixes[e.parent]
                self.prefixes.setdefault(e.hash, head + list(e.token_ids))
                assert self.prefixes[e.hash] == head + list(e.token_ids)
                del todo[b]
        caches = self.engine.runner.kv_caches
        for b, e in entries.items():
            seen = self.seen.get((b, e.hash))
            # Unchanged since the last check, or newly cached: then what its tokens give computed
            # afresh (up to rounding). A block evicted and cached again under the same hash
            # within one step was rewritten: the second case.
            if seen is None or not all(torch.equal(cache[:, b], kv) for cache, kv in zip(caches, seen)):
                for layer, (cache, want) in enumerate(zip(caches, self._expected(e.hash))):
                    torch.testing.assert_close(cache[:, b], want, atol=1e-4, rtol=1e-4,
                                               msg=lambda m: f"cached block {b}, layer {layer}: {m}")
                self.seen[(b, e.hash)] = [cache[:, b].clone() for cache in caches]
            self.num_checked += 1

    def _expected(self, h: bytes) -> list[torch.Tensor]:
        """The block's keys and values computed afresh from its whole token prefix."""
        if h not in self.expected:
            tokens = self.prefixes[h]
            size = self.engine.blocks.block_size
            fresh = BlockManager(-(-len(tokens) // size), size)
            fresh.allocate("x", len(tokens))
            runner = ModelRunner(self.engine.model, fresh)
            with torch.inference_mode():
                runner.forward([Feed("x", tokens, 0, 1)])
            last = fresh.block_table("x")[-1]
            self.expected[h] = [cache[:, last].clone() for cache in runner.kv_caches]
        return self.expected[h]
