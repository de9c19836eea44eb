"""Validation of decoded requests against the model's limits: each check raises ``ApiError``
(a 400 naming the offending ``param``) or returns the normalized value.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec

from radix_runtime.frontend.contract import ModelLimits
from radix_runtime.frontend.errors import ApiError
from radix_runtime.frontend.schemas import (
    ChatCompletionRequest,
    NativeGenerateRequest,
    OpenAIRequest,
    ResponseFormat,
    SamplingFields,
)
from radix_runtime.messages import ANY_JSON, JSON_OBJECT_SCHEMA, SamplingParams

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


def cache_salt(req: OpenAIRequest | NativeGenerateRequest) -> str | None:
    """The request's cache salt (``cache_salt`` or its alias ``extra_key``), validated: requests
    share cached KV only with requests of the same salt (frontend/tenancy.py)."""
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


def openai_max_tokens(req: OpenAIRequest, minimum: int = 1) -> tuple[int | None, str]:
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


def choice_sampling(base: SamplingParams, max_new_tokens: int, index: int) -> SamplingParams:
    """The sampling of choice ``index`` of n: its own budget, and a seed offset so seeded choices
    differ from each other yet reproduce."""
    seed = base.seed
    if seed is not None:
        seed = (seed + index) % (MAX_SEED + 1)
    return msgspec.structs.replace(base, max_new_tokens=max_new_tokens, seed=seed)
