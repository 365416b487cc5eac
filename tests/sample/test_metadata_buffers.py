"""SamplingMetadata written into MetadataBuffers (an engine with padded steps) equals the one
built afresh, field for field, for batches that grow the buffers and shrink again."""

from __future__ import annotations

import dataclasses

import torch

from verispec import SamplingMetadata, SamplingParams
from verispec.sample.metadata import MetadataBuffers

PARAMS = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3),
          SamplingParams(min_p=0.1, guidance_scale=1.5, seed=2**62), SamplingParams(temperature=1e-6)]


def test_buffered_metadata_equals_fresh_metadata() -> None:
    buffers = MetadataBuffers("cpu")
    for n in (3, 40, 2, 17):
        params = [PARAMS[i % len(PARAMS)] for i in range(n)]
        steps, seeds = list(range(n)), [None if i % 3 else 100 + i for i in range(n)]
        fresh = SamplingMetadata.from_params(params, steps, [s if s is not None else 7 for s in seeds])
        ours = SamplingMetadata.from_params(params, steps, [s if s is not None else 7 for s in seeds],
                                            buffers=buffers)
        for field in dataclasses.fields(fresh):
            a, b = getattr(fresh, field.name), getattr(ours, field.name)
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), field.name
            else:
                assert a == b, field.name
    assert buffers.capacity == 40
