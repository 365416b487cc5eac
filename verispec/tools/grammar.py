"""The grammar a tool call must follow, in llguidance's Lark: Hermes-style calls,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

the format Qwen 2.5 / 3 and many fine-tunes were trained on. The JSON is one schema per callable
function ({"name": its name as a constant, "arguments": its parameters}), so a call's arguments
always parse and validate. "required" is one call, or calls separated by newlines when parallel
calls are allowed; "auto" is free text, or free text then calls: the text is a lazy lexeme that
ends at the first "<tool_call>", after which the call is constrained like a required one.
"""

from __future__ import annotations

import json

from ..structured.spec import JSON_LAYOUT
from .spec import Tool, ToolUse

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def call_schema(tools: tuple[Tool, ...]) -> str:
    """The JSON Schema of one call's body over `tools`, as JSON text (the tools' parameter
    schemas spliced in as they are)."""
    def one(tool: Tool) -> str:
        return (f'{{"type": "object", "properties": {{"name": {{"const": {json.dumps(tool.name)}}}, '
                f'"arguments": {tool.parameters_json}}}, "required": ["name", "arguments"], '
                '"additionalProperties": false}')

    layout = f'"x-guidance": {json.dumps(JSON_LAYOUT)}'
    if len(tools) == 1:
        return one(tools[0])[:-1] + ", " + layout + "}"
    return '{"anyOf": [' + ", ".join(one(t) for t in tools) + "], " + layout + "}"


def tool_grammar(use: ToolUse) -> str:
    """The Lark grammar of the output under `use` (which must be active)."""
    more = f'("\\n" {_quote(OPEN)} "\\n" body "\\n" {_quote(CLOSE)})*' if use.parallel else ""
    lines = [f"body: %json {call_schema(use.callable)}"]
    if use.mode == "auto":
        lines = ["start: TEXT | lead \"\\n\" body \"\\n\" " + _quote(CLOSE) + " " + more,
                 "TEXT: /(.|\\n)*/",
                 f"lead[lazy]: TEXT {_quote(OPEN)}", *lines]
    else:
        lines = [f"start: {_quote(OPEN)} \"\\n\" body \"\\n\" {_quote(CLOSE)} {more}", *lines]
    return "\n".join(lines) + "\n"


def _quote(text: str) -> str:
    return json.dumps(text)
