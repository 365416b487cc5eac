"""The engine on CUDA (skipped without a GPU; the same paths run on the CPU in the other tests).

Tiny random checkpoints, sharpened so that greedy decisions do not hang on rounding: with every
kind of drafter, trees and CFG, greedy output on the GPU equals the CPU engine's token for
token and the GPU's own plain decoding; a seeded sampled request gives the same tokens alone and
in a batch; every KV block is free at the end. Decode and verify steps replayed as CUDA graphs
give every step's logits bit for bit as the same steps run eagerly (enforce_eager), so greedy
and seeded output are identical, with every drafter; the padded step equals the ordinary one.
"""

from __future__ import annotations

import logging
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
    for kind in ("medusa", "eagle"):
        head = new_head(HeadConfig.for_target(kind, plain.model.config, num_medusa_heads=3), plain.model,
                        torch.arange(16))
        save_head(head, root / f"{kind}.safetensors")
    return root


def _setups(root: Path) -> dict[str, dict]:
    return {
        "none": dict(draft="none"),
        "ngram": dict(draft="ngram", num_speculative_tokens=3),
        # A random draft model's drafts never pay, so the adaptive K would step it aside (no
        # step verifying drafts): its K stays fixed.
        "draft model": dict(draft=str(root / "draft"), num_speculative_tokens=3, adaptive=False),
        "medusa tree": dict(draft=str(root / "medusa.safetensors"), tree=(3, 2, 1)),
        "ngram tree": dict(draft="ngram", tree=(2, 1)),
        "eagle": dict(draft=str(root / "eagle.safetensors"), num_speculative_tokens=3),
        "medusa": dict(draft=str(root / "medusa.safetensors"), num_speculative_tokens=3),
    }


def _logged_steps(llm: LLM, params: SamplingParams) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Output token ids, and the logits every step handed to verification."""
    logits = []
    verify = llm.engine._verify
    llm.engine._verify = lambda sampling, drafts, rows: logits.append(rows.clone()) or verify(sampling, drafts, rows)
    return _ids(llm, params), logits


REPLAYED = [(name, params) for name in ["none", "ngram", "draft model", "eagle", "medusa", "medusa tree", "ngram tree"]
            for params in (GREEDY, SEEDED)] + [("ngram", CFG)]


@pytest.mark.parametrize("name,params", REPLAYED,
                         ids=[f"{n}-{'cfg' if p is CFG else 'greedy' if p is GREEDY else 'seeded'}" for n, p in REPLAYED])
def test_graph_replay_equals_eager_bit_for_bit(checkpoints, name: str, params: SamplingParams) -> None:
    setup = _setups(checkpoints)[name]
    replayed = _llm(checkpoints, "cuda", "bfloat16", **setup)
    ids, logits = _logged_steps(replayed, params)
    graphs = replayed.engine.runner.graphs
    assert graphs is not None and graphs.num_graphs > 0 and not graphs.failed
    eager = _llm(checkpoints, "cuda", "bfloat16", enforce_eager=True, **setup)
    assert eager.engine.runner.graphs is None and eager.engine.runner.static is not None
    eager_ids, eager_logits = _logged_steps(eager, params)
    assert ids == eager_ids
    assert len(logits) == len(eager_logits) and all(torch.equal(a, b) for a, b in zip(logits, eager_logits))


@pytest.mark.parametrize("name", ["none", "ngram", "eagle"])
def test_the_padded_step_equals_the_ordinary_step_on_the_gpu(checkpoints, name: str) -> None:
    setup = _setups(checkpoints)[name]
    ordinary = _llm(checkpoints, "cuda", static_step=False, **setup)
    assert ordinary.engine.runner.static is None
    for params in (GREEDY, SEEDED):
        assert _ids(_llm(checkpoints, "cuda", **setup), params) == _ids(ordinary, params)


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


def test_a_failed_capture_logs_one_line_and_runs_eagerly(checkpoints, monkeypatch, caplog) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("no capture here")

    setup = _setups(checkpoints)["ngram"]
    expected = _ids(_llm(checkpoints, "cuda", "bfloat16", enforce_eager=True, **setup), GREEDY)
    monkeypatch.setattr(torch.cuda, "graph", broken)
    llm = _llm(checkpoints, "cuda", "bfloat16", **setup)
    with caplog.at_level(logging.WARNING, logger="verispec.runtime.cuda_graphs"):
        assert _ids(llm, GREEDY) == expected
    assert llm.engine.runner.graphs.failed and llm.engine.runner.graphs.num_graphs == 0
    assert [r.getMessage().count("no capture here") for r in caplog.records] == [1]
