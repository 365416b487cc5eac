"""Speculative-decoding statistics, and the analysis that says whether speculation pays.

Terms: a verify step is one target forward pass over a request's newest token and its k draft
tokens. Its draft tokens are accepted up to the first rejection; the step then emits the
accepted tokens plus one more (the recovered token sampled at the rejection, or the bonus token
when all k were accepted), so emitted = accepted + 1.

Analysis model (Leviathan et al. 2022, §3): draft position i is accepted, given that positions
1..i-1 were, with probability alpha_i; a single alpha means alpha_i = alpha for every i. For one
position with target distribution p and draft distribution q, the rule "accept x ~ q with
probability min(1, p(x) / q(x))" accepts with probability sum_v min(p_v, q_v), which is alpha.
Costs: t_draft per draft token, t_target per target forward pass, and a verify pass over k + 1
tokens costs the same as a one-token decode pass (true while decoding is memory-bound).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# One acceptance probability for every draft position, or per-position [alpha_1, alpha_2, ...].
Alpha = float | Sequence[float]


def _check_count(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r} is invalid: expected an integer >= 0")
    return value


def _check_probability(name: str, value: object) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
        raise ValueError(f"{name}={value!r} is invalid: expected a number in [0, 1]")
    return float(value)


def _check_time(name: str, value: object, allow_zero: bool) -> float:
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value >= 0 if allow_zero else value > 0))
    if not ok:
        raise ValueError(
            f"{name}={value!r} is invalid: expected a finite number {'>=' if allow_zero else '>'} 0"
        )
    return float(value)


def _per_position(alpha: Sequence[float], k: int | None) -> list[float]:
    """[alpha_1..alpha_k] from per-position alphas, validated; k defaults to len(alpha)."""
    alphas = [_check_probability(f"alpha[{i}]", a) for i, a in enumerate(alpha)]
    if k is None:
        return alphas
    if _check_count("k", k) > len(alphas):
        raise ValueError(
            f"k={k!r} is invalid: expected at most len(alpha)={len(alphas)} per-position alphas"
        )
    return alphas[:k]


def expected_acceptance(
    p: torch.Tensor,  # [..., vocab_size]
    q: torch.Tensor,  # [..., vocab_size]
) -> torch.Tensor:  # [...]
    """Probability that a draft token x ~ q is accepted against p: sum_v min(p_v, q_v).

    Equals 1 - TV(p, q), where TV(p, q) = sum_v max(p_v - q_v, 0) is the total-variation
    distance and also the mass of the residual the recovered token is drawn from.

    p: [..., vocab_size] target probabilities.
    q: [..., vocab_size] draft probabilities, same shape as p.
    Returns [...].
    """
    if p.shape != q.shape or p.dim() == 0:
        raise ValueError(
            f"p and q have shapes {tuple(p.shape)} and {tuple(q.shape)}: expected equal shapes "
            "[..., vocab_size]"
        )
    return torch.minimum(p, q).sum(dim=-1)


def expected_emitted_tokens(alpha: Alpha, k: int | None = None) -> float:
    """Expected tokens emitted per verify step with k draft tokens.

    E = sum_{j=0..k} prod_{i=1..j} alpha_i (position j is reached only if 1..j-1 were accepted,
    and the first emitted token is always there). With one alpha this is the geometric sum
    (1 - alpha^(k+1)) / (1 - alpha), and k + 1 when alpha == 1. The expected number of accepted
    tokens is E - 1.

    alpha: one acceptance probability for every position (k is then required), or per-position
        [alpha_1, ...] (k then defaults to its length and may not exceed it).
    """
    if isinstance(alpha, Sequence):
        alphas = _per_position(alpha, k)
    else:
        alphas = [_check_probability("alpha", alpha)] * _check_count("k", k)
    # Summing the products term by term (k is small) stays accurate near alpha = 1, where the
    # closed form cancels, and needs no alpha == 1 case.
    total, reach = 1.0, 1.0
    for a in alphas:
        reach *= a
        total += reach
    return total


def speedup(alpha: Alpha, k: int, t_draft: float, t_target: float) -> float:
    """Expected decode speed-up of speculating k tokens over plain decoding.

    speedup = E * t_target / (k * t_draft + t_target), with E = expected_emitted_tokens(alpha,
    k) = n + 1 for n expected accepted tokens: a step costs k draft passes and one target pass
    and emits E tokens, where plain decoding emits one token per t_target. k = 0 gives 1.

    t_draft: seconds per draft token (>= 0: a lookup drafter is nearly free).
    t_target: seconds per target forward pass (> 0).
    """
    k = _check_count("k", k)
    t_draft = _check_time("t_draft", t_draft, allow_zero=True)
    t_target = _check_time("t_target", t_target, allow_zero=False)
    return expected_emitted_tokens(alpha, k) * t_target / (k * t_draft + t_target)


def should_use_speculation(alpha: Alpha, k: int, t_draft: float, t_target: float) -> bool:
    """Whether speculating k tokens is expected to beat plain decoding (speedup > 1)."""
    return speedup(alpha, k, t_draft, t_target) > 1


def best_num_speculative_tokens(
    alpha: Alpha, t_draft: float, t_target: float, max_k: int = 16
) -> int:
    """The k in 0..max_k with the largest speedup; 0 means do not speculate.

    Ties go to the smaller k (same speed for less work). With per-position alphas, k also stops
    at len(alpha).
    """
    max_k = _check_count("max_k", max_k)
    if isinstance(alpha, Sequence):
        max_k = min(max_k, len(alpha))
    best_k, best = 0, 1.0
    for k in range(1, max_k + 1):
        s = speedup(alpha, k, t_draft, t_target)
        if s > best:
            best_k, best = k, s
    return best_k


@dataclass
class SpecDecodeStats:
    """Running counts of speculative verification (terms as in the module docstring).

    num_drafts: verify steps that had at least one draft token.
    num_draft_tokens: draft tokens verified.
    num_accepted_tokens: draft tokens accepted.
    num_emitted_tokens: tokens emitted by all observed steps, those without drafts included.
    draft_per_position[i]: steps that had a draft token at position i (0-based).
    accepted_per_position[i]: steps whose draft token at position i was accepted.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    draft_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """Record one verify step of one request: num_draft tokens verified, the first
        num_accepted of them accepted, num_accepted + 1 tokens emitted."""
        _check_count("num_draft", num_draft)
        _check_count("num_accepted", num_accepted)
        if num_accepted > num_draft:
            raise ValueError(
                f"num_accepted={num_accepted} is invalid: expected at most num_draft={num_draft}"
            )
        self.num_emitted_tokens += num_accepted + 1
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        _add(self.draft_per_position, [1] * num_draft)
        _add(self.accepted_per_position, [1] * num_accepted)

    def merge(self, other: SpecDecodeStats) -> None:
        """Add ``other``'s counts to these (e.g. per-request stats into engine totals)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_emitted_tokens += other.num_emitted_tokens
        _add(self.draft_per_position, other.draft_per_position)
        _add(self.accepted_per_position, other.accepted_per_position)

    @property
    def num_steps(self) -> int:
        """Verify steps observed, those without drafts included (each emits accepted + 1)."""
        return self.num_emitted_tokens - self.num_accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified draft tokens; 0 when there were none."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Mean tokens emitted per verify step with drafts: 1 + num_accepted_tokens / num_drafts.

        This is vLLM's definition (steps without drafts are left out, so it measures the
        drafter, not the scheduler); 1 when no step had drafts.
        """
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Per draft position i: accepted_per_position[i] / draft_per_position[i].

        The marginal rate of position i among steps that drafted it (vLLM's per-position rate
        when k is fixed). With a fixed k, entry i / entry i-1 estimates the conditional alpha_i
        of the module docstring.
        """
        accepted = self.accepted_per_position
        return [
            (accepted[i] if i < len(accepted) else 0) / n
            for i, n in enumerate(self.draft_per_position)
        ]

    def summary(self) -> dict[str, int | float | list[float]]:
        return {
            "num_steps": self.num_steps,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_emitted_tokens": self.num_emitted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
        }


def _add(totals: list[int], counts: Sequence[int]) -> None:
    """totals += counts elementwise, growing totals as needed."""
    if len(totals) < len(counts):
        totals.extend([0] * (len(counts) - len(totals)))
    for i, c in enumerate(counts):
        totals[i] += c
