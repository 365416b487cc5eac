"""Where each emitted token came from: the per-step record a request's output carries.

A verify step emits its accepted drafts, then one token the verifier drew itself: the
*recovered* token (drawn from the residual at a rejection) or the *bonus* token (drawn from the
target's row after the last draft, when no draft on the way there was rejected). A step that
drafted nothing emits one *plain* token, sampled from the target as without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class TokenOrigin(str, Enum):
    ACCEPTED = "accepted"  # a draft the verifier accepted
    RECOVERED = "recovered"  # drawn by the verifier at the first rejected draft
    BONUS = "bonus"  # drawn by the verifier after every draft on its path was accepted
    PLAIN = "plain"  # the step drafted nothing: sampled from the target alone


@dataclass(frozen=True)
class StepRecord:
    """One verify step of one request.

    step: the request's step number, from 1 (steps that only fed a prefill chunk are not counted).
    num_draft: draft tokens (tree nodes) verified.
    num_accepted: drafts accepted; the step emitted num_accepted + 1 tokens (fewer when a stop
        condition cut it short).
    bonus: whether the last token was drawn after an accepted path with nothing left to verify
        (a chain: every draft accepted; a tree: the path's last node has no children).
    """

    step: int
    num_draft: int
    num_accepted: int
    bonus: bool

    def origins(self, num_tokens: int) -> list[TokenOrigin]:
        """The origins of the first `num_tokens` tokens the step emitted, in order."""
        if not 0 <= num_tokens <= self.num_accepted + 1:
            raise ValueError(f"num_tokens={num_tokens} is invalid: the step emitted at most "
                             f"{self.num_accepted + 1} tokens")
        if self.num_draft == 0:
            last = TokenOrigin.PLAIN
        else:
            last = TokenOrigin.BONUS if self.bonus else TokenOrigin.RECOVERED
        return ([TokenOrigin.ACCEPTED] * self.num_accepted + [last])[:num_tokens]


def ends_in_bonus(num_draft: int, parents: list[int] | None, path: list[int]) -> bool:
    """Whether the token after the accepted `path` is a bonus token: no draft follows the path's
    last node (parents: a tree's node parents, -1 for the root's children; None for a chain)."""
    if parents is None:
        return len(path) == num_draft
    last = path[-1] if path else -1
    return last not in parents
