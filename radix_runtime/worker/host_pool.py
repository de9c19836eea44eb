"""The host tier's KV pages (docs/hicache.md): a second pool in host memory, and the copies
between it and the device pool that the scheduler asks for.

The pool is one tensor [num_pages, num_layers, 2 (K, V), page_size, kv_heads, head_dim], page
major: a host page is one contiguous block (every layer's K and V of its tokens), so a run of
consecutive host pages is one contiguous range. It is allocated once at start (pinned on CUDA,
at its exact size: `pinned_empty`)
and sized by --hicache-size or --hicache-ratio against the memory the machine has free. Page 0
is reserved, as in the device pool. On CUDA a staging buffer of whole pages
[chunk_pages, num_layers, 2, page_size, kv_heads, head_dim] (STAGING_BYTES at most) lives on
the device, allocated once: a batch's copies go through it chunk by chunk.

The worker only copies what it is told (`ForwardBatch.write_*`, `load_*`), before the step's
model runs. A batch's pairs are sorted by host page id, so each run of consecutive host pages
moves as one block. On CUDA every copy runs on ONE side stream, so copies run in the order they
were queued and no host thread ever waits for one:
- the steps still running when a batch's copies are queued (the overlap schedule: the step
  before) are known by the KV pages they read and write (`StepPages`, from the worker); every
  step before them is done (collected). A copy waits for the compute stream only when it
  touches one of their pages: a write when a running step writes a page it reads (the tree's
  pages hold KV computed by collected steps, so in practice never), a load when a running step
  reads or writes a page it fills (a page freed while the step before still ran: a request
  finished or aborted, its row in that step discarded). Otherwise the copies run while the
  step before computes.
- a write (device -> host) gathers the pages on the device into the staging buffer (page
  major; one kernel for every layer's K and V, kernels/page_copy.py) and copies each run of
  consecutive host pages straight into the pinned pool with one async copy. The step waits
  for the writes when `writes_block` says it reuses their device pages, and every step waits
  for the previous batch's writes (a write-through copy whose node a later batch evicts).
- a load (host -> device) copies each run of consecutive host pages from the pinned pool into
  the staging buffer with one async copy, and scatters the staging buffer into the device pool
  there (one kernel), and the step waits for the load's event. So a load is ordered before the
  step that reads it, and after every write queued before it (the same stream): a page loaded
  includes the writes queued before, with no host wait.
- the staging buffer is reused chunk after chunk and batch after batch in the stream's order;
  nothing else touches it.
Off CUDA (the CPU worker, and CI) both pools are host tensors and there is no staging buffer:
per layer, K or V, one numpy fancy-index copy moves the batch's rows (a load: the host pages'
rows of that layer into the device pool; a write: the reverse). numpy copies each row with one
memcpy, where torch's CPU index kernels measured 2 to 10x slower on these 2 KiB rows
(bench/host_copy.py).
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from radix_runtime.utils.runs import consecutive_runs
from radix_runtime.worker.kernels._triton import HAVE_TRITON
from radix_runtime.worker.kernels.page_copy import buffer_table, page_copy, page_copy_reference
from radix_runtime.worker.kv_pool import KVPool, available_cpu_memory

logger = logging.getLogger(__name__)

# the host tier may take at most this fraction of the machine's available memory
HOST_POOL_MAX_FRACTION = 0.8
# the staging buffer a batch's copies go through, chunk by chunk (at most the device pool)
STAGING_BYTES = 128 << 20


def host_pool_pages(device_pool: KVPool, size_gb: float, ratio: float, bytes_per_token: int) -> int:
    """Pages of the host tier (the reserved page 0 included): --hicache-size GB, else
    --hicache-ratio times the device pool. Raises a clear error when the memory is not there."""
    page_bytes = bytes_per_token * device_pool.page_size
    if size_gb > 0:
        want = int(size_gb * 1e9)
    else:
        want = int(ratio * (device_pool.num_pages - 1) * page_bytes)
    pages = want // page_bytes + 1
    need = pages * page_bytes
    avail = available_cpu_memory()
    if pages < 2:
        raise RuntimeError(
            f"--hicache-size/--hicache-ratio give {want} bytes, less than one KV page "
            f"({page_bytes} bytes)"
        )
    if need > HOST_POOL_MAX_FRACTION * avail:
        raise RuntimeError(
            f"the host KV tier needs {need / 2**30:.2f} GiB but only {avail / 2**30:.2f} GiB of "
            f"host memory is available (at most {HOST_POOL_MAX_FRACTION:.0%} of it may be used); "
            "lower --hicache-size or --hicache-ratio"
        )
    return pages


def pinned_empty(shape: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """A pinned host tensor of exactly its size, and whether it is registered: plain host memory
    page-locked with cudaHostRegister. torch's pinned allocator (`pin_memory=True`) rounds each
    allocation up to a power of two (a 17 GB host tier would pin 32 GB); it is the fallback when
    registering fails."""
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    try:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
        code = int(getattr(err, "value", err))
    except Exception as exc:  # no cudart binding: the pinned allocator
        logger.warning("cudaHostRegister unavailable (%s): pinning with torch's allocator", exc)
        code = -1
    if code == 0:
        return t, True
    if code > 0:
        logger.warning("cudaHostRegister failed (error %d): pinning with torch's allocator", code)
        try:  # the error is not sticky, but a later launch check would read it: clear it
            torch.cuda.cudart().cudaGetLastError()
        except AttributeError:
            pass
    del t
    return torch.empty(shape, dtype=dtype, pin_memory=True), False


def _host_unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown: the process's memory goes anyway
        pass


def last_per_destination(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A batch's copies with one copy per destination page, the last one queued. A page can be
    named twice in one batch: a node written to the host, evicted from it and its page handed
    to the next node written before the batch was sent (the radix tree queues both writes); the
    later copy is the page's owner. torch leaves an index assignment with repeated indices
    undefined, so the earlier ones are dropped here."""
    if len(dst) < 2:
        return src, dst
    _, first = np.unique(dst[::-1], return_index=True)
    if len(first) == len(dst):
        return src, dst
    keep = np.sort(len(dst) - 1 - first)
    return src[keep], dst[keep]


class HostKVPool:
    def __init__(
        self,
        device_pool: KVPool,
        num_pages: int,
        staging_bytes: int = STAGING_BYTES,
    ) -> None:
        self.dev = device_pool
        self.num_pages = num_pages
        self.cuda = device_pool.device.type == "cuda"
        d = device_pool
        page = (d.num_layers, 2, d.page_size, d.kv_heads, d.head_dim)
        self.registered = False  # pinned at its exact size (cudaHostRegister)
        if self.cuda:
            self.buffer, self.registered = pinned_empty((num_pages, *page), d.dtype)
            if self.registered:  # unpinned when the pool goes (the buffer lives as long)
                weakref.finalize(self, _host_unregister, self.buffer.data_ptr())
        else:
            self.buffer = torch.empty((num_pages, *page), dtype=d.dtype)
        self.page_bytes = self.buffer[0].numel() * self.buffer.element_size()
        # the staging buffer (CUDA): whole pages on the device, used by the side stream only
        self.chunk_pages = max(1, min(staging_bytes // self.page_bytes, d.num_pages))
        self.stream = self.staging = None
        if self.cuda:
            self.stream = torch.cuda.Stream(d.device)
            with torch.cuda.stream(self.stream):
                self.staging = torch.empty(
                    (self.chunk_pages, *page), dtype=d.dtype, device=d.device
                )
        self._last_write_event: torch.cuda.Event | None = None
        # loads no step has waited for yet (copy's `needs`): (end event, device pages)
        self._pending: list[tuple[torch.cuda.Event, np.ndarray]] = []
        # the copies move bytes: integer views of the same element size (index_copy_ has no
        # FP8 kernels)
        self._k = [_as_bits(b) for b in d.k_buffers]
        self._v = [_as_bits(b) for b in d.v_buffers]
        self._buffer = _as_bits(self.buffer)
        self._staging = _as_bits(self.staging) if self.cuda else None
        # every layer's K and V buffer, layer 0's K, its V, layer 1's K, ... (a host page's
        # order); on CUDA their address table: a chunk's scatter or gather over all layers is
        # one kernel (page_copy)
        self._kv = [b for i in range(d.num_layers) for b in (self._k[i], self._v[i])]
        self._table = buffer_table(self._kv) if self.cuda and HAVE_TRITON else None
        self.row = d.page_size * d.kv_heads * d.head_dim  # elements of one page of one buffer
        if not self.cuda:  # numpy views of both pools: its fancy indexing copies whole rows
            flat = (num_pages, 2 * d.num_layers, *page[2:])
            self._np_pool = self._buffer.numpy().reshape(flat)
            self._np_slots = [b.numpy() for b in self._kv]
        # runs of consecutive host pages copied, and the pages in them (docs/hicache.md)
        self.load_runs = self.load_pages = self.write_runs = self.write_pages = 0
        if self._table is not None:
            self._compile_page_copies()

    def _compile_page_copies(self) -> None:
        """Compile page_copy's launches now, not on the worker's thread in the middle of a batch
        (every copy queued behind a compile of a second or more): the reserved page 0
        gathered into the staging buffer and scattered back.
        The copy stream first waits for the compute stream: the address table and the pool's
        zero fill were queued there (as is every kernel before the pool was made)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.dev.device))
        with torch.cuda.stream(self.stream):
            idx = torch.zeros(1, dtype=torch.int64, device=self.dev.device)  # filled on this stream
            self._gather_device(idx, self._staging[:1])
            self._scatter_device(idx, self._staging[:1])
        self.stream.synchronize()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    # -- the copies of one batch ---------------------------------------------------------------

    def copy(
        self,
        write_src: np.ndarray,
        write_dst: np.ndarray,
        load_src: np.ndarray,
        load_dst: np.ndarray,
        writes_block: bool,
        busy: StepPages | None = None,
        needs: np.ndarray | None = None,
    ) -> CopyTiming:
        """A batch's copies, before its model runs: writes, then loads (called for every step,
        copies or not). `busy`: the KV pages that the steps still running read and write; a
        copy that touches none of theirs does not wait for them (None: every copy waits).
        `needs`: the pages the batch's own step reads and writes (None: all of them); the
        compute stream waits for the loads into those, queued first, and the other loads
        (prefetches for later steps, or a HostCopies with no step: an empty `needs`) run after
        them and are waited for by the first later step that touches their pages
        (`wait_pending`). Returns what `load_time` and `wait_time` read once the step is done,
        and whether the loads / writes wait for the running steps (on the CPU: whether they
        would)."""
        t0 = time.perf_counter()
        self._check(write_src, write_dst, load_src, load_dst)
        write_src, write_dst = last_per_destination(write_src, write_dst)
        load_src, load_dst = last_per_destination(load_src, load_dst)
        # by host page id: a run of consecutive host pages is one contiguous block
        order = np.argsort(write_dst, kind="stable")
        write_src, write_dst = write_src[order], write_dst[order]
        order = np.argsort(load_src, kind="stable")
        load_src, load_dst = load_src[order], load_dst[order]
        # a write reads its pages: it waits for the steps running only if one writes them; a
        # load writes its pages: it waits if a running step reads or writes one of them
        write_waits = bool(len(write_src)) and (busy is None or _touches(write_src, busy.written))
        load_waits = bool(len(load_src)) and (
            busy is None or _touches(load_dst, busy.read) or _touches(load_dst, busy.written)
        )
        if not self.cuda:  # synchronous: the step waits for every copy
            if not len(write_src) and not len(load_src):
                return CopyTiming()
            t1 = time.perf_counter()
            if len(write_src):
                self._write_sync(write_src, write_dst)
            t2 = time.perf_counter()
            if len(load_src):
                self._load_sync(load_src, load_dst)
            t3 = time.perf_counter()
            return CopyTiming(
                load=t3 - t2 if len(load_src) else None,
                load_bytes=len(load_src) * self.page_bytes,
                wait=t3 - t1,
                issue_s=t3 - t0,
                load_waited=load_waits,
                write_waited=write_waits,
            )
        compute = torch.cuda.current_stream(self.dev.device)
        before = None  # the compute stream, before it waits for any copy
        if self._last_write_event is not None or len(write_src) or len(load_src):
            before = torch.cuda.Event(enable_timing=True)
            before.record(compute)
        if self._last_write_event is not None:
            compute.wait_event(self._last_write_event)  # the previous batch's writes
            self._last_write_event = None
        if len(write_src):
            event = self._write_async(write_src, write_dst, compute, write_waits)
            self._last_write_event = event
            if writes_block:
                compute.wait_event(event)
        load = None
        if len(load_src):
            load = self._load_async(load_src, load_dst, compute, load_waits, needs)
        if before is None:
            return CopyTiming()
        after = torch.cuda.Event(enable_timing=True)
        after.record(compute)
        return CopyTiming(
            load=load,
            load_bytes=len(load_src) * self.page_bytes,
            wait=(before, after),
            issue_s=time.perf_counter() - t0,
            load_waited=load_waits,
            write_waited=write_waits,
        )

    @staticmethod
    def load_time(handle: CopyTiming | None) -> float:
        """Seconds the loads of a batch took (call after its step completed): on CUDA the side
        stream's time from the load's start to its end (copies and scatter; a stream starved
        by the host issuing the copies counts the gaps too)."""
        return _seconds(handle.load) if handle is not None else 0.0

    @staticmethod
    def wait_time(handle: CopyTiming | None) -> float:
        """Seconds the batch's model waited for copies (call after its step completed): on CUDA
        the compute stream's time from reaching the batch's copies (every earlier step done) to
        passing them (the previous batch's writes, this batch's blocking writes and its loads
        done); on the CPU the copies' wall time. The loads' cost on the critical path."""
        return _seconds(handle.wait) if handle is not None else 0.0

    def _check(self, *arrays: np.ndarray) -> None:
        ws, wd, ls, ld = arrays
        if len(ws) != len(wd) or len(ls) != len(ld):
            raise ValueError("host copies need as many destination pages as source pages")
        for dev_ids in (ws, ld):
            if len(dev_ids) and (dev_ids.min() < 1 or dev_ids.max() >= self.dev.num_pages):
                raise ValueError(f"device page ids outside [1, {self.dev.num_pages})")
        for host_ids in (wd, ls):
            if len(host_ids) and (host_ids.min() < 1 or host_ids.max() >= self.num_pages):
                raise ValueError(f"host page ids outside [1, {self.num_pages})")

    def _chunks(self, n: int):
        return self._chunks_of(n, self.chunk_pages)

    def _gather_device(self, idx: torch.Tensor, out: torch.Tensor) -> None:
        """Device pages `idx` -> `out` [len(idx), layers, 2, ...] (page major): one kernel
        over every layer (page_copy), else one gather per buffer."""
        if self._table is not None:
            page_copy(self._table, idx, out, self.row, gather=True)
        else:
            page_copy_reference(self._kv, idx, out, gather=True)

    def _scatter_device(self, idx: torch.Tensor, pages: torch.Tensor) -> None:
        """`pages` [len(idx), layers, 2, ...] -> device pages `idx`: one kernel over every layer
        (page_copy), else one index copy per buffer."""
        if self._table is not None:
            page_copy(self._table, idx, pages, self.row, gather=False)
        else:
            page_copy_reference(self._kv, idx, pages, gather=False)

    def _count(self, ids: np.ndarray, load: bool) -> tuple[np.ndarray, np.ndarray]:
        starts, lengths = consecutive_runs(ids)
        if load:
            self.load_runs += len(starts)
            self.load_pages += len(ids)
        else:
            self.write_runs += len(starts)
            self.write_pages += len(ids)
        return starts, lengths

    # -- CPU -----------------------------------------------------------------------------------

    def _write_sync(self, src: np.ndarray, dst: np.ndarray) -> None:
        self._count(dst, load=False)
        pool = self._np_pool
        for i, slot in enumerate(self._np_slots):  # each layer's K or V: one gather
            pool[dst, i] = slot[src]

    def _load_sync(self, src: np.ndarray, dst: np.ndarray) -> None:
        self._count(src, load=True)
        pool = self._np_pool
        for i, slot in enumerate(self._np_slots):
            slot[dst] = pool[src, i]

    # -- CUDA ----------------------------------------------------------------------------------

    def _write_async(
        self, src: np.ndarray, dst: np.ndarray, compute, wait: bool
    ) -> torch.cuda.Event:
        starts, lengths = self._count(dst, load=False)
        src_t = _pinned_ids(src)
        with torch.cuda.stream(self.stream):
            if wait:
                self.stream.wait_stream(compute)
            idx = src_t.to(self.dev.device, non_blocking=True)
            for a, b in self._chunks(len(src)):
                self._gather_device(idx[a:b], self._staging[: b - a])
                self._copy_runs(dst, starts, lengths, a, b, load=False)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def _copy_runs(self, host_ids, starts, lengths, a: int, b: int, load: bool) -> None:
        """Chunk [a, b) of a batch sorted by host page: each run of consecutive host pages is
        one copy between the pool and the staging rows [0, b - a) (a load: pool -> staging)."""
        for j, r in _runs_in(starts, lengths, a, b):
            s = int(host_ids[j])
            pool, staged = self._buffer[s : s + r], self._staging[j - a : j - a + r]
            if load:
                staged.copy_(pool, non_blocking=True)
            else:
                pool.copy_(staged, non_blocking=True)

    def _load_async(self, src: np.ndarray, dst: np.ndarray, compute, wait: bool, needs=None):
        """The loads (sorted by host page): those into `needs` first, the compute stream waiting
        for them; the rest after them, held in `_pending` (all of them are `needs` with None)."""
        own = np.ones(len(dst), bool) if needs is None else np.isin(dst, needs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # the device pages of both groups (own first) in one small copy, queued before `start`
        # so the load's time is its copies and scatters
        idx_all = _pinned_ids(np.concatenate([dst[own], dst[~own]]))
        n_own = int(own.sum())
        with torch.cuda.stream(self.stream):
            if wait:
                self.stream.wait_stream(compute)
            idx_all = idx_all.to(self.dev.device, non_blocking=True)
            start.record(self.stream)
            if n_own:
                self._load_group(src[own], idx_all[:n_own])
                if not own.all():
                    own_end = torch.cuda.Event()
                    own_end.record(self.stream)
                    compute.wait_event(own_end)
            if not own.all():
                self._load_group(src[~own], idx_all[n_own:])
            end.record(self.stream)
        if not own.all():
            self._pending.append((end, dst[~own]))
        else:
            compute.wait_event(end)
        return start, end

    def _load_group(self, src: np.ndarray, idx: torch.Tensor) -> None:
        """Queue loads on the copy stream (the current stream here), chunk after chunk of the
        staging buffer: each chunk's runs copied in, then scattered into the device pool (one
        kernel for every layer). `idx`: the device pages, on the device. (A second stream
        scattering one half of the buffer while the other fills measured no faster on the
        H200 — the scatter is ~1 % of the copy — docs/hicache.md.)"""
        starts, lengths = self._count(src, load=True)
        for a, b in self._chunks(len(src)):
            self._copy_runs(src, starts, lengths, a, b, load=True)
            self._scatter_device(idx[a:b], self._staging[: b - a])

    @staticmethod
    def _chunks_of(n: int, size: int):
        for a in range(0, n, size):
            yield a, min(a + size, n)

    def wait_pending(self, pages: StepPages) -> CopyTiming | None:
        """Before a step that reads or writes `pages`: the compute stream waits for the loads
        still held (`copy`'s `needs`) into any of them; the loads that are done are dropped. The
        wait's timing (CUDA events), or None when nothing was waited for here."""
        if not self._pending:
            return None
        waits, keep = [], []
        for event, dst in self._pending:
            if event.query():
                continue
            if _touches(dst, pages.read) or _touches(dst, pages.written):
                waits.append(event)
            else:
                keep.append((event, dst))
        self._pending = keep
        if not waits:
            return None
        compute = torch.cuda.current_stream(self.dev.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(compute)
        for event in waits:
            compute.wait_event(event)
        after.record(compute)
        return CopyTiming(wait=(before, after))

    def synchronize(self) -> None:
        """Every queued copy done (tests, shutdown)."""
        if self.cuda:
            self.stream.synchronize()


@dataclass(frozen=True)
class StepPages:
    """The KV pages a launched step reads (its requests' page rows up to their new tokens) and
    writes (its new tokens' pages)."""

    read: np.ndarray
    written: np.ndarray


def _pinned_ids(ids: np.ndarray) -> torch.Tensor:
    """Page ids as a pinned int64 host tensor, ready for a non-blocking copy to the device."""
    return torch.from_numpy(ids.astype(np.int64)).pin_memory()


def _touches(pages: np.ndarray, busy: np.ndarray) -> bool:
    return bool(len(busy)) and bool(np.isin(pages, busy).any())


@dataclass
class CopyTiming:
    """What a batch's copies leave for `HostKVPool.load_time` / `wait_time`: CUDA timing
    events (a pair: from, to) or, on the CPU, seconds."""

    load: tuple | float | None = None  # the loads (CUDA: on the side stream)
    load_bytes: int = 0  # the bytes they move
    wait: tuple | float | None = None  # the model's wait for the copies (CUDA: compute stream)
    issue_s: float = 0.0  # the host's time in `copy` (CUDA: queueing the copies)
    load_waited: bool = False  # the loads waited for the running steps (a page of theirs)
    write_waited: bool = False  # the writes did

    def ready(self) -> bool:
        """Whether its times can be read without waiting (CUDA: every event done; a load held
        for a later step may still run after the step it came with)."""
        return all(_done(t) for t in (self.load, self.wait))


def _done(timing) -> bool:
    if timing is None or isinstance(timing, float):
        return True
    return timing[1].query()


def _seconds(timing) -> float:
    if timing is None:
        return 0.0
    if isinstance(timing, float):
        return timing
    start, end = timing
    end.synchronize()
    return max(start.elapsed_time(end), 0.0) / 1e3


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the same width."""
    return t.view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )


def _runs_in(starts: np.ndarray, lengths: np.ndarray, a: int, b: int):
    """The runs (start index, length) clipped to the chunk [a, b) of the sorted ids."""
    first = max(int(np.searchsorted(starts, a, side="right")) - 1, 0)
    for j, r in zip(starts[first:].tolist(), lengths[first:].tolist()):
        if j >= b:
            return
        lo, hi = max(j, a), min(j + r, b)
        yield lo, hi - lo


def measure_load_bandwidth(device: torch.device, nbytes: int = 64 << 20) -> float:
    """Host -> device copy bandwidth (bytes/s): pinned memory on CUDA, a memcpy off it."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best
