"""Prompt sets for drafter training and evaluation: JSONL files of {"category", "prompt"}.

The shipped training set (prompts.jsonl, written by make_prompts.py) lives next to this module;
evaluation sets (bench/prompts/) use the same format. Blank lines are skipped; every other line
must be a JSON object with exactly the string keys "category" and "prompt", both non-empty.
"""

from __future__ import annotations

import json
import os
from importlib.resources import files
from pathlib import Path

_KEYS = frozenset(("category", "prompt"))


def _parse(line: str, where: str) -> dict[str, str]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: expected a JSON object, got invalid JSON ({exc})") from None
    if not isinstance(row, dict) or set(row) != _KEYS:
        raise ValueError(
            f"{where}: expected an object with exactly the keys 'category' and 'prompt', got "
            f"{line.strip()[:80]!r}"
        )
    for key in sorted(_KEYS):
        if not isinstance(row[key], str) or not row[key].strip():
            raise ValueError(
                f"{where}: expected {key!r} to be a non-empty string, got {row[key]!r}"
            )
    return row


def load_prompts(path: str | os.PathLike | None = None) -> list[dict[str, str]]:
    """Prompts from a JSONL file of {"category", "prompt"} objects; None: the shipped training set."""
    if path is None:
        name, source = "verispec/train/prompts.jsonl", files(__package__) / "prompts.jsonl"
    else:
        name, source = os.fspath(path), Path(path)
    text = source.read_text(encoding="utf-8")
    return [
        _parse(line, f"{name}, line {number}")
        for number, line in enumerate(text.splitlines(), start=1)
        if line.strip()
    ]
