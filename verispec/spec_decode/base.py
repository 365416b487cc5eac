"""The drafter contract: what a drafter sees of each request and what it hands back."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from verispec.sampling_params import SamplingParams
from verispec.structured.matcher import GrammarMatcher

from .trees import TreeBatch, TreeShape


@dataclass(frozen=True)
class DraftRequest:
    """What a drafter sees of one request at one decode step.

    token_ids: prompt + output so far; the last one is the newest emitted token, the one the
        draft continues from.
    num_draft_tokens: K, the most draft tokens to propose for this request this step (0: none).
    params: the request's sampling parameters (the target's pipeline; see Drafter).
    seed: the request's resolved seed; with ``step`` it keys the drafter's random numbers so that
        a sampling drafter is batch-invariant.
    step: the request's decode-step counter.
    num_prompt_tokens: how many of ``token_ids`` are the prompt; the rest is the output, which
        frequency / presence penalties count (the repetition penalty counts both). A drafter
        that samples with the request's pipeline penalises each draft position with the output
        followed by its own drafts before that position, as the verifier does.
    batch_invariant: its tokens must not depend on the rest of the batch (a seeded sampled
        request), so neither may its drafts: a drafter with a shared, bounded resource (a
        draft model's cache) serves it before the others.
    grammar: structured output's grammar after the output (None without one): a drafter that
        samples masks each draft row with grammar.masks([its drafts before that row]); the
        engine cuts proposals at the first token the grammar forbids.
    """

    request_id: str
    token_ids: Sequence[int]
    num_draft_tokens: int
    params: SamplingParams
    seed: int
    step: int
    num_prompt_tokens: int = 0
    batch_invariant: bool = False
    grammar: GrammarMatcher | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.num_prompt_tokens <= len(self.token_ids):
            raise ValueError(
                f"num_prompt_tokens={self.num_prompt_tokens!r} is invalid: expected an integer in "
                f"[0, {len(self.token_ids)}], the length of token_ids"
            )

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class DraftBatch:
    """The drafts for a batch of requests, in the order of the requests.

    token_ids: per request, its draft tokens; at most its ``num_draft_tokens``, maybe fewer or none.
    probs: the draft distributions q, one row per draft token, requests concatenated in batch
        order; None for a one-hot drafter (q puts all its mass on the proposed token).
    """

    token_ids: list[list[int]]
    probs: torch.Tensor | None = None  # [total_draft_tokens, vocab_size] float32

    def __post_init__(self) -> None:
        if self.probs is not None:
            total = sum(len(t) for t in self.token_ids)
            if self.probs.dim() != 2 or self.probs.shape[0] != total:
                raise ValueError(
                    f"probs has shape {tuple(self.probs.shape)}: expected "
                    f"[{total}, vocab_size], one row per draft token"
                )

    @property
    def num_draft_tokens(self) -> list[int]:
        """Per request, how many draft tokens were proposed."""
        return [len(t) for t in self.token_ids]


@dataclass(frozen=True)
class FedTokens:
    """The tokens one request fed to the target in one forward pass (its conditional sequence:
    a CFG companion's are not handed over), whose hidden states a learned drafter reads.

    token_ids sit at positions start, start + 1, ...; their hidden states are rows
    first_row, first_row + 1, ... of the pass's hidden tensor. They are the request's pending
    tokens followed by the step's drafts, so the rows past the accepted drafts belong to
    tokens the verifier rejected: a drafter keeps only what the request's tokens confirm.
    """

    request_id: str
    start: int
    token_ids: Sequence[int]
    first_row: int


class Drafter(ABC):
    """Proposes draft tokens for the target model to verify.

    Contract:
    - ``propose`` returns one entry per request, in order. A proposal may be shorter than the
      request's ``num_draft_tokens`` (down to empty); the engine then verifies fewer tokens.
    - ``probs``, when given, must hold the exact distributions the draft tokens were sampled
      from. Normally that is the draft logits after the request's sampling pipeline (the
      SamplingParams order, penalties with the draft's own history included, without CFG),
      the pipeline the target's p goes through too; a
      drafter that sampled with other parameters hands over the q it actually used. The output
      is distributed exactly as the target only if q is the distribution sampled from.
      A drafter whose tokens are deterministic (n-gram lookup, greedy drafting) returns
      ``probs=None``: q is then one-hot at each proposed token. Otherwise every draft token has
      a row, greedy requests' included (their verification compares with the target's argmax
      and ignores q).
    - A drafter may keep per-request state between calls (an index, a draft KV cache), keyed by
      ``request_id``; it must drop it in ``release``, which the engine calls when a request
      finishes, fails or is cancelled. Proposals only affect speed, never the output
      distribution, so stale state may cost acceptance but never correctness.
    - A drafter that reads the target's hidden states names their layers in ``hidden_layers``
      (LlamaModel.forward_hidden numbering); the engine then hands it, after every target
      forward pass, the hidden states of every token fed in it (``observe``), prefill chunks
      included. Observations concern tokens that may still be rejected (see FedTokens).
    """

    hidden_layers: tuple[int, ...] = ()
    # Whether it drafts from features with holes (spec_decode/features.py): the engine then
    # captures hidden states only when a request may draft soon, and lets the target take a
    # request's whole cached prefix, unless the request is batch invariant (its drafts, and so
    # its tokens, must not depend on what other requests made the engine capture or cache).
    drafts_over_holes: bool = False
    # Declared acceptance by draft class (draft_class), index c for class c: where the adaptive K
    # starts its estimate of how often the target takes a class-c draft after the one before
    # it. Empty: one class, the adaptive K's own prior.
    class_priors: tuple[float, ...] = ()
    # Classes whose drafts cost next to nothing beside the calls draft_cost describes (the
    # hybrid's lookup drafts): the adaptive K prices them by their rows alone.
    free_classes: frozenset[int] = frozenset()

    def draft_class(self, request_id: str, token_ids: Sequence[int]) -> int | None:
        """What kind of draft the request's context would get next, told before drafting and
        for much less than a draft (the n-gram lookup's match length): drafts of one class are
        accepted alike, so the adaptive K estimates acceptance per class and drafts the moment
        a good class turns up. A function of the context alone (seeded requests stay batch
        invariant). None: nothing to draft. Asked only of a drafter with class_priors; this
        default: 0."""
        return 0

    def draft_cost(self, depth: int, num_requests: int) -> float:
        """What one ``propose`` call costs when `num_requests` requests draft and the deepest
        gets `depth` drafts, in units of the target step's fixed cost (verispec.config.DraftCost;
        0 when depth or num_requests is 0). Declared, never timed: the adaptive K
        (spec_decode/adaptive.py) weighs it against the tokens drafts bring, and seeded requests must
        get the same K on every machine. This default: free."""
        return 0.0

    def restorable_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        """How many leading tokens of a request being admitted the target may take from its
        prefix cache (verispec/runtime/prefix_cache.py), so that their hidden states are never
        observed, with this drafter still able to draft for it (or, recording, to record them).
        A drafter may hold state for the request from here on (it is released as usual); the
        engine asks again each time it tries to admit the request. This default: none for a
        drafter that reads hidden states (it may need every token's), all of them otherwise (its
        state comes from the token ids)."""
        return 0 if self.hidden_layers else len(token_ids)

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> DraftBatch:
        """Draft tokens for every request of the batch, in order."""

    def propose_tree(self, requests: Sequence[DraftRequest], shape: TreeShape,
                     exclude: Sequence[Collection[int]] | None = None) -> TreeBatch:
        """Draft trees of at most `shape` (a static shape or a DynamicTree, spec_decode/trees.py) and
        ``num_draft_tokens`` nodes per request. `exclude`, per request: tokens the root's
        children must avoid because another drafter proposes them as root children verified
        before this tree's (spec_decode/hybrid.py); a sampled root child is then drawn from q without
        them, and its q row is that distribution. This default drafts a chain with
        ``propose``: a tree of one branch, none for a request with exclusions (its chain's
        first draft could not avoid them)."""
        if exclude is not None and any(exclude):
            requests = [dataclasses.replace(r, num_draft_tokens=0) if avoid else r
                        for r, avoid in zip(requests, exclude, strict=True)]
        batch = self.propose(requests)
        return TreeBatch(batch.token_ids, [list(range(-1, len(t) - 1)) for t in batch.token_ids],
                         batch.probs)

    def absorb(self, requests: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Takes in what the target just computed for each (request id, token ids) without
        drafting (the engine calls it for a request at K = 0 whose prompt was just computed):
        a drafter with a cache of its own may fill and publish it. This default: nothing."""

    def observe(
        self,
        fed: Sequence[FedTokens],
        hidden: torch.Tensor,  # [T, len(hidden_layers) * hidden_size], rows as FedTokens say
    ) -> None:
        """The target's hidden states of the tokens fed in one forward pass; called only for a
        drafter with ``hidden_layers``."""

    def release(self, request_id: str) -> None:
        """Forget everything kept for ``request_id``; an unknown id is a no-op."""
