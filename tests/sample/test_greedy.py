"""The host greedy rule (verispec.sample.greedy) against rejection_sample, the oracle."""

from __future__ import annotations

import pytest
import torch

from verispec import SamplingMetadata, SamplingParams
from verispec.sample import rejection_sample
from verispec.sample.greedy import greedy_chains, plain_greedy


def _oracle(logits: torch.Tensor, drafts: list[list[int]]) -> list[list[int]]:
    cu = torch.tensor([0] + [len(d) for d in drafts]).cumsum(0)
    ids = torch.tensor([t for d in drafts for t in d], dtype=torch.long)
    sampling = SamplingMetadata.from_params([SamplingParams(temperature=0)] * len(drafts))
    out = rejection_sample(logits, ids, cu, sampling, backend="native")
    return [row[:n] for row, n in zip(out.token_ids.tolist(), out.num_emitted.tolist())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # numpy's argmax; torch's
@pytest.mark.parametrize("seed", range(20))
def test_greedy_chains_equal_rejection_sample(seed: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(seed)
    vocab = 6  # few values over a small vocabulary: many rows hold tied maxima
    counts = torch.randint(0, 5, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
    logits = torch.randint(0, 3, (sum(counts) + len(counts), vocab), generator=gen).to(dtype)
    best = logits.max(dim=-1).indices.tolist()
    drafts, row = [], 0
    for k in counts:
        # Mostly the argmax, so chains run long; sometimes another token, often a tied one.
        drafts.append([best[row + j] if torch.rand(1, generator=gen) < 0.7
                       else int(torch.randint(0, vocab, (1,), generator=gen)) for j in range(k)])
        row += k + 1
    assert greedy_chains(logits, drafts) == _oracle(logits, drafts)


def test_greedy_chains_stop_at_the_first_rejection() -> None:
    logits = torch.zeros(4, 8)
    logits[torch.arange(4), torch.tensor([3, 5, 1, 2])] = 1.0
    assert greedy_chains(logits, [[3, 4, 1]]) == [[3, 5]]  # 1 matches row 2, but 4 was rejected
    assert greedy_chains(logits, [[3, 5, 1]]) == [[3, 5, 1, 2]]
    assert greedy_chains(logits, [[], [], [], []]) == [[3], [5], [1], [2]]


def test_plain_greedy_names_the_requests_whose_logits_stay_raw() -> None:
    assert plain_greedy(SamplingParams(temperature=0, top_k=5, top_p=0.5))
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=0, guidance_scale=2.0),
                   SamplingParams(temperature=0, repetition_penalty=1.2),
                   SamplingParams(temperature=0, logit_bias={3: 1.0}),
                   SamplingParams(temperature=0, banned_token_ids=[3])):
        assert not plain_greedy(params), params
