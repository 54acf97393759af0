"""SamplingParams: normalisation, validation messages, from_dict / to_dict."""

from __future__ import annotations

import math
from typing import Any

import pytest

from radixserve.sampling.sampling_params import SamplingParams

VOCAB = 100

# (field, bad value, extra fields needed to isolate the rule)
INVALID: list[tuple[str, Any, dict[str, Any]]] = [
    ("max_new_tokens", -1, {}),
    ("max_new_tokens", 1.5, {}),
    ("max_new_tokens", True, {}),
    ("max_new_tokens", "5", {}),
    ("min_new_tokens", -1, {}),
    ("min_new_tokens", 11, {"max_new_tokens": 10}),
    ("min_new_tokens", 2.0, {}),
    ("temperature", -0.1, {}),
    ("temperature", math.nan, {}),
    ("temperature", math.inf, {}),
    ("temperature", "1", {}),
    ("temperature", 10**400, {}),  # an int past float's range (a JSON number of 401 digits)
    ("top_p", 0.0, {}),
    ("top_p", -0.5, {}),
    ("top_p", 1.01, {}),
    ("top_k", 0, {}),
    ("top_k", -2, {}),
    ("top_k", 2.5, {}),
    ("min_p", -0.01, {}),
    ("min_p", 1.01, {}),
    ("frequency_penalty", 2.01, {}),
    ("frequency_penalty", -2.01, {}),
    ("presence_penalty", 2.5, {}),
    ("presence_penalty", -3, {}),
    ("repetition_penalty", 0.0, {}),
    ("repetition_penalty", -1.0, {}),
    ("logit_bias", {VOCAB: 1.0}, {}),
    ("logit_bias", {-1: 1.0}, {}),
    ("logit_bias", {5: 100.5}, {}),
    ("logit_bias", {5: -101}, {}),
    ("logit_bias", {5: "big"}, {}),
    ("logit_bias", {5: 10**400}, {}),
    ("logit_bias", [1, 2], {}),
    ("stop_token_ids", [VOCAB], {}),
    ("stop_token_ids", [-1], {}),
    ("stop_token_ids", ["a"], {}),
    ("stop", [1], {}),
    ("n", 0, {}),
    ("n", 1.0, {}),
    ("seed", 1.5, {}),
    ("seed", "7", {}),
    ("seed", True, {}),
    ("ignore_eos", "yes", {}),
    ("skip_special_tokens", 1, {}),
    ("spaces_between_special_tokens", False, {}),  # refused, not ignored: the fast tokenizer decides
    ("no_stop_trim", None, {}),
]


@pytest.mark.parametrize(("name", "value", "extra"), INVALID)
def test_invalid_value_names_field(name: str, value: Any, extra: dict[str, Any]) -> None:
    params = SamplingParams(**extra)
    setattr(params, name, value)  # bypass normalise so the raw bad value reaches verify()
    with pytest.raises(ValueError) as err:
        params.verify(VOCAB)
    assert str(err.value).startswith(name), str(err.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.0},
        {"temperature": 2},  # ints are fine where floats are expected
        {"top_p": 1.0, "top_k": 1, "min_p": 1.0},
        {"top_p": 1e-6, "top_k": VOCAB * 10, "min_p": 0.0},
        {"frequency_penalty": -2.0, "presence_penalty": 2.0},
        {"repetition_penalty": 1e-3},
        {"max_new_tokens": 0, "min_new_tokens": 0},
        {"max_new_tokens": 5, "min_new_tokens": 5},
        {"logit_bias": {0: -100, VOCAB - 1: 100.0}},
        {"stop_token_ids": [0, VOCAB - 1], "stop": ["\n", "END"]},
        {"seed": -(2**70)},
        {"n": 4, "ignore_eos": True},
    ],
)
def test_valid_values_pass(kwargs: dict[str, Any]) -> None:
    SamplingParams(**kwargs).verify(VOCAB)


def test_from_dict_none_and_defaults() -> None:
    assert SamplingParams.from_dict(None) == SamplingParams()
    assert SamplingParams.from_dict({}) == SamplingParams()
    # explicit JSON nulls mean "use the default"
    assert SamplingParams.from_dict({"temperature": None, "stop": None}) == SamplingParams()


def test_from_dict_rejects_unknown_keys_naming_them() -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict({"temperature": 0.5, "bogus": 1, "top_q": 0.9})
    assert "bogus" in str(err.value) and "top_q" in str(err.value)
    assert "temperature" not in str(err.value)


def test_from_dict_converts_str_logit_bias_keys() -> None:
    p = SamplingParams.from_dict({"logit_bias": {"5": 2.0, "17": -1, 3: 0.5}})
    assert p.logit_bias == {5: 2.0, 17: -1, 3: 0.5}
    assert all(type(k) is int for k in p.logit_bias)
    p.verify(VOCAB)
    with pytest.raises(ValueError, match="^logit_bias"):
        SamplingParams.from_dict({"logit_bias": {"hello": 1.0}})


def test_stop_accepts_str_or_list() -> None:
    assert SamplingParams.from_dict({"stop": "###"}).stop == ["###"]
    assert SamplingParams.from_dict({"stop": ["a", "b"]}).stop == ["a", "b"]
    assert SamplingParams(stop=("a", "")).stop == ["a"]  # empty stop strings are dropped
    assert SamplingParams.from_dict({"stop_token_ids": 7}).stop_token_ids == [7]


def test_to_dict_round_trip() -> None:
    p = SamplingParams(
        max_new_tokens=9,
        temperature=0.3,
        top_k=5,
        stop=["x"],
        stop_token_ids=[3],
        logit_bias={4: 1.5},
        seed=11,
        n=2,
    )
    d = p.to_dict()
    assert d["logit_bias"] == {4: 1.5} and d["stop"] == ["x"]
    assert SamplingParams.from_dict(d) == p
    d["stop"].append("y")  # a copy, not a view of p
    assert p.stop == ["x"]


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy
    assert not SamplingParams(temperature=1e-3, top_k=2).is_greedy
