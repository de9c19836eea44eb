"""The worker process: `python -m radix_runtime.worker.main` (started by the launcher).

Owns tensors only: weights, the KV pool, attention metadata, sampling. It is told which pages each
request reads and writes and keeps no request policy.

The loop keeps up to one step in flight beyond the one being collected: a batch is launched
(`ModelRunner.launch`: host preparation, then all device work queued) as soon as it arrives, and
only then is the previous step collected and its result sent, so the device already holds the
next step while the host waits. While a step is pending and no batch has arrived, the loop waits
for whichever comes first, the step finishing (its result goes out at once: a result is never
held back for the next batch) or a new batch (launched first, then the pending step collected).
Results go out in step order. On the CPU there is nothing to overlap (`launch` computes the
step): a result goes out before the next batch is launched. A batch with constrained rows is
launched in two parts: the forward, then (after the previous step's result went out) its grammar
masks and sampling (`ModelRunner.sample`), which need the tokens the previous step sampled.

With tensor parallelism (`--tp N`) N of these processes run, one per rank: every rank receives
every frame the scheduler sends (its own inbox, utils/tp.py) and runs the same loop, its
collectives meeting the other ranks' inside each step; only rank 0 sends results (a failing
rank reports its error too).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque

import msgspec
import zmq

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.utils import gc_tuning
from radix_runtime.utils.procs import (
    configure_logging,
    endpoint,
    install_child_signal_handlers,
    read_child_payload,
    set_process_title,
    zmq_socket,
)
from radix_runtime.utils.tp import rank_inbox, rank_role

logger = logging.getLogger("radix_runtime.worker")

# Fault injection for the reliability tests: hang (sleep) when this step number is reached.
HANG_AT_STEP_ENV = "RADIX_RUNTIME_FAULT_WORKER_HANG_AT_STEP"


def serve(args: ServerArgs, ipc_dir: str, rank: int = 0) -> None:
    ctx = zmq.Context()
    role = rank_role(rank)
    inbox_at = rank_inbox(args, ipc_dir, rank)
    inbox = Inbox(zmq_socket(ctx, zmq.PULL, inbox_at.addr, bind=inbox_at.worker_binds))
    # (a rank on another host has no way back: its death reaches node 0 through the collectives)
    to_scheduler = zmq_socket(ctx, zmq.PUSH, endpoint(ipc_dir, "scheduler_w"), bind=False)
    outbox = to_scheduler if rank == 0 else _NoResults()  # only rank 0 reports step results
    try:
        from radix_runtime.worker.distributed import TPRank
        from radix_runtime.worker.model_runner import ModelRunner

        runner = ModelRunner(args, tp=TPRank.for_worker(args, rank, ipc_dir))
    except Exception as exc:
        logger.exception("the worker failed to start")
        to_scheduler.send(m.encode(m.FatalError(role=role, message=f"{type(exc).__name__}: {exc}")))
        time.sleep(0.2)
        raise SystemExit(2) from exc
    outbox.send(m.encode(runner.ready_info()))
    if runner.grammars is not None:
        runner.grammars.warm()  # in the background: the first constrained request is faster
    gc_watch = gc_tuning.ready(args, role)
    hang_at = int(os.environ.get(HANG_AT_STEP_ENV, "0") or 0)

    def fail(what: str, exc: Exception) -> None:
        logger.exception("%s failed", what)
        to_scheduler.send(m.encode(m.FatalError(role=role, message=f"{type(exc).__name__}: {exc}")))
        time.sleep(0.2)
        raise SystemExit(2) from exc

    early_copies = runner.host_pool is not None and runner.device.type == "cuda"

    def finish(pending, held_s: float = 0.0) -> None:
        try:
            if early_copies:  # host-tier copies sent on their own go out while it computes
                inbox.copies_while(pending, runner)
            result = runner.collect(pending)
        except Exception as exc:
            fail(f"forward step {pending.step}", exc)
        result.launch_s = pending.launch_s
        result.held_s = held_s
        result.gc = gc_watch.report()
        outbox.send(m.encode(result), copy=False)

    pending = None  # the launched step whose result is not sent yet
    while True:
        for done in runner.finished_compiles():  # grammars compiled on the side threads
            outbox.send(m.encode(done))
        if pending is not None and not wait_for_batch(inbox, pending):
            finish(pending)  # it is done and nothing new came: never hold a result back
            pending = None
            continue
        if runner.compiles_pending() and not inbox.poll(_COMPILE_POLL_MS):
            continue  # report a compile as soon as it is done
        msg = inbox.recv()
        if msg is None:
            continue
        if isinstance(msg, m.ForwardBatch):
            if hang_at and msg.step >= hang_at:
                if pending is not None:  # the steps before it complete
                    finish(pending)
                logger.warning("fault injection: hanging at step %d", msg.step)
                time.sleep(1e9)
            if pending is not None and runner.device.type == "cpu":
                # NOTE: on the CPU `launch` computes the whole step, so launching first would hold
                # a finished result back for a whole step (a first token's TTFT included)
                finish(pending)
                pending = None
            t0 = time.perf_counter()
            try:
                # a constrained row's mask needs the token `pending` samples: its result goes
                # out first, so the scheduler builds the next batch while the mask is filled
                launched = runner.launch(msg, defer_sample=pending is not None)
            except Exception as exc:
                fail(f"forward step {msg.step}", exc)
            took = time.perf_counter() - t0
            if pending is not None:  # the device already holds `launched` behind it
                # held_s: at most the launch's time, when `pending` was done by its end
                finish(pending, took if pending.ready() else 0.0)
            t1 = time.perf_counter()
            try:
                runner.sample(launched)
            except Exception as exc:
                fail(f"forward step {msg.step}", exc)
            launched.launch_s = took + time.perf_counter() - t1
            pending = launched
        elif isinstance(msg, m.HostCopies):
            try:
                runner.early_copies(msg)
            except Exception as exc:
                fail("host-tier copies", exc)
        elif isinstance(msg, m.CompileGrammar):
            runner.compile_grammar(msg.kind, msg.text)
        elif isinstance(msg, m.ShutdownReq):
            runner.tp.leave()
            return
        else:
            logger.warning("ignored an unexpected %s", type(msg).__name__)


class Inbox:
    """The scheduler's messages, decoded in order. While a step is collected (`copies_while`) the
    host tier's HostCopies are made at once; any other message read then waits in `stash`, and
    from the first one on everything does, so the messages keep their order (a batch's copies
    and a later HostCopies' loads may name the same device page)."""

    def __init__(self, sock) -> None:
        self.sock = sock
        self.stash: deque = deque()

    def poll(self, timeout_ms: int = 0) -> bool:
        return bool(self.stash) or bool(self.sock.poll(timeout_ms))

    def recv(self):
        """The next message (None: a malformed frame, dropped)."""
        if self.stash:
            return self.stash.popleft()
        return self._decode(self.sock.recv())

    @staticmethod
    def _decode(frame: bytes):
        try:
            return m.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("dropped a malformed frame (%d bytes): %s", len(frame), exc)
            return None

    def copies_while(self, pending, runner) -> None:
        """Until `pending` is done: make the HostCopies that arrive (`ModelRunner.early_copies`:
        loads of requests the scheduler read while this step runs, queued beside the steps in
        flight), stashing anything else (then stop reading: it keeps its place)."""
        spin_until = time.perf_counter() + _SPIN_S
        while not self.stash and not pending.ready():
            if not self.sock.poll(0 if time.perf_counter() < spin_until else 1):
                continue
            msg = self._decode(self.sock.recv())
            if isinstance(msg, m.HostCopies):
                runner.early_copies(msg)
            elif msg is not None:
                self.stash.append(msg)


class _NoResults:
    """The result socket of a rank other than 0: its results are rank 0's."""

    def send(self, *_args, **_kwargs) -> None:
        pass


# while a step runs on the device, spin (poll the socket, query the step's event) this long
# (a decode step is a few ms, and cudaEventSynchronize spins too by default); past it, poll with
# a 1 ms timeout, so a long step does not keep a core busy
_SPIN_S = 0.5
# while grammars compile and no step runs, look for finished compiles this often
_COMPILE_POLL_MS = 2


def wait_for_batch(inbox: Inbox, pending) -> bool:
    """Wait until `pending` is done (False) or a message arrives (True), whichever is first."""
    if inbox.poll(0):
        return True
    spin_until = time.perf_counter() + _SPIN_S
    while not pending.ready():
        if inbox.poll(0 if time.perf_counter() < spin_until else 1):
            return True
    return False


def main() -> None:
    payload = read_child_payload()
    args = ServerArgs.from_json(payload["args"])
    rank = int(payload.get("tp_rank", 0))
    set_process_title(rank_role(rank))
    configure_logging(args.log_level, rank_role(rank))
    install_child_signal_handlers()
    try:
        serve(args, payload["ipc_dir"], rank)
    except SystemExit:
        raise
    except Exception:
        logger.exception("worker crashed")
        sys.exit(2)


if __name__ == "__main__":
    main()
