"""``@rr.function`` programs and how they run: ``run``, ``run(stream=True)``, ``run_batch``."""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from radix_runtime.lang.backend import Backend
from radix_runtime.lang.ir import ExprLike, as_expr
from radix_runtime.lang.state import ProgramState

_default_backend: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    """The backend ``run`` and ``run_batch`` use when given none."""
    global _default_backend
    _default_backend = backend


def get_default_backend() -> Backend | None:
    return _default_backend


def _resolve(backend: Backend | None) -> Backend:
    backend = backend if backend is not None else _default_backend
    if backend is None:
        raise ValueError(
            "no backend: pass backend=rr.RuntimeEndpoint(url) (or rr.Runtime()) or call "
            "rr.set_default_backend(...)"
        )
    return backend


def function(func: Callable[..., Any]) -> Program:
    """Decorate ``def program(s, ...)``; ``s`` is the :class:`ProgramState` it appends to."""
    return Program(func)


class Program:
    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        functools.update_wrapper(self, func)

    def __call__(self, s: ProgramState, *args: Any, **kwargs: Any) -> Any:
        """Run inside another program, on its state."""
        return self.func(s, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<rr.function {self.func.__qualname__}>"

    def run(
        self, *args: Any, backend: Backend | None = None, stream: bool = False, **kwargs: Any
    ) -> ProgramState:
        """Run with these arguments and return the state once the program has finished; with
        ``stream=True`` return at once and read the text live with ``state.text_iter()``."""
        state = ProgramState(_resolve(backend), stream=stream)
        if not stream:
            state.ret_value = self.func(state, *args, **kwargs)
            return state.sync()

        def body() -> None:
            try:
                state.ret_value = self.func(state, *args, **kwargs)
                state.sync()
            except BaseException as exc:
                state._finish_stream(exc)
            else:
                state._finish_stream()

        threading.Thread(target=body, name="rr-program", daemon=True).start()
        return state

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any]],
        *,
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        cache_prefix: bool = True,
        return_exceptions: bool = False,
    ) -> list[ProgramState | BaseException]:
        """Run once per kwargs dict, ``num_threads`` at a time; states come back in input order.

        With ``cache_prefix`` the prompt text all runs start with is sent once first (found by
        running each program up to its first ``gen``/``select``/read; see docs/frontend.md).
        An error raises the first exception once all runs are done, unless ``return_exceptions``
        puts exceptions in the list in place of states."""
        backend = _resolve(backend)
        batch_kwargs = list(batch_kwargs)
        if not batch_kwargs:
            return []
        if cache_prefix and len(batch_kwargs) > 1:
            prefix = self.shared_prefix(batch_kwargs, backend)
            if prefix:
                backend.cache_prefix(prefix)
        if num_threads == "auto":
            num_threads = min(len(batch_kwargs), max(16, 4 * (os.cpu_count() or 1)), 128)
        results: list[Any] = [None] * len(batch_kwargs)
        bar = None
        if progress_bar:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(batch_kwargs), desc=self.func.__name__)
        with ThreadPoolExecutor(max_workers=int(num_threads)) as pool:
            futures = {
                pool.submit(self.run, backend=backend, **kw): i for i, kw in enumerate(batch_kwargs)
            }
            for future in as_completed(futures):
                exc = future.exception()
                results[futures[future]] = exc if exc is not None else future.result()
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        if not return_exceptions:
            for r in results:
                if isinstance(r, BaseException):
                    raise r
        return results

    def shared_prefix(self, batch_kwargs: Sequence[dict[str, Any]], backend: Backend) -> str:
        """The prompt text every run starts with, cut after its last whole word."""
        prompts = [self._capture(kw, backend) for kw in batch_kwargs]
        prefix = os.path.commonprefix(prompts)
        if all(p == prefix for p in prompts):
            return prefix
        # ends inside the runs: stop before a trailing partial word, which the runs tokenize
        # differently ("Question: Wh" vs "Question: What")
        match = re.search(r"\s+\S*$", prefix)
        return prefix[: match.start()] if match else ""

    def _capture(self, kwargs: dict[str, Any], backend: Backend) -> str:
        state = _CaptureState(backend)
        try:
            self.func(state, **kwargs)
        except _Captured:
            pass
        except Exception:
            pass  # the real run raises it again; the text before it is still shared
        return state._text


class _Captured(BaseException):
    """Stops a capture pass (a BaseException so a program's ``except Exception`` lets it by)."""


class _CaptureState(ProgramState):
    """Runs a program synchronously up to the first thing that needs the model."""

    def __iadd__(self, expr: ExprLike) -> ProgramState:
        self._execute(as_expr(expr))
        return self

    def _execute_gen(self, expr: Any) -> None:
        raise _Captured

    def _execute_select(self, expr: Any) -> None:
        raise _Captured

    def sync(self) -> ProgramState:
        raise _Captured

    def fork(self, n: int = 1) -> Any:
        raise _Captured
