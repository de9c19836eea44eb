"""The OpenAPI schema the server serves at /openapi.json (and renders at /docs, FastAPI's own
Swagger UI): request bodies are the msgspec Structs the routes decode (frontend/schemas.py), so
the schema is what the server accepts; responses are the Structs below, written to the shapes
the renderers return (tests/unit/test_openapi_fuzz.py sends schema-generated requests and checks
every answer against them). `--disable-docs` turns both routes off.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from radix_runtime.frontend.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    NativeGenerateRequest,
)

# ---------------------------------------------------------------------------------------------
# response shapes (fields with a default may be absent)


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    error: ErrorDetail


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int  # prompt tokens read from the cache (this request's namespace only)


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class ToolCallFunction(msgspec.Struct):
    name: str
    arguments: str


class ToolCall(msgspec.Struct):
    id: str
    type: str
    function: ToolCallFunction


class ChatCompletionMessage(msgspec.Struct):
    role: str
    content: str | None
    tool_calls: list[ToolCall] = []


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    matched_stop: int | str | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(msgspec.Struct):
    """With echo, the prompt's tokens come first: the first has a null logprob and null top."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    matched_stop: int | str | None = None


class Completion(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[CompletionChoice]
    usage: Usage


class NativeMetaInfo(msgspec.Struct):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: dict[str, Any] | None
    # with return_logprob: [logprob, token id] pairs (input ones: logprob null at position 0)
    output_token_logprobs: list[list[float | int | None]] = []
    output_top_logprobs: list[list[list[float | int]]] = []
    input_token_logprobs: list[list[float | int | None]] = []
    input_top_logprobs: list[list[list[float | int]] | None] = []


class NativeOutput(msgspec.Struct):
    text: str
    output_ids: list[int]
    meta_info: NativeMetaInfo


REQUESTS = {
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletion),
    "/v1/completions": (CompletionRequest, Completion),
    "/generate": (NativeGenerateRequest, NativeOutput | list[NativeOutput]),
}
ERROR_STATUSES = {
    400: "invalid request",
    401: "missing or wrong API key",
    404: "unknown model",
    413: "request body too large",
    503: "unhealthy or shutting down",
}
_REF = "#/components/schemas/{name}"


def _components() -> tuple[dict[str, dict], dict[str, Any]]:
    """The schema of each request / response type (by route) and the named components."""
    types = [t for pair in REQUESTS.values() for t in pair] + [ErrorResponse]
    schemas, components = msgspec.json.schema_components(types, ref_template=_REF)
    return dict(zip(map(id, types), schemas)), components


def route_openapi(path: str) -> dict:
    """`openapi_extra` for the POST route at `path`: its body and its answers."""
    by_type, _ = _components()
    request_type, response_type = REQUESTS[path]
    error = {"application/json": {"schema": by_type[id(ErrorResponse)]}}
    responses: dict[str, Any] = {
        "200": {
            "description": "the generation (a JSON body, or an SSE stream with stream: true)",
            "content": {
                "application/json": {"schema": by_type[id(response_type)]},
                "text/event-stream": {"schema": {"type": "string"}},
            },
        }
    }
    for status, what in ERROR_STATUSES.items():
        responses[str(status)] = {"description": what, "content": error}
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": by_type[id(request_type)]}},
        },
        "responses": responses,
    }


def install_openapi(app: FastAPI) -> None:
    """Serve the components that the routes' `openapi_extra` refer to."""
    _, components = _components()

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description="OpenAI-compatible and SGLang-native generation (docs/api.md)",
                routes=app.routes,
            )
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
