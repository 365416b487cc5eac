"""Sampling draft tokens with the request's own pipeline, shared by the drafters that sample.

A drafter that samples draws each draft token from q = the request's sampling pipeline applied
to its draft logits (no CFG: drafts are unguided; penalties count the output followed by the
drafts already proposed this step, the history the verifier gives the same position), with
counter-based random numbers keyed by (seed, step, position), so a seeded request drafts the
same tokens in any batch. q is handed to the verifier, which keeps the output exact whatever q
is; greedy requests take q's argmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..sample import SamplingMetadata
from ..sample.penalties import PrecedingTokens
from ..sample.processors import process_logits
from ..sample.rejection import sample_inverse_cdf
from ..sample.rng import DRAFT, uniform
from .base import DraftRequest


def draft_metadata(requests: Sequence[DraftRequest], device: torch.device) -> SamplingMetadata:
    """The sampling metadata of a drafter's call: each request's pipeline, streams and
    penalty histories, rows in request order."""
    return SamplingMetadata.from_params(
        [r.params for r in requests], steps=[r.step for r in requests],
        seeds=[r.seed for r in requests], device=device,
        prompt_token_ids=[r.prompt_token_ids for r in requests],
        output_token_ids=[r.output_token_ids for r in requests],
    )


def sample_drafts(
    sampling: SamplingMetadata,  # of every request of the drafter's call
    active: list[int],  # the requests drafting this round, one logit row each
    drafted: list[list[int]],  # their drafts so far, the tail of their penalty history
    logits: torch.Tensor,  # [R, V] draft logits, one row per active request
    position: int,  # the draft position (0 for the first draft of the step)
) -> tuple[list[int], torch.Tensor]:  # tokens, q rows [R, V]
    """Draws one draft token per active request. A row whose pipeline leaves no token (a
    reduced draft vocabulary with allowed_token_ids outside it) has a NaN q; `drafted_rows`
    tells the caller which rows are usable."""
    device = logits.device
    rows = torch.tensor(active, dtype=torch.int64, device=device)
    preceding = None
    if sampling.adjustments is not None:
        pairs = [(r, t) for r, tokens in enumerate(drafted) for t in tokens]
        index = torch.tensor([r for r, _ in pairs], dtype=torch.int64, device=device)
        ids = torch.tensor([t for _, t in pairs], dtype=torch.int64, device=device)
        preceding = PrecedingTokens(index, ids, torch.ones_like(index, dtype=torch.bool))
    q = process_logits(logits, rows, sampling, preceding=preceding).softmax(dim=-1)
    positions = torch.full((len(active),), position, dtype=torch.int64, device=device)
    sampled = sample_inverse_cdf(q, uniform(sampling.keys[rows], positions, DRAFT))
    tokens = torch.where(sampling.is_greedy[rows], q.argmax(dim=-1), sampled)
    return tokens.tolist(), q


def drafted_rows(q: torch.Tensor) -> list[bool]:  # q: [R, V] from sample_drafts
    """Per row, whether q is a distribution (False: the pipeline masked every token)."""
    return (~q[:, 0].isnan()).tolist()


def sample_from_draft_vocab(
    sampling: SamplingMetadata,  # of every request of the drafter's call
    active: list[int],  # the requests drafting this round, one logit row each
    drafted: list[list[int]],  # their drafts so far
    logits: torch.Tensor,  # [R, N] over the draft vocabulary
    vocab: torch.Tensor,  # [N] int64, the target token id of each column
    vocab_size: int,
    position: int,
) -> tuple[list[int], torch.Tensor | None, list[bool]]:  # tokens, q rows [R, V] or None, usable
    """`sample_drafts` for a head over a reduced draft vocabulary. When every request of the
    call is greedy without penalties, bias or masks, the draft is the argmax of the head's own
    logits and q is not built (None: one-hot, which greedy verification never reads), sparing
    a pass over the target's whole vocabulary per draft."""
    if sampling.all_greedy and sampling.adjustments is None:
        return vocab[logits.argmax(dim=-1)].tolist(), None, [True] * len(active)
    tokens, q = sample_drafts(sampling, active, drafted, widen_vocab(logits, vocab, vocab_size), position)
    return tokens, q, drafted_rows(q)


def widen_vocab(
    logits: torch.Tensor,  # [R, N] over a reduced draft vocabulary
    vocab: torch.Tensor,  # [N] int64, the target token id of each column
    vocab_size: int,
) -> torch.Tensor:  # [R, vocab_size] float32, -inf outside `vocab`
    """Draft logits over the target's vocabulary: tokens outside the draft vocabulary get
    q = 0, which the verifier handles exactly (their recovered mass comes from p)."""
    full = logits.new_full((logits.shape[0], vocab_size), float("-inf"), dtype=torch.float32)
    return full.index_copy_(1, vocab, logits.float())
