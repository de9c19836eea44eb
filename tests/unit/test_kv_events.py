"""KV-cache events: a subscriber that applies every batch rebuilds exactly what the scheduler's
radix tree holds (compared with the tree's own dump after every step), through inserts,
evictions under a small pool, a flush, and a late subscriber that starts from a snapshot."""

from __future__ import annotations

import random

import numpy as np
import pytest

from radix_runtime import kv_events as kv
from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.scheduler.scheduler import Scheduler
from tests.unit.test_scheduler import Driver, FakeWorker


def wire(obj):
    """Through msgpack and back, as a subscriber receives it."""
    data = kv.encode(obj)
    return kv.decode_batch(data) if isinstance(obj, kv.EventBatch) else kv.decode_snapshot(data)


@pytest.mark.parametrize("impl", ["python", "cpp"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_subscriber_rebuilds_the_tree(impl, page_size):
    pool, slots = 384, 4
    args = ServerArgs(
        page_size=page_size,
        max_total_tokens=pool,
        chunked_prefill_size=32,
        max_running_requests=slots,
        radix_tree_impl=impl,
        kv_events_endpoint="ipc://unused",
    )
    worker = FakeWorker(pool // page_size + 1, page_size, slots)
    sched = Scheduler(args, worker.ready())
    driver = Driver(sched, worker)
    rng = random.Random(page_size)
    systems = [[rng.randrange(1, 97) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    live, late = kv.KvIndex(), None
    removed = stored = cleared = 0
    sampling = m.SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    for step in range(400):
        if step < 300 and step % 3 == 0:
            prompt = rng.choice(systems) + [
                rng.randrange(1, 97) for _ in range(rng.randrange(1, 30))
            ]
            sched.add_request(
                m.GenerateReq(rid=f"r{step}", input_ids=m.pack_ids(prompt), sampling=sampling)
            )
        if step == 150:
            sched.flush_cache()
        driver.iteration()
        sched.take_outputs()
        batch = sched.kv_events.take_batch()
        if batch is not None:
            batch = wire(batch)
            live.apply(batch)
            if late is not None:
                late.apply(batch)
            for ev in batch.events:
                stored += isinstance(ev, kv.BlockStored)
                removed += isinstance(ev, kv.BlockRemoved)
                cleared += isinstance(ev, kv.AllBlocksCleared)
        if step == 200:  # a subscriber joining now starts from a snapshot
            late = kv.KvIndex()
            late.load(wire(sched.kv_events.snapshot()))
        expected = kv.tree_prefixes(sched.cache.dump(), page_size)
        assert live.prefixes() == expected, f"step {step}"
        if late is not None:
            assert late.blocks == live.blocks
    assert not driver.busy()
    assert stored and removed, (stored, removed)  # the pool was small enough to evict
    sched.flush_cache()  # idle: everything goes, as one event
    batch = wire(sched.kv_events.take_batch())
    assert [type(ev) for ev in batch.events] == [kv.AllBlocksCleared]
    live.apply(batch)
    assert live.blocks == {} and kv.tree_prefixes(sched.cache.dump(), page_size) == set()


def test_hashes_are_chained_and_namespaced():
    tokens = np.arange(12, dtype=np.int32)
    hashes = kv.chain_hashes(tokens, 4)
    assert len(hashes) == 3
    assert hashes[0] == kv.block_hash(0, tokens[:4])
    assert hashes[1] == kv.block_hash(hashes[0], tokens[4:8])
    assert kv.chain_hashes(tokens, 4, namespace="tenant-a") != hashes
    assert kv.chain_hashes(tokens[:11], 4) == hashes[:2]  # whole blocks only


def test_index_refuses_inconsistent_streams():
    index = kv.KvIndex()
    toks = [1, 2, 3, 4]
    h = kv.block_hash(0, np.array(toks, dtype=np.int32))
    ok = kv.EventBatch(0, 0.0, 0, [kv.BlockStored([h], None, toks, 4)])
    assert index.apply(ok) and not index.apply(ok)  # a batch already applied is skipped
    with pytest.raises(ValueError, match="lost batches"):
        index.apply(kv.EventBatch(5, 0.0, 0, []))
    with pytest.raises(ValueError, match="unknown parent"):
        index.apply(kv.EventBatch(1, 0.0, 0, [kv.BlockStored([h + 1], 12345, toks, 4)]))
    with pytest.raises(ValueError, match="does not hash"):
        index.apply(kv.EventBatch(1, 0.0, 0, [kv.BlockStored([h + 1], None, toks, 4)]))
