"""Rotary position embeddings, Llama style (rotate-half convention, as in Hugging Face).

A head vector x = [x1, x2] (two halves) at position p becomes x * cos + rotate_half(x) * sin
with rotate_half(x) = [-x2, x1] and angles p * theta^(-2i / head_dim). Cos and sin are computed
once per forward for all positions and shared by every layer; nothing is cached across calls,
so positions are unbounded.
"""

from __future__ import annotations

import torch


class RotaryEmbedding:
    """Angles for a head width and base theta: `angles` once per forward, then `apply_rotary_`
    in every layer."""

    def __init__(self, head_dim: int, theta: float, dtype: torch.dtype,
                 device: torch.device) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
        self.inv_freq = 1.0 / (theta ** (exponents / head_dim))  # [head_dim // 2] float32
        self.dtype = dtype

    def angles(
        self, positions: torch.Tensor,  # [T] int64
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, 1, head_dim], [T, 1, head_dim])
        """cos and sign-folded sin, in the model dtype, broadcastable over heads."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # float32 as in HF
        cos, sin = freqs.cos(), freqs.sin()
        # The sign of rotate_half lives in sin, so `apply_rotary_` needs no negation.
        cos = torch.cat((cos, cos), dim=-1).to(self.dtype)
        sin = torch.cat((-sin, sin), dim=-1).to(self.dtype)
        return cos[:, None, :], sin[:, None, :]


def apply_rotary_(
    x: torch.Tensor,  # [T, heads, head_dim], rotated in place (may be a view)
    cos: torch.Tensor,  # [T, 1, head_dim] from RotaryEmbedding.angles
    sin: torch.Tensor,  # [T, 1, head_dim] sign-folded, from RotaryEmbedding.angles
) -> None:
    num_tokens, heads, head_dim = x.shape
    # [x2, x1] by swapping the halves; with sin = [-s, s] this is rotate_half(x) * [s, s].
    halves = x.reshape(num_tokens, heads, 2, head_dim // 2)
    swapped = halves.flip(2).view(num_tokens, heads, head_dim)
    x.mul_(cos).addcmul_(swapped, sin)
