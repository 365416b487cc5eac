"""Tool calling through the server with OpenAI's client, over the tiny random checkpoint: every
tool_choice, streamed and not (the streamed deltas join into the whole response's calls),
parallel calls or one, a two-turn exchange with a tool result, greedy output the same with and
without drafts (and offline, LLM.chat with the same fields), the arguments of many seeded sampled
calls validating against their schemas (jsonschema), bad input as 400s naming the field, and
run-batch taking the same fields."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from verispec import LLM, SamplingParams
from verispec.cli import main
from verispec.model import Tokenizer
from verispec.model.gguf_vocab import build_bpe_tokenizer

from ..model.conftest import BOS_TEMPLATE, make_hf_tiny, tiny_vocab
from .conftest import MODEL, serving

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# The tiny vocabulary's first unused token spells "<tool_call>" here, as one token of Qwen's
# vocabulary does: a logit bias on it makes the random model begin a call where it pleases.
TOOL_CALL_TOKEN = tiny_vocab()[0].index("<unused0>")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """The serve tests' tiny checkpoint with a longer context (the default tool preamble is
    about 900 of its mostly one-character tokens) and a "<tool_call>" token (TOOL_CALL_TOKEN)."""
    directory = tmp_path_factory.mktemp("tools-tiny")
    make_hf_tiny(tied=False, max_position_embeddings=2048).save_pretrained(directory)
    tokens, types, merges = tiny_vocab()
    tokens[TOOL_CALL_TOKEN] = "<tool_call>"
    backend = build_bpe_tokenizer("llama-bpe", tokens, types, merges, bos_token_id=0, add_bos=True)
    Tokenizer(backend, bos_token_id=0, eos_token_id=2, chat_template=BOS_TEMPLATE).save(directory)
    return str(directory)


def _llm(checkpoint: str, draft: str = "ngram") -> LLM:
    return LLM(checkpoint, draft=draft, num_speculative_tokens=3, kv_cache_gib=0.05, max_num_batched_tokens=1024,
               progress=False)


@pytest.fixture(scope="module")
def reference(checkpoint) -> LLM:
    return _llm(checkpoint)


@pytest.fixture(scope="module")
def client(checkpoint):
    with serving(_llm(checkpoint), MODEL) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


def _valid(calls) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, after checking its shape and its arguments' schema."""
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def _streamed(client, **kwargs) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(name, arguments text)], finish_reason) joined from a stream's deltas."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for entry in choice.delta.tool_calls or []:
                if entry.id is not None:  # a call's first delta names it
                    assert entry.index == len(calls) and entry.type == "function"
                    calls[entry.index] = [entry.function.name, ""]
                calls[entry.index][1] += entry.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in range(len(calls))], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_required_and_named_calls_streamed_and_not(client, choice) -> None:
    kwargs = dict(messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=120,
                  parallel_tool_calls=False)
    reply = client.chat.completions.create(model=MODEL, **kwargs)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    (name, _), = _valid(message.tool_calls)
    assert name == "add" or choice == "required"
    content, streamed, finish = _streamed(client, **kwargs)
    assert content == "" and finish == "tool_calls"
    assert streamed == [(c.function.name, c.function.arguments) for c in message.tool_calls]


def test_parallel_calls(client) -> None:
    """Seeded answers with one call or more, streamed and not: the streamed calls (indexed 0,
    1, ...) are the whole answer's."""
    counts = []
    for seed in range(5, 17):
        kwargs = dict(messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, max_tokens=200)
        choice = client.chat.completions.create(model=MODEL, **kwargs).choices[0]
        calls = _valid(choice.message.tool_calls)
        counts.append(len(calls))
        # A parallel answer ends by itself or runs into max_tokens (a cut last call is left out).
        assert choice.finish_reason in ("tool_calls", "length") and calls
        content, streamed, finish = _streamed(client, **kwargs)
        assert content == "" and finish == choice.finish_reason
        whole = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert streamed[:len(whole)] == whole and len(streamed) <= len(whole) + 1  # + a cut last one
    assert max(counts) > 1, counts  # with a random model, more than one call somewhere


def test_auto_and_none(client) -> None:
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=40)
    message = auto.choices[0].message
    if message.tool_calls:  # the model's choice; a random model mostly writes text
        _valid(message.tool_calls)
    else:
        assert message.content and auto.choices[0].finish_reason in ("stop", "length")
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=40)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=40)
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == plain.choices[0].message.content  # no preamble, no grammar


def test_auto_reads_and_constrains_a_call_the_model_begins(client, checkpoint, reference) -> None:
    """A logit bias on the "<tool_call>" token makes the model begin a call, by itself, in auto
    mode; from there the grammar holds it to the tools' schemas and the server reads the call
    out: message.tool_calls and finish_reason "tool_calls", streamed and not, the same with and
    without drafts, and valid in every seeded sampled answer."""
    bias = {str(TOOL_CALL_TOKEN): 100}
    kwargs = dict(messages=ASK, tools=TOOLS, temperature=0, max_tokens=120, parallel_tool_calls=False,
                  logit_bias=bias)
    reply = client.chat.completions.create(model=MODEL, **kwargs)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    assert len(_valid(message.tool_calls)) == 1
    content, streamed, finish = _streamed(client, **kwargs)
    assert content == "" and finish == "tool_calls"
    assert streamed == [(c.function.name, c.function.arguments) for c in message.tool_calls]
    params = SamplingParams(temperature=0, max_tokens=120, logit_bias={TOOL_CALL_TOKEN: 100})
    plain = _llm(checkpoint, draft="none")
    outs = [llm.chat(ASK, params, use_tqdm=False, tools=TOOLS, parallel_tool_calls=False)[0]
            for llm in (plain, reference)]
    assert outs[0].token_ids == outs[1].token_ids and outs[1].stats.num_draft_tokens > 0
    assert [(c.name, c.arguments) for c in outs[0].tool_calls] == streamed
    unbiased = client.chat.completions.create(model=MODEL, **kwargs | {"logit_bias": None})
    assert unbiased.choices[0].message.tool_calls is None  # the random model alone writes text
    sampled = client.chat.completions.create(model=MODEL, **kwargs | {"temperature": 1.0, "seed": 3, "n": 8})
    for choice in sampled.choices:
        assert choice.finish_reason == "tool_calls" and len(_valid(choice.message.tool_calls)) == 1


def test_sampled_arguments_always_validate(client) -> None:
    """3 requests x n = 16 seeded sampled answers at temperature 1.2 from a random model."""
    for seed in range(3):
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, temperature=1.2, seed=seed,
                                               max_tokens=120, n=16)
        for choice in reply.choices:
            assert choice.finish_reason == "tool_calls", choice
            assert len(_valid(choice.message.tool_calls)) == 1


def test_two_turns_with_a_tool_result(client, reference) -> None:
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=120)
    call = first.choices[0].message.tool_calls[0]
    # As the README's example sends it back.
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0,
                                            max_tokens=30)
    (offline,) = reference.chat(history, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False, tools=TOOLS)
    message = second.choices[0].message
    assert (message.content or "") == (offline.text if not offline.tool_calls else "")
    assert [c.function.arguments for c in message.tool_calls or []] == [c.arguments for c in offline.tool_calls]
    # The result reached the prompt, after the call the model made.
    prompt = reference.tokenizer.decode(offline.prompt_token_ids, skip_special_tokens=False)
    assert call.function.arguments in prompt and '"content": "sunny, 21 C"' in prompt


def test_greedy_calls_are_the_same_with_and_without_drafts(client, checkpoint, reference) -> None:
    plain = _llm(checkpoint, draft="none")
    params = SamplingParams(temperature=0, max_tokens=120)
    for choice in ("required", "auto"):
        served = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                temperature=0, max_tokens=120)
        outs = [llm.chat(ASK, params, use_tqdm=False, tools=TOOLS, tool_choice=choice)[0] for llm in (plain, reference)]
        assert outs[0].token_ids == outs[1].token_ids
        assert outs[1].stats.num_draft_tokens > 0  # the reference speculated
        served_calls = [(c.function.name, c.function.arguments) for c in served.choices[0].message.tool_calls or []]
        assert served_calls == [(c.name, c.arguments) for c in outs[0].tool_calls]
        assert served.choices[0].finish_reason == outs[0].finish_reason


@pytest.mark.parametrize("extra,param,message", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "sub"}}), "tool_choice",
     "not among the tools"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0].function.name",
     "is invalid"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "a string"}}]),
     "tools[0].function.parameters", "expected a JSON Schema"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "objectx"}}}}}]), "tools", "objectx"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": json.loads(
        '{"type": "object", "properties": {"x": ' * 20 + '{}' + '}}' * 20)}}]), "tools[0].function.parameters",
     "max_schema_depth"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        f"p{i}": {"type": "string"} for i in range(12_000)}}}}]), "tools", "max_grammar_bytes"),
    (dict(tool_choice="required"), "tool_choice", "without tools"),
    (dict(tools=TOOLS, response_format={"type": "json_object"}), "tool_choice", "both set"),
    (dict(tools=TOOLS, messages=ASK + [{"role": "tool", "content": "3"}]), "messages[1].tool_call_id", "missing"),
])
def test_bad_input_is_a_400_naming_the_field(client, extra, param, message) -> None:
    kwargs = dict(messages=ASK, max_tokens=8) | extra
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, **kwargs)
    assert bad.value.body["param"] == param and message in bad.value.body["message"], bad.value.body


def test_run_batch_takes_the_same_fields(client, checkpoint, tmp_path) -> None:
    bodies = {"named": dict(tool_choice={"type": "function", "function": {"name": "add"}}),
              "required": dict(tool_choice="required", parallel_tool_calls=False),
              "bad": dict(tool_choice={"type": "function", "function": {"name": "sub"}})}
    lines = [json.dumps({"custom_id": key, "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 120} | extra})
        for key, extra in bodies.items()]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--model",
                 checkpoint, "--served-model-name", MODEL, "--kv-cache-gib", "0.05", "-k", "3", "--no-progress"]) == 0
    lines_out = (tmp_path / "out.jsonl").read_text().splitlines()
    records = {r["custom_id"]: r["response"] for r in map(json.loads, lines_out)}
    assert records["bad"]["status_code"] == 400 and records["bad"]["body"]["error"]["param"] == "tool_choice"
    for key in ("named", "required"):
        served = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                                max_tokens=120, **bodies[key])
        choice = records[key]["body"]["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == \
            [(c.function.name, c.function.arguments) for c in served.choices[0].message.tool_calls]
