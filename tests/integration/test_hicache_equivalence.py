"""The host tier never changes outputs: greedy outputs with --enable-hierarchical-cache equal the
cache-off and the device-only-cache outputs, with a device pool far smaller than the working set
(multi-turn conversations whose histories are evicted from the device and come back), page size
1 and 16, the overlap schedule on and off, the Python and the C++ tree. The scheduler and the
worker's ModelRunner run in-process through the scheduler's own step loop
(test_cache_equivalence.run); one test runs a real server (`--radix-tree-impl cpp`)."""

from __future__ import annotations

import random

import pytest
from test_cache_equivalence import run

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs

pytestmark = pytest.mark.slow


def conversations(vocab: int, n: int = 5, seed: int = 0):
    """n conversations of 3 turns over a shared 16-token system prompt: turn k+1's prompt is
    turn k's plus new tokens, arriving after the earlier turns are done (about 260 distinct
    tokens of history, >= 4x a 64-token device pool)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(16)]
    turns = [[system + [rng.randrange(3, vocab) for _ in range(20)] for _ in range(n)]]
    for _ in range(2):
        turns.append([p + [rng.randrange(3, vocab) for _ in range(8)] for p in turns[-1]])
    prompts = [p for turn in turns for p in turn]
    arrivals = [25 * (i // n) for i in range(len(prompts))]
    return prompts, arrivals


@pytest.mark.parametrize("page_size,pool", [(1, 64), (16, 128)])
def test_host_tier_outputs_equal_cache_off_and_device_only(page_size, pool):
    from radix_runtime.worker.model_runner import ModelRunner

    base = ServerArgs(
        model="tiny-llama",
        load_format="dummy",
        model_config="tiny-llama",
        page_size=page_size,
        max_total_tokens=pool,
        chunked_prefill_size=32,
        max_running_requests=3,
        device="cpu",
        disable_overlap_schedule=True,
    )
    tiered = base.replace(enable_hierarchical_cache=True, hicache_ratio=8.0)
    device_runner = ModelRunner(base)
    tiered_runner = ModelRunner(tiered)
    prompts, arrivals = conversations(device_runner.ready_info().vocab_size)
    greedy = m.SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    off, _ = run(device_runner, base.replace(disable_radix_cache=True), prompts, greedy, arrivals)
    for impl in ("python", "cpp"):
        device_only, dev_sched = run(
            device_runner, base.replace(radix_tree_impl=impl), prompts, greedy, arrivals
        )
        assert device_only == off
    for impl, overlap_off in (("python", True), ("python", False), ("cpp", True), ("cpp", False)):
        args = tiered.replace(disable_overlap_schedule=overlap_off, radix_tree_impl=impl)
        on, sched = run(tiered_runner, args, prompts, greedy, arrivals)
        assert on == off
        assert sched.tree_impl == impl
        stats = sched.cache_stats()
        # the host tier served hits the device-only cache had lost
        assert sched.host_cached_tokens_total > 0 and stats.host_loaded_bytes > 0
        assert stats.host_written_bytes > 0
        assert sched.cached_tokens_total > dev_sched.cached_tokens_total


def staggered(vocab: int, n: int = 6):
    """n two-turn conversations: the first turns together, the second turns a step apart
    (some arrive while the slots are full and wait: --hicache-prefetch arrival loads their
    host hits back then)."""
    prompts, _ = conversations(vocab, n=n)
    return prompts[: 2 * n], [0] * n + [40 + i for i in range(n)]


@pytest.mark.parametrize("page_size,pool", [(1, 96), (16, 128)])
def test_prefetch_on_arrival_outputs_equal_cache_off(page_size, pool):
    """Host hits loaded back when their requests arrive, the copies handed to the runner at
    once while the steps before run (the overlap schedule), both trees: greedy outputs equal
    cache off and the tier without prefetching."""
    from radix_runtime.worker.model_runner import ModelRunner

    base = ServerArgs(
        model="tiny-llama", load_format="dummy", model_config="tiny-llama", page_size=page_size,
        max_total_tokens=pool, chunked_prefill_size=32, max_running_requests=3, device="cpu",
    )  # fmt: skip
    tiered = base.replace(enable_hierarchical_cache=True, hicache_ratio=8.0)
    runner = ModelRunner(tiered)
    prompts, arrivals = staggered(runner.ready_info().vocab_size)
    greedy = m.SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    off, _ = run(runner, tiered.replace(disable_radix_cache=True), prompts, greedy, arrivals)
    plain, _ = run(runner, tiered.replace(hicache_prefetch="off"), prompts, greedy, arrivals)
    assert plain == off
    for impl in ("python", "cpp"):
        args = tiered.replace(radix_tree_impl=impl)
        on, sched = run(runner, args, prompts, greedy, arrivals, early=True)
        assert on == off, impl
        c = sched.counters
        assert c.host_prefetches > 0 and c.host_early_copies > 0
        assert sched.host_cached_tokens_total > 0


# the real-server tests' flags: a tiny dummy model on the CPU with the host tier on
TIERED_SERVER = (
    "--load-format", "dummy", "--model-config", "tiny-llama", "--device", "cpu",
    "--chunked-prefill-size", "32", "--enable-hierarchical-cache", "--hicache-ratio", "8",
)  # fmt: skip


def test_server_with_the_cpp_tree_and_the_host_tier_keeps_greedy_outputs(tmp_path):
    """A real server (`--radix-tree-impl cpp`, the host tier on, a 64-token device pool):
    multi-turn conversations sent a turn at a time (one /generate batch per turn) give the same
    greedy tokens as the same prompts computed without any reuse (each under its own cache
    salt, so it matches nothing), and the host tier served part of them."""
    from server_support import start_server

    server = start_server(
        str(tmp_path), *TIERED_SERVER, "--max-total-tokens", "64", "--radix-tree-impl", "cpp"
    )
    try:
        prompts, _ = conversations(vocab=500)
        sampling = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
        with server.client(timeout=120) as c:
            assert c.get("/get_server_info").json()["cache"]["tree"] == "cpp"
            fresh = []
            for i, p in enumerate(prompts):
                body = {"input_ids": p, "sampling_params": sampling, "cache_salt": f"own-{i}"}
                r = c.post("/generate", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["meta_info"]["cached_tokens"] == 0
                fresh.append(r.json()["output_ids"])
            reused, host_cached = [], 0
            for turn in range(3):  # 5 conversations a turn, together
                batch = prompts[5 * turn : 5 * turn + 5]
                r = c.post("/generate", json={"input_ids": batch, "sampling_params": sampling})
                assert r.status_code == 200, r.text
                reused += [out["output_ids"] for out in r.json()]
                host_cached += sum(out["meta_info"]["host_cached_tokens"] for out in r.json())
            cache = c.get("/get_server_info").json()["cache"]
        assert reused == fresh
        assert host_cached > 0 and cache["host_loads"] > 0
        # the worker timed the loads, and the steps' wait for them (the CPU copies synchronously)
        assert 0 < cache["host_load_s"] <= cache["host_copy_wait_s"]
        # batches with loads, each of one or more requests' loads, and the host time to queue
        # them; the CPU worker collects a step before it launches the next, so nothing was
        # running for a copy to wait for
        assert 0 < cache["host_load_steps"] <= cache["host_loads"]
        assert cache["host_write_steps"] > 0 and cache["host_copy_issue_s"] > 0
        assert cache["host_load_steps_waited"] == cache["host_write_steps_waited"] == 0
    finally:
        assert server.stop() is not None


def test_server_prefetches_requests_read_while_a_step_runs(tmp_path):
    """A real server with prefetch on arrival (the default): second turns sent together, more
    than the slots hold, so the scheduler reads some while a step runs and sends their loads
    to the worker at once (HostCopies); greedy outputs equal the same prompts computed
    without reuse."""
    from concurrent.futures import ThreadPoolExecutor

    from server_support import start_server

    server = start_server(
        str(tmp_path), *TIERED_SERVER, "--max-total-tokens", "192", "--max-running-requests", "2"
    )
    try:
        prompts, _ = staggered(vocab=500, n=8)
        sampling = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
        with server.client(timeout=120) as c:

            def generate(prompt, salt=""):
                body = {"input_ids": prompt, "sampling_params": sampling}
                if salt:
                    body["cache_salt"] = salt
                r = c.post("/generate", json=body)
                assert r.status_code == 200, r.text
                return r.json()

            fresh = [generate(p, f"own-{i}")["output_ids"] for i, p in enumerate(prompts)]
            first = [generate(p)["output_ids"] for p in prompts[:8]]
            with ThreadPoolExecutor(9) as pool:
                # a long request keeps the scheduler stepping while the second turns arrive
                long = {"input_ids": prompts[0][:20], "cache_salt": "busy",
                        "sampling_params": {**sampling, "max_new_tokens": 80}}  # fmt: skip
                busy = pool.submit(c.post, "/generate", json=long)
                for _ in range(500):
                    if c.get("/get_server_info").json()["running_requests"]:
                        break
                second = list(pool.map(generate, prompts[8:]))
                assert busy.result().status_code == 200
            cache = c.get("/get_server_info").json()["cache"]
        assert first + [out["output_ids"] for out in second] == fresh
        assert sum(out["meta_info"]["host_cached_tokens"] for out in second) > 0
        assert cache["host_prefetches"] > 0 and cache["host_early_copies"] > 0
    finally:
        assert server.stop() is not None
