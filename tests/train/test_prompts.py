"""The shipped training prompts and the Spec-Bench-style evaluation prompts: format, size, and
that no evaluation prompt or passage leaks into training (drafters would be scored on their
training data)."""

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from verispec.train.make_prompts import build
from verispec.train.prompts import load_prompts

EVAL_SET = Path(__file__).parents[2] / "bench" / "prompts" / "spec_bench.jsonl"
EVAL_CATEGORIES = {"conversation", "translation", "summarization", "qa", "math", "rag"}
MIN_SHARED = 40  # characters: shorter common pieces are instructions, not passages


def _normal(text: str) -> str:
    return " ".join(text.split())


def _segments(text: str) -> list[str]:
    """Sentences and lines of a prompt, whitespace-normalised."""
    pieces = re.split(r"(?<=[.!?])\s+|\n+", text)
    return [_normal(piece) for piece in pieces if piece.strip()]


def test_training_set_is_large_unique_and_varied():
    rows = load_prompts()
    prompts = [_normal(row["prompt"]) for row in rows]
    assert len(rows) >= 600
    assert len(set(prompts)) == len(prompts)
    assert len({row["category"] for row in rows}) >= 8


def test_training_file_is_what_the_script_writes():
    assert load_prompts() == build()


def test_eval_set_has_ten_prompts_per_spec_bench_category():
    counts = Counter(row["category"] for row in load_prompts(EVAL_SET))
    assert counts == {category: 10 for category in EVAL_CATEGORIES}


def test_eval_prompts_and_passages_are_not_in_training():
    training = [_normal(row["prompt"]) for row in load_prompts()]
    corpus = "\n".join(training)
    evaluation = load_prompts(EVAL_SET)
    assert not {_normal(row["prompt"]) for row in evaluation} & set(training)
    shared = [
        segment
        for row in evaluation
        for segment in _segments(row["prompt"])
        if len(segment) >= MIN_SHARED and segment in corpus
    ]
    assert shared == []


def test_leak_check_sees_a_shared_passage():
    """The segment check would catch an evaluation passage pasted into a training prompt."""
    passage = next(row["prompt"] for row in load_prompts(EVAL_SET) if row["category"] == "rag")
    corpus = _normal("Answer from this text.\n\n" + passage)
    assert any(len(s) >= MIN_SHARED and s in corpus for s in _segments(passage))


@pytest.mark.parametrize(
    "bad",
    [
        '{"category": "qa", "prompt": "unterminated}',
        '["qa", "What is 2 + 2?"]',
        '{"category": "qa"}',
        '{"category": "qa", "prompt": "Hi", "answer": "Hello"}',
        '{"category": "qa", "prompt": 4}',
        '{"category": " ", "prompt": "Hi"}',
    ],
)
def test_malformed_line_raises_naming_file_and_line(tmp_path, bad):
    path = tmp_path / "prompts.jsonl"
    good = json.dumps({"category": "qa", "prompt": "What is 2 + 2?"})
    path.write_text(f"{good}\n\n{bad}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}, line 3: expected"):
        load_prompts(path)


def test_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "prompts.jsonl"
    row = {"category": "qa", "prompt": "What is 2 + 2?"}
    path.write_text(f"\n{json.dumps(row)}\n\n", encoding="utf-8")
    assert load_prompts(path) == [row]
