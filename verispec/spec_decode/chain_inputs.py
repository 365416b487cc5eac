"""ChainInputs: the index tensors of one compiled EAGLE drafting call (EagleHead.chain_drafts),
built straight from the feeds in one int64 tensor.

The call's first pass is a plain chain of catch-up rows attended row by row, and its later
positions one row per request, so what ModelRunner.inputs and AttentionPlan compute in general
(trees, windows, padded groups, a tensor per list) reduces to a few lists. At batch 1 on the
4-bit embedded model, building them through those took ~0.4 ms of a ~1.8 ms call whose compiled
part is ~0.75 ms (2026-11-28, Skylake-SP Xeon).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..runtime.kv_cache import BlockManager
from ..runtime.runner import Feed


@dataclass(frozen=True)
class ChainInputs:
    """Rows: T catch-up rows (each request's feed, request by request), then per later position
    s = 1 .. D - 1 (D = max depth) a row per request, L = (D - 1) R of them; a later row past
    its request's depth has slot 0 and is never read."""

    input_ids: torch.Tensor  # [T] int64, x_{t+1} of each catch-up row
    positions: torch.Tensor  # [T + L] int64
    slots: torch.Tensor  # [T + L] int64, head-cache slots
    plan: list[torch.Tensor]  # the catch-up rows' RowPlan.tensors(): block tables, row_seq, first, visible, tree start, mask
    logits_rows: torch.Tensor  # [R] int64, each request's last catch-up row
    block_tables: torch.Tensor  # [R, W] int64
    chain_start: torch.Tensor  # [R] int64, the position of each request's first later row
    depths: list[int]  # [R] drafts per request, >= 1


def chain_inputs(blocks: BlockManager, feeds: Sequence[Feed], depths: Sequence[int]) -> ChainInputs:
    """The inputs of a call drafting depths[r] tokens after feed r, whose slots through its last
    later row the cache already holds. A feed has no parents and one logits row (its last)."""
    depth = max(depths)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    row_seq: list[int] = []
    later_positions: list[list[int]] = [[] for _ in range(depth - 1)]
    later_slots: list[list[int]] = [[] for _ in range(depth - 1)]
    last: list[int] = []
    starts: list[int] = []
    tables: list[list[int]] = []
    for r, (feed, own_depth) in enumerate(zip(feeds, depths)):
        n, newest = len(feed.token_ids), feed.start + len(feed.token_ids)
        own = blocks.slot_mapping(feed.seq_id, feed.start, newest + own_depth - 1)
        ids.extend(feed.token_ids)
        positions.extend(range(feed.start, newest))
        slots.extend(own[:n])
        row_seq.extend([r] * n)
        last.append(len(ids) - 1)
        starts.append(newest)
        for s in range(1, depth):
            later_positions[s - 1].append(newest + s - 1)
            later_slots[s - 1].append(own[n + s - 1] if s < own_depth else 0)
        tables.append(blocks.block_table(feed.seq_id, hole=0))
    width = max(map(len, tables))
    rows, count = len(ids), len(feeds)
    every_position = positions + [p for step in later_positions for p in step]
    flat = (ids + every_position + slots + [s for step in later_slots for s in step] + row_seq + [0] * rows
            + [p + 1 for p in positions] + [feed.start for feed in feeds for _ in feed.token_ids]
            + last + starts + [b for t in tables for b in t + [0] * (width - len(t))])
    sizes = [rows, len(every_position), len(every_position), rows, rows, rows, rows, count, count, count * width]
    (input_ids, all_positions, all_slots, seq, first, visible, tree_start, logits_rows, chain_start,
     table) = torch.tensor(flat, dtype=torch.int64).split(sizes)
    block_tables = table.view(count, width)
    plan = [block_tables, seq, first, visible, tree_start, torch.zeros(rows, 0, dtype=torch.bool)]
    return ChainInputs(input_ids, all_positions, all_slots, plan, logits_rows, block_tables, chain_start,
                       list(depths))
