"""StepRecord.origins and ends_in_bonus: which emitted token came from where."""

from __future__ import annotations

import pytest

from verispec.spec_decode.trace import StepRecord, TokenOrigin, ends_in_bonus

A, R, B, P = TokenOrigin.ACCEPTED, TokenOrigin.RECOVERED, TokenOrigin.BONUS, TokenOrigin.PLAIN


def test_a_rejection_ends_in_the_recovered_token() -> None:
    assert StepRecord(3, num_draft=4, num_accepted=2, bonus=False).origins(3) == [A, A, R]


def test_every_draft_accepted_ends_in_the_bonus_token() -> None:
    assert StepRecord(1, num_draft=3, num_accepted=3, bonus=True).origins(4) == [A, A, A, B]


def test_a_step_without_drafts_emits_a_plain_token() -> None:
    assert StepRecord(1, num_draft=0, num_accepted=0, bonus=True).origins(1) == [P]


def test_a_stop_keeps_the_first_tokens_origins() -> None:
    assert StepRecord(2, num_draft=3, num_accepted=3, bonus=True).origins(2) == [A, A]


@pytest.mark.parametrize("n", [-1, 4])
def test_more_tokens_than_the_step_emitted_are_refused(n: int) -> None:
    with pytest.raises(ValueError, match=f"num_tokens={n} is invalid"):
        StepRecord(1, num_draft=3, num_accepted=2, bonus=False).origins(n)


def test_a_chain_ends_in_a_bonus_only_when_every_draft_was_accepted() -> None:
    assert ends_in_bonus(3, None, [0, 1, 2])
    assert not ends_in_bonus(3, None, [0, 1])
    assert ends_in_bonus(0, None, [])


def test_a_tree_ends_in_a_bonus_when_the_path_ends_at_a_leaf() -> None:
    parents = [-1, -1, 0, 0, 2]  # root -> 0, 1; 0 -> 2, 3; 2 -> 4
    assert ends_in_bonus(5, parents, [0, 2, 4])  # 4 is a leaf
    assert ends_in_bonus(5, parents, [1])  # so is 1
    assert not ends_in_bonus(5, parents, [0])  # 2 and 3 were rejected
    assert not ends_in_bonus(5, parents, [])  # 0 and 1 were rejected
