"""What a drafter adds to a step outside the target's pass: its bookkeeping, even where it drafts
nothing.

Each drafter's default engine (the 4-bit embedded target, adaptive K) generates the prompt classes
(bench/prompts/classes.jsonl) at batch 1 (prompt by prompt) or all at once (--batch), greedy,
engines taking turns round by round. Every target pass is timed (the runner's forward, with or
without captured hidden states, drafting excluded); the rest of the step is the engine's Python,
the drafter's calls and their bookkeeping. Per drafter, medians over the rounds: tok/s, steps,
ms per step, of which the target's pass and the rest, and the rest over no drafts'. On a shared
machine the pass's time moves with the neighbours' load; the rest moves much less, which makes
its difference a steadier reading of what an aside drafter costs than tok/s.

    python bench/step_split.py                                   # none, EAGLE, lookup + EAGLE
    python bench/step_split.py --drafters none ngram ngram+eagle --batch 16 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from common import Table, write_json
from draft_cost import timed
from drafters import CLASSES, chat_ids

from verispec import SamplingParams
from verispec.engine.llm import LLM


def run_round(llm: LLM, prompts: list[list[int]], params: SamplingParams, batch: int) -> dict:
    """One pass over the prompts (batch 1: one by one; else together, `batch` at a time):
    tokens, steps, seconds and the target passes' seconds."""
    passes: list[tuple[float]] = []
    runner = llm.engine.runner
    originals = runner.forward, runner.forward_hidden
    runner.forward = timed(passes, runner.forward, lambda *_: ())
    runner.forward_hidden = timed(passes, runner.forward_hidden, lambda *_: ())
    try:
        groups = [[p] for p in prompts] if batch == 1 else \
            [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        start = time.perf_counter()
        outs = [o for group in groups for o in llm.generate(group, params, use_tqdm=False)]
        seconds = time.perf_counter() - start
    finally:
        runner.forward, runner.forward_hidden = originals
    return {"tokens": sum(len(o.token_ids) for o in outs), "steps": len(passes), "seconds": seconds,
            "pass_seconds": sum(s for (s,) in passes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafters", nargs="+", default=["none", "eagle", "ngram+eagle"],
                        help="as LLM(draft=...); the first is the baseline")
    parser.add_argument("--batch", type=int, default=1, help="requests at once (the class prompts repeated)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("bench/results/step_split.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    texts = [json.loads(line)["prompt"] for line in CLASSES.read_text().splitlines() if line.strip()]
    if args.batch > 1:
        texts = (texts * -(-args.batch // len(texts)))[: args.batch]
    llms = {name: LLM(draft=name, progress=False) for name in args.drafters}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    prompts = {name: [chat_ids(llm, t) for t in texts] for name, llm in llms.items()}
    for name, llm in llms.items():  # warm: caches filled, costs learned on this machine
        llm.generate(prompts[name][:2], params, use_tqdm=False)
    rounds = {name: [] for name in llms}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            rounds[name].append(run_round(llm, prompts[name], params, args.batch))
    rows = []
    for name, runs in rounds.items():
        def median(f):
            return statistics.median(f(r) for r in runs)
        rows.append({"drafter": name, "batch": args.batch, "tok_s": median(lambda r: r["tokens"] / r["seconds"]),
                     "steps": median(lambda r: r["steps"]),
                     "step_ms": median(lambda r: r["seconds"] / r["steps"] * 1e3),
                     "pass_ms": median(lambda r: r["pass_seconds"] / r["steps"] * 1e3),
                     "rest_ms": median(lambda r: (r["seconds"] - r["pass_seconds"]) / r["steps"] * 1e3)})
    base = rows[0]
    table = Table("drafter", "batch", "tok/s", "steps", "ms / step", "pass ms", "rest ms", "rest - baseline ms",
                  digits=3)
    for row in rows:
        row["rest_over_baseline_ms"] = row["rest_ms"] - base["rest_ms"]
        table.row(row["drafter"], row["batch"], f"{row['tok_s']:.1f}", f"{row['steps']:.0f}", row["step_ms"],
                  row["pass_ms"], row["rest_ms"], row["rest_over_baseline_ms"])
    write_json(args.json, torch.device("cpu"), rows, batch=args.batch, rounds=args.rounds,
               max_tokens=args.max_tokens, threads=args.threads)


if __name__ == "__main__":
    main()
