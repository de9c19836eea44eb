"""The worker's host pool (worker/host_pool.py) applying one batch's copies when the tree named
a page twice: a node written to the host, evicted from it and its host page handed to the next
node written, all before the batch was sent. The later copy owns the page."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radix_runtime.scheduler.allocator import PageAllocator
from radix_runtime.scheduler.radix_cache import RadixCache
from radix_runtime.worker.host_pool import HostKVPool, last_per_destination
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
            assert (pool.buffer[i, 0, host_page] == page + 100 * i).all()
            assert (pool.buffer[i, 1, host_page] == -(page + 100 * i)).all()


def test_last_per_destination():
    src, dst = np.array([10, 11, 12, 13, 14]), np.array([1, 2, 1, 3, 2])
    s, d = last_per_destination(src, dst)
    assert (s.tolist(), d.tolist()) == ([12, 13, 14], [1, 3, 2])
    s, d = last_per_destination(src[:3], np.array([5, 6, 7]))
    assert s.tolist() == [10, 11, 12] and d.tolist() == [5, 6, 7]
    assert last_per_destination(src[:0], dst[:0])[1].size == 0
