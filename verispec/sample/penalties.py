"""The pipeline's stages between CFG and temperature: repetition penalty, frequency / presence
penalties, logit bias, allowed / banned tokens (semantics in sampling_params.py).

Terms: a request's *history* at a row is its output so far followed by the tokens that precede
the row's prediction in this step (under speculation, the draft tokens before the row's
position; for a drafter, the drafts it has sampled so far). The output part is per request
(in LogitAdjustments); the part that varies by row comes as PrecedingTokens pairs, so no
history is ever materialised per row on the host: counts are built on the device with one
scatter per request and one accumulate over the (row, preceding token) pairs.

Rows of requests that adjust nothing come out numerically unchanged (penalty 1, zero penalties
and bias, no mask), so one batched pass serves mixed batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from ..sampling_params import SamplingParams


class TokenPairs(NamedTuple):
    """(request, token id) pairs: a list of token ids per request, flattened."""

    index: torch.Tensor  # [P] int64, the request
    token_ids: torch.Tensor  # [P] int64


class PrecedingTokens(NamedTuple):
    """Per-row history beyond the request's output: row `rows[i]` is preceded by `token_ids[i]`
    when `valid[i]` (padding pairs are invalid, so the pairs can be built without a host sync)."""

    rows: torch.Tensor  # [P] int64
    token_ids: torch.Tensor  # [P] int64
    valid: torch.Tensor  # [P] bool


@dataclass(frozen=True)
class LogitAdjustments:
    """The adjustments of a batch of B requests (request b as in SamplingMetadata).

    adjusts: [B] bool, requests with any adjustment.
    repetition_penalty: [B] float32, 1 where off. frequency_penalty, presence_penalty: [B] float32.
    output: the output tokens of requests with penalties (others' are not needed).
    prompt: the prompt tokens of requests with a repetition penalty.
    bias / bias_values: logit_bias entries, [L] each. allowed / banned: the token masks;
    restricted: [B] bool, requests with an allowed list.
    The any_* flags skip unused stages; guided_unadjusted: some request without adjustments
    uses CFG (after the verifier's pre-stage, only those still need the unconditional rows).
    """

    adjusts: torch.Tensor
    repetition_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    output: TokenPairs
    prompt: TokenPairs
    bias: TokenPairs
    bias_values: torch.Tensor
    allowed: TokenPairs
    restricted: torch.Tensor
    banned: TokenPairs
    any_repetition: bool
    any_count_penalty: bool
    any_bias: bool
    any_allowed: bool
    any_banned: bool
    guided_unadjusted: bool

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]] | None,
        output_token_ids: Sequence[Sequence[int]] | None,
        device: torch.device | str,
    ) -> "LogitAdjustments | None":
        """None when no request adjusts its logits (the fast path). Missing token lists count as
        empty histories."""
        memo: dict[int, tuple] = {}

        def summary(p: SamplingParams) -> tuple:  # a SamplingParams shared by many requests is read once
            if id(p) not in memo:
                memo[id(p)] = (p.adjusts_logits, float(p.repetition_penalty), float(p.frequency_penalty),
                               float(p.presence_penalty), p.allowed_token_ids is not None, p.uses_cfg)
            return memo[id(p)]

        adjusts, rep, freq, pres, restricted, guided = zip(*[summary(p) for p in params])
        if not any(adjusts):
            return None
        n = len(params)
        for name, lists in (("prompt_token_ids", prompt_token_ids), ("output_token_ids", output_token_ids)):
            if lists is not None and len(lists) != n:
                raise ValueError(f"{name} has {len(lists)} entries: expected {n}, one per request")
        # Each column becomes one host-to-device copy.
        cols: dict[str, list] = {"adjusts": adjusts, "rep": rep, "freq": freq, "pres": pres, "restricted": restricted}
        cols.update({name: [] for name in (
            "out_b", "out_t", "prompt_b", "prompt_t", "bias_b", "bias_t", "bias_v", "allowed_b", "allowed_t",
            "banned_b", "banned_t")})
        for b in (b for b in range(n) if adjusts[b]):
            p = params[b]
            if output_token_ids is not None and (rep[b] != 1 or freq[b] != 0 or pres[b] != 0):
                _extend(cols["out_b"], cols["out_t"], b, output_token_ids[b])
            if prompt_token_ids is not None and rep[b] != 1:
                _extend(cols["prompt_b"], cols["prompt_t"], b, prompt_token_ids[b])
            if p.logit_bias:
                _extend(cols["bias_b"], cols["bias_t"], b, p.logit_bias)
                cols["bias_v"].extend(p.logit_bias.values())
            if p.allowed_token_ids:
                _extend(cols["allowed_b"], cols["allowed_t"], b, p.allowed_token_ids)
            if p.banned_token_ids:
                _extend(cols["banned_b"], cols["banned_t"], b, p.banned_token_ids)

        def tensor(name: str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(cols[name], dtype=dtype).to(device, non_blocking=True)

        def pairs(prefix: str) -> TokenPairs:
            return TokenPairs(tensor(prefix + "_b"), tensor(prefix + "_t"))

        return cls(
            adjusts=tensor("adjusts", torch.bool),
            repetition_penalty=tensor("rep", torch.float32),
            frequency_penalty=tensor("freq", torch.float32),
            presence_penalty=tensor("pres", torch.float32),
            output=pairs("out"),
            prompt=pairs("prompt"),
            bias=pairs("bias"),
            bias_values=tensor("bias_v", torch.float32),
            allowed=pairs("allowed"),
            restricted=tensor("restricted", torch.bool),
            banned=pairs("banned"),
            any_repetition=any(r != 1 for r in rep),
            any_count_penalty=any(freq) or any(pres),
            any_bias=bool(cols["bias_v"]),
            any_allowed=any(restricted),
            any_banned=bool(cols["banned_t"]),
            guided_unadjusted=any(g and not a for g, a in zip(guided, adjusts)),
        )


def _extend(index: list[int], token_ids: list[int], b: int, ids) -> None:
    index.extend([b] * len(ids))
    token_ids.extend(ids)


def apply_adjustments(
    x: torch.Tensor,  # [N, V] float32 guided logits
    rows: torch.Tensor,  # [N] int64, the request of each row
    adj: LogitAdjustments,
    preceding: PrecedingTokens | None = None,
) -> torch.Tensor:  # [N, V] float32
    """Repetition penalty -> frequency / presence penalties -> logit bias -> allowed / banned."""
    batch, vocab = adj.adjusts.shape[0], x.shape[1]
    if adj.any_repetition or adj.any_count_penalty:
        counts = _per_request(adj.output, batch, vocab, accumulate=True)[rows]  # [N, V]
        if preceding is not None:
            counts.index_put_(
                (preceding.rows, preceding.token_ids), preceding.valid.float(), accumulate=True
            )
        seen = counts > 0
        if adj.any_repetition:
            penalty = adj.repetition_penalty[rows][:, None]
            in_prompt = _per_request(adj.prompt, batch, vocab)[rows] > 0
            x = torch.where(seen | in_prompt, torch.where(x > 0, x / penalty, x * penalty), x)
        if adj.any_count_penalty:
            x = x - adj.frequency_penalty[rows][:, None] * counts - adj.presence_penalty[rows][:, None] * seen
    if adj.any_bias:
        bias = x.new_zeros(batch, vocab).index_put_(tuple(adj.bias), adj.bias_values)
        x = x + bias[rows]
    if adj.any_allowed or adj.any_banned:
        keep = (~adj.restricted)[:, None].repeat(1, vocab)  # [B, V]
        keep[tuple(adj.allowed)] = True
        keep[tuple(adj.banned)] = False
        x = x.masked_fill(~keep[rows], float("-inf"))
    return x


def _per_request(
    pairs: TokenPairs, batch: int, vocab: int, accumulate: bool = False
) -> torch.Tensor:  # [B, V] float32: counts (accumulate) or presence of each token
    out = torch.zeros(batch, vocab, device=pairs.index.device)
    return out.index_put_(tuple(pairs), torch.ones_like(pairs.index, dtype=out.dtype), accumulate=accumulate)


def preceding_drafts(
    draft_token_ids: torch.Tensor,  # [D] int64, in range
    first_row: torch.Tensor,  # [D] int64, the first row each draft token precedes
    num_rows: torch.Tensor,  # [D] int64, how many consecutive rows (from first_row) it precedes
    max_rows: int,  # an upper bound of num_rows
) -> PrecedingTokens:
    """Each draft token paired with the rows that follow it in its request: D * max_rows pairs,
    the invalid ones padding (a few per draft; sum K(K+1)/2 are valid)."""
    offsets = torch.arange(max(max_rows, 0), device=draft_token_ids.device)
    valid = offsets[None, :] < num_rows[:, None]  # [D, max_rows]
    rows = torch.where(valid, first_row[:, None] + offsets, 0)
    ids = draft_token_ids[:, None].expand_as(rows)
    return PrecedingTokens(rows.reshape(-1), ids.reshape(-1), valid.reshape(-1))
