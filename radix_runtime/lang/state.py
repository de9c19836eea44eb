"""``ProgramState``: the growing prompt of one program, and the interpreter of its expressions.

``s += expr`` only queues ``expr``; a thread per state runs the queue in order, so the program's
Python keeps going while the model works and the branches of a fork run in parallel. Reading
(``s["name"]``, ``s.text()``, ``s.messages()``) waits for everything queued before it and raises
the first error any of it hit.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from radix_runtime.lang.backend import Backend
from radix_runtime.lang.ir import Concat, Expr, ExprLike, Gen, Role, Select, Text, as_expr

_END = object()  # closes a stream


class ProgramState:
    def __init__(self, backend: Backend, *, stream: bool = False) -> None:
        self.backend = backend
        self.ret_value: Any = None  # what the program function returned
        self._text = ""
        self._vars: dict[str, str] = {}
        self._meta: dict[str, dict] = {}
        self._messages: list[dict[str, str]] = []
        self._open_role: str | None = None
        # executor
        self._cond = threading.Condition()
        self._pending: collections.deque[Expr] = collections.deque()
        self._busy = False
        self._error: BaseException | None = None
        # streaming: (variable name or None, text piece) per piece, then _END or an exception
        self._events: queue.Queue | None = queue.Queue() if stream else None

    # -----------------------------------------------------------------------------------------
    # building

    def __iadd__(self, expr: ExprLike) -> ProgramState:
        expr = as_expr(expr)
        with self._cond:
            if self._error is not None:
                return self  # the program already failed; sync() reports it
            self._pending.append(expr)
            if not self._busy:
                self._busy = True
                threading.Thread(target=self._drain, name="rr-state", daemon=True).start()
        return self

    def fork(self, n: int = 1) -> ForkGroup:
        """``n`` copies that continue independently (and in parallel). The prompt so far is sent
        once first (a zero-token generate), so every branch finds it in the radix tree."""
        if n < 1:
            raise ValueError("fork needs n >= 1")
        self.sync()
        if n > 1 and self._text:
            self.backend.cache_prefix(self._text)
        return ForkGroup(self._copy() for _ in range(n))

    def _copy(self) -> ProgramState:
        child = ProgramState(self.backend)
        child._text = self._text
        child._vars = dict(self._vars)
        child._meta = dict(self._meta)
        child._messages = [dict(m) for m in self._messages]
        child._open_role = self._open_role
        return child

    # -----------------------------------------------------------------------------------------
    # reading (each waits for the queued work)

    def sync(self) -> ProgramState:
        """Wait until everything queued has run; raise the first error it hit."""
        with self._cond:
            while self._busy:
                self._cond.wait()
            if self._error is not None:
                raise self._error
        return self

    def text(self) -> str:
        """The whole prompt so far, role markers included."""
        self.sync()
        return self._text

    def __getitem__(self, name: str) -> str:
        self.sync()
        try:
            return self._vars[name]
        except KeyError:
            raise KeyError(f"no variable {name!r}; have {sorted(self._vars)}") from None

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._vars

    def get_meta_info(self, name: str) -> dict:
        """The server's ``meta_info`` for a ``gen`` (tokens, cached tokens, finish reason), or
        the scores of a ``select``."""
        self.sync()
        return self._meta[name]

    def messages(self) -> list[dict[str, str]]:
        """The role turns so far as ``{"role", "content"}`` dicts (plain text outside a role and
        the template's default system turn are not messages)."""
        self.sync()
        return [dict(m) for m in self._messages]

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text as it is produced (of one variable with ``var_name``). On a state from
        ``run(stream=True)`` the pieces arrive live, once (one reader); otherwise the finished
        text comes as one piece."""
        if self._events is None:
            yield self[var_name] if var_name is not None else self.text()
            return
        while True:
            item = self._events.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            name, piece = item
            if var_name is None or name == var_name:
                yield piece

    async def text_async_iter(self, var_name: str | None = None) -> AsyncIterator[str]:
        """:meth:`text_iter` for asyncio: waits in a worker thread, never blocks the loop."""
        it = self.text_iter(var_name)
        while True:
            piece = await asyncio.to_thread(next, it, _END)
            if piece is _END:
                return
            yield piece

    def __repr__(self) -> str:
        # no sync: a repr must not block or raise; a running state shows its text so far
        return f"ProgramState({self._text!r})"

    # -----------------------------------------------------------------------------------------
    # the executor

    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._pending or self._error is not None:
                    self._pending.clear()
                    self._busy = False
                    self._cond.notify_all()
                    return
                expr = self._pending.popleft()
            try:
                self._execute(expr)
            except BaseException as exc:
                with self._cond:
                    self._error = exc

    def _finish_stream(self, error: BaseException | None = None) -> None:
        """Called by ``run(stream=True)`` once the program function has returned (or failed)."""
        if error is not None:
            with self._cond:
                if self._error is None:
                    self._error = error
        if self._events is not None:
            self._events.put(error if error is not None else _END)

    def _append(self, piece: str, var: str | None = None) -> None:
        if not piece:
            return
        self._text += piece
        if self._events is not None:
            self._events.put((var, piece))

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, Text):
            self._append(expr.text)
        elif isinstance(expr, Concat):
            for part in expr.parts:
                self._execute(part)
        elif isinstance(expr, Role):
            self._execute_role(expr)
        elif isinstance(expr, Gen):
            self._execute_gen(expr)
        elif isinstance(expr, Select):
            self._execute_select(expr)
        else:  # pragma: no cover - as_expr admits nothing else
            raise TypeError(f"unknown expression {expr!r}")

    def _execute_role(self, expr: Role) -> None:
        if self._open_role is not None:
            raise ValueError(f"a {expr.role} turn cannot start inside a {self._open_role} turn")
        markers = self.backend.role_markers()
        prefix, suffix = markers.around(expr.role)
        if not self._messages and not self._text:
            # what the template writes before the first turn, so the prompt is the one the
            # server's chat route renders for the same messages (and shares its cache)
            self._append(markers.begin)
            if expr.role != "system":
                self._append(markers.default_system)
        self._append(prefix)
        start = len(self._text)
        self._open_role = expr.role
        try:
            self._execute(expr.content)
        finally:
            self._open_role = None
        self._messages.append({"role": expr.role, "content": self._text[start:]})
        self._append(suffix)

    def _execute_gen(self, expr: Gen) -> None:
        if self._events is not None:
            result = self.backend.generate(
                self._text, expr.params, on_text=lambda piece: self._append(piece, expr.name)
            )
        else:
            result = self.backend.generate(self._text, expr.params)
            self._append(result.text, expr.name)
        if expr.name is not None:
            self._vars[expr.name] = result.text
            self._meta[expr.name] = result.meta_info

    def _execute_select(self, expr: Select) -> None:
        result = self.backend.select(self._text, expr.choices)
        self._append(result.choice, expr.name)
        if expr.name is not None:
            self._vars[expr.name] = result.choice
            self._meta[expr.name] = result.meta_info


class ForkGroup(list):
    """The states of ``s.fork(n)``: a list, where ``forks += expr`` appends to every branch and
    ``forks.join()`` waits for them all."""

    def __iadd__(self, expr: ExprLike) -> ForkGroup:  # type: ignore[override]
        for state in self:
            state += expr
        return self

    def join(self) -> ForkGroup:
        for state in self:
            state.sync()
        return self
