"""The scheduler's statistics, their totals in the HTTP process, the flush under load, and the
metrics flags, without a model (the scheduler against test_scheduler's FakeWorker)."""

from __future__ import annotations

import pytest
import test_scheduler as ts
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from radix_runtime import messages as m
from radix_runtime.config import (
    ServerArgs,
    auto_max_running_requests,
    parse_server_args,
)
from radix_runtime.scheduler.stats import SCHEDULER_HISTOGRAMS, Counters, SchedulerStats
from radix_runtime.server.http_server import build_app
from radix_runtime.server.metrics import Metrics, RequestTiming
from radix_runtime.utils.histogram import Histogram


def parse(text: bytes) -> dict:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def test_histogram_buckets_are_prometheus_le():
    h = Histogram((1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 2.0, 9.0):
        h.observe(v)
    assert h.counts == [2, 2, 1]  # le=1 holds 1.0 itself
    assert h.cumulative() == [2, 4, 5] and h.count == 5 and h.sum == 14.0
    with pytest.raises(ValueError):
        h.add([1, 2], 0.0)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_reports_add_up_to_the_totals(overlap):
    """Reports taken at every step carry increments whose sum is the whole run: the tokens of
    every request exactly once, one queue/prefill time per request."""
    prompts = ts.shared_prefix_prompts(seed=3)
    metrics = Metrics("m")
    reports: list[m.SchedulerMetrics] = []

    def report(sched, step):
        msg = sched.stats.report(sched)
        reports.append(msg)
        metrics.apply(m.decode(m.encode(msg)))  # over the wire format

    outputs, _, sched = ts.run_workload(prompts, 6, overlap=overlap, on_step=report)
    last = sched.stats.report(sched)
    reports.append(last)
    metrics.apply(last)
    assert sum(r.prompt_tokens for r in reports) == sum(map(len, prompts))
    assert sum(r.cached_tokens for r in reports) == sched.cached_tokens_total > 0
    assert sum(r.generation_tokens for r in reports) == sum(map(len, outputs.values()))
    got = parse(metrics.exposition())

    def v(name, **labels):
        return got[("radix_runtime:" + name, tuple(sorted(labels.items())))]

    assert v("prompt_tokens_total") == sched.prompt_tokens_total
    assert v("cached_tokens_total") == sched.cached_tokens_total
    assert v("cache_hit_rate") == pytest.approx(sched.cache_stats().hit_rate)
    assert v("generation_tokens_total") == sum(map(len, outputs.values()))
    assert v("queue_time_seconds_count") == len(prompts)
    assert v("prefill_time_seconds_count") == len(prompts)
    # gauges are the latest report's
    assert v("num_running_reqs") == 0 and v("kv_pages", state="held") == 0
    assert v("kv_pages", state="evictable") == sched.cache.evictable_pages
    assert v("kv_pages_capacity") == sched.allocator.total_pages
    assert v("radix_tree_nodes") == sched.cache.stats()["nodes"]


def test_a_report_starts_the_increments_again():
    counters = Counters()
    stats = SchedulerStats(counters)
    counters.prompt_tokens_total += 10
    counters.cached_tokens_total += 4
    stats.admitted(0.01)
    stats.step(3, 40, 0.02, 0.015)
    counters.retractions += 1
    counters.evicted_pages += 7

    class Sched:  # the attributes report() reads
        running, waiting, page_size = [], [], 1

        class allocator:
            total_pages, free_pages = 100, 90

        class cache:
            evictable_pages, protected_pages = 10, 0

            @staticmethod
            def stats():
                return {"nodes": 3}

    first = stats.report(Sched)
    assert (first.prompt_tokens, first.cached_tokens, first.retractions) == (10, 4, 1)
    assert first.evicted_pages == 7
    assert set(first.histograms) == {"queue_time", "batch_size", "step_tokens", "step_time",
                                     "forward_time", "launch_time",
                                     "result_held_time"}  # fmt: skip
    second = stats.report(Sched)
    assert second.prompt_tokens == second.evicted_pages == 0 and not second.histograms
    counters.prompt_tokens_total += 5  # the totals only grow; a report carries what is new
    assert stats.report(Sched).prompt_tokens == 5
    assert set(SCHEDULER_HISTOGRAMS) >= set(first.histograms)
    # the HTTP side: two applications, no decrease whatever the scheduler's counters do
    metrics = Metrics("m")
    metrics.apply(first)
    metrics.apply(second)
    got = parse(metrics.exposition())
    assert got[("radix_runtime:prompt_tokens_total", ())] == 10
    assert got[("radix_runtime:evicted_pages_total", ())] == 7
    assert got[("radix_runtime:num_retractions_total", ())] == 1
    assert got[("radix_runtime:batch_size_count", ())] == 1


def test_request_timing():
    metrics = Metrics("m")
    t = RequestTiming()
    metrics.on_tokens(t, 1, t.created + 0.5)  # the first token
    metrics.on_tokens(t, 2, t.created + 0.7)  # two more, 0.1 s apart on average
    metrics.on_finish(t, "stop")
    metrics.on_finish(t, "abort")  # counted once
    got = parse(metrics.exposition())
    assert got[("radix_runtime:time_to_first_token_seconds_sum", ())] == pytest.approx(0.5)
    assert got[("radix_runtime:inter_token_latency_seconds_count", ())] == 2
    assert got[("radix_runtime:inter_token_latency_seconds_sum", ())] == pytest.approx(0.2)
    assert got[("radix_runtime:request_success_total", (("finished_reason", "stop"),))] == 1
    assert got[("radix_runtime:request_success_total", (("finished_reason", "abort"),))] == 0
    assert got[("radix_runtime:e2e_request_latency_seconds_count", ())] == 1


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_flush_while_requests_run_keeps_outputs_and_integrity(page_size, overlap):
    """A flush between any two steps drops what no running request holds, keeps the rest, and
    changes no output (the FakeWorker hashes the KV it reads: a page reused too early shows)."""
    prompts = ts.shared_prefix_prompts(seed=5)
    arrivals = [i // 3 * 4 for i in range(len(prompts))]
    ref, _, _ = ts.run_workload(prompts, 10, page_size=page_size, disable=True, arrivals=arrivals)
    flushes: list[m.FlushCacheDone] = []

    def flush(sched, step):
        if step % 5 == 2:
            before = sched.cache.stats()["nodes"]
            done = sched.flush_cache()
            assert done.ok and done.dropped_nodes <= before
            assert sched.cache.evictable_pages == 0
            assert done.kept_pages == sched.cache.protected_pages
            assert done.dropped_tokens == done.dropped_pages * page_size
            flushes.append(done)
            sched.check_integrity()

    out, fin, sched = ts.run_workload(
        prompts, 10, page_size=page_size, arrivals=arrivals, overlap=overlap, on_step=flush
    )
    assert out == ref and len(fin) == len(prompts)
    assert any(f.dropped_pages for f in flushes) and any(f.kept_pages for f in flushes)
    done = sched.flush_cache()  # idle: everything goes
    assert sched.cache.stats()["nodes"] == 0 and done.kept_pages == 0
    assert sched.allocator.free_pages == sched.allocator.total_pages
    sched.check_integrity()


def test_metrics_flags():
    def parse_flags(*argv):
        return parse_server_args(list(argv))

    assert parse_flags().disable_metrics is False
    assert parse_flags("--disable-metrics").disable_metrics is True
    assert parse_flags("--enable-metrics").disable_metrics is False


def test_disable_metrics_removes_the_route():
    class Manager:  # what build_app touches at build time
        model_name = "m"

    off = TestClient(build_app(Manager(), ServerArgs(disable_metrics=True)))
    assert off.get("/metrics").status_code == 404
    assert off.get("/dashboard").status_code == 200
    on = TestClient(build_app(Manager(), ServerArgs()), raise_server_exceptions=False)
    assert on.get("/metrics").status_code == 503  # the manager has not started


@pytest.mark.parametrize("disable", [False, True], ids=["metrics", "disable_metrics"])
def test_the_scheduler_process_answers_metrics(tmp_path, disable):
    """A MetricsReq gets the gauges and the increments since the previous answer; with
    --disable-metrics, the gauges and no increments (an answer, so no request hangs)."""
    from radix_runtime.scheduler.main import SchedulerProcess
    from radix_runtime.scheduler.scheduler import Scheduler

    args = ServerArgs(disable_metrics=disable, max_total_tokens=256, radix_tree_impl="python")
    proc = SchedulerProcess(args, str(tmp_path))
    try:
        worker = ts.FakeWorker(257, 1, auto_max_running_requests(256))
        sched = proc.scheduler = Scheduler(args, worker.ready())
        sent = []
        proc.send_tok = sent.append
        for rid in ("a", "b"):
            prompt = m.pack_ids(list(range(1, 11)))
            sampling = m.SamplingParams(max_new_tokens=8)  # both fit the pool at full length
            sched.add_request(m.GenerateReq(rid=rid, input_ids=prompt, sampling=sampling))
        batch, plan = sched.schedule()
        sched.process_result(plan, worker.forward(batch))
        proc.handle(m.MetricsReq())
        proc.handle(m.MetricsReq())
        first, second = sent
        assert (first.running_requests, first.waiting_requests) == (2, 0)
        assert first.total_pages == 256 and first.free_pages < 256
        assert first.prompt_tokens == (0 if disable else 20)
        assert first.generation_tokens == (0 if disable else 2)
        assert second.prompt_tokens == second.generation_tokens == 0 and not second.histograms
        assert sched.prompt_tokens_total == 20  # the totals are kept either way
    finally:
        proc.ctx.destroy(linger=0)
