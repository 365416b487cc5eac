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
from verispec.spec_decode.base import DraftRequest, FedTokens
from verispec.spec_decode.eagle import EagleDrafter
from verispec.spec_decode.heads import HeadConfig, new_head

from ..stats import chi_square
from ..tiny import run_all, tiny_engine, tiny_model
from .test_learned import _engine as fixed_k_engine, _greedy as greedy_outputs

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


@pytest.mark.parametrize("compiled, fused", [(True, False), (False, False), (True, True)],
                         ids=["compiled-layer", "torch-layer", "compiled-fused-head"])
def test_a_quantized_eagle_head_on_a_4_bit_target_keeps_the_output_exact(compiled: bool, fused: bool) -> None:
    """fused: the shipped head's kind (EAGLE-3), whose compiled stack also computes its logits."""
    target = tiny_model(**TARGET, quantization=(4, 32))
    head = new_head(HeadConfig.for_target("eagle", target.config, fused=fused), target, torch.arange(VOCAB))
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


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-layer", "torch-layer"])
def test_chained_draft_rows_compute_what_planned_rows_do(compiled: bool) -> None:
    """A draft position after the first feeds one token per request with its rows laid out on
    the device (ModelRunner.chain_inputs) and takes its logits through row_logits (in the
    compiled stack for a fused head): the same features and logits as rows planned from host
    lists and the head's own logits (two requests with different contexts, so that a row
    reading the other's cache or position would show)."""
    target = tiny_model(**TARGET, quantization=(4, 32))
    head = new_head(HeadConfig.for_target("eagle", target.config, fused=True), target, torch.arange(VOCAB))
    quantize_linears_(head, bits=HEAD_BITS["eagle"])
    if compiled and not head.compile_layer():
        pytest.skip("the compiled kernels are not built here")
    gen = torch.Generator().manual_seed(1)
    features = torch.randn(10, target.config.hidden_size, generator=gen)
    ids = torch.randint(0, VOCAB, (10,), generator=gen).tolist()

    def run(chain: bool) -> tuple[torch.Tensor, torch.Tensor]:  # [2, d] features, [2, N] logits
        blocks = BlockManager(16, 4)
        runner = ModelRunner(head, blocks)
        blocks.allocate("a", 6)
        blocks.allocate("b", 4)
        with torch.no_grad():
            step = runner.inputs([Feed("a", ids[:5], 0, 1), Feed("b", ids[5:8], 0, 1)])
            head(features[:8], step.input_ids, step.positions, step.attn, runner.kv_caches)
            feeds = [Feed("a", [ids[8]], 5, 1), Feed("b", [ids[9]], 3, 1)]
            step = runner.chain_inputs(feeds) if chain else runner.inputs(feeds)
            out = head(features[8:], step.input_ids, step.positions, step.attn, runner.kv_caches)
            return out, head.row_logits(out, step.logits_rows)

    planned, planned_logits = run(chain=False)
    chained, chained_logits = run(chain=True)
    with torch.no_grad():
        own = head.logits(planned)
    # Measured: the features equal through the compiled layer and 1.5e-7 of the largest value
    # apart through the torch layer (its planned rows attend in a padded SDPA call, its chained
    # ones row by row), the stack's logits 2e-7 from the head's own; a row attending from the
    # wrong position fails.
    assert (chained - planned).abs().max() < 1e-5 * planned.abs().max()
    assert (planned_logits - own).abs().max() < 1e-5 * own.abs().max()
    assert (chained_logits - planned_logits).abs().max() < 1e-3 * own.abs().max()


def test_greedy_chains_in_one_compiled_call_draft_what_the_passes_from_python_do() -> None:
    """A quantized fused head drafts greedy requests in one compiled call (EagleHead.chain_drafts):
    the same drafts as its pass-by-pass path from Python (the same tokens accepted), requests
    ending at different steps drafting to different depths, and the output plain decoding's."""
    target = tiny_model(**TARGET, quantization=(4, 32))
    calls = []

    def drafter(one_call: bool) -> EagleDrafter:
        head = new_head(HeadConfig.for_target("eagle", target.config, fused=True), target, torch.arange(VOCAB))
        quantize_linears_(head, bits=HEAD_BITS["eagle"])
        if not head.compile_layer() or not head.drafts_in_one_call:
            pytest.skip("the compiled kernels are not built here")
        if one_call:
            chains = head.chain_drafts
            head.chain_drafts = lambda *args: calls.append(args[1].depths) or chains(*args)
        else:
            head._chain = None  # the pass-by-pass path
        return EagleDrafter(head, num_blocks=1024, block_size=4)

    prompts = [[1, 2, 3], [4, 5], [6, 7, 0, 1, 2], [3], [5, 5, 5, 5], [2, 4, 6, 0]]
    plain, _ = greedy_outputs(fixed_k_engine(target, None), prompts)
    chained, accepted = greedy_outputs(fixed_k_engine(target, drafter(one_call=True)), prompts)
    passes, accepted_by_passes = greedy_outputs(fixed_k_engine(target, drafter(one_call=False)), prompts)
    assert chained == plain == passes
    assert accepted == accepted_by_passes > 0
    assert any(len(set(depths)) > 1 for depths in calls)  # a call with requests at different depths


def _one_call_drafter() -> tuple:
    """A compiled fused head on a 4-bit target and three requests' contexts (tokens, depth) with
    random hidden states: (head, its compiled chain, contexts, tokens, hidden)."""
    vocab = 64
    target = tiny_model(seed=5, vocab=vocab, quantization=(4, 32))
    head = new_head(HeadConfig.for_target("eagle", target.config, fused=True), target, torch.arange(vocab))
    quantize_linears_(head, bits=HEAD_BITS["eagle"])
    if not head.compile_layer() or not head.drafts_in_one_call:
        pytest.skip("the compiled kernels are not built here")
    gen = torch.Generator().manual_seed(2)
    contexts = {"a": (5, 1), "b": (9, 3), "c": (3, 4)}  # request: (tokens, depth)
    tokens = {rid: torch.randint(0, vocab, (n,), generator=gen).tolist() for rid, (n, _) in contexts.items()}
    width = len(head.config.fused_layers) * target.config.hidden_size
    hidden = {rid: torch.randn(n, width, generator=gen) * 3 for rid, (n, _) in contexts.items()}
    return head, head._chain, contexts, tokens, hidden


def _propose(head, contexts: dict, tokens: dict, hidden: dict, params: dict) -> tuple:
    """One propose call of a fresh drafter over `head` for the requests of `params` (request:
    SamplingParams): (the DraftBatch, the head's cache after it)."""
    drafter = EagleDrafter(head, num_blocks=64, block_size=4)
    for rid in params:
        drafter.observe([FedTokens(rid, 0, tokens[rid], 0)], hidden[rid])
    batch = drafter.propose([DraftRequest(rid, tokens[rid], contexts[rid][1], p, p.seed or 0, 0)
                             for rid, p in params.items()])
    return batch, drafter.runner.kv_caches[0].clone()


def test_a_greedy_chain_in_one_call_writes_and_drafts_what_the_passes_do() -> None:
    """One propose call for three requests at depths 1, 3 and 4, through the compiled chain and
    pass by pass: the same drafts, and the same keys and values in the same slots of the head's
    cache (a later row at the wrong position or slot changes them)."""
    head, chain, contexts, tokens, hidden = _one_call_drafter()
    greedy = {rid: SamplingParams(temperature=0) for rid in contexts}
    chained, chained_cache = _propose(head, contexts, tokens, hidden, greedy)
    head._chain = None  # the pass-by-pass path
    passes, passes_cache = _propose(head, contexts, tokens, hidden, greedy)
    assert [len(d) for d in chained.token_ids] == [1, 3, 4]
    assert chained.token_ids == passes.token_ids and chained.probs is None
    # Measured: 2e-7 of the largest value apart (each fused layer's unit norm rounds differently
    # in C++ than torch's); a wrong position or slot moves keys and values by far more.
    assert (chained_cache - passes_cache).abs().max() < 1e-4 * passes_cache.abs().max()


def test_a_sampled_chain_in_one_call_draws_from_its_own_filters_and_stream() -> None:
    """Sampled requests in the compiled chain: each draft a token its q gives mass, q a
    distribution within the request's top-k, and a seeded request's drafts and q the same alone
    as beside the others (its own DRAFT stream); a greedy request beside them takes the first
    maximum, as alone. (Exactness: the chi-square test above, compiled-fused-head.)"""
    head, _, contexts, tokens, hidden = _one_call_drafter()
    params = {"a": SamplingParams(temperature=0), "b": SamplingParams(temperature=0.9, top_k=5, seed=7),
              "c": SamplingParams(temperature=1.2, top_p=0.7, min_p=0.02, seed=8)}
    together, _ = _propose(head, contexts, tokens, hidden, params)
    assert together.probs is not None and together.probs.shape == (1 + 3 + 4, 64)
    rows = {"a": together.probs[:1], "b": together.probs[1:4], "c": together.probs[4:]}
    for rid, drafts in zip(params, together.token_ids):
        alone, _ = _propose(head, contexts, tokens, hidden, {rid: params[rid]})
        assert alone.token_ids == [drafts]
        if rid == "a":  # one-hot at its draft: a distribution, which greedy verification never reads
            assert torch.equal(rows[rid], torch.nn.functional.one_hot(torch.tensor(drafts), 64).float())
            continue
        assert torch.equal(alone.probs, rows[rid])
        assert torch.allclose(rows[rid].sum(-1), torch.ones(len(drafts)), atol=1e-5)
        assert all(rows[rid][j, t] > 0 for j, t in enumerate(drafts))
    assert ((rows["b"] > 0).sum(-1) <= 5).all()


def test_the_chains_q_is_the_filter_pipelines() -> None:
    """The compiled chain's q for each request's first draft equals the one the passes build
    with the Python filters (sample_from_draft_vocab), for near-flat logits (a high temperature)
    where the nucleus holds many columns: with top-p alone the chain once took its top-k cut
    from an unsorted column and kept 36 of the 52 columns the nucleus holds."""
    head, _, contexts, tokens, hidden = _one_call_drafter()
    params = {"a": SamplingParams(temperature=1e4, top_p=0.5, seed=1),
              "b": SamplingParams(temperature=1e4, top_p=0.8, seed=2),
              "c": SamplingParams(temperature=1e4, top_k=20, top_p=0.9, seed=3)}
    chained, _ = _propose(head, contexts, tokens, hidden, params)
    head._chain = None  # the pass-by-pass path
    passes, _ = _propose(head, contexts, tokens, hidden, params)
    for first in (0, 1, 4):  # each request's first draft row (depths 1, 3, 4)
        assert torch.equal(chained.probs[first] > 0, passes.probs[first] > 0)
        torch.testing.assert_close(chained.probs[first], passes.probs[first], atol=1e-6, rtol=1e-4)
