"""Static draft-tree shapes: which node hangs where, for drafters that expand a tree top-k.

A shape (b_1, ..., b_D) gives every node at depth d - 1 (the root at depth 0) b_d children.
Nodes are listed breadth first, parents before children, each with its depth and its rank
among its siblings (0 for the most likely child): drafters fill node (d, r) with their r-th
most likely token at depth d. A node budget keeps the first nodes in that order, so a
truncated tree is still a tree and keeps the most likely candidates.
"""

from __future__ import annotations

from typing import NamedTuple


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
