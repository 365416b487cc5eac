"""Tools and tool traffic into a chat prompt.

A chat template that takes tools (one that writes a tool it is given, as Qwen 2.5's, Llama
3.1's and Hermes' do: takes_tools) gets them as the `tools` variable, assistant messages'
`tool_calls` (arguments as objects, as transformers passes them) and `role: "tool"` messages,
and renders them its own way.
Any other template (SmolLM2's, ChatML) gets the default rendering:

- the tool preamble (DEFAULT_PREAMBLE with the tools' signatures) as the system message, after
  the conversation's own system text when it has one;
- an assistant message's calls appended to its content as <tool_call> blocks (grammar.py's
  format, what the model is asked to write);
- each run of tool messages as one user message of <tool_response> blocks, since templates that
  know no tools often refuse or mangle a "tool" role.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache

from ..model.chat_template import CHATML_TEMPLATE, render_chat
from .grammar import CLOSE, OPEN
from .spec import ToolUse

DEFAULT_PREAMBLE = (
    "You have functions you may call. Their names, descriptions and argument schemas (JSON "
    "Schema) are listed between <tools> and </tools>, one per line:\n<tools>\n{tools}\n</tools>\n\n"
    "To call one, answer with a JSON object of its name and arguments between <tool_call> and "
    "</tool_call>, one block per call:\n" + OPEN + "\n"
    '{{"name": "<the function\'s name>", "arguments": {{<the arguments>}}}}\n' + CLOSE + "\n"
    "Each result comes back to you between <tool_response> and </tool_response>."
)


# A tool no template writes unless it renders the tools it is given.
_PROBE = {"type": "function", "function": {"name": "verispec_probe_9c1e", "description": "",
                                           "parameters": {"type": "object", "properties": {}}}}


def takes_tools(template: str) -> bool:
    """Whether a chat template renders tools itself: rendered for one user message with a probe
    tool, its output names the probe. (The word "tools" in a template's source says little: a
    comment, a condition never taken, an instruction to the model.) A template that fails to
    render then does not take them."""
    return _renders_probe(template)


@lru_cache(maxsize=16)
def _renders_probe(template: str) -> bool:
    try:
        text = render_chat(template or CHATML_TEMPLATE, [{"role": "user", "content": "Hi"}], True,
                           tools=[_PROBE], bos_token="", eos_token="")
    except ValueError:
        return False
    return _PROBE["function"]["name"] in text


def check_messages(messages: Sequence[Mapping]) -> None:
    """ValueError naming messages[i].<field> for malformed tool traffic: a tool message without
    tool_call_id, tool_calls that are not OpenAI's function calls."""
    for i, m in enumerate(messages):
        if m.get("role") == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise ValueError(f"messages[{i}].tool_call_id is missing: a tool message answers the call with "
                             "that id")
        calls = m.get("tool_calls")
        if calls is None:
            continue
        if m.get("role") != "assistant" or not isinstance(calls, Sequence):
            raise ValueError(f"messages[{i}].tool_calls is invalid: expected a list, on an assistant message")
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) \
                    or not isinstance(function.get("arguments", "{}"), (str, Mapping)):
                raise ValueError(f"messages[{i}].tool_calls[{j}] is invalid: expected {{\"id\": ..., \"type\": "
                                 "\"function\", \"function\": {\"name\": ..., \"arguments\": \"<JSON>\"}}")


def render_tool_chat(tokenizer, messages: Sequence[Mapping], use: ToolUse | None,
                     add_generation_prompt: bool = True) -> str:
    """The prompt for `messages` (OpenAI's chat messages, tool traffic included) under `use`
    (None: no tools) with `tokenizer`'s chat template."""
    check_messages(messages)
    template = tokenizer.chat_template or ""
    tools = use.tools if use is not None and use.active else ()
    if not tools and not any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt)
    if takes_tools(template):
        variables = {"tools": [t.as_openai() for t in tools]} if tools else {}
        return tokenizer.apply_chat_template([_native(m) for m in messages], add_generation_prompt, **variables)
    rendered = _default(messages)
    if tools:
        preamble = DEFAULT_PREAMBLE.format(tools="\n".join(t.function_json() for t in tools))
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": rendered[0]["content"] + "\n\n" + preamble}
        else:
            rendered.insert(0, {"role": "system", "content": preamble})
    return tokenizer.apply_chat_template(rendered, add_generation_prompt)


def _arguments(function: Mapping) -> object:
    """A call's arguments as an object when they are JSON text (OpenAI sends text)."""
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _native(message: Mapping) -> dict:
    out = {k: v for k, v in message.items() if v is not None}
    out.setdefault("content", "")
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"], "arguments": _arguments(c["function"])}}
                             for c in message["tool_calls"]]
    return out


def _default(messages: Sequence[Mapping]) -> list[dict]:
    out: list[dict] = []
    names = {}  # tool_call_id -> function name, from the assistant's calls
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "tool":
            name = names.get(m.get("tool_call_id"), m.get("name"))
            block = "<tool_response>\n" + json.dumps({"name": name, "content": content}, ensure_ascii=False) \
                + "\n</tool_response>"
            if out and out[-1].get("tool_responses"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_responses": True})
            continue
        calls = m.get("tool_calls") or []
        blocks = []
        for c in calls:
            names[c.get("id")] = c["function"]["name"]
            body = {"name": c["function"]["name"], "arguments": _arguments(c["function"])}
            blocks.append(f"{OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{CLOSE}")
        if blocks:
            content = "\n".join(([content] if content else []) + blocks)
        out.append({"role": role, "content": content})
    return [{"role": m["role"], "content": m["content"]} for m in out]
