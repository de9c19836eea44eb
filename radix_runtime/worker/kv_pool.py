"""The paged KV pool: per layer, K and V of shape [num_pages, page_size, kv_heads, head_dim].

Page 0 is reserved: the scheduler never hands it out, so backends may use it as padding.
A token's *cache location* is ``page * page_size + offset``: an index into the flat
[num_pages * page_size, kv_heads, head_dim] view of a layer's buffer.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

CPU_POOL_MEMORY_FRACTION = 0.2  # of available RAM
CPU_POOL_MAX_TOKENS = 65536
# on CUDA, room left for activations, logits and CUDA graphs after the static fraction
CUDA_ACTIVATION_HEADROOM_BYTES = 2 << 30


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (page 0 is reserved)")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        shape = (num_pages, page_size, kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def num_slots(self) -> int:
        """Token locations in the pool, page 0 included."""
        return self.num_pages * self.page_size

    def k_flat(self, layer_id: int) -> torch.Tensor:
        return self.k_buffers[layer_id].view(self.num_slots, self.kv_heads, self.head_dim)

    def v_flat(self, layer_id: int) -> torch.Tensor:
        return self.v_buffers[layer_id].view(self.num_slots, self.kv_heads, self.head_dim)

    def store(
        self, layer_id: int, cache_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write K/V of shape [n, kv_heads, head_dim] at the flat locations `cache_loc` [n]."""
        # index_copy_: the same copy as `flat[cache_loc] = k`, without advanced indexing's setup
        self.k_flat(layer_id).index_copy_(0, cache_loc, k.to(self.dtype))
        self.v_flat(layer_id).index_copy_(0, cache_loc, v.to(self.dtype))

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def available_cpu_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes); falls back to total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def pool_tokens_from_memory(
    device: torch.device, bytes_per_token: int, mem_fraction_static: float
) -> int:
    """How many tokens of KV fit, when --max-total-tokens is not given.

    CPU: min(20% of available RAM, 64K tokens) — the CPU path serves a small model, and a
    larger pool only slows start-up. CUDA: like SGLang, everything free beyond
    (1 - mem_fraction_static) of the card (measured after the weights are loaded), minus a
    fixed headroom for activations.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - total * (1.0 - mem_fraction_static) - CUDA_ACTIVATION_HEADROOM_BYTES
        tokens = int(budget // bytes_per_token)
    else:
        budget = available_cpu_memory() * CPU_POOL_MEMORY_FRACTION
        tokens = min(int(budget // bytes_per_token), CPU_POOL_MAX_TOKENS)
    if tokens <= 0:
        raise RuntimeError(
            f"no memory left for the KV cache on {device} (budget {budget / 2**30:.2f} GiB); "
            "lower --max-total-tokens or raise --mem-fraction-static"
        )
    return tokens


def num_pages_for(
    max_total_tokens: int | None,
    page_size: int,
    device: torch.device,
    bytes_per_token: int,
    mem_fraction_static: float,
) -> int:
    """Pages in the pool including the reserved page 0."""
    tokens = max_total_tokens
    if tokens is None:
        tokens = pool_tokens_from_memory(device, bytes_per_token, mem_fraction_static)
        logger.info("KV pool sized from memory: %d tokens", tokens)
    return max(tokens // page_size, 1) + 1
