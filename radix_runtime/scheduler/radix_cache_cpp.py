"""The radix tree in C++ (csrc/radix_tree.cpp) behind RadixCache's exact interface, and the page
allocator's C++ twin (csrc/page_allocator.cpp).

The Python `RadixCache` (radix_cache.py) is the readable reference; this is its twin for the
scheduler's hot path. Both take the same steps in the same order: the same node ids, LRU clock
and heap, the same splits, the same eviction order and the same order of freed pages, so either
can replace the other mid-design (tests/unit/test_radix_cache_cpp.py runs them side by side).

Token and page arrays cross into C++ as int32 numpy buffers. Nodes are C++ objects with the
Python node's read interface (`id`, `parent`, `key`, `pages`, `children`, `lock_ref`,
`last_access`); `key`, `pages` and `children` are built on each access (copies), so they are
for tests and debugging, not hot loops. Importing this module raises ImportError when the
extension is not built; `scheduler/cache.py` then falls back to the Python tree.

The wrapper is thin on the hot path: while the cache is enabled, `match_prefix`, `insert`,
`lock`, `unlock` (and `evict` with the C++ allocator) are the extension's own methods, bound on
the instance, so a call goes straight to C++ without a Python frame in between.

The host tier (docs/hicache.md) is in the C++ tree too, with the Python tree's semantics step for
step: the host pool is the C++ allocator or the Python one (`host_allocator`), the queued copies
come out of `take_copies` as the Python tree's `PendingCopies`, and the tier observer's events
are recorded in C++ and handed to the observer when the call that made them returns.
"""

from __future__ import annotations

import numpy as np

from radix_runtime.scheduler import _radix_tree
from radix_runtime.scheduler.allocator import PageAllocator
from radix_runtime.scheduler.radix_cache import (
    _EMPTY,
    Copy,
    InsertResult,
    MatchResult,
    PendingCopies,
    RadixCache,
    _as_tokens,
    check_page_ownership,
)

if not hasattr(_radix_tree.TreeNode, "load_pending"):
    # NOTE: a copy built from older sources lacks the host tier as the Python tree has it (or
    # namespaces); refusing it here makes `--radix-tree-impl auto` fall back to the Python tree
    # (with a warning) instead of running a tree that behaves differently
    raise ImportError(
        "the C++ radix tree extension predates the host tier: rebuild it "
        "(`python setup.py build_ext --inplace`)"
    )

TreeNode = _radix_tree.TreeNode
# The twin of allocator.PageAllocator (same interface, same LIFO order, same checks and errors):
# evictions free thousands of pages at a time, which the numpy allocator checks slower than the
# C++ tree evicts them. The tree works with either allocator.
CppPageAllocator = _radix_tree.PageAllocator


class CppRadixCache:
    def __init__(
        self,
        page_size: int,
        allocator: PageAllocator | CppPageAllocator,
        disable: bool = False,
        host_allocator: PageAllocator | CppPageAllocator | None = None,
        write_through: bool = False,
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.allocator = allocator
        # the host tier's pool (None: one tier); the C++ tree allocates from it and frees into it
        self.host_allocator = host_allocator
        self.write_through = write_through and host_allocator is not None
        # With the C++ allocator, evicted pages go back to it without crossing into Python: the
        # C++ tree holds that allocator from here on (reassigning self.allocator does not move it).
        self._cpp_allocator = isinstance(allocator, CppPageAllocator)
        self._tree = _radix_tree.RadixTree(
            page_size,
            MatchResult,
            InsertResult,
            allocator if self._cpp_allocator else None,
            host_allocator,
            self.write_through,
        )
        self.disable = disable

    # NOTE: the methods below are the reference behaviour; while the cache is enabled the hot
    # ones are shadowed by the C++ methods themselves (instance attributes), which do the same.
    _FAST = ("match_prefix", "insert", "lock", "unlock", "evict")

    @property
    def disable(self) -> bool:
        return self._disable

    @disable.setter
    def disable(self, value: bool) -> None:
        self._disable = bool(value)
        for name in self._FAST:
            self.__dict__.pop(name, None)
        if not self._disable:
            tree = self._tree
            self.__dict__.update(match_prefix=tree.match_prefix, lock=tree.lock, unlock=tree.unlock)
            # NOTE: with a tier observer, insert and evict report the events they made (a Python
            # frame after the call); with an eviction observer, evict hands over what it dropped
            if self.on_tier is None:
                self.insert = tree.insert
            if self._cpp_allocator and self.on_evict is None and self.on_tier is None:
                self.evict = tree.evict_into

    # ---- sizes ----

    @property
    def root(self) -> TreeNode:
        return self._tree.root

    @property
    def evictable_pages(self) -> int:
        return self._tree.evictable_pages

    @property
    def protected_pages(self) -> int:
        return self._tree.protected_pages

    @property
    def cached_pages(self) -> int:
        return self._tree.evictable_pages + self._tree.protected_pages

    @property
    def host_cached_pages(self) -> int:
        return self._tree.host_cached_pages

    @property
    def host_evictable_pages(self) -> int:
        return self._tree.host_evictable_pages

    def stats(self) -> dict:
        tree = self._tree
        return {
            "nodes": tree.num_nodes,
            "cached_pages": tree.evictable_pages + tree.protected_pages,
            "evictable_pages": tree.evictable_pages,
            "protected_pages": tree.protected_pages,
        }

    # ---- match / insert ----

    def match_prefix(self, tokens, namespace: str | None = None) -> MatchResult:
        if self.disable:
            return MatchResult(_EMPTY, 0, self._tree.root)
        return self._tree.match_prefix(tokens, namespace)

    def insert(self, tokens, pages, namespace: str | None = None) -> InsertResult:
        if self.disable:  # all "duplicates": the caller frees them
            tokens = _as_tokens(tokens)
            num_pages = len(tokens) // self.page_size
            if np.asarray(pages).size != num_pages:
                raise ValueError(
                    f"{len(tokens)} tokens need {num_pages} pages, got {np.asarray(pages).size}"
                )
            return InsertResult(num_pages * self.page_size, self._tree.root)
        try:
            return self._tree.insert(tokens, pages, namespace)
        finally:
            self._report_tier_events()

    # ---- the host tier ----

    def load_back(self, node: TreeNode, pages) -> int:
        """Give the host-only nodes on the path to `node` (locked by the caller) the device
        `pages` and queue their loads (RadixCache.load_back). Returns the tokens loaded."""
        try:
            return self._tree.load_back(node, pages)
        finally:
            self._report_tier_events()

    def evict_host(self, num_pages: int) -> int:
        """Free at least `num_pages` host pages: LRU unlocked host-only leaves leave the tree."""
        try:
            return self._tree.evict_host(num_pages)
        finally:
            self._report_tier_events()

    def take_copies(self) -> PendingCopies:
        writes, loads, block = self._tree.take_copies()
        return PendingCopies(
            [Copy(src, dst) for src, dst in writes], [Copy(src, dst) for src, dst in loads], block
        )

    on_tier = None

    def set_tier_observer(self, on_tier) -> None:
        """`on_tier(kind, src, dst)` as RadixCache.set_tier_observer: the C++ tree records the
        events and each call that made some hands them over before it returns."""
        self.on_tier = on_tier
        self._tree.record_tier_events(on_tier is not None)
        self.disable = self._disable  # rebinds the fast paths

    def _report_tier_events(self) -> None:
        if self.on_tier is not None:
            for kind, src, dst in self._tree.take_tier_events():
                self.on_tier(kind, src, dst)

    # ---- locks ----

    def lock(self, node: TreeNode) -> None:
        self._tree.lock(node)

    def unlock(self, node: TreeNode) -> None:
        self._tree.unlock(node)

    # ---- eviction ----

    def evict(self, num_pages: int) -> int:
        if self._cpp_allocator and self.on_evict is None:
            try:
                return self._tree.evict_into(num_pages)
            finally:
                self._report_tier_events()
        try:
            freed, pages, dropped = self._tree.evict(num_pages)
        finally:
            self._report_tier_events()
        if len(pages):
            self.allocator.free(pages)
        if dropped is not None and self.on_evict is not None:
            self.on_evict(dropped)
        return freed

    on_evict = None

    def set_evict_observer(self, on_evict) -> None:
        """`on_evict(page_ids)` after every eviction (KV-cache events): the pages of the nodes
        that left the tree then come back through Python, also with the C++ allocator."""
        self.on_evict = on_evict
        self.__dict__.pop("evict", None)

    def reset(self) -> None:
        if self._cpp_allocator:
            self._tree.reset_into()
        else:
            self.allocator.free(self._tree.reset())

    # ---- debugging ----

    def check_integrity(
        self, expect_unlocked: bool = False, held_pages: np.ndarray | None = None
    ) -> None:
        """The same checks as RadixCache.check_integrity: the tree, counters and heap in C++
        (an AssertionError on failure), the page accounting against the allocator here."""
        tree = self._tree
        if self.disable:
            assert not tree.root.children, "disabled cache holds nodes"
        tree.check_integrity(expect_unlocked)
        check_page_ownership(
            self.allocator,
            tree.evictable_pages,
            tree.protected_pages,
            [tree.all_pages()],
            held_pages,
        )
        if self.host_allocator is not None:
            check_page_ownership(
                self.host_allocator, tree.host_cached_pages, 0, [tree.all_host_pages()], None
            )

    # Both read the tree only through the node interface, which the C++ nodes share.
    dump = RadixCache.dump
    pretty = RadixCache.pretty
