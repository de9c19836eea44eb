"""The scheduler against a fake worker that *reads its KV from the pages it was told about*.

The fake "model" stores each token id in the page slot the scheduler assigned, and predicts the
next token from the sequence it reads back through the page table. A wrong page table (a freed
page reused, a duplicate page swapped badly, a missed resend) reads the wrong tokens and changes
the outputs, so "outputs with the cache on == outputs with it off" checks the page bookkeeping.

With `overlap=True` the drivers run the scheduler process's loop: step N+1 is built
(`schedule_ahead`) and run before N's result is processed, decoders feeding the token their slot
just sampled (`from_last_sample`), which the fake worker, like the real one, keeps per slot.
The fake worker runs a batch when it is sent, as the GPU runs steps in the order they are sent.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.scheduler.main import advance
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
        self.last_sampled: dict[int, int] = {}  # slot -> the token it sampled last
        self.fed_from_last = 0  # rows that fed the slot's last sampled token
        self.sampled_rows = 0

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
        for slot in batch.released_slots:
            self.last_sampled.pop(slot, None)
        for r in batch.reqs:
            if r.new_slot:
                self.last_sampled.pop(r.slot, None)
            pages = m.unpack_ids(r.new_pages)
            self.table[r.slot, r.page_offset : r.page_offset + len(pages)] = pages
            ids = m.unpack_ids(r.input_ids)
            if r.from_last_sample:
                assert len(ids) == 0 and r.slot in self.last_sampled, "nothing sampled to feed"
                ids = [self.last_sampled[r.slot]]
                self.fed_from_last += 1
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
            self.last_sampled[r.slot] = h % VOCAB
            self.sampled_rows += 1
        return m.ForwardResult(step=batch.step, results=results)


class Driver:
    """The scheduler process's step loop (`scheduler.main.advance`) against a FakeWorker, one
    turn at a time: with the overlap schedule on, step N+1 is sent before N's result is
    processed."""

    def __init__(self, sched: Scheduler, worker: FakeWorker):
        self.sched, self.worker = sched, worker
        self.inflight = None  # (plan, result)
        self.trace: list[list[tuple[str, int]]] = []  # each sent batch's (rid, num_tokens)
        self.ahead_steps = 0  # batches built by schedule_ahead

    def send(self, batch, plan):
        self.trace.append([(p.req.rid, p.num_tokens) for p in plan])
        return self.worker.forward(batch)

    def busy(self) -> bool:
        return self.sched.has_work() or self.inflight is not None

    def iteration(self) -> None:
        self.inflight, _ = advance(self.sched, self.inflight, self.send, self.sched.process_result)
        self.ahead_steps += self.inflight is not None  # what stays in flight was built ahead


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
    overlap=False,
    stop_ids=(),
    aborts=None,
    info=None,
    ignore_eos=False,
    namespaces=None,
    on_step=None,
    extra_args=None,
):
    """Run prompts to completion; `namespaces[i]` is request i's cache namespace ("": public); `arrivals[i]` is the step at which request i arrives.

    `mixed` sets enable_mixed_chunk; `trace`, a list, gets one entry per step: the batch's
    (rid, num_tokens) pairs, in order (empty when nothing was scheduled; with `overlap`, one
    entry per batch sent). `overlap` runs the overlap schedule's loop; `stop_ids` are stop token
    ids; `aborts` maps a rid to the step at which it is aborted; `info`, a dict, gets the
    driver's counters; `on_step(sched, step)` runs before each iteration (where the scheduler
    process handles control messages); `extra_args`: more ServerArgs fields."""
    args = ServerArgs(
        page_size=page_size,
        max_total_tokens=pool_tokens,
        disable_radix_cache=disable,
        schedule_policy=policy,
        chunked_prefill_size=chunk,
        max_running_requests=max_running,
        radix_tree_impl="python",
        enable_mixed_chunk=mixed,
        disable_overlap_schedule=not overlap,
        **(extra_args or {}),
    )
    worker = FakeWorker(pool_tokens // page_size + 1, page_size, max_running)
    sched = Scheduler(args, worker.ready())
    driver = Driver(sched, worker)
    arrivals = arrivals or [0] * len(prompts)
    aborts = dict(aborts or {})
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    finished: dict[str, str] = {}
    step = 0
    pending = list(range(len(prompts)))
    sampling = m.SamplingParams(
        max_new_tokens=max_new,
        temperature=0.0,
        stop_token_ids=list(stop_ids),
        ignore_eos=ignore_eos,
    )
    while pending or driver.busy():
        for i in [i for i in pending if arrivals[i] <= step]:
            sched.add_request(
                m.GenerateReq(
                    rid=f"r{i}",
                    input_ids=m.pack_ids(prompts[i]),
                    sampling=sampling,
                    cache_namespace=namespaces[i] if namespaces else "",
                )
            )
            pending.remove(i)
        arrived = {f"r{i}" for i in range(len(prompts)) if i not in pending}
        for rid in [rid for rid, at in aborts.items() if at <= step and rid in arrived]:
            sched.abort(rid)
            del aborts[rid]
        if on_step is not None:
            on_step(sched, step)
        sent = len(driver.trace)
        driver.iteration()
        if trace is not None:
            trace.extend(driver.trace[sent:] or [[]])
        for out in sched.take_outputs():
            assert out.error is None, out.error
            outputs[out.rid].extend(m.unpack_ids(out.new_ids).tolist())
            if out.finish_reason:
                assert out.rid not in finished, "finished twice"
                finished[out.rid] = out.finish_reason
        if check_every_step:
            sched.check_integrity()
        step += 1
        assert step < 100_000, "no progress"
    sched.check_integrity()
    stats = sched.cache_stats()
    assert stats.free_pages + stats.evictable_pages == stats.total_pages
    assert stats.protected_pages == 0
    if info is not None:
        info.update(
            ahead_steps=driver.ahead_steps,
            steps=len(driver.trace),
            fed_from_last=worker.fed_from_last,
            sampled_rows=worker.sampled_rows,
        )
    if not overlap:
        assert driver.ahead_steps == 0 and worker.fed_from_last == 0
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
OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])


def check_cache_on_equals_cache_off(page_size, policy, mixed, overlap=False):
    prompts = shared_prefix_prompts()
    arrivals = [i // 3 * 5 for i in range(len(prompts))]
    # the reference is always mixed with the cache off: outputs must not depend on the mode either
    off, _, _ = run_workload(
        prompts, 12, page_size=page_size, disable=True, arrivals=arrivals, mixed=True
    )
    on, fin, sched = run_workload(
        prompts,
        12,
        page_size=page_size,
        policy=policy,
        arrivals=arrivals,
        mixed=mixed,
        overlap=overlap,
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
def test_cache_on_equals_cache_off_overlap(page_size, policy):
    check_cache_on_equals_cache_off(page_size, policy, mixed=False, overlap=True)


@OVERLAP
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
def test_cache_on_equals_cache_off_mixed(page_size, policy, overlap):
    check_cache_on_equals_cache_off(page_size, policy, mixed=True, overlap=overlap)


def check_pressure_evicts_and_retracts(page_size, mixed, overlap=False):
    prompts = shared_prefix_prompts(seed=1, n=16)
    off, _, _ = run_workload(
        prompts, 24, page_size=page_size, disable=True, pool_tokens=4096, mixed=True
    )
    # run_workload checks integrity every step and at the end (no leaked pages or slots)
    on, _, sched = run_workload(
        prompts,
        24,
        page_size=page_size,
        pool_tokens=256,
        max_running=8,
        mixed=mixed,
        overlap=overlap,
        # admission reserves only the decoders' next pages: the decoders outgrow the pool
        extra_args={"schedule_conservativeness": 0.0},
    )
    assert on == off
    assert sched.retractions > 0, "a 256-token pool must force retraction"


@pytest.mark.parametrize("page_size", [1, 16])
def test_pressure_evicts_and_retracts_without_changing_outputs(page_size):
    check_pressure_evicts_and_retracts(page_size, mixed=False)


@pytest.mark.parametrize("page_size", [1, 16])
def test_pressure_evicts_and_retracts_without_changing_outputs_overlap(page_size):
    check_pressure_evicts_and_retracts(page_size, mixed=False, overlap=True)


@OVERLAP
@pytest.mark.parametrize("page_size", [1, 16])
def test_pressure_evicts_and_retracts_without_changing_outputs_mixed(page_size, overlap):
    check_pressure_evicts_and_retracts(page_size, mixed=True, overlap=overlap)


def decoding_scheduler(
    n_decoders=2,
    *,
    mixed=False,
    max_running=8,
    pool_tokens=4096,
    chunk=64,
    max_new=40,
    conservativeness=1.0,
):
    """A scheduler (and its fake worker) with `n_decoders` requests already decoding
    (`conservativeness`: --schedule-conservativeness; 0 lets admission outgrow the pool)."""
    args = ServerArgs(
        max_total_tokens=pool_tokens,
        max_running_requests=max_running,
        chunked_prefill_size=chunk,
        radix_tree_impl="python",
        enable_mixed_chunk=mixed,
        schedule_conservativeness=conservativeness,
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


@OVERLAP
@MODES
def test_long_prompt_chunks_then_decodes_resume(mixed, overlap):
    short = [[10, 20, 30, 40], [11, 21, 31, 41]]
    long_prompt = [1 + i % 90 for i in range(100)]
    prompts = [*short, long_prompt]
    trace: list = []
    out, fin, _ = run_workload(
        prompts, 30, chunk=16, arrivals=[0, 0, 3], mixed=mixed, trace=trace, overlap=overlap
    )
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
        1, mixed=mixed, pool_tokens=pool_tokens, chunk=16, max_new=30, conservativeness=0.0
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


@OVERLAP
@MODES
def test_dfs_weight_order_survives_node_splits(mixed, overlap):
    # matching one waiting request can split a tree node that another's parent walk went through
    rng = random.Random(161)
    prompts = shared_prefix_prompts(seed=161, n=12)
    arrivals = sorted(rng.randrange(0, 40) for _ in prompts)
    chunk = rng.choice([16, 64, 256])
    ref, _, _ = run_workload(prompts, 8, disable=True, arrivals=arrivals, chunk=chunk, mixed=True)
    out, _, _ = run_workload(
        prompts,
        8,
        policy="dfs-weight",
        arrivals=arrivals,
        chunk=chunk,
        mixed=mixed,
        overlap=overlap,
    )
    assert out == ref


def test_enable_mixed_chunk_flag():

    from radix_runtime.config import parse_server_args

    assert parse_server_args([]).enable_mixed_chunk is False
    assert parse_server_args(["--enable-mixed-chunk"]).enable_mixed_chunk


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


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefix_longer_than_a_chunk_is_computed_once(overlap, mixed, page_size):
    """Requests sharing a prefix that takes the first one several chunks to compute (a long
    document, concurrent questions) wait until it is in the tree instead of computing its later
    chunks again; they may arrive together or while it is being computed."""
    shared = [1 + i % 90 for i in range(230)]  # 64-token chunks leave 38 (>= the threshold)
    prompts = [shared + [91 + i] * 20 for i in range(5)]
    out, fin, sched = run_workload(
        prompts, 3, chunk=64, overlap=overlap, mixed=mixed, page_size=page_size,
        arrivals=[0, 0, 1, 2, 5],
    )  # fmt: skip
    # the first computes the 230 shared tokens (in four chunks); the other four hit all of them
    # that fill whole pages
    assert sched.cached_tokens_total == 4 * (230 // page_size * page_size)
    # and the outputs are those of the cache-off server
    ref_out, ref_fin, _ = run_workload(
        prompts, 3, chunk=64, overlap=overlap, mixed=mixed, page_size=page_size,
        arrivals=[0, 0, 1, 2, 5], disable=True,
    )  # fmt: skip
    assert (out, fin) == (ref_out, ref_fin)


@pytest.mark.parametrize("prompt_logprobs", [False, True])
def test_waiting_for_a_shared_prefix_only_when_it_can_be_matched(prompt_logprobs):
    """B arrives while A computes their shared 250 tokens. B waits for A's last chunk and then
    matches all of them; but a B that asks for the prompt's logprobs from position 0 cannot
    match them anyway (those positions must be computed), so it starts at once."""
    shared = [1 + i % 90 for i in range(250)]
    args = ServerArgs(max_total_tokens=1024, radix_tree_impl="python", chunked_prefill_size=200)
    worker = FakeWorker(1025, 1, 8)
    sched = Scheduler(args, worker.ready())
    sampling = m.SamplingParams(max_new_tokens=2, temperature=0.0)

    def add(rid, tail, **kw):
        ids = m.pack_ids(shared + [tail] * 20)
        sched.add_request(m.GenerateReq(rid=rid, input_ids=ids, sampling=sampling, **kw))

    def step():
        batch, plan = sched.schedule()
        sched.process_result(plan, worker.forward(batch))
        return [(p.req.rid, p.num_tokens) for p in plan]

    add("A", 91)
    assert step() == [("A", 200)]
    add("B", 92, logprob_start_len=0 if prompt_logprobs else -1)
    if prompt_logprobs:
        assert step() == [("A", 70), ("B", 130)]
        assert sched.reqs["B"].cached_tokens == 0
    else:
        assert step() == [("A", 70)]  # B waits: A's last chunk holds 50 tokens B shares
        assert step() == [("B", 20)]
        assert sched.reqs["B"].cached_tokens == 250


@pytest.mark.parametrize("overlap", [False, True])
def test_namespaces_share_nothing_in_the_tree_or_in_a_batch(overlap):
    """The same long prompt in three namespaces, then again in each: the first of each
    namespace computes all of it (the others, arriving together, do not wait for a prefix they
    could never match), the repeats hit their own namespace's copy; outputs equal cache-off."""
    prompt = [1 + i % 90 for i in range(150)]
    spaces = ["", "salt-a", "salt-b"]
    prompts, namespaces = [prompt] * 6, spaces * 2
    arrivals = [0, 0, 0, 40, 40, 40]
    trace: list = []
    out, _, sched = run_workload(
        prompts, 3, chunk=512, overlap=overlap, arrivals=arrivals, namespaces=namespaces,
        trace=trace,
    )  # fmt: skip
    first_step = [rid for rid, _ in trace[0]]
    assert first_step == ["r0", "r1", "r2"], trace[0]  # nobody waited for another namespace
    assert sched.cached_tokens_total == 3 * 149  # each repeat hits its own copy only
    ref, _, _ = run_workload(prompts, 3, chunk=512, arrivals=arrivals, disable=True)
    assert out == ref


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
    overlap=st.booleans(),
)
def test_random_workloads_cache_on_equals_off(seed, page_size, pool, chunk, mixed, overlap):
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
    # cache salts: most requests public, some in one of two salted namespaces
    namespaces = [rng.choice(["", "", "", "a", "b"]) for _ in prompts]
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
        overlap=overlap,
        namespaces=namespaces,
    )
    assert on == off


# ---------------------------------------------------------------------------------------------
# the overlap schedule


@MODES
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("chunk", [16, 64])
def test_overlap_equals_sync_with_stops_and_aborts(page_size, chunk, mixed):
    """Stop-token finishes mid-batch (their run-ahead row discarded), max-token finishes,
    chunked prefills and aborts of requests in flight: the outputs equal a synchronous run's
    and a cache-off run's, and no page or slot leaks (run_workload checks integrity every step
    and that every page is free or evictable at the end)."""
    prompts = shared_prefix_prompts(seed=7)
    arrivals = [i // 3 * 4 for i in range(len(prompts))]
    stops = [3, 5, 7, 11, 13]
    aborts = {"r1": 3, "r6": 9, "r12": 14}
    kw = dict(page_size=page_size, chunk=chunk, arrivals=arrivals, stop_ids=stops, mixed=mixed)
    ref, ref_fin, _ = run_workload(prompts, 16, disable=True, **kw)
    sync, sync_fin, _ = run_workload(prompts, 16, aborts=aborts, **kw)
    info: dict = {}
    over, over_fin, sched = run_workload(prompts, 16, aborts=aborts, overlap=True, info=info, **kw)
    assert "stop" in ref_fin.values() and "length" in ref_fin.values()
    for fin in (sync_fin, over_fin):
        assert set(fin) == set(ref_fin)
        assert {rid for rid, why in fin.items() if why == "abort"} <= set(aborts)
    for rid, tokens in ref.items():
        for got, fin in ((sync, sync_fin), (over, over_fin)):
            if fin[rid] == "abort":  # cut short; what it produced is still the reference's
                assert got[rid] == tokens[: len(got[rid])]
            else:
                assert got[rid] == tokens and fin[rid] == ref_fin[rid]
    assert info["ahead_steps"] > info["steps"] // 2, "the overlap schedule must run ahead"
    assert info["fed_from_last"] > 0
    # the run-ahead rows wasted are those of requests a stop token or an abort ended
    wasted = info["sampled_rows"] - sum(len(v) for v in over.values())
    assert 0 < wasted <= sum(why in ("stop", "abort") for why in over_fin.values())
    assert sched.cached_tokens_total > 0


@MODES
def test_overlap_wastes_nothing_on_length_finishes(mixed):
    """A request that reaches max_new_tokens at step N is known to finish without its token:
    it gets no row in N+1 (every sampled row's token is delivered)."""
    prompts = shared_prefix_prompts(seed=3)
    info: dict = {}
    out, fin, _ = run_workload(
        prompts, 9, chunk=32, mixed=mixed, overlap=True, info=info, ignore_eos=True
    )
    assert set(fin.values()) == {"length"} and all(len(v) == 9 for v in out.values())
    assert info["sampled_rows"] == 9 * len(prompts)
    assert info["ahead_steps"] > info["steps"] // 2


def run_after_stop(page_size, overlap):
    """One request that ends on a stop token, then its next turn: the tokens the tree holds."""
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    probe, _, _ = run_workload([prompt], 20, ignore_eos=True)
    out = probe["r0"]
    i = next(i for i in range(4, len(out)) if out[i] not in out[:i])
    stop = out[i]
    outs, fin, sched = run_workload(
        [prompt], 20, page_size=page_size, stop_ids=[stop], overlap=overlap, ignore_eos=True
    )
    assert fin == {"r0": "stop"} and outs["r0"] == out[: i + 1]
    history = prompt + outs["r0"]
    cached = sched.cache.match_prefix(np.asarray(history + [1, 2, 3], np.int32)).length
    return cached, sched.cache.evictable_pages


@pytest.mark.parametrize("page_size", [1, 4])
def test_stop_finish_caches_no_run_ahead_token(page_size):
    """With the overlap schedule the step after a stop-token finish already fed the stop token
    (its K/V written into a page of the request); the tree must hold exactly what a synchronous
    run caches: the history but the last sampled token, in full pages."""
    sync = run_after_stop(page_size, overlap=False)
    over = run_after_stop(page_size, overlap=True)
    assert over == sync
    cached, _ = sync
    assert cached == (9 + 5 - 1) // page_size * page_size  # 9 prompt + 5 output tokens


def test_schedule_ahead_falls_back_instead_of_retracting():
    # 2 decoders in a 15-token pool: after two steps and a run-ahead one, the step after the
    # next does not fit next to them (a retraction), so the run-ahead falls back
    sched, worker = decoding_scheduler(2, pool_tokens=15, max_new=40, conservativeness=0.0)
    fell_back = False
    for _ in range(20):
        scheduled = sched.schedule()
        if scheduled is None:
            break
        batch, plan = scheduled
        retractions, free = sched.retractions, sched.allocator.free_pages
        ahead = sched.schedule_ahead(plan)
        if ahead is None:
            fell_back = True
            assert sched.retractions == retractions and sched.allocator.free_pages == free
            sched.process_result(plan, worker.forward(batch))
        else:
            a_batch, a_plan = ahead
            assert all(fr.from_last_sample and not fr.input_ids for fr in a_batch.reqs)
            r1, r2 = worker.forward(batch), worker.forward(a_batch)
            sched.process_result(plan, r1)
            sched.process_result(a_plan, r2)
        sched.check_integrity()
    assert fell_back and sched.retractions > 0


def test_overlap_flag():

    from radix_runtime.config import parse_server_args

    assert parse_server_args([]).disable_overlap_schedule is False
    assert parse_server_args(["--disable-overlap-schedule"]).disable_overlap_schedule


# ---------------------------------------------------------------------------------------------
# --max-consecutive-prefill-steps: decoders wait at most N prefill steps under a burst


def decoder_gaps(trace, rid: str) -> list[int]:
    """Steps without a row of `rid` between two consecutive steps with one, once `rid` decodes
    (its rows after its last prefill chunk)."""
    steps = [i for i, rows in enumerate(trace) if any(r == rid for r, _ in rows)]
    decoding = [i for i in steps if dict(trace[i])[rid] == 1]
    return [b - a - 1 for a, b in zip(decoding, decoding[1:])]


def burst_workload():
    """Two short prompts decode while six long ones (4 prefill chunks of 64 each) arrive."""
    rng = random.Random(11)
    short = [[rng.randrange(1, VOCAB) for _ in range(6)] for _ in range(2)]
    long = [[rng.randrange(1, VOCAB) for _ in range(250)] for _ in range(6)]
    return short + long, [0, 0] + [4] * 6


@OVERLAP
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_cap_bounds_the_decoders_wait(overlap, page_size):
    prompts, arrivals = burst_workload()
    kw = dict(page_size=page_size, arrivals=arrivals, overlap=overlap, ignore_eos=True)
    free_trace, capped_trace = [], []
    free, _, _ = run_workload(prompts, 60, trace=free_trace, **kw)
    for cap, trace in ((1, capped_trace), (3, [])):
        capped, _, sched = run_workload(
            prompts, 60, trace=trace, extra_args={"max_consecutive_prefill_steps": cap}, **kw
        )
        assert capped == free  # the same tokens, in steps of other shapes
        assert sched.retractions == 0
        if cap == 1:
            capped_trace = trace
    # prefill first: the burst's 24 chunks stall the decoders for many steps in a row
    assert max(decoder_gaps(free_trace, "r0")) >= 8
    # capped at 1: never more than one prefill step between two of their decode steps
    for rid in ("r0", "r1"):
        gaps = decoder_gaps(capped_trace, rid)
        assert gaps and max(gaps) <= 1, gaps
    # and the burst still gets its prefill steps (no starvation): every other step at most
    assert len(capped_trace) <= 2 * len(free_trace)


@OVERLAP
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_cap_cache_on_equals_off(overlap, page_size):
    prompts = shared_prefix_prompts(seed=4)
    arrivals = [i // 3 * 2 for i in range(len(prompts))]
    kw = dict(page_size=page_size, arrivals=arrivals, max_new=24)
    off, _, _ = run_workload(prompts, disable=True, **kw)
    cap = {"max_consecutive_prefill_steps": 1}
    on, _, sched = run_workload(prompts, overlap=overlap, extra_args=cap, **kw)
    assert on == off
    assert sched.cache_stats().cached_tokens > 0


def test_prefill_cap_flag():

    from radix_runtime.config import parse_server_args

    assert parse_server_args([]).max_consecutive_prefill_steps == 0
    assert (
        parse_server_args(["--max-consecutive-prefill-steps", "2"]).max_consecutive_prefill_steps
        == 2
    )
    with pytest.raises(ValueError, match="max-consecutive-prefill-steps"):
        parse_server_args(["--max-consecutive-prefill-steps", "-1"])
