"""verispec.tools without a model: tools and tool_choice checked with errors naming the field,
the call grammar (auto is free text until "<tool_call>", then constrained), calls read back whole
and streamed in random increments (the fragments join into the whole reading), and the prompt
(the default preamble and tool traffic for a template without tools; a template with tools gets
them itself)."""

from __future__ import annotations

import json
import random

import pytest

from verispec.structured import GrammarCompiler, GrammarSpec
from verispec.tools import DEFAULT_PREAMBLE, StreamedCalls, render_tool_chat, split_calls, tool_grammar, tool_use
from verispec.tools.prompt import check_messages, takes_tools

from ..model.conftest import tiny_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("tools,choice,parallel,message", [
    ([{"type": "function", "function": {}}], None, None, r"^tools\[0\]\.function\.name=None is invalid"),
    ([{"type": "function", "function": {"name": "a b"}}], None, None, r"^tools\[0\]\.function\.name='a b'"),
    ([ADD, {"type": "function", "function": {"name": "x", "parameters": 5}}], None, None,
     r"^tools\[1\]\.function\.parameters=5 is invalid: expected a JSON Schema"),
    ([{"type": "function", "function": {"name": "x", "parameters": {"type": "array"}}}], None, None,
     r"^tools\[0\]\.function\.parameters=.* is invalid"),
    ([ADD, ADD], None, None, r"^tools\[1\]\.function\.name='add' is invalid: another tool has that name"),
    ([{"type": "retrieval"}], None, None, r"^tools\[0\] is invalid"),
    ([ADD], "sometimes", None, r"^tool_choice='sometimes' is invalid"),
    ([ADD], {"type": "function", "function": {"name": "sub"}}, None,
     r"^tool_choice names function 'sub', which is not among the tools \(add\)"),
    ([ADD], {"type": "function"}, None, r"^tool_choice=.* is invalid"),
    (None, "required", None, r"^tool_choice='required' is invalid without tools"),
    ([ADD], "auto", "yes", r"^parallel_tool_calls='yes' is invalid: expected a bool"),
])
def test_bad_tools_name_the_field(tools, choice, parallel, message) -> None:
    with pytest.raises(ValueError, match=message):
        tool_use(tools, choice, parallel)


def test_tool_choice_modes() -> None:
    assert tool_use(None) is None and tool_use([], "none") is None
    auto = tool_use([WEATHER, ADD])
    assert auto.mode == "auto" and auto.parallel and [t.name for t in auto.callable] == ["get_weather", "add"]
    named = tool_use([WEATHER, ADD], {"type": "function", "function": {"name": "add"}}, True)
    assert named.mode == "required" and not named.parallel and [t.name for t in named.callable] == ["add"]
    assert not tool_use([ADD], "none").active
    assert not tool_use([ADD], "required", False).parallel


def _allowed(matcher) -> list[int]:
    return matcher.masks([[]])[0].nonzero().flatten().tolist()


def test_auto_is_free_until_a_call_starts_then_follows_the_schema() -> None:
    tok = tiny_tokenizer()
    compiler = GrammarCompiler(tok, tok.vocab_size, [tok.eos_token_id])
    auto = compiler.matcher(GrammarSpec.from_field("grammar", tool_grammar(tool_use([WEATHER, ADD]))))
    assert len(_allowed(auto)) > 90  # free text: (nearly) every printable token
    for t in tok.encode("Let me see. <tool_call>", add_special_tokens=False):
        auto.advance(t)
    forced = ""
    while len(allowed := _allowed(auto)) == 1:  # the grammar forces the call's head
        forced += tok.decode(allowed)
        auto.advance(allowed[0])
    assert forced == '\n{"name": "'
    assert {tok.decode([t]) for t in allowed} <= {"g", "a", "ge", "ad"}  # the tools' names begin so
    required = compiler.matcher(GrammarSpec.from_field("grammar", tool_grammar(tool_use([ADD], "required"))))
    text = ""
    while len(allowed := _allowed(required)) == 1:
        text += tok.decode(allowed)
        required.advance(allowed[0])
    assert text == '<tool_call>\n{"name": "add", "arguments": {"a": '


WHOLE = ('Checking.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": -2}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "}\\n</tool_call>", "unit": "c"}}\n</tool_call>')


def test_calls_read_whole_and_streamed_agree() -> None:
    content, calls = split_calls(WHOLE)
    assert content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": -2}), ("get_weather", {"city": "}\n</tool_call>", "unit": "c"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    rng = random.Random(0)
    for _ in range(300):
        stream, streamed, names, arguments, at = StreamedCalls(), "", {}, {}, 0
        while at < len(WHOLE):
            step = rng.randint(1, 8)
            text, entries = stream.feed(WHOLE[at:at + step])
            at += step
            streamed += text
            for e in entries:
                if "id" in e:  # a call's first delta: index, id, type, name
                    assert e["type"] == "function" and e["index"] == len(names)
                    names[e["index"]], arguments[e["index"]] = e["function"]["name"], ""
                arguments[e["index"]] += e["function"]["arguments"]
        streamed += stream.finish()
        assert streamed == content and stream.calls == 2
        assert [(names[i], arguments[i]) for i in range(2)] == [(c.name, c.arguments) for c in calls]


def test_text_without_complete_calls() -> None:
    assert split_calls("no calls <tool_call") == ("no calls <tool_call", [])
    cut = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b'
    assert split_calls(cut) == (cut, [])
    content, calls = split_calls(WHOLE.split("\n<tool_call>\n{\"name\": \"get")[0] + '\n<tool_call>\n{"na')
    assert content == "Checking." and [c.name for c in calls] == ["add"]  # the cut last call is left out
    stream = StreamedCalls()
    assert stream.feed("a <tool_") == ("a ", []) and stream.finish() == "<tool_"
    # Streamed, a cut last call whose head never completed is left out too, not sent as content.
    answer = WHOLE.split("\n<tool_call>\n{\"name\": \"get")[0] + '\n<tool_call>\n{"name": "get_wea'
    stream = StreamedCalls()
    text, _ = stream.feed(answer)
    assert text + stream.finish() == "Checking." and stream.calls == 1
    # A first call cut in its head: the whole answer is content, streamed as whole.
    stream = StreamedCalls()
    text, entries = stream.feed(cut[:20])
    assert text + stream.finish() == cut[:20] and entries == []


def test_default_preamble_and_tool_traffic() -> None:
    tok = tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    use = tool_use([ADD])
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    prompt = render_tool_chat(tok, messages, use)
    preamble = DEFAULT_PREAMBLE.format(tools=json.dumps(use.tools[0].as_openai()["function"]))
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n" + preamble + "<|im_end|>\n")
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
            '<|im_end|>\n<|im_start|>user\n<tool_response>\n{"name": "add", "content": "3"}\n</tool_response>'
            '<|im_end|>\n<|im_start|>assistant\n') in prompt
    assert "<tools>" not in render_tool_chat(tok, messages, tool_use([ADD], "none"))  # "none": no preamble
    # A template that takes tools renders them (and the calls, arguments as objects) itself.
    tok.chat_template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                         "{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
                         "({{ c.function.arguments.a }}){% endfor %};{% endfor %}")
    assert render_tool_chat(tok, messages, use, add_generation_prompt=False) == \
        "[add]system:Be brief.;user:1+2?;assistant:(1);tool:3;"


@pytest.mark.parametrize("message,error", [
    ({"role": "tool", "content": "3"}, r"^messages\[1\]\.tool_call_id is missing"),
    ({"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]},
     r"^messages\[1\]\.tool_calls\[0\] is invalid"),
    ({"role": "user", "content": "", "tool_calls": []}, r"^messages\[1\]\.tool_calls is invalid"),
])
def test_bad_tool_traffic_names_the_message(message, error) -> None:
    with pytest.raises(ValueError, match=error):
        check_messages([{"role": "user", "content": "hi"}, message])


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template,takes", [
    ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}" + CHATML, True),
    ("{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}" + CHATML, True),  # as JSON, Qwen-style
    (CHATML, False),
    ("{# tools: this model was not trained on them #}" + CHATML, False),  # the word, in a comment
    ("You answer without tools.\n" + CHATML, False),  # the word, in the output
    ("{% if tools is defined and tools is none %}{{ tools }}{% endif %}" + CHATML, False),  # never taken
    ("{{ raise_exception('no') }}", False),  # a template that fails takes none
])
def test_whether_a_template_takes_tools_is_read_from_what_it_writes(template, takes) -> None:
    assert takes_tools(template) is takes
    if "raise_exception" in template:
        return
    tok = tiny_tokenizer()
    tok.chat_template = template
    prompt = render_tool_chat(tok, [{"role": "user", "content": "1+2?"}], tool_use([ADD]))
    assert ("[add]" in prompt or '"name": "add"' in prompt) and (DEFAULT_PREAMBLE[:40] in prompt) is not takes


def test_limits_refuse_the_size_before_walking_the_schemas() -> None:
    """check_limits: the callable tools' schemas past max_grammar_bytes are refused on their JSON's
    size, before any schema's depth is walked (a 6,000-property schema took 40 ms of walking);
    a schema within the size but too deep is refused naming its tool."""
    from verispec.config import StructuredOutputConfig

    wide = {"type": "function", "function": {"name": "wide", "parameters": {
        "type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(200)}}}}
    use = tool_use([ADD, wide], "required")
    size = sum(len(t.parameters_json.encode()) for t in use.callable)
    with pytest.raises(ValueError, match=rf"^tools has more than {size - 1} bytes as a grammar .* alone have {size}\)"
                                         r".*max_grammar_bytes"):
        use.check_limits(StructuredOutputConfig(max_grammar_bytes=size - 1))
    assert all("depth" not in vars(t) for t in use.tools)  # no schema was walked
    use.check_limits(StructuredOutputConfig(max_grammar_bytes=size, max_schema_depth=5))  # each 3 deep, + 2
    with pytest.raises(ValueError, match=r"^tools\[0\]\.function\.parameters is nested 5 levels deep in a call"):
        use.check_limits(StructuredOutputConfig(max_grammar_bytes=size, max_schema_depth=4))
    assert [t.depth for t in use.tools] == [3, 3]
