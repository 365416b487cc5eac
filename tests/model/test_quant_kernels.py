"""The block-quantized products (verispec.model.quant): every kernel this machine runs, and the
torch fallback, against a float64 reference of the same arithmetic; rows independent of their
batch; GGUF blocks read exactly; round-to-nearest blocks reproduce what they dequantize to."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from verispec.model.quant import kernels
from verispec.model.quant.formats import PanelWeight, QuantizedWeight, from_gguf, quantize_rtn

KERNELS = kernels.available_kernels()


def _random_weight(rows: int, columns: int, bits: int, minimum: bool, scales: torch.dtype,
                   seed: int) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, columns * bits // 8), dtype=torch.uint8, generator=g)
    d = (torch.rand(rows, columns // 32, generator=g) * 0.02).to(scales)
    m = (torch.randn(rows, columns // 32, generator=g) * 0.1).to(scales) if minimum else None
    return QuantizedWeight(packed, d, m, bits, 0 if minimum else (8 if bits == 4 else 128))


def _reference(x: torch.Tensor, weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 result of the kernels' arithmetic, and the sum of the terms' magnitudes."""
    xq, xd, xs = kernels.quantize_activations(x)
    rows, columns = x.shape
    groups = columns // 32
    q = weight.unpacked().double().view(-1, groups, 32)
    dots = torch.einsum("mgk,ngk->mng", xq.double().view(rows, groups, 32), q)
    scaled = dots * weight.d.double()[None] * xd.double()[:, None]
    minimums = weight.minimums().double()[None] * (xd.double() * xs.double())[:, None]
    return (scaled + minimums).sum(-1), (scaled.abs() + minimums.abs()).sum(-1)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bits,minimum,scales", [(4, True, torch.float16), (4, False, torch.float16),
                                                 (8, False, torch.float16), (4, True, torch.float32),
                                                 (8, True, torch.float32)])
def test_kernel_equals_float64_reference(kernel, bits, minimum, scales) -> None:
    # 96 columns: three blocks, not a multiple of eight (the kernels' padded scale loop);
    # 37 output columns: no multiple of anything.
    weight = _random_weight(37, 96, bits, minimum, scales, seed=bits)
    for rows in (1, 2, 3, 5, 16, 64):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)) * 3
        y = kernels.qlinear(x, weight, kernel)
        expected, magnitude = _reference(x, weight)
        assert y.shape == (rows, 37) and y.dtype == torch.float32
        # float32 accumulation of the exact integer products: a few ulps of the terms' sum.
        assert ((y.double() - expected).abs() <= 1e-6 * magnitude + 1e-6).all(), kernel


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_rows_result_does_not_depend_on_the_other_rows(kernel) -> None:
    weight = _random_weight(70, 576, 4, True, torch.float16, seed=3)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(0))
    full = kernels.qlinear(x, weight, kernel)
    # 16: two tiles of 8 rows on AVX-512 VNNI, one on AMX; 9, 11: 4 + 5, 5 + 6 on AVX2; 17, 32:
    # two AMX tiles over the same weights; 33, 40: such a pair, then one tile; below 8 rows the
    # amx kernel runs the VNNI path.
    for rows in (1, 2, 5, 7, 9, 11, 16, 17, 32, 33):
        assert torch.equal(kernels.qlinear(x[:rows], weight, kernel), full[:rows])
    assert torch.equal(kernels.qlinear(x[5:6], weight, kernel), full[5:6])


@pytest.mark.parametrize("bits,minimum,scales", [(4, True, torch.float16), (8, False, torch.float16),
                                                 (8, True, torch.float32)])
def test_the_compiled_kernels_agree_bit_for_bit(bits, minimum, scales) -> None:
    # The same float operations per block and row in every variant (csrc/qgemm_kernel.inc), the
    # zero point folded into the exact integers: the instruction set does not change a result.
    compiled = [k for k in KERNELS if k != kernels.FALLBACK]
    if len(compiled) < 2:
        pytest.skip("fewer than two compiled kernels run here")
    weight = _random_weight(40, 160, bits, minimum, scales, seed=11)  # 40: a half-padded panel
    for rows in (6, 20):  # 20: AMX's tiles, where the CPU has them
        x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(2)) * 3
        first = kernels.qlinear(x, weight, compiled[0])
        for kernel in compiled[1:]:
            assert torch.equal(kernels.qlinear(x, weight, kernel), first), kernel


def test_compiled_activation_blocks_equal_the_python_definition() -> None:
    if kernels.compiled_kernels() is None:
        pytest.skip("the compiled kernels are not built")
    x = torch.randn(9, 128) * torch.logspace(-3, 3, 9)[:, None]
    x[2, :32] = 0  # an all-zero block: scale 0, q 0
    x[3, 5] = 0.5 * 127 / x[3, :32].abs().max()  # not a tie in general; ties round half to even
    for ours, theirs in zip(kernels.compiled_kernels().quantize_activations(x), kernels.quantize_activations(x)):
        assert torch.equal(ours, theirs)


def test_the_kernels_run_what_the_cpu_has() -> None:
    assert KERNELS[-1] == kernels.FALLBACK
    if kernels.compiled_kernels() is not None:
        assert "generic" in KERNELS
        flags = open("/proc/cpuinfo").read() if open("/proc/cpuinfo") else ""
        if " avx512_vnni" in flags and " avx512vl" in flags:
            # amx first where the OS also grants the tile data (not visible in the flags alone).
            assert KERNELS[0] in ("amx", "avx512vnni") and "avx512vnni" in KERNELS
            assert KERNELS[0] != "amx" or " amx_int8" in flags
        elif " avx512bw" in flags and " avx512vl" in flags:
            # AVX-512 without VNNI (Skylake-SP): 512-bit pair products, ahead of avx2.
            assert "avx512bw" in KERNELS and "avx2" in KERNELS
            assert KERNELS[0] == ("avxvnni" if " avx_vnni" in flags else "avx512bw")
        elif " avx2" in flags:
            assert "avx2" in KERNELS


def test_forcing_a_kernel_the_machine_lacks_names_the_choices(monkeypatch) -> None:
    monkeypatch.setenv(kernels.ENV, "sse1")
    kernels.default_kernel.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"VERISPEC_CPU_KERNEL='sse1' is not available.*torch"):
            kernels.default_kernel()
    finally:
        kernels.default_kernel.cache_clear()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_are_read_as_stored(kind) -> None:
    values = np.random.default_rng(0).normal(size=(6, 128)).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    raw = quantize(values, qtype)
    weight = from_gguf(raw, kind, 128)
    assert weight.shape == (6, 128) and weight.kind == kind
    assert torch.equal(weight.dequantize(), torch.from_numpy(dequantize(raw, qtype)))


def test_gguf_q4_k_blocks_are_read_as_stored() -> None:
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=(3, 2 * 144), dtype=np.uint8)
    for block in range(2):  # finite float16 d and dmin
        raw[:, block * 144:block * 144 + 4] = np.frombuffer(
            rng.uniform(0.001, 0.1, size=(3, 2)).astype(np.float16).tobytes(), np.uint8).reshape(3, 4)
    weight = from_gguf(raw, "Q4_K", 512)
    expected = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K))
    assert weight.d.dtype == torch.float32  # d * scale does not fit float16
    torch.testing.assert_close(weight.dequantize(), expected, rtol=1e-6, atol=1e-7)


def test_unsupported_gguf_type_is_named() -> None:
    with pytest.raises(ValueError, match="GGUF type Q5_K does not run as stored"):
        from_gguf(np.zeros((1, 176), np.uint8), "Q5_K", 256)


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (4, 128), (8, 32), (8, 128)])
def test_round_to_nearest_blocks(bits, group) -> None:
    weight = torch.randn(10, 256, generator=torch.Generator().manual_seed(bits + group))
    q = quantize_rtn(weight, bits, group)
    assert q.bits == bits and q.kind == f"int{bits}-g{group}"
    # One scale per group: each group of 32-blocks repeats its scales.
    blocks_per_group = group // 32
    assert torch.equal(q.d, q.d[:, ::blocks_per_group].repeat_interleave(blocks_per_group, 1))
    error = (q.dequantize() - weight).abs().view(10, -1, 32)
    step = q.d.float()[..., None]
    if bits == 8:
        assert (error <= step * 0.5 + 1e-3 * step + 1e-4).all()  # within half a step (float16 scales)
    else:
        # Least-squares grids: each group's squared error at most the min/max grid's (which
        # keeps every weight within half a step), and less in all.
        groups = weight.view(10, -1, group)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        d, m = ((high - low) / 15).half().float(), low.half().float()
        minmax = ((groups - m) / d).round().clamp(0, 15) * d + m
        minmax_error = ((minmax - groups) ** 2).sum(-1)
        fitted_error = (error.view(10, -1, group) ** 2).sum(-1)
        assert (fitted_error <= minmax_error * (1 + 1e-6)).all()
        assert fitted_error.sum() < 0.95 * minmax_error.sum()
    with pytest.raises(ValueError, match="group_size=48 is invalid"):
        quantize_rtn(weight, bits, 48)


@pytest.mark.parametrize("kernel", KERNELS)
def test_rtn_weight_times_activations_is_close_to_the_float_product(kernel) -> None:
    g = torch.Generator().manual_seed(5)
    weight, x = torch.randn(64, 576, generator=g) * 0.05, torch.randn(4, 576, generator=g)
    for bits, tolerance in ((8, 0.02), (4, 0.15)):
        y = kernels.qlinear(x, quantize_rtn(weight, bits, 32), kernel)
        exact = x @ weight.T
        assert (y - exact).norm() / exact.norm() < tolerance


@pytest.mark.parametrize("bits,minimum", [(4, True), (8, False)])
def test_panels_hold_the_same_weight(bits, minimum) -> None:
    weight = _random_weight(13, 64, bits, minimum, torch.float16, seed=7)  # 13: a padded panel
    panels = PanelWeight.from_rows(weight)
    assert panels.packed.shape == (1, 2, 64 * bits)
    back = panels.to_rows()
    assert torch.equal(back.packed, weight.packed) and torch.equal(back.d, weight.d)
    assert (back.m is None and weight.m is None) or torch.equal(back.m, weight.m)
    assert torch.equal(panels.dequantize(), weight.dequantize())
    index = torch.tensor([12, 0, 7, 12])  # rows picked out of their panel, one twice
    picked = panels.select_rows(index)
    assert torch.equal(picked.dequantize(), weight.dequantize()[index])


@pytest.mark.skipif(kernels.compiled_kernels() is None, reason="the compiled kernels did not build")
@pytest.mark.parametrize("bits,minimum,scales", [(4, True, torch.float16), (4, False, torch.float16),
                                                 (8, False, torch.float16), (4, True, torch.float32)])
def test_compiled_row_lookup_equals_the_dequantized_rows(bits, minimum, scales) -> None:
    weight = _random_weight(37, 96, bits, minimum, scales, seed=11)  # three panels, one padded
    index = torch.tensor([36, 0, 17, 36, 15, 16])
    rows = kernels.dequantize_rows(PanelWeight.from_rows(weight), index)
    assert torch.equal(rows, weight.dequantize()[index])  # the same float32 arithmetic, bit for bit
    assert torch.equal(kernels.dequantize_rows(weight, index), rows)  # the row layout's lookup
    with pytest.raises(RuntimeError, match="row 37 is not within"):
        kernels.dequantize_rows(PanelWeight.from_rows(weight), torch.tensor([37]))
