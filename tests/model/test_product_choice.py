"""The float32 product each row count runs on this machine: measured once, cached per CPU model,
torch version and thread count, or forced by VERISPEC_FP32_PRODUCT."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from verispec.model.linear import _time_product, fp32_kinds
from verispec.model.product_choice import (COMPILED_MAX_ROWS, KINDS, ROW_COUNTS, ProductChoice,
                                           measure, product_choice)


def timings(fastest: dict[int, str]):
    """A fake clock: the product fastest[r] takes 1 s at up to r rows (the smallest key >= rows),
    the others 2 s; calls counted."""
    calls = []

    def seconds(kind: str, rows: int) -> float:
        calls.append((kind, rows))
        best = next((k for r, k in sorted(fastest.items()) if rows <= r), "linear")
        return 1.0 if kind == best else 2.0
    return seconds, calls


def test_each_row_count_takes_the_fastest_product() -> None:
    seconds, calls = timings({2: "compiled", 16: "skinny"})
    choice = measure(seconds, KINDS)
    assert choice.kinds == tuple("compiled" if r <= 2 else "skinny" if r <= 16 else "linear"
                                 for r in ROW_COUNTS)
    assert [choice.kind(r) for r in (1, 2, 3, 16, 17, 64, 65)] == \
        ["compiled", "compiled", "skinny", "skinny", "linear", "linear", "linear"]
    # The compiled product is not timed where it cannot win (beyond COMPILED_MAX_ROWS rows).
    assert max(r for k, r in calls if k == "compiled") == COMPILED_MAX_ROWS
    seconds, _ = timings({})  # an Intel-like machine: F.linear everywhere
    assert set(measure(seconds, KINDS).kinds) == {"linear"}
    seconds, calls = timings({64: "compiled"})  # a machine without the extension
    assert set(measure(seconds, ("linear", "skinny")).kinds) == {"linear"}
    assert all(k != "compiled" for k, _ in calls)


def test_f_linear_wins_ties_and_near_ties() -> None:
    def seconds(kind: str, rows: int) -> float:
        return {"linear": 1.0, "skinny": 0.97, "compiled": 1.0}[kind]
    assert set(measure(seconds, KINDS).kinds) == {"linear"}  # within MARGIN of F.linear


def test_the_measurement_is_cached_per_machine(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VERISPEC_FP32_PRODUCT", raising=False)
    seconds, calls = timings({16: "skinny"})
    first = product_choice(seconds, (8, 4), KINDS)
    assert calls and first.kinds == tuple("skinny" if r <= 16 else "linear" for r in ROW_COUNTS)
    saved = json.loads((tmp_path / "cpu-products.json").read_text())
    (key, value), = saved.items()
    assert "torch" in key and "threads" in key and "compiled" in key and key.endswith("8x4")
    assert value == list(first.kinds)
    assert product_choice(timings({})[0], (8, 5), KINDS) != first  # another shape: its own

    def never(kind: str, rows: int) -> float:
        raise AssertionError("measured again")
    assert product_choice(never, (8, 4), KINDS) == first
    # Without the extension the machine's kinds differ: measured for them, on their own.
    assert product_choice(timings({})[0], (8, 4), ("linear", "skinny")) != first
    (tmp_path / "cpu-products.json").write_text("{damaged")
    seconds, calls = timings({2: "skinny"})
    assert product_choice(seconds, (8, 4), KINDS).kind(2) == "skinny" and calls


def test_a_choice_whose_bytes_changed_is_measured_again(tmp_path, monkeypatch, caplog) -> None:
    """Valid JSON naming other kinds than were measured would run a slower product, silently."""
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VERISPEC_FP32_PRODUCT", raising=False)
    path = tmp_path / "cpu-products.json"
    product_choice(timings({16: "skinny"})[0], (8, 4), KINDS)
    path.write_text(path.read_text().replace("skinny", "linear"))  # same length, still JSON
    seconds, calls = timings({16: "skinny"})
    with caplog.at_level(logging.WARNING, logger="verispec"):
        assert product_choice(seconds, (8, 4), KINDS).kind(16) == "skinny" and calls
    (line,) = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert str(path) in line and "timing the products again" in line


def test_the_choice_can_be_forced(monkeypatch) -> None:
    def never(kind: str, rows: int) -> float:
        raise AssertionError("measured")
    monkeypatch.setenv("VERISPEC_FP32_PRODUCT", "linear")
    assert product_choice(never, (8, 4), KINDS) == ProductChoice(("linear",) * len(ROW_COUNTS))
    monkeypatch.setenv("VERISPEC_FP32_PRODUCT", "skinny")
    assert product_choice(never, (8, 4), KINDS).kind(64) == "skinny"
    monkeypatch.setenv("VERISPEC_FP32_PRODUCT", "compiled")
    with pytest.raises(ValueError, match="VERISPEC_FP32_PRODUCT='compiled' is invalid: expected "
                                         "one of \\('linear', 'skinny'\\)"):
        product_choice(never, (8, 4), ("linear", "skinny"))
    monkeypatch.setenv("VERISPEC_FP32_PRODUCT", "fast")
    with pytest.raises(ValueError, match="VERISPEC_FP32_PRODUCT='fast' is invalid"):
        product_choice(never, (8, 4), KINDS)


@pytest.mark.parametrize("kind", fp32_kinds())
def test_timing_the_products_leaves_the_callers_random_stream_alone(kind: str) -> None:
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    assert _time_product((8, 4), kind, 2) > 0
    assert torch.equal(torch.rand(3), expected)
