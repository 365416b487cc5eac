"""QuantLinear: y = x W^T with W kept as stored blocks (QuantizedWeight), or a float tensor for
the parts a checkpoint stores in a type no kernel runs (widened at load)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from verispec.model.linear import Linear
from verispec.model.quant.formats import BLOCK, PanelWeight, QuantizedWeight, quantize_rtn
from verispec.model.quant.kernels import dequantize_rows, prepare, qlinear

Part = QuantizedWeight | torch.Tensor
Prepared = QuantizedWeight | PanelWeight | torch.Tensor


def stack_parts(parts: list[Part]) -> list[Part]:
    """Consecutive row blocks merged where their layouts allow (one product instead of several)."""
    merged: list[Part] = []
    for part in parts:
        last = merged[-1] if merged else None
        if isinstance(part, QuantizedWeight) and isinstance(last, QuantizedWeight) \
                and last.same_layout(part):
            merged[-1] = QuantizedWeight.stack([last, part])
        elif isinstance(part, torch.Tensor) and isinstance(last, torch.Tensor):
            merged[-1] = torch.cat([last, part.float()])
        else:
            merged.append(part if isinstance(part, QuantizedWeight) else part.float())
    return merged


class QuantLinear(nn.Module):
    """A Linear over row blocks ("parts") of the weight: the fused q/k/v of a layer may mix types
    in a GGUF file. Float32 activations in and out; no padding of rows (`cost_rows`). A bias,
    where there is one, stays float32."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.parts: list[Prepared] = []  # in the layout the kernel reads (kernels.prepare)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def load(self, parts: list[Part]) -> None:
        rows = sum(p.shape[0] for p in parts)
        widths = {p.shape[1] for p in parts}
        if rows != self.out_features or widths != {self.in_features}:
            raise ValueError(f"weights of shapes {[tuple(p.shape) for p in parts]} do not make a "
                             f"[{self.out_features}, {self.in_features}] linear layer")
        self.parts = [prepare(p) if isinstance(p, QuantizedWeight) else p
                      for p in stack_parts(parts)]

    def load_prepared(self, parts: list[Prepared]) -> None:
        """Parts as `load` leaves them (a cached model), in whichever layout they were saved."""
        self.parts = [p if isinstance(p, torch.Tensor) else prepare(p) for p in parts]

    def cost_rows(self, rows: int) -> int:
        return rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] float32 -> [T, out] float32
        x = x.float()
        outs = [F.linear(x, p) if isinstance(p, torch.Tensor) else qlinear(x, p)
                for p in self.parts]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return out if self.bias is None else out.add_(self.bias)

    def dense_rows(self, index: torch.Tensor) -> torch.Tensor:  # [R] int64 -> [R, in] float32
        """Rows of the weight as float32 (a learned head borrows the LM head's rows)."""
        dense = torch.empty((index.numel(), self.in_features), dtype=torch.float32)
        start = 0
        for part in self.parts:
            hit = ((index >= start) & (index < start + part.shape[0])).nonzero().squeeze(1)
            local = index[hit] - start
            if isinstance(part, torch.Tensor):
                dense[hit] = part.index_select(0, local)
            else:
                dense[hit] = dequantize_rows(part, local)
            start += part.shape[0]
        return dense

    def extra_repr(self) -> str:
        kinds = ["float32" if isinstance(p, torch.Tensor) else p.kind for p in self.parts]
        return f"in_features={self.in_features}, out_features={self.out_features}, parts={kinds}"


def quantize_linears_(module: nn.Module, bits: int = 8) -> int:
    """Replaces every float Linear under `module` whose width blocks of 32 divide by a QuantLinear
    of its weight rounded to `bits`-bit blocks (formats.quantize_rtn); returns how many. A learned
    head on a quantized target runs this way: its float32 products would cost as much as the
    target's whole 4-bit step."""
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, Linear) or child.weight.shape[1] % BLOCK:
                continue
            quantized = QuantLinear(child.weight.shape[1], child.weight.shape[0], child.bias is not None)
            quantized.load([quantize_rtn(child.weight.detach().float(), bits, BLOCK)])
            if child.bias is not None:
                quantized.bias.copy_(child.bias.float())
            setattr(parent, name, quantized)
            replaced += 1
    return replaced
