"""Scale-out: `verispec run-batch` over one request file, in one process and on Ray Data.

The same file of chat requests (half greedy, half seeded sampling at temperature 0.8) is run by
the CLI, each configuration as its own process on a fresh output file:

    local, 1 engine x 2 threads        verispec run-batch --threads 2
    Ray, 1 replica x 2 threads         verispec run-batch --ray --replicas 1 --threads-per-replica 2
    Ray, 2 replicas x 1 thread         verispec run-batch --ray --replicas 2 --threads-per-replica 1

For each: wall time of the command, time to the first record (model load; for Ray also starting
Ray and its actors), first-to-last record time, generated tokens/s over that span and over the
whole command. Separately, a bare `ray.init()` + `ray.shutdown()` (Ray's own start-up). Checks
that every configuration wrote the same choices for every request (greedy and seeded rows alike).
Prints a table, writes JSON.

    python bench/scale.py                                  # 256 requests, 64 tokens, embedded model
    python bench/scale.py --requests 32 --max-tokens 16 --model path/to/checkpoint
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import Table, write_json
from serve import PROMPTS  # bench/serve.py's chat prompts


CONFIGS = [  # (name, run-batch flags)
    ("local, 1 engine x 2 threads", ["--threads", "2"]),
    ("Ray, 1 replica x 2 threads", ["--ray", "--replicas", "1", "--threads-per-replica", "2"]),
    ("Ray, 2 replicas x 1 thread", ["--ray", "--replicas", "2", "--threads-per-replica", "1"]),
]


def write_requests(path: Path, count: int, max_tokens: int, model: str) -> None:
    with path.open("w") as file:
        for i in range(count):
            body = {"model": model, "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} (#{i})"}]}
            body |= {"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": i}
            file.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                                   "body": body}) + "\n")


def run(flags: list[str], requests: Path, output: Path, model_flags: list[str], batch_size: int) -> dict:
    ray_flags = ["--batch-size", str(batch_size)] if "--ray" in flags else []
    command = [sys.executable, "-m", "verispec.cli", "run-batch", "-i", str(requests), "-o", str(output),
               "--no-progress", *model_flags, *flags, *ray_flags]
    start = time.perf_counter()
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    first = last = None
    seen = 0
    while process.poll() is None:
        lines = output.read_text().count("\n") if output.exists() else 0
        now = time.perf_counter()
        if lines and first is None:
            first = now
        if lines > seen:
            seen, last = lines, now
        time.sleep(0.05)
    wall = time.perf_counter() - start
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed with status {process.returncode}")
    records = [json.loads(line) for line in output.read_text().splitlines()]
    tokens = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in records if r["error"] is None)
    first = start + wall if first is None else first
    last = first if last is None else last
    return {"wall_s": wall, "first_record_s": first - start, "first_to_last_s": last - first, "tokens": tokens,
            "tok_s_first_to_last": tokens / (last - first) if last > first else None, "tok_s_wall": tokens / wall,
            "choices": {r["custom_id"]: r["response"]["body"]["choices"] for r in records if r["error"] is None},
            "errors": sum(r["error"] is not None for r in records)}


def ray_startup() -> float:
    code = "import time, ray; t = time.perf_counter(); ray.init(); ray.shutdown(); print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                 .stdout.split()[-1])


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="a checkpoint (default: the embedded model)")
    parser.add_argument("--served-model-name", default="verispec")
    parser.add_argument("--batch-size", type=int, default=32, help="Ray Data rows per batch (default 32)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "scale.json")
    args = parser.parse_args()
    model_flags = ["--served-model-name", args.served_model_name] + (["--model", args.model] if args.model else [])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        requests = Path(tmp) / "requests.jsonl"
        write_requests(requests, args.requests, args.max_tokens, args.served_model_name)
        startup = ray_startup()
        for i, (name, flags) in enumerate(CONFIGS):
            rows.append({"config": name} | run(flags, requests, Path(tmp) / f"out-{i}.jsonl", model_flags,
                                                  args.batch_size))
    identical = all(row["choices"] == rows[0]["choices"] for row in rows)
    print(f"{args.requests} chat requests, max_tokens {args.max_tokens}; bare ray.init + shutdown: {startup:.2f} s; "
          f"identical choices in every configuration: {'yes' if identical else 'NO'}")
    table = Table("configuration", "wall s", "first record s", "first to last s", "tokens", "tok/s first to last",
                  "tok/s wall", digits=1)
    for row in rows:
        table.row(row["config"], row["wall_s"], row["first_record_s"], row["first_to_last_s"], row["tokens"],
                  _rate(row["tok_s_first_to_last"]), row["tok_s_wall"])
    for row in rows:
        del row["choices"]
    write_json(args.out, torch.device("cpu"), rows, requests=args.requests, max_tokens=args.max_tokens,
               ray_startup_s=startup, identical_choices=identical)


if __name__ == "__main__":
    main()
