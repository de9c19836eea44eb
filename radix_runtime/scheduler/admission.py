"""Admission: which waiting requests join the next step, and which must not wait at all.

A request arrives (`add`): refused with a clear error when it cannot ever run (validation),
held back until the worker compiled its grammar (constrained decoding), else queued. Each step,
`admit` walks the waiting queue in policy order (policy.py): it matches each request's prompt in
the radix tree, skips one that shares a long not-yet-cached prefix with a request computing it
(waiting-for-prefix: it matches the whole prefix once that is cached), locks the match and takes
pages for its first chunk, keeping the running decoders' next pages free.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

import numpy as np

from radix_runtime.config import ServerArgs
from radix_runtime.grammar import SCHEDULER_KNOWN_GRAMMARS
from radix_runtime.messages import (
    CompileGrammar,
    GenerateReq,
    GrammarCompiled,
    GrammarStats,
    ReqOutput,
    unpack_ids,
)
from radix_runtime.scheduler.kv import KvBook
from radix_runtime.scheduler.policy import order_waiting
from radix_runtime.scheduler.queues import Queues
from radix_runtime.scheduler.request import PlannedReq, Req, ReqState
from radix_runtime.scheduler.stats import Counters, SchedulerStats

if TYPE_CHECKING:
    from radix_runtime.scheduler.planner import Projected

logger = logging.getLogger("radix_runtime.scheduler.scheduler")

# A waiting request that shares at least this many not-yet-cached tokens with a request that is
# computing them (admitted in this step, still prefilling, or prefilling in the step in flight)
# waits until they are cached, so the shared prefix is computed once and then matched.
IN_BATCH_SHARE_THRESHOLD = 32

# Admission expects at most this many more output tokens of a request (as SGLang's
# CLIP_MAX_NEW_TOKENS): a request asking for the whole context does not hold back every other.
EXPECTED_OUTPUT_CLIP = 4096
# ... and at least this fraction of it, however early finished requests stopped (as SGLang's
# minimum new-token ratio): a workload whose first replies are short still keeps some room
MIN_EXPECTED_FRACTION = 0.1


class Admission:
    def __init__(
        self,
        args: ServerArgs,
        context_length: int,
        vocab_size: int,
        kv: KvBook,
        queues: Queues,
        counters: Counters,
        stats: SchedulerStats | None,
    ):
        self.args, self.context_length, self.vocab_size = args, context_length, vocab_size
        self.kv, self.queues, self.counters, self.stats = kv, queues, counters, stats
        self.max_running = args.max_running_requests
        self.arrivals = 0
        # constrained decoding: a request whose grammar the worker has not compiled yet waits
        # here (not in `waiting`) until the worker reports it compiled (or invalid)
        self.grammar_waiting: dict[tuple[str, str], list[Req]] = {}
        self.known_grammars: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.worker_outbox: list[CompileGrammar] = []  # sent to the worker before the next step
        self.grammar_requests = self.grammar_hits = self.grammar_compiles = self.grammar_failed = 0
        self.compile_times: deque[float] = deque(maxlen=1000)  # the latest compiles (seconds)

    # -----------------------------------------------------------------------------------------
    # requests in

    def add(self, msg: GenerateReq) -> None:
        outbox = self.queues.outbox
        if len(msg.input_ids) % 4:
            # NOTE: not raw int32s, so not from our tokenizer: refuse it rather than crash
            logger.warning("dropped request %r: input_ids is not an int32 buffer", msg.rid)
            outbox.append(
                ReqOutput(
                    rid=msg.rid,
                    finish_reason="error",
                    error="input_ids is not an int32 buffer",
                    error_code="invalid_request",
                )
            )
            return
        prompt = unpack_ids(msg.input_ids).copy()
        error = self.reject_reason(msg, prompt)
        if error is not None:
            message, code = error
            outbox.append(
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
        if self.stats is not None and msg.sent_at > 0:
            self.stats.arrived(req.arrived_at - msg.sent_at)
        self.queues.reqs[req.rid] = req
        key = msg.sampling.grammar
        if key is not None:
            self.grammar_requests += 1
        if key is None or key in self.known_grammars:
            if key is not None:
                self.known_grammars.move_to_end(key)
                self.grammar_hits += 1
            self.queues.waiting.append(req)
            self.prefetch(req)
        elif key in self.grammar_waiting:  # compiling now: no compile of its own either
            self.grammar_waiting[key].append(req)
            self.grammar_hits += 1
        else:
            self.grammar_waiting[key] = [req]
            self.worker_outbox.append(CompileGrammar(kind=key[0], text=key[1]))

    def reject_reason(self, msg: GenerateReq, prompt: np.ndarray) -> tuple[str, str] | None:
        if msg.rid in self.queues.reqs:
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
        capacity = self.kv.capacity_tokens
        if len(prompt) + 1 > capacity:
            return (
                f"the prompt needs {len(prompt) + 1} tokens of KV cache but the pool holds "
                f"{capacity} (--max-total-tokens)",
                "kv_cache_too_small",
            )
        return None

    def remove_waiting(self, req: Req) -> None:
        """An aborted waiting request leaves its queue (its grammar's, while that compiles)."""
        self.kv.drop_prefetch(req)
        if req in self.queues.waiting:
            self.queues.waiting.remove(req)
        else:
            self.grammar_waiting[req.sampling.grammar].remove(req)

    # -----------------------------------------------------------------------------------------
    # the host tier: loading a waiting request's host hit back before it is admitted

    def prefetch(self, req: Req) -> int:
        """--hicache-prefetch arrival: a request that just joined `waiting` and whose match runs
        on into host-only nodes has them loaded back now (`KvBook.prefetch`), so the copy runs
        while the request waits for its first step instead of in front of it. Only when the
        pool keeps, beyond the load, the running requests' next pages and expected growth (as
        admission counts them), the request's own first chunk, and at most half of it is held
        for waiting requests this way. Returns the tokens loaded."""
        kv = self.kv
        if self.args.hicache_prefetch != "arrival" or kv.host_allocator is None:
            return 0
        if req.state is not ReqState.WAITING or req not in self.queues.waiting:
            return 0
        match = self.match(req)
        host_len = match.host_length
        if not host_len:
            return 0
        ps = kv.page_size
        held = sum(
            r.prefetched_tokens // ps for r in self.queues.waiting if r.prefetch_node is not None
        )
        if held + host_len // ps > kv.allocator.total_pages // 2:
            return 0
        running = self.queues.running
        reserve = len(running) + sum(self.expected_pages(r, r.all_len, r.kv_len) for r in running)
        rest = req.all_len - match.length - host_len
        reserve += math.ceil(min(self.args.chunked_prefill_size, rest) / ps)
        return kv.prefetch(req, match, reserve)

    def drop_prefetches(self) -> bool:
        """Memory pressure: every waiting request's prefetch is unlocked (its nodes stay cached,
        evictable again). Whether there was any."""
        dropped = 0
        for req in self.queues.waiting:
            if req.prefetch_node is not None:
                self.kv.drop_prefetch(req)
                dropped += 1
        self.counters.host_prefetches_dropped += dropped
        return dropped > 0

    def prefetched(self) -> int:
        """Waiting requests holding a prefetch."""
        return sum(1 for r in self.queues.waiting if r.prefetch_node is not None)

    # -----------------------------------------------------------------------------------------
    # grammars: compiled by the worker before their requests may run

    def grammar_compiled(self, msg: GrammarCompiled) -> None:
        """The worker compiled a grammar: its requests may run, or fail (an invalid grammar)."""
        key = (msg.kind, msg.text)
        reqs = self.grammar_waiting.pop(key, [])
        if not msg.cache_hit:
            self.grammar_compiles += 1
            self.compile_times.append(msg.compile_s)
        live = self.queues.reqs
        if msg.error is not None:
            self.grammar_failed += 1
            for req in reqs:
                if live.get(req.rid) is req:
                    out = self.queues.finish(req, "error")
                    out.error, out.error_code = msg.error, "invalid_grammar"
                    self.queues.outbox.append(out)
            return
        self.known_grammars[key] = None
        self.known_grammars.move_to_end(key)
        while len(self.known_grammars) > SCHEDULER_KNOWN_GRAMMARS:
            self.known_grammars.popitem(last=False)
        self.queues.waiting.extend(r for r in reqs if live.get(r.rid) is r)

    def take_worker_messages(self) -> list[CompileGrammar]:
        out, self.worker_outbox = self.worker_outbox, []
        return out

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

    # -----------------------------------------------------------------------------------------
    # admitting waiting requests into a step

    def admit(
        self,
        plan: list[PlannedReq],
        budget: int,
        reserve: int,
        running: list[Projected],
        shared_with: list[Req] = (),
    ) -> None:
        """Admit waiting requests in policy order, next to the `running` requests as the step
        finds them (planner.py), while the budget, the slots and the pages last; `reserve` pages
        stay free for the running decoders' next tokens, so an admission never forces a
        retraction. A request that shares at least IN_BATCH_SHARE_THRESHOLD not-yet-cached prompt
        tokens with one that is computing them waits: with a request admitted in this step, with
        a running request whose prefill is not done (a prefix longer than a chunk is cached chunk
        by chunk), and with `shared_with`, the requests that had prefill rows in the step still
        in flight (their KV is not in the tree yet). Then it matches the whole prefix instead of
        computing it again."""
        waiting, kv = self.queues.waiting, self.kv
        if not waiting or budget <= 0:
            return
        matches = {}
        if self.args.schedule_policy == "dfs-weight":
            # a match may split a tree node: match them all before dfs-weight walks parent links,
            # or a request reached through a stale link is listed twice
            matches = {id(r): self.match(r) for r in waiting}

        def ordering_match(r: Req):
            return matches[id(r)] if matches else self.match(r)

        ordered = order_waiting(
            self.args.schedule_policy,
            waiting,
            match_len=lambda r: ordering_match(r).length,
            match_node=lambda r: ordering_match(r).node,
        )
        computing: list[Req] | None = None  # built once something can be admitted
        n_running = len(running)
        expected = None  # pages the running requests are expected to need: built when needed
        for req in ordered:
            if budget <= 0 or n_running >= self.max_running or not kv.free_slots:
                break
            if computing is None:
                computing = computing_uncached(running, shared_with)
            match = self.match(req)
            host_len = match.host_length  # 0 without a host tier (either tree)
            if self.shares_uncached_prefix(req, match.length + host_len, computing):
                continue
            if expected is None:
                expected = sum(self.expected_pages(v.req, v.all_len, v.kv_len) for v in running)
            # room for its first chunk, the running requests' expected growth and its own (as
            # if nothing loads from the host tier); NOTE: with nothing running, a request goes
            # whatever its expected growth: nothing would free memory for it (and it fits the
            # pool: checked on arrival)
            first = match.length + min(budget, req.all_len - match.length)
            own = self.expected_pages(req, req.all_len, first)
            ahead = expected + own if n_running else 0
            taken = kv.admit(req, match, budget, reserve + ahead)
            if taken is None:  # the pages do not fit: the ones after it wait too (policy order)
                break
            n, loaded = taken
            expected += own
            # a prefetch (on arrival) is held by the request's own lock now; its tokens were
            # loaded from the host for it
            early = req.prefetched_tokens  # (0 without a prefetch)
            self.kv.drop_prefetch(req)
            if req.cached_tokens < 0:
                # host tokens matched now and not loaded are computed again (beyond those a
                # prefetch loaded: a match that grew into host-only nodes since)
                recomputed = host_len if host_len and not loaded else 0
                self._count_admission(req, match.length - early, loaded + early, recomputed)
            self.queues.start(req)
            n_running += 1
            computing.append(req)
            sample = req.kv_len + n == req.all_len and not req.prefill_only
            plan.append(PlannedReq(req, n, sample, start=req.kv_len))
            budget -= n

    def expected_pages(self, req: Req, all_len: int, kv_len: int) -> int:
        """Pages `req` is expected to need beyond those that hold `kv_len` tokens (or those it
        holds, if more): the rest of its prompt and its expected output, i.e. its remaining
        max_new_tokens (at most EXPECTED_OUTPUT_CLIP) times --schedule-conservativeness times
        the fraction of max_new_tokens finished requests used (at least MIN_EXPECTED_FRACTION);
        0 with a conservativeness of 0."""
        scale = self.args.schedule_conservativeness
        if scale <= 0:
            return 0
        remaining = req.sampling.max_new_tokens - (all_len - len(req.prompt))
        output = min(max(remaining, 0), EXPECTED_OUTPUT_CLIP)
        fraction = max(self.queues.output_fraction, MIN_EXPECTED_FRACTION)
        expect = math.ceil(output * min(scale * fraction, 1.0))
        final = min(all_len + expect, self.context_length)
        ps = self.kv.page_size
        held = max(math.ceil(kv_len / ps), len(req.pages))
        return max(math.ceil(final / ps) - held, 0)

    def _count_admission(self, req: Req, matched: int, loaded: int, recomputed: int) -> None:
        """A request's first admission (a retried one is not counted again): `matched` tokens
        on the device, `loaded` from the host tier, `recomputed` host-tier hits computed."""
        c = self.counters
        req.cached_tokens = matched + loaded
        req.host_cached_tokens = loaded
        c.prompt_tokens_total += len(req.prompt)
        c.cached_tokens_total += matched + loaded
        c.host_cached_tokens_total += loaded
        c.host_recomputed_tokens += recomputed
        req.admitted_at = time.perf_counter()
        if self.stats is not None:
            self.stats.admitted(req.admitted_at - req.arrived_at)

    @staticmethod
    def match_limit(req: Req) -> int:
        """How far a match may go: always one token to compute, and the prompt positions whose
        logprobs were asked for."""
        limit = req.all_len - 1
        if req.logprob_start_len >= 0:
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        return limit

    def match(self, req: Req):
        """Longest cached prefix within `match_limit`."""
        return self.kv.cache.match_prefix(req.ids_slice(0, self.match_limit(req)), req.namespace)

    def shares_uncached_prefix(self, req: Req, cached: int, computing: list[Req]) -> bool:
        """Whether `req` shares at least IN_BATCH_SHARE_THRESHOLD tokens past `cached` with one
        of `computing` that it could match once they are cached (so waiting pays off): only one
        in its own cache namespace, whose prefix it will be able to match."""
        if self.kv.cache.disable:
            return False
        limit = self.match_limit(req)
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


def computing_uncached(running: list[Projected], shared_with: list[Req]) -> list[Req]:
    """The requests computing prompt tokens that are not in the tree yet: `shared_with` and
    the running requests whose prefill is not done (each once; Req hashes by identity)."""
    prefilling = (v.req for v in running if not v.is_decoding and v.remaining_fill > 0)
    return list(dict.fromkeys([*shared_with, *prefilling]))
