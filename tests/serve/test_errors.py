"""Bad input gets 400 with OpenAI's error object naming the parameter, and the server goes on."""

from __future__ import annotations

import httpx2
import openai
import pytest

from .conftest import MODEL


@pytest.mark.parametrize("body,param", [
    ({"model": "gpt-4", "prompt": "the"}, "model"),
    ({"model": MODEL, "prompt": "the", "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "the", "top_p": 2}, "top_p"),
    ({"model": MODEL, "prompt": "the", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "the", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"model": MODEL, "prompt": "the", "logit_bias": {"5": 500}}, "logit_bias"),
    ({"model": MODEL, "prompt": "the", "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"model": MODEL, "prompt": "the " * 400}, "prompt"),
    ({"model": MODEL, "prompt": [[1, 2], [99999]]}, "prompt"),
    ({"model": MODEL, "prompt": "the", "n": 0}, "n"),
    ({"model": MODEL, "prompt": "the", "logprobs": 21}, "logprobs"),
    ({"model": MODEL, "prompt": "the", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"model": MODEL, "prompt": "the", "temperature": "hot"}, "temperature"),
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
])
def test_bad_chat_requests_name_the_parameter(server, body, param) -> None:
    r = httpx2.post(server[0] + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


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
