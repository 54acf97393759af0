"""Twenty JSON schemas of the shapes real clients send: nested objects, arrays with min / max items,
enums, numbers with ranges, required and optional fields, $refs. Shared by `radixserve bench grammar`
(compile times, masking cost) and the structured-output tests (every output must validate).

Strings carry maxLength and numbers ranges, as production schemas usually do: a 135M model left
free inside a string can repeat a word until max_tokens, and a cut-off JSON value cannot validate.
"""

from __future__ import annotations

from typing import Any

_name = {"type": "string", "minLength": 1, "maxLength": 24}
_short = {"type": "string", "maxLength": 16}

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": _name, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": _name, "country": _name, "population": {"type": "integer",
     "minimum": 0, "maximum": 100000000}}, "required": ["city", "country"]},
    {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    {"type": "object", "properties": {"answer": {"type": "boolean"}, "confidence": {"type": "number",
     "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": _short, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": 0,
     "maximum": 100}, "minItems": 2, "maxItems": 4}}, "required": ["scores"]},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {"first": _name, "last": _name},
     "required": ["first", "last"]}, "email": {"type": "string", "maxLength": 40}}, "required": ["person"]},
    {"type": "object", "properties": {"title": _name, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
     "genre": {"type": "string", "enum": ["drama", "comedy", "horror", "sci-fi"]}},
     "required": ["title", "year", "genre"]},
    {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -10,
     "maximum": 10}, "y": {"type": "integer", "minimum": -10, "maximum": 10}}, "required": ["x", "y"]},
     "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"status": {"enum": ["ok", "error"]}, "code": {"type": "integer",
     "minimum": 100, "maximum": 599}}, "required": ["status", "code"]},
    {"$defs": {"point": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
     "lon": {"type": "number", "minimum": -180, "maximum": 180}}, "required": ["lat", "lon"]}},
     "type": "object", "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
     "required": ["from", "to"]},
    {"$defs": {"item": {"type": "object", "properties": {"sku": _short, "qty": {"type": "integer", "minimum": 1,
     "maximum": 99}}, "required": ["sku", "qty"]}}, "type": "object", "properties": {"items": {"type": "array",
     "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 2}}, "required": ["items"]},
    {"type": "object", "properties": {"ingredients": {"type": "array", "items": _name, "maxItems": 4},
     "steps": {"type": "integer", "minimum": 1, "maximum": 20}, "vegetarian": {"type": "boolean"}},
     "required": ["ingredients", "vegetarian"]},
    {"type": "object", "properties": {"sentiment": {"type": "string", "enum": ["positive", "negative",
     "neutral"]}, "score": {"type": "number", "minimum": -1, "maximum": 1}}, "required": ["sentiment"]},
    {"type": "object", "properties": {"meta": {"type": "object", "properties": {"version": {"type": "integer",
     "minimum": 1, "maximum": 9}, "draft": {"type": "boolean"}}, "required": ["version"]},
     "body": {"type": "string", "maxLength": 32}}, "required": ["meta", "body"]},
    {"type": "object", "properties": {"language": {"type": "string", "enum": ["python", "rust", "go", "c"]},
     "lines": {"type": "integer", "minimum": 0, "maximum": 10000}}, "required": ["language", "lines"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {"type": "array", "items":
     {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer",
     "minimum": 1, "maximum": 1000000}, "roles": {"type": "array", "items": {"enum": ["admin", "user", "guest"]},
     "minItems": 1, "maxItems": 3}}, "required": ["id", "roles"]}}, "required": ["user"]},
    {"type": "object", "properties": {"q": _name, "a": _name, "difficulty": {"type": "integer", "minimum": 1,
     "maximum": 5}}, "required": ["q", "a"]},
    {"$defs": {"node": {"type": "object", "properties": {"label": _short, "weight": {"type": "number",
     "minimum": 0, "maximum": 10}}, "required": ["label"]}}, "type": "object", "properties": {"root":
     {"$ref": "#/$defs/node"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
     "required": ["root", "children"]},
]

PROMPTS = [
    "Describe a person as JSON.", "Give a city as JSON.", "Pick a color.", "Is water wet? Answer as JSON.",
    "Tag this post about cooking.", "List some test scores.", "Who wrote Hamlet? Give the person.",
    "Name a film.", "Give some points.", "Report the status of a web request.", "Plan a trip between two places.",
    "Write a shopping order.", "Give a recipe.", "Rate the sentiment of: I love this!", "Write a document.",
    "Describe a program.", "Give a 2x2 matrix.", "Describe a user account.", "Write a quiz question.",
    "Describe a tree of labels.",
]
