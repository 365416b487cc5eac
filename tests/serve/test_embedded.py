"""The server on the embedded SmolLM2-135M-Instruct: a greedy chat answer, streamed and not,
equals the offline LLM.chat answer, with speculation on."""

from __future__ import annotations

import openai

from verispec import LLM, SamplingParams

from .conftest import serving

MESSAGES = [{"role": "user", "content": "List three rivers."}]


def test_embedded_model_chat_equals_llm_chat() -> None:
    llm = LLM(kv_cache_gib=0.05, progress=False)
    (offline,) = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    with serving(llm, "smollm2") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=24, temperature=0)
        stream = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=24, temperature=0,
                                                stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert reply.choices[0].message.content == offline.text == streamed
    assert reply.usage.completion_tokens == len(offline.token_ids)
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
