"""Rotary position embeddings, Llama style (rotate-half convention, as in Hugging Face).

A head vector x = [x1, x2] (two halves) at position p becomes x * cos + rotate_half(x) * sin
with rotate_half(x) = [-x2, x1] and angles p * theta^(-2i / head_dim). Cos and sin are computed
once per forward for all positions and shared by every layer; nothing is cached across calls,
so positions are unbounded.

Scaled variants (verispec.model.config.RopeScaling) change the frequencies as transformers'
modeling_rope_utils does. Two of them depend on the sequence length in transformers, which
recomputes the frequencies of the whole forward pass from its largest position: "dynamic" and
"longrope". With a KV cache that would give one token different angles in different steps, so
here each token's angles depend on its own position only (p + 1 as the length): the same as
transformers for every sequence up to original_max_position_embeddings, and well defined beyond.
"""

from __future__ import annotations

import math

import torch

from verispec.model.config import RopeScaling


def _exponents(head_dim: int, device: torch.device) -> torch.Tensor:  # [head_dim // 2] float32
    return torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(theta: float, head_dim: int, s: RopeScaling,
          device: torch.device) -> tuple[torch.Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = s.factor
    attention = s.attention_factor
    if attention is None:
        attention = mscale(factor, s.mscale) / mscale(factor, s.mscale_all_dim) \
            if s.mscale and s.mscale_all_dim else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(s.original_max_position_embeddings
                                   / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(device=device, dtype=torch.float) / head_dim)
    extrapolation = 1 - ramp.to(device)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


class RotaryEmbedding:
    """Angles for a head width, base theta and optional scaling: `angles` once per forward, then
    `apply_rotary_` in every layer.

    max_position_embeddings: the checkpoint's context length, which "dynamic" scaling grows
    from and "longrope" derives its default factor from."""

    def __init__(self, head_dim: int, theta: float, dtype: torch.dtype, device: torch.device,
                 scaling: RopeScaling | None = None, max_position_embeddings: int = 2048) -> None:
        self.dtype, self.head_dim, self.theta = dtype, head_dim, theta
        self.scaling, self.attention_factor = scaling, 1.0
        self.inv_freq = 1.0 / (theta ** _exponents(head_dim, device))  # [head_dim // 2] float32
        # Per-token variants (module docstring): the frequencies past `self.switch` tokens.
        self.switch: int | None = None
        self.long_inv_freq: torch.Tensor | None = None
        # Position-only angles on the CPU, computed once for positions 0 .. len - 1 (`angles`):
        # cos and sin, [len, 1, head_dim] each.
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None
        if scaling is None:
            return
        kind = scaling.rope_type
        original = scaling.original_max_position_embeddings
        if kind == "linear":
            self.inv_freq = self.inv_freq / scaling.factor
        elif kind == "llama3":
            self.inv_freq = _llama3(self.inv_freq, scaling)
        elif kind == "yarn":
            self.inv_freq, self.attention_factor = _yarn(theta, head_dim, scaling, device)
        elif kind == "freq_factors":
            self.inv_freq = self.inv_freq / torch.tensor(scaling.short_factor, device=device)
        elif kind == "dynamic":  # transformers grows from max_position_embeddings here
            self.switch = max_position_embeddings
        elif kind == "longrope":
            factor = scaling.factor
            self.attention_factor = scaling.attention_factor or (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
            shape = theta ** _exponents(head_dim, device)
            self.inv_freq = 1.0 / (torch.tensor(scaling.short_factor, device=device) * shape)
            self.long_inv_freq = 1.0 / (torch.tensor(scaling.long_factor, device=device) * shape)
            self.switch = original

    def _token_inv_freq(self, positions: torch.Tensor) -> torch.Tensor:  # [T] -> [T, head_dim // 2]
        lengths = positions[:, None] + 1
        beyond = lengths > self.switch
        if self.long_inv_freq is not None:
            return torch.where(beyond, self.long_inv_freq[None, :], self.inv_freq[None, :])
        # Dynamic NTK: base * (factor * length / original - (factor - 1)) ^ (d / (d - 2)).
        factor, d = self.scaling.factor, self.head_dim
        grown = (factor * lengths.double() / self.switch - (factor - 1)) ** (d / (d - 2))
        base = torch.where(beyond, self.theta * grown, torch.full_like(grown, self.theta))
        return (1.0 / base ** _exponents(d, positions.device).double()[None, :]).float()

    def angles(
        self, positions: torch.Tensor,  # [T] int64
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, 1, head_dim], [T, 1, head_dim])
        """cos and sign-folded sin, in the model dtype, broadcastable over heads. On the CPU,
        where they depend on the position alone (no per-token scaling), rows of a table computed
        once and grown by doubling: the same values (each computed on its own, elementwise), for
        two index_selects instead of ~10 operations a step. (On a GPU reading the largest
        position would wait for the device, and a captured graph cannot.)"""
        if self.switch is not None or positions.device.type != "cpu":
            return self._computed(positions)
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if self._table is None or needed > self._table[0].shape[0]:
            size = max(needed, 2 * (0 if self._table is None else self._table[0].shape[0]), 256)
            self._table = self._computed(torch.arange(size))
        return self._table[0].index_select(0, positions), self._table[1].index_select(0, positions)

    def _computed(
        self, positions: torch.Tensor,  # [T] int64
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, 1, head_dim], [T, 1, head_dim])
        if self.switch is None:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]  # float32 as in HF
        else:
            freqs = positions.float()[:, None] * self._token_inv_freq(positions)
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
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
