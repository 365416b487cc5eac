"""BatchAnswerer: the server's OpenAI app (serve/app.py) over one LLM, called in-process.

Each batch request is handed to the app as the HTTP request the server would receive (an ASGI
call, no socket), so a body is validated, run and answered by exactly the code that answers it
over HTTP: the same 400s naming the field, the same response bodies. The app lives on its own
event loop thread with its engine thread (serve/async_engine.py); every request submitted shares
the engine's steps (continuous batching), and results come back as each request finishes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from ..config import ServeLimits
from ..engine.llm import LLM
from ..serve import build_app
from ..serve.errors import APIError
from .records import BatchRequest, response_record


class BatchAnswerer:
    def __init__(self, llm: LLM, model_name: str, limits: ServeLimits = ServeLimits()) -> None:
        self.app = build_app(llm, model_name, limits)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="verispec-batch", daemon=True)
        self._thread.start()
        self._lifespan = contextlib.AsyncExitStack()
        # The app's lifespan starts (and at close stops) its engine thread, as uvicorn would.
        self._call(self._lifespan.enter_async_context(self.app.router.lifespan_context(self.app))).result()

    def _call(self, coroutine: Any) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def submit(self, request: BatchRequest) -> concurrent.futures.Future[dict]:
        """The request's output record, once the app has answered it."""
        return self._call(self._answer(request))

    def answer(self, requests: Iterable[BatchRequest], window: int) -> Iterator[dict]:
        """Output records in the order requests finish, with at most `window` in flight (enough
        to keep the engine's batch full without tokenizing a whole file up front)."""
        pending: set[concurrent.futures.Future] = set()
        for request in requests:
            if len(pending) >= window:
                done, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                yield from (future.result() for future in done)
            pending.add(self.submit(request))
        while pending:
            done, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            yield from (future.result() for future in done)

    async def _answer(self, request: BatchRequest) -> dict:
        try:
            status, body = await post(self.app, request.url, request.body)
        except Exception as error:  # the app raised (a bug): the server answers 500, and so does the batch
            status = 500
            body = json.dumps(APIError(f"the server failed: {type(error).__name__}: {error}", status=500).body()).encode()
        return response_record(request.custom_id, status, body)

    def close(self) -> None:
        self._call(self._lifespan.aclose()).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


async def post(app: Any, path: str, body: bytes) -> tuple[int, bytes]:
    """(status, body) of a JSON POST to the ASGI `app`, as an HTTP server would call it; the
    client stays connected until the response is complete."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": None, "server": None,
    }
    answered = asyncio.Event()
    status = 500
    chunks: list[bytes] = []
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                answered.set()

    await app(scope, receive, send)
    return status, b"".join(chunks)
