"""Continuous batching: which requests run in the next step, how many tokens each feeds.

Plain Python over the BlockManager. Each step:
1. running requests, oldest first, get their pending tokens (+ K draft slots when they sample);
   when the cache is full, the newest running request is preempted (its blocks freed, to be
   recomputed later) rather than failing anyone;
2. waiting requests are admitted in arrival order while the token budget, the sequence limit
   and the cache allow, unless this step had to preempt (admitting would only thrash).
A prompt longer than the remaining budget is prefilled in chunks. A chunk never completes a
sequence unless the request samples in that step, so the row of its last pending token is
always fed together with its drafts. A CFG request's two sequences move as one unit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..config import EngineConfig
from .kv_cache import BlockManager
from .request import FinishReason, Request, RequestStatus


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
    failed: list[Request]  # can never fit in the cache; finished with FinishReason.ERROR


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in arrival order

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        """Ends a request (in any state) and frees its blocks at once."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        for seq in request.seqs:
            self.blocks.free(seq.seq_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], [], [])
        budget = self.config.max_num_batched_tokens
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or budget == 0:
                continue
            plan = self._plan(request, budget)
            while not self._fits(request, plan):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                self._reserve(request, plan)
                out.scheduled.append(plan)
                budget -= self._cost(plan)
        while (
            self.waiting and budget > 0 and not out.preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            if not self._can_ever_fit(request):
                self.finish(request, FinishReason.ERROR, "the request needs more KV-cache blocks than exist")
                out.failed.append(request)
                continue
            plan = self._plan(request, budget)
            if not all(self.blocks.can_allocate(s.seq_id, 0) for s in request.seqs) or not self._fits(request, plan):
                break
            self.waiting.popleft()
            for seq in request.seqs:
                self.blocks.allocate(seq.seq_id, 0)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._reserve(request, plan)
            out.scheduled.append(plan)
            budget -= self._cost(plan)
        return out

    def commit(self, planned: ScheduledRequest, num_accepted: int) -> None:
        """After the step: the fed tokens and the accepted drafts stay in the cache, the slots of
        rejected (or never proposed) drafts go back."""
        for seq, fed in zip(planned.request.seqs, planned.num_new):
            seq.num_computed += fed + num_accepted
            self.blocks.truncate(seq.seq_id, planned.num_draft_slots - num_accepted)

    def _plan(self, request: Request, budget: int) -> ScheduledRequest:
        pending = [request.num_pending(s) for s in request.seqs]
        num_seqs = len(pending)
        if sum(pending) <= budget:
            k = min(
                request.num_speculative_tokens,
                request.remaining_tokens - 1,
                self.config.max_model_len - request.num_tokens(request.seqs[0]) - 1,
                (budget - sum(pending)) // num_seqs,
            )
            return ScheduledRequest(request, pending, max(k, 0), True)
        # Chunked prefill: the companion's (short) history first, never a sequence's last token.
        num_new = []
        for p in reversed(pending):
            fed = min(p - 1, budget)
            num_new.append(fed)
            budget -= fed
        return ScheduledRequest(request, num_new[::-1], 0, False)

    @staticmethod
    def _cost(plan: ScheduledRequest) -> int:
        return sum(plan.num_new) + plan.num_draft_slots * len(plan.num_new)

    def _fits(self, request: Request, plan: ScheduledRequest) -> bool:
        # Both sequences of a CFG pair must fit together, hence one sum, not can_append per sequence.
        needed = 0
        for seq, fed in zip(request.seqs, plan.num_new):
            have = self.blocks.num_tokens(seq.seq_id) if self.blocks.has(seq.seq_id) else 0
            needed += self.blocks.blocks_for(have + fed + plan.num_draft_slots) - self.blocks.blocks_for(have)
        return needed <= self.blocks.num_free_blocks

    def _reserve(self, request: Request, plan: ScheduledRequest) -> None:
        for seq, fed in zip(request.seqs, plan.num_new):
            self.blocks.append(seq.seq_id, fed + plan.num_draft_slots)

    def _can_ever_fit(self, request: Request) -> bool:
        extra = request.params.max_tokens + request.max_speculative_tokens
        needed = sum(self.blocks.blocks_for(len(s.prefix_token_ids) + extra) for s in request.seqs)
        return needed <= self.blocks.num_blocks

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        for seq in request.seqs:
            self.blocks.free(seq.seq_id)
            seq.num_computed = 0
        request.status = RequestStatus.WAITING
        # Back to the front of the queue, ahead of requests that arrived after it.
        index = next((i for i, r in enumerate(self.waiting) if r.arrival > request.arrival), len(self.waiting))
        self.waiting.insert(index, request)
