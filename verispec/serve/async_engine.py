"""AsyncEngine: an asyncio front over one LLMEngine, for the server.

One background thread owns the engine: it alone calls prepare_request / enqueue / abort /
step. The event loop hands it commands through a thread-safe queue and receives each request's
outputs on an asyncio queue (via loop.call_soon_threadsafe). Between two steps the thread takes
every command waiting, so all requests in flight share each step (continuous batching), and an
abort lands before the next step, which frees the request's KV blocks (CFG companion and
drafter state included).

Requests are validated and tokenized on a worker thread (LLMEngine.prepare_request touches no
engine state), so a long prompt does not hold up the steps of everyone else; the engine thread
only queues them.

Liveness: the thread notes when it began its current step or command; `stalled_for()` is how
long that has been (0 when it is waiting for work), which /health reports.

Failures: a bad request (prepare_request's ValueError / TypeError) is raised to its caller and
queues nothing. A request that fails inside a step comes back as an output with
finish_reason "error" (the engine isolates it). If step() itself raises, every request in
flight is aborted and gets EngineStepError; the thread keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from ..engine.engine import LLMEngine, PreparedRequest, RequestOutput
from ..sampling_params import SamplingParams
from .metrics import ServeMetrics

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """The engine's step raised; every request in flight at the time gets this."""


@dataclass(frozen=True)
class Submission:
    """One request to prepare and queue (arguments of LLMEngine.prepare_request)."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    num_speculative_tokens: int | None = None
    name: str = "prompt"  # what the prompt is called in error messages
    add_special_tokens: bool = True
    group: str | None = None  # admitted fairly against other groups (LLMEngine.prepare_request)


@dataclass
class _Sink:
    """Where the engine thread delivers one request's outputs: (index in its group, output)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int

    def put(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, item))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServeMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._busy_since: float | None = None  # monotonic start of the current step / command

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._commands.put(None)
            self._thread.join()
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stalled_for(self) -> float:
        """Seconds the engine thread has spent in its current step or command; 0 when idle."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    async def generate(self, submissions: list[Submission]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Queues the requests together (all or, if one is bad, none: its ValueError /
        TypeError is raised) and yields (index in `submissions`, output) as the engine makes
        them, until every request finished. Closing the iterator early aborts the rest."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        queued: asyncio.Future = loop.create_future()
        unfinished = {s.request_id for s in submissions}
        prepared = await asyncio.to_thread(self._prepare, submissions)

        def add() -> None:
            try:
                for i, p in enumerate(prepared):
                    self.engine.enqueue(p)
                    self._sinks[p.request_id] = _Sink(loop, outputs, i)
                    if self.metrics is not None:
                        self.metrics.added(p.request_id, len(p.prompt_token_ids), time.monotonic())
            except Exception as error:
                loop.call_soon_threadsafe(_settle, queued, error)
            else:
                loop.call_soon_threadsafe(_settle, queued, None)

        try:
            self._commands.put(add)
            await queued
            while unfinished:
                index, item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    unfinished.discard(item.request_id)
                yield index, item
        finally:
            if unfinished:
                self._commands.put(lambda: self._abort(unfinished))

    def _prepare(self, submissions: list[Submission]) -> list[PreparedRequest]:
        return [self.engine.prepare_request(s.prompt, s.params, s.request_id, s.num_speculative_tokens,
                                            name=s.name, add_special_tokens=s.add_special_tokens, group=s.group)
                for s in submissions]

    def _abort(self, request_ids: set[str]) -> None:
        for rid in request_ids:
            self._sinks.pop(rid, None)
            self.engine.abort(rid)
            if self.metrics is not None:
                self.metrics.forget(rid)

    def _run(self) -> None:
        while True:
            # Idle: sleep until a command comes. Busy: take what is waiting, then step.
            try:
                command = self._commands.get(block=not self.engine.has_unfinished())
            except queue.Empty:
                command = False
            while command is not False:
                if command is None:
                    return
                self._busy_since = time.monotonic()
                command()
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = False
            if self.engine.has_unfinished():
                self._busy_since = time.monotonic()
                self._step()
            self._busy_since = None

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:
            logger.exception("engine step failed; failing every request in flight")
            failed = EngineStepError(f"the engine failed: {type(error).__name__}: {error}")
            for rid, sink in list(self._sinks.items()):
                sink.put(failed)
            self._fail_all()
            return
        now = time.monotonic()
        for out in outputs:
            if self.metrics is not None:
                self.metrics.observe(out, now)
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                sink.put(out)
            if out.finished:
                self._sinks.pop(out.request_id, None)
                if self.metrics is not None:
                    self.metrics.forget(out.request_id)

    def _fail_all(self) -> None:
        """Aborts every request in flight, even when an abort raises, so the cache is freed."""
        rids = list(self._sinks)
        self._sinks.clear()
        for rid in rids:
            try:
                self.engine.abort(rid)
            except Exception:
                logger.exception("aborting %s after a failed step raised", rid)
            if self.metrics is not None:
                self.metrics.forget(rid)


def _settle(future: asyncio.Future, error: Exception | None) -> None:
    if not future.done():
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
