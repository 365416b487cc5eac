"""OpenAI's function tools and tool_choice, checked: what a request may call and how it must.

A tool is {"type": "function", "function": {"name", "description"?, "parameters"?}}; its
parameters are a JSON Schema of the arguments object (none given: an object with no
properties). tool_choice is "none" (no call; the tools stay out of the prompt), "auto" (text or
calls, the model's choice), "required" (at least one call) or {"type": "function", "function":
{"name": ...}} (that function, called once). Errors are ValueErrors whose message begins with the
field's name (tools[1].function.name, tool_choice, ...), as the server's 400s name the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from ..config import StructuredOutputConfig
from ..structured.spec import json_depth

CHOICES = ("none", "auto", "required")
# OpenAI's rule for function names: the server and the grammar can then embed them verbatim.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
NO_PARAMETERS: Mapping[str, object] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Tool:
    """One function a model may call: its name, description ("" if none), the JSON Schema of
    its arguments (as JSON text, so a Tool is hashable and its schema immutable; the call
    grammar and the default preamble splice the text in, rather than parsing and writing it
    again: a large schema's JSON holds the interpreter while it is parsed or written)."""

    name: str
    description: str
    parameters_json: str

    @cached_property
    def depth(self) -> int:
        """The schema's nesting depth: a walk of every node (40 ms for 6,000 properties), taken
        only when ToolUse.check_limits gets past the size of the schemas."""
        return json_depth(self.parameters)

    @property
    def parameters(self) -> dict:
        return json.loads(self.parameters_json)

    def as_openai(self) -> dict:
        """The tool as OpenAI writes it (what chat templates that take tools expect)."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}

    def function_json(self) -> str:
        """json.dumps(self.as_openai()["function"], ensure_ascii=False), without the round trip."""
        return (f'{{"name": {json.dumps(self.name)}, "description": {json.dumps(self.description, ensure_ascii=False)}, '
                f'"parameters": {self.parameters_json}}}')


@dataclass(frozen=True)
class ToolUse:
    """The tools of a request and how they may be used: mode is "none", "auto" or "required"
    (a named function is "required" with only that tool callable and one call); parallel: more
    than one call allowed in one answer."""

    tools: tuple[Tool, ...]
    mode: str
    parallel: bool
    callable: tuple[Tool, ...]

    @property
    def active(self) -> bool:
        """Whether calls are possible (and the tools go into the prompt)."""
        return self.mode != "none" and bool(self.callable)

    def check_limits(self, config: StructuredOutputConfig) -> None:
        """ValueError naming the limit when the callable tools' parameter schemas alone are past
        max_grammar_bytes (the whole grammar's size is checked with the others'), or naming the
        tool when its schema is nested deeper than max_schema_depth (the call's JSON puts it two
        levels down)."""
        size = sum(len(tool.parameters_json.encode()) for tool in self.callable)
        if size > config.max_grammar_bytes:  # the grammar splices each callable tool's schema in
            raise ValueError(f"tools has more than {config.max_grammar_bytes} bytes as a grammar (its callable "
                             f"tools' parameter schemas alone have {size}): expected at most "
                             f"{config.max_grammar_bytes} (the grammar size limit, max_grammar_bytes)")
        for i, tool in enumerate(self.tools):
            if tool in self.callable and tool.depth + 2 > config.max_schema_depth:
                raise ValueError(f"tools[{i}].function.parameters is nested {tool.depth + 2} levels deep in a call: "
                                 f"expected at most {config.max_schema_depth} (the schema depth limit, "
                                 "max_schema_depth)")


def parse_tools(value: object, field: str = "tools") -> tuple[Tool, ...]:
    """Tools from OpenAI's JSON shape; ValueError naming the field of the first bad one."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise ValueError(f"{field}={value!r:.200} is invalid: expected a list of tools")
    tools = []
    for i, item in enumerate(value):
        at = f"{field}[{i}]"
        if not isinstance(item, Mapping) or item.get("type", "function") != "function":
            raise ValueError(f"{at} is invalid: expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        function = item.get("function")
        if not isinstance(function, Mapping):
            raise ValueError(f"{at}.function is missing: expected {{\"name\": ..., \"parameters\": {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{at}.function.name={name!r:.100} is invalid: expected 1 to 64 letters, digits, "
                             "'_' or '-'")
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise ValueError(f"{at}.function.description is invalid: expected a string")
        parameters = function.get("parameters")
        parameters = NO_PARAMETERS if parameters is None else parameters
        if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
            raise ValueError(f"{at}.function.parameters={parameters!r:.200} is invalid: expected a JSON Schema "
                             "of an object (the arguments)")
        try:
            parameters_json = json.dumps(parameters, allow_nan=False, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError) as error:
            raise ValueError(f"{at}.function.parameters cannot be written as JSON: {error}") from None
        tools.append(Tool(name, description, parameters_json))
    names = [t.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ValueError(f"{field}[{i}].function.name={name!r} is invalid: another tool has that name")
    return tuple(tools)


def tool_use(tools: object, tool_choice: object = None, parallel_tool_calls: object = None) -> ToolUse | None:
    """The request's ToolUse (None without tools and tool_choice); ValueError naming the field."""
    if tools is None or (isinstance(tools, Sequence) and not tools):
        if tool_choice not in (None, "none"):
            raise ValueError(f"tool_choice={tool_choice!r:.100} is invalid without tools: expected tools to "
                             "choose from")
        return None
    parsed = parse_tools(tools)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ValueError(f"parallel_tool_calls={parallel_tool_calls!r:.100} is invalid: expected a bool")
    parallel = parallel_tool_calls is not False
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ValueError(f"tool_choice={choice!r:.100} is invalid: expected one of {CHOICES} or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        return ToolUse(parsed, choice, parallel, parsed if choice != "none" else ())
    function = choice.get("function") if isinstance(choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(choice, Mapping) or choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError(f"tool_choice={choice!r:.200} is invalid: expected one of {CHOICES} or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    named = [t for t in parsed if t.name == name]
    if not named:
        raise ValueError(f"tool_choice names function {name!r:.100}, which is not among the tools "
                         f"({', '.join(t.name for t in parsed)})")
    return ToolUse(parsed, "required", False, tuple(named))
