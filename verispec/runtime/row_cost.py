"""measure_row_cost: what one more row costs the target's pass on this machine, relative to the
pass's fixed cost, timed at load (the adaptive K's batch-1 row cost where no earlier run's fit
is kept, spec_decode/cost_learner.py).

Why at load: the declared row cost is a guess across CPUs (LlamaModel.row_cost: 0.6 for 4-bit
weights, measured on AVX2 and VNNI cores; 0.16 on a Skylake-SP Xeon, 2026-11-28), and learning
it online needs passes of more than one row count, which a gate priced at 0.6 on a machine
where rows cost 0.16 rarely runs: there EAGLE drafted on 4 of ~1,400 steps of a fresh run
(probes aside) and sped nothing up, where K = 1 alone ran 1.08x no drafts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from .kv_cache import BlockManager
from .runner import Feed, ModelRunner

# A context as long as a short chat turn's, so that a row's attention costs what it does in use.
CONTEXT = 64
# Rounds of a 1-row and a 2-row pass after one warm-up round: the median of the rounds'
# differences is the row's price (a round's two passes see the same load of the machine).
ROUNDS = 12


class _Scratch:
    """The measuring sequence's id: an object no request id can equal."""

    def __repr__(self) -> str:
        return "<row-cost scratch sequence>"


def measure_row_cost(runner: ModelRunner, blocks: BlockManager, vocab_size: int,
                     padded_rows: Callable[[int], int]) -> float | None:
    """b / a of passes over 1 and 2 new rows (each with its logits, as a verify step's) after a
    CONTEXT-token prefill, a + b · padded rows each; None when the cache has no room for the
    scratch sequence or the timings do not fit (a pass over 2 rows timed no slower than 1)."""
    seq = _Scratch()
    if not blocks.can_allocate(seq, CONTEXT + 2):
        return None
    blocks.allocate(seq, CONTEXT + 2)
    try:
        ids = [(7919 * i + 11) % vocab_size for i in range(CONTEXT + 2)]
        runner.forward([Feed(seq, ids[:CONTEXT], 0, 1)]).sum().item()
        seconds: dict[int, list[float]] = {1: [], 2: []}
        for round_ in range(ROUNDS + 1):
            for rows in (1, 2):
                start = time.perf_counter()
                # .item() waits for a device's work to end.
                runner.forward([Feed(seq, ids[CONTEXT : CONTEXT + rows], CONTEXT, rows)]).sum().item()
                if round_:
                    seconds[rows].append(time.perf_counter() - start)
    finally:
        blocks.free(seq)
    extra = statistics.median(two - one for one, two in zip(seconds[1], seconds[2]))
    per_row = extra / max(1, padded_rows(2) - padded_rows(1))
    fixed = statistics.median(seconds[1]) - per_row * padded_rows(1)
    return per_row / fixed if per_row > 0 and fixed > 0 else None
