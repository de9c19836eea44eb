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
):
    """Run prompts to completion; `arrivals[i]` is the step at which request i arrives."""
    args = ServerArgs(
        page_size=page_size,
        max_total_tokens=pool_tokens,
        disable_radix_cache=disable,
        schedule_policy=policy,
        chunked_prefill_size=chunk,
        max_running_requests=max_running,
        radix_tree_impl="python",
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


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
def test_cache_on_equals_cache_off(page_size, policy):
    prompts = shared_prefix_prompts()
    arrivals = [i // 3 * 5 for i in range(len(prompts))]
    off, _, _ = run_workload(prompts, 12, page_size=page_size, disable=True, arrivals=arrivals)
    on, fin, sched = run_workload(
        prompts, 12, page_size=page_size, policy=policy, arrivals=arrivals
    )
    assert on == off
    assert sched.cached_tokens_total > 0, "the shared prefixes must hit"
    assert set(fin) == {f"r{i}" for i in range(len(prompts))}


@pytest.mark.parametrize("page_size", [1, 16])
def test_pressure_evicts_and_retracts_without_changing_outputs(page_size):
    prompts = shared_prefix_prompts(seed=1, n=16)
    off, _, _ = run_workload(prompts, 24, page_size=page_size, disable=True, pool_tokens=4096)
    on, _, sched = run_workload(prompts, 24, page_size=page_size, pool_tokens=256, max_running=8)
    assert on == off
    assert sched.retractions > 0, "a 256-token pool must force retraction"


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
)
def test_random_workloads_cache_on_equals_off(seed, page_size, pool, chunk):
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
    )
    on, _, _ = run_workload(
        prompts,
        10,
        page_size=page_size,
        pool_tokens=pool,
        chunk=chunk,
        arrivals=arrivals,
        max_running=4,
    )
    assert on == off
