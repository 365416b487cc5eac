"""Index bookkeeping of a ragged batch of draft chains, and the pieces every verifier shares
(rejection.py, block.py, tree.py, the drafters' sampling): which drafts lead a request without
a failure, the emitted-token layout, inverse-CDF sampling. Terms as in rejection.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..model.quant.kernels import compiled_kernels
from .types import PLACEHOLDER_TOKEN_ID, RejectionOutput


class Layout(NamedTuple):
    """Index bookkeeping of a ragged batch, all on the device."""

    num_draft: torch.Tensor  # [B] K_b
    draft_start: torch.Tensor  # [B] first draft index of each request
    req_of_row: torch.Tensor  # [N] request of each target row
    req_of_draft: torch.Tensor  # [D] request of each draft token
    pos_of_draft: torch.Tensor  # [D] position of each draft token within its request
    row_of_draft: torch.Tensor  # [D] target row of each draft token


def layout(cu: torch.Tensor, num_rows: int, device: torch.device) -> Layout:
    cu = cu.to(device=device, dtype=torch.int64)
    batch = cu.shape[0] - 1
    num_draft = cu[1:] - cu[:-1]
    requests = torch.arange(batch, device=device)
    req_of_row = torch.repeat_interleave(requests, num_draft + 1, output_size=num_rows)
    req_of_draft = torch.repeat_interleave(requests, num_draft, output_size=num_rows - batch)
    draft_index = torch.arange(num_rows - batch, device=device)
    return Layout(
        num_draft=num_draft,
        draft_start=cu[:-1],
        req_of_row=req_of_row,
        req_of_draft=req_of_draft,
        pos_of_draft=draft_index - cu[:-1][req_of_draft],
        row_of_draft=draft_index + req_of_draft,
    )


def leading_run(
    ok: torch.Tensor,  # [D] bool per draft
    lay: Layout,
    max_k: int,
) -> torch.Tensor:  # [B] int64: how many of each request's first drafts are ok
    grid = torch.zeros(lay.num_draft.shape[0], max_k, dtype=torch.bool, device=ok.device)
    grid[lay.req_of_draft, lay.pos_of_draft] = ok
    return grid.to(torch.int64).cumprod(dim=1).sum(dim=1)


def emitted_output(
    ids: torch.Tensor,  # [D] draft ids
    lay: Layout,
    num_accepted: torch.Tensor,  # [B]
    final_token: torch.Tensor,  # [B] the recovered or bonus token
    max_k: int,
) -> RejectionOutput:
    """Each request's accepted drafts, then its final token, then placeholders."""
    drafts = torch.full((num_accepted.shape[0], max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64,
                        device=ids.device)
    drafts[lay.req_of_draft, lay.pos_of_draft] = ids
    slot = torch.arange(max_k + 1, device=ids.device)[None, :]
    n = num_accepted[:, None]
    token_ids = torch.where(slot < n, drafts, torch.where(slot == n, final_token[:, None], PLACEHOLDER_TOKEN_ID))
    return RejectionOutput(token_ids, num_accepted + 1, num_accepted)


def sample_inverse_cdf(
    weights: torch.Tensor,  # [B, V] non-negative, unnormalised
    u: torch.Tensor,  # [B] float64 uniform in (0, 1)
) -> torch.Tensor:  # [B] int64
    """One draw per row from weights / sum(weights), using one uniform per row.

    The running sum is float64, so rounding cannot favour or starve a token measurably; a token
    with zero weight is never chosen (searchsorted finds a strictly increasing step). On CPU the
    compiled kernels draw the same token without the float64 copy and cumsum of every row (at
    batch 16 those were a third of the sampled verifier's time).
    """
    compiled = compiled_kernels()
    if compiled is not None and weights.device.type == "cpu" and weights.dtype in (torch.float32, torch.float64):
        return compiled.inverse_cdf(weights.contiguous(), u.to(torch.float64).contiguous())
    cdf = weights.double().cumsum(dim=-1)
    target = u * cdf[:, -1]
    index = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    return index.clamp(max=weights.shape[-1] - 1)
