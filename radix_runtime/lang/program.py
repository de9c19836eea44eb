"""``@rr.function`` programs and how they run: ``run``, ``run(stream=True)``, ``run_batch``, a
direct call; the process-wide ``global_config`` and default backend."""

from __future__ import annotations

import functools
import inspect
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from radix_runtime.lang.backend import Backend
from radix_runtime.lang.ir import ExprLike, GenParams, as_expr
from radix_runtime.lang.state import ProgramState

# The keyword arguments of run / run_batch / a direct call that are sampling defaults for every
# gen of the run (SGLang's list), never arguments of the program function. ``max_new_tokens``
# is gen's ``max_tokens``.
SAMPLING_KWARGS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "ignore_eos",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
)


class GlobalConfig:
    """Process-wide frontend settings (SGLang's ``global_config``).

    ``default_backend``: what runs use without ``backend=`` (also ``rr.set_default_backend``);
    ``verbosity``: 2 prints each finished run's text; ``enable_precache_with_tracing``: the
    default of ``run_batch(cache_prefix=...)``. ``enable_parallel_encoding`` is accepted and has
    no effect: ``join(mode="concate_and_append")`` always appends the branches' text."""

    def __init__(self) -> None:
        self.default_backend: Backend | None = None
        self.verbosity = 0
        self.enable_precache_with_tracing = True
        self.enable_parallel_encoding = True
        self.skip_special_tokens_in_output = True
        self.spaces_between_special_tokens_in_out = True


global_config = GlobalConfig()


def set_default_backend(backend: Backend | None) -> None:
    """The backend ``run`` and ``run_batch`` use when given none."""
    global_config.default_backend = backend


def get_default_backend() -> Backend | None:
    return global_config.default_backend


def _resolve(backend: Backend | None) -> Backend:
    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        raise ValueError(
            "no backend: pass backend=rr.RuntimeEndpoint(url) (or rr.Runtime()) or call "
            "rr.set_default_backend(...)"
        )
    return backend


def flush_cache(backend: Backend | None = None) -> bool:
    """Empty the server's radix cache; False when there is no backend or requests are running."""
    from radix_runtime.lang.backend import ServerError

    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        return False
    try:
        backend.flush_cache()
    except ServerError as exc:
        if exc.code == "cache_busy":
            return False
        raise
    return True


def get_server_info(backend: Backend | None = None) -> dict | None:
    """The server's ``/get_server_info`` (flags, cache statistics); None without a backend."""
    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        return None
    return backend.get_server_info()


def function(func: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Decorate ``def program(s, ...)``; ``s`` is the :class:`ProgramState` it appends to.
    ``@rr.function(num_api_spec_tokens=...)`` is accepted (there is no API model to speculate
    for); any other option is an error."""
    unknown = set(options) - {"num_api_spec_tokens"}
    if unknown:
        raise TypeError(f"rr.function got unexpected options {sorted(unknown)}")
    if func is None:
        return Program
    return Program(func)


def sampling_defaults(kwargs: dict[str, Any]) -> GenParams | None:
    """Pop SGLang's run-level sampling keywords out of ``kwargs`` into gen defaults."""
    found = {name: kwargs.pop(name) for name in SAMPLING_KWARGS if name in kwargs}
    found = {k: v for k, v in found.items() if v is not None}
    if found.get("return_text_in_logprobs"):
        raise NotImplementedError(
            "return_text_in_logprobs=True is not supported by radix_runtime: the logprobs come "
            "as [logprob, token id] pairs"
        )
    found.pop("return_text_in_logprobs", None)
    if not found:
        return None
    if "max_new_tokens" in found:
        found["max_tokens"] = found.pop("max_new_tokens")
    if found.get("stop") in ((), []):
        del found["stop"]
    if found.get("stop_token_ids") in ((), []):
        del found["stop_token_ids"]
    return GenParams(**found)


class Program:
    def __init__(self, func: Callable[..., Any], bind_arguments: dict | None = None) -> None:
        self.func = func
        self.bind_arguments = dict(bind_arguments or {})
        functools.update_wrapper(self, func)
        params = list(inspect.signature(func).parameters.values())
        self.arg_names = [
            p.name for p in params[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY)
        ]
        self.required_args = [
            p.name
            for p in params[1:]
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY) and p.default is p.empty
        ]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``prog(s, ...)`` inside another program runs on that state; ``prog(...)`` anywhere else
        is ``prog.run(...)`` (sampling keywords, ``stream=``, ``backend=`` included)."""
        if args and isinstance(args[0], ProgramState):
            return self.func(*args, **kwargs)
        return self.run(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<rr.function {self.func.__qualname__}>"

    def bind(self, **kwargs: Any) -> Program:
        """A program with some arguments fixed."""
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise TypeError(f"{self.func.__name__} has no arguments {sorted(unknown)}")
        return Program(self.func, {**self.bind_arguments, **kwargs})

    def run(
        self, *args: Any, backend: Backend | None = None, stream: bool = False, **kwargs: Any
    ) -> ProgramState:
        """Run with these arguments and return the state once the program has finished; with
        ``stream=True`` return at once and read the text live with ``state.text_iter()``.
        SGLang's sampling keywords (``temperature=0``, ``max_new_tokens=64``, ...) are defaults
        for every ``gen`` of the run; a ``gen``'s own settings win."""
        defaults = sampling_defaults(kwargs)
        return self._run(args, kwargs, backend, stream, defaults)

    def _run(
        self,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        backend: Backend | None,
        stream: bool,
        defaults: GenParams | None,
    ) -> ProgramState:
        kwargs = {**self.bind_arguments, **kwargs}
        state = ProgramState(_resolve(backend), stream=stream, default_params=defaults)
        if not stream:
            state.ret_value = self.func(state, *args, **kwargs)
            state.sync()
            if global_config.verbosity >= 2:
                print(state.text())
            return state

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
        batch_kwargs: Sequence[dict[str, Any] | Sequence[Any]],
        *,
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        cache_prefix: bool | None = None,
        return_exceptions: bool = False,
        **sampling: Any,
    ) -> Any:
        """Run once per kwargs dict (or tuple of positional arguments), ``num_threads`` at a
        time; states come back in input order (``generator_style=True``: yielded in order as
        they finish in order). ``sampling`` takes SGLang's sampling keywords, defaults for every
        ``gen`` of every run.

        With ``cache_prefix`` (default: ``global_config.enable_precache_with_tracing``) the
        prompt text all runs start with is sent once first (found by running each program up to
        its first ``gen``/``select``/read; see docs/frontend.md). An error raises the first
        exception once all runs are done, unless ``return_exceptions`` puts exceptions in the
        list in place of states."""
        defaults = sampling_defaults(sampling)
        if sampling:
            raise TypeError(f"run_batch got unexpected keyword arguments {sorted(sampling)}")
        backend = _resolve(backend)
        batch_kwargs = [self._as_kwargs(kw) for kw in batch_kwargs]
        if cache_prefix is None:
            cache_prefix = global_config.enable_precache_with_tracing
        if cache_prefix and len(batch_kwargs) > 1:
            prefix = self.shared_prefix(batch_kwargs, backend)
            if prefix:
                backend.cache_prefix(prefix)
        if num_threads == "auto":
            num_threads = max(16, 4 * (os.cpu_count() or 1))
        num_threads = max(1, min(int(num_threads), len(batch_kwargs) or 1, 128))
        if generator_style:
            return self._run_batch_iter(batch_kwargs, backend, defaults, num_threads, progress_bar)
        if not batch_kwargs:
            return []
        results: list[Any] = [None] * len(batch_kwargs)
        bar = _progress(progress_bar, len(batch_kwargs), self.func.__name__)
        with ThreadPoolExecutor(max_workers=num_threads) as pool:
            futures = {
                pool.submit(self._run, (), kw, backend, False, defaults): i
                for i, kw in enumerate(batch_kwargs)
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

    def _run_batch_iter(
        self,
        batch_kwargs: list[dict[str, Any]],
        backend: Backend,
        defaults: GenParams | None,
        num_threads: int,
        progress_bar: bool,
    ) -> Iterator[ProgramState]:
        bar = _progress(progress_bar, len(batch_kwargs), self.func.__name__)
        with ThreadPoolExecutor(max_workers=num_threads) as pool:
            # a bounded window of submitted runs, so the first results come before all are sent
            window = 4 * num_threads
            futures = [
                pool.submit(self._run, (), kw, backend, False, defaults)
                for kw in batch_kwargs[:window]
            ]
            for i in range(len(batch_kwargs)):
                if i + window < len(batch_kwargs):
                    kw = batch_kwargs[i + window]
                    futures.append(pool.submit(self._run, (), kw, backend, False, defaults))
                state = futures[i].result()
                if bar is not None:
                    bar.update(1)
                yield state
        if bar is not None:
            bar.close()

    def _as_kwargs(self, item: dict[str, Any] | Sequence[Any]) -> dict[str, Any]:
        if isinstance(item, dict):
            return item
        if isinstance(item, (list, tuple)) and (
            len(self.required_args) <= len(item) <= len(self.arg_names)
        ):
            return dict(zip(self.arg_names, item))
        raise TypeError(
            f"run_batch items must be dicts of arguments or tuples of {self.arg_names}, got "
            f"{item!r}"
        )

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
            self.func(state, **{**self.bind_arguments, **kwargs})
        except _Captured:
            pass
        except Exception:
            pass  # the real run raises it again; the text before it is still shared
        return state._text


def _progress(enabled: bool, total: int, desc: str) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc)


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

    def fork(self, *args: Any, **kwargs: Any) -> Any:
        raise _Captured
