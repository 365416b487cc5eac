"""The greedy chain rule on the host: what rejection_sample emits for greedy requests whose
logits no pipeline stage changes, without its metadata tensors, layout or random keys (terms as
in rejection.py). At ~200 tokens/s a step is ~5 ms, and building those costs ~0.6 ms of it.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..sampling_params import SamplingParams


def plain_greedy(params: SamplingParams) -> bool:
    """Whether the request's processed logits are its raw logits and it keeps only their
    argmax: greedy, no CFG, no penalties, bias or masks (filters never move an argmax)."""
    return params.greedy and not params.uses_cfg and not params.adjusts_logits


def greedy_chains(
    target_logits: torch.Tensor,  # [num_draft_tokens + B, V]: per request K_b draft rows + 1 bonus row
    draft_token_ids: Sequence[Sequence[int]],  # per request its K_b drafts
) -> list[list[int]]:  # per request its emitted tokens
    """Each request accepts its drafts while they equal the argmax of their target rows, then
    emits the argmax of the next row (the first maximum of a row, as rejection_sample takes it)."""
    best = argmax_rows(target_logits)
    emitted = []
    row = 0
    for drafts in draft_token_ids:
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == best[row + accepted]:
            accepted += 1
        emitted.append([*drafts[:accepted], best[row + accepted]])
        row += len(drafts) + 1
    return emitted


def argmax_rows(x: torch.Tensor) -> list[int]:  # [N, V] -> N indices
    """The first maximum of each row."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        # numpy's argmax is vectorized (~4 us a row of 49,152 on 2 cores); torch's CPU
        # max(dim) is not (~45 us). Both return the first maximum.
        return x.detach().numpy().argmax(axis=-1).tolist()
    return x.max(dim=-1).indices.tolist()
