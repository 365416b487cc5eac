"""The model runner: the one place (with the model itself) that touches device tensors per step.

It turns plain-Python feeds into the model's ragged-batch inputs against the paged KV cache,
runs the forward pass, and hands logits to the sampler. A drafter that runs a model owns a
runner of its own, over its own cache.

With StaticShapes (the engine's target on CUDA by default, EngineConfig.static_step), decode and
verify steps run padded over persistent buffers (static_step.py) and, with `graphs`, as CUDA
graphs (cuda_graphs.py); the logits and hidden states handed back are the fed rows' only, as
in the ordinary path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..model import AttentionMetadata, LlamaModel
from ..model.attention import RowLayout, check_parents, new_positions
from .cuda_graphs import StepGraphs
from .kv_cache import BlockManager
from .static_step import StaticInputs, StaticShapes, StaticStep


@dataclass(frozen=True)
class Feed:
    """Tokens one sequence feeds in one forward pass.

    token_ids: written to the cache at positions start, start + 1, ...; at least one (a sequence
        with nothing to feed in a pass has no Feed: an empty one has no row to attend from).
    num_logits: how many of its LAST rows need logits (0 for a prefill chunk).
    parents: for a tree of tokens (tree speculation), the parent of each fed row among the fed
        rows, -1 for a row that follows the cached context (verispec.model.attention: tree);
        None for a chain.
    """

    seq_id: str
    token_ids: Sequence[int]
    start: int
    num_logits: int
    parents: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.num_logits <= len(self.token_ids) or not self.token_ids:
            raise ValueError(f"Feed for seq_id={self.seq_id!r} has {len(self.token_ids)} tokens and "
                             f"num_logits={self.num_logits}: expected 1 or more tokens and "
                             "0 <= num_logits <= tokens")
        if self.parents is not None:
            check_parents(list(self.parents), len(self.token_ids))


@dataclass(frozen=True)
class KVMove:
    """Keys/values of one sequence to copy from positions `src` to positions `dst` (pairwise):
    after tree verification, the accepted path's entries to consecutive positions."""

    seq_id: str
    src: Sequence[int]
    dst: Sequence[int]

    def __post_init__(self) -> None:
        if len(self.src) != len(self.dst):
            raise ValueError(f"KVMove for seq_id={self.seq_id!r} has {len(self.src)} sources and "
                             f"{len(self.dst)} destinations: expected as many of each")


@dataclass(frozen=True)
class StepInputs:
    """A forward pass's inputs on the device, built from feeds (ModelRunner.inputs)."""

    input_ids: torch.Tensor  # [T] int64, fed tokens in feed order
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_rows: torch.Tensor  # [R] int64, rows of T that need logits


class ModelRunner:
    """Runs `model` (a LlamaModel, or a drafter's head with the same cache interface) over
    `blocks`' paged cache; with `static`, decode and verify steps of `model` (a LlamaModel) run
    padded (module docstring), as CUDA graphs with `graphs`."""

    def __init__(self, model: LlamaModel, blocks: BlockManager, static: StaticShapes | None = None,
                 graphs: bool = False) -> None:
        self.model = model
        self.blocks = blocks
        self.device = next(model.parameters()).device
        # A padded step's reserved block is one more than the BlockManager hands out.
        self.kv_caches = model.allocate_kv_cache(blocks.num_blocks + (static is not None), blocks.block_size)
        self.static = None if static is None else \
            StaticInputs(self.device, static, blocks.block_size, reserved_block=blocks.num_blocks)
        self.graphs = StepGraphs() if graphs and static is not None else None

    def forward(self, feeds: Sequence[Feed]) -> torch.Tensor:  # [sum(num_logits), V] float32
        """The caller has already reserved slots for every fed token in the BlockManager;
        `feeds` is not empty."""
        static = self._static_step(feeds)
        if static is not None:
            return self._run_static(static, ())[0]
        step = self.inputs(feeds)
        return self.model(step.input_ids, step.positions, step.attn, self.kv_caches, step.logits_rows)

    def forward_hidden(
        self, feeds: Sequence[Feed], hidden_layers: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [sum(num_logits), V] float32, [T, H * hidden_size]
        """`forward`, plus the hidden states of `hidden_layers` for every fed token, in feed
        order (LlamaModel.forward_hidden)."""
        static = self._static_step(feeds)
        if static is not None:
            return self._run_static(static, tuple(hidden_layers))
        step = self.inputs(feeds)
        return self.model.forward_hidden(step.input_ids, step.positions, step.attn, self.kv_caches,
                                         step.logits_rows, hidden_layers)

    def _static_step(self, feeds: Sequence[Feed]) -> StaticStep | None:
        """The padded step of a step whose every row needs logits, else None."""
        if self.static is None or any(f.num_logits != len(f.token_ids) for f in feeds):
            return None
        reserved = self.static.reserved_block
        return self.static.prepare([f.token_ids for f in feeds], [f.start for f in feeds],
                                   [self.blocks.block_table(f.seq_id, hole=reserved) for f in feeds],
                                   [f.parents for f in feeds])

    def _run_static(self, step: StaticStep, hidden_layers: tuple[int, ...],
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [fed, V], [fed, H * hidden_size]
        def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
            return self.model.forward_hidden(step.input_ids, step.positions, step.attn, self.kv_caches,
                                             step.logits_rows, hidden_layers)

        logits, hidden = forward() if self.graphs is None else self.graphs.run((step.shape, hidden_layers), forward)
        return logits.index_select(0, step.real_rows), \
            None if hidden is None else hidden.index_select(0, step.real_rows)

    def move_kv(self, moves: Sequence[KVMove]) -> None:
        """Copies cache entries as `moves` say, in every layer. All sources are read before any
        destination is written, so a path may slide onto its own positions."""
        src = [s for m in moves for s in self._slots(m.seq_id, m.src)]
        dst = [s for m in moves for s in self._slots(m.seq_id, m.dst)]
        if not src:
            return
        src_t = torch.tensor(src, dtype=torch.int64).to(self.device, non_blocking=True)
        dst_t = torch.tensor(dst, dtype=torch.int64).to(self.device, non_blocking=True)
        for cache in self.kv_caches:
            flat = cache.view(2, -1, *cache.shape[3:])
            flat.index_copy_(1, dst_t, flat.index_select(1, src_t))

    def _slots(self, seq_id: str, positions: Sequence[int]) -> list[int]:
        table, size = self.blocks.block_table(seq_id), self.blocks.block_size
        length, first = self.blocks.num_tokens(seq_id), self.blocks.num_holes(seq_id) * size
        if any(not first <= p < length for p in positions):
            raise ValueError(f"positions {list(positions)!r} of seq_id={seq_id!r}: expected "
                             f"positions in [{first}, {length})")
        return [table[p // size] * size + p % size for p in positions]

    def inputs(self, feeds: Sequence[Feed]) -> StepInputs:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        trees = [None if feed.parents is None else list(feed.parents) for feed in feeds]
        for feed, parents in zip(feeds, trees):
            n = len(feed.token_ids)
            end = feed.start + n
            ids.extend(feed.token_ids)
            positions.extend(new_positions(feed.start, n, parents))
            slots.extend(self.blocks.slot_mapping(feed.seq_id, feed.start, end))
            logits_rows.extend(range(starts[-1] + n - feed.num_logits, starts[-1] + n))
            starts.append(starts[-1] + n)
            seq_lens.append(end)
            # Released blocks (sliding windows) are read as block 0 under the window's mask,
            # as the padding of shorter tables is.
            tables.append(self.blocks.block_table(feed.seq_id, hole=0))
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]

        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

        attn = AttentionMetadata(
            query_start_loc=tensor(starts),
            seq_lens=tensor(seq_lens),
            slot_mapping=tensor(slots),
            block_tables=tensor(padded),
            query_lens_list=[b - a for a, b in zip(starts, starts[1:])],
            seq_lens_list=seq_lens,
            trees=trees if any(t is not None for t in trees) else None,
        )
        return StepInputs(tensor(ids), tensor(positions), attn, tensor(logits_rows))

    def chain_inputs(self, feeds: Sequence[Feed]) -> StepInputs:
        """`inputs` for feeds of one token each that all need logits (a drafter's draft
        positions after its first), with the rows laid out on the device (AttentionMetadata.rows)
        rather than planned from host lists: for a pass of a few rows through a one-layer head,
        that planning cost more than the pass."""
        if any(len(f.token_ids) != 1 or f.num_logits != 1 or f.parents is not None for f in feeds):
            raise ValueError("chain_inputs takes feeds of one token each, with its logits and no tree")
        tables = [self.blocks.block_table(f.seq_id, hole=0) for f in feeds]
        width = max(len(t) for t in tables)
        columns = torch.tensor([[f.token_ids[0] for f in feeds], [f.start for f in feeds],
                                [self.blocks.slot_mapping(f.seq_id, f.start, f.start + 1)[0] for f in feeds]],
                               dtype=torch.int64).to(self.device, non_blocking=True)  # [3, R]
        ids, positions, slots = columns
        count = torch.arange(len(feeds) + 1, dtype=torch.int64, device=self.device)
        rows = RowLayout(count[:-1], positions + 1, positions, positions,
                         torch.zeros((len(feeds), 0), dtype=torch.bool, device=self.device),
                         torch.zeros_like(positions))
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        attn = AttentionMetadata(count, positions + 1, slots, padded.to(self.device, non_blocking=True), rows=rows)
        return StepInputs(ids, positions, attn, count[:-1])
