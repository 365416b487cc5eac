"""Which float32 product a CPU runs fastest at each row count, measured on this machine.

Two ways to multiply activations x [rows, in] by a weight W [out, in] on a CPU: F.linear (x W^T)
and the "skinny" product (W x^T, transposed back: verispec.model.linear). Which wins depends on
the CPU and its BLAS: on the AMD EPYC of the development machine the skinny one is 1.1-3x
faster up to 64 rows; on an Intel Xeon (AVX512, MKL) it was 2.8-3.9x slower at 1-2 rows. So
each weight shape a float32 model loads on a machine is timed both ways at a few row counts,
once, and the answer is kept in $VERISPEC_CACHE_DIR/cpu-products.json per CPU model, torch
version, thread count and shape (a few seconds for the embedded model's five shapes, the
first time: each is timed streaming 48 MB of weights, as a step streams a model's layers).
VERISPEC_FP32_PRODUCT=skinny|linear skips the measurement.
"""

from __future__ import annotations

import json
import logging
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass

import torch

from verispec.files import atomic_path, cache_dir

_log = logging.getLogger("verispec")
ENV = "VERISPEC_FP32_PRODUCT"
# Row counts measured; a product of r rows follows the smallest of them >= r.
ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class ProductChoice:
    """skinny[i]: the skinny product is the faster one at up to ROW_COUNTS[i] rows."""

    skinny: tuple[bool, ...]

    def use_skinny(self, rows: int) -> bool:
        for count, skinny in zip(ROW_COUNTS, self.skinny):
            if rows <= count:
                return skinny
        return False


# The skinny product must beat F.linear by this factor to be chosen: F.linear, torch's own, wins
# ties and the noise of a short measurement on a shared machine.
MARGIN = 0.95


def measure(product_seconds: Callable[[str, int], float]) -> ProductChoice:
    """The choice from timings: product_seconds(kind, rows), kind "skinny" or "linear"."""
    return ProductChoice(tuple(product_seconds("skinny", r) < MARGIN * product_seconds("linear", r)
                               for r in ROW_COUNTS))


def _machine_key() -> str:  # the CPU model, torch version and thread count
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            model = next((line.split(":", 1)[1].strip() for line in info
                          if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def product_choice(product_seconds: Callable[[str, int], float],
                   shape: tuple[int, int]) -> ProductChoice:
    """This machine's choice for a weight of `shape` [out, in]: $VERISPEC_FP32_PRODUCT, else the
    cached measurement, else a new one with product_seconds(kind, rows) (see `measure`), saved
    for the next process."""
    forced = os.environ.get(ENV)
    if forced:
        if forced not in ("skinny", "linear"):
            raise ValueError(f"{ENV}={forced!r} is invalid: expected 'skinny' or 'linear'")
        return ProductChoice((forced == "skinny",) * len(ROW_COUNTS))
    path = cache_dir() / "cpu-products.json"
    key = f"{_machine_key()} | {shape[0]}x{shape[1]}"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        saved = {}
    entry = saved.get(key) if isinstance(saved, dict) else None
    if isinstance(entry, list) and len(entry) == len(ROW_COUNTS):
        return ProductChoice(tuple(bool(v) for v in entry))
    _log.info("verispec: timing float32 products with a %dx%d weight on this CPU, once", *shape)
    choice = measure(product_seconds)
    _log.info("verispec: float32 products on this CPU (%s): skinny at rows %s, F.linear "
              "otherwise", key, [r for r, s in zip(ROW_COUNTS, choice.skinny) if s])
    try:
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps({**(saved if isinstance(saved, dict) else {}),
                                       key: list(choice.skinny)}, indent=1))
    except OSError as error:  # a read-only cache: measure again next time
        _log.warning("verispec: could not save the product choice under %s (%s)", path, error)
    return choice
