"""The `speculation` extension of streamed chunks (serve/speculation.py), through OpenAI's own
client, against the engine's per-step records of the same seeded request run offline."""

from __future__ import annotations

import httpx2

from verispec import SamplingParams

from .conftest import MODEL

MESSAGES = [{"role": "user", "content": "the winter and the winter and the sea"}]
# One draft a step: on the tiny random model every kind of token then turns up in 40 (an accepted
# draft is also a bonus step; at K = 3 three drafts in a row are rarely all taken).
COMMON = dict(model=MODEL, messages=MESSAGES, max_tokens=40, seed=11, temperature=0.3,
              extra_body={"ignore_eos": True, "num_speculative_tokens": 1})


def _engine_steps(llm) -> list[tuple[int, int, int, list[int], list[str]]]:
    """(step, drafted, accepted, token ids, origins) of each step of COMMON's request, run on
    the offline engine."""
    engine = llm.engine
    prompt = llm.tokenizer.apply_chat_template(MESSAGES)
    params = SamplingParams(temperature=0.3, seed=11, max_tokens=40, ignore_eos=True)
    engine.enqueue(engine.prepare_request(prompt, params, "trace-ref", 1, add_special_tokens=False))
    steps = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_step is not None:
                r = out.new_step
                steps.append((r.step, r.num_draft, r.num_accepted, out.new_token_ids,
                              [o.value for o in r.origins(len(out.new_token_ids))]))
    return steps


def test_streamed_marks_are_the_engines_records(client, reference) -> None:
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True, "include_speculation": True}, **COMMON))
    traced = [c.choices[0].model_extra["speculation"] for c in chunks if c.choices
              and c.choices[0].model_extra.get("speculation") is not None]
    got = [(s["step"], s["drafted"], s["accepted"], [t["id"] for t in s["tokens"]],
            [t["origin"] for t in s["tokens"]]) for s in traced]
    assert got == _engine_steps(reference)
    assert [s["step"] for s in traced] == list(range(1, len(traced) + 1))
    origins = [o for step in got for o in step[4]]
    assert len(origins) == 40 and set(origins) == {"accepted", "recovered", "bonus", "plain"}
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "".join(t["text"] for s in traced for t in s["tokens"]) == content
    body = {k: v for k, v in COMMON.items() if k != "extra_body"} | COMMON["extra_body"]
    whole = httpx2.post(str(client.base_url) + "chat/completions", json=body, timeout=60).json()
    stats = whole["spec_decode_stats"]
    assert whole["choices"][0]["message"]["content"] == content
    assert origins.count("accepted") == stats["num_accepted_tokens"] and len(traced) == stats["num_steps"]
    assert sum(s["drafted"] for s in traced) == stats["num_draft_tokens"]


def test_without_asking_the_chunks_are_openais(client) -> None:
    chunks = list(client.chat.completions.create(stream=True, **COMMON))
    assert len(chunks) > 2
    assert all("speculation" not in (c.choices[0].model_extra or {}) for c in chunks if c.choices)


def test_a_stop_string_cuts_the_content_not_the_tokens(client) -> None:
    whole = client.chat.completions.create(**COMMON).choices[0].message.content
    stop = whole[10:13]
    chunks = list(client.chat.completions.create(
        stream=True, stop=[stop], stream_options={"include_speculation": True}, **COMMON))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    texts = "".join(t["text"] for c in chunks if c.choices and c.choices[0].model_extra.get("speculation")
                    for t in c.choices[0].model_extra["speculation"]["tokens"])
    assert content == whole[: whole.index(stop)] and texts.startswith(content + stop)
