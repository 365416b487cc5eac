"""LLM: the offline API. Load once, then generate, chat or stream.

    llm = LLM()                                   # embedded SmolLM2-135M-Instruct, n-gram drafts
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0))
    print(out[0].text, out[0].stats.mean_acceptance_length)

Every call validates all of its prompts before queueing any. Calls share one engine: whoever
needs output steps it, and every output lands in its request's own outbox, so streams read in
turn, or a generate() while a stream is open, each receive all of their own outputs.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections import deque
from typing import Any, Iterator, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from ..config import LEARNED_METHODS, CacheConfig, EngineConfig, SpeculativeConfig, StructuredOutputConfig, TreeShape
from ..model import LlamaModel, load_model
from ..model.loader import QUANTIZATIONS
from ..model.quant.linear import quantize_linears_
from ..sampling_params import STRUCTURED_FIELDS, SamplingParams
from ..spec_decode.base import Drafter
from ..spec_decode.draft_model import DraftModelDrafter, draft_model_cost
from ..spec_decode.eagle import EAGLE_COST, EAGLE_COST_QUANTIZED, EagleDrafter
from ..spec_decode.heads import KINDS, head_config, load_head, shipped_head
from ..spec_decode.hybrid import LOOKUP_MIN_N, HybridDrafter
from ..spec_decode.medusa import MEDUSA_COST, MEDUSA_COST_QUANTIZED, MedusaDrafter
from ..spec_decode.ngram import NGRAM_COST, NGRAM_COST_QUANTIZED, NgramDrafter
from ..tools import ToolUse, render_tool_chat, split_calls, tool_grammar, tool_use
from .engine import LLMEngine, PreparedRequest, RequestOutput

HYBRID = "ngram+"  # a `draft` prefix: prompt lookup first, the named head otherwise (spec_decode/hybrid.py)
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}

Prompt = str | list[int]
Message = dict[str, Any]  # role, content; tool traffic adds tool_calls / tool_call_id


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype={dtype!r} is invalid: expected 'auto' or one of {sorted(_DTYPES)}")


def resolve_weights(model: object, dtype: str | torch.dtype, quantization: str | None,
                    device: str | torch.device) -> tuple[torch.dtype, str | None]:
    """(torch dtype, load_model's quantization) for LLM's arguments: with dtype "auto", a .gguf
    file (the embedded default included) runs its stored blocks on the CPU, and anything else,
    or on another device, runs in float32."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is invalid: expected None or one of "
                         f"{QUANTIZATIONS}")
    if dtype != "auto":
        torch_dtype = resolve_dtype(dtype)
        if quantization is not None and torch_dtype != torch.float32:
            raise ValueError(f"dtype={dtype!r} is invalid with quantization={quantization!r}: "
                             f"quantized weights take float32 activations (use 'auto')")
        return torch_dtype, quantization
    on_cpu = str(device).startswith("cpu")
    if quantization is None and on_cpu and (model is None or str(model).lower().endswith(".gguf")):
        quantization = "gguf"
    return torch.float32, quantization


def _draft_method(draft: object) -> tuple[str, str | None]:
    """SpeculativeConfig's (method, draft_model) for LLM's `draft` argument."""
    if draft is None or draft == "none":
        return "none", None
    if draft == "ngram" or draft in KINDS:
        return draft, None
    if not isinstance(draft, (str, os.PathLike)):
        raise TypeError(f"draft is {type(draft).__name__}: expected a str")
    text = str(draft)
    if text.startswith(HYBRID):
        head = text[len(HYBRID):]
        if head in KINDS:
            return text, None
        if not head.endswith(".safetensors"):
            raise ValueError(f"draft={text!r} is invalid: after {HYBRID!r} expected 'eagle', 'medusa' or "
                             "a head file (.safetensors)")
        return HYBRID + head_config(head).kind, head
    if text.endswith(".safetensors"):
        return head_config(text).kind, text
    return "draft_model", text


_SELF_DRAFT = re.compile(r"(int4|int8)(?:-g(32|64|128))?")


def _self_draft(draft: str) -> tuple[str, int] | None:
    """load_model's (quantization, group size) for a self-draft `draft` ("int4", "int8",
    "int4-g128", ...; int4 defaults to groups of 64: groups of 32 would reproduce a Q4 file's
    own grid), or None for a draft model path."""
    match = _SELF_DRAFT.fullmatch(draft)
    if match is None:
        return None
    return match[1], int(match[2] or (64 if match[1] == "int4" else 32))


# Bits of a learned head's products on a quantized target. EAGLE's in 4-bit blocks read half
# the bytes for the same drafts: on a 2-core Xeon its layer 0.34 -> 0.26 ms and its 8,192-row
# LM head 0.20 -> 0.11 ms a draft position, 1.625 tokens per step at K = 3 against 1.621 in
# int8 (greedy, the 12 prompts of bench/drafters.py); Medusa's heads lose acceptance in 4 bits
# (1.306 against 1.325), so they stay int8.
HEAD_BITS = {"eagle": 4, "medusa": 8}


def _learned_drafter(kind: str, path: str | None, model: LlamaModel, num_blocks: int,
                     block_size: int, prefix_caching: bool) -> Drafter:
    try:
        head = load_head(path or shipped_head(kind), model)
    except ValueError as error:
        if path is not None:
            raise
        raise ValueError(f"draft={kind!r} names the {kind} head shipped for the embedded model, which "
                         f"does not fit this model ({error}); train one with `verispec train-drafter "
                         f"--kind {kind} --model ...` and pass its file as draft") from None
    if model.quantized:  # products in blocks, as the target's own run (quantize_linears_)
        quantize_linears_(head, bits=HEAD_BITS[kind])
        if kind == "eagle":
            head.compile_layer()
    if kind == "eagle":
        return EagleDrafter(head, num_blocks, block_size, prefix_caching,
                            EAGLE_COST_QUANTIZED if model.quantized else EAGLE_COST)
    return MedusaDrafter(head, MEDUSA_COST_QUANTIZED if model.quantized else MEDUSA_COST)


def kv_blocks_for(model: LlamaModel, memory_gib: float, block_size: int) -> int:
    """How many blocks of `block_size` tokens fit in `memory_gib` of KV cache for `model`."""
    cfg = model.config
    element = torch.finfo(model.kv_dtype).bits // 8
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * element
    return max(1, int(memory_gib * 2**30 // (per_token * block_size)))


class LLM:
    """model: None for the embedded default (SmolLM2-135M-Instruct), a .gguf file, or a Hugging
        Face checkpoint directory.
    draft: "ngram" (prompt lookup, the default), "eagle" or "medusa" (the learned heads shipped
        for the embedded model), a head file (.safetensors, from `verispec train-drafter`),
        "ngram+eagle", "ngram+medusa" or "ngram+<head file>" (prompt lookup for a request whose
        context has a match of 2 tokens or more, the head otherwise), "int4" / "int8" (the target itself,
        quantized at load: int4 in groups of 64, or "int4-g32" / "int4-g128"), "none", or a
        draft model (path as for `model`) that shares the target's tokenizer.
    num_speculative_tokens: K, the most draft tokens verified per request per step; 0 turns
        speculation off, whatever `draft` names.
    verification: "token" or "block", how drafts are verified (SpeculativeConfig.verification).
    adaptive: choose each request's K per step from its acceptance, with a tree its whole tree
        or nothing (SpeculativeConfig.adaptive); False drafts num_speculative_tokens (every
        tree node) every step.
    tree: tree speculation with this static shape, branching factors per depth, e.g. (3, 2, 1),
        or a DynamicTree (EAGLE-2, grown by draft confidence) (SpeculativeConfig.tree); None
        drafts chains.
    kv_cache_gib: memory for each model's paged KV cache.
    dtype: "auto" (a .gguf file runs its stored 4- and 8-bit blocks, anything else float32),
        "float32" or "bfloat16" (a .gguf file widened to it).
    quantization: None, or "int4" / "int8": weight-only round-to-nearest at load, one scale per
        group of `quantization_group_size` weights (32, 64, 128); "gguf" as dtype "auto" does.
    enable_prefix_caching: reuse the KV cache of prompt prefixes already computed
        (CacheConfig.enable_prefix_caching); False computes every prompt in full.
    structured: limits and cache of structured-output grammars (StructuredOutputConfig).
    enforce_eager: on CUDA, run decode and verify steps kernel by kernel instead of replaying
        them as CUDA graphs (EngineConfig.enforce_eager, vLLM's name).
    static_step: run decode and verify steps padded over persistent buffers; None: on CUDA only
        (EngineConfig.static_step).
    """

    def __init__(
        self,
        model: str | None = None,
        draft: str | None = "ngram",
        num_speculative_tokens: int = 5,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "cpu",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        kv_cache_gib: float = 1.0,
        block_size: int = 16,
        progress: bool = True,
        verification: str = "token",
        adaptive: bool = True,
        tree: TreeShape | None = None,
        quantization: str | None = None,
        quantization_group_size: int = 32,
        enable_prefix_caching: bool = True,
        structured: StructuredOutputConfig = StructuredOutputConfig(),
        enforce_eager: bool = False,
        static_step: bool | None = None,
    ) -> None:
        torch_dtype, quantization = resolve_weights(model, dtype, quantization, device)
        if not (isinstance(kv_cache_gib, (int, float)) and math.isfinite(kv_cache_gib) and kv_cache_gib > 0):
            raise ValueError(f"kv_cache_gib={kv_cache_gib!r} is invalid: expected a number > 0")
        # K = 0 and no tree: no drafter to load
        no_drafts = draft in (None, "none") or (num_speculative_tokens == 0 and tree is None)
        method, draft_path = _draft_method(None if no_drafts else draft)
        spec = SpeculativeConfig(
            method=method,
            num_speculative_tokens=num_speculative_tokens,
            draft_model=draft_path,
            verification=verification,
            adaptive=adaptive,
            tree=tree,
        )
        # Everything but the model's limits is checked before the (slow) load.
        limits = EngineConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=EngineConfig.max_model_len if max_model_len is None else max_model_len,
            cache=CacheConfig(block_size, enable_prefix_caching=enable_prefix_caching),
            speculative=spec,
            structured=structured,
            static_step=static_step,
            enforce_eager=enforce_eager,
        )
        self.model, self.tokenizer = load_model(model, dtype=torch_dtype, device=device, progress=progress,
                                                quantization=quantization,
                                                group_size=quantization_group_size)
        positions = self.model.config.max_position_embeddings
        if max_model_len is not None and max_model_len > positions:
            raise ValueError(f"max_model_len={max_model_len!r} is invalid: expected at most {positions}, "
                             "the model's max_position_embeddings")
        drafter: Drafter | None = None
        lookup_cost = NGRAM_COST_QUANTIZED if self.model.quantized else NGRAM_COST
        if method == "ngram":
            drafter = NgramDrafter(spec.ngram_min, spec.ngram_max, num_speculative_tokens, lookup_cost)
        elif method == "draft_model":
            self_draft = _self_draft(str(draft))
            if self_draft is not None:  # the target's own weights, quantized at load
                draft_model, _ = load_model(model, progress=progress, quantization=self_draft[0],
                                            group_size=self_draft[1])
            else:
                draft_model, _ = load_model(draft, dtype=torch_dtype, device=device, progress=progress)
            if draft_model.config.vocab_size != self.model.config.vocab_size:
                raise ValueError(
                    f"draft={draft!r} has vocabulary size {draft_model.config.vocab_size}: expected "
                    f"{self.model.config.vocab_size}, the target's (draft and target must share a tokenizer)"
                )
            drafter = DraftModelDrafter(draft_model, kv_blocks_for(draft_model, kv_cache_gib, block_size), block_size,
                                        draft_model_cost(draft_model, self.model, self.model.row_cost
                                                         if spec.row_cost is None else spec.row_cost))
        elif method in LEARNED_METHODS:
            drafter = _learned_drafter(method.removeprefix(HYBRID), draft_path, self.model,
                                       kv_blocks_for(self.model, kv_cache_gib, block_size), block_size,
                                       enable_prefix_caching)
            if method.startswith(HYBRID):
                shortest = min(max(spec.ngram_min, LOOKUP_MIN_N), spec.ngram_max)
                drafter = HybridDrafter(NgramDrafter(shortest, spec.ngram_max, num_speculative_tokens,
                                                     lookup_cost), drafter)
        config = dataclasses.replace(
            limits,
            max_model_len=min(positions, 8192) if max_model_len is None else max_model_len,
            cache=dataclasses.replace(limits.cache, num_blocks=kv_blocks_for(self.model, kv_cache_gib, block_size)),
        )
        self.engine = LLMEngine(self.model, self.tokenizer, config, drafter)
        self._outboxes: dict[str, deque[RequestOutput]] = {}  # per request id, outputs not yet read

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Completes every prompt (text or token ids); outputs in the order of the prompts."""
        return self._generate(prompts, sampling_params, use_tqdm, add_special_tokens=True)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
    ) -> list[RequestOutput]:
        """One conversation ([{"role": ..., "content": ...}, ...]) or a list of them, rendered
        with the model's chat template and a generation prompt. The template writes any BOS
        itself, so the rendered text is encoded without adding special tokens.

        tools, tool_choice, parallel_tool_calls: OpenAI's function tools, as the server takes
        them (verispec.tools): the calls follow a grammar over the tools' parameter schemas, each
        output's `tool_calls` holds those it made (`text` is the raw output, calls included) and
        its finish_reason is "tool_calls" when it made any. Messages may carry an assistant's
        `tool_calls` and `role: "tool"` results with `tool_call_id`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        use = tool_use(tools, tool_choice, parallel_tool_calls)
        prompts = [render_tool_chat(self.tokenizer, list(c), use) for c in conversations]
        if use is None or not use.active:
            return self._generate(prompts, sampling_params, use_tqdm, add_special_tokens=False)
        use.check_limits(self.engine.config.structured)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        outputs = self._generate(prompts, [_with_tools(p, use, tool_choice) for p in sampling_params], use_tqdm,
                                 add_special_tokens=False)
        for out in outputs:
            if out.finish_reason != "error":
                out.tool_calls = split_calls(out.text)[1]
                if out.tool_calls and out.finish_reason == "stop":
                    out.finish_reason = "tool_calls"
        return outputs

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yields after every step that added tokens; `new_text` holds the increment."""
        rid = self._submit(self.engine.prepare_request(prompt, sampling_params))
        try:
            while True:
                out = self._next_output(rid)
                if out.finished:
                    self._close(rid)  # now, not when the caller next touches the generator
                    yield out
                    return
                yield out
        finally:
            self._close(rid)

    def _generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        add_special_tokens: bool,
    ) -> list[RequestOutput]:
        if not isinstance(prompts, (str, list, tuple)):
            raise TypeError(f"prompts is a {type(prompts).__name__}: expected a str, a list of token ids, "
                            "or a list of those")
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise ValueError("prompts is empty: expected at least one prompt")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(f"sampling_params has {len(params)} entries: expected {len(batch)}, one per prompt")
        prepared = [
            self.engine.prepare_request(p, sp, name="prompts" if single else f"prompts[{i}]",
                                        add_special_tokens=add_special_tokens)
            for i, (p, sp) in enumerate(zip(batch, params))
        ]
        ids = [self._submit(p) for p in prepared]
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm or len(ids) == 1)
        try:
            for rid in ids:
                while rid not in done:
                    out = self._next_output(rid)
                    if out.finished:
                        done[rid] = out
                        bar.update(1)
        finally:
            bar.close()
            for rid in ids:
                self._close(rid)
        return [done[rid] for rid in ids]

    def _submit(self, prepared: PreparedRequest) -> str:
        rid = self.engine.enqueue(prepared)
        self._outboxes[rid] = deque()
        return rid

    def _next_output(self, rid: str) -> RequestOutput:
        """The request's next output, stepping the engine (for everyone) while none is waiting."""
        box = self._outboxes[rid]
        while not box:
            if not self.engine.has_unfinished():
                raise RuntimeError(f"request {rid!r} ended without a final output")
            for out in self.engine.step():
                if out.request_id in self._outboxes:
                    self._outboxes[out.request_id].append(out)
        return box.popleft()

    def _close(self, rid: str) -> None:
        """Stops reading a request: cancels it if unfinished and drops its outbox."""
        self._outboxes.pop(rid, None)
        self.engine.abort(rid)


def _with_tools(params: SamplingParams, use: ToolUse, tool_choice: object) -> SamplingParams:
    """`params` constrained by the tools' grammar; ValueError when it has a grammar of its own."""
    given = [name for name in STRUCTURED_FIELDS if getattr(params, name) not in (None, False)]
    if given:
        raise ValueError(f"tool_choice={tool_choice or 'auto'!r} and {given[0]} are both set: the calls follow "
                         "their own grammar (use tool_choice=\"none\" for structured text)")
    return dataclasses.replace(params, grammar=tool_grammar(use))
