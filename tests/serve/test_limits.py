"""What one client may take of the server: body size, n x prompts, time to send a request,
connections, the engine thread's time; and /health when the engine is wedged. A server of its
own with tight limits, on 127.0.0.1, shut down at the end of the module."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2
import pytest

from verispec.config import ServeLimits

from .conftest import MODEL, make_llm, serving

LIMITS = ServeLimits(max_request_bytes=64 * 1024, max_choices=8, header_timeout_s=1.0, body_timeout_s=1.0,
                     max_connections=6, stall_s=1.0)


@pytest.fixture(scope="module")
def limited(checkpoint):
    llm = make_llm(checkpoint)
    with serving(llm, MODEL, LIMITS) as url:
        yield url, llm


def _works(base: str) -> None:
    r = httpx2.post(base + "/v1/completions", json={"model": MODEL, "prompt": "the", "max_tokens": 2,
                                                    "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_body_over_the_limit_is_a_413_before_parsing(limited) -> None:
    base, llm = limited
    big = b'{"model": "tiny", "prompt": "' + b"a" * (LIMITS.max_request_bytes + 1) + b'"}'
    r = httpx2.post(base + "/v1/completions", content=big, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "--max-request-bytes" in r.json()["error"]["message"]

    def chunks():  # no content-length: the limit counts what streams in
        for _ in range(big.__len__() // 4096 + 1):
            yield b"a" * 4096

    r = httpx2.post(base + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                    timeout=30)
    assert r.status_code == 413
    _works(base)


@pytest.mark.parametrize("n,prompt", [(9, "the"), (3, ["a", "b", "c"]), (1, ["a"] * 9)])
def test_n_times_prompts_is_capped(limited, n, prompt) -> None:
    r = httpx2.post(limited[0] + "/v1/completions", json={"model": MODEL, "prompt": prompt, "n": n}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "n" and str(LIMITS.max_choices) in error["message"]
    assert not limited[1].engine.has_unfinished()


def test_n_up_to_the_cap_is_served(limited) -> None:
    r = httpx2.post(limited[0] + "/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "n": 4,
                                                          "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


def test_a_huge_prompt_is_refused_without_tokenizing_it_or_holding_the_engine(limited, monkeypatch) -> None:
    """Tokenization runs off the engine thread, and a text too long for max_model_len tokens is
    refused before it is encoded."""
    llm = limited[1]
    engine_threads: list[str] = []
    encoded: list[int] = []
    prepare, encode = llm.engine.prepare_request, llm.tokenizer.encode

    def watched_prepare(*args, **kwargs):
        engine_threads.append(threading.current_thread().name)
        return prepare(*args, **kwargs)

    def watched_encode(text, *args, **kwargs):
        encoded.append(len(text))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(llm.engine, "prepare_request", watched_prepare)
    monkeypatch.setattr(llm.tokenizer, "encode", watched_encode)
    huge = "the " * (LIMITS.max_request_bytes // 4 - 20)
    assert len(huge) > 4 * llm.tokenizer.longest_token * llm.engine.config.max_model_len
    r = httpx2.post(limited[0] + "/v1/completions", json={"model": MODEL, "prompt": huge}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "characters" in r.json()["error"]["message"] and len(huge) not in encoded
    assert engine_threads and "verispec-engine" not in engine_threads
    _works(limited[0])


def test_a_half_sent_header_is_cut_off(limited) -> None:
    port = int(limited[0].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        assert s.recv(1024) == b""  # closed by the server, not by our own timeout
        assert time.monotonic() - start < LIMITS.header_timeout_s + 5


def test_a_half_sent_body_is_a_408(limited) -> None:
    port = int(limited[0].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 1000\r\n\r\n{\"model\": ")
        start = time.monotonic()
        reply = b""
        while chunk := s.recv(65536):  # the server closes the connection after answering
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
        assert time.monotonic() - start < LIMITS.body_timeout_s + 5
    _works(limited[0])


def test_connections_past_the_limit_get_503(limited) -> None:
    port = int(limited[0].rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.2)
        assert httpx2.get(limited[0] + "/v1/models", timeout=10).status_code == 503
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10
    while httpx2.get(limited[0] + "/v1/models", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the server did not recover after the connections closed"
        time.sleep(0.1)


def test_health_is_503_while_the_engine_is_wedged(limited, monkeypatch) -> None:
    base, llm = limited
    engine = llm.engine
    step, release = engine.step, threading.Event()

    def wedged():
        release.wait(30)
        return step()

    monkeypatch.setattr(engine, "step", wedged)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_works, base)
        try:
            deadline = time.monotonic() + 20
            while (health := httpx2.get(base + "/health", timeout=10)).status_code != 503:
                assert time.monotonic() < deadline, "/health never reported the wedged engine"
                time.sleep(0.1)
            assert health.json()["engine_busy_s"] >= LIMITS.stall_s and health.json()["status"] == "unhealthy"
        finally:
            release.set()
        pending.result(timeout=30)
    assert httpx2.get(base + "/health", timeout=10).status_code == 200


def test_one_requests_fan_out_does_not_queue_a_later_request_behind_it(checkpoint) -> None:
    """Two sequences at a time: a request of n=8 long samples, then a 2-token request. The
    later request takes the first free slot instead of waiting for all 8 samples."""
    from verispec import LLM

    llm = LLM(checkpoint, num_speculative_tokens=3, kv_cache_gib=0.002, max_num_batched_tokens=256,
              max_num_seqs=2, progress=False)
    with serving(llm, MODEL, LIMITS) as base, ThreadPoolExecutor(1) as pool:
        fan_out = pool.submit(httpx2.post, base + "/v1/completions", json={
            "model": MODEL, "prompt": "the", "n": 8, "max_tokens": 48, "ignore_eos": True}, timeout=120)
        deadline = time.monotonic() + 30
        while len(llm.engine.scheduler.running) < 2:
            assert time.monotonic() < deadline and not fan_out.done()
            time.sleep(0.01)
        _works(base)
        left = len(llm.engine.scheduler.running) + len(llm.engine.scheduler.waiting)
        assert left >= 4, f"the short request waited for {8 - left} of the 8 samples"
        assert fan_out.result().status_code == 200
