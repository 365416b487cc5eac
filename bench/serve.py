"""Serving on the embedded default model: `verispec serve` against `transformers serve
--continuous-batching` and llama.cpp's server, with the offline engine as the server's own bound.

Each server runs as its own process on 127.0.0.1 with the same thread count and the same chat
prompts, greedy, streamed: verispec serve and llama.cpp's `llama-server` on the embedded GGUF
file (verispec runs its 4-bit blocks as stored; llama-server with one slot per client and
continuous batching), transformers on the float32 checkpoint verispec converts from it (it
cannot run the GGUF's blocks). For concurrency 1, 4 and 16 clients (threads, each sending its
next request as soon as its last one finished) it measures requests/s, output tokens/s (completions
re-tokenized with the model's tokenizer, so every server is counted alike), time to first token
and inter-chunk latency (p50 / p99). The `offline` rows run the same requests through
LLM.chat with max_num_seqs = clients (bench/serve_offline.py), so server / offline is what the
server costs. Prints a table with the ratio to transformers, writes JSON.

    python bench/serve.py --llama-server ~/llama.cpp/build/bin/llama-server
    python bench/serve.py --requests 8 --max-tokens 32 --concurrency 1 4 --servers verispec offline

Servers: offline, offline-ngram, verispec, verispec-ngram, transformers-cb (continuous
batching), transformers (its default: one request at a time), llama.cpp (needs --llama-server).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import openai
import torch
from common import Table, write_json

from verispec.model.loader import converted_checkpoint_dir, default_model_path
from verispec.model.tokenizer import Tokenizer

PROMPTS = [
    "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog.",
    "Write a short story about a lighthouse keeper.",
    "List the planets of the solar system in order.",
    "Explain what a hash table is in two sentences.",
    "Copy this list: apples, pears, plums, apples, pears, plums, apples, pears, plums.",
    "Give three tips for learning a new language.",
    "What is the capital of France, and why is it famous?",
    "Write a haiku about the sea.",
]

SERVERS = ("offline", "offline-ngram", "verispec", "verispec-ngram", "transformers-cb", "transformers", "llama.cpp")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, threads: int, slots: int, llama_server: Path | None) -> tuple[subprocess.Popen, str, str]:
    """(process, base url, model name) of a server that answers /health."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    bin_dir = Path(sys.executable).parent
    if name.startswith("verispec"):
        draft = "ngram" if name.endswith("ngram") else "none"
        command = [str(bin_dir / "verispec"), "serve", "--port", str(port), "--threads", str(threads),
                   "--draft", draft, "--served-model-name", "smollm2"]
        model = "smollm2"
    elif name == "llama.cpp":
        if llama_server is None:
            raise SystemExit("--servers llama.cpp needs --llama-server PATH (llama.cpp's llama-server binary)")
        # One slot per client, each with room for a prompt and its completion; continuous batching.
        command = [str(llama_server), "-m", str(default_model_path()), "--host", "127.0.0.1", "--port", str(port),
                   "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(512 * slots),
                   "--cont-batching", "--no-webui"]
        model = "smollm2"
    else:
        command = [str(bin_dir / "transformers"), "serve", str(converted_checkpoint_dir()), "--port", str(port),
                   "--device", "cpu"]
        command += ["--continuous-batching"] if name == "transformers-cb" else []
        model = str(converted_checkpoint_dir())
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited: {process.stderr.read().decode()[-2000:]}")
        try:
            if httpx2.get(url + "/health", timeout=2).status_code == 200:
                return process, url, model
        except httpx2.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{name} did not start")
        time.sleep(1)


def one_request(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    arrivals = []
    text = ""
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
            text += chunk.choices[0].delta.content
    return {"start": start, "arrivals": arrivals, "text": text}


def run_level(url: str, model: str, concurrency: int, requests: int, max_tokens: int) -> list[dict]:
    """`concurrency` clients, each taking the next request as soon as its last one finished (one
    shared queue, as users would, and as the offline engine's queue does: no client is left with
    a heavier share at the end)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    results: list[dict] = []
    lock = threading.Lock()
    pending = iter(range(requests))

    def worker() -> None:
        while True:
            with lock:
                i = next(pending, None)
            if i is None:
                return
            result = one_request(client, model, PROMPTS[i % len(PROMPTS)], max_tokens)
            with lock:
                results.append(result)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def summarise(results: list[dict], wall: float, tokenizer: Tokenizer) -> dict:
    tokens = sum(len(tokenizer.encode(r["text"], add_special_tokens=False)) for r in results)
    ttft = [r["arrivals"][0] - r["start"] for r in results if r["arrivals"]]
    gaps = [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:])]

    def pct(values: list[float], q: float) -> float:
        return statistics.quantiles(values, n=100)[q - 1] * 1e3 if len(values) > 1 else float("nan")

    return {
        "requests_per_s": len(results) / wall, "output_tok_per_s": tokens / wall,
        "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
        "itl_p50_ms": pct(gaps, 50), "itl_p99_ms": pct(gaps, 99),
    }


def offline(draft: str, args: argparse.Namespace, tokenizer: Tokenizer) -> list[dict]:
    """Rows of the offline engine on the same requests (bench/serve_offline.py, its own process)."""
    command = [sys.executable, str(Path(__file__).parent / "serve_offline.py"), "--draft", draft,
               "--requests", str(args.requests), "--max-tokens", str(args.max_tokens), "--threads", str(args.threads),
               "--concurrency", *map(str, args.concurrency), "--prompts", *PROMPTS]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    lines = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout.splitlines()
    rows = []
    for line in lines:
        level = json.loads(line)
        tokens = sum(len(tokenizer.encode(text, add_special_tokens=False)) for text in level["texts"])
        rows.append({"concurrency": level["concurrency"], "requests_per_s": args.requests / level["seconds"],
                     "output_tok_per_s": tokens / level["seconds"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--servers", nargs="+", choices=SERVERS,
                        default=["offline", "verispec", "verispec-ngram", "transformers-cb", "llama.cpp"])
    parser.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary (for --servers llama.cpp)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "serve.json")
    args = parser.parse_args()
    tokenizer = Tokenizer.from_directory(converted_checkpoint_dir())
    rows = []
    for name in args.servers:
        if name.startswith("offline"):
            for row in offline("ngram" if name.endswith("ngram") else "none", args, tokenizer):
                rows.append({"server": name, **row})
                print(rows[-1], flush=True)
            continue
        process, url, model = start(name, args.threads, max(args.concurrency), args.llama_server)
        try:
            run_level(url, model, 1, 1, 8)  # warm-up: first-request costs are not serving costs
            for concurrency in args.concurrency:
                started = time.perf_counter()
                results = run_level(url, model, concurrency, args.requests, args.max_tokens)
                rows.append({"server": name, "concurrency": concurrency,
                             **summarise(results, time.perf_counter() - started, tokenizer)})
                print(rows[-1], flush=True)
        finally:
            process.terminate()
            process.wait(timeout=60)
    baseline_name = "transformers-cb" if "transformers-cb" in args.servers else "transformers"
    baseline = {r["concurrency"]: r["output_tok_per_s"] for r in rows if r["server"] == baseline_name}
    table = Table("server", "clients", "req/s", "tok/s", f"vs {baseline_name}", "TTFT p50 ms", "TTFT p99 ms",
                  "ITL p50 ms", "ITL p99 ms")
    nan = float("nan")
    for r in rows:
        ratio = r["output_tok_per_s"] / baseline[r["concurrency"]] if r["concurrency"] in baseline else nan
        table.row(r["server"], r["concurrency"], r["requests_per_s"], f"{r['output_tok_per_s']:.1f}", ratio,
                  f"{r.get('ttft_p50_ms', nan):.0f}", f"{r.get('ttft_p99_ms', nan):.0f}",
                  f"{r.get('itl_p50_ms', nan):.1f}", f"{r.get('itl_p99_ms', nan):.1f}")
    write_json(args.out, torch.device("cpu"), rows, requests=args.requests, max_tokens=args.max_tokens)


if __name__ == "__main__":
    main()
