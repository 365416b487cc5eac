"""Many clients at once: mixed parameters all complete; clients that leave mid-stream free their
KV blocks; /metrics agrees with the outputs' own speculative stats."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx2
from prometheus_client.parser import text_string_to_metric_families

from .conftest import MODEL

MIXES = [
    dict(temperature=0, extra_body={"num_speculative_tokens": 0}),
    dict(temperature=0.8, seed=1, extra_body={"num_speculative_tokens": 3}),
    dict(temperature=0.7, top_p=0.9, extra_body={"guidance_scale": 1.5, "negative_prompt": "cold"}),
    dict(temperature=1.0, extra_body={"top_k": 5, "num_speculative_tokens": 2, "guidance_scale": 2.0}),
]


def _wait_for_free_cache(llm, timeout: float = 20.0) -> None:
    blocks = llm.engine.blocks
    deadline = time.monotonic() + timeout
    while blocks.num_free_blocks != blocks.num_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert blocks.num_free_blocks == blocks.num_blocks


def _stream(client, i: int) -> tuple[str, str | None]:
    mix = MIXES[i % len(MIXES)]
    extra = {"ignore_eos": True, **mix["extra_body"]}
    chunks = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"the sea {i}"}], max_tokens=12, stream=True,
        **{k: v for k, v in mix.items() if k != "extra_body"}, extra_body=extra)
    text, reason = "", None
    for chunk in chunks:
        text += chunk.choices[0].delta.content or ""
        reason = chunk.choices[0].finish_reason or reason
    return text, reason


def test_32_concurrent_streams_with_mixed_parameters_complete(client, server) -> None:
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda i: _stream(client, i), range(32)))
    assert all(reason == "length" and text for text, reason in results)
    _wait_for_free_cache(server[1])


def test_clients_leaving_mid_stream_free_their_blocks(client, server) -> None:
    def leave(i: int) -> int:
        stream = client.completions.create(model=MODEL, prompt=f"the winter {i}", max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True})
        seen = 0
        for _ in stream:
            seen += 1
            if seen == 3:
                break
        stream.close()
        return seen

    generated = _metric(server[0], "verispec_generation_tokens_total")
    with ThreadPoolExecutor(10) as pool:
        assert list(pool.map(leave, range(10))) == [3] * 10
    _wait_for_free_cache(server[1])
    assert not server[1].engine.has_unfinished()
    # Aborted, not run to the end: far fewer than the 10 x 200 tokens asked for.
    assert _metric(server[0], "verispec_generation_tokens_total") - generated < 1000


def test_clients_leaving_a_non_streamed_request_free_their_blocks(server, monkeypatch) -> None:
    """The server notices a non-streaming client that left (it polls) and aborts its request."""
    engine = server[1].engine
    step = engine.step

    def slow_step():  # ~250 tokens then take seconds, far longer than the client waits
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)

    def leave(i: int) -> None:
        body = {"model": MODEL, "prompt": f"the winter {i}", "max_tokens": 240, "ignore_eos": True}
        try:
            httpx2.post(server[0] + "/v1/completions", json=body, timeout=0.5)
        except httpx2.TimeoutException:
            return
        raise AssertionError("the request finished before the client left")

    generated = _metric(server[0], "verispec_generation_tokens_total")
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(leave, range(4)))
    _wait_for_free_cache(server[1])
    assert not engine.has_unfinished()
    assert _metric(server[0], "verispec_generation_tokens_total") - generated < 4 * 240 / 2


def _metric(base: str, name: str) -> float:
    for family in text_string_to_metric_families(httpx2.get(base + "/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_count_the_accepted_tokens_of_the_outputs(client, server) -> None:
    base = server[0]
    before = _metric(base, "verispec_spec_decode_accepted_tokens_total")
    generated_before = _metric(base, "verispec_generation_tokens_total")
    # A repetitive prompt: n-gram drafts get accepted.
    outs = [client.completions.create(model=MODEL, prompt="the cat the cat the cat the cat", max_tokens=24,
                                      temperature=0, extra_body={"ignore_eos": True, "num_speculative_tokens": k})
            for k in (1, 3)]
    assert all(o.usage.completion_tokens == 24 for o in outs)
    accepted = _metric(base, "verispec_spec_decode_accepted_tokens_total") - before
    assert _metric(base, "verispec_generation_tokens_total") - generated_before == 48
    assert accepted == sum(o.spec_decode_stats["num_accepted_tokens"] for o in outs) > 0
    families = {f.name for f in text_string_to_metric_families(httpx2.get(base + "/metrics").text)}
    assert {"verispec_requests_running", "verispec_kv_blocks_free", "verispec_time_to_first_token_seconds",
            "verispec_inter_token_latency_seconds", "verispec_spec_decode_mean_acceptance_length",
            "verispec_spec_decode_accepted_tokens_per_position"} <= families


def test_metrics_report_the_prefix_cache(client, server) -> None:
    base = server[0]
    before = {name: _metric(base, f"verispec_prefix_cache_{name}") for name in ("queries_total", "hits_total")}
    prompt = " ".join(["the cat sat on the mat and looked at the dog"] * 6)  # several full blocks
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    queries = _metric(base, "verispec_prefix_cache_queries_total") - before["queries_total"]
    hits = _metric(base, "verispec_prefix_cache_hits_total") - before["hits_total"]
    assert 0 < hits < queries  # the second request found the first one's blocks, not its last token
    assert _metric(base, "verispec_prefix_cache_blocks") > 0
