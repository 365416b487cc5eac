"""DraftModelDrafter: proposals from a smaller model that shares the target's tokenizer.

Terms: the drafter's *cache* holds K/V for a prefix of each request's tokens (its *cached*
tokens). Each call rolls the cache back to the longest prefix it shares with the request's
current tokens (keep-and-rollback: rejected drafts are truncated, the accepted prefix is kept,
nothing is rebuilt), feeds the rest, then drafts K tokens one forward pass at a time, batched
over requests, each sampled from q as spec_decode/draft_sampling.py describes; q is handed to the
verifier, so the output is exact.

A request's cache slots for the whole step (its new tokens and its K - 1 fed drafts) are
reserved before drafting, so it drafts all K or, when the cache has no room, none. Batch-
invariant requests (DraftRequest.batch_invariant) are served first and may evict the cache of
any other request (which only costs that request a re-prefill, since the cache is a cache): so
whether they draft does not depend on what else is in the batch, as long as the batch's
batch-invariant requests fit the cache together.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..config import DraftCost
from ..runtime.kv_cache import BlockManager
from ..runtime.runner import Feed, ModelRunner
from ..model import LlamaModel
from .base import DraftBatch, Drafter, DraftRequest
from .draft_sampling import draft_metadata, sample_drafts


def draft_model_cost(draft: LlamaModel, target: LlamaModel, row_cost: float) -> DraftCost:
    """A draft model's cost relative to its target's: decoding reads the weights, so a draft
    pass's fixed cost is the target's scaled by the ratio of their weights' bytes (an int4 copy
    of a float32 target costs about a seventh of it), and so is each row's (row_cost,
    SpeculativeConfig). One pass per draft position."""
    ratio = draft.weight_bytes() / target.weight_bytes()
    return DraftCost(per_position=ratio, per_row=ratio * row_cost)


class DraftModelDrafter(Drafter):
    """cost: what a call costs (Drafter.draft_cost), e.g. draft_model_cost(model, target, ...);
    free by default."""

    def __init__(self, model: LlamaModel, num_blocks: int = 1024, block_size: int = 16,
                 cost: DraftCost = DraftCost()) -> None:
        self.model = model
        self.blocks = BlockManager(num_blocks, block_size, window=model.config.cache_window)
        self.runner = ModelRunner(model, self.blocks)
        self.cost = cost
        self._cached: dict[str, list[int]] = {}

    def draft_cost(self, depth: int, num_requests: int) -> float:
        return self.cost(depth, num_requests)

    def release(self, request_id: str) -> None:
        self.blocks.free(request_id)
        self._cached.pop(request_id, None)

    def propose(self, requests: Sequence[DraftRequest]) -> DraftBatch:
        drafts: list[list[int]] = [[] for _ in requests]
        rows: list[list[torch.Tensor]] = [[] for _ in requests]
        protected = {r.request_id for r in requests if r.batch_invariant}
        # Batch-invariant requests first, so that the others get only what they leave.
        order = sorted(range(len(requests)), key=lambda i: not requests[i].batch_invariant)
        synced = {i for i in order if requests[i].num_draft_tokens > 0 and self._sync(requests[i], protected)}
        active = sorted(synced)
        pending = {i: list(requests[i].token_ids[len(self._cached[requests[i].request_id]) :]) for i in active}
        sampling = None
        if active:
            sampling = draft_metadata(requests, self.runner.device)
        position = 0
        while active:
            feeds = []
            for i in active:
                cached = self._cached[requests[i].request_id]
                feeds.append(Feed(requests[i].request_id, pending[i], len(cached), 1))
                cached.extend(pending[i])
            tokens, probs = sample_drafts(sampling, active, [drafts[i] for i in active],
                                          self.runner.forward(feeds), position)
            position += 1
            still = []
            for j, (i, token) in enumerate(zip(active, tokens)):
                drafts[i].append(token)
                if probs is not None:  # None: greedy drafts (sample_drafts)
                    rows[i].append(probs[j])
                # The next round feeds this draft token (its slot reserved by _sync); the last
                # round's draft is never fed.
                if requests[i].num_draft_tokens > position:
                    pending[i] = [token]
                    still.append(i)
            active = still
        flat = [q for per_request in rows for q in per_request]
        return DraftBatch(drafts, torch.stack(flat) if flat else None)

    def _sync(self, request: DraftRequest, protected: set[str]) -> bool:
        """Rolls the cache back to the shared prefix and reserves slots for the new tokens and
        the K - 1 drafts fed after them; False (and no cache kept) when the draft cache has no
        room: the request then gets no drafts this step, which costs speed, never exactness. A
        batch-invariant request first evicts the caches of requests not in `protected`."""
        rid, tokens = request.request_id, request.token_ids
        cached = self._cached.get(rid)
        if cached is None:
            self.blocks.allocate(rid, 0)
            cached = self._cached[rid] = []
        keep = 0
        limit = min(len(cached), len(tokens) - 1)  # the newest token is always fed for its logits
        while keep < limit and cached[keep] == tokens[keep]:
            keep += 1
        self.blocks.truncate(rid, len(cached) - keep)
        # Later calls keep at least this prefix (the request's tokens only grow), so what lies
        # behind the window of position `keep` is never read again.
        self.blocks.release_behind(rid, keep)
        del cached[keep:]
        needed = len(tokens) - keep + request.num_draft_tokens - 1
        if request.batch_invariant:
            for other in [o for o in self._cached if o not in protected]:
                if self.blocks.can_append(rid, needed):
                    break
                self.release(other)
        if not self.blocks.can_append(rid, needed):
            self.release(rid)
            return False
        self.blocks.append(rid, needed)
        return True
