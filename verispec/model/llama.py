"""The decoder of every supported family, run over a ragged batch against a paged KV cache.

RMSNorm, rotary embeddings (rotate-half), grouped-query attention, gated MLP, tied or untied
LM head: Llama 2/3.x and SmolLM2 with the default ModelConfig; Mistral, Qwen2/2.5/3, Gemma 1/2/3
and Phi-3 through its options (verispec.model.config: rope scaling, biases, q/k norms, GeGLU,
Gemma's norms and embedding scale, soft-capping, sliding-window layers). An option left at its
default costs nothing: the Llama path runs the operations it ran before the options existed.
Built for speed at small scale, where per-op overhead and memory traffic dominate:
- q/k/v are one matrix and gate/up another, so a layer runs four matrix multiplies;
- rotary is applied to q and k together, in place; norms run as one fused layer_norm (rms_norm);
- the LM head runs only on the rows that need logits;
- matrix multiplies pick a CPU strategy by dtype and rows (verispec.model.linear).

Weights are loaded with `load_weights` from a mapping in Hugging Face names (the loaders turn
GGUF and safetensors checkpoints into that), so the fused layout stays private.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from verispec.model.attention import AttentionMetadata, AttentionPlan, paged_attention
from verispec.model.config import ModelConfig
from verispec.model.linear import Linear, WideningBuffer, empty_parameter, widening_for
from verispec.model.quant.decoder import build_stack, product_code, stack_products
from verispec.model.quant.formats import PanelWeight, QuantizedWeight
from verispec.model.quant.kernels import compiled_kernels, dequantize_rows
from verispec.model.quant.linear import QuantLinear
from verispec.model.rotary import RotaryEmbedding, apply_rotary_

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# A float32 sequence with more new tokens than this (a long prefill chunk) is attended by SDPA,
# not row by row: the row-by-row kernel's cost grows with the square of the chunk and SDPA's
# far more slowly (the embedded model's whole pass, 2 threads: row by row faster up to ~256
# tokens, 1.2-1.4x slower at 512, 1.5x at 1,500). Quantized models attend every row row by
# row, whose int8 activations would magnify SDPA's batch-dependent rounding.
FLOAT_ROWWISE_MAX_QUERY = 256


def rms_norm(
    x: torch.Tensor,  # [T, d]
    doubled_weight: torch.Tensor,  # [2 * d], the norm weight w twice: [w, w]
    eps: float,
) -> torch.Tensor:  # [T, d], a view with row stride 2 * d
    """x / sqrt(mean(x^2) + eps) * w, as torch's fused layer_norm over the rows [x, -x]: their
    mean is 0 and their variance mean(x^2), so the first half is the RMS norm. On CPU torch's
    rms_norm runs as ~10 separate ops; this is 3 (a bf16 decode step of the default model: -5%)."""
    width = x.shape[-1]
    doubled = torch.cat((x, -x), dim=-1)
    return F.layer_norm(doubled, (2 * width,), doubled_weight, None, eps)[:, :width]


def _norm_heads_(
    x: torch.Tensor,  # [T, heads, head_dim], normed in place (a view of the fused q/k/v)
    doubled_weight: torch.Tensor,  # [2 * head_dim]
    eps: float,
) -> None:
    num_tokens, heads, head_dim = x.shape
    x.copy_(rms_norm(x.reshape(-1, head_dim), doubled_weight, eps).view(num_tokens, heads, head_dim))


def check_weights(config: ModelConfig, weights: Mapping[str, torch.Tensor]) -> None:
    """ValueError naming the first tensor the config needs that `weights` lacks or holds in
    another shape. Cheap: loaders run it before allocating the model."""
    for name, shape in config.weight_shapes():
        if name not in weights:
            raise ValueError(f"weights is missing {name!r}")
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"weights[{name!r}] has shape {tuple(weights[name].shape)}, "
                             f"expected {shape}")


class DecoderLayer(nn.Module):
    """One transformer block: x += attn(norm(x)); x += mlp(norm(x)); with sandwich norms the
    attention and MLP outputs are normed before they are added.

    post_attention_norm is the MLP's input norm (Llama's post_attention_layernorm, Gemma 2's
    pre_feedforward_layernorm); attn_out_norm and mlp_out_norm exist with sandwich norms only."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 widening: WideningBuffer | None, quantized: bool = False) -> None:
        super().__init__()

        def linear(in_features: int, out_features: int, bias: bool) -> Linear | QuantLinear:
            if quantized:
                return QuantLinear(in_features, out_features, bias)
            return Linear(in_features, out_features, dtype, device, widening, bias)

        def norm(width: int) -> nn.Parameter:  # doubled, see rms_norm
            return empty_parameter((2 * width,), dtype, device)

        hidden, heads, kv_heads = config.hidden_size, config.num_heads, config.num_kv_heads
        head_dim, inter = config.head_dim, config.intermediate_size
        self.eps = config.rms_norm_eps
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.inter = inter
        self.input_norm = norm(hidden)
        self.post_attention_norm = norm(hidden)
        self.attn_out_norm = norm(hidden) if config.sandwich_norms else None
        self.mlp_out_norm = norm(hidden) if config.sandwich_norms else None
        self.q_norm = norm(head_dim) if config.qk_norm else None
        self.k_norm = norm(head_dim) if config.qk_norm else None
        self.qkv_proj = linear(hidden, (heads + 2 * kv_heads) * head_dim, config.qkv_bias)
        self.o_proj = linear(heads * head_dim, hidden, config.o_bias)
        self.gate_up_proj = linear(hidden, 2 * inter, config.mlp_bias)
        self.down_proj = linear(inter, hidden, config.mlp_bias)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.scale, self.softcap = config.attention_scale, config.attn_logit_softcap

    def load(self, weights: Mapping[str, torch.Tensor | QuantizedWeight], prefix: str,
             norm_offset: float) -> None:
        """This layer's tensors from a checkpoint in Hugging Face names (prefix:
        "model.layers.{i}."); norm_offset is added to the norm weights (Gemma's 1 + w)."""
        def norm(parameter: nn.Parameter | None, name: str) -> None:
            if parameter is not None:
                parameter.copy_((weights[prefix + name] + norm_offset).repeat(2))

        def fill(module: Linear | QuantLinear, names: list[str]) -> None:
            tensors = [weights[prefix + n + ".weight"] for n in names]
            if isinstance(module, QuantLinear):
                module.load(tensors)
            else:
                module.weight.copy_(tensors[0] if len(tensors) == 1 else torch.cat(tensors))
            if module.bias is not None:
                module.bias.copy_(torch.cat([weights[prefix + n + ".bias"] for n in names]))

        sandwich = self.attn_out_norm is not None
        norm(self.input_norm, "input_layernorm.weight")
        norm(self.post_attention_norm, "pre_feedforward_layernorm.weight" if sandwich
             else "post_attention_layernorm.weight")
        norm(self.attn_out_norm, "post_attention_layernorm.weight")
        norm(self.mlp_out_norm, "post_feedforward_layernorm.weight")
        norm(self.q_norm, "self_attn.q_norm.weight")
        norm(self.k_norm, "self_attn.k_norm.weight")
        fill(self.qkv_proj, [f"self_attn.{x}_proj" for x in "qkv"])
        fill(self.o_proj, ["self_attn.o_proj"])
        fill(self.gate_up_proj, ["mlp.gate_proj", "mlp.up_proj"])
        fill(self.down_proj, ["mlp.down_proj"])

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden_size], updated in place
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,  # [T, 1, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        plan: AttentionPlan,
    ) -> torch.Tensor:  # [T, hidden_size]
        num_tokens = hidden.shape[0]
        x = rms_norm(hidden, self.input_norm, self.eps)
        qkv = self.qkv_proj(x).view(num_tokens, -1, self.head_dim)  # heads: q, then k, then v
        if self.q_norm is not None:
            _norm_heads_(qkv[:, : self.heads], self.q_norm, self.eps)
            _norm_heads_(qkv[:, self.heads : self.heads + self.kv_heads], self.k_norm, self.eps)
        apply_rotary_(qkv[:, : self.heads + self.kv_heads], cos, sin)
        attn = paged_attention(qkv[:, : self.heads], qkv[:, self.heads :], kv_cache, plan,
                               self.scale, self.softcap)
        out = self.o_proj(attn)
        if self.attn_out_norm is not None:
            out = rms_norm(out, self.attn_out_norm, self.eps)
        hidden += out

        x = rms_norm(hidden, self.post_attention_norm, self.eps)
        gate_up = self.gate_up_proj(x)
        gate = gate_up[:, : self.inter]
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        out = self.down_proj(gate.mul_(gate_up[:, self.inter :]))
        if self.mlp_out_norm is not None:
            out = rms_norm(out, self.mlp_out_norm, self.eps)
        hidden += out
        return hidden


class LlamaModel(nn.Module):
    """A causal LM of any supported family over a paged KV cache (see verispec.model.attention
    for the terms: new tokens, seq_len, block, slot).

    One forward pass takes the new tokens of every sequence in the batch, writes their keys and
    values into the cache, and returns logits for the requested rows only. Sequences may be
    prefill chunks, single decode tokens, or a last token plus draft tokens, mixed in one batch.

    quantized: the linear layers, the embedding and the LM head take QuantizedWeights (stored
    blocks, verispec.model.quant) in `load_weights`; activations, norms and the KV cache are
    float32 (dtype must be float32), and the model runs on the CPU.

    Layers with the same rotary parameters share one set of angles per forward pass, and layers
    with the same sliding window one AttentionPlan (Gemma 2/3 alternate two of each).

    compiled_layers: a quantized or CPU float32 model runs its decoder layers as one compiled
    call per pass (verispec.model.quant.decoder) where the compiled kernels run all its
    weights; False keeps the torch operations of DecoderLayer (tests compare the two).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", quantized: bool = False) -> None:
        super().__init__()
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"dtype={dtype!r} is not supported: expected one of {SUPPORTED_DTYPES}")
        device = torch.device(device)
        if quantized and (dtype != torch.float32 or device.type != "cpu"):
            raise ValueError(f"quantized weights run with float32 activations on the CPU, not "
                             f"dtype={dtype} on device={str(device)!r}")
        self.config, self.dtype, self.device, self.quantized = config, dtype, device, quantized
        # Quantized and CPU float32 models attend row by row (verispec.model.attention) where
        # it is compiled, in the compiled decoder stack; quantized ones over a float16 KV cache
        # as llama.cpp keeps: half the memory and bytes read per step; the kernel widens each
        # value exactly, so rows stay batch invariant.
        self.layer_windows = [config.window_of(i) for i in range(config.num_layers)]
        cpu_fp32 = device.type == "cpu" and dtype == torch.float32
        self.rowwise_attention = (quantized or cpu_fp32) and compiled_kernels() is not None
        self.kv_dtype = torch.float16 if quantized and self.rowwise_attention else dtype
        ropes = [config.rope_of(i) for i in range(config.num_layers)]
        self.rotaries = {rope: RotaryEmbedding(config.head_dim, rope[0], dtype, device, rope[1],
                                               config.max_position_embeddings)
                         for rope in dict.fromkeys(ropes)}
        self.layer_ropes = ropes
        self.embedding_scale = config.embedding_scale
        self.widening = widening = None if quantized else widening_for(dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device, widening, quantized)
                                    for _ in range(config.num_layers))
        self.compiled_layers = True
        self._stack: object | None = None  # built at the first pass after weights are loaded
        self._stack_built = False
        # Doubled, see rms_norm.
        self.norm = empty_parameter((2 * config.hidden_size,), dtype, device)
        self.lm_head: Linear | QuantLinear
        if quantized:
            self.embed_quantized: QuantizedWeight | torch.Tensor | None = None
            self.lm_head = QuantLinear(config.hidden_size, config.vocab_size)
            return
        self.embed_tokens = empty_parameter((config.vocab_size, config.hidden_size), dtype, device)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype, device, widening)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens

    def load_weights(self, weights: Mapping[str, torch.Tensor | QuantizedWeight]) -> None:
        """Copy a checkpoint in Hugging Face names (model.layers.0.self_attn.q_proj.weight, ...);
        a quantized model takes the linear layers' and the embedding's weights as stored
        (QuantizedWeight, or a float tensor where no kernel runs the stored type).

        Raises ValueError naming the first missing tensor or one of the wrong shape."""
        check_weights(self.config, weights)
        self._stack, self._stack_built = None, False
        offset = self.config.norm_weight_offset
        with torch.no_grad():
            if self.quantized:
                embed = weights["model.embed_tokens.weight"]
                self.lm_head.load([weights["model.embed_tokens.weight"
                                           if self.config.tie_word_embeddings else "lm_head.weight"]])
                if self.config.tie_word_embeddings and isinstance(embed, QuantizedWeight):
                    self.embed_quantized = self.lm_head.parts[0]  # one table for both
                else:
                    self.embed_quantized = embed if isinstance(embed, QuantizedWeight) else embed.float()
            else:
                self.embed_tokens.copy_(weights["model.embed_tokens.weight"])
                if not self.config.tie_word_embeddings:
                    self.lm_head.weight.copy_(weights["lm_head.weight"])
            self.norm.copy_((weights["model.norm.weight"] + offset).repeat(2))
            for i, layer in enumerate(self.layers):
                layer.load(weights, f"model.layers.{i}.", offset)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, hidden_size]
        """The input embeddings of the tokens (rows of a quantized table dequantized), times the
        embedding scale (rounded to the model's dtype first, as transformers rounds it)."""
        if not self.quantized:
            rows = F.embedding(input_ids, self.embed_tokens)
        elif isinstance(self.embed_quantized, (QuantizedWeight, PanelWeight)):
            rows = dequantize_rows(self.embed_quantized, input_ids)
        else:
            rows = F.embedding(input_ids, self.embed_quantized)
        if self.embedding_scale == 1.0:
            return rows
        return rows * torch.tensor(self.embedding_scale, dtype=rows.dtype)

    def lm_head_rows(self, index: torch.Tensor) -> torch.Tensor:  # [R] int64 -> [R, hidden_size]
        """Rows of the LM head's weight in the model's dtype (learned heads borrow them)."""
        if self.quantized:
            return self.lm_head.dense_rows(index)
        return self.lm_head.weight.index_select(0, index)

    def weight_bytes(self) -> int:
        """Bytes of all weights, as stored (blocks for a quantized model)."""
        stored = sum(p.numel() * p.element_size() for p in self.parameters())
        if self.quantized:
            linears = [m for m in self.modules() if isinstance(m, QuantLinear)]
            stored += sum(p.numel() * p.element_size() if isinstance(p, torch.Tensor) else p.nbytes
                          for m in linears for p in m.parts)
            embed = self.embed_quantized
            if not self.embedding_is_lm_head:
                stored += embed.numel() * embed.element_size() if isinstance(embed, torch.Tensor) \
                    else embed.nbytes
        return stored

    @property
    def embedding_is_lm_head(self) -> bool:
        """A tied quantized model's lookups read the LM head's own table (load_weights)."""
        return self.quantized and any(self.embed_quantized is part for part in self.lm_head.parts)

    def _compiled_stack(self):  # -> verispec.cpu_kernels.DecoderStack | None
        if not (self.compiled_layers and self.rowwise_attention):
            return None
        if not self._stack_built:
            ropes, windows = list(self.rotaries), list(dict.fromkeys(self.layer_windows))
            self._stack = build_stack(self.layers, [ropes.index(r) for r in self.layer_ropes],
                                      [windows.index(w) for w in self.layer_windows],
                                      self.norm, self.lm_head)
            self._stack_built = True
        return self._stack

    @property
    def row_cost(self) -> float:
        """What one more row costs a forward pass, relative to the pass's fixed cost (the
        adaptive K's default, SpeculativeConfig.row_cost, and where its learned row cost starts,
        spec_decode/step_costs.py). Measured with bench/draft_cost.py on the embedded model, 2
        threads: 0.1 with float32 weights; 0.6 with its 4-bit blocks, whose one-row pass reads the
        weights at the memory's pace and each extra row adds its integer products, its attention
        and its logits (0.52-0.71 on an Intel Xeon with AVX-512 VNNI, 0.63-0.72 on an AVX2 AMD
        EPYC; 0.3 on an AMD EPYC with AVX-512 VNNI)."""
        return 0.6 if self.quantized else 0.1

    def padded_rows(self, rows: int) -> int:
        """The row count a forward pass over `rows` new tokens costs like: on CPU the products
        pad rows to the counts BLAS runs fastest (verispec.model.linear)."""
        return self.lm_head.cost_rows(rows)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        """One tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim].

        Zero-filled where SDPA attends (it masks unwritten slots, but a masked NaN would still
        poison the weighted sum of values). The row-by-row attention reads written slots only,
        so its cache (float16 for quantized models, `kv_dtype`) is left unfilled: its memory is
        taken as it is used, not all at once."""
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} is invalid: expected a positive int")
        shape = (2, num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)
        make = torch.empty if self.rowwise_attention else torch.zeros
        return [make(shape, dtype=self.kv_dtype, device=self.device)
                for _ in range(self.config.num_layers)]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, new tokens of all sequences in batch order
        positions: torch.Tensor,  # [T] int64, absolute position of each new token
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
        logits_indices: torch.Tensor,  # [R] int64, rows of T that need logits
    ) -> torch.Tensor:  # [R, vocab_size] float32
        return self.forward_hidden(input_ids, positions, attn, kv_caches, logits_indices)[0]

    @torch.inference_mode()
    def forward_hidden(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        logits_indices: torch.Tensor,  # [R] int64
        hidden_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [R, vocab_size] float32, [T, H * hidden_size]
        """`forward`, plus the hidden states a learned drafter reads, from the same pass: for
        every new token, the output of each layer in `hidden_layers` (1-based: layer
        num_layers is the last, before the final norm), concatenated in the order given
        (None without `hidden_layers`)."""
        for layer_number in hidden_layers:
            if not 1 <= layer_number <= self.config.num_layers:
                raise ValueError(f"hidden_layers holds {layer_number!r}: expected layer numbers "
                                 f"in [1, {self.config.num_layers}]")
        plans = {window: AttentionPlan(attn, block_size=kv_caches[0].shape[2],
                                       widen_decode=self.widening is not None,
                                       rowwise=self.rowwise_attention, window=window,
                                       rowwise_max_query=None if self.quantized
                                       else FLOAT_ROWWISE_MAX_QUERY)
                 for window in dict.fromkeys(self.layer_windows)}
        angles = {rope: rotary.angles(positions) for rope, rotary in self.rotaries.items()}
        hidden = self.embed(input_ids)
        captured: dict[int, torch.Tensor] = {}
        last = self.config.num_layers
        # The stack attends every row row by row: a pass with a sequence attended on its own
        # (a long float32 prefill chunk) runs the torch layers.
        stack = None if any(plan.singles for plan in plans.values()) else self._compiled_stack()
        if stack is not None:
            hidden = hidden.contiguous()
            cos = [angles[rope][0] for rope in self.rotaries]
            sin = [angles[rope][1] for rope in self.rotaries]
            row_plans = [plans[w].rows.tensors() for w in dict.fromkeys(self.layer_windows)]
            products = stack_products(self.layers[0], len(input_ids))
            inner = sorted(set(hidden_layers) - {last})
            captured = {number: torch.empty_like(hidden) for number in inner}
            stack.forward(hidden, 0, last, cos, sin, kv_caches, attn.slot_mapping, row_plans, products,
                          inner, [captured[number] for number in inner])
        else:
            for number, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches), start=1):
                cos, sin = angles[self.layer_ropes[number - 1]]
                hidden = layer(hidden, cos, sin, kv_cache, plans[self.layer_windows[number - 1]])
                if number in hidden_layers and number != last:
                    captured[number] = hidden.clone()  # later layers update `hidden` in place
        captured[last] = hidden
        if stack is not None and stack.has_head:
            logits = stack.logits(hidden, logits_indices,
                                  product_code(self.lm_head, len(logits_indices)))
        else:
            rows = rms_norm(hidden.index_select(0, logits_indices), self.norm, self.config.rms_norm_eps)
            logits = self.lm_head(rows).float()
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if not hidden_layers:
            return logits, None
        return logits, torch.cat([captured[n] for n in hidden_layers], dim=-1)
