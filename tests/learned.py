"""Tiny learned draft heads for tests: recorded from a tiny random target and trained a few
steps (cached per process: several test files share them)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from verispec import SamplingParams
from verispec.config import CacheConfig, EngineConfig
from verispec.model import LlamaModel
from verispec.spec_decode.heads import Head, HeadConfig, new_head
from verispec.train.command import recorded_layers
from verispec.train.record import Dataset, record
from verispec.train.trainer import TrainConfig, train

from .tiny import tiny_model, word_tokenizer

VOCAB = 32


@functools.lru_cache(maxsize=None)
def target() -> LlamaModel:
    """Flat enough output distributions that a few hundred steps visibly raise acceptance."""
    return tiny_model(seed=3, vocab=VOCAB, scale=0.5)


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@functools.lru_cache(maxsize=None)
def dataset() -> Dataset:
    params = [SamplingParams(temperature=0 if i % 2 else 0.7, seed=i, max_tokens=32, ignore_eos=True)
              for i in range(48)]
    return record(target(), word_tokenizer(VOCAB), prompts(48, seed=0), params,
                  EngineConfig(cache=CacheConfig(4, 1024)), chat=False, progress=False,
                  layers=recorded_layers(target().config.num_layers))


def head_config(kind: str, model: LlamaModel) -> HeadConfig:
    """kind: "eagle", "medusa" (3 heads) or "eagle-fused" (an EAGLE head reading the fused layers,
    1 and 2 of a 2-layer target)."""
    return HeadConfig.for_target(kind.removesuffix("-fused"), model.config, num_medusa_heads=3,
                                 fused=kind.endswith("-fused"))


def untrained(kind: str, vocab: torch.Tensor | None = None) -> Head:
    """kind as `head_config` takes it."""
    vocab = torch.arange(VOCAB) if vocab is None else vocab
    return new_head(head_config(kind, target()), target(), vocab, seed=0)


TRAINING = TrainConfig(epochs=40, batch_tokens=512, lr=3e-2, warmup_steps=3)


@functools.lru_cache(maxsize=None)
def training(kind: str) -> tuple[Head, list[float]]:
    """A head trained on `dataset()` and its per-step losses. Heads hold no per-request state
    (their drafters do), so tests share them."""
    head = untrained(kind)
    return head, train(head, dataset(), TRAINING, progress=False)


def trained(kind: str) -> Head:
    return training(kind)[0]


SAMPLED_VOCAB = 8
SAMPLED_PROMPT = [1, 2, 3]


def sampled_world(kind: str, cfg: bool, max_tokens: int, prompt: list[int] = SAMPLED_PROMPT,
                  ) -> tuple[LlamaModel, Head, SamplingParams, Callable[[list[int]], torch.Tensor]]:
    """The setting of the sampled (chi-square) tests of learned drafters: a target of
    SAMPLED_VOCAB tokens, an untrained head of `kind` (as `head_config` takes it) whose draft vocabulary
    leaves tokens 6 and 7 out (q = 0 there), temperature 0.7 / top-p 0.9 (and CFG at 1.5 with
    the negative prompt [5, 6]); and dist(tokens) [V]: the target's own distribution of the
    token after `prompt` + tokens."""
    from .engine.test_cfg import _guided
    from .engine.test_engine import _dist

    model = tiny_model(seed=3, vocab=SAMPLED_VOCAB, scale=0.3)
    head = new_head(head_config(kind, model), model, torch.arange(6), seed=5)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=max_tokens, ignore_eos=True,
                            **({"guidance_scale": 1.5, "negative_prompt": [5, 6]} if cfg else {}))

    def dist(tokens: list[int]) -> torch.Tensor:  # [V]
        if cfg:
            return _guided(model, prompt + tokens, [5, 6, *tokens], params)
        return _dist(model, prompt + tokens, params)

    return model, head, params, dist
