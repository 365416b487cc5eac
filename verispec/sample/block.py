"""Block verification (Sun et al. 2024, "Block Verification Accelerates Speculative Decoding",
arXiv 2403.10444, Algorithm 2): rejection_sample(..., verification="block").

Token-wise verification stops at the first rejected draft. Block verification judges the block
of drafts as a whole: a draft the target likes less than the drafter can still be kept when the
drafts after it make up for it. For one request with drafts x_1..x_K drawn from q_1..q_K and
target rows p_1..p_{K+1} (terms of rejection.py):

    w_0 = 1,  w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i))      (q_i(x_i) = 0: w_i = 0)
    h_i = r_i / (r_i + 1 - w_i),  r_i = sum_x max(w_i p_{i+1}(x) - q_{i+1}(x), 0)   (i < K;
          h_i = 1 where r_i + 1 - w_i = 0),  h_K = w_K
    tau = the LAST i in 1..K with eta_i <= h_i (0 if none): every position is tested
    emit x_1..x_tau, then y ~ p_{K+1} if tau = K, else y ~ normalize(max(w_tau p_{tau+1} - q_{tau+1}, 0))
    (p_{tau+1} when that has no mass).

The emitted tokens follow the target exactly and their expected number is at least token-wise
verification's (tests/sample/test_block_verification.py proves both by exact enumeration). With
K = 1 the rule is token-wise verification. Greedy requests keep the token-wise rule (accept
while the draft is the argmax), which the block rule reduces to for a one-hot target.

Random numbers are keyed as in the token-wise path: eta_i is the request's ACCEPT uniform at
position i - 1, the emitted token's the SAMPLE uniform at position tau, so seeded requests stay
batch invariant. Unlike token-wise verification, h_i needs whole target and draft rows after
every draft, not single probabilities. One native PyTorch implementation serves every backend:
the Triton kernels implement token-wise verification only.
"""

from __future__ import annotations

import torch

from .metadata import SamplingMetadata
from .processors import process_logits
from .ragged import Layout, emitted_output, layout, leading_run, sample_inverse_cdf
from .rng import ACCEPT, SAMPLE, uniform
from .types import Draft, DraftLogits, DraftProbs, RejectionOutput


def verify_block(
    target_logits: torch.Tensor,  # [N, V] after rejection_sample's pre-stage
    draft_token_ids: torch.Tensor,  # [D]
    cu_num_draft_tokens: torch.Tensor,  # [B + 1]
    sampling: SamplingMetadata,
    draft: Draft,
    uncond_logits: torch.Tensor | None,  # [N, V]
    max_k: int,
) -> RejectionOutput:
    """The block rule for sampled requests, the token-wise rule for greedy ones; arguments and
    output as rejection_sample's native backend."""
    num_rows, vocab = target_logits.shape
    device = target_logits.device
    lay = layout(cu_num_draft_tokens, num_rows, device)
    batch = lay.num_draft.shape[0]
    target = process_logits(target_logits, lay.req_of_row, sampling, uncond_logits)  # [N, V]
    row_argmax = target.max(dim=-1).indices

    # Out-of-range ids (possible only without validation) drafted nothing: a request's block
    # ends before its first one.
    ids = draft_token_ids.to(torch.int64)
    in_range = (ids >= 0) & (ids < vocab)
    ids = ids.clamp(0, vocab - 1)
    block_len = leading_run(in_range, lay, max_k)  # [B]
    num_accepted = leading_run(in_range & (ids == row_argmax[lay.row_of_draft]), lay, max_k)
    final_token = row_argmax[lay.draft_start + torch.arange(batch, device=device) + num_accepted]
    if not sampling.all_greedy:
        p = target.softmax(dim=-1)  # [N, V]
        q = _draft_probs(draft, lay, sampling)  # [D, V], None for one-hot drafts
        w = _weights(p, q, ids, lay, batch, max_k)  # [B, max_k + 1]
        h = _stop_probs(p, q, ids, w, lay, block_len, max_k)  # [B, max_k + 1]
        positions = torch.arange(max_k + 1, device=device)
        eta = uniform(
            sampling.keys[:, None].expand(batch, max_k + 1).reshape(-1),
            (positions - 1).clamp(min=0).repeat(batch), ACCEPT,
        ).reshape(batch, max_k + 1)
        tau = _last_passed((eta <= h) | (positions == 0))
        sampled = _sample_final(p, q, ids, w, tau, block_len, lay, sampling)
        num_accepted = torch.where(sampling.is_greedy, num_accepted, tau)
        final_token = torch.where(sampling.is_greedy, final_token, sampled)

    return emitted_output(ids, lay, num_accepted, final_token, max_k)


def _last_passed(
    passed: torch.Tensor,  # [B, max_k + 1] bool: eta_i <= h_i at column i; column 0 always True
) -> torch.Tensor:  # [B] int64: tau
    """The last passed test wins, not the first failed one (that would be token-wise-like and
    inexact with the block rule's h)."""
    positions = torch.arange(passed.shape[1], device=passed.device)
    return (passed.to(torch.int64) * positions).amax(dim=1)


def _draft_probs(draft: Draft, lay: Layout, sampling: SamplingMetadata) -> torch.Tensor | None:  # [D, V]
    if isinstance(draft, DraftLogits):
        return process_logits(draft.logits, lay.req_of_draft, sampling).softmax(dim=-1)
    if isinstance(draft, DraftProbs):
        return draft.probs.float()
    return None


def _weights(
    p: torch.Tensor,  # [N, V] target probabilities
    q: torch.Tensor | None,  # [D, V] draft probabilities, None for one-hot drafts
    ids: torch.Tensor,  # [D] clamped draft ids
    lay: Layout,
    batch: int,
    max_k: int,
) -> torch.Tensor:  # [B, max_k + 1] float64: w_0..w_K per request (1 after its block)
    p_x = p[lay.row_of_draft, ids].double()
    q_x = torch.ones_like(p_x) if q is None else q.gather(1, ids[:, None])[:, 0].double()
    ratio = torch.ones(batch, max_k, dtype=torch.float64, device=p.device)
    ratio[lay.req_of_draft, lay.pos_of_draft] = torch.where(q_x > 0, p_x / q_x.clamp(min=1e-300), 0.0)
    w = [torch.ones(batch, dtype=torch.float64, device=p.device)]
    for i in range(max_k):
        w.append((w[-1] * ratio[:, i]).clamp(max=1.0))
    return torch.stack(w, dim=1)


def _stop_probs(
    p: torch.Tensor,  # [N, V]
    q: torch.Tensor | None,  # [D, V]
    ids: torch.Tensor,  # [D]
    w: torch.Tensor,  # [B, max_k + 1] float64
    lay: Layout,
    block_len: torch.Tensor,  # [B]
    max_k: int,
) -> torch.Tensor:  # [B, max_k + 1] float64: h_i at column i (column 0 unused)
    """h_i for i < K from the residual mass r_i of the row after draft i; h_K = w_K; 0 past K."""
    w_before = w[lay.req_of_draft, lay.pos_of_draft]  # [D]: w_i for the draft at position i (0-based)
    if q is None:
        # One-hot q at x: w p(x) <= 1, so the residual is w p off x and 0 at x.
        mass = w_before * (1 - p[lay.row_of_draft, ids].double())
    else:
        # Whole rows in p's precision (float32: a relative error ~1e-7 in h, far below what any
        # test can see), only the sums in float64.
        rows = w_before.to(p.dtype)[:, None] * p[lay.row_of_draft] - q
        mass = rows.clamp_(min=0).sum(dim=-1).double()
    denom = mass + 1 - w_before
    h_draft = torch.where(denom > 0, mass / denom.clamp(min=1e-300), 1.0)
    h = torch.zeros_like(w)
    h[lay.req_of_draft, lay.pos_of_draft] = h_draft  # column i: the draft at 0-based position i
    column = torch.arange(max_k + 1, device=w.device)[None, :]
    end = block_len[:, None]
    return torch.where(column == end, w, torch.where(column < end, h, 0.0))


def _sample_final(
    p: torch.Tensor,  # [N, V]
    q: torch.Tensor | None,  # [D, V]
    ids: torch.Tensor,  # [D]
    w: torch.Tensor,  # [B, max_k + 1] float64
    tau: torch.Tensor,  # [B] int64
    block_len: torch.Tensor,  # [B]
    lay: Layout,
    sampling: SamplingMetadata,
) -> torch.Tensor:  # [B] int64
    batch = tau.shape[0]
    p_final = p[lay.draft_start + torch.arange(batch, device=p.device) + tau]  # [B, V]
    weights = p_final
    if ids.numel() > 0:
        residual = tau < block_len
        draft_row = (lay.draft_start + tau).clamp(max=ids.shape[0] - 1)
        scaled = w.gather(1, tau[:, None]).to(p.dtype) * p_final  # w_0 = 1 keeps p bit for bit
        if q is None:
            at_draft = scaled.gather(1, ids[draft_row][:, None])
            rest = scaled.scatter(1, ids[draft_row][:, None], (at_draft - 1).clamp(min=0))
        else:
            rest = (scaled - q[draft_row]).clamp(min=0)
        weights = torch.where(residual[:, None], rest, p_final)
        # A residual with no mass means stopping there had probability 0: fall back to p.
        weights = torch.where(weights.sum(dim=-1, keepdim=True) > 0, weights, p_final)
    return sample_inverse_cdf(weights, uniform(sampling.keys, tau, SAMPLE))
