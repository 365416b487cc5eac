"""Structured output under speculation, proven distributionally (chi-square per position and
joint, false alarm 1e-6, tests/stats.py): a three-token world over a 7-token vocabulary whose
grammar allows different tokens after different histories. Each of n requests verifies K = 2
drafts (chain) or a small tree with the target rows masked by structured/matcher.py (each row
with its own prefix), and a request that emitted one token takes a draft-free step after it.
Exactness: the first two emitted tokens follow p1(y1) p2(y2 | y1), the target's distributions
masked by the grammar after the history and renormalised. Drafts that obey the grammar (q
masked as the drafters mask it), drafts that violate it (uniform over every token, as
probabilities and one-hot), with penalties, filters and CFG; masking every row with the
output's state alone (a per-request mask) fails the statistic."""

from __future__ import annotations

import dataclasses

import pytest
import tokenizers
import torch
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from verispec import SamplingMetadata, SamplingParams
from verispec.model import Tokenizer
from verispec.sample import DraftProbs, rejection_sample, verify_tree
from verispec.sample.reference import reference_probs
from verispec.structured import GrammarCompiler, GrammarSpec, apply_token_mask, chain_prefixes, tree_prefixes

from ..stats import chi_square

V, EOS = 7, 6
N = 40_000
# Token i spells the letter LETTERS[i] (EOS: "</s>"). The first token decides what may follow.
LETTERS = "abcdef"
REGEX = r"(a|b)(c|d|e)(f|a)|(c|d|f)(a|b|f)(b|c)|eee"


def letter_tokenizer() -> Tokenizer:
    backend = tokenizers.Tokenizer(WordLevel({**{c: i for i, c in enumerate(LETTERS)}, "</s>": EOS}, unk_token="a"))
    backend.pre_tokenizer = WhitespaceSplit()
    return Tokenizer(backend, bos_token_id=None, eos_token_id=EOS)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(letter_tokenizer(), V, [EOS])


class GrammarWorld:
    def __init__(self, compiler: GrammarCompiler, params: SamplingParams, drafts: str, seed: int) -> None:
        self.params, self.drafts, self.seed = params, drafts, seed
        self.grammar = compiler.matcher(GrammarSpec.from_field("regex", REGEX))
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}
        g = torch.Generator().manual_seed(seed)

        def logits(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, V, generator=g) * 1.5

        self.t1, self.t2, self.t3 = logits(), logits(V), logits(V)
        self.u1, self.u2, self.u3 = logits(), logits(V), logits(V)
        self.d1, self.d2 = logits(), logits(V)
        self.p1 = self.probs(self.t1, self.u1, ())
        self.p2 = torch.stack([self.probs(self.t2[y], self.u2[y], (y,)) for y in range(V)])

    def mask(self, prefix: tuple[int, ...]) -> torch.Tensor:  # [V] bool
        if prefix not in self._masks:
            self._masks[prefix] = self.grammar.masks([list(prefix)])[0]
        return self._masks[prefix]

    def probs(self, logits: torch.Tensor, uncond: torch.Tensor, history: tuple[int, ...]) -> torch.Tensor:
        """The reference: the grammar's tokens as the allowed list, the pipeline's stage before
        temperature (the engine masks the raw logits instead, which must come to the same)."""
        allowed = tuple(torch.nonzero(self.mask(history)).flatten().tolist())
        return reference_probs(logits, dataclasses.replace(self.params, allowed_token_ids=allowed), uncond, (),
                               history)

    def draft_dists(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.drafts == "obey":  # the drafter's own logits through the mask, as draft_sampling does
            q1 = apply_token_mask(self.d1[None], self.mask(())[None])[0].softmax(-1)
            q2 = torch.stack([apply_token_mask(self.d2[y][None], self.mask((y,))[None])[0].softmax(-1)
                              for y in range(V)])
            return q1.double(), q2.double()
        return torch.full((V,), 1 / V, dtype=torch.float64), torch.full((V, V), 1 / V, dtype=torch.float64)

    def masked(self, rows: torch.Tensor, prefixes: list[list[int]]) -> torch.Tensor:
        index = {p: i for i, p in enumerate({tuple(p) for p in prefixes})}
        table = torch.stack([self.mask(p) for p in index])
        return apply_token_mask(rows, table[torch.tensor([index[tuple(p)] for p in prefixes])])

    def run(self, n: int, row_prefixes=chain_prefixes, tree: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed + 1)
        q1, q2 = self.draft_dists()
        x1 = torch.multinomial(q1.float(), n, replacement=True, generator=g)
        x2 = torch.multinomial(q2[x1].float(), 1, generator=g)[:, 0]
        if tree:  # root -> a, root -> b (drawn without replacement), a -> c: 3 nodes
            xb = torch.multinomial(_without(q1, x1).float(), 1, generator=g)[:, 0]
            nodes = torch.stack([x1, xb, x2], 1)
            parents = [-1, -1, 0]
            prefixes = [tree_prefixes(t, parents) for t in nodes.tolist()]
            target = torch.stack([self.t1.expand(n, V), self.t2[x1], self.t2[xb], self.t3[x2]], 1)
            uncond = torch.stack([self.u1.expand(n, V), self.u2[x1], self.u2[xb], self.u3[x2]], 1)
            rows_per = 4
            ids = nodes.reshape(-1)
        else:
            prefixes = [row_prefixes(d) for d in torch.stack([x1, x2], 1).tolist()]
            target = torch.stack([self.t1.expand(n, V), self.t2[x1], self.t3[x2]], 1)
            uncond = torch.stack([self.u1.expand(n, V), self.u2[x1], self.u3[x2]], 1)
            rows_per = 3
            ids = torch.stack([x1, x2], 1).reshape(-1)
        flat = [p for per in prefixes for p in per]
        target = self.masked(target.reshape(-1, V), flat)
        uncond = self.masked(uncond.reshape(-1, V), flat)
        seeds = list(range(self.seed * 10**7, self.seed * 10**7 + n))
        sampling = SamplingMetadata.from_params([self.params] * n, seeds=seeds, output_token_ids=[()] * n)
        cu = torch.arange(n + 1) * (rows_per - 1)
        if tree:
            q = torch.stack([q1.expand(n, V), _without(q1, x1), q2[x1]], 1).reshape(-1, V).float()
            out = verify_tree(target, ids, torch.tensor(parents * n), cu, sampling, draft=DraftProbs(q),
                              uncond_logits=uncond, replacement=False)
            tokens = out.token_ids
        else:
            draft = None if self.drafts == "onehot" else \
                DraftProbs(torch.stack([q1.expand(n, V), q2[x1]], 1).reshape(-1, V).float())
            tokens = rejection_sample(target, ids, cu, sampling, draft=draft, uncond_logits=uncond).token_ids
        y1, y2 = tokens[:, 0].clone(), tokens[:, 1].clone()
        again = (y2 == -1).nonzero()[:, 0]
        if again.numel():
            m = again.numel()
            first = y1[again]
            second = SamplingMetadata.from_params([self.params] * m, seeds=[seeds[i] for i in again.tolist()],
                                                  steps=[1] * m, output_token_ids=[(y,) for y in first.tolist()])
            prefixes2 = [row_prefixes([])[0] for _ in range(m)]  # the next step's output holds y1
            masks = torch.stack([self.mask((y,) + tuple(p)) for y, p in zip(first.tolist(), prefixes2)])
            y2[again] = rejection_sample(
                apply_token_mask(self.t2[first], masks), torch.zeros(0, dtype=torch.long),
                torch.zeros(m + 1, dtype=torch.long), second, uncond_logits=apply_token_mask(self.u2[first], masks),
            ).token_ids[:, 0]
        return y1, y2

    def tests(self, n: int, **kwargs) -> dict:
        y1, y2 = self.run(n, **kwargs)
        joint = self.p1[:, None] * self.p2
        return {
            "position 1": chi_square(y1, self.p1),
            "position 2": chi_square(y2, joint.sum(0)),
            "joint": chi_square(y1 * V + y2, joint.reshape(-1)),
        }


def _without(q: torch.Tensor, taken: torch.Tensor) -> torch.Tensor:  # [n, V]: q with `taken` removed, renormalised
    rest = q.repeat(taken.numel(), 1).scatter(1, taken[:, None], 0.0)
    return rest / rest.sum(-1, keepdim=True)


CASES = [
    (SamplingParams(), "obey"),
    (SamplingParams(temperature=0.7, top_p=0.9), "onehot"),
    (SamplingParams(guidance_scale=2.0, presence_penalty=1.0, top_k=3), "violate"),
]


@pytest.mark.parametrize("params,drafts", CASES, ids=[f"{d}-{i}" for i, (_, d) in enumerate(CASES)])
def test_emitted_tokens_follow_the_masked_target(compiler, params: SamplingParams, drafts: str) -> None:
    world = GrammarWorld(compiler, params, drafts, seed=11 + len(drafts))
    for name, result in world.tests(N).items():
        assert result.passed, f"{name}: {result}"


def test_tree_nodes_are_masked_by_their_own_paths(compiler) -> None:
    world = GrammarWorld(compiler, SamplingParams(), "obey", seed=5)
    for name, result in world.tests(N // 2, tree=True).items():
        assert result.passed, f"{name}: {result}"


def test_the_world_constrains_each_position_differently(compiler) -> None:
    world = GrammarWorld(compiler, SamplingParams(), "obey", seed=0)
    allowed = lambda prefix: torch.nonzero(world.mask(prefix)).flatten().tolist()  # noqa: E731
    assert allowed(()) == [0, 1, 2, 3, 4, 5]
    assert allowed((0,)) == [2, 3, 4] and allowed((2,)) == [0, 1, 5] and allowed((4,)) == [4]
    assert allowed((0, 2)) == [0, 5] and allowed((4, 4)) == [4]
    assert allowed((0, 2, 5)) == [EOS]  # complete: only the end


def test_masking_with_the_output_state_alone_fails_the_statistic(compiler) -> None:
    """Power: every verify row masked with the state after the output (a per-request mask, the
    drafts before the row ignored) lets a row after an accepted draft emit tokens its grammar
    state forbids: pairs the reference gives probability 0 (which chi_square refuses outright)."""
    world = GrammarWorld(compiler, SamplingParams(), "obey", seed=3)
    y1, y2 = world.run(N, row_prefixes=lambda drafts: [[] for _ in range(len(drafts) + 1)])
    joint = world.p1[:, None] * world.p2
    assert chi_square(y1, world.p1).passed
    with pytest.raises(AssertionError, match="drew impossible categories"):
        chi_square(y1 * V + y2, joint.reshape(-1))
