"""The scheduler: owns every decision about KV memory and batching. Torch-free.

One step reads as three lines (see `scheduler/main.py`): schedule, run on the worker, process the
result. `Scheduler` composes the parts, each in its own module:

- `admission.py` (`Admission`): requests in (validation, the grammar gate), and which waiting
  requests join a step (policy order, prefix matching, waiting for a prefix being computed);
- `kv.py` (`KvBook`): pages, slots, the radix tree and its host tier; growth, release, integrity;
- `queues.py` (`Queues`): the requests by state, finishing and retraction;
- `planner.py` (`Planner`): the next step's rows and batch, and the overlap schedule's step ahead;
- here: a step's result applied to its requests (`process_result`), and introspection.
"""

from __future__ import annotations

import time

from radix_runtime.config import ServerArgs, auto_max_running_requests
from radix_runtime.messages import (
    CacheStats,
    CompileGrammar,
    FlushCacheDone,
    ForwardBatch,
    ForwardResult,
    GenerateReq,
    GrammarCompiled,
    GrammarStats,
    HostCopies,
    ReqOutput,
    ServerInfo,
    WorkerReady,
    pack_floats,
    pack_ids,
    unpack_floats,
    unpack_ids,
)
from radix_runtime.scheduler.admission import Admission
from radix_runtime.scheduler.kv import KvBook
from radix_runtime.scheduler.planner import Planner
from radix_runtime.scheduler.queues import Queues
from radix_runtime.scheduler.request import PlannedReq, Req, ReqState
from radix_runtime.scheduler.stats import Counters, SchedulerStats

__all__ = ["PlannedReq", "Scheduler"]


def _total(name: str) -> property:
    return property(lambda self: getattr(self.counters, name), doc=f"Counters.{name}")


class Scheduler:
    def __init__(self, args: ServerArgs, worker: WorkerReady):
        # the request slots: as the worker sized them, else as it would have (the same rule)
        slots = worker.max_running_requests or args.max_running_requests
        slots = slots or auto_max_running_requests((worker.num_pages - 1) * worker.page_size)
        args = args.replace(max_running_requests=slots)
        self._args = args
        self.page_size = worker.page_size
        self.context_length = worker.context_length
        self.vocab_size = worker.vocab_size
        self.kv_cache_dtype, self.quantization = worker.kv_cache_dtype, worker.quantization
        self.eos_ids = set(worker.eos_token_ids)
        self.max_running = args.max_running_requests
        self.counters = Counters()
        # /metrics: the histograms and the reports (none with --disable-metrics)
        self.stats = None if args.disable_metrics else SchedulerStats(self.counters)
        self.kv = KvBook(args, worker, self.counters)
        self.queues = Queues(self.kv, self.counters)
        self.admission = Admission(
            args, self.context_length, self.vocab_size, self.kv, self.queues, self.counters,
            self.stats,
        )  # fmt: skip
        self.planner = Planner(
            args, self.context_length, self.kv, self.admission, self.queues, self.counters
        )

    # the parts' state, under the names the process, /metrics and the tests read (read-only:
    # replace a part's state on the part, e.g. `sched.kv.cache`)
    args = property(lambda self: self._args)
    allocator = property(lambda self: self.kv.allocator)
    host_allocator = property(lambda self: self.kv.host_allocator)
    cache = property(lambda self: self.kv.cache)
    tree_impl = property(lambda self: self.kv.tree_impl)
    kv_events = property(lambda self: self.kv.kv_events)
    waiting = property(lambda self: self.queues.waiting)
    running = property(lambda self: self.queues.running)
    reqs = property(lambda self: self.queues.reqs)
    grammar_waiting = property(lambda self: self.admission.grammar_waiting)

    step_id = _total("step_id")
    prompt_tokens_total = _total("prompt_tokens_total")
    cached_tokens_total = _total("cached_tokens_total")
    decode_steps = _total("decode_steps")
    jumped_tokens = _total("jumped_tokens")
    retractions = _total("retractions")
    integrity_checks = _total("integrity_checks")
    host_cached_tokens_total = _total("host_cached_tokens_total")
    host_recomputed_tokens = _total("host_recomputed_tokens")
    host_loads = _total("host_loads")

    @property
    def capacity_tokens(self) -> int:
        return self.kv.capacity_tokens

    # -----------------------------------------------------------------------------------------
    # requests in

    def add_request(self, msg: GenerateReq) -> None:
        self.admission.add(msg)

    def take_early_copies(self) -> HostCopies | None:
        """The host tier's copies queued since the last batch (prefetches of requests read while
        a step runs), to send to the worker now rather than with the next batch; None if none."""
        if self.host_allocator is None:
            return None
        copies = HostCopies()
        self.kv.attach_copies(copies)
        if not (copies.write_src or copies.load_src):
            return None
        self.counters.host_early_copies += 1
        return copies

    def grammar_compiled(self, msg: GrammarCompiled) -> None:
        self.admission.grammar_compiled(msg)

    def take_worker_messages(self) -> list[CompileGrammar]:
        return self.admission.take_worker_messages()

    def abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is None:
            return
        if req.state is ReqState.WAITING:
            self.admission.remove_waiting(req)
        elif req.state is ReqState.RUNNING:
            self.running.remove(req)
            self.kv.release(req)
        self.queues.outbox.append(self.queues.finish(req, "abort"))

    # -----------------------------------------------------------------------------------------
    # schedule

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[ForwardBatch, list[PlannedReq]] | None:
        """The next step, with nothing in flight."""
        return self.planner.schedule()

    def schedule_ahead(
        self, inflight: list[PlannedReq]
    ) -> tuple[ForwardBatch, list[PlannedReq]] | None:
        """Step N+1 while step N (`inflight`) runs, or None (see `Planner.schedule_ahead`)."""
        return self.planner.schedule_ahead(inflight)

    # -----------------------------------------------------------------------------------------
    # results

    def process_result(self, plan: list[PlannedReq], result: ForwardResult) -> None:
        outputs = self.queues.outbox
        if self.host_allocator is not None:
            self.kv.observe_step(plan, result)
        for p, res in zip(plan, result.results):
            req = p.req
            if req.state is not ReqState.RUNNING:
                # aborted while the step ran, or (a run-ahead row) finished by the step before
                continue
            start = req.kv_len
            if p.start >= 0 and start != p.start:
                raise AssertionError(
                    f"{req.rid}: a run-ahead step computed from {p.start}, the request is at {start}"
                )
            req.kv_len += p.num_tokens
            out = ReqOutput(
                rid=req.rid,
                prompt_tokens=len(req.prompt),
                cached_tokens=req.cached_tokens,
                host_cached_tokens=req.host_cached_tokens,
            )
            has_news = False
            if res.prompt_logprobs:
                lps = unpack_floats(res.prompt_logprobs)
                first = start + 1
                keep = max(req.logprob_start_len, first) - first
                if keep < len(lps):
                    out.prompt_logprob_start = first + keep
                    out.prompt_logprobs = pack_floats(lps[keep:])
                    if res.prompt_top_ids:  # k per position
                        k = req.top_logprobs_num
                        out.prompt_top_ids = res.prompt_top_ids[4 * k * keep :]
                        out.prompt_top_logprobs = res.prompt_top_logprobs[4 * k * keep :]
                    has_news = True
            if p.sample:
                token = int(res.next_id)
                req.output_ids.append(token)
                self.counters.generation_tokens += 1
                if self.stats is not None and len(req.output_ids) == 1:
                    self.stats.first_token(time.perf_counter() - req.admitted_at)
                if req.return_logprob:
                    out.output_logprobs = pack_floats([res.logprob])
                    out.top_ids, out.top_logprobs = res.top_ids, res.top_logprobs
                has_news = True
                reason = self._finish_reason(req, token, res)
                new_ids = [token]
                if reason is None and res.jump_ids:
                    # jump-forward: tokens the grammar forces; the next step computes them
                    for forced in unpack_ids(res.jump_ids).tolist():
                        req.output_ids.append(forced)
                        new_ids.append(forced)
                        reason = self._finish_reason(req, forced)
                        if reason is not None:
                            break
                    self.counters.jumped_tokens += len(new_ids) - 1
                    self.counters.generation_tokens += len(new_ids) - 1
                out.new_ids = pack_ids(new_ids)
                if reason is not None:
                    finished = self.queues.end(req, reason)
                    out.finish_reason, out.matched_stop = finished.finish_reason, req.matched_stop
                    if reason == "error":
                        out.error, out.error_code = req.error, "grammar_error"
                elif start < len(req.prompt) or p.num_tokens > 1:
                    self.kv.cache_unfinished(req)
            elif req.prefill_only and req.kv_len >= req.all_len:
                out.finish_reason = self.queues.end(req, "length").finish_reason
                has_news = True
            else:
                self.kv.cache_unfinished(req)
            if has_news:
                outputs.append(out)

    def _finish_reason(self, req: Req, token: int, res=None) -> str | None:
        sp = req.sampling
        if res is not None and res.grammar_error is not None:
            req.error = res.grammar_error
            return "error"
        if not sp.ignore_eos and token in self.eos_ids:
            req.matched_stop = token
            return "stop"
        if token in sp.stop_token_ids:
            req.matched_stop = token
            return "stop"
        if res is not None and res.grammar_done:
            req.matched_stop = token
            return "stop"  # the grammar ended (a stop token it accepted while ignore_eos is on)
        if len(req.output_ids) >= sp.max_new_tokens or req.all_len >= self.context_length:
            return "length"
        return None

    def take_outputs(self) -> list[ReqOutput]:
        return self.queues.take_outputs()

    # -----------------------------------------------------------------------------------------
    # control and introspection

    def flush_cache(self) -> FlushCacheDone:
        return self.kv.flush_cache()

    def cache_stats(self) -> CacheStats:
        return self.kv.cache_stats()

    def grammar_stats(self) -> GrammarStats | None:
        return self.admission.grammar_stats()

    def server_info(self) -> ServerInfo:
        return ServerInfo(
            cache=self.cache_stats(),
            running_requests=len(self.running),
            waiting_requests=len(self.waiting),
            max_total_tokens=self.capacity_tokens,
            max_running_requests=self.max_running,
            context_length=self.context_length,
            vocab_size=self.vocab_size,
            decode_steps=self.decode_steps,
            steps=self.step_id,
            jumped_tokens=self.jumped_tokens,
            grammar=self.grammar_stats(),
            retractions=self.retractions,
            integrity_checks=self.integrity_checks,
            kv_cache_dtype=self.kv_cache_dtype,
            quantization=self.quantization,
        )

    def check_integrity(self) -> None:
        """Every page is free, cached in the tree, or owned by exactly one running request; when
        idle, nothing is locked and every slot is free."""
        self.kv.check_integrity(self.running, self.admission.prefetched())
