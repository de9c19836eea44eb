"""Admission that uses the memory the pool has: --max-running-requests sized from the KV pool by
default, and admission keeping room for the running requests' expected output, so that a small
pool retracts rarely (the scheduler against the page-reading fake worker of test_scheduler)."""

from __future__ import annotations

import msgspec
import pytest
from test_scheduler import OVERLAP, FakeWorker, run_workload, shared_prefix_prompts

from radix_runtime import messages as m
from radix_runtime.config import (
    AUTO_MAX_RUNNING,
    AUTO_MIN_RUNNING,
    ServerArgs,
    auto_max_running_requests,
)
from radix_runtime.scheduler.scheduler import Scheduler


def test_the_default_grows_with_the_pool():
    sizes = [auto_max_running_requests(t) for t in (4096, 65536, 256 * 1024, 400_000, 1 << 22)]
    assert sizes == [AUTO_MIN_RUNNING, AUTO_MIN_RUNNING, 512, 781, AUTO_MAX_RUNNING]
    assert sizes == sorted(sizes)


def test_with_cuda_graphs_the_default_stays_within_the_largest_graph():
    # a decode batch beyond --cuda-graph-max-bs runs eagerly (slower on the H200 than the extra
    # requests gain), so a graphed worker's default is capped there; the CPU's is not
    assert auto_max_running_requests(1 << 22, graph_max_bs=256) == 256
    assert auto_max_running_requests(1 << 22, graph_max_bs=512) == 512
    assert auto_max_running_requests(400_000, graph_max_bs=1024) == 781
    assert auto_max_running_requests(1 << 22, graph_max_bs=None) == AUTO_MAX_RUNNING


@pytest.mark.parametrize("pool", [65536, 400_000])
def test_the_scheduler_sizes_its_slots_from_the_pool(pool):
    worker = FakeWorker(pool + 1, 1, 1)
    sched = Scheduler(ServerArgs(max_total_tokens=pool), worker.ready())
    assert sched.max_running == auto_max_running_requests(pool)
    assert sched.server_info().max_running_requests == sched.max_running
    assert len(sched.kv.free_slots) == sched.max_running
    # the worker's count, when it reports one, is the one both sides use
    reported = msgspec.structs.replace(worker.ready(), max_running_requests=9)
    assert Scheduler(ServerArgs(max_total_tokens=pool), reported).max_running == 9
    # and an explicit --max-running-requests still wins
    assert Scheduler(ServerArgs(max_running_requests=5), worker.ready()).max_running == 5


def test_the_cpu_worker_sizes_and_reports_its_slots(monkeypatch):
    from radix_runtime import config
    from radix_runtime.worker.model_runner import ModelRunner

    # a slot per 8 pool tokens: the rule's effect on a pool small enough to build quickly
    monkeypatch.setattr(config, "AUTO_TOKENS_PER_REQUEST", 8)
    monkeypatch.setattr(config, "AUTO_MIN_RUNNING", 1)
    runner = ModelRunner(
        ServerArgs(model="tiny-llama", load_format="dummy", device="cpu", max_total_tokens=4096)
    )
    assert runner.max_running == auto_max_running_requests(4096) == 512
    assert runner.req_to_page.shape[0] == 512
    assert runner.ready_info().max_running_requests == 512


@OVERLAP
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_small_pool_retracts_rarely(overlap, page_size):
    """16 requests of up to 122 tokens, 24 new each, in a 256-token pool: admission that keeps
    room only for the decoders' next pages (conservativeness 0) retracts again and again; the
    default keeps room for the output they will produce and does not retract, with the same
    tokens."""
    prompts = shared_prefix_prompts(seed=1, n=16)
    kw = dict(page_size=page_size, pool_tokens=256, max_running=16, overlap=overlap)
    off, _, _ = run_workload(prompts, 24, disable=True, pool_tokens=4096, page_size=page_size)
    greedy, _, eager = run_workload(
        prompts, 24, extra_args={"schedule_conservativeness": 0.0}, **kw
    )
    planned, _, sched = run_workload(prompts, 24, **kw)
    assert greedy == planned == off
    assert eager.retractions >= 2  # 13 at page size 1, 3 at 16
    assert sched.retractions == 0


def test_early_finishes_lower_the_expected_output():
    """Requests that stop long before max_new_tokens teach admission to expect less output (it
    admits more next to them); a retraction puts the expectation back to all of it."""
    prompts = shared_prefix_prompts(seed=2, n=12)
    _, finished, sched = run_workload(prompts, 200, pool_tokens=4096, stop_ids=range(1, 60))
    assert all(reason == "stop" for reason in finished.values())
    assert sched.queues.output_fraction < 0.5
    prompt = shared_prefix_prompts(seed=3, n=1)[0]
    sampling = m.SamplingParams(max_new_tokens=100)
    sched.add_request(m.GenerateReq(rid="x", input_ids=m.pack_ids(prompt), sampling=sampling))
    req, n = sched.waiting[0], len(prompt)
    # page size 1: its expected pages past the prompt are its expected output tokens
    for fraction, expected in ((1.0, 100), (0.3, 30), (0.0, 10)):  # at least a tenth
        sched.queues.output_fraction = fraction
        assert sched.admission.expected_pages(req, n, n) == expected
    # and the prompt tokens its pages do not hold yet
    assert sched.admission.expected_pages(req, n, n - 5) == 10 + 5
    _, plan = sched.schedule()
    sched.queues.retract(plan[0].req)
    assert sched.queues.output_fraction == 1.0
