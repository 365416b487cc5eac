"""The compiled sampling helpers (csrc/sampling.h) against the torch operations they replace on
CPU: the same values and the same tokens, bit for bit, so the choice of path changes no output."""

import pytest
import torch

from verispec.model.quant.kernels import compiled_kernels
from verispec.sample import ragged


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
