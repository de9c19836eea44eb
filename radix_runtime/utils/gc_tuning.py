"""Python's cyclic garbage collector in the server's processes.

A full (generation 2) collection walks every tracked object of the process, and runs whenever
enough objects have survived two younger collections, i.e. now and then in the middle of the
step loop; every decoder's next token waits for it. The worker's imports (torch, FlashInfer, the
model) leave ~300K objects and the tokenizer process's (transformers, FastAPI) ~75K: ~0.1 s a
full collection walking them.

`freeze_after_startup()` collects once and then moves every object alive at that point into
the permanent generation, which collections never walk again (they are still freed by
reference counting): a full collection then walks only what serving keeps alive. The server
calls it in each process once that process is ready (`--disable-gc-freeze` leaves the collector
as Python sets it up). What still pauses a loaded server is the tokenizer process's full
collections over the requests' own state (docs/serving_roofline.md, "What sets ITL p99").

`GcWatch` times every collection of its process (gc.callbacks): how many, how many full ones,
their total and longest pause, and how many paused for at least LONG_PAUSE_S (each logged at
INFO). `/get_server_info` reports them per process (`gc`).
"""

from __future__ import annotations

import gc
import logging
import time

from radix_runtime.messages import GcStats

logger = logging.getLogger("radix_runtime.gc")

LONG_PAUSE_S = 0.02  # a collection this long delays a decode step noticeably: logged, counted


class GcWatch:
    """Times the collections of this process; one per process (`install`)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.collections = self.full_collections = self.long_pauses = 0
        self.pause_s = self.max_pause_s = 0.0
        self.frozen_objects = 0
        self._t0 = 0.0
        # (full collections, long pauses, longest pause in ms) at the last report(); None: never
        self._reported: tuple[int, int, int] | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        took = time.perf_counter() - self._t0
        self.collections += 1
        self.full_collections += info.get("generation") == 2
        self.pause_s += took
        self.max_pause_s = max(self.max_pause_s, took)
        if took >= LONG_PAUSE_S:
            self.long_pauses += 1
            logger.info(
                "%s: a generation-%d garbage collection paused the process %.1f ms",
                self.role,
                info.get("generation", -1),
                took * 1e3,
            )

    def stats(self) -> GcStats:
        return GcStats(
            collections=self.collections,
            full_collections=self.full_collections,
            pause_s=self.pause_s,
            max_pause_s=self.max_pause_s,
            long_pauses=self.long_pauses,
            frozen_objects=self.frozen_objects,
        )

    def report(self) -> GcStats | None:
        """The stats on the first call and whenever a full or long collection happened, or the
        longest pause grew by a millisecond, since the last one (the worker attaches them to a
        step result), else None."""
        now = (self.full_collections, self.long_pauses, int(self.max_pause_s * 1e3))
        if now == self._reported:
            return None
        self._reported = now
        return self.stats()


_watch: GcWatch | None = None


def install(role: str) -> GcWatch:
    """This process's GcWatch (installed once; a second call returns the first)."""
    global _watch
    if _watch is None:
        _watch = GcWatch(role)
        gc.callbacks.append(_watch)
    return _watch


def current() -> GcWatch | None:
    return _watch


def freeze_after_startup(role: str) -> int:
    """Collect what startup left, then freeze every object still alive (see the module); the
    number frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: froze %d objects out of garbage collection", role, frozen)
    return frozen


def ready(args, role: str) -> GcWatch:
    """A server process is ready to serve: watch its collections and, unless
    --disable-gc-freeze, freeze what startup left alive."""
    frozen = 0
    if not args.disable_gc_freeze:
        frozen = freeze_after_startup(role)
    watch = install(role)  # after the freeze: its own collection is startup's, not serving's
    watch.frozen_objects = frozen
    return watch
