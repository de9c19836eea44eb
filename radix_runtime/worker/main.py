"""The worker process: `python -m radix_runtime.worker.main` (started by the launcher).

Owns tensors only: weights, the KV pool, attention metadata, sampling. It is told which pages each
request reads and writes and keeps no request policy.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import msgspec
import zmq

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.utils.procs import (
    configure_logging,
    endpoint,
    install_child_signal_handlers,
    read_child_payload,
    set_process_title,
    zmq_socket,
)

logger = logging.getLogger("radix_runtime.worker")

# Fault injection for the reliability tests: hang (sleep) when this step number is reached.
HANG_AT_STEP_ENV = "RADIX_RUNTIME_FAULT_WORKER_HANG_AT_STEP"


def serve(args: ServerArgs, ipc_dir: str) -> None:
    ctx = zmq.Context()
    inbox = zmq_socket(ctx, zmq.PULL, endpoint(ipc_dir, "worker"), bind=True)
    outbox = zmq_socket(ctx, zmq.PUSH, endpoint(ipc_dir, "scheduler_w"), bind=False)
    try:
        from radix_runtime.worker.model_runner import ModelRunner

        runner = ModelRunner(args)
    except Exception as exc:
        logger.exception("the worker failed to start")
        outbox.send(m.encode(m.FatalError(role="worker", message=f"{type(exc).__name__}: {exc}")))
        time.sleep(0.2)
        raise SystemExit(2) from exc
    outbox.send(m.encode(runner.ready_info()))
    hang_at = int(os.environ.get(HANG_AT_STEP_ENV, "0") or 0)
    while True:
        frame = inbox.recv()
        try:
            msg = m.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("dropped a malformed frame (%d bytes): %s", len(frame), exc)
            continue
        if isinstance(msg, m.ForwardBatch):
            if hang_at and msg.step >= hang_at:
                logger.warning("fault injection: hanging at step %d", msg.step)
                time.sleep(1e9)
            try:
                result = runner.forward(msg)
            except Exception as exc:
                logger.exception("forward step %d failed", msg.step)
                outbox.send(
                    m.encode(m.FatalError(role="worker", message=f"{type(exc).__name__}: {exc}"))
                )
                time.sleep(0.2)
                raise SystemExit(2) from exc
            outbox.send(m.encode(result), copy=False)
        elif isinstance(msg, m.ShutdownReq):
            return
        else:
            logger.warning("ignored an unexpected %s", type(msg).__name__)


def main() -> None:
    payload = read_child_payload()
    args = ServerArgs.from_json(payload["args"])
    set_process_title("worker")
    configure_logging(args.log_level, "worker")
    install_child_signal_handlers()
    try:
        serve(args, payload["ipc_dir"])
    except SystemExit:
        raise
    except Exception:
        logger.exception("worker crashed")
        sys.exit(2)


if __name__ == "__main__":
    main()
