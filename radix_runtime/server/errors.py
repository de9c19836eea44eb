"""Every HTTP failure answers with the OpenAI error body (frontend/errors.py).

Client mistakes are 400 (413 for an oversized body, 401 for auth), never FastAPI's 422 and never
a 500; a 500 means a bug on our side and its traceback is logged.
"""

from __future__ import annotations

import logging

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from radix_runtime.frontend.errors import ApiError, GenerationError, error_body

logger = logging.getLogger(__name__)


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> Response:
    body = msgspec.json.encode(error_body(err.message, err.type, err.param, err.code))
    return Response(body, status_code=err.status, media_type="application/json", headers=headers)


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
