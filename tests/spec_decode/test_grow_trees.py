"""grow_trees (spec_decode/trees.py): static shapes filled rank by rank, EAGLE-2 dynamic trees kept by
path score, drawn (sampled) children kept in draw order, draws without replacement, and the
command-line form of trees."""

from __future__ import annotations

import math

import pytest
import torch

from verispec import SamplingParams
from verispec.config import DynamicTree, SpeculativeConfig, parse_tree
from verispec.spec_decode.base import DraftRequest
from verispec.spec_decode.draft_sampling import draw_without_replacement, grow_tree_batch
from verispec.spec_decode.trees import Children, GrownTree, branching, grow_trees, static_tree

from ..stats import chi_square

VOCAB = torch.tensor([10, 11, 12, 13])  # draft column -> target token id


def _probs_logits(rows: list[list[float]]) -> torch.Tensor:  # [R, 4]
    return torch.tensor(rows).log()


def _by_token(table: dict[int, list[float]]):
    """An expand whose children's distribution depends on the expanded node's token only,
    recording which (depth, token) nodes it was asked for."""
    calls: list[list[tuple[int, int]]] = []

    def expand(trees: list[GrownTree], nodes: list[list[int]]) -> torch.Tensor:
        calls.append([(trees[r].depths[j], trees[r].token_ids[j]) for r, chosen in enumerate(nodes) for j in chosen])
        return _probs_logits([table[trees[r].token_ids[j]] for r, chosen in enumerate(nodes) for j in chosen])

    return expand, calls


TABLE = {10: [0.1, 0.2, 0.3, 0.4], 11: [0.6, 0.2, 0.15, 0.05], 12: [0.25, 0.25, 0.4, 0.1], 13: [0.4, 0.3, 0.2, 0.1]}


def test_a_static_shape_takes_each_parents_ranked_tokens_breadth_first() -> None:
    expand, calls = _by_token(TABLE)
    root = _probs_logits([[0.5, 0.3, 0.15, 0.05], [0.1, 0.1, 0.2, 0.6]])
    (first, second), probs = grow_trees((2, 2, 1), [10, 4], root, VOCAB, expand)
    assert probs is None  # ranked children are deterministic drafts
    plan = static_tree((2, 2, 1), 10)
    assert first.parents == [n.parent for n in plan] and first.depths == [n.depth for n in plan]
    # Root: 10 then 11. Children of 10: 13, 12; of 11: 10, 11.
    # Depth 3: the best child of each: of 13 -> 10, of 12 -> 12, of 10 -> 13, of 11 -> 10.
    assert first.token_ids == [10, 11, 13, 12, 10, 11, 10, 12, 13, 10]
    assert second.token_ids == [13, 12, 10, 11] and second.parents == [-1, -1, 0, 0]
    # Each level is one call for both requests; depth-2 nodes of the second request are not
    # expanded (its budget has no depth-3 nodes).
    assert calls == [[(1, 10), (1, 11), (1, 13)], [(2, 13), (2, 12), (2, 10), (2, 11)]]
    assert first.scores[2] == pytest.approx(math.log(0.5 * 0.4))


def test_a_dynamic_tree_keeps_the_best_paths() -> None:
    expand, calls = _by_token(TABLE)
    root = _probs_logits([[0.5, 0.3, 0.15, 0.05]])
    (tree,), _ = grow_trees(DynamicTree(nodes=4, depth=3, top_k=2), [4], root, VOCAB, expand)
    # Drawn: 10 (.5), 11 (.3); children of 10: 13 (.2), 12 (.15); of 11: 10 (.18), 11 (.06);
    # depth 3 expands the best two of depth 2, 13 under 10 (.2) and 10 under 11 (.18):
    # 10 (.08), 11 (.06) and 13 (.072), 12 (.054). The best four: .5, .3, .2, .18.
    assert calls[1] == [(2, 13), (2, 10)]
    assert tree.token_ids == [10, 11, 13, 10]
    assert tree.parents == [-1, -1, 0, 1]
    assert tree.scores == pytest.approx([math.log(p) for p in (0.5, 0.3, 0.2, 0.18)])


@pytest.mark.parametrize("seed", range(20))
def test_dynamic_trees_are_trees_of_the_best_scores_within_budget(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(64, 4, generator=generator) * 3

    def expand(trees, nodes):
        return torch.stack([logits[(trees[r].token_ids[j] * 7 + trees[r].depths[j] * 3 + r) % 64]
                            for r, chosen in enumerate(nodes) for j in chosen])

    shape = DynamicTree(nodes=int(torch.randint(1, 12, (), generator=generator)), depth=4, top_k=3)
    budgets = [shape.nodes, max(1, shape.nodes // 2), 64]
    trees, _ = grow_trees(shape, budgets, torch.randn(3, 4, generator=generator), VOCAB, expand)
    for tree, budget in zip(trees, budgets):
        assert 1 <= len(tree.token_ids) <= budget
        for j, parent in enumerate(tree.parents):
            assert -1 <= parent < j
            if parent >= 0:
                assert tree.scores[j] <= tree.scores[parent] + 1e-6
                assert tree.depths[j] == tree.depths[parent] + 1
        # Siblings are distinct tokens: a path is never drafted twice.
        siblings = [(p, t) for p, t in zip(tree.parents, tree.token_ids)]
        assert len(set(siblings)) == len(siblings)
    assert max(trees[2].depths) <= shape.depth


def test_a_static_shape_wider_than_the_draft_vocabulary_is_clipped_to_it() -> None:
    expand, _ = _by_token(TABLE)
    (tree,), _ = grow_trees((6, 1), [64], _probs_logits([[0.5, 0.3, 0.15, 0.05]]), VOCAB, expand)
    assert tree.token_ids == [10, 11, 12, 13, 13, 10, 12, 10]
    assert tree.parents == [-1, -1, -1, -1, 0, 1, 2, 3]


def test_branching_bounds_a_dynamic_tree_for_static_fillers() -> None:
    assert branching((3, 2)) == (3, 2)
    assert branching(DynamicTree(nodes=8, depth=3, top_k=2)) == (2, 2, 2)


@pytest.mark.parametrize("text,expected", [
    ("3,2,1", (3, 2, 1)), ("4", (4,)), ("dynamic", DynamicTree()), ("dynamic:12", DynamicTree(12)),
    ("dynamic:12,4", DynamicTree(12, 4)), ("dynamic:12,4,3", DynamicTree(12, 4, 3)),
])
def test_trees_parse_from_their_command_line_form(text: str, expected) -> None:
    assert parse_tree(text) == expected


@pytest.mark.parametrize("text,match", [
    ("3,x", "tree '3,x' is invalid"), ("3,0", "tree '3,0' is invalid"), ("", "tree '' is invalid"),
    ("dynamic:x", "tree 'dynamic:x'"), ("dynamic:1,2,3,4", "tree 'dynamic:1,2,3,4'"),
    ("dynamic:100", "DynamicTree nodes=100 is invalid"), ("dynamic:8,0", "DynamicTree depth=0"),
])
def test_bad_tree_texts_are_named(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_tree(text)


def test_a_dynamic_tree_counts_its_node_budget() -> None:
    spec = SpeculativeConfig(method="eagle", tree=DynamicTree(nodes=10, depth=3, top_k=2))
    assert spec.num_draft_tokens == 10
    with pytest.raises(ValueError, match="top_k=True"):
        DynamicTree(top_k=True)


def _drawn_picker(table: dict[int, list[int]], priors: dict[int, list[float]] | None = None, vocab_size: int = 16):
    """A picker that 'draws' fixed children per parent token (-1: the root), each with log q of
    -3, its parent's distribution having the largest log-probabilities `priors[token]` (default
    -1, -2, ...); one q row per expanded row, one-hot at the row's index, so the tests can tell
    which row each node was drawn from."""
    priors = priors or {}

    def pick(logits, rows, trees, width):
        parents = [-1 if parent < 0 else trees[r].token_ids[parent] for r, parent in rows]
        tokens = [table[t][:width] for t in parents]
        top = [priors.get(t, [-1.0 - i for i in range(width)])[:width] for t in parents]
        probs = torch.eye(len(rows), vocab_size)
        return Children(tokens, [[-3.0] * len(t) for t in tokens], probs, [True] * len(rows), top)

    return pick


def _level_expand(trees, nodes):
    return torch.zeros(sum(len(n) for n in nodes), 4)


def test_a_drawn_dynamic_tree_shares_its_budget_by_level_and_prior_without_reranking() -> None:
    """Siblings stay a prefix of their draws: each level keeps ceil(left / levels left) nodes,
    given to the draw slots of best prior (parent score + the parent distribution's i-th
    largest log-probability), never by a draw's own score (re-ranking would keep a sibling
    depending on its own token, which recursive rejection sampling cannot allow)."""
    table = {-1: [1, 2], 1: [3, 4], 2: [5, 6], 3: [7, 8], 4: [9, 10], 5: [11, 12], 6: [13, 14]}
    # Token 1's distribution is peaked, token 2's flat: at depth 2 both take one of the two slots.
    priors = {1: [-0.1, -5.0], 2: [-0.2, -0.3]}
    shape = DynamicTree(nodes=5, depth=3, top_k=2)
    (tree,), probs = grow_trees(shape, [5], torch.zeros(1, 4), VOCAB, _level_expand, _drawn_picker(table, priors))
    # Depth 1: ceil(5 / 3) = 2 slots, both root draws. Depth 2: ceil(3 / 2) = 2 slots: the
    # first draws of 1 (-3.1) and 2 (-3.2) beat 2's second (-3.3) and 1's second (-8).
    # Depth 3: 1 slot; 3 and 5 are expanded (both score -6) and 3's first draw wins the tie.
    assert tree.token_ids == [1, 2, 3, 5, 7]
    assert tree.parents == [-1, -1, 0, 1, 2]
    # Each node carries the q row of the level row it was drawn from: root row, the second
    # level's rows (parents 1, 2), the third level's first row.
    assert probs.argmax(dim=-1).tolist() == [0, 0, 0, 1, 0]
    assert probs.shape == (5, 16)


def test_a_drawn_static_tree_skips_the_subtree_of_a_missing_draw() -> None:
    """A parent whose q holds fewer tokens than the shape asks for draws fewer children; the
    planned nodes under the missing ones are not grown and the rest keep their places."""
    table = {-1: [1], 1: [3, 4], 3: [7], 4: [8]}
    (tree,), probs = grow_trees((2, 2, 1), [10], torch.zeros(1, 4), VOCAB, _level_expand, _drawn_picker(table))
    assert tree.token_ids == [1, 3, 4, 7, 8]
    assert tree.parents == [-1, 0, 0, 1, 2]
    assert probs.argmax(dim=-1).tolist() == [0, 0, 0, 0, 1]


def test_draws_without_replacement_follow_the_sequential_law() -> None:
    """20,000 rows, two draws each from q: P(a then b) = q(a) q(b) / (1 - q(a)) (chi-square,
    false alarm 1e-6); the counter streams make each row's draws a function of its key."""
    q = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    n = 20_000
    keys = torch.arange(n, dtype=torch.int64) * 7919 + 11
    drawn = draw_without_replacement(q.expand(n, 4), keys, torch.zeros(n, dtype=torch.int64), 2)
    assert (drawn[:, 0] != drawn[:, 1]).all()
    law = q[:, None] * q[None, :] / (1 - q[:, None])
    law.fill_diagonal_(0)
    assert chi_square(drawn[:, 0] * 4 + drawn[:, 1], law.reshape(-1)).passed
    again = draw_without_replacement(q.expand(3, 4), keys[[5, 0, 9]], torch.zeros(3, dtype=torch.int64), 2)
    assert torch.equal(again, drawn[[5, 0, 9]])


def test_draws_stop_when_q_has_no_tokens_left() -> None:
    q = torch.tensor([[0.0, 0.6, 0.0, 0.4], [float("nan")] * 4])
    drawn = draw_without_replacement(q, torch.tensor([1, 2]), torch.zeros(2, dtype=torch.int64), 3)
    assert sorted(drawn[0, :2].tolist()) == [1, 3] and drawn[0, 2] == -1
    assert drawn[1].tolist() == [-1, -1, -1]


def test_excluded_tokens_are_never_root_children_and_drawn_ones_come_from_q_without_them() -> None:
    """grow_tree_batch's `exclude` (the hybrid's grafted trees): a greedy request's ranked root
    children skip the excluded tokens, even where fewer tokens are left than the shape asks
    for; a sampled request draws from q without them, and that q is its rows."""
    requests = [DraftRequest("greedy", [1], 3, SamplingParams(temperature=0), seed=0, step=0),
                DraftRequest("sampled", [1], 3, SamplingParams(temperature=1.0), seed=1, step=0)]
    root = _probs_logits([[0.5, 0.3, 0.15, 0.05]] * 2)
    batch = grow_tree_batch(requests, [0, 1], (3,), root, VOCAB, 14, expand=None, exclude=[{10, 12}, {10, 12}])
    assert batch.node_token_ids[0] == [11, 13]
    assert sorted(batch.node_token_ids[1]) == [11, 13]
    expected = torch.zeros(14)
    expected[11], expected[13] = 0.3 / 0.35, 0.05 / 0.35
    torch.testing.assert_close(batch.probs[2:], expected.expand(2, -1))
