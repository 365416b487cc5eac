"""Per-request sampling parameters, validated on construction.

The sampling pipeline they drive is, in this order (identical for draft and target):
CFG combine -> temperature -> top-k -> top-p -> min-p. ``temperature == 0`` means greedy, and so
does any temperature below GREEDY_TEMPERATURE (see SamplingParams).

Filter semantics (chosen so that a threshold search on a GPU gives the same set as a sort):
- top-k keeps every token whose logit is >= the k-th largest logit (ties at the boundary stay);
- top-p keeps every token whose probability is >= t*, the largest threshold whose kept mass is
  still >= top_p (the smallest "nucleus"; ties at the boundary stay);
- min-p keeps every token with probability >= min_p * (largest probability).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Temperatures below this sample as greedy (vLLM's _SAMPLING_EPS): dividing float32 logits by
# them overflows to inf, or the temperature itself underflows to 0 in float32 (1e-40, 1e-50).
GREEDY_TEMPERATURE = 1e-5
# float32's largest finite value: a larger temperature becomes inf on the device.
MAX_TEMPERATURE = 3.4028234663852886e38


def _check_number(name: str, value: object, expected: str, ok: bool) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: expected {expected}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_ids(value: object) -> bool:
    return isinstance(value, (list, tuple)) and all(_is_int(i) and i >= 0 for i in value)


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
    max_tokens: the most tokens to generate.
    stop: a string or a list of strings that end generation (not included in the output text).
    stop_token_ids: a list of token ids that end generation (in addition to EOS unless
        ignore_eos).
    ignore_eos: keep generating past the end-of-sequence token.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    guidance_scale: float = 1.0
    negative_prompt: str | list[int] | None = None
    max_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

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
            n is None or isinstance(n, str) or (_is_token_ids(n) and len(n) > 0),
        )
        mt = self.max_tokens
        _check_number(
            "max_tokens", mt, "an integer >= 1",
            isinstance(mt, int) and not isinstance(mt, bool) and mt >= 1,
        )
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        _check_number(
            "stop", self.stop, "a non-empty string or a list of them",
            isinstance(stop, (list, tuple)) and all(isinstance(x, str) and x for x in stop),
        )
        object.__setattr__(self, "stop", tuple(stop))
        _check_number(
            "stop_token_ids", self.stop_token_ids, "a list of token ids (integers >= 0)",
            _is_token_ids(self.stop_token_ids),
        )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_number("ignore_eos", self.ignore_eos, "a bool", isinstance(self.ignore_eos, bool))
        if isinstance(n, list):
            object.__setattr__(self, "negative_prompt", tuple(n))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_cfg(self) -> bool:
        return self.guidance_scale != 1
