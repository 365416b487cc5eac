"""A drop-in for vLLM's (V0) RejectionSampler call convention, backed by verispec's exact core.

Users of `RejectionSampler.forward(target_with_bonus_probs, bonus_token_ids, draft_probs,
draft_token_ids, seeded_seqs)` switch by changing the import. Semantics kept from that API:
probabilities in (already through the sampling pipeline), every request has the same K, the
caller's pre-sampled bonus token is emitted when all K drafts are accepted, output [B, K + 1]
with -1 after the first rejection, and running counters of drafted / accepted / emitted tokens.
Seeded rows draw their counter-based seed from the caller's torch.Generator (one host draw per
seeded row), so a seeded row is reproducible and independent of its batch.
"""

from __future__ import annotations

import torch

from . import validation as check
from .rejection import rejection_sample_probs
from .rng import fresh_seed, request_keys


class RejectionSampler(torch.nn.Module):
    """Counters (tensors on the device of the last call): num_draft_tokens (drafted),
    num_accepted_tokens (accepted drafts), num_emitted_tokens (accepted drafts + recovered or
    bonus tokens, counting only what was emitted)."""

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
        batch, k = draft_token_ids.shape
        device = target_with_bonus_probs.device
        if self.strict_mode:
            self._check(target_with_bonus_probs, bonus_token_ids, draft_probs, draft_token_ids)
        seeds = [fresh_seed() for _ in range(batch)]
        for row, generator in (seeded_seqs or {}).items():
            seeds[row] = int(torch.randint(0, 2**63 - 1, (1,), generator=generator, device=generator.device))
        keys = request_keys(torch.tensor(seeds), torch.zeros(batch, dtype=torch.int64)).to(device)
        out = rejection_sample_probs(draft_probs, draft_token_ids, target_with_bonus_probs, keys, validate=False)
        all_accepted = out.num_accepted == k
        token_ids = out.token_ids.clone()
        token_ids[:, k] = torch.where(all_accepted, bonus_token_ids[:, 0].to(torch.int64), token_ids[:, k])
        if self.num_accepted_tokens is None or self.num_accepted_tokens.device != device:
            self.init_tensors(device)
        self.num_draft_tokens += batch * k
        self.num_accepted_tokens += out.num_accepted.sum()
        self.num_emitted_tokens += out.num_emitted.sum()
        return token_ids

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
        check.check_token_ids("draft_token_ids", draft_token_ids.reshape(-1), vocab)
        check.check_token_ids("bonus_token_ids", bonus_token_ids.reshape(-1), vocab)
