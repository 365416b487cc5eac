"""LLM: the offline API. Load once, then generate, chat or stream.

    llm = LLM()                                   # embedded SmolLM2-135M-Instruct, n-gram drafts
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0))
    print(out[0].text, out[0].stats.mean_acceptance_length)
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator, Sequence

import torch
from tqdm.auto import tqdm

from ..config import CacheConfig, EngineConfig, SpeculativeConfig
from ..model import LlamaModel, load_model
from ..sampling_params import SamplingParams
from ..spec.base import Drafter
from ..spec.draft_model import DraftModelDrafter
from ..spec.ngram import NgramDrafter
from .engine import LLMEngine, RequestOutput

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}

Prompt = str | list[int]
Message = dict[str, str]


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype={dtype!r} is invalid: expected one of {sorted(_DTYPES)}")


def kv_blocks_for(model: LlamaModel, memory_gib: float, block_size: int) -> int:
    """How many blocks of `block_size` tokens fit in `memory_gib` of KV cache for `model`."""
    cfg = model.config
    element = torch.finfo(next(model.parameters()).dtype).bits // 8
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * element
    return max(1, int(memory_gib * 2**30 // (per_token * block_size)))


class LLM:
    """model: None for the embedded default (SmolLM2-135M-Instruct), a .gguf file, or a Hugging
        Face checkpoint directory.
    draft: "ngram" (prompt lookup, the default), "none", or a draft model (path as for `model`)
        that shares the target's tokenizer.
    num_speculative_tokens: K, the most draft tokens verified per request per step.
    kv_cache_gib: memory for each model's paged KV cache.
    """

    def __init__(
        self,
        model: str | None = None,
        draft: str | None = "ngram",
        num_speculative_tokens: int = 5,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        kv_cache_gib: float = 1.0,
        block_size: int = 16,
        progress: bool = True,
    ) -> None:
        torch_dtype = resolve_dtype(dtype)
        if not (isinstance(kv_cache_gib, (int, float)) and math.isfinite(kv_cache_gib) and kv_cache_gib > 0):
            raise ValueError(f"kv_cache_gib={kv_cache_gib!r} is invalid: expected a number > 0")
        self.model, self.tokenizer = load_model(model, dtype=torch_dtype, device=device, progress=progress)
        method = "none" if draft in (None, "none") else "ngram" if draft == "ngram" else "draft_model"
        spec = SpeculativeConfig(
            method=method,
            num_speculative_tokens=num_speculative_tokens,
            draft_model=draft if method == "draft_model" else None,
        )
        drafter: Drafter | None = None
        if method == "ngram":
            drafter = NgramDrafter(spec.ngram_min, spec.ngram_max, num_speculative_tokens)
        elif method == "draft_model":
            draft_model, _ = load_model(draft, dtype=torch_dtype, device=device, progress=progress)
            if draft_model.config.vocab_size != self.model.config.vocab_size:
                raise ValueError(
                    f"draft={draft!r} has vocabulary size {draft_model.config.vocab_size}: expected "
                    f"{self.model.config.vocab_size}, the target's (draft and target must share a tokenizer)"
                )
            drafter = DraftModelDrafter(draft_model, kv_blocks_for(draft_model, kv_cache_gib, block_size), block_size)
        max_len = max_model_len or min(self.model.config.max_position_embeddings, 8192)
        config = EngineConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_len,
            cache=CacheConfig(block_size, kv_blocks_for(self.model, kv_cache_gib, block_size)),
            speculative=spec,
        )
        self.engine = LLMEngine(self.model, self.tokenizer, config, drafter)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Completes every prompt (text or token ids); outputs in the order of the prompts."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts is empty: expected at least one prompt")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries: expected {len(prompts)}, one per prompt")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm or len(ids) == 1)
        try:
            for out in self._run():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        finally:
            bar.close()
            for rid in ids:
                if rid not in done:
                    self.engine.abort(rid)
        return [done[rid] for rid in ids]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One conversation ([{"role": ..., "content": ...}, ...]) or a list of them, rendered
        with the model's chat template and a generation prompt."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yields after every step that added tokens; `new_text` holds the increment."""
        rid = self.engine.add_request(prompt, sampling_params)
        try:
            for out in self._run():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return
        finally:
            self.engine.abort(rid)

    def _run(self) -> Iterable[RequestOutput]:
        while self.engine.has_unfinished():
            yield from self.engine.step()
