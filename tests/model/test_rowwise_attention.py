"""The compiled row-by-row paged attention (quantized models) against the SDPA paths, on chains,
trees, decode steps and prefill chunks in one batch; and its rows independent of the batch."""

from __future__ import annotations

import pytest
import torch

from verispec.model import AttentionMetadata
from verispec.model.attention import AttentionPlan, paged_attention
from verispec.model.quant.kernels import compiled_kernels

pytestmark = pytest.mark.skipif(compiled_kernels() is None, reason="compiled kernels not built")

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4


def _attend(attn: AttentionMetadata, q, kv, cache, rowwise: bool) -> torch.Tensor:
    return paged_attention(q, kv, cache.clone(), AttentionPlan(attn, BLOCK, rowwise=rowwise))


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
    torch.testing.assert_close(ours, _attend(attn, q, kv, cache, rowwise=False),
                               atol=2e-5, rtol=1e-5)


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
