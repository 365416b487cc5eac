"""FeatureStore with holes: what is stored is the target's feature of that position, holes read
as zero, a feed rewrites everything from its position on, confirm drops what the tokens
disagree with."""

from __future__ import annotations

import pytest
import torch

from verispec.spec_decode.base import FedTokens
from verispec.spec_decode.features import FeatureStore


def _rows(positions: range) -> torch.Tensor:  # [len, 2]: row p holds (p, -p)
    return torch.tensor([[float(p), -float(p)] for p in positions])


def _feed(store: FeatureStore, start: int, tokens: list[int]) -> None:
    store.observe([FedTokens("r", start, tokens, 0)], _rows(range(start, start + len(tokens))))


def test_segments_holes_and_zero_features() -> None:
    store = FeatureStore()
    _feed(store, 0, [5, 6, 7])  # a prompt
    _feed(store, 6, [8])        # positions 3..5 fed without capture: a hole
    _feed(store, 7, [9, 1])
    assert [store.known("r", p) for p in range(10)] == [True] * 3 + [False] * 3 + [True] * 3 + [False]
    assert store.first_hole("r", 0, 3) is None and store.first_hole("r", 1, 8) == 3
    assert store.first_hole("r", 6, 9) is None and store.first_hole("r", 6, 10) == 9
    got = store.features("r", 1, 9)
    want = _rows(range(1, 9))
    want[2:5] = 0
    assert torch.equal(got, want)
    assert torch.equal(store.features("r", 6, 9), _rows(range(6, 9)))


def test_a_feed_rewrites_from_its_position_and_confirm_cuts_each_segment_at_a_disagreement() -> None:
    store = FeatureStore()
    tokens = [5, 6, 7, 1, 2, 3, 8, 9, 4]
    _feed(store, 0, tokens[:3])
    _feed(store, 6, tokens[6:9])
    _feed(store, 2, [7, 0, 0])  # a verify pass from position 2: everything stored from 2 on is stale
    assert [store.known("r", p) for p in range(9)] == [True] * 5 + [False] * 4
    # Positions 3 and 4 held rejected drafts; a later pass (not capturing 3..5) fed 6.. with its
    # last draft rejected: each segment keeps what agrees with the tokens, the later one stands.
    _feed(store, 6, [8, 9, 0])
    store.confirm("r", tokens)
    assert [store.known("r", p) for p in range(9)] == [True] * 3 + [False] * 3 + [True] * 2 + [False]
    assert store.first_hole("r", 0, 8) == 3
    assert torch.equal(store.features("r", 2, 8), torch.cat([_rows(range(2, 3)), torch.zeros(3, 2),
                                                             _rows(range(6, 8))]))
    store.drop_before("r", 7)
    assert [store.known("r", p) for p in range(9)] == [False] * 7 + [True] + [False]
    assert torch.equal(store.features("r", 7, 8), _rows(range(7, 8)))
    assert store.tokens("r") == (7, [9])


def test_unknown_requests_are_named() -> None:
    store = FeatureStore()
    assert not store.known("x", 0) and store.first_hole("x", 0, 2) == 0
    with pytest.raises(ValueError, match="'x'"):
        store.features("x", 0, 1)
    with pytest.raises(KeyError):
        store.tokens("x")
