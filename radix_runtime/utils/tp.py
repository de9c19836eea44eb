"""Where tensor-parallel ranks live and how the scheduler reaches them (torch-free: the launcher
and the scheduler import it).

One scheduler sends every step to every rank: one PUSH socket per rank, the same frame on each
(docs/decisions.md, "Tensor parallelism: how a step reaches the ranks"). Ranks on this host bind
an ipc:// path in the server's private directory; ranks on another host (--nnodes > 1) are
reached over TCP on node 0's --dist-init-addr host, ports PORT+1+rank, where the scheduler
binds and the remote rank connects. Only rank 0 sends results back.
"""

from __future__ import annotations

from typing import NamedTuple

import zmq

from radix_runtime.config import ServerArgs
from radix_runtime.utils.procs import endpoint, zmq_socket


def rank_role(rank: int) -> str:
    """The process role of a worker rank (its title, and the name a death is reported with)."""
    return "worker" if rank == 0 else f"worker_tp{rank}"


def local_ranks(args: ServerArgs) -> range:
    """The tp ranks this host runs (--tp / --nnodes of them, by --node-rank)."""
    per_node = args.tp // args.nnodes
    return range(args.node_rank * per_node, (args.node_rank + 1) * per_node)


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


class RankInbox(NamedTuple):
    addr: str
    worker_binds: bool  # else the scheduler binds and the worker connects


def rank_inbox(args: ServerArgs, ipc_dir: str, rank: int) -> RankInbox:
    """Where rank `rank` receives the scheduler's frames."""
    per_node = args.tp // args.nnodes
    if rank < per_node:  # on node 0, with the scheduler
        return RankInbox(endpoint(ipc_dir, "worker" if rank == 0 else f"worker{rank}"), True)
    assert args.dist_init_addr is not None  # validated: nnodes > 1 needs it
    host, port = split_addr(args.dist_init_addr)
    return RankInbox(f"tcp://{host}:{port + 1 + rank}", False)


class RankFanout:
    """The scheduler's way to the worker: the same frame to every rank, in the same order on
    each (with `--tp 1`, the one PUSH socket it always was)."""

    def __init__(self, ctx: zmq.Context, args: ServerArgs, ipc_dir: str) -> None:
        self.sockets = []
        for rank in range(args.tp):
            inbox = rank_inbox(args, ipc_dir, rank)
            self.sockets.append(zmq_socket(ctx, zmq.PUSH, inbox.addr, bind=not inbox.worker_binds))

    def send(self, frame: bytes, copy: bool = True) -> None:
        for sock in self.sockets:
            sock.send(frame, copy=copy)
