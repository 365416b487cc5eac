"""Bad input gets 400 with OpenAI's error object naming the parameter, and the server goes on."""

from __future__ import annotations

import httpx2
import openai
import pytest

from .conftest import MODEL


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL, "prompt": "the", "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "the", "top_p": 2}, "top_p"),
    ({"model": MODEL, "prompt": "the", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "the", "max_tokens": 2**70}, "max_tokens"),  # beyond the context
    ({"model": MODEL, "prompt": "the", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"model": MODEL, "prompt": "the", "logit_bias": {"5": 500}}, "logit_bias"),
    ({"model": MODEL, "prompt": "the", "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"model": MODEL, "prompt": "the " * 400}, "prompt"),
    ({"model": MODEL, "prompt": [[1, 2], [99999]]}, "prompt"),
    ({"model": MODEL, "prompt": "the", "n": 0}, "n"),
    ({"model": MODEL, "prompt": "the", "logprobs": 21}, "logprobs"),
    ({"model": MODEL, "prompt": "the", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"model": MODEL, "prompt": "the", "temperature": "hot"}, "temperature"),
    # Strict types, as OpenAI's API: a string is not a number or a boolean.
    ({"model": MODEL, "prompt": "the", "n": "2"}, "n"),
    ({"model": MODEL, "prompt": "the", "logprobs": "2"}, "logprobs"),
    ({"model": MODEL, "prompt": "the", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
    ({"model": MODEL, "prompt": "the", "max_tokens": "4"}, "max_tokens"),
    ({"model": MODEL, "prompt": "the", "ignore_eos": "yes"}, "ignore_eos"),
    ({"model": MODEL, "prompt": "the", "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"model": MODEL}, "prompt"),
])
def test_bad_completion_requests_name_the_parameter(server, body, param) -> None:
    for stream in (False, True):
        r = httpx2.post(server[0] + "/v1/completions", json=body | {"stream": stream})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL, "messages": [{"role": "user", "content": "the"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "the"}], "logprobs": True, "top_logprobs": 30},
     "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "the " * 400}]}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "the"}], "max_tokens": 2**70}, "max_tokens"),
])
def test_bad_chat_requests_name_the_parameter(server, body, param) -> None:
    r = httpx2.post(server[0] + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_string_is_not_a_boolean_for_stream(server) -> None:
    r = httpx2.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "the", "stream": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


def test_an_unknown_model_is_a_404(server, client) -> None:
    for path, body in (("/v1/completions", {"prompt": "the"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the"}]})):
        r = httpx2.post(server[0] + path, json={"model": "gpt-4"} | body)
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model" and "gpt-4" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="the", max_tokens=2)


HUGE = "x" * 1_000_000


@pytest.mark.parametrize("field,value", [("max_tokens", HUGE), ("temperature", HUGE), ("model", HUGE),
                                         ("logit_bias", {HUGE: 1}), ("seed", [HUGE] * 3)])
def test_error_bodies_echo_a_shortened_value(server, field, value) -> None:
    r = httpx2.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "the", field: value},
                    timeout=60)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == field, r.text[:300]
    assert len(r.content) < 2_000 and "xxxxxxxx" in r.json()["error"]["message"]


def test_json_nested_too_deep_gets_the_openai_error_object(server) -> None:
    r = httpx2.post(server[0] + "/v1/completions", content=b"[" * 100_000 + b"]" * 100_000,
                    headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "json_invalid" and error["message"]
    r = httpx2.get(server[0] + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


def test_malformed_json_is_a_400(server) -> None:
    r = httpx2.post(server[0] + "/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                    headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error" and "JSON" in r.json()["error"]["message"]


def test_the_client_sees_a_bad_request_and_the_server_still_answers(client, server) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the"}], top_p=2)
    assert caught.value.status_code == 400 and caught.value.body["param"] == "top_p"
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the"}], max_tokens=3,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    assert server[1].engine.blocks.num_free_blocks == server[1].engine.blocks.num_blocks


def test_a_failing_step_fails_the_requests_in_flight_and_the_server_goes_on(client, server, monkeypatch) -> None:
    engine = server[1].engine
    step = engine.step

    def fails_once() -> list:
        monkeypatch.setattr(engine, "step", step)
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "step", fails_once)
    with pytest.raises(openai.InternalServerError, match="device lost"):
        client.completions.create(model=MODEL, prompt="the", max_tokens=4)
    out = client.completions.create(model=MODEL, prompt="the", max_tokens=4, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and not engine.has_unfinished()
