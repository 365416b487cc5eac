"""Config dataclasses: DraftCost and its place in SpeculativeConfig; EngineConfig's step options."""

from __future__ import annotations

import pytest

from verispec import DraftCost, SpeculativeConfig
from verispec.config import EngineConfig


def test_draft_cost_adds_its_terms() -> None:
    cost = DraftCost(per_call=0.5, per_request=0.1, per_position=0.2, per_row=0.01)
    assert cost(4, 3) == pytest.approx(0.5 + 0.3 + 4 * (0.2 + 0.03))
    assert cost(0, 3) == cost(4, 0) == DraftCost()(4, 3) == 0


@pytest.mark.parametrize("field", ["per_call", "per_request", "per_position", "per_row"])
@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf"), "0.1", True])
def test_bad_draft_costs_are_named(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        DraftCost(**{field: value})


def test_speculative_config_takes_a_draft_cost_or_none() -> None:
    assert SpeculativeConfig().draft_cost is None
    assert SpeculativeConfig(draft_cost=DraftCost(per_call=1)).draft_cost(1, 1) == 1
    with pytest.raises(TypeError, match="draft_cost=0.5 is a float: expected a DraftCost"):
        SpeculativeConfig(draft_cost=0.5)


@pytest.mark.parametrize("field,value", [("static_step", 1), ("static_step", "yes"), ("enforce_eager", None),
                                         ("enforce_eager", 0)])
def test_step_options_are_booleans(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{field}={value!r} is invalid"):
        EngineConfig(**{field: value})
