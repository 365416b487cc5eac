"""The training-time test (train/unroll.py) computes, at every depth, what drafting computes:
each pass is checked against the head run through its paged cache the way EagleDrafter runs it
(confirmed positions fed true features, then one draft at a time fed the previous prediction)."""

from __future__ import annotations

import pytest
import torch

from verispec.model import AttentionMetadata
from verispec.spec_decode.heads import HeadConfig, new_head
from verispec.train.unroll import unrolled_passes, valid_rows

from .. import learned

BLOCK = 4


def _head(fused: bool):
    target = learned.target()
    head = new_head(HeadConfig.for_target("eagle", target.config, fused=fused), target,
                    torch.arange(learned.VOCAB), seed=2)
    # Random norms and fusion, so a wrong layer or a missing norm shows.
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in head.own_state().values():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return head


def _drafted(head, features: torch.Tensor, ids: torch.Tensor, confirmed: int, depth: int) -> torch.Tensor:
    """The head's output at draft `depth` after positions 0 .. confirmed - 1 of one sequence
    were fed true features: a prefill, then one row per draft, through a paged cache."""
    cache = head.allocate_kv_cache(16, BLOCK)
    table = list(range(16))

    def run(fed: torch.Tensor, start: int) -> torch.Tensor:  # [n, d] rows fed at start ..
        n = fed.shape[0]
        attn = AttentionMetadata.build([n], [start + n], [table], BLOCK)
        return head(fed, ids[start : start + n], attn.positions(), attn, cache)

    out = run(features[:confirmed], 0)[-1:]
    for j in range(1, depth + 1):
        out = run(out, confirmed - 1 + j)
    return out[0]


@pytest.mark.parametrize("fused", [False, True])
def test_every_pass_equals_drafting_at_its_depth(fused: bool) -> None:
    head = _head(fused)
    g = torch.Generator().manual_seed(0)
    lengths = [7, 5, 9]
    d = head.config.hidden_size
    hidden = torch.randn(sum(lengths), len(head.config.hidden_layers) * d, generator=g) * 3
    features = head.features(hidden)
    ids = torch.randint(0, learned.VOCAB, (sum(lengths),), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        passes = unrolled_passes(head, features, ids, positions, 4)
    start = 0
    checked = 0
    for n in lengths:
        for depth, out in enumerate(passes):
            for t in range(n):
                if not valid_rows(positions, depth)[start + t]:
                    assert t < depth
                    continue
                with torch.no_grad():
                    expected = _drafted(head, features[start : start + n], ids[start : start + n], t - depth + 1, depth)
                torch.testing.assert_close(out[start + t], expected, atol=2e-5, rtol=2e-5)
                checked += 1
        start += n
    assert checked == sum(n - j for n in lengths for j in range(4))


def test_gradients_reach_every_trainable_weight_through_the_unroll() -> None:
    head = _head(True)
    params = head.trainable()
    lengths = [6, 4]
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(sum(lengths), len(head.config.hidden_layers) * head.config.hidden_size, generator=g)
    ids = torch.randint(0, learned.VOCAB, (sum(lengths),), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])
    passes = unrolled_passes(head, head.features(hidden), ids, positions, 3)
    head.logits(passes[-1][valid_rows(positions, 2)]).logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    for p in params:
        p.requires_grad_(False)
