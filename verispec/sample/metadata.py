"""SamplingMetadata: the per-request sampling parameters of one batch, as tensors.

Built once per step on the host from plain Python values (no device reads), then moved to the
device in one copy per field, or, with MetadataBuffers (an engine whose steps are padded,
runtime/static_step.py), written into buffers allocated once and moved in two copies. The fast-path flags let the sampler skip whole stages (no sort when
no request uses top-k / top-p, no CFG combine when no request is guided, no random numbers when
all are greedy, no penalty / bias / mask stage when `adjustments` is None) without inspecting
tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from ..sampling_params import SamplingParams
from .penalties import LogitAdjustments
from .rng import fresh_seed, request_keys

if TYPE_CHECKING:
    from ..structured.matcher import GrammarMatcher


class MetadataBuffers:
    """Host staging and device tensors that one caller's SamplingMetadata are written into step
    after step: the float fields as one [4, capacity] tensor and the integer ones as another,
    each moved in one copy (from pinned memory on CUDA). A metadata's tensors are views of them,
    valid until the next write; the buffers grow when a batch outgrows them."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.capacity = 0
        self._copied: torch.cuda.Event | None = None

    def write(
        self,
        floats: Sequence[Sequence[float]],  # 4 rows of n values
        ints: Sequence[Sequence[int]],  # 4 rows of n values
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [4, n] float32, [4, n] int64 on the device
        n = len(floats[0])
        if self._copied is not None:  # the staging must not change under a copy in flight
            self._copied.synchronize()
        if n > self.capacity:
            self.capacity = max(n, 2 * self.capacity, 16)
            pinned = self.device.type == "cuda"
            self._host_floats = torch.zeros(4, self.capacity, dtype=torch.float32, pin_memory=pinned)
            self._host_ints = torch.zeros(4, self.capacity, dtype=torch.int64, pin_memory=pinned)
            self._floats = torch.zeros(4, self.capacity, dtype=torch.float32, device=self.device)
            self._ints = torch.zeros(4, self.capacity, dtype=torch.int64, device=self.device)
        self._host_floats.numpy()[:, :n] = np.asarray(floats, dtype=np.float32)
        self._host_ints.numpy()[:, :n] = np.asarray(ints, dtype=np.int64)
        self._floats.copy_(self._host_floats, non_blocking=True)
        self._ints.copy_(self._host_ints, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self._floats[:, :n], self._ints[:, :n]


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-request tensors for a batch of B requests (request b is row b of every field).

    temperature: [B] float32, 0 for greedy requests.
    top_k: [B] int64, 0 where disabled.
    top_p: [B] float32, 1 where disabled.
    min_p: [B] float32, 0 where disabled.
    guidance_scale: [B] float32, 1 where CFG is off.
    keys: [B] int64, the counter-based random key of each request at this step.
    is_greedy: [B] bool.
    adjustments: penalties, logit bias and token masks (penalties.py); None when no request
        uses any, which skips those stages.
    grammars: a drafter's call only (spec_decode/draft_sampling.py): per request its
        structured-output grammar or None; None when no request has one.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    guidance_scale: torch.Tensor
    keys: torch.Tensor
    is_greedy: torch.Tensor
    all_greedy: bool
    all_random: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_cfg: bool
    adjustments: LogitAdjustments | None = None
    grammars: tuple[GrammarMatcher | None, ...] | None = None

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        steps: Sequence[int] | None = None,
        seeds: Sequence[int | None] | None = None,
        device: torch.device | str = "cpu",
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        buffers: MetadataBuffers | None = None,
    ) -> "SamplingMetadata":
        """params: one SamplingParams per request.

        steps: each request's decode-step counter (default 0); together with the seed it keys
            the request's random numbers, so it must advance between verify steps.
        seeds: overrides params[b].seed (the engine passes each request's resolved seed);
            a request with no seed from either gets a fresh one.
        buffers: write the tensors into these (on their device, which `device` must name)
            instead of allocating them.
        prompt_token_ids, output_token_ids: each request's prompt and output so far, read only
            for requests with penalties (None: empty). The verifier adds each row's preceding
            draft tokens itself.
        """
        n = len(params)
        if n == 0:
            raise ValueError("params is empty: expected at least one SamplingParams")
        steps = [0] * n if steps is None else list(steps)
        seeds = [None] * n if seeds is None else list(seeds)
        for name, values in (("steps", steps), ("seeds", seeds)):
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries: expected {n}, one per request")
        if min(steps) < 0:
            raise ValueError(f"steps={steps!r} is invalid: expected integers >= 0")
        # One row of plain values per request. Filters cannot change an argmax, so greedy
        # requests carry them as disabled and the flags skip the sort for them.
        rows = []
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params[{i}] is {type(p).__name__}: expected SamplingParams")
            seed = seeds[i] if seeds[i] is not None else p.seed
            greedy = p.greedy
            rows.append((
                float(p.temperature),
                0 if greedy or p.top_k is None else p.top_k,
                1.0 if greedy else float(p.top_p),
                0.0 if greedy else float(p.min_p),
                float(p.guidance_scale),
                fresh_seed() if seed is None else seed,
                greedy,
            ))
        temperature, top_k, top_p, min_p, scale, seed_col, greedy_col = zip(*rows)
        if buffers is not None:
            floats, ints = buffers.write((temperature, top_p, min_p, scale), (top_k, seed_col, steps, greedy_col))
            fields = dict(temperature=floats[0], top_p=floats[1], min_p=floats[2], guidance_scale=floats[3],
                          top_k=ints[0], keys=request_keys(ints[1], ints[2]), is_greedy=ints[3] != 0)
        else:
            def tensor(values: tuple, dtype: torch.dtype) -> torch.Tensor:
                return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

            fields = dict(temperature=tensor(temperature, torch.float32), top_k=tensor(top_k, torch.int64),
                          top_p=tensor(top_p, torch.float32), min_p=tensor(min_p, torch.float32),
                          guidance_scale=tensor(scale, torch.float32),
                          keys=request_keys(tensor(seed_col, torch.int64), tensor(tuple(steps), torch.int64)),
                          is_greedy=tensor(greedy_col, torch.bool))
        return cls(
            **fields,
            all_greedy=all(greedy_col),
            all_random=not any(greedy_col),
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(x < 1 for x in top_p),
            any_min_p=any(x > 0 for x in min_p),
            any_cfg=any(x != 1 for x in scale),
            adjustments=LogitAdjustments.from_params(params, prompt_token_ids, output_token_ids, device),
        )
