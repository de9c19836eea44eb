"""Process hygiene: titles, dying with the parent, private ipc directories, child launching."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import zmq

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def set_process_title(role: str) -> None:
    """Name the process after its role (`ps` shows radix_runtime::scheduler etc.)."""
    title = f"radix_runtime::{role}"
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # pragma: no cover - setproctitle is a declared dependency
        pass
    try:  # also the short name shown by `top` / pkill
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, title.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def die_with_parent(parent_pid: int) -> None:
    """Make this process exit when `parent_pid` dies.

    PR_SET_PDEATHSIG covers the common case; a polling thread covers the race where the parent
    died before prctl ran, and platforms without prctl.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def make_ipc_dir() -> str:
    """A private directory (mode 0700) for the ipc:// sockets of one server."""
    return tempfile.mkdtemp(prefix="radix_runtime-")


def endpoint(ipc_dir: str, name: str) -> str:
    return f"ipc://{os.path.join(ipc_dir, name)}"


def zmq_socket(ctx: zmq.Context, kind: int, addr: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PUSH:
        sock.setsockopt(zmq.SNDHWM, 0)
    if kind == zmq.PULL:
        sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(addr)
    else:
        sock.connect(addr)
    return sock


def configure_logging(level: str, role: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s [{role}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )


# ---------------------------------------------------------------------------------------------
# children are started with `python -m <module>` and read their config as one JSON line on stdin:
# nothing is pickled and secrets (the API key) never show up in `ps`.


# GOMP_SPINCOUNT of the children's OpenMP threads (libgomp: busy-wait iterations before sleeping,
# ~0.25 ms here): a step's ~200 parallel regions follow each other within microseconds, and
# waking a sleeping thread for each (futex) cost more than the second thread gained; past it the
# thread sleeps, so between steps it leaves the core to the scheduler and HTTP processes
# (docs/decisions.md, "The CPU kernels on every thread")
OMP_SPIN_COUNT = "10000"


def child_env(env: dict | None = None) -> dict:
    """A child's environment: ours, `env` on top, and the defaults below where neither sets them."""
    env = {**os.environ, **(env or {})}
    env.setdefault("PYTHONUNBUFFERED", "1")
    # OpenMP threads that spin while waiting starve the other processes of the server on a
    # small CPU machine (measured: a decode step 1.0 s with libgomp's default spin of ~6 ms vs
    # 0.13-0.2 s passive on 2 busy cores), and sleeping at once between the closely spaced
    # parallel regions of one step makes a second thread slower than one: a short bounded spin.
    # An OMP_WAIT_POLICY or GOMP_SPINCOUNT of the user's is left alone.
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
        env["GOMP_SPINCOUNT"] = OMP_SPIN_COUNT
    return env


def spawn_child(
    module: str, payload: dict, env: dict | None = None, new_session: bool = False
) -> subprocess.Popen:
    """`env`: variables to set on top of ours. `new_session`: the child (and what it starts) gets
    its own process group, so signals sent to ours (Ctrl-C, `kill -- -PGID`) reach only us and
    we decide what to forward (the data-parallel supervisor does)."""
    payload = {**payload, "parent_pid": os.getpid()}
    proc = subprocess.Popen(
        [sys.executable, "-m", module],
        stdin=subprocess.PIPE,
        env=child_env(env),
        start_new_session=new_session,
    )
    assert proc.stdin is not None
    proc.stdin.write((json.dumps(payload) + "\n").encode())
    proc.stdin.close()
    return proc


def read_child_payload() -> dict:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("radix_runtime child started without a config on stdin")
    payload = json.loads(line)
    die_with_parent(int(payload["parent_pid"]))
    return payload


def install_child_signal_handlers() -> None:
    """Ctrl-C reaches the whole process group, and SIGTERM may too (systemd's default
    KillMode=control-group, `timeout`, `kill -- -PGID`): children leave the shutdown to the
    parent, which drains in-flight requests first, then stops them (see terminate_children)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def terminate_children(procs: list[subprocess.Popen], grace: float = 1.0) -> None:
    """Children exit on the ShutdownReq the parent sent before; whatever still runs after
    `grace` seconds (a hung worker, a child that never got the message) is killed. They keep no
    state worth flushing, and they ignore SIGTERM."""
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
