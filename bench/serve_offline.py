"""The offline engine on bench/serve.py's workload: what `verispec serve` would reach with no
server in the way. Run by bench/serve.py in its own process, with the server's thread count.

For each concurrency c, one LLM with max_num_seqs=c completes every request (the same chat
prompts, greedy, max_tokens) with continuous batching, as c clients sending requests back to back
keep c in flight. Prints one JSON line per level: {"concurrency", "seconds", "texts"}.

    python bench/serve_offline.py --draft none --requests 16 --max-tokens 64 --concurrency 1 4 16
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from verispec import SamplingParams
from verispec.engine.llm import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default="none")
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--concurrency", type=int, nargs="+", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--prompts", nargs="+", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    conversations = [[{"role": "user", "content": args.prompts[i % len(args.prompts)]}] for i in range(args.requests)]
    for concurrency in args.concurrency:
        llm = LLM(draft=args.draft, max_num_seqs=concurrency, progress=False)
        # The servers get a warm-up request and keep their prefix cache; so does this engine.
        llm.chat(conversations[0], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        started = time.perf_counter()
        outs = llm.chat(conversations, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        print(json.dumps({"concurrency": concurrency, "seconds": seconds, "texts": [o.text for o in outs]}),
              flush=True)


if __name__ == "__main__":
    main()
