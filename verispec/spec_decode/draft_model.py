"""DraftModelDrafter: proposals from a smaller model that shares the target's tokenizer.

Terms: the drafter's *cache* holds K/V for a prefix of each request's tokens (its *cached*
tokens). Each call rolls the cache back to the longest prefix it shares with the request's
current tokens (keep-and-rollback: rejected drafts are truncated, the accepted prefix is kept,
nothing is rebuilt), feeds the rest, then drafts K tokens one forward pass at a time, batched
over requests, each sampled from q as spec_decode/draft_sampling.py describes; q is handed to the
verifier, so the output is exact.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..config import DraftCost
from ..engine.kv_cache import BlockManager
from ..engine.runner import Feed, ModelRunner
from ..model import LlamaModel
from .base import DraftBatch, Drafter, DraftRequest
from .draft_sampling import draft_metadata, sample_drafts


def draft_model_cost(draft: LlamaModel, target: LlamaModel, row_cost: float) -> DraftCost:
    """A draft model's cost relative to its target's: decoding reads the weights, so a draft
    pass's fixed cost is the target's scaled by the ratio of their parameter counts, and so is
    each row's (row_cost, SpeculativeConfig). One pass per draft position."""
    ratio = sum(p.numel() for p in draft.parameters()) / sum(p.numel() for p in target.parameters())
    return DraftCost(per_position=ratio, per_row=ratio * row_cost)


class DraftModelDrafter(Drafter):
    """cost: what a call costs (Drafter.draft_cost), e.g. draft_model_cost(model, target, ...);
    free by default."""

    def __init__(self, model: LlamaModel, num_blocks: int = 1024, block_size: int = 16,
                 cost: DraftCost = DraftCost()) -> None:
        self.model = model
        self.blocks = BlockManager(num_blocks, block_size)
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
        active = [i for i, r in enumerate(requests) if r.num_draft_tokens > 0 and self._sync(r)]
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
            for i, token, q in zip(active, tokens, probs):
                drafts[i].append(token)
                rows[i].append(q)
                # The next round feeds this draft token; the last round's draft is never fed.
                rid = requests[i].request_id
                if requests[i].num_draft_tokens > position and self.blocks.can_append(rid, 1):
                    self.blocks.append(rid, 1)
                    pending[i] = [token]
                    still.append(i)
            active = still
        flat = [q for per_request in rows for q in per_request]
        return DraftBatch(drafts, torch.stack(flat) if flat else None)

    def _sync(self, request: DraftRequest) -> bool:
        """Rolls the cache back to the shared prefix and reserves slots for the new tokens;
        False (and no cache kept) when the draft cache has no room: the request then gets no
        drafts this step, which costs speed, never exactness."""
        rid, tokens = request.request_id, request.token_ids
        cached = self._cached.get(rid)
        if cached is None:
            if not self.blocks.can_allocate(rid, 0):
                return False
            self.blocks.allocate(rid, 0)
            cached = self._cached[rid] = []
        keep = 0
        limit = min(len(cached), len(tokens) - 1)  # the newest token is always fed for its logits
        while keep < limit and cached[keep] == tokens[keep]:
            keep += 1
        self.blocks.truncate(rid, len(cached) - keep)
        del cached[keep:]
        if not self.blocks.can_append(rid, len(tokens) - keep):
            self.release(rid)
            return False
        self.blocks.append(rid, len(tokens) - keep)
        return True
