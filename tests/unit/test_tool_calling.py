"""Tool calling's pieces without a server: the request plan, the prompt, the reply parsers."""

from __future__ import annotations

import json

import msgspec
import pytest

from radix_runtime.frontend.contract import ChoiceState, GenerateChunk
from radix_runtime.frontend.errors import ApiError
from radix_runtime.frontend.rendering import ChatRenderer
from radix_runtime.frontend.schemas import ChatCompletionRequest, decode_request
from radix_runtime.frontend.tools import (
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    ToolDef,
    history_for_template,
    parse_reply,
    plan_tools,
    resolve_parser,
    with_fallback_prompt,
)
from radix_runtime.frontend.validation import chat_messages, check_unsupported_chat_fields
from radix_runtime.tokenizer.chat_template import (
    CHATML_TEMPLATE,
    render_chat,
    supports_tools,
)

WEATHER = ToolDef(
    function=FunctionDef(
        name="get_weather",
        description="Weather in a city",
        parameters={
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    )
)
TIME = ToolDef(function=FunctionDef(name="get_time"))

# a Hermes/Qwen2.5-style template that renders tools itself
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    '{% for c in m.tool_calls or [] %}<tool_call>\n{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}'
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def auto(parser="hermes", parallel=None, tools=(WEATHER, TIME)):
    return plan_tools(list(tools), None, parallel, parser)


def stream_pieces(plan, text, size):
    """Feed ``text`` in pieces of ``size`` characters; the content and calls streamed."""
    parser = plan.new_parser()
    content, calls = "", []
    for i in range(0, len(text), size):
        step = parser.feed(text[i : i + size])
        content += step.content
        calls += step.calls
    step = parser.finish()
    return content + step.content, calls + step.calls


HERMES_REPLIES = [
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>\n"
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}',  # EOS, no close
    "No tools needed: 2 < 3 and <tool is not a tag.\n",
    '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>',
    '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>',  # name last
    # heads that name a function: calls whose arguments are cut where the block breaks
    'Broken <tool_call>{"name": "get_weather", "arguments": {</tool_call> end',
    '<tool_call>{"name": "get_weather", "arguments": {"city": Paris}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Par</tool_call> after',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a \\"{x}\\" </b>"}}\n</tool_call>',
]


@pytest.mark.parametrize("reply", HERMES_REPLIES)
def test_hermes_stream_reassembles_to_the_whole_reply_parse(reply):
    plan = auto()
    content, calls = parse_reply(plan, reply)
    for size in (1, 3, 7, len(reply)):
        s_content, s_calls = stream_pieces(plan, reply, size)
        assert s_content == content
        assert [(c.name, c.arguments) for c in s_calls] == [(c.name, c.arguments) for c in calls]


def test_hermes_parses_calls_and_keeps_the_rest_as_content():
    content, calls = parse_reply(auto(), HERMES_REPLIES[0])
    assert content == "Let me look."
    assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Paris"}),
        (1, "get_time", {}),
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    _, calls = parse_reply(auto(), HERMES_REPLIES[1])
    assert json.loads(calls[0].arguments) == {"city": "Rome", "days": 2}
    for reply in HERMES_REPLIES[2:5]:  # plain text, an unknown function, the name last
        if "Oslo" in reply:  # not streamable: parsed once the block is complete
            content, (call,) = parse_reply(auto(), reply)
            assert content == "" and json.loads(call.arguments) == {"city": "Oslo"}
        else:
            assert parse_reply(auto(), reply) == (reply, [])
    # a block is a call once its head names a function: cut arguments stay cut, the rest of the
    # block is not content (what was streamed is never taken back)
    cut = [parse_reply(auto(), reply) for reply in HERMES_REPLIES[5:8]]
    assert [(content, [c.arguments for c in calls]) for content, calls in cut] == [
        ("Broken end", ["{"]),
        ("", ['{"city": ']),
        (" after", ['{"city": "Par']),
    ]
    content, (call,) = parse_reply(auto(), HERMES_REPLIES[8])  # brackets and tags in strings
    assert content == "" and json.loads(call.arguments) == {"city": 'a "{x}" </b>'}
    # parallel_tool_calls: false keeps the first call
    content, calls = parse_reply(auto(parallel=False), HERMES_REPLIES[0])
    assert [c.name for c in calls] == ["get_weather"]


def test_hermes_holds_back_a_partial_marker_only():
    parser = auto().new_parser()
    assert parser.feed("Hello <tool").content == "Hello"
    assert parser.feed("box> x").content == " <toolbox> x"


LLAMA_REPLIES = [
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
    '{"name": "get_time", "parameters": {}}',
    "The weather is fine.",
    '{"name": "get_weather", "parameters": {"city": ',  # cut off by max_tokens
]


@pytest.mark.parametrize("reply", LLAMA_REPLIES)
def test_llama3_json_stream_reassembles(reply):
    plan = auto("llama3")
    content, calls = parse_reply(plan, reply)
    for size in (1, 4, len(reply)):
        s_content, s_calls = stream_pieces(plan, reply, size)
        assert s_content == content
        assert [(c.name, c.arguments) for c in s_calls] == [(c.name, c.arguments) for c in calls]


def test_llama3_json_calls():
    plan = auto("llama3")
    content, calls = parse_reply(plan, LLAMA_REPLIES[0])
    assert content == "" and json.loads(calls[0].arguments) == {"city": "Oslo"}
    _, calls = parse_reply(plan, LLAMA_REPLIES[1])
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert parse_reply(plan, LLAMA_REPLIES[2]) == (LLAMA_REPLIES[2], [])
    assert parse_reply(plan, LLAMA_REPLIES[3]) == (LLAMA_REPLIES[3], [])


def test_required_and_named_choices_force_a_schema_and_parse_it():
    required = plan_tools([WEATHER, TIME], "required", False, "hermes")
    schema = json.loads(required.json_schema())
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = sorted(alt["properties"]["name"]["enum"][0] for alt in schema["items"]["anyOf"])
    assert names == ["get_time", "get_weather"]
    weather = next(
        a for a in schema["items"]["anyOf"] if a["properties"]["name"]["enum"] == ["get_weather"]
    )
    assert weather["properties"]["parameters"] == WEATHER.function.parameters
    _, calls = parse_reply(required, '[{"name": "get_time", "parameters": {}}]')
    assert [c.name for c in calls] == ["get_time"]

    named = plan_tools(
        [WEATHER, TIME], NamedToolChoice(function=NamedFunction(name="get_weather")), None, "hermes"
    )
    assert json.loads(named.json_schema()) == WEATHER.function.parameters
    _, calls = parse_reply(named, '{"city": "Lima"}')
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Lima"}
    assert auto().json_schema() is None


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        (
            [WEATHER],
            NamedToolChoice(function=NamedFunction(name="nope")),
            "tool_choice.function.name",
        ),
        (None, "required", "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([WEATHER, WEATHER], None, "tools[1].function.name"),
        ([ToolDef(function=FunctionDef(name="bad name!"))], None, "tools[0].function.name"),
        ([ToolDef(type="retrieval", function=FunctionDef(name="f"))], None, "tools[0].type"),
        (
            [ToolDef(function=FunctionDef(name="f", parameters={"type": "string"}))],
            None,
            "tools[0].function.parameters",
        ),
        ([], None, "tools"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(tools, choice, param):
    with pytest.raises(ApiError) as info:
        plan_tools(tools, choice, None, "hermes")
    assert info.value.param == param and info.value.status == 400


def test_tool_choice_none_offers_no_tools():
    assert plan_tools([WEATHER], "none", None, "hermes") is None
    assert plan_tools(None, "none", None, "hermes") is None


def test_parser_choice_from_template_and_flag():
    assert resolve_parser("auto", HERMES_TEMPLATE) == "hermes"
    assert resolve_parser("auto", "{{ '<|python_tag|>' }}{{ tools }}") == "llama3"
    assert resolve_parser("auto", CHATML_TEMPLATE) == "hermes"
    assert resolve_parser("llama3", HERMES_TEMPLATE) == "llama3"
    with pytest.raises(ValueError):
        resolve_parser("mistral", None)


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


def test_template_with_tools_gets_tools_and_call_arguments_as_objects():
    assert supports_tools(HERMES_TEMPLATE) and not supports_tools(CHATML_TEMPLATE)
    plan = auto()
    text = render_chat(
        HERMES_TEMPLATE, history_for_template(HISTORY, True), tools=[dict(t) for t in plan.tools]
    )
    assert '"name": "get_weather", "description": "Weather in a city"' in text
    # arguments rendered as an object (tojson of a dict), not as a quoted string
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<|im_start|>tool\n18 C<|im_end|>" in text


def test_template_without_tools_gets_the_fallback_prompt():
    plan = auto()
    messages = with_fallback_prompt(history_for_template(HISTORY, False), plan)
    text = render_chat(CHATML_TEMPLATE, messages)
    assert text.startswith("<|im_start|>system\nYou can call functions.")
    assert json.dumps(plan.tools[0]) in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in text
    # an existing system message keeps its text first
    merged = with_fallback_prompt([{"role": "system", "content": "Be brief."}], plan)
    assert merged[0]["content"].startswith("Be brief.\n\nYou can call functions.")


def test_request_decoding_and_unsupported_fields():
    body = {
        "messages": HISTORY,
        "tools": [msgspec.to_builtins(WEATHER)],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "user": "u1",
        "metadata": {"k": "v"},
        "store": False,
    }
    req = decode_request(json.dumps(body).encode(), ChatCompletionRequest)
    check_unsupported_chat_fields(req)  # metadata is accepted
    messages = chat_messages(req)
    assert messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert messages[2]["tool_call_id"] == "call_1"
    for field, value in [
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("audio", {"voice": "alloy"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("reasoning_effort", "high"),
    ]:
        req = decode_request(json.dumps({**body, field: value}).encode(), ChatCompletionRequest)
        with pytest.raises(ApiError) as info:
            check_unsupported_chat_fields(req)
        assert info.value.param == field
    bad_tool_msg = {**body, "messages": [{"role": "tool", "content": "x"}]}
    req = decode_request(json.dumps(bad_tool_msg).encode(), ChatCompletionRequest)
    with pytest.raises(ApiError, match="tool_call_id"):
        chat_messages(req)


def _chunk(text, finish=None):
    return GenerateChunk(text=text, finish_reason=finish)


def test_chat_renderer_streams_tool_call_deltas_that_reassemble():
    plan = auto()
    reply = HERMES_REPLIES[0]

    def renderer():
        return ChatRenderer(
            id="x", model="m", n=1, logprobs=False, include_usage=False, token_text=None, tools=plan
        )

    state = ChoiceState(0, "r", [1])
    state.add(_chunk(reply, "stop"))
    whole = renderer().response([state])["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["content"] == "Let me look."

    r, state = renderer(), ChoiceState(0, "r", [1])
    events = []
    pieces = [reply[i : i + 5] for i in range(0, len(reply), 5)]
    for i, piece in enumerate(pieces):
        chunk = _chunk(piece, "stop" if i == len(pieces) - 1 else None)
        state.add(chunk)
        events += r.stream_chunk(state, chunk)
    content, calls, finish = "", {}, None
    for e in events:
        choice = e["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            call["name"] += tc.get("function", {}).get("name", "")
            call["arguments"] += tc.get("function", {}).get("arguments", "")
        finish = choice["finish_reason"] or finish
    assert content == whole["message"]["content"] and finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in whole["message"]["tool_calls"]
    ]


REQUIRED_REPLIES = [
    '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]',
    # cut by max_tokens inside the second call: the first is kept
    '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "param',
    # cut inside the first call's arguments: the call stays, its arguments cut short (OpenAI's
    # finish_reason "length" reply)
    '[{"name": "get_weather", "parameters": {"ci',
    '[{"name": "get_wea',  # cut before the first call's arguments: content
]


@pytest.mark.parametrize("reply", REQUIRED_REPLIES)
def test_required_list_streams_call_by_call(reply):
    plan = plan_tools([WEATHER, TIME], "required", None, "hermes")
    content, calls = parse_reply(plan, reply)
    for size in (1, 5, len(reply)):
        s_content, s_calls = stream_pieces(plan, reply, size)
        assert s_content == content
        assert [(c.name, c.arguments) for c in s_calls] == [(c.name, c.arguments) for c in calls]
    expected = {0: ["get_weather", "get_time"], 1: ["get_weather"], 2: ["get_weather"], 3: []}[
        REQUIRED_REPLIES.index(reply)
    ]
    assert [c.name for c in calls] == expected
    assert content == ("" if expected else reply)
    if REQUIRED_REPLIES.index(reply) == 2:
        assert calls[0].arguments == '{"ci'
    # the first call is out as soon as its arguments start
    if expected:
        parser = plan.new_parser()
        start = reply.index('"parameters": ') + len('"parameters": ') + 1
        assert [c.name for c in parser.feed(reply[:start]).calls] == expected[:1]


def stream_deltas(plan, text, size):
    """The tool_calls deltas of `text` fed in pieces of `size` characters, per feed."""
    parser = plan.new_parser()
    per_feed = [parser.feed(text[i : i + size]).deltas for i in range(0, len(text), size)]
    return per_feed + [parser.finish().deltas], parser.calls


def test_auto_hermes_calls_stream_arguments_as_they_are_generated():
    """tool_choice auto, hermes: a block's call goes out with its head, then each piece of its
    arguments as it arrives; the fragments join to the whole reply's parse."""
    args = '{"city": "Paris \\"the {city} of light\\"", "days": 3}'
    reply = f'Sure.\n<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
    plan = auto()
    content, whole = parse_reply(plan, reply)
    assert content == "Sure." and [(c.name, c.arguments) for c in whole] == [("get_weather", args)]
    per_feed, calls = stream_deltas(plan, reply, 4)
    head, *fragments = [d for feed in per_feed for d in feed]
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert len(fragments) >= len(args) // 4  # a fragment per piece fed, not one at the end
    assert "".join(d["function"]["arguments"] for d in fragments) == args
    first = next(i for i, feed in enumerate(per_feed) if feed)
    assert (first + 1) * 4 < len(reply) - len(args) // 2  # the head before the arguments end


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_stream_arguments_as_they_are_generated(choice):
    """required / a named function: the call's id and name go out as soon as its arguments
    start, then each piece of the arguments as it arrives (OpenAI's stream shape); the
    fragments join to the arguments of the whole reply's parse."""
    tool_choice = NamedToolChoice(function=NamedFunction(name="get_weather"))
    plan = plan_tools(
        [WEATHER, TIME], "required" if choice == "required" else tool_choice, None, "hermes"
    )
    args = '{"city": "Paris \\"the {city} of light\\"", "days": 3}'
    reply = f'[{{"name": "get_weather", "parameters": {args}}}]' if choice == "required" else args
    _, whole = parse_reply(plan, reply)
    assert [(c.name, c.arguments) for c in whole] == [("get_weather", args)]
    json.loads(args)
    per_feed, calls = stream_deltas(plan, reply, 4)
    deltas = [d for feed in per_feed for d in feed]
    head, *fragments = deltas
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert head["id"].startswith("call_") and head["index"] == 0
    assert all(set(d) == {"index", "function"} and d["index"] == 0 for d in fragments)
    assert len(fragments) >= len(args) // 4  # a fragment per piece fed, not one at the end
    assert "".join(d["function"]["arguments"] for d in fragments) == args
    # the head goes out before the arguments are complete
    first = next(i for i, feed in enumerate(per_feed) if feed)
    assert (first + 1) * 4 < len(reply) - len(args) // 2
