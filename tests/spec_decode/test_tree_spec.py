"""Tree speculation through the engine (Medusa top-k trees, tree attention, verify_tree, KV
compaction): greedy output token for token that of plain decoding, with preemption; sampled
output distributed as the target (chi-square, false alarm 1e-6); no leaked blocks."""

from __future__ import annotations

import dataclasses

import numpy as np

import pytest
import torch

from verispec import LLM, SamplingParams
from verispec.cli import main
from verispec.config import CacheConfig, DynamicTree, EngineConfig, SpeculativeConfig, TreeShape
from verispec.engine.engine import LLMEngine
from verispec.spec_decode.base import Drafter
from verispec.spec_decode.draft_model import DraftModelDrafter
from verispec.spec_decode.heads import HeadConfig, new_head, save_head
from verispec.spec_decode.medusa import MedusaDrafter
from verispec.spec_decode.ngram import NgramDrafter, propose_ngram_tree
from verispec.spec_decode.trees import TreeBatch, static_tree

from .. import learned
from ..engine.test_logprobs import PARAMS, assert_records_match_the_oracle
from .test_learned import _drafter as head_drafter, _hidden
from ..stats import chi_square
from ..tiny import run_all, tiny_checkpoint, tiny_model, word_tokenizer


def _engine(model, drafter: Drafter | None, tree: TreeShape | None, max_seqs: int = 64,
            num_blocks: int = 8192, k: int = 5, adaptive: bool = False) -> LLMEngine:
    method = "none" if drafter is None else "ngram" if isinstance(drafter, NgramDrafter) else "medusa"
    spec = SpeculativeConfig(method=method, tree=tree, num_speculative_tokens=k, adaptive=adaptive)
    config = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=4096, max_model_len=512,
                          cache=CacheConfig(4, num_blocks), speculative=spec)
    return LLMEngine(model, word_tokenizer(model.config.vocab_size), config, drafter)


def _greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 24) -> tuple[list[list[int]], dict]:
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           request_id=str(i))
    done = run_all(engine)
    return [done[str(i)].token_ids for i in range(len(prompts))], done


def test_static_tree_is_breadth_first_and_truncates_to_the_budget() -> None:
    nodes = static_tree((2, 2, 1), 100)
    assert [n.parent for n in nodes] == [-1, -1, 0, 0, 1, 1, 2, 3, 4, 5]
    assert [n.depth for n in nodes] == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    assert [n.rank for n in nodes] == [0, 1, 0, 1, 0, 1, 0, 0, 0, 0]
    assert static_tree((2, 2, 1), 3) == nodes[:3]


@pytest.mark.parametrize("tree", [(), (3, 0), [3, 2], (True,), (8, 8)])
def test_bad_tree_shapes_name_the_setting(tree) -> None:
    with pytest.raises(ValueError, match="tree="):
        SpeculativeConfig(method="medusa", tree=tree)


def test_a_tree_counts_its_nodes_and_needs_token_verification() -> None:
    assert SpeculativeConfig(method="medusa", tree=(3, 2, 1)).num_draft_tokens == 15
    with pytest.raises(ValueError, match="verification="):
        SpeculativeConfig(method="medusa", tree=(2,), verification="block")


@pytest.mark.parametrize("tokens,parents,probs", [
    ([[1, 2]], [[-1]], None),
    ([[1, 2]], [[-1, 1]], None),
    ([[1, 2]], [[-1, 0]], torch.zeros(3, 4)),
])
def test_tree_batches_are_checked(tokens, parents, probs) -> None:
    with pytest.raises(ValueError, match="node_token_ids|node_parents|probs"):
        TreeBatch(tokens, parents, probs)


def _trained_drafter(kind: str) -> Drafter:
    return head_drafter(learned.trained(kind))


@pytest.mark.parametrize("kind,tree,num_blocks", [
    ("medusa", (3, 2, 1), 8192), ("medusa", (4, 1, 1), 8192), ("medusa", (2, 2, 2), 40),
    ("medusa", DynamicTree(8, 3, 3), 40), ("eagle", (3, 2, 1), 8192), ("eagle", (2, 2, 2), 40),
    ("eagle", DynamicTree(10, 4, 3), 8192), ("eagle", DynamicTree(6, 3, 2), 40),
    ("eagle-fused", DynamicTree(6, 3, 2), 40),
])
def test_greedy_tree_output_is_plain_decoding_token_for_token(kind: str, tree: TreeShape, num_blocks: int) -> None:
    """Batched, with 40 blocks of 4 small enough to preempt; static and dynamic trees."""
    target, prompts = learned.target(), learned.prompts(6, seed=11)
    plain, _ = _greedy(_engine(target, None, None), prompts)
    drafter = _trained_drafter(kind)
    engine = _engine(target, drafter, tree, num_blocks=num_blocks)
    batched, done = _greedy(engine, prompts)
    assert batched == plain
    assert sum(o.stats.num_accepted_tokens for o in done.values()) > 0
    assert engine.blocks.num_free_blocks == num_blocks
    assert engine.blocks.seq_ids() == []
    if kind.startswith("eagle"):  # drafting rolled the head's cache back to nothing
        assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_a_one_branch_tree_drafts_what_the_chain_drafts(kind: str) -> None:
    """Tree (1, 1, 1) takes each level's most likely token: the greedy chain of K = 3, so the
    same drafts are accepted step by step."""
    target, prompts = learned.target(), learned.prompts(6, seed=11)
    stats = []
    for tree in (None, (1, 1, 1)):
        _, done = _greedy(_engine(target, _trained_drafter(kind), tree, k=3), prompts)
        stats.append([(o.stats.num_draft_tokens, o.stats.num_accepted_tokens) for o in done.values()])
    assert stats[0] == stats[1]
    assert sum(a for _, a in stats[0]) > 0


@pytest.mark.parametrize("shape,budget,tokens,parents", [
    ((3, 1, 1), 64, [5, 1, 2, 4, 1, 2, 3, 1, 2], [-1, 0, 1, -1, 3, 4, -1, 6, 7]),
    ((2, 1, 1), 64, [5, 1, 2, 4, 1, 2], [-1, 0, 1, -1, 3, 4]),
    ((3, 1, 1), 4, [5, 1, 2, 4], [-1, 0, 1, -1]),
    ((3, 1), 64, [5, 1, 4, 1, 3, 1], [-1, 0, -1, 2, -1, 4]),
])
def test_ngram_trees_merge_the_continuations_of_several_matches(shape, budget, tokens, parents) -> None:
    context = np.array([1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2])  # "1 2" was followed by 3, 4, 5
    assert propose_ngram_tree(context, 1, 2, shape, budget) == (tokens, parents)


def test_ngram_trees_leave_out_the_continuations_of_avoided_tokens() -> None:
    context = np.array([1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2])
    assert propose_ngram_tree(context, 1, 2, (3, 1, 1), 64, avoid={4}) == ([5, 1, 2, 3, 1, 2], [-1, 0, 1, -1, 3, 4])


def test_ngram_trees_share_prefixes() -> None:
    context = np.array([7, 1, 2, 3, 9, 1, 2, 4, 9, 1])  # "1" was followed by "2 3" and "2 4"
    assert propose_ngram_tree(context, 1, 1, (2, 2), 64) == ([2, 4, 3], [-1, 0, 0])


@pytest.mark.parametrize("num_blocks", [8192, 24])
def test_greedy_ngram_tree_output_is_plain_decoding_token_for_token(num_blocks: int) -> None:
    model = tiny_model(seed=0, scale=3.0)
    prompts = [[1, 2, 3, 1, 2, 4, 1, 2, 3, 1], [5, 6, 7, 5, 6, 8, 5], [9, 9, 9], [3, 1, 4, 1, 5, 9, 2, 6]]
    plain, _ = _greedy(_engine(model, None, None), prompts, max_tokens=20)
    engine = _engine(model, NgramDrafter(1, 3, 4), (3, 2, 1), num_blocks=num_blocks)
    batched, done = _greedy(engine, prompts, max_tokens=20)
    assert batched == plain
    assert sum(o.stats.num_accepted_tokens for o in done.values()) > 0
    assert engine.blocks.num_free_blocks == num_blocks


@pytest.mark.parametrize("tree", [(2, 1), DynamicTree(4, 2, 2)])
def test_a_drafter_without_trees_drafts_a_chain_in_tree_mode(tree: TreeShape) -> None:
    """The draft model's drafter keeps the default propose_tree (one branch of up to the
    tree's node count): still plain decoding's tokens, with preemption."""
    target, prompts = learned.target(), learned.prompts(4, seed=11)
    plain, _ = _greedy(_engine(target, None, None), prompts)
    drafter = DraftModelDrafter(tiny_model(seed=4, vocab=learned.VOCAB, scale=0.5), num_blocks=256, block_size=4)
    engine = _engine(target, drafter, tree, num_blocks=40)
    batched, done = _greedy(engine, prompts)
    assert batched == plain
    assert sum(o.stats.num_accepted_tokens for o in done.values()) > 0
    assert engine.blocks.num_free_blocks == 40


def test_the_tree_gate_keeps_trees_that_pay_and_drops_those_that_do_not() -> None:
    """Adaptive (TreeGate): a poor drafter's trees in a batch of 8 give way to probes, a perfect
    drafter (the target itself) keeps drafting all its nodes; the tokens are plain decoding's."""
    target, prompts = learned.target(), learned.prompts(8, seed=11)
    plain, _ = _greedy(_engine(target, None, None), prompts)

    def drafted(drafter: Drafter, prompts, adaptive: bool) -> tuple[list[list[int]], int]:
        outputs, done = _greedy(_engine(target, drafter, (3, 2, 1), adaptive=adaptive), prompts)
        return outputs, sum(o.stats.num_draft_tokens for o in done.values())

    poor = lambda: DraftModelDrafter(tiny_model(seed=4, vocab=learned.VOCAB, scale=0.5), 256, 4)  # noqa: E731
    gated, gated_nodes = drafted(poor(), prompts, adaptive=True)
    fixed, fixed_nodes = drafted(poor(), prompts, adaptive=False)
    assert gated == fixed == plain
    assert gated_nodes < fixed_nodes / 3
    _, kept = drafted(DraftModelDrafter(target, 256, 4), prompts[:2], adaptive=True)
    _, every = drafted(DraftModelDrafter(target, 256, 4), prompts[:2], adaptive=False)
    assert kept == every > 0


@pytest.mark.parametrize("kind,tree,num_blocks", [("medusa", (3, 2, 1), 40), ("medusa", (3, 2, 1), 8192),
                                                  ("eagle", (2, 1), 40), ("eagle", DynamicTree(6, 3, 2), 40),
                                                  ("eagle-fused", DynamicTree(6, 3, 2), 40)])
def test_tree_steps_hand_drafters_the_targets_own_hidden_states(kind: str, tree, num_blocks: int) -> None:
    """Every feature a drafter reads after tree steps (accepted paths moved, other nodes
    dropped), with CFG companions and preemption (40 blocks), is the target's hidden state of
    that position computed afresh from the request's tokens; without preemption, the feature
    Medusa needs is there at every step after the first (the accepted path's last node's)."""
    target = learned.target()
    drafter = _trained_drafter(kind)
    tokens_of: dict[str, list[int]] = {}
    checked = []
    propose_tree, features = drafter.propose_tree, drafter.store.features

    empty_after_first = []

    def spy_propose_tree(requests, shape):
        tokens_of.update({r.request_id: list(r.token_ids) for r in requests})
        trees = propose_tree(requests, shape)
        empty_after_first.extend(r.request_id for r, t in zip(requests, trees.node_token_ids)
                                 if r.output_token_ids and r.num_draft_tokens and not t)
        return trees

    def spy_features(rid, begin, end):
        got = features(rid, begin, end)
        torch.testing.assert_close(got, _hidden(target, tokens_of[rid][:end], drafter.hidden_layers)[begin:end],
                                   atol=1e-4, rtol=1e-4)
        checked.append(end - begin)
        return got

    drafter.propose_tree, drafter.store.features = spy_propose_tree, spy_features
    engine = _engine(target, drafter, tree, num_blocks=num_blocks)
    for i, p in enumerate(learned.prompts(8, seed=5)):
        engine.add_request(p, SamplingParams(temperature=0.9, seed=i, max_tokens=20, ignore_eos=True,
                                             **({"guidance_scale": 1.5} if i % 3 == 0 else {})))
    done = run_all(engine)
    assert sum(o.stats.num_accepted_tokens for o in done.values()) > 0
    assert sum(checked) > 8 * 10
    if kind == "medusa" and num_blocks == 8192:
        assert empty_after_first == []


def test_a_tree_accepts_more_per_step_than_its_first_branch() -> None:
    """Same heads, same prompts: the tree (3, 2, 1) verifies the chain (1, 1, 1) as its first
    branch and more, so greedy decoding needs no more steps with it."""
    target, prompts = learned.target(), learned.prompts(6, seed=11)
    accepted = []
    for tree in ((1, 1, 1), (3, 2, 1)):
        _, done = _greedy(_engine(target, MedusaDrafter(learned.trained("medusa")), tree), prompts)
        accepted.append(sum(o.stats.num_accepted_tokens for o in done.values()))
    assert accepted[1] > accepted[0]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "top-k", "presence"])
def test_tree_logprobs_match_the_oracle(params: SamplingParams) -> None:
    """Records of accepted path tokens and of recovered / bonus tokens: the target's row at
    each, as a plain forward over the emitted tokens computes it."""
    target, prompts = learned.target(), learned.prompts(4, seed=11)
    engine = _engine(target, MedusaDrafter(learned.trained("medusa")), (3, 2, 1))
    ids = [engine.add_request(p, params) for p in prompts]
    done = run_all(engine)
    assert sum(done[r].stats.num_accepted_tokens for r in ids) > 0
    for rid, prompt in zip(ids, prompts):
        assert_records_match_the_oracle(target, prompt, done[rid], params)


@pytest.mark.parametrize("kind,tree,adaptive", [("eagle", DynamicTree(6, 3, 2), False), ("medusa", (3, 2), False),
                                               ("medusa", (3, 2), True)])
def test_sampled_trees_are_batch_invariant_and_greedy_requests_beside_them_stay_plain(kind: str, tree,
                                                                                      adaptive: bool) -> None:
    """A seeded T = 0.7 request draws its tree from its own streams: the same tokens alone and
    among other sampled and greedy requests (with the tree gate too: it prices seeded requests
    at batch size 1); the greedy request in that batch (ranked children, its q rows unused)
    still decodes as without drafts."""
    target, prompts = learned.target(), learned.prompts(4, seed=11)
    plain, _ = _greedy(_engine(target, None, None), prompts[:1])
    seeded = SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True)

    def run(batch):
        engine = _engine(target, _trained_drafter(kind), tree, adaptive=adaptive)
        if adaptive:  # a 9-node tree probe waits ~27 steps by default: within these 24 tokens, every ~4
            engine.adaptive.probe_interval = 1
        ids = [engine.add_request(p, params) for p, params in batch]
        done = run_all(engine)
        return [done[i].token_ids for i in ids], sum(o.stats.num_accepted_tokens for o in done.values())

    (alone,), _ = run([(prompts[1], seeded)])
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs, accepted = run([(prompts[0], greedy), (prompts[2], others), (prompts[1], seeded), (prompts[3], others)])
    assert outputs[2] == alone
    assert outputs[0] == plain[0]
    assert accepted > 0


def sampled_first_tokens(engine: LLMEngine, params: SamplingParams, n: int) -> tuple[torch.Tensor, int]:
    """20,000 requests of learned.SAMPLED_PROMPT with `params` seeded 0, 1, ...: each one's
    first n tokens ([20000, n]), the request aborted then, and the drafts accepted until then."""
    for i in range(20_000):
        engine.add_request(learned.SAMPLED_PROMPT, dataclasses.replace(params, seed=i))
    first, accepted = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if len(out.token_ids) >= n and out.request_id not in first:
                first[out.request_id] = out.token_ids[:n]
                accepted += out.stats.num_accepted_tokens
                engine.abort(out.request_id)
    return torch.tensor(list(first.values())), accepted


@pytest.mark.parametrize("kind,cfg", [("medusa", False), ("medusa", True), ("eagle", False)])
def test_sampled_tree_output_follows_the_target(kind: str, cfg: bool) -> None:
    """20,000 seeded requests at temperature 0.7, top-p 0.9 (and CFG): the first three emitted
    tokens against p1(y1) p2(y2 | y1) p3(y3 | y1, y2) from the target itself, and the first
    two alone. Medusa drafts from the second step on, so y2 and y3 come from a tree: (3, 2), three
    siblings drawn without replacement from q and tested in turn (recursive rejection
    sampling), then their children; with CFG (2, 1), to halve the rows of the two sequences.
    EAGLE drafts from the first step, a dynamic tree (6 nodes, 3 levels, top 2), drawn.
    The heads are untrained and their draft vocabulary leaves tokens 6 and 7 out."""
    vocab = learned.SAMPLED_VOCAB
    target, head, params, dist = learned.sampled_world(kind, cfg, max_tokens=12)
    drafter = head_drafter(head)
    tree = DynamicTree(6, 3, 2) if kind == "eagle" else (2, 1) if cfg else (3, 2)
    engine = _engine(target, drafter, tree, max_seqs=1024)
    first, accepted = sampled_first_tokens(engine, params, 3)
    assert accepted > 1000
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks

    p1 = dist([])
    p2 = torch.stack([dist([y]) for y in range(vocab)])  # [V, V]
    p3 = torch.stack([torch.stack([dist([y, z]) for z in range(vocab)]) for y in range(vocab)])  # [V, V, V]
    assert chi_square(first[:, 0] * vocab + first[:, 1], (p1[:, None] * p2).reshape(-1)).passed
    joint = p1[:, None, None] * p2[:, :, None] * p3
    cells = (first[:, 0] * vocab + first[:, 1]) * vocab + first[:, 2]
    assert chi_square(cells, joint.reshape(-1)).passed


def test_llm_and_cli_take_a_tree(tmp_path, capsys) -> None:
    """LLM(tree=...) and `--tree` with a Medusa head file: greedy text as without drafts."""
    tiny_checkpoint(tmp_path / "model", vocab=16)
    model = str(tmp_path / "model")
    plain = LLM(model=model, draft="none", progress=False)
    head = new_head(HeadConfig.for_target("medusa", plain.model.config, num_medusa_heads=3), plain.model,
                    torch.arange(16))
    save_head(head, tmp_path / "medusa.safetensors")
    draft = str(tmp_path / "medusa.safetensors")
    llm = LLM(model=model, draft=draft, tree=(3, 2, 1), progress=False)
    assert llm.engine.config.speculative.tree == (3, 2, 1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate("t1 t2 t3", params)[0]
    assert out.token_ids == plain.generate("t1 t2 t3", params)[0].token_ids
    assert out.stats.num_draft_tokens > 0
    texts = []
    for args in (["--draft", "none"], ["--draft", draft, "--tree", "3,2,1"], ["--tree", "2,1"],
                 ["--draft", draft, "--tree", "dynamic:8,3,2"]):
        assert main(["generate", "--model", model, "--no-chat", "--temperature", "0", "--max-tokens", "12",
                     *args, "t4 t5 t4 t5"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] == texts[2] == texts[3]
    with pytest.raises(SystemExit):
        main(["generate", "--model", model, "--tree", "3,x", "t1"])
    assert "'3,x' is invalid" in capsys.readouterr().err
