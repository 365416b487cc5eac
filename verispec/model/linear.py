"""The model's matrix multiplies, with the CPU strategies that make small-batch inference fast.

Measured on 2 AVX2 cores with SmolLM2's shapes (torch 2.13, MKL and oneDNN):
- float32, up to 64 rows: MKL runs (W @ x^T)^T ("skinny" products) 1.1-3x faster than
  x @ W^T, at a cost far from linear in the rows: the products of 30 layers take 27 ms for 1 row,
  2 rows 21, 4 rows 20, 6 rows 34, 12 rows 58, 15 rows 93, 16 rows 43, 31 rows 109, 32 rows 59.
  Inputs are therefore padded with zero rows: 1 row to 2, 3 to 4, above 9 rows to a multiple
  of 16 (`skinny_rows`), within 8% of the best padding at every row count up to 64. verispec's
  compiled product (csrc/f32linear.h) reads each weight once for up to 8 rows: all products of
  a step, 1 row 18 ms, 5 rows 23, 8 rows 33-36 (skinny 20, 33, 43; F.linear 45, 63, 57). On an
  Intel Xeon the skinny product was 2.8-3.9x slower than F.linear at 1-2 rows instead, so each
  machine's choice per row count is measured once and cached (verispec.model.product_choice).
- bfloat16 on a CPU without bf16 arithmetic (no AVX512-BF16 / AMX): one row reads the weight at
  the bandwidth (half float32's bytes), but oneDNN's emulated product costs about one such pass
  per row (16 rows: 4.5x float32, a 96-token prefill chunk 7x). From two rows on, the weight
  is therefore widened to float32 in cache-sized chunks and multiplied in float32: the same
  products of bf16 values, accumulated in float32 and rounded to bf16, as oneDNN computes.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F
from torch import nn

from verispec.model.product_choice import KINDS, ProductChoice, product_choice
from verispec.model.quant.kernels import compiled_kernels

# Up to this many rows, CPU float32 products may run other than F.linear (where faster).
SKINNY_MAX_ROWS = 64
# Weight elements widened at a time: 8 MB of float32, which stays in cache for the multiply.
WIDEN_CHUNK_ELEMENTS = 1 << 21


def empty_parameter(shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def cpu_has_bf16_arithmetic() -> bool:
    """Whether oneDNN multiplies bfloat16 natively on this CPU."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class WideningBuffer:
    """Float32 scratch space shared by the Linear layers of one model (one step runs them one
    after another), so widening costs one chunk of memory, not a float32 copy of the model."""

    def __init__(self, device: torch.device) -> None:
        self._buffer = torch.empty(0, dtype=torch.float32, device=device)

    def widen(self, weight: torch.Tensor) -> torch.Tensor:  # [n, in] bf16 -> [n, in] float32
        numel = weight.numel()
        if self._buffer.numel() < numel:
            self._buffer = torch.empty(numel, dtype=torch.float32, device=self._buffer.device)
        return self._buffer[:numel].view(weight.shape).copy_(weight)


def skinny_product(
    weight: torch.Tensor,  # [N, in] float32
    x: torch.Tensor,  # [T, in] float32, T <= SKINNY_MAX_ROWS
    dtype: torch.dtype,
) -> torch.Tensor:  # [T, N] in dtype, contiguous
    """(W x^T)^T over x padded to `skinny_rows` rows."""
    rows = x.shape[0]
    padded = skinny_rows(rows)
    if padded > rows:
        # Real zero rows: stride-0 (expanded) ones would leave BLAS for a slow path.
        x = F.pad(x, (0, 0, 0, padded - rows))
    transposed = torch.mm(weight, x.t())[:, :rows]
    # One copy transposes and converts.
    return torch.empty((rows, weight.shape[0]), dtype=dtype, device=x.device).copy_(transposed.t())


# Weights streamed by one timing: beyond the last-level cache, as a model's layers are read one
# after another in a step (a single small weight timed in a loop stays in cache, where F.linear
# does better than when its weight comes from memory).
STREAMED_BYTES = 48 << 20
# At most this many copies: a tiny layer's choice is not worth streaming thousands of them.
MAX_COPIES = 64


@functools.cache
def _f32_isa() -> str:  # the best instruction set of the compiled float32 product here
    return compiled_kernels().f32_isas()[0]


def compiled_product(
    weight: torch.Tensor,  # [N, in] float32, contiguous
    x: torch.Tensor,  # [T, in] float32
    dtype: torch.dtype,
) -> torch.Tensor:  # [T, N] in dtype
    """verispec's float32 product (csrc/f32linear.h): a row's result whatever the other rows."""
    return compiled_kernels().f32_linear(x, weight.contiguous(), _f32_isa()).to(dtype)


def fp32_kinds() -> tuple[str, ...]:
    """The float32 products this machine runs (product_choice.KINDS): the compiled one where
    the extension is built."""
    return KINDS if compiled_kernels() is not None else tuple(k for k in KINDS if k != "compiled")


def cpu_fp32_product(
    weight: torch.Tensor,  # [N, in] float32
    x: torch.Tensor,  # [T, in] float32
    dtype: torch.dtype,
    kind: str,  # product_choice.KINDS
) -> torch.Tensor:  # [T, N] in dtype, contiguous
    """The product of `kind`; F.linear for "compiled" where autograd records (training a head:
    the compiled product has no backward)."""
    if kind == "skinny":
        return skinny_product(weight, x, dtype)
    recorded = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if kind == "compiled" and not recorded:
        return compiled_product(weight, x, dtype)
    return F.linear(x, weight).to(dtype)


def _time_product(shape: tuple[int, int], kind: str, rows: int, repeats: int = 2) -> float:
    """Seconds per product of `kind` (product_choice) with a weight of `shape`, taken over
    distinct weights totalling STREAMED_BYTES (or MAX_COPIES of them), the fastest of `repeats`
    passes (the fastest: what the machine can do, less the noise of other work on it)."""
    copies = min(MAX_COPIES, max(1, STREAMED_BYTES // (4 * shape[0] * shape[1])))
    # Its own generator: a model's first product must not move the caller's random stream.
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator) for _ in range(copies)]
    x = torch.randn(rows, shape[1], generator=generator)
    cpu_fp32_product(weights[0], x, torch.float32, kind)  # warms up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for weight in weights:
            cpu_fp32_product(weight, x, torch.float32, kind)
        times.append((time.perf_counter() - start) / copies)
    return min(times)


@functools.cache
def fp32_choice(out_features: int, in_features: int) -> ProductChoice:
    """This machine's float32 product per row count for a weight of this shape
    (verispec.model.product_choice)."""
    shape = (out_features, in_features)
    return product_choice(functools.partial(_time_product, shape), shape, fp32_kinds())


def fp32_kind(rows: int, shape: tuple[int, int]) -> str:
    """The product (product_choice.KINDS) a CPU float32 product over `rows` rows with a weight
    of `shape` runs on this machine."""
    return fp32_choice(*shape).kind(rows) if rows <= SKINNY_MAX_ROWS else "linear"


# DecoderStack's codes for a dense product (csrc/decoder.h): the compiled one, F.linear's; a
# positive count is the skinny product over that many padded rows.
STACK_COMPILED, STACK_LINEAR = -1, 0


def stack_product(rows: int, shape: tuple[int, int]) -> int:
    """The code (STACK_COMPILED, STACK_LINEAR or a padded count) of the product `fp32_kind`
    picks, for the compiled decoder stack's float32 weights."""
    kind = fp32_kind(rows, shape)
    if kind == "compiled":
        return STACK_COMPILED
    return skinny_rows(rows) if kind == "skinny" else STACK_LINEAR


def skinny_rows(rows: int) -> int:
    """The row count, at least `rows`, to run a skinny product with (module docstring)."""
    if rows <= 2:
        return 2
    if rows <= 4:
        return 4
    if rows <= 9:
        return rows
    return -(-rows // 16) * 16


def widening_for(dtype: torch.dtype, device: torch.device) -> WideningBuffer | None:
    """The scratch a model in this dtype on this device needs, or None when it multiplies
    in its own dtype."""
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_bf16_arithmetic():
        return WideningBuffer(device)
    return None


class Linear(nn.Module):
    """y = x W^T (+ b with `bias`), W stored [out_features, in_features] as checkpoints store it.

    Products run as the module docstring explains: on CPU in float32 the product this machine
    runs fastest at the row count (`fp32_kind`), widened on CPU in
    bf16 when `widening` is given (from `widening_for`), F.linear otherwise (cuBLAS, native bf16,
    or a single bf16 row)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device, widening: WideningBuffer | None = None,
                 bias: bool = False) -> None:
        super().__init__()
        self.weight = empty_parameter((out_features, in_features), dtype, device)
        self.bias = empty_parameter((out_features,), dtype, device) if bias else None
        self.cpu_fp32 = device.type == "cpu" and dtype == torch.float32
        self.widening = widening

    def cost_rows(self, rows: int) -> int:
        """The row count a product over `rows` rows costs like (skinny products pad)."""
        fp32 = self.cpu_fp32 or (self.widening is not None and rows > 1)
        return skinny_rows(rows) if fp32 and fp32_kind(rows, tuple(self.weight.shape)) == "skinny" \
            else rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        out = self._product(x)
        return out if self.bias is None else out.add_(self.bias)

    def _product(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.cpu_fp32:
            return cpu_fp32_product(self.weight, x, x.dtype,
                                    fp32_kind(x.shape[0], tuple(self.weight.shape)))
        if self.widening is None or x.shape[0] == 1:
            return F.linear(x, self.weight)
        wide_x = x.float()
        chunk_rows = max(1, WIDEN_CHUNK_ELEMENTS // self.weight.shape[1])
        kind = fp32_kind(x.shape[0], tuple(self.weight.shape))
        parts = [cpu_fp32_product(self.widening.widen(chunk), wide_x, x.dtype, kind)
                 for chunk in self.weight.split(chunk_rows)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
