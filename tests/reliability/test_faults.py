"""Faults: clients that leave, memory pressure, dying and hanging processes, shutdown.

Cases that keep the server alive use the shared `default_server` and end with
`assert_no_leak`; cases that kill a process start their own server.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import socket
import threading
import time

import httpx
import pytest
import reliability_support as support
from reliability_support import (
    FAST_FLAGS,
    assert_error_shape,
    assert_no_leak,
    health_status,
    processes,
    record,
    server_info,
    wait_all_exit,
    wait_for,
    wait_idle,
)

from radix_runtime.worker.main import HANG_AT_STEP_ENV

pytestmark = pytest.mark.slow

# a generation that would run for minutes unless something stops it
ENDLESS = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}


def sse_events(response: httpx.Response) -> list:
    """The JSON payloads of an SSE response (and "[DONE]")."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def steps(client: httpx.Client) -> int:
    return server_info(client)["decode_steps"]


# ---------------------------------------------------------------------------------------------
# clients that go away


def test_disconnect_mid_stream(default_server):
    h = default_server
    with h.client() as c:
        assert_no_leak(h)
        with httpx.Client(base_url=h.url, timeout=120) as streamer:
            body = {"prompt": "Once upon a time", "stream": True, **ENDLESS}
            with streamer.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                seen, started = 0, time.monotonic()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        seen += 1
                        if seen == 5:
                            break
                step_s = (time.monotonic() - started) / seen
                before = steps(c)
        # the client (and its connection) is gone: count the steps the request still ran
        gone = time.monotonic()
        info = wait_idle(c, timeout=60)
        latency = time.monotonic() - gone
        extra_steps = info["decode_steps"] - before
    assert_no_leak(h)
    record(
        "disconnect mid-stream",
        abort_s=latency,
        steps_after_disconnect=extra_steps,
        step_s=step_s,
    )
    # the step in flight when the abort lands may finish; the one after it must not start.
    # (+1: the step that runs between reading `before` and closing the socket)
    assert extra_steps <= 3, extra_steps


def test_disconnect_mid_non_stream(default_server):
    h = default_server
    body = json.dumps({"prompt": "Once upon a time", **ENDLESS}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with h.client() as c:
        start = steps(c)
        sock = socket.create_connection(("127.0.0.1", h.port))
        try:
            sock.sendall(head + body)
            wait_for(lambda: steps(c) >= start + 5, 60, what="the request to decode")
            before = steps(c)
        finally:
            sock.close()
        gone = time.monotonic()
        info = wait_idle(c, timeout=60)
        latency = time.monotonic() - gone
        extra_steps = info["decode_steps"] - before
    assert_no_leak(h)
    record("disconnect mid-non-stream", abort_s=latency, steps_after_disconnect=extra_steps)
    assert extra_steps <= 3, extra_steps


def test_concurrent_shared_prefixes_with_cancellations(default_server):
    """200 requests over 4 shared system prompts, a quarter cancelled at random moments."""
    h = default_server
    rng = random.Random(6)
    prefixes = [
        f"You are assistant number {k}. Answer briefly and politely. " * 3 for k in range(4)
    ]
    n, n_cancel = 200, 50
    cancel_at = dict(zip(rng.sample(range(n), n_cancel), (rng.uniform(0, 2) for _ in range(n))))

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str | None]:
        body = {
            "prompt": prefixes[i % 4] + f"Question {i}: {i} plus {i}?",
            "max_tokens": rng.choice([1, 2, 4]),
            "temperature": 0,
            "stream": i % 2 == 0,
        }
        if not body["stream"]:
            r = await client.post("/v1/completions", json=body)
            return r.status_code, r.json()["choices"][0]["finish_reason"]
        async with client.stream("POST", "/v1/completions", json=body) as r:
            finish = None
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
            return r.status_code, finish

    async def run() -> list:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=h.url, timeout=600, limits=limits) as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(n)]
            loop = asyncio.get_running_loop()
            for i, delay in cancel_at.items():
                loop.call_later(delay, tasks[i].cancel)
            return await asyncio.gather(*tasks, return_exceptions=True)

    started = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - started
    cancelled = [i for i, r in enumerate(results) if isinstance(r, asyncio.CancelledError)]
    failures = [
        (i, r)
        for i, r in enumerate(results)
        if i not in cancelled and (isinstance(r, BaseException) or r[0] != 200)
    ]
    unfinished = [
        i for i, r in enumerate(results) if i not in cancelled and r[1] not in ("stop", "length")
    ]
    info = assert_no_leak(h)
    record(
        "200 concurrent, shared prefixes, cancellations",
        requests=n,
        cancelled_in_flight=len(cancelled),
        completed=n - len(cancelled),
        errors=len(failures),
        wall_s=elapsed,
        hit_rate=round(info["cache"]["hit_rate"], 3),
    )
    assert not failures, failures[:5]
    assert not unfinished, unfinished[:5]
    assert cancelled, "no cancellation landed while requests were in flight"


# ---------------------------------------------------------------------------------------------
# memory pressure: a pool far smaller than the work


SMALL_POOL = 200  # tokens of KV; the 8 counting requests below need ~350 at once
COUNT_PROMPTS = [
    f"Count from {k} upwards: {k}, {k + 1}, {k + 2}," for k in (3, 17, 40, 58, 71, 90, 123, 200)
]
COUNT_TOKENS = 24


@pytest.fixture(scope="module")
def small_pool_server(tmp_path_factory):
    # admission reserving only the decoders' next pages: the pool runs out and retracts
    handle = support.start_server(
        str(tmp_path_factory.mktemp("small_pool")),
        "--max-total-tokens", str(SMALL_POOL),
        "--schedule-conservativeness", "0",
    )  # fmt: skip
    yield handle
    handle.stop()


def _counts(url: str, prompts: list[str]) -> list[dict]:
    """Run the prompts concurrently (greedy, fixed length); return the first choice of each."""
    out: list = [None] * len(prompts)

    def one(i: int) -> None:
        r = httpx.post(
            f"{url}/v1/completions",
            json={
                "prompt": prompts[i],
                "max_tokens": COUNT_TOKENS,
                "ignore_eos": True,
                "temperature": 0,
            },
            timeout=600,
        )
        assert r.status_code == 200, r.text
        out[i] = r.json()["choices"][0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(o is not None for o in out)
    return out


def test_server_info_reports_zero_counters(small_pool_server):
    """A fresh server reports its counters as 0 rather than leaving them out."""
    with small_pool_server.client() as c:
        info = server_info(c)
    assert info["retractions"] == 0 and info["decode_steps"] == 0, info
    assert info["cache"]["protected_pages"] == 0


def test_kv_oversubscription_evicts_then_retracts(default_server, small_pool_server):
    """Eviction first, then retraction and requeue; greedy outputs equal an unpressured run."""
    h = small_pool_server
    unpressured = _counts(default_server.url, COUNT_PROMPTS)
    with h.client() as c:
        # cached prefixes the pressure must evict before it may retract anyone
        fillers = [f"Filler document {k}: " + "lorem ipsum dolor sit amet " * 6 for k in range(2)]
        for text in fillers:
            assert support.completion(c, text, max_tokens=1).status_code == 200
        before = wait_idle(c)
        evictable_before = before["cache"]["evictable_pages"]
        started = time.monotonic()
        pressured = _counts(h.url, COUNT_PROMPTS)
        elapsed = time.monotonic() - started
        after = wait_idle(c)
        refill = support.completion(c, fillers[0], max_tokens=1).json()
    retractions = after["retractions"] - before["retractions"]
    filler_cached = refill["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert_no_leak(h)
    same = sum(a["text"] == b["text"] for a, b in zip(pressured, unpressured))
    record(
        f"KV oversubscription (pool {SMALL_POOL} tokens)",
        retractions=retractions,
        evictable_before=evictable_before,
        filler_cached_after=f"{filler_cached}/{refill['usage']['prompt_tokens']}",
        outputs_equal=f"{same}/{len(COUNT_PROMPTS)}",
        wall_s=elapsed,
    )
    assert evictable_before > 0
    assert retractions > 0, "the pool never ran out: the case did not exercise retraction"
    assert filler_cached < refill["usage"]["prompt_tokens"] - 1, "the cached filler survived"
    for p, a, b in zip(COUNT_PROMPTS, pressured, unpressured):
        assert a["finish_reason"] == "length"
        assert a["text"] == b["text"], (p, a["text"], b["text"])


def test_request_that_can_never_fit(small_pool_server):
    """A prompt larger than the whole pool: an immediate 400; the requests around it proceed."""
    h = small_pool_server
    results: dict[str, httpx.Response] = {}

    def send(name: str, prompt) -> None:
        results[name] = httpx.post(
            f"{h.url}/v1/completions",
            json={"prompt": prompt, "max_tokens": 8, "temperature": 0},
            timeout=300,
        )

    threads = [
        threading.Thread(target=send, args=(f"before{i}", f"Say hello number {i}."))
        for i in range(3)
    ]
    for t in threads:
        t.start()
    started = time.monotonic()
    send("huge", [1000 + (i % 500) for i in range(SMALL_POOL + 50)])
    reject_s = time.monotonic() - started
    after = [
        threading.Thread(target=send, args=(f"after{i}", f"Say goodbye number {i}."))
        for i in range(3)
    ]
    for t in after:
        t.start()
    for t in threads + after:
        t.join()
    err = assert_error_shape(results.pop("huge"), 400)
    assert err["code"] == "kv_cache_too_small", err
    for name, r in results.items():
        assert r.status_code == 200, (name, r.text)
    assert_no_leak(h)
    record("request larger than the pool", status=400, reject_s=reject_s, others_ok=len(results))
    assert reject_s < 10


# ---------------------------------------------------------------------------------------------
# processes that die


def _in_flight(url: str) -> tuple[dict, list[threading.Thread]]:
    """One streaming and one non-streaming endless request in background threads; each records
    what it got and when."""
    got: dict = {}

    def plain() -> None:
        try:
            r = httpx.post(
                f"{url}/v1/completions", json={"prompt": "Tell me a story.", **ENDLESS}, timeout=60
            )
            got["plain"] = (r.status_code, r.json(), time.monotonic())
        except httpx.HTTPError as exc:
            got["plain"] = (None, repr(exc), time.monotonic())

    def stream() -> None:
        body = {"prompt": "Tell me a long story.", "stream": True, **ENDLESS}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                events = sse_events(r)
            got["stream"] = (r.status_code, events, time.monotonic())
        except httpx.HTTPError as exc:
            got["stream"] = (None, repr(exc), time.monotonic())

    threads = [threading.Thread(target=f, daemon=True) for f in (plain, stream)]
    for t in threads:
        t.start()
    return got, threads


@pytest.mark.parametrize("role", ["scheduler", "worker"])
def test_sigkill_child(launch_server, role):
    h = launch_server(*FAST_FLAGS)
    procs = processes(h)
    with h.client() as c:
        got, threads = _in_flight(h.url)
        wait_for(lambda: server_info(c)["running_requests"] == 2, 60, what="2 running requests")
        wait_for(lambda: steps(c) >= 3, 60)
    killed = time.monotonic()
    support.kill(procs[role], signal.SIGKILL)
    to_503 = wait_for(lambda: health_status(h.url) == 503, 10, interval=0.02, what="/health 503")
    for t in threads:
        t.join(30)
    assert set(got) == {"plain", "stream"}, f"in-flight requests hung: {got}"
    # the non-streaming request: an error response (503), not a hang and not a 200
    status, body, when = got["plain"]
    assert status == 503, got["plain"]
    assert body["error"]["code"] == "server_error", body
    plain_s = when - killed
    # the stream: already 200, so the failure arrives as an error event before [DONE]
    status, events, when = got["stream"]
    assert status == 200 and isinstance(events, list), got["stream"]
    assert any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
    assert events[-1] == "[DONE]"
    stream_s = when - killed
    code = h.proc.wait(30)  # before psutil reaps it, which would hide the exit code
    exit_s = wait_all_exit([procs["scheduler"], procs["worker"]], timeout=30)
    record(
        f"SIGKILL the {role}",
        to_503_s=to_503,
        non_stream_error_s=plain_s,
        stream_error_s=stream_s,
        all_exited_s=round(time.monotonic() - killed, 2),
        exit_code=code,
    )
    assert code != 0, "a server that lost a child must not exit 0"
    assert to_503 < 5
    assert exit_s < 30


def test_sigkill_parent(launch_server):
    h = launch_server(*FAST_FLAGS)
    procs = processes(h)
    sockets = support.ipc_dir(h)
    killed = time.monotonic()
    support.kill(procs["tokenizer"], signal.SIGKILL)
    h.proc.wait(10)
    children = [procs["scheduler"], procs["worker"]]
    exit_s = wait_all_exit(children, timeout=15)
    left = os.path.exists(sockets)
    shutil.rmtree(sockets, ignore_errors=True)  # nobody is left to remove it (see the docs)
    record(
        "SIGKILL the parent (tokenizer)",
        children_exited_s=round(time.monotonic() - killed, 2),
        ipc_dir_left_behind=left,
    )
    assert exit_s < 15


# ---------------------------------------------------------------------------------------------
# shutdown and hangs


DRAIN_S = 20


def _request_thread(url: str, name: str, got: dict, *, stream: bool, endless: bool):
    """A background request recording (status, JSON body or SSE events, finish time)."""
    body = {"prompt": f"Name a colour ({name}).", "max_tokens": 4, "ignore_eos": True}
    if endless:
        body.update(ENDLESS)

    def run() -> None:
        try:
            if stream:
                with httpx.stream(
                    "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120
                ) as r:
                    got[name] = (r.status_code, sse_events(r), time.monotonic())
            else:
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
                got[name] = (r.status_code, r.json(), time.monotonic())
        except Exception as exc:  # recorded, so the test reports it instead of a thread error
            got[name] = (None, repr(exc), time.monotonic())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _assert_finished(got: dict, name: str) -> float:
    """The request completed normally; returns when."""
    status, body, when = got[name]
    assert status == 200, got[name]
    if isinstance(body, list):  # SSE
        assert body[-1] == "[DONE]", body[-3:]
        assert body[-2]["choices"][0]["finish_reason"] == "length", body[-3:]
    else:
        assert body["choices"][0]["finish_reason"] == "length", body
    return when


@pytest.mark.parametrize("target", ["parent", "every process"])
def test_sigterm_drains(launch_server, target):
    """SIGTERM: new requests get 503 at once, in-flight ones finish, a request that outlives
    --drain-timeout gets a 503 when it expires, and every process exits with 0.

    "every process": what systemd (KillMode=control-group), `timeout` or `kill -- -PGID` do;
    the children must leave the shutdown to the parent rather than die mid-drain."""
    h = launch_server(*FAST_FLAGS, "--drain-timeout", str(DRAIN_S))
    procs = processes(h)
    sockets = support.ipc_dir(h)
    got: dict = {}
    threads = [
        _request_thread(h.url, "plain", got, stream=False, endless=False),
        _request_thread(h.url, "stream", got, stream=True, endless=False),
    ]
    if target == "parent":  # the group case skips these to save the drain timeout
        threads += [
            _request_thread(h.url, "endless plain", got, stream=False, endless=True),
            _request_thread(h.url, "endless stream", got, stream=True, endless=True),
        ]
    with h.client() as c:
        wait_for(lambda: server_info(c)["running_requests"] == len(threads), 60, what="all running")
        sent = time.monotonic()
        victims = [procs["tokenizer"]] if target == "parent" else list(procs.values())
        for p in victims:
            support.kill(p, signal.SIGTERM)
        refused = wait_for(lambda: health_status(h.url) == 503, 5, interval=0.02)
        assert_error_shape(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 503)
    for t in threads:
        t.join(DRAIN_S + 30)
    code = h.proc.wait(30)
    exited = time.monotonic() - sent
    wait_all_exit([procs["scheduler"], procs["worker"]], timeout=15)
    finished = max(_assert_finished(got, "plain"), _assert_finished(got, "stream")) - sent
    numbers = {"refused_503_s": refused, "in_flight_finished_s": round(finished, 2)}
    if target == "parent":
        status, body, when = got["endless plain"]
        assert status == 503, got["endless plain"]
        assert "drain-timeout" in body["error"]["message"], body
        status, events, when_s = got["endless stream"]
        assert status == 200 and events[-1] == "[DONE]", got["endless stream"]
        assert "drain-timeout" in events[-2]["error"]["message"], events[-3:]
        numbers["endless_got_503_s"] = round(max(when, when_s) - sent, 2)
    record(
        f"SIGTERM to {target} (--drain-timeout {DRAIN_S})",
        **numbers,
        exited_s=round(exited, 2),
        exit_code=code,
    )
    assert finished < DRAIN_S
    assert exited < DRAIN_S + 10
    assert code == 0
    assert not os.path.exists(sockets), "a clean shutdown removes the ipc directory"


def test_hung_worker_watchdog(launch_server):
    """The worker sleeps forever at step 4: the scheduler's watchdog reports it, the in-flight
    request fails with that report, and every process exits."""
    h = launch_server(*FAST_FLAGS, "--watchdog-timeout", "5", env={HANG_AT_STEP_ENV: "4"})
    procs = processes(h)
    sent = time.monotonic()
    r = httpx.post(
        f"{h.url}/v1/completions",
        json={"prompt": "Hello", "max_tokens": 16, "ignore_eos": True},
        timeout=60,
    )
    failed_s = time.monotonic() - sent
    err = assert_error_shape(r, 503)
    assert "watchdog-timeout" in err["message"], err
    assert health_status(h.url) in (503, None)
    code = h.proc.wait(30)
    exit_s = wait_all_exit([procs["scheduler"], procs["worker"]], timeout=30)
    log = h.log()
    assert "did not finish step 4" in log
    record(
        "hung worker (watchdog 5 s)",
        request_failed_s=failed_s,
        all_exited_s=round(time.monotonic() - sent, 2),
        exit_code=code,
    )
    assert code != 0
    assert exit_s < 30
