"""Per-request sampling parameters, validated on construction.

The sampling pipeline they drive is, in this order (identical for draft and target):
CFG combine -> repetition penalty -> frequency / presence penalties -> logit bias ->
allowed / banned tokens -> temperature -> top-k -> top-p -> min-p. ``temperature == 0`` (or any
temperature below GREEDY_TEMPERATURE) means greedy: the stages up to the allowed / banned mask
still apply (they move the argmax), the rest do not.

History-based penalties (semantics of OpenAI and vLLM / Hugging Face):
- a request's *history* at a position is its output so far, followed, under speculation, by the
  draft tokens before that position: each verified position is penalised exactly as if the
  tokens before it had been sampled one at a time;
- repetition_penalty: every token in the prompt or the history has its logit divided by the
  penalty when positive, multiplied by it otherwise;
- frequency_penalty and presence_penalty: logit -= frequency_penalty * count +
  presence_penalty * (count > 0), count = occurrences in the history (the prompt not included).

Filter semantics (chosen so that a threshold search on a GPU gives the same set as a sort):
- top-k keeps every token whose logit is >= the k-th largest logit (ties at the boundary stay);
- top-p keeps every token whose probability is >= t*, the largest threshold whose kept mass is
  still >= top_p (the smallest "nucleus"; ties at the boundary stay);
- min-p keeps every token with probability >= min_p * (largest probability).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .structured.spec import GrammarSpec

# Temperatures below this sample as greedy (vLLM's _SAMPLING_EPS): dividing float32 logits by
# them overflows to inf, or the temperature itself underflows to 0 in float32 (1e-40, 1e-50).
GREEDY_TEMPERATURE = 1e-5
MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs
# float32's largest finite value: a larger temperature becomes inf on the device.
MAX_TEMPERATURE = 3.4028234663852886e38
STRUCTURED_FIELDS = ("json_schema", "json_object", "regex", "grammar")


def _check_number(name: str, value: object, expected: str, ok: bool) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: expected {expected}")


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_token_id(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_id_list(v: object) -> bool:
    return isinstance(v, (list, tuple)) and all(_is_token_id(t) for t in v)


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens, and when it stops.

    temperature: 0 for greedy, otherwise > 0 (the logits are divided by it), at most float32's
        largest value. Below GREEDY_TEMPERATURE (1e-5) sampling is greedy, as in vLLM: such
        temperatures are stored as 0, since in float32 they overflow the logits or underflow.
    top_k: keep the k most likely tokens; None (or 0 / -1, as in other libraries) disables it.
    top_p: nucleus mass in (0, 1]; 1 disables it.
    min_p: in [0, 1]; 0 disables it.
    seed: makes the request's random numbers a pure function of (seed, step, position), so its
        tokens do not depend on what else is in the batch. None draws a fresh seed.
    guidance_scale: classifier-free guidance scale gamma; 1 disables it.
    negative_prompt: text or token ids for the unconditional branch of CFG (None: the prompt's
        last token).
    max_tokens: the most tokens to generate; None: as many as the context has room for. More
        than the context holds beside the prompt is a ValueError when the request is added.
    stop: a string or a list of strings that end generation (not included in the output text).
    stop_token_ids: a list of token ids that end generation (in addition to EOS unless
        ignore_eos).
    ignore_eos: keep generating past the end-of-sequence token.
    presence_penalty: in [-2, 2]; subtracted from the logit of every token in the history.
    frequency_penalty: in [-2, 2]; times each token's count in the history, subtracted.
    repetition_penalty: > 0, 1 disables it; divides positive (multiplies other) logits of tokens
        in the prompt or the history.
    logit_bias: token id -> bias in [-100, 100], added to that token's logit (kept read-only).
    allowed_token_ids: when given, only these tokens may be emitted (non-empty).
    banned_token_ids: tokens never emitted; at least one allowed token must remain.
    logprobs: None (off), or n in [0, 20]: report each emitted token's log-probability under
        the processed target distribution (at temperature 1 for greedy requests) and its row's
        n likeliest alternatives (RequestOutput.logprobs); costs nothing when off.
    json_schema: a JSON Schema (dict or JSON text) the output must match.
    json_object: True: the output is a JSON object.
    regex: a regular expression the whole output must match (llguidance's automata).
    grammar: a Lark grammar, or a GBNF one as llama.cpp writes it, the output must match.
        At most one of json_schema / json_object / regex / grammar; the grammar's mask is the
        pipeline's stage after allowed / banned tokens (structured/matcher.py), and the request
        stops once the grammar is complete. Each is checked here by the grammar engine
        (llguidance), whose message a ValueError carries; the engine applies its size, depth and
        compile-time limits (StructuredOutputConfig) when the request is added, and there, with
        the tokenizer, refuses (ValueError from LLM.generate / chat) a grammar with an empty
        language or whose first token masks exhaust llguidance's budgets.
    Token ids in logit_bias / allowed / banned must be below the vocabulary size, which the
    engine checks with check_vocab when the request is added.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    guidance_scale: float = 1.0
    negative_prompt: str | list[int] | None = None
    max_tokens: int | None = 128
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    banned_token_ids: tuple[int, ...] = field(default_factory=tuple)
    logprobs: int | None = None
    json_schema: Mapping[str, object] | bool | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    # The structured-output field as the grammar engine's grammar (None without one).
    grammar_spec: GrammarSpec | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        t = self.temperature
        _check_number(
            "temperature", t, f"a number in [0, {MAX_TEMPERATURE:.7g}] (float32's largest; 0 means greedy)",
            isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t <= MAX_TEMPERATURE,
        )
        if t < GREEDY_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        k = self.top_k
        _check_number(
            "top_k", k, "None, 0 or -1 (disabled), or an integer >= 1",
            k is None or (isinstance(k, int) and not isinstance(k, bool) and k >= -1),
        )
        if k is not None and k <= 0:
            object.__setattr__(self, "top_k", None)
        p = self.top_p
        _check_number(
            "top_p", p, "a number in (0, 1]",
            isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p <= 1,
        )
        m = self.min_p
        _check_number(
            "min_p", m, "a number in [0, 1]",
            isinstance(m, (int, float)) and not isinstance(m, bool) and 0 <= m <= 1,
        )
        s = self.seed
        _check_number(
            "seed", s, "None or an integer in [0, 2**63)",
            s is None or (isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**63),
        )
        g = self.guidance_scale
        _check_number(
            "guidance_scale", g, "a finite number (1 disables guidance)",
            isinstance(g, (int, float)) and not isinstance(g, bool) and math.isfinite(g),
        )
        n = self.negative_prompt
        _check_number(
            "negative_prompt", n, "None, a string, or a non-empty list of token ids >= 0",
            n is None or isinstance(n, str) or (_is_id_list(n) and len(n) > 0),
        )
        mt = self.max_tokens
        _check_number(
            "max_tokens", mt, "None or an integer >= 1",
            mt is None or (isinstance(mt, int) and not isinstance(mt, bool) and mt >= 1),
        )
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        _check_number(
            "stop", self.stop, "a non-empty string or a list of them",
            isinstance(stop, (list, tuple)) and all(isinstance(x, str) and x for x in stop),
        )
        object.__setattr__(self, "stop", tuple(stop))
        _check_number(
            "stop_token_ids", self.stop_token_ids, "a list of token ids (integers >= 0)",
            _is_id_list(self.stop_token_ids),
        )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_number("ignore_eos", self.ignore_eos, "a bool", isinstance(self.ignore_eos, bool))
        if isinstance(n, list):
            object.__setattr__(self, "negative_prompt", tuple(n))
        lp = self.logprobs
        _check_number(
            "logprobs", lp, f"None or an integer in [0, {MAX_TOP_LOGPROBS}] (the alternatives per token)",
            lp is None or (_is_token_id(lp) and lp <= MAX_TOP_LOGPROBS),
        )
        self._check_adjustments()
        self._check_structured()

    def _check_structured(self) -> None:
        _check_number("json_object", self.json_object, "a bool", isinstance(self.json_object, bool))
        given = [k for k in STRUCTURED_FIELDS if getattr(self, k) not in (None, False)]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} are both set: expected at most one of "
                             f"{', '.join(STRUCTURED_FIELDS)}")
        if given:
            from .structured.spec import GrammarSpec

            object.__setattr__(self, "grammar_spec", GrammarSpec.from_field(given[0], getattr(self, given[0])))

    def _check_adjustments(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check_number(name, v, "a number in [-2, 2] (0 disables it)", _is_number(v) and -2 <= v <= 2)
        r = self.repetition_penalty
        _check_number(
            "repetition_penalty", r, "a finite number > 0 (1 disables it)",
            _is_number(r) and math.isfinite(r) and r > 0,
        )
        bias = self.logit_bias
        _check_number(
            "logit_bias", bias,
            "None or a mapping of token ids (integers >= 0) to finite biases in [-100, 100]",
            bias is None or (isinstance(bias, Mapping)
                             and all(_is_token_id(t) and _is_number(b) and -100 <= b <= 100
                                     for t, b in bias.items())),
        )
        if bias is not None:
            object.__setattr__(self, "logit_bias", MappingProxyType({t: float(b) for t, b in bias.items()}))
        allowed = self.allowed_token_ids
        _check_number(
            "allowed_token_ids", allowed, "None or a non-empty list of token ids (integers >= 0)",
            allowed is None or (_is_id_list(allowed) and len(allowed) > 0),
        )
        banned = self.banned_token_ids
        _check_number(
            "banned_token_ids", banned, "a list of token ids (integers >= 0)", _is_id_list(banned),
        )
        object.__setattr__(self, "banned_token_ids", tuple(banned))
        if allowed is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(allowed))
            if not set(allowed) - set(banned):
                raise ValueError(
                    f"allowed_token_ids={allowed!r} with banned_token_ids={banned!r} is invalid: "
                    "expected at least one allowed token that is not banned"
                )

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError unless every token id in logit_bias / allowed / banned is < vocab_size."""
        for name, ids in (
            ("logit_bias", tuple(self.logit_bias or ())),
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("banned_token_ids", self.banned_token_ids),
        ):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(
                    f"{name} contains token id {bad[0]}: expected ids in [0, {vocab_size}), the vocabulary"
                )

    @property
    def uses_penalties(self) -> bool:
        """Whether the request's history changes its logits."""
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether any stage between CFG and temperature (penalties, bias, masks) is on."""
        return (self.uses_penalties or bool(self.logit_bias)
                or self.allowed_token_ids is not None or bool(self.banned_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_cfg(self) -> bool:
        return self.guidance_scale != 1
