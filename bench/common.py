"""Shared by the benchmark scripts: timing, memory bandwidth, the machine a run was on, its table
on stdout (Table: markdown, as docs/benchmarks.md holds them) and where its results go (one JSON
file per benchmark: {"meta": machine, date, commit, ..., "rows": [...]})."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch


def measure(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of `reps` calls after one warm-up; on CUDA, triton's do_bench median (L2
    flushed, CUDA events; see docs/design.md, "Benchmarks")."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large copy on `device`, reads and writes both counted."""
    src = torch.empty(64 * 2**20, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = measure(lambda: dst.copy_(src), device, reps=10)
    return 2 * src.numel() * 4 / seconds


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device) -> dict[str, object]:
    """Where and when a run was measured, for its JSON file and its table's caption."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else cpu_name(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
    }


class Table:
    """A benchmark's table on stdout in markdown, its header printed at once and each row as it is
    measured (a long run shows its progress). A cell is printed as given: a float with `digits`
    decimals, anything else with str()."""

    def __init__(self, *columns: str, digits: int = 2) -> None:
        self.digits = digits
        print("| " + " | ".join(columns) + " |")
        print("|" + "---|" * len(columns), flush=True)

    def row(self, *cells: object) -> None:
        text = (f"{c:.{self.digits}f}" if isinstance(c, float) else str(c) for c in cells)
        print("| " + " | ".join(text) + " |", flush=True)


def write_json(path: Path, device: torch.device, rows: list[dict], **meta: object) -> None:
    """The run's rows and `meta` beside `machine(device)`, to `path` (its folder created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    info = {**machine(device), **meta}
    path.write_text(json.dumps({"meta": info, "rows": rows}, indent=2))
    print(f"wrote {path}")
