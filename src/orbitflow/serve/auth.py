"""Bearer API-key check as plain ASGI middleware (runs before body parsing, and leaves streaming alone).

The key is compared with `hmac.compare_digest`, in time independent of where the first difference lies.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from orbitflow.serve.errors import APIError


class APIKeyMiddleware:
    # /health for load balancers, /metrics for Prometheus (vLLM's key, too, guards the /v1 routes only)
    def __init__(self, app: ASGIApp, api_key: str, open_paths: tuple[str, ...] = ("/health", "/metrics")) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "invalid API key" if given else "missing API key (send 'Authorization: Bearer KEY')"
                error = APIError(401, message, "invalid_request_error", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for a request body over `max_bytes`, whether announced by Content-Length or streamed in chunks.

    The body is read here (up to the limit) and replayed to the app; later messages (the disconnect that
    aborts a request) pass straight through."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                chunks.append(message)  # a disconnect before the body ended: let the app see it
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(message)
            if not message.get("more_body", False):
                break
        body = b"".join(m.get("body", b"") for m in chunks if m["type"] == "http.request")
        replay = [{"type": "http.request", "body": body, "more_body": False}]
        replay += [m for m in chunks if m["type"] != "http.request"]

        async def replayed() -> dict:
            return replay.pop(0) if replay else await receive()

        await self.app(scope, replayed, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"request body is larger than {self.max_bytes} bytes (--max-body-bytes)",
                         code="request_too_large")
        await error.response()(scope, receive, send)
