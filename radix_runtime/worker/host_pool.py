"""The host tier's KV pages (docs/hicache.md): a second pool in host memory, and the copies
between it and the device pool that the scheduler asks for.

The pool is one tensor [num_layers, 2 (K, V), num_pages, page_size, kv_heads, head_dim],
allocated once at start (pinned on CUDA) and sized by --hicache-size or --hicache-ratio against
the memory the machine has free. Page 0 is reserved, as in the device pool.

The worker only copies what it is told (`ForwardBatch.write_*`, `load_*`), before the step's
model runs. On CUDA every copy runs on a side stream:
- a write (device -> host) first waits for the compute stream (the KV it reads was computed by
  an earlier step), gathers the pages on the device and copies them into pinned memory with one
  async copy; the scatter into the pool happens on the host once the copy's event has completed
  (`_drain_writes`). The step waits for the writes when `writes_block` says it reuses their
  device pages, and every step waits for the previous batch's writes (a write-through copy
  whose node a later batch evicts).
- a load (host -> device) gathers the pages on the host into pinned memory (after the pending
  writes have landed), copies them with one async copy on the side stream after the compute
  stream's earlier work (a page it fills may have been freed while the step before still ran),
  scatters them into the device pool there, and the step waits for the load's event. So the
  load is ordered before the step that reads it, and overlaps the host's preparation of that
  step and the device's end of the previous one.
Off CUDA (the CPU worker, and CI) the same copies are plain index copies.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from radix_runtime.worker.kv_pool import KVPool, available_cpu_memory

logger = logging.getLogger(__name__)

# the host tier may take at most this fraction of the machine's available memory
HOST_POOL_MAX_FRACTION = 0.8


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
    def __init__(self, device_pool: KVPool, num_pages: int) -> None:
        self.dev = device_pool
        self.num_pages = num_pages
        self.cuda = device_pool.device.type == "cuda"
        shape = (
            device_pool.num_layers,
            2,
            num_pages,
            device_pool.page_size,
            device_pool.kv_heads,
            device_pool.head_dim,
        )
        self.buffer = torch.empty(shape, dtype=device_pool.dtype, pin_memory=self.cuda)
        self.stream = torch.cuda.Stream(device_pool.device) if self.cuda else None
        # (event, pinned copy of the pages, host page ids): device -> host copies whose scatter
        # into the pool waits for their event, in order
        self._pending_writes: list[tuple[torch.cuda.Event, torch.Tensor, torch.Tensor]] = []
        self._last_write_event: torch.cuda.Event | None = None

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
    ):
        """A batch's copies, before its model runs: writes, then loads (called for every step,
        copies or not). Returns what `load_time` reads (CUDA: the load's timing events and its
        host gather's seconds; CPU: its seconds)."""
        self._check(write_src, write_dst, load_src, load_dst)
        write_src, write_dst = last_per_destination(write_src, write_dst)
        load_src, load_dst = last_per_destination(load_src, load_dst)
        if not self.cuda:
            if len(write_src):
                self._write_sync(write_src, write_dst)
            t0 = time.perf_counter()
            if len(load_src):
                self._load_sync(load_src, load_dst)
            return time.perf_counter() - t0
        compute = torch.cuda.current_stream(self.dev.device)
        self._drain_writes(wait=False)
        if self._last_write_event is not None:
            compute.wait_event(self._last_write_event)  # the previous batch's writes
            self._last_write_event = None
        if len(write_src):
            event = self._write_async(write_src, write_dst, compute)
            self._last_write_event = event
            if writes_block:
                compute.wait_event(event)
        if len(load_src):
            return self._load_async(load_src, load_dst, compute)
        return None

    @staticmethod
    def load_time(handle) -> float:
        """Seconds the loads of a batch took (call after its step completed)."""
        if handle is None:
            return 0.0
        if isinstance(handle, float):
            return handle
        start, end, gather_s = handle
        end.synchronize()
        return gather_s + start.elapsed_time(end) / 1e3

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

    def _gather_device(self, idx: torch.Tensor) -> torch.Tensor:
        dev = self.dev
        return torch.stack(
            [
                torch.stack([dev.k_buffers[i][idx], dev.v_buffers[i][idx]])
                for i in range(dev.num_layers)
            ]
        )

    def _scatter_device(self, idx: torch.Tensor, pages: torch.Tensor) -> None:
        dev = self.dev
        for i in range(dev.num_layers):
            dev.k_buffers[i][idx] = pages[i, 0]
            dev.v_buffers[i][idx] = pages[i, 1]

    # -- CPU -----------------------------------------------------------------------------------

    def _write_sync(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.buffer[:, :, torch.from_numpy(dst.astype(np.int64))] = self._gather_device(
            torch.from_numpy(src.astype(np.int64))
        )

    def _load_sync(self, src: np.ndarray, dst: np.ndarray) -> None:
        pages = self.buffer[:, :, torch.from_numpy(src.astype(np.int64))]
        self._scatter_device(torch.from_numpy(dst.astype(np.int64)), pages)

    # -- CUDA ----------------------------------------------------------------------------------

    def _write_async(self, src: np.ndarray, dst: np.ndarray, compute) -> torch.cuda.Event:
        src_t = torch.from_numpy(src.astype(np.int64)).pin_memory()
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(compute)
            idx = src_t.to(self.dev.device, non_blocking=True)
            gathered = self._gather_device(idx)
            host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            host.copy_(gathered, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._pending_writes.append((event, host, torch.from_numpy(dst.astype(np.int64))))
        return event

    def _drain_writes(self, wait: bool) -> None:
        """Scatter the completed device -> host copies into the pool, oldest first (all of them
        with `wait`)."""
        while self._pending_writes:
            event, host, dst = self._pending_writes[0]
            if wait:
                event.synchronize()
            elif not event.query():
                return
            self.buffer[:, :, dst] = host
            self._pending_writes.pop(0)

    def _load_async(self, src: np.ndarray, dst: np.ndarray, compute):
        t0 = time.perf_counter()
        self._drain_writes(wait=True)  # a page loaded may have been written just now
        b = self.buffer
        staged = torch.empty((*b.shape[:2], len(src), *b.shape[3:]), dtype=b.dtype, pin_memory=True)
        torch.index_select(b, 2, torch.from_numpy(src.astype(np.int64)), out=staged)
        gather_s = time.perf_counter() - t0  # counted in the load's time: the host's share
        dst_t = torch.from_numpy(dst.astype(np.int64)).pin_memory()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(compute)
            start.record(self.stream)
            pages = staged.to(self.dev.device, non_blocking=True)
            self._scatter_device(dst_t.to(self.dev.device, non_blocking=True), pages)
            end.record(self.stream)
        compute.wait_event(end)
        return start, end, gather_s

    def synchronize(self) -> None:
        """Every queued copy done and scattered (tests, shutdown)."""
        if self.cuda:
            self.stream.synchronize()
        self._drain_writes(wait=True)


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
