"""The compiled sampling helpers (csrc/sampling.h) against the torch operations they replace on
CPU: the same values and the same tokens, bit for bit, so the choice of path changes no output."""

import pytest
import torch

from verispec.model.quant.kernels import compiled_kernels
from verispec.sample import ragged, rng


@pytest.fixture
def compiled():
    module = compiled_kernels()
    if module is None:
        pytest.skip("the compiled kernels are not built here")
    return module


def _torch_inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = weights.double().cumsum(dim=-1)
    index = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return index.clamp(max=weights.shape[-1] - 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inverse_cdf_draws_what_searchsorted_over_the_cumsum_does(compiled, dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = (torch.rand(40, 3000, generator=gen) ** 12).to(dtype)
    weights[1] = 0  # no mass: the last column, as the clamp gives
    weights[2, :2999] = 0  # all mass on the last column
    weights[3, 1:] = 0  # all mass on the first
    weights[4, ::2] = 0  # zero weights between others are never drawn
    u = torch.rand(40, generator=gen, dtype=torch.float64)
    u[5], u[6] = 2.0 ** -53 * 0.5, 1 - 2.0 ** -53  # the extremes of rng.uniform
    drawn = compiled.inverse_cdf(weights.contiguous(), u)
    assert torch.equal(drawn, _torch_inverse_cdf(weights, u))
    assert drawn[1] == 2999 and drawn[2] == 2999 and drawn[3] == 0 and (drawn[4] % 2 == 1)
    assert torch.equal(ragged.sample_inverse_cdf(weights, u), drawn)  # the path verispec takes


def test_top_values_are_topks_values(compiled) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 49152, generator=gen) * 4
    x[0, 100:400] = x[0].max()  # ties across the boundary of the top 256
    x[1] = 0.5  # every value tied
    x[2, 1000:] = float("-inf")  # a masked row (guided, banned tokens)
    x[3, ::3] = float("-inf")
    for width in (1, 50, 256, 3072, 3073, 49152):  # 3072 = 49152 / 16 groups: the bound's limit
        assert torch.equal(compiled.top_values(x, width), x.topk(width, dim=-1).values), width
    odd = torch.randn(3, 37, generator=gen)  # fewer groups than the width: sorts the row
    assert torch.equal(compiled.top_values(odd, 5), odd.topk(5, dim=-1).values)
    with pytest.raises(RuntimeError, match="width=0"):
        compiled.top_values(x, 0)


def test_the_compiled_streams_are_the_tensor_ones(compiled) -> None:
    edges = [0, 1, -1, 2**63 - 1, -(2**63), 12345, 2**40 + 3]
    seeds = torch.tensor(edges + list(range(50)), dtype=torch.int64)
    steps = torch.tensor(list(reversed(edges)) + list(range(0, 500, 10)), dtype=torch.int64)
    keys = compiled.request_keys(seeds, steps)
    assert torch.equal(keys, rng.splitmix64(seeds ^ rng.splitmix64(steps)))
    assert torch.equal(rng.request_keys(seeds, steps), keys)  # the path verispec takes
    positions = torch.tensor(edges + list(range(50)), dtype=torch.int64)
    for purpose in (rng.ACCEPT, rng.SAMPLE, rng.DRAFT):
        bits = rng.splitmix64(keys ^ rng.splitmix64(positions * 8 + purpose))
        expected = (rng._shr(bits, 11).to(torch.float64) + 0.5) * (2.0 ** -53)
        assert torch.equal(compiled.uniform(keys, positions, purpose), expected)
        assert torch.equal(rng.uniform(keys, positions, purpose), expected)


def test_fill_below_is_the_masked_fill(compiled) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 1000, generator=gen)
    x[0, :10] = float("-inf")
    x[1, 3] = float("nan")  # kept: NaN < t is false, as masked_fill's mask says
    threshold = torch.tensor([[0.5], [float("-inf")], [-0.1], [10.0], [x[4].max().item()]])
    expected = x.masked_fill(x < threshold, float("-inf"))
    assert torch.equal(compiled.fill_below(x, threshold.reshape(-1)).isnan(), expected.isnan())
    same = ~expected.isnan()
    assert torch.equal(compiled.fill_below(x, threshold.reshape(-1))[same], expected[same])
