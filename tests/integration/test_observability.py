"""/metrics, /flush_cache under load, /cache_tree and the dashboard's inputs, on one real server
(the default model, behind --api-key) shared by the module."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_support import start_server

KEY = "sk-metrics-test-7f3a"
MODEL = "SmolLM2-135M-Instruct"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    handle = start_server(
        str(tmp_path_factory.mktemp("metrics")),
        "--max-total-tokens", "16384", "--api-key", KEY,
    )  # fmt: skip
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(server):
    with server.client(timeout=120) as c:
        yield c


_rng = random.Random(15)


def fresh_ids(n: int) -> list[int]:
    """Token ids no other request of this module starts with (nothing cached matches them)."""
    return [_rng.randrange(1000, 40000) for _ in range(n)]


def generate(client: httpx.Client, ids: list[int], new: int, **extra) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True, **extra},
    }
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def scrape(client: httpx.Client) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, parsed by prometheus-client's own parser: (name, labels) -> value."""
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            assert s.labels.get("model_name") == MODEL, s
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def val(metrics: dict, name: str, **labels) -> float:
    return metrics[("radix_runtime:" + name, tuple(sorted(labels.items())))]


def finished(metrics: dict) -> float:
    return sum(val(metrics, "request_success_total", finished_reason=r) for r in ("stop", "length", "abort"))  # fmt: skip


def wait_idle(client: httpx.Client, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = client.get("/get_server_info").json()
        if info["running_requests"] == 0 and info["waiting_requests"] == 0:
            return info
        assert time.monotonic() < deadline, "the server did not become idle"
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------


def test_metrics_needs_the_key(server):
    assert httpx.get(server.url + "/metrics").status_code == 401
    wrong = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    # the page itself is open (it holds no data and asks for the key)
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert KEY not in page.text


def test_counters_move_by_the_tokens_of_known_requests(client):
    before = scrape(client)
    first_ids = fresh_ids(40)
    first = generate(client, first_ids, 6)
    mid = scrape(client)
    assert val(mid, "prompt_tokens_total") - val(before, "prompt_tokens_total") == 40
    assert val(mid, "generation_tokens_total") - val(before, "generation_tokens_total") == 6
    assert val(mid, "cached_tokens_total") == val(before, "cached_tokens_total")

    # the second turn: the whole first turn (prompt and output) is cached
    history = first_ids + first["output_ids"]
    second = generate(client, history + fresh_ids(9), 4)
    cached = second["meta_info"]["cached_tokens"]
    assert cached >= 40
    after = scrape(client)
    assert val(after, "prompt_tokens_total") - val(mid, "prompt_tokens_total") == len(history) + 9
    assert val(after, "cached_tokens_total") - val(mid, "cached_tokens_total") == cached
    assert val(after, "generation_tokens_total") - val(mid, "generation_tokens_total") == 4
    got = val(after, "request_success_total", finished_reason="length")
    assert got - val(before, "request_success_total", finished_reason="length") == 2

    # the same totals as /get_server_info, which the scheduler counts on its own
    info = client.get("/get_server_info").json()["cache"]
    assert val(after, "prompt_tokens_total") == info["prompt_tokens"]
    assert val(after, "cached_tokens_total") == info["cached_tokens"]
    assert val(after, "cache_hit_rate") == pytest.approx(info["hit_rate"])


def test_histograms_count_every_finished_request(server, client):
    before = scrape(client)
    n_plain = 5

    def plain(i: int) -> dict:
        return generate(client, fresh_ids(12 + i), 3 + i)

    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(plain, range(n_plain)))
    # finished by a stop string in the tokenizer process: reason "stop"
    r = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 24, "temperature": 0,
              "stop": [","]},
    )  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
    # a client that leaves mid-stream: reason "abort"
    body = {
        "input_ids": fresh_ids(10),
        "stream": True,
        "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
    }
    with (
        httpx.Client(base_url=server.url, headers=client.headers, timeout=60) as c,
        c.stream("POST", "/generate", json=body) as resp,
    ):
        for line in resp.iter_lines():
            if line.startswith("data:"):
                break
    deadline = time.monotonic() + 30
    while True:
        after = scrape(client)
        if val(after, "num_aborted_requests_total") > val(before, "num_aborted_requests_total"):
            break
        assert time.monotonic() < deadline, "the aborted stream was not counted"
        time.sleep(0.2)
    wait_idle(client)
    after = scrape(client)

    def delta(name: str, **labels) -> float:
        return val(after, name, **labels) - val(before, name, **labels)

    assert delta("request_success_total", finished_reason="length") == n_plain
    assert delta("request_success_total", finished_reason="stop") == 1
    assert delta("request_success_total", finished_reason="abort") == 1
    assert delta("num_aborted_requests_total") == 1
    total = n_plain + 2
    assert finished(after) - finished(before) == total
    assert delta("e2e_request_latency_seconds_count") == total
    assert delta("time_to_first_token_seconds_count") == total
    # every output token after the first is one inter-token gap (plus those of the stop and
    # the aborted requests, whose lengths are not known here)
    gaps = sum(len(r["output_ids"]) - 1 for r in results)
    assert delta("inter_token_latency_seconds_count") >= gaps > 0
    assert delta("queue_time_seconds_count") == total
    assert delta("prefill_time_seconds_count") == total
    assert delta("step_time_seconds_count") == delta("batch_size_count") > 0
    # the rest of a TTFT: the scheduler's inbox and the first token's way back, per request;
    # the worker's launch and held result, per step
    assert delta("inbox_time_seconds_count") == total
    assert delta("first_token_transit_seconds_count") == total
    steps = delta("step_time_seconds_count")
    assert delta("launch_time_seconds_count") == delta("result_held_time_seconds_count") == steps
    assert delta("launch_time_seconds_sum") > 0
    # inbox, queue, prefill and transit are disjoint parts of each request's TTFT (one clock)
    parts = sum(
        delta(f"{k}_seconds_sum")
        for k in ("inbox_time", "queue_time", "prefill_time", "first_token_transit")
    )
    assert 0 < parts <= delta("time_to_first_token_seconds_sum")
    # histogram buckets: cumulative, +Inf == count
    for name in ("time_to_first_token_seconds", "step_time_seconds", "batch_size"):
        buckets = sorted(
            (float(dict(k[1])["le"]), v)
            for k, v in after.items()
            if k[0] == f"radix_runtime:{name}_bucket"
        )
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and buckets[-1][0] == float("inf")
        assert counts[-1] == val(after, f"{name}_count")


def test_concurrent_scrapes_during_load_never_error_and_never_go_back(client):
    """The scheduler ships increments and starts from zero after each report (a stats reset on
    every scrape): what /metrics shows must still only grow, whoever scrapes when."""
    stop = threading.Event()
    problems: list[str] = []
    series: list[list[dict]] = [[] for _ in range(3)]

    def scraper(k: int) -> None:
        while not stop.is_set():
            try:
                series[k].append(scrape(client))
            except Exception as exc:  # recorded, asserted below
                problems.append(repr(exc))
                return
            stop.wait(0.02)  # the 2-core CI machine also runs the server

    threads = [threading.Thread(target=scraper, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        with cf.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: generate(client, fresh_ids(30), 8), range(6)))
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not problems, problems
    monotonic = ("_total", "_count", "_sum", "_bucket")
    for runs in series:
        assert len(runs) >= 2
        for earlier, later in zip(runs, runs[1:]):
            for key, value in earlier.items():
                if key[0].endswith(monotonic):
                    assert later[key] >= value, (key, value, later[key])


def test_flush_under_load(client):
    probe = fresh_ids(48)
    generate(client, probe, 2)
    assert generate(client, probe, 2)["meta_info"]["cached_tokens"] == 47  # cached
    checks_before = wait_idle(client)["integrity_checks"]

    errors: list[str] = []
    flushes: list[dict] = []

    def load(i: int) -> None:
        try:
            generate(client, fresh_ids(64), 16)
        except Exception as exc:
            errors.append(repr(exc))

    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(load, i) for i in range(4)]
        deadline = time.monotonic() + 60
        # running, their computed prefixes in the tree (locked)
        while client.get("/get_server_info").json()["cache"]["protected_pages"] == 0:
            assert time.monotonic() < deadline, "the load did not start"
            time.sleep(0.05)
        for route in ("/flush_cache", "/reset_prefix_cache"):
            r = client.post(route)
            assert r.status_code == 200, r.text
            flushes.append(r.json())
        cf.wait(futures)
    assert not errors, errors
    first = flushes[0]
    assert first["success"] and first["dropped_tokens"] >= 48  # the probe's path went
    assert first["kept_pages"] > 0  # the running requests' prefixes stayed, locked
    info = wait_idle(client)
    time.sleep(0.5)  # the scheduler checks integrity once idle (a failure is fatal)
    info = client.get("/get_server_info").json()
    assert info["integrity_checks"] > checks_before
    assert client.get("/health").status_code == 200
    # nothing of the probe survived: the same prompt computes everything again
    assert generate(client, probe, 2)["meta_info"]["cached_tokens"] == 0

    # idle: a flush drops the whole tree
    r = client.post("/flush_cache").json()
    assert r["kept_pages"] == 0
    info = client.get("/get_server_info").json()["cache"]
    assert info["evictable_pages"] == info["protected_pages"] == 0
    assert info["free_pages"] == info["total_pages"]


def test_cache_tree_shows_shared_prefixes(client):
    client.post("/flush_cache")
    system = fresh_ids(60)
    for _ in range(3):
        generate(client, system + fresh_ids(20), 3)
    tree = client.get("/cache_tree", params={"max_depth": 2}).json()
    root = tree["root"]
    assert not tree["truncated"] and tree["total_nodes"] == tree["visited"] >= 4
    info = client.get("/get_server_info").json()["cache"]
    cached = info["evictable_pages"] + info["protected_pages"]
    assert root["subtree_tokens"] == cached * info["page_size"]
    [shared] = root["children"]  # the system prompt is one branch...
    assert shared["tokens"] == 60 and shared["head_ids"] == system[:16]
    assert len(shared["children"]) == 3  # ...with three conversations under it
    assert shared["subtree_tokens"] == 60 + sum(c["subtree_tokens"] for c in shared["children"])
    ages = [c["age"] for c in shared["children"]]
    assert min(ages) == 0 and len(set(ages)) == 3  # the newest has age 0
    narrow = client.get("/cache_tree", params={"max_depth": 2, "max_children": 1}).json()
    [kept] = narrow["root"]["children"][0]["children"]
    assert narrow["root"]["children"][0]["other_children"] == 2
    assert (
        narrow["root"]["children"][0]["other_tokens"] + kept["subtree_tokens"] + 60
        == (shared["subtree_tokens"])
    )
    bad = client.get("/cache_tree", params={"max_depth": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_depth"


def test_monitoring_examples_query_only_exported_metrics(client):
    """Every metric the Grafana dashboard and the /dashboard page query is exported."""
    exported = {name for name, _ in scrape(client)}
    grafana = json.loads((ROOT / "examples/monitoring/grafana_dashboard.json").read_text())
    exprs = [t["expr"] for p in grafana["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8
    page = (ROOT / "radix_runtime/server/static/dashboard.html").read_text()
    names = set()
    for text in [*exprs, page]:
        names.update(re.findall(r"radix_runtime:[a-z0-9_:]+", text))
    assert len(names) >= 12
    # the page reads a histogram by its family name (then its _bucket samples)
    missing = sorted(n for n in names if n not in exported and n + "_bucket" not in exported)
    assert not missing, f"queried but not exported: {missing}"
    scrape_cfg = (ROOT / "examples/monitoring/prometheus.yml").read_text()
    assert "/metrics" in scrape_cfg or "metrics_path" not in scrape_cfg


# ---------------------------------------------------------------------------------------------
# the live page in a real browser


def _browser():
    """Debian's Chromium driven by Playwright, or a reason to skip."""
    import shutil

    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        return None, "no Chromium (Debian: apt-get install chromium; scripts/setup.sh tries)"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None, "the playwright package is not installed (pip install playwright)"
    return (exe, sync_playwright), None


def _shown(page, element_id: str) -> str:
    return page.text_content(f"#{element_id}").strip()


def _number(text: str) -> float:
    return float(text.replace(",", "").rstrip("%"))


def test_dashboard_in_a_real_browser(server, client, tmp_path):
    found, reason = _browser()
    if found is None:
        print(f"SKIPPED test_dashboard_in_a_real_browser: {reason}")
        pytest.skip(reason)
    exe, sync_playwright = found
    # conversations sharing a system prompt: one branch with a few under it in the tree picture
    system = "You are a concise assistant for a demo of the radix_runtime prefix cache."
    questions = ["Name a prime number.", "What colour is the sky?", "Say hello in French."]
    artifacts = Path(os.environ.get("RADIX_RUNTIME_TEST_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / "dashboard.png"
    urls: list[str] = []
    with sync_playwright() as p:
        try:
            browser = p.chromium.launch(
                executable_path=exe,
                args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
            )
        except Exception as exc:  # e.g. a Chromium whose libraries are missing
            print(f"SKIPPED test_dashboard_in_a_real_browser: {exe} did not start: {exc}")
            pytest.skip(f"{exe} did not start: {exc}")
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            auth_headers: list[str | None] = []

            def on_request(request):
                urls.append(request.url)
                if request.url.endswith("/metrics"):
                    auth_headers.append(request.headers.get("authorization"))

            page.on("request", on_request)
            page.goto(server.url + "/dashboard")
            page.wait_for_selector("#auth-key", state="visible", timeout=30000)  # 401: asks
            page.fill("#auth-key", KEY)
            page.click("#auth-form button")
            page.wait_for_function("Number(document.body.dataset.updates) >= 1", timeout=30000)
            # the page watches while two turns of three conversations run
            with cf.ThreadPoolExecutor(3) as pool:
                replies = list(pool.map(lambda q: _chat(client, system, [q]), questions))
                list(
                    pool.map(
                        lambda qa: _chat(client, system, [*qa, "Thanks! One more, please."]),
                        zip(questions, replies),
                    )
                )
            wait_idle(client)
            page.wait_for_function("Number(document.body.dataset.treeUpdates) >= 2", timeout=30000)
            # a fresh scrape, taken after the server went idle
            seen = int(page.evaluate("document.body.dataset.updates"))
            page.wait_for_function(f"Number(document.body.dataset.updates) > {seen}", timeout=30000)
            info = client.get("/get_server_info").json()
            cache = info["cache"]
            assert _number(_shown(page, "prompt-tokens")) == cache["prompt_tokens"]
            assert _number(_shown(page, "cached-tokens")) == cache["cached_tokens"]
            assert _shown(page, "hit-rate-total") == f"{100 * cache['hit_rate']:.1f}%"
            assert _number(_shown(page, "running")) == info["running_requests"] == 0
            assert _number(_shown(page, "waiting")) == info["waiting_requests"] == 0
            for state in ("free", "evictable", "protected"):
                assert _number(_shown(page, f"kv-{state}")) == cache[f"{state}_pages"], state
            assert _number(_shown(page, "kv-capacity")) == cache["total_pages"]
            assert _shown(page, "ttft-p50").endswith(("ms", "s"))
            # the tree picture: a box per node, the shared system prompt among them
            boxes = page.locator("#tree-svg rect").count()
            assert boxes >= 1 + len(questions)
            assert "concise assistant" in page.text_content("#tree-svg")
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    print(f"dashboard screenshot: {shot}")
    assert shot.stat().st_size > 10_000
    # the first scrape went without a key (401: the prompt), every one after it with the key
    assert auth_headers[0] is None and len(auth_headers) >= 3
    assert all(h == f"Bearer {KEY}" for h in auth_headers[1:])
    assert not any(KEY in u for u in urls), "the key went into a URL"


def _chat(client: httpx.Client, system: str, turns: list[str]) -> str:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]
