"""Log-probabilities of emitted tokens, computed only when a request asks for them.

An emitted token's log-probability is read from the target row it was emitted at (an accepted
draft at its own verify row, the recovered or bonus token at the final row), under the
request's processed distribution: the same pipeline the verifier samples from. A greedy request
has no distribution to sample (temperature 0), so it reports the distribution at temperature 1
with every adjustment that can move the argmax applied (CFG and any logit adjustments) and no
filters: the figures users of other engines expect for greedy decoding. The top-n alternatives
of a row are its n likeliest tokens; a token ruled out by a filter (log-probability -inf) is
never listed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .metadata import SamplingMetadata
from .processors import process_logits
from .rejection import adjust_rows
from .types import AdjustedRows, RejectionOutput


class EmittedLogprobs(NamedTuple):
    """Rows are the emitted tokens of the requests that asked, request by request, in order."""

    num_rows: list[int]  # per request: its emitted tokens if it asked, else 0
    token_logprobs: torch.Tensor  # [R] float32, of each emitted token
    top_ids: torch.Tensor  # [R, n] int64, likeliest first
    top_logprobs: torch.Tensor  # [R, n] float32


def emitted_logprobs(
    target_logits: torch.Tensor,  # [num_draft_tokens + B, V], as given to rejection_sample
    draft_token_ids: torch.Tensor,  # [num_draft_tokens], as given to rejection_sample
    cu_num_draft_tokens: torch.Tensor,  # [B + 1], leading 0
    sampling: SamplingMetadata,
    out: RejectionOutput,  # what rejection_sample emitted for these inputs
    wanted: list[bool],  # per request: whether it asked for log-probabilities
    num_top: int,  # n, the alternatives per row (at most SamplingParams' 20)
    uncond_logits: torch.Tensor | None = None,  # [num_draft_tokens + B, V] CFG rows, or None
    adjusted: AdjustedRows | None = None,  # out.adjusted, when `out` is rejection_sample's for these rows
) -> EmittedLogprobs:
    device = target_logits.device
    if adjusted is not None:  # the verifier already ran the pre-stage on these very rows
        target_logits, sampling = adjusted.target_logits, adjusted.sampling
    elif sampling.adjustments is not None:
        # Penalties see each row's own history (the accepted drafts before it), as in the verifier.
        target_logits, _, sampling = adjust_rows(
            target_logits, draft_token_ids, cu_num_draft_tokens, sampling, None, uncond_logits,
            out.token_ids.shape[1] - 1,
        )
    counts = [n if w else 0 for n, w in zip(out.num_emitted.tolist(), wanted)]
    request = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).to(device)
    starts = torch.tensor([0, *counts[:-1]]).cumsum(0).to(device)
    slot = torch.arange(request.shape[0], device=device) - starts[request]  # position in its output
    row = cu_num_draft_tokens.to(device)[request] + request + slot
    processed = process_logits(
        target_logits[row], request, sampling, None if uncond_logits is None else uncond_logits[row]
    )
    logprobs = processed.log_softmax(dim=-1)  # [R, V]
    tokens = out.token_ids[request, slot]
    top = logprobs.topk(num_top, dim=-1)
    return EmittedLogprobs(counts, logprobs.gather(1, tokens[:, None])[:, 0], top.indices, top.values)


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability and the likeliest alternatives of its row."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # up to n (token id, log-probability), likeliest first


def token_logprobs(
    emitted: EmittedLogprobs,
    token_ids: list[list[int]],  # per request, its emitted tokens
    num_top: list[int],  # per request, the alternatives it asked for
) -> list[list[TokenLogprob] | None]:  # per request; None where it did not ask
    """Host records of emitted_logprobs, request by request."""
    values = emitted.token_logprobs.tolist()
    top_ids, top_values = emitted.top_ids.tolist(), emitted.top_logprobs.tolist()
    records: list[list[TokenLogprob] | None] = []
    row = 0
    for tokens, count, n in zip(token_ids, emitted.num_rows, num_top):
        if count == 0:
            records.append(None)
            continue
        records.append([
            TokenLogprob(token, values[r], tuple(
                (i, v) for i, v in zip(top_ids[r][:n], top_values[r][:n]) if v != float("-inf")))
            for token, r in zip(tokens, range(row, row + count))
        ])
        row += count
    return records
