"""A two-token world for distributional tests of a verifier.

A toy "model" over a vocabulary of V tokens: target logits t1 for the first position, t2[y1] for
the second given the first token, t3[y2] for the bonus position; the drafter proposes x1 ~ q1,
x2 ~ q2[x1]. Each of n independent requests (distinct seeds) verifies K = 2 drafts; a request
that emitted only one token takes a second, draft-free step (K = 0, step 1), as an engine would.
Exactness means the pair of first two emitted tokens (y1, y2) is distributed as
p1(y1) * p2(y2 | y1), with p the reference pipeline's distributions.

Every request has the same prompt and output so far (for penalties): p1 is penalised with the
history `output`, p2(. | y1) with output + [y1], as sampling token by token would. The "repeat"
drafts propose the last output token, then the first draft again, most of the time, so that
a verifier penalising a row without the drafts before it is caught.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from verispec import SamplingMetadata, SamplingParams
from verispec.sample import DraftLogits, DraftProbs, rejection_sample
from verispec.sample.reference import reference_probs

from ..stats import ChiSquare, chi_square

V = 6
DRAFT_KINDS = ("uniform", "disjoint", "same", "overconfident", "logits", "onehot")
REPEAT_KINDS = ("repeat", "onehot-repeat")  # probabilities / one-hot drafts that repeat tokens

# (target_logits, draft_token_ids, cu_num_draft_tokens, sampling, draft, uncond_logits) -> [n, K+1]
Sampler = Callable[..., torch.Tensor]


def default_sampler(target, ids, cu, sampling, draft, uncond) -> torch.Tensor:
    return rejection_sample(target, ids, cu, sampling, draft=draft, uncond_logits=uncond).token_ids


@dataclass
class World:
    params: SamplingParams
    draft_kind: str
    seed: int = 0
    prompt: tuple[int, ...] = ()
    output: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.seed)

        def logits(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, V, generator=g) * 1.5

        self.t1, self.t2, self.t3 = logits(), logits(V), logits(V)
        self.u1, self.u2, self.u3 = logits(), logits(V), logits(V)
        if self.draft_kind == "disjoint":
            # The target rules out the upper half; the drafter proposes only from it.
            for t in (self.t1, self.t2, self.t3):
                t[..., V // 2 :] = float("-inf")
        self.p1 = self._probs(self.t1, self.params, self.u1, self.output)
        self.p2 = torch.stack([self._probs(self.t2[y], self.params, self.u2[y], self.output + (y,)) for y in range(V)])
        self.d1, self.d2 = logits(), logits(V)
        self.q1, self.q2 = self._draft_dists()

    def _probs(self, logits: torch.Tensor, params: SamplingParams, uncond: torch.Tensor | None,
               history: tuple[int, ...]) -> torch.Tensor:
        return reference_probs(logits, params, uncond, self.prompt, history)

    def _draft_dists(self) -> tuple[torch.Tensor, torch.Tensor]:
        kind = self.draft_kind
        if kind in REPEAT_KINDS:
            last = self.output[-1] if self.output else 0
            repeat = torch.full((V, V), 0.2 / (V - 1), dtype=torch.float64).fill_diagonal_(0.8)
            return repeat[last], repeat
        if kind in ("uniform", "onehot"):
            return torch.full((V,), 1 / V, dtype=torch.float64), torch.full((V, V), 1 / V, dtype=torch.float64)
        if kind == "disjoint":
            q = torch.zeros(V, dtype=torch.float64)
            q[V // 2 :] = 1 / (V - V // 2)
            return q, q.expand(V, V).clone()
        if kind == "same":
            return self.p1, self.p2
        if kind == "overconfident":
            sharpen = lambda p: p**4 / (p**4).sum(-1, keepdim=True)  # noqa: E731
            return sharpen(self.p1), sharpen(self.p2)
        if kind == "logits":
            unguided = dataclasses.replace(self.params, guidance_scale=1.0)
            q2 = torch.stack([self._probs(self.d2[y], unguided, None, self.output + (y,)) for y in range(V)])
            return self._probs(self.d1, unguided, None, self.output), q2
        raise ValueError(kind)

    def run(self, n: int, sampler: Sampler = default_sampler) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns y1, y2: [n] each."""
        g = torch.Generator().manual_seed(self.seed + 1)
        x1 = torch.multinomial(self.q1.float(), n, replacement=True, generator=g)
        x2 = torch.multinomial(self.q2[x1].float(), 1, generator=g)[:, 0]
        target = torch.stack([self.t1.expand(n, V), self.t2[x1], self.t3[x2]], 1).reshape(3 * n, V)
        uncond = torch.stack([self.u1.expand(n, V), self.u2[x1], self.u3[x2]], 1).reshape(3 * n, V)
        ids = torch.stack([x1, x2], 1).reshape(-1)
        if self.draft_kind == "logits":
            draft = DraftLogits(torch.stack([self.d1.expand(n, V), self.d2[x1]], 1).reshape(2 * n, V))
        elif self.draft_kind.startswith("onehot"):
            draft = None
        else:
            draft = DraftProbs(torch.stack([self.q1.expand(n, V), self.q2[x1]], 1).reshape(2 * n, V).float())
        seeds = list(range(self.seed * 10**7, self.seed * 10**7 + n))
        sampling = SamplingMetadata.from_params(
            [self.params] * n, seeds=seeds, prompt_token_ids=[self.prompt] * n, output_token_ids=[self.output] * n
        )
        out = sampler(target, ids, torch.arange(n + 1) * 2, sampling, draft, uncond)
        assert out.shape == (n, 3)
        y1, y2 = out[:, 0].clone(), out[:, 1].clone()
        again = (y2 == -1).nonzero()[:, 0]
        if again.numel():
            m = again.numel()
            second = SamplingMetadata.from_params(
                [self.params] * m, seeds=[seeds[i] for i in again.tolist()], steps=[1] * m,
                prompt_token_ids=[self.prompt] * m, output_token_ids=[self.output + (y,) for y in y1[again].tolist()],
            )
            out2 = sampler(
                self.t2[y1[again]], torch.zeros(0, dtype=torch.long), torch.zeros(m + 1, dtype=torch.long),
                second, None, self.u2[y1[again]],
            )
            y2[again] = out2[:, 0]
        return y1, y2

    def tests(self, n: int, sampler: Sampler = default_sampler) -> dict[str, ChiSquare]:
        """Chi-square per output position and on the joint of the first two emitted tokens."""
        y1, y2 = self.run(n, sampler)
        joint = self.p1[:, None] * self.p2
        return {
            "position 1": chi_square(y1, self.p1),
            "position 2": chi_square(y2, joint.sum(0)),
            "joint": chi_square(y1 * V + y2, joint.reshape(-1)),
        }
