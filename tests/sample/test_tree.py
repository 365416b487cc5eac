"""Tree verification (verispec/sample/tree.py): exact for sampled and deterministic drafts, with
and without replacement; a chain is rejection_sample token for token; greedy takes the longest
argmax path; seeded requests are batch invariant; bad input is a named error.

Distributional claims: chi-square (false alarm 1e-6, tests/stats.py) per position and on the
joints of the first two and three emitted tokens, in the world of tree_world.py. A deliberately
wrong multi-draft rule, and each rule applied to the other's drafts, fail the same statistics.
"""

from __future__ import annotations

import pytest
import torch

from verispec import SamplingMetadata, SamplingParams
from verispec.sample import DraftLogits, DraftProbs, rejection_sample
from verispec.sample.rng import ACCEPT, SAMPLE, uniform
from verispec.sample.tree import verify_tree

from ..stats import chi_square
from .tree_world import KINDS, TreeWorld, tree_sampler

N = 20_000


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Rows of 6 tokens gain nothing from intra-op threads; on a loaded 2-core machine the
    threads only wait for each other (5x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Every kind of draft with and without replacement on the mixed tree; the wide tree (4 siblings
# under the root) and the chain with a few. Disjoint drafts have 3 tokens of support: the wide
# tree's 4 siblings cannot all be drawn from them without replacement.
DRAFTS = [("mixed", kind, replacement) for kind in KINDS for replacement in (True, False)] + [
    ("wide", "uniform", True), ("wide", "overconfident", False), ("wide", "onehot", True),
    ("wide", "same", False), ("wide", "logits", True), ("chain", "uniform", True), ("chain", "logits", False),
]

PIPELINES = [
    (SamplingParams(temperature=0.7), "logits"),
    (SamplingParams(top_k=3), "overconfident"),
    (SamplingParams(top_p=0.7), "onehot"),
    (SamplingParams(guidance_scale=2.0), "logits"),
    (SamplingParams(guidance_scale=1.5, temperature=0.7, top_p=0.9), "uniform"),
    (SamplingParams(min_p=0.1, temperature=1.3), "same"),
    (SamplingParams(presence_penalty=1.5, repetition_penalty=1.3), "uniform"),
    (SamplingParams(frequency_penalty=0.8, logit_bias={1: 1.0}, temperature=0.8), "logits"),
]


def _check(world: TreeWorld) -> None:
    for name, result in world.tests(N).items():
        assert result.passed, f"{name}: {result}"


@pytest.mark.parametrize("shape,kind,replacement", DRAFTS,
                         ids=[f"{s}-{k}-{'with' if r else 'without'}" for s, k, r in DRAFTS])
def test_emitted_tokens_follow_target(shape: str, kind: str, replacement: bool) -> None:
    _check(TreeWorld(SamplingParams(), kind, shape, replacement, seed=len(kind) + 10 * len(shape)))


@pytest.mark.parametrize("case", range(len(PIPELINES)))
def test_pipelines_follow_target(case: int) -> None:
    """Half of the pipelines with replacement, half without."""
    params, kind = PIPELINES[case]
    _check(TreeWorld(params, kind, "mixed", case % 2 == 0, seed=7 + case, prompt=(2, 5), output=(1, 3, 1)))


# ---------------------------------------------------------------- power: wrong rules fail

def naive_wide(target, ids, parents, cu, sampling, draft, uncond, replacement) -> torch.Tensor:
    """A WRONG rule for trees of leaves under the root: every child is tested against the
    ORIGINAL p (no residual update); the first accepted one is kept, then a bonus token; when
    all are rejected, a token from the last child's residual max(p - q_m, 0)."""
    n = sampling.batch_size
    if ids.numel() == 0:
        return tree_sampler(target, ids, parents, cu, sampling, draft, uncond, replacement)
    m = ids.numel() // n
    assert bool((parents == -1).all())
    rows = target.reshape(n, m + 1, -1).softmax(-1)  # sampling at temperature 1, no filters
    p, x, q = rows[:, 0], ids.reshape(n, m), draft.probs.reshape(n, m, -1)
    req = torch.arange(n)
    u = uniform(sampling.keys.repeat_interleave(m), torch.arange(m).repeat(n), ACCEPT).reshape(n, m)
    q_x, p_x = q.gather(2, x[:, :, None])[:, :, 0], p.gather(1, x)
    accept = u * q_x < p_x
    first = torch.where(accept.any(1), accept.to(torch.int64).argmax(1), m)
    residual = (p - q[:, -1]).clamp(min=0)
    weights = torch.where((first < m)[:, None], rows[req, first.clamp(max=m - 1) + 1], residual)
    final = torch.multinomial(weights, 1, generator=torch.Generator().manual_seed(0))[:, 0]
    kept = x[req, first.clamp(max=m - 1)]
    return torch.stack([torch.where(first < m, kept, final), torch.where(first < m, final, -1)], 1)


def test_naive_multi_draft_rule_fails_the_statistic() -> None:
    world = TreeWorld(SamplingParams(), "uniform", "wide", True, seed=3)  # the right rule: in DRAFTS
    results = world.tests(N, sampler=naive_wide)
    assert results["position 1"].statistic > results["position 1"].threshold, results
    assert results["joint 2"].statistic > results["joint 2"].threshold, results


@pytest.mark.parametrize("drawn_with", [True, False], ids=["iid-drafts", "distinct-drafts"])
def test_each_rule_is_wrong_for_the_other_drafts(drawn_with: bool) -> None:
    """The replacement flag matters: verifying i.i.d. siblings as drawn without replacement, or
    distinct siblings as i.i.d., biases the output."""
    world = TreeWorld(SamplingParams(), "overconfident", "wide", drawn_with, seed=5)

    def swapped(*args) -> torch.Tensor:
        return tree_sampler(*args[:-1], not drawn_with)

    results = world.tests(N, sampler=swapped)
    assert results["position 1"].statistic > results["position 1"].threshold, results


# ---------------------------------------------------------------- chains, empty trees, greedy

def _chains(seed: int, lengths: list[int], vocab: int = 9):
    g = torch.Generator().manual_seed(seed)
    k = torch.tensor(lengths)
    n, d = len(lengths), int(k.sum())
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), k.cumsum(0)])
    target = torch.randn(d + n, vocab, generator=g) * 2
    logits = torch.randn(d, vocab, generator=g) * 2
    ids = torch.multinomial(logits.softmax(-1), 1, generator=g)[:, 0]
    parents = torch.cat([torch.arange(length) - 1 for length in lengths])
    return target, ids, parents, cu, logits


@pytest.mark.parametrize("draft_kind", ["probs", "logits", "onehot"])
@pytest.mark.parametrize("replacement", [True, False])
def test_chain_is_rejection_sample_token_for_token(draft_kind: str, replacement: bool) -> None:
    """Same layout, same counters: a chain (ragged, empty trees included) emits exactly the
    tokens of token-wise rejection_sample, pipeline and penalties included."""
    lengths = [0, 3, 1, 5, 2] * 100
    target, ids, parents, cu, logits = _chains(1, lengths)
    params = [SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.7) if b % 3 == 0
              else SamplingParams(temperature=0) if b % 3 == 1 else SamplingParams(guidance_scale=1.5)
              for b in range(len(lengths))]
    sampling = SamplingMetadata.from_params(params, seeds=list(range(len(lengths))),
                                            output_token_ids=[[b % 9, 2] for b in range(len(lengths))])
    uncond = torch.randn_like(target)
    draft = {"probs": DraftProbs(logits.softmax(-1)), "logits": DraftLogits(logits), "onehot": None}[draft_kind]
    chain = rejection_sample(target, ids, cu, sampling, draft=draft, uncond_logits=uncond)
    tree = verify_tree(target, ids, parents, cu, sampling, draft=draft, uncond_logits=uncond, replacement=replacement)
    assert torch.equal(tree.token_ids, chain.token_ids)
    assert torch.equal(tree.num_accepted, chain.num_accepted)
    positions = torch.arange(5)[None, :]
    expected_nodes = torch.where(positions < chain.num_accepted[:, None], positions, -1)
    assert torch.equal(tree.accepted_nodes, expected_nodes)


def test_empty_trees_emit_one_token_from_the_root_row() -> None:
    n, vocab = 4000, 5
    g = torch.Generator().manual_seed(2)
    root = torch.randn(vocab, generator=g)
    empty = torch.zeros(0, dtype=torch.int64)
    out = verify_tree(root.expand(n, vocab), empty, empty, torch.zeros(n + 1, dtype=torch.int64),
                      SamplingMetadata.from_params([SamplingParams()] * n, seeds=list(range(n))))
    assert out.token_ids.shape == (n, 1) and out.accepted_nodes.shape == (n, 0)
    assert bool((out.num_accepted == 0).all())
    assert chi_square(out.token_ids[:, 0], root.double().softmax(0)).passed


def test_greedy_takes_the_longest_argmax_path() -> None:
    """Request 0: root children hold 3, 5, 5 and the root's argmax is 5; node 1's subtree
    matches one level (node 5), node 2's two more (nodes 7, 8): the longest path wins. Node 3
    matches its row but its parent does not. Request 1: two matching siblings, equally deep:
    the first. Request 2: an empty tree emits the argmax of its root row."""
    vocab = 8
    parents = [-1, -1, -1, 0, 1, 1, 4, 2, 7] + [-1, -1]
    ids = [3, 5, 5, 4, 2, 7, 1, 6, 6] + [4, 4]
    argmax = [5, 4, 7, 6, 0, 0, 0, 0, 6, 0] + [4, 1, 2] + [2]  # per row: root, then nodes
    target = torch.nn.functional.one_hot(torch.tensor(argmax), vocab).float() * 3
    sampling = SamplingMetadata.from_params([SamplingParams(temperature=0)] * 3, seeds=[0, 1, 2])
    out = verify_tree(target, torch.tensor(ids), torch.tensor(parents), torch.tensor([0, 9, 11, 11]), sampling)
    assert out.token_ids.tolist() == [[5, 6, 6, 0], [4, 1, -1, -1], [2, -1, -1, -1]]
    assert out.accepted_nodes.tolist() == [[2, 7, 8], [0, -1, -1], [-1, -1, -1]]
    assert out.num_accepted.tolist() == [3, 1, 0] and out.num_emitted.tolist() == [4, 2, 1]


# ---------------------------------------------------------------- batches of random trees

def _random_trees(seed: int, n: int, vocab: int = 10):
    g = torch.Generator().manual_seed(seed)
    parents, counts = [], []
    for _ in range(n):
        m = int(torch.randint(0, 8, (1,), generator=g))
        counts.append(m)
        parents += [int(torch.randint(-1, j, (1,), generator=g)) for j in range(m)]
    total = sum(counts)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(counts).cumsum(0)])
    target = torch.randn(total + n, vocab, generator=g) * 1.5
    q = (torch.randn(total, vocab, generator=g) * 1.5).softmax(-1)
    ids = torch.multinomial(q, 1, generator=g)[:, 0]
    return target, ids, torch.tensor(parents, dtype=torch.int64), cu, DraftProbs(q)


def test_accepted_nodes_form_a_path_of_the_emitted_tokens() -> None:
    n = 300
    target, ids, parents, cu, draft = _random_trees(3, n)
    params = [SamplingParams(temperature=0) if b % 4 == 0 else SamplingParams() for b in range(n)]
    out = verify_tree(target, ids, parents, cu, SamplingMetadata.from_params(params, seeds=list(range(n))),
                      draft=draft, replacement=torch.arange(n) % 2 == 0)
    assert int(out.num_accepted.sum()) > n // 4
    for b in range(n):
        path = out.accepted_nodes[b, : int(out.num_accepted[b])].tolist()
        assert out.accepted_nodes[b, len(path):].eq(-1).all()
        start = int(cu[b])
        expected_parent = -1
        for d, node in enumerate(path):
            assert int(parents[start + node]) == expected_parent
            assert int(out.token_ids[b, d]) == int(ids[start + node])
            expected_parent = node
        assert int(out.token_ids[b, len(path)]) >= 0 and out.token_ids[b, len(path) + 1:].eq(-1).all()


def test_seeded_requests_are_batch_invariant() -> None:
    n = 24
    target, ids, parents, cu, draft = _random_trees(4, n)
    params = [SamplingParams(temperature=0.9, top_k=6)] * n
    together = verify_tree(target, ids, parents, cu, SamplingMetadata.from_params(params, seeds=list(range(n))),
                           draft=draft, replacement=False)
    for b in range(n):
        nodes = slice(int(cu[b]), int(cu[b + 1]))
        rows = slice(int(cu[b]) + b, int(cu[b + 1]) + b + 1)
        alone = verify_tree(target[rows], ids[nodes], parents[nodes], torch.tensor([0, int(cu[b + 1] - cu[b])]),
                            SamplingMetadata.from_params([params[b]], seeds=[b]),
                            draft=DraftProbs(draft.probs[nodes]), replacement=False)
        width = alone.token_ids.shape[1]
        assert alone.token_ids[0].tolist() == together.token_ids[b, :width].tolist()
        assert together.token_ids[b, width:].eq(-1).all()
        assert alone.accepted_nodes[0].tolist() == together.accepted_nodes[b, : width - 1].tolist()


def test_counters_one_accept_per_node_and_the_sample_at_the_final_row() -> None:
    """A root with two children, verified as deterministic drafts: the first child's test uses
    the ACCEPT uniform at counter 0, the second's at counter 1, the emitted token the SAMPLE
    uniform at counter 0 (the root row) or j + 1 (node j's row)."""
    n, vocab = 2000, 4
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    target = p.log().repeat(3 * n, 1)
    ids = torch.tensor([3, 2]).repeat(n)
    sampling = SamplingMetadata.from_params([SamplingParams()] * n, seeds=list(range(n)))
    out = verify_tree(target, ids, torch.tensor([-1, -1]).repeat(n), torch.arange(n + 1) * 2, sampling)
    u0 = uniform(sampling.keys, torch.zeros(n, dtype=torch.int64), ACCEPT)
    u1 = uniform(sampling.keys, torch.ones(n, dtype=torch.int64), ACCEPT)
    first = u0 < 0.4
    second = ~first & (u1 < 0.3 / 0.6)  # the residual after rejecting token 3 is p without it
    assert torch.equal(out.num_accepted, (first | second).to(torch.int64))
    assert torch.equal(out.accepted_nodes[:, 0], torch.where(first, 0, torch.where(second, 1, -1)))
    final_row = torch.where(first, 1, torch.where(second, 2, 0))
    s = uniform(sampling.keys, final_row, SAMPLE)
    weights = torch.where((first | second)[:, None], p, torch.tensor([0.1, 0.2, 0.0, 0.0]) / 0.3)
    expected = (s[:, None] * weights.sum(-1, keepdim=True) >= weights.double().cumsum(-1)).sum(-1)
    assert torch.equal(out.token_ids[torch.arange(n), out.num_accepted], expected)


def test_placeholder_nodes_drafted_nothing() -> None:
    """Without validation a -1 node is never accepted (its clamped id 0 holds almost all of p)
    and never rejected: its sibling's test and the emitted token see the whole p."""
    n = 4000
    p = torch.tensor([0.9, 0.05, 0.03, 0.02])
    target = p.log().repeat(4 * n, 1)
    ids = torch.tensor([-1, 0, 1]).repeat(n)  # node 1 is the placeholder's child
    sampling = SamplingMetadata.from_params([SamplingParams()] * n, seeds=list(range(n)))
    out = verify_tree(target, ids, torch.tensor([-1, 0, -1]).repeat(n), torch.arange(n + 1) * 3, sampling,
                      validate=False)
    u = uniform(sampling.keys, torch.full((n,), 2), ACCEPT)
    assert torch.equal(out.accepted_nodes[:, 0], torch.where(u < 0.05, 2, -1))
    rejected = out.num_accepted == 0
    residual = torch.tensor([0.9, 0.0, 0.03, 0.02], dtype=torch.float64) / 0.95
    assert chi_square(out.token_ids[rejected, 0], residual).passed
    greedy = SamplingMetadata.from_params([SamplingParams(temperature=0)] * n, seeds=list(range(n)))
    out = verify_tree(target, ids, torch.tensor([-1, 0, -1]).repeat(n), torch.arange(n + 1) * 3, greedy,
                      validate=False)
    assert bool((out.num_accepted == 0).all()) and bool((out.token_ids[:, 0] == 0).all())


# ---------------------------------------------------------------- bad input

def _small():
    target, ids, parents, cu, draft = _random_trees(5, 3)
    sampling = SamplingMetadata.from_params([SamplingParams()] * 3, seeds=[0, 1, 2])
    return target, ids, parents, cu, sampling, draft


def test_bad_parents_are_named_errors() -> None:
    target, ids, parents, cu, sampling, draft = _small()
    start = int(cu[1])  # the second request's first node
    for bad_value in (0, 5, -2):
        bad = parents.clone()
        bad[start] = bad_value
        with pytest.raises(ValueError, match=rf"node_parents\[{start}\]={bad_value} is invalid"):
            verify_tree(target, ids, bad, cu, sampling, draft=draft)
    with pytest.raises(ValueError, match="node_parents has shape"):
        verify_tree(target, ids, parents[:-1], cu, sampling, draft=draft)
    with pytest.raises(ValueError, match="node_parents has dtype"):
        verify_tree(target, ids, parents.float(), cu, sampling, draft=draft)


def test_bad_shapes_and_values_are_named_errors() -> None:
    target, ids, parents, cu, sampling, draft = _small()
    with pytest.raises(ValueError, match="target_logits has shape"):
        verify_tree(target[:-1], ids, parents, cu, sampling, draft=draft)
    with pytest.raises(ValueError, match="cu_num_nodes"):
        verify_tree(target, ids, parents, cu + 1, sampling, draft=draft)
    with pytest.raises(ValueError, match="node_token_ids contains token id 10"):
        verify_tree(target, ids.clone().fill_(10), parents, cu, sampling, draft=draft)
    with pytest.raises(ValueError, match="draft.probs has shape"):
        verify_tree(target, ids, parents, cu, sampling, draft=DraftProbs(draft.probs[:-1]))
    with pytest.raises(ValueError, match="replacement has shape"):
        verify_tree(target, ids, parents, cu, sampling, draft=draft, replacement=torch.ones(2, dtype=torch.bool))
    with pytest.raises(TypeError, match="replacement is str"):
        verify_tree(target, ids, parents, cu, sampling, draft=draft, replacement="yes")
    with pytest.raises(ValueError, match="uncond_logits is None"):
        verify_tree(target, ids, parents, cu, SamplingMetadata.from_params(
            [SamplingParams(guidance_scale=2.0)] * 3, seeds=[0, 1, 2]), draft=draft)
