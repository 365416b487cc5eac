"""A tiny random checkpoint with a chat template, request files in OpenAI's batch format, and
their results read back."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from ..model.conftest import write_bos_chat_checkpoint

MODEL = "tiny"
# What every run-batch of these tests passes: the tiny model, a small KV cache.
MODEL_FLAGS = ["--served-model-name", MODEL, "--kv-cache-gib", "0.002", "-k", "3"]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> str:
    return write_bos_chat_checkpoint(tmp_path_factory.mktemp("batch-tiny"))


def request_line(custom_id: str, index: int, max_tokens: int = 12) -> str:
    """Greedy for even `index`, seeded sampling (temperature 1) for odd; chat and completions."""
    body: dict = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True}
    body |= {"temperature": 0} if index % 2 == 0 else {"temperature": 1.0, "seed": 1000 + index}
    if index % 3 == 2:
        url, body["prompt"] = "/v1/completions", f"t{index} says hello to t{index + 1}"
    else:
        url, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": f"question {index}: why?"}]
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def write_requests(path: Path, count: int, max_tokens: int = 12, extra: tuple[str, ...] = ()) -> Path:
    path.write_text("".join(request_line(f"req-{i}", i, max_tokens) + "\n" for i in range(count))
                    + "".join(line + "\n" for line in extra))
    return path


def results(path: Path) -> dict[str, dict]:
    """The output's records by custom_id (or "line N"), checking that none appears twice."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    keys = [r["custom_id"] if r["custom_id"] is not None else f"line {r['line']}" for r in records]
    repeated = [key for key, count in Counter(keys).items() if count > 1]
    assert repeated == []
    return dict(zip(keys, records))


def choices(path: Path) -> dict[str, list[dict] | None]:
    """What a run decided: each request's choices (None for an error record)."""
    return {key: None if r["error"] else r["response"]["body"]["choices"] for key, r in results(path).items()}
