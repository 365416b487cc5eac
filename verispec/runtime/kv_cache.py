"""Paged KV-cache bookkeeping: which fixed-size blocks each sequence owns.

Plain Python, no tensors: the model runner turns block tables and slot mappings into device
tensors. Terms, used throughout:

- block: ``block_size`` consecutive KV slots in the cache, identified by an index in
  ``[0, num_blocks)``; a block is free or held by one or more sequences (its reference count).
  Only cached blocks (prefix caching, below) are ever held by more than one sequence.
- sequence: anything with its own KV history (a request, or the unconditional CFG companion of
  one), identified by a hashable ``seq_id``.
- length: the number of KV slots a sequence holds. Position ``i`` of a sequence lives in slot
  ``block_table[i // block_size] * block_size + i % block_size`` of the flat cache.

Speculative decoding grows a sequence by K + 1 slots before verification (``append``) and gives
back the slots of rejected tokens afterwards (``truncate``), so blocks that end up unused return
to the pool at once. Methods come in check-then-act pairs (``can_allocate``/``allocate``,
``can_append``/``append``): the scheduler checks, then acts; acting without room raises
``RuntimeError`` and never leaves a partial change behind. Bad arguments (negative counts, an
unknown or duplicate ``seq_id``, a range outside the sequence) raise ``ValueError``.

Free blocks are kept on a stack, so the most recently freed block is reused first; a fresh
manager hands out blocks 0, 1, 2, ... in order.

Prefix caching (on when the manager is given an identity key; prefix_cache.py has the terms): a
sequence's full blocks of committed tokens are `publish`ed under their chain hashes; a new
sequence starts from the blocks of its longest cached prefix (`cached_prefix`, then `allocate`
with them), sharing them read-only: a cached block is full, and a sequence only ever writes at
or after its computed length. A cached block that no sequence holds counts as free but keeps its
content until a fresh block is needed and no plain free block is left; then the least recently
released one is evicted.

Sliding windows (a manager given `window`: every layer of its model slides, ModelConfig.
cache_window): a query at position p reads keys at positions > p - window only. Once a
sequence's queries all sit at or after position c (its computed length: fed tokens and accepted
drafts; drafts and rollbacks only ever come after it), `release_behind(seq_id, c)` frees every
block whose slots all lie at or before c - window. Its table entry becomes a *hole* (`HOLE`):
the table keeps its length, so positions, appends and truncations count as before, and the
runner reads a hole as block 0, under a mask (model/attention.py masks those keys, and a
masked key's weight is exactly 0, so the output is bit for bit that of a table without holes).
Holes are always a table's first entries. A released block that was published stays cached
(evictable, like any cached block no sequence holds); one released before publication is plain
free, and the sequence's later blocks are then published only where an equal prefix is cached
elsewhere (the index keeps whole chains). `cached_prefix` maps a hit's blocks behind the
window of its first new query as holes, so an admission holds only the window's blocks.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from .prefix_cache import PrefixIndex

HOLE = -1  # a block table entry whose block was released (sliding windows, module docstring)


def _check_count(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: expected an integer >= {minimum}")
    return value


class BlockManager:
    """Owns the free-block pool and the block table and length of every sequence.

    prefix_root: the identity key of prefix caching (prefix_cache.identity_key), None to turn
    it off. window: every query reads only the keys of the last `window` positions up to its
    own (module docstring: sliding windows); None: all of them, nothing is released early."""

    def __init__(self, num_blocks: int, block_size: int, prefix_root: bytes | None = None,
                 window: int | None = None) -> None:
        self.num_blocks = _check_count("num_blocks", num_blocks, 1)
        self.block_size = _check_count("block_size", block_size, 1)
        self.window = None if window is None else _check_count("window", window, 1)
        # Reversed so that pop() hands out the lowest indices first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._tables: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}
        self._published: dict[Hashable, int] = {}  # per sequence, its first blocks already offered to the index
        self._holes: dict[Hashable, int] = {}  # per sequence, its first blocks released (HOLE)
        self._horizon: dict[Hashable, int] = {}  # per sequence, where its queries sit from now on
        self.prefix = PrefixIndex(prefix_root) if prefix_root is not None else None

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence may take: plain free ones and evictable cached ones."""
        return len(self._free) + (self.prefix.num_evictable if self.prefix is not None else 0)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` slots."""
        return -(-num_tokens // self.block_size)

    def _length(self, seq_id: Hashable) -> int:
        try:
            return self._lengths[seq_id]
        except KeyError:
            raise ValueError(f"seq_id={seq_id!r} is not allocated") from None

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._lengths

    def seq_ids(self) -> list[Hashable]:
        """Every allocated sequence."""
        return list(self._lengths)

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._length(seq_id)

    def block_table(self, seq_id: Hashable, hole: int = HOLE) -> list[int]:
        """The sequence's blocks in position order, `hole` where one was released."""
        self._length(seq_id)
        table = self._tables[seq_id]
        holes = self._holes[seq_id]
        return [hole] * holes + table[holes:] if holes and hole != HOLE else list(table)

    def num_holes(self, seq_id: Hashable) -> int:
        """How many of the sequence's first blocks were released (sliding windows)."""
        self._length(seq_id)
        return self._holes[seq_id]

    def ref_count(self, block: int) -> int:
        """How many sequences hold `block`."""
        return self._refs[block]

    def cached_prefix(self, hashes: Sequence[bytes], token_ids: Sequence[int], root: bytes | None = None) -> list[int]:
        """The cached blocks of the longest cached prefix of `token_ids`, whose full blocks'
        chain from `root` (None: the identity key) is `hashes` (prefix_cache.extend_chain); []
        without prefix caching. With a window, the blocks that no query after the prefix reads
        are HOLEs."""
        if self.prefix is None:
            return []
        found = self.prefix.lookup(hashes, token_ids, self.block_size, root)
        behind = self._behind(len(found) * self.block_size)
        return [HOLE] * min(behind, len(found)) + found[behind:]

    def _behind(self, position: int) -> int:
        """How many first blocks no query at `position` or later reads (0 without a window)."""
        if self.window is None:
            return 0
        return max(0, position - self.window + 1) // self.block_size

    def blocks_taken(self, cached: Sequence[int]) -> int:
        """How many free blocks mapping `cached` (cached_prefix's blocks) would use up: the
        evictable ones among them."""
        return sum(1 for b in set(cached) if b != HOLE and self._refs[b] == 0)

    def can_allocate(self, seq_id: Hashable, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """False if ``seq_id`` already exists or the pool lacks the blocks for ``num_tokens``
        after the ``cached`` blocks."""
        _check_count("num_tokens", num_tokens, 0)
        return seq_id not in self._lengths and \
            self.blocks_for(num_tokens) + self.blocks_taken(cached) <= self.num_free_blocks

    def allocate(self, seq_id: Hashable, num_tokens: int, cached: Sequence[int] = ()) -> None:
        """Start sequence ``seq_id`` from the ``cached`` blocks (cached_prefix's, 0 or more),
        then ``num_tokens`` (0 allowed) slots in fresh blocks: its length is
        ``len(cached) * block_size + num_tokens``."""
        _check_count("num_tokens", num_tokens, 0)
        if seq_id in self._lengths:
            raise ValueError(f"seq_id={seq_id!r} is already allocated")
        holes = next((i for i, b in enumerate(cached) if b != HOLE), len(cached))
        if any(self.prefix is None or not self.prefix.is_cached(b) for b in cached[holes:]):
            raise ValueError(f"cached={list(cached)!r} for seq_id={seq_id!r}: expected cached blocks "
                             "after the holes")
        needed = self.blocks_for(num_tokens)
        if needed + self.blocks_taken(cached) > self.num_free_blocks:
            raise RuntimeError(
                f"cannot allocate seq_id={seq_id!r}: {num_tokens} tokens need {needed} blocks, "
                f"{self.num_free_blocks - self.blocks_taken(cached)} free"
            )
        for block in cached[holes:]:
            self._hold(block)
        self._tables[seq_id] = list(cached) + [self._take() for _ in range(needed)]
        self._lengths[seq_id] = len(cached) * self.block_size + num_tokens
        self._published[seq_id] = len(cached)
        self._holes[seq_id] = holes
        self._horizon[seq_id] = len(cached) * self.block_size if holes else 0

    def can_append(self, seq_id: Hashable, n: int) -> bool:
        """Whether ``seq_id`` can grow by ``n`` slots; raises ValueError for an unknown id."""
        _check_count("n", n, 0)
        length = self._length(seq_id)
        needed = self.blocks_for(length + n) - len(self._tables[seq_id])
        return needed <= self.num_free_blocks

    def append(self, seq_id: Hashable, n: int) -> None:
        """Grow ``seq_id`` by ``n`` slots (e.g. K + 1 before a verification step)."""
        _check_count("n", n, 0)
        length = self._length(seq_id)
        table = self._tables[seq_id]
        needed = self.blocks_for(length + n) - len(table)
        if needed > self.num_free_blocks:
            raise RuntimeError(
                f"cannot append {n} tokens to seq_id={seq_id!r} (length {length}): "
                f"needs {needed} more blocks, {self.num_free_blocks} free"
            )
        table.extend(self._take() for _ in range(needed))
        self._lengths[seq_id] = length + n

    def truncate(self, seq_id: Hashable, n: int) -> None:
        """Drop the last ``n`` slots of ``seq_id`` (rejected tokens) and free emptied blocks."""
        _check_count("n", n, 0)
        length = self._length(seq_id)
        if n > length:
            raise ValueError(
                f"cannot truncate {n} tokens from seq_id={seq_id!r}: its length is {length}"
            )
        table = self._tables[seq_id]
        keep = self.blocks_for(length - n)
        if length - n < self._horizon[seq_id]:
            raise ValueError(f"cannot truncate seq_id={seq_id!r} to {length - n} tokens: blocks behind "
                             f"the window of position {self._horizon[seq_id]} were released")
        # Freed last-first so the stack hands them back in their original order.
        while len(table) > keep:
            self._drop(table.pop())
        self._lengths[seq_id] = length - n
        self._published[seq_id] = min(self._published[seq_id], keep)

    def free(self, seq_id: Hashable) -> None:
        """Release every block of ``seq_id``; an unknown id is a no-op (idempotent cleanup)."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        del self._lengths[seq_id]
        del self._published[seq_id]
        holes = self._holes.pop(seq_id)
        del self._horizon[seq_id]
        # Last block first: the free stack hands them back in order, and a chain's deeper
        # cached blocks are evicted before the prefix they extend.
        for block in reversed(table[holes:]):
            self._drop(block)

    def release_behind(self, seq_id: Hashable, position: int) -> int:
        """The sequence's queries all sit at `position` or later from now on: releases its
        blocks that no such query reads (module docstring: sliding windows); returns how many.
        A no-op without a window."""
        length = self._length(seq_id)
        if not isinstance(position, int) or not 0 <= position <= length:
            raise ValueError(f"position={position!r} for seq_id={seq_id!r}: expected 0 <= position "
                             f"<= {length} (its length)")
        if self.window is None:
            return 0
        table = self._tables[seq_id]
        start, end = self._holes[seq_id], self._behind(position)
        for i in range(start, end):
            self._drop(table[i])
            table[i] = HOLE
        self._holes[seq_id] = max(start, end)
        self._horizon[seq_id] = max(self._horizon[seq_id], position)
        return max(0, end - start)

    def publish(self, seq_id: Hashable, hashes: Sequence[bytes], token_ids: Sequence[int],
                root: bytes | None = None) -> None:
        """Offers the first ``len(hashes)`` blocks of ``seq_id`` to the prefix cache: full blocks
        of committed tokens (``token_ids`` starts with them), ``hashes`` their chain from
        ``root`` (None: the identity key). A no-op without prefix caching; a block whose content
        is already cached elsewhere stays private."""
        length = self._length(seq_id)
        if self.prefix is None:
            return
        if len(hashes) * self.block_size > length:
            raise ValueError(f"{len(hashes)} block hashes for seq_id={seq_id!r} of length {length}: "
                             "expected only full blocks")
        table, bs = self._tables[seq_id], self.block_size
        root = self.prefix.root if root is None else root
        for i in range(max(self._published[seq_id], self._holes[seq_id]), len(hashes)):
            self.prefix.register(table[i], hashes[i], hashes[i - 1] if i else root, token_ids[i * bs : (i + 1) * bs],
                                 first=i == 0)
        self._published[seq_id] = max(self._published[seq_id], len(hashes))

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Flat cache slots of positions ``[start, end)`` of ``seq_id``."""
        length = self._length(seq_id)
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= length):
            raise ValueError(
                f"start={start!r}, end={end!r} is invalid for seq_id={seq_id!r}: "
                f"expected 0 <= start <= end <= {length} (its length)"
            )
        table, bs = self._tables[seq_id], self.block_size
        if start < end and start // bs < self._holes[seq_id]:
            raise ValueError(f"start={start} for seq_id={seq_id!r}: its first {self._holes[seq_id]} "
                             f"blocks were released")
        return [table[pos // bs] * bs + pos % bs for pos in range(start, end)]

    def _take(self) -> int:
        """A fresh block: a plain free one, else the least recently released cached one."""
        block = self._free.pop() if self._free else self.prefix.evict()
        self._refs[block] = 1
        return block

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            self.prefix.unpark(block)
        self._refs[block] += 1

    def _drop(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if self.prefix is not None and self.prefix.is_cached(block):
                self.prefix.park(block)
            else:
                self._free.append(block)
