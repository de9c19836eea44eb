"""What a program appends to its state (``s += expr``): text, role turns, ``gen`` and ``select``.

Expressions are plain immutable data; ``ProgramState`` interprets them. ``+`` joins them
(``"Q: " + rr.gen("a")``), and a ``str`` anywhere stands for its literal text.

The constructors keep SGLang's names, argument order and meaning (``gen("name", 64)`` is
``max_tokens=64``), so SGLang programs run unchanged with ``import radix_runtime as sgl``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

ROLES = ("system", "user", "assistant")

# What ``gen(dtype=...)`` constrains the output to (sent to the server as ``regex``). The
# trailing blanks let the model end a number; ``dtype`` gens also stop at the first blank.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

_DTYPE_REGEX = {"int": REGEX_INT, "float": REGEX_FLOAT, "bool": REGEX_BOOL, "str": REGEX_STR}
_DTYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str", "string": "str"}
_NUMBER_STOPS = (" ", "\n")


class Expr:
    """Base of every expression; ``a + b`` concatenates."""

    def __add__(self, other: ExprLike) -> Concat:
        return Concat((self, as_expr(other)))

    def __radd__(self, other: ExprLike) -> Concat:
        return Concat((as_expr(other), self))


ExprLike = Union[Expr, str]


@dataclass(frozen=True, eq=False)
class Text(Expr):
    text: str


@dataclass(frozen=True, eq=False)
class Concat(Expr):
    parts: tuple[Expr, ...]


@dataclass(frozen=True, eq=False)
class Role(Expr):
    """One chat turn: the role's prefix, ``content`` (which may generate), the role's suffix."""

    role: str
    content: Expr


@dataclass(frozen=True, eq=False)
class RoleBegin(Expr):
    """The opening half of a turn (``with s.user():``, ``rr.user_begin()``)."""

    role: str


@dataclass(frozen=True, eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True, eq=False)
class VarScopeBegin(Expr):
    """``with s.var_scope(name):`` stores the text appended inside the block under ``name``."""

    name: str


@dataclass(frozen=True, eq=False)
class VarScopeEnd(Expr):
    name: str


@dataclass(frozen=True, eq=False)
class SetVar(Expr):
    """``s[name] = value``: queued, so it lands in order with the generations before it."""

    name: str
    value: Any


@dataclass(frozen=True)
class GenParams:
    """Sampling for one ``gen``; ``None`` leaves the run's default, then the server's.

    ``dtype`` is one of ``"int" | "float" | "bool" | "str"``; at most one of ``regex``,
    ``json_schema`` (JSON text), ``ebnf`` and ``dtype`` is set."""

    max_tokens: int | None = None
    min_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    dtype: str | None = None
    # not sampling: what /generate returns besides the text
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None

    def merged(self, defaults: GenParams | None) -> GenParams:
        """These settings over ``defaults`` (a run's keyword arguments): set fields win."""
        if defaults is None:
            return self
        changes = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }
        return dataclasses.replace(defaults, **changes)

    def to_sampling_params(self) -> dict[str, Any]:
        """The native ``/generate`` ``sampling_params`` (``max_tokens`` is ``max_new_tokens``;
        ``dtype`` becomes a ``regex``)."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_tokens,
            "min_tokens": self.min_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
            "regex": self.regex,
            "json_schema": self.json_schema,
            "ebnf": self.ebnf,
        }
        if self.dtype is not None:
            out["regex"] = _DTYPE_REGEX[self.dtype]
            if self.dtype in ("int", "float"):
                # a number ends at the first blank the regex lets through
                stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
                out["stop"] = list(dict.fromkeys([*stops, *_NUMBER_STOPS]))
        if out["min_tokens"] == 0:
            out["min_tokens"] = None
        return {k: v for k, v in out.items() if v is not None}

    def request_options(self) -> dict[str, Any]:
        """Top-level ``/generate`` fields: logprobs of the output (and of the prompt)."""
        if not self.return_logprob:
            return {}
        out: dict[str, Any] = {"return_logprob": True}
        if self.top_logprobs_num:
            out["top_logprobs_num"] = self.top_logprobs_num
        if self.logprob_start_len is not None:
            out["logprob_start_len"] = self.logprob_start_len
        return out


@dataclass(frozen=True, eq=False)
class Gen(Expr):
    name: str | None
    params: GenParams


@dataclass(frozen=True, eq=False)
class Select(Expr):
    name: str | None
    choices: tuple[str, ...]


def as_expr(value: ExprLike) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    if value is None:
        raise ValueError("tried to append None to a program state")
    raise TypeError(f"a program can append text or rr expressions, not {type(value).__name__}")


# ---------------------------------------------------------------------------------------------
# constructors (exported as rr.system, rr.user, ...)


def system(content: ExprLike | None = None) -> Role:
    return Role("system", as_expr("" if content is None else content))


def user(content: ExprLike | None = None) -> Role:
    return Role("user", as_expr("" if content is None else content))


def assistant(content: ExprLike | None = None) -> Role:
    return Role("assistant", as_expr("" if content is None else content))


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")


class _ChoicesMethod:
    """How ``select`` ranks its choices. Only SGLang's default (mean log probability per
    token) is implemented; the others are named so that a program using them fails clearly."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"rr.{self.name}"


token_length_normalized = _ChoicesMethod("token_length_normalized")
greedy_token_selection = _ChoicesMethod("greedy_token_selection")
unconditional_likelihood_normalized = _ChoicesMethod("unconditional_likelihood_normalized")


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: Sequence[str] | None = None,
    choices_method: _ChoicesMethod | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
    *,
    ebnf: str | None = None,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    max_new_tokens: int | None = None,
) -> Gen | Select:
    """Generate text from the model and store it under ``name`` (SGLang's argument order).

    ``regex``, ``json_schema`` (JSON text or a dict), ``ebnf`` or ``dtype`` (``int``, ``float``,
    ``bool``, ``str``) constrain the output on the server; ``min_tokens`` holds EOS back; ``n > 1``
    stores a list of ``n`` completions and appends the first. With ``choices`` it is
    :func:`select`. Unset knobs take the run's defaults (``prog.run(temperature=0)``), then the
    server's (``/generate``: temperature 1.0, at most 128 new tokens)."""
    if choices is not None:
        return select(
            name,
            choices,
            temperature=0.0 if temperature is None else temperature,
            choices_method=choices_method or token_length_normalized,
        )
    if stop_regex is not None:
        raise NotImplementedError(
            "gen(stop_regex=...) is not supported by radix_runtime: use stop strings or regex="
        )
    if return_text_in_logprobs:
        raise NotImplementedError(
            "gen(return_text_in_logprobs=True) is not supported by radix_runtime: the logprobs "
            "come as [logprob, token id] pairs"
        )
    if max_new_tokens is not None:
        if max_tokens is not None and max_tokens != max_new_tokens:
            raise ValueError("give max_tokens or max_new_tokens, not both")
        max_tokens = max_new_tokens
    constraints = [
        k
        for k, v in (
            ("regex", regex),
            ("json_schema", json_schema),
            ("ebnf", ebnf),
            ("dtype", dtype),
        )
        if v is not None
    ]
    if len(constraints) > 1:
        raise ValueError(f"gen takes one output constraint, got {' and '.join(constraints)}")
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as exc:
            raise ValueError(f"gen(regex=...) is not a valid regular expression: {exc}") from None
    if isinstance(json_schema, dict):
        json_schema = json.dumps(json_schema)
    elif json_schema is not None:
        try:
            json.loads(json_schema)
        except ValueError as exc:
            raise ValueError(f"gen(json_schema=...) is not valid JSON: {exc}") from None
    if n is not None and n < 1:
        raise ValueError(f"gen(n=...) must be >= 1, got {n}")
    params = GenParams(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        n=n,
        stop=stop,
        stop_token_ids=stop_token_ids,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        repetition_penalty=repetition_penalty,
        ignore_eos=ignore_eos,
        seed=seed,
        regex=regex,
        json_schema=json_schema,
        ebnf=ebnf,
        dtype=_dtype_name(dtype),
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
    )
    return Gen(name, params)


def gen_int(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> Gen:
    """``gen(name, max_tokens, dtype=int, ...)``: an integer."""
    return gen(name, max_tokens, dtype=int, **kwargs)


def gen_string(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> Gen:
    """``gen(name, max_tokens, dtype=str, ...)``: a double-quoted string of word characters
    and blanks."""
    return gen(name, max_tokens, dtype=str, **kwargs)


def _dtype_name(dtype: type | str | None) -> str | None:
    if dtype is None:
        return None
    name = _DTYPE_NAMES.get(dtype, dtype if dtype in _DTYPE_REGEX else None)
    if name is None:
        raise ValueError(f"gen(dtype=...) must be int, float, bool or str, got {dtype!r}")
    return name


def select(
    name: str | None = None,
    choices: Sequence[str] | None = None,
    temperature: float = 0.0,
    choices_method: _ChoicesMethod = token_length_normalized,
) -> Select:
    """Append the choice the model finds most likely (mean log probability per token) and store
    it under ``name``. ``temperature`` is accepted and, as in SGLang, does not change the pick."""
    if choices_method is not token_length_normalized:
        raise NotImplementedError(
            f"select(choices_method={choices_method!r}) is not supported by radix_runtime; "
            "only rr.token_length_normalized (the default) is"
        )
    choices = tuple(choices or ())
    if not choices:
        raise ValueError("select needs at least one choice")
    for c in choices:
        if not isinstance(c, str) or not c:
            raise ValueError(f"select choices must be non-empty strings, got {c!r}")
    return Select(name, choices)


# ---------------------------------------------------------------------------------------------
# what cannot run here


def image(path: Any) -> Expr:
    raise NotImplementedError(
        "rr.image: radix_runtime serves text-only models (no vision model), so a program "
        "cannot append images"
    )


def video(path: Any, num_frames: int = 0) -> Expr:
    raise NotImplementedError(
        "rr.video: radix_runtime serves text-only models (no vision model), so a program "
        "cannot append videos"
    )


def separate_reasoning(expr: Any = None, model_type: str | None = None) -> Expr:
    raise NotImplementedError(
        "rr.separate_reasoning: radix_runtime has no reasoning parser (no reasoning model is "
        "served)"
    )
