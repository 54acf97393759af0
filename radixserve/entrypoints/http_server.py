"""The HTTP server: FastAPI on uvicorn in front of the scheduler process(es) (entrypoints/replicas.py).

    launch_server(args): bind the port (fail fast) -> scheduler process loads the model while
        this one loads the tokenizer -> uvicorn; lifespan start: TokenizerManager on uvicorn's
        loop + watchdog on the scheduler -> "radixserve ready on http://HOST:PORT (model NAME)"
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
import logging
import signal
import socket
import sys
import threading
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
from radixserve.entrypoints.replicas import Replicas, launch_replicas
from radixserve.entrypoints.request_gate import RequestGate
from radixserve.entrypoints.server_routes import add_info_routes
from radixserve.entrypoints.serving_chat import OpenAIServingChat
from radixserve.entrypoints.serving_completions import OpenAIServingCompletion
from radixserve.entrypoints.serving_generate import NativeServing
from radixserve.entrypoints.surfaces import SCHEMA_MODELS as SURFACE_SCHEMA_MODELS
from radixserve.entrypoints.surfaces import add_surface_routes, make_surface_servings
from radixserve.entrypoints.web.routes import add_web_routes
from radixserve.entrypoints.worker_node import run_worker_node
from radixserve.exceptions import SchedulerDied
from radixserve.lora.lora_routes import add_lora_routes
from radixserve.managers.io_struct import ShutdownReq
from radixserve.managers.tokenizer_manager import TokenizerManager
from radixserve.mem_cache.hiradix_cache import scheduler_stop_timeout
from radixserve.metrics import ServerMetrics
from radixserve.model_loader import get_tokenizer
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


def _bind(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a busy port fails in a second, not after the load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"radixserve: cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


class _Background:
    """A function run on a daemon thread (Ctrl-C during start-up must not wait for it)."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), name="rs-load", daemon=True)
        self._thread.start()

    def _run(self, fn: Any, args: tuple[Any, ...]) -> None:
        try:
            self._result = fn(*args)
        except BaseException as e:  # noqa: BLE001  # re-raised in the caller by result()
            self._error = e

    def result(self) -> Any:
        while self._thread.is_alive():
            self._thread.join(0.5)  # a timeout keeps the main thread responsive to signals
        if self._error is not None:
            raise self._error
        return self._result


def _start_scheduler(server_args: ServerArgs) -> tuple[Replicas, Any]:
    """The scheduler process loads the model while this process loads the tokenizer."""
    model_path = server_args.resolved_model_path()
    print(f"radixserve: loading {model_path} ...", flush=True)
    tokenizer = _Background(get_tokenizer, model_path, server_args.tokenizer_path, server_args.chat_template)
    handle = launch_replicas(server_args)
    try:
        return handle, tokenizer.result()
    except BaseException:
        handle.stop(2.0)
        raise


def launch_server(server_args: ServerArgs) -> None:
    """Run the server until SIGTERM / Ctrl-C; exits with status 1 if the scheduler dies. A node other than
    node 0 of a multi-node group serves no HTTP: it runs its ranks (worker_node.py)."""
    if server_args.node_rank > 0:
        logging.basicConfig(level=server_args.log_level.upper())
        return run_worker_node(server_args)
    logging.basicConfig(level=server_args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # SIGTERM behaves as Ctrl-C: while the model loads it interrupts launch_replicas (which
    # then stops its child), and later uvicorn's own handlers take over and drain.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sock = _bind(server_args.host, server_args.port)
    handle: Replicas | None = None
    state: ServerState | None = None
    try:
        try:
            handle, tokenizer = _start_scheduler(server_args)
        except (RuntimeError, OSError, ValueError) as e:  # a bad model path / file: one line, no traceback
            raise SystemExit(f"radixserve: cannot start: {e}") from None
        state = ServerState(server_args, handle, tokenizer, port=sock.getsockname()[1])
        config = uvicorn.Config(build_app(state), log_level=server_args.log_level, loop="asyncio",
                                timeout_graceful_shutdown=server_args.graceful_shutdown_timeout, timeout_keep_alive=30)
        state.uvicorn_server = _UvicornServer(config, state)
        state.uvicorn_server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        if handle is not None:
            handle.stop(scheduler_stop_timeout(server_args, SCHEDULER_STOP_TIMEOUT_S))
        sock.close()
    if state is not None and state.death_reason:
        raise SystemExit(1)
    print("radixserve: stopped", flush=True)
