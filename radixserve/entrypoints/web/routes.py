"""The web routes: the playground page, its live metrics stream, the radix tree and the step log.

    GET /                    the page (static/index.html; open: it holds no data, every call it makes
    GET /web/...             sends the API key), its scripts and styles -- no build step, no CDN
    GET /v1/stream/metrics   server-sent events: a snapshot of the scheduler every interval_ms
    GET /debug/radix_tree    the cached prefixes as a bounded tree (JSON; of replica dp_rank with --dp-size)
    GET /debug/steps         the scheduler's last step records, or those of one request (its trace)

Everything but the page and its files sits behind --api-key (RequestGate), like every other route.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.staticfiles import StaticFiles

from radixserve import __version__
from radixserve.debug.step_log import STEP_LOG_SIZE
from radixserve.entrypoints.openai_serving import APIError
from radixserve.entrypoints.web.metrics_feed import MAX_STREAMS, STEP_HISTORY, MetricsFeed
from radixserve.entrypoints.web.query_params import IntParam, StrParam, query_doc

if TYPE_CHECKING:
    from radixserve.entrypoints.http_server import ServerState

STATIC_DIR = Path(__file__).parent / "static"
KEEPALIVE_S = 10.0  # a comment line when no snapshot came for this long (the scheduler is in a long step)

INTERVAL_MS = IntParam("interval_ms", 500, 250, 60_000, "milliseconds between two snapshots on this stream "
                       "(the feed polls the scheduler every 250 ms whatever the streams ask)")
STEPS = IntParam("steps", 16, 0, STEP_HISTORY, "how many of the newest step records each snapshot carries")
MAX_NODES = IntParam("max_nodes", 200, 1, 2_000, "the most tree nodes in the answer (breadth first)")
MAX_DEPTH = IntParam("max_depth", 32, 1, 256, "the deepest level of the tree in the answer")
STEP_LIMIT = IntParam("limit", 64, 1, STEP_LOG_SIZE, "the most step records in the answer (newest)")
RID = StrParam("rid", 256, "only the steps that ran this request id (its trace)")

# The page runs only its own files: no inline script, nothing from another origin (so also no CDN).
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


class MetricsStreamResponse(StreamingResponse):
    """One dashboard's SSE stream. It counts as open from the moment the response starts until it ends,
    however it ends (the client went away, the server drains): MetricsFeed.num_streams never leaks."""

    media_type = "text/event-stream"

    def __init__(self, feed: MetricsFeed, interval_s: float, n_steps: int, stopped: Callable[[], bool]) -> None:
        self.feed = feed
        super().__init__(self._events(interval_s, n_steps, stopped),
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.feed.subscribe()
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.feed.unsubscribe()
            await self.body_iterator.aclose()  # type: ignore[union-attr]

    async def _events(self, interval_s: float, n_steps: int, stopped: Callable[[], bool]) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        seq, due = 0, loop.time()
        while not stopped():
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not await self.feed.wait_newer(seq, KEEPALIVE_S):
                yield ": keepalive\n\n"  # also how a vanished client is noticed when nothing changes
                continue
            seq, due = self.feed.seq, loop.time() + interval_s
            yield self.feed.render(n_steps)


def _index_page(api_key_required: bool, dp_size: int = 1) -> str:
    config = {"api_key_required": api_key_required, "version": __version__, "dp_size": dp_size}
    text = (STATIC_DIR / "index.html").read_text()
    # A JSON data block (never executed, so the CSP allows it); "<" escaped so it cannot close the tag.
    return text.replace("{{CONFIG}}", json.dumps(config).replace("<", "\\u003c"))


def add_web_routes(app: FastAPI, state: ServerState) -> MetricsFeed:
    """Register the routes; returns the feed (the server closes it at shutdown)."""

    async def server_info(**kw: Any) -> dict[str, Any]:
        if state.tm is None:
            raise RuntimeError("the server is starting")
        return await state.tm.get_server_info(**kw)

    feed = MetricsFeed(server_info)
    page = _index_page(bool(state.server_args.api_key), state.server_args.dp_size)
    dp_rank = IntParam("dp_rank", 0, 0, state.server_args.dp_size - 1, "the data-parallel replica whose tree to show "
                       "(each replica has its own cache)")

    def stopped() -> bool:
        tm = state.tm
        return tm is None or tm.draining or bool(tm.dead_reason)

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return HTMLResponse(page, headers=PAGE_HEADERS)

    app.mount("/web", StaticFiles(directory=STATIC_DIR), name="web")

    # Not in /openapi.json: a never-ending stream is nothing a schema fuzzer can check (README documents it).
    @app.get("/v1/stream/metrics", include_in_schema=False)
    async def stream_metrics(request: Request) -> Response:
        interval_ms, n_steps = INTERVAL_MS.read(request), STEPS.read(request)
        state.tm_or_503()
        if feed.num_streams >= MAX_STREAMS:
            raise APIError(429, f"too many metric streams open ({feed.num_streams} of {MAX_STREAMS}); "
                           "close one and retry", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        return MetricsStreamResponse(feed, interval_ms / 1000.0, n_steps, stopped)

    @app.get("/debug/radix_tree", openapi_extra=query_doc(MAX_NODES, MAX_DEPTH, dp_rank))
    async def radix_tree(request: Request) -> Response:
        max_nodes, max_depth, rank = MAX_NODES.read(request), MAX_DEPTH.read(request), dp_rank.read(request)
        tm = state.tm_or_503()
        tree = await tm.get_radix_tree(max_nodes, max_depth, rank)
        for node in tree["nodes"]:  # decoded here, not in the scheduler's loop
            ids = node.pop("preview_ids")
            node["text"] = tm.tokenizer.decode(ids, skip_special_tokens=False)
            node["text_cut"] = node["num_tokens"] > len(ids)
        return JSONResponse(tree)

    @app.get("/debug/steps", openapi_extra=query_doc(RID, STEP_LIMIT))
    async def steps(request: Request) -> Response:
        rid, limit = RID.read(request), STEP_LIMIT.read(request)
        info = await state.tm_or_503().get_server_info(steps_since=-1, steps_rid=rid, steps_limit=limit)
        return JSONResponse({"rid": rid, "steps": info["steps"], "last_step": info["last_step"],
                             "oldest_step": info["oldest_step"], "ring_size": STEP_LOG_SIZE})

    return feed
