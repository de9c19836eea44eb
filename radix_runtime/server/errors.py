"""One error shape for every HTTP failure, OpenAI-style.

Every response that is not a success carries

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

Client mistakes are 400 (413 for an oversized body, 401 for auth), never FastAPI's 422 and never
a 500; a 500 means a bug on our side and its traceback is logged.
"""

from __future__ import annotations

import logging
import re

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
SERVER_ERROR = "server_error"


class ApiError(Exception):
    """An error that becomes an HTTP response with the OpenAI error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = "invalid_value",
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or (INVALID_REQUEST if status < 500 else SERVER_ERROR)


class GenerationError(Exception):
    """Raised by ``TokenizerManager.generate`` when a request fails (e.g. the scheduler rejects it
    because it can never fit). ``status`` 4xx means the request itself is at fault."""

    def __init__(self, message: str, code: str | None = None, status: int = 500) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status

    def to_api_error(self) -> ApiError:
        return ApiError(self.message, status=self.status, code=self.code)


def error_body(
    message: str, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> Response:
    body = msgspec.json.encode(error_body(err.message, err.type, err.param, err.code))
    return Response(body, status_code=err.status, media_type="application/json", headers=headers)


# msgspec.ValidationError messages end with " - at `$.messages[0].content`"
_AT_PATH = re.compile(r" - at `\$\.?(.*)`$")
_MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")


def from_msgspec_error(exc: msgspec.ValidationError) -> ApiError:
    """Map a msgspec validation error to a 400 whose ``param`` is the offending field path."""
    text = str(exc)
    param = None
    match = _AT_PATH.search(text)
    if match:
        # msgspec writes a dict key as "[...]": name the dict itself
        param = match.group(1).replace("[...]", "") or None
        text = text[: match.start()]
    missing = _MISSING_FIELD.search(text)
    if missing:
        param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        return ApiError(text, param=param, code="missing_required_parameter")
    return ApiError(text, param=param, code="invalid_type")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return error_response(exc)

    @app.exception_handler(GenerationError)
    async def _generation_error(request: Request, exc: GenerationError) -> Response:
        return error_response(exc.to_api_error())

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        param = None
        message = "invalid request"
        if errors:
            first = errors[0]
            loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
            param = ".".join(loc) or None
            message = str(first.get("msg", message))
        return error_response(ApiError(message, param=param, code="invalid_type"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        codes = {404: "not_found", 405: "method_not_allowed"}
        err = ApiError(str(exc.detail), status=exc.status_code, code=codes.get(exc.status_code))
        return error_response(err, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(ApiError("internal server error", status=500, code="internal_error"))
