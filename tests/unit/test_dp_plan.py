"""Placement of --dp replicas, the router's settings, and the routes the router reads."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from radix_runtime.config import ServerArgs
from radix_runtime.dp import supervisor as sup


def test_one_gpu_each():
    args = ServerArgs(dp=2, port=8000, api_key="k")
    plans = sup.plan_replicas(args, ["3", "5"], [0, 1, 2, 3], [9001, 9002])
    assert [p.env for p in plans] == [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    assert [p.args.port for p in plans] == [9001, 9002]
    assert all(p.args.host == "127.0.0.1" and p.args.dp == 1 for p in plans)
    assert [p.args.dp_rank for p in plans] == [0, 1]
    assert all(p.args.mem_fraction_static == args.mem_fraction_static for p in plans)
    assert all(p.args.api_key == "k" for p in plans)  # the router sends the same key


def test_replicas_sharing_a_gpu_split_its_memory():
    # each sizes its pool from the memory still free when it starts, one after another
    plans = sup.plan_replicas(ServerArgs(dp=2, mem_fraction_static=0.8), ["0"], [0], [1, 2])
    assert [p.gpu for p in plans] == ["0", "0"]
    assert [p.args.mem_fraction_static for p in plans] == pytest.approx([0.4, 0.8])
    fixed = sup.plan_replicas(ServerArgs(dp=2, max_total_tokens=4096), ["0"], [0], [1, 2])
    assert [p.args.mem_fraction_static for p in fixed] == [0.85, 0.85]


def test_cpu_replicas_split_the_cores():
    plans = sup.plan_replicas(ServerArgs(dp=2), [], [0, 1, 2, 3, 4], [1, 2])
    assert [p.cpus for p in plans] == [[0, 1], [2, 3]]
    assert [p.env["OMP_NUM_THREADS"] for p in plans] == ["2", "2"]
    crowded = sup.plan_replicas(ServerArgs(dp=3), [], [0, 1], [1, 2, 3])
    assert [p.cpus for p in crowded] == [None] * 3  # fewer cores than replicas: no pinning
    assert [p.env["OMP_NUM_THREADS"] for p in crowded] == ["1"] * 3


def test_kv_events_endpoints_per_replica():
    assert sup.replica_endpoint("tcp://*:5557", 1) == "tcp://*:5558"
    assert sup.replica_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv-2"
    assert sup.replica_endpoint(None, 1) is None
    plans = sup.plan_replicas(ServerArgs(dp=2, kv_events_endpoint="tcp://*:7000"), [], [0], [1, 2])
    assert [p.args.kv_events_endpoint for p in plans] == ["tcp://*:7000", "tcp://*:7001"]


def test_router_settings():
    args = ServerArgs(dp=2, host="0.0.0.0", port=8000, api_key="k", router_policy="round_robin")
    plans = sup.plan_replicas(args, [], [0, 1], [9001, 9002])
    settings = sup.router_settings(args, plans)
    assert settings["worker_urls"] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert (settings["host"], settings["port"]) == ("0.0.0.0", 8000)
    assert settings["policy"] == "round_robin" and settings["api_key"] == "k"
    assert settings["balance_abs_threshold"] == 4  # not the router's 64: docs/scaling.md
    router_args = pytest.importorskip("sglang_router.router_args")
    router_args.RouterArgs(**settings)  # every key is one of the router's fields


def test_bad_dp_flags_are_refused():
    with pytest.raises(ValueError, match="--dp"):
        ServerArgs(dp=0).validate()
    with pytest.raises(ValueError, match="--router-policy"):
        ServerArgs(router_policy="fastest").validate()


def test_missing_router_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(sup, "router_installed", lambda: False)
    assert sup.run_dp(ServerArgs(dp=2)) == 2
    assert "pip install 'radix_runtime[router]'" in capsys.readouterr().err


def test_get_load_in_sglangs_shape(server, monkeypatch):
    info = server.sched.server_info()
    cache = msgspec.structs.replace(info.cache, protected_pages=30, page_size=16)
    loaded = msgspec.structs.replace(info, cache=cache, running_requests=3, waiting_requests=2)
    monkeypatch.setattr(server.sched, "server_info", lambda: loaded)
    client = server.client
    assert client.get("/get_load").json() == [
        {"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 480}
    ]
    # the router asks for the new names first
    assert client.get("/model_info").json() == client.get("/get_model_info").json()
    assert client.get("/server_info").status_code == 200


def test_the_routers_placeholder_model_is_no_model(server):
    # SGLang's router forwards a chat request without "model" with "unknown" in it
    client = server.client
    body = {"model": "unknown", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    body["model"] = "another-model"
    assert client.post("/v1/chat/completions", json=body).status_code == 404


def test_router_args_go_on_top_of_the_supervisors():
    pytest.importorskip("sglang_router.router_args")
    from radix_runtime.dp.router import build_router_args

    args = ServerArgs(dp=2, port=8000)
    settings = sup.router_settings(args, sup.plan_replicas(args, [], [0, 1], [9001, 9002]))
    built = build_router_args(settings, "--balance-abs-threshold 4 --cache-threshold 0.5")
    assert (built.balance_abs_threshold, built.cache_threshold) == (4, 0.5)
    assert built.health_check_interval_secs == sup.HEALTH_CHECK_INTERVAL_S  # ours stay
    assert built.worker_urls == settings["worker_urls"] and built.port == 8000
    with pytest.raises(ValueError, match="--router-args"):
        build_router_args(settings, "--no-such-flag 1")


def test_bad_router_args_fail_before_anything_starts(capsys):
    pytest.importorskip("sglang_router.router_args")
    assert sup.run_dp(ServerArgs(dp=2, router_args="--no-such-flag 1")) == 2
    assert "--router-args" in capsys.readouterr().err


def test_router_gets_the_one_key_and_refuses_tenants():
    args = ServerArgs(dp=2, port=8000, api_key=["k"])  # as argparse gives it
    plans = sup.plan_replicas(args, [], [0, 1], [1, 2])
    assert sup.router_settings(args, plans)["api_key"] == "k"
    for bad in ({"api_key": ["a", "b"]}, {"api_key": "a", "cache_isolation": "api-key"}):
        with pytest.raises(ValueError, match="one --api-key"):
            ServerArgs(dp=2, **bad).validate()


class ExitedOrNot:
    """What the supervisor reads of a child process: poll() -> None while it runs."""

    def __init__(self) -> None:
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code


def test_the_supervisors_health_reports_a_dead_replica():
    args = ServerArgs(dp=2, port=8000)
    supervisor = sup.Supervisor(args)
    supervisor.plans = sup.plan_replicas(args, [], [0, 1], [9001, 9002])
    supervisor.replicas = {0: ExitedOrNot(), 1: ExitedOrNot()}
    supervisor.router = ExitedOrNot()
    port = sup.free_port()
    health = sup.HealthServer(supervisor, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}/health"
    try:
        ok = httpx.get(url, timeout=5)
        assert ok.status_code == 200 and ok.json()["status"] == "ok"
        assert [r["alive"] for r in ok.json()["replicas"]] == [True, True]
        supervisor.replicas[1].code = -9
        dead = httpx.get(url, timeout=5)
        assert dead.status_code == 503 and dead.json()["status"] == "degraded"
        error = dead.json()["error"]
        assert error["code"] == "replica_dead" and error["type"] == "server_error"
        assert "replica 1 (http://127.0.0.1:9002) exited with code -9" in error["message"]
        assert [r["alive"] for r in dead.json()["replicas"]] == [True, False]
        assert httpx.get(f"http://127.0.0.1:{port}/other", timeout=5).status_code == 404
    finally:
        health.close()
