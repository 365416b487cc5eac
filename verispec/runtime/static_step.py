"""Decode and verify steps over persistent buffers, padded to a fixed set of shapes.

A step qualifies when every fed sequence is a chain whose every row needs logits (the pending
token and its drafts; prefill chunks and tree steps run the ordinary way). It is padded to a
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
    max_blocks entries; a step beyond any of them runs the ordinary way."""

    max_seqs: int
    max_rows: int
    max_blocks: int

    def __post_init__(self) -> None:
        if self.max_seqs not in SEQ_BUCKETS:
            raise ValueError(f"max_seqs={self.max_seqs!r} is invalid: expected one of {SEQ_BUCKETS}")
        for name in ("max_rows", "max_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: expected an integer >= 1")

    @classmethod
    def covering(cls, max_seqs: int, max_rows: int, max_tokens: int, block_size: int) -> StaticShapes:
        """Shapes for steps of up to max_seqs sequences (capped at the largest bucket) of up to
        max_rows rows, over sequences of at most max_tokens slots."""
        seqs = next((b for b in SEQ_BUCKETS if b >= max_seqs), SEQ_BUCKETS[-1])
        return cls(seqs, max_rows, -(-max_tokens // block_size))


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
    SEGMENTS = ("input_ids", "positions", "slots", "row_seq", "visible", "real")

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
        self.no_tree = torch.zeros(self.capacity, 0, dtype=torch.bool, device=device)
        self.every_row = torch.arange(self.capacity, dtype=torch.int64, device=device)
        self._starts: dict[StepShape, torch.Tensor] = {}

    def segment(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        i = self.SEGMENTS.index(name)
        return buffer[i * self.capacity : (i + 1) * self.capacity]

    def prepare(
        self,
        tokens: Sequence[Sequence[int]],  # per sequence, its fed tokens (a chain)
        starts: Sequence[int],  # per sequence, the cache position of its first fed token
        tables: Sequence[Sequence[int]],  # per sequence, its block table (holes: any block)
    ) -> StaticStep | None:
        """The step padded to its shape, its inputs written to the buffers; None when it exceeds
        the shapes (more sequences or rows, or a longer block table)."""
        count = len(tokens)
        lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=count)
        rows = int(lengths.max())
        seqs = next((b for b in SEQ_BUCKETS if b >= count), None)
        width = self.shapes.max_blocks
        if seqs is None or seqs > self.shapes.max_seqs or rows > self.shapes.max_rows \
                or max(map(len, tables)) > width:
            return None
        shape, size = StepShape(seqs, rows), seqs * rows
        column = np.arange(rows)
        real = np.zeros((seqs, rows), dtype=bool)
        real[:count] = column[None, :] < lengths[:, None]
        position = np.zeros((seqs, rows), dtype=np.int64)
        position[:count] = np.asarray(starts, dtype=np.int64)[:, None] + column
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
            "positions": np.where(real, position, 0),
            "slots": np.where(real, block * self.block_size + position % self.block_size, reserved_slot),
            "row_seq": np.where(real, np.arange(seqs)[:, None], self.shapes.max_seqs),
            "visible": np.where(real, position + 1, 1),
        }
        for name, value in values.items():
            self.segment(host, name)[:size] = value.reshape(-1)
        found = np.flatnonzero(real)
        self.segment(host, "real")[: len(found)] = found
        host[len(self.SEGMENTS) * self.capacity :][:count] = np.asarray(starts) + lengths
        self.rows.copy_(self.host_rows, non_blocking=True)
        self.tables.view(-1)[: count * width].copy_(self.host_tables[: count * width], non_blocking=True)
        return self._step(shape, len(found))

    def _step(self, shape: StepShape, num_real: int) -> StaticStep:
        size = shape.num_seqs * shape.rows
        if shape not in self._starts:
            self._starts[shape] = torch.arange(0, size + 1, shape.rows, dtype=torch.int64, device=self.device)
        view = {name: self.segment(self.rows, name)[:size] for name in self.SEGMENTS}
        seq_lens = self.rows[len(self.SEGMENTS) * self.capacity :][: shape.num_seqs]
        layout = RowLayout(view["row_seq"], view["visible"], self.zeros[:size], self.no_tree[:size])
        attn = AttentionMetadata(self._starts[shape], seq_lens, view["slots"], self.tables, rows=layout)
        return StaticStep(shape, view["input_ids"], view["positions"], attn, self.every_row[:size],
                          self.segment(self.rows, "real")[:num_real])
