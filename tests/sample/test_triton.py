"""The Triton path against the contract of the native path (docs/design.md, "Tests").

On CUDA the kernels run compiled; without a GPU they run under the Triton interpreter (see
tests/conftest.py) at V = 6: a representative subset of the chi-square suite, covering every
draft kind, temperature, top-k, top-p, min-p, CFG and greedy, at the suite's 100,000 draws.
Beyond exactness: acceptance decisions and greedy outputs equal the native path's token for
token; every kept set and normaliser equals the native pipeline's, ties included; buffers are
poisoned before each run; a race split across programs picks the same tokens; garbage never
yields an out-of-range token; seeded requests are batch invariant. Dispatch tests need no triton.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verispec import SamplingMetadata, SamplingParams
from verispec.sample import DraftLogits, DraftProbs, rejection_sample, rejection_sample_probs
from verispec.sample import rejection
from verispec.sample.processors import process_logits

from ..stats import chi_square
from .harness import V, World

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# A real vocabulary (Llama 3's) where the kernels run compiled; the interpreter keeps to small ones.
VOCABS = [16, 128_256] if DEVICE.type == "cuda" else [16]
N = 100_000
GREEDY = SamplingParams(temperature=0)


def needs_triton(test):
    """Skips without triton. Under the interpreter numpy warns about the -inf arithmetic that
    masked tokens go through; the warnings say nothing about the results."""
    test = pytest.mark.filterwarnings("ignore::RuntimeWarning")(test)
    return pytest.mark.skipif(not rejection._triton_importable(), reason="triton is not installed")(test)


def on_device(sampling: SamplingMetadata) -> SamplingMetadata:
    moved = {
        f.name: getattr(sampling, f.name).to(DEVICE)
        for f in dataclasses.fields(sampling)
        if isinstance(getattr(sampling, f.name), torch.Tensor)
    }
    return dataclasses.replace(sampling, **moved)


def draft_on_device(draft):
    """DraftProbs / DraftLogits (one-field tuples) or None, moved to DEVICE."""
    return None if draft is None else type(draft)(*(t.to(DEVICE) for t in draft))


def triton_verify(target, ids, cu, sampling, draft=None, uncond=None, **kw):
    return rejection_sample(
        target.to(DEVICE), ids.to(DEVICE), cu.to(DEVICE), on_device(sampling),
        draft=draft_on_device(draft), uncond_logits=None if uncond is None else uncond.to(DEVICE),
        backend="triton", **kw,
    )


def triton_sampler(target, ids, cu, sampling, draft, uncond) -> torch.Tensor:
    return triton_verify(target, ids, cu, sampling, draft, uncond).token_ids.cpu()


CASES = [
    (SamplingParams(), "uniform"),
    (SamplingParams(), "disjoint"),
    (SamplingParams(), "same"),
    (SamplingParams(), "onehot"),
    (SamplingParams(temperature=0.3), "logits"),
    (SamplingParams(temperature=1.7), "overconfident"),
    (SamplingParams(top_k=3), "disjoint"),
    (SamplingParams(top_k=3), "logits"),
    (SamplingParams(top_p=0.7), "onehot"),
    (SamplingParams(min_p=0.2), "logits"),
    (SamplingParams(temperature=0.7, top_k=4, top_p=0.8, min_p=0.05), "logits"),
    (SamplingParams(guidance_scale=3.0), "same"),
    (SamplingParams(guidance_scale=1.5), "logits"),
    (SamplingParams(guidance_scale=3.0, temperature=0.7, top_p=0.9), "overconfident"),
    (GREEDY, "uniform"),
]


@needs_triton
@pytest.mark.parametrize(
    "params,kind", CASES,
    ids=[f"{kind}-{p.temperature}-{p.top_k}-{p.top_p}-{p.min_p}-{p.guidance_scale}" for p, kind in CASES],
)
def test_emitted_tokens_follow_target(params: SamplingParams, kind: str) -> None:
    world = World(params, kind, seed=len(kind) + int(params.temperature * 10))
    for name, result in world.tests(N, sampler=triton_sampler).items():
        assert result.passed, f"{name}: {result}"


def _probs_sampler(target, ids, cu, sampling, draft, uncond) -> torch.Tensor:
    """Probabilities in: the world's rows softmaxed, K = 2 (K = 0 for the draft-free step)."""
    n = sampling.batch_size
    k = ids.numel() // n
    probs = target.softmax(-1).reshape(n, k + 1, V)
    draft_probs = draft.probs.reshape(n, k, V) if k else torch.zeros(n, 0, V)
    out = rejection_sample_probs(
        draft_probs.to(DEVICE), ids.reshape(n, k).to(DEVICE), probs.to(DEVICE),
        sampling.keys.to(DEVICE), backend="triton",
    )
    return out.token_ids.cpu()


@needs_triton
@pytest.mark.parametrize("kind", ["uniform", "disjoint"])
def test_probabilities_in_follow_target(kind: str) -> None:
    world = World(SamplingParams(), kind, seed=21)
    for name, result in world.tests(N, sampler=_probs_sampler).items():
        assert result.passed, f"{name}: {result}"


@needs_triton
@pytest.mark.parametrize("vocab", VOCABS[1:])
@pytest.mark.parametrize("dtype,params", [
    (torch.float32, SamplingParams()),
    (torch.bfloat16, SamplingParams(temperature=0.8, top_k=50, top_p=0.9)),
], ids=["float32-plain", "bfloat16-top-k50-top-p0.9"])
def test_first_token_follows_target_at_a_real_vocabulary(vocab: int, dtype: torch.dtype,
                                                         params: SamplingParams) -> None:
    """Compiled kernels only: N requests share one target row set and a broad drafter q, K = 2;
    the first emitted token must follow the target's processed distribution p (chi-square,
    false alarm 1e-6; the tail of tiny-probability tokens merged into one bin). The drafted
    tokens themselves, distributed as q, fail the same test: it has the power to see a wrong
    residual."""
    g = torch.Generator(device=DEVICE).manual_seed(3)
    chunk, k = 4096, 2
    target_rows = (torch.randn(k + 1, vocab, device=DEVICE, generator=g) * 2.5).to(dtype)
    q = torch.softmax(torch.randn(k, vocab, device=DEVICE, generator=g) * 2.5, -1)
    target = target_rows.repeat(chunk, 1)  # [chunk * (K + 1), V]
    draft = DraftProbs(q.repeat(chunk, 1))
    cu = torch.arange(chunk + 1, device=DEVICE) * k
    first, drafted = [], []
    for start in range(0, N, chunk):
        ids = torch.multinomial(q, chunk, replacement=True, generator=g).t().reshape(-1)  # [chunk * K]
        sampling = SamplingMetadata.from_params([params] * chunk, seeds=range(start, start + chunk), device=DEVICE)
        out = rejection_sample(target, ids, cu, sampling, draft=draft, max_num_draft_tokens=k, backend="triton",
                               validate=False)
        first.append(out.token_ids[:, 0].cpu())
        drafted.append(ids.reshape(chunk, k)[:, 0].cpu())
    first, drafted = torch.cat(first)[:N], torch.cat(drafted)[:N]
    one = SamplingMetadata.from_params([params])
    p = process_logits(target_rows[:1].float().cpu(), torch.zeros(1, dtype=torch.long), one).double().softmax(-1)[0]
    result = chi_square(first, p)
    assert result.passed, result
    assert not _follows(drafted, p)


def _follows(samples: torch.Tensor, probs: torch.Tensor) -> bool:
    """chi_square's verdict, False also where a sample has probability 0 (it asserts then)."""
    try:
        return chi_square(samples, probs).passed
    except AssertionError:
        return False


def _random_batch(seed: int, vocab: int = 16, dtype: torch.dtype = torch.float32,
                  ks: tuple[int, ...] = (0, 1, 4, 2, 3, 5) * 4):
    """Ragged K (0 included; `ks` per request), random logits, draft probabilities and draft logits."""
    g = torch.Generator().manual_seed(seed)
    d, n = sum(ks), len(ks)
    return dict(
        target=(torch.randn(d + n, vocab, generator=g) * 2).to(dtype),
        uncond=(torch.randn(d + n, vocab, generator=g) * 2).to(dtype),
        ids=torch.randint(0, vocab, (d,), generator=g),
        cu=torch.tensor([0, *ks]).cumsum(0),
        probs=torch.softmax(torch.randn(d, vocab, generator=g), -1),
        draft_logits=(torch.randn(d, vocab, generator=g) * 2).to(dtype),
        n=n,
    )


def _draft(batch: dict, kind: str):
    if kind == "onehot":
        return None
    return DraftProbs(batch["probs"]) if kind == "probs" else DraftLogits(batch["draft_logits"])


PARAMS = {
    "plain": SamplingParams(),
    "top-k": SamplingParams(temperature=0.6, top_k=5),
    "top-p-min-p": SamplingParams(temperature=1.4, top_p=0.8, min_p=0.02),
    "cfg-min-p": SamplingParams(guidance_scale=2.0, min_p=0.1),
    "negative-cfg-top-k-top-p": SamplingParams(guidance_scale=-0.5, top_k=3, top_p=0.6),
    "greedy": GREEDY,
    "greedy-cfg": SamplingParams(temperature=0, guidance_scale=2.0),
}
MIXED_PARAMS = list(PARAMS.values())


def _both(batch: dict, kind: str, params: list[SamplingParams], steps: int = 3):
    """Native and Triton outputs on the batch, its requests cycling through params."""
    n = batch["n"]
    params = (params * n)[:n]
    sampling = SamplingMetadata.from_params(params, seeds=list(range(100, 100 + n)), steps=[steps] * n)
    args = (batch["target"], batch["ids"], batch["cu"], sampling)
    native = rejection_sample(*args, draft=_draft(batch, kind), uncond_logits=batch["uncond"], backend="native")
    fast = triton_verify(*args, draft=_draft(batch, kind), uncond=batch["uncond"])
    return sampling, native, fast


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["onehot", "probs", "logits"])
@pytest.mark.parametrize("name", [*PARAMS, "mixed"])
@pytest.mark.parametrize("vocab", VOCABS)
def test_decisions_and_greedy_tokens_match_native(name: str, kind: str, dtype: torch.dtype, vocab: int) -> None:
    batch = _random_batch(0, vocab, dtype)
    sampling, native, fast = _both(batch, kind, MIXED_PARAMS if name == "mixed" else [PARAMS[name]])
    assert fast.num_accepted.cpu().tolist() == native.num_accepted.tolist()
    assert torch.equal(fast.num_emitted.cpu(), native.num_accepted + 1)
    for b, n in enumerate(native.num_accepted.tolist()):
        assert fast.token_ids[b, :n].cpu().tolist() == native.token_ids[b, :n].tolist()
        assert set(fast.token_ids[b, n + 1 :].tolist()) <= {-1}
        if sampling.is_greedy[b]:
            assert int(fast.token_ids[b, n]) == int(native.token_ids[b, n])


@needs_triton
def test_kept_sets_and_normalisers_match_the_native_pipeline() -> None:
    """Each request repeats one row and drafts every token of the vocabulary once on it, so the
    p(x) that row_stats gathers are that row's whole distribution; integer logits put ties at
    every filter boundary."""
    from verispec.sample.kernels.row_stats import row_stats

    g = torch.Generator().manual_seed(5)
    vocab, n = 12, 40
    params = [
        SamplingParams(temperature=0.8, top_k=k, top_p=p, min_p=m, guidance_scale=s)
        for k, p, m, s in [(3, 1.0, 0.0, 1.0), (5, 0.7, 0.0, 1.0), (None, 0.5, 0.0, 1.0), (None, 1.0, 0.3, 1.0),
                           (4, 0.9, 0.1, 2.0), (1, 1.0, 0.0, 1.0), (12, 0.95, 0.0, 0.5), (None, 0.3, 0.05, 1.5)]
    ] * (n // 8)
    rows = torch.randint(-3, 4, (n, vocab), generator=g).float()
    uncond_rows = torch.randint(-3, 4, (n, vocab), generator=g).float()
    target = rows.repeat_interleave(vocab + 1, dim=0)
    uncond = uncond_rows.repeat_interleave(vocab + 1, dim=0)
    ids = torch.arange(vocab).repeat(n)
    cu = torch.arange(n + 1) * vocab
    sampling = SamplingMetadata.from_params(params)
    stats = row_stats(
        target.to(DEVICE), uncond.to(DEVICE), ids.to(DEVICE), cu.to(DEVICE), on_device(sampling), is_target=True
    )
    got = stats.gathered.cpu().reshape(n, vocab)
    expected = process_logits(rows, torch.arange(n), sampling, uncond_rows).softmax(-1)
    assert torch.equal(got > 0, expected > 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def _poison(monkeypatch: pytest.MonkeyPatch) -> None:
    from verispec.sample.kernels import tiles

    def poisoned(shape, dtype, device):
        value = float("nan") if dtype.is_floating_point else 7_777_777
        return torch.full(shape if isinstance(shape, tuple) else (shape,), value, dtype=dtype, device=device)

    monkeypatch.setattr(tiles, "empty", poisoned)


def _split_races(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forces the final-row race across several programs (as on a GPU with few requests)."""
    from verispec.sample.kernels import tiles

    def split(batch, vocab, device, racing):
        # At most 8 splits: a real vocabulary cut into 4-column splits (32,064 racing programs) ran
        # past two minutes on an H100 without testing anything the 8 splits do not.
        block_v = 4 if vocab <= 64 else 256
        width = -(-vocab // (8 * block_v)) * block_v
        return tiles.RequestTiles(requests=8, block_v=block_v, num_splits=-(-vocab // width),
                                  split_width=width, num_warps=4)

    monkeypatch.setattr(tiles, "request_tiles", split)


@needs_triton
@pytest.mark.parametrize("kind", ["onehot", "probs", "logits"])
@pytest.mark.parametrize("vocab", VOCABS)
def test_poisoned_buffers_and_split_races_change_nothing(kind: str, vocab: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    batch = _random_batch(1, vocab)
    _, _, clean = _both(batch, kind, MIXED_PARAMS)
    _poison(monkeypatch)
    _, _, poisoned = _both(batch, kind, MIXED_PARAMS)
    _split_races(monkeypatch)
    _, _, split = _both(batch, kind, MIXED_PARAMS)
    for out in (poisoned, split):
        assert torch.equal(out.token_ids, clean.token_ids)
        assert torch.equal(out.num_accepted, clean.num_accepted)
        assert torch.equal(out.num_emitted, clean.num_emitted)


@needs_triton
def test_probabilities_in_match_native_decisions(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(8)
    b, k, vocab = 64, 3, 16
    target = torch.softmax(torch.randn(b, k + 1, vocab, generator=g) * 2, -1)
    draft = torch.softmax(torch.randn(b, k, vocab, generator=g), -1)
    ids = torch.randint(0, vocab, (b, k), generator=g)
    keys = torch.randint(-(2**63), 2**63 - 1, (b,), generator=g)
    native = rejection_sample_probs(draft, ids, target, keys, backend="native")
    _poison(monkeypatch)
    fast = rejection_sample_probs(
        draft.to(DEVICE), ids.to(DEVICE), target.to(DEVICE), keys.to(DEVICE), backend="triton"
    )
    assert torch.equal(fast.num_accepted.cpu(), native.num_accepted)
    slot = torch.arange(k + 1)[None, :]
    accepted = slot < native.num_accepted[:, None]
    assert torch.equal(fast.token_ids.cpu()[accepted], native.token_ids[accepted])
    final = fast.token_ids.cpu()[slot == native.num_accepted[:, None]]
    assert bool(((final >= 0) & (final < vocab)).all())
    assert bool((fast.token_ids.cpu()[slot > native.num_accepted[:, None]] == -1).all())


@needs_triton
@pytest.mark.parametrize("vocab", [50, *VOCABS[1:]])
def test_same_seed_same_tokens_whatever_the_batch(vocab: int) -> None:
    g = torch.Generator().manual_seed(2)
    mine_target = torch.randn(4, vocab, generator=g)
    mine_logits = torch.randn(3, vocab, generator=g)
    mine_drafts = torch.tensor([1, 2, 3])
    params = SamplingParams(seed=1234, temperature=1.2, top_k=20, top_p=0.9)
    alone = triton_verify(
        mine_target, mine_drafts, torch.tensor([0, 3]),
        SamplingMetadata.from_params([params], steps=[7]), DraftLogits(mine_logits),
    )
    n = int(alone.num_emitted)
    for other_k in (0, 2, 6):
        others = torch.randn(other_k + 1, vocab, generator=g)
        other_logits = torch.randn(other_k, vocab, generator=g)
        batch = triton_verify(
            torch.cat([others, mine_target]),
            torch.cat([torch.arange(other_k), mine_drafts]),
            torch.tensor([0, other_k, other_k + 3]),
            SamplingMetadata.from_params([SamplingParams(min_p=0.1), params], steps=[0, 7]),
            DraftLogits(torch.cat([other_logits, mine_logits])),
        )
        assert batch.token_ids[1, :n].tolist() == alone.token_ids[0, :n].tolist()


# Dispatch: these need no triton.


@pytest.fixture
def fresh_default_backend(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(rejection.BACKEND_ENV, raising=False)
    rejection.default_backend.cache_clear()
    yield
    rejection.default_backend.cache_clear()


@pytest.mark.usefixtures("fresh_default_backend")
def test_default_backend_is_decided_once_per_device_type(monkeypatch: pytest.MonkeyPatch) -> None:
    assert rejection.default_backend("cpu") == "native"
    monkeypatch.setenv(rejection.BACKEND_ENV, "triton")
    assert rejection.default_backend("cpu") == "native"  # cached: the environment is read once
    rejection.default_backend.cache_clear()
    assert rejection.default_backend("cpu") == "triton"
    monkeypatch.setenv(rejection.BACKEND_ENV, "cuda")
    rejection.default_backend.cache_clear()
    with pytest.raises(ValueError, match=r"VERISPEC_SAMPLER_BACKEND='cuda' is invalid"):
        rejection.default_backend("cpu")
    monkeypatch.delenv(rejection.BACKEND_ENV)
    monkeypatch.setattr(rejection, "_triton_importable", lambda: True)
    rejection.default_backend.cache_clear()
    assert rejection.default_backend("cuda") == "triton"
    monkeypatch.setattr(rejection, "_triton_importable", lambda: False)
    rejection.default_backend.cache_clear()
    assert rejection.default_backend("cuda") == "native"


def test_backend_argument_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    target, ids, cu = torch.zeros(3, 8), torch.tensor([1]), torch.tensor([0, 1, 1])
    sampling = SamplingMetadata.from_params([SamplingParams()] * 2)
    with pytest.raises(ValueError, match=r"backend='gpu' is invalid: expected one of \('native', 'triton'\)"):
        rejection_sample(target, ids, cu, sampling, backend="gpu")
    monkeypatch.setattr(rejection, "_triton_importable", lambda: False)
    with pytest.raises(ValueError, match="backend='triton' is unavailable"):
        rejection_sample(target, ids, cu, sampling, backend="triton")
    assert rejection_sample(target, ids, cu, sampling, backend="native").token_ids.shape == (2, 2)

