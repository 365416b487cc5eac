"""Rows described on the device (a padded step's RowLayout, runtime/static_step.py), chains and a
tree, attended by each
backend of model/row_attention.py (the torch reference, the compiled CPU kernel, the Triton kernel,
under the interpreter without a GPU) equal today's attention of the same sequences (the SDPA
padded group), with a sliding window and a soft cap too; the padding rows' reserved block is full
of NaN, their queries and keys are NaN and the block tables hold out-of-range ids past every
sequence's blocks, so an equal result shows none of it is read."""

from __future__ import annotations

import pytest
import torch

from verispec.model import AttentionMetadata, row_attention
from verispec.model.attention import AttentionPlan, paged_attention
from verispec.model.quant.kernels import compiled_kernels
from verispec.runtime.static_step import StaticInputs, StaticShapes

from verispec.sample import rejection

from ..sample.test_triton import DEVICE

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4
# (new rows, seq_len) per sequence: decode steps, verify steps of 3 and 5 rows, a tree of 6.
SEQS = [(1, 13), (5, 30), (3, 11), (6, 24), (1, 40), (2, 9)]
TREES = [None, None, None, [-1, 0, 0, 1, 1, 2], None, None]
GEMMA2 = dict(scale=0.3, softcap=5.0)
OUT_OF_RANGE = 10**9


def _tables() -> tuple[list[list[int]], int]:
    tables, next_block = [], 0
    for _, s in SEQS:
        count = -(-s // BLOCK)
        tables.append(list(range(next_block, next_block + count))[::-1])  # blocks out of order
        next_block += count
    return tables, next_block


def _both(window: int | None, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """(today's attention of SEQS, the same rows of their padded step)."""
    tables, num_blocks = _tables()
    reserved = num_blocks
    g = torch.Generator().manual_seed(5)
    tokens = sum(n for n, _ in SEQS)
    q = torch.randn(tokens, HEADS, DIM, generator=g)
    kv = torch.randn(tokens, 2 * KV_HEADS, DIM, generator=g)
    cache = torch.randn(2, num_blocks + 1, BLOCK, KV_HEADS, DIM, generator=g)
    cache[:, reserved] = float("nan")
    attn = AttentionMetadata.build([n for n, _ in SEQS], [s for _, s in SEQS], tables, BLOCK, trees=TREES)
    expected = paged_attention(q, kv, cache.clone(), AttentionPlan(attn, BLOCK, window=window), **options)

    static = StaticInputs(torch.device("cpu"), StaticShapes(8, 6, 12, trees=True), BLOCK, reserved)
    static.tables[: len(SEQS)] = OUT_OF_RANGE  # what prepare does not write is stale
    static.masks[:] = True
    step = static.prepare([[0] * n for n, _ in SEQS], [s - n for n, s in SEQS], tables, TREES)
    assert static.tables[: len(SEQS)].max() == reserved  # past a sequence's blocks: the reserved one
    static.tables[len(SEQS) : -1] = OUT_OF_RANGE  # rows of no sequence
    padded_q = torch.full((len(step.input_ids), HEADS, DIM), float("nan"))
    padded_kv = torch.full((len(step.input_ids), 2 * KV_HEADS, DIM), float("nan"))
    padded_q[step.real_rows], padded_kv[step.real_rows] = q, kv
    out = paged_attention(padded_q.to(DEVICE), padded_kv.to(DEVICE), cache.to(DEVICE),
                          _moved(AttentionPlan(step.attn, BLOCK, window=window)), **options)
    return expected, out.cpu()[step.real_rows]


def _moved(plan: AttentionPlan) -> AttentionPlan:
    """The plan's tensors on DEVICE (the Triton kernel's, on a GPU)."""
    rows = plan.rows
    for name in ("block_tables", "row_seq", "row_first", "row_visible", "row_tree_start", "tree_mask"):
        setattr(rows, name, getattr(rows, name).to(DEVICE))
    plan.slot_mapping = plan.slot_mapping.to(DEVICE)
    return plan


def _backends() -> list:
    return [
        pytest.param("torch"),
        pytest.param("compiled", marks=pytest.mark.skipif(
            compiled_kernels() is None or DEVICE.type != "cpu", reason="compiled kernels not built")),
        pytest.param("triton", marks=[
            pytest.mark.skipif(not rejection._triton_importable(), reason="triton is not installed"),
            pytest.mark.filterwarnings("ignore::RuntimeWarning")]),
    ]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("window,options", [(None, {}), (7, {}), (7, GEMMA2)],
                         ids=["plain", "window", "window-scale-softcap"])
def test_device_rows_equal_todays_attention(monkeypatch: pytest.MonkeyPatch, backend: str, window, options) -> None:
    monkeypatch.setattr(row_attention, "backend_for", lambda device_type: backend)
    expected, ours = _both(window, **options)
    torch.testing.assert_close(ours, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", _backends())
def test_a_wrong_window_or_cap_fails_the_comparison(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    monkeypatch.setattr(row_attention, "backend_for", lambda device_type: backend)
    expected, _ = _both(7, **GEMMA2)
    for window, options in ((None, GEMMA2), (7, dict(GEMMA2, softcap=None))):
        assert not torch.allclose(_both(window, **options)[1], expected, atol=1e-3)
