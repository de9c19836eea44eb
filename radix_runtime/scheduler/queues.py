"""The scheduler's requests by state, and their moves between states.

WAITING (in `waiting`, or for its grammar in `Admission.grammar_waiting`) -> RUNNING (in
`running`: holds a slot and pages) -> FINISHED (gone, its last reply in `outbox`). Retraction
moves a running request back to the front of `waiting` with its pages released. `waiting`, `running` and `reqs`
are mutated in place, never replaced: the admission and planning parts hold the same lists.
"""

from __future__ import annotations

import logging

from radix_runtime.messages import ReqOutput
from radix_runtime.scheduler.kv import KvBook
from radix_runtime.scheduler.request import Req, ReqState
from radix_runtime.scheduler.stats import Counters

logger = logging.getLogger("radix_runtime.scheduler.scheduler")

OUTPUT_FRACTION_WEIGHT = 0.1  # of each finished request in `Queues.output_fraction`


class Queues:
    def __init__(self, kv: KvBook, counters: Counters):
        self.kv, self.counters = kv, counters
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}  # every request not finished, by rid
        self.outbox: list[ReqOutput] = []  # replies for the tokenizer process, sent after each step
        # the fraction of max_new_tokens that finished requests used (an exponential average):
        # what admission expects of the running requests' output (1.0 until one finished, and
        # again after a retraction: the estimate was too low)
        self.output_fraction = 1.0

    def start(self, req: Req) -> None:
        """An admitted request (its KV and slot taken, `KvBook.admit`) runs."""
        req.state = ReqState.RUNNING
        self.waiting.remove(req)
        self.running.append(req)

    def finish(self, req: Req, reason: str) -> ReqOutput:
        """Mark `req` finished (it holds nothing by now) and return its final reply."""
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

    def end(self, req: Req, reason: str) -> ReqOutput:
        """Finish a running request: its pages go back (`KvBook.release`)."""
        self.running.remove(req)
        self.kv.release(req)
        if reason in ("stop", "length") and req.sampling.max_new_tokens > 0:
            used = min(len(req.output_ids) / req.sampling.max_new_tokens, 1.0)
            self.output_fraction += OUTPUT_FRACTION_WEIGHT * (used - self.output_fraction)
        return self.finish(req, reason)

    def retract(self, req: Req) -> None:
        """Memory pressure: a running request gives its pages back (its computed KV goes into the
        tree, so the retry mostly hits the cache) and waits again, in front."""
        logger.info("retracting %s (%d tokens) under memory pressure", req.rid, req.all_len)
        self.running.remove(req)
        self.kv.release(req)
        req.state = ReqState.WAITING
        req.retractions += 1
        self.counters.retractions += 1
        self.output_fraction = 1.0
        self.waiting.insert(0, req)

    def take_outputs(self) -> list[ReqOutput]:
        out, self.outbox = self.outbox, []
        return out
