"""Launch shapes and buffers, decided in one place.

On a GPU a program handles a tile of about 2K values (one row of a large vocabulary at a time,
many rows of a small one), and the final-row race is split across programs when there are too
few requests to fill the machine. Under the Triton interpreter (TRITON_INTERPRET=1, every
program run one after another in numpy) programs are costly and values cheap, so tiles are
large and neither the race nor the rows' threshold searches are split (tests force splits to
check that they change nothing). The mode is read when this module is imported, as triton.jit
reads it when the kernels are defined.
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import torch
import triton

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_TILE = 1 << 19 if INTERPRETED else 2048  # values per program tile
_SEARCH_TILE = 1 << 20 if INTERPRETED else 4096  # values per tile of the pivot comparisons
_NUM_PIVOTS = 2 if INTERPRETED else 8
# A pass compares every column with every pivot, so its work grows with the pivots faster than
# its launches shrink: on an H100 at V = 128,256 (bench/gpu/topk_split.py) 8 pivots beat 64 by
# 1.6x at one request and 5.6x at eight.
_SPLIT_PIVOTS = 8
# Rows too few to fill the device are split at least this fine (128,256 columns 8 ways): a row's
# search is dependent passes over its columns.
_SPLIT_COLUMNS = 16384
_PROGRAMS_PER_SM = 2


class RowTiles(NamedTuple):
    rows: int  # rows per program
    block_v: int  # columns per chunk of a pass
    search_block_v: int  # columns per chunk of a threshold-search pass
    num_pivots: int
    max_passes: int  # a bound the search never needs on valid rows (threshold.py)
    num_warps: int


class RequestTiles(NamedTuple):
    requests: int  # requests per program
    block_v: int  # columns per chunk of the final-row pass
    num_splits: int  # programs sharing one final row
    split_width: int  # columns per split, a multiple of block_v
    num_warps: int


class SplitTiles(NamedTuple):
    num_splits: int  # programs sharing one row
    split_width: int  # columns per split, a multiple of block_v and search_block_v
    block_v: int  # columns per chunk of the statistics pass
    search_block_v: int  # columns per chunk of a threshold-search pass
    num_pivots: int
    max_passes: int  # search launches: threshold.py's bound on the passes
    num_warps: int


def row_tiles(num_rows: int, vocab: int) -> RowTiles:
    block_v = min(triton.next_power_of_2(vocab), _TILE)
    rows = min(_TILE // block_v, triton.next_power_of_2(max(num_rows, 1)))
    search_block_v = max(1, min(block_v, _SEARCH_TILE // (rows * _NUM_PIVOTS)))
    max_passes = math.ceil(32 / math.log2(_NUM_PIVOTS + 1)) + 1
    return RowTiles(rows, block_v, search_block_v, _NUM_PIVOTS, max_passes, _num_warps(rows * block_v))


def split_tiles(num_rows: int, vocab: int, device: torch.device) -> SplitTiles | None:
    """How to split rows whose top-k / top-p thresholds are searched, or None to keep one program
    per row (rows enough to fill the device, a small vocabulary, or the interpreter). Rows that
    fill the device run best unsplit: 64 requests x 6 rows at V = 128,256 on an H100 took 7.1 ms
    unsplit, 7.8 ms split 8 ways."""
    if INTERPRETED or device.type != "cuda":
        return None
    wanted = _PROGRAMS_PER_SM * _num_sms(device.index)
    if num_rows >= wanted:
        return None
    block_v = min(triton.next_power_of_2(vocab), _TILE)
    splits = min(triton.cdiv(vocab, block_v),
                 max(triton.cdiv(vocab, _SPLIT_COLUMNS), wanted // max(num_rows, 1)))
    if splits < 2:
        return None
    return split_shape(vocab, splits, block_v, _SPLIT_PIVOTS)


def split_shape(vocab: int, splits: int, block_v: int, num_pivots: int) -> SplitTiles:
    """`splits` programs per row (fewer when the columns run out), tiles of block_v columns."""
    search_block_v = max(1, min(block_v, _SEARCH_TILE // num_pivots))
    width = triton.cdiv(triton.cdiv(vocab, splits), block_v) * block_v
    max_passes = math.ceil(32 / math.log2(num_pivots + 1)) + 1
    return SplitTiles(triton.cdiv(vocab, width), width, block_v, search_block_v, num_pivots, max_passes,
                      _num_warps(block_v))


def request_tiles(batch: int, vocab: int, device: torch.device, racing: bool) -> RequestTiles:
    """racing: some request samples a final token (not all greedy)."""
    block_v = min(triton.next_power_of_2(vocab), _TILE)
    requests = min(_TILE // block_v, triton.next_power_of_2(batch))
    chunks = triton.cdiv(vocab, block_v)
    splits = 1
    if racing and not INTERPRETED and device.type == "cuda":
        wanted = _PROGRAMS_PER_SM * _num_sms(device.index)
        splits = max(1, min(chunks, wanted // triton.cdiv(batch, requests)))
    width = triton.cdiv(chunks, splits) * block_v
    return RequestTiles(requests, block_v, triton.cdiv(vocab, width), width, _num_warps(requests * block_v))


def empty(shape: int | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the kernels fill; the tests poison it to prove each value read is written."""
    return torch.empty(shape, dtype=dtype, device=device)


def _num_warps(tile: int) -> int:
    return 8 if tile >= 2048 else 4


@functools.lru_cache(maxsize=None)
def _num_sms(index: int | None) -> int:
    device = torch.cuda.current_device() if index is None else index
    return torch.cuda.get_device_properties(device).multi_processor_count
