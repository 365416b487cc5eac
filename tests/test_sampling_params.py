"""SamplingParams validation: every bad argument is named with its value and what was
expected; temperatures outside float32's useful range are made greedy or refused."""

from __future__ import annotations

import dataclasses

import pytest

from verispec import SamplingParams
from verispec.sampling_params import MAX_TEMPERATURE


@pytest.mark.parametrize("kwargs,expected", [
    ({"stop": 123}, "stop=123 is invalid: expected a non-empty string or a list of them"),
    ({"stop": {"a": 1}}, r"stop=\{'a': 1\} is invalid"),
    ({"stop": ""}, "stop='' is invalid"),
    ({"stop": ["ok", 5]}, r"stop=\['ok', 5\] is invalid"),
    ({"stop_token_ids": 5}, r"stop_token_ids=5 is invalid: expected a list of token ids \(integers >= 0\)"),
    ({"stop_token_ids": [True]}, r"stop_token_ids=\[True\] is invalid"),
    ({"stop_token_ids": {3: 4}}, r"stop_token_ids=\{3: 4\} is invalid"),
    ({"negative_prompt": [True]}, r"negative_prompt=\[True\] is invalid"),
    ({"ignore_eos": "no"}, "ignore_eos='no' is invalid: expected a bool"),
    ({"temperature": 1e39}, r"temperature=1e\+39 is invalid: expected a number in \[0, 3.402823e\+38\]"),
    ({"temperature": float("inf")}, "temperature=inf is invalid"),
    ({"temperature": float("nan")}, "temperature=nan is invalid"),
    ({"temperature": -1e-50}, "temperature=-1e-50 is invalid"),
])
def test_bad_argument_is_named(kwargs, expected) -> None:
    with pytest.raises(ValueError, match=expected):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature", [1e-40, 1e-50, 5e-6, 9.99e-6])
def test_temperatures_below_the_greedy_threshold_are_greedy(temperature) -> None:
    params = SamplingParams(temperature=temperature)
    assert params.greedy and params.temperature == 0


def test_temperatures_in_range_are_kept() -> None:
    assert not SamplingParams(temperature=1e-5).greedy
    assert SamplingParams(temperature=MAX_TEMPERATURE).temperature == MAX_TEMPERATURE


def test_good_arguments_are_normalised_and_frozen() -> None:
    params = SamplingParams(stop="END", stop_token_ids=[3, 4], negative_prompt=[1, 2], ignore_eos=True)
    assert params.stop == ("END",) and params.stop_token_ids == (3, 4) and params.negative_prompt == (1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5
