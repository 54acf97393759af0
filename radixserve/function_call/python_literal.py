"""Python literal text -> a JSON-able value, through `ast` and never eval.

Accepted: str / int / float / bool / None constants, negative numbers, lists, tuples (as lists) and
dicts with string keys, nested; also the JSON spellings true / false / null, which models trained on
JSON write inside Python calls. Anything else (names, calls, operators, f-strings) raises ValueError.
"""

from __future__ import annotations

import ast
import math
from typing import Any

_JSON_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}
MAX_DEPTH = 64  # nesting a value may have (a deeply nested literal must not exhaust the stack)


def literal_value(node: ast.AST, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError("literal nested too deeply")
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("non-finite number")
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = literal_value(node.operand, depth + 1)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError("sign on a non-number")  # noqa: TRY004  # callers catch ValueError: "not a literal"
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal_value(e, depth + 1) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values, strict=True):
            if k is None:
                raise ValueError("** in a dict literal")
            key = literal_value(k, depth + 1)
            if not isinstance(key, str):
                raise ValueError("dict keys must be strings")  # noqa: TRY004  # as above
            out[key] = literal_value(v, depth + 1)
        return out
    raise ValueError(f"not a literal: {type(node).__name__}")


def parse_literal(text: str) -> Any:
    """One literal expression's text -> its value (ValueError if it is not one)."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise ValueError(f"not a Python literal: {e}") from None
    return literal_value(tree.body)
