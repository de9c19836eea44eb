"""Security: the API key, private ipc sockets, hostile frames on them, and no pickle anywhere."""

from __future__ import annotations

import ast
import os
import random
import stat
import time
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import reliability_support as support
import zmq
from reliability_support import (
    FAST_FLAGS,
    assert_error_shape,
    assert_no_leak,
    ipc_paths,
    processes,
    record,
)

from radix_runtime import messages as m

PACKAGE = Path(__file__).resolve().parents[2] / "radix_runtime"
KEY = "sk-reliability-Zx81-secret"

# every route; /health and the static /dashboard page alone are open
ROUTES = [
    ("GET", "/v1/models"),
    ("GET", "/v1/models/SmolLM2-135M-Instruct"),
    ("GET", "/get_model_info"),
    ("GET", "/get_server_info"),
    ("GET", "/flush_cache"),
    ("POST", "/flush_cache"),
    ("POST", "/reset_prefix_cache"),
    ("GET", "/metrics"),
    ("GET", "/cache_tree"),
    ("POST", "/generate"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/no/such/route"),
    ("GET", "/docs"),
]
BODIES = {
    "/generate": {"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
}


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    handle = support.start_server(
        str(tmp_path_factory.mktemp("keyed")), *FAST_FLAGS, "--api-key", KEY
    )
    yield handle
    handle.stop()


# ---------------------------------------------------------------------------------------------
# the API key


@pytest.mark.slow
def test_api_key_guards_every_route_but_health(keyed_server):
    h = keyed_server
    wrong = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": f"Bearer {KEY[:-1]}"},
        {"Authorization": KEY},
        {"Authorization": f"Basic {KEY}"},
        {"X-Api-Key": KEY},
    ]
    with httpx.Client(base_url=h.url, timeout=120) as c:
        assert c.get("/health").status_code == 200
        for method, path in ROUTES:
            for headers in wrong:
                r = c.request(method, path, headers=headers, json=BODIES.get(path))
                err = assert_error_shape(r, 401)
                assert err["code"] == "invalid_api_key" and err["type"] == "authentication_error"
                assert r.headers.get("www-authenticate") == "Bearer"
            ok = c.request(
                method, path, headers={"Authorization": f"Bearer {KEY}"}, json=BODIES.get(path)
            )
            assert ok.status_code != 401, (method, path, ok.text)
            if not path.startswith(("/no/", "/docs")):
                assert ok.status_code == 200, (method, path, ok.text)
        info = c.get("/get_server_info", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert info["api_key"] is None, "the key is echoed back"
    assert_no_leak(h)
    record("API key on every route but /health", routes=len(ROUTES), wrong_keys=len(wrong))


def test_api_key_comparison_is_constant_time():
    """The middleware finds the caller's key with tenancy.find_tenant, which compares with every
    key through hmac.compare_digest, never ==, and never stops at the first match."""
    source = (PACKAGE / "server" / "http_server.py").read_text()
    middleware = next(
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.ClassDef) and n.name == "_AuthMiddleware"
    )
    calls = [ast.unparse(n.func) for n in ast.walk(middleware) if isinstance(n, ast.Call)]
    assert "find_tenant" in calls
    source = (PACKAGE / "frontend" / "tenancy.py").read_text()
    find = next(
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.FunctionDef) and n.name == "find_tenant"
    )
    calls = [ast.unparse(n.func) for n in ast.walk(find) if isinstance(n, ast.Call)]
    assert "hmac.compare_digest" in calls
    compares = [
        n for n in ast.walk(find) if isinstance(n, ast.Compare) and "bearer" in ast.unparse(n)
    ]
    assert not compares, [ast.unparse(n) for n in compares]
    assert not [
        n
        for n in ast.walk(find)
        if isinstance(n, (ast.Break, ast.Return)) and n.lineno < find.body[-1].lineno
    ]


@pytest.mark.slow
def test_secret_stays_out_of_child_processes(keyed_server):
    """Children get their config on stdin: the key is in no child's argv or environment."""
    procs = processes(keyed_server)
    for role in ("scheduler", "worker"):
        p = procs[role]
        assert KEY not in " ".join(p.cmdline()), role
        assert all(KEY not in v for v in p.environ().values()), role


# ---------------------------------------------------------------------------------------------
# internal sockets


@pytest.mark.slow
def test_internal_sockets_are_private_ipc(keyed_server):
    h = keyed_server
    paths = ipc_paths(h)
    every = [p for ps in paths.values() for p in ps]
    assert every, paths
    dirs = {os.path.dirname(p) for p in every}
    assert len(dirs) == 1, dirs
    (ipc_dir,) = dirs
    st = os.stat(ipc_dir)
    assert stat.S_IMODE(st.st_mode) == 0o700, oct(st.st_mode)
    assert st.st_uid == os.getuid()
    # only the tokenizer process listens on TCP (the HTTP port); the children not at all
    for role, p in processes(h).items():
        inet = p.net_connections(kind="inet")
        if role == "tokenizer":
            assert {c.laddr.port for c in inet if c.status == "LISTEN"} == {h.port}
            assert all(c.laddr.ip == "127.0.0.1" for c in inet if c.status == "LISTEN")
        else:
            assert not inet, (role, inet)
    record(
        "internal sockets",
        ipc_dir_mode=oct(stat.S_IMODE(st.st_mode)),
        sockets=sorted(os.path.basename(p) for p in every),
    )


def _hostile_frames() -> list[tuple[str, bytes]]:
    sampling = m.SamplingParams(max_new_tokens=2)
    return [
        ("garbage", b"\x00\xffnot msgpack at all\xc1"),
        ("empty", b""),
        ("msgpack int", msgspec.msgpack.encode(7)),
        ("msgpack array", msgspec.msgpack.encode([1, 2, 3])),
        ("unknown tag", msgspec.msgpack.encode({"type": "Evil", "payload": "x" * 100})),
        ("wrong field types", msgspec.msgpack.encode({"type": "GenerateReq", "rid": 5})),
        ("oversized garbage", random.Random(0).randbytes(1 << 20)),
        ("message of a wrong kind", m.encode(m.FlushCacheDone(ok=True))),
        (
            "ids not int32",
            m.encode(m.GenerateReq(rid="hostile-1", input_ids=b"\x01\x02\x03", sampling=sampling)),
        ),
        (
            "ids out of vocabulary",
            m.encode(
                m.GenerateReq(
                    rid="hostile-2",
                    input_ids=np.array([1, 2**30], dtype="<i4").tobytes(),
                    sampling=sampling,
                )
            ),
        ),
        ("abort of nothing", m.encode(m.AbortReq(rid="nobody"))),
    ]


@pytest.mark.slow
def test_hostile_frames_are_dropped(keyed_server):
    """Connect to every internal socket and send garbage, foreign msgpack, a message of the wrong
    kind and a right-kind message with a corrupt payload: each is logged and dropped; every
    process keeps running and the server keeps answering."""
    h = keyed_server
    before = {role: p.pid for role, p in processes(h).items()}
    paths = ipc_paths(h)
    ipc_dir = os.path.dirname(paths["scheduler"][0])
    frames = _hostile_frames()
    ctx = zmq.Context()
    try:
        # the pull sockets: scheduler (from the tokenizer), scheduler_w (from the worker),
        # worker (from the scheduler), tokenizer (from the scheduler)
        for name in ("scheduler", "scheduler_w", "worker", "tokenizer"):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(f"ipc://{os.path.join(ipc_dir, name)}")
            for label, frame in frames:
                if name == "worker" and label.startswith("ids"):
                    continue  # a GenerateReq is a wrong kind for the worker already
                sock.send(frame)
            sock.close()
    finally:
        ctx.term()
    time.sleep(1.0)
    after = {role: p.pid for role, p in processes(h).items()}
    assert after == before
    with httpx.Client(base_url=h.url, timeout=120) as c:
        assert c.get("/health").status_code == 200
    assert_no_leak(h)
    log = h.log()
    dropped = log.count("dropped a malformed frame")
    ignored = log.count("ignored an unexpected")
    assert dropped >= 4 * 6, log[-4000:]
    assert ignored >= 3
    assert "crashed" not in log and "Traceback" not in log, log[-4000:]
    record(
        "hostile frames on the 4 internal sockets",
        frames=len(frames),
        logged_dropped=dropped,
        logged_ignored=ignored,
        processes_alive=3,
    )


# ---------------------------------------------------------------------------------------------
# no pickle


FORBIDDEN_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "dill",
    "cloudpickle",
    "joblib",
    "shelve",
    "marshal",
    "multiprocessing",
}
FORBIDDEN_TEXT = ("recv_pyobj", "send_pyobj", "torch.load(", "allow_pickle=True", "pickle.load")


def _python_files() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20
    return files


def test_no_pickle_in_the_package():
    """Nothing in radix_runtime/ imports a pickle-based serializer or multiprocessing (whose
    queues and pipes pickle), calls recv_pyobj / send_pyobj / torch.load, or loads numpy pickles."""
    offences = []
    for path in _python_files():
        source = path.read_text()
        rel = path.relative_to(PACKAGE.parent)
        for text in FORBIDDEN_TEXT:
            if text in source:
                offences.append(f"{rel}: {text}")
        for node in ast.walk(ast.parse(source)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module"):
                names = [ast.unparse(a).strip("'\"") for a in node.args]
            elif isinstance(node, ast.Name | ast.Attribute):
                ident = node.id if isinstance(node, ast.Name) else node.attr
                if "pickle" in ident.lower() or ident.endswith("_pyobj"):
                    offences.append(f"{rel}:{node.lineno}: uses {ident}")
            for name in names:
                if name.split(".")[0] in FORBIDDEN_MODULES:
                    offences.append(f"{rel}:{node.lineno}: imports {name}")
    assert not offences, offences
