"""Hostile structured-output requests against the server (tiny checkpoint, OpenAI's client): an
empty language and a grammar that exhausts the grammar engine's budget are 400s naming the field
before generation (and ValueErrors offline); a grammar that dead-ends mid-generation ends its
request with a 400 (streamed: an invalid_request_error event), never a 500; guided_choice takes
10,000 choices; large bodies are prepared one at a time; and hostile requests (tools among them)
delay another client's stream by at most 50 ms."""

from __future__ import annotations

import json
import threading
import time

import httpx2
import openai
import pytest
import torch

from verispec import SamplingParams
from verispec.structured.choice import choice_grammar

from .conftest import MODEL, make_llm, serving

EMPTY_REGEX = "[^\\x00-\\U0010FFFF]"
LOOPING_SCHEMA = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
EXHAUSTING_REGEX = "(a{1000}){1000}"  # the lexer runs out of expressions within its first masks
DEAD_END_REGEX = "ab\u00e9"  # no token of the tiny vocabulary spells é: stuck after "ab"


STALL_BOUND_S = 0.05  # the most a hostile request may delay another client's stream (the issue's)


@pytest.fixture(scope="module")
def served(checkpoint):
    """(url, client) of a server of its own, whose engine computes on one torch thread, as
    `verispec serve --threads 1` would on a 2-core machine, leaving a core to the work that
    prepares requests (and to this test's client): with torch's parallel regions on every core,
    any work beside them makes a step wait for the thread the OS set aside, and the stall test
    would measure that rather than the server's blocking."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with serving(make_llm(checkpoint), MODEL) as url:
            yield url, openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(served):
    return served[1]


def _refused(client, **extra) -> dict:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=16, extra_body=extra)
    return bad.value.body


@pytest.mark.parametrize("field,value,message", [
    ("guided_regex", EMPTY_REGEX, "allows no output"),
    ("guided_json", LOOPING_SCHEMA, "allows no output"),
    ("guided_regex", EXHAUSTING_REGEX, "exhausts the grammar engine's budget"),
])
def test_refused_before_generation(client, reference, field, value, message) -> None:
    body = _refused(client, **{field: value})
    assert body["param"] == field and message in body["message"] and body["type"] == "invalid_request_error"
    kind = {"guided_regex": "regex", "guided_json": "json_schema"}[field]
    with pytest.raises(ValueError, match=f"^{kind} {message}"):
        reference.generate("hi", SamplingParams(max_tokens=16, **{kind: value}), use_tqdm=False)


def test_a_dead_end_during_generation_is_a_client_error(client, reference) -> None:
    (offline,) = reference.generate("hi", SamplingParams(max_tokens=16, regex=DEAD_END_REGEX), use_tqdm=False)
    assert offline.finish_reason == "error" and offline.error_kind == "invalid_request"
    body = _refused(client, guided_regex=DEAD_END_REGEX)
    assert body["param"] == "guided_regex" and body["code"] == "structured_output_failed"
    assert "cannot continue" in body["message"]
    events = [json.loads(line[6:]) for line in client.completions.with_raw_response.create(
        model=MODEL, prompt="hi", max_tokens=16, stream=True, extra_body={"guided_regex": DEAD_END_REGEX},
    ).http_response.iter_lines() if line.startswith("data: {")]
    assert events[-1]["error"]["type"] == "invalid_request_error"
    assert events[-1]["error"]["code"] == "structured_output_failed"


def test_ten_thousand_choices(client) -> None:
    choices = [f"w{i:05d}" for i in range(10_000)]
    for temperature in (0, 1.0):
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "pick"}],
                                               max_tokens=16, temperature=temperature, seed=1,
                                               extra_body={"guided_choice": choices})
        assert reply.choices[0].message.content in choices and reply.choices[0].finish_reason == "stop"


def test_large_bodies_are_prepared_one_at_a_time(served, monkeypatch) -> None:
    """Bodies of LARGE_BODY_BYTES or more are parsed one after another (their parsing holds the
    interpreter; several at once stacked up in front of the engine thread), while a small body is
    not held behind them."""
    from verispec.serve import app

    url, _ = served
    spans: list[tuple[bool, float, float]] = []  # (large, start, end) of each parse
    parse = app.parse_body

    def slow_parse(model, raw):
        start = time.monotonic()
        time.sleep(0.3)
        spans.append((len(raw) >= app.LARGE_BODY_BYTES, start, time.monotonic()))
        return parse(model, raw)

    monkeypatch.setattr(app, "parse_body", slow_parse)
    large = json.dumps({"model": MODEL, "prompt": "x" * app.LARGE_BODY_BYTES, "max_tokens": 1}).encode()
    small = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    with httpx2.Client(base_url=url, timeout=60) as http:
        def send(body: bytes, delay: float) -> None:
            time.sleep(delay)
            http.post("/v1/completions", content=body, headers={"content-type": "application/json"})

        threads = [threading.Thread(target=send, args=args) for args in ((large, 0), (large, 0), (small, 0.1))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    big = sorted((start, end) for is_large, start, end in spans if is_large)
    (small_start,) = [start for is_large, start, _ in spans if not is_large]
    assert len(big) == 2 and big[1][0] >= big[0][1], big  # the second began after the first ended
    assert small_start < big[1][1] - 0.1, (small_start, big)  # not queued behind both


def _hostile_bodies() -> list[tuple[str, bytes]]:
    """(path, JSON body) of each hostile request: guided_choice lists of 10,000 choices (compiled
    and run) and 100,000 (2.3 MB, past max_grammar_bytes), grammars that
    exhaust the engine's budget or allow nothing, tools whose parameter schema is past the size
    limit, and tools whose grammar is built (then the prompt, the tools in the default preamble,
    is refused as too long for the tiny model)."""
    many = [f"w{i:05d}" for i in range(10_000)]
    too_many = [f"choice number {i}" for i in range(100_000)]
    wide = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 8} for i in range(6_000)}}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"x": {"enum": [f"v{i}-{j}" for j in range(300)]}}}}} for i in range(40)]
    completions = [{"guided_choice": many}, {"guided_choice": too_many}, {"guided_regex": EXHAUSTING_REGEX},
                   {"guided_json": LOOPING_SCHEMA}, {"guided_regex": EMPTY_REGEX}]
    chats = [{"tools": [{"type": "function", "function": {"name": "wide", "parameters": wide}}],
              "tool_choice": "required"}, {"tools": tools, "tool_choice": "required"}]
    return [("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4} | extra).encode())
            for extra in completions] + \
        [("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 4} | extra).encode()) for extra in chats]


def _largest_gap(client, url: str, hostile: list[tuple[str, bytes]]) -> tuple[float, list[int]]:
    """The largest gap between two chunks of a 150-token stream (after its first chunk) while
    the `hostile` requests (each from its own thread) arrive, and their status codes. The bodies
    are encoded beforehand: the server shares this process's interpreter, and encoding 2 MB
    here would stall it as the server's own work would."""
    gaps, statuses, last = [], [], None
    threads = []
    http = httpx2.Client(base_url=url, timeout=120)  # made now: a client loads certificates (GIL-held)

    def send(path: str, body: bytes) -> None:
        statuses.append(http.post(path, content=body, headers={"content-type": "application/json"}).status_code)

    stream = client.completions.create(model=MODEL, prompt="Once", max_tokens=150, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True, "num_speculative_tokens": 0})
    for chunk in stream:
        now = time.monotonic()
        if last is None:  # the stream is under way: let the hostile requests in
            threads = [threading.Thread(target=send, args=request) for request in hostile]
            for t in threads:
                t.start()
        else:
            gaps.append(now - last)
        last = now
    for t in threads:
        t.join(timeout=120)
    http.close()
    return max(gaps), statuses


def test_hostile_requests_do_not_stall_other_streams(served) -> None:
    """The issue's bound: hostile requests delay no other stream by more than 50 ms. The delay is
    the stream's largest gap between chunks with hostile requests arriving, less its largest gap
    without them (measured just before: a stream on a 2-core machine has gaps of its own, 5 to
    10 ms on an idle one, tens of milliseconds beside other load). Other work on the machine
    (the test suite runs on shared 2-core machines) can stretch either run, so the bound must
    hold in one of up to five tries. The test can fail: the grammar work the server did on its
    event loop before is asserted to take longer than the bound (2.9 s for the issue's 50,000
    rule-form choices; every stream waited it out). The figures are printed (pytest -s)."""
    url, client = served
    start = time.monotonic()
    SamplingParams(grammar=choice_grammar([f"choice number {i}" for i in range(100_000)]))  # the old on-loop work
    work = time.monotonic() - start
    hostile = _hostile_bodies()
    delays = []
    for _ in range(5):
        quiet, _ = _largest_gap(client, url, [])
        loud, statuses = _largest_gap(client, url, hostile)
        assert sorted(statuses) == [200] + [400] * (len(hostile) - 1), statuses  # only the 10,000 choices run
        delays.append(loud - quiet)
        print(f"largest gap: {loud * 1000:.1f} ms with hostile requests, {quiet * 1000:.1f} ms without; "
              f"the old on-loop work alone: {work * 1000:.0f} ms")
        if delays[-1] <= STALL_BOUND_S:
            break
    assert min(delays) <= STALL_BOUND_S, [round(d * 1000) for d in delays]
    assert work > 5 * STALL_BOUND_S, work
