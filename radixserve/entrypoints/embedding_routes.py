"""The routes of embeddings and tokenisation: POST /v1/embeddings (serving_embedding.py), POST /tokenize and
/detokenize (serving_tokenize.py). Registered on both server kinds: /v1/embeddings on a generation server
answers a 400 saying so (managers/embedding_request.check_server_kind), the tokenizer routes work on both."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from radixserve.entrypoints.embedding_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from radixserve.entrypoints.openapi_docs import json_body
from radixserve.entrypoints.serving_embedding import OpenAIServingEmbedding
from radixserve.entrypoints.serving_tokenize import TokenizeServing

if TYPE_CHECKING:
    from radixserve.entrypoints.http_server import ServerState
    from radixserve.managers.tokenizer_manager import TokenizerManager
    from radixserve.server_args import ServerArgs


def make_embedding_servings(tm: TokenizerManager, args: ServerArgs, metrics: Any, chat: Any) -> dict[str, Any]:
    """The handlers, built at start-up beside the generation ones (they need the TokenizerManager)."""
    return {"embeddings": OpenAIServingEmbedding(tm, args, metrics), "tokenize": TokenizeServing(tm, args, chat=chat)}


def add_embedding_routes(app: FastAPI, state: ServerState, servings: dict[str, Any]) -> None:
    @app.post("/v1/embeddings", openapi_extra=json_body(EmbeddingRequest, EmbeddingResponse))
    async def embeddings(request: Request) -> Response:
        state.tm_or_503()
        return await servings["embeddings"].create(request)

    @app.post("/tokenize", openapi_extra=json_body(TokenizeRequest, TokenizeResponse))
    async def tokenize(request: Request) -> Response:
        state.tm_or_503()
        return await servings["tokenize"].tokenize(request)

    @app.post("/detokenize", openapi_extra=json_body(DetokenizeRequest, DetokenizeResponse))
    async def detokenize(request: Request) -> Response:
        state.tm_or_503()
        return await servings["tokenize"].detokenize(request)
