"""The CPU matrix-multiply strategies of verispec.model.linear against plain float32 math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verispec.model import linear as linear_module
from verispec.model.linear import Linear, WideningBuffer, fp32_kinds, skinny_rows, widening_for
from verispec.model.product_choice import ROW_COUNTS, ProductChoice

CPU = torch.device("cpu")


def make_linear(dtype: torch.dtype, widening: WideningBuffer | None, seed: int = 0) -> Linear:
    layer = Linear(16, 10, dtype, CPU, widening)
    gen = torch.Generator().manual_seed(seed)
    layer.weight.copy_(torch.randn(10, 16, generator=gen))
    return layer


@pytest.mark.parametrize("rows", [1, 2, 5, 64, 65, 90])
def test_widened_bf16_products_are_float32_products_rounded_to_bf16(monkeypatch, rows) -> None:
    # Chunks of 3 weight rows (3, 3, 3, 1): several chunks and a short last one.
    monkeypatch.setattr(linear_module, "WIDEN_CHUNK_ELEMENTS", 3 * 16)
    layer = make_linear(torch.bfloat16, WideningBuffer(CPU))
    x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(rows)).bfloat16()
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 10) and out.is_contiguous()
    exact = x.double() @ layer.weight.double().t()
    # Float32 accumulation, then one bf16 rounding: within one bf16 ulp (2^-8 relative) of exact.
    assert ((out.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()


def choose(monkeypatch, kind: str) -> None:
    """This machine's float32 choice, forced: one product at every row count."""
    monkeypatch.setattr(linear_module, "fp32_choice",
                        lambda *shape: ProductChoice((kind,) * len(ROW_COUNTS)))


@pytest.mark.parametrize("kind", fp32_kinds())
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 9, 10, 15, 16, 17, 33, 64, 65])
def test_float32_products_match_f_linear(monkeypatch, rows, kind) -> None:
    choose(monkeypatch, kind)
    layer = make_linear(torch.float32, None)
    assert layer.cpu_fp32 and linear_module.fp32_kind(rows, (10, 16)) == (kind if rows <= 64 else "linear")
    x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(rows))
    out = layer(x)
    assert out.is_contiguous() and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, layer.weight), atol=1e-6, rtol=1e-6)


@pytest.mark.skipif("compiled" not in fp32_kinds(), reason="the compiled kernels did not build")
def test_the_compiled_product_gives_a_row_the_same_bits_whatever_the_other_rows() -> None:
    """Fixed sums per element (csrc/f32linear.h): one row alone, in 5 rows, in 16 (two blocks
    of 8) and under every instruction set give the same bits, within float32 rounding of the
    float64 product (K = 581: a tail of 5 past the last 16 elements)."""
    from verispec.model.quant.kernels import compiled_kernels
    compiled = compiled_kernels()
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(37, 581, generator=gen), torch.randn(16, 581, generator=gen)
    alone = torch.cat([compiled.f32_linear(x[r:r + 1], weight, "generic") for r in range(16)])
    for isa in compiled.f32_isas():
        for rows in (1, 5, 16):
            assert torch.equal(compiled.f32_linear(x[:rows], weight, isa), alone[:rows]), (isa, rows)
    exact = x.double() @ weight.double().T
    assert ((alone.double() - exact).abs() <= 1e-6 * (x.double().abs() @ weight.double().abs().T)).all()
    with pytest.raises(RuntimeError, match="isa='avx9' is unknown"):
        compiled.f32_linear(x, weight, "avx9")


def test_skinny_rows_pads_up_to_the_fast_row_counts() -> None:
    assert [skinny_rows(r) for r in (1, 2, 3, 4, 5, 9, 10, 16, 17, 33, 64)] == \
        [2, 2, 4, 4, 5, 9, 16, 16, 32, 48, 64]


def test_widening_buffer_is_reused_and_grows() -> None:
    buffer = WideningBuffer(CPU)
    big = torch.randn(6, 4).bfloat16()
    first = buffer.widen(big)
    assert first.dtype == torch.float32 and torch.equal(first, big.float())
    small = buffer.widen(big[:2])
    assert small.data_ptr() == first.data_ptr() and torch.equal(small, big[:2].float())
    bigger = buffer.widen(torch.ones(10, 4).bfloat16())
    assert bigger.shape == (10, 4) and bool((bigger == 1).all())


def test_widening_only_for_bf16_on_cpus_without_bf16_arithmetic(monkeypatch) -> None:
    monkeypatch.setattr(linear_module, "cpu_has_bf16_arithmetic", lambda: False)
    assert isinstance(widening_for(torch.bfloat16, CPU), WideningBuffer)
    assert widening_for(torch.float32, CPU) is None
    assert widening_for(torch.bfloat16, torch.device("cuda")) is None
    monkeypatch.setattr(linear_module, "cpu_has_bf16_arithmetic", lambda: True)
    assert widening_for(torch.bfloat16, CPU) is None


def test_cost_rows_follow_the_padding_of_each_strategy(monkeypatch) -> None:
    choose(monkeypatch, "skinny")
    skinny = make_linear(torch.float32, None)
    widened = make_linear(torch.bfloat16, WideningBuffer(CPU))
    native = make_linear(torch.bfloat16, None)
    assert [skinny.cost_rows(r) for r in (1, 3, 7, 17, 65)] == [2, 4, 7, 32, 65]
    assert [widened.cost_rows(r) for r in (1, 3, 17)] == [1, 4, 32]  # one row: the bf16 product
    assert [native.cost_rows(r) for r in (1, 3, 17)] == [1, 3, 17]
    for kind in ("linear", "compiled"):  # products that do not pad
        choose(monkeypatch, kind)
        assert [skinny.cost_rows(r) for r in (1, 3, 7, 17, 65)] == [1, 3, 7, 17, 65]


def test_products_autograd_records_stay_differentiable(monkeypatch) -> None:
    """A head's training multiplies through Linear: the compiled product has no backward, so
    where autograd records, F.linear runs instead."""
    choose(monkeypatch, "compiled")
    layer = make_linear(torch.float32, None)
    layer.weight.requires_grad_(True)
    x = torch.randn(3, 16, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.weight.detach().sum(0).expand(3, 16))
