"""Attention of new tokens described row by row (model/attention.py's row plans): row r reads row
row_seq[r] of the block table and attends positions row_first[r] .. row_visible[r] - 1 of the
paged cache, plus for a tree row the new positions row_tree_start[r] + j where tree_mask[r, j].
A row touches no slot outside those, so what the rest of the cache or of its block-table row
holds (unwritten slots, released blocks, a padding row's reserved block) never reaches it.

Which implementation runs is decided once per device type: the compiled kernel on the CPU where
the extension is built (verispec.cpu_kernels), the Triton kernel on CUDA, and everywhere else the
torch reference below, which the other two are tested against.
"""

from __future__ import annotations

from functools import cache

import torch

from verispec.model.quant.kernels import compiled_kernels
from verispec.model.row_plan import RowPlan


def attend_rows(
    q: torch.Tensor,  # [R, num_heads, head_dim], rotary applied
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    plan: RowPlan,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:  # [R, num_heads * head_dim] in q's dtype
    """The rows' attention outputs (module docstring), with `backend_for(q.device.type)`."""
    backend = backend_for(q.device.type) if q.dtype == torch.float32 or q.device.type != "cpu" \
        else "torch"
    if backend == "compiled":
        return compiled_kernels().paged_attention_rows(
            q, kv_cache, plan.block_tables, plan.row_seq, plan.row_first, plan.row_visible,
            plan.row_tree_start, plan.tree_mask, scale, 0.0 if softcap is None else softcap)
    if backend == "triton":
        from verispec.model.triton_attention import attend_rows_triton

        return attend_rows_triton(q, kv_cache, plan, scale, softcap)
    return attend_rows_torch(q, kv_cache, plan, scale, softcap)


@cache
def backend_for(device_type: str) -> str:
    """"compiled", "triton" or "torch" for float32 queries on `device_type` (bf16 queries on the
    CPU take the torch reference: the compiled kernel reads float32 queries)."""
    if device_type == "cpu":
        return "compiled" if compiled_kernels() is not None else "torch"
    return "triton" if device_type == "cuda" else "torch"


def attend_rows_torch(
    q: torch.Tensor,  # [R, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    plan: RowPlan,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:  # [R, num_heads * head_dim]
    """The reference: every row gathers its table's whole width (fixed shapes, no host value),
    reads slot 0 where it sees nothing and zeroes those keys' values, so a NaN there cannot
    leak through a zero weight; scores and softmax in float32."""
    rows, heads, head_dim = q.shape
    _, num_blocks, block_size, kv_heads, _ = kv_cache.shape
    width = plan.block_tables.shape[1] * block_size
    positions = torch.arange(width, device=q.device)
    seen = (positions >= plan.row_first[:, None]) & (positions < plan.row_visible[:, None])  # [R, S]
    tree_mask = plan.tree_mask
    if tree_mask.shape[1]:
        offset = positions[None, :] - plan.row_tree_start[:, None]
        inside = (offset >= 0) & (offset < tree_mask.shape[1])
        seen |= inside & tree_mask.gather(1, offset.clamp(0, tree_mask.shape[1] - 1))
    tables = plan.block_tables.index_select(0, plan.row_seq)  # [R, max_blocks]
    slots = tables.repeat_interleave(block_size, dim=1) * block_size + positions % block_size
    slots = torch.where(seen, slots, torch.zeros_like(slots))
    flat = kv_cache.view(2, num_blocks * block_size, kv_heads, head_dim)
    keys = flat[0].index_select(0, slots.reshape(-1)).view(rows, width, kv_heads, head_dim).float()
    values = flat[1].index_select(0, slots.reshape(-1)).view(rows, width, kv_heads, head_dim).float()
    values = values.masked_fill(~seen[:, :, None, None], 0.0)
    grouped = q.float().view(rows, kv_heads, heads // kv_heads, head_dim)
    scores = torch.einsum("rkgd,rskd->rkgs", grouped, keys) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    out = torch.einsum("rkgs,rskd->rkgd", scores.softmax(dim=-1), values)
    return out.reshape(rows, heads * head_dim).to(q.dtype)
