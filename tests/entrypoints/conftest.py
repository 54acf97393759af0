"""One real `radixserve serve` subprocess for the whole HTTP test session.

Loading a model costs tens of seconds on the shared CI box, so every HTTP test module shares
one server (`--context-length 256 --check-invariants --api-key ...`). The offline Engine that
the chat test compares against starts loading in a background thread as soon as the server
process is spawned, so the two loads overlap. test_http_shutdown.py runs last (file order) and
stops the server; the `server` fixture restarts it if a later test still needs one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.server_process import ServerProcess

API_KEY = "test-key-123"
CONTEXT_LEN = 256


SERVER_ARGS = [
    "--context-length",
    str(CONTEXT_LEN),
    "--check-invariants",
    "--api-key",
    API_KEY,
    "--max-total-tokens",
    "16384",
    # the exact mode: these tests compare outputs across batchings (64 concurrent streams equal the same
    # requests one at a time) against transformers-level float32 references. The default mode (batch-invariant
    # too, on every CPU kind) runs over HTTP in test_http_faults.py's own server.
    "--quantization",
    "none",
    "--dtype",
    "float32",
]


@dataclass
class _Pool:
    server: ServerProcess | None = None
    engine_future: concurrent.futures.Future | None = None
    tmpdirs: list[str] = field(default_factory=list)
    executor: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1)
    )


def _make_engine() -> Any:
    import radixserve

    # Same context length as the server; a smaller KV pool (the pool size never changes greedy output).
    return radixserve.Engine(
        model_path=None,
        check_invariants=True,
        context_length=CONTEXT_LEN,
        max_total_tokens=4096,
        show_progress=False,
        quantization="none",
        dtype="float32",
    )


@pytest.fixture(scope="session")
def _pool(request: pytest.FixtureRequest) -> Iterator[_Pool]:
    pool = _Pool()
    yield pool
    if pool.server is not None:
        pool.server.stop()
    for tmpdir in pool.tmpdirs:  # each server's log and TMPDIR
        shutil.rmtree(tmpdir, ignore_errors=True)
    if pool.engine_future is not None:
        with contextlib.suppress(Exception):  # its load failed: that test already reported it
            pool.engine_future.result().shutdown()
    pool.executor.shutdown(wait=False)


def _session_wants_engine(session: pytest.Session) -> bool:
    return any("offline_engine" in getattr(item, "fixturenames", ()) for item in session.items)


def _ensure_server(pool: _Pool, session: pytest.Session) -> ServerProcess:
    """(Re)start the shared server if needed; the Engine's load overlaps its start-up."""
    if pool.server is None or not pool.server.alive():
        pool.server = ServerProcess(SERVER_ARGS, api_key=API_KEY, context_len=CONTEXT_LEN)
        pool.tmpdirs.append(pool.server.tmpdir)
        pool.server.start()
        if pool.engine_future is None and _session_wants_engine(session):
            pool.engine_future = pool.executor.submit(_make_engine)
        pool.server.wait_ready()
    return pool.server


@pytest.fixture
def server(_pool: _Pool, request: pytest.FixtureRequest) -> ServerProcess:
    """The shared server (function-scoped so that a test after the shutdown test gets a new one)."""
    return _ensure_server(_pool, request.session)


@pytest.fixture(scope="module")
def offline_engine(_pool: _Pool, request: pytest.FixtureRequest) -> Iterator[Any]:
    """The offline Engine (radixserve.Engine), shut down when the requesting module ends."""
    _ensure_server(_pool, request.session)
    if _pool.engine_future is None:
        _pool.engine_future = _pool.executor.submit(_make_engine)
    eng = _pool.engine_future.result()
    yield eng
    eng.shutdown()
    _pool.engine_future = None


@pytest.fixture
def client(server: ServerProcess) -> Any:
    """The official OpenAI client, pointed at the shared server."""
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300
    ) as c:
        yield c


STRUCTURED_ARGS = ["--context-length", "2048", "--api-key", API_KEY, "--max-total-tokens", "16384",
                   "--check-invariants", "--quantization", "none", "--dtype", "float32", "--served-model-name", "smol,smollm2-alias"]


@pytest.fixture(scope="session")
def structured_server() -> Iterator[ServerProcess]:
    """A server with room for tool prompts (the generic tool rendering alone is ~150 tokens), shared by
    the structured-output, tool-calling and real-client tests."""
    srv = ServerProcess(STRUCTURED_ARGS, api_key=API_KEY, context_len=2048)
    srv.start()
    srv.wait_ready()
    yield srv
    srv.stop()
    shutil.rmtree(srv.tmpdir, ignore_errors=True)


@pytest.fixture
def sclient(structured_server: ServerProcess) -> Any:
    import openai

    return openai.OpenAI(base_url=structured_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


REASONING_CONTEXT = 1024
THINK_TEMPLATE = (  # ChatML (SmolLM2's own) whose generation prompt opens the thinking, as R1 distills' do
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{ '<think>\\n' }}{%- endif %}{%- endif %}"
)


@pytest.fixture(scope="session")
def reasoning_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The default model with `--reasoning-parser auto` and a template that opens `<think>` (served as "smol"):
    SmolLM2 never closes a thinking itself, so tests set a thinking budget. Shared by the reasoning tests of
    every API surface (chat, Anthropic Messages, Responses, Ollama)."""
    path = tmp_path_factory.mktemp("reasoning") / "think.jinja"
    path.write_text(THINK_TEMPLATE)
    srv = ServerProcess(["--reasoning-parser", "auto", "--chat-template", str(path), "--context-length",
                         str(REASONING_CONTEXT), "--max-total-tokens", "16384", "--api-key", API_KEY,
                         "--served-model-name", "smol"], api_key=API_KEY, context_len=REASONING_CONTEXT)
    srv.start()
    srv.wait_ready()
    yield srv
    srv.stop()
    shutil.rmtree(srv.tmpdir, ignore_errors=True)


EMBED_KEY = "embed-key"
EMBED_ARGS = ["--is-embedding", "--context-length", "256", "--max-total-tokens", "16384", "--check-invariants",
              "--api-key", EMBED_KEY, "--quantization", "none", "--dtype", "float32",
              "--chunked-prefill-size", "2048"]  # 64 inputs: one step


@pytest.fixture(scope="session")
def embed_server() -> Iterator[ServerProcess]:
    """The default model as an embedding server (--is-embedding, exact mode): /v1/embeddings' tests and every
    surface's embeddings (Ollama's /api/embed) share it."""
    yield from ServerProcess(EMBED_ARGS, api_key=EMBED_KEY, context_len=256).running()
