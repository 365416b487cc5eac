"""The test oracle: slow, per-sequence, float64, written to be read rather than to run fast.

`reference_probs` is the sampling pipeline of one row, step by step as SamplingParams documents
it, penalties applied token by token from the row's history. `reference_rejection_sample` walks each request's drafts one at a time with the rules of
docs/design.md ("The rule"), drawing its random numbers from the same counter-based streams as the fast paths, so
for the same inputs it emits the same tokens (up to float rounding at exact decision
boundaries).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..sampling_params import SamplingParams
from .rng import ACCEPT, SAMPLE, request_keys, uniform


def reference_probs(
    logits: torch.Tensor,  # [V]
    params: SamplingParams,
    uncond: torch.Tensor | None = None,  # [V] CFG unconditional row
    prompt_token_ids: Sequence[int] = (),
    history: Sequence[int] = (),
) -> torch.Tensor:  # [V] float64 sampling distribution (one-hot at the argmax when greedy)
    """`history`: the tokens before this row's prediction that penalties count (the output so
    far, then any drafts before the row)."""
    x = logits.double()
    if params.uses_cfg and uncond is not None:
        u = uncond.double()
        x = u + params.guidance_scale * (x - u)
    for token in set(prompt_token_ids) | set(history):
        r = params.repetition_penalty
        x[token] = x[token] / r if x[token] > 0 else x[token] * r
    for token in set(history):
        x[token] -= params.frequency_penalty * list(history).count(token) + params.presence_penalty
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    for token in range(x.shape[0]):
        allowed = params.allowed_token_ids is None or token in params.allowed_token_ids
        if not allowed or token in params.banned_token_ids:
            x[token] = float("-inf")
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(), x.shape[0]).double()
    x = x / params.temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if params.top_k is not None:
        kth_largest = x.sort(descending=True).values[min(params.top_k, x.shape[0]) - 1]
        keep &= x >= kth_largest
    if params.top_p < 1:
        probs = torch.where(keep, x, float("-inf")).softmax(0)
        ordered = probs.sort(descending=True).values
        mass = 0.0
        for value in ordered.tolist():
            mass += value
            if mass >= params.top_p:
                break
        keep &= probs >= value
    if params.min_p > 0:
        probs = torch.where(keep, x, float("-inf")).softmax(0)
        keep &= probs >= params.min_p * probs.max()
    return torch.where(keep, x, float("-inf")).softmax(0)


def reference_rejection_sample(
    target_logits: torch.Tensor,  # [num_draft_tokens + B, V]
    draft_token_ids: Sequence[Sequence[int]],  # per request, K_b ids
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    steps: Sequence[int] | None = None,
    draft_probs: torch.Tensor | None = None,  # [num_draft_tokens, V], None = one-hot drafter
    uncond_logits: torch.Tensor | None = None,  # [num_draft_tokens + B, V]
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
    output_token_ids: Sequence[Sequence[int]] | None = None,
) -> list[list[int]]:
    """Emitted tokens per request. Row i of a request is penalised with the history
    output + drafts[:i]."""
    steps = [0] * len(params) if steps is None else steps
    keys = request_keys(torch.tensor(list(seeds)), torch.tensor(list(steps)))
    out: list[list[int]] = []
    row = 0
    draft_row = 0
    for b, (drafts, sp) in enumerate(zip(draft_token_ids, params)):
        emitted: list[int] = []
        for i in range(len(drafts) + 1):
            uncond = uncond_logits[row + i] if uncond_logits is not None else None
            prompt = prompt_token_ids[b] if prompt_token_ids is not None else ()
            output = list(output_token_ids[b]) if output_token_ids is not None else []
            p = reference_probs(target_logits[row + i], sp, uncond, prompt, output + list(drafts[:i]))
            if i == len(drafts):  # every draft accepted: bonus token from the last row
                emitted.append(_draw(p, keys[b], i))
                break
            x = drafts[i]
            if draft_probs is None:
                q = torch.nn.functional.one_hot(torch.tensor(x), p.shape[0]).double()
            else:
                q = draft_probs[draft_row + i].double()
            if sp.greedy:
                accepted = x == int(p.argmax())
            else:
                u = float(uniform(keys[b : b + 1], torch.tensor([i]), ACCEPT)[0])
                accepted = q[x] > 0 and u * q[x] < p[x]
            if accepted:
                emitted.append(x)
                continue
            residual = (p - q).clamp(min=0)
            emitted.append(_draw(residual if residual.sum() > 0 else p, keys[b], i))
            break
        out.append(emitted)
        row += len(drafts) + 1
        draft_row += len(drafts)
    return out


def _draw(weights: torch.Tensor, key: torch.Tensor, position: int) -> int:
    """Inverse CDF with the request's SAMPLE uniform at this position."""
    u = float(uniform(key.reshape(1), torch.tensor([position]), SAMPLE)[0])
    target = u * float(weights.sum())
    total = 0.0
    for token, w in enumerate(weights.tolist()):
        total += w
        if total > target:
            return token
    return int(torch.nonzero(weights)[-1])
