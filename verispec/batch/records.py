"""OpenAI's batch file format: the requests of an input file, the records of an output file, and
what an output file already holds (for resuming).

Input line: {"custom_id": str, "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body": {...}}. Output record: {"id", "custom_id", "response":
{"status_code", "request_id", "body"} or null, "error": {"code", "message"} or null}; `error` is
set whenever the request was not answered with 200, so failures are found by `error != null`.

A *key* names an input line across runs: its custom_id, or for a line whose custom_id cannot be
read, its line number (such records carry custom_id null and a "line" field).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

URLS = ("/v1/chat/completions", "/v1/completions")


@dataclass(frozen=True)
class BatchRequest:
    """A well-formed input line. body: the JSON of its body, as the server would receive it."""

    line: int  # 1-based, in the input file
    custom_id: str
    url: str
    body: bytes

    @property
    def key(self) -> str:
        return self.custom_id


@dataclass(frozen=True)
class BadLine:
    """An input line that is not a request; it is answered by an error record, unrun."""

    line: int
    custom_id: str | None
    message: str

    @property
    def key(self) -> str:
        return self.custom_id if self.custom_id is not None else _line_key(self.line)


def _line_key(line: int) -> str:
    # Begins with NUL, which no sane custom_id does, so it cannot pass for one.
    return f"\0line {line}"


def parse_line(line: int, text: str) -> BatchRequest | BadLine:
    try:
        entry = json.loads(text)
    except ValueError as error:
        return BadLine(line, None, f"line {line} is not JSON: {error}")
    if not isinstance(entry, dict):
        return BadLine(line, None, f"line {line} is a JSON {type(entry).__name__}: expected an object")
    custom_id = entry.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BadLine(line, None, f"line {line}: custom_id={custom_id!r} is invalid: expected a non-empty string")

    def bad(message: str) -> BadLine:
        return BadLine(line, custom_id, f"line {line}: {message}")

    if entry.get("method") != "POST":
        return bad(f"method={entry.get('method')!r} is invalid: expected 'POST'")
    url = entry.get("url")
    if url not in URLS:
        return bad(f"url={url!r} is invalid: expected one of {', '.join(URLS)}")
    body = entry.get("body")
    if not isinstance(body, dict):
        return bad(f"body is a {type(body).__name__}: expected an object")
    if body.get("stream") not in (None, False):
        return bad("body.stream is true: a batch answers whole responses, not streams")
    return BatchRequest(line, custom_id, url, json.dumps(body).encode())


def read_requests(path: str | os.PathLike) -> list[BatchRequest | BadLine]:
    """Every non-blank line of the input file; raises ValueError, before anything runs, when a
    custom_id appears on more than one line."""
    items = []
    with open(path, encoding="utf-8") as file:
        for number, text in enumerate(file, 1):
            if text.strip():
                items.append(parse_line(number, text))
    first: dict[str, int] = {}
    repeats = []
    for item in items:
        if item.custom_id is None:
            continue
        if item.custom_id in first:
            repeats.append(f"{item.custom_id!r} (lines {first[item.custom_id]} and {item.line})")
        else:
            first[item.custom_id] = item.line
    if repeats:
        shown = ", ".join(repeats[:5]) + (f" and {len(repeats) - 5} more" if len(repeats) > 5 else "")
        raise ValueError(f"{path} repeats custom_ids: {shown}; each request needs its own, nothing was run")
    return items


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_record(custom_id: str, status: int, body: bytes) -> dict:
    """The record of a request the app answered with `status` and `body` (JSON)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = {"error": {"message": body.decode(errors="replace"), "type": "server_error"}}
    error = None
    if status != 200:
        detail = parsed.get("error") if isinstance(parsed, dict) else None
        detail = detail if isinstance(detail, dict) else {}
        error = {"code": detail.get("code") or detail.get("type") or str(status),
                 "message": detail.get("message") or f"status {status}"}
    request_id = parsed.get("id") if isinstance(parsed, dict) and status == 200 else None
    return {"id": new_id("batch_req"), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id or new_id("req"), "body": parsed},
            "error": error}


def bad_line_record(bad: BadLine) -> dict:
    record = {"id": new_id("batch_req"), "custom_id": bad.custom_id, "response": None,
              "error": {"code": "invalid_request", "message": bad.message}}
    if bad.custom_id is None:
        record["line"] = bad.line
    return record


def record_key(record: dict) -> str:
    custom_id = record.get("custom_id")
    return custom_id if isinstance(custom_id, str) else _line_key(record["line"])


def read_done(path: str | os.PathLike) -> set[str]:
    """The keys an output file already holds. A last line cut short (the previous run was
    killed mid-write) is removed from the file, so its request runs again; any other line that
    is not a record raises ValueError."""
    path = Path(path)
    if not path.exists():
        return set()
    data = path.read_bytes()
    keys: set[str] = set()
    start = 0
    while start < len(data):
        end = data.find(b"\n", start)
        line = data[start:] if end < 0 else data[start:end]
        try:
            record = json.loads(line)
            key = record_key(record)
        except (ValueError, KeyError, TypeError, AttributeError):
            if end < 0 or data[end + 1:].strip() == b"":  # the last line: a write the kill cut short
                with open(path, "r+b") as file:
                    file.truncate(start)
                break
            number = data.count(b"\n", 0, start) + 1
            raise ValueError(f"{path} line {number} is not a batch output record: is it the output of "
                             "`verispec run-batch`?") from None
        if end < 0:  # a whole record without its newline: complete it
            with open(path, "ab") as file:
                file.write(b"\n")
        if key in keys:
            raise ValueError(f"{path} holds {key!r} twice: is it the output of `verispec run-batch`?")
        keys.add(key)
        start = len(data) if end < 0 else end + 1
    return keys


class ResultsFile:
    """The output file, appended to one whole line at a time and flushed after each, so a kill
    loses at most the line being written (read_done removes it). A key is written once: a record
    for a key already written (a retried Ray task's second answer) is dropped."""

    def __init__(self, path: str | os.PathLike, written: set[str]) -> None:
        self._file = open(path, "a", encoding="utf-8")
        self.written = set(written)

    def write(self, record: dict) -> bool:
        key = record_key(record)
        if key in self.written:
            return False
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self.written.add(key)
        return True

    def close(self) -> None:
        self._file.close()
