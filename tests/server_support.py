"""The server launcher the tests share: `start_server` runs a real `radix-runtime serve` process
and waits until it is healthy. A module of its own (not tests/conftest.py) so that every test
imports it under one name: the module name `conftest` belongs to whichever conftest pytest
imported last (tests/reliability has one too).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerHandle:
    proc: subprocess.Popen
    port: int
    api_key: str | None = None
    log_path: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kw) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(
            base_url=self.url, timeout=kw.pop("timeout", 120), headers=headers, **kw
        )

    def log(self) -> str:
        if self.log_path and os.path.exists(self.log_path):
            with open(self.log_path, errors="replace") as f:
                return f.read()[-20000:]
        return ""

    def stop(self, timeout: float = 15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(
    tmp_dir: str, *flags: str, env: dict | None = None, timeout: float = 240
) -> ServerHandle:
    port = free_port()
    log_path = os.path.join(tmp_dir, f"server-{port}.log")
    cmd = [sys.executable, "-m", "radix_runtime", "serve", "--port", str(port), *flags]
    api_key = flags[flags.index("--api-key") + 1] if "--api-key" in flags else None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    handle = ServerHandle(proc, port, api_key, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{handle.log()}")
        try:
            if httpx.get(f"{handle.url}/health", timeout=2).status_code == 200:
                return handle
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    handle.stop()
    raise RuntimeError(f"server did not become healthy in {timeout}s:\n{handle.log()}")


# Small enough to start fast and to keep memory low in CI, large enough for every test.
DEFAULT_TEST_FLAGS = ("--max-total-tokens", "32768")
