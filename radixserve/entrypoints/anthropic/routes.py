"""Anthropic Messages routes: POST /v1/messages (also `?beta=true`, as the SDK's beta client calls it) and
POST /v1/messages/count_tokens, plus `HEAD /`, which Anthropic-speaking clients probe before they start
(GET / is the web playground). Every error under /v1/messages leaves in Anthropic's shape."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from radixserve.entrypoints.anthropic.protocol import (
    AnthropicCountTokensRequest,
    AnthropicCountTokensResponse,
    AnthropicError,
    AnthropicMessage,
    AnthropicMessagesRequest,
)
from radixserve.entrypoints.anthropic.serving import make_anthropic_serving, render_error
from radixserve.entrypoints.openai_serving import register_error_shape
from radixserve.entrypoints.openapi_docs import json_body

if TYPE_CHECKING:
    from radixserve.entrypoints.http_server import ServerState

PREFIX = "/v1/messages"
SCHEMA_MODELS: list[Any] = [AnthropicMessagesRequest, AnthropicMessage, AnthropicCountTokensRequest,
                            AnthropicCountTokensResponse, AnthropicError]
_ERROR_STATUSES = (400, 401, 404, 408, 409, 413, 415, 429, 503)


def make_servings(tm: Any, args: Any, metrics: Any, servings: dict[str, Any]) -> dict[str, Any]:
    return {"anthropic": make_anthropic_serving(servings)}


def _openapi(request: type, response: type, stream: bool = False) -> dict[str, Any]:
    """json_body, with the error statuses' bodies in Anthropic's shape (the fuzz checks them)."""
    extra = json_body(request, response, stream=stream)
    schema = {"application/json": {"schema": {"$ref": f"#/components/schemas/{AnthropicError.__name__}"}}}
    for status in _ERROR_STATUSES:
        extra["responses"][str(status)] = {"description": "an error in Anthropic's shape", "content": schema}
    return extra


def add_routes(app: FastAPI, state: ServerState, servings: dict[str, Any]) -> None:
    register_error_shape(PREFIX, render_error)

    @app.post(PREFIX, openapi_extra=_openapi(AnthropicMessagesRequest, AnthropicMessage, stream=True))
    async def messages(request: Request) -> Response:
        state.tm_or_503()
        return await servings["anthropic"].create(request)

    @app.post(PREFIX + "/count_tokens", openapi_extra=_openapi(AnthropicCountTokensRequest,
                                                              AnthropicCountTokensResponse))
    async def count_tokens(request: Request) -> Response:
        state.tm_or_503()
        return await servings["anthropic"].count_tokens(request)

    @app.head("/", include_in_schema=False)
    async def probe() -> Response:
        """Claude Code and friends probe the base URL with HEAD before their first call."""
        return Response(status_code=200)
