"""Draft trees: the batch a drafter hands over (TreeBatch), tree shapes, and growing trees
from a drafter's distributions (grow_trees), top-k or sampled.

Terms: the *root* is the request's newest token (never a node); a node's *depth* is 1 for the
root's children; a drafter *expands* a node by computing the draft distribution of its
children's tokens (for EAGLE a head pass over the node's path, for Medusa the next head).

A static shape (b_1, ..., b_D) gives every node at depth d - 1 b_d children: the b_d most
likely tokens of its distribution. Nodes are listed breadth first, parents before children,
each with its depth and its rank among its siblings (0 for the most likely child). A node
budget keeps the first nodes in that order, so a truncated tree is still a tree and keeps the
most likely candidates.

A DynamicTree grows by draft confidence, as EAGLE-2 does: a node's *score* is the sum of the
draft log-probabilities along its path; at each depth the top_k best-scored nodes are expanded
with their top_k children each, up to `depth`, and the `nodes` best-scored nodes of all those
drawn are kept (a child never outscores its parent, so they form a tree).

Children are *ranked* (a row's most likely tokens: deterministic drafts, and greedy requests)
or *drawn*: for a sampled request, a row's children are drawn one after another without
replacement from q (the request's pipeline on the draft logits), and each node carries the q it
was drawn from, for the verifier's recursive rejection sampling (sample/tree.py). That rule
is exact only if a sibling group is a prefix of its draws whose length does not depend on the
drawn tokens themselves, so a drawn dynamic tree is not re-ranked at the end: each level
expands the top_k best-scored nodes of the level before (decided by draws already made) and
keeps its share of the remaining budget, given to the draw slots of best prior score (the
parent's score plus its distribution's i-th largest log-probability for the i-th draw, known
before drawing); the rank of a drawn node is its draw's place.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..config import DynamicTree, TreeShape




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

    @classmethod
    def empty(cls, num_requests: int) -> TreeBatch:
        """No drafts for any request."""
        return cls([[] for _ in range(num_requests)], [[] for _ in range(num_requests)])

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


def branching(shape: TreeShape) -> tuple[int, ...]:
    """The most children a node may have at each depth: a dynamic tree's bound, for drafters
    that fill a static shape (n-gram tries)."""
    return (shape.top_k,) * shape.depth if isinstance(shape, DynamicTree) else shape


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


@dataclass
class GrownTree:
    """One request's tree as grow_trees builds it: nodes in creation order (parents first)."""

    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)  # the row of grow_trees' q rows each node was drawn from

    def add(self, token: int, parent: int, score: float, source: int = -1) -> None:
        self.token_ids.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(score)
        self.sources.append(source)

    def path(self, node: int) -> list[int]:
        """The node's ancestors and itself, root side first."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def best(self, budget: int) -> GrownTree:
        """The `budget` best-scored nodes (ties: shallower, then older), reindexed in creation
        order; every kept node's parent is kept too."""
        order = sorted(range(len(self.token_ids)), key=lambda j: (-self.scores[j], self.depths[j], j))
        kept = sorted(order[:budget])
        index = {j: i for i, j in enumerate(kept)}
        tree = GrownTree()
        for j in kept:
            tree.add(self.token_ids[j], index[self.parents[j]] if self.parents[j] >= 0 else -1,
                     self.scores[j], self.sources[j])
        return tree


Expand = Callable[[list[GrownTree], list[list[int]]], torch.Tensor]


class Children(NamedTuple):
    """The children a level draws, one entry per expanded row (rows as in `expand`)."""

    tokens: list[list[int]]  # per row: most likely first (ranked), or in draw order (drawn)
    logprobs: list[list[float]]  # per row: each child's draft log-probability
    probs: torch.Tensor | None  # [rows, V] the distribution each row's children were drawn from, or None
    drawn: list[bool]  # per row: sampled without replacement (True) or the top tokens (False)
    top_logprobs: list[list[float]]  # per row: its distribution's largest log-probabilities, descending


Pick = Callable[[torch.Tensor, list[tuple[int, int]], list[GrownTree], int], Children]


def top_children(vocab: torch.Tensor) -> Pick:  # vocab: [N] int64, the token id of each column
    """Deterministic children: each row's `width` most likely tokens (tokens with -inf logits,
    masked out, are never children)."""

    def pick(logits: torch.Tensor, rows: list[tuple[int, int]], trees: list[GrownTree], width: int) -> Children:
        top = logits.float().log_softmax(-1).topk(min(width, logits.shape[-1]), dim=-1)  # logits: [rows, N]
        kept = [[(t, v) for t, v in zip(tokens, values) if math.isfinite(v)]
                for tokens, values in zip(vocab[top.indices].tolist(), top.values.tolist())]
        values = [[v for _, v in row] for row in kept]
        return Children([[t for t, _ in row] for row in kept], values, None, [False] * len(rows), values)

    return pick


def grow_trees(
    shape: TreeShape,
    budgets: Sequence[int],  # node budget per request (>= 1)
    root_logits: torch.Tensor,  # [R, N] draft logits of the root's children, one row per request
    vocab: torch.Tensor,  # [N] int64, the target token id of each column
    expand: Expand,
    pick: Pick | None = None,
) -> tuple[list[GrownTree], torch.Tensor | None]:  # trees, q rows [total nodes, V] or None
    """Grows one tree per request (module docstring). `expand(trees, nodes)` returns the draft
    logits of the children of nodes[r] of trees[r] ([sum(len(n) for n in nodes), N], rows in
    that order); it is called once per level, for all requests together. `pick` chooses each
    expanded row's children (default: top_children); when it samples, the second result holds
    the distribution each node was drawn from, requests concatenated in node order."""
    pick = pick or top_children(vocab)
    trees = [GrownTree() for _ in budgets]
    if isinstance(shape, DynamicTree):
        plans = None
        width, levels = shape.top_k, shape.depth
    else:
        # A node cannot have more children than the draft vocabulary has tokens.
        shape = tuple(min(b, root_logits.shape[-1]) for b in shape)
        plans = [static_tree(shape, budget) for budget in budgets]
        width, levels = max(shape), len(shape)
    # Static trees: the grown index of each planned node (a drawn node may be missing: its
    # parent's distribution had fewer tokens than the shape asks for).
    grown_of_plan: list[dict[int, int]] = [{-1: -1} for _ in budgets]
    level_probs: list[torch.Tensor] = []
    rows: list[tuple[int, int]] = [(r, -1) for r in range(len(trees))]
    logits = root_logits
    drawn = [False] * len(trees)
    for depth in range(1, levels + 1):
        children = pick(logits, rows, trees, width)
        offset = sum(p.shape[0] for p in level_probs)  # of this level's q rows
        if children.probs is not None:
            level_probs.append(children.probs)
        for row, (r, _) in enumerate(rows):
            drawn[r] = drawn[r] or children.drawn[row]
        quotas = _drawn_quotas(shape, depth, budgets, trees, rows, children, drawn) if plans is None else {}
        for row, (r, parent) in enumerate(rows):
            base = 0.0 if parent < 0 else trees[r].scores[parent]
            count = len(children.tokens[row])
            if plans is not None:
                # Grown nodes follow the plan's breadth-first order.
                planned = [(i, n.rank) for i, n in enumerate(plans[r])
                           if n.depth == depth and grown_of_plan[r].get(n.parent) == parent]
            else:
                planned = [(None, rank) for rank in range(quotas.get(row, count))]
            for index, rank in planned:
                if rank >= count:
                    continue
                if index is not None:
                    grown_of_plan[r][index] = len(trees[r].token_ids)
                trees[r].add(children.tokens[row][rank], parent, base + children.logprobs[row][rank],
                             offset + row)
        if depth == levels:
            break
        # A drawn tree's budget is final once full (no re-ranking): nothing more to expand.
        nodes = [[] if drawn[r] and len(tree.token_ids) >= budgets[r] else _to_expand(tree, depth, plan, width, grown)
                 for r, (tree, plan, grown) in
                 enumerate(zip(trees, plans if plans is not None else [None] * len(trees), grown_of_plan))]
        rows = [(r, j) for r, chosen in enumerate(nodes) for j in chosen]
        if not rows:
            break
        logits = expand(trees, nodes)
    if plans is None:
        trees = [tree if sampled else tree.best(budget) for tree, budget, sampled in zip(trees, budgets, drawn)]
    if not level_probs:
        return trees, None
    probs = torch.cat(level_probs)
    return trees, probs[torch.tensor([row for tree in trees for row in tree.sources], dtype=torch.int64,
                                     device=probs.device)]


def _drawn_quotas(shape: DynamicTree, depth: int, budgets: Sequence[int], trees: list[GrownTree],
                  rows: list[tuple[int, int]], children: Children, drawn: list[bool]) -> dict[int, int]:
    """How many of its draws each row of a drawn dynamic tree keeps at `depth`: the level gets
    its share of the remaining budget (ceil(left / levels left), so the tree reaches its depth),
    given to the draw slots of best *prior* score, a slot's prior being its parent's score plus
    the parent distribution's i-th largest log-probability for the i-th draw. Priors are known
    before the draws, so what a row keeps never depends on what it drew."""
    slots: dict[int, list[tuple[float, int, int]]] = {}
    for row, (r, parent) in enumerate(rows):
        if drawn[r]:
            base = 0.0 if parent < 0 else trees[r].scores[parent]
            prior = children.top_logprobs[row][: len(children.tokens[row])]
            slots.setdefault(r, []).extend((-(base + value), row, i) for i, value in enumerate(prior))
    quotas = {row: 0 for row, (r, _) in enumerate(rows) if drawn[r]}
    for r, candidates in slots.items():
        left = budgets[r] - len(trees[r].token_ids)
        share = -(-left // (shape.depth - depth + 1))
        for _, row, _ in sorted(candidates)[:share]:
            quotas[row] += 1
    return quotas


def _to_expand(tree: GrownTree, depth: int, plan: list[TreeNode] | None, width: int,
               grown_of_plan: dict[int, int]) -> list[int]:
    """The nodes at `depth` to expand next: those with children in a static plan, or the
    `width` best-scored (dynamic)."""
    level = [j for j, d in enumerate(tree.depths) if d == depth]
    if plan is not None:
        with_children = {grown_of_plan.get(n.parent) for n in plan if n.depth == depth + 1}
        return [j for j in level if j in with_children]
    return sorted(sorted(level, key=lambda j: (-tree.scores[j], j))[:width])
