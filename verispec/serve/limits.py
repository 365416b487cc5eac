"""What one client may take of the server: body size, time to send a request, connections.

ServeLimits (config.py) holds the numbers (`verispec serve` flags). BodyLimit is an ASGI middleware that
reads a POST body before the app sees it, answering 413 past max_request_bytes (declared or
streamed) and 408 when the body does not arrive within body_timeout_s, so a 20 MB prompt never
reaches the JSON parser and a half-sent body does not hold a handler. Headers come before the
app is called, so their timeout lives in the HTTP protocol (TimedH11Protocol): a connection that
has not finished a request's headers within header_timeout_s is closed.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..config import ServeLimits
from .errors import APIError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyLimit:
    """ASGI middleware: buffers each HTTP request body within the size and time limits, then
    hands the app the buffered body (later receive() calls, e.g. disconnect checks, pass through)."""

    def __init__(self, app: ASGIApp, limits: ServeLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_request_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _reply(send, _too_large(limit, f"{int(declared)} bytes declared"))
            return
        try:
            body = await asyncio.wait_for(_read_body(receive, limit), self.limits.body_timeout_s)
        except TimeoutError:
            await _reply(send, APIError(f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                                        status=408, code="request_timeout"))
            return
        except _Disconnected:
            return  # nobody is left to answer
        if body is None:
            await _reply(send, _too_large(limit, "more sent"))
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class _Disconnected(Exception):
    """The client left while sending its body."""


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None past `limit` bytes; raises _Disconnected."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _too_large(limit: int, seen: str) -> APIError:
    return APIError(f"the request body is larger than the server's limit of {limit} bytes ({seen}; "
                    "`verispec serve --max-request-bytes` raises it)", status=413, code="request_too_large")


async def _reply(send: Send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers are not complete
    within `header_timeout_s` of its first byte (or of connecting). uvicorn times out only idle
    keep-alive connections, so a client trickling its headers would otherwise hold one forever."""

    header_timeout_s = 10.0  # set per server by server_config (a subclass per limit)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the first bytes of a next request on a kept-alive connection
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # the headers are in: the app (and BodyLimit's timeout) takes over

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_timed_out)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def server_config(app: ASGIApp, host: str, port: int, limits: ServeLimits, **options: Any) -> uvicorn.Config:
    """uvicorn's config for `app` under `limits`: the header timeout, the connection limit
    (503 beyond), h11 (whose protocol carries the timeout) and idle keep-alive connections
    closed after 5 s."""
    protocol = type("LimitedH11Protocol", (TimedH11Protocol,), {"header_timeout_s": limits.header_timeout_s})
    return uvicorn.Config(app, host=host, port=port, http=protocol, limit_concurrency=limits.max_connections,
                          timeout_keep_alive=5, **options)
