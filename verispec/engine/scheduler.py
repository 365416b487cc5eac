"""Continuous batching: which requests run in the next step, how many tokens each feeds.

Plain Python over the BlockManager. Each step:
1. running requests, oldest first, get their pending tokens (+ K draft slots when they sample);
   when the cache is full, the newest running request is preempted (its blocks freed, to be
   recomputed later) rather than failing anyone;
2. waiting requests are admitted while the token budget, the sequence limit and the cache
   allow, unless this step had to preempt (admitting would only thrash). Admission is fair
   across groups (Request.group, e.g. one server request's n x prompts): the next admitted is
   the oldest waiting request of the group with the fewest running requests, so a request that
   fans out into thousands of sequences takes turns with later ones instead of queueing them
   all behind it. Requests without a group are each their own: admission in arrival order.
With prefix caching (runtime/kv_cache.py), an admitted sequence starts from the cached blocks of its
longest cached prefix and computes the rest; its last token is never taken from the cache,
since its row must be fed to give logits (vLLM does the same). Full blocks of committed tokens
are published after every step, and before a request's blocks are freed (finished or
preempted), so a preempted request usually finds its own prefix again.
With a sliding-window cache (BlockManager.window), each commit then releases the blocks behind
the window of the sequence's next query, so a sequence holds about its window plus one step's
tokens, and a request is refused only when that does not fit the cache.
A prompt longer than the remaining budget is prefilled in chunks. A chunk never completes a
sequence unless the request samples in that step, so the row of its last pending token is
always fed together with its drafts. A CFG request's two sequences move as one unit: their
chunks are planned together from one budget, and a sequence with nothing to feed in a step
(its prefill done, or only its last token left) feeds nothing rather than an empty chunk.

K per step: a request's K is capped by its remaining tokens and by what one step can ever hold
(K + 1 rows per sequence within max_num_batched_tokens), both facts about the request alone.
Greedy and unseeded requests then give up drafts to fit the budget left by older requests; a
batch-invariant request (Request.batch_invariant) never does: it samples with its full K or
not at all in that step (it may still feed a prefill chunk), since a trimmed K would change
which random numbers it consumes. It waits only for older requests (running requests are served
oldest first), so it waits at most until they finish.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..config import EngineConfig
from ..runtime.kv_cache import BlockManager
from ..runtime.prefix_cache import PrefixCacheStats, extend_chain
from .request import FinishReason, Request, RequestStatus, Sequence

logger = logging.getLogger(__name__)


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    num_new: per sequence (conditional first), pending tokens fed this step.
    num_draft_slots: K, the draft tokens it may verify this step (slots are reserved for them in
        every sequence); 0 when it does not speculate or does not sample.
    samples: whether its last pending token is fed, so that it emits tokens this step.
    """

    request: Request
    num_new: list[int]
    num_draft_slots: int
    samples: bool


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]
    failed: list[Request]  # can never be served; finished with FinishReason.ERROR and a message


class Scheduler:
    """prefix_limit: of a request being admitted, how many leading tokens of its conditional
    sequence may come from the prefix cache (a drafter that must see the target's hidden state
    of every token limits it; LLMEngine); None: no limit."""

    def __init__(self, config: EngineConfig, blocks: BlockManager,
                 prefix_limit: Callable[[Request], int] | None = None) -> None:
        self.config = config
        self.blocks = blocks
        self.prefix_limit = prefix_limit
        self.prefix_stats = PrefixCacheStats()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in arrival order

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        """Ends a request (in any state) and frees its blocks at once; `error` says why, exactly
        when the reason is ERROR."""
        if (reason is FinishReason.ERROR) != (error is not None):
            raise ValueError(f"error={error!r} with reason {reason.value}: expected a message exactly for errors")
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error
        request.error_kind = None if error is None else "server"  # the engine names client errors

    def schedule(self) -> SchedulerOutput:
        """The next step's plan. A request whose planning raises is finished with
        FinishReason.ERROR (blocks freed) and listed in `failed`; the others are planned as usual."""
        out = SchedulerOutput([], [], [])
        budget = self.config.max_num_batched_tokens
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or budget == 0:
                continue
            try:
                plan = self._schedule_running(request, budget, out)
            except Exception as error:
                self._fail(request, error, out)
                continue
            if plan is not None:
                out.scheduled.append(plan)
                budget -= self._cost(plan)
        while (
            self.waiting and budget > 0 and not out.preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self._next_waiting()
            try:
                problem = self._never_fits(request)
                plan = self._admit(request, budget) if problem is None else None
            except Exception as error:
                self._fail(request, error, out)
                continue
            if problem is not None:
                self.finish(request, FinishReason.ERROR, problem)
                out.failed.append(request)
                continue
            if plan is None:
                break
            out.scheduled.append(plan)
            budget -= self._cost(plan)
        return out

    def _schedule_running(self, request: Request, budget: int, out: SchedulerOutput) -> ScheduledRequest | None:
        """A running request's share of the step, preempting the newest requests (itself last)
        while the cache cannot hold it; None when it does not move this step."""
        plan = self._plan(request, budget)
        if plan is None:
            return None
        while not self._fits(request, plan):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return None
        self._reserve(request, plan)
        return plan

    def _admit(self, request: Request, budget: int) -> ScheduledRequest | None:
        """Moves a waiting request to running with its share of the step; None when it does not
        fit (then nothing later is admitted either: skipping it could starve a large request)."""
        hits = self._cached_prefixes(request)
        for seq, hit in zip(request.seqs, hits):  # planned as if its cached prefix were computed
            seq.num_computed = len(hit) * self.blocks.block_size
        plan = self._plan(request, budget)
        if plan is None or not all(self.blocks.can_allocate(s.seq_id, 0) for s in request.seqs) \
                or not self._fits(request, plan, hits):
            for seq in request.seqs:
                seq.num_computed = 0  # a waiting request holds nothing
            return None
        self.waiting.remove(request)
        for seq, hit in zip(request.seqs, hits):
            self.blocks.allocate(seq.seq_id, 0, cached=hit)
            self.prefix_stats.queries += request.num_tokens(seq)
            self.prefix_stats.hits += seq.num_computed
        if request.num_cached_tokens is None:
            request.num_cached_tokens = min(request.seqs[0].num_computed, len(request.prompt_token_ids))
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._reserve(request, plan)
        return plan

    def _fail(self, request: Request, error: Exception, out: SchedulerOutput) -> None:
        logger.warning("scheduling request %s raised; failing it", request.request_id, exc_info=error)
        self.finish(request, FinishReason.ERROR, f"{type(error).__name__}: {error}")
        out.failed.append(request)

    def _next_waiting(self) -> Request:
        """The oldest waiting request of the group with the fewest running requests (waiting is
        in arrival order, preempted requests back in their place)."""
        running: dict[str, int] = {}
        for r in self.running:
            running[_group(r)] = running.get(_group(r), 0) + 1
        best = self.waiting[0]
        best_count = running.get(_group(best), 0)
        seen = set()
        for r in self.waiting:
            if best_count == 0:
                break  # nothing beats an idle group, and older requests come first
            group = _group(r)
            if group in seen:
                continue
            seen.add(group)
            count = running.get(group, 0)
            if count < best_count:
                best, best_count = r, count
        return best

    def commit(self, planned: ScheduledRequest, num_accepted: int) -> None:
        """After the step: the fed tokens and the accepted drafts stay in the cache, the slots of
        rejected (or never proposed) drafts go back."""
        for seq, fed in zip(planned.request.seqs, planned.num_new):
            seq.num_computed += fed + num_accepted
            self.blocks.truncate(seq.seq_id, planned.num_draft_slots - num_accepted)
            self._publish(planned.request, seq)
            # After publication, so that a released block stays cached when it can.
            self.blocks.release_behind(seq.seq_id, seq.num_computed)

    def _publish(self, request: Request, seq: Sequence) -> None:
        """Offers the sequence's full blocks of committed tokens to the prefix cache. Accepted
        drafts are computed before they join the output (the engine appends them after the
        commit), so a block they complete is published a step later."""
        if self.blocks.prefix is None or not self.blocks.has(seq.seq_id):
            return
        tokens = request.all_token_ids(seq)
        num_full = min(seq.num_computed, len(tokens)) // self.blocks.block_size
        hashes = extend_chain(seq.block_hashes, self.blocks.prefix.root, tokens, self.blocks.block_size,
                              num_full * self.blocks.block_size)
        self.blocks.publish(seq.seq_id, hashes[:num_full], tokens)

    def _cached_prefixes(self, request: Request) -> list[list[int]]:
        """Per sequence, the cached blocks it would start from if admitted now: its longest
        cached prefix short of its last token (whose row must be fed for logits), within
        prefix_limit for the conditional sequence."""
        if self.blocks.prefix is None:
            return [[] for _ in request.seqs]
        hits = []
        size = self.blocks.block_size
        for seq in request.seqs:
            tokens = request.all_token_ids(seq)
            limit = len(tokens) - 1
            if seq is request.seqs[0] and self.prefix_limit is not None:
                limit = min(limit, self.prefix_limit(request))
            hashes = extend_chain(seq.block_hashes, self.blocks.prefix.root, tokens, size, limit)
            hits.append(self.blocks.cached_prefix(hashes[: limit // size], tokens))
        return hits

    def _plan(self, request: Request, budget: int) -> ScheduledRequest | None:
        """The request's share of a step within `budget` tokens; None when it cannot move."""
        pending = [request.num_pending(s) for s in request.seqs]
        num_seqs = len(pending)
        k = self.max_draft_slots(request)
        spare = budget - sum(pending)
        if request.batch_invariant:
            if spare >= k * num_seqs:
                return ScheduledRequest(request, pending, k, True)
        elif spare >= 0:
            return ScheduledRequest(request, pending, min(k, spare // num_seqs), True)
        # Chunked prefill: the companion's (short) history first, never a sequence's last token.
        num_new = [0] * num_seqs
        for i in reversed(range(num_seqs)):
            num_new[i] = min(pending[i] - 1, budget)
            budget -= num_new[i]
        return ScheduledRequest(request, num_new, 0, False) if sum(num_new) else None

    def max_draft_slots(self, request: Request) -> int:
        """K for the request's next sampling step before the step's budget is shared out: its
        adaptive K, capped by its remaining tokens (emitted drafts + 1 bonus must not pass them)
        and by the largest K whose rows fit one step. Depends on the request alone."""
        per_step = self.config.max_num_batched_tokens // len(request.seqs) - 1
        return max(0, min(request.num_speculative_tokens, request.remaining_tokens - 1, per_step))

    @staticmethod
    def _cost(plan: ScheduledRequest) -> int:
        return sum(plan.num_new) + plan.num_draft_slots * len(plan.num_new)

    def _fits(self, request: Request, plan: ScheduledRequest, hits: list[list[int]] | None = None) -> bool:
        """Whether the plan's slots fit, after mapping `hits` (per sequence, the cached blocks a
        request being admitted starts from)."""
        # Both sequences of a CFG pair must fit together, hence one sum, not can_append per sequence.
        hits = hits or [[] for _ in request.seqs]
        needed = self.blocks.blocks_taken([b for hit in hits for b in hit])
        for seq, fed, hit in zip(request.seqs, plan.num_new, hits):
            have = self.blocks.num_tokens(seq.seq_id) if self.blocks.has(seq.seq_id) else len(hit) * self.blocks.block_size
            needed += self.blocks.blocks_for(have + fed + plan.num_draft_slots) - self.blocks.blocks_for(have)
        return needed <= self.blocks.num_free_blocks

    def _reserve(self, request: Request, plan: ScheduledRequest) -> None:
        for seq, fed in zip(request.seqs, plan.num_new):
            self.blocks.append(seq.seq_id, fed + plan.num_draft_slots)

    def _never_fits(self, request: Request) -> str | None:
        """Why the request can never be served (as its error message), or None."""
        if len(request.seqs) > self.config.max_num_batched_tokens:
            return (f"classifier-free guidance feeds {len(request.seqs)} sequences per step: "
                    f"max_num_batched_tokens={self.config.max_num_batched_tokens} is too small")
        # A sampling step holds prefix + emitted + K slots per sequence, and K <= remaining - 1,
        # so never more than prefix + max_tokens - 1.
        tokens = [len(s.prefix_token_ids) + request.max_tokens - 1 for s in request.seqs]
        needed = self._most_blocks(tokens)
        if needed > self.blocks.num_blocks:
            return (f"the request needs {needed} KV-cache blocks ({' + '.join(map(str, tokens))} tokens "
                    f"at {self.blocks.block_size} per block) but the cache has {self.blocks.num_blocks}")
        return None

    def _most_blocks(self, num_tokens: list[int]) -> int:
        """The most blocks a request whose sequences grow to `num_tokens` slots holds at once.
        With a window, sequence i holds in a step the blocks of the window - 1 keys behind its
        first query and of the s_i slots it feeds (drafts included), at most
        ceil((window - 1 + s_i + block_size - 1) / block_size) however they are aligned, and
        the s_i add up to at most max_num_batched_tokens."""
        full = sum(self.blocks.blocks_for(t) for t in num_tokens)
        if self.blocks.window is None:
            return full
        size = self.blocks.block_size
        fed = min(sum(num_tokens), self.config.max_num_batched_tokens)
        # sum_i ceil(x_i / size) <= (sum_i x_i + n (size - 1)) // size
        return min(full, (len(num_tokens) * (self.blocks.window + 2 * size - 3) + fed) // size)

    def _free(self, request: Request) -> None:
        """Publishes the request's committed full blocks, then releases all its blocks."""
        for seq in request.seqs:
            self._publish(request, seq)
            self.blocks.free(seq.seq_id)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._free(request)
        for seq in request.seqs:
            seq.num_computed = 0
        request.status = RequestStatus.WAITING
        # Back to the front of the queue, ahead of requests that arrived after it.
        index = next((i for i, r in enumerate(self.waiting) if r.arrival > request.arrival), len(self.waiting))
        self.waiting.insert(index, request)


def _group(request: Request) -> str:
    return request.request_id if request.group is None else request.group
