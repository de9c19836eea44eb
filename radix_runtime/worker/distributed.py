"""Tensor parallelism in the worker: joining the ranks, each rank's share of the model, and the
collectives the runner and the row-parallel layers call.

With `--tp N` every worker rank holds 1/N of each decoder layer (Megatron-style, as SGLang and
vLLM shard it):
- attention: the q heads and their KV heads (qkv_proj is column-parallel: each rank its heads'
  rows), o_proj row-parallel (each rank its heads' columns; the partial outputs all-reduced);
- MLP: gate/up column-parallel (1/N of the intermediate rows), down row-parallel (all-reduced);
- embeddings, norms and the LM head are replicated (every rank computes the same logits).
A rank's model is the ordinary model class built from its *local* config (`shard_config`: its
share of the heads, KV heads and intermediate size): the attention backend, the KV pool (one
rank's KV heads, the same page ids on every rank), CUDA graphs and the fused kernels see the
local shapes and need no change. The checkpoint is sliced on the way in (`shard_checkpoint`).

KV heads that do not divide by N are replicated when N is a multiple of them (each rank keeps the
one KV head its q heads use, as vLLM does); any other split is refused by name.

Sampling runs on every rank over the same all-reduced logits with the same seeds; rank 0's ids
are then broadcast so that every rank feeds the same token next, whatever a kernel's rounding
(only rank 0 reports results).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from radix_runtime.config import ServerArgs
from radix_runtime.worker.model_config import ModelConfig, UnsupportedModel

logger = logging.getLogger(__name__)

RENDEZVOUS_FILE = "tp_rendezvous"


@dataclass(frozen=True)
class TPRank:
    """One worker's place among the tensor-parallel ranks (size 1: no tensor parallelism)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0  # among this host's ranks: its GPU index
    init_method: str = ""  # torch.distributed's rendezvous (file:// or tcp://)
    local_only: bool = True  # every rank on this host: keep the transport on loopback

    @classmethod
    def for_worker(cls, args: ServerArgs, rank: int, ipc_dir: str) -> TPRank:
        if args.tp == 1:
            return cls()
        per_node = args.tp // args.nnodes
        if args.dist_init_addr:
            init_method = f"tcp://{args.dist_init_addr}"
        else:  # one host: a file in the server's private (0700) directory, no port at all
            init_method = f"file://{os.path.join(ipc_dir, RENDEZVOUS_FILE)}"
        return cls(rank, args.tp, rank % per_node, init_method, args.nnodes == 1)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def pin(self, device: torch.device) -> torch.device:
        """This rank's device: on CUDA, the GPU of its local rank (among the visible ones)."""
        if not self.enabled or device.type != "cuda":
            return device
        torch.cuda.set_device(self.local_rank)
        return torch.device("cuda", self.local_rank)

    def join(self, device: torch.device) -> None:
        """Join the process group: NCCL on CUDA, gloo on the CPU. Returns once every rank has."""
        if not self.enabled or dist.is_initialized():  # (several runners in one test process)
            return
        if self.local_only:  # nothing but loopback for the ranks' own connections
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=self.init_method,
            rank=self.rank,
            world_size=self.size,
            # NOTE: idle ranks wait on ZeroMQ, never inside a collective, so this bounds only a
            # step whose peer stopped answering (a dead rank also ends the server at once)
            timeout=datetime.timedelta(minutes=30),
        )
        self.barrier(device)  # also creates NCCL's communicator before any graph capture
        logger.info("tensor-parallel rank %d/%d joined (%s)", self.rank, self.size, backend)

    def leave(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()

    def barrier(self, device: torch.device) -> None:
        if self.enabled:
            self.min_over_ranks(0, device)

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (e.g. the KV pages each one's memory fits)."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast_from_first(self, t: torch.Tensor) -> None:
        """In place: every rank gets rank 0's `t` (the sampled ids)."""
        if self.enabled:
            dist.broadcast(t, src=0)


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over the tensor-parallel ranks in place (a row-parallel layer's partial output)."""
    dist.all_reduce(t)
    return t


# ---------------------------------------------------------------------------------------------
# each rank's share of the model


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The local config of one of `size` ranks: its q heads, KV heads and intermediate columns.
    Raises UnsupportedModel (by name) for a split the shapes do not allow."""
    if size == 1:
        return config
    heads, kv, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
    if heads % size:
        raise UnsupportedModel(f"{heads} attention heads do not divide over --tp {size}")
    if kv % size and size % kv:
        raise UnsupportedModel(
            f"{kv} KV heads over --tp {size}: neither divides the other (KV heads are split "
            "when --tp divides them and replicated when --tp is a multiple of them)"
        )
    if inter % size:
        raise UnsupportedModel(f"intermediate size {inter} does not divide over --tp {size}")
    return dataclasses.replace(
        config,
        num_heads=heads // size,
        num_kv_heads=max(1, kv // size),
        intermediate_size=inter // size,
        tp_size=size,
    )


def kv_heads_of(config: ModelConfig, rank: int, size: int) -> range:
    """The global KV heads rank `rank` keeps: its 1/size, or the one its q heads read when the
    KV heads are replicated (size a multiple of them)."""
    kv = config.num_kv_heads
    if kv % size == 0:
        n = kv // size
        return range(rank * n, (rank + 1) * n)
    head = rank // (size // kv)
    return range(head, head + 1)


def shard_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig, rank: int, size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors (HF names, or our fused qkv_proj / gate_up_proj) -> this rank's slices
    under the same names, for `model.load_weights` of the model built from `shard_config`.
    `config` is the full model's."""
    if size == 1:
        yield from weights
        return
    d = config.head_dim
    q_heads = config.num_heads // size
    q_rows = slice(rank * q_heads * d, (rank + 1) * q_heads * d)
    kv_heads = kv_heads_of(config, rank, size)
    kv_rows = slice(kv_heads.start * d, kv_heads.stop * d)
    inter = config.intermediate_size // size
    i_rows = slice(rank * inter, (rank + 1) * inter)
    q_size, kv_size = config.q_size, config.kv_size
    for name, t in weights:
        if ".q_proj." in name:
            t = t[q_rows]
        elif ".k_proj." in name or ".v_proj." in name:
            t = t[kv_rows]
        elif ".qkv_proj." in name:  # already fused (the GGUF conversion cache, dummy weights)
            q, k, v = t.split([q_size, kv_size, kv_size])
            t = torch.cat([q[q_rows], k[kv_rows], v[kv_rows]])
        elif ".gate_proj." in name or ".up_proj." in name:
            t = t[i_rows]
        elif ".gate_up_proj." in name:
            gate, up = t.chunk(2)
            t = torch.cat([gate[i_rows], up[i_rows]])
        elif ".o_proj.weight" in name:
            t = t[:, q_rows]
        elif ".down_proj.weight" in name:
            t = t[:, i_rows]
        elif name.endswith((".o_proj.bias", ".down_proj.bias")) and rank > 0:
            # NOTE: a row-parallel bias is added once: rank 0's partial output carries it
            t = torch.zeros_like(t)
        yield name, t.contiguous()
