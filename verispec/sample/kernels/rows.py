"""What the statistics kernels (row_stats.py, split_rows.py) share about a logits row: its
statistics record, and the request, draft slot and per-request scales of the row.

Target rows come K_b + 1 per request (drafts, then the bonus row); draft logit rows K_b per
request. The request of a row is found by binary search over cu_num_draft_tokens, so a launch
needs no index tensors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class RowStats(NamedTuple):
    """Statistics of processed rows (row_stats.py's module docstring)."""

    row_max: torch.Tensor  # [num_rows] float32
    lse: torch.Tensor  # [num_rows] float32
    threshold: torch.Tensor  # [num_rows] float32
    argmax: torch.Tensor  # [num_rows] int32 (target rows; empty for draft rows)
    gathered: torch.Tensor  # [num_draft_tokens] float32


@triton.jit
def request_of_row(
    rows,  # [ROWS] int32 row indices
    cu_ptr,  # [batch_size + 1] cumulative draft counts
    batch,
    steps,  # >= ceil(log2(batch))
    BONUS_ROW: tl.constexpr,  # 1 for target rows (K_b + 1 per request), 0 for draft rows (K_b)
):
    """[ROWS] int32: the request b whose rows [start(b), start(b + 1)) hold the row, where
    start(b) = cu[b] + b * BONUS_ROW.

    The largest b with start(b) <= row; requests with no rows share their start with the next
    one, so the largest is the one that owns the row.
    """
    lo = tl.zeros_like(rows)
    hi = tl.zeros_like(rows) + batch
    for _ in range(steps):
        mid = (lo + hi) // 2
        start = tl.load(cu_ptr + mid).to(tl.int32) + mid * BONUS_ROW
        lo = tl.where(start <= rows, mid, lo)
        hi = tl.where(start <= rows, hi, mid)
    return lo


@triton.jit
def row_context(
    rows,  # [ROWS] int32 row indices
    live,  # [ROWS] bool, rows < num_rows
    cu_ptr,  # [batch_size + 1] cumulative draft counts
    temperature_ptr,  # [batch_size] float32, 0 for greedy
    gamma_ptr,  # [batch_size] float32 guidance scale
    batch,
    steps,  # >= ceil(log2(batch))
    BONUS_ROW: tl.constexpr,
):
    """([ROWS] request, [ROWS] draft index of the row's draft token, [ROWS] bool the row has a
    draft token, [ROWS] effective temperature (1 for greedy), [ROWS] guidance scale)."""
    req = request_of_row(rows, cu_ptr, batch, steps, BONUS_ROW)
    first_draft = tl.load(cu_ptr + req, mask=live, other=0)
    num_draft = tl.load(cu_ptr + req + 1, mask=live, other=0) - first_draft
    position = rows - first_draft - req * BONUS_ROW
    temperature = tl.load(temperature_ptr + req, mask=live, other=1.0)
    temperature = tl.where(temperature > 0, temperature, 1.0)
    gamma = tl.load(gamma_ptr + req, mask=live, other=1.0)
    return req, first_draft + position, live & (position < num_draft), temperature, gamma
