"""Shared fixtures: real `radix-runtime serve` processes for integration tests.

`default_server` is one server on the embedded default model (SmolLM2, CPU) shared by the whole
session; `launch_server(**flags)` starts a private one for tests that need other flags or kill it.
"""

from __future__ import annotations

import os

from radix_runtime.utils.procs import OMP_SPIN_COUNT

# the tests share 2 cores with the servers they start: OpenMP threads wait passively after the
# short spin a server's children get (utils/procs.child_env), in this process too (set before
# torch loads libgomp): a long spin starves the servers, none makes each of a CPU step's
# parallel regions wait for a wake-up (two CPU test files: 84.7 s without the spin, 50.2 with)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", OMP_SPIN_COUNT)

import pytest  # noqa: E402
from http_support import Served, served  # noqa: E402
from server_support import DEFAULT_TEST_FLAGS, ServerHandle, free_port, start_server  # noqa: E402

__all__ = ["DEFAULT_TEST_FLAGS", "ServerHandle", "free_port", "start_server"]


@pytest.fixture(scope="session")
def default_server(tmp_path_factory):
    handle = start_server(str(tmp_path_factory.mktemp("server")), *DEFAULT_TEST_FLAGS)
    yield handle
    handle.stop()


@pytest.fixture
def launch_server(tmp_path):
    handles: list[ServerHandle] = []

    def launch(*flags: str, env: dict | None = None) -> ServerHandle:
        handle = start_server(str(tmp_path), *flags, env=env)
        handles.append(handle)
        return handle

    yield launch
    for h in handles:
        h.stop()


@pytest.fixture(scope="module")
def module_server():
    """One app over the real TokenizerManager and a scripted scheduler (tests/http_support.py)
    per test module, for tests that leave it healthy; use it through ``server``."""
    with served() as s:
        yield s


@pytest.fixture
def server(module_server) -> Served:
    """The module's served app, with its scheduler's script and the recorded inputs reset."""
    module_server.sched.reset()
    module_server.manager.inputs.clear()
    module_server.manager.draining = False
    return module_server
