"""Counter-based random streams.

A request's random numbers are a pure function of (seed, step, position, purpose): no generator
state is carried between calls or shared between requests, so a seeded request draws the same
numbers whatever else is in its batch, and a batch needs no per-request Python loop.

The mixing function is splitmix64 (Steele et al. 2014), evaluated on int64 tensors with wrapping
multiplication; right shifts are masked to behave as logical (unsigned) shifts. ``splitmix64_int``
is the same function on Python ints, used by the tests to pin the tensor version down. On CPU
the compiled kernels compute request_keys and uniform in one call each, bit for bit the same
(csrc/sampling.h).

Terms: the *key* of a request at a step is mix(seed, step); a *purpose* separates the streams a
request uses at one position (acceptance test, final-token sample).
"""

from __future__ import annotations

import random

import torch

from ..model.quant.kernels import compiled_kernels

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB

ACCEPT = 1  # purpose: the uniform compared against p/q for a draft token
SAMPLE = 2  # purpose: the uniform that picks the recovered / bonus token
DRAFT = 3  # purpose: the uniform a sampling drafter draws its draft token with


def _signed(x: int) -> int:
    """The int64 bit pattern of an unsigned 64-bit constant."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """x: [...] int64 (any bit pattern) -> [...] int64 mixed bit pattern."""
    z = x + _signed(_GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(_M1)
    z = (z ^ _shr(z, 27)) * _signed(_M2)
    return z ^ _shr(z, 31)


def splitmix64_int(x: int) -> int:
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return _signed(z ^ (z >> 31))


def request_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """seeds: [B] int64, steps: [B] int64 -> [B] int64 keys."""
    compiled = compiled_kernels()
    if compiled is not None and _plain(seeds, steps):
        return compiled.request_keys(seeds.contiguous(), steps.contiguous())
    return splitmix64(seeds ^ splitmix64(steps))


def _plain(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are what the compiled streams take: 1-D int64 CPU, of one length."""
    return a.device.type == b.device.type == "cpu" and a.dtype == b.dtype == torch.int64 \
        and a.dim() == b.dim() == 1 and a.shape == b.shape


def uniform(keys: torch.Tensor, positions: torch.Tensor, purpose: int) -> torch.Tensor:
    """keys: [N] int64, positions: [N] int64 -> [N] float64 uniform on the open interval (0, 1).

    53 random bits, so every representable step of a float64 in [0, 1) is reachable and the
    value is never exactly 0 or 1 (u * q < p can then never accept a token with p = 0).
    """
    compiled = compiled_kernels()
    if compiled is not None and _plain(keys, positions):
        return compiled.uniform(keys.contiguous(), positions.contiguous(), purpose)
    bits = splitmix64(keys ^ splitmix64(positions * 8 + purpose))
    return (_shr(bits, 11).to(torch.float64) + 0.5) * (2.0 ** -53)


_seed_source = random.SystemRandom()


def fresh_seed() -> int:
    """A seed for a request that did not ask for one."""
    return _seed_source.getrandbits(63)
