"""Rows split across programs (verispec/sample/kernels/split_rows.py) against one program per
row and against the native pipeline.

Without a GPU the interpreter never splits rows on its own (tiles.split_tiles), so these tests
force splits of a few columns each, and few pivots, so that every search takes several passes
and every fold combines several splits. Argmax, row maximum and top-k thresholds combine
exactly and must be equal; masses are float sums in another order, equal to rounding; and a
search cut short must fail the same comparison.
"""

from __future__ import annotations

import pytest
import torch

from verispec import SamplingMetadata, SamplingParams
from verispec.sample.processors import process_logits

from .test_triton import DEVICE, MIXED_PARAMS, _both, _poison, _random_batch, needs_triton, on_device

PARAMS = [
    SamplingParams(temperature=0.6, top_k=5),
    SamplingParams(temperature=1.4, top_p=0.8, min_p=0.02),
    SamplingParams(guidance_scale=-0.5, top_k=3, top_p=0.6),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.95),
    SamplingParams(),
    SamplingParams(temperature=0),
]


def _small_batch(seed: int, vocab: int, dtype: torch.dtype = torch.float32) -> dict:
    """test_triton's _random_batch with fewer requests: every split run is many launches, and
    the interpreter runs each program one after another."""
    return _random_batch(seed, vocab, dtype, ks=(0, 2, 1, 3, 1, 2))


def _force_split(monkeypatch: pytest.MonkeyPatch, splits: int, block_v: int = 8, num_pivots: int = 8,
                 max_passes: int | None = None) -> None:
    from verispec.sample.kernels import tiles

    def split(num_rows, vocab, device):
        shape = tiles.split_shape(vocab, splits, block_v, num_pivots)
        return shape if max_passes is None else shape._replace(max_passes=max_passes)

    monkeypatch.setattr(tiles, "split_tiles", split)


def _stats(vocab: int, seed: int = 0, dtype: torch.dtype = torch.float32):
    """row_stats of a ragged batch's target rows, its requests cycling through PARAMS."""
    from verispec.sample.kernels.row_stats import row_stats

    batch = _small_batch(seed, vocab, dtype)
    n = batch["n"]
    sampling = SamplingMetadata.from_params((PARAMS * n)[:n], seeds=range(n))
    return row_stats(batch["target"].to(DEVICE), batch["uncond"].to(DEVICE), batch["ids"].to(DEVICE),
                     batch["cu"].to(DEVICE), on_device(sampling), is_target=True)


def _differences(split, whole) -> list[str]:
    """What differs between two RowStats beyond the rounding of float sums."""
    wrong = [name for name in ("row_max", "threshold", "argmax") if not torch.equal(getattr(split, name),
                                                                                 getattr(whole, name))]
    for name in ("lse", "gathered"):
        if not torch.allclose(getattr(split, name), getattr(whole, name), rtol=1e-5, atol=1e-7):
            wrong.append(name)
    return wrong


@needs_triton
def test_split_rows_equal_one_program_per_row(monkeypatch: pytest.MonkeyPatch) -> None:
    whole = _stats(48)
    _poison(monkeypatch)
    _force_split(monkeypatch, 3)
    split = _stats(48)
    assert _differences(split, whole) == []
    assert torch.equal(_stats(48).lse, split.lse)  # the same launches, the same bits


@needs_triton
def test_a_split_search_cut_short_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above has the power to see a search that stops before it settles."""
    whole = _stats(48)
    _force_split(monkeypatch, 3, max_passes=1)
    assert "threshold" in _differences(_stats(48), whole)


@needs_triton
def test_split_kept_sets_and_normalisers_match_the_native_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    """As test_triton's kept-set test, rows split: each request drafts every token of its
    repeated row once, and integer logits put ties at every filter boundary."""
    from verispec.sample.kernels.row_stats import row_stats

    _poison(monkeypatch)
    _force_split(monkeypatch, 2, block_v=4)
    g = torch.Generator().manual_seed(5)
    vocab = 8
    params = [SamplingParams(temperature=0.8, top_k=k, top_p=p, min_p=m, guidance_scale=s)
              for k, p, m, s in [(3, 1.0, 0.0, 1.0), (5, 0.7, 0.0, 1.0), (4, 0.9, 0.1, 2.0),
                                 (None, 0.3, 0.05, 1.5)]]
    n = len(params)
    rows = torch.randint(-3, 4, (n, vocab), generator=g).float()
    uncond_rows = torch.randint(-3, 4, (n, vocab), generator=g).float()
    sampling = SamplingMetadata.from_params(params)
    stats = row_stats(
        rows.repeat_interleave(vocab + 1, dim=0).to(DEVICE), uncond_rows.repeat_interleave(vocab + 1, dim=0).to(DEVICE),
        torch.arange(vocab).repeat(n).to(DEVICE), (torch.arange(n + 1) * vocab).to(DEVICE), on_device(sampling),
        is_target=True,
    )
    got = stats.gathered.cpu().reshape(n, vocab)
    expected = process_logits(rows, torch.arange(n), sampling, uncond_rows).softmax(-1)
    assert torch.equal(got > 0, expected > 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


@needs_triton
def test_split_rows_change_no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole verification, draft logit rows split too: the same decisions and tokens."""
    batch = _small_batch(1, 40, torch.bfloat16)
    _, _, whole = _both(batch, "logits", MIXED_PARAMS)
    _poison(monkeypatch)
    _force_split(monkeypatch, 4)
    _, native, split = _both(batch, "logits", MIXED_PARAMS)
    assert torch.equal(split.token_ids, whole.token_ids)
    assert torch.equal(split.num_accepted, whole.num_accepted)
    assert split.num_accepted.cpu().tolist() == native.num_accepted.tolist()
