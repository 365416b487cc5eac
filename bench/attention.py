"""The compiled row-by-row attention (csrc/attention.cpp) alone: microseconds per call and
nanoseconds per attended (position, head) for R query rows of one sequence against a float16
paged cache, at the embedded model's shape (9 query heads, 3 key/value heads, head dim 64); the
ms column is a step's 30 layers. What one more verify row costs in attention is the R = 1 -> 5
difference. Compare two builds by running the script under each one's PYTHONPATH, alternately.

    python bench/attention.py                       # 2 threads, contexts 200 and 512
    PYTHONPATH=/path/to/other/checkout python bench/attention.py --context 512
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import Table, measure, write_json

from verispec.model.quant.kernels import compiled_kernels

LAYERS, HEADS, KV_HEADS, DIM, BLOCK = 30, 9, 3, 64, 16


def time_call(context: int, rows: int, reps: int) -> float:
    """Median seconds of one call: `rows` rows whose last sees position context - 1."""
    blocks = -(-context // BLOCK)
    generator = torch.Generator().manual_seed(context)
    cache = torch.randn(2, blocks, BLOCK, KV_HEADS, DIM, generator=generator).half()
    table = torch.arange(blocks, dtype=torch.int64)[None]
    q = torch.randn(rows, HEADS, DIM, generator=generator)
    zeros = torch.zeros(rows, dtype=torch.int64)
    visible = torch.arange(context - rows + 1, context + 1, dtype=torch.int64)
    no_tree = torch.zeros(rows, 0, dtype=torch.bool)
    kernels = compiled_kernels()
    return measure(lambda: kernels.paged_attention_rows(q, cache, table, zeros, zeros, visible, zeros,
                                                        no_tree, DIM ** -0.5, 0.0),
                   torch.device("cpu"), reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, nargs="+", default=[200, 512])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--json", type=Path, default=Path("bench/results/attention.json"))
    args = parser.parse_args()
    if compiled_kernels() is None:
        parser.error("the compiled kernels are not built (make setup)")
    torch.set_num_threads(args.threads)
    table = Table("context", "rows", "µs / call", f"ms / step ({LAYERS} layers)", "ns / (position, head)")
    results = []
    for context in args.context:
        for rows in args.rows:
            seconds = time_call(context, rows, args.reps)
            per_pair = seconds / (rows * HEADS * context) * 1e9
            table.row(context, rows, seconds * 1e6, seconds * LAYERS * 1e3, per_pair)
            results.append({"context": context, "rows": rows, "seconds": seconds})
    write_json(args.json, torch.device("cpu"), results, threads=args.threads)


if __name__ == "__main__":
    main()
