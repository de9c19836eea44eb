"""The tokenizer process's bridge to the scheduler: sends tokenized requests, receives token ids,
detokenizes them incrementally (UTF-8 safe), applies stop strings, and streams the increments.

Used by the HTTP server and by the offline `Engine` alike: both run it on an asyncio loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.frontend.contract import GenerateChunk, GenerateInput
from radix_runtime.frontend.errors import GenerationError
from radix_runtime.server.metrics import Metrics, RequestTiming
from radix_runtime.tokenizer import IncrementalDetokenizer, StopMatcher
from radix_runtime.utils import gc_tuning
from radix_runtime.utils.procs import endpoint, zmq_socket

logger = logging.getLogger(__name__)


@dataclass
class _HeldToken:
    """An output token and where its text lies in the detokenized output ([start, end))."""

    id: int
    logprob: float | None
    top: list[tuple[int, float]] | None
    start: int
    end: int


@dataclass
class _ReqState:
    inp: GenerateInput
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    timing: RequestTiming | None = None  # with metrics on
    reached_scheduler: bool = False  # sent and not rejected: its finish is counted


class TokenizerManager:
    def __init__(self, args: ServerArgs, tokenizer, model_name: str, model_path: str, ipc_dir: str):
        self.args = args
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model_path = model_path
        self.chat_template = getattr(tokenizer, "chat_template", None)
        self.ipc_dir = ipc_dir
        self.healthy = False
        self.draining = False
        self.fatal_message: str | None = None
        self.context_length = 0
        self.vocab_size = 0
        self.max_total_tokens = 0
        self.states: dict[str, _ReqState] = {}
        self._info_waiters: deque[asyncio.Future] = deque()
        self._flush_waiters: deque[asyncio.Future] = deque()
        self._metrics_waiters: deque[asyncio.Future] = deque()
        self._tree_waiters: deque[asyncio.Future] = deque()
        self.metrics: Metrics | None = None  # made in start(), once the model name is final
        self._ready: asyncio.Future | None = None
        self._recv_task: asyncio.Task | None = None
        self.on_fatal: Callable[[str], None] | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, timeout: float = 3600.0) -> None:
        """Open the sockets and wait for the scheduler (which waits for the worker)."""
        self.ctx = zmq.asyncio.Context()
        self.from_sched = zmq_socket(
            self.ctx, zmq.PULL, endpoint(self.ipc_dir, "tokenizer"), bind=True
        )
        self.to_sched = zmq_socket(
            self.ctx, zmq.PUSH, endpoint(self.ipc_dir, "scheduler"), bind=False
        )
        self._ready = asyncio.get_running_loop().create_future()
        self._recv_task = asyncio.create_task(self._recv_loop())
        self._recv_task.add_done_callback(self._recv_loop_ended)
        ready: m.SchedulerReady = await asyncio.wait_for(self._ready, timeout)
        self.context_length = ready.context_length
        self.vocab_size = ready.vocab_size
        self.max_total_tokens = ready.max_total_tokens
        if not self.args.disable_metrics:
            self.metrics = Metrics(self.model_name)
        self.healthy = True

    async def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
        try:  # NOTE: never waits: after a death there may be nobody to take it
            await self.to_sched.send(m.encode(m.ShutdownReq()), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self.from_sched.close(0)
        self.to_sched.close(0)
        self.ctx.term()

    def fail(self, message: str) -> None:
        """A child died or reported a fatal error: fail everything in flight, refuse new work."""
        if self.fatal_message is None:
            logger.error("fatal: %s", message)
        self.healthy = False
        self.fatal_message = message
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(RuntimeError(message))
        self.fail_inflight(message)
        for waiters in (
            self._info_waiters,
            self._flush_waiters,
            self._metrics_waiters,
            self._tree_waiters,
        ):
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_exception(RuntimeError(message))
        if self.on_fatal is not None:
            self.on_fatal(message)

    def fail_inflight(self, message: str) -> None:
        """End every in-flight generation with a 503 carrying `message`."""
        err = m.ReqOutput(rid="", finish_reason="error", error=message, error_code="server_error")
        for state in self.states.values():
            state.queue.put_nowait(err)

    @property
    def num_inflight(self) -> int:
        return len(self.states)

    # -- receiving -------------------------------------------------------------------------

    def _recv_loop_ended(self, task: asyncio.Task) -> None:
        """The receive loop only ends by close(); a bug that ends it otherwise would leave every
        request waiting forever, so it is a fatal error (in flight: 503; /health: 503)."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        logger.error("the receive loop failed", exc_info=exc)
        self.fail(f"the tokenizer process's receive loop failed: {exc!r}")

    async def _recv_loop(self) -> None:
        while True:
            frame = await self.from_sched.recv()
            try:
                msg = m.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("dropped a malformed frame (%d bytes): %s", len(frame), exc)
                continue
            if isinstance(msg, m.BatchOutput):
                now = time.perf_counter()
                metrics = self.metrics
                for out in msg.outputs:
                    state = self.states.get(out.rid)
                    if state is not None:
                        state.queue.put_nowait(out)
                        if metrics is not None and out.new_ids:
                            metrics.on_tokens(state.timing, len(out.new_ids) // 4, now, msg.sent_at)
            elif isinstance(msg, m.SchedulerMetrics):
                # NOTE: applied whether or not a scrape still waits, so no increment is lost
                if self.metrics is not None:
                    self.metrics.apply(msg)
                self._resolve(self._metrics_waiters, msg)
            elif isinstance(msg, m.CacheTree):
                self._resolve(self._tree_waiters, msg)
            elif isinstance(msg, m.ServerInfo):
                self._resolve(self._info_waiters, msg)
            elif isinstance(msg, m.FlushCacheDone):
                self._resolve(self._flush_waiters, msg)
            elif isinstance(msg, m.SchedulerReady):
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result(msg)
            elif isinstance(msg, m.FatalError):
                self.fail(f"the {msg.role} failed: {msg.message}")
            else:
                logger.warning("ignored an unexpected %s", type(msg).__name__)

    @staticmethod
    def _resolve(waiters: deque, value) -> None:
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(value)
                return

    # -- requests --------------------------------------------------------------------------

    def serving_error(self, *, new_work: bool = True) -> GenerationError | None:
        """Why this server refuses work now, or None. The one serving-state check: the HTTP
        front (before it reads a body), /health, and every generation and control message ask
        it. A control message (info, flush, metrics) needs only a live scheduler
        (``new_work=False``); a new generation is refused while draining too."""
        if not self.healthy:
            why = self.fatal_message or "its processes are not ready"
            return GenerationError(f"the server is unhealthy: {why}", "unhealthy", 503)
        if new_work and self.draining:
            return GenerationError("the server is shutting down", "draining", 503)
        return None

    def _check_serving(self, *, new_work: bool = True) -> None:
        error = self.serving_error(new_work=new_work)
        if error is not None:
            raise error

    async def _send(self, msg) -> None:
        await self.to_sched.send(m.encode(msg))

    async def generate(self, inp: GenerateInput) -> AsyncIterator[GenerateChunk]:
        """Yield increments of one generation; the last one has finish_reason set."""
        self._check_serving()
        rid = inp.rid or uuid.uuid4().hex
        if rid in self.states:
            raise GenerationError(
                f"request id {rid!r} is already running", "duplicate_request_id", 400
            )
        state = _ReqState(inp)
        if self.metrics is not None:
            state.timing = RequestTiming()
        self.states[rid] = state
        logger.debug("request %s: %d prompt tokens to the scheduler", rid, len(inp.input_ids))
        try:
            await self._send(
                m.GenerateReq(
                    rid=rid,
                    input_ids=m.pack_ids(inp.input_ids),
                    sampling=inp.sampling,
                    return_logprob=inp.return_logprob,
                    top_logprobs_num=inp.top_logprobs_num,
                    logprob_start_len=inp.logprob_start_len,
                    cache_namespace=inp.cache_namespace,
                    sent_at=time.perf_counter(),
                )
            )
            state.reached_scheduler = True
            async for chunk in self._stream(rid, state):
                yield chunk
        finally:
            self.states.pop(rid, None)
            if self.metrics is not None and state.reached_scheduler:
                self.metrics.on_finish(state.timing, "abort")  # no-op when already counted
            if not state.finished and self.healthy:
                # the consumer went away (client disconnect, cancellation): free its pages now
                await self._send(m.AbortReq(rid=rid))

    async def _stream(self, rid: str, state: _ReqState) -> AsyncIterator[GenerateChunk]:
        inp = state.inp
        detok = (
            IncrementalDetokenizer(self.tokenizer, skip_special_tokens=inp.skip_special_tokens)
            if self.tokenizer is not None
            else None  # dummy weights without a tokenizer: token ids only
        )
        # (without a tokenizer there is no text for a stop string to match)
        stops = StopMatcher(inp.stop) if inp.stop and detok is not None else None
        completion_tokens = 0
        prompt_lps: list[float] = []
        prompt_tops: list[list[tuple[int, float]]] = []
        # Output tokens whose text the stop matcher still holds back wait with it, so that the
        # tokens of a stop string it trims never reach completion_tokens or the logprobs, and a
        # stream reports what the non-streamed response does. Offsets count characters of the
        # detokenized output: `produced` so far, `emitted` of them released by the matcher.
        held: list[_HeldToken] = []
        produced = emitted = 0
        while True:
            out: m.ReqOutput = await state.queue.get()
            if out.error is not None:
                state.finished = True
                state.reached_scheduler = False  # rejected or failed: not a finished request
                status = 503 if out.error_code == "server_error" else 400
                raise GenerationError(out.error, out.error_code or "invalid_request", status)
            ids = m.unpack_ids(out.new_ids).tolist() if out.new_ids else []
            if out.prompt_logprobs:
                prompt_lps.extend(m.unpack_floats(out.prompt_logprobs).tolist())
                if out.prompt_top_ids and inp.top_logprobs_num:
                    k = inp.top_logprobs_num
                    tids = m.unpack_ids(out.prompt_top_ids).reshape(-1, k).tolist()
                    tlps = m.unpack_floats(out.prompt_top_logprobs).reshape(-1, k).tolist()
                    prompt_tops.extend(list(zip(a, b)) for a, b in zip(tids, tlps))
            finish = out.finish_reason
            matched = out.matched_stop
            lps: list[float] = []
            tops: list[list[tuple[int, float]]] | None = None
            if inp.return_logprob and out.output_logprobs:
                lps = m.unpack_floats(out.output_logprobs).tolist()
                if inp.top_logprobs_num and out.top_ids:
                    k = inp.top_logprobs_num
                    tids = m.unpack_ids(out.top_ids).reshape(-1, k)
                    tlps = m.unpack_floats(out.top_logprobs).reshape(-1, k)
                    tops = [
                        list(zip(r_ids.tolist(), r_lps.tolist()))
                        for r_ids, r_lps in zip(tids, tlps)
                    ]
            # the stop token itself is not part of the text
            n_visible = (
                len(ids) - 1 if finish == "stop" and matched is not None and ids else len(ids)
            )
            text = ""
            for i, tok in enumerate(ids):
                start = produced
                if detok is not None and i < n_visible:
                    delta = detok.add([tok])
                    text += delta
                    produced += len(delta)
                held.append(
                    _HeldToken(
                        tok,
                        lps[i] if i < len(lps) else None,
                        tops[i] if tops is not None and i < len(tops) else None,
                        start,
                        produced,
                    )
                )
            if detok is not None and finish is not None:
                delta = detok.flush()
                text += delta
                produced += len(delta)
            if stops is not None:
                text, stopped = stops.feed(text)
                emitted += len(text)
                if stopped and finish is None:
                    finish, matched = "stop", stops.matched
                    state.finished = True
                    await self._send(m.AbortReq(rid=rid))
                elif finish is not None and not stopped:
                    flushed = stops.flush()
                    text += flushed
                    emitted += len(flushed)
                if stopped:
                    # NOTE: the tokens of a trimmed stop string (and after it) are dropped: not
                    # counted, no logprobs; a token with any character in the text is kept
                    held = [t for t in held if t.start < emitted]
                    released, held = held, []
                elif finish is not None:
                    released, held = held, []
                else:
                    # a token whose text is all held back (it may start a stop string) waits
                    cut = next((j for j, t in enumerate(held) if t.start >= emitted), len(held))
                    released, held = held[:cut], held[cut:]
            else:
                released, held = held, []
            completion_tokens += len(released)
            if finish is not None:
                state.finished = True
                if self.metrics is not None:
                    self.metrics.on_finish(state.timing, finish)
            ids = [t.id for t in released]
            chunk = GenerateChunk(
                text=text,
                ids=ids,
                finish_reason=finish,
                matched_stop=matched,
                prompt_tokens=out.prompt_tokens,
                completion_tokens=completion_tokens,
                cached_tokens=out.cached_tokens,
                host_cached_tokens=out.host_cached_tokens,
            )
            if inp.return_logprob and any(t.logprob is not None for t in released):
                chunk.output_logprobs = [t.logprob for t in released]
                if inp.top_logprobs_num:
                    chunk.output_top_logprobs = [t.top or [] for t in released]
            if prompt_lps and (finish is not None or ids):
                chunk.prompt_logprobs, prompt_lps = prompt_lps, []
                if prompt_tops:
                    chunk.prompt_top_logprobs, prompt_tops = prompt_tops, []
            if ids or text or finish is not None or chunk.prompt_logprobs:
                yield chunk
            if finish is not None:
                return

    async def abort(self, rid: str) -> None:
        state = self.states.get(rid)
        if state is not None and not state.finished:
            state.finished = True
            await self._send(m.AbortReq(rid=rid))
            state.queue.put_nowait(m.ReqOutput(rid=rid, finish_reason="abort"))

    async def server_info(self) -> dict:
        self._check_serving(new_work=False)
        fut = asyncio.get_running_loop().create_future()
        self._info_waiters.append(fut)
        await self._send(m.ServerInfoReq())
        info: m.ServerInfo = await asyncio.wait_for(fut, 30)
        # every field, zero counters included (the wire format omits defaults)
        out = msgspec.to_builtins(msgspec.structs.asdict(info))
        watch = gc_tuning.current()
        if watch is not None:  # this process's collections (a server's tokenizer process)
            out["gc"] = {"tokenizer": msgspec.to_builtins(watch.stats()), **out["gc"]}
        return out

    async def _ask(self, waiters: deque, msg, timeout: float = 30):
        """Send a control message to the scheduler and await its reply (replies come in order)."""
        self._check_serving(new_work=False)
        fut = asyncio.get_running_loop().create_future()
        waiters.append(fut)
        await self._send(msg)
        return await asyncio.wait_for(fut, timeout)

    async def flush_cache(self) -> dict:
        """Drop every unlocked node of the radix tree; what was dropped and what stayed."""
        done: m.FlushCacheDone = await self._ask(self._flush_waiters, m.FlushCacheReq())
        out = msgspec.to_builtins(msgspec.structs.asdict(done))
        out["success"] = out.pop("ok")
        return out

    async def refresh_metrics(self) -> None:
        """Bring the scheduler's latest numbers into `self.metrics` (the receive loop applies
        them)."""
        await self._ask(self._metrics_waiters, m.MetricsReq())

    async def cache_tree(self, max_depth: int, max_children: int, max_nodes: int) -> m.CacheTree:
        return await self._ask(
            self._tree_waiters, m.CacheTreeReq(max_depth, max_children, max_nodes)
        )
