"""Draft trees: the batch a drafter hands over (TreeBatch), and static tree shapes.

Static shapes say which node hangs where, for drafters that expand a tree top-k.

A shape (b_1, ..., b_D) gives every node at depth d - 1 (the root at depth 0) b_d children.
Nodes are listed breadth first, parents before children, each with its depth and its rank
among its siblings (0 for the most likely child): drafters fill node (d, r) with their r-th
most likely token at depth d. A node budget keeps the first nodes in that order, so a
truncated tree is still a tree and keeps the most likely candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass
class TreeBatch:
    """Draft trees for a batch of requests, in the order of the requests (layout of
    sample/tree.py's verify_tree, per request).

    node_token_ids: per request, its nodes' tokens, parents before children; at most its
        ``num_draft_tokens`` nodes, maybe none.
    node_parents: per request, each node's parent index within the request, -1 for the root.
    probs: the distribution q each node's token was drawn from, one row per node, requests
        concatenated; None for deterministic drafts (top-k expansion, lookup).
    replacement: whether siblings were drawn with replacement (i.i.d. from q) or without.
    """

    node_token_ids: list[list[int]]
    node_parents: list[list[int]]
    probs: torch.Tensor | None = None  # [total_nodes, vocab_size] float32
    replacement: bool = True

    def __post_init__(self) -> None:
        if [len(t) for t in self.node_token_ids] != [len(p) for p in self.node_parents]:
            raise ValueError("node_token_ids and node_parents must hold one entry per node, got "
                             f"{[len(t) for t in self.node_token_ids]} and "
                             f"{[len(p) for p in self.node_parents]} nodes")
        for parents in self.node_parents:
            if any(not -1 <= p < j for j, p in enumerate(parents)):
                raise ValueError(f"node_parents holds {parents!r}: expected each parent to be -1 "
                                 "or an earlier node")
        total = sum(len(t) for t in self.node_token_ids)
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != total):
            raise ValueError(f"probs has shape {tuple(self.probs.shape)}: expected "
                             f"[{total}, vocab_size], one row per node")


class TreeNode(NamedTuple):
    parent: int  # index of the parent node, -1 for the root
    depth: int  # 1 for the root's children
    rank: int  # rank among its siblings


def static_tree(shape: tuple[int, ...], budget: int) -> list[TreeNode]:
    """The first `budget` nodes of the tree of `shape`, breadth first."""
    nodes: list[TreeNode] = []
    level = [-1]  # the nodes of the previous depth
    for depth, branching in enumerate(shape, start=1):
        next_level = []
        for parent in level:
            for rank in range(branching):
                if len(nodes) == budget:
                    return nodes
                next_level.append(len(nodes))
                nodes.append(TreeNode(parent, depth, rank))
        level = next_level
    return nodes
