"""Bookkeeping of tree speculation, plain Python: the rows a request feeds for its tree and where
the accepted path's cache entries go afterwards.

A sampling request feeds its pending tokens (a chain; the last is the *root*) followed by its
draft tree's nodes (sample/tree.py: node parents within the tree, -1 for the root's children).
Fed at cache positions start, start + 1, ..., node j sits at start + m + j (m pending tokens),
but attends and is rotated as if at start + m + depth - 1 (model/attention.py: tree). Once
verified, the accepted path's nodes move to start + m, start + m + 1, ... (the positions they
were rotated for) and the scheduler truncates the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..spec_decode.base import FedTokens
from ..runtime.runner import KVMove


def feed_parents(num_pending: int, node_parents: Sequence[int]) -> list[int]:
    """Parents of the fed rows (runner.Feed.parents): the pending tokens as a chain, then the
    nodes, the root's children hanging from the last pending row."""
    chain = list(range(-1, num_pending - 1))
    return chain + [num_pending + p if p >= 0 else num_pending - 1 for p in node_parents]


def path_move(seq_id: str, start: int, num_pending: int, path_nodes: Sequence[int]) -> KVMove:
    """The move that puts the accepted path's nodes (indices within the tree, root side first)
    right after the pending tokens fed from position `start`; nodes already in place stay."""
    first = start + num_pending
    pairs = [(first + node, first + depth) for depth, node in enumerate(path_nodes) if node != depth]
    return KVMove(seq_id, [s for s, _ in pairs], [d for _, d in pairs])


def accepted_rows(
    fed: Sequence[FedTokens], num_nodes: dict[str, int], paths: dict[str, list[int]],
) -> tuple[list[FedTokens], list[int]]:
    """What a drafter that reads hidden states should see of a tree step: per request its
    pending tokens and accepted path (all of a request without a path, e.g. a prefill chunk),
    renumbered as rows of the hidden states gathered at the returned row indices."""
    kept: list[FedTokens] = []
    index: list[int] = []
    for f in fed:
        rows = list(range(len(f.token_ids)))
        if f.request_id in paths:
            m = len(f.token_ids) - num_nodes[f.request_id]
            rows = rows[:m] + [m + j for j in paths[f.request_id]]
        kept.append(FedTokens(f.request_id, f.start, [f.token_ids[r] for r in rows], len(index)))
        index.extend(f.first_row + r for r in rows)
    return kept, index
