"""The scheduler with the host tier, against test_scheduler's fake worker (which reads its KV
from the pages it was told about) given a host pool: it makes the batch's copies (writes, then
loads) before the batch's rows, as the real worker does. A load missing or misordered, a write
read after its page was reused, or a page freed while still the tree's reads wrong tokens and
changes the outputs."""

from __future__ import annotations

import random

import numpy as np
from test_scheduler import VOCAB, Driver, FakeWorker

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.scheduler.kv import KvBook
from radix_runtime.scheduler.scheduler import Scheduler


class TieredFakeWorker(FakeWorker):
    def __init__(self, num_pages, page_size, max_slots, host_pages, sent=None):
        super().__init__(num_pages, page_size, max_slots)
        self.host = np.full((host_pages, page_size), -1, dtype=np.int64)
        self.loaded_pages = 0
        self.sent = sent  # a list: every batch, as received

    def ready(self) -> m.WorkerReady:
        ready = super().ready()
        ready.host_num_pages = len(self.host)
        ready.kv_bytes_per_token = 64
        return ready

    def forward(self, batch: m.ForwardBatch) -> m.ForwardResult:
        if self.sent is not None:
            self.sent.append(batch)
        self.copy(batch)
        return super().forward(batch)

    def copy(self, batch: m.ForwardBatch | m.HostCopies) -> None:
        """A batch's copies (or a HostCopies message's): writes, then loads."""
        src, dst = m.unpack_ids(batch.write_src), m.unpack_ids(batch.write_dst)
        self.host[dst] = self.pool[src]
        src, dst = m.unpack_ids(batch.load_src), m.unpack_ids(batch.load_dst)
        self.pool[dst] = self.host[src]
        self.loaded_pages += len(src)


def conversations(n=6, rounds=3, seed=0):
    rng = random.Random(seed)
    system = [rng.randrange(1, VOCAB) for _ in range(12)]
    turns = [[system + [rng.randrange(1, VOCAB) for _ in range(30)] for _ in range(n)]]
    for _ in range(rounds - 1):
        turns.append([p + [rng.randrange(1, VOCAB) for _ in range(10)] for p in turns[-1]])
    return [p for t in turns for p in t], [15 * (i // n) for i in range(n * rounds)]


def run(prompts, arrivals, *, hicache, page_size=1, pool=96, host=4096, overlap=False,
        policy="write_through", disable=False, aborts=None, max_new=4, sent=None,
        prefetch="arrival", early=False, between=None):  # fmt: skip
    """`early`: the copies queued by requests' arrival go to the worker at once (HostCopies),
    as the scheduler process sends them while a step runs; `between(sched, step)` runs after
    each step's arrivals."""
    args = ServerArgs(
        page_size=page_size,
        max_total_tokens=pool,
        chunked_prefill_size=32,
        max_running_requests=3,
        radix_tree_impl="python",
        disable_radix_cache=disable,
        disable_overlap_schedule=not overlap,
        enable_hierarchical_cache=hicache,
        hicache_write_policy=policy,
        hicache_prefetch=prefetch,
        # admission reserves only the decoders' next pages: these tiny pools then see the
        # evictions, loads and retractions the tests are about
        schedule_conservativeness=0.0,
    )
    num_pages = pool // page_size + 1
    worker = (
        TieredFakeWorker(num_pages, page_size, 3, host // page_size + 1, sent)
        if hicache
        else FakeWorker(num_pages, page_size, 3)
    )
    sched = Scheduler(args, worker.ready())
    driver = Driver(sched, worker)
    sampling = m.SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    outputs = {f"r{i}": [] for i in range(len(prompts))}
    pending, step, aborts = list(range(len(prompts))), 0, dict(aborts or {})
    while pending or driver.busy():
        for i in [i for i in pending if arrivals[i] <= step]:
            sched.add_request(
                m.GenerateReq(rid=f"r{i}", input_ids=m.pack_ids(prompts[i]), sampling=sampling)
            )
            pending.remove(i)
        if early:
            copies = sched.take_early_copies()
            if copies is not None:
                if sent is not None:
                    sent.append(copies)
                worker.copy(m.decode(m.encode(copies)))
        if between is not None:
            between(sched, step)
        for rid, at in list(aborts.items()):
            if at(sched, step):
                sched.abort(rid)
                del aborts[rid]
        driver.iteration()
        for out in sched.take_outputs():
            assert out.error is None, out.error
            outputs[out.rid].extend(m.unpack_ids(out.new_ids).tolist())
        sched.check_integrity()
        step += 1
        assert step < 20_000, "no progress"
    stats = sched.cache_stats()
    assert stats.free_pages + stats.evictable_pages == stats.total_pages
    if hicache:
        assert stats.host_free_pages + stats.host_evictable_pages <= stats.host_total_pages
    return outputs, sched


def test_outputs_equal_cache_off_under_a_pool_far_smaller_than_the_working_set():
    prompts, arrivals = conversations()
    off, _ = run(prompts, arrivals, hicache=False, disable=True)
    device, dev_sched = run(prompts, arrivals, hicache=False)
    assert device == off
    for page_size in (1, 4):
        for overlap in (False, True):
            for policy in ("write_through", "write_back"):
                on, sched = run(
                    prompts, arrivals, hicache=True, page_size=page_size, overlap=overlap,
                    policy=policy,
                )  # fmt: skip
                assert on == off, (page_size, overlap, policy)
                assert sched.host_cached_tokens_total > 0
                if page_size == 1:
                    assert sched.cached_tokens_total > dev_sched.cached_tokens_total


def test_abort_during_a_load_frees_everything():
    """The request is aborted right after the step carrying its load was built (with the
    overlap schedule: while it is in flight): its pages go back, the loaded nodes stay cached."""
    prompts, arrivals = conversations(n=4, rounds=2)
    victims = {}

    def aborts_when_loading(rid):
        def at(sched, step):
            req = sched.reqs.get(rid)
            return req is not None and req.host_cached_tokens > 0 and req.node is not None

        return at

    for i in range(4, 8):
        victims[f"r{i}"] = aborts_when_loading(f"r{i}")
    for overlap in (False, True):
        out, sched = run(prompts, arrivals, hicache=True, overlap=overlap, aborts=dict(victims))
        assert sched.host_loads > 0
        assert sum(len(out[v]) < 4 for v in victims) >= 2  # aborted after their load
        if overlap:  # the step carrying the load was still in flight: no output at all
            assert any(not out[v] for v in victims)
        off, _ = run(prompts[:4], arrivals[:4], hicache=False, disable=True)
        assert {k: out[k] for k in off} == off  # the other requests are unaffected
        sched.check_integrity()


def test_pressure_in_both_tiers_retracts_and_never_crashes():
    prompts, arrivals = conversations(n=8, rounds=3, seed=1)
    off, _ = run(prompts, arrivals, hicache=False, disable=True, max_new=12)
    for overlap in (False, True):
        on, sched = run(
            prompts, arrivals, hicache=True, pool=80, host=96, overlap=overlap, max_new=12
        )
        assert on == off
        assert sched.retractions > 0
        stats = sched.cache_stats()
        assert stats.host_total_pages == 96 and stats.host_written_bytes > 0


def test_metrics_label_cached_tokens_by_tier():
    from test_metrics_stats import parse

    from radix_runtime.server.metrics import Metrics

    prompts, arrivals = conversations()
    _, sched = run(prompts, arrivals, hicache=True)
    metrics = Metrics("m")
    metrics.apply(m.decode(m.encode(sched.stats.report(sched))))
    got = parse(metrics.exposition())

    def v(tier):
        return got[("radix_runtime:cached_tokens_by_tier_total", (("tier", tier),))]

    assert v("host") == sched.host_cached_tokens_total > 0
    assert v("device") + v("host") == sched.cached_tokens_total
    info = sched.cache_stats()
    assert info.host_cached_tokens == sched.host_cached_tokens_total
    # 64 bytes a token here; a retracted request loads again without counting its hits again
    assert info.host_loaded_bytes >= info.host_cached_tokens * 64 > 0
    # each batch's loads are at least one run and at most one run a page
    assert 0 < info.host_load_runs <= info.host_loaded_bytes // (64 * info.page_size)
    assert 0 < info.host_write_runs <= info.host_written_bytes // (64 * info.page_size)
    # batches with loads / writes (the scheduler counts them as it sends them)
    assert 0 < info.host_load_steps <= info.host_loads
    assert 0 < info.host_write_steps <= info.host_write_runs


def test_host_page_runs():
    from radix_runtime.scheduler.kv import host_page_runs

    assert host_page_runs(np.array([9, 8, 7, 20, 3, 4], np.int32)) == 3  # 3-4, 7-9, 20
    assert host_page_runs(np.array([5], np.int32)) == 1
    assert host_page_runs(np.zeros(0, np.int32)) == 0


def test_kv_events_keep_host_blocks_cached_until_they_leave_both_tiers():
    """A subscriber applying every batch holds exactly the tree's blocks in either tier: moving
    to the host emits nothing, leaving the host emits BlockRemoved."""
    from radix_runtime import kv_events as kv

    args = ServerArgs(
        page_size=1, max_total_tokens=96, chunked_prefill_size=32, max_running_requests=3,
        radix_tree_impl="python", kv_events_endpoint="ipc://unused",
        enable_hierarchical_cache=True,
    )  # fmt: skip
    worker = TieredFakeWorker(97, 1, 3, 161)
    sched = Scheduler(args, worker.ready())
    driver = Driver(sched, worker)
    live = kv.KvIndex()
    prompts, arrivals = conversations(n=6, rounds=3, seed=2)
    sampling = m.SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    removed = 0
    for step in range(2000):
        for i, at in enumerate(arrivals):
            if at == step:
                sched.add_request(
                    m.GenerateReq(rid=f"r{i}", input_ids=m.pack_ids(prompts[i]), sampling=sampling)
                )
        driver.iteration()
        sched.take_outputs()
        batch = sched.kv_events.take_batch()
        if batch is not None:
            live.apply(kv.decode_batch(kv.encode(batch)))
            removed += sum(isinstance(ev, kv.BlockRemoved) for ev in batch.events)
        assert live.prefixes() == kv.tree_prefixes(sched.cache.dump(), 1), step
        if step > max(arrivals) and not driver.busy():
            break
    assert sched.host_cached_tokens_total > 0 and removed > 0  # both tiers were full at times


def test_a_load_that_does_not_pay_is_recomputed():
    """With a link far slower than prefill the cost model recomputes host hits; outputs stay."""
    prompts, arrivals = conversations()
    off, _ = run(prompts, arrivals, hicache=False, disable=True)
    original = KvBook.observe_step

    def slow_link(self, plan, result):
        self.load_bandwidth, self.prefill_tps = 1.0, 1e9  # 1 byte/s against 1e9 tokens/s
        original(self, plan, result)

    KvBook.observe_step = slow_link
    try:
        on, sched = run(prompts, arrivals, hicache=True)
    finally:
        KvBook.observe_step = original
    assert on == off
    assert sched.host_recomputed_tokens > 0 and sched.host_cached_tokens_total == 0


def test_a_host_pool_larger_than_memory_is_a_clear_error():
    import pytest
    import torch

    from radix_runtime.worker.host_pool import host_pool_pages
    from radix_runtime.worker.kv_pool import KVPool

    dev = KVPool(2, 9, 1, 1, 8, torch.float32, torch.device("cpu"))
    per_token = KVPool.bytes_per_token(2, 1, 8, torch.float32)
    assert host_pool_pages(dev, 0.0, 2.0, per_token) == 17
    with pytest.raises(RuntimeError, match="lower --hicache-size"):
        host_pool_pages(dev, 1e6, 2.0, per_token)  # a petabyte


def test_generate_meta_info_splits_cached_tokens_by_tier():
    from radix_runtime.frontend.contract import ChoiceState, GenerateChunk, GenerateInput
    from radix_runtime.frontend.rendering import native_output

    inp = GenerateInput(rid="r", input_ids=[5, 6, 7, 8], sampling=m.SamplingParams())
    state = ChoiceState(0, "r", [5, 6, 7, 8])
    state.add(GenerateChunk(ids=[9], cached_tokens=3, host_cached_tokens=2, finish_reason="length"))
    meta = native_output(state, inp)["meta_info"]
    assert (meta["cached_tokens"], meta["device_cached_tokens"], meta["host_cached_tokens"]) == (
        3,
        1,
        2,
    )


def test_a_load_goes_in_the_same_step_as_its_requests_first_prefill_chunk():
    """No load step of its own and no scheduler round trip: the batch that carries a load
    carries the prefill row of the request it is for (the worker orders the row after the
    copy on the device), so a host hit costs the copy, not a step."""
    prompts, arrivals = conversations()
    for page_size in (1, 4):
        for overlap in (False, True):
            sent = []
            _, sched = run(prompts, arrivals, hicache=True, page_size=page_size,
                           overlap=overlap, sent=sent, prefetch="off")  # fmt: skip
            assert sched.host_loads > 0
            with_loads = [b for b in sent if b.load_dst]
            assert with_loads
            for batch in with_loads:
                loaded = set(m.unpack_ids(batch.load_dst).tolist())
                rows = [r for r in batch.reqs
                        if loaded & set(m.unpack_ids(r.new_pages).tolist())]  # fmt: skip
                # the rows that receive the loaded pages: first steps of their requests,
                # computing the tokens right after what was loaded
                assert rows and all(r.new_slot and len(r.input_ids) > 0 for r in rows)
                assert loaded <= set().union(*(m.unpack_ids(r.new_pages).tolist() for r in rows))


# -- --hicache-prefetch arrival: a waiting request's host hit is loaded back when it arrives


def staggered(n=8, seed=0, max_gap=1):
    """n two-turn conversations: the first turns together, the second turns one a step later
    (while earlier ones run, so some wait: prefetch has time to work)."""
    prompts, _ = conversations(n=n, rounds=2, seed=seed)
    return prompts, [0] * n + [40 + max_gap * i for i in range(n)]


def _handed_out(sent) -> dict[int, list[int]]:
    """Each device page -> the indices of the batches whose rows were handed it."""
    out: dict[int, list[int]] = {}
    for i, batch in enumerate(sent):
        for r in getattr(batch, "reqs", ()):
            for page in m.unpack_ids(r.new_pages).tolist():
                out.setdefault(page, []).append(i)
    return out


def test_prefetch_on_arrival_loads_before_the_first_step_and_keeps_outputs():
    """Turns that arrive while the slots are full have their host hits loaded back on arrival
    (locked for them while they wait): every load is sent no later than the first batch that
    reads its pages, some strictly before it (the copy runs while the request waits), the
    loaded tokens count as host hits, and outputs equal cache off, with the copies sent on
    their own (HostCopies, as while a step runs) or with the next batch."""
    prompts, arrivals = staggered()
    off, _ = run(prompts, arrivals, hicache=False, disable=True)
    for page_size, early in ((1, True), (4, False)):
        sent = []
        on, sched = run(prompts, arrivals, hicache=True, page_size=page_size, overlap=True,
                        sent=sent, early=early, pool=160)  # fmt: skip
        assert on == off, (page_size, early)
        c = sched.counters
        assert c.host_prefetches > 0 and sched.host_cached_tokens_total > 0
        assert (c.host_early_copies > 0) == early
        # a loaded page is handed to its request's rows in the load's batch or, prefetched
        # while the request waited and sent at once, in a later one (the fake worker's
        # outputs check the order)
        handed, ahead = _handed_out(sent), 0
        for i, batch in enumerate(sent):
            for page in m.unpack_ids(batch.load_dst).tolist():
                ahead += min((j for j in handed.get(page, ()) if j >= i), default=i) > i
        assert (ahead > 0) == early
        # the counts by tier add up as without prefetching
        stats = sched.stats.report(sched)
        assert 0 < sched.host_cached_tokens_total <= sched.cached_tokens_total
        assert stats is not None


def test_prefetch_off_loads_with_the_first_chunk_only():
    prompts, arrivals = staggered()
    on, sched = run(prompts, arrivals, hicache=True, prefetch="off", overlap=True, pool=160)
    assert sched.counters.host_prefetches == 0 and sched.host_cached_tokens_total > 0


def test_abort_of_a_prefetched_waiting_request_frees_everything():
    """A request aborted while it waits with its prefetch: its lock goes, the loaded nodes stay
    cached (evictable), nothing leaks (check_integrity after every step: nothing locked once
    idle), and the other requests' outputs are unchanged."""
    prompts, arrivals = staggered()
    aborted = []

    def prefetched(rid):
        def at(sched, step):
            req = sched.reqs.get(rid)
            if req is not None and req.prefetch_node is not None:
                aborted.append(rid)
                return True
            return False

        return at

    victims = {f"r{i}": prefetched(f"r{i}") for i in range(8, 16, 2)}
    off, _ = run(prompts, arrivals, hicache=False, disable=True)
    for overlap in (False, True):
        aborted.clear()
        out, sched = run(prompts, arrivals, hicache=True, overlap=overlap, aborts=dict(victims),
                         early=overlap, pool=160)  # fmt: skip
        assert aborted and all(not out[v] for v in aborted)
        assert {k: out[k] for k in off if k not in victims} == {
            k: v for k, v in off.items() if k not in victims
        }
        assert sched.admission.prefetched() == 0
        sched.check_integrity()


def test_prefetch_under_memory_pressure_gives_way_and_keeps_outputs():
    """A pool too small for the running turns and the waiting turns' prefetches: the prefetches
    are given up (unlocked) before a running request is retracted or a step stalls, they never
    hold more than half the pool, and outputs still equal cache off."""
    prompts, arrivals = staggered(seed=1)
    off, _ = run(prompts, arrivals, hicache=False, disable=True, max_new=12)
    for overlap in (False, True):
        held = []

        def prefetched_pages(sched, step, held=held):
            ps = sched.page_size
            held.append(
                sum(r.prefetched_tokens // ps for r in sched.waiting if r.prefetch_node is not None)
            )

        on, sched = run(prompts, arrivals, hicache=True, pool=80, host=400, overlap=overlap,
                        max_new=12, early=overlap, between=prefetched_pages)  # fmt: skip
        assert on == off
        c = sched.counters
        assert c.host_prefetches > 0 and c.host_prefetches_dropped > 0 and sched.retractions > 0
        assert 0 < max(held) <= sched.allocator.total_pages // 2


def test_a_prefetched_node_evicted_meanwhile_is_recomputed():
    """A prefetch given up while its request waits, its nodes then dropped from both tiers
    (a cache flush): the request matches what is left when admitted and computes the rest;
    outputs equal cache off."""
    prompts, arrivals = conversations()
    off, _ = run(prompts, arrivals, hicache=False, disable=True)
    flushed = []

    def flush_after_prefetch(sched, step):
        waiting = [r for r in sched.waiting if r.prefetch_node is not None]
        if waiting and len(flushed) < 3:
            assert sched.admission.drop_prefetches()
            assert all(r.prefetch_node is None for r in waiting)
            sched.flush_cache()
            flushed.append(step)

    on, sched = run(prompts, arrivals, hicache=True, between=flush_after_prefetch)
    assert flushed and on == off
    assert sched.counters.host_prefetches_dropped >= len(flushed)


def test_host_hits_a_prefetched_request_computes_again_are_counted(monkeypatch):
    """A request holding a prefetch whose match grows, before its admission, into host-only
    nodes (cached by another request after the prefetch and evicted to the host since), and
    the load of those does not pay: they count in `host_recomputed_tokens`, as for a request
    without a prefetch, and outputs stay right."""
    args = ServerArgs(page_size=1, max_total_tokens=96, chunked_prefill_size=32,
                      max_running_requests=3, radix_tree_impl="python",
                      enable_hierarchical_cache=True, schedule_conservativeness=0.0,
                      disable_overlap_schedule=True)  # fmt: skip
    worker = TieredFakeWorker(97, 1, 3, 4097)
    sched = Scheduler(args, worker.ready())
    kv, cache = sched.kv, sched.kv.cache
    toks = list(range(1, 41))
    pages = kv.take_pages(20)
    worker.pool[pages, 0] = toks[:20]  # their KV (the fake worker's: the tokens)
    cache.insert(toks[:20], pages)  # cached, then evicted to the host
    assert cache.evict(20) == 20 and cache.match_prefix(toks[:20]).host_length == 20
    sampling = m.SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = toks[:30] + [77, 78]
    sched.add_request(m.GenerateReq(rid="r", input_ids=m.pack_ids(prompt), sampling=sampling))
    req = sched.reqs["r"]
    assert req.prefetch_node is not None and req.prefetched_tokens == 20
    # another request cached [20, 40) below the prefetched node; evicted to the host since
    loaded = cache.match_prefix(toks[:20]).pages
    pages = kv.take_pages(20)
    worker.pool[pages, 0] = toks[20:40]
    cache.insert(toks[:40], np.concatenate([loaded, pages]))
    assert cache.evict(20) == 20
    match = cache.match_prefix(prompt)
    assert (match.length, match.host_length) == (20, 10)
    monkeypatch.setattr(kv, "load_pays", lambda tokens: False)
    driver = Driver(sched, worker)
    out = []
    for _ in range(50):
        driver.iteration()
        out += m.unpack_ids(b"".join(o.new_ids for o in sched.take_outputs())).tolist()
        if not driver.busy():
            break
    off, _ = run([prompt], [0], hicache=False, disable=True, max_new=2)
    assert out == off["r0"]
    assert sched.counters.host_recomputed_tokens == 10
    assert req.cached_tokens == 20 and req.host_cached_tokens == 20
    sched.check_integrity()
