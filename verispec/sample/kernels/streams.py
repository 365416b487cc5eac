"""Counter-based random numbers inside kernels: the streams of ``verispec.sample.rng`` in Triton.

``stream`` reproduces, bit for bit, the 64 bits behind ``rng.uniform(key, position, purpose)``
(splitmix64 on uint64: wrapping multiplication, logical shifts), so ``uniform`` equals
``rng.uniform`` exactly and acceptance decisions agree with the native path.

The final-token sample is an exponential race, which needs one Exp(1) variate per column: column
v of a stream s takes the v-th output of the SplitMix64 generator seeded with s,
splitmix64(s + v * golden). Nothing is carried between columns, so any split of a row across
programs draws the same numbers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import rng

ACCEPT = tl.constexpr(rng.ACCEPT)
SAMPLE = tl.constexpr(rng.SAMPLE)
_GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
_M1 = tl.constexpr(0xBF58476D1CE4E5B9)
_M2 = tl.constexpr(0x94D049BB133111EB)
_TWO_POW_M53 = tl.constexpr(2.0**-53)
_TWO_POW_M64 = tl.constexpr(2.0**-64)
_BELOW_ONE = tl.constexpr(1.0 - 2.0**-24)  # the largest float32 below 1
_SERIES_BELOW = tl.constexpr(2.0**-7)


@triton.jit
def splitmix64(x):
    """x: uint64 tensor -> uint64 tensor (rng.splitmix64 on unsigned bits)."""
    z = x + _GOLDEN
    z = (z ^ (z >> 30)) * _M1
    z = (z ^ (z >> 27)) * _M2
    return z ^ (z >> 31)


@triton.jit
def stream(key, position, purpose: tl.constexpr):
    """key: [R] int64 request keys, position: [R] int -> [R] uint64 stream bits."""
    k = key.to(tl.uint64, bitcast=True)
    p = position.to(tl.int64).to(tl.uint64, bitcast=True)
    return splitmix64(k ^ splitmix64(p * 8 + purpose))


@triton.jit
def uniform(key, position, purpose: tl.constexpr):
    """[R] float64 on (0, 1), equal to rng.uniform(key, position, purpose)."""
    bits = stream(key, position, purpose)
    return ((bits >> 11).to(tl.float64) + 0.5) * _TWO_POW_M53


@triton.jit
def exponential(stream_bits, column):
    """stream_bits: [R, 1] uint64, column: [1, C] int -> [R, C] float32 Exp(1) variates.

    E = -log(1 - v) with v uniform. A token of tiny weight w wins the race only through a tiny
    E, so E must keep its relative precision near 0: v comes from all 64 bits (float32 keeps
    their leading 24, whatever their magnitude), and below 2^-7 a series replaces the log,
    where 1 - v would round.
    """
    bits = splitmix64(stream_bits + column.to(tl.uint64) * _GOLDEN)
    v = tl.minimum(bits.to(tl.float32) * _TWO_POW_M64 + _TWO_POW_M64, _BELOW_ONE)
    series = v * (1.0 + v * (0.5 + v * (1.0 / 3.0 + v * 0.25)))
    return tl.where(v < _SERIES_BELOW, series, -tl.log(1.0 - v))
