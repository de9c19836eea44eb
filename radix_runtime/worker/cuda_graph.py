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
from dataclasses import dataclass

import numpy as np
import torch

from radix_runtime.worker.attention.base import AttentionBackend, AttentionMetadata
from radix_runtime.worker.host_copy import upload
from radix_runtime.worker.kv_pool import KVPool

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 to 64, every 16 to 128, every 32 beyond; max_bs always included."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, 129, 16), *range(160, max_bs + 1, 32)]
    sizes = sorted({s for s in sizes if s <= max_bs} | {max_bs})
    return sizes


def capture(run, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A graph of `run()` (its output tensor with it), sharing the memory pool `pool`. Two
    warm-up runs on a side stream first: Triton compiles, cuBLAS picks kernels and workspaces."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = run()
    return graph, output


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
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        reserved = torch.cuda.memory_reserved(device)
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
        # device memory the capture added (the graphs' pool, the attention state's buffers)
        self.memory_bytes = torch.cuda.memory_reserved(device) - reserved
        logger.info(
            "captured %d CUDA graphs (batch sizes %d..%d) in %.1fs, %.2f GiB",
            len(self.batch_sizes), self.batch_sizes[0], self.max_bs, self.capture_s,
            self.memory_bytes / 2**30,
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
        self.graphs[bs], self.outputs[bs] = capture(lambda: self._run_model(bs), pool)
        return self.graphs[bs].pool()

    def replay(
        self, meta: AttentionMetadata, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run a decode-only batch of B <= max_bs rows; returns float32 logits [B, vocab], a view
        into the graph's output buffer (valid until the next replay). `input_ids` (device, [B]):
        the token ids, when the host does not know them all (the overlap schedule's
        from_last_sample rows); else they come from `meta.input_ids_cpu`."""
        b = meta.batch_size
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, b)]
        pad = bs - b
        host = np.zeros((3, self.max_bs), dtype=np.int64)  # padding: token 0, position 0, loc 0
        if input_ids is None:
            host[0, :b] = meta.input_ids_cpu
        host[1, :b] = meta.positions_cpu
        host[2, :b] = meta.out_cache_loc_cpu
        upload(self.inputs, host)  # stream order: after the previous step's graph read them
        if input_ids is not None:
            self.inputs[0, :b].copy_(input_ids)
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


# ---------------------------------------------------------------------------------------------
# prefill / mixed batches


def extend_token_sizes(max_tokens: int) -> list[int]:
    """64, 128, 192, 256, 384, 512, then doubling; max_tokens always included (0: none).
    Padding wastes at most half a step's tokens, and below ~200 tokens an 8B step costs about
    the same at any row count (it streams the weights)."""
    if max_tokens <= 0:
        return []
    sizes, t = [64, 128, 192, 256, 384], 512
    while t < max_tokens:
        sizes.append(t)
        t *= 2
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


EXTEND_REQ_SIZES = (1, 2, 4, 8, 16, 32, 48, 64)  # requests per captured graph


def pick_extend_shape(
    req_sizes: list[int], token_sizes: list[int], num_reqs: int, num_tokens: int
) -> tuple[int, int] | None:
    """The captured (requests, tokens) shape for a batch: the fewest requests >= num_reqs, then
    the fewest tokens that leave each padding request one; None when nothing holds the batch."""
    for bs in req_sizes:
        if bs >= num_reqs:
            i = bisect.bisect_left(token_sizes, num_tokens + bs - num_reqs)
            return (bs, token_sizes[i]) if i < len(token_sizes) else None
    return None


@dataclass
class PaddedExtend:
    """A prefill/mixed batch padded to a captured (bs, tokens) shape (host arrays)."""

    input_ids: np.ndarray  # [tokens]
    positions: np.ndarray  # [tokens]
    out_cache_loc: np.ndarray  # [tokens]: padding tokens write into page 0
    qo_indptr: np.ndarray  # [bs + 1] int32
    kv_indptr: np.ndarray  # [bs + 1] int32, counting the pages padding rows read
    kv_last_page_len: np.ndarray  # [bs] int32
    rows: np.ndarray  # [bs]: the row whose logits each request gets (its last real one)
    num_pad_pages: int  # page ids past the real ones that padding rows read


def pad_extend_batch(
    qo_lens: np.ndarray,
    seq_lens: np.ndarray,
    input_ids: np.ndarray,
    positions: np.ndarray,
    out_cache_loc: np.ndarray,
    bs: int,
    tokens: int,
    page_size: int,
) -> PaddedExtend:
    """bs - b padding requests of one token each (token 0 at position 0); the tokens still
    missing extend the last request, padding or real, at the positions after its own."""
    qo_lens, kv_lens = qo_lens.astype(np.int64), seq_lens.astype(np.int64)
    b, n = len(qo_lens), int(qo_lens.sum())
    extra = tokens - n - (bs - b)
    if b > bs or extra < 0:
        raise ValueError(f"{b} requests of {n} tokens do not fit the shape ({bs}, {tokens})")
    real_rows = np.cumsum(qo_lens) - 1
    qo_lens = np.concatenate([qo_lens, np.ones(bs - b, np.int64)])
    kv_lens = np.concatenate([kv_lens, np.ones(bs - b, np.int64)])
    real_pages = int((-(-kv_lens[:b] // page_size)).sum())
    pad_pos = np.concatenate([np.zeros(bs - b, np.int64), kv_lens[-1] + np.arange(extra)])
    qo_lens[-1] += extra
    kv_lens[-1] += extra
    pages = -(-kv_lens // page_size)
    return PaddedExtend(
        input_ids=np.concatenate([input_ids, np.zeros(tokens - n, np.int64)]),
        positions=np.concatenate([positions, pad_pos]),
        out_cache_loc=np.concatenate([out_cache_loc, pad_pos % page_size]),
        qo_indptr=np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32),
        kv_indptr=np.concatenate([[0], np.cumsum(pages)]).astype(np.int32),
        kv_last_page_len=(kv_lens - (pages - 1) * page_size).astype(np.int32),
        rows=np.concatenate([real_rows, n + np.arange(bs - b)]),
        num_pad_pages=int(pages.sum()) - real_pages,
    )


class ExtendGraphRunner:
    """CUDA graphs for batches that hold prefill chunks (alone or mixed with decodes).

    An eager forward of a small prefill is bound by the host (hundreds of Python-launched kernels
    and FlashInfer calls, ~0.5 ms per layer), not by the GPU; a graph replays them for the GPU
    time alone. Each graph covers `bs` requests and `tokens` rows, one (requests, tokens) pair per
    captured shape. A batch of b requests and n tokens runs in the smallest shape with bs >= b
    and tokens >= n + (bs - b): bs - b padding requests of one token each, and the tokens still
    missing appended to the last request (padding or real: causal attention keeps a real
    request's rows blind to tokens after them). Like the decode graphs' padding rows, padding
    tokens read stale-but-valid page ids, write their K/V into the reserved page 0, and their
    logits are dropped. Logits come out for each request's last real row only, so a batch that
    wants prompt logprobs (every row) runs eagerly.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        attn: AttentionBackend,
        kv_pool: KVPool,
        max_tokens: int,
        max_reqs: int,
        max_pages_per_slot: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.attn = attn
        self.page_size = kv_pool.page_size
        self.kv_pool = kv_pool
        self.token_sizes = extend_token_sizes(max_tokens)
        self.req_sizes = [s for s in EXTEND_REQ_SIZES if s <= max_reqs] or [1]
        self.max_tokens, self.max_reqs = self.token_sizes[-1], self.req_sizes[-1]
        t, b = self.max_tokens, self.max_reqs
        # token ids, positions, KV locations (t each), logit rows (b): one host->device copy
        self.flat = torch.zeros(3 * t + b, dtype=torch.int64, device=device)
        self.ids, self.positions, self.locs = (
            self.flat[:t],
            self.flat[t : 2 * t],
            self.flat[2 * t : 3 * t],
        )
        self.rows = self.flat[3 * t :]
        attn.init_extend_graph_state(b, b * max_pages_per_slot + t)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.replays = 0
        t0 = time.perf_counter()
        pool = None
        for tokens in reversed(self.token_sizes):
            for bs in reversed(self.req_sizes):
                if tokens >= bs:
                    pool = self._capture(bs, tokens, pool)
        self.capture_s = time.perf_counter() - t0
        logger.info(
            "captured %d prefill CUDA graphs (%s tokens x %s requests) in %.1fs",
            len(self.graphs), self.token_sizes, self.req_sizes, self.capture_s,
        )  # fmt: skip

    def _run_model(self, bs: int, tokens: int) -> torch.Tensor:
        hidden = self.model(self.ids[:tokens], self.positions[:tokens], self.attn, self.kv_pool)
        return self.model.compute_logits(hidden[self.rows[:bs]])

    def _plan(
        self,
        meta: AttentionMetadata | None,
        bs: int,
        tokens: int,
        input_ids: torch.Tensor | None = None,
    ) -> None:
        """Pad the batch (None: nothing but padding, for the capture) to (bs, tokens), fill the
        input buffers with one copy (then the real token ids from `input_ids` when given, a
        device tensor) and plan the attention for the shape."""
        t = self.max_tokens
        if meta is None:
            empty = np.zeros(0, np.int64)
            pad = pad_extend_batch(empty, empty, empty, empty, empty, bs, tokens, self.page_size)
            indices = self.flat.new_zeros(0, dtype=torch.int32)
        else:
            pad = pad_extend_batch(
                np.diff(meta.qo_indptr_cpu), meta.seq_lens_cpu, meta.input_ids_cpu,
                meta.positions_cpu, meta.out_cache_loc_cpu, bs, tokens, self.page_size,
            )  # fmt: skip
            indices = meta.kv_page_indices
        host = np.zeros(3 * t + self.max_reqs, np.int64)
        host[:tokens], host[t : t + tokens] = pad.input_ids, pad.positions
        host[2 * t : 2 * t + tokens], host[3 * t : 3 * t + bs] = pad.out_cache_loc, pad.rows
        upload(self.flat, host)
        if input_ids is not None and meta is not None:
            self.ids[: meta.num_tokens].copy_(input_ids)
        # the pages past the real ones (padding, extension) are whatever the shared index
        # buffer holds there: stale but valid ids, only read, by rows whose outputs are dropped
        self.attn.plan_extend_graph(
            pad.qo_indptr, pad.kv_indptr, indices, pad.kv_last_page_len, self.locs[:tokens]
        )

    @torch.inference_mode()
    def _capture(self, bs: int, tokens: int, pool):
        self._plan(None, bs, tokens)
        shape = (bs, tokens)
        self.graphs[shape], self.outputs[shape] = capture(lambda: self._run_model(*shape), pool)
        return self.graphs[shape].pool()

    def replay(
        self, meta: AttentionMetadata, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """float32 logits [B, vocab] of each request's last row (a view into the graph's output,
        valid until the next replay), or None when no captured shape holds the batch.
        `input_ids` (device, [N]): the token ids when the host does not know them all."""
        shape = pick_extend_shape(
            self.req_sizes, self.token_sizes, meta.batch_size, meta.num_tokens
        )
        if shape is None:
            return None
        self._plan(meta, *shape, input_ids)
        self.graphs[shape].replay()
        self.replays += 1
        return self.outputs[shape][: meta.batch_size]
