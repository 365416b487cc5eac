"""Could a datastore of the target's own answers draft where prompt lookup finds nothing?

Retrieval drafting (REST, He et al. 2023) proposes what followed the context's tail in a corpus
instead of in the context. A 135M model's answers are formulaic, so its own answers to other
prompts are a natural corpus. This probe measures what such a drafter would accept before any
of it is built into the engine, on the embedded model, greedy:

- datastore: the target's greedy answers (`--store-tokens` each) to the shipped training
  prompts (verispec/train/prompts.jsonl, never the evaluation prompts);
- evaluation: the target's greedy answers to the evaluation prompts
  (bench/prompts/spec_bench.jsonl), on which each drafter's chain of K drafts is replayed step
  by step: a step accepts the drafts up to the first that differs from the answer, then emits
  one token (what greedy speculative decoding does, so tokens per step is exact for these
  answers);
- drafters: prompt lookup as the engine drafts it (spec_decode/ngram.py, n = 1..3), the datastore
  alone (the longest context tail of n = max_n..min_n found in the datastore; each draft token
  the most frequent continuation among that tail's occurrences, given the drafts before it),
  and lookup first with the datastore where lookup finds nothing.

Drafting from either costs no model pass, so at K = 1 (two verify rows, which cost what one
does on this CPU: verispec/model/linear.py) tokens per step is the speed-up over no
speculation. Answers are generated once and cached under the cache directory.

    python bench/research/retrieval_probe.py                 # all 874 training prompts, 192 tokens each
    python bench/research/retrieval_probe.py --store-prompts 256 -k 1
"""

from __future__ import annotations

import argparse
import sys
import json
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, drafters.py
from common import write_json  # noqa: E402

from verispec import SamplingParams
from verispec.config import SpeculativeConfig
from verispec.engine.llm import LLM
from verispec.model.loader import cache_dir
from verispec.spec_decode.ngram import propose_ngram

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "verispec" / "train" / "prompts.jsonl"
EVAL = Path(__file__).parent / "prompts" / "spec_bench.jsonl"
LOOKUP = SpeculativeConfig()  # prompt lookup's n-gram sizes: the engine's defaults


def answers(llm: LLM, source: Path, count: int | None, max_tokens: int, cache: Path) -> list[dict]:
    """Chat-rendered prompt ids, greedy answer ids and category of the first `count` prompts of
    `source`, cached in `cache` (a JSON-lines file)."""
    if cache.exists():
        return [json.loads(line) for line in cache.read_text().splitlines()]
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()][:count]
    conversations = [[{"role": "user", "content": row["prompt"]}] for row in rows]
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=max_tokens))
    records = [{"category": row["category"], "prompt_ids": out.prompt_token_ids, "output_ids": out.token_ids}
               for row, out in zip(rows, outputs)]
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


class Datastore:
    """Every n-gram (n <= max_n) of the stored answers, with the positions where it ends."""

    def __init__(self, sequences: list[list[int]], max_n: int) -> None:
        self.sequences, self.max_n = sequences, max_n
        self.ends: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)
        for s, seq in enumerate(sequences):
            for end in range(len(seq)):
                for n in range(1, min(max_n, end + 1) + 1):
                    self.ends[tuple(seq[end - n + 1:end + 1])].append((s, end))

    def draft(self, context: list[int], min_n: int, k: int) -> list[int]:
        """At most k tokens: the most frequent continuation of the longest tail found (docstring)."""
        for n in range(min(self.max_n, len(context)), min_n - 1, -1):
            found = self.ends.get(tuple(context[-n:]))
            if found:
                follows = [self.sequences[s][end + 1:end + 1 + k] for s, end in found]
                drafts: list[int] = []
                for depth in range(k):
                    votes = Counter(f[depth] for f in follows if len(f) > depth and f[:depth] == drafts)
                    if not votes:
                        break
                    drafts.append(votes.most_common(1)[0][0])
                return drafts
        return []


def replay(records: list[dict], drafter: Callable[[list[int]], list[int]], k: int) -> dict[str, float]:
    """Tokens per step of greedy speculation with `drafter`'s chains on the recorded answers,
    over the whole set and per category."""
    steps: dict[str, int] = defaultdict(int)
    emitted: dict[str, int] = defaultdict(int)
    for r in records:
        tokens = r["prompt_ids"] + r["output_ids"]
        position = len(r["prompt_ids"])
        while position < len(tokens):
            drafts = drafter(tokens[:position])[:min(k, len(tokens) - position - 1)]
            accepted = next((i for i, t in enumerate(drafts) if t != tokens[position + i]), len(drafts))
            steps[r["category"]] += 1
            emitted[r["category"]] += accepted + 1
            position += accepted + 1
    per_category = {c: emitted[c] / steps[c] for c in steps}
    return {"all": sum(emitted.values()) / sum(steps.values()), **per_category}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store-prompts", type=int, default=None, help="training prompts answered (default all)")
    parser.add_argument("--store-tokens", type=int, default=192, help="max tokens of each stored answer")
    parser.add_argument("--max-tokens", type=int, default=96, help="max tokens of each evaluation answer")
    parser.add_argument("-k", type=int, default=4, help="drafts per step")
    parser.add_argument("--max-n", type=int, default=6, help="longest context tail looked up in the datastore")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("bench/results/retrieval_probe.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(draft="none", progress=False)
    cache = cache_dir() / "retrieval"
    stored = answers(llm, TRAIN, args.store_prompts, args.store_tokens,
                     cache / f"store-{args.store_prompts or 'all'}-{args.store_tokens}.jsonl")
    evaluated = answers(llm, EVAL, None, args.max_tokens, cache / f"eval-{args.max_tokens}.jsonl")
    store = Datastore([r["output_ids"] for r in stored], args.max_n)

    def lookup(context: list[int]) -> list[int]:
        return propose_ngram(np.asarray(context, dtype=np.int64), LOOKUP.ngram_min, LOOKUP.ngram_max, args.k)

    drafters = {"prompt lookup": lookup}
    for min_n in (1, 2, 3):
        drafters[f"datastore n>={min_n}"] = lambda c, m=min_n: store.draft(c, m, args.k)
        drafters[f"lookup, then datastore n>={min_n}"] = lambda c, m=min_n: lookup(c) or store.draft(c, m, args.k)
    store_tokens = sum(len(r["output_ids"]) for r in stored)
    print(f"datastore: {len(stored)} answers, {store_tokens} tokens; "
          f"evaluation: {len(evaluated)} answers, {sum(len(r['output_ids']) for r in evaluated)} tokens; "
          f"K = {args.k}, greedy")
    results = {name: replay(evaluated, drafter, args.k) for name, drafter in drafters.items()}
    categories = [c for c in results["prompt lookup"] if c != "all"]
    print(f"{'drafter':>30} {'tokens/step':>11} {'x lookup':>8}  " + " ".join(f"{c[:8]:>8}" for c in categories))
    rows = []
    for name, r in results.items():
        ratio = r["all"] / results["prompt lookup"]["all"]
        print(f"{name:>30} {r['all']:11.3f} {ratio:8.3f}  " + " ".join(f"{r[c]:8.2f}" for c in categories))
        rows.append({"drafter": name, "tokens_per_step": r["all"], "vs_lookup": ratio, "per_category": r})
    write_json(args.json, torch.device("cpu"), rows, k=args.k, max_n=args.max_n, store_answers=len(stored),
               store_tokens=store_tokens, max_tokens=args.max_tokens)


if __name__ == "__main__":
    main()
