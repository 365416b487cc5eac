"""The float32 product each row count runs on this machine: measured once, cached per CPU model,
torch version and thread count, or forced by VERISPEC_FP32_PRODUCT."""

from __future__ import annotations

import json

import pytest
import torch

from verispec.model.linear import _time_product
from verispec.model.product_choice import ROW_COUNTS, ProductChoice, measure, product_choice


def timings(skinny_up_to: int):
    """A fake clock: the skinny product is faster up to `skinny_up_to` rows; calls counted."""
    calls = []

    def seconds(kind: str, rows: int) -> float:
        calls.append((kind, rows))
        return 1.0 if (kind == "skinny") == (rows <= skinny_up_to) else 2.0
    return seconds, calls


def test_each_row_count_takes_the_faster_product() -> None:
    seconds, _ = timings(skinny_up_to=4)
    choice = measure(seconds)
    assert choice.skinny == tuple(r <= 4 for r in ROW_COUNTS)
    assert [choice.use_skinny(r) for r in (1, 3, 4, 5, 8, 64, 65)] == \
        [True, True, True, False, False, False, False]
    seconds, _ = timings(skinny_up_to=0)  # an Intel-like machine: F.linear everywhere
    assert not any(measure(seconds).skinny)


def test_the_measurement_is_cached_per_machine(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VERISPEC_FP32_PRODUCT", raising=False)
    seconds, calls = timings(skinny_up_to=16)
    first = product_choice(seconds, (8, 4))
    assert calls and first.skinny == tuple(r <= 16 for r in ROW_COUNTS)
    saved = json.loads((tmp_path / "cpu-products.json").read_text())
    (key, value), = saved.items()
    assert "torch" in key and "threads" in key and key.endswith("8x4")
    assert value == list(first.skinny)
    assert product_choice(timings(skinny_up_to=0)[0], (8, 5)) != first  # another shape: its own

    def never(kind: str, rows: int) -> float:
        raise AssertionError("measured again")
    assert product_choice(never, (8, 4)) == first
    (tmp_path / "cpu-products.json").write_text("{damaged")
    seconds, calls = timings(skinny_up_to=2)
    assert product_choice(seconds, (8, 4)).skinny == tuple(r <= 2 for r in ROW_COUNTS) and calls


def test_the_choice_can_be_forced(monkeypatch) -> None:
    def never(kind: str, rows: int) -> float:
        raise AssertionError("measured")
    monkeypatch.setenv("VERISPEC_FP32_PRODUCT", "linear")
    assert product_choice(never, (8, 4)) == ProductChoice((False,) * len(ROW_COUNTS))
    monkeypatch.setenv("VERISPEC_FP32_PRODUCT", "skinny")
    assert product_choice(never, (8, 4)).use_skinny(64)
    monkeypatch.setenv("VERISPEC_FP32_PRODUCT", "fast")
    with pytest.raises(ValueError, match="VERISPEC_FP32_PRODUCT='fast' is invalid: expected "
                                         "'skinny' or 'linear'"):
        product_choice(never, (8, 4))


def test_timing_the_products_leaves_the_callers_random_stream_alone() -> None:
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    assert _time_product((8, 4), "skinny", 2) > 0 and _time_product((8, 4), "linear", 2) > 0
    assert torch.equal(torch.rand(3), expected)
