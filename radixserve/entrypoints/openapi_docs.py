"""The OpenAPI description of the server: request bodies and every status a route may answer.

The handlers read their bodies themselves (parse_body, so that every error is an OpenAI-shaped
400 rather than FastAPI's 422), so FastAPI cannot see the body models; they are declared here and
their JSON schemas added to components. `/openapi.json` is what schemathesis fuzzes in the tests.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from radixserve.entrypoints.openai_protocol import ErrorResponse

_ERROR_STATUSES = {
    400: "invalid parameters (the field is named in error.param)",
    401: "missing or wrong API key",
    404: "unknown model or route",
    408: "the request's timeout ran out; it was aborted",
    409: "the request was aborted through /abort_request",
    413: "request body over --max-request-body-bytes",
    415: "a POST body that is not application/json",
    429: "too many requests in flight (Retry-After)",
    503: "the model is unavailable or the server is shutting down",
}


def error_responses() -> dict[int | str, dict[str, Any]]:
    """Every route may answer these (the gate, the bounds and the scheduler's state apply to all)."""
    return {code: {"model": ErrorResponse, "description": text} for code, text in _ERROR_STATUSES.items()}


def json_body(model: type[BaseModel], response: type[BaseModel] | None = None, stream: bool = False) -> dict[str, Any]:
    """openapi_extra for a route that reads `model` from a JSON body (and may stream SSE)."""
    extra: dict[str, Any] = {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}
    content: dict[str, Any] = {"application/json": {"schema": {"$ref": f"#/components/schemas/{response.__name__}"}
                                                    if response else {}}}
    if stream:
        # one parsed server-sent event (OpenAPI 3.0/3.1 read `schema` as the per-event schema): `data` is
        # a JSON chunk, or "[DONE]" on the OpenAI routes
        content["text/event-stream"] = {"schema": {
            "type": "object", "required": ["data"],
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
        }}
    extra["responses"] = {"200": {"description": "Successful Response", "content": content}}
    return extra


def install_openapi(app: FastAPI, models: list[type[BaseModel]]) -> None:
    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in models],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]
