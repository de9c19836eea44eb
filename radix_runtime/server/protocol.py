"""What crosses the HTTP boundary: request structs, their validation, and response shaping.

Three request kinds arrive as JSON and are decoded straight into msgspec Structs (a wrong type
becomes a 400 whose ``param`` is the field path):

    POST /v1/chat/completions  -> ChatCompletionRequest
    POST /v1/completions       -> CompletionRequest
    POST /generate             -> NativeGenerateRequest   (SGLang's native API; the DSL uses it)

Each is validated against the model's limits and turned into one ``GenerateInput`` per generation
(n choices x prompts), which the ``TokenizerManager`` runs. The manager answers with a stream of
``GenerateChunk`` increments; a ``ChoiceState`` accumulates them and the ``*_response`` /
``*_stream_chunk`` functions shape the JSON the client sees.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from radix_runtime.messages import ANY_JSON, JSON_OBJECT_SCHEMA, SamplingParams
from radix_runtime.server.errors import ApiError, from_msgspec_error
from radix_runtime.server.tools import NamedToolChoice, ToolCallIn, ToolDef, ToolPlan

# limits on what one request may ask for
MAX_N = 16
MAX_STOP = 16
MAX_TOP_LOGPROBS = 20
MAX_BATCH = 1024  # generations one request may start (prompts x n)
MAX_SEED = 2**63 - 1
NATIVE_DEFAULT_MAX_NEW_TOKENS = 128
MAX_CACHE_SALT_CHARS = 1024
GREEDY_BELOW_TEMPERATURE = 1e-5  # a smaller temperature is greedy (as vLLM and SGLang do)
# a regex / JSON schema / EBNF grammar longer than this is refused (compile time and memory grow
# with it; 32 KiB holds schemas of a few hundred properties)
MAX_GRAMMAR_CHARS = 32768

# ---------------------------------------------------------------------------------------------
# the contract with the TokenizerManager


class GenerateInput(msgspec.Struct, kw_only=True):
    """One generation, fully validated and tokenized, handed to ``TokenizerManager.generate``."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stop: list[str] = []  # stop strings: the manager trims them from the text it returns
    stream: bool = False
    return_logprob: bool = False  # logprob of every output token
    top_logprobs_num: int = 0  # also the top-k alternatives per output token
    # >= 0: also the logprob of every prompt token at positions >= this index; -1: none
    logprob_start_len: int = -1
    skip_special_tokens: bool = True
    # the radix tree namespace it shares cached KV in ("": public); see server/tenancy.py
    cache_namespace: str = ""


class GenerateChunk(msgspec.Struct, kw_only=True):
    """One increment of a generation, yielded by ``TokenizerManager.generate``.

    ``text``/``ids``/``output_logprobs``/``output_top_logprobs`` are deltas (new this chunk);
    ``prompt_tokens``/``completion_tokens``/``cached_tokens`` are totals so far. The last chunk has
    ``finish_reason`` set. ``prompt_logprobs`` arrives once (on the first chunk) and covers the
    *last* ``len(prompt_logprobs)`` prompt positions (position 0 has no logprob, so a request with
    ``logprob_start_len == 0`` gets ``len(input_ids) - 1`` values).
    """

    text: str = ""  # new text, UTF-8 complete, stop strings already trimmed
    ids: list[int] = []  # new output token ids
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_stop: int | str | None = None  # the stop token id or stop string that ended it
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # of cached_tokens, loaded from the host tier (docs/hicache.md)
    output_logprobs: list[float] = []  # one per id in ``ids`` (when return_logprob)
    output_top_logprobs: list[list[tuple[int, float]]] | None = None  # per id: [(id, logprob)]
    prompt_logprobs: list[float] | None = None
    # with top_logprobs_num > 0: the top alternatives of each of those prompt positions
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(frozen=True)
class ModelLimits:
    """What the validators check against."""

    model_name: str
    context_length: int
    vocab_size: int


# ---------------------------------------------------------------------------------------------
# request structs


class _Request(msgspec.Struct, kw_only=True):
    """Unknown fields are ignored (clients send ``user``, ``metadata``, ...)."""


class SamplingFields(_Request, kw_only=True):
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


class StreamOptions(_Request, kw_only=True):
    include_usage: bool = False


class JsonSchemaFormat(_Request, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None


class ResponseFormat(_Request, kw_only=True):
    type: str = "text"
    json_schema: JsonSchemaFormat | None = None


class ContentPart(_Request, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(_Request, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers


class _OpenAIRequest(SamplingFields, kw_only=True):
    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # requests share cached KV only with requests of the same salt (vLLM's name; SGLang's
    # extra_key is an alias): see cache_salt()
    cache_salt: str | None = None
    extra_key: str | None = None


class ChatCompletionRequest(_OpenAIRequest, kw_only=True):
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


UNSUPPORTED_CHAT_FIELDS = (
    ("functions", "use tools"),
    ("function_call", "use tool_choice"),
    ("audio", "this server has no audio output"),
    ("prediction", "predicted outputs are not implemented"),
    ("web_search_options", "there is no web search"),
    ("reasoning_effort", "no reasoning model is served"),
    ("verbosity", "not implemented"),
)


def check_unsupported_chat_fields(req: ChatCompletionRequest) -> None:
    """A field we would otherwise ignore while the client relies on it is a 400 naming it."""
    for name, why in UNSUPPORTED_CHAT_FIELDS:
        if getattr(req, name) is not None:
            raise ApiError(
                f"{name} is not supported ({why})", param=name, code="unsupported_parameter"
            )
    if req.modalities is not None and req.modalities != ["text"]:
        raise ApiError(
            "modalities other than ['text'] are not supported",
            param="modalities",
            code="unsupported_parameter",
        )


class CompletionRequest(_OpenAIRequest, kw_only=True):
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


class NativeGenerateRequest(_Request, kw_only=True):
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


UNSUPPORTED_NATIVE_FIELDS = (
    ("image_data", "this server serves text models"),
    ("audio_data", "this server serves text models"),
    ("video_data", "this server serves text models"),
    ("lora_path", "LoRA adapters are not implemented"),
    ("session_params", "sessions are not implemented"),
    ("custom_logit_processor", "custom logit processors are not implemented"),
)


def check_unsupported_native_fields(req: NativeGenerateRequest) -> None:
    """A /generate field we would otherwise ignore while the client relies on it is a 400."""
    for name, why in UNSUPPORTED_NATIVE_FIELDS:
        if getattr(req, name) is not None:
            raise ApiError(
                f"{name} is not supported ({why})", param=name, code="unsupported_parameter"
            )
    if req.return_hidden_states:
        raise ApiError(
            "return_hidden_states is not supported",
            param="return_hidden_states",
            code="unsupported_parameter",
        )
    sp = req.sampling_params
    if sp is not None and sp.n not in (None, 1):
        raise ApiError(
            "sampling_params.n is not supported: send the prompt n times in a batch",
            param="sampling_params.n",
            code="unsupported_parameter",
        )


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


# ---------------------------------------------------------------------------------------------
# validation


def _p(prefix: str, name: str) -> str:
    return prefix + name


def _check_range(
    value: float,
    name: str,
    lo: float,
    hi: float,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> None:
    ok = math.isfinite(value)
    ok = ok and (value > lo if lo_open else value >= lo)
    ok = ok and (value < hi if hi_open else value <= hi)
    if not ok:
        lb = "(" if lo_open else "["
        rb = ")" if hi_open else "]"
        raise ApiError(f"{name} must be in {lb}{lo}, {hi}{rb}, got {value}", param=name)


def _check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    if ids and min(ids) >= 0 and max(ids) < vocab_size:  # C-speed fast path (long prompts)
        return
    for i, tok in enumerate(ids):
        if not 0 <= tok < vocab_size:
            raise ApiError(
                f"token id {tok} is outside the vocabulary [0, {vocab_size})",
                param=f"{param}[{i}]",
            )


def normalize_stop(stop: str | list[str] | None, param: str = "stop") -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP:
        raise ApiError(f"at most {MAX_STOP} stop sequences are allowed", param=param)
    # an empty stop string would match at once: treat it as absent
    return list(dict.fromkeys(s for s in stops if s))


def sampling_params(
    fields: SamplingFields,
    limits: ModelLimits,
    max_new_tokens: int,
    *,
    prefix: str = "",
    seed_offset: int = 0,
    response_format: ResponseFormat | None = None,
) -> SamplingParams:
    """Validate the shared sampling knobs; ``prefix`` names where they sit (``sampling_params.``)."""
    f = fields
    temperature = 1.0 if f.temperature is None else f.temperature
    _check_range(temperature, _p(prefix, "temperature"), 0.0, 2.0)
    if temperature < GREEDY_BELOW_TEMPERATURE:
        # NOTE: logits / 1e-40 overflows float32: NaN probabilities that always draw token 0
        temperature = 0.0
    top_p = 1.0 if f.top_p is None else f.top_p
    _check_range(top_p, _p(prefix, "top_p"), 0.0, 1.0, lo_open=True)
    top_k = -1 if f.top_k is None else f.top_k
    if top_k == 0 or top_k < -1:
        raise ApiError(f"top_k must be -1 (off) or >= 1, got {top_k}", param=_p(prefix, "top_k"))
    min_p = 0.0 if f.min_p is None else f.min_p
    _check_range(min_p, _p(prefix, "min_p"), 0.0, 1.0)
    freq = 0.0 if f.frequency_penalty is None else f.frequency_penalty
    _check_range(freq, _p(prefix, "frequency_penalty"), -2.0, 2.0)
    pres = 0.0 if f.presence_penalty is None else f.presence_penalty
    _check_range(pres, _p(prefix, "presence_penalty"), -2.0, 2.0)
    rep = 1.0 if f.repetition_penalty is None else f.repetition_penalty
    _check_range(rep, _p(prefix, "repetition_penalty"), 0.0, 2.0, lo_open=True)
    seed = f.seed
    if seed is not None:
        if not 0 <= seed <= MAX_SEED:
            raise ApiError(f"seed must be in [0, 2**63 - 1], got {seed}", param=_p(prefix, "seed"))
        # n choices from one seeded request must differ, yet be reproducible
        seed = (seed + seed_offset) % (MAX_SEED + 1)
    stop_token_ids = list(f.stop_token_ids or [])
    _check_token_ids(stop_token_ids, limits.vocab_size, _p(prefix, "stop_token_ids"))
    logit_bias: dict[int, float] = {}
    for key, bias in (f.logit_bias or {}).items():
        param = _p(prefix, f"logit_bias.{key}")
        try:
            tok = int(key)
        except ValueError:
            raise ApiError(f"logit_bias key {key!r} is not a token id", param=param) from None
        if not 0 <= tok < limits.vocab_size:
            raise ApiError(
                f"logit_bias token id {tok} is outside the vocabulary [0, {limits.vocab_size})",
                param=param,
            )
        _check_range(bias, param, -100.0, 100.0)
        logit_bias[tok] = float(bias)
    min_tokens = f.min_tokens
    if min_tokens is None:
        min_tokens = getattr(f, "min_new_tokens", None) or 0
    if not 0 <= min_tokens <= limits.context_length:
        raise ApiError(
            f"min_tokens must be in [0, {limits.context_length}], got {min_tokens}",
            param=_p(prefix, "min_tokens"),
        )
    grammar = grammar_fields(f, prefix, response_format)
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        min_p=float(min_p),
        seed=seed,
        frequency_penalty=float(freq),
        presence_penalty=float(pres),
        repetition_penalty=float(rep),
        stop_token_ids=stop_token_ids,
        ignore_eos=f.ignore_eos,
        logit_bias=logit_bias,
        min_tokens=min_tokens,
        **grammar,
    )


def grammar_fields(
    f: SamplingFields, prefix: str = "", response_format: ResponseFormat | None = None
) -> dict[str, str]:
    """The one grammar a request asks for, as SamplingParams fields ({} when none): from
    ``regex``, ``json_schema`` (an object, a JSON string, or SGLang's ``"$$ANY$$"``), ``ebnf``
    or OpenAI's ``response_format``. Two at once, a schema that is not JSON, or one longer
    than MAX_GRAMMAR_CHARS is a 400 here; whether it compiles is known when the worker compiles
    it (a failure is a 400 too, before any output)."""
    found: list[tuple[str, str, str]] = []  # (field, text, param)
    if f.regex is not None:
        found.append(("regex", f.regex, _p(prefix, "regex")))
    if f.ebnf is not None:
        found.append(("ebnf", f.ebnf, _p(prefix, "ebnf")))
    if f.json_schema is not None:
        param = _p(prefix, "json_schema")
        found.append(("json_schema", _schema_text(f.json_schema, param), param))
    if response_format is not None:
        text = _response_format_schema(response_format)
        if text is not None:
            found.append(("json_schema", text, "response_format"))
    if len(found) > 1:
        names = " and ".join(param for _, _, param in found)
        raise ApiError(
            f"at most one of regex, json_schema, ebnf and response_format may constrain the "
            f"output; got {names}",
            param=found[1][2],
        )
    if not found:
        return {}
    field, text, param = found[0]
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ApiError(
            f"{field} has {len(text)} characters; the limit is {MAX_GRAMMAR_CHARS}",
            param=param,
            code="grammar_too_large",
        )
    if field != "json_schema" and not text:
        raise ApiError(f"{field} is empty", param=param)
    return {field: text}


def _schema_text(value: str | dict | bool, param: str) -> str:
    """A JSON schema (an object or its JSON text) as JSON text; ANY_JSON passes through."""
    if isinstance(value, str):
        if value == ANY_JSON:
            return value
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ApiError(f"json_schema is not valid JSON: {exc}", param=param) from None
    if not isinstance(value, (dict, bool)):
        raise ApiError("json_schema must be a JSON object (a schema)", param=param)
    return json.dumps(value)  # keeps the order of the properties: the output follows it


def _response_format_schema(rf: ResponseFormat) -> str | None:
    """OpenAI's response_format as a JSON schema text (None for "text")."""
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return JSON_OBJECT_SCHEMA
    if rf.type == "json_schema":
        if rf.json_schema is None:
            raise ApiError(
                "response_format json_schema needs a json_schema object",
                param="response_format.json_schema",
            )
        schema = rf.json_schema.schema
        if schema is None:  # OpenAI makes the schema optional: any JSON object
            return JSON_OBJECT_SCHEMA
        return _schema_text(schema, "response_format.json_schema.schema")
    raise ApiError(
        f"response_format type {rf.type!r} is not supported (text, json_object, json_schema)",
        param="response_format.type",
        code="unsupported_value",
    )


# what SGLang's router puts in a chat request that came without a model
ROUTER_NO_MODEL = "unknown"


def check_model(model: str | None, limits: ModelLimits) -> None:
    if model and model != limits.model_name and model != ROUTER_NO_MODEL:
        raise ApiError(
            f"the model '{model}' does not exist; this server serves '{limits.model_name}'",
            status=404,
            param="model",
            code="model_not_found",
        )


def cache_salt(req: _OpenAIRequest | NativeGenerateRequest) -> str | None:
    """The request's cache salt (``cache_salt`` or its alias ``extra_key``), validated: requests
    share cached KV only with requests of the same salt (server/tenancy.py)."""
    salt, param = req.cache_salt, "cache_salt"
    if req.extra_key is not None:
        if salt is not None and salt != req.extra_key:
            raise ApiError(
                "cache_salt and extra_key name the same salt; give one of them", param="extra_key"
            )
        salt, param = req.extra_key, "extra_key"
    if salt is None:
        return None
    if not salt:
        raise ApiError(f"{param} must be a non-empty string", param=param)
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise ApiError(f"{param} is longer than {MAX_CACHE_SALT_CHARS} characters", param=param)
    return salt


def check_n(n: int, num_prompts: int = 1) -> None:
    if not 1 <= n <= MAX_N:
        raise ApiError(f"n must be in [1, {MAX_N}], got {n}", param="n")
    if n * num_prompts > MAX_BATCH:
        raise ApiError(f"at most {MAX_BATCH} generations per request (prompts x n)", param="n")


def openai_max_tokens(req: _OpenAIRequest, minimum: int = 1) -> tuple[int | None, str]:
    """The requested completion budget and the field it came from (validated >= minimum: 0 for
    an echoed completion, which scores the prompt alone)."""
    value, param = req.max_tokens, "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        value, param = req.max_completion_tokens, "max_completion_tokens"
    if value is not None and value < minimum:
        raise ApiError(f"{param} must be at least {minimum}, got {value}", param=param)
    return value, param


def resolve_max_new_tokens(
    prompt_tokens: int,
    requested: int | None,
    limits: ModelLimits,
    *,
    param: str,
    prompt_param: str,
    default: int | None = None,
) -> int:
    """Fit prompt + output into the context window: an explicit request that does not fit is a 400;
    an omitted one is capped at what is left (and at ``default`` when given)."""
    ctx = limits.context_length
    if requested is not None and requested > ctx:
        raise ApiError(
            f"{param} is too large: {requested}; this model's context length is {ctx} tokens",
            param=param,
        )
    if prompt_tokens >= ctx:
        raise ApiError(
            f"this model's maximum context length is {ctx} tokens, but the prompt has "
            f"{prompt_tokens} tokens",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        room = ctx - prompt_tokens
        return room if default is None else min(default, room)
    if prompt_tokens + requested > ctx:
        raise ApiError(
            f"this model's maximum context length is {ctx} tokens, but {prompt_tokens} prompt "
            f"tokens + {requested} requested completion tokens is {prompt_tokens + requested}",
            param=prompt_param,
            code="context_length_exceeded",
        )
    return requested


# text parts of one message are joined with a newline, as vLLM (and our chat_template) do
PART_SEPARATOR = "\n"
CHAT_ROLES = {"system", "user", "assistant", "tool", "developer", "function"}


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """Flatten OpenAI messages into ``[{"role", "content"}]`` for the chat template."""
    if not req.messages:
        raise ApiError("messages must not be empty", param="messages")
    out = []
    for i, msg in enumerate(req.messages):
        if msg.role not in CHAT_ROLES:
            raise ApiError(f"unknown role {msg.role!r}", param=f"messages[{i}].role")
        content = msg.content
        if msg.tool_calls is not None and msg.role != "assistant":
            raise ApiError("only assistant messages carry tool_calls", param=f"messages[{i}]")
        if msg.role == "tool" and msg.tool_call_id is None:
            raise ApiError(
                "a tool message needs the tool_call_id it answers",
                param=f"messages[{i}].tool_call_id",
            )
        if content is None:
            if msg.role != "assistant":
                raise ApiError("content must not be null", param=f"messages[{i}].content")
            content = ""
        elif not isinstance(content, str):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise ApiError(
                        f"only text content parts are supported, got {part.type!r}",
                        param=f"messages[{i}].content[{j}]",
                    )
                texts.append(part.text)
            content = PART_SEPARATOR.join(texts)
        role = "system" if msg.role == "developer" else msg.role
        entry = {"role": role, "content": content}
        if msg.name is not None:
            entry["name"] = msg.name
        if msg.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": call.type,
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
                for call in msg.tool_calls
            ]
        if msg.tool_call_id is not None:
            entry["tool_call_id"] = msg.tool_call_id
        out.append(entry)
    return out


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _all_ints(value: list) -> bool:
    """Every item an int (not a bool); JSON gives exact ints, checked at C speed first."""
    return set(map(type, value)) == {int} or all(is_int(t) for t in value)


def _token_list(value: list, vocab_size: int, param: str) -> list[int]:
    if not _all_ints(value):
        raise ApiError("a token-id prompt must be a list of integers", param=param)
    if not value:
        raise ApiError("the prompt must not be empty", param=param)
    _check_token_ids(value, vocab_size, param)
    return value


def split_prompts(value: Any, vocab_size: int, param: str) -> list[str | list[int]]:
    """OpenAI ``prompt`` / native ``text``+``input_ids`` -> a list of prompts (text or token ids).

    Accepts a string, a token-id list, or a list of strings / token-id lists.
    """
    if isinstance(value, str):
        prompts: list = [value]
    elif value and _all_ints(value):  # one token-id prompt: already known to be ints
        _check_token_ids(value, vocab_size, param)
        return [value]
    else:
        prompts = list(value)
        if not prompts:
            raise ApiError("the prompt must not be empty", param=param)
    out: list[str | list[int]] = []
    for i, p in enumerate(prompts):
        p_param = param if len(prompts) == 1 and p is value else f"{param}[{i}]"
        if isinstance(p, str):
            if not p:
                raise ApiError("the prompt must not be empty", param=p_param)
            out.append(p)
        elif isinstance(p, list):
            out.append(_token_list(p, vocab_size, p_param))
        else:
            raise ApiError(
                "the prompt must be a string, a list of token ids, or a list of those",
                param=p_param,
            )
    if len(out) > MAX_BATCH:
        raise ApiError(f"at most {MAX_BATCH} prompts per request", param=param)
    return out


# ---------------------------------------------------------------------------------------------
# accumulating a generation's chunks


class ChoiceState:
    """Everything one generation has produced so far."""

    __slots__ = (
        "index",
        "rid",
        "input_ids",
        "text",
        "ids",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "prompt_top_logprobs",
        "finish_reason",
        "matched_stop",
        "completion_tokens",
        "cached_tokens",
        "host_cached_tokens",
    )

    def __init__(self, index: int, rid: str, input_ids: list[int]) -> None:
        self.index = index
        self.rid = rid
        self.input_ids = input_ids
        self.text: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.prompt_logprobs: list[float] | None = None
        self.prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
        self.finish_reason: str | None = None
        self.matched_stop: int | str | None = None
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.host_cached_tokens = 0

    def add(self, chunk: GenerateChunk) -> None:
        if chunk.text:
            self.text.append(chunk.text)
        self.ids.extend(chunk.ids)
        self.logprobs.extend(chunk.output_logprobs)
        if chunk.output_top_logprobs:
            self.top_logprobs.extend(chunk.output_top_logprobs)
        if chunk.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = list(chunk.prompt_logprobs)
            self.prompt_top_logprobs = chunk.prompt_top_logprobs
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.matched_stop = chunk.matched_stop
        self.completion_tokens = max(self.completion_tokens, chunk.completion_tokens, len(self.ids))
        self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)
        self.host_cached_tokens = max(self.host_cached_tokens, chunk.host_cached_tokens)

    @property
    def full_text(self) -> str:
        return "".join(self.text)

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)


def usage(choices: list[ChoiceState], n: int) -> dict:
    """Prompt and cached tokens count once per prompt (the first of its n choices)."""
    prompt = sum(c.prompt_tokens for c in choices if c.index % n == 0)
    cached = sum(c.cached_tokens for c in choices if c.index % n == 0)
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---------------------------------------------------------------------------------------------
# logprobs in the OpenAI shapes


class TokenText:
    """Token id -> its text, memoized per request (top-k lists repeat tokens a lot)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, tok: int) -> str:
        text = self._cache.get(tok)
        if text is None:
            if self._tokenizer is None:  # dummy weights: no vocabulary to show
                text = f"token_id:{tok}"
            else:
                text = self._tokenizer.decode([tok])
            self._cache[tok] = text
        return text


def chat_logprobs(
    ids: list[int],
    logprobs: list[float],
    tops: list[list[tuple[int, float]]],
    token_text: TokenText,
) -> dict:
    content = []
    for i, (tok, lp) in enumerate(zip(ids, logprobs)):
        text = token_text(tok)
        top = tops[i] if i < len(tops) else []
        content.append(
            {
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": (t := token_text(tid)), "logprob": tlp, "bytes": list(t.encode())}
                    for tid, tlp in top
                ],
            }
        )
    return {"content": content}


def completion_logprobs(
    ids: list[int],
    logprobs: list[float],
    tops: list[list[tuple[int, float]]],
    token_text: TokenText,
    text_offset: int = 0,
    with_top: bool = True,
) -> dict:
    tokens, offsets, top_out = [], [], []
    for i, tok in enumerate(ids[: len(logprobs)]):
        text = token_text(tok)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if with_top:
            top = tops[i] if i < len(tops) else []
            top_out.append({token_text(tid): tlp for tid, tlp in top})
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs[: len(tokens)]),
        "top_logprobs": top_out if with_top else None,
        "text_offset": offsets,
    }


# ---------------------------------------------------------------------------------------------
# native /generate output


def _finish_info(state: ChoiceState) -> dict | None:
    reason = state.finish_reason
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": state.completion_tokens}
    if reason == "stop":
        return {"type": "stop", "matched": state.matched_stop}
    return {"type": reason, "matched": state.matched_stop}


def native_output(state: ChoiceState, inp: GenerateInput) -> dict:
    meta: dict[str, Any] = {
        "id": state.rid,
        "prompt_tokens": state.prompt_tokens,
        "completion_tokens": state.completion_tokens,
        "cached_tokens": state.cached_tokens,
        # the prefix's tiers: device_cached_tokens + host_cached_tokens == cached_tokens
        "device_cached_tokens": state.cached_tokens - state.host_cached_tokens,
        "host_cached_tokens": state.host_cached_tokens,
        "finish_reason": _finish_info(state),
    }
    if inp.return_logprob:
        meta["output_token_logprobs"] = [[lp, tok] for lp, tok in zip(state.logprobs, state.ids)]
        if inp.top_logprobs_num > 0:
            meta["output_top_logprobs"] = [
                [[lp, tok] for tok, lp in top] for top in state.top_logprobs
            ]
        if inp.logprob_start_len >= 0:
            meta["input_token_logprobs"] = _input_logprobs(state, inp.logprob_start_len)
            if inp.top_logprobs_num > 0:
                meta["input_top_logprobs"] = _input_top_logprobs(state, inp.logprob_start_len)
    return {"text": state.full_text, "output_ids": list(state.ids), "meta_info": meta}


def _input_logprobs(state: ChoiceState, start: int) -> list[list]:
    """[[logprob | None, id]] for prompt positions >= start; the manager's values cover the last
    len(values) positions (position 0 has none)."""
    ids = state.input_ids
    values = state.prompt_logprobs or []
    first_known = len(ids) - len(values)
    out = []
    for pos in range(start, len(ids)):
        k = pos - first_known
        out.append([values[k] if k >= 0 else None, ids[pos]])
    return out


def _input_top_logprobs(state: ChoiceState, start: int) -> list[list | None]:
    """[[logprob, id] of the top alternatives] (None where unknown) per prompt position >= start,
    aligned like _input_logprobs."""
    ids = state.input_ids
    tops = state.prompt_top_logprobs or []
    first_known = len(ids) - len(tops)
    return [
        [[lp, tok] for tok, lp in tops[pos - first_known]] if pos >= first_known else None
        for pos in range(start, len(ids))
    ]


def choice_sampling(base: SamplingParams, max_new_tokens: int, index: int) -> SamplingParams:
    """The sampling of choice ``index`` of n: its own budget, and a seed offset so seeded choices
    differ from each other yet reproduce."""
    seed = base.seed
    if seed is not None:
        seed = (seed + index) % (MAX_SEED + 1)
    return msgspec.structs.replace(base, max_new_tokens=max_new_tokens, seed=seed)


# ---------------------------------------------------------------------------------------------
# renderers: accumulated state -> the JSON one route answers with
#
# ``response(states)`` is the non-streaming body; ``stream_chunk(state, chunk)`` the SSE payloads
# for one increment; ``stream_end(states)`` those sent after the last increment (before [DONE]).


class ChatRenderer:
    def __init__(
        self,
        *,
        id: str,
        model: str,
        n: int,
        logprobs: bool,
        include_usage: bool,
        token_text: TokenText,
        tools: ToolPlan | None = None,
    ) -> None:
        self.id = id
        self.model = model
        self.created = now()
        self.n = n
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.token_text = token_text
        self.tools = tools
        self._started: set[int] = set()
        self._parsers: dict = {}  # choice index -> its ToolCallParser, when streaming tools

    def _logprobs(self, ids, logprobs, tops) -> dict | None:
        if not self.logprobs:
            return None
        return chat_logprobs(ids, logprobs, tops or [], self.token_text)

    def _message(self, state: ChoiceState) -> tuple[dict, str | None]:
        """The assistant message and finish reason of one choice (tool calls parsed out)."""
        if self.tools is None:
            return {"role": "assistant", "content": state.full_text}, state.finish_reason
        from radix_runtime.server.tools import parse_reply

        content, calls = parse_reply(self.tools, state.full_text)
        if not calls:
            return {"role": "assistant", "content": content}, state.finish_reason
        message = {
            "role": "assistant",
            "content": content or None,
            "tool_calls": [c.message() for c in calls],
        }
        return message, _tool_finish(state.finish_reason)

    def response(self, states: list[ChoiceState]) -> dict:
        choices = []
        for s in states:
            message, finish_reason = self._message(s)
            choices.append(
                {
                    "index": s.index,
                    "message": message,
                    "logprobs": self._logprobs(s.ids, s.logprobs, s.top_logprobs),
                    "finish_reason": finish_reason,
                    "matched_stop": s.matched_stop,
                }
            )
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
            "usage": usage(states, self.n),
        }

    def _chunk(self, choices: list[dict]) -> dict:
        out = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if self.include_usage:
            out["usage"] = None
        return out

    def stream_chunk(self, state: ChoiceState, chunk: GenerateChunk) -> list[dict]:
        out = []
        if state.index not in self._started:
            self._started.add(state.index)
            delta = {"role": "assistant", "content": ""}
            out.append(
                self._chunk(
                    [
                        {
                            "index": state.index,
                            "delta": delta,
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            )
        has_logprobs = self.logprobs and chunk.ids
        text, finish_reason, calls = chunk.text, chunk.finish_reason, []
        if self.tools is not None:
            text, calls, finish_reason = self._tool_step(state, chunk)
        # the finish reason rides on the last content chunk, or follows the tool calls
        final_here = finish_reason is not None and not calls
        if text or has_logprobs or final_here:
            choice = {
                "index": state.index,
                "delta": {"content": text} if text or has_logprobs else {},
                "logprobs": self._logprobs(
                    chunk.ids, chunk.output_logprobs, chunk.output_top_logprobs
                ),
                "finish_reason": finish_reason if final_here else None,
            }
            if final_here:
                choice["matched_stop"] = chunk.matched_stop
            out.append(self._chunk([choice]))
        for call in calls:
            for delta in call.deltas():
                out.append(
                    self._chunk(
                        [
                            {
                                "index": state.index,
                                "delta": {"tool_calls": [delta]},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
                )
        if finish_reason is not None and calls:
            choice = {
                "index": state.index,
                "delta": {},
                "logprobs": None,
                "finish_reason": finish_reason,
                "matched_stop": chunk.matched_stop,
            }
            out.append(self._chunk([choice]))
        return out

    def _tool_step(self, state: ChoiceState, chunk: GenerateChunk) -> tuple[str, list, str | None]:
        parser = self._parsers.get(state.index)
        if parser is None:
            parser = self._parsers[state.index] = self.tools.new_parser()
        step = parser.feed(chunk.text)
        text, calls = step.content, list(step.calls)
        finish_reason = chunk.finish_reason
        if finish_reason is not None:
            last = parser.finish()
            text += last.content
            calls += last.calls
            if parser.calls:
                finish_reason = _tool_finish(finish_reason)
        return text, calls, finish_reason

    def stream_end(self, states: list[ChoiceState]) -> list[dict]:
        if not self.include_usage:
            return []
        last = self._chunk([])
        last["usage"] = usage(states, self.n)
        return [last]


def _tool_finish(reason: str | None) -> str | None:
    """A reply that ended by itself with tool calls finishes with ``tool_calls``."""
    return "tool_calls" if reason == "stop" else reason


class CompletionRenderer:
    """/v1/completions. With ``echo`` (one prompt text per choice in ``echo_prompts``) each
    choice's text starts with its prompt, and with ``logprobs`` its logprobs start with the
    prompt's tokens, the first with a ``null`` logprob (nothing comes before it), as OpenAI and
    vLLM return them: what lm-evaluation-harness's log-likelihood tasks read."""

    def __init__(
        self,
        *,
        id: str,
        model: str,
        n: int,
        logprobs: int | None,
        include_usage: bool,
        token_text: TokenText,
        echo_prompts: list[str] | None = None,
    ) -> None:
        self.id = id
        self.model = model
        self.created = now()
        self.n = n
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.token_text = token_text
        self.echo_prompts = echo_prompts
        self._echoed: set[int] = set()

    def _logprobs(self, ids, logprobs, tops, offset: int) -> dict | None:
        if self.logprobs is None:
            return None
        return completion_logprobs(
            ids, logprobs, tops or [], self.token_text, offset, with_top=self.logprobs > 0
        )

    def _echo(self, state: ChoiceState) -> tuple[str, dict | None]:
        """The prompt's text and (with logprobs) its tokens' logprobs, once per choice."""
        self._echoed.add(state.index)
        text = self.echo_prompts[state.index]
        if self.logprobs is None:
            return text, None
        ids = state.input_ids
        values = state.prompt_logprobs or []
        tops = state.prompt_top_logprobs or []
        # positions 1.. have a logprob (the values cover the last len(values) positions)
        lps: list[float | None] = [None] * (len(ids) - len(values)) + list(values)
        tops_all = [None] * (len(ids) - len(tops)) + list(tops)
        out = completion_logprobs(
            ids, lps, [t or [] for t in tops_all], self.token_text, 0, self.logprobs > 0
        )
        if out["top_logprobs"] is not None:
            out["top_logprobs"] = [
                None if t is None else top for t, top in zip(tops_all, out["top_logprobs"])
            ]
        return text, out

    def _choice_text_and_logprobs(
        self, state: ChoiceState, text: str, ids, lps, tops, gen_offset: int
    ) -> tuple[str, dict | None]:
        """A choice's text and logprobs for generated `text` starting at `gen_offset` of the
        generated text; the echoed prompt goes in front of the choice's first."""
        prefix, prompt_lps = "", None
        if self.echo_prompts is not None and state.index not in self._echoed:
            prefix, prompt_lps = self._echo(state)
        echoed = len(self.echo_prompts[state.index]) if self.echo_prompts is not None else 0
        gen = self._logprobs(ids, lps, tops, echoed + gen_offset)
        if prompt_lps is not None and gen is not None:
            for key in ("tokens", "token_logprobs", "text_offset"):
                gen[key] = prompt_lps[key] + gen[key]
            if gen["top_logprobs"] is not None:
                gen["top_logprobs"] = prompt_lps["top_logprobs"] + gen["top_logprobs"]
        return prefix + text, gen

    def response(self, states: list[ChoiceState]) -> dict:
        choices = []
        for s in states:
            text, logprobs = self._choice_text_and_logprobs(
                s, s.full_text, s.ids, s.logprobs, s.top_logprobs, 0
            )
            choices.append(
                {
                    "index": s.index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": s.finish_reason,
                    "matched_stop": s.matched_stop,
                }
            )
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
            "usage": usage(states, self.n),
        }

    def _chunk(self, choices: list[dict]) -> dict:
        out = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if self.include_usage:
            out["usage"] = None
        return out

    def stream_chunk(self, state: ChoiceState, chunk: GenerateChunk) -> list[dict]:
        has_logprobs = self.logprobs is not None and chunk.ids
        echo = self.echo_prompts is not None and state.index not in self._echoed
        if not (chunk.text or chunk.finish_reason is not None or has_logprobs or echo):
            return []
        offset = len(state.full_text) - len(chunk.text)
        text, logprobs = self._choice_text_and_logprobs(
            state, chunk.text, chunk.ids, chunk.output_logprobs, chunk.output_top_logprobs, offset
        )
        choice = {
            "index": state.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": chunk.finish_reason,
        }
        if chunk.finish_reason is not None:
            choice["matched_stop"] = chunk.matched_stop
        return [self._chunk([choice])]

    def stream_end(self, states: list[ChoiceState]) -> list[dict]:
        if not self.include_usage:
            return []
        last = self._chunk([])
        last["usage"] = usage(states, self.n)
        return [last]


class NativeRenderer:
    """/generate: one ``{"text", "output_ids", "meta_info"}`` per input (a list for a batch);
    streamed events are cumulative, with ``index`` for a batch."""

    def __init__(self, inputs: list[GenerateInput], batch: bool) -> None:
        self.inputs = inputs
        self.batch = batch

    def response(self, states: list[ChoiceState]) -> dict | list[dict]:
        outs = [native_output(s, self.inputs[s.index]) for s in states]
        return outs if self.batch else outs[0]

    def stream_chunk(self, state: ChoiceState, chunk: GenerateChunk) -> list[dict]:
        out = native_output(state, self.inputs[state.index])
        if self.batch:
            out["index"] = state.index
        return [out]

    def stream_end(self, states: list[ChoiceState]) -> list[dict]:
        return []
