"""The HTTP server: FastAPI on uvicorn in front of the scheduler process(es) (entrypoints/replicas.py).

    launch_server(args) (launch_server.py): bind the port (fail fast) -> spawn the scheduler process(es),
        which load the model while this one imports this module and loads the tokenizer -> uvicorn;
        lifespan start: TokenizerManager on uvicorn's loop + watchdog on the scheduler
        -> "radixserve ready on http://HOST:PORT (model NAME)"
    SIGTERM / Ctrl-C: drain -- new requests (and /health) get 503 while running ones finish, for
        up to --graceful-shutdown-timeout seconds (then uvicorn cancels them: their KV is freed)
        -> lifespan end: ShutdownReq to the scheduler, join / terminate it, IPC files removed
        -> socket closed -> "radixserve: stopped", exit status 0. A second Ctrl-C stops at once.

Generation routes live here, the others in server_routes.py; the OpenAI logic in serving_*.py.

If the scheduler process dies (any rank, on any node: entrypoints/node_monitor.py), every waiting
request gets a 503 and the server exits with status 1, naming the rank, so a supervisor can restart it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from radixserve import __version__
from radixserve.entrypoints.embedding_protocol import SCHEMA_MODELS as EMBEDDING_SCHEMA_MODELS
from radixserve.entrypoints.embedding_routes import add_embedding_routes, make_embedding_servings
from radixserve.entrypoints.openai_protocol import (
    AbortRequest,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    GenerateRequest,
    ModelCard,
    ModelList,
)
from radixserve.entrypoints.openai_serving import APIError, install_error_handlers, scheduler_died
from radixserve.entrypoints.openapi_docs import error_responses, install_openapi, json_body
from radixserve.entrypoints.replicas import Replicas
from radixserve.entrypoints.request_gate import RequestGate
from radixserve.entrypoints.server_routes import add_info_routes
from radixserve.entrypoints.serving_chat import OpenAIServingChat
from radixserve.entrypoints.serving_completions import OpenAIServingCompletion
from radixserve.entrypoints.serving_generate import NativeServing
from radixserve.entrypoints.surfaces import SCHEMA_MODELS as SURFACE_SCHEMA_MODELS
from radixserve.entrypoints.surfaces import add_surface_routes, make_surface_servings
from radixserve.entrypoints.web.routes import add_web_routes
from radixserve.exceptions import SchedulerDied
from radixserve.lora.lora_routes import add_lora_routes
from radixserve.managers.io_struct import ShutdownReq
from radixserve.managers.tokenizer_manager import TokenizerManager
from radixserve.mem_cache.hicache_stop import scheduler_stop_timeout
from radixserve.metrics import ServerMetrics
from radixserve.server_args import ServerArgs

SCHEDULER_STOP_TIMEOUT_S = 3.0  # after the ShutdownReq: its current step may take a while on CPU
WATCHDOG_INTERVAL_S = 0.5


@dataclass
class ServerState:
    server_args: ServerArgs
    handle: Replicas
    tokenizer: Any
    tm: TokenizerManager | None = None
    metrics: ServerMetrics | None = None
    uvicorn_server: uvicorn.Server | None = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    death_reason: str | None = None  # set when the scheduler process died
    port: int = 0
    loop: asyncio.AbstractEventLoop | None = None

    def tm_or_503(self) -> TokenizerManager:
        if self.tm is None or self.tm.dead_reason:
            raise scheduler_died(SchedulerDied(self.tm.dead_reason if self.tm else "not started"))
        if self.tm.draining:
            raise APIError(503, "the server is shutting down", code="unavailable")
        return self.tm


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app; the TokenizerManager is made on uvicorn's own loop at startup."""
    args = state.server_args
    name = args.model_name()
    servings: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = state.loop = asyncio.get_running_loop()
        handle = state.handle
        tm = TokenizerManager(state.tokenizer, handle.to_scheduler, handle.from_scheduler, handle.info, args)
        state.tm, state.metrics = tm, ServerMetrics(name)
        tm.metrics = state.metrics
        servings.update(chat=OpenAIServingChat(tm, args, state.metrics),
                        completions=OpenAIServingCompletion(tm, args, state.metrics),
                        generate=NativeServing(tm, args, state.metrics))
        servings.update(make_embedding_servings(tm, args, state.metrics, servings["chat"]))  # + /tokenize
        servings.update(make_surface_servings(tm, args, state.metrics, servings))  # Anthropic, Responses, Ollama, rerank

        async def watchdog() -> None:
            while state.handle.is_alive():
                await asyncio.sleep(WATCHDOG_INTERVAL_S)
            state.death_reason = state.handle.death_reason()
            print(f"radixserve: {state.death_reason}; shutting down", file=sys.stderr, flush=True)
            tm.fail_all(state.death_reason)  # every waiting request gets its 503 now
            if state.uvicorn_server is not None:
                state.uvicorn_server.should_exit = True

        watch = loop.create_task(watchdog())
        ready = loop.create_task(_announce_ready(state))
        try:
            yield
        finally:
            ready.cancel()
            watch.cancel()
            await web_feed.close()
            if state.handle.is_alive():
                tm.send(ShutdownReq())
            await asyncio.to_thread(state.handle.stop, scheduler_stop_timeout(args, SCHEDULER_STOP_TIMEOUT_S))
            await tm.close()

    app = FastAPI(title="radixserve", version=__version__, lifespan=lifespan, responses=error_responses())
    app.add_middleware(RequestGate, api_key=args.api_key, max_body_bytes=args.max_request_body_bytes)
    if args.allowed_origins:  # added last = outermost: preflights are answered before the gate
        from starlette.middleware.cors import CORSMiddleware

        origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()]
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"])

    install_error_handlers(app)

    # ------------------------------------------------------------------ generation
    @app.post("/generate", openapi_extra=json_body(GenerateRequest, stream=True))
    async def generate(request: Request) -> Response:
        state.tm_or_503()
        return await servings["generate"].create(request)

    @app.post("/v1/completions", openapi_extra=json_body(CompletionRequest, CompletionResponse, stream=True))
    async def completions(request: Request) -> Response:
        state.tm_or_503()
        return await servings["completions"].create(request)

    @app.post("/v1/chat/completions",
              openapi_extra=json_body(ChatCompletionRequest, ChatCompletionResponse, stream=True))
    async def chat_completions(request: Request) -> Response:
        state.tm_or_503()
        return await servings["chat"].create(request)

    add_info_routes(app, state, servings)
    add_embedding_routes(app, state, servings)  # /v1/embeddings, /tokenize, /detokenize
    add_lora_routes(app, state)  # /load_lora_adapter, /unload_lora_adapter
    add_surface_routes(app, state, servings)  # /v1/messages, /v1/responses, /api/*, /v1/rerank (surfaces.py)
    web_feed = add_web_routes(app, state)  # the playground at /, its metrics stream, tree and step views
    install_openapi(app, [GenerateRequest, CompletionRequest, CompletionResponse, ChatCompletionRequest,
                          ChatCompletionResponse, AbortRequest, ModelList, ModelCard, *EMBEDDING_SCHEMA_MODELS,
                          *SURFACE_SCHEMA_MODELS])

    return app


class _UvicornServer(uvicorn.Server):
    """uvicorn that drains at SIGTERM / Ctrl-C: the TokenizerManager stops accepting requests
    (503) while uvicorn lets the open ones finish, up to timeout_graceful_shutdown."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        tm, loop = self.state.tm, self.state.loop
        if tm is not None and loop is not None and not tm.dead_reason:
            # a signal handler runs between bytecodes of the loop's thread: hand over, don't call
            loop.call_soon_threadsafe(setattr, tm, "draining", True)


async def _announce_ready(state: ServerState) -> None:
    """Print the ready line once uvicorn accepts connections (after its startup completes)."""
    while state.uvicorn_server is None or not state.uvicorn_server.started:
        await asyncio.sleep(0.05)
    host = state.server_args.host
    shown = f"[{host}]" if ":" in host else host
    name = state.server_args.model_name()
    print(f"radixserve ready on http://{shown}:{state.port} (model {name})", flush=True)
