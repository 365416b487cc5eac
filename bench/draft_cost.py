"""What drafting costs, in units of the target step's fixed cost a (verispec.config.DraftCost).

Runs the engine with each drafter at a fixed K (1..4) and batch 1 and `--batch`, greedy, and
times every target forward pass and every drafter call. a and the row cost come from the target
passes of the same run (a pass over R rows: a + b * padded rows, least squares; row_cost =
b / a, what LlamaModel.row_cost should be), so slowness of the machine (a job beside it)
cancels out of the ratios. Prints, per drafter, the median cost of a call in
units of a by (depth, drafting requests) and the least-squares DraftCost fit, the numbers the
drafters declare (Drafter.draft_cost), and the fitted row cost.

    python bench/draft_cost.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from common import Table, write_json
from drafters import chat_ids, load

from verispec import SamplingParams
from verispec.engine.llm import LLM


def timed(record: list[tuple[int, int, float]], fn, key):
    """fn, recording (key(args)..., seconds) of every call."""
    def wrapper(*args):
        start = time.perf_counter()
        out = fn(*args)
        record.append((*key(*args), time.perf_counter() - start))
        return out
    return wrapper


def run(k: int, prompts: list[list[int]], params: SamplingParams, llm: LLM) -> tuple[list, list]:
    """Generates `prompts` together at K = k; (rows, 0, seconds) per target pass and
    (depth, drafting requests, seconds) per drafter call."""
    engine = llm.engine
    passes: list[tuple[int, int, float]] = []
    calls: list[tuple[int, int, float]] = []
    rows = lambda feeds, *_: (sum(len(f.token_ids) for f in feeds), 0)  # noqa: E731
    runner, drafter = engine.runner, engine.drafter
    originals = runner.forward, runner.forward_hidden, drafter.propose
    runner.forward, runner.forward_hidden = timed(passes, runner.forward, rows), timed(passes, runner.forward_hidden, rows)
    drafter.propose = timed(calls, drafter.propose, lambda requests: (
        max(r.num_draft_tokens for r in requests), sum(r.num_draft_tokens > 0 for r in requests)))
    for p in prompts:
        engine.add_request(p, params, num_speculative_tokens=k)
    while engine.has_unfinished():
        engine.step()
    runner.forward, runner.forward_hidden, drafter.propose = originals
    return passes, calls


def fit_pass_cost(passes: list[tuple[int, int, float]], padded_rows) -> tuple[float, float]:
    """The target pass's cost a + b * padded rows, fitted by least squares to the median
    seconds of each padded row count (decode-sized passes, 32 rows at most): (a, b / a)."""
    cells = defaultdict(list)
    for rows, _, seconds in passes:
        if rows <= 32:
            cells[padded_rows(rows)].append(seconds)
    keys = sorted(k for k, v in cells.items() if len(v) >= 3)
    x = torch.tensor([[1.0, k] for k in keys], dtype=torch.float64)
    y = torch.tensor([statistics.median(cells[k]) for k in keys], dtype=torch.float64)
    a, b = torch.linalg.lstsq(x, y[:, None]).solution[:, 0].tolist()
    return a, b / a


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafters", default="ngram,medusa,eagle")
    parser.add_argument("--prompts", type=int, default=2, help="batch-1 prompts per drafter and K")
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("bench/results/draft_cost.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    texts = [row["prompt"] for row in load(max(args.prompts, -(-args.batch // 6)))]
    results = []
    for name in args.drafters.split(","):
        llm = LLM(draft=name, num_speculative_tokens=4, adaptive=False, progress=False)
        ids = [chat_ids(llm, text) for text in texts]
        passes, calls = [], []
        for k in (1, 2, 4):
            for batch in (1, args.batch):
                chosen = ids[: args.prompts] if batch == 1 else ids[:batch]
                for start in range(0, len(chosen), batch):
                    p, c = run(k, chosen[start : start + batch], params, llm)
                    passes += p
                    calls += c
        a, row_cost = fit_pass_cost(passes, llm.model.padded_rows)
        cells = defaultdict(list)
        for depth, n, seconds in calls:
            cells[(depth, n)].append(seconds / a)
        # Least squares over the cells' medians: cost = per_call + per_request n + depth (per_position + per_row n).
        keys = sorted(k for k, v in cells.items() if len(v) >= 3)
        x = torch.tensor([[1.0, n, d, d * n] for d, n in keys], dtype=torch.float64)
        y = torch.tensor([statistics.median(cells[key]) for key in keys], dtype=torch.float64)
        fit = torch.linalg.lstsq(x, y[:, None]).solution[:, 0].clamp(min=0).tolist()
        print(f"{name}: a = {1000 * a:.1f} ms, row_cost = {row_cost:.3f} "
              f"(LlamaModel.row_cost: {llm.model.row_cost}); DraftCost(per_call={fit[0]:.4f}, per_request={fit[1]:.4f}, "
              f"per_position={fit[2]:.4f}, per_row={fit[3]:.4f})")
        results.append({"drafter": name, "a_seconds": a, "row_cost": row_cost, "fit": dict(zip(
            ("per_call", "per_request", "per_position", "per_row"), fit)),
            "cells": {f"{d},{n}": statistics.median(cells[(d, n)]) for d, n in keys},
            "calls": {f"{d},{n}": len(cells[(d, n)]) for d, n in keys}})
        del llm
    table = Table("drafter", "depth", "requests", "drafting call / a", "calls", digits=4)
    for result in results:
        for key, value in result["cells"].items():
            depth, requests = key.split(",")
            table.row(result["drafter"], depth, requests, value, result["calls"][key])
    write_json(args.json, torch.device("cpu"), results, threads=args.threads, max_tokens=args.max_tokens)


if __name__ == "__main__":
    sys.exit(main())
