"""Start-up as a user meets it, timed as whole processes: `verispec generate "Hi" --max-tokens 1`
to its first token and exit, and `verispec serve` until GET /health answers, each beside the floor
they stand on, `python -c "import torch"`, on the same machine in the same run (interleaved, so
that a machine slowing down slows all three alike). The cached embedded model: one warm-up run of
each fills the cache. Median of --runs, and peak RSS of the process.

    python bench/startup.py --runs 7        # JSON to bench/results/startup.json
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from common import write_json

import torch

BIN = Path(sys.executable).parent


def _reap(proc: subprocess.Popen) -> float:
    """Waits for `proc`; its peak RSS in MiB (Linux reports KiB)."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss / 1024


def run_to_exit(command: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS MiB) of `command` run to its exit."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rss = _reap(proc)
    if proc.returncode:
        raise RuntimeError(f"{command} exited with {proc.returncode}")
    return time.perf_counter() - start, rss


def serve_to_health() -> tuple[float, float]:
    """(seconds from starting `verispec serve` to its first 200 on /health, its peak RSS MiB then);
    it is stopped after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    proc = subprocess.Popen([str(BIN / "verispec"), "serve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"verispec serve exited with {proc.returncode} before answering /health")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                    if response.status == 200:
                        seconds = time.perf_counter() - start
                        break
            except OSError:
                time.sleep(0.005)
    finally:
        proc.terminate()
    return seconds, _reap(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--json", type=Path, default=Path("bench/results/startup.json"))
    args = parser.parse_args()
    cases = {
        "python -c 'import torch'": lambda: run_to_exit([sys.executable, "-c", "import torch"]),
        "verispec generate 'Hi' --max-tokens 1": lambda: run_to_exit(
            [str(BIN / "verispec"), "generate", "Hi", "--max-tokens", "1"]),
        "verispec serve, until /health": serve_to_health,
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    peaks: dict[str, list[float]] = {name: [] for name in cases}
    for case in cases.values():  # warm-up: fills the model cache and the page cache
        case()
    for _ in range(args.runs):
        for name, case in cases.items():
            seconds, rss = case()
            times[name].append(seconds)
            peaks[name].append(rss)
    floor = statistics.median(times["python -c 'import torch'"])
    rows = [{"command": name, "median_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
             "over_import_torch_s": statistics.median(t) - floor, "peak_rss_mib": statistics.median(peaks[name]), "runs": t}
            for name, t in times.items()]
    print(f"| command | median s | min-max s | over `import torch` s | peak RSS MiB |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['command']} | {r['median_s']:.2f} | {r['min_s']:.2f}-{r['max_s']:.2f} | "
              f"{r['over_import_torch_s']:+.2f} | {r['peak_rss_mib']:.0f} |")
    write_json(args.json, torch.device("cpu"), rows, runs=args.runs)


if __name__ == "__main__":
    main()
