"""Chat templates: validate OpenAI-style messages and render them with the model's jinja template.

The environment matches transformers' (sandboxed, ``trim_blocks``, ``lstrip_blocks``,
``raise_exception``, a ``tojson`` that does not HTML-escape, ``strftime_now``, the
``{% generation %}`` tag), so templates from the Hub render the same text here.

A model without a template gets :data:`CHATML_TEMPLATE`::

    <|im_start|>{role}\\n{content}<|im_end|>\\n ... <|im_start|>assistant\\n

Every problem with the request (an unknown role, content that is not text, a template that
calls ``raise_exception``) raises ``ValueError`` -- the HTTP layer answers 400.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

VALID_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# text parts of one message are joined with a newline (as vLLM does)
PART_SEPARATOR = "\n"

# ---------------------------------------------------------------------------------------------
# messages


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validated copies of the messages, each ``content`` a plain string."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    return [_normalize_message(i, m) for i, m in enumerate(messages)]


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{index}] must be an object, got {type(message).__name__}")
    role = message.get("role")
    if role not in VALID_ROLES:
        raise ValueError(
            f"messages[{index}].role must be one of {sorted(VALID_ROLES)}, got {role!r}"
        )
    out = dict(message)
    out["content"] = _content_text(index, role, message.get("content"), message)
    return out


def _content_text(index: int, role: str, content: Any, message: Mapping) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        # OpenAI allows a null content on an assistant turn that only calls tools
        if role == "assistant" or message.get("tool_calls"):
            return ""
        raise ValueError(f"messages[{index}].content is missing")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(
                    f"messages[{index}].content[{j}]: only text parts are supported, got {kind!r}"
                )
            if not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{index}].content[{j}].text must be a string")
            texts.append(part["text"])
        return PART_SEPARATOR.join(texts)
    raise ValueError(
        f"messages[{index}].content must be a string or a list of text parts, "
        f"got {type(content).__name__}"
    )


# ---------------------------------------------------------------------------------------------
# rendering


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks;
    serving only needs it to parse, so it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes (<, >, &), which would change what the model sees
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e}") from e


@lru_cache(maxsize=32)
def template_variables(source: str) -> frozenset[str]:
    """The variables a template reads from its context (``messages``, ``tools``, ...)."""
    import jinja2.meta

    env = compile_template(source).environment
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))


def supports_tools(source: str) -> bool:
    """Whether the template renders a ``tools`` list itself (Qwen2.5, Llama 3.1, Hermes...)."""
    return "tools" in template_variables(source)


def render_chat(
    template: str,
    messages: Any,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str | None] | None = None,
    **kwargs: Any,
) -> str:
    """Render validated messages; ``special_tokens`` supplies bos_token, eos_token, ... ."""
    variables: dict[str, Any] = dict(special_tokens or {})
    variables.update(kwargs)
    variables["messages"] = normalize_messages(messages)
    variables["add_generation_prompt"] = add_generation_prompt
    try:
        return compile_template(template).render(**variables)
    except (jinja2.TemplateError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise ValueError(f"chat template: {e}") from e


# ---------------------------------------------------------------------------------------------
# role markers for the frontend DSL

SENTINELS = {
    "system": "RRSENTINELSYSTEMQZ",
    "user": "RRSENTINELUSERQZ",
    "assistant": "RRSENTINELASSISTANTQZ",
    "user2": "RRSENTINELUSERTWOQZ",
}


def derive_role_markers(render: Callable[[list[dict], bool], str], bos_token: str | None) -> dict:
    """Prefix and suffix text around each role's content, found by rendering sentinel contents.

    Returns a dict:
      ``system``, ``user``, ``assistant``: ``(prefix, suffix)`` around a turn's content;
        ``system`` is None when the template has no system turn of its own (it refuses one, or
        folds it into the first user turn);
      ``generation_prompt``: what ``add_generation_prompt`` appends;
      ``begin``: what every conversation starts with (e.g. the BOS text);
      ``default_system``: the whole turn the template inserts when no system message is given.
    Raises ValueError when the template cannot be written as prefixes and suffixes.
    """
    try:
        user, assistant, generation_prompt, text = _turn_markers(render, with_system=True)
        begin, system = _system_markers(text, user[0], bos_token)
    except ValueError:
        user, assistant, generation_prompt, _ = _turn_markers(render, with_system=False)
        begin, system = None, None
    plain = render([_msg("user", SENTINELS["user"])], False)
    before_user = _strip_suffix(plain[: _find(plain, SENTINELS["user"])], user[0])
    if begin is None:
        begin = before_user
    default_system = before_user[len(begin) :] if before_user.startswith(begin) else ""
    return {
        "begin": begin,
        "system": system,
        "user": user,
        "assistant": assistant,
        "generation_prompt": generation_prompt,
        "default_system": default_system,
    }


def _msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def _turn_markers(
    render: Callable[[list[dict], bool], str], with_system: bool
) -> tuple[tuple[str, str], tuple[str, str], str, str]:
    """User and assistant markers from user, assistant, user turns (the second user turn shows a
    user prefix that no first-turn special case touches)."""
    s, u, a, u2 = (SENTINELS[k] for k in ("system", "user", "assistant", "user2"))
    lead = [_msg("system", s)] if with_system else []
    turns = [_msg("user", u), _msg("assistant", a), _msg("user", u2)]
    text = render([*lead, *turns], False)
    if with_system:
        _find(text, s)
    user_suffix = _after(render([*lead, turns[0]], False), u)
    assistant_suffix = _after(render([*lead, *turns[:2]], False), a)
    assistant_prefix = _strip_prefix(_between(text, u, a), user_suffix)
    user_prefix = _strip_prefix(_between(text, a, u2), assistant_suffix)
    without_prompt = render([*lead, turns[0]], False)
    generation_prompt = _strip_prefix(render([*lead, turns[0]], True), without_prompt)
    return (user_prefix, user_suffix), (assistant_prefix, assistant_suffix), generation_prompt, text


def _system_markers(
    text: str, user_prefix: str, bos_token: str | None
) -> tuple[str, tuple[str, str]]:
    """(begin, (system prefix, system suffix)) from a conversation that starts with a system turn.

    Where the system turn starts cannot be seen by rendering (nothing comes before it), so: the
    user prefix with its role name swapped, else the BOS text, else the very start."""
    s, u = SENTINELS["system"], SENTINELS["user"]
    before = text[: _find(text, s)]
    suffix = _strip_suffix(_between(text, s, u), user_prefix)
    guess = user_prefix.replace("user", "system") if user_prefix.count("user") == 1 else None
    if guess and before.endswith(guess):
        begin = before[: len(before) - len(guess)]
    elif bos_token and before.startswith(bos_token) and not user_prefix.startswith(bos_token):
        begin = bos_token
    else:
        begin = ""
    return begin, (before[len(begin) :], suffix)


def _after(text: str, sentinel: str) -> str:
    return text[_find(text, sentinel) + len(sentinel) :]


def _between(text: str, left: str, right: str) -> str:
    start = _find(text, left) + len(left)
    return text[start : _find(text, right)]


def _find(text: str, sentinel: str) -> int:
    i = text.find(sentinel)
    if i < 0:
        raise ValueError("the chat template cannot be expressed as role markers (content dropped)")
    return i


def _strip_prefix(text: str, prefix: str) -> str:
    if not text.startswith(prefix):
        raise ValueError("the chat template cannot be expressed as role markers (turns interleave)")
    return text[len(prefix) :]


def _strip_suffix(text: str, suffix: str) -> str:
    if not text.endswith(suffix):
        raise ValueError("the chat template cannot be expressed as role markers (turns interleave)")
    return text[: len(text) - len(suffix)]
