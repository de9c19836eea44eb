"""The worker's host pool (worker/host_pool.py) applying one batch's copies when the tree named
a page twice: a node written to the host, evicted from it and its host page handed to the next
node written, all before the batch was sent. The later copy owns the page."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radix_runtime.scheduler.allocator import PageAllocator
from radix_runtime.scheduler.radix_cache import RadixCache
from radix_runtime.worker.host_pool import (
    HostKVPool,
    _runs_in,
    consecutive_runs,
    last_per_destination,
)
from radix_runtime.worker.kv_pool import KVPool

TREES = [RadixCache]
try:
    from radix_runtime.scheduler.radix_cache_cpp import CppRadixCache

    TREES.append(CppRadixCache)
except ImportError:  # the C++ tree is not built: the Python one alone
    pass


def _batch_with_a_reused_host_page(tree):
    """Two nodes evicted in one call into a host pool with room for one of them: the first is
    written, then evicted from the host to make room for the second, which gets its pages."""
    dev, host = PageAllocator(16), PageAllocator(4)  # 3 usable host pages
    cache = tree(1, dev, host_allocator=host)
    pages = [dev.alloc(3), dev.alloc(3)]
    for key, p in zip(([1, 2, 3], [4, 5, 6]), pages):
        cache.insert(np.array(key, np.int32), p)
    cache.evict(6)
    copies = cache.take_copies()
    node = cache.match_prefix(np.array([4, 5, 6], np.int32)).host_node
    return copies, pages, node.host_pages


@pytest.mark.parametrize("tree", TREES, ids=lambda t: t.__name__)
def test_the_later_write_owns_a_host_page_named_twice(tree):
    copies, (first, second), owned = _batch_with_a_reused_host_page(tree)
    src = np.concatenate([c.src for c in copies.writes])
    dst = np.concatenate([c.dst for c in copies.writes])
    assert len(np.unique(dst)) < len(dst)  # the tree did name a host page twice
    dev = KVPool(2, 16, 1, 2, 4, torch.float32, torch.device("cpu"))
    for i in range(dev.num_layers):  # each device page's KV: its page id (and the layer)
        for page in range(16):
            dev.k_buffers[i][page] = page + 100 * i
            dev.v_buffers[i][page] = -(page + 100 * i)
    pool = HostKVPool(dev, 4)
    written = []
    real = pool._write_sync
    pool._write_sync = lambda s, d: (written.append(d.copy()), real(s, d))
    pool.copy(src, dst, np.empty(0, np.int32), np.empty(0, np.int32), copies.writes_block)
    assert len(np.unique(written[0])) == len(written[0])  # one copy per page reached torch
    for page, host_page in zip(second.tolist(), owned.tolist()):
        for i in range(dev.num_layers):
            assert (pool.buffer[host_page, i, 0] == page + 100 * i).all()
            assert (pool.buffer[host_page, i, 1] == -(page + 100 * i)).all()


def test_last_per_destination():
    src, dst = np.array([10, 11, 12, 13, 14]), np.array([1, 2, 1, 3, 2])
    s, d = last_per_destination(src, dst)
    assert (s.tolist(), d.tolist()) == ([12, 13, 14], [1, 3, 2])
    s, d = last_per_destination(src[:3], np.array([5, 6, 7]))
    assert s.tolist() == [10, 11, 12] and d.tolist() == [5, 6, 7]
    assert last_per_destination(src[:0], dst[:0])[1].size == 0


def test_consecutive_runs():
    starts, lengths = consecutive_runs(np.array([3, 4, 5, 9, 10, 12, 12, 13]))
    assert starts.tolist() == [0, 3, 5, 6] and lengths.tolist() == [3, 2, 1, 2]
    assert consecutive_runs(np.zeros(0, np.int64))[0].size == 0


@pytest.mark.parametrize("a,b", [(0, 8), (2, 7), (3, 4), (5, 8)])
def test_runs_clipped_to_a_chunk(a, b):
    ids = np.array([3, 4, 5, 9, 10, 12, 13, 14])
    starts, lengths = consecutive_runs(ids)
    got = list(_runs_in(starts, lengths, a, b))
    covered = [k for j, r in got for k in range(j, j + r)]
    assert covered == list(range(a, b))  # every index of the chunk once, in order
    for j, r in got:  # each piece is consecutive host pages
        assert (np.diff(ids[j : j + r]) == 1).all()


def _filled(dev: KVPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for buf in dev.k_buffers + dev.v_buffers:
        buf.copy_(torch.randn(buf.shape, generator=g).to(dev.dtype))


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_copies_match_a_page_model(page_size, dtype):
    """Random batches of writes and loads (runs of consecutive host pages, scattered pages,
    repeated destinations): every device and host page holds what a per-page model of the
    copies says."""
    rng = np.random.default_rng(page_size)
    dev = KVPool(3, 24, page_size, 2, 4, dtype, torch.device("cpu"))
    _filled(dev, 0)
    pool = HostKVPool(dev, 40)
    host_model: dict[int, list[torch.Tensor]] = {}

    def page(i):
        return [b[i].clone() for b in dev.k_buffers + dev.v_buffers]

    for step in range(12):
        n = int(rng.integers(1, 12))
        src = rng.choice(np.arange(1, 24), n, replace=False).astype(np.int32)
        if step % 2:  # a run of consecutive host pages, in reverse (a LIFO allocator's order)
            first = int(rng.integers(1, 40 - n))
            dst = np.arange(first + n - 1, first - 1, -1, dtype=np.int32)
        else:
            dst = rng.integers(1, 40, n).astype(np.int32)  # may repeat: the later one owns it
        for s, d in zip(src.tolist(), dst.tolist()):
            host_model[d] = page(s)
        held = np.array(sorted(host_model), np.int32)
        m = int(rng.integers(1, min(len(held), 10) + 1))
        lsrc = rng.choice(held, m, replace=False)
        ldst = rng.choice(np.arange(1, 24), m, replace=False).astype(np.int32)
        pool.copy(src, dst, lsrc, ldst, False)  # writes land before the loads read them
        for s, d in zip(lsrc.tolist(), ldst.tolist()):
            for got, want in zip(page(d), host_model[s]):
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        for h, want in host_model.items():
            got = pool.buffer[h]
            for i in range(dev.num_layers):
                assert torch.equal(got[i, 0].view(torch.uint8), want[i].view(torch.uint8))
                assert torch.equal(got[i, 1].view(torch.uint8), want[3 + i].view(torch.uint8))
        _filled(dev, step + 1)  # the steps overwrite the device pool


def test_a_host_page_is_one_contiguous_block_and_runs_are_counted():
    dev = KVPool(2, 16, 1, 2, 4, torch.float32, torch.device("cpu"))
    _filled(dev, 0)
    pool = HostKVPool(dev, 32)
    assert pool.buffer.shape[0] == 32 and pool.buffer[5].is_contiguous()
    assert pool.page_bytes == dev.bytes_per_token(2, 2, 4, torch.float32)
    none = np.zeros(0, np.int32)
    # host pages 9, 8, 7 and 20: two runs once sorted
    pool.copy(
        np.array([1, 2, 3, 4], np.int32), np.array([9, 8, 7, 20], np.int32), none, none, False
    )
    assert (pool.write_runs, pool.write_pages) == (2, 4)
    pool.copy(
        none, none, np.array([20, 7, 8, 9], np.int32), np.array([5, 6, 7, 8], np.int32), False
    )
    assert (pool.load_runs, pool.load_pages) == (2, 4)
    assert torch.equal(dev.k_buffers[0][5], dev.k_buffers[0][4])  # host 20 <- device 4
    assert torch.equal(dev.k_buffers[0][8], dev.k_buffers[0][1])  # host 9 <- device 1
    assert not torch.equal(dev.k_buffers[0][8], dev.k_buffers[0][2])


def test_the_cuda_paths_run_copies_move_each_chunk_between_pool_and_staging():
    """`_copy_runs` (the CUDA paths' copies, run here on host tensors): chunk by chunk, a
    load puts the chunk's host pages in the staging rows in order, a write puts the rows back."""
    dev = KVPool(2, 16, 1, 2, 4, torch.float32, torch.device("cpu"))
    pool = HostKVPool(dev, 32, staging_bytes=3 * pool_page_bytes(dev))
    pool.buffer.copy_(torch.randn(pool.buffer.shape))
    pool.staging = torch.empty((3, *pool.buffer.shape[1:]))  # on the device on CUDA
    pool._staging = pool.staging.view(torch.int32)  # the copies move bits
    before = pool.buffer.clone()
    ids = np.array([2, 3, 4, 5, 9, 11, 12, 20], np.int64)  # sorted, runs across chunk edges
    starts, lengths = consecutive_runs(ids)
    for a in range(0, len(ids), pool.chunk_pages):
        b = min(a + pool.chunk_pages, len(ids))
        pool.staging.fill_(-1)
        pool._copy_runs(ids, starts, lengths, a, b, load=True)
        assert torch.equal(pool.staging[: b - a], pool.buffer[torch.from_numpy(ids[a:b])])
        pool.staging[: b - a] *= 2
        pool._copy_runs(ids, starts, lengths, a, b, load=False)
    want = before.clone()
    want[torch.from_numpy(ids)] *= 2  # written back to their own pages, the others untouched
    assert torch.equal(pool.buffer, want)


def pool_page_bytes(dev: KVPool) -> int:
    return (
        dev.bytes_per_token(dev.num_layers, dev.kv_heads, dev.head_dim, dev.dtype) * dev.page_size
    )


def test_a_batch_reports_its_load_time_and_the_steps_wait_for_its_copies():
    dev = KVPool(2, 16, 1, 2, 4, torch.float32, torch.device("cpu"))
    _filled(dev, 0)
    pool = HostKVPool(dev, 32)
    none = np.zeros(0, np.int32)
    idle = pool.copy(none, none, none, none, False)
    assert HostKVPool.load_time(idle) == HostKVPool.wait_time(idle) == 0.0
    assert HostKVPool.load_time(None) == HostKVPool.wait_time(None) == 0.0
    writes = pool.copy(np.array([1, 2], np.int32), np.array([3, 4], np.int32), none, none, False)
    assert HostKVPool.load_time(writes) == 0.0 < HostKVPool.wait_time(writes)
    both = pool.copy(
        np.array([5], np.int32), np.array([9], np.int32),
        np.array([3, 4], np.int32), np.array([7, 8], np.int32), False,
    )  # fmt: skip
    # on the CPU the step waits for every copy: the writes and the loads
    assert 0.0 < HostKVPool.load_time(both) <= HostKVPool.wait_time(both)
    # the bytes the loads moved (the worker's debug log of each load's throughput)
    assert both.load_bytes == 2 * pool.page_bytes and writes.load_bytes == 0


def test_a_batch_reports_whether_its_copies_wait_for_the_running_steps():
    """`busy`: the pages the steps still running read and write. A load into one of them, or a
    write of one they write, waits (CUDA: the side stream waits for the compute stream); the
    rest run beside the step. The worker reports which did (and the host time to queue them)."""
    from radix_runtime.worker.host_pool import StepPages

    dev = KVPool(2, 16, 1, 2, 4, torch.float32, torch.device("cpu"))
    _filled(dev, 0)
    pool = HostKVPool(dev, 32)
    busy = StepPages(read=np.array([3, 4], np.int32), written=np.array([4], np.int32))

    def copy(ws, wd, ls, ld, busy=busy):
        a = [np.array(x, np.int32) for x in (ws, wd, ls, ld)]
        return pool.copy(*a, False, busy=busy)

    apart = copy([3], [20], [9], [5])  # writes page 3 (only read by the step), loads into 5
    assert not apart.load_waited and not apart.write_waited and apart.issue_s > 0
    assert copy([], [], [9], [3]).load_waited  # page 3 is read by the running step
    assert copy([4], [21], [], []).write_waited  # page 4 is written by it
    assert copy([], [], [9], [4]).load_waited
    # no page list (None): every copy waits; no copies: nothing waited
    everything = copy([5], [22], [9], [6], busy=None)
    assert everything.load_waited and everything.write_waited
    idle = copy([], [], [], [])
    assert not idle.load_waited and not idle.write_waited
