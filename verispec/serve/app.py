"""The OpenAI-compatible HTTP server: build_app(llm, model_name) -> FastAPI.

POST /v1/completions, POST /v1/chat/completions (stream: true gives server-sent events
`data: {...}` ending in `data: [DONE]`; stream_options.include_speculation adds each token's
origin, serve/speculation.py), GET /v1/models, GET /health, GET /metrics, and the chat page at
GET / unless web_ui is off (serve/page.py).

A request's n samples (and, for completions, its prompts) are queued together, at most
ServeLimits.max_choices of them, and share engine steps with every other request in flight; the
scheduler admits them as one group, taking turns with other requests. A client that disconnects
has its requests aborted before the next engine step, which frees their KV blocks. Bodies over
ServeLimits.max_request_bytes are refused before they are parsed (limits.py); bodies are parsed
and checked off the event loop (body.py), those of LARGE_BODY_BYTES or more one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..config import ServeLimits
from ..engine.engine import RequestOutput
from ..engine.llm import LLM
from ..sampling_params import STRUCTURED_FIELDS, SamplingParams
from ..spec_decode.metrics import SpecDecodeStats
from ..tools import ToolUse, render_tool_chat
from ..tools.prompt import check_messages
from .async_engine import AsyncEngine, EngineStepError, Submission
from .body import parse_body
from .errors import APIError, echo, install_error_handlers
from .interpreter import responsive_interpreter
from .limits import BodyLimit
from .metrics import ServeMetrics
from .page import install_web_ui
from .protocol import (DEFAULT_COMPLETION_TOKENS, ChatRequest, CompletionRequest, invalid, sampling_params,
                       structured_field)
from .responses import Formatter, usage
from .speculation import SpeculationTrace, describe_drafter

_DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
LARGE_BODY_BYTES = 64 * 1024  # bodies from this size on are prepared one at a time (build_app)
Prepared = tuple[CompletionRequest | ChatRequest, Formatter, list[Submission]]


def build_app(llm: LLM, model_name: str, limits: ServeLimits = ServeLimits(), web_ui: bool = True) -> FastAPI:
    metrics = ServeMetrics(llm.engine)
    engine = AsyncEngine(llm.engine, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # llguidance's view of the tokenizer, built before any stream runs: it holds the
        # interpreter throughout (about 0.5 s for SmolLM2's 49k tokens), which the first
        # structured-output request would otherwise do to every stream in flight.
        try:
            await asyncio.to_thread(llm.engine.grammars.lltokenizer)
        except ImportError:  # no llguidance: structured-output requests are refused anyway
            pass
        engine.start()
        try:
            with responsive_interpreter():
                yield
        finally:
            engine.stop()

    app = FastAPI(title="verispec", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.add_middleware(BodyLimit, limits=limits)
    install_error_handlers(app)
    if web_ui:
        install_web_ui(app, model_name, describe_drafter(llm.engine.config.speculative))

    def request_params(body: CompletionRequest | ChatRequest, prompts: int, use: ToolUse | None = None
                       ) -> list[SamplingParams]:
        """The SamplingParams of each of the request's n samples (of each of its `prompts`)."""
        if body.model != model_name:
            raise APIError(f"model={echo(body.model)} does not exist here: this server serves {model_name!r}",
                           "model", status=404, code="model_not_found")
        if body.n < 1:
            raise APIError(f"n={body.n} is invalid: expected an integer >= 1", "n")
        if body.n * prompts > limits.max_choices:
            many = f"n={body.n}" if prompts == 1 else f"n={body.n} x {prompts} prompts"
            raise APIError(f"{many} asks for {body.n * prompts} sequences: this server allows at most "
                           f"{limits.max_choices} per request (`verispec serve --max-choices`)", "n")
        default_max = None if isinstance(body, ChatRequest) else DEFAULT_COMPLETION_TOKENS  # None: the rest
        return sampling_params(body, default_max, llm.engine.config.structured, use)

    def submissions(body: CompletionRequest | ChatRequest, params: list[SamplingParams],
                    prompts: list[str | list[int]], request_id: str) -> list[Submission]:
        chat = isinstance(body, ChatRequest)
        name = "messages" if chat else "prompt"
        return [Submission(f"{request_id}-{p}-{i}", prompt, params[i], body.num_speculative_tokens,
                           name=name if len(prompts) == 1 else f"{name}[{p}]", add_special_tokens=not chat,
                           group=request_id)
                for p, prompt in enumerate(prompts) for i in range(body.n)]

    # The two endpoints' work before generation, each on a worker thread (off the event loop):
    # parsing and validating the body, rendering the chat, and building and checking the
    # structured-output grammar (first: its size refuses a hostile one before any other work),
    # which a hostile request can make take seconds.
    def prepare_completion(raw: bytes) -> tuple[CompletionRequest, Formatter, list[Submission]]:
        body = parse_body(CompletionRequest, raw)
        prompts = body.prompts()
        params = request_params(body, len(prompts))
        fmt = Formatter(False, model_name, llm.tokenizer)
        return body, fmt, submissions(body, params, prompts, fmt.id)

    def prepare_chat(raw: bytes) -> tuple[ChatRequest, Formatter, list[Submission]]:
        body = parse_body(ChatRequest, raw)
        if not body.messages:
            raise APIError("messages is empty: expected at least one message", "messages")
        use = body.tool_use()
        messages = [m.as_dict() for m in body.messages]
        try:
            if use is not None and use.active:
                use.check_limits(llm.engine.config.structured)
            check_messages(messages)
        except ValueError as error:
            raise invalid(error) from None
        params = request_params(body, 1, use)
        try:
            prompt = render_tool_chat(llm.tokenizer, messages, use)
        except Exception as error:  # a template's own error (raise_exception, bad roles)
            raise APIError(f"messages could not be rendered by the chat template: {error}", "messages") from None
        fmt = Formatter(True, model_name, llm.tokenizer, use)
        return body, fmt, submissions(body, params, [prompt], fmt.id)

    async def respond(http: Request, body: CompletionRequest | ChatRequest, fmt: Formatter,
                      prepared: list[Submission]) -> Response:
        outputs = engine.generate(prepared)
        try:
            first = await outputs.__anext__()
        except (ValueError, TypeError) as error:
            # A grammar refused when compiled names its SamplingParams field: name the request's.
            field = structured_field(body)
            raise invalid(error, rename=dict.fromkeys(STRUCTURED_FIELDS, field) if field else None) from None
        except EngineStepError as error:
            raise APIError(str(error), status=500) from None
        except StopAsyncIteration:
            raise APIError("the request produced no output", status=500) from None
        if body.stream:
            trace = SpeculationTrace(llm.tokenizer) if body.include_speculation else None
            return StreamingResponse(_events(fmt, first, outputs, body.include_usage, body, body.n, trace),
                                     media_type="text/event-stream")
        task = asyncio.ensure_future(_collect(first, outputs))
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if not task.done() and await http.is_disconnected():
                    task.cancel()
        finally:
            if not task.done():  # this handler itself was cancelled
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            return Response(status_code=499)  # the client is gone; nobody reads this
        finals = task.result()
        for out in finals:
            if out.finish_reason == "error":
                raise _failed(out, body)
        return JSONResponse(fmt.whole(list(enumerate(finals)), _usage(finals, body.n))
                            | {"spec_decode_stats": _spec_stats(finals)})

    # Bodies of LARGE_BODY_BYTES or more are prepared one at a time: their parsing and checks
    # hold the interpreter (a 2.3 MB body, 20 ms in the JSON parser's one C call), and a stream
    # waited for several of them at once when they took turns with the engine thread.
    large_bodies = asyncio.Semaphore(1)

    async def off_loop(prepare: Callable[[bytes], Prepared], raw: bytes) -> Prepared:
        async with large_bodies if len(raw) >= LARGE_BODY_BYTES else contextlib.nullcontext():
            return await asyncio.to_thread(prepare, raw)

    # The bodies (CompletionRequest, ChatRequest) are read raw and parsed by prepare_*: body.py.
    @app.post("/v1/completions")
    async def completions(http: Request) -> Response:
        return await respond(http, *await off_loop(prepare_completion, await http.body()))

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request) -> Response:
        return await respond(http, *await off_loop(prepare_chat, await http.body()))

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "verispec"}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the engine thread serves; 503 when it is gone, or has been inside one step
        (or command) for ServeLimits.stall_s with work queued: a wedged engine answers nothing."""
        stalled = engine.stalled_for()
        work = llm.engine.has_unfinished()
        wedged = not engine.alive or (work and stalled >= limits.stall_s)
        body = {"status": "unhealthy" if wedged else "ok", "engine_alive": engine.alive,
                "engine_busy_s": round(stalled, 3), "requests_running": len(llm.engine.scheduler.running),
                "requests_waiting": len(llm.engine.scheduler.waiting)}
        return JSONResponse(body, status_code=503 if wedged else 200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def _from(first: tuple[int, RequestOutput],
                outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The output already read (to answer bad requests before responding), then the rest."""
    yield first
    async for item in outputs:
        yield item


async def _collect(first: tuple[int, RequestOutput],
                   outputs: AsyncIterator[tuple[int, RequestOutput]]) -> list[RequestOutput]:
    """Every request's final output, in submission order; closing `outputs` aborts the rest."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, out in _from(first, outputs):
            if out.finished:
                finals[index] = out
        return [finals[i] for i in sorted(finals)]
    finally:
        await outputs.aclose()


async def _events(fmt: Formatter, first: tuple[int, RequestOutput],
                  outputs: AsyncIterator[tuple[int, RequestOutput]], include_usage: bool,
                  body: CompletionRequest | ChatRequest, n: int,
                  trace: SpeculationTrace | None = None) -> AsyncIterator[str]:
    """Server-sent events of a stream; a failure mid-stream is sent as an error event. Cancelled
    (the client left) or not, closing `outputs` aborts what is unfinished. With `trace`, chunks
    carry the speculation extension, and a step whose text is held back still sends one."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, out in _from(first, outputs):
            if out.finished:
                finals[index] = out
            if out.finish_reason == "error":
                yield _event(_failed(out, body).body())
                return
            extension = trace.of(index, out) if trace is not None else None
            if out.new_text or out.new_logprobs or out.finished or extension is not None:
                chunk = fmt.chunk(index, out)
                if extension is not None:
                    chunk["choices"][0]["speculation"] = extension
                yield _event(chunk)
        if include_usage:
            yield _event(fmt.usage_chunk(_usage([finals[i] for i in sorted(finals)], n)))
        yield "data: [DONE]\n\n"
    except EngineStepError as error:
        yield _event(APIError(str(error), status=500).body())
    finally:
        await outputs.aclose()


def _failed(out: RequestOutput, body: CompletionRequest | ChatRequest) -> APIError:
    """The error of a request that failed during generation: a 400 naming the structured-output
    field when its grammar could not go on (a budget of the grammar engine ran out, or no token
    continues it: retrying fails again), else a 500."""
    if out.error_kind == "invalid_request":
        return APIError(f"generation failed: {out.error}", structured_field(body), status=400,
                        code="structured_output_failed")
    return APIError(f"generation failed: {out.error}", status=500)


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _spec_stats(finals: list[RequestOutput]) -> dict[str, int | float | list[float]]:
    """An extension field: the speculative verification of all choices together."""
    total = SpecDecodeStats()
    for out in finals:
        total.merge(out.stats)
    return total.summary()


def _usage(finals: list[RequestOutput], n: int) -> dict[str, int]:
    """The prompt counted once per prompt (not per sample, as OpenAI does), every sample's tokens."""
    prompt = sum(len(out.prompt_token_ids) for i, out in enumerate(finals) if i % n == 0)
    return usage(prompt, sum(len(out.token_ids) for out in finals))
