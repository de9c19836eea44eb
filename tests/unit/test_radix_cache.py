"""The radix tree of KV pages: unit tests, then a stateful property test against a brute-force
model (a dict of every cached page-aligned prefix -> its page id and LRU time)."""

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


def make(page_size: int = 1, num_pages: int = 64, disable: bool = False):
    alloc = PageAllocator(num_pages)
    return alloc, RadixCache(page_size, alloc, disable=disable)


def cache_request(cache: RadixCache, alloc: PageAllocator, tokens):
    """What the scheduler does for one request: match, allocate the rest, insert, free dups."""
    ps = cache.page_size
    tokens = np.asarray(tokens, dtype=np.int32)
    m = cache.match_prefix(tokens)
    own = len(m.pages)
    new = alloc.alloc(len(tokens) // ps - own)
    assert new is not None, "test pool too small"
    pages = np.concatenate([m.pages, new])
    r = cache.insert(tokens, pages)
    alloc.free(pages[own : r.prefix_len // ps])
    return r


def path_tokens(node) -> list[int]:
    parts = []
    while node.parent is not None:
        parts.append(node.key.tolist())  # a namespace node's key is empty
        node = node.parent
    return [t for part in reversed(parts) for t in part]


# ---------------------------------------------------------------- unit tests


def test_empty_tree():
    alloc, cache = make()
    m = cache.match_prefix([1, 2, 3])
    assert m.length == 0 and len(m.pages) == 0 and m.node is cache.root
    assert m.pages.dtype == np.int32
    assert cache.stats() == {
        "nodes": 0,
        "cached_pages": 0,
        "evictable_pages": 0,
        "protected_pages": 0,
    }
    assert cache.evict(10) == 0
    assert cache.match_prefix([]).length == 0
    cache.check_integrity(expect_unlocked=True)


def test_exact_match_returns_the_inserted_pages():
    alloc, cache = make()
    pages = alloc.alloc(5)
    r = cache.insert([1, 2, 3, 4, 5], pages)
    assert r.prefix_len == 0 and path_tokens(r.node) == [1, 2, 3, 4, 5]
    m = cache.match_prefix(np.array([1, 2, 3, 4, 5], dtype=np.int64))
    assert m.length == 5 and m.pages.tolist() == pages.tolist() and m.node is r.node
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).length == 5
    cache.check_integrity()


def test_partial_match_splits_the_edge():
    alloc, cache = make()
    pages = alloc.alloc(6)
    cache.insert([1, 2, 3, 4, 5, 6], pages)
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.length == 3 and m.pages.tolist() == pages[:3].tolist()
    assert m.node.key.tolist() == [1, 2, 3]
    assert [c.key.tolist() for c in m.node.children.values()] == [[4, 5, 6]]
    assert cache.stats()["nodes"] == 2
    cache.check_integrity()
    # A query that ends inside the edge splits it too: the node ends at the match.
    m = cache.match_prefix([1, 2])
    assert m.length == 2 and path_tokens(m.node) == [1, 2]
    assert cache.stats()["nodes"] == 3
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).pages.tolist() == pages.tolist()
    cache.check_integrity()


def test_page_size_16_matches_whole_pages_only():
    alloc, cache = make(page_size=16)
    tokens = np.arange(100, 140, dtype=np.int32)  # 40 tokens: 2 whole pages + a tail of 8
    pages = alloc.alloc(2)
    r = cache.insert(tokens, pages)
    assert r.prefix_len == 0 and len(path_tokens(r.node)) == 32
    m = cache.match_prefix(tokens[:20])  # 20 tokens -> one whole page
    assert m.length == 16 and m.pages.tolist() == [pages[0]]
    other = tokens.copy()
    other[20] = 0  # mismatch inside the second page
    m = cache.match_prefix(other)
    assert m.length == 16 and m.pages.tolist() == [pages[0]]
    assert cache.match_prefix(tokens[:15]).length == 0
    first_page_differs = tokens.copy()
    first_page_differs[15] = 0
    assert cache.match_prefix(first_page_differs).length == 0
    assert cache.match_prefix(tokens).length == 32
    cache.check_integrity()


def test_page_size_must_match_pages():
    alloc, cache = make(page_size=4)
    with pytest.raises(ValueError):
        cache.insert(list(range(9)), alloc.alloc(3))  # 9 tokens are 2 whole pages
    with pytest.raises(ValueError):
        RadixCache(0, alloc)


def test_insert_returns_cached_prefix_len():
    alloc, cache = make()
    assert cache_request(cache, alloc, [1, 2, 3]).prefix_len == 0
    r = cache_request(cache, alloc, [1, 2, 3, 4, 5])
    assert r.prefix_len == 3 and path_tokens(r.node) == [1, 2, 3, 4, 5]
    # Diverging inside an edge splits it and adds a sibling.
    r = cache_request(cache, alloc, [1, 2, 3, 4, 7])
    assert r.prefix_len == 4 and path_tokens(r.node) == [1, 2, 3, 4, 7]
    # A key that ends inside an edge: all cached, the node ends at the key.
    r = cache_request(cache, alloc, [1, 2])
    assert r.prefix_len == 2 and path_tokens(r.node) == [1, 2]
    assert cache.cached_pages == 6 and alloc.free_pages == alloc.total_pages - 6
    cache.check_integrity(expect_unlocked=True)


def test_duplicate_pages_are_the_callers_to_free():
    """Two requests compute the same prompt concurrently; the second insert is all duplicate."""
    alloc, cache = make(num_pages=32)
    prompt = np.array([7, 8, 9, 10, 11, 12], dtype=np.int32)
    m1, m2 = cache.match_prefix(prompt), cache.match_prefix(prompt)
    assert m1.length == m2.length == 0
    p1, p2 = alloc.alloc(6), alloc.alloc(6)
    assert cache.insert(prompt, p1).prefix_len == 0
    r2 = cache.insert(prompt, p2)
    assert r2.prefix_len == 6
    cache.check_integrity(held_pages=p2)  # p2 still belongs to request 2
    alloc.free(p2[len(m2.pages) : r2.prefix_len])
    cache.check_integrity()
    assert cache.match_prefix(prompt).pages.tolist() == p1.tolist()  # the first copy won
    assert alloc.free_pages == alloc.total_pages - 6


def test_lock_moves_pages_between_evictable_and_protected():
    alloc, cache = make()
    cache_request(cache, alloc, [1, 2, 3, 4])
    cache_request(cache, alloc, [1, 2, 5, 6, 7])
    assert (cache.evictable_pages, cache.protected_pages) == (7, 0)
    m = cache.match_prefix([1, 2, 5, 6, 7])
    cache.lock(m.node)
    assert (cache.evictable_pages, cache.protected_pages) == (2, 5)
    cache.lock(m.node)  # a second request on the same path
    assert (cache.evictable_pages, cache.protected_pages) == (2, 5)
    m2 = cache.match_prefix([1, 2, 3])  # splits [3, 4] below a locked node
    cache.lock(m2.node)
    assert (cache.evictable_pages, cache.protected_pages) == (1, 6)
    cache.check_integrity()
    cache.unlock(m.node)
    cache.unlock(m.node)
    assert (cache.evictable_pages, cache.protected_pages) == (4, 3)
    cache.unlock(m2.node)
    assert (cache.evictable_pages, cache.protected_pages) == (7, 0)
    assert cache.cached_pages == 7
    cache.check_integrity(expect_unlocked=True)
    with pytest.raises(RuntimeError):
        cache.unlock(m.node)
    cache.lock(cache.root)  # the root is never locked: a no-op
    cache.unlock(cache.root)
    cache.check_integrity(expect_unlocked=True)


def test_evict_lru_leaves_first():
    alloc, cache = make()
    cache_request(cache, alloc, [1, 1, 1])
    cache_request(cache, alloc, [2, 2, 2])
    cache_request(cache, alloc, [3, 3, 3])
    cache.match_prefix([1, 1, 1])  # 1 is now the most recent, 2 the oldest
    assert cache.evict(1) == 3  # whole leaves: may free more than asked
    assert cache.match_prefix([2, 2, 2]).length == 0
    assert cache.match_prefix([3, 3, 3]).length == 3  # refreshes 3: now 1 is the oldest
    assert cache.evict(3) == 3
    assert cache.match_prefix([1, 1, 1]).length == 0
    assert cache.match_prefix([3, 3, 3]).length == 3
    assert alloc.free_pages == alloc.total_pages - 3
    cache.check_integrity()


def test_evict_cascades_to_parents():
    alloc, cache = make()
    cache_request(cache, alloc, [1, 2, 3])
    cache_request(cache, alloc, [1, 2, 3, 4, 5])
    cache_request(cache, alloc, [1, 2, 3, 6])
    cache_request(cache, alloc, [9])
    cache.match_prefix([9])  # [9] is the newest; the [1 2 3] subtree goes first
    assert cache.evict(4) == 6  # [4 5], [6], then the parent [1 2 3] became a leaf
    assert cache.match_prefix([1, 2, 3]).length == 0
    assert cache.match_prefix([9]).length == 1
    assert cache.stats()["nodes"] == 1
    cache.check_integrity()


def test_locked_nodes_are_never_evicted_and_evict_returns_what_it_could():
    alloc, cache = make()
    cache_request(cache, alloc, [1, 2, 3])
    cache_request(cache, alloc, [1, 2, 4, 5])
    cache_request(cache, alloc, [7, 7])
    m = cache.match_prefix([1, 2, 3])
    cache.lock(m.node)
    assert cache.evict(100) == 4  # [4 5] and [7 7]; [1 2] and [3] are protected
    assert cache.cached_pages == 3 and cache.protected_pages == 3
    assert cache.match_prefix([1, 2, 3]).pages.tolist() == m.pages.tolist()
    assert cache.evict(1) == 0
    cache.check_integrity()
    cache.unlock(m.node)
    assert cache.evict(100) == 3
    assert cache.cached_pages == 0 and alloc.free_pages == alloc.total_pages
    cache.check_integrity(expect_unlocked=True)


def test_locking_an_evicted_node_raises():
    alloc, cache = make()
    r = cache_request(cache, alloc, [1, 2])
    cache.evict(2)
    with pytest.raises(ValueError):
        cache.lock(r.node)


def test_reset():
    alloc, cache = make()
    cache_request(cache, alloc, [1, 2, 3])
    r = cache_request(cache, alloc, [4, 5])
    cache.lock(r.node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(r.node)
    cache.reset()
    assert cache.stats()["nodes"] == 0 and cache.cached_pages == 0
    assert alloc.free_pages == alloc.total_pages
    assert cache.match_prefix([1, 2, 3]).length == 0
    cache.check_integrity(expect_unlocked=True)
    cache_request(cache, alloc, [1, 2, 3])  # usable after a reset
    assert cache.match_prefix([1, 2, 3]).length == 3


def test_disabled_cache_reuses_nothing_through_the_same_code_path():
    alloc, cache = make(page_size=2, disable=True)
    for _ in range(3):
        r = cache_request(cache, alloc, [1, 2, 3, 4, 5])  # frees all its pages as duplicates
        assert r.prefix_len == 4 and r.node is cache.root
    assert cache.match_prefix([1, 2, 3, 4]).length == 0
    assert alloc.free_pages == alloc.total_pages
    assert (cache.evictable_pages, cache.protected_pages, cache.cached_pages) == (0, 0, 0)
    cache.lock(cache.root)
    cache.unlock(cache.root)
    assert cache.evict(10) == 0
    cache.check_integrity(expect_unlocked=True)


def test_long_prompts_match_page_aligned():
    alloc, cache = make(page_size=16, num_pages=4096)
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, 8192, dtype=np.int32)
    a = np.concatenate([system, rng.integers(0, 32000, 24000, dtype=np.int32)])
    b = np.concatenate([system, rng.integers(0, 32000, 1000, dtype=np.int32)])
    assert cache_request(cache, alloc, a).prefix_len == 0
    assert cache_request(cache, alloc, b).prefix_len == 8192
    m = cache.match_prefix(a[:-1])
    assert m.length == (len(a) - 1) // 16 * 16 and len(m.pages) == m.length // 16
    cache.check_integrity()


def test_heap_of_evictable_leaves_stays_bounded():
    alloc, cache = make(num_pages=128)
    for i in range(50):
        cache_request(cache, alloc, [i, i])
    for _ in range(20_000):
        cache.match_prefix([3, 3])  # each touch pushes a new heap entry for the leaf
    assert len(cache._heap) <= 2 * 1024
    cache.check_integrity()
    assert cache.evict(2) == 2
    assert cache.match_prefix([0, 0]).length == 0  # still LRU after compactions


def test_pretty_mentions_nodes():
    alloc, cache = make()
    cache_request(cache, alloc, [1, 2, 3])
    cache_request(cache, alloc, [1, 2, 4])
    text = cache.pretty()
    assert "[1, 2]" in text and "[3]" in text and "[4]" in text


def _corrupt_free_a_cached_page(alloc, cache):
    node = next(iter(cache.root.children.values()))
    alloc.free(node.pages[:1])  # now both free and in the tree


def _corrupt_counter(alloc, cache):
    cache._evictable += 1


def _corrupt_heap(alloc, cache):
    cache._heap.clear()


def _corrupt_lock_ref(alloc, cache):
    leaf = cache.match_prefix([1, 2, 3, 4]).node
    leaf.lock_ref = 1  # locked without its parent, and without moving the counters


def _corrupt_child_key(alloc, cache):
    node = next(iter(cache.root.children.values()))
    node.key_bytes = np.int32(99).tobytes() + node.key_bytes[4:]
    node.key = np.frombuffer(node.key_bytes, dtype=np.int32)


def _corrupt_leak_a_page(alloc, cache):
    alloc.alloc(1)  # owned by nobody


def _corrupt_key_bytes(alloc, cache):
    node = cache.match_prefix([1, 2, 3, 4]).node
    node.key = np.array([3, 5], dtype=np.int32)  # the tokens and their bytes disagree


def _corrupt_pages_length(alloc, cache):
    node = cache.match_prefix([5, 6]).node
    node.pages = node.pages[:1]


def _corrupt_duplicate_page(alloc, cache):
    a = cache.match_prefix([5, 6]).node
    b = cache.match_prefix([1, 2]).node
    a.pages = a.pages.copy()
    a.pages[0] = b.pages[0]  # counts add up, but one page is in two nodes and one is lost


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_corrupt_free_a_cached_page, "free"),
        (_corrupt_counter, "evictable"),
        (_corrupt_heap, "heap"),
        (_corrupt_lock_ref, "lock"),
        (_corrupt_child_key, "first token"),
        (_corrupt_leak_a_page, "total"),
        (_corrupt_key_bytes, "key_bytes"),
        (_corrupt_pages_length, "pages"),
        (_corrupt_duplicate_page, "exactly once"),
    ],
)
def test_check_integrity_catches_corruption(corrupt, message):
    alloc, cache = make()
    cache_request(cache, alloc, [1, 2, 3, 4])
    cache_request(cache, alloc, [1, 2, 7])
    cache_request(cache, alloc, [5, 6])
    cache.check_integrity(expect_unlocked=True)
    corrupt(alloc, cache)
    with pytest.raises(AssertionError, match=message):
        cache.check_integrity()


# ---- namespaces (cache salts, tenants)


def test_namespaces_share_nothing_not_even_the_first_token():
    alloc, cache = make()
    tokens = [1, 2, 3, 4, 5, 6]
    cache_request(cache, alloc, tokens + [7])  # public
    r = cache.insert(tokens, alloc.alloc(6), namespace="a")
    assert r.prefix_len == 0  # the public copy is not a's
    assert cache.match_prefix(tokens, "a").length == 6
    assert cache.match_prefix(tokens, "b").length == 0  # no node for b: nothing at all
    assert cache.match_prefix(tokens[:1], "b").length == 0
    assert cache.match_prefix(tokens).length == 6  # public
    m = cache.match_prefix([1, 2, 9], "a")
    assert m.length == 2 and m.node.parent.namespace == "a"
    assert cache.match_prefix([1, 2, 9], "b").node is cache.root
    cache.check_integrity()
    assert cache.cached_pages == 13


def test_namespace_nodes_hold_nothing_and_are_dropped_when_emptied():
    alloc, cache = make(num_pages=8)
    r = cache.insert([1, 2, 3], alloc.alloc(3), namespace="tenant")
    ns_node = r.node.parent
    assert ns_node.namespace == "tenant" and ns_node.parent is cache.root
    assert len(ns_node.key) == 0 and len(ns_node.pages) == 0
    assert cache.root.children["tenant"] is ns_node
    assert "tenant" in cache.pretty()
    assert cache.insert([], [], namespace="other").node is cache.root  # no empty namespace node
    assert "other" not in cache.root.children
    assert cache.evict(3) == 3
    assert cache.evict(1) == 0  # the empty namespace node goes, freeing nothing
    assert "tenant" not in cache.root.children and ns_node.parent is None
    cache.check_integrity(expect_unlocked=True)
    assert alloc.free_pages == alloc.total_pages


def test_eviction_across_namespaces_is_one_lru():
    alloc, cache = make(num_pages=10)  # page 0 is reserved: 9 usable
    cache.insert([1, 2, 3], alloc.alloc(3), namespace="a")  # oldest
    cache.insert([1, 2, 3], alloc.alloc(3), namespace="b")
    cache.insert([1, 2, 3], alloc.alloc(3))  # public, newest
    assert cache.match_prefix([1, 2, 3, 4], "a").length == 3  # a is now the newest
    assert cache.evict(3) == 3
    assert cache.match_prefix([1, 2, 3], "b").length == 0  # b was the least recently used
    assert cache.match_prefix([1, 2, 3], "a").length == 3
    assert cache.evict(3) == 3  # public next (a was touched just now)
    assert cache.match_prefix([1, 2, 3]).length == 0
    assert cache.match_prefix([1, 2, 3], "a").length == 3
    cache.check_integrity()


def test_locks_through_namespace_nodes():
    alloc, cache = make(num_pages=6)
    cache.insert([1, 2, 3], alloc.alloc(3), namespace="a")
    m = cache.match_prefix([1, 2, 3, 4], "a")
    cache.lock(m.node)
    assert cache.protected_pages == 3 and cache.evictable_pages == 0
    assert cache.evict(3) == 0
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(m.node)
    empty = cache.match_prefix([7, 7], "a")  # nothing matched: the namespace node itself
    assert empty.length == 0 and empty.node.namespace == "a"
    cache.lock(empty.node)
    cache.check_integrity()
    with pytest.raises(RuntimeError):
        cache.reset()  # a request holds the namespace
    cache.unlock(empty.node)
    cache.reset()
    cache.check_integrity(expect_unlocked=True)
    assert alloc.free_pages == alloc.total_pages


def test_disabled_cache_ignores_namespaces():
    alloc, cache = make(disable=True)
    pages = alloc.alloc(3)
    assert cache.insert([1, 2, 3], pages, namespace="a").prefix_len == 3  # all duplicates
    assert cache.match_prefix([1, 2, 3], "a").length == 0
    alloc.free(pages)  # the caller's duplicates
    cache.check_integrity()


def test_check_integrity_catches_a_misfiled_namespace_node():
    alloc, cache = make()
    cache.insert([1, 2], alloc.alloc(2), namespace="a")
    cache.check_integrity()
    cache.root.children["b"] = cache.root.children.pop("a")  # filed under another name
    with pytest.raises(AssertionError, match="not under its name"):
        cache.check_integrity()


def test_a_namespace_is_a_str():
    _, cache = make()
    with pytest.raises(TypeError):
        cache.match_prefix([1, 2], b"a")


def test_check_integrity_expect_unlocked():
    alloc, cache = make()
    r = cache_request(cache, alloc, [1, 2])
    cache.lock(r.node)
    cache.check_integrity()
    with pytest.raises(AssertionError, match="locked"):
        cache.check_integrity(expect_unlocked=True)


# ---------------------------------------------------------------- property test

# Tokens come from a few page-sized patterns so keys share prefixes; patterns 0 and 1 share
# their first half so that, with page_size 16, keys also diverge inside a page.
_PATTERNS = {
    1: [[5], [6], [7]],
    16: [[5] * 16, [5] * 8 + [6] * 8, [7] * 16],
}
_NUM_PAGES = {1: 24, 16: 14}
_MAX_KEY_PAGES = 10
_NAMESPACES = st.sampled_from([None, None, "a", "b"])


def node_namespace(node):
    """The namespace a node is in (None: the public one)."""
    while node.parent is not None and node.namespace is None:
        node = node.parent
    return node.namespace


class RadixCacheMachine(RuleBasedStateMachine):
    """Drives the tree as a scheduler would and keeps a brute-force model: every cached
    page-aligned prefix, keyed by (namespace, tuple of tokens) -> [page id, LRU time]. Keys live
    in the public namespace (None) or in one of two salted ones, and the same tokens are often
    sent in several namespaces: a match must only ever see its own namespace's prefixes. The
    model's eviction is LRU over its unlocked leaf prefixes of all namespaces together, one page
    at a time; the tree must drop exactly that set."""

    page_size = 1
    keys = Bundle("keys")

    @initialize()
    def setup(self):
        ps = self.page_size
        self.alloc = PageAllocator(_NUM_PAGES[ps])
        self.cache = RadixCache(ps, self.alloc)
        self.model: dict[tuple, list[int]] = {}
        self.clock = 0
        self.requests: list[dict] = []  # running: key, matched length, node

    # ---- keys: (namespace, tokens) ----

    def _build(self, patterns, mutation, tail) -> tuple:
        ps = self.page_size
        tokens = [t for p in patterns for t in _PATTERNS[ps][p]]
        if mutation is not None:
            tokens[mutation % len(tokens)] = 9
        return tuple(tokens + [5] * (tail % ps))

    @rule(
        target=keys,
        patterns=st.lists(st.integers(0, 2), min_size=1, max_size=6),
        mutation=st.none() | st.integers(0, 200),
        tail=st.integers(0, 15),
        ns=_NAMESPACES,
    )
    def new_key(self, patterns, mutation, tail, ns):
        return ns, self._build(patterns, mutation, tail)

    @rule(target=keys, key=keys, more=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def extend_key(self, key, more):
        """The next turn of a conversation: the old key (tail dropped) plus new pages."""
        ps = self.page_size
        ns, tokens = key
        aligned = tokens[: len(tokens) // ps * ps]
        extra = self._build(more, None, 0)
        return ns, (aligned + extra)[: _MAX_KEY_PAGES * ps]

    @rule(target=keys, key=keys, ns=_NAMESPACES)
    def other_namespace(self, key, ns):
        """The same tokens sent under another salt (or none)."""
        return ns, key[1]

    # ---- model helpers ----

    def _model_match(self, key: tuple) -> int:
        ps = self.page_size
        ns, tokens = key
        length = 0
        while length + ps <= len(tokens) and (ns, tokens[: length + ps]) in self.model:
            length += ps
        return length

    def _model_pages(self, key: tuple, length: int) -> list[int]:
        ns, tokens = key
        return [
            self.model[ns, tokens[:i]][0] for i in range(self.page_size, length + 1, self.page_size)
        ]

    def _touch(self, key: tuple, length: int) -> None:
        ns, tokens = key
        self.clock += 1
        for i in range(self.page_size, length + 1, self.page_size):
            self.model[ns, tokens[:i]][1] = self.clock

    def _locked_prefixes(self) -> set[tuple]:
        ps = self.page_size
        return {
            (r["key"][0], r["key"][1][:i])
            for r in self.requests
            for i in range(ps, r["length"] + 1, ps)
        }

    def _evict(self, num_pages: int) -> int:
        ps = self.page_size
        evictable_before = self.cache.evictable_pages
        freed = self.cache.evict(num_pages)
        assert freed >= min(num_pages, evictable_before), "evict stopped early"
        assert freed <= evictable_before
        locked = self._locked_prefixes()
        for _ in range(freed):
            parents = {(ns, p[:-ps]) for ns, p in self.model}
            leaves = [k for k in self.model if k not in parents and k not in locked]
            assert leaves, "tree freed more than the model can"
            oldest = min(leaves, key=lambda k: self.model[k][1])
            ties = [k for k in leaves if self.model[k][1] == self.model[oldest][1]]
            assert len(ties) == 1, "LRU tie between leaves: the model is ambiguous"
            del self.model[oldest]
        return freed

    # ---- scheduler-like operations ----

    def _start(self, key: tuple) -> dict:
        ps = self.page_size
        ns, tokens = key
        m = self.cache.match_prefix(np.array(tokens, dtype=np.int32), ns)
        expected = self._model_match(key)
        assert m.length == expected, f"match {m.length} != model {expected}"
        assert m.pages.tolist() == self._model_pages(key, expected)
        assert len(path_tokens(m.node)) == m.length
        assert node_namespace(m.node) in ({ns} if m.length else {ns, None})
        assert len(m.pages) == m.length // ps
        self._touch(key, m.length)
        self.cache.lock(m.node)
        return {"key": key, "length": m.length, "node": m.node, "pages": m.pages}

    def _finish(self, req: dict) -> None:
        """Insert a running request's key; it stays locked (in self.requests) until the end."""
        ps = self.page_size
        key = req["key"]
        ns, tokens = key
        n_pages = len(tokens) // ps
        own = req["length"] // ps
        need = n_pages - own
        new = self.alloc.alloc(need)
        if new is None:
            self._evict(need - self.alloc.free_pages)
            new = self.alloc.alloc(need)
        if new is not None:
            pages = np.concatenate([req["pages"], new])
            expected = self._model_match(key)
            assert expected >= req["length"], "a locked prefix was lost"
            r = self.cache.insert(np.array(tokens, dtype=np.int32), pages, namespace=ns)
            assert r.prefix_len == expected, f"prefix_len {r.prefix_len} != model {expected}"
            assert len(path_tokens(r.node)) == n_pages * ps
            if n_pages:
                assert node_namespace(r.node) == ns
            self.alloc.free(pages[own : r.prefix_len // ps])
            for i in range(r.prefix_len // ps, n_pages):
                self.model[ns, tokens[: (i + 1) * ps]] = [int(pages[i]), 0]
            self._touch(key, n_pages * ps)
        # else: the request could not fit; it is dropped (its match still refreshed LRU)
        self.cache.unlock(req["node"])
        self.requests = [r for r in self.requests if r is not req]

    @precondition(lambda self: len(self.requests) < 4)
    @rule(key=keys)
    def start_request(self, key):
        self.requests.append(self._start(key))

    @precondition(lambda self: self.requests)
    @rule(which=st.integers(0, 3))
    def finish_request(self, which):
        self._finish(self.requests[which % len(self.requests)])

    @rule(key=keys)
    def serve_request(self, key):
        self.requests.append(self._start(key))
        self._finish(self.requests[-1])

    @rule(key=keys)
    def match_only(self, key):
        m = self.cache.match_prefix(list(key[1]), namespace=key[0])
        assert m.length == self._model_match(key)
        assert m.pages.tolist() == self._model_pages(key, m.length)
        self._touch(key, m.length)

    @precondition(lambda self: self.cache.evictable_pages > 0)
    @rule(num_pages=st.integers(0, 12))
    def evict(self, num_pages):
        self._evict(num_pages)

    # Rare (a full pool, nothing running): a reset makes the rest of the run start over.
    @precondition(
        lambda self: not self.requests and self.alloc.free_pages < self.alloc.total_pages // 4
    )
    @rule()
    def reset(self):
        self.cache.reset()
        self.model.clear()
        assert self.alloc.free_pages == self.alloc.total_pages

    # ---- invariants ----

    @invariant()
    def tree_agrees_with_model(self):
        if not hasattr(self, "cache"):
            return
        cache = self.cache
        cache.check_integrity()
        self.alloc.check_integrity()
        ps = self.page_size
        tree: dict[tuple, int] = {}
        stack = [(cache.root, None, ())]
        while stack:
            node, ns, prefix = stack.pop()
            for child in node.children.values():
                if child.namespace is not None:
                    assert node is cache.root and not len(child.key) and not len(child.pages)
                    stack.append((child, child.namespace, ()))
                    continue
                full = prefix + tuple(child.key.tolist())
                for i, page in enumerate(child.pages.tolist()):
                    tree[ns, full[: len(prefix) + (i + 1) * ps]] = page
                stack.append((child, ns, full))
        assert tree == {k: v[0] for k, v in self.model.items()}
        assert cache.protected_pages == len(self._locked_prefixes())
        assert cache.cached_pages == len(self.model)

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        while self.requests:
            self._finish(self.requests[-1])
        self.cache.check_integrity(expect_unlocked=True)
        self.cache.reset()
        self.cache.check_integrity(expect_unlocked=True)
        assert self.alloc.free_pages == self.alloc.total_pages


class RadixCacheMachinePage16(RadixCacheMachine):
    page_size = 16


_machine_settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestRadixCachePage1 = RadixCacheMachine.TestCase
TestRadixCachePage1.settings = _machine_settings
TestRadixCachePage16 = RadixCacheMachinePage16.TestCase
TestRadixCachePage16.settings = _machine_settings
