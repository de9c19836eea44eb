"""The radix tree of KV-cache pages: any prefix that requests share is computed once.

An edge (a `TreeNode`) is a run of token ids plus the page ids that hold their KV. With
`page_size > 1` edges are whole pages and only whole pages match, so every node holds
`len(key) // page_size` pages. Children are keyed by the bytes of their first token
(page_size 1) or of their first page, so a child lookup is one dict access. Edges keep their
tokens as immutable bytes: a whole edge is compared with one memcmp (bytes.startswith), and only
the edge where a match ends needs numpy to find the first differing token. Hence a long prompt
(32k tokens) costs a few microseconds plus about one microsecond per edge on its path.

Lifecycle of a request's pages, as the scheduler drives it:
    m = cache.match_prefix(prompt[:-1])       # reuse m.pages, lock m.node while running
    cache.lock(m.node)
    ... allocate pages for the rest, run ...
    r = cache.insert(tokens, pages)           # prompt + output, page-aligned part
    allocator.free(pages[len(m.pages) : r.prefix_len // page_size])   # duplicates
    cache.unlock(m.node)
The tree never frees pages on insert: pages that someone else cached in the meantime are the
caller's duplicates (one place frees pages: the caller).

Namespaces (cache salts, tenants): a prefix is shared only inside its namespace. The public
namespace (None) is the root itself; every other namespace is a *namespace node* directly under
the root, with no tokens and no pages, filed in the root's children under its name (a str, so it
can never equal a token key, which is bytes). A match or insert in namespace `ns` starts its walk
at that node, so a salted prefix can never be reached from another namespace, not even for the
first token. Namespace nodes are ordinary nodes to everything else: locks run through them to the
root, the one LRU heap holds them (an emptied one is dropped like any unlocked leaf, freeing no
pages), and check_integrity walks them as part of the one tree. A host-memory tier would hang off
the same nodes; namespaces need nothing from it.

The host tier (`--enable-hierarchical-cache`, docs/hicache.md): a node's KV lives on the device
(`pages`), in the host pool (`host_pages`), or both. The device-resident nodes form a prefix-closed
subtree (a node on the device has its parent on the device), so a match is a run of device nodes
followed by a run of host-only nodes. Device eviction takes the LRU unlocked node none of whose
children is on the device; it keeps the node on the host (writing it there first when it has no
host copy yet) and removes it only when the host pool has no room. Host eviction first drops the
LRU host copies of unlocked nodes that are also on the device (their KV stays there), then takes
the LRU unlocked host-only leaf; that node leaves the tree. The tree does not copy anything: it queues the
copies (`take_copies`) that the scheduler sends to the worker with the next step. Without a host
pool (`host_allocator` None) everything below reduces to the one-tier tree.

LRU: a monotonic counter (not wall time, so runs are deterministic) stamps every node on the
path of a match or insert. Eviction takes the least recently used *unlocked leaf* from a heap
of evictable leaves with lazy deletion: an entry is live only while its node is still an
attached, unlocked leaf with the same `last_access`; stale entries are skipped on pop and
dropped by an amortised compaction. No eviction scans the tree.
"""

from __future__ import annotations

import heapq
import itertools
from typing import NamedTuple

import numpy as np

from radix_runtime.scheduler.allocator import PageAllocator

_EMPTY = np.empty(0, dtype=np.int32)
_EMPTY.flags.writeable = False


class TreeNode:
    __slots__ = (
        "key",
        "key_bytes",
        "pages",
        "children",
        "parent",
        "lock_ref",
        "last_access",
        "id",
        "heap_time",
        "namespace",
        "host_pages",
        "dev_children",
        "host_heap_time",
        "in_copy_heap",
        "load_pending",
    )

    def __init__(self, key_bytes: bytes, pages: np.ndarray, parent: TreeNode | None, node_id: int):
        # NOTE: the edge's tokens live in immutable bytes; `key` is a read-only int32 view of them.
        # Whole edges are compared with bytes.startswith (one memcmp, no numpy call overhead).
        self.key_bytes = key_bytes
        self.key = np.frombuffer(key_bytes, dtype=np.int32)  # the edge's tokens
        self.pages = pages  # read-only int32 page ids, len(key) // page_size of them
        self.children: dict[bytes, TreeNode] = {}  # keyed by the child's first token / page
        self.parent = parent  # None for the root and for evicted nodes
        self.lock_ref = 0  # requests whose matched path goes through this node
        self.last_access = 0  # LRU stamp; a parent's is always >= its children's
        self.id = node_id  # LRU tie-break, and a stable name in debug dumps
        # NOTE: `last_access` of this node's newest entry in the evictable-leaf heap, -1 if none.
        self.heap_time = -1
        # the namespace's name for a namespace node (a child of the root), else None
        self.namespace: str | None = None
        # the host tier: this node's host page ids (None: not on the host); `pages` is empty
        # when the node is on the host only
        self.host_pages: np.ndarray | None = None
        self.dev_children = 0  # children on the device (namespace nodes count as on the device)
        self.host_heap_time = -1  # as heap_time, for the host-leaf heap
        self.in_copy_heap = False  # has an entry in the heap of host copies of device nodes
        self.load_pending = False  # a load into it is queued and not taken yet

    @property
    def on_device(self) -> bool:
        # NOTE: the root and namespace nodes (no tokens) count as on the device
        return len(self.pages) > 0 or not self.key_bytes

    def __repr__(self) -> str:
        if self.namespace is not None:
            return (
                f"TreeNode(id={self.id}, namespace={self.namespace!r}, "
                f"lock_ref={self.lock_ref}, last_access={self.last_access})"
            )
        host = "" if self.host_pages is None else f", host_pages={len(self.host_pages)}"
        return (
            f"TreeNode(id={self.id}, tokens={len(self.key)}, pages={len(self.pages)}{host}, "
            f"lock_ref={self.lock_ref}, last_access={self.last_access})"
        )


class MatchResult(NamedTuple):
    pages: np.ndarray  # int32 page ids of the matched prefix (a read-only array)
    length: int  # matched tokens, a multiple of page_size
    node: TreeNode  # deepest matched node; the root when nothing matched
    # the host tier: tokens past `length` whose KV is on the host only, and the deepest node
    # matched in either tier (`node` when nothing matched on the host)
    host_length: int = 0
    host_node: TreeNode | None = None


class InsertResult(NamedTuple):
    prefix_len: int  # tokens of the key that were cached before this insert
    node: TreeNode  # node ending at the key's page-aligned end (the root for an empty key)


def _join(pages: list[np.ndarray]) -> np.ndarray:
    """Concatenate int32 page arrays into a read-only array. A single edge's (read-only) pages
    are returned as they are; bytes.join beats np.concatenate's per-array overhead."""
    if len(pages) == 1:
        return pages[0]
    return np.frombuffer(b"".join(pages), dtype=np.int32)


def _as_tokens(tokens) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32).reshape(-1)


class Copy(NamedTuple):
    """A copy the worker makes between the pools: page ids, one per page, `src` to `dst`."""

    src: np.ndarray
    dst: np.ndarray


class PendingCopies(NamedTuple):
    """What the tree queued since the last `take_copies`, for the next step's batch."""

    writes: list[Copy]  # device -> host
    loads: list[Copy]  # host -> device
    writes_block: bool  # device pages of a write were freed: the step must wait for the write


class RadixCache:
    def __init__(
        self,
        page_size: int,
        allocator: PageAllocator,
        disable: bool = False,
        host_allocator: PageAllocator | None = None,
        write_through: bool = False,
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.allocator = allocator
        self.disable = disable
        self.host_allocator = host_allocator  # the host tier's pool; None: one tier
        self.write_through = write_through and host_allocator is not None
        self.on_evict = None  # see set_evict_observer
        self.on_tier = None  # see set_tier_observer
        self._writes: list[Copy] = []
        self._loads: list[Copy] = []
        self._loading: list[TreeNode] = []  # the nodes of the queued loads
        self._writes_block = False
        self._key_step = 4 * page_size  # bytes of one page of int32 tokens
        self._ids = itertools.count()
        self._clock = 0
        self._new_tree()

    def _new_tree(self) -> None:
        self.root = TreeNode(b"", _EMPTY, None, next(self._ids))
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0  # excluding the root
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._heap_limit = 1024
        self._host_heap: list[tuple[int, int, TreeNode]] = []
        self._host_heap_limit = 1024
        # NOTE: one entry per node at most (`in_copy_heap`); an entry whose node was used since
        # is pushed again with its new stamp when it reaches the top (exact LRU, lazily)
        self._copy_heap: list[tuple[int, int, TreeNode]] = []
        self._copy_heap_limit = 1024
        self._host_cached = 0  # host pages held by nodes
        self._host_evictable = 0  # host pages of unlocked host-only nodes

    # ---- sizes ----

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def protected_pages(self) -> int:
        return self._protected

    @property
    def cached_pages(self) -> int:
        return self._evictable + self._protected

    @property
    def host_cached_pages(self) -> int:
        return self._host_cached

    @property
    def host_evictable_pages(self) -> int:
        return self._host_evictable

    def stats(self) -> dict:
        return {
            "nodes": self._num_nodes,
            "cached_pages": self.cached_pages,
            "evictable_pages": self._evictable,
            "protected_pages": self._protected,
        }

    # ---- match / insert ----

    def _child_key(self, key_bytes: bytes) -> bytes:
        """The children-dict key of an edge: the bytes of its first token / first page."""
        return key_bytes[: self._key_step]

    def _slot(self, node: TreeNode) -> bytes | str:
        """The key `node` is filed under in its parent's children."""
        if node.namespace is not None:
            return node.namespace
        return node.key_bytes[: self._key_step]

    def _namespace_node(self, namespace: str | None, create: bool) -> TreeNode | None:
        """Where a walk in `namespace` starts: the root for the public namespace, else the
        namespace's node (made when `create`; None when it does not exist)."""
        if namespace is None:
            return self.root
        if not isinstance(namespace, str):
            raise TypeError(f"a namespace is a str or None, got {type(namespace).__name__}")
        node = self.root.children.get(namespace)
        if node is None and create:
            node = TreeNode(b"", _EMPTY, self.root, next(self._ids))
            node.namespace = namespace
            self.root.children[namespace] = node
            self.root.dev_children += 1
            self._num_nodes += 1
        return node

    def _tick_root(self) -> None:
        """What a walk that finds no namespace node does: one clock tick, the root stamped."""
        self._clock += 1
        self.root.last_access = self._clock

    def match_prefix(self, tokens, namespace: str | None = None) -> MatchResult:
        """Longest cached page-aligned prefix of `tokens` in `namespace` (None: the public one).
        Refreshes LRU on the path and splits the last node when the match ends inside its edge,
        so `node` ends exactly at `length`."""
        if self.disable:
            return MatchResult(_EMPTY, 0, self.root)
        tokens = _as_tokens(tokens)
        start = self._namespace_node(namespace, create=False)
        if start is None:
            self._tick_root()
            return MatchResult(_EMPTY, 0, self.root)
        node, length, pages, _ = self._walk(tokens, len(tokens) // self.page_size, start)
        self._push_if_evictable_leaf(node)
        if self.host_allocator is None or node.on_device:
            if not pages:
                return MatchResult(_EMPTY, 0, node, 0, node)
            return MatchResult(_join(pages), length, node, 0, node)
        # the match ends on the host: `pages` are the device run, then empty arrays
        self._push_host_leaf(node)
        dev = node
        while not dev.on_device:
            dev = dev.parent
        self._push_if_evictable_leaf(dev)
        dev_pages = [p for p in pages if len(p)]
        dev_len = sum(len(p) for p in dev_pages) * self.page_size
        joined = _join(dev_pages) if dev_pages else _EMPTY
        return MatchResult(joined, dev_len, dev, length - dev_len, node)

    def insert(self, tokens, pages, namespace: str | None = None) -> InsertResult:
        """Cache the page-aligned part of `tokens` whose KV is in `pages`
        (len(pages) == len(tokens) // page_size) in `namespace`. Takes ownership of the pages
        past the already-cached prefix; returns that prefix's length. Never frees pages."""
        tokens = _as_tokens(tokens)
        pages = np.asarray(pages, dtype=np.int32).reshape(-1)
        ps = self.page_size
        num_pages = len(tokens) // ps
        if len(pages) != num_pages:
            raise ValueError(f"{len(tokens)} tokens need {num_pages} pages, got {len(pages)}")
        if self.disable:
            return InsertResult(num_pages * ps, self.root)  # all "duplicates": the caller frees
        # NOTE: an empty insert does not make a namespace node (it would hold nothing)
        start = self._namespace_node(namespace, create=num_pages > 0)
        if start is None:
            self._tick_root()
            return InsertResult(0, self.root)
        node, walked, _, query = self._walk(tokens, num_pages, start)
        prefix_len = walked
        if not node.on_device:
            # the walk ran on into host-only nodes: they take the caller's pages (its KV is the
            # same) and count as new, so the caller keeps them instead of freeing duplicates
            prefix_len = walked - self._to_device(node, pages[: walked // ps], copy=False)
        if walked < num_pages * ps:
            new_pages = pages[walked // ps :].copy()
            new_pages.flags.writeable = False
            leaf = TreeNode(query[4 * walked :], new_pages, node, next(self._ids))
            leaf.last_access = self._clock
            node.children[self._child_key(leaf.key_bytes)] = leaf
            node.dev_children += 1
            self._num_nodes += 1
            self._evictable += len(new_pages)
            node = leaf
            if self.write_through and self._write_to_host(leaf):
                self._push_copy(leaf)
        self._push_if_evictable_leaf(node)
        return InsertResult(prefix_len, node)

    # ---- the host tier ----

    def load_back(self, node: TreeNode, pages) -> int:
        """Give the host-only nodes on the path to `node` (locked by the caller) the device
        `pages` (one per page of those nodes, top-down) and queue their host-to-device copies.
        Returns the tokens loaded."""
        if node.lock_ref <= 0:
            raise RuntimeError(f"load_back of an unlocked node {node!r}")
        pages = np.asarray(pages, dtype=np.int32).reshape(-1)
        want = self._host_only_pages(node)
        if len(pages) != want:
            raise ValueError(f"the host-only path to {node!r} needs {want} pages, got {len(pages)}")
        # NOTE: the pages go at the end of a path whose device run comes first: pad the front
        return self._to_device(node, pages, copy=True, tail=True)

    def _host_only_path(self, node: TreeNode) -> list[TreeNode]:
        """The host-only nodes from the first one below the device run down to `node`."""
        path = []
        while not node.on_device:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def _host_only_pages(self, node: TreeNode) -> int:
        return sum(len(n.host_pages) for n in self._host_only_path(node))

    def _to_device(self, node: TreeNode, pages: np.ndarray, copy: bool, tail: bool = False) -> int:
        """Put the host-only path ending at `node` on the device in `pages` (the whole path's
        pages, or with `tail` only the host-only part's); queue the copies when `copy`.
        Returns the tokens put on the device."""
        path = self._host_only_path(node)
        total = sum(len(n.host_pages) for n in path)
        off = 0 if tail else len(pages) - total
        for n in path:
            k = len(n.host_pages)
            dev = pages[off : off + k].copy()
            dev.flags.writeable = False
            off += k
            n.pages = dev
            n.parent.dev_children += 1
            if n.lock_ref:
                self._protected += k
            else:
                self._evictable += k
                self._host_evictable -= k
            if copy:
                self._loads.append(Copy(n.host_pages, dev))
                n.load_pending = True  # its host copy stays until the load is taken
                self._loading.append(n)
            else:
                self._push_copy(n)
            if self.on_tier is not None:
                self.on_tier("loaded", n.host_pages, dev)
        for n in path:
            self._push_if_evictable_leaf(n)
        return total * self.page_size

    def _write_to_host(self, node: TreeNode) -> bool:
        """Make sure the device node `node` has a host copy (queueing the write); False when the
        host pool has no room even after host eviction."""
        if node.host_pages is not None:
            return True
        n = len(node.pages)
        host = self.host_allocator
        if host.free_pages < n:
            self.evict_host(n - host.free_pages)
        got = host.alloc(n)
        if got is None:
            return False
        got.flags.writeable = False
        node.host_pages = got
        self._host_cached += n
        self._writes.append(Copy(node.pages, got))
        return True

    def take_copies(self) -> PendingCopies:
        out = PendingCopies(self._writes, self._loads, self._writes_block and bool(self._writes))
        self._writes, self._loads, self._writes_block = [], [], False
        loading, self._loading = self._loading, []
        for n in loading:
            n.load_pending = False
            self._push_copy(n)
        return out

    def _push_copy(self, node: TreeNode) -> None:
        """File a node that is on both tiers in the heap of droppable host copies (once)."""
        if node.in_copy_heap or node.host_pages is None or not len(node.pages):
            return
        if node.parent is None:
            return
        node.in_copy_heap = True
        heapq.heappush(self._copy_heap, (node.last_access, node.id, node))
        if len(self._copy_heap) > self._copy_heap_limit:
            live = []
            for entry in self._copy_heap:
                n = entry[2]
                if n.parent is not None and n.host_pages is not None and len(n.pages):
                    live.append(entry)
                else:
                    n.in_copy_heap = False
            heapq.heapify(live)
            self._copy_heap = live
            self._copy_heap_limit = max(1024, 2 * len(live))

    def _push_host_leaf(self, node: TreeNode) -> None:
        if node.children or node.lock_ref or node.on_device or node.parent is None:
            return
        if node.host_heap_time == node.last_access:
            return
        node.host_heap_time = node.last_access
        heapq.heappush(self._host_heap, (node.last_access, node.id, node))
        if len(self._host_heap) > self._host_heap_limit:
            self._host_heap = _live_entries(
                self._host_heap, self._host_entry_is_live, "host_heap_time"
            )
            self._host_heap_limit = max(1024, 2 * len(self._host_heap))

    @staticmethod
    def _host_entry_is_live(t: int, node: TreeNode) -> bool:
        return (
            t == node.last_access
            and node.lock_ref == 0
            and not node.children
            and node.parent is not None
            and not node.on_device
        )

    def evict_host(self, num_pages: int) -> int:
        """Free at least `num_pages` host pages (or as many as possible): first the LRU host
        copies of unlocked nodes that are also on the device (without a queued load from them;
        the nodes stay, on the device), then LRU unlocked host-only leaves, which leave the tree,
        cascading upwards. Returns how many were freed."""
        freed = 0
        copies: list[np.ndarray] = []
        heap = self._copy_heap
        while freed < num_pages and heap:
            t, _, node = heapq.heappop(heap)
            node.in_copy_heap = False
            if node.parent is None or node.host_pages is None or not len(node.pages):
                continue  # left the tree or a tier; filed again when on both again
            if node.lock_ref or node.load_pending:
                continue  # filed again by unlock / take_copies
            if t != node.last_access:  # used since: its place is further down
                node.in_copy_heap = True
                heapq.heappush(heap, (node.last_access, node.id, node))
                continue
            k = len(node.host_pages)
            self._host_cached -= k
            freed += k
            copies.append(node.host_pages)
            node.host_pages = None
        if copies:
            self.host_allocator.free(_join(copies))
        heap = self._host_heap
        released: list[np.ndarray] = []
        while freed < num_pages and heap:
            t, _, node = heapq.heappop(heap)
            if t == node.host_heap_time:
                node.host_heap_time = -1
            if not self._host_entry_is_live(t, node):
                continue
            parent = node.parent
            del parent.children[self._slot(node)]
            node.parent = None
            self._num_nodes -= 1
            k = len(node.host_pages)
            self._host_evictable -= k
            self._host_cached -= k
            freed += k
            released.append(node.host_pages)
            self._push_host_leaf(parent)
            self._push_if_evictable_leaf(parent)  # a namespace node may now be empty
        if released:
            pages = _join(released)
            self.host_allocator.free(pages)
            if self.on_tier is not None:
                self.on_tier("evicted_host", pages, None)
        return freed

    def _walk(self, tokens: np.ndarray, num_pages: int, start: TreeNode):
        """Follow the first `num_pages` pages of `tokens` down the tree from `start` (the root or
        a namespace node), stamping the path with a new clock value and splitting the last edge
        if the match ends inside it.
        Returns (deepest node, matched tokens, pages per matched edge, the query's bytes)."""
        ps = self.page_size
        step = self._key_step
        self._clock += 1
        now = self._clock
        self.root.last_access = now
        node = start
        node.last_access = now
        pages: list[np.ndarray] = []
        # NOTE: positions are byte offsets into `query` (4 bytes a token): whole-edge compares
        # are bytes.startswith (a memcmp), child lookups hash a bytes slice.
        query = tokens[: num_pages * ps].tobytes()
        end = len(query)
        off = 0
        while off < end:
            child = node.children.get(query[off : off + step])
            if child is None:
                break
            key_len = len(child.key_bytes)
            if query.startswith(child.key_bytes, off):
                matched = key_len  # the common case: the whole edge matches
            else:
                # Find the first differing token; the child key guarantees that the first
                # token / page matches, so argmax() == 0 means "none differ".
                pos, m = off // 4, min(key_len, end - off) // 4
                first = int((child.key[:m] != tokens[pos : pos + m]).argmax())
                matched = 4 * (m if first == 0 else first // ps * ps)
                child = self._split(child, matched // 4)
            child.last_access = now
            pages.append(child.pages)
            off += matched
            node = child
            if matched < key_len:
                break
        return node, off // 4, pages, query

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut `child`'s edge after `at` tokens (page-aligned); return the new upper node.
        Sizes, lock counts and heap entries stay valid: the lower part keeps its identity."""
        ps = self.page_size
        cut = 4 * at
        upper = TreeNode(
            child.key_bytes[:cut], child.pages[: at // ps], child.parent, next(self._ids)
        )
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.dev_children = 1 if child.on_device else 0
        if child.host_pages is not None:
            upper.host_pages = child.host_pages[: at // ps]
            child.host_pages = child.host_pages[at // ps :]
            upper.load_pending = child.load_pending
            if upper.load_pending:
                self._loading.append(upper)
        child.key_bytes = child.key_bytes[cut:]
        child.key = np.frombuffer(child.key_bytes, dtype=np.int32)
        child.pages = child.pages[at // ps :]
        child.parent.children[self._child_key(upper.key_bytes)] = upper
        upper.children[self._child_key(child.key_bytes)] = child
        child.parent = upper
        self._num_nodes += 1
        if upper.host_pages is not None:
            self._push_copy(upper)
        return upper

    # ---- locks ----

    def lock(self, node: TreeNode) -> None:
        """Protect the path node..root (root excluded) from eviction."""
        if node is self.root:
            return
        if node.parent is None:
            raise ValueError(f"lock of an evicted node {node!r}")
        while node is not self.root:
            if node.lock_ref == 0:
                size = len(node.pages)
                self._evictable -= size
                self._protected += size
                if not size and node.host_pages is not None:
                    self._host_evictable -= len(node.host_pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        if node is self.root:
            return
        # NOTE: a parent's lock_ref >= its child's, so checking the start checks the whole path.
        if node.lock_ref <= 0:
            raise RuntimeError(f"unlock of an unlocked node {node!r}")
        start = node
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                size = len(node.pages)
                self._protected -= size
                self._evictable += size
                if node.host_pages is not None:
                    if size:
                        self._push_copy(node)  # its host copy may be dropped again
                    else:
                        self._host_evictable += len(node.host_pages)
            node = node.parent
        self._push_if_evictable_leaf(start)  # only the start can be a leaf
        if start.host_pages is not None:
            self._push_host_leaf(start)
            node = start
            while not node.on_device:  # the device run's last node may now be evictable
                node = node.parent
            self._push_if_evictable_leaf(node)

    # ---- eviction ----

    def _push_if_evictable_leaf(self, node: TreeNode) -> None:
        """Push `node` if it is an unlocked *device leaf*: on the device, none of its children on
        the device (with one tier: a leaf)."""
        if node.dev_children or node.lock_ref or node is self.root or not node.on_device:
            return
        if node.namespace is not None and node.children:
            return  # a namespace node goes when its last (host-only) child has gone
        if node.heap_time == node.last_access:
            return  # its live entry is already in the heap
        node.heap_time = node.last_access
        heapq.heappush(self._heap, (node.last_access, node.id, node))
        if len(self._heap) > self._heap_limit:
            self._compact_heap()

    @staticmethod
    def _entry_is_live(t: int, node: TreeNode) -> bool:
        return (
            t == node.last_access
            and node.lock_ref == 0
            and node.dev_children == 0
            and node.parent is not None
            and node.on_device
            and not (node.namespace is not None and node.children)
        )

    def _compact_heap(self) -> None:
        self._heap = _live_entries(self._heap, self._entry_is_live, "heap_time")
        self._heap_limit = max(1024, 2 * len(self._heap))

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` device pages (whole nodes, so possibly a few more), or as
        many as possible; return how many were freed. LRU unlocked device leaves first,
        cascading upwards. With a host tier a node is kept on the host (written there first if
        it has no host copy) and leaves the tree only when the host pool has no room."""
        heap = self._heap
        freed = 0
        released: list[np.ndarray] = []  # device pages of nodes that left the tree
        offloaded: list[np.ndarray] = []  # device pages of nodes kept on the host
        while freed < num_pages and heap:
            t, _, node = heapq.heappop(heap)
            if t == node.heap_time:
                node.heap_time = -1
            if not self._entry_is_live(t, node):
                continue
            parent = node.parent
            size = len(node.pages)
            self._evictable -= size
            freed += size
            if (
                self.host_allocator is not None
                and node.namespace is None
                and self._write_to_host(node)
            ):
                offloaded.append(node.pages)
                if self.on_tier is not None:
                    self.on_tier("offloaded", node.pages, node.host_pages)
                node.pages = _EMPTY
                parent.dev_children -= 1
                self._host_evictable += len(node.host_pages)
                self._push_host_leaf(node)
            else:
                released.append(node.pages)
                self._remove(node)
            self._push_if_evictable_leaf(parent)
        if offloaded or released:
            self._writes_block = True
            self.allocator.free(_join(offloaded + released))
        if released and self.on_evict is not None:
            self.on_evict(_join(released))
        return freed

    def _remove(self, node: TreeNode) -> None:
        """Take an unlocked device node out of the tree, with its host-only subtree (whose host
        pages are freed)."""
        parent = node.parent
        del parent.children[self._slot(node)]
        node.parent = None
        parent.dev_children -= 1
        self._num_nodes -= 1
        host: list[np.ndarray] = []
        if node.host_pages is not None:
            self._host_cached -= len(node.host_pages)
            host.append(node.host_pages)
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            n.parent = None
            self._num_nodes -= 1
            k = len(n.host_pages)
            self._host_cached -= k
            self._host_evictable -= k
            host.append(n.host_pages)
        if host:
            pages = _join(host)
            self.host_allocator.free(pages)
            if self.on_tier is not None:
                self.on_tier("evicted_host", pages, None)

    def set_evict_observer(self, on_evict) -> None:
        """`on_evict(page_ids)` after every eviction (KV-cache events, kv_events.py)."""
        self.on_evict = on_evict

    def set_tier_observer(self, on_tier) -> None:
        """`on_tier(kind, src, dst)` when KV moves between the tiers without leaving the cache
        ("offloaded": device pages `src` now live in host pages `dst`; "loaded": host pages `src`
        have device pages `dst` too) and when host pages leave it ("evicted_host", `src`)."""
        self.on_tier = on_tier

    def reset(self) -> None:
        """Drop the whole cache, freeing its pages. Only legal while nothing is locked."""
        if self._protected or any(c.lock_ref for c in self.root.children.values()):
            raise RuntimeError("reset of the radix cache while nodes are locked")
        nodes = self._nodes()
        pages = [node.pages for node in nodes if len(node.pages)]
        host = [node.host_pages for node in nodes if node.host_pages is not None]
        for node in nodes:
            node.parent = None
        if pages:
            self.allocator.free(_join(pages))
        if host:
            self.host_allocator.free(_join(host))
        self._new_tree()

    # ---- debugging ----

    def _nodes(self) -> list[TreeNode]:
        """Every node except the root, parents before children."""
        out: list[TreeNode] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def check_integrity(
        self, expect_unlocked: bool = False, held_pages: np.ndarray | None = None
    ) -> None:
        """Raise AssertionError unless the tree, its counters, the evictable-leaf heap and the
        allocator agree. `held_pages`: pages owned by running requests outside the tree (then
        free + cached + held == total); omit it when the scheduler is idle."""
        ps = self.page_size
        root = self.root
        assert root.parent is None and len(root.key) == 0 and len(root.pages) == 0, "bad root"
        assert root.lock_ref == 0, f"root lock_ref {root.lock_ref} != 0"
        if self.disable:
            assert not root.children, "disabled cache holds nodes"
        nodes = self._nodes()
        assert len(nodes) == self._num_nodes, f"node count {self._num_nodes} != {len(nodes)}"
        evictable = protected = host_evictable = 0
        leaves = set()
        host_leaves = set()
        host_pages: list[np.ndarray] = []
        assert root.dev_children == sum(1 for c in root.children.values() if c.on_device), (
            "root dev_children"
        )
        for node in nodes:
            parent = node.parent
            name = repr(node)
            assert parent is not None, f"{name} in the tree has no parent"
            assert node.key.dtype == np.int32 and node.pages.dtype == np.int32, f"{name} dtype"
            if node.namespace is not None:
                assert parent is root, f"namespace node {name} is not a child of the root"
                assert len(node.key) == 0 and len(node.pages) == 0, f"{name} holds tokens"
                assert root.children.get(node.namespace) is node, f"{name} not under its name"
            else:
                assert len(node.key) > 0, f"empty non-root node {name}"
                assert parent.children.get(self._child_key(node.key_bytes)) is node, (
                    f"{name} is not under its first {'token' if ps == 1 else 'page'} in its parent"
                )
            assert len(node.key) % ps == 0, f"{name} key is not page-aligned"
            on_device = node.on_device
            if node.host_pages is not None:
                assert self.host_allocator is not None, f"{name} on the host without a host tier"
                assert len(node.host_pages) == len(node.key) // ps, f"{name} host pages mismatch"
                host_pages.append(node.host_pages)
                if not on_device and node.lock_ref == 0:
                    host_evictable += len(node.host_pages)
            else:
                assert on_device, f"{name} is in neither tier"
            if on_device:
                assert len(node.pages) == len(node.key) // ps, f"{name} pages/key length mismatch"
                assert parent.on_device, f"{name} is on the device, its parent is not"
            dev_children = sum(1 for c in node.children.values() if c.on_device)
            assert node.dev_children == dev_children, f"{name} dev_children != {dev_children}"
            if not on_device and node.lock_ref == 0 and not node.children:
                host_leaves.add(node)
            assert node.key.tobytes() == node.key_bytes, f"{name} key and key_bytes differ"
            assert node.lock_ref >= 0, f"{name} negative lock_ref"
            assert node.last_access <= parent.last_access, f"{name} accessed after its parent"
            child_locks = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= child_locks, (
                f"{name} lock_ref {node.lock_ref} < its children's {child_locks}"
            )
            if expect_unlocked:
                assert node.lock_ref == 0, f"{name} still locked"
            if node.lock_ref:
                protected += len(node.pages)
            else:
                evictable += len(node.pages)
                if (
                    on_device
                    and node.dev_children == 0
                    and (node.namespace is None or not node.children)
                ):
                    leaves.add(node)
        assert evictable == self._evictable, f"evictable {self._evictable} != recount {evictable}"
        assert protected == self._protected, f"protected {self._protected} != recount {protected}"

        live = set()
        for t, _, node in self._heap:
            if self._entry_is_live(t, node):
                assert node not in live, f"{node!r} has two live heap entries"
                assert t == node.heap_time, f"{node!r} live heap entry not its newest"
                live.add(node)
        assert live == leaves, (
            f"evictable-leaf heap holds {len(live)} live nodes, tree has {len(leaves)} "
            f"unlocked leaves (missing {len(leaves - live)}, extra {len(live - leaves)})"
        )

        check_page_ownership(
            self.allocator, self._evictable, self._protected, [n.pages for n in nodes], held_pages
        )
        if self.host_allocator is not None:
            live = {n for t, _, n in self._host_heap if self._host_entry_is_live(t, n)}
            assert live == host_leaves, (
                f"host heap holds {len(live)} live nodes, tree has {len(host_leaves)} host leaves"
            )
            cached = sum(len(p) for p in host_pages)
            assert cached == self._host_cached, f"host cached {self._host_cached} != {cached}"
            assert host_evictable == self._host_evictable, (
                f"host evictable {self._host_evictable} != recount {host_evictable}"
            )
            check_page_ownership(self.host_allocator, cached, 0, host_pages, None)
            self._check_copy_heap(nodes)

    def _check_copy_heap(self, nodes: list[TreeNode]) -> None:
        """Every unlocked node on both tiers without a queued load is in the heap of droppable
        host copies, with exactly one entry (and every entry's node says it has one)."""
        entries: dict[int, int] = {}
        for _, _, n in self._copy_heap:
            assert n.in_copy_heap, f"{n!r} in the host-copy heap without its flag"
            entries[id(n)] = entries.get(id(n), 0) + 1
        assert all(c == 1 for c in entries.values()), "a node has two host-copy heap entries"
        loading = {id(n) for n in self._loading}
        for n in nodes:
            if n.load_pending:
                assert id(n) in loading, f"{n!r} waits for a load that is not queued"
            if n.in_copy_heap:
                assert id(n) in entries, f"{n!r} flagged but not in the host-copy heap"
            elif n.host_pages is not None and len(n.pages) and not n.lock_ref:
                assert n.load_pending, f"{n!r} is on both tiers, not in the host-copy heap"

    def dump(self) -> list[tuple]:
        """The state as plain data: (id, parent id, tokens, pages, lock_ref, last_access, namespace)
        per node (namespace: the name of a namespace node, else None), sorted by id. Two trees driven alike dump equal (the C++ twin's differential test).
        Works on any tree with this node interface (CppRadixCache reuses it)."""
        out = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            key, pages = tuple(node.key.tolist()), tuple(node.pages.tolist())
            out.append(
                (
                    node.id,
                    node.parent.id,
                    key,
                    pages,
                    node.lock_ref,
                    node.last_access,
                    node.namespace,
                )
            )
            stack.extend(node.children.values())
        return sorted(out)

    def pretty(self, max_tokens: int = 8) -> str:
        lines = [f"{type(self).__name__}(page_size={self.page_size}) {self.stats()}"]
        stack = [(child, 1) for child in sorted(self.root.children.values(), key=lambda c: -c.id)]
        while stack:
            node, depth = stack.pop()
            more = "..." if len(node.key) > max_tokens else ""
            if node.namespace is not None:
                lines.append(
                    f"{'  ' * depth}#{node.id} namespace {node.namespace!r} "
                    f"lock={node.lock_ref} t={node.last_access}"
                )
            else:
                lines.append(
                    f"{'  ' * depth}#{node.id} {node.key[:max_tokens].tolist()}{more} "
                    f"({len(node.key)} tok) pages={node.pages[:4].tolist()}"
                    f"{'...' if len(node.pages) > 4 else ''} lock={node.lock_ref} t={node.last_access}"
                )
            stack.extend(
                (c, depth + 1) for c in sorted(node.children.values(), key=lambda c: -c.id)
            )
        return "\n".join(lines)


def check_page_ownership(
    allocator: PageAllocator,
    evictable: int,
    protected: int,
    tree_pages: list[np.ndarray],
    held_pages: np.ndarray | None,
) -> None:
    """The allocator side of a tree's check_integrity (shared with the C++ twin): every page is
    free, cached in the tree (`tree_pages`) or held by a running request, exactly once."""
    held = _EMPTY if held_pages is None else np.asarray(held_pages, dtype=np.int32)
    free = allocator.free_page_ids()
    assert allocator.free_pages + evictable + protected + len(held) == allocator.total_pages, (
        f"free {allocator.free_pages} + evictable {evictable} + protected "
        f"{protected} + held {len(held)} != total {allocator.total_pages}"
    )
    every = np.concatenate([free, held, *tree_pages])
    assert every.size == 0 or (every.min() >= 1 and every.max() <= allocator.total_pages), (
        "a page id out of range (or the reserved page 0) is in use"
    )
    counts = np.bincount(every, minlength=allocator.num_pages)
    assert (counts[1:] == 1).all(), (
        f"pages not owned exactly once: {(np.flatnonzero(counts[1:] != 1) + 1)[:10].tolist()}"
    )


def _live_entries(heap: list, is_live, stamp: str) -> list:
    """A lazy LRU heap without its stale entries, as a heap again. A dropped entry that was its
    node's current one (the node's `stamp` attribute holds its time) clears that stamp, so the
    node is pushed anew when it next becomes evictable."""
    live = []
    for entry in heap:
        t, _, node = entry
        if is_live(t, node):
            live.append(entry)
        elif t == getattr(node, stamp):
            setattr(node, stamp, -1)
    heapq.heapify(live)
    return live
