"""The radix tree's host tier (radix_cache.py, docs/hicache.md): residency, locks, eviction order
in both tiers, the copies it queues, and integrity, against a brute-force model.

The model simulates the two pools' contents: each page holds the prefix (namespace, tokens)
whose KV it has. A request's step writes its new pages; the tree's queued copies are applied
before that step (writes, then loads), as the worker does. Every prefix the tree holds must
then find its own KV in every tier the tree says it is in: a copy missing, misordered or read
from a reused page shows up as a wrong value."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from radix_runtime.scheduler.allocator import PageAllocator
from radix_runtime.scheduler.radix_cache import RadixCache

_PATTERNS = {1: [[5], [6], [7]], 4: [[5] * 4, [5, 5, 6, 6], [7] * 4]}


def tiered(page_size=1, dev_pages=9, host_pages=17, write_through=False):
    dev = PageAllocator(dev_pages)
    host = PageAllocator(host_pages)
    return RadixCache(page_size, dev, host_allocator=host, write_through=write_through), dev, host


def residency(cache: RadixCache) -> dict[tuple, tuple]:
    """(namespace, prefix tokens) -> (device page | None, host page | None, node) per page."""
    ps = cache.page_size
    out = {}
    stack = [(cache.root, None, ())]
    while stack:
        node, ns, prefix = stack.pop()
        for child in node.children.values():
            if child.namespace is not None:
                stack.append((child, child.namespace, ()))
                continue
            full = prefix + tuple(child.key.tolist())
            for i in range(len(child.key) // ps):
                dev = int(child.pages[i]) if len(child.pages) else None
                host = int(child.host_pages[i]) if child.host_pages is not None else None
                out[ns, full[: len(prefix) + (i + 1) * ps]] = (dev, host, child)
            stack.append((child, ns, full))
    return out


class Pools:
    """The simulated contents of the device and host pools."""

    def __init__(self):
        self.dev: dict[int, tuple] = {}
        self.host: dict[int, tuple] = {}

    def step(self, cache: RadixCache) -> None:
        copies = cache.take_copies()
        for c in copies.writes:
            for s, d in zip(c.src.tolist(), c.dst.tolist()):
                self.host[d] = self.dev.get(s)
        for c in copies.loads:
            for s, d in zip(c.src.tolist(), c.dst.tolist()):
                self.dev[d] = self.host.get(s)


class TieredMachine(RuleBasedStateMachine):
    page_size = 1
    host_pages = 17
    write_through = False
    keys = Bundle("keys")

    @initialize()
    def setup(self):
        self.cache, self.alloc, self.host = tiered(
            self.page_size, 9 if self.page_size == 1 else 7, self.host_pages, self.write_through
        )
        self.pools = Pools()
        self.requests: list[dict] = []
        self.inserted: set[tuple] = set()  # every prefix ever cached (since the last reset)
        self.lost: set[tuple] = set()  # prefixes that left the tree

    @rule(
        target=keys,
        patterns=st.lists(st.integers(0, 2), min_size=1, max_size=5),
        ns=st.sampled_from([None, None, "a"]),
    )
    def new_key(self, patterns, ns):
        return ns, tuple(t for p in patterns for t in _PATTERNS[self.page_size][p])

    @rule(target=keys, key=keys, more=st.lists(st.integers(0, 2), min_size=1, max_size=2))
    def extend_key(self, key, more):
        ns, tokens = key
        extra = tuple(t for p in more for t in _PATTERNS[self.page_size][p])
        return ns, (tokens + extra)[: 7 * self.page_size]

    # ---- helpers ----

    def _evict_device(self, n: int) -> None:
        before = residency(self.cache)
        locked_leaves = self._device_leaves(before)
        self.cache.evict(n)
        after = residency(self.cache)
        left = [
            k
            for k, v in before.items()
            if v[0] is not None and (k not in after or after[k][0] is None)
        ]
        stayed = [k for k in locked_leaves if k in after and after[k][0] is not None]
        if left and stayed:
            # LRU: nothing evicted from the device was used more recently than a device leaf
            # that stays (both unlocked)
            newest_left = max(before[k][2].last_access for k in left)
            assert newest_left <= min(after[k][2].last_access for k in stayed)
        for k in left:
            if k not in after:
                assert before[k][1] is None, "a node with a host copy left the tree"
                assert self.host_pages < 64, "device eviction dropped a node the host had room for"
                self.lost.add(k)

    def _device_leaves(self, res: dict) -> list[tuple]:
        ps = self.page_size
        on_dev = {k for k, v in res.items() if v[0] is not None}
        parents = {(ns, p[:-ps]) for ns, p in on_dev}
        return [k for k in on_dev if k not in parents and res[k][2].lock_ref == 0]

    def _take(self, n: int):
        if self.alloc.free_pages < n:
            self._evict_device(n - self.alloc.free_pages)
        return self.alloc.alloc(n)

    def _check_match(self, key, m):
        ps = self.page_size
        ns, tokens = key
        res = residency(self.cache)
        n = 0
        while n + ps <= len(tokens) and (ns, tokens[: n + ps]) in res:
            n += ps
        assert m.length + m.host_length == n, "the match is not the longest cached prefix"
        for i in range(ps, m.length + 1, ps):
            assert res[ns, tokens[:i]][0] is not None
        for i in range(m.length + ps, n + 1, ps):
            assert res[ns, tokens[:i]][0] is None, "the host run holds a device node"

    # ---- rules ----

    @precondition(lambda self: len(self.requests) < 3)
    @rule(key=keys, load=st.booleans())
    def start_request(self, key, load):
        ns, tokens = key
        ps = self.page_size
        m = self.cache.match_prefix(np.array(tokens, np.int32), ns)
        self._check_match(key, m)
        pages = m.pages
        node, length = m.node, m.length
        if m.host_length and load:
            self.cache.lock(m.host_node)
            got = self._take(m.host_length // ps)
            if got is not None:
                self.cache.load_back(m.host_node, got)
                pages = np.concatenate([m.pages, got])
                node, length = m.host_node, m.length + m.host_length
            self.cache.lock(node)  # the request's own lock (m.node when the load failed)
            self.cache.unlock(m.host_node)
        else:
            self.cache.lock(node)
        self.pools.step(self.cache)  # the loads land before the step that reads them
        for i, page in enumerate(pages.tolist()):
            assert self.pools.dev[page] == (ns, tokens[: (i + 1) * ps]), "loaded KV is wrong"
        self.requests.append({"key": key, "length": length, "node": node, "pages": pages})

    @precondition(lambda self: self.requests)
    @rule(which=st.integers(0, 2), abort=st.booleans())
    def finish_request(self, which, abort):
        """Compute the rest of the key and insert it (as `_release` does), or abort at once
        (`abort`: its loaded pages already belong to the tree; nothing else to free)."""
        req = self.requests.pop(which % len(self.requests))
        ns, tokens = req["key"]
        ps = self.page_size
        n_pages, own = len(tokens) // ps, req["length"] // ps
        new = None if abort else self._take(n_pages - own)
        if new is not None:
            self.pools.step(self.cache)  # the step's copies run before it writes its pages
            for i, page in enumerate(new.tolist()):
                self.pools.dev[page] = (ns, tokens[: (own + i + 1) * ps])
            pages = np.concatenate([req["pages"], new]).astype(np.int32)
            before = residency(self.cache)
            r = self.cache.insert(np.array(tokens, np.int32), pages, ns)
            dev_prefix = 0
            while (
                dev_prefix + ps <= len(tokens)
                and before.get((ns, tokens[: dev_prefix + ps]), (None,))[0] is not None
            ):
                dev_prefix += ps
            assert r.prefix_len == dev_prefix, "insert reports the device-cached prefix"
            self.alloc.free(pages[own : r.prefix_len // ps])
            for i in range(n_pages):
                self.inserted.add((ns, tokens[: (i + 1) * ps]))
                self.lost.discard((ns, tokens[: (i + 1) * ps]))
        self.cache.unlock(req["node"])

    @rule(n=st.integers(1, 8))
    def evict_device(self, n):
        self._evict_device(n)

    @rule(n=st.integers(1, 8))
    def evict_host(self, n):
        before = residency(self.cache)
        candidates = [
            k
            for k, v in before.items()
            if v[0] is None and v[2].lock_ref == 0 and not v[2].children
        ]
        self.cache.evict_host(n)
        after = residency(self.cache)
        gone = [k for k in before if k not in after]
        for k in gone:
            assert before[k][0] is None, "host eviction took a device node"
            assert before[k][2].lock_ref == 0, "host eviction took a locked node"
            self.lost.add(k)
        stayed = [k for k in candidates if k in after]
        if gone and stayed:
            assert max(before[k][2].last_access for k in gone) <= min(
                after[k][2].last_access for k in stayed
            )

    @invariant()
    def agrees(self):
        if not hasattr(self, "cache"):
            return
        cache = self.cache
        held = np.concatenate(
            [np.zeros(0, np.int32)]
            + [r["pages"][r["length"] // self.page_size :] for r in self.requests]
        )
        cache.check_integrity(held_pages=held)
        self.pools.step(cache)
        res = residency(cache)
        for key, (dev, host, _node) in res.items():
            assert dev is not None or host is not None, "a node in neither tier"
            assert key in self.inserted
            if dev is not None:
                assert self.pools.dev.get(dev) == key, f"device page {dev} holds the wrong KV"
            if host is not None:
                assert self.pools.host.get(host) == key, f"host page {host} holds the wrong KV"
        for r in self.requests:  # a running request's prefix never leaves the device
            ns, tokens = r["key"]
            for i in range(self.page_size, r["length"] + 1, self.page_size):
                assert res[ns, tokens[:i]][0] is not None
        if self.host_pages >= 64:  # room for everything: nothing ever leaves the tree
            assert set(res) == self.inserted - self.lost

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for r in self.requests:
            self.cache.unlock(r["node"])
        self.cache.check_integrity(expect_unlocked=True)
        self.cache.reset()
        assert self.alloc.free_pages == self.alloc.total_pages
        assert self.host.free_pages == self.host.total_pages


class TieredMachineBigHost(TieredMachine):
    host_pages = 200


class TieredMachineWriteThroughPage4(TieredMachine):
    page_size = 4
    write_through = True


_settings = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestTiered = TieredMachine.TestCase
TestTiered.settings = _settings
TestTieredBigHost = TieredMachineBigHost.TestCase
TestTieredBigHost.settings = _settings
TestTieredWriteThroughPage4 = TieredMachineWriteThroughPage4.TestCase
TestTieredWriteThroughPage4.settings = _settings


# ---------------------------------------------------------------- the named cases


def _cache_one(cache, tokens, alloc, pools=None):
    pages = alloc.alloc(len(tokens) // cache.page_size)
    if pools is not None:
        for i, p in enumerate(pages.tolist()):
            pools.dev[p] = (None, tuple(tokens[: i + 1]))
    cache.insert(np.array(tokens, np.int32), pages)
    return pages


def test_eviction_keeps_the_node_on_the_host_and_a_match_reaches_it():
    cache, alloc, host = tiered(dev_pages=9, host_pages=17)
    _cache_one(cache, [1, 2, 3, 4], alloc)
    assert cache.evict(4) == 4
    m = cache.match_prefix(np.array([1, 2, 3, 4, 9], np.int32))
    assert (m.length, m.host_length) == (0, 4)
    assert m.node is cache.root and m.host_node.host_pages is not None
    copies = cache.take_copies()
    assert [len(c.src) for c in copies.writes] == [4] and copies.writes_block
    cache.check_integrity()


def test_without_a_host_pool_eviction_drops_the_node():
    alloc = PageAllocator(9)
    cache = RadixCache(1, alloc)
    _cache_one(cache, [1, 2, 3], alloc)
    cache.evict(3)
    assert cache.match_prefix(np.array([1, 2, 3], np.int32)).host_length == 0
    assert not cache.root.children


def test_host_full_drops_lru_host_nodes_then_evicted_nodes():
    cache, alloc, host = tiered(dev_pages=9, host_pages=5)  # 4 usable host pages
    _cache_one(cache, [1, 2, 3, 4], alloc)
    cache.evict(4)  # -> host (full)
    _cache_one(cache, [5, 6, 7], alloc)
    cache.evict(3)  # host makes room: [1..4] is the LRU host leaf and leaves the tree
    assert cache.match_prefix(np.array([1, 2, 3, 4], np.int32)).host_length == 0
    assert cache.match_prefix(np.array([5, 6, 7], np.int32)).host_length == 3
    cache.check_integrity()


def test_a_node_being_loaded_is_locked_and_never_evicted():
    cache, alloc, host = tiered(dev_pages=9, host_pages=17)
    _cache_one(cache, [1, 2, 3, 4], alloc)
    cache.evict(4)
    m = cache.match_prefix(np.array([1, 2, 3, 4], np.int32))
    cache.lock(m.host_node)
    with pytest.raises(RuntimeError):  # a load needs the lock
        cache.load_back(cache.match_prefix(np.array([9], np.int32)).host_node or cache.root, [])
    cache.load_back(m.host_node, alloc.alloc(4))
    assert cache.evict(100) == 0 and cache.evict_host(100) == 0  # all locked
    assert cache.protected_pages == 4
    copies = cache.take_copies()
    assert [len(c.src) for c in copies.loads] == [4]
    cache.unlock(m.host_node)
    assert cache.evict(4) == 4  # now evictable; its host copy stays, so no write this time
    assert not cache.take_copies().writes
    cache.check_integrity()


def test_write_back_of_a_node_still_in_use_never_happens():
    """A node a running request holds (locked) is never written back nor evicted; the
    unlocked part of its branch is."""
    cache, alloc, host = tiered(dev_pages=9, host_pages=17)
    _cache_one(cache, [1, 2, 3, 4, 5, 6], alloc)
    m = cache.match_prefix(np.array([1, 2, 3], np.int32))  # splits: [1,2,3] | [4,5,6]
    cache.lock(m.node)
    assert cache.evict(100) == 3  # only the unlocked lower half
    writes = cache.take_copies().writes
    assert [len(c.src) for c in writes] == [3]
    m2 = cache.match_prefix(np.array([1, 2, 3, 4, 5, 6], np.int32))
    assert (m2.length, m2.host_length) == (3, 3)
    cache.unlock(m.node)
    cache.check_integrity(expect_unlocked=True)


def test_write_through_copies_on_insert_so_eviction_is_free():
    cache, alloc, host = tiered(dev_pages=9, host_pages=17, write_through=True)
    _cache_one(cache, [1, 2, 3], alloc)
    copies = cache.take_copies()
    assert [len(c.src) for c in copies.writes] == [3] and not copies.writes_block
    cache.evict(3)
    assert not cache.take_copies().writes
    assert cache.match_prefix(np.array([1, 2, 3], np.int32)).host_length == 3


def test_host_pressure_drops_the_lru_host_copy_of_a_device_node_first():
    """write_through with a full host pool: a new node gets its host copy by dropping the least
    recently used host copy of an unlocked node that is also on the device (which stays there),
    not by going without one."""
    cache, alloc, host = tiered(dev_pages=17, host_pages=7, write_through=True)  # 6 host pages
    _cache_one(cache, [1, 2, 3], alloc)
    _cache_one(cache, [4, 5, 6], alloc)  # the host pool is full
    locked = cache.match_prefix(np.array([1, 2, 3], np.int32)).node  # used last
    _cache_one(cache, [7, 8, 9], alloc)
    nodes = [cache.match_prefix(np.array(k, np.int32)) for k in ([1, 2, 3], [4, 5, 6], [7, 8, 9])]
    assert [m.length for m in nodes] == [3, 3, 3]  # all still on the device
    assert [m.node.host_pages is not None for m in nodes] == [True, False, True]
    cache.lock(locked)  # a locked node's copy is never dropped: the next one goes without
    cache.lock(nodes[2].node)
    _cache_one(cache, [10, 11, 12], alloc)
    assert cache.match_prefix(np.array([10, 11, 12], np.int32)).node.host_pages is None
    assert locked.host_pages is not None and nodes[2].node.host_pages is not None
    cache.unlock(locked)
    cache.unlock(nodes[2].node)
    cache.check_integrity(expect_unlocked=True)
    assert host.free_pages == 0 and cache.host_cached_pages == 6


def test_a_queued_load_keeps_its_host_copy_until_taken():
    """A node loaded back keeps its host pages for the queued load, even unlocked, until the
    batch's copies are taken: only then may host pressure drop them."""
    cache, alloc, host = tiered(dev_pages=17, host_pages=4, write_through=False)  # 3 host pages
    _cache_one(cache, [1, 2, 3], alloc)
    cache.evict(3)  # -> the host (full)
    cache.take_copies()
    m = cache.match_prefix(np.array([1, 2, 3], np.int32))
    cache.lock(m.host_node)
    cache.load_back(m.host_node, alloc.alloc(3))
    cache.unlock(m.host_node)  # an abort right after the load
    assert m.host_node.load_pending
    _cache_one(cache, [4, 5, 6], alloc)
    assert cache.evict_host(3) == 0  # the loaded node's copy is still read by its load
    cache.check_integrity()
    loads = cache.take_copies().loads
    assert [c.src.tolist() for c in loads] == [m.host_node.host_pages.tolist()]
    assert cache.evict_host(3) == 3 and m.host_node.host_pages is None
    assert cache.match_prefix(np.array([1, 2, 3], np.int32)).length == 3  # still on the device
    cache.check_integrity()


def test_insert_over_host_nodes_adopts_the_callers_pages():
    """A request that recomputed tokens cached on the host only: its pages become the nodes'
    device pages (not duplicates to free)."""
    cache, alloc, host = tiered(dev_pages=9, host_pages=17)
    _cache_one(cache, [1, 2, 3, 4], alloc)
    cache.evict(4)
    pages = alloc.alloc(5)
    r = cache.insert(np.array([1, 2, 3, 4, 5], np.int32), pages)
    assert r.prefix_len == 0
    m = cache.match_prefix(np.array([1, 2, 3, 4, 5], np.int32))
    assert m.length == 5 and m.pages.tolist() == pages.tolist()
    cache.check_integrity()


@pytest.mark.parametrize("impl", ["python", "cpp"])
def test_flush_drops_both_tiers(impl):
    from radix_runtime.config import ServerArgs
    from radix_runtime.messages import WorkerReady
    from radix_runtime.scheduler.scheduler import Scheduler

    ready = WorkerReady(
        num_pages=9, page_size=1, context_length=64, vocab_size=32, eos_token_ids=[0],
        device="cpu", dtype="float32", attention_backend="torch", host_num_pages=17,
        kv_bytes_per_token=8,
    )  # fmt: skip
    if impl == "cpp":
        pytest.importorskip("radix_runtime.scheduler.radix_cache_cpp")
    sched = Scheduler(ServerArgs(enable_hierarchical_cache=True, radix_tree_impl=impl), ready)
    assert sched.host_allocator is not None and sched.tree_impl == impl
    _cache_one(sched.cache, [1, 2, 3, 4], sched.allocator)
    sched.cache.evict(2)
    sched.flush_cache()
    assert sched.cache.stats()["nodes"] == 0
    assert sched.host_allocator.free_pages == sched.host_allocator.total_pages
    sched.check_integrity()
    info = sched.cache_stats()
    assert info.host_total_pages == 16 and info.host_written_bytes == 0
