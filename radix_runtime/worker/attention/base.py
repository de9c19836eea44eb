"""The attention-backend interface: plan once per batch, run per layer.

The runner builds one `AttentionMetadata` per forward step (the paged layout of every request
in the batch, in the CSR form FlashInfer uses), calls `backend.plan(meta)` once, and then each
layer calls `backend.forward(layer_id, q, k, v, kv_pool)`, which stores the new K/V into their
pages and returns the attention output. Backends keep whatever they derive in `plan` (gather
indices, masks, FlashInfer wrapper state) until the next `plan`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from radix_runtime.worker.kernels.config import KernelConfig
from radix_runtime.worker.kv_pool import KVPool


@dataclass
class AttentionMetadata:
    """The paged layout of one batch. B requests, N new tokens in total.

    Request i owns new tokens ``[qo_indptr[i], qo_indptr[i+1])`` of the flattened batch, at
    positions ``[prefix_lens[i], seq_lens[i])``. Its KV after this step spans ``seq_lens[i]``
    tokens in the pages ``kv_page_indices[kv_indptr[i]:kv_indptr[i+1]]``, the last of which holds
    ``kv_last_page_len[i]`` tokens.

    Host (numpy) copies come with the device tensors so a backend can plan without a device
    sync; the device tensors are int32 except the int64 index tensors used by torch indexing.
    """

    page_size: int
    num_tokens: int
    # host copies
    qo_indptr_cpu: np.ndarray  # [B+1] int32
    kv_indptr_cpu: np.ndarray  # [B+1] int32
    kv_page_indices_cpu: np.ndarray  # [total pages] int32
    kv_last_page_len_cpu: np.ndarray  # [B] int32
    prefix_lens_cpu: np.ndarray  # [B] int32: tokens already cached before this step
    seq_lens_cpu: np.ndarray  # [B] int32: prefix + new tokens
    input_ids_cpu: np.ndarray  # [N] int64
    positions_cpu: np.ndarray  # [N] int64
    out_cache_loc_cpu: np.ndarray  # [N] int64
    # device tensors
    qo_indptr: torch.Tensor  # [B+1] int32
    kv_indptr: torch.Tensor  # [B+1] int32
    kv_page_indices: torch.Tensor  # [total pages] int32
    kv_last_page_len: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32
    positions: torch.Tensor  # [N] int64: absolute position of each new token
    out_cache_loc: torch.Tensor  # [N] int64: flat pool location where each new token's K/V go

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def qo_lens_cpu(self) -> np.ndarray:
        return np.diff(self.qo_indptr_cpu)

    @property
    def is_decode_only(self) -> bool:
        """Every request feeds exactly one token (the shape CUDA graphs capture)."""
        return self.num_tokens == self.batch_size


class AttentionBackend(ABC):
    """One instance per runner. Heads are [num_heads | num_kv_heads] x head_dim; GQA is allowed."""

    name: str = "base"
    supports_cuda_graph = False  # True: has init_cuda_graph_state / plan_cuda_graph
    # True: has init_extend_graph_state / plan_extend_graph (graphs of prefill/mixed batches)
    supports_extend_graph = False

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        *,
        scale: float | None = None,
        layer_windows: tuple[int, ...] | None = None,
        kernels: KernelConfig | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.device = device
        # per layer: how many keys (itself included) a query sees, 0 = all (ModelConfig's
        # layer_windows); None when no layer is windowed
        self.layer_windows = tuple(layer_windows) if layer_windows and any(layer_windows) else None
        # the runner's kernel choices (the FlashInfer backend reads triton_decode_max_bs)
        self.kernels = kernels or KernelConfig()

    def window(self, layer_id: int) -> int:
        """Layer `layer_id`'s window (0: the whole sequence)."""
        return 0 if self.layer_windows is None else self.layer_windows[layer_id]

    def windows(self) -> list[int]:
        """The distinct windows of all layers (0 = full), each planned once per batch."""
        return sorted(set(self.layer_windows)) if self.layer_windows else [0]

    def bind_pool(self, kv_pool: KVPool) -> None:
        """Called once, after the runner allocated the pool (dtype, page size are known then)."""
        self.kv_dtype = kv_pool.dtype

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare everything that is the same for all layers of this batch."""

    @abstractmethod
    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_pool: KVPool,
    ) -> torch.Tensor:
        """q [N, num_heads, head_dim], k/v [N, num_kv_heads, head_dim] -> out [N, num_heads, head_dim].

        Stores k/v at `meta.out_cache_loc` of layer `layer_id` first, so each new token attends
        to the cached prefix, the earlier tokens of its own chunk, and itself (causal).
        """
