"""OpenAI-style error bodies and the handlers every service installs."""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("epd.errors")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          409: "conflict_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """An error that reaches the client as {"error": {...}} with this status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 extra: dict[str, Any] | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.extra, self.headers = extra or {}, headers

    def body(self) -> dict[str, Any]:
        err = {"message": self.message, "type": _TYPES.get(self.status, "server_error" if self.status >= 500
               else "invalid_request_error"), "param": self.param, "code": self.code}
        return {"error": {**err, **self.extra}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


_UNION_BRANCHES = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic names union members in loc


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The most specific error (deepest location), with union-branch names dropped from its path."""
    errors = list(exc.errors())
    if not errors:
        return "invalid request", None
    if any(e.get("type") == "json_invalid" for e in errors):
        return "request body is not valid JSON", None
    err = max(errors, key=lambda e: len(e.get("loc", ())))
    loc = [str(p) for p in err.get("loc", ()) if p != "body" and str(p) not in _UNION_BRANCHES and "[" not in str(p)]
    loc = [p for i, p in enumerate(loc) if i == 0 or p != loc[i - 1]]  # a tagged union repeats its tag
    param = ".".join(loc) or None
    msg = str(err.get("msg", "invalid value"))
    return (f"{param}: {msg}" if param else msg), param


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI error JSON, never as FastAPI's {"detail": ...}."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return APIError(400, message, param=param, code="invalid_request").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error").response()
