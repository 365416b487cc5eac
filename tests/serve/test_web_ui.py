"""The chat page at GET /, in a real headless Chromium (tests/serve/browser.py): it loads, a
seeded message streams with each token marked as the server recorded it, stop frees the
request, a dropped connection is said and frees the request, regenerate redraws the answer,
the server's errors are shown; --no-web-ui serves no page."""

from __future__ import annotations

import json
import time

import httpx2
import pytest

from .browser import start_chromium
from .conftest import MODEL, serving
from .cutting_proxy import cutting_proxy

PROMPT = "the winter and the winter and the sea"
# One draft a step: on the tiny random model every kind of token then turns up in 40 (an accepted
# draft is also a bonus step; at K = 3 three drafts in a row are rarely all taken).
SEEDED = {"temperature": "0.3", "seed": "11", "max_tokens": "40", "num_speculative_tokens": "1"}

# The tokens of the latest answer as the page shows them: (id, origin, step, text, title).
LAST_TOKENS = """
const answers = document.querySelectorAll('.message.assistant');
if (!answers.length) return [];
return [...answers[answers.length - 1].querySelectorAll('.tok')].map(
  (s) => [Number(s.dataset.id), s.dataset.origin, Number(s.dataset.step), s.textContent, s.title]);
"""
LAST_STATE = """
const answers = document.querySelectorAll('.message.assistant, .message.error');
return answers.length ? answers[answers.length - 1].dataset.state : null;
"""
# Records the number of marked tokens each time the page changes, to see them arrive in parts.
WATCH_TOKENS = """
window.tokenCounts = [];
new MutationObserver(() => window.tokenCounts.push(document.querySelectorAll('.message.assistant .tok').length))
  .observe(document.getElementById('conversation'), {childList: true, subtree: true});
"""
# Presses Stop as soon as the first marked token is shown.
STOP_AT_FIRST_TOKEN = """
new MutationObserver((_, observer) => {
  if (document.querySelector('.message.assistant .tok')) {
    observer.disconnect();
    document.getElementById('stop').click();
  }
}).observe(document.getElementById('conversation'), {childList: true, subtree: true});
"""


@pytest.fixture(scope="module")
def browser():
    driver = start_chromium()
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def page(browser, server):
    """The page freshly loaded from the test server."""
    browser.get(server[0] + "/")
    _wait(browser, lambda: browser.execute_script("return document.getElementById('model-name').textContent"))
    return browser


def _wait(browser, condition, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "the page did not get there in time"
        time.sleep(0.05)
    return value


def _fill(browser, **fields: str) -> None:
    browser.execute_script("for (const [id, value] of Object.entries(arguments[0]))"
                           " document.getElementById(id).value = value;", fields)


def _send(browser, text: str) -> None:
    _fill(browser, prompt=text)
    browser.execute_script("document.getElementById('send').click()")


def _finished(browser, states: tuple[str, ...] = ("done",)) -> str:
    return _wait(browser, lambda: (s := browser.execute_script(LAST_STATE)) in states + ("error", "dropped") and s)


def _server_record(url: str, body: dict) -> tuple[list[tuple[int, str, int, str]], int]:
    """(id, origin, step, text) of each token of the streamed answer to `body`, as the server
    sends them in the speculation extension, and the draft tokens its steps verified."""
    body = body | {"model": MODEL, "stream": True, "stream_options": {"include_speculation": True}}
    record, drafted = [], 0
    with httpx2.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                spec = choice.get("speculation")
                if spec is not None:
                    drafted += spec["drafted"]
                    record += [(t["id"], t["origin"], spec["step"], t["text"]) for t in spec["tokens"]]
    return record, drafted


def _seeded_body() -> dict:
    return {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0.3, "seed": 11, "max_tokens": 40,
            "num_speculative_tokens": 1}


def test_the_page_loads_with_the_model_and_its_drafter(page) -> None:
    assert page.title == "verispec"
    assert page.execute_script("return document.getElementById('model-name').textContent") == MODEL
    drafter = page.execute_script("return document.getElementById('drafter-name').textContent")
    assert drafter.startswith("ngram") and "3 drafts" in drafter
    assert [e for e in page.get_log("browser") if e["level"] == "SEVERE"] == []


def test_a_seeded_answer_streams_marked_as_the_server_recorded_it(page, server) -> None:
    page.execute_script(WATCH_TOKENS)
    _fill(page, **SEEDED)
    _send(page, PROMPT)
    assert _finished(page) == "done"
    shown = page.execute_script(LAST_TOKENS)
    want, drafted = _server_record(server[0], _seeded_body())
    assert [(i, o, s, t) for i, o, s, t, _ in shown] == want
    origins = [o for _, o, _, _ in want]
    assert set(origins) == {"accepted", "recovered", "bonus", "plain"}
    counts = page.execute_script("return window.tokenCounts")
    assert len({c for c in counts if 0 < c < len(shown)}) >= 2, f"the tokens came at once: {counts}"
    step, origin, title = shown[0][2], shown[0][1], shown[0][4]
    assert title.startswith(f"step {step}: ") and origin in title
    accepted = origins.count("accepted")
    steps = len({s for _, _, s, _ in want})
    stats = page.execute_script("return ['stat-tokens', 'stat-per-step', 'stat-acceptance', 'stat-rate']"
                                ".map((id) => document.getElementById(id).textContent)")
    assert stats[0] == str(len(want)) and stats[1] == f"{len(want) / steps:.2f}"
    assert stats[2] == f"{100 * accepted / drafted:.0f}%" and float(stats[3]) > 0
    text = page.execute_script("return document.querySelector('.message.assistant .body').textContent")
    assert text == "".join(t for _, _, _, t in want)


def test_regenerate_draws_the_seeded_answer_again(page) -> None:
    _fill(page, **SEEDED)
    _send(page, PROMPT)
    assert _finished(page) == "done"
    first = page.execute_script(LAST_TOKENS)
    # The redrawn answer is a new element: waiting for it (not for a "streaming" state, which a
    # short answer can pass between two polls) cannot miss it.
    page.execute_script("window.firstAnswer = [...document.querySelectorAll('.message.assistant')].pop();"
                        "document.getElementById('regenerate').click()")
    _wait(page, lambda: page.execute_script(
        "const a = [...document.querySelectorAll('.message.assistant')].pop();"
        "return a !== undefined && a !== window.firstAnswer"))
    assert _finished(page) == "done"
    assert page.execute_script("return document.querySelectorAll('.message.assistant').length") == 1
    assert [t[:3] for t in page.execute_script(LAST_TOKENS)] == [t[:3] for t in first]


def test_stop_ends_the_answer_and_frees_the_request(page, server) -> None:
    url = server[0]
    # Greedy and long: this prompt's answer runs to max_tokens, so only Stop ends it early.
    _fill(page, temperature="0", max_tokens="200")
    page.execute_script(STOP_AT_FIRST_TOKEN)
    _send(page, PROMPT)
    assert _finished(page, ("stopped",)) == "stopped"
    stopped = len(page.execute_script(LAST_TOKENS))
    full, _ = _server_record(url, {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
                                "max_tokens": 200})
    assert 0 < stopped < len(full)
    note = page.execute_script("return document.querySelector('.message.assistant .note').textContent")
    assert note == "Stopped."
    _wait_idle(url)
    assert page.execute_script("return !document.getElementById('send').disabled "
                               "&& document.getElementById('stop').disabled")


def _wait_idle(url: str) -> None:
    """Until the server holds no request: a request whose client left is aborted."""
    deadline = time.monotonic() + 10
    while (health := httpx2.get(url + "/health").json())["requests_running"] + health["requests_waiting"]:
        assert time.monotonic() < deadline, f"a request whose client left is still on the server: {health}"
        time.sleep(0.05)


def test_a_dropped_connection_is_said_and_frees_the_request(browser, server) -> None:
    url = server[0]
    port = int(url.rsplit(":", 1)[1])
    # Cut after the stream's first chunks (`data: {"id"` is in no file of the page).
    with cutting_proxy(port, b'data: {"id"') as (proxied, cut):
        browser.get(proxied + "/")
        _fill(browser, temperature="0", max_tokens="200")
        _send(browser, PROMPT)
        assert _finished(browser, ("dropped",)) == "dropped"
        assert cut.is_set()
    note = browser.execute_script("return document.querySelector('.message.assistant .note').textContent")
    assert note.startswith("The connection to the server was lost")
    _wait_idle(url)
    assert browser.execute_script("return !document.getElementById('send').disabled")


@pytest.mark.parametrize("field,value,message", [
    ("temperature", "-1", "temperature=-1"),
    ("max_tokens", "many", "max_tokens"),
    ("json_schema", "{not json", "guided_json"),
])
def test_the_servers_error_is_shown(page, field, value, message) -> None:
    _fill(page, **{field: value})
    _send(page, "hello")
    assert _finished(page) == "error"
    shown = page.execute_script("return [...document.querySelectorAll('.message.error .body')].pop().textContent")
    assert shown.startswith("400: ") and message in shown
    assert page.execute_script("return !document.getElementById('send').disabled")


def test_no_web_ui_serves_no_page(server) -> None:
    url, llm = server
    page = httpx2.get(url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '"model": "tiny"' in page.text and "{{CONFIG}}" not in page.text
    assert httpx2.get(url + "/static/chat.js").status_code == 200
    assert httpx2.get(url + "/static/other.js").status_code == 404
    with serving(llm, MODEL, web_ui=False) as bare:
        assert httpx2.get(bare + "/").status_code == 404
        assert httpx2.get(bare + "/static/chat.js").status_code == 404
        assert httpx2.get(bare + "/v1/models").json()["data"][0]["id"] == MODEL
