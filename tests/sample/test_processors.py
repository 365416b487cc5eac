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
