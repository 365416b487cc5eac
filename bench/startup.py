"""Start-up as a user meets it, timed as whole processes: `verispec generate "Hi" --max-tokens 1`
to its first token and exit, and `verispec serve` until GET /health answers, each beside the floor
they stand on, `python -c "import torch"`, on the same machine in the same run (interleaved, so
that a machine slowing down slows all three alike). The cached embedded model: one warm-up run of
each fills the cache. Median of --runs of the wall time, of the CPU time (user + sys, every thread:
steadier than wall where other work shares the machine, but it counts OpenMP threads' spinning
too) and of the peak RSS.

The children run with bytecode caching on (PYTHONDONTWRITEBYTECODE dropped from their
environment): an installed package has its modules compiled, and without it every run would
compile verispec's ~70 modules again (~0.08 s).

    python bench/startup.py --runs 7        # JSON to bench/results/startup.json
    python bench/startup.py --threads 1     # verispec's commands on one thread: where other work
                                            # shares the cores, OpenMP threads otherwise spin waiting
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

from common import Table, write_json

import torch

BIN = Path(sys.executable).parent
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
TICKS = os.sysconf("SC_CLK_TCK")


def _reap(proc: subprocess.Popen) -> tuple[float, float]:
    """Waits for `proc`; (its CPU seconds, its peak RSS in MiB: Linux reports KiB)."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def run_to_exit(command: list[str]) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak RSS MiB) of `command` run to its exit."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    cpu, rss = _reap(proc)
    if proc.returncode:
        raise RuntimeError(f"{command} exited with {proc.returncode}")
    return time.perf_counter() - start, cpu, rss


def _cpu_so_far(pid: int) -> float:
    """CPU seconds (user + sys) process `pid` has used until now (Linux: /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime: fields 14 and 15


def serve_to_health(flags: list[str]) -> tuple[float, float, float]:
    """(wall and CPU seconds from starting `verispec serve` to its first 200 on /health, its peak
    RSS MiB); it is stopped after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    proc = subprocess.Popen([str(BIN / "verispec"), "serve", "--port", str(port), *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"verispec serve exited with {proc.returncode} before answering /health")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                    if response.status == 200:
                        seconds, cpu = time.perf_counter() - start, _cpu_so_far(proc.pid)
                        break
            except OSError:
                time.sleep(0.005)
    finally:
        proc.terminate()
    return seconds, cpu, _reap(proc)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="verispec's --threads (default: torch's)")
    parser.add_argument("--json", type=Path, default=Path("bench/results/startup.json"))
    args = parser.parse_args()
    flags = [] if args.threads is None else ["--threads", str(args.threads)]
    cases = {
        "python -c 'import torch'": lambda: run_to_exit([sys.executable, "-c", "import torch"]),
        "verispec generate 'Hi' --max-tokens 1": lambda: run_to_exit(
            [str(BIN / "verispec"), "generate", "Hi", "--max-tokens", "1", *flags]),
        "verispec serve, until /health": lambda: serve_to_health(flags),
    }
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in cases}
    for case in cases.values():  # warm-up: fills the model cache, the bytecode and the page cache
        case()
    for _ in range(args.runs):
        for name, case in cases.items():
            runs[name].append(case())
    floor = [statistics.median(r[i] for r in runs["python -c 'import torch'"]) for i in range(2)]
    table = Table("command", "wall s, median", "min-max s", "over `import torch` s", "CPU s, median",
                  "CPU over `import torch` s", "peak RSS MiB")
    rows = []
    for name, measured in runs.items():
        wall, cpu, rss = (statistics.median(r[i] for r in measured) for i in range(3))
        walls = [r[0] for r in measured]
        rows.append({"command": name, "median_s": wall, "min_s": min(walls), "max_s": max(walls),
                     "over_import_torch_s": wall - floor[0], "cpu_s": cpu, "cpu_over_import_torch_s": cpu - floor[1],
                     "peak_rss_mib": rss, "runs": walls, "cpu_runs": [r[1] for r in measured]})
        table.row(name, wall, f"{min(walls):.2f}-{max(walls):.2f}", f"{wall - floor[0]:+.2f}", cpu,
                  f"{cpu - floor[1]:+.2f}", f"{rss:.0f}")
    write_json(args.json, torch.device("cpu"), rows, runs=args.runs, verispec_threads=args.threads)


if __name__ == "__main__":
    main()
