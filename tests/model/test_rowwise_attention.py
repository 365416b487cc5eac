"""The compiled row-by-row paged attention (quantized models) against the SDPA paths, on chains,
trees, decode steps and prefill chunks in one batch, plain and with a sliding window, a score
scale and a soft cap (Gemma 2); its rows independent of the batch; and under a window it never
reads the blocks behind it (the engine releases them). A float16 cache (what quantized models
keep) gives exactly the float32 result on the widened values, with F16C and on the portable
path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from verispec.model import AttentionMetadata
from verispec.model.attention import AttentionPlan, paged_attention
from verispec.model.quant.kernels import compiled_kernels

pytestmark = pytest.mark.skipif(compiled_kernels() is None, reason="compiled kernels not built")

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4


def _attend(attn: AttentionMetadata, q, kv, cache, rowwise: bool, window=None, **options) -> torch.Tensor:
    return paged_attention(q, kv, cache.clone(), AttentionPlan(attn, BLOCK, rowwise=rowwise, window=window),
                           **options)


def _reference(attn: AttentionMetadata, q, kv, cache, window=None, **options) -> torch.Tensor:
    """The SDPA path in float64: in float32 its products differ between processes (in about one
    run in six on the Xeon of 2026-11-28, by up to 8e-5 with a window and a soft cap, while the
    row-by-row path stays within 5e-7 of this reference), which made a float32 comparison flaky."""
    return _attend(attn, q.double(), kv.double(), cache.double(), False, window, **options).float()


def _batch(query_lens, seq_lens, trees=None):
    tables, next_block = [], 0
    for s in seq_lens:
        count = -(-s // BLOCK)
        tables.append(list(range(next_block, next_block + count))[::-1])  # blocks out of order
        next_block += count
    attn = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK, trees=trees)
    g = torch.Generator().manual_seed(sum(seq_lens))
    tokens = sum(query_lens)
    q = torch.randn(tokens, HEADS, DIM, generator=g)
    kv = torch.randn(tokens, 2 * KV_HEADS, DIM, generator=g)
    cache = torch.randn(2, next_block + 1, BLOCK, KV_HEADS, DIM, generator=g)
    return attn, q, kv, cache


def test_rowwise_equals_sdpa_on_a_mixed_batch() -> None:
    # decode, a chain verify, a tree verify, a prefill chunk with context, a fresh prompt.
    query_lens, seq_lens = [1, 5, 6, 20, 9], [13, 30, 11, 40, 9]
    trees = [None, None, [-1, 0, 0, 1, 1, 2], None, None]
    attn, q, kv, cache = _batch(query_lens, seq_lens, trees)
    ours = _attend(attn, q, kv, cache, rowwise=True)
    torch.testing.assert_close(ours, _reference(attn, q, kv, cache), atol=2e-5, rtol=1e-5)


def test_rowwise_rows_do_not_depend_on_the_batch() -> None:
    attn, q, kv, cache = _batch([5], [30])
    verify = _attend(attn, q, kv, cache, rowwise=True)
    # Row i of the verify step, fed alone as a decode step against the same cache content.
    written = cache.clone()
    paged_attention(q, kv, written, AttentionPlan(attn, BLOCK, rowwise=True))
    for i in range(5):
        alone = AttentionMetadata.build([1], [26 + i], [attn.block_tables[0].tolist()], BLOCK)
        out = paged_attention(q[i:i + 1], kv[i:i + 1], written.clone(),
                              AttentionPlan(alone, BLOCK, rowwise=True))
        assert torch.equal(out[0], verify[i])


GEMMA2 = dict(window=7, scale=0.3, softcap=5.0)


@pytest.mark.parametrize("options", [dict(window=7), GEMMA2], ids=["window", "window-scale-softcap"])
def test_rowwise_equals_sdpa_with_window_and_softcap(options) -> None:
    query_lens, seq_lens = [1, 5, 6, 20, 9], [13, 30, 11, 40, 9]
    trees = [None, None, [-1, 0, 0, 1, 1, 2], None, None]
    attn, q, kv, cache = _batch(query_lens, seq_lens, trees)
    ours = _attend(attn, q, kv, cache, True, **options)
    torch.testing.assert_close(ours, _reference(attn, q, kv, cache, **options), atol=2e-5, rtol=1e-5)
    # The window and the cap change the result: neither is ignored.
    assert not torch.allclose(ours, _attend(attn, q, kv, cache, True), atol=1e-3)
    if "softcap" in options:
        without = dict(options, softcap=None)
        assert not torch.allclose(ours, _attend(attn, q, kv, cache, True, **without), atol=1e-3)


def test_rowwise_window_rows_do_not_depend_on_the_batch_nor_on_released_blocks() -> None:
    """Verify rows equal decode rows bit for bit under a window and a soft cap, also when the
    blocks behind every row's window are replaced by one full of NaN (a released block)."""
    attn, q, kv, cache = _batch([5], [30])
    verify = _attend(attn, q, kv, cache, True, **GEMMA2)
    written = cache.clone()
    paged_attention(q, kv, written, AttentionPlan(attn, BLOCK, rowwise=True, window=7))
    written[:, -1] = float("nan")  # the spare block at the end of the cache
    table = attn.block_tables[0].tolist()
    # The first query sits at 25: keys <= 18 are outside every row's window, blocks 0-3 wholly.
    released = [written.shape[1] - 1] * 4 + table[4:]
    for i in range(5):
        for blocks in (table, released):
            alone = AttentionMetadata.build([1], [26 + i], [blocks], BLOCK)
            out = paged_attention(q[i:i + 1], kv[i:i + 1], written.clone(),
                                  AttentionPlan(alone, BLOCK, rowwise=True, window=7),
                                  scale=0.3, softcap=5.0)
            assert torch.equal(out[0], verify[i])


def _half_case():
    query_lens, seq_lens = [1, 5, 6, 20, 9], [13, 30, 11, 40, 9]
    attn, q, kv, cache = _batch(query_lens, seq_lens, [None, None, [-1, 0, 0, 1, 1, 2], None, None])
    return attn, q, kv.half(), cache.half()


def test_a_float16_cache_gives_the_float32_result_on_its_values() -> None:
    attn, q, kv, cache = _half_case()
    half = _attend(attn, q, kv, cache, True, **GEMMA2)
    assert torch.equal(half, _attend(attn, q, kv.float(), cache.float(), True, **GEMMA2))
    assert not torch.equal(half, _attend(attn, q, kv.float() * 1.001, cache.float(), True, **GEMMA2))


def test_the_portable_float16_path_equals_the_f16c_one() -> None:
    """VERISPEC_CPU_KERNEL=generic (read once per process) forces the path without F16C."""
    script = ("import sys, torch; sys.path.insert(0, '.'); "
              "from tests.model.test_rowwise_attention import _attend, _half_case, GEMMA2; "
              "a, q, kv, c = _half_case(); torch.save(_attend(a, q, kv, c, True, **GEMMA2), sys.argv[1])")
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"rowwise-half-{os.getpid()}.pt")
    env = dict(os.environ, VERISPEC_CPU_KERNEL="generic")
    subprocess.run([sys.executable, "-c", script, out], check=True, env=env, timeout=120,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        portable = torch.load(out)
    finally:
        os.remove(out)
    attn, q, kv, cache = _half_case()
    assert torch.equal(portable, _attend(attn, q, kv, cache, True, **GEMMA2))
