"""Deterministic cases, agreement with the reference oracle, seeding, and bad input."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from verispec import SamplingMetadata, SamplingParams
from verispec.sample import DraftLogits, DraftProbs, rejection_sample
from verispec.sample.reference import reference_rejection_sample

GREEDY = SamplingParams(temperature=0)


def one_hot_logits(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    """Rows whose argmax is the given token, with a clear margin."""
    rows = torch.zeros(len(tokens), vocab)
    rows[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return rows


def run(target, drafts: list[list[int]], params, draft=None, **kw):
    cu = torch.tensor([0] + [len(d) for d in drafts]).cumsum(0)
    ids = torch.tensor([t for d in drafts for t in d], dtype=torch.long)
    sampling = SamplingMetadata.from_params(params, seeds=kw.pop("seeds", None), steps=kw.pop("steps", None))
    return rejection_sample(target, ids, cu, sampling, draft=draft, **kw)


def test_greedy_all_accepted_emits_bonus() -> None:
    out = run(one_hot_logits([3, 5, 1]), [[3, 5]], [GREEDY])
    assert out.token_ids.tolist() == [[3, 5, 1]]
    assert out.num_accepted.tolist() == [2] and out.num_emitted.tolist() == [3]


def test_greedy_first_mismatch_emits_argmax_and_stops() -> None:
    out = run(one_hot_logits([3, 6, 1]), [[3, 5]], [GREEDY])
    assert out.token_ids.tolist() == [[3, 6, -1]]
    assert out.num_accepted.tolist() == [1]


def test_ragged_batch_with_k_zero_and_mixed_greedy_random() -> None:
    # Request 0: K=0 greedy; request 1: K=3 greedy rejected at position 2; request 2: K=1 random
    # whose target puts all its mass on the draft (always accepted) and on token 4 as bonus.
    target = torch.cat([
        one_hot_logits([2]),
        one_hot_logits([1, 1, 7, 0]),
        torch.full((2, 8), float("-inf")),
    ])
    target[5, 6] = 0.0
    target[6, 4] = 0.0
    out = run(target, [[], [1, 1, 3], [6]], [GREEDY, GREEDY, SamplingParams(seed=1)])
    assert out.token_ids.tolist() == [[2, -1, -1, -1], [1, 1, 7, -1], [6, 4, -1, -1]]
    assert out.num_emitted.tolist() == [1, 3, 2]


def test_draft_with_zero_target_probability_is_never_accepted() -> None:
    target = torch.zeros(2, 8)
    target[0, 3] = float("-inf")
    for seed in range(50):
        out = run(target, [[3]], [SamplingParams(seed=seed)], draft=DraftProbs(torch.full((1, 8), 1 / 8)))
        assert out.num_accepted.item() == 0 and out.token_ids[0, 0].item() != 3


@pytest.mark.parametrize("draft_kind", ["probs", "logits", "onehot"])
@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=0.6, top_k=5),
    SamplingParams(temperature=1.4, top_p=0.8, min_p=0.02),
    SamplingParams(guidance_scale=2.0),
    GREEDY,
])
def test_matches_reference_token_for_token(draft_kind: str, params: SamplingParams) -> None:
    g = torch.Generator().manual_seed(0)
    vocab, ks = 16, [0, 1, 4, 2, 3, 5] * 4
    drafts = [torch.randint(0, vocab, (k,), generator=g).tolist() for k in ks]
    d = sum(ks)
    target = torch.randn(d + len(ks), vocab, generator=g) * 2
    uncond = torch.randn(d + len(ks), vocab, generator=g) * 2
    probs = torch.softmax(torch.randn(d, vocab, generator=g), -1)
    draft_logits = torch.randn(d, vocab, generator=g)
    seeds = list(range(100, 100 + len(ks)))
    params_list = [params, SamplingParams(seed=5)] * (len(ks) // 2)  # mixed with a plain request
    if draft_kind == "logits":
        draft = DraftLogits(draft_logits)
        unguided = [dataclasses.replace(p, guidance_scale=1.0) for p in params_list]
        ref_q = torch.cat([_ref_probs_rows(draft_logits[a:b], p) for p, a, b in _spans(ks, unguided)])
    else:
        draft = DraftProbs(probs) if draft_kind == "probs" else None
        ref_q = probs if draft_kind == "probs" else None
    out = run(target, drafts, params_list, draft=draft, seeds=seeds, uncond_logits=uncond, steps=[3] * len(ks))
    expected = reference_rejection_sample(
        target, drafts, params_list, seeds, steps=[3] * len(ks), draft_probs=ref_q, uncond_logits=uncond
    )
    got = [row[:n].tolist() for row, n in zip(out.token_ids, out.num_emitted.tolist())]
    assert got == expected


def _spans(ks, params):
    start = 0
    for k, p in zip(ks, params):
        yield p, start, start + k
        start += k


def _ref_probs_rows(rows: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    from verispec.sample.reference import reference_probs

    return torch.stack([reference_probs(r, p) for r in rows]) if rows.shape[0] else rows.double()


def test_placeholders_follow_the_emitted_tokens() -> None:
    g = torch.Generator().manual_seed(1)
    ks = [0, 3, 1, 5]
    target = torch.randn(sum(ks) + 4, 10, generator=g)
    drafts = [torch.randint(0, 10, (k,), generator=g).tolist() for k in ks]
    out = run(target, drafts, [SamplingParams()] * 4)
    assert out.token_ids.shape == (4, 6)
    for row, n in zip(out.token_ids.tolist(), out.num_emitted.tolist()):
        assert all(t >= 0 for t in row[:n]) and all(t == -1 for t in row[n:])


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    g = torch.Generator().manual_seed(2)
    vocab = 50
    mine_target = torch.randn(4, vocab, generator=g)
    mine_drafts = [1, 2, 3]
    probs = torch.softmax(torch.randn(3, vocab, generator=g), -1)
    params = SamplingParams(seed=1234, temperature=1.2)
    alone = run(mine_target, [mine_drafts], [params], draft=DraftProbs(probs), steps=[7])
    for other_k in (0, 2, 6):
        others = torch.randn(other_k + 1, vocab, generator=g)
        other_probs = torch.softmax(torch.randn(other_k, vocab, generator=g), -1)
        batch = run(
            torch.cat([others, mine_target]),
            [list(range(other_k)), mine_drafts],
            [SamplingParams(), params],
            draft=DraftProbs(torch.cat([other_probs, probs])),
            steps=[0, 7],
        )
        n = alone.num_emitted.item()
        assert batch.token_ids[1, :n].tolist() == alone.token_ids[0, :n].tolist()


def test_steps_and_seeds_change_the_stream() -> None:
    target = torch.zeros(1000, 32)  # uniform rows, K = 0
    cu = torch.zeros(1001, dtype=torch.long)
    ids = torch.zeros(0, dtype=torch.long)

    def draw(seed: int, step: int) -> list[int]:
        sampling = SamplingMetadata.from_params([SamplingParams(seed=seed + i) for i in range(1000)], steps=[step] * 1000)
        return rejection_sample(target, ids, cu, sampling).token_ids[:, 0].tolist()

    assert draw(0, 0) == draw(0, 0)
    assert draw(0, 0) != draw(0, 1)
    assert draw(0, 0) != draw(5000, 0)


def test_unseeded_requests_draw_fresh_seeds() -> None:
    target = torch.zeros(200, 32)
    cu = torch.zeros(201, dtype=torch.long)
    ids = torch.zeros(0, dtype=torch.long)
    first, second = (
        rejection_sample(target, ids, cu, SamplingMetadata.from_params([SamplingParams()] * 200)).token_ids
        for _ in range(2)
    )
    assert first.tolist() != second.tolist()


def _valid_inputs():
    target = torch.zeros(5, 8)
    ids = torch.tensor([1, 2, 3])
    cu = torch.tensor([0, 1, 3])
    sampling = SamplingMetadata.from_params([SamplingParams(), SamplingParams()])
    return target, ids, cu, sampling


@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.update(target=torch.zeros(4, 8)), "target_logits has shape"),
    (lambda a: a.update(target=torch.zeros(5, 8, dtype=torch.long)), "target_logits has dtype"),
    (lambda a: a["target"].__setitem__((2, 3), float("nan")), "target_logits row 2 contains NaN"),
    (lambda a: a["target"].__setitem__((1, 0), float("inf")), r"target_logits row 1 contains NaN or \+inf"),
    (lambda a: a["target"].__setitem__(3, float("-inf")), "target_logits row 3 is all -inf"),
    (lambda a: a.update(ids=torch.tensor([1, 8, 3])), r"draft_token_ids contains token id 8: expected ids in \[0, 8\)"),
    (lambda a: a.update(ids=torch.tensor([1, -2, 3])), "draft_token_ids contains token id -2"),
    (lambda a: a.update(ids=torch.tensor([1.0, 2.0, 3.0])), "draft_token_ids has dtype"),
    (lambda a: a.update(cu=torch.tensor([0, 2, 1])), "cu_num_draft_tokens=.*expected a leading 0"),
    (lambda a: a.update(cu=torch.tensor([0, 3])), r"cu_num_draft_tokens has shape \(2,\): expected \(3,\)"),
    (lambda a: a.update(draft=DraftProbs(torch.full((3, 8), 0.2))), "draft.probs row 0 sums to 1.6"),
    (lambda a: a.update(draft=DraftProbs(torch.full((2, 8), 0.125))), "draft.probs has shape"),
    (lambda a: a.update(draft=DraftLogits(torch.full((3, 8), float("nan")))), "draft.logits row 0 contains NaN"),
    (lambda a: a.update(draft=torch.zeros(3, 8)), "draft is Tensor: expected DraftProbs"),
    (lambda a: a.update(sampling=SamplingMetadata.from_params([SamplingParams(guidance_scale=2)] * 2)), "uncond_logits is None"),
])
def test_bad_input_names_the_argument(mutate, match) -> None:
    target, ids, cu, sampling = _valid_inputs()
    args = dict(target=target, ids=ids, cu=cu, sampling=sampling, draft=None)
    mutate(args)
    with pytest.raises((ValueError, TypeError), match=match):
        rejection_sample(args["target"], args["ids"], args["cu"], args["sampling"], draft=args["draft"])


@pytest.mark.parametrize("backend", ["native", pytest.param("triton", marks=pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"))])
@pytest.mark.parametrize("vocab", [8, 128_256] if torch.cuda.is_available() else [8])
def test_garbage_without_validation_never_emits_out_of_range_ids(backend: str, vocab: int) -> None:
    """NaN / +-inf rows, NaN draft rows and out-of-range draft ids, unvalidated: every emitted id
    stays in [0, V) and placeholders follow, on every backend (on the GPU where there is one)."""
    g = torch.Generator().manual_seed(4)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = torch.randn(11, vocab, generator=g)
    target[0] = float("nan")
    target[4] = float("-inf")
    target[7, 2] = float("inf")
    uncond = target.flip(0)
    ids = torch.tensor([vocab + 1, -3, 2, 5, vocab + 92, 1, 0, 3])
    cu = torch.tensor([0, 2, 5, 8])
    nan_rows = torch.full((8, vocab), float("nan"))
    for params in (SamplingParams(), GREEDY, SamplingParams(top_k=3, top_p=0.5, min_p=0.1, guidance_scale=2.0)):
        for draft in (None, DraftProbs(nan_rows), DraftLogits(nan_rows)):
            sampling = SamplingMetadata.from_params([params] * 3, seeds=[1, 2, 3], device=device)
            draft = None if draft is None else type(draft)(*(t.to(device) for t in draft))
            out = rejection_sample(target.to(device), ids.to(device), cu.to(device), sampling, draft=draft,
                                   uncond_logits=uncond.to(device), validate=False, max_num_draft_tokens=3,
                                   backend=backend)
            for row, n in zip(out.token_ids.tolist(), out.num_emitted.tolist()):
                assert all(0 <= t < vocab for t in row[:n]) and all(t == -1 for t in row[n:]), out.token_ids
