"""The exceptions radixserve's own code raises across module boundaries, in one place.

Here rather than beside their first raiser so that a module catching one imports nothing else of the
raiser's (the scheduler's fault handling must not depend on debug/, the HTTP layer on the tokenizer
manager's internals). The HTTP layer's own errors (entrypoints/openai_serving.APIError and the errors it
maps from request bodies) stay in entrypoints/: they are raised and caught there only.
"""

from __future__ import annotations


class InvariantError(AssertionError):
    """--check-invariants found a broken invariant (debug/invariants.py): our bug, fatal to the server."""


class FatalSchedulerError(RuntimeError):
    """A fault no request can be blamed for (the device or the process itself): stop the server."""


class OutOfKVSlots(RuntimeError):
    """The scheduler's budgets said yes but the pool said no (should not happen: a bug)."""


class SchedulerDied(RuntimeError):
    """The scheduler process is gone (HTTP 503)."""


class ServerUnavailable(RuntimeError):
    """Not accepting new requests (shutting down) or a control call timed out (HTTP 503)."""


class QueueFull(RuntimeError):
    """Too many requests in flight (HTTP 429 with Retry-After)."""

    retry_after_s = 1


class RequestError(RuntimeError):
    """The scheduler rejected or failed one request: `status` is its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
