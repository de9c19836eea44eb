"""The request bodies the API accepts, as msgspec Structs, and their decoding.

Three request kinds arrive as JSON and are decoded straight into these Structs (a wrong type
becomes a 400 whose ``param`` is the field path):

    POST /v1/chat/completions  -> ChatCompletionRequest
    POST /v1/completions       -> CompletionRequest
    POST /generate             -> NativeGenerateRequest   (SGLang's native API; the DSL and Engine use it)

What the values mean and which are allowed is checked in ``validation``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from radix_runtime.frontend.errors import ApiError, from_msgspec_error
from radix_runtime.frontend.tools import NamedToolChoice, ToolCallIn, ToolDef


class ApiRequest(msgspec.Struct, kw_only=True):
    """Unknown fields are ignored (clients send ``user``, ``metadata``, ...)."""


class SamplingFields(ApiRequest, kw_only=True):
    """Sampling knobs shared by the OpenAI routes (top level) and /generate (``sampling_params``)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    min_tokens: int | None = None
    # constrained decoding (SGLang's names); at most one, and not with response_format
    regex: str | None = None
    json_schema: str | dict[str, Any] | bool | None = None
    ebnf: str | None = None


class StreamOptions(ApiRequest, kw_only=True):
    include_usage: bool = False


class JsonSchemaFormat(ApiRequest, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None


class ResponseFormat(ApiRequest, kw_only=True):
    type: str = "text"
    json_schema: JsonSchemaFormat | None = None


class ContentPart(ApiRequest, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(ApiRequest, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers


class OpenAIRequest(SamplingFields, kw_only=True):
    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # requests share cached KV only with requests of the same salt (vLLM's name; SGLang's
    # extra_key is an alias): see cache_salt()
    cache_salt: str | None = None
    extra_key: str | None = None


class ChatCompletionRequest(OpenAIRequest, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields that change what the model must do and that are not implemented: a 400
    # names them (harmless metadata such as user, metadata, store is ignored)
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None


class CompletionRequest(OpenAIRequest, kw_only=True):
    # a string, a list of token ids, or a list of strings / token-id lists (a batch)
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None  # only best_of == n (or absent): nothing to pick the best by
    response_format: ResponseFormat | None = None


class NativeSamplingParams(SamplingFields, kw_only=True):
    max_new_tokens: int | None = None
    n: int | None = None  # SGLang's parallel sampling: refused unless 1 (send a batch instead)
    min_new_tokens: int | None = None  # SGLang's native name of min_tokens


class NativeGenerateRequest(ApiRequest, kw_only=True):
    text: str | list[Any] | None = None
    input_ids: list[Any] | None = None
    sampling_params: NativeSamplingParams | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    rid: str | list[str] | None = None
    cache_salt: str | None = None
    extra_key: str | None = None
    # SGLang fields that change what the model must do and that are not implemented: a 400
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    lora_path: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    return_hidden_states: bool = False


def decode_request(body: bytes, type_: type) -> Any:
    """JSON bytes -> a request Struct, or ApiError(400). Invalid UTF-8 and lone surrogates are
    malformed JSON to msgspec, so they land here too."""
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        return _decode_with_whole_number_floats(body, type_, exc)
    except msgspec.DecodeError as exc:
        raise ApiError(f"invalid JSON body: {exc}", code="invalid_json") from None
    except RecursionError:
        raise ApiError("invalid JSON body: nested too deeply", code="invalid_json") from None


# objects whose scalar fields are request knobs, as the top level's are
_KNOB_OBJECTS = ("sampling_params", "stream_options")


def _whole_floats_to_ints(obj: dict) -> bool:
    """Rewrite whole-number floats (``4.0``) among the scalar knobs of a decoded request as ints;
    True if any was. Lists (token ids, stop ids) and other nested objects stay as sent."""
    changed = False
    for key, value in obj.items():
        if isinstance(value, float) and value.is_integer():
            obj[key] = int(value)
            changed = True
        elif key in _KNOB_OBJECTS and isinstance(value, dict):
            changed |= _whole_floats_to_ints(value)
    return changed


def _decode_with_whole_number_floats(body: bytes, type_: type, error: Exception) -> Any:
    """The slow path of a body the strict decode refused: OpenAI's and pydantic-based servers
    take ``"max_tokens": 4.0`` for an integer field, so whole-number floats among the request's
    knobs are read as ints and the body decoded again; anything else keeps its 400."""
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        obj = None
    if not isinstance(obj, dict) or not _whole_floats_to_ints(obj):
        raise from_msgspec_error(error) from None
    try:
        return msgspec.convert(obj, type_)
    except msgspec.ValidationError as exc:
        raise from_msgspec_error(exc) from None
