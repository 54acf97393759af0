"""What every HTTP handler shares: OpenAI-shaped errors, request groups (fan-out + abort), SSE.

One API call fans out into sub-requests (prompts x n samples). Each runs the
TokenizerManager's generator in its own asyncio task (`RequestGroup`) and the handler reads
their outputs from one queue:

    handler / SSE generator <-- queue <-- task 0: tm.generate_request(...)   (rid)
                                      <-- task 1: tm.generate_request(...)   (rid-1)

NOTE: the generators never run inside the HTTP response's anyio cancel scope. On a client
disconnect Starlette cancels that scope, and a cancelled anyio scope re-raises at *every*
later await, so a generator cleaning up inside it could stop half-way and never send the
AbortReq that frees the request's KV. `task.cancel()` delivers exactly one CancelledError,
after which the generator's `finally` runs to completion.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from radixserve.entrypoints.json_bounds import JSONShapeError, check_json_shape
from radixserve.exceptions import QueueFull, RequestError, SchedulerDied, ServerUnavailable
from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.managers.tokenizer_manager import TokenizerManager
from radixserve.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 1.0  # how often a waiting handler asks whether its client is still there
_DONE = object()

# Field names a ValueError message may start with (SamplingParams.verify, tm.validate).
_KNOWN_PARAMS = {f for f in SamplingParams.__dataclass_fields__} | {
    "prompt", "input_ids", "rid", "messages", "top_logprobs_num", "timeout", "priority", "return_logprob",
    "return_prompt_logprob", "stream", "sampling_params", "token_ids_logprob",
}
# SamplingParams name -> OpenAI name, so an error names the field the client actually sent.
OPENAI_RENAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
_CODES = {400: "invalid_value", 401: "invalid_api_key", 404: "not_found", 408: "request_timeout", 409: "request_aborted",
          413: "request_too_large", 415: "unsupported_media_type", 429: "rate_limit_exceeded",
          503: "unavailable"}


class BodyTooLarge(Exception):
    """The request body grew past --max-request-body-bytes while it was being read (HTTP 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body exceeds the server's limit of {limit} bytes (--max-request-body-bytes)")


class APIError(Exception):
    """An error with its HTTP status, rendered as OpenAI's {"error": {...}} body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or _CODES.get(status)
        self.headers = headers

    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    @classmethod
    def from_exception(cls, e: BaseException, renames: dict[str, str] | None = None) -> APIError | None:
        """The status an exception from request handling maps to; None for an unexpected one."""
        if isinstance(e, APIError):
            return e
        if isinstance(e, ValueError):
            return cls.from_value_error(e, renames)
        if isinstance(e, SchedulerDied):
            return scheduler_died(e)
        if isinstance(e, ServerUnavailable):
            return cls(503, str(e), code="unavailable")
        if isinstance(e, QueueFull):
            return cls(429, str(e), headers={"Retry-After": str(QueueFull.retry_after_s)})
        if isinstance(e, BodyTooLarge):
            return cls(413, str(e))
        if isinstance(e, RequestError):
            return cls(e.status, str(e), code=_CODES.get(e.status, "internal_error"))
        return None

    @classmethod
    def from_value_error(cls, e: ValueError, renames: dict[str, str] | None = None) -> APIError:
        """A 400 whose `param` is the field the message starts with (see SamplingParams.verify)."""
        message = str(e)
        head = message.split(" ", 1)[0].rstrip(":")
        param = head if head in _KNOWN_PARAMS else None
        if param and renames and param in renames:
            param, message = renames[param], renames[param] + message[len(head) :]
        return cls(400, message, param)

    @classmethod
    def from_validation_error(cls, e: ValidationError) -> APIError:
        """pydantic's first error as a 400 naming the field (never FastAPI's 422)."""
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()) if not str(x).startswith("function-"))
        message = f"{loc}: {err['msg']}" if loc else err["msg"]
        return cls(400, message, loc.split(".")[0] if loc else None, "invalid_type")


def scheduler_died(e: SchedulerDied) -> APIError:
    return APIError(503, f"the model is not available: {e}", code="scheduler_unavailable")


# Routes of other APIs answer errors in their own shape (Anthropic's {"type": "error", ...}, Ollama's
# {"error": "..."}): path prefix -> renderer, registered by each surface (entrypoints/surfaces.py).
ErrorShape = Callable[[APIError], Response]
_ERROR_SHAPES: dict[str, ErrorShape] = {}


def register_error_shape(prefix: str, render: ErrorShape) -> None:
    """Errors on paths starting with `prefix` are rendered by `render` instead of as OpenAI's body."""
    _ERROR_SHAPES[prefix] = render


def render_error(path: str, err: APIError) -> Response:
    """The error response for a request to `path`: the longest registered prefix wins."""
    best = max((p for p in _ERROR_SHAPES if path.startswith(p)), key=len, default=None)
    return _ERROR_SHAPES[best](err) if best is not None else err.response()


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI's {"error": {...}} JSON (or its route's API's shape: render_error),
    never FastAPI's 422 or {"detail"}."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> Response:
        return render_error(request.url.path, e)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, e: ValueError) -> Response:
        return render_error(request.url.path, APIError.from_value_error(e))

    @app.exception_handler(SchedulerDied)
    @app.exception_handler(ServerUnavailable)
    @app.exception_handler(QueueFull)
    @app.exception_handler(RequestError)
    @app.exception_handler(BodyTooLarge)
    async def _mapped(request: Request, e: Exception) -> Response:
        err = APIError.from_exception(e)
        assert err is not None
        return render_error(request.url.path, err)

    @app.exception_handler(ConnectionAbortedError)
    async def _client_gone(_: Request, e: ConnectionAbortedError) -> Response:
        # Nobody reads this: the client hung up and its requests were aborted (nginx's 499).
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> Response:
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        loc = ".".join(str(x) for x in err.get("loc", ())[1:])  # drop "body" / "query"
        message = f"{loc}: {err['msg']}" if loc else err["msg"]
        return render_error(request.url.path, APIError(400, message, loc or None, "invalid_type"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
        code = "not_found" if e.status_code == 404 else None
        return render_error(request.url.path, APIError(e.status_code, str(e.detail), code=code))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> Response:
        logger.exception("unhandled error")
        return render_error(request.url.path, APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error"))


async def parse_body(request: Request, model: type[Any]) -> Any:
    """JSON body -> pydantic model; malformed JSON, hostile shapes (json_bounds.py) and bad types are 400s."""
    raw = await request.body()
    try:
        # decoded as json.loads(bytes) would (UTF-8/16/32), so the shape check reads the same text
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
        check_json_shape(text)  # before json.loads / pydantic, which recurse once per level
        data = json.loads(text) if text else {}
    except JSONShapeError as e:
        raise APIError(400, str(e), e.field, "invalid_json") from None
    except ValueError as e:  # JSONDecodeError and bad UTF-8
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise APIError.from_validation_error(e) from None


class RequestGroup:
    """The sub-requests of one API call, each driven by its own asyncio task (see module doc)."""

    def __init__(self, tm: TokenizerManager, subs: list[TokenizedGenerateReqInput], *, metrics: Any = None) -> None:
        self.tm, self.subs, self.metrics = tm, subs, metrics
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.finished = [False] * len(subs)
        self.tasks = [asyncio.create_task(self._pump(i, sub)) for i, sub in enumerate(subs)]

    async def _pump(self, i: int, sub: TokenizedGenerateReqInput) -> None:
        # NOTE: always stream from the scheduler, even when the client does not: the
        # TokenizerManager times the first token on arrival, and a non-streamed request's only
        # output arrives at the end (TTFT would equal the whole latency in /metrics).
        sub.stream = True
        try:
            async for out in self.tm.generate_request(sub):
                self.finished[i] = self.finished[i] or out["finished"]
                self.queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001  # handed to the reader, which raises it in the handler
            self.queue.put_nowait((i, e))
        else:
            self.queue.put_nowait((i, _DONE))

    async def events(self, request: Request | None = None) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """Yield (sub-request index, output) until all finish; raise the first error.

        Raises ConnectionAbortedError when `request`'s client has gone away.
        """
        remaining = len(self.tasks)
        while remaining:
            try:
                i, item = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    raise ConnectionAbortedError("client disconnected") from None
                continue
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item

    async def results(self, request: Request | None = None) -> list[dict[str, Any]]:
        """Final outputs in sub-request order (non-streaming)."""
        finals: list[dict[str, Any]] = [{} for _ in self.tasks]
        async for i, out in self.events(request):
            finals[i] = out
        return finals

    def cancel(self) -> None:
        """Abort what still runs (each task's generator sends its AbortReq). Safe to call twice."""
        for i, task in enumerate(self.tasks):
            if not task.done():
                task.cancel()
                if not self.finished[i] and self.metrics is not None:
                    self.metrics.observe_aborted()
                self.finished[i] = True


class GroupStreamingResponse(StreamingResponse):
    """A stream of a RequestGroup's output that always closes its generator and cancels the group when the
    response ends (SSE here; other APIs' framings, e.g. Ollama's NDJSON, subclass it too).

    Starlette only cancels the sending task on a disconnect; a generator parked at a `yield`
    would stay open until garbage collection, with its requests still decoding.
    """

    def __init__(self, body: AsyncIterator[str], group: RequestGroup) -> None:
        super().__init__(body, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.group = group

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # A generator that never started has no `finally` to run: cancel the group here too.
            self.group.cancel()
            await self.body_iterator.aclose()  # type: ignore[union-attr]


class SSEResponse(GroupStreamingResponse):
    """A server-sent-event stream: the events, then [DONE] (_framed)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], group: RequestGroup) -> None:
        super().__init__(_framed(events, group), group)


async def _framed(events: AsyncIterator[str], group: RequestGroup) -> AsyncIterator[str]:
    """Every route's stream: its events, then [DONE]. An error after the 200 headers went out is reported
    in-band as the last event; a client that left (ConnectionAbortedError) is sent nothing more."""
    try:
        async for event in events:
            yield event
    except ConnectionAbortedError:
        return
    except Exception as e:  # noqa: BLE001
        yield sse_error(e)
    finally:
        group.cancel()
        await events.aclose()  # type: ignore[attr-defined]
    yield SSE_DONE


def sse(data: Any) -> str:
    payload = data.model_dump_json() if hasattr(data, "model_dump_json") else json.dumps(data)
    return f"data: {payload}\n\n"


async def sse_objects(chunks: AsyncIterator[Any]) -> AsyncIterator[str]:
    """A ServingRun's chunk objects as SSE events; closes the chunk generator when the stream ends."""
    try:
        async for c in chunks:
            yield sse(c)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


SSE_DONE = "data: [DONE]\n\n"


def sse_error(e: BaseException) -> str:
    """An error that happens after the 200 headers went out, as a final SSE event."""
    err = APIError.from_exception(e, OPENAI_RENAMES) or APIError(500, f"{type(e).__name__}: {e}",
                                                                 code="internal_error")
    return sse(err.body())


def finish_reason(meta: dict[str, Any]) -> tuple[str | None, int | str | None]:
    """meta_info's finish_reason -> (OpenAI finish_reason, matched stop string / token).

    OpenAI clients know stop | length | tool_calls | content_filter only: a request aborted through
    /abort_request is an error (409) for them, in-band when it streams, instead of a new value."""
    reason = meta.get("finish_reason")
    if not reason:
        return None, None
    if reason["type"] == "abort":
        raise APIError(409, f"the request was aborted ({reason.get('message') or 'abort_request'})",
                       code="request_aborted")
    return reason["type"], reason.get("matched")


def ends_with_stop_token(out: dict[str, Any]) -> bool:
    """True when the output's last token is the EOS / stop token that ended it (not part of the text)."""
    reason = out["meta_info"].get("finish_reason") or {}
    return bool(out["finished"] and reason.get("type") == "stop" and isinstance(reason.get("matched"), int))


def new_logprob_items(out: dict[str, Any]) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """(logprob, token id, top alternatives) of the tokens this output added that belong to the text."""
    pairs, tops = out["new_logprobs"], out["new_top_logprobs"]
    n = len(pairs) - (1 if ends_with_stop_token(out) and pairs else 0)
    return [(lp, tok, tops[k] if k < len(tops) else []) for k, (lp, tok) in enumerate(pairs[:n])]


def all_logprob_items(out: dict[str, Any]) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """The same for a finished output's whole text (non-streamed responses)."""
    meta = out["meta_info"]
    pairs, tops = meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs") or []
    n = len(pairs) - (1 if ends_with_stop_token(out) and pairs else 0)
    return [(lp, tok, tops[k] if k < len(tops) else []) for k, (lp, tok) in enumerate(pairs[:n])]
