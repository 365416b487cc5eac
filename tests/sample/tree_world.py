"""A small world for distributional tests of a tree verifier (verispec/sample/tree.py).

A toy "model" over V tokens: target logits T[prefix] (and CFG rows U[prefix]) for every prefix
of up to MAX_PREFIX tokens after the prompt, drafter logits D[prefix]. Each of n independent
requests (distinct seeds) drafts a tree of one fixed shape: a node's token is drawn from the
drafter's distribution at its parent's path, siblings i.i.d. (with replacement) or one after
the other without replacement; "onehot" drafts are random tokens verified as deterministic
drafts. A request that emitted fewer than LENGTH tokens continues with draft-free steps (an
empty tree, the next step's key), as an engine would. Exactness means the first LENGTH emitted
tokens follow the target's joint distribution, computed with the reference pipeline
(verispec.sample.reference) with the history output + prefix for penalties.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from verispec import SamplingMetadata, SamplingParams
from verispec.sample import DraftLogits, DraftProbs
from verispec.sample.reference import reference_probs
from verispec.sample.tree import verify_tree

from ..stats import ChiSquare, chi_square

V = 6
LENGTH = 3  # emitted tokens compared with the target's joint distribution
MAX_PREFIX = 3
KINDS = ("uniform", "disjoint", "same", "overconfident", "logits", "onehot")
SHAPES = {  # node parents, per request
    "wide": (-1, -1, -1, -1),
    "chain": (-1, 0, 1),
    "mixed": (-1, -1, -1, 0, 0, 1, 3),
}

# (target_logits, ids, parents, cu, sampling, draft, uncond, replacement) -> token_ids [n, width]
TreeSampler = Callable[..., torch.Tensor]


def tree_sampler(target, ids, parents, cu, sampling, draft, uncond, replacement) -> torch.Tensor:
    return verify_tree(target, ids, parents, cu, sampling, draft=draft, uncond_logits=uncond,
                       replacement=replacement).token_ids


def _offsets() -> list[int]:
    return [sum(V**i for i in range(length)) for length in range(MAX_PREFIX + 2)]


def prefix_code(prefix: torch.Tensor) -> torch.Tensor:  # [n, L] tokens -> [n] row of the tables
    code = torch.zeros(prefix.shape[0], dtype=torch.int64)
    for i in range(prefix.shape[1]):
        code = code * V + prefix[:, i]
    return code + _offsets()[prefix.shape[1]]


@dataclass
class TreeWorld:
    params: SamplingParams
    kind: str
    shape: str
    replacement: bool = True
    seed: int = 0
    prompt: tuple[int, ...] = ()
    output: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.seed)
        rows = _offsets()[MAX_PREFIX + 1]
        self.prefixes = [p for length in range(MAX_PREFIX + 1) for p in itertools.product(range(V), repeat=length)]
        self.t, self.u, self.d = (torch.randn(rows, V, generator=g) * 1.5 for _ in range(3))
        if self.kind == "disjoint":  # the target rules out the upper half; the drafter proposes only from it
            self.t[:, V // 2:] = float("-inf")
        self.p = torch.stack([self._probs(self.t[i], self.params, self.u[i], s) for i, s in enumerate(self.prefixes)])
        self.q = self._draft_table()

    def _probs(self, logits, params, uncond, prefix) -> torch.Tensor:
        return reference_probs(logits, params, uncond, self.prompt, self.output + prefix)

    def _draft_table(self) -> torch.Tensor:  # [rows, V] float64 drafter distribution per prefix
        kind, rows = self.kind, self.p.shape[0]
        if kind in ("uniform", "onehot"):
            return torch.full((rows, V), 1 / V, dtype=torch.float64)
        if kind == "disjoint":
            q = torch.zeros(rows, V, dtype=torch.float64)
            q[:, V // 2:] = 1 / (V - V // 2)
            return q
        if kind == "same":
            return self.p.clone()
        if kind == "overconfident":
            return self.p**4 / (self.p**4).sum(-1, keepdim=True)
        if kind == "logits":
            unguided = dataclasses.replace(self.params, guidance_scale=1.0)
            return torch.stack([self._probs(self.d[i], unguided, None, s) for i, s in enumerate(self.prefixes)])
        raise ValueError(kind)

    def draft_tree(self, n: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """ids [n, m], parent codes [n, m] (the table row each node was drawn from), paths."""
        g = torch.Generator().manual_seed(self.seed + 1)
        parents = SHAPES[self.shape]
        paths: list[torch.Tensor] = []
        ids, drawn_from = [], []
        for j, parent in enumerate(parents):
            before = paths[parent] if parent >= 0 else torch.zeros(n, 0, dtype=torch.int64)
            code = prefix_code(before)
            q = self.q[code].clone()
            if not self.replacement:
                for i in range(j):
                    if parents[i] == parent:
                        q[torch.arange(n), ids[i]] = 0.0
            x = torch.multinomial(q.float(), 1, generator=g)[:, 0]
            ids.append(x)
            drawn_from.append(code)
            paths.append(torch.cat([before, x[:, None]], 1))
        return torch.stack(ids, 1), torch.stack(drawn_from, 1), paths

    def run(self, n: int, sampler: TreeSampler = tree_sampler) -> torch.Tensor:
        """The first LENGTH emitted tokens of n requests: [n, LENGTH]."""
        ids, drawn_from, paths = self.draft_tree(n)
        m = ids.shape[1]
        codes = torch.stack([prefix_code(torch.zeros(n, 0, dtype=torch.int64))] + [prefix_code(p) for p in paths], 1)
        target, uncond = self.t[codes].reshape(-1, V), self.u[codes].reshape(-1, V)
        if self.kind == "logits":
            draft = DraftLogits(self.d[drawn_from].reshape(-1, V))
        elif self.kind == "onehot":
            draft = None
        else:
            draft = DraftProbs(self.q[drawn_from].reshape(-1, V).float())
        seeds = list(range(self.seed * 10**7, self.seed * 10**7 + n))
        sampling = self._sampling(seeds, [0] * n, [()] * n)
        parents = torch.tensor(SHAPES[self.shape]).repeat(n)
        out = sampler(target, ids.reshape(-1), parents, torch.arange(n + 1) * m, sampling, draft, uncond,
                      self.replacement)
        emitted = [[t for t in row if t >= 0] for row in out.tolist()]
        step = 1
        while True:
            shortest = min(len(e) for e in emitted)
            if shortest >= LENGTH:
                break
            short = [b for b, e in enumerate(emitted) if len(e) == shortest]
            prefixes = torch.tensor([emitted[b] for b in short])
            rows = prefix_code(prefixes)
            sampling = self._sampling([seeds[b] for b in short], [step] * len(short),
                                      [tuple(emitted[b]) for b in short])
            empty = torch.zeros(0, dtype=torch.int64)
            more = sampler(self.t[rows], empty, empty, torch.zeros(len(short) + 1, dtype=torch.int64), sampling,
                           None, self.u[rows], self.replacement)
            for b, token in zip(short, more[:, 0].tolist()):
                emitted[b].append(token)
            step += 1
        return torch.tensor([e[:LENGTH] for e in emitted])

    def _sampling(self, seeds: list[int], steps: list[int], prefixes: list[tuple[int, ...]]) -> SamplingMetadata:
        n = len(seeds)
        return SamplingMetadata.from_params(
            [self.params] * n, seeds=seeds, steps=steps, prompt_token_ids=[self.prompt] * n,
            output_token_ids=[self.output + p for p in prefixes],
        )

    def joint(self, length: int) -> torch.Tensor:  # [V**length] float64 target probability of each sequence
        probs = torch.ones(1, dtype=torch.float64)
        for i in range(length):
            sequences = torch.tensor(list(itertools.product(range(V), repeat=i)), dtype=torch.int64).reshape(V**i, i)
            probs = (probs[:, None] * self.p[prefix_code(sequences)]).reshape(-1)
        return probs

    def tests(self, n: int, sampler: TreeSampler = tree_sampler) -> dict[str, ChiSquare]:
        """Chi-square per position and on the joint of the first two and of all LENGTH tokens."""
        y = self.run(n, sampler)
        full = self.joint(LENGTH).reshape((V,) * LENGTH)
        results = {}
        for i in range(LENGTH):
            marginal = full.sum(dim=tuple(a for a in range(LENGTH) if a != i))
            results[f"position {i + 1}"] = chi_square(y[:, i], marginal)
        results["joint 2"] = chi_square(y[:, 0] * V + y[:, 1], self.joint(2))
        code = torch.zeros(n, dtype=torch.int64)
        for i in range(LENGTH):
            code = code * V + y[:, i]
        results[f"joint {LENGTH}"] = chi_square(code, self.joint(LENGTH))
        return results
