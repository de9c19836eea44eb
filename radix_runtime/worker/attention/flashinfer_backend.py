"""The FlashInfer attention backend: the CUDA path (bf16/fp16).

Plan once per batch, run per layer, straight over the paged pool (FlashInfer's NHD layout is the
pool's: per layer K and V of [num_pages, page_size, kv_heads, head_dim]):

- a batch holding any prefill chunk goes through one `BatchPrefillWithPagedKVCacheWrapper`
  (causal, bottom-right aligned: each new token sees the cached prefix pages plus the tokens
  of its own chunk up to itself; decode rows of a mixed batch are just chunks of length 1).
  The new K/V are written into their pages first, so prefix and chunk are one paged read;
  a ragged pass over the chunk plus a merge with the prefix would save that write-then-read,
  but bench/gpu_kernels.py measures the difference and it is small next to the matmuls;
- a decode-only batch goes through `BatchDecodeWithPagedKVCacheWrapper` (tensor cores when a
  KV head serves >= 4 query heads, as for Llama-3-8B, where they are faster), except batches of
  <= `KernelConfig.triton_decode_max_bs` requests: those take the Triton split-KV kernel
  (`kernels/decode_attention.py`, ~2x faster at batch 1, and no plan: the device index arrays are
  all it reads);
- CUDA graphs (cuda_graph.py) get one decode wrapper per captured batch size, built with
  `use_cuda_graph=True` over fixed index buffers shared by all sizes; `plan_cuda_graph` refills
  those buffers before each replay;
- graphs of small prefill/mixed batches (`ExtendGraphRunner`) get one prefill wrapper per
  captured (requests, tokens) shape, in CUDA-graph mode (fixed batch size and row count, the
  schedule written into the wrapper's own workspace by `plan_extend_graph`).

New K/V are written with the Triton kernel `kernels/kv_store.py` (one launch for K and V).

An FP8 pool (`--kv-cache-dtype fp8_e4m3`): `store_kv` writes x / scale in e4m3. FlashInfer
0.5.3's kernels for a bf16 query over FP8 KV failed on the H200 (a CUDA "operation not supported
on global/shared address space" error from the FA2 prefill path), so FP8 stays out of FlashInfer:
every decode batch (any size, graphed or not) runs the Triton split-KV kernel, which widens the FP8
rows in registers (K scale folded into the softmax scale, V scale applied to the output); a
prefill or mixed batch first gathers the batch's pages of each layer into a bf16 scratch
(`index_select`, times the layer's scales) and runs the ordinary bf16 prefill wrapper over it,
planned on page ids 0..P-1 of that scratch. New tokens are stored before the gather, so every
query sees its own K/V FP8-rounded, as later decode steps and cached prefixes do. Graphs of
prefill batches are off with an FP8 pool (their fixed buffers assume the pool's page ids).

Sliding-window layers (Mistral, Gemma 3's local layers): every wrapper above exists once per
distinct window of the model (0 = full attention), planned with FlashInfer's `window_left`
(window - 1: the keys a query sees besides itself); each layer runs the wrapper of its window.
The Triton decode kernel takes the window as an argument and starts its split-KV loop at the
window's first key. Each window's wrappers have their own pinned host buffers and scratch, so
the wait before a plan (see `_plan`) is per window. A windowed model runs every FlashInfer call
on one kernel module, FA2 prefill with the sliding-window mask (`window_left` of a full layer is
`FULL_WINDOW_LEFT`, beyond any context; decode on tensor cores, which is the same module):
FlashInfer compiles each (backend, head_dim, window) variant on first use, ~1 minute each, and
the ahead-of-time set has no windowed ones.
"""

from __future__ import annotations

import flashinfer
import numpy as np
import torch

from radix_runtime.worker.attention.base import AttentionBackend, AttentionMetadata
from radix_runtime.worker.host_copy import upload
from radix_runtime.worker.kernels.decode_attention import decode_attention
from radix_runtime.worker.kernels.kv_store import store_kv
from radix_runtime.worker.kv_pool import KVPool

# FlashInfer's scratch space for split-KV partial results, shared by every wrapper (one runs at
# a time); SGLang uses the same order of size
WORKSPACE_BYTES = 256 << 20
# window_left of a full-attention layer in a windowed model: larger than any context, so the
# sliding-window kernel variant masks nothing
FULL_WINDOW_LEFT = 1 << 24


def use_tensor_cores(num_heads: int, num_kv_heads: int) -> bool:
    """Decode on tensor cores when each KV head serves >= 4 query heads (SGLang's rule)."""
    return num_heads // num_kv_heads >= 4


def _gather(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """cache[pages] of an FP8 pool, gathered as bytes (index kernels need not know FP8)."""
    return cache.view(torch.uint8).index_select(0, pages).view(cache.dtype)


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graph = True
    supports_extend_graph = True
    # FlashInfer implementation of the graphed prefill wrappers (FA3 on Hopper: no split-KV pass
    # whose presence could differ between capture and replay)
    extend_graph_backend = "auto"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        **options,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, device, **options)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.tensor_cores = use_tensor_cores(num_heads, num_kv_heads)
        self._prefill_backend = "auto"
        if self.layer_windows is not None:  # one kernel module for everything (see the top)
            self.tensor_cores = True
            self._prefill_backend = self.extend_graph_backend = "fa2"
            # NOTE: FA2's graphed prefill fails on the H200 (cudaErrorInvalidAddressSpace in the
            # capture's warm-up run; FA2 may add a split-KV pass that FA3 never has), so a
            # windowed model's prefill steps run eagerly; its decode steps are still graphed
            self.supports_extend_graph = False
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=self._prefill_backend
        )
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.tensor_cores
        )
        # the eager wrappers of each sliding window (window 0 is the pair above)
        self._window_wrappers = {
            w: (
                flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    self.workspace, "NHD", backend=self._prefill_backend
                ),
                flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_tensor_cores=self.tensor_cores
                ),
            )
            for w in self.windows()
            if w
        }
        self.kv_dtype: torch.dtype | None = None  # the pool's, known once bound
        self.q_dtype: torch.dtype | None = None  # the model's (differs from kv_dtype for FP8)
        self.fp8 = False
        self.k_scales: list[float] = []
        self.v_scales: list[float] = []
        self.page_size = 1
        self._active: dict[int, object] = {}  # per window, the wrapper planned for this batch
        # per window: recorded after each plan's copies out of FlashInfer's pinned host
        # buffers; the window's next plan waits for it before it writes them again (see _plan)
        self._plan_copied: dict[int, torch.cuda.Event] = {}
        # or, for a small decode batch, the Triton kernel's index arrays (device tensors)
        self._small_decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # an FP8 pool's prefill batch: its page ids, gathered into bf16 scratch per layer
        self._gather_pages: torch.Tensor | None = None
        self._out_cache_loc: torch.Tensor | None = None
        # CUDA graphs: fixed index buffers and one decode wrapper per captured batch size
        self._graph_wrappers: dict[int, flashinfer.BatchDecodeWithPagedKVCacheWrapper] = {}
        self._graph_kv_indptr: torch.Tensor | None = None
        self._graph_kv_indices: torch.Tensor | None = None
        self._graph_kv_last_page_len: torch.Tensor | None = None
        # graphs of prefill/mixed batches: one prefill wrapper per (requests, tokens) shape
        # keyed by (requests, tokens, window)
        self._extend_wrappers: dict[
            tuple[int, int, int], flashinfer.BatchPrefillWithPagedKVCacheWrapper
        ] = {}
        self._extend_bufs: dict[str, torch.Tensor] = {}

    def bind_pool(self, kv_pool: KVPool) -> None:
        if kv_pool.act_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the flashinfer backend needs fp16 or bf16, not {kv_pool.act_dtype}")
        super().bind_pool(kv_pool)
        self.q_dtype = kv_pool.act_dtype
        self.page_size = kv_pool.page_size
        self.k_scales, self.v_scales = kv_pool.k_scales, kv_pool.v_scales
        self.fp8 = kv_pool.is_fp8
        if self.fp8:  # (see the top) FlashInfer runs over bf16 scratch pages only
            self.kv_dtype = self.q_dtype
            self.supports_extend_graph = False

    # ------------------------------------------------------------------------------------------
    # eager batches

    def plan(self, meta: AttentionMetadata) -> None:
        self._out_cache_loc = meta.out_cache_loc
        self._small_decode = None
        self._gather_pages = None
        if meta.is_decode_only and (
            meta.batch_size <= self.kernels.triton_decode_max_bs or self.fp8
        ):
            self._small_decode = (meta.kv_indptr, meta.kv_page_indices, meta.kv_last_page_len)
            return
        page_ids = meta.kv_page_indices
        if self.fp8:  # the scratch holds the batch's pages in page-table order
            self._gather_pages = meta.kv_page_indices.long()
            page_ids = torch.arange(len(page_ids), dtype=torch.int32, device=page_ids.device)
        kv_indptr = torch.from_numpy(meta.kv_indptr_cpu)
        last_page_len = torch.from_numpy(meta.kv_last_page_len_cpu)
        for w in self.windows():
            prefill, decode = self._window_wrappers[w] if w else (self._prefill, self._decode)
            if meta.is_decode_only:
                self._plan(decode, kv_indptr, meta.kv_page_indices, last_page_len, window=w)
            else:
                self._plan(
                    prefill,
                    torch.from_numpy(meta.qo_indptr_cpu),
                    kv_indptr,
                    page_ids,
                    last_page_len,
                    causal=True,
                    window=w,
                )

    def _plan(self, wrapper, *indices: torch.Tensor, window: int = 0, **extra) -> None:
        """Plan `wrapper` (prefill: qo_indptr, kv_indptr, kv_indices, last_page_len and
        causal=True; decode: the last three) over the pool: host index arrays, device page ids.

        A plan writes the schedule into a pinned host buffer and queues its copy to the device
        without waiting. With the overlap schedule the next step is planned while the device may
        not have run the previous copy yet, and graphed wrappers of one size (or all the prefill
        ones, which share scratch) reuse the same pinned buffer: so each plan first waits for the
        previous plan's copies (in practice long done: the step before was collected); the
        wrappers of another window have buffers of their own, so only `window`'s are waited on.
        """
        copied = self._plan_copied.get(window)
        if copied is not None:
            copied.synchronize()
        wrapper.plan(
            *indices,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.page_size,
            sm_scale=self.scale,
            q_data_type=self.q_dtype,
            kv_data_type=self.kv_dtype,
            window_left=self._window_left(window),
            **extra,
        )
        self._active[window] = wrapper
        if self.device.type == "cuda":
            self._plan_copied[window] = torch.cuda.Event()
            self._plan_copied[window].record()

    def _window_left(self, window: int) -> int:
        if self.layer_windows is None:
            return -1
        return window - 1 if window else FULL_WINDOW_LEFT

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_pool: KVPool,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_pool.k_buffers[layer_id], kv_pool.v_buffers[layer_id]
        ks, vs = self.k_scales[layer_id], self.v_scales[layer_id]
        pdl = self.kernels.use_pdl()  # (a kernel launched after these waits for them as usual)
        store_kv(k_cache, v_cache, self._out_cache_loc, k, v, ks, vs, pdl=pdl)
        window = self.window(layer_id)
        if self._small_decode is not None:
            return decode_attention(
                q, k_cache, v_cache, *self._small_decode, self.scale, window=window,
                k_scale=ks, v_scale=vs, pdl=pdl,
            )  # fmt: skip
        if self._gather_pages is not None:  # an FP8 pool: this batch's pages in bf16
            k_cache = _gather(k_cache, self._gather_pages).to(q.dtype) * ks
            v_cache = _gather(v_cache, self._gather_pages).to(q.dtype) * vs
        return self._active[window].run(q.contiguous(), (k_cache, v_cache))

    # ------------------------------------------------------------------------------------------
    # CUDA graphs (decode only)

    def init_cuda_graph_state(self, max_bs: int, max_pages: int) -> None:
        """Index buffers that every captured size reads: kv_indices holds up to `max_pages`."""
        self._graph_kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self._graph_kv_indices = torch.zeros(max_pages, dtype=torch.int32, device=self.device)
        self._graph_kv_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=self.device)

    def plan_cuda_graph(
        self,
        bs: int,
        kv_indptr: np.ndarray,
        kv_indices: torch.Tensor,
        kv_last_page_len: np.ndarray,
        out_cache_loc: torch.Tensor,
    ) -> None:
        """Plan the size-`bs` graph wrapper (indptr / last page lengths padded to `bs` rows,
        page ids on the device); the layers then write K/V at `out_cache_loc`, a fixed buffer
        the graph reads."""
        self._out_cache_loc = out_cache_loc
        self._gather_pages = None
        if (
            bs <= self.kernels.triton_decode_max_bs or self.fp8
        ):  # Triton reads the buffers themselves
            n = len(kv_indices)
            upload(self._graph_kv_indptr[: bs + 1], kv_indptr)
            upload(self._graph_kv_last_page_len[:bs], kv_last_page_len)
            self._graph_kv_indices[:n].copy_(kv_indices, non_blocking=True)
            self._small_decode = (
                self._graph_kv_indptr[: bs + 1],
                self._graph_kv_indices,
                self._graph_kv_last_page_len[:bs],
            )
            return
        self._small_decode = None
        self._gather_pages = None
        for w in self.windows():
            key = bs if w == 0 else (bs, w)  # window 0 keeps the plain key (bench/ reads it)
            wrapper = self._graph_wrappers.get(key)
            if wrapper is None:
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace,
                    "NHD",
                    use_cuda_graph=True,
                    use_tensor_cores=self.tensor_cores,
                    paged_kv_indptr_buffer=self._graph_kv_indptr[: bs + 1],
                    paged_kv_indices_buffer=self._graph_kv_indices,
                    paged_kv_last_page_len_buffer=self._graph_kv_last_page_len[:bs],
                )
                self._graph_wrappers[key] = wrapper
            self._plan(
                wrapper,
                torch.from_numpy(kv_indptr),
                kv_indices,
                torch.from_numpy(kv_last_page_len),
                window=w,
            )

    # ------------------------------------------------------------------------------------------
    # CUDA graphs of prefill / mixed batches

    def init_extend_graph_state(self, max_reqs: int, max_pages: int) -> None:
        """Index buffers every graphed prefill wrapper reads (each takes its shape's prefix)."""
        i32 = dict(dtype=torch.int32, device=self.device)
        self._extend_bufs = {
            "qo_indptr": torch.zeros(max_reqs + 1, **i32),
            "kv_indptr": torch.zeros(max_reqs + 1, **i32),
            "kv_indices": torch.zeros(max_pages, **i32),
            "last_page_len": torch.ones(max_reqs, **i32),
        }

    # a wrapper's own scratch: plan() fills it, run() (the graph) reads it. Plans and replays are
    # queued in step order on one stream and a plan waits for the previous plan's host copies
    # (_plan), so every graphed wrapper can use the first one's: ~80 MB each otherwise
    # (FlashInfer 0.5.3 sizes them for 16M KV entries)
    _SCRATCH = (
        "_int_workspace_buffer",
        "_pin_memory_int_workspace_buffer",
        "_kv_lens_buffer",
        "_vector_sparse_indices_buffer",
        "_vector_sparse_indptr_buffer",
    )

    def _share_scratch(self, wrapper, window: int) -> None:
        """Within one window only: two windows' wrappers are planned in the same step."""
        first = next((x for k, x in self._extend_wrappers.items() if k[2] == window), None)
        if first is not None:
            for name in self._SCRATCH:
                if getattr(wrapper, name, None) is not None:
                    setattr(wrapper, name, getattr(first, name))

    def plan_extend_graph(
        self,
        qo_indptr: np.ndarray,
        kv_indptr: np.ndarray,
        kv_indices: torch.Tensor,
        kv_last_page_len: np.ndarray,
        out_cache_loc: torch.Tensor,
    ) -> None:
        """Plan the wrapper of shape (len(qo_indptr) - 1 requests, qo_indptr[-1] tokens): host
        arrays already padded to that shape, page ids on the device. The first plan of a shape
        (at capture) fixes its row count; later plans must match it exactly."""
        bs, tokens = len(qo_indptr) - 1, int(qo_indptr[-1])
        self._small_decode = None
        for w in self.windows():
            wrapper = self._extend_wrappers.get((bs, tokens, w))
            if wrapper is None:
                b = self._extend_bufs
                wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    self.workspace,
                    "NHD",
                    use_cuda_graph=True,
                    qo_indptr_buf=b["qo_indptr"][: bs + 1],
                    paged_kv_indptr_buf=b["kv_indptr"][: bs + 1],
                    paged_kv_indices_buf=b["kv_indices"],
                    paged_kv_last_page_len_buf=b["last_page_len"][:bs],
                    backend=self.extend_graph_backend,
                )
                self._share_scratch(wrapper, w)
                self._extend_wrappers[(bs, tokens, w)] = wrapper
            self._plan(
                wrapper,
                torch.from_numpy(qo_indptr),
                torch.from_numpy(kv_indptr),
                kv_indices,
                torch.from_numpy(kv_last_page_len),
                causal=True,
                disable_split_kv=True,  # FA2: the same kernels at every replay
                window=w,
            )
        self._out_cache_loc = out_cache_loc
