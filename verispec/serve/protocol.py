"""OpenAI request bodies for /v1/completions and /v1/chat/completions, and their translation
into SamplingParams.

Fields follow OpenAI's API; top_k, min_p, repetition_penalty, guidance_scale, negative_prompt,
num_speculative_tokens and ignore_eos are extensions (the `extra_body` of OpenAI's client).
Unknown fields are ignored, as OpenAI's own server ignores fields it does not use. Types are
strict, as OpenAI's: a string is not a number or a boolean (`"n": "2"` is a 400 naming n).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ..sampling_params import SamplingParams
from .errors import APIError, echo

# OpenAI's default for /v1/completions; chat completions default to the rest of the context.
DEFAULT_COMPLETION_TOKENS = 16


# strict: no coercion from strings ("2" -> 2, "yes" -> True); an int still passes as a float.
_STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


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

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


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

    def as_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def sampling_params(request: CompletionRequest | ChatRequest, index: int, default_max_tokens: int) -> SamplingParams:
    """SamplingParams of the request's `index`-th sample (of n): a seeded request gives sample i
    the seed seed + i, so that the n samples differ and each is reproducible. Bad values raise
    APIError (400) naming the parameter."""
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
    try:
        return SamplingParams(
            **{k: v for k, v in given.items() if v is not None},
            seed=None if request.seed is None else request.seed + index,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            stop=() if request.stop is None else request.stop,
            ignore_eos=request.ignore_eos, logprobs=logprobs,
        )
    except (ValueError, TypeError) as error:
        raise invalid(error, rename={"max_tokens": max_name, "logprobs": _logprobs_name(request)}) from None


def _logprobs_name(request: CompletionRequest | ChatRequest) -> str:
    return "top_logprobs" if isinstance(request, ChatRequest) else "logprobs"


_NAMED = re.compile(r"^(\w+)")


def invalid(error: Exception, rename: dict[str, str] | None = None) -> APIError:
    """A 400 for a ValueError / TypeError of verispec, whose messages begin with the argument's
    name (`temperature=-1 is invalid: ...`, `prompt has 300 tokens: ...`)."""
    message = str(error)
    match = _NAMED.match(message)
    param = match.group(1) if match else None
    if param is not None and rename and param in rename:
        param = rename[param]
        message = param + message[match.end():]
    return APIError(message, param)
