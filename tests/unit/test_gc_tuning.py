"""utils/gc_tuning.py: each server process freezes what its startup left alive out of garbage
collection (so a full collection walks only what serving keeps alive) and times its collections,
reported per process by /get_server_info."""

from __future__ import annotations

import gc
import json
import logging
import subprocess
import sys
from pathlib import Path

from radix_runtime import messages as m
from radix_runtime.utils import gc_tuning

ROOT = Path(__file__).resolve().parents[2]


def _watched():
    watch = gc_tuning.GcWatch("test")
    gc.callbacks.append(watch)
    return watch


def test_watch_counts_and_times_collections(monkeypatch, caplog):
    watch = _watched()
    try:
        assert watch.report() is not None  # the first report always goes out
        assert watch.report() is None  # nothing full or long since
        gc.collect()
        stats = watch.stats()
        assert stats.full_collections == 1 and stats.collections >= 1
        assert stats.pause_s > 0 and 0 < stats.max_pause_s <= stats.pause_s
        assert watch.report() == stats and watch.report() is None
        gc.collect(0)  # a young collection: counted, not reported on its own
        assert watch.stats().collections == stats.collections + 1
        assert watch.report() is None
        long_before = watch.stats().long_pauses  # (the full one may have been long already)
        monkeypatch.setattr(gc_tuning, "LONG_PAUSE_S", 0.0)  # every collection is long
        with caplog.at_level(logging.INFO, logger="radix_runtime.gc"):
            gc.collect(0)
        assert watch.stats().long_pauses >= long_before + 1 and watch.report() is not None
        assert "test: a generation-0 garbage collection paused the process" in caplog.text
    finally:
        gc.callbacks.remove(watch)


def test_server_info_carries_each_process_stats():
    stats = m.GcStats(collections=3, full_collections=1, pause_s=0.5, max_pause_s=0.4)
    cache = m.CacheStats(
        total_pages=1, free_pages=1, evictable_pages=0, protected_pages=0, page_size=1, hit_rate=0
    )
    info = m.ServerInfo(
        cache=cache,
        running_requests=0,
        waiting_requests=0,
        max_total_tokens=1,
        max_running_requests=1,
        context_length=1,
        vocab_size=1,
        gc={"scheduler": stats, "worker": m.GcStats()},
    )
    back = m.decode(m.encode(info))
    assert back.gc == {"scheduler": stats, "worker": m.GcStats()}
    result = m.decode(m.encode(m.ForwardResult(step=1, results=[], gc=stats)))
    assert result.gc == stats
    assert m.decode(m.encode(m.ForwardResult(step=1, results=[]))).gc is None


_READY = """
import gc, json
from radix_runtime.config import ServerArgs
from radix_runtime.utils import gc_tuning
startup = [[i] for i in range(50_000)]  # what a process's imports and model leave alive
watch = gc_tuning.ready(ServerArgs(disable_gc_freeze={disable}), "worker")
gc.collect()
print(json.dumps({{
    "frozen": watch.frozen_objects,
    "freeze_count": gc.get_freeze_count(),
    "walked": len(gc.get_objects()),  # what a full collection now walks
    "collections_seen": watch.stats().collections,
}}))
"""


def _ready_in_a_fresh_process(disable: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _READY.format(disable=disable)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_ready_freezes_what_startup_left_unless_disabled():
    frozen = _ready_in_a_fresh_process(disable=False)
    assert frozen["frozen"] >= 50_000 and frozen["freeze_count"] >= 50_000
    assert frozen["walked"] < 10_000  # the startup objects are out of every collection
    assert frozen["collections_seen"] >= 1  # the watch counts the collections after the freeze
    kept = _ready_in_a_fresh_process(disable=True)
    assert kept["frozen"] == kept["freeze_count"] == 0
    assert kept["walked"] >= 50_000


def test_the_flag():
    from radix_runtime.config import parse_server_args

    assert parse_server_args([]).disable_gc_freeze is False
    assert parse_server_args(["--disable-gc-freeze"]).disable_gc_freeze


def test_a_requests_prompt_ids_are_not_walked_by_the_collector():
    """The front holds every request's prompt as a tuple of ints, which the collector stops
    tracking; a list would be walked element by element by every full collection."""
    from http_support import served

    with served() as s:
        r = s.client.post(
            "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
        )
        assert r.status_code == 200
        r = s.client.post("/v1/completions", json={"model": "fake-model", "prompt": "ab"})
        assert r.status_code == 200
        prompts = [inp.input_ids for inp in s.manager.inputs]
    assert prompts[0] == (5, 6, 7) and len(prompts) == 2
    gc.collect()
    assert all(type(p) is tuple and not gc.is_tracked(p) for p in prompts)
