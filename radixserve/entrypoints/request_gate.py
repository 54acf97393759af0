"""The HTTP server's gate, one pure ASGI middleware in front of every route:

    1. --api-key KEY: every route but /health and the web page's own files (/ and /web/...: static,
       no data; every call the page makes sends the key) requires `Authorization: Bearer KEY` (401);
    2. a POST with a body must say `Content-Type: application/json` (415): a web page can send
       text/plain or form bodies to a local server without a CORS preflight, JSON it cannot;
    3. the body may not exceed --max-request-body-bytes (413), by Content-Length or as it streams.

Pure ASGI rather than Starlette's BaseHTTPMiddleware: the latter wraps streaming responses in its
own task, which changes how a client disconnect reaches the SSE generator.
"""

from __future__ import annotations

import secrets
from typing import Any

from radixserve.entrypoints.openai_serving import APIError, BodyTooLarge, render_error

OPEN_PATHS = frozenset({"/health", "/"})  # the liveness probe load balancers call; the web page
OPEN_PREFIXES = ("/web/",)  # the page's scripts and styles (entrypoints/web/static)


class RequestGate:
    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":  # CORS preflights carry no key
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        err = self._check(scope, headers)
        if err is not None:
            await render_error(scope["path"], err)(scope, receive, send)
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            receive = self._limited(receive, scope, send)
        await self.app(scope, receive, send)

    def _check(self, scope: dict[str, Any], headers: dict[bytes, bytes]) -> APIError | None:
        path = scope["path"]
        if self.expected is not None and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES):
            # OpenAI's clients send the key as a bearer token, Anthropic's as x-api-key: either opens the gate
            given = headers.get(b"authorization", b"")
            if given:
                ok = secrets.compare_digest(given.strip(), self.expected)
            else:
                given = headers.get(b"x-api-key", b"")
                ok = secrets.compare_digest(b"Bearer " + given.strip(), self.expected)
            if not ok:
                why = "missing" if not given else "incorrect"
                return APIError(401, f"{why} API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                                code="invalid_api_key")
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return None
        length = headers.get(b"content-length")
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                return APIError(400, "Content-Length is not a number", code="invalid_request")
            if size > self.max_body_bytes:
                return _too_large(self.max_body_bytes)
            if size == 0:
                return None  # a bodiless POST (e.g. /flush_cache) needs no content type
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if not (ctype == b"application/json" or (ctype.startswith(b"application/") and ctype.endswith(b"+json"))):
            shown = ctype.decode(errors="replace") or "none"
            return APIError(415, f"Content-Type must be application/json, got {shown}", code="unsupported_media_type")
        return None

    def _limited(self, receive: Any, scope: dict[str, Any], send: Any) -> Any:
        """Count a body sent without (or lying about) Content-Length as it arrives."""
        seen = 0
        limit = self.max_body_bytes

        async def wrapped() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        return wrapped


def _too_large(limit: int) -> APIError:
    return APIError.from_exception(BodyTooLarge(limit))  # type: ignore[return-value]
