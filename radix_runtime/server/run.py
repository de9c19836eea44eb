"""`radix-runtime serve`: the tokenizer process runs the HTTP server and watches its children."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import uvicorn

from radix_runtime.config import ServerArgs
from radix_runtime.launch import Children, load_frontend
from radix_runtime.server.tokenizer_manager import TokenizerManager
from radix_runtime.utils import gc_tuning
from radix_runtime.utils.procs import configure_logging, set_process_title

logger = logging.getLogger("radix_runtime.server")

# After a child dies, keep answering /health with 503 this long, then exit.
FATAL_GRACE_S = 3.0


class DrainingServer(uvicorn.Server):
    """SIGTERM: refuse new requests (503), let in-flight ones finish within the drain timeout,
    then exit. SIGINT (Ctrl-C): exit now; a second Ctrl-C forces it."""

    def __init__(self, config: uvicorn.Config, manager: TokenizerManager, drain_timeout: float):
        super().__init__(config)
        self.manager = manager
        self.drain_timeout = drain_timeout
        self.loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig, frame) -> None:  # called in signal context: no awaiting here
        if sig == signal.SIGTERM and not self.manager.draining and self.loop is not None:
            logger.info("SIGTERM: draining %d in-flight requests", self.manager.num_inflight)
            self.manager.draining = True
            self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))
            return
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while self.manager.num_inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.manager.num_inflight:
            # NOTE: what outlives the drain gets a 503, not a connection cut by uvicorn's shutdown
            self.manager.fail_inflight(
                f"the server shut down: --drain-timeout ({self.drain_timeout:g}s) expired"
            )
            deadline = time.monotonic() + 1.0
            while self.manager.num_inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        self.should_exit = True

    def exit_soon(self, delay: float) -> None:
        assert self.loop is not None
        self.loop.call_later(delay, setattr, self, "should_exit", True)


async def _serve(args: ServerArgs, children: Children, source, tokenizer) -> int:
    from radix_runtime.server.http_server import build_app

    loop = asyncio.get_running_loop()
    manager = TokenizerManager(args, tokenizer, source.name, source.path, children.ipc_dir)
    if args.served_model_name:
        manager.model_name = args.served_model_name

    def on_death(role: str, code: int) -> None:
        manager.fail(f"the {role} process exited with code {code}")

    children.watch(lambda role, code: loop.call_soon_threadsafe(on_death, role, code))
    try:
        await manager.start()
    except Exception as exc:
        logger.error("startup failed: %s", exc)
        return 1

    app = build_app(manager, args)
    gc_tuning.ready(args, "tokenizer")
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level if args.log_level != "debug" else "debug",
        access_log=args.log_level == "debug",
        loop="none",
        timeout_graceful_shutdown=2,
        limit_concurrency=None,
    )
    server = DrainingServer(config, manager, args.drain_timeout)
    server.loop = loop
    manager.on_fatal = lambda _msg: server.exit_soon(FATAL_GRACE_S)
    logger.info(
        "serving %s on http://%s:%d (pids: %s)",
        manager.model_name,
        args.host,
        args.port,
        children.pids(),
    )
    await server.serve()
    await manager.close()
    return 0 if manager.healthy or manager.draining else 1


def run_server(args: ServerArgs) -> int:
    if args.node_rank > 0:  # a multi-node tensor-parallel server's other hosts: ranks only
        from radix_runtime.launch import run_worker_node

        set_process_title(f"node{args.node_rank}")
        configure_logging(args.log_level, f"node{args.node_rank}")
        return run_worker_node(args)
    set_process_title("tokenizer")
    configure_logging(args.log_level, "tokenizer")
    children = Children(args)
    try:
        source, tokenizer = load_frontend(args)
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
            runner = asyncio.run
        return runner(_serve(args, children, source, tokenizer))
    except KeyboardInterrupt:
        return 130
    finally:
        children.shutdown()
