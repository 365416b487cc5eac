"""Response bodies and stream chunks in OpenAI's shapes, for both endpoints."""

from __future__ import annotations

import time
import uuid

from ..engine.engine import RequestOutput
from ..model import Tokenizer
from ..sample.logprobs import TokenLogprob
from ..tools import StreamedCalls, ToolUse, split_calls


def _finish(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason for a choice that made calls and stopped by itself."""
    return "tool_calls" if called and reason == "stop" else reason


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Formatter:
    """Builds one response's bodies: a chat completion or a (text) completion, whole or as chunks.

    Completion choices carry `text` and legacy logprobs (tokens, token_logprobs, top_logprobs,
    text_offset); chat choices carry a `message` (whole) or a `delta` (chunk) and logprobs as
    {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}.

    With tools that may be called (`tools`), a chat choice's text is split into content and
    `tool_calls` (verispec.tools.parser), streamed as `delta.tool_calls` entries, and a choice
    that made calls and stopped finishes with "tool_calls".
    """

    def __init__(self, chat: bool, model: str, tokenizer: Tokenizer, tools: ToolUse | None = None) -> None:
        self.chat = chat
        self.tools = tools if tools is not None and tools.active else None
        self._calls: dict[int, StreamedCalls] = {}  # tool streams, per choice
        self.model = model
        self.tokenizer = tokenizer
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # completions: per choice, characters sent so far
        self._started: set[int] = set()  # chat streams: choices whose role was sent

    def whole(self, choices: list[tuple[int, RequestOutput]], usage_: dict[str, int]) -> dict:
        body = []
        for i, out in choices:
            if self.tools is None:
                body.append(self._choice(i, out.text, out.logprobs, out.finish_reason, whole=True))
                continue
            content, calls = split_calls(out.text)
            choice = self._choice(i, content, out.logprobs, _finish(out.finish_reason, bool(calls)), whole=True)
            if calls:
                choice["message"]["content"] = content or None
                choice["message"]["tool_calls"] = [c.as_openai() for c in calls]
            body.append(choice)
        return self._envelope("chat.completion" if self.chat else "text_completion", body) | {"usage": usage_}

    def chunk(self, index: int, out: RequestOutput) -> dict:
        reason = out.finish_reason if out.finished else None
        if self.tools is None:
            choice = self._choice(index, out.new_text, out.new_logprobs, reason, whole=False)
        else:
            calls = self._calls.setdefault(index, StreamedCalls())
            content, entries = calls.feed(out.new_text)
            if out.finished:
                content += calls.finish()
            choice = self._choice(index, content, out.new_logprobs, reason and _finish(reason, calls.calls > 0),
                                  whole=False)
            if entries:
                choice["delta"]["tool_calls"] = entries
                if not content:
                    del choice["delta"]["content"]
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, usage_: dict[str, int]) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", []) | {"usage": usage_}

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, index: int, text: str, records: list[TokenLogprob] | None, finish_reason: str | None,
                whole: bool) -> dict:
        choice: dict = {"index": index}
        if not self.chat:
            choice["text"] = text
        elif whole:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["delta"] = {"content": text}
            if index not in self._started:
                self._started.add(index)
                choice["delta"]["role"] = "assistant"
        choice["logprobs"] = None if records is None else (
            self._chat_logprobs(records) if self.chat else self._completion_logprobs(index, records))
        choice["finish_reason"] = finish_reason
        return choice

    def _token(self, token_id: int, emitted: bool = False) -> str:
        """An emitted token reads as it does in the text (special tokens are left out of both,
        so the tokens join into the text and text_offset indexes it); an alternative shows its
        name."""
        return self.tokenizer.token_text(token_id, skip_special_tokens=emitted)

    def _chat_logprobs(self, records: list[TokenLogprob]) -> dict:
        def entry(token_id: int, logprob: float, emitted: bool = False) -> dict:
            token = self._token(token_id, emitted)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {"content": [entry(r.token_id, r.logprob, True) | {"top_logprobs": [entry(i, v) for i, v in r.top]}
                            for r in records]}

    def _completion_logprobs(self, index: int, records: list[TokenLogprob]) -> dict:
        tokens = [self._token(r.token_id, emitted=True) for r in records]
        offsets = []
        offset = self._offsets.get(index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": [r.logprob for r in records],
                "top_logprobs": [{self._token(i): v for i, v in r.top} for r in records],
                "text_offset": offsets}
