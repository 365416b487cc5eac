"""Where a streamed token's time goes in `verispec serve`: engine step, hand-over to the event
loop, SSE encoding, uvicorn and the client, against the offline engine on the same requests.

The server runs in this process exactly as `verispec serve` builds it (build_app, uvicorn with
the server's own config), with the engine's step and the stream's chunk encoder wrapped to note
the time. Clients are separate processes (bench/serve_client.py) that note each chunk's arrival;
all clocks are time.monotonic (one clock across processes on Linux). Per token it prints:
- step: the engine step that made it (ms), and how much of the wall time the engine spent
  stepping (what is left is the engine waiting on the server);
- handoff: step end -> the event loop encoding the chunk; client: encoded -> the client
  having parsed it (uvicorn, the socket, the OpenAI client);
- server / offline: wall per token through the server over wall per token of LLM.chat on the
  same requests in this process (max_num_seqs = clients), the server's whole cost.

    python bench/serve_profile.py --clients 1 --requests 6 --max-tokens 128
    python bench/serve_profile.py --clients 16 --requests 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import uvicorn

from serve_client import PROMPTS

from verispec import SamplingParams
from verispec.config import ServeLimits
from verispec.engine.llm import LLM
from verispec.serve import build_app
from verispec.serve import app as serve_app
from verispec.serve.limits import server_config



def conversations(requests: int) -> list[list[dict]]:
    return [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(requests)]


def traced_server(llm: LLM, port: int) -> tuple[uvicorn.Server, list[tuple[float, float]], list[float]]:
    """A started server, the (start, end) of every engine step and the time of every encoded chunk."""
    steps: list[tuple[float, float]] = []
    encoded: list[float] = []
    step = llm.engine.step

    def timed_step():  # engine thread only
        start = time.monotonic()
        outputs = step()
        steps.append((start, time.monotonic()))
        return outputs

    llm.engine.step = timed_step
    event = serve_app._event

    def timed_event(body: dict) -> str:
        text = event(body)
        encoded.append(time.monotonic())
        return text

    serve_app._event = timed_event
    server = uvicorn.Server(server_config(build_app(llm, "smollm2"), "127.0.0.1", port, ServeLimits(),
                                          log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, steps, encoded


def run_clients(port: int, clients: int, requests: int, max_tokens: int) -> list[dict]:
    script = Path(__file__).parent / "serve_client.py"
    procs = [subprocess.Popen([sys.executable, str(script), f"http://127.0.0.1:{port}", str(c), str(clients),
                               str(requests), str(max_tokens)], stdout=subprocess.PIPE, text=True)
             for c in range(clients)]
    return [json.loads(line) for p in procs for line in p.communicate()[0].splitlines()]


def nearest_after(times: list[float], t: float) -> float | None:
    later = [x for x in times if x >= t]
    return min(later) if later else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft", default="none")
    parser.add_argument("--port", type=int, default=8457)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(draft=args.draft, max_num_seqs=args.clients, progress=False)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.chat(conversations(args.requests), params, use_tqdm=False)  # warm-up: the server meets warm caches too
    started = time.perf_counter()
    offline = llm.chat(conversations(args.requests), params, use_tqdm=False)
    offline_s = time.perf_counter() - started
    offline_tokens = sum(len(o.token_ids) for o in offline)

    server, steps, encoded = traced_server(llm, args.port)
    try:
        run_clients(args.port, 1, 1, 8)  # warm-up
        steps.clear()
        encoded.clear()
        results = run_clients(args.port, args.clients, args.requests, args.max_tokens)
    finally:
        server.should_exit = True
    # From the first request sent to the last chunk parsed: the clients' start-up is not serving.
    wall = max(r["arrivals"][-1] for r in results) - min(r["start"] for r in results)
    arrivals = sorted(t for r in results for t in r["arrivals"])
    tokens = sum(r["tokens"] for r in results)
    step_ms = statistics.median(e - s for s, e in steps) * 1e3
    first = min(r["start"] for r in results)
    busy = sum(e - s for s, e in steps if s >= first) / wall
    ends = [e for _, e in steps]
    handoff = [enc - max((e for e in ends if e <= enc), default=enc) for enc in encoded]
    to_client = [a - max((t for t in encoded if t <= a), default=a) for a in arrivals]
    print(f"clients {args.clients}, {args.requests} requests x {args.max_tokens} tokens, {args.threads} threads")
    print(f"offline: {offline_tokens / offline_s:.1f} tok/s ({offline_s / offline_tokens * 1e3:.2f} ms/token)")
    print(f"server:  {tokens / wall:.1f} tok/s ({wall / tokens * 1e3:.2f} ms/token); "
          f"server / offline time per token: {wall / tokens / (offline_s / offline_tokens):.3f}")
    print(f"engine step p50 {step_ms:.2f} ms over {len(steps)} steps; engine stepping {busy:.1%} of the wall time")
    print(f"handoff (step end -> chunk encoded) p50 {statistics.median(handoff) * 1e3:.2f} ms; "
          f"chunk encoded -> client parsed p50 {statistics.median(to_client) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
