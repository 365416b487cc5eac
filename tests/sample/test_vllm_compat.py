"""The vLLM-style adapter: its contract, counters, strict mode, and the distributional suite."""

from __future__ import annotations

import pytest
import torch

from verispec import SamplingParams
from verispec.sample.vllm_compat import RejectionSampler

from ..stats import chi_square
from .harness import V, World


def _adapter_sampler(target, ids, cu, sampling, draft, uncond) -> torch.Tensor:
    """Drives the adapter from the harness: softmaxed rows in, a pre-sampled bonus token."""
    n = sampling.batch_size
    k = ids.numel() // n
    probs = target.softmax(-1).reshape(n, k + 1, V)
    g = torch.Generator().manual_seed(int(ids.sum()) + n)
    bonus = torch.multinomial(probs[:, k], 1, generator=g)
    draft_probs = draft.probs.reshape(n, k, V) if k else torch.zeros(n, 0, V)
    return RejectionSampler(strict_mode=True)(probs, bonus, draft_probs, ids.reshape(n, k))


@pytest.mark.parametrize("kind", ["uniform", "overconfident", "disjoint"])
def test_adapter_emits_the_target_distribution(kind: str) -> None:
    world = World(SamplingParams(), kind, seed=21)
    for name, result in world.tests(100_000, sampler=_adapter_sampler).items():
        assert result.passed, f"{name}: {result}"


def test_bonus_token_used_when_all_accepted_and_counters() -> None:
    probs = torch.zeros(2, 3, 5)
    probs[:, :, 2] = 1.0  # the target puts all mass on token 2: drafts of 2 always accepted
    draft = torch.full((2, 2, 5), 0.2)
    sampler = RejectionSampler(strict_mode=True)
    out = sampler(probs, torch.tensor([[4], [1]]), draft, torch.tensor([[2, 2], [2, 3]]))
    assert out.tolist() == [[2, 2, 4], [2, 2, -1]]
    assert sampler.num_draft_tokens == 4
    assert int(sampler.num_accepted_tokens) == 3 and int(sampler.num_emitted_tokens) == 5


def test_seeded_rows_are_reproducible() -> None:
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(4, 4, 30, generator=g), -1)
    draft = torch.softmax(torch.randn(4, 3, 30, generator=g), -1)
    ids = torch.randint(0, 30, (4, 3), generator=g)
    bonus = torch.zeros(4, 1, dtype=torch.long)

    def run() -> torch.Tensor:
        seeded = {1: torch.Generator().manual_seed(9), 3: torch.Generator().manual_seed(10)}
        return RejectionSampler()(probs, bonus, draft, ids, seeded_seqs=seeded)

    a, b = run(), run()
    assert torch.equal(a[[1, 3]], b[[1, 3]])


def test_strict_mode_rejects_bad_input() -> None:
    sampler = RejectionSampler(strict_mode=True)
    probs = torch.full((1, 3, 4), 0.25)
    draft = torch.full((1, 2, 4), 0.25)
    with pytest.raises(ValueError, match="draft_token_ids contains token id 4"):
        sampler(probs, torch.tensor([[0]]), draft, torch.tensor([[1, 4]]))
    with pytest.raises(ValueError, match="draft_probs has shape"):
        sampler(probs, torch.tensor([[0]]), draft[:, :1], torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="target_with_bonus_probs row 0 sums to 2"):
        sampler(probs * 2, torch.tensor([[0]]), draft, torch.tensor([[1, 2]]))


def test_accepted_counter_counts_every_passing_draft_as_vllm_does() -> None:
    """vLLM V0 counts drafts that pass their own test even after an earlier rejection."""
    probs = torch.zeros(1, 3, 5)
    probs[:, :, 2] = 1.0
    draft = torch.full((1, 2, 5), 0.2)
    sampler = RejectionSampler()
    out = sampler(probs, torch.tensor([[4]]), draft, torch.tensor([[3, 2]]))
    assert out.tolist() == [[2, -1, -1]]  # 3 rejected (p = 0), the recovered token is 2
    assert int(sampler.num_accepted_tokens) == 1 and int(sampler.num_emitted_tokens) == 1


def test_torch_manual_seed_reproduces_unseeded_rows() -> None:
    g = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(64, 4, 30, generator=g), -1)
    draft = torch.softmax(torch.randn(64, 3, 30, generator=g), -1)
    ids = torch.randint(0, 30, (64, 3), generator=g)
    bonus = torch.zeros(64, 1, dtype=torch.long)

    def run(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return RejectionSampler()(probs, bonus, draft, ids)

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))


@pytest.mark.parametrize("strict", [False, True])
def test_empty_batch(strict: bool) -> None:
    sampler = RejectionSampler(strict_mode=strict)
    out = sampler(torch.zeros(0, 3, 4), torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 2, 4),
                  torch.zeros(0, 2, dtype=torch.long))
    assert out.shape == (0, 3) and sampler.num_draft_tokens == 0


@pytest.mark.parametrize("strict", [False, True])
def test_seeded_row_outside_the_batch_is_a_clear_error(strict: bool) -> None:
    probs = torch.full((2, 2, 4), 0.25)
    with pytest.raises(ValueError, match=r"seeded_seqs has row 2: expected row indices in \[0, 2\)"):
        RejectionSampler(strict_mode=strict)(probs, torch.zeros(2, 1, dtype=torch.long), probs[:, :1],
                                             torch.zeros(2, 1, dtype=torch.long),
                                             seeded_seqs={2: torch.Generator().manual_seed(0)})


def test_strict_mode_takes_placeholder_drafts_and_they_follow_p() -> None:
    """vLLM pads draft slots with -1; such a slot drafted nothing, so its token follows p even
    though the (meaningless) draft row there is far from p."""
    n = 100_000
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    target = p.float().expand(n, 2, 4)
    draft = p.float().flip(0).expand(n, 1, 4)
    out = RejectionSampler(strict_mode=True)(target, torch.zeros(n, 1, dtype=torch.long), draft,
                                             torch.full((n, 1), -1))
    assert bool((out[:, 1] == -1).all())
    result = chi_square(out[:, 0], p)
    assert result.passed, result
