"""`radix-runtime serve --dp N`: N replicas on this host behind SGLang's router on --port.

The supervisor starts the replicas (each a whole server on a private 127.0.0.1 port: one GPU
each via CUDA_VISIBLE_DEVICES, or its share of the CPU cores), waits until every one is healthy,
then starts the router in front of them, and watches all of them:

- a replica that dies is logged at once and reported by the supervisor's own GET /health (on
  --dp-health-port, default --port + 1: 503 naming it; the router's /health is its liveness); the router's health checks (every 2 s here) take it out
  of rotation and its retries send what was in flight elsewhere; once no replica is left the
  supervisor stops everything and exits 1. A dead router stops everything too.
- SIGTERM drains: it is forwarded once to the router and every replica, which finish in-flight
  requests within --drain-timeout; SIGINT (Ctrl-C) stops them at once. Whatever still runs
  afterwards is killed. Children live in their own process groups (so a signal to ours is
  forwarded exactly once) and die with the supervisor (PR_SET_PDEATHSIG, see utils/procs.py).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import msgspec

from radix_runtime.config import ServerArgs
from radix_runtime.dp.router import MISSING, build_router_args, router_installed
from radix_runtime.frontend.errors import SERVER_ERROR, error_body
from radix_runtime.utils.procs import configure_logging, set_process_title, spawn_child

logger = logging.getLogger("radix_runtime.dp")

# the router's health checks: how fast a dead replica leaves the rotation (interval x threshold)
HEALTH_CHECK_INTERVAL_S = 2
HEALTH_FAILURE_THRESHOLD = 2
# cache_aware balances by queue length once loads differ by more than this (and by 1.5x)
BALANCE_ABS_THRESHOLD = 4
STARTUP_TIMEOUT_S = 3600.0  # like a single server: loading a large model takes long


@dataclass
class ReplicaPlan:
    index: int
    args: ServerArgs  # its own port on 127.0.0.1, dp=1, dp_rank=index
    env: dict[str, str] = field(default_factory=dict)
    cpus: list[int] | None = None
    gpu: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.args.port}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def visible_gpus(device: str) -> list[str]:
    """The GPUs replicas may use: CUDA_VISIBLE_DEVICES when set, else every CUDA device."""
    if device == "cpu":
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # no torch CUDA runtime: a CPU host
        return []


def replica_endpoint(endpoint: str | None, index: int) -> str | None:
    """Replica i's KV-events endpoint: the given TCP port + i (tcp://*:5557 -> 5558 for replica 1),
    or the ipc path with -i appended."""
    if endpoint is None:
        return None
    head, sep, port = endpoint.rpartition(":")
    if sep and port.isdigit() and "://" in head:
        return f"{head}:{int(port) + index}"
    return f"{endpoint}-{index}"


def plan_replicas(
    args: ServerArgs, gpus: list[str], cpus: list[int], ports: list[int]
) -> list[ReplicaPlan]:
    """Where each of the `args.dp` replicas runs. GPUs: replica i on gpus[i % len(gpus)]; when
    k replicas share a card, the j-th to start gets mem_fraction_static * (j + 1) / k, because
    each one sizes its KV pool from the memory still free (they start one after another).
    CPU: contiguous equal shares of the cores, torch threads to match."""
    n = args.dp
    plans = []
    for i in range(n):
        rargs = args.replace(
            host="127.0.0.1",
            port=ports[i],
            dp=1,
            dp_rank=i,
            kv_events_endpoint=replica_endpoint(args.kv_events_endpoint, i),
            kv_events_replay_endpoint=replica_endpoint(args.kv_events_replay_endpoint, i),
        )
        plan = ReplicaPlan(i, rargs)
        if gpus:
            plan.gpu = gpus[i % len(gpus)]
            plan.env["CUDA_VISIBLE_DEVICES"] = plan.gpu
            sharing = len(range(i % len(gpus), n, len(gpus)))
            if sharing > 1 and args.max_total_tokens is None:
                rank_on_gpu = i // len(gpus)
                plan.args = rargs.replace(
                    mem_fraction_static=args.mem_fraction_static * (rank_on_gpu + 1) / sharing
                )
        else:
            per = len(cpus) // n
            if per >= 1:
                plan.cpus = cpus[i * per : (i + 1) * per]
            plan.env["OMP_NUM_THREADS"] = str(max(per, 1))
        plans.append(plan)
    return plans


def replicas_share_a_gpu(plans: list[ReplicaPlan]) -> bool:
    """Whether two of `plans` run on one GPU: then each sizes its KV pool from the memory the
    ones before it left free, so they start one after another."""
    gpus = [p.gpu for p in plans if p.gpu is not None]
    return len(gpus) > len(set(gpus))


def router_settings(args: ServerArgs, plans: list[ReplicaPlan]) -> dict:
    """sglang_router's RouterArgs for the router in front of `plans`."""
    return {
        "worker_urls": [p.url for p in plans],
        "host": args.host,
        "port": args.port,
        "policy": args.router_policy,
        # NOTE: the router sends its own key to the replicas too: one key for both sides
        "api_key": (args.api_keys() or [None])[0],  # one at most with --dp (validate())
        # the router logs every request at info: its info is our debug
        "log_level": {"debug": "info", "info": "warn", "warning": "warn"}.get(
            args.log_level, args.log_level
        ),
        "prometheus_host": "127.0.0.1",
        "prometheus_port": free_port(),
        # NOTE: sglang-router's default, 64 requests, let cache_aware send a whole shared-prefix
        # workload to one replica (docs/scaling.md); the 1.5x relative threshold still keeps
        # busy replicas on cache affinity
        "balance_abs_threshold": BALANCE_ABS_THRESHOLD,
        "health_check_interval_secs": HEALTH_CHECK_INTERVAL_S,
        "health_failure_threshold": HEALTH_FAILURE_THRESHOLD,
        "health_success_threshold": 1,
        "shutdown_grace_period_secs": max(1, int(args.drain_timeout)),
        "max_payload_size": args.max_body_bytes,
        "worker_startup_timeout_secs": 60,
        "worker_startup_check_interval": 1,
    }


class HealthServer:
    """The supervisor's GET /health: 200 while the router and every replica live, else 503 with
    the OpenAI error body naming what died; both list every replica. (On --port the router
    answers /health with its own liveness, and /readiness stays 200 while any replica serves.)"""

    def __init__(self, sup: Supervisor, host: str, port: int) -> None:
        self.sup = sup

        class Handler(BaseHTTPRequestHandler):
            def do_GET(handler) -> None:  # noqa: N802 (http.server's name)
                if handler.path.split("?")[0] != "/health":
                    handler.send_error(404)
                    return
                status, body = self.report()
                payload = msgspec.json.encode(body)
                handler.send_response(status)
                handler.send_header("Content-Type", "application/json")
                handler.send_header("Content-Length", str(len(payload)))
                handler.end_headers()
                handler.wfile.write(payload)

            def log_message(handler, *args) -> None:  # probes are not news
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, name="dp-health", daemon=True
        )
        self.thread.start()

    def report(self) -> tuple[int, dict]:
        sup = self.sup
        replicas, dead = [], []
        for plan in sup.plans:
            code = sup.replicas[plan.index].poll()
            replicas.append(
                {"dp_rank": plan.index, "url": plan.url, "alive": code is None, "exit_code": code}
            )
            if code is not None:
                dead.append(f"replica {plan.index} ({plan.url}) exited with code {code}")
        router_code = sup.router.poll() if sup.router is not None else None
        if router_code is not None:
            dead.append(f"the router exited with code {router_code}")
        body = {"status": "degraded" if dead else "ok", "replicas": replicas}
        if not dead:
            return 200, body
        body.update(error_body("; ".join(dead), SERVER_ERROR, code="replica_dead"))
        return 503, body

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Supervisor:
    def __init__(self, args: ServerArgs):
        self.args = args
        self.replicas: dict[int, subprocess.Popen] = {}
        self.plans: list[ReplicaPlan] = []
        self.router: subprocess.Popen | None = None
        self.stop_signal: int | None = None
        self.stopping = threading.Event()
        self.dead: set[int] = set()
        self.health: HealthServer | None = None

    # -- signals ----------------------------------------------------------------------------

    def _on_signal(self, sig, frame) -> None:
        if self.stop_signal is not None and sig == signal.SIGINT:
            self._forward(signal.SIGKILL)  # a second Ctrl-C: now
        self.stop_signal = sig if self.stop_signal is None else self.stop_signal
        self.stopping.set()

    def _children(self) -> list[subprocess.Popen]:
        procs = list(self.replicas.values())
        return procs + ([self.router] if self.router is not None else [])

    def _forward(self, sig: int) -> None:
        for proc in self._children():
            if proc.poll() is None:
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    # -- starting ---------------------------------------------------------------------------

    def _spawn_replica(self, plan: ReplicaPlan) -> None:
        payload = {"args": plan.args.to_json(), "cpus": plan.cpus}
        self.replicas[plan.index] = spawn_child(
            "radix_runtime.dp.replica", payload, env=plan.env, new_session=True
        )
        where = f"GPU {plan.gpu}" if plan.gpu is not None else f"CPUs {plan.cpus or 'all'}"
        pid = self.replicas[plan.index].pid
        logger.info("replica %d: %s on %s (pid %d)", plan.index, plan.url, where, pid)

    def _wait_healthy(self, plans: list[ReplicaPlan], timeout: float) -> bool:
        pending = {p.index: p for p in plans}
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2) as client:
            while pending and time.monotonic() < deadline and not self.stopping.is_set():
                for index, plan in list(pending.items()):
                    code = self.replicas[index].poll()
                    if code is not None:
                        logger.error("replica %d exited with code %d while starting", index, code)
                        return False
                    try:
                        if client.get(plan.url + "/health").status_code == 200:
                            del pending[index]
                    except httpx.HTTPError:
                        pass
                self.stopping.wait(0.3)
        return not pending

    def _router_url(self) -> str:
        host = self.args.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.args.port}"

    def _wait_router(self, timeout: float = 120.0) -> bool:
        """Until the router answers and counts every replica healthy."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2) as client:
            while time.monotonic() < deadline and not self.stopping.is_set():
                if self.router.poll() is not None:
                    logger.error("the router exited with code %d", self.router.returncode)
                    return False
                try:
                    resp = client.get(self._router_url() + "/readiness")
                    if resp.status_code == 200 and (
                        resp.json().get("healthy_workers") == len(self.plans)
                    ):
                        return True
                except (httpx.HTTPError, ValueError):
                    pass
                self.stopping.wait(0.3)
        return False

    def start(self) -> bool:
        args = self.args
        gpus = visible_gpus(args.device)
        if args.device == "cuda" and not gpus:
            logger.error("--device cuda: no CUDA device is visible")
            return False
        cpus = sorted(os.sched_getaffinity(0))
        self.plans = plan_replicas(args, gpus, cpus, [free_port() for _ in range(args.dp)])
        if replicas_share_a_gpu(self.plans):
            for plan in self.plans:
                self._spawn_replica(plan)
                if not self._wait_healthy([plan], STARTUP_TIMEOUT_S):
                    return False
        else:
            for plan in self.plans:
                self._spawn_replica(plan)
            if not self._wait_healthy(self.plans, STARTUP_TIMEOUT_S):
                return False
        settings = router_settings(args, self.plans)
        self.router = spawn_child(
            "radix_runtime.dp.router",
            {"router": settings, "extra": args.router_args},
            new_session=True,
        )
        if not self._wait_router():
            return False
        health_port = args.dp_health_port or args.port + 1
        try:
            self.health = HealthServer(self, args.host, health_port)
        except OSError as exc:
            if args.dp_health_port:  # asked for by name: refuse to run without it
                logger.error("cannot serve /health on --dp-health-port %d: %s", health_port, exc)
                return False
            # NOTE: the default port (--port + 1) being taken must not stop the service
            logger.warning(
                "cannot serve the replicas' /health on port %d (%s); pass --dp-health-port",
                health_port,
                exc,
            )
        logger.info(
            "serving %d replicas behind the router (%s) on %s; their /health on port %s",
            len(self.plans),
            args.router_policy,
            self._router_url(),
            health_port if self.health is not None else "(none)",
        )
        return True

    # -- running ----------------------------------------------------------------------------

    def watch(self, interval: float = 0.2) -> int:
        """Until a signal, the router's death or the last replica's: the exit code."""
        while not self.stopping.wait(interval):
            for index, proc in self.replicas.items():
                if index not in self.dead and proc.poll() is not None:
                    self.dead.add(index)
                    self._remove_from_router(self.plans[index].url)
                    logger.error(
                        "replica %d (%s) exited with code %d; the router stops routing to it "
                        "(%d of %d replicas left)",
                        index,
                        self.plans[index].url,
                        proc.returncode,
                        len(self.plans) - len(self.dead),
                        len(self.plans),
                    )
            if len(self.dead) == len(self.plans):
                logger.error("no replica is left; shutting down")
                return 1
            if self.router.poll() is not None:
                logger.error(
                    "the router exited with code %d; shutting down", self.router.returncode
                )
                return 1
        return 0

    def _remove_from_router(self, url: str) -> None:
        """Take a dead replica out of the rotation now: the router's health checks would take
        HEALTH_CHECK_INTERVAL_S x HEALTH_FAILURE_THRESHOLD, and it does not retry a request
        whose connection was refused."""
        keys = self.args.api_keys()
        headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
        base = self._router_url()

        def listed(client: httpx.Client) -> list[dict]:
            resp = client.get(base + "/workers")
            resp.raise_for_status()
            return [w for w in resp.json().get("workers", []) if w.get("url") == url]

        try:
            with httpx.Client(timeout=5, headers=headers) as client:
                for worker in listed(client):
                    client.delete(f"{base}/workers/{worker['id']}").raise_for_status()
                deadline = time.monotonic() + 5  # the router removes it in the background
                while listed(client) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not listed(client):
                    logger.info("removed %s from the router", url)
                    return
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            logger.warning("could not remove %s from the router: %s", url, exc)
        logger.warning("the router's health checks will take %s out of rotation", url)

    def shutdown(self) -> None:
        if self.health is not None:
            self.health.close()
        sig = self.stop_signal if self.stop_signal is not None else signal.SIGTERM
        self._forward(sig)
        grace = self.args.drain_timeout + 5 if sig == signal.SIGTERM else 5.0
        deadline = time.monotonic() + grace
        for proc in self._children():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("pid %d outlived the shutdown; killing it", proc.pid)
                proc.kill()
                proc.wait()


def run_dp(args: ServerArgs) -> int:
    if not router_installed():
        print(f"radix-runtime: {MISSING}", file=sys.stderr)
        return 2
    try:  # a bad --router-args fails here, before anything starts
        build_router_args(router_settings(args, []), args.router_args)
    except ValueError as exc:
        print(f"radix-runtime: {exc}", file=sys.stderr)
        return 2
    set_process_title("dp_supervisor")
    configure_logging(args.log_level, "dp")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the health polls
    sup = Supervisor(args)
    previous = {s: signal.signal(s, sup._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if not sup.start():
            return 1 if sup.stop_signal is None else 0
        return sup.watch()
    finally:
        sup.shutdown()
        for s, handler in previous.items():
            signal.signal(s, handler)
