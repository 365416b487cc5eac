"""The quantized target as its own drafter (draft="int4" / "int8"): its drafts are sampled from
the request's pipeline over the int4 copy's logits and verified against the full-precision
target, so the output follows the target exactly: chi-square (false alarm 1e-6) plain, with top-p
and with CFG; the copy's own samples, the wrong variant, fail the same test. Likewise an EAGLE
head with quantized products (quantize_linears_, in the bits LLM gives it on a quantized
target) drafting for a 4-bit target."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verispec import SamplingParams
from verispec.runtime.kv_cache import BlockManager
from verispec.runtime.runner import Feed, ModelRunner
from verispec.model import AttentionMetadata
from verispec.sample.reference import reference_probs
from verispec.engine.llm import HEAD_BITS
from verispec.model.quant.linear import QuantLinear, quantize_linears_
from verispec.spec_decode.draft_model import DraftModelDrafter
from verispec.spec_decode.eagle import EagleDrafter
from verispec.spec_decode.heads import HeadConfig, new_head

from ..stats import chi_square
from ..tiny import run_all, tiny_engine, tiny_model
from .test_learned import _engine as fixed_k_engine

VOCAB, PROMPT, NEGATIVE = 8, [1, 2, 3], [5, 6]
# int4 in groups of 32 moves the first token's distribution by a total variation of 0.09 here:
# drafts are accepted most of the time, and rejected often enough to test the residual.
TARGET = dict(seed=3, vocab=VOCAB, scale=0.3)
GROUPS = {
    "sampled": SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True),
    "top-p": SamplingParams(temperature=1.0, top_p=0.8, max_tokens=2, ignore_eos=True),
    "cfg": SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, guidance_scale=1.5,
                          negative_prompt=NEGATIVE),
}
N = 8000


def _target_probs(model, tokens: list[int], params: SamplingParams) -> torch.Tensor:  # [V]
    blocks = BlockManager(64, 4)
    feeds = [Feed("c", tokens, 0, 1)]
    blocks.allocate("c", len(tokens))
    if params.guidance_scale is not None:
        uncond = NEGATIVE + tokens[len(PROMPT):]
        blocks.allocate("u", len(uncond))
        feeds.append(Feed("u", uncond, 0, 1))
    logits = ModelRunner(model, blocks).forward(feeds)
    return reference_probs(logits[0], params, logits[1] if len(feeds) > 1 else None)


def _pairs_fit(model, pairs: torch.Tensor, params: SamplingParams) -> bool:
    p1 = _target_probs(model, PROMPT, params)
    p2 = torch.stack([_target_probs(model, PROMPT + [y], params) for y in range(VOCAB)])
    return chi_square(pairs[:, 0], p1).passed and \
        chi_square(pairs[:, 0] * VOCAB + pairs[:, 1], (p1[:, None] * p2).reshape(-1)).passed


def test_int4_self_draft_output_follows_the_float_target() -> None:
    target = tiny_model(**TARGET)
    draft = DraftModelDrafter(tiny_model(**TARGET, quantization=(4, 32)), num_blocks=8192,
                              block_size=4)
    engine = tiny_engine(target, draft, k=3, num_blocks=16384, budget=4096, max_seqs=1024)
    ids = {name: [engine.add_request(PROMPT, dataclasses.replace(params, seed=s))
                  for s in range(N)] for name, params in GROUPS.items()}
    done = run_all(engine)
    drafted = sum(o.stats.num_draft_tokens for o in done.values())
    accepted = sum(o.stats.num_accepted_tokens for o in done.values())
    assert 0.5 * drafted < accepted < drafted  # the copy is close, and not identical
    for name, params in GROUPS.items():
        pairs = torch.tensor([done[i].token_ids[:2] for i in ids[name]])
        assert _pairs_fit(target, pairs, params), name


def test_the_int4_copys_own_samples_fail_the_same_test() -> None:
    """The wrong variant (sampling from the int4 copy, no verification): the test sees it."""
    target = tiny_model(**TARGET)
    engine = tiny_engine(tiny_model(**TARGET, quantization=(4, 32)), num_blocks=16384,
                         budget=4096, max_seqs=1024)
    params = GROUPS["sampled"]
    ids = [engine.add_request(PROMPT, dataclasses.replace(params, seed=s)) for s in range(N)]
    done = run_all(engine)
    pairs = torch.tensor([done[i].token_ids[:2] for i in ids])
    assert not _pairs_fit(target, pairs, params)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-layer", "torch-layer"])
def test_a_quantized_eagle_head_on_a_4_bit_target_keeps_the_output_exact(compiled: bool) -> None:
    target = tiny_model(**TARGET, quantization=(4, 32))
    head = new_head(HeadConfig.for_target("eagle", target.config), target, torch.arange(VOCAB))
    # In the blocks LLM gives it on a quantized target.
    assert quantize_linears_(head, bits=HEAD_BITS["eagle"]) == sum(isinstance(m, QuantLinear)
                                                                  for m in head.modules()) > 0
    if compiled and not head.compile_layer():  # as LLM does on a quantized target
        pytest.skip("the compiled kernels are not built here")
    engine = fixed_k_engine(target, EagleDrafter(head, num_blocks=8192, block_size=4), max_seqs=1024,
                            num_blocks=16384)
    # The head drafts from the second step on (it reads the target's hidden states): y2 is
    # verified against up to two drafts.
    params = dataclasses.replace(GROUPS["top-p"], max_tokens=4)
    ids = [engine.add_request(PROMPT, dataclasses.replace(params, seed=s)) for s in range(N // 2)]
    done = run_all(engine)
    drafted = sum(o.stats.num_draft_tokens for o in done.values())
    assert 0.02 * drafted < sum(o.stats.num_accepted_tokens for o in done.values()) < 0.9 * drafted
    pairs = torch.tensor([done[i].token_ids[:2] for i in ids])
    assert _pairs_fit(target, pairs, params)


def test_the_compiled_eagle_layer_computes_the_torch_layers_features() -> None:
    """EagleHead.compile_layer runs the int8 head's decoder layer as one compiled call: the
    same features as its torch operations, up to float rounding (a prefill of 6 rows, then one
    more row against the cache each wrote)."""
    target = tiny_model(**TARGET, quantization=(4, 32))
    head = new_head(HeadConfig.for_target("eagle", target.config), target, torch.arange(VOCAB))
    quantize_linears_(head)
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(7, target.config.hidden_size, generator=gen)
    ids = torch.randint(0, VOCAB, (7,), generator=gen)

    def run() -> torch.Tensor:  # [7, d]
        caches = head.allocate_kv_cache(4, 4)
        outs = []
        for start, n in ((0, 6), (6, 1)):
            attn = AttentionMetadata.build([n], [start + n], [[0, 1]], 4)
            with torch.no_grad():
                outs.append(head(features[start:start + n], ids[start:start + n], attn.positions(),
                                 attn, caches))
        return torch.cat(outs)

    layers = run()
    if not head.compile_layer():
        pytest.skip("the compiled kernels are not built here")
    compiled = run()
    # Measured: 1.9e-7 of the largest value (int8 activations can turn a rounding difference
    # into another rounding of a value; a wrong weight or rotary would move them by far more).
    assert (compiled - layers).abs().max() < 1e-3 * layers.abs().max()
