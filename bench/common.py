"""Shared by the benchmark scripts: timing, memory bandwidth, and where results go."""

from __future__ import annotations

import json
import platform
import statistics
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


def write_json(path: Path, device: torch.device, rows: list[dict], **meta: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    info = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        **meta,
    }
    path.write_text(json.dumps({"meta": info, "rows": rows}, indent=2))
    print(f"wrote {path}")
