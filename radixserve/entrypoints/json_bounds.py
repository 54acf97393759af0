"""Bounds on a request body's JSON shape, checked before anything recursive reads it.

json.loads and pydantic recurse once per nested array / object: a body nested 100,000 levels deep
(`{"prompt": [[[[...]]]]}`) would end in a RecursionError, a 500. Python's int() refuses more than
4,300 digits with a message about sys.set_int_max_str_digits, which is the server's business, not the
client's. So parse_body (openai_serving.py), which every route that reads a body goes through, first
calls check_json_shape on the text: a body nesting deeper than MAX_JSON_DEPTH, or holding a number
longer than MAX_NUMBER_DIGITS, is a 400 naming the top-level field it sits in.

The common body is cleared by two C-speed scans (it has too few brackets to nest that deep, and no
long digit run at all); only the others are walked token by token. The walk reads strings exactly as
JSON does (escapes included), so a bracket inside a string never counts; on an invalid body it and
json.loads agree up to the first error, so json.loads never sees more nesting than the walk did.
"""

from __future__ import annotations

import json
import re

MAX_JSON_DEPTH = 64  # a tool's JSON schema nested 25 objects deep is still ~55 levels from the root
MAX_NUMBER_DIGITS = 1000  # 10**300 still reaches the field's own range check, which names the bound

_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*"'
_LONG_NUMBER = f"[0-9]{{{MAX_NUMBER_DIGITS + 1}}}"
_TOKEN = re.compile(f"{_STRING}|[\\[\\]{{}}]|{_LONG_NUMBER}", re.DOTALL)
_LONG_DIGITS = re.compile(_LONG_NUMBER)


class JSONShapeError(ValueError):
    """The body is JSON too deep or with too long a number to decode; `field` is its top-level key."""

    def __init__(self, message: str, field: str | None) -> None:
        super().__init__(message)
        self.field = field


def check_json_shape(text: str) -> None:
    """Raise JSONShapeError if `text` nests deeper than MAX_JSON_DEPTH or has an over-long number."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH and _LONG_DIGITS.search(text) is None:
        return
    depth, top_is_object, key = 0, False, None
    for m in _TOKEN.finditer(text):
        tok = m.group()
        head = tok[0]
        if head == '"':
            if depth == 1 and top_is_object:
                key = tok  # at the top level of an object the last string before a value is its key
        elif head in "[{":
            depth += 1
            top_is_object = top_is_object or (depth == 1 and head == "{")
            if depth > MAX_JSON_DEPTH:
                raise _error(key, f"nested deeper than {MAX_JSON_DEPTH} levels of arrays / objects")
        elif head in "]}":
            depth -= 1
        else:
            raise _error(key, f"a number with more than {MAX_NUMBER_DIGITS} digits")


def _error(key: str | None, what: str) -> JSONShapeError:
    field = _field_name(key) if key is not None else None
    where = field if field is not None else "the request body"
    return JSONShapeError(f"{where}: {what}", field)


def _field_name(key: str) -> str | None:
    try:
        name = json.loads(key)
    except ValueError:
        return None
    return name if isinstance(name, str) and 0 < len(name) <= 64 else None
