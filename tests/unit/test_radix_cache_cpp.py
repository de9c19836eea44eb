"""The C++ radix tree against the Python reference: differential tests.

1. Hypothesis-generated operation sequences (match / lock / insert / unlock / evict / reset, and
   lock / unlock of arbitrary, possibly evicted nodes) run on both trees, each with its own
   allocator; every result (matched pages, lengths, node ids, prefix_len, evicted counts, raised
   exceptions) and, after every step, the whole state (a dump of every node with its id, tokens,
   pages, lock count and LRU stamp, the counters, the heap size and the allocator's free list in
   order) must be identical.
   The C++ tree runs with the Python allocator or with its C++ twin, CppPageAllocator (then
   evicted pages go straight back to it); the twin is checked against the Python allocator too.
2. The Python tree's and allocator's unit tests and property tests (against brute-force models)
   run on the C++ twins too, and the scheduler's tests run with `--radix-tree-impl cpp`.
"""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest
import test_allocator
import test_radix_cache as ref
import test_scheduler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from radix_runtime.config import ServerArgs
from radix_runtime.scheduler import kv as scheduler_module  # builds the scheduler's tree
from radix_runtime.scheduler.allocator import PageAllocator
from radix_runtime.scheduler.cache import make_radix_cache
from radix_runtime.scheduler.radix_cache import RadixCache
from radix_runtime.scheduler.scheduler import Scheduler

cpp = pytest.importorskip(
    "radix_runtime.scheduler.radix_cache_cpp", reason="the C++ radix tree is not built"
)
CppRadixCache = cpp.CppRadixCache
CppPageAllocator = cpp.CppPageAllocator


def assert_same_state(py: RadixCache, cc, py_alloc: PageAllocator, cc_alloc: PageAllocator):
    py.check_integrity()
    cc.check_integrity()
    py_alloc.check_integrity()
    cc_alloc.check_integrity()
    assert py.dump() == cc.dump()
    assert py.stats() == cc.stats()
    assert len(py._heap) == cc._tree.heap_size
    assert np.array_equal(py_alloc.free_page_ids(), cc_alloc.free_page_ids())


def attempt(fn):
    """(result, None) or (None, exception type) for the errors the trees raise on misuse."""
    try:
        return fn(), None
    except (ValueError, RuntimeError) as exc:
        return None, type(exc)


def same_match(a, b) -> None:
    assert a.length == b.length
    assert a.pages.tolist() == b.pages.tolist()
    assert a.pages.dtype == b.pages.dtype == np.int32
    assert a.node.id == b.node.id
    # the host tier's fields (without one: 0 and the matched node, None for a missing namespace)
    assert a.host_length == b.host_length
    assert (a.host_node is None) == (b.host_node is None)
    assert a.host_node is None or a.host_node.id == b.host_node.id


# ---------------------------------------------------------------- 1. differential property test

# Keys are built from a few page-sized patterns so that they share prefixes; patterns 0 and 1
# share their first half so that, with page_size 16, keys also diverge inside a page.
PATTERNS = {
    1: [[5], [6], [7]],
    16: [[5] * 16, [5] * 8 + [6] * 8, [7] * 16],
}
NUM_PAGES = {1: 24, 16: 14}  # small pools: most runs evict
MAX_KEY_PAGES = 10
NAMESPACES = st.sampled_from([None, None, "a", "b"])


class DifferentialMachine(RuleBasedStateMachine):
    page_size = 1
    cpp_allocator = False  # the C++ tree's allocator: the Python one or the C++ twin
    keys = Bundle("keys")
    nodes = Bundle("nodes")  # (python node, C++ node) pairs handed out by match / insert

    @initialize()
    def setup(self):
        ps = self.page_size
        cc_allocator = CppPageAllocator if self.cpp_allocator else PageAllocator
        self.allocs = [PageAllocator(NUM_PAGES[ps]), cc_allocator(NUM_PAGES[ps])]
        self.py = RadixCache(ps, self.allocs[0])
        self.cc = CppRadixCache(ps, self.allocs[1])
        self.requests: list[tuple] = []  # running: (key, python match, C++ match)
        self.extra_locks: list[tuple] = []  # node pairs locked by lock_node

    # ---- keys ----

    def _build(self, patterns, mutation, tail) -> tuple:
        ps = self.page_size
        tokens = [t for p in patterns for t in PATTERNS[ps][p]]
        if mutation is not None:
            tokens[mutation % len(tokens)] = 9
        return tuple(tokens + [5] * (tail % ps))

    # keys are (namespace, tokens): the public namespace (None) or one of two salted ones

    @rule(
        target=keys,
        patterns=st.lists(st.integers(0, 2), min_size=0, max_size=6),
        mutation=st.none() | st.integers(0, 200),
        tail=st.integers(0, 15),
        ns=NAMESPACES,
    )
    def new_key(self, patterns, mutation, tail, ns):
        if not patterns:
            return ns, tuple([5] * (tail % self.page_size))  # shorter than a page (or empty)
        return ns, self._build(patterns, mutation, tail)

    @rule(target=keys, key=keys, more=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def extend_key(self, key, more):
        ps = self.page_size
        ns, tokens = key
        aligned = tokens[: len(tokens) // ps * ps]
        return ns, (aligned + self._build(more, None, 0))[: MAX_KEY_PAGES * ps]

    @rule(target=keys, key=keys, ns=NAMESPACES)
    def other_namespace(self, key, ns):
        return ns, key[1]

    # ---- both trees, side by side ----

    def _match(self, key: tuple):
        # the Python tree gets a list, the C++ one an int64 array: both convert
        ns, tokens = key
        mp = self.py.match_prefix(list(tokens), ns)
        mc = self.cc.match_prefix(np.array(tokens, dtype=np.int64), namespace=ns)
        same_match(mp, mc)
        return mp, mc

    def _evict(self, num_pages: int) -> int:
        freed = [self.py.evict(num_pages), self.cc.evict(num_pages)]
        assert freed[0] == freed[1]
        return freed[0]

    def _insert_new(self, key: tuple, own_py, own_cc):
        """Allocate the pages past the matched ones (evicting if needed), insert, free dups."""
        ps = self.page_size
        ns, tokens = key
        n_pages = len(tokens) // ps
        own = len(own_py)
        need = n_pages - own
        news = [alloc.alloc(need) for alloc in self.allocs]
        if news[0] is None:
            self._evict(need - self.allocs[0].free_pages)
            news = [alloc.alloc(need) for alloc in self.allocs]
        assert (news[0] is None) == (news[1] is None)
        if news[0] is None:
            return None
        assert news[0].tolist() == news[1].tolist()
        results = []
        for tree, alloc, mine, new in zip((self.py, self.cc), self.allocs, (own_py, own_cc), news):
            pages = np.concatenate([mine, new])
            r = tree.insert(np.array(tokens, dtype=np.int32), pages, ns)
            alloc.free(pages[own : r.prefix_len // ps])
            results.append(r)
        rp, rc = results
        assert rp.prefix_len == rc.prefix_len and rp.node.id == rc.node.id
        return rp.node, rc.node

    # ---- operations ----

    @precondition(lambda self: len(self.requests) < 4)
    @rule(target=nodes, key=keys)
    def start_request(self, key):
        mp, mc = self._match(key)
        self.py.lock(mp.node)
        self.cc.lock(mc.node)
        self.requests.append((key, mp, mc))
        return mp.node, mc.node

    @precondition(lambda self: self.requests)
    @rule(target=nodes, which=st.integers(0, 3))
    def finish_request(self, which):
        key, mp, mc = self.requests.pop(which % len(self.requests))
        inserted = self._insert_new(key, mp.pages, mc.pages)
        errors = [attempt(lambda: self.py.unlock(mp.node))[1]]
        errors.append(attempt(lambda: self.cc.unlock(mc.node))[1])
        assert errors[0] == errors[1]  # unlock_node may have taken the request's lock already
        return inserted if inserted is not None else (mp.node, mc.node)

    @rule(target=nodes, key=keys)
    def insert_key(self, key):
        """An insert without a match first: everything cached meanwhile is a duplicate."""
        empty = np.empty(0, dtype=np.int32)
        inserted = self._insert_new(key, empty, empty)
        return inserted if inserted is not None else (self.py.root, self.cc.root)

    @rule(target=nodes, key=keys)
    def match_only(self, key):
        mp, mc = self._match(key)
        return mp.node, mc.node

    @rule(num_pages=st.integers(-1, 12))
    def evict(self, num_pages):
        self._evict(num_pages)

    @rule(pair=nodes)
    def lock_node(self, pair):
        """Lock any node handed out before, evicted or detached by a reset ones included."""
        results = [attempt(lambda: self.py.lock(pair[0])), attempt(lambda: self.cc.lock(pair[1]))]
        assert results[0][1] == results[1][1]
        if results[0][1] is None:
            self.extra_locks.append(pair)

    @precondition(lambda self: self.extra_locks)
    @rule()
    def unlock_node(self):
        pair = self.extra_locks.pop()
        errors = [attempt(lambda: self.py.unlock(pair[0]))[1]]
        errors.append(attempt(lambda: self.cc.unlock(pair[1]))[1])
        assert errors[0] == errors[1]

    # Only while nothing is locked: a stolen lock would corrupt both trees (or let a request's
    # pages be evicted under it), which is the caller's bug, not a difference between them.
    @precondition(lambda self: not self.requests and not self.extra_locks)
    @rule(pair=nodes)
    def unlock_any(self, pair):
        """Misuse: an unlock of an unlocked (or evicted) node raises alike in both."""
        errors = [attempt(lambda: self.py.unlock(pair[0]))[1]]
        errors.append(attempt(lambda: self.cc.unlock(pair[1]))[1])
        assert errors[0] == errors[1]

    @rule()
    def reset(self):
        errors = [attempt(self.py.reset)[1], attempt(self.cc.reset)[1]]
        assert errors[0] == errors[1]

    @invariant()
    def trees_agree(self):
        if hasattr(self, "py"):
            assert_same_state(self.py, self.cc, *self.allocs)


class DifferentialMachinePage16(DifferentialMachine):
    page_size = 16
    cpp_allocator = True


_settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestDifferentialPage1 = DifferentialMachine.TestCase
TestDifferentialPage1.settings = _settings
TestDifferentialPage16 = DifferentialMachinePage16.TestCase
TestDifferentialPage16.settings = _settings


def random_trace(
    seed: int,
    page_size: int,
    steps: int,
    num_pages: int,
    check_every: int,
    cpp_allocator: bool,
    vocab: int = 4,
    conversations: int = 8,
) -> int:
    """A long random op sequence (multi-turn requests, matches, evictions, the occasional
    reset) on both trees: long enough for heap compactions and deep splits. Returns the most
    children a node had at a check."""
    rng = np.random.default_rng(seed)
    widest = 0
    allocs = [
        PageAllocator(num_pages),
        (CppPageAllocator if cpp_allocator else PageAllocator)(num_pages),
    ]
    py, cc = RadixCache(page_size, allocs[0]), CppRadixCache(page_size, allocs[1])
    # conversations in the public namespace and two salted ones, often with equal tokens
    spaces = [None, "a", "b"]
    histories = [
        rng.integers(0, vocab, rng.integers(0, 64), dtype=np.int32) for _ in range(conversations)
    ]
    for step in range(steps):
        op = rng.random()
        c = int(rng.integers(len(histories)))
        if op < 0.5:  # a turn of conversation c: match its history + new tokens, then insert
            key = np.concatenate([histories[c], rng.integers(0, vocab, rng.integers(1, 40))])
            ns = spaces[c % 3]
            mp, mc = py.match_prefix(key[:-1], ns), cc.match_prefix(key[:-1], ns)
            same_match(mp, mc)
            py.lock(mp.node)
            cc.lock(mc.node)
            whole = len(key) // page_size
            need = whole - len(mp.pages)
            if allocs[0].free_pages < need:
                assert py.evict(need - allocs[0].free_pages) == cc.evict(
                    need - allocs[1].free_pages
                )
            news = [a.alloc(need) for a in allocs]
            if news[0] is not None:
                for tree, alloc, m, new in zip((py, cc), allocs, (mp, mc), news):
                    pages = np.concatenate([m.pages, new])
                    r = tree.insert(key[: whole * page_size], pages, ns)
                    alloc.free(pages[len(m.pages) : r.prefix_len // page_size])
                histories[c] = key
            py.unlock(mp.node)
            cc.unlock(mc.node)
        elif op < 0.93:  # a re-read of a random prefix: LRU refreshes, heap pushes, splits
            key = histories[c][: rng.integers(0, len(histories[c]) + 1)]
            ns = spaces[int(rng.integers(3))]
            same_match(py.match_prefix(key, ns), cc.match_prefix(key, ns))
        elif op < 0.995:
            n = int(rng.integers(0, 16))
            assert py.evict(n) == cc.evict(n)
        else:
            py.reset()
            cc.reset()
        if step % check_every == 0:
            assert_same_state(py, cc, *allocs)
            widest = max(widest, *(len(n.children) for n in [py.root, *py._nodes()]))
    assert_same_state(py, cc, *allocs)
    return widest


@pytest.mark.parametrize("cpp_allocator", [False, True])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_long_random_traces_agree(page_size, cpp_allocator):
    random_trace(
        page_size, page_size, 6000, num_pages=64, check_every=250, cpp_allocator=cpp_allocator
    )


@pytest.mark.parametrize("cpp_allocator", [False, True])
@pytest.mark.parametrize("page_size", [1, 2])
def test_wide_nodes_agree(page_size, cpp_allocator):
    """Nodes with more children than the C++ tree keeps in its flat array (8): past that it files
    them in a hash multimap, which must find, add and remove them alike."""
    widest = random_trace(
        7 + page_size,
        page_size,
        3000,
        num_pages=2048,  # room for many conversations at once (evict ops still run)
        check_every=100,
        cpp_allocator=cpp_allocator,
        vocab=24,
        conversations=48,
    )
    assert widest > 8


def test_bad_page_in_an_eviction_into_the_cpp_allocator_frees_nothing():
    """The C++ tree frees evicted pages straight into the C++ allocator, node by node: a bad
    page (here: one that is already free) in the second evicted node must still raise free()'s
    error for all the pages and free none, after evicting what the Python tree evicts."""
    allocs = [PageAllocator(64), CppPageAllocator(64)]
    py, cc = RadixCache(1, allocs[0]), CppRadixCache(1, allocs[1])
    leaves = {}
    for name, cache, alloc in (("py", py, allocs[0]), ("cc", cc, allocs[1])):
        leaves[name] = [ref.cache_request(cache, alloc, [i + 1] * 5).node for i in range(6)]
    for name, alloc in (("py", allocs[0]), ("cc", allocs[1])):
        node = leaves[name][1]  # the second least recently used leaf
        pages = node.pages.copy()
        pages[2] = alloc.free_page_ids()[-1]
        node.pages = pages
    free_before = [a.free_page_ids() for a in allocs]
    errors = []
    for cache in (py, cc):
        with pytest.raises(ValueError) as exc:
            cache.evict(100)
        errors.append(str(exc.value))
    assert errors[0] == errors[1] and "double free" in errors[0]
    for alloc, before in zip(allocs, free_before):
        assert np.array_equal(alloc.free_page_ids(), before)
        alloc.check_integrity()
    assert py.dump() == cc.dump() == [] and py.stats() == cc.stats()


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    page_size=st.sampled_from([1, 2, 16]),
    cpp_allocator=st.booleans(),
)
def test_random_traces_agree(seed, page_size, cpp_allocator):
    random_trace(seed, page_size, 300, num_pages=48, check_every=1, cpp_allocator=cpp_allocator)


def test_long_prompts_agree():
    """32k-token prompts over a shared 8k system prompt: the scheduler's real sizes."""
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, 8192, dtype=np.int32)
    allocs = [PageAllocator(16384), CppPageAllocator(16384)]
    py, cc = RadixCache(16, allocs[0]), CppRadixCache(16, allocs[1])
    for i in range(6):
        prompt = np.concatenate([system, rng.integers(0, 32000, 24000 - 1000 * i, dtype=np.int32)])
        results = []
        for tree, alloc in zip((py, cc), allocs):
            results.append(ref.cache_request(tree, alloc, prompt))
        assert results[0].prefix_len == results[1].prefix_len
        same_match(py.match_prefix(prompt[:-7]), cc.match_prefix(prompt[:-7]))
        assert_same_state(py, cc, *allocs)
    assert py.evict(3000) == cc.evict(3000)
    assert_same_state(py, cc, *allocs)


# ---------------------------------------------------------------- the C++ page allocator

ALLOCATOR_TESTS = [
    (test_allocator.test_fresh_allocator_hands_out_pages_from_one, {}),
    (test_allocator.test_alloc_zero_and_exhaustion, {}),
    (test_allocator.test_free_returns_pages_lifo, {}),
    (test_allocator.test_double_free_after_free, {}),
    (test_allocator.test_free_of_more_pages_than_are_in_use, {}),
    (test_allocator.test_minimum_size, {}),
    (test_allocator.test_allocator_matches_a_set_model, {}),
] + [
    (test_allocator.test_bad_free_raises_and_changes_nothing, {"bad": bad, "match": match})
    for bad, match in [
        ([0], "reserved"),
        ([10], "out-of-range"),
        ([-1], "out-of-range"),
        ([3], "double free"),
        ([1, 1], "twice in one call"),
    ]
]


@pytest.mark.parametrize(
    "test, kwargs",
    ALLOCATOR_TESTS,
    ids=[f"{t.__name__}-{kw.get('bad', '')}" for t, kw in ALLOCATOR_TESTS],
)
def test_reference_allocator_tests_on_cpp(test, kwargs, monkeypatch):
    monkeypatch.setattr(test_allocator, "PageAllocator", CppPageAllocator)
    test(**kwargs)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("alloc"), st.integers(-1, 8)),
            st.tuples(st.just("free"), st.lists(st.integers(-1, 17), max_size=6)),
            st.tuples(st.just("free_held"), st.integers(0, 6)),
        ),
        max_size=60,
    )
)
def test_allocators_agree(ops):
    """The same alloc / free calls, bad ones included: same pages, same errors, same free list."""
    allocs = [PageAllocator(16), CppPageAllocator(16)]
    held: list[int] = []
    for op, arg in ops:
        if op == "alloc":
            got = [attempt(lambda a=a, n=arg: a.alloc(n)) for a in allocs]
            pages = [None if p is None else p.tolist() for p, _ in got]
            assert pages[0] == pages[1] and got[0][1] == got[1][1]
            held.extend(pages[0] or [])
        else:
            if op == "free_held":
                pages, held = held[:arg], held[arg:]
            else:
                pages = arg
            errors = []
            for a in allocs:
                try:
                    a.free(np.array(pages, dtype=np.int64 if op == "free" else np.int32))
                    errors.append(None)
                except ValueError as exc:
                    errors.append(str(exc))
            assert errors[0] == errors[1]
            if op == "free" and errors[0] is None:
                held = [p for p in held if p not in pages]
        assert allocs[0].free_pages == allocs[1].free_pages
        assert allocs[0].free_page_ids().tolist() == allocs[1].free_page_ids().tolist()
        allocs[1].check_integrity()
    assert repr(allocs[0]) == repr(allocs[1])


def test_allocator_rejects_what_numpy_rejects():
    alloc = CppPageAllocator(8)
    alloc.free([])  # nothing to free, whatever the dtype
    for bad in (np.array([1.0]), np.array([[1]]), np.array([True])):
        with pytest.raises(ValueError, match="1-D integer"):
            alloc.free(bad)
    with pytest.raises(ValueError):
        CppPageAllocator(1)


# ---------------------------------------------------------------- 2. the Python tree's tests

REFERENCE_TESTS = [
    ref.test_empty_tree,
    ref.test_exact_match_returns_the_inserted_pages,
    ref.test_partial_match_splits_the_edge,
    ref.test_page_size_16_matches_whole_pages_only,
    ref.test_page_size_must_match_pages,
    ref.test_insert_returns_cached_prefix_len,
    ref.test_duplicate_pages_are_the_callers_to_free,
    ref.test_lock_moves_pages_between_evictable_and_protected,
    ref.test_evict_lru_leaves_first,
    ref.test_evict_cascades_to_parents,
    ref.test_locked_nodes_are_never_evicted_and_evict_returns_what_it_could,
    ref.test_locking_an_evicted_node_raises,
    ref.test_reset,
    ref.test_disabled_cache_reuses_nothing_through_the_same_code_path,
    ref.test_long_prompts_match_page_aligned,
    ref.test_pretty_mentions_nodes,
    ref.test_check_integrity_expect_unlocked,
    ref.test_namespaces_share_nothing_not_even_the_first_token,
    ref.test_namespace_nodes_hold_nothing_and_are_dropped_when_emptied,
    ref.test_eviction_across_namespaces_is_one_lru,
    ref.test_locks_through_namespace_nodes,
    ref.test_disabled_cache_ignores_namespaces,
    ref.test_a_namespace_is_a_str,
]


@pytest.mark.parametrize("test", REFERENCE_TESTS, ids=lambda t: t.__name__)
def test_reference_unit_tests_on_cpp(test, monkeypatch):
    monkeypatch.setattr(ref, "RadixCache", CppRadixCache)
    test()


def test_handles_are_stable_and_walk_to_the_root():
    alloc = PageAllocator(64)
    cache = CppRadixCache(1, alloc)
    r = ref.cache_request(cache, alloc, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 9])  # splits [1 2 3 4]: the upper part is a new node
    assert m.node is cache.match_prefix([1, 2]).node
    assert r.node.parent is m.node and m.node.parent is cache.root and cache.root.parent is None
    assert cache.match_prefix([1, 2, 3, 4]).node is r.node  # the lower part kept its identity
    assert not m.pages.flags.writeable
    cache.evict(10)
    assert r.node.parent is None  # evicted, like a Python node
    with pytest.raises(TypeError):
        cache.lock(None)


def test_heap_of_evictable_leaves_stays_bounded():
    alloc = PageAllocator(128)
    cache = CppRadixCache(1, alloc)
    for i in range(50):
        ref.cache_request(cache, alloc, [i, i])
    for _ in range(20_000):
        cache.match_prefix([3, 3])
    assert cache._tree.heap_size <= 2 * 1024
    cache.check_integrity()
    assert cache.evict(2) == 2
    assert cache.match_prefix([0, 0]).length == 0


def _corrupt_counter(alloc, cache):
    cache._tree._debug_add_evictable(1)


def _corrupt_heap(alloc, cache):
    cache._tree._debug_clear_heap()


def _corrupt_duplicate_page(alloc, cache):
    a = cache.match_prefix([5, 6]).node
    b = cache.match_prefix([1, 2]).node
    pages = a.pages.copy()  # a C++ node's pages are a copy: assign them back
    pages[0] = b.pages[0]
    a.pages = pages


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (ref._corrupt_free_a_cached_page, "free"),
        (_corrupt_counter, "evictable"),
        (_corrupt_heap, "heap"),
        (ref._corrupt_lock_ref, "lock"),
        (ref._corrupt_leak_a_page, "total"),
        (ref._corrupt_pages_length, "pages"),
        (_corrupt_duplicate_page, "exactly once"),
    ],
)
def test_check_integrity_catches_corruption(corrupt, message, monkeypatch):
    monkeypatch.setattr(ref, "RadixCache", CppRadixCache)
    ref.test_check_integrity_catches_corruption(corrupt, message)


class CppModelMachine(ref.RadixCacheMachine):
    """The Python tree's property test (tree vs a brute-force model), on the C++ tree."""

    @initialize()
    def setup(self):
        ps = self.page_size
        self.alloc = PageAllocator(ref._NUM_PAGES[ps])
        self.cache = CppRadixCache(ps, self.alloc)
        self.model = {}
        self.clock = 0
        self.requests = []


class CppModelMachinePage16(CppModelMachine):
    page_size = 16


TestCppModelPage1 = CppModelMachine.TestCase
TestCppModelPage1.settings = ref._machine_settings
TestCppModelPage16 = CppModelMachinePage16.TestCase
TestCppModelPage16.settings = ref._machine_settings


def test_factory_picks_cpp_when_built():
    alloc = PageAllocator(8)
    assert isinstance(make_radix_cache("auto", 1, alloc), CppRadixCache)
    assert isinstance(make_radix_cache("cpp", 1, alloc), CppRadixCache)
    assert isinstance(make_radix_cache("python", 1, alloc), RadixCache)


def test_factory_falls_back_to_python_loudly(monkeypatch, caplog):
    """Without the extension, "auto" takes the Python tree and says so in the log (a server
    that silently runs the slower tree is hard to notice); "cpp" refuses."""
    monkeypatch.setitem(sys.modules, "radix_runtime.scheduler.radix_cache_cpp", None)
    alloc = PageAllocator(8)
    with caplog.at_level(logging.WARNING, logger="radix_runtime.scheduler.cache"):
        assert isinstance(make_radix_cache("auto", 1, alloc), RadixCache)
    assert "the C++ radix tree is not built" in caplog.text
    with pytest.raises(RuntimeError, match="not built"):
        make_radix_cache("cpp", 1, alloc)


@pytest.mark.parametrize("impl", ["python", "cpp"])
def test_server_info_names_the_tree(impl):
    args = ServerArgs(max_total_tokens=64, radix_tree_impl=impl)
    sched = Scheduler(args, test_scheduler.FakeWorker(65, 1, 4).ready())
    assert sched.server_info().cache.tree == impl


# ---------------------------------------------------------------- 3. the scheduler on it


@pytest.fixture
def cpp_scheduler(monkeypatch):
    """Scheduler(...) builds its tree with impl "cpp", whatever its ServerArgs say."""
    real = scheduler_module.make_radix_cache
    monkeypatch.setattr(
        scheduler_module, "make_radix_cache", lambda _impl, *a, **kw: real("cpp", *a, **kw)
    )


SCHEDULER_TESTS = [
    (test_scheduler.test_cache_on_equals_cache_off, {"page_size": 1, "policy": "lpm"}),
    (test_scheduler.test_cache_on_equals_cache_off, {"page_size": 16, "policy": "lpm"}),
    (test_scheduler.test_cache_on_equals_cache_off, {"page_size": 1, "policy": "dfs-weight"}),
    (test_scheduler.test_cache_on_equals_cache_off, {"page_size": 16, "policy": "dfs-weight"}),
    (test_scheduler.test_cache_on_equals_cache_off, {"page_size": 16, "policy": "fcfs"}),
    (test_scheduler.test_pressure_evicts_and_retracts_without_changing_outputs, {"page_size": 1}),
    (test_scheduler.test_pressure_evicts_and_retracts_without_changing_outputs, {"page_size": 16}),
    (test_scheduler.test_multi_turn_hits_whole_history, {}),
    (test_scheduler.test_prompt_larger_than_pool_is_rejected_and_queue_proceeds, {}),
    (test_scheduler.test_abort_unlocks_pages, {}),
    (test_scheduler.test_in_batch_prefix_is_computed_once, {}),
    (test_scheduler.test_prefill_only_request_warms_the_cache, {}),
    (test_scheduler.test_random_workloads_cache_on_equals_off, {}),
]


@pytest.mark.parametrize(
    "test, kwargs",
    SCHEDULER_TESTS,
    ids=[f"{t.__name__}-{'-'.join(map(str, kw.values()))}" for t, kw in SCHEDULER_TESTS],
)
def test_scheduler_tests_on_cpp(test, kwargs, cpp_scheduler):
    test(**kwargs)


@pytest.mark.parametrize("cpp_allocator", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_scheduler_is_identical_with_either_tree(page_size, policy, cpp_allocator, monkeypatch):
    """Same workload under memory pressure: same outputs, same final tree, same free list."""
    prompts = test_scheduler.shared_prefix_prompts(seed=2, n=16)
    kwargs = dict(page_size=page_size, policy=policy, pool_tokens=320, max_running=6)
    out_py, fin_py, sched_py = test_scheduler.run_workload(prompts, 20, **kwargs)
    real = scheduler_module.make_radix_cache
    monkeypatch.setattr(
        scheduler_module, "make_radix_cache", lambda _impl, *a, **kw: real("cpp", *a, **kw)
    )
    if cpp_allocator:
        monkeypatch.setattr(scheduler_module, "PageAllocator", CppPageAllocator)
    out_cc, fin_cc, sched_cc = test_scheduler.run_workload(prompts, 20, **kwargs)
    assert isinstance(sched_cc.cache, CppRadixCache) and isinstance(sched_py.cache, RadixCache)
    assert (out_py, fin_py) == (out_cc, fin_cc)
    assert sched_py.retractions == sched_cc.retractions
    assert sched_py.cache.dump() == sched_cc.cache.dump()
    assert np.array_equal(sched_py.allocator.free_page_ids(), sched_cc.allocator.free_page_ids())
