"""EAGLE and Medusa drafters through the engine: greedy output token for token that of plain
decoding, sampled output distributed as the target (chi-square, false alarm 1e-6), the heads
reading the target's own hidden states, no leaked blocks, head files."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from verispec import LLM, SamplingParams
from verispec.config import CacheConfig, EngineConfig, SpeculativeConfig
from verispec.engine.engine import LLMEngine
from verispec.runtime.kv_cache import BlockManager
from verispec.runtime.runner import Feed, ModelRunner
from verispec.spec_decode.base import Drafter
from verispec.sample import SamplingMetadata
from verispec.sample.processors import process_logits
from verispec.spec_decode.draft_sampling import sample_drafts, sample_from_draft_vocab, widen_vocab
from verispec.spec_decode.eagle import EagleDrafter
from verispec.spec_decode.heads import KINDS, HeadConfig, head_config, load_head, new_head, save_head, shipped_head
from verispec.spec_decode.medusa import MedusaDrafter

from .. import learned
from ..stats import chi_square
from ..tiny import run_all, tiny_checkpoint, tiny_model, word_tokenizer


def _drafter(head) -> Drafter:
    return EagleDrafter(head, num_blocks=8192, block_size=4) if head.config.kind == "eagle" else MedusaDrafter(head)


def _engine(model, drafter: Drafter | None, k: int = 3, max_seqs: int = 64, num_blocks: int = 8192) -> LLMEngine:
    """K fixed (no adaptive K): every step drafts, so every path of the drafter runs."""
    spec = SpeculativeConfig(method="none" if drafter is None else "eagle", num_speculative_tokens=k, adaptive=False)
    config = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=4096, max_model_len=512,
                          cache=CacheConfig(4, num_blocks), speculative=spec)
    return LLMEngine(model, word_tokenizer(model.config.vocab_size), config, drafter)


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), request_id=str(i))
    done = run_all(engine)
    return [done[str(i)].token_ids for i in range(len(prompts))], sum(o.stats.num_accepted_tokens for o in done.values())


@pytest.mark.parametrize("kind", [*KINDS, "eagle-fused"])
def test_greedy_output_is_plain_decoding_token_for_token(kind: str) -> None:
    target, prompts = learned.target(), learned.prompts(6, seed=11)
    plain, _ = _greedy(_engine(target, None), prompts)
    batched, accepted = _greedy(_engine(target, _drafter(learned.trained(kind))), prompts)
    assert batched == plain
    assert accepted > 0  # drafts were accepted and rolled back, not just rejected
    alone = [_greedy(_engine(target, _drafter(learned.trained(kind))), [p])[0][0] for p in prompts[:2]]
    assert alone == plain[:2]


def _sampled_pairs(target, drafter: Drafter, params: SamplingParams, n: int, prompt: list[int],
                   holes: bool = False) -> torch.Tensor:
    """holes: unseeded requests (the target takes the prompt's cached blocks, which the head
    never sees) and an engine that captures hidden states in a random half of its passes, so
    that the head drafts over holes in its features (spec_decode/features.py)."""
    engine = _engine(target, drafter, k=3, max_seqs=1024)
    if holes:
        coin = random.Random(0)
        engine._feature_requests = lambda scheduled: None if coin.random() < 0.5 else set()
        first_hole, found = drafter.store.first_hole, []
        drafter.store.first_hole = lambda *args: found.append(first_hole(*args)) or found[-1]
    for i in range(n):
        engine.add_request(prompt, dataclasses.replace(params, seed=None if holes else i))
    done = run_all(engine)
    drafted = sum(o.stats.num_draft_tokens for o in done.values())
    accepted = sum(o.stats.num_accepted_tokens for o in done.values())
    assert 0 < accepted < drafted  # the head is poor but not useless
    if holes:
        assert sum(h is not None for h in found) > n / 4
    return torch.tensor([o.token_ids[:2] for o in done.values()])


@pytest.mark.parametrize("kind,cfg,holes", [("eagle", False, False), ("medusa", False, False), ("eagle", True, False),
                                            ("eagle-fused", False, False), ("eagle", False, True)])
def test_sampled_output_follows_the_target(kind: str, cfg: bool, holes: bool) -> None:
    """20,000 seeded requests at temperature 0.7, top-p 0.9 (and CFG with a negative prompt; and
    drafts over holes in the features): the first two emitted tokens against p1(y1) p2(y2 | y1)
    from the target itself. The head is untrained and its draft vocabulary leaves tokens 6 and 7
    out (q = 0 there)."""
    vocab = learned.SAMPLED_VOCAB
    # Two blocks and a token: with holes the target takes two blocks from its prefix cache.
    prompt = learned.SAMPLED_PROMPT + [4, 5, 1, 2, 0, 3] if holes else learned.SAMPLED_PROMPT
    target, head, params, dist = learned.sampled_world(kind, cfg, max_tokens=3, prompt=prompt)
    pairs = _sampled_pairs(target, _drafter(head), params, 20_000, prompt, holes)
    p1 = dist([])
    p2 = torch.stack([dist([y]) for y in range(vocab)])
    assert chi_square(pairs[:, 0], p1).passed
    assert chi_square(pairs[:, 0] * vocab + pairs[:, 1], (p1[:, None] * p2).reshape(-1)).passed


def _hidden(model, tokens: list[int], layers: tuple[int, ...]) -> torch.Tensor:  # [len(tokens), n * d], fresh cache
    blocks = BlockManager(64, 4)
    blocks.allocate("s", len(tokens))
    return ModelRunner(model, blocks).forward_hidden([Feed("s", tokens, 0, 1)], layers)[1]


@pytest.mark.parametrize("kind", [*KINDS, "eagle-fused"])
def test_heads_read_the_targets_own_hidden_states(kind: str) -> None:
    """Every feature a drafter hands its head, across prefill, accepted and rejected drafts,
    CFG companions and preemption, is the target's hidden state of that position (of every
    layer the head reads) computed afresh from the request's tokens."""
    target = learned.target()
    drafter = _drafter(learned.trained(kind))
    layers = drafter.hidden_layers
    assert layers == ((1, 2) if kind == "eagle-fused" else (2,))
    tokens_of: dict[str, list[int]] = {}
    checked = []
    propose, features = drafter.propose, drafter.store.features

    def spy_propose(requests):
        tokens_of.update({r.request_id: list(r.token_ids) for r in requests})
        return propose(requests)

    def spy_features(rid, begin, end):
        got = features(rid, begin, end)
        expected = _hidden(target, tokens_of[rid][:end], layers)[begin:end]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        checked.append(end - begin)
        return got

    drafter.propose, drafter.store.features = spy_propose, spy_features
    engine = _engine(target, drafter, k=3, num_blocks=40)  # small enough to preempt
    for i, p in enumerate(learned.prompts(8, seed=5)):
        params = SamplingParams(temperature=0.9, seed=i, max_tokens=20, ignore_eos=True,
                                **({"guidance_scale": 1.5} if i % 3 == 0 else {}))
        engine.add_request(p, params)
    run_all(engine)
    assert sum(checked) > 8 * 10


def test_all_greedy_calls_draft_the_argmax_of_the_full_pipeline() -> None:
    """The greedy fast path (no q built) drafts what the full pipeline's q would put first."""
    vocab = torch.tensor([1, 4, 5, 9, 12])
    logits = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    greedy = SamplingMetadata.from_params([SamplingParams(temperature=0)] * 6, seeds=list(range(6)))
    tokens, q, usable = sample_from_draft_vocab(greedy, list(range(6)), [[]] * 6, logits, vocab, 16, 0)
    wide = widen_vocab(logits, vocab, 16)
    full = process_logits(wide, torch.arange(6), greedy).softmax(dim=-1)
    assert q is None and all(usable) and tokens == full.argmax(-1).tolist()
    # The whole vocabulary's drafts (a draft model's) likewise, and q is built as soon as one
    # request of the call samples.
    tokens, q = sample_drafts(greedy, list(range(6)), [[]] * 6, wide, 0)
    assert q is None and tokens == full.argmax(-1).tolist()
    mixed = SamplingMetadata.from_params([SamplingParams(temperature=0)] * 5 + [SamplingParams(seed=1)])
    tokens, q = sample_drafts(mixed, list(range(6)), [[]] * 6, wide, 0)
    assert q is not None and tokens[:5] == full.argmax(-1).tolist()[:5]
    # With an adjustment (a bias) in the call, q is built and the bias counts.
    biased = SamplingMetadata.from_params([SamplingParams(temperature=0, logit_bias={1: 100.0})] * 6,
                                          seeds=list(range(6)), prompt_token_ids=[[]] * 6, output_token_ids=[[]] * 6)
    tokens, q, _ = sample_from_draft_vocab(biased, list(range(6)), [[]] * 6, logits, vocab, 16, 0)
    assert q is not None and tokens == [1] * 6


def test_sampled_drafts_over_a_reduced_vocabulary_draw_from_the_full_pipelines_q() -> None:
    """Without penalties, bias, masks or grammar a head's q is built over its own columns and
    widened: the full pipeline's q over the widened logits (temperature, top-k, top-p, min-p),
    and each request's draft is drawn from it (chi-square at false alarm 1e-6 over 20,000
    requests; the unfiltered softmax, what a wrong pipeline would give, fails the same test)."""
    n, vocab = 20_000, torch.tensor([1, 4, 5, 9, 12, 13])
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -1.0, 0.8]]).expand(n, -1)
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.95, min_p=0.05)
    sampling = SamplingMetadata.from_params([params] * n, seeds=list(range(n)))
    tokens, q, usable = sample_from_draft_vocab(sampling, list(range(n)), [[]] * n, logits, vocab, 16, 0)
    full = process_logits(widen_vocab(logits[:1], vocab, 16), torch.zeros(1, dtype=torch.int64), sampling).softmax(-1)
    assert all(usable) and (q - full).abs().max() < 1e-6
    assert (full[0, vocab] > 0).sum() == 4  # the filters removed two of the six
    assert chi_square(torch.tensor(tokens), full[0].double() / full[0].double().sum()).passed
    unfiltered = widen_vocab(logits[:1] / 0.8, vocab, 16).double().softmax(-1)[0]
    assert not chi_square(torch.tensor(tokens), unfiltered).passed


@pytest.mark.parametrize("kind", KINDS)
def test_finished_requests_leave_no_drafter_state(kind: str) -> None:
    drafter = _drafter(learned.trained(kind))
    engine = _engine(learned.target(), drafter)
    for i, p in enumerate(learned.prompts(6, seed=2)):
        rid = engine.add_request(p, SamplingParams(temperature=0.8, seed=i, max_tokens=16, ignore_eos=True))
        if i == 3:
            engine.step()
            engine.abort(rid)
    run_all(engine)
    assert not drafter.store._segments
    if kind == "eagle":
        assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks and not drafter._confirmed


@pytest.mark.parametrize("kind", KINDS)
def test_head_files_round_trip_and_name_what_is_wrong(kind: str, tmp_path) -> None:
    head = learned.trained(kind)
    path = tmp_path / "head.safetensors"
    save_head(head, path, dtype=torch.float32)
    loaded = load_head(path, learned.target())
    assert loaded.config == head.config and torch.equal(loaded.draft_vocab, head.draft_vocab)
    for name, p in head.own_state().items():
        assert torch.equal(loaded.own_state()[name], p)
    other = tiny_model(seed=0, vocab=16)
    with pytest.raises(ValueError, match=r"head\.safetensors.* vocab_size=32; this target has vocab_size=16"):
        load_head(path, other)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match=r"plain\.safetensors.* is not a verispec draft head"):
        load_head(tmp_path / "plain.safetensors", learned.target())


@pytest.mark.parametrize("kind", KINDS)
def test_the_shipped_heads_are_in_the_package_for_the_embedded_model(kind: str) -> None:
    """What `--draft eagle|medusa` loads: present in a fresh checkout, shaped for SmolLM2-135M."""
    config = head_config(shipped_head(kind))
    assert config.kind == kind
    assert (config.target_vocab_size, config.hidden_size, config.target_num_layers) == (49152, 576, 30)


def test_llm_takes_a_head_file_and_refuses_the_shipped_head_for_another_model(tmp_path) -> None:
    tiny_checkpoint(tmp_path / "model", vocab=16)
    plain = LLM(model=str(tmp_path / "model"), draft="none", progress=False)
    head = new_head(HeadConfig.for_target("eagle", plain.model.config), plain.model, torch.arange(16))
    save_head(head, tmp_path / "eagle.safetensors")
    llm = LLM(model=str(tmp_path / "model"), draft=str(tmp_path / "eagle.safetensors"), progress=False)
    assert isinstance(llm.engine.drafter, EagleDrafter)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert llm.generate("t1 t2 t3", params)[0].token_ids == plain.generate("t1 t2 t3", params)[0].token_ids
    with pytest.raises(ValueError, match="train-drafter --kind medusa"):
        LLM(model=str(tmp_path / "model"), draft="medusa", progress=False)
