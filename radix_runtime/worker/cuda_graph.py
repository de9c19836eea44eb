"""CUDA graphs for decode steps: one graph per batch size in a fixed set, a batch padded to the
next size up.

A decode step of a small batch is a few hundred tiny kernels whose launch cost would exceed the
time the GPU needs to stream the weights; a graph replays them with no CPU launch in between.
Each graph covers embedding -> layers -> final norm -> LM head over `bs` rows, reading fixed
input buffers (token ids, positions, KV locations) that `replay` fills before launching it.
Attention metadata is planned outside the graph, into the fixed index buffers the attention
backend's per-size wrapper reads. Sampling stays outside: it is per-request Python logic.

Padding rows feed token 0 at position 0 and write their K/V into the reserved page 0, which is
never handed to a request; they read one token of a stale (valid) page id; their logits are
dropped. So they can change nothing real.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from radix_runtime.worker.attention.base import AttentionBackend, AttentionMetadata
from radix_runtime.worker.kv_pool import KVPool

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 to 64, every 16 to 128, every 32 beyond; max_bs always included."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, 129, 16), *range(160, max_bs + 1, 32)]
    sizes = sorted({s for s in sizes if s <= max_bs} | {max_bs})
    return sizes


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        attn: AttentionBackend,
        kv_pool: KVPool,
        max_bs: int,
        max_pages_per_slot: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.attn = attn
        self.kv_pool = kv_pool
        self.page_size = kv_pool.page_size
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        # rows: token ids, positions, KV write locations; one host->device copy fills all three
        self.inputs = torch.zeros((3, self.max_bs), dtype=torch.int64, device=device)
        attn.init_cuda_graph_state(self.max_bs, self.max_bs * max_pages_per_slot)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        t0 = time.perf_counter()
        pool = None
        for bs in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its memory
            pool = self._capture(bs, pool)
        self.capture_s = time.perf_counter() - t0
        logger.info(
            "captured %d CUDA graphs (batch sizes %d..%d) in %.1fs",
            len(self.batch_sizes), self.batch_sizes[0], self.max_bs, self.capture_s,
        )  # fmt: skip

    def can_run(self, meta: AttentionMetadata) -> bool:
        return meta.is_decode_only and meta.batch_size <= self.max_bs

    def _run_model(self, bs: int) -> torch.Tensor:
        ids, positions = self.inputs[0, :bs], self.inputs[1, :bs]
        hidden = self.model(ids, positions, self.attn, self.kv_pool)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self, bs: int, pool):
        self.inputs[:, :bs] = 0
        self.attn.plan_cuda_graph(
            bs,
            np.arange(bs + 1, dtype=np.int32),
            torch.zeros(bs, dtype=torch.int32, device=self.inputs.device),
            np.ones(bs, dtype=np.int32),
            self.inputs[2, :bs],
        )
        # warm up outside the graph (Triton compiles, cuBLAS picks its kernels and workspaces)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run_model(bs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs[bs] = self._run_model(bs)
        self.graphs[bs] = graph
        return graph.pool()

    def replay(self, meta: AttentionMetadata, input_ids: np.ndarray) -> torch.Tensor:
        """Run a decode-only batch of B <= max_bs rows; returns float32 logits [B, vocab], a view
        into the graph's output buffer (valid until the next replay)."""
        b = meta.batch_size
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, b)]
        pad = bs - b
        ps = self.page_size
        positions = meta.seq_lens_cpu.astype(np.int64) - 1
        last_pages = meta.kv_page_indices_cpu[meta.kv_indptr_cpu[1:] - 1].astype(np.int64)
        host = np.zeros((3, bs), dtype=np.int64)  # padding rows: token 0, position 0, location 0
        host[0, :b] = input_ids
        host[1, :b] = positions
        host[2, :b] = last_pages * ps + positions % ps
        self.inputs[:, :bs].copy_(torch.from_numpy(host))
        kv_indptr = meta.kv_indptr_cpu
        last_page_len = meta.kv_last_page_len_cpu
        if pad:  # each padding row: one token of one page
            kv_indptr = np.concatenate([kv_indptr, kv_indptr[-1] + np.arange(1, pad + 1)])
            last_page_len = np.concatenate([last_page_len, np.ones(pad, np.int32)])
        # the padding rows' page ids are whatever the index buffer holds past the real ones:
        # stale but valid pages, only read (their outputs are dropped, their K/V go to page 0)
        self.attn.plan_cuda_graph(
            bs,
            kv_indptr.astype(np.int32),
            meta.kv_page_indices,
            last_page_len.astype(np.int32),
            self.inputs[2, :bs],
        )
        self.graphs[bs].replay()
        return self.outputs[bs][:b]
