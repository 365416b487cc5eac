"""The decoder layers of a quantized or CPU float32 model as one compiled call per forward pass
(verispec.cpu_kernels.DecoderStack, csrc/decoder.h): the same layers as DecoderLayer, without
the ~76 torch operations per layer that cost a batch-1 step of the 4-bit model about half of its
time and the float32 model about a third."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from verispec.model.linear import STACK_LINEAR, Linear, stack_product
from verispec.model.quant.formats import PanelWeight
from verispec.model.quant.kernels import FALLBACK, compiled_kernels, default_kernel
from verispec.model.quant.linear import QuantLinear

# The layers' linear modules, in the order of DecoderStack.forward's `products`.
LINEARS = (("qkv", "qkv_proj"), ("o", "o_proj"), ("gate_up", "gate_up_proj"),
           ("down", "down_proj"))


def _linear(module: nn.Module) -> tuple[list[tuple] | torch.Tensor, torch.Tensor | None] | None:
    """(parts, bias) as DecoderStack takes them (parts: panels, or a dense float32 weight), or
    None where the stack cannot run the module (a part not in panels, a weight not float32 on
    the CPU)."""
    bias = None if module.bias is None else module.bias.detach().contiguous()
    if isinstance(module, Linear):
        if not module.cpu_fp32:
            return None
        return module.weight.detach().contiguous(), bias
    if not isinstance(module, QuantLinear) or not all(isinstance(p, PanelWeight)
                                                      for p in module.parts):
        return None
    return [(p.packed, p.d, p.m, p.bits, p.zero_point, p.shape[0]) for p in module.parts], bias


def product_code(module: nn.Module, rows: int) -> int:
    """How DecoderStack runs `module`'s product at `rows` rows (linear.stack_product; quantized
    parts ignore it)."""
    return stack_product(rows, tuple(module.weight.shape)) if isinstance(module, Linear) \
        else STACK_LINEAR


def stack_products(layer: nn.Module, rows: int) -> list[int]:
    """DecoderStack.forward's `products` for a pass of `rows` rows over layers shaped like
    `layer`."""
    return [product_code(getattr(layer, attr), rows) for _, attr in LINEARS]


def build_stack(layers: Sequence[nn.Module], rope_index: Sequence[int], plan_index: Sequence[int],
                norm: torch.Tensor | None = None,  # [2 * hidden_size], the final norm's [w, w]
                lm_head: nn.Module | None = None):  # -> DecoderStack | None
    """The compiled stack of `layers` (DecoderLayers of one model, so of one shape and options),
    layer i taking rope rope_index[i] and attention plan plan_index[i]; None where it cannot run
    them: no compiled kernels, the torch fallback chosen, a quantized layer's part kept as a
    float tensor, or a dense weight not float32 on the CPU. With `norm` and `lm_head` (the
    layers' eps) the stack also computes the logits (`has_head`), unless the LM head is one the
    stack cannot run."""
    compiled = compiled_kernels()
    if compiled is None or default_kernel() == FALLBACK:
        return None
    specs = []
    for layer, rope, plan in zip(layers, rope_index, plan_index):
        linears = {name: _linear(getattr(layer, attr)) for name, attr in LINEARS}
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


def build_eagle_chain(fc: nn.Module, fuse: nn.Module, fused_layers: int,
                      vocab_embeddings: torch.Tensor,  # [N, d] float32
                      vocab: torch.Tensor,  # [N] int64
                      eps: float):  # -> EagleChain | None
    """A fused EAGLE head's greedy drafting as one compiled call (csrc/eagle_chain.h), run over
    its layer's stack built with its norm and LM head; None where the compiled code cannot run
    fc or fuse."""
    linears = {"fc": _linear(fc), "fuse": _linear(fuse)}
    if compiled_kernels() is None or None in linears.values():
        return None
    return compiled_kernels().EagleChain(linears, fused_layers, vocab_embeddings.float().contiguous(),
                                         vocab.contiguous(), eps)
