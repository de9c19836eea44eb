"""Starting the processes: the scheduler and worker children, watched by the tokenizer process.

    tokenizer process (this one) ──▶ scheduler child ──▶ worker child (one per --tp rank)

With --nnodes > 1, node 0 runs all three roles and its share of the ranks; every other node
runs only its ranks (`run_worker_node`), which join node 0's at --dist-init-addr.

The parent notices a dead child (a watcher thread on the children's pids) and shuts down; the
children die with the parent (PR_SET_PDEATHSIG plus a polling thread, see utils/procs.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Callable

from radix_runtime.config import ServerArgs
from radix_runtime.model_source import ModelSource, resolve_model
from radix_runtime.utils.procs import make_ipc_dir, spawn_child, terminate_children
from radix_runtime.utils.tp import local_ranks, rank_role

logger = logging.getLogger(__name__)


class Children:
    """The scheduler and worker processes of one server (or of one node of a multi-node
    tensor-parallel server: its ranks only), and the watcher that notices deaths: any of them
    dying ends the server (a rank's peers would wait for it forever)."""

    def __init__(
        self, args: ServerArgs, env: dict[str, str] | None = None, cpus: list[int] | None = None
    ):
        """`env` and `cpus` place the children (an in-process data-parallel replica's share of
        the host: its GPU, or its CPU cores and threads; see dp/supervisor.py plan_replicas)."""
        self.args = args
        self.ipc_dir = make_ipc_dir()
        payload = {"args": args.to_json(), "ipc_dir": self.ipc_dir}
        self.procs: dict[str, subprocess.Popen] = {
            rank_role(rank): spawn_child(
                "radix_runtime.worker.main", {**payload, "tp_rank": rank}, env=env
            )
            for rank in local_ranks(args)
        }
        if args.node_rank == 0:
            self.procs["scheduler"] = spawn_child("radix_runtime.scheduler.main", payload, env=env)
        if cpus:
            for proc in self.procs.values():
                # NOTE: set before the child starts its torch threads, which inherit it
                os.sched_setaffinity(proc.pid, cpus)
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def watch(self, on_death: Callable[[str, int], None], interval: float = 0.2) -> None:
        """Call on_death(role, returncode) from a thread once any child exits unexpectedly."""

        def run() -> None:
            while not self._stopping.wait(interval):
                for role, proc in self.procs.items():
                    code = proc.poll()
                    if code is not None:
                        if not self._stopping.is_set():
                            on_death(role, code)
                        return

        self._watcher = threading.Thread(target=run, name="child-watcher", daemon=True)
        self._watcher.start()

    def dead_child(self) -> tuple[str, int] | None:
        for role, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return role, code
        return None

    def pids(self) -> dict[str, int]:
        return {role: p.pid for role, p in self.procs.items()}

    def shutdown(self, grace: float = 2.0) -> None:
        """Stop the children: they exit on the ShutdownReq sent before this; after a death
        (nobody forwards that message any more) or past `grace`, they are killed."""
        self._stopping.set()
        if self.dead_child() is not None:
            grace = 0.0
        terminate_children(list(self.procs.values()), grace)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def load_frontend(args: ServerArgs) -> tuple[ModelSource, object]:
    """The model source and its tokenizer (dummy models have none: token ids only)."""
    from radix_runtime.tokenizer import load_tokenizer

    source = resolve_model(args.model, args.load_format, args.model_config)
    if args.tokenizer is not None:
        return source, load_tokenizer(args.tokenizer)
    if source.kind == "dummy":
        return source, None
    return source, load_tokenizer(source)


def run_worker_node(args: ServerArgs) -> int:
    """A node other than 0 of a multi-node tensor-parallel server: run this node's ranks until
    one of them exits (node 0's shutdown, or a death anywhere reaching them through a failed
    collective) or this process is told to stop; then stop the rest."""
    import signal

    children = Children(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    logger.info("node %d of %d: tp ranks %s", args.node_rank, args.nnodes, children.pids())
    try:
        while not stop.wait(0.2):
            dead = children.dead_child()
            if dead is not None:
                logger.info("%s exited with code %d: stopping this node", *dead)
                return 0 if dead[1] == 0 else 1
        return 0
    finally:
        children.shutdown(grace=0.0)
