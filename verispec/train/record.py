"""Self-distillation data: the target answers prompts, and its hidden states are recorded from
the very forward passes that generate the answers (a Drafter that only observes: FedTokens).

Terms: a *sequence* is one request's prompt + output tokens with the target's hidden states of
each, the outputs of the recorded *layers* (1-based; the last is before the final norm),
concatenated per token; the newest output token has none (it was never fed), so a sequence of
L tokens has L - 1 features. A *dataset* concatenates sequences.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..config import EngineConfig, SpeculativeConfig
from ..engine.engine import LLMEngine
from ..files import atomic_path, intact
from ..model import LlamaModel, Tokenizer
from ..sampling_params import SamplingParams
from ..spec_decode.base import DraftBatch, Drafter, DraftRequest, FedTokens
from ..spec_decode.features import FeatureStore


@dataclass
class Dataset:
    """Sequences, concatenated.

    tokens: [S] int64 all sequences' tokens; features: [S, len(layers) * d] their hidden states,
    layer by layer in the order of `layers` (a sequence's last token's row is zero: it has
    none); offsets: [n + 1] int64 sequence starts in S; prompt_lens: [n] int64 tokens of each
    sequence that are prompt.
    """

    tokens: torch.Tensor  # [S] int64
    features: torch.Tensor  # [S, len(layers) * d]
    offsets: torch.Tensor  # [n + 1] int64
    prompt_lens: torch.Tensor  # [n] int64
    layers: tuple[int, ...]

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @property
    def num_output_tokens(self) -> int:
        return int((self.offsets[1:] - self.offsets[:-1] - self.prompt_lens).sum())

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:  # [L], [L, F], prompt length
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.features[a:b], int(self.prompt_lens[i])

    def select(self, layers: Sequence[int]) -> Dataset:
        """The same sequences with the features of `layers` only, in that order."""
        missing = [n for n in layers if n not in self.layers]
        if missing:
            raise ValueError(f"layers {missing} were not recorded: this dataset holds layers {list(self.layers)}")
        if tuple(layers) == self.layers:
            return self
        d = self.features.shape[1] // len(self.layers)
        columns = torch.cat([torch.arange(d) + self.layers.index(n) * d for n in layers])
        return Dataset(self.tokens, self.features[:, columns], self.offsets, self.prompt_lens, tuple(layers))

    @classmethod
    def concat(cls, parts: Sequence[Dataset]) -> Dataset:
        layers = {p.layers for p in parts}
        if len(layers) != 1:
            raise ValueError(f"datasets of different recorded layers cannot be joined: {sorted(layers)}")
        sizes = torch.tensor([0] + [p.tokens.numel() for p in parts]).cumsum(0)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64)]
                            + [p.offsets[1:] + base for p, base in zip(parts, sizes.tolist())])
        return cls(torch.cat([p.tokens for p in parts]), torch.cat([p.features for p in parts]), offsets,
                   torch.cat([p.prompt_lens for p in parts]), layers.pop())

    def save(self, path: str | os.PathLike[str]) -> None:
        """Written to a temporary name and renamed: a run killed while saving leaves no shard; its
        checksum beside it (verispec.files.seal), which `load` checks."""
        from safetensors.torch import save_file

        with atomic_path(path, sealed=True) as partial:
            save_file({"tokens": self.tokens, "features": self.features.to(torch.bfloat16).contiguous(),
                       "offsets": self.offsets, "prompt_lens": self.prompt_lens}, str(partial),
                      metadata={"layers": json.dumps(list(self.layers))})

    @classmethod
    def load(cls, path: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> Dataset:
        """`dtype`: the features' (stored as bf16; keeping them so halves a large dataset's memory).
        ValueError naming the file when it is not a whole, consistent recording, or not the bytes
        `save` wrote."""
        from safetensors import SafetensorError, safe_open

        source = f"recording {str(path)!r}"
        if not intact(path):
            raise ValueError(f"{source} is damaged: its bytes do not match the checksum written with it")
        try:
            with safe_open(str(path), framework="pt") as f:
                layers = tuple(json.loads((f.metadata() or {})["layers"]))
                t = {name: f.get_tensor(name) for name in f.keys()}
            dataset = cls(t["tokens"], t["features"].to(dtype), t["offsets"], t["prompt_lens"], layers)
        # A cut or foreign file: SafetensorError (Exception alone), a missing key, bad JSON.
        except (SafetensorError, OSError, KeyError, TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"{source} cannot be read: {type(error).__name__}: {error}") from None
        problem = dataset._inconsistency()
        if problem is not None:
            raise ValueError(f"{source} is inconsistent: {problem}")
        return dataset

    def _inconsistency(self) -> str | None:
        """What does not add up between the tensors, or None."""
        n = len(self.prompt_lens)
        if self.offsets.shape != (n + 1,) or self.tokens.dim() != 1 or self.features.dim() != 2:
            return f"shapes offsets {tuple(self.offsets.shape)}, prompt_lens {tuple(self.prompt_lens.shape)}"
        if int(self.offsets[0]) != 0 or int(self.offsets[-1]) != len(self.tokens) \
                or len(self.features) != len(self.tokens) or bool((self.offsets[1:] < self.offsets[:-1]).any()):
            return f"offsets end at {int(self.offsets[-1])} for {len(self.tokens)} tokens, {len(self.features)} features"
        return None


class _Recorder(Drafter):
    """Drafts nothing; keeps every request's fed tokens and hidden states until it finishes."""

    def __init__(self, layers: tuple[int, ...]) -> None:
        self.hidden_layers = layers
        self.store = FeatureStore()
        self.finished: dict[str, tuple[list[int], torch.Tensor]] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> DraftBatch:
        return DraftBatch([[] for _ in requests])

    def observe(self, fed: Sequence[FedTokens], hidden: torch.Tensor) -> None:  # [T, d]
        self.store.observe(fed, hidden)

    def release(self, request_id: str) -> None:
        """Keeps the request's record (a preempted request's is replaced when it finishes)."""
        try:
            start, fed = self.store.tokens(request_id)
        except KeyError:
            return
        if start == 0 and fed:
            self.finished[request_id] = (fed, self.store.features(request_id, 0, len(fed)))
        self.store.release(request_id)


def record(
    model: LlamaModel,
    tokenizer: Tokenizer,
    prompts: Sequence[str | list[int]],
    params: Sequence[SamplingParams],
    config: EngineConfig,
    chat: bool = True,
    progress: bool = True,
    layers: Sequence[int] | None = None,
) -> Dataset:
    """Generates an answer to every prompt (text rendered with the chat template when `chat`,
    or token ids as given) with `params[i]`, recording the hidden states of `layers` (the last
    layer by default) on the way."""
    recorder = _Recorder(tuple(layers) if layers is not None else (model.config.num_layers,))
    engine = LLMEngine(model, tokenizer, dataclasses.replace(config, speculative=SpeculativeConfig()), recorder)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        text = isinstance(prompt, str)
        if text and chat:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                   add_generation_prompt=True)
        # A rendered template writes its own BOS.
        engine.enqueue(engine.prepare_request(prompt, p, str(i), add_special_tokens=not (text and chat)))
    outputs = {}
    bar = tqdm(total=len(prompts), desc="recording", unit="prompt", disable=not progress)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
                bar.update(1)
    bar.close()
    tokens, features, lengths, prompt_lens = [], [], [], []
    for rid in sorted(outputs, key=int):
        if rid not in recorder.finished or outputs[rid].finish_reason == "error":
            continue
        fed, hidden = recorder.finished[rid]
        full = outputs[rid].prompt_token_ids + outputs[rid].token_ids
        if fed != full[: len(fed)]:
            raise RuntimeError(f"request {rid}: the recorded tokens are not its prompt + output")
        # The newest token was never fed: it ends the sequence with a zero feature row.
        tokens.append(torch.tensor(full[: len(fed) + 1]))
        features.append(torch.cat((hidden.float(), hidden.new_zeros(1, hidden.shape[1]).float())))
        lengths.append(len(fed) + 1)
        prompt_lens.append(len(outputs[rid].prompt_token_ids))
    offsets = torch.tensor([0] + lengths).cumsum(0)
    return Dataset(torch.cat(tokens), torch.cat(features), offsets, torch.tensor(prompt_lens),
                   recorder.hidden_layers)
