"""Triton kernels of the verifier (docs/design.md, "Layout"). Imported only when the Triton backend is used.

    row_stats.py     per-row online softmax statistics, CFG, temperature, filters, p(x), argmax
    split_rows.py    row_stats with each row split across programs (top-k / top-p, few rows)
    rows.py          the statistics record, and a row's request and per-request scales
    threshold.py     top-k / top-p thresholds by a multi-pivot search over the row (no sort)
    chain.py         the acceptance chain and the final-row race, one kernel
    final_sample.py  the exponential race, and the combine of a race split across programs
    pipeline.py      the sampling pipeline element by element; streams.py its random numbers
    verify.py        logits in (rejection_sample(..., backend="triton"))
    probs.py         probabilities in (rejection_sample_probs(..., backend="triton"))
    tiles.py         launch shapes (GPU, or the interpreter) and buffer allocation
"""

from .probs import rejection_sample_probs_triton
from .verify import rejection_sample_triton

__all__ = ["rejection_sample_probs_triton", "rejection_sample_triton"]
