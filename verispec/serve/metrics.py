"""Prometheus metrics of one server, in its own CollectorRegistry (GET /metrics).

The engine thread reports through `added` / `observe` / `forget`; the gauges of the scheduler
and the KV cache are read when scraped. Speculative counters grow by each output's increment of
its request's SpecDecodeStats, so they also count requests that are later aborted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from ..engine.engine import LLMEngine, RequestOutput
from ..runtime.prefix_cache import PrefixCacheStats
from ..spec_decode.metrics import SpecDecodeStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PREFIX = "verispec"


@dataclass
class _Seen:
    """What was already counted of one request."""

    arrival: float
    last: float | None = None  # when its previous tokens came
    stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)


class ServeMetrics:
    def __init__(self, engine: LLMEngine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.totals = SpecDecodeStats()  # every verify step reported so far
        self._seen: dict[str, _Seen] = {}
        scheduler, blocks = engine.scheduler, engine.blocks
        Gauge(f"{PREFIX}_requests_running", "Requests being generated.", registry=r).set_function(
            lambda: len(scheduler.running))
        Gauge(f"{PREFIX}_requests_waiting", "Requests queued, not yet admitted.", registry=r).set_function(
            lambda: len(scheduler.waiting))
        Gauge(f"{PREFIX}_kv_blocks_used", "KV cache blocks allocated.", registry=r).set_function(
            lambda: blocks.num_blocks - blocks.num_free_blocks)
        Gauge(f"{PREFIX}_kv_blocks_free", "KV cache blocks free (cached ones no request holds included).",
              registry=r).set_function(lambda: blocks.num_free_blocks)
        r.register(_PrefixCacheCounters(scheduler.prefix_stats))
        Gauge(f"{PREFIX}_prefix_cache_blocks", "KV cache blocks holding cached prefixes (held or evictable).",
              registry=r).set_function(lambda: blocks.prefix.num_cached if blocks.prefix is not None else 0)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of queued requests.", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "From queueing to the first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                             "Between a request's outputs, per token of the later one.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.drafts = Counter(f"{PREFIX}_spec_decode_drafts", "Verify steps with at least one draft token.",
                              registry=r)
        self.draft_tokens = Counter(f"{PREFIX}_spec_decode_draft_tokens", "Draft tokens verified.", registry=r)
        self.accepted_tokens = Counter(f"{PREFIX}_spec_decode_accepted_tokens", "Draft tokens accepted.",
                                       registry=r)
        self.accepted_per_position = Counter(
            f"{PREFIX}_spec_decode_accepted_tokens_per_position",
            "Draft tokens accepted at each draft position (0-based).", ["position"], registry=r)
        Gauge(f"{PREFIX}_spec_decode_mean_acceptance_length",
              "Mean tokens emitted per verify step with drafts (1 + accepted / drafts).",
              registry=r).set_function(lambda: self.totals.mean_acceptance_length)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def added(self, request_id: str, num_prompt_tokens: int, now: float) -> None:
        self._seen[request_id] = _Seen(now)
        self.prompt_tokens.inc(num_prompt_tokens)

    def observe(self, out: RequestOutput, now: float) -> None:
        seen = self._seen.get(out.request_id)
        if seen is None or not out.new_token_ids:
            return
        n = len(out.new_token_ids)
        self.generation_tokens.inc(n)
        if seen.last is None:
            self.ttft.observe(now - seen.arrival)
        else:
            for _ in range(n):
                self.itl.observe((now - seen.last) / n)
        seen.last = now
        self._count_spec(seen.stats, out.stats)

    def forget(self, request_id: str) -> None:
        self._seen.pop(request_id, None)

    def _count_spec(self, before: SpecDecodeStats, now: SpecDecodeStats) -> None:
        """Counts now - before, then makes `before` a copy of `now` (the engine keeps mutating it)."""
        delta = SpecDecodeStats(
            num_drafts=now.num_drafts - before.num_drafts,
            num_draft_tokens=now.num_draft_tokens - before.num_draft_tokens,
            num_accepted_tokens=now.num_accepted_tokens - before.num_accepted_tokens,
            num_emitted_tokens=now.num_emitted_tokens - before.num_emitted_tokens,
            draft_per_position=_minus(now.draft_per_position, before.draft_per_position),
            accepted_per_position=_minus(now.accepted_per_position, before.accepted_per_position),
        )
        self.totals.merge(delta)
        self.drafts.inc(delta.num_drafts)
        self.draft_tokens.inc(delta.num_draft_tokens)
        self.accepted_tokens.inc(delta.num_accepted_tokens)
        for position, count in enumerate(delta.accepted_per_position):
            if count:
                self.accepted_per_position.labels(position=str(position)).inc(count)
        before.merge(delta)


class _PrefixCacheCounters(Collector):
    """The scheduler's prefix-cache token counts as counters (vLLM's prefix_cache_queries /
    prefix_cache_hits), read when scraped: the engine thread only bumps two integers."""

    def __init__(self, stats: PrefixCacheStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(f"{PREFIX}_prefix_cache_queries", "Tokens looked up in the prefix cache "
                                  "at admission (every sequence's, CFG companions included).", value=self.stats.queries)
        yield CounterMetricFamily(f"{PREFIX}_prefix_cache_hits", "Tokens found in the prefix cache at admission.",
                                  value=self.stats.hits)


def _minus(a: list[int], b: list[int]) -> list[int]:
    return [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
