"""Prompt-lookup (n-gram) drafting: propose what followed the last n tokens the previous time.

For each request, with tokens t_0..t_{L-1} (prompt + output) and K = min(num_draft_tokens,
num_speculative_tokens):

1. For n from max_n down to min_n, look for an earlier occurrence of the suffix
   t_{L-n}..t_{L-1}, i.e. a match ending at j < L - 1; take the longest n that has one and, for
   that n, the most recent occurrence (largest j).
2. Propose the K tokens that follow it, t_{j+1}, t_{j+2}, ... When they run into the end of the
   context (the match overlaps the suffix: a repeating pattern of period d = L - 1 - j), copy on
   past the end as LZ77 does: the draft continues the repetition, t_{L+i} = t_{L+i-d}.
3. No occurrence for any n: propose nothing.

Trees (``propose_tree``): the continuations of several matches, preferred as above (longest n
first, then most recent), merged into a trie: a continuation adds the nodes it does not share
with earlier ones, within the shape's branching factors and depth and the node budget.

The tokens are deterministic, so ``probs`` is None (one-hot q). Drafts only affect speed; the
verifier makes the output exact whatever they are.

Speed: each request's tokens are mirrored in a numpy buffer kept across calls (only the newly
emitted tokens are copied in), so a call costs one vectorised comparison over the context plus
work proportional to the number of candidate matches, instead of O(L * n) Python. The buffer is
dropped in ``release``. If ``token_ids`` no longer extends what was mirrored (shorter, or a
different last mirrored token, as when a request id is reused without ``release``), the buffer
is rebuilt from scratch.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence

import numpy as np

from verispec.config import DraftCost
from verispec.spec_decode.base import DraftBatch, Drafter, DraftRequest
from verispec.spec_decode.trees import TreeBatch, TreeShape, branching


class _TokenBuffer:
    """The tokens of one request in a numpy array that grows by doubling."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.length = len(token_ids)
        self.data = np.empty(max(16, 2 * self.length), dtype=np.int64)
        self.data[: self.length] = np.asarray(token_ids, dtype=np.int64)

    def extends_to(self, token_ids: Sequence[int]) -> bool:
        """Whether ``token_ids`` looks like the mirrored tokens plus new ones (an O(1) check)."""
        n = self.length
        return len(token_ids) >= n and (n == 0 or token_ids[n - 1] == self.data[n - 1])

    def sync(self, token_ids: Sequence[int]) -> None:
        new = len(token_ids) - self.length
        if new == 0:
            return
        if len(token_ids) > len(self.data):
            grown = np.empty(2 * len(token_ids), dtype=np.int64)
            grown[: self.length] = self.data[: self.length]
            self.data = grown
        self.data[self.length : len(token_ids)] = np.asarray(
            token_ids[self.length :], dtype=np.int64
        )
        self.length = len(token_ids)


class _SuffixIndex:
    """The latest end of each n-gram (n <= max_n) of one request's tokens, kept as tokens arrive,
    so the best match (best_match's) costs O(max_n) dictionary lookups per new token instead of
    scans of the whole context: ~20 us a request and step at a few hundred tokens, which at
    batch 16 was 1-2 % of the 4-bit target's step."""

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n)]  # [n - 1]: n-gram -> end
        self.indexed = 0  # the n-grams ending before this position are in `ends`

    def best(self, tokens: np.ndarray, min_n: int) -> tuple[int, int]:  # tokens: [L] int64, extending the last call's
        """(n, end) of the longest n >= min_n whose last n tokens occurred before, ending at
        `end` < L - 1 (the latest such end), or (0, -1)."""
        length = len(tokens)
        if length < 2:
            return 0, -1
        base = max(0, self.indexed - self.max_n + 1)
        window = tokens[base:].tolist()
        for end in range(self.indexed, length - 1):
            for n in range(1, min(self.max_n, end + 1) + 1):
                self.ends[n - 1][tuple(window[end - n + 1 - base : end + 1 - base])] = end
        self.indexed = max(self.indexed, length - 1)
        last = length - 1
        for n in range(min(self.max_n, length - 1), min_n - 1, -1):
            end = self.ends[n - 1].get(tuple(window[last - n + 1 - base : last + 1 - base]))
            if end is not None:
                return n, end
        return 0, -1


def _check_positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: expected an integer >= 1")
    return value


def _ends_by_n(
    tokens: np.ndarray,  # [L] int64: prompt + output so far
    min_n: int,
    max_n: int,
) -> list[tuple[int, np.ndarray]]:
    """(n, ends j < L - 1 of earlier occurrences of the context's last n tokens, ascending) for
    each n in min_n..max_n that has one, shortest n first."""
    length = len(tokens)
    if length < 2:
        return []
    # Candidate match ends j < L - 1 whose last n tokens equal the suffix's, for growing n.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    by_n: list[tuple[int, np.ndarray]] = []
    for n in range(1, max_n + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
        if len(ends) == 0:
            break
        if n >= min_n:
            by_n.append((n, ends))
    return by_n


def match_ends(
    tokens: np.ndarray,  # [L] int64: prompt + output so far
    min_n: int,
    max_n: int,
) -> Iterator[int]:
    """Ends j < L - 1 of earlier occurrences of the context's last n tokens, min_n <= n <= max_n,
    best first: longest n first, then most recent."""
    seen: set[int] = set()
    for _, ends in reversed(_ends_by_n(tokens, min_n, max_n)):
        for j in ends[::-1].tolist():
            if j not in seen:
                seen.add(j)
                yield j


def best_match(
    tokens: np.ndarray,  # [L] int64: prompt + output so far
    min_n: int,
    max_n: int,
) -> tuple[int, int]:
    """(n, end) of the best match (match_ends' first), or (0, -1) when there is none."""
    by_n = _ends_by_n(tokens, min_n, max_n)
    return (by_n[-1][0], int(by_n[-1][1][-1])) if by_n else (0, -1)


def continuation(tokens: np.ndarray, end: int, k: int) -> list[int]:  # tokens: [L] int64
    """The k tokens after the match ending at `end`, copied on past the context's end when the
    match overlaps it (module docstring)."""
    follow = tokens[end + 1 : end + 1 + k]
    if len(follow) < k:
        # The match overlaps the suffix: continue the period-len(follow) repetition.
        follow = np.resize(follow, k)
    return follow.tolist()


def propose_ngram(
    tokens: np.ndarray,  # [L] int64: prompt + output so far
    min_n: int,
    max_n: int,
    k: int,
) -> list[int]:
    """The prompt-lookup draft of at most k tokens for one context (rule: module docstring)."""
    if k == 0:
        return []
    n, end = best_match(tokens, min_n, max_n)
    return [] if n == 0 else continuation(tokens, end, k)


def propose_ngram_tree(
    tokens: np.ndarray,  # [L] int64: prompt + output so far
    min_n: int,
    max_n: int,
    shape: tuple[int, ...],
    budget: int,
    avoid: Collection[int] = (),
) -> tuple[list[int], list[int]]:
    """(node tokens, node parents) of the trie of match continuations (module docstring),
    leaving out the continuations that start with a token of `avoid`."""
    node_tokens: list[int] = []
    parents: list[int] = []
    children: dict[int, dict[int, int]] = {-1: {}}  # node -> its children by token
    for end in match_ends(tokens, min_n, max_n) if budget > 0 else []:
        node = -1
        follow = continuation(tokens, end, len(shape))
        if follow[0] in avoid:
            continue
        for depth, token in enumerate(follow):
            if token in children[node]:
                node = children[node][token]
                continue
            if len(children[node]) == shape[depth] or len(node_tokens) == budget:
                break
            children[node][token] = len(node_tokens)
            children[len(node_tokens)] = {}
            node_tokens.append(token)
            parents.append(node)
            node = len(node_tokens) - 1
        if len(node_tokens) == budget:
            break
    return node_tokens, parents


# A lookup in numpy per request: about 0.2% of the target step's fixed cost per call, 0.03% per
# request (the embedded model on CPU, measured with bench/draft_cost.py); the same time is 3% of
# the 4-bit target's step.
NGRAM_COST = DraftCost(per_call=0.002, per_request=0.0003)
NGRAM_COST_QUANTIZED = DraftCost(per_call=0.03, per_request=0.0035)
# Acceptance by match length n (index n; 0: no match, nothing to draft): how often the target
# takes a draft after the one before it was taken. A 1-token match is mostly chance, a 3-token
# one mostly a copied span (the embedded model, bench/prompts/classes.jsonl and 12 training
# prompts at K = 4, 2026-11-27: 0.2 / 0.45 / 0.85 greedy, 0.2 / 0.3 / 0.65 sampled).
NGRAM_CLASS_PRIORS = (0.0, 0.2, 0.35, 0.7)


class NgramDrafter(Drafter):
    """Prompt-lookup drafter: copies what followed the latest earlier match of the context's tail.

    min_n, max_n: the shortest and longest suffix lengths (n-grams) to match, 1 <= min_n <= max_n.
    num_speculative_tokens: the most tokens proposed per request per step; a request's own
        ``num_draft_tokens`` may ask for fewer.
    cost: what a call costs relative to the target's step (NGRAM_COST for a float target,
        NGRAM_COST_QUANTIZED for a quantized one).
    """

    class_priors = NGRAM_CLASS_PRIORS

    def __init__(self, min_n: int = 1, max_n: int = 3, num_speculative_tokens: int = 5,
                 cost: DraftCost = NGRAM_COST) -> None:
        self.cost = cost
        self.min_n = _check_positive("min_n", min_n)
        self.max_n = _check_positive("max_n", max_n)
        if max_n < min_n:
            raise ValueError(f"max_n={max_n!r} is invalid: expected an integer >= min_n={min_n}")
        self.num_speculative_tokens = _check_positive(
            "num_speculative_tokens", num_speculative_tokens
        )
        self._buffers: dict[str, _TokenBuffer] = {}
        self._indexes: dict[str, _SuffixIndex] = {}

    def draft_cost(self, depth: int, num_requests: int) -> float:
        return self.cost(depth, num_requests)

    def propose(self, requests: Sequence[DraftRequest]) -> DraftBatch:
        return DraftBatch(token_ids=[self._propose_one(r) for r in requests], probs=None)

    def propose_tree(self, requests: Sequence[DraftRequest], shape: TreeShape,
                     exclude: Sequence[Collection[int]] | None = None) -> TreeBatch:
        """Tries of continuations (module docstring), of at most each request's
        ``num_draft_tokens`` nodes (num_speculative_tokens does not cap trees); a dynamic tree
        bounds them by its depth and top_k."""
        avoid = exclude if exclude is not None else [()] * len(requests)
        trees = [propose_ngram_tree(self._tokens(r.request_id, r.token_ids), self.min_n, self.max_n,
                                    branching(shape), r.num_draft_tokens, a)
                 for r, a in zip(requests, avoid, strict=True)]
        return TreeBatch([t for t, _ in trees], [p for _, p in trees])

    def draft_class(self, request_id: str, token_ids: Sequence[int]) -> int | None:
        """The length n of the context's best match; None when it has none."""
        n, _ = self.match(request_id, token_ids)
        return n or None

    def match(self, request_id: str, token_ids: Sequence[int]) -> tuple[int, int]:
        """(n, end) of the context's best match (best_match's), from the request's n-gram index:
        asked again for the same context (draft_class, then the draft), it only looks up."""
        tokens = self._tokens(request_id, token_ids)
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = _SuffixIndex(self.max_n)
        return index.best(tokens, self.min_n)

    def _propose_one(self, request: DraftRequest) -> list[int]:
        k = min(request.num_draft_tokens, self.num_speculative_tokens)
        if k <= 0:
            return []
        n, end = self.match(request.request_id, request.token_ids)
        return [] if n == 0 else continuation(self._tokens(request.request_id, request.token_ids), end, k)

    def _tokens(self, request_id: str, token_ids: Sequence[int]) -> np.ndarray:  # [L] int64, the mirror
        buf = self._buffers.get(request_id)
        if buf is None or not buf.extends_to(token_ids):
            buf = self._buffers[request_id] = _TokenBuffer(token_ids)
            self._indexes.pop(request_id, None)  # it indexed the tokens this replaces
        else:
            buf.sync(token_ids)
        return buf.data[: buf.length]

    def release(self, request_id: str) -> None:
        self._buffers.pop(request_id, None)
        self._indexes.pop(request_id, None)
