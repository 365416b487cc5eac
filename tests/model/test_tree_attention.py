"""Tree attention: every row of a fed tree gets the logits a plain forward pass over its own
path gives (fresh cache), whatever the tree's shape, batched with decode steps, prefill chunks
and other trees, in the padded group and on the one-sequence path."""

from __future__ import annotations

import random

import pytest
import torch

from verispec.runtime.kv_cache import BlockManager
from verispec.runtime.runner import Feed, ModelRunner
from verispec.engine.tree import feed_parents
from verispec.model import AttentionMetadata

from ..tiny import tiny_model

VOCAB = 16


def random_parents(n: int, rng: random.Random, shape: str) -> list[int]:
    """Node parents within a tree (-1: the root), parents before children."""
    if shape == "wide":
        return [-1] * n
    if shape == "deep":
        return list(range(-1, n - 1))
    return [rng.randrange(-1, j) for j in range(n)]


def path_rows(parents: list[int], row: int) -> list[int]:
    """The rows from the first fed row down to `row`, in order."""
    rows = []
    while row >= 0:
        rows.append(row)
        row = parents[row]
    return rows[::-1]


def fresh_last_logits(model, tokens: list[int]) -> torch.Tensor:  # [V]
    blocks = BlockManager(64, 4)
    blocks.allocate("s", len(tokens))
    return ModelRunner(model, blocks).forward([Feed("s", tokens, 0, 1)])[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_rows_match_a_plain_forward_over_their_path(seed: int) -> None:
    rng = random.Random(seed)
    model = tiny_model(seed=seed, vocab=VOCAB)
    blocks = BlockManager(256, 4)
    runner = ModelRunner(model, blocks)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    # (name, context, pending tokens, node parents or None for a chain)
    seqs = [
        ("wide", tokens(5), tokens(1), random_parents(6, rng, "wide")),
        ("deep", tokens(9), tokens(1), random_parents(5, rng, "deep")),
        ("mixed", tokens(3), tokens(3), random_parents(10, rng, "mixed")),
        ("big", tokens(6), tokens(2), random_parents(22, rng, "mixed")),  # > 16 rows: alone
        ("decode", tokens(7), tokens(1), None),
        ("chunk", tokens(4), tokens(20), None),
        ("short", tokens(2), tokens(3), None),
    ]
    first = []
    for name, context, _, _ in seqs:
        blocks.allocate(name, len(context))
        first.append(Feed(name, context, 0, 0))
    runner.forward(first)

    feeds, rows_of = [], {}
    for name, context, pending, nodes in seqs:
        fed = pending + ([] if nodes is None else tokens(len(nodes)))
        parents = None if nodes is None else feed_parents(len(pending), nodes)
        blocks.append(name, len(fed))
        feeds.append(Feed(name, fed, len(context), len(fed), parents))
        rows_of[name] = (context, fed, parents)
    logits = runner.forward(feeds).split([len(f.token_ids) for f in feeds])

    for (name, _, _, _), out in zip(seqs, logits):
        context, fed, parents = rows_of[name]
        for row in range(len(fed)):
            path = list(range(row + 1)) if parents is None else path_rows(parents, row)
            expected = fresh_last_logits(model, context + [fed[r] for r in path])
            torch.testing.assert_close(out[row], expected, atol=1e-4, rtol=1e-4)


def test_tree_positions_are_the_root_position_plus_depth() -> None:
    attn = AttentionMetadata.build([4, 2], [10, 5], [[0, 1, 2], [3, 4]], 4,
                                   trees=[[-1, 0, 0, 1], None])
    assert attn.positions().tolist() == [6, 7, 7, 8, 3, 4]


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, -2]])
def test_tree_parents_must_point_to_earlier_rows(parents: list[int]) -> None:
    with pytest.raises(ValueError, match="parents"):
        Feed("s", [1, 2], 0, 2, parents)
