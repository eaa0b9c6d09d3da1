"""OpenAI-shaped error bodies, and the exception handlers that make every failure one of them."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from orbitflow.serve.protocol import NO_MEMBER, UnsupportedParameter, main_error

log = logging.getLogger("orbitflow.serve")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def unavailable(message: str, retry_after_s: int = 1) -> APIError:
    """503 with Retry-After: load or shutdown, never a fault of the request."""
    return APIError(503, message, "server_busy", code="server_busy", headers={"Retry-After": str(retry_after_s)})


def validation_error(exc: RequestValidationError, content_type: str | None = None) -> APIError:
    """The error a client should read (``protocol.main_error``), with its location in the body as `param` (e.g.
    "messages.0.role"); ``content_type``: the request's, named when a body that is not JSON is the cause."""
    errors = [{**e, "loc": tuple(e.get("loc", ()))[1:]} if tuple(e.get("loc", ()))[:1] == ("body",) else e
              for e in exc.errors()]
    if not errors:
        return bad_request("invalid request body")
    loc, message, err = main_error(errors)
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, UnsupportedParameter) and message != NO_MEMBER:
        return bad_request(str(cause), param=cause.param)
    if err.get("type") == "json_invalid":
        return bad_request(f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
    if not loc:
        if err.get("type") == "missing":
            return bad_request("a JSON request body is required")
        if content_type and "json" not in content_type.lower():  # `curl -d` sends a form (none: parsed as JSON)
            return bad_request(f"request body: {message} (the body is sent as {content_type}; send JSON with "
                               "'Content-Type: application/json')")
        return bad_request(f"request body: {message}")
    param = ".".join(loc)
    return bad_request(f"{param}: {message}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc, request.headers.get("content-type", "")).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, message, type_, headers=exc.headers).response()  # 405 keeps its Allow

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error serving %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}", "server_error").response()
