"""Prefix caching: content hashes of full KV blocks and the index of blocks that hold them.

Plain Python, no tensors. Terms (block and sequence as in kv_cache.py):

- a *full* block holds ``block_size`` committed tokens of a sequence: tokens the request keeps,
  never draft slots that verification may still roll back;
- its *hash* is a chain, ``H(parent hash, its token ids)``; the first block's parent is the
  chain's *root*: the cache's *identity key*, a digest of everything else that decides the keys
  and values (the model, its dtype), so two blocks match only when the whole token prefix and
  the model match (a cache whose first block also depends on something else, such as EAGLE's
  head on the token before its first position, starts its chains from a root derived from it);
- a *cached* block is a full block registered under its hash; while no sequence holds it, it
  is *evictable*: reusable by a request with the same prefix until a fresh block is needed,
  least recently released first.

The index keeps each cached block's parent hash and token ids: a hit is confirmed against the
request's own tokens, so not even a hash collision can map a wrong block.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_DIGEST = 16  # bytes of blake2b: a collision is astronomically unlikely, and hits are re-checked anyway


def identity_key(*parts: object) -> bytes:
    """The root of every hash chain of one cache: a digest of what besides the tokens decides a
    block's keys and values (e.g. the model's class and config, its dtype)."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=_DIGEST).digest()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Hash of a full block: its parent's hash (or the identity key) and its token ids."""
    h = hashlib.blake2b(parent, digest_size=_DIGEST)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


def extend_chain(hashes: list[bytes], root: bytes, token_ids: Sequence[int], block_size: int,
                 num_tokens: int) -> list[bytes]:
    """Extends `hashes` (the chain of a token list's first full blocks, in place) to the full
    blocks of ``token_ids[:num_tokens]``; returns it. Token lists only grow, so a sequence keeps
    its chain and hashes each block once."""
    for i in range(len(hashes), num_tokens // block_size):
        hashes.append(block_hash(hashes[-1] if hashes else root, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes


@dataclass(frozen=True)
class CachedBlock:
    """What a cached block holds: its hash, its parent's hash (the identity key for a first
    block) and its token ids."""

    hash: bytes
    parent: bytes
    token_ids: tuple[int, ...]


class PrefixIndex:
    """Cached blocks by hash, and the evictable ones in least-recently-released order.

    The BlockManager owns reference counts and calls `park` when a cached block's count drops to
    0 and `unpark` when a sequence takes it again."""

    def __init__(self, root: bytes) -> None:
        self.root = root
        self._by_hash: dict[bytes, int] = {}
        self._entries: dict[int, CachedBlock] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first

    @property
    def num_cached(self) -> int:
        return len(self._entries)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def entries(self) -> dict[int, CachedBlock]:
        """Every cached block (block index -> what it holds); a copy."""
        return dict(self._entries)

    def is_cached(self, block: int) -> bool:
        return block in self._entries

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def lookup(self, hashes: Sequence[bytes], token_ids: Sequence[int], block_size: int,
               root: bytes | None = None) -> list[int]:
        """The blocks of the longest cached prefix of a token list whose block chain is `hashes`,
        started from `root` (None: the identity key)."""
        found: list[int] = []
        parent = self.root if root is None else root
        for i, h in enumerate(hashes):
            block = self._by_hash.get(h)
            if block is None:
                break
            entry = self._entries[block]
            if entry.parent != parent or entry.token_ids != tuple(token_ids[i * block_size : (i + 1) * block_size]):
                break  # a hash collision: never map another prefix's keys and values
            found.append(block)
            parent = h
        return found

    def register(self, block: int, h: bytes, parent: bytes, token_ids: Sequence[int], first: bool) -> bool:
        """Publishes a full block held by a sequence (`first`: the first of its chain, `parent`
        the root); False (nothing changes) when that content is already cached in another
        block, or its parent is not cached (no lookup could reach it)."""
        if h in self._by_hash or block in self._entries or (not first and parent not in self._by_hash):
            return False
        self._by_hash[h] = block
        self._entries[block] = CachedBlock(h, parent, tuple(token_ids))
        return True

    def park(self, block: int) -> None:
        """A cached block no sequence holds any more: evictable, most recently released last."""
        self._evictable[block] = None

    def unpark(self, block: int) -> None:
        """A sequence took an evictable block (a hit)."""
        del self._evictable[block]

    def evict(self) -> int:
        """Forgets the least recently released evictable block and returns it as a fresh block."""
        block, _ = self._evictable.popitem(last=False)
        del self._by_hash[self._entries.pop(block).hash]
        return block


@dataclass
class PrefixCacheStats:
    """Token counts of admissions' lookups (vLLM's prefix_cache_queries / prefix_cache_hits):
    `queries` tokens looked up (every sequence's tokens at admission), `hits` found cached."""

    queries: int = 0
    hits: int = 0
