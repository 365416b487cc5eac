"""HybridDrafter: prompt lookup where the context repeats itself, a learned head elsewhere.

Per request and step: the n-gram drafter (spec/ngram.py) looks for an earlier occurrence of
the context's tail; when it finds one, its continuation (a chain, or a trie for trees) is the
request's draft, otherwise the learned drafter (EAGLE or Medusa) drafts for it. Why: the two
fail on different text. A lookup match predicts copied spans (summaries, RAG answers, code,
math restating its operands) better than a small head does, and costs nothing beside a head
pass; the head predicts where nothing repeats. Measured in docs/benchmarks.md.

Exactness: the choice depends only on the request's tokens, never on random numbers, and
lookup drafts are deterministic, so their q is one-hot at each draft token. When the learned
drafter hands over q rows for its requests, the lookup's requests get one-hot rows beside them
(a batch holds one probs tensor). One-hot rows are exact in tree verification with and without
replacement alike (sample/tree.py: the two rules coincide for them), so a batch may mix
lookup tries with sampled head trees.

The learned drafter observes every forward pass; a request that drafted by lookup for a while
catches up on the positions it skipped the next time the head drafts for it (EAGLE feeds them
in its first pass, as it feeds a prompt), so its stored features grow with the skipped span,
as they do with a prompt, until then.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import DraftBatch, Drafter, DraftRequest, FedTokens
from .ngram import NgramDrafter
from .trees import TreeBatch, TreeShape


class HybridDrafter(Drafter):
    """lookup: the n-gram drafter tried first; learned: the drafter for requests it finds no
    match for (any Drafter; its hidden layers are the hybrid's)."""

    def __init__(self, lookup: NgramDrafter, learned: Drafter) -> None:
        self.lookup = lookup
        self.learned = learned
        self.hidden_layers = learned.hidden_layers

    def draft_cost(self, depth: int, num_requests: int) -> float:
        # Declared before knowing which requests the lookup serves: the head's cost, an upper bound.
        return self.lookup.draft_cost(depth, num_requests) + self.learned.draft_cost(depth, num_requests)

    def observe(self, fed: Sequence[FedTokens], hidden: torch.Tensor) -> None:  # hidden: [T, F]
        self.learned.observe(fed, hidden)

    def release(self, request_id: str) -> None:
        self.lookup.release(request_id)
        self.learned.release(request_id)

    def propose(self, requests: Sequence[DraftRequest]) -> DraftBatch:
        found = self.lookup.propose(requests).token_ids
        rest = _unmatched(requests, found)
        learned = self.learned.propose([requests[i] for i in rest])
        tokens = _merge(found, rest, learned.token_ids)
        return DraftBatch(tokens, _merge_probs(tokens, rest, learned.probs))

    def propose_tree(self, requests: Sequence[DraftRequest], shape: TreeShape) -> TreeBatch:
        found = self.lookup.propose_tree(requests, shape)
        rest = _unmatched(requests, found.node_token_ids)
        learned = self.learned.propose_tree([requests[i] for i in rest], shape)
        tokens = _merge(found.node_token_ids, rest, learned.node_token_ids)
        return TreeBatch(tokens, _merge(found.node_parents, rest, learned.node_parents),
                         _merge_probs(tokens, rest, learned.probs), learned.replacement)


def _unmatched(requests: Sequence[DraftRequest], found: list[list[int]]) -> list[int]:
    """The requests that ask for drafts and got none from the lookup, in order."""
    return [i for i, (r, drafts) in enumerate(zip(requests, found)) if r.num_draft_tokens > 0 and not drafts]


def _merge(found: list[list[int]], rest: list[int], learned: list[list[int]]) -> list[list[int]]:
    """Per request, the lookup's entry, or the learned drafter's for the requests in `rest`."""
    merged = list(found)
    for i, entry in zip(rest, learned):
        merged[i] = entry
    return merged


def _merge_probs(
    tokens: list[list[int]],
    rest: list[int],
    learned: torch.Tensor | None,  # [learned drafts, V] float32, the requests of `rest` in order
) -> torch.Tensor | None:  # [all drafts, V] float32
    """The batch's q rows: the learned drafter's for its requests, one-hot rows at the lookup's
    draft tokens for the others; None when every row would be one-hot."""
    if learned is None or not rest:
        return None
    from_learned = set(rest)
    rows, offset = [], 0
    for i, drafts in enumerate(tokens):
        if i in from_learned:
            rows.append(learned[offset : offset + len(drafts)])
            offset += len(drafts)
        elif drafts:
            ids = torch.tensor(drafts, device=learned.device)
            rows.append(torch.zeros(len(drafts), learned.shape[1], device=learned.device,
                                    dtype=learned.dtype).scatter_(1, ids[:, None], 1.0))
    return torch.cat(rows)
