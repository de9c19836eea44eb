"""The scheduler process: `python -m radix_runtime.scheduler.main` (started by the launcher)."""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass

import msgspec
import zmq

from radix_runtime import kv_events
from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.scheduler.stats import cache_tree, gauges
from radix_runtime.utils import gc_tuning
from radix_runtime.utils.procs import (
    configure_logging,
    endpoint,
    install_child_signal_handlers,
    read_child_payload,
    set_process_title,
    zmq_socket,
)
from radix_runtime.utils.tp import RankFanout

logger = logging.getLogger("radix_runtime.scheduler")


class WorkerLost(RuntimeError):
    pass


def advance(sched, inflight: tuple | None, send, finish) -> tuple[tuple | None, bool]:
    """One turn of the step loop, the same for the scheduler process and for every test driver
    (which pass their own transport): schedule a step when none is in flight; with one in flight
    (`(plan, handle)`), build the next one with `Scheduler.schedule_ahead` and send it before
    finishing the in-flight one (the overlap schedule; None there: the in-flight result is
    processed first and the next turn schedules as usual).

    `send(batch, plan) -> handle` hands a batch to the worker; `finish(plan, handle)` waits for
    its result and processes it (`Scheduler.process_result`). Returns (what is in flight now,
    whether a step was finished): anything still in flight was built ahead."""
    if inflight is None:
        scheduled = sched.schedule()
        if scheduled is not None:
            batch, plan = scheduled
            inflight = (plan, send(batch, plan))
    if inflight is None:
        return None, False
    ahead = sched.schedule_ahead(inflight[0])
    following = None
    if ahead is not None:
        batch, plan = ahead
        following = (plan, send(batch, plan))
    finish(*inflight)
    return following, True


@dataclass
class InFlight:
    """A step sent to the worker whose result is not processed yet."""

    batch: m.ForwardBatch
    plan: list
    sent_at: float


class SchedulerProcess:
    def __init__(self, args: ServerArgs, ipc_dir: str):
        self.args = args
        self.ctx = zmq.Context()
        self.from_tok = zmq_socket(self.ctx, zmq.PULL, endpoint(ipc_dir, "scheduler"), bind=True)
        self.to_tok = zmq_socket(self.ctx, zmq.PUSH, endpoint(ipc_dir, "tokenizer"), bind=False)
        self.from_worker = zmq_socket(
            self.ctx, zmq.PULL, endpoint(ipc_dir, "scheduler_w"), bind=True
        )
        self.to_worker = RankFanout(self.ctx, args, ipc_dir)  # every tensor-parallel rank
        self.scheduler = None
        self.running = True
        # KV-cache events (kv_events.py): a PUB socket, and a ROUTER answering snapshot requests
        self.kv_pub = self.kv_replay = None
        if args.kv_events_endpoint:
            self.kv_pub = self.ctx.socket(zmq.PUB)
            self.kv_pub.setsockopt(zmq.LINGER, 0)
            self.kv_pub.setsockopt(zmq.SNDHWM, 100_000)  # past it a slow subscriber loses batches
            self.kv_pub.bind(args.kv_events_endpoint)
        if args.kv_events_replay_endpoint:
            self.kv_replay = zmq_socket(
                self.ctx, zmq.ROUTER, args.kv_events_replay_endpoint, bind=True
            )
        self._last_result_at = 0.0  # when the latest step result came back (for step_time)
        self.gc: gc_tuning.GcWatch | None = None  # its collections, once started
        self.worker_gc = m.GcStats()  # the worker's, as its latest report left them
        # --hicache-prefetch arrival: requests are read while a step runs too (`read_early`);
        # the other messages read then wait here, in order, for the loop's next read
        self.reads_early = False
        self.deferred: list = []
        self._step_poller = zmq.Poller()  # both sockets, for `wait_worker` (built once)
        self._step_poller.register(self.from_worker, zmq.POLLIN)
        self._step_poller.register(self.from_tok, zmq.POLLIN)

    # -- startup ---------------------------------------------------------------------------

    def wait_worker_ready(self, timeout: float = 3600.0) -> m.WorkerReady:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self._recv_worker(timeout_ms=1000)
            if isinstance(msg, m.WorkerReady):
                return msg
        raise WorkerLost("the worker did not become ready in time")

    def start(self) -> None:
        from radix_runtime.scheduler.scheduler import Scheduler

        ready = self.wait_worker_ready()
        self.scheduler = Scheduler(self.args, ready)
        self.reads_early = (
            self.args.hicache_prefetch == "arrival" and self.scheduler.host_allocator is not None
        )
        self.send_tok(
            m.SchedulerReady(
                max_total_tokens=self.scheduler.capacity_tokens,
                page_size=ready.page_size,
                context_length=ready.context_length,
                vocab_size=ready.vocab_size,
                max_running_requests=self.scheduler.max_running,
            )
        )
        logger.info(
            "ready: %d pages of %d tokens, context %d, policy %s, radix cache %s (%s tree)",
            self.scheduler.allocator.total_pages,
            ready.page_size,
            ready.context_length,
            self.args.schedule_policy,
            "off" if self.args.disable_radix_cache else "on",
            self.scheduler.tree_impl,
        )
        self.gc = gc_tuning.ready(self.args, "scheduler")

    # -- messaging -------------------------------------------------------------------------

    def send_tok(self, msg) -> None:
        self.to_tok.send(m.encode(msg), copy=False)

    def _decode(self, frame: bytes, source: str):
        try:
            return m.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning(
                "dropped a malformed frame from %s (%d bytes): %s", source, len(frame), exc
            )
            return None

    def _recv_worker(self, timeout_ms: int):
        if not self.from_worker.poll(timeout_ms):
            return None
        msg = self._decode(self.from_worker.recv(), "worker")
        if isinstance(msg, m.FatalError):
            self.send_tok(msg)
            raise WorkerLost(f"the worker failed: {msg.message}")
        if isinstance(msg, m.GrammarCompiled) and self.scheduler is not None:
            self.scheduler.grammar_compiled(msg)
            return None
        return msg

    def send_worker_messages(self) -> None:
        """Grammars to compile, sent before the next step (the worker compiles them aside)."""
        for msg in self.scheduler.take_worker_messages():
            self.to_worker.send(m.encode(msg))

    def handle(self, msg) -> None:
        sched = self.scheduler
        if isinstance(msg, m.GenerateReq):
            logger.debug("request %s arrived: %d prompt tokens", msg.rid, len(msg.input_ids) // 4)
            sched.add_request(msg)
        elif isinstance(msg, m.AbortReq):
            sched.abort(msg.rid)
        elif isinstance(msg, m.ServerInfoReq):
            info = sched.server_info()
            own = self.gc.stats() if self.gc is not None else m.GcStats()
            info.gc = {"scheduler": own, "worker": self.worker_gc}
            self.send_tok(info)
        elif isinstance(msg, m.FlushCacheReq):
            self.send_tok(sched.flush_cache())
        elif isinstance(msg, m.MetricsReq):
            # NOTE: answered even with --disable-metrics (gauges only), so a request never hangs
            self.send_tok(sched.stats.report(sched) if sched.stats else gauges(sched))
        elif isinstance(msg, m.CacheTreeReq):
            self.send_tok(
                cache_tree(sched.cache, max(msg.max_depth, 0), max(msg.max_children, 1),
                           max(msg.max_nodes, 1))
            )  # fmt: skip
        elif isinstance(msg, m.ShutdownReq):
            self.running = False
        elif msg is not None:
            logger.warning("ignored an unexpected %s from the tokenizer", type(msg).__name__)

    def drain_inputs(self, timeout_ms: int, worker: bool) -> None:
        """Requests from the tokenizer; with `worker` (no step in flight: `finish_step` reads the
        worker otherwise) also the worker's compiled-grammar reports, which an idle scheduler
        waits for too."""
        deferred, self.deferred = self.deferred, []
        for msg in deferred:  # read while a step ran (`read_early`), in their order
            self.handle(msg)
        poller = zmq.Poller()
        poller.register(self.from_tok, zmq.POLLIN)
        if worker:
            poller.register(self.from_worker, zmq.POLLIN)
        if self.kv_replay is not None:  # KV-events snapshot requests
            poller.register(self.kv_replay, zmq.POLLIN)
        ready = dict(poller.poll(timeout_ms))
        if self.kv_replay is not None and self.kv_replay in ready:
            self.serve_kv_snapshots()
        if worker and self.from_worker in ready:
            while self.from_worker.poll(0):
                msg = self._recv_worker(timeout_ms=0)
                if msg is not None:
                    logger.warning("ignored an unexpected %s from the worker", type(msg).__name__)
        if self.from_tok not in ready:
            return
        while True:
            try:
                frame = self.from_tok.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handle(self._decode(frame, "tokenizer"))

    def wait_worker(self, timeout_ms: int):
        """The worker's next message (None after `timeout_ms`). With `reads_early`, requests that
        arrive meanwhile are read too (`read_early`): a host-tier hit is then loaded back while
        the step runs, before the batch that admits the request is built."""
        if not self.reads_early:
            return self._recv_worker(timeout_ms)
        poller = self._step_poller
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            left = max(0, math.ceil((deadline - time.monotonic()) * 1000))
            ready = dict(poller.poll(left))
            if self.from_tok in ready:
                self.read_early()
            if self.from_worker in ready:
                return self._recv_worker(timeout_ms=0)
            if time.monotonic() >= deadline:
                return None

    def read_early(self) -> None:
        """Messages from the tokenizer while a step runs: a request joins the waiting queue at
        once (`Admission.add`, which prefetches its host-tier hit), and the copies that queued
        go to the worker now (`HostCopies`), so they run beside the steps in flight. Anything
        else (and any request after it, to keep their order) waits for the loop's next read
        (`drain_inputs`): aborts, flushes and reports keep their place between steps."""
        while True:
            try:
                frame = self.from_tok.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = self._decode(frame, "tokenizer")
            if isinstance(msg, m.GenerateReq) and not self.deferred:
                self.handle(msg)
            elif msg is not None:
                self.deferred.append(msg)
        copies = self.scheduler.take_early_copies()
        if copies is not None:
            self.to_worker.send(m.encode(copies))

    def publish_kv_events(self) -> None:
        events = self.scheduler.kv_events if self.scheduler is not None else None
        if events is None or self.kv_pub is None:
            return
        batch = events.take_batch()
        if batch is not None:
            seq = batch.seq.to_bytes(8, "big")
            self.kv_pub.send_multipart([kv_events.TOPIC, seq, kv_events.encode(batch)])

    def serve_kv_snapshots(self) -> None:
        """Answer every snapshot request waiting on the replay socket (frames: the envelope,
        then b"snapshot"; the reply: the envelope, seq as 8 bytes big-endian, the Snapshot)."""
        while True:
            try:
                frames = self.kv_replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if self.scheduler is None or self.scheduler.kv_events is None:
                continue
            if frames[-1] != kv_events.SNAPSHOT_REQUEST:
                logger.warning("ignored a KV-events replay request %r", frames[-1][:32])
                continue
            self.publish_kv_events()  # the snapshot then covers exactly the batches sent
            snap = self.scheduler.kv_events.snapshot()
            seq = snap.seq.to_bytes(8, "big", signed=True)
            self.kv_replay.send_multipart([*frames[:-1], seq, kv_events.encode(snap)])

    def send_batch(self, batch: m.ForwardBatch, plan) -> InFlight:
        self.to_worker.send(m.encode(batch), copy=False)
        return InFlight(batch, plan, time.perf_counter())

    def finish_step(self, plan: list, step: InFlight) -> None:
        """Wait for a sent step's result (the watchdog: at most --watchdog-timeout from its
        sending, after the steps before it) and process it."""
        batch, plan = step.batch, step.plan
        deadline = time.monotonic() + self.args.watchdog_timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                message = (
                    f"the worker did not finish step {batch.step} within "
                    f"{self.args.watchdog_timeout:.0f}s (--watchdog-timeout); tearing down"
                )
                logger.error(message)
                self.send_tok(m.FatalError(role="worker", message=message))
                raise WorkerLost(message)
            msg = self.wait_worker(timeout_ms=int(min(remaining, 1.0) * 1000) + 1)
            if isinstance(msg, m.ForwardResult) and msg.step == batch.step:
                received = time.perf_counter()
                if msg.gc is not None:
                    self.worker_gc = msg.gc
                if logger.isEnabledFor(logging.DEBUG):
                    self._log_step(batch, plan, msg, received - step.sent_at)
                stats = self.scheduler.stats
                if stats is not None:
                    # the time this step held the pipeline: from its sending, or from the
                    # previous step's result when it queued behind that step (overlap)
                    began = max(step.sent_at, self._last_result_at)
                    tokens = sum(p.num_tokens for p in plan)
                    stats.step(
                        len(plan), tokens, received - began, msg.forward_s, msg.launch_s, msg.held_s
                    )
                self._last_result_at = received
                self.scheduler.process_result(plan, msg)
                return

    def _log_step(
        self, batch: m.ForwardBatch, plan, result: m.ForwardResult, wall_s: float
    ) -> None:
        """One line per step (--log-level debug): its shape, the worker's and the round trip's
        time, and the requests whose first token it produced."""
        fills = [p for p in plan if not p.req.output_ids or p.num_tokens > 1]
        firsts = [p.req.rid for p in fills if p.sample]
        logger.debug(
            "step %d: %d prefill rows (%d tokens), %d decode rows; worker %.2f ms, step %.2f ms; "
            "%d waiting; first tokens for %s",
            batch.step, len(fills), sum(p.num_tokens for p in fills), len(plan) - len(fills),
            result.forward_s * 1e3, wall_s * 1e3, len(self.scheduler.waiting), firsts,
        )  # fmt: skip

    # -- the loop --------------------------------------------------------------------------

    def loop(self) -> None:
        """Schedule, send, process. With the overlap schedule (the default), once step N is
        sent the next one is built and sent before N's result is processed when that is easy
        (`Scheduler.schedule_ahead`), so the worker receives N+1 while it computes N; otherwise
        (and with --disable-overlap-schedule) N's result is processed first and the next step
        is scheduled as usual (`advance`). Idle, it blocks on its sockets; the integrity check
        waits for a quiet moment (`IdleCheck`)."""
        sched = self.scheduler
        idle_check = IdleCheck()
        inflight: tuple[list, InFlight] | None = None  # sent, result not processed yet
        while self.running:
            busy = sched.has_work() or inflight is not None
            wait_ms = 0 if busy else idle_check.wait_ms(time.monotonic())
            self.drain_inputs(timeout_ms=wait_ms, worker=inflight is None)
            self.send_worker_messages()
            inflight, finished = advance(sched, inflight, self.send_batch, self.finish_step)
            if finished:
                idle_check.stepped()
            outputs = sched.take_outputs()
            if outputs:
                self.send_tok(m.BatchOutput(outputs=outputs, sent_at=time.perf_counter()))
            self.publish_kv_events()
            if sched.has_work() or inflight is not None:
                idle_check.busy()
            elif idle_check.due(time.monotonic()):
                sched.check_integrity()  # NOTE: a real check; a failure is a bug, so it is fatal
                idle_check.checked()
        self.to_worker.send(m.encode(m.ShutdownReq()))


class IdleCheck:
    """When the scheduler runs `check_integrity`: once per idle period, after the steps of the
    busy period before it, and only once no work has arrived for `grace_s`.

    NOTE: the check walks every page of the pool (O(pool): ~5 ms at 800K pages) and the loop
    answers nothing while it runs, so run at the first idle moment it would sit in front of
    the next request of a client that sends one right after its previous answer (a chat turn,
    a benchmark): that request would wait for it. After `grace_s` of quiet it costs nobody."""

    # how long the scheduler stays idle before it checks (a client's next request usually
    # comes sooner: the answer's round trip); idle, the loop otherwise wakes every IDLE_POLL_MS
    GRACE_S = 0.05
    IDLE_POLL_MS = 500

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.pending = False  # a step finished since the last check
        self.idle_since: float | None = None  # when the scheduler last became idle

    def stepped(self) -> None:
        self.pending = True
        self.idle_since = None

    def busy(self) -> None:
        self.idle_since = None

    def due(self, now: float) -> bool:
        """Idle now: is the check due? (The first idle call starts the quiet period.)"""
        if not self.pending:
            return False
        if self.idle_since is None:
            self.idle_since = now
        return now - self.idle_since >= self.grace_s

    def checked(self) -> None:
        self.pending = False
        self.idle_since = None

    def wait_ms(self, now: float) -> int:
        """How long an idle loop may block on its sockets: until the check is due, else
        IDLE_POLL_MS (any message wakes it at once)."""
        if not self.pending:
            return self.IDLE_POLL_MS
        since = now if self.idle_since is None else self.idle_since
        left = self.grace_s - (now - since)
        return max(0, min(self.IDLE_POLL_MS, math.ceil(left * 1000)))


def main() -> None:
    payload = read_child_payload()
    args = ServerArgs.from_json(payload["args"])
    set_process_title("scheduler")
    configure_logging(args.log_level, "scheduler")
    install_child_signal_handlers()
    proc = SchedulerProcess(args, payload["ipc_dir"])
    try:
        proc.start()
        proc.loop()
    except WorkerLost as exc:
        logger.error("%s", exc)
        sys.exit(3)
    except Exception as exc:
        logger.exception("scheduler crashed")
        try:
            proc.send_tok(m.FatalError(role="scheduler", message=f"{type(exc).__name__}: {exc}"))
            time.sleep(0.1)
        finally:
            os._exit(2)


if __name__ == "__main__":
    main()
