"""APIKeyMiddleware: `--api-key KEY` makes every route but the probes require
`Authorization: Bearer KEY` (401, OpenAI-shaped, otherwise).

A pure ASGI middleware rather than Starlette's BaseHTTPMiddleware: the latter wraps streaming
responses in its own task, which changes how a client disconnect reaches the SSE generator.
"""

from __future__ import annotations

import secrets
from typing import Any

from radixserve.entrypoints.openai_serving import APIError

# Load balancers and Prometheus probe these without credentials (as with vLLM).
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})


class APIKeyMiddleware:
    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if secrets.compare_digest(given.strip(), self.expected):
            await self.app(scope, receive, send)
            return
        why = "missing" if not given else "incorrect"
        err = APIError(401, f"{why} API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        await err.response()(scope, receive, send)
