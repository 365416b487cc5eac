"""Training-time test (EAGLE-3): an EAGLE head run over packed training sequences at several
draft depths at once, each row attending to exactly what it would attend to while drafting.

Terms (head positions and features as in spec_decode/heads.py): *pass* j at row t is the head at
position t when the newest confirmed position is t - j, i.e. the j-th draft of a chain.
- Pass 0 is fed the true feature f_t; pass j >= 1 is fed the feature pass j - 1 predicted at
  row t - 1, as drafting feeds a predicted feature (gradients flow through it: the head learns
  features that serve its later drafts, not only its next one).
- Row t of pass j attends to pass 0's keys at positions <= t - j of its sequence (the
  confirmed ones, cached with true features) and to the keys of passes 1 .. j at rows
  t - j + 1 .. t (the drafts of the same chain before it, and itself). Pass 0 is plain causal
  attention.
- A row of pass j is *valid* when position t - j is in its sequence: a chain starts after at
  least one confirmed position. Invalid rows are computed (they keep the tensors rectangular)
  and left out of the loss.
Attention is dense per step (a step packs about a thousand tokens), with a mask built from
sequence ids, instead of the paged cache drafting uses: every pass's keys must stay readable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.llama import rms_norm
from ..model.rotary import apply_rotary_
from ..spec_decode.heads import EagleHead


def unrolled_passes(
    head: EagleHead,
    features: torch.Tensor,  # [T, d] true features f_t of every row (as head.features makes them)
    input_ids: torch.Tensor,  # [T] int64, x_{t+1} of each row
    positions: torch.Tensor,  # [T] int64, t within the row's sequence
    passes: int,
) -> list[torch.Tensor]:  # passes x [T, d], the predicted f_{t+1} of each row at each depth
    """The head's output at depths 0 .. passes - 1 (module docstring); rows of one sequence are
    consecutive, with positions 0, 1, ... (a row at position 0 starts a sequence)."""
    layer, T = head.layer, features.shape[0]
    heads, kv_heads, head_dim = layer.heads, layer.kv_heads, layer.head_dim
    group = heads // kv_heads
    sequence = (positions == 0).cumsum(0)  # [T] sequence id of each row
    rows = torch.arange(T, device=features.device)
    same = sequence[:, None] == sequence[None, :]  # [T, T]
    embedded = head._target_embed(input_ids)
    cos, sin = head.rotary.angles(positions)
    keys: list[torch.Tensor] = []  # per pass [T, kv_heads, head_dim]
    values: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    fed = features
    for j in range(passes):
        if j:
            # Row t is fed what the previous pass predicted at row t - 1.
            fed = _rows_above(outputs[-1], 1)
        hidden = head.fc(torch.cat((embedded, fed), dim=-1))
        qkv = layer.qkv_proj(rms_norm(hidden, layer.input_norm, layer.eps)).view(T, -1, head_dim)
        qk = qkv[:, : heads + kv_heads].clone()
        apply_rotary_(qk, cos, sin)
        q = qk[:, :heads].view(T, kv_heads, group, head_dim) * head_dim**-0.5
        keys.append(qk[:, heads:])
        values.append(qkv[:, heads + kv_heads :])
        confirmed = same & (rows[None, :] <= rows[:, None] - j)  # [T, T]: pass 0's keys
        scores = [torch.einsum("tkgd,skd->tkgs", q, keys[0]).masked_fill(~confirmed[:, None, None, :], float("-inf"))]
        chain_values = []
        for i in range(1, j + 1):
            # The chain's draft at depth i sits j - i rows above.
            shift = j - i
            k, v = _rows_above(keys[i], shift), _rows_above(values[i], shift)
            in_sequence = positions >= shift  # row t - shift is in row t's sequence
            scores.append(torch.einsum("tkgd,tkd->tkg", q, k).masked_fill(~in_sequence[:, None, None], float("-inf"))[..., None])
            chain_values.append(v)
        weights = torch.cat(scores, dim=-1).softmax(-1)  # [T, kv_heads, group, T + j]
        attended = torch.einsum("tkgs,skd->tkgd", weights[..., :T], values[0])
        for i, v in enumerate(chain_values):
            attended = attended + weights[..., T + i, None] * v[:, :, None, :]
        hidden = hidden + layer.o_proj(attended.reshape(T, heads * head_dim))
        gate_up = layer.gate_up_proj(rms_norm(hidden, layer.post_attention_norm, layer.eps))
        hidden = hidden + layer.down_proj(F.silu(gate_up[:, : layer.inter]) * gate_up[:, layer.inter :])
        outputs.append(hidden)
    return outputs


def _rows_above(
    x: torch.Tensor,  # [T, ...]
    n: int,
) -> torch.Tensor:  # [T, ...]: row t holds x[t - n]; the first n rows (never valid) repeat row 0
    return torch.cat((x[:1].expand(n, *x.shape[1:]), x[: x.shape[0] - n])) if n else x


def valid_rows(
    positions: torch.Tensor,  # [T] int64
    depth: int,
) -> torch.Tensor:  # [T] bool
    """Rows whose pass `depth` chain starts inside their sequence (t - depth >= 0)."""
    return positions >= depth
