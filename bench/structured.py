"""Structured output on the embedded default model: tokens/s with and without a JSON schema,
greedy, at batch 1 and 16, with no drafts, n-gram and EAGLE drafts; acceptance under the schema;
the grammar's compile time and its mask time per verified row.

    python bench/structured.py
    python bench/structured.py --batches 1 --drafts none ngram --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from common import Table, write_json

from verispec import SamplingParams
from verispec.engine.llm import LLM
from verispec.structured import GrammarSpec

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
}, "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
PROMPTS = ["Describe a fictional person.", "Invent a character for a novel.", "Tell me about a neighbour.",
           "Describe a famous scientist.", "Make up a sports player.", "Describe a chef you admire."]


def run(llm: LLM, batch: int, max_tokens: int, schema: bool) -> dict:
    messages = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + " Answer in JSON."}] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, json_schema=SCHEMA if schema else None)
    llm.chat(messages[:1], params, use_tqdm=False)  # warm-up (and the grammar's compilation)
    start = time.perf_counter()
    outs = llm.chat(messages, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    drafted = sum(o.stats.num_draft_tokens for o in outs)
    accepted = sum(o.stats.num_accepted_tokens for o in outs)
    valid = sum(1 for o in outs if o.finish_reason == "stop" and _parses(o.text)) if schema else None
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "acceptance": accepted / drafted if drafted else None, "valid": valid}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def grammar_costs(llm: LLM, reps: int) -> dict:
    spec = GrammarSpec.from_field("json_schema", SCHEMA)
    compiler = llm.engine.grammars
    compiler.lltokenizer()
    start = time.perf_counter()
    compiler._compile(spec)  # noqa: SLF001 -- the compilation alone, past the cache
    compile_s = time.perf_counter() - start
    matcher = compiler.matcher(spec)
    text = json.dumps({"name": "Ada Lovelace", "age": 36, "city": "London", "hobbies": ["maths", "poetry"]})
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    times = []
    for i in range(len(ids) - 4):
        rows = [ids[i : i + j] for j in range(5)]  # a verify step with K = 4 drafts
        for _ in range(reps):
            t = time.perf_counter()
            matcher.masks(rows)
            times.append((time.perf_counter() - t) / len(rows))
        matcher.advance(ids[i])
    return {"compile_ms": compile_s * 1e3, "mask_us_per_row": statistics.median(times) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--drafts", nargs="+", default=["none", "ngram", "eagle"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("bench/results/structured.json"))
    args = parser.parse_args()
    rows = []
    table = None
    for draft in args.drafts:
        llm = LLM(draft=draft, num_speculative_tokens=4, progress=False)
        if not rows:
            costs = grammar_costs(llm, reps=5)
            print(f"schema compile {costs['compile_ms']:.2f} ms, mask {costs['mask_us_per_row']:.1f} us per row")
            table = Table("draft", "batch", "tok/s plain", "tok/s with the schema", "ratio", "acceptance", "valid")
        for batch in args.batches:
            plain, constrained = (run(llm, batch, args.max_tokens, schema) for schema in (False, True))
            row = {"draft": draft, "batch": batch, "plain": plain, "schema": constrained,
                   "schema_over_plain": constrained["tok_s"] / plain["tok_s"]}
            rows.append(row)
            table.row(draft, batch, f"{plain['tok_s']:.1f}", f"{constrained['tok_s']:.1f}",
                      f"{row['schema_over_plain']:.2f}x", constrained["acceptance"], f"{constrained['valid']}/{batch}")
    write_json(args.out, torch.device("cpu"), rows, **costs)


if __name__ == "__main__":
    main()
