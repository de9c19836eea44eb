"""GET /metrics: every process's numbers, in the Prometheus text format, by prometheus-client.

Where the numbers come from (docs/metrics.md lists them; docs/decisions.md says why this way):
- this process (the tokenizer/HTTP process) times each request: time to first token, inter-token
  latency, end-to-end latency, and counts finished requests by finish reason;
- the scheduler ships `SchedulerMetrics` over the existing ZeroMQ socket when a scrape asks
  for it: gauges as they are now, counters and histograms as increments since its previous
  report (the worker's step time rides along: the scheduler gets it in every ForwardResult).
  `apply()` adds the increments here, so every counter this process exposes only grows.

Every metric carries one label, `model_name` (plus `finished_reason` on the finished-request
counter); nothing per request.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from radix_runtime.messages import SchedulerMetrics
from radix_runtime.scheduler.stats import SCHEDULER_HISTOGRAMS
from radix_runtime.utils.histogram import (
    INTER_TOKEN_BUCKETS,
    LATENCY_BUCKETS,
    STEP_BUCKETS,
    Histogram,
)

PREFIX = "radix_runtime:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort")

# name (after the prefix) -> help, for every histogram; the scheduler's are SCHEDULER_HISTOGRAMS
_HISTOGRAM_HELP = {
    "time_to_first_token_seconds": "Time from the request reaching the tokenizer manager to its "
    "first output token",
    "inter_token_latency_seconds": "Time between two output tokens of a request",
    "e2e_request_latency_seconds": "Time from the request reaching the tokenizer manager to its "
    "last output token (finished requests, aborted ones included)",
    "first_token_transit_seconds": "Time from the scheduler sending a first output token to "
    "the tokenizer manager reading it",
    "inbox_time_seconds": "Time from the tokenizer manager sending a request to the scheduler "
    "reading it",
    "queue_time_seconds": "Time a request waited at the scheduler before its first step",
    "prefill_time_seconds": "Time from a request's first step to its first sampled token",
    "step_time_seconds": "Time a forward step held the scheduler-worker pipeline",
    "forward_time_seconds": "The worker's own time for a forward step",
    "launch_time_seconds": "The worker's host time to launch a forward step",
    "result_held_time_seconds": "Time a finished step's result waited behind the worker's "
    "launch of the next step (at most; 0 when the step was still running)",
    "batch_size": "Requests in a forward step",
    "step_tokens": "Tokens computed in a forward step (prefill chunks and decodes)",
}
# scheduler histogram key -> exposed name (after the prefix)
_SCHEDULER_NAMES = {
    "inbox_time": "inbox_time_seconds",
    "queue_time": "queue_time_seconds",
    "prefill_time": "prefill_time_seconds",
    "step_time": "step_time_seconds",
    "forward_time": "forward_time_seconds",
    "launch_time": "launch_time_seconds",
    "result_held_time": "result_held_time_seconds",
    "batch_size": "batch_size",
    "step_tokens": "step_tokens",
}


class _Histograms:
    """A prometheus-client collector over our `Histogram`s (bucket counts that the scheduler
    ships as increments cannot go through prometheus_client.Histogram.observe)."""

    def __init__(self, model_name: str, hists: dict[str, Histogram]) -> None:
        self.model_name = model_name
        self.hists = hists
        self.les = {
            name: [floatToGoString(b) for b in h.bounds] + ["+Inf"] for name, h in hists.items()
        }

    def collect(self):
        for name, h in self.hists.items():
            family = HistogramMetricFamily(
                PREFIX + name, _HISTOGRAM_HELP[name], labels=["model_name"]
            )
            family.add_metric(
                [self.model_name],
                buckets=list(zip(self.les[name], h.cumulative())),
                sum_value=h.sum,
            )
            yield family


class RequestTiming:
    """Per request, in the tokenizer manager: when it came, when its latest token came."""

    __slots__ = ("created", "last_token", "counted")

    def __init__(self) -> None:
        self.created = time.perf_counter()
        self.last_token = 0.0  # 0 until the first token
        self.counted = False  # its finish is counted


class Metrics:
    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # no *_created series (as vLLM): they double the output
        self.model_name = model_name
        self.registry = registry = CollectorRegistry(auto_describe=False)
        label = ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, label, registry=registry).labels(model_name)

        def gauge(name: str, doc: str, labels: list[str] = label) -> Gauge:
            g = Gauge(PREFIX + name, doc, labels, registry=registry)
            return g if len(labels) > 1 else g.labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests")
        self.cached_tokens = counter(
            "cached_tokens", "Prompt tokens read from the radix cache instead of computed"
        )
        self._cached_by_tier = Counter(
            PREFIX + "cached_tokens_by_tier",
            "cached_tokens by where their KV was: on the device, or loaded from the host tier "
            "(--enable-hierarchical-cache)",
            ["model_name", "tier"],
            registry=registry,
        )
        self.cached_by_tier = {
            t: self._cached_by_tier.labels(model_name, t) for t in ("device", "host")
        }
        self.generation_tokens = counter("generation_tokens", "Output tokens sampled")
        self.retractions = counter(
            "num_retractions", "Running requests retracted (preempted) under memory pressure"
        )
        self.evicted_pages = counter("evicted_pages", "KV pages evicted from the radix cache (LRU)")
        self._finished = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason (stop, length, abort)",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self.finished = {r: self._finished.labels(model_name, r) for r in FINISH_REASONS}
        self.aborted = counter("num_aborted_requests", "Requests aborted (client gone, shut down)")

        self.running = gauge("num_running_reqs", "Requests running (holding KV pages)")
        self.waiting = gauge("num_queue_reqs", "Requests waiting to be admitted")
        self.kv_pages = Gauge(
            PREFIX + "kv_pages",
            "KV pages by state: free, evictable (cached, unlocked), protected (cached, locked by "
            "running requests), held (running requests' pages not in the tree yet)",
            ["model_name", "state"],
            registry=registry,
        )
        self.kv_state = {
            s: self.kv_pages.labels(model_name, s)
            for s in ("free", "evictable", "protected", "held")
        }
        self.capacity = gauge("kv_pages_capacity", "KV pages in the pool")
        self.page_size = gauge("page_size", "Tokens per KV page")
        self.token_usage = gauge(
            "token_usage", "Fraction of KV pages running requests use (protected + held)"
        )
        self.tree_nodes = gauge("radix_tree_nodes", "Nodes in the radix tree (the root excluded)")
        self.hit_rate = gauge(
            "cache_hit_rate", "cached_tokens_total / prompt_tokens_total since the server started"
        )

        self.ttft = Histogram(LATENCY_BUCKETS)
        self.itl = Histogram(INTER_TOKEN_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.first_transit = Histogram(STEP_BUCKETS)
        self.sched_hist = {k: Histogram(b) for k, b in SCHEDULER_HISTOGRAMS.items()}
        hists = {
            "time_to_first_token_seconds": self.ttft,
            "inter_token_latency_seconds": self.itl,
            "e2e_request_latency_seconds": self.e2e,
            "first_token_transit_seconds": self.first_transit,
        }
        hists.update({_SCHEDULER_NAMES[k]: h for k, h in self.sched_hist.items()})
        registry.register(_Histograms(model_name, hists))
        self._prompt_total = 0
        self._cached_total = 0

    # -- the scheduler's numbers ---------------------------------------------------------

    def apply(self, msg: SchedulerMetrics) -> None:
        self.prompt_tokens.inc(msg.prompt_tokens)
        self.cached_tokens.inc(msg.cached_tokens)
        self.cached_by_tier["device"].inc(msg.cached_tokens - msg.host_cached_tokens)
        self.cached_by_tier["host"].inc(msg.host_cached_tokens)
        self.generation_tokens.inc(msg.generation_tokens)
        self.retractions.inc(msg.retractions)
        self.evicted_pages.inc(msg.evicted_pages)
        self._prompt_total += msg.prompt_tokens
        self._cached_total += msg.cached_tokens
        if self._prompt_total:
            self.hit_rate.set(self._cached_total / self._prompt_total)
        self.running.set(msg.running_requests)
        self.waiting.set(msg.waiting_requests)
        held = (
            msg.total_pages - msg.free_pages - msg.evictable_pages - msg.protected_pages
        )  # outside the tree, owned by running requests
        for state, value in (
            ("free", msg.free_pages),
            ("evictable", msg.evictable_pages),
            ("protected", msg.protected_pages),
            ("held", held),
        ):
            self.kv_state[state].set(value)
        self.capacity.set(msg.total_pages)
        self.page_size.set(msg.page_size)
        self.token_usage.set((msg.protected_pages + held) / max(msg.total_pages, 1))
        self.tree_nodes.set(msg.tree_nodes)
        for name, delta in msg.histograms.items():
            h = self.sched_hist.get(name)
            if h is not None:
                h.add(delta.counts, delta.sum)

    # -- this process's numbers (called by the tokenizer manager) ------------------------

    def on_tokens(self, timing: RequestTiming, n: int, now: float, sent_at: float = 0.0) -> None:
        """`n` output tokens of one request arrived at `now` (the scheduler sent them at
        `sent_at`, 0 if unknown)."""
        if n <= 0:  # (a malformed frame: the request fails when its tokens are unpacked)
            return
        if timing.last_token == 0.0:
            self.ttft.observe(now - timing.created)
            if sent_at > 0:
                self.first_transit.observe(max(now - sent_at, 0.0))
            n -= 1
        else:
            gap = (now - timing.last_token) / n
            for _ in range(n):
                self.itl.observe(gap)
        timing.last_token = now

    def on_finish(self, timing: RequestTiming, reason: str) -> None:
        if timing.counted:
            return
        timing.counted = True
        reason = reason if reason in self.finished else "abort"
        self.finished[reason].inc()
        if reason == "abort":
            self.aborted.inc()
        self.e2e.observe(time.perf_counter() - timing.created)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
