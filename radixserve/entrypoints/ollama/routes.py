"""Ollama's API on radixserve (`radixserve serve --port 11434` is all an Ollama client needs):

    POST /api/chat, /api/generate       serving.py (streamed as NDJSON unless `stream: false`)
    POST /api/embed, /api/embeddings    embed.py (an --is-embedding server; a 400 on a generation one)
    POST /api/show; GET /api/tags, /api/ps, /api/version; HEAD /   model_card.py (clients probe these first)

Every error under /api/ is Ollama's `{"error": "message"}` with the HTTP status (register_error_shape).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.entrypoints.ollama.embed import OllamaEmbedding
from radixserve.entrypoints.ollama.model_card import OLLAMA_API_VERSION, ModelCards
from radixserve.entrypoints.ollama.protocol import (
    SCHEMA_MODELS,
    ChatRequest,
    ChatResponse,
    EmbeddingsRequest,
    EmbeddingsResponse,
    EmbedRequest,
    EmbedResponse,
    GenerateRequest,
    GenerateResponse,
    OllamaError,
    PsResponse,
    ShowRequest,
    ShowResponse,
    TagsResponse,
    VersionResponse,
)
from radixserve.entrypoints.ollama.serving import OllamaServing
from radixserve.entrypoints.openai_serving import APIError, parse_body, register_error_shape
from radixserve.entrypoints.openapi_docs import error_responses

if TYPE_CHECKING:
    from radixserve.entrypoints.http_server import ServerState

__all__ = ["SCHEMA_MODELS", "add_routes", "make_servings"]

PREFIX = "/api/"


def render_error(err: APIError) -> Response:
    return JSONResponse({"error": err.message}, status_code=err.status, headers=err.headers)


def make_servings(tm: Any, args: Any, metrics: Any, servings: dict[str, Any]) -> dict[str, Any]:
    ollama = OllamaServing(servings)
    return {"ollama": ollama, "ollama_embed": OllamaEmbedding(servings, ollama.resolve)}


def _doc(body: type[BaseModel] | None, response: type[BaseModel], stream: bool = False) -> dict[str, Any]:
    """openapi_extra: the body, the 200 (JSON, or NDJSON when it streams) and Ollama-shaped errors."""
    content: dict[str, Any] = {"application/json": {"schema": {"$ref": f"#/components/schemas/{response.__name__}"}}}
    if stream:  # one JSON object per line (not JSON as a whole: schema-less here)
        content["application/x-ndjson"] = {"schema": {"type": "string"}}
    error = {"application/json": {"schema": {"$ref": f"#/components/schemas/{OllamaError.__name__}"}}}
    extra: dict[str, Any] = {"responses": {
        "200": {"description": "Successful Response", "content": content},
        **{str(code): {"description": doc["description"], "content": error} for code, doc in error_responses().items()},
    }}
    if body is not None:
        extra["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{body.__name__}"}}}}
    return extra


def add_routes(app: FastAPI, state: ServerState, servings: dict[str, Any]) -> None:
    register_error_shape(PREFIX, render_error)
    cards = ModelCards(state, lambda: servings["ollama"].thinks)

    @app.post("/api/chat", openapi_extra=_doc(ChatRequest, ChatResponse, stream=True))
    async def chat(request: Request) -> Response:
        state.tm_or_503()
        return await servings["ollama"].chat(request)

    @app.post("/api/generate", openapi_extra=_doc(GenerateRequest, GenerateResponse, stream=True))
    async def generate(request: Request) -> Response:
        state.tm_or_503()
        return await servings["ollama"].generate(request)

    @app.post("/api/embed", openapi_extra=_doc(EmbedRequest, EmbedResponse))
    async def embed(request: Request) -> Response:
        state.tm_or_503()
        return await servings["ollama_embed"].embed(request)

    @app.post("/api/embeddings", openapi_extra=_doc(EmbeddingsRequest, EmbeddingsResponse))
    async def embeddings(request: Request) -> Response:
        state.tm_or_503()
        return await servings["ollama_embed"].embeddings(request)

    @app.post("/api/show", openapi_extra=_doc(ShowRequest, ShowResponse))
    async def show(request: Request) -> Response:
        state.tm_or_503()
        req: ShowRequest = await parse_body(request, ShowRequest)
        name = req.model or req.name
        servings["ollama"].resolve(name)
        return JSONResponse(cards.show(name).model_dump())

    @app.get("/api/tags", openapi_extra=_doc(None, TagsResponse))
    async def tags() -> Response:
        return JSONResponse(cards.tags().model_dump())

    @app.get("/api/ps", openapi_extra=_doc(None, PsResponse))
    async def ps() -> Response:
        return JSONResponse(cards.ps().model_dump())

    @app.get("/api/version", openapi_extra=_doc(None, VersionResponse))
    async def version() -> Response:
        return JSONResponse(VersionResponse(version=OLLAMA_API_VERSION).model_dump())

    # Ollama's clients (and Anthropic's) probe the root with HEAD; GET / stays the web page. Another surface
    # may have registered it already (entrypoints/surfaces.py adds them in order).
    if not any(getattr(r, "path", None) == "/" and "HEAD" in (getattr(r, "methods", None) or ()) for r in app.routes):
        @app.head("/", include_in_schema=False)
        async def probe() -> Response:
            return Response(status_code=200, media_type="text/plain")
