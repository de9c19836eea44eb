"""Tool calling on /v1/chat/completions: validating ``tools``/``tool_choice``, rendering them into
the prompt, constraining ``required``/named choices, and parsing the model's output into
``tool_calls`` (see docs/tool_calling.md).

Output formats (the ``--tool-call-parser``):

- ``hermes`` (Qwen2.5, Hermes, and the fallback prompt for templates without tools):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call;
- ``llama3`` (Llama 3.1/3.2 JSON tool calling): the whole reply is
  ``{"name": ..., "parameters": {...}}`` (``;``-separated for several calls);
- ``json`` (internal: ``tool_choice`` ``required`` or a named function): the reply is the JSON
  the grammar forced, a list of ``{"name", "parameters"}`` or the arguments object itself.

One incremental parser serves both streaming and non-streaming responses: a non-streamed reply
is the same parser fed the whole text at once, so the streamed deltas always reassemble to the
non-streamed message. A call's arguments stream as they are generated (its id and name first,
then argument fragments) in the grammar-forced ``json`` format and in ``hermes``: there a
``<tool_call>`` block is a call from the moment its head ``{"name": "<an offered function>",
"arguments": {`` is out; its arguments are the model's text up to the end of that object, cut
where the block closes first or a character JSON does not allow outside a string appears (as a
reply cut by max_tokens is); blocks of any other shape are parsed once complete. In ``llama3``
a call is sent once the reply is complete and valid, since free text may turn out not to be one.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from radix_runtime.frontend.errors import ApiError

PARSERS = ("hermes", "llama3")
PARSER_ALIASES = {"qwen25": "hermes", "qwen": "hermes", "llama3_json": "llama3"}
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
LLAMA_PYTHON_TAG = "<|python_tag|>"

# ---------------------------------------------------------------------------------------------
# request structs (OpenAI's shapes)


class FunctionDef(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: FunctionDef


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: NamedFunction


class ToolCallFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(msgspec.Struct, kw_only=True):
    """A call in an assistant message of the history."""

    id: str | None = None
    type: str = "function"
    function: ToolCallFunction


# ---------------------------------------------------------------------------------------------
# the plan for one request


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for the prompt, the sampler and the output parser.

    ``mode``: ``"auto"`` (the model may call: parse its output), ``"required"`` (at least one
    call, output forced to a JSON list of calls), ``"named"`` (a call of ``forced``, output
    forced to its arguments object)."""

    tools: tuple[dict, ...]  # OpenAI tool dicts, as the chat template receives them
    mode: str
    parser: str  # hermes | llama3 (the reply format in auto mode)
    parallel: bool
    forced: str | None = None

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    def parameters(self, name: str) -> dict:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or {"type": "object", "properties": {}}
        raise KeyError(name)

    def json_schema(self) -> str | None:
        """The JSON schema that forces the reply (``required``/named), as JSON text."""
        if self.mode == "named":
            return json.dumps(self.parameters(self.forced))
        if self.mode != "required":
            return None
        call = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [name]},
                    "parameters": self.parameters(name),
                },
                "required": ["name", "parameters"],
            }
            for name in sorted(self.names)
        ]
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": call[0] if len(call) == 1 else {"anyOf": call},
        }
        if not self.parallel:
            schema["maxItems"] = 1
        return json.dumps(schema)

    def new_parser(self) -> ToolCallParser:
        fmt = "json" if self.mode in ("required", "named") else self.parser
        return ToolCallParser(fmt, self.names, self.parallel, forced=self.forced)


def plan_tools(
    tools: list[ToolDef] | None,
    tool_choice: str | NamedToolChoice | None,
    parallel_tool_calls: bool | None,
    parser: str,
) -> ToolPlan | None:
    """Validate ``tools``/``tool_choice`` (400s name the field); None when the request has no
    tools to offer (none given, or ``tool_choice: "none"``)."""
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise ApiError("tool_choice is only allowed when tools are given", param="tool_choice")
        if tools is not None:
            raise ApiError("tools must not be empty", param="tools")
        return None
    seen: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise ApiError(
                f"tool type {tool.type!r} is not supported; only 'function' is",
                param=f"tools[{i}].type",
                code="unsupported_value",
            )
        name = tool.function.name
        if not TOOL_NAME.match(name):
            raise ApiError(
                f"tool names must match {TOOL_NAME.pattern}, got {name!r}",
                param=f"tools[{i}].function.name",
            )
        if name in seen:
            raise ApiError(f"duplicate tool name {name!r}", param=f"tools[{i}].function.name")
        seen.add(name)
        params = tool.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise ApiError(
                "a function's parameters must be a JSON schema of type 'object'",
                param=f"tools[{i}].function.parameters",
            )
        function: dict[str, Any] = {"name": name}
        if tool.function.description is not None:
            function["description"] = tool.function.description
        function["parameters"] = (
            params
            if params is not None
            else {
                "type": "object",
                "properties": {},
            }
        )
        out.append({"type": "function", "function": function})
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if tool_choice is None or tool_choice == "auto":
        mode, forced = "auto", None
    elif tool_choice == "none":
        return None
    elif tool_choice == "required":
        mode, forced = "required", None
    elif isinstance(tool_choice, NamedToolChoice):
        if tool_choice.type != "function":
            raise ApiError(
                f"tool_choice type {tool_choice.type!r} is not supported; only 'function' is",
                param="tool_choice.type",
            )
        forced = tool_choice.function.name
        if forced not in seen:
            raise ApiError(
                f"tool_choice names the function {forced!r}, which is not among the tools "
                f"({', '.join(sorted(seen))})",
                param="tool_choice.function.name",
                code="invalid_tool_choice",
            )
        mode = "named"
    else:
        raise ApiError(
            f"tool_choice must be 'none', 'auto', 'required' or a named function, got "
            f"{tool_choice!r}",
            param="tool_choice",
        )
    return ToolPlan(tuple(out), mode, parser, parallel, forced)


def resolve_parser(flag: str, template: str | None) -> str:
    """The reply format of ``tool_choice: "auto"``: the flag, or (``auto``) from the template:
    Llama 3.1's ``<|python_tag|>``/``ipython`` template gives ``llama3``; anything else ``hermes``
    (Qwen2.5 and Hermes templates, and the fallback prompt of templates without tools)."""
    flag = PARSER_ALIASES.get(flag, flag)
    if flag in PARSERS:
        return flag
    if flag != "auto":
        raise ValueError(f"unknown --tool-call-parser {flag!r}; choose auto, {', '.join(PARSERS)}")
    source = template or ""
    if HERMES_OPEN in source:
        return "hermes"
    if LLAMA_PYTHON_TAG in source or "ipython" in source:
        return "llama3"
    return "hermes"


# ---------------------------------------------------------------------------------------------
# the prompt

FALLBACK_INSTRUCTIONS = (
    "You can call functions. Their JSON schemas:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, reply with one block per call, each a JSON object with the function "
    "name and its arguments:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n</tool_call>'
)


def history_for_template(messages: list[dict], template_has_tools: bool) -> list[dict]:
    """Messages as a chat template expects them: a call's ``arguments`` as a dict (templates
    write them with ``tojson``). A template without tool support gets the calls and results as
    text, in the hermes format the fallback prompt teaches."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            calls = [_template_call(c) for c in calls]
            if template_has_tools:
                m["tool_calls"] = calls
            else:
                del m["tool_calls"]
                blocks = [
                    f"{HERMES_OPEN}\n"
                    + json.dumps(
                        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                    )
                    + f"\n{HERMES_CLOSE}"
                    for c in calls
                ]
                m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
        if m["role"] == "tool" and not template_has_tools:
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    return out


def _template_call(call: dict) -> dict:
    fn = dict(call["function"])
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args) if args.strip() else {}
        except ValueError:
            pass  # keep the text; the template writes what it was given
    return {"id": call.get("id"), "type": "function", "function": fn}


def with_fallback_prompt(messages: list[dict], plan: ToolPlan) -> list[dict]:
    """The tools as a system prompt, for templates that take no ``tools``: prepended to the
    conversation's system message, or a new first system message."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools)
    text = FALLBACK_INSTRUCTIONS.format(tools=listing)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{text}" if first["content"] else text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# ---------------------------------------------------------------------------------------------
# parsing the reply


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON text

    def message(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def deltas(self) -> list[dict]:
        """The OpenAI stream shape: the call's id and name, then its arguments (none yet for a
        call whose arguments stream)."""
        head = {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": ""},
        }
        if not self.arguments:
            return [head]
        return [head, {"index": self.index, "function": {"arguments": self.arguments}}]


@dataclass
class ParseStep:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)  # calls started in this step
    # OpenAI `tool_calls` stream deltas, in order: a call's id and name, then argument fragments
    deltas: list[dict] = field(default_factory=list)


# required: an item of the forced list up to its arguments object (hermes: a block's start)
_LIST_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=\{)'
)


# what a JSON value may hold outside its strings (true, false, null and numbers)
_JSON_OUTSIDE_STRINGS = frozenset(" \t\n\r{}[],:-+.0123456789eEtrufalsn")


class _ObjectScan:
    """Where a JSON object starting at `pos` of a growing text ends (brackets outside strings).
    `strict`: it also ends (`cut`) before a character JSON does not allow outside a string
    (free text: the model's object may be malformed)."""

    def __init__(self, pos: int, strict: bool = False) -> None:
        self.pos = pos
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False
        self.strict = strict
        self.cut = False

    def advance(self, text: str, limit: int | None = None) -> int:
        """Scan what `text` added (up to `limit`); the position scanned to (the object's end
        once done)."""
        i = self.pos
        end = len(text) if limit is None else limit
        while i < end and not self.done:
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                self.done = self.depth == 0
            elif self.strict and c not in _JSON_OUTSIDE_STRINGS:
                self.done = self.cut = True
                break
            i += 1
        self.pos = i
        return i


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """Splits a reply, fed in pieces, into content and tool calls.

    ``feed(text)`` and ``finish()`` return what is new: content that can be shown now and calls
    that are complete. Content that might still turn out to start a call is held back (a partial
    ``<tool_call>``; blanks before a call), so what was shown is never taken back. A block that
    is not a valid call of an offered function stays content, exactly as the model wrote it."""

    def __init__(
        self, fmt: str, names: frozenset[str], parallel: bool, forced: str | None = None
    ) -> None:
        self.fmt = fmt
        self.names = names
        self.parallel = parallel
        self.forced = forced
        self.calls: list[ToolCall] = []
        self._buf = ""  # text not yet classified
        self._in_block = False
        self._blank = ""  # blanks held until we know whether a call follows
        self._whole: bool | None = None  # llama3: is the whole reply a call (None: undecided)
        self._list_pos = 0  # json list: where the next item starts
        self._opened = False
        self._list_broken = False
        # the call whose arguments are streaming (required / named: the grammar guarantees them)
        self._streaming: tuple[ToolCall | None, _ObjectScan] | None = None
        self._args_end: int | None = None  # hermes: where the streamed call's arguments ended
        self._forced_state = "start"  # named: start | args | done | content

    # --- public

    def feed(self, text: str) -> ParseStep:
        self._buf += text
        if self.fmt == "hermes":
            return self._hermes(final=False)
        if self.fmt == "json":
            return self._json_list(final=False) if self.forced is None else self._named(False)
        return self._whole_reply(final=False)

    def finish(self) -> ParseStep:
        if self.fmt == "hermes":
            return self._hermes(final=True)
        if self.fmt == "json":
            return self._json_list(final=True) if self.forced is None else self._named(True)
        return self._whole_reply(final=True)

    # --- arguments streamed as they are generated (the grammar-forced formats)

    def _start_streaming(self, step: ParseStep, name: str, pos: int, strict: bool = False) -> None:
        call = ToolCall(len(self.calls), new_call_id(), name, "")
        self._streaming = (call if self._add(step, call) else None, _ObjectScan(pos, strict))

    def _stream_arguments(self, step: ParseStep, limit: int | None = None) -> int | None:
        """Send the arguments text that arrived (up to `limit`); where the arguments object
        ends once it is complete, else None."""
        call, scan = self._streaming
        start = scan.pos
        end = scan.advance(self._buf, limit)
        if call is not None and end > start:
            fragment = self._buf[start:end]
            call.arguments += fragment
            step.deltas.append({"index": call.index, "function": {"arguments": fragment}})
        if not scan.done:
            return None
        self._streaming = None
        return end

    # --- named function: the reply is its arguments object

    def _named(self, final: bool) -> ParseStep:
        """The call is out with the reply's first character, its arguments as they arrive. A
        reply cut by max_tokens keeps its call with the arguments cut short (as OpenAI's)."""
        step = ParseStep()
        if self._forced_state == "start":
            head = self._buf.lstrip()
            if head.startswith("{"):
                self._forced_state = "args"
                self._start_streaming(step, self.forced, len(self._buf) - len(head))
            elif head or final:  # not an object (the grammar forces one): content
                self._forced_state = "content"
        if self._forced_state == "args" and self._stream_arguments(step) is not None:
            self._forced_state = "done"  # what follows the object (blanks) is not part of it
        if self._forced_state == "content":
            step.content, self._buf = self._buf, ""
        return step

    # --- json list (tool_choice "required"): [{"name", "parameters"}, ...], a call per item

    def _json_list(self, final: bool) -> ParseStep:
        """Each item is a call as soon as its name is known, its arguments streamed as they
        arrive (the grammar forces the list's shape); a reply cut by max_tokens keeps the calls
        it started, the last one's arguments cut short. A reply with no call started is
        content (under the schema only a cut before the first arguments object does that)."""
        step = ParseStep()
        decoder = json.JSONDecoder()
        while not self._list_broken:
            if self._streaming is not None:
                end = self._stream_arguments(step)
                if end is None:
                    break  # wait for more of the arguments
                self._list_pos = end
            pos = self._list_pos
            while pos < len(self._buf) and (self._buf[pos].isspace() or self._buf[pos] in "[,]}"):
                if self._buf[pos] == "[":
                    self._opened = True
                pos += 1
            self._list_pos = pos
            if not self._opened or pos >= len(self._buf):
                break
            head = _LIST_HEAD.match(self._buf, pos)
            if head is not None and json.loads(f'"{head.group(1)}"') in self.names:
                self._start_streaming(step, json.loads(f'"{head.group(1)}"'), head.end())
                continue
            try:
                item, end = decoder.raw_decode(self._buf, pos)
            except ValueError:
                break  # incomplete: wait for more
            self._list_pos = end
            parsed = self._name_and_args(item)
            if parsed is None:
                self._list_broken = True  # not a call of a tool: the rest is not parsed
            else:
                self._add(step, self._make_call(*parsed))
        if final and not self.calls:
            step.content = self._buf
        return step

    # --- hermes: <tool_call>{...}</tool_call> blocks anywhere in the reply

    def _hermes(self, final: bool) -> ParseStep:
        step = ParseStep()
        while True:
            if self._in_block and self._streaming is None and self._args_end is None:
                self._hermes_head(step)
            if self._in_block and self._streaming is not None:
                close = self._buf.find(HERMES_CLOSE)
                if close >= 0:  # the block ends there, whatever the arguments' brackets say
                    limit = close
                elif final:
                    limit = len(self._buf)
                else:  # what may be the start of `</tool_call>` waits for the next piece
                    limit = len(self._buf) - _partial_suffix(self._buf, HERMES_CLOSE)
                end = self._stream_arguments(step, limit)
                if end is None:
                    if close < 0 and not final:
                        return step
                    self._streaming, end = None, limit  # cut by the block's or the reply's end
                self._args_end = end
            if self._in_block and self._args_end is not None:
                # the rest of a streamed call's block (its closing brace) is not content
                close = self._buf.find(HERMES_CLOSE, self._args_end)
                if close < 0 and not final:
                    return step
                self._buf = "" if close < 0 else self._buf[close + len(HERMES_CLOSE) :]
                self._in_block, self._args_end = False, None
                if close < 0:
                    return self._flush_final(step)
                continue
            if self._in_block:
                end = self._buf.find(HERMES_CLOSE)
                if end < 0 and not final:
                    return step
                body = self._buf if end < 0 else self._buf[:end]
                raw = HERMES_OPEN + (self._buf if end < 0 else self._buf[: end + len(HERMES_CLOSE)])
                self._buf = "" if end < 0 else self._buf[end + len(HERMES_CLOSE) :]
                self._in_block = False
                call = self._call_from(body)
                if call is not None:
                    self._blank = ""  # blanks between calls are not content
                    self._add(step, call)
                else:
                    self._content(step, raw)
                if end < 0:
                    return self._flush_final(step)
                continue
            start = self._buf.find(HERMES_OPEN)
            if start >= 0:
                self._content(step, self._buf[:start], hold_blank=True)
                self._buf = self._buf[start + len(HERMES_OPEN) :]
                self._in_block = True
                continue
            if final:
                self._content(step, self._buf, hold_blank=True)
                self._buf = ""
                return self._flush_final(step)
            keep = _partial_suffix(self._buf, HERMES_OPEN)
            self._content(step, self._buf[: len(self._buf) - keep], hold_blank=True)
            self._buf = self._buf[len(self._buf) - keep :]
            return step

    def _hermes_head(self, step: ParseStep) -> None:
        """Start streaming the block's call once its head names an offered function and its
        arguments object opens (other shapes wait for the block's end)."""
        head = _LIST_HEAD.match(self._buf, len(self._buf) - len(self._buf.lstrip()))
        if head is None:
            return
        name = _loads(f'"{head.group(1)}"')
        close = self._buf.find(HERMES_CLOSE)
        if name not in self.names or 0 <= close < head.end():
            return
        self._blank = ""  # blanks before a call are not content
        self._start_streaming(step, name, head.end(), strict=True)

    def _content(self, step: ParseStep, text: str, hold_blank: bool = False) -> None:
        if not text:
            return
        if hold_blank:
            stripped = text.rstrip()
            if not stripped:
                self._blank += text
                return
            text, tail = stripped, text[len(stripped) :]
            step.content += self._blank + text
            self._blank = tail
            return
        step.content += self._blank + text
        self._blank = ""

    def _flush_final(self, step: ParseStep) -> ParseStep:
        # trailing blanks after a call are dropped; in a reply without calls they are content
        if self._blank and not self.calls:
            step.content += self._blank
        self._blank = ""
        return step

    # --- llama3 / json: the whole reply is the call(s), or plain content

    def _whole_reply(self, final: bool) -> ParseStep:
        step = ParseStep()
        if self._whole is None:
            head = self._buf.lstrip()
            if self.fmt == "llama3" and head.startswith(LLAMA_PYTHON_TAG):
                head = head[len(LLAMA_PYTHON_TAG) :].lstrip()
            undecided = not head or (self.fmt == "llama3" and LLAMA_PYTHON_TAG.startswith(head))
            if self.fmt == "json":
                self._whole = True
            elif undecided and not final:
                return step
            else:
                self._whole = head.startswith("{")
        if not self._whole:
            step.content, self._buf = self._buf, ""
            return step
        if not final:
            return step
        text, self._buf = self._buf, ""
        calls = self._whole_calls(text)
        if calls is None:
            step.content = text
            return step
        for name, args in calls:
            self._add(step, self._make_call(name, args))
        return step

    def _whole_calls(self, text: str) -> list[tuple[str, Any]] | None:
        body = text.strip()
        if body.startswith(LLAMA_PYTHON_TAG):
            body = body[len(LLAMA_PYTHON_TAG) :]
        if self.fmt == "json" and self.forced is not None:
            value = _loads(body)
            return [(self.forced, value)] if isinstance(value, dict) else None
        if self.fmt == "json":
            value = _loads(body)
            if not isinstance(value, list) or not value:
                return None
            items = value
        else:
            items = _json_sequence(body)
            if items is None:
                return None
        calls = []
        for item in items:
            parsed = self._name_and_args(item)
            if parsed is None:
                return None
            calls.append(parsed)
        return calls

    # --- shared

    def _call_from(self, body: str) -> ToolCall | None:
        parsed = self._name_and_args(_loads(body.strip()))
        return None if parsed is None else self._make_call(*parsed)

    def _name_and_args(self, value: Any) -> tuple[str, Any] | None:
        if not isinstance(value, dict):
            return None
        name = value.get("name")
        args = value.get("arguments", value.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as JSON text
            args = _loads(args)
        if not isinstance(name, str) or name not in self.names or not isinstance(args, dict):
            return None
        return name, args

    def _make_call(self, name: str, args: Any) -> ToolCall:
        arguments = json.dumps(args, ensure_ascii=False)
        return ToolCall(len(self.calls), new_call_id(), name, arguments)

    def _add(self, step: ParseStep, call: ToolCall) -> bool:
        """Record a call (complete, or started with empty arguments); False when dropped."""
        if self.calls and not self.parallel:
            return False  # parallel_tool_calls: false keeps the first call only
        call.index = len(self.calls)
        self.calls.append(call)
        step.calls.append(call)
        step.deltas.extend(call.deltas())
        return True


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _json_sequence(text: str) -> list[Any] | None:
    """``{...}`` or ``{...}; {...}`` (Llama's several calls), nothing else."""
    decoder = json.JSONDecoder()
    items, pos = [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or (items and text[pos] == ";")):
            pos += 1
        if pos >= len(text):
            return items or None
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        items.append(value)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def parse_reply(plan: ToolPlan, text: str) -> tuple[str, list[ToolCall]]:
    """A whole reply -> (content, calls), by the same parser the stream uses."""
    parser = plan.new_parser()
    first, last = parser.feed(text), parser.finish()
    return first.content + last.content, parser.calls
