"""Which kernel multiplies a QuantizedWeight, and the pure-torch fallback.

The compiled kernels (verispec.cpu_kernels, csrc/, built by `make setup`) come in one variant per
instruction set, chosen at run time from the CPU's flags: amx (AVX-512 VNNI plus AMX-INT8 tiles
for products of two or more rows, where the OS grants the tiles), avx512vnni, avxvnni, avx512bw
(AVX-512 without VNNI: 512-bit pair products, half AVX2's instructions per row), avx2,
generic (scalar C++, any CPU). Where the extension did not build or load, `torch` runs the same
arithmetic with torch operations. VERISPEC_CPU_KERNEL=<name> forces one (tests, benchmarks).

The arithmetic (csrc/qgemm.h): activations are quantized per row and block of 32 to int8,
xd = amax / 127 and xq = round-half-even(x * (127 / amax)); each block's product is then an
exact integer dot product, scaled by d * xd, plus m * xd * sum(xq).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from verispec.model.quant.formats import BLOCK, PanelWeight, QuantizedWeight

try:
    import verispec.cpu_kernels as _compiled
except ImportError as error:  # not built (no compiler at install time) or built for another torch
    _compiled = None
    _IMPORT_ERROR = str(error)

_log = logging.getLogger("verispec")
ENV = "VERISPEC_CPU_KERNEL"
FALLBACK = "torch"
# Column chunk of the fallback: bounds its float32 copy of the weights to ~8 MB.
_FALLBACK_ELEMENTS = 1 << 21


def compiled_kernels():  # the verispec.cpu_kernels module, or None
    """verispec.cpu_kernels where it was built and loads, else None."""
    return _compiled


def available_kernels() -> list[str]:
    """The kernels this machine can run, best first; the torch fallback is always last."""
    return (list(_compiled.supported_isas()) if _compiled is not None else []) + [FALLBACK]


@functools.cache
def default_kernel() -> str:
    """The kernel quantized products use: $VERISPEC_CPU_KERNEL, else the best available."""
    chosen = os.environ.get(ENV)
    available = available_kernels()
    if chosen:
        if chosen not in available:
            raise ValueError(f"{ENV}={chosen!r} is not available on this machine: expected one "
                             f"of {available}")
        return chosen
    if _compiled is None:
        _log.warning("verispec: the compiled CPU kernels are not available (%s); quantized "
                     "weights run on the slower pure-torch fallback", _IMPORT_ERROR)
    return available[0]


def quantize_activations(
    x: torch.Tensor,  # [M, K] float32, K a multiple of 32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # xq [M, K] int8, xd [M, K/32], xs [M, K/32] int32
    """The activations' blocks as every kernel computes them (module docstring)."""
    rows, columns = x.shape
    blocks = x.float().reshape(rows, columns // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse[..., None])
    return (q.to(torch.int8).reshape(rows, columns), amax / 127.0,
            q.sum(-1, dtype=torch.int32))


def _torch_qlinear(
    x: torch.Tensor,  # [M, K] float32
    weight: QuantizedWeight,
) -> torch.Tensor:  # [M, N] float32
    # Integer dot products of 32 terms below 2^24 are exact in float32, in any order, so each
    # row's result is the same whatever the other rows.
    xq, xd, xs = quantize_activations(x)
    rows, columns = x.shape
    groups = columns // BLOCK
    xq_blocks = xq.float().view(rows, groups, BLOCK).transpose(0, 1)  # [G, M, 32]
    xm = xd * xs.float()  # [M, G]
    chunk = max(1, _FALLBACK_ELEMENTS // columns)
    out = []
    for start in range(0, weight.shape[0], chunk):
        part = weight.select_rows(torch.arange(start, min(start + chunk, weight.shape[0])))
        q = part.unpacked().float().view(-1, groups, BLOCK).permute(1, 2, 0)  # [G, 32, n]
        dots = torch.bmm(xq_blocks, q)  # [G, M, n]
        d, m = part.d.float().T, part.minimums().T  # [G, n]
        # Groups summed one by one, in order: torch's reductions pick their order by shape.
        total = torch.zeros_like(dots[0])
        for g in range(groups):
            total += dots[g] * (d[g] * xd[:, g, None]) + m[g] * xm[:, g, None]
        out.append(total)
    return torch.cat(out, dim=1)


def prepare(weight: QuantizedWeight | PanelWeight,
            kernel: str | None = None) -> QuantizedWeight | PanelWeight:
    """The weight in the layout `kernel` (None: `default_kernel()`) reads: panels for the
    compiled kernels, rows for the fallback."""
    if (kernel or default_kernel()) == FALLBACK:
        return weight.to_rows() if isinstance(weight, PanelWeight) else weight
    return weight if isinstance(weight, PanelWeight) else PanelWeight.from_rows(weight)


def dequantize_rows(
    weight: QuantizedWeight | PanelWeight,  # [N, K]
    index: torch.Tensor,  # [R] int64
) -> torch.Tensor:  # [R, K] float32
    """Rows `index` of the weight, dequantized (embedding lookups; a learned head borrows the
    LM head's rows): read straight out of the panels where the compiled kernels loaded."""
    if isinstance(weight, PanelWeight) and _compiled is not None:
        return _compiled.dequantize_rows(weight.packed, weight.d, weight.m, weight.bits,
                                         weight.zero_point, weight.shape[0], weight.shape[1], index)
    return weight.select_rows(index).dequantize()


def qlinear(
    x: torch.Tensor,  # [M, K] float32
    weight: QuantizedWeight | PanelWeight,  # [N, K]
    kernel: str | None = None,
) -> torch.Tensor:  # [M, N] float32
    """x times the weight transposed, on `kernel` (None: `default_kernel()`); a weight in the
    other layout is converted first (tests; models `prepare` theirs once)."""
    kernel = kernel or default_kernel()
    if kernel == FALLBACK:
        return _torch_qlinear(x, weight.to_rows() if isinstance(weight, PanelWeight) else weight)
    if isinstance(weight, QuantizedWeight):
        weight = PanelWeight.from_rows(weight)
    return _compiled.qlinear(x, weight.packed, weight.d, weight.m, weight.bits, weight.zero_point,
                      weight.shape[0], kernel)
