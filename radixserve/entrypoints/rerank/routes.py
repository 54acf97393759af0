"""The routes of rerank and score (serving.py): POST /v1/rerank, its aliases /rerank (llama.cpp, vLLM) and
/v2/rerank (Cohere v2), and POST /v1/score (vLLM). Errors keep OpenAI's shape, as vLLM's and SGLang's
rerank routes answer them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from radixserve.entrypoints.openapi_docs import json_body
from radixserve.entrypoints.rerank.protocol import (
    SCHEMA_MODELS,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from radixserve.entrypoints.rerank.serving import RerankServing

if TYPE_CHECKING:
    from radixserve.entrypoints.http_server import ServerState
    from radixserve.managers.tokenizer_manager import TokenizerManager
    from radixserve.server_args import ServerArgs

__all__ = ["SCHEMA_MODELS", "add_routes", "make_servings"]

RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")


def make_servings(tm: TokenizerManager, args: ServerArgs, metrics: Any, servings: dict[str, Any]) -> dict[str, Any]:
    return {"rerank": RerankServing(tm, args, metrics)}


def add_routes(app: FastAPI, state: ServerState, servings: dict[str, Any]) -> None:
    async def rerank(request: Request) -> Response:
        state.tm_or_503()
        return await servings["rerank"].rerank(request)

    for path in RERANK_PATHS:
        app.add_api_route(path, rerank, methods=["POST"], openapi_extra=json_body(RerankRequest, RerankResponse),
                          name=f"rerank{path.replace('/', '_')}")

    @app.post("/v1/score", openapi_extra=json_body(ScoreRequest, ScoreResponse))
    async def score(request: Request) -> Response:
        state.tm_or_503()
        return await servings["rerank"].score(request)
