"""EagleDrafter: drafts with an EAGLE head (spec_decode/heads.py) over the target's hidden states.

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
Drafts are sampled from q as spec_decode/draft_sampling.py describes (sample_from_draft_vocab),
batched over requests, one head pass per draft position.

Trees (propose_tree): after step 2, each level of the tree (spec_decode/trees.py grow_trees) is one
head pass over the nodes to expand and their ancestors, fed as a tree at positions n, n + 1, ...
by depth (tree attention: a node sees the confirmed positions and its own path); a node is fed
(its parent's predicted feature, its token), and its output gives its children's logits. Each
level overwrites the cache slots of the last, so drafting leaves only confirmed positions. A
request without the feature of its newest token's predecessor (its drafter state was dropped
mid-request, or the engine captured no hidden states in the last pass) gets no drafts this
step; positions in a hole of its features (spec_decode/features.py) are fed with a zero feature,
which the head reads as "no feature". Either costs speed, never exactness.

Prefix caching (verispec/runtime/prefix_cache.py): the target takes a prompt's cached prefix
without feeding it, so its features never arrive; the head therefore keeps a prefix cache of
its own, and the target skips only what the head has (`restorable_prefix`). Head position t
holds (f_t, x_{t+1}), a function of the head, the target and x_0 .. x_{t+1}, so a head block's
chain runs over x_1, x_2, ... from a root derived from x_0. `restorable_prefix` maps the head's
longest cached prefix into the request's head cache at once (as confirmed positions), leaving
at least one position to feed; a call publishes the full blocks of the positions confirmed by
earlier calls (those were written: a call that raised has its request released), up to the
request's first hole (a zero feature is not the head's input for those tokens). The engine may
let the target take more of its cache than the head has (LLMEngine): the rest is a hole.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from ..config import DraftCost, DynamicTree
from ..runtime.kv_cache import BlockManager
from ..runtime.prefix_cache import block_hash, extend_chain, identity_key
from ..runtime.runner import Feed, ModelRunner
from .base import DraftBatch, Drafter, DraftRequest, FedTokens
from .chain_inputs import chain_inputs
from ..sample import SamplingMetadata
from ..sample.rng import DRAFT, uniform
from .draft_sampling import draft_metadata, grow_tree_batch, sample_from_draft_vocab, widen_probs
from .features import FeatureStore
from .heads import EagleHead
from .trees import GrownTree, TreeBatch, TreeShape


# One head pass per draft position (the first also feeds the newly confirmed features): the
# EAGLE layer and the restricted LM head, 0.09 of the target step's fixed cost, plus 0.011 per
# drafting request (the embedded model on CPU, measured with bench/draft_cost.py). Against the
# 4-bit target's step, about 8x cheaper, the quantized head costs more: pass by pass from Python
# (what a request with penalties, a bias or a grammar still gets) 0.51 of the step at depth 1 and
# 1.17 at depth 4 on an Intel Xeon with AVX-512 VNNI (2026-11-27, int8 head), 0.58 and 1.54 on an
# AVX2 AMD EPYC. Greedy and plain sampled requests draft in one compiled call (EagleHead.chain_drafts,
# 4-bit head) with its inputs built in one tensor (spec_decode/chain_inputs.py), the prices
# declared here: 0.155 of a step at depth 1 and 0.207 at depth 2 for one request on an AVX-512
# Xeon without VNNI (Skylake-SP, 2026-11-28: 1.22 / 1.63 ms against a 7.9 ms step; 0.235 / 0.29
# before the inputs were built in one tensor, and 0.55 for 8 requests at depth 1).
# The engine learns the machine's own prices from these (spec_decode/step_costs.py).
EAGLE_COST = DraftCost(per_position=0.09, per_row=0.011)
EAGLE_COST_QUANTIZED = DraftCost(per_call=0.08, per_request=0.025, per_position=0.03, per_row=0.02)
# How often the target takes a head's first draft before any is judged: the shipped head's on the
# issue-46 prompt classes (1.43 tokens per step at K = 1, greedy, 4-bit target, 2026-11-28).
# Beside the adaptive K's generic 0.3, which is below the head's break-even on the 4-bit target
# (~0.4 at batch 1), no request drafted long enough to show that K = 1 paid (1.09x no drafts).
HEAD_PRIOR = 0.43


class EagleDrafter(Drafter):
    """prefix_caching: keep the head's own prefix cache (module docstring); off, the target
    computes every prompt token of a request this drafter serves. One drafter serves one target.
    cost: what a call costs relative to the target's step (EAGLE_COST for a float target,
    EAGLE_COST_QUANTIZED for a quantized one)."""

    drafts_over_holes = True
    # One class, so that the adaptive K learns the head's acceptance from all requests' drafts
    # and a new request starts from it (spec_decode/adaptive.py), not from one probe of its own.
    class_priors = (HEAD_PRIOR,)

    def __init__(self, head: EagleHead, num_blocks: int = 1024, block_size: int = 16,
                 prefix_caching: bool = True, cost: DraftCost = EAGLE_COST) -> None:
        self.head, self.cost = head, cost
        self.hidden_layers = head.config.hidden_layers
        identity = identity_key("eagle", head.config, next(head.parameters()).dtype) if prefix_caching else None
        self.blocks = BlockManager(num_blocks, block_size, prefix_root=identity)
        self.runner = ModelRunner(head, self.blocks)
        self.store = FeatureStore()
        self._confirmed: dict[str, int] = {}  # head positions fed true features, per request
        self._hashes: dict[str, list[bytes]] = {}  # per request, the chain of its head blocks
        self._holes: dict[str, int] = {}  # per request, the first head position fed a zero feature
        self._greedy: dict[tuple[int, int], tuple] = {}  # (requests, depth) -> _greedy_filters

    def draft_cost(self, depth: int, num_requests: int) -> float:
        return self.cost(depth, num_requests)

    def observe(self, fed: Sequence[FedTokens], hidden: torch.Tensor) -> None:  # hidden: [T, d]
        self.store.observe(fed, hidden)

    def release(self, request_id: str) -> None:
        self.store.release(request_id)
        self.blocks.free(request_id)
        self._confirmed.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._holes.pop(request_id, None)

    def restorable_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        if self.blocks.prefix is None:
            return 0
        self.release(request_id)  # what an earlier, unsuccessful admission mapped
        # One position at least is left to feed: its row predicts the newest token's feature.
        root, hashes = self._chain(request_id, token_ids, len(token_ids) - 2)
        hit = self.blocks.cached_prefix(hashes, token_ids[1:], root)
        if not self.blocks.can_allocate(request_id, 0, hit):
            return 0
        self.blocks.allocate(request_id, 0, cached=hit)
        self._confirmed[request_id] = self.blocks.num_tokens(request_id)
        return self._confirmed[request_id]

    def _chain(self, request_id: str, token_ids: Sequence[int], num_positions: int) -> tuple[bytes, list[bytes]]:
        """(root, chain hashes of the head blocks full within the first `num_positions` positions)."""
        root = block_hash(self.blocks.prefix.root, token_ids[:1])
        size = self.blocks.block_size
        hashes = extend_chain(self._hashes.setdefault(request_id, []), root, token_ids[1:], size, max(0, num_positions))
        return root, hashes[: max(0, num_positions) // size]

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> DraftBatch:
        drafts: list[list[int]] = [[] for _ in requests]
        rows: list[list[torch.Tensor]] = [[] for _ in requests]
        feeds, hidden, active = self._start(requests, lambda r: r.num_draft_tokens - 1)
        if not active:
            return DraftBatch(drafts)
        sampling = draft_metadata(requests, self.runner.device)
        if self.head.drafts_in_one_call and (sampling is None or (sampling.adjustments is None
                                                                  and sampling.grammars is None)):
            return self._chains(requests, active, feeds, torch.cat(hidden), sampling)
        step = self.runner.inputs(feeds)
        fed = self.head.features(torch.cat(hidden))
        position = 0
        while active:
            outputs = self.head(fed, step.input_ids, step.positions, step.attn, self.runner.kv_caches)
            tokens, q, usable = sample_from_draft_vocab(
                sampling, active, [drafts[i] for i in active], self.head.row_logits(outputs, step.logits_rows),
                self.head.draft_vocab, self.head.config.target_vocab_size, position)
            position += 1
            still, feeds, kept = [], [], []
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
                    kept.append(r)
                    still.append(i)
            active = still
            if active:
                # Each drafting request's predicted feature: its row among the logit rows.
                rows_kept = step.logits_rows if len(kept) == len(step.logits_rows) else step.logits_rows[kept]
                fed = outputs.index_select(0, rows_kept)
                step = self.runner.chain_inputs(feeds)
        flat = [q for per_request in rows for q in per_request]
        return DraftBatch(drafts, torch.stack(flat) if flat else None)

    def _chains(self, requests: Sequence[DraftRequest], active: list[int], feeds: list[Feed],
                hidden: torch.Tensor,  # [T, n * d] the first pass's stored hidden states
                sampling: SamplingMetadata | None,  # draft_metadata's: no penalties, bias, masks or grammar
                ) -> DraftBatch:
        """propose's drafts in one compiled call (EagleHead.chain_drafts): the first pass over
        `feeds`, then draft position s of request r at its newest token's position + s - 1, in
        the slots _sync reserved; a sampled request draws its draft at position s with the DRAFT
        stream's uniform at s, as the passes would (sample_from_draft_vocab)."""
        inputs = chain_inputs(self.blocks, feeds, [requests[i].num_draft_tokens for i in active])
        count, depth = len(active), max(inputs.depths)
        if sampling is None:
            filters, uniforms = self._greedy_filters(count, depth)
        else:
            rows = torch.tensor(active, dtype=torch.int64, device=sampling.keys.device)
            filters = tuple(f[rows].cpu() for f in (sampling.temperature, sampling.top_k, sampling.top_p,
                                                    sampling.min_p))
            draws = torch.arange(depth, device=rows.device).repeat(count)
            uniforms = uniform(sampling.keys[rows].repeat_interleave(depth), draws, DRAFT).view(count, depth).cpu()
        chains, q = self.head.chain_drafts(hidden, inputs, self.runner.kv_caches, filters, uniforms)
        drafts: list[list[int]] = [[] for _ in requests]
        for i, chain in zip(active, chains):
            drafts[i] = chain
        if q is None:
            return DraftBatch(drafts)
        drawn = torch.cat([q[r, :d] for r, d in enumerate(inputs.depths)])  # [drafts, N], request by request
        return DraftBatch(drafts, widen_probs(drawn, self.head.draft_vocab, self.head.config.target_vocab_size))

    def _greedy_filters(self, count: int, depth: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """chain_drafts's filters and uniforms for `count` greedy requests (never written: kept)."""
        if (count, depth) not in self._greedy:
            self._greedy[count, depth] = ((torch.zeros(count), torch.zeros(count, dtype=torch.int64),
                                           torch.ones(count), torch.zeros(count)),
                                          torch.zeros(count, depth, dtype=torch.float64))
        return self._greedy[count, depth]

    @torch.inference_mode()
    def propose_tree(self, requests: Sequence[DraftRequest], shape: TreeShape,
                     exclude: Sequence[Collection[int]] | None = None) -> TreeBatch:
        """Trees grown from the head (module docstring): top-k for greedy requests, children
        drawn without replacement for sampled ones (spec_decode/trees.py)."""
        # The most nodes a level feeds: a static tree's whole budget at most.
        fed_rows = shape.max_fed_nodes() if isinstance(shape, DynamicTree) else None
        feeds, hidden, active = self._start(requests, lambda r: fed_rows or r.num_draft_tokens)
        if not active:
            return TreeBatch.empty(len(requests))
        step = self.runner.inputs(feeds)
        roots = self.head(self.head.features(torch.cat(hidden)), step.input_ids, step.positions, step.attn,
                          self.runner.kv_caches).index_select(0, step.logits_rows)  # [R, d]
        # Per active request: the predicted feature each expanded node hands its children (-1: the root's).
        outputs: list[dict[int, torch.Tensor]] = [{-1: roots[r]} for r in range(len(active))]

        def expand(trees: list[GrownTree], nodes: list[list[int]]) -> torch.Tensor:  # [rows, N]
            level_feeds, level_features, picked, base = [], [], [], 0
            for r, chosen in enumerate(nodes):
                if not chosen:
                    continue
                tree = trees[r]
                fed = sorted({a for j in chosen for a in tree.path(j)})  # parents before children
                index = {j: k for k, j in enumerate(fed)}
                level_feeds.append(Feed(requests[active[r]].request_id, [tree.token_ids[j] for j in fed],
                                        len(requests[active[r]].token_ids) - 1, 0,
                                        [index.get(tree.parents[j], -1) for j in fed]))
                level_features.extend(outputs[r][tree.parents[j]] for j in fed)
                picked.extend((r, j, base + index[j]) for j in chosen)
                base += len(fed)
            step = self.runner.inputs(level_feeds)
            predicted = self.head(torch.stack(level_features), step.input_ids, step.positions, step.attn,
                                  self.runner.kv_caches)
            for r, j, row in picked:
                outputs[r][j] = predicted[row]
            return self.head.logits(predicted[torch.tensor([row for _, _, row in picked], device=predicted.device)])

        return grow_tree_batch(requests, active, shape, self.head.logits(roots), self.head.draft_vocab,
                               self.head.config.target_vocab_size, expand, exclude)

    @torch.inference_mode()
    def absorb(self, requests: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Feeds the head the positions of each (request id, token ids) whose features it holds,
        without drafting, and publishes their blocks: a request at K = 0 whose prompt was just
        computed, so that the prompt's head blocks are cached for the next request that sends
        it (and its first probe has nothing to catch up on)."""
        synced = [s for rid, tokens in requests if (s := self._sync(rid, tokens, 0)) is not None]
        if not synced:
            return
        step = self.runner.inputs([feed for feed, _ in synced])
        self.head(self.head.features(torch.cat([hidden for _, hidden in synced])), step.input_ids, step.positions, step.attn,
                  self.runner.kv_caches)
        for rid, tokens in requests:
            self._publish(rid, tokens)

    def _start(self, requests: Sequence[DraftRequest], draft_rows: Callable[[DraftRequest], int],
               ) -> tuple[list[Feed], list[torch.Tensor], list[int]]:
        """The first head pass's feeds and their stored hidden states ([rows, n * d] each), for
        the requests that draft this step (their indices); `draft_rows` of a request: the slots
        its drafting needs after the confirmed positions."""
        feeds, hidden, active = [], [], []
        for i, request in enumerate(requests):
            synced = self._sync(request.request_id, request.token_ids, draft_rows(request)) \
                if request.num_draft_tokens > 0 else None
            if synced is not None:
                feeds.append(synced[0])
                hidden.append(synced[1])
                active.append(i)
        return feeds, hidden, active

    def _publish(self, rid: str, tokens: Sequence[int]) -> None:
        """Publishes the head blocks of the request's confirmed positions up to its first hole."""
        if self.blocks.prefix is not None and self.blocks.has(rid):
            confirmed = self._confirmed.get(rid, 0)
            root, hashes = self._chain(rid, tokens, min(confirmed, self._holes.get(rid, confirmed)))
            self.blocks.publish(rid, hashes, tokens[1:], root)

    def _sync(self, rid: str, tokens: Sequence[int], draft_rows: int) -> tuple[Feed, torch.Tensor] | None:
        """Rolls the head's cache back to its confirmed positions and returns the feed of the
        newly confirmed ones with their stored hidden states ([rows, n * d], the head's features
        of them: EagleHead.features); reserves `draft_rows` slots after them for drafting. None
        when the request cannot draft this step."""
        newest = len(tokens) - 1
        self.store.confirm(rid, tokens)
        confirmed = self._confirmed.get(rid, 0)
        self._publish(rid, tokens)
        # Without f_{n-1} the first draft would come from a zero feature, near random.
        if newest <= confirmed or not self.store.known(rid, newest - 1):
            return None
        if not self.blocks.has(rid):
            if not self.blocks.can_allocate(rid, 0):
                return None
            self.blocks.allocate(rid, 0)
        self.blocks.truncate(rid, self.blocks.num_tokens(rid) - confirmed)
        needed = newest - confirmed + draft_rows
        if not self.blocks.can_append(rid, needed):
            self.release(rid)
            return None
        self.blocks.append(rid, needed)
        hole = self.store.first_hole(rid, confirmed, newest)
        if hole is not None:
            self._holes.setdefault(rid, hole)
        hidden = self.store.features(rid, confirmed, newest)
        self._confirmed[rid] = newest
        self.store.drop_before(rid, newest)
        return Feed(rid, list(tokens[confirmed + 1 :]), confirmed, 1), hidden
