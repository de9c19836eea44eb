"""What a program appends to its state (``s += expr``): text, role turns, ``gen`` and ``select``.

Expressions are plain immutable data; ``ProgramState`` interprets them. ``+`` joins them
(``"Q: " + rr.gen("a")``), and a ``str`` anywhere stands for its literal text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

ROLES = ("system", "user", "assistant")


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


@dataclass(frozen=True)
class GenParams:
    """Sampling for one ``gen``; ``None`` leaves the server's default."""

    max_tokens: int | None = None
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

    def to_sampling_params(self) -> dict[str, Any]:
        """The native ``/generate`` ``sampling_params`` (``max_tokens`` is ``max_new_tokens``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["max_new_tokens"] = out.pop("max_tokens")
        return {k: v for k, v in out.items() if v is not None}


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
    raise TypeError(f"a program can append text or rr expressions, not {type(value).__name__}")


# ---------------------------------------------------------------------------------------------
# constructors (exported as rr.system, rr.user, ...)


def system(content: ExprLike = "") -> Role:
    return Role("system", as_expr(content))


def user(content: ExprLike = "") -> Role:
    return Role("user", as_expr(content))


def assistant(content: ExprLike = "") -> Role:
    return Role("assistant", as_expr(content))


def gen(
    name: str | None = None,
    *,
    max_tokens: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    repetition_penalty: float | None = None,
    ignore_eos: bool | None = None,
    seed: int | None = None,
    choices: Sequence[str] | None = None,
) -> Gen | Select:
    """Generate text from the model and store it under ``name``; with ``choices`` it is
    :func:`select`. Unset sampling knobs take the server's defaults (``/generate``: temperature
    1.0, at most 128 new tokens)."""
    if choices is not None:
        return select(name, choices)
    params = GenParams(
        max_tokens=max_tokens,
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
    )
    return Gen(name, params)


def select(name: str | None = None, choices: Sequence[str] = ()) -> Select:
    """Append the choice the model finds most likely (mean log probability per token) and store
    it under ``name``."""
    choices = tuple(choices)
    if not choices:
        raise ValueError("select needs at least one choice")
    for c in choices:
        if not isinstance(c, str) or not c:
            raise ValueError(f"select choices must be non-empty strings, got {c!r}")
    return Select(name, choices)
