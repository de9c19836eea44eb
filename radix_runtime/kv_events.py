"""KV-cache events: what enters and leaves a server's radix cache, for an external router that
keeps an exact index of every replica (schema and protocol: docs/scaling.md).

A *block* is one KV page (`page_size` tokens). It is named by a chained hash: 64 bits of
BLAKE2b over the parent block's hash and the block's token ids, so two servers (or a router
that tokenizes a prompt itself) name the same prefix the same way:

    block_hash(parent, tokens) = int.from_bytes(blake2b(parent.to_bytes(8, "little")
                                   + int32-little-endian(tokens), digest_size=8), "little")

with parent = root_hash(namespace) for a prefix's first block (0 for the public namespace).

On the wire (ZeroMQ PUB, multipart): [b"kv-events", seq as 8 bytes big-endian, EventBatch as
msgpack]. A subscriber that joins late or sees a gap in `seq` asks the replay socket (ROUTER)
for a Snapshot: every block cached now, parents first, and the `seq` of the last batch it
includes; it applies the batches after that one.

This module holds the schema, the hash, `KvEventLog` (the scheduler's side: a mirror of the
tree at page granularity that turns inserts and evictions into events) and `KvIndex` (a
subscriber's side, used by the tests and usable by a router).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable

import msgspec
import numpy as np

TOPIC = b"kv-events"
SNAPSHOT_REQUEST = b"snapshot"


class BlockStored(msgspec.Struct, tag="stored", tag_field="type"):
    """Blocks that entered the cache: a chain, each the child of the one before it, the first
    the child of `parent_block_hash` (None: it starts at the namespace's root)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]  # len(block_hashes) * page_size tokens
    page_size: int
    namespace: str | None = None  # the cache salt / tenant the blocks belong to


class BlockRemoved(msgspec.Struct, tag="removed", tag_field="type"):
    """Blocks that left the cache (evicted or flushed); never a parent of a block still cached."""

    block_hashes: list[int]


class AllBlocksCleared(msgspec.Struct, tag="cleared", tag_field="type"):
    """The cache is empty (a flush with nothing running)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct):
    seq: int  # 0, 1, 2, ... per server; a gap means batches were lost: ask for a snapshot
    ts: float  # unix time
    dp_rank: int  # the replica that sent it (--dp-rank)
    events: list[Event]


class Snapshot(msgspec.Struct):
    seq: int  # the last batch already applied here; -1 before the first
    dp_rank: int
    page_size: int
    blocks: list[BlockStored]  # one block each, parents before children


_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(EventBatch)
_snapshot_decoder = msgspec.msgpack.Decoder(Snapshot)


def encode(obj: EventBatch | Snapshot) -> bytes:
    return _encoder.encode(obj)


def decode_batch(data: bytes) -> EventBatch:
    return _batch_decoder.decode(data)


def decode_snapshot(data: bytes) -> Snapshot:
    return _snapshot_decoder.decode(data)


def _h(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def root_hash(namespace: str | None) -> int:
    return 0 if namespace is None else _h(b"namespace:" + namespace.encode())


def block_hash(parent: int, tokens: np.ndarray) -> int:
    return _h(parent.to_bytes(8, "little") + np.ascontiguousarray(tokens, dtype="<i4").tobytes())


def chain_hashes(tokens, page_size: int, namespace: str | None = None, start: int = 0,
                 parents: list[int] | None = None) -> list[int]:  # fmt: skip
    """The hashes of the whole blocks of `tokens`; `parents` (the first `start` of them, already
    known) are extended in place and returned."""
    buf = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
    out = parents if parents is not None else []
    prev = out[start - 1] if start else root_hash(namespace)
    step, blake2b, from_bytes = 4 * page_size, hashlib.blake2b, int.from_bytes
    for b in range(start, len(buf) // step):  # block_hash, inlined: ~1 us a block
        data = prev.to_bytes(8, "little") + buf[b * step : (b + 1) * step]
        prev = from_bytes(blake2b(data, digest_size=8).digest(), "little")
        out.append(prev)
    return out


class _Block(msgspec.Struct):
    parent: int | None
    tokens: list[int]
    namespace: str | None
    page: int


class KvEventLog:
    """The scheduler's side. Mirrors the radix tree at page granularity (page id -> block) and
    queues the events of each change; `take_batch()` hands them over once per scheduler step.

    The scheduler reports `stored(...)` after each insert into the tree and the tree reports
    evicted page ids (its `on_evict` observer); nothing else changes what the tree holds."""

    def __init__(self, page_size: int, dp_rank: int = 0):
        self.page_size = page_size
        self.dp_rank = dp_rank
        self.seq = -1  # of the last batch taken
        self.pending: list[Event] = []
        self.by_page: dict[int, int] = {}  # page id -> block hash
        self.blocks: dict[int, _Block] = {}  # block hash -> block
        self._chains: dict[str, list[int]] = {}  # rid -> its tokens' block hashes so far

    # -- changes ----------------------------------------------------------------------------

    def stored(
        self,
        rid: str,
        tokens: np.ndarray,
        cached_before: int,
        pages: np.ndarray,
        namespace: str | None = None,
        done: bool = False,
    ) -> None:
        """`tokens` (page-aligned) were inserted; the first `cached_before` were in the tree
        already, `pages` (one per block of `tokens`) hold the rest from now on. `done`: the
        request releases its pages (its hash chain is dropped)."""
        ps = self.page_size
        first, last = cached_before // ps, len(tokens) // ps
        chain = self._chains.setdefault(rid, [])
        if last > len(chain):
            chain_hashes(tokens[: last * ps], ps, namespace, len(chain), chain)
        if last > first:
            hashes = chain[first:last]
            parent = chain[first - 1] if first else None
            block_tokens = tokens[first * ps : last * ps]
            for b, h in enumerate(hashes):
                page = int(pages[first + b])
                self.by_page[page] = h
                self.blocks[h] = _Block(
                    hashes[b - 1] if b else parent,
                    block_tokens[b * ps : (b + 1) * ps].tolist(),
                    namespace,
                    page,
                )
            self.pending.append(BlockStored(hashes, parent, block_tokens.tolist(), ps, namespace))
        if done:
            self._chains.pop(rid, None)

    def evicted(self, pages: Iterable[int]) -> None:
        hashes = []
        for page in np.asarray(pages).tolist():
            h = self.by_page.pop(page, None)
            if h is not None:
                del self.blocks[h]
                hashes.append(h)
        if hashes:
            self.pending.append(BlockRemoved(hashes))

    def tier_moved(self, kind: str, src: np.ndarray, dst: np.ndarray | None) -> None:
        """The host tier moved KV (RadixCache.set_tier_observer). A block on the host only is
        still cached (a match reaches it; it is loaded back), so moving between the tiers emits
        nothing: the mirror only re-keys the block from its device page to its host page
        (host page q is kept as -(q + 1)) and back. A block leaves the cache, with a
        BlockRemoved, when it leaves the host as well ("evicted_host")."""
        if kind == "evicted_host":
            self.evicted(-np.asarray(src, dtype=np.int64) - 1)
            return
        if kind == "offloaded":
            old, new = np.asarray(src).tolist(), (-np.asarray(dst, np.int64) - 1).tolist()
        else:  # "loaded"
            old, new = (-np.asarray(src, np.int64) - 1).tolist(), np.asarray(dst).tolist()
        for a, b in zip(old, new):
            h = self.by_page.pop(a, None)
            if h is not None:
                self.by_page[b] = h
                self.blocks[h].page = b

    def flushed(self, removed_from: int) -> None:
        """A flush ran; the events from index `removed_from` of `pending` are its removals.
        Emptied: they become one AllBlocksCleared."""
        if not self.blocks:
            del self.pending[removed_from:]
            self.pending.append(AllBlocksCleared())

    def forget(self, rid: str) -> None:
        self._chains.pop(rid, None)

    # -- output -----------------------------------------------------------------------------

    def take_batch(self) -> EventBatch | None:
        if not self.pending:
            return None
        self.seq += 1
        batch = EventBatch(self.seq, time.time(), self.dp_rank, self.pending)
        self.pending = []
        return batch

    def snapshot(self) -> Snapshot:
        """Every block cached as of the last batch taken (call it with nothing pending)."""
        ps = self.page_size
        return Snapshot(
            self.seq,
            self.dp_rank,
            ps,
            [
                BlockStored([h], b.parent, b.tokens, ps, b.namespace)
                for h, b in _parents_first(self.blocks)
            ],
        )


def _parents_first(blocks: dict[int, _Block]) -> list[tuple[int, _Block]]:
    children: dict[int | None, list[int]] = {}
    for h, b in blocks.items():
        children.setdefault(b.parent, []).append(h)
    out, stack = [], list(children.get(None, []))
    while stack:
        h = stack.pop()
        out.append((h, blocks[h]))
        stack.extend(children.get(h, []))
    return out


class KvIndex:
    """A subscriber's view of one server's cache: block hash -> (parent, tokens, namespace).
    `apply` raises ValueError on anything inconsistent (a gap in seq, a block stored under an
    unknown parent or not hashing its parent and tokens, the removal of an unknown block)."""

    def __init__(self) -> None:
        self.seq = -1
        self.blocks: dict[int, tuple[int | None, tuple[int, ...], str | None]] = {}

    def load(self, snap: Snapshot) -> None:
        self.blocks = {}
        for ev in snap.blocks:
            self._store(ev)
        self.seq = snap.seq

    def apply(self, batch: EventBatch) -> bool:
        """Apply a batch; False (ignored) for one the snapshot already holds."""
        if batch.seq <= self.seq:
            return False
        if batch.seq != self.seq + 1:
            raise ValueError(f"lost batches {self.seq + 1}..{batch.seq - 1}: take a snapshot")
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._store(ev)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    if h not in self.blocks:
                        raise ValueError(f"removal of unknown block {h:#x}")
                    del self.blocks[h]
            else:
                self.blocks.clear()
        self.seq = batch.seq
        return True

    def _store(self, ev: BlockStored) -> None:
        ps = ev.page_size
        parent = ev.parent_block_hash
        if parent is not None and parent not in self.blocks:
            raise ValueError(f"block stored under unknown parent {parent:#x}")
        for i, h in enumerate(ev.block_hashes):
            tokens = tuple(ev.token_ids[i * ps : (i + 1) * ps])
            expected = block_hash(root_hash(ev.namespace) if parent is None else parent,
                                  np.array(tokens, dtype=np.int32))  # fmt: skip
            if expected != h:
                raise ValueError(f"block {h:#x} does not hash its parent and tokens")
            self.blocks[h] = (parent, tokens, ev.namespace)
            parent = h

    def prefixes(self) -> set[tuple[int, ...]]:
        """Every cached block as the full token prefix it ends."""
        memo: dict[int | None, tuple[int, ...]] = {None: ()}

        def path(h: int) -> tuple[int, ...]:
            todo = []
            while h not in memo:  # iterative: chains of page_size 1 are thousands deep
                todo.append(h)
                h = self.blocks[h][0]  # a KeyError: a block whose parent left before it
            for g in reversed(todo):
                memo[g] = memo[self.blocks[g][0]] + self.blocks[g][1]
            return memo[todo[0]] if todo else memo[h]

        return {path(h) for h in self.blocks}


def tree_prefixes(dump: list[tuple], page_size: int) -> set[tuple[int, ...]]:
    """The same set from a radix tree's `dump()` (id, parent id, tokens, pages, ...): one prefix
    per page of every node."""
    by_id = {row[0]: row for row in dump}
    memo: dict[int, tuple[int, ...]] = {}

    def path(node_id: int) -> tuple[int, ...]:
        todo = []
        while node_id in by_id and node_id not in memo:  # not in by_id: the root
            todo.append(node_id)
            node_id = by_id[node_id][1]
        prefix = memo.get(node_id, ())
        for n in reversed(todo):
            prefix = memo[n] = prefix + tuple(by_id[n][2])
        return prefix

    out = set()
    for node_id, _, tokens, *_ in dump:
        full = path(node_id)
        start = len(full) - len(tokens)
        for end in range(start + page_size, len(full) + 1, page_size):
            out.add(full[:end])
    return out
