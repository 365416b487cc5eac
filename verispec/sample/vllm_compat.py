"""A drop-in for vLLM's (V0) RejectionSampler call convention, backed by verispec's exact core.

Users of `RejectionSampler.forward(target_with_bonus_probs, bonus_token_ids, draft_probs,
draft_token_ids, seeded_seqs)` switch by changing the import. Semantics kept from that API:
probabilities in (already through the sampling pipeline), every request has the same K, the
caller's pre-sampled bonus token is emitted when all K drafts are accepted, output [B, K + 1]
with -1 after the first rejection, and vLLM's running counters (see RejectionSampler).

Random numbers: a seeded row draws its counter-based seed from the caller's torch.Generator,
the other rows from torch's default generator, both with one host draw per call, so a seeded
row is reproducible and independent of its batch, and `torch.manual_seed` reproduces a whole
call as it does for vLLM users. Draft slots holding vLLM's -1 placeholder drafted nothing: the
token there follows the target distribution.
"""

from __future__ import annotations

import torch

from . import validation as check
from .rejection import rejection_sample_probs
from .rng import ACCEPT, request_keys, uniform
from .types import PLACEHOLDER_TOKEN_ID

_SEED_LIMIT = 2**63 - 1


class RejectionSampler(torch.nn.Module):
    """Counters, with vLLM V0's meaning (tensors on the device of the last call, except the
    host int num_draft_tokens):
    num_draft_tokens: drafted tokens, B * K per call;
    num_accepted_tokens: drafts that pass their own acceptance test u * q < p, counted at every
        position, also after an earlier rejection (what vLLM counts; the emitted prefix can be
        shorter: the output's accepted prefix is `num_emitted_tokens - B` per call);
    num_emitted_tokens: tokens in the output that are not -1.
    """

    def __init__(self, strict_mode: bool = False):
        super().__init__()
        self.strict_mode = strict_mode
        self.num_draft_tokens = 0
        self.num_accepted_tokens: torch.Tensor | None = None
        self.num_emitted_tokens: torch.Tensor | None = None

    def init_tensors(self, device: torch.device | str = "cpu") -> None:
        self.num_accepted_tokens = torch.zeros((), dtype=torch.long, device=device)
        self.num_emitted_tokens = torch.zeros((), dtype=torch.long, device=device)

    def forward(
        self,
        target_with_bonus_probs: torch.Tensor,  # [B, K + 1, V]
        bonus_token_ids: torch.Tensor,  # [B, 1]
        draft_probs: torch.Tensor,  # [B, K, V]
        draft_token_ids: torch.Tensor,  # [B, K]
        seeded_seqs: dict[int, torch.Generator] | None = None,
    ) -> torch.Tensor:  # [B, K + 1] int64, -1 after the emitted tokens
        if self.strict_mode:
            self._check(target_with_bonus_probs, bonus_token_ids, draft_probs, draft_token_ids)
        batch, k = draft_token_ids.shape
        device = target_with_bonus_probs.device
        seeded_seqs = seeded_seqs or {}
        for row in seeded_seqs:
            if not isinstance(row, int) or not 0 <= row < batch:
                raise ValueError(f"seeded_seqs has row {row!r}: expected row indices in [0, {batch})")
        if self.num_accepted_tokens is None or self.num_accepted_tokens.device != device:
            self.init_tensors(device)
        if batch == 0:
            return torch.empty(0, k + 1, dtype=torch.int64, device=device)
        seeds = torch.randint(0, _SEED_LIMIT, (batch,), dtype=torch.int64)
        for row, generator in seeded_seqs.items():
            seeds[row] = int(torch.randint(0, _SEED_LIMIT, (1,), generator=generator, device=generator.device))
        keys = request_keys(seeds, torch.zeros(batch, dtype=torch.int64)).to(device)
        out = rejection_sample_probs(draft_probs, draft_token_ids, target_with_bonus_probs, keys, validate=False)
        token_ids = out.token_ids.clone()
        all_accepted = out.num_accepted == k
        token_ids[:, k] = torch.where(all_accepted, bonus_token_ids[:, 0].to(torch.int64), token_ids[:, k])
        self.num_draft_tokens += batch * k
        self.num_accepted_tokens += self._passed_own_test(
            target_with_bonus_probs, draft_probs, draft_token_ids, keys).sum()
        self.num_emitted_tokens += out.num_emitted.sum()
        return token_ids

    @staticmethod
    def _passed_own_test(
        target_probs: torch.Tensor,  # [B, K + 1, V]
        draft_probs: torch.Tensor,  # [B, K, V]
        draft_token_ids: torch.Tensor,  # [B, K]
        keys: torch.Tensor,  # [B] int64
    ) -> torch.Tensor:  # [B, K] bool
        """Each draft's acceptance test on the verifier's own uniforms, at every position."""
        batch, k = draft_token_ids.shape
        vocab = target_probs.shape[-1]
        ids = draft_token_ids.to(torch.int64)
        in_range = (ids >= 0) & (ids < vocab)
        index = ids.clamp(0, vocab - 1)[..., None]
        p = target_probs[:, :k].gather(2, index)[..., 0].double()
        q = draft_probs.gather(2, index)[..., 0].double()
        positions = torch.arange(k, device=keys.device).expand(batch, k)
        u = uniform(keys[:, None].expand(batch, k).reshape(-1), positions.reshape(-1), ACCEPT).view(batch, k)
        return in_range & (q > 0) & (u * q < p)

    @staticmethod
    def _check(
        target_probs: torch.Tensor,  # [B, K + 1, V]
        bonus_token_ids: torch.Tensor,  # [B, 1]
        draft_probs: torch.Tensor,  # [B, K, V]
        draft_token_ids: torch.Tensor,  # [B, K]
    ) -> None:
        check.check_tensor("draft_token_ids", draft_token_ids, 2, integer=True)
        device = target_probs.device
        batch, k = draft_token_ids.shape
        check.check_tensor("target_with_bonus_probs", target_probs, 3, floating=True, device=device)
        vocab = target_probs.shape[-1]
        check.check_shape("target_with_bonus_probs", target_probs, (batch, k + 1, vocab))
        check.check_tensor("draft_probs", draft_probs, 3, floating=True, device=device)
        check.check_shape("draft_probs", draft_probs, (batch, k, vocab))
        check.check_tensor("bonus_token_ids", bonus_token_ids, 2, integer=True, device=device)
        check.check_shape("bonus_token_ids", bonus_token_ids, (batch, 1))
        check.check_prob_values("target_with_bonus_probs", target_probs.reshape(-1, vocab))
        check.check_prob_values("draft_probs", draft_probs.reshape(-1, vocab))
        drafted = draft_token_ids.reshape(-1)
        check.check_token_ids("draft_token_ids", drafted[drafted != PLACEHOLDER_TOKEN_ID], vocab)
        check.check_token_ids("bonus_token_ids", bonus_token_ids.reshape(-1), vocab)
