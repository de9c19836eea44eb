"""`radix-runtime serve --dp 2`: two CPU replicas of the default model behind SGLang's real router
(cache_aware), with an API key. One server for the module; the tests run in file order and the
last ones kill a replica, then stop the whole thing."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time

import httpx
import psutil
import pytest
import zmq

pytest.importorskip("sglang_router.router", reason="needs radix_runtime[router] (sglang-router)")
pytestmark = pytest.mark.slow  # one --dp 2 server: ~60-75 s on an idle 2-core machine

from server_support import free_port, start_server  # noqa: E402

import radix_runtime as rr  # noqa: E402
from radix_runtime import kv_events as kv  # noqa: E402

KEY = "dp-test-key"
MODEL = "SmolLM2-135M-Instruct"


def free_ports(n: int) -> int:
    """The first of n consecutive free ports (replica i publishes on the given port + i)."""
    for _ in range(100):
        first = free_port()
        try:
            for port in range(first, first + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError("no consecutive free ports")


@pytest.fixture(scope="module")
def dp(tmp_path_factory):
    events, replay, health = free_ports(2), free_ports(2), free_port()
    handle = start_server(
        str(tmp_path_factory.mktemp("dp")),
        "--dp", "2", "--router-policy", "cache_aware", "--max-total-tokens", "4096",
        "--api-key", KEY, "--dp-health-port", str(health),
        "--kv-events-endpoint", f"tcp://127.0.0.1:{events}",
        "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}",
    )  # fmt: skip
    # the router answers /health as soon as it listens; /readiness once it has both replicas
    deadline = time.monotonic() + 60
    while True:
        r = httpx.get(handle.url + "/readiness", timeout=5)
        if r.status_code == 200 and r.json().get("healthy_workers") == 2:
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)
    handle.health_url = f"http://127.0.0.1:{health}/health"
    handle.kv_endpoints = [
        (f"tcp://127.0.0.1:{events + i}", f"tcp://127.0.0.1:{replay + i}") for i in range(2)
    ]
    yield handle
    handle.stop(timeout=60)


def replicas(dp) -> dict[str, int]:
    """Replica URL -> pid of its tokenizer process, from the supervisor's log."""
    found = re.findall(r"replica \d+: (http://\S+) on .* \(pid (\d+)\)", dp.log())
    assert len(found) == 2, dp.log()
    return {url: int(pid) for url, pid in found}


def replica_info(url: str) -> dict:
    r = httpx.get(url + "/get_server_info", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    r.raise_for_status()
    return r.json()


def chat(client: httpx.Client, messages: list[dict]) -> dict:
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return r.json()


def conversation(client: httpx.Client, name: str, turns: int) -> list[tuple[int, int]]:
    """(prompt_tokens, cached_tokens) per turn of a fresh conversation."""
    messages = [{"role": "system", "content": f"You are {name}, a terse assistant. " * 4}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{name}: tell me fact number {turn}."})
        body = chat(client, messages)
        usage = body["usage"]
        out.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
        messages.append(body["choices"][0]["message"])
    return out


def test_routes_through_the_router(dp):
    with dp.client() as client:
        info = client.get("/get_model_info").json()
        assert info["served_model_name"] == MODEL
        # a worker's error body comes back as the worker wrote it
        r = client.post(
            "/v1/chat/completions",
            json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found"
        # a request without a model (the router fills in "unknown") is served
        r = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert r.status_code == 200, r.text
        # streaming passes through, event by event
        with client.stream(
            "POST",
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 4, "stream": True},
        ) as resp:  # fmt: skip
            assert resp.status_code == 200
            events = [line for line in resp.iter_lines() if line.startswith("data:")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3
    # the key is checked by the router, and the router sends it on to the replicas
    r = httpx.post(dp.url + "/generate", json={"text": "hi"}, timeout=30)
    assert r.status_code == 401


def test_conversations_stay_on_the_replica_that_holds_them(dp):
    with dp.client() as client:
        for name in ("Ada", "Bob"):
            turns = conversation(client, name, 3)
            for (prev_prompt, _), (prompt, cached) in zip(turns, turns[1:]):
                # the whole previous prompt is reused: only the replica that served the
                # previous turn holds it
                assert prompt > prev_prompt
                assert cached >= prev_prompt, turns


def cached_pages(url: str) -> int:
    cache = replica_info(url)["cache"]
    return cache["evictable_pages"] + cache["protected_pages"]


def test_kv_events_let_a_subscriber_index_every_replica(dp):
    """Per replica: a subscriber that starts from a snapshot and applies the published batches
    holds one block per cached page (page size 1), and a later snapshot equals what it built."""
    ctx = zmq.Context()
    try:
        subs, indexes = [], []
        for pub_ep, _ in dp.kv_endpoints:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, kv.TOPIC)
            sub.connect(pub_ep)
            subs.append(sub)
        time.sleep(0.5)  # ZeroMQ's slow joiner: subscribed before the snapshot is taken
        for _, replay_ep in dp.kv_endpoints:
            index = kv.KvIndex()
            index.load(snapshot(ctx, replay_ep))
            indexes.append(index)
        with dp.client() as client:
            conversation(client, "Ivy", 2)
        urls = list(replicas(dp))
        for sub, index, url in zip(subs, indexes, urls):
            deadline = time.monotonic() + 30
            while len(index.blocks) != cached_pages(url) and time.monotonic() < deadline:
                if sub.poll(300):
                    _, seq, data = sub.recv_multipart()
                    batch = kv.decode_batch(data)
                    assert batch.seq == int.from_bytes(seq, "big")
                    index.apply(batch)
            assert len(index.blocks) == cached_pages(url)
            index.prefixes()  # every block's parent is there
        assert sum(len(index.blocks) for index in indexes) > 0
        for index, (_, replay_ep) in zip(indexes, dp.kv_endpoints):
            fresh = kv.KvIndex()
            fresh.load(snapshot(ctx, replay_ep))
            assert fresh.blocks == index.blocks
    finally:
        ctx.destroy(linger=0)


def snapshot(ctx, replay_ep: str) -> kv.Snapshot:
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.RCVTIMEO, 30_000)
    req.connect(replay_ep)
    req.send(kv.SNAPSHOT_REQUEST)
    seq, data = req.recv_multipart()
    req.close(0)
    snap = kv.decode_snapshot(data)
    assert snap.seq == int.from_bytes(seq, "big", signed=True)
    return snap


def test_flush_cache_reaches_every_replica(dp):
    urls = list(replicas(dp))
    with dp.client() as client:
        conversation(client, "Dee", 1)
    assert sum(replica_info(u)["cache"]["evictable_pages"] for u in urls) > 0
    endpoint = rr.RuntimeEndpoint(dp.url, api_key=KEY)  # the DSL's flush goes to the router
    endpoint.flush_cache()
    for url in urls:
        cache = replica_info(url)["cache"]
        assert cache["evictable_pages"] == 0 and cache["free_pages"] == cache["total_pages"]


def test_multi_turn_bench_against_the_router(dp, tmp_path):
    from bench import multi_turn_chat

    out = tmp_path / "dp.json"
    argv = ["--url", dp.url, "--api-key", KEY, "--dp", "2", "--text", "--clients", "2",
            "--rounds", "2", "--system-tokens", "24", "--context-tokens", "8",
            "--user-tokens", "8", "--answer-tokens", "3", "--out", str(out)]  # fmt: skip
    assert multi_turn_chat.main(argv) == 0
    result = json.loads(out.read_text())
    on = result["cache_on"]
    assert on["errors"] == 0 and on["optimal_hit_rate"] > 0
    assert on["hit_rate"] >= 0.5 * on["optimal_hit_rate"]
    assert len(on["replicas"]) == 2  # how the router spread the trace, per replica


def test_client_disconnect_aborts_on_the_replica(dp):
    urls = list(replicas(dp))
    with dp.client() as client, client.stream(
        "POST",
        "/generate",
        json={"text": "Count to a thousand:", "stream": True,
              "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}},
    ) as resp:  # fmt: skip
        assert resp.status_code == 200
        next(line for line in resp.iter_lines() if line.startswith("data:"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(replica_info(u)["running_requests"] == 0 for u in urls):
            break
        time.sleep(0.3)
    else:
        pytest.fail("the replica kept generating for a client that went away")


def test_killing_a_replica_keeps_requests_succeeding(dp):
    by_url = replicas(dp)
    before = httpx.get(dp.health_url, timeout=5)
    assert before.status_code == 200 and [r["alive"] for r in before.json()["replicas"]] == [
        True,
        True,
    ]
    with dp.client() as client:
        conversation(client, "Hal", 1)  # the router now holds Hal's prefix on one replica
        victim = max(by_url, key=lambda u: replica_info(u)["cache"]["evictable_pages"])
        psutil.Process(by_url[victim]).send_signal(signal.SIGKILL)
        psutil.Process(by_url[victim]).wait(30)
        # the supervisor notices within 0.2 s and takes it out of the router (in between, a
        # request routed to it fails: the router does not retry a refused connection)
        deadline = time.monotonic() + 30
        while f"removed {victim} from the router" not in dp.log():
            assert time.monotonic() < deadline, dp.log()
            time.sleep(0.1)
        turns = conversation(client, "Hal", 3)  # the router moves Hal to the survivor
        assert turns[2][1] >= turns[1][0], turns
        for _ in range(4):
            assert client.post("/generate", json={"text": "hello", "sampling_params": {
                "max_new_tokens": 2}}).status_code == 200  # fmt: skip
    assert re.search(r"replica \d \(" + re.escape(victim) + r"\) exited", dp.log())
    # the router's /readiness still counts a healthy replica; our /health names the dead one
    assert httpx.get(dp.url + "/readiness", timeout=5).status_code == 200
    after = httpx.get(dp.health_url, timeout=5)
    assert after.status_code == 503 and after.json()["error"]["code"] == "replica_dead"
    assert victim in after.json()["error"]["message"]
    assert sorted(r["alive"] for r in after.json()["replicas"]) == [False, True]


def test_sigterm_drains_then_stops_every_process(dp):
    children = psutil.Process(dp.proc.pid).children(recursive=True)
    assert any("router" in " ".join(p.cmdline()) for p in children)
    alive = [url for url, pid in replicas(dp).items() if psutil.pid_exists(pid)]
    result = {}

    def generate() -> None:
        with dp.client() as client:
            body = {"text": "Once upon a time", "sampling_params": {
                "max_new_tokens": 24, "ignore_eos": True}}  # fmt: skip
            result["response"] = client.post("/generate", json=body)

    thread = threading.Thread(target=generate)
    thread.start()
    deadline = time.monotonic() + 60
    while not any(replica_info(u)["running_requests"] for u in alive):
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.1)
    dp.proc.send_signal(signal.SIGTERM)  # while the request runs: it finishes, then all stop
    thread.join(60)
    response = result["response"]
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["completion_tokens"] == 24
    assert dp.proc.wait(60) == 0
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, alive
