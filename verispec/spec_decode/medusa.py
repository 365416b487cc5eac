"""MedusaDrafter: drafts with Medusa heads (spec_decode/heads.py) over the target's hidden states.

For a request whose newest token x_n sits at position n, the newest known feature is f_{n-1}
(the verify pass that emitted x_n computed it): head k reads it and gives q_k for x_{n+k}, so
K drafts cost one pass of K small heads, with no cache to keep. Draft k is sampled from q_k
as spec_decode/draft_sampling.py describes (sample_from_draft_vocab; its penalty history holds drafts
1..k-1, as the verifier's does); q_k does not otherwise depend on the earlier drafts, which the
verifier allows: it needs only the distribution each draft was drawn from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

import torch

from ..config import DraftCost, DynamicTree
from .base import DraftBatch, Drafter, DraftRequest, FedTokens
from .draft_sampling import draft_metadata, grow_tree_batch, sample_from_draft_vocab
from .features import FeatureStore
from .heads import MedusaHeads
from .trees import GrownTree, TreeBatch, TreeShape


# One call: `depth` residual blocks and one product with the restricted LM head (8192 of the
# target's 49152 rows), over depth rows per request, plus each request's features and sampling
# metadata. The embedded model on CPU, in units of the target step's fixed cost (measured with
# bench/draft_cost.py): 0.05 for one request at depth 1, 0.07 at depth 4, 0.21 for 12 at depth 4.
# Against the 4-bit target's step: 0.25 for one request at depth 1, 0.31 at depth 4.
MEDUSA_COST = DraftCost(per_call=0.037, per_request=0.0046, per_position=0.0047, per_row=0.0021)
MEDUSA_COST_QUANTIZED = DraftCost(per_call=0.25, per_request=0.004, per_position=0.003, per_row=0.011)


class MedusaDrafter(Drafter):
    """cost: what a call costs relative to the target's step (MEDUSA_COST for a float target,
    MEDUSA_COST_QUANTIZED for a quantized one)."""

    drafts_over_holes = True  # it reads the newest token's predecessor's feature alone

    def __init__(self, heads: MedusaHeads, cost: DraftCost = MEDUSA_COST) -> None:
        self.heads, self.cost = heads, cost
        self.hidden_layers = heads.config.hidden_layers
        self.store = FeatureStore()

    def draft_cost(self, depth: int, num_requests: int) -> float:
        return self.cost(min(depth, len(self.heads.blocks)), num_requests)

    def observe(self, fed: Sequence[FedTokens], hidden: torch.Tensor) -> None:  # hidden: [T, d]
        self.store.observe(fed, hidden)

    def restorable_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        # Only the newest token's feature is read, and the target always computes a prompt's last token.
        return len(token_ids)

    def release(self, request_id: str) -> None:
        self.store.release(request_id)

    def _features(self, requests: Sequence[DraftRequest]) -> tuple[list[int], torch.Tensor | None]:
        """The requests that draft (those asking for drafts whose newest feature is known), and
        those features ([len(active), d]; None when none drafts)."""
        active, features = [], []
        for i, request in enumerate(requests):
            rid, newest = request.request_id, len(request.token_ids) - 1
            self.store.confirm(rid, request.token_ids)
            if request.num_draft_tokens == 0 or not self.store.known(rid, newest - 1):
                continue
            features.append(self.store.features(rid, newest - 1, newest))
            self.store.drop_before(rid, newest - 1)
            active.append(i)
        return active, torch.cat(features) if features else None

    @torch.inference_mode()
    def propose_tree(self, requests: Sequence[DraftRequest], shape: TreeShape,
                     exclude: Sequence[Collection[int]] | None = None) -> TreeBatch:
        """Trees grown from the heads (spec_decode/trees.py): every node at depth k takes its children
        from head k + 1, as in Medusa's static trees (a dynamic tree ranks them by the heads'
        confidence); no deeper than there are heads; top-k for greedy requests, drawn without
        replacement for sampled ones."""
        active, features = self._features(requests)
        if features is None:
            return TreeBatch.empty(len(requests))
        depth = len(self.heads.blocks)
        shape = dataclasses.replace(shape, depth=min(shape.depth, depth)) \
            if isinstance(shape, DynamicTree) else shape[:depth]
        levels = shape.depth if isinstance(shape, DynamicTree) else len(shape)
        logits = self.heads(self.heads.features(features), levels)  # [levels, R, N]

        def expand(trees: list[GrownTree], nodes: list[list[int]]) -> torch.Tensor:  # [rows, N]
            return torch.stack([logits[trees[r].depths[j], r] for r, chosen in enumerate(nodes) for j in chosen])

        return grow_tree_batch(requests, active, shape, logits[0], self.heads.draft_vocab,
                               self.heads.config.target_vocab_size, expand, exclude)

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> DraftBatch:
        drafts: list[list[int]] = [[] for _ in requests]
        rows: list[list[torch.Tensor]] = [[] for _ in requests]
        active, features = self._features(requests)
        if features is None:
            return DraftBatch(drafts)
        device = features.device
        sampling = draft_metadata(requests, device)
        depth = max(requests[i].num_draft_tokens for i in active)
        logits = self.heads(self.heads.features(features), depth)  # [min(depth, heads), R, N]
        slot = {i: r for r, i in enumerate(active)}  # request -> its row in `logits`
        for k in range(logits.shape[0]):
            active = [i for i in active if requests[i].num_draft_tokens > k]
            if not active:
                break
            picked = logits[k].index_select(0, torch.tensor([slot[i] for i in active], device=device))
            tokens, q, usable = sample_from_draft_vocab(
                sampling, active, [drafts[i] for i in active], picked, self.heads.draft_vocab,
                self.heads.config.target_vocab_size, k)
            for r, (i, token) in enumerate(zip(active, tokens)):
                if usable[r]:
                    drafts[i].append(token)
                    if q is not None:
                        rows[i].append(q[r])
            active = [i for i, ok in zip(active, usable) if ok]
        flat = [q for per_request in rows for q in per_request]
        return DraftBatch(drafts, torch.stack(flat) if flat else None)
