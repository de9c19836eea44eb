"""Helpers shared by the reliability suite: the no-leak check every case ends with, finding a
server's processes, waiting on conditions, and recording the numbers `docs/reliability.md` reports.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx
import psutil
from server_support import ServerHandle, start_server  # noqa: F401 (the cases use them)

ROLES = ("tokenizer", "scheduler", "worker")

# A small pool keeps startup fast on the 2-core CI box; every prompt here is short.
FAST_FLAGS = ("--max-total-tokens", "4096")


# ---------------------------------------------------------------------------------------------
# results: each case records its numbers; the conftest prints them as a table after the run

RESULTS: list[dict[str, Any]] = []


def record(case: str, **numbers: Any) -> None:
    RESULTS.append({"case": case, **numbers})
    print(f"[reliability] {case}: {numbers}")


def format_results() -> str:
    lines = []
    for row in RESULTS:
        numbers = ", ".join(f"{k}={_fmt(v)}" for k, v in row.items() if k != "case")
        lines.append(f"{row['case']:<46} {numbers}")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


# ---------------------------------------------------------------------------------------------
# waiting


def wait_for(
    predicate: Callable[[], Any], timeout: float, interval: float = 0.05, what: str = ""
) -> float:
    """Poll until predicate() is truthy; return the seconds it took (AssertionError on timeout)."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


def server_info(client: httpx.Client) -> dict:
    r = client.get("/get_server_info")
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(client: httpx.Client, timeout: float = 120) -> dict:
    """The server info once nothing runs or waits in the scheduler."""
    info: dict = {}

    def idle() -> bool:
        nonlocal info
        info = server_info(client)
        return info["running_requests"] == 0 and info["waiting_requests"] == 0

    wait_for(idle, timeout, interval=0.05, what="an idle scheduler")
    return info


def assert_no_leak(handle, timeout: float = 120) -> dict:
    """What every case ends with: at idle no page is lost or still locked, and a normal request
    is answered. Returns the idle server info."""
    with handle.client() as client:
        info = wait_idle(client, timeout)
        cache = info["cache"]
        assert cache["free_pages"] + cache["evictable_pages"] == cache["total_pages"], cache
        assert cache["protected_pages"] == 0, cache
        r = client.post(
            "/v1/completions",
            json={"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    return info


def completion(client: httpx.Client, prompt: str | list[int], **kw: Any) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, **kw}
    return client.post("/v1/completions", json=body)


def health_status(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return None


def assert_error_shape(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"]
    return err


# ---------------------------------------------------------------------------------------------
# processes


def processes(handle) -> dict[str, psutil.Process]:
    """The server's three processes by role (the children are found by their process titles)."""
    parent = psutil.Process(handle.proc.pid)
    found = {"tokenizer": parent}
    for child in parent.children(recursive=True):
        try:
            title = " ".join(child.cmdline())
        except psutil.Error:
            continue
        for role in ("scheduler", "worker"):
            if f"radix_runtime::{role}" in title:
                found[role] = child
    assert set(found) == set(ROLES), f"expected {ROLES}, found {sorted(found)}"
    return found


def wait_all_exit(procs: list[psutil.Process], timeout: float) -> float:
    """Seconds until every process has exited (AssertionError listing the survivors)."""
    start = time.monotonic()
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    alive = [p for p in alive if _running(p)]
    assert not alive, f"still running after {timeout}s: {[(p.pid, _title(p)) for p in alive]}"
    return time.monotonic() - start


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _title(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return "?"


def kill(p: psutil.Process, sig: int = signal.SIGKILL) -> None:
    os.kill(p.pid, sig)


def ipc_paths(handle) -> dict[str, list[str]]:
    """The unix socket paths each of the server's processes has open."""
    out = {}
    for role, p in processes(handle).items():
        out[role] = sorted({c.laddr for c in p.net_connections(kind="unix") if c.laddr})
    return out


def ipc_dir(handle) -> str:
    dirs = {os.path.dirname(p) for paths in ipc_paths(handle).values() for p in paths}
    assert len(dirs) == 1, dirs
    return dirs.pop()


def rss_mb(procs: dict[str, psutil.Process]) -> dict[str, float]:
    return {role: p.memory_info().rss / 2**20 for role, p in procs.items()}
