"""The endpoints through OpenAI's client: texts, streams, usage, logprobs, n, models, health."""

from __future__ import annotations

import httpx2
import pytest

from verispec import SamplingParams

from .conftest import MODEL

PROMPT = "the winter and the sea"
MESSAGES = [{"role": "user", "content": "the winter"}]
EXTRA = {"ignore_eos": True}  # random weights: EOS could end a text after one token


def test_greedy_completion_equals_llm_generate(client, reference) -> None:
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=EXTRA)
    (want,) = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                 use_tqdm=False)
    assert got.choices[0].text == want.text and len(want.token_ids) == 12
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == 12 and got.usage.total_tokens == len(want.prompt_token_ids) + 12


def test_greedy_chat_equals_llm_chat(client, reference) -> None:
    got = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=10, temperature=0,
                                         extra_body=EXTRA)
    (want,) = reference.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                             use_tqdm=False)
    message = got.choices[0].message
    assert message.role == "assistant" and message.content == want.text
    assert got.object == "chat.completion" and got.model == MODEL
    assert got.usage.prompt_tokens == len(want.prompt_token_ids) and got.usage.completion_tokens == 10


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_concatenates_to_the_whole_text(client, chat) -> None:
    common = dict(model=MODEL, max_tokens=16, seed=7, temperature=0.9, extra_body=EXTRA)
    if chat:
        whole = client.chat.completions.create(messages=MESSAGES, **common).choices[0].message.content
        chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True,
                                                     stream_options={"include_usage": True}, **common))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        whole = client.completions.create(prompt=PROMPT, **common).choices[0].text
        chunks = list(client.completions.create(prompt=PROMPT, stream=True,
                                                stream_options={"include_usage": True}, **common))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert len(chunks) > 2 and streamed == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_n_samples_use_consecutive_seeds(client) -> None:
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, seed=3, n=3, extra_body=EXTRA)
    texts = [c.text for c in sorted(got.choices, key=lambda c: c.index)]
    again = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, seed=3 + i,
                                       extra_body=EXTRA).choices[0].text for i in range(3)]
    assert texts == again and len(set(texts)) > 1
    assert got.usage.completion_tokens == 24


def test_a_list_of_prompts_gives_one_choice_each(client) -> None:
    got = client.completions.create(model=MODEL, prompt=["the", "a cat"], max_tokens=4, temperature=0,
                                    extra_body=EXTRA)
    assert [c.index for c in got.choices] == [0, 1] and all(c.text for c in got.choices)


def test_chat_logprobs_have_the_requested_alternatives(client) -> None:
    got = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, logprobs=True, temperature=0,
                                         top_logprobs=3, extra_body=EXTRA)
    content = got.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(c.token for c in content) == got.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and c.logprob <= 0
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)


def test_completion_logprobs_in_the_legacy_shape(client) -> None:
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=2, temperature=0,
                                    extra_body=EXTRA)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    # Greedy: the emitted token is its row's likeliest.
    assert all(max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == got.choices[0].text


def test_models_and_health(client, server) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx2.get(server[0] + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["engine_alive"]
