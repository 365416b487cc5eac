"""The row attention of model/row_attention.py as a Triton kernel, for CUDA tensors (or the
interpreter, TRITON_INTERPRET=1, on the CPU at small shapes).

One program per (row, query head) walks the row's visible positions in tiles of BLOCK_N, then
(trees) the positions its tree mask allows, looks each position's block up in the block table
on the device and keeps an online softmax in float32.
Its grid and arguments depend only on the tensors' shapes and its loop bounds are read on the
device, so a CUDA graph replays it for any lengths; masked lanes are never loaded, so a row reads
no slot outside its own positions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from verispec.model.row_plan import RowPlan

BLOCK_N = 32


@triton.jit
def _tile(
    kv_ptr, tables_ptr, seq, table_stride, value_offset, kv_head, query, dims, dims_ok,
    positions,  # [BLOCK] int64 cache positions
    ok,  # [BLOCK] bool: attended
    best, total, acc,  # the online softmax so far: max, sum of weights, [DIM_PAD] weighted values
    scale, softcap,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, CACHE_BLOCK: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """The softmax state after the keys at `positions` where `ok` (no other lane is loaded)."""
    block = tl.load(tables_ptr + seq * table_stride + positions // CACHE_BLOCK, mask=ok, other=0)
    slot = block * CACHE_BLOCK + positions % CACHE_BLOCK
    offsets = (slot[:, None] * KV_HEADS + kv_head) * HEAD_DIM + dims[None, :]
    lanes = ok[:, None] & dims_ok[None, :]
    keys = tl.load(kv_ptr + offsets, mask=lanes, other=0.0).to(tl.float32)
    scores = tl.sum(keys * query[None, :], axis=1) * scale
    if SOFTCAP:
        scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))  # tanh
    scores = tl.where(ok, scores, float("-inf"))
    newest = tl.maximum(best, tl.max(scores, axis=0))
    shift = tl.where(newest == float("-inf"), 0.0, newest)  # nothing attended yet: no NaN
    weights = tl.exp(scores - shift)
    shrink = tl.exp(best - shift)
    values = tl.load(kv_ptr + value_offset + offsets, mask=lanes, other=0.0).to(tl.float32)
    return newest, total * shrink + tl.sum(weights, axis=0), acc * shrink + tl.sum(weights[:, None] * values, axis=0)


@triton.jit
def _rows_kernel(
    q_ptr,  # [R, num_heads, head_dim]
    kv_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous
    tables_ptr,  # [B, max_blocks] int64, contiguous
    row_seq_ptr,  # [R] int64
    row_first_ptr,  # [R] int64
    row_visible_ptr,  # [R] int64
    tree_start_ptr,  # [R] int64 (TREE_COLS)
    tree_mask_ptr,  # [R, TREE_COLS] uint8, contiguous (TREE_COLS)
    out_ptr,  # [R, num_heads * head_dim], contiguous
    q_row_stride, q_head_stride,
    value_offset,  # elements from the keys to the values: num_blocks * block_size * kv_heads * head_dim
    table_stride,
    scale, softcap,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    CACHE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
    TREE_COLS: tl.constexpr, TREE_BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    dims = tl.arange(0, DIM_PAD)
    dims_ok = dims < HEAD_DIM
    query = tl.load(q_ptr + row * q_row_stride + head * q_head_stride + dims, mask=dims_ok,
                    other=0.0).to(tl.float32)
    seq = tl.load(row_seq_ptr + row)
    first = tl.load(row_first_ptr + row)
    visible = tl.load(row_visible_ptr + row)
    best = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)
    acc = tl.zeros((DIM_PAD,), tl.float32)
    for start in range((first // BLOCK_N) * BLOCK_N, visible, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        ok = (positions >= first) & (positions < visible)
        best, total, acc = _tile(kv_ptr, tables_ptr, seq, table_stride, value_offset, kv_head, query, dims,
                                 dims_ok, positions, ok, best, total, acc, scale, softcap,
                                 KV_HEADS, HEAD_DIM, CACHE_BLOCK, SOFTCAP)
    if TREE_COLS > 0:
        columns = tl.arange(0, TREE_BLOCK)
        inside = columns < TREE_COLS
        ok = inside & (tl.load(tree_mask_ptr + row * TREE_COLS + columns, mask=inside, other=0) != 0)
        positions = tl.load(tree_start_ptr + row) + columns
        best, total, acc = _tile(kv_ptr, tables_ptr, seq, table_stride, value_offset, kv_head, query, dims,
                                 dims_ok, positions, ok, best, total, acc, scale, softcap,
                                 KV_HEADS, HEAD_DIM, CACHE_BLOCK, SOFTCAP)
    out = acc / total
    tl.store(out_ptr + row * (KV_HEADS * GROUP * HEAD_DIM) + head * HEAD_DIM + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims_ok)


def attend_rows_triton(
    q: torch.Tensor,  # [R, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    plan: RowPlan,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:  # [R, num_heads * head_dim] in q's dtype
    """Every row sees at least one position."""
    rows, heads, head_dim = q.shape
    _, num_blocks, block_size, kv_heads, _ = kv_cache.shape
    block_tables = plan.block_tables
    if not (kv_cache.is_contiguous() and block_tables.is_contiguous()):
        raise ValueError("kv_cache and block_tables must be contiguous")
    out = q.new_empty(rows, heads * head_dim)
    if rows == 0:
        return out
    tree_cols = plan.tree_mask.shape[1]
    _rows_kernel[(rows, heads)](
        q, kv_cache, block_tables, plan.row_seq, plan.row_first, plan.row_visible, plan.row_tree_start,
        plan.tree_mask.contiguous().view(torch.uint8), out,
        q.stride(0), q.stride(1), num_blocks * block_size * kv_heads * head_dim, block_tables.stride(0),
        scale, 1.0 if softcap is None else softcap,
        KV_HEADS=kv_heads, GROUP=heads // kv_heads, HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim), CACHE_BLOCK=block_size, BLOCK_N=BLOCK_N,
        SOFTCAP=softcap is not None, TREE_COLS=tree_cols, TREE_BLOCK=triton.next_power_of_2(max(tree_cols, 1)),
    )
    return out
