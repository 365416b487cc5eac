"""verify_tree(): exact, batched verification of draft trees (native PyTorch).

Terms as in rejection.py (draft, target, accepted, recovered, bonus, emitted), plus:
- a request drafts a *tree* of n_b *nodes* (n_b may be 0), each holding one draft token; node j
  has a *parent* (a node before it, or the *root*: the last token already emitted). The nodes
  with the same parent are *siblings*, tested in node order;
- one target forward pass (with a tree attention mask) gives n_b + 1 target rows: the *root
  row* (the distribution of the token after the root, i.e. of the depth-1 nodes) and, for each
  node, the distribution of the token after it;
- the *accepted path* is a chain of nodes root -> child -> grandchild ...; the emitted tokens
  are its tokens followed by one recovered or bonus token, sampled at the path's last node.

Layout (a chain is exactly rejection_sample's layout):
    target_logits  [N + B, V]  per request: the root row, then one row per node in node order
    node_token_ids [N]         requests concatenated, nodes in topological order
    node_parents   [N]         parent index within the request, -1 for children of the root,
                               always < the node's own index
    cu_num_nodes   [B + 1]     leading 0
    draft          DraftProbs / DraftLogits rows [N, V] per node: the distribution q its token
                               was drawn from (siblings drawn from one distribution share it),
                               or None for deterministic drafts (top-k children, n-gram
                               continuations: q is one-hot at each node's token)
    uncond_logits  [N + B, V]  CFG rows aligned with target_logits
    replacement    bool or [B] bool: siblings drawn with replacement (i.i.d. from q) or without

The rule, at the current node (first the root) with target distribution p and children
c_1..c_m holding x_1..x_m (Miao et al. 2024, SpecInfer, "multi-step speculative sampling"; Jeon
et al. 2024, "Recursive Speculative Decoding", recursive rejection sampling):
    for i = 1..m: accept c_i with probability min(1, p(x_i) / q_i(x_i)) (as u * q < p); on
        acceptance descend: c_i becomes the current node, its row the new p;
        on rejection p <- normalize(max(p - q_i, 0)) (p itself when that has no mass: the
        rejection had probability 0) and test c_{i + 1};
    when every child is rejected (or there is none), emit a token from the current p.
with q_i = q (the child's draft row) with replacement, and without replacement q_i = q with
x_1..x_{i-1} removed and renormalised (zero if nothing is left: x_i is then rejected and p kept),
the distribution x_i was actually drawn from given the siblings before it. Either way the
emitted token follows the node's target distribution: conditioned on the rejections so far,
x_i ~ q_i, so each test is an ordinary rejection step whose residual does not depend on x_i.
Deterministic drafts use q_i one-hot at x_i: acceptance with probability p(x_i), residual p
with x_i zeroed; the two rules coincide (a repeated token has p(x) = 0 by then and is
rejected). Greedy requests take the longest path on which every token is the argmax of the row
before it (the first in node order among equally long ones: siblings drafting one token share
their context, so any such path is a prefix of greedy decoding) and emit the argmax after it.

Without validation, a node whose id is out of range (a -1 placeholder) drafted nothing: it is
never tested (p stays as it is) and its subtree is never reached.

p and q are the distributions after the request's pipeline: the rows go through rejection.py's
pre-stage (penalties count the tokens of the path to each row) and process_logits, as in
rejection_sample.

Random numbers (rng.py, keyed by the request): the test of node j uses the ACCEPT uniform at
counter j (its index within the request; each node is tested at most once), the emitted token
the SAMPLE uniform at counter r, the index within the request of the row it is drawn from
(0 for the root, j + 1 for node j). Seeded requests are therefore batch invariant, and a chain
draws exactly the numbers rejection_sample does: it emits the same tokens.

Vectorised over requests: greedy requests without a loop (the ancestors of every node); sampled
ones with one Python loop over depth and, inside, one over sibling rank, each step on [B, V]
rows; no loop over requests. Two kinds of host reads: one flag per tree level (the depth) and
the widest sibling group, which size the loops and the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import validation as check
from .metadata import SamplingMetadata
from .penalties import PrecedingTokens
from .processors import process_logits
from .ragged import layout, sample_inverse_cdf
from .rejection import adjust_with_history, check_inputs
from .rng import ACCEPT, SAMPLE, uniform
from .types import PLACEHOLDER_TOKEN_ID, Draft, DraftLogits, DraftProbs


@dataclass(frozen=True)
class TreeOutput:
    token_ids: torch.Tensor  # [B, max_depth + 1] int64: the accepted path, then the recovered / bonus token, then -1
    num_emitted: torch.Tensor  # [B] int64, num_accepted + 1
    num_accepted: torch.Tensor  # [B] int64, the accepted path's length
    accepted_nodes: torch.Tensor  # [B, max_depth] int64: the path's node indices within the request, then -1


def verify_tree(
    target_logits: torch.Tensor,  # [N + B, V]: per request the root row, then one row per node
    node_token_ids: torch.Tensor,  # [N] int, requests concatenated, parents before children
    node_parents: torch.Tensor,  # [N] int, parent index within the request, -1 for the root
    cu_num_nodes: torch.Tensor,  # [B + 1] int, leading 0
    sampling: SamplingMetadata,
    draft: Draft = None,
    uncond_logits: torch.Tensor | None = None,  # [N + B, V], CFG rows aligned with target_logits
    replacement: bool | torch.Tensor = True,  # or [B] bool per request
    validate: bool = True,
) -> TreeOutput:
    """Verify every request's draft tree against its target rows (layout and rule: the module
    docstring). The emitted tokens are distributed exactly as sampling token by token from the
    target, whatever the drafts. `validate` checks values too (reads the tensors)."""
    if validate:
        check_inputs(target_logits, node_token_ids, cu_num_nodes, sampling, draft, uncond_logits,
                  ids_name="node_token_ids", cu_name="cu_num_nodes")
        _validate_tree(node_token_ids, node_parents, cu_num_nodes, replacement, sampling.batch_size)
    device = target_logits.device
    vocab = target_logits.shape[1]
    tree = _structure(node_parents, node_token_ids, cu_num_nodes, target_logits.shape[0], vocab)
    ids = node_token_ids.to(device=device, dtype=torch.int64).clamp(0, vocab - 1)
    if sampling.adjustments is not None:
        before_target, before_draft = _path_tokens(ids, tree)
        target_logits, draft, sampling = adjust_with_history(
            target_logits, tree.req_of_row, tree.req_of_node, sampling, draft, uncond_logits,
            before_target, before_draft,
        )
    if isinstance(replacement, torch.Tensor):
        with_replacement = replacement.to(device=device, dtype=torch.bool)
    else:
        with_replacement = torch.full((sampling.batch_size,), bool(replacement), device=device)
    target = process_logits(target_logits, tree.req_of_row, sampling, uncond_logits)  # [N + B, V]
    return _walk(target, ids, tree, sampling, draft, with_replacement)


class _Tree(NamedTuple):
    """Index bookkeeping of a batch of trees, on the device (global = over the batch)."""

    req_of_row: torch.Tensor  # [N + B] request of each target row
    req_of_node: torch.Tensor  # [N]
    node_start: torch.Tensor  # [B] global index of each request's first node
    root_row: torch.Tensor  # [B] global row of each root
    node_row: torch.Tensor  # [N] global row of the distribution after each node
    parent_row: torch.Tensor  # [N] global row of the distribution each node was drawn for
    local: torch.Tensor  # [N] index of each node within its request
    drafted: torch.Tensor  # [N] bool: the id is in range (without validation a -1 slot drafted nothing)
    ancestors: torch.Tensor  # [N, max_depth] global node, parent, grandparent ..., then -1
    children: torch.Tensor  # [N + B, max_width] global child nodes of each row's node in node order, then -1


def _structure(
    node_parents: torch.Tensor,  # [N]
    node_token_ids: torch.Tensor,  # [N]
    cu_num_nodes: torch.Tensor,  # [B + 1]
    num_rows: int,
    vocab: int,
) -> _Tree:
    device = node_token_ids.device
    lay = layout(cu_num_nodes, num_rows, device)
    num_nodes = lay.req_of_draft.shape[0]
    parents = node_parents.to(device=device, dtype=torch.int64)
    parent_global = torch.where(parents >= 0, parents + lay.draft_start[lay.req_of_draft], -1)
    root_row = lay.draft_start + torch.arange(lay.num_draft.shape[0], device=device)
    node_row = lay.row_of_draft + 1
    parent_row = torch.where(parents >= 0, node_row[parent_global.clamp(min=0)], root_row[lay.req_of_draft])

    # Pointer chasing, one level per step; a parent before its node bounds it by the node count.
    columns = [torch.arange(num_nodes, device=device)]
    for _ in range(num_nodes):
        up = columns[-1]
        above = torch.where(up >= 0, parent_global[up.clamp(min=0)], -1)
        if not bool((above >= 0).any()):
            break
        columns.append(above)
    ancestors = torch.stack(columns, dim=1) if num_nodes else torch.zeros(0, 0, dtype=torch.int64, device=device)

    # A node's rank among its siblings: its position within its parent's group after a stable sort.
    order = torch.sort(parent_row, stable=True).indices
    sorted_rows = parent_row[order]
    position = torch.arange(num_nodes, device=device)
    starts = torch.ones_like(sorted_rows, dtype=torch.bool)
    starts[1:] = sorted_rows[1:] != sorted_rows[:-1]
    group_start = torch.where(starts, position, 0).cummax(dim=0).values
    rank = torch.empty_like(position)
    rank[order] = position - group_start
    width = int(rank.max()) + 1 if num_nodes else 0
    children = torch.full((num_rows, width), -1, dtype=torch.int64, device=device)
    children[parent_row, rank] = position
    return _Tree(
        req_of_row=lay.req_of_row, req_of_node=lay.req_of_draft, node_start=lay.draft_start,
        root_row=root_row, node_row=node_row, parent_row=parent_row, local=lay.pos_of_draft,
        drafted=(node_token_ids >= 0) & (node_token_ids < vocab), ancestors=ancestors, children=children,
    )


def _path_tokens(
    ids: torch.Tensor,  # [N] clamped node tokens
    tree: _Tree,
) -> tuple[PrecedingTokens, PrecedingTokens]:
    """The drafted history of each row for penalties: a node's target row is preceded by the
    tokens of its path (the node included), its draft row by those of its ancestors."""
    anc = tree.ancestors  # [N, D]
    tokens = ids[anc.clamp(min=0)]
    valid = anc >= 0
    target_rows = tree.node_row[:, None].expand_as(anc)
    draft_rows = torch.arange(anc.shape[0], device=ids.device)[:, None].expand_as(anc[:, 1:])
    return (
        PrecedingTokens(target_rows.reshape(-1), tokens.reshape(-1), valid.reshape(-1)),
        PrecedingTokens(draft_rows.reshape(-1), tokens[:, 1:].reshape(-1), valid[:, 1:].reshape(-1)),
    )


def _walk(
    target: torch.Tensor,  # [N + B, V] processed target logits
    ids: torch.Tensor,  # [N] clamped node tokens
    tree: _Tree,
    sampling: SamplingMetadata,
    draft: Draft,
    with_replacement: torch.Tensor,  # [B] bool
) -> TreeOutput:
    row_argmax = target.max(dim=-1).indices  # [N + B]
    path, num_accepted, final_token = _greedy(row_argmax, ids, tree)
    if not sampling.all_greedy:
        sampled = _sampled(target, ids, tree, sampling, draft, with_replacement)
        greedy = sampling.is_greedy
        path = torch.where(greedy[:, None], path, sampled[0])
        num_accepted = torch.where(greedy, num_accepted, sampled[1])
        final_token = torch.where(greedy, final_token, sampled[2])
    return _output(ids, tree, path, num_accepted, final_token)


def _greedy(
    row_argmax: torch.Tensor,  # [N + B]
    ids: torch.Tensor,  # [N]
    tree: _Tree,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # path [B, max_depth], num_accepted [B], final token [B]
    """The deepest node whose path matches the argmax of every row on it (the first in node
    order among equally deep ones), and the argmax after it."""
    batch = tree.root_row.shape[0]
    anc = tree.ancestors  # [N, D]
    num_nodes, max_depth = anc.shape
    device = ids.device
    if num_nodes == 0:
        return anc.new_zeros(batch, 0), anc.new_zeros(batch), row_argmax[tree.root_row]
    match = tree.drafted & (ids == row_argmax[tree.parent_row])  # [N]
    on_path = anc >= 0
    good = torch.where(on_path, match[anc.clamp(min=0)], True).all(dim=1)  # [N]
    depth = on_path.sum(dim=1)  # [N]
    # One key per node, largest for the deepest good node, then for the first in node order.
    key = torch.where(good, depth * (num_nodes + 1) + num_nodes - tree.local, 0)
    best = torch.zeros(batch, dtype=torch.int64, device=device).scatter_reduce(0, tree.req_of_node, key, "amax")
    num_accepted = best // (num_nodes + 1)
    found = num_accepted > 0
    node = torch.where(found, tree.node_start + num_nodes - best % (num_nodes + 1), 0)  # [B] global
    final_token = row_argmax[torch.where(found, tree.node_row[node], tree.root_row)]
    # The path from the root: the ancestor at depth d + 1 sits in column num_accepted - 1 - d.
    column = num_accepted[:, None] - 1 - torch.arange(max_depth, device=device)[None, :]  # [B, D]
    on_chain = anc[node].gather(1, column.clamp(min=0))
    path = torch.where(column >= 0, tree.local[on_chain.clamp(min=0)], PLACEHOLDER_TOKEN_ID)
    return path, num_accepted, final_token


def _sampled(
    target: torch.Tensor,  # [N + B, V] processed target logits
    ids: torch.Tensor,  # [N] clamped node tokens
    tree: _Tree,
    sampling: SamplingMetadata,
    draft: Draft,
    with_replacement: torch.Tensor,  # [B] bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # path [B, max_depth], num_accepted [B], final token [B]
    """The rule of the module docstring, one depth per step; greedy requests ride along unused."""
    batch = tree.root_row.shape[0]
    vocab = target.shape[1]
    device = target.device
    max_depth = tree.ancestors.shape[1]
    requests = torch.arange(batch, device=device)
    row = tree.root_row.clone()  # [B] the current node's row
    stopped = torch.zeros(batch, dtype=torch.bool, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    path = torch.full((batch, max_depth), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    final_token = torch.zeros(batch, dtype=torch.int64, device=device)
    for depth in range(max_depth + 1):
        p = target[row].softmax(dim=-1)  # [B, V] the current (residual) target
        removed = torch.zeros(batch, vocab, dtype=torch.bool, device=device)  # siblings rejected so far
        moved = torch.zeros(batch, dtype=torch.bool, device=device)
        next_row = row
        for rank in range(tree.children.shape[1]):
            child = tree.children[row, rank]  # [B]
            node = child.clamp(min=0)
            live = ~stopped & ~moved & (child >= 0) & tree.drafted[node]
            x = ids[node]
            accept, p = _test(p, x, node, removed, draft, sampling, with_replacement, tree, live)
            accept &= live
            removed[requests, x] |= live & ~accept
            moved |= accept
            next_row = torch.where(accept, tree.node_row[node], next_row)
            if depth < max_depth:
                path[:, depth] = torch.where(accept, tree.local[node], path[:, depth])
        stop = ~stopped & ~moved
        u = uniform(sampling.keys, row - tree.root_row, SAMPLE)
        final_token = torch.where(stop, sample_inverse_cdf(p, u), final_token)
        num_accepted += moved.to(torch.int64)
        stopped |= stop
        row = next_row
    return path, num_accepted, final_token


def _test(
    p: torch.Tensor,  # [B, V] current target distributions
    x: torch.Tensor,  # [B] the tested children's tokens
    node: torch.Tensor,  # [B] their global node indices (clamped)
    removed: torch.Tensor,  # [B, V] bool, the tokens of the siblings rejected before them
    draft: Draft,
    sampling: SamplingMetadata,
    with_replacement: torch.Tensor,  # [B] bool
    tree: _Tree,
    live: torch.Tensor,  # [B] bool, requests testing a child at this step
) -> tuple[torch.Tensor, torch.Tensor]:  # ([B] accepted, [B, V] p after a rejection)
    """One rejection step per request: accept x with probability min(1, p(x) / q(x)), else
    the residual normalize(max(p - q, 0))."""
    requests = torch.arange(p.shape[0], device=p.device)
    q = _draft_rows(draft, node, sampling)
    if q is None:  # one-hot at x: whatever the rule, max(p - q, 0) is p without x
        q_x = torch.ones_like(p[:, 0])
        residual = p.scatter(1, x[:, None], 0.0)
    else:
        # Without replacement x was drawn from q without the siblings rejected before it.
        kept = q.masked_fill(removed, 0.0)
        mass = kept.sum(dim=-1, keepdim=True)
        kept = torch.where(mass > 0, kept / mass.clamp(min=1e-30), 0.0)
        q = torch.where(with_replacement[:, None], q, kept)
        q_x = q[requests, x]
        residual = (p - q).clamp(min=0)
    u = uniform(sampling.keys, tree.local[node], ACCEPT)
    accept = (q_x > 0) & (u * q_x.double() < p[requests, x].double())
    mass = residual.sum(dim=-1, keepdim=True)
    # No mass left means the rejection had probability 0: keep p.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)
    return accept, torch.where((live & ~accept)[:, None], residual, p)


def _draft_rows(
    draft: Draft,
    node: torch.Tensor,  # [B] global node indices
    sampling: SamplingMetadata,
) -> torch.Tensor | None:  # [B, V] draft probabilities, None for one-hot drafts
    if isinstance(draft, DraftLogits):
        requests = torch.arange(node.shape[0], device=node.device)
        return process_logits(draft.logits[node], requests, sampling).softmax(dim=-1)
    if isinstance(draft, DraftProbs):
        return draft.probs[node].float()
    return None


def _output(
    ids: torch.Tensor,  # [N]
    tree: _Tree,
    path: torch.Tensor,  # [B, max_depth] local node indices, -1 padded
    num_accepted: torch.Tensor,  # [B]
    final_token: torch.Tensor,  # [B]
) -> TreeOutput:
    slot = torch.arange(path.shape[1] + 1, device=path.device)[None, :]
    n = num_accepted[:, None]
    on_path = ids[(path + tree.node_start[:, None]).clamp(min=0)]  # [B, max_depth], read before slot n only
    tokens = torch.cat([on_path, final_token[:, None]], dim=1)
    token_ids = torch.where(slot < n, tokens, torch.where(slot == n, final_token[:, None], PLACEHOLDER_TOKEN_ID))
    return TreeOutput(token_ids, num_accepted + 1, num_accepted, path)


def _validate_tree(
    node_token_ids: torch.Tensor,  # [N]
    node_parents: object,
    cu_num_nodes: torch.Tensor,  # [B + 1]
    replacement: object,
    batch: int,
) -> None:
    """What rejection.check_inputs does not cover: the parents (before each node, in its request) and
    `replacement`."""
    device = node_token_ids.device
    check.check_tensor("node_parents", node_parents, 1, integer=True, device=device)
    check.check_shape("node_parents", node_parents, tuple(node_token_ids.shape))
    counts = (cu_num_nodes[1:] - cu_num_nodes[:-1]).to(device)
    start = torch.repeat_interleave(cu_num_nodes[:-1].to(device), counts, output_size=node_parents.shape[0])
    local = torch.arange(node_parents.shape[0], device=device) - start
    bad = (node_parents < -1) | (node_parents >= local)
    if bool(bad.any()):
        j = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"node_parents[{j}]={int(node_parents[j])} is invalid for node {int(local[j])} of its request: "
            f"expected -1 (the root) or the index of an earlier node of the same request"
        )
    if isinstance(replacement, torch.Tensor):
        if replacement.dtype != torch.bool:
            raise ValueError(f"replacement has dtype {replacement.dtype}: expected torch.bool")
        check.check_shape("replacement", replacement, (batch,))
    elif not isinstance(replacement, bool):
        raise TypeError(f"replacement is {type(replacement).__name__}: expected bool or a [B] bool tensor")
