"""`radixserve serve`: start the scheduler process(es) first, then the HTTP server (http_server.py).

    bind the port (fail fast) -> spawn the scheduler process(es) -> import the HTTP server's modules
    (FastAPI, the routes: ~1 s; never torch) while they load the model -> load the tokenizer while they finish
    -> uvicorn until SIGTERM / Ctrl-C (http_server.py's docstring has the rest)

This module imports nothing heavy at the top: the scheduler's own start (torch, the weights) overlaps this
process's imports instead of following them, ~2 s sooner ready on two cores.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from typing import TYPE_CHECKING, Any

from radixserve.entrypoints.replicas import start_replicas
from radixserve.mem_cache.hicache_stop import scheduler_stop_timeout
from radixserve.model_loader import get_tokenizer
from radixserve.server_args import ServerArgs

if TYPE_CHECKING:
    from radixserve.entrypoints.replicas import Replicas


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
    """The scheduler process(es) load the model while this process imports the server and loads the tokenizer.
    The import runs on this thread before the tokenizer's starts: two threads importing torch's modules at
    once can deadlock on their import locks."""
    model_path = server_args.resolved_model_path()
    print(f"radixserve: loading {model_path} ...", flush=True)
    pending = start_replicas(server_args)  # from this thread: the children's PR_SET_PDEATHSIG follows it
    try:
        import radixserve.entrypoints.http_server  # noqa: F401  # lazy: the heavy imports, overlapping the load

        tokenizer = _Background(get_tokenizer, model_path, server_args.tokenizer_path,
                                server_args.chat_template)
        handle = pending.wait()
    except BaseException:
        pending.kill()
        raise
    try:
        return handle, tokenizer.result()
    except BaseException:
        handle.stop(2.0)
        raise


def launch_server(server_args: ServerArgs) -> None:
    """Run the server until SIGTERM / Ctrl-C; exits with status 1 if the scheduler dies. A node other than
    node 0 of a multi-node group serves no HTTP: it runs its ranks (worker_node.py)."""
    if server_args.node_rank > 0:
        from radixserve.entrypoints.worker_node import run_worker_node  # lazy: other nodes serve no HTTP

        logging.basicConfig(level=server_args.log_level.upper())
        return run_worker_node(server_args)
    logging.basicConfig(level=server_args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # SIGTERM behaves as Ctrl-C: while the model loads it interrupts the wait (which then stops the
    # children), and later uvicorn's own handlers take over and drain.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sock = _bind(server_args.host, server_args.port)
    handle: Replicas | None = None
    state = None
    try:
        try:
            handle, tokenizer = _start_scheduler(server_args)
        except (RuntimeError, OSError, ValueError) as e:  # a bad model path / file: one line, no traceback
            raise SystemExit(f"radixserve: cannot start: {e}") from None
        import uvicorn

        from radixserve.entrypoints.http_server import (  # lazy: imported by _start_scheduler, after the spawn
            ServerState,
            _UvicornServer,
            build_app,
        )

        state = ServerState(server_args, handle, tokenizer, port=sock.getsockname()[1])
        config = uvicorn.Config(build_app(state), log_level=server_args.log_level, loop="asyncio",
                                timeout_graceful_shutdown=server_args.graceful_shutdown_timeout, timeout_keep_alive=30)
        state.uvicorn_server = _UvicornServer(config, state)
        state.uvicorn_server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        if handle is not None:
            from radixserve.entrypoints.http_server import SCHEDULER_STOP_TIMEOUT_S  # lazy: as above

            handle.stop(scheduler_stop_timeout(server_args, SCHEDULER_STOP_TIMEOUT_S))
        sock.close()
    if state is not None and state.death_reason:
        raise SystemExit(1)
    print("radixserve: stopped", flush=True)
