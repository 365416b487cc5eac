"""Learned draft heads on the target's hidden states: EAGLE (one decoder layer, autoregressive
over its own features) and Medusa (K independent residual heads), and their files.

Terms, used by the drafters (spec_decode/eagle.py, spec_decode/medusa.py) and the trainer (verispec/train):
- feature f_t: what a head reads of the target at position t. By default the target's
  last-layer hidden state after the target's final norm (what its LM head reads): normalised
  features keep the heads' inputs and regression targets at one scale. A *fused* EAGLE head
  (EAGLE-3) reads the hidden states of a low, a middle and a high layer instead, each
  RMS-normalised, concatenated and projected to one feature by a learned matrix.
- draft vocabulary: the N target tokens a head can propose (the most frequent ones in the
  training text, as EAGLE-3 does); a head's LM head is the target's, restricted to those rows,
  so a draft step costs N / vocab_size of a full LM head. Other tokens get q = 0.
- EAGLE: at position t the head reads (f_t, embedding of x_{t+1}) and predicts f_{t+1}, hence the
  distribution of x_{t+2}; drafting feeds its own predicted features back, one token at a time,
  through a paged KV cache of its own. A fused head's output is not pinned to any target
  feature (it is trained on tokens only, as EAGLE-3 is): it is whatever feature the head feeds
  itself, and its own final norm comes before the LM head.
- Medusa: head k (1..K) reads f_t alone and predicts x_{t+k+1}, so one pass over the newest
  feature drafts K tokens.

A head file is safetensors: the head's own weights, "draft_vocab" (int64 [N]), and the
HeadConfig as JSON under the metadata key "verispec.head". The target's embedding, final norm
and LM head are never stored: they are read from the target the head is loaded onto, which
must match the config's target shape.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..files import atomic_path
from ..model import AttentionMetadata, LlamaModel, ModelConfig
from ..model.attention import AttentionPlan
from ..model.linear import Linear
from ..model.llama import DecoderLayer, rms_norm
from ..model.quant.decoder import build_eagle_chain, build_stack, product_code, stack_products
from ..model.rotary import RotaryEmbedding
from .chain_inputs import ChainInputs

KINDS = ("eagle", "medusa")
METADATA_KEY = "verispec.head"
# Heads trained for the embedded SmolLM2-135M-Instruct, shipped in the package (docs/drafter-training.md).
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "heads"


def shipped_head(kind: str) -> Path:
    """The head file of `kind` shipped for the embedded model."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is invalid: expected one of {KINDS}")
    return SHIPPED_DIR / f"{kind}-smollm2-135m-instruct.safetensors"


def fused_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers a fused EAGLE head reads (1-based, distinct, ascending): a low, a middle
    and a high one, as EAGLE-3 picks them (for 30 layers: 2, 15 and 27)."""
    return tuple(sorted({min(2, num_layers), max(1, num_layers // 2), max(1, num_layers - 3)}))


def head_config(path: str | os.PathLike[str]) -> HeadConfig:
    """The config of the head stored at `path` (ValueError when it is not a head file)."""
    return _read(path)[0]


@dataclass(frozen=True)
class HeadConfig:
    """The shape of a draft head and of the target it belongs to.

    kind: "eagle" or "medusa".
    target_vocab_size / hidden_size / target_num_layers: the target's, checked at load.
    num_heads / num_kv_heads / head_dim / intermediate_size / rms_norm_eps / rope_theta: the
        EAGLE decoder layer's attention and MLP (the target's attention shape by default).
    num_medusa_heads: K, Medusa's number of heads (drafts per step).
    fused_layers: the target layers a fused EAGLE head reads (1-based, ascending); empty for
        the default feature (the last layer's, normalised).
    """

    kind: str
    target_vocab_size: int
    hidden_size: int
    target_num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    num_medusa_heads: int = 4
    fused_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} is invalid: expected one of {KINDS}")
        if not isinstance(self.num_medusa_heads, int) or not 1 <= self.num_medusa_heads <= 16:
            raise ValueError(f"num_medusa_heads={self.num_medusa_heads!r} is invalid: "
                             "expected an integer in [1, 16]")
        layers = tuple(self.fused_layers)  # a list when read back from JSON
        object.__setattr__(self, "fused_layers", layers)
        if layers and (self.kind != "eagle" or list(layers) != sorted(set(layers))
                       or not all(isinstance(n, int) and 1 <= n <= self.target_num_layers for n in layers)):
            raise ValueError(f"fused_layers={layers!r} is invalid: expected distinct ascending layer "
                             f"numbers in [1, {self.target_num_layers}], for an eagle head only")

    @classmethod
    def for_target(cls, kind: str, target: ModelConfig, intermediate_size: int | None = None,
                   num_medusa_heads: int = 4, fused: bool = False) -> HeadConfig:
        """`fused`: an EAGLE head reading fused_layers(target.num_layers) (EAGLE-3)."""
        return cls(kind, target.vocab_size, target.hidden_size, target.num_layers, target.num_heads,
                   target.num_kv_heads, target.head_dim,
                   intermediate_size or target.intermediate_size, target.rms_norm_eps,
                   target.rope_theta, num_medusa_heads,
                   fused_layers(target.num_layers) if fused else ())

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target layers the head reads, in the order `_Head.features` takes them."""
        return self.fused_layers or (self.target_num_layers,)

    def layer_config(self) -> ModelConfig:
        """The EAGLE decoder layer's shape, as a one-layer ModelConfig."""
        return ModelConfig(vocab_size=self.target_vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=1,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
                           rope_theta=self.rope_theta)

    def check_target(self, target: ModelConfig, source: str) -> None:
        for name, mine, theirs in (("vocab_size", self.target_vocab_size, target.vocab_size),
                                   ("hidden_size", self.hidden_size, target.hidden_size),
                                   ("num_layers", self.target_num_layers, target.num_layers)):
            if mine != theirs:
                raise ValueError(f"{source} is a head for a target with {name}={mine}; this "
                                 f"target has {name}={theirs}")


class _Head(nn.Module):
    """What both kinds share: the target's norm and embedding (borrowed, never stored) and its
    LM head restricted to the draft vocabulary."""

    def __init__(self, config: HeadConfig, target: LlamaModel,
                 draft_vocab: torch.Tensor) -> None:  # draft_vocab: [N] int64
        super().__init__()
        config.check_target(target.config, "the head")
        vocab = draft_vocab.to(device=target.device, dtype=torch.int64)
        if vocab.dim() != 1 or vocab.numel() == 0 or vocab.unique().numel() != vocab.numel() \
                or int(vocab.min()) < 0 or int(vocab.max()) >= config.target_vocab_size:
            raise ValueError(f"draft_vocab must be distinct token ids in [0, "
                             f"{config.target_vocab_size}), got {vocab.numel()} ids")
        self.config, self.dtype, self.widening = config, target.dtype, target.widening
        self.draft_vocab = vocab  # plain attribute: saved by save_head, not as a parameter
        self._target_embed = target.embed
        self._target_norm = target.norm.detach()
        self.lm_head = Linear(config.hidden_size, vocab.numel(), target.dtype, target.device,
                              target.widening)
        with torch.no_grad():
            self.lm_head.weight.copy_(target.lm_head_rows(vocab))

    def features(
        self, hidden: torch.Tensor,  # [T, len(config.hidden_layers) * d] the target's, as drafters observe them
    ) -> torch.Tensor:  # [T, d]
        """The features the head reads (module docstring): here the target's final norm."""
        return rms_norm(hidden, self._target_norm, self.config.rms_norm_eps)

    def logits(self, features: torch.Tensor) -> torch.Tensor:  # [R, d] the head's output -> [R, N] float32
        return self.lm_head(features).float()

    def target_logits(
        self, hidden: torch.Tensor,  # [R, d] the target's last-layer hidden states
    ) -> torch.Tensor:  # [R, N] float32
        """The target's own logits over the draft vocabulary: what training distils."""
        return self.lm_head(rms_norm(hidden, self._target_norm, self.config.rms_norm_eps)).float()

    def trainable(self) -> list[nn.Parameter]:
        """The head's own weights (not the borrowed LM head), made to require gradients."""
        params = [p for name, p in self.named_parameters() if not name.startswith("lm_head.")]
        for p in params:
            p.requires_grad_(True)
        return params

    def own_state(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.named_parameters()
                if not name.startswith("lm_head.")}


class EagleHead(_Head):
    """fc([embedding of x_{t+1}, f_t]) -> one decoder layer -> predicted f_{t+1}. A fused head
    first makes f_t from its layers (`fuse`) and norms its output before the LM head (`norm`)."""

    def __init__(self, config: HeadConfig, target: LlamaModel, draft_vocab: torch.Tensor) -> None:
        super().__init__(config, target, draft_vocab)
        d = config.hidden_size
        self.fc = Linear(2 * d, d, target.dtype, target.device, target.widening)
        self.layer = DecoderLayer(config.layer_config(), target.dtype, target.device, target.widening)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, target.dtype, target.device)
        self._stack = None  # the layer as one compiled call (compile_layer), or None
        self._chain = None  # a fused head's greedy drafting as one compiled call (compile_layer), or None
        self._product_codes: dict[int, list[int]] = {}  # rows -> stack_products (_products)
        if config.fused_layers:
            self.fuse = Linear(len(config.fused_layers) * d, d, target.dtype, target.device, target.widening)
            self.norm = nn.Parameter(torch.ones(2 * d, dtype=target.dtype, device=target.device))  # doubled, see rms_norm

    def features(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, n * d] -> [T, d]
        if not self.config.fused_layers:
            return super().features(hidden)
        n, d = len(self.config.fused_layers), self.config.hidden_size
        # Each layer at unit RMS: hidden states grow with depth (SmolLM2-135M: median RMS 2.6 at
        # layer 2, 24 at layer 27, some tokens' 1,000), and fuse would read mostly the deepest.
        # As torch's layer_norm over [x, -x] (model/llama.py rms_norm): F.rms_norm runs as ~10 ops.
        rows = hidden.reshape(-1, n, d)
        unit = F.layer_norm(torch.cat((rows, -rows), dim=-1), (2 * d,), eps=self.config.rms_norm_eps)[..., :d]
        return self.fuse(unit.reshape(-1, n * d))

    def logits(self, features: torch.Tensor) -> torch.Tensor:  # [R, d] -> [R, N] float32
        if not self.config.fused_layers:
            return super().logits(features)
        return super().logits(rms_norm(features, self.norm, self.config.rms_norm_eps))

    def row_logits(
        self, outputs: torch.Tensor,  # [T, d] forward's
        rows: torch.Tensor,  # [R] int64, the rows of `outputs` to take
    ) -> torch.Tensor:  # [R, N] float32
        """`logits` of some of forward's rows: for a fused head with the layer compiled, its
        norm and LM head run in the compiled stack, one call."""
        if self._stack is not None and self._stack.has_head:
            return self._stack.logits(outputs, rows, product_code(self.lm_head, len(rows)))
        return self.logits(outputs.index_select(0, rows))

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        shape = (2, num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=self.draft_vocab.device)]

    def compile_layer(self) -> bool:
        """Runs the decoder layer as one compiled call (verispec.model.quant.decoder, row-by-row
        attention over the head's float32 cache) from now on, where the stack runs its weights
        (in panels after quantize_linears_, or float32 on the CPU); returns whether it does. The
        stack has no backward: for inference only (LLM calls it for a quantized head on a quantized
        target). A draft position then costs 0.083 of the 4-bit target's step instead of 0.14
        with the layer's torch operations (bench/draft_cost.py). A fused head's norm and LM head
        run in the stack too (row_logits)."""
        self._stack = build_stack([self.layer], [0], [0], self.norm if self.config.fused_layers else None,
                                  self.lm_head)
        self._product_codes.clear()  # the layer's parts may have been quantized since
        if self._stack is not None and self._stack.has_head:  # a fused head's
            with torch.no_grad():
                table = self._target_embed(self.draft_vocab)  # [N, d]
            self._chain = build_eagle_chain(self.fc, self.fuse, len(self.config.fused_layers), table,
                                            self.draft_vocab, self.config.rms_norm_eps)
        return self._stack is not None

    @property
    def drafts_in_one_call(self) -> bool:
        """Whether chain_drafts runs (compile_layer built the compiled chain)."""
        return self._chain is not None

    def chain_drafts(
        self,
        hidden: torch.Tensor,  # [T, len(fused_layers) * d] the catch-up rows' target hidden states
        inputs: ChainInputs,  # the call's rows, in the head's cache
        kv_caches: list[torch.Tensor],
        filters: tuple[torch.Tensor, ...],  # [R] each: temperature (0: greedy), top_k, top_p, min_p
        uniforms: torch.Tensor,  # [R, D] float64, request r's uniform for its draft at position s
    ) -> tuple[list[list[int]], torch.Tensor | None]:  # drafts; q [R, D, N] (None: all greedy)
        """Each request's drafts (the first maximum of the draft logits for a greedy request, a
        draw at its uniform from its filtered distribution otherwise), the whole chain in one
        compiled call (csrc/eagle_chain.h): what `forward` and `row_logits` compute position by
        position, without Python between the positions."""
        cos, sin = self.rotary.angles(inputs.positions)
        rows, requests = len(inputs.input_ids), len(inputs.depths)
        drafts, q = self._chain.draft(
            self._stack, hidden.contiguous(), self._target_embed(inputs.input_ids).float().contiguous(),
            cos.contiguous(), sin.contiguous(), kv_caches, inputs.slots, inputs.plan, inputs.logits_rows,
            inputs.block_tables, inputs.chain_start, torch.tensor(inputs.depths, dtype=torch.int64),
            self._products(rows), self._products(requests), product_code(self.lm_head, requests),
            *(f.contiguous() for f in filters), uniforms.contiguous())
        return [row[:depth] for row, depth in zip(drafts.tolist(), inputs.depths)], q if q.numel() else None

    def _products(self, rows: int) -> list[int]:
        """stack_products of the layer at `rows` rows, kept: they depend on the count alone."""
        if rows not in self._product_codes:
            self._product_codes[rows] = stack_products(self.layer, rows)
        return self._product_codes[rows]

    def forward(
        self,
        features: torch.Tensor,  # [T, d] f_t of each row (true or predicted)
        input_ids: torch.Tensor,  # [T] int64, x_{t+1} of each row
        positions: torch.Tensor,  # [T] int64, t
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # one layer's cache
    ) -> torch.Tensor:  # [T, d] predicted f_{t+1}
        cos, sin = self.rotary.angles(positions)
        x = self.fc(torch.cat((self._target_embed(input_ids), features), dim=-1))
        if self._stack is not None:
            plan = AttentionPlan(attn, block_size=kv_caches[0].shape[2], rowwise=True)
            x = x.contiguous()
            self._stack.forward(x, 0, 1, [cos], [sin], kv_caches, attn.slot_mapping,
                                [plan.rows.tensors()], self._products(len(x)))
            return x
        plan = AttentionPlan(attn, block_size=kv_caches[0].shape[2],
                             widen_decode=self.widening is not None)
        return self.layer(x, cos, sin, kv_caches[0], plan)


class MedusaHeads(_Head):
    """Head k: y = f + SiLU(W_k f), logits = LM head(y); W_k starts at zero, so an untrained
    head predicts what the target's LM head does at position t."""

    def __init__(self, config: HeadConfig, target: LlamaModel, draft_vocab: torch.Tensor) -> None:
        super().__init__(config, target, draft_vocab)
        d = config.hidden_size
        self.blocks = nn.ModuleList(Linear(d, d, target.dtype, target.device, target.widening)
                                    for _ in range(config.num_medusa_heads))

    def forward(
        self,
        features: torch.Tensor,  # [R, d]
        num_heads: int | None = None,
    ) -> torch.Tensor:  # [num_heads, R, N] float32
        """The first num_heads heads' logits (all heads by default). One LM-head product serves
        them all: the restricted LM head is most of a head's cost and is read once, not once per
        head (on CPU 4 heads over one feature: 15.6 ms apart, 5.4 ms together)."""
        blocks = self.blocks[:num_heads]
        residual = torch.stack([features + F.silu(block(features)) for block in blocks])  # [K, R, d]
        return self.logits(residual.flatten(0, 1)).view(len(blocks), features.shape[0], -1)

    def head_logits(self, k: int, features: torch.Tensor) -> torch.Tensor:  # [R, d] -> [R, N] float32
        """Head k + 1's logits (0-based k)."""
        return self.logits(features + F.silu(self.blocks[k](features)))


Head = EagleHead | MedusaHeads


def new_head(config: HeadConfig, target: LlamaModel, draft_vocab: torch.Tensor,
             seed: int = 0) -> Head:
    """An untrained head: small random weights (Medusa's blocks zero, see MedusaHeads); the
    EAGLE layer's norms start at one."""
    head = (EagleHead if config.kind == "eagle" else MedusaHeads)(config, target, draft_vocab)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in head.own_state().items():
            if name.endswith("norm"):
                p.fill_(1.0)
            elif config.kind == "medusa":
                p.zero_()
            else:
                std = p.shape[-1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    return head


def save_head(head: Head, path: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16) -> None:
    """Writes the head's own weights in `dtype` (bf16 by default: the file ships in the package)."""
    from safetensors.torch import save_file

    tensors = {name: t.to("cpu", dtype).contiguous() for name, t in head.own_state().items()}
    tensors["draft_vocab"] = head.draft_vocab.cpu()
    with atomic_path(path) as partial:
        save_file(tensors, str(partial), metadata={METADATA_KEY: json.dumps(dataclasses.asdict(head.config))})


def _read(path: str | os.PathLike[str]) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    source = f"draft head file {str(path)!r}"
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = (f.metadata() or {}).get(METADATA_KEY)
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    # A damaged file (cut short, empty, random bytes, an absurd header length, offsets past its
    # end) is a SafetensorError, which derives from Exception alone.
    except SafetensorError as error:
        raise ValueError(f"{source} is not a valid safetensors file: {error}") from None
    except (OSError, ValueError, RuntimeError) as error:
        raise ValueError(f"{source} cannot be read: {error}") from None
    if meta is None or "draft_vocab" not in tensors:
        raise ValueError(f"{source} is not a verispec draft head (no {METADATA_KEY!r} metadata)")
    try:
        return HeadConfig(**json.loads(meta)), tensors
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source} has an invalid config: {error}") from None


def load_head(path: str | os.PathLike[str], target: LlamaModel) -> Head:
    """The head stored at `path`, on `target`'s device and dtype. ValueError naming the file
    when it is not a head file or belongs to a target of another shape."""
    source = f"draft head file {str(path)!r}"
    config, tensors = _read(path)
    config.check_target(target.config, source)
    head = (EagleHead if config.kind == "eagle" else MedusaHeads)(config, target, tensors.pop("draft_vocab"))
    expected = head.own_state()
    if set(tensors) != set(expected):
        raise ValueError(f"{source} holds tensors {sorted(tensors)}: expected {sorted(expected)}")
    with torch.no_grad():
        for name, p in expected.items():
            if tuple(tensors[name].shape) != tuple(p.shape):
                raise ValueError(f"{source}: {name!r} has shape {tuple(tensors[name].shape)}, "
                                 f"expected {tuple(p.shape)}")
            p.copy_(tensors[name])
    return head
