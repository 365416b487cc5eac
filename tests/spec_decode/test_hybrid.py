"""HybridDrafter (prompt lookup first, a learned head for the chains it finds no match for,
trees grafted from both): routing and the merged q rows; grafted sibling groups exact only
with the lookup's tokens masked out of the head's q (chi-square, false alarm 1e-6, and the
unmasked version failing it); through the engine, greedy output token for token that of plain
decoding (chains and trees), sampled output distributed as the target with lookup and head
drafts verified side by side in the same steps."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from verispec import LLM, SamplingMetadata, SamplingParams
from verispec.config import CacheConfig, DynamicTree, EngineConfig, SpeculativeConfig, TreeShape
from verispec.engine.engine import LLMEngine
from verispec.sample import DraftProbs
from verispec.sample.tree import verify_tree
from verispec.spec_decode import draft_sampling
from verispec.spec_decode.base import DraftBatch, Drafter, DraftRequest
from verispec.spec_decode.draft_sampling import grow_tree_batch
from verispec.spec_decode.heads import HeadConfig, new_head, save_head
from verispec.spec_decode.adaptive import PRIOR
from verispec.spec_decode.hybrid import LOOKUP_MIN_N, HybridDrafter
from verispec.spec_decode.medusa import MedusaDrafter
from verispec.spec_decode.ngram import NgramDrafter
from verispec.spec_decode.trees import TreeBatch

from .. import learned
from ..stats import chi_square
from ..tiny import run_all, tiny_checkpoint, word_tokenizer
from .test_learned import _drafter as head_drafter
from .test_tree_spec import sampled_first_tokens


class _Counted:
    """Counts, over a run, the requests the lookup drafted for, those the learned drafter was
    asked to draft for, and (trees) those whose tree grafted the head's beside a lookup trie."""

    def __init__(self, hybrid: HybridDrafter) -> None:
        self.by_lookup = self.learned = self.grafted = 0
        for name in ("propose", "propose_tree"):
            self._spy(hybrid.lookup, name, self._looked_up)
            self._spy(hybrid.learned, name, self._learn)

    @staticmethod
    def _spy(drafter: Drafter, name: str, seen) -> None:
        method = getattr(drafter, name)

        def spied(requests, *args):
            out = method(requests, *args)
            seen(requests, args, out)
            return out

        setattr(drafter, name, spied)

    def _looked_up(self, requests, args, out) -> None:
        drafts = out.node_token_ids if isinstance(out, TreeBatch) else out.token_ids
        self.by_lookup += sum(map(bool, drafts))

    def _learn(self, requests, args, out) -> None:
        self.learned += len(requests)
        if len(args) == 2:  # propose_tree(requests, shape, exclude)
            self.grafted += sum(map(bool, args[1]))


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
    """A learned drafter's stand-in: drafts the tokens 1, 2, ... it is not asked to avoid, with
    a uniform q over 4 tokens; trees are root children only."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.avoided: list[set[int]] = []

    def propose(self, requests: Sequence[DraftRequest]) -> DraftBatch:
        return self._drafts(requests, [set() for _ in requests])

    def propose_tree(self, requests: Sequence[DraftRequest], shape, exclude=None) -> TreeBatch:
        batch = self._drafts(requests, [set(e) for e in exclude])
        return TreeBatch(batch.token_ids, [[-1] * len(t) for t in batch.token_ids], batch.probs, replacement=False)

    def _drafts(self, requests: Sequence[DraftRequest], avoid: list[set[int]]) -> DraftBatch:
        self.asked += [r.request_id for r in requests]
        self.avoided += avoid
        tokens = [[t for t in range(1, r.num_draft_tokens + 1 + len(a)) if t not in a][: r.num_draft_tokens]
                  for r, a in zip(requests, avoid)]
        return DraftBatch(tokens, torch.full((sum(map(len, tokens)), 4), 0.25))


def _request(rid: str, tokens: list[int], k: int, temperature: float = 0.7) -> DraftRequest:
    return DraftRequest(rid, tokens, k, SamplingParams(temperature=temperature), seed=0, step=0)


def _requests() -> list[DraftRequest]:
    return [_request("head-0", [0, 1, 2], 2), _request("lookup", [3, 0, 1, 3], 3),
            _request("none", [0, 1, 0], 0), _request("head-1", [2, 3], 1, temperature=0)]


def test_chains_come_from_the_lookup_where_the_context_repeats_and_from_the_head_elsewhere() -> None:
    """Requests with a match get the lookup's draft and one-hot q rows; the others, and only
    they, go to the learned drafter, whose rows arrive unchanged in batch order."""
    fixed = _Fixed()
    batch = HybridDrafter(NgramDrafter(num_speculative_tokens=3), fixed).propose(_requests())
    assert fixed.asked == ["head-0", "head-1"]
    assert batch.token_ids == [[1, 2], [0, 1, 3], [], [1]]
    uniform = torch.full((1, 4), 0.25)
    torch.testing.assert_close(batch.probs, torch.cat([uniform, uniform, torch.eye(4)[[0, 1, 3]], uniform]))


def test_trees_graft_the_head_beside_the_lookup_trie() -> None:
    """The lookup's trie takes at most half of a request's nodes (rounded up) and comes first;
    the learned drafter fills the rest under the same root, asked to avoid the trie's root
    tokens; q rows: one-hot for the trie, the learned drafter's after them."""
    fixed = _Fixed()
    batch = HybridDrafter(NgramDrafter(num_speculative_tokens=3), fixed).propose_tree(_requests(), (1, 1, 1))
    assert fixed.asked == ["head-0", "lookup", "head-1"]
    assert fixed.avoided == [set(), {0}, set()]
    assert batch.node_token_ids == [[1, 2], [0, 1, 1], [], [1]]
    assert batch.node_parents == [[-1, -1], [-1, 0, -1], [], [-1]] and batch.replacement is False
    uniform = torch.full((1, 4), 0.25)
    torch.testing.assert_close(batch.probs, torch.cat([uniform, uniform, torch.eye(4)[[0, 1]], uniform, uniform]))


class _Drawn(Drafter):
    """Trees of root children drawn from fixed draft logits by the path EAGLE's and Medusa's
    trees take (grow_tree_batch: ranked when greedy, drawn without replacement when sampled)."""

    def __init__(self, logits: torch.Tensor) -> None:  # [V]
        self.logits = logits

    def propose(self, requests: Sequence[DraftRequest]) -> DraftBatch:
        return DraftBatch([[] for _ in requests])

    def propose_tree(self, requests: Sequence[DraftRequest], shape, exclude=None) -> TreeBatch:
        active = [i for i, r in enumerate(requests) if r.num_draft_tokens > 0]
        vocab = torch.arange(self.logits.numel())
        return grow_tree_batch(requests, active, shape, self.logits.expand(len(active), -1), vocab,
                               self.logits.numel(), expand=None, exclude=exclude)


def _grafted_first_tokens(n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """n seeded requests of context 5 0 5 at temperature 1 (lookup: token 0 after the match
    of 5) draft grafted trees of 4 root children: 0 from the lookup, then 3 drawn from a q
    that favours 0 (0.6) where the target rarely takes it (0.1). Returns the first emitted
    tokens, p, and how many drawn siblings were 0."""
    p = torch.tensor([0.1, 0.3, 0.2, 0.2, 0.1, 0.1], dtype=torch.float64)
    q = torch.tensor([0.6, 0.1, 0.1, 0.1, 0.05, 0.05])
    params = SamplingParams(temperature=1.0)
    requests = [DraftRequest(str(i), [5, 0, 5], 4, params, seed=i, step=0) for i in range(n)]
    batch = HybridDrafter(NgramDrafter(), _Drawn(q.log())).propose_tree(requests, (4,))
    assert all(len(t) == 4 and t[0] == 0 for t in batch.node_token_ids)
    ids = torch.tensor([t for tokens in batch.node_token_ids for t in tokens])
    target = p.log().float().expand(5 * n, -1).contiguous()  # the root row and each node's (bonus) row
    sampling = SamplingMetadata.from_params([params] * n, seeds=list(range(n)))
    out = verify_tree(target, ids, torch.full((4 * n,), -1), torch.arange(n + 1) * 4, sampling,
                      draft=DraftProbs(batch.probs), replacement=batch.replacement)
    drawn_zeros = int((ids.view(n, 4)[:, 1:] == 0).sum())
    return out.token_ids[:, 0], p, drawn_zeros


def test_grafted_trees_are_exact_only_with_the_lookup_tokens_left_out_of_q(monkeypatch) -> None:
    """The first emitted token of grafted trees follows p (chi-square, false alarm 1e-6); drawn
    from q without masking the lookup's token (a sibling may repeat it, and its row would not be
    the distribution it was drawn from), the same statistic fails."""
    tokens, p, drawn_zeros = _grafted_first_tokens(20_000)
    assert drawn_zeros == 0
    assert chi_square(tokens, p).passed
    monkeypatch.setattr(draft_sampling, "_masked", lambda logits, *args: logits)
    tokens, p, drawn_zeros = _grafted_first_tokens(20_000)
    assert drawn_zeros > 10_000
    result = chi_square(tokens, p)
    assert result.statistic > result.threshold, result


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
    assert (counted.grafted > 0) == (tree is not None)


@pytest.mark.parametrize("tree", [None, DynamicTree(6, 3, 2)])
def test_sampled_hybrid_output_follows_the_target(tree) -> None:
    """20,000 seeded requests at temperature 0.7, top-p 0.9 from the prompt [1, 2, 3]: the first
    step has no lookup match (the head drafts), later steps of a request that emitted 1, 2 or 3
    have one, so steps verify lookup drafts (one-hot q) beside head drafts (q of an untrained
    EAGLE head whose draft vocabulary leaves tokens 6 and 7 out; with a tree, EAGLE's dynamic
    tree drawn without replacement grafted beside lookup tries, its root children drawn from q
    without the tries' root tokens). The first two emitted tokens against
    p1(y1) p2(y2 | y1)."""
    vocab = learned.SAMPLED_VOCAB
    target, head, params, dist = learned.sampled_world("eagle", False, max_tokens=4)
    hybrid = HybridDrafter(NgramDrafter(num_speculative_tokens=3), head_drafter(head))
    counted = _Counted(hybrid)
    engine = _engine(target, hybrid, tree, max_seqs=1024)
    first, accepted = sampled_first_tokens(engine, params, 2)
    assert accepted > 1000
    assert counted.learned > 20_000 and counted.by_lookup > 1000  # the head drafted beyond first steps
    assert (counted.grafted > 1000) == (tree is not None)
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


def test_the_hybrid_tells_lookup_drafts_from_head_drafts_before_drafting() -> None:
    """Class 0: the head drafts (no lookup match, or one shorter than the lookup's min_n); class
    n: the lookup's match of length n, priced by its rows alone (free_classes)."""
    hybrid = HybridDrafter(NgramDrafter(min_n=LOOKUP_MIN_N, max_n=3), _Fixed())
    assert hybrid.class_priors[0] == PRIOR and hybrid.class_priors[2:] == NgramDrafter.class_priors[2:]
    assert hybrid.free_classes == {1, 2, 3} and 0 not in hybrid.free_classes
    assert hybrid.draft_class("r", [0, 1, 2, 1]) == 0  # a 1-token match: the head's
    assert hybrid.draft_class("r", [0, 1, 2, 0, 1]) == 2
    assert hybrid.propose([_request("r", [0, 1, 2, 0, 1], 2)]).token_ids == [[2, 0]]


def test_llm_builds_the_hybrids_lookup_with_two_token_matches_at_least() -> None:
    llm = LLM(draft="ngram+medusa", progress=False)
    assert llm.engine.drafter.lookup.min_n == LOOKUP_MIN_N == 2
    assert llm.engine.adaptive.class_priors == llm.engine.drafter.class_priors
    assert llm.engine.adaptive.free_classes == llm.engine.drafter.free_classes
