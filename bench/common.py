"""What the benchmarks share: a server to talk to (given by URL or launched as a subprocess), a
streaming client that times every token, Poisson pacing, the optimal hit rate of a trace,
percentiles, and JSON / PNG output.

Definitions used by every benchmark:
- TTFT: from sending the request to the first streamed event that carries an output token.
- ITL (inter-token latency): the gaps between later events; an event carrying k tokens counts as
  k gaps of (gap / k), so the ITLs of a request add up to its decode time.
- output tok/s and req/s: totals over the wall time from the first send to the last reply.
- hit rate: cached prompt tokens / prompt tokens, both summed from the replies' ``meta_info``
  (``usage`` for chat).
- optimal hit rate: the same trace against an infinite cache (:func:`optimal_cached_tokens`),
  page-aligned with the server's page size.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np

from bench.sse_client import HTTPStatusError, SSEClient

REPO_ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------------------------
# the trace


def safe_token_range(vocab_size: int) -> tuple[int, int]:
    """[lo, hi) of token ids for random prompts: clear of the low ids (bytes, specials in most
    vocabularies) and of the top of the vocabulary (added specials, e.g. Llama-3's 128000+)."""
    lo = min(1000, vocab_size // 8)
    hi = vocab_size - max(256, vocab_size // 64)
    if hi - lo < 2:
        return 0, vocab_size
    return lo, hi


def optimal_cached_tokens(
    requests: Sequence[tuple[Sequence[int], Sequence[int]]], page_size: int = 1
) -> list[int]:
    """Prompt tokens an infinite cache would hit, per request of ``requests`` ((prompt, answer)
    pairs in issue order): the longest prefix the prompt shares with what any earlier request
    computed, rounded down to whole pages (a cache of pages keeps only full ones).

    What a request computed is its prompt and its answer but the answer's last token: that one
    is sampled, never fed back, so no KV of it exists. For the same reason a prompt never hits in
    full: its last token must be computed to produce the first output."""
    seen: list[np.ndarray] = []
    out = []
    for prompt, answer in requests:
        p = np.asarray(prompt, dtype=np.int64)
        limit = len(p) - 1
        best = 0
        for s in seen:
            n = min(limit, len(s))
            if n <= best:
                continue
            diff = np.flatnonzero(p[:n] != s[:n])
            best = max(best, int(diff[0]) if diff.size else n)
            if best >= limit:
                break
        out.append(max(best, 0) // page_size * page_size)
        seen.append(np.concatenate([p, np.asarray(answer[:-1], dtype=np.int64)]))
    return out


def hit_rate(cached: int, prompt: int) -> float:
    return cached / prompt if prompt else 0.0


# ---------------------------------------------------------------------------------------------
# statistics


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100, linear interpolation); None for no values."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


@dataclass
class RequestResult:
    """One streamed generation, timed. ``start_s`` / ``end_s`` are seconds since the run began."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # of cached_tokens, loaded from a host tier (native API only)
    output_ids: list[int] = field(default_factory=list)
    output_tokens: int = 0
    text: str = ""
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    start_s: float = 0.0
    end_s: float = 0.0
    error: str | None = None


class LoopLag:
    """How late the client's own event loop wakes up (a task that sleeps `period_s` in a loop).

    A busy client delays the requests it sends and the tokens it sees, which a benchmark would
    report as server latency; this says how much of that there was."""

    def __init__(self, period_s: float = 0.005) -> None:
        self.period_s = period_s
        self.lags_s: list[float] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.period_s)
            self.lags_s.append(time.perf_counter() - t - self.period_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> dict:
        if self._task is not None:
            self._task.cancel()
        lags = [x * 1e3 for x in self.lags_s]
        return {
            "client_loop_lag_p50_ms": percentile(lags, 50),
            "client_loop_lag_p99_ms": percentile(lags, 99),
        }


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict:
    """The metrics every benchmark reports for a set of requests."""
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [x for r in ok for x in r.itls_s]
    latencies = [r.latency_s for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "duration_s": duration_s,
        "ttft_mean_s": float(np.mean(ttfts)) if ttfts else None,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_mean_s": float(np.mean(itls)) if itls else None,
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "output_tok_s": output / duration_s if duration_s > 0 else 0.0,
        "req_s": len(ok) / duration_s if duration_s > 0 else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "hit_rate": hit_rate(cached, prompt),
    }


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


# ---------------------------------------------------------------------------------------------
# pacing


class PoissonPacer:
    """Send times of a Poisson process of ``rate`` requests/s, handed out in the order asked
    (``rate`` inf: no waiting, a closed loop). A request that becomes ready after the process
    went idle waits a fresh exponential gap, which memorylessness makes the same process."""

    def __init__(self, rate: float, rng: np.random.Generator) -> None:
        self.rate = rate
        self.rng = rng
        self._next_at: float | None = None

    async def wait(self) -> None:
        if math.isinf(self.rate):
            return
        now = time.perf_counter()
        start = now if self._next_at is None else max(self._next_at, now)
        self._next_at = start + float(self.rng.exponential(1.0 / self.rate))
        delay = self._next_at - now
        if delay > 0:
            await asyncio.sleep(delay)


# ---------------------------------------------------------------------------------------------
# the streaming client

_encode_json = msgspec.json.Encoder().encode


class BenchRequestError(RuntimeError):
    pass


class BenchClient(httpx.AsyncClient):
    """httpx for the odd request, and `sse` (bench/sse_client.py) for the streamed generations
    on plain http, whose per-event cost is a fraction of httpx's."""

    def __init__(self, api_key: str | None, max_connections: int) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        timeout = httpx.Timeout(None, connect=30.0)
        super().__init__(headers=headers, limits=limits, timeout=timeout)
        self.sse = SSEClient(headers)

    async def __aexit__(self, *exc) -> None:
        await self.sse.aclose()
        await super().__aexit__(*exc)


def make_client(api_key: str | None, max_connections: int) -> BenchClient:
    return BenchClient(api_key, max_connections)


class _TokenClock:
    """TTFT and ITLs of one generation from the token counts of its streamed events."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last = self.start
        self.itls: list[float] = []

    def arrived(self, n_tokens: int) -> None:
        if n_tokens <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now  # tokens arriving with the first one add no gaps
        else:
            self.itls.extend([(now - self.last) / n_tokens] * n_tokens)
        self.last = now


async def _checked(events: AsyncIterator[dict]) -> AsyncIterator[dict]:
    async for event in events:
        if "error" in event:
            raise BenchRequestError(event["error"].get("message", str(event["error"])))
        yield event


async def _sse_events(response: httpx.Response) -> AsyncIterator[dict]:
    if response.status_code != 200:
        body = (await response.aread()).decode(errors="replace")
        raise BenchRequestError(f"HTTP {response.status_code}: {body[:500]}")
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def _timed(
    client: httpx.AsyncClient, url: str, body: dict, t0: float, on_event: Any
) -> RequestResult:
    """POST ``body`` streaming; ``on_event(event, result) -> new token count`` folds each event
    into the result. Errors land in ``result.error`` (a benchmark reports them, not dies)."""
    result = RequestResult()
    clock = _TokenClock()
    result.start_s = clock.start - t0
    sse = getattr(client, "sse", None)
    try:
        if sse is not None and url.startswith("http://"):
            async for event in _checked(sse.events(url, _encode_json(body))):
                clock.arrived(on_event(event, result))
        else:
            async with client.stream("POST", url, json=body) as response:
                async for event in _checked(_sse_events(response)):
                    clock.arrived(on_event(event, result))
    except (
        httpx.HTTPError,
        BenchRequestError,
        HTTPStatusError,
        json.JSONDecodeError,
        msgspec.DecodeError,
        OSError,
        asyncio.IncompleteReadError,
        TimeoutError,
    ) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    result.end_s = end - t0
    result.latency_s = end - clock.start
    result.ttft_s = None if clock.first is None else clock.first - clock.start
    result.itls_s = clock.itls
    if result.error is None and result.ttft_s is None:
        result.error = "no output token streamed"
    return result


async def stream_generate(
    client: httpx.AsyncClient,
    base_url: str,
    input_ids: list[int],
    max_new_tokens: int,
    t0: float,
    ignore_eos: bool = True,
) -> RequestResult:
    """Native ``/generate`` with token ids, greedy, streamed (events are cumulative)."""
    body = {
        "input_ids": input_ids,
        "stream": True,
        "sampling_params": {
            "max_new_tokens": max_new_tokens,
            "ignore_eos": ignore_eos,
            "temperature": 0.0,
        },
    }

    def on_event(event: dict, result: RequestResult) -> int:
        ids = event.get("output_ids") or []
        new = len(ids) - len(result.output_ids)
        result.output_ids = list(ids)
        result.output_tokens = len(ids)
        result.text = event.get("text", "")
        meta = event.get("meta_info") or {}
        result.prompt_tokens = meta.get("prompt_tokens", len(input_ids))
        result.cached_tokens = meta.get("cached_tokens", 0)
        result.host_cached_tokens = meta.get("host_cached_tokens", 0)
        return new

    return await _timed(client, base_url + "/generate", body, t0, on_event)


async def stream_chat(
    client: httpx.AsyncClient,
    base_url: str,
    messages: list[dict],
    max_tokens: int,
    t0: float,
    ignore_eos: bool = True,
) -> RequestResult:
    """``/v1/chat/completions`` streamed; token counts per chunk come from its logprobs, the
    prompt and cached token counts from the final usage chunk."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": True,
    }
    parts: list[str] = []

    def on_event(event: dict, result: RequestResult) -> int:
        new = 0
        for choice in event.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                parts.append(content)
            new += len((choice.get("logprobs") or {}).get("content") or [])
        result.output_tokens += new
        result.text = "".join(parts)
        usage = event.get("usage")
        if usage:  # the last chunk: the server's own counts
            result.prompt_tokens = usage.get("prompt_tokens", 0)
            result.output_tokens = usage.get("completion_tokens", result.output_tokens)
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = details.get("cached_tokens", 0)
        return new

    return await _timed(client, base_url + "/v1/chat/completions", body, t0, on_event)


# ---------------------------------------------------------------------------------------------
# the server


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def get_server_info(url: str, api_key: str | None = None) -> dict:
    r = httpx.get(url + "/get_server_info", headers=_headers(api_key), timeout=60)
    r.raise_for_status()
    return r.json()


def flush_cache(url: str, api_key: str | None = None) -> bool:
    """Empty the server's radix cache so runs start equal; False if the server refused."""
    try:
        r = httpx.post(url + "/flush_cache", headers=_headers(api_key), timeout=60)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def warm_up(url: str, vocab_size: int, api_key: str | None = None, salt: int = 0) -> None:
    """One short request, so the first measured one does not pay for lazy initialisation."""
    lo, hi = safe_token_range(vocab_size)
    ids = [lo + (i * 7919 + salt * 104729) % (hi - lo) for i in range(16)]
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "temperature": 0.0},
    }
    r = httpx.post(url + "/generate", json=body, headers=_headers(api_key), timeout=600)
    r.raise_for_status()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server's process, before exec: SIGTERM it (a clean shutdown) if the benchmark dies
    without stopping it, e.g. killed by a timeout (Linux only; elsewhere a no-op)."""
    with contextlib.suppress(Exception):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into KeyboardInterrupt, so launched servers are stopped on the way out."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


class LaunchedServer:
    """``radix-runtime serve`` as a subprocess on a free port, its output in a log file; stopped
    with SIGINT (the server's own clean shutdown) on exit."""

    def __init__(
        self, model: str, flags: Sequence[str], log_dir: str | None = None, timeout: float = 600
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "radix_runtime", "serve", "--model", model]
        self.cmd += [*flags, "--port", str(self.port)]
        log_dir = log_dir or tempfile.mkdtemp(prefix="radix-bench-")
        self.log_path = os.path.join(log_dir, f"server-{self.port}.log")
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None

    def log_tail(self, chars: int = 4000) -> str:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]
        return ""

    def __enter__(self) -> LaunchedServer:
        print(f"launching: {shlex.join(self.cmd)}  (log: {self.log_path})", file=sys.stderr)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                # --dp: the router answers /health once it listens, /readiness once it has
                # a replica to send to
                path = "/readiness" if "--dp" in self.cmd else "/health"
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the server was not healthy within {self.timeout}s:\n{self.log_tail()}")

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass(frozen=True)
class Target:
    """One server a benchmark runs against: ``cache_on`` or ``cache_off``."""

    label: str
    url: str | None  # None: launch one
    flags: tuple[str, ...]  # server flags when launched


def server_bench_parser(doc: str) -> argparse.ArgumentParser:
    """The parser of a benchmark against a server: `doc`'s first paragraph as its description,
    defaults in --help, the server options (add_server_options)."""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_server_options(parser)
    return parser


def exit_code(sections: Sequence[dict]) -> int:
    """1 (with a line on stderr) when a request of any of `sections` failed, else 0."""
    failed = sum(s["errors"] for s in sections)
    if failed:
        print(f"error: {failed} requests failed; the numbers above are not valid", file=sys.stderr)
        return 1
    return 0


def add_server_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server (give --url, or let the benchmark launch one)")
    g.add_argument("--url", help="a running server, e.g. http://127.0.0.1:30000")
    g.add_argument(
        "--url-no-cache",
        help="a running server started with --disable-radix-cache (for --compare-no-cache)",
    )
    g.add_argument("--model", default="default", help="the model of a launched server")
    g.add_argument(
        "--server-args",
        default="",
        help='flags for launched servers, e.g. "--max-total-tokens 65536 --page-size 16"',
    )
    g.add_argument(
        "--compare-no-cache",
        action="store_true",
        help="run the same workload against a server with --disable-radix-cache too",
    )
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--launch-timeout", type=float, default=600, help="seconds to wait for /health")


def targets_from_args(args: argparse.Namespace) -> list[Target]:
    """cache_on: --url or a launched server; cache_off (with --compare-no-cache): --url-no-cache,
    else a launched server with --disable-radix-cache added."""
    flags = tuple(shlex.split(args.server_args))
    out = [Target("cache_on", args.url.rstrip("/") if args.url else None, flags)]
    if args.compare_no_cache:
        url = args.url_no_cache.rstrip("/") if args.url_no_cache else None
        off_flags = flags if "--disable-radix-cache" in flags else (*flags, "--disable-radix-cache")
        out.append(Target("cache_off", url, off_flags))
    return out


@contextlib.contextmanager
def open_target(target: Target, args: argparse.Namespace) -> Iterator[str]:
    """The target's base URL, launching (and finally stopping) a server if it has none."""
    with serve_with_pid(target, args) as (url, _):
        yield url


@contextlib.contextmanager
def serve_with_pid(target: Target, args: argparse.Namespace) -> Iterator[tuple[str, int | None]]:
    """(url, pid): the target's base URL, launching (and finally stopping) a server if it has
    none, and the launched server's pid (None for a server given by URL), for role_cpu_s."""
    if target.url is not None:
        yield target.url, None
        return
    with LaunchedServer(args.model, target.flags, timeout=args.launch_timeout) as server:
        yield server.url, server.proc.pid


ROLES = ("tokenizer", "scheduler", "worker")


def role_cpu_s(pid: int | None) -> dict[str, float] | None:
    """CPU seconds (user + system, all threads) each process of the server at `pid` has used
    so far, by role (the processes name themselves radix_runtime::ROLE); None without a pid,
    without psutil, or when no process carries a role title."""
    if pid is None:
        return None
    try:
        import psutil
    except ImportError:  # a machine without it (the H200 kit): no CPU split
        return None
    root = psutil.Process(pid)
    out = dict.fromkeys(ROLES, 0.0)
    found = False
    for proc in [root, *root.children(recursive=True)]:
        try:
            title = " ".join(proc.cmdline())
            times = proc.cpu_times()
        except psutil.Error:
            continue
        for role in ROLES:
            if f"radix_runtime::{role}" in title:
                out[role] += times.user + times.system
                found = True
    return out if found else None  # no process titled by role (no setproctitle there)


def replica_split(url: str, api_key: str | None) -> list[dict] | None:
    """Behind SGLang's router: each replica's prompt and cached tokens so far (from the router's
    GET /workers and each replica's /get_server_info), showing how a policy spread the load;
    None for a plain server."""
    try:
        r = httpx.get(url + "/workers", headers=_headers(api_key), timeout=30)
        workers = r.json().get("workers") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(workers, list):
        return None
    out = []
    for w in workers:
        cache = get_server_info(w["url"], api_key).get("cache") or {}
        out.append(
            {
                "url": w["url"],
                "prompt_tokens": cache.get("prompt_tokens"),
                "cached_tokens": cache.get("cached_tokens"),
            }
        )
    return out


def prepare_server(url: str, api_key: str | None, warm_ups: int = 1) -> dict:
    """Server info, after warm-up requests and an emptied cache. Behind SGLang's router
    (`serve --dp N`), /get_server_info is the router's own: the model's facts come from
    /get_model_info (answered by a replica); `warm_ups` > 1 reaches several replicas."""
    info = get_server_info(url, api_key)
    if "vocab_size" not in info:  # a router
        r = httpx.get(url + "/get_model_info", headers=_headers(api_key), timeout=60)
        r.raise_for_status()
        info = {**info, **r.json(), "router": True}
    for i in range(warm_ups):
        warm_up(url, info["vocab_size"], api_key, salt=i)
    if not flush_cache(url, api_key):
        print(f"warning: {url} refused /flush_cache; the run may start warm", file=sys.stderr)
    return info


# ---------------------------------------------------------------------------------------------
# output


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except ImportError:
        return None


def host_info() -> dict:
    """What the numbers depend on besides the server: CPUs, the load when the run started, the
    OpenMP settings a CPU worker inherits, and the event loop and HTTP parser that this client
    and a launched server (same environment) run on: uvloop and httptools, or asyncio's own
    loop and uvicorn's pure-Python h11 when they are missing (null here)."""
    env = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "CUDA_VISIBLE_DEVICES")
    return {
        "cpus": os.cpu_count(),
        "loadavg_1m_at_start": os.getloadavg()[0],
        "env": {k: os.environ[k] for k in env if k in os.environ},
        "uvloop": _version("uvloop"),
        "httptools": _version("httptools"),
    }


def git_commit() -> tuple[str, bool | None]:
    """(commit, dirty) of the code this run imports: $RADIX_RUNTIME_COMMIT when set (a checkout
    copied without .git, e.g. the H200's, names its commit that way), else `git rev-parse HEAD`
    and whether the work tree has uncommitted changes; ("unknown", None) when neither exists."""
    stated = os.environ.get("RADIX_RUNTIME_COMMIT")
    if stated:
        return stated, None
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown", None
    if head.returncode != 0:
        return "unknown", None
    return head.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None


def cpu_model() -> str | None:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or None


def gpu_names() -> list[str]:
    """The GPUs nvidia-smi lists (without importing torch); [] when there is none."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return (
        [line.strip() for line in out.stdout.splitlines() if line.strip()]
        if out.returncode == 0
        else []
    )


def machine() -> dict:
    """The machine a result was measured on, and how busy it was when the run began."""
    import platform

    gpus = gpu_names()
    return {
        "gpu": gpus[0] if gpus else None,
        "gpus": len(gpus),
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "loadavg_1m_at_start": _RUN_START["loadavg"],
        "python": platform.python_version(),
        "numpy": np.__version__,
    }


# the environment variables a run's numbers depend on, repeated in front of its command
COMMAND_ENV = (
    "OMP_WAIT_POLICY",
    "GOMP_SPINCOUNT",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "RADIX_RUNTIME_GEMV_CONFIGS",
)


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that reproduces this run, as a user would type it from the repo root."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0])
    with contextlib.suppress(ValueError):
        script = script.resolve().relative_to(REPO_ROOT)
    env = [f"{k}={os.environ[k]}" for k in COMMAND_ENV if k in os.environ]
    return shlex.join([*env, "python", str(script), *argv[1:]])


_RUN_START: dict = {"commit": None, "date": None, "loadavg": None}


def mark_run_start() -> None:
    """Note the commit, the time and the load as the run begins (a provenance block written at
    the end describes the start, not the moment of writing); bench/common does it on import."""
    from datetime import UTC, datetime

    _RUN_START.update(
        commit=git_commit(),
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        loadavg=os.getloadavg()[0],
    )


def provenance(
    ceiling: str | dict, server_flags: Any = None, argv: Sequence[str] | None = None
) -> dict:
    """What every results file opens with: the commit, date, machine and exact command that
    produced it, the flags of the server(s) it measured (None for in-process benchmarks), and
    the ceiling or reference its ratios divide by."""
    if _RUN_START["commit"] is None:  # the first call of a run that started without one
        mark_run_start()
    commit, dirty = _RUN_START["commit"]
    return {
        "reconstructed": False,
        "commit": commit,
        "dirty": dirty,
        "date": _RUN_START["date"],
        "machine": machine(),
        "command": command_line(argv),
        "server_flags": server_flags,
        "ceiling": ceiling,
    }


def targets_flags(targets: Sequence[Target]) -> dict:
    """server_flags of a provenance block for a run against `targets`: each one's launch flags,
    or the URL it was given (its settings are then in the result's config)."""
    return {
        t.label: (shlex.join(t.flags) if t.url is None else f"a running server at {t.url}")
        for t in targets
    }


CACHE_OFF_REFERENCE = (
    "the same workload against a server with --disable-radix-cache, in the same run"
)


def run_async(coro):
    """Run the client's coroutine on uvloop when it is installed (as the server does), else on
    asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# the server settings a run's numbers depend on, as /get_server_info reports them
SERVER_SETTINGS = (
    "max_total_tokens",
    "disable_radix_cache",
    "chunked_prefill_size",
    "schedule_policy",
    "enable_mixed_chunk",
    "disable_overlap_schedule",
)


def server_config(info: dict, url: str | None, flags: Sequence[str]) -> dict:
    """What the JSON records of one server: where it ran, the flags it was launched with, its
    page size, its radix tree implementation and SERVER_SETTINGS (null when the server does not
    report one), so that a result says e.g. which prefill step size it ran with even where the
    flags left it at the default."""
    page_size = (info.get("cache") or {}).get("page_size") or info.get("page_size", 1)
    return {
        "url": url or "launched",
        "flags": list(flags) if url is None else None,
        "page_size": page_size,
        "radix_tree": (info.get("cache") or {}).get("tree"),  # "cpp" or "python"
        **{key: info.get(key) for key in SERVER_SETTINGS},
    }


def fmt(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value * scale:.{digits}f}"


def jsonable(obj: Any) -> Any:
    """``obj`` with inf / nan floats as None (strict JSON has neither)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    return obj


def write_json(path: str, obj: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(jsonable(obj), f, indent=2, allow_nan=False)
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr)


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str) -> None:
    """Lay out, write (creating the folder) and close a matplotlib figure."""
    plt = pyplot()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)


def progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True)


mark_run_start()
