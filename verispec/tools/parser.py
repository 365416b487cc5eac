"""Reading tool calls out of generated text (grammar.py's format), whole or as it streams.

The grammar writes each call's JSON on one line as {"name": "<name>", "arguments": <object>},
so the arguments are the text between that head and the "}" before "\n</tool_call>" (a newline
cannot occur inside JSON written on one line: strings escape it). Both readers return the
arguments exactly as generated, so a streamed call's fragments join into the whole one's.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .grammar import CLOSE, OPEN

_HEAD = re.compile(r'\n\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')
_END = "}\n" + CLOSE


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: its id (call_...), the function's name, and the arguments as JSON
    text (OpenAI's `function.arguments`)."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def split_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls): the text before the first call, and the complete calls. A last call
    cut short (by max_tokens) is left out; text whose first call is not complete, or that does
    not follow the format, is all content."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = []
    rest = text[start:]
    while rest.startswith(OPEN):
        head = _HEAD.match(rest, len(OPEN))
        end = rest.find(_END)
        if head is None or end < head.end():
            break
        arguments = rest[head.end():end]
        try:
            if not isinstance(json.loads(arguments), dict):
                break
        except ValueError:
            break
        calls.append(ToolCall(new_call_id(), head.group(1), arguments))
        rest = rest[end + len(_END):].lstrip("\n")
    if not calls:
        return text, []
    return text[:start].rstrip("\n"), calls


class StreamedCalls:
    """Turns one choice's text increments into OpenAI deltas: content until a call begins (text
    that may be the beginning of "<tool_call>" is held back until decided), then per call a
    first delta with index, id, type and name, then fragments of its arguments."""

    def __init__(self) -> None:
        self._pending = ""  # text received but not yet turned into deltas
        self._state = "content"  # content -> head -> arguments -> between -> head ...
        self.calls = 0
        self._content_sent = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content delta, tool_calls delta entries) for the next increment of the text."""
        self._pending += text
        content, entries = "", []
        while True:
            if self._state == "content":
                at = self._pending.find(OPEN)
                if at < 0:
                    # Held back: a possible beginning of a call, and the newlines before it
                    # (the content of an answer with calls ends before them, as split_calls').
                    cut = len(self._pending) - _partial(self._pending, OPEN)
                    sent = self._pending[:cut].rstrip("\n")
                    content += sent
                    self._pending = self._pending[len(sent):]
                    break
                content += self._pending[:at].rstrip("\n")
                self._pending, self._state = self._pending[at:], "head"
            elif self._state == "head":
                head = _HEAD.match(self._pending, len(OPEN))
                if head is None:
                    break
                entries.append({"index": self.calls, "id": new_call_id(), "type": "function",
                                "function": {"name": head.group(1), "arguments": ""}})
                self._pending, self._state = self._pending[head.end():], "arguments"
            elif self._state == "arguments":
                end = self._pending.find(_END)
                cut = end if end >= 0 else len(self._pending) - _partial(self._pending, _END)
                if cut > 0:
                    entries.append({"index": self.calls, "function": {"arguments": self._pending[:cut]}})
                if end < 0:
                    self._pending = self._pending[cut:]
                    break
                self._pending, self._state = self._pending[end + len(_END):], "between"
                self.calls += 1
            else:  # between calls: newlines, then the next call
                self._pending = self._pending.lstrip("\n")
                if self._pending.startswith(OPEN):
                    self._state = "head"
                    continue
                if not OPEN.startswith(self._pending):
                    self._pending = ""  # not a call: the grammars allow nothing else here
                break
        return content, entries

    def finish(self) -> str:
        """Content held back at the end: text that began like a call but never was one. A call
        whose head was cut short after complete calls is left out, as split_calls leaves it."""
        content = self._state == "content" or (self._state == "head" and self.calls == 0)
        rest, self._pending = (self._pending if content else ""), ""
        return rest


def _partial(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a beginning of `marker` (and not all of it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
