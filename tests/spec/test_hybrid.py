"""HybridDrafter (prompt lookup first, a learned head for the requests it finds no match for):
routing and the merged q rows; through the engine, greedy output token for token that of
plain decoding (chains and trees), sampled output distributed as the target (chi-square, false
alarm 1e-6) with lookup and head drafts verified side by side in the same steps."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from verispec import LLM, SamplingParams
from verispec.config import CacheConfig, DynamicTree, EngineConfig, SpeculativeConfig, TreeShape
from verispec.engine.engine import LLMEngine
from verispec.spec.base import DraftBatch, Drafter, DraftRequest
from verispec.spec.heads import HeadConfig, new_head, save_head
from verispec.spec.hybrid import HybridDrafter
from verispec.spec.medusa import MedusaDrafter
from verispec.spec.ngram import NgramDrafter
from verispec.spec.trees import TreeBatch

from .. import learned
from ..stats import chi_square
from ..tiny import run_all, tiny_checkpoint, word_tokenizer
from .test_learned import _drafter as head_drafter
from .test_tree_spec import sampled_first_tokens


class _Counted:
    """Counts the requests that asked the hybrid for drafts, and those it passed to the head;
    the rest got the lookup's drafts."""

    def __init__(self, hybrid: HybridDrafter) -> None:
        self.asked = self.learned = 0

        def counting(drafter: Drafter, name: str, count) -> None:
            method = getattr(drafter, name)

            def counted(requests, *shape):
                count(requests)
                return method(requests, *shape)

            setattr(drafter, name, counted)

        for name in ("propose", "propose_tree"):
            counting(hybrid, name, self._ask)
            counting(hybrid.learned, name, self._learn)

    def _ask(self, requests) -> None:
        self.asked += sum(r.num_draft_tokens > 0 for r in requests)

    def _learn(self, requests) -> None:
        self.learned += len(requests)

    @property
    def by_lookup(self) -> int:
        return self.asked - self.learned


def _hybrid(kind: str) -> HybridDrafter:
    return HybridDrafter(NgramDrafter(num_speculative_tokens=8), head_drafter(learned.trained(kind)))


def _engine(model, drafter: Drafter | None, tree: TreeShape | None = None, k: int = 3,
            max_seqs: int = 64) -> LLMEngine:
    """Fixed K (no adaptive K): every step drafts."""
    spec = SpeculativeConfig(method="none" if drafter is None else "ngram+eagle", tree=tree,
                             num_speculative_tokens=k, adaptive=False)
    config = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=4096, max_model_len=512,
                          cache=CacheConfig(4, 8192), speculative=spec)
    return LLMEngine(model, word_tokenizer(model.config.vocab_size), config, drafter)


class _Fixed(Drafter):
    """A learned drafter's stand-in: drafts tokens 1, 2, ... with a uniform q over 4 tokens."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def propose(self, requests: Sequence[DraftRequest]) -> DraftBatch:
        self.asked += [r.request_id for r in requests]
        tokens = [list(range(1, r.num_draft_tokens + 1)) for r in requests]
        return DraftBatch(tokens, torch.full((sum(map(len, tokens)), 4), 0.25))

    def propose_tree(self, requests: Sequence[DraftRequest], shape) -> TreeBatch:
        batch = self.propose(requests)
        return TreeBatch(batch.token_ids, [[-1] * len(t) for t in batch.token_ids], batch.probs, replacement=False)


def _request(rid: str, tokens: list[int], k: int, temperature: float = 0.7) -> DraftRequest:
    return DraftRequest(rid, tokens, k, SamplingParams(temperature=temperature), seed=0, step=0)


@pytest.mark.parametrize("tree", [False, True])
def test_lookup_drafts_where_the_context_repeats_and_the_head_elsewhere(tree: bool) -> None:
    """Requests with a match get the lookup's draft and one-hot q rows; the others, and only
    they, go to the learned drafter, whose rows arrive unchanged in batch order."""
    fixed = _Fixed()
    hybrid = HybridDrafter(NgramDrafter(num_speculative_tokens=3), fixed)
    requests = [_request("head-0", [0, 1, 2], 2), _request("lookup", [3, 0, 1, 3], 3),
                _request("none", [0, 1, 0], 0), _request("head-1", [2, 3], 1, temperature=0)]
    if tree:
        batch = hybrid.propose_tree(requests, (1, 1, 1))
        tokens, probs = batch.node_token_ids, batch.probs
        assert batch.node_parents == [[-1, -1], [-1, 0, 1], [], [-1]] and batch.replacement is False
    else:
        batch = hybrid.propose(requests)
        tokens, probs = batch.token_ids, batch.probs
    assert fixed.asked == ["head-0", "head-1"]
    assert tokens == [[1, 2], [0, 1, 3], [], [1]]
    uniform = torch.full((1, 4), 0.25)
    expected = torch.cat([uniform, uniform, torch.eye(4)[[0, 1, 3]], uniform])
    torch.testing.assert_close(probs, expected)


def test_all_lookup_drafts_need_no_q_rows() -> None:
    hybrid = HybridDrafter(NgramDrafter(num_speculative_tokens=2), _Fixed())
    batch = hybrid.propose([_request("a", [1, 2, 1], 2), _request("b", [3, 3], 2)])
    assert batch.token_ids == [[2, 1], [3, 3]] and batch.probs is None


@pytest.mark.parametrize("kind,tree", [("eagle", None), ("medusa", None), ("eagle-fused", None),
                                       ("eagle", DynamicTree(6, 3, 2)), ("medusa", (2, 2))])
def test_greedy_hybrid_output_is_plain_decoding_token_for_token(kind: str, tree) -> None:
    target = learned.target()
    prompts = [p + p[:3] for p in learned.prompts(6, seed=11)]  # repeats: the lookup has matches
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def greedy(drafter):
        engine = _engine(target, drafter, tree)
        ids = [engine.add_request(p, params) for p in prompts]
        done = run_all(engine)
        return [done[i].token_ids for i in ids], sum(o.stats.num_accepted_tokens for o in done.values())

    plain, _ = greedy(None)
    hybrid = _hybrid(kind)
    counted = _Counted(hybrid)
    outputs, accepted = greedy(hybrid)
    assert outputs == plain
    assert accepted > 0
    assert counted.learned > 0 and counted.by_lookup > 0


@pytest.mark.parametrize("tree", [None, DynamicTree(6, 3, 2)])
def test_sampled_hybrid_output_follows_the_target(tree) -> None:
    """20,000 seeded requests at temperature 0.7, top-p 0.9 from the prompt [1, 2, 3]: the first
    step has no lookup match (the head drafts), later steps of a request that emitted 1, 2 or 3
    have one, so steps verify lookup drafts (one-hot q) beside head drafts (q of an untrained
    EAGLE head whose draft vocabulary leaves tokens 6 and 7 out; with a tree, EAGLE's dynamic
    tree drawn without replacement beside lookup tries). The first two emitted tokens against
    p1(y1) p2(y2 | y1)."""
    vocab = learned.SAMPLED_VOCAB
    target, head, params, dist = learned.sampled_world("eagle", False, max_tokens=4)
    hybrid = HybridDrafter(NgramDrafter(num_speculative_tokens=3), head_drafter(head))
    counted = _Counted(hybrid)
    engine = _engine(target, hybrid, tree, max_seqs=1024)
    first, accepted = sampled_first_tokens(engine, params, 2)
    assert accepted > 1000
    assert counted.learned > 20_000 and counted.by_lookup > 1000  # the head drafted beyond first steps
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks

    p1 = dist([])
    p2 = torch.stack([dist([y]) for y in range(vocab)])  # [V, V]
    assert chi_square(first[:, 0] * vocab + first[:, 1], (p1[:, None] * p2).reshape(-1)).passed


def test_llm_takes_hybrid_drafts_and_names_a_bad_one(tmp_path) -> None:
    tiny_checkpoint(tmp_path / "model", vocab=16)
    model = str(tmp_path / "model")
    plain = LLM(model=model, draft="none", progress=False)
    head = new_head(HeadConfig.for_target("medusa", plain.model.config), plain.model, torch.arange(16))
    save_head(head, tmp_path / "medusa.safetensors")
    llm = LLM(model=model, draft=f"ngram+{tmp_path / 'medusa.safetensors'}", progress=False)
    assert isinstance(llm.engine.drafter, HybridDrafter) and isinstance(llm.engine.drafter.learned, MedusaDrafter)
    assert llm.engine.config.speculative.method == "ngram+medusa"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = "t1 t2 t3 t1 t2"
    assert llm.generate(prompt, params)[0].token_ids == plain.generate(prompt, params)[0].token_ids
    with pytest.raises(ValueError, match=r"draft='ngram\+t1' is invalid: after 'ngram\+' expected 'eagle', 'medusa'"):
        LLM(model=model, draft="ngram+t1", progress=False)
    with pytest.raises(ValueError, match="train-drafter --kind eagle"):
        LLM(model=model, draft="ngram+eagle", progress=False)
