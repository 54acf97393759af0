"""Bounded query parameters of the web routes: every one has a default, a range (or a length limit),
a 400 naming it when it is out of range, not a number, or given twice, and an OpenAPI entry that
states the bounds (so /openapi.json documents them and the fuzz test tries values outside them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from radixserve.entrypoints.openai_serving import APIError


def _one(request: Request, name: str) -> str | None:
    values = request.query_params.getlist(name)
    if len(values) > 1:
        raise APIError(400, f"{name}: given {len(values)} times; give it once", name, "invalid_value")
    return values[0] if values else None


@dataclass(frozen=True)
class IntParam:
    name: str
    default: int
    lo: int
    hi: int
    doc: str

    def read(self, request: Request) -> int:
        raw = _one(request, self.name)
        if raw is None:
            return self.default
        try:
            value = int(raw.strip())
        except ValueError:
            raise APIError(400, f"{self.name} must be an integer in [{self.lo}, {self.hi}], got {raw[:40]!r}",
                           self.name, "invalid_value") from None
        if not self.lo <= value <= self.hi:
            raise APIError(400, f"{self.name} must be in [{self.lo}, {self.hi}], got {value}", self.name,
                           "invalid_value")
        return value

    def openapi(self) -> dict[str, Any]:
        return {"name": self.name, "in": "query", "required": False, "description": self.doc,
                "schema": {"type": "integer", "minimum": self.lo, "maximum": self.hi, "default": self.default}}


@dataclass(frozen=True)
class StrParam:
    name: str
    max_len: int
    doc: str

    def read(self, request: Request) -> str | None:
        raw = _one(request, self.name)
        if raw is None or raw == "":
            return None
        if len(raw) > self.max_len:
            raise APIError(400, f"{self.name} may be at most {self.max_len} characters, got {len(raw)}",
                           self.name, "invalid_value")
        return raw

    def openapi(self) -> dict[str, Any]:
        return {"name": self.name, "in": "query", "required": False, "description": self.doc,
                "schema": {"type": "string", "maxLength": self.max_len}}


def query_doc(*params: IntParam | StrParam) -> dict[str, Any]:
    """openapi_extra for a GET route that reads these parameters itself."""
    return {"parameters": [p.openapi() for p in params]}
