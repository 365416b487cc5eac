"""Which verifier backend runs: a Triton request for tensors Triton cannot run on is refused
up front, naming the device, instead of failing inside Triton's driver lookup."""

from __future__ import annotations

import pytest
import torch

from verispec import SamplingMetadata, SamplingParams
from verispec.sample import rejection
from verispec.sample.rejection import rejection_sample


def _inputs() -> tuple:
    target, ids, cu = torch.zeros(3, 8), torch.tensor([1]), torch.tensor([0, 1, 1])
    return target, ids, cu, SamplingMetadata.from_params([SamplingParams()] * 2)


def test_triton_on_cpu_tensors_without_the_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(rejection, "_triton_importable", lambda: True)
    with pytest.raises(ValueError, match=r"backend='triton' needs CUDA tensors .*TRITON_INTERPRET=1.* on cpu"):
        rejection_sample(*_inputs(), backend="triton")


def test_a_forced_triton_default_on_cpu_is_refused_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(rejection, "default_backend", lambda device_type: "triton")  # as $VERISPEC_SAMPLER_BACKEND=triton
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        rejection_sample(*_inputs())


def test_native_on_cpu_needs_no_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert rejection_sample(*_inputs(), backend="native").token_ids.shape == (2, 2)
