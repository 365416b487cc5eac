"""KV compaction after tree verification: random trees, accepted paths and rollbacks over a
shared paged cache. The accepted path's entries end up where a plain decode would have put
them (the next step's logits equal a fresh forward over the committed tokens), and the block
manager ends exactly as it started."""

from __future__ import annotations

import random

import pytest
import torch

from verispec.runtime.kv_cache import BlockManager
from verispec.runtime.runner import Feed, ModelRunner
from verispec.engine.tree import feed_parents, path_move

from ..model.test_tree_attention import fresh_last_logits, random_parents
from ..tiny import tiny_model

VOCAB = 16


def random_path(parents: list[int], rng: random.Random) -> list[int]:
    """A random accepted path from the root: node indices, root side first (maybe empty)."""
    path, current = [], -1
    while True:
        children = [j for j, p in enumerate(parents) if p == current]
        if not children or rng.random() < 0.25:
            return path
        current = rng.choice(children)
        path.append(current)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_trees_accepts_and_rollbacks(seed: int) -> None:
    rng = random.Random(seed)
    model = tiny_model(seed=seed, vocab=VOCAB)
    blocks = BlockManager(48, 4)
    runner = ModelRunner(model, blocks)
    blocks.allocate("bystander", 6)
    bystander_table = blocks.block_table("bystander")
    free_before = sorted(blocks._free)

    names = [f"s{i}" for i in range(3)]
    committed = {n: [] for n in names}  # tokens whose entries sit in the cache
    pending = {n: [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))] for n in names}
    for n in names:
        blocks.allocate(n, 0)
    for _ in range(8):
        feeds, trees = [], {}
        for n in names:
            nodes = random_parents(rng.randint(0, 12), rng, rng.choice(["wide", "deep", "mixed"]))
            tokens = [rng.randrange(VOCAB) for _ in nodes]
            m = len(pending[n])
            blocks.append(n, m + len(nodes))
            feeds.append(Feed(n, pending[n] + tokens, len(committed[n]), len(nodes) + 1,
                              feed_parents(m, nodes)))
            trees[n] = (nodes, tokens)
        logits = runner.forward(feeds).split([len(t[0]) + 1 for t in trees.values()])
        moves = []
        for n, rows in zip(names, logits):
            # The root row reads the entries the previous step compacted.
            torch.testing.assert_close(rows[0], fresh_last_logits(model, committed[n] + pending[n]),
                                       atol=1e-4, rtol=1e-4)
            nodes, tokens = trees[n]
            path = random_path(nodes, rng)
            moves.append(path_move(n, len(committed[n]), len(pending[n]), path))
            trees[n] = (nodes, tokens, path)
        runner.move_kv(moves)
        for n in names:
            nodes, tokens, path = trees[n]
            blocks.truncate(n, len(nodes) - len(path))
            committed[n] += pending[n] + [tokens[j] for j in path]
            pending[n] = [rng.randrange(VOCAB)]  # the recovered / bonus token
            assert blocks.num_tokens(n) == len(committed[n])
            assert len(blocks.block_table(n)) == blocks.blocks_for(len(committed[n]))
        if rng.random() < 0.3:  # a request finishes; a new one takes its place
            gone = rng.choice(names)
            blocks.free(gone)
            blocks.allocate(gone, 0)
            committed[gone], pending[gone] = [], [rng.randrange(VOCAB)]

    for n in names:
        blocks.free(n)
    assert blocks.block_table("bystander") == bystander_table
    assert sorted(blocks._free) == free_before
    assert blocks.seq_ids() == ["bystander"]
