"""KV bookkeeping: which pages and slots each request holds, and the radix tree they go to.

Pages are free (the allocator), cached in the tree, or owned by exactly one running request
(`Req.pages[Req.tree_pages:]`; `check_integrity` asserts it). They grow as a request computes
(`grow_pages`, evicting cached prefixes for a shortfall), go to the tree as a running request's
prefix is computed (`cache_unfinished`) and when it ends (`release`: the one place that frees a
request's pages). With the host tier (--enable-hierarchical-cache), a match that runs on into
host memory is loaded back when the cost model says loading beats recomputing (`lock_match`).
"""

from __future__ import annotations

import math

import numpy as np

from radix_runtime.config import ServerArgs
from radix_runtime.kv_events import KvEventLog
from radix_runtime.messages import (
    CacheStats,
    FlushCacheDone,
    ForwardBatch,
    ForwardResult,
    WorkerReady,
    pack_ids,
)
from radix_runtime.scheduler.allocator import PageAllocator
from radix_runtime.scheduler.cache import make_radix_cache
from radix_runtime.scheduler.radix_cache import RadixCache
from radix_runtime.scheduler.request import PageRow, Req
from radix_runtime.scheduler.stats import Counters
from radix_runtime.utils.runs import consecutive_runs

# The host tier's cost model (docs/hicache.md): loading n tokens costs LOAD_LATENCY_S +
# n * kv_bytes_per_token / load_bandwidth (measured by the worker at start); recomputing them
# costs n / prefill tokens-per-second (measured on prefill steps of at least
# PREFILL_SAMPLE_MIN_TOKENS tokens, an exponential average). Until a prefill was measured,
# loads are taken.
LOAD_LATENCY_S = 50e-6
PREFILL_SAMPLE_MIN_TOKENS = 32


class KvBook:
    """The page pool, the radix tree over it, the host tier, and the worker's request slots."""

    def __init__(
        self,
        args: ServerArgs,
        worker: WorkerReady,
        counters: Counters,
    ):
        self.counters = counters
        self.page_size = worker.page_size
        self.allocator = PageAllocator(worker.num_pages)
        # the host tier (--enable-hierarchical-cache): the worker sized and allocated its pool
        self.host_allocator = None
        if worker.host_num_pages > 1 and not args.disable_radix_cache:
            self.host_allocator = PageAllocator(worker.host_num_pages)
        self.kv_bytes_per_token = worker.kv_bytes_per_token
        self.load_bandwidth = worker.load_bandwidth
        self.prefill_tps = 0.0  # measured prefill tokens per second (the cost model's)
        self.cache = make_radix_cache(
            args.radix_tree_impl,
            self.page_size,
            self.allocator,
            disable=args.disable_radix_cache,
            host_allocator=self.host_allocator,
            write_through=args.hicache_write_policy == "write_through",
        )
        self.tree_impl = "python" if isinstance(self.cache, RadixCache) else "cpp"
        self.max_running = args.max_running_requests
        self.free_slots = list(range(self.max_running - 1, -1, -1))
        self.released_slots: list[int] = []
        # --kv-events-endpoint: what enters and leaves the tree, as events (kv_events.py)
        self.kv_events: KvEventLog | None = None
        if args.kv_events_endpoint and not self.cache.disable:
            self.kv_events = KvEventLog(self.page_size, args.dp_rank)
            self.cache.set_evict_observer(self.kv_events.evicted)
            if self.host_allocator is not None:
                self.cache.set_tier_observer(self.kv_events.tier_moved)

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.total_pages * self.page_size

    # -----------------------------------------------------------------------------------------
    # pages: the one place that frees a request's pages is release

    def available_pages(self) -> int:
        return self.allocator.free_pages + self.cache.evictable_pages

    def pages_needed(self, req: Req, kv_len: int) -> int:
        """Pages `req` still lacks to hold `kv_len` tokens."""
        return max(math.ceil(kv_len / self.page_size) - len(req.pages), 0)

    def grow_pages(self, req: Req, kv_len: int, reserve: int | None = None) -> bool:
        """Pages for `req` to hold `kv_len` tokens. With `reserve`, refuse (taking nothing) unless
        that many pages stay available after it, for the running decoders' next tokens."""
        need = self.pages_needed(req, kv_len)
        if reserve is not None and self.available_pages() - reserve < need:
            return False
        if need == 0:
            return True
        pages = self.take_pages(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def next_token_pages(self, rows: list[tuple[Req, int]]) -> int:
        """How many of `rows` (request, kv_len) need a new page for their next token."""
        return sum(1 for req, kv_len in rows if self.pages_needed(req, kv_len + 1) > 0)

    def grow_next_token(self, rows: list[tuple[Req, int]]) -> None:
        """A page for each of `rows` (request, kv_len) whose next token starts one, in one
        allocation (page size 1: every decoder, every step); counted as available before."""
        growing = [req for req, kv_len in rows if self.pages_needed(req, kv_len + 1) > 0]
        if growing:
            pages = self.take_pages(len(growing))
            assert pages is not None, "pages were counted as available"
            for req, page in zip(growing, pages.tolist()):
                req.pages.append(page)

    def take_pages(self, n: int) -> np.ndarray | None:
        """`n` free pages, evicting cached prefixes for the shortfall; None if there are not."""
        if self.allocator.free_pages < n:
            self.counters.evicted_pages += self.cache.evict(n - self.allocator.free_pages)
        return self.allocator.alloc(n)

    def admit(self, req: Req, match, budget: int, reserve: int) -> tuple[int, int] | None:
        """A waiting request's KV for its first step: `match` locked (loaded back from the host
        tier when that pays, `lock_match`), pages for its first chunk of at most `budget` tokens
        with `reserve` pages left available, and a slot. Returns the chunk's length and the
        tokens loaded from the host; None, with nothing taken, when the pages do not fit."""
        loaded = self.lock_match(req, match, budget, reserve)
        n = min(budget, req.remaining_fill)
        if not self.grow_pages(req, req.kv_len + n, reserve):
            self.cache.unlock(req.node)
            req.node, req.pages, req.tree_pages, req.kv_len = None, PageRow(), 0, 0
            return None
        req.slot = self.free_slots.pop()
        req.sent_pages = 0
        return n, loaded

    def lock_match(self, req: Req, match, budget: int, reserve: int) -> int:
        """Lock `match` for `req` and set its pages and kv_len. A match that runs on into the
        host tier is loaded back (device pages for it, the copies queued for the next batch)
        when the load beats recomputing and the pool has the pages for it and for the first
        chunk; else the request computes those tokens. Returns the tokens loaded."""
        ps = self.page_size
        host_len = match.host_length  # 0 without a host tier (either tree)
        if host_len:
            load_pages = host_len // ps
            kv_after = match.length + host_len
            first_chunk = min(budget, req.all_len - kv_after)
            chunk_pages = math.ceil((kv_after + first_chunk) / ps) - len(match.pages) - load_pages
            self.cache.lock(match.host_node)
            if self.load_pays(host_len) and (
                self.available_pages() - reserve >= load_pages + max(chunk_pages, 0)
            ):
                pages = self.take_pages(load_pages)
                assert pages is not None, "pages were counted as available"
                self.cache.load_back(match.host_node, pages)
                req.node = match.host_node
                req.pages = PageRow(np.concatenate([match.pages, pages]))
                req.tree_pages = len(req.pages)
                req.kv_len = match.length + host_len
                return host_len
            self.cache.unlock(match.host_node)
        self.cache.lock(match.node)
        req.node = match.node
        req.pages = PageRow(match.pages)
        req.tree_pages = len(req.pages)
        req.kv_len = match.length
        return 0

    def prefetch(self, req: Req, match, reserve: int) -> int:
        """--hicache-prefetch arrival: load a waiting request's host hit back now (device pages
        for it, the copies queued), when the load pays and `reserve` pages stay available after
        it. The loaded node stays locked for the request (`Req.prefetch_node`) until it is
        admitted (`drop_prefetch`). Returns the tokens loaded."""
        host_len = match.host_length
        if not host_len or req.prefetch_node is not None or not self.load_pays(host_len):
            return 0
        load_pages = host_len // self.page_size
        if self.available_pages() - reserve < load_pages:
            return 0
        self.cache.lock(match.host_node)
        pages = self.take_pages(load_pages)
        assert pages is not None, "pages were counted as available"
        self.cache.load_back(match.host_node, pages)
        req.prefetch_node, req.prefetched_tokens = match.host_node, host_len
        self.counters.host_prefetches += 1
        return host_len

    def drop_prefetch(self, req: Req) -> None:
        """Unlock what `prefetch` loaded for `req` (admitted: its own lock holds it now; aborted
        or memory pressure: the loaded nodes stay cached, evictable again)."""
        if req.prefetch_node is not None:
            self.cache.unlock(req.prefetch_node)
            req.prefetch_node, req.prefetched_tokens = None, 0

    def cache_unfinished(self, req: Req) -> None:
        """Put the computed prefix of a running request into the tree, so requests arriving now
        can share it, and swap the request's lock to the deeper node."""
        if self.cache.disable:
            return
        aligned = req.kv_len // self.page_size * self.page_size
        n_pages = aligned // self.page_size
        if n_pages <= req.tree_pages:
            return
        ids = req.ids_slice(0, aligned)
        res = self.cache.insert(ids, req.pages[:n_pages], req.namespace)
        if self.kv_events is not None:
            self.kv_events.stored(
                req.rid, ids, res.prefix_len, req.pages[:n_pages], namespace=req.namespace
            )
        dup_hi = res.prefix_len // self.page_size
        match = self.cache.match_prefix(ids, req.namespace)
        assert match.length == aligned, (match.length, aligned)
        if dup_hi > req.tree_pages:
            # someone else cached these tokens first: use their pages, free ours
            self.allocator.free(req.pages[req.tree_pages : dup_hi])
            req.pages[req.tree_pages : dup_hi] = match.pages[req.tree_pages : dup_hi]
            req.sent_pages = min(req.sent_pages, req.tree_pages)
        self.cache.lock(match.node)
        self.cache.unlock(req.node)
        req.node = match.node
        req.tree_pages = n_pages

    def release(self, req: Req) -> None:
        """Give a request's pages back: computed full pages to the tree, the rest to the free list."""
        if req.node is not None:
            aligned = req.kv_len // self.page_size * self.page_size
            n_pages = aligned // self.page_size
            ids = req.ids_slice(0, aligned)
            res = self.cache.insert(ids, req.pages[:n_pages], req.namespace)
            if self.kv_events is not None:
                pages = req.pages[:n_pages]
                self.kv_events.stored(
                    req.rid, ids, res.prefix_len, pages, done=True, namespace=req.namespace
                )
            dup_hi = min(res.prefix_len // self.page_size, n_pages)
            if dup_hi > req.tree_pages:
                self.allocator.free(req.pages[req.tree_pages : dup_hi])
            if len(req.pages) > n_pages:
                self.allocator.free(req.pages[n_pages:])
            self.cache.unlock(req.node)
        elif req.pages:
            self.allocator.free(req.pages.view())
        req.node, req.pages, req.tree_pages, req.kv_len, req.sent_pages = None, PageRow(), 0, 0, 0
        if req.slot is not None:
            self.released_slots.append(req.slot)
            self.free_slots.append(req.slot)
            req.slot = None
        req.slot_started = False

    # -----------------------------------------------------------------------------------------
    # slots: the worker's per-request rows (page table, sampling state)

    def take_released_slots(self) -> list[int]:
        """Slots freed since the last batch (the worker forgets their sampling state)."""
        slots, self.released_slots = self.released_slots, []
        return slots

    # -----------------------------------------------------------------------------------------
    # the host tier

    def attach_copies(self, batch: ForwardBatch) -> None:
        """The host tier's copies the tree queued since the last batch: the worker makes them
        before this step's model runs (writes, then loads), so a load is in place before any
        step reads it and a write has read its device pages before a step reuses them."""
        copies = self.cache.take_copies()
        page_bytes = self.page_size * self.kv_bytes_per_token
        totals = self.counters
        if copies.writes:
            src = np.concatenate([c.src for c in copies.writes])
            batch.write_src = pack_ids(src)
            dst = np.concatenate([c.dst for c in copies.writes])
            batch.write_dst = pack_ids(dst)
            batch.writes_block = copies.writes_block
            totals.host_written_bytes += len(src) * page_bytes
            totals.host_write_runs += host_page_runs(dst)
            totals.host_write_steps += 1
        if copies.loads:
            src = np.concatenate([c.src for c in copies.loads])
            batch.load_src = pack_ids(src)
            batch.load_dst = pack_ids(np.concatenate([c.dst for c in copies.loads]))
            totals.host_loads += len(copies.loads)
            totals.host_loaded_bytes += len(src) * page_bytes
            totals.host_load_runs += host_page_runs(src)
            totals.host_load_steps += 1

    def load_pays(self, tokens: int) -> bool:
        """Whether loading `tokens` tokens from the host is faster than computing them."""
        if self.prefill_tps <= 0 or self.load_bandwidth <= 0:
            return True
        load_s = LOAD_LATENCY_S + tokens * self.kv_bytes_per_token / self.load_bandwidth
        return load_s <= tokens / self.prefill_tps

    def observe_step(self, plan, result: ForwardResult) -> None:
        """Feed the cost model: prefill throughput of this step, and the loads' time."""
        self.counters.host_load_s += result.load_s
        self.counters.host_copy_wait_s += result.copy_wait_s
        self.counters.host_copy_issue_s += result.copy_issue_s
        self.counters.host_load_steps_waited += result.load_waited
        self.counters.host_write_steps_waited += result.write_waited
        tokens = sum(p.num_tokens for p in plan if p.num_tokens > 1)
        if tokens >= PREFILL_SAMPLE_MIN_TOKENS and result.forward_s > 0:
            tps = tokens / result.forward_s
            self.prefill_tps = tps if self.prefill_tps <= 0 else 0.8 * self.prefill_tps + 0.2 * tps

    # -----------------------------------------------------------------------------------------
    # control and introspection

    def flush_cache(self) -> FlushCacheDone:
        """Drop every unlocked node: the whole tree when idle; under load, what no running
        request holds (locked nodes stay and are reported as kept). This is LRU eviction of
        everything evictable, so it is safe between steps for the same reasons eviction is
        (see `Planner.schedule_ahead`): a running request's pages are locked or its own, and a
        freed page is handed out only by a batch built afterwards, which the worker runs after
        every step already sent. Waiting requests hold nothing; they match again when
        admitted."""
        cache = self.cache
        nodes = cache.stats()["nodes"]
        events_before = len(self.kv_events.pending) if self.kv_events is not None else 0
        dropped = cache.evict(cache.evictable_pages) if cache.evictable_pages else 0
        if self.host_allocator is not None:  # what eviction kept on the host goes too
            cache.evict_host(cache.host_evictable_pages)
        if self.kv_events is not None:
            self.kv_events.flushed(events_before)
        return FlushCacheDone(
            ok=True,
            dropped_nodes=nodes - cache.stats()["nodes"],
            dropped_pages=dropped,
            dropped_tokens=dropped * self.page_size,
            kept_pages=cache.protected_pages,
        )

    def cache_stats(self) -> CacheStats:
        c = self.counters
        prompt = c.prompt_tokens_total
        return CacheStats(
            total_pages=self.allocator.total_pages,
            free_pages=self.allocator.free_pages,
            evictable_pages=self.cache.evictable_pages,
            protected_pages=self.cache.protected_pages,
            page_size=self.page_size,
            hit_rate=c.cached_tokens_total / prompt if prompt else 0.0,
            cached_tokens=c.cached_tokens_total,
            prompt_tokens=prompt,
            tree=self.tree_impl,
            **self._host_stats(),
        )

    def _host_stats(self) -> dict:
        host = self.host_allocator
        if host is None:
            return {}
        c = self.counters
        return dict(
            host_total_pages=host.total_pages,
            host_free_pages=host.free_pages,
            host_evictable_pages=self.cache.host_evictable_pages,
            host_cached_tokens=c.host_cached_tokens_total,
            host_loads=c.host_loads,
            host_loaded_bytes=c.host_loaded_bytes,
            host_written_bytes=c.host_written_bytes,
            host_load_s=c.host_load_s,
            host_recomputed_tokens=c.host_recomputed_tokens,
            host_load_bandwidth=self.load_bandwidth,
            host_load_runs=c.host_load_runs,
            host_write_runs=c.host_write_runs,
            host_copy_wait_s=c.host_copy_wait_s,
            host_copy_issue_s=c.host_copy_issue_s,
            host_load_steps=c.host_load_steps,
            host_load_steps_waited=c.host_load_steps_waited,
            host_write_steps=c.host_write_steps,
            host_write_steps_waited=c.host_write_steps_waited,
            host_prefetches=c.host_prefetches,
            host_prefetches_dropped=c.host_prefetches_dropped,
            host_early_copies=c.host_early_copies,
        )

    def check_integrity(self, running: list[Req], prefetched: int = 0) -> None:
        """Every page is free, cached in the tree, or owned by exactly one running request; when
        idle (nothing running, no waiting request holding a prefetch: `prefetched` of them do),
        nothing is locked and every slot is free."""
        held = np.concatenate([np.zeros(0, np.int32)] + [r.pages[r.tree_pages :] for r in running])
        self.cache.check_integrity(expect_unlocked=not running and not prefetched, held_pages=held)
        assert len(self.free_slots) + len(running) == self.max_running, "slot leak"
        self.counters.integrity_checks += 1


def host_page_runs(host_pages: np.ndarray) -> int:
    """Runs of consecutive ids among a batch's host pages, in any order: the copies the worker
    makes for them (worker/host_pool.py sorts a batch by host page)."""
    return len(consecutive_runs(np.sort(host_pages))[0])
