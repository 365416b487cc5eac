"""The engine on CUDA (skipped without a GPU; the same paths run on the CPU in the other tests).

Tiny random checkpoints, sharpened so that greedy decisions do not hang on rounding: with every
kind of drafter, trees and CFG, greedy output on the GPU equals the CPU engine's token for
token and the GPU's own plain decoding; a seeded sampled request gives the same tokens alone and
in a batch; every KV block is free at the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from verispec import LLM, SamplingParams
from verispec.spec_decode.heads import HeadConfig, new_head, save_head

from ..tiny import tiny_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = ["t1 t2 t3 t1 t2 t3 t1", "t4 t5 t4 t5 t4", "t7", "t9 t9 t2 t9 t9 t2"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
CFG = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, guidance_scale=1.5, negative_prompt="t3 t3")
SEEDED = SamplingParams(temperature=0.9, top_k=8, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cuda")
    tiny_checkpoint(root / "model", seed=0, vocab=16)
    tiny_checkpoint(root / "draft", seed=1, vocab=16, sharpen=3.0)
    plain = LLM(model=str(root / "model"), draft="none", progress=False, kv_cache_gib=0.01)
    head = new_head(HeadConfig.for_target("medusa", plain.model.config, num_medusa_heads=3), plain.model,
                    torch.arange(16))
    save_head(head, root / "medusa.safetensors")
    return root


def _setups(root: Path) -> dict[str, dict]:
    return {
        "none": dict(draft="none"),
        "ngram": dict(draft="ngram", num_speculative_tokens=3),
        "draft model": dict(draft=str(root / "draft"), num_speculative_tokens=3),
        "medusa tree": dict(draft=str(root / "medusa.safetensors"), tree=(3, 2, 1)),
        "ngram tree": dict(draft="ngram", tree=(2, 1)),
    }


def _llm(root: Path, device: str, dtype: str = "float32", **setup) -> LLM:
    return LLM(model=str(root / "model"), device=device, dtype=dtype, progress=False, kv_cache_gib=0.01,
               max_num_batched_tokens=64, **setup)


def _ids(llm: LLM, params: SamplingParams) -> list[list[int]]:
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks, "blocks leaked"
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("name", ["none", "ngram", "draft model", "medusa tree", "ngram tree"])
@pytest.mark.parametrize("params", [GREEDY, CFG], ids=["greedy", "cfg"])
def test_greedy_on_the_gpu_equals_the_cpu_and_plain_decoding(checkpoints, name: str, params) -> None:
    setup = _setups(checkpoints)[name]
    on_gpu = _llm(checkpoints, "cuda", **setup)
    assert next(on_gpu.model.parameters()).device.type == "cuda"
    expected = _ids(_llm(checkpoints, "cpu", draft="none"), params)
    assert _ids(on_gpu, params) == expected
    if name != "none":
        assert sum(o.stats.num_draft_tokens for o in on_gpu.generate(PROMPTS, params, use_tqdm=False)) > 0


def test_bfloat16_greedy_speculation_equals_plain_decoding_on_the_gpu(checkpoints) -> None:
    plain = _ids(_llm(checkpoints, "cuda", "bfloat16", draft="none"), GREEDY)
    assert _ids(_llm(checkpoints, "cuda", "bfloat16", draft="ngram", num_speculative_tokens=3), GREEDY) == plain


@pytest.mark.parametrize("name", ["none", "ngram", "medusa tree"])
def test_a_seeded_request_is_batch_invariant_on_the_gpu(checkpoints, name: str) -> None:
    llm = _llm(checkpoints, "cuda", **_setups(checkpoints)[name])
    alone = llm.generate(PROMPTS[:1], SEEDED, use_tqdm=False)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    batch = llm.generate(PROMPTS, [SEEDED, others, others, others], use_tqdm=False)
    assert batch[0].token_ids == alone
    assert all(0 <= t < 16 for o in batch for t in o.token_ids)
