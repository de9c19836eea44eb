"""The scheduler: owns every decision about KV memory and batching. Torch-free.

One step reads as three lines (see `scheduler/main.py`): schedule, run on the worker, process the
result. By default `schedule()` is prefill-first (as SGLang): when any prefill work can be
scheduled, the step holds only prefill chunks within the token budget (chunked prefill),
continuing requests first, then new ones in policy order; otherwise it is a decode-only step
(every decoding request gets one token), which the worker can replay as a CUDA graph. With
`--enable-mixed-chunk` every step is mixed: decodes first, prefill chunks fill the rest of the
budget. Memory pressure is met by evicting cached prefixes first, then by retracting running
requests (their computed KV goes into the tree, so the retry mostly hits the cache).

Overlap (the default; `--disable-overlap-schedule` turns it off): while the worker computes step
N, `schedule_ahead(plan N)` builds step N+1 before N's result is processed. See its docstring
for what it covers, when it falls back, and why reusing pages stays safe.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from radix_runtime.config import ServerArgs
from radix_runtime.grammar import SCHEDULER_KNOWN_GRAMMARS
from radix_runtime.kv_events import KvEventLog
from radix_runtime.messages import (
    CacheStats,
    CompileGrammar,
    FlushCacheDone,
    ForwardBatch,
    ForwardReq,
    ForwardResult,
    GenerateReq,
    GrammarCompiled,
    GrammarStats,
    ReqOutput,
    ServerInfo,
    WorkerReady,
    pack_floats,
    pack_ids,
    unpack_floats,
    unpack_ids,
)
from radix_runtime.scheduler.allocator import PageAllocator
from radix_runtime.scheduler.cache import make_radix_cache
from radix_runtime.scheduler.policy import order_waiting
from radix_runtime.scheduler.radix_cache import RadixCache
from radix_runtime.scheduler.request import PageRow, Req, ReqState
from radix_runtime.scheduler.stats import SchedulerStats

logger = logging.getLogger(__name__)

# A waiting request that shares at least this many not-yet-cached tokens with a request that is
# computing them (admitted in this step, still prefilling, or prefilling in the step in flight)
# waits until they are cached, so the shared prefix is computed once and then matched.
IN_BATCH_SHARE_THRESHOLD = 32


# an output token sampled by the in-flight step, not known yet (only while schedule_ahead runs)
PENDING_TOKEN = -1

# The host tier's cost model (docs/hicache.md): loading n tokens costs LOAD_LATENCY_S +
# n * kv_bytes_per_token / load_bandwidth (measured by the worker at start); recomputing them
# costs n / prefill tokens-per-second (measured on prefill steps of at least
# PREFILL_SAMPLE_MIN_TOKENS tokens, an exponential average). Until a prefill was measured,
# loads are taken.
LOAD_LATENCY_S = 50e-6
PREFILL_SAMPLE_MIN_TOKENS = 32


@dataclass
class PlannedReq:
    req: Req
    num_tokens: int
    sample: bool
    start: int = -1  # kv_len the step starts from (run-ahead steps; checked when processed)


class Scheduler:
    def __init__(self, args: ServerArgs, worker: WorkerReady):
        self.args = args
        self.page_size = worker.page_size
        self.context_length = worker.context_length
        self.vocab_size = worker.vocab_size
        self.kv_cache_dtype, self.quantization = worker.kv_cache_dtype, worker.quantization
        self.eos_ids = set(worker.eos_token_ids)
        self.allocator = PageAllocator(worker.num_pages)
        # the host tier (--enable-hierarchical-cache): the worker sized and allocated its pool
        self.host_allocator = None
        if worker.host_num_pages > 1 and not args.disable_radix_cache:
            self.host_allocator = PageAllocator(worker.host_num_pages)
        self.kv_bytes_per_token = worker.kv_bytes_per_token
        self.load_bandwidth = worker.load_bandwidth
        self.prefill_tps = 0.0  # measured prefill tokens per second (the cost model's)
        self.cache = make_radix_cache(
            args.radix_tree_impl,
            self.page_size,
            self.allocator,
            disable=args.disable_radix_cache,
            host_allocator=self.host_allocator,
            write_through=args.hicache_write_policy == "write_through",
        )
        self.tree_impl = "python" if isinstance(self.cache, RadixCache) else "cpp"
        self.max_running = args.max_running_requests
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        self.free_slots = list(range(self.max_running - 1, -1, -1))
        self.released_slots: list[int] = []
        self.outbox: list[ReqOutput] = []  # replies for the tokenizer process, sent after each step
        # constrained decoding: a request whose grammar the worker has not compiled yet waits
        # here (not in `waiting`) until the worker reports it compiled (or invalid)
        self.grammar_waiting: dict[tuple[str, str], list[Req]] = {}
        self.known_grammars: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.worker_outbox: list[CompileGrammar] = []  # sent to the worker before the next step
        self.grammar_requests = self.grammar_hits = self.grammar_compiles = self.grammar_failed = 0
        self.compile_times: deque[float] = deque(maxlen=1000)  # the latest compiles (seconds)
        self.step_id = 0
        self.arrivals = 0
        # statistics
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.decode_steps = 0
        self.jumped_tokens = 0  # output tokens appended by jump-forward (no decode step each)
        self.retractions = 0
        self.integrity_checks = 0
        self.host_cached_tokens_total = 0
        self.host_recomputed_tokens = 0
        self.host_loads = 0
        self.host_loaded_bytes = 0
        self.host_written_bytes = 0
        self.host_load_s = 0.0
        # /metrics: increments since the last report (none with --disable-metrics)
        self.stats = None if args.disable_metrics else SchedulerStats()
        # --kv-events-endpoint: what enters and leaves the tree, as events (kv_events.py)
        self.kv_events: KvEventLog | None = None
        if args.kv_events_endpoint and not self.cache.disable:
            self.kv_events = KvEventLog(self.page_size, args.dp_rank)
            self.cache.set_evict_observer(self.kv_events.evicted)
            if self.host_allocator is not None:
                self.cache.set_tier_observer(self.kv_events.tier_moved)

    # -----------------------------------------------------------------------------------------
    # requests in

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.total_pages * self.page_size

    def add_request(self, msg: GenerateReq) -> None:
        if len(msg.input_ids) % 4:
            # NOTE: not raw int32s, so not from our tokenizer: refuse it rather than crash
            logger.warning("dropped request %r: input_ids is not an int32 buffer", msg.rid)
            self.outbox.append(
                ReqOutput(
                    rid=msg.rid,
                    finish_reason="error",
                    error="input_ids is not an int32 buffer",
                    error_code="invalid_request",
                )
            )
            return
        prompt = unpack_ids(msg.input_ids).copy()
        error = self._reject_reason(msg, prompt)
        if error is not None:
            message, code = error
            self.outbox.append(
                ReqOutput(rid=msg.rid, finish_reason="error", error=message, error_code=code)
            )
            return
        req = Req(
            rid=msg.rid,
            prompt=prompt,
            sampling=msg.sampling,
            arrival=self.arrivals,
            return_logprob=msg.return_logprob,
            top_logprobs_num=msg.top_logprobs_num,
            logprob_start_len=msg.logprob_start_len,
            namespace=msg.cache_namespace or None,
            arrived_at=time.perf_counter(),
        )
        self.arrivals += 1
        self.reqs[req.rid] = req
        key = msg.sampling.grammar
        if key is not None:
            self.grammar_requests += 1
        if key is None or key in self.known_grammars:
            if key is not None:
                self.known_grammars.move_to_end(key)
                self.grammar_hits += 1
            self.waiting.append(req)
        elif key in self.grammar_waiting:  # compiling now: no compile of its own either
            self.grammar_waiting[key].append(req)
            self.grammar_hits += 1
        else:
            self.grammar_waiting[key] = [req]
            self.worker_outbox.append(CompileGrammar(kind=key[0], text=key[1]))

    def grammar_compiled(self, msg: GrammarCompiled) -> None:
        """The worker compiled a grammar: its requests may run, or fail (an invalid grammar)."""
        key = (msg.kind, msg.text)
        reqs = self.grammar_waiting.pop(key, [])
        if not msg.cache_hit:
            self.grammar_compiles += 1
            self.compile_times.append(msg.compile_s)
        if msg.error is not None:
            self.grammar_failed += 1
            for req in reqs:
                if self.reqs.get(req.rid) is req:
                    out = self._finish(req, "error")
                    out.error, out.error_code = msg.error, "invalid_grammar"
                    self.outbox.append(out)
            return
        self.known_grammars[key] = None
        self.known_grammars.move_to_end(key)
        while len(self.known_grammars) > SCHEDULER_KNOWN_GRAMMARS:
            self.known_grammars.popitem(last=False)
        self.waiting.extend(r for r in reqs if self.reqs.get(r.rid) is r)

    def take_worker_messages(self) -> list[CompileGrammar]:
        out, self.worker_outbox = self.worker_outbox, []
        return out

    def _reject_reason(self, msg: GenerateReq, prompt: np.ndarray) -> tuple[str, str] | None:
        if msg.rid in self.reqs:
            return f"duplicate request id {msg.rid!r}", "duplicate_request_id"
        if len(prompt) == 0:
            return "the prompt is empty", "invalid_prompt"
        if prompt.min() < 0 or prompt.max() >= self.vocab_size:
            return f"token ids must be in [0, {self.vocab_size})", "invalid_token_id"
        if len(prompt) >= self.context_length:
            return (
                f"the prompt has {len(prompt)} tokens; the context holds {self.context_length}",
                "context_length_exceeded",
            )
        if len(prompt) + 1 > self.capacity_tokens:
            return (
                f"the prompt needs {len(prompt) + 1} tokens of KV cache but the pool holds "
                f"{self.capacity_tokens} (--max-total-tokens)",
                "kv_cache_too_small",
            )
        return None

    def abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is None:
            return
        if req.state is ReqState.WAITING:
            if req in self.waiting:
                self.waiting.remove(req)
            else:  # its grammar is compiling
                self.grammar_waiting[req.sampling.grammar].remove(req)
        elif req.state is ReqState.RUNNING:
            self.running.remove(req)
            self._release(req)
        self.outbox.append(self._finish(req, "abort"))

    # -----------------------------------------------------------------------------------------
    # schedule

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[ForwardBatch, list[PlannedReq]] | None:
        """The next step, with nothing in flight."""
        plan = self._plan()
        if not plan:
            return None
        return self._make_batch(plan), plan

    def _plan(self, ahead: bool = False, shared_with: list[Req] = ()) -> list[PlannedReq] | None:
        """The next step's rows. `ahead` (schedule_ahead): never retract or finish a request
        here; None when that would be needed (the caller falls back)."""
        plan: list[PlannedReq] = []
        budget = self.args.chunked_prefill_size
        if self.args.enable_mixed_chunk:
            if not self._schedule_decodes(plan, ahead):
                return None
            budget = self._schedule_running_prefills(plan, max(budget - len(plan), 0))
            self._schedule_waiting(plan, budget, self._decode_reserve(), shared_with)
        else:
            # prefill-first; the decoders' next pages stay free, so a prefill never forces a
            # retraction, and a prefill that cannot go now leaves the step to the decodes
            reserve = self._decode_reserve()
            budget = self._schedule_running_prefills(plan, budget, reserve)
            self._schedule_waiting(plan, budget, reserve, shared_with)
            if not plan:
                running = len(self.running)
                if not self._schedule_decodes(plan, ahead):
                    return None
                if not plan and len(self.running) < running:
                    # every decoder left: their pages may fit a prefill
                    return self._plan(ahead, shared_with)
        if not plan and len(self.running) > 1 and not ahead:
            # every running request is mid-prefill and none can grow: free the newest one's pages
            self._retract(max(self.running, key=lambda r: r.arrival))
            return self._plan()
        return plan or None

    def _make_batch(self, plan: list[PlannedReq]) -> ForwardBatch:
        self.step_id += 1
        batch = ForwardBatch(
            step=self.step_id,
            reqs=[self._forward_req(p) for p in plan],
            released_slots=self._take_released_slots(),
        )
        if self.host_allocator is not None:
            self._attach_copies(batch)
        return batch

    def _attach_copies(self, batch: ForwardBatch) -> None:
        """The host tier's copies the tree queued since the last batch: the worker makes them
        before this step's model runs (writes, then loads), so a load is in place before any
        step reads it and a write has read its device pages before a step reuses them."""
        copies = self.cache.take_copies()
        page_bytes = self.page_size * self.kv_bytes_per_token
        if copies.writes:
            src = np.concatenate([c.src for c in copies.writes])
            batch.write_src = pack_ids(src)
            batch.write_dst = pack_ids(np.concatenate([c.dst for c in copies.writes]))
            batch.writes_block = copies.writes_block
            self.host_written_bytes += len(src) * page_bytes
        if copies.loads:
            src = np.concatenate([c.src for c in copies.loads])
            batch.load_src = pack_ids(src)
            batch.load_dst = pack_ids(np.concatenate([c.dst for c in copies.loads]))
            self.host_loads += len(copies.loads)
            self.host_loaded_bytes += len(src) * page_bytes

    def _load_pays(self, tokens: int) -> bool:
        """Whether loading `tokens` tokens from the host is faster than computing them."""
        if self.prefill_tps <= 0 or self.load_bandwidth <= 0:
            return True
        load_s = LOAD_LATENCY_S + tokens * self.kv_bytes_per_token / self.load_bandwidth
        return load_s <= tokens / self.prefill_tps

    def _observe_step(self, plan: list[PlannedReq], result: ForwardResult) -> None:
        """Feed the cost model: prefill throughput of this step, and the loads' time."""
        self.host_load_s += result.load_s
        tokens = sum(p.num_tokens for p in plan if p.num_tokens > 1)
        if tokens >= PREFILL_SAMPLE_MIN_TOKENS and result.forward_s > 0:
            tps = tokens / result.forward_s
            self.prefill_tps = tps if self.prefill_tps <= 0 else 0.8 * self.prefill_tps + 0.2 * tps

    # -----------------------------------------------------------------------------------------
    # the overlap schedule: one step ahead

    def schedule_ahead(
        self, inflight: list[PlannedReq]
    ) -> tuple[ForwardBatch, list[PlannedReq]] | None:
        """Step N+1, built while step N (`inflight`, sent, its result not processed) runs on the
        worker; None when it is not easy, and the caller processes N's result first and then
        schedules as usual (`schedule()`).

        How: N's rows are advanced as if N's result were processed, its sampled tokens being
        unknown (`PENDING_TOKEN`), then the usual step is planned; a request whose token is
        pending decodes with `from_last_sample` (the worker feeds it the token its slot just
        sampled, on the device). Requests that N finishes by length (max_new_tokens, context,
        prefill-only) stay out of N+1: that is known without the token. Then the advance is
        undone: `process_result(N)` applies N's result as always, and `process_result(N+1)`
        finds each row's request where N+1 expected it (`PlannedReq.start`).

        Fall-back cases (None): the overlap schedule is off; the step would need a retraction,
        or to finish a request that cannot grow (memory pressure); nothing to schedule.

        Requests finished by N's result (EOS or a stop token id: unknown until then) or aborted
        while N+1 runs have their N+1 row discarded by `process_result` (the request is no longer
        running). Their release inserts only the KV that `kv_len` counts (N's tokens, never the
        token N+1 feeds: its K/V lands in a page past the last full page inserted, which is
        freed, or in a partial page, also freed) and frees the page(s) N+1 took for them.

        Why freeing and reusing pages while a step runs is safe: the worker runs steps in the
        order they are sent, on one CUDA stream. A page freed while processing N's result (or
        on an abort) can only be handed out by a batch built afterwards, i.e. N+2 or later,
        whose kernels run after N+1's: every read or write of the page by N and N+1 (the
        discarded row included) precedes the new owner's writes, and the new owner reads only
        positions it has written. Pages evicted from the tree while building N+1 are unlocked,
        so no running request (no row of N) reads them; a request aborted during N whose pages
        are reused by N+1 is read by N before N+1 writes. Tree insertions made while processing
        N cover only KV that N or earlier steps computed, and are read only by later steps.
        Duplicate pages swapped for the tree's while processing N (`_cache_unfinished`) may
        still be read by N+1 (they hold the same valid K/V until a later step reuses them);
        N+1 never writes into them (it writes past the inserted full pages).
        """
        if self.args.disable_overlap_schedule:
            return None
        rows = [p for p in inflight if p.req.state is ReqState.RUNNING]
        # whose KV computed by N is not in the tree until N's result is processed
        prefilling_in_n = [p.req for p in rows if not p.req.is_decoding]
        finishing = set()
        for p in rows:
            req = p.req
            if p.sample:
                if (
                    len(req.output_ids) + 1 >= req.sampling.max_new_tokens
                    or req.all_len + 1 >= self.context_length
                    or self._may_jump(req)  # its next tokens are not known: it sits N+1 out
                ):
                    finishing.add(id(req))
            elif req.prefill_only and req.kv_len + p.num_tokens >= req.all_len:
                finishing.add(id(req))
        for p in rows:  # advance as if N's result were in
            p.req.kv_len += p.num_tokens
            if p.sample:
                p.req.output_ids.append(PENDING_TOKEN)
                p.req.pending_token = True
        saved = self.running
        self.running = [r for r in saved if id(r) not in finishing]
        plan: list[PlannedReq] | None = None
        batch = None
        try:
            plan = self._plan(ahead=True, shared_with=prefilling_in_n)
            if plan:
                for p in plan:
                    p.start = p.req.kv_len
                batch = self._make_batch(plan)
        finally:
            kept = {id(r) for r in saved}
            self.running = saved + [r for r in self.running if id(r) not in kept]
            for p in rows:  # undo the advance
                p.req.kv_len -= p.num_tokens
                if p.sample:
                    p.req.output_ids.pop()
                    p.req.pending_token = False
        if batch is None:
            return None
        return batch, plan

    def _schedule_decodes(self, plan: list[PlannedReq], ahead: bool = False) -> bool:
        """Every decoding request gets one token. False (nothing changed) when `ahead` and that
        needs a retraction."""
        decoders = [r for r in self.running if r.is_decoding]
        # every decoder whose next token starts a new page needs one; retract until they fit
        while decoders:
            need = sum(1 for r in decoders if self._pages_needed(r, 1) > 0)
            if self._available_pages() >= need:
                break
            if ahead:
                return False
            victim = max(decoders, key=lambda r: r.arrival)
            if len(self.running) == 1:
                # alone and out of memory: it can never grow, so it ends here
                self.running.remove(victim)
                self._release(victim)
                self.outbox.append(self._finish(victim, "length"))
                decoders.remove(victim)
                continue
            self._retract(victim)
            decoders.remove(victim)
        # the decoders' new pages in one allocation (page size 1: every decoder, every step)
        growing = [r for r in decoders if self._pages_needed(r, 1) > 0]
        if growing:
            pages = self._take_pages(len(growing))
            assert pages is not None, "pages were counted as available"
            for req, page in zip(growing, pages.tolist()):
                req.pages.append(page)
        plan.extend(PlannedReq(req, 1, True) for req in decoders)
        if decoders:
            self.decode_steps += 1
        return True

    def _schedule_running_prefills(
        self, plan: list[PlannedReq], budget: int, reserve: int = 0
    ) -> int:
        for req in self.running:
            if budget <= 0:
                break
            if req.is_decoding or req.remaining_fill <= 0:
                continue
            n = min(budget, req.remaining_fill)
            if not self._grow_pages(req, req.kv_len + n, reserve):
                break
            plan.append(PlannedReq(req, n, req.kv_len + n == req.all_len and not req.prefill_only))
            budget -= n
        return budget

    def _schedule_waiting(
        self, plan: list[PlannedReq], budget: int, reserve: int, shared_with: list[Req] = ()
    ) -> None:
        """Admit waiting requests in policy order; `reserve` pages stay free for the running
        decoders' next tokens, so an admission never forces a retraction. A request that shares
        at least IN_BATCH_SHARE_THRESHOLD not-yet-cached prompt tokens with one that is computing
        them waits: with a request admitted in this step, with a running request whose prefill is
        not done (a prefix longer than a chunk is cached chunk by chunk), and with `shared_with`,
        the requests that had prefill rows in the step still in flight (their KV is not in the
        tree yet). Then it matches the whole prefix instead of computing it again."""
        if not self.waiting or budget <= 0:
            return
        matches = {}
        if self.args.schedule_policy == "dfs-weight":
            # a match may split a tree node: match them all before dfs-weight walks parent links,
            # or a request reached through a stale link is listed twice
            matches = {id(r): self._match(r) for r in self.waiting}

        def ordering_match(r: Req):
            return matches[id(r)] if matches else self._match(r)

        ordered = order_waiting(
            self.args.schedule_policy,
            self.waiting,
            match_len=lambda r: ordering_match(r).length,
            match_node=lambda r: ordering_match(r).node,
        )
        computing: list[Req] | None = None  # built once something can be admitted
        for req in ordered:
            if budget <= 0 or len(self.running) >= self.max_running or not self.free_slots:
                break
            if computing is None:
                computing = self._computing_uncached(shared_with)
            match = self._match(req)
            # NOTE: the C++ tree's matches have no host fields (it has no host tier)
            host_len = match.host_length if self.host_allocator is not None else 0
            if self._shares_uncached_prefix(req, match.length + host_len, computing):
                continue
            loaded = self._lock_match(req, match, budget, reserve)
            n = min(budget, req.remaining_fill)
            if not self._grow_pages(req, req.kv_len + n, reserve):
                self.cache.unlock(req.node)
                req.node, req.pages, req.tree_pages, req.kv_len = None, PageRow(), 0, 0
                break
            if req.cached_tokens < 0:
                req.cached_tokens = match.length + loaded
                req.host_cached_tokens = loaded
                self.prompt_tokens_total += len(req.prompt)
                self.cached_tokens_total += match.length + loaded
                self.host_cached_tokens_total += loaded
                if host_len and not loaded:
                    self.host_recomputed_tokens += host_len
                req.admitted_at = time.perf_counter()
                if self.stats is not None:
                    self.stats.admitted(
                        len(req.prompt),
                        match.length + loaded,
                        req.admitted_at - req.arrived_at,
                        host_cached_tokens=loaded,
                    )
            req.slot = self.free_slots.pop()
            req.sent_pages = 0
            req.state = ReqState.RUNNING
            self.waiting.remove(req)
            self.running.append(req)
            computing.append(req)
            sample = req.kv_len + n == req.all_len and not req.prefill_only
            plan.append(PlannedReq(req, n, sample))
            budget -= n

    def _lock_match(self, req: Req, match, budget: int, reserve: int) -> int:
        """Lock `match` for `req` and set its pages and kv_len. A match that runs on into the
        host tier is loaded back (device pages for it, the copies queued for the next batch)
        when the load beats recomputing and the pool has the pages for it and for the first
        chunk; else the request computes those tokens. Returns the tokens loaded."""
        ps = self.page_size
        host_len = match.host_length if self.host_allocator is not None else 0
        if host_len:
            load_pages = host_len // ps
            kv_after = match.length + host_len
            first_chunk = min(budget, req.all_len - kv_after)
            chunk_pages = math.ceil((kv_after + first_chunk) / ps) - len(match.pages) - load_pages
            self.cache.lock(match.host_node)
            if self._load_pays(host_len) and (
                self._available_pages() - reserve >= load_pages + max(chunk_pages, 0)
            ):
                pages = self._take_pages(load_pages)
                assert pages is not None, "pages were counted as available"
                self.cache.load_back(match.host_node, pages)
                req.node = match.host_node
                req.pages = PageRow(np.concatenate([match.pages, pages]))
                req.tree_pages = len(req.pages)
                req.kv_len = match.length + host_len
                return host_len
            self.cache.unlock(match.host_node)
        self.cache.lock(match.node)
        req.node = match.node
        req.pages = PageRow(match.pages)
        req.tree_pages = len(req.pages)
        req.kv_len = match.length
        return 0

    def _computing_uncached(self, shared_with: list[Req]) -> list[Req]:
        """The requests computing prompt tokens that are not in the tree yet: `shared_with` and
        the running requests whose prefill is not done (each once; Req hashes by identity)."""
        prefilling = (r for r in self.running if not r.is_decoding and r.remaining_fill > 0)
        return list(dict.fromkeys([*shared_with, *prefilling]))

    def _decode_reserve(self) -> int:
        """Pages to keep free for the running decoders' next tokens (one each, conservatively)."""
        return sum(1 for r in self.running if r.is_decoding)

    @staticmethod
    def _match_limit(req: Req) -> int:
        """How far a match may go: always one token to compute, and the prompt positions whose
        logprobs were asked for."""
        limit = req.all_len - 1
        if req.logprob_start_len >= 0:
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        return limit

    def _match(self, req: Req):
        """Longest cached prefix within `_match_limit`."""
        return self.cache.match_prefix(req.ids_slice(0, self._match_limit(req)), req.namespace)

    def _shares_uncached_prefix(self, req: Req, cached: int, computing: list[Req]) -> bool:
        """Whether `req` shares at least IN_BATCH_SHARE_THRESHOLD tokens past `cached` with one
        of `computing` that it could match once they are cached (so waiting pays off): only one
        in its own cache namespace, whose prefix it will be able to match."""
        if self.cache.disable:
            return False
        limit = self._match_limit(req)
        for other in computing:
            if other.namespace != req.namespace:
                continue
            n = min(len(req.prompt), len(other.prompt), limit)
            if n - cached < IN_BATCH_SHARE_THRESHOLD:
                continue
            a, b = req.prompt[cached:n], other.prompt[cached:n]
            diff = np.flatnonzero(a != b)
            shared = len(a) if len(diff) == 0 else int(diff[0])
            if shared >= IN_BATCH_SHARE_THRESHOLD:
                return True
        return False

    def _forward_req(self, p: PlannedReq) -> ForwardReq:
        req = p.req
        new_slot = not req.slot_started
        start = req.kv_len
        # run-ahead: the token the in-flight step samples is fed from the worker's device
        from_last = req.pending_token and start + p.num_tokens == req.all_len
        if from_last:
            assert p.num_tokens == 1 and not new_slot, "a pending token is one decode token"
            ids = np.zeros(0, np.int32)
        else:
            ids = req.ids_slice(start, start + p.num_tokens)
        want_prompt_lp = req.logprob_start_len >= 0 and start < len(req.prompt)
        next_token = -1
        if want_prompt_lp and start + p.num_tokens < len(req.prompt):
            next_token = int(req.prompt[start + p.num_tokens])
        fr = ForwardReq(
            slot=req.slot,
            input_ids=pack_ids(ids),
            start_pos=start,
            page_offset=req.sent_pages,
            new_pages=pack_ids(req.pages[req.sent_pages :]),
            new_slot=new_slot,
            sample=p.sample,
            sampling=req.sampling if new_slot else None,
            return_logprob=req.return_logprob,
            top_logprobs_num=req.top_logprobs_num,
            prompt_logprobs=want_prompt_lp,
            next_token=next_token,
            from_last_sample=from_last,
        )
        if new_slot and req.sampling.needs_penalties:
            fr.history_ids = pack_ids(req.ids_slice(0, start))
        if new_slot and req.output_ids and self._counts_outputs(req.sampling):
            fr.prior_output_ids = pack_ids(req.output_ids)
        req.slot_started = True
        req.sent_pages = len(req.pages)
        return fr

    def _may_jump(self, req: Req) -> bool:
        """Whether the worker may append jump-forward tokens to this request's next token."""
        return (
            self.args.enable_jump_forward
            and req.sampling.grammar is not None
            and not req.return_logprob
            and req.top_logprobs_num == 0
        )

    @staticmethod
    def _counts_outputs(sp) -> bool:
        """Whether the worker needs a retracted request's earlier outputs: penalties count them,
        a grammar replays them, min_tokens counts them."""
        return sp.needs_penalties or sp.grammar is not None or sp.min_tokens > 0

    # -----------------------------------------------------------------------------------------
    # results

    def process_result(self, plan: list[PlannedReq], result: ForwardResult) -> None:
        outputs = self.outbox
        if self.host_allocator is not None:
            self._observe_step(plan, result)
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
                if self.stats is not None:
                    self.stats.generation_tokens += 1
                    if len(req.output_ids) == 1:
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
                    self.jumped_tokens += len(new_ids) - 1
                    if self.stats is not None:
                        self.stats.generation_tokens += len(new_ids) - 1
                out.new_ids = pack_ids(new_ids)
                if reason is not None:
                    self.running.remove(req)
                    self._release(req)
                    finished = self._finish(req, reason)
                    out.finish_reason, out.matched_stop = finished.finish_reason, req.matched_stop
                    if reason == "error":
                        out.error, out.error_code = req.error, "grammar_error"
                elif start < len(req.prompt) or p.num_tokens > 1:
                    self._cache_unfinished(req)
            elif req.prefill_only and req.kv_len >= req.all_len:
                self.running.remove(req)
                self._release(req)
                out.finish_reason = self._finish(req, "length").finish_reason
                has_news = True
            else:
                self._cache_unfinished(req)
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

    def _finish(self, req: Req, reason: str) -> ReqOutput:
        req.state = ReqState.FINISHED
        req.finish_reason = reason
        self.reqs.pop(req.rid, None)
        return ReqOutput(
            rid=req.rid,
            finish_reason=reason,
            prompt_tokens=len(req.prompt),
            cached_tokens=max(req.cached_tokens, 0),
            host_cached_tokens=req.host_cached_tokens,
        )

    # -----------------------------------------------------------------------------------------
    # pages: the one place that frees a request's pages is _release

    def _available_pages(self) -> int:
        return self.allocator.free_pages + self.cache.evictable_pages

    def _pages_needed(self, req: Req, n: int) -> int:
        return max(math.ceil((req.kv_len + n) / self.page_size) - len(req.pages), 0)

    def _grow_pages(self, req: Req, kv_len: int, reserve: int | None = None) -> bool:
        """Pages for `req` to hold `kv_len` tokens. With `reserve`, refuse (taking nothing) unless
        that many pages stay available after it, for the running decoders' next tokens."""
        need = max(math.ceil(kv_len / self.page_size) - len(req.pages), 0)
        if reserve is not None and self._available_pages() - reserve < need:
            return False
        if need == 0:
            return True
        pages = self._take_pages(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def _take_pages(self, n: int) -> np.ndarray | None:
        """`n` free pages, evicting cached prefixes for the shortfall; None if there are not."""
        if self.allocator.free_pages < n:
            evicted = self.cache.evict(n - self.allocator.free_pages)
            if self.stats is not None:
                self.stats.evicted_pages += evicted
        return self.allocator.alloc(n)

    def _cache_unfinished(self, req: Req) -> None:
        """Put the computed prefix of a running request into the tree, so requests arriving now
        can share it, and swap the request's lock to the deeper node."""
        if self.cache.disable:
            return
        aligned = req.kv_len // self.page_size * self.page_size
        n_pages = aligned // self.page_size
        if n_pages <= req.tree_pages:
            return
        ids = req.ids_slice(0, aligned)
        res = self.cache.insert(ids, req.pages[:n_pages], req.namespace)
        if self.kv_events is not None:
            self.kv_events.stored(
                req.rid, ids, res.prefix_len, req.pages[:n_pages], namespace=req.namespace
            )
        dup_hi = res.prefix_len // self.page_size
        match = self.cache.match_prefix(ids, req.namespace)
        assert match.length == aligned, (match.length, aligned)
        if dup_hi > req.tree_pages:
            # someone else cached these tokens first: use their pages, free ours
            self.allocator.free(req.pages[req.tree_pages : dup_hi])
            req.pages[req.tree_pages : dup_hi] = match.pages[req.tree_pages : dup_hi]
            req.sent_pages = min(req.sent_pages, req.tree_pages)
        self.cache.lock(match.node)
        self.cache.unlock(req.node)
        req.node = match.node
        req.tree_pages = n_pages

    def _release(self, req: Req) -> None:
        """Give a request's pages back: computed full pages to the tree, the rest to the free list."""
        if req.node is not None:
            aligned = req.kv_len // self.page_size * self.page_size
            n_pages = aligned // self.page_size
            ids = req.ids_slice(0, aligned)
            res = self.cache.insert(ids, req.pages[:n_pages], req.namespace)
            if self.kv_events is not None:
                pages = req.pages[:n_pages]
                self.kv_events.stored(
                    req.rid, ids, res.prefix_len, pages, done=True, namespace=req.namespace
                )
            dup_hi = min(res.prefix_len // self.page_size, n_pages)
            if dup_hi > req.tree_pages:
                self.allocator.free(req.pages[req.tree_pages : dup_hi])
            if len(req.pages) > n_pages:
                self.allocator.free(req.pages[n_pages:])
            self.cache.unlock(req.node)
        elif req.pages:
            self.allocator.free(req.pages.view())
        req.node, req.pages, req.tree_pages, req.kv_len, req.sent_pages = None, PageRow(), 0, 0, 0
        if req.slot is not None:
            self.released_slots.append(req.slot)
            self.free_slots.append(req.slot)
            req.slot = None
        req.slot_started = False

    def _retract(self, req: Req) -> None:
        logger.info("retracting %s (%d tokens) under memory pressure", req.rid, req.all_len)
        self.running.remove(req)
        self._release(req)
        req.state = ReqState.WAITING
        req.retractions += 1
        self.retractions += 1
        if self.stats is not None:
            self.stats.retractions += 1
        self.waiting.insert(0, req)

    def _take_released_slots(self) -> list[int]:
        slots, self.released_slots = self.released_slots, []
        return slots

    def take_outputs(self) -> list[ReqOutput]:
        out, self.outbox = self.outbox, []
        return out

    # -----------------------------------------------------------------------------------------
    # control and introspection

    def flush_cache(self) -> FlushCacheDone:
        """Drop every unlocked node: the whole tree when idle; under load, what no running
        request holds (locked nodes stay and are reported as kept). This is LRU eviction of
        everything evictable, so it is safe between steps for the same reasons eviction is
        (see schedule_ahead): a running request's pages are locked or its own, and a freed page
        is handed out only by a batch built afterwards, which the worker runs after every step
        already sent. Waiting requests hold nothing; they match again when admitted."""
        cache = self.cache
        nodes = cache.stats()["nodes"]
        events_before = len(self.kv_events.pending) if self.kv_events is not None else 0
        dropped = cache.evict(cache.evictable_pages) if cache.evictable_pages else 0
        if self.host_allocator is not None:  # what eviction kept on the host goes too
            cache.evict_host(cache.host_evictable_pages)
        if self.kv_events is not None:
            self.kv_events.flushed(events_before)
        return FlushCacheDone(
            ok=True,
            dropped_nodes=nodes - cache.stats()["nodes"],
            dropped_pages=dropped,
            dropped_tokens=dropped * self.page_size,
            kept_pages=cache.protected_pages,
        )

    def cache_stats(self) -> CacheStats:
        prompt = self.prompt_tokens_total
        return CacheStats(
            total_pages=self.allocator.total_pages,
            free_pages=self.allocator.free_pages,
            evictable_pages=self.cache.evictable_pages,
            protected_pages=self.cache.protected_pages,
            page_size=self.page_size,
            hit_rate=self.cached_tokens_total / prompt if prompt else 0.0,
            cached_tokens=self.cached_tokens_total,
            prompt_tokens=prompt,
            tree=self.tree_impl,
            **self._host_stats(),
        )

    def _host_stats(self) -> dict:
        host = self.host_allocator
        if host is None:
            return {}
        return dict(
            host_total_pages=host.total_pages,
            host_free_pages=host.free_pages,
            host_evictable_pages=self.cache.host_evictable_pages,
            host_cached_tokens=self.host_cached_tokens_total,
            host_loads=self.host_loads,
            host_loaded_bytes=self.host_loaded_bytes,
            host_written_bytes=self.host_written_bytes,
            host_load_s=self.host_load_s,
            host_recomputed_tokens=self.host_recomputed_tokens,
            host_load_bandwidth=self.load_bandwidth,
        )

    def grammar_stats(self) -> GrammarStats | None:
        if not self.grammar_requests:
            return None
        times = sorted(self.compile_times)

        def pct(q: float) -> float:
            return times[min(len(times) - 1, int(q * len(times)))] if times else 0.0

        return GrammarStats(
            requests=self.grammar_requests,
            cache_hits=self.grammar_hits,
            compiles=self.grammar_compiles,
            failed=self.grammar_failed,
            compile_p50_s=pct(0.5),
            compile_p99_s=pct(0.99),
            compile_max_s=times[-1] if times else 0.0,
        )

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
        held = np.concatenate(
            [np.zeros(0, np.int32)] + [r.pages[r.tree_pages :] for r in self.running]
        )
        self.cache.check_integrity(expect_unlocked=not self.running, held_pages=held)
        assert len(self.free_slots) + len(self.running) == self.max_running, "slot leak"
        self.integrity_checks += 1
