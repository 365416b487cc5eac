"""Draft slots that hold an out-of-range id (vLLM callers pad with -1 by design) drafted nothing:
the token emitted there must follow p, not the residual max(p - q, 0), whatever q is supplied.

Chi-square at the suite's 1e-6 false-alarm rate, both backends (Triton under the interpreter on
CPU), for draft probabilities and draft logits. Before the fix the first token of the repro came
out as [0, 0, .25, .75] instead of p = [.1, .2, .3, .4].
"""

from __future__ import annotations

import pytest
import torch

from verispec import SamplingMetadata, SamplingParams
from verispec.sample import DraftLogits, DraftProbs, rejection

from ..stats import chi_square
from .test_triton import needs_triton, triton_verify

P = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
N = 100_000


def _verify(backend: str, draft_kind: str, ids: torch.Tensor, k: int) -> torch.Tensor:  # [N, k + 1]
    n = ids.shape[0] // k
    target = P.float().log().expand(n * (k + 1), 4).contiguous()
    q = P.float().flip(0).expand(n * k, 4).contiguous()
    draft = DraftProbs(q) if draft_kind == "probs" else DraftLogits(q.log())
    sampling = SamplingMetadata.from_params([SamplingParams()] * n, seeds=list(range(n)))
    cu = torch.arange(n + 1) * k
    if backend == "triton":
        out = triton_verify(target, ids, cu, sampling, draft, validate=False)
    else:
        out = rejection.rejection_sample(target, ids, cu, sampling, draft=draft, validate=False,
                                         backend="native")
    return out.token_ids.cpu()


def _case(backend: str, draft_kind: str) -> None:
    # K = 1, every slot a placeholder: the first emitted token follows p.
    tokens = _verify(backend, draft_kind, torch.full((N,), -1), 1)
    result = chi_square(tokens[:, 0], P)
    assert result.passed, result
    # K = 2, a real draft then a placeholder: after an accepted first draft, the token at the
    # placeholder slot follows p as well (the target rows are all p here).
    ids = torch.stack([torch.full((N,), 3), torch.full((N,), -1)], 1).reshape(-1)
    tokens = _verify(backend, draft_kind, ids, 2)
    accepted_first = tokens[:, 0] == 3
    result = chi_square(tokens[accepted_first, 1], P)
    assert result.passed, result


@pytest.mark.parametrize("draft_kind", ["probs", "logits"])
def test_placeholder_slot_follows_p_native(draft_kind: str) -> None:
    _case("native", draft_kind)


@needs_triton
@pytest.mark.parametrize("draft_kind", ["probs", "logits"])
def test_placeholder_slot_follows_p_triton(draft_kind: str) -> None:
    _case("triton", draft_kind)
