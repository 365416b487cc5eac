"""Hostile structured-output requests against the server (tiny checkpoint, OpenAI's client): an
empty language and a grammar that exhausts the grammar engine's budget are 400s naming the field
before generation (and ValueErrors offline); a grammar that dead-ends mid-generation ends its
request with a 400 (streamed: an invalid_request_error event), never a 500; guided_choice takes
10,000 choices; and a stream's chunks keep coming while hostile requests are checked."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest

from verispec import SamplingParams
from verispec.structured.choice import choice_grammar

from .conftest import MODEL, make_llm, serving

EMPTY_REGEX = "[^\\x00-\\U0010FFFF]"
LOOPING_SCHEMA = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
EXHAUSTING_REGEX = "(a{1000}){1000}"  # the lexer runs out of expressions within its first masks
DEAD_END_REGEX = "ab\u00e9"  # no token of the tiny vocabulary spells é: stuck after "ab"


@pytest.fixture(scope="module")
def client(checkpoint):
    """A server of its own: the load these tests make would skew the step costs the session's
    server learns (adaptive K), and with them other tests' drafting."""
    with serving(make_llm(checkpoint), MODEL) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


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


def _largest_gap(client, hostile: list[dict] | None) -> tuple[float, list[float]]:
    """The largest gap between two chunks of a 150-token stream (after its first chunk) while
    `hostile` requests (each on its own thread) arrive, and how long each took to be answered."""
    gaps, answered, last = [], [], None
    threads = []

    def send(extra: dict) -> None:
        start = time.monotonic()
        try:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body=extra)
        except openai.BadRequestError:
            pass
        answered.append(time.monotonic() - start)

    stream = client.completions.create(model=MODEL, prompt="Once", max_tokens=150, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True, "num_speculative_tokens": 0})
    for chunk in stream:
        now = time.monotonic()
        if last is None:  # the stream is under way: let the hostile requests in
            threads = [threading.Thread(target=send, args=(extra,)) for extra in hostile or []]
            for t in threads:
                t.start()
        else:
            gaps.append(now - last)
        last = now
    for t in threads:
        t.join(timeout=120)
    return max(gaps), answered


def test_hostile_requests_do_not_stall_other_streams(client) -> None:
    """The issue's bound is 50 ms. On the shared, loaded 2-core test machine a stream's largest
    gap varies by tens of milliseconds with no hostile request at all (24 to 80 ms measured), so
    the assertion is relative: with hostile requests the largest gap stays within 50 ms of the
    largest without them (measured just before) plus 100 ms of slack for the load, in one of up
    to three tries. It is meaningful: the grammar work the server did on its event loop before
    (building and validating a request's grammar: here 100,000 choices) is asserted to take
    longer than that bound, and its whole length was the stall (2.9 s for the issue's 50,000
    rule-form choices). The figures are printed (pytest -s)."""
    many = [f"choice number {i}" for i in range(20_000)]  # under max_grammar_bytes: compiled and run
    too_many = [f"choice number {i}" for i in range(100_000)]  # over it: refused once validated
    start = time.monotonic()
    SamplingParams(grammar=choice_grammar(too_many))  # what the event loop used to do for it
    work = time.monotonic() - start
    hostile = [{"guided_choice": many}, {"guided_choice": too_many}, {"guided_regex": EXHAUSTING_REGEX},
               {"guided_json": LOOPING_SCHEMA}, {"guided_regex": EMPTY_REGEX}]
    tries = []
    for _ in range(3):
        quiet, _ = _largest_gap(client, None)
        loud, answered = _largest_gap(client, hostile)
        assert len(answered) == len(hostile)
        tries.append((loud, quiet + 0.05 + 0.1))
        print(f"largest gap: {loud * 1000:.1f} ms with hostile requests, {quiet * 1000:.1f} ms without; "
              f"the old on-loop work alone: {work * 1000:.0f} ms; hostile answered in "
              f"{', '.join(f'{a * 1000:.0f}' for a in answered)} ms")
        if loud < tries[-1][1]:
            break
    assert any(loud < bound for loud, bound in tries), tries
    assert work > max(bound for _, bound in tries), (work, tries)
