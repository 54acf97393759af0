"""json_bounds.check_json_shape: what counts as nesting and where a number is too long (no server)."""

from __future__ import annotations

import json

import pytest

from radixserve.entrypoints.json_bounds import (
    MAX_JSON_DEPTH,
    MAX_NUMBER_DIGITS,
    JSONShapeError,
    check_json_shape,
)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("text", [
    "", "{}", json.dumps({"prompt": "[" * 10_000}),  # brackets inside a string are text
    json.dumps({"a": 'he said "[[[[' * 100, "b": [1, 2]}),  # escaped quotes do not end the string
    json.dumps({"x": "1" * 5000}),  # digits inside a string are text
    json.dumps({"x": [[0] * 100] * 100}),  # many brackets, shallow
    "[" + _nested(MAX_JSON_DEPTH - 1) + "]",  # exactly at the bound
    json.dumps({"seed": int("9" * MAX_NUMBER_DIGITS)}),
])
def test_accepted(text: str) -> None:
    check_json_shape(text)


@pytest.mark.parametrize(("text", "field"), [
    ('{"a": "x", "prompt": ' + _nested(MAX_JSON_DEPTH) + "}", "prompt"),  # the root object is a level
    ('{"a": "[[[\\"", "b": {"c": ' + _nested(MAX_JSON_DEPTH) + "}}", "b"),
    (_nested(MAX_JSON_DEPTH + 1), None),  # no top-level object: no field to name
    ('{"seed": 1' + "0" * MAX_NUMBER_DIGITS + "}", "seed"),
    ('{"p": "x", "input_ids": [1, -1' + "0" * MAX_NUMBER_DIGITS + "]}", "input_ids"),
    ('{"x": ' + _nested(100_000) + "}", "x"),
])
def test_refused_naming_the_field(text: str, field: str | None) -> None:
    with pytest.raises(JSONShapeError) as err:
        check_json_shape(text)
    assert err.value.field == field
    assert str(err.value).startswith(field or "the request body"), str(err.value)
