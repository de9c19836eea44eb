"""The host tier in the C++ radix tree against the Python reference (docs/hicache.md).

1. Differential tests: hypothesis-generated operation sequences (matches, loads back from the
   host, inserts over host-only nodes, device and host eviction, locks of arbitrary nodes,
   resets, the queued copies) and long random traces run on both tiered trees, each with its own
   device and host allocators; every result and, after every step, the whole state (the dump,
   every node's host pages, residency and device-children count, the counters of both tiers,
   both heaps' sizes, both allocators' free lists in order, the tier observer's events) must be
   identical, and both trees pass check_integrity (both tiers). Both write policies, page sizes 1
   and 4, the C++ tree with the Python or the C++ allocators, with and without observers.
2. The Python tiered tree's own tests (the brute-force model machine, the named cases) run on
   the C++ tree, and the scheduler's host-tier tests run with `--radix-tree-impl cpp`.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import test_hicache_scheduler as hs
import test_hicache_tree as ht
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule
from test_radix_cache_cpp import DifferentialMachine, assert_same_state, attempt, same_match

from radix_runtime.scheduler import kv as scheduler_module  # builds the scheduler's tree
from radix_runtime.scheduler.allocator import PageAllocator
from radix_runtime.scheduler.cache import make_radix_cache
from radix_runtime.scheduler.radix_cache import MatchResult, RadixCache

cpp = pytest.importorskip(
    "radix_runtime.scheduler.radix_cache_cpp", reason="the C++ radix tree is not built"
)
CppRadixCache = cpp.CppRadixCache
CppPageAllocator = cpp.CppPageAllocator


def host_dump(cache) -> list[tuple]:
    """Per node: (id, host pages or None, on the device, device children, a load queued, filed
    as a droppable host copy)."""
    out = []
    stack = list(cache.root.children.values())
    while stack:
        node = stack.pop()
        hp = node.host_pages
        host = None if hp is None else tuple(hp.tolist())
        out.append(
            (node.id, host, node.on_device, node.dev_children, node.load_pending, node.in_copy_heap)
        )
        stack.extend(node.children.values())
    return sorted(out)


def assert_same_tiers(py, cc, allocs, hosts) -> None:
    assert_same_state(py, cc, *allocs)
    hosts[0].check_integrity()
    hosts[1].check_integrity()
    assert host_dump(py) == host_dump(cc)
    assert py.root.dev_children == cc.root.dev_children
    assert (py.host_cached_pages, py.host_evictable_pages) == (
        cc.host_cached_pages,
        cc.host_evictable_pages,
    )
    assert len(py._host_heap) == cc._tree.host_heap_size
    assert len(py._copy_heap) == cc._tree.copy_heap_size
    assert np.array_equal(hosts[0].free_page_ids(), hosts[1].free_page_ids())


def same_copies(a, b) -> None:
    assert a.writes_block == b.writes_block
    for xs, ys in ((a.writes, b.writes), (a.loads, b.loads)):
        assert [(x.src.tolist(), x.dst.tolist()) for x in xs] == [
            (y.src.tolist(), y.dst.tolist()) for y in ys
        ]


class Recorder:
    """The tier and eviction observers' calls, as plain data."""

    def __init__(self):
        self.calls: list[tuple] = []

    def tier(self, kind, src, dst):
        self.calls.append((kind, np.asarray(src).tolist(), None if dst is None else dst.tolist()))

    def evicted(self, pages):
        self.calls.append(("evicted", np.asarray(pages).tolist()))


# ---------------------------------------------------------------- 1. differential property test


class TieredDifferentialMachine(DifferentialMachine):
    """DifferentialMachine's rules (match, lock, insert, unlock, evict, reset, misuse) on two
    tiered trees, plus loads back from the host, host eviction and the queued copies."""

    page_size = 1
    cpp_allocator = False
    host_pages = 12  # a small host pool: host eviction and failed write-backs happen
    write_through = False
    observers = False

    @initialize()
    def setup(self):
        ps = self.page_size
        alloc_type = CppPageAllocator if self.cpp_allocator else PageAllocator
        self.allocs = [PageAllocator(_NUM_PAGES[ps]), alloc_type(_NUM_PAGES[ps])]
        self.hosts = [PageAllocator(self.host_pages), alloc_type(self.host_pages)]
        tier = dict(write_through=self.write_through)
        self.py = RadixCache(ps, self.allocs[0], host_allocator=self.hosts[0], **tier)
        self.cc = CppRadixCache(ps, self.allocs[1], host_allocator=self.hosts[1], **tier)
        self.recorders = [Recorder(), Recorder()]
        if self.observers:
            for tree, rec in zip((self.py, self.cc), self.recorders):
                tree.set_tier_observer(rec.tier)
                tree.set_evict_observer(rec.evicted)
        self.requests = []
        self.extra_locks = []

    def _alloc(self, n: int):
        """`n` device pages from both allocators (evicting alike first if needed), or None."""
        if self.allocs[0].free_pages < n:
            self._evict(n - self.allocs[0].free_pages)
        got = [a.alloc(n) for a in self.allocs]
        assert (got[0] is None) == (got[1] is None)
        return None if got[0] is None else got

    @precondition(lambda self: len(self.requests) < 4)
    @rule(target=DifferentialMachine.nodes, key=DifferentialMachine.keys, load=st.booleans())
    def start_loading_request(self, key, load):
        """A request admitted as the scheduler does: a match that runs on into host-only nodes
        locks them and loads them back (or, when `load` is off or the pool is full, unlocks
        them and computes those tokens)."""
        mp, mc = self._match(key)
        if mp.host_length:
            self.py.lock(mp.host_node)
            self.cc.lock(mc.host_node)
            got = self._alloc(mp.host_length // self.page_size) if load else None
            if got is not None:
                loaded = [self.py.load_back(mp.host_node, got[0])]
                loaded.append(self.cc.load_back(mc.host_node, got[1]))
                assert loaded[0] == loaded[1] == mp.host_length
                n = mp.length + mp.host_length
                mp = MatchResult(np.concatenate([mp.pages, got[0]]), n, mp.host_node)
                mc = MatchResult(np.concatenate([mc.pages, got[1]]), n, mc.host_node)
                self.requests.append((key, mp, mc))
                return mp.node, mc.node
            self.py.unlock(mp.host_node)
            self.cc.unlock(mc.host_node)
        self.py.lock(mp.node)
        self.cc.lock(mc.node)
        self.requests.append((key, mp, mc))
        return mp.node, mc.node

    @rule(pair=DifferentialMachine.nodes)
    def load_back_any(self, pair):
        """Misuse: a load of any node (unlocked, evicted, on the device) or with the wrong
        number of pages raises alike and changes nothing."""
        n = 0
        node = pair[0]
        while node is not None and node.parent is not None and not node.on_device:
            n += len(node.host_pages)
            node = node.parent
        pages = list(range(1, n + 2))  # one page too many
        errors = [attempt(lambda: self.py.load_back(pair[0], pages))[1]]
        errors.append(attempt(lambda: self.cc.load_back(pair[1], pages))[1])
        assert errors[0] == errors[1] and errors[0] is not None

    @rule(num_pages=st.integers(-1, 12))
    def evict_host(self, num_pages):
        assert self.py.evict_host(num_pages) == self.cc.evict_host(num_pages)

    @rule()
    def take_copies(self):
        same_copies(self.py.take_copies(), self.cc.take_copies())

    @invariant()
    def tiers_agree(self):
        if hasattr(self, "py"):
            assert_same_tiers(self.py, self.cc, self.allocs, self.hosts)
            assert self.recorders[0].calls == self.recorders[1].calls


_NUM_PAGES = {1: 24, 4: 16}
PATTERNS_4 = [[5] * 4, [5, 5, 6, 6], [7] * 4]


class TieredDifferentialPage4(TieredDifferentialMachine):
    page_size = 4
    cpp_allocator = True
    write_through = True
    host_pages = 9

    def _build(self, patterns, mutation, tail) -> tuple:
        tokens = [t for p in patterns for t in PATTERNS_4[p]]
        if mutation is not None:
            tokens[mutation % len(tokens)] = 9
        return tuple(tokens + [5] * (tail % 4))


class TieredDifferentialObservedBigHost(TieredDifferentialMachine):
    host_pages = 200
    observers = True


class TieredDifferentialObservedCppPage4(TieredDifferentialPage4):
    observers = True
    write_through = False


_settings = settings(
    max_examples=40,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestTieredDifferentialPage1 = TieredDifferentialMachine.TestCase
TestTieredDifferentialPage1.settings = _settings
TestTieredDifferentialPage4WriteThrough = TieredDifferentialPage4.TestCase
TestTieredDifferentialPage4WriteThrough.settings = _settings
TestTieredDifferentialObservedBigHost = TieredDifferentialObservedBigHost.TestCase
TestTieredDifferentialObservedBigHost.settings = _settings
TestTieredDifferentialObservedCppPage4 = TieredDifferentialObservedCppPage4.TestCase
TestTieredDifferentialObservedCppPage4.settings = _settings


def tiered_trace(seed, page_size, steps, num_pages, host_pages, write_through, cpp_allocator,
                 check_every, vocab=4, conversations=8):  # fmt: skip
    """A long random op sequence on both tiered trees: multi-turn requests whose histories go
    to the host and come back (loaded, or recomputed and inserted over host-only nodes),
    re-reads, evictions in both tiers, flushes and resets."""
    rng = np.random.default_rng(seed)
    alloc_type = CppPageAllocator if cpp_allocator else PageAllocator
    allocs = [PageAllocator(num_pages), alloc_type(num_pages)]
    hosts = [PageAllocator(host_pages), alloc_type(host_pages)]
    trees = [
        RadixCache(page_size, allocs[0], host_allocator=hosts[0], write_through=write_through),
        CppRadixCache(page_size, allocs[1], host_allocator=hosts[1], write_through=write_through),
    ]
    py, cc = trees
    spaces = [None, "a", "b"]
    histories = [
        rng.integers(0, vocab, rng.integers(0, 64), dtype=np.int32) for _ in range(conversations)
    ]
    loads = host_hits = 0
    for step in range(steps):
        op = rng.random()
        c = int(rng.integers(len(histories)))
        if op < 0.5:  # a turn: match, load the host part back (mostly), compute, insert
            key = np.concatenate([histories[c], rng.integers(0, vocab, rng.integers(1, 40))])
            ns = spaces[c % 3]
            ms = [t.match_prefix(key[:-1], ns) for t in trees]
            same_match(*ms)
            nodes, owned = [m.node for m in ms], [m.pages for m in ms]
            if ms[0].host_length:
                host_hits += 1
                for t, m in zip(trees, ms):
                    t.lock(m.host_node)
                n = ms[0].host_length // page_size
                if allocs[0].free_pages < n:
                    assert py.evict(n - allocs[0].free_pages) == cc.evict(n - allocs[1].free_pages)
                got = [a.alloc(n) for a in allocs] if rng.random() < 0.8 else [None, None]
                if got[0] is not None:
                    loads += 1
                    for t, m, g in zip(trees, ms, got):
                        t.load_back(m.host_node, g)
                    nodes = [m.host_node for m in ms]
                    owned = [np.concatenate([m.pages, g]) for m, g in zip(ms, got)]
                else:
                    for t, m in zip(trees, ms):
                        t.unlock(m.host_node)
            if nodes[0] is ms[0].node:
                for t, m in zip(trees, ms):
                    t.lock(m.node)
            whole = len(key) // page_size
            need = whole - len(owned[0])
            if allocs[0].free_pages < need:
                assert py.evict(need - allocs[0].free_pages) == cc.evict(
                    need - allocs[1].free_pages
                )
            news = [a.alloc(need) for a in allocs]
            if news[0] is not None:
                results = []
                for t, a, mine, new in zip(trees, allocs, owned, news):
                    pages = np.concatenate([mine, new])
                    r = t.insert(key[: whole * page_size], pages, ns)
                    a.free(pages[len(mine) : r.prefix_len // page_size])
                    results.append(r)
                assert results[0].prefix_len == results[1].prefix_len
                assert results[0].node.id == results[1].node.id
                histories[c] = key
            if len(histories[c]) > num_pages * page_size // 3:  # a new conversation
                histories[c] = rng.integers(0, vocab, rng.integers(0, 16), dtype=np.int32)
            for t, node in zip(trees, nodes):
                t.unlock(node)
        elif op < 0.85:
            key = histories[c][: rng.integers(0, len(histories[c]) + 1)]
            ns = spaces[int(rng.integers(3))]
            same_match(py.match_prefix(key, ns), cc.match_prefix(key, ns))
        elif op < 0.93:
            n = int(rng.integers(0, 16))
            assert py.evict(n) == cc.evict(n)
        elif op < 0.97:
            n = int(rng.integers(0, 16))
            assert py.evict_host(n) == cc.evict_host(n)
        elif op < 0.995:
            same_copies(py.take_copies(), cc.take_copies())
        else:
            py.reset()
            cc.reset()
        if step % check_every == 0:
            assert_same_tiers(py, cc, allocs, hosts)
    assert_same_tiers(py, cc, allocs, hosts)
    same_copies(py.take_copies(), cc.take_copies())
    return loads, host_hits


@pytest.mark.parametrize(
    "page_size, write_through, cpp_allocator, host_pages",
    [(1, False, False, 48), (1, True, True, 300), (4, True, False, 20), (16, False, True, 12)],
)
def test_long_tiered_traces_agree(page_size, write_through, cpp_allocator, host_pages):
    loads, host_hits = tiered_trace(
        page_size, page_size, 4000, num_pages=64 // min(page_size, 4), host_pages=host_pages,
        write_through=write_through, cpp_allocator=cpp_allocator, check_every=200,
    )  # fmt: skip
    assert loads > 20 and host_hits > loads  # the trace exercised the host tier


def test_tiered_trees_agree_on_the_scheduler_sizes():
    """Long prompts over a shared system prompt, page size 16, a device pool that holds two of
    them and a host pool that holds six: the scheduler's real sizes."""
    tiered_trace(3, 16, 300, num_pages=1200, host_pages=3000, write_through=True,
                 cpp_allocator=True, check_every=25, vocab=3, conversations=6)  # fmt: skip


# ---------------------------------------------------------------- 2. the Python tier's tests


class CppTieredModel(ht.TieredMachine):
    """The Python tiered tree's property test (against the simulated pools), on the C++ tree."""

    @initialize()
    def setup(self):
        ps = self.page_size
        self.alloc = PageAllocator(9 if ps == 1 else 7)
        self.host = CppPageAllocator(self.host_pages)
        self.cache = CppRadixCache(
            ps, self.alloc, host_allocator=self.host, write_through=self.write_through
        )
        self.pools = ht.Pools()
        self.requests = []
        self.inserted = set()
        self.lost = set()


class CppTieredModelBigHost(CppTieredModel):
    host_pages = 200


class CppTieredModelWriteThroughPage4(CppTieredModel):
    page_size = 4
    write_through = True


TestCppTieredModel = CppTieredModel.TestCase
TestCppTieredModel.settings = ht._settings
TestCppTieredModelBigHost = CppTieredModelBigHost.TestCase
TestCppTieredModelBigHost.settings = ht._settings
TestCppTieredModelWriteThroughPage4 = CppTieredModelWriteThroughPage4.TestCase
TestCppTieredModelWriteThroughPage4.settings = ht._settings


def _cpp_tiered(page_size=1, dev_pages=9, host_pages=17, write_through=False):
    dev, host = PageAllocator(dev_pages), PageAllocator(host_pages)
    cache = CppRadixCache(page_size, dev, host_allocator=host, write_through=write_through)
    return cache, dev, host


NAMED = [
    ht.test_eviction_keeps_the_node_on_the_host_and_a_match_reaches_it,
    ht.test_host_full_drops_lru_host_nodes_then_evicted_nodes,
    ht.test_a_node_being_loaded_is_locked_and_never_evicted,
    ht.test_write_back_of_a_node_still_in_use_never_happens,
    ht.test_write_through_copies_on_insert_so_eviction_is_free,
    ht.test_insert_over_host_nodes_adopts_the_callers_pages,
    ht.test_host_pressure_drops_the_lru_host_copy_of_a_device_node_first,
    ht.test_a_queued_load_keeps_its_host_copy_until_taken,
]


@pytest.mark.parametrize("test", NAMED, ids=lambda t: t.__name__)
def test_named_tier_cases_on_cpp(test, monkeypatch):
    monkeypatch.setattr(ht, "tiered", _cpp_tiered)
    test()


def test_integrity_catches_host_corruption():
    """check_integrity covers the host tier: a host page held twice or freed under a node, and
    a counter off, are caught."""
    cache, dev, host = _cpp_tiered()
    ht._cache_one(cache, [1, 2, 3], dev)
    ht._cache_one(cache, [4, 5], dev)
    cache.evict(5)
    cache.check_integrity()
    host.free(cache.match_prefix([1, 2, 3]).host_node.host_pages[:1])
    with pytest.raises(AssertionError, match="free|exactly once"):
        cache.check_integrity()


def test_make_radix_cache_picks_cpp_with_the_host_tier():
    dev, host = PageAllocator(8), PageAllocator(8)
    for impl in ("auto", "cpp"):
        cache = make_radix_cache(impl, 1, dev, host_allocator=host, write_through=True)
        assert isinstance(cache, CppRadixCache) and cache.write_through
    cache = make_radix_cache("python", 1, dev, host_allocator=host)
    assert isinstance(cache, RadixCache) and cache.host_allocator is host


@pytest.fixture
def cpp_scheduler(monkeypatch):
    real = scheduler_module.make_radix_cache
    monkeypatch.setattr(
        scheduler_module, "make_radix_cache", lambda _impl, *a, **kw: real("cpp", *a, **kw)
    )


SCHEDULER_TESTS = [
    hs.test_outputs_equal_cache_off_under_a_pool_far_smaller_than_the_working_set,
    hs.test_abort_during_a_load_frees_everything,
    hs.test_pressure_in_both_tiers_retracts_and_never_crashes,
    hs.test_kv_events_keep_host_blocks_cached_until_they_leave_both_tiers,
    hs.test_a_load_that_does_not_pay_is_recomputed,
]


@pytest.mark.parametrize("test", SCHEDULER_TESTS, ids=lambda t: t.__name__)
def test_scheduler_host_tier_tests_on_cpp(test, cpp_scheduler):
    test()


@pytest.mark.parametrize("page_size, policy", [(1, "write_through"), (16, "write_back")])
def test_scheduler_is_identical_with_either_tiered_tree(page_size, policy, monkeypatch):
    """The same multi-turn workload through a device pool far smaller than its working set:
    the same outputs, final tree (both tiers), free lists and host-tier statistics."""
    prompts, arrivals = hs.conversations(n=6, rounds=3)
    kwargs = dict(hicache=True, page_size=page_size, pool=96 if page_size == 1 else 160,
                  host=4096, policy=policy)  # fmt: skip
    out_py, sched_py = hs.run(prompts, arrivals, **kwargs)
    real = scheduler_module.make_radix_cache
    monkeypatch.setattr(
        scheduler_module, "make_radix_cache", lambda _impl, *a, **kw: real("cpp", *a, **kw)
    )
    out_cc, sched_cc = hs.run(prompts, arrivals, **kwargs)
    assert isinstance(sched_py.cache, RadixCache) and isinstance(sched_cc.cache, CppRadixCache)
    assert sched_cc.tree_impl == "cpp"
    assert out_py == out_cc
    assert sched_py.cache.dump() == sched_cc.cache.dump()
    assert host_dump(sched_py.cache) == host_dump(sched_cc.cache)
    for a, b in ((sched_py.allocator, sched_cc.allocator), (sched_py.host_allocator, sched_cc.host_allocator)):  # fmt: skip
        assert np.array_equal(a.free_page_ids(), b.free_page_ids())
    assert msgspec.structs.replace(sched_cc.cache_stats(), tree="python") == sched_py.cache_stats()
    assert sched_cc.host_loads > 0 and sched_cc.host_cached_tokens_total > 0
