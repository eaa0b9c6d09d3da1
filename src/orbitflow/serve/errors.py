"""OpenAI-shaped error bodies, and the exception handlers that make every failure one of them."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from orbitflow.serve.protocol import UnsupportedParameter

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


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error, with its location in the body as `param` (e.g. "messages.0.role"). A value that
    fits no member of a union gets one error per member; the first that is not a plain type mismatch names the
    member the value was meant as (a token id below 0 in a list of ids, not "should be a string"); when every
    member's error is a type mismatch, the message says the value has none of the union's types."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    err = next((e for e in errors if not _mismatch(e.get("type", ""))), None)
    if err is None and len(errors) > 1:
        union = _common_prefix([_param_loc(e) for e in errors])
        if union:
            param = ".".join(union)
            return bad_request(f"{param}: has none of the types it accepts (see /openapi.json)", param=param)
    err = err or errors[0]
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, UnsupportedParameter):
        return bad_request(str(cause), param=cause.param)
    loc = _param_loc(err)
    if err.get("type") == "json_invalid":
        return bad_request(f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
    if not loc:
        if err.get("type") == "missing":
            return bad_request("a JSON request body is required")
        return bad_request(f"request body: {_message(err)}")
    param = ".".join(loc)
    return bad_request(f"{param}: {_message(err)}", param=param)


def _param_loc(err: dict) -> list[str]:
    """The error's location in the body, without pydantic's union member tags."""
    loc = [str(part) for part in err.get("loc", ()) if not _is_union_tag(part)]
    return loc[1:] if loc[:1] == ["body"] else loc


def _common_prefix(locs: list[list[str]]) -> list[str]:
    out: list[str] = []
    for parts in zip(*locs):
        if len(set(parts)) > 1:
            break
        out.append(parts[0])
    return out


def _mismatch(kind: str) -> bool:
    """A pydantic error type that says "not this type" (one per member of a union the value is not)."""
    return kind.endswith(("_type", "_parsing"))


def _message(err: dict) -> str:
    """pydantic's message without its "Value error, " prefix (our validators' messages stand alone)."""
    msg = str(err.get("msg", ""))
    return msg.removeprefix("Value error, ")


def _is_union_tag(part: str | int) -> bool:
    """pydantic puts the member of a union it tried into `loc` ("str", "list[int]", "TextPart", ...)."""
    if isinstance(part, int):
        return False
    return not part.isidentifier() or part in ("str", "int", "float", "bool") or part[0].isupper()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, message, type_, headers=exc.headers).response()  # 405 keeps its Allow

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error serving %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}", "server_error").response()
