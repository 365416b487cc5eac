"""The batched pipeline against the per-row reference, and the filters' tie rules."""

from __future__ import annotations

import pytest
import torch

from verispec import SamplingMetadata, SamplingParams
from verispec.sample.processors import process_logits
from verispec.sample.reference import reference_probs

PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.3),
    SamplingParams(temperature=1.7, top_k=7),
    SamplingParams(top_p=0.5),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
    SamplingParams(min_p=0.3),
    SamplingParams(guidance_scale=3.0, top_p=0.95),
    SamplingParams(guidance_scale=0.5, temperature=1.2),
    SamplingParams(top_k=1),
]


def test_batch_of_mixed_params_matches_reference_rows() -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 64
    logits = torch.randn(len(PARAMS) * 3, vocab, generator=g) * 3
    uncond = torch.randn(len(PARAMS) * 3, vocab, generator=g) * 3
    rows = torch.arange(len(PARAMS)).repeat_interleave(3)
    sampling = SamplingMetadata.from_params(PARAMS)
    probs = process_logits(logits, rows, sampling, uncond).softmax(-1)
    for i, r in enumerate(rows.tolist()):
        expected = reference_probs(logits[i], PARAMS[r], uncond[i])
        torch.testing.assert_close(probs[i].double(), expected, atol=1e-6, rtol=1e-5)


def test_greedy_rows_keep_their_argmax_and_skip_temperature() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    sampling = SamplingMetadata.from_params([SamplingParams(temperature=0, top_k=1)])
    assert not sampling.any_top_k
    out = process_logits(logits, torch.tensor([0]), sampling)
    assert torch.equal(out, logits)


def test_top_k_keeps_ties_at_the_boundary() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    out = process_logits(logits, torch.tensor([0]), SamplingMetadata.from_params([SamplingParams(top_k=2)]))
    assert torch.isfinite(out).tolist() == [[True, False, True, True, False]]


@pytest.mark.parametrize("top_p,kept", [(0.5, 1), (0.6, 2), (0.85, 3), (1.0, 4)])
def test_top_p_keeps_the_smallest_nucleus(top_p: float, kept: int) -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    sampling = SamplingMetadata.from_params([SamplingParams(top_p=top_p)])
    out = process_logits(probs.log(), torch.tensor([0]), sampling)
    assert int(torch.isfinite(out).sum()) == kept


def test_min_p_is_relative_to_the_top_token() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    sampling = SamplingMetadata.from_params([SamplingParams(min_p=0.5)])
    out = process_logits(probs.log(), torch.tensor([0]), sampling)
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]


def test_cfg_scale_one_is_the_conditional_row_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(1)
    cond, uncond = torch.randn(2, 10, generator=g), torch.randn(2, 10, generator=g)
    sampling = SamplingMetadata.from_params([SamplingParams(guidance_scale=2.0), SamplingParams()])
    out = process_logits(cond, torch.tensor([0, 1]), sampling, uncond)
    assert torch.equal(out[1], cond[1])
    torch.testing.assert_close(out[0], uncond[0] + 2.0 * (cond[0] - uncond[0]))


def test_cpu_head_search_matches_reference_on_a_large_vocabulary() -> None:
    """Rows whose kept tokens fit the CPU head, and rows that make it widen (flat nuclei, ties
    reaching past the head, top-k above it), against the per-row float64 reference."""
    g = torch.Generator().manual_seed(3)
    vocab = 5000
    ties_k = torch.full((vocab,), -2.0)
    ties_k[:10], ties_k[10:310] = 5.0, 1.0  # the 50th largest value is tied over 300 tokens
    ties_p = torch.full((vocab,), -3.0)
    ties_p[:400] = 2.0  # the top mass is 400 equal tokens
    rows = [
        (torch.randn(vocab, generator=g) * 8, SamplingParams(top_p=0.9)),
        (torch.randn(vocab, generator=g) * 0.3, SamplingParams(top_p=0.95)),
        (torch.randn(vocab, generator=g) * 2, SamplingParams(temperature=0.7, top_p=0.7)),
        (ties_k, SamplingParams(top_k=50)),
        (ties_p, SamplingParams(top_p=0.5)),
        (torch.randn(vocab, generator=g) * 2, SamplingParams(top_k=300, top_p=0.99)),
        (torch.randn(vocab, generator=g), SamplingParams(temperature=0.9)),
        (torch.randn(vocab, generator=g) * 4, SamplingParams(top_k=20, top_p=0.8)),
    ]
    logits = torch.stack([row for row, _ in rows])
    params = [p for _, p in rows]
    out = process_logits(logits, torch.arange(len(rows)), SamplingMetadata.from_params(params))
    kept = torch.isfinite(out).sum(-1).tolist()
    assert kept[3] == 310 and kept[4] == 400 and kept[1] > 2048  # widened past the head
    for i, (row, p) in enumerate(rows):
        expected = reference_probs(row, p)
        assert torch.equal(torch.isfinite(out[i]), expected > 0)
        torch.testing.assert_close(out[i].softmax(-1).double(), expected, atol=1e-6, rtol=1e-5)


def test_cpu_head_search_normalises_top_k_mass_that_reaches_past_the_head() -> None:
    """The 50th largest value is tied over 300 tokens, so the top-k mass reaches past the
    256-wide head: the top 10 tokens hold 0.645 of it but 0.689 of the head's, and a head-only
    normaliser would end the 0.65 nucleus at them instead of keeping all 310."""
    row = torch.full((5000,), -2.0)
    row[:10], row[10:310] = 5.0, 1.0
    params = SamplingParams(top_k=50, top_p=0.65)
    out = process_logits(row[None], torch.tensor([0]), SamplingMetadata.from_params([params]))
    assert torch.equal(torch.isfinite(out[0]), reference_probs(row, params) > 0)
    assert int(torch.isfinite(out).sum()) == 310
