"""The server's non-generation routes: models, health probes, info, cache, abort, metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve import __version__
from radixserve.entrypoints.openai_protocol import AbortRequest, ModelCard, ModelList
from radixserve.entrypoints.openai_serving import APIError, RequestGroup, parse_body
from radixserve.entrypoints.openapi_docs import json_body
from radixserve.lora.lora_registry import front_registry
from radixserve.managers.io_struct import GenerateReqInput
from radixserve.metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from radixserve.entrypoints.http_server import ServerState

HEALTH_GENERATE_TIMEOUT_S = 120.0  # a loaded CPU box can take a while for one token


def add_info_routes(app: FastAPI, state: ServerState, servings: dict[str, Any]) -> None:
    """Register the routes; `servings` is filled in at startup (the chat one checks model names)."""
    args = state.server_args
    name = args.model_name()

    def card(model_id: str = name) -> ModelCard:
        # root is the served name, never a filesystem path (the listing is for any client).
        return ModelCard(id=model_id, created=state.created, root=name,
                         max_model_len=state.handle.info["context_len"])

    listed = [n for n in args.model_names() if n != "default" or n == name]  # 'default' is implied

    @app.get("/v1/models", openapi_extra={"responses": {"200": {"description": "the served model", "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/ModelList"}}}}}})
    async def models() -> Response:
        adapters = [] if state.tm is None else sorted(front_registry(state.tm).names)  # LoRA adapters
        cards = [card(n) for n in listed] + [ModelCard(id=a, created=state.created, root=a, parent=name,
                                                       max_model_len=state.handle.info["context_len"])
                                             for a in adapters]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        servings["chat"].check_model(model)
        return JSONResponse(card(model).model_dump())

    @app.get("/health", response_class=Response)
    async def health() -> Response:
        why = state.tm_or_503().unhealthy_reason()
        if why is not None:
            raise APIError(503, f"unhealthy: {why}", code="unhealthy")
        return Response(status_code=200)

    @app.get("/health_generate", response_class=Response)
    async def health_generate(request: Request) -> Response:
        """Healthy only if a one-token generation goes through the whole pipeline."""
        tm = state.tm_or_503()
        subs, _ = tm.normalize(GenerateReqInput(text="ping", rid=f"health-{time.time_ns()}",
                                                sampling_params={"max_new_tokens": 1, "temperature": 0.0}),
                               embed=args.is_embedding)  # an embedding server pools the ping instead
        group = RequestGroup(tm, subs)
        try:
            await asyncio.wait_for(group.results(request), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise APIError(503, "health_generate: no token within the timeout", code="unhealthy") from None
        except Exception as e:  # noqa: BLE001  # the probe's own generation failed: the model is unwell
            raise APIError(503, f"health_generate: generation failed: {e}", code="unhealthy") from None
        finally:
            group.cancel()
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info() -> Response:
        info = state.handle.info
        return JSONResponse({
            "model_path": args.resolved_model_path(),
            "tokenizer_path": args.tokenizer_path or args.resolved_model_path(),
            "served_model_name": name,
            "is_generation": not args.is_embedding,
            **{k: info[k] for k in ("context_len", "vocab_size", "max_total_num_tokens", "eos_token_ids")},
        })

    @app.get("/get_server_info")
    async def get_server_info() -> Response:
        tm = state.tm_or_503()
        server_args = dataclasses.asdict(args)
        if server_args.get("api_key"):
            server_args["api_key"] = "<hidden>"  # never echo the secret back
        return JSONResponse({**server_args, **await tm.get_server_info(), "version": __version__,
                             "served_model_name": name, "memory_budget": state.handle.info.get("memory_budget")})

    @app.get("/flush_cache", operation_id="flush_cache_get")
    @app.post("/flush_cache", operation_id="flush_cache_post")
    async def flush_cache(storage: bool = False) -> Response:
        """`?storage=true` empties the disk tier as well (--enable-hierarchical-cache)."""
        try:
            ok = await state.tm_or_503().flush_cache(storage)
        except ValueError as e:
            raise APIError(400, str(e), "storage") from None
        if not ok:
            raise APIError(400, "flush_cache: requests are still running; try again when idle", code="busy")
        return JSONResponse({"success": True, "message": "Cache flushed."})

    @app.post("/abort_request", openapi_extra=json_body(AbortRequest))
    async def abort_request(request: Request) -> Response:
        tm = state.tm_or_503()
        req: AbortRequest = await parse_body(request, AbortRequest)
        if not req.rid and not req.abort_all:
            raise APIError(400, "rid: give the request id to abort (or abort_all: true)", "rid")
        # Exact rids only; an n > 1 / batch call made with rid R runs as, ...: R aborts them.
        rids = await (tm.abort_all() if req.abort_all else tm.abort_request(req.rid))
        return JSONResponse({"success": bool(rids), "aborted": rids})

    @app.get("/metrics", response_class=Response,
             openapi_extra={"responses": {"200": {"description": "Prometheus text format",
                                                  "content": {"text/plain": {}}}}})
    async def metrics() -> Response:
        assert state.metrics is not None
        if state.tm is not None and not state.tm.dead_reason:
            state.metrics.refresh(await state.tm.get_server_info())
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

