"""Tool calling on /v1/chat/completions with the official ``openai`` client, default model."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from radix_runtime.messages import SamplingParams

pytestmark = pytest.mark.slow

HAS_GRAMMAR = "json_schema" in SamplingParams.__struct_fields__
needs_grammar = pytest.mark.skipif(not HAS_GRAMMAR, reason="needs the constrained-decoding runtime")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 20}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


@pytest.fixture(scope="module")
def client(default_server):
    return openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def reassemble(stream) -> tuple[str | None, list[dict], str | None]:
    """Content, tool calls and finish reason of a streamed chat completion."""
    content, calls, finish = None, {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for tc in delta.tool_calls or []:
                call = calls.setdefault(
                    tc.index, {"id": None, "name": "", "arguments": "", "fragments": 0}
                )
                call["id"] = tc.id or call["id"]
                if tc.function is not None:
                    assert tc.function.name or call["name"], "an argument fragment before the name"
                    call["name"] += tc.function.name or ""
                    call["arguments"] += tc.function.arguments or ""
                    call["fragments"] += bool(tc.function.arguments)
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def as_calls(message) -> list[dict]:
    return [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or []
    ]


def _past_call(city: str, i: int) -> dict:
    args = json.dumps({"city": city, "unit": "celsius"})
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": "get_weather", "arguments": args},
            }
        ],
    }


# earlier turns where the assistant called the tool: the 135M model follows the pattern
FEW_SHOT = [
    turn
    for i, city in enumerate(["Paris", "Berlin", "Madrid"])
    for turn in (
        {"role": "user", "content": f"What is the weather in {city}?"},
        _past_call(city, i),
    )
] + [{"role": "user", "content": "What is the weather in Rome?"}]


@pytest.mark.parametrize("messages, max_tokens", [(FEW_SHOT, 48), (ASK, 16)], ids=["calls", "text"])
def test_auto_stream_reassembles_to_the_non_stream_reply(client, model, messages, max_tokens):
    kw = dict(model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=max_tokens)
    whole = client.chat.completions.create(**kw).choices[0]
    content, calls, finish = reassemble(client.chat.completions.create(stream=True, **kw))
    assert content == whole.message.content
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["name"], c["arguments"]) for c in as_calls(whole.message)
    ]
    assert finish == whole.finish_reason
    if messages is FEW_SHOT:  # the model called the tool in the hermes format, in "auto" mode
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        (call,) = as_calls(whole.message)
        assert call["name"] == "get_weather" and json.loads(call["arguments"])["city"] == "Rome"
        # the arguments stream as they are generated, not in one piece when the call is complete
        assert calls[0]["fragments"] > 2, calls


def test_history_with_tool_calls_and_results_is_accepted(client, model):
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    reply = client.chat.completions.create(
        model=model,
        messages=history,
        tools=TOOLS,
        temperature=0,
        max_tokens=4,
        user="u-1",
        metadata={"trace": "abc"},
        store=False,
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"functions": [WEATHER["function"]]}, "functions"),
        ({"extra_body": {"reasoning_effort": "high"}}, "reasoning_effort"),
    ],
)
def test_bad_tool_requests_get_openai_400s(client, model, default_server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=2, **kwargs)
    assert info.value.body["param"] == param
    assert info.value.body["type"] == "invalid_request_error"
    # the server keeps serving
    assert httpx.get(default_server.url + "/health").status_code == 200


@needs_grammar
def test_required_calls_always_validate(client, model):
    import jsonschema

    for seed in range(3):
        reply = client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=64,
        ).choices[0]
        # the schema lets the model add calls until max_tokens cuts it ("length"); the calls it
        # completed are returned either way
        assert reply.finish_reason in ("tool_calls", "length"), reply
        calls = as_calls(reply.message)
        assert calls, reply
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@needs_grammar
def test_named_choice_and_single_call(client, model):
    import jsonschema

    reply = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
        max_tokens=64,
    ).choices[0]
    (call,) = as_calls(reply.message)
    assert call["name"] == "get_time" and reply.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS["get_time"])
    reply = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=96,
    ).choices[0]
    assert len(reply.message.tool_calls) == 1


@needs_grammar
@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_forced_stream_reassembles(client, model, choice):
    kw = dict(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice=choice,
        temperature=0,
        max_tokens=64,
    )
    whole = client.chat.completions.create(**kw).choices[0]
    content, calls, finish = reassemble(client.chat.completions.create(stream=True, **kw))
    assert (content or None) == whole.message.content and finish == whole.finish_reason
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["name"], c["arguments"]) for c in as_calls(whole.message)
    ]
    assert all(c["id"].startswith("call_") for c in calls)
    # the arguments stream as they are generated, not in one piece when the call is complete
    assert all(c["fragments"] > 2 for c in calls), calls


@needs_grammar
def test_a_schema_the_grammar_cannot_compile_and_a_second_constraint_are_400s(client, model):
    bad = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}},
            },
        },
    }
    with pytest.raises(openai.BadRequestError, match="invalid JSON schema"):
        client.chat.completions.create(
            model=model, messages=ASK, tools=[bad], tool_choice="required", max_tokens=4
        )
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
            max_tokens=4,
        )
    assert info.value.body["param"] == "tool_choice"
