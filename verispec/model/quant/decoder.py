"""The decoder layers of a quantized model as one compiled call per forward pass
(verispec.cpu_kernels.DecoderStack, csrc/decoder.h): the same layers as DecoderLayer, without
the ~76 torch operations per layer that cost a batch-1 step about half of its time."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from verispec.model.quant.formats import PanelWeight
from verispec.model.quant.kernels import FALLBACK, compiled_kernels, default_kernel
from verispec.model.quant.linear import QuantLinear


def _linear(module: nn.Module) -> tuple[list[tuple], torch.Tensor | None] | None:
    """(parts, bias) as DecoderStack takes them, or None where a part is not in panels."""
    if not isinstance(module, QuantLinear) or not all(isinstance(p, PanelWeight)
                                                      for p in module.parts):
        return None
    parts = [(p.packed, p.d, p.m, p.bits, p.zero_point, p.shape[0]) for p in module.parts]
    return parts, None if module.bias is None else module.bias.detach().contiguous()


def build_stack(layers: Sequence[nn.Module], rope_index: Sequence[int], plan_index: Sequence[int],
                norm: torch.Tensor | None = None,  # [2 * hidden_size], the final norm's [w, w]
                lm_head: nn.Module | None = None):  # -> DecoderStack | None
    """The compiled stack of `layers` (DecoderLayers of one model, so of one shape and options),
    layer i taking rope rope_index[i] and attention plan plan_index[i]; None where it cannot run
    them: no compiled kernels, the torch fallback chosen, or a weight part kept as a float
    tensor. With `norm` and `lm_head` (the layers' eps) the stack also computes the logits
    (`has_head`), unless a part of the LM head is a float tensor."""
    compiled = compiled_kernels()
    if compiled is None or default_kernel() == FALLBACK:
        return None
    specs = []
    for layer, rope, plan in zip(layers, rope_index, plan_index):
        linears = {name: _linear(getattr(layer, attr)) for name, attr in
                   (("qkv", "qkv_proj"), ("o", "o_proj"), ("gate_up", "gate_up_proj"),
                    ("down", "down_proj"))}
        if any(v is None for v in linears.values()):
            return None
        norms = {name: None if getattr(layer, name) is None else getattr(layer, name).detach()
                 for name in ("input_norm", "post_attention_norm", "attn_out_norm",
                              "mlp_out_norm", "q_norm", "k_norm")}
        specs.append({**norms, **linears, "rope": rope, "plan": plan})
    first = layers[0]
    scale = first.head_dim ** -0.5 if first.scale is None else first.scale
    head_linear = None if lm_head is None else _linear(lm_head)
    head = None if norm is None or head_linear is None else \
        {"norm": norm.detach().contiguous(), "lm_head": head_linear}
    return compiled.DecoderStack(specs, first.heads, first.kv_heads, first.head_dim, first.inter,
                                 first.eps, first.gelu, scale,
                                 0.0 if first.softcap is None else first.softcap, default_kernel(),
                                 head)
