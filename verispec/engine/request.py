"""Request state: plain Python bookkeeping, no tensors.

Terms:
- a *request* is one prompt being completed; its *output* tokens are shared by its sequences;
- a *sequence* is a KV history in the cache: the request's conditional sequence (prompt +
  output) and, for classifier-free guidance, its *unconditional companion* (negative prompt, or
  the prompt's last token, + the same output). Both are scheduled, preempted and freed together;
- a sequence's *computed* tokens are those whose K/V are in the cache; its *pending* tokens are
  the rest. A request *samples* in a step when every pending token of every sequence is fed in
  that step: the rows of its last pending token and of its draft tokens then give logits;
- *step* counts the request's sampling steps; with the seed it keys the request's random numbers;
- its *max_tokens* is SamplingParams.max_tokens, or with max_tokens=None the room its longest
  sequence leaves in the engine's max_model_len (the engine refuses a max_tokens beyond it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..sample.logprobs import TokenLogprob
from ..sampling_params import SamplingParams
from ..spec_decode.metrics import SpecDecodeStats
from ..structured.matcher import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not in the cache (new, or preempted and to be recomputed)
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, or the model's context length
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # could not be served (larger than the whole KV cache, or it raised); see error


@dataclass
class Sequence:
    seq_id: str
    prefix_token_ids: list[int]  # the prompt (conditional) or the negative prompt (companion)
    num_computed: int = 0
    # Chain hashes of its first full blocks (runtime/prefix_cache.py), kept across preemption: tokens only grow.
    block_hashes: list[bytes] = field(default_factory=list)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int  # admission order; the newest running request is preempted first
    num_speculative_tokens: int  # K for the next step (adaptive), at most max_speculative_tokens
    max_speculative_tokens: int
    uncond_token_ids: list[int] | None = None  # CFG companion prefix; None without CFG
    prompt: str | None = None
    max_tokens: int | None = None  # the effective cap (module docstring); None: params.max_tokens
    group: str | None = None  # admission fairness (Scheduler); None: the request is its own group
    grammar: GrammarMatcher | None = None  # structured output: the grammar after output_token_ids
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # aligned with output_token_ids when params.logprobs is set
    text: str = ""
    streamed_chars: int = 0  # text[:streamed_chars] has been handed out in RequestOutputs
    step: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    # "invalid_request" when the request itself could not be served (its grammar cannot go on),
    # "server" for any other failure; None unless finish_reason is "error".
    error_kind: str | None = None
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at its first admission
    stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    seqs: list[Sequence] = field(init=False)

    def __post_init__(self) -> None:
        if self.max_tokens is None:
            self.max_tokens = self.params.max_tokens
        self.seqs = [Sequence(self.request_id, self.prompt_token_ids)]
        if self.uncond_token_ids is not None:
            self.seqs.append(Sequence(f"{self.request_id}#uncond", self.uncond_token_ids))

    @property
    def uses_cfg(self) -> bool:
        return len(self.seqs) == 2

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def num_tokens(self, seq: Sequence) -> int:
        return len(seq.prefix_token_ids) + len(self.output_token_ids)

    def all_token_ids(self, seq: Sequence | None = None) -> list[int]:
        seq = seq or self.seqs[0]
        return seq.prefix_token_ids + self.output_token_ids

    def pending_token_ids(self, seq: Sequence, limit: int | None = None) -> list[int]:
        """Up to `limit` tokens of `seq` not yet in the cache, in order."""
        start = seq.num_computed
        end = self.num_tokens(seq) if limit is None else min(self.num_tokens(seq), start + limit)
        prefix = seq.prefix_token_ids
        if start >= len(prefix):
            return self.output_token_ids[start - len(prefix) : end - len(prefix)]
        return prefix[start:end] + self.output_token_ids[: max(0, end - len(prefix))]

    def num_pending(self, seq: Sequence) -> int:
        return self.num_tokens(seq) - seq.num_computed

    @property
    def remaining_tokens(self) -> int:
        return self.max_tokens - len(self.output_token_ids)

    @property
    def batch_invariant(self) -> bool:
        """Whether its tokens must not depend on the batch: a seeded sampled request. K decides
        which random numbers it consumes, so its K comes from its own history alone: never
        trimmed to fit the step's token budget or the batch's cost (it waits for a step with room
        instead), and priced at batch size 1 by adaptive K."""
        return self.params.seed is not None and not self.params.greedy
