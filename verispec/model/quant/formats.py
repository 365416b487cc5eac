"""QuantizedWeight: a [N, K] weight stored as blocks of 32 small unsigned integers along K, each
block with a scale d and a minimum m, w = d * q + m.

Terms, used by the kernels (csrc/qgemm.h, kernels.py) and the loaders:
- block: 32 consecutive weights of one row; group: the blocks sharing a scale (32, 64 or 128
  weights; a group of 64 is two blocks with equal scales, so the kernels know only blocks);
- bits: 4 (q in [0, 15], two per byte: byte j of a block holds q[j] in its low nibble and
  q[j + 16] in its high one, GGUF's layout) or 8 (q in [0, 255], one per byte);
- zero point: blocks without a stored minimum have m = -zero_point * d (GGUF's Q4_0: 8, Q8_0:
  128, whose signed q is stored as q + 128 here).

GGUF's Q4_0, Q4_1, Q8_0 and Q4_K map onto this exactly (`from_gguf`); `quantize_rtn` makes it from
float weights by rounding to nearest (weight-only int4 / int8).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

BLOCK = 32
# The GGUF block types run as stored; other types are widened to float by the loader.
GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K")
GROUP_SIZES = (32, 64, 128)


class QuantizedWeight:
    """A [N, K] weight as blocks (module docstring). packed: [N, K * bits / 8] uint8; d and m:
    [N, K / 32] float16 (or float32 where float16 would round, e.g. Q4_K's products of two
    scales); m None: m = -zero_point * d."""

    def __init__(self, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int,
                 zero_point: int = 0, kind: str = "") -> None:
        if bits not in (4, 8):
            raise ValueError(f"bits={bits!r} is invalid: expected 4 or 8")
        rows, width = packed.shape
        columns = width * 8 // bits
        if packed.dtype != torch.uint8 or columns % BLOCK or d.shape != (rows, columns // BLOCK) \
                or (m is not None and (m.shape != d.shape or m.dtype != d.dtype)) \
                or d.dtype not in (torch.float16, torch.float32):
            raise ValueError(f"inconsistent quantized weight: packed {tuple(packed.shape)} "
                             f"{packed.dtype}, d {tuple(d.shape)} {d.dtype}, m "
                             f"{None if m is None else (tuple(m.shape), m.dtype)}, bits {bits}")
        self.packed, self.d, self.m = packed.contiguous(), d.contiguous(), m
        if m is not None:
            self.m = m.contiguous()
        self.bits, self.zero_point = bits, zero_point
        self.kind = kind or f"int{bits}"  # what it came from, for messages: "Q4_1", "int4-g64"
        self.shape = (rows, columns)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.d, self.m)
                   if t is not None)

    def same_layout(self, other: QuantizedWeight) -> bool:
        """Whether the two can be stacked into one weight (same bits, scales and minimum)."""
        return (self.bits, self.zero_point, self.d.dtype, self.m is None) == \
            (other.bits, other.zero_point, other.d.dtype, other.m is None)

    def unpacked(self) -> torch.Tensor:  # [N, K] uint8, q in column order
        rows, columns = self.shape
        if self.bits == 8:
            return self.packed
        blocks = self.packed.view(rows, columns // BLOCK, BLOCK // 2)
        return torch.cat((blocks & 0x0F, blocks >> 4), dim=-1).view(rows, columns)

    def minimums(self) -> torch.Tensor:  # [N, K / 32] float32
        return self.m.float() if self.m is not None else -float(self.zero_point) * self.d.float()

    def dequantize(self) -> torch.Tensor:  # [N, K] float32, d * q + m exactly as float32 computes it
        rows, columns = self.shape
        q = self.unpacked().view(rows, columns // BLOCK, BLOCK).float()
        return (q * self.d.float()[..., None] + self.minimums()[..., None]).view(rows, columns)

    def select_rows(self, index: torch.Tensor) -> QuantizedWeight:  # index: [R] int64
        return QuantizedWeight(self.packed.index_select(0, index), self.d.index_select(0, index),
                               None if self.m is None else self.m.index_select(0, index),
                               self.bits, self.zero_point, self.kind)

    @staticmethod
    def stack(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """The parts' rows one after another (they must share a layout: `same_layout`)."""
        first = parts[0]
        return QuantizedWeight(torch.cat([p.packed for p in parts]),
                               torch.cat([p.d for p in parts]),
                               None if first.m is None else torch.cat([p.m for p in parts]),
                               first.bits, first.zero_point, first.kind)


PANEL = 16


class PanelWeight:
    """A QuantizedWeight laid out for the compiled kernels: panels of 16 columns whose bytes for
    four consecutive elements lie side by side (csrc/qgemm.h), so one integer dot product gives
    each column's partial sum in its own lane. packed: [ceil(N / 16), K / 32, 64 * bits] uint8;
    d, m: [ceil(N / 16), K / 32, 16]; padding columns are zero."""

    def __init__(self, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int,
                 zero_point: int, kind: str, shape: tuple[int, int]) -> None:
        self.packed, self.d, self.m = packed, d, m
        self.bits, self.zero_point, self.kind, self.shape = bits, zero_point, kind, tuple(shape)

    @classmethod
    def from_rows(cls, weight: QuantizedWeight) -> PanelWeight:
        rows, columns = weight.shape
        panels, groups = -(-rows // PANEL), columns // BLOCK
        pad = panels * PANEL - rows
        # A row's bytes 4c .. 4c+3 of a block hold elements 4c .. 4c+3 (8 bits), or elements
        # 4c .. 4c+3 and 16+4c .. 16+4c+3 in their two nibbles (4 bits): exactly one panel chunk.
        # So panels are the rows' 4-byte words transposed, column by column within each block.
        words = _pad_rows(weight.packed, pad).view(torch.int32).view(panels, PANEL, groups, -1)
        packed = words.permute(0, 2, 3, 1).contiguous().view(torch.uint8).view(panels, groups, -1)

        def panel_scales(t: torch.Tensor) -> torch.Tensor:
            return _pad_rows(t, pad).view(panels, PANEL, groups).transpose(1, 2).contiguous()

        return cls(packed, panel_scales(weight.d),
                   None if weight.m is None else panel_scales(weight.m), weight.bits,
                   weight.zero_point, weight.kind, weight.shape)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.d, self.m)
                   if t is not None)

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        return self.to_rows().dequantize()

    def select_rows(self, index: torch.Tensor) -> QuantizedWeight:  # [R] int64 -> R rows
        """Rows `index` in row layout, read out of their panels (a tied LM head serves the
        embedding lookups this way, without a second copy of the table)."""
        panels, groups = self.packed.shape[:2]
        panel, lane = index // PANEL, index % PANEL
        words = self.packed.view(torch.int32).view(panels, groups, -1, PANEL)[panel, :, :, lane]
        packed = words.reshape(index.numel(), -1).contiguous().view(torch.uint8)
        return QuantizedWeight(packed, self.d[panel, :, lane],
                               None if self.m is None else self.m[panel, :, lane], self.bits,
                               self.zero_point, self.kind)

    def to_rows(self) -> QuantizedWeight:
        """The same weight in row layout (QuantizedWeight), padding dropped."""
        rows, columns = self.shape
        panels, groups = self.packed.shape[:2]
        words = self.packed.view(torch.int32).view(panels, groups, -1, PANEL)
        packed = words.permute(0, 3, 1, 2).reshape(panels * PANEL, -1)[:rows]

        def row_scales(t: torch.Tensor) -> torch.Tensor:
            return t.transpose(1, 2).reshape(panels * PANEL, groups)[:rows]

        return QuantizedWeight(packed.contiguous().view(torch.uint8), row_scales(self.d),
                               None if self.m is None else row_scales(self.m), self.bits,
                               self.zero_point, self.kind)


def _pad_rows(t: torch.Tensor, pad: int) -> torch.Tensor:  # [N, ...] -> [N + pad, ...], zeros
    return F.pad(t, (0, 0, 0, pad)) if pad else t


def _halves(raw: np.ndarray, start: int) -> torch.Tensor:  # raw [N, G, block_bytes] -> [N, G]
    return torch.from_numpy(np.ascontiguousarray(raw[..., start:start + 2]).view(np.float16)[..., 0])


def _q4k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of packed 6-bit (scale, min) pairs -> [.., 8] scales and [.., 8] mins."""
    s = scales.astype(np.uint8)
    low_sc, low_mn = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    high_mn = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return np.concatenate((low_sc, high_sc), -1), np.concatenate((low_mn, high_mn), -1)


def from_gguf(raw: np.ndarray, kind: str, columns: int) -> QuantizedWeight:
    """A GGUF tensor's blocks ([N, row bytes] uint8, as gguf's reader gives them) as stored."""
    rows = raw.shape[0]
    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        header = 2 if kind != "Q4_1" else 4
        payload = BLOCK // 2 if kind != "Q8_0" else BLOCK
        blocks = raw.reshape(rows, columns // BLOCK, header + payload)
        d = _halves(blocks, 0)
        m = _halves(blocks, 2) if kind == "Q4_1" else None
        packed = np.ascontiguousarray(blocks[..., header:]).reshape(rows, -1)
        if kind == "Q8_0":  # signed q stored as q + 128
            packed = packed ^ np.uint8(0x80)
        return QuantizedWeight(torch.from_numpy(packed), d, m, 8 if kind == "Q8_0" else 4,
                               {"Q4_0": 8, "Q8_0": 128}.get(kind, 0), kind)
    if kind == "Q4_K":
        # 256 weights: d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
        # where 64 weights share 32 bytes (low nibbles the first 32, high the next 32).
        blocks = raw.reshape(rows, columns // 256, 144)
        d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = _q4k_scales(blocks[..., 4:16])
        scale = (d * sc).reshape(rows, -1)  # exact in float32: 11 bits times 6
        minimum = (-dmin * mn).reshape(rows, -1)
        nibbles = blocks[..., 16:].reshape(rows, columns // 256, 4, 32)
        q = np.stack((nibbles & 15, nibbles >> 4), axis=3).reshape(rows, columns // BLOCK, BLOCK)
        packed = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8).reshape(rows, -1)
        return QuantizedWeight(torch.from_numpy(packed), torch.from_numpy(scale),
                               torch.from_numpy(minimum), 4, 0, kind)
    raise ValueError(f"GGUF type {kind} does not run as stored: expected one of {GGUF_TYPES}")


# Candidate int4 grids of a group (fit_int4_grid): its [min, max] range shrunk by a share s
# from the top, or by s / 4 from the bottom and 3 s / 4 from the top.
_SHRINKS = tuple(i / 20 for i in range(11))
_SHIFTS = (0.0, 0.25)
# Rows fitted at a time: bounds the float32 temporaries (~20 of the chunk's size).
_FIT_ROWS = 4096


def fit_int4_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 grid d * q + m (q = 0..15) of each group of w [rows, groups, size] float32 with
    the least squared error found among the min/max grid and candidate grids (_SHRINKS x
    _SHIFTS), each refitted by least squares to the q it rounds to: d, m [rows, groups]
    float16. A group's outliers are clipped where that lowers the error of the rest. The
    embedded model's int4 copy in groups of 64 agrees with the model's greedy token on 0.74
    of positions (16 prompts, 1,536 tokens), against 0.67 with the min/max grid."""
    if w.shape[0] > _FIT_ROWS:
        fits = [fit_int4_grid(chunk) for chunk in w.split(_FIT_ROWS)]
        return torch.cat([d for d, _ in fits]), torch.cat([m for _, m in fits])
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    span, total, n = high - low, w.sum(-1, keepdim=True), w.shape[-1]

    def rounded(d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        safe = torch.where(d == 0, torch.ones_like(d), d)
        q = ((w - m) / safe).round_().clamp_(0, 15)
        return ((q * d + m - w) ** 2).sum(-1, keepdim=True), q

    def half(x: torch.Tensor) -> torch.Tensor:  # as stored: the error is judged after rounding
        return x.half().float()

    best_d, best_m = half(span / 15), half(low)
    best_error, _ = rounded(best_d, best_m)
    for shrink in _SHRINKS:
        for shift in _SHIFTS:
            d, m = half(span * (1 - shrink) / 15), half(low + span * shrink * shift)
            _, q = rounded(d, m)
            # min over d, m of sum (d q + m - w)^2: the normal equations of a line fit.
            sum_q, sum_qq, sum_qw = q.sum(-1, keepdim=True), (q * q).sum(-1, keepdim=True), \
                (q * w).sum(-1, keepdim=True)
            det = n * sum_qq - sum_q * sum_q
            solvable = det > 0
            d = half(torch.where(solvable, (n * sum_qw - sum_q * total)
                                 / torch.where(solvable, det, torch.ones_like(det)), d))
            m = half(torch.where(solvable, (total - d * sum_q) / n, m))
            error, _ = rounded(d, m)
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            best_d, best_m = torch.where(better, d, best_d), torch.where(better, m, best_m)
    return best_d.squeeze(-1).half(), best_m.squeeze(-1).half()


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int) -> QuantizedWeight:
    """Round-to-nearest weight-only quantization of a [N, K] float weight, one scale per group
    of `group_size` weights along K: int4 asymmetric on the least-squares grid of each group
    (fit_int4_grid), int8 symmetric (d = max|w| / 127). Scales are float16, and q is rounded
    against the float16 scales, so the stored blocks reproduce exactly what `dequantize`
    returns."""
    rows, columns = weight.shape
    if group_size not in GROUP_SIZES or columns % group_size:
        raise ValueError(f"group_size={group_size!r} is invalid for a weight {columns} wide: "
                         f"expected one of {GROUP_SIZES} dividing it")
    w = weight.detach().float().reshape(rows, columns // group_size, group_size)
    if bits == 4:
        d, m = fit_int4_grid(w)
        safe = torch.where(d == 0, torch.ones_like(d), d).float()
        q = torch.round((w - m.float()[..., None]) / safe[..., None]).clamp_(0, 15)
        zero_point = 0
    elif bits == 8:
        d = (w.abs().amax(-1) / 127).half()
        safe = torch.where(d == 0, torch.ones_like(d), d).float()
        q = torch.round(w / safe[..., None]).clamp_(-127, 127) + 128
        m, zero_point = None, 128
    else:
        raise ValueError(f"bits={bits!r} is invalid: expected 4 or 8")
    repeat = group_size // BLOCK
    q = q.to(torch.uint8).reshape(rows, columns // BLOCK, BLOCK)
    packed = q if bits == 8 else q[..., :16] | (q[..., 16:] << 4)
    return QuantizedWeight(packed.reshape(rows, -1).contiguous(), d.repeat_interleave(repeat, 1),
                           None if m is None else m.repeat_interleave(repeat, 1), bits,
                           zero_point, f"int{bits}-g{group_size}")
