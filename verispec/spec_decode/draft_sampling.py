"""Sampling draft tokens with the request's own pipeline, shared by the drafters that sample.

A drafter that samples draws each draft token from q = the request's sampling pipeline applied
to its draft logits (no CFG: drafts are unguided; penalties count the output followed by the
drafts already proposed this step, the history the verifier gives the same position), with
counter-based random numbers keyed by (seed, step, position), so a seeded request drafts the
same tokens in any batch. q is handed to the verifier, which keeps the output exact whatever q
is; greedy requests take q's argmax. Trees (tree_children) draw each node's children one
after another without replacement from q, which the verifier's recursive rejection sampling
takes as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

import numpy as np
import torch

from ..sample import SamplingMetadata
from ..sample.greedy import argmax_rows
from ..sample.penalties import PrecedingTokens
from ..sample.processors import process_logits
from ..sample.ragged import sample_inverse_cdf
from ..sample.rng import DRAFT, uniform
from ..structured.matcher import apply_token_mask
from .base import DraftRequest
from .trees import Children, Expand, GrownTree, Pick, TreeBatch, TreeShape, grow_trees, top_children


def draft_metadata(requests: Sequence[DraftRequest], device: torch.device) -> SamplingMetadata | None:
    """The sampling metadata of a drafter's call: each request's pipeline, streams, penalty
    histories and grammars, rows in request order. None when every request is greedy without
    penalties, bias, masks or grammar: its drafts are the argmax of the draft logits, and
    building the metadata (random keys included) cost a one-position EAGLE call a sixth of its
    time."""
    if all(r.params.greedy and not r.params.adjusts_logits and r.grammar is None for r in requests):
        return None
    sampling = SamplingMetadata.from_params(
        [r.params for r in requests], steps=[r.step for r in requests],
        seeds=[r.seed for r in requests], device=device,
        prompt_token_ids=[r.prompt_token_ids for r in requests],
        output_token_ids=[r.output_token_ids for r in requests],
    )
    if any(r.grammar is not None for r in requests):
        sampling = dataclasses.replace(sampling, grammars=tuple(r.grammar for r in requests))
    return sampling


def grammar_masked(
    sampling: SamplingMetadata,
    requests: list[int],  # the request of each row
    prefixes: list[list[int]],  # each row's tokens after the output (its drafts before it)
    logits: torch.Tensor,  # [R, V] draft logits over the target's vocabulary, or [R, N] with `vocab`
    vocab: torch.Tensor | None = None,  # [N] int64, the target token id of each column
) -> torch.Tensor:  # logits with grammar-forbidden tokens at -inf (unchanged without grammars)
    """The structured-output mask stage on draft rows, each with its own history, as the verifier
    masks the target's rows (structured/matcher.py): a drafter then proposes only tokens the
    grammar allows, and q is the masked distribution it drew from."""
    if sampling.grammars is None:
        return logits
    width = next(g.vocab_size for g in sampling.grammars if g is not None)  # the target's vocabulary
    mask = np.ones((logits.shape[0], width), dtype=np.bool_)
    for row, (b, prefix) in enumerate(zip(requests, prefixes)):
        grammar = sampling.grammars[b]
        if grammar is not None:
            mask[row] = grammar.masks([prefix])[0].numpy()
    if vocab is not None:
        mask = mask[:, vocab.cpu().numpy()]
    return apply_token_mask(logits, torch.from_numpy(np.ascontiguousarray(mask)))


def sample_drafts(
    sampling: SamplingMetadata | None,  # of every request of the drafter's call (draft_metadata's)
    active: list[int],  # the requests drafting this round, one logit row each
    drafted: list[list[int]],  # their drafts so far, the tail of their penalty history
    logits: torch.Tensor,  # [R, V] draft logits, one row per active request
    position: int,  # the draft position (0 for the first draft of the step)
) -> tuple[list[int], torch.Tensor | None]:  # tokens, q rows [R, V] or None
    """Draws one draft token per active request. A row whose pipeline leaves no token (a
    reduced draft vocabulary with allowed_token_ids outside it) has a NaN q; `drafted_rows`
    tells the caller which rows are usable. When every request of the call is greedy without
    penalties, bias or masks, the draft is the argmax of the logits and q is not built (None:
    one-hot, which greedy verification never reads): a softmax, a draw and a slow argmax over
    the vocabulary per draft spared (~0.5 ms of a ~5 ms draft pass of the embedded model)."""
    if sampling is None:
        return argmax_rows(logits), None
    if sampling.all_greedy and sampling.adjustments is None:
        return argmax_rows(grammar_masked(sampling, active, drafted, logits)), None
    device = logits.device
    rows = torch.tensor(active, dtype=torch.int64, device=device)
    logits = grammar_masked(sampling, active, drafted, logits)
    q = process_logits(logits, rows, sampling, preceding=_preceding(sampling, drafted, device)).softmax(dim=-1)
    positions = torch.full((len(active),), position, dtype=torch.int64, device=device)
    sampled = sample_inverse_cdf(q, uniform(sampling.keys[rows], positions, DRAFT))
    tokens = torch.where(sampling.is_greedy[rows], q.argmax(dim=-1), sampled)
    return tokens.tolist(), q


def _preceding(sampling: SamplingMetadata, drafted: list[list[int]], device: torch.device) -> PrecedingTokens | None:
    """Each row's drafts so far as penalty history (None when no request adjusts its logits)."""
    if sampling.adjustments is None:
        return None
    pairs = [(r, t) for r, tokens in enumerate(drafted) for t in tokens]
    index = torch.tensor([r for r, _ in pairs], dtype=torch.int64, device=device)
    ids = torch.tensor([t for _, t in pairs], dtype=torch.int64, device=device)
    return PrecedingTokens(index, ids, torch.ones_like(index, dtype=torch.bool))


def drafted_rows(q: torch.Tensor) -> list[bool]:  # q: [R, V] from sample_drafts
    """Per row, whether q is a distribution (False: the pipeline masked every token)."""
    return (~q[:, 0].isnan()).tolist()


def sample_from_draft_vocab(
    sampling: SamplingMetadata | None,  # of every request of the drafter's call (draft_metadata's)
    active: list[int],  # the requests drafting this round, one logit row each
    drafted: list[list[int]],  # their drafts so far
    logits: torch.Tensor,  # [R, N] over the draft vocabulary
    vocab: torch.Tensor,  # [N] int64, the target token id of each column
    vocab_size: int,
    position: int,
) -> tuple[list[int], torch.Tensor | None, list[bool]]:  # tokens, q rows [R, V] or None, usable
    """`sample_drafts` for a head over a reduced draft vocabulary. When every request of the
    call is greedy without penalties, bias or masks, the draft is the argmax of the head's own
    logits and q is not built (None: one-hot, which greedy verification never reads), sparing
    a pass over the target's whole vocabulary per draft."""
    if sampling is None:
        return vocab[argmax_rows(logits)].tolist(), None, [True] * len(active)
    if sampling.all_greedy and sampling.adjustments is None:
        # A grammar masks the head's own columns (no q over the whole vocabulary is needed).
        logits = grammar_masked(sampling, active, drafted, logits, vocab)
        return vocab[argmax_rows(logits)].tolist(), None, [True] * len(active)
    if sampling.adjustments is None and sampling.grammars is None:
        # Temperature, top-k, top-p and min-p give the tokens outside the draft vocabulary no
        # mass whether they are there or not, so q is built and drawn from over the head's own
        # columns, then widened: the pipeline over the whole vocabulary cost a sampled EAGLE
        # draft position ~0.6 ms of its ~0.85 on the embedded model.
        columns, q = sample_drafts(sampling, active, drafted, logits, position)
        return vocab[columns].tolist(), widen_probs(q, vocab, vocab_size), drafted_rows(q)
    tokens, q = sample_drafts(sampling, active, drafted, widen_vocab(logits, vocab, vocab_size), position)
    return tokens, q, drafted_rows(q)


def widen_probs(
    q: torch.Tensor,  # [R, N] a distribution over a reduced draft vocabulary
    vocab: torch.Tensor,  # [N] int64, the target token id of each column
    vocab_size: int,
) -> torch.Tensor:  # [R, vocab_size] float32, 0 outside `vocab`
    """q over the target's vocabulary, its values copied (the distribution the draft was drawn from)."""
    return q.new_zeros((q.shape[0], vocab_size)).index_copy_(1, vocab, q)


def widen_vocab(
    logits: torch.Tensor,  # [R, N] over a reduced draft vocabulary
    vocab: torch.Tensor,  # [N] int64, the target token id of each column
    vocab_size: int,
) -> torch.Tensor:  # [R, vocab_size] float32, -inf outside `vocab`
    """Draft logits over the target's vocabulary: tokens outside the draft vocabulary get
    q = 0, which the verifier handles exactly (their recovered mass comes from p)."""
    full = logits.new_full((logits.shape[0], vocab_size), float("-inf"), dtype=torch.float32)
    return full.index_copy_(1, vocab, logits.float())


def tree_children(
    requests: Sequence[DraftRequest],  # of the drafter's call
    active: list[int],  # the requests growing trees, in grow_trees' order
    vocab: torch.Tensor,  # [N] int64, the target token id of each draft column
    vocab_size: int,
) -> Pick:
    """How a drafter's trees pick children (spec_decode/trees.py): greedy requests rank them (top
    tokens of the draft logits); sampled ones draw them without replacement from q, their
    pipeline on the draft logits with the parent's path as penalty history, using the DRAFT
    stream at counter (parent + 1) * width + i for the i-th draw (parent -1 for the root), so a
    seeded request grows the same tree in any batch."""
    ranked = top_children(vocab)
    sampling = draft_metadata(requests, vocab.device)
    if sampling is None:
        return ranked

    def pick(logits: torch.Tensor, rows: list[tuple[int, int]], trees: list[GrownTree], width: int) -> Children:
        device = logits.device
        requests_of_rows = torch.tensor([active[r] for r, _ in rows], dtype=torch.int64, device=device)
        paths = [[trees[r].token_ids[j] for j in trees[r].path(parent)] if parent >= 0 else [] for r, parent in rows]
        wide = grammar_masked(sampling, [active[r] for r, _ in rows], paths, widen_vocab(logits, vocab, vocab_size))
        if sampling.grammars is not None:  # greedy children ranked among the allowed tokens too
            logits = wide[:, vocab]
        top = ranked(logits, rows, trees, width)  # logits: [rows, N]
        q = process_logits(wide, requests_of_rows, sampling,
                           preceding=_preceding(sampling, paths, device)).softmax(dim=-1)
        first = torch.tensor([(parent + 1) * width for _, parent in rows], dtype=torch.int64, device=device)
        drawn = draw_without_replacement(q, sampling.keys[requests_of_rows], first, width)
        greedy = sampling.is_greedy[requests_of_rows].tolist()
        largest = q.topk(min(width, q.shape[-1]), dim=-1).values.log().tolist()
        tokens, logprobs, priors = [], [], []
        for row, (chosen, values) in enumerate(zip(top.tokens, top.logprobs)):
            if greedy[row]:
                tokens.append(chosen)
                logprobs.append(values)
                priors.append(values)
                continue
            picked = [t for t in drawn[row].tolist() if t >= 0]
            tokens.append(picked)
            logprobs.append(q[row, picked].log().tolist())
            priors.append(largest[row])
        return Children(tokens, logprobs, q, [not g for g in greedy], priors)

    return pick


def grow_tree_batch(
    requests: Sequence[DraftRequest],  # of the drafter's call
    active: list[int],  # the requests growing trees (at least one), one root row each
    shape: TreeShape,
    root_logits: torch.Tensor,  # [len(active), N] draft logits of the roots' children
    vocab: torch.Tensor,  # [N] int64, the target token id of each draft column
    vocab_size: int,
    expand: Expand,
    exclude: Sequence[Collection[int]] | None = None,  # per request of the call (Drafter.propose_tree)
) -> TreeBatch:
    """A head drafter's trees for the call: grow_trees over the active requests' budgets,
    children picked by tree_children; requests that do not draft get empty trees. Excluded
    tokens get -inf root logits: ranked root children skip them, drawn ones come from the
    pipeline on the masked logits, which is the q row handed over."""
    if exclude is not None:
        root_logits = _masked(root_logits, [exclude[i] for i in active], vocab, vocab_size)
    grown, probs = grow_trees(shape, [requests[i].num_draft_tokens for i in active], root_logits, vocab, expand,
                              tree_children(requests, active, vocab, vocab_size))
    tokens: list[list[int]] = [[] for _ in requests]
    parents: list[list[int]] = [[] for _ in requests]
    for i, tree in zip(active, grown):
        tokens[i], parents[i] = tree.token_ids, tree.parents
    return TreeBatch(tokens, parents, probs, replacement=False)


def _masked(
    logits: torch.Tensor,  # [R, N] over the draft vocabulary
    exclude: Sequence[Collection[int]],  # per row, target token ids
    vocab: torch.Tensor,  # [N] int64, the target token id of each column
    vocab_size: int,
) -> torch.Tensor:  # [R, N], -inf at the excluded tokens' columns
    pairs = [(row, token) for row, tokens in enumerate(exclude) for token in tokens]
    if not pairs:
        return logits
    column = torch.full((vocab_size,), -1, dtype=torch.int64, device=vocab.device)
    column[vocab] = torch.arange(vocab.numel(), device=vocab.device)
    rows = torch.tensor([row for row, _ in pairs], dtype=torch.int64, device=logits.device)
    columns = column[torch.tensor([token for _, token in pairs], dtype=torch.int64, device=vocab.device)]
    inside = columns >= 0  # a token outside the draft vocabulary is never drafted anyway
    masked = logits.clone()
    masked[rows[inside], columns[inside]] = float("-inf")
    return masked


def draw_without_replacement(
    q: torch.Tensor,  # [R, V] distributions (a NaN row: the pipeline left no token)
    keys: torch.Tensor,  # [R] int64 stream keys
    first: torch.Tensor,  # [R] int64 counter of each row's first draw
    count: int,
) -> torch.Tensor:  # [R, count] int64 tokens in draw order, -1 once a row has no mass left
    """Up to `count` tokens per row, each drawn from q with the earlier draws removed and the
    rest renormalised (the order recursive rejection sampling assumes)."""
    weights = q.double().nan_to_num(0.0)
    drawn = []
    for i in range(count):
        alive = weights.sum(dim=-1) > 0
        token = sample_inverse_cdf(weights, uniform(keys, first + i, DRAFT))
        drawn.append(torch.where(alive, token, -1))
        weights.scatter_(1, token[:, None], 0.0)
    return torch.stack(drawn, dim=1)
