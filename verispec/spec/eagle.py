"""EagleDrafter: drafts with an EAGLE head (spec/heads.py) over the target's hidden states.

Terms: the head's *cache* is a paged KV cache of its own (one layer); head position t holds
the input (f_t, x_{t+1}). A request's *confirmed* head positions were fed true target
features of tokens the request has emitted, so they never roll back; positions fed while
drafting (predicted features, draft tokens) are rolled back at the next call
(keep-and-rollback, as DraftModelDrafter does).

One call, for a request whose newest token x_n sits at position n:
1. confirm the stored features against the request's tokens; the head needs f_h .. f_{n-1},
   h being its confirmed positions (the verify pass of the last step supplied the features of
   the accepted drafts; the newest token's feature is not known yet);
2. feed (f_t, x_{t+1}) for t = h .. n-1; the last row predicts f_n, whose logits give q_1;
3. draft token i + 1 feeds (predicted f_{n+i}, x_{n+i} = draft i) at position n + i.
Drafts are sampled from q as spec/draft_sampling.py describes (sample_from_draft_vocab),
batched over requests, one head pass per draft position. A request without the features it needs (its drafter state
was dropped mid-request, or a step drafted before its prompt's features arrived) gets no
drafts this step: that costs speed, never exactness.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..engine.kv_cache import BlockManager
from ..engine.runner import Feed, ModelRunner
from .base import DraftBatch, Drafter, DraftRequest, FedTokens
from .draft_sampling import draft_metadata, sample_from_draft_vocab
from .features import FeatureStore
from .heads import EagleHead


class EagleDrafter(Drafter):
    def __init__(self, head: EagleHead, num_blocks: int = 1024, block_size: int = 16) -> None:
        self.head = head
        self.hidden_layers = (head.config.target_num_layers,)
        self.blocks = BlockManager(num_blocks, block_size)
        self.runner = ModelRunner(head, self.blocks)
        self.store = FeatureStore()
        self._confirmed: dict[str, int] = {}  # head positions fed true features, per request

    def draft_cost(self, depth: int, num_requests: int) -> float:
        """One head pass per draft position (the first also feeds the newly confirmed
        features): the EAGLE layer and the restricted LM head, 0.09 of the target step's fixed
        cost, plus 0.011 per drafting request (the embedded model on CPU, measured with
        bench/draft_cost.py; verispec.config.DraftCost(per_position=0.09, per_row=0.011))."""
        return depth * (0.09 + 0.011 * num_requests) if num_requests > 0 else 0.0

    def observe(self, fed: Sequence[FedTokens], hidden: torch.Tensor) -> None:  # hidden: [T, d]
        self.store.observe(fed, hidden)

    def release(self, request_id: str) -> None:
        self.store.release(request_id)
        self.blocks.free(request_id)
        self._confirmed.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> DraftBatch:
        drafts: list[list[int]] = [[] for _ in requests]
        rows: list[list[torch.Tensor]] = [[] for _ in requests]
        feeds: list[Feed] = []
        features: list[torch.Tensor] = []
        active: list[int] = []
        for i, request in enumerate(requests):
            synced = self._sync(request) if request.num_draft_tokens > 0 else None
            if synced is not None:
                feeds.append(synced[0])
                features.append(synced[1])
                active.append(i)
        if not active:
            return DraftBatch(drafts)
        sampling = draft_metadata(requests, self.runner.device)
        position = 0
        while active:
            step = self.runner.inputs(feeds)
            predicted = self.head(torch.cat(features), step.input_ids, step.positions, step.attn,
                                  self.runner.kv_caches).index_select(0, step.logits_rows)
            tokens, q, usable = sample_from_draft_vocab(
                sampling, active, [drafts[i] for i in active], self.head.logits(predicted),
                self.head.draft_vocab, self.head.config.target_vocab_size, position)
            position += 1
            still, feeds, features = [], [], []
            for r, (i, token) in enumerate(zip(active, tokens)):
                if not usable[r]:
                    continue
                drafts[i].append(token)
                if q is not None:
                    rows[i].append(q[r])
                if requests[i].num_draft_tokens > position:
                    rid = requests[i].request_id
                    start = len(requests[i].token_ids) - 1 + position - 1
                    feeds.append(Feed(rid, [token], start, 1))
                    features.append(predicted[r : r + 1])
                    still.append(i)
            active = still
        flat = [q for per_request in rows for q in per_request]
        return DraftBatch(drafts, torch.stack(flat) if flat else None)

    def _sync(self, request: DraftRequest) -> tuple[Feed, torch.Tensor] | None:
        """Rolls the head's cache back to its confirmed positions and returns the feed of the
        newly confirmed ones with their features ([rows, d]); reserves the slots of the
        drafting rounds. None when the request cannot draft this step."""
        rid, tokens = request.request_id, request.token_ids
        newest = len(tokens) - 1
        start, end = self.store.confirm(rid, tokens)
        confirmed = self._confirmed.get(rid, 0)
        if newest <= confirmed or start > confirmed or end < newest:
            return None
        if not self.blocks.has(rid):
            if not self.blocks.can_allocate(rid, 0):
                return None
            self.blocks.allocate(rid, 0)
        self.blocks.truncate(rid, self.blocks.num_tokens(rid) - confirmed)
        # Rows for the new confirmed positions, then one per drafting round after the first.
        needed = newest - confirmed + request.num_draft_tokens - 1
        if not self.blocks.can_append(rid, needed):
            self.release(rid)
            return None
        self.blocks.append(rid, needed)
        features = self.head.normalize(self.store.features(rid, confirmed, newest))
        self._confirmed[rid] = newest
        self.store.drop_before(rid, newest)
        return Feed(rid, list(tokens[confirmed + 1 :]), confirmed, 1), features
