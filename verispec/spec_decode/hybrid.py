"""HybridDrafter: prompt lookup where the context repeats itself, a learned head elsewhere.

Chains, per request and step: the n-gram drafter (spec_decode/ngram.py) looks for an earlier
occurrence of the context's tail; when it finds one, its continuation is the request's draft,
otherwise the learned drafter (EAGLE or Medusa) drafts for it. The lookup here matches at least
LOOKUP_MIN_N tokens: a one-token match is mostly chance (about 0.2 of its drafts taken after the
one before, against 0.44 of EAGLE's first drafts on the embedded model), so open text, where
every token has been seen before, goes to the head. Why: the two fail on different
text. A lookup match predicts copied spans (summaries, RAG answers, code, math restating its
operands) better than a small head does, and costs nothing beside a head pass; the head
predicts where nothing repeats. Measured in docs/benchmarks.md.

Trees are *grafted*: the lookup's trie of continuations takes at most half of the request's
nodes, and the learned drafter's tree the rest, beside it under the same root. The trie's root
children come first in node order, so the verifier tests them first, and the learned tree's
root children avoid their tokens (Drafter.propose_tree's `exclude`): ranked ones skip them,
drawn ones come from q without them, and that masked q is their row. Both branches are then
tested by the multi-draft rule as one sibling group (sample/tree.py). So a grafted tree may
hold more root children than the shape's branching allows either drafter; its nodes stay
within the request's budget.

Exactness: which drafter drafts what depends only on the request's tokens, never on random
numbers, and lookup drafts are deterministic, so their q is one-hot at each draft token. When
the learned drafter hands over q rows, the lookup's drafts get one-hot rows beside them (a
batch holds one probs tensor). One-hot rows are exact in tree verification with and without
replacement alike (sample/tree.py: the two rules coincide for them); a learned sibling after
them was drawn from its row's q, which holds no mass on the lookup's tokens, with the
lookup's siblings removed or not, as each rule assumes.

The learned drafter observes every forward pass; a request that drafted by lookup for a while
catches up on the positions it skipped the next time the head drafts for it (EAGLE feeds them
in its first pass, as it feeds a prompt), so its stored features grow with the skipped span,
as they do with a prompt, until then.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

import torch

from .adaptive import PRIOR
from .base import DraftBatch, Drafter, DraftRequest, FedTokens
from .ngram import NgramDrafter
from .trees import TreeBatch, TreeShape


# The shortest match the lookup drafts from beside a learned drafter (module docstring).
LOOKUP_MIN_N = 2


class HybridDrafter(Drafter):
    """lookup: the n-gram drafter tried first; learned: the drafter for chains it finds no
    match for, and for the rest of every tree (any Drafter; its hidden layers are the
    hybrid's)."""

    def __init__(self, lookup: NgramDrafter, learned: Drafter) -> None:
        self.lookup = lookup
        self.learned = learned
        self.hidden_layers = learned.hidden_layers
        self.drafts_over_holes = learned.drafts_over_holes
        # Class 0: the learned drafter's drafts; n >= 1: the lookup's, from a match of length n.
        head = learned.class_priors[0] if learned.class_priors else PRIOR
        self.class_priors = (head, *lookup.class_priors[1:])
        self.free_classes = frozenset(range(1, lookup.max_n + 1))

    def draft_class(self, request_id: str, token_ids: Sequence[int]) -> int:
        return self.lookup.draft_class(request_id, token_ids) or 0

    def draft_cost(self, depth: int, num_requests: int) -> float:
        # Declared before knowing which requests the lookup serves: the head's cost, an upper bound.
        return self.lookup.draft_cost(depth, num_requests) + self.learned.draft_cost(depth, num_requests)

    def observe(self, fed: Sequence[FedTokens], hidden: torch.Tensor) -> None:  # hidden: [T, F]
        self.learned.observe(fed, hidden)

    def absorb(self, requests: Sequence[tuple[str, Sequence[int]]]) -> None:
        self.learned.absorb(requests)

    def restorable_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        return min(self.lookup.restorable_prefix(request_id, token_ids),
                   self.learned.restorable_prefix(request_id, token_ids))

    def release(self, request_id: str) -> None:
        self.lookup.release(request_id)
        self.learned.release(request_id)

    def propose(self, requests: Sequence[DraftRequest]) -> DraftBatch:
        found = self.lookup.propose(requests).token_ids
        rest = _unmatched(requests, found)
        learned = self.learned.propose([requests[i] for i in rest])
        return DraftBatch(_merge(found, rest, learned.token_ids),
                          _merge_probs(found, rest, learned.token_ids, learned.probs))

    def propose_tree(self, requests: Sequence[DraftRequest], shape: TreeShape,
                     exclude: Sequence[Collection[int]] | None = None) -> TreeBatch:
        """Grafted trees (module docstring): the lookup's trie in at most half of each
        request's nodes, the learned drafter's tree in the rest."""
        halves = [dataclasses.replace(r, num_draft_tokens=-(-r.num_draft_tokens // 2)) for r in requests]
        found = self.lookup.propose_tree(halves, shape, exclude)
        left = [dataclasses.replace(r, num_draft_tokens=r.num_draft_tokens - len(t))
                for r, t in zip(requests, found.node_token_ids)]
        rest = [i for i, r in enumerate(left) if r.num_draft_tokens > 0]
        avoid = [{t for t, p in zip(found.node_token_ids[i], found.node_parents[i]) if p < 0}
                 | set(exclude[i] if exclude is not None else ()) for i in rest]
        learned = self.learned.propose_tree([left[i] for i in rest], shape, avoid)
        tokens, parents = list(found.node_token_ids), list(found.node_parents)
        for i, grown, grown_parents in zip(rest, learned.node_token_ids, learned.node_parents):
            tokens[i] = tokens[i] + grown
            parents[i] = parents[i] + [p + len(found.node_token_ids[i]) if p >= 0 else -1 for p in grown_parents]
        probs = _merge_probs(found.node_token_ids, rest, learned.node_token_ids, learned.probs)
        return TreeBatch(tokens, parents, probs, learned.replacement)


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
    found: list[list[int]],  # per request, the lookup's draft tokens (maybe none)
    rest: list[int],  # the requests the learned drafter drafted for, in order
    drafted: list[list[int]],  # its drafts for them
    probs: torch.Tensor | None,  # [learned drafts, V] float32, its q rows
) -> torch.Tensor | None:  # [all drafts, V] float32
    """The batch's q rows, per request in batch order: one-hot rows at the lookup's tokens, then
    the learned drafter's rows for its drafts; None when every row would be one-hot."""
    if probs is None or probs.shape[0] == 0:
        return None
    counts = dict(zip(rest, map(len, drafted)))
    rows, offset = [], 0
    for i, tokens in enumerate(found):
        if tokens:
            ids = torch.tensor(tokens, device=probs.device)
            rows.append(torch.zeros(len(tokens), probs.shape[1], device=probs.device,
                                    dtype=probs.dtype).scatter_(1, ids[:, None], 1.0))
        n = counts.get(i, 0)
        rows.append(probs[offset : offset + n])
        offset += n
    return torch.cat(rows)
