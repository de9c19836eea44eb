"""``Runtime``: a local ``radix-runtime serve`` subprocess and its endpoint, as one backend."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from radix_runtime.lang.backend import (
    Backend,
    GenResult,
    RoleMarkers,
    RuntimeEndpoint,
    SelectResult,
)
from radix_runtime.lang.ir import GenParams

_PR_SET_PDEATHSIG = 1


class Runtime(Backend):
    """Start a server on a free port and wait until it is healthy::

        with rr.Runtime() as runtime:            # the default model, SmolLM2 on CPU
            state = program.run(backend=runtime)

    ``model_path=`` (SGLang's name) is ``model=``. ``server_args`` are the ``radix-runtime serve``
    flags as keywords (``page_size=16``,
    ``disable_radix_cache=True``). The server's output goes to ``log_path`` (by default a temp file,
    removed at shutdown)."""

    def __init__(
        self,
        model: str = "default",
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        api_key: str | None = None,
        log_path: str | None = None,
        startup_timeout: float = 600,
        model_path: str | None = None,
        **server_args: Any,
    ) -> None:
        if model_path is not None:  # SGLang's name for the model
            model = model_path
        self.port = port or _free_port()
        self.url = f"http://{host}:{self.port}"
        flags = ["--model", model, "--host", host, "--port", str(self.port)]
        if api_key:
            flags += ["--api-key", api_key]
        flags += _flags(server_args)
        self._own_log = log_path is None
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="radix-runtime-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.process: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-m", "radix_runtime", "serve", *flags],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent if _on_main_thread() else None,
            )
        atexit.register(self.shutdown)
        self.endpoint = RuntimeEndpoint(self.url, api_key)
        try:
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.shutdown()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(f"the server exited with code {code}:\n{self.log_tail()}")
            if self.endpoint.health():
                return
            time.sleep(0.25)
        raise RuntimeError(f"the server was not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def shutdown(self, timeout: float = 30) -> None:
        """Stop the server (SIGINT, then SIGKILL after ``timeout``) and every process it
        started. Idempotent."""
        proc, self.process = self.process, None
        if proc is None:
            return
        atexit.unregister(self.shutdown)
        children = _children(proc.pid)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        _reap(children, timeout=10)
        if self._own_log:
            with contextlib.suppress(OSError):
                os.remove(self.log_path)

    def __repr__(self) -> str:
        return f"Runtime({self.url!r})"

    # --- Backend, by the endpoint

    def role_markers(self) -> RoleMarkers:
        return self.endpoint.role_markers()

    def generate(
        self, prompt: str, params: GenParams, on_text: Callable[[str], None] | None = None
    ) -> GenResult:
        return self.endpoint.generate(prompt, params, on_text)

    def generate_n(self, prompt: str, params: GenParams, n: int) -> list[GenResult]:
        return self.endpoint.generate_n(prompt, params, n)

    def select(self, prompt: str, choices: Sequence[str]) -> SelectResult:
        return self.endpoint.select(prompt, choices)

    def get_model_info(self) -> dict:
        return self.endpoint.get_model_info()

    def get_server_info(self) -> dict:
        return self.endpoint.get_server_info()

    def flush_cache(self) -> dict:
        return self.endpoint.flush_cache()

    def cache_prefix(self, prompt: str) -> int:
        return self.endpoint.cache_prefix(prompt)


def _flags(server_args: dict[str, Any]) -> list[str]:
    out = []
    for name, value in server_args.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not None and value is not False:
            out += [flag, str(value)]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _on_main_thread() -> bool:
    # PR_SET_PDEATHSIG fires when the *thread* that forked exits, so only the main thread's
    # death is a safe signal
    return threading.current_thread() is threading.main_thread()


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux; elsewhere a no-op)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _children(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _reap(procs: list, timeout: float) -> None:
    """Wait for ``procs`` (psutil processes) to exit; kill what is left."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
