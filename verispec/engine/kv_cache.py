"""Paged KV-cache bookkeeping: which fixed-size blocks each sequence owns.

Plain Python, no tensors: the model runner turns block tables and slot mappings into device
tensors. Terms, used throughout:

- block: ``block_size`` consecutive KV slots in the cache, identified by an index in
  ``[0, num_blocks)``; a block is either free or owned by exactly one sequence.
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
manager hands out blocks 0, 1, 2, ... in order. No prefix sharing: every block has one owner.
"""

from __future__ import annotations

from collections.abc import Hashable


def _check_count(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: expected an integer >= {minimum}")
    return value


class BlockManager:
    """Owns the free-block pool and the block table and length of every sequence."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = _check_count("num_blocks", num_blocks, 1)
        self.block_size = _check_count("block_size", block_size, 1)
        # Reversed so that pop() hands out the lowest indices first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

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

    def block_table(self, seq_id: Hashable) -> list[int]:
        self._length(seq_id)
        return list(self._tables[seq_id])

    def can_allocate(self, seq_id: Hashable, num_tokens: int) -> bool:
        """False if ``seq_id`` already exists or the pool lacks the blocks for ``num_tokens``."""
        _check_count("num_tokens", num_tokens, 0)
        return seq_id not in self._lengths and self.blocks_for(num_tokens) <= len(self._free)

    def allocate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Start sequence ``seq_id`` with length ``num_tokens`` (0 allowed)."""
        _check_count("num_tokens", num_tokens, 0)
        if seq_id in self._lengths:
            raise ValueError(f"seq_id={seq_id!r} is already allocated")
        needed = self.blocks_for(num_tokens)
        if needed > len(self._free):
            raise RuntimeError(
                f"cannot allocate seq_id={seq_id!r}: {num_tokens} tokens need {needed} blocks, "
                f"{len(self._free)} free"
            )
        self._tables[seq_id] = [self._free.pop() for _ in range(needed)]
        self._lengths[seq_id] = num_tokens

    def can_append(self, seq_id: Hashable, n: int) -> bool:
        """Whether ``seq_id`` can grow by ``n`` slots; raises ValueError for an unknown id."""
        _check_count("n", n, 0)
        length = self._length(seq_id)
        needed = self.blocks_for(length + n) - len(self._tables[seq_id])
        return needed <= len(self._free)

    def append(self, seq_id: Hashable, n: int) -> None:
        """Grow ``seq_id`` by ``n`` slots (e.g. K + 1 before a verification step)."""
        _check_count("n", n, 0)
        length = self._length(seq_id)
        table = self._tables[seq_id]
        needed = self.blocks_for(length + n) - len(table)
        if needed > len(self._free):
            raise RuntimeError(
                f"cannot append {n} tokens to seq_id={seq_id!r} (length {length}): "
                f"needs {needed} more blocks, {len(self._free)} free"
            )
        table.extend(self._free.pop() for _ in range(needed))
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
        # Freed last-first so the stack hands them back in their original order.
        while len(table) > keep:
            self._free.append(table.pop())
        self._lengths[seq_id] = length - n

    def free(self, seq_id: Hashable) -> None:
        """Release every block of ``seq_id``; an unknown id is a no-op (idempotent cleanup)."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        del self._lengths[seq_id]
        self._free.extend(reversed(table))

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Flat cache slots of positions ``[start, end)`` of ``seq_id``."""
        length = self._length(seq_id)
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= length):
            raise ValueError(
                f"start={start!r}, end={end!r} is invalid for seq_id={seq_id!r}: "
                f"expected 0 <= start <= end <= {length} (its length)"
            )
        table, bs = self._tables[seq_id], self.block_size
        return [table[pos // bs] * bs + pos % bs for pos in range(start, end)]
