"""The API surfaces beside OpenAI's chat and completions, each a thin translation onto the same pipeline
(TokenizerManager, chat template, reasoning and tool parsers, grammars); none has a scheduler path of its own.

    entrypoints/anthropic/  POST /v1/messages, /v1/messages/count_tokens (Anthropic Messages)
    entrypoints/responses/  POST /v1/responses, GET / DELETE /v1/responses/{id} (OpenAI Responses)
    entrypoints/ollama/     /api/chat, /api/generate, /api/tags, /api/show, /api/embed, /api/version, /api/ps
    entrypoints/rerank/     POST /v1/rerank (/rerank, /v2/rerank) and /v1/score

Each package's routes.py has make_servings (built at start-up on uvicorn's loop, beside the OpenAI
handlers), add_routes and SCHEMA_MODELS (the bodies /openapi.json describes, which schemathesis fuzzes).
Errors on its routes leave in its API's own shape (openai_serving.register_error_shape).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from radixserve.entrypoints.anthropic import routes as anthropic_routes
from radixserve.entrypoints.ollama import routes as ollama_routes
from radixserve.entrypoints.rerank import routes as rerank_routes
from radixserve.entrypoints.responses import routes as responses_routes

if TYPE_CHECKING:
    from radixserve.entrypoints.http_server import ServerState
    from radixserve.managers.tokenizer_manager import TokenizerManager
    from radixserve.server_args import ServerArgs

_SURFACES = (anthropic_routes, responses_routes, ollama_routes, rerank_routes)
SCHEMA_MODELS: list[Any] = [m for s in _SURFACES for m in s.SCHEMA_MODELS]


def make_surface_servings(tm: TokenizerManager, args: ServerArgs, metrics: Any,
                          servings: dict[str, Any]) -> dict[str, Any]:
    """Each surface's handlers; `servings` holds the OpenAI ones already built (chat, completions, ...)."""
    made: dict[str, Any] = {}
    for surface in _SURFACES:
        made.update(surface.make_servings(tm, args, metrics, servings))
    return made


def add_surface_routes(app: FastAPI, state: ServerState, servings: dict[str, Any]) -> None:
    for surface in _SURFACES:
        surface.add_routes(app, state, servings)
