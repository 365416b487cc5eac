"""Which float32 product a CPU runs fastest at each row count, measured on this machine.

Three ways to multiply activations x [rows, in] by a weight W [out, in] on a CPU (the *kinds*):
"linear", F.linear (x W^T); "skinny", W x^T transposed back (verispec.model.linear); and
"compiled", verispec's own product (csrc/f32linear.h: each weight row read once for up to eight
rows, a row's result independent of the others), where the extension is built. Which wins
depends on the CPU and its BLAS: on the AMD EPYC of the development machine the skinny one is
1.1-3x faster than F.linear up to 64 rows and the compiled one faster still up to 8 rows; on an
Intel Xeon (AVX512, MKL) the skinny one was 2.8-3.9x slower than F.linear at 1-2 rows. So each
weight shape a float32 model loads on a machine is timed every way at a few row counts, once,
and the answer is kept in $VERISPEC_CACHE_DIR/cpu-products.json per CPU model, torch version,
thread count, kinds and shape (about ten seconds for the embedded model's five shapes, the
first time: each is timed streaming 48 MB of weights, as a step streams a model's layers).
VERISPEC_FP32_PRODUCT=<kind> skips the measurement.
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
KINDS = ("linear", "skinny", "compiled")
# Row counts measured; a product of r rows follows the smallest of them >= r.
ROW_COUNTS = (1, 2, 4, 6, 8, 16, 32, 64)  # 6: a verify step at K = 5
# The compiled product is timed up to this many rows: beyond, it reads the weights once per
# eight rows and BLAS wins.
COMPILED_MAX_ROWS = 16


@dataclass(frozen=True)
class ProductChoice:
    """kinds[i]: the product (KINDS) run at up to ROW_COUNTS[i] rows; F.linear beyond."""

    kinds: tuple[str, ...]

    def kind(self, rows: int) -> str:
        for count, kind in zip(ROW_COUNTS, self.kinds):
            if rows <= count:
                return kind
        return "linear"


# Another product must beat F.linear by this factor to be chosen: F.linear, torch's own, wins
# ties and the noise of a short measurement on a shared machine.
MARGIN = 0.95


def measure(product_seconds: Callable[[str, int], float], kinds: tuple[str, ...]) -> ProductChoice:
    """The choice from timings: product_seconds(kind, rows) for each of `kinds` (KINDS; the
    compiled product up to COMPILED_MAX_ROWS rows)."""
    chosen = []
    for rows in ROW_COUNTS:
        timed = {kind: product_seconds(kind, rows) for kind in kinds
                 if kind != "compiled" or rows <= COMPILED_MAX_ROWS}
        timed["linear"] *= MARGIN  # the others must beat it by the margin
        chosen.append(min(timed, key=timed.__getitem__))
    return ProductChoice(tuple(chosen))


def machine_key() -> str:
    """The CPU model, torch version and thread count: what measurements kept per machine depend on."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            model = next((line.split(":", 1)[1].strip() for line in info
                          if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def product_choice(product_seconds: Callable[[str, int], float], shape: tuple[int, int],
                   kinds: tuple[str, ...]) -> ProductChoice:
    """This machine's choice among `kinds` (those it can run) for a weight of `shape` [out, in]:
    $VERISPEC_FP32_PRODUCT, else the cached measurement, else a new one with
    product_seconds(kind, rows) (see `measure`), saved for the next process."""
    forced = os.environ.get(ENV)
    if forced:
        if forced not in kinds:
            raise ValueError(f"{ENV}={forced!r} is invalid: expected one of {kinds} (the products "
                             "this machine runs)")
        return ProductChoice((forced,) * len(ROW_COUNTS))
    path = cache_dir() / "cpu-products.json"
    key = f"{machine_key()} | {'/'.join(kinds)} | {shape[0]}x{shape[1]}"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        saved = {}
    entry = saved.get(key) if isinstance(saved, dict) else None
    if isinstance(entry, list) and len(entry) == len(ROW_COUNTS) and set(entry) <= set(kinds):
        return ProductChoice(tuple(entry))
    _log.info("verispec: timing float32 products with a %dx%d weight on this CPU, once", *shape)
    choice = measure(product_seconds, kinds)
    _log.info("verispec: float32 products on this CPU (%s): %s by rows up to %s, F.linear beyond",
              key, list(choice.kinds), list(ROW_COUNTS))
    try:
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps({**(saved if isinstance(saved, dict) else {}),
                                       key: list(choice.kinds)}, indent=1))
    except OSError as error:  # a read-only cache: measure again next time
        _log.warning("verispec: could not save the product choice under %s (%s)", path, error)
    return choice
