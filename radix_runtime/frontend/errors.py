"""One error shape for every failure, OpenAI-style:

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

``ApiError`` is a request the front refuses (400 for a client mistake, 413 for an oversized body,
401 for auth, 503 while not serving); ``GenerationError`` is a generation that failed after it
was handed to the ``TokenizerManager``. server/errors.py turns both into HTTP responses; the
offline Engine raises them as ``ValueError``.
"""

from __future__ import annotations

import re

import msgspec

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
