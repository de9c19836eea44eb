"""The scheduler against a fake worker that *reads its KV from the pages it was told about*.

The fake "model" stores each token id in the page slot the scheduler assigned, and predicts the
next token from the sequence it reads back through the page table. A wrong page table (a freed
page reused, a duplicate page swapped badly, a missed resend) reads the wrong tokens and changes
the outputs, so "outputs with the cache on == outputs with it off" checks the page bookkeeping.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.scheduler.scheduler import Scheduler

VOCAB = 97
EOS = 0


class FakeWorker:
    def __init__(self, num_pages: int, page_size: int, max_slots: int, context: int = 4096):
        self.page_size = page_size
        self.pool = np.full((num_pages, page_size), -1, dtype=np.int64)
        self.table = np.zeros((max_slots, context // page_size + 2), dtype=np.int64)
        self.num_pages = num_pages
        self.context = context

    def ready(self) -> m.WorkerReady:
        return m.WorkerReady(
            num_pages=self.num_pages,
            page_size=self.page_size,
            context_length=self.context,
            vocab_size=VOCAB,
            eos_token_ids=[EOS],
            device="cpu",
            dtype="int",
            attention_backend="fake",
        )

    def forward(self, batch: m.ForwardBatch) -> m.ForwardResult:
        results = []
        # a batch must never write one page slot twice (two requests sharing a page they both own)
        written: set[tuple[int, int]] = set()
        for r in batch.reqs:
            pages = m.unpack_ids(r.new_pages)
            self.table[r.slot, r.page_offset : r.page_offset + len(pages)] = pages
            ids = m.unpack_ids(r.input_ids)
            for i, tok in enumerate(ids):
                pos = r.start_pos + i
                page, off = self.table[r.slot, pos // self.page_size], pos % self.page_size
                assert page != 0, "wrote into the reserved page 0"
                assert (page, off) not in written, "two requests wrote the same KV slot"
                written.add((page, off))
                self.pool[page, off] = tok
            if not r.sample:
                results.append(m.ForwardReqResult())
                continue
            n = r.start_pos + len(ids)
            seq = [
                int(self.pool[self.table[r.slot, p // self.page_size], p % self.page_size])
                for p in range(n)
            ]
            assert -1 not in seq, "read a KV slot nobody wrote"
            h = 0
            for t in seq:
                h = (h * 31 + t + 7) % 1_000_003
            results.append(m.ForwardReqResult(next_id=h % VOCAB))
        return m.ForwardResult(step=batch.step, results=results)


def run_workload(
    prompts,
    max_new,
    *,
    page_size=1,
    pool_tokens=4096,
    disable=False,
    policy="lpm",
    chunk=64,
    max_running=8,
    arrivals=None,
    check_every_step=True,
    mixed=False,
    trace=None,
):
    """Run prompts to completion; `arrivals[i]` is the step at which request i arrives.

    `mixed` sets enable_mixed_chunk; `trace`, a list, gets one entry per step: the batch's
    (rid, num_tokens) pairs, in order (empty when nothing was scheduled)."""
    args = ServerArgs(
        page_size=page_size,
        max_total_tokens=pool_tokens,
        disable_radix_cache=disable,
        schedule_policy=policy,
        chunked_prefill_size=chunk,
        max_running_requests=max_running,
        radix_tree_impl="python",
        enable_mixed_chunk=mixed,
    )
    worker = FakeWorker(pool_tokens // page_size + 1, page_size, max_running)
    sched = Scheduler(args, worker.ready())
    arrivals = arrivals or [0] * len(prompts)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    finished: dict[str, str] = {}
    step = 0
    pending = list(range(len(prompts)))
    while pending or sched.has_work():
        for i in [i for i in pending if arrivals[i] <= step]:
            sched.add_request(
                m.GenerateReq(
                    rid=f"r{i}",
                    input_ids=m.pack_ids(prompts[i]),
                    sampling=m.SamplingParams(max_new_tokens=max_new, temperature=0.0),
                )
            )
            pending.remove(i)
        scheduled = sched.schedule()
        if trace is not None:
            trace.append([(p.req.rid, p.num_tokens) for p in scheduled[1]] if scheduled else [])
        if scheduled is not None:
            batch, plan = scheduled
            sched.process_result(plan, worker.forward(batch))
        for out in sched.take_outputs():
            assert out.error is None, out.error
            outputs[out.rid].extend(m.unpack_ids(out.new_ids).tolist())
            if out.finish_reason:
                finished[out.rid] = out.finish_reason
        if check_every_step:
            sched.check_integrity()
        step += 1
        assert step < 100_000, "no progress"
    sched.check_integrity()
    stats = sched.cache_stats()
    assert stats.free_pages + stats.evictable_pages == stats.total_pages
    assert stats.protected_pages == 0
    return outputs, finished, sched


def shared_prefix_prompts(seed=0, n=12):
    rng = random.Random(seed)
    system = [rng.randrange(1, VOCAB) for _ in range(70)]
    doc = [rng.randrange(1, VOCAB) for _ in range(40)]
    prompts = []
    for i in range(n):
        depth = i % 4
        p = list(system[: 20 * (depth + 1)])
        if depth == 3:
            p += doc
        p += [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 12))]
        prompts.append(p)
    prompts.append(list(prompts[0]))  # fully cached prompt (identical to an earlier one)
    prompts.append(list(system[:20]))  # a prompt that is a prefix of others
    return prompts


MODES = pytest.mark.parametrize("mixed", [False, True], ids=["prefill_first", "mixed"])


def check_cache_on_equals_cache_off(page_size, policy, mixed):
    prompts = shared_prefix_prompts()
    arrivals = [i // 3 * 5 for i in range(len(prompts))]
    # the reference is always mixed with the cache off: outputs must not depend on the mode either
    off, _, _ = run_workload(
        prompts, 12, page_size=page_size, disable=True, arrivals=arrivals, mixed=True
    )
    on, fin, sched = run_workload(
        prompts, 12, page_size=page_size, policy=policy, arrivals=arrivals, mixed=mixed
    )
    assert on == off
    assert sched.cached_tokens_total > 0, "the shared prefixes must hit"
    assert set(fin) == {f"r{i}" for i in range(len(prompts))}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
def test_cache_on_equals_cache_off(page_size, policy):
    check_cache_on_equals_cache_off(page_size, policy, mixed=False)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
def test_cache_on_equals_cache_off_mixed(page_size, policy):
    check_cache_on_equals_cache_off(page_size, policy, mixed=True)


def check_pressure_evicts_and_retracts(page_size, mixed):
    prompts = shared_prefix_prompts(seed=1, n=16)
    off, _, _ = run_workload(
        prompts, 24, page_size=page_size, disable=True, pool_tokens=4096, mixed=True
    )
    # run_workload checks integrity every step and at the end (no leaked pages or slots)
    on, _, sched = run_workload(
        prompts, 24, page_size=page_size, pool_tokens=256, max_running=8, mixed=mixed
    )
    assert on == off
    assert sched.retractions > 0, "a 256-token pool must force retraction"


@pytest.mark.parametrize("page_size", [1, 16])
def test_pressure_evicts_and_retracts_without_changing_outputs(page_size):
    check_pressure_evicts_and_retracts(page_size, mixed=False)


@pytest.mark.parametrize("page_size", [1, 16])
def test_pressure_evicts_and_retracts_without_changing_outputs_mixed(page_size):
    check_pressure_evicts_and_retracts(page_size, mixed=True)


def decoding_scheduler(
    n_decoders=2, *, mixed=False, max_running=8, pool_tokens=4096, chunk=64, max_new=40
):
    """A scheduler (and its fake worker) with `n_decoders` requests already decoding."""
    args = ServerArgs(
        max_total_tokens=pool_tokens,
        max_running_requests=max_running,
        chunked_prefill_size=chunk,
        radix_tree_impl="python",
        enable_mixed_chunk=mixed,
    )
    worker = FakeWorker(pool_tokens + 1, 1, max_running)
    sched = Scheduler(args, worker.ready())
    for i in range(n_decoders):
        add(sched, f"d{i}", [10 + i, 20, 30, 40 + i], max_new)
    while not all(r.is_decoding for r in sched.running) or sched.waiting:
        step(sched, worker)
    return sched, worker


def add(sched, rid, prompt, max_new):
    sched.add_request(
        m.GenerateReq(
            rid=rid,
            input_ids=m.pack_ids(prompt),
            sampling=m.SamplingParams(max_new_tokens=max_new, temperature=0.0),
        )
    )


def step(sched, worker) -> list[tuple[str, int]]:
    """One scheduler step; returns the batch as (rid, num_tokens) pairs."""
    batch, plan = sched.schedule()
    rows = [(p.req.rid, p.num_tokens) for p in plan]
    sched.process_result(plan, worker.forward(batch))
    return rows


@MODES
def test_new_request_prefills_alone_unless_mixed(mixed):
    sched, worker = decoding_scheduler(2, mixed=mixed)
    add(sched, "new", list(range(1, 31)), 5)
    decode_steps = sched.decode_steps
    rows = step(sched, worker)
    if mixed:
        assert rows == [("d0", 1), ("d1", 1), ("new", 30)]
    else:
        assert rows == [("new", 30)], "a prefill step holds no decode rows"
        assert sched.decode_steps == decode_steps
    # then everyone decodes together
    assert step(sched, worker) == [("d0", 1), ("d1", 1), ("new", 1)]


@MODES
def test_long_prompt_chunks_then_decodes_resume(mixed):
    short = [[10, 20, 30, 40], [11, 21, 31, 41]]
    long_prompt = [1 + i % 90 for i in range(100)]
    prompts = [*short, long_prompt]
    trace: list = []
    out, fin, _ = run_workload(prompts, 30, chunk=16, arrivals=[0, 0, 3], mixed=mixed, trace=trace)
    ref, _, _ = run_workload(prompts, 30, chunk=16, arrivals=[0, 0, 3], disable=True, mixed=True)
    assert out == ref, "greedy outputs do not depend on the scheduling mode"
    assert set(fin) == {"r0", "r1", "r2"} and len(out["r0"]) == len(out["r1"]) == 30
    # the steps that carry r2's prompt: 100 tokens in chunks of 16 (prefill-first) or of 16 minus
    # the two decode rows (mixed)
    chunks = [(i, n) for i, rows in enumerate(trace) for rid, n in rows if rid == "r2" and n > 1]
    assert sum(n for _, n in chunks) == 100
    assert [n for _, n in chunks] == ([16] * 6 + [4] if not mixed else [14] * 7 + [2])
    for i, _ in chunks:
        assert [rid for rid, _ in trace[i] if rid != "r2"] == ([] if not mixed else ["r0", "r1"])
    # after the prefill all three decode together
    assert trace[chunks[-1][0] + 1] == [("r0", 1), ("r1", 1), ("r2", 1)]


@MODES
def test_waiting_request_without_a_slot_does_not_stall_decodes(mixed):
    sched, worker = decoding_scheduler(2, mixed=mixed, max_running=2)
    add(sched, "late", list(range(1, 9)), 3)
    for _ in range(10):
        assert step(sched, worker) == [("d0", 1), ("d1", 1)]
    assert [r.rid for r in sched.waiting] == ["late"]
    while sched.has_work():
        step(sched, worker)
    sched.check_integrity()
    done = {o.rid: o.finish_reason for o in sched.take_outputs() if o.finish_reason}
    assert done == {"d0": "length", "d1": "length", "late": "length"}


@MODES
def test_waiting_request_without_memory_does_not_stall_decodes(mixed):
    # 64 tokens of KV: two decoders of 4 + 10 tokens fit; a 60-token prompt only once they finish
    sched, worker = decoding_scheduler(2, mixed=mixed, pool_tokens=64, max_new=10)
    add(sched, "late", list(range(1, 61)), 3)
    for _ in range(9):
        assert step(sched, worker) == [("d0", 1), ("d1", 1)]
    assert [r.rid for r in sched.waiting] == ["late"]
    assert step(sched, worker) == [("late", 60)]
    while sched.has_work():
        step(sched, worker)
        sched.check_integrity()
    done = {o.rid: o.finish_reason for o in sched.take_outputs() if o.finish_reason}
    assert done == {"d0": "length", "d1": "length", "late": "length"}
    assert sched.retractions == 0, "admission keeps room for the decoders"


def drive_decoder_and_long_prompt(pool_tokens, mixed):
    """A decodes while B's 36-token prompt arrives in chunks of 16; returns outputs, batches."""
    sched, worker = decoding_scheduler(
        1, mixed=mixed, pool_tokens=pool_tokens, chunk=16, max_new=30
    )
    for _ in range(3):
        step(sched, worker)
    add(sched, "b", list(range(1, 37)), 3)
    trace = []
    while sched.has_work():
        trace.append(step(sched, worker))
        sched.check_integrity()
        assert len(trace) < 200
    outs: dict[str, list[int]] = {}
    for o in sched.take_outputs():
        outs.setdefault(o.rid, []).extend(m.unpack_ids(o.new_ids).tolist())
    return outs, trace, sched


@MODES
def test_decoder_retracted_for_a_blocked_prefill_then_resumes(mixed):
    ref, _, _ = drive_decoder_and_long_prompt(4096, mixed=True)
    outs, trace, sched = drive_decoder_and_long_prompt(40, mixed=mixed)
    assert outs == ref and len(outs["d0"]) == 30
    assert sched.retractions == 1
    if not mixed:
        # B's third chunk does not fit next to d0's next page: d0 decodes; then d0 cannot grow,
        # is retracted, and its pages go to B's chunk in the same step (no empty step)
        assert trace[:4] == [[("b", 16)], [("b", 16)], [("d0", 1)], [("b", 4)]]


@MODES
def test_dfs_weight_order_survives_node_splits(mixed):
    # matching one waiting request can split a tree node that another's parent walk went through
    rng = random.Random(161)
    prompts = shared_prefix_prompts(seed=161, n=12)
    arrivals = sorted(rng.randrange(0, 40) for _ in prompts)
    chunk = rng.choice([16, 64, 256])
    ref, _, _ = run_workload(prompts, 8, disable=True, arrivals=arrivals, chunk=chunk, mixed=True)
    out, _, _ = run_workload(
        prompts, 8, policy="dfs-weight", arrivals=arrivals, chunk=chunk, mixed=mixed
    )
    assert out == ref


def test_enable_mixed_chunk_flag():
    import argparse

    from radix_runtime.config import add_server_args, args_from_namespace

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert args_from_namespace(parser.parse_args([])).enable_mixed_chunk is False
    assert args_from_namespace(parser.parse_args(["--enable-mixed-chunk"])).enable_mixed_chunk


def test_multi_turn_hits_whole_history():
    prompts = [[5, 6, 7, 8, 9, 10, 11]]
    out, _, sched = run_workload(prompts, 6)
    second = prompts[0] + out["r0"] + [12, 13]
    sched.add_request(
        m.GenerateReq(
            rid="turn2",
            input_ids=m.pack_ids(second),
            sampling=m.SamplingParams(max_new_tokens=2, temperature=0.0),
        )
    )
    sched.schedule()
    req = sched.reqs["turn2"]
    # prompt + output of turn 1 are cached, except the last sampled token (never computed)
    assert req.cached_tokens == len(prompts[0]) + len(out["r0"]) - 1


def test_prompt_larger_than_pool_is_rejected_and_queue_proceeds():
    args = ServerArgs(max_total_tokens=64, radix_tree_impl="python")
    worker = FakeWorker(65, 1, 8)
    sched = Scheduler(args, worker.ready())
    sched.add_request(
        m.GenerateReq(rid="big", input_ids=m.pack_ids([1] * 100), sampling=m.SamplingParams())
    )
    sched.add_request(
        m.GenerateReq(
            rid="ok", input_ids=m.pack_ids([1, 2, 3]), sampling=m.SamplingParams(max_new_tokens=3)
        )
    )
    outs = sched.take_outputs()
    assert outs[0].rid == "big" and outs[0].error_code == "kv_cache_too_small"
    while sched.has_work():
        batch, plan = sched.schedule()
        sched.process_result(plan, worker.forward(batch))
    done = [o for o in sched.take_outputs() if o.finish_reason]
    assert [o.rid for o in done] == ["ok"]


def test_abort_unlocks_pages():
    args = ServerArgs(max_total_tokens=512, radix_tree_impl="python", chunked_prefill_size=16)
    worker = FakeWorker(513, 1, 8)
    sched = Scheduler(args, worker.ready())
    for i in range(3):
        sched.add_request(
            m.GenerateReq(
                rid=f"a{i}",
                input_ids=m.pack_ids(list(range(1, 40))),
                sampling=m.SamplingParams(max_new_tokens=50),
            )
        )
    for _ in range(3):
        batch, plan = sched.schedule()
        sched.process_result(plan, worker.forward(batch))
    for i in range(3):
        sched.abort(f"a{i}")
    reasons = {o.rid: o.finish_reason for o in sched.take_outputs() if o.finish_reason}
    assert reasons == {"a0": "abort", "a1": "abort", "a2": "abort"}
    assert not sched.has_work()
    sched.check_integrity()
    assert sched.cache.protected_pages == 0


def test_in_batch_prefix_is_computed_once():
    shared = [1 + i % 90 for i in range(100)]
    prompts = [shared + [i + 1] for i in range(4)]
    _, _, sched = run_workload(prompts, 2, chunk=512)
    # the first computes the 100 shared tokens; the other three hit them
    assert sched.cached_tokens_total >= 3 * 100


def test_prefill_only_request_warms_the_cache():
    args = ServerArgs(max_total_tokens=512, radix_tree_impl="python")
    worker = FakeWorker(513, 1, 8)
    sched = Scheduler(args, worker.ready())
    sched.add_request(
        m.GenerateReq(
            rid="warm",
            input_ids=m.pack_ids(list(range(1, 30))),
            sampling=m.SamplingParams(max_new_tokens=0),
        )
    )
    while sched.has_work():
        batch, plan = sched.schedule()
        assert all(not fr.sample for fr in batch.reqs)
        sched.process_result(plan, worker.forward(batch))
    outs = sched.take_outputs()
    assert outs[-1].finish_reason == "length" and not outs[-1].new_ids
    assert sched.cache.evictable_pages == 29


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    page_size=st.sampled_from([1, 4, 16]),
    pool=st.sampled_from([128, 256, 1024]),
    chunk=st.sampled_from([16, 48, 256]),
    mixed=st.booleans(),
)
def test_random_workloads_cache_on_equals_off(seed, page_size, pool, chunk, mixed):
    rng = random.Random(seed)
    bases = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(5, 60))] for _ in range(3)]
    prompts = []
    for _ in range(rng.randrange(2, 10)):
        b = rng.choice(bases)
        p = b[: rng.randrange(1, len(b) + 1)] + [
            rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 20))
        ]
        prompts.append(p)
    arrivals = sorted(rng.randrange(0, 30) for _ in prompts)
    off, _, _ = run_workload(
        prompts,
        10,
        page_size=page_size,
        disable=True,
        pool_tokens=2048,
        chunk=chunk,
        arrivals=arrivals,
        mixed=True,
    )
    on, _, _ = run_workload(
        prompts,
        10,
        page_size=page_size,
        pool_tokens=pool,
        chunk=chunk,
        arrivals=arrivals,
        max_running=4,
        mixed=mixed,
    )
    assert on == off
