"""The counter-based streams: pinned to a plain-integer splitmix64, uniform, and open (0, 1)."""

from __future__ import annotations

import torch

from tests.stats import chi_square
from verispec.sample.rng import fresh_seed, splitmix64, splitmix64_int, uniform


def test_tensor_hash_equals_integer_hash() -> None:
    xs = [0, 1, 2, 12345, 2**62 + 7, -1, -(2**63), 2**63 - 1]
    got = splitmix64(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [splitmix64_int(x & (2**64 - 1)) for x in xs]


def test_uniform_is_uniform_on_open_interval() -> None:
    n = 200_000
    u = uniform(torch.full((n,), 42, dtype=torch.int64), torch.arange(n), purpose=1)
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    result = chi_square((u * 50).long(), torch.full((50,), 1 / 50, dtype=torch.float64))
    assert result.passed, result


def test_purposes_and_positions_give_independent_streams() -> None:
    n = 100_000
    keys = torch.arange(n, dtype=torch.int64)
    a = uniform(keys, torch.zeros(n, dtype=torch.int64), purpose=1)
    b = uniform(keys, torch.zeros(n, dtype=torch.int64), purpose=2)
    c = uniform(keys, torch.ones(n, dtype=torch.int64), purpose=1)
    pairs = (a * 10).long() * 10 + (b * 10).long()
    assert chi_square(pairs, torch.full((100,), 0.01, dtype=torch.float64)).passed
    pairs = (a * 10).long() * 10 + (c * 10).long()
    assert chi_square(pairs, torch.full((100,), 0.01, dtype=torch.float64)).passed


def test_fresh_seeds_differ() -> None:
    assert len({fresh_seed() for _ in range(100)}) == 100
