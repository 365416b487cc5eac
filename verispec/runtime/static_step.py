"""Decode and verify steps over persistent buffers, padded to a fixed set of shapes.

A step qualifies when every fed sequence's every row needs logits (the pending token and its
drafts, a chain or, with `trees`, a tree of them; prefill chunks run the ordinary way). A tree
row attends the sequence's context and its own ancestors (model/attention.py: tree), given as a
mask over the sequence's rows. It is padded to a
*shape*: a bucket of sequences (SEQ_BUCKETS) x the step's most rows per sequence. Row b * rows + i
is row i of sequence b; the rows past a sequence's own, and every row of the sequences past the
step's, are *padding*: they feed token 0 at position 0, write their key and value to the
*reserved* slot (the first of a block the KV cache holds beyond the BlockManager's, which no
sequence is ever given), and attend only that slot through a block-table row of reserved blocks.
Nothing else reads the reserved block, and the real rows' logits and hidden states are taken out
of the padded ones by index, so whatever padding computes never reaches a token.

All tensors of a shape are views of buffers allocated once, so a CUDA graph captured over them
(runtime/cuda_graphs.py) replays every later step of that shape. Per step the host fills one
staging buffer with numpy (no loop over rows) and copies it over in two transfers; the row
attention reads the block table on the device (model/row_attention.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..model import AttentionMetadata
from ..model.attention import RowLayout

SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class StaticShapes:
    """The largest padded step: max_seqs sequences (a bucket) of max_rows rows, block tables of
    max_blocks entries; `trees`: tree rows too (a [rows, rows] mask per sequence). A step beyond
    any of them runs the ordinary way."""

    max_seqs: int
    max_rows: int
    max_blocks: int
    trees: bool = False

    def __post_init__(self) -> None:
        if self.max_seqs not in SEQ_BUCKETS:
            raise ValueError(f"max_seqs={self.max_seqs!r} is invalid: expected one of {SEQ_BUCKETS}")
        for name in ("max_rows", "max_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: expected an integer >= 1")

    @classmethod
    def covering(cls, max_seqs: int, max_rows: int, max_tokens: int, block_size: int,
                 trees: bool = False) -> StaticShapes:
        """Shapes for steps of up to max_seqs sequences (capped at the largest bucket) of up to
        max_rows rows, over sequences of at most max_tokens slots."""
        seqs = next((b for b in SEQ_BUCKETS if b >= max_seqs), SEQ_BUCKETS[-1])
        return cls(seqs, max_rows, -(-max_tokens // block_size), trees)


@dataclass(frozen=True)
class StepShape:
    num_seqs: int  # a bucket
    rows: int  # rows per sequence


@dataclass(frozen=True)
class StaticStep:
    """A prepared step: the model's inputs (the same tensors for every step of `shape`) and which
    of its rows are the fed tokens."""

    shape: StepShape
    input_ids: torch.Tensor  # [num_seqs * rows] int64
    positions: torch.Tensor  # [num_seqs * rows] int64
    attn: AttentionMetadata
    logits_rows: torch.Tensor  # [num_seqs * rows] int64, every row
    real_rows: torch.Tensor  # [fed tokens] int64, the fed tokens' rows in feed order


class StaticInputs:
    """The persistent buffers of padded steps on `device`, over a cache of `block_size` slots a
    block whose reserved block is `reserved_block`."""

    # The row buffer: these segments, each max_seqs * max_rows long, then seq_lens [max_seqs].
    SEGMENTS = ("input_ids", "positions", "slots", "row_seq", "visible", "tree_start", "real")

    def __init__(self, device: torch.device, shapes: StaticShapes, block_size: int,
                 reserved_block: int) -> None:
        self.device, self.shapes, self.block_size = device, shapes, block_size
        self.reserved_block = reserved_block
        seqs, width = shapes.max_seqs, shapes.max_blocks
        self.capacity = seqs * shapes.max_rows
        pinned = device.type == "cuda"
        rows_len = len(self.SEGMENTS) * self.capacity + seqs
        self.host_rows = torch.zeros(rows_len, dtype=torch.int64, pin_memory=pinned)
        # Row `seqs` of the tables is the padding rows' all-reserved row, written once.
        self.host_tables = torch.full(((seqs + 1) * width,), reserved_block, dtype=torch.int64,
                                      pin_memory=pinned)
        self.rows = self.host_rows.to(device)
        self.tables = self.host_tables.to(device).view(seqs + 1, width)
        self.zeros = torch.zeros(self.capacity, dtype=torch.int64, device=device)
        # Row r's mask over its sequence's rows, [size, rows] for a shape (no columns without trees).
        self.host_masks = torch.zeros(self.capacity * shapes.max_rows if shapes.trees else 0,
                                      dtype=torch.bool, pin_memory=pinned and shapes.trees)
        self.masks = self.host_masks.to(device)
        self.every_row = torch.arange(self.capacity, dtype=torch.int64, device=device)
        self._starts: dict[StepShape, torch.Tensor] = {}

    def segment(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        i = self.SEGMENTS.index(name)
        return buffer[i * self.capacity : (i + 1) * self.capacity]

    def prepare(
        self,
        tokens: Sequence[Sequence[int]],  # per sequence, its fed tokens
        starts: Sequence[int],  # per sequence, the cache position of its first fed token
        tables: Sequence[Sequence[int]],  # per sequence, its block table (holes: any block)
        parents: Sequence[Sequence[int] | None] | None = None,  # per sequence, its tree or None
    ) -> StaticStep | None:
        """The step padded to its shape, its inputs written to the buffers; None when it exceeds
        the shapes (more sequences or rows, a longer block table, a tree without `trees`)."""
        trees = parents is not None and any(p is not None for p in parents)
        count = len(tokens)
        lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=count)
        rows = int(lengths.max())
        seqs = next((b for b in SEQ_BUCKETS if b >= count), None)
        width = self.shapes.max_blocks
        if seqs is None or seqs > self.shapes.max_seqs or rows > self.shapes.max_rows \
                or max(map(len, tables)) > width or (trees and not self.shapes.trees):
            return None
        shape, size = StepShape(seqs, rows), seqs * rows
        column = np.arange(rows)
        real = np.zeros((seqs, rows), dtype=bool)
        real[:count] = column[None, :] < lengths[:, None]
        start = np.zeros(seqs, dtype=np.int64)
        start[:count] = starts
        position = start[:, None] + column  # in the cache
        mask = np.zeros((seqs, rows, rows), dtype=bool)
        depth = column[None, :].repeat(seqs, 0)
        tree_rows = np.zeros(seqs, dtype=bool)
        if trees:
            tree_rows[:count] = [p is not None for p in parents]
            mask, depth = _ancestry(parents, count, seqs, rows, real)
        rotary = np.where(tree_rows[:, None], start[:, None] + depth, position)
        table = self.host_tables.numpy()[: count * width].reshape(count, width)
        table.fill(self.reserved_block)
        for i, entries in enumerate(tables):
            table[i, : len(entries)] = entries
        block = np.zeros((seqs, rows), dtype=np.int64)
        block[:count] = np.take_along_axis(table, np.minimum(position[:count] // self.block_size, width - 1), 1)
        host = self.host_rows.numpy()
        reserved_slot = self.reserved_block * self.block_size
        ids = np.zeros((seqs, rows), dtype=np.int64)
        ids[real] = np.fromiter(itertools.chain.from_iterable(tokens), dtype=np.int64, count=int(lengths.sum()))
        values = {
            "input_ids": ids,
            "positions": np.where(real, rotary, 0),
            "slots": np.where(real, block * self.block_size + position % self.block_size, reserved_slot),
            "row_seq": np.where(real, np.arange(seqs)[:, None], self.shapes.max_seqs),
            # A tree row sees the context, then its ancestors through the mask from its start.
            "visible": np.where(real, np.where(tree_rows[:, None], start[:, None], position + 1), 1),
            "tree_start": np.where(real, start[:, None], 0),
        }
        for name, value in values.items():
            self.segment(host, name)[:size] = value.reshape(-1)
        found = np.flatnonzero(real)
        self.segment(host, "real")[: len(found)] = found
        host[len(self.SEGMENTS) * self.capacity :][:count] = np.asarray(starts) + lengths
        self.rows.copy_(self.host_rows, non_blocking=True)
        self.tables.view(-1)[: count * width].copy_(self.host_tables[: count * width], non_blocking=True)
        if self.shapes.trees:
            self.host_masks.numpy()[: size * rows] = mask.reshape(-1)
            self.masks[: size * rows].copy_(self.host_masks[: size * rows], non_blocking=True)
        return self._step(shape, len(found))

    def _step(self, shape: StepShape, num_real: int) -> StaticStep:
        size = shape.num_seqs * shape.rows
        if shape not in self._starts:
            self._starts[shape] = torch.arange(0, size + 1, shape.rows, dtype=torch.int64, device=self.device)
        view = {name: self.segment(self.rows, name)[:size] for name in self.SEGMENTS}
        seq_lens = self.rows[len(self.SEGMENTS) * self.capacity :][: shape.num_seqs]
        masks = self.masks[: size * shape.rows].view(size, shape.rows if self.shapes.trees else 0)
        layout = RowLayout(view["row_seq"], view["visible"], view["positions"], view["tree_start"], masks,
                           self.zeros[:size])
        attn = AttentionMetadata(self._starts[shape], seq_lens, view["slots"], self.tables, rows=layout)
        return StaticStep(shape, view["input_ids"], view["positions"], attn, self.every_row[:size],
                          self.segment(self.rows, "real")[:num_real])


def _ancestry(
    parents: Sequence[Sequence[int] | None],  # per real sequence, its tree (parent row or -1) or None
    count: int,
    seqs: int,
    rows: int,
    real: np.ndarray,  # [seqs, rows] bool
) -> tuple[np.ndarray, np.ndarray]:  # [seqs, rows, rows] bool ancestors-or-self, [seqs, rows] depth
    """Each tree row's mask over its sequence's rows and its depth; a chain's rows stay unmasked
    (they attend by length) with depth = row. One pass per row index, over every sequence at once
    (a parent comes before its child)."""
    parent = np.full((seqs, rows), -1, dtype=np.int64)
    is_tree = np.zeros(seqs, dtype=bool)
    for b, p in enumerate(parents[:count]):
        if p is not None:
            parent[b, : len(p)] = p
            is_tree[b] = True
    mask = np.zeros((seqs, rows, rows), dtype=bool)
    depth = np.zeros((seqs, rows), dtype=np.int64)
    every = np.arange(seqs)
    for i in range(rows):
        has = parent[:, i] >= 0
        up = np.maximum(parent[:, i], 0)
        mask[:, i] = np.where(has[:, None], mask[every, up], False)
        mask[:, i, i] = real[:, i]
        depth[:, i] = np.where(has, depth[every, up] + 1, 0)
    mask &= is_tree[:, None, None]
    depth = np.where(is_tree[:, None], depth, np.arange(rows)[None, :])
    return mask, depth
