"""Planning the next step: which rows it holds, and the batch the worker receives.

By default a step is prefill-first (as SGLang): when any prefill work can be scheduled, the step
holds only prefill chunks within the token budget (chunked prefill), continuing requests first,
then new ones (`Admission.admit`); otherwise it is a decode-only step (every decoding request
gets one token), which the worker can replay as a CUDA graph. `--max-consecutive-prefill-steps
N` caps how long the decoders wait under a burst of prompts: after N prefill steps in a row while
requests are decoding, the next step is a decode step. With `--enable-mixed-chunk` every step is
mixed: decodes first, prefill chunks fill the rest of the budget. Memory pressure is met
by evicting cached prefixes first (`KvBook.take_pages`), then by retracting running requests.

Overlap (the default; `--disable-overlap-schedule` turns it off): while the worker computes step
N, `schedule_ahead(plan N)` builds step N+1 before N's result is processed.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from radix_runtime.config import ServerArgs
from radix_runtime.messages import ForwardBatch, ForwardReq, pack_ids
from radix_runtime.scheduler.admission import Admission
from radix_runtime.scheduler.kv import KvBook
from radix_runtime.scheduler.queues import Queues
from radix_runtime.scheduler.request import PlannedReq, Req, ReqState
from radix_runtime.scheduler.stats import Counters


class Projected(NamedTuple):
    """A running request as the step being planned finds it: as it is now (`now`), or (the
    overlap schedule) as the step in flight leaves it (`after`), before that step's result is
    processed. A tuple: planning makes one per running request per step."""

    req: Req
    kv_len: int
    all_len: int
    is_decoding: bool  # one token to compute, after an output: the next step decodes it
    pending: bool = False  # its last output token is the in-flight step's sample, unknown yet

    @classmethod
    def now(cls, req: Req) -> Projected:
        kv_len, all_len = req.kv_len, len(req.prompt) + len(req.output_ids)
        return cls(req, kv_len, all_len, all_len - kv_len == 1 and bool(req.output_ids))

    @classmethod
    def after(cls, row: PlannedReq) -> Projected:
        """`row`'s request once its row is computed (and sampled, with `row.sample`)."""
        req = row.req
        kv_len, all_len = req.kv_len + row.num_tokens, req.all_len + row.sample
        decoding = all_len - kv_len == 1 and (bool(req.output_ids) or row.sample)
        return cls(req, kv_len, all_len, decoding, pending=row.sample)

    @property
    def remaining_fill(self) -> int:
        """Tokens still to compute before the next token can be sampled."""
        return self.all_len - self.kv_len


class Planner:
    def __init__(
        self,
        args: ServerArgs,
        context_length: int,
        kv: KvBook,
        admission: Admission,
        queues: Queues,
        counters: Counters,
    ):
        self.args, self.context_length = args, context_length
        self.kv, self.admission, self.queues, self.counters = kv, admission, queues, counters
        # --max-consecutive-prefill-steps: prefill steps sent in a row while requests decode
        self.prefill_streak = 0
        self._decodes_planned = self._decoders_waiting = False  # of the last plan

    def schedule(self) -> tuple[ForwardBatch, list[PlannedReq]] | None:
        """The next step, with nothing in flight."""
        plan = self.plan(self.now())
        if not plan:
            return None
        return self.make_batch(plan), plan

    def now(self) -> list[Projected]:
        return [Projected.now(r) for r in self.queues.running]

    def plan(
        self, views: list[Projected], shared_with: list[Req] = (), ahead: bool = False
    ) -> list[PlannedReq] | None:
        """The next step's rows, for the running requests as `views` (in running order) show
        them. `ahead` (schedule_ahead): never retract or finish a request here; None when that
        would be needed (the caller falls back)."""
        running = self.queues.running
        plan: list[PlannedReq] = []
        budget = self.args.chunked_prefill_size
        self._decodes_planned = self._decoders_waiting = False
        if self.args.enable_mixed_chunk:
            if not self._schedule_decodes(plan, views, ahead):
                return None
            budget = self._schedule_running_prefills(plan, views, max(budget - len(plan), 0))
            self.admission.admit(plan, budget, _decode_reserve(views), views, shared_with)
        else:
            # prefill-first; the decoders' next pages stay free, so a prefill never forces a
            # retraction, and a prefill that cannot go now leaves the step to the decodes
            reserve = _decode_reserve(views)
            self._decoders_waiting = reserve > 0
            cap = self.args.max_consecutive_prefill_steps
            if not (cap and reserve and self.prefill_streak >= cap):
                budget = self._schedule_running_prefills(plan, views, budget, reserve)
                self.admission.admit(plan, budget, reserve, views, shared_with)
            # else the decoders waited `cap` prefill steps: this step is theirs
            if not plan:
                before = len(running)
                if not self._schedule_decodes(plan, views, ahead):
                    return None
                if not plan and len(running) < before:
                    # every decoder left: their pages may fit a prefill
                    return self.plan(self.now())
        if not plan and not ahead and self.admission.drop_prefetches():
            # pages held for waiting requests' prefetches (on arrival) go first
            return self.plan(views, shared_with)
        if not plan and len(running) > 1 and not ahead:
            # every running request is mid-prefill and none can grow: free the newest one's pages
            self.queues.retract(max(running, key=lambda r: r.arrival))
            return self.plan(self.now())
        return plan or None

    # -----------------------------------------------------------------------------------------
    # the overlap schedule: one step ahead

    def schedule_ahead(
        self, inflight: list[PlannedReq]
    ) -> tuple[ForwardBatch, list[PlannedReq]] | None:
        """Step N+1, built while step N (`inflight`, sent, its result not processed) runs on the
        worker; None when it is not easy, and the caller processes N's result first and then
        schedules as usual (`schedule()`).

        How: the usual step is planned from a projection of the running requests as N leaves
        them (`Projected.after`: N's tokens computed, its sampled tokens counted but unknown);
        no request is changed to get there. A request whose token is pending decodes with
        `from_last_sample` (the worker feeds it the token its slot just sampled, on the
        device). Requests that N finishes by length (max_new_tokens, context, prefill-only)
        stay out of N+1: that is known without the token. `process_result(N)` applies N's
        result as always, and `process_result(N+1)` finds each row's request where N+1 expected
        it (`PlannedReq.start`). What planning N+1 does change is what any plan changes: pages
        and slots taken, requests admitted, the rows' pages sent.

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
        Duplicate pages swapped for the tree's while processing N (`KvBook.cache_unfinished`)
        may still be read by N+1 (they hold the same valid K/V until a later step reuses them);
        N+1 never writes into them (it writes past the inserted full pages).
        """
        if self.args.disable_overlap_schedule:
            return None
        rows = {id(p.req): p for p in inflight if p.req.state is ReqState.RUNNING}
        # whose KV computed by N is not in the tree until N's result is processed
        prefilling_in_n = [p.req for p in rows.values() if not p.req.is_decoding]
        views = []
        for req in self.queues.running:
            row = rows.get(id(req))
            if row is None:
                views.append(Projected.now(req))
            elif not self._finishes_by_length(row):
                views.append(Projected.after(row))
        plan = self.plan(views, prefilling_in_n, ahead=True)
        if not plan:
            return None
        pending = {id(v.req) for v in views if v.pending}
        return self.make_batch(plan, pending), plan

    def _finishes_by_length(self, row: PlannedReq) -> bool:
        """Whether processing `row` surely finishes its request, whatever token it samples (or
        leaves its next tokens unknown: jump-forward)."""
        req = row.req
        if row.sample:
            return (
                len(req.output_ids) + 1 >= req.sampling.max_new_tokens
                or req.all_len + 1 >= self.context_length
                or self.may_jump(req)  # its next tokens are not known: it sits N+1 out
            )
        return req.prefill_only and req.kv_len + row.num_tokens >= req.all_len

    # -----------------------------------------------------------------------------------------
    # the running requests' rows

    def _schedule_decodes(
        self, plan: list[PlannedReq], views: list[Projected], ahead: bool = False
    ) -> bool:
        """Every decoding request gets one token. False (nothing changed) when `ahead` and that
        needs a retraction. A request retracted or ended here leaves `views` too."""
        kv, queues = self.kv, self.queues
        decoders = [v for v in views if v.is_decoding]
        # every decoder whose next token starts a new page needs one; retract until they fit
        while decoders:
            if kv.available_pages() >= kv.next_token_pages([(v.req, v.kv_len) for v in decoders]):
                break
            if ahead:
                return False
            if self.admission.drop_prefetches():  # before any running request gives way
                continue
            victim = max(decoders, key=lambda v: v.req.arrival)
            if len(queues.running) == 1:
                # alone and out of memory: it can never grow, so it ends here
                queues.outbox.append(queues.end(victim.req, "length"))
            else:
                queues.retract(victim.req)
            decoders.remove(victim)
            views.remove(victim)
        kv.grow_next_token([(v.req, v.kv_len) for v in decoders])
        plan.extend(PlannedReq(v.req, 1, True, start=v.kv_len) for v in decoders)
        if decoders:
            self.counters.decode_steps += 1
            self._decodes_planned = True
        return True

    def _schedule_running_prefills(
        self, plan: list[PlannedReq], views: list[Projected], budget: int, reserve: int = 0
    ) -> int:
        for v in views:
            if budget <= 0:
                break
            if v.is_decoding or v.remaining_fill <= 0:
                continue
            n = min(budget, v.remaining_fill)
            if not self.kv.grow_pages(v.req, v.kv_len + n, reserve):
                break
            sample = v.kv_len + n == v.all_len and not v.req.prefill_only
            plan.append(PlannedReq(v.req, n, sample, start=v.kv_len))
            budget -= n
        return budget

    def may_jump(self, req: Req) -> bool:
        """Whether the worker may append jump-forward tokens to this request's next token."""
        return (
            self.args.enable_jump_forward
            and req.sampling.grammar is not None
            and not req.return_logprob
            and req.top_logprobs_num == 0
        )

    # -----------------------------------------------------------------------------------------
    # the batch

    def make_batch(self, plan: list[PlannedReq], pending: set[int] = frozenset()) -> ForwardBatch:
        """The batch for `plan`; `pending`: the ids of the requests whose last token is the
        in-flight step's sample (the worker feeds it from the device)."""
        self.counters.step_id += 1
        if self._decodes_planned or not self._decoders_waiting:
            self.prefill_streak = 0
        else:  # a prefill step while requests wait to decode
            self.prefill_streak += 1
        batch = ForwardBatch(
            step=self.counters.step_id,
            reqs=[self._forward_req(p, id(p.req) in pending) for p in plan],
            released_slots=self.kv.take_released_slots(),
        )
        if self.kv.host_allocator is not None:
            self.kv.attach_copies(batch)
        return batch

    def _forward_req(self, p: PlannedReq, from_last: bool) -> ForwardReq:
        """`from_last`: the row's one input token is the in-flight step's sample, which the
        worker feeds from its device."""
        req = p.req
        new_slot = not req.slot_started
        start = p.start
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
        if new_slot and req.output_ids and _counts_outputs(req.sampling):
            fr.prior_output_ids = pack_ids(req.output_ids)
        req.slot_started = True
        req.sent_pages = len(req.pages)
        return fr


def _counts_outputs(sp) -> bool:
    """Whether the worker needs a retracted request's earlier outputs: penalties count them,
    a grammar replays them, min_tokens counts them."""
    return sp.needs_penalties or sp.grammar is not None or sp.min_tokens > 0


def _decode_reserve(views: list[Projected]) -> int:
    """Pages to keep free for the running decoders' next tokens (one each, conservatively)."""
    return sum(1 for v in views if v.is_decoding)
