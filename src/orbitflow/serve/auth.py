"""Bearer API-key check as plain ASGI middleware (runs before body parsing, and leaves streaming alone)."""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from orbitflow.serve.errors import APIError


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, open_paths: tuple[str, ...] = ("/health",)) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                message = "invalid API key" if given else "missing API key (send 'Authorization: Bearer KEY')"
                error = APIError(401, message, "invalid_request_error", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
