"""Block verification (verispec/sample/block.py): exact, never worse than token-wise, and the
implementation is the rule.

1. Exact enumeration (no sampling): for small worlds, the probability of every emitted
   sequence under a rule is computed over all draft blocks and all acceptance outcomes; the
   tokens, continued by sampling from the target, must follow the target's joint distribution.
   Token-wise and block verification do; two deliberately wrong block rules do not.
2. Exact expected accepted drafts: block >= token-wise on random worlds.
3. Chi-square (false alarm 1e-6) of the implementation, through the two-token world of
   harness.py: against the target (per position, joint) and against the block rule's own
   enumerated distribution of emitted sequences; a wrong residual fails.
4. Seeds, greedy, K = 1, the engine, bad input.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable

import pytest
import torch

from verispec import LLM, SamplingMetadata, SamplingParams
from verispec.config import CacheConfig, EngineConfig, SpeculativeConfig
from verispec.engine.engine import LLMEngine
from verispec.sample import DraftProbs, block, rejection_sample
from verispec.spec_decode.ngram import NgramDrafter

from ..stats import chi_square
from ..tiny import run_all, tiny_model, word_tokenizer
from .harness import V, World

N = 40_000
Dist = Callable[[tuple[int, ...]], torch.Tensor]  # prefix -> [V] float64 distribution


# ---------------------------------------------------------------- exact enumeration

def random_world(seed: int, vocab: int, k: int, draft: str) -> tuple[Dist, Dist]:
    """Target p(. | prefix) for prefixes up to length K, drafter q(. | prefix) up to K - 1."""
    g = torch.Generator().manual_seed(seed)
    table: dict[tuple[int, ...], torch.Tensor] = {}
    for length in range(k + 1):
        for prefix in itertools.product(range(vocab), repeat=length):
            table[prefix] = (torch.randn(vocab, generator=g, dtype=torch.float64) * 1.5).softmax(0)
            table[("q",) + prefix] = (torch.randn(vocab, generator=g, dtype=torch.float64) * 1.5).softmax(0)
            if draft == "zeros":  # the drafter proposes tokens the target rules out, and vice versa
                table[prefix][0] = 0.0
                table[prefix] /= table[prefix].sum()
                table[("q",) + prefix][1:2] = 0.0
                table[("q",) + prefix] /= table[("q",) + prefix].sum()
            if draft == "onehot":
                table[("q",) + prefix] = torch.nn.functional.one_hot(
                    table[("q",) + prefix].argmax(), vocab).double()
    return (lambda prefix: table[prefix]), (lambda prefix: table[("q",) + prefix])


def token_rule(p: list[torch.Tensor], q: list[torch.Tensor], x: tuple[int, ...]):
    """Token-wise verification: P(tau = t) and the distribution of the token after t drafts."""
    k = len(x)
    accept = [min(1.0, float(p[i][x[i]] / q[i][x[i]])) for i in range(k)]
    out = []
    for t in range(k + 1):
        prob = math.prod(accept[:t]) * (1 - accept[t] if t < k else 1.0)
        out.append((prob, p[k] if t == k else _normalise((p[t] - q[t]).clamp(min=0), p[t])))
    return out


def block_rule(p, q, x, first_failure: bool = False, token_residual: bool = False):
    """The rule of block.py, or a deliberately wrong variant: tau at the first failed test
    (as token-wise) instead of the last passed one, or the residual max(p - q, 0) at every tau."""
    k = len(x)
    w = [1.0]
    for i in range(k):
        w.append(min(1.0, w[-1] * float(p[i][x[i]] / q[i][x[i]])) if q[i][x[i]] > 0 else 0.0)
    h = [1.0]
    for i in range(1, k):
        r = float((w[i] * p[i] - q[i]).clamp(min=0).sum())
        h.append(r / (r + 1 - w[i]) if r + 1 - w[i] > 0 else 1.0)
    h.append(w[k])
    out = []
    for t in range(k + 1):
        if first_failure:
            prob = math.prod(h[1:t + 1]) * (1 - h[t + 1] if t < k else 1.0)
        else:
            prob = h[t] * math.prod([1 - v for v in h[t + 1:]])
        scale = 1.0 if token_residual else w[t]
        out.append((prob, p[k] if t == k else _normalise((scale * p[t] - q[t]).clamp(min=0), p[t])))
    return out


def _normalise(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    return weights / weights.sum() if weights.sum() > 0 else fallback


def emitted_distribution(p: Dist, q: Dist, vocab: int, k: int, rule) -> dict[tuple[int, ...], float]:
    """P(emitted tokens = s) for every sequence s, over all draft blocks."""
    emitted: dict[tuple[int, ...], float] = {}
    for x in itertools.product(range(vocab), repeat=k):
        ps = [p(x[:i]) for i in range(k + 1)]
        qs = [q(x[:i]) for i in range(k)]
        drawn = math.prod([qs[i][x[i]] for i in range(k)])
        if drawn == 0:
            continue
        for t, (prob, final) in enumerate(rule(ps, qs, x)):
            for y in range(vocab):
                s = x[:t] + (y,)
                emitted[s] = emitted.get(s, 0.0) + drawn * prob * float(final[y])
    return emitted


def continued_error(p: Dist, emitted: dict[tuple[int, ...], float], vocab: int, k: int) -> float:
    """Largest gap between P(first K + 1 tokens = z), when the emitted tokens are continued by
    sampling from the target, and the target's own joint probability of z."""
    worst = 0.0
    for z in itertools.product(range(vocab), repeat=k + 1):
        target = math.prod([p(z[:i])[z[i]] for i in range(k + 1)])
        got = sum(
            emitted.get(z[:t], 0.0) * math.prod([p(z[:i])[z[i]] for i in range(t, k + 1)] + [1.0])
            for t in range(1, k + 2)
        )
        worst = max(worst, abs(got - target))
    return worst


WORLDS = [(seed, vocab, k, draft) for seed, (vocab, k) in enumerate([(3, 2), (3, 3), (4, 2)])
          for draft in ("random", "zeros", "onehot")]


@pytest.mark.parametrize("seed,vocab,k,draft", WORLDS)
def test_enumeration_token_and_block_rules_are_exact(seed: int, vocab: int, k: int, draft: str) -> None:
    p, q = random_world(seed, vocab, k, draft)
    for rule in (token_rule, block_rule):
        emitted = emitted_distribution(p, q, vocab, k, rule)
        assert abs(sum(emitted.values()) - 1) < 1e-12
        assert continued_error(p, emitted, vocab, k) < 1e-12, rule.__name__


@pytest.mark.parametrize("wrong", ["first_failure", "token_residual"])
def test_enumeration_rejects_wrong_block_rules(wrong: str) -> None:
    # K = 3: at K = 2 the token-wise residual is often exact by coincidence (error ~1e-17).
    p, q = random_world(2, 3, 3, "random")
    emitted = emitted_distribution(p, q, 3, 3, lambda *a: block_rule(*a, **{wrong: True}))
    assert continued_error(p, emitted, 3, 3) > 2e-3


def expected_accepted(emitted: dict[tuple[int, ...], float]) -> float:
    return sum(prob * (len(s) - 1) for s, prob in emitted.items())


@pytest.mark.parametrize("seed", range(6))
def test_block_accepts_at_least_as_many_in_expectation(seed: int) -> None:
    vocab, k = (3, 3) if seed % 2 else (4, 2)
    p, q = random_world(100 + seed, vocab, k, "zeros" if seed % 3 == 0 else "random")
    token = expected_accepted(emitted_distribution(p, q, vocab, k, token_rule))
    blocked = expected_accepted(emitted_distribution(p, q, vocab, k, block_rule))
    assert blocked >= token - 1e-12, (blocked, token)


def test_block_accepts_strictly_more_somewhere() -> None:
    """Not a vacuous inequality: some worlds gain."""
    gains = []
    for seed in range(6):
        p, q = random_world(100 + seed, 3, 3, "random")
        gains.append(expected_accepted(emitted_distribution(p, q, 3, 3, block_rule))
                     - expected_accepted(emitted_distribution(p, q, 3, 3, token_rule)))
    assert max(gains) > 1e-3, gains


@pytest.mark.parametrize("vocab,k", [(3, 2), (3, 3), (4, 4)])
def test_one_hot_drafts_gain_nothing(vocab: int, k: int) -> None:
    """With one-hot q, h_i = (w_i - w_{i+1}) / (1 - w_{i+1}) and w_i = prod p_j(x_j), so
    P(tau = i) = w_i - w_{i+1}: exactly token-wise verification's distribution. Block
    verification gains only over drafters that sample (DraftProbs / DraftLogits)."""
    p, q = random_world(7, vocab, k, "onehot")
    token = emitted_distribution(p, q, vocab, k, token_rule)
    blocked = emitted_distribution(p, q, vocab, k, block_rule)
    assert max(abs(token.get(s, 0.0) - blocked.get(s, 0.0)) for s in set(token) | set(blocked)) < 1e-12


# ---------------------------------------------------------------- chi-square, the implementation

def block_sampler(target, ids, cu, sampling, draft, uncond) -> torch.Tensor:
    return rejection_sample(target, ids, cu, sampling, draft=draft, uncond_logits=uncond,
                            verification="block").token_ids


CASES = [
    *[(SamplingParams(), kind) for kind in ("uniform", "disjoint", "same", "overconfident", "logits", "onehot")],
    (SamplingParams(temperature=0.7), "logits"),
    (SamplingParams(top_k=3), "overconfident"),
    (SamplingParams(top_p=0.7), "onehot"),
    (SamplingParams(guidance_scale=2.0), "logits"),
    (SamplingParams(guidance_scale=1.5, temperature=0.7, top_p=0.9), "uniform"),
]


PENALISED = [  # rejection_sample's pre-stage adjusts the rows before the block verifier reads them
    (SamplingParams(presence_penalty=1.5, repetition_penalty=1.3), "repeat"),
    (SamplingParams(frequency_penalty=0.8, logit_bias={1: 1.0}, temperature=0.8), "logits"),
]


@pytest.mark.parametrize("params,kind", CASES + PENALISED,
                         ids=[f"{k}-{p.temperature}-{p.top_k}-{p.top_p}-{p.guidance_scale}-{p.presence_penalty}"
                              f"-{p.frequency_penalty}" for p, k in CASES + PENALISED])
def test_block_emitted_tokens_follow_target(params: SamplingParams, kind: str) -> None:
    world = World(params, kind, seed=20 + len(kind), prompt=(2, 5), output=(1, 3, 1))
    for name, result in world.tests(N, sampler=block_sampler).items():
        assert result.passed, f"{name}: {result}"


def harness_dists(world: World) -> tuple[Dist, Dist]:
    """The harness world's target and draft distributions as prefix -> distribution."""
    def p(prefix: tuple[int, ...]) -> torch.Tensor:
        if len(prefix) < 2:
            return world.p1 if not prefix else world.p2[prefix[0]]
        return world._probs(world.t3[prefix[1]], world.params, world.u3[prefix[1]], world.output + prefix)

    def q(prefix: tuple[int, ...]) -> torch.Tensor:
        return world.q1 if not prefix else world.q2[prefix[0]]

    return p, q


def emitted_categories(tokens: torch.Tensor) -> torch.Tensor:  # [n, 3] -> [n] index of the sequence
    length = (tokens >= 0).sum(1)
    offset = torch.tensor([0, 0, V, V + V * V])[length]
    code = torch.zeros_like(length)
    for i in range(3):
        code = torch.where(i < length, code * V + tokens[:, i].clamp(min=0), code)
    return offset + code


@pytest.mark.parametrize("kind", ["uniform", "logits", "onehot"])
def test_implementation_emits_the_block_rules_sequences(kind: str) -> None:
    """Stronger than following the target: the emitted sequences (so the number accepted too)
    follow the enumerated block rule, not the token-wise one."""
    world = World(SamplingParams(), kind, seed=3)
    p, q = harness_dists(world)
    if kind == "onehot":  # the harness draws one-hot drafts from q but verifies them as one-hot
        q = lambda prefix: torch.nn.functional.one_hot(torch.tensor(0), V).double()  # noqa: E731
    first = []

    def record(*args) -> torch.Tensor:
        out = block_sampler(*args)
        if args[1].numel():
            first.append(out)
        return out

    if kind == "onehot":
        world.q1, world.q2 = q(()), q(()).expand(V, V)  # draw the drafts the rule assumes
    world.run(N, sampler=record)
    expected = {"block": emitted_distribution(p, q, V, 2, block_rule),
                "token": emitted_distribution(p, q, V, 2, token_rule)}
    probs = {name: torch.zeros(V + V * V + V**3, dtype=torch.float64) for name in expected}
    for name, emitted in expected.items():
        for s, prob in emitted.items():
            index = [0, V, V + V * V][len(s) - 1] + sum(t * V ** (len(s) - 1 - i) for i, t in enumerate(s))
            probs[name][index] = prob
    samples = emitted_categories(first[0])
    assert chi_square(samples, probs["block"]).passed
    if kind != "onehot":  # one-hot drafts: the two rules are the same distribution (test below)
        assert not chi_square(samples, probs["token"]).passed


def _fixed_block_outcomes(monkeypatch, wrong_residual: bool):
    """Many requests verifying one fixed block x (K = 3, V = 4): their (tau, y) against the block
    rule's exact distribution given x (every tau, every residual)."""
    vocab, k, n = 4, 3, N
    # The drafter overrates token 0, so w_tau < 1 after accepted drafts, and the block rule's
    # residual (w p - q)+ differs from the token-wise (p - q)+.
    x = (0, 0, 0)
    ps = [torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)] * (k + 1)
    qs = [torch.tensor([0.6, 0.2, 0.1, 0.1], dtype=torch.float64)] * k
    expected = torch.zeros((k + 1) * vocab, dtype=torch.float64)
    for t, (prob, final) in enumerate(block_rule(ps, qs, x)):
        expected[t * vocab: (t + 1) * vocab] = prob * final
    if wrong_residual:  # the token-wise residual max(p - q, 0) at every tau
        original = block._sample_final
        monkeypatch.setattr(block, "_sample_final",
                            lambda p_, q_, ids, w, *rest: original(p_, q_, ids, torch.ones_like(w), *rest))
    target = torch.stack(ps).float().log().repeat(n, 1)
    out = rejection_sample(target, torch.tensor(x).repeat(n), torch.arange(n + 1) * k,
                           SamplingMetadata.from_params([SamplingParams()] * n, seeds=list(range(n))),
                           draft=DraftProbs(torch.stack(qs).float().repeat(n, 1)), verification="block")
    tau = out.num_accepted
    return chi_square(tau * vocab + out.token_ids[torch.arange(n), tau], expected)


def test_fixed_block_follows_the_rule_at_every_tau(monkeypatch) -> None:
    assert _fixed_block_outcomes(monkeypatch, wrong_residual=False).passed


def test_wrong_residual_fails_the_fixed_block_statistic(monkeypatch) -> None:
    """Power: the token-wise residual max(p - q, 0) after an accepted prefix is caught (it
    even draws a token the block rule never emits there, which chi_square asserts against)."""
    with pytest.raises(AssertionError):
        assert _fixed_block_outcomes(monkeypatch, wrong_residual=True).passed


def test_wrong_block_stopping_rule_fails_the_statistic(monkeypatch) -> None:
    """Power: the block rule stopping at the first failed test instead of the last passed one
    is caught."""
    monkeypatch.setattr(block, "_last_passed", lambda passed: passed.to(torch.int64).cumprod(dim=1).sum(dim=1) - 1)
    world = World(SamplingParams(), "uniform", seed=11)
    results = world.tests(N, sampler=block_sampler)
    assert not results["joint"].passed, results


# ---------------------------------------------------------------- seeds, greedy, K = 1, engine

def _batch(n: int, k: int, params: list[SamplingParams], seeds: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(n * (k + 1), 12, generator=g) * 2
    ids = torch.randint(0, 12, (n * k,), generator=g)
    probs = torch.rand(n * k, 12, generator=g).softmax(-1)
    sampling = SamplingMetadata.from_params(params, seeds=seeds)
    return target, ids, torch.arange(n + 1) * k, sampling, DraftProbs(probs)


def test_seeded_block_is_batch_invariant() -> None:
    n, k = 16, 4
    target, ids, cu, sampling, draft = _batch(n, k, [SamplingParams()] * n, list(range(n)))
    together = rejection_sample(target, ids, cu, sampling, draft=draft, verification="block").token_ids
    for b in (0, 5, 15):
        rows, drafts = slice(b * (k + 1), (b + 1) * (k + 1)), slice(b * k, (b + 1) * k)
        alone = rejection_sample(target[rows], ids[drafts], torch.tensor([0, k]),
                                 SamplingMetadata.from_params([SamplingParams()], seeds=[b]),
                                 draft=DraftProbs(draft.probs[drafts]), verification="block").token_ids
        assert alone[0].tolist() == together[b].tolist()


def test_block_with_k_one_is_token_wise_token_for_token() -> None:
    n = 2000
    target, ids, cu, sampling, draft = _batch(n, 1, [SamplingParams()] * n, list(range(n)), seed=1)
    token = rejection_sample(target, ids, cu, sampling, draft=draft)
    blocked = rejection_sample(target, ids, cu, sampling, draft=draft, verification="block")
    assert torch.equal(token.token_ids, blocked.token_ids)


@pytest.mark.parametrize("draft_kind", ["probs", "onehot"])
def test_greedy_block_equals_greedy_token_wise(draft_kind: str) -> None:
    n, k = 64, 4
    params = [SamplingParams(temperature=0) if b % 2 else SamplingParams() for b in range(n)]
    target, ids, cu, sampling, draft = _batch(n, k, params, list(range(n)), seed=2)
    # Drafts that often match the argmax, so greedy requests accept some.
    argmax = target.reshape(n, k + 1, -1)[:, :k].argmax(-1).reshape(-1)
    ids = torch.where(torch.arange(n * k) % 3 == 0, ids, argmax)
    draft = draft if draft_kind == "probs" else None
    token = rejection_sample(target, ids, cu, sampling, draft=draft)
    blocked = rejection_sample(target, ids, cu, sampling, draft=draft, verification="block")
    greedy = torch.arange(n) % 2 == 1
    assert torch.equal(token.token_ids[greedy], blocked.token_ids[greedy])
    assert int(token.num_accepted[greedy].sum()) > 0


def test_block_accepts_more_on_average_and_handles_ragged_k() -> None:
    g = torch.Generator().manual_seed(4)
    ks = torch.tensor([0, 3, 1, 5]).repeat(500)
    n = ks.numel()
    cu = torch.cat([torch.zeros(1, dtype=torch.long), ks.cumsum(0)])
    target = torch.randn(int(cu[-1]) + n, 8, generator=g)
    q = (target[torch.arange(int(cu[-1])) + torch.repeat_interleave(torch.arange(n), ks)]
         + torch.randn(int(cu[-1]), 8, generator=g)).softmax(-1)
    ids = torch.multinomial(q, 1, generator=g)[:, 0]
    sampling = SamplingMetadata.from_params([SamplingParams()] * n, seeds=list(range(n)))
    token = rejection_sample(target, ids, cu, sampling, draft=DraftProbs(q))
    blocked = rejection_sample(target, ids, cu, sampling, draft=DraftProbs(q), verification="block")
    assert bool((blocked.num_accepted <= ks).all()) and bool((blocked.num_accepted[ks == 0] == 0).all())
    assert float(blocked.num_accepted.float().mean()) > float(token.num_accepted.float().mean())


def test_bad_verification_is_a_named_error() -> None:
    target, ids, cu, sampling, draft = _batch(1, 1, [SamplingParams()], [0])
    with pytest.raises(ValueError, match="verification='chain'"):
        rejection_sample(target, ids, cu, sampling, draft=draft, verification="chain")
    with pytest.raises(ValueError, match="verification='chain'"):
        SpeculativeConfig(verification="chain")


def test_block_runs_natively_whatever_the_backend() -> None:
    """The kernels implement token-wise verification only: backend="triton" runs the same native
    block path (on CPU tensors too), while a bad backend name is still an error."""
    n, k = 8, 3
    target, ids, cu, sampling, draft = _batch(n, k, [SamplingParams()] * n, list(range(n)), seed=5)
    native = rejection_sample(target, ids, cu, sampling, draft=draft, verification="block", backend="native")
    triton = rejection_sample(target, ids, cu, sampling, draft=draft, verification="block", backend="triton")
    assert torch.equal(native.token_ids, triton.token_ids)
    with pytest.raises(ValueError, match="backend='cuda'"):
        rejection_sample(target, ids, cu, sampling, draft=draft, verification="block", backend="cuda")


def test_llm_passes_verification_to_its_config(tmp_path) -> None:
    # No model exists at the path: the config's message shows the keyword reached it first.
    with pytest.raises(ValueError, match="verification='chain' is invalid"):
        LLM(str(tmp_path / "missing"), verification="chain", progress=False)


def test_engine_greedy_block_equals_plain(monkeypatch) -> None:
    model = tiny_model(seed=0, scale=3.0)
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7], [9, 9, 9, 9, 9, 9]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def generate(spec: SpeculativeConfig, drafter) -> list[list[int]]:
        config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512,
                              cache=CacheConfig(4, 256), speculative=spec)
        engine = LLMEngine(model, word_tokenizer(model.config.vocab_size), config, drafter)
        ids = [engine.add_request(p, params) for p in prompts]
        done = run_all(engine)
        return [done[i].token_ids for i in ids]

    calls = []
    original = block.verify_block
    monkeypatch.setattr(block, "verify_block", lambda *args: calls.append(1) or original(*args))
    plain = generate(SpeculativeConfig(), None)
    assert not calls
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, verification="block")
    assert generate(spec, NgramDrafter(1, 3, 4)) == plain
    assert not calls  # plain greedy requests take the host rule (sample/greedy.py), the same
    params = dataclasses.replace(params, logprobs=0)  # through the sampler
    assert generate(spec, NgramDrafter(1, 3, 4)) == plain
    assert calls  # the engine verified with the block rule
