"""``ProgramState``: the growing prompt of one program, and the interpreter of its expressions.

``s += expr`` only queues ``expr``; a thread per state runs the queue in order, so the program's
Python keeps going while the model works and the branches of a fork run in parallel. Reading
(``s["name"]``, ``s.text()``, ``s.messages()``) waits for everything queued before it and raises
the first error any of it hit.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from radix_runtime.lang.backend import Backend
from radix_runtime.lang.ir import (
    Concat,
    Expr,
    ExprLike,
    Gen,
    GenParams,
    Role,
    RoleBegin,
    RoleEnd,
    Select,
    SetVar,
    Text,
    VarScopeBegin,
    VarScopeEnd,
    as_expr,
)

_END = object()  # closes a stream


@dataclass(frozen=True, eq=False)
class _Join(Expr):
    """Queued on the parent by ``ForkGroup.join``: runs once every branch has finished."""

    branches: tuple[ProgramState, ...]
    mode: str


class ProgramState:
    def __init__(
        self,
        backend: Backend,
        *,
        stream: bool = False,
        default_params: GenParams | None = None,
    ) -> None:
        self.backend = backend
        self.default_params = default_params  # a run's sampling keyword arguments
        self.ret_value: Any = None  # what the program function returned
        self.position_ids_offset: list[int] | None = None  # set on fork branches
        self._text = ""
        self._vars: dict[str, Any] = {}
        self._meta: dict[str, Any] = {}
        self._messages: list[dict[str, str]] = []
        self._open_role: str | None = None
        self._role_start = 0
        self._scopes: dict[str, int] = {}
        self._fork_start = 0  # where this branch's own text starts (0: not a branch)
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

    def _role(self, role: str, expr: ExprLike | None) -> Any:
        if expr is not None:
            self += Role(role, as_expr(expr))
            return None
        return self._role_scope(role)

    @contextlib.contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self += RoleBegin(role)
        yield
        self += RoleEnd(role)

    def system(self, expr: ExprLike | None = None) -> Any:
        """``s.system(x)`` appends a system turn; ``with s.system(): ...`` wraps what the block
        appends in one."""
        return self._role("system", expr)

    def user(self, expr: ExprLike | None = None) -> Any:
        """``s.user(x)``, or ``with s.user(): ...``."""
        return self._role("user", expr)

    def assistant(self, expr: ExprLike | None = None) -> Any:
        """``s.assistant(x)``, or ``with s.assistant(): ...``."""
        return self._role("assistant", expr)

    @contextlib.contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """``with s.var_scope("x"): ...`` stores the text the block appends under ``"x"``."""
        self += VarScopeBegin(name)
        yield
        self += VarScopeEnd(name)

    def set_var(self, name: str, value: Any) -> None:
        """Store ``value`` under ``name``, in order with what was queued before."""
        self += SetVar(name, value)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def fork(self, size: int = 1, position_ids_offset: list[int] | None = None) -> ForkGroup:
        """``size`` copies that continue independently (and in parallel). The prompt so far is
        sent once first (a zero-token generate), so every branch finds it in the radix tree.

        ``position_ids_offset`` (one int per branch) is accepted for SGLang programs and kept on
        each branch; positions are not shifted (as in SGLang's text interpreter)."""
        size = int(size)
        if size < 1:
            raise ValueError("fork needs size >= 1")
        if position_ids_offset is not None and len(position_ids_offset) != size:
            raise ValueError(
                f"fork(position_ids_offset=...) needs one offset per branch ({size}), "
                f"got {len(position_ids_offset)}"
            )
        self.sync()
        if size > 1 and self._text:
            self.backend.cache_prefix(self._text)
        branches = ForkGroup(self._copy() for _ in range(size))
        branches.parent = self
        for i, branch in enumerate(branches):
            branch._fork_start = len(self._text)
            if position_ids_offset is not None:
                branch.position_ids_offset = [int(position_ids_offset[i])]
        return branches

    @contextlib.contextmanager
    def copy(self, position_ids_offset: list[int] | None = None) -> Iterator[ProgramState]:
        """``with s.copy() as c: ...``: one branch, joined back into ``s`` at the end of the
        block (its new variables gathered into ``s`` as lists, as ``join()`` does)."""
        branches = self.fork(1, position_ids_offset)
        try:
            yield branches[0]
        finally:
            branches.join()

    def _copy(self) -> ProgramState:
        child = ProgramState(self.backend, default_params=self.default_params)
        child._text = self._text
        child._vars = dict(self._vars)
        child._meta = dict(self._meta)
        child._messages = [dict(m) for m in self._messages]
        child._open_role = self._open_role
        child._role_start = self._role_start
        child._scopes = dict(self._scopes)
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

    def error(self) -> BaseException | None:
        """The first error the queued work hit (None if none), once it has all run."""
        with self._cond:
            while self._busy:
                self._cond.wait()
            return self._error

    def text(self) -> str:
        """The whole prompt so far, role markers included."""
        self.sync()
        return self._text

    def __getitem__(self, name: str) -> Any:
        self.sync()
        try:
            return self._vars[name]
        except KeyError:
            raise KeyError(f"no variable {name!r}; have {sorted(self._vars)}") from None

    def get_var(self, name: str) -> Any:
        return self[name]

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._vars

    def get_meta_info(self, name: str) -> Any:
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
            self._execute_role_begin(RoleBegin(expr.role))
            self._execute(expr.content)
            self._execute_role_end(RoleEnd(expr.role))
        elif isinstance(expr, RoleBegin):
            self._execute_role_begin(expr)
        elif isinstance(expr, RoleEnd):
            self._execute_role_end(expr)
        elif isinstance(expr, Gen):
            self._execute_gen(expr)
        elif isinstance(expr, Select):
            self._execute_select(expr)
        elif isinstance(expr, VarScopeBegin):
            self._scopes[expr.name] = len(self._text)
        elif isinstance(expr, VarScopeEnd):
            if expr.name not in self._scopes:
                raise ValueError(f"var_scope {expr.name!r} ends without beginning")
            self._vars[expr.name] = self._text[self._scopes.pop(expr.name) :]
        elif isinstance(expr, SetVar):
            self._vars[expr.name] = expr.value
        elif isinstance(expr, _Join):
            self._execute_join(expr)
        else:  # pragma: no cover - as_expr admits nothing else
            raise TypeError(f"unknown expression {expr!r}")

    def _execute_role_begin(self, expr: RoleBegin) -> None:
        if self._open_role is not None:
            raise ValueError(f"a {expr.role} turn cannot start inside a {self._open_role} turn")
        markers = self.backend.role_markers()
        prefix, _ = markers.around(expr.role)
        if not self._messages and not self._text:
            # what the template writes before the first turn, so the prompt is the one the
            # server's chat route renders for the same messages (and shares its cache)
            self._append(markers.begin)
            if expr.role != "system":
                self._append(markers.default_system)
        self._append(prefix)
        self._role_start = len(self._text)
        self._open_role = expr.role

    def _execute_role_end(self, expr: RoleEnd) -> None:
        if self._open_role != expr.role:
            raise ValueError(f"a {expr.role} turn ends but the open turn is {self._open_role}")
        _, suffix = self.backend.role_markers().around(expr.role)
        self._open_role = None
        self._messages.append({"role": expr.role, "content": self._text[self._role_start :]})
        self._append(suffix)

    def _execute_gen(self, expr: Gen) -> None:
        params = expr.params.merged(self.default_params)
        if params.n is not None and params.n > 1:
            if self._events is not None:
                raise NotImplementedError("gen(n > 1) cannot stream; run it without stream=True")
            results = self.backend.generate_n(self._text, params, params.n)
            texts = [r.text for r in results]
            self._append(texts[0], expr.name)
            if expr.name is not None:
                self._vars[expr.name] = texts
                self._meta[expr.name] = [r.meta_info for r in results]
            return
        if self._events is not None:
            result = self.backend.generate(
                self._text, params, on_text=lambda piece: self._append(piece, expr.name)
            )
        else:
            result = self.backend.generate(self._text, params)
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

    def _execute_join(self, expr: _Join) -> None:
        for branch in expr.branches:
            branch.sync()
        if expr.mode == "concate_and_append":
            # the branches' own text, one after another, as SGLang's text path does
            self._append("".join(b._text[b._fork_start :] for b in expr.branches))
            return
        # gather_variable: what the branches created is gathered as one list per name
        before = set(self._vars)
        for branch in expr.branches:
            for name in branch._vars.keys() - before:
                self._vars.setdefault(name, []).append(branch._vars[name])
                if name in branch._meta:
                    self._meta.setdefault(name, []).append(branch._meta[name])


JOIN_MODES = ("gather_variable", "concate_and_append")


class ForkGroup(list):
    """The states of ``s.fork(n)``: a list, where ``forks += expr`` appends to every branch
    (``forks += lambda i: ...`` and ``forks += [e0, e1, ...]`` one per branch) and
    ``forks.join()`` waits for them all."""

    parent: ProgramState | None = None

    def __iadd__(self, other: Any) -> ForkGroup:  # type: ignore[override]
        if isinstance(other, (list, tuple)):
            if len(other) != len(self):
                raise ValueError(f"forks += [...] needs one item per branch ({len(self)})")
            for state, expr in zip(self, other):
                state += expr
        elif callable(other) and not isinstance(other, Expr):
            for i, state in enumerate(self):
                state += other(i)
        else:
            for state in self:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> ForkGroup:
        """Wait for every branch, then merge into the state that forked:
        ``"gather_variable"`` (default) stores each variable the branches created as a list of
        their values; ``"concate_and_append"`` appends the branches' new text, in order."""
        if mode not in JOIN_MODES:
            raise ValueError(f"join mode must be one of {JOIN_MODES}, got {mode!r}")
        for state in self:
            state.sync()
        if self.parent is not None:
            self.parent += _Join(tuple(self), mode)
            if mode == "concate_and_append":
                self.parent.sync()
        return self
