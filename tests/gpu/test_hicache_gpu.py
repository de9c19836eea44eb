"""The host tier's copies on CUDA (worker/host_pool.py): pinned pool, side stream, events; the
copies of a batch are ordered after the compute stream's earlier work and before the step's.
The end-to-end check (outputs with the tier == without) is the CPU suite's
test_hicache_equivalence run with device="cuda" below."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from radix_runtime.worker.host_pool import (  # noqa: E402
    HostKVPool,
    StepPages,
    measure_load_bandwidth,
)
from radix_runtime.worker.kv_pool import KVPool  # noqa: E402


def _pools(page_size=16, num_pages=64, host_pages=128, **kw):
    dev = KVPool(4, num_pages, page_size, 2, 64, torch.bfloat16, torch.device("cuda"))
    for buf in dev.k_buffers + dev.v_buffers:
        buf.normal_()
    return dev, HostKVPool(dev, host_pages, **kw)


def test_host_pool_is_pinned_and_copies_round_trip():
    dev, host = _pools()
    # pinned at its exact size (cudaHostRegister), not by the power-of-two pinned allocator
    assert host.buffer.is_pinned() and host.registered
    src = np.array([3, 7, 8, 20], np.int32)
    before = [b[torch.from_numpy(src).long().cuda()].clone() for b in dev.k_buffers]
    host.copy(
        src, np.array([1, 2, 3, 4], np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32), True
    )
    for b in dev.k_buffers:  # the step overwrites the written pages: the write waited for it
        b[torch.from_numpy(src).long().cuda()] = 0
    handle = host.copy(
        np.zeros(0, np.int32), np.zeros(0, np.int32),
        np.array([1, 2, 3, 4], np.int32), np.array([30, 31, 32, 33], np.int32), False,
    )  # fmt: skip
    torch.cuda.synchronize()
    for b, want in zip(dev.k_buffers, before):
        assert torch.equal(b[30:34], want)
    assert HostKVPool.load_time(handle) > 0
    # the model waits for the load: its wait spans the load (the compute stream was idle)
    assert HostKVPool.wait_time(handle) > 0


def test_a_load_is_ordered_after_earlier_work_on_its_pages():
    """A long kernel on the compute stream writes a page, then the batch loads into that page:
    the load must land after (the side stream waits for the compute stream)."""
    dev, host = _pools()
    host.buffer.fill_(1.0)
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        big = big @ big / 64  # keep the compute stream busy
    page = dev.k_buffers[0][5]
    page.copy_((big[0, 0] * 0 + 7).expand(page.shape))  # 7, written after the matmuls, no sync
    host.copy(np.zeros(0, np.int32), np.zeros(0, np.int32), np.array([9], np.int32),
              np.array([5], np.int32), False)  # fmt: skip
    dev.k_buffers[0][5].add_(1)  # the step reading it runs after the load
    torch.cuda.synchronize()
    assert torch.all(dev.k_buffers[0][5] == 2)  # 8 if the load had landed before the 7


def test_copies_that_touch_no_page_of_the_running_steps_overlap_them():
    """The worker names the pages the steps still running read and write (`busy`): a load or a
    write that touches none of them runs while the compute stream is busy; a load into one of
    them, or a write of one a running step writes, waits for it."""
    dev, host = _pools()
    host.buffer.fill_(1.0)
    torch.cuda.synchronize()
    none = np.zeros(0, np.int32)
    busy = StepPages(read=np.array([3, 4], np.int32), written=np.array([4], np.int32))

    def running_step() -> torch.cuda.Event:
        torch.cuda._sleep(int(5e8))  # a few hundred ms on the compute stream
        done = torch.cuda.Event()
        done.record()
        return done

    # warm-up: the copy path's first call (allocations, kernel loads) must not eat the step
    host.copy(none, none, np.array([9], np.int32), np.array([6], np.int32), False, busy=busy)
    host.copy(np.array([6], np.int32), np.array([22], np.int32), none, none, False, busy=busy)
    torch.cuda.synchronize()
    step = running_step()
    host.copy(none, none, np.array([9], np.int32), np.array([5], np.int32), False, busy=busy)
    host.copy(np.array([3], np.int32), np.array([20], np.int32), none, none, False, busy=busy)
    host.stream.synchronize()  # the load and the write are done ...
    assert not step.query()  # ... while the step still runs
    torch.cuda.synchronize()
    assert torch.all(dev.k_buffers[0][5] == 1)
    step = running_step()
    host.copy(none, none, np.array([9], np.int32), np.array([3], np.int32), False, busy=busy)
    host.stream.synchronize()
    assert step.query()  # page 3 is read by the running step: the load waited for it
    step = running_step()
    host.copy(np.array([4], np.int32), np.array([21], np.int32), none, none, False, busy=busy)
    host.stream.synchronize()
    assert step.query()  # page 4 is written by the running step: the write waited for it
    torch.cuda.synchronize()


def test_loads_for_later_steps_do_not_hold_this_step_and_the_step_reading_them_waits():
    """`needs`: the pages of the batch's own step. Loads into other pages (prefetches) go after
    its own and the compute stream does not wait for them; the first later step touching their
    pages does (`wait_pending`), and one that does not touch them does not."""
    dev, host = _pools()
    host.buffer.fill_(1.0)
    none = np.zeros(0, np.int32)
    host.copy(none, none, np.array([9], np.int32), np.array([6], np.int32), False)  # warm-up
    torch.cuda.synchronize()
    with torch.cuda.stream(host.stream):
        torch.cuda._sleep(int(5e8))  # the copy stream busy for a few hundred ms
    held = host.copy(none, none, np.array([11], np.int32), np.array([8], np.int32), False,
                     needs=none)  # fmt: skip
    free = torch.cuda.Event()
    free.record()
    free.synchronize()  # the compute stream passed the batch ...
    assert not host._pending[0][0].query()  # ... while its load still waits behind the sleep
    assert not held.ready()  # (its time is read later: collecting a step never waits for it)
    host.copy(none, none, np.array([9, 10], np.int32), np.array([5, 7], np.int32), False,
              needs=np.array([5], np.int32))  # fmt: skip
    own = torch.cuda.Event()
    own.record()  # after the compute stream's wait for page 5's load (not page 7's)
    assert [d.tolist() for _, d in host._pending] == [[8], [7]]
    assert host.wait_pending(StepPages(read=np.array([1, 2], np.int32), written=none)) is None
    waited = host.wait_pending(StepPages(read=np.array([3], np.int32), written=np.array([8])))
    assert waited is not None and [d.tolist() for _, d in host._pending] == [[7]]
    dev.k_buffers[0][8].add_(1)  # the step writing page 8 runs after its load
    torch.cuda.synchronize()
    assert own.query() and torch.all(dev.k_buffers[0][5] == 1)
    assert torch.all(dev.k_buffers[0][7] == 1) and torch.all(dev.k_buffers[0][8] == 2)
    assert HostKVPool.wait_time(waited) > 0
    # a load done is dropped without a wait
    assert host.wait_pending(StepPages(read=np.array([7], np.int32), written=none)) is None
    assert host._pending == []


def test_a_host_page_written_twice_in_a_batch_holds_the_later_write():
    """One batch's writes name host page 2 twice (a node written, host-evicted and its page
    handed to the next node before the batch was sent): the later write owns it."""
    dev, host = _pools()
    host.copy(np.array([3, 7, 8], np.int32), np.array([2, 5, 2], np.int32),
              np.zeros(0, np.int32), np.zeros(0, np.int32), True)  # fmt: skip
    host.synchronize()
    for i in range(dev.num_layers):
        assert torch.equal(host.buffer[2, i, 0], dev.k_buffers[i][8].cpu())
        assert torch.equal(host.buffer[5, i, 0], dev.k_buffers[i][7].cpu())


def test_a_load_reads_the_writes_queued_before_it_without_a_host_wait():
    """Batch 1 writes device pages to host pages 10..13; batch 2, queued at once (no
    synchronize), loads them back: the load runs after the writes on the one side stream. The
    staging buffer holds 3 pages, so runs cross chunk edges."""
    dev, _ = _pools()
    per_page = KVPool.bytes_per_token(4, 2, 64, torch.bfloat16) * dev.page_size
    host = HostKVPool(dev, 128, staging_bytes=3 * per_page)
    assert host.chunk_pages == 3 and host.staging.is_cuda
    src = np.array([3, 4, 5, 6, 9], np.int32)
    want = [b[torch.from_numpy(src).long().cuda()].clone() for b in dev.k_buffers + dev.v_buffers]
    none = np.zeros(0, np.int32)
    host.copy(src, np.array([13, 12, 11, 10, 40], np.int32), none, none, False)
    host.copy(none, none, np.array([10, 11, 12, 13, 40], np.int32),
              np.array([50, 51, 52, 53, 54], np.int32), False)  # fmt: skip
    torch.cuda.synchronize()
    order = torch.tensor([53, 52, 51, 50, 54], device="cuda")  # host 13 <- device 3, ...
    for b, w in zip(dev.k_buffers + dev.v_buffers, want):
        assert torch.equal(b[order], w)
    assert (host.write_runs, host.load_runs) == (2, 2)


def test_copies_on_cuda_equal_the_cpu_path():
    """The same random batches through a CUDA pool and a CPU pool: same host pages, same
    device pages (a staging buffer of 5 pages: several chunks per batch)."""
    rng = np.random.default_rng(0)
    cuda_dev, _ = _pools(page_size=4)
    cpu_dev = KVPool(4, 64, 4, 2, 64, torch.bfloat16, torch.device("cpu"))
    per_page = KVPool.bytes_per_token(4, 2, 64, torch.bfloat16) * 4
    pools = [HostKVPool(d, 96, staging_bytes=5 * per_page) for d in (cuda_dev, cpu_dev)]
    for p in pools:
        p.buffer.zero_()  # loads may read host pages never written
    for step in range(6):
        for a, b in zip(
            cuda_dev.k_buffers + cuda_dev.v_buffers, cpu_dev.k_buffers + cpu_dev.v_buffers
        ):
            b.copy_(a.cpu())
        ws = rng.choice(np.arange(1, 64), 20, replace=False).astype(np.int32)
        wd = rng.integers(1, 96, 20).astype(np.int32)
        ls = rng.choice(np.arange(1, 96), 12, replace=False).astype(np.int32)
        ld = rng.choice(np.arange(1, 64), 12, replace=False).astype(np.int32)
        for p in pools:
            p.copy(ws, wd, ls, ld, bool(step % 2))
        torch.cuda.synchronize()
        assert torch.equal(pools[0].buffer, pools[1].buffer)
        for a, b in zip(
            cuda_dev.k_buffers + cuda_dev.v_buffers, cpu_dev.k_buffers + cpu_dev.v_buffers
        ):
            assert torch.equal(a.cpu(), b)
        for buf in cuda_dev.k_buffers + cuda_dev.v_buffers:
            buf.normal_()


def test_fp8_pages_round_trip():
    dev = KVPool(2, 32, 1, 2, 64, torch.float8_e4m3fn, torch.device("cuda"))
    for buf in dev.k_buffers + dev.v_buffers:
        buf.copy_(torch.randn(buf.shape, device="cuda").to(torch.float8_e4m3fn))
    host = HostKVPool(dev, 32)
    none = np.zeros(0, np.int32)
    host.copy(np.array([1, 2, 3], np.int32), np.array([5, 6, 7], np.int32), none, none, False)
    host.copy(none, none, np.array([5, 6, 7], np.int32), np.array([10, 11, 12], np.int32), False)
    torch.cuda.synchronize()
    for b in dev.k_buffers + dev.v_buffers:
        assert torch.equal(b[10:13].view(torch.uint8), b[1:4].view(torch.uint8))


def test_pinned_bandwidth_is_measured():
    assert measure_load_bandwidth(torch.device("cuda"), 64 << 20) > 1e9


def test_outputs_with_the_host_tier_on_cuda(monkeypatch):
    pytest.importorskip("flashinfer")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    import test_cache_equivalence as eq
    import test_hicache_equivalence as hq

    from radix_runtime import messages as m
    from radix_runtime.config import ServerArgs
    from radix_runtime.worker.model_runner import ModelRunner

    base = ServerArgs(model="tiny-llama", load_format="dummy", model_config="tiny-llama",
                      max_total_tokens=64, chunked_prefill_size=32, max_running_requests=3,
                      device="cuda", disable_cuda_graph=True)  # fmt: skip
    tiered = base.replace(enable_hierarchical_cache=True, hicache_ratio=8.0)
    runner, tiered_runner = ModelRunner(base), ModelRunner(tiered)
    prompts, arrivals = hq.conversations(runner.ready_info().vocab_size)
    greedy = m.SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    off, _ = eq.run(runner, base.replace(disable_radix_cache=True), prompts, greedy, arrivals)
    for impl in ("python", "cpp"):
        for overlap_off in (True, False):
            args = tiered.replace(disable_overlap_schedule=overlap_off, radix_tree_impl=impl)
            on, sched = eq.run(tiered_runner, args, prompts, greedy, arrivals)
            assert on == off and sched.tree_impl == impl
            assert sched.host_cached_tokens_total > 0


def test_prefetched_loads_sent_while_steps_run_keep_outputs_on_cuda():
    """--hicache-prefetch arrival on CUDA: the loads of requests that arrive while steps are in
    flight go to the runner at once (`ModelRunner.early_copies`, as the scheduler process sends
    them), on the copy stream beside those steps; greedy outputs equal cache off (page size 1
    and 16, CUDA graphs off and on)."""
    pytest.importorskip("flashinfer")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    import test_cache_equivalence as eq
    import test_hicache_equivalence as hq

    from radix_runtime import messages as m
    from radix_runtime.config import ServerArgs
    from radix_runtime.worker.model_runner import ModelRunner

    for page_size, pool, no_graphs in [(1, 96, True), (16, 128, True), (16, 128, False)]:
        args = ServerArgs(model="tiny-llama", load_format="dummy", model_config="tiny-llama",
                          page_size=page_size, max_total_tokens=pool, chunked_prefill_size=32,
                          max_running_requests=3, device="cuda", disable_cuda_graph=no_graphs,
                          cuda_graph_max_bs=4, cuda_graph_max_extend_tokens=64,
                          enable_hierarchical_cache=True, hicache_ratio=8.0)  # fmt: skip
        runner = ModelRunner(args)
        prompts, arrivals = hq.staggered(runner.ready_info().vocab_size)
        greedy = m.SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
        off, _ = eq.run(runner, args.replace(disable_radix_cache=True), prompts, greedy, arrivals)
        for impl in ("python", "cpp"):
            on, sched = eq.run(runner, args.replace(radix_tree_impl=impl), prompts, greedy,
                               arrivals, early=True)  # fmt: skip
            assert on == off, (page_size, impl, no_graphs)
            assert sched.counters.host_prefetches > 0 and sched.counters.host_early_copies > 0


def test_a_cuda_batch_reports_which_copies_waited_and_its_host_time():
    """The flags the worker reports per step (ForwardResult.load_waited / write_waited) are the
    waits the copies were queued with; issue_s is the host's time in `copy`."""
    dev, host = _pools()
    none = np.zeros(0, np.int32)
    busy = StepPages(read=np.array([3, 4], np.int32), written=np.array([4], np.int32))
    apart = host.copy(np.array([3], np.int32), np.array([20], np.int32), np.array([9], np.int32),
                      np.array([5], np.int32), False, busy=busy)  # fmt: skip
    assert not apart.load_waited and not apart.write_waited and apart.issue_s > 0
    touching = host.copy(np.array([4], np.int32), np.array([21], np.int32),
                         np.array([9], np.int32), np.array([3], np.int32), False, busy=busy)  # fmt: skip
    assert touching.load_waited and touching.write_waited
    idle = host.copy(none, none, none, none, False, busy=busy)
    assert not idle.load_waited and not idle.write_waited
    torch.cuda.synchronize()


@pytest.mark.parametrize(
    "page_size,dtype,num_pages",
    [
        (1, torch.bfloat16, 700),
        (16, torch.bfloat16, 40),
        (16, torch.float8_e4m3fn, 40),
        (3, torch.float32, 90),
    ],
)
def test_page_copy_kernel_equals_the_reference(page_size, dtype, num_pages):
    """kernels/page_copy.py: the one-launch gather and scatter over every buffer (and over one
    layer's K and V: a slice of the table) move the same bits as one index op per buffer;
    several programs per buffer (page size 1: 700 pages), pages never named stay as they were."""
    from radix_runtime.worker.kernels._triton import HAVE_TRITON
    from radix_runtime.worker.kernels.page_copy import buffer_table, page_copy, page_copy_reference

    if not HAVE_TRITON:
        pytest.skip("needs Triton")
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[
        torch.empty((), dtype=dtype).element_size()
    ]
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (num_pages, page_size, 2, 64)
    buffers = [
        torch.randint(-100, 100, shape, generator=gen, device="cuda").to(bits) for _ in range(6)
    ]
    row = page_size * 2 * 64
    table = buffer_table(buffers)
    n = num_pages // 2
    idx = torch.randperm(num_pages, device="cuda", generator=gen)[:n]
    got = torch.zeros((n, 6, page_size, 2, 64), dtype=bits, device="cuda")
    want = torch.zeros_like(got)
    page_copy(table, idx, got, row, gather=True)
    page_copy_reference(buffers, idx, want, gather=True)
    assert torch.equal(got, want)
    # a scatter of other rows into other pages
    dst = torch.randperm(num_pages, device="cuda", generator=gen)[:n]
    rows = torch.randint(-100, 100, got.shape, generator=gen, device="cuda").to(bits)
    copies = [b.clone() for b in buffers]
    page_copy(table, dst, rows, row, gather=False)
    page_copy_reference(copies, dst, rows, gather=False)
    for b, c in zip(buffers, copies):
        assert torch.equal(b, c)
    # one layer's K and V (the table's slice), from a [n, 2, ...] region
    region = rows[:, :2].contiguous()
    page_copy(table[2:4], idx, region, row, gather=False)
    page_copy_reference(copies[2:4], idx, region, gather=False)
    for b, c in zip(buffers, copies):
        assert torch.equal(b, c)


def test_the_pool_compiles_its_page_copies_after_the_compute_streams_earlier_work():
    """The page copies run once when the pool is made (compiled then, not mid-batch), on the
    copy stream, reading the address table and the pool's pages queued on the compute stream:
    the copy stream waits for the compute stream first (here: held back by a sleep)."""
    from radix_runtime.worker.kernels._triton import HAVE_TRITON

    if not HAVE_TRITON:
        pytest.skip("needs Triton")
    dev = KVPool(2, 16, 1, 2, 64, torch.bfloat16, torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e8))  # the compute stream busy for a few hundred ms
    earlier = torch.cuda.Event()
    earlier.record()
    HostKVPool(dev, 16)
    assert earlier.query()  # made after the compute stream's earlier work was done
