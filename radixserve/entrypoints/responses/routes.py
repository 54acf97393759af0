"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{response_id} (serving.py).
Errors are OpenAI's {"error": {...}} shape, the server's default."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from radixserve.entrypoints.openapi_docs import json_body
from radixserve.entrypoints.responses.protocol import DeletedResponse, ResponseObject, ResponsesRequest
from radixserve.entrypoints.responses.serving import ResponsesServing

if TYPE_CHECKING:
    from radixserve.entrypoints.http_server import ServerState

SCHEMA_MODELS: list[Any] = [ResponsesRequest, ResponseObject, DeletedResponse]


def make_servings(tm: Any, args: Any, metrics: Any, servings: dict[str, Any]) -> dict[str, Any]:
    return {"responses": ResponsesServing(servings["chat"], args.responses_store_size)}


def _returns(model: type[Any]) -> dict[str, Any]:
    return {"responses": {"200": {"description": "Successful Response", "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}}


def add_routes(app: FastAPI, state: ServerState, servings: dict[str, Any]) -> None:
    @app.post("/v1/responses", openapi_extra=json_body(ResponsesRequest, ResponseObject, stream=True))
    async def create_response(request: Request) -> Response:
        state.tm_or_503()
        return await servings["responses"].create(request)

    @app.get("/v1/responses/{response_id}", openapi_extra=_returns(ResponseObject))
    async def get_response(response_id: str, request: Request) -> Response:
        state.tm_or_503()
        return servings["responses"].get(response_id, request)

    @app.delete("/v1/responses/{response_id}", openapi_extra=_returns(DeletedResponse))
    async def delete_response(response_id: str) -> Response:
        state.tm_or_503()
        return servings["responses"].delete(response_id)
