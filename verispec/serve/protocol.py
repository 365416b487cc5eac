"""OpenAI request bodies for /v1/completions and /v1/chat/completions, and their translation
into SamplingParams.

Fields follow OpenAI's API; top_k, min_p, repetition_penalty, guidance_scale, negative_prompt,
num_speculative_tokens and ignore_eos are extensions (the `extra_body` of OpenAI's client), and
so are vLLM's structured-output fields guided_json, guided_regex, guided_grammar and
guided_choice, beside OpenAI's response_format (json_object, or json_schema: enforced whether or
not `strict` is set). Chat requests take OpenAI's tools, tool_choice and parallel_tool_calls
(verispec.tools), and messages with an assistant's tool_calls or a tool's result (tool_call_id).
Unknown fields are ignored, as OpenAI's own server ignores fields it does not use. Types are
strict, as OpenAI's: a string is not a number or a boolean (`"n": "2"` is a 400 naming n).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..config import StructuredOutputConfig
from ..sampling_params import STRUCTURED_FIELDS, SamplingParams
from ..structured.choice import choice_grammar
from ..structured.spec import GrammarSpec
from ..tools import ToolUse, tool_grammar, tool_use
from .errors import APIError, echo

# OpenAI's default for /v1/completions; chat completions default to the rest of the context.
DEFAULT_COMPLETION_TOKENS = 16


# strict: no coercion from strings ("2" -> 2, "yes" -> True); an int still passes as a float.
_STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False
    include_speculation: bool = False  # an extension: serve/speculation.py


class JSONSchemaFormat(BaseModel):
    model_config = _STRICT

    name: str | None = None
    description: str | None = None
    # "schema" would shadow a pydantic BaseModel attribute, hence the alias.
    schema_: dict | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingRequest(BaseModel):
    """Fields both endpoints share."""

    model_config = _STRICT

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    guidance_scale: float | None = None
    negative_prompt: str | list[int] | None = None
    num_speculative_tokens: int | None = None
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    guided_json: dict | bool | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def include_speculation(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_speculation


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # alternatives per token, as OpenAI's legacy completions

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one text, a list of texts, token ids or lists of them."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError("prompt is empty: expected a string, a list of strings or token ids", "prompt")
        return list(p)


class TextPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls (checked by verispec.tools.prompt)
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    def as_dict(self) -> dict[str, object]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, object] = {"role": self.role, "content": content or ""}
        for key in ("tool_calls", "tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    def tool_use(self) -> ToolUse | None:
        """The request's tools and tool_choice; a 400 naming the field when they are bad."""
        try:
            use = tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ValueError as error:
            raise invalid(error) from None
        if use is not None and use.active:
            given = [name for name in ("response_format", "guided_json", "guided_regex", "guided_grammar",
                                       "guided_choice") if getattr(self, name) is not None]
            if self.response_format is not None and self.response_format.type == "text":
                given.remove("response_format")
            if given:
                raise APIError(f"tool_choice={echo(self.tool_choice or 'auto')} and {given[0]} are both set: the "
                               "calls follow their own grammar (use tool_choice=\"none\" for structured text)",
                               "tool_choice")
        return use


def sampling_params(request: CompletionRequest | ChatRequest, default_max_tokens: int | None,
                    limits: StructuredOutputConfig, use: ToolUse | None = None) -> list[SamplingParams]:
    """SamplingParams of each of the request's n samples: a seeded request gives sample i the
    seed seed + i, so that the n samples differ and each is reproducible. Bad values raise
    APIError (400) naming the parameter; a structured-output field past `limits` is refused
    before its grammar is built. `use`: a chat request's tool_use(), when already read."""
    max_name, max_tokens = "max_tokens", request.max_tokens
    logprobs: int | None
    if isinstance(request, ChatRequest):
        if request.max_completion_tokens is not None:
            max_name, max_tokens = "max_completion_tokens", request.max_completion_tokens
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError("top_logprobs needs logprobs=true", "top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    else:
        logprobs = request.logprobs
    bias = None
    if request.logit_bias is not None:
        try:
            bias = {int(token): value for token, value in request.logit_bias.items()}
        except ValueError:
            raise APIError(f"logit_bias={echo(request.logit_bias)} is invalid: expected token ids (integer strings) "
                           "as keys", "logit_bias") from None
    given = dict(
        temperature=request.temperature, top_p=request.top_p, top_k=request.top_k, min_p=request.min_p,
        presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty, guidance_scale=request.guidance_scale,
        negative_prompt=request.negative_prompt, logit_bias=bias,
    )
    structured, structured_name = _structured(request, limits)
    given.update(structured)
    if use is None and isinstance(request, ChatRequest):
        use = request.tool_use()
    if use is not None and use.active:
        given["grammar"], structured_name = tool_grammar(use), "tools"
    rename = {"max_tokens": max_name, "logprobs": _logprobs_name(request),
              **dict.fromkeys(STRUCTURED_FIELDS, structured_name)}
    try:
        for kind in STRUCTURED_FIELDS:
            if given.get(kind) not in (None, False):
                # Sized before it is built, and built once for all n samples (GrammarSpec's cache).
                GrammarSpec.from_field(kind, given[kind], limits)
        return [SamplingParams(
            **{k: v for k, v in given.items() if v is not None},
            seed=None if request.seed is None else request.seed + index,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            stop=() if request.stop is None else request.stop,
            ignore_eos=request.ignore_eos, logprobs=logprobs,
        ) for index in range(request.n)]
    except (ValueError, TypeError) as error:
        raise invalid(error, rename=rename) from None


def _structured(request: CompletionRequest | ChatRequest,
                limits: StructuredOutputConfig) -> tuple[dict[str, object], str]:
    """The SamplingParams field of the request's structured output (at most one of
    response_format and the guided_* fields) and the request field it came from."""
    given = {name: getattr(request, name) for name in
             ("guided_json", "guided_regex", "guided_grammar", "guided_choice")
             if getattr(request, name) is not None}
    fmt = request.response_format
    if fmt is not None and fmt.type != "text":
        given["response_format"] = fmt
    if len(given) > 1:
        raise APIError(f"{' and '.join(given)} are both set: expected at most one structured-output field",
                       next(iter(given)))
    if not given:
        return {}, "response_format"
    name, value = next(iter(given.items()))
    if name == "response_format":
        if value.type == "json_object":
            return {"json_object": True}, name
        if value.json_schema is None:
            raise APIError("response_format has type json_schema without a json_schema: expected "
                           "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}", name)
        return {"json_schema": value.json_schema.schema_}, name
    if name == "guided_choice":
        try:
            return {"grammar": choice_grammar(value, limits.max_grammar_bytes)}, name
        except ValueError as error:
            raise APIError(str(error), name) from None
    return {{"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar"}[name]: value}, name


def structured_field(request: CompletionRequest | ChatRequest) -> str | None:
    """The request field its grammar came from (None without one)."""
    if isinstance(request, ChatRequest) and request.tools and request.tool_choice != "none":
        return "tools"
    for name in ("guided_json", "guided_regex", "guided_grammar", "guided_choice"):
        if getattr(request, name) is not None:
            return name
    fmt = request.response_format
    return "response_format" if fmt is not None and fmt.type != "text" else None


def _logprobs_name(request: CompletionRequest | ChatRequest) -> str:
    return "top_logprobs" if isinstance(request, ChatRequest) else "logprobs"


_NAMED = re.compile(r"^((?:tools|messages)(?:\[\d+\](?:\.\w+)*)+|\w+)")


def invalid(error: Exception, rename: dict[str, str] | None = None) -> APIError:
    """A 400 for a ValueError / TypeError of verispec, whose messages begin with the argument's
    name (`temperature=-1 is invalid: ...`, `prompt has 300 tokens: ...`, or a path into it:
    `tools[1].function.name=...`)."""
    message = str(error)
    match = _NAMED.match(message)
    param = match.group(1) if match else None
    if param is not None and rename and param in rename:
        param = rename[param]
        message = param + message[match.end():]
    return APIError(message, param)
