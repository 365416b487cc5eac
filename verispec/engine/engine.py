"""LLMEngine: one step = schedule -> draft -> one target forward -> verify -> commit.

Terms as in request.py (request, sequence, pending, sampling step) and sample/rejection.py
(draft, target, accepted, emitted). Per step, every request that samples feeds its last pending
token followed by its draft tokens; the target forward pass gives K + 1 rows per request (and the
same rows for a CFG companion), rejection_sample emits accepted drafts + one token, and the
scheduler keeps the accepted prefix in the cache and rolls the rest back. With a tree
(SpeculativeConfig.tree) the drafts are a tree fed with tree attention, verify_tree picks the
accepted path, and the runner moves its cache entries in place before the rollback (tree.py).

Requests enter in two steps: `prepare_request` validates and encodes (no state changes, so a
caller can check a whole batch before queueing any of it), `enqueue` queues.

Failure isolation: drafting, the forward pass and verification run for the step's batch and
change no request state, so when they raise the batch is run again one request at a time
(the KV slots reserved for the step stay reserved and are simply written again; drafter state
of the batch is released, since a half-run drafter may hold state for tokens it never
computed). A request that raises on its own, or while its emitted tokens are committed and
detokenized, finishes with FinishReason.ERROR and the exception in `error`; its blocks (both CFG
sequences) and drafter state are freed, and the other requests go on, each emitting its tokens
exactly once.

Stop strings: the text is cut where the earliest stop string begins, among those the newest
token completed; text that may begin a stop string is held back from `new_text` until a later
token decides it.
"""

from __future__ import annotations

import itertools
import logging
import math
import reprlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..config import EngineConfig
from ..model import IncrementalDecoder, LlamaModel, Tokenizer
from ..model.product_choice import machine_key
from ..model.quant.kernels import default_kernel
from ..sample import DraftProbs, SamplingMetadata, rejection_sample, verify_tree
from ..sample.greedy import greedy_chains, plain_greedy
from ..sample.metadata import MetadataBuffers
from ..sample.logprobs import TokenLogprob, emitted_logprobs, token_logprobs
from ..sampling_params import SamplingParams
from ..sample.rng import fresh_seed
from ..spec_decode.adaptive import AdaptiveK, DraftClaim, TreeGate, finish_shares
from ..spec_decode.cost_cache import CostCache
from ..spec_decode.cost_learner import CostLearner, learning_enabled
from ..spec_decode.base import DraftBatch, Drafter, DraftRequest, FedTokens
from ..structured import GrammarCompiler, GrammarError, GrammarMatcher, apply_token_mask, chain_prefixes, tree_prefixes
from ..spec_decode.trees import branching
from ..spec_decode.metrics import SpecDecodeStats
from ..spec_decode.trace import StepRecord, ends_in_bonus
from ..runtime.kv_cache import BlockManager
from ..runtime.prefix_cache import identity_key
from ..runtime.row_cost import measure_row_cost
from .request import FinishReason, Request
from ..runtime.runner import Feed, ModelRunner
from ..runtime.static_step import StaticShapes
from .scheduler import ScheduledRequest, Scheduler
from .tree import accepted_rows, feed_parents, path_move

# Steps before a probe whose hidden states are kept for it (LLMEngine._feature_requests): the head's
# newest positions then hold true features, as when it drafts every step.
FEATURE_LEAD = 4

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """A request's state after a step. `new_text` / `new_token_ids` are what this step added."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    error: str | None = None  # why, when finish_reason is "error"
    # With an error: "invalid_request" when the request's own grammar could not go on (a client
    # error: retrying it fails again), "server" otherwise.
    error_kind: str | None = None
    # With SamplingParams.logprobs: one record per token of token_ids / new_token_ids.
    logprobs: list[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] | None = None
    # Prompt tokens taken from the prefix cache at admission (None before the request was admitted).
    num_cached_tokens: int | None = None
    # The verify step that emitted new_token_ids (None when the output emitted nothing):
    # StepRecord.origins(len(new_token_ids)) says which were accepted drafts.
    new_step: StepRecord | None = None
    # LLM.chat with tools that may be called: the calls read from `text` (verispec.tools.ToolCall).
    tool_calls: list | None = None


@dataclass(frozen=True)
class PreparedRequest:
    """A validated, encoded request, not yet queued (LLMEngine.prepare_request).

    num_speculative_tokens: the most draft tokens (tree nodes, with SpeculativeConfig.tree) per
        step (0 without a drafter).
    """

    request_id: str | None
    prompt: str | None
    prompt_token_ids: list[int]
    uncond_token_ids: list[int] | None
    params: SamplingParams
    num_speculative_tokens: int
    group: str | None = None  # requests sharing a group are admitted fairly against other groups
    grammar: GrammarMatcher | None = None  # structured output, compiled (params.grammar_spec)


@dataclass(frozen=True)
class _Emitted:
    """What verification gave one sampling request in a step."""

    token_ids: list[int]
    num_accepted: int
    num_draft: int
    logprobs: list[TokenLogprob] | None  # per token, when the request asked for them
    bonus: bool  # the last token follows an accepted path with no draft after it (trace.py)


@dataclass(frozen=True)
class _Drafts:
    """A step's drafts: per drafting request id its tokens and, for trees, its node parents;
    the draft distributions ([total drafts, V], requests in step order) or None (one-hot)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    parents: dict[str, list[int]] = field(default_factory=dict)
    probs: torch.Tensor | None = None
    replacement: bool = True  # tree siblings drawn with replacement (TreeBatch.replacement)

    def of(self, request_id: str) -> list[int]:
        return self.tokens.get(request_id, [])


@dataclass(frozen=True)
class _Verified:
    """Verification's result for one sampling request (path: the accepted tree nodes, root
    side first; for a chain the accepted drafts' indices)."""

    token_ids: list[int]
    path: list[int]
    logprobs: list[TokenLogprob] | None


class LLMEngine:
    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer,
        config: EngineConfig = EngineConfig(),
        drafter: Drafter | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.drafter = drafter
        spec = config.speculative
        self.tree = spec.tree if drafter is not None else None
        self.adaptive: AdaptiveK | TreeGate | None = None
        if drafter is not None and spec.adaptive:
            cost = spec.draft_cost or drafter.draft_cost
            row_cost = model.row_cost if spec.row_cost is None else spec.row_cost
            self.adaptive = AdaptiveK(spec.num_speculative_tokens, row_cost, draft_cost=cost,
                                      class_priors=drafter.class_priors, free_classes=drafter.free_classes) \
                if self.tree is None else \
                TreeGate(spec.num_draft_tokens, min(len(branching(self.tree)), spec.num_draft_tokens),
                         row_cost, draft_cost=cost)
        # Constants the user gave stay as given; the declared ones are only where learning starts.
        self.costs: CostLearner | None = None
        if self.adaptive is not None and spec.learn_costs and spec.row_cost is None and spec.draft_cost is None \
                and learning_enabled():
            # The quantized products' kernel too: forcing another one (or a new variant for this
            # CPU) changes what a row costs.
            key = (machine_key(), type(model).__name__, model.config, model.dtype,
                   model.quantized and default_kernel(), type(drafter).__name__, self.tree,
                   [cost(d, n) for d in (1, 2, 4) for n in (1, 4)])
            self.costs = CostLearner(self.adaptive, row_cost, cost, CostCache(repr(key)))
        # (rows, drafting seconds, sampling requests) of a decode step
        self._step_timing: tuple[int, float, int] | None = None
        # Every chain hash starts from the model, its dtype and whether its weights are
        # quantized: a block's keys and values are a function of these and the token prefix alone.
        root = identity_key("target", type(model).__name__, model.config, model.dtype, model.quantized) \
            if config.cache.enable_prefix_caching else None
        window = model.config.cache_window if config.cache.free_out_of_window else None
        self.blocks = BlockManager(config.cache.num_blocks, config.cache.block_size, prefix_root=root,
                                   window=window)
        self.scheduler = Scheduler(config, self.blocks, prefix_limit=None if drafter is None else self._prefix_limit)
        self.runner = ModelRunner(model, self.blocks, *_static_shapes(config, model))
        # On a GPU a pass's time is mostly the host's and the declared constants stand (timing
        # there would also record CUDA graphs of the scratch shapes).
        if self.costs is not None and model.device.type == "cpu":
            self.costs.calibrate(lambda: measure_row_cost(self.runner, self.blocks, model.config.vocab_size,
                                                          model.padded_rows))
        # Padded steps keep the sampler's per-step tensors in buffers too (sample/metadata.py).
        self._metadata_buffers = MetadataBuffers(model.device) if self.runner.static is not None else None
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = set(model.config.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, sorted(self.eos_token_ids), config.structured)
        self._arrival = itertools.count()
        self._steps = 0  # engine steps run so far
        self._requests: dict[str, Request] = {}
        self._decoders: dict[str, IncrementalDecoder] = {}

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        num_speculative_tokens: int | None = None,
    ) -> str:
        """Queues a prompt (text or token ids); returns its request id."""
        return self.enqueue(self.prepare_request(prompt, params, request_id, num_speculative_tokens))

    def prepare_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        num_speculative_tokens: int | None = None,
        *,
        name: str = "prompt",
        add_special_tokens: bool = True,
        group: str | None = None,
    ) -> PreparedRequest:
        """Validates and encodes a request without queueing it; raises ValueError / TypeError
        naming the bad argument (`name` is what the prompt is called in that message).
        add_special_tokens=False: a prompt text whose chat template wrote its own BOS.
        group: the scheduler admits waiting requests round-robin over groups (e.g. the n x
        prompts of one server request), so one group's fan-out cannot starve the others; by
        default every request is its own group (admission in arrival order).
        Touches no engine state, so it may run on another thread than step()."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params is {type(params).__name__}: expected SamplingParams")
        params.check_vocab(self.vocab_size)
        text, ids = self._encode(name, prompt, add_special_tokens)
        uncond = None
        if params.uses_cfg:
            # Plain text, not rendered by a chat template: encoded as the model expects (with BOS).
            uncond = self._encode("negative_prompt", params.negative_prompt)[1] if params.negative_prompt else ids[-1:]
        for what, tokens in ((name, ids), ("negative_prompt", uncond or [])):
            if len(tokens) >= self.config.max_model_len:
                raise ValueError(f"{what} has {len(tokens)} tokens: expected fewer than "
                                 f"max_model_len ({self.config.max_model_len})")
        # As vLLM: a completion the context cannot hold is refused, not silently cut short.
        room = self.config.max_model_len - max(len(ids), len(uncond or []))
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(f"max_tokens={params.max_tokens} is too large: the {name} has {len(ids)} tokens"
                             f"{f' (negative_prompt {len(uncond)})' if uncond and len(uncond) > len(ids) else ''}"
                             f" and max_model_len is {self.config.max_model_len}, so at most {room} can be "
                             f"generated")
        if request_id is not None and request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        spec = self.config.speculative
        k = spec.num_draft_tokens if spec.enabled else 0
        if num_speculative_tokens is not None:
            if not isinstance(num_speculative_tokens, int) or isinstance(num_speculative_tokens, bool) \
                    or not 0 <= num_speculative_tokens <= 64:
                raise ValueError(f"num_speculative_tokens={num_speculative_tokens!r} is invalid: "
                                 "expected an integer in [0, 64]")
            k = num_speculative_tokens
        # Compiled here, off the engine thread when the caller is (the server), and cached.
        grammar = self.grammars.matcher(params.grammar_spec) if params.grammar_spec is not None else None
        return PreparedRequest(request_id, text, ids, uncond, params, k if self.drafter is not None else 0, group,
                               grammar)

    def enqueue(self, prepared: PreparedRequest) -> str:
        """Queues a request from prepare_request; returns its request id."""
        arrival = next(self._arrival)
        request_id = prepared.request_id if prepared.request_id is not None else f"req-{arrival}"
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        params, k = prepared.params, prepared.num_speculative_tokens
        room = self.config.max_model_len - max(len(prepared.prompt_token_ids), len(prepared.uncond_token_ids or []))
        request = Request(
            request_id=request_id, prompt_token_ids=prepared.prompt_token_ids, params=params,
            seed=params.seed if params.seed is not None else fresh_seed(),
            arrival=arrival, num_speculative_tokens=k, max_speculative_tokens=k,
            uncond_token_ids=prepared.uncond_token_ids, prompt=prepared.prompt,
            logprobs=None if params.logprobs is None else [],
            max_tokens=room if params.max_tokens is None else params.max_tokens,
            group=prepared.group, grammar=prepared.grammar,
        )
        request.num_speculative_tokens = self._next_k(request)
        self._requests[request_id] = request
        self._decoders[request_id] = self.tokenizer.incremental_decoder(context=prepared.prompt_token_ids)
        self.scheduler.add(request)
        return request_id

    def _encode(self, name: str, value: object, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt given as text or as token ids."""
        if isinstance(value, str):
            # A text too long for any tokenization to fit is refused before encoding it (a
            # 20 MB prompt would take seconds and gigabytes to tokenize only to be refused).
            # No token covers more than longest_token characters (4x for normalizers that merge
            # characters), so a longer text has at least max_model_len tokens. longest_token
            # reads the whole vocabulary (~0.1 s), so only a text that could be that long asks.
            limit = self.config.max_model_len
            if len(value) > limit and len(value) > 4 * self.tokenizer.longest_token * limit:
                raise ValueError(f"{name} has {len(value)} characters: at least max_model_len "
                                 f"({self.config.max_model_len}) tokens, expected fewer")
            ids = self.tokenizer.encode(value, add_special_tokens=add_special_tokens)
            if not ids:
                raise ValueError(f"{name}={reprlib.repr(value)} encodes to no tokens: expected non-empty text")
            return value, ids
        expected = f"a str, or a non-empty list of int token ids in [0, {self.vocab_size})"
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name}={reprlib.repr(value)} is a {type(value).__name__}: expected {expected}")
        for i, t in enumerate(value):
            if isinstance(t, bool) or not isinstance(t, int):
                raise TypeError(f"{name}={reprlib.repr(value)} holds {t!r} ({type(t).__name__}) at index {i}: "
                                f"expected {expected}")
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"{name}={reprlib.repr(value)} holds {t} at index {i}: expected {expected}")
        if not value:
            raise ValueError(f"{name}=[] is empty: expected {expected}")
        return None, list(value)

    def abort(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None and not request.finished:
            self._finish(request, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns the outputs of requests that changed. Never raises
        for a request's sake: a request whose scheduling, drafting, verification or drafter
        bookkeeping raises is failed (module docstring)."""
        self._steps += 1
        start = time.perf_counter()
        self._step_timing = None
        try:
            plan = self.scheduler.schedule()
        except Exception as error:  # outside any one request's planning: nobody can be served
            logger.exception("scheduling raised; failing every unfinished request")
            return [self._fail(r, error) for r in [*self.scheduler.running, *self.scheduler.waiting]]
        outputs = [self._output(r, []) for r in plan.failed]
        for request in plan.failed:
            self._forget(request)
        for request in plan.preempted:
            error = self._release(request.request_id)
            if error is not None:
                outputs.append(self._fail(request, error))
        outputs += self._run(plan.scheduled)
        if self.costs is not None and self._step_timing is not None:
            rows, drafting, requests = self._step_timing
            self.costs.observe_pass(self.model.padded_rows(rows), time.perf_counter() - start - drafting, requests)
        return outputs

    def _run(self, scheduled: list[ScheduledRequest]) -> list[RequestOutput]:
        """Runs the scheduled requests as one batch; if that raises, one at a time (module
        docstring), failing the requests that raise alone."""
        if not scheduled:
            return []
        try:
            emitted = self._execute(scheduled)
        except Exception as error:
            # A half-run drafter may hold state for tokens it never computed; a request whose
            # state cannot be dropped cannot be drafted for again.
            unreleased = {p.request.request_id: e for p in scheduled
                          if (e := self._release(p.request.request_id)) is not None}
            failed = [self._fail(p.request, unreleased[p.request.request_id]) for p in scheduled
                      if p.request.request_id in unreleased]
            scheduled = [p for p in scheduled if p.request.request_id not in unreleased]
            if len(scheduled) == 1 and not failed:
                return [self._fail(scheduled[0].request, error)]
            logger.warning("a batch of %d requests raised; running them one at a time", len(scheduled))
            return failed + [out for p in scheduled for out in self._run([p])]
        outputs = []
        for p, e in zip(scheduled, emitted):
            try:
                out = self._commit(p, e)
            except Exception as error:
                out = self._fail(p.request, error)
            if out is not None:
                outputs.append(out)
        return outputs

    def _execute(self, scheduled: list[ScheduledRequest]) -> list[_Emitted | None]:
        """Drafts, runs the target and verifies; changes no request state (only the KV slots
        reserved for the step are written). Per scheduled request, what it emits (None when it
        only fed a prefill chunk)."""
        sampling = [p for p in scheduled if p.samples]
        start = time.perf_counter()
        drafts = self._propose(scheduled, sampling)
        drafting = time.perf_counter() - start
        feeds = []
        fed: list[FedTokens] = []  # each request's conditional sequence, for a drafter that reads hidden states
        row = 0
        for p in scheduled:
            rid = p.request.request_id
            d = drafts.of(rid)
            for seq, n in zip(p.request.seqs, p.num_new):
                if p.samples or n > 0:  # a sequence with nothing to feed this step feeds nothing
                    feed = Feed(seq.seq_id, p.request.pending_token_ids(seq, n) + d, seq.num_computed,
                                len(d) + 1 if p.samples else 0,
                                feed_parents(n, drafts.parents[rid]) if rid in drafts.parents else None)
                    if seq is p.request.seqs[0]:
                        fed.append(FedTokens(rid, feed.start, feed.token_ids, row))
                    feeds.append(feed)
                    row += len(feed.token_ids)
        # Only decode steps teach the cost model: a prefill chunk's rows cost what a long
        # sequence's attention does, not what a verify row does.
        if sampling and all(n <= 1 for p in scheduled for n in p.num_new):
            self._step_timing = (row, drafting, len(sampling))
        layers = self.drafter.hidden_layers if self.drafter is not None else ()
        wanted = self._feature_requests(scheduled) if layers else set()
        hidden = None
        if wanted is None or wanted:
            logits, hidden = self.runner.forward_hidden(feeds, layers)
        else:
            logits = self.runner.forward(feeds)
        verified = self._verify(sampling, drafts, logits) if sampling else []
        results = dict(zip((p.request.request_id for p in sampling), verified))
        if self.tree is not None:
            self.runner.move_kv([path_move(seq.seq_id, seq.num_computed, n, results[p.request.request_id].path)
                                 for p in sampling for seq, n in zip(p.request.seqs, p.num_new)])
        if hidden is not None:
            if self.tree is not None:
                # Only the tokens the request keeps: the pending ones and the accepted path.
                fed, index = accepted_rows(fed, {rid: len(drafts.of(rid)) for rid in results},
                                           {rid: v.path for rid, v in results.items()})
                hidden = hidden[torch.tensor(index, device=hidden.device)]
            if wanted is None:
                self.drafter.observe(fed, hidden)
            else:
                # A batch-invariant request's features are its own choice alone.
                invariant = {p.request.request_id for p in scheduled if p.request.batch_invariant}
                self.drafter.observe([f for f in fed if f.request_id in wanted or f.request_id not in invariant],
                                     hidden)
                # A prompt at K = 0 goes into the drafter's own cache now, not at a first probe
                # (which would catch up on all of it, or never come for a short request): the next
                # request with it then finds it there (a seeded one may take from the target's
                # prefix cache only that much), and probes feed the head only what came after.
                self.drafter.absorb([(p.request.request_id, p.request.all_token_ids()) for p in scheduled
                                     if p.samples and max(p.num_new) > 1 and p.request.num_speculative_tokens == 0])
        emitted: list[_Emitted | None] = []
        for p in scheduled:
            rid = p.request.request_id
            v = results.get(rid) if p.samples else None
            emitted.append(None if v is None else _Emitted(
                v.token_ids, len(v.path), len(drafts.of(rid)), v.logprobs,
                ends_in_bonus(len(drafts.of(rid)), drafts.parents.get(rid), v.path)))
        return emitted

    def _commit(self, p: ScheduledRequest, emitted: _Emitted | None) -> RequestOutput | None:
        """Keeps what the step computed for one request and appends its emitted tokens."""
        if emitted is None:
            self.scheduler.commit(p, 0)
            return None
        request = p.request
        self.scheduler.commit(p, emitted.num_accepted)
        request.step += 1
        request.stats.observe(emitted.num_draft, emitted.num_accepted)
        if self.adaptive is not None:
            self.adaptive.observe(request.request_id, emitted.num_draft, emitted.num_accepted)
        step = StepRecord(request.step, emitted.num_draft, emitted.num_accepted, emitted.bonus)
        output = self._append(request, emitted.token_ids, emitted.logprobs, step)
        if self.adaptive is not None and not request.finished:  # K for the tokens now appended
            request.num_speculative_tokens = self._next_k(request)
        return output

    def _fail(self, request: Request, error: Exception) -> RequestOutput:
        logger.warning("request %s failed", request.request_id, exc_info=error)
        self._finish(request, FinishReason.ERROR, f"{type(error).__name__}: {error}")
        request.error_kind = "invalid_request" if isinstance(error, GrammarError) else "server"
        return self._output(request, [])

    def _prefix_limit(self, request: Request) -> int:
        """How much of its cached prefix the target may take for a request being admitted: what
        the drafter can restore (it maps that much of its own state), or all of it when the
        drafter drafts over holes and the request is not batch invariant (Drafter.drafts_over_holes)."""
        tokens = request.all_token_ids()
        restorable = self.drafter.restorable_prefix(request.request_id, tokens)
        return len(tokens) if self._holes_allowed(request) else restorable

    def _holes_allowed(self, request: Request) -> bool:
        return self.drafter.drafts_over_holes and not request.batch_invariant

    def _feature_requests(self, scheduled: list[ScheduledRequest]) -> set[str] | None:
        """The requests whose hidden states this pass captures for the drafter (None: every
        one's). A drafter that drafts over holes gets them only where it may read them soon:
        prompts (a request's context) unless the drafter has stepped aside, a request that
        drafts this step (and likely the next), one whose probe is at most FEATURE_LEAD steps
        away; a step of requests at K = 0 (a drafter that does not pay on this text) then runs
        the target's plain pass. A drafter whose probes stopped paying (AdaptiveK.stepped_aside)
        gets no features for drafts that do not need them (the hybrid's lookup drafts: at batch
        16 they had the pass capture in 114 of 128 steps, for three head probes), and no prompt
        either: a new request's first probe is then 128 steps away or more, and
        feeding the head its prompt (EagleDrafter.absorb) cost EAGLE ~1 % of a short answer's
        time and a seventh of every prefill's for nothing; a probe that does come feeds the
        prompt as a hole (exact, its first drafts a little worse). A batch-invariant request
        decides from its own K and probe schedule alone, and keeps only the features it chose
        (`_execute`), so that its drafts never depend on the batch."""
        if self.adaptive is None or not self.drafter.drafts_over_holes:
            return None
        batch = len(self.scheduler.running)
        aside = self.adaptive.stepped_aside
        wanted = set()
        for p in scheduled:
            request = p.request
            if request.max_speculative_tokens == 0:
                continue
            soon = self.adaptive.probes_within(request.request_id, FEATURE_LEAD, declared=True) \
                if request.batch_invariant else \
                self.adaptive.probes_within(request.request_id, FEATURE_LEAD, batch, self._steps + 1)
            prompt = not p.samples or max(p.num_new) > 1
            drafts = request.num_speculative_tokens > 0 and (
                request.batch_invariant or not aside or self.adaptive.priced(request.request_id))
            if soon or drafts or (prompt and (request.batch_invariant or not aside)):
                wanted.add(request.request_id)
        return wanted

    def _next_k(self, request: Request) -> int:
        cap = request.max_speculative_tokens
        if cap == 0 or self.adaptive is None:
            return cap
        draft_class = self.drafter.draft_class(request.request_id, request.all_token_ids()) \
            if self.drafter.class_priors and self.tree is None else 0
        if request.batch_invariant:
            return min(cap, self.adaptive.num_draft_tokens(request.request_id, declared=True,
                                                           draft_class=draft_class))
        return min(cap, self.adaptive.num_draft_tokens(
            request.request_id, len(self.scheduler.running), engine_step=self._steps + 1, draft_class=draft_class))

    def _finish_shares(self, speculating: list[ScheduledRequest]) -> list[float] | None:
        """Per speculating request, its share of the batch's finish (spec_decode/adaptive.py
        finish_shares) among all running ones, a request still in its prompt included, each
        expected to run to its max_tokens; None while requests wait for a slot (every token
        alike brings the next one in). EOS may end any of them sooner, but which one runs
        longest is then anybody's guess, and the bound is the guess that never drafts for a
        request bound to finish first: at batch 16 on the class prompts (10 of 16 ended at
        EOS), sampled, n-gram ran 1.01x no drafts by it and 0.94x with every token valued alike
        (docs/benchmarks.md); where a long answer drafts well among short ones ended at EOS,
        its drafts wait for them (7 % slower than valuing tokens alike, still 1.14x none)."""
        if self.scheduler.waiting:
            return None
        running = self.scheduler.running
        slots = {p.request.request_id: p.num_draft_slots for p in speculating}
        steps = [r.remaining_tokens / self.adaptive.expected_tokens(r.request_id, slots.get(r.request_id, 0))
                 for r in running]
        share = {r.request_id: s for r, s in zip(running, finish_shares(steps))}
        return [share[p.request.request_id] for p in speculating]

    def _propose(
        self, scheduled: list[ScheduledRequest], sampling: list[ScheduledRequest],
    ) -> _Drafts:
        speculating = [p for p in sampling if p.num_draft_slots > 0]
        if not speculating or self.drafter is None:
            return _Drafts()
        counts = [p.num_draft_slots for p in speculating]
        if self.adaptive is not None:
            base_rows = sum(sum(p.num_new) for p in scheduled)
            counts = self.adaptive.allot(
                [DraftClaim(p.request.request_id, p.num_draft_slots,
                            fixed=p.request.batch_invariant or self.adaptive.probing(p.request.request_id),
                            rows_per_draft=len(p.request.seqs))
                 for p in speculating],
                base_rows=base_rows,
                base_tokens=len(sampling),
                padded_rows=self.model.padded_rows,
                # Beyond a row per sampled sequence, what the step feeds is prompt.
                prompt_rows=base_rows - sum(len(p.request.seqs) for p in sampling),
                shares=self._finish_shares(speculating),
            )
        drafting = [(p, k) for p, k in zip(speculating, counts) if k > 0]
        if not drafting:
            return _Drafts()
        speculating = [p for p, _ in drafting]
        requests = [
            DraftRequest(p.request.request_id, p.request.all_token_ids(), k,
                         p.request.params, p.request.seed, p.request.step,
                         num_prompt_tokens=len(p.request.prompt_token_ids),
                         batch_invariant=p.request.batch_invariant, grammar=p.request.grammar)
            for p, k in drafting
        ]
        start = time.perf_counter()
        if self.tree is None:
            batch = _grammar_cut(requests, self.drafter.propose(requests))
            # Only calls like those the gate prices teach the cost model: not a probe's (it also
            # catches up on what the drafter skipped at K = 0), and without a hybrid's lookup drafts.
            if self.costs is not None and not any(self.adaptive.probing(p.request.request_id) for p, _ in drafting):
                priced = [k for p, k in drafting if self.adaptive.priced(p.request.request_id)]
                if priced:
                    self.costs.observe_call(max(priced), len(priced), time.perf_counter() - start)
            drafts = {p.request.request_id: list(t) for p, t in zip(speculating, batch.token_ids) if t}
            return _Drafts(drafts, {}, batch.probs)
        trees = self.drafter.propose_tree(requests, self.tree)
        if self.costs is not None:  # priced as TreeGate prices a call
            gate = self.adaptive
            self.costs.observe_call(gate.depth, len(requests) * math.ceil(gate.nodes / gate.depth),
                                    time.perf_counter() - start)
        kept = [(p.request.request_id, t, a) for p, t, a in
                zip(speculating, trees.node_token_ids, trees.node_parents) if t]
        return _Drafts({r: list(t) for r, t, _ in kept}, {r: list(a) for r, _, a in kept},
                       trees.probs, trees.replacement)

    def _verify(
        self,
        sampling: list[ScheduledRequest],
        drafts: _Drafts,
        logits: torch.Tensor,  # [num_logits_rows, V]: per sampling request K + 1 rows per sequence
    ) -> list[_Verified]:
        """Per sampling request: its emitted tokens, its accepted drafts (tree nodes) and the
        tokens' log-probabilities when it asked for them (computed only then)."""
        if self.tree is None and all(plain_greedy(p.request.params) and p.request.grammar is None
                                     and p.request.params.logprobs is None for p in sampling):
            chains = greedy_chains(logits, [drafts.of(p.request.request_id) for p in sampling])
            return [_Verified(t, list(range(len(t) - 1)), None) for t in chains]
        target_rows: list[int] = []
        uncond_rows: list[int] = []
        row = 0
        for p in sampling:
            n = len(drafts.of(p.request.request_id)) + 1
            target_rows.extend(range(row, row + n))
            uncond_rows.extend(range(row + n, row + 2 * n) if p.request.uses_cfg else range(row, row + n))
            row += n * len(p.request.seqs)
        device = logits.device
        uncond = None
        if any(p.request.uses_cfg for p in sampling):
            uncond = logits.index_select(0, torch.tensor(uncond_rows, device=device))
        counts = [len(drafts.of(p.request.request_id)) for p in sampling]
        ids = [t for p in sampling for t in drafts.of(p.request.request_id)]
        metadata = SamplingMetadata.from_params(
            [p.request.params for p in sampling],
            steps=[p.request.step for p in sampling],
            seeds=[p.request.seed for p in sampling],
            device=device,
            prompt_token_ids=[p.request.prompt_token_ids for p in sampling],
            output_token_ids=[p.request.output_token_ids for p in sampling],
            buffers=self._metadata_buffers,
        )
        # Without CFG every logits row is a target row: no copy of [rows, V].
        target = logits if len(target_rows) == logits.shape[0] \
            else logits.index_select(0, torch.tensor(target_rows, device=device))
        if any(p.request.grammar is not None for p in sampling):
            target, uncond = _grammar_masked(sampling, drafts, target, uncond)
        draft_ids = torch.tensor(ids, dtype=torch.int64, device=device)
        cu = torch.tensor([0, *itertools.accumulate(counts)], device=device)
        draft = DraftProbs(drafts.probs) if drafts.probs is not None and ids else None
        if self.tree is None:
            out = rejection_sample(
                target, draft_ids, cu, metadata, draft=draft, uncond_logits=uncond,
                max_num_draft_tokens=max(counts), validate=False,
                verification=self.config.speculative.verification,
            )
            accepted = out.num_accepted.tolist()
            paths = [list(range(a)) for a in accepted]
        else:
            parents = [a for p in sampling for a in drafts.parents.get(p.request.request_id, [])]
            out = verify_tree(target, draft_ids, torch.tensor(parents, dtype=torch.int64, device=device),
                              cu, metadata, draft=draft, uncond_logits=uncond,
                              replacement=drafts.replacement, validate=False)
            accepted = out.num_accepted.tolist()
            paths = [nodes[:a] for nodes, a in zip(out.accepted_nodes.tolist(), accepted)]
        tokens = [row[: a + 1] for row, a in zip(out.token_ids.tolist(), accepted)]
        asked = [p.request.params.logprobs for p in sampling]
        records: list[list[TokenLogprob] | None] = [None] * len(sampling)
        if any(n is not None for n in asked):
            if self.tree is not None:
                # The emitted tokens' rows as a chain: each request's root row, then its path's.
                rows = torch.tensor([start + b + r for b, (start, path) in enumerate(zip(cu.tolist(), paths))
                                     for r in [0] + [j + 1 for j in path]], device=device)
                target, uncond = target[rows], None if uncond is None else uncond[rows]
                draft_ids = torch.tensor([t for row, a in zip(out.token_ids.tolist(), accepted) for t in row[:a]],
                                         dtype=torch.int64, device=device)
                cu = torch.tensor([0, *itertools.accumulate(accepted)], device=device)
            emitted = emitted_logprobs(target, draft_ids, cu, metadata, out, [n is not None for n in asked],
                                       max(n or 0 for n in asked), uncond,
                                       adjusted=out.adjusted if self.tree is None else None)
            records = token_logprobs(emitted, tokens, [n or 0 for n in asked])
        return [_Verified(t, path, r) for t, path, r in zip(tokens, paths, records)]

    def _append(self, request: Request, tokens: list[int],
                logprobs: list[TokenLogprob] | None = None, step: StepRecord | None = None) -> RequestOutput:
        """Adds emitted tokens (and their log-probabilities) one at a time, stopping at the
        first stop condition."""
        params = request.params
        decoder = self._decoders[request.request_id]
        new_ids: list[int] = []
        reason = None
        for i, token in enumerate(tokens):
            request.output_token_ids.append(token)
            new_ids.append(token)
            if request.logprobs is not None and logprobs is not None:
                request.logprobs.append(logprobs[i])
            before = len(request.text)
            request.text += decoder.push([token])
            if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
                reason = FinishReason.STOP
            if request.grammar is not None:
                request.grammar.advance(token)
                if request.grammar.stopped:  # complete, with no continuation but the end
                    reason = FinishReason.STOP
            cut = _earliest_stop(request.text, before, params.stop)
            if cut is not None:
                request.text = request.text[:cut]
                reason = FinishReason.STOP
            if reason is None and request.remaining_tokens <= 0:
                reason = FinishReason.LENGTH
            if reason is not None:
                break
        if reason is not None:
            self._finish(request, reason)
        # Text that may begin a stop string is held back until a later step decides it.
        visible = len(request.text) if request.finished else \
            len(request.text) - _stop_prefix_len(request.text, params.stop)
        new_text = request.text[request.streamed_chars : visible]
        request.streamed_chars = max(request.streamed_chars, visible)
        return self._output(request, new_ids, new_text, step)

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        self.scheduler.finish(request, reason, error)
        self._forget(request)

    def _release(self, request_id: str) -> Exception | None:
        """Drops the drafter's state of a request; returns what release raised (logged), so that
        a drafter's bookkeeping failing fails that request, not the step."""
        if self.drafter is None:
            return None
        try:
            self.drafter.release(request_id)
        except Exception as error:
            logger.warning("the drafter's release of %s raised", request_id, exc_info=error)
            return error
        return None

    def _forget(self, request: Request) -> None:
        self._release(request.request_id)  # the request is over either way
        if self.adaptive is not None:
            self.adaptive.release(request.request_id)
        self._requests.pop(request.request_id, None)
        self._decoders.pop(request.request_id, None)

    def _output(self, request: Request, new_ids: list[int], new_text: str = "",
                step: StepRecord | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            text=request.text[: request.streamed_chars],
            token_ids=list(request.output_token_ids),
            new_text=new_text,
            new_token_ids=new_ids,
            finished=request.finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            stats=request.stats,
            error=request.error,
            error_kind=request.error_kind,
            logprobs=None if request.logprobs is None else list(request.logprobs),
            new_logprobs=None if request.logprobs is None else request.logprobs[len(request.logprobs) - len(new_ids):],
            num_cached_tokens=request.num_cached_tokens,
            new_step=step,
        )


def _static_shapes(config: EngineConfig, model: LlamaModel) -> tuple[StaticShapes | None, bool]:
    """The target runner's padded-step shapes (None: the ordinary step) and whether it replays
    them as CUDA graphs (EngineConfig.static_step, enforce_eager)."""
    cuda = model.device.type == "cuda"
    if not (cuda if config.static_step is None else config.static_step):
        return None, False
    spec = config.speculative
    # A step feeds the pending token and its drafts (tree nodes).
    rows = spec.num_draft_tokens + 1 if spec.enabled else 1
    # A CFG request feeds two sequences.
    shapes = StaticShapes.covering(2 * config.max_num_seqs, rows, config.max_model_len + rows,
                                   config.cache.block_size, trees=spec.enabled and spec.tree is not None)
    return shapes, cuda and not config.enforce_eager


def _grammar_cut(requests: list[DraftRequest], batch: DraftBatch) -> DraftBatch:
    """Proposals cut before the first token the request's grammar forbids (a sure rejection
    costs a verify row), with their q rows."""
    keep = [t[: r.grammar.valid_prefix(t)] if r.grammar is not None else t
            for r, t in zip(requests, batch.token_ids)]
    if keep == batch.token_ids:
        return batch
    probs = batch.probs
    if probs is not None:
        rows, start = [], 0
        for t, kept in zip(batch.token_ids, keep):
            rows.extend(range(start, start + len(kept)))
            start += len(t)
        probs = probs[torch.tensor(rows, dtype=torch.int64, device=probs.device)]
    return DraftBatch(keep, probs)


def _grammar_masked(
    sampling: list[ScheduledRequest],
    drafts: _Drafts,
    target: torch.Tensor,  # [R, V]: per sampling request its K + 1 (tree: nodes + 1) rows
    uncond: torch.Tensor | None,  # [R, V] or None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Target (and unconditional) rows masked by each request's grammar, each row with its own
    history: the output plus the drafts before it (a tree node: its path), as penalties count it."""
    mask = np.ones(tuple(target.shape), dtype=np.bool_)
    row = 0
    for p in sampling:
        rid = p.request.request_id
        tokens = drafts.of(rid)
        if p.request.grammar is not None:
            prefixes = tree_prefixes(tokens, drafts.parents[rid]) if rid in drafts.parents else chain_prefixes(tokens)
            mask[row : row + len(prefixes)] = p.request.grammar.masks(prefixes).numpy()
        row += len(tokens) + 1
    allowed = torch.from_numpy(mask)
    return apply_token_mask(target, allowed), None if uncond is None else apply_token_mask(uncond, allowed)


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that a later token could extend into a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def _earliest_stop(text: str, before: int, stops: tuple[str, ...]) -> int | None:
    """Where the earliest stop string completed by the text after `before` begins, if any."""
    found = [at for stop in stops if (at := text.find(stop, max(0, before - len(stop) + 1))) >= 0]
    return min(found, default=None)
